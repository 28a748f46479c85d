"""`megatron-zb compare/simulate/plan --seq-lengths FILE --data-parallel-size D`: variable-length
batches, Megatron's sequential microbatches against the balanced ones; bad input is one line and
exit code 2."""
import json
import math
import random

import pytest

from megatron_zb.cli import main
from megatron_zb.core.varlen.seqlens import format_seq_lengths


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    rng = random.Random(5)
    batches = [[max(16, min(4096, int(rng.lognormvariate(math.log(400), 1.0)))) for _ in range(32)] for _ in range(2)]
    path = tmp_path_factory.mktemp("varlen") / "lengths.txt"
    path.write_text(format_seq_lengths(batches))
    return str(path)


def test_compare_json_rows(capsys, lengths_file):
    rc, out, err = run(capsys, "compare", "-p", "4", "--seq-lengths", lengths_file, "--data-parallel-size", "2",
                       "--cost-f", "20", "--cost-b", "30", "--cost-w", "15", "--seq-length", "4096",
                       "--attention-share", "0.15", "--schedules", "1f1b", "zb-h1", "--json")
    assert rc == 0, err
    d = json.loads(out)
    rows = {(r["schedule"], r["balanced"]): r for r in d["rows"]}
    assert set(rows) == {("1f1b", False), ("1f1b", True), ("zb-h1", False), ("zb-h1", True)}
    for r in rows.values():
        assert r["iteration_time_s"] == pytest.approx(r["iteration_time"] * 1e-3)
        assert len(r["batches"]) == 2 and len(r["peak_memory"]) == 4
    assert rows[("1f1b", False)]["speedup_vs_megatron_1f1b"] == 1.0
    assert rows[("zb-h1", True)]["iteration_time"] < rows[("zb-h1", False)]["iteration_time"]
    assert rows[("zb-h1", True)]["speedup_vs_unbalanced"] > 1.0
    assert all(sum(b["microbatches_per_replica"]) == 32 for b in rows[("zb-h1", True)]["batches"])
    rc, out, _ = run(capsys, "compare", "-p", "4", "--seq-lengths", lengths_file, "--data-parallel-size", "2",
                     "--schedules", "zb-h1")
    assert rc == 0 and "vs Megatron 1F1B" in out and "zb-h1" in out


def test_simulate_json_and_text(capsys, lengths_file):
    rc, out, err = run(capsys, "simulate", "--schedule", "zb-h1", "-p", "4", "--seq-lengths", lengths_file,
                       "--data-parallel-size", "2", "--balance-microbatches", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["balanced"] and d["data_parallel_size"] == 2 and len(d["batches"]) == 2
    assert d["iteration_time"] == pytest.approx(sum(b["iteration_time"] for b in d["batches"]) / 2, rel=1e-6)
    for k in ("makespan", "bubble_rate", "peak_memory", "iteration_time_post_validated"):
        assert k in d
    rc, out, _ = run(capsys, "simulate", "--schedule", "1f1b", "-p", "4", "--seq-lengths", lengths_file,
                     "--data-parallel-size", "2")
    assert rc == 0 and "Megatron's sequential microbatches" in out


@pytest.mark.parametrize("argv, match", [
    (["simulate", "--schedule", "1f1b", "-p", "4", "--data-parallel-size", "2"], "give --seq-lengths"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--seq-lengths", "@"], "--microbatches comes from"),
    (["compare", "-p", "4", "--seq-lengths", "/nonexistent/x.txt"], "no such file"),
    (["compare", "-p", "4", "--seq-lengths", "@", "--offload-ratio", "0.5"], "cannot be combined with --offload-ratio"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "--seq-lengths", "@", "--data-parallel-size", "3"],
     "multiple of 3"),
    (["compare", "-p", "4", "--seq-lengths", "@", "--max-tokens", "100"], "give --pack-sequences"),
])
def test_bad_input_is_one_line(capsys, lengths_file, argv, match):
    argv = [lengths_file if a == "@" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1


def test_bad_lengths_file(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n7\nx\n")
    rc, _, err = run(capsys, "compare", "-p", "2", "--seq-lengths", str(bad))
    assert rc == 2 and "line 3: 'x' is not a sequence length" in err
