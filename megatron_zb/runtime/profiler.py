"""Measure F, B, W, BW and p2p per model chunk over a window of iterations; write a profile JSON.

    prof = PassProfiler(window=(3, 5), path="profile.json", schedule="zb-h1")
    for it in range(1, n + 1):                       # iterations count from 1
        if prof.in_window(it):
            passes, p2p_run = prof.instrument(passes, p2p)   # wrapped copies, this iteration only
        execute(actions, rank, placement, passes, p2p_run)
        if prof.in_window(it):
            profile = prof.end_iteration(it, placement=pl, num_microbatches=m, rank=me,
                                         group=pp_group, p2p=p2p, shape=act_shape)
            # ``profile`` is None until the last iteration of the window, then the gathered dict
            # (the same on every pipeline rank; pipeline rank 0 also wrote it to ``path``)

``megatron_zb.megatron.install`` does this for you (``install(..., profile_window=(a, b),
profile_path=...)``).

What is measured (inside the window only; outside it nothing is wrapped, timed or synchronised):

* **Pass time** per (stage, kind) for F, B, W and BW. On CUDA, a pair of ``torch.cuda.Event``
  records around each pass (no synchronisation per pass); the events are read once at the end of
  each window iteration after a *local* ``torch.cuda.synchronize()``. On CPU, ``perf_counter``.
* **p2p**: the time this rank waits in receives (``recv`` + the handle's ``wait()``), attributed to
  the consuming pass (F or B of a stage); on CUDA as events around the wait (the stream stall).
  This includes pipeline-dependency waiting (bubbles), so it is reported, not used as the hop
  cost. ``cost_comm`` (the simulator's per-hop charge) comes from a short **ping-pong probe** run
  once at the end of the window: each pair of neighbouring pipeline ranks exchanges one
  activation-shaped tensor ``probe_rounds`` times over its own pair group; one hop = half the
  median round trip.
* **Activation bytes per F pass** (``mem_f``) and what is still held from B until W (``mem_w``).
  On CUDA: ``torch.cuda.memory_allocated()`` before/after F (``mem_f``) and before/after W
  (``mem_w`` = what W frees). On CPU (and whenever the passes do not run on a CUDA device): a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook counts the bytes of the distinct storages
  the F pass saves for backward (parameters, i.e. ``nn.Parameter`` and their views, and anything
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

import dataclasses
import json
import math
import os
import re
import statistics
import time
import weakref
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core.ir import DEFAULT_MEM_W_RATIO, B, BW, F, W, Placement

__all__ = ["PassProfiler", "ProfileError", "build_profile", "load_profile", "save_profile",
           "profile_to_setting_kwargs", "PROFILE_FORMAT", "PROFILE_VERSION", "AUTO_REPLAN_PREFIXES",
           "auto_replans"]

PROFILE_FORMAT = "megatron-zb-profile"
PROFILE_VERSION = 1
#: schedules whose order depends on the costs: re-planned from the profile when the window ends
AUTO_REPLAN_PREFIXES = ("zb-auto", "v-auto")
_WHAT = re.compile(r"\b([FB])(\d+)\.(\d+)\b")


class ProfileError(ValueError):
    """A profile window or profile JSON is malformed."""


def auto_replans(schedule: str) -> bool:
    """Whether a schedule is re-planned automatically from the measured costs."""
    return isinstance(schedule, str) and schedule.startswith(AUTO_REPLAN_PREFIXES)


def _median(xs: Sequence[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


# --------------------------------------------------------------------------------------------
# the per-rank recorder
# --------------------------------------------------------------------------------------------

class _SavedBytes:
    """Distinct storages one F pass saved for backward, tracked by weak reference.

    Storage Python objects are preserved as long as their storage lives (even when only a view or
    a ``detach()``-ed alias of the saved tensor keeps it), so a weak reference to the storage
    tells whether the memory is still held.
    """

    __slots__ = ("refs", "nbytes", "ignore")

    def __init__(self, ignore):
        self.refs: Dict[int, weakref.ref] = {}
        self.nbytes: Dict[int, int] = {}
        self.ignore = ignore

    def pack(self, t):
        if isinstance(t, torch.Tensor):
            base = t._base if t._base is not None else t
            if not isinstance(t, torch.nn.Parameter) and not isinstance(base, torch.nn.Parameter):
                try:
                    st = t.untyped_storage()
                    ptr, n = st.data_ptr(), st.nbytes()
                except Exception:  # sparse / meta / tensor subclasses without storage
                    st, ptr, n = None, None, 0
                if ptr and ptr not in self.ignore and ptr not in self.refs:
                    try:
                        self.refs[ptr] = weakref.ref(st)
                        self.nbytes[ptr] = n
                    except TypeError:
                        pass
        return t

    @staticmethod
    def unpack(t):
        return t

    def total(self) -> int:
        return int(sum(self.nbytes.values()))

    def alive(self) -> int:
        n = 0
        for ptr, ref in self.refs.items():
            st = ref()
            if st is not None and st.data_ptr() == ptr:  # megatron may swap a tensor's .data out
                n += self.nbytes[ptr]
        return n


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
        self._reset_samples()

    # -- state -------------------------------------------------------------------------------
    def _reset_samples(self):
        self.times: Dict[Tuple[int, str], List[float]] = defaultdict(list)  # (stage, kind) -> s
        self.mem_f: Dict[int, List[int]] = defaultdict(list)  # stage -> bytes per F
        self.mem_w: Dict[int, List[int]] = defaultdict(list)  # stage -> bytes held from B until W
        self.recv_wait: Dict[Tuple[int, str], List[float]] = defaultdict(list)  # (stage, 'F'|'B') -> s
        self.iteration_s: List[float] = []
        self.iterations: List[int] = []
        self.device_type = "cpu"
        self.mem_method = None
        self._events: List[tuple] = []  # CUDA: (what, stage, kind, start_event, end_event)
        self._saved: Dict[Tuple[int, int], _SavedBytes] = {}
        self._gpu_mem_at_f: Dict[Tuple[int, int], int] = {}
        self._t_iter: Optional[float] = None
        self.offload_stats: List[dict] = []  # per window iteration, from the offload manager (if any)

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

    # -- instrumentation -----------------------------------------------------------------------
    def instrument(self, passes, p2p=None):
        """Wrapped copies of ``passes`` (a StagePasses) and ``p2p`` that record this iteration."""
        dev = torch.device(passes.device) if not isinstance(passes.device, torch.device) else passes.device
        cuda = dev.type == "cuda" and torch.cuda.is_available()
        self.device_type = "cuda" if cuda else "cpu"
        self.mem_method = "cuda.memory_allocated" if cuda else "saved_tensors_hooks"
        self._t_iter = time.perf_counter()
        fwd, bwd, wgt = passes.forward, passes.backward, passes.weight
        # with activation offload the offload manager's saved-tensor hooks capture the F pass (ours
        # would hide them): its own count of the captured bytes is used instead
        off = getattr(passes, "offload", None)
        if off is not None and not cuda:
            self.mem_method = "offload manager (saved_tensors_hooks)"

        def forward(stage, mb, inp):
            if cuda:
                m0 = torch.cuda.memory_allocated()
                out = self._timed_cuda(F, stage, fwd, stage, mb, inp)
                self.mem_f[stage].append(torch.cuda.memory_allocated() - m0)
                return out
            if off is not None:
                t0 = time.perf_counter()
                out = fwd(stage, mb, inp)
                self.times[(stage, F)].append(time.perf_counter() - t0)
                self.mem_f[stage].append(off.last_captured_bytes)
                self._saved[(stage, mb)] = off
                return out
            reg = _SavedBytes(self._ignore)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(reg.pack, reg.unpack):
                out = fwd(stage, mb, inp)
            self.times[(stage, F)].append(time.perf_counter() - t0)
            self.mem_f[stage].append(reg.total())
            self._saved[(stage, mb)] = reg
            return out

        def backward(stage, mb, inp, out, grad, split):
            kind = B if split else BW
            if cuda:
                res = self._timed_cuda(kind, stage, bwd, stage, mb, inp, out, grad, split)
            else:
                t0 = time.perf_counter()
                res = bwd(stage, mb, inp, out, grad, split)
                self.times[(stage, kind)].append(time.perf_counter() - t0)
            if not split:
                self._saved.pop((stage, mb), None)
            return res

        def weight(stage, mb):
            if cuda:
                m0 = torch.cuda.memory_allocated()
                res = self._timed_cuda(W, stage, wgt, stage, mb)
                self.mem_w[stage].append(max(0, m0 - torch.cuda.memory_allocated()))
                return res
            reg = self._saved.pop((stage, mb), None)
            if reg is off and off is not None:
                self.mem_w[stage].append(off.alive_bytes(stage, mb))
            elif reg is not None:  # what the F pass saved and is still alive after B
                self.mem_w[stage].append(reg.alive())
            t0 = time.perf_counter()
            res = wgt(stage, mb)
            self.times[(stage, W)].append(time.perf_counter() - t0)
            return res

        new_passes = dataclasses.replace(passes, forward=forward, backward=backward, weight=weight)
        return new_passes, (None if p2p is None else _TimedP2P(p2p, self, cuda))

    def _timed_cuda(self, kind, stage, fn, *args):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn(*args)
        e.record()
        self._events.append(("pass", stage, kind, s, e))
        return out

    def _record_wait(self, what: str, seconds: float = None, events=None) -> None:
        m = _WHAT.search(what or "")
        stage, kind = (int(m.group(2)), m.group(1)) if m else (-1, "?")
        if events is not None:
            self._events.append(("recv", stage, kind) + tuple(events))
        else:
            self.recv_wait[(stage, kind)].append(seconds)

    # -- end of an iteration / of the window ------------------------------------------------------
    def end_iteration(self, iteration: int, *, placement: Placement, num_microbatches: int, rank: int,
                      group=None, p2p=None, shape: Optional[Sequence[int]] = None,
                      dtype: torch.dtype = torch.float32, device=None,
                      schedule: Optional[str] = None) -> Optional[dict]:
        """Close one window iteration. At the window's last iteration: probe the hop time, gather
        every pipeline rank's samples (one ``all_gather_object`` over ``group``), build the profile,
        write it (pipeline rank 0 of the pipeline holding global rank 0) and return it."""
        if not self.in_window(iteration):
            return None
        if self._events:
            torch.cuda.synchronize()  # local device only, inside the window
            for what, stage, kind, s, e in self._events:
                secs = s.elapsed_time(e) / 1e3
                if what == "pass":
                    self.times[(stage, kind)].append(secs)
                else:
                    self.recv_wait[(stage, kind)].append(secs)
            self._events.clear()
        if self._t_iter is not None:
            self.iteration_s.append(time.perf_counter() - self._t_iter)
            self._t_iter = None
        self.iterations.append(iteration)
        self._saved.clear()
        if iteration < self.end:
            return None
        probe = self._probe_comm(p2p, placement, rank, shape, dtype, device) if p2p is not None and shape else []
        mine = self.rank_stats(rank, placement)
        mine["comm_probe"] = probe
        if group is not None or (dist.is_available() and dist.is_initialized()):
            n = dist.get_world_size(group) if group is not None else dist.get_world_size()
            everyone: List[Any] = [None] * n
            dist.all_gather_object(everyone, mine, group=group)
        else:
            everyone = [mine]
        profile = build_profile(everyone, schedule=schedule or self.schedule, placement=placement,
                                microbatches=num_microbatches, window=(self.start, self.end))
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
            "times": {k: {str(s): v for (s, kk), v in self.times.items() if kk == k} for k in (F, B, W, BW)},
            "mem_f": {str(s): v for s, v in self.mem_f.items()},
            "mem_w": {str(s): v for s, v in self.mem_w.items()},
            "recv_wait": {k: {str(s): v for (s, kk), v in self.recv_wait.items() if kk == k} for k in (F, B)},
            "iteration_s": list(self.iteration_s),
            "iterations": list(self.iterations),
            "offload": list(self.offload_stats),
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


class _TimedP2P:
    """A P2P stand-in whose receives record how long this rank waited for them."""

    def __init__(self, inner, prof: PassProfiler, cuda: bool):
        self._inner, self._prof, self._cuda = inner, prof, cuda

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def recv(self, shape, dtype, device, peer, what):
        t0 = time.perf_counter()  # with exchanged shapes recv() itself waits for the shape
        h = self._inner.recv(shape, dtype, device, peer, what)
        return _TimedPending(h, self._prof, what, time.perf_counter() - t0, self._cuda)


class _TimedPending:
    def __init__(self, inner, prof, what, posted_s, cuda):
        self._inner, self._prof, self._what, self._posted_s, self._cuda = inner, prof, what, posted_s, cuda

    def wait(self):
        if self._cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            buf = self._inner.wait()
            e.record()
            self._prof._record_wait(self._what, events=(s, e))
            return buf
        t0 = time.perf_counter()
        buf = self._inner.wait()
        self._prof._record_wait(self._what, seconds=self._posted_s + time.perf_counter() - t0)
        return buf

    def __getattr__(self, name):
        return getattr(self._inner, name)


# --------------------------------------------------------------------------------------------
# aggregation, JSON, conversion for the planner / simulator
# --------------------------------------------------------------------------------------------

def build_profile(rank_stats: Sequence[dict], *, schedule: Optional[str], placement: Placement,
                  microbatches: int, window: Tuple[int, int]) -> dict:
    """The profile from every pipeline rank's :meth:`PassProfiler.rank_stats` (pure function).

    Per chunk (global stage): the median of each pass kind. Per pipeline rank (the ``cost_*`` and
    ``mem_*`` lists, one value per rank as the simulator's settings want): the sum over the rank's
    chunks. Where a schedule ran only fused backwards (BW), B and W are each taken as half of BW
    (``backward_split`` says so). ``mem_w`` without a W pass: DEFAULT_MEM_W_RATIO x mem_f.
    """
    p = placement.num_ranks
    by_rank = {int(s["rank"]): s for s in rank_stats}
    missing = sorted(set(range(p)) - set(by_rank))
    if missing:
        raise ProfileError(f"no samples from pipeline rank(s) {missing}")
    per_chunk = []
    cost = {k: [0.0] * p for k in ("f", "b", "w", "bw")}
    has_bw = [False] * p
    mem_f, mem_w = [0.0] * p, [0.0] * p
    mem_w_known = [True] * p
    counts = {k: 0 for k in (F, B, W, BW, "recv_wait", "comm_probe")}
    split_sources = set()
    for r in range(p):
        st = by_rank[r]
        times = st.get("times", {})
        for s in placement.stages_of(r):
            key = str(s)
            med = {k: _median(times.get(k, {}).get(key, [])) for k in (F, B, W, BW)}
            n = {k: len(times.get(k, {}).get(key, [])) for k in (F, B, W, BW)}
            for k in n:
                counts[k] += n[k]
            f = med[F] or 0.0
            if med[B] is not None or med[W] is not None:
                b, w = med[B] or 0.0, med[W] or 0.0
                split_sources.add("measured")
            elif med[BW] is not None:
                b = w = med[BW] / 2
                split_sources.add("assumed")
            else:
                b = w = 0.0
            mf = _median(st.get("mem_f", {}).get(key, []))
            mw = _median(st.get("mem_w", {}).get(key, []))
            waits = st.get("recv_wait", {})
            wf, wb = waits.get(F, {}).get(key, []), waits.get(B, {}).get(key, [])
            counts["recv_wait"] += len(wf) + len(wb)
            cost["f"][r] += f
            cost["b"][r] += b
            cost["w"][r] += w
            if med[BW] is not None:
                cost["bw"][r] += med[BW]
                has_bw[r] = True
            mem_f[r] += mf or 0.0
            if mw is None:
                mem_w_known[r] = False
            else:
                mem_w[r] += mw
            per_chunk.append({
                "stage": s, "rank": r, "chunk": placement.chunk_of(s),
                "f": f, "b": med[B], "w": med[W], "bw": med[BW],
                "samples": n, "mem_f": mf, "mem_w": mw,
                "recv_wait_f": _median(wf), "recv_wait_b": _median(wb),
                "recv_wait_total_per_iter": (sum(wf) + sum(wb)) / max(1, len(st.get("iterations", [])) or 1),
            })
    if placement.replicated:  # a microbatch runs through one path's chunks: the average over paths
        k = placement.num_paths
        for lst in (cost["f"], cost["b"], cost["w"], cost["bw"], mem_f, mem_w):
            for r in range(p):
                lst[r] /= k
    for r in range(p):
        if not mem_w_known[r]:
            mem_w[r] = DEFAULT_MEM_W_RATIO * mem_f[r]
        mem_w[r] = min(mem_w[r], mem_f[r])
    probes = [x for r in range(p) for x in by_rank[r].get("comm_probe", [])]
    counts["comm_probe"] = len(probes)
    iters = [by_rank[r].get("iteration_s", []) for r in range(p)]
    per_iter = [max(xs) for xs in zip(*iters)] if all(iters) else []
    first = by_rank[0]
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "schedule": schedule,
        "pipeline_size": p,
        "stages": p,
        "chunks": placement.chunks,
        "microbatches": microbatches,
        "placement": placement.to_dict(),
        "window": [int(window[0]), int(window[1])],
        "iterations": len(first.get("iterations", [])),
        "device": first.get("device", "cpu"),
        "time_unit": "s",
        "cost_f": cost["f"],
        "cost_b": cost["b"],
        "cost_w": cost["w"],
        "cost_bw": cost["bw"] if any(has_bw) else None,
        "cost_comm": _median(probes) or 0.0,
        "cost_comm_source": "ping-pong probe (half the median round trip)" if probes else "not measured",
        "backward_split": ("assumed B = W = BW/2 (only fused backwards ran)" if split_sources == {"assumed"}
                           else "measured" if split_sources else "none"),
        "mem_unit": "bytes",
        "mem_f": mem_f,
        "mem_w": mem_w,
        "mem_w_source": "measured" if all(mem_w_known) else
                        f"DEFAULT_MEM_W_RATIO ({DEFAULT_MEM_W_RATIO}) x mem_f where no W pass ran",
        "mem_method": first.get("mem_method"),
        "p2p_wait_per_iter": [sum(sum(v) for k in (F, B) for v in by_rank[r].get("recv_wait", {}).get(k, {}).values())
                              / max(1, len(by_rank[r].get("iterations", []))) for r in range(p)],
        "iteration_s": _median(per_iter),
        "samples": counts,
        "per_chunk": per_chunk,
        **_offload_section(by_rank, p),
    }


def _offload_section(by_rank: Dict[int, dict], p: int) -> dict:
    """``offload``: per rank, the offload manager's counts over the window (peak resident
    activation bytes, bytes per F, offloaded and reloaded bytes, host buffer bytes); absent
    without offload."""
    if not any(by_rank[r].get("offload") for r in range(p)):
        return {}
    rows = []
    for r in range(p):
        its = by_rank[r].get("offload") or []
        rows.append({"rank": r, "iterations": len(its),
                     "peak_resident_bytes": max((x["peak_resident_bytes"] for x in its), default=0),
                     "captured_bytes_per_forward": its[-1]["captured_bytes_per_forward"] if its else 0,
                     "offloaded_bytes": its[-1]["offloaded_bytes"] if its else 0,
                     "reloaded_bytes": its[-1]["reloaded_bytes"] if its else 0,
                     "host_buffer_bytes": its[-1]["host_buffer_bytes"] if its else 0,
                     "host_allocations": [x["host_allocations"] for x in its]})
    return {"offload": rows}


def save_profile(profile: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


_REQUIRED = ("cost_f", "cost_b", "cost_w")


def load_profile(path: str) -> dict:
    """Read and check a profile JSON (this module's or any dict with per-stage cost lists)."""
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"cannot read profile {path!r}: {e}") from None
    _check(prof, path)
    return prof


