"""GPipe and 1F1B: one stage per rank, fused backward (BW)."""
from __future__ import annotations

from ..ir import BW, Action, F, Placement, Schedule, Setting


def gpipe(setting: Setting) -> Schedule:
    """All forwards, then all backwards in the same microbatch order."""
    p, m = setting.stages, setting.microbatches
    orders = [[Action(F, r, j) for j in range(m)] + [Action(BW, r, j) for j in range(m)]
              for r in range(p)]
    return Schedule("gpipe", Placement.single(p), m, orders, {"memory_claim": m})


def one_f_one_b(setting: Setting) -> Schedule:
    """Rank r runs min(p-1-r, m) warm-up forwards, then one F / one BW alternately, then cool-down."""
    p, m = setting.stages, setting.microbatches
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        order = [Action(F, r, j) for j in range(warm)]
        for j in range(m - warm):
            order += [Action(F, r, warm + j), Action(BW, r, j)]
        order += [Action(BW, r, j) for j in range(m - warm, m)]
        orders.append(order)
    return Schedule("1f1b", Placement.single(p), m, orders, {"memory_claim": min(p, m)})
