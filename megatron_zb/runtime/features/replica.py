"""Gradient synchronisation between the replicas of a stage (replicated placements, e.g. BitPipe).

With replicated stages a logical stage lives on several pipeline ranks (one copy per path) and
each copy sees only the microbatches of its path; their weight gradients must be summed before
the optimizer step so that the copies stay identical. ``ReplicaGroups`` creates one process group
per logical stage and pipeline (its members: the global ranks holding the copies), so the
all-reduces of different stages never wait on each other whatever order the ranks finish their
stages in. ``ReplicaGradSync`` starts a stage's all-reduce (asynchronous, SUM) as soon as the
stage's last backward pass is done and ``finish()`` waits for all of them and writes the sums back;
the caller runs it before data-parallel reduction (both are sums and commute, but reducing the same
buffer twice at once would race).

Torch only; knows nothing of Megatron (the caller passes the gradient tensors).
"""
from __future__ import annotations

import datetime
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class ReplicaGroups:
    """One process group per (logical stage, pipeline) holding two or more replicas.

    ``pp_ranks[i]`` is the global rank of pipeline rank i in this rank's pipeline group;
    ``members`` maps a logical stage to the pipeline ranks holding its copies. Creating them is a
    collective over the whole world (every rank must call it): the ranks gather every pipeline's
    groups, then all create the same groups in the same order.
    """

    def __init__(self, pp_ranks: Sequence[int], members: Dict[int, Sequence[int]],
                 backend: Optional[str] = None):
        self.pp_ranks = list(pp_ranks)
        self.groups: Dict[int, dist.ProcessGroup] = {}
        mine = sorted((int(l), tuple(sorted(self.pp_ranks[r] for r in set(rs))))
                      for l, rs in members.items() if len(set(rs)) > 1)
        everyone: List = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        me = dist.get_rank()
        for l, ranks in sorted({(l, tuple(g)) for lst in everyone for l, g in lst}):
            group = dist.new_group(list(ranks), backend=backend)
            if me in ranks:
                self.groups[l] = group

    def group(self, logical: int) -> Optional[dist.ProcessGroup]:
        return self.groups.get(logical)

    def alive(self) -> bool:
        from ..p2p import registered_groups
        live = set(map(id, registered_groups()))
        return all(id(g) in live for g in self.groups.values())


def grads_of(params: Iterable[torch.nn.Parameter],
             grad: Callable[[torch.nn.Parameter], Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """The gradient tensor of each parameter (created as zeros where a parameter got none, so both
    replicas sum tensors of the same layout)."""
    out = []
    for p in params:
        g = grad(p)
        if g is None:
            p.grad = torch.zeros_like(p)
            g = p.grad
        out.append(g)
    return out


class ReplicaGradSync:
    """Asynchronous SUM all-reduce of each replicated stage's gradients within one iteration."""

    def __init__(self, groups: ReplicaGroups, timeout_s: Optional[float] = 300.0):
        self.groups = groups
        self.timeout_s = timeout_s
        self._work: List[Tuple[int, object, torch.Tensor, List[torch.Tensor]]] = []
        self.started: List[int] = []  # logical stages, in the order their sync started

    def start(self, logical: int, grads: Sequence[torch.Tensor]) -> bool:
        """Start summing ``grads`` with the other replicas of ``logical``; False if it has none here."""
        group = self.groups.group(logical)
        if group is None or not grads:
            return False
        flat = torch.cat([g.detach().reshape(-1).to(grads[0].dtype) for g in grads])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._work.append((logical, work, flat, list(grads)))
        self.started.append(logical)
        return True

    def finish(self) -> None:
        """Wait for every started all-reduce and write the sums into the gradient tensors."""
        work, self._work = self._work, []
        for logical, w, flat, grads in work:
            self._wait(w, logical)
            off = 0
            with torch.no_grad():
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[off:off + n].view_as(g))
                    off += n

    def _wait(self, w, logical: int) -> None:
        if self.timeout_s is None:
            w.wait()
            return
        try:
            w.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "imeout" not in str(e) and "imed out" not in str(e):
                raise
            from ..p2p import PipelineTimeout
            raise PipelineTimeout(f"global rank {dist.get_rank()} waited {self.timeout_s:.0f}s for the gradient "
                                  f"all-reduce of logical stage {logical} with its replica; that rank is stuck "
                                  "or has failed") from None
