"""One way to build a schedule: a request plus the pipeline size P and microbatch count M in, the
validated schedule, the setting it was built with and its lowered form out.

Every caller goes through ``build``: the command line (simulate, compare, plot, plan), the
training flags' start-up preview, the forward-backward function that training runs and the
verify harness. So "generate, or generate with offload, or refine exactly, form the overlapped F&B
pairs an all-to-all cost asks for (``core.pairing``), then validate" and the
meaning of the ``'auto'`` offload options are written once, here.

    req = ScheduleRequest("zb-v", cost_f=[43.8], cost_b=[59.2], cost_w=[32.0],
                          offload=OffloadRequest(ratio=0.5, time=0.5))
    built = build(req, 4, 8)
    built.schedule, built.setting, built.result.makespan, built.lowered()

Pure Python, no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

from . import schedules
from .fuse import fuse_adjacent
from .hostlink import OffloadOptions, has_offload
from .ir import Schedule, ScheduleError, Setting
from .lower import forward_only as forward_only_schedule
from .lower import lower
from .offload import add_offload
from .offload_search import generate_with_offload
from .pairing import form_pairs
from .schedules.auto import check_effort
from .schedules.exact import AUTOMATIC, refine
from .simulate import SimResult, makespan_and_peak, simulate
from .validate import validate
from .vocab import VocabSetting
from .vocab_place import place_vocab

__all__ = ["OffloadRequest", "ScheduleRequest", "Built", "OverMemoryLimit", "build", "AUTO"]

#: the value of an offload option that is decided for the user: ratio 'auto' offloads as little as
#: fits the memory limit; time 'auto' is measured on the device at start-up (``with_time``)
AUTO = "auto"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x != float("inf")


@dataclass(frozen=True)
class OffloadRequest:
    """Activation offload (docs/offload.md) as a user asks for it.

    ``ratio``: a share 0..1 of each rank's activations, or ``'auto'`` (as little as fits the
    memory limit). ``time``: K, the one-way transfer of one stage activation takes K x (F + B)
    (one value, or one per stage), or ``'auto'``: measured at start-up, then ``with_time(K)``.
    ``overlap``: full duplex (a copy stream per direction). ``chunks``: offload only the first N
    model chunks of each rank. ``memory_limit``: the limit ``'auto'`` offloads under, where it is
    not the request's own (default: the request's)."""

    ratio: Union[float, str] = 1.0
    time: Union[float, Sequence[float], str] = 1.0
    overlap: bool = True
    chunks: Optional[int] = None
    memory_limit: Optional[float] = None

    def __post_init__(self):
        r = self.ratio
        if r != AUTO and not (_number(r) and 0.0 <= r <= 1.0):
            raise ScheduleError(f"offload ratio must be a number in 0..1 or 'auto', got {r!r}")
        t = self.time
        if isinstance(t, (list, tuple)):
            object.__setattr__(self, "time", tuple(t))
            if not t or any(not (_number(k) and k >= 0) for k in t):
                raise ScheduleError(f"offload time must be non-negative numbers or 'auto', got {list(t)!r}")
        elif t != AUTO and not (_number(t) and t >= 0):
            raise ScheduleError(f"offload time must be a number >= 0 or 'auto', got {t!r}")
        if self.chunks is not None and (not isinstance(self.chunks, int) or isinstance(self.chunks, bool)
                                        or self.chunks < 1):
            raise ScheduleError(f"offload chunk count must be an integer >= 1, got {self.chunks!r}")

    @property
    def time_measured(self) -> bool:
        """K is measured at start-up: nothing can be built before ``with_time``."""
        return self.time == AUTO

    def with_time(self, k) -> "OffloadRequest":
        return dataclasses.replace(self, time=k)

    def options(self, memory_limit: Optional[float]) -> OffloadOptions:
        """The offload model's options for a schedule built under ``memory_limit``."""
        if self.time_measured:
            raise ScheduleError("offload time 'auto' is measured on the device at start-up; the schedule is built "
                                "once it is known")
        limit = self.memory_limit if self.memory_limit is not None else memory_limit
        auto = self.ratio == AUTO
        if auto and limit is None:
            raise ScheduleError("offload ratio 'auto' offloads as little as fits the memory limit: give a memory limit")
        time = self.time if not isinstance(self.time, tuple) else (list(self.time) if len(self.time) > 1
                                                                   else self.time[0])
        return OffloadOptions(ratio=None if auto else float(self.ratio), time=time, overlap=self.overlap,
                              memory_limit=limit if auto else None, chunks=self.chunks)


