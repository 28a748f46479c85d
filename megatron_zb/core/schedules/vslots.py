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
from typing import Dict, Iterator, List, Optional, Tuple

from ..ir import B, F, W, Action, Placement, Schedule, Setting
from .evaluate import Coder
from ..memo import Memo

CH = "FfBbWw"
FWD = "Ff"
Grid = List[List[str]]


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


def _gap(a: int, b: int) -> int:
    """Slots from a pass at slot a (mod 6) to the next slot b (mod 6), at least 1."""
    return (b - a - 1) % 6 + 1


def unroll(blk: List[List[int]], p: int, mm: int) -> Grid:
    """Microbatch 0 at the earliest slots along its chain, microbatch j six slots later each."""
    t = {c: [0] * p for c in CH}
    for i in range(1, p):
        t["F"][i] = t["F"][i - 1] + _gap(blk[i - 1][0], blk[i][0])
    t["f"][p - 1] = t["F"][p - 1] + _gap(blk[p - 1][0], blk[p - 1][1])
    for i in range(p - 2, -1, -1):
        t["f"][i] = t["f"][i + 1] + _gap(blk[i + 1][1], blk[i][1])
    t["B"][0] = t["f"][0] + _gap(blk[0][1], blk[0][2])
    for i in range(1, p):
        t["B"][i] = t["B"][i - 1] + _gap(blk[i - 1][2], blk[i][2])
    t["b"][p - 1] = t["B"][p - 1] + _gap(blk[p - 1][2], blk[p - 1][3])
    for i in range(p - 2, -1, -1):
        t["b"][i] = t["b"][i + 1] + _gap(blk[i + 1][3], blk[i][3])
    for i in range(p):
        t["W"][i] = t["B"][i] + _gap(blk[i][2], blk[i][4])
        t["w"][i] = t["b"][i] + _gap(blk[i][3], blk[i][5])
    length = max(max(v) for v in t.values()) + 6 * mm + 1
    grid = [[" "] * length for _ in range(p)]
    for c in CH:
        for i in range(p):
            for j in range(mm):
                grid[i][t[c][i] + 6 * j] = c
    return grid


def peak(grid: Grid, per_rank: bool = False):
    out = []
    for row in grid:
        cur = top = 0
        for c in row:
            if c in FWD:
                cur += 1
                top = max(top, cur)
            elif c in "Ww":
                cur -= 1
        out.append(top)
    return out if per_rank else max(out)


def _pad(grid: Grid) -> Grid:
    n = max(len(r) for r in grid)
    for r in grid:
        r.extend([" "] * (n - len(r)))
    return grid


def squeeze(grid: Grid) -> Optional[Grid]:
    """Each pass at the earliest slot after its input (on another rank) and the rank's previous
    pass, every rank's order kept. None if the orders wait on each other forever."""
    p = len(grid)
    seqs = [[c for c in row if c != " "] for row in grid]
    n = max((len(q) for q in seqs), default=0)
    slot = {c: [[-1] * (n + 1) for _ in range(p)] for c in CH}  # char -> rank -> count -> slot
    pos, nxt = [0] * p, [0] * p
    cnt = [{c: 0 for c in CH} for _ in range(p)]
    out: Grid = [[] for _ in range(p)]
    waiting = {c: [[None] * (n + 1) for _ in range(p)] for c in CH}  # ranks waiting on a pass
    stack = list(range(p - 1, -1, -1))
    while stack:
        i = stack.pop()
        seq, row, ci = seqs[i], out[i], cnt[i]
        while pos[i] < len(seq):
            c = seq[pos[i]]
            k = ci[c]
            at = nxt[i]
            if c == "F" or c == "B":
                src = i - 1
            elif c == "f" or c == "b":
                src = i + 1
            else:
                src = -1
            if 0 <= src < p:
                t = slot[c][src][k]
                if t < 0:
                    w = waiting[c][src]
                    if w[k] is None:
                        w[k] = [i]
                    else:
                        w[k].append(i)
                    break
                if t + 1 > at:
                    at = t + 1
            slot[c][i][k] = at
            ci[c] = k + 1
            gap = at - len(row)
            if gap:
                row.extend([" "] * gap)
            row.append(c)
            nxt[i] = at + 1
            pos[i] += 1
            w = waiting[c][i][k]
            if w is not None:
                stack.extend(w)
    if any(pos[i] < len(seqs[i]) for i in range(p)):
        return None
    return _pad(out)


