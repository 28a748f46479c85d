"""Schedules searched under a memory limit: zb-auto (one stage per rank), and what every search
here and in ``vsearch`` (the V family) shares: ranking candidates, the local search that finishes
them, the ladder of limits, the memory tie-break.

zb-auto: the best of the greedy variants (``greedy.py``), the hand-crafted ZB-H1/ZB-H2/1F1B that
fit the limit, then a local search from the best (``improve.py``). Default limit p x mem-f
(1F1B's peak, where it matches ZB-H1's bubble or beats it); with 2p it reaches zero bubble at
equal costs. An infeasible limit is an error stating the least memory that works.

Memory is the tie-break everywhere: among the schedules a search found within 0.1% (``TIE``) of
the fastest (makespan and end of the last pass), the one with the lowest peak activation is kept,
then the one with the lowest iteration time with optimizer post-validation. Such a tie can give up
up to 0.1% of time for memory (on bench_vs_authors' grid: a few settings, e.g. zb-auto P=8 M=16 at
2P with H100 costs, 0.08% slower than the authors' zb.py with a quarter less memory).
zb-auto and v-auto under a limit above 1F1B's peak also search at 1F1B's peak and at 1.5 and 2
times it (``least_memory_of``): a generous limit is not spent where a smaller one is as fast.

Every search here is deterministic (work budgets, no clocks): each rank generates the schedule
on its own and all must get the same one.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

from ...ir import Placement, Schedule, ScheduleError, Setting
from ...ir.memo import Memo, copy_schedule, setting_key
from ...sim.simulate import simulate
from ...sim.validate import validate
from .bounds import lower_bound
from .evaluate import Coder, Run
from .greedy import best_of, capped_variants
from .improve import improve
from .rounds import round_variants

#: times within this share of the fastest count as equally fast: plan and compare rank their rows
#: within it by memory, the searches keep the least peak within it (``_cheapest``), the offload
#: search stops within it of the unlimited schedule
TIE = 1e-3
#: equal up to float noise: the tie of a search without memory as its tie-break (``memory=False``)
NOISE = 1e-9
#: zb-auto's searches done in this process (``memo``): plan asks for some of them more than once
_DONE = Memo(32)
#: the candidate generators' results in this process: plan's full search of a row builds the
#: quick search's candidates again (``remembered``)
_CANDIDATES = Memo(64)


def remembered(fn: Callable, st: Setting, *args, name: str):
    """``fn(st, *args, name)`` (a candidate generator: deterministic), remembered (``memo``); a
    ScheduleError it raised is raised again. Copies named ``name``."""
    def run():
        try:
            return fn(st, *args, name)
        except ScheduleError as e:
            return e
    found = _CANDIDATES.get((fn.__name__, setting_key(st), args), run)
    if isinstance(found, ScheduleError):
        raise ScheduleError(str(found))
    if isinstance(found, Schedule):
        return copy_schedule(found, name)
    return [copy_schedule(x, name) for x in found]
#: how hard the V family's searches look: 'full' (every candidate family, the long local search:
#: what simulate, compare and training build) or 'quick' (plan's first pass over its rows: no
#: building blocks, a shorter local search; plan searches its leading rows again in full)
EFFORTS = ("full", "quick")


def check_effort(effort: str) -> str:
    if effort not in EFFORTS:
        raise ScheduleError(f"search effort is one of {', '.join(EFFORTS)}, got {effort!r}")
    return effort


def _cheapest(ranked: List[Tuple[tuple, Schedule]], setting: Setting,
              tie: float = TIE) -> Tuple[tuple, Schedule]:
    """Of ranked (key, schedule) pairs, key = (makespan, sum of spans, peak): among those within
    ``tie`` of the fastest (least makespan, then sum of spans) both in makespan and in the end of
    the last pass (the iteration time with a synchronous optimizer step), the one with the least
    peak; among equal peaks, the least iteration time with optimizer post-validation (``iteration``'s
    model, timed by the coder, only where two are left), then makespan, end, sum of spans.
    The peaks compared are counted here, not taken from the keys (vslots' building blocks claim
    0.0 there, which let them win every tie whatever they held)."""
    ref = min(ranked, key=lambda x: x[0][:2])
    near = [x for x in ranked if x[0][0] <= ref[0][0] * (1 + tie) + 1e-9]
    if len(near) == 1:
        return ref
    coder = Coder.of(setting, ref[1].placement, setting.microbatches)

    def end_peak(s: Schedule) -> Tuple[float, float, list]:
        """The end of its last pass, its peak as the coder counts it (a key's own peak may be a
        placeholder: vslots' building blocks carry 0.0), and its coded orders."""
        orders = coder.encode(s.orders)
        t = coder.time(orders)
        return (round(max(t.end[o[-1]] for o in orders if o), 9), round(max(coder.peak(o) for o in orders), 6),
                orders)

    ends = {id(x[1]): end_peak(x[1]) for x in near}
    top = ends[id(ref[1])][0] * (1 + tie) + 1e-9
    near = [x for x in near if ends[id(x[1])][0] <= top]
    least = min(ends[id(x[1])][1] for x in near)
    near = [x for x in near if ends[id(x[1])][1] == least]
    if len(near) == 1:
        return near[0]
    # post-validated time >= makespan (a rank's next iteration starts after its own last pass):
    # in makespan order, one whose makespan is above the best time found so far cannot win
    best, best_key = None, None
    for x in sorted(near, key=lambda x: (x[0][0], ends[id(x[1])][0], x[0][1])):
        if best is not None and x[0][0] > best_key[0] + 1e-9:
            break
        k = (round(coder.post_validated(ends[id(x[1])][2], setting.cost_comm), 9), x[0][0],
             ends[id(x[1])][0], x[0][1])
        if best is None or k < best_key:
            best, best_key = x, k
    return best


def pass_count(setting: Setting) -> int:
    return setting.stages * setting.microbatches * (setting.chunks or 1) * 3


def _evals(setting: Setting, work: int = 250_000) -> int:
    """Local-search budget (timings per candidate): scaled so that the work (``work`` pass
    timings) stays about the same whatever the size (a timing costs one pass over every pass)."""
    n = int(work / pass_count(setting))
    return min(600, n) if n >= 10 else 0


def _key(coder: Coder, s: Schedule, limit: Optional[float]):
    if "timing" in s.meta:  # timed as it was built (round heuristic)
        k = tuple(s.meta["timing"])
        return None if limit is not None and k[2] > limit + 1e-9 else k
    orders = coder.encode(s.orders)
    t = coder.time(orders)
    if t is None:
        return None
    if limit is not None and any(coder.peak(o) > limit + 1e-9 for o in orders):
        return None
    return (round(t.makespan, 9), round(sum(t.spans), 9), round(max(coder.peak(o) for o in orders), 9))


def rank_candidates(cands: List[Schedule], setting: Setting, limit: Optional[float]) -> List[Tuple[tuple, Schedule]]:
    """Valid candidates under the limit, best first (makespan, sum of spans, peak), duplicates
    (same timing) dropped."""
    if not cands:
        return []
    coder = Coder.of(setting, cands[0].placement, setting.microbatches)
    out, seen = [], set()
    for s in cands:
        k = _key(coder, s, limit)
        if k is None or k in seen:
            continue
        seen.add(k)
        out.append((k, s))
    out.sort(key=lambda x: x[0])
    return out


@dataclasses.dataclass(frozen=True)
class Finish:
    """How hard ``finish_search`` looks: local searches from the best ``top`` candidates,
    ``_evals(setting, work)`` pass timings each; schedules within ``tie`` of the shortest count as
    equally short."""

    top: int = 3
    work: int = 250_000
    tie: float = TIE


def finish_search(ranked: List[Tuple[tuple, Schedule]], setting: Setting, limit: Optional[float], name: str,
                  how: Finish = Finish(), lb: Optional[float] = None, sim: Optional[list] = None) -> Schedule:
    """Local search (``how``) on the best ``how.top`` distinct candidates (``ranked``, best first,
    at least one: ``rank_candidates`` / ``search_candidates``) unless the best already meets the
    lower bound ``lb`` (default: ``lower_bound`` under ``limit``); of the results and the
    candidates, the one with the least peak memory among those as short as the shortest
    (``_cheapest``), with its gap to the bound, named ``name``. A candidate that starts worse often
    ends better (a different basin), hence several. ``sim``: a list the chosen schedule's
    simulation (with ``setting``) is appended to, for a caller that needs it."""
    if lb is None:
        lb = lower_bound(setting, ranked[0][1].placement, limit)
    pool = list(ranked)
    evals = _evals(setting, how.work)
    if ranked[0][0][0] > lb + 1e-9 and evals > 0:
        pool += rank_candidates([improve(s, setting, limit, max_evals=evals) for _, s in ranked[:how.top]], setting,
                                limit)
    chosen = _cheapest(pool, setting, how.tie)[1] if len(pool[0][0]) == 3 else pool[0][1]
    if sim is not None:  # (the caller builds on its simulation: validated here)
        res = validate(chosen, setting, memory_limit=float("inf") if limit is None else limit)
        sim.append(res)
        makespan = res.makespan
    else:  # (every schedule ``build`` returns is validated there)
        makespan = Run(Coder.of(setting, chosen.placement, setting.microbatches), chosen, setting).makespan
    meta = {k: v for k, v in chosen.meta.items() if k not in ("timing", "near_ties")}
    meta = dict(meta, memory_limit=limit, memory_claim=limit, lower_bound=round(lb, 9),
                gap_to_lower_bound=round(max(0.0, makespan / lb - 1.0), 6) if lb > 0 else 0.0)
    return dataclasses.replace(chosen, name=name, meta=meta)


def _pick(cands: List[Schedule], setting: Setting, limit: Optional[float]) -> Optional[Schedule]:
    ranked = rank_candidates(cands, setting, limit)
    return ranked[0][1] if ranked else None


def search_candidates(name: str, st: Setting, pl: Placement, limit: float, cands: List[Schedule],
                      bracket: Tuple[float, float], other: Optional[Callable[[float], Optional[Schedule]]] = None,
                      greedy_too: bool = True) -> List[Tuple[tuple, Schedule]]:
    """``cands`` and (``greedy_too``, or when none fits) the greedy variants under ``limit``,
    ranked best first; an infeasible limit is an error naming the least memory at which the
    greedy variants or ``other`` find a schedule (searched within ``bracket``, (lo, hi))."""
    ranked = rank_candidates(cands, st, limit)
    if greedy_too or not ranked:
        try:
            g = remembered(best_of, st, pl, limit, name=name)
            ranked = sorted(ranked + rank_candidates([g], st, limit), key=lambda x: x[0])
        except ScheduleError:
            pass
    best = ranked[0][1] if ranked else None
    if best is None:
        def attempt(x: float) -> Schedule:
            try:
                return best_of(st, pl, x, name)
            except ScheduleError:
                found = other(x) if other is not None else None
                if found is None:
                    raise
                return found
        need = _least_memory(attempt, st, *bracket)
        raise ScheduleError(f"{name}: no schedule fits memory limit {limit:g}; the least that works is about "
                            f"{need:g} (units of mem-f)")
    return ranked


def _least_memory(fn: Callable[[float], Schedule], setting: Setting, lo: float, hi: float) -> float:
    """The least peak memory of a schedule ``fn`` finds under a limit in [lo, hi] (bisection;
    each schedule found counts with its own peak, which may lie below the limit asked for)."""
    def peak(x: float) -> Optional[float]:
        try:
            return max(simulate(fn(x), setting).peak_memory)
        except ScheduleError:
            return None

    found = peak(lo)
    if found is not None:
        return found
    bad, good = lo, hi
    for _ in range(6):
        mid = (bad + good) / 2
        found = peak(mid)
        if found is None:
            bad = mid
        else:
            good = min(good, found)
    return good


def _zb_auto(setting: Setting, sim: Optional[list] = None, tie: float = TIE, effort: str = "full") -> Schedule:
    """zb-auto's search under ``setting.memory_limit`` (remembered: ``memo``)."""
    if sim is not None:
        return _zb_auto_search(setting, sim, tie, effort)
    found = _DONE.get(("zb-auto", setting_key(setting), tie, effort),
                      lambda: _zb_auto_search(setting, None, tie, effort))
    return copy_schedule(found, found.name)


def _zb_auto_search(setting: Setting, sim: Optional[list], tie: float, effort: str = "full") -> Schedule:
    """``effort`` 'quick' (``EFFORTS``): the hand-crafted and round schedules alone, the local
    search of the best of them at 100,000 pass timings."""
    from ..basic import one_f_one_b
    from ..zb_handcrafted import zb_h1, zb_h2
    p = setting.stages
    pl = Placement.single(p)
    limit = setting.memory_limit if setting.memory_limit is not None else f1b_peak(setting, pl)
    st = dataclasses.replace(setting, chunks=1)
    cands = [f(st) for f in (zb_h1, zb_h2, one_f_one_b)]
    # the event-driven greedy costs ~ passes x p; it rarely wins
    small = pass_count(st) * p <= 150_000 and effort == "full"
    if limit >= unit(st, pl) - 1e-9:
        cands += remembered(_rounds_kept, st, limit, name="zb-auto")
        if small:
            cands += remembered(capped_variants, st, limit, name="zb-auto")
    ranked = search_candidates("zb-auto", st, pl, limit, cands, (unit(st, pl), 2 * f1b_peak(st, pl)),
                               greedy_too=small)
    how = Finish(top=1, work=100_000, tie=tie) if effort == "quick" else Finish(tie=tie)
    return finish_search(ranked, st, limit, "zb-auto", how, sim=sim)


def zb_auto(setting: Setting, memory: bool = True, sim: Optional[list] = None, effort: str = "full",
            finish: Optional[Callable] = None) -> Schedule:
    """``memory``: memory is the tie-break (under a limit above 1F1B's peak it also searches at
    smaller limits, ``least_memory_of``, and keeps the least peak within ``TIE`` of the fastest);
    without it the fastest under the limit (the offload search's bases: there memory is what
    offload is for). ``sim`` (without ``memory``): as ``finish_search``'s. ``effort`` 'quick' (plan's
    first pass): ``_zb_auto_search``'s, on the quick ladder (``LADDER``). ``finish``: what becomes
    of each limit's schedule before they are compared (``least_memory_of``; e.g. the vocabulary
    passes placed)."""
    check_effort(effort)
    st = dataclasses.replace(setting, chunks=1)
    limit = setting.memory_limit if setting.memory_limit is not None else f1b_peak(st, Placement.single(st.stages))
    st = dataclasses.replace(st, memory_limit=limit)
    if not memory:
        return _zb_auto(st, sim, tie=NOISE, effort=effort)
    return least_memory_of(lambda lim: _zb_auto(dataclasses.replace(st, memory_limit=lim), effort=effort), st,
                            Placement.single(st.stages), limit, "zb-auto", effort, finish)


def unit(setting: Setting, placement: Optional[Placement] = None) -> float:
    """One rank's whole-stage activation of one microbatch, the largest over the ranks (1F1B's
    peak is P of these): mem-f per rank, or the sum of a rank's chunks where it is given per
    chunk (``placement``: the schedule's; default one stage per rank)."""
    return setting.stage_peak_unit(placement or Placement.single(setting.stages))


def f1b_peak(setting: Setting, placement: Placement) -> float:
    """1F1B's depth of memory on ``placement`` for a schedule that splits its backwards: P whole-stage
    activations (``unit``), plus what one B adds before its W frees it where a W holds more than
    its F (full recompute: F keeps the layer's input, B recreates the layer and W keeps its GEMMs'
    inputs). 1F1B itself fuses the two and peaks at P units; a split schedule cannot go below this."""
    own = setting if setting.vocab is None else dataclasses.replace(setting, vocab=None)
    grow = max(own.pass_mem("B", placement.rank_of(s), s) for s in range(placement.num_stages))
    return setting.stages * unit(setting, placement) + max(0.0, grow)


#: the ladder's limits in units of 1F1B's peak (``_ladder``): the full effort's, the quick one's
LADDER = {"full": (1.0, 1.5, 2.0), "quick": (1.0,)}


def _ladder(setting: Setting, limit: float, pl: Optional[Placement] = None, effort: str = "full") -> List[float]:
    """The limits searched below ``limit``: 1F1B's peak (p x mem-f), 1.5 and 2 times it (the
    quick effort: 1F1B's peak)."""
    one = setting.stages * unit(setting, pl)
    return [x * one for x in LADDER[effort] if x * one < limit - 1e-9]


def least_memory_of(run: Callable[[float], Schedule], setting: Setting, pl: Placement, limit: float,
                     name: str, effort: str = "full", finish: Optional[Callable] = None) -> Schedule:
    """``run(limit)`` at 1F1B's peak (the ladder's first limit), then at ``limit`` itself, then,
    where ``limit`` bought time over 1F1B's peak (more than ``TIE``), at the ladder's other limits
    (ascending), stopping once a schedule below ``limit`` meets the lower bound under ``limit``;
    of those found, the one with the least peak memory within ``TIE`` of the fastest
    (``_cheapest``) (a schedule at ``limit`` is always tried unless one at 1F1B's peak already
    meets the bound, so the result is never more than ``TIE`` slower than the search at ``limit``
    alone). The limits between serve a ``limit`` that buys time, for a schedule as fast with less
    memory; where it buys none, the one at 1F1B's peak is as fast already (the schedule
    fingerprints, P <= 4, are the same as with every limit searched in ascending order).
    ``finish(schedule) -> (schedule, (makespan, sum of spans, peak))``: each limit's schedule as
    it is compared (and returned), e.g. with its vocabulary passes placed: then the least peak within
    ``TIE`` of the fastest of those, over the limit last (``_least_finished``)."""
    steps = _ladder(setting, limit, pl, effort)
    if not steps and finish is None:
        return run(limit)
    lb = lower_bound(setting, pl, limit)
    found = []
    for lim in ([steps[0], limit] + steps[1:]) if steps else [limit]:
        if lim in steps[1:] and len(found) == 2 and found[1][0][0] >= found[0][0][0] * (1 - TIE):
            break  # the limit bought no time over 1F1B's peak
        try:
            s = run(lim)
        except ScheduleError:
            if lim == limit:
                raise
            continue
        r = simulate(s, setting)
        if finish is not None:
            s, key = finish(s)
            found.append((tuple(round(x, 9) for x in key), s))
        else:
            found.append(((round(r.makespan, 9), round(sum(r.spans), 9), round(max(r.peak_memory), 9)), s))
        if r.makespan <= lb + 1e-9 and lim != limit:
            break  # (at ``limit`` the limits between may still give as fast a schedule with less memory)
    if finish is not None:
        key, chosen = _least_finished(found, limit)
        return dataclasses.replace(chosen, name=name, meta=dict(chosen.meta, memory_limit=limit, memory_claim=limit))
    key, chosen = _cheapest(found, setting)
    gap = round(max(0.0, key[0] / lb - 1.0), 6) if lb > 0 else 0.0
    return dataclasses.replace(chosen, name=name, meta=dict(chosen.meta, memory_limit=limit, memory_claim=limit,
                                                            lower_bound=round(lb, 9), gap_to_lower_bound=gap))


def _least_finished(found: List[Tuple[tuple, Schedule]], limit: float) -> Tuple[tuple, Schedule]:
    """Of (key (makespan, sum of spans, peak), schedule) pairs: those within ``limit`` where any is,
    and of them the least peak within ``TIE`` of the fastest (then the faster)."""
    within = [x for x in found if x[0][2] <= limit + 1e-9] or found
    top = min(x[0][0] for x in within) * (1 + TIE) + 1e-9
    return min((x for x in within if x[0][0] <= top), key=lambda x: (x[0][2], x[0][0], x[0][1]))


def _rounds_kept(st: Setting, limit: float, name: str) -> List[Schedule]:
    return round_variants(st, limit, name, keep=4)
