"""Vocabulary parallelism's passes placed into a schedule (the passes, their costs and the barriers'
rules: ``core.ir.vocab``). Pure Python.

``add_vocab`` places the passes into a schedule without them: it replays the schedule's order and,
on every rank, runs a vocabulary pass as soon as it is ready (VT, then VS, before the rank's next
pass), and each VW in the rank's idle time or, at the latest, before the next VT (so one shard's
logits gradient is held at a time). Memory per rank: VS allocates ``mem_s`` (the logits shard, the
statistics), VT frees all but ``mem_w`` (what VW needs), VW frees the rest. With the input embedding
split too, ``add_vocab`` runs VI(·, j) once F(0, j - AHEAD) ended, before any other pass of the rank,
and each VG as soon as its gradient is there.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import Dict, List, Optional, Tuple

from ..ir import BW, VG, VI, VS, VT, VW, Action, B, F, Schedule, ScheduleError, Setting, W
from ..ir.vocab import AHEAD, C0, CG, EPS, INF, Barriers, key_rank, vocab_deps

__all__ = ["add_vocab", "placed", "delay_backwards"]


def add_vocab(schedule: Schedule, setting: Setting, w_cap: int = 1) -> Schedule:
    """``schedule`` (without vocabulary passes; one path) with every rank's VS, VT and VW placed
    (see the module docstring); ``setting.vocab`` gives their costs. ``w_cap``: the most VW a rank
    may leave pending (their logits gradients held) before its next VT."""
    return placed(schedule, setting, w_cap)[0]


def placed(schedule: Schedule, setting: Setting, w_cap: int = 1, coded: Optional[Dict] = None) \
        -> Tuple[Schedule, bool]:
    """``add_vocab``, and whether ``w_cap`` ever decided (a rank held that many VW when its VT was
    ready): where it never did, every larger cap places the passes the same way. ``coded``: a dict
    kept between calls with one placement and setting (each pass's inputs and cost, worked out once)."""
    vocab = setting.vocab
    if vocab is None:
        raise ScheduleError("vocabulary passes need a vocabulary setting")
    pl = schedule.placement
    if pl.replicated:
        raise ScheduleError(f"vocabulary parallelism with replicated stages ({schedule.name}) is not supported: "
                            "each path would need its own output layer's shards")
    if any(a.is_vocab for o in schedule.orders for a in o):
        raise ScheduleError(f"schedule {schedule.name} already has vocabulary passes")
    p, m = pl.num_ranks, schedule.num_microbatches
    vocab.check(p)
    last = pl.num_stages - 1
    base = [deque(a for a in o if a.is_compute) for o in schedule.flat().orders]
    if any(a.kind not in (F, B, W, BW) for o in base for a in o):
        raise ScheduleError(f"vocabulary passes go into plain F/B/W schedules; {schedule.name} has others")
    done: Dict[Tuple[str, int, int], float] = {}
    barriers = Barriers(p, vocab, done)
    feeding = barriers.feeding
    clock = [0.0] * p
    nxt_s, nxt_t = [0] * p, [0] * p
    emb = vocab.embedding
    nxt_i, nxt_g = [0 if emb else m] * p, [0 if emb else m] * p  # VI, VG: in microbatch order
    first = pl.rank_of(0)
    pending_w: List[deque] = [deque() for _ in range(p)]
    orders: List[List[Action]] = [[] for _ in range(p)]
    comm = setting.cost_comm
    st = setting
    # each base pass coded once: its inputs (key, whether it crosses ranks: + cost_comm) and its cost
    coded = {} if coded is None else coded

    def code(r: int, a: Action):
        c = coded.get((r, a))
        if c is None:
            keys = vocab_deps(a, pl, vocab.barriers, emb)
            c = coded[(r, a)] = ([(key, key_rank(key, pl) not in (None, r)) for key in keys],
                                 st.pass_cost(a.kind, r, a.stage))
        return c

    info = [deque(code(r, a) for a in o) for r, o in enumerate(base)]
    cost_s, cost_t, cost_w, cost_i, cost_g = ([st.pass_cost(k, r, None) for r in range(p)] for k in (VS, VT, VW, VI, VG))
    loss_rank = pl.rank_of(last)

    def finished(r: int) -> bool:
        return not base[r] and nxt_s[r] == m and nxt_t[r] == m and not pending_w[r] and nxt_i[r] == m and \
            nxt_g[r] == m

    fin = [finished(r) for r in range(p)]  # each rank's, kept as its passes run
    live = [INF if f else 0.0 for f in fin]  # each rank's clock, INF once it is finished
    ordered = sorted(live)  # the same values in order: the earliest later clock of any rank

    def relive(r: int, v: float, left=bisect.bisect_left, insort=bisect.insort) -> None:
        del ordered[left(ordered, live[r])]
        insort(ordered, v)
        live[r] = v

    # the vocabulary passes as actions, made once for every variant placed with ``coded``
    acts = coded.get("actions")
    if acts is None:
        acts = coded["actions"] = {k: [[Action(k, r, j) for j in range(m)] for r in range(p)]
                                   for k in (VS, VT, VW, VI, VG)}
    a_s, a_t, a_w, a_i, a_g = (acts[k] for k in (VS, VT, VW, VI, VG))
    heap = [(0.0, r) for r in range(p)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    stalls, capped = 0, False
    while heap:
        t0, r = pop(heap)
        if fin[r] or t0 < clock[r] - EPS:
            if not fin[r] and t0 < clock[r] - EPS:
                push(heap, (clock[r], r))
            continue
        t = clock[r]
        lim = t + EPS
        # rank r's next passes whose inputs are known, and when they are ready: VT, VS, its own
        rt = rs = rb = ri = rg = None
        j = nxt_i[r]
        if j < m:  # VI: AHEAD microbatches before the first stage's forward, after the tokens
            e = 0.0 if j < AHEAD else done.get((F, 0, j - AHEAD))
            if e is not None and r != first:
                e2 = done.get((VI, first, j))
                e = None if e2 is None else max(e, e2 + comm)
            ri = e
        if nxt_g[r] < m:
            rg = done.get((CG, -1, nxt_g[r]))
        if nxt_t[r] < nxt_s[r]:
            e = done.get((C0, -1, nxt_t[r]))
            if e is not None:
                rt = max(0.0, e)
        if nxt_s[r] < m:
            e = done.get((F, last, nxt_s[r]))
            if e is not None:
                if loss_rank != r:
                    e += comm
                rs = max(0.0, e)
        if base[r]:
            rb = 0.0
            for key, cross in info[r][0][0]:
                e = done.get(key)
                if e is None:
                    rb = None
                    break
                if cross:
                    e += comm
                rb = max(rb, e)
        must_w = rt is not None and rt <= lim and len(pending_w[r]) >= w_cap  # gradients held: at most w_cap
        capped = capped or must_w
        a = None  # the pass rank r runs now, and its cost
        if ri is not None and ri <= lim:
            a, c = a_i[r][nxt_i[r]], cost_i[r]
            nxt_i[r] += 1
        elif rg is not None and rg <= lim:
            a, c = a_g[r][nxt_g[r]], cost_g[r]
            nxt_g[r] += 1
        elif not must_w and rt is not None and rt <= lim:
            a, c = a_t[r][nxt_t[r]], cost_t[r]
            nxt_t[r] += 1
            pending_w[r].append(a.mb)
        elif not must_w and rs is not None and rs <= lim:
            a, c = a_s[r][nxt_s[r]], cost_s[r]
            nxt_s[r] += 1
        elif not must_w and rb is not None and rb <= lim:
            a, c = base[r].popleft(), info[r].popleft()[1]
        else:
            # the earliest of its own passes' and the other unfinished ranks' later times (not r's: clock[r] = t)
            horizon = INF
            if rt is not None and lim < rt:
                horizon = rt
            if rs is not None and lim < rs < horizon:
                horizon = rs
            if rb is not None and lim < rb < horizon:
                horizon = rb
            if ri is not None and lim < ri < horizon:
                horizon = ri
            if rg is not None and lim < rg < horizon:
                horizon = rg
            i = bisect.bisect_right(ordered, lim)
            if i < p and ordered[i] < horizon:
                horizon = ordered[i]
            if horizon == INF:
                horizon = None
            if pending_w[r] and (must_w or horizon is None or
                                 horizon - t >= cost_w[r] - EPS or not base[r] and nxt_s[r] == m):
                a, c = a_w[r][pending_w[r].popleft()], cost_w[r]
            elif horizon is not None:
                clock[r] = horizon
                relive(r, horizon)
            else:
                stalls += 1
                if stalls > 4 * p + 8:
                    raise ScheduleError(f"vocabulary passes cannot be placed into {schedule.name}: rank {r} waits "
                                        f"at time {t:g} for a pass no rank can run")
                clock[r] = t + EPS
                relive(r, clock[r])
        if a is not None:  # it runs from t
            stalls = 0
            end = t + c
            clock[r] = end
            orders[r].append(a)
            kind = a.kind
            done[(kind, a.stage, a.mb)] = end
            if kind in (B, BW):
                done[("B*", a.stage, a.mb)] = end
            if kind in feeding or emb and a.stage == 0 and kind in (B, BW):
                barriers.passed(a, end)
            fin[r] = not base[r] and nxt_s[r] == m and nxt_t[r] == m and not pending_w[r] and nxt_i[r] == m and \
                nxt_g[r] == m
            relive(r, INF if fin[r] else end)
        if not fin[r]:
            push(heap, (clock[r], r))
    meta = dict(schedule.meta, vocab=vocab.to_dict())
    return Schedule(schedule.name, pl, m, orders, meta), capped


def delay_backwards(schedule: Schedule, k: int, only_loss: bool = False) -> Schedule:
    """Every rank's backward passes k forwards later in its order (each B or BW with the W's that
    follow it before the next forward), forwards and backwards each keeping their own order: the
    rank holds k more microbatches, and a backward waiting for a vocabulary barrier no longer
    stalls the forwards behind it (the paper's 1F1B with vocabulary parallelism holds p + 1 or
    p + 2 microbatches). ``only_loss``: only the loss stage's backwards (the ones a barrier feeds)."""
    if k <= 0:
        return schedule
    last = schedule.placement.num_stages - 1
    orders = []
    for o in schedule.flat().orders:
        out: List[Action] = []
        held: deque = deque()  # [countdown, [B, W...]]
        seq = [x for x in o if x.is_compute]
        f_after = [0] * (len(seq) + 1)  # forwards after each position: a backward with fewer behind it stays
        for i in range(len(seq) - 1, -1, -1):
            f_after[i] = f_after[i + 1] + (seq[i].kind == F)
        for i, a in enumerate(seq):
            if a.kind in (B, BW) and f_after[i] < k and not held:
                out.append(a)  # the cool-down: no forward left to let by
                continue
            if only_loss and a.kind != F and not (a.kind in (B, BW) and a.stage == last) and \
                    not (a.kind == W and a.stage == last):
                while held and any(x.mb <= a.mb for x in held[0][1]) and a.kind in (B, BW):
                    out += held.popleft()[1]  # a microbatch's backward chain starts at the loss stage
                out.append(a)
                continue
            if a.kind in (B, BW):
                held.append([k, [a]])
            elif a.kind == W and held and any(x.kind == B and x.stage == a.stage and x.mb == a.mb
                                              for _, grp in held for x in grp):
                next(grp for _, grp in held if any(x.kind == B and x.stage == a.stage and x.mb == a.mb
                                                   for x in grp)).append(a)
            elif a.kind == W:
                out.append(a)
            else:  # F
                out.append(a)
                for h in held:
                    h[0] -= 1
                while held and held[0][0] <= 0:
                    out += held.popleft()[1]
        while held:
            out += held.popleft()[1]
        orders.append(out)
    meta = dict(schedule.meta, vocab_delay=k)
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, orders, meta)
