"""Which layers each model chunk holds, chosen so that the pipeline ranks carry equal work.

A pipeline runs at the pace of its busiest rank: every microbatch passes F, B and W of every
chunk, so the time per iteration is at least M x the largest rank load (the F + B + W of the
chunks it holds). The embedding sits on the first chunk, the output layer and loss (2 to 4
transformer layers' worth for a 128k-256k vocabulary) on the last, and a V puts both on rank 0:
an even split of the layers leaves that rank far busier than the rest. ``balanced`` moves the
chunk boundaries one layer at a time (a local search over Megatron's contiguous layouts, several
starting points) to the layout with the smallest largest rank load, then the most even loads; a
middle chunk keeps at least one layer, the first and the last may hold none (a chunk with the
embedding alone, or the loss alone). Pure Python, deterministic.

Per-layer work may differ (MoE models with dense first layers, ``--moe-layer-freq``): the search
takes one weight per layer.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from ..ir import Placement, ScheduleError
from ..ir.memo import Memo
from .layout import Layout, from_counts

__all__ = ["balanced", "even_counts", "front_light", "rank_loads", "rank_shifts"]


def even_counts(num_layers: int, num_stages: int) -> List[int]:
    """Megatron's even split where it divides; else the extra layers on the middle chunks."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(s - (num_stages - 1) / 2)))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def front_light(layout: Layout, p: int, mtp_layers: int = 0) -> Optional[Layout]:
    """``layout`` of a looped placement (P ranks, two or more model chunks each) with one layer
    moved from each rank's first chunk to its second, where the first holds two or more: every rank
    keeps its layers, and the chunk that holds the most microbatches at once (the first: its
    forwards run ahead in the warm-up) holds one layer less. None where no chunk gives one up, or
    the layout is not the plain kind (embedding first, MTP layers and loss last)."""
    counts = layout.layers()
    if len(counts) < 2 * p or len(counts) % p or from_counts(counts, mtp_layers) != layout:
        return None
    moved = False
    for r in range(p):
        if counts[r] >= 2:
            counts[r] -= 1
            counts[p + r] += 1
            moved = True
    return from_counts(counts, mtp_layers) if moved else None


def rank_shifts(layout: Layout, placement: Placement, mtp_layers: int = 0) -> List[Layout]:
    """The layouts one layer away from ``layout`` that keep every rank's layers: one layer moved
    between the first and the last chunk of the ranks that hold the embedding or the loss, either
    way (a chunk that gives a layer keeps one). Empty where the placement has one chunk per rank or
    replicated stages, or the layout is not the plain kind (embedding first, MTP layers and loss last)."""
    counts = layout.layers()
    S = placement.num_stages
    if placement.replicated or len(counts) != S or S <= placement.num_ranks \
            or from_counts(counts, mtp_layers) != layout:
        return []
    out: List[Layout] = []
    for way in (1, -1):
        moved = list(counts)
        for r in sorted({placement.rank_of(0), placement.rank_of(S - 1)}):
            mine = [s for s in range(S) if placement.rank_of(s) == r]
            give, take = (mine[0], mine[-1]) if way == 1 else (mine[-1], mine[0])
            if moved[give] >= 2:
                moved[give] -= 1
                moved[take] += 1
        if moved != counts:
            out.append(from_counts(moved, mtp_layers))
    return out


def rank_loads(counts: Sequence[int], layer_work: Sequence[float], first: float, last: float,
               placement: Placement) -> List[float]:
    """Per rank, the work of the chunks it holds (one path's share when replicated)."""
    work = _stage_work(counts, _prefix(layer_work), first, last)
    out = [0.0] * placement.num_ranks
    for s in range(placement.num_stages):
        out[placement.rank_of(s)] += work[placement.logical(s)] / placement.num_paths
    return out


def _prefix(w: Sequence[float]) -> List[float]:
    out = [0.0]
    for x in w:
        out.append(out[-1] + x)
    return out


def _stage_work(counts, pre, first, last) -> List[float]:
    out, b = [], 0
    for c in counts:
        out.append(pre[b + c] - pre[b])
        b += c
    out[0] += first
    out[-1] += last
    return out


#: layouts found in this process (``memo``): plan's rows of one placement ask for the same
_FOUND = Memo(16)


