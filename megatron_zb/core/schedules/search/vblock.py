"""Schedules from a periodic building block with real costs ("Pipeline Parallelism with
Controllable Memory", Qi et al. 2024), for any placement; used for the V family.

1. **Block.** One microbatch's passes get start times such that repeating them every
   ``period`` (T = the busiest rank's F+B+W of one microbatch, times an optional stretch) never
   overlaps on any rank: each rank's passes tile its period. The times are built along the
   dependency chain (all forwards from stage 0 to the last, then all backwards back to stage 0;
   each W after its B): every pass starts at the earliest moment its input is there and a gap in
   the rank's period (taken modulo T) holds it while the rank's remaining passes still fit.
   A hop to a higher rank may wait ``down`` extra time units, a hop to a lower rank ``up``: the
   waits stretch activation lifespans, i.e. they trade memory (more microbatches in flight) for
   a fuller warm-up. The steady state of a block has no bubble (at stretch 1); its memory is
   the number of microbatches a rank holds at once.
2. **Repeat and squeeze.** Microbatch j's passes start at block time + j x T; each rank runs its
   passes in that order, as early as dependencies allow (the simulator). Order decides memory,
   so squeezing never raises it.
3. **Reorder warm-up and cool-down** (``compact``): in block-time order, each pass moves to the
   earliest idle time on its rank at or after its inputs that ends by its own block time, if the
   rank's memory stays under the limit. Passes still to come keep their block times, so every
   move is safe. Then the W's are placed again (``refill_w``): each rank keeps its F/B order and
   runs its oldest pending W when its next F/B is not there yet (or memory needs it), and the
   result is timed again; a few rounds until the makespan stops falling. Steps 2 and 3 live in
   ``vpolish`` (``polish``).

``search`` builds blocks over a small grid of (stretch, down, up), keeps those that fit the
memory limit, scores the ones that use the most memory (``probe`` per stretch) on a run of 2p+4
microbatches (warm-up and cool-down are where blocks differ) and finishes the best two.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...ir import B, F, Placement, Schedule, ScheduleError, Setting, W
from ...ir.memo import Memo, copy_schedule, setting_key
from .improve import lower_bound
from .vpolish import KIND_ORDER, Window, compact, orders_by_time, polish, polish_run, refill_w, score  # noqa: F401

EPS = 1e-9
Key = Tuple[str, int, int]  # (kind, stage, microbatch)

# -- 1. the building block ------------------------------------------------------------------------


def _free_arcs(busy: List[Tuple[float, float]], period: float) -> List[Tuple[float, float]]:
    """Free (start, length) arcs of a period holding ``busy`` (start mod period, duration)."""
    if not busy:
        return [(0.0, period)]
    iv = sorted(busy)
    arcs = []
    for k, (a, d) in enumerate(iv):
        nxt = iv[k + 1][0] if k + 1 < len(iv) else iv[0][0] + period
        gap = nxt - (a + d)
        if gap > EPS:
            arcs.append(((a + d) % period, gap))
    return arcs


def _packs(items: Sequence[float], arcs: List[Tuple[float, float]]) -> bool:
    """Can ``items`` (durations) be laid into the free arcs without overlapping?"""
    items = sorted((x for x in items if x > EPS), reverse=True)  # zero-cost passes fit anywhere
    room = sorted((length for _, length in arcs), reverse=True)

    def fill(k: int) -> bool:
        if k == len(items):
            return True
        tried = set()
        for j, r in enumerate(room):
            if r + EPS < items[k] or round(r, 9) in tried:
                continue
            tried.add(round(r, 9))
            room[j] -= items[k]
            ok = fill(k + 1)
            room[j] += items[k]
            if ok:
                return True
        return False

    return fill(0)


def _place(busy, rest: List[float], ready: float, d: float, period: float) -> float:
    """Earliest t >= ready where [t, t+d) is free modulo the period and ``rest`` still fits."""
    if d <= EPS:
        return ready
    sums = {0.0}
    for x in rest:
        sums |= {s + x for s in sums}
    best = None
    for a, length in _free_arcs(busy, period):
        if length + EPS < d:
            continue
        first = ready - ((ready - a) % period)  # the arc's latest occurrence starting <= ready
        for occ in (first, first + period):
            for off in sorted(sums | {ready - occ}):
                t = occ + off
                if t < ready - EPS or off < -EPS or off + d > length + EPS:
                    continue
                if _packs(rest, _free_arcs(busy + [(t % period, d)], period)):
                    if best is None or t < best:
                        best = t
                    break
    if best is None:  # cannot happen: the previous step checked that this pass fits
        raise ScheduleError("building block: no room for a pass in its rank's period")
    return best


def chain(placement: Placement) -> List[Tuple[str, int]]:
    """One microbatch's F and B passes in dependency order."""
    n = placement.num_stages
    return [(F, s) for s in range(n)] + [(B, s) for s in reversed(range(n))]


