"""Schedules for microbatches of different costs (variable-length batches): a fast list-scheduling
pass over any schedule family's placement, timed with each microbatch's own costs.

A schedule generated for equal microbatches (the *template*) stays valid for any costs (its order
is what it is), but a long microbatch stalls the passes behind it. ``list_schedule`` builds each
rank's order again by simulating the pipeline with the real per-microbatch costs: whenever a rank is
free it runs

1. a backward (B, or the fused BW) whose output gradient has arrived, oldest microbatch first;
2. else a forward whose input has arrived and whose activation fits under the rank's cap (the
   template's own peak with every microbatch the reference one; each microbatch's activation
   counted with its own size, so a long one takes the room of several short ones and memory stays
   within the template's at the reference length; a rank's earlier chunks leave room for one
   forward of each later chunk, as large as the largest microbatch in flight, so the oldest
   microbatch can always go on), each stage's forwards in microbatch order (Megatron reads its
   data iterator in order);
3. else a W whose B has run (split backward), oldest first;
4. else it waits for the next message.

``per_microbatch`` keeps the shorter, with the real costs, of the template (where its activations,
each microbatch its own size, stay within the caps) and the list schedule. A few milliseconds at P=8, M=32: cheap enough to run for every iteration's lengths.
Deterministic (no clocks): every rank builds the same. Pure Python.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import BW, Action, B, F, Placement, Schedule, ScheduleError, Setting, W
from ..sim.plain import Plain
from ..sim.simulate import peak_memory, simulate

__all__ = ["list_schedule", "per_microbatch", "template_caps", "end_time", "within"]

EPS = 1e-9


def template_caps(template: Schedule, setting: Setting) -> List[float]:
    """Each rank's activation peak in the template, counted as if every microbatch were the
    reference one (the units ``list_schedule`` caps in)."""
    st = dataclasses.replace(setting, microbatch_costs=None, chunks=template.placement.chunks)
    return [peak_memory([a for a in o if a.is_compute], r, st) for r, o in enumerate(template.orders)]


def list_schedule(name: str, placement: Placement, setting: Setting, caps: Sequence[float], split: bool = True,
                  meta: Optional[dict] = None) -> Tuple[Schedule, float]:
    """Rank orders for ``setting.microbatches`` microbatches on ``placement``, built by list
    scheduling with ``setting``'s per-microbatch costs (module doc); ``caps``: per rank, in
    reference-microbatch activation units; ``split``: B and W apart (else fused BW). Returns the
    schedule and the end of its last pass (``end_time``'s value). Raises ``ScheduleError`` when
    the caps stall the pipeline."""
    pl = placement
    if pl.replicated:
        raise ScheduleError("list scheduling does not cover replicated stages")
    m, p, nst = setting.microbatches, pl.num_ranks, pl.num_stages
    st = setting if setting.chunks == pl.chunks else dataclasses.replace(setting, chunks=pl.chunks)
    unit = dataclasses.replace(st, microbatch_costs=None)
    bk = B if split else BW
    rank_of = pl.stage_to_rank
    cost = cost_table(st, pl, (F, B, W) if split else (F, BW))
    mem = {k: [unit.pass_mem(k, rank_of[s], s) for s in range(nst)] for k in ((F, B, W) if split else (F, BW))}
    size = st.microbatch_costs.factors["mem"] if st.microbatch_costs is not None else [1.0] * m
    held: List[Dict[int, float]] = [dict() for _ in range(p)]  # per rank, its microbatches in flight -> size
    comm = st.cost_comm
    stages = [pl.stages_of(r) for r in range(p)]
    # a rank's earlier chunks leave room for one forward of each later chunk: the oldest microbatch
    # can always go on to its next chunk, so the caps never stall the pipeline
    reserve = [0.0] * nst
    for r in range(p):
        acc = 0.0
        for s in reversed(stages[r]):
            reserve[s] = acc
            acc += mem[F][s]
    next_f = [0] * nst
    f_in: Dict[Tuple[int, int], float] = {(s, mb): 0.0 for s in range(nst) if s == 0 for mb in range(m)}
    b_wait: List[list] = [[] for _ in range(p)]  # per rank, heap of (arrival, mb, -stage) of output gradients
    b_ready: List[list] = [[] for _ in range(p)]  # per rank, heap of (mb, -stage) of those arrived
    w_todo: List[deque] = [deque() for _ in range(p)]
    used = [0.0] * p
    inflight = [0] * p
    free = [0.0] * p
    orders: List[List[Action]] = [[] for _ in range(p)]
    left = [len(stages[r]) * m * (3 if split else 2) for r in range(p)]
    events = [(0.0, r, r) for r in range(p)]
    serial = p
    last = 0.0
    while events:
        t, _, r = heapq.heappop(events)
        if free[r] > t + EPS or not left[r]:
            continue
        act = None
        wait, ready = b_wait[r], b_ready[r]
        while wait and wait[0][0] <= t + EPS:
            _, mb, ns = heapq.heappop(wait)
            heapq.heappush(ready, (mb, ns))
        if ready:
            mb, ns = heapq.heappop(ready)
            act = (bk, -ns, mb)
        else:
            cands = []
            for s in stages[r]:
                mb = next_f[s]
                if mb < m:
                    at = f_in.get((s, mb))
                    big = max(size[mb], max(held[r].values(), default=0.0))
                    if at is not None and at <= t + EPS and (used[r] + (mem[F][s] * size[mb] + reserve[s] * big)
                                                             <= caps[r] + EPS or (inflight[r] == 0 and not w_todo[r])):
                        cands.append((mb, -s))
            if cands:
                mb, ns = min(cands)
                act = (F, -ns, mb)
                next_f[-ns] += 1
            elif w_todo[r]:
                s, mb = w_todo[r].popleft()
                act = (W, s, mb)
        if act is None:
            continue  # a message will wake this rank (every arrival pushes an event)
        k, s, mb = act
        end = t + cost[k][s][mb]
        orders[r].append(Action(k, s, mb))
        used[r] += mem[k][s] * size[mb]
        left[r] -= 1
        free[r] = end
        last = max(last, end)
        if k == F:
            inflight[r] += 1
            held[r][mb] = size[mb]
            nxt = s + 1 if s + 1 < nst else None
            if nxt is None:
                heapq.heappush(b_wait[r], (end, mb, -s))
                heapq.heappush(events, (end, serial, r))
            else:
                q = rank_of[nxt]
                at = end + (comm if q != r else 0.0)
                f_in[(nxt, mb)] = at
                heapq.heappush(events, (at, serial, q))
        elif k in (B, BW):
            inflight[r] -= 1
            if s == min(stages[r]):  # its last backward on this rank: no longer in flight here
                held[r].pop(mb, None)
            if split:
                w_todo[r].append((s, mb))
            if s > 0:
                q = rank_of[s - 1]
                at = end + (comm if q != r else 0.0)
                heapq.heappush(b_wait[q], (at, mb, -(s - 1)))
                heapq.heappush(events, (at, serial, q))
        serial += 1
        heapq.heappush(events, (end, serial, r))
        serial += 1
    if any(left):
        stuck = [r for r in range(p) if left[r]]
        raise ScheduleError(f"{name}: list scheduling stalls under the activation caps on rank(s) {stuck}")
    return Schedule(name, pl, m, orders, dict(meta or {}, per_microbatch="list")), last


def cost_table(setting: Setting, placement: Placement, kinds: Sequence[str]) -> Dict[str, List[List[float]]]:
    """``setting.pass_cost(kind, rank, stage, mb)`` for every kind, stage and microbatch, computed
    as ``ir.Setting.pass_cost`` does, in bulk (the simulator's per-call cost adds up here)."""
    st = setting if setting.chunks == placement.chunks else dataclasses.replace(setting, chunks=placement.chunks)
    m, mc = st.microbatches, st.microbatch_costs
    ones = [1.0] * m
    fac = {k: (mc.factors[k] if mc is not None else ones) for k in (F, B, W, "tokens")}
    out = {}
    for k in kinds:
        rows = []
        for s in range(placement.num_stages):
            r = placement.rank_of(s)
            a2a = st._at(st.cost_a2a, r, s) if k in (F, B, BW) else 0.0
            if k in (F, B):
                c = st._at(st.cost_f if k == F else st.cost_b, r, s)
                rows.append([c * fk + a2a * tk for fk, tk in zip(fac[k], fac["tokens"])])
            elif k == W:
                c = st._at(st.cost_w, r, s)
                rows.append([c * fk for fk in fac[W]])
            elif st.cost_bw is not None:  # a fused backward of its own cost (``ir.Setting.pass_cost``)
                rows.append([st.pass_cost(BW, r, s, j) for j in range(m)])
            else:
                cb, cw = st._at(st.cost_b, r, s), st._at(st.cost_w, r, s)
                rows.append([cb * fb + cw * fw + a2a * tk for fb, fw, tk in zip(fac[B], fac[W], fac["tokens"])])
        out[k] = rows
    return out


def end_time(schedule: Schedule, setting: Setting) -> float:
    """End of the last pass, every rank starting at 0 (the synchronous iteration's compute): the
    simulator's timing of a plain schedule by the one timing engine (``core.sim.plain``), without
    the simulator's bookkeeping."""
    if setting.chunks != schedule.placement.chunks:
        setting = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    coded = Plain.of([[a for a in o if a.is_compute] for o in schedule.orders], schedule.placement, setting) \
        if plain(schedule) else None
    times = coded.times() if coded is not None and coded.ok else None
    if times is None:  # not plain, or it deadlocks: the simulator times it (or says where it is stuck)
        res = simulate(schedule, setting)
        return max((tl[-1].end for tl in res.timeline if tl), default=0.0)
    end = times[1]
    return max((end[c[-1]] for c in coded.codes if c), default=0.0)


def plain(schedule: Schedule) -> bool:
    """Whether list scheduling can stand in for ``schedule``: compute passes only (no overlapped
    pairs, vocabulary or offload actions), no replicated stages."""
    return (not schedule.placement.replicated and not schedule.meta.get("overlap_pairs")
            and all(a.kind in (F, B, W, BW) for o in schedule.orders for a in o))


def per_microbatch(setting: Setting, caps: Sequence[float], template: Optional[Schedule] = None,
                   placement: Optional[Placement] = None, split: bool = True, name: str = "",
                   meta: Optional[dict] = None, known: Optional[Tuple[Schedule, float]] = None) -> Tuple[Schedule, float]:
    """The shortest, with ``setting``'s per-microbatch costs, of ``template`` (a schedule for these
    microbatches built for equal ones; None: none at hand) and the list schedule under ``caps``
    (per rank); with its end time. Without a template, on
    ``placement`` (``split``: B/W apart). Raises ``ScheduleError`` when there is no template and
    list scheduling stalls. ``known``: the list schedule under ``caps`` already built for this
    setting, with its end (not built again). The template counts only where its activations, each
    microbatch its own size, stay within the caps (``within``): else it is the last resort."""
    best = None if known is None else (known[1], known[0])
    fallback = None
    if template is not None:
        timed = (end_time(template, setting), template)
        placement, name = template.placement, template.name
        split = template.uses_split_backward()
        if not plain(template):
            return timed[1], timed[0]
        if within(template, setting, caps):
            best = timed if best is None or timed[0] < best[0] - EPS else best
        else:
            fallback = timed
    stall = None
    if known is None:
        try:
            cand, t = list_schedule(name, placement, setting, caps, split, meta)
            if best is None or t < best[0] - EPS:
                best = (t, cand)
        except ScheduleError as e:
            stall = e
    best = best or fallback
    if best is None:
        raise stall
    return best[1], best[0]


def within(schedule: Schedule, setting: Setting, caps: Sequence[float]) -> bool:
    """Whether every rank's activations, each microbatch with its own size (``setting``'s
    per-microbatch costs), stay within its cap (reference units) -- or within what one microbatch
    alone holds there, where that is more."""
    unit = dataclasses.replace(setting, microbatch_costs=None, chunks=schedule.placement.chunks)
    st = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    mc = setting.microbatch_costs
    top = max(mc.factors["mem"]) if mc is not None else 1.0
    for r, o in enumerate(schedule.orders):
        alone = top * sum(unit.pass_mem(F, r, s) for s in schedule.placement.stages_of(r))
        if peak_memory([a for a in o if a.is_compute], r, st) > max(caps[r], alone) + EPS:
            return False
    return True
