"""What splitting a backward into B and W costs, from a setting: whether it costs anything on a
placement (``Setting.cost_bw`` below B + W on some chunk), and the same setting with the split free
(each chunk's W the fused backward less its B), against which a schedule's split is priced. Pure
functions over ``ir.Setting`` and ``ir.Placement``."""
from __future__ import annotations

import dataclasses

from ..ir import BW, B, Placement, Setting, W

__all__ = ["split_costs", "split_free"]


def split_costs(setting: Setting, placement: Placement) -> bool:
    """Whether a split backward (B, then W) costs more than the fused one on some chunk of
    ``placement`` (``cost_bw`` below B + W)."""
    if setting.cost_bw is None:
        return False
    st = _on(setting, placement)
    return any(st.pass_cost(BW, r, s) < st.pass_cost(B, r, s) + st.pass_cost(W, r, s) - 1e-12
               for s in range(placement.num_stages) for r in (placement.rank_of(s),))


def split_free(setting: Setting, placement: Placement) -> Setting:
    """``setting`` with the split costing nothing on ``placement``: each chunk's W is the fused
    backward's time less its B (B + W = BW), given per chunk. A schedule's time there against its
    time in ``setting`` is what its split costs it. ``setting`` itself where ``cost_bw`` is None or
    the stages are replicated (their schedules run fused backwards)."""
    if setting.cost_bw is None or placement.paths is not None:
        return setting
    st = _on(setting, placement)
    stages = [(placement.rank_of(s), s) for s in range(placement.num_stages)]
    b = [st.pass_cost(B, r, s) - st.pass_a2a(B, r, s) for r, s in stages]
    fused = [st.pass_cost(BW, r, s) - st.pass_a2a(BW, r, s) for r, s in stages]
    return dataclasses.replace(st, cost_b=b, cost_bw=None, cost_w=[max(0.0, x - y) for x, y in zip(fused, b)])


def _on(setting: Setting, placement: Placement) -> Setting:
    """``setting`` with ``placement``'s chunks per rank (each chunk's pass costs the rank's value / chunks)."""
    return setting if setting.chunks == placement.chunks else dataclasses.replace(setting, chunks=placement.chunks)
