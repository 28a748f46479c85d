"""One way to build a schedule: a request plus the pipeline size P and microbatch count M in, the
validated schedule, the setting it was built with and its lowered form out.

Every caller goes through ``build``: the command line (simulate, compare, plot, plan), the
training flags' start-up preview, the forward-backward function that training runs and the
verify harness. A build is a declared chain of links (``CHAIN``), each with one signature, a step in
and a step out: generate (or the offload search, ``core.passes.offload_search``, which chooses the
schedule it offloads), exact (the MILP), vocabulary (``core.passes.vocab_place``), offload
(``core.passes.offload``: a given schedule's, or one with vocabulary passes), pairs (MoE's
overlapped F&B, ``core.passes.pairing``), fuse (``core.passes.fuse``); then the schedule is validated. Each link says
whether it applies and what it cannot combine with (one line, asked of every link before any runs).
A new lever is one more link. The meaning of the ``'auto'`` offload options is written here too.

    req = ScheduleRequest("zb-v", cost_f=[43.8], cost_b=[59.2], cost_w=[32.0],
                          offload=OffloadRequest(ratio=0.5, time=0.5))
    built = build(req, 4, 8)
    built.schedule, built.setting, built.result.makespan, built.lowered()

Pure Python, no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

from . import schedules
from .ir import Schedule, ScheduleError, Setting
from .ir.vocab import VocabSetting
from .passes.fuse import fuse_adjacent
from .passes.offload import add_offload
from .passes.offload_search import generate_with_offload
from .passes.pairing import form_pairs
from .passes.vocab_place import placer, with_vocab
from .schedules.search.auto import check_effort
from .schedules.search.exact import AUTOMATIC, refine
from .sim.hostlink import OffloadOptions, has_offload
from .sim.lower import forward_only as forward_only_schedule
from .sim.lower import lower
from .sim.simulate import SimResult, simulate
from .sim.validate import validate

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
    # vocabulary parallelism (core.ir.vocab): the output layer and loss on every rank's shard, as
    # passes the core places into the schedule; costs above then leave the output layer out
    vocab: Optional[VocabSetting] = None
    # how hard the searched schedules look and how many ways the vocabulary passes are placed
    # (``schedules.search.auto.EFFORTS``): 'full' (what training builds) or 'quick' (plan's first pass
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
        """The simulation of one iteration (``core.sim.simulate``)."""
        if self._result is None:
            self._result = simulate(self.schedule, self.setting)
        return self._result

    def lowered(self, forward_only: bool = False) -> Schedule:
        """With SEND/RECV actions (``core.sim.lower``); ``forward_only``: the forwards alone, as
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


@dataclass(frozen=True)
class Step:
    """What flows through the chain: the request, the setting it is built for, the schedule so far
    (None before one is generated) and whether it was given (a loaded file: the links that make or
    remake a schedule leave it as it is)."""

    request: ScheduleRequest
    setting: Setting
    schedule: Optional[Schedule] = None
    given: bool = False

    def with_schedule(self, sched: Schedule) -> "Step":
        """This step with ``sched`` (the setting takes its chunks per rank)."""
        return dataclasses.replace(self, schedule=sched,
                                   setting=dataclasses.replace(self.setting, chunks=sched.placement.chunks))

    @property
    def own(self) -> Setting:
        """The setting of the pipeline's own passes (vocabulary passes are placed afterwards)."""
        return dataclasses.replace(self.setting, vocab=None)


def _never(step: Step) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Link:
    """One link of the build chain: ``applies(step)`` whether it runs, ``refuses(step)`` what it
    cannot combine with (one line; every link that applies is asked before any runs), ``run(step)``
    the step after it."""

    name: str
    applies: Callable[[Step], bool]
    run: Callable[[Step], Step]
    refuses: Callable[[Step], Optional[str]] = _never


def _generate(step: Step) -> Step:
    req, spec = step.request, step.request.spec
    if req.vocab is not None and spec.searched and req.exact is None:
        # the limits it searches compared with their vocabulary passes placed
        sched = spec.generate(step.own, effort=req.effort,
                              finish=placer(step.setting, step.setting.memory_limit, req.effort))
    else:
        sched = _generator(spec, req.effort)(step.own)
    return step.with_schedule(sched)


def _offload_search(step: Step) -> Step:
    options = step.request.offload.options(step.setting.memory_limit)
    return step.with_schedule(generate_with_offload(step.request.name, step.setting, options))


