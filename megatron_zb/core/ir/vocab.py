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

Here: the passes' costs and memory (``VocabSetting``), what each waits for (``vocab_deps``) and when
the barriers complete (``Barriers``); ``core.passes.vocab`` places the passes into a schedule.

**The input embedding split too** (``VocabSetting.embedding``; the authors' fork does it): every
rank holds a shard of the embedding's rows (tied: its output shard). Per microbatch j every rank
runs **VI** (the first stage's rank reads the tokens and broadcasts them; every rank looks up its
rows, zeros elsewhere) and **VG** (its rows' weight gradient, a W-like pass). Barrier CI(j), once
every VI(·, j) ended, sums the partial outputs on the first stage's rank (``cost_ci``): F(0, j)
waits for it. Barrier CG(j), once B(0, j) ended, broadcasts the embedding output's gradient from
the first stage's rank (``cost_cg``): VG(·, j) waits for it. Each has its own link, microbatch by
microbatch. Memory (``mem_i``: the
embedding output): the first stage's rank holds the summed output from VI to F (F's own activation
counts it then) and the gradient from B to VG; every other rank the gradient's receive buffer from
VI (where it is posted) to VG.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import BW, VG, VI, VOCAB_KINDS, VS, VT, VW, Action, B, F, Placement, Schedule, ScheduleError, Setting, W, deps

__all__ = ["VocabSetting", "BARRIER_KINDS", "Barriers", "vocab_deps", "key_rank", "barrier_of"]

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
