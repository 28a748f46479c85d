"""Building-block V schedules (core/schedules/search/vblock.py) and what the V family claims with them."""
import dataclasses
import itertools

import pytest
from hypothesis import given, settings, strategies as stg

from megatron_zb.core.ir import B, F, W, Placement, Schedule, Setting
from megatron_zb.core.schedules import generate
from megatron_zb.core.schedules.search import vblock
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate

H100 = dict(cost_f=43.8, cost_b=59.2, cost_w=32.0, cost_comm=0.5)  # measured, README


def v_setting(p, m, **kw):
    return Setting(p, m, chunks=2, **kw)


def run(name, p, m, **kw):
    st = Setting(p, m, **kw)
    s = generate(name, st)
    st = dataclasses.replace(st, chunks=s.placement.chunks)
    validate(s, st)
    return s, simulate(s, st)


@given(p=stg.integers(1, 6), f=stg.sampled_from([0.5, 1, 1.3]), b=stg.sampled_from([1, 1.35, 2]),
       w=stg.sampled_from([0, 0.4, 0.73, 1]), comm=stg.sampled_from([0, 0.1]),
       stretch=stg.sampled_from(vblock.STRETCHES), down=stg.sampled_from([0, 1]), up=stg.sampled_from([0, 0.5]),
       reverse=stg.booleans())
@settings(max_examples=60, deadline=None)
def test_block_tiles_its_period_and_respects_dependencies(p, f, b, w, comm, stretch, down, up, reverse):
    st = v_setting(p, 4, cost_f=f, cost_b=b, cost_w=w, cost_comm=comm)
    pl = Placement.vshape(p)
    period = vblock.period_of(st, pl, stretch)
    blk = vblock.building_block(st, pl, period, down, up, reverse)
    assert len(blk) == 3 * 2 * p
    cost = lambda k, s: st.pass_cost(k, pl.rank_of(s))  # noqa: E731
    for r in range(p):  # repeated every period, a rank's passes never overlap
        iv = [(blk[(k, s)] % period, cost(k, s)) for s in pl.stages_of(r) for k in (F, B, W) if cost(k, s) > 0]
        for (a, da), (c, dc) in itertools.combinations(iv, 2):
            assert (c - a) % period >= da - 1e-9 and (a - c) % period >= dc - 1e-9
    for (k, s), t in blk.items():  # every pass starts after its inputs (comm across ranks)
        if k == W:
            assert t >= blk[(B, s)] + cost(B, s) - 1e-9
        prev = [(F, s - 1)] if k == F and s > 0 else ([(B, s + 1)] if k == B and s < 2 * p - 1 else
                                                       ([(F, s)] if k == B else []))
        for q in prev:
            hop = comm if pl.rank_of(q[1]) != pl.rank_of(s) else 0
            assert t >= blk[q] + cost(*q) + hop - 1e-9
    # repeating it: no steady-state bubble at stretch 1 (the period is the busiest rank's work)
    m = 40
    order = vblock.orders_by_time(pl, vblock.unroll(blk, period, m))
    res = simulate(Schedule("blk", pl, m, order), st)
    assert res.makespan <= (m - 1) * period + (max(blk.values()) + max(w, b)) + 1e-6


@pytest.mark.parametrize("p,m,limit", [(4, 12, 3), (8, 24, 5), (5, 15, 4)])
def test_reordering_never_exceeds_the_limit_and_never_slows_down(p, m, limit):
    st = v_setting(p, m, cost_f=1, cost_b=2, cost_w=1)
    pl = Placement.vshape(p)
    period = vblock.period_of(st, pl, 1.2)
    blk = vblock.building_block(st, pl, period)
    peak = vblock.block_peak(st, pl, blk, period, m)
    limit = max(limit, peak)
    times = vblock.unroll(blk, period, m)
    squeezed = simulate(Schedule("x", pl, m, vblock.orders_by_time(pl, times)), st)
    moved = vblock.compact(st, pl, times, limit)
    assert all(moved[k] <= times[k] + 1e-9 for k in times)  # passes only move earlier
    s = vblock.polish(st, pl, times, limit, "x")
    validate(s, st, memory_limit=limit)
    assert simulate(s, st).makespan <= squeezed.makespan + 1e-9


