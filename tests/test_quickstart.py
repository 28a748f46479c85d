"""The quickstart's pieces: the emulated-compute runner (real processes, real p2p, passes that
wait given F/B/W times) and the report's log reading and GPU-mode comparison."""
from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_zb.core.ir import BW, Setting
from megatron_zb.core.schedules import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import quickstart_report as report  # noqa: E402

LINE = (" [2026-11-23 20:40:01.977951] iteration        {i}/      20 | consumed samples:           16 | "
        "elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): 0.0 | learning rate: "
        "1.995070E-03 | global batch size:    16 | lm loss: {loss} | loss scale: 1.0 | grad norm: 0.645 |"
        "[Rank 2] (after 1 iterations) memory (MB) | allocated: 0.00")


@pytest.mark.dist
@pytest.mark.timing
def test_emulated_runs_follow_the_schedule_and_the_simulator():
    """The emulated runner on 2 real processes: every rank runs its schedule's passes in order (the
    recorded sequence), each pass and each iteration at least as long as the plan, the prediction is
    the simulator's with the measured message time. What holds whatever the host's load; how close
    the measured times come to the prediction (and zb-h1's measured speed-up) are figures:
    benchmarks/bench_test_figures.py, and the quickstart prints them."""
    import dataclasses

    from megatron_zb.verify.timing.emulate import Entry, Timing, emulate, predicted_iteration
    entries = [Entry("1f1b"), Entry("zb-h1"), Entry("1f1b", post_validation=True, label="1f1b back to back")]
    rows = emulate(entries, Setting(2, 4, cost_f=10.0, cost_b=10.0, cost_w=10.0),
                   Timing(unit_s=1e-3, iterations=2, warmup=1, timeout=120))
    by = {r["label"]: r for r in rows}
    assert set(by) == {"1f1b", "zb-h1", "1f1b back to back"}
    hop = rows[0]["hop"]
    assert hop >= 0 and all(r["hop"] == hop for r in rows)  # one measurement for every entry
    st = Setting(2, 4, cost_f=10.0, cost_b=10.0, cost_w=10.0)
    for label, sim in (("1f1b", 150.0), ("zb-h1", 130.0)):
        r = by[label]
        assert predicted_iteration(Entry(label), st) == pytest.approx(sim)  # without message time
        assert r["predicted"] == pytest.approx(predicted_iteration(Entry(label), dataclasses.replace(st, cost_comm=hop)))
        # waits cannot end early: no iteration beats the plan without message time
        assert len(r["per_iteration"]) == 2 and min(r["per_iteration"]) >= 0.98 * sim, r["per_iteration"]
        assert r["measured"] == pytest.approx(sum(r["per_iteration"]) / 2)  # the median of two
        tl = r["timeline"].timeline
        sched = generate(label, Setting(2, 4))
        for rank in range(2):  # the timeline is what ran: each rank's passes in its schedule's order
            ran = [(t.action.kind, t.action.stage, t.action.mb) for t in tl[rank]]
            assert ran == [(a.kind, a.stage, a.mb) for a in sched.orders[rank] if a.is_compute]
            assert all(t.end - t.start >= (19.0 if t.action.kind == BW else 9.5) for t in tl[rank])
            assert all(x.end <= y.start for x, y in zip(tl[rank], tl[rank][1:]))  # one pass at a time
    assert by["zb-h1"]["speedup_predicted"] == pytest.approx(by["1f1b"]["predicted"] / by["zb-h1"]["predicted"])
    assert by["zb-h1"]["speedup_measured"] == pytest.approx(by["1f1b"]["measured"] / by["zb-h1"]["measured"])
    # back to back (post-validation's timing): the steady period is at least a rank's own work,
    # 4 microbatches x (F + B + W) = 120 ms, and the simulator predicts 1f1b's iteration time here
    b2b = by["1f1b back to back"]
    assert min(b2b["per_iteration"]) >= 0.98 * 120.0, b2b["per_iteration"]
    assert b2b["predicted"] == pytest.approx(
        predicted_iteration(Entry("1f1b", post_validation=True), dataclasses.replace(st, cost_comm=hop)))


def test_emulate_refuses_a_bad_entry_before_starting_processes():
    from megatron_zb.core.ir import ScheduleError
    from megatron_zb.verify.timing.emulate import Entry, emulate
    with pytest.raises(ScheduleError):
        emulate([Entry("no-such-schedule")], Setting(2, 4, cost_f=1.0, cost_b=1.0, cost_w=1.0))


