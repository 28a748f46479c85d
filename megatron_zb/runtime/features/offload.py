"""The activation offload manager (PipeOffload): moves what a pass keeps for later to host memory
and back, at the points the lowered schedule says (``core.passes.offload`` places OFFLOAD/RELOAD).

    mgr = OffloadManager(device)                   # one per rank; keys are (stage, microbatch)
    mgr.ignore(model.parameters())                 # never offload weights
    with mgr.capture(stage, mb, offload=True, inputs=(stage_input,)):
        out = forward(...)                         # saved tensors are captured, not kept by autograd
    mgr.offload(stage, mb)                         # OFFLOAD: D2H copies start, device memory is let go
    ...
    mgr.reload(stage, mb)                          # RELOAD: H2D copies start into fresh device memory
    mgr.wait(stage, mb)                            # before the B: the compute stream waits for them
    backward(...)
    mgr.offload_w(stage, mb) / reload_w / wait_w   # the same for what W still needs (W queue tensors)

The executor reaches it through ``runtime.features.offload_hook.OffloadHook``, which makes exactly those calls.

How:

* **Capture.** ``torch.autograd.graph.saved_tensors_hooks`` around the chunk's forward: every
  tensor autograd saves is replaced by a small handle naming its storage and its view (dtype,
  size, stride, offset). Storages are recorded once (views and aliases of an already captured
  storage share it). Skipped (kept as they are): parameters and anything given to
  :meth:`ignore`, tensors below ``min_elements`` elements, tensors on another device. The stage
  input (a leaf the executor keeps for its gradient) is captured as well; its ``.data`` is
  emptied while it is away and restored before the B.
* **Copies.** Host memory comes from a pool of buffers allocated once per size and reused every
  iteration (pinned on CUDA; one buffer per offloaded part, storages packed in it). On CUDA the
  copies run on dedicated streams: D2H on one, H2D on another (``overlap=True``, full duplex) or
  the same one (``overlap=False``); each waits for the compute stream, records an event, and the
  compute stream waits only on that event, right before the pass that needs the data. Device
  memory is released with ``record_stream`` so the allocator reuses it only after the copy. On a
  CPU (test mode, ``cpu_test=True``) the "host" buffers are separate preallocated CPU tensors and
  the copies are synchronous: same code path, same accounting.
* **W.** The inputs and output gradients of the deferred weight-gradient GEMMs (the W queue's
  tensors, asked for with ``w_tensors(stage, mb)``) can travel between B and W the same way; a
  reloaded activation is ordinary device memory, so W always reads valid data.
* **Accounting.** Resident activation bytes per rank: the captured storages (and their reloaded
  copies) that are alive and on the device, followed by weak reference, sampled after every F and
  at every offload call. ``stats()`` gives the peak, bytes captured per F, offloaded, reloaded,
  host buffer bytes and allocations (the profiler puts them in its profile).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch


__all__ = ["OffloadManager", "OffloadError"]

_ALIGN = 512  # bytes: every storage starts at a multiple of this inside a host buffer


class OffloadError(RuntimeError):
    """Misuse of the offload manager (a reload without an offload, a pass before its reload, ...)."""


class _Packed:
    """What autograd keeps instead of a captured tensor: its slot, storage and view."""
    __slots__ = ("slot", "index", "dtype", "size", "stride", "offset")

    def __init__(self, slot, index, dtype, size, stride, offset):
        self.slot = slot
        self.index = index
        self.dtype = dtype
        self.size = size
        self.stride = stride
        self.offset = offset


class _Slot:
    """One offloaded part: (stage, mb) activation ('B') or what W needs ('W')."""
    __slots__ = ("key", "storages", "nbytes", "offsets", "index", "leaves", "host", "state", "event", "kept",
                 "counted", "__weakref__")

    def __init__(self, key):
        self.key = key
        self.storages: List[Optional[torch.UntypedStorage]] = []
        self.nbytes: List[int] = []
        self.offsets: List[int] = []
        self.index: Dict[int, int] = {}
        self.leaves: List[tuple] = []  # (tensor, storage index, dtype, size, stride, offset)
        self.host = None  # the host buffer while away
        self.state = "device"  # device -> host -> coming -> device
        self.event = None
        self.kept: set = set()  # storages that stay on the device (changed size since captured)
        self.counted: List[bool] = []  # whether a storage counts as activation (its reload is tracked)

    def add(self, st: torch.UntypedStorage, counted: bool = True) -> int:
        ptr = st.data_ptr()
        i = self.index.get(ptr)
        if i is None:
            i = len(self.storages)
            self.index[ptr] = i
            self.storages.append(st)
            self.nbytes.append(st.nbytes())
            self.counted.append(counted)
        return i

    def view(self, i, dtype, size, stride, offset):
        st = self.storages[i]
        return torch.empty(0, dtype=dtype, device=st.device).set_(st, offset, size, stride)


def _u8(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


class OffloadManager:
    """Activation offload for one rank; parts are keyed by (stage, mb) (a chunk's stage)."""

    def __init__(self, device, *, overlap: bool = True, min_elements: int = 1024, cpu_test: bool = False,
                 w_tensors: Optional[Callable[[int, int], Sequence[torch.Tensor]]] = None):
        dev = torch.device(device)  # tensors name their GPU, and torch.device("cuda") != "cuda:0"
        self.device = torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
        self.cuda = self.device.type == "cuda"
        if not self.cuda and not cpu_test:
            raise OffloadError(
                f"activation offload moves activations from a GPU to host memory, but the model runs on "
                f"{self.device}; on a CPU it only runs in its test mode (cpu_test=True: synchronous copies "
                "between CPU tensors, for correctness tests)")
        self.overlap = overlap
        self.min_elements = int(min_elements)
        self.w_tensors = w_tensors
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device) if overlap else self._d2h
        self._ignore: set = set()
        self._slots: Dict[tuple, _Slot] = {}  # parts between capture/offload and their wait
        self._pool: Dict[int, List[Tuple[torch.Tensor, object]]] = {}
        self._host_bytes = 0
        self._live: Dict[int, Tuple[weakref.ref, int]] = {}  # captured device storages, by pointer
        self._by_key: Dict[Tuple[int, int], List[weakref.ref]] = {}  # (stage, mb) -> its storages
        # reloaded W-queue storages that F did not capture (output gradients made by B): not
        # activation in this manager's counts, but device memory W holds (``storages()`` has them)
        self._w_held: Dict[int, weakref.ref] = {}
        self.last_captured_bytes = 0
        self.reset_stats()

    # ------------------------------------------------------------------ setup
    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never capture these tensors' storages (the model's parameters, persistent buffers)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                try:
                    self._ignore.add(t.untyped_storage().data_ptr())
                except Exception:  # pragma: no cover - tensor subclasses without storage
                    pass

    def reset_stats(self) -> None:
        self._stats = {"peak_resident_bytes": 0, "captured_bytes": [], "offloaded_bytes": 0, "reloaded_bytes": 0,
                       "offloaded_parts": 0, "reloaded_parts": 0, "host_allocations": 0, "kept_on_device_bytes": 0}

    # ------------------------------------------------------------------ capture (F)
    @contextlib.contextmanager
    def capture(self, stage: int, mb: int, offload: bool, inputs: Sequence[Optional[torch.Tensor]] = ()):
        """Around the F of (stage, mb). ``offload``: the part will be offloaded (its saved tensors
        become handles); otherwise they are only counted. ``inputs``: the stage input leaf."""
        key = ("B", stage, mb)
        if key in self._slots:
            raise OffloadError(f"F{stage}.{mb} captured twice without its backward in between")
        slot = _Slot(key)
        counted: Dict[int, int] = {}
        device = self.device

        def pack(t):
            if not isinstance(t, torch.Tensor) or t.device != device or t.numel() < self.min_elements \
                    or isinstance(t, torch.nn.Parameter):
                return t
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if not ptr or ptr in self._ignore:
                return t
            self._track(st)
            counted[ptr] = st.nbytes()
            if not offload:
                return t
            return _Packed(slot, slot.add(st), t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())

        def unpack(x):
            if isinstance(x, _Packed):
                return self._materialize(x)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.device == device and t.numel() >= self.min_elements:
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self._ignore:
                    self._track(st)
                    counted[st.data_ptr()] = st.nbytes()
                    if offload:
                        slot.leaves.append((t, slot.add(st), t.dtype, tuple(t.size()), tuple(t.stride()),
                                            t.storage_offset()))
        self.last_captured_bytes = sum(counted.values())
        self._stats["captured_bytes"].append(self.last_captured_bytes)
        self._by_key[(stage, mb)] = [self._live[p][0] for p in counted if p in self._live]
        if offload:
            self._slots[key] = slot
        self._sample()

    def _materialize(self, p: _Packed) -> torch.Tensor:
        slot = p.slot
        if slot.state == "host":
            _, s, mb = slot.key
            raise OffloadError(f"the activation of F{s}.{mb} is needed while it is on the host (no RELOAD "
                               "before its backward)")
        if slot.state == "coming":
            self._arrive(slot)
        return slot.view(p.index, p.dtype, p.size, p.stride, p.offset)

    # ------------------------------------------------------------------ B part
    def offload(self, stage: int, mb: int) -> None:
        """OFFLOAD: copy (stage, mb)'s captured activation to host memory and let the device copy go."""
        self._out(self._get(("B", stage, mb), "OFFLOAD"))

    def reload(self, stage: int, mb: int) -> None:
        """RELOAD: start bringing (stage, mb)'s activation back into fresh device memory."""
        self._in(self._get(("B", stage, mb), "RELOAD"))

    def wait(self, stage: int, mb: int) -> None:
        """Before the B of (stage, mb): its activation is on the device when this returns (a no-op
        for parts that were never offloaded). The slot is handed over to autograd's handles."""
        slot = self._slots.pop(("B", stage, mb), None)
        if slot is not None:
            self._ready(slot, f"B{stage}.{mb}")
        self._sample()

    # ------------------------------------------------------------------ W part
    def offload_w(self, stage: int, mb: int) -> None:
        """OFFLOAD_W: after the B, move the W queue's tensors of (stage, mb) to host memory."""
        key = ("W", stage, mb)
        if key in self._slots:
            raise OffloadError(f"OFFLOAD_W{stage}.{mb} twice")
        if self.w_tensors is None:
            raise OffloadError("OFFLOAD_W needs w_tensors(stage, mb) (the W queue's tensors)")
        slot = _Slot(key)
        for t in self.w_tensors(stage, mb):
            if not isinstance(t, torch.Tensor) or t.device != self.device or t.numel() < self.min_elements:
                continue
            st = t.untyped_storage()
            if not st.data_ptr() or st.data_ptr() in self._ignore:
                continue
            # counted as activation only if F captured it (an input); output gradients made by B
            # are not (the profiler's mem-w is what F saved); storages() still has their reloads
            live = self._live.get(st.data_ptr())
            counted = live is not None and live[0]() is st
            slot.leaves.append((t, slot.add(st, counted), t.dtype, tuple(t.size()), tuple(t.stride()),
                                t.storage_offset()))
        self._slots[key] = slot
        self._out(slot)

    def reload_w(self, stage: int, mb: int) -> None:
        self._in(self._get(("W", stage, mb), "RELOAD_W"))

    def wait_w(self, stage: int, mb: int) -> None:
        """Before the W of (stage, mb) (a no-op if its tensors never left)."""
        slot = self._slots.pop(("W", stage, mb), None)
        if slot is not None:
            self._ready(slot, f"W{stage}.{mb}")
        self._sample()

    # ------------------------------------------------------------------ iteration
    def end_iteration(self) -> dict:
        """Check that every offloaded part came back; return this iteration's statistics."""
        if self._slots:
            left = sorted(self._slots)
            self._slots.clear()
            raise OffloadError(f"parts still offloaded or captured at the end of the iteration: "
                               f"{[f'{p}{s}.{m}' for p, s, m in left]} (each needs its RELOAD and its pass)")
        out = self.stats()
        self.reset_stats()
        self._by_key.clear()
        self._w_held.clear()
        return out

    def discard(self) -> None:
        """Forget this iteration's parts (optimizer post-validation drained the rest of it: the
        passes that would have taken them back never ran). Host buffers go back to the pool."""
        for slot in self._slots.values():
            if slot.host is not None:
                self._pool.setdefault(slot.host.numel(), []).append((slot.host, slot.event if self.cuda else None))
                slot.host = None
        self._slots.clear()
        self._by_key.clear()
        self.reset_stats()

    def stats(self) -> dict:
        cap = self._stats["captured_bytes"]
        return {**{k: v for k, v in self._stats.items() if k != "captured_bytes"},
                "captured_bytes_per_forward": sorted(cap)[len(cap) // 2] if cap else 0,
                "forwards": len(cap), "host_buffer_bytes": self._host_bytes,
                "device": str(self.device), "copies": "cuda streams" if self.cuda else "synchronous (CPU test mode)"}

    def alive_bytes(self, stage: int, mb: int) -> int:
        """Bytes of what the F of (stage, mb) captured (or their reloaded copies) still alive on the
        device (the profiler's ``mem_w`` at the W pass)."""
        seen, total = set(), 0
        for ref in self._by_key.get((stage, mb), ()):
            st = ref()
            if st is not None and st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def storages(self, key: Optional[Tuple[int, int]] = None) -> Dict[int, int]:
        """{pointer: bytes} of the captured storages (or reloaded copies) alive on the device, of
        one (stage, mb) or all (``runtime.observe.memory`` measures with it); all of them include the
        reloaded W-queue tensors F did not capture (output gradients), as ``runtime.observe.memory``
        counts what the W queue holds without offload."""
        self._w_held = {p: r for p, r in self._w_held.items() if r() is not None and r().data_ptr() == p}
        refs = self._by_key.get(key, ()) if key is not None else \
            [r for r, _ in self._live.values()] + list(self._w_held.values())
        out = {}
        for ref in refs:
            st = ref()
            if st is not None and st.data_ptr():
                out[st.data_ptr()] = st.nbytes()
        return out

    def resident_bytes(self) -> int:
        total = 0
        for ptr, (ref, n) in list(self._live.items()):
            st = ref()
            if st is None or st.data_ptr() != ptr:
                del self._live[ptr]
            else:
                total += st.nbytes()
        return total

    # ------------------------------------------------------------------ internals
    def _get(self, key, what) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            _, s, mb = key
            raise OffloadError(f"{what}{s}.{mb}: nothing captured for it (its pass did not run under capture, "
                               "or its part already came back)")
        return slot

    def _track(self, st) -> None:
        ptr = st.data_ptr()
        old = self._live.get(ptr)
        if old is None or old[0]() is not st:
            self._live[ptr] = (weakref.ref(st), st.nbytes())

    def _sample(self) -> None:
        r = self.resident_bytes()
        if r > self._stats["peak_resident_bytes"]:
            self._stats["peak_resident_bytes"] = r

    def _layout(self, slot: _Slot) -> int:
        off, total = [], 0
        for n in slot.nbytes:
            off.append(total)
            total += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        slot.offsets = off
        return max(total, _ALIGN)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        free = self._pool.get(nbytes)
        if free:
            buf, ev = free.pop()
            if ev is not None:  # the last H2D out of this buffer must be done before a D2H writes it
                self._d2h.wait_event(ev)
            return buf
        self._stats["host_allocations"] += 1
        self._host_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def _out(self, slot: _Slot) -> None:
        if slot.state != "device":
            _, s, mb = slot.key
            raise OffloadError(f"offload of {slot.key[0]}{s}.{mb} twice")
        # a storage whose size changed since capture (megatron's output-discarding recompute
        # frees it and refills it in place later) must stay where it is
        for i, st in enumerate(slot.storages):
            if st.nbytes() != slot.nbytes[i]:
                slot.kept.add(i)
                self._stats["kept_on_device_bytes"] += slot.nbytes[i]
        host = self._acquire(self._layout(slot))
        moved = 0
        if self.cuda:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                for i, st in enumerate(slot.storages):
                    if i in slot.kept or not slot.nbytes[i]:
                        continue
                    src = _u8(st)
                    host[slot.offsets[i]:slot.offsets[i] + slot.nbytes[i]].copy_(src, non_blocking=True)
                    src.record_stream(self._d2h)
                    moved += slot.nbytes[i]
                slot.event = torch.cuda.Event()
                slot.event.record(self._d2h)
        else:
            for i, st in enumerate(slot.storages):
                if i in slot.kept or not slot.nbytes[i]:
                    continue
                host[slot.offsets[i]:slot.offsets[i] + slot.nbytes[i]].copy_(_u8(st))
                moved += slot.nbytes[i]
        slot.host = host
        for t, *_ in slot.leaves:  # the stage input / W tensors let their storage go too
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        slot.storages = [st if i in slot.kept else None for i, st in enumerate(slot.storages)]
        slot.state = "host"
        self._stats["offloaded_bytes"] += moved
        self._stats["offloaded_parts"] += 1
        self._sample()

    def _in(self, slot: _Slot) -> None:
        if slot.state != "host":
            _, s, mb = slot.key
            raise OffloadError(f"reload of {slot.key[0]}{s}.{mb}, which is not on the host (state {slot.state})")
        host = slot.host
        fresh = []
        for i, st in enumerate(slot.storages):
            if st is None:
                st = torch.empty(slot.nbytes[i], dtype=torch.uint8, device=self.device).untyped_storage()
                slot.storages[i] = st
                fresh.append(i)
                if slot.counted[i]:
                    self._track(st)
                    self._by_key.setdefault(slot.key[1:], []).append(self._live[st.data_ptr()][0])
                else:
                    self._w_held[st.data_ptr()] = weakref.ref(st)
        moved = sum(slot.nbytes[i] for i in fresh)
        if self.cuda:
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
            if self._h2d is not self._d2h:
                self._h2d.wait_event(slot.event)  # the D2H into this buffer is done
            with torch.cuda.stream(self._h2d):
                for i in fresh:
                    _u8(slot.storages[i]).copy_(host[slot.offsets[i]:slot.offsets[i] + slot.nbytes[i]],
                                                non_blocking=True)
                slot.event = torch.cuda.Event()
                slot.event.record(self._h2d)
        else:
            for i in fresh:
                _u8(slot.storages[i]).copy_(host[slot.offsets[i]:slot.offsets[i] + slot.nbytes[i]])
        slot.state = "coming"
        self._stats["reloaded_bytes"] += moved
        self._stats["reloaded_parts"] += 1
        self._sample()

    def _arrive(self, slot: _Slot) -> None:
        """The compute stream waits for the H2D; the host buffer goes back to the pool."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.event)
        self._pool.setdefault(slot.host.numel(), []).append((slot.host, slot.event if self.cuda else None))
        slot.host = None
        for t, i, dtype, size, stride, offset in slot.leaves:
            t.data = slot.view(i, dtype, size, stride, offset)
        slot.leaves = []
        slot.state = "device"

    def _ready(self, slot: _Slot, what: str) -> None:
        if slot.state == "host":
            raise OffloadError(f"{what} needs what was offloaded for it, but no RELOAD ran before it")
        if slot.state == "coming":
            self._arrive(slot)
        # state 'device' (captured, never offloaded): nothing to do
