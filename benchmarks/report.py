"""Generate ``docs/results.md`` from the benchmark results in ``benchmarks/results/``.

    python benchmarks/report.py            # writes docs/results.md
    python benchmarks/report.py --check    # exit 1, one line naming what differs, when docs/results.md
                                           # is not exactly what the JSON gives; exit 0 when it is
    python benchmarks/report.py --results DIR --out FILE [--check]

Every ``*.json`` under the results folder (its subfolders too, e.g. ``gpu_check_h200/``) is read. Each
section of the page (``report_sections.py``, ``report_sections_more.py``, ``report_sections_memory.py``; the
GPU check's realpipe table:
``report_sections_gpu.py``) claims files by name pattern
and renders headline tables (medians with their spread where the JSON has samples), each under the
command that wrote its file and the machine kind it ran on. A file no section claims, one whose shape
its section does not know, or one that is not valid JSON goes to the page's last section, "Other
results" (its name and top-level keys): a new benchmark file never breaks ``--check``, it only changes
the page, which is then regenerated. The output is deterministic: files sorted, fixed number formats,
no timestamps, dates or commit hashes.

Command and machine kind: taken from the JSON's own fields where it records them (``command``; a
split-overhead run's ``config`` and ``device``; the GPU check's ``env`` section; ``cpus`` / ``cores``),
else from ``KNOWN``, an explicit table below of file name -> (command, machine kind) for the files
that record neither (written from each benchmark script's usage and the commits that added the file).

Headline figures: ``headline(results_dir)`` returns the few figures README may quote, as an ordered
dict of label -> value (both strings, exactly as the page's "Headline figures" table prints them)::

    sys.path.insert(0, "benchmarks"); import report
    for label, value in report.headline().items():
        assert f"| {label} | {value} |" in open("docs/results.md").read()

so a test can check that README quotes the same strings as the page. Pure Python (standard library).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys

import report_sections
import report_sections_memory
import report_sections_more
from report_sections import label, table, times

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_RESULTS = os.path.join(HERE, "results")
DEFAULT_OUT = os.path.join(ROOT, "docs", "results.md")

_CPU2 = "2-core CPU"
_BENCH = "python benchmarks/"
_PLAN_CMDS = _BENCH + "bench_plan_speed.py --commands"
# file name -> (command, machine kind), for the files whose JSON records neither (None: derived from
# the JSON's own fields). Written from each script's usage and the commit that added the file.
KNOWN = (
    ("split_overhead.json", None, _CPU2 + ", 1 thread"),
    ("split_overhead_gaf.json", None, _CPU2 + ", 1 thread"),
    ("split_overhead_h100host_cpu.json", None, "16-core CPU of the H100 machine, 1 thread"),
    ("split_overhead_h100_cuda_h1024_s512.json", None, "H100"),
    ("split_overhead_h100_cuda_h4096_s4096.json", None, "H100"),
    ("fbw_h100_h2048_s2048.json", None, "H100"),
    ("fbw_h100_h4096_s4096.json", None, "H100"),
    ("gpu_check_h200/memory_traces_before_fix.json",
     _BENCH + "gpu_memory_traces.py OUTDIR (before the runtime.p2p send-list fix)", "H200"),
    ("gpu_check_h200/memory_traces_after_fix.json", _BENCH + "gpu_memory_traces.py OUTDIR", "H200"),
    ("runtime_fidelity.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_runtime_fidelity.py", _CPU2),
    ("runtime_fidelity_16core.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_runtime_fidelity.py "
     "--out benchmarks/results/runtime_fidelity_16core.json", "16-core CPU"),
    ("runtime_fidelity_field.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_runtime_fidelity.py --pp 4 2 "
     "--schedules 1f1b interleaved-1f1b bitpipe zeropp interleaved-zb zb-v "
     "--out benchmarks/results/runtime_fidelity_field.json", _CPU2),
    ("runtime_fidelity_iterations.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_runtime_fidelity.py "
     "--iteration-model --pp 4 --iterations 10", _CPU2),
    ("schedules.json", _BENCH + "bench_schedules.py --md docs/schedules.md", _CPU2),
    ("simulator.json", _BENCH + "bench_simulator.py", _CPU2),
    ("exact.json", _BENCH + "bench_exact.py", _CPU2),
    ("field.json", _BENCH + "bench_field.py --md docs/field_tables.md", _CPU2),
    ("bitpipe_vs_authors.json", _BENCH + "bench_bitpipe_authors.py /path/to/BitPipe --random 300", _CPU2),
    ("vs_authors.json", _BENCH + "bench_vs_authors.py /path/to/zero-bubble-pipeline-parallelism "
     "(rows re-run with --append --reuse-theirs)", _CPU2),
    ("offload.json", None, _CPU2),
    ("offload_table5.json", None, _CPU2),
    ("v_families.json", None, _CPU2),
    ("optimizer_offload.json", _BENCH + "bench_optimizer_offload.py", _CPU2),
    ("memory.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_memory.py", _CPU2),
    ("moe_overlap.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_moe_overlap.py", _CPU2),
    ("moe_recompute.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_moe_recompute.py", _CPU2),
    ("varlen.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_varlen.py --figures benchmarks/results/figures", _CPU2),
    ("varlen_emulated_unit1.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_varlen.py --distributions lognormal "
     "--settings 8x4 --unit 1.0 --emulate-batches 1 --iterations 1 "
     "--out benchmarks/results/varlen_emulated_unit1.json", _CPU2),
    ("varlen_emulated_unit1_sharegpt.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_varlen.py --distributions "
     "sharegpt --settings 8x4 --unit 1.0 --emulate-batches 1 --iterations 1 "
     "--out benchmarks/results/varlen_emulated_unit1_sharegpt.json", _CPU2),
    ("vocab_emulated.json", None, _CPU2),
    ("vocab_paper.json", None, _CPU2),
    ("vocab_paper_split.json", None, _CPU2),
    ("plan_speed.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_plan_speed.py --sizes 8:32 --modes off both",
     _CPU2),
    ("plan_speed_commands.json", _PLAN_CMDS + " --repeat 3", _CPU2),
    ("plan_speed_commands_jobs2.json", _PLAN_CMDS + " --repeat 3 --jobs 2 "
     "--out benchmarks/results/plan_speed_commands_jobs2.json", _CPU2),
    ("plan_speed_commands_before.json", "megatron-zb plan ... --json under /usr/bin/time, on a checkout from "
     "before plan's quick first pass (every row searched in full)", _CPU2),
    ("plan_speed_commands_before_coded_embedding.json", _PLAN_CMDS + " --out benchmarks/results/"
     "plan_speed_commands_before_coded_embedding.json, on a checkout from before the coded embedding passes",
     _CPU2),
    ("plan_speed_commands_merged_p8.json", _PLAN_CMDS + " --sizes 8:32 --search quick full "
     "--out benchmarks/results/plan_speed_commands_merged_p8.json", _CPU2),
    ("plan_search_gaps.json", _BENCH + "bench_plan_speed.py --gaps", _CPU2),
    ("faults.json", "OMP_NUM_THREADS=1 MZB_MCORE=0.19.2 " + _BENCH + "bench_faults.py --trials 3 "
     "--scenarios stop kill launcher", _CPU2),
    ("test_figures.json", "OMP_NUM_THREADS=1 " + _BENCH + "bench_test_figures.py", _CPU2),
)

# bench_split_overhead.py's defaults: a recorded config differing from them becomes an argument
_SPLIT_DEFAULTS = (("hidden", 1024), ("heads", 16), ("seq", 512), ("batch", 1), ("reps", 7), ("warmup", 2),
                   ("dtype", "fp32"))


def _split_command(name, d):
    """The bench_split_overhead.py command line a split-overhead JSON records (config and device)."""
    c = d["config"]
    args = [] if d.get("device", "cpu") == "cpu" else ["--device", d["device"]]
    for key, default in _SPLIT_DEFAULTS:
        if c.get(key, default) != default:
            args += [f"--{key}", str(c[key])]
    if c.get("ffn") and c["ffn"] != 4 * c["hidden"]:
        args += ["--ffn", str(c["ffn"])]
    if c.get("gradient_accumulation_fusion"):
        args.append("--gaf")
    if os.path.basename(name) != "split_overhead.json":
        args += ["--out", f"benchmarks/results/{name}"]
    return " ".join([_BENCH + "bench_split_overhead.py"] + args)


def _machine(d):
    """The machine kind a JSON records itself (the GPU check's env section, a CPU count), or None."""
    if not isinstance(d, dict):
        return None
    env = d.get("sections", {}).get("env", {}) if isinstance(d.get("sections"), dict) else {}
    figures = env.get("figures", {}) if isinstance(env, dict) else {}
    gpu = figures.get("gpu") if isinstance(figures, dict) else None
    if isinstance(gpu, str):
        return gpu.replace("NVIDIA ", "")
    cpus = d.get("cpus") or d.get("cores")
    return f"{cpus}-core CPU" if isinstance(cpus, int) else None


def source(name, d):
    """(command, machine kind) of one result file: from its own fields, else from ``KNOWN``."""
    known = {n: (c, m) for n, c, m in KNOWN}.get(name, (None, None))
    command = d.get("command") if isinstance(d, dict) else None
    if not isinstance(command, str) and isinstance(d, dict) and d.get("benchmark") == "split_overhead":
        command = _split_command(name, d)
    command = (command if isinstance(command, str) else known[0]) or "command not recorded"
    return command.strip(), _machine(d) or known[1] or "machine not recorded"


def load_results(results_dir):
    """Every ``*.json`` under ``results_dir`` (sorted paths relative to it) -> (parsed, unreadable)."""
    res, bad = {}, {}
    for top, dirs, files in os.walk(results_dir):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".json"):
                path = os.path.join(top, f)
                name = os.path.relpath(path, results_dir).replace(os.sep, "/")
                try:
                    with open(path, encoding="utf-8") as fh:
                        res[name] = json.load(fh)
                except (OSError, ValueError):
                    bad[name] = "not valid JSON"
    return dict(sorted(res.items())), bad


