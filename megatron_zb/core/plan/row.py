"""One schedule's row of `megatron-zb plan`: its layout, each chunk's costs, the schedule built with
them, its time per iteration and memory per rank, and the flags to paste. Pure Python.

The layout: the user's (``--pipeline-model-parallel-layout``), or the best of the even split and
the balanced one (``core.costs.layout_search``: every rank carrying equal work, the embedding and the
output layer + loss counted where they sit), by fitting first, then time per iteration. With a
profile, the costs are what it measured (per rank or per chunk) and the layout is the one it ran.
A layout that cannot be the one kept is not built: the one with the least busiest-rank work first,
then another only where its lower bound on the iteration time (``schedules.search.bounds``) leaves it a
chance against the rows built so far (the same row as building every layout, sooner).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import List, Optional

from ..build import AUTO, Built, OffloadRequest, ScheduleRequest, before, build
from ..costs.chunk_costs import chunk_costs, in_seconds, unit_costs
from ..costs.layout import Layout, from_counts, parse
from ..costs.layout_search import balanced, even_counts
from ..costs.model import ModelSpec, layer_split
from ..ir import OVERLAP, B, Placement, ScheduleError, Setting, W
from ..passes.fuse import split_cost
from ..passes.offload_floor import offload_floor
from ..schedules import ScheduleSpec, get
from ..schedules.search.auto import TIE
from ..schedules.search.bounds import lower_bound
from ..sim.iteration import iteration_times
from .request import CHUNK_CHOICES, OffloadLever, PlanRequest

__all__ = ["placement_for", "candidate_layouts", "row", "profile_costs", "load_profile"]


def placement_for(style: str, p: int, v: int) -> Placement:
    if style == "v":
        return Placement.vshape(p)
    if style == "bitpipe":
        return Placement.bitpipe(p)
    return Placement.looped(p, v)


def candidate_layouts(spec: ModelSpec, pl: Placement, pad_ends: bool, layout: Optional[Layout],
                      search: bool, vocab: bool = False) -> List[Layout]:
    """The layouts a row tries: the user's alone; else the even split (with ``pad_ends``: the first
    and last chunk one layer less) and, with ``search``, the balanced one."""
    S = pl.num_logical_stages
    if layout is not None:
        layout.check(num_layers=spec.num_layers, mtp_layers=spec.mtp_num_layers, num_stages=S)
        return [layout]
    if pad_ends:
        even = layer_split(spec.num_layers, S, pad_ends=True)
    else:
        even = even_counts(spec.num_layers, S)
    out = [from_counts(even, spec.mtp_num_layers)]
    if search:
        work = [sum(spec.layer_flops(i)) for i in range(spec.num_layers)]
        first = sum(spec.embedding_flops())
        last = (0.0 if vocab else sum(spec.output_flops()) * (1 + spec.mtp_num_layers)) + \
            spec.mtp_num_layers * sum(spec.mtp_layer_flops(with_output=False))
        for lay in balanced(work, pl, first, last, spec.mtp_num_layers, keep=1, starts=[even]):
            if lay.stages not in [x.stages for x in out]:
                out.append(lay)
    return out


@dataclass(frozen=True)
class _Row:
    """What every layout of one row shares: the request, the schedule (``sp``, ``chunks`` per
    rank, its placement ``pl``), the vocabulary barriers (None: without vocabulary parallelism),
    the search ``effort`` and whether a searched schedule's limit is ``tighten``-ed."""

    request: PlanRequest
    sp: ScheduleSpec
    chunks: int
    pl: Placement
    vocab: Optional[int]
    effort: str
    tighten: bool
    fit_only: bool = False


