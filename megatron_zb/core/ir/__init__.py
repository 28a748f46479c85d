"""The schedule IR: plain data, no torch.

A *stage* is a global model-chunk index in pipeline order (0 = embedding side, S-1 = loss side).
A *placement* maps stages to ranks. A *schedule* is, for every rank, the ordered list of actions
that rank executes. Compute actions are F (forward), B (input gradient), W (weight gradient) and
BW (fused backward). Lowering (``core.sim.lower``) adds SEND/RECV actions that name a peer rank.
A placement may replicate stages (``Placement.paths``): a logical stage then exists on several
ranks and each microbatch runs along one path of physical stages (BitPipe's two directions).
``core.passes.offload`` adds OFFLOAD/RELOAD actions (activation offload to host memory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .errors import ScheduleError, is_nonneg_number, setting_values

F, B, W, BW = "F", "B", "W", "BW"
COMPUTE_KINDS = (F, B, W, BW)
# Vocabulary parallelism (core.ir.vocab): the output layer and loss spread over every pipeline rank;
# each rank runs, per microbatch, VS (its vocabulary shard's forward), VT (its backward) and VW
# (the shard's weight gradient); with the input embedding split too (``core.vocab_input``) VI (its
# rows' lookup) and VG (their weight gradient). ``Action.stage`` of one is the rank whose shard it is.
VS, VT, VW, VI, VG = "VS", "VT", "VW", "VI", "VG"
VOCAB_KINDS = (VS, VT, VW, VI, VG)
# Lowered communication actions: the tensor of (stage, mb) produced by the named pass.
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
# A compound action: a forward and a backward (of other stages/microbatches) that a runtime with
# an overlap hook may run together (DualPipe's overlapped F&B). ``parts`` holds the two passes;
# without a hook they run one after the other, which is what the simulator assumes.
OVERLAP = "OVERLAP_F_B"
# Activation offload (core.passes.offload): OFFLOAD starts moving the activation F saved for (stage, mb)
# to host memory, RELOAD brings it back before its B; OFFLOAD_W / RELOAD_W do the same, after B,
# for the part W still needs. They run on the rank's host link, not on its compute stream.
OFFLOAD, RELOAD, OFFLOAD_W, RELOAD_W = "OFFLOAD", "RELOAD", "OFFLOAD_W", "RELOAD_W"
OFFLOAD_KINDS = (OFFLOAD, RELOAD, OFFLOAD_W, RELOAD_W)
ALL_KINDS = COMPUTE_KINDS + COMM_KINDS + (OVERLAP,) + OFFLOAD_KINDS + VOCAB_KINDS


class Action(NamedTuple):
    """One pass (or message, offload, pair) of a rank's order: immutable and hashable; a tuple
    underneath (the searches make, hash and compare millions of them)."""

    kind: str
    stage: int
    mb: int
    peer: Optional[int] = None  # only for SEND/RECV: the other rank
    parts: Optional[Tuple["Action", "Action"]] = None  # only for OVERLAP: (F, B or BW)

    def __str__(self) -> str:
        if self.parts is not None:
            return f"({self.parts[0]};{self.parts[1]}){self.kind}"
        s = f"{self.kind}{self.stage}.{self.mb}"
        return s if self.peer is None else f"{s}@{self.peer}"


    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE_OR_VOCAB

    @property
    def is_vocab(self) -> bool:
        return self.kind in VOCAB_KINDS

    @classmethod
    def overlap(cls, f: "Action", b: "Action") -> "Action":
        if f.kind != F or b.kind not in (B, BW):
            raise ScheduleError(f"an overlapped pair is a forward and a backward, got {f} and {b}")
        return cls(OVERLAP, -1, -1, None, (f, b))


_COMPUTE_OR_VOCAB = frozenset(COMPUTE_KINDS + (OVERLAP,) + VOCAB_KINDS)


@dataclass(frozen=True)
class Placement:
    """stage -> rank. ``style`` is informational: 'single', 'looped', 'v', 'bitpipe' or 'custom'.

    **Replicated stages** (``paths`` given): the model's logical stages exist more than once. Each
    path is a chain of (physical) stages, one per logical stage, in pipeline order; every
    microbatch runs along exactly one path (which one is read off the schedule: ``routes``), and
    the copies of a logical stage (its *replicas*, one per path) sum their weight gradients before
    the optimizer step. Without ``paths`` there is one implicit path 0, 1, ..., S-1 and everything
    behaves as before.
    """

    stage_to_rank: Tuple[int, ...]
    style: str = "custom"
    paths: Optional[Tuple[Tuple[int, ...], ...]] = None

    def __post_init__(self):
        if not self.stage_to_rank:
            raise ScheduleError("a placement needs at least one stage")
        ranks = sorted(set(self.stage_to_rank))
        if ranks != list(range(len(ranks))):
            raise ScheduleError(f"placement ranks must be 0..R-1 with none unused, got {ranks}")
        if self.paths is not None:
            paths = tuple(tuple(int(s) for s in p) for p in self.paths)
            object.__setattr__(self, "paths", paths)
            if len(paths) < 2 or len({len(p) for p in paths}) != 1 or not paths[0]:
                raise ScheduleError(f"replicated stages need at least two paths of equal, non-zero length, "
                                    f"got lengths {[len(p) for p in paths]}")
            flat = sorted(s for p in paths for s in p)
            if flat != list(range(len(self.stage_to_rank))):
                raise ScheduleError("the paths of a replicated placement must hold every stage exactly once")
            if len(paths[0]) % self.num_ranks:
                raise ScheduleError(f"{len(paths[0])} logical stages do not spread evenly over "
                                    f"{self.num_ranks} ranks")

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank) + 1

    @property
    def replicated(self) -> bool:
        return self.paths is not None

    @property
    def num_logical_stages(self) -> int:
        return len(self.paths[0]) if self.paths is not None else self.num_stages

    @property
    def models_per_rank(self) -> int:
        """Model chunks (stages) the busiest rank builds."""
        counts = [0] * self.num_ranks
        for r in self.stage_to_rank:
            counts[r] += 1
        return max(counts)

    @property
    def chunks(self) -> int:
        """Model chunks per rank, the unit of per-chunk costs (a pass costs the rank's value /
        chunks). With replicated stages: logical stages per rank (each path's share); the rank
        builds ``models_per_rank`` chunks."""
        if self.paths is not None:
            return self.num_logical_stages // self.num_ranks
        return self.models_per_rank

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> List[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among the stages its rank holds (0 = the earliest in the pipeline)."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    # -- paths (all of these work for plain placements too: one path 0..S-1) ------------------
    def _where(self):
        w = self.__dict__.get("_where_cache")
        if w is None:
            w = {s: (k, i) for k, p in enumerate(self.paths) for i, s in enumerate(p)}
            object.__setattr__(self, "_where_cache", w)
        return w

    def logical(self, stage: int) -> int:
        """The logical stage (position along its path) of a physical stage."""
        return stage if self.paths is None else self._where()[stage][1]

    def path_of(self, stage: int) -> int:
        return 0 if self.paths is None else self._where()[stage][0]

    def path(self, k: int) -> Tuple[int, ...]:
        return tuple(range(self.num_stages)) if self.paths is None else self.paths[k]

    @property
    def num_paths(self) -> int:
        return 1 if self.paths is None else len(self.paths)

    def is_first(self, stage: int) -> bool:
        return self.logical(stage) == 0

    def is_last(self, stage: int) -> bool:
        return self.logical(stage) == self.num_logical_stages - 1

    def next_stage(self, stage: int) -> Optional[int]:
        """The stage after ``stage`` on its path (None for the last)."""
        if self.paths is None:
            return stage + 1 if stage + 1 < self.num_stages else None
        k, i = self._where()[stage]
        return self.paths[k][i + 1] if i + 1 < len(self.paths[k]) else None

    def prev_stage(self, stage: int) -> Optional[int]:
        if self.paths is None:
            return stage - 1 if stage > 0 else None
        k, i = self._where()[stage]
        return self.paths[k][i - 1] if i > 0 else None

    def replicas(self, stage: int) -> List[int]:
        """Every physical stage holding the same logical stage as ``stage`` (itself included)."""
        if self.paths is None:
            return [stage]
        i = self.logical(stage)
        return [p[i] for p in self.paths]

    @property
    def loss_rank(self) -> int:
        """The rank that reports the losses: the one holding the last stage of path 0."""
        return self.rank_of(self.path(0)[-1])

    def weight_copies(self, rank: int) -> float:
        """Model weights this rank holds, in units of 1/num_ranks of the model (a 1F1B stage):
        1 for every plain even placement, 2 where each rank holds two replicas' worth."""
        return len(self.stages_of(rank)) * self.num_ranks / self.num_logical_stages

    @classmethod
    def single(cls, p: int) -> "Placement":
        return cls(tuple(range(p)), "single")

    @classmethod
    def looped(cls, p: int, v: int) -> "Placement":
        """Megatron's interleaving: stage s on rank s % p (rank r holds r, r+p, r+2p, ...)."""
        return cls(tuple(s % p for s in range(p * v)), "looped" if v > 1 else "single")

    @classmethod
    def vshape(cls, p: int) -> "Placement":
        """V: rank r holds stages r and 2p-1-r; embedding and loss both on rank 0."""
        return cls(tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)), "v")

    @classmethod
    def bitpipe(cls, p: int) -> "Placement":
        """BitPipe: two V pipelines in opposite directions over the same p ranks (p even).

        Path 0 ("down", stages 0..2p-1): logical stage l on rank l for l < p, else 2p-1-l (the V
        of ``vshape``). Path 1 ("up", stages 2p..4p-1): logical l on rank p-1-l for l < p, else
        l-p. Rank r holds four chunks; its replicas all live on rank p-1-r."""
        if p < 2 or p % 2:
            raise ScheduleError(f"the BitPipe placement needs an even number of ranks >= 2, got {p}")
        down = [l if l < p else 2 * p - 1 - l for l in range(2 * p)]
        up = [p - 1 - l if l < p else l - p for l in range(2 * p)]
        return cls(tuple(down + up), "bitpipe",
                   (tuple(range(2 * p)), tuple(range(2 * p, 4 * p))))

    def to_dict(self) -> dict:
        d = {"stage_to_rank": list(self.stage_to_rank), "style": self.style}
        if self.paths is not None:
            d["paths"] = [list(p) for p in self.paths]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        paths = d.get("paths")
        return cls(tuple(int(r) for r in d["stage_to_rank"]), d.get("style", "custom"),
                   None if paths is None else tuple(tuple(int(s) for s in p) for p in paths))


