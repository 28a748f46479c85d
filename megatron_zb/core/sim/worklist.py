"""The one timing engine: coded passes timed by a work list. Pure Python.

Every rank runs its passes in list order, each at the earliest time the rank's previous pass and
its input allow: the end of the pass it waits for (``dep``) plus the hop (``hop``: ``cost_comm``
between ranks, 0 on one rank), and the rank's release for that position where one is given. A rank
whose input is not there yet waits in ``waiting`` and is taken up again when that pass ends, so no
rank is scanned twice for nothing.

The simulator's fast path (``sim.plain.Plain``) and the searches' evaluator
(``schedules.search.evaluate.Coder``) code their passes differently (a schedule's passes by
position; a setting's every (kind, stage, microbatch)) and both time them here; the variable-length
batches' end time (``varlen.mb_schedule.end_time``) through ``Plain``. Two loops stay apart, for
what they do beyond timing fixed orders: the evaluator's incremental re-timing from a base timing
(``Coder.retime``, every local-search move's) starts from a cut through the base's times and stops
once a span must exceed a bound; the list scheduler (``schedules.listsched``) chooses each rank's
next pass as it times it (its order does not exist before the timing does).

``alias``: per code, another code that ends with it (the evaluator codes a fused backward's
consumers through its B: a BW ends its B's code too), or -1. ``Vocab`` (optional): the vocabulary
passes' second input (``dep2``/``hop2``) and the barriers their passes feed, link by link
(``sim.plain``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

__all__ = ["Vocab", "run"]


class Vocab:
    """What the vocabulary passes add to a coding: a second input per code (``dep2``, ``hop2``;
    -1 for none), the barrier each feeding code feeds (``feeds``: code -> (link, index)) and the
    links (``links``: (first barrier code, count, cost) each; per link a barrier waits for
    ``waits[link]`` passes and completes after the previous one, once the link is free)."""

    __slots__ = ("dep2", "hop2", "feeds", "links", "waits")

    def __init__(self, dep2: List[int], hop2: List[float], feeds: Dict[int, tuple], links: List[tuple],
                 waits: List[int]):
        self.dep2, self.hop2, self.feeds, self.links, self.waits = dep2, hop2, feeds, links, waits


def run(orders: Sequence[Sequence[int]], dep: Sequence[int], hop: Sequence[float], cost: Sequence[float],
        end: List[Optional[float]], start: List[float], release: Optional[Sequence[Optional[dict]]] = None,
        alias: Optional[Sequence[int]] = None, vocab: Optional[Vocab] = None) -> bool:
    """Time ``orders`` (per rank, codes) into ``start`` / ``end`` (indexed by code; ``end`` None
    for a pass not run yet, and for every barrier code). ``release``: per rank, {position: time}
    before which the pass at that position may not start, or None. False where the orders
    deadlock (some rank cannot finish). Nine parameters: the coding's four tables, the timing's
    two outputs and the three optional parts, kept apart so that the hot loop reads plain lists."""
    R = len(orders)
    pos, clock = [0] * R, [0.0] * R
    waiting: Dict[int, List[int]] = {}
    if vocab is not None:
        dep2, hop2, feeds, links = vocab.dep2, vocab.hop2, vocab.feeds, vocab.links
        left = [[w] * count for w, (_, count, _) in zip(vocab.waits, links)]
        latest = [[0.0] * count for _, count, _ in links]
        nxt, free = [0] * len(links), [0.0] * len(links)
    stack = list(range(R - 1, -1, -1))
    while stack:
        r = stack.pop()
        o = orders[r]
        i, t = pos[r], clock[r]
        n = len(o)
        rl = release[r] if release is not None else None
        while i < n:
            x = o[i]
            if rl and i in rl and rl[i] > t:
                t = rl[i]
            d = dep[x]
            if d >= 0:
                e = end[d]
                if e is None:
                    if d in waiting:  # a B feeds the next B down and its own W
                        waiting[d].append(r)
                    else:
                        waiting[d] = [r]
                    break
                e += hop[x]
                if e > t:
                    t = e
            if vocab is not None:
                d = dep2[x]
                if d >= 0:
                    e = end[d]
                    if e is None:
                        waiting.setdefault(d, []).append(r)
                        break
                    e += hop2[x]
                    if e > t:
                        t = e
            start[x] = t
            t += cost[x]
            end[x] = t
            if alias is not None:
                y = alias[x]
                if y >= 0:
                    end[y] = t
                    if y in waiting:
                        stack.extend(waiting.pop(y))
            if x in waiting:
                stack.extend(waiting.pop(x))
            if vocab is not None and x in feeds:
                L, j = feeds[x]
                base, count, c = links[L]
                left[L][j] -= 1
                if t > latest[L][j]:
                    latest[L][j] = t
                while nxt[L] < count and not left[L][nxt[L]]:
                    free[L] = max(latest[L][nxt[L]], free[L]) + c
                    end[base + nxt[L]] = free[L]
                    if base + nxt[L] in waiting:
                        stack.extend(waiting.pop(base + nxt[L]))
                    nxt[L] += 1
            i += 1
        pos[r], clock[r] = i, t
    return all(pos[r] == len(orders[r]) for r in range(R))
