"""V-placement orders the core can express without the zero-bubble V generators.

``gpipe-v``: GPipe on the V placement (rank r holds stages r and 2p-1-r): every rank runs all
forwards of its first chunk, then of its second, then the backwards in reverse. It exercises
the V turn-around on the last rank and embedding + loss on rank 0 with the plainest order.
"""
from __future__ import annotations

from ..ir import BW, Action, F, Placement, Schedule, Setting


def gpipe_v(setting: Setting) -> Schedule:
    p, m = setting.stages, setting.microbatches
    orders = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        order = [Action(F, first, j) for j in range(m)] + [Action(F, second, j) for j in range(m)]
        order += [Action(BW, second, j) for j in range(m)] + [Action(BW, first, j) for j in range(m)]
        orders.append(order)
    return Schedule("gpipe-v", Placement.vshape(p), m, orders, {"memory_claim": m})
