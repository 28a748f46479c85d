"""The other schedules of the field (issue 17): bitpipe (replicated stages), zeropp, interleaved-zb.

Property tests over random settings (valid, deadlock-free, messages paired, memory claim kept),
BitPipe's placement and routing, the simulator's replica gradient sync, and the errors where a
setting does not apply (pure Python; torch's own order and the runtime's sync: test_field_torch.py).
"""
import itertools
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zb.core import io as sched_io
from megatron_zb.core.ir import B, BW, F, W, Placement, ScheduleError, Setting, routes
from megatron_zb.core.lower import check_pair_order, lower
from megatron_zb.core.schedules import generate, get
from megatron_zb.core.simulate import simulate
from megatron_zb.core.validate import validate

FIELD = ("bitpipe", "zeropp", "interleaved-zb")


def _applies(name, p, m, v):
    if name == "bitpipe":
        return p % 2 == 0 and m % p == 0
    if name == "interleaved-zb":
        r = max(1, m // p)
        return m % r == 0
    return True


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(FIELD), st.integers(1, 9), st.integers(1, 24), st.integers(2, 4),
       st.floats(0.1, 4), st.floats(0.1, 4), st.floats(0.0, 4), st.sampled_from([0.0, 0.1, 0.5]),
       st.floats(0.0, 1.0), st.booleans(), st.sampled_from([0.0, 1.0]))
def test_field_schedules_valid_deadlock_free_within_claim(name, p, m, v, f, b, w, comm, mem_w, hetero, sync):
    cf = [f * (1.5 if hetero and r in (0, p - 1) else 1) for r in range(p)]
    spec = get(name)
    chunks = v if spec.chunks is None else spec.chunks
    setting = Setting(p, m, chunks=chunks, cost_f=cf, cost_b=b, cost_w=w, cost_comm=comm, mem_w=mem_w,
                      cost_sync=sync)
    if not _applies(name, p, m, v):
        with pytest.raises(ScheduleError):
            generate(name, setting)
        return
    sched = generate(name, setting)
    setting = Setting(**{**setting.to_dict(), "chunks": sched.placement.chunks})
    validate(sched, setting)
    res = simulate(sched, setting)
    assert max(res.peak_memory) <= sched.meta["memory_claim"] + 1e-9
    assert 0.0 <= res.bubble_rate < 1.0
    check_pair_order(lower(sched, setting))
    kinds = {a.kind for o in sched.orders for a in o}
    assert kinds <= ({F, BW} if name == "bitpipe" else {F, B, W})


def test_interleaved_zb_rounds_rule():
    with pytest.raises(ScheduleError, match="multiple of 2"):
        generate("interleaved-zb", Setting(4, 9, chunks=2))
    with pytest.raises(ScheduleError, match="--chunks >= 2"):
        generate("interleaved-zb", Setting(4, 8, chunks=1))


