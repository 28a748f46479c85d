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

import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import B, BW, F, W, Action, Placement, Schedule, ScheduleError, Setting
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

    end: Dict[Tuple[str, int, int], float] = {}
    next_f = {s: 0 for s in range(nst)}
    next_b = {s: 0 for s in range(nst)}
    pending_w: List[List[Tuple[int, int]]] = [[] for _ in range(p)]  # (stage, mb), B order
    mem = [0.0] * p
    inflight = [0] * p
    clock = [0.0] * p
    orders: List[List[Action]] = [[] for _ in range(p)]
    done = [0] * p
    total = [len(stages_of[r]) * m * 3 for r in range(p)]

    def arrival(kind, s, mb, r):
        t = end.get((kind, s, mb))
        if t is None:
            return None
        return t + (comm if pl.rank_of(s) != r else 0.0)

    def ready_time(r, kind, s):
        """When the next F/B of stage s on rank r can start (None: not yet known)."""
        if kind == F:
            mb = next_f[s]
            if mb >= m:
                return None
            return 0.0 if s == 0 else arrival(F, s - 1, mb, r)
        mb = next_b[s]
        if mb >= m or mb >= next_f[s]:
            return None
        if s == nst - 1:
            return end[(F, s, mb)]
        return arrival(B, s + 1, mb, r)

    def run(r, kind, s, mb, start):
        t_end = start + cost[(s, kind)]
        end[(kind, s, mb)] = t_end
        clock[r] = t_end
        orders[r].append(Action(kind, s, mb))
        done[r] += 1
        if kind == F:
            next_f[s] += 1
            mem[r] += fmem[s]
            inflight[r] += 1
        elif kind == B:
            next_b[s] += 1
            inflight[r] -= 1
            mem[r] -= bfree[s]
            pending_w[r].append((s, mb))
        else:
            mem[r] -= wfree[s]

    deepest = [max(stages_of[r]) for r in range(p)]
    # a rank waiting for others: its clock is raised to the next candidate time
    heap = [(0.0, r) for r in range(p)]
    heapq.heapify(heap)
    idle_rounds = 0
    while heap:
        t, r = heapq.heappop(heap)
        if t < clock[r] - EPS:  # stale entry
            continue
        if done[r] == total[r]:
            continue
        t = clock[r]
        cands = []  # (ready_at, kind, stage)
        for s in stages_of[r]:
            for kind in (B, F):
                rt = ready_time(r, kind, s)
                if rt is not None:
                    cands.append((rt, kind, s))
        now = [c for c in cands if c[0] <= t + EPS]
        bs = sorted((c for c in now if c[1] == B), key=lambda c: -c[2])
        fs = []
        capped = policy.cap is not None and inflight[r] >= policy.cap[r]
        for c in sorted((c for c in now if c[1] == F and not capped), key=lambda c: -c[2]):
            need = fmem[c[2]] + (fmem[deepest[r]] if policy.reserve and c[2] != deepest[r] else 0.0)
            if mem[r] + need <= limit + EPS:
                fs.append(c)
        f_blocked = any(c[1] == F for c in now) and not fs and not capped
        pick = None
        if bs and (policy.b_first or not fs):
            pick = bs[0]
        elif fs:
            pick = fs[0]
        if pick is not None:
            kind, s = pick[1], pick[2]
            run(r, kind, s, next_f[s] if kind == F else next_b[s], t)
            idle_rounds = 0
        else:
            future = [c[0] for c in cands if c[0] > t + EPS]
            others = [clock[q] for q in range(p) if q != r and done[q] < total[q] and clock[q] > t + EPS]
            horizon = min(future + others) if (future or others) else None
            wgap_ok = pending_w[r] and (policy.fill == "always" or f_blocked or horizon is None
                                        or horizon - t >= cost[(pending_w[r][0][0], W)] - EPS)
            if wgap_ok:
                s, mb = pending_w[r].pop(0)
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
        if done[r] < total[r]:
            heapq.heappush(heap, (clock[r], r))
    return Schedule(name, pl, m, orders, {"memory_limit": limit, "policy": policy.__dict__})


POLICIES = [Policy(fill, b_first, reserve) for fill, b_first, reserve in
            itertools.product(("fit", "always"), (True, False), (True, False))]


def best_of(setting: Setting, placement: Placement, limit: float, name: str,
            policies: Sequence[Policy] = tuple(POLICIES)) -> Schedule:
    """Try each policy; keep the valid schedule with the smallest makespan (then peak memory)."""
    best, best_key, errors = None, None, []
    coder = Coder(setting, placement, setting.microbatches)
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