def test_search_is_deterministic():
    st = v_setting(6, 14, cost_f=1, cost_b=1.4, cost_w=0.7, cost_comm=0.05)
    a = generate("v-auto", dataclasses.replace(st, memory_limit=4))
    b = generate("v-auto", dataclasses.replace(st, memory_limit=4))
    assert [[str(x) for x in o] for o in a.orders] == [[str(x) for x in o] for o in b.orders]


@pytest.mark.parametrize("limits", [(40.0, 12.0, 9.0, 7.5), (9.0, 40.0, 7.5, 12.0)])
def test_polishes_remembered_under_other_limits_are_the_ones_made_afresh(limits):
    """vblock remembers each polish with the window of limits its memory checks allow
    (``vpolish.Window``): under each limit, in either order, the search builds what it builds with
    nothing remembered; a limit above every check's amount hits what another limit polished."""
    st = v_setting(6, 16, cost_f=[1.0, 1.1, 0.9, 1.2, 1.0, 1.0, 1.3, 0.8, 1.0, 1.1, 1.0, 1.4], cost_b=2.1,
                   cost_w=0.8, cost_comm=0.05)
    pl = Placement.vshape(6)

    made = []

    def fresh(limit):
        vblock._POLISHED._data.clear()
        found = vblock.search(st, pl, limit, "v-auto")
        made.append(sum(len(e) for e in vblock._POLISHED._data.values()))
        return found

    alone = {x: fresh(x) for x in limits}
    vblock._POLISHED._data.clear()
    for x in limits:
        got = vblock.search(st, pl, x, "v-auto")
        assert (got is None) == (alone[x] is None)
        if got is not None:
            assert got.orders == alone[x].orders and got.meta == alone[x].meta
    kept = [w for entries in vblock._POLISHED._data.values() for w, _ in entries]
    assert kept and all(w.need <= w.refused for w in kept)
    assert len(kept) < sum(made)  # some limit took another's polishes
    w = vblock.Window()
    assert w.check(3.0, 4.0) and not w.check(5.0, 4.0) and w.holds(4.0) and w.holds(3.0) and not w.holds(5.0)
    assert not w.holds(2.0)  # a check of 3.0 passed: a limit under it would have refused it


@pytest.mark.parametrize("costs", [dict(cost_b=2), dict(cost_f=1, cost_b=1.35, cost_w=0.73),
                                   dict(cost_f=1.3, cost_b=2.1, cost_w=0.7), dict(cost_b=1.1, cost_w=0.9)])
def test_v_half_at_half_memory_beats_1f1b_with_real_costs(costs):
    p, m = 8, 32
    _, one = run("1f1b", p, m, **costs)
    _, half = run("v-half", p, m, **costs)
    assert max(half.peak_memory) <= p / 2 + 1 + 1e-9
    assert half.makespan < one.makespan


@pytest.mark.parametrize("p", [4, 8])
def test_v_half_and_v_min_against_the_papers_bubbles_at_equal_costs(p):
    # the ZB fork's README: with F=B=W, V-Half has half of 1F1B's bubble, V-Min two thirds
    m = 3 * p
    _, one = run("1f1b", p, m, mem_w=1.0)
    _, half = run("v-half", p, m, mem_w=1.0)
    _, vmin = run("v-min", p, m, mem_w=1.0)
    assert half.bubble_rate <= one.bubble_rate / 2 + 0.005
    assert vmin.bubble_rate <= 2 * one.bubble_rate / 3 + 0.005


def test_zb_v_at_least_as_good_as_dualpipe_v_with_measured_costs():
    _, zbv = run("zb-v", 8, 32, **H100)
    _, dual = run("dualpipe-v", 8, 32, **H100)
    assert zbv.makespan <= dual.makespan + 1e-9
    assert max(zbv.peak_memory) <= 8 + 1e-9 < max(dual.peak_memory)


def test_v_auto_bubble_falls_steeply_past_half_memory():
    p, m = 8, 32
    rates = []
    for lim in (p / 3 + 1, p / 2 + 1, 0.75 * p, p):
        _, r = run("v-auto", p, m, cost_b=2, memory_limit=lim)
        assert max(r.peak_memory) <= lim + 1e-9
        rates.append(r.bubble_rate)
    assert rates == sorted(rates, reverse=True)
    assert rates[1] < rates[0] / 2  # from a third to about half of 1F1B's memory
