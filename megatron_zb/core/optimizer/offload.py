"""Optimizer states in host memory: Megatron's static split, per rank, and in the pipeline's troughs.
Pure Python, no torch (docs/optimizer_offload.md has the model with its figures).

Adam keeps 12 bytes per parameter that the GPU touches once per iteration (fp32 main parameter,
m, v; divided over the data-parallel ranks with the distributed optimizer), beside the 6 that
stay (bf16 parameter, fp32 main gradient). Three ways to hold the 12 bytes of a share ``f``:

* **static** (Megatron's ``--optimizer-cpu-offload --optimizer-offload-fraction f``, one ``f``
  for all ranks, ``HybridDeviceOptimizer``): the share lives on the host and is updated there.
  After the rank's last pass its gradients go down (D2H), the CPU updates them, the new
  parameters come back up (H2D), pipelined per subgroup; the rest is updated on the GPU meanwhile.
* **per rank** (``auto_fractions``, ``--zero-bubble-optimizer-offload auto``): each rank
  offloads just what its own memory needs: states + the schedule's activation peak over the
  budget. Ranks with room (1F1B's last rank, a V schedule's middle ranks) keep their states.
* **trough** (``trough_step``): the share lives on the host between steps; its subgroups come up
  (H2D) once the rank's activations have fallen enough at the end of the iteration, are updated
  on the GPU after the rank's last pass, and go back (D2H) while the next iteration's warm-up
  still holds little. A subgroup whose visit would cost more than updating it on the CPU (the
  link is busy, there is no room in the trough) is updated on the CPU instead, chosen one
  subgroup at a time by the earlier time its parameters are ready (the cost model: host link
  bandwidth, CPU and GPU update speed, the room left under the budget).

The host link is the one activation offload uses (``core.sim.hostlink``): one queue per direction
(PCIe is full duplex); the activation transfers a simulation placed keep their slots and the
optimizer's transfers take the free time between them. A rank's step time is from its last pass
to the moment all its parameters are updated on the GPU (and, for a trough subgroup still on the
GPU, until the next iteration's memory leaves it room); ``iteration.iteration_times`` takes one
step time per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..ir import ScheduleError

__all__ = ["ADAM_STATE_BYTES", "RESIDENT_BYTES", "HostCosts", "auto_fractions", "memory_curve",
           "SubgroupPlan", "RankShare", "RankStep", "trough_step", "static_step", "device_step"]

ADAM_STATE_BYTES = 12.0  # fp32 main parameter, exp_avg, exp_avg_sq
RESIDENT_BYTES = 6.0  # bf16 parameter, fp32 main gradient (stay on the GPU)


@dataclass(frozen=True)
class HostCosts:
    """The cost model's speeds. Defaults (an H100 node, each GPU with its share of the host):
    PCIe 5 x16 at 25 GB/s per direction as measured with pinned memory (not the 64 GB/s of the
    wire); a fused GPU Adam moving ``update_bytes`` per parameter at 2,000 GB/s of HBM; a CPU Adam
    at 25 GB/s (one GPU's share of a two-socket host's memory bandwidth, 8 GPUs per host)."""

    link_gbps: float = 25.0
    gpu_update_gbps: float = 2000.0
    cpu_update_gbps: float = 25.0
    update_bytes: float = 34.0  # Adam's traffic per parameter: main param, m, v read+written, grad read, bf16 param written
    grad_bytes: float = 4.0  # a CPU update's gradient copy down (fp32 main gradient)
    param_bytes: float = 2.0  # a CPU update's parameter copy up (bf16)
    state_bytes: float = ADAM_STATE_BYTES  # a trough visit moves this per parameter each way
    subgroups: int = 16  # a rank's offloaded share in this many equal subgroups

    def __post_init__(self):
        for k in ("link_gbps", "gpu_update_gbps", "cpu_update_gbps"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ScheduleError(f"{k} must be a positive number, got {v!r}")
        if not isinstance(self.subgroups, int) or self.subgroups < 1:
            raise ScheduleError(f"subgroups must be an integer >= 1, got {self.subgroups!r}")

    def link(self, nbytes: float) -> float:
        return nbytes / (self.link_gbps * 1e9)

    def gpu(self, params: float) -> float:
        return params * self.update_bytes / (self.gpu_update_gbps * 1e9)

    def cpu(self, params: float) -> float:
        return params * self.update_bytes / (self.cpu_update_gbps * 1e9)


def auto_fractions(states: Sequence[float], fixed: Sequence[float], activation: Sequence[float],
                   budget: float, step: float = 0.01) -> List[Optional[float]]:
    """Per rank, the least share of its offloadable optimizer state (``states`` bytes) that brings
    ``fixed + states + activation`` under ``budget`` (rounded up to ``step``); 0 where it fits, None
    where even offloading all of it does not."""
    out: List[Optional[float]] = []
    for s, f, a in zip(states, fixed, activation):
        over = f + s + a - budget
        if over <= 0:
            out.append(0.0)
        elif s <= 0 or over > s * (1 + 1e-12):
            out.append(None)
        else:
            out.append(min(1.0, math.ceil(over / s / step - 1e-9) * step))
    return out


def memory_curve(timeline, rank: int, setting, unit: float = 1.0) -> List[Tuple[float, float]]:
    """(time, activation bytes from then on) of one rank over one simulated iteration: a pass that
    allocates counts from its start, one that frees from its end (the conservative side).
    ``timeline``: the rank's ``Timed`` passes; ``unit``: bytes per unit of the setting's memory."""
    events = []
    for t in timeline:
        a = t.action
        d = setting.pass_mem(a.kind, rank, a.stage, a.mb) * unit
        events.append((t.start if d > 0 else t.end, d))
    events.sort(key=lambda e: (e[0], e[1]))  # at one instant, what ends frees before what starts
    cur, out = 0.0, [(0.0, 0.0)]
    for when, d in events:
        cur += d
        out.append((when, max(0.0, cur)))
    return out


def _at(curve: List[Tuple[float, float]], t: float) -> float:
    """The curve's value at ``t`` (the last breakpoint at or before it)."""
    v = 0.0
    for when, x in curve:
        if when <= t + 1e-15:
            v = x
        else:
            break
    return v


