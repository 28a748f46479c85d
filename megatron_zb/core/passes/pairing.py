"""Overlapped F&B pairs formed in a built schedule (MoE expert parallelism, issue 27).

With an all-to-all in every F, B and BW (``Setting.cost_a2a``), a forward and a backward of two
different microbatches that run together hide each one's dispatch/combine behind the other's
compute (DualPipe's overlapped F&B, Megatron's combined 1F1B); the simulator charges such a pair
as ``simulate.paired_cost`` says and starts it once both passes have their inputs.

``form_pairs`` is a pure post-pass over a built schedule: its candidates are the plain F directly
followed by a plain B or BW on a rank's list (nothing between them, so after lowering only
messages lie between the two, which is what a runtime needs to run them together) of different
microbatches (a backward of the forward's own microbatch waits for it). It tries every candidate,
then only those whose backward has its input by the time the forward starts (read off the
unpaired simulation), and drops pairs that make the schedule deadlock (a pair waits for both
inputs). Where a rank's forward and backward meet only with one microbatch (the last stage of a
1F1B-like order: F k, B k, F k+1, B k+1, ...), it can move the rank's forwards one backward earlier
(``advance_forwards``: Megatron's extra warm-up forward of combined 1F1B), holding one more
activation: only where the rank's peak stays within the memory limit, else within the schedule's
own peak (the largest over its ranks), tried on every such rank at once, then rank by rank. Last,
it drops the pairs of one rank at a time (once over the ranks) where that shortens the iteration. Everything is kept
only where the simulated iteration gets shorter. Without an all-to-all, or with ``a2a_overlap``
off, nothing changes.

Pure Python, no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

from ..ir import BW, OFFLOAD_KINDS, OVERLAP, Action, B, F, Schedule, Setting, deps
from ..sim.simulate import Deadlock, peak_memory, simulate

__all__ = ["form_pairs", "candidates", "advance_forwards"]

EPS = 1e-9
Cand = Tuple[int, int, int]  # (rank, position of the F in the rank's list, index of the F among its compute passes)


@dataclass
class _Found:
    makespan: float
    unpaired: Schedule  # the orders the pairs were formed in
    pairs: FrozenSet[Cand]
    schedule: Schedule  # ``unpaired`` with ``pairs`` formed


def candidates(schedule: Schedule) -> List[Cand]:
    """Every plain F directly followed by a plain B or BW of another microbatch."""
    out = []
    for r, order in enumerate(schedule.orders):
        n = 0  # compute passes so far (an overlapped pair counts two)
        for j, a in enumerate(order):
            nxt = order[j + 1] if j + 1 < len(order) else None
            if a.kind == F and a.parts is None and nxt is not None and nxt.kind in (B, BW) and nxt.parts is None \
                    and nxt.mb != a.mb:
                out.append((r, j, n))
            n += 2 if a.kind == OVERLAP else int(a.is_compute)
    return out


def form_pairs(schedule: Schedule, setting: Setting) -> Schedule:
    """``schedule`` with the overlapped F&B pairs (and forwards advanced) that shorten its
    simulated iteration (see the module doc); ``schedule`` itself where nothing does.
    ``meta['pairs_formed']`` counts the pairs formed here, ``meta['advanced_ranks']`` lists the
    ranks whose forwards moved one backward earlier."""
    if not setting.a2a_overlap or not any(setting.cost_a2a):
        return schedule
    if setting.chunks != schedule.placement.chunks:
        setting = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    base = simulate(schedule, setting)
    best = _best_pairs(schedule, setting, base)
    if not any(a.kind in OFFLOAD_KINDS for o in schedule.orders for a in o):
        best = _advance(schedule, setting, base, best)
    if best is None:
        return schedule
    best = _refine(best, setting)  # last, drop one rank's pairs at a time while that shortens it
    return best.schedule


def _advance(schedule: Schedule, setting: Setting, base, best: Optional[_Found]) -> Optional[_Found]:
    """Forwards one backward earlier (Megatron's extra warm-up forward of combined 1F1B) on the
    ranks that stay within the memory budget (the memory limit, else the schedule's own peak):
    on all such ranks at once, then a rank at a time, wherever the iteration gets shorter."""
    budget = (setting.memory_limit if setting.memory_limit is not None else max(base.peak_memory)) + EPS
    moved = [advance_forwards(o) for o in schedule.orders]
    fits = [moved[r] != o and peak_memory(moved[r], r, setting) <= budget for r, o in enumerate(schedule.orders)]
    if not any(fits):
        return best
    state = [False] * schedule.num_ranks
    limit = base.makespan if best is None else best.makespan

    def trial(ranks) -> Optional[_Found]:
        sched = dataclasses.replace(schedule, orders=[moved[r] if ranks[r] else o
                                                       for r, o in enumerate(schedule.orders)],
                                    meta=dict(schedule.meta, advanced_ranks=[r for r in range(len(ranks)) if ranks[r]]))
        try:
            res = simulate(sched, setting)
        except Deadlock:
            return None
        return _best_pairs(sched, setting, res)

    tries = [list(fits)] + [r for r in range(len(fits)) if fits[r]]
    for t in tries:  # every rank that fits at once, then one rank at a time from where the search stands
        ranks = t if isinstance(t, list) else state[:t] + [not state[t]] + state[t + 1:]
        got = trial(ranks)
        if got is not None and got.makespan < limit - EPS:
            best, state, limit = got, ranks, got.makespan
    return best


def advance_forwards(order: List[Action]) -> List[Action]:
    """Every forward after a backward moved to just before the last backward (B or BW) that
    precedes it since the previous forward: ``B x, W, F y`` becomes ``F y, B x, W``, so each
    forward meets a backward of another microbatch (Megatron's one extra warm-up forward)."""
    out: List[Action] = []
    last_b = None
    for a in order:
        if a.kind == F and a.parts is None:
            if last_b is not None:
                out.insert(last_b, a)
                last_b = None
            else:
                out.append(a)
            continue
        out.append(a)
        if a.kind in (B, BW) and a.parts is None:
            last_b = len(out) - 1
        elif a.kind == OVERLAP:
            last_b = None
    return out


def _best_pairs(schedule: Schedule, setting: Setting, base) -> Optional[_Found]:
    """The better of two sets of pairs in ``schedule``'s orders (``base``: its unpaired
    simulation): every candidate, and those whose backward has its inputs by the time the forward
    starts; None where neither shortens the iteration."""
    cands = candidates(schedule)
    best = None
    for chosen in (cands, _ready_in_time(cands, schedule, base, setting)):
        got = _feasible(schedule, setting, frozenset(chosen)) if chosen else None
        if got is not None and got.makespan < (base.makespan if best is None else best.makespan) - EPS:
            best = got
    return best


def _refine(best: _Found, setting: Setting) -> _Found:
    """Drop one rank's pairs at a time (once over the ranks) where that shortens the iteration."""
    for r in sorted({c[0] for c in best.pairs}):
        got = _feasible(best.unpaired, setting, frozenset(c for c in best.pairs if c[0] != r))
        if got is not None and got.makespan < best.makespan - EPS:
            best = got
    return best


def _apply(schedule: Schedule, chosen: FrozenSet[Cand]) -> Schedule:
    at = {(r, j) for r, j, _ in chosen}
    orders = []
    for r, order in enumerate(schedule.orders):
        out, j = [], 0
        while j < len(order):
            if (r, j) in at:
                out.append(Action.overlap(order[j], order[j + 1]))
                j += 2
            else:
                out.append(order[j])
                j += 1
        orders.append(out)
    # a generator's lower bound counts every all-to-all serial: it does not bound the pairs
    meta = {k: v for k, v in schedule.meta.items() if k not in ("overlap_pairs", "lower_bound", "gap_to_lower_bound")}
    meta["pairs_formed"] = len(chosen)
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, orders, meta)


def _feasible(schedule: Schedule, setting: Setting, chosen: FrozenSet[Cand]) -> Optional[_Found]:
    """``schedule`` with ``chosen`` paired, less the pairs that wait for each other (a pair starts
    once both passes have their inputs: where that deadlocks, the simulator runs the pairs the
    stuck ranks wait in as plain passes, which times the rest exactly as with those left out);
    None if none is left."""
    unpaired = set()
    try:
        res = simulate(_apply(schedule, chosen), setting, unpaired=unpaired)
    except Deadlock:  # not the pairs' doing
        return None
    if unpaired:
        chosen = frozenset(c for c in chosen if (c[0], c[2]) not in unpaired)
    if not chosen:
        return None
    return _Found(res.makespan, schedule, chosen, _apply(schedule, chosen))


def _ready_in_time(cands: List[Cand], schedule: Schedule, base, setting: Setting) -> List[Cand]:
    """The candidates whose backward has its inputs by the time the forward starts (unpaired)."""
    pl = schedule.placement
    done = {}
    for tl in base.timeline:
        for t in tl:
            a = t.action
            done[(a.kind, a.stage, a.mb)] = t.end
            if a.kind in (B, BW):
                done[("B*", a.stage, a.mb)] = t.end
    out = []
    for r, j, n in cands:
        f, b = base.timeline[r][n], schedule.orders[r][j + 1]
        ready = max([done[d] + (setting.cost_comm if pl.rank_of(d[1]) != r else 0.0)
                     for d in deps(b, pl.num_stages, pl)], default=0.0)
        if ready <= f.start + EPS:
            out.append((r, j, n))
    return out
