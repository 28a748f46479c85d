"""Exact mode: the best schedule as a mixed-integer program, solved with HiGHS
(``scipy.optimize.milp``). Meant for small settings (p <= 4, m <= 8 solve in seconds) and to
measure how far the heuristics are from optimal.

Model (split backward, any placement whose stages 0..p-1 lie on distinct ranks: one stage per
rank, V, looped):

* a start time t_x for every pass; t_x >= end of its input (+ cost_comm across ranks);
* every stage runs its F's, its B's and its W's each in microbatch order (all our generators
  and the authors' do; it removes the symmetric copies of every schedule), so "x before y" is
  implied for a pair of passes when x's kind and stage precede y's in one microbatch's chain and
  x's microbatch is not later;
* for every other pair on one rank a binary z picks the order, and big-M constraints keep the
  two apart;
* memory: after every F its rank's running sum (the passes ordered before it, through the z's)
  stays within the limit;
* each rank's first pass (its first stage's microbatch 0 F) starts when the chain of first
  forwards reaches it, as the simulator would start it; the objective is the longest span
  C >= end of every rank's last W - that start.

So its optimum is the least simulated makespan over all schedules that keep microbatch order on
every stage. The node limit (``node_limit``, deterministic) or a time limit (``time_limit``
seconds: machine-dependent, so ranks could disagree; only for offline use) bounds the search.
An incumbent's makespan caps C. HiGHS reports the best schedule found and its dual bound.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ...ir import Action, B, F, Placement, Schedule, ScheduleError, Setting, W
from ...sim.simulate import simulate

Key = Tuple[str, int, int]


@dataclasses.dataclass
class ExactResult:
    schedule: Optional[Schedule]  # the best found (None if HiGHS found none under the cap)
    makespan: Optional[float]
    dual_bound: float  # no schedule of this kind is shorter
    optimal: bool
    status: str
    nodes: int
    binaries: int


def _chain_pos(S: int) -> Dict[Tuple[str, int], float]:
    pos = {}
    for s in range(S):
        pos[(F, s)] = s
        pos[(B, s)] = 2 * S - 1 - s
        pos[(W, s)] = 2 * S - 1 - s + 0.5
    return pos


def _precedes(pos, a: Tuple[str, int], b: Tuple[str, int]) -> bool:
    """a comes before b in one microbatch's dependency order (a W feeds nothing)."""
    if a == b or a[0] == W:
        return False
    if b[0] == W:
        return a == (B, b[1]) or pos[a] < pos[(B, b[1])]
    return pos[a] < pos[b]