SHAPE_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError, StopIteration)


def _fbw_headline(out, d, machine):
    c, m = d["config"], d["median_s"]
    dtype = c.get("dtype", "fp32")
    key = f"B+W over the fused backward, one layer, {machine}, {dtype}, h{c['hidden']} s{c['seq']}"
    fbw = " / ".join(report_sections.ms(m[k]) for k in ("f", "b", "w"))
    out[key] = f"{times(d['ratio_b_plus_w_over_fused'])} (F / B / W {fbw} ms)"


def _fbw_headlines(res, out):
    """B+W over the fused backward per recorded layer shape (fbw_*.json)."""
    for n in (n for n in res if fnmatch.fnmatch(n, "fbw_*.json")):
        _fbw_headline(out, res[n], source(n, res[n])[1])


def _gpu_fbw_headlines(res, out):
    """The same from the latest GPU check run whose fbw section passed."""
    runs = sorted((n for n in res if fnmatch.fnmatch(n, "gpu_check*/run*_gpu_check.json")),
                  key=lambda n: (n.rsplit("/", 1)[0], report_sections.run_number(n)))
    good = [n for n in runs if res[n]["sections"].get("fbw", {}).get("status") == "ok"]
    if good:
        for r in res[good[-1]]["sections"]["fbw"]["figures"]["runs"]:
            _fbw_headline(out, r, f"{source(good[-1], res[good[-1]])[1]} (GPU check)")


