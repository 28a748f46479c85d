"""zb-auto, the V family, looped-bfs and dualpipe-v: claims from the papers that hold exactly."""
import itertools

import pytest

from megatron_zb.core.ir import BW, F, B, OVERLAP, ScheduleError, Setting
from megatron_zb.core.sim.lower import lower
from megatron_zb.core.schedules import generate
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate

COSTS = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1.5, 2, 0.75)]


def sim(name, p, m, **kw):
    st = Setting(p, m, **kw)
    s = generate(name, st)
    st = Setting(**{**st.to_dict(), "chunks": s.placement.chunks})
    validate(s, st)
    return s, simulate(s, st)


@pytest.mark.parametrize("p,costs", list(itertools.product([2, 3, 4, 5, 8], COSTS)))
def test_zb_auto_never_worse_than_zb_h1_at_1f1b_memory(p, costs):
    f, b, w = costs
    for m in (p - 1 or 1, 2 * p, 3 * p + 1):
        kw = dict(cost_f=f, cost_b=b, cost_w=w, memory_limit=p)
        _, auto = sim("zb-auto", p, m, **kw)
        _, h1 = sim("zb-h1", p, m, **kw)
        assert auto.makespan <= h1.makespan + 1e-9
        assert max(auto.peak_memory) <= p + 1e-9


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_zb_auto_zero_bubble_at_2p(p):
    s, r = sim("zb-auto", p, 3 * p, memory_limit=2 * p)
    assert r.makespan == pytest.approx(3 * p * 3)
    assert s.meta["gap_to_lower_bound"] == pytest.approx(0.0)


def test_zb_auto_heterogeneous_stages_and_gap():
    s, r = sim("zb-auto", 4, 12, cost_f=[1.4, 1, 1, 1.6], cost_b=[1.4, 1, 1, 2], cost_w=[0.8, 1, 1, 0.8],
               cost_comm=0.05, memory_limit=6)
    assert s.meta["lower_bound"] <= r.makespan + 1e-9 and s.meta["gap_to_lower_bound"] >= 0
    assert max(r.peak_memory) <= 6 + 1e-9


def test_zb_auto_infeasible_limit_names_least_memory():
    with pytest.raises(ScheduleError, match=r"no schedule fits memory limit 0.5; the least that works is about 1 "):
        generate("zb-auto", Setting(4, 8, memory_limit=0.5))  # one microbatch in flight: F, B, W, F, ...
    assert max(sim("zb-auto", 4, 8, memory_limit=1)[1].peak_memory) <= 1 + 1e-9
    with pytest.raises(ScheduleError, match=r"the least that works is about 2 "):
        generate("zb-auto", Setting(4, 8, mem_f=2, memory_limit=1.5))
    # V: rank 0 holds both chunks of a microbatch (mem-f / 2 each) before its first B
    with pytest.raises(ScheduleError, match=r"v-auto: no schedule fits memory limit 0.4; the least that works is about 1 "):
        generate("v-auto", Setting(4, 8, memory_limit=0.4))


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zb_v_zero_bubble_at_equal_costs_with_1f1b_memory(p):
    for m in (2 * p, 3 * p):
        s, r = sim("zb-v", p, m)
        assert r.bubble_rate == pytest.approx(0.0, abs=1e-9)
        assert max(r.peak_memory) <= p + 1e-9  # 1F1B's peak: p microbatches of a stage's activation


@pytest.mark.parametrize("p", [4, 5, 6, 8])
def test_v_half_and_v_min_memory(p):
    _, half = sim("v-half", p, 4 * p)
    _, vmin = sim("v-min", p, 4 * p)
    assert max(half.peak_memory) <= p / 2 + 1 + 1e-9
    assert max(vmin.peak_memory) <= p / 3 + 1 + 1e-9
    _, one = sim("1f1b", p, 4 * p)
    assert max(vmin.peak_memory) < max(half.peak_memory) < max(one.peak_memory)


def test_v_auto_bubble_falls_with_memory():
    p, m = 4, 12
    spans = []
    for lim in (2, 2.5, 3, 3.5, 4):
        _, r = sim("v-auto", p, m, memory_limit=lim)
        assert max(r.peak_memory) <= lim + 1e-9
        spans.append(r.makespan)
    assert spans == sorted(spans, reverse=True)
    assert spans[-1] == pytest.approx(3 * m)  # zero bubble at 1F1B's memory


