"""Unit-slot building blocks for the V placement, after "Pipeline Parallelism with Controllable
Memory" (Qi et al. 2024, sections 3-4 and appendix A): every pass takes one slot, a microbatch's
six passes on a rank (F, f forwards of the first and second leg, B, b backwards of the second
and first leg, W, w their weight gradients) tile a period of six slots, and a block is repeated,
squeezed and reordered; the orders are then timed with the real costs. Memory is counted as
the paper does (a forward +1 chunk activation, a W -1), which is never below ours.

* **Blocks.** Rank 0's slots: F at 0, f, B and b at three distinct slots of 1..5; each W in the
  first free slot after its B. Rank i+1 shifts F and B by k slots and f and b by -1 (mod 6),
  with k = k0 for the first ``len0`` ranks and k1 <= k0 after; blocks whose slots collide are
  skipped.
* **Repeat** (one microbatch's passes at the earliest slots after their inputs, then every six
  slots; at least 2p microbatches are built) and **squeeze** (every pass at the earliest slot
  its input and its rank allow, order kept).
* **Warm-up** rewritten in a fixed shape set by the peak memory P: rank i runs
  min(i+1, P/2) second-leg forwards before its first B and P minus that in all, laid out as
  F's, then (F f) pairs, then (B W f-or-F) triples.
* Extra microbatches dropped (with m <= p the early W's make room for more forwards).
* **Cool-down** rewritten: the last (P+1)/2 b's and min(i+1, P - that) B's of rank i are laid two
  slots apart from the end of rank 0's forwards, the W's of the tail after them.
* **Holes filled**: each empty slot takes the first later pass of its rank that may move there
  (its input is done, memory stays under the peak).

A block is dropped when a step would raise the peak memory or leave a pass unplaced. The best
order by real-cost makespan is returned. Deterministic; its cost grows with p x (4p + m), so
callers use it on small settings.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from itertools import permutations
from typing import Iterator, List, Optional, Tuple

from ...ir import Action, B, F, Placement, Schedule, Setting, W
from ...ir.memo import Memo
from .evaluate import Coder
from .vgrid import FWD, Grid, cooldown, drop_extra, early_w_to_end, fill_holes, peak, squeeze, unroll, warmup


def _with_w(pos4: List[int]) -> Optional[List[int]]:
    """Rank slots [F, f, B, b] plus W after B and w after b, each in the first free slot."""
    used = set(pos4)
    out = list(pos4) + [-1, -1]
    for src, dst in ((2, 4), (3, 5)):
        for step in range(1, 6):
            s = (out[src] + step) % 6
            if s not in used:
                out[dst] = s
                used.add(s)
                break
    return out if -1 not in out else None


def blocks(p: int) -> Iterator[Tuple[Tuple[int, int, int], List[List[int]]]]:
    """((pattern id, k0, k1), len0 groups) in the paper's enumeration order; each item is
    (key, list over len0 of the block or None)."""
    for pid, (ff, bb, b) in enumerate(permutations(range(1, 6), 3)):
        base = _with_w([0, ff, bb, b])
        if base is None:
            continue
        for k0 in range(1, 6):
            for k1 in range(1, k0 + 1):
                row = []
                for len0 in range(1, p):
                    blk = [base]
                    for i in range(p - 1):
                        k = k0 if i < len0 else k1
                        q = blk[-1]
                        nxt = [(q[0] + k) % 6, (q[1] - 1) % 6, (q[2] + k) % 6, (q[3] - 1) % 6]
                        nxt = _with_w(nxt) if len(set(nxt)) == 4 else None
                        if nxt is None:
                            blk = None
                            break
                        blk.append(nxt)
                    row.append(blk)
                yield (pid, k0, k1), row


def to_schedule(grid: Grid, m: int, name: str) -> Optional[Schedule]:
    """Our orders: forwards and backwards numbered in order; each W slot runs the weight
    gradient of the oldest backward still waiting for one (either leg)."""
    p = len(grid)
    orders = []
    for i, row in enumerate(grid):
        n = {c: 0 for c in "FfBb"}
        pending = deque()
        o = []
        for c in row:
            if c == " ":
                continue
            if c in "Ww":
                if not pending:
                    return None
                o.append(pending.popleft())
                continue
            j = n[c]
            n[c] += 1
            if j >= m:
                return None
            stage = i if c in "Fb" else 2 * p - 1 - i
            o.append(Action(F if c in FWD else B, stage, j))
            if c in "Bb":
                pending.append(Action(W, stage, j))
        if pending or any(v != m for v in n.values()):
            return None
        orders.append(o)
    return Schedule(name, Placement.vshape(p), m, orders)


def build(blk: List[List[int]], p: int, m: int, max_mem: int) -> Tuple[Optional[Grid], int]:
    """(grid or None, the peak memory that decided it) for one block."""
    mm = max(m, 2 * p)
    grid = unroll(blk, p, mm)
    first_peak = peak(grid)
    if (m == mm and first_peak > max_mem) or first_peak > 2 * p:
        return None, first_peak
    grid = squeeze(grid)
    if grid is None:
        return None, first_peak
    grid = squeeze(warmup(grid, mm))
    if grid is None or peak(grid) > first_peak:
        return None, first_peak
    top = peak(grid)
    if m < mm:
        grid = drop_extra(grid, m)
        if m <= p and 2 * m <= max_mem:
            grid = early_w_to_end(grid, min(2 * p, top))
        grid = squeeze(grid)
        if grid is None:
            return None, top
        first_peak = top = peak(grid)
        if top > max_mem:
            return None, top
    grid = cooldown(grid, m)
    if grid is None:
        return None, top
    grid = fill_holes(grid, m)
    top = peak(grid)
    if top > first_peak:
        return None, first_peak
    return grid, top


#: block orders by (p, m, peak in chunk activations): cost-free, shared by nearby limits (``memo``)
_ORDERS = Memo(8)
#: each block's grid (rows as strings) and peaks by (block, p, m), and the peak when m < 2p: with
#: m >= 2p a block's grid does not depend on the peak allowed beyond the first check (``_built``)
_BUILT = Memo(4096)


def _built(blk: List[List[int]], p: int, m: int, max_mem: int) -> Tuple[Optional[Grid], int]:
    """``build``, remembered: where m >= 2p the peak allowed only decides whether the unrolled
    block's first peak is too high, so one grid serves every limit."""
    ident = tuple(map(tuple, blk))
    if m < max(m, 2 * p):
        key = (ident, p, m, max_mem)
        grid, top = _BUILT.get(key, lambda: _frozen(build(blk, p, m, max_mem)))
        return grid, top
    first_peak, grid, top = _BUILT.get((ident, p, m), lambda: (peak(unroll(blk, p, m)),)
                                       + _frozen(build(blk, p, m, 2 * p)))
    if first_peak > max_mem:
        return None, first_peak
    return grid, top