@dataclass
class SubgroupPlan:
    params: float
    where: str  # 'gpu' (visits the trough) | 'cpu'
    up: Tuple[float, float]  # H2D of its state ('gpu') or of its parameters after the update ('cpu')
    update: Tuple[float, float]
    down: Tuple[float, float]  # D2H of its state after the update ('gpu') or of its gradient before it ('cpu')
    ready: float  # its parameters updated on the GPU


@dataclass
class RankStep:
    rank: int
    offloaded_params: float
    resident_params: float
    end: float  # the rank's last pass
    step_time: float  # from ``end`` to every parameter ready (and the trough left as the next iteration needs)
    subgroups: List[SubgroupPlan] = field(default_factory=list)
    visiting_peak_bytes: float = 0.0  # most optimizer state on the GPU at once beyond the resident
    on_gpu: int = 0
    on_cpu: int = 0

    def to_dict(self) -> dict:
        return {"rank": self.rank, "step_time_s": round(self.step_time, 9), "on_gpu": self.on_gpu,
                "on_cpu": self.on_cpu, "visiting_peak_bytes": self.visiting_peak_bytes,
                "offloaded_params": self.offloaded_params}


@dataclass(frozen=True)
class RankShare:
    """One rank as its optimizer step sees it: ``offloaded`` parameters (their states on the host
    between steps) and ``resident`` ones (their states on the GPU); ``resident_bytes``: what stays on
    the GPU throughout (parameters, gradients, the states not offloaded); ``budget``: the GPU's bytes
    (``math.inf``: no limit)."""

    rank: int
    offloaded: float
    resident: float
    resident_bytes: float
    budget: float


class _Lane:
    """One direction of a rank's host link: busy intervals (activation transfers first), the
    optimizer's copies placed first-fit in the gaps after their ready time."""

    def __init__(self, busy: Sequence[Tuple[float, float]] = ()):
        self.busy = sorted((s, e) for s, e in busy if e > s)

    def place(self, ready: float, dur: float) -> Tuple[float, float]:
        t = ready
        for s, e in self.busy:
            if e <= t:
                continue
            if s >= t + dur:
                break
            t = max(t, e)
        self.busy.append((t, t + dur))
        self.busy.sort()
        return t, t + dur


def device_step(params: float, costs: HostCosts) -> float:
    """Every state on the GPU: the fused update of ``params``."""
    return costs.gpu(params)


def static_step(offloaded: float, resident: float, costs: HostCosts, end: float = 0.0,
                busy_down: Sequence[Tuple[float, float]] = (), busy_up: Sequence[Tuple[float, float]] = ()) -> float:
    """Megatron's static offload: the resident part on the GPU while the offloaded share goes
    gradient down, CPU update, parameters up, pipelined over ``costs.subgroups``. Step time."""
    down, up = _Lane(busy_down), _Lane(busy_up)
    gpu_done = end + costs.gpu(resident)
    cpu_free, ready = end, end
    n = costs.subgroups if offloaded > 0 else 0
    for _ in range(n):
        g = offloaded / n
        _, d_end = down.place(end, costs.link(g * costs.grad_bytes))
        c0 = max(d_end, cpu_free)
        cpu_free = c0 + costs.cpu(g)
        _, u_end = up.place(cpu_free, costs.link(g * costs.param_bytes))
        ready = max(ready, u_end)
    return max(gpu_done, ready) - end


