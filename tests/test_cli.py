"""`megatron-zb` CLI: simulate contract, compare, plot, and error paths (exit 2, one line, no traceback)."""
import json
import subprocess
import sys

import pytest

from megatron_zb.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_simulate_json_contract(capsys):
    rc, out, err = run(capsys, "simulate", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--json")
    assert rc == 0
    d = json.loads(out)
    for k in ("schedule", "stages", "microbatches", "makespan", "bubble_rate", "peak_memory"):
        assert k in d
    assert d["makespan"] == 27 and d["schedule"] == "zb-h1" and len(d["peak_memory"]) == 4


def test_simulate_costs_lists(capsys):
    rc, out, _ = run(capsys, "simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--cost-f", "1",
                     "--cost-b", "2", "--cost-w", "1", "--cost-comm", "0", "--mem-f", "2", "--mem-w", "1", "--json")
    d = json.loads(out)
    assert d["makespan"] == 44 and d["peak_memory"][0] == 8
    rc, out, _ = run(capsys, "simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--cost-f", "2,1,1,2", "--json")
    assert json.loads(out)["cost_f"] == [2, 1, 1, 2]


def test_compare_table(capsys):
    rc, out, _ = run(capsys, "compare", "-p", "4", "-m", "8")
    assert rc == 0 and "zb-h2" in out and "speed-up" in out
    rc, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--json", "--memory-limit", "4")
    rows = json.loads(out)["rows"]
    assert rows[0]["fits"] and {r["schedule"] for r in rows} >= {"1f1b", "zb-h1", "zb-h2"}
    assert next(r for r in rows if r["schedule"] == "zb-h2")["fits"] is False


def test_save_and_load(tmp_path, capsys):
    for ext in ("json", "csv"):
        f = tmp_path / f"s.{ext}"
        assert run(capsys, "simulate", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--save", str(f))[0] == 0
        rc, out, _ = run(capsys, "simulate", "--load", str(f), "--json")
        assert rc == 0 and json.loads(out)["makespan"] == 24


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--schedule", "nope", "-p", "4", "-m", "8"], "known schedules: gpipe, 1f1b"),
    (["simulate", "--schedule", "1f1b", "-p", "0", "-m", "8"], "--stages must be an integer >= 1"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "0"], "--microbatches must be an integer >= 1"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--cost-f", "-1"], "non-negative"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--cost-b", "x"], "must be a number"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--cost-f", "1,2"], "one per stage"),
    (["simulate", "--schedule", "gpipe-v", "-p", "4", "-m", "8", "--chunks", "3"], "uses 2 chunk(s)"),
    (["simulate", "--schedule", "interleaved-1f1b", "-p", "4", "-m", "8", "--chunks", "1"], "needs --chunks >= 2"),
    (["simulate", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--memory-limit", "3"], "over --memory-limit 3"),
    (["compare", "-p", "4", "-m", "8", "--memory-limit", "0.5"], "no schedule fits"),
    (["simulate", "--schedule", "1f1b", "-p", "4"], "required"),
    (["simulate", "--load", "/nonexistent.json"], "no such file"),
    (["plot", "--schedule", "1f1b", "-p", "2", "-m", "2", "--out", "x.gif"], "use .png, .svg"),
    (["frobnicate"], "invalid choice"),
    (["plan", "--model", "llama-3-8b", "--pipeline-parallel-size", "8", "--offload-ratio", "auto"],
     "--offload-ratio needs the host link it copies over: give --host-link-gbps"),
    (["plan", "--model", "llama-3-8b", "--pipeline-parallel-size", "8", "--host-link-gbps", "50"],
     "need --offload-ratio R (0..1) or auto"),
])
def test_errors(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_no_traceback():
    p = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zz", "-p", "2", "-m", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_simulate_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "from megatron_zb.cli import main; sys.exit(main(['compare', '-p', '4', '-m', '8']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def _saved(tmp_path, capsys, name="zb-h1", p=4, m=8):
    f = tmp_path / f"{name}.json"
    assert run(capsys, "simulate", "--schedule", name, "-p", str(p), "-m", str(m), "--save", str(f))[0] == 0
    return f


def test_load_checks_stages_and_microbatches(tmp_path, capsys):
    f = _saved(tmp_path, capsys)
    rc, out, err = run(capsys, "simulate", "--load", str(f), "--stages", "3", "--microbatches", "5")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "holds 4 pipeline ranks, 8 microbatches" in err and "not --stages 3, --microbatches 5" in err
    rc, _, err = run(capsys, "simulate", "--load", str(f), "--chunks", "2")
    assert rc == 2 and "not --chunks 2" in err
    assert run(capsys, "simulate", "--load", str(f), "--stages", "4", "--microbatches", "8")[0] == 0


def test_load_names_the_broken_rank_and_position(tmp_path, capsys):
    f = _saved(tmp_path, capsys)
    d = json.loads(f.read_text())
    last = d["orders"][3]  # the last rank: its first B moved before its F
    i = next(i for i, a in enumerate(last) if a[0] == "B")
    last.insert(0, last.pop(i))
    f.write_text(json.dumps(d))
    rc, _, err = run(capsys, "simulate", "--load", str(f))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "F3.0 at rank 3 position 1 comes too late: rank 3 position 0 (B3.0) waits for it" in err


@pytest.mark.timing
def test_unreasonable_size_refused_at_once(capsys):
    import time
    t = time.process_time()  # CPU time: the work done before refusing, however busy the host is
    rc, _, err = run(capsys, "simulate", "--schedule", "1f1b", "--stages", "100000", "--microbatches", "8")
    assert rc == 2 and "more than the simulator handles in a few seconds" in err
    rc, _, err = run(capsys, "plan", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--seq-length", "32", "--pipeline-parallel-size", "4", "--num-microbatches", "1000000")
    assert rc == 2 and "--num-microbatches 1000000" in err
    assert time.process_time() - t < 2.0