def test_report_reads_megatron_lines_and_compares_gpu_runs(tmp_path, capsys):
    out = tmp_path
    for s, ms in (("1f1b", 100.0), ("zb-v", 80.0)):
        lines = [LINE.format(i=i, ms=ms, loss=f"{4.0 - 0.01 * i:.6E}") for i in range(5, 61, 5)]
        (out / f"train_{s}.log").write_text("error_injection_type ... transient_error\n" + "\n".join(lines) + "\n")
        prof = {"pipeline_size": 2, "microbatches": 4, "cost_f": [0.01, 0.01], "cost_b": [0.01, 0.01],
                "cost_w": [0.01, 0.01], "cost_comm": 0.0}
        (out / f"profile_{s}.json").write_text(json.dumps(prof))
    assert report.read_log(str(out / "train_1f1b.log"))[5] == (100.0, pytest.approx(3.95))
    report.main([str(out), "--mode", "gpu", "--pp", "2", "--schedules", "1f1b", "zb-v"])
    text = capsys.readouterr().out
    assert "REAL compute" in text and "same losses" in text
    d = json.loads((out / "quickstart.json").read_text())
    by = {r["schedule"]: r for r in d["speed"]}
    assert by["zb-v"]["speedup_measured"] == pytest.approx(1.25)
    assert by["1f1b"]["predicted"] == pytest.approx(1e3 * (4 + 1) * 0.03)  # (m + p - 1)(F+B+W), in ms
    assert (out / "timeline_zb-v.trace.json").exists()


def test_report_cpu_mode_reads_the_emulated_run(tmp_path, capsys):
    for s in ("zb-v", "1f1b"):
        lines = [LINE.format(i=i, ms=300.0, loss=f"{4.0 - 0.01 * i:.6E}") for i in (1, 5, 10)]
        (tmp_path / f"train_{s}.log").write_text("\n".join(lines) + "\n")
    rows = [{"label": s, "schedule": s, "post_validation": False, "hop": 0.05, "measured": ms, "predicted": pred,
             "per_iteration": [ms], "error_pct": 100 * (ms - pred) / pred, "speedup_measured": 3000 / ms,
             "speedup_predicted": 2970 / pred} for s, ms, pred in (("1f1b", 3000, 2970), ("zb-v", 2360, 2340))]
    rows[1]["picture"] = str(tmp_path / "timeline_zb-v")
    (tmp_path / "emulated.json").write_text(json.dumps({
        "pp": 4, "microbatches": 8, "layers_per_rank": 2, "layer": {"hidden": 4096, "seq": 4096, "batch": 1},
        "layer_ms": {"f": 43.8, "b": 59.2, "w": 32.0}, "source": "x.json", "rows": rows}))
    report.main([str(tmp_path), "--mode", "cpu", "--schedules", "zb-v", "1f1b"])
    out = capsys.readouterr().out
    assert "EMULATED compute" in out and "F 43.8, B 59.2, W 32.0 ms" in out
    summary = out[out.index("== summary =="):]
    assert "zb-v trained the GPT with the same losses as 1f1b" in summary
    assert "zb-v 1.271x the iteration speed of 1f1b measured, 1.269x simulated" in summary
    assert "timeline_zb-v.png" in summary and "time in ms" in summary


