"""Gradient and parameter synchronisation of Megatron's DDP around our schedules, as one executor
hook (``runtime.hooks``), so their order lives in one place.

Megatron's 1F1B keeps every chunk's data-parallel gradient reduction off (``config.no_sync_func``)
until the chunk's last backward, and starts it (``config.grad_sync_func``, or the DDP hooks once
``no_sync`` is left) right after; the distributed optimizer's parameter all-gather of a later
chunk (``config.param_sync_func``) is launched before that chunk's first forward. With
replicated stages (BitPipe) the copies of a stage first sum their gradients
(``runtime.features.replica.ReplicaGradSync``, started after the stage's last backward pass); the
data-parallel reduction of such a chunk starts only after that sum (``finish``).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

from ...core.ir import F, Placement
from ...runtime.hooks import Hook
from ...runtime.features.replica import ReplicaGradSync, grads_of
from ..errors import ZeroBubbleConfigError
from .finalize import grad_of

__all__ = ["GradSync"]


def _per_chunk(fn, n):
    if fn is None:
        return [None] * n
    if isinstance(fn, (list, tuple)):
        if len(fn) != n:
            raise ZeroBubbleConfigError(f"config has {len(fn)} per-chunk sync functions for {n} model chunks")
        return list(fn)
    return [fn] * n


class GradSync(Hook):
    """One rank's gradient/parameter sync for one attempt at an iteration. ``chunk_of`` maps a
    global stage to the index of its model chunk on this rank; ``replicas``: the replica sum of
    a replicated placement (None otherwise)."""

    def __init__(self, config, models, chunk_of: Dict[int, int], placement: Placement,
                 replicas: Optional[ReplicaGradSync] = None):
        self.models, self.chunk_of, self.placement, self.replicas = models, chunk_of, placement, replicas
        n = len(models)
        self.no_sync = _per_chunk(config.no_sync_func, n)
        self.grad_sync = _per_chunk(config.grad_sync_func, n)
        self.param_sync = _per_chunk(config.param_sync_func, n)
        self.sync_off: Dict[int, contextlib.ExitStack] = {}
        self.forwarded = set()  # chunks whose first forward ran
        self.deferred: List[int] = []  # chunks whose DP reduction waits for their replica sum
        for c, fn in enumerate(self.no_sync):
            if fn is not None:
                stack = contextlib.ExitStack()
                stack.enter_context(fn())
                self.sync_off[c] = stack

    def compute(self, a, inputs):
        if a.kind == F:
            c = self.chunk_of[a.stage]
            if c not in self.forwarded:
                self.forwarded.add(c)
                if self.param_sync[c] is not None and c > 0:
                    self.param_sync[c](self.models[c].parameters())
        return None

    def before_last_backward(self, stage: int) -> None:  # the chunk's DDP hooks may reduce now
        c = self.chunk_of[stage]
        if self.grad_sync[c] is None and c in self.sync_off:
            self.sync_off.pop(c).close()

    def after_last_backward(self, stage: int) -> None:
        c = self.chunk_of[stage]
        params = self.models[c].parameters()
        if self.replicas is not None and self.replicas.start(self.placement.logical(stage), grads_of(params, grad_of)):
            if self.grad_sync[c] is not None:  # replica sum first; the DP reduction after it
                if c in self.sync_off:
                    self.sync_off.pop(c).close()
                self.deferred.append(c)
            return
        if self.grad_sync[c] is not None:
            if c in self.sync_off:
                self.sync_off.pop(c).close()
            self.grad_sync[c](self.models[c].parameters())

    def finish_replicas(self) -> None:
        """Wait for the replica sums, then start the data-parallel reductions that waited for them."""
        if self.replicas is None:
            return
        self.replicas.finish()
        for c in self.deferred:
            self.grad_sync[c](self.models[c].parameters())

    def close(self) -> None:
        """Leave every ``no_sync`` context still open (at the end of the attempt, whatever happened)."""
        for stack in self.sync_off.values():
            stack.close()
        self.sync_off.clear()
