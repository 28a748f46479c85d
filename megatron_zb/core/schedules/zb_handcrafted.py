"""ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism"), one stage per rank.

Both keep 1F1B's shape for F and B and differ in two numbers per rank r:

* ``warm``: forwards before the first B. ZB-H1 keeps 1F1B's p-r; ZB-H2 fills the warm-up
  bubble with 2(p-1-r)+1 forwards (2p-1 on rank 0).
* ``lag``: how many W passes a rank keeps pending behind its B passes. Rank r may hold
  ``lag`` pending W (mem-w each) because it holds fewer in-flight forwards than rank 0; the
  pending W's are what fill the cool-down bubble at the end. ZB-H1 lags r, ZB-H2 lags 2r.

Steady state per microbatch: B, then W of the oldest microbatch beyond the lag, then the next F.
With T_W <= min(T_F, T_B) the bubble is (p-1)(T_F+T_B-T_W) for ZB-H1 at 1F1B's peak memory
(p microbatches), and (p-1)(T_F+T_B-2T_W) for ZB-H2 at 2p-1 microbatches, once m >= 2p-1.
"""
from __future__ import annotations

from collections import deque
from typing import List

from ..ir import Action, B, F, Placement, Schedule, Setting, W


def rank_order(rank: int, m: int, warm: int, lag: int) -> List[Action]:
    warm = min(warm, m)
    order = [Action(F, rank, j) for j in range(warm)]
    pending = deque()
    next_f = warm
    for j in range(m):
        order.append(Action(B, rank, j))
        pending.append(j)
        while len(pending) > lag:
            order.append(Action(W, rank, pending.popleft()))
        if next_f < m:
            order.append(Action(F, rank, next_f))
            next_f += 1
    order += [Action(W, rank, j) for j in pending]
    return order


def zb_h1(setting: Setting) -> Schedule:
    p, m = setting.stages, setting.microbatches
    orders = [rank_order(r, m, warm=p - r, lag=r) for r in range(p)]
    return Schedule("zb-h1", Placement.single(p), m, orders, {"memory_claim": min(p, m)})


def zb_h2(setting: Setting) -> Schedule:
    p, m = setting.stages, setting.microbatches
    orders = [rank_order(r, m, warm=2 * (p - 1 - r) + 1, lag=2 * r) for r in range(p)]
    return Schedule("zb-h2", Placement.single(p), m, orders, {"memory_claim": min(2 * p - 1, m)})