@dataclass
class Schedule:
    name: str
    placement: Placement
    num_microbatches: int
    orders: List[List[Action]]  # one ordered list per rank
    meta: Dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def compute_only(self) -> "Schedule":
        return Schedule(self.name, self.placement, self.num_microbatches,
                        [[a for a in o if a.is_compute] for o in self.orders], dict(self.meta))

    def uses_split_backward(self) -> bool:
        return any(a.kind == W for o in self.flat().orders for a in o)

    def flat(self) -> "Schedule":
        """Overlapped pairs expanded into their two passes; ``meta['overlap_pairs']`` then lists
        (rank, position of the F among the compute passes of the expanded lists). The schedule
        itself if it has none."""
        if not any(a.kind == OVERLAP for o in self.orders for a in o):
            return self
        orders, pairs = [], []
        for r, o in enumerate(self.orders):
            out = []
            n = 0  # compute passes so far (offload actions may lie between them)
            for a in o:
                if a.kind == OVERLAP:
                    pairs.append((r, n))
                    out += list(a.parts)
                    n += 2
                else:
                    out.append(a)
                    n += a.is_compute
            orders.append(out)
        return Schedule(self.name, self.placement, self.num_microbatches, orders,
                        dict(self.meta, overlap_pairs=pairs))


def deps(action: Action, num_stages: int, placement: Optional[Placement] = None) -> List[Tuple[str, int, int]]:
    """The compute passes (kind, stage, mb) an F/B/W/BW pass waits for.

    F(s) <- F(s-1); B|BW(s) <- B|BW(s+1) (the last stage: its own F); W(s) <- B(s).
    B-or-BW producers are returned with kind 'B*' (either satisfies the dependency).
    With a replicated ``placement``, s-1 and s+1 are the neighbours along the stage's path.
    """
    k, s, mb = action.kind, action.stage, action.mb
    if placement is not None and placement.paths is not None:
        if k == F:
            prev = placement.prev_stage(s)
            return [(F, prev, mb)] if prev is not None else []
        if k in (B, BW):
            nxt = placement.next_stage(s)
            return [("B*", nxt, mb)] if nxt is not None else [(F, s, mb)]
    if k == F:
        return [(F, s - 1, mb)] if s > 0 else []
    if k in (B, BW):
        return [("B*", s + 1, mb)] if s < num_stages - 1 else [(F, s, mb)]
    if k == W:
        return [(B, s, mb)]
    raise ScheduleError(f"no dependencies defined for {action}")