def balanced(layer_work: Sequence[float], placement: Placement, first: float, last: float,
             mtp_layers: int = 0, keep: int = 1, starts: Optional[Sequence[Sequence[int]]] = None) -> List[Layout]:
    """The ``keep`` best layouts (fewest first) for ``placement``'s logical stages: the smallest
    largest rank load, then the smallest sum of squared rank loads, then the most even chunks (sum of
    squared chunk work), then the work placed as late in the pipeline as possible (the warm-up's
    forwards wait for the early chunks; on the V, P=8 M=32 in layer units with Llama-3-8B's output
    layer, 2.24 layers: zb-v 480, its lower bound, with the heavy ranks' extra layers in their second
    chunks and rank 0 holding E+1 and 1+L; 487.5 with them in their first chunks). ``layer_work``: F + B + W of each transformer layer;
    ``first``: what the first chunk adds (the embedding), ``last``: what the last one adds (the
    output layer, loss and MTP layers)."""
    key = (tuple(layer_work), placement, first, last, mtp_layers, keep,
           None if starts is None else tuple(tuple(c) for c in starts))
    return list(_FOUND.get(key, lambda: _balanced(layer_work, placement, first, last, mtp_layers, keep, starts)))


def _balanced(layer_work, placement: Placement, first: float, last: float, mtp_layers: int, keep: int,
              starts) -> List[Layout]:
    S = placement.num_logical_stages
    L = len(layer_work)
    if L < max(0, S - 2):
        raise ScheduleError(f"{L} layers cannot fill {S} model chunks (every chunk between the first and the last "
                            "holds at least one layer)")
    pre = _prefix(layer_work)
    owners = [[] for _ in range(placement.num_ranks)]
    for s in range(placement.num_stages):
        owners[placement.rank_of(s)].append(placement.logical(s))
    share = 1.0 / placement.num_paths

    def score(counts) -> Tuple[float, float, float, float]:
        work = _stage_work(counts, pre, first, last)
        loads = [sum(work[l] for l in ls) * share for ls in owners]
        early = sum(w * (S - 1 - s) for s, w in enumerate(work))  # work the warm-up's forwards wait for
        return (round(max(loads), 9), round(sum(x * x for x in loads), 6), round(sum(x * x for x in work), 6),
                round(early, 6))

    def low(s: int) -> int:
        return 0 if s in (0, S - 1) else 1

    seeds = [list(c) for c in (starts or [])] + [even_counts(L, S)]
    if S >= 2:
        seeds.append(_fill(pre, S, first, last))
    found, climbed = {}, set()
    for seed in seeds:
        if len(seed) != S or sum(seed) != L or any(c < low(s) for s, c in enumerate(seed)) or tuple(seed) in climbed:
            continue  # (a seed climbed already: the same climb)
        climbed.add(tuple(seed))
        counts = _climb(list(seed), score, low)
        found[tuple(counts)] = score(counts)
    if not found:
        raise ScheduleError(f"no layout of {L} layers over {S} model chunks")
    best = sorted(found, key=lambda c: (found[c], c))[:keep]
    return [from_counts(c, mtp_layers) for c in best]


def _fill(pre: List[float], S: int, first: float, last: float) -> List[int]:
    """A greedy start: equal work per chunk, layers handed out in order."""
    L = len(pre) - 1
    target = (pre[-1] + first + last) / S
    counts, b = [], 0
    for s in range(S):
        left = S - s - 1
        budget = target - (first if s == 0 else 0.0)
        c = 0
        while b + c < L - left and (pre[b + c + 1] - pre[b] <= budget or (c == 0 and 0 < s < S - 1)):
            c += 1
        if s == S - 1:
            c = L - b
        counts.append(c)
        b += c
    return counts


def _climb(counts: List[int], score: Callable, low: Callable) -> List[int]:
    """While that lowers the score, take one layer from a chunk and give one to another: every
    boundary between the two moves by one layer (the layout stays contiguous), the chunks in
    between keep their counts."""
    cur = score(counts)
    S = len(counts)
    for _ in range(4 * (sum(counts) + S)):
        best, move = cur, None
        for a in range(S):
            if counts[a] - 1 < low(a):
                continue
            for b in range(S):
                if b == a:
                    continue
                counts[a] -= 1
                counts[b] += 1
                sc = score(counts)
                counts[a] += 1
                counts[b] -= 1
                if sc < best:
                    best, move = sc, (a, b)
        if move is None:
            return counts
        counts[move[0]] -= 1
        counts[move[1]] += 1
        cur = best
    return counts
