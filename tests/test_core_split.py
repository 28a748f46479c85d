"""The split backward's cost (issue 53): a fused BW charged ``cost_bw``, B and W their own costs; a
B and its W run back to back fused where that delays no pass; what the split costs a schedule."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.cli import main
from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.passes.fuse import fuse_adjacent, split_cost
from megatron_zb.core.ir import B, BW, W, Placement, Setting
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.schedules.search.bounds import lower_bound
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.split import split_costs, split_free


def test_a_fused_backward_costs_cost_bw_and_split_passes_their_own():
    st = Setting(4, 8, cost_f=[1.0], cost_b=[1.2], cost_w=[0.8], cost_bw=[1.7])
    assert st.pass_cost(BW, 0) == pytest.approx(1.7)
    assert st.pass_cost(B, 0) + st.pass_cost(W, 0) == pytest.approx(2.0)
    assert Setting(4, 8, cost_b=[1.2], cost_w=[0.8]).pass_cost(BW, 0) == pytest.approx(2.0)  # default B + W
    pl = Placement.vshape(4)
    assert split_costs(st, pl) and not split_costs(Setting(4, 8), pl)
    free = split_free(st, pl)  # per chunk: W = BW - B
    assert free.cost_bw is None and free.pass_cost(B, 0, 0) + free.pass_cost(W, 0, 0) == pytest.approx(0.85)


def test_per_chunk_fused_costs():
    pl = Placement.vshape(2)
    st = Setting(2, 4, chunks=2, cost_b=[1, 1, 1, 1], cost_w=[1, 1, 1, 1], cost_bw=[2, 1.5, 2, 2])
    assert [st.pass_cost(BW, pl.rank_of(s), s) for s in range(4)] == [2, 1.5, 2, 2]
    assert split_costs(st, pl)
    assert not split_costs(Setting(2, 4, chunks=2, cost_bw=[2, 2, 2, 2]), pl)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v", "v-half", "interleaved-zb", "zb-auto", "v-min"])
def test_fusing_delays_nothing_and_keeps_memory(name):
    req = ScheduleRequest(name, cost_f=[1.0], cost_b=[1.2], cost_w=[0.8], cost_bw=[1.7])
    built = build(req, 4, 8)
    plain = build(req.replace(cost_bw=None), 4, 8)
    fused = built.schedule
    assert fused.meta.get("fused_backwards", 0) > 0
    # every B;W pair it fused ran back to back; the rest of the order is the same
    assert sum(1 for o in fused.orders for a in o if a.kind == BW) == fused.meta["fused_backwards"]
    unfused = simulate(plain.schedule, built.setting)
    after = built.result
    assert after.makespan <= unfused.makespan + 1e-9
    for r in range(4):
        times = {(t.action.kind, t.action.stage, t.action.mb): t.start for t in after.timeline[r]}
        for t in unfused.timeline[r]:
            k = (t.action.kind, t.action.stage, t.action.mb)
            if k in times:
                assert times[k] <= t.start + 1e-9, (name, k)
    assert max(after.peak_memory) <= max(unfused.peak_memory) + 1e-9


def test_the_first_stage_fuses_its_back_to_back_pairs():
    """Nothing waits for stage 0's input gradient: its B;W pairs always fuse."""
    req = ScheduleRequest("zb-h1", cost_b=[1.0], cost_w=[1.0], cost_bw=[1.99])
    sched = build(req, 4, 8).schedule
    base = build(req.replace(cost_bw=None), 4, 8).schedule
    pairs = sum(1 for i, a in enumerate(base.orders[0][:-1])
                if a.kind == B and base.orders[0][i + 1] == a._replace(kind=W))
    assert pairs and sum(1 for a in sched.orders[0] if a.kind == BW) >= pairs


def test_no_fusing_where_the_split_is_free():
    req = ScheduleRequest("zb-v", cost_b=[1.2], cost_w=[0.8])
    assert "fused_backwards" not in build(req, 4, 8).schedule.meta
    sched = build(req, 4, 8).schedule
    assert fuse_adjacent(sched, build(req, 4, 8).setting) is sched


@settings(max_examples=25, deadline=None)
@given(f=st.floats(0.5, 2), b=st.floats(0.5, 2), w=st.floats(0.2, 2), extra=st.floats(0.0, 0.5),
       comm=st.floats(0, 0.3), name=st.sampled_from(["zb-h1", "zb-h2", "zb-v", "interleaved-zb"]))
def test_fusing_never_lengthens_the_iteration(f, b, w, extra, comm, name):
    req = ScheduleRequest(name, cost_f=[f], cost_b=[b * (1 + extra)], cost_w=[w * (1 + extra)], cost_bw=[b + w],
                          cost_comm=comm)
    built = build(req, 4, 8)
    plain = build(req.replace(cost_bw=None), 4, 8)
    assert iteration_times(built.schedule, built.setting).iteration_time <= \
        iteration_times(plain.schedule, built.setting).iteration_time + 1e-9


def test_split_cost_is_the_time_the_split_adds():
    req = ScheduleRequest("zb-h1", cost_b=[1.2], cost_w=[0.8], cost_bw=[1.7])
    built = build(req, 4, 8)
    c = split_cost(built.schedule, built.setting)
    free = split_free(built.setting, built.schedule.placement)
    assert c == pytest.approx(iteration_times(built.schedule, built.setting).iteration_time
                              - iteration_times(built.schedule, free).iteration_time)
    assert c > 0
    one = build(req.replace(name="1f1b"), 4, 8)
    assert split_cost(one.schedule, one.setting) == 0.0


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_lower_bound_holds_with_a_cheaper_fused_backward(name):
    req = ScheduleRequest(name, cost_f=[1.0], cost_b=[1.5], cost_w=[1.5], cost_bw=[2.0])
    built = build(req, 4, 8)
    assert built.result.makespan >= lower_bound(built.setting, built.schedule.placement, None) - 1e-9


def test_simulate_and_compare_report_the_split(capsys):
    args = ["-p", "4", "-m", "8", "--cost-b", "1.2", "--cost-w", "0.8", "--cost-bw", "1.7", "--json"]
    assert main(["simulate", "--schedule", "zb-h1"] + args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cost_bw"] == [1.7] * 4 and d["split_cost"] > 0 and d["fused_backwards"] > 0
    assert main(["compare"] + args) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r}
    assert rows["1f1b"]["split_cost"] == 0.0 and rows["zb-h1"]["split_cost"] > 0
    assert main(["simulate", "--schedule", "zb-h1", "-p", "4", "-m", "8", "--cost-bw", "x"]) == 2
