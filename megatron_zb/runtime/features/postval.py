"""Optimizer post-validation, the pipeline side (torch only; nothing of Megatron).

With post-validation each pipeline rank steps its optimizer as soon as its own last pass is done,
from its local gradient statistics, and the next iteration starts at once. The statistics are
reduced over the pipeline afterwards, off the critical path:

* **Channel.** Its own process groups, one per pair of neighbouring pipeline ranks (gloo, CPU
  tensors: a few numbers), so these messages never interleave with the activations, whose pairs
  match first-in first-out without tags. Per step a small helper thread on every rank receives
  the partial reduction from pipeline rank r-1 (rank 0 starts from nothing), adds its own, sends it
  to r+1; the last rank then holds the full result and sends it back r -> r-1, each rank forwarding
  it as soon as it has it (not at its own validation point: on a V placement rank 0's first
  backward waits for no backward of rank 1, so waiting there would deadlock).
* **Validation point.** Before a rank's first backward (B or BW) of the next iteration, the
  executor calls :meth:`PostValidation.validate`: wait for the full result (with a timeout naming
  the rank, the iteration and the peer), let the optimizer side judge it. The forwards before that
  point ran on the unvalidated weights; nothing they produced is kept if the step is rolled back.
* **Rollback.** When the judge says the eager step was not what a synchronous step would have done
  (clipping needed, a non-finite gradient), the executor finishes the iteration without computing
  (every message still flows, so the pipeline stays matched), the optimizer side restores the saved
  bytes and redoes the step exactly as the synchronous optimizer does, and the iteration runs again
  from the start on the same microbatches (:class:`Replay` buffers what the data iterators gave).
  Cost: one extra iteration per rollback.

The reduced values are a vector of float64: ``[sum of squared gradient norms, zero count,
non-finite flag of each optimizer]``; sums add, flags take the maximum.
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..hooks import Hook
from ..p2p import PairGroups, PipelineTimeout

__all__ = ["Channel", "Round", "PostValidation", "Replay", "replayable", "ValidationTimeout"]


class ValidationTimeout(PipelineTimeout):
    """A rank waited too long for the post-validation result; names the rank, iteration and peer."""


def combine(acc: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Partial reduction: sums for the first two entries, maximum (logical or) for the flags."""
    out = acc.clone()
    out[:2] += local[:2]
    out[2:] = torch.maximum(acc[2:], local[2:])
    return out


class Channel:
    """The post-validation links of one pipeline: pair groups (r, r+1) of their own, gloo."""

    def __init__(self, pp_ranks: Sequence[int], me: int, timeout_s: float = 300.0):
        self.pp_ranks = list(pp_ranks)
        self.me = me
        self.p = len(self.pp_ranks)
        self.timeout_s = timeout_s
        self.groups = PairGroups(self.pp_ranks, [(r, r + 1) for r in range(self.p - 1)], backend="gloo")

    def alive(self) -> bool:
        return self.groups.alive()

    def destroy(self) -> None:
        self.groups.destroy()

    def start(self, iteration: int, local: torch.Tensor) -> "Round":
        """Start the reduction of one step (``local``: this rank's values, float64 CPU)."""
        return Round(self, iteration, local.detach().to("cpu", torch.float64).clone())


