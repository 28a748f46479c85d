"""A list scheduler over fixed per-rank sequences, timed with the real costs (fused backward).

Each rank gets the order in which it may start its forwards (``f_seq``) and its fused backwards
(``b_seq``), both lists of (stage, microbatch), and an activation cap. The scheduler simulates the
pipeline (costs from the setting, ``cost_comm`` on every hop between ranks, any placement,
replicated stages included) and builds each rank's action list as it goes; the rank whose clock is
earliest decides next:

1. the next backward of ``b_seq`` if its output gradient has arrived (the critical path);
2. else the next forward of ``f_seq`` if its input has arrived and its activation fits under the
   rank's cap;
3. else the rank idles until the next moment something may become ready.

With the cap of a 1F1B-like warm-up this gives the warm-up / steady / cool-down shape, adapted to
unequal costs. Everything is deterministic (no clocks). Used by ``bitpipe``.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import BW, F, Action, Placement, Schedule, ScheduleError, Setting

EPS = 1e-9
Item = Tuple[int, int]  # (stage, microbatch)


@dataclass
class Plan:
    f_seq: List[List[Item]]
    b_seq: List[List[Item]]
    cap: List[float]  # per rank, activation memory (units of mem-f)


def run(name: str, setting: Setting, placement: Placement, plan: Plan, m: int,
        meta: Optional[dict] = None) -> Schedule:
    pl = placement
    p = pl.num_ranks
    if setting.chunks != pl.chunks:
        setting = dataclasses.replace(setting, chunks=pl.chunks)
    cost = {(s, k): setting.pass_cost(k, pl.rank_of(s), s) for s in range(pl.num_stages) for k in (F, BW)}
    fmem = [setting.pass_mem(F, pl.rank_of(s), s) for s in range(pl.num_stages)]
    bmem = [setting.pass_mem(BW, pl.rank_of(s), s) for s in range(pl.num_stages)]
    comm = setting.cost_comm
    shortest = [min([c for s in pl.stages_of(r) for c in (cost[(s, F)], cost[(s, BW)]) if c > 0] or [0.0])
                for r in range(p)]
    for r in range(p):
        need = max([fmem[s] for s, _ in plan.f_seq[r]], default=0.0)
        if need > plan.cap[r] + EPS:
            raise ScheduleError(f"{name}: activation limit {plan.cap[r]:g} on rank {r} is below one forward's "
                                f"activation ({need:g})")

    end: Dict[Tuple[int, int, int], float] = {}  # (0 = F / 1 = BW, stage, mb) -> end time
    fi = [0] * p
    bi = [0] * p
    mem = [0.0] * p
    clock = [0.0] * p
    orders: List[List[Action]] = [[] for _ in range(p)]

    def arrival(kind, s, mb, r):
        t = end.get((kind, s, mb))
        if t is None:
            return None
        return t + (comm if pl.rank_of(s) != r else 0.0)

    def f_ready(r) -> Optional[float]:
        s, mb = plan.f_seq[r][fi[r]]
        prev = pl.prev_stage(s)
        return 0.0 if prev is None else arrival(0, prev, mb, r)

    def b_ready(r) -> Optional[float]:
        s, mb = plan.b_seq[r][bi[r]]
        nxt = pl.next_stage(s)
        if nxt is None:
            return end.get((0, s, mb))
        return arrival(1, nxt, mb, r)

    def done(r) -> bool:
        return fi[r] >= len(plan.f_seq[r]) and bi[r] >= len(plan.b_seq[r])

    def can_progress(q) -> bool:
        """Something of rank q's own has a known ready time (else it waits on other ranks)."""
        if done(q):
            return False
        if bi[q] < len(plan.b_seq[q]) and b_ready(q) is not None:
            return True
        return (fi[q] < len(plan.f_seq[q]) and mem[q] + fmem[plan.f_seq[q][fi[q]][0]] <= plan.cap[q] + EPS
                and f_ready(q) is not None)

    def stall():
        waits = []
        for q in range(p):
            if done(q):
                continue
            nb = plan.b_seq[q][bi[q]] if bi[q] < len(plan.b_seq[q]) else None
            nf = plan.f_seq[q][fi[q]] if fi[q] < len(plan.f_seq[q]) else None
            waits.append(f"rank {q} waits for BW{nb} / F{nf} (activation {mem[q]:g} of {plan.cap[q]:g})")
        return ScheduleError(f"{name} stalls: " + "; ".join(waits))

    seq = itertools.count()
    heap = [(0.0, next(seq), r) for r in range(p)]
    heapq.heapify(heap)
    budget = 64 * (sum(len(x) for x in plan.f_seq) + 2 * p) + 1000  # decisions; a safety net
    while heap:
        budget -= 1
        if budget < 0:
            raise stall()
        _, _, r = heapq.heappop(heap)
        if done(r):
            continue
        t = clock[r]
        has_b = bi[r] < len(plan.b_seq[r])
        has_f = fi[r] < len(plan.f_seq[r])
        brt = b_ready(r) if has_b else None
        frt = f_ready(r) if has_f else None
        fits = has_f and mem[r] + fmem[plan.f_seq[r][fi[r]][0]] <= plan.cap[r] + EPS
        if brt is not None and brt <= t + EPS:
            s, mb = plan.b_seq[r][bi[r]]
            bi[r] += 1
            kind, key, dm = BW, 1, bmem[s]
        elif fits and frt is not None and frt <= t + EPS:
            s, mb = plan.f_seq[r][fi[r]]
            fi[r] += 1
            kind, key, dm = F, 0, fmem[s]
        else:
            known = [x for x in (brt, frt if fits else None) if x is not None and x > t + EPS]
            if not known and not any(can_progress(q) for q in range(p)):
                raise stall()
            # another rank may deliver what this one waits for: not before its clock, and a rank
            # deciding at this very moment not before its shortest pass ends
            others = [clock[q] + (shortest[q] if clock[q] <= t + EPS else 0.0)
                      for q in range(p) if q != r and not done(q) and clock[q] >= t - EPS]
            horizon = min(known + others) if (known or others) else None
            if horizon is not None and horizon > t + EPS:
                clock[r] = horizon
            heapq.heappush(heap, (clock[r], next(seq), r))
            continue
        clock[r] = end[(key, s, mb)] = t + cost[(s, kind)]
        mem[r] += dm
        orders[r].append(Action(kind, s, mb))
        if not done(r):
            heapq.heappush(heap, (clock[r], next(seq), r))
    return Schedule(name, pl, m, orders, dict(meta or {}))


def in_flight_cap(setting: Setting, placement: Placement, counts: Sequence[float]) -> List[float]:
    """Per-rank caps from counts of in-flight chunk forwards (each allocating mem-f / chunks; with
    per-chunk memory, the rank's largest chunk's)."""
    st = setting if setting.chunks == placement.chunks else dataclasses.replace(setting, chunks=placement.chunks)
    return [counts[r] * max(st.pass_mem(F, r, s) for s in placement.stages_of(r)) for r in range(placement.num_ranks)]