def warmup(grid: Grid, mm: int) -> Grid:
    """Everything before a rank's first b laid out again in the fixed warm-up shape."""
    p = len(grid)
    top = min(peak(grid), 2 * p)
    for i, row in enumerate(grid):
        want_ff = min(i + 1, top // 2, mm)
        want_f = min(top - want_ff, mm)
        n = {c: 0 for c in CH}
        for j, c in enumerate(row):
            if c == "b":
                break
            if c != " ":
                n[c] += 1
            row[j] = " "
        u = {c: 0 for c in CH}

        def put(j: int, c: str, ok: bool) -> None:
            if ok:
                if j >= len(row):
                    row.extend([" "] * (j + 1 - len(row)))
                row[j] = c
                u[c] += 1

        j = i
        for _ in range(2 * (p - 1 - i)):
            put(j, "F", u["F"] < want_f and u["F"] < n["F"])
            j += 1
        for _ in range(i + 1):
            put(j, "F", u["F"] < want_f and u["F"] < n["F"])
            j += 1
            put(j, "f", u["f"] < want_ff and u["f"] < n["f"])
            j += 1
        while any(u[c] < n[c] for c in "FfBW"):
            put(j, "B", u["B"] < n["B"])
            j += 1
            put(j, "W", u["W"] < n["W"])
            j += 1
            if u["f"] < n["f"]:
                put(j, "f", True)
            else:
                put(j, "F", u["F"] < n["F"])
            j += 1
    return _pad(grid)


def drop_extra(grid: Grid, m: int) -> Grid:
    for row in grid:
        n = {c: 0 for c in CH}
        for j, c in enumerate(row):
            if c == " ":
                continue
            if n[c] >= m:
                row[j] = " "
            else:
                n[c] += 1
    return grid


def early_w_to_end(grid: Grid, top: int) -> Grid:
    """Few microbatches: move each rank's earliest W's to its end while its peak stays <= top."""
    peaks = peak(grid, per_rank=True)
    extra = top - min(peaks)
    for i, row in enumerate(grid):
        moved = []
        for j, c in enumerate(row):
            if peaks[i] + len(moved) >= top:
                break
            if c in "Ww":
                moved.append(c)
                row[j] = " "
        row.extend(moved + [" "] * (extra - len(moved)))
    return _pad(grid)


def cooldown(grid: Grid, m: int) -> Optional[Grid]:
    """The last backwards laid two slots apart after rank 0's last f; the tail's W's after them."""
    p = len(grid)
    top = peak(grid)
    max_bb = min((top + 1) // 2, m)
    max_b = min(top - max_bb, m)
    start = -1
    for i, row in enumerate(grid):
        nb = nbb = nw = nww = 0
        last_f = -1
        for j in range(len(row) - 1, -1, -1):
            c = row[j]
            if c == "f" and last_f == -1:
                last_f = j
            if c == "B" and nb < i + 1 and nb < max_b:
                row[j] = " "
                nb += 1
            if c == "b" and nbb < max_bb:
                row[j] = " "
                nbb += 1
        for j in range(len(row) - 1, -1, -1):
            if nw >= nb and nww >= nbb and nw + nww >= top:
                break
            if row[j] == "W":
                row[j] = " "
                nw += 1
            if row[j] == "w":
                row[j] = " "
                nww += 1
        if i == 0:
            start = last_f
        for k in range(nbb):
            j = start - i + 2 * p - 2 * k
            if j < 0 or j >= len(row) or row[j] != " ":
                return None
            row[j] = "b"
        for k in range(nb):
            j = start + 1 + i - 2 * k
            if j < 0 or j >= len(row):
                return None
            row[j] = "B"
    for row in grid:
        last_w = max([j for j, c in enumerate(row) if c in "Ww"] + [-1])
        pend_w = pend_ww = 0
        for j, c in enumerate(row):
            if c == "B":
                pend_w += 1
            elif c == "b":
                pend_ww += 1
            elif c == "W":
                pend_w -= 1
            elif c == "w":
                pend_ww -= 1
            elif j > last_w:
                if pend_w > 0:
                    row[j] = "W"
                    pend_w -= 1
                elif pend_ww > 0:
                    row[j] = "w"
                    pend_ww -= 1
        row.extend(["W"] * pend_w + ["w"] * pend_ww)
    return squeeze(_pad(grid))


def fill_holes(grid: Grid, m: int) -> Grid:
    """Each empty slot takes the first later pass of its rank (one of each kind considered) that
    may run there: its input placed at an earlier slot and the rank's peak not exceeded."""
    p = len(grid)
    top = peak(grid)
    n = len(grid[0])
    last = [{c: -1 for c in CH} for _ in range(p)]
    for i, row in enumerate(grid):
        for j, c in enumerate(row):
            if c != " ":
                last[i][c] = j
    mem = [0] * p
    cnt = [{c: 0 for c in CH} for _ in range(p)]
    at: Dict[Tuple[str, int, int], int] = {}
    for j in range(n):
        for i in range(p):
            row = grid[i]
            c = row[j]
            if c != " ":
                at[(c, i, cnt[i][c])] = j
                cnt[i][c] += 1
                mem[i] += 1 if c in FWD else (-1 if c in "Ww" else 0)
                continue
            avail = {x for x in CH if last[i][x] > j}
            delta = top_delta = 0
            for k in range(j + 1, n):
                if not avail:
                    break
                x = row[k]
                delta += 1 if x in FWD else (-1 if x in "Ww" else 0)
                before = top_delta
                top_delta = max(top_delta, delta)
                if x == " " or x not in avail:
                    continue
                avail.discard(x)
                if x in FWD and mem[i] + before >= top:
                    continue
                q = cnt[i][x]
                if x in "FB":
                    if i > 0:
                        ok = at.get((x, i - 1, q), n) < j
                    else:
                        ok = x == "F" or cnt[i]["f"] > q
                elif x in "fb":
                    if i < p - 1:
                        ok = at.get((x, i + 1, q), n) < j
                    else:
                        ok = cnt[i]["F" if x == "f" else "B"] > q
                else:
                    ok = cnt[i]["B" if x == "W" else "b"] > q
                if not ok:
                    continue
                row[j], row[k] = x, " "
                at[(x, i, q)] = j
                cnt[i][x] = q + 1
                mem[i] += 1 if x in FWD else (-1 if x in "Ww" else 0)
                break
    return grid


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


def _orders(p: int, m: int, max_mem: int) -> List[List[List[Action]]]:
    """Every block's orders that fit ``max_mem`` chunk activations, in the enumeration order."""
    def build_all() -> List[List[List[Action]]]:
        out, tops = [], {}
        for _, row in blocks(p):
            for blk in (b for b in row if b is not None):
                ident = tuple(map(tuple, blk))
                grid = None  # a block met before (k0 = k1, or len0 = p - 1) ends as it did then
                if ident not in tops:
                    grid, tops[ident] = build(blk, p, m, max_mem)
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
    coder = Coder(st, pl, m)
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
