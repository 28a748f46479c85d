"""Round-based heuristic for one stage per rank, after the rules of the ZB paper (Qi et al.,
"Zero Bubble Pipeline Parallelism", section 3.1), written from their description:

1. **Warm-up.** Every stage runs microbatch 0's F; then, from the last stage back, stage j counts
   the extra forwards that fit in memory and (``overrun=False``) end before microbatch 0's
   gradient can arrive from stage j+1, or (``overrun=True``) start before it, so that at most
   one forward is still running when it arrives. Stage j must run fewer forwards than stage
   j-1 (so its inputs exist); then every stage runs its B of microbatch 0.
2. **Steady rounds.** Round i gives each stage one more F (stage 0 first, so each F's input is
   known) and then B of microbatch i on every stage (last stage first, so each B's gradient is
   known). Before a pass, W's fill the wait for its input when they end in time; a W that
   would overrun the input's arrival runs anyway when the stage's idle time would otherwise
   grow past the largest idle time of any stage (``fill_small=False``: small gaps stay idle,
   balancing the bubble between stages), or always (``fill_small=True``). W's also run when
   the memory limit needs their memory back.
3. A stage always has at least one more F than the next. With ``skip_f``, a stage that is two
   or more ahead skips its F in a round if running it (with the W's memory forces) would delay
   the next stage's gradient and its idle time stays within the largest one; a stage that
   skips makes every earlier stage skip too.
4. When a stage's F's and B's are done, its remaining W's run one after the other (stage 0
   runs its pending W's before each B once its forwards are done).

Times are the simulator's (each pass at the earliest moment its input and its rank allow), so
the orders returned simulate to exactly the times used here. Deterministic, O(p m).
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

from ...ir import Action, B, F, Placement, Schedule, ScheduleError, Setting, W

EPS = 1e-9


def round_schedule(setting: Setting, limit: float, overrun: bool, skip_f: bool, fill_small: bool, tol: float = EPS,
                   name: str = "rounds") -> Schedule:
    return _materialize(_rounds(setting, limit, overrun, skip_f, fill_small, tol), setting, limit, name)


def _materialize(raw, setting: Setting, limit: float, name: str) -> Schedule:
    orders, key, near, policy = raw
    return Schedule(name, Placement.single(setting.stages), setting.microbatches,
                    [[Action(k, j, i) for k, i in o] for j, o in enumerate(orders)],
                    {"memory_limit": limit, "policy": policy, "timing": key, "near_ties": near})


def _rounds(setting: Setting, limit: float, overrun: bool, skip_f: bool, fill_small: bool, tol: float):
    """(per-stage orders of (kind, microbatch), (makespan, sum of spans, peak), near ties, policy)"""
    p, m = setting.stages, setting.microbatches
    st = setting
    cf, cb, cw = list(st.cost_f), list(st.cost_b), list(st.cost_w)
    c = st.cost_comm
    dmem = {F: list(st.mem_f), B: [-(a - b) for a, b in zip(st.mem_f, st.mem_w)], W: [-x for x in st.mem_w]}
    if any(x > limit + EPS for x in st.mem_f):
        raise ScheduleError(f"memory limit {limit:g} is below one forward's activation ({max(st.mem_f):g})")
    end = {F: [[0.0] * m for _ in range(p)], B: [[0.0] * m for _ in range(p)]}
    clock = [0.0] * p
    mem = [0.0] * p
    idle = [0.0] * p
    most = [0.0]  # the largest idle time of any stage (idle times only grow)
    count = {F: [0] * p, B: [0] * p, W: [0] * p}
    orders: List[List[Tuple[str, int]]] = [[] for _ in range(p)]
    cost = {F: cf, B: cb, W: cw}
    first = [0.0] * p
    peak = [0.0] * p
    near = [False]  # did a comparison fall within EPS without being exact (float noise)?

    def le(a: float, b: float) -> bool:  # a <= b, ties within ``tol``
        d = a - b
        if 0.0 < abs(d) <= EPS:
            near[0] = True
        return d <= tol

    def arrival(j: int, kind: str) -> float:
        i = count[kind][j]
        if kind == F:
            return 0.0 if j == 0 else end[F][j - 1][i] + c
        if kind == B:
            return end[F][j][i] if j == p - 1 else end[B][j + 1][i] + c
        return end[B][j][i]

    def put(j: int, kind: str) -> None:
        start = max(clock[j], arrival(j, kind))
        if not orders[j]:
            first[j] = start
        if count[F][j]:
            idle[j] += start - clock[j]
            if idle[j] > most[0]:
                most[0] = idle[j]
        i = count[kind][j]
        clock[j] = start + cost[kind][j]
        if kind != W:
            end[kind][j][i] = clock[j]
        mem[j] += dmem[kind][j]
        if mem[j] > peak[j]:
            peak[j] = mem[j]
        count[kind][j] += 1
        orders[j].append((kind, i))

    def pending(j: int) -> bool:
        return count[W][j] < count[B][j]

    def make_room(j: int, need: float) -> None:
        while mem[j] + need > limit + EPS:
            if not pending(j):
                raise ScheduleError(f"round heuristic: stage {j} cannot fit memory limit {limit:g}")
            put(j, W)

    def fill(j: int, at: float) -> None:
        while pending(j) and le(clock[j] + cw[j], at):
            put(j, W)
        if pending(j) and not le(at, clock[j]):
            if fill_small or not le(at - clock[j], most[0] - idle[j]):
                put(j, W)

    # 1. warm-up
    for j in range(p):
        put(j, F)
    extra = [0] * p
    back = end[F][p - 1][0] + cb[p - 1]  # end of B(p-1, 0)
    for j in range(p - 2, -1, -1):
        t, mm = clock[j], mem[j]
        arrive = back + c
        while count[F][j] + extra[j] < m and mm + dmem[F][j] <= limit + EPS:
            if (not le(t + cf[j], arrive)) if not overrun else le(arrive, t):
                break
            t += cf[j]
            mm += dmem[F][j]
            extra[j] += 1
        back = max(t, arrive) + cb[j]
    for j in range(1, p):
        while extra[j] > 0 and extra[j] >= extra[j - 1] and count[F][j] + extra[j] < m:
            extra[j] -= 1
    for j in range(p):
        for _ in range(extra[j]):
            put(j, F)
    for j in range(p - 1, -1, -1):
        put(j, B)

    # 2./3. steady rounds
    for i in range(1, m):
        want = [count[F][j] < m for j in range(p)]
        if skip_f:
            for j in range(p - 1):
                if not want[j] or count[F][j] < count[F][j + 1] + 2:
                    continue
                horizon = clock[j + 1] + cf[j + 1] + cb[j + 1] + c
                if le(horizon, clock[j]):
                    want[j] = False
                    continue
                mm, k, wt = mem[j] + dmem[F][j], count[W][j], 0.0
                while mm > limit + EPS and k < count[B][j]:
                    mm += dmem[W][j]
                    wt += cw[j]
                    k += 1
                if le(clock[j] + cf[j] + wt, horizon):
                    continue
                if le(horizon - clock[j], most[0] - idle[j]):
                    want[j] = False
        for j in range(p - 2, -1, -1):
            want[j] = want[j] and want[j + 1]
        for j in range(p):
            if not want[j]:
                continue
            make_room(j, dmem[F][j])
            if j > 0:
                fill(j, end[F][j - 1][count[F][j]] + c)
            put(j, F)
        for j in range(p - 1, -1, -1):
            if count[F][j] <= i:
                raise ScheduleError(f"round heuristic: stage {j} has no F for microbatch {i}")
            make_room(j, dmem[B][j])
            if j < p - 1:
                fill(j, end[B][j + 1][i] + c)
            if j == 0 and count[F][0] == m:
                while pending(0):
                    put(0, W)
            put(j, B)

    # 4. the rest of the W's
    for j in range(p):
        while pending(j):
            put(j, W)
    spans = [clock[j] - first[j] for j in range(p)]
    return (orders, (round(max(spans), 9), round(sum(spans), 9), round(max(peak), 9)), near[0],
            {"overrun": overrun, "skip_f": skip_f, "fill_small": fill_small, "tie_tolerance": tol})


def round_variants(setting: Setting, limit: float, name: str = "rounds", keep: Optional[int] = None) -> List[Schedule]:
    """The variants (overrun x skip_f x fill_small) that do not fail. Which one wins is
    sensitive to ties between a gap and a pass: each is built with a tolerance of 1e-9 and, if
    some comparison fell within it (float noise, e.g. sums of 18.522 and 0.601), again with
    exact comparisons. ``meta['timing']`` is (makespan, sum of spans, peak memory) as built
    (the simulator times the orders the same way). ``keep``: only the best that many, by it."""
    raws = []
    for overrun, skip_f, fill_small in itertools.product((False, True), repeat=3):
        try:
            raw = _rounds(setting, limit, overrun, skip_f, fill_small, EPS)
        except ScheduleError:
            continue
        raws.append(raw)
        if raw[2]:  # exact comparisons may decide differently
            try:
                raws.append(_rounds(setting, limit, overrun, skip_f, fill_small, 0.0))
            except ScheduleError:
                pass
    if keep is not None:
        raws = sorted(raws, key=lambda r: r[1])[:keep]
    return [_materialize(r, setting, limit, name) for r in raws]
