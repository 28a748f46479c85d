"""The other schedules of the field (issue 17): bitpipe (replicated stages), zeropp, interleaved-zb.

Property tests over random settings (valid, deadlock-free, messages paired, memory claim kept),
BitPipe's placement and routing, the simulator's replica gradient sync, and the errors where a
setting does not apply (pure Python; torch's own order and the runtime's sync: test_field_torch.py).
"""
import itertools
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zb.core.ir import io as sched_io
from megatron_zb.core.ir import B, BW, F, W, Placement, ScheduleError, Setting
from megatron_zb.core.sim.validate import routes
from megatron_zb.core.sim.lower import check_pair_order, lower
from megatron_zb.core.schedules import generate, get
from megatron_zb.core.schedules.bitpipe import interleavings
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate

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


# The BitPipe authors' per-rank order at P=8, M=8, recorded from their
# forward_backward_pipelining_with_BitPipe (wuhouming/BitPipe @ 6fb0e22f, run under stubs by
# benchmarks/bench_bitpipe_authors.py) and mapped onto Placement.bitpipe: "stage.microbatch", the
# forwards and the (fused) backwards of each rank in the order their code calls them.
AUTHORS_P8_M8_F = [
    "0.0 0.1 0.2 0.3 23.4 24.4 23.5 24.5 23.6 24.6 23.7 24.7 15.0 15.1 15.2 15.3",
    "1.0 1.1 1.2 22.4 1.3 22.5 25.4 22.6 25.5 22.7 25.6 14.0 25.7 14.1 14.2 14.3",
    "2.0 2.1 21.4 2.2 21.5 2.3 21.6 26.4 21.7 26.5 13.0 26.6 13.1 26.7 13.2 13.3",
    "3.0 20.4 3.1 20.5 3.2 20.6 3.3 20.7 27.4 12.0 27.5 12.1 27.6 12.2 27.7 12.3",
    "19.4 4.0 19.5 4.1 19.6 4.2 19.7 4.3 11.0 28.4 11.1 28.5 11.2 28.6 11.3 28.7",
    "18.4 18.5 5.0 18.6 5.1 18.7 5.2 10.0 5.3 10.1 29.4 10.2 29.5 10.3 29.6 29.7",
    "17.4 17.5 17.6 6.0 17.7 6.1 9.0 6.2 9.1 6.3 9.2 30.4 9.3 30.5 30.6 30.7",
    "16.4 16.5 16.6 16.7 7.0 8.0 7.1 8.1 7.2 8.2 7.3 8.3 31.4 31.5 31.6 31.7",
]
AUTHORS_P8_M8_B = [
    "15.0 15.1 15.2 15.3 24.4 23.4 24.5 23.5 24.6 23.6 24.7 23.7 0.0 0.1 0.2 0.3",
    "14.0 14.1 14.2 25.4 14.3 25.5 22.4 25.6 22.5 25.7 22.6 1.0 22.7 1.1 1.2 1.3",
    "13.0 13.1 26.4 13.2 26.5 13.3 26.6 21.4 26.7 21.5 2.0 21.6 2.1 21.7 2.2 2.3",
    "12.0 27.4 12.1 27.5 12.2 27.6 12.3 27.7 20.4 3.0 20.5 3.1 20.6 3.2 20.7 3.3",
    "28.4 11.0 28.5 11.1 28.6 11.2 28.7 11.3 4.0 19.4 4.1 19.5 4.2 19.6 4.3 19.7",
    "29.4 29.5 10.0 29.6 10.1 29.7 10.2 5.0 10.3 5.1 18.4 5.2 18.5 5.3 18.6 18.7",
    "30.4 30.5 30.6 9.0 30.7 9.1 6.0 9.2 6.1 9.3 6.2 17.4 6.3 17.5 17.6 17.7",
    "31.4 31.5 31.6 31.7 8.0 7.0 8.1 7.1 8.2 7.2 8.3 7.3 16.4 16.5 16.6 16.7",
]
# ... and how their loops interleave them at P=8, M=16 (F: forward, B: fused backward), rank by rank
AUTHORS_P8_M16_KINDS = [
    "FFFFFFFFFFFFFBFBFBFBBBBBBBBBBFBFBFBFFFFFFFFFFBFBFBFBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFFBFBFBBBBBBBBBBBBFBFBFFFFFFFFFFFFBFBFBBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFFFBFBBBBBBBBBBBBBBFBFFFFFFFFFFFFFFBFBBBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFFFFBBBBBBBBBBBBBBBBFFFFFFFFFFFFFFFFBBBBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFFFFBBBBBBBBBBBBBBBBFFFFFFFFFFFFFFFFBBBBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFFFBFBBBBBBBBBBBBBBFBFFFFFFFFFFFFFFBFBBBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFFBFBFBBBBBBBBBBBBFBFBFFFFFFFFFFFFBFBFBBBBBBBBBBBBBB",
    "FFFFFFFFFFFFFBFBFBFBBBBBBBBBBFBFBFBFFFFFFFFFFBFBFBFBBBBBBBBBBBBB",
]


