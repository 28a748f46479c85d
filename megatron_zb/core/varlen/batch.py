"""Variable-length batches end to end: one global batch's sequence lengths in, each data-parallel
replica's microbatches, their order and the schedule for them out, with the simulated iteration.

Two ways through a batch:

* **unbalanced** (``balanced=False``): Megatron's data path. The sequences go to the replicas and
  microbatches in the order they come (``core.varlen.balance.sequential``), every replica runs the same
  number of microbatches and the schedule built for equal microbatches (the *template*: with
  ``1f1b`` this is Megatron's 1F1B with sequential microbatches);
* **balanced**: the balancer (``core.varlen.balance``) spreads the sequences over the replicas (replicas
  may run different microbatch counts) and forms each one's microbatches; the microbatch order is
  the best of a few (by the template's simulated time); the schedule is the per-microbatch one
  (``core.varlen.mb_schedule.per_microbatch``: the template or a list schedule, whichever is shorter with
  each microbatch's own costs).

An iteration with Megatron's synchronous optimizer step ends when the slowest replica's last pass
does (the gradient reduction waits for it), plus the step: ``iteration_time``. Pure Python.

    cfg = VarlenConfig(replicas=4, model=LengthModel.simple(4096, attention=0.2))
    plan = plan_batch(lengths, ScheduleRequest("zb-v", cost_f=[43.8], ...), stages=8, config=cfg, balanced=True)
    plan.iteration_time, [r.microbatches for r in plan.replicas], plan.replicas[0].schedule
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .. import schedules
from ..build import ScheduleRequest, build
from ..costs.microbatch_costs import LengthModel, microbatch_shape
from ..ir import B, F, Schedule, ScheduleError, Setting, W
from .balance import microbatches as form_microbatches
from .balance import pipeline_estimate, sequential, split_replicas
from .mb_schedule import end_time, list_schedule, per_microbatch, plain, template_caps

__all__ = ["VarlenConfig", "ReplicaPlan", "BatchPlan", "Templates", "plan_batch", "ORDERS"]

#: the microbatch orders the balanced path tries (each replica keeps its best). Over 128 replica plans
#: of bench_varlen (P=8 D=4, 1f1b/zb-h1/zb-h2/zb-v, lognormal and ShareGPT lengths) 'pyramid' won 92,
#: 'ascending' 36; 'descending' (ODC's) and 'alternating' never: ``order`` still takes them
ORDERS = ("pyramid", "ascending")


@dataclass(frozen=True)
class VarlenConfig:
    """How a global batch becomes microbatches. ``replicas``: data-parallel size D. ``model``: the
    length cost model (its ``seq_length`` is the reference microbatch the request's costs are
    for). ``micro_batch_size``: sequences per microbatch in Megatron's path (and padded balanced
    microbatches). ``packed``: Megatron's packed-sequence format (THD; attention within each
    sequence) instead of rows padded to the longest. ``max_tokens``: tokens a packed balanced
    microbatch holds at most (default micro_batch_size x seq_length). ``activation_limit``: per rank,
    the most its activations may hold (the settings' memory unit, e.g. bytes: a GPU's memory less
    the model states); balanced replicas' schedules keep within it where they can."""

    replicas: int
    model: LengthModel
    micro_batch_size: int = 1
    packed: bool = False
    max_tokens: Optional[int] = None
    activation_limit: Optional[Tuple[float, ...]] = None

    def __post_init__(self):
        for name in ("replicas", "micro_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ScheduleError(f"{name.replace('_', ' ')} must be an integer >= 1, got {v!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ScheduleError(f"max tokens per microbatch must be an integer >= 1, got {self.max_tokens!r}")

    @property
    def token_budget(self) -> int:
        return self.max_tokens or self.micro_batch_size * self.model.seq_length


@dataclass
class ReplicaPlan:
    """One replica: its microbatches (indices into the global batch, in run order), their lengths,
    the schedule and the setting with each microbatch's costs, and its compute's end."""

    microbatches: List[List[int]]
    lengths: List[List[int]]
    schedule: Schedule
    setting: Setting
    end: float
    order: str = "given"

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)


@dataclass
class BatchPlan:
    balanced: bool
    schedule: str
    replicas: List[ReplicaPlan]
    cost_optimizer: float = 0.0
    plan_seconds: float = 0.0  # wall time this plan took (balancer + schedules)

    @property
    def iteration_time(self) -> float:
        """Synchronous optimizer step: the slowest replica's end, then the step."""
        return max(r.end for r in self.replicas) + self.cost_optimizer

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "balanced": self.balanced, "iteration_time": round(self.iteration_time, 10),
                "replica_ends": [round(r.end, 10) for r in self.replicas],
                "microbatches_per_replica": [r.num_microbatches for r in self.replicas],
                "tokens_per_replica": [sum(sum(mb) for mb in r.lengths) for r in self.replicas],
                "orders": [r.order for r in self.replicas], "plan_seconds": round(self.plan_seconds, 6)}


