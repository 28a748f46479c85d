"""A schedule's compute passes coded once and timed by a work list: ``simulate``'s rules where
nothing else takes part (no host link, no overlapped pairs), with the same arithmetic, so to the
same times (a pass's start is the largest of its rank's previous end, its release and its inputs'
ends plus their hops, whatever the order they are worked out in). Pure Python.

Vocabulary passes (``core.ir.vocab``) are timed too where the schedule has one barrier and every rank
runs its VS in microbatch order: the barrier of microbatch j then completes after the one of j-1
(in ``simulate``'s loop as here), at max(its last VS's end, the previous barrier's end) + the
collective's time. With the input embedding split too, the same holds for VI and its barrier CI;
CG, fed by the first stage's backward alone, completes in the order that rank runs them. With two
barriers the two kinds share the link in the order ``simulate``'s loop meets them, so those
schedules are left to it (``ok`` False)."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

from ..ir import BW, OFFLOAD_KINDS, VG, VI, VS, VT, VW, Action, B, F, Schedule, Setting, W, deps
from ..ir.memo import Memo, setting_key
from .worklist import Vocab, run

__all__ = ["Plain", "Timed"]

#: the schedules coded in this process (``Plain.of``)
_CODED = Memo(16)


class Timed(NamedTuple):
    """One pass of a simulated timeline (a tuple underneath: a timeline holds every pass)."""

    action: Action
    rank: int
    start: float
    end: float


class Plain:
    """The passes of ``orders`` (compute passes per rank) coded for ``times``; ``ok`` is False where
    they are not each run once, wait for a pass no rank runs, or take part in what only
    ``simulate``'s own loop times (see the module); ``times`` gives None where they deadlock:
    ``simulate``'s loop then says what is wrong."""

    def __init__(self, orders: List[List[Action]], pl, setting: Setting):
        self.orders, self.ok = orders, False
        self._free = None  # (``times()``,) once worked out
        nst, rank_of, comm = pl.num_stages, pl.stage_to_rank, setting.cost_comm
        per_mb = setting.microbatch_costs is not None
        p = len(orders)
        idx: Dict[Tuple[str, int, int], int] = {}
        fed: Dict[str, Dict[int, int]] = {VS: {}, VI: {}}  # microbatch -> VS (VI) passes
        for r, order in enumerate(orders):
            last = {VS: None, VI: None}
            for a in order:
                key = (a.kind, a.stage, a.mb)
                if key in idx:
                    return
                if a.kind in (F, B, W, BW):
                    if not 0 <= a.stage < nst:
                        return
                elif a.kind in (VS, VT, VW, VI, VG):
                    if a.stage != r:
                        return
                    if a.kind in fed:  # in microbatch order (see the module)
                        if last[a.kind] is not None and a.mb <= last[a.kind]:
                            return
                        last[a.kind] = a.mb
                        fed[a.kind][a.mb] = fed[a.kind].get(a.mb, 0) + 1
                else:
                    return
                idx[key] = len(idx)
        vocab, emb = None, False
        if any(k[0] in (VS, VT, VW, VI, VG) for k in idx):
            vocab = setting.vocab
            if vocab is None or vocab.barriers != 1 or any(len(getattr(vocab, k)) not in (1, p) for k in
                                                         ("cost_s", "cost_t", "cost_w", "mem_s", "mem_w",
                                                          "cost_i", "cost_g")) \
                    or any(c != p for f in fed.values() for c in f.values()):
                return
            emb = vocab.embedding
            if not emb and (fed[VI] or any(k[0] == VG for k in idx)):
                return
        n = len(idx)
        # the barriers, link by link (C0; with the embedding split CI and CG): per link its barriers'
        # microbatches in the order they complete, and the cost of one
        first_rank = rank_of[0]
        cg_mbs = [a.mb for a in orders[first_rank] if a.kind in (B, BW) and a.stage == 0] if emb else []
        if len(set(cg_mbs)) != len(cg_mbs):
            return
        link_mbs = [sorted(fed[VS]), sorted(fed[VI]), cg_mbs]
        link_cost = [vocab.cost_comm, vocab.cost_ci, vocab.cost_cg] if vocab is not None else [0.0] * 3
        link_base, size = [], n
        for mbs in link_mbs:
            link_base.append(size)
            size += len(mbs)
        barrier = [{mb: link_base[L] + i for i, mb in enumerate(mbs)} for L, mbs in enumerate(link_mbs)]
        dep, hop, cost = [-1] * size, [0.0] * size, [0.0] * size
        dep2, hop2 = [-1] * size, [0.0] * size
        last = nst - 1
        loss_rank = rank_of[last]
        feeds: Dict[int, Tuple[int, int]] = {}  # pass code -> (link, index of the barrier it feeds)
        plain_deps = pl.paths is None  # ``ir.deps`` of one path, worked out here
        cost_of: Dict[Tuple[str, int, int], float] = {}
        x = -1  # each pass's code: the passes were numbered in this order
        for r, order in enumerate(orders):
            for a in order:
                x += 1
                k, s, mb = a.kind, a.stage, a.mb
                if per_mb:
                    cost[x] = setting.pass_cost(k, r, s, mb)
                else:
                    c = cost_of.get((k, r, s))
                    if c is None:
                        c = cost_of[(k, r, s)] = setting.pass_cost(k, r, s, None)
                    cost[x] = c
                if vocab is not None:
                    if k == VS or k == VI:
                        L = 0 if k == VS else 1
                        feeds[x] = (L, barrier[L][a.mb] - link_base[L])
                    elif emb and k in (B, BW) and a.stage == 0:
                        feeds[x] = (2, barrier[2][a.mb] - link_base[2])
                if vocab is not None and (k in (VS, VT, VW, VI, VG) or (k in (B, BW) and a.stage == last)
                                          or (emb and k == F and a.stage == 0)):
                    h = 0.0
                    if k == VS:
                        y = idx.get((F, last, a.mb))
                        h = comm if loss_rank != r else 0.0
                    elif k == VW:
                        y = idx.get((VT, r, a.mb))
                        if loss_rank != r:
                            z = idx.get((VT, loss_rank, a.mb))
                            if z is None:
                                return
                            dep2[x], hop2[x] = z, comm
                    elif k == VI:
                        if r == first_rank:
                            continue
                        y, h = idx.get((VI, first_rank, a.mb)), comm
                    elif k == VG:
                        y = barrier[2].get(a.mb)
                    elif k == F:  # the first stage's forward: the embedding's summed output (CI)
                        y = barrier[1].get(a.mb)
                    else:  # VT, and the loss stage's backward: the barrier
                        y = barrier[0].get(a.mb)
                    if y is None:
                        return
                    dep[x], hop[x] = y, h
                    continue
                if plain_deps:
                    if k == F:
                        if s == 0:
                            continue
                        ds = s - 1
                        y = idx.get((F, ds, mb))
                    elif k == W:
                        ds = s
                        y = idx.get((B, s, mb))
                    elif s < last:  # B or BW: the next stage's B or BW
                        ds = s + 1
                        y, z = idx.get((B, ds, mb)), idx.get((BW, ds, mb))
                        if y is not None and z is not None:
                            return
                        if y is None:
                            y = z
                    else:  # the last stage's backward: its own forward
                        ds = s
                        y = idx.get((F, s, mb))
                else:
                    d = deps(a, nst, pl)
                    if not d:
                        continue
                    dk, ds, dmb = d[0]
                    if dk == "B*":
                        y, z = idx.get((B, ds, dmb)), idx.get((BW, ds, dmb))
                        if y is not None and z is not None:
                            return
                        y = y if y is not None else z
                    else:
                        y = idx.get((dk, ds, dmb))
                if y is None:
                    return
                dep[x] = y
                if rank_of[ds] != r:
                    hop[x] = comm
        self.n, self.dep, self.hop, self.cost, self.dep2, self.hop2 = n, dep, hop, cost, dep2, hop2
        self.vocab = vocab is not None
        self.feeds = feeds
        self.links = [(link_base[L], len(link_mbs[L]), link_cost[L]) for L in range(3)]
        self.size = size
        first = 0
        self.codes = []  # the codes follow the orders, rank by rank
        for order in orders:
            self.codes.append(list(range(first, first + len(order))))
            first += len(order)
        self.ok = True

    @classmethod
    def of(cls, orders: List[List[Action]], pl, setting: Setting) -> "Plain":
        """``Plain(orders, pl, setting)``, remembered (``memo``): a row's schedule is timed by its
        validation, its iterations and, with vocabulary passes, their placement, each coding it anew."""
        return _CODED.get((tuple(map(tuple, orders)), pl, setting_key(setting)), lambda: cls(orders, pl, setting))

    @staticmethod
    def plain(schedule: Schedule, setting: Setting) -> bool:
        """Whether ``simulate`` times ``schedule`` (flattened) without host link or pairs."""
        return (schedule.meta.get("offload") is None
                and not any(a.kind in OFFLOAD_KINDS for o in schedule.orders for a in o)
                and not (schedule.meta.get("overlap_pairs") and setting.a2a_overlap and any(setting.cost_a2a)))

    def times(self, release: Optional[Dict[Tuple[int, int], float]] = None):
        """(start, end) per pass code, or None on a deadlock (shared lists: read, never change them).
        Without ``release`` worked out once (``of`` hands the same coding to every caller)."""
        if not release:
            if self._free is None:
                self._free = (self._times(None),)
            return self._free[0]
        return self._times(release)

    def _times(self, release):
        rel: List[Optional[Dict[int, float]]] = [None] * len(self.codes)  # per rank: position -> release
        for (rr, ii), v in (release or {}).items():
            rel[rr] = rel[rr] or {}
            rel[rr][ii] = v
        end: List[Optional[float]] = [None] * self.size
        start = [0.0] * self.n
        vocab = None
        if self.vocab:
            vocab = Vocab(self.dep2, self.hop2, self.feeds, self.links, [len(self.codes)] * 2 + [1])
        if not run(self.codes, self.dep, self.hop, self.cost, end, start, rel, None, vocab):
            return None
        return start, end

    def timeline(self, release=None) -> Optional[List[List[Timed]]]:
        t = self.times(release)
        if t is None:
            return None
        start, end = t
        return [[Timed(a, r, start[x], end[x]) for a, x in zip(o, c)]
                for r, (o, c) in enumerate(zip(self.orders, self.codes))]
