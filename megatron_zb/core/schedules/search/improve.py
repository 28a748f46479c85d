"""Local search on per-rank orders, never raising any rank's peak memory above a limit.

Each round times the schedule (``evaluate.Coder``), follows the **critical chain** back from the
last pass of the longest rank span (each pass to whatever made it start when it did: the
previous pass on its rank, or its input from another pass), and tries, for every link where a
pass waited for the one before it on its rank:

* swapping the two (the earlier one is *delayed*: e.g. an F moved after a B, a W after an F),
* moving the earlier one two or three places later, or the later one two or three earlier,

and, on the ranks the chain crosses, moving a W or F from just after an idle gap into it. The
first move that lowers (makespan, sum of spans) is kept and the chain is followed again. A move
that deadlocks or breaks the memory limit is skipped. The budget counts timings, not seconds:
every rank generates its schedule on its own and must get the same one, whatever its load.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

from ...ir import Schedule, Setting
from .bounds import lower_bound  # noqa: F401  (re-exported: callers import it from here)
from .evaluate import Coder, Timing, score

EPS = 1e-9


def critical_chain(coder: Coder, orders: Sequence[Sequence[int]], t: Timing) -> List[Tuple[int, int]]:
    """(rank, position) of every pass on the chain that sets the longest span, latest first."""
    where = {}
    for r, o in enumerate(orders):
        for i, x in enumerate(o):
            where[x] = (r, i)
            if x >= 3 * coder.S * coder.m:  # a fused backward stands for its B as an input
                where[x - 2 * coder.S * coder.m] = (r, i)
    rc = max(range(len(orders)), key=lambda r: (t.spans[r], -r))
    if not orders[rc]:
        return []
    r, i = rc, len(orders[rc]) - 1
    chain = []
    for _ in range(sum(len(o) for o in orders)):
        chain.append((r, i))
        x = orders[r][i]
        s = t.start[x]
        d = coder.dep[x]
        arrive = t.end[d] + coder.hop[x] if d >= 0 else -1.0
        if i > 0 and t.end[orders[r][i - 1]] >= arrive - EPS and abs(t.end[orders[r][i - 1]] - s) <= EPS:
            i -= 1
        elif d >= 0 and abs(arrive - s) <= EPS:
            r, i = where[d]
        else:
            break
    return chain


def _moves(coder: Coder, orders: Sequence[Sequence[int]], t: Timing, reach: int,
           wide: bool) -> Iterator[Tuple[int, int, int, List[int]]]:
    """(rank, first and last position that change, the rank's new order) of every move to try."""
    chain = critical_chain(coder, orders, t)
    seen = set()
    on_chain = set(r for r, _ in chain)
    for r, i in chain:
        o = orders[r]
        if i == 0 or (r, i) in seen:
            continue
        seen.add((r, i))
        if abs(t.end[o[i - 1]] - t.start[o[i]]) > EPS:
            continue  # it waited for its input, not for its rank
        yield r, i - 1, i, o[:i - 1] + [o[i], o[i - 1]] + o[i + 1:]  # swap: the earlier pass is delayed
        for k in range(2, reach + 1):
            if i - 1 + k < len(o):  # the earlier pass k places later
                yield r, i - 1, i - 1 + k, o[:i - 1] + o[i:i + k] + [o[i - 1]] + o[i + k:]
            if i - k >= 0:  # the later pass k places earlier
                yield r, i - k, i, o[:i - k] + [o[i]] + o[i - k:i] + o[i + 1:]
    for r in sorted(on_chain):  # fill idle gaps on the ranks the chain crosses
        o = orders[r]
        for i in range(1, len(o)):
            if t.start[o[i]] <= t.end[o[i - 1]] + EPS:
                continue
            for j in range(i + 1, min(len(o), i + 1 + 2 * reach)):
                if o[j] // (coder.S * coder.m) in (0, 2):  # an F or a W
                    yield r, i, j, o[:i] + [o[j]] + o[i:j] + o[j + 1:]
    if not wide:
        return
    for r in sorted(on_chain):  # every pass of those ranks a few places earlier or later
        o = orders[r]
        for i in range(len(o)):
            for k in range(1, 2 * reach + 1):
                if i + k < len(o):
                    yield r, i, i + k, o[:i] + o[i + 1:i + k + 1] + [o[i]] + o[i + k + 1:]
                if i - k >= 0:
                    yield r, i - k, i, o[:i - k] + [o[i]] + o[i - k:i] + o[i + 1:]


def improve(schedule: Schedule, setting: Setting, limit: Optional[float], max_evals: int = 400,
            reach: int = 3, wide: bool = True) -> Schedule:
    """The schedule after local search (at most ``max_evals`` timings); the same object if no
    move helps. The caller validates the result."""
    if max_evals <= 0:
        return schedule
    flat = schedule.flat()
    if flat is not schedule:  # overlapped pairs are kept as they are
        return schedule
    coder = Coder.of(setting, schedule.placement, schedule.num_microbatches)
    orders = coder.encode(schedule.orders)
    t = coder.time(orders)
    if t is None:
        return schedule
    key = score(t)
    lim = float("inf") if limit is None else limit + 1e-9
    evals = 0
    # a move whose makespan is sure to be above the current one's by more than the rounding of
    # ``score`` is not better: its timing stops as soon as that shows (``Coder.retime``)
    margin = 1e-7 * max(1.0, abs(t.makespan))
    moved = False
    while evals < max_evals:
        better = False
        for r, first, last, new in _moves(coder, orders, t, reach, wide):
            if coder.peak(new) > lim:
                continue
            trial = list(orders)
            trial[r] = new
            evals += 1
            # coder.time(trial) where it may be better
            tt = coder.retime(trial, t, r, first, t.makespan + margin, last, orders)
            if tt is not None and score(tt) < key:
                orders, t, key, better, moved = trial, coder.full(tt), score(tt), True, True
                break
            if evals >= max_evals:
                break
        if not better:
            break
    if not moved:
        return schedule
    meta = {k: v for k, v in schedule.meta.items() if k not in ("timing", "near_ties")}
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, coder.decode(orders),
                    dict(meta, improved_by_local_search=True))
