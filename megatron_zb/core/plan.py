"""`megatron-zb plan`: rank the schedules for one GPT model and GPU memory budget.

Pure Python. Costs come from a profile JSON (``megatron-zb`` writes one while training with
profiling on) or from the model (``core.model.ModelSpec``: the zero-bubble paper's per-layer FLOPs
at a GPU's dense peak times an efficiency, Megatron's per-layer activation formula generalised to the
element size, dropout, MoE and recompute, 18 bytes of model state per parameter).
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import multiprocessing
from typing import List, Optional

from .build import OffloadRequest, ScheduleRequest, build
from .ir import OVERLAP, Placement, ScheduleError
from .iteration import iteration_times
from .schedules import get, names
from .schedules.auto import TIE
from .model import ModelSpec, layer_split, stage_activation_bytes  # noqa: F401 (plan's model, re-exported)

# schedules found by a search (seconds each at P=16), not built by a rule; the longest first
SEARCHED = ("v-auto", "zb-v", "v-half", "v-min", "zb-auto")

GPU_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "b200": 2250.0, "mi300x": 1307.0}

#: all-to-all bandwidth per GPU of expert parallelism, GB/s, where none is given: one 400 Gb/s
#: InfiniBand NIC per GPU (experts spread over nodes), as DeepSeek-V3 trains
EP_BANDWIDTH_GBPS = 50.0


def stage_a2a(spec: ModelSpec, p: int, style: str, counts: List[int], gbps: float) -> List[float]:
    """Seconds of one microbatch's expert-parallel all-to-all in an F (and again in a B) of each
    rank's stage: its layers' ``layer_a2a_bytes`` at ``gbps`` GB/s (``counts``: layers per stage,
    per logical stage for 'bitpipe', whose two paths share a rank's microbatches)."""
    per_layer = spec.layer_a2a_bytes() / (gbps * 1e9)
    out = [0.0] * p
    if style == "bitpipe":
        pl = Placement.bitpipe(p)
        for s in range(pl.num_stages):
            out[pl.rank_of(s)] += counts[pl.logical(s)] * per_layer / pl.num_paths
        return out
    for s, n in enumerate(counts):
        out[pl_rank(s, p, style)] += n * per_layer
    return out


def stage_costs(spec: ModelSpec, p: int, v: int, placement_style: str, tflops: float, efficiency: float,
                pad_ends: bool):
    """Per-rank (cost_f, cost_b, cost_w in seconds; mem_f, mem_w in bytes; state bytes).

    'bitpipe' (replicated stages, two paths): costs and activations are those of one path's chunks
    on the rank (a microbatch runs through one path), averaged over the two paths; model states count
    all four chunks (both replicas' weights)."""
    if placement_style == "bitpipe":
        return _replicated_stage_costs(spec, Placement.bitpipe(p), tflops, efficiency, pad_ends)
    nst = p * v
    counts = layer_split(spec.num_layers, nst, pad_ends)
    rank_of = [pl_rank(s, p, placement_style) for s in range(nst)]
    lf = spec.layer_flops()
    of = spec.output_flops()
    m_b, m_w = spec.layer_activation_bytes()
    speed = tflops * 1e12 * efficiency
    cf, cb, cw, mf, mw, params = ([0.0] * p for _ in range(6))
    for s, n in enumerate(counts):
        r = rank_of[s]
        cf[r] += n * lf[0] / speed
        cb[r] += n * lf[1] / speed
        cw[r] += n * lf[2] / speed
        mf[r] += n * m_b
        mw[r] += n * m_w
        params[r] += n * spec.params_per_layer()
    b, sq, h, vv, t = spec.micro_batch_size, spec.seq_length, spec.hidden_size, spec.vocab_size, spec.tensor_parallel_size
    first, last = rank_of[0], rank_of[-1]
    cf[last] += of[0] / speed
    cb[last] += of[1] / speed
    cw[last] += of[2] / speed
    loss_f, loss_w = spec.loss_activation_bytes()
    mf[last] += loss_f
    mw[last] += loss_w
    mf[first] += spec.embedding_activation_bytes()
    params[first] += vv * h / t
    params[last] += vv * h / t if last != first else 0.0
    return cf, cb, cw, mf, mw, [spec.state_bytes(x) for x in params], counts


def _replicated_stage_costs(spec: ModelSpec, pl: Placement, tflops: float, efficiency: float, pad_ends: bool):
    p, S, k = pl.num_ranks, pl.num_logical_stages, pl.num_paths
    counts = layer_split(spec.num_layers, S, pad_ends)
    lf, of = spec.layer_flops(), spec.output_flops()
    m_b, m_w = spec.layer_activation_bytes()
    speed = tflops * 1e12 * efficiency
    b, sq, h, vv, t = spec.micro_batch_size, spec.seq_length, spec.hidden_size, spec.vocab_size, spec.tensor_parallel_size
    cf, cb, cw, mf, mw, params = ([0.0] * p for _ in range(6))
    for s in range(pl.num_stages):
        r, l = pl.rank_of(s), pl.logical(s)
        n = counts[l]
        cf[r] += n * lf[0] / speed / k
        cb[r] += n * lf[1] / speed / k
        cw[r] += n * lf[2] / speed / k
        mf[r] += n * m_b / k
        mw[r] += n * m_w / k
        params[r] += n * spec.params_per_layer()
        if l == S - 1:  # output layer and loss of this path
            cf[r] += of[0] / speed / k
            cb[r] += of[1] / speed / k
            cw[r] += of[2] / speed / k
            mf[r] += spec.loss_activation_bytes()[0] / k
            mw[r] += spec.loss_activation_bytes()[1] / k
            if pl.rank_of(pl.path(pl.path_of(s))[0]) != r:
                params[r] += vv * h / t
        if l == 0:
            mf[r] += spec.embedding_activation_bytes() / k
            params[r] += vv * h / t
    return cf, cb, cw, mf, mw, [spec.state_bytes(x) for x in params], counts


def plan(spec: ModelSpec, pipeline_parallel_size: int, microbatches: int, gpu_memory_gb: float,
         tflops: float = GPU_PEAK_TFLOPS["h100"], efficiency: float = 0.5, profile: Optional[dict] = None,
         schedules: Optional[List[str]] = None, pad_ends: bool = False, interleave_chunks: int = 2,
         cost_optimizer: float = 0.0, post_validation: bool = False,
         offload_ratio=None, offload_time=None, host_link_gbps: Optional[float] = None,
         offload_overlap: bool = True, exact: Optional[tuple] = None, jobs: int = 1,
         ep_bandwidth_gbps: float = EP_BANDWIDTH_GBPS, a2a_overlap: bool = True) -> List[dict]:
    """Rows sorted by (fits, time per training iteration): with Megatron's synchronous optimizer
    step, or with optimizer post-validation when ``post_validation`` (``cost_optimizer`` seconds
    per step); times within 0.1% count as equal, the least peak memory first
    (``by_memory_among_ties``). Each row carries both times. zb-auto's and v-auto's memory limit
    (``memory_limit_microbatches`` and the flag) is what the schedule needs, its peak rounded up,
    where the schedule built under it is as fast; else the budget's room. Activation offload (``core.offload``):
    ``offload_ratio`` R (0..1) offloads that share of every schedule's activations; ``'auto'``
    offloads as little as brings each schedule under the memory budget (zb-auto / v-auto may then
    take a schedule that needs more). The transfer time is ``offload_time`` K, or derived per rank
    from ``host_link_gbps`` (one-way GB/s): K = activation bytes / bandwidth / (F + B). ``exact`` =
    (node limit, time limit or None): the automatic schedules also get the exact MILP (``schedules.exact.refine``; not with offload).
    ``jobs`` > 1: the schedules are generated by that many processes at once (the same rows: every
    generator is deterministic). MoE with expert parallelism: each F and B also moves its layers'
    all-to-all (``ModelSpec.layer_a2a_bytes``) at ``ep_bandwidth_gbps`` GB/s (``cost_a2a``; with a
    profile, its ``cost_a2a`` if it has one, else none), hidden inside the overlapped F&B pairs a
    schedule forms unless ``a2a_overlap`` is False."""
    if exact is not None and offload_ratio is not None:
        raise ScheduleError("the exact mode solves schedules without activation offload (the MILP has no host "
                            "link): leave out the offload ratio or the exact mode")
    if not isinstance(jobs, int) or jobs < 1:
        raise ScheduleError(f"jobs must be an integer >= 1 (processes generating schedules), got {jobs!r}")
    spec.validate()
    key = "iteration_time_post_validated_s" if post_validation else "iteration_time_s"
    p, m = pipeline_parallel_size, microbatches
    if p < 2:
        raise ScheduleError("--pipeline-parallel-size must be >= 2: pipeline schedules need several stages")
    if spec.num_layers + (2 if pad_ends else 0) < p:
        raise ScheduleError(f"--num-layers {spec.num_layers} cannot fill --pipeline-parallel-size {p} stages: every "
                            "stage holds at least one layer (use fewer pipeline stages or more layers)")
    for name, v in (("--efficiency", efficiency), ("--peak-tflops", tflops), ("--gpu-memory-gb", gpu_memory_gb),
                    ("--ep-bandwidth-gbps", ep_bandwidth_gbps)):
        if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
            raise ScheduleError(f"{name} must be a positive number, got {v!r}")
    if microbatches < 1:
        raise ScheduleError("--num-microbatches must be >= 1")
    one = functools.partial(_row, spec=spec, p=p, m=m, budget=gpu_memory_gb * 1024 ** 3, tflops=tflops,
                            efficiency=efficiency, profile=profile, pad_ends=pad_ends,
                            interleave_chunks=interleave_chunks, cost_optimizer=cost_optimizer,
                            ranked_by=key, offload=(offload_ratio, offload_time, host_link_gbps, offload_overlap),
                            exact=exact, a2a=(ep_bandwidth_gbps, a2a_overlap))
    todo = list(schedules or names())
    if jobs > 1 and len(todo) > 1:
        # fork where there is one: the workers need nothing re-imported (and the caller's main
        # module may be a script that cannot be, e.g. stdin)
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        # the searched schedules first, the longest first (they take seconds; the others milliseconds)
        order = sorted(range(len(todo)), key=lambda i: SEARCHED.index(todo[i]) if todo[i] in SEARCHED
                       else len(SEARCHED))
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(todo)), mp_context=ctx) as pool:
            done = dict(zip(order, pool.map(one, [todo[i] for i in order])))
        rows = [done[i] for i in range(len(todo))]
    else:
        rows = [one(name) for name in todo]
    base = next((r for r in rows if r["schedule"] == "1f1b" and "error" not in r), None)
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        r["throughput_vs_1f1b"] = round(base[key] / r[key], 4) if base and r[key] else None
        if post_validation:
            r["flags"] += " --enable-optimizer-post-validation"
    ok = (by_memory_among_ties([r for r in ok if r["fits"]], lambda r: r[key], lambda r: max(r["peak_bytes"]))
          + by_memory_among_ties([r for r in ok if not r["fits"]], lambda r: r[key], lambda r: max(r["peak_bytes"])))
    return ok + [r for r in rows if "error" in r]


