"""Vocabulary parallelism with emulated compute (runtime.emulate.sleep_vocab, verify.timing.emulate.emulate_schedules,
verify.timing.emulate_vocab, core.plan.schedule) and the quickstart's section on it. What holds whatever
the host's load: each rank runs its schedule's order, a barrier's passes wait for every rank's
pass before it (one clock for every process), the plan's rows rebuild to the same schedules. How
close the measured times come to the simulator's is a figure (the quickstart prints it)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import B, BW, VS, VT, VW
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.costs.model import ModelSpec
from megatron_zb.core.plan import PlanRequest, VocabLever, plan
from megatron_zb.core.plan.schedule import row_schedule
from megatron_zb.core.ir.vocab import VocabSetting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import quickstart_report as report  # noqa: E402
from megatron_zb.verify.timing.emulate import host_costs  # noqa: E402

TINY = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=512, vocab_size=32000)


def _built(name, p, m, barriers, comm=1.0):
    vocab = VocabSetting(barriers=barriers, cost_s=4.0, cost_t=1.0, cost_w=2.0, cost_comm=comm)
    b = build(ScheduleRequest(name, cost_f=6.0, cost_b=6.0, cost_w=4.0, vocab=vocab), p, m)
    return b.schedule, b.setting


@pytest.mark.dist
def test_emulated_vocab_passes_run_the_schedule_and_wait_for_their_barriers():
    """Two schedules with vocabulary passes (one and two barriers) on 4 real processes: every rank
    runs its schedule's order (VS, VT, VW included), one pass at a time; every VT of a microbatch
    ends after every rank's VS of it was due to end plus the barrier's time, the loss stage's
    backward starts after the last barrier; every pass lasts at least its cost."""
    from megatron_zb.verify.timing.emulate import emulate_schedules

    pairs = [_built("1f1b", 4, 4, 1), _built("zb-h1", 4, 4, 2)]
    hop, times, tls, profs = emulate_schedules(pairs, unit_s=1e-3, iterations=1, warmup=1, timeout=900,
                                               timelines=True, interleave=True, profiles=True)
    assert hop >= 0 and len(times) == 2 and all(len(t) == 1 for t in times)
    for (sched, st), prof in zip(pairs, profs):  # each pass's handling, as profiled in the timed iteration
        assert len(prof["chunk_handling_f"]) == sched.placement.num_stages
        assert all(h >= 0 for k in "fbw" for h in prof[f"chunk_handling_{k}"]) and max(prof["chunk_handling_f"]) > 0
        nominal = iteration_times(sched, st).iteration_time
        assert iteration_times(sched, host_costs(st, sched.placement, prof, 1e-3)).iteration_time > nominal
    for (sched, st), tl, t in zip(pairs, tls, times):
        busiest = max(sum(st.pass_cost(a.kind, r, None if a.is_vocab else a.stage) for a in o if a.is_compute)
                      for r, o in enumerate(sched.orders))
        assert t[0] >= 0.98 * busiest  # waits cannot end early
        ran = {}
        for rank in range(4):
            got = [(x.action.kind, x.action.stage, x.action.mb) for x in tl.timeline[rank]]
            assert got == [(a.kind, a.stage, a.mb) for a in sched.orders[rank] if a.is_compute]
            assert all(x.end <= y.start for x, y in zip(tl.timeline[rank], tl.timeline[rank][1:]))
            for x in tl.timeline[rank]:
                cost = st.pass_cost(x.action.kind, rank, None if x.action.is_vocab else x.action.stage)
                assert x.end - x.start >= 0.95 * cost
                ran[(x.action.kind, x.action.stage, x.action.mb)] = x
        # a barrier joins with the time its pass is due to end (issued as the pass begins): it
        # completes no sooner than every rank's pass started plus its cost, plus the barrier's time
        comm, vs = st.vocab.cost_comm, st.vocab
        last = sched.placement.num_stages - 1
        for mb in range(4):
            c0 = max(ran[(VS, r, mb)].start + vs.cost(VS, r) for r in range(4)) + comm
            assert all(ran[(VT, r, mb)].end >= c0 - 1e-6 for r in range(4))
            assert all(ran[(VW, r, mb)].start >= ran[(VT, r, mb)].end for r in range(4))
            back = ran.get((B, last, mb)) or ran[(BW, last, mb)]
            if st.vocab.barriers == 2:
                c1 = max(ran[(VT, r, mb)].start + vs.cost(VT, r) for r in range(4)) + comm
                assert back.start >= c1 - 1e-6
            else:
                assert back.start >= c0 - 1e-6


def test_row_schedule_rebuilds_plan_rows():
    """Each of plan's rows, with and without vocabulary parallelism, rebuilds to a schedule whose
    simulated iteration is the row's."""
    req = PlanRequest(TINY, 4, 8, 80.0, schedules=["1f1b", "zb-h1", "zb-v", "v-auto"], vocab=VocabLever("both"))
    rows = plan(req)
    ok = [r for r in rows if "error" not in r]
    assert {bool(r.get("vocab_parallel")) for r in ok} == {True, False}
    for r in ok:
        sched, st = row_schedule(req, r)
        assert (st.vocab is not None) == bool(r.get("vocab_parallel"))
        assert iteration_times(sched, st).iteration_time == pytest.approx(r["iteration_time_s"], rel=1e-9)
    with pytest.raises(Exception, match="no schedule"):
        row_schedule(req, {"schedule": "bitpipe", "error": "x"})