def period_of(setting: Setting, placement: Placement, stretch: float = 1.0) -> float:
    """The busiest rank's F+B+W for one microbatch (all its chunks), times ``stretch``."""
    st = dataclasses.replace(setting, chunks=placement.chunks)
    return stretch * max(sum(st.pass_cost(k, r, s) for s in placement.stages_of(r) for k in (F, B, W))
                         for r in range(placement.num_ranks))


def building_block(setting: Setting, placement: Placement, period: float, down: float = 0.0,
                   up: float = 0.0, reverse: bool = False) -> Dict[Tuple[str, int], float]:
    """Start time of each pass (kind, stage) of one microbatch; repeating every ``period`` is
    overlap-free on every rank. ``reverse`` builds the F/B chain from its end, backwards in
    time: the backward passes then pack tightly and the forwards absorb the waits (often less
    memory when B costs more than F)."""
    pl = placement
    st = dataclasses.replace(setting, chunks=pl.chunks)
    cost = lambda k, s: st.pass_cost(k, pl.rank_of(s), s)  # noqa: E731
    busy: List[List[Tuple[float, float]]] = [[] for _ in range(pl.num_ranks)]
    rest = [[cost(k, s) for s in pl.stages_of(r) for k in (F, B, W)] for r in range(pl.num_ranks)]
    start: Dict[Tuple[str, int], float] = {}

    def put(kind: str, s: int, ready: float) -> None:
        r, d = pl.rank_of(s), cost(kind, s)
        rest[r].remove(d)
        t = _place(busy[r], rest[r], ready, d, period)
        if d > EPS:  # a zero-cost pass takes no room
            busy[r].append((t % period, d))
        start[(kind, s)] = t

    prev = None
    for kind, s in (reversed(chain(pl)) if reverse else chain(pl)):
        ready = 0.0
        if prev is not None:
            ready = start[prev] + cost(*prev)
            r0, r1 = pl.rank_of(prev[1]), pl.rank_of(s)
            if r0 != r1:  # ``down``/``up`` name the direction in forward time
                ready += setting.cost_comm + (down if (r1 > r0) != reverse else up)
        put(kind, s, ready)
        prev = (kind, s)
    if reverse:  # back to forward time, first pass at 0
        start = {k: -(t + cost(*k)) for k, t in start.items()}
        busy = [[((-(a + d)) % period, d) for a, d in b] for b in busy]
        t0 = min(start.values())
        start = {k: t - t0 for k, t in start.items()}
        busy = [[((a - t0) % period, d) for a, d in b] for b in busy]
    for _, s in chain(pl)[pl.num_stages:]:
        put(W, s, start[(B, s)] + cost(B, s))
    return start


def unroll(block: Dict[Tuple[str, int], float], period: float, m: int) -> Dict[Key, float]:
    return {(k, s, j): t + j * period for (k, s), t in block.items() for j in range(m)}


# -- search -----------------------------------------------------------------------------------

STRETCHES = (1.0, 1.1, 1.2, 1.35, 1.5)
DOWN = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)  # in units of one period / 6 (one unit-cost chunk pass on V)
UP = (0.0, 0.5, 1.0)


def block_peak(setting: Setting, placement: Placement, block, period: float, m: int) -> float:
    """Peak memory of the block repeated m times (memory depends on the order only)."""
    st = dataclasses.replace(setting, chunks=placement.chunks)
    times = unroll(block, period, m)
    rank = placement.stage_to_rank
    mem = {(k, s): st.pass_mem(k, rank[s], s) for k in (F, B, W) for s in range(placement.num_stages)}
    cur = [0.0] * placement.num_ranks
    top = [0.0] * placement.num_ranks
    for k in sorted(times, key=lambda k: (times[k], KIND_ORDER[k[0]], k[1] if k[0] == F else -k[1], k[2])):
        r = rank[k[1]]  # each rank's running sum in its order (``orders_by_time``), as peak_memory
        cur[r] += mem[k[0], k[1]]
        if cur[r] > top[r]:
            top[r] = cur[r]
    return max(top)


#: the blocks of a setting (``_blocks``), whatever the limit: the V searches of one plan share them
_GRIDS = Memo(8)
#: the polishes of this process (``_polished``): per start, each with the limits it holds under
_POLISHED = Memo(256)


