"""A fast timing of a schedule for the searches: the simulator's rules (each rank runs its passes
in order, each at the earliest moment its input and the rank allow; a hop between ranks costs
``cost_comm``) on integer-coded passes, with a work list instead of rescanning blocked ranks.
``core.simulate`` stays the reference; tests check that both agree.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import B, BW, F, W, Action, Placement, Schedule, Setting
from ..iteration import AVERAGE_OVER, ITERATIONS, validation_times
from ..simulate import simulate

KIND = {F: 0, B: 1, W: 2, BW: 3}


class Timing:
    """Start/end of every pass of a coded schedule; ``None`` from ``time_orders`` on a deadlock."""

    __slots__ = ("start", "end", "spans", "makespan")

    def __init__(self, start, end, spans, makespan):
        self.start = start
        self.end = end
        self.spans = spans
        self.makespan = makespan


class Coder:
    """Integer codes for the passes of one placement and microbatch count, with what each pass
    waits for, costs and does to memory."""

    def __init__(self, setting: Setting, placement: Placement, m: int):
        st = dataclasses.replace(setting, chunks=placement.chunks)
        self.pl = placement
        self.m = m
        self.S = S = placement.num_stages
        self.R = placement.num_ranks
        n = 4 * S * m
        self.n = n
        rank = [0] * n
        cost = [0.0] * n
        dmem = [0.0] * n
        dep = [-1] * n  # the pass it waits for (a B-or-BW producer is coded as its B)
        hop = [0.0] * n  # comm charged on that wait
        comm = setting.cost_comm
        for k, kind in enumerate((F, B, W, BW)):
            for s in range(S):
                r = placement.rank_of(s)
                c, dm = st.pass_cost(kind, r, s), st.pass_mem(kind, r, s)
                for j in range(m):
                    x = (k * S + s) * m + j
                    rank[x], cost[x], dmem[x] = r, c, dm
                    if kind == F:
                        d = (s - 1) * m + j if s > 0 else -1
                        src = s - 1
                    elif kind in (B, BW):
                        if s < S - 1:
                            d, src = (S + s + 1) * m + j, s + 1
                        else:
                            d, src = s * m + j, s
                    else:
                        d, src = (S + s) * m + j, s
                    dep[x] = d
                    if d >= 0 and placement.rank_of(src) != r:
                        hop[x] = comm
        self.rank, self.cost, self.dmem, self.dep, self.hop = rank, cost, dmem, dep, hop

    def code(self, a: Action) -> int:
        return (KIND[a.kind] * self.S + a.stage) * self.m + a.mb

    def action(self, x: int) -> Action:
        k, rest = divmod(x, self.S * self.m)
        s, j = divmod(rest, self.m)
        return Action((F, B, W, BW)[k], s, j)

    def encode(self, orders: Sequence[Sequence[Action]]) -> List[List[int]]:
        S, m = self.S, self.m
        kind = {F: 0, B: S, W: 2 * S, BW: 3 * S}
        return [[(kind[a.kind] + a.stage) * m + a.mb for a in o if a.kind in kind] for o in orders]

    def decode(self, orders: Sequence[Sequence[int]]) -> List[List[Action]]:
        return [[self.action(x) for x in o] for o in orders]

    def forwards_in_order(self, orders: Sequence[Sequence[int]]) -> bool:
        """Each stage's forwards in microbatch order (the runtime reads a stage's data in order):
        a search move that swaps two microbatches' forwards of one stage is not a schedule."""
        S, m = self.S, self.m
        last = [-1] * S
        for o in orders:
            for x in o:
                if x < S * m:  # an F
                    s, j = divmod(x, m)
                    if j < last[s]:
                        return False
                    last[s] = j
        return True

    def time(self, orders: Sequence[Sequence[int]],
             release: Optional[Sequence[Dict[int, float]]] = None) -> Optional[Timing]:
        """Time coded per-rank orders (None if they deadlock, or a stage's forwards are out of
        microbatch order). A BW producer is found through its B code: coded orders of fused
        backwards register their end under both codes. ``release``: per rank, {position: time}
        before which the pass at that position may not start (``simulate``'s ``release``)."""
        if not self.forwards_in_order(orders):
            return None
        R = len(orders)
        return self._run(orders, [None] * self.n, [0.0] * self.n, [0] * R, [0.0] * R, release)

    def retime(self, orders: Sequence[Sequence[int]], base: Timing, rank: int, first: int) -> Optional[Timing]:
        """``time(orders)`` where ``base`` times orders that differ from ``orders`` only on
        ``rank`` from position ``first`` on (and were in forward order): the same result, with
        only the passes that may move timed again. Every pass of the base that ended before the
        end of ``rank``'s pass ``first - 1`` (before 0: none) depends on nothing that changed (its
        inputs ended earlier still, and the changed passes start at that end at the earliest), so
        it keeps its times; the simulation resumes after those."""
        o = orders[rank]
        S, m = self.S, self.m
        last = [-1] * S  # forwards of each stage in microbatch order: only this rank's changed
        for x in o:
            if x < S * m:
                s, j = divmod(x, m)
                if j < last[s]:
                    return None
                last[s] = j
        bend = base.end
        cut = bend[o[first - 1]] if first > 0 else 0.0
        end = list(bend)
        start = list(base.start)
        R = len(orders)
        pos = [0] * R
        clock = [0.0] * R
        bw0, two = 3 * S * m, 2 * S * m
        for r in range(R):
            q = orders[r]
            i = len(q)
            while i > 0 and not bend[q[i - 1]] < cut:
                i -= 1
            pos[r] = i
            clock[r] = bend[q[i - 1]] if i else 0.0
            for x in q[i:]:
                end[x] = None
                if x >= bw0:
                    end[x - two] = None
        return self._run(orders, end, start, pos, clock, None)

    def _run(self, orders, end: List[Optional[float]], start: List[float], pos: List[int], clock: List[float],
             release) -> Optional[Timing]:
        """The work-list simulation from a state: each rank r at position ``pos[r]`` at time
        ``clock[r]``, ``end`` holding the ends of the passes done (None for the others)."""
        S, m = self.S, self.m
        dep, hop, cost = self.dep, self.hop, self.cost
        R = len(orders)
        waiting = {}
        bw0 = 3 * S * m
        stack = list(range(R - 1, -1, -1))
        while stack:
            r = stack.pop()
            o = orders[r]
            i, t = pos[r], clock[r]
            ln = len(o)
            rel = release[r] if release is not None else None
            while i < ln:
                x = o[i]
                if rel and i in rel and rel[i] > t:
                    t = rel[i]
                d = dep[x]
                if d >= 0:
                    e = end[d]
                    if e is None:
                        if d in waiting:  # a B feeds the next B down and its own W
                            waiting[d].append(r)
                        else:
                            waiting[d] = [r]
                        break
                    e += hop[x]
                    if e > t:
                        t = e
                start[x] = t
                t += cost[x]
                end[x] = t
                if x >= bw0:  # a fused backward also counts as the B its consumers wait for
                    y = x - 2 * S * m
                    end[y] = t
                    if y in waiting:
                        stack.extend(waiting.pop(y))
                if x in waiting:
                    stack.extend(waiting.pop(x))
                i += 1
            pos[r], clock[r] = i, t
        if any(pos[r] < len(orders[r]) for r in range(R)):
            return None
        spans = [end[o[-1]] - start[o[0]] if o else 0.0 for o in orders]
        return Timing(start, end, spans, max(spans) if spans else 0.0)

    def post_validated(self, orders: Sequence[Sequence[int]], comm: float) -> Optional[float]:
        """``iteration.iteration_times``' post-validated time (optimizer cost 0) of coded orders:
        ``ITERATIONS`` iterations back to back, each rank's next one released at the end of its
        last pass and its first backward at the validation result (``validation_times``)."""
        bw = self.S * self.m  # the first B-or-BW code
        points = [next((i for i, x in enumerate(o) if x >= bw and x < 2 * bw or x >= 3 * bw), None)
                  for o in orders]
        t = self.time(orders)
        last = []
        for k in range(ITERATIONS):
            if t is None:
                return None
            ends = [t.end[o[-1]] if o else 0.0 for o in orders]
            last.append(max(ends))
            if k == ITERATIONS - 1:
                break
            v = validation_times(ends, comm)
            release = [{0: ends[r]} for r in range(len(orders))]
            for r, i in enumerate(points):
                if i is not None:
                    release[r][i] = max(release[r].get(i, 0.0), v[r])
            t = self.time(orders, release)
        return (last[-1] - last[-1 - AVERAGE_OVER]) / AVERAGE_OVER

    def peak(self, order: Sequence[int]) -> float:
        cur = best = 0.0
        dmem = self.dmem
        for x in order:
            cur += dmem[x]
            if cur > best:
                best = cur
        return best


class Run:
    """What a search reads of a schedule's simulation: makespan, spans, peak and each pass's
    start ((kind, stage, microbatch) -> time), timed by ``coder`` (the simulator's rules, the same
    times), or by ``simulate`` where the coder gives none: a deadlock (simulate raises, saying
    where) or forwards out of microbatch order (simulate times them)."""

    __slots__ = ("makespan", "spans", "peak", "starts")

    def __init__(self, coder: Coder, s: Schedule, setting: Setting):
        codes = coder.encode(s.orders)
        t = coder.time(codes)
        if t is None:
            res = simulate(s, setting)
            self.makespan, self.spans, self.peak = res.makespan, res.spans, max(res.peak_memory)
            self.starts = {(x.action.kind, x.action.stage, x.action.mb): x.start for tl in res.timeline for x in tl}
            return
        self.makespan, self.spans = t.makespan, t.spans
        self.peak = max(coder.peak(o) for o in codes)
        start = t.start
        self.starts = {(a.kind, a.stage, a.mb): start[x] for o, c in zip(s.orders, codes) for a, x in zip(o, c)}


def score(t: Timing) -> Tuple[float, float]:
    return (round(t.makespan, 9), round(sum(t.spans), 9))