def row(name: str, vocab: Optional[int], request: PlanRequest, effort: str = "full", tighten: bool = True,
        fit_only: bool = False) -> dict:
    """Schedule ``name``'s best row over the candidate layouts (fits first, then ``request.ranked_by``),
    or {schedule, error}. ``vocab``: with vocabulary parallelism, that many barriers (``core.ir.vocab``;
    ``request.vocab.embedding``: the input embedding split over the ranks too). ``effort``: how hard
    the searched schedules look (``schedules.search.auto.EFFORTS``; the row says which in
    ``search_effort``). ``tighten``: a searched schedule's memory limit is its peak where the
    schedule built under that is as fast (else, and without ``tighten``, the budget's room: a
    search more). ``fit_only``: a row wanted only where it fits (a lever's variant,
    ``levers.fit_rows``): one that offload 'auto' provably cannot bring under the budget is an
    error row, not built (``_cannot_fit``)."""
    spec, p, m, profile = request.model, request.pipeline_parallel_size, request.microbatches, request.profile
    layout = parse(request.layout, p) if request.layout is not None else None
    ranked_by, flops_per_s = request.ranked_by, request.flops_per_s
    sp = get(name)
    if sp.chunks is None and request.interleave_chunks is None:  # an interleaved schedule: its chunks too
        return _best_chunks(name, vocab, request, effort, tighten, fit_only, layout)
    try:
        v = sp.resolve_chunks(request.interleave_chunks if sp.chunks is None else None)
        pl = placement_for(sp.placement, p, v)
    except ScheduleError as e:  # a schedule that cannot run this setting gets its row with the reason
        return {"schedule": name, "error": str(e)}
    S = pl.num_logical_stages
    if layout is None and S > spec.num_layers + 2:
        return {"schedule": name, "error": f"{spec.num_layers} layers < {S} model chunks"}
    if vocab is not None and (pl.replicated or profile is not None):
        return {"schedule": name, "vocab_parallel": vocab,
                "error": "vocabulary parallelism: not with replicated stages (bitpipe)" if pl.replicated
                else "vocabulary parallelism: plan's profile rows do not model it"}
    try:
        layouts = candidate_layouts(spec, pl, request.pad_ends, layout, request.layout_search and profile is None,
                                    vocab is not None)
    except ScheduleError as e:
        return {"schedule": name, "error": str(e)}
    ctx = _Row(request, sp, v, pl, vocab, effort, tighten, fit_only)

    def one(k: int) -> dict:
        return _one(ctx, layouts[k], request.pad_ends and layout is None and k == 0)

    # A layout whose lower bound (no schedule's iteration is shorter) lies above a fitting row's
    # time by more than TIE cannot be the one kept below: it is not built (the same row, sooner)
    bound = _Bounds(spec, layouts, pl, m, flops_per_s, vocab_work(spec, p, flops_per_s, vocab, request.vocab.gbps)) \
        if len(layouts) > 1 and request.offload is None and profile is None and not pl.replicated else None
    done = {}
    if bound is not None and len(layouts) == 2 and bound.busy(1) < bound.busy(0):
        # the second looks better: built first, the first only where it could still be kept
        r = done[1] = one(1)
        if "error" not in r and r["fits"] and bound.above(0, r[ranked_by] / (1 - TIE)):
            return r
    best, first_error = None, None
    for k in range(len(layouts)):
        if k not in done and best is not None and best["fits"] and bound is not None \
                and bound.above(k, best[ranked_by] * (1 - TIE)):
            continue  # it could only replace ``best`` by being faster than its bound allows
        r = done[k] if k in done else one(k)
        if "error" in r:
            first_error = first_error or r
            continue
        if _better(r, best, ranked_by):
            best = r
    return best if best is not None else first_error


