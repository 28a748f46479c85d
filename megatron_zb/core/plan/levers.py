"""The memory levers searched together (issue 55): a row that does not fit the budget is made to fit
by recomputing layers (each model chunk its own count: ``ModelSpec.recompute_counts``, Megatron's
block method: the chunk's first layers) and, where the request asks for it, offloading activations
as little as fits (``--offload-ratio auto``), or both; on the looped placement also by a layout with
each rank's first chunk a layer lighter (``front_light``), alone and with recompute. Pure Python.

A lever costs time (a recomputed forward in B, a copy over the host link, a layout other than the
one the row ran fastest on), so a row's time without levers bounds its variants (a lighter-first
layout faster than the row's own is not looked for): the rows that do not fit are tried likeliest
first (their time, plus what recomputing away their worst rank's excess would add), ``MOST_TRIED``
of them, each only where it could still beat the fastest row that fits. Every variant is one more candidate, never
a replacement of one that fits: a lever added to the search cannot make the best fitting row worse.

Recompute per rank: each rank over the budget recomputes the fewest layers that close its gap, its
earliest chunk first (it holds the most microbatches), estimated from what one recomputed layer saves
(its activation less its kept input, for every microbatch of that chunk the rank holds at its peak),
then checked by building the row again on its layout (the counts are per model chunk of it) and
raised by one layer on a rank still over, a few times.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Set, Tuple

from ..costs.chunk_costs import chunk_costs
from ..costs.layout import parse
from ..costs.layout_search import front_light, rank_shifts
from ..costs.model import ModelSpec
from ..ir import ScheduleError
from ..schedules import get
from .request import PlanRequest
from .row import candidate_layouts, placement_for

__all__ = ["fit_rows", "vocab_twins", "rebuilt", "levered", "light_request", "recompute_flags", "RAISES"]

#: how many times a recompute estimate is raised by one layer on the ranks still over the budget
RAISES = 3
#: ``vocab_twins`` tries the layouts one layer away where P x M is at most this: each is a row built
#: again (on Llama-3.1-405B at P=16, M=64 they took 22 s of CPU and brought no row to its twin)
SHIFTS_UP_TO = 256
#: the rows that do not fit tried with levers, likeliest first (each variant is a row built again)
MOST_TRIED = 6


def recompute_flags(counts: Sequence[int]) -> str:
    """The flags of a recompute per model chunk (pipeline order): Megatron's own where every chunk
    recomputes alike, else megatron-zb's counts."""
    flags = " --recompute-granularity full --recompute-method block"
    if len(set(counts)) == 1:
        return flags + f" --recompute-num-layers {counts[0]}"
    return flags + f" --recompute-num-layers {max(counts)} --zero-bubble-recompute-num-layers " + \
        ",".join(str(n) for n in counts)


def fit_rows(rows: List[dict], request: PlanRequest, build_row: Callable[..., dict],
             only: Optional[Set[int]] = None) -> List[dict]:
    """``rows`` (built without offload where ``request.offload`` is 'auto') with each row that does not
    fit replaced by its fastest variant that fits (recompute per rank; with ``--offload-ratio auto``,
    offload as little as fits, alone and with recompute), tried likeliest first where it could beat
    the fastest fitting row. ``build_row(name, vocab, request, fit_only=False)`` builds one row
    (``fit_only``: it is wanted only where it fits, ``row.row``). ``only``: the indices of the rows
    tried (default every row)."""
    key = request.ranked_by
    fitting = [r[key] for r in rows if "error" not in r and r["fits"]]
    best = min(fitting) if fitting else math.inf
    out = list(rows)
    over = [i for i, r in enumerate(rows) if "error" not in r and not r["fits"] and (only is None or i in only)]
    for i in sorted(over, key=lambda i: _promise(rows[i], request))[:MOST_TRIED]:
        if rows[i][key] >= best:
            continue  # a lever only costs time: no variant of this row can beat ``best``
        fit = [v for v in _variants(rows[i], request, build_row) if "error" not in v and v["fits"]]
        if fit:
            out[i] = min(fit, key=lambda v: v[key])
            best = min(best, out[i][key])
    return out


