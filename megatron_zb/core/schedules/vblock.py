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
   result is timed again; a few rounds until the makespan stops falling.

``search`` builds blocks over a small grid of (stretch, down, up), keeps those that fit the
memory limit, scores the ones that use the most memory (``probe`` per stretch) on a run of 2p+4
microbatches (warm-up and cool-down are where blocks differ) and finishes the best two.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..ir import B, BW, F, W, Action, Placement, Schedule, ScheduleError, Setting
from ..simulate import peak_memory
from .evaluate import Coder, Run
from .improve import lower_bound
from .memo import Memo, setting_key

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


# -- 2./3. squeeze, reorder, refill -----------------------------------------------------------------

_KIND_ORDER = {F: 0, B: 1, BW: 1, W: 2}


def orders_by_time(placement: Placement, times: Dict[Key, float]) -> List[List[Action]]:
    orders: List[List[Action]] = [[] for _ in range(placement.num_ranks)]
    # ties (zero-cost passes) in dependency order: F by stage up, B by stage down, W last
    for k in sorted(times, key=lambda k: (times[k], _KIND_ORDER[k[0]], k[1] if k[0] == F else -k[1], k[2])):
        orders[placement.rank_of(k[1])].append(Action(*k))
    return orders


def _tables(setting: Setting, pl: Placement):
    """Each stage's rank and each (kind, stage)'s pass cost and memory change (chunks: the
    placement's)."""
    st = dataclasses.replace(setting, chunks=pl.chunks)
    rank = pl.stage_to_rank
    cost = {(k, s): st.pass_cost(k, rank[s], s) for k in (F, B, W, BW) for s in range(pl.num_stages)}
    mem = {(k, s): st.pass_mem(k, rank[s], s) for k in (F, B, W, BW) for s in range(pl.num_stages)}
    return rank, cost, mem


def _dep(kind: str, s: int, mb: int, nst: int) -> Optional[Key]:
    """``ir.deps`` of a pass of a plain placement (one input at most; 'B*': a B or a BW)."""
    if kind == F:
        return (F, s - 1, mb) if s > 0 else None
    if kind == W:
        return (B, s, mb)
    return ("B*", s + 1, mb) if s < nst - 1 else (F, s, mb)


def compact(setting: Setting, placement: Placement, times: Dict[Key, float], limit: float) -> Dict[Key, float]:
    """Move each pass, in time order, to the earliest idle time of its rank at or after its
    inputs that ends by its own time, unless an F would lift the rank's memory over ``limit``.
    ``times`` must be a valid timing of the passes (a block, or a simulated schedule)."""
    pl = placement
    nst = pl.num_stages
    p = pl.num_ranks
    rank, cost, mem = _tables(setting, pl)
    comm = setting.cost_comm
    placed: List[List[Tuple[float, float]]] = [[] for _ in range(p)]  # (start, mem change), by start
    gaps: List[List[List[float]]] = [[] for _ in range(p)]  # idle [start, end) between placed passes
    gap_ends: List[List[float]] = [[] for _ in range(p)]  # their ends, for bisect
    last_end = [0.0] * p
    total = [0.0] * p
    new: Dict[Key, float] = {}
    order = sorted(times, key=lambda k: (times[k], _KIND_ORDER[k[0]], k[1] if k[0] == F else -k[1], k[2]))
    for key in order:
        kind, s, mb = key
        r = rank[s]
        d = cost[key[:2]]
        dm = mem[key[:2]]
        own = times[key]
        ready = 0.0
        dep = _dep(kind, s, mb, nst)
        if dep is not None:
            dk, ds, dmb = dep
            dk = B if dk == "B*" else dk
            t = new.get((dk, ds, dmb))
            if t is None:
                dk = BW
                t = new[(dk, ds, dmb)]
            t += cost[dk, ds] + (comm if rank[ds] != r else 0.0)
            ready = max(ready, t)
        if mb > 0:  # a stage's passes of one kind stay in microbatch order
            t = new.get((kind, s, mb - 1))
            if t is not None:
                ready = max(ready, t)
        gr, ge = gaps[r], gap_ends[r]
        if own > last_end[r] + EPS:  # idle until this pass's own time: nothing else can start there
            if gr and abs(gr[-1][1] - last_end[r]) <= EPS:
                gr[-1][1] = ge[-1] = own
            else:
                gr.append([last_end[r], own])
                ge.append(own)
            last_end[r] = own
        at = None
        # the gaps ending before ready + d cannot hold the pass (they are sorted): skip them, unless
        # one of them starts after the pass's own time (the scan would stop there)
        rd = ready + d
        first = bisect.bisect_left(ge, True, key=lambda e: not e + EPS < rd)
        for i in range(first if first == 0 or gr[first - 1][0] <= own else len(gr), len(gr)):
            g0, g1 = gr[i]
            t = ready if ready > g0 else g0  # max(g0, ready), min(g1, own) below
            if t + d > (own if own < g1 else g1) + EPS:
                if g0 > own:
                    break
                continue
            if dm > 0 and not _room(placed[r], total[r], t, dm, limit):
                continue
            at = t
            pieces = [x for x in ([g0, t], [t + d, g1]) if x[1] - x[0] > EPS]
            gr[i:i + 1] = pieces
            ge[i:i + 1] = [x[1] for x in pieces]
            break
        if at is None:
            at = own
            last_end[r] = max(last_end[r], at + d)
        new[key] = at
        bisect.insort(placed[r], (at, dm))
        total[r] += dm
    return new


