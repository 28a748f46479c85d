"""Steps 2 and 3 of the building-block schedules (``vblock``): a timing of every pass (a block
repeated, or a simulated schedule) squeezed into per-rank orders, warm-up and cool-down
reordered (``compact``), the W's placed again (``refill_w``), a few rounds while the makespan
falls (``polish``). Any plain placement (one path), any per-rank or per-chunk costs.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import deque
from typing import Dict, List, Optional, Tuple

from ...ir import BW, Action, B, F, Placement, Schedule, ScheduleError, Setting, W
from .evaluate import Coder, Run

EPS = 1e-9
Key = Tuple[str, int, int]  # (kind, stage, microbatch)

#: ties (zero-cost passes) in dependency order: F by stage up, B by stage down, W last
KIND_ORDER = {F: 0, B: 1, BW: 1, W: 2}


class Window:
    """The memory limits under which a polish decides as it did under its own: every memory
    check it made, as the amount checked, ``need`` the largest allowed, ``refused`` the least
    turned down. Under any limit L with need <= L + EPS < refused each check comes out the same,
    so the polish gives the same schedule (``vblock`` polishes the same blocks under the limits
    of v-auto's ladder)."""

    __slots__ = ("need", "refused")

    def __init__(self):
        self.need, self.refused = float("-inf"), float("inf")

    def check(self, amount: float, top: float) -> bool:
        """amount <= top (a limit plus its EPS), noted."""
        if amount <= top:
            if amount > self.need:
                self.need = amount
            return True
        if amount < self.refused:
            self.refused = amount
        return False

    def holds(self, limit: float, eps: float = EPS) -> bool:
        return self.need <= limit + eps < self.refused


def orders_by_time(placement: Placement, times: Dict[Key, float],
                   actions: Optional[Dict[Key, Action]] = None) -> List[List[Action]]:
    """Each rank's passes in time order. ``actions``: the Action of each key, made where missing
    (one search orders the same passes many times over)."""
    orders: List[List[Action]] = [[] for _ in range(placement.num_ranks)]
    actions = {} if actions is None else actions
    rank = placement.stage_to_rank
    # ties (zero-cost passes) in dependency order: F by stage up, B by stage down, W last
    for k in sorted(times, key=lambda k: (times[k], KIND_ORDER[k[0]], k[1] if k[0] == F else -k[1], k[2])):
        a = actions.get(k)
        if a is None:
            a = actions[k] = Action(*k)
        orders[rank[k[1]]].append(a)
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


def compact(setting: Setting, placement: Placement, times: Dict[Key, float], limit: float,
            window: Optional[Window] = None) -> Dict[Key, float]:
    """Move each pass, in time order, to the earliest idle time of its rank at or after its
    inputs that ends by its own time, unless an F would lift the rank's memory over ``limit``.
    ``times`` must be a valid timing of the passes (a block, or a simulated schedule). ``window``:
    where its memory checks are noted."""
    pl = placement
    window = Window() if window is None else window
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
    order = sorted(times, key=lambda k: (times[k], KIND_ORDER[k[0]], k[1] if k[0] == F else -k[1], k[2]))
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
            if dm > 0 and not window.check(_room(placed[r], total[r], t, dm), limit + EPS):
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


def _room(placed: List[Tuple[float, float]], total: float, t: float, dm: float) -> float:
    """The highest running memory (after every pass from t on, and just before t) once ``dm`` is
    added at time t: the pass fits where that is under the limit."""
    cur = total  # running sum after the last placed pass, then walking back
    top = cur
    i = len(placed) - 1
    while i >= 0 and placed[i][0] >= t - EPS:
        cur -= placed[i][1]
        if cur > top:
            top = cur
        i -= 1
    return top + dm


def refill_w(setting: Setting, placement: Placement, orders: List[List[Action]], limit: float,
             eager: bool, actions: Optional[Dict[Key, Action]] = None,
             window: Optional[Window] = None) -> List[List[Action]]:
    """Keep every rank's F/B order and place its W's again: the oldest pending W runs when the
    next F/B has not arrived (``eager``) or will not arrive before the W ends, or when the next
    F needs its memory; the rest at the end. ``window``: where its memory checks are noted."""
    pl = placement
    check = (Window() if window is None else window).check
    p, nst = pl.num_ranks, pl.num_stages
    rank, cost, mem_of = _tables(setting, pl)
    comm = setting.cost_comm
    top = limit + EPS
    fb = [[a for a in o if a.kind != W] for o in orders]
    # the ranks next to each stage's on the chain (those that may wait for its passes)
    nbr = [tuple(sorted({rank[x] for x in (s - 1, s + 1) if 0 <= x < nst} - {rank[s]})) for s in range(nst)]
    # per rank and F/B position: the key of its input (None: none), the hop before it, its cost,
    # memory change, whether it is an F, the keys it makes, its W (for a B) and its neighbours
    info = []
    for r, o in enumerate(fb):
        row = []
        for a in o:
            dep = _dep(a.kind, a.stage, a.mb, nst)
            made = ((a.kind, a.stage, a.mb),) + ((("B*", a.stage, a.mb),) if a.kind in (B, BW) else ())
            w = None
            if a.kind == B:
                wk = (W, a.stage, a.mb)
                wa = actions.get(wk) if actions is not None else None
                if wa is None:
                    wa = Action(*wk)
                    if actions is not None:
                        actions[wk] = wa
                w = (wa, cost[W, a.stage], mem_of[W, a.stage])
            row.append((dep, 0.0 if dep is None or rank[dep[1]] == r else comm, cost[a.kind, a.stage],
                        mem_of[a.kind, a.stage], a.kind == F, made, w, nbr[a.stage]))
        info.append(row)
    out: List[List[Action]] = [[] for _ in range(p)]
    pend: List[deque] = [deque() for _ in range(p)]
    pos, clock, mem = [0] * p, [0.0] * p, [0.0] * p
    size = [len(o) for o in fb]
    end: Dict[Tuple[str, int, int], float] = {}

    def candidate(r: int):
        """(time, rank, what) of rank r's next action, or None while it waits for others."""
        if pos[r] == size[r]:
            return (clock[r], r, "W") if pend[r] else None
        dep, hop, _, dm, is_f = info[r][pos[r]][:5]
        if dep is None:
            rt = 0.0
        else:
            e = end.get(dep)
            rt = None if e is None else max(0.0, e + hop)
        room = not is_f or check(mem[r] + dm, top)
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
            if any(pos[r] < size[r] for r in range(p)):
                raise ScheduleError("W refill stalls: the F/B order does not fit memory limit "
                                    f"{limit:g} even with every W run at once")
            return out
        t, r, what, ver = heapq.heappop(heap)
        if ver != version[r]:
            continue
        if what == "W":
            a, c, dm = pend[r].popleft()
            e = t + c
            clock[r] = e
            mem[r] += dm
            end[(W, a.stage, a.mb)] = e
            out[r].append(a)
            touched = (r,)
        else:
            a = fb[r][pos[r]]
            _, _, c, dm, _, made, w, near = info[r][pos[r]]
            e = t + c
            clock[r] = e
            mem[r] += dm
            for k in made:
                end[k] = e
            if w is not None:
                pend[r].append(w)
            out[r].append(a)
            pos[r] += 1
            # a neighbour's next action changes only if it waited for what this pass made
            touched = (r,) + tuple(q for q in near if pos[q] < size[q] and info[q][pos[q]][0] in made)
        for q in touched:
            version[q] += 1
            c = candidate(q)
            if c is not None:
                heapq.heappush(heap, c + (version[q],))


def score(res) -> Tuple[float, float]:
    """(makespan, sum of spans), rounded: how polish and the block search rank schedules."""
    return (round(res.makespan, 9), round(sum(res.spans), 9))


def polish(setting: Setting, placement: Placement, times: Dict[Key, float], limit: float, name: str,
           rounds: int = 3) -> Optional[Schedule]:
    """Squeeze, reorder warm-up/cool-down and refill W's until the makespan stops falling."""
    best = polish_run(setting, placement, times, limit, rounds)[0]
    return None if best is None else dataclasses.replace(best, name=name)


def polish_run(setting: Setting, placement: Placement, times: Dict[Key, float], limit: float, rounds: int,
               state: Optional[list] = None, actions: Optional[Dict[Key, Action]] = None,
               window: Optional[Window] = None) -> Tuple[Optional[Schedule], Optional[Run]]:
    """``polish`` and its run (the schedule named "polish": its caller names it). ``state``: a list
    that holds, after the call, what lets a later call go on for more rounds (passed again with
    ``times`` None: the same as asking for all the rounds at once). ``actions``: as
    ``orders_by_time``'s. ``window``: where its memory checks are noted (``Window``: under which
    other limits it gives the same)."""
    actions = {} if actions is None else actions
    window = Window() if window is None else window
    if times is None:
        times, best, best_res, stopped = state
        if stopped:
            return best, best_res
    else:
        best, best_res = None, None
    m = 1 + max(k[2] for k in times)
    coder = Coder.of(setting, placement, m)
    stopped = False
    for _ in range(rounds):
        orders = orders_by_time(placement, compact(setting, placement, times, limit, window), actions)
        cands = []
        for eager in (False, True):
            try:
                cands.append(refill_w(setting, placement, orders, limit, eager, actions, window))
            except ScheduleError:
                pass
        cands = cands or [orders]
        improved = False
        for o in cands:
            s = Schedule("polish", placement, m, o)
            res = Run(coder, s, setting)
            if not window.check(res.peak, limit + 1e-9):
                continue
            if best_res is None or score(res) < score(best_res):
                best, best_res, improved = s, res, True
        if not improved:
            stopped = True
            break
        times = best_res.starts
    if state is not None:
        state[:] = [times, best, best_res, stopped]
    return best, best_res
