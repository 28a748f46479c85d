"""Measure F, B, W, BW and p2p per model chunk over a window of iterations; write a profile JSON.

    prof = PassProfiler(window=(3, 5), path="profile.json", schedule="zb-h1")
    for it in range(1, n + 1):                       # iterations count from 1
        hooks = [prof.hook(device)] if prof.in_window(it) else []   # this iteration only
        execute(actions, rank, placement, passes, p2p, hooks=hooks)
        if prof.in_window(it):
            profile = prof.end_iteration(it, WindowCall(placement=pl, num_microbatches=m, rank=me,
                                                        group=pp_group, p2p=p2p, shape=act_shape))
            # ``profile`` is None until the last iteration of the window, then the gathered dict
            # (the same on every pipeline rank; pipeline rank 0 also wrote it to ``path``;
            # ``runtime.observe.profile_data`` builds, reads and converts it)

``megatron_zb.megatron.install`` does this for you (``install(..., profile_window=(a, b),
profile_path=...)``).

What is measured (inside the window only; outside it no hook is given, nothing is timed or synchronised):

* **Pass time** per (stage, kind) for F, B, W and BW. On CUDA, a pair of ``torch.cuda.Event``
  records around each pass (no synchronisation per pass); the events are read once at the end of
  each window iteration after a *local* ``torch.cuda.synchronize()``. On CPU, ``perf_counter``.
* **p2p**: the time this rank waits in receives (posting the receive + its ``wait()``; the hook's
  ``wait`` points, the posting time added to the wait that follows it), attributed to
  the consuming pass (F or B of a stage); on CUDA as events around the wait (the stream stall).
  This includes pipeline-dependency waiting (bubbles), so it is reported, not used as the hop
  cost. ``cost_comm`` (the simulator's per-hop charge) comes from a short **ping-pong probe** run
  once at the end of the window: each pair of neighbouring pipeline ranks exchanges one
  activation-shaped tensor ``probe_rounds`` times over its own pair group; one hop = half the
  median round trip.
* **Handling** (CPU only): per pass, the time of its own action and of its messages' actions
  (RECV_F/SEND_F an F's, RECV_B/SEND_B its backward's) that is neither its computation nor a wait for
  a message: posting sends and receives, the executor's bookkeeping, the hooks' entry and exit. The
  profile's ``chunk_handling_*``, beside ``chunk_interference_*`` (how much the pass's samples cost on
  average beyond their median: other threads and processes taking the core); ``profile_data.
  profile_to_setting_kwargs`` adds both to the pass's cost (what the rank spends on the pass on
  average). On CUDA the host's work overlaps the device's: neither is measured.
* **Activation bytes per F pass** (``mem_f``) and what is still held from B until W (``mem_w``).
  On CUDA: ``torch.cuda.memory_allocated()`` before/after F (``mem_f``) and before/after W
  (``mem_w`` = what W frees). On CPU (and whenever the passes do not run on a CUDA device): an
  activation meter (``runtime.observe.memory.ActivationMeter``: a ``torch.autograd.graph.saved_tensors_hooks``
  pack hook; or whatever already captures, the offload manager or the forward-backward's meter) counts
  the bytes of the distinct storages the F pass saves for backward (parameters, i.e. ``nn.Parameter`` and their views, and anything
  given to :meth:`PassProfiler.ignore_parameters`, are not activations and are skipped); the
  storages are tracked by weak reference, and the bytes still alive when that microbatch's W pass
  starts give ``mem_w``. This is an estimate: tensors a custom autograd Function keeps as plain
  ``ctx`` attributes and the stage output (megatron frees it after sending) are not counted.

At the end of the window every rank's raw samples are gathered across the pipeline group with a
single ``all_gather_object`` (the only collective the profiler issues), every rank builds the same
profile (:func:`build_profile`), and pipeline rank 0 of the pipeline group holding global rank 0
writes it to ``path``. Per stage (pipeline rank) costs are whole-stage values as in the simulator
contract: the sum over the rank's chunks of each chunk's median pass time.

No module-level state: everything lives in the :class:`PassProfiler` object.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...core.ir import BW, RECV_B, RECV_F, SEND_B, SEND_F, VOCAB_KINDS, B, F, Placement, W
from ..hooks import Hook
from .memory import ActivationMeter
from .profile_data import ProfileError, build_profile, save_profile

__all__ = ["PassProfiler", "ProfileError", "WindowCall"]

_WHAT = re.compile(r"\b([FB])(\d+)\.(\d+)\b")


# --------------------------------------------------------------------------------------------
# the per-rank recorder
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WindowCall:
    """What the window's end needs from the forward-backward call that closes an iteration: the
    placement, the microbatches, this pipeline rank, its pipeline group and P2P with the activation
    shape, dtype and device (the hop probe's message; none: no probe), the schedule's name (None:
    the profiler's own) and the built schedule that ran (recorded in the profile; None: not)."""
    placement: Placement
    num_microbatches: int
    rank: int
    group: Any = None
    p2p: Any = None
    shape: Optional[Sequence[int]] = None
    dtype: torch.dtype = torch.float32
    device: Any = None
    schedule: Optional[str] = None
    built: Any = None


class PassProfiler:
    """Times passes and receives of one pipeline rank while the iteration is inside ``window``.

    ``window`` = (start, end), inclusive, iterations numbered from 1 by the caller (install()
    counts forward-backward calls with ``forward_only=False``). ``path``: where the profile JSON
    is written at the end of the window (None: not written; the dict is still returned).
    """

    def __init__(self, window: Tuple[int, int], path: Optional[str] = None, *,
                 schedule: Optional[str] = None, probe_rounds: int = 5):
        try:
            start, end = (int(window[0]), int(window[1]))
            ok = len(window) == 2 and all(not isinstance(x, bool) and int(x) == x for x in window)
        except (TypeError, ValueError, IndexError):
            ok = False
        if not ok or start < 1 or end < start:
            raise ProfileError(f"profile window must be two iteration numbers 1 <= start <= end, got {window!r}")
        if not isinstance(probe_rounds, int) or probe_rounds < 0:
            raise ProfileError(f"probe_rounds must be an integer >= 0, got {probe_rounds!r}")
        self.start, self.end = start, end
        self.path = path
        self.schedule = schedule
        self.probe_rounds = probe_rounds
        self.profile: Optional[dict] = None  # set once the window has ended
        self._ignore: set = set()
        # variable-length batches: this iteration's microbatch shapes, mb -> (tokens, sum of s^2), set by
        # the caller before the iteration runs; each timed pass then also gives a length sample
        self.shapes: Dict[int, Tuple[int, int]] = {}
        self._reset_samples()

    # -- state -------------------------------------------------------------------------------
    def _reset_samples(self):
        self.times: Dict[Tuple[int, str], List[float]] = defaultdict(list)  # (stage, kind) -> s
        self.mem_f: Dict[int, List[int]] = defaultdict(list)  # stage -> bytes per F
        self.mem_w: Dict[int, List[int]] = defaultdict(list)  # stage -> bytes held from B until W
        self.recv_wait: Dict[Tuple[int, str], List[float]] = defaultdict(list)  # (stage, 'F'|'B') -> s
        # CPU: the rank's time around each pass that is neither its computation nor a wait (its messages'
        # posting, the executor's bookkeeping, the hooks' entry and exit): (stage, kind) -> s per pass
        self.handling: Dict[Tuple[int, str], List[float]] = defaultdict(list)
        self._handling: Dict[Tuple[int, str, int], float] = defaultdict(float)  # this iteration's, per pass
        self.length_samples: Dict[Tuple[int, str], List[list]] = defaultdict(list)  # -> [tokens, sum s^2, s]
        self.iteration_s: List[float] = []
        self.between_s: List[float] = []  # from one window iteration's end to the next one's start
        self._t_end: Optional[float] = None
        self.iterations: List[int] = []
        self.device_type = "cpu"
        self.mem_method = None
        self._events: List[tuple] = []  # CUDA: (what, stage, kind, start_event, end_event)
        self._saved: Dict[Tuple[int, int], Any] = {}  # (stage, mb) -> what captured its F
        self._gpu_mem_at_f: Dict[Tuple[int, int], int] = {}
        self._t_iter: Optional[float] = None
        self.offload_stats: List[dict] = []  # per window iteration, from the offload manager (if any)
        self.memory: Optional[dict] = None  # the last window iteration's measured memory (runtime.observe.memory)

    @property
    def done(self) -> bool:
        return self.profile is not None

    def in_window(self, iteration: int) -> bool:
        return self.profile is None and self.start <= iteration <= self.end

    def ignore_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Storages that hold weights, not activations: saved tensors in them are not counted
        (needed where a layer saves a detached alias of its weight, or weights are plain tensors;
        with megatron's DDP every parameter lives in one contiguous buffer storage)."""
        for p in params:
            self._ignore.add(p.untyped_storage().data_ptr())

    # -- the executor hook of one window iteration ---------------------------------------------
    def hook(self, device, offload=None) -> Hook:
        """The hook (``runtime.hooks``) that records this iteration on ``device``. ``offload``:
        whatever already captures each F's saved tensors on a CPU (the rank's offload manager, or
        the activation meter of ``runtime.observe.memory``): nested capture hooks hide each other, so its
        counts (``last_captured_bytes``, ``alive_bytes(stage, mb)``) are taken."""
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        cuda = dev.type == "cuda" and torch.cuda.is_available()
        self.device_type = "cuda" if cuda else "cpu"
        self.mem_method = ("cuda.memory_allocated" if cuda else "saved_tensors_hooks" if offload is None
                           else f"saved_tensors_hooks ({type(offload).__name__})")
        self._t_iter = time.perf_counter()
        if self._t_end is not None:  # Megatron's optimizer step (and the rest of its loop) since the last one
            self.between_s.append(self._t_iter - self._t_end)
            self._t_end = None
        return _ProfileHook(self, cuda, offload)

    def _record_pass(self, stage: int, kind: str, mb: int, seconds: float, shape=None) -> None:
        self.times[(stage, kind)].append(seconds)
        shape = shape if shape is not None else self.shapes.get(mb)
        if shape is not None:
            self.length_samples[(stage, kind)].append([shape[0], shape[1], seconds])

    def _record_wait(self, what: str, seconds: float = None, events=None) -> None:
        m = _WHAT.search(what or "")
        stage, kind = (int(m.group(2)), m.group(1)) if m else (-1, "?")
        if events is not None:
            self._events.append(("recv", stage, kind) + tuple(events))
        else:
            self.recv_wait[(stage, kind)].append(seconds)

    # -- end of an iteration / of the window ------------------------------------------------------
    def end_iteration(self, iteration: int, call: "WindowCall") -> Optional[dict]:
        """Close one window iteration. At the window's last iteration: probe the hop time, gather
        every pipeline rank's samples (one ``all_gather_object`` over ``call.group``), build the
        profile, write it (pipeline rank 0 of the pipeline holding global rank 0) and return it."""
        if not self.in_window(iteration):
            return None
        if self._events:
            torch.cuda.synchronize()  # local device only, inside the window
            for what, stage, kind, s, e, *shape in self._events:
                secs = s.elapsed_time(e) / 1e3
                if what == "pass":
                    self._record_pass(stage, kind, -1, secs, shape[0] if shape else None)
                else:
                    self.recv_wait[(stage, kind)].append(secs)
            self._events.clear()
        if self._t_iter is not None:
            self._t_end = time.perf_counter()
            self.iteration_s.append(self._t_end - self._t_iter)
            self._t_iter = None
        for (stage, kind, _), secs in self._handling.items():
            self.handling[(stage, kind)].append(secs)
        self._handling.clear()
        self.iterations.append(iteration)
        self._saved.clear()
        self.shapes = {}
        if iteration < self.end:
            return None
        group, placement = call.group, call.placement
        probe = (self._probe_comm(call.p2p, placement, call.rank, call.shape, call.dtype, call.device)
                 if call.p2p is not None and call.shape else [])
        mine = self.rank_stats(call.rank, placement)
        mine["comm_probe"] = probe
        if group is not None or (dist.is_available() and dist.is_initialized()):
            n = dist.get_world_size(group) if group is not None else dist.get_world_size()
            everyone: List[Any] = [None] * n
            dist.all_gather_object(everyone, mine, group=group)
        else:
            everyone = [mine]
        profile = build_profile(everyone, schedule=call.schedule or self.schedule, placement=placement,
                                microbatches=call.num_microbatches, window=(self.start, self.end))
        built = call.built
        if built is not None:  # the schedule that ran (``core.ir.io``), to simulate it with the measured costs
            import json

            from ...core.ir.io import to_json
            profile["built_schedule"] = json.loads(to_json(built))
        self.profile = profile
        if self.path and _is_writer(group):
            save_profile(profile, self.path)
        self._reset_samples()
        return profile

    def rank_stats(self, rank: int, placement: Placement) -> dict:
        """This rank's raw samples, JSON-able (keys are strings)."""
        return {
            "rank": rank,
            "stages": placement.stages_of(rank),
            "device": self.device_type,
            "mem_method": self.mem_method,
            "times": {k: {str(s): v for (s, kk), v in self.times.items() if kk == k}
                      for k in (F, B, W, BW) + VOCAB_KINDS},  # a vocabulary pass's "stage" is its rank
            "mem_f": {str(s): v for s, v in self.mem_f.items()},
            "mem_w": {str(s): v for s, v in self.mem_w.items()},
            "recv_wait": {k: {str(s): v for (s, kk), v in self.recv_wait.items() if kk == k} for k in (F, B)},
            "handling": {k: {str(s): v for (s, kk), v in self.handling.items() if kk == k} for k in (F, B, W, BW)},
            "iteration_s": list(self.iteration_s),
            "between_s": list(self.between_s),
            "iterations": list(self.iterations),
            "offload": list(self.offload_stats),
            "memory": self.memory,
            "length_samples": {k: {str(s): v for (s, kk), v in self.length_samples.items() if kk == k}
                               for k in (F, B, W, BW) if any(kk == k for _, kk in self.length_samples)},
        }

    def _probe_comm(self, p2p, placement: Placement, me: int, shape, dtype, device) -> List[float]:
        """One-way hop time between neighbouring pipeline ranks (half a ping-pong round trip)."""
        if self.probe_rounds < 1 or getattr(p2p, "groups", None) is None:
            return []
        pl = placement
        nxt = [(s, pl.next_stage(s)) for s in range(pl.num_stages)]
        pairs = sorted({tuple(sorted((pl.rank_of(s), pl.rank_of(n))))
                        for s, n in nxt if n is not None and pl.rank_of(s) != pl.rank_of(n)})
        dev = device if device is not None else "cpu"
        cuda = torch.device(dev).type == "cuda" and torch.cuda.is_available()
        buf = torch.zeros(tuple(shape), dtype=dtype, device=dev)
        out = []
        # every rank walks the same globally sorted pair list: the lowest unfinished pair always
        # has both of its ranks at it, so blocking send/recv cannot deadlock
        for a, b in pairs:
            if me not in (a, b):
                continue
            g = p2p.groups.group(a, b)
            ga, gb = p2p.groups.pp_ranks[a], p2p.groups.pp_ranks[b]
            for i in range(self.probe_rounds + 1):  # the first round warms the connection up
                if me == a:
                    t0 = time.perf_counter()
                    dist.send(buf, gb, group=g)
                    dist.recv(buf, gb, group=g)
                    if cuda:
                        torch.cuda.synchronize()
                    if i:
                        out.append((time.perf_counter() - t0) / 2)
                else:
                    dist.recv(buf, ga, group=g)
                    dist.send(buf, ga, group=g)
                    if cuda:
                        torch.cuda.synchronize()
        return out


def _is_writer(group) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return True
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return 0 in ranks and dist.get_rank() == ranks[0]


class _ProfileHook(Hook):
    """Times the passes (CUDA events, or perf_counter on a CPU) and the waits for receives, and
    measures what each F keeps for its backward and what is still held at its W. On a CPU also each
    pass's handling: the time of its own action and of its messages' actions (RECV_F/SEND_F an F's,
    RECV_B/SEND_B its backward's) that is neither the pass's computation nor a wait for a message
    (on CUDA the host runs ahead of the device: that time overlaps the device's)."""

    def __init__(self, prof: PassProfiler, cuda: bool, offload):
        self.prof, self.cuda, self.offload = prof, cuda, offload
        self.posted: Dict[str, float] = {}  # a receive's posting time, added to its wait
        self.backward_kind: Dict[Tuple[int, int], str] = {}  # (stage, mb) -> B or BW on this rank
        self._open: Optional[tuple] = None  # (action, start, the timed inner seconds at its start)
        self._inner = 0.0  # computation and waits timed so far (excluded from handling)

    def prepare(self, actions) -> None:
        self.backward_kind = {(a.stage, a.mb): a.kind for a in actions if a.kind in (B, BW)}

    def begin(self, a) -> None:
        if not self.cuda and self._open is None:  # an overlapped pair's second begin is the first's
            self._open = (a, time.perf_counter(), self._inner)

    def end(self, a) -> None:
        if self._open is None or self._open[0] is not a:
            return
        _, t0, inner = self._open
        self._open = None
        kind = _HANDLING_OF.get(a.kind)
        if kind == B:
            kind = self.backward_kind.get((a.stage, a.mb), B)
        if kind is not None:
            spent = time.perf_counter() - t0 - (self._inner - inner)
            self.prof._handling[(a.stage, kind, a.mb)] += max(0.0, spent)

    @contextlib.contextmanager
    def wait(self, what: str):
        prof = self.prof
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            yield
            e.record()
            if what in self.posted:
                self.posted.pop(what)
                prof._record_wait(what, events=(s, e))
            else:
                self.posted[what] = 0.0
            return
        t0 = time.perf_counter()
        yield
        secs = time.perf_counter() - t0
        if what in self.posted:
            prof._record_wait(what, seconds=self.posted.pop(what) + secs)
            self._inner += secs  # the wait itself (its posting is the message's handling)
        else:
            self.posted[what] = secs

    @contextlib.contextmanager
    def compute(self, a, inputs):
        prof, stage, kind = self.prof, a.stage, a.kind
        if self.cuda:
            m0 = torch.cuda.memory_allocated()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            yield
            e.record()
            prof._events.append(("pass", stage, kind, s, e, prof.shapes.get(a.mb)))
            if kind == F:
                prof.mem_f[stage].append(torch.cuda.memory_allocated() - m0)
            elif kind == W:
                prof.mem_w[stage].append(max(0, m0 - torch.cuda.memory_allocated()))
            return
        if kind == F:
            t0 = time.perf_counter()
            src = self.offload
            if src is None:  # nothing captures yet: a meter of this F alone does
                src = ActivationMeter()
                src.ignore_pointers(prof._ignore)
                with src.capture(stage, a.mb):
                    yield
            else:
                yield
            prof.mem_f[stage].append(src.last_captured_bytes)
            secs = time.perf_counter() - t0
            prof._record_pass(stage, F, a.mb, secs)
            self._inner += secs
            prof._saved[(stage, a.mb)] = src
            return
        if kind == W:
            src = prof._saved.pop((stage, a.mb), None)
            if src is not None:  # what the F pass saved and is still alive after B
                prof.mem_w[stage].append(src.alive_bytes(stage, a.mb))
        elif kind == BW:
            prof._saved.pop((stage, a.mb), None)
        t0 = time.perf_counter()
        yield
        secs = time.perf_counter() - t0
        prof._record_pass(stage, kind, a.mb, secs)
        self._inner += secs


# the pass whose handling an action is: its own, or the pass its message feeds or comes from
_HANDLING_OF = {F: F, RECV_F: F, SEND_F: F, B: B, BW: B, RECV_B: B, SEND_B: B, W: W}
