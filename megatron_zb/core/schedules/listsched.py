"""A list scheduler over fixed per-rank sequences, timed with the real costs.

Each rank gets the order in which it may start its forwards (``f_seq``) and its backwards
(``b_seq``), both lists of (stage, microbatch), and an activation cap. The scheduler simulates the
pipeline (costs from the setting, ``cost_comm`` on every hop between ranks, any placement,
replicated stages included) and builds each rank's action list as it goes; the rank whose clock is
earliest decides next:

1. the next backward of ``b_seq`` if its output gradient has arrived (the critical path);
2. else the next forward of ``f_seq`` if its input has arrived and its activation fits under the
   rank's cap (the cap counts every held activation, pending W's included);
3. else, with a split backward, the oldest pending W if the rank would otherwise idle at least that
   long (``fill='fit'``), whenever it would idle (``fill='idle'``), or when memory blocks a ready
   forward; and always before anything else while more than ``lag[r]`` W's are pending (ZB-H1's
   rule: rank r keeps r W's in reserve for the cool-down);
4. else the rank idles until the next moment something may become ready.

With the caps of 1F1B-like warm-ups this reproduces the familiar warm-up / steady / cool-down
shape, and adapts it to unequal costs. Everything is deterministic (no clocks).
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from ..ir import B, BW, F, W, Action, Placement, Schedule, ScheduleError, Setting

EPS = 1e-9
Item = Tuple[int, int]  # (stage, microbatch)


@dataclass
class Plan:
    f_seq: List[List[Item]]
    b_seq: List[List[Item]]
    cap: List[float]  # per rank, activation memory (units of mem-f)
    split: bool = True
    fill: str = "fit"  # 'fit' | 'idle'
    lag: Optional[List[int]] = None  # per rank: at most this many W's pending (older ones run first)


def run(name: str, setting: Setting, placement: Placement, plan: Plan, m: int,
        meta: Optional[dict] = None) -> Schedule:
    pl = placement
    p = pl.num_ranks
    if setting.chunks != pl.chunks:
        import dataclasses
        setting = dataclasses.replace(setting, chunks=pl.chunks)
    bkind = B if plan.split else BW
    cost = {(r, k): setting.pass_cost(k, r) for r in range(p) for k in (F, B, W, BW)}
    fmem = [setting.pass_mem(F, r) for r in range(p)]
    bmem = [setting.pass_mem(bkind, r) for r in range(p)]
    wmem = [setting.pass_mem(W, r) for r in range(p)]
    comm = setting.cost_comm
    shortest = [min([c for c in (cost[(r, F)], cost[(r, bkind)]) if c > 0] or [0.0]) for r in range(p)]
    for r in range(p):
        if plan.f_seq[r] and fmem[r] > plan.cap[r] + EPS:
            raise ScheduleError(f"{name}: activation limit {plan.cap[r]:g} on rank {r} is below one forward's "
                                f"activation ({fmem[r]:g})")

    end: Dict[Tuple[str, int, int], float] = {}
    fi = [0] * p
    bi = [0] * p
    pending: List[Deque[Item]] = [deque() for _ in range(p)]
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
        return 0.0 if prev is None else arrival(F, prev, mb, r)

    def b_ready(r) -> Optional[float]:
        s, mb = plan.b_seq[r][bi[r]]
        nxt = pl.next_stage(s)
        if nxt is None:
            return end.get((F, s, mb))
        return arrival("B*", nxt, mb, r)

    def run_pass(r, kind, s, mb, start):
        t_end = start + cost[(r, kind)]
        end[(kind, s, mb)] = t_end
        if kind in (B, BW):
            end[("B*", s, mb)] = t_end
        clock[r] = t_end
        orders[r].append(Action(kind, s, mb))

    def done(r) -> bool:
        return fi[r] >= len(plan.f_seq[r]) and bi[r] >= len(plan.b_seq[r]) and not pending[r]

    def can_progress(q) -> bool:
        """Something of rank q's own is runnable now or has a known time (else it waits on others)."""
        if done(q):
            return False
        if pending[q]:
            return True
        if bi[q] < len(plan.b_seq[q]) and b_ready(q) is not None:
            return True
        return (fi[q] < len(plan.f_seq[q]) and mem[q] + fmem[q] <= plan.cap[q] + EPS
                and f_ready(q) is not None)

    seq = itertools.count()
    heap = [(0.0, next(seq), r) for r in range(p)]
    heapq.heapify(heap)
    budget = 64 * (sum(len(x) for x in plan.f_seq) + 2 * p) + 1000  # decisions; passes take 1-3 each
    while heap:
        budget -= 1
        if budget < 0:
            raise ScheduleError(f"{name} stalls: the ranks only wait on each other (no pass can start)")
        t, _, r = heapq.heappop(heap)
        if done(r):
            continue
        t = clock[r]
        has_b = bi[r] < len(plan.b_seq[r])
        has_f = fi[r] < len(plan.f_seq[r])
        brt = b_ready(r) if has_b else None
        frt = f_ready(r) if has_f else None
        fits = has_f and mem[r] + fmem[r] <= plan.cap[r] + EPS
        ran = True
        if plan.lag is not None and len(pending[r]) > plan.lag[r]:
            s, mb = pending[r].popleft()
            run_pass(r, W, s, mb, t)
            mem[r] += wmem[r]
        elif brt is not None and brt <= t + EPS:
            s, mb = plan.b_seq[r][bi[r]]
            bi[r] += 1
            run_pass(r, bkind, s, mb, t)
            mem[r] += bmem[r]
            if plan.split:
                pending[r].append((s, mb))
        elif fits and frt is not None and frt <= t + EPS:
            s, mb = plan.f_seq[r][fi[r]]
            fi[r] += 1
            run_pass(r, F, s, mb, t)
            mem[r] += fmem[r]
        else:
            known = [x for x in (brt, frt if fits else None) if x is not None and x > t + EPS]
            # another rank may deliver what this one waits for: not before its clock, and a rank
            # deciding at this very moment not before its shortest pass ends
            others = [clock[q] + (shortest[q] if clock[q] <= t + EPS else 0.0)
                      for q in range(p) if q != r and not done(q) and clock[q] >= t - EPS]
            horizon = min(known + others) if (known or others) else None
            blocked = has_f and not fits and frt is not None and frt <= t + EPS
            w_now = bool(pending[r]) and (
                blocked or horizon is None or (not has_b and not has_f) or plan.fill == "idle"
                or horizon - t >= cost[(r, W)] - EPS)
            if w_now:
                s, mb = pending[r].popleft()
                run_pass(r, W, s, mb, t)
                mem[r] += wmem[r]
            else:
                ran = False
                if not known and not any(can_progress(q) for q in range(p)):
                    waits = []
                    for q in range(p):
                        if done(q):
                            continue
                        nb = plan.b_seq[q][bi[q]] if bi[q] < len(plan.b_seq[q]) else None
                        nf = plan.f_seq[q][fi[q]] if fi[q] < len(plan.f_seq[q]) else None
                        waits.append(f"rank {q} waits for B{nb} / F{nf} (activation {mem[q]:g} of "
                                     f"{plan.cap[q]:g})")
                    raise ScheduleError(f"{name} stalls: " + "; ".join(waits))
                if horizon is not None and horizon > t + EPS:
                    clock[r] = horizon
        if not done(r):
            heapq.heappush(heap, (clock[r], next(seq), r))
    return Schedule(name, pl, m, orders, dict(meta or {}))


def in_flight_cap(setting: Setting, placement: Placement, counts: Sequence[float]) -> List[float]:
    """Per-rank caps from counts of in-flight chunk forwards (each allocating mem-f / chunks)."""
    v = placement.chunks
    return [counts[r] * setting.mem_f[r] / v for r in range(placement.num_ranks)]