def _promise(r: dict, request: PlanRequest) -> float:
    """What a row may cost once it fits, to try the likeliest first: its time, plus a third of it (a
    forward's share of F + B + W) for the share of its worst rank's activations recomputed away."""
    need = max(max(0.0, p - request.budget_bytes) / a if a > 0 else 1.0
               for p, a in zip(r["peak_bytes"], r["activation_bytes"]))
    return r[request.ranked_by] * (1 + min(1.0, need) / 3)


def _variants(r: dict, request: PlanRequest, build_row) -> List[dict]:
    """The row's variants with levers, each built: offload 'auto' (where asked), recompute per rank,
    and both; on a looped placement, its layout with each rank's first chunk a layer lighter
    (``front_light``), alone and with recompute per rank."""
    name, vocab = r["schedule"], r.get("vocab_parallel")
    auto = request.offload is not None and request.offload.ratio == "auto"
    out = [build_row(name, vocab, request, True)] if auto else []
    rc = _recompute(r, request.replace(offload=None), build_row)
    if rc is not None:
        row, counts = rc
        out.append(row)
        if auto and not row["fits"]:
            both = build_row(name, vocab, _own_layout(r, request.replace(model=_recomputing(request.model, counts))),
                             True)
            if "error" not in both:
                _recomputes(both, counts)
            out.append(both)
    light = light_request(r, request.replace(offload=None))
    if light is not None:
        row = build_row(name, vocab, light)
        if "error" not in row:
            row["front_light"] = True
            out.append(row)
            rc = None if row["fits"] else _recompute(row, light, build_row)
            if rc is not None:
                rc[0]["front_light"] = True
                out.append(rc[0])
    return out


def light_request(r: dict, request: PlanRequest) -> Optional[PlanRequest]:
    """``request`` pinned to row ``r``'s layout with each rank's first chunk a layer lighter
    (``front_light``) and to its chunks per rank, where ``r`` runs a looped placement on a layout
    plan chose (not the user's, nor a profile's; plan searches layouts) and one chunk can give up a
    layer; else None."""
    sp = get(r["schedule"])
    if sp.placement != "looped" or request.layout is not None or request.profile is not None \
            or not request.layout_search:
        return None
    p = request.pipeline_parallel_size
    try:
        lay = front_light(parse(r["layout"], p), p, request.model.mtp_num_layers)
    except ScheduleError:
        return None
    if lay is None:
        return None
    return request.replace(layout=str(lay), interleave_chunks=r["chunks"] if sp.chunks is None else None)


def _own_layout(r: dict, request: PlanRequest) -> PlanRequest:
    """``request`` pinned to row ``r``'s layout and chunks per rank (one build, not one per candidate
    layout): its recompute counts are per model chunk of that layout. The even split padded at the
    ends stays the request's (its flag, not a layout, says so)."""
    if get(r["schedule"]).chunks is None:  # an interleaved schedule: its chunks per rank too
        request = request.replace(interleave_chunks=r["chunks"])
    return request if "--allow-padding-num-layers" in r["flags"] else request.replace(layout=r["layout"])


def _recomputes(row: dict, counts: Sequence[int]) -> None:
    """A row built with recompute per model chunk ``counts``: its flags and ``recompute_layers`` say so."""
    row["flags"] += recompute_flags(counts)
    row["recompute_layers"] = list(counts)


def _recomputing(spec: ModelSpec, counts: Sequence[int]) -> ModelSpec:
    return dataclasses.replace(spec, recompute="full", recompute_method="block", recompute_num_layers=max(counts),
                               recompute_counts=tuple(counts))