def test_looped_bfs_and_dualpipe_v():
    s, r = sim("looped-bfs", 4, 8, chunks=2)
    assert s.placement.style == "looped" and all(a.kind in (F, BW) for o in s.orders for a in o)
    s, r = sim("dualpipe-v", 4, 10)
    pairs = [a for o in s.orders for a in o if a.kind == OVERLAP]
    assert s.placement.style == "v" and pairs
    for a in pairs:
        f, b = a.parts
        assert f.kind == F and b.kind in (B, BW) and f.stage != b.stage
    flat = s.flat()
    assert len(flat.meta["overlap_pairs"]) == len(pairs)
    low = lower(s)
    for rank, i, j in low.meta["overlap_pairs"]:
        o = low.orders[rank]
        assert o[i].kind == F and o[j].kind in (B, BW) and not any(x.is_compute for x in o[i + 1:j])
    # fewer microbatches than 2p: the extra ones are dropped, still valid
    sim("dualpipe-v", 4, 3)


@pytest.mark.parametrize("name", ["zb-auto", "zb-v", "v-half", "v-min", "v-auto", "looped-bfs", "dualpipe-v"])
@pytest.mark.parametrize("p,m", [(3, 1), (3, 2), (5, 4), (4, 3), (1, 3)])
def test_small_m_and_odd_p(name, p, m):
    kw = {"chunks": 2} if name == "looped-bfs" else {}
    sim(name, p, m, **kw)


@pytest.mark.parametrize("name,p,m", [("v-auto", 4, 12), ("zb-auto", 4, 12)])
def test_memory_is_the_tie_break_under_a_generous_limit(name, p, m):
    """Issue 26: under a limit far above what the fastest schedule needs, zb-auto / v-auto keep the
    least-memory schedule among the equally fast: never more memory than the same search under
    1F1B's peak, 1.5 or 2 times it, when that one is as fast."""
    from megatron_zb.core.schedules.search.auto import TIE
    kw = dict(cost_f=1.0, cost_b=1.0, cost_w=1.0)
    s, big = sim(name, p, m, memory_limit=10 * p, **kw)
    for lim in (p, 1.5 * p, 2 * p):
        _, small = sim(name, p, m, memory_limit=lim, **kw)
        if small.makespan <= big.makespan * (1 + TIE):
            assert max(big.peak_memory) <= max(small.peak_memory) + 1e-9, lim
            break
    # never more than the tie slower than the search at the generous limit alone
    from megatron_zb.core.schedules.search.auto import zb_auto
    from megatron_zb.core.schedules.search.vsearch import v_auto
    alone = (v_auto if name == "v-auto" else zb_auto)(Setting(p, m, memory_limit=10 * p, **kw), memory=False)
    st = Setting(p, m, chunks=alone.placement.chunks, **kw)
    assert big.makespan <= simulate(alone, st).makespan * (1 + TIE) + 1e-9
    assert max(big.peak_memory) <= max(simulate(alone, st).peak_memory) + 1e-9


def test_cheapest_of_equally_fast_candidates():
    """``_cheapest``: among the equally fast (makespan and end, within its tie), the least peak wins."""
    from megatron_zb.core.schedules.search.auto import _cheapest
    st = Setting(4, 8, cost_f=1.0, cost_b=1.0, cost_w=1.0)
    a, b = generate("zb-h2", st), generate("zb-h1", st)
    ra, rb = simulate(a, st), simulate(b, st)
    key = lambda r: (r.makespan, sum(r.spans), max(r.peak_memory))  # noqa: E731
    # zb-h1 (27, peak 4) against zb-h2 (24 with post-validation, peak 7): not within 0.1%
    assert _cheapest([(key(ra), a), (key(rb), b)], st)[1] is a
    # within a wide tie the lower real peak wins: zb-h1 (4) over zb-h2 (7), even where zb-h2's key
    # claims 0.0 (vslots' building blocks carry that placeholder; it used to win every tie)
    assert _cheapest([(key(ra), a), (key(rb), b)], st, tie=1.0)[1] is b
    assert _cheapest([((ra.makespan, sum(ra.spans), 0.0), a), (key(rb), b)], st, tie=1.0)[1] is b