def by_memory_among_ties(rows: List[dict], time, peak, tie: float = TIE) -> List[dict]:
    """``rows`` by ``time(row)``, where times within ``tie`` (0.1%) of the fastest row not yet
    placed count as equal: those go first, least ``peak(row)`` first (then faster), then the
    rest the same way."""
    rest = sorted(rows, key=lambda r: (time(r), peak(r)))
    out = []
    while rest:
        top = time(rest[0]) * (1 + tie) + 1e-12
        group = [r for r in rest if time(r) <= top]
        rest = [r for r in rest if time(r) > top]
        out += sorted(group, key=lambda r: (round(peak(r), 6), time(r)))
    return out


def _row(name: str, spec: ModelSpec, p: int, m: int, budget: float, tflops: float, efficiency: float,
         profile: Optional[dict], pad_ends: bool, interleave_chunks: int, cost_optimizer: float,
         ranked_by: str, offload: tuple, exact: Optional[tuple], a2a: tuple = (EP_BANDWIDTH_GBPS, True)) -> dict:
    """One schedule's row of ``plan`` (or ``{"schedule", "error"}``)."""
    offload_ratio, offload_time, host_link_gbps, offload_overlap = offload
    ep_gbps, a2a_overlap = a2a
    sp = get(name)
    v = sp.resolve_chunks(interleave_chunks if sp.chunks is None else None)
    if v * p > spec.num_layers + (2 if pad_ends else 0):
        return {"schedule": name, "error": f"{spec.num_layers} layers < {v * p} model chunks"}
    cf, cb, cw, mf, mw, states, counts = stage_costs(spec, p, v, sp.placement, tflops, efficiency, pad_ends)
    comm = 0.0
    ca = stage_a2a(spec, p, sp.placement, counts, ep_gbps)
    if profile is not None:
        from_profile = _profile_costs(profile, p)
        cf, cb, cw = from_profile["cost_f"], from_profile["cost_b"], from_profile["cost_w"]
        comm = from_profile.get("cost_comm", 0.0)
        ca = from_profile.get("cost_a2a", [0.0] * p)
        if from_profile.get("mem_f"):
            mf, mw = from_profile["mem_f"], from_profile["mem_w"]
    unit = max(mf)  # simulate in units of the largest stage activation
    act_budget = [max(0.0, budget - states[r]) for r in range(p)]
    limit_units = min(act_budget) / unit if unit > 0 else None
    try:
        req = ScheduleRequest(name, chunks=v if sp.chunks is None else None, cost_f=cf, cost_b=cb, cost_w=cw,
                              cost_comm=comm, cost_a2a=ca, a2a_overlap=a2a_overlap, mem_f=[x / unit for x in mf],
                              mem_w=[b / unit for b in mw],
                              memory_limit=limit_units if sp.searched else None, exact=exact,
                              offload=_offload_request(offload_ratio, offload_time, host_link_gbps, offload_overlap,
                                                       mf, cf, cb, limit_units))
        built = build(req, p, m, enforce_limit=False)
        it = iteration_times(built.schedule, built.setting, cost_optimizer)
        if sp.searched and limit_units and req.offload is None:
            # the flag asks for what the schedule needs (its peak), not for the GPU's room: the
            # schedule the run builds under that limit, where it is as fast (``TIE``)
            need = math.ceil(max(built.result.peak_memory) * 100 - 1e-6) / 100
            if need < math.floor(limit_units * 100) / 100:
                tight = build(req.replace(memory_limit=need), p, m, enforce_limit=False)
                it2 = iteration_times(tight.schedule, tight.setting, cost_optimizer)
                if getattr(it2, ranked_by[:-2]) <= getattr(it, ranked_by[:-2]) * (1 + TIE):
                    built, it, limit_units = tight, it2, need
        sched, res = built.schedule, built.result
    except ScheduleError as e:
        return {"schedule": name, "error": str(e)}
    act_bytes = [x * unit for x in res.peak_memory]
    total = [a + s for a, s in zip(act_bytes, states)]
    row = {"schedule": name, "chunks": v, "makespan_s": res.makespan, "bubble_rate": res.bubble_rate,
           "iteration_time_s": it.iteration_time,
           "iteration_time_post_validated_s": it.iteration_time_post_validated,
           "ranked_by": ranked_by,
           "activation_bytes": act_bytes, "state_bytes": states, "peak_bytes": total,
           "fits": max(total) <= budget, "layers_per_stage": counts,
           "activation_unit_bytes": unit,  # one microbatch's activation on the fullest rank
           "memory_limit_microbatches": (math.floor(limit_units * 100 + 1e-6) / 100
                                         if sp.searched and limit_units else None),
           "weight_copies": res.weight_copies or [1.0] * p,
           "flags": _flags(sp, p, v, limit_units, counts, pad_ends)}
    if any(ca):
        pairs = sum(1 for o in sched.orders for a in o if a.kind == OVERLAP)
        row.update(cost_a2a_s=ca, overlap_pairs=pairs)
        if pairs:  # training asks the core for the same pairs: the all-to-all relative to F
            rel = max(ca) / max(cf) if max(cf) > 0 else 0.0
            row["flags"] += f" --overlap-moe-expert-parallel-comm --zero-bubble-cost-a2a {rel:.3g}"
    for k in ("gap_to_lower_bound", "exact"):
        if k in sched.meta:
            row[k] = sched.meta[k]
    if res.offload is not None:
        o = res.offload.to_dict()
        row["offload"] = {"time": o["time"], "offloaded": o["offloaded"], "offloaded_w": o["offloaded_w"],
                          "activation_bytes_without_offload": [x * unit for x in o["peak_memory_without_offload"]]}
        ks = o["time"] if isinstance(o["time"], list) else [o["time"]]
        share = max(o["offloaded_share"]) if o["offloaded_share"] else 0.0
        row["flags"] += (f" --cpu-offload --zero-bubble-offload-ratio {share:.2f} --offload-time "
                         f"{max(ks):.3g}")
    return row