def _best_chunks(name: str, vocab: Optional[int], request: PlanRequest, effort: str, tighten: bool,
                 fit_only: bool, layout: Optional[Layout]) -> dict:
    """An interleaved schedule's row: the best (fits first, then time; of equally fast ones the fewer
    chunks) of its rows with each count of model chunks per rank it can take: ``CHUNK_CHOICES`` whose
    chunks the layers fill; the user's layout's own count; with a profile, the first (its run's)."""
    p, key = request.pipeline_parallel_size, request.ranked_by
    if layout is not None:
        counts = [max(2, layout.num_stages // p)]  # (a count that does not divide: the row says why)
    elif request.profile is not None:
        counts = [CHUNK_CHOICES[0]]
    else:
        counts = [v for v in CHUNK_CHOICES if p * v <= request.model.num_layers + 2] or [CHUNK_CHOICES[0]]
    best, first_error = None, None
    for v in counts:
        r = row(name, vocab, request.replace(interleave_chunks=v), effort, tighten, fit_only)
        if "error" in r:
            first_error = first_error or r
        elif _better(r, best, key):
            best = r
    return best if best is not None else first_error


def _better(r: dict, best: Optional[dict], key: str) -> bool:
    """Whether row ``r`` replaces ``best`` (None: none yet): it fits where ``best`` does not, or it is
    faster by more than ``TIE`` (of equally fast ones the first built stays)."""
    return best is None or (not r["fits"], r[key]) < (not best["fits"], best[key] * (1 - TIE))


class _Bounds:
    """Lower bounds on the iteration time of any schedule of each layout (seconds): the busiest
    rank's work, and where that is not enough, ``bounds.lower_bound`` (iteration times with or
    without post-validation are at least the makespan). None where the costs cannot be had, or a
    layout's all-to-all could hide in overlapped F&B pairs (not bounded by pass costs)."""

    def __init__(self, spec: ModelSpec, layouts: List[Layout], pl: Placement, m: int, flops_per_s: float,
                 vocab: Optional[List[float]] = None):
        self.pl, self.m, self.vocab = pl, m, vocab
        self.settings: List[Optional[Setting]] = []
        for lay in layouts:
            try:
                cc = chunk_costs(spec, lay, pl, flops_per_s, 0.0, vocab=vocab is not None)
                st = Setting(pl.num_ranks, m, chunks=pl.chunks, cost_f=cc.cost_f, cost_b=cc.cost_b, cost_w=cc.cost_w)
            except ScheduleError:
                st = None
            self.settings.append(None if st is None or any(spec.layer_a2a_bytes(i) for i in range(spec.num_layers))
                                 else st)
        self.full: dict = {}

    def busy(self, k: int) -> float:
        st = self.settings[k]
        if st is None:
            return 0.0
        work = [sum(x) for x in zip(*(st.rank_values(n, self.pl) for n in ("cost_f", "cost_b", "cost_w")))]
        if self.vocab is not None:  # and each rank's vocabulary passes
            work = [w + v for w, v in zip(work, self.vocab)]
        return self.m * max(work)

    def above(self, k: int, t: float) -> bool:
        """Whether every schedule of layout k takes longer than ``t``."""
        if self.settings[k] is None:
            return False
        if self.busy(k) > t * (1 + 1e-9):
            return True
        if self.vocab is not None:  # ``lower_bound`` knows no vocabulary passes: the busiest rank alone
            return False
        if k not in self.full:
            self.full[k] = lower_bound(self.settings[k], self.pl, None)
        return self.full[k] > t * (1 + 1e-9)


def vocab_work(spec: ModelSpec, p: int, flops_per_s: float, barriers: Optional[int], gbps: float) \
        -> Optional[List[float]]:
    """Per rank, one microbatch's VS + VT + VW seconds with vocabulary parallelism (None without)."""
    if barriers is None:
        return None
    from ..costs.chunk_costs import vocab_setting
    vs = vocab_setting(spec, p, flops_per_s, gbps * 1e9, barriers)
    return [sum(vs.cost(k, r) for k in ("VS", "VT", "VW")) for r in range(p)]


def _one(ctx: _Row, lay: Layout, padded: bool) -> dict:
    """The row of one layout ``lay`` (``padded``: the even split with ``pad_ends``)."""
    asked = ctx.request
    sp, v, pl, effort, tighten, barriers = ctx.sp, ctx.chunks, ctx.pl, ctx.effort, ctx.tighten, ctx.vocab
    spec, p, m, profile = asked.model, asked.pipeline_parallel_size, asked.microbatches, asked.profile
    budget, flops_per_s, cost_optimizer = asked.budget_bytes, asked.flops_per_s, asked.cost_optimizer
    ranked_by, offload, ep_gbps, vocab_gbps = asked.ranked_by, asked.offload, asked.moe.ep_gbps, asked.vocab.gbps
    split = asked.vocab.embedding and barriers is not None
    name = sp.name
    try:
        cc = chunk_costs(spec, lay, pl, flops_per_s, ep_gbps * 1e9, vocab=barriers is not None, vocab_embedding=split)
    except ScheduleError as e:
        return {"schedule": name, "error": str(e)}
    cf, cb, cw, ca, mf, mw = cc.cost_f, cc.cost_b, cc.cost_w, cc.cost_a2a, cc.mem_f, cc.mem_w
    cbw = cc.cost_bw if spec.split_overhead_s else None  # the fused backward, where the split costs
    states = [spec.state_bytes(x) for x in cc.params]
    comm = 0.0
    if profile is not None:
        measured = profile_costs(profile, p, len(cf))
        cf, cb, cw, cbw = measured["cost_f"], measured["cost_b"], measured["cost_w"], measured.get("cost_bw")
        comm = measured.get("cost_comm", 0.0)
        ca = measured.get("cost_a2a", [0.0])
        if measured.get("mem_f"):
            mf, mw = measured["mem_f"], measured["mem_w"]
    rank_mf = _rank_sum(mf, pl, p)
    unit = max(rank_mf)  # simulate in units of the largest whole-stage activation of a rank
    act_budget = [max(0.0, budget - states[r]) for r in range(p)]
    limit_units = min(act_budget) / unit if unit > 0 else None
    if sp.searched and limit_units is not None and limit_units < 1 - 1e-9 and offload is None:
        # no schedule holds less than one microbatch's activations of a rank (a B waits for its F's,
        # on a V rank for both chunks'), and the search's limit is the least room of any rank: its
        # search for the least memory that works (seconds at P=16) would only say so
        r = min(range(p), key=lambda i: (act_budget[i], -states[i]))
        gib = 1024 ** 3
        if act_budget[r] <= 0:
            why = f"rank {r}'s model states take {states[r] / gib:.1f} GiB of its {budget / gib:g} GiB"
        else:
            why = (f"{act_budget[r] / gib:.1f} GiB left beside rank {r}'s model states, one microbatch's activations "
                   f"take {unit / gib:.1f} GiB on rank {rank_mf.index(unit)}")
        return {"schedule": name, "error": f"no room for activations under --gpu-memory-gb: {why}"}
    # the row's schedule is built as training builds it from the row's flags: from a model, in the
    # units training plans with (``unit_costs``: the busiest rank's F, the fullest rank's activation;
    # the searches round and compare in those units), its memory limit the flag's two decimals;
    # its times then in seconds (``sec`` per unit). From a profile: its seconds
    sec, vs = 1.0, None
    rf, rb, rw, rbw, rmf, rmw = cf, cb, cw, cbw, [x / unit for x in mf], [x / unit for x in mw]
    if profile is None:
        try:
            uc = unit_costs(spec, lay, pl, barriers, split, flops_per_s, vocab_gbps * 1e9)
        except ScheduleError as e:
            return {"schedule": name, "error": str(e)}
        sec, vs = uc.seconds(flops_per_s), uc.vocab
        rf, rb, rw, rbw, rmf, rmw = uc.cost_f, uc.cost_b, uc.cost_w, uc.cost_bw, uc.mem_f, uc.mem_w
    if sp.searched and limit_units:
        limit_units = math.floor(limit_units * 100 + 1e-6) / 100  # as the flag gives it
    try:
        req = ScheduleRequest(name, chunks=v if sp.chunks is None else None, cost_f=rf, cost_b=rb, cost_w=rw,
                              cost_bw=rbw, vocab=vs,
                              cost_comm=comm / sec, cost_a2a=[x / sec for x in ca], a2a_overlap=asked.moe.overlap,
                              mem_f=rmf, mem_w=rmw, memory_limit=limit_units if sp.searched else None,
                              exact=asked.exact, offload=_offload_request(offload, rank_mf, _rank_sum(cf, pl, p),
                                                                         _rank_sum(cb, pl, p), limit_units),
                              effort=effort)
        if ctx.fit_only and _cannot_fit(req, p, m, unit, states, budget):
            return {"schedule": name, "error": "offload cannot bring it under the memory budget"}
        built = build(req, p, m, enforce_limit=False)
        it = iteration_times(built.schedule, built.setting, cost_optimizer / sec)
        if sp.searched and limit_units and req.offload is None and tighten:
            # the flag asks for what the schedule needs (its peak), not for the GPU's room: the
            # schedule the run builds under that limit (at the row's effort), where it is as fast
            # (``TIE``)
            need = needed_limit(max(built.result.peak_memory))
            if need < limit_units:
                tight = build(req.replace(memory_limit=need), p, m, enforce_limit=False)
                it2 = iteration_times(tight.schedule, tight.setting, cost_optimizer / sec)
                if getattr(it2, ranked_by[:-2]) <= getattr(it, ranked_by[:-2]) * (1 + TIE):
                    built, it, limit_units = tight, it2, need
        sched, res = built.schedule, built.result
    except ScheduleError as e:
        return {"schedule": name, "error": str(e)}
    act_bytes = [x * unit for x in res.peak_memory]
    total = [a + s for a, s in zip(act_bytes, states)]
    searched_limit = math.floor(limit_units * 100 + 1e-6) / 100 if sp.searched and limit_units else None
    out = {"schedule": name, "chunks": v, "makespan_s": res.makespan * sec, "bubble_rate": res.bubble_rate,
           "iteration_time_s": it.iteration_time * sec,
           "iteration_time_post_validated_s": it.iteration_time_post_validated * sec,
           "ranked_by": ranked_by,
           "activation_bytes": act_bytes, "state_bytes": states, "peak_bytes": total,
           "fits": max(total) <= budget, "layers_per_stage": lay.layers(), "layout": str(lay),
           "chunk_cost_s": [f + b + w for f, b, w in zip(cf, cb, cw)],
           "activation_unit_bytes": unit,  # one microbatch's activation on the fullest rank
           "memory_limit_microbatches": searched_limit,
           "weight_copies": res.weight_copies or [1.0] * p,
           "flags": _flags(sp, p, searched_limit, lay, padded, profile is not None)}
    if rbw is not None:  # what the split backward costs the row (its passes as the schedule runs them)
        out["split_cost_s"] = split_cost(sched, built.setting) * sec
        out["fused_backwards"] = sched.meta.get("fused_backwards", 0)
        if sp.split_backward and profile is None:  # training models the same overhead: the same schedule
            out["flags"] += f" --zero-bubble-split-overhead-ms {1e3 * spec.split_overhead_s:g}"
    if (sp.effort or barriers is not None) and offload is None:  # the effort changed the row
        out["search_effort"] = effort
        if effort != "full":  # training builds the row's own schedule
            out["flags"] += f" --zero-bubble-search-effort {effort}"
    if barriers is not None:
        out["vocab_parallel"] = barriers
        out["flags"] += " --enable-vocab-parallel" + (" --disable-backward-fusion" if barriers == 2 else "") + \
            (" --split-vocab-embedding" if split else "")
        out["vocab_embedding"] = split
    if any(ca):
        pairs = sum(1 for o in sched.orders for a in o if a.kind == OVERLAP)
        out.update(cost_a2a_s=_rank_sum(ca, pl, p), overlap_pairs=pairs)
        if pairs:  # training asks the core for the same pairs: the all-to-all relative to F
            rel = max(ca) / max(cf) if max(cf) > 0 else 0.0
            out["flags"] += f" --overlap-moe-expert-parallel-comm --zero-bubble-cost-a2a {rel:.3g}"
    for k in ("gap_to_lower_bound", "exact"):
        if k in sched.meta:
            out[k] = sched.meta[k]
    if res.offload is not None:
        o = res.offload.to_dict()
        out["offload"] = {"time": o["time"], "offloaded": o["offloaded"], "offloaded_w": o["offloaded_w"],
                          "activation_bytes_without_offload": [x * unit for x in o["peak_memory_without_offload"]]}
        ks = o["time"] if isinstance(o["time"], list) else [o["time"]]
        share = max(o["offloaded_share"]) if o["offloaded_share"] else 0.0
        out["flags"] += (f" --cpu-offload --zero-bubble-offload-ratio {share:.2f} --offload-time "
                         f"{max(ks):.3g}")
    if asked.optimizer_offload is not None:  # every rank's optimizer step, and offload where the row does not fit
        from ..optimizer.rows import apply
        if sec != 1.0:  # its step's costs are seconds: the schedule timed in seconds
            built = Built(built.request, sched, in_seconds(built.setting, sec))
        apply(out, built, spec, cc.params, unit, budget, cost_optimizer, asked.optimizer_offload)
    return out


def _cannot_fit(req: ScheduleRequest, p: int, m: int, unit: float, states: List[float], budget: float) -> bool:
    """Whether offload 'auto' provably leaves some rank over ``budget``: where its link offloads
    the schedule built before it (vocabulary passes placed, or a schedule that is not searched),
    ``offload_floor`` bounds what any selection of that schedule's parts leaves (in ``unit`` bytes,
    beside each rank's ``states``); only where the links after it (MoE pairs, fused backwards)
    change nothing of it: no all-to-all, no back-to-back B;W where the split costs."""
    off = req.offload
    if off is None or off.ratio != AUTO or off.time_measured or any(req.cost_a2a):
        return False
    step = before(req, p, m, "offload")
    if step is None:
        return False  # (the offload search chooses what it offloads)
    sched, st = step.schedule, step.setting
    if req.cost_bw is not None and any(a.kind == B and b.kind == W and (a.stage, a.mb) == (b.stage, b.mb)
                                       for o in sched.orders for a, b in zip(o, o[1:])):
        return False
    floor = offload_floor(sched, st, off.options(st.memory_limit))
    return floor is not None and any(f * unit + s > budget * (1 + 1e-9) for f, s in zip(floor, states))


def needed_limit(peak: float) -> float:
    """The ``--zero-bubble-memory-limit`` a schedule peaking at ``peak`` (microbatches) needs: its
    peak rounded up to the flag's two decimals."""
    return math.ceil(peak * 100 - 1e-6) / 100


def _rank_sum(values: List[float], pl: Placement, p: int) -> List[float]:
    """Per rank: a per-rank list as it is, a per-chunk one summed over the rank's chunks."""
    if len(values) == p:
        return list(values)
    if len(values) == 1:
        return list(values) * p
    out = [0.0] * p
    for s in range(pl.num_stages):
        out[pl.rank_of(s)] += values[pl.logical(s) % len(values)] / pl.num_paths
    return out


def _offload_request(lever: Optional[OffloadLever], mf, cf, cb, limit_units) -> Optional[OffloadRequest]:
    """The plan's offload options: 'auto' offloads under the activation budget (``limit_units``),
    whatever limit a schedule searches under; K from ``time`` or, per rank, from ``host_link_gbps``."""
    if lever is None:
        return None
    ratio, time, gbps, overlap = lever.ratio, lever.time, lever.host_link_gbps, lever.overlap
    if time is None:
        if gbps is None:
            time = 1.0
        else:  # K per rank: bytes / bandwidth over (F + B) seconds of the rank's chunks
            time = [(mf[r] / (gbps * 1e9)) / (cf[r] + cb[r]) if cf[r] + cb[r] > 0 else 0.0 for r in range(len(mf))]
    return OffloadRequest(ratio=ratio, time=time, overlap=overlap, memory_limit=limit_units)


def _flags(sp, p, limit, lay: Layout, padded: bool, profiled: bool) -> str:
    f = [f"--pipeline-model-parallel-size {p}", f"--zero-bubble-schedule {sp.name}"]
    if limit:
        f.append(f"--zero-bubble-memory-limit {limit:g}")
    counts = lay.layers()
    if sp.placement == "looped":
        f.append(f"--num-virtual-stages-per-pipeline-rank {lay.num_stages // p}")
    even = len(set(counts)) == 1
    if padded:
        f.append("--allow-padding-num-layers")
    elif not even and not profiled:
        f.append(f"--pipeline-model-parallel-layout '{lay}'")
    return " ".join(f)


def profile_costs(profile: dict, p: int, chunks: Optional[int] = None) -> dict:
    """A profile's costs: one value, one per rank or (``chunks``: the row's model chunks in all)
    one per model chunk, as the profiler writes them."""
    if not isinstance(profile, dict):
        raise ScheduleError("profile JSON: expected an object with cost_f, cost_b, cost_w (per-stage seconds)")
    out = {}
    for k in ("cost_f", "cost_b", "cost_w", "cost_bw", "mem_f", "mem_w", "cost_a2a"):
        val = profile.get(k)
        if val is None:
            continue
        if _nonneg(val):
            val = [float(val)] * p
        if not (isinstance(val, list) and all(_nonneg(x) for x in val)):
            raise ScheduleError(f"profile's {k} must be a number or a list of numbers >= 0, got {_short(val)}")
        if len(val) != p and len(val) != (chunks or p):
            per = f" or one per model chunk ({chunks})" if chunks and chunks != p else ""
            raise ScheduleError(f"profile has {len(val)} values of {k} but the plan is for {p} stages{per}")
        out[k] = [float(x) for x in val]
    for k in ("cost_f", "cost_b", "cost_w"):
        if k not in out:
            raise ScheduleError(f"profile JSON lacks {k}: expected per-stage costs as written by the profiler")
    if sum(out["cost_f"]) + sum(out["cost_b"]) <= 0:
        raise ScheduleError("profile's cost_f and cost_b are all zero: no pass took any time")
    comm = profile.get("cost_comm", 0.0)
    if comm is not None and not _nonneg(comm):
        raise ScheduleError(f"profile's cost_comm must be a number >= 0, got {_short(comm)}")
    out["cost_comm"] = float(comm or 0.0)
    return out


def _nonneg(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def load_profile(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # missing, a directory, not text, not JSON
        raise ScheduleError(f"cannot read profile {path!r}: {e}") from None