@dataclass(frozen=True)
class ScheduleRequest:
    """What to build, before the pipeline size and microbatch count are known.

    ``name``: a registered schedule (``core.schedules.names()``). ``chunks``: model chunks per
    rank for the schedules that take it (None: the schedule's own). Costs and memory as in
    ``ir.Setting`` (per whole stage; one value or one per stage). ``memory_limit``: per rank, in
    mem-f units (the searched schedules search under it; ``build`` refuses a schedule over it).
    ``exact``: (node limit, seconds or None) to also solve the automatic schedules as a MILP."""

    name: str
    chunks: Optional[int] = None
    cost_f: Sequence[float] = (1.0,)
    cost_b: Sequence[float] = (1.0,)
    cost_w: Sequence[float] = (1.0,)
    cost_bw: Optional[Sequence[float]] = None  # the fused backward's time where it is not B + W
    cost_comm: float = 0.0
    cost_sync: float = 0.0
    cost_a2a: Sequence[float] = (0.0,)
    a2a_overlap: bool = True
    mem_f: Sequence[float] = (1.0,)
    mem_w: Optional[Sequence[float]] = None
    memory_limit: Optional[float] = None
    offload: Optional[OffloadRequest] = None
    exact: Optional[Tuple[int, Optional[float]]] = None
    # vocabulary parallelism (core.vocab): the output layer and loss on every rank's shard, as
    # passes the core places into the schedule; costs above then leave the output layer out
    vocab: Optional[VocabSetting] = None
    # how hard the searched schedules look and how many ways the vocabulary passes are placed
    # (``schedules.auto.EFFORTS``): 'full' (what training builds) or 'quick' (plan's first pass
    # over its rows)
    effort: str = "full"

    def __post_init__(self):
        check_effort(self.effort)

    @property
    def spec(self) -> schedules.ScheduleSpec:
        return schedules.get(self.name)

    def replace(self, **changes) -> "ScheduleRequest":
        return dataclasses.replace(self, **changes)

    def setting(self, p: int, m: int, chunks: Optional[int] = None) -> Setting:
        """The setting for P ranks and M microbatches (``chunks``: as the schedule resolves them)."""
        return Setting(p, m, chunks=self.chunks if chunks is None else chunks, cost_f=_seq(self.cost_f),
                       cost_b=_seq(self.cost_b), cost_w=_seq(self.cost_w), cost_comm=self.cost_comm,
                       cost_bw=None if self.cost_bw is None else _seq(self.cost_bw),
                       mem_f=_seq(self.mem_f), mem_w=None if self.mem_w is None else _seq(self.mem_w),
                       memory_limit=self.memory_limit, cost_sync=self.cost_sync, cost_a2a=_seq(self.cost_a2a),
                       a2a_overlap=self.a2a_overlap, vocab=self.vocab)