def pl_rank(stage: int, p: int, style: str) -> int:
    """The rank of ``stage`` in a plain placement of that style ('v': a V; else looped)."""
    if style == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def _offload_request(ratio, time, gbps, overlap, mf, cf, cb, limit_units) -> Optional[OffloadRequest]:
    """The plan's offload options: 'auto' offloads under the activation budget (``limit_units``),
    whatever limit a schedule searches under; K from ``time`` or, per rank, from ``gbps``."""
    if ratio is None:
        return None
    if time is None:
        if gbps is None:
            time = 1.0
        else:  # K per rank: bytes / bandwidth over (F + B) seconds (per chunk both scale alike)
            time = [(mf[r] / (gbps * 1e9)) / (cf[r] + cb[r]) if cf[r] + cb[r] > 0 else 0.0 for r in range(len(mf))]
    return OffloadRequest(ratio=ratio, time=time, overlap=overlap, memory_limit=limit_units)


def _flags(sp, p, v, limit_units, counts, pad_ends):
    f = [f"--pipeline-model-parallel-size {p}", f"--zero-bubble-schedule {sp.name}"]
    if sp.searched and limit_units:
        f.append(f"--zero-bubble-memory-limit {math.floor(limit_units * 100 + 1e-6) / 100:g}")
    if sp.placement == "looped":
        f.append(f"--num-layers-per-virtual-pipeline-stage {max(1, min(counts))}")
    if pad_ends:
        f.append("--allow-padding-num-layers")
    return " ".join(f)


def _profile_costs(profile: dict, p: int) -> dict:
    if not isinstance(profile, dict):
        raise ScheduleError("profile JSON: expected an object with cost_f, cost_b, cost_w (per-stage seconds)")
    out = {}
    for k in ("cost_f", "cost_b", "cost_w", "mem_f", "mem_w", "cost_a2a"):
        val = profile.get(k)
        if val is None:
            continue
        if _nonneg(val):
            val = [float(val)] * p
        if not (isinstance(val, list) and all(_nonneg(x) for x in val)):
            raise ScheduleError(f"profile's {k} must be a number or a list of numbers >= 0, got {_short(val)}")
        if len(val) != p:
            raise ScheduleError(f"profile has {len(val)} values of {k} but the plan is for {p} stages")
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