def _offload(step: Step) -> Step:
    options = step.request.offload.options(step.setting.memory_limit)
    return step.with_schedule(add_offload(step.schedule, step.setting, options))


def _offload_refuses(step: Step) -> Optional[str]:
    off, req, chunks = step.request.offload, step.request, step.setting.chunks
    if off.chunks is not None and off.chunks > chunks:
        return (f"offload of the first {off.chunks} model chunk(s) of each rank, but schedule {req.name} runs "
                f"{chunks} chunk(s) per rank (offload chunks 1..{chunks})")
    if not step.given and req.exact is not None and req.name in AUTOMATIC:
        return ("the exact mode solves schedules without activation offload (the MILP has no host link): leave out "
                "the offload ratio or the exact mode")
    return None


def _exact(step: Step) -> Step:
    node_limit, time_limit = step.request.exact
    return step.with_schedule(refine(step.schedule, step.own, node_limit=node_limit, time_limit=time_limit))


def _vocabulary(step: Step) -> Step:
    req = step.request
    sched = with_vocab(_generator(req.spec, req.effort), req.spec, step.schedule, step.own, step.setting, req.effort)
    return step.with_schedule(sched)


def _made(step: Step) -> bool:
    """The schedule is the core's own (not a given one)."""
    return not step.given


def _searches_offload(step: Step) -> bool:
    """Offload without vocabulary passes on a schedule still to generate: the offload search
    chooses the schedule it offloads (``core.passes.offload_search``); otherwise the offload link
    offloads the schedule it is given (vocabulary passes placed first: the policy times them)."""
    return step.request.offload is not None and step.request.vocab is None and step.schedule is None


#: the build chain, in order: a new lever is one more link
CHAIN: Tuple[Link, ...] = (
    Link("generate", lambda s: s.schedule is None and not _searches_offload(s), _generate),
    Link("offload search", _searches_offload, _offload_search, _offload_refuses),
    Link("exact", lambda s: _made(s) and s.request.exact is not None and s.request.name in AUTOMATIC
         and s.request.offload is None, _exact),
    Link("vocabulary", lambda s: _made(s) and s.request.vocab is not None, _vocabulary),
    Link("offload", lambda s: s.request.offload is not None and (s.given or s.request.vocab is not None), _offload,
         _offload_refuses),
    # MoE all-to-all overlap: the F&B pairs that shorten the iteration (none without)
    Link("pairs", _made, lambda s: s.with_schedule(form_pairs(s.schedule, s.setting))),
    # a split backward only where the schedule uses it: a back-to-back B;W fused where the split costs
    Link("fuse", _made, lambda s: s.with_schedule(fuse_adjacent(s.schedule, s.setting))),
)


def before(request: ScheduleRequest, p: int, m: int, name: str) -> Optional[Step]:
    """The step link ``name`` of the ``CHAIN`` would be given building ``request`` (the links
    before it run, no refusals asked), None where that link does not apply."""
    step = Step(request, request.setting(p, m, chunks=request.spec.resolve_chunks(request.chunks)))
    for link in CHAIN:
        if link.applies(step):
            if link.name == name:
                return step
            step = link.run(step)
    return None


def build(request: ScheduleRequest, p: int, m: int, *, enforce_limit: bool = True,
          base: Optional[Schedule] = None) -> Built:
    """Build ``request`` for ``p`` ranks and ``m`` microbatches (or from ``base``, e.g. a loaded
    schedule file) through the ``CHAIN`` (generate, offload, exact, vocabulary, pairs, fuse), then
    validate it.

    Raises ``ScheduleError`` naming what is wrong (a link's refusal before any link runs);
    ``OverMemoryLimit`` when the schedule peaks over ``request.memory_limit`` (with
    ``enforce_limit``; compare and plan report it instead)."""
    if base is not None:
        step = Step(request, request.setting(base.num_ranks, base.num_microbatches, chunks=base.placement.chunks),
                    base, given=True)
    else:
        step = Step(request, request.setting(p, m, chunks=request.spec.resolve_chunks(request.chunks)))
    links = [link for link in CHAIN if link.applies(step)]
    for link in links:
        why = link.refuses(step)
        if why:
            raise ScheduleError(why)
    for link in links:
        step = link.run(step)
    sched, setting = step.schedule, step.setting
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
