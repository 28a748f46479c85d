"""``--zero-bubble-optimizer-offload trough``: Megatron's host-resident optimizer states visiting
the GPU in the pipeline's troughs (docs/optimizer_offload.md, section 3).

Megatron's ``--optimizer-cpu-offload --optimizer-offload-fraction F`` keeps the first ``F`` of each
rank's optimizer parameters on the host (``HybridDeviceOptimizer``: a host copy of each, its Adam
state there, one CPU optimizer per parameter with ``overlap_cpu_optimizer_d2h_h2d``, which this
mode turns on). Here those CPU optimizers are cut into the core's subgroups
(``core.optimizer.trough.split_evenly``), and the core's trough plan for this rank
(``rank_trough_plan``: the rank's simulated passes, its memory, the host link, the update speeds)
says which visit the GPU:

* a visiting subgroup's host copy and state are prefetched (``runtime.features.optim_trough``) at the
  plan's point in the rank's pass order (once its activations have fallen, after its last W),
  updated on the GPU by the same torch optimizer the CPU would run (its gradient taken on the GPU,
  no copy down; the updated parameter copied to the model's parameter by Megatron's own hook), and
  written back right after; the write-back is released at the plan's point in the next
  iteration's warm-up;
* the others are updated on the CPU by ``HybridDeviceOptimizer`` as before.

Exact: the visiting update is the same elementwise optimizer on the same values (on a CPU-only
torch, where host and device are one memory, the run is bit-identical to Megatron's static
offload; on a GPU the CPU's and the GPU's torch AdamW may differ in the last bits). With optimizer
post-validation the write-back is staged (``TroughStates.staged``): the host copy from before the
step stays until the step is validated; a rollback points the tensors at it again
(``features.optimizer`` commits and rolls back, and does not save what this module restores).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...core.ir import OFFLOAD, OFFLOAD_W
from ...core.optimizer.offload import ADAM_STATE_BYTES, RESIDENT_BYTES, HostCosts, RankShare, memory_curve
from ...core.optimizer.trough import TroughPlan, rank_trough_plan, split_evenly
from ...runtime.features.optim_trough import TroughHook, TroughStates

__all__ = ["TroughOptimizer", "TroughOffload", "use_trough"]


def _param(o) -> torch.Tensor:
    return o.param_groups[0]["params"][0]


class TroughOptimizer:
    """One ``HybridDeviceOptimizer`` whose offloaded parameters may visit the GPU (``on_gpu``:
    the subgroups that do, set from the plan; empty: Megatron's static offload)."""

    def __init__(self, hdo, subgroups: int):
        self._hdo = weakref.ref(hdo)  # the optimizer holds this object, not the other way round
        self.subgroups = subgroups
        self.on_gpu: set = set()
        self.plan: Optional[TroughPlan] = None
        self.states = TroughStates()
        self._index()
        hdo.step = self.step
        hdo.mzb_trough = self
        for name in ("state_dict", "load_state_dict"):
            setattr(hdo, name, self._settled(getattr(hdo, name), reindex=name == "load_state_dict"))

    @property
    def hdo(self):
        return self._hdo()

    def _index(self) -> None:
        opts = list(self.hdo.cpu_optimizers)
        self.groups: List[List] = [[opts[i] for i in g]
                                   for g in split_evenly([_param(o).numel() for o in opts], self.subgroups)] if opts else []

    def _settled(self, fn, reindex: bool):
        def call(*a, **k):
            self.states.settle()
            out = fn(*a, **k)
            if reindex:  # Megatron rebuilds its sub-optimizers and host copies after a load
                self.states = TroughStates(staged=self.states.staged)
                self._index()
            return out
        return call

    def numel(self) -> Tuple[int, int]:
        """(elements whose state lives on the host, elements whose state stays on the GPU)."""
        off = sum(_param(o).numel() for g in self.groups for o in g)
        total = sum(p.numel() for g in self.hdo.param_groups for p in g["params"])
        return off, total - off

    def tensors_of(self, k: int) -> List[torch.Tensor]:
        """Subgroup ``k``'s host copies and every tensor of their optimizer state."""
        out, seen = [], set()
        for o in self.groups[k]:
            p = _param(o)
            for t in [p] + [v for v in o.state.get(p, {}).values() if torch.is_tensor(v)]:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def managed(self) -> set:
        """ids of what the trough moves and restores itself (post-validation saves the rest)."""
        ids = set(self.states.managed())
        for k in self.on_gpu:
            ids.update(id(t) for t in self.tensors_of(k))
        return ids

    @torch.no_grad()
    def step(self, closure=None):
        hdo = self.hdo
        hdo._sync_hdo_param_groups_to_sub_optimizers()
        for k in sorted(self.on_gpu):  # first: the GPU works while the CPU updates the others
            self.states.visit(k, self.tensors_of(k))
            for o in self.groups[k]:
                p = _param(o)
                gp = hdo.cpu_copys_map_gpu_param[p]
                g = getattr(gp, "decoupled_grad", gp.grad)
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype, copy=True)
                o.step(closure)  # Megatron's post-step hook copies p to the model's parameter
                p.grad = None
            self.states.write_back(k, self.tensors_of(k))
        every = hdo.cpu_optimizers
        hdo.cpu_optimizers = [o for k, g in enumerate(self.groups) if k not in self.on_gpu for o in g]
        try:
            type(hdo).step(hdo, closure)  # the GPU part and the CPU subgroups, Megatron's way
        finally:
            hdo.cpu_optimizers = every
        hdo._sync_sub_optimizers_state_to_hdo()


