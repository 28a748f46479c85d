"""The unit-slot grids of ``vslots``' building blocks: a block unrolled over the microbatches, the
peak memory counted as the paper does, and the steps that squeeze and reshape a grid (see
``vslots``). Each rank's row holds one character per slot: F, f (forwards of the first and second
leg), B, b (backwards of the second and first leg), W, w (their weight gradients) or a space.
Pure Python."""
from __future__ import annotations

from itertools import accumulate, repeat
from typing import Dict, List, Optional, Tuple

__all__ = ["CH", "FWD", "Grid", "unroll", "peak", "squeeze", "warmup", "drop_extra", "early_w_to_end", "cooldown",
           "fill_holes"]

CH = "FfBbWw"
FWD = "Ff"
Grid = List[List[str]]
_CODE = {c: n for n, c in enumerate(CH)}  # squeeze's code of each pass kind
_FROM = (-1, 1, -1, 1, 0, 0)  # where each kind's input comes from: the rank before, after, or its own
_DELTA = {"F": 1, "f": 1, "W": -1, "w": -1}  # a slot's change of the running activation count


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
    """Each rank's highest running count of forwards less weight gradients (0 at least)."""
    get = _DELTA.get
    out = [max(0, max(accumulate(map(get, row, repeat(0))), default=0)) for row in grid]
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
    # every pass numbered, rank by rank in its order; ids[kind code * p + rank]: that kind's on that rank
    ids: List[List[int]] = [[] for _ in range(6 * p)]
    first, g = [], 0
    for i, q in enumerate(seqs):
        first.append(g)
        for c in q:
            ids[_CODE[c] * p + i].append(g)
            g += 1
    total = g
    # each pass's input (the same kind's k-th pass on the rank before or after): -1 where it has
    # none, ``total`` where that rank lacks it (a slot never filled: it waits forever)
    src = [-1] * total
    for x in range(4):
        for i in range(p):
            o = i + _FROM[x]
            if 0 <= o < p:
                mine, theirs = ids[x * p + i], ids[x * p + o]
                for a, b in zip(mine, theirs):
                    src[a] = b
                for a in mine[len(theirs):]:
                    src[a] = total
    slot = [-1] * (total + 1)
    waiting: List[Optional[List[int]]] = [None] * (total + 1)  # ranks waiting on a pass
    pos, ends = list(first), first[1:] + [total]
    nxt = [0] * p
    out: Grid = [[] for _ in range(p)]
    stack = list(range(p - 1, -1, -1))
    while stack:
        i = stack.pop()
        seq, row, base = seqs[i], out[i], first[i]
        g, at_next, end = pos[i], nxt[i], ends[i]  # len(row) is at_next: the rank's next free slot
        while g < end:
            s = src[g]
            at = at_next
            if s >= 0:
                t = slot[s]
                if t < 0:
                    w = waiting[s]
                    if w is None:
                        waiting[s] = [i]
                    else:
                        w.append(i)
                    break
                if t >= at:
                    at = t + 1
            slot[g] = at
            if at > at_next:
                row.extend([" "] * (at - at_next))
            row.append(seq[g - base])
            at_next = at + 1
            w = waiting[g]
            if w is not None:
                stack.extend(w)
            g += 1
        pos[i], nxt[i] = g, at_next
    if any(pos[i] < ends[i] for i in range(p)):
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
                if delta > top_delta:
                    top_delta = delta
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
