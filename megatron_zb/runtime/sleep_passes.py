"""Passes that sleep for given F/B/W durations: the runtime with compute replaced by time.

For benchmarking the runtime itself (executor order, p2p, ranks waiting on each other) against the
simulator: each pass sleeps for the setting's per-chunk cost times ``unit`` seconds, and still
produces, sends and receives real (small) tensors, so the p2p path is the real one.

    passes = sleep_passes(setting, rank, placement, unit=0.02)
    execute(lowered.orders[rank], rank, placement, passes, p2p)

:func:`time_iterations` runs a lowered schedule several times on every rank of a process group
(barrier before each) and returns each iteration's wall time on this rank.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import List, Sequence

import torch
import torch.distributed as dist

from ..core.ir import B, BW, F, W, Placement, Schedule, Setting
from .executor import StagePasses, execute

__all__ = ["sleep_passes", "time_iterations", "precise_sleep"]

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def precise_sleep(seconds: float, spin_s: float = 0.0004) -> None:
    """Sleep ``seconds``: ``time.sleep`` until ``spin_s`` before the deadline (its wake-up comes
    0.05-0.3 ms late), then yield the CPU (``os.sched_yield``) until the deadline. The tail costs
    little CPU, so several sleeping ranks share a small machine without skewing each other.
    (``time.sleep(0)`` is a 0.1 ms system call on some VMs; sched_yield is a few us.)"""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    left = seconds - spin_s
    if left > 0:
        time.sleep(left)
    while time.perf_counter() < end:
        _yield()


def sleep_passes(setting: Setting, rank: int, placement: Placement, shape: Sequence[int] = (4,),
                 unit: float = 0.01, dtype: torch.dtype = torch.float32, device="cpu") -> StagePasses:
    """StagePasses for ``rank`` whose F/B/W/BW sleep ``setting.pass_cost(kind, rank) * unit`` s.

    ``setting.chunks`` is taken from the placement (each chunk's pass costs the rank's value / V).
    F returns a tensor of ``shape`` (the stage's output, sent for real); B/BW return an input
    gradient of ``shape`` (stage 0 returns None).
    """
    if setting.chunks != placement.chunks:
        setting = dataclasses.replace(setting, chunks=placement.chunks)
    if unit < 0:
        raise ValueError(f"unit must be >= 0 seconds, got {unit}")
    shape = tuple(int(x) for x in shape)
    dur = {k: setting.pass_cost(k, rank) * unit for k in (F, B, W, BW)}

    def forward(stage, mb, inp):  # the (tiny) real work first, inside the pass's duration
        t_end = time.perf_counter() + dur[F]
        out = torch.full(shape, float(stage * 1000 + mb), dtype=dtype, device=device)
        precise_sleep(t_end - time.perf_counter())
        return out

    def backward(stage, mb, inp, out, grad, split):
        t_end = time.perf_counter() + (dur[B] if split else dur[BW])
        g = None if placement.is_first(stage) else torch.full(shape, float(mb), dtype=dtype, device=device)
        precise_sleep(t_end - time.perf_counter())
        return g

    def weight(stage, mb):
        precise_sleep(dur[W])

    return StagePasses(forward=forward, backward=backward, weight=weight,
                       recv_shape=lambda s, mb: shape, dtype=dtype, device=device)


def time_iterations(lowered: Schedule, rank: int, passes: StagePasses, p2p, iterations: int,
                    warmup: int = 1, group=None) -> List[float]:
    """Run ``lowered.orders[rank]`` ``warmup + iterations`` times; a barrier before each; return
    the wall time of each timed iteration on this rank (seconds, from leaving the barrier to the
    end of the rank's last action, its sends completed)."""
    out = []
    for i in range(warmup + iterations):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        execute(lowered.orders[rank], rank, lowered.placement, passes, p2p)
        t = time.perf_counter() - t0
        if i >= warmup:
            out.append(t)
    return out