def _frozen(built: Tuple[Optional[Grid], int]) -> Tuple[Optional[Tuple[str, ...]], int]:
    grid, top = built
    return (None if grid is None else tuple("".join(row) for row in grid)), top


def _orders(p: int, m: int, max_mem: int) -> List[List[List[Action]]]:
    """Every block's orders that fit ``max_mem`` chunk activations, in the enumeration order."""
    def build_all() -> List[List[List[Action]]]:
        out, tops = [], {}
        for _, row in blocks(p):
            for blk in (b for b in row if b is not None):
                ident = tuple(map(tuple, blk))
                grid = None  # a block met before (k0 = k1, or len0 = p - 1) ends as it did then
                if ident not in tops:
                    grid, tops[ident] = _built(blk, p, m, max_mem)
                if tops[ident] > 2 * p or tops[ident] > max_mem:
                    break  # later len0 only hold more
                s = to_schedule(grid, m, "") if grid is not None else None
                if s is not None:
                    out.append(s.orders)
        return out

    return _ORDERS.get((p, m, max_mem), build_all)


def search(setting: Setting, limit: float, name: str, keep: int = 2) -> List[Schedule]:
    """The best ``keep`` block schedules under ``limit`` by real-cost makespan."""
    st = dataclasses.replace(setting, chunks=2)
    p, m = st.stages, st.microbatches
    if p < 2:
        return []
    pl = Placement.vshape(p)
    chunk = max(st.pass_mem(F, pl.rank_of(s), s) for s in range(pl.num_stages))  # the largest chunk activation
    max_mem = min(2 * p, int(limit / chunk + 1e-9)) if chunk > 0 else 2 * p  # chunk activations
    coder = Coder.of(st, pl, m)
    found: List[Tuple[tuple, int, Schedule]] = []
    seen = set()
    for block_orders in _orders(p, m, max_mem):
        s = Schedule(name, pl, m, [list(o) for o in block_orders])
        orders = coder.encode(s.orders)
        t = coder.time(orders)
        if t is None or max(coder.peak(o) for o in orders) > limit + 1e-9:
            continue
        key = (round(t.makespan, 9), round(sum(t.spans), 9))
        if key in seen:
            continue
        seen.add(key)
        found.append((key, len(found), s))
    found.sort(key=lambda x: x[:2])
    for key, _, s in found[:keep]:
        s.meta = {"start": "unit-slot building block", "timing": key + (0.0,)}
    return [s for _, _, s in found[:keep]]