#: schedules whose generator searches (seconds at P=8): a balanced replica with another microbatch
#: count than the reference gets the list schedule under the reference's caps instead of a search
SEARCHED = ("zb-auto", "zb-v", "v-half", "v-min", "v-auto", "zeropp")


@dataclass
class Templates:
    """Schedules built for equal microbatches, per (schedule, M), reused across a batch's replicas
    and across batches; the reference template (Megatron's microbatch count) also gives the
    activation caps of the list schedules."""

    request: ScheduleRequest
    stages: int
    reference_m: int
    built: Dict[Tuple[str, int], Tuple[Schedule, Setting]] = field(default_factory=dict)
    cap_cache: Dict[str, List[float]] = field(default_factory=dict)

    def build(self, name: str, m: int) -> Tuple[Schedule, Setting]:
        key = (name, m)
        if key not in self.built:
            chunks = None if schedules.get(name).chunks is not None else self.request.chunks
            b = build(self.request.replace(name=name, chunks=chunks), self.stages, m, enforce_limit=False)
            self.built[key] = (b.schedule, b.setting)
        return self.built[key]

    def get(self, name: str, m: int) -> Optional[Tuple[Schedule, Setting]]:
        """The template for ``m`` microbatches, or None for a searched schedule at another count
        than the reference's (not worth a search per iteration)."""
        if name in SEARCHED and m != self.reference_m and (name, m) not in self.built:
            return None
        try:
            return self.build(name, m)
        except ScheduleError:  # e.g. a count the generator refuses: list scheduling may still place it
            return None

    def caps(self, name: str) -> List[float]:
        if name not in self.cap_cache:
            sched, st = self.build(name, self.reference_m)
            self.cap_cache[name] = template_caps(sched, st)
        return self.cap_cache[name]


def _stage_weights(setting: Setting, template: Schedule) -> Dict[str, float]:
    """Each kind's reference time on the busiest rank (whole stage)."""
    pl = template.placement
    return {k: max(setting.rank_values(n, pl)) for k, n in ((F, "cost_f"), (B, "cost_b"), (W, "cost_w"))}


def _ordered(lens: List[List[int]], cost: Sequence[float], how: str) -> List[int]:
    """A permutation of the microbatches: by cost descending / ascending, 'pyramid' (cheapest at
    both ends, dearest in the middle) or 'alternating' (dearest, cheapest, second dearest, ...)."""
    if how not in ORDERS + ("descending", "alternating"):
        raise ScheduleError(f"unknown microbatch order {how!r}; known: pyramid, ascending, descending, alternating")
    idx = sorted(range(len(lens)), key=lambda i: (cost[i], i))
    if how == "ascending":
        return idx
    if how == "descending":
        return idx[::-1]
    if how == "pyramid":
        front, back = [], []
        for n, i in enumerate(idx):
            (front if n % 2 == 0 else back).append(i)
        return front + back[::-1]
    if how == "alternating":
        out, lo, hi = [], 0, len(idx) - 1
        while lo <= hi:
            out.append(idx[hi])
            if lo != hi:
                out.append(idx[lo])
            lo, hi = lo + 1, hi - 1
        return out
    raise AssertionError(how)


def _with_costs(setting: Setting, model: LengthModel, lens: List[List[int]], packed: bool) -> Setting:
    return dataclasses.replace(setting, microbatches=len(lens), microbatch_costs=model.costs(lens, packed))


