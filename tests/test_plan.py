"""`megatron-zb plan`: FLOP and memory model, ranking, profile input, errors."""
import json

import pytest

from megatron_zb.cli import main
from megatron_zb.core import plan as P
from megatron_zb.core.ir import ScheduleError

ARGS = ["plan", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
        "--pipeline-parallel-size", "4", "--num-microbatches", "16"]


def test_formulas():
    spec = P.ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, micro_batch_size=2)
    f, b, w = spec.layer_flops()
    s, h, bb = 512, 1024, 2
    assert f == bb * s * h * (24 * h + 4 * s) and b == bb * s * h * (24 * h + 8 * s) and w == 24 * bb * s * h * h
    m_b, m_w = P.ModelSpec(4, 1024, 16, 512, 2, flash_attention=False).layer_activation_bytes()
    assert m_b == s * bb * (34 * h + 5 * 16 * s) and m_w == 32 * s * bb * h
    assert P.layer_split(14, 4, pad_ends=True) == [3, 4, 4, 3]


def test_plan_table_and_json(capsys):
    assert main(ARGS + ["--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "zb-v" in out and "--zero-bubble-schedule" in out
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if "schedule" in l and "iteration ms" in l)
    assert all(w in lines[head] for w in ("bubble", "vs 1f1b", "act GiB", "peak GiB", "fits"))
    assert all(w in lines[head + 1] for w in ("sync", "postval", "min", "max", "on rank"))
    # one ready-to-paste line for the best schedule that fits, then the others aligned
    i = next(i for i, l in enumerate(lines) if l.startswith("suggested flags ("))
    assert lines[i + 1].strip().startswith("--pipeline-model-parallel-size 4 --zero-bubble-schedule ")
    assert len({l.index("--pipeline") for l in lines[i + 3:] if "--pipeline" in l}) == 1, lines[i:]
    assert main(ARGS + ["--gpu-memory-gb", "80", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for r in (r for r in d["rows"] if r.get("memory_limit_microbatches")):  # the limit's unit is said
        assert f"--zero-bubble-memory-limit {r['memory_limit_microbatches']:g}" in r["flags"]
        assert f"{r['memory_limit_microbatches']:g} x {r['activation_unit_bytes'] / 1024 ** 3:.2f} GiB" in out
    rows = [r for r in d["rows"] if "error" not in r]
    assert rows[0]["fits"] and rows[0]["throughput_vs_1f1b"] >= 1.0
    by = {r["schedule"]: r for r in rows}
    assert max(by["zb-h2"]["activation_bytes"]) > max(by["zb-h1"]["activation_bytes"])
    assert by["1f1b"]["throughput_vs_1f1b"] == 1.0
    assert by["zb-h1"]["bubble_rate"] < by["1f1b"]["bubble_rate"]


def test_small_budget_marks_what_does_not_fit(capsys):
    assert main(ARGS + ["--gpu-memory-gb", "3", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r]
    assert any(not r["fits"] for r in rows)
    assert all(r["fits"] for r in rows[: sum(r["fits"] for r in rows)])  # fitting ones first


def test_profile_costs(tmp_path, capsys):
    prof = {"cost_f": [1.0, 1, 1, 1.5], "cost_b": [1.0, 1, 1, 2], "cost_w": 0.8, "cost_comm": 0.01}
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(prof))
    assert main(ARGS + ["--profile", str(f), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["costs_from"] == "profile"
    one = next(r for r in d["rows"] if r["schedule"] == "1f1b")
    assert one["makespan_s"] == pytest.approx(16 * 4.5 + 3 * (4.5) + 6 * 0.01, rel=0.2)


def test_errors(capsys):
    assert main(["plan", "--num-layers", "4", "--hidden-size", "100", "--num-attention-heads", "3", "--seq-length", "8",
                 "--pipeline-parallel-size", "2", "--num-microbatches", "4"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(ARGS[:-4] + ["--pipeline-parallel-size", "1", "--num-microbatches", "4"]) == 2
    assert ">= 2" in capsys.readouterr().err
    with pytest.raises(ScheduleError, match="lacks cost_b"):
        P._profile_costs({"cost_f": [1, 1]}, 2)


def test_plan_help_documents_every_option_and_column(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    from megatron_zb.cli import build_parser
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    for action in plan._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings[0]} has no help text"
    for col in ("iteration ms", "sync", "postval", "bubble", "vs 1f1b", "act GiB", "peak GiB", "fits", "microbatches"):
        assert col in text