def _seq(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


class OverMemoryLimit(ScheduleError):
    """Schedule ``schedule``'s activation memory peaks over the request's limit on ``rank``. The
    message is the validator's (rank, position, pass); callers may word their own from the fields."""

    def __init__(self, message: str, schedule: str, rank: int, peak: float, limit: float, offloaded: bool):
        super().__init__(message)
        self.schedule, self.rank, self.peak, self.limit, self.offloaded = schedule, rank, peak, limit, offloaded


@dataclass
class Built:
    """A validated schedule and the setting it was built with (chunks: the schedule's own)."""

    request: ScheduleRequest
    schedule: Schedule
    setting: Setting
    _lowered: Dict[bool, Schedule] = field(default_factory=dict, repr=False)
    _result: Optional[SimResult] = field(default=None, repr=False)

    @property
    def result(self) -> SimResult:
        """The simulation of one iteration (``core.simulate``)."""
        if self._result is None:
            self._result = simulate(self.schedule, self.setting)
        return self._result

    def lowered(self, forward_only: bool = False) -> Schedule:
        """With SEND/RECV actions (``core.lower``); ``forward_only``: the forwards alone, as
        evaluation runs them."""
        if forward_only not in self._lowered:
            sched = forward_only_schedule(self.schedule) if forward_only else self.schedule
            # the validation's simulation of the schedule orders its messages (not run again)
            self._lowered[forward_only] = lower(sched, self.setting, None if forward_only else self._result)
        return self._lowered[forward_only]


def _generator(spec: schedules.ScheduleSpec, effort: str):
    """``spec``'s generator at search ``effort`` (the schedules that search take one)."""
    if effort == "full" or not spec.effort:
        return spec.generate
    return lambda setting: spec.generate(setting, effort=effort)


def _placer(st: Setting, limit: Optional[float], effort: str):
    """zb-auto's and v-auto's ``finish``: a schedule with its vocabulary passes placed, and its
    (makespan, -, peak)."""
    def finish(s: Schedule):
        placed = place_vocab(s, st, memory_limit=limit, effort=effort)
        makespan, top = makespan_and_peak(placed, st)
        return placed, (makespan, 0.0, top)
    return finish


def _with_vocab(generate, spec, sched: Schedule, base: Setting, setting: Setting, effort: str = "full") -> Schedule:
    """The vocabulary passes placed into ``sched`` (``core.vocab.place_vocab``, at ``effort``; where
    it has them already, as zb-auto and v-auto place them at each limit they search: ``_placer``).
    A search chose ``sched`` among its candidates without the vocabulary passes, so the passes also
    go into a few others it builds (``_vocab_alternatives``): the fastest placed (then the least
    peak), within the memory limit where any is. A searched schedule whose passes then peak over the
    memory limit is searched again under a limit lowered by what they add (the vocabulary
    activations and the backwards they delay), until it fits."""
    st = dataclasses.replace(setting, chunks=sched.placement.chunks)
    limit = setting.memory_limit
    out, best, peak = None, None, None
    for cand in [sched] + _vocab_alternatives(spec, base, effort):
        placed = cand if any(a.is_vocab for o in cand.orders for a in o) else \
            place_vocab(cand, st, memory_limit=limit, effort=effort)
        makespan, top = makespan_and_peak(placed, st)  # (top: simulate's highest peak)
        key = (limit is not None and top > limit + 1e-9, round(makespan, 9), round(top, 9))
        if best is None or key < best:
            out, best, peak = placed, key, top
    out = dataclasses.replace(out, name=sched.name)
    if limit is None or not spec.searched:
        return out
    # no schedule holds less than one microbatch's activations of its fullest rank (a rank's B waits
    # for its F's, a V rank's for both chunks'): a search under less fails (after seconds of looking
    # for the least memory that works)
    floor = st.stage_peak_unit(sched.placement)
    for step in range(1, 5):
        if peak <= limit + 1e-9:
            break
        lower = limit - (peak - limit) * step
        if lower < floor - 1e-9:
            break
        try:
            again = place_vocab(generate(dataclasses.replace(base, memory_limit=lower)), st, memory_limit=limit,
                                effort=effort)
        except ScheduleError:
            break
        p2 = max(simulate(again, st).peak_memory)
        if p2 < peak:
            out, peak = again, p2
    return out


def _vocab_alternatives(spec: schedules.ScheduleSpec, base: Setting, effort: str):
    """Schedules a search builds besides the one it returns that may take the vocabulary passes
    better: the full search's quick one (the V family, zb-auto), zb-auto's hand-crafted ZB-H1 and
    ZB-H2 (zb-auto and v-auto also place the passes at each limit they search, 1F1B's peak
    among them, ``_placer``). Without them v-auto with vocabulary parallelism was up to 15% slower
    than zb-v with it, zb-auto 18% slower than zb-h2 (plan's rows for Llama-3-8B at P=8 and
    Qwen2.5-7B at P=4)."""
    out = []
    if not spec.effort:
        return out
    if effort == "full":
        out.append(spec.generate(base, effort="quick"))
    if spec.name == "zb-auto":
        from .schedules.zb_handcrafted import zb_h1, zb_h2
        for f in (zb_h1, zb_h2):
            try:
                out.append(f(dataclasses.replace(base, chunks=1)))
            except ScheduleError:
                pass
    return out


def build(request: ScheduleRequest, p: int, m: int, *, enforce_limit: bool = True,
          base: Optional[Schedule] = None) -> Built:
    """Generate ``request`` for ``p`` ranks and ``m`` microbatches (or take ``base``, e.g. a
    loaded schedule file), add its activation offload, refine it exactly if asked, validate it.

    Raises ``ScheduleError`` naming what is wrong; ``OverMemoryLimit`` when the schedule peaks over
    ``request.memory_limit`` (with ``enforce_limit``; compare and plan report it instead)."""
    if base is not None:
        setting = request.setting(base.num_ranks, base.num_microbatches, chunks=base.placement.chunks)
        sched = base
        if request.offload is not None:
            sched = add_offload(base, setting, request.offload.options(setting.memory_limit))
    else:
        spec = request.spec
        setting = request.setting(p, m, chunks=spec.resolve_chunks(request.chunks))
        off = request.offload
        if request.vocab is not None and off is not None:
            raise ScheduleError("vocabulary parallelism and activation offload together are not supported yet: "
                                "leave out one of them")
        if off is not None and off.chunks is not None and off.chunks > setting.chunks:
            raise ScheduleError(f"offload of the first {off.chunks} model chunk(s) of each rank, but schedule "
                                f"{request.name} runs {setting.chunks} chunk(s) per rank (offload chunks "
                                f"1..{setting.chunks})")
        if off is not None:
            if request.exact is not None and request.name in AUTOMATIC:
                raise ScheduleError("the exact mode solves schedules without activation offload (the MILP has no "
                                    "host link): leave out the offload ratio or the exact mode")
            sched = generate_with_offload(request.name, setting, request.offload.options(setting.memory_limit))
        else:
            own = dataclasses.replace(setting, vocab=None)  # the pipeline's own passes first
            generate = _generator(spec, request.effort)
            if request.vocab is not None and spec.searched and request.exact is None:
                # the limits it searches compared with their vocabulary passes placed
                sched = spec.generate(own, effort=request.effort,
                                      finish=_placer(setting, setting.memory_limit, request.effort))
            else:
                sched = generate(own)
            if request.exact is not None and request.name in AUTOMATIC:
                sched = refine(sched, own, node_limit=request.exact[0], time_limit=request.exact[1])
            if request.vocab is not None:
                sched = _with_vocab(generate, spec, sched, own, setting, request.effort)
    setting = dataclasses.replace(setting, chunks=sched.placement.chunks)
    if base is None:  # MoE all-to-all overlap: the F&B pairs that shorten the iteration (none without)
        sched = form_pairs(sched, setting)
        # a split backward only where the schedule uses it: back-to-back B;W fused where the split costs
        sched = fuse_adjacent(sched, setting)
    result = validate(sched, setting, memory_limit=float("inf"))
    built = Built(request, sched, setting, _result=result)
    limit = setting.memory_limit
    if enforce_limit and limit is not None and max(result.peak_memory) > limit + 1e-9:
        peak = max(result.peak_memory)
        try:
            validate(sched, setting)
            message = f"activation memory peaks at {peak:g}, over the limit {limit:g}"
        except ScheduleError as e:
            message = str(e)
        raise OverMemoryLimit(message, sched.name, result.peak_memory.index(peak), peak, limit, has_offload(sched))
    return built