def test_bitpipe_placement_and_routes():
    p = 4
    pl = Placement.bitpipe(p)
    assert pl.replicated and pl.num_paths == 2 and pl.num_logical_stages == 2 * p
    assert pl.models_per_rank == 4 and pl.chunks == 2
    for r in range(p):
        assert len(pl.stages_of(r)) == 4 and pl.weight_copies(r) == 2
        for s in pl.stages_of(r):  # every replica of rank r's stages lives on rank p-1-r
            others = [x for x in pl.replicas(s) if x != s]
            assert [pl.rank_of(x) for x in others] == [p - 1 - r]
    # each direction is a V: first and last logical stage on one rank (embedding and loss)
    assert pl.rank_of(pl.path(0)[0]) == pl.rank_of(pl.path(0)[-1]) == 0
    assert pl.rank_of(pl.path(1)[0]) == pl.rank_of(pl.path(1)[-1]) == p - 1
    assert pl.loss_rank == 0
    sched = generate("bitpipe", Setting(p, 8))
    rt = routes(sched)
    assert [rt[mb] for mb in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert Placement.from_dict(json.loads(json.dumps(pl.to_dict()))) == pl


def test_bitpipe_rules():
    with pytest.raises(ScheduleError, match="even pipeline size"):
        generate("bitpipe", Setting(3, 6))
    with pytest.raises(ScheduleError, match="use 8 or 12 microbatches"):
        generate("bitpipe", Setting(4, 10))
    with pytest.raises(ScheduleError, match="4 model chunks per rank"):
        get("bitpipe").resolve_chunks(4)
    with pytest.raises(ScheduleError, match="memory limit 1"):
        generate("bitpipe", Setting(4, 8, memory_limit=1.0))


def test_bitpipe_beats_interleaved_1f1b_at_p4_m8():
    st = Setting(4, 8)
    bit = simulate(generate("bitpipe", st), Setting(4, 8, chunks=2))
    il = simulate(generate("interleaved-1f1b", Setting(4, 8, chunks=2)), Setting(4, 8, chunks=2))
    assert bit.bubble_rate < il.bubble_rate
    assert max(bit.peak_memory) <= 4 < max(il.peak_memory)  # and at 1F1B's memory (interleaved: 5.5)
    assert bit.weight_copies == [2.0] * 4


def test_replica_sync_is_charged_and_overlapped():
    p, m = 4, 8
    base = simulate(generate("bitpipe", Setting(p, m)), Setting(p, m, chunks=2))
    small = simulate(generate("bitpipe", Setting(p, m)), Setting(p, m, chunks=2, cost_sync=0.5))
    big = simulate(generate("bitpipe", Setting(p, m)), Setting(p, m, chunks=2, cost_sync=20.0))
    assert len(small.syncs) == 2 * p  # one all-reduce per logical stage, between its two replicas
    assert all(len(ranks) == 2 for _, ranks, _, _ in small.syncs)
    # the early syncs hide behind the remaining passes: only the last ones show
    assert small.makespan < base.makespan + 2 * p * 0.25
    assert big.makespan > base.makespan + 10.0  # ... but a slow link cannot hide
    assert "gradient_syncs" in small.to_dict() and "gradient_syncs" not in simulate(
        generate("zb-h1", Setting(p, m)), Setting(p, m)).to_dict()


def test_replicated_validation_and_io():
    st = Setting(4, 8)
    sched = generate("bitpipe", st)
    back = sched_io.from_json(sched_io.to_json(sched))
    assert back.placement == sched.placement and back.orders == sched.orders
    with pytest.raises(ScheduleError, match="CSV cannot"):
        sched_io.to_csv(sched)
    # a microbatch on both paths is refused, naming the pass
    bad = [list(o) for o in sched.orders]
    r0 = bad[0]
    i = next(i for i, a in enumerate(r0) if a.kind == F and sched.placement.path_of(a.stage) == 1)
    a = r0[i]
    r0[i] = type(a)(F, a.stage, 0)
    sched.orders = bad
    with pytest.raises(ScheduleError):
        validate(sched, Setting(4, 8, chunks=2))


def test_zeropp_units_and_limits():
    p, m = 4, 16
    s = generate("zeropp", Setting(p, m))
    assert s.meta["unit"] == p and s.placement.style == "looped"
    res = simulate(s, Setting(p, m, chunks=2))
    zb1 = simulate(generate("zb-h1", Setting(p, m)), Setting(p, m))
    assert res.bubble_rate < zb1.bubble_rate and max(res.peak_memory) <= p
    # at 1F1B's memory with p dividing m: torch's ZB1P order (interleaved-zb)
    assert s.orders == generate("interleaved-zb", Setting(p, m, chunks=2)).orders
    # more memory: larger units and fuller warm-ups are tried (never worse: the default is a candidate)
    st = dict(cost_f=1, cost_b=1.1, cost_w=0.9, cost_comm=0.05)
    base = simulate(generate("zeropp", Setting(8, 32, **st)), Setting(8, 32, chunks=2, **st))
    more = generate("zeropp", Setting(8, 32, memory_limit=12.0, **st))
    r = simulate(more, Setting(8, 32, chunks=2, **st))
    assert r.makespan < base.makespan and more.meta["unit"] == 16 and max(r.peak_memory) <= 12.0
    # any microbatch count (a last, shorter unit)
    validate(generate("zeropp", Setting(4, 10)), Setting(4, 10, chunks=2))
    with pytest.raises(ScheduleError, match=r"smallest scheduling unit needs \(4"):
        generate("zeropp", Setting(p, m, memory_limit=2.0))


@pytest.mark.parametrize("p,m", list(itertools.product([2, 4, 8], [8, 16])))
def test_field_equal_costs_table(p, m):
    """Equal costs: every field schedule beats 1F1B's bubble at no more than 1F1B's activation."""
    one = simulate(generate("1f1b", Setting(p, m)), Setting(p, m)).bubble_rate
    for name in FIELD:
        s = generate(name, Setting(p, m))
        r = simulate(s, Setting(p, m, chunks=s.placement.chunks))
        assert r.bubble_rate < one and max(r.peak_memory) <= p + 1e-9, name