def _blocks(st: Setting, placement: Placement, short: int) -> List[tuple]:
    """Every distinct block of the grid as (-peak, stretch, down, up, reverse, block, period), the
    peak counted over ``short`` microbatches at most (remembered: ``memo``)."""
    def build() -> List[tuple]:
        unit = period_of(st, placement) / 6
        out, seen = [], set()
        for stretch, down, up, reverse in itertools.product(STRETCHES, DOWN, UP, (False, True)):
            period = period_of(st, placement, stretch)
            blk = building_block(st, placement, period, down * unit, up * unit, reverse)
            sig = tuple(sorted((k, round(t % period, 6), int((t + EPS) // period)) for k, t in blk.items()))
            if sig in seen:
                continue
            seen.add(sig)
            span = max(blk.values()) - min(blk.values())
            peak = block_peak(st, placement, blk, period, min(short, int(span / period) + 3))
            out.append((-peak, stretch, down, up, reverse, blk, period))
        return out

    key = (setting_key(dataclasses.replace(st, memory_limit=None)), placement, short)
    return _GRIDS.get(key, build)


def search(setting: Setting, placement: Placement, limit: float, name: str, probe: int = 2,
           extra: Sequence[Tuple[str, Callable[[int], Dict[Key, float]]]] = ()) -> Optional[Schedule]:
    """The best block schedule under ``limit`` (None if nothing fits). ``extra``: more starting
    points, (label, microbatches -> timing), e.g. the paper's unit-slot blocks, reordered the
    same way."""
    st = dataclasses.replace(setting, chunks=placement.chunks)
    m = st.microbatches
    short = min(m, 2 * placement.num_ranks + 4)
    short_st = dataclasses.replace(st, microbatches=short)
    unit = period_of(st, placement) / 6
    if unit <= EPS:  # nothing costs time: any valid order is optimal, leave it to the others
        return None
    blocks = [c for c in _blocks(st, placement, short) if -c[0] <= limit + 1e-9]
    # per stretch, the blocks that use the most memory (long lifespans fill the warm-up best)
    blocks.sort(key=lambda c: c[:5])
    if placement.num_ranks * short > 1024:  # big pipelines: one block per stretch
        probe = 1
    chosen = [c for k, c in enumerate(blocks) if sum(1 for d in blocks[:k] if d[1] == c[1]) < probe]
    starts = [(f"block stretch={c[1]:g} down={c[2]:g} up={c[3]:g}" + (" reverse" if c[4] else ""),
               lambda mb, blk=c[5], period=c[6]: unroll(blk, period, mb)) for c in chosen]
    starts += list(extra)
    floor = lower_bound(short_st, placement, limit) + 1e-9
    scored = []
    states = [[] for _ in starts]  # where the short run is the whole run, the full polish goes on from it
    acts: Dict[int, dict] = {short: {}, m: {}}  # each pass's Action, made once
    base = (setting_key(dataclasses.replace(st, memory_limit=None)), placement, short)
    for k, (label, timing) in enumerate(starts):
        s, res = _polished(base + (label, "short"), limit, name, states[k] if short == m else None, None,
                           lambda w, k=k, timing=timing: polish_run(short_st, placement, timing(short), limit, 2,
                                                                    states[k] if short == m else None, acts[short], w))
        if s is not None:
            scored.append((score(res), k))
            if scored[-1][0][0] <= floor:  # cannot be beaten
                break
    scored.sort()
    best, best_res = None, None
    for _, k in scored[:2 if st.stages * m <= 2048 else 1]:
        label, timing = starts[k]
        if short == m:
            s, res = _polished(base + (label, "more"), limit, name, states[k], base + (label, "short"),
                               lambda w, k=k: polish_run(st, placement, None, limit, 1, states[k], acts[m], w))
        else:
            s, res = _polished(base + (label, "long"), limit, name, None, None,
                               lambda w, timing=timing: polish_run(st, placement, timing(m), limit, 3, None,
                                                                   acts[m], w))
        if s is None:
            continue
        if best_res is None or score(res) < score(best_res):
            best, best_res = s, res
            best.meta = {"start": label}
    return best


def _polished(key: tuple, limit: float, name: str, state: Optional[list], after: Optional[tuple], run):
    """``run(window)`` (a ``polish_run``: (schedule, run)), remembered with its ``Window``: a
    polish of the same start under another limit whose checks all come out the same is the same
    polish (v-auto's ladder polishes the same blocks under up to five limits; at P=16 most of them
    decide alike). ``state``: the list ``polish_run`` leaves its state in, restored on a hit;
    ``after``: the key of the polish this one goes on from (its checks count too)."""
    kept = _POLISHED.get(key, list)
    for window, (s, res, left) in kept:
        if window.holds(limit):
            if state is not None:
                state[:] = left
            return (copy_schedule(s, name) if s is not None else None), res
    window = Window()
    if after is not None:  # the window of the polish this one goes on from
        prior = next(w for w, _ in _POLISHED.get(after, list) if w.holds(limit))
        window.need, window.refused = prior.need, prior.refused
    s, res = run(window)
    kept.append((window, (s, res, list(state) if state is not None else None)))
    return (copy_schedule(s, name) if s is not None else None), res