def _fidelity_headlines(res, out):
    """Runtime fidelity on the idle 16-core host, and zb-v's emulated speed-up over 1F1B there."""
    name = "runtime_fidelity_16core.json"
    if name not in res:
        return
    d = res[name]
    s, machine = d["summary"], source(name, d)[1]
    out[f"runtime fidelity, sleeping passes on gloo processes, {machine}"] = (
        f"{s['within_5pct']} of {s['cases']} cases within 5% of the simulator "
        f"(median {s['median_abs_error_pct']:.1f}%)")
    for r in d["rows"]:
        if (r["schedule"], r["p"], r["m"], r["costs"], r.get("chunks")) == ("zb-v", 4, 8, "F=B=W=20", None):
            out[f"zb-v over 1F1B, emulated compute, P=4 M=8 F=B=W, {machine}"] = (
                f"{times(r['speedup_measured'])} measured, {times(r['speedup_simulated'])} simulated")


def _authors_headlines(res, out):
    """Our automatic schedulers against the authors' (vs_authors.json)."""
    for part in res.get("vs_authors.json", {}).values():
        c = part["counts"]
        out[f"{part['schedule']} against the authors' scheduler, {sum(c.values())} settings"] = (
            f"worse {c['worse']}, equal {c['equal']}, better {c['better']}")


def _optimizer_headlines(res, out):
    """Trough optimizer offload's speed-up (optimizer_offload.json)."""
    if "optimizer_offload.json" in res:
        d = res["optimizer_offload.json"]
        h = d["headline"]
        out[f"{h['fastest_only_with_trough']} with optimizer states in the troughs over the best that fits "
            f"without, {d['model']} (simulated)"] = times(h["speedup"])


def _headline(res):
    """label -> value of every headline figure the files give (a file of another shape gives none)."""
    out = {}
    for part in (_fbw_headlines, _gpu_fbw_headlines, _fidelity_headlines, _authors_headlines,
                 _optimizer_headlines):
        try:
            part(res, out)
        except SHAPE_ERRORS:
            pass
    return out


def headline(results_dir=DEFAULT_RESULTS):
    """The few headline figures README may quote: an ordered dict label -> value, as the page prints them."""
    return _headline(load_results(results_dir)[0])


