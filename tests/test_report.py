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


def _realpipe_run():
    """A GPU check run as gpu_check.py writes it, with a realpipe section (figures as
    gpu_check_realpipe.evaluate makes them): P=2 every case measured, P=4 one skipped for time."""
    def case(name, meas, sim, sp_m, sp_s, peak, pred):
        return {"case": name, "measured_s": meas, "simulated_s": sim, "error_pct": 100 * (meas / sim - 1),
                "speedup_measured": sp_m, "speedup_simulated": sp_s, "peak_bytes": peak, "predicted_peak_bytes": pred}
    gib = 2 ** 30
    p2 = [case("megatron-1f1b", 0.110, 0.1118, 1.0, 1.0, [3.2 * gib, 2.1 * gib], [1.0 * gib, 0.5 * gib]),
          case("zb-v", 0.095, 0.0934, 0.110 / 0.095, 0.1118 / 0.0934, [3.1 * gib, 3.0 * gib], [gib, gib])]
    p4 = [case("megatron-1f1b", 0.50, 0.49, 1.0, 1.0, [5 * gib] * 4, [2 * gib] * 4),
          {"case": "zb-v+offload0.5", "skipped": "9 s left, the last case took 12 s"}]
    runs = [{"p": 2, "m": 4, "green": {"num_sms": 64, "total_sms": 132, "device": 0}, "error": None,
             "probe": {"concurrency": 1.92, "share_speed": 0.49, "backward_ratio": 1.01}, "cases": p2},
            {"p": 4, "m": 8, "green": {"num_sms": 32, "total_sms": 132, "device": 0}, "error": None,
             "probe": {"concurrency": 3.7, "share_speed": 0.25, "backward_ratio": 1.0}, "cases": p4}]
    rows = [{"what": "P=2 M=4 zb-v: ms per iteration", "measured": "95.00 ms", "predicted": "simulated 93.40 ms"}]
    return {"command": "python benchmarks/gpu_check.py OUT --attention-backend flash", "ok": False, "wall_s": 410.2,
            "sections": {"env": {"status": "ok", "figures": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": []},
                         "realpipe": {"status": "failed", "rows": rows, "figures": {"runs": runs}}}}


def test_realpipe_table_from_a_gpu_check_run(tmp_path):
    results = tmp_path / "results" / "gpu_check_h100"
    results.mkdir(parents=True)
    (results / "run7_gpu_check.json").write_text(json.dumps(_realpipe_run()))
    unmeasured = _realpipe_run()
    unmeasured["sections"]["realpipe"]["figures"] = {"flop_prediction": {}}  # a dry run's: no table from it
    (results / "run8_gpu_check.json").write_text(json.dumps(unmeasured))
    page = tmp_path / "page.md"
    r = _report("--results", str(tmp_path / "results"), "--out", str(page))
    assert r.returncode == 0, r.stdout + r.stderr
    text = page.read_text()
    assert "## Other results" not in text
    assert "A real pipeline on one GPU (`gpu_check_h100/run7_gpu_check`, realpipe failed)" in text
    assert "- P=2: 64 of 132 SMs per rank; ranks at once against one at a time: concurrency 1.92 of 2" in text
    assert "| 2 | 4 | zb-v | 95.0 | 93.4 | +1.7% | 1.158x | 1.197x | 3.10 | 1.00 |" in text
    assert "| 4 | 8 | megatron-1f1b | 500.0 | 490.0 | +2.0% | 1.000x | 1.000x | 5.00 | 2.00 |" in text
    assert "| 4 | 8 | zb-v+offload0.5 | skipped: 9 s left, the last case took 12 s | - | - |" in text
    assert _report("--results", str(tmp_path / "results"), "--out", str(page), "--check").returncode == 0
