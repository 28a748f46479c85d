"""Vocabulary parallelism in the schedule core: the output layer and loss spread over every pipeline
rank ("Balancing Pipeline Parallelism with Vocabulary Parallelism", Yeung et al., MLSys 2025),
as passes the core places into any schedule. Pure Python.

Each rank r holds a shard of the output layer (a slice of the vocabulary). Per microbatch j, after
the last stage's forward F(S-1, j) its hidden states reach every rank, and every rank runs:

* **VS** (S in the paper): its shard's logits, their local maximum and sum of exponentials, the
  target's logit where the target is in the shard; with one barrier also the shard's part of the
  input gradient, unnormalised (every rank's part is rescaled by the global maximum and sum later);
* **VT** (T): after the barrier the softmax of its shard and the logits' gradient; with two barriers
  also its part of the input gradient;
* **VW**: its shard's weight gradient (a W pass: the core may move it, like any W).

**Barriers** are collectives over the pipeline group that run beside the compute (asynchronous):
C0(j), once every rank's VS(·, j) ended, combines the statistics (and, with one barrier, the input
gradient's parts); with two barriers C1(j), once every rank's VT(·, j) ended, sums the input
gradient's parts. The last stage's backward of j waits for the last barrier (its output gradient).
A barrier takes ``cost_comm``; barriers run one after the other.

``add_vocab`` places the passes into a schedule without them: it replays the schedule's order and,
on every rank, runs a vocabulary pass as soon as it is ready (VT, then VS, before the rank's next
pass), and each VW in the rank's idle time or, at the latest, before the next VT (so one shard's
logits gradient is held at a time). Memory per rank: VS allocates ``mem_s`` (the logits shard, the
statistics), VT frees all but ``mem_w`` (what VW needs), VW frees the rest.

**The input embedding split too** (``VocabSetting.embedding``; the authors' fork does it): every
rank holds a shard of the embedding's rows (tied: its output shard). Per microbatch j every rank
runs **VI** (the first stage's rank reads the tokens and broadcasts them; every rank looks up its
rows, zeros elsewhere) and **VG** (its rows' weight gradient, a W-like pass). Barrier CI(j), once
every VI(·, j) ended, sums the partial outputs on the first stage's rank (``cost_ci``): F(0, j)
waits for it. Barrier CG(j), once B(0, j) ended, broadcasts the embedding output's gradient from
the first stage's rank (``cost_cg``): VG(·, j) waits for it. Each has its own link, microbatch by
microbatch. ``add_vocab`` runs VI(·, j) once F(0, j - 2) ended (two microbatches ahead), before any
other pass of the rank, and each VG as soon as its gradient is there. Memory (``mem_i``: the
embedding output): the first stage's rank holds the summed output from VI to F (F's own activation
counts it then) and the gradient from B to VG; every other rank the gradient's receive buffer from
VI (where it is posted) to VG.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .ir import B, BW, F, VG, VI, VOCAB_KINDS, VS, VT, VW, W, Action, Placement, Schedule, ScheduleError, Setting, deps

__all__ = ["VocabSetting", "BARRIER_KINDS", "Barriers", "vocab_deps", "key_rank", "add_vocab", "placed",
           "barrier_of", "delay_backwards"]

C0, C1, CI, CG = "C0", "C1", "CI", "CG"
BARRIER_KINDS = (C0, C1, CI, CG)
AHEAD = 4  # VI(·, j) runs once F(0, j - AHEAD) ended
EPS = 1e-9
INF = float("inf")


PER_RANK = ("cost_s", "cost_t", "cost_w", "mem_s", "mem_w", "cost_i", "cost_g")


def _tuple(name: str, v) -> Tuple[float, ...]:
    vals = [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else list(v)
    if not vals or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not (x >= 0 and x < float("inf"))
                       for x in vals):
        raise ScheduleError(f"vocabulary {name} must be non-negative numbers, got {v!r}")
    return tuple(float(x) for x in vals)


@dataclass(frozen=True)
class VocabSetting:
    """The vocabulary passes of one pipeline: one value, or one per rank (its shard's)."""

    barriers: int = 1
    cost_s: Sequence[float] = (1.0,)
    cost_t: Sequence[float] = (1.0,)
    cost_w: Sequence[float] = (1.0,)
    cost_comm: float = 0.0
    mem_s: Sequence[float] = (0.0,)
    mem_w: Sequence[float] = (0.0,)
    # the input embedding split over the ranks too (VI, VG, barriers CI and CG; see the module)
    embedding: bool = False
    cost_i: Sequence[float] = (0.0,)
    cost_g: Sequence[float] = (0.0,)
    cost_ci: float = 0.0
    cost_cg: float = 0.0
    mem_i: float = 0.0

    def __post_init__(self):
        if self.barriers not in (1, 2):
            raise ScheduleError(f"vocabulary parallelism has one or two barriers, got {self.barriers!r}")
        for k in PER_RANK:
            object.__setattr__(self, k, _tuple(k.replace("_", "-"), getattr(self, k)))
        if any(w > s + EPS for s, w in zip(self._full(self.mem_s, 1), self._full(self.mem_w, 1))):
            raise ScheduleError("vocabulary mem-w (what VW needs) cannot exceed mem-s (what VS allocates)")
        for k in ("cost_comm", "cost_ci", "cost_cg", "mem_i"):
            c = getattr(self, k)
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0 <= c < float("inf")):
                raise ScheduleError(f"vocabulary {k.replace('_', '-')} must be a non-negative number, got {c!r}")
        if not isinstance(self.embedding, bool):
            raise ScheduleError(f"vocabulary embedding is True or False, got {self.embedding!r}")

    @staticmethod
    def _full(vals, p):
        return list(vals) * p if len(vals) == 1 else list(vals)

    def check(self, p: int) -> "VocabSetting":
        for k in PER_RANK:
            n = len(getattr(self, k))
            if n not in (1, p):
                raise ScheduleError(f"vocabulary {k.replace('_', '-')} has {n} values; give one or one per rank ({p})")
        return self

    def _at(self, vals, rank: int) -> float:
        return vals[0] if len(vals) == 1 else vals[rank]

    def cost(self, kind: str, rank: int) -> float:
        return self._at({VS: self.cost_s, VT: self.cost_t, VW: self.cost_w, VI: self.cost_i, VG: self.cost_g}[kind],
                        rank)

    def mem(self, kind: str, rank: int) -> float:
        s, w = self._at(self.mem_s, rank), self._at(self.mem_w, rank)
        return {VS: s, VT: -(s - w), VW: -w, VI: self.mem_i, VG: -self.mem_i}[kind]

    def first_mem(self, kind: str, stage: Optional[int]) -> float:
        """With the embedding split, what the first stage's F and B change besides their own
        activations: F takes the summed output VI held (-mem_i), B leaves the gradient CG sends (+mem_i)."""
        if not self.embedding or stage != 0:
            return 0.0
        return {F: -self.mem_i, B: self.mem_i, BW: self.mem_i}.get(kind, 0.0)

    def to_dict(self) -> dict:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}
        if not self.embedding:  # as before the embedding could be split
            for k in ("embedding", "cost_i", "cost_g", "cost_ci", "cost_cg", "mem_i"):
                d.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "VocabSetting":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def barrier_of(kind: str, barriers: int) -> Optional[str]:
    """The barrier the passes of ``kind`` feed: VS -> C0; VT -> C1 with two barriers."""
    if kind == VS:
        return C0
    if kind == VT and barriers == 2:
        return C1
    return None