def _pairs(text):
    return [tuple(int(x) for x in t.split(".")) for t in text.split()]


def test_bitpipe_uses_the_authors_per_rank_order_at_p8():
    p = 8
    for cost in (dict(), dict(cost_f=2.867, cost_b=0.455, cost_w=0.719)):  # list / fixed interleaving
        sched = generate("bitpipe", Setting(p, 8, **cost))
        for r, o in enumerate(sched.orders):
            assert [(a.stage, a.mb) for a in o if a.kind == F] == _pairs(AUTHORS_P8_M8_F[r])
            assert [(a.stage, a.mb) for a in o if a.kind == BW] == _pairs(AUTHORS_P8_M8_B[r])
    fixed = interleavings(Setting(p, 16))[0]["fixed"]
    assert ["".join("F" if a.kind == F else "B" for a in o) for o in fixed.orders] == AUTHORS_P8_M16_KINDS
    for k in (1, 2, 4):  # every unit repeats the first one's order, microbatches shifted by p per unit
        sched = generate("bitpipe", Setting(p, k * p))
        for r, o in enumerate(sched.orders):
            fw = [(a.stage, a.mb) for a in o if a.kind == F]
            want = [(s, mb + u * p) for u in range(k) for s, mb in _pairs(AUTHORS_P8_M8_F[r])]
            assert fw == want


# (P, M, F, B, W, comm): the authors' makespan (their order timed by our simulator, as above), and
# which interleaving of ours is kept. The last four: forwards slow against the fused backward,
# where the list scheduler alone would lose to their fixed loops (so those are kept, equal to theirs).
AUTHORS_MAKESPANS = [
    ((4, 8, 1, 1, 1, 0), 27.0, "list"), ((6, 12, 1, 1, 1, 0), 42.0, "list"), ((8, 8, 1, 1, 1, 0), 30.0, "list"),
    ((8, 32, 1, 1, 1, 0), 111.0, "list"), ((12, 48, 1, 1, 1, 0), 169.0, "list"),
    ((16, 64, 1, 1, 1, 0), 227.0, "list"), ((8, 32, 1, 2, 1, 0), 155.0, "list"),
    ((16, 64, 1, 2, 1, 0), 319.0, "list"), ((8, 32, 1, 1, 1, 0.1), 122.4, "list"),
    ((8, 16, 2.867, 0.455, 0.719, 0), 78.336, "fixed"), ((10, 30, 2.664, 0.308, 1.503, 0), 151.73, "fixed"),
    ((12, 36, 2.006, 0.522, 0.632, 0), 132.31, "fixed"), ((8, 24, 2.528, 0.602, 0.393, 0), 101.334, "fixed"),
]


@pytest.mark.parametrize("case,theirs,kept", AUTHORS_MAKESPANS)
def test_bitpipe_at_least_as_fast_as_the_authors(case, theirs, kept):
    p, m, f, b, w, comm = case
    st = Setting(p, m, cost_f=f, cost_b=b, cost_w=w, cost_comm=comm)
    sched = generate("bitpipe", st)
    res = validate(sched, Setting(**{**st.to_dict(), "chunks": 2}))
    check_pair_order(lower(sched, Setting(**{**st.to_dict(), "chunks": 2})))
    assert res.makespan <= theirs + 1e-6 and sched.meta["interleaving"] == kept
    assert max(res.peak_memory) <= p + 1e-9  # 1F1B's activation
    if kept == "fixed":
        assert res.makespan == pytest.approx(theirs)
        only_list = simulate(interleavings(st)[0]["list"], Setting(**{**st.to_dict(), "chunks": 2}))
        assert only_list.makespan > theirs + 1e-6


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

