"""``benchmarks/report.py`` (issue 52): ``docs/results.md`` is exactly what ``benchmarks/results/`` gives
(``--check``), a result file of a shape the report does not know lands in "Other results" instead of
breaking it, the page carries no dates or commit hashes, its headline figures are the ones
``report.headline()`` returns, and the report runs without torch."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
REPORT = os.path.join(BENCH, "report.py")
PAGE = os.path.join(ROOT, "docs", "results.md")


def _report(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, REPORT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_page_is_what_the_json_gives():
    r = _report("--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_unknown_shapes_go_to_other_results(tmp_path):
    results = tmp_path / "results"
    (results / "sub").mkdir(parents=True)
    shutil.copy(os.path.join(BENCH, "results", "faults.json"), results / "faults.json")
    (results / "new_bench.json").write_text(json.dumps({"alpha": 1, "beta": [1, 2]}))
    (results / "sub" / "listed.json").write_text(json.dumps([1, 2, 3]))
    (results / "exact.json").write_text(json.dumps({"rows": "not rows"}))   # a known name, a new shape
    (results / "optimizer_offload.json").write_text(json.dumps({"model": "m"}))  # read by the headline too
    (results / "broken.json").write_text("{not json")
    page = tmp_path / "page.md"
    r = _report("--results", str(results), "--out", str(page))
    assert r.returncode == 0, r.stdout + r.stderr
    text = page.read_text()
    assert "## Faults" in text and "| SIGKILL a rank: job over |" in text
    other = text.split("## Other results", 1)[1]
    assert "| `new_bench.json` | no section reads it | alpha, beta |" in other
    assert "| `sub/listed.json` | no section reads it | a list of 3 items |" in other
    assert "`exact.json` | a shape the section 'Exact optimum' does not know | rows |" in other
    assert "| `broken.json` | not valid JSON |" in other
    assert "`optimizer_offload.json` | a shape the section 'Optimizer offload' does not know | model |" in other
    assert "## Exact optimum" not in text
    assert _report("--results", str(results), "--out", str(page), "--check").returncode == 0
    page.write_text(text.replace("SIGKILL a rank: job over", "edited by hand"))
    r = _report("--results", str(results), "--out", str(page), "--check")
    assert r.returncode == 1
    assert len(r.stdout.strip().splitlines()) == 1 and "section 'Faults'" in r.stdout, r.stdout


def test_page_has_no_dates_or_commit_hashes():
    with open(PAGE, encoding="utf-8") as fh:
        text = fh.read()
    assert not re.search(r"\b\d{4}-\d{2}-\d{2}\b", text)
    assert not re.search(r"\b\d{2}:\d{2}(:\d{2})?\b", text)
    hexes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hexes


def test_headline_figures_are_on_the_page():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import json, report; "
            "print(json.dumps(list(report.headline().items()))); "
            "assert 'torch' not in sys.modules, 'report imported torch'")
    r = subprocess.run([sys.executable, "-c", code, BENCH], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    heads = json.loads(r.stdout)
    assert any(label.startswith("B+W over the fused backward") for label, _ in heads)
    with open(PAGE, encoding="utf-8") as fh:
        text = fh.read()
    for label, value in heads:
        assert f"| {label} | {value} |" in text