def _room(placed: List[Tuple[float, float]], total: float, t: float, dm: float, limit: float) -> bool:
    """Would adding ``dm`` at time t keep the running memory (after every pass) under limit?"""
    cur = total  # running sum after the last placed pass, then walking back
    i = len(placed) - 1
    while i >= 0 and placed[i][0] >= t - EPS:
        if cur + dm > limit + EPS:
            return False
        cur -= placed[i][1]
        i -= 1
    return cur + dm <= limit + EPS  # the running sum just before t, plus this F


def refill_w(setting: Setting, placement: Placement, orders: List[List[Action]], limit: float,
             eager: bool) -> List[List[Action]]:
    """Keep every rank's F/B order and place its W's again: the oldest pending W runs when the
    next F/B has not arrived (``eager``) or will not arrive before the W ends, or when the next
    F needs its memory; the rest at the end."""
    pl = placement
    p, nst = pl.num_ranks, pl.num_stages
    rank, cost, mem_of = _tables(setting, pl)
    comm = setting.cost_comm
    top = limit + EPS
    fb = [[a for a in o if a.kind != W] for o in orders]
    # per rank and F/B position: the key of its input (None: none), its cost, memory change and
    # whether it is an F; the rank's W's as (stage, W action, cost, memory change)
    info = [[(_dep(a.kind, a.stage, a.mb, nst), cost[a.kind, a.stage], mem_of[a.kind, a.stage], a.kind == F)
             for a in o] for o in fb]
    out: List[List[Action]] = [[] for _ in range(p)]
    pend: List[deque] = [deque() for _ in range(p)]
    pos, clock, mem = [0] * p, [0.0] * p, [0.0] * p
    end: Dict[Tuple[str, int, int], float] = {}

    def ready_at(r: int, dep: Optional[Key]) -> Optional[float]:
        t = 0.0
        if dep is not None:
            e = end.get(dep)
            if e is None:
                return None
            t = max(t, e + (comm if rank[dep[1]] != r else 0.0))
        return t

    def run_fb(r: int, a: Action, t: float, c: float, dm: float) -> None:
        e = t + c
        clock[r] = e
        mem[r] += dm
        key = (a.kind, a.stage, a.mb)
        end[key] = e
        if a.kind in (B, BW):
            end[("B*", a.stage, a.mb)] = e
        if a.kind == B:
            pend[r].append((Action(W, a.stage, a.mb), cost[W, a.stage], mem_of[W, a.stage]))
        out[r].append(a)

    def run_w(r: int, t: float) -> None:
        a, c, dm = pend[r].popleft()
        e = t + c
        clock[r] = e
        mem[r] += dm
        end[(W, a.stage, a.mb)] = e
        out[r].append(a)

    def candidate(r: int):
        """(time, rank, what) of rank r's next action, or None while it waits for others."""
        if pos[r] == len(fb[r]):
            return (clock[r], r, "W") if pend[r] else None
        dep, _, dm, is_f = info[r][pos[r]]
        rt = ready_at(r, dep)
        room = not is_f or mem[r] + dm <= top
        if pend[r] and (not room or rt is None or rt > clock[r] + EPS and
                        (eager or clock[r] + pend[r][0][1] <= rt + EPS)):
            return (clock[r], r, "W")
        if rt is not None and room:
            return (max(clock[r], rt), r, "FB")
        return None

    heap = [c + (0,) for c in map(candidate, range(p)) if c is not None]
    heapq.heapify(heap)
    version = [0] * p
    while True:
        if not heap:
            if any(pos[r] < len(fb[r]) for r in range(p)):
                raise ScheduleError("W refill stalls: the F/B order does not fit memory limit "
                                    f"{limit:g} even with every W run at once")
            return out
        t, r, what, ver = heapq.heappop(heap)
        if ver != version[r]:
            continue
        if what == "W":
            run_w(r, t)
            touched = (r,)
        else:
            a = fb[r][pos[r]]
            _, c, dm, _ = info[r][pos[r]]
            run_fb(r, a, t, c, dm)
            pos[r] += 1
            # a neighbour's next action changes only if it waited for what this pass produced
            made = ((a.kind, a.stage, a.mb), ("B*", a.stage, a.mb))
            touched = (r,) + tuple(q for q in {rank[x] for x in (a.stage - 1, a.stage + 1) if 0 <= x < nst}
                                   if q != r and pos[q] < len(fb[q]) and info[q][pos[q]][0] in made)
        for q in touched:
            version[q] += 1
            c = candidate(q)
            if c is not None:
                heapq.heappush(heap, c + (version[q],))


