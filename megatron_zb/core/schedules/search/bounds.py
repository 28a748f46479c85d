"""A lower bound on the makespan (the longest rank span) that no schedule can beat.

Passes are named by order statistics, so nothing here assumes microbatch order: "the j-th F of
stage s" is whichever forward stage s runs (j+1)-th. For every pass we derive

* a **head** (earliest start): its input's head plus cost and hop (one microbatch's chain, all
  forwards down, all backwards back, each W after its B); the previous pass of its kind on its
  stage; the rank's first possible start plus the work the rank must have done before it (the
  j earlier passes of its kind, and for each pass of the same microbatch that precedes it on
  this rank, j+1 of those); and, with a memory limit and one stage per rank, the **memory-aware
  warm-up argument** (the ZB paper's appendix B): the j-th F needs (j+1) mem-f minus the limit
  freed first, i.e. enough B's (and their W's) done -- it cannot start before the B that frees
  it ends, and the rank's work before it includes the cheapest mix of B's and W's that frees it;
  before the j-th B, the W's that keep memory under the limit have run;
* a **tail** (least time the rank still works after it ends): the rest of its microbatch's chain
  that comes back to this rank, or the passes of its stage still to come.

Each rank is then a one-machine problem with heads and tails, bounded by Jackson's preemptive
schedule (**per-rank critical paths**). The rank holding stage 0 starts at time 0, so its bound
is a bound on its span; every other rank's span is bounded in its own time frame (times from its
first pass, using only what that rank itself implies). The result is the largest of these and
the busiest rank's work.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Dict, List, Optional, Tuple

from ...ir import B, F, Placement, Setting, W
from ...ir.memo import Memo, setting_key
from ...sim.split import split_free

NEG = float("-inf")


def _jackson(jobs: List[Tuple[float, float, float]]) -> float:
    """max(completion + tail) of the preemptive schedule that always runs the released job with
    the longest tail: a lower bound for one machine with heads, durations and tails."""
    jobs = sorted(jobs)
    heap: List[Tuple[float, float]] = []
    t, i, n, best = NEG, 0, len(jobs), 0.0
    while i < n or heap:
        if not heap and jobs[i][0] > t:
            t = jobs[i][0]
        while i < n and jobs[i][0] <= t:
            h, d, q = jobs[i]
            heapq.heappush(heap, (-q, d))
            i += 1
        nq, d = heapq.heappop(heap)
        nxt = jobs[i][0] if i < n else float("inf")
        run = min(d, nxt - t)
        t += run
        if d - run > 1e-12:
            heapq.heappush(heap, (nq, d - run))
        else:
            best = max(best, t - nq)
    return best


class _Chain:
    """One microbatch's passes (kind, stage) in dependency order and their same-rank relations."""

    def __init__(self, st: Setting, pl: Placement):
        S = pl.num_stages
        self.S = S
        self.rank = [pl.rank_of(s) for s in range(S)]
        self.cost = {(k, s): st.pass_cost(k, self.rank[s], s) for k in (F, B, W) for s in range(S)}
        c = st.cost_comm
        path = [(F, s) for s in range(S)] + [(B, s) for s in reversed(range(S))]
        hop = {}  # hop before each path element / before W(s) (same rank as B(s): none)
        for i, (k, s) in enumerate(path):
            prev = path[i - 1][1] if i else s
            hop[(k, s)] = c if i and self.rank[prev] != self.rank[s] else 0.0
        # end time of each pass of one microbatch without contention, from its first F's start
        end, t = {}, 0.0
        for k, s in path:
            t += hop[(k, s)] + self.cost[(k, s)]
            end[(k, s)] = t
        for s in range(S):
            end[(W, s)] = end[(B, s)] + self.cost[(W, s)]
        self.end = end
        pos = {x: i for i, x in enumerate(path)}
        for s in range(S):
            pos[(W, s)] = pos[(B, s)] + 0.5

        def before(x, y):  # x precedes y within one microbatch
            if x[0] == W:
                return y[0] == W and False  # a W feeds nothing
            if y[0] == W:
                return x == (B, y[1]) or pos[x] < pos[(B, y[1])]
            return pos[x] < pos[y]

        nodes = list(end)
        self.anc = {y: [x for x in nodes if x != y and self.rank[x[1]] == self.rank[y[1]] and before(x, y)]
                    for y in nodes}
        self.desc = {x: [y for y in nodes if y != x and self.rank[x[1]] == self.rank[y[1]] and before(x, y)]
                     for x in nodes}
        # longest rest of the microbatch on the pass's own rank after it ends
        self.back = {x: max([end[y] - end[x] for y in self.desc[x]] + [0.0]) for x in nodes}