def vocab_deps(a: Action, placement: Placement, barriers: int, embedding: bool = False) -> List[Tuple[str, int, int]]:
    """``ir.deps`` for a schedule with vocabulary passes: VS after the last stage's forward, VT after
    C0, VW after its VT and the loss stage's rank's VT (the loss scale), the last stage's backward
    after the last barrier (its output gradient). ``embedding`` (split too): VI after the first
    stage's rank's VI (the tokens), the first stage's forward after CI, VG after CG."""
    last = placement.num_stages - 1
    if a.kind == VI:
        first = placement.rank_of(0)
        return [(VI, first, a.mb)] if a.stage != first else []
    if a.kind == VG:
        return [(CG, -1, a.mb)]
    if embedding and a.kind == F and a.stage == 0:
        return [(CI, -1, a.mb)]
    if a.kind == VS:
        return [(F, last, a.mb)]
    if a.kind == VT:
        return [(C0, -1, a.mb)]
    if a.kind == VW:  # and the per-token loss scale the loss stage's rank computes in its VT
        loss_rank = placement.rank_of(last)
        return [(VT, a.stage, a.mb)] + ([(VT, loss_rank, a.mb)] if loss_rank != a.stage else [])
    if a.kind in (B, BW) and a.stage == last:
        return [(C1 if barriers == 2 else C0, -1, a.mb)]
    return deps(a, placement.num_stages, placement)


def key_rank(key: Tuple[str, int, int], placement: Placement) -> Optional[int]:
    """The rank a dependency key's pass ran on (None for a barrier: it ends everywhere at once)."""
    if key[0] in BARRIER_KINDS:
        return None
    if key[0] in VOCAB_KINDS:
        return key[1]
    return placement.rank_of(key[1])


class Barriers:
    """When each barrier of each microbatch completes (``done`` gets (C0|C1|CI|CG, -1, mb) -> time)."""

    def __init__(self, p: int, vocab: VocabSetting, done: Dict):
        self.p, self.vocab, self.done = p, vocab, done
        self.ends: Dict[Tuple[str, int], List[float]] = {}
        # the links: one collective at a time on each (the output layer's; the embedding's sum; its gradient's)
        self.free = {C0: 0.0, CI: 0.0, CG: 0.0}
        self.cost = {C0: vocab.cost_comm, CI: vocab.cost_ci, CG: vocab.cost_cg}
        # the kinds whose passes feed a barrier: ``passed`` does nothing for the others (save the
        # first stage's backwards where the embedding is split)
        self.feeding = frozenset(k for k in (VS, VT, VI) if k == VI or barrier_of(k, vocab.barriers) is not None)

    def passed(self, a: Action, end: float) -> None:
        v = self.vocab
        if v.embedding and a.kind in (B, BW) and a.stage == 0:
            b, n = CG, 1  # the first stage's rank broadcasts the gradient
        else:
            b, n = (CI, self.p) if a.kind == VI else (barrier_of(a.kind, v.barriers), self.p)
        if b is None:
            return
        ends = self.ends.setdefault((b, a.mb), [])
        ends.append(end)
        if len(ends) == n:
            link = C0 if b == C1 else b
            start = max(max(ends), self.free[link])
            self.free[link] = start + self.cost[link]
            self.done[(b, -1, a.mb)] = self.free[link]
            del self.ends[(b, a.mb)]


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
