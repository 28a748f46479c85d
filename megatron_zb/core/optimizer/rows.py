"""`megatron-zb plan --optimizer-offload`: one row's optimizer step and memory with the Adam states
on the GPU, on the host per rank (Megatron's CPU update), or visiting the troughs
(``core.optimizer.offload``). Pure Python.

Every row with this option counts its optimizer step per rank (the row's ``cost_optimizer`` plus
the modelled update), so rows with and without offload compare on the same footing:

* ``none``: every state on the GPU, step = the fused GPU update of the rank's parameters;
* ``static``: Megatron's one fraction for every rank (the largest rank's need), CPU updates;
* ``auto``: each rank's share from its own need (``auto_fractions``), updated on the CPU
  (Megatron's ``HybridDeviceOptimizer`` with that rank's fraction);
* ``trough``: the same shares, visiting the GPU in the trough where that is faster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..ir import ScheduleError
from ..sim.hostlink import OFFLOAD, OFFLOAD_W
from ..sim.iteration import iteration_times
from .offload import (ADAM_STATE_BYTES, HostCosts, RankShare, auto_fractions, device_step, memory_curve, static_step,
                      trough_step)

__all__ = ["MODES", "OptimizerOffload", "apply"]

MODES = ("static", "auto", "trough")


@dataclass(frozen=True)
class OptimizerOffload:
    """plan's optimizer-offload lever: ``mode`` (``MODES``) and the cost model's speeds."""

    mode: str
    costs: HostCosts = HostCosts()

    def check(self) -> None:
        if self.mode not in MODES:
            raise ScheduleError(f"optimizer offload is one of {', '.join(MODES)}, got {self.mode!r}")


def _busy(res, r: int):
    """(D2H, H2D) intervals of rank r's activation transfers in the simulation."""
    if res.offload is None:
        return [], []
    tl = res.offload.transfers[r]
    down = [(t.start, t.end) for t in tl if t.action.kind in (OFFLOAD, OFFLOAD_W)]
    up = [(t.start, t.end) for t in tl if t.action.kind not in (OFFLOAD, OFFLOAD_W)]
    return down, up


def apply(out: dict, built, spec, params: List[float], unit: float, budget: float, cost_optimizer: float,
          lever: OptimizerOffload) -> dict:
    """Update row ``out`` (``core.plan.row``) in place for ``lever.mode`` and return it."""
    mode, costs = lever.mode, lever.costs
    sched, setting, res = built.schedule, built.setting, built.result
    p = len(params)
    per_param = ADAM_STATE_BYTES / (spec.data_parallel_size if spec.distributed_optimizer else 1)
    offloadable = [n * per_param for n in params]
    states = out["state_bytes"]
    fixed = [s - o for s, o in zip(states, offloadable)]
    act = out["activation_bytes"]
    base = [cost_optimizer + device_step(n, costs) for n in params]
    it0 = iteration_times(sched, setting, base)
    out["iteration_time_s"] = it0.iteration_time
    out["iteration_time_post_validated_s"] = it0.iteration_time_post_validated
    out["step_time_s"] = base
    if out["fits"]:
        return out
    fractions = auto_fractions(offloadable, fixed, act, budget)
    if mode == "static" and all(f is not None for f in fractions):
        fractions = [max(fractions)] * p
    info = {"mode": mode, "fractions": fractions, "peak_bytes_without": list(out["peak_bytes"]),
            "iteration_time_without_s": it0.iteration_time,
            "iteration_time_post_validated_without_s": it0.iteration_time_post_validated}
    out["optimizer_offload"] = info
    if any(f is None for f in fractions):
        info["error"] = "does not fit even with every optimizer state on the host"
        return out
    with_ = [f_ + (1 - f) * o + a for f_, f, o, a in zip(fixed, fractions, offloadable, act)]
    steps: List[float] = []
    ranks: List[Optional[dict]] = []
    for r in range(p):
        off, keep = fractions[r] * params[r], (1 - fractions[r]) * params[r]
        down, up = _busy(res, r)
        tl = res.timeline[r]
        end = tl[-1].end if tl else 0.0
        if mode == "trough" and off > 0:
            curve = memory_curve(tl, r, setting, unit)
            share = RankShare(r, off, keep, fixed[r] + (1 - fractions[r]) * offloadable[r], budget)
            rs = trough_step(share, curve, end, costs, (down, up))
            steps.append(cost_optimizer + rs.step_time)
            ranks.append(rs.to_dict())
        else:
            steps.append(cost_optimizer + static_step(off, keep, costs, end, down, up))
            ranks.append(None)
    it = iteration_times(sched, setting, steps)
    info.update(peak_bytes_with=with_, step_time_s=steps, ranks=ranks)
    out.update(peak_bytes=with_, fits=max(with_) <= budget, step_time_s=steps, iteration_time_s=it.iteration_time,
               iteration_time_post_validated_s=it.iteration_time_post_validated)
    shares = ",".join(f"{f:g}" for f in fractions)
    out["flags"] += " --optimizer-cpu-offload --use-precision-aware-optimizer --use-distributed-optimizer"
    if mode == "static":
        out["flags"] += f" --optimizer-offload-fraction {fractions[0]:g}"
    else:  # each rank its own share, visiting the troughs with 'trough' (docs/optimizer_offload.md)
        out["flags"] += f" --zero-bubble-optimizer-offload {'trough:' if mode == 'trough' else ''}{shares}"
    return out