def _recompute(r: dict, request: PlanRequest, build_row) -> Optional[Tuple[dict, List[int]]]:
    """(the row with the least recompute per model chunk that fits, or the last tried where none
    does; the counts, one per chunk in pipeline order); None where the model or the schedule take
    none (the user's own recompute, measured costs, replicated stages)."""
    spec = request.model
    if spec.recompute is not None or request.profile is not None:
        return None
    sp = get(r["schedule"])
    try:
        v = sp.resolve_chunks(r["chunks"] if sp.chunks is None else None)
        pl = placement_for(sp.placement, request.pipeline_parallel_size, v)
        layout = parse(r["layout"], request.pipeline_parallel_size)
        cc = chunk_costs(spec, layout, pl, 1.0, 1.0, vocab=r.get("vocab_parallel") is not None,
                         vocab_embedding=bool(r.get("vocab_embedding")))
    except ScheduleError:
        return None
    saved = _saved_per_layer(spec)
    if saved <= 0 or pl.replicated:
        return None
    p = request.pipeline_parallel_size
    chunks = [sorted(s for s in range(pl.num_stages) if pl.rank_of(s) == q) for q in range(p)]  # earliest first
    room = layout.layers()
    counts: List[int] = [0] * pl.num_stages
    row = r
    for attempt in range(1 + RAISES):
        over = [row["peak_bytes"][q] - request.budget_bytes for q in range(p)]
        if not any(x > 0 for x in over):
            break
        before = list(counts)
        for q in range(p):
            if over[q] > 0:
                held = _held(row["activation_bytes"][q], [cc.mem_f[s] for s in chunks[q]])
                layers = max(1, math.ceil(over[q] / (saved * held) - 1e-9)) if attempt == 0 else 1
                _add(counts, chunks[q], room, layers)
        if counts == before:
            break
        row = build_row(r["schedule"], r.get("vocab_parallel"),
                        _own_layout(r, request.replace(model=_recomputing(spec, counts))))
        if "error" in row:
            return None
        _recomputes(row, counts)
    if not any(counts):
        return None
    return row, counts


def _held(act_peak: float, chunk_mem: Sequence[float]) -> float:
    """Chunk activations a rank holds at its peak, per chunk: its peak over its chunks' activations."""
    total = sum(chunk_mem)
    return act_peak / total if total > 0 else 1.0


def _add(counts: List[int], chunks: Sequence[int], room: Sequence[int], layers: int) -> None:
    """``layers`` more recomputed layers on a rank, its earliest chunk first (it holds the most
    microbatches), each chunk up to the layers it has."""
    for s in chunks:
        take = min(layers, room[s] - counts[s])
        counts[s] += take
        layers -= take
        if layers <= 0:
            return


def _saved_per_layer(spec: ModelSpec) -> float:
    """Bytes one microbatch's layer keeps less when it recomputes its forward (its activation less
    its kept input)."""
    return spec.layer_activation_bytes()[0] - spec.recomputing().layer_activation_bytes()[0]


def vocab_twins(rows: List[dict], request: PlanRequest,
                build_row: Callable[[str, Optional[int], PlanRequest, str], dict]) -> List[dict]:
    """A +vocab row of a schedule whose memory is its own (not searched under a limit) slower than its
    plain twin where both fit: where it carries no lever, built again on its twin's layout and on the
    layouts one layer away from its own that keep every rank's layers (``rank_shifts``: the output
    layer spread over the ranks moves the point where a rank's two chunks balance; on Llama-3-8B at
    P=4, M=16, v-half +vocab ran 2122 ms on its own layout, 1907 ms with rank 0's first chunk a layer
    lighter, its plain twin 2012 ms), at the plan's effort (``request.search``), until one is as
    fast as the twin, where P x M is at most ``SHIFTS_UP_TO``; then, where the fastest is still
    slower and was searched quickly, its vocabulary passes placed every way (the full effort), on its
    layout with the levers it carries (``build_row(name, vocab, request, effort)``, ``request`` with
    its recompute and offload: ``_lever_request``). Kept where faster."""
    key = request.ranked_by
    plain = {r["schedule"]: r for r in rows if "error" not in r and not r.get("vocab_parallel") and r["fits"]}
    out = list(rows)
    for i, r in enumerate(rows):
        twin = plain.get(r["schedule"]) if "error" not in r and r.get("vocab_parallel") and r["fits"] else None
        if twin is None or get(r["schedule"]).searched or r[key] <= twin[key] * (1 + 1e-3):
            continue
        if not levered(r, request) and request.pipeline_parallel_size * request.microbatches <= SHIFTS_UP_TO:
            for req in _shifted(r, twin, request):  # (quick: their flags say so)
                again = build_row(r["schedule"], r["vocab_parallel"], req, request.search)
                if "error" not in again and again["fits"] and again[key] < out[i][key]:
                    out[i] = again
                if out[i][key] <= twin[key] * (1 + 1e-3):
                    break
        r = out[i]
        if r.get("search_effort") == "quick" and r[key] > twin[key] * (1 + 1e-3):
            again = rebuilt(r, request, build_row, "full")
            if "error" not in again and again["fits"] and again[key] < r[key]:
                out[i] = again
    return out


