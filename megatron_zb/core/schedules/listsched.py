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

from ..ir import BW, Action, F, Placement, Schedule, ScheduleError, Setting

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
    f_seq, b_seq, cap = plan.f_seq, plan.b_seq, plan.cap
    n_f = [len(x) for x in f_seq]
    n_b = [len(x) for x in b_seq]
    rank_of = pl.stage_to_rank
    prev_of = [pl.prev_stage(s) for s in range(pl.num_stages)]
    next_of = [pl.next_stage(s) for s in range(pl.num_stages)]
    cost_f = [cost[(s, F)] for s in range(pl.num_stages)]
    cost_bw = [cost[(s, BW)] for s in range(pl.num_stages)]
    over = [c + EPS for c in cap]
    finished = [n_f[r] == 0 and n_b[r] == 0 for r in range(p)]

    def f_ready(r) -> Optional[float]:
        s, mb = f_seq[r][fi[r]]
        prev = prev_of[s]
        if prev is None:
            return 0.0
        t = end.get((0, prev, mb))
        return None if t is None else t + (comm if rank_of[prev] != r else 0.0)

    def b_ready(r) -> Optional[float]:
        s, mb = b_seq[r][bi[r]]
        nxt = next_of[s]
        if nxt is None:
            return end.get((0, s, mb))
        t = end.get((1, nxt, mb))
        return None if t is None else t + (comm if rank_of[nxt] != r else 0.0)

    def can_progress(q) -> bool:
        """Something of rank q's own has a known ready time (else it waits on other ranks)."""
        if finished[q]:
            return False
        if bi[q] < n_b[q] and b_ready(q) is not None:
            return True
        return fi[q] < n_f[q] and mem[q] + fmem[f_seq[q][fi[q]][0]] <= over[q] and f_ready(q) is not None

    def stall():
        waits = []
        for q in range(p):
            if finished[q]:
                continue
            nb = b_seq[q][bi[q]] if bi[q] < n_b[q] else None
            nf = f_seq[q][fi[q]] if fi[q] < n_f[q] else None
            waits.append(f"rank {q} waits for BW{nb} / F{nf} (activation {mem[q]:g} of {cap[q]:g})")
        return ScheduleError(f"{name} stalls: " + "; ".join(waits))

    seq = itertools.count()
    heap = [(0.0, next(seq), r) for r in range(p)]
    heapq.heapify(heap)
    budget = 64 * (sum(n_f) + 2 * p) + 1000  # decisions; a safety net
    while heap:
        budget -= 1
        if budget < 0:
            raise stall()
        _, _, r = heapq.heappop(heap)
        if finished[r]:
            continue
        t = clock[r]
        now = t + EPS
        has_b = bi[r] < n_b[r]
        has_f = fi[r] < n_f[r]
        brt = b_ready(r) if has_b else None
        frt = f_ready(r) if has_f else None
        fits = has_f and mem[r] + fmem[f_seq[r][fi[r]][0]] <= over[r]
        if brt is not None and brt <= now:
            s, mb = b_seq[r][bi[r]]
            bi[r] += 1
            kind, key, dm, c = BW, 1, bmem[s], cost_bw[s]
        elif fits and frt is not None and frt <= now:
            s, mb = f_seq[r][fi[r]]
            fi[r] += 1
            kind, key, dm, c = F, 0, fmem[s], cost_f[s]
        else:
            known = [x for x in (brt, frt if fits else None) if x is not None and x > now]
            if not known and not any(can_progress(q) for q in range(p)):
                raise stall()
            # another rank may deliver what this one waits for: not before its clock, and a rank
            # deciding at this very moment not before its shortest pass ends
            low = t - EPS
            others = [clock[q] + (shortest[q] if clock[q] <= now else 0.0)
                      for q in range(p) if q != r and not finished[q] and clock[q] >= low]
            horizon = min(known + others) if (known or others) else None
            if horizon is not None and horizon > now:
                clock[r] = horizon
            heapq.heappush(heap, (clock[r], next(seq), r))
            continue
        clock[r] = end[(key, s, mb)] = t + c
        mem[r] += dm
        orders[r].append(Action(kind, s, mb))
        finished[r] = fi[r] >= n_f[r] and bi[r] >= n_b[r]
        if not finished[r]:
            heapq.heappush(heap, (clock[r], next(seq), r))
    return Schedule(name, pl, m, orders, dict(meta or {}))


def in_flight_cap(setting: Setting, placement: Placement, counts: Sequence[float]) -> List[float]:
    """Per-rank caps from counts of in-flight chunk forwards (each allocating mem-f / chunks; with
    per-chunk memory, the rank's largest chunk's)."""
    st = setting if setting.chunks == placement.chunks else dataclasses.replace(setting, chunks=placement.chunks)
    return [counts[r] * max(st.pass_mem(F, r, s) for s in placement.stages_of(r)) for r in range(placement.num_ranks)]
