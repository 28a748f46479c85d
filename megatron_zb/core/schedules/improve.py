"""Local search that starts from a valid schedule and fills idle gaps, never raising peak memory
above a limit: for the pass that follows an idle gap on some rank, try moving one of the next few
passes of that rank (a W, or a ready F) in front of it; keep the move if the makespan (then the
sum of spans) drops and the schedule stays valid. Stops after ``max_evals`` simulations or when no
move helps. The budget counts work, not seconds: every rank generates its schedule on its own
and must get the same one, whatever its load.

Also the lower bound every automatic result reports its gap against.
"""
from __future__ import annotations

from typing import List, Optional

from ..ir import B, BW, F, W, Action, Schedule, ScheduleError, Setting
from ..simulate import Deadlock, simulate
from ..validate import validate


def _score(res):
    return (round(res.makespan, 9), round(sum(res.spans), 9))


def improve(schedule: Schedule, setting: Setting, limit: Optional[float], max_evals: int = 400,
            lookahead: int = 6) -> Schedule:
    evals = 0
    best = schedule
    res = simulate(best, setting)
    best_score = _score(res)
    improved = True
    while improved and evals < max_evals:
        improved = False
        for r, tl in enumerate(res.timeline):
            for i in range(1, len(tl)):
                if tl[i].start <= tl[i - 1].end + 1e-9:
                    continue  # no gap before pass i
                order = best.orders[r]
                for j in range(i + 1, min(len(order), i + 1 + lookahead)):
                    a = order[j]
                    if a.kind not in (W, F):
                        continue
                    cand_order = order[:i] + [a] + order[i:j] + order[j + 1:]
                    cand = Schedule(best.name, best.placement, best.num_microbatches,
                                    best.orders[:r] + [cand_order] + best.orders[r + 1:], best.meta)
                    evals += 1
                    try:
                        cres = simulate(cand, setting)
                    except Deadlock:
                        continue
                    if limit is not None and max(cres.peak_memory) > limit + 1e-9:
                        continue
                    if _score(cres) < best_score:
                        best, res, best_score = cand, cres, _score(cres)
                        improved = True
                        break
                if improved or evals >= max_evals:
                    break
            if improved or evals >= max_evals:
                break
    validate(best, setting, memory_limit=float("inf") if limit is None else limit)
    return best


def lower_bound(setting: Setting, placement, limit: Optional[float]) -> float:
    """A makespan no schedule can beat: the busiest rank's work, and on the rank holding stage 0
    the wait for the first microbatch's gradient to come back, minus the forwards memory lets it
    run meanwhile."""
    p, m = setting.stages, setting.microbatches
    v = placement.chunks
    busy = [m * v * (setting.pass_cost(F, r) + setting.pass_cost(B, r) + setting.pass_cost(W, r))
            for r in range(p)]
    lb = max(busy)
    nst = placement.num_stages
    r0 = placement.rank_of(0)
    rk = placement.rank_of

    def cross(s):
        return 1 if rk(s) != rk(s + 1) else 0

    def chain(d):  # from F(0, mb 0) until B(d, mb 0) can start: down to the loss and back to d
        f_all = sum(setting.pass_cost(F, rk(s)) for s in range(nst))
        b_back = sum(setting.pass_cost(B, rk(s)) for s in range(d + 1, nst))
        hops = sum(cross(s) for s in range(nst - 1)) + sum(cross(s) for s in range(d, nst - 1))
        return f_all + b_back + hops * setting.cost_comm

    first_b = min(chain(d) for d in placement.stages_of(r0))
    f0 = setting.pass_cost(F, r0)
    fmem = setting.mem_f[r0] / v
    k = m * v if limit is None or fmem == 0 else max(1, int(limit / fmem + 1e-9))
    # until its first B can start, rank r0 can only run forwards (no B, hence no W, exists yet)
    wait = max(0.0, first_b - min(k, m * v) * f0)
    lb = max(lb, busy[r0] + wait)
    return lb