@dataclass
class Setting:
    """What a generator, the simulator and the planner need to know about one pipeline.

    Costs and memory come per *rank* (a whole stage: all layers a rank holds; with ``chunks``
    model chunks per rank each chunk's pass costs / allocates the rank's value divided by chunks)
    or per *model chunk* (one value per virtual stage, P x chunks of them in pipeline order, each
    the chunk's own time or memory: the way to describe a V rank's light first chunk beside its
    heavy last one, or any uneven layout). One value means the same for every rank. Each list is
    read on its own: per-chunk costs may come with per-rank memory and the other way round.
    A replicated placement (BitPipe) takes per-chunk values per *logical* stage: its paths are
    consecutive blocks of stages, so physical stage s reads value s mod (P x chunks).
    """

    stages: int  # pipeline ranks P
    microbatches: int
    chunks: Optional[int] = None  # model chunks per rank; None = the schedule's default
    cost_f: Sequence[float] = (1.0,)
    cost_b: Sequence[float] = (1.0,)
    cost_w: Sequence[float] = (1.0,)
    cost_comm: float = 0.0
    mem_f: Sequence[float] = (1.0,)
    # the fused backward's time (B and W in one pass, no W queue), where it is not B + W: a split
    # backward costs more on a GPU at small shapes (extra kernels, the W queue, inputs read twice).
    # None: B + W. The simulator charges a BW pass this, and B and W passes their own costs
    cost_bw: Optional[Sequence[float]] = None
    # what W still holds after B; default DEFAULT_MEM_W_RATIO * mem_f. Usually part of mem_f; more than
    # mem_f with full activation recompute (B recreates the layer, W keeps its GEMMs' inputs and gradients)
    mem_w: Optional[Sequence[float]] = None
    memory_limit: Optional[float] = None  # per rank, same units as mem_f
    # replicated stages: time of the gradient all-reduce between the replicas of a whole stage
    # (all layers of a 1F1B stage; a chunk's share is cost_sync / chunks). Only charged where a
    # placement has replicated stages.
    cost_sync: float = 0.0
    # MoE expert parallelism: one microbatch's all-to-all (dispatch + combine) in an F, B or BW of a
    # whole stage, part of the pass and serial with its compute; inside an overlapped F&B pair
    # (dualpipe-v's OVERLAP_F_B) each pass's all-to-all hides behind the other's compute unless
    # a2a_overlap is False. W has none.
    cost_a2a: Sequence[float] = (0.0,)
    a2a_overlap: bool = True
    # vocabulary parallelism (``core.ir.vocab.VocabSetting``): its passes' costs, memory, barriers
    vocab: Optional[object] = None
    # variable-length microbatches (``core.costs.microbatch_costs.MicrobatchCosts``): per microbatch, the
    # factor on each pass kind's cost and on its memory against the values above (a microbatch of
    # the reference length has 1); None: every microbatch alike
    microbatch_costs: Optional[object] = None

    def __post_init__(self):
        p = self.stages
        if not isinstance(p, int) or p < 1:
            raise ScheduleError(f"stages must be an integer >= 1, got {p!r}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"microbatches must be an integer >= 1, got {self.microbatches!r}")
        if self.chunks is not None and (not isinstance(self.chunks, int) or self.chunks < 1):
            raise ScheduleError(f"chunks must be an integer >= 1, got {self.chunks!r}")
        self.cost_f = setting_values("cost-f", self.cost_f, p, self.chunks)
        self.cost_b = setting_values("cost-b", self.cost_b, p, self.chunks)
        self.cost_w = setting_values("cost-w", self.cost_w, p, self.chunks)
        if self.cost_bw is not None:
            self.cost_bw = setting_values("cost-bw", self.cost_bw, p, self.chunks)
        self.cost_a2a = setting_values("cost-a2a", self.cost_a2a, p, self.chunks)
        self.mem_f = setting_values("mem-f", self.mem_f, p, self.chunks)
        if self.mem_w is None:
            self.mem_w = [DEFAULT_MEM_W_RATIO * x for x in self.mem_f]
        self.mem_w = setting_values("mem-w", self.mem_w, p, self.chunks)
        if not is_nonneg_number(self.cost_comm):
            raise ScheduleError(f"cost-comm must be a non-negative number, got {self.cost_comm!r}")
        if not is_nonneg_number(self.cost_sync):
            raise ScheduleError(f"cost-sync must be a non-negative number, got {self.cost_sync!r}")
        if self.memory_limit is not None and not (is_nonneg_number(self.memory_limit)):
            raise ScheduleError(f"memory-limit must be a non-negative number, got {self.memory_limit!r}")
        if self.microbatch_costs is not None:
            self.microbatch_costs.check(self.microbatches)
        # pass_cost / pass_mem by (what, kind, rank, stage, mb), filled as they are asked for: the
        # searches ask millions of times. A Setting is never changed once made
        self._passes: Dict[tuple, float] = {}

    @property
    def per_chunk(self) -> bool:
        """Whether any cost or memory is given per model chunk."""
        return any(len(x) != self.stages for x in (self.cost_f, self.cost_b, self.cost_w, self.cost_a2a,
                                                   self.mem_f, self.mem_w, self.cost_bw or ()) if x)

    def _at(self, values: Sequence[float], rank: int, stage: Optional[int]) -> float:
        """One chunk's share of ``values``: its own value (per chunk) or the rank's / chunks."""
        if len(values) == self.stages:
            return values[rank] / (self.chunks or 1)
        if stage is None:
            raise ScheduleError("per-chunk costs need the stage of the pass (internal: pass_cost without stage)")
        return values[stage % len(values)]

    def _k(self, what: str, mb: Optional[int]) -> float:
        """Microbatch ``mb``'s factor on ``what`` (a pass kind, 'tokens' or 'mem'; 1 without one)."""
        return 1.0 if mb is None or self.microbatch_costs is None else self.microbatch_costs.factor(what, mb)

    def pass_cost(self, kind: str, rank: int, stage: Optional[int] = None, mb: Optional[int] = None) -> float:
        """Time of one pass of one chunk (stage ``stage`` on ``rank``): its compute and, for
        F/B/BW, its all-to-all. ``mb``: the microbatch, where microbatches differ
        (``microbatch_costs``; without it, or without ``mb``, every microbatch costs the same)."""
        return self._cached(("c", kind, rank, stage, mb), self._pass_cost)

    def _cached(self, key: tuple, fn) -> float:
        v = self._passes.get(key)
        if v is None:
            v = self._passes[key] = fn(*key[1:])
        return v

    def _pass_cost(self, kind: str, rank: int, stage: Optional[int], mb: Optional[int]) -> float:
        if kind in VOCAB_KINDS:
            return self.vocab.cost(kind, rank) if self.vocab is not None else 0.0
        a2a = self.pass_a2a(kind, rank, stage, mb)
        if kind in (F, B):
            return self._at(self.cost_f if kind == F else self.cost_b, rank, stage) * self._k(kind, mb) + a2a
        if kind == W:
            return self._at(self.cost_w, rank, stage) * self._k(W, mb)
        if kind == BW:
            b, w = self._at(self.cost_b, rank, stage), self._at(self.cost_w, rank, stage)
            split = b * self._k(B, mb) + w * self._k(W, mb)
            if self.cost_bw is None:
                return split + a2a
            fused = self._at(self.cost_bw, rank, stage)  # (a microbatch's factor: B's and W's, weighted)
            return (fused * split / (b + w) if b + w > 0 else fused * self._k(B, mb)) + a2a
        return 0.0

    def pass_a2a(self, kind: str, rank: int, stage: Optional[int] = None, mb: Optional[int] = None) -> float:
        """The all-to-all part of ``pass_cost`` (0 for W)."""
        return self._at(self.cost_a2a, rank, stage) * self._k("tokens", mb) if kind in (F, B, BW) else 0.0

    def pass_mem(self, kind: str, rank: int, stage: Optional[int] = None, mb: Optional[int] = None) -> float:
        """Change of rank memory caused by one pass of one chunk (``mb``: as for ``pass_cost``;
        activations scale with the microbatch's tokens)."""
        return self._cached(("m", kind, rank, stage, mb), self._pass_mem)

    def _pass_mem(self, kind: str, rank: int, stage: Optional[int], mb: Optional[int]) -> float:
        if kind in VOCAB_KINDS:
            return self.vocab.mem(kind, rank) if self.vocab is not None else 0.0
        if self.vocab is not None and stage == 0:  # the input embedding split: its output and gradient
            return self.vocab.first_mem(kind, stage) + self._own_mem(kind, rank, stage, mb)
        return self._own_mem(kind, rank, stage, mb)

    def _own_mem(self, kind: str, rank: int, stage: Optional[int], mb: Optional[int]) -> float:
        k = self._k("mem", mb)
        if kind == F:
            return self._at(self.mem_f, rank, stage) * k
        if kind == B:
            return -(self._at(self.mem_f, rank, stage) - self._at(self.mem_w, rank, stage)) * k
        if kind == W:
            return -self._at(self.mem_w, rank, stage) * k
        if kind == BW:
            return -self._at(self.mem_f, rank, stage) * k
        return 0.0

    def rank_values(self, name: str, placement: "Placement") -> List[float]:
        """Per rank, the whole stage's value of ``name`` ('cost_f', 'mem_f', ...): the rank's
        own, or the sum over the chunks it holds (per-chunk values; a replicated placement's
        rank counts one path's share, as a microbatch runs through one path)."""
        values = getattr(self, name)
        if len(values) == self.stages:
            return list(values)
        out = [0.0] * self.stages
        for s in range(placement.num_stages):
            out[placement.rank_of(s)] += values[s % len(values)] / placement.num_paths
        return out

    def stage_peak_unit(self, placement: "Placement") -> float:
        """The largest whole-stage activation of a rank (1F1B's peak is P of these)."""
        return max(self.rank_values("mem_f", placement))

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, (list, tuple)) else v.to_dict() if hasattr(v, "to_dict") else v)
                for k, v in self.__dict__.items() if not k.startswith("_")}


# M_W / M_B for the default mem-w. Megatron's per-layer formula gives M_B = 34h + 5as and
# M_W = 32h: the ratio is ~0.94 with flash attention (no 5as term) and ~0.2 for long sequences
# without it. 0.5 sits between; pass --mem-w for your model (``megatron-zb plan`` computes it).
DEFAULT_MEM_W_RATIO = 0.5