def solve(setting: Setting, placement: Placement, limit: Optional[float], upper: Optional[float] = None,
          node_limit: Optional[int] = 20000, time_limit: Optional[float] = None,
          lower: float = 0.0) -> ExactResult:
    """Solve the model; ``upper`` caps the makespan (an incumbent's), ``lower`` is a known lower
    bound (it tightens the relaxation)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    pl = placement
    st = dataclasses.replace(setting, chunks=pl.chunks)
    S, R, m = pl.num_stages, pl.num_ranks, st.microbatches
    rank = [pl.rank_of(s) for s in range(S)]
    first_stage = {}
    for s in range(S):
        first_stage.setdefault(rank[s], s)
    if any(first_stage[rank[s]] != s for s in range(R)) or sorted(first_stage.values()) != list(range(R)):
        raise ScheduleError("exact mode needs stages 0..p-1 on distinct ranks (one stage per rank, V or looped)")
    pos = _chain_pos(S)
    kinds = [(k, s) for s in range(S) for k in (F, B, W)]
    cost = {(k, s): st.pass_cost(k, rank[s], s) for k, s in kinds}
    dmem = {(k, s): st.pass_mem(k, rank[s], s) for k, s in kinds}
    c = st.cost_comm
    keys: List[Key] = [(k, s, j) for (k, s) in kinds for j in range(m)]
    idx = {x: i for i, x in enumerate(keys)}
    n_t = len(keys)

    def dep(x: Key) -> Optional[Key]:
        k, s, j = x
        if k == F:
            return (F, s - 1, j) if s > 0 else None
        if k == B:
            return (B, s + 1, j) if s < S - 1 else (F, s, j)
        return (B, s, j)

    def hop(a: Key, b: Key) -> float:
        return c if rank[a[1]] != rank[b[1]] else 0.0

    # earliest starts along dependencies and microbatch order (topological: j, F up, B down, W)
    topo = [(F, s, j) for j in range(m) for s in range(S)]
    order = []
    for j in range(m):
        order += [(F, s, j) for s in range(S)] + [(B, s, j) for s in reversed(range(S))] + [(W, s, j) for s in range(S)]
    topo = order
    es: Dict[Key, float] = {}
    for x in topo:
        t = 0.0
        d = dep(x)
        if d is not None:
            t = es[d] + cost[d[:2]] + hop(d, x)
        if x[2] > 0:
            t = max(t, es[(x[0], x[1], x[2] - 1)] + cost[x[:2]])
        es[x] = t
    start = {r: es[(F, first_stage[r], 0)] for r in range(R)}
    # latest starts under the cap: the rank's span cannot exceed `upper`
    if upper is None:
        upper = sum(cost[x[:2]] for x in keys) + 2 * S * c * m  # everything one after the other
    desc = {a: [b for b in kinds if rank[b[1]] == rank[a[1]] and _precedes(pos, a, b)] for a in kinds}
    ls: Dict[Key, float] = {}
    for x in keys:
        k, s, j = x
        after = (m - 1 - j) * cost[(k, s)] + (m - j) * sum(cost[b] for b in desc[(k, s)])
        ls[x] = start[rank[s]] + upper - cost[(k, s)] - after
        if ls[x] < es[x] - 1e-9:
            return ExactResult(None, None, upper, False, "infeasible under the cap", 0, 0)

    # same-rank pairs whose order is not implied
    by_rank: Dict[int, List[Key]] = {r: [] for r in range(R)}
    for x in keys:
        by_rank[rank[x[1]]].append(x)

    def implied(a: Key, b: Key) -> bool:  # a before b in every schedule of this kind
        if a[:2] == b[:2]:
            return a[2] < b[2]
        return _precedes(pos, a[:2], b[:2]) and a[2] <= b[2]

    pairs: List[Tuple[Key, Key]] = []
    for r, xs in by_rank.items():
        for i, a in enumerate(xs):
            for b in xs[i + 1:]:
                if not implied(a, b) and not implied(b, a):
                    pairs.append((a, b))
    n_z = len(pairs)
    n = n_t + n_z + 1  # times, binaries, C
    iC = n - 1
    rows, cols, vals, lo, hi = [], [], [], [], []
    row = [0]

    def add(coefs: List[Tuple[int, float]], lb: float, ub: float) -> None:
        for col, v in coefs:
            rows.append(row[0])
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)
        row[0] += 1

    inf = np.inf
    for x in keys:  # inputs and microbatch order
        d = dep(x)
        if d is not None:
            add([(idx[x], 1.0), (idx[d], -1.0)], cost[d[:2]] + hop(d, x), inf)
        if x[2] > 0:
            p = (x[0], x[1], x[2] - 1)
            add([(idx[x], 1.0), (idx[p], -1.0)], cost[x[:2]], inf)
    for zi, (a, b) in enumerate(pairs):  # z = 1: a before b
        z = n_t + zi
        M1 = max(0.0, ls[a] + cost[a[:2]] - es[b])
        M2 = max(0.0, ls[b] + cost[b[:2]] - es[a])
        add([(idx[b], 1.0), (idx[a], -1.0), (z, -M1)], cost[a[:2]] - M1, inf)
        add([(idx[a], 1.0), (idx[b], -1.0), (z, M2)], cost[b[:2]], inf)
    if limit is not None and limit != float("inf"):
        zpos = {}
        for zi, (a, b) in enumerate(pairs):
            zpos.setdefault(b, []).append((a, n_t + zi, True))  # a before b <=> z
            zpos.setdefault(a, []).append((b, n_t + zi, False))  # b before a <=> 1 - z
        for r, xs in by_rank.items():
            for y in xs:
                if dmem[y[:2]] <= 0:
                    continue
                base = dmem[y[:2]] + sum(dmem[x[:2]] for x in xs if x != y and implied(x, y))
                coefs = []
                for x, z, direct in zpos.get(y, []):
                    if direct:
                        coefs.append((z, dmem[x[:2]]))
                    else:
                        base += dmem[x[:2]]
                        coefs.append((z, -dmem[x[:2]]))
                if coefs:
                    add(coefs, -inf, limit - base)
                elif base > limit + 1e-9:
                    return ExactResult(None, None, upper, False, "memory limit below what any schedule needs", 0, 0)
    for s in range(S):  # the span: C >= end of the rank's last W - its first start
        x = (W, s, m - 1)
        add([(iC, 1.0), (idx[x], -1.0)], cost[(W, s)] - start[rank[s]], inf)
    A = coo_matrix((vals, (rows, cols)), shape=(row[0], n)).tocsr()
    lb = np.array([es[x] for x in keys] + [0.0] * n_z + [min(lower, upper)])
    ub = np.array([ls[x] for x in keys] + [1.0] * n_z + [upper + 1e-9])
    for r in range(R):  # first passes start as the simulator starts them
        i = idx[(F, first_stage[r], 0)]
        ub[i] = lb[i]
    integrality = np.array([0] * n_t + [1] * n_z + [0])
    cvec = np.zeros(n)
    cvec[iC] = 1.0
    options = {"presolve": True, "disp": False}
    if node_limit is not None:
        options["node_limit"] = int(node_limit)
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    res = milp(cvec, integrality=integrality, bounds=Bounds(lb, ub),
               constraints=LinearConstraint(A, np.array(lo), np.array(hi)), options=options)
    nodes = int(getattr(res, "mip_node_count", 0) or 0)
    dual = getattr(res, "mip_dual_bound", None)
    if res.status == 0:
        status = "optimal"
    elif res.status == 2:
        status = "infeasible under the cap"
    elif res.status == 1 or "limit" in str(res.message).lower():  # HiGHS may call a node limit a solution limit
        status = "node or time limit reached"
    else:
        status = "stopped: " + str(res.message)
    if res.x is None:
        return ExactResult(None, None, float(dual) if dual is not None else 0.0, False, status, nodes, n_z)
    times = res.x[:n_t]
    rank_of_key = lambda x: rank[x[1]]  # noqa: E731
    tie = {x: i for i, x in enumerate(topo)}
    orders: List[List[Action]] = [[] for _ in range(R)]
    for x in sorted(keys, key=lambda x: (round(times[idx[x]], 6), tie[x])):
        orders[rank_of_key(x)].append(Action(*x))
    sched = Schedule("exact", pl, m, orders)
    mk = simulate(sched, st).makespan
    optimal = res.status == 0
    if dual is None or optimal:
        dual = res.fun if optimal else 0.0
    return ExactResult(sched, mk, float(dual), optimal, status, nodes, n_z)


AUTOMATIC = ("zb-auto", "v-auto", "zb-v", "v-half", "v-min")
MAX_BINARIES = 20000  # beyond this the model takes longer to build than it is worth


def refine(schedule: Schedule, setting: Setting, node_limit: Optional[int] = 20000,
           time_limit: Optional[float] = None) -> Schedule:
    """``schedule`` (from an automatic scheduler) or a shorter one from the MILP under the same
    memory limit, with ``meta['exact']`` saying what the solver proved and ``lower_bound`` /
    ``gap_to_lower_bound`` updated with its dual bound."""
    from .bounds import lower_bound
    pl = schedule.placement
    st = dataclasses.replace(setting, chunks=pl.chunks)
    limit = schedule.meta.get("memory_limit", setting.memory_limit)
    heur = simulate(schedule, st).makespan
    lb = lower_bound(st, pl, limit)
    info = {"node_limit": node_limit, "time_limit": time_limit, "heuristic_makespan": round(heur, 9)}
    best, bound = schedule, lb
    if heur <= lb + 1e-9:
        info.update(status="the heuristic meets the lower bound", optimal=True, nodes=0)
    else:
        S, m = pl.num_stages, st.microbatches
        per_rank = 3 * m * (S // pl.num_ranks)
        estimate = pl.num_ranks * per_rank * (per_rank - 1) // 2
        if estimate > 4 * MAX_BINARIES:
            info.update(status=f"too large for exact mode (about {estimate // 2} order variables; "
                        "meant for small settings such as p <= 4, m <= 8)", optimal=False, nodes=0)
        else:
            r = solve(st, pl, limit, upper=heur, node_limit=node_limit, time_limit=time_limit, lower=lb)
            info.update(status=r.status, optimal=r.optimal, nodes=r.nodes, binaries=r.binaries,
                        dual_bound=round(r.dual_bound, 9))
            bound = max(lb, r.dual_bound)
            if r.schedule is not None and r.makespan < heur - 1e-9:
                best = r.schedule
            if r.optimal:
                bound = max(bound, min(heur, r.makespan if r.makespan is not None else heur))
    mk = simulate(best, st).makespan
    info["makespan"] = round(mk, 9)
    meta = dict(schedule.meta, exact=info, lower_bound=round(bound, 9),
                gap_to_lower_bound=round(max(0.0, mk / bound - 1.0), 6) if bound > 0 else 0.0)
    return dataclasses.replace(best, name=schedule.name, meta=meta)
