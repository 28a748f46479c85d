"""The balancer: one global batch's sequences onto data-parallel replicas and microbatches.

Megatron's data path hands every replica the same number of microbatches, in the order the
sequences come (``sequential``): with lengths that vary 10-100x, one replica draws the long ones
and the others wait for it at the gradient reduction. Megatron's DDP and distributed optimizer
reduce gradients once per iteration, so a replica may just as well run *fewer, longer* or *more,
shorter* microbatches than another (ODC's observation for FSDP): the balancer

1. splits the sequences over the D replicas by their cost (``karmarkar_karp``: the largest
   differencing method, k-way), then moves and swaps sequences between the busiest replica and the
   others while that lowers the busiest one's cost (``refine``);
2. forms each replica's microbatches (``microbatches``): padded (n rows of the longest: sequences of
   similar length together, ``micro_batch_size`` a microbatch) or packed (Megatron's packed-sequence
   format: up to ``max_tokens`` tokens a microbatch, as many microbatches as makes the pipeline
   shortest by ``pipeline_estimate``, the sequences spread over them by cost).

The order of the microbatches and the pipeline schedule for them come after (``core.varlen.batch``).
The gradient stays the unbalanced run's when the loss is normalised over the global token count
(Megatron's ``--calculate-per-token-loss``): every token counts once, whichever replica and
microbatch holds it. Pure Python, deterministic (every rank computes the same assignment).
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, List, Optional, Sequence

from ..ir import ScheduleError

__all__ = ["sequential", "karmarkar_karp", "refine", "split_replicas", "microbatches", "pipeline_estimate"]

EPS = 1e-12


def sequential(n: int, replicas: int, micro_batch_size: int = 1) -> List[List[List[int]]]:
    """Megatron's order (its pretraining sampler): consecutive groups of ``micro_batch_size x
    replicas`` sequences, replica d taking rows d*mbs .. (d+1)*mbs - 1 of each group as its next
    microbatch. Returns replica -> microbatch -> sequence indices."""
    group = micro_batch_size * replicas
    if n < group or n % group:
        raise ScheduleError(f"a global batch of {n} sequences does not split into microbatches of "
                            f"{micro_batch_size} sequence(s) on {replicas} data-parallel replica(s): Megatron needs a "
                            f"multiple of {group} (micro-batch size x data-parallel size)")
    return [[list(range(k * group + d * micro_batch_size, k * group + (d + 1) * micro_batch_size))
             for k in range(n // group)] for d in range(replicas)]


def karmarkar_karp(costs: Sequence[float], k: int) -> List[List[int]]:
    """Indices of ``costs`` in ``k`` parts of nearly equal sums: the largest differencing method.
    Every item starts as a k-tuple (itself and k-1 empty parts); the two tuples whose largest and
    smallest parts differ most are merged, the largest part of one with the smallest of the other,
    until one tuple is left. Deterministic; parts ordered by decreasing sum."""
    if k < 1:
        raise ScheduleError(f"partitioning needs at least one part, got {k}")
    heap = []
    for n, i in enumerate(sorted(range(len(costs)), key=lambda j: (costs[j], j))):
        parts = [(float(costs[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
        heap.append((-float(costs[i]), n, parts))
    heapq.heapify(heap)
    serial = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)),
                        key=lambda x: (-x[0], x[1][:1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), serial, merged))
        serial += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(items) for _, items in heap[0][2]]


def refine(parts: List[List[int]], costs: Sequence[float], rounds: int = 1000,
           extra: Optional[Sequence[float]] = None) -> List[List[int]]:
    """Lower the busiest part's time: move one item from it to another part, or swap an item of it
    with a cheaper one, whichever leaves the pair's larger time least, while that helps (at most
    ``rounds`` moves). A part's time is its sum of ``costs``, plus, with ``extra``, the largest
    ``extra`` of its items (a pipeline's fill and drain: the time its longest microbatch's F and B
    take on the other P - 1 stages, see ``pipeline_estimate``). A part never empties."""
    parts = [list(p) for p in parts]
    bnd = extra if extra is not None else [0.0] * len(costs)
    sums = [sum(costs[i] for i in p) for p in parts]

    def top2(p):
        a = b = 0.0
        for i in p:
            if bnd[i] > a:
                a, b = bnd[i], a
            elif bnd[i] > b:
                b = bnd[i]
        return a, b

    def without(top, i):  # the largest bound of a part once item i left it
        return top[1] if bnd[i] >= top[0] else top[0]

    for _ in range(rounds):
        times = [sums[j] + top2(parts[j])[0] for j in range(len(parts))]
        hi = max(range(len(parts)), key=lambda j: (times[j], -j))
        th = top2(parts[hi])
        best = None  # (pair's new larger time, lo, a, b)
        for lo in sorted(range(len(parts)), key=lambda j: (times[j], j)):
            if lo == hi or times[lo] >= times[hi] - EPS:
                continue
            tl = top2(parts[lo])
            if len(parts[hi]) > 1:
                for a in parts[hi]:
                    new = max(sums[hi] - costs[a] + without(th, a), sums[lo] + costs[a] + max(tl[0], bnd[a]))
                    if new < times[hi] - EPS and (best is None or (new, lo, a, -1) < best[0]):
                        best = ((new, lo, a, -1), lo, a, None)
            for a in parts[hi]:
                for b in parts[lo]:
                    d = costs[a] - costs[b]
                    new = max(sums[hi] - d + max(without(th, a), bnd[b]), sums[lo] + d + max(without(tl, b), bnd[a]))
                    if new < times[hi] - EPS and (best is None or (new, lo, a, b) < best[0]):
                        best = ((new, lo, a, b), lo, a, b)
            if best is not None:
                break  # the least busy part that can take something
        if best is None:
            break
        _, lo, a, b = best
        parts[hi].remove(a)
        parts[lo].append(a)
        sums[hi] -= costs[a]
        sums[lo] += costs[a]
        if b is not None:
            parts[lo].remove(b)
            parts[hi].append(b)
            sums[lo] -= costs[b]
            sums[hi] += costs[b]
    return [sorted(p) for p in parts]


def split_replicas(costs: Sequence[float], replicas: int, extra: Optional[Sequence[float]] = None) -> List[List[int]]:
    """The sequences (by cost) over ``replicas`` data-parallel replicas: Karmarkar-Karp, refined
    (``extra``: see ``refine``). Every replica gets at least one sequence."""
    if len(costs) < replicas:
        raise ScheduleError(f"a global batch of {len(costs)} sequence(s) cannot keep {replicas} data-parallel "
                            "replicas busy: give at least one sequence per replica")
    parts = karmarkar_karp(costs, replicas)
    empty = [j for j, p in enumerate(parts) if not p]
    for j in empty:  # fewer distinct items than replicas ended up apart: take one from the fullest
        donor = max(range(len(parts)), key=lambda q: (len(parts[q]), -q))
        parts[j].append(parts[donor].pop())
    return refine(parts, costs, extra=extra)


def pipeline_estimate(stage_costs: Sequence[float], ramps: Sequence[float], stages: int) -> float:
    """A quick estimate of one replica's pipeline: every microbatch's work on a stage
    (``stage_costs``), plus the ramp the first and last microbatches take through the other
    P - 1 stages (``ramps``: each microbatch's F + B on one stage; the largest counts)."""
    if not stage_costs:
        return 0.0
    return sum(stage_costs) + (stages - 1) * max(ramps)


def microbatches(seq: Sequence[int], lengths: Sequence[int], *, packed: bool, micro_batch_size: int = 1,
                 max_tokens: Optional[int] = None, cost: Optional[Callable[[List[int]], float]] = None,
                 estimate: Optional[Callable[[List[List[int]]], float]] = None) -> List[List[int]]:
    """One replica's sequences ``seq`` (indices into ``lengths``) as microbatches.

    Padded: up to ``micro_batch_size`` sequences of similar length each (the longest together).
    Packed: up to ``max_tokens`` tokens each (a longer sequence alone); the count is chosen by
    ``estimate`` (a list of microbatches -> time) among counts from the fewest that fit up to one
    sequence per microbatch, and the sequences are spread over them by ``cost`` (of one sequence's
    lengths list) with Karmarkar-Karp."""
    order = sorted(seq, key=lambda i: (-lengths[i], i))
    if not packed:
        b = max(1, micro_batch_size)
        return [order[k:k + b] for k in range(0, len(order), b)]
    if max_tokens is None or max_tokens < 1:
        raise ScheduleError("packed microbatches need a token budget (max tokens per microbatch)")
    cost = cost or (lambda ls: float(sum(ls)))
    seq_costs = [cost([lengths[i]]) for i in order]
    tokens = sum(lengths[i] for i in order)
    lo = max(1, math.ceil(tokens / max_tokens))
    counts = sorted({min(len(order), c) for c in _geometric(lo, len(order))})
    best, best_t = None, None
    for m in counts:
        mbs = _pack(order, seq_costs, lengths, m, max_tokens)
        if mbs is None:
            continue
        t = estimate(mbs) if estimate is not None else float(len(mbs))
        if best_t is None or t < best_t - EPS:
            best, best_t = mbs, t
    if best is None:  # one sequence per microbatch always fits (a longer one alone)
        best = [[i] for i in order]
    return best


def _geometric(lo: int, hi: int) -> List[int]:
    out, c = [], lo
    while c < hi:
        out.append(c)
        c = max(c + 1, int(round(c * 1.25)))
    out.append(hi)
    return out


def _pack(order: List[int], seq_costs: List[float], lengths: Sequence[int], m: int, max_tokens: int):
    """``m`` microbatches of the sequences, balanced by cost, each within ``max_tokens`` (a
    sequence longer than that alone); None when they do not fit in ``m``."""
    if m >= len(order):
        return [[i] for i in order]
    parts = refine(karmarkar_karp(seq_costs, m), seq_costs)
    out = [[order[j] for j in p] for p in parts if p]
    for mb in out:
        if len(mb) > 1 and sum(lengths[i] for i in mb) > max_tokens:
            return None
    return out
