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
up pipeline (so m must be a multiple of p, as in the authors' code). Each rank's order is the
authors' (their ``get_microbatch_idx`` / ``get_bkmicrobatch_idx``; our own code). A rank sees four
streams of p/2 chunk passes per unit: its own direction's first-half chunk (``own0``; own: down on
ranks r < p/2, up on the others), the other direction's first half (``oth0``) and both second
halves (``oth1``, ``own1``). Forwards take stream A = own0 then oth1 and stream B = oth0 then own1:
the first ``lead`` passes of A (lead = p/2 - r for r < p/2, r - p/2 + 1 for the others: the
own-direction forwards that reach the rank before the other direction's first one), then
one of B, one of A, in turn, then the rest of B. Backwards mirror it (A = own1 then oth0, B = oth1
then own0). Units follow one another; each chunk runs its microbatches in order.

Forwards and fused backwards (BitPipe does not split the backward) are interleaved in one of two
ways, both timed under the setting's costs, the faster kept:

* ``list``: the list scheduler (``listsched``): a backward as soon as its gradient is there, a
  forward while the rank holds at most 2p - lead chunk activations (the warm-up count below);
* ``fixed``: the authors' loops: 2p - lead warm-up forwards, then per unit lead x (F, BW),
  2p - 2 lead + 1 BW, (lead - 1) x (F, BW), 2p - 2 lead + 1 F (the next unit's warm-up); the last
  unit ends with lead x (F, BW) and the remaining BWs. It wins where forwards are slow against
  the fused backward.

Either way the peak activation is at most p x mem-f (1F1B's) on every rank. ``--memory-limit``
caps the list scheduler's activations instead, and the fixed loops are kept only within it.

Memory: each rank holds two copies' worth of weights (four chunks of half a 1F1B stage each): the
model states per rank double against 1F1B (``SimResult.weight_copies``, ``megatron-zb plan``).
"""
from __future__ import annotations

import dataclasses

from ..ir import BW, Action, F, Placement, Schedule, ScheduleError, Setting
from ..sim.simulate import simulate
from . import listsched


def rank_orders(p: int, m: int, r: int):
    """Rank ``r``'s forward and backward orders, lists of (stage, microbatch), and its ``lead``."""
    pl = Placement.bitpipe(p)
    half = p // 2
    own = 0 if r < half else 1
    lead = half - r if r < half else r - half + 1

    def stage(k, h):  # direction k's first (h=0) or second (h=1) chunk on rank r
        logical = (r if h == 0 else 2 * p - 1 - r) if k == 0 else (p - 1 - r if h == 0 else p + r)
        return pl.path(k)[logical]

    def merge(a, b):  # ``lead`` of a, then b and a in turn, then the rest of b
        out = a[:lead]
        for x, y in zip(b, a[lead:]):
            out += [x, y]
        return out + b[len(a) - lead:]

    f_seq, b_seq = [], []
    for unit in range(m // p):
        def stream(k, h):
            return [(stage(k, h), unit * p + k * half + j) for j in range(half)]
        f_seq += merge(stream(own, 0) + stream(1 - own, 1), stream(1 - own, 0) + stream(own, 1))
        b_seq += merge(stream(own, 1) + stream(1 - own, 0), stream(1 - own, 1) + stream(own, 0))
    return f_seq, b_seq, lead


def fixed_order(p: int, m: int, f_seq, b_seq, lead: int):
    """The authors' warm-up / 1F1B / drain loops over one rank's forward and backward orders."""
    warm = 2 * p - lead
    kinds = "F" * warm
    for unit in range(m // p):
        if unit < m // p - 1:
            kinds += "FB" * lead + "B" * (warm - lead + 1) + "FB" * (lead - 1) + "F" * (warm - lead + 1)
        else:
            kinds += "FB" * lead + "B" * warm
    fi, bi = iter(f_seq), iter(b_seq)
    return [Action(F, *next(fi)) if k == "F" else Action(BW, *next(bi)) for k in kinds]


def interleavings(setting: Setting):
    """{"list": ..., "fixed": ...}: the two ways of running the authors' per-rank orders ("list"
    is missing where it cannot run under ``--memory-limit``), and the list scheduler's error."""
    p, m = setting.stages, setting.microbatches
    if p < 2 or p % 2:
        raise ScheduleError(f"bitpipe needs an even pipeline size >= 2 (rank r pairs with rank p-1-r), got {p}")
    if m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        raise ScheduleError(f"bitpipe runs microbatches in units of the pipeline size ({p}: {p // 2} per direction); "
                            f"{m} is not a multiple of {p}, use " + (f"{lo} or {hi}" if lo else f"{hi}") +
                            " microbatches")
    pl = Placement.bitpipe(p)
    ranks = [rank_orders(p, m, r) for r in range(p)]
    counts = [2 * p - lead + 1 for _, _, lead in ranks]  # warm-up forwards + the first steady one
    limit = setting.memory_limit
    claim = max(c / pl.chunks for c in counts) if limit is None else float(limit)
    cap = listsched.in_flight_cap(setting, pl, counts) if limit is None else [float(limit)] * p
    out, err = {}, None
    try:
        out["list"] = listsched.run("bitpipe", setting, pl, listsched.Plan(
            [f for f, _, _ in ranks], [b for _, b, _ in ranks], cap), m, {"interleaving": "list"})
    except ScheduleError as e:
        if limit is None:
            raise
        err = e
    out["fixed"] = Schedule("bitpipe", pl, m, [fixed_order(p, m, *x) for x in ranks], {"interleaving": "fixed"})
    for s in out.values():
        s.meta["memory_claim"] = claim
    return out, err


def bitpipe(setting: Setting) -> Schedule:
    cands, err = interleavings(setting)
    limit = setting.memory_limit
    st = dataclasses.replace(setting, chunks=cands["fixed"].placement.chunks, memory_limit=None)
    best = None
    for s in cands.values():  # the list scheduler first: it is kept on a tie
        res = simulate(s, st)
        if limit is not None and max(res.peak_memory) > limit + 1e-9:
            continue
        if best is None or res.makespan < best[0] - 1e-9:
            best = (res.makespan, s)
    if best is None:
        raise ScheduleError(f"bitpipe cannot run its order under memory limit {limit:g}: a rank fills up "
                            f"before the gradient it waits for can come back (without a limit it needs "
                            f"{setting.stages} x mem-f at most; {err})") from None
    return best[1]
