"""A fast timing of a schedule for the searches: a setting's every (kind, stage, microbatch) coded
once as an integer, timed by the one timing engine (``core.sim.worklist``: the simulator's rules,
each rank running its passes in order at the earliest moment its input and the rank allow, a hop
between ranks costing ``cost_comm``), and re-timed incrementally after a local change (``retime``).
``core.sim.simulate`` stays the reference; tests check that both agree.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

from ...ir import BW, Action, B, F, Placement, Schedule, Setting, W
from ...ir.memo import Memo, setting_key
from ...sim.iteration import AVERAGE_OVER, ITERATIONS, validation_times
from ...sim.simulate import simulate
from ...sim.worklist import run

KIND = {F: 0, B: 1, W: 2, BW: 3}
#: the coders made in this process (``Coder.of``)
_CODERS = Memo(16)


class Timing:
    """Start/end of every pass of a coded schedule; ``None`` from ``time_orders`` on a deadlock.
    From ``Coder.retime``: start and end None, ``patch`` what ``Coder.full`` makes them from."""

    __slots__ = ("start", "end", "spans", "makespan", "patch", "_work")

    def __init__(self, start, end, spans, makespan):
        self.start = start
        self.end = end
        self.spans = spans
        self.makespan = makespan
        self.patch = None
        self._work = None

    def work(self, cost: Sequence[float], orders: Sequence[Sequence[int]]) -> List[List[float]]:
        """Per rank of ``orders`` (the ones timed), the work of its first i passes, i = 0..n."""
        if self._work is None:
            self._work = [list(itertools.accumulate((cost[x] for x in o), initial=0.0)) for o in orders]
        return self._work


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
        # a fused backward also ends the B its consumers wait for (they are coded through the B)
        bw0, two = 3 * S * m, 2 * S * m
        self.alias = [x - two if x >= bw0 else -1 for x in range(n)]

    @classmethod
    def of(cls, setting: Setting, placement: Placement, m: int) -> "Coder":
        """``Coder(setting, placement, m)``, remembered (``memo``; it does not depend on the memory
        limit): a search codes its setting again for each candidate ranking, local search and tie."""
        key = (tuple(x for x in setting_key(setting) if x[0] != "memory_limit"), placement, m)
        return _CODERS.get(key, lambda: cls(setting, placement, m))

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
        end: List[Optional[float]] = [None] * self.n
        start = [0.0] * self.n
        if not run(orders, self.dep, self.hop, self.cost, end, start, release, self.alias):
            return None
        spans = [end[o[-1]] - start[o[0]] if o else 0.0 for o in orders]
        return Timing(start, end, spans, max(spans) if spans else 0.0)

    def retime(self, orders: Sequence[Sequence[int]], base: Timing, rank: int, first: int,
               above: Optional[float] = None, last: Optional[int] = None,
               base_orders: Optional[Sequence[Sequence[int]]] = None) -> Optional[Timing]:
        """``time(orders)`` where ``base`` times orders (``base_orders``) that differ from ``orders``
        only on ``rank`` from position ``first`` on (to ``last``, where the rest is the same), in
        forward order: the same times, timing only the passes that may move. Every pass of the
        base that ended before the end of ``rank``'s pass ``first - 1`` (before 0: none) depends on
        nothing that changed (its inputs ended earlier still, and the changed passes start at that
        end at the earliest), so it keeps its times; the simulation resumes after those, reading
        the base's times where it has none of its own (``full`` gives every pass's). ``above``:
        None as soon as some rank's span is sure to exceed it (its clock plus the work it has
        left), as for a deadlock: a caller that wants orders with a makespan up to ``above`` need
        not time the rest (it then passes ``base_orders``)."""
        o = orders[rank]
        nf, m = self.S * self.m, self.m
        last_j: Dict[int, int] = {}  # forwards of each stage in microbatch order: only what moved
        for x in o[first:len(o) if last is None else last + 1]:
            if x < nf:
                s, j = divmod(x, m)
                if j < last_j.get(s, -1):
                    return None
                last_j[s] = j
        bend, bstart = base.end, base.start
        cut = bend[o[first - 1]] if first > 0 else 0.0
        R = len(orders)
        pos, clock = [0] * R, [0.0] * R
        key = bend.__getitem__
        for r in range(R):  # a rank's ends do not fall along its order: the passes before the cut
            q = orders[r]
            i = bisect.bisect_left(q, cut, 0, first if r == rank else len(q), key=key)
            pos[r], clock[r] = i, (bend[q[i - 1]] if i else 0.0)
        left = None
        if above is not None:
            work = base.work(self.cost, base_orders)
            left = [work[r][-1] - work[r][pos[r]] for r in range(R)]
        fs: Dict[int, float] = {}
        fe: Dict[int, float] = {}
        if not self._run_from(orders, bend, bstart, cut, fs, fe, pos, clock, rank, left, above):
            return None
        spans = []
        for q in orders:
            if not q:
                spans.append(0.0)
                continue
            x, y = q[0], q[-1]
            spans.append((fe[y] if y in fe else bend[y]) - (fs[x] if x in fs else bstart[x]))
        t = Timing(None, None, spans, max(spans) if spans else 0.0)
        t.patch = (base, fs, fe)
        return t

    def _run_from(self, orders, bend: List[float], bstart: List[float], cut: float, fs: Dict[int, float],
                  fe: Dict[int, float],
                  pos: List[int], clock: List[float], rank: int, left: Optional[List[float]],
                  above: Optional[float]) -> bool:
        """The work list from a base timing (eleven parameters: the state of the searches' hottest
        loop, every local-search move's re-timing, handed over as the plain lists it reads): a pass whose base end is before ``cut`` keeps it, the others
        are timed again into ``fs`` / ``fe`` (start / end). False on a deadlock or, with ``left``
        (each rank's work still to do), once a rank's span is sure to exceed ``above``. The
        changed ``rank`` goes first: where it was on the longest span, a delay shows there at once."""
        dep, hop, cost = self.dep, self.hop, self.cost
        R = len(orders)
        waiting: Dict[int, List[int]] = {}
        bw0 = 3 * self.S * self.m
        two = 2 * self.S * self.m
        stack = [r for r in range(R - 1, -1, -1) if r != rank] + [rank]
        while stack:
            r = stack.pop()
            o = orders[r]
            i, t = pos[r], clock[r]
            ln = len(o)
            rest = left[r] if left is not None else 0.0
            while i < ln:
                x = o[i]
                d = dep[x]
                if d >= 0:
                    e = fe.get(d)
                    if e is None:
                        e = bend[d]
                        if not e < cut:  # not timed yet
                            if d in waiting:
                                waiting[d].append(r)
                            else:
                                waiting[d] = [r]
                            break
                    e += hop[x]
                    if e > t:
                        t = e
                fs[x] = t
                c = cost[x]
                t += c
                rest -= c
                fe[x] = t
                if x >= bw0:  # a fused backward also counts as the B its consumers wait for
                    y = x - two
                    fe[y] = t
                    if y in waiting:
                        stack.extend(waiting.pop(y))
                if x in waiting:
                    stack.extend(waiting.pop(x))
                i += 1
            pos[r], clock[r] = i, t
            if left is not None and o:
                left[r] = rest
                begin = fs[o[0]] if o[0] in fs else (bstart[o[0]] if i else t)
                if t + rest - begin > above:
                    return False
        return all(pos[r] == len(orders[r]) for r in range(R))

    def full(self, t: Timing) -> Timing:
        """A timing from ``retime`` with every pass's start and end (the base's, then its own)."""
        if t.start is not None:
            return t
        base, fs, fe = t.patch
        start, end = list(base.start), list(base.end)
        for x, v in fs.items():
            start[x] = v
        for x, v in fe.items():
            end[x] = v
        return Timing(start, end, t.spans, t.makespan)

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

    __slots__ = ("makespan", "spans", "peak", "_starts", "_made")

    def __init__(self, coder: Coder, s: Schedule, setting: Setting):
        codes = coder.encode(s.orders)
        t = coder.time(codes)
        self._starts = None
        if t is None:
            res = simulate(s, setting)
            self.makespan, self.spans, self.peak = res.makespan, res.spans, max(res.peak_memory)
            self._starts = {(x.action.kind, x.action.stage, x.action.mb): x.start for tl in res.timeline for x in tl}
            return
        self.makespan, self.spans = t.makespan, t.spans
        self.peak = max(coder.peak(o) for o in codes)
        self._made = (s.orders, codes, t.start)

    @property
    def starts(self) -> Dict[Tuple[str, int, int], float]:
        if self._starts is None:
            orders, codes, start = self._made
            self._starts = {(a.kind, a.stage, a.mb): start[x] for o, c in zip(orders, codes) for a, x in zip(o, c)}
        return self._starts


def score(t: Timing) -> Tuple[float, float]:
    return (round(t.makespan, 9), round(sum(t.spans), 9))
