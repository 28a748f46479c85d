"""core.optimizer.offload / core.optimizer.rows: per-rank shares of the Adam states on the host,
the trough cost model (what visits the GPU, what is updated on the CPU, what the step costs), the
iteration model with one step time per rank, and plan's rows with --optimizer-offload."""
from __future__ import annotations

import json
import math

import pytest

from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import ScheduleError
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.optimizer.offload import (HostCosts, RankShare, auto_fractions, memory_curve, static_step,
                                               trough_step)

GB = 1e9
COSTS = HostCosts(link_gbps=10.0, gpu_update_gbps=1000.0, cpu_update_gbps=10.0, subgroups=4)


def test_auto_fractions_each_rank_its_own_need():
    states, fixed, act = [12.0, 12.0, 12.0, 12.0], [6.0] * 4, [2.0, 5.0, 8.0, 30.0]
    f = auto_fractions(states, fixed, act, budget=20.0)
    assert f[0] == 0.0  # 20 fits
    assert f[1] == pytest.approx(0.25)  # 23: 3 of 12 bytes to the host
    assert f[2] == pytest.approx(0.5)
    assert f[3] is None  # 6 + 30 > 20 even with every state on the host
    assert auto_fractions([12.0], [6.0], [3.0], budget=20.0) == [0.09]  # rounded up to 0.01


def _flat(end):
    """Activations 10 GB until ``end``, then nothing (the trough)."""
    return [(0.0, 10 * GB), (end, 0.0)]


def test_trough_takes_everything_when_there_is_room_and_time():
    params = 1e9  # 12 GB of state, 4 subgroups of 3 GB, 0.3 s each way at 10 GB/s
    rs = trough_step(RankShare(0, params, 0.0, resident_bytes=10 * GB, budget=40 * GB), [(0.0, 10 * GB), (5.0, 0.0)],
                     10.0, costs=COSTS)
    assert rs.on_gpu == 4 and rs.on_cpu == 0
    # prefetched before the last pass ended: the step is the GPU update alone
    assert rs.step_time == pytest.approx(COSTS.gpu(params))
    assert all(p.up[1] <= 10.0 for p in rs.subgroups)
    assert rs.visiting_peak_bytes <= 12 * GB + 1


def test_no_room_in_the_trough_means_cpu_updates_as_megatron_does():
    params = 1e9
    rs = trough_step(RankShare(0, params, 0.0, resident_bytes=10 * GB, budget=12 * GB), _flat(10.0), 10.0, costs=COSTS)
    assert rs.on_gpu == 0 and rs.on_cpu == 4
    assert rs.step_time == pytest.approx(static_step(params, 0.0, COSTS, end=10.0))


def test_a_busy_link_delays_the_prefetch():
    params = 1e9
    curve = [(0.0, 28 * GB), (9.0, 0.0)]  # room for a subgroup only from 9.0
    share = RankShare(0, params, 0.0, 10 * GB, 40 * GB)
    free = trough_step(share, curve, 10.0, COSTS)
    busy = trough_step(share, curve, 10.0, COSTS, busy=([], [(8.9, 10.5)]))  # activation reloads hold the H2D lane
    assert busy.step_time > free.step_time
    for p in busy.subgroups:
        if p.where == "gpu":
            assert p.up[0] >= 10.5 - 1e-9 or p.up[1] <= 8.9 + 1e-9


def test_write_back_waits_for_the_next_iterations_room():
    # the next iteration fills the GPU at once: states still on the GPU hold its start back
    params = 1e9
    curve = [(0.0, 27 * GB), (9.0, 0.0)]
    rs = trough_step(RankShare(0, params, 0.0, resident_bytes=10 * GB, budget=40 * GB), curve, 10.0, costs=COSTS)
    last_down = max(p.down[1] for p in rs.subgroups if p.where == "gpu")
    assert rs.on_gpu >= 1
    assert rs.end + rs.step_time >= last_down - 1e-9


def test_costs_are_checked():
    with pytest.raises(ScheduleError):
        HostCosts(link_gbps=0)
    with pytest.raises(ScheduleError):
        HostCosts(subgroups=0)


