"""Lowering: add explicit SEND/RECV actions to a compute schedule.

Every dependency between passes on different ranks becomes one message: a SEND on the producer's
rank right after the producer and a RECV on the consumer's rank. Dependencies between stages on
the same rank (the V turn-around, or any local hand-over) need no message.

Ordering rule (deadlock-free on gloo and NCCL alike): the schedule is simulated once; a message is
"sent" when its producer ends, and its RECV is posted on the consumer's rank in the gap before the
first pass that starts at or after that moment. Within one gap, communication actions are sorted
by a global key (send time, sender rank, sender position). Hence for every pair of ranks both
sides see that pair's messages in the same order: receives match sends first-in first-out without
tags, and no pair can wait on each other in opposite orders.

Action fields for messages: ``stage`` is the stage of the rank that holds the action (SEND_F:
the producing stage s, its peer holds s+1; RECV_F: the consuming stage s, its peer holds s-1;
SEND_B: the stage whose input gradient is sent to s-1; RECV_B: the stage whose output gradient
comes from s+1), ``peer`` the other rank. With replicated stages s-1 and s+1 are the neighbours
along the stage's path.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from ..ir import (BW, OFFLOAD_KINDS, RECV_B, RECV_F, SEND_B, SEND_F, VI, VS, VT, Action, B, F, Schedule, ScheduleError,
                  Setting)
from .simulate import simulate


def lower(schedule: Schedule, setting: Optional[Setting] = None, result=None) -> Schedule:
    """Return a copy of ``schedule`` with SEND/RECV actions inserted (compute order unchanged).

    Overlapped pairs come out as their two passes; ``meta['overlap_pairs']`` then lists
    (rank, position of the F, position of the B) in the lowered lists. ``result``: the
    simulation of this (flat) schedule with ``setting``, where already at hand (not run again)."""
    if schedule.flat() is not schedule:
        result = None
    schedule = schedule.flat()
    if any(not a.is_compute and a.kind not in OFFLOAD_KINDS for o in schedule.orders for a in o):
        raise ScheduleError("schedule is already lowered (it has SEND/RECV actions)")
    # OFFLOAD/RELOAD actions keep their place: after the messages of the gap they sit in
    local: List[Dict[int, List[Action]]] = []
    for o in schedule.orders:
        gaps: Dict[int, List[Action]] = defaultdict(list)
        n = 0
        for a in o:
            if a.is_compute:
                n += 1
            else:
                gaps[n].append(a)
        local.append(gaps)
    pl = schedule.placement
    st = setting or Setting(pl.num_ranks, max(1, schedule.num_microbatches), chunks=pl.chunks)
    res = result if result is not None else simulate(schedule, st)
    # (rank, position) of every compute pass, and its simulated start/end
    timed = res.timeline  # per rank, in list order
    # inserted[rank][gap] = list of (key, action); gap g = just before compute pass g
    inserted: List[Dict[int, List[Tuple[tuple, Action]]]] = [defaultdict(list) for _ in timed]
    for q, tl in enumerate(timed):
        for i, t in enumerate(tl):
            a = t.action
            msgs = []
            nxt, prev = pl.next_stage(a.stage), pl.prev_stage(a.stage)
            if a.kind == F and nxt is not None and pl.rank_of(nxt) != q:
                msgs.append((SEND_F, RECV_F, nxt))
            if a.kind in (B, BW) and prev is not None and pl.rank_of(prev) != q:
                msgs.append((SEND_B, RECV_B, prev))
            for send_kind, recv_kind, dst_stage in msgs:
                r = pl.rank_of(dst_stage)
                key = (t.end, q, i)
                inserted[q][i + 1].append((key, Action(send_kind, a.stage, a.mb, r)))
                gap = _first_start_at_or_after(timed[r], t.end)
                inserted[r][gap].append((key, Action(recv_kind, dst_stage, a.mb, q)))
    orders, where = [], []
    for r, tl in enumerate(timed):
        out: List[Action] = []
        pos = {}
        for g in range(len(tl) + 1):
            out += [a for _, a in sorted(inserted[r].get(g, ()), key=lambda x: x[0])]
            out += local[r].get(g, [])
            if g < len(tl):
                pos[g] = len(out)
                out.append(tl[g].action)
        orders.append(out)
        where.append(pos)
    meta = dict(schedule.meta, lowered=True)
    if "overlap_pairs" in meta:
        meta["overlap_pairs"] = [(r, where[r][i], where[r][i + 1]) for r, i in meta["overlap_pairs"]]
    return dataclasses.replace(schedule, orders=orders, meta=meta)


def _first_start_at_or_after(tl, t: float) -> int:
    lo, hi = 0, len(tl)
    while lo < hi:  # timeline starts are non-decreasing per rank
        mid = (lo + hi) // 2
        if tl[mid].start < t:
            lo = mid + 1
        else:
            hi = mid
    return lo


def forward_only(schedule: Schedule) -> Schedule:
    """The forward passes of ``schedule`` in the same per-rank order (evaluation); with vocabulary
    parallelism also the passes that compute the loss (VS, VT: the statistics and the loss, no
    gradients) and, with the embedding split, the lookups (VI). Dropping actions nothing kept
    depends on keeps the order deadlock-free."""
    schedule = schedule.flat()
    meta = {k: v for k, v in schedule.meta.items() if k not in ("overlap_pairs", "offload")}
    orders = [[a for a in o if a.kind in (F, VS, VT, VI)] for o in schedule.orders]
    return dataclasses.replace(schedule, name=schedule.name + "/forward-only", orders=orders,
                               meta=dict(meta, forward_only=True))


def check_pair_order(lowered: Schedule) -> None:
    """Every pair of ranks sees its messages in the same order on both sides; each RECV is
    posted before the pass that consumes it and each SEND comes after its producer."""
    pl = lowered.placement
    pair_seq: Dict[Tuple[int, int], Dict[int, list]] = defaultdict(dict)
    for r, order in enumerate(lowered.orders):
        done = set()
        seqs = defaultdict(list)
        for i, a in enumerate(order):
            if a.is_compute:
                done.add((a.kind, a.stage, a.mb))
                continue
            if a.kind in OFFLOAD_KINDS:
                continue
            if a.kind in (SEND_F, SEND_B):
                need = (F, a.stage, a.mb) if a.kind == SEND_F else None
                if need and need not in done:
                    raise ScheduleError(f"rank {r} position {i}: {a} comes before its producer")
                if a.kind == SEND_B and (B, a.stage, a.mb) not in done and (BW, a.stage, a.mb) not in done:
                    raise ScheduleError(f"rank {r} position {i}: {a} comes before its producer")
                src, dst = r, a.peer
                msg = ("F" if a.kind == SEND_F else "B", a.stage, a.mb, src, dst)
            else:
                consumers = [(F, a.stage, a.mb)] if a.kind == RECV_F else [(B, a.stage, a.mb), (BW, a.stage, a.mb)]
                if any(c in done for c in consumers):
                    raise ScheduleError(f"rank {r} position {i}: {a} is posted after its consumer")
                src, dst = a.peer, r
                # name the message by its producer's stage so both sides agree
                ps = pl.prev_stage(a.stage) if a.kind == RECV_F else pl.next_stage(a.stage)
                msg = ("F" if a.kind == RECV_F else "B", ps, a.mb, src, dst)
            seqs[tuple(sorted((src, dst)))].append(msg)
        for pair, seq in seqs.items():
            pair_seq[pair][r] = seq
    for pair, sides in pair_seq.items():
        a, b = pair
        if sides.get(a, []) != sides.get(b, []):
            raise ScheduleError(f"ranks {a} and {b} see their messages in different orders")

