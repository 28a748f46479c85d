"""Validator: a schedule is complete, placed right, deadlock-free and within its memory limit."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from ..ir import (BW, COMPUTE_KINDS, OFFLOAD_KINDS, VG, VI, VOCAB_KINDS, VS, VT, VW, B, F, Schedule, ScheduleError,
                  Setting, W)
from .hostlink import check_offload
from .simulate import Deadlock, simulate


def validate(schedule: Schedule, setting: Optional[Setting] = None,
             memory_limit: Optional[float] = None) -> None:
    """Raise ScheduleError naming the rank, position and pass of the first problem found.

    ``memory_limit`` (per rank, units of mem-f) defaults to ``setting.memory_limit``.
    Without a setting, dependencies are checked with unit costs and memory is not checked.
    """
    schedule = schedule.flat()  # positions below count an overlapped pair as its two passes
    pl = schedule.placement
    m = schedule.num_microbatches
    if len(schedule.orders) != pl.num_ranks:
        raise ScheduleError(f"schedule has {len(schedule.orders)} rank lists but its placement "
                            f"has {pl.num_ranks} ranks")
    where = {}  # (kind, stage, mb) -> (rank, position) of each compute pass (every key once)
    nst, rank_of = pl.num_stages, pl.stage_to_rank
    for r, order in enumerate(schedule.orders):
        for i, a in enumerate(order):
            if not a.is_compute:
                continue
            key = (a.kind, a.stage, a.mb)
            if a.kind in VOCAB_KINDS:  # a vocabulary pass runs on its own rank's shard
                if a.stage != r or not (0 <= a.mb < m):
                    raise ScheduleError(f"rank {r} position {i}: {a} must name this rank's vocabulary shard ({r}) and "
                                        f"a microbatch in 0..{m - 1}")
                if key in where:
                    raise ScheduleError(f"rank {r} position {i}: {a} appears twice")
                where[key] = (r, i)
                continue
            if a.kind not in COMPUTE_KINDS:
                raise ScheduleError(f"rank {r} position {i}: unknown pass kind in {a}")
            if not (0 <= a.stage < nst):
                raise ScheduleError(f"rank {r} position {i}: {a} names stage {a.stage}, "
                                    f"valid stages are 0..{nst - 1}")
            if not (0 <= a.mb < m):
                raise ScheduleError(f"rank {r} position {i}: {a} names microbatch {a.mb}, "
                                    f"valid microbatches are 0..{m - 1}")
            if rank_of[a.stage] != r:
                raise ScheduleError(f"rank {r} position {i}: {a} belongs to stage {a.stage}, "
                                    f"which is placed on rank {rank_of[a.stage]}")
            if key in where:
                pr, pi = where[key]
                raise ScheduleError(f"rank {r} position {i}: {a} appears twice "
                                    f"(first at rank {pr} position {pi})")
            where[key] = (r, i)
    if pl.replicated:
        route = {}
        for r, order in enumerate(schedule.orders):
            for i, a in enumerate(order):
                if not a.is_compute:
                    continue
                k = pl.path_of(a.stage)
                if route.setdefault(a.mb, k) != k:
                    raise ScheduleError(f"rank {r} position {i}: {a} runs microbatch {a.mb} on path {k}, but it "
                                        f"also runs on path {route[a.mb]}; a microbatch takes one path")
        todo = [(s, mb) for mb in range(m) for s in pl.path(route.get(mb, 0))]
    else:
        todo = [(s, mb) for s in range(pl.num_stages) for mb in range(m)]
    for s, mb in todo:
        r = pl.rank_of(s)
        if (F, s, mb) not in where:
            raise ScheduleError(f"rank {r}: missing F for stage {s} microbatch {mb}")
        nb, nw, nbw = (B, s, mb) in where, (W, s, mb) in where, (BW, s, mb) in where
        if nbw and (nb or nw):
            raise ScheduleError(f"rank {r}: stage {s} microbatch {mb} has both BW and B/W; "
                                "use either one BW or one B followed by one W")
        if not nbw and not (nb and nw):
            missing = "B and W (or one BW)" if not (nb or nw) else ("W" if nb else "B")
            raise ScheduleError(f"rank {r}: stage {s} microbatch {mb} is missing {missing}")
    if any(k in VOCAB_KINDS for k, _, _ in where):
        split = any(k in (VI, VG) for k, _, _ in where)
        for r in range(pl.num_ranks):
            for mb in range(m):
                for k in VOCAB_KINDS if split else (VS, VT, VW):
                    if (k, r, mb) not in where:
                        raise ScheduleError(f"rank {r}: missing vocabulary pass {k} of microbatch {mb} (every rank "
                                            "runs VS, VT and VW of every microbatch on its shard"
                                            + (", and VI and VG with the embedding split)" if split else ")"))
    offload = any(a.kind in OFFLOAD_KINDS for o in schedule.orders for a in o)
    if offload:
        check_offload(schedule)
    try:
        result = simulate(schedule, setting or Setting(pl.num_ranks, max(m, 1), chunks=pl.chunks))
    except Deadlock as e:
        raise ScheduleError(str(e)) from None
    if setting is None:
        return result
    limit = setting.memory_limit if memory_limit is None else memory_limit
    if limit is None or limit == float("inf"):
        return result
    if offload:  # offloaded activations leave the count: the simulator's time-based peak
        for r, peak in enumerate(result.peak_memory):
            if peak > limit + 1e-9:
                raise ScheduleError(f"rank {r}: activation memory peaks at {peak:g} even with offload, over "
                                    f"the limit {limit:g}")
        return result
    st = dataclasses.replace(setting, chunks=pl.chunks)
    for r, order in enumerate(schedule.orders):
        cur = 0.0
        i = -1
        for i, a in enumerate(order):
            if not a.is_compute:
                continue
            cur += st.pass_mem(a.kind, r, a.stage)
            if cur > limit + 1e-9:
                raise ScheduleError(f"rank {r} position {i}: {a} raises activation memory to "
                                    f"{cur:g}, over the limit {limit:g}")
    return result


def routes(schedule: "Schedule") -> Dict[int, int]:
    """microbatch -> index of the path it runs along (read off the schedule's forwards)."""
    pl = schedule.placement
    out: Dict[int, int] = {}
    for o in schedule.flat().orders:
        for a in o:
            if a.kind == F and 0 <= a.stage < pl.num_stages:
                out.setdefault(a.mb, pl.path_of(a.stage))
    return out