def test_iteration_time_with_a_step_per_rank():
    built = build(ScheduleRequest("zb-h1"), 4, 8)
    s, st = built.schedule, built.setting
    same = iteration_times(s, st, 0.5)
    per = iteration_times(s, st, [0.5] * 4)
    assert per.iteration_time == pytest.approx(same.iteration_time)
    assert per.iteration_time_post_validated == pytest.approx(same.iteration_time_post_validated)
    slow = iteration_times(s, st, [0.5, 0.5, 3.0, 0.5])
    assert slow.iteration_time == pytest.approx(iteration_times(s, st, 3.0).iteration_time)
    assert slow.iteration_time_post_validated > same.iteration_time_post_validated
    with pytest.raises(ScheduleError):
        iteration_times(s, st, [0.5, 0.5])


def test_memory_curve_follows_the_passes():
    built = build(ScheduleRequest("1f1b"), 4, 8)
    res, st = built.result, built.setting
    for r in range(4):
        curve = memory_curve(res.timeline[r], r, st)
        assert max(x for _, x in curve) == pytest.approx(res.peak_memory[r])
        assert curve[-1][1] == pytest.approx(0.0, abs=1e-9)


def test_plan_rows_fit_with_the_offloaded_states():
    from megatron_zb.core.plan import ModelSpec, OptimizerOffload, PlanRequest, plan
    spec = ModelSpec(num_layers=16, hidden_size=4096, num_attention_heads=32, seq_length=8192, vocab_size=32000)
    req = PlanRequest(spec, 4, 16, 40.0, schedules=["1f1b", "zb-h1", "zb-h2"], layout_search=False)
    plain = {r["schedule"]: r for r in plan(req, jobs=1)}
    rows = {r["schedule"]: r for r in plan(req.replace(optimizer_offload=OptimizerOffload("trough")), jobs=1)}
    assert not plain["zb-h2"]["fits"]
    o = rows["zb-h2"]["optimizer_offload"]
    assert rows["zb-h2"]["fits"] and max(o["peak_bytes_with"]) <= 40.0 * 2 ** 30
    assert o["peak_bytes_without"] == plain["zb-h2"]["peak_bytes"]
    assert any(f > 0 for f in o["fractions"]) and "--zero-bubble-optimizer-offload" in rows["zb-h2"]["flags"]
    # a row that fits keeps its states, but its optimizer step is counted as well
    assert "optimizer_offload" not in rows["1f1b"] and rows["1f1b"]["iteration_time_s"] > plain["1f1b"]["iteration_time_s"]
    static = {r["schedule"]: r for r in plan(req.replace(optimizer_offload=OptimizerOffload("auto")), jobs=1)}
    assert static["zb-h2"]["iteration_time_s"] >= rows["zb-h2"]["iteration_time_s"] - 1e-12
    assert math.isclose(max(static["zb-h2"]["peak_bytes"]), max(rows["zb-h2"]["peak_bytes"]))


def test_plan_cli_prints_the_shares_and_the_flags(capsys):
    from megatron_zb.cli import main
    argv = ["plan", "--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length",
            "8192", "--pipeline-parallel-size", "4", "--num-microbatches", "16", "--gpu-memory-gb", "40",
            "--no-layout-search", "--no-vocab-parallel", "--jobs", "1"]
    assert main(argv + ["--optimizer-offload", "trough", "--host-link-gbps", "20"]) == 0
    out = capsys.readouterr().out
    assert "optimizer states (trough)" in out and "host link 20 GB/s" in out
    assert "--zero-bubble-optimizer-offload" in out and "shares on the host per rank" in out
    assert main(argv + ["--optimizer-offload", "static", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    flagged = [r for r in rows if r.get("optimizer_offload") and "error" not in r["optimizer_offload"]]
    assert flagged and all("--optimizer-offload-fraction" in r["flags"] for r in flagged)
    assert all(len(set(r["optimizer_offload"]["fractions"])) == 1 for r in flagged)  # one for all ranks
    assert main(argv + ["--optimizer-offload", "sometimes"]) == 2
    assert "invalid choice" in capsys.readouterr().err
