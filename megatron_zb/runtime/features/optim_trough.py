"""Optimizer states that live in host memory and visit the device in subgroups (torch only).

``TroughStates`` owns the movement; what a subgroup holds (a parameter copy and its optimizer state
tensors) and when it moves come from outside: the optimizer side names the tensors, the core's
trough plan (``core.optimizer.trough``) the points, and ``TroughHook`` runs them in the rank's
pass order. A tensor moves by swapping its ``.data`` (its identity, the optimizer state's key,
stays):

* ``prefetch(k)``: the subgroup's host values are copied to new device memory, asynchronously
  (``non_blocking`` on a side stream where CUDA exists);
* ``visit(k)``: right before the update: wait for the prefetch (or copy now if there was none) and
  point the tensors at their device copies;
* ``write_back(k)``: right after the update: the device values are copied to host memory on the
  other side stream (after the update's kernels);
* ``release(k)``: wait for the write-back, point the tensors at host memory, free the device copy.

**Post-validation** (``staged = True``): a step may be rolled back after its write-back. The
write-back then goes to a second host buffer; the first keeps the values from before the step
until ``commit()`` (the step was validated: the buffers swap roles) or ``rollback()`` (the tensors
point at the untouched first buffer again; device copies and prefetches are dropped). Nothing is
copied for a rollback, and the device holds no saved copy.

Without CUDA the host is the device: the copies are real copies into separate host tensors
(synchronous), so the same code runs in CPU tests.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from ..hooks import Hook

__all__ = ["TroughStates", "TroughHook"]


class _Slot:
    __slots__ = ("t", "home", "spare", "dev", "dst", "dirty")

    def __init__(self, t: torch.Tensor, home: Optional[torch.Tensor]):
        self.t = t
        self.home = home  # the committed values in host memory (None: created on the device by an update)
        self.spare: Optional[torch.Tensor] = None  # the staged write-back's buffer (post-validation)
        self.dev: Optional[torch.Tensor] = None  # the device copy (prefetched or visiting)
        self.dst: Optional[torch.Tensor] = None  # where the pending write-back goes
        self.dirty = False  # the current values are in ``dst`` / ``dev``, not yet committed


class TroughStates:
    """The host-resident tensors of one optimizer, in subgroups (see the module docstring)."""

    def __init__(self, device: Optional[torch.device] = None, staged: bool = False):
        self.device = device if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.cuda = self.device.type == "cuda"
        self.staged = staged
        self.slots: Dict[int, _Slot] = {}
        self.members: Dict[int, List[int]] = {}  # subgroup -> slot ids
        self.h2d = torch.cuda.Stream() if self.cuda else None
        self.d2h = torch.cuda.Stream() if self.cuda else None
        self.pre_events: Dict[int, object] = {}
        self.wb_events: Dict[int, object] = {}
        self.stats = {"prefetched": 0, "visited": 0, "synchronous_visits": 0, "written_back": 0, "released": 0,
                      "commits": 0, "rollbacks": 0, "bytes_h2d": 0, "bytes_d2h": 0}

    # -- the tensors ------------------------------------------------------------------------------
    def _slots(self, k: int, tensors: Iterable[torch.Tensor], born_on_device: bool = False) -> List[_Slot]:
        out = []
        for t in tensors:
            s = self.slots.get(id(t))
            if s is None or s.t is not t:
                s = self.slots[id(t)] = _Slot(t, None if born_on_device else t.data)
            out.append(s)
        self.members[k] = [id(s.t) for s in out]
        return out

    def managed(self) -> set:
        """ids of the tensors this object moves (post-validation saves everything else)."""
        return set(self.slots)

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)

    def _stream(self, s):
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    # -- the four moves ---------------------------------------------------------------------------
    def prefetch(self, k: int, tensors: Sequence[torch.Tensor]) -> None:
        """Start copying subgroup ``k`` to the device (a no-op for what is there already)."""
        every = self._slots(k, tensors)
        if all(s.dev is not None for s in every):
            return
        if self.wb_events.get(k) is not None:
            self.release(k)
        slots = [s for s in every if s.dev is None]
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream())
        with self._stream(self.h2d):
            for s in slots:
                s.dev = torch.empty(s.t.shape, dtype=s.t.dtype, device=self.device)
                s.dev.copy_(s.t.data, non_blocking=True)
                self.stats["bytes_h2d"] += s.t.numel() * s.t.element_size()
        self.pre_events[k] = self.h2d.record_event() if self.cuda else None
        self.stats["prefetched"] += 1

    def visit(self, k: int, tensors: Sequence[torch.Tensor]) -> None:
        """Subgroup ``k`` on the device now (its update follows on the current stream)."""
        slots = self._slots(k, tensors)
        if any(s.dev is None for s in slots):
            self.stats["synchronous_visits"] += 1
            self.prefetch(k, tensors)
        for ev in (self.pre_events.pop(k, None), self.wb_events.get(k)):  # copied in; the last copy out read
            if self.cuda and ev is not None:
                torch.cuda.current_stream().wait_event(ev)
        for s in slots:
            if self.cuda:  # made on the copy stream, used on this one: freed only after its work here
                s.dev.record_stream(torch.cuda.current_stream())
            s.t.data = s.dev
        self.stats["visited"] += 1

    def write_back(self, k: int, tensors: Sequence[torch.Tensor]) -> None:
        """After subgroup ``k``'s update: copy it to host memory (``tensors``: its tensors now, the
        state created by a first update included)."""
        slots = self._slots(k, tensors, born_on_device=True)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream())
        with self._stream(self.d2h):
            for s in slots:
                s.dev = s.t.data
                if self.staged or s.home is None:
                    if s.spare is None or s.spare.shape != s.t.shape or s.spare.dtype != s.t.dtype:
                        s.spare = self._host_like(s.t)
                    s.dst = s.spare
                    s.dirty = True
                else:
                    s.dst = s.home
                s.dst.copy_(s.dev, non_blocking=True)
                self.stats["bytes_d2h"] += s.t.numel() * s.t.element_size()
        self.wb_events[k] = self.d2h.record_event() if self.cuda else True
        self.stats["written_back"] += 1
        if not self.staged:
            self.commit_group(k)

    def release(self, k: int) -> None:
        """Wait for subgroup ``k``'s write-back; its tensors back in host memory, the device copy freed."""
        ev = self.wb_events.pop(k, None)
        if ev is None:
            return
        if self.cuda:
            ev.synchronize()
        for i in self.members.get(k, ()):
            s = self.slots.get(i)
            if s is None:
                continue
            s.t.data = s.dst if s.dirty else s.home
            s.dev = None
        self.stats["released"] += 1

    # -- post-validation --------------------------------------------------------------------------
    def commit_group(self, k: int) -> None:
        """Subgroup ``k``'s written-back buffers become its host copy (no wait: nothing reads them
        before ``release``, which waits for the copy)."""
        for i in self.members.get(k, ()):
            s = self.slots.get(i)
            if s is None or not s.dirty:
                continue
            if s.dst is s.spare:
                s.home, s.spare = s.spare, s.home
            s.dst, s.dirty = s.home, False
            if s.dev is None:
                s.t.data = s.home

    def commit(self) -> None:
        """The last step stands: its written-back values become the host copy."""
        for k in list(self.members):
            self.commit_group(k)
        self.stats["commits"] += 1

    def rollback(self) -> None:
        """The last step is undone: every tensor back to its committed host values (device copies,
        prefetches and pending write-backs dropped); state created by the step is forgotten."""
        if self.cuda:
            self.h2d.synchronize()
            self.d2h.synchronize()
        self.pre_events.clear()
        self.wb_events.clear()
        for i, s in list(self.slots.items()):
            s.dev, s.dst, s.dirty = None, None, False
            if s.home is None:
                del self.slots[i]
            else:
                s.t.data = s.home
        self.stats["rollbacks"] += 1

    def settle(self) -> None:
        """Every subgroup in host memory (before a checkpoint, at the end)."""
        for k in list(self.wb_events):
            self.release(k)


class TroughHook(Hook):
    """The executor's side: prefetch after the plan's passes, release before them (the rank's
    order; ``runtime.hooks``). ``points``: [(states, tensors_of(k), prefetch_after, release_before,
    first pass)] with the fields of ``core.optimizer.trough.TroughPlan``; a prefetch "at the start"
    runs at the first pass, after the releases there (the last step's copy is written back first)."""

    def __init__(self, points: Sequence[tuple]):
        self.after: Dict[tuple, list] = {}
        self.before: Dict[tuple, list] = {}
        for states, tensors_of, pre, rel, first in points:
            for k, key in rel.items():
                if key is not None:
                    self.before.setdefault(key, []).append(lambda states=states, k=k: states.release(k))
            for k, key in pre.items():
                move = (lambda states=states, tensors_of=tensors_of, k=k: states.prefetch(k, tensors_of(k)))
                if key is None:
                    self.before.setdefault(first, []).append(move)
                else:
                    self.after.setdefault(key, []).append(move)

    def begin(self, action) -> None:
        for move in self.before.get((action.kind, action.stage, action.mb), ()):
            move()

    def end(self, action) -> None:
        for move in self.after.get((action.kind, action.stage, action.mb), ()):
            move()