def _check(prof, where="profile"):
    if not isinstance(prof, dict):
        raise ProfileError(f"{where}: a profile is a JSON object")
    for k in _REQUIRED:
        if k not in prof:
            raise ProfileError(f"{where}: no {k} (per-stage costs as written by the profiler)")
    lens = set()
    for k in _REQUIRED + ("mem_f", "mem_w"):
        v = prof.get(k)
        if v is None:
            continue
        vs = [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        if not isinstance(vs, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               and math.isfinite(x) and x >= 0 for x in vs):
            raise ProfileError(f"{where}: {k} must be a non-negative number or a list of them, got {v!r}")
        if isinstance(v, list):
            lens.add(len(v))
    if len(lens) > 1:
        raise ProfileError(f"{where}: per-stage lists have different lengths {sorted(lens)}")


def profile_to_setting_kwargs(profile: dict, normalize: bool = False) -> dict:
    """``cost_f/cost_b/cost_w`` (lists per stage), ``cost_comm``, ``mem_f``, ``mem_w`` for
    ``core.ir.Setting(stages, microbatches, **kwargs)``.

    Raw: seconds and bytes, as measured. ``normalize=True``: costs in units of the mean F cost per
    stage, memory in units of the largest stage's ``mem_f`` (so ``memory_limit`` keeps its meaning
    "activations of this many microbatches of one stage").
    """
    _check(profile)
    as_list = lambda v: [float(x) for x in (v if isinstance(v, list) else [v])]  # noqa: E731
    cf, cb, cw = (as_list(profile[k]) for k in _REQUIRED)
    comm = float(profile.get("cost_comm") or 0.0)
    out = {"cost_f": cf, "cost_b": cb, "cost_w": cw, "cost_comm": comm}
    mf = profile.get("mem_f")
    if mf is not None and sum(as_list(mf)) > 0:
        mf = as_list(mf)
        mw = as_list(profile["mem_w"]) if profile.get("mem_w") is not None else [DEFAULT_MEM_W_RATIO * x for x in mf]
        if len(mw) == 1 and len(mf) > 1:
            mw = mw * len(mf)
        if len(mf) == 1 and len(mw) > 1:
            mf = mf * len(mw)
        out["mem_f"], out["mem_w"] = mf, [min(a, b) for a, b in zip(mw, mf)]
    if normalize:
        unit = sum(cf) / len(cf) if sum(cf) > 0 else (sum(cf + cb + cw) / (3 * len(cf)) or 1.0)
        for k in ("cost_f", "cost_b", "cost_w"):
            out[k] = [x / unit for x in out[k]]
        out["cost_comm"] = comm / unit
        if "mem_f" in out:
            mu = max(out["mem_f"])
            out["mem_f"] = [x / mu for x in out["mem_f"]]
            out["mem_w"] = [x / mu for x in out["mem_w"]]
    return out
