"""Vocabulary passes that sleep (emulated compute, ``runtime.emulate.sleep_passes``'s companion for
vocabulary parallelism): VS, VT and VW of every rank wait their costs (``core.ir.vocab.VocabSetting``
times ``unit`` seconds), and everything between the ranks goes through real asynchronous gloo
collectives over the pipeline ranks, as the real runtime (``runtime.features.vocab``) moves it:

* the loss stage's forward of microbatch j sends a small tensor to every other rank (group
  ``bcast``, tag j: the hidden states); a VS(j) on another rank waits for it;
* **C0**: in VS(j) every rank joins an all-reduce (MAX, group ``c0``) of the time its VS is due
  to end (issued as the pass begins: issuing a gloo collective takes a CPU rank a fraction of a
  millisecond, an accelerator's stream next to nothing); VT(j) waits for it, then until that time
  plus the barrier's modelled transfer time (``cost_comm``: the collective carries a few bytes
  here, the real one the statistics and the input gradient's parts), as the simulator has it
  (``core.ir.vocab.Barriers``);
* **C1** (two barriers): the same for VT(j) (group ``c1``); the loss stage's backward
  of j waits for it (with one barrier, for C0);
* the loss stage's rank sends the loss scale at the end of its VT(j) (group ``scale``, tag j);
  a VW(j) on another rank waits for it.

The two hand-overs from the loss stage's rank are point-to-point messages (``isend``, one per
rank): a gloo broadcast would hold one of its group's two worker threads until the last rank
joins, so a late rank would hold up the next microbatches' hand-overs to every rank (the
simulator charges each a hop). Every barrier's all-reduce runs in microbatch order on every
rank. The clocks are ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of a machine).

    vocab = SleepVocab(setting.vocab, rank, placement, unit=1e-3, groups=SleepVocab.groups(world))
    passes.vocab = vocab            # StagePasses of runtime.emulate.sleep_passes
    execute(...); vocab.finish()
"""
from __future__ import annotations

import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ...core.ir import VS, VT, VW, Placement
from .sleep_passes import precise_sleep

__all__ = ["SleepVocab", "sleep_vocab"]

_GROUPS = ("bcast", "c0", "c1", "scale")


class _All:
    """Several requests waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


class SleepVocab:
    """One rank's emulated vocabulary passes (``run``), the loss stage's hand-over
    (``loss_output``) and output gradient (``loss_grad``), as ``runtime.executor`` calls them."""

    def __init__(self, vocab, rank: int, placement: Placement, unit: float, groups: Dict[str, object],
                 shape=(4,)):
        self.vocab, self.rank, self.unit, self.groups = vocab, rank, float(unit), groups
        self.loss_rank = placement.rank_of(placement.num_stages - 1)
        self.world = placement.num_ranks
        self.is_loss_rank = rank == self.loss_rank
        self.shape = tuple(shape)
        self.comm_s = vocab.cost_comm * self.unit
        self.handles: Dict[tuple, object] = {}  # (what, mb) -> (work, tensor)
        self.barrier_end: Dict[tuple, float] = {}  # (C0|C1, mb) -> when it completes

    @staticmethod
    def groups(world: int) -> Dict[str, object]:
        """The four gloo groups over ranks 0..world-1 (every rank calls this, in the same order)."""
        ranks = list(range(world))
        return {name: dist.new_group(ranks, backend="gloo") for name in _GROUPS}

    def _seconds(self, kind: str) -> float:
        return self.vocab.cost(kind, self.rank) * self.unit

    def _async(self, what: str, mb: int, work, tensor) -> None:
        self.handles[(what, mb)] = (work, tensor)

    def _wait(self, what: str, mb: int) -> torch.Tensor:
        work, tensor = self.handles.pop((what, mb))
        work.wait()
        return tensor

    def _barrier_time(self, which: str, mb: int) -> float:
        """When barrier ``which`` of ``mb`` completes: the latest rank's pass end (the all-reduce's
        result) plus the modelled transfer time."""
        key = (which, mb)
        if key not in self.barrier_end:
            ends = self._wait(which, mb)
            self.barrier_end[key] = float(ends[0]) + self.comm_s
        return self.barrier_end[key]

    def _join_barrier(self, which: str, mb: int, end: float) -> None:
        """Join barrier ``which`` of ``mb`` with this rank's pass ending at ``end``."""
        t = torch.tensor([end], dtype=torch.float64)
        self._async(which, mb, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups[which], async_op=True), t)

    def _send(self, what: str, mb: int, shape) -> None:
        """The loss stage's rank: a small tensor to every other rank (tag ``mb``)."""
        t = torch.full(shape, float(mb))
        works = [dist.isend(t, q, group=self.groups[what], tag=mb) for q in range(self.world) if q != self.rank]
        self._async(what, mb, _All(works), t)

    def _recv(self, what: str, mb: int, shape) -> None:
        t = torch.empty(shape)
        dist.irecv(t, self.loss_rank, group=self.groups[what], tag=mb).wait()

    # -- what the executor calls ----------------------------------------------------------------
    def loss_output(self, mb: int, out) -> None:
        """The loss stage's forward of ``mb`` ended: its hidden states to every rank."""
        self._send("bcast", mb, self.shape)

    def loss_grad(self, mb: int) -> torch.Tensor:
        """The loss stage's output gradient of ``mb``: after the last barrier."""
        which = "c1" if self.vocab.barriers == 2 else "c0"
        precise_sleep(self._barrier_time(which, mb) - time.perf_counter())
        return torch.full(self.shape, float(mb))

    def run(self, kind: str, mb: int) -> None:
        {VS: self._vs, VT: self._vt, VW: self._vw}[kind](mb)

    def _vs(self, mb: int) -> None:
        if not self.is_loss_rank:  # the hidden states from the loss stage's rank
            self._recv("bcast", mb, self.shape)
        end = time.perf_counter() + self._seconds(VS)
        self._join_barrier("c0", mb, end)  # issued as the pass begins: issuing takes a gloo rank ~0.2 ms
        precise_sleep(end - time.perf_counter())

    def _vt(self, mb: int) -> None:
        precise_sleep(self._barrier_time("c0", mb) - time.perf_counter())
        end = time.perf_counter() + self._seconds(VT)
        if self.vocab.barriers == 2:
            self._join_barrier("c1", mb, end)
        precise_sleep(end - time.perf_counter())
        if self.is_loss_rank:
            self._send("scale", mb, (1,))

    def _vw(self, mb: int) -> None:
        if not self.is_loss_rank:
            self._recv("scale", mb, (1,))  # the loss stage's per-token scale
        precise_sleep(self._seconds(VW))  # the loss stage's sends complete by the iteration's end (finish)

    def finish(self) -> None:
        """The end of an iteration: every collective of it completed, nothing left."""
        for what, mb in sorted(self.handles):
            self._wait(what, mb)
        self.barrier_end.clear()


def sleep_vocab(setting, rank: int, placement: Placement, unit: float,
                groups: Dict[str, object]) -> Optional[SleepVocab]:
    """A ``SleepVocab`` where ``setting`` has vocabulary passes (``setting.vocab``), else None."""
    if setting.vocab is None:
        return None
    return SleepVocab(setting.vocab, rank, placement, unit, groups)