class Round:
    """One step's reduction, run by a helper thread; :meth:`wait` gives the full result."""

    def __init__(self, channel: Channel, iteration: int, local: torch.Tensor):
        self.channel, self.iteration, self.local = channel, iteration, local
        self.result: Optional[torch.Tensor] = None
        self.error: Optional[BaseException] = None
        self.waiting_for = "nothing yet"
        self.peer: Optional[int] = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mzb-postval-{iteration}", daemon=True)
        self._thread.start()

    def _recv(self, peer: int, what: str) -> torch.Tensor:
        ch = self.channel
        self.waiting_for, self.peer = what, peer
        buf = torch.empty_like(self.local)
        work = dist.irecv(buf, ch.pp_ranks[peer], group=ch.groups.group(ch.me, peer))
        work.wait(timeout=datetime.timedelta(seconds=ch.timeout_s))
        return buf

    def _send(self, t: torch.Tensor, peer: int):
        ch = self.channel
        return dist.isend(t, ch.pp_ranks[peer], group=ch.groups.group(ch.me, peer))

    def _run(self):
        ch = self.channel
        sends = []
        try:
            acc = self.local
            if ch.me > 0:
                acc = combine(self._recv(ch.me - 1, "the partial reduction"), self.local)
            if ch.me < ch.p - 1:
                sends.append((self._send(acc, ch.me + 1), acc))
                full = self._recv(ch.me + 1, "the full result")
            else:
                full = acc
            if ch.me > 0:
                sends.append((self._send(full, ch.me - 1), full))
            self.result = full
            self.waiting_for, self.peer = "nothing (done)", None
            self._done.set()
            for work, _ in sends:  # keep the buffers alive until sent
                work.wait(timeout=datetime.timedelta(seconds=ch.timeout_s))
        except BaseException as e:  # reported by wait() on the main thread
            self.error = e
            self._done.set()

    def wait(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        ch = self.channel
        t0 = time.monotonic()
        limit = ch.timeout_s if timeout_s is None else timeout_s
        if not self._done.wait(limit) or (self.result is None and self.error is not None
                                          and _is_timeout(self.error)):
            peer = self.peer
            raise ValidationTimeout(
                f"pipeline rank {ch.me} (global rank {dist.get_rank()}) waited {time.monotonic() - t0:.0f}s at "
                f"training iteration {self.iteration} for the optimizer post-validation result: waiting for "
                f"{self.waiting_for} from pipeline rank {peer}"
                + (f" (global rank {ch.pp_ranks[peer]})" if peer is not None else "")
                + "; that rank is stuck or has failed")
        if self.error is not None:
            raise RuntimeError(f"pipeline rank {ch.me}: optimizer post-validation of iteration {self.iteration} "
                               f"failed: {type(self.error).__name__}: {self.error}") from self.error
        return self.result


def _is_timeout(e: BaseException) -> bool:
    return "imeout" in str(e) or "imed out" in str(e)


@dataclass
class Pending:
    """A step taken (or not) eagerly, waiting for its validation."""

    iteration: int
    round: Round
    judge: Callable[[torch.Tensor], bool]  # full result -> True if the eager step stands
    recover: Callable[[], None]  # after a False: restore and redo the step (collective)
    verdict: Optional[bool] = None


class PostValidation:
    """Shared by the optimizer side (:meth:`submit` after its eager step) and the executor
    (:meth:`validate` at the validation point, :meth:`recover` after a rolled-back iteration).

    ``timeout_s``: how long a rank waits for the result before failing with its rank, the
    iteration and the peer. Counters: ``rollbacks``, ``validated``.
    """

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.pending: Optional[Pending] = None
        self.rollbacks = 0
        self.validated = 0
        self._channel: Optional[Channel] = None
        self._channel_key = None

    # -- optimizer side -------------------------------------------------------------------------
    def channel(self, pp_group) -> Channel:
        """The channel of ``pp_group`` (created on first use: a collective over the whole world,
        like every ``new_group``; re-created after the process groups were destroyed)."""
        ranks = tuple(dist.get_process_group_ranks(pp_group))
        if self._channel is None or self._channel_key != ranks or not self._channel.alive():
            self._channel = Channel(ranks, pp_group.rank(), self.timeout_s)
            self._channel_key = ranks
        return self._channel

    def submit(self, pp_group, iteration: int, local: torch.Tensor, judge, recover) -> None:
        if self.pending is not None:
            raise RuntimeError("optimizer post-validation: a step was submitted while the previous one was "
                               "not validated yet (run a training iteration or finish() in between)")
        rnd = self.channel(pp_group).start(iteration, local)
        self.pending = Pending(iteration, rnd, judge, recover)

    # -- executor side --------------------------------------------------------------------------
    @property
    def due(self) -> bool:
        return self.pending is not None and self.pending.verdict is None

    def validate(self) -> bool:
        """At the validation point: wait for the result and judge it. True: the eager step stands
        (continue); False: finish this iteration without computing, then :meth:`recover`."""
        pend = self.pending
        if pend is None:
            return True
        if pend.verdict is None:
            full = pend.round.wait(self.timeout_s)
            pend.verdict = bool(pend.judge(full))
            self.validated += 1
        if pend.verdict:
            self.pending = None
        return pend.verdict

    def recover(self) -> None:
        """Roll back and redo the pending step (every rank of the model calls it at the same point)."""
        pend = self.pending
        if pend is None or pend.verdict is not False:
            raise RuntimeError("optimizer post-validation: recover() without a rejected step")
        self.pending = None
        self.rollbacks += 1
        pend.recover()

    def finish(self) -> None:
        """Validate the pending step now (before evaluation, a checkpoint, the end of training);
        a rejected step is rolled back and redone at once (no forwards of a next iteration ran)."""
        if self.pending is not None and not self.validate():
            self.recover()


class ValidationPoint(Hook):
    """The executor's side of post-validation (``runtime.hooks``): right before the rank's first
    backward, wait for the pending step's result and judge it; False drains the iteration."""

    def __init__(self, post_validation: PostValidation):
        self.post_validation = post_validation

    def validate(self) -> bool:
        return self.post_validation.validate()


class Replay:
    """An iterator that records what it hands out; :meth:`rewind` replays it, then continues."""

    def __init__(self, it: Iterator):
        self.it = it
        self.seen: List[Any] = []
        self.cursor = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.cursor < len(self.seen):
            x = self.seen[self.cursor]
        else:
            x = next(self.it)
            self.seen.append(x)
        self.cursor += 1
        return x

    def rewind(self) -> None:
        self.cursor = 0


def replayable(iterators: Sequence[Any]) -> List[Any]:
    """Wrap each distinct iterator once (chunks may share one); None stays None."""
    made = {}
    out = []
    for it in iterators:
        if it is None:
            out.append(None)
            continue
        if id(it) not in made:
            made[id(it)] = it if isinstance(it, Replay) else Replay(it)
        out.append(made[id(it)])
    return out