class TroughOffload:
    """The feature in one process: every ``HybridDeviceOptimizer`` built while it is on becomes a
    ``TroughOptimizer``; ``hook(built, me)`` plans this rank's subgroups (once per schedule) and
    gives the executor hook that prefetches and releases them.

    The plan's inputs: ``budget_bytes`` the GPU's memory (``math.inf``: no limit), or ``room``: the
    share of the offloaded states the trough holds (budget = what stays + that share: the CPU
    tests' way to get both kinds of subgroups); ``unit_bytes`` bytes of one unit of the schedule's
    activation memory (``"room"``: the rank's activation peak fills three quarters of the room, so
    the trough opens as the activations fall: the CPU tests' way to get prefetches at the start and
    in the cooldown, releases in the warm-up); ``unit_s`` seconds of one unit of its time; ``costs`` the host link and
    update speeds."""

    def __init__(self, *, budget_bytes: float = math.inf, room: Optional[float] = None, unit_bytes=0.0,
                 unit_s: float = 1e-3, costs: Optional[HostCosts] = None,
                 log: Optional[Callable[[str], None]] = None):
        self.budget_bytes, self.room, self.unit_bytes, self.unit_s = budget_bytes, room, unit_bytes, unit_s
        self.costs = costs if costs is not None else HostCosts()
        self.log = log
        self._made: List[weakref.ref] = []  # the TroughOptimizers made (of live optimizers: ``optimizers``)
        self._planned: Dict[int, list] = {}
        self._undo: Optional[Callable[[], None]] = None

    def patch(self) -> "TroughOffload":
        from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H
        cls = H.HybridDeviceOptimizer
        init = cls.__init__
        feature = self

        def trough_init(hdo, *a, **k):
            k["overlap_cpu_optimizer_d2h_h2d"] = True  # one CPU optimizer per parameter: the subgroups' parts
            init(hdo, *a, **k)
            feature._made.append(weakref.ref(TroughOptimizer(hdo, feature.costs.subgroups)))
        trough_init.__wrapped__ = init
        cls.__init__ = trough_init

        def undo():
            if cls.__init__ is trough_init:
                cls.__init__ = init
        self._undo = undo
        return self

    @property
    def optimizers(self) -> List[TroughOptimizer]:
        """Those of the optimizers still in use (Megatron's distributed optimizer builds its
        ``HybridDeviceOptimizer`` twice and drops the first)."""
        return [t for t in (r() for r in self._made) if t is not None and t.hdo is not None]

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
        for opt in self.optimizers:
            opt.states.settle()

    def hook(self, built, me: int) -> Optional[TroughHook]:
        key = id(built)
        if key not in self._planned:
            gc.collect()  # a dropped optimizer (a cycle through its hooks) is gone before the plan
        if not self.optimizers:
            return None
        if key not in self._planned:
            self._planned = {key: [self._plan(built, me, opt) for opt in self.optimizers]}
        points = [(opt.states, opt.tensors_of, plan.prefetch_after, plan.release_before, plan.first)
                  for opt, plan in zip(self.optimizers, self._planned[key])]
        return TroughHook(points)

    def _plan(self, built, me: int, opt: TroughOptimizer) -> TroughPlan:
        res = built.result
        off, keep = opt.numel()
        fixed = (off + keep) * RESIDENT_BYTES + keep * ADAM_STATE_BYTES
        budget = self.budget_bytes if self.room is None else fixed + self.room * off * ADAM_STATE_BYTES
        busy = ((), ())
        if res.offload is not None:  # the host link's activation copies keep their slots
            tl = res.offload.transfers[me]
            busy = tuple([(t.start, t.end) for t in tl if (t.action.kind in (OFFLOAD, OFFLOAD_W)) == down]
                         for down in (True, False))
        unit = self.unit_bytes
        if unit == "room":
            peak = max((x for _, x in memory_curve(res.timeline[me], me, built.setting)), default=0.0)
            unit = 0.75 * (budget - fixed) / peak if peak > 0 and math.isfinite(budget) else 0.0
        plan = rank_trough_plan(res.timeline[me], built.setting, RankShare(me, off, keep, fixed, budget), unit,
                                self.unit_s, dataclasses.replace(self.costs, subgroups=max(1, len(opt.groups))), busy)
        opt.on_gpu, opt.plan = set(plan.on_gpu) if off else set(), plan
        if self.log is not None:
            self.log(f"megatron-zb: optimizer states in the troughs, pipeline {plan.describe()}")
        return plan


def use_trough(forward_backward, **kw) -> TroughOffload:
    """Turn trough offload on for the optimizers built from now on and attach its hook to
    ``forward_backward`` (a ``ZeroBubbleForwardBackward``). ``kw``: ``TroughOffload``'s."""
    feature = TroughOffload(**kw).patch()
    forward_backward.attach(feature.hook)
    return feature
