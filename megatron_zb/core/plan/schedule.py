"""The schedule and setting behind one row of ``core.plan`` (for a model without a profile): its
layout's chunk costs, vocabulary passes and memory limit, built as the row was. For running a
plan's choice elsewhere (emulated compute: ``verify.timing.emulate.emulate_schedules``). Pure Python.

    request = PlanRequest(spec, 4, 8, 80.0, vocab=VocabLever("both"))
    rows = plan(request)
    sched, setting = row_schedule(request, rows[0])       # costs in seconds
"""
from __future__ import annotations

from typing import Tuple

from ..build import ScheduleRequest, build
from ..costs.chunk_costs import chunk_costs, in_seconds, unit_costs
from ..costs.layout import parse
from ..ir import Schedule, ScheduleError, Setting
from ..schedules import get
from .request import PlanRequest
from .row import placement_for

__all__ = ["row_schedule"]


def row_schedule(request: PlanRequest, row: dict) -> Tuple[Schedule, Setting]:
    """(schedule, setting) of ``row`` (one of ``plan(request)``'s rows; what it takes of ``request``:
    the model, P, M, ``tflops``, ``efficiency``, the vocabulary's and the
    all-to-all's GB/s): the row's layout and schedule, its memory limit (the searched schedules),
    with vocabulary parallelism where the row has it. Costs in seconds, memory in the row's unit (one
    microbatch's activations on the fullest rank). A row searched quickly (``search_effort``) is
    rebuilt by the same search."""
    if "error" in row:
        raise ScheduleError(f"plan row {row['schedule']} has no schedule: {row['error']}")
    spec, p, m = request.model, request.pipeline_parallel_size, request.microbatches
    sp = get(row["schedule"])
    v = sp.resolve_chunks(row["chunks"] if sp.chunks is None else None)
    pl = placement_for(sp.placement, p, v)
    lay = parse(row["layout"], p)
    barriers = row.get("vocab_parallel")
    flops_per_s = request.flops_per_s
    split = bool(row.get("vocab_embedding"))
    # built in the units the row was (``core.plan.row``: what training plans with), timed in seconds
    uc = unit_costs(spec, lay, pl, barriers, split, flops_per_s, request.vocab.gbps * 1e9)
    sec = uc.seconds(flops_per_s)
    ca = chunk_costs(spec, lay, pl, flops_per_s, request.moe.ep_gbps * 1e9, vocab=barriers is not None,
                     vocab_embedding=split).cost_a2a
    req = ScheduleRequest(row["schedule"], chunks=v if sp.chunks is None else None, cost_f=uc.cost_f,
                          cost_b=uc.cost_b, cost_w=uc.cost_w, cost_bw=uc.cost_bw, cost_a2a=[x / sec for x in ca],
                          vocab=uc.vocab,
                          mem_f=uc.mem_f, mem_w=uc.mem_w,
                          memory_limit=row.get("memory_limit_microbatches") if sp.searched else None,
                          effort=row.get("search_effort", "full"))
    built = build(req, p, m, enforce_limit=False)
    return built.schedule, in_seconds(built.setting, sec)