def test_pick_rows_takes_megatron_1f1b_and_the_best_vocab_row():
    from megatron_zb.verify.timing.emulate_vocab import RowChoice, pick_rows
    base, best = pick_rows(TINY, 4, 8, RowChoice(schedules=["1f1b", "zb-h1", "zb-v"]))
    assert base["schedule"] == "1f1b" and not base.get("vocab_parallel")
    assert best["vocab_parallel"] == 1 and best["fits"]
    assert "--enable-vocab-parallel" in best["flags"]


def test_report_prints_the_vocab_section(tmp_path, capsys):
    line = (" [2026-11-23 20:40:01.977951] iteration        {i}/      20 | elapsed time per iteration (ms): 300.0 |"
            " lm loss: {loss} | loss scale: 1.0 |")
    for s in ("zb-v", "1f1b"):
        (tmp_path / f"train_{s}.log").write_text("\n".join(line.format(i=i, loss=f"{4.0 - 0.01 * i:.6E}")
                                                           for i in (1, 5, 10)) + "\n")
    rows = [{"label": s, "schedule": s, "post_validation": False, "hop": 0.05, "measured": ms, "predicted": ms,
             "per_iteration": [ms], "error_pct": 0.0, "speedup_measured": 3000 / ms, "speedup_predicted": 3000 / ms}
            for s, ms in (("1f1b", 3000), ("zb-v", 2400))]
    (tmp_path / "emulated.json").write_text(json.dumps({
        "pp": 4, "microbatches": 8, "layers_per_rank": 2, "layer": {"hidden": 4096, "seq": 4096, "batch": 1},
        "layer_ms": {"f": 43.8, "b": 59.2, "w": 32.0}, "source": "x.json", "rows": rows}))
    vrows = [{"label": "Megatron 1F1B", "schedule": "1f1b", "layout": "Et*5|(t*5|)*2,tL", "vocab_parallel": None,
              "flags": "--pipeline-model-parallel-size 4", "per_iteration": [210.0, 212.0], "measured": 211.0,
              "predicted": 207.5, "error_pct": 1.7, "hop_ms": 0.01, "speedup_measured": 1.0,
              "speedup_measured_range": [1.0, 1.0], "speedup_predicted": 1.0},
             {"label": "v-auto + vocab-1", "schedule": "v-auto", "layout": "Ett|(tt|)*6,ttL", "vocab_parallel": 1,
              "flags": "--zero-bubble-schedule v-auto --enable-vocab-parallel", "per_iteration": [165.0, 164.0],
              "measured": 164.5, "predicted": 157.3, "error_pct": 4.6, "hop_ms": 0.01, "speedup_measured": 1.283,
              "speedup_measured_range": [1.27, 1.29], "speedup_predicted": 1.319, "handling_ms": 0.13,
              "predicted_nominal": 150.0, "picture": str(tmp_path / "timeline_vocab")}]
    (tmp_path / "emulated_vocab.json").write_text(json.dumps({
        "pp": 4, "microbatches": 8, "model": "llama-3.2-1b", "seq_length": 4096, "vocab_size": 128256,
        "hidden_size": 2048, "num_layers": 16, "output_share": 0.175, "output_layers": 3.39, "slow_down": 4.0,
        "rows": vrows}))
    report.main([str(tmp_path), "--mode", "cpu", "--schedules", "zb-v", "1f1b"])
    out = capsys.readouterr().out
    assert "Vocabulary parallelism with EMULATED compute" in out and "17.5% of the FLOPs" in out
    assert "--enable-vocab-parallel" in out
    assert "median v-auto + vocab-1 0.130 ms); without them: v-auto + vocab-1 150.0 ms" in out  # its host costs
    summary = out[out.index("== summary =="):]
    assert ("v-auto + vocab-1 1.283x the iteration speed of Megatron 1F1B with its best layout measured, "
            "1.319x simulated") in summary
    assert "timeline_vocab.png" in summary
    d = json.loads((tmp_path / "quickstart.json").read_text())
    assert d["vocab_parallel_emulated"][1]["speedup_predicted"] == 1.319


def test_output_share_of_llama_3_2_1b():
    """The main job's model: the output layer + loss about a sixth of the FLOPs (3.4 layers)."""
    share, layers = report.output_share(report.vocab_spec(), "Et*5|(t*5|)*2,tL")
    assert 0.17 < share < 0.18 and 3.3 < layers < 3.5


def test_host_costs_add_each_chunks_profiled_handling_to_its_passes():
    """``host_costs``: each model chunk's F, B, W and fused BW cost their own plus the chunk's profiled
    handling and interference (seconds, divided by the emulation's unit); none profiled: unchanged."""
    sched, st = _built("zb-h1", 4, 4, 1)
    pl = sched.placement
    assert host_costs(st, pl, {}, 1e-3) is st
    prof = {f"chunk_{h}_{k}": [0.0] * 4 for h in ("handling", "interference") for k in ("f", "b", "w", "bw")}
    same = host_costs(st, pl, prof, 1e-3)
    assert iteration_times(sched, same).iteration_time == pytest.approx(iteration_times(sched, st).iteration_time)
    prof["chunk_handling_f"] = [1e-3, 0.0, 0.0, 0.0]  # 1 ms on a 1 ms unit: one more unit per F of stage 0
    prof["chunk_interference_w"] = [0.0, 0.0, 0.0, 2e-3]
    more = host_costs(st, pl, prof, 1e-3)
    assert more.pass_cost("F", 0, 0) == pytest.approx(st.pass_cost("F", 0, 0) + 1.0)
    assert more.pass_cost("F", 1, 1) == pytest.approx(st.pass_cost("F", 1, 1))
    assert more.pass_cost("W", 3, 3) == pytest.approx(st.pass_cost("W", 3, 3) + 2.0)
    assert more.pass_cost("BW", 3, 3) == pytest.approx(st.pass_cost("BW", 3, 3))  # its own handling: none here