def _heads(st: Setting, pl: Placement, ch: _Chain, m: int, limit: Optional[float],
           anchor: Optional[int]) -> Dict[Tuple[str, int], List[float]]:
    """Heads of every pass. anchor=None: absolute times (rank r starts at the earliest its first
    stage's first forward can); anchor=r: times from rank r's first pass, using only stages
    from rank r's first one on, and rank work terms only on rank r."""
    S = ch.S
    cost = ch.cost
    c = st.cost_comm
    rank = ch.rank
    first = {}
    for s in range(S):
        first.setdefault(rank[s], s)
    if anchor is None:
        start = {}
        t = 0.0
        for s in range(S):  # the chain of first forwards: a lower bound on each rank's start
            if first[rank[s]] == s:
                start[rank[s]] = t
            t += cost[(F, s)] + (c if s + 1 < S and rank[s + 1] != rank[s] else 0.0)
        s0 = 0
    else:
        start = {anchor: 0.0}
        s0 = first[anchor]
    H = {(k, s): [NEG] * m for k in (F, B, W) for s in range(S)}
    single = pl.chunks == 1 and limit is not None
    mf = st.mem_f
    mw = st.mem_w

    def work(k, s, j):
        r = rank[s]
        if r not in start:
            return NEG
        t = start[r] + j * cost[(k, s)] + (j + 1) * sum(cost[x] for x in ch.anc[(k, s)])
        if single:
            if k == F:
                need = (j + 1) * mf[r] - limit
                if need > 1e-9:
                    opts = [need * (cost[(B, s)] + cost[(W, s)]) / mf[r]]
                    if mf[r] > mw[r]:
                        opts.append(need * cost[(B, s)] / (mf[r] - mw[r]))
                    t += min(opts)
            elif k == B and mw[r] > 0:
                t += cost[(W, s)] * max(0.0, (mf[r] + j * mw[r] - limit) / mw[r])
        return t

    def hop(a, b):
        return c if rank[a] != rank[b] else 0.0

    for j in range(m):
        for s in range(s0, S):
            h = work(F, s, j)
            if s > s0:
                h = max(h, H[(F, s - 1)][j] + cost[(F, s - 1)] + hop(s - 1, s))
            elif anchor is None or s == s0:
                h = max(h, 0.0)
            if j:
                h = max(h, H[(F, s)][j - 1] + cost[(F, s)])
            if single and (anchor is None or rank[s] == anchor):
                need = (j + 1) * mf[rank[s]] - limit
                if need > 1e-9:
                    nb = math.ceil(need / mf[rank[s]] - 1e-9)
                    if 1 <= nb <= j:
                        h = max(h, H[(B, s)][nb - 1] + cost[(B, s)])
            H[(F, s)][j] = h
        for s in range(S - 1, s0 - 1, -1):
            h = work(B, s, j)
            if s < S - 1:
                h = max(h, H[(B, s + 1)][j] + cost[(B, s + 1)] + hop(s + 1, s))
            else:
                h = max(h, H[(F, s)][j] + cost[(F, s)])
            if j:
                h = max(h, H[(B, s)][j - 1] + cost[(B, s)])
            H[(B, s)][j] = h
        for s in range(s0, S):
            h = max(work(W, s, j), H[(B, s)][j] + cost[(B, s)])
            if j:
                h = max(h, H[(W, s)][j - 1] + cost[(W, s)])
            H[(W, s)][j] = h
    return H


def _rank_bound(ch: _Chain, H, m: int, r: int) -> float:
    jobs = []
    for (k, s), hs in H.items():
        if ch.rank[s] != r:
            continue
        d = ch.cost[(k, s)]
        later = sum(ch.cost[y] for y in ch.desc[(k, s)])
        for j, h in enumerate(hs):
            if h == NEG:
                h = 0.0
            q = max(ch.back[(k, s)], (m - 1 - j) * d + (m - j) * later)
            jobs.append((h, d, q))
    return _jackson(jobs) if jobs else 0.0


#: bounds asked for in this process (``memo``): the searches ask for the same one several times
_BOUNDS = Memo(32)


def lower_bound(setting: Setting, placement: Placement, limit: Optional[float]) -> float:
    """The bound on any schedule's makespan for ``placement`` under ``limit`` (None: none); the
    limit counts with one stage per rank only (the memory-aware warm-up argument)."""
    if limit is not None and limit == float("inf"):
        limit = None
    if placement.chunks != 1:
        limit = None
    key = (setting_key(dataclasses.replace(setting, memory_limit=None)), placement, limit)
    return _BOUNDS.get(key, lambda: _lower_bound(setting, placement, limit))


def _lower_bound(setting: Setting, placement: Placement, limit: Optional[float]) -> float:
    # where a split backward costs more than the fused one, with the split free (no pass costs more
    # there, so no schedule is faster here than there: a fused backward is no cheaper than B + W)
    st = dataclasses.replace(split_free(setting, placement), chunks=placement.chunks)
    m = setting.microbatches
    R = placement.num_ranks
    busy = [sum(m * st.pass_cost(k, r, s) for k in (F, B, W) for s in placement.stages_of(r)) for r in range(R)]
    lb = max(busy)
    ch = _Chain(st, placement)
    H = _heads(st, placement, ch, m, limit, None)
    lb = max(lb, _rank_bound(ch, H, m, placement.rank_of(0)))
    if R * placement.num_stages * m <= 200_000:  # every other rank in its own time frame
        for r in range(R):
            if r != placement.rank_of(0):
                lb = max(lb, _rank_bound(ch, _heads(st, placement, ch, m, limit, r), m, r))
    return lb
