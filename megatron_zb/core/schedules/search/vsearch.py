"""The V family's searches (rank r holds stages r and 2p-1-r, so embedding and loss both live on
rank 0), all with the real per-stage costs, on ``auto``'s machinery (ranking, local search,
ladder, memory tie-break):

* v-auto: under a memory limit (default p x mem-f), the best of (a) building-block schedules
  (``vblock.py``: a periodic block of one microbatch's passes, repeated, squeezed, warm-up and
  cool-down reordered, W's refilled; searched over the block's period and hop waits), (b) the
  paper's unit-slot V-Half/V-Min blocks reordered the same way, where they fit, and (c) the
  memory-bounded greedy variants.
* zb-v: v-auto at 1F1B's peak (p x mem-f): zero bubble at equal costs when m >= 2p.
* v-half / v-min: v-auto at the peak memory of the paper's V-Half / V-Min block (about half /
  a third of 1F1B's: p/2 + 1 and p/3 + 1 x mem-f with the default mem-w); the block itself is a
  candidate, so a schedule always exists. Near a third of 1F1B's memory a block's steady state
  needs more than F+B+W per microbatch once F, B and W differ: V-Min's bubble grows with the
  imbalance (the paper says the same).

Deterministic, as ``auto``'s searches.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

from ...ir import Action, B, F, Placement, Schedule, ScheduleError, Setting, W
from ...ir.memo import Memo, copy_schedule, setting_key
from ...sim.simulate import simulate
from . import vblock, vslots
from .auto import (NOISE, TIE, Finish, check_effort, f1b_peak, finish_search, least_memory_of, pass_count,
                   rank_candidates, remembered, search_candidates, unit)
from .bounds import lower_bound
from .evaluate import Coder
from .greedy import best_of
from .vrounds import v_round_variants

#: the V searches done in this process (``memo``): zb-v's is v-auto's at 1F1B's peak, and plan asks
#: for some of them more than once
_DONE = Memo(32)


def _v_rounds_kept(st: Setting, limit: float, name: str) -> List[Schedule]:
    return v_round_variants(st, limit, name, keep=4)


def _v_setting(setting: Setting) -> Setting:
    return dataclasses.replace(setting, chunks=2)


def block_schedule(p: int, m: int, offsets: Callable[[int], List[int]], name: str) -> Schedule:
    """The paper's unit-slot block: one microbatch's F (chunk 0), f, B (chunk 1), b at the slot
    offsets of its rank, repeated every 6 slots; each W in the first free slot after its B."""
    orders = []
    for i in range(p):
        used, events = set(), []
        for k in range(m):
            for off, kind, stage in zip(offsets(i), (F, F, B, B), (i, 2 * p - 1 - i, 2 * p - 1 - i, i)):
                t = off + 6 * k
                if t in used:
                    raise ScheduleError(f"{name}: building block collides on rank {i} (slot {t})")
                used.add(t)
                events.append((t, kind, stage, k))
        for t, kind, stage, k in sorted(events):
            if kind == B:
                u = t + 1
                while u in used:
                    u += 1
                used.add(u)
                events.append((u, W, stage, k))
        orders.append([Action(kind, stage, k) for _, kind, stage, k in sorted(events)])
    return Schedule(name, Placement.vshape(p), m, orders)


def v_half_offsets(p: int):
    d = 3 if p % 2 == 0 else 0
    return lambda i: [2 * i, 3 * p - i - 2, 3 * p + d + 2 * i - 1, 6 * p + d - i - 2]


def v_min_offsets(p: int):
    d = 2 if p % 3 == 0 else 0
    return lambda i: [i, 2 * p - i - 1, 2 * p + d + i, 4 * p + d - i - 1]


def _paper_block(setting: Setting, name: str) -> Optional[Schedule]:
    offsets = {"v-half": v_half_offsets, "v-min": v_min_offsets}[name]
    try:
        return block_schedule(setting.stages, setting.microbatches, offsets(setting.stages), name)
    except ScheduleError:
        return None


def _timing(schedule: Schedule, setting: Setting) -> Dict:
    res = simulate(schedule, setting)
    return {(t.action.kind, t.action.stage, t.action.mb): t.start for tl in res.timeline for t in tl}


def _v_search(name: str, setting: Setting, limit: Optional[float] = None, sim: Optional[list] = None,
              tie: float = TIE, effort: str = "full") -> Schedule:
    """``_v_searched``, remembered (``memo``): zb-v's search is v-auto's at 1F1B's peak. The
    search reads its limit from ``limit`` alone, and ``name`` only labels what it builds."""
    check_effort(effort)
    if sim is not None:
        return _v_searched(name, setting, limit, sim, tie, effort)
    st = dataclasses.replace(_v_setting(setting), memory_limit=None)
    found = _DONE.get(("v", setting_key(st), name if limit is None else limit, tie, effort),
                      lambda: _v_searched(name, st, limit, None, tie, effort))
    return copy_schedule(found, name)


def _v_searched(name: str, setting: Setting, limit: Optional[float], sim: Optional[list],
                tie: float, effort: str = "full") -> Schedule:
    """The best V schedule under ``limit``; v-half / v-min (limit None) take the peak memory of
    the paper's block of that name. Candidates, each family only while the best so far is above
    the lower bound: the round heuristic (``vrounds``), the paper's V-Half / V-Min blocks, the
    real-cost building blocks (``vblock``; on big settings only when nothing else fits), the
    unit-slot building blocks (``vslots``; small settings) and the greedy variants. ``effort``
    'quick' (``EFFORTS``): neither kind of building block (the real-cost ones only where nothing else
    fits) and the local search of the best two candidates at zb-auto's length."""
    st = _v_setting(setting)
    p, m = st.stages, st.microbatches
    pl = Placement.vshape(p)
    paper = {n: _paper_block(st, n) for n in ("v-half", "v-min")}
    coder = Coder.of(st, pl, m)
    peak = {n: max(coder.peak(o) for o in coder.encode(s.orders)) for n, s in paper.items() if s is not None}
    if limit is None:  # the paper's memory; its formula where its block does not fit this p
        limit = peak.get(name, (p / 2 + 1 if name == "v-half" else p / 3 + 1) * unit(st, pl))
    fits = [n for n in peak if peak[n] <= limit + 1e-9]
    cands = [paper[n] for n in fits]
    lb = lower_bound(st, pl, limit)
    small = p * m <= 1024 and effort == "full"
    # Which building blocks are worth their time (``benchmarks/bench_v_families.py``): the
    # unit-slot ones only under 1F1B's peak; at 1F1B's peak itself (zb-v's limit) the real-cost
    # ones only on the smallest settings. On the authors' grid (bench_vs_authors: P 4..16, 120
    # settings at each limit) and Llama-shaped chunk costs they found nothing shorter or leaner
    # there, for most of the search's time (P=16, M=32: ~15 and ~4 of ~20 s); under 1F1B's peak
    # both gain up to 17%, above it the real-cost ones up to 1.6%
    one = p * unit(st, pl)
    unit_slots = small and limit < one * (1 - 1e-9)
    real_cost = small and (p * m <= 64 or abs(limit - one) > 1e-9 * max(1.0, one))

    def optimal() -> bool:
        ranked = rank_candidates(cands, st, limit)
        return bool(ranked) and ranked[0][0][0] <= lb + 1e-9

    rounds = remembered(_v_rounds_kept, st, limit, name=name)
    cands += rounds
    greedy = pass_count(st) * p <= 150_000
    if effort == "quick" and not rounds and greedy:  # the greedy variants before the blocks: they cost less
        try:
            cands.append(remembered(best_of, st, pl, limit, name=name))
        except ScheduleError:
            pass
        greedy = False
    # the real-cost blocks where nothing else was found (quick: no candidate fits at all)
    nothing = not rounds if effort == "full" else not rank_candidates(cands, st, limit)
    if not optimal() and (real_cost or nothing):
        # those blocks, timed with the real costs, are starting points for reordering too
        extra = [(f"paper {n} block",
                  lambda mb, n=n: _timing(_paper_block(dataclasses.replace(st, microbatches=mb), n),
                                          dataclasses.replace(st, microbatches=mb))) for n in fits]
        blocks = vblock.search(st, pl, limit, name, extra=extra)
        if blocks is not None:
            cands.append(blocks)
    if not optimal() and unit_slots:
        cands += vslots.search(st, limit, name, keep=4)
    chunk = max(st.pass_mem(F, pl.rank_of(s), s) for s in range(pl.num_stages))
    ranked = search_candidates(name, st, pl, limit, cands, (chunk, f1b_peak(st, pl)),
                               other=lambda x: vblock.search(st, pl, x, name), greedy_too=greedy and not optimal())
    # on small settings V searches end in narrow basins: more starting points and a longer
    # search than zb-auto's (at p=16 m=16 a start 0.3% worse ends 0.3% better); the quick effort
    # searches from the best two (its third start never ended best: 144 settings of P 4..16, M
    # 8..64, three cost shapes, zb-v, v-half, v-min and v-auto at 2P, and six plans, the same
    # schedules for 7% less time; from one alone 9 of them up to 3.9% slower)
    top = 5 if small else 3 if effort == "full" else 2
    return finish_search(ranked, st, limit, name, Finish(top, 1_000_000 if small else 250_000, tie), lb=lb, sim=sim)


def zb_v(setting: Setting, effort: str = "full") -> Schedule:
    st = _v_setting(setting)
    return _v_search("zb-v", setting, f1b_peak(st, Placement.vshape(st.stages)), effort=effort)


def v_half(setting: Setting, effort: str = "full") -> Schedule:
    return _v_search("v-half", setting, effort=effort)


def v_min(setting: Setting, effort: str = "full") -> Schedule:
    return _v_search("v-min", setting, effort=effort)


def v_auto(setting: Setting, memory: bool = True, sim: Optional[list] = None, effort: str = "full",
           finish: Optional[Callable] = None) -> Schedule:
    """``memory``, ``sim``, ``effort`` and ``finish``: as zb-auto's."""
    check_effort(effort)
    st = _v_setting(setting)
    limit = (setting.memory_limit if setting.memory_limit is not None
             else f1b_peak(st, Placement.vshape(st.stages)))
    if not memory:
        return _v_search("v-auto", setting, limit, sim, tie=NOISE, effort=effort)
    return least_memory_of(lambda lim: _v_search("v-auto", setting, lim, effort=effort), st,
                            Placement.vshape(st.stages), limit, "v-auto", effort, finish)
