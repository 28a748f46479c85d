"""The W queue: deferred weight-gradient work of one model chunk, keyed by microbatch.

Zero-bubble schedules split a backward pass into **B** (gradient w.r.t. the chunk's input, on the
pipeline's critical path) and **W** (gradient w.r.t. the weights, moved into bubbles). One
:class:`WQueue` belongs to one model chunk (it is the only mutable runtime state of the weight-
gradient split, and it is scoped to that chunk, never global). The executor uses it like this::

    with queue.defer(mb):          # B pass of microbatch mb
        torch.autograd.backward(output, grad)
    ...
    queue.run(mb)                  # W pass of microbatch mb (any time later)
    ...
    queue.run_all()                # end of the iteration: drain what is left
    queue.assert_empty()

While ``defer(mb)`` is active, the layers the queue is attached to (see
``megatron_zb.megatron.execution.wgrad.attach_wgrad_queue``) compute only their input gradient and
:meth:`put` a closure that computes and accumulates their weight gradient. Outside ``defer`` a
backward is the ordinary fused one (a BW pass). Plain torch, no Megatron import.

Ordering: :meth:`run` runs one microbatch's closures in the order they were put. Microbatches may be
run in any order, except that closures put with ``fifo=True`` (Transformer Engine modules, which
keep their own first-in-first-out store per module) require W passes in the same order as the B
passes; breaking that raises :class:`WQueueError` before anything runs.

Thread note: on GPU the autograd engine runs backward on a device thread, so the "deferring" state
is a plain attribute (not thread-local); one chunk runs one pass at a time.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Callable, Dict, Iterator, List, Optional

__all__ = ["WQueue", "WQueueError"]


class WQueueError(RuntimeError):
    """Misuse of a W queue (W without its B, nested B passes, out-of-order FIFO work, ...)."""


class _Entry:
    __slots__ = ("closures", "fifo")

    def __init__(self) -> None:
        self.closures: List[Callable[[], object]] = []
        self.fifo = False


class WQueue:
    """Deferred weight-gradient closures of one model chunk, keyed by microbatch id."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._pending: Dict[int, _Entry] = {}  # insertion order == B order
        self._current: Optional[int] = None
        self._session = 0
        #: per-B-pass scratch space for the layer adapters (emptied when a ``defer`` starts);
        #: e.g. megatron_zb.megatron.execution.wgrad keeps there what the B pass's closures share at W.
        self.scratch: Dict[str, object] = {}
        self.closures_put = 0
        self.closures_run = 0

    # ------------------------------------------------------------------ B side
    @contextlib.contextmanager
    def defer(self, mb: int) -> Iterator["WQueue"]:
        """Context manager for the B pass of microbatch ``mb``.

        Inside it, attached linear layers compute only the input gradient and enqueue a closure for
        their weight gradient under key ``mb``. The microbatch is recorded as pending even if no
        closure gets queued (a chunk without deferrable layers), so its W pass is then a no-op.
        """
        mb = self._check_mb(mb)
        if self._current is not None:
            raise WQueueError(
                f"{self._who()}: defer({mb}) inside defer({self._current}); "
                "B passes of one chunk cannot nest")
        if mb in self._pending:
            raise WQueueError(
                f"{self._who()}: microbatch {mb} already has a deferred B pass whose W has not "
                f"run yet (pending: {self.pending()})")
        self._pending[mb] = _Entry()
        self._current = mb
        self._session += 1
        self.scratch = {}
        try:
            yield self
        finally:
            self._current = None
            self.scratch = {}

    @property
    def deferring(self) -> bool:
        """True while a B pass (``defer``) is active on this chunk."""
        return self._current is not None

    @property
    def current_mb(self) -> Optional[int]:
        """The microbatch whose B pass is active, or None."""
        return self._current

    @property
    def session(self) -> int:
        """Counter of ``defer`` entries (how many B passes this chunk has deferred)."""
        return self._session

    def put(self, fn: Callable[[], object], *, fifo: bool = False) -> None:
        """Queue ``fn`` (computes and accumulates one weight gradient) for the active microbatch.

        Called by layers during backward, only while :attr:`deferring`. ``fifo=True`` marks work
        that must be run in B order (see module docstring).
        """
        if self._current is None:
            raise WQueueError(
                f"{self._who()}: put() called outside defer(); weight-gradient work can only be "
                "queued during a B pass")
        entry = self._pending[self._current]
        entry.closures.append(fn)
        entry.fifo = entry.fifo or fifo
        self.closures_put += 1

    # ------------------------------------------------------------------ W side
    def run(self, mb: int) -> int:
        """W pass: run every closure of microbatch ``mb`` in enqueue order. Returns how many ran."""
        mb = self._check_mb(mb)
        if self._current is not None:
            raise WQueueError(
                f"{self._who()}: run({mb}) called during the B pass of microbatch {self._current}")
        entry = self._pending.get(mb)
        if entry is None:
            raise WQueueError(
                f"{self._who()}: W for microbatch {mb} but nothing is queued for it (its B pass did "
                f"not run under defer({mb}), or its W already ran); pending microbatches: "
                f"{self.pending()}")
        if entry.fifo:
            for other, e in self._pending.items():
                if other == mb:
                    break
                if e.fifo:
                    raise WQueueError(
                        f"{self._who()}: W for microbatch {mb} before W for microbatch {other}, "
                        f"but this chunk has Transformer Engine modules with delayed wgrad, which "
                        f"keep one FIFO per module: W passes must follow the B order "
                        f"{[m for m, x in self._pending.items() if x.fifo]}")
        del self._pending[mb]
        closures, entry.closures = entry.closures, []
        for fn in closures:
            fn()
        self.closures_run += len(closures)
        return len(closures)

    def run_all(self) -> int:
        """Drain everything in B order (end of iteration). Returns the number of closures run."""
        n = 0
        while self._pending:
            n += self.run(next(iter(self._pending)))
        return n

    def held_tensors(self, mb: int) -> List[object]:
        """The tensors microbatch ``mb``'s queued closures keep for its W (inputs and output
        gradients), for activation offload between B and W. Closures report them through a
        ``held_tensors()`` method; those without one (Transformer Engine's ``backward_dw``) keep
        theirs where they are."""
        entry = self._pending.get(self._check_mb(mb))
        if entry is None:
            return []
        out = []
        for fn in entry.closures:
            held = getattr(fn, "held_tensors", None)
            if callable(held):
                out.extend(held())
        return out

    def pending(self) -> List[int]:
        """Microbatches whose B ran under ``defer`` and whose W has not run yet, in B order."""
        return list(self._pending)

    def __len__(self) -> int:
        """Number of queued closures (all microbatches)."""
        return sum(len(e.closures) for e in self._pending.values())

    def assert_empty(self) -> None:
        """Raise :class:`WQueueError` naming the pending microbatches, if any."""
        if self._pending:
            raise WQueueError(
                f"{self._who()}: weight-gradient work still pending for microbatches "
                f"{self.pending()} ({len(self)} closures); every B needs its W before the "
                "optimizer step")

    def clear(self) -> None:
        """Drop all pending work without running it (error recovery only)."""
        if self._current is not None:
            raise WQueueError(f"{self._who()}: clear() during the B pass of {self._current}")
        self._pending.clear()

    # ------------------------------------------------------------------ helpers
    def _who(self) -> str:
        return f"W queue of chunk {self.name!r}" if self.name else "W queue"

    def _check_mb(self, mb) -> int:
        if not isinstance(mb, bool):
            try:
                return operator.index(mb)
            except TypeError:
                pass
        raise WQueueError(f"{self._who()}: microbatch id must be an int, got {mb!r}")

    def __repr__(self) -> str:
        state = f", deferring={self._current}" if self._current is not None else ""
        return f"WQueue(name={self.name!r}, pending={self.pending()}{state})"
