"""A split backward only where the schedule uses it: a B and the W of the same microbatch and chunk
that a rank runs back to back (nothing between them in its order) become one fused BW pass, where
the split costs time (``Setting.cost_bw`` below B + W) and the fusion delays no other pass.

Fusing saves the split's cost on the rank but hands the input gradient on at the BW's end, not the
B's. So a pair is fused only where every pass that waits for that gradient starts, in the schedule's
simulation, no earlier than the fused pass would deliver it (plus the hop to another rank): then no
pass starts later than it did (each pass's inputs end no later, each rank's passes are no longer),
and the iteration is no longer. The first stage's backward feeds no one: its pairs always fuse.

The runtime runs a BW as one backward with no W queue entry; memory is the same (B then W back to
back free what the BW frees). Not applied to schedules with overlapped F&B pairs (their positions
are part of the schedule). Pure Python.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from ..ir import BW, OVERLAP, Action, B, Schedule, Setting, W, deps
from ..sim.simulate import simulate
from ..sim.split import split_costs, split_free

__all__ = ["fuse_adjacent", "split_cost"]


def fuse_adjacent(sched: Schedule, setting: Setting) -> Schedule:
    """``sched`` with its back-to-back B;W pairs fused where that costs no pass any time (module
    docstring); ``sched`` itself where there is nothing to fuse."""
    pl = sched.placement
    kinds = {a.kind for o in sched.orders for a in o}
    if W not in kinds or OVERLAP in kinds or sched.meta.get("overlap_pairs") or not split_costs(setting, pl):
        return sched
    res = simulate(sched, setting)
    start: Dict[Tuple[str, int, int], Tuple[int, float]] = {}  # (kind, stage, mb) -> (rank, start)
    for line in res.timeline:
        for t in line:
            start[(t.action.kind, t.action.stage, t.action.mb)] = (t.rank, t.start)
    waiting = _waiting(res.timeline, sched, setting)
    comm, orders, fused = setting.cost_comm, [], 0
    for r, order in enumerate(sched.orders):
        out: List[Action] = []
        i = 0
        while i < len(order):
            a = order[i]
            nxt = order[i + 1] if i + 1 < len(order) else None
            if a.kind == B and nxt is not None and (nxt.kind, nxt.stage, nxt.mb) == (W, a.stage, a.mb):
                s = a.stage
                saving = setting.pass_cost(B, r, s, a.mb) + setting.pass_cost(W, r, s, a.mb) - \
                    setting.pass_cost(BW, r, s, a.mb)
                ready = start[(B, s, a.mb)][1] + setting.pass_cost(BW, r, s, a.mb)  # the gradient, fused
                if saving > 1e-12 and all(ready + (comm if q != r else 0.0) <= t + 1e-9
                                          for q, t in waiting.get((s, a.mb), ())):
                    out.append(Action(BW, s, a.mb))
                    fused += 1
                    i += 2
                    continue
            out.append(a)
            i += 1
        orders.append(out)
    if not fused:
        return sched
    return dataclasses.replace(sched, orders=orders, meta={**sched.meta, "fused_backwards": fused})


def _waiting(timeline, sched: Schedule, setting: Setting) -> Dict[Tuple[int, int], List[Tuple[int, float]]]:
    """(stage, mb) -> (rank, start) of every pass that waits for that backward's input gradient: the
    previous stage's backward (``ir.deps``; vocabulary passes never wait for a backward). With the
    input embedding split (``core.ir.vocab``) the first stage's backward feeds a collective every
    rank's VG waits for: those pairs are not fused (an infinitely early start stands for them)."""
    pl = sched.placement
    out: Dict[Tuple[int, int], List[Tuple[int, float]]] = {}
    for line in timeline:
        for t in line:
            if t.action.kind in (B, BW):
                for kind, s, mb in deps(t.action, pl.num_stages, pl):
                    if kind == "B*":
                        out.setdefault((s, mb), []).append((t.rank, t.start))
    vocab = setting.vocab
    if vocab is not None and vocab.embedding and any(a.is_vocab for o in sched.orders for a in o):
        for mb in range(sched.num_microbatches):
            out.setdefault((0, mb), []).append((-1, float("-inf")))
    return out


def split_cost(sched: Schedule, setting: Setting) -> float:
    """The time per training iteration (Megatron's synchronous step) ``sched``'s split backwards cost
    it: its time against its time with every split pass costing what the fused backward does
    (``Setting.split_free``). 0 where the split costs nothing or the schedule runs no W."""
    pl = sched.placement
    if not split_costs(setting, pl) or not any(a.kind == W for o in sched.orders for a in o):
        return 0.0
    return _compute_span(sched, setting) - _compute_span(sched, split_free(setting, pl))  # (the step cancels)


def _compute_span(sched: Schedule, setting: Setting) -> float:
    """The synchronous iteration's compute: the last pass's end less the first's start, any rank."""
    tl = [line for line in simulate(sched, setting).timeline if line]
    return max(line[-1].end for line in tl) - min(line[0].start for line in tl) if tl else 0.0
