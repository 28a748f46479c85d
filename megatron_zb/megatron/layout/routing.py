"""Where microbatches and their losses go when the model is not laid out as Megatron assumes:
replicated stages (each chunk reads only its path's microbatches; the loss stages of all paths
hand their loss dicts to one rank) and V placements (the loss stage is on pipeline rank 0 while
Megatron's training loop reduces and logs losses on the last pipeline rank). Shared by the
forward-backward function and the entry points; also the device moves the hand-offs need.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ...core.ir import Placement
from ..errors import ZeroBubbleConfigError

__all__ = ["RoutedIterator", "check_replicas_equal", "hand_over", "merge_losses", "to_cpu", "to_device", "LossesToLastRank",
           "route_losses_to_last_rank"]


class RoutedIterator:
    """A chunk's data iterator where the chunk sees only some microbatches (replicated stages):
    reading microbatch ``target`` skips the items of the microbatches routed to other replicas,
    and ``drain(m)`` skips the rest of the iteration's m items, so every chunk that reads data
    consumes exactly m items per call, as Megatron expects. A chunk that never reads (a middle
    stage whose ``forward_step_func`` ignores the iterator) consumes nothing."""

    def __init__(self, it):
        self.it = it
        self.pos = 0  # items consumed in this call
        self.target = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.it is None:
            raise StopIteration
        while self.pos < self.target:
            next(self.it)
            self.pos += 1
        self.pos += 1
        return next(self.it)

    def drain(self, m: int) -> None:
        if self.it is None or self.pos == 0:
            return
        while self.pos < m:
            next(self.it)
            self.pos += 1


def check_replicas_equal(models, stages, pl: Placement, groups) -> None:
    """Replicas must start identical (a fingerprint of each chunk's weights, compared once)."""
    for c in sorted(range(len(models)), key=lambda c: pl.logical(stages[c])):
        group = groups.group(pl.logical(stages[c]))
        if group is None:
            continue
        with torch.no_grad():
            acc = torch.zeros(2, dtype=torch.float64)
            for i, prm in enumerate(models[c].parameters()):
                x = prm.detach().double().reshape(-1).cpu()
                acc[0] += x.sum()
                acc[1] += (x * torch.arange(1, x.numel() + 1, dtype=torch.float64)).sum() * (i + 1)
        if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
            acc = acc.cuda()
        lo, hi = acc.clone(), acc.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            raise ZeroBubbleConfigError(
                f"the replicas of logical stage {pl.logical(stages[c])} (global ranks "
                f"{dist.get_process_group_ranks(group)}) start with different weights; build them identically "
                "(megatron_zb.megatron.layout.placement.deterministic_init_, --zero-bubble-deterministic-init) or copy "
                "one replica into the other before creating the optimizer")


def hand_over(obj, src: int, dst: int, me: int, pp_group):
    """Move a small picklable object (loss dicts: a few scalars per microbatch) from pipeline rank
    ``src`` to ``dst`` over ``pp_group``; returns it on ``dst`` (on its device), None elsewhere."""
    ranks = dist.get_process_group_ranks(pp_group)
    # the size and bytes travel as tensors: on the GPU for NCCL, in host memory for gloo (which would
    # read a CUDA pointer as a host address: "writev ... Bad address")
    nccl = torch.cuda.is_available() and dist.get_backend(pp_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if me == src:
        dist.send_object_list([to_cpu(obj)], dst=ranks[dst], group=pp_group, device=device)
    elif me == dst:
        box = [None]
        dist.recv_object_list(box, src=ranks[src], group=pp_group, device=device)
        return to_device(box[0])
    return None


def merge_losses(store, mb_of_entry, pl: Placement, me: int, pp_group):
    """Replicated stages: every path's loss stage holds its own microbatches' loss dicts; hand them
    to ``pl.loss_rank`` and return them there in microbatch order (elsewhere: [])."""
    dst = pl.loss_rank
    holders = sorted({pl.rank_of(pl.path(k)[-1]) for k in range(pl.num_paths)} - {dst})
    if me not in holders and me != dst:
        return store
    if me != dst:
        hand_over(list(zip(mb_of_entry, store)), me, dst, me, pp_group)
        return []
    tagged = list(zip(mb_of_entry, store))
    for src in holders:
        tagged += hand_over(None, src, dst, me, pp_group)
    tagged.sort(key=lambda x: x[0])
    return [e for _, e in tagged]


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def to_device(obj):
    if not torch.cuda.is_available():
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: to_device(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v) for v in obj)
    return obj


class LossesToLastRank:
    """Wraps the forward-backward function: with V placement the loss stage is on pipeline rank 0,
    while Megatron's ``train_step``/``evaluate`` reduce and log the losses on the last pipeline
    rank. The loss dicts (a few scalars per microbatch) are sent there after each call."""

    def __init__(self, fb, loss_rank: int):
        self.fb = fb
        self.loss_rank = loss_rank

    def __getattr__(self, name):
        return getattr(self.fb, name)

    def __call__(self, *args, **kwargs):
        from megatron.core import parallel_state as ps

        out = self.fb(*args, **kwargs)
        pg = kwargs.get("pg_collection")
        group = getattr(pg, "pp", None) or ps.get_pipeline_model_parallel_group()
        p, me = group.size(), group.rank()
        dst = p - 1
        if p == 1 or self.loss_rank == dst or me not in (self.loss_rank, dst):
            return out
        got = hand_over(out, self.loss_rank, dst, me, group)
        return [] if me == self.loss_rank else got


def route_losses_to_last_rank(loss_rank: int) -> Callable[[], None]:
    """Make megatron.training's ``get_forward_backward_func`` return the loss-forwarding wrapper."""
    import megatron.training.training as T
    inner = T.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        fb = inner(*args, **kwargs)
        if fb is None or isinstance(fb, LossesToLastRank) or not hasattr(fb, "schedule_for"):
            return fb  # Megatron's own function (PP=1)
        return LossesToLastRank(fb, loss_rank)
    get_forward_backward_func.__wrapped__ = inner
    T.get_forward_backward_func = get_forward_backward_func

    def undo():
        if T.get_forward_backward_func is get_forward_backward_func:
            T.get_forward_backward_func = inner
    return undo
