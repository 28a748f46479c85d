"""A memory-bounded greedy list scheduler with B/W split, for any placement.

It simulates the pipeline with the real per-stage costs and builds every rank's order as it goes:
the rank whose clock is earliest decides next (so everything that could be ready for it is
known), by this policy:

1. a **B** whose input gradient has arrived runs first (it is on the critical path);
2. else an **F** that is ready and fits in memory: deeper stages first (closer to the loss);
   an F keeps ``reserve`` free so the deepest stage of the rank can always take one more F
   (on the V placement that is what lets the turn-around come back down; without it the rank
   can fill its memory with first-chunk forwards and stall);
3. else a pending **W** (oldest first) fills the wait, if it fits before the next pass can start
   (``fill='fit'``) or always (``fill='always'``); a W also runs when memory blocks a ready F;
4. else the rank idles until the next moment something may become ready.

Forwards and backwards of each stage run in microbatch order. Which variant is best depends on
the costs, so callers try a few (``best_of``) and keep the shortest.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ...ir import BW, Action, B, F, Placement, Schedule, ScheduleError, Setting, W
from .evaluate import Coder, Run

EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    fill: str = "fit"  # 'fit' | 'always'
    b_first: bool = True  # B before a ready F
    reserve: bool = True  # keep room for one F of the rank's deepest stage
    cap: Optional[Tuple[int, ...]] = None  # per rank: most forwards in flight (F run, B not yet)


def greedy(setting: Setting, placement: Placement, limit: float, policy: Policy = Policy(),
           name: str = "greedy") -> Schedule:
    """One greedy schedule under a per-rank activation ``limit`` (units of mem-f)."""
    p, m = setting.stages, setting.microbatches
    pl = placement
    nst = pl.num_stages
    v = pl.chunks
    stages_of = [pl.stages_of(r) for r in range(p)]
    if setting.chunks != v:
        setting = dataclasses.replace(setting, chunks=v)
    cost = {(s, k): setting.pass_cost(k, pl.rank_of(s), s) for s in range(nst) for k in (F, B, W)}
    comm = setting.cost_comm
    fmem = [setting.pass_mem(F, pl.rank_of(s), s) for s in range(nst)]
    bfree = [-setting.pass_mem(B, pl.rank_of(s), s) for s in range(nst)]
    wfree = [-setting.pass_mem(W, pl.rank_of(s), s) for s in range(nst)]
    if max(fmem) > limit + EPS:
        raise ScheduleError(f"memory limit {limit:g} is below one forward's activation ({max(fmem):g})")

    rank_of = pl.stage_to_rank
    # per stage: the end of each microbatch's F and B, what a pass costs, the hop before its input
    end_f: List[List[Optional[float]]] = [[None] * m for _ in range(nst)]
    end_b: List[List[Optional[float]]] = [[None] * m for _ in range(nst)]
    cost_f, cost_b, cost_w = ([cost[(s, k)] for s in range(nst)] for k in (F, B, W))
    hop_f = [comm if s > 0 and rank_of[s - 1] != rank_of[s] else 0.0 for s in range(nst)]
    hop_b = [comm if s < nst - 1 and rank_of[s + 1] != rank_of[s] else 0.0 for s in range(nst)]
    next_f = [0] * nst
    next_b = [0] * nst
    pending_w: List[deque] = [deque() for _ in range(p)]  # (stage, mb), B order
    mem = [0.0] * p
    inflight = [0] * p
    clock = [0.0] * p
    orders: List[List[Action]] = [[] for _ in range(p)]
    done = [0] * p
    total = [len(stages_of[r]) * m * 3 for r in range(p)]
    last = nst - 1
    cap, b_first, fill_always = policy.cap, policy.b_first, policy.fill == "always"

    def run(r, kind, s, mb, start):
        if kind == F:
            t_end = start + cost_f[s]
            end_f[s][mb] = t_end
            next_f[s] += 1
            mem[r] += fmem[s]
            inflight[r] += 1
        elif kind == B:
            t_end = start + cost_b[s]
            end_b[s][mb] = t_end
            next_b[s] += 1
            inflight[r] -= 1
            mem[r] -= bfree[s]
            pending_w[r].append((s, mb))
        else:
            t_end = start + cost_w[s]
            mem[r] -= wfree[s]
        clock[r] = t_end
        orders[r].append(Action(kind, s, mb))
        done[r] += 1

    # per rank, deeper stages first, each with what an F of it needs free (with ``reserve``: room
    # for one more F of the rank's deepest stage too)
    down = []
    for r in range(p):
        deepest = max(stages_of[r])
        down.append([(s, fmem[s] + (fmem[deepest] if policy.reserve and s != deepest else 0.0))
                     for s in sorted(stages_of[r], reverse=True)])
    top = limit + EPS
    # a rank waiting for others: its clock is raised to the next candidate time
    heap = [(0.0, r) for r in range(p)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    # the clocks of the ranks with passes left, sorted (the earliest later clock of another rank)
    active = sorted(clock[r] for r in range(p) if total[r])
    listed = list(clock)
    idle_rounds = 0
    while heap:
        t, r = pop(heap)
        if t < clock[r] - EPS:  # stale entry
            continue
        if done[r] == total[r]:
            continue
        t = clock[r]
        now_t = t + EPS
        capped = cap is not None and inflight[r] >= cap[r]
        b_pick = f_pick = future = None  # the deepest ready B, the deepest ready F that fits
        f_ready = False
        for s, need in down[r]:
            mb = next_b[s]  # when the next B of stage s can start (None: not yet known)
            if mb < m and mb < next_f[s]:
                if s == last:
                    rt = end_f[s][mb]
                else:
                    rt = end_b[s + 1][mb]
                    if rt is not None:
                        rt += hop_b[s]
                if rt is not None:
                    if rt <= now_t:
                        if b_pick is None:
                            b_pick = s
                    elif future is None or rt < future:
                        future = rt
            mb = next_f[s]
            if mb < m:
                if s == 0:
                    rt = 0.0
                else:
                    rt = end_f[s - 1][mb]
                    if rt is not None:
                        rt += hop_f[s]
                if rt is not None:
                    if rt <= now_t:
                        f_ready = True
                        if not capped and f_pick is None and mem[r] + need <= top:
                            f_pick = s
                    elif future is None or rt < future:
                        future = rt
        if b_pick is not None and (b_first or f_pick is None):
            run(r, B, b_pick, next_b[b_pick], t)
            idle_rounds = 0
        elif f_pick is not None:
            run(r, F, f_pick, next_f[f_pick], t)
            idle_rounds = 0
        else:
            i = bisect.bisect_right(active, now_t)  # another rank's clock after now (this one's is now)
            other = active[i] if i < len(active) else None
            horizon = future if other is None else (other if future is None else min(future, other))
            pw = pending_w[r]
            if pw and (fill_always or (f_ready and not capped) or horizon is None
                       or horizon - t >= cost_w[pw[0][0]] - EPS):
                s, mb = pw.popleft()
                run(r, W, s, mb, t)
                idle_rounds = 0
            elif horizon is not None:
                clock[r] = horizon
            else:
                # nothing known will ever unblock this rank unless another rank at the same
                # clock moves first
                idle_rounds += 1
                if idle_rounds > 4 * p:
                    raise ScheduleError(f"greedy schedule stalls under memory limit {limit:g}: "
                                        f"rank {r} cannot proceed at time {t:g}")
                clock[r] = t + EPS
        del active[bisect.bisect_left(active, listed[r])]
        if done[r] < total[r]:
            push(heap, (clock[r], r))
            bisect.insort(active, clock[r])
            listed[r] = clock[r]
    return Schedule(name, pl, m, orders, {"memory_limit": limit, "policy": policy.__dict__})


POLICIES = [Policy(fill, b_first, reserve) for fill, b_first, reserve in
            itertools.product(("fit", "always"), (True, False), (True, False))]


def best_of(setting: Setting, placement: Placement, limit: float, name: str,
            policies: Sequence[Policy] = tuple(POLICIES)) -> Schedule:
    """Try each policy; keep the valid schedule with the smallest makespan (then peak memory)."""
    best, best_key, errors = None, None, []
    coder = Coder.of(setting, placement, setting.microbatches)
    for pol in policies:
        try:
            s = greedy(setting, placement, limit, pol, name)
            res = Run(coder, s, setting)  # the simulator's times, coded
        except ScheduleError as e:
            errors.append(str(e))
            continue
        if res.peak > limit + 1e-6:
            continue
        key = (round(res.makespan, 9), round(res.peak, 9))
        if best_key is None or key < best_key:
            best, best_key = s, key
    if best is None:
        raise ScheduleError(f"no schedule fits memory limit {limit:g}" + (f" ({errors[0]})" if errors else ""))
    return best


def arrival_caps(setting: Setting, limit: float, overrun: float = 0.0, step: int = 1) -> Tuple[int, ...]:
    """Per-rank forwards in flight for one stage per rank: the forwards that end (``overrun`` x F
    later at most) before microbatch 0's gradient can come back to the rank, within the memory
    limit, each rank at least ``step`` fewer than the one before (warm-up admission)."""
    p, c = setting.stages, setting.cost_comm
    caps = []
    for r in range(p):
        back = sum(setting.cost_f[s] + setting.cost_b[s] + 2 * c for s in range(r + 1, p))
        f = setting.cost_f[r]
        k = 1 + (int((back + overrun * f) / f + EPS) if f > 0 else setting.microbatches)
        caps.append(max(1, min(k, int(limit / setting.mem_f[r] + EPS), setting.microbatches)))
    for r in range(1, p):
        caps[r] = max(1, min(caps[r], caps[r - 1] - step))
    return tuple(caps)


def capped_variants(setting: Setting, limit: float, name: str) -> List[Schedule]:
    """Greedy schedules whose ranks keep at most their warm-up count of forwards in flight."""
    pl = Placement.single(setting.stages)
    out, seen = [], set()
    for overrun, step in itertools.product((0.0, 0.5, 1.0), (1, 2)):
        caps = arrival_caps(setting, limit, overrun, step)
        if caps in seen:
            continue
        seen.add(caps)
        for fill in ("fit", "always"):
            try:
                out.append(greedy(setting, pl, limit, Policy(fill, True, False, caps), name))
            except ScheduleError:
                pass
    return out
