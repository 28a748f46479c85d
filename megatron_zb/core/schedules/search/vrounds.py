"""Round-based heuristic for the V placement (ZB-V, "Zero Bubble Pipeline Parallelism" section
6), written from its description, under any memory limit and with per-rank costs.

Rank i holds stage a = i (first leg, down) and stage z = 2p-1-i (second leg, back up). Its
passes are Fa, Fz (forwards), Bz, Ba (backwards: the gradient comes back up the second leg,
turns on the last rank and goes down the first) and W's (one per B, in B order).

1. **Warm-up.** Microbatch 0's Fa on every rank; then from the last rank back: rank i, while
   its Fz input is not there yet (the forward coming back up), adds one more Fa on ranks 0..i
   per round as long as the memory of 2+2i more chunk activations fits and the Fa ends in time;
   then its Fz. Then ranks are topped up (alternating chunks: first-leg forwards from rank i
   up, second-leg ones from the last rank down) until each holds as many forwards as the rank
   before it and more second-leg ones, or a rank has no room left (per-chunk memory differs:
   a rank with heavier chunks than the one before it takes fewer) or lacks an input.
2. **Rounds** (2m when every rank runs a B in each): one B on every rank -- Ba where its
   gradient is there (or the rank's Bz's are done), else Bz -- Ba ranks from the last rank
   down, then Bz ranks from rank 0 up (so inputs are known); then one F per rank -- Fz if its
   input is there, else Fa. A rank whose pass lacks its input, or whose F finds no room even
   after its W's, sits the round out; rounds go on until every B has run. Before each
   pass W's fill the wait for its input when they end in time; a W that would overrun it runs
   anyway when the rank's idle time would exceed the largest (or the allowed) idle time of any
   rank: always before a Ba, before a Bz with ``fill_b``, before an F with ``fill_f``. W's also
   run when an F needs their memory.
3. Then the remaining W's. The whole is redone with each rank's idle time of the previous try
   as an allowance (a rank that idled less may idle more), while the largest idle time falls;
   every try is a candidate.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Dict, List, Optional, Tuple

from ...ir import Action, B, F, Placement, Schedule, ScheduleError, Setting, W

EPS = 1e-9
FA, FZ, BZ, BA = "Fa", "Fz", "Bz", "Ba"


def _try(st: Setting, limit: float, fill_b: bool, fill_f: bool, tol: float, approved: Optional[List[float]]):
    p, m = st.stages, st.microbatches
    c = st.cost_comm
    st = st if st.chunks == 2 else dataclasses.replace(st, chunks=2)
    stage = {FA: list(range(p)), FZ: [2 * p - 1 - i for i in range(p)], BZ: [2 * p - 1 - i for i in range(p)],
             BA: list(range(p))}
    kind_of = {FA: F, FZ: F, BZ: B, BA: B}
    # per rank, each chunk's own cost and memory change (the V's two chunks may differ)
    cost = {k: [st.pass_cost(kind_of[k], i, stage[k][i]) for i in range(p)] for k in kind_of}
    dm = {k: [st.pass_mem(kind_of[k], i, stage[k][i]) for i in range(p)] for k in kind_of}
    cw = {s: st.pass_cost(W, min(s, 2 * p - 1 - s), s) for s in range(2 * p)}
    wmem = {s: st.pass_mem(W, min(s, 2 * p - 1 - s), s) for s in range(2 * p)}
    fmem = [max(dm[FA][i], dm[FZ][i]) for i in range(p)]  # the larger chunk activation of a rank
    bmem = [max(dm[BA][i], dm[BZ][i]) for i in range(p)]
    cnt = {k: [0] * p for k in (FA, FZ, BZ, BA)}
    end: Dict[str, List[List[Optional[float]]]] = {k: [[None] * m for _ in range(p)] for k in (FA, FZ, BZ, BA)}
    # where each rank's next pass of a kind takes its input: (the input's ends, crosses ranks), or
    # None where it has none (rank 0's first-leg forward)
    src = {FA: [(end[FA][i - 1], True) if i > 0 else None for i in range(p)],
           FZ: [(end[FZ][i + 1], True) if i < p - 1 else (end[FA][i], False) for i in range(p)],
           BZ: [(end[BZ][i - 1], True) if i > 0 else (end[FZ][i], False) for i in range(p)],
           BA: [(end[BA][i + 1], True) if i < p - 1 else (end[BZ][i], False) for i in range(p)]}
    clock, mem, idle, peak, first = [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p
    pend: List[deque] = [deque() for _ in range(p)]
    orders: List[List[Tuple[str, int, int]]] = [[] for _ in range(p)]
    approved = approved or [-1.0] * p
    top_approved = max(approved)
    near = [False, False]  # a comparison within EPS; one that tol=EPS decides unlike an exact one
    top_idle = [0.0]  # max(idle): idle times only grow

    def le(x: float, y: float) -> bool:
        d = x - y
        if 0.0 < abs(d) <= EPS:
            near[0] = True
            if d > 0.0:
                near[1] = True
        return d <= tol

    def dep(i: int, k: str) -> Optional[Tuple[float, bool]]:
        """(end of the input of rank i's next k, crosses ranks) or None if it has none elsewhere."""
        sr = src[k][i]
        if sr is None:
            return None
        e = sr[0][cnt[k][i]]
        if e is None:
            raise ScheduleError(f"V round heuristic: rank {i}'s {k} of microbatch {cnt[k][i]} has no input yet")
        return e, sr[1]

    def has_input(i: int, k: str) -> bool:
        sr = src[k][i]
        return sr is None or sr[0][cnt[k][i]] is not None

    def put(i: int, k: str) -> None:
        if k == "W":
            s, j = pend[i].popleft()
            start, d, dmm, kind = clock[i], cw[s], wmem[s], W
        else:
            j = cnt[k][i]
            if j >= m:
                raise ScheduleError(f"V round heuristic: rank {i} has no {k} left")
            start = clock[i]
            sr = src[k][i]  # (``dep``, inline: every pass asks)
            if sr is not None:
                e = sr[0][j]
                if e is None:
                    raise ScheduleError(f"V round heuristic: rank {i}'s {k} of microbatch {j} has no input yet")
                start = max(start, e + (c if sr[1] else 0.0))
            s, d, dmm, kind = stage[k][i], cost[k][i], dm[k][i], kind_of[k]
            if dmm > 0 and mem[i] + dmm > limit + EPS:
                raise ScheduleError(f"V round heuristic: rank {i} over the memory limit {limit:g}")
        if not orders[i]:
            first[i] = start
        if cnt[FA][i]:
            idle[i] += start - clock[i]
            if idle[i] > top_idle[0]:
                top_idle[0] = idle[i]
        clock[i] = start + d
        mem[i] += dmm
        peak[i] = max(peak[i], mem[i])
        orders[i].append((kind, s, j))
        if k != "W":
            end[k][i][j] = clock[i]
            cnt[k][i] += 1
            if kind == B:
                pend[i].append((s, j))

    def allowance(i: int) -> float:
        return max(top_idle[0], top_approved - approved[i]) - idle[i]

    def fill(i: int, k: str, overrun: bool) -> None:
        if k in (FZ, BA) and i == p - 1 or k == BZ and i == 0:
            return  # the input is on this rank: no wait to fill
        dd = dep(i, k) if k != FA or i > 0 else None
        if dd is None:
            return
        at = dd[0] + (c if dd[1] else 0.0)
        while pend[i] and le(clock[i] + cw[pend[i][0][0]], at):
            put(i, "W")
        if pend[i] and overrun and not le(at - clock[i], allowance(i)):
            put(i, "W")

    # 1. warm-up
    for i in range(p):
        put(i, FA)
    for i in range(p - 1, -1, -1):
        if i < p - 1:
            arrive = end[FZ][i + 1][0] + c
            while (cnt[FA][i] < m and le(clock[i] + cost[FA][i], arrive)
                   and mem[i] + fmem[i] * (2 + 2 * i) <= limit + EPS
                   and all(mem[j] + dm[FA][j] <= limit + EPS for j in range(i))):
                for j in range(i + 1):
                    put(j, FA)
        put(i, FZ)
    chunk = 0
    for i in range(1, p):
        full = False
        while not full and (cnt[FA][i] + cnt[FZ][i] < cnt[FA][i - 1] + cnt[FZ][i - 1]
                            or cnt[FZ][i] <= cnt[FZ][i - 1] < m):
            k = (FA, FZ)[chunk]
            # in the order the inputs flow: first-leg forwards up the ranks, second-leg ones down
            for j in (range(i, p) if k == FA else range(p - 1, i - 1, -1)):
                if cnt[k][j] < m:
                    if mem[j] + dm[k][j] > limit + EPS or not has_input(j, k):
                        # a rank whose chunks hold more than the one before it takes fewer
                        # warm-up forwards (and the ranks after it in this sweep lack an input)
                        full = True
                        break
                    put(j, k)
            chunk = 1 - chunk

    # 2. rounds (2m where every rank runs a B in each; a rank whose pass lacks its input or
    # memory sits a round out, as after a warm-up that gave a rank with heavier chunks fewer)
    while any(cnt[BA][i] < m or cnt[BZ][i] < m for i in range(p)):
        done = sum(cnt[BA]) + sum(cnt[BZ])
        for i in range(p):
            while mem[i] + bmem[i] > limit + EPS:
                if not pend[i]:
                    raise ScheduleError(f"V round heuristic: rank {i} cannot fit memory limit {limit:g}")
                put(i, "W")
        ba, bz = [], []
        for i in range(p):
            if cnt[BA][i] >= cnt[BZ][i]:
                bz.append(i)
            elif i == p - 1 or end[BA][i + 1][cnt[BA][i]] is not None or cnt[BZ][i] >= m:
                ba.append(i)
            else:
                bz.append(i)
        for i, k in [(i, BA) for i in reversed(ba)] + [(i, BZ) for i in bz]:
            if cnt[k][i] >= m or not has_input(i, k):
                continue
            fill(i, k, overrun=(k == BA or fill_b))
            put(i, k)
        if sum(cnt[BA]) + sum(cnt[BZ]) == done:
            raise ScheduleError("V round heuristic: no rank can run a backward")
        for i in range(p):
            if cnt[FZ][i] >= m:
                continue
            k = None
            if cnt[FZ][i] >= cnt[FA][i]:
                k = FA
            elif i == p - 1 or end[FZ][i + 1][cnt[FZ][i]] is not None:
                k = FZ
            elif cnt[FA][i] < m and (i == 0 or end[FA][i - 1][cnt[FA][i]] is not None):
                k = FA
            if k is None or not has_input(i, k):
                continue
            while mem[i] + dm[k][i] > limit + EPS and pend[i]:
                put(i, "W")
            if mem[i] + dm[k][i] > limit + EPS:
                continue
            fill(i, k, overrun=fill_f)
            put(i, k)

    # 3. the rest of the W's
    for i in range(p):
        while pend[i]:
            put(i, "W")
    if any(cnt[k][i] < m for k in cnt for i in range(p)):
        raise ScheduleError("V round heuristic: passes left unscheduled")
    spans = [clock[i] - first[i] for i in range(p)]
    key = (round(max(spans), 9), round(sum(spans), 9), round(max(peak), 9))
    return orders, key, tuple(near), list(idle)


def _materialize(orders, key, st: Setting, limit: float, name: str, policy: dict) -> Schedule:
    return Schedule(name, Placement.vshape(st.stages), st.microbatches,
                    [[Action(k, s, j) for k, s, j in o] for o in orders],
                    {"memory_limit": limit, "policy": policy, "timing": key})


def v_round_variants(setting: Setting, limit: float, name: str = "v-rounds", keep: Optional[int] = None,
                     depth: int = 10) -> List[Schedule]:
    """Every try (fill_b x fill_f, each redone with the idle allowance up to ``depth`` times while
    the largest idle time falls) that fits; with a tie tolerance of 1e-9 and, where a comparison
    fell within it, exact comparisons too. ``keep``: the best that many by makespan."""
    raws = []
    for fill_b, fill_f in itertools.product((True, False), repeat=2):
        # the tol=EPS chain's tries: (key, orders, whether tol=0 would decide otherwise, idle)
        done: List[Optional[tuple]] = []
        for tol in (EPS, 0.0):
            approved, top = None, None
            near = False
            reuse = tol == 0.0  # while the tries so far were the EPS chain's, unchanged
            for step in range(depth):
                if reuse and step < len(done) and done[step] is not None and not done[step][2]:
                    # no comparison of that try fell where exact comparisons decide otherwise:
                    # the exact try makes the same decisions, so it is the same schedule
                    key, orders, _, idle = done[step]
                else:
                    reuse = False
                    try:
                        orders, key, (near_t, differs), idle = _try(setting, limit, fill_b, fill_f, tol, approved)
                    except ScheduleError:
                        if tol == EPS:
                            done.append(None)
                        break
                    near = near or near_t
                    if tol == EPS:
                        done.append((key, orders, differs, idle))
                raws.append((key, orders, {"fill_b": fill_b, "fill_f": fill_f, "tie_tolerance": tol}))
                worst = max(idle)
                if top is not None and worst >= top - 1e-12:
                    break
                approved, top = idle, worst
            if not near:  # exact comparisons would decide the same
                break
    raws.sort(key=lambda r: r[0])
    if keep is not None:
        raws = raws[:keep]
    return [_materialize(o, k, setting, limit, name, pol) for k, o, pol in raws]