def _score(res) -> Tuple[float, float]:
    return (round(res.makespan, 9), round(sum(res.spans), 9))


def polish(setting: Setting, placement: Placement, times: Dict[Key, float], limit: float, name: str,
           rounds: int = 3) -> Optional[Schedule]:
    """Squeeze, reorder warm-up/cool-down and refill W's until the makespan stops falling."""
    return _polish(setting, placement, times, limit, name, rounds)[0]


def _polish(setting: Setting, placement: Placement, times: Dict[Key, float], limit: float, name: str,
            rounds: int) -> Tuple[Optional[Schedule], Optional[Run]]:
    m = 1 + max(k[2] for k in times)
    coder = Coder(setting, placement, m)
    best, best_res = None, None
    for _ in range(rounds):
        orders = orders_by_time(placement, compact(setting, placement, times, limit))
        cands = []
        for eager in (False, True):
            try:
                cands.append(refill_w(setting, placement, orders, limit, eager))
            except ScheduleError:
                pass
        cands = cands or [orders]
        improved = False
        for o in cands:
            s = Schedule(name, placement, m, o)
            res = Run(coder, s, setting)
            if res.peak > limit + 1e-9:
                continue
            if best_res is None or _score(res) < _score(best_res):
                best, best_res, improved = s, res, True
        if not improved:
            break
        times = best_res.starts
    return best, best_res


# -- search -----------------------------------------------------------------------------------

STRETCHES = (1.0, 1.1, 1.2, 1.35, 1.5)
DOWN = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)  # in units of one period / 6 (one unit-cost chunk pass on V)
UP = (0.0, 0.5, 1.0)


def block_peak(setting: Setting, placement: Placement, block, period: float, m: int) -> float:
    """Peak memory of the block repeated m times (memory depends on the order only)."""
    st = dataclasses.replace(setting, chunks=placement.chunks)
    orders = orders_by_time(placement, unroll(block, period, m))
    return max(peak_memory(o, r, st) for r, o in enumerate(orders))


#: the blocks of a setting (``_blocks``), whatever the limit: the V searches of one plan share them
_GRIDS = Memo(8)


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
    for k, (label, timing) in enumerate(starts):
        s, res = _polish(short_st, placement, timing(short), limit, name, rounds=2)
        if s is not None:
            scored.append((_score(res), k))
            if scored[-1][0][0] <= floor:  # cannot be beaten
                break
    scored.sort()
    best, best_res = None, None
    for _, k in scored[:2 if st.stages * m <= 2048 else 1]:
        label, timing = starts[k]
        s, res = _polish(st, placement, timing(m), limit, name, 3)
        if s is None:
            continue
        if best_res is None or _score(res) < _score(best_res):
            best, best_res = s, res
            best.meta = {"start": label}
    return best