def trough_step(share: RankShare, curve: List[Tuple[float, float]], end: float, costs: HostCosts,
                busy: Tuple[Sequence[Tuple[float, float]], Sequence[Tuple[float, float]]] = ((), ())) -> RankStep:
    """Plan one rank's step with its offloaded share (``share.offloaded`` parameters) visiting the trough.

    ``curve``: the rank's activation bytes over one iteration (``memory_curve``), ``end`` its last
    pass; the next iteration repeats the curve from when this rank's step is done. ``busy``: the
    link's activation transfers (start, end), (D2H, H2D)."""
    rank, offloaded, resident = share.rank, share.offloaded, share.resident
    resident_bytes, budget = share.resident_bytes, share.budget
    down, up = _Lane(busy[0]), _Lane(busy[1])
    n = costs.subgroups if offloaded > 0 else 0
    g = offloaded / n if n else 0.0
    sb = g * costs.state_bytes
    visits: List[Tuple[float, float]] = []  # (on the GPU from, until) of each subgroup state visiting
    gpu_free = end + costs.gpu(resident)
    cpu_free = end
    plans: List[SubgroupPlan] = []
    # when the trough can take k visiting subgroups: from the last time before ``end`` the
    # activations leave less room than that (the curve falls towards the end of the iteration)
    room_at = [(t, budget - resident_bytes - x) for t, x in curve if t <= end] + [(end, budget - resident_bytes)]

    def earliest(k_bytes: float) -> Optional[float]:
        t0 = None
        for t, room in reversed(room_at):
            if room + 1e-6 >= k_bytes:
                t0 = t
            else:
                break
        return t0
    for _ in range(n):
        # GPU: up once the trough holds it, update after the rank's last pass, back down after
        on_gpu = sum(1 for a, b in visits if b > end) + 1
        t_room = earliest(on_gpu * sb)
        gpu_plan = None
        if t_room is not None:
            u = up.place(t_room, costs.link(sb))
            up.busy.remove(u)  # tentative
            u0 = max(u[1], gpu_free)
            upd = (u0, u0 + costs.gpu(g))
            gpu_plan = (u, upd)
        # CPU: gradient down, update on the host, parameters up
        d = down.place(end, costs.link(g * costs.grad_bytes))
        down.busy.remove(d)
        c0 = max(d[1], cpu_free)
        cu = (c0, c0 + costs.cpu(g))
        cpu_ready_guess = cu[1] + costs.link(g * costs.param_bytes)
        if gpu_plan is not None and gpu_plan[1][1] <= cpu_ready_guess:
            u = up.place(gpu_plan[0][0], costs.link(sb))
            upd = (max(u[1], gpu_free), max(u[1], gpu_free) + costs.gpu(g))
            gpu_free = upd[1]
            w = down.place(upd[1], costs.link(sb))
            visits.append((u[0], w[1]))
            plans.append(SubgroupPlan(g, "gpu", u, upd, w, upd[1]))
        else:
            d = down.place(end, costs.link(g * costs.grad_bytes))
            c0 = max(d[1], cpu_free)
            cu = (c0, c0 + costs.cpu(g))
            cpu_free = cu[1]
            u = up.place(cu[1], costs.link(g * costs.param_bytes))
            plans.append(SubgroupPlan(g, "cpu", u, cu, d, u[1]))
    ready = max([gpu_free] + [p.ready for p in plans])
    # the next iteration starts at ``ready``; a state still on the GPU must leave it the room its
    # activations take then: the start waits until every write-back fits
    start = ready
    for _ in range(4 * n + 1):
        late = 0.0
        for t, x in curve:
            tau = start + t
            covering = [y for a, y in visits if a <= tau < y]
            if covering and x + len(covering) * sb + resident_bytes > budget + 1e-6:
                late = max(late, max(covering) - tau)
        if late <= 1e-15:
            break
        start += late
    peak = 0.0
    for a, b in visits:
        peak = max(peak, sum(sb for x, y in visits if x <= a < y))
    return RankStep(rank, offloaded, resident, end, start - end, plans, peak,
                    sum(1 for p in plans if p.where == "gpu"), sum(1 for p in plans if p.where == "cpu"))