def _shown(path):
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel.replace(os.sep, "/")


def _top_level(d):
    """A JSON document's top-level keys, or what it is when it is not an object."""
    if isinstance(d, dict):
        return ", ".join(map(str, d))
    return f"a list of {len(d)} items" if isinstance(d, list) else f"a {type(d).__name__}"


def _other_rows(res, bad, unknown):
    """The "Other results" rows: unreadable files and files no section could render, sorted."""
    rows = [[f"`{n}`", why, ""] for n, why in bad.items()]
    return sorted(rows + [[f"`{n}`", why, _top_level(res[n])] for n, why in unknown.items()])


def _claims(res, sections):
    """Which part of which section reads each file: exact names first, then patterns, in order."""
    parts = [(i, j, pattern) for i, (_, _, ps) in enumerate(sections) for j, (pattern, _) in enumerate(ps)]
    claims = {}
    for exact in (True, False):
        for i, j, pattern in parts:
            alternatives = pattern.split("|")
            if all(any(c in p for c in "*?[") != exact for p in alternatives):
                for n in res:
                    if n not in claims and any(fnmatch.fnmatch(n, p) for p in alternatives):
                        claims[n] = (i, j)
    return claims


def _sections(res):
    """(section lines, files no section could render: name -> why)."""

    def src(name):
        return source(name, res[name])

    sections = report_sections.SECTIONS + report_sections_more.SECTIONS + report_sections_memory.SECTIONS
    claims, unknown, body = _claims(res, sections), {}, []
    for i, (title, blurb, parts) in enumerate(sections):
        lines = []
        for j, (_, block) in enumerate(parts):
            names = [n for n in res if claims.get(n) == (i, j)]
            if not names:
                continue
            try:
                lines += block(res, names, src) + [""]
            except SHAPE_ERRORS:
                unknown.update((n, f"a shape the section '{title}' does not know") for n in names)
        if lines:
            body += [f"## {title}", "", blurb, ""] + lines
    unknown.update((n, "no section reads it") for n in res if n not in claims)
    return body, unknown


def render(results_dir=DEFAULT_RESULTS):
    """The page's markdown text from the JSON under ``results_dir``."""
    res, bad = load_results(results_dir)
    body, unknown = _sections(res)
    heads = _headline(res)
    page = ["# Benchmark results", "",
            f"This page is generated by `python benchmarks/report.py` from the JSON files in "
            f"`{_shown(results_dir)}/`; do not edit it by hand (`python benchmarks/report.py --check` fails "
            "when it differs from what the JSON gives). Each table names the command that wrote its file "
            "and the kind of machine it ran on; \"simulated\" figures come from the schedule core's simulator, "
            "\"emulated\" ones from real processes whose passes wait their cost instead of computing.", ""]
    if heads:
        page += ["## Headline figures", "", "The figures README quotes (`report.headline()`), each from a table "
                 "below.", ""] + table(["figure", "value"], list(heads.items())) + [""]
    page += body
    others = _other_rows(res, bad, unknown)
    if others:
        page += ["## Other results", "", "Files the sections above do not read (name and top-level keys):", ""]
        page += table(["file", "why", "top-level keys"], others) + [""]
    return "\n".join(page).rstrip("\n") + "\n"


def _first_difference(want, have):
    """One line naming where ``have`` first differs from ``want``: line, section, both texts (cut short)."""
    a, b = want.splitlines(), have.splitlines()
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            section = next((ln[3:] for ln in reversed(a[:i + 1]) if ln.startswith("## ")), "the top")
            expected = a[i][:60] if i < len(a) else "(end of page)"
            found = b[i][:60] if i < len(b) else "(end of page)"
            return f"line {i + 1} (section '{section}'): expected {expected!r}, found {found!r}"
    return "the line endings"


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate docs/results.md from benchmarks/results/*.json.")
    ap.add_argument("--results", default=DEFAULT_RESULTS,
                    help="folder of result JSON (default benchmarks/results)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="the page (default docs/results.md)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is not what the JSON gives")
    a = ap.parse_args(argv)
    text = render(a.results)
    if a.check:
        if not os.path.exists(a.out):
            print(f"report: {_shown(a.out)} is missing; run python benchmarks/report.py")
            return 1
        with open(a.out, encoding="utf-8") as fh:
            have = fh.read()
        if have != text:
            print(f"report: {_shown(a.out)} differs from what {_shown(a.results)} gives at "
                  f"{_first_difference(text, have)}; run python benchmarks/report.py")
            return 1
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"report: wrote {_shown(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
