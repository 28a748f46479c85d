"""BitPipe (Wu et al., "BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating
Large Models Training", 2024): two V-shaped interleaved pipelines running in opposite directions
over the same p ranks (p even).

Placement (``Placement.bitpipe``): the model has 2p logical stages. The "down" pipeline places
them like ``zb-v``'s V (logical l on rank l, then back up: 2p-1-l), the "up" pipeline mirrors it
(logical l on rank p-1-l, then l-p). Every rank holds four model chunks, two per direction; rank r
and rank p-1-r hold the same logical stages, so each logical stage has one replica per direction,
and the two replicas all-reduce their weight gradients once their last backward is done (eager
gradient synchronisation, overlapped with the remaining passes; ``--cost-sync`` in the simulator).
The first and last logical stages of a direction sit on the same rank, so the embedding and the
loss of the down pipeline live on rank 0, those of the up pipeline on rank p-1.

Microbatches go in units of p: in each unit the first p/2 take the down pipeline, the other p/2 the
up pipeline (so m must be a multiple of p, as in the authors' code). Every rank runs its forwards in
the order they would arrive in an unhindered pipeline with equal chunk times (the j-th microbatch of
a direction reaches logical stage l at time l + j; ties: the deeper stage first), unit after unit,
and its backwards in the mirrored order. Forwards and fused backwards (BitPipe does not split the
backward) are interleaved by the list scheduler (``listsched``): a backward as soon as its gradient
is there, a forward while the rank holds fewer than the paper's warm-up count plus one chunk
activations (3p/2 + min(r, p-1-r) chunk forwards before the first backward), so the peak activation
is at most p x mem-f (1F1B's) on every rank. ``--memory-limit`` replaces that cap.

Memory: each rank holds two copies' worth of weights (four chunks of half a 1F1B stage each): the
model states per rank double against 1F1B (``SimResult.weight_copies``, ``megatron-zb plan``).
"""
from __future__ import annotations

from ..ir import Placement, Schedule, ScheduleError, Setting
from . import listsched


def route(mb: int, p: int):
    """(path, index within its direction in the unit, unit) of microbatch ``mb``."""
    unit, i = divmod(mb, p)
    half = p // 2
    return (0 if i < half else 1), i % half, unit


def bitpipe(setting: Setting) -> Schedule:
    p, m = setting.stages, setting.microbatches
    if p < 2 or p % 2:
        raise ScheduleError(f"bitpipe needs an even pipeline size >= 2 (rank r pairs with rank p-1-r), got {p}")
    if m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        raise ScheduleError(f"bitpipe runs microbatches in units of the pipeline size ({p}: {p // 2} per direction); "
                            f"{m} is not a multiple of {p}, use " + (f"{lo} or {hi}" if lo else f"{hi}") +
                            " microbatches")
    pl = Placement.bitpipe(p)
    S = pl.num_logical_stages
    f_seq, b_seq = [], []
    for r in range(p):
        items = []
        for mb in range(m):
            k, j, unit = route(mb, p)
            for s in pl.path(k):
                if pl.rank_of(s) == r:
                    items.append((s, mb, pl.logical(s), j, unit))
        f_seq.append([(s, mb) for s, mb, l, j, u in sorted(items, key=lambda x: (x[4], x[2] + x[3], -x[2], x[1]))])
        b_seq.append([(s, mb) for s, mb, l, j, u in
                      sorted(items, key=lambda x: (x[4], (S - 1 - x[2]) + x[3], x[2], x[1]))])
    if setting.memory_limit is not None:
        cap = [float(setting.memory_limit)] * p
        claim = float(setting.memory_limit)
    else:
        counts = [min(3 * p // 2 + min(r, p - 1 - r) + 1, 2 * m) for r in range(p)]
        cap = listsched.in_flight_cap(setting, pl, counts)
        claim = max(c / pl.chunks for c in counts)
    plan = listsched.Plan(f_seq, b_seq, cap)
    try:
        return listsched.run("bitpipe", setting, pl, plan, m, {"memory_claim": claim})
    except ScheduleError as e:
        if setting.memory_limit is None:
            raise
        raise ScheduleError(f"bitpipe cannot run its order under memory limit {setting.memory_limit:g}: a rank fills up "
                            f"before the gradient it waits for can come back (without a limit it needs {p} x mem-f at "
                            f"most; {e})") from None