@pytest.mark.parametrize("p,m,c", [(4, 8, (1, 1, 1, 0)), (4, 12, (1, 2, 1, 0.1)), (6, 12, (1.2, 1, 0.7, 0.3))])
def test_cheapest_keeps_the_least_memory_within_the_tie(p, m, c):
    """Issue 26: of the candidates within 0.1% (``TIE``) of the fastest in makespan and in the end
    of the last pass, the least peak, then the least post-validated iteration time, then makespan."""
    from megatron_zb.core.sim.iteration import iteration_times
    from megatron_zb.core.schedules.search.auto import TIE, _cheapest
    st = Setting(p, m, cost_f=c[0], cost_b=c[1], cost_w=c[2], cost_comm=c[3])
    cands = [generate(n, st) for n in ("1f1b", "zb-h1", "zb-h2")]
    cands += [generate("zb-auto", Setting(**{**st.to_dict(), "memory_limit": lim * p})) for lim in (1, 1.5, 2)]
    for tie in (TIE, 0.05, 1.0):
        rs = [simulate(s, st) for s in cands]
        keys = [(r.makespan, sum(r.spans), max(r.peak_memory)) for r in rs]
        ends = [max(tl[-1].end for tl in r.timeline if tl) for r in rs]
        fast = min(range(len(rs)), key=lambda i: keys[i][:2])
        near = [i for i in range(len(rs)) if keys[i][0] <= keys[fast][0] * (1 + tie) + 1e-9
                and ends[i] <= ends[fast] * (1 + tie) + 1e-9]
        want = min(near, key=lambda i: (round(keys[i][2], 6), round(
            iteration_times(cands[i], st).iteration_time_post_validated, 9), keys[i][0], ends[i]))
        got = _cheapest(list(zip(keys, cands)), st, tie=tie)[1]
        r = simulate(got, st)
        assert (max(r.peak_memory), r.makespan) == pytest.approx((keys[want][2], keys[want][0])), tie


def test_zb_auto_gives_up_a_little_time_for_a_quarter_less_memory():
    """bench_vs_authors' one zb-auto 'tie, less memory' setting: P=8 M=16, H100 costs, limit 2P.
    The authors' zb.py reaches 2408 with a peak of 16 (and so did zb-auto before memory became its
    tie-break); within 0.1% of that zb-auto now keeps a schedule with peak 12."""
    st = Setting(8, 16, cost_f=43.8, cost_b=59.2, cost_w=32.0, cost_comm=0.5, mem_f=1.0, mem_w=0.5,
                 memory_limit=16)
    r = simulate(generate("zb-auto", st), st)
    assert r.makespan == pytest.approx(2410.0) and r.makespan <= 2408.0 * 1.001
    assert max(r.peak_memory) == pytest.approx(12.0)


@pytest.mark.parametrize("name,limit", [("v-auto", 2.13), ("v-auto", 3.37), ("zb-auto", 3.37)])
def test_searched_schedules_keep_each_stages_forwards_in_microbatch_order(name, limit):
    """Measured costs of a CPU run (F on rank 0 three times rank 1's): the local search used to swap
    two microbatches' forwards of one stage (F0.2 before F0.0), which the runtime cannot run (it reads
    a stage's data in order); such orders are no longer candidates."""
    from megatron_zb.core.build import ScheduleRequest, build
    req = ScheduleRequest(name, cost_f=[0.01132, 0.00342], cost_b=[0.00223, 0.00227], cost_w=[0.00066, 0.00066],
                          cost_comm=0.000081, mem_w=[0.94], memory_limit=limit)
    for m in (4, 8):
        sched = build(req, 2, m).schedule
        for order in sched.orders:
            for s in {a.stage for a in order}:
                fwd = [a.mb for a in order if a.kind == "F" and a.stage == s]
                assert fwd == sorted(fwd), (name, limit, m, s, fwd)


@pytest.mark.parametrize("p,m,costs", [(4, 16, (10.419, 10.207, 7.715, 0.408)), (8, 16, (18.522, 18.086, 9.337, 0.601)),
                                       (8, 32, (43.8, 59.2, 32.0, 0.5))])
def test_round_variants_reuse_a_tolerant_try_only_where_exact_comparisons_decide_the_same(p, m, costs, monkeypatch):
    """vrounds: the exact-comparison rerun of a try is skipped where no comparison of the tolerant
    try fell in (0, 1e-9]; the variants (orders and policy, in order) are those of running every
    try again. (These settings have comparisons within 1e-9, so the exact reruns happen: all
    reused at P=4 and P=8 M=32, all but one at P=8 M=16.)"""
    from megatron_zb.core.schedules.search import vrounds
    f, b, w, c = costs
    st = Setting(p, m, chunks=2, cost_f=f, cost_b=b, cost_w=w, cost_comm=c, mem_w=32 * 6144 / (34 * 6144 + 5 * 48 * 1024))
    lim = 2.0 * p
    got = vrounds.v_round_variants(st, lim, "v-auto")
    real = vrounds._try

    def always_rerun(*a):
        orders, key, (near, _), idle = real(*a)
        return orders, key, (near, True), idle
    monkeypatch.setattr(vrounds, "_try", always_rerun)
    want = vrounds.v_round_variants(st, lim, "v-auto")
    assert [(s.orders, s.meta) for s in got] == [(s.orders, s.meta) for s in want]