def _shifted(r: dict, twin: dict, request: PlanRequest) -> List[PlanRequest]:
    """``request`` pinned to row ``r``'s chunks per rank and, one per request, to each other layout
    of: the ones its row chose among (``candidate_layouts``), its plain ``twin``'s, and those
    ``rank_shifts`` finds from each of these; none where the user or a profile fixed the layout, or
    plan searches none."""
    sp = get(r["schedule"])
    if request.layout is not None or request.profile is not None or not request.layout_search:
        return []
    p, spec = request.pipeline_parallel_size, request.model
    try:
        pl = placement_for(sp.placement, p, sp.resolve_chunks(r["chunks"] if sp.chunks is None else None))
        bases = [parse(r["layout"], p)] + candidate_layouts(spec, pl, False, None, True, vocab=True)
        if "--allow-padding-num-layers" not in twin["flags"] and twin.get("chunks") == r.get("chunks"):
            bases.append(parse(twin["layout"], p))
        layouts = [str(x) for b in bases for x in [b] + rank_shifts(b, pl, spec.mtp_num_layers)]
    except ScheduleError:
        return []
    chunks = r["chunks"] if sp.chunks is None else None
    return [request.replace(layout=lay, interleave_chunks=chunks)
            for k, lay in enumerate(layouts) if lay != r["layout"] and lay not in layouts[:k]]


def levered(r: dict, request: PlanRequest) -> bool:
    """Whether row ``r`` is a variant ``fit_rows`` made to fit: it recomputes layers per model chunk,
    runs its first chunks lighter, or offloads under ``--offload-ratio auto`` (rows are built without
    it)."""
    auto = request.offload is not None and request.offload.ratio == "auto"
    return bool(r.get("recompute_layers")) or bool(r.get("front_light")) or (auto and "offload" in r)


def rebuilt(r: dict, request: PlanRequest, build_row: Callable[[str, Optional[int], PlanRequest, str], dict],
            effort: str) -> dict:
    """Row ``r`` built again at ``effort`` with the levers it carries (``_lever_request``), on its
    layout and chunks per rank: ``build_row(name, vocab, request, effort)``."""
    again = build_row(r["schedule"], r.get("vocab_parallel"), _own_layout(r, _lever_request(r, request)), effort)
    if "error" not in again and r.get("recompute_layers"):
        _recomputes(again, r["recompute_layers"])
    return again


def _lever_request(r: dict, request: PlanRequest) -> PlanRequest:
    """The request a row made to fit by ``fit_rows`` was built with: offload 'auto' where the row
    offloads under it (else none: the rows are built without it), its recompute per model chunk."""
    auto = request.offload is not None and request.offload.ratio == "auto"
    req = request.replace(offload=None) if auto and "offload" not in r else request
    counts = r.get("recompute_layers")
    return req.replace(model=_recomputing(req.model, counts)) if counts else req