def plan_replica(name: str, templates: Templates, model: LengthModel, lens_by_mb: List[List[int]],
                 seq_by_mb: List[List[int]], packed: bool, balanced: bool,
                 limit: Optional[Sequence[float]] = None) -> ReplicaPlan:
    """One replica's plan for its microbatches (sequence lengths and indices, in the given order)."""
    m = len(lens_by_mb)
    ref, ref_setting = templates.build(name, templates.reference_m)
    base = dataclasses.replace(ref_setting, microbatches=m)
    if not balanced:
        template, base = templates.build(name, m)
        st = _with_costs(base, model, lens_by_mb, packed)
        return ReplicaPlan(seq_by_mb, lens_by_mb, template, st, end_time(template, st))
    got = templates.get(name, m)
    template = got[0] if got is not None else None
    # the template's activation peak with every microbatch the reference one -- or, where this replica holds
    # longer ones, as long as its longest (what Megatron's order needs for them): the list schedules' caps
    scale = max([1.0] + [microbatch_shape(ls, packed)[0] / model.seq_length for ls in lens_by_mb])
    caps = [c * scale for c in templates.caps(name)]
    if limit is not None:  # the memory there is (VarlenConfig.activation_limit)
        caps = [min(c, lim) for c, lim in zip(caps, limit)]
    split = ref.uses_split_backward()
    usable = plain(ref)
    if template is None and not usable:  # overlapped pairs, replicated stages: only the generator's own
        template, base = templates.build(name, m)

    def timed(st):  # (end, the list schedule behind it or None)
        if template is not None:
            return end_time(template, st), None
        sched, end = list_schedule(name, ref.placement, st, caps, split)
        return end, sched

    w = _stage_weights(base, ref)
    mb_cost = [sum(w[k] * model.factor(k, *microbatch_shape(ls, packed)) for k in w) for ls in lens_by_mb]
    best = None
    for how in ORDERS:
        perm = _ordered(lens_by_mb, mb_cost, how)
        st = _with_costs(base, model, [lens_by_mb[i] for i in perm], packed)
        try:
            t, found = timed(st)
        except ScheduleError:  # the caps stall this order
            continue
        if best is None or t < best[0] - 1e-9:
            best = (t, how, perm, st, found)
    known = None
    if best is None:  # list scheduling stalls in every order: the generator's own schedule (or its error)
        template, base = templates.build(name, m)
        perm, how = list(range(m)), "given"
        st = _with_costs(base, model, lens_by_mb, packed)
    else:
        t, how, perm, st, found = best
        known = (found, t) if found is not None else None
    sched, end = per_microbatch(st, caps, template=template, placement=ref.placement, split=split, name=name,
                                known=known)
    return ReplicaPlan([seq_by_mb[i] for i in perm], [lens_by_mb[i] for i in perm], sched, st, end, how)


def assign(lengths: Sequence[int], config: VarlenConfig, weights: Dict[str, float], stages: int,
           balanced: bool) -> List[List[List[int]]]:
    """Replica -> microbatch -> sequence indices: Megatron's sequential order, or the balancer's."""
    n, model = len(lengths), config.model
    if not balanced:
        return sequential(n, config.replicas, config.micro_batch_size)
    costs = [model.sequence_cost(s, weights) for s in lengths]
    # the pipeline's fill and drain: a sequence's F and B on the other P - 1 stages
    fb = {k: weights[k] for k in (F, B)}
    extra = [(stages - 1) * model.sequence_cost(s, fb) for s in lengths]
    parts = split_replicas(costs, config.replicas, extra)

    def mb_time(ls):
        return sum(weights[k] * model.factor(k, *microbatch_shape(ls, config.packed)) for k in weights)

    def estimate(mbs):
        lens = [[lengths[i] for i in mb] for mb in mbs]
        ramps = [sum(weights[k] * model.factor(k, *microbatch_shape(ls, config.packed)) for k in (F, B))
                 for ls in lens]
        return pipeline_estimate([mb_time(ls) for ls in lens], ramps, stages)

    return [form_microbatches(part, lengths, packed=config.packed, micro_batch_size=config.micro_batch_size,
                              max_tokens=config.token_budget, cost=mb_time, estimate=estimate)
            for part in parts]


def plan_batch(lengths: Sequence[int], request: ScheduleRequest, stages: int, config: VarlenConfig,
               balanced: bool, templates: Optional[Templates] = None, cost_optimizer: float = 0.0,
               replica: Optional[int] = None) -> BatchPlan:
    """Plan one global batch (module doc). ``templates``: reuse schedules across batches (must be
    for ``request`` and ``stages``). ``replica``: plan only that replica's schedule (a training
    rank needs its own; the others get their microbatches and a zero end)."""
    t0 = time.perf_counter()
    bad = [s for s in lengths if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if not lengths or bad:
        raise ScheduleError(f"sequence lengths must be integers >= 1, got {bad[0]!r}" if bad else
                            "a global batch needs at least one sequence")
    if request.offload is not None or request.vocab is not None:
        raise ScheduleError("variable-length batches with activation offload or vocabulary parallelism are not "
                            "supported by the schedule core yet: leave those out")
    name = request.name
    templates = templates or Templates(request, stages, max(1, len(lengths) // (config.replicas * config.micro_batch_size)))
    weights = _stage_weights(*reversed(templates.build(name, templates.reference_m)))
    groups = assign(lengths, config, weights, stages, balanced)
    plans = []
    for d, mbs in enumerate(groups):
        lens = [[lengths[i] for i in mb] for mb in mbs]
        if replica is not None and d != replica:
            plans.append(ReplicaPlan(mbs, lens, None, None, 0.0))
            continue
        plans.append(plan_replica(name, templates, config.model, lens, mbs, config.packed, balanced,
                                  config.activation_limit))
    return BatchPlan(balanced, name, plans, cost_optimizer, time.perf_counter() - t0)
