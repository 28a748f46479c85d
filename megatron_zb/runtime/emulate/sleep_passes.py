"""Passes that sleep for given F/B/W durations: the runtime with compute replaced by time.

For benchmarking the runtime itself (executor order, p2p, ranks waiting on each other) against the
simulator: each pass sleeps for the setting's per-chunk cost times ``unit`` seconds, and still
produces, sends and receives real (small) tensors, so the p2p path is the real one.

    passes = sleep_passes(setting, rank, placement, unit=0.02)
    execute(lowered.orders[rank], rank, placement, passes, p2p)

MoE's all-to-all (``setting.cost_a2a``) is part of every F, B and BW's sleep, as the simulator
charges it; an overlapped F&B pair runs as one pass (the executor's pair call, once both inputs
are in) that sleeps the two computes and only what each all-to-all's partner does not hide
(``SleepPasses.pair_seconds``: ``core.sim.simulate.paired_cost`` of each), and hands both results on
at its end, as the simulator has it.

:func:`time_iterations` runs a lowered schedule several times on every rank of a process group
(barrier before each) and returns each iteration's wall time on this rank.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...core.ir import BW, Action, B, F, Placement, Schedule, Setting, W
from ...core.sim.simulate import paired_cost
from ..executor import StagePasses, execute

__all__ = ["SleepPasses", "sleep_passes", "time_iterations", "precise_sleep"]

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


@dataclass
class SleepPasses(StagePasses):
    """``StagePasses`` whose passes sleep (``sleep_passes``), plus what an overlapped F&B pair
    sleeps: its two computes and only the part of each all-to-all the other's compute does not
    hide, exactly as the simulator charges it (``core.sim.simulate.paired_cost``)."""

    seconds: Dict[str, float] = field(default_factory=dict)  # kind -> one plain pass of the rank's first chunk
    stage_seconds: Dict[Tuple[str, int], float] = field(default_factory=dict)  # (kind, stage) -> one plain pass
    setting: Optional[Setting] = None
    unit: float = 0.0
    rank: int = 0

    def pair_seconds(self, f_stage: int, b_stage: int, split: bool) -> float:
        """Seconds an overlapped pair of this rank's F (of ``f_stage``) and B (``split``) or BW
        (of ``b_stage``) takes in all, from the moment both have their inputs."""
        return sum(self.pair_parts(f_stage, b_stage, split))

    def pair_parts(self, f_stage: int, b_stage: int, split: bool) -> Tuple[float, float]:
        """(seconds of the F, seconds of the backward) inside an overlapped pair: each pass's
        all-to-all hides behind the other's compute unless the setting says it does not."""
        st, bk = self.setting, (B if split else BW)
        if st is None or not (st.a2a_overlap and any(st.cost_a2a)):
            return self.stage_seconds[(F, f_stage)], self.stage_seconds[(bk, b_stage)]
        r = self.rank
        f_act, b_act = Action(F, f_stage, 0), Action(bk, b_stage, 0)
        return paired_cost(st, r, f_act, b_act) * self.unit, paired_cost(st, r, b_act, f_act) * self.unit


def sleep_passes(setting: Setting, rank: int, placement: Placement, shape: Sequence[int] = (4,),
                 unit: float = 0.01, dtype: torch.dtype = torch.float32, device="cpu",
                 pairs_as_one: bool = False) -> SleepPasses:
    """StagePasses for ``rank`` whose F/B/W/BW of stage s sleep ``setting.pass_cost(kind, rank, s) * unit`` s
    (with per-microbatch costs, ``setting.microbatch_costs``: microbatch mb's own ``pass_cost(kind, rank, s, mb)``).

    ``setting.chunks`` is taken from the placement (each chunk's pass costs the rank's value / V,
    or its own where the setting gives costs per chunk).
    F returns a tensor of ``shape`` (the stage's output, sent for real); B/BW return an input
    gradient of ``shape`` (stage 0 returns None). ``pairs_as_one``: an overlapped F&B pair the
    executor is given (``overlap_pairs``) runs as one pass (``StagePasses.overlap``, the executor's
    pair call) that sleeps ``pair_seconds``; without it, as two plain passes.
    """
    if setting.chunks != placement.chunks:
        setting = dataclasses.replace(setting, chunks=placement.chunks)
    if unit < 0:
        raise ValueError(f"unit must be >= 0 seconds, got {unit}")
    shape = tuple(int(x) for x in shape)
    dur = {(k, s): setting.pass_cost(k, rank, s) * unit for k in (F, B, W, BW) for s in range(placement.num_stages)}
    first = placement.stages_of(rank)[0]
    if setting.microbatch_costs is not None:  # variable-length microbatches: each its own duration
        per_mb = {(k, s, mb): setting.pass_cost(k, rank, s, mb) * unit for k in (F, B, W, BW)
                  for s in placement.stages_of(rank) for mb in range(setting.microbatches)}
        seconds = lambda k, s, mb: per_mb[(k, s, mb)]  # noqa: E731
    else:
        seconds = lambda k, s, mb: dur[(k, s)]  # noqa: E731

    def output(stage, mb):
        return torch.full(shape, float(stage * 1000 + mb), dtype=dtype, device=device)

    def in_grad(stage, mb):
        return None if placement.is_first(stage) else torch.full(shape, float(mb), dtype=dtype, device=device)

    def forward(stage, mb, inp):  # the (tiny) real work first, inside the pass's duration
        t_end = time.perf_counter() + seconds(F, stage, mb)
        out = output(stage, mb)
        precise_sleep(t_end - time.perf_counter())
        return out

    def backward(stage, mb, inp, out, grad, split):
        t_end = time.perf_counter() + seconds(B if split else BW, stage, mb)
        g = in_grad(stage, mb)
        precise_sleep(t_end - time.perf_counter())
        return g

    def weight(stage, mb):
        precise_sleep(seconds(W, stage, mb))

    def overlap(f, b):  # f = (stage, mb, input), b = (stage, mb, input, output, grad, split)
        t_end = time.perf_counter() + passes.pair_seconds(f[0], b[0], bool(b[5]))
        out, g = output(f[0], f[1]), in_grad(b[0], b[1])
        precise_sleep(t_end - time.perf_counter())
        return out, g

    passes = SleepPasses(forward=forward, backward=backward, weight=weight, overlap=overlap if pairs_as_one else None,
                         recv_shape=lambda s, mb: shape, dtype=dtype, device=device,
                         seconds={k: dur[(k, first)] for k in (F, B, W, BW)}, stage_seconds=dur, setting=setting,
                         unit=unit, rank=rank)
    return passes


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
