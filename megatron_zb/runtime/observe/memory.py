"""Activation memory as measured: what one rank really holds at every pass boundary of an iteration.

The definition is the simulator's (``core.sim.simulate.memory_trace``): an F adds what it keeps for
its backward, a B releases all of it but what W still needs, a W (or a fused BW) releases the rest;
offloaded activations do not count while they are on the host. Measured two ways, one meaning:

* **CUDA**: the caching allocator's allocated bytes after every pass, minus those at the start of
  the iteration (the model, its gradients and the optimizer states are static between the two).
* **CPU** (and the tests): the distinct storages autograd saves for backward during each F
  (``torch.autograd.graph.saved_tensors_hooks``; parameters and their aliases excluded), the stage
  input the executor keeps for its gradient, and after each B the W queue's tensors (the inputs and
  output gradients of the deferred weight-gradient GEMMs), all followed by weak reference, so a
  storage counts exactly as long as something still holds it. With activation offload the offload
  manager's capture is the source (its reloaded copies count, what is on the host does not).

Not counted on CPU: the stage output sent to the next stage (Megatron frees it after the send with
``deallocate_pipeline_outputs``) and tensors a custom autograd Function keeps as plain attributes.

``MemoryHook`` is the executor's side (``runtime.hooks``); after each completed iteration its
``result`` holds the trace, the peak and each stage's median bytes per F (mem-f) and still held
after B (mem-w), which ``measured_memory`` turns into the simulator's trace and peak for the same order.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ...core.ir import BW, B, F, W
from ...core.sim.simulate import stage_memory_trace
from ..hooks import Hook

__all__ = ["ActivationMeter", "MemoryHook", "measured_memory"]

Key = Tuple[int, int]  # (stage, microbatch)


class ActivationMeter:
    """Storages that passes of one rank keep as activation, by (stage, microbatch)."""

    def __init__(self):
        self._ignore: set = set()
        self._refs: Dict[int, Tuple[weakref.ref, int]] = {}  # pointer -> (storage ref, bytes)
        self._by_key: Dict[Key, List[int]] = defaultdict(list)
        self.last_captured_bytes = 0

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (weights, persistent buffers)."""
        for t in tensors:
            try:
                self._ignore.add(t.untyped_storage().data_ptr())
            except Exception:  # noqa: BLE001 - tensor subclasses without storage
                pass

    def ignore_pointers(self, pointers: Iterable[int]) -> None:
        """Never count the storages at these data pointers."""
        self._ignore.update(pointers)

    def _add(self, key: Key, t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        base = t._base if t._base is not None else t
        if isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
            return 0
        try:
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - sparse / meta tensors
            return 0
        if not ptr or ptr in self._ignore:
            return 0
        old = self._refs.get(ptr)
        if old is not None and old[0]() is st:
            if ptr in self._by_key[key]:
                return 0
            self._by_key[key].append(ptr)
            return 0  # already counted (another microbatch's, or a constant shared by all)
        try:
            self._refs[ptr] = (weakref.ref(st), n)
        except TypeError:  # pragma: no cover
            return 0
        self._by_key[key].append(ptr)
        return n

    @contextlib.contextmanager
    def capture(self, stage: int, mb: int, inputs: Sequence[Optional[torch.Tensor]] = ()):
        """Around the F of (stage, mb): what autograd saves, and the stage input, are counted."""
        key = (stage, mb)
        new = [0]

        def pack(t):
            new[0] += self._add(key, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        for t in inputs:
            new[0] += self._add(key, t)
        self.last_captured_bytes = new[0]

    def hold(self, stage: int, mb: int, tensors: Iterable[torch.Tensor]) -> None:
        """After the B of (stage, mb): what the W queue keeps for its W counts too."""
        for t in tensors:
            self._add((stage, mb), t)

    def storages(self, key: Optional[Key] = None) -> Dict[int, int]:
        """{pointer: bytes} of the storages still alive (of one (stage, mb), or all)."""
        ptrs = self._by_key.get(key, ()) if key is not None else list(self._refs)
        out = {}
        for ptr in ptrs:
            entry = self._refs.get(ptr)
            if entry is None:
                continue
            st = entry[0]()
            if st is None or st.data_ptr() != ptr:  # freed, or megatron swapped a tensor's .data out
                if key is None:
                    del self._refs[ptr]
                continue
            out[ptr] = entry[1]
        return out

    def alive_bytes(self, stage: int, mb: int) -> int:
        """Bytes of (stage, mb)'s storages still alive (the profiler's mem-w at the W pass)."""
        return sum(self.storages((stage, mb)).values())

    def forget(self, stage: int, mb: int) -> None:
        self._by_key.pop((stage, mb), None)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return float(s[len(s) // 2]) if s else 0.0


class MemoryHook(Hook):
    """The executor's side of the measurement (see the module docstring). ``offload``: the rank's
    offload manager when activation offload runs (its capture is then the source); ``w_tensors(stage,
    mb)``: the W queue's tensors of a microbatch after its B; ``cuda``: measure with the allocator."""

    def __init__(self, meter: ActivationMeter, *, cuda: bool = False, offload=None,
                 w_tensors: Optional[Callable[[int, int], Sequence[torch.Tensor]]] = None):
        self.meter, self.cuda, self.offload, self.w_tensors = meter, cuda, offload, w_tensors
        self.result: Optional[dict] = None  # the last completed iteration's measurement
        self._trace: List[Tuple[str, int, int, int]] = []

    def prepare(self, actions) -> None:
        self._trace = []
        self._mem_f: Dict[int, List[int]] = defaultdict(list)
        self._mem_w: Dict[int, List[int]] = defaultdict(list)
        self._f_bytes: Dict[Key, int] = {}
        self._base = torch.cuda.memory_allocated() if self.cuda else 0

    def _live(self, key: Optional[Key] = None) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated() - self._base
        both = self.meter.storages(key)
        if self.offload is not None:
            both.update(self.offload.storages(key))
        return sum(both.values())

    @contextlib.contextmanager
    def compute(self, a, inputs):
        key = (a.stage, a.mb)
        if self.cuda:
            before = torch.cuda.memory_allocated()  # a local: an overlapped pair nests two passes
            yield
            delta = torch.cuda.memory_allocated() - before
            if a.kind == F:
                self._f_bytes[key] = max(0, delta)
                self._mem_f[a.stage].append(max(0, delta))
            elif a.kind == B:
                self._mem_w[a.stage].append(max(0, self._f_bytes.get(key, 0) + delta))
            return
        if a.kind == F:
            if self.offload is None:
                with self.meter.capture(a.stage, a.mb, inputs):
                    yield
                self._mem_f[a.stage].append(self.meter.last_captured_bytes)
            else:
                yield
                self._mem_f[a.stage].append(self.offload.last_captured_bytes)
            return
        yield
        if a.kind == B:
            if self.w_tensors is not None:
                self.meter.hold(a.stage, a.mb, self.w_tensors(a.stage, a.mb))
            self._b_done = True  # mem-w at its end: the executor has let its input and output go
        elif a.kind in (W, BW):
            self.meter.forget(a.stage, a.mb)

    def end(self, a) -> None:
        if a.kind == B and not self.cuda and getattr(self, "_b_done", False):
            self._b_done = False
            self._mem_w[a.stage].append(self._live((a.stage, a.mb)))
        if a.kind in (F, B, W, BW):
            self._trace.append((a.kind, a.stage, a.mb, self._live()))

    def finish(self, completed: bool) -> None:
        if not completed:
            return
        self.result = {
            "method": "cuda.memory_allocated" if self.cuda else
                      ("offload manager capture" if self.offload is not None else "saved_tensors_hooks"),
            "peak_bytes": max([0] + [b for *_, b in self._trace]),
            "trace": [{"pass": f"{k}{s}.{mb}", "bytes": b} for k, s, mb, b in self._trace],
            "mem_f": {s: _median(v) for s, v in self._mem_f.items()},
            "mem_w": {s: _median(v) for s, v in self._mem_w.items()},
        }


def measured_memory(result: Optional[dict], order) -> Optional[dict]:
    """One rank's iteration as measured (``MemoryHook.result``) next to the simulator's for its
    ``order`` with the measured per-stage mem-f / mem-w: ``measured_peak_bytes``,
    ``predicted_peak_bytes``, the stages' bytes, the method and the trace (each pass's measured
    and predicted bytes)."""
    if result is None:
        return None
    stage_mem = {s: (float(result["mem_f"].get(s, 0.0)), float(result["mem_w"].get(s, 0.0)))
                 for s in set(result["mem_f"]) | set(result["mem_w"])}
    # the trace has one row per F/B/W/BW; the vocabulary passes (VS/VT/VW/VI/VG) hold their own
    # buffers, not a chunk's activation: left out, so each row meets its own pass's prediction
    predicted = stage_memory_trace([a for a in order if not a.is_vocab], stage_mem)
    trace = [dict(row, predicted=int(round(p))) for row, p in zip(result["trace"], predicted)]
    return {"measured_peak_bytes": int(result["peak_bytes"]),
            "predicted_peak_bytes": int(round(max([0.0] + predicted))),
            "mem_f_bytes": {str(s): int(v) for s, v in sorted(result["mem_f"].items())},
            "mem_w_bytes": {str(s): int(v) for s, v in sorted(result["mem_w"].items())},
            "method": result["method"], "trace": trace}
