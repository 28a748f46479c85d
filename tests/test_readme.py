"""README.md is the front door: short, both commands near the top, every megatron-zb command it shows
runs as shown, its plan output is what plan prints, and README and docs/ state the present (no
dates, no commit hashes)."""
import glob
import os
import re
import shlex

import pytest

from megatron_zb.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
TEST_COMMAND = "bash scripts/run_tests.sh"


def _blocks(text: str) -> list:
    """(language, body) of every fenced code block."""
    out, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                out.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def _commands(text: str) -> list:
    """Every `megatron-zb ...` command: the lines of ```bash blocks (continuations joined) and inline
    code spans."""
    found = []
    for block in [b for lang, b in _blocks(text) if lang == "bash"]:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("megatron-zb "):
                found.append(line)
    found += [c for c in re.findall(r"`(megatron-zb [^`]+)`", text) if c not in found]
    return found


def test_readme_is_short_and_starts_with_both_commands():
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)
    head = "\n".join(lines[:30])
    assert "bash scripts/quickstart.sh" in head and TEST_COMMAND in head
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert TEST_COMMAND in ci


def test_readme_and_docs_state_the_present():
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bthis (evening|morning|afternoon)\b|\b(yesterday|last night)\b|"
                       r"\b(at|commit|main at|clones? of main at) [0-9a-f]{7,40}\b")
    hits = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for n, line in enumerate(open(path).read().splitlines(), 1):
            if dated.search(line):
                hits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_readme_shows_commands():
    names = {c.split()[1] for c in _commands(README)}
    assert {"plan", "verify", "plot", "compare"} <= names, names


@pytest.mark.parametrize("command", [c for c in _commands(README) if "--help" in c])
def test_readme_help_commands_run(command, capsys):
    with pytest.raises(SystemExit) as info:
        main(shlex.split(command)[1:])
    assert info.value.code == 0 and capsys.readouterr().out


@pytest.mark.parametrize("command", [c for c in _commands(README) if c.split()[1] in ("simulate", "compare", "plot")])
def test_readme_schedule_commands_run_as_shown(command, tmp_path, capsys):
    argv = shlex.split(command)[1:]
    if "--out" in argv:  # the pictures go to a temporary folder
        i = argv.index("--out") + 1
        while i < len(argv) and not argv[i].startswith("--"):
            argv[i] = str(tmp_path / os.path.basename(argv[i]))
            i += 1
    assert main(argv) == 0, command
    capsys.readouterr()


def test_readme_plan_output_is_what_plan_prints(capsys):
    """The plan command runs as shown, and every line of the output README shows is one it prints."""
    plans = [c for c in _commands(README) if c.split()[1] == "plan" and "--help" not in c]
    assert plans
    for command in plans:
        assert main(shlex.split(command)[1:] + ["--jobs", "1"]) == 0, command
        printed = {line.rstrip() for line in capsys.readouterr().out.splitlines()}
        shown = next(b for lang, b in _blocks(README) if "suggested flags" in b)
        missing = [line for line in shown.splitlines() if line.strip() and line.rstrip() not in printed]
        assert not missing, "README shows lines plan does not print:\n" + "\n".join(missing)


def test_readme_quotes_only_the_results_pages_headlines():
    """The figures README quotes are rows of the results page's headline table, as report.headline() gives them."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import report
        heads = report.headline()
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    section = README[README.index("## Results"):README.index("\n## ", README.index("## Results") + 5)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert rows
    page = open(os.path.join(ROOT, "docs", "results.md")).read()
    for line in rows:
        label, value = [c.strip() for c in line.strip("|").split("|")]
        assert heads.get(label) == value, line
        assert line in page, line


@pytest.mark.parametrize("command", [c for c in _commands(README) if c.split()[1] == "verify"])
def test_readme_verify_commands_dry_run(command, capsys):
    """verify's flags checked and its schedule built as shown (--dry-run: no process starts)."""
    assert main(shlex.split(command)[1:] + ["--dry-run"]) == 0, command
    assert "no process started" in capsys.readouterr().out
