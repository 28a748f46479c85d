"""The trough plan of one rank in the rank's own order: what the runtime executes (pure Python).

``core.optimizer.offload.trough_step`` plans a rank's step in seconds: for each subgroup of its
host-resident optimizer states, whether it visits the GPU (H2D, update, D2H) or is updated on the
CPU, and when each copy runs. The runtime does not run on a clock; it runs the rank's list of
passes. ``rank_trough_plan`` turns the seconds into points of that list:

* **prefetch after** a pass: a visiting subgroup's H2D starts once the pass that the plan's copy
  start follows has ended (the last pass ending at or before it; None: when the iteration starts,
  right before its first pass, after the releases there);
* **release before** a pass of the next iteration: its write-back (D2H, issued right after its
  update) must be complete and its GPU copy freed before the first pass that starts at or after
  the plan's write-back end (measured from the next iteration's start); None: it may stay on the
  GPU (the plan found room for it throughout).

A point names a pass by ``(kind, stage, mb)``, unique within one iteration of one rank.
``split_evenly`` cuts a rank's offloaded tensors (in order) into the plan's subgroups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import ScheduleError
from .offload import HostCosts, RankShare, RankStep, memory_curve, trough_step

__all__ = ["PassKey", "TroughPlan", "rank_trough_plan", "split_evenly"]

PassKey = Tuple[str, Optional[int], Optional[int]]  # (kind, stage, mb) of a pass of the rank, as its Action has them


@dataclass(frozen=True)
class TroughPlan:
    rank: int
    subgroups: int
    on_gpu: Tuple[int, ...]  # the subgroups that visit the GPU (the others: updated on the CPU)
    prefetch_after: Dict[int, Optional[PassKey]]  # visiting subgroup -> pass after which its H2D starts
    release_before: Dict[int, Optional[PassKey]]  # visiting subgroup -> pass (next iteration) its D2H precedes
    step: RankStep  # the cost model's plan, in seconds
    first: Optional[PassKey] = None  # the rank's first pass (a prefetch "at the start" runs right before it)

    def describe(self) -> str:
        def name(k):
            return "start" if k is None else f"{k[0]}{'' if k[1] is None else k[1]}.{'' if k[2] is None else k[2]}"
        pre = sorted({name(self.prefetch_after[k]) for k in self.on_gpu})
        rel = sorted({"-" if self.release_before[k] is None else name(self.release_before[k]) for k in self.on_gpu})
        return (f"rank {self.rank}: {len(self.on_gpu)} of {self.subgroups} subgroup(s) visit the GPU "
                f"(prefetch after {', '.join(pre) or '-'}; released before {', '.join(rel) or '-'}), "
                f"{self.subgroups - len(self.on_gpu)} updated on the CPU; modelled step {self.step.step_time * 1e3:.3g} ms")


def split_evenly(sizes: Sequence[int], n: int) -> List[List[int]]:
    """Cut the indices of ``sizes`` (in order) into at most ``n`` contiguous non-empty groups of
    about equal total size (each group ends once it reaches its share of the total)."""
    if not isinstance(n, int) or n < 1:
        raise ScheduleError(f"subgroups must be an integer >= 1, got {n!r}")
    total = float(sum(sizes))
    groups: List[List[int]] = []
    cur: List[int] = []
    acc = 0.0
    for i, s in enumerate(sizes):
        cur.append(i)
        acc += s
        if acc >= total * (len(groups) + 1) / n - 1e-9 and len(groups) < n - 1 and i < len(sizes) - 1:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


def rank_trough_plan(timeline, setting, share: RankShare, unit_bytes: float, unit_s: float, costs: HostCosts,
                     busy: Tuple[Sequence, Sequence] = ((), ())) -> TroughPlan:
    """The trough plan of rank ``share.rank`` in its pass order (``share``: its parameters, what
    stays on the GPU and the GPU's bytes, ``RankShare``).

    ``timeline``: the rank's simulated passes (``Timed``, in the setting's time units),
    ``unit_s`` seconds per time unit; ``unit_bytes`` bytes per unit of the setting's memory;
    ``busy``: the host link's activation transfers (D2H, H2D) in time units."""
    rank = share.rank
    if not (unit_s > 0):
        raise ScheduleError(f"unit_s must be positive, got {unit_s!r}")
    tl = sorted(timeline, key=lambda t: (t.start, t.end))
    end = tl[-1].end * unit_s if tl else 0.0
    curve = [(t * unit_s, x) for t, x in memory_curve(tl, rank, setting, unit_bytes)]
    down, up = ([(a * unit_s, b * unit_s) for a, b in lane] for lane in busy)
    step = trough_step(share, curve, end, costs, (down, up))
    on_gpu = tuple(k for k, sg in enumerate(step.subgroups) if sg.where == "gpu")
    pre: Dict[int, Optional[PassKey]] = {}
    rel: Dict[int, Optional[PassKey]] = {}
    start_next = end + step.step_time
    eps = 1e-12
    for k in on_gpu:
        sg = step.subgroups[k]
        after = [t for t in tl if t.end * unit_s <= sg.up[0] + eps]
        pre[k] = _key(after[-1]) if after else None
        t_rel = sg.down[1] - start_next  # the write-back's end, in the next iteration's time
        before = [t for t in tl if t.start * unit_s >= t_rel - eps]
        rel[k] = _key(before[0]) if before else None
    return TroughPlan(rank, len(step.subgroups), on_gpu, pre, rel, step, _key(tl[0]) if tl else None)


def _key(t) -> PassKey:
    a = t.action
    return (a.kind, a.stage, a.mb)