def test_report_reads_the_real_compute_rounds(tmp_path, capsys):
    """The real-compute (CPU) section: Megatron's own 1F1B and megatron-zb's schedules over their
    rounds, the speed-up over Megatron's (median over the rounds, and its spread), and the
    simulator's prediction from each run's profile: the schedule that ran, each chunk's costs (the
    fused backward as measured, each pass's handling added), the optimizer step (Megatron's own 1F1B:
    1f1b's order with megatron-zb's 1f1b profile of the same round)."""
    for s in ("zb-v", "1f1b"):
        lines = [LINE.format(i=i, ms=300.0, loss=f"{4.0 - 0.01 * i:.6E}") for i in (1, 5, 10)]
        (tmp_path / f"train_{s}.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "emulated.json").write_text(json.dumps({
        "pp": 4, "microbatches": 8, "layers_per_rank": 2, "layer": {"hidden": 4096, "seq": 4096, "batch": 1},
        "layer_ms": {"f": 43.8, "b": 59.2, "w": 32.0}, "source": "x.json", "rows": []}))
    ms = {"megatron": 900.0, "1f1b": 905.0, "zb-h1": 840.0, "zb-v": 820.0}
    from megatron_zb.core.build import ScheduleRequest, build
    from megatron_zb.core.ir.io import to_json
    for s, t in ms.items():
        for r in (1, 2, 3):
            lines = [LINE.format(i=i, ms=t + (i % 2) + 10 * r, loss="4.0E+00") for i in range(1, 9)]
            (tmp_path / f"real_{s}_r{r}.log").write_text("\n".join(lines) + "\n")
            if s != "megatron":
                v = 2 if s == "zb-v" else 1
                built = build(ScheduleRequest(s), 2, 8).schedule
                prof = {"schedule": s, "pipeline_size": 2, "microbatches": 8, "cost_f": [0.03, 0.03],
                        "cost_b": [0.03, 0.03], "cost_w": [0.02, 0.02], "cost_comm": 0.0,
                        "chunk_cost_f": [0.03 / v] * 2 * v, "chunk_cost_b": [0.03 / v] * 2 * v,
                        "chunk_cost_w": [0.02 / v] * 2 * v, "between_iterations_s": 0.05,
                        "built_schedule": json.loads(to_json(built))}
                if s == "1f1b":  # fused backwards measured, cheaper than B + W; 1 ms of handling per F
                    prof.update(cost_bw=[0.045, 0.045], chunk_cost_bw=[0.045, 0.045],
                                chunk_handling_f=[0.001, 0.001], chunk_handling_b=[0.0, 0.0],
                                chunk_handling_w=[0.0, 0.0], chunk_handling_bw=[0.0, 0.0])
                (tmp_path / f"real_profile_{s}_r{r}.json").write_text(json.dumps(prof))
    rows = report.real_cpu_speed(str(tmp_path))
    out = capsys.readouterr().out
    by = {r["schedule"]: r for r in rows}
    assert [r["schedule"] for r in rows] == ["megatron", "1f1b", "zb-h1", "zb-v"]
    assert by["megatron"]["speedup_measured"] == 1.0
    assert by["zb-v"]["speedup_measured"] == pytest.approx(900.0 / 820.0, rel=1e-2)  # the median of the rounds' ratios
    assert by["zb-v"]["predicted"] < by["megatron"]["predicted"]  # zb-v's simulated iteration is shorter
    # 1F1B with 1f1b's profile: M(F + BW) + the ramp (F + BW of the other stage) + the step, F with its handling
    assert by["megatron"]["predicted"] == pytest.approx(1e3 * (8 * 0.076 + 0.076 + 0.05))
    assert by["1f1b"]["predicted"] == by["megatron"]["predicted"]
    assert by["zb-h1"]["predicted"] < 1e3 * (8 * 0.08 + 0.08 + 0.05)  # W in 1F1B's bubble
    assert len(by["zb-h1"]["rounds"]) == 3 and "spread" in out
    summary = "\n".join(report.real_summary(rows))
    assert "zb-v 1.095x the iteration speed of Megatron's own 1F1B measured (each of 3 rounds faster" in summary, summary
    assert "not every row within 3% of its simulation" in summary


def _row(label, rounds, predicted, base_rounds):
    ratios = [b / x for b, x in zip(base_rounds, rounds)]
    med = sorted(rounds)[len(rounds) // 2]
    return {"label": label, "rounds": rounds, "measured": med, "predicted": predicted,
            "error_pct": 100 * (med - predicted) / predicted, "spread_pct": 100 * (max(rounds) - min(rounds)) / med,
            "speedup_measured": sorted(ratios)[len(ratios) // 2], "speedup_measured_rounds": ratios,
            "speedup_predicted": 900.0 / predicted}


def test_real_summary_claims_only_what_the_rounds_show():
    """A speed-up only where every round shows one; a slowdown said as such; rounds on both sides of
    1.0x: no speed-up; a simulation farther off than the rounds' spread said in words; the 3% line."""
    base = [900.0, 905.0, 910.0]
    rows = [_row("Megatron's own 1F1B", base, 900.0, base),
            _row("zb-h1", [880.0, 890.0, 915.0], 890.0, base),  # one round slower than Megatron's
            _row("zb-v", [850.0, 855.0, 860.0], 880.0, base),  # every round faster; 2.8% below its simulation
            _row("1f1b", [920.0, 925.0, 930.0], 905.0, base)]  # every round slower
    text = "\n".join(report.real_summary(rows))
    assert "zb-h1 no speed-up over Megatron's own 1F1B measured: its 3 rounds range 0.995x-1.023x, across" in text
    assert "zb-v 1.058x the iteration speed of Megatron's own 1F1B measured (each of 3 rounds faster" in text
    assert "measured 2.8% faster than simulated, more than the rounds' spread (1.2%)" in text
    assert "1f1b slower than Megatron's own 1F1B measured: 0.978x" in text
    assert "Megatron's own 1F1B iteration 905 ms measured (rounds 900-910), 900 ms simulated (+0.6%: within the " \
           "rounds' spread)" in text
    assert text.splitlines()[-1].startswith("real compute (CPU): every row within 3% of its simulation")
