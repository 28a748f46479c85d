"""Costs and memory per model chunk (issue 32, item 1): a V rank's light first chunk beside its heavy
last one, any uneven layout. One value per virtual stage (P x chunks, pipeline order) is each
chunk's own time; one value per rank keeps meaning the whole stage (each chunk rank / chunks)."""
import json
import subprocess
import sys

import pytest

from megatron_zb.core.build import OffloadRequest, ScheduleRequest, build
from megatron_zb.core.ir import F, Placement, ScheduleError, Setting
from megatron_zb.core.sim.simulate import simulate


def _per_chunk(values, placement):
    """Per-rank values as the equal per-chunk values they stand for."""
    v = placement.chunks
    return [values[placement.rank_of(s)] / v for s in range(placement.num_ranks * v)]


@pytest.mark.parametrize("name, p, m, chunks", [
    ("zb-v", 4, 8, None), ("v-half", 4, 8, None), ("v-min", 4, 6, None), ("v-auto", 4, 8, None),
    ("dualpipe-v", 4, 8, None), ("gpipe-v", 3, 6, None), ("interleaved-1f1b", 4, 8, 2),
    ("interleaved-zb", 4, 8, 3), ("zeropp", 4, 8, 2), ("looped-bfs", 3, 6, 2), ("bitpipe", 4, 8, None),
    ("zb-auto", 4, 8, None), ("zb-h1", 4, 8, None),
])
def test_equal_chunks_build_what_per_rank_costs_build(name, p, m, chunks):
    """Per-chunk values that split each rank's value evenly give the very same schedule and times."""
    cf, cb, cw, mf = [1.0, 1.2, 0.9, 1.1][:p], [1.5, 1.4, 1.6, 1.3][:p], [0.8, 0.7, 0.9, 1.0][:p], [1.0, 2.0, 1.0, 1.5][:p]
    if name == "bitpipe":  # a logical stage sits on two ranks (one per path): per-rank values that differ
        cf, cb, cw, mf = [1.1] * p, [1.4] * p, [0.8] * p, [1.5] * p  # describe ranks, not layers
    rank = build(ScheduleRequest(name, chunks=chunks, cost_f=cf, cost_b=cb, cost_w=cw, mem_f=mf, cost_comm=0.05), p, m)
    pl = rank.schedule.placement
    if pl.replicated:  # BitPipe: per logical stage (one path's chunks)
        pl_one = Placement.vshape(p)
        per = lambda x: _per_chunk(x, pl_one)  # noqa: E731
    else:
        per = lambda x: _per_chunk(x, pl)  # noqa: E731
    chunk = build(ScheduleRequest(name, chunks=chunks, cost_f=per(cf), cost_b=per(cb), cost_w=per(cw), mem_f=per(mf),
                                  cost_comm=0.05), p, m)
    assert [[str(a) for a in o] for o in chunk.schedule.orders] == [[str(a) for a in o] for o in rank.schedule.orders]
    assert chunk.result.makespan == pytest.approx(rank.result.makespan, abs=1e-9)
    assert chunk.result.peak_memory == pytest.approx(rank.result.peak_memory, abs=1e-9)


def test_each_pass_takes_its_own_chunks_time():
    p = 4
    cf = [1.0 + 0.25 * s for s in range(2 * p)]
    b = build(ScheduleRequest("zb-v", cost_f=cf, cost_b=[2.0] * 8, cost_w=[1.0] * 8), p, 8)
    for tl in b.result.timeline:
        for t in tl:
            want = {"F": cf[t.action.stage], "B": 2.0, "W": 1.0}[t.action.kind]
            assert t.end - t.start == pytest.approx(want)


def test_heavy_last_chunk_of_a_v_is_seen():
    """Llama-3-8B's shape at P=8 in layer units (issue 32): 2 layers per chunk, the output layer 2.24
    layers on the last chunk (rank 0 under V)."""
    p, m = 8, 32
    bal = build(ScheduleRequest("zb-v", cost_f=[2.0] * 16, cost_b=[2.0] * 16, cost_w=[2.0] * 16, mem_f=[2.0] * 16), p, m)
    heavy = [2.0] * 15 + [4.24]
    unbal = build(ScheduleRequest("zb-v", cost_f=heavy, cost_b=heavy, cost_w=heavy, mem_f=heavy), p, m)
    assert bal.result.makespan == pytest.approx(384.0)
    assert unbal.result.makespan == pytest.approx(599.04, abs=0.5)
    assert unbal.result.busy[0] == pytest.approx(32 * 3 * 6.24)


def test_offload_times_each_chunk_by_its_own_cost():
    """K x (F + B) of the chunk moved, not of its rank's average."""
    p = 2
    cf = [1.0, 1.0, 1.5, 3.0]
    b = build(ScheduleRequest("zb-v", cost_f=cf, cost_b=cf, cost_w=[1.0] * 4, mem_f=[1.0] * 4, mem_w=[0.0] * 4,
                              offload=OffloadRequest(ratio=1.0, time=0.25)), p, 8)
    moved = [t for tl in b.result.offload.transfers for t in tl]
    assert {t.action.stage for t in moved} >= {0, 2}  # chunks of different cost travel
    for t in moved:
        assert t.end - t.start == pytest.approx(0.25 * 2 * cf[t.action.stage])


def test_limits_count_a_ranks_chunks_together():
    """zb-v's default limit is 1F1B's peak: P x the fullest rank's whole-stage activation (its two chunks)."""
    p = 4
    mf = [1.0] * 7 + [3.0]
    b = build(ScheduleRequest("zb-v", mem_f=mf), p, 8)
    assert b.schedule.meta["memory_limit"] == pytest.approx(p * 4.0)
    assert max(b.result.peak_memory) <= p * 4.0 + 1e-9


def test_wrong_counts_are_named():
    with pytest.raises(ScheduleError, match=r"cost-f has 7 values; give one value or one per stage \(4\), "
                                            r"or one per model chunk \(4 x 2 = 8\)"):
        Setting(4, 8, chunks=2, cost_f=[1.0] * 7)
    with pytest.raises(ScheduleError, match="one per model chunk where a schedule runs several chunks"):
        build(ScheduleRequest("1f1b", cost_f=[1.0] * 8), 4, 8)
    with pytest.raises(ScheduleError, match="per-chunk costs need the stage"):
        Setting(2, 2, chunks=2, cost_f=[1.0] * 4).pass_cost(F, 0)


def test_rank_values_sum_a_ranks_chunks():
    st = Setting(3, 4, chunks=2, mem_f=[1, 2, 3, 4, 5, 6])
    assert st.rank_values("mem_f", Placement.vshape(3)) == [7.0, 7.0, 7.0]
    assert st.rank_values("mem_f", Placement.looped(3, 2)) == [5.0, 7.0, 9.0]
    assert Setting(3, 4, chunks=2, mem_f=[2.0]).rank_values("mem_f", Placement.vshape(3)) == [2.0] * 3


def test_cli_simulate_takes_one_value_per_chunk():
    cf = ",".join(["2"] * 15 + ["4.24"])
    out = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-v", "-p", "8", "-m",
                          "32", "--cost-f", cf, "--cost-b", cf, "--cost-w", cf, "--mem-f", cf, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["makespan"] == pytest.approx(599.04, abs=0.5)
    bad = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-v", "-p", "8", "-m",
                          "32", "--cost-f", ",".join(["1"] * 15)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "15 values" in bad.stderr and "8 x 2 = 16" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert simulate  # the module under test imports cleanly without torch
