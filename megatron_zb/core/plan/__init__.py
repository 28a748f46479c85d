"""`megatron-zb plan`: rank the schedules for one GPT model and GPU memory budget.

Pure Python. Costs come from a profile JSON (``megatron-zb`` writes one while training with
profiling on) or from the model (``core.costs.model.ModelSpec``: the zero-bubble paper's per-layer FLOPs
at a GPU's dense peak times an efficiency, Megatron's per-layer activation formula generalised to the
element size, dropout, MoE and recompute, 18 bytes of model state per parameter).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import multiprocessing
from typing import List, Optional

from ..costs.model import ModelSpec, layer_split, stage_activation_bytes  # noqa: F401 (plan's model, re-exported)
from ..ir import ScheduleError
from ..schedules import names
from ..schedules.search.auto import TIE
from .levers import fit_rows, levered, rebuilt, vocab_twins
from .request import (CHUNK_CHOICES, EP_BANDWIDTH_GBPS, GPU_PEAK_TFLOPS, SEARCHES, MoeLever,  # noqa: F401 (re-exported)
                      OffloadLever, OptimizerOffload, PlanRequest, VocabLever)
from .row import load_profile, needed_limit, profile_costs  # noqa: F401 (re-exported)
from .row import row as one_row  # (``core.plan.row`` stays the module)

# schedules found by a search (seconds each at P=16), not built by a rule; the longest first
SEARCHED = ("v-auto", "zb-v", "v-half", "v-min", "zb-auto")

#: ``search='quick'``: a row searched quickly whose time per iteration lies within this share of the
#: leading row's is searched again in full where the full search adds building blocks (v-half,
#: v-min and v-auto under 1F1B's peak; the V family on settings of p x m <= 64): there it is up to
#: ~5% faster (2.1% for zb-v at P=4, M=8). Elsewhere (zb-v and v-auto at or above 1F1B's peak,
#: zb-auto, the vocabulary placements) the full search only searches longer or places the
#: vocabulary passes more ways: on the plans of five models at P=8 and two at P=4
#: (``benchmarks/bench_plan_speed.py --gaps``) at most 0.6% faster, for most of plan's time (P=16:
#: v-auto +vocab's 6 of 20 s for 0.25%). Those rows stay quick: their flags carry
#: ``--zero-bubble-search-effort quick``, which builds the very schedule the row measured
FULL_MARGIN = 0.06


def plan(request: PlanRequest, workers: Optional["Workers"] = None, jobs: int = 1) -> List[dict]:
    """Rows sorted by (fits, time per training iteration): with Megatron's synchronous optimizer
    step, or with optimizer post-validation when ``request.post_validation`` (``cost_optimizer``
    seconds per step); times within 0.1% count as equal, the least peak memory first
    (``by_memory_among_ties``). Each row carries both times. zb-auto's and v-auto's memory limit:
    see below. Activation offload (``request.offload``, ``OffloadLever``; ``core.passes.offload``):
    its ratio R (0..1) offloads that share of every schedule's activations; ``'auto'`` offloads as
    little as brings each schedule under the memory budget (zb-auto / v-auto may then take a
    schedule that needs more). ``request.exact``: the automatic schedules also get the exact MILP
    (``schedules.search.exact.refine``; not with offload). ``jobs`` > 1: the schedules are generated
    by that many processes at once (the same rows: every generator is deterministic); ``workers``: a
    ``Workers`` the caller keeps for several plans (its rows go on from what their workers remember),
    instead of ``jobs`` processes for this plan. MoE with expert parallelism (``request.moe``,
    ``MoeLever``): each F and B also moves its layers' all-to-all, hidden inside the overlapped F&B
    pairs a schedule forms unless its ``overlap`` is False.

    Layouts (``core.plan.row``): each row runs the layout ``request.layout`` (Megatron's
    ``--pipeline-model-parallel-layout`` grammar, pipeline order; a schedule whose model chunks it
    does not match gets an error row), or the faster of the even split and, with ``layout_search``,
    the balanced layout (``core.costs.layout_search``), each chunk costed by what it holds.
    ``request.vocab`` (``VocabLever``): its ``parallel`` 'off' (rows without vocabulary
    parallelism), 'on' (with) or 'both' (a row of each for every schedule; rows without it alone
    with offload, a profile or the exact mode). ``request.optimizer_offload`` (``core.optimizer.rows``):
    every row counts each rank's optimizer step, and a row that does not fit offloads each rank's
    share of its Adam states, updated on the CPU ('auto') or in the troughs ('trough').

    ``request.search``: 'full' searches every searched schedule's row in full (what training builds
    from its flags); 'quick' (default) searches them with the quick effort
    (``schedules.search.auto.EFFORTS``: several times faster), then, once the memory levers made the
    rows they can fit (``levers.fit_rows``, at each row's effort), again in full every such row within
    ``margin`` of the leading row's time per iteration (fitting rows first; a lever's variant with its
    levers, kept where it still fits) where the full search adds building blocks; the others stay
    quick, their flags saying so
    (``--zero-bubble-search-effort quick``: training builds that very schedule). Each searched row
    says which in ``search_effort``. ``refine`` False: the quick rows as they are (a caller that
    searches again in full only the row it chooses, ``within_1f1b_memory``).

    zb-auto's and v-auto's ``--zero-bubble-memory-limit`` (``memory_limit_microbatches``): the
    schedule's peak where the schedule built under it is as fast (the suggested row's, every row's
    with ``search='full'`` or ``tighten``: a search more each), else the budget's room (``room_limit``;
    its flags build the same schedule either way)."""
    if request.exact is not None and request.offload is not None:
        raise ScheduleError("the exact mode solves schedules without activation offload (the MILP has no host "
                            "link): leave out the offload ratio or the exact mode")
    # (no process starts before the first row: an error below leaves nothing running)
    own = Workers(jobs) if workers is None else contextlib.nullcontext(workers)
    request.check()
    key, p, m = request.ranked_by, request.pipeline_parallel_size, request.microbatches
    vocab_parallel = request.vocab.parallel
    if vocab_parallel == "both" and (request.profile is not None or request.exact is not None):
        vocab_parallel = "off"  # rows with vocabulary parallelism are not modelled with these
    full = request.search == "full"
    # offload 'auto' is a lever (``levers.fit_rows``): the rows are built without it, then the ones
    # that do not fit try it; a given ratio is the user's for every row
    lever = request.offload is not None and request.offload.ratio == "auto"
    built = request.replace(offload=None) if lever else request
    one = functools.partial(_job, request=built, effort=request.search, tighten=request.tighten or full)
    variants = {"off": [None], "on": [request.vocab.barriers], "both": [None, request.vocab.barriers]}[vocab_parallel]
    todo = [(name, v) for name in (request.schedules or names()) for v in variants]
    with own as pool:
        rows = pool.run(one, todo)
        tight = set(range(len(todo))) if request.tighten or full else set()  # rows whose limit was tightened
        # the levers first: the rows searched again in full are those that may lead once the levers
        # made rows fit (searched before, a row 12% behind the fastest fitting row was searched for seconds)
        rows = fit_rows(rows, request, _lever_builder(rows))
        levers = {i for i, r in enumerate(rows) if levered(r, request)}  # (each built with its limit tightened)
        tight |= levers
        redone: set = set()
        again = _leading_quick(rows, key, p, m) if request.refine else []
        while again:  # the rows that may lead, searched in full (until those near the new leader are)
            plain = [i for i in again if i not in levers]
            for i, r in zip(plain, pool.run(functools.partial(one, effort="full", tighten=True),
                                            [todo[i] for i in plain])):
                rows[i] = r
            for i in again:  # a lever's variant: in full with its levers, where it still fits
                if i in levers:
                    r = rebuilt(rows[i], request, _at_effort, "full")
                    if "error" not in r and r["fits"]:
                        rows[i] = r
            tight.update(again)
            redone.update(again)
            again = [i for i in _leading_quick(rows, key, p, m) if i not in redone]
        while request.refine:  # the suggested row's memory limit is its schedule's peak, not the budget's room
            i = _leader(rows, key)
            if i is None or i in tight or not room_limit(rows[i]):
                break
            tight.add(i)
            rows[i] = pool.run(functools.partial(one, tighten=True), [todo[i]])[0]
            redone.add(i)
    # a row searched again in full that no longer fits: its levers, at that effort
    rows = fit_rows(rows, request, _lever_builder(rows), only=redone - levers)
    rows = vocab_twins(rows, request, _at_effort)
    base = next((r for r in rows if r["schedule"] == "1f1b" and "error" not in r and not r.get("vocab_parallel")),
                None)
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        r["throughput_vs_1f1b"] = round(base[key] / r[key], 4) if base and r[key] else None
        if request.post_validation:
            r["flags"] += " --enable-optimizer-post-validation"
    ok = (by_memory_among_ties([r for r in ok if r["fits"]], lambda r: r[key], lambda r: max(r["peak_bytes"]))
          + by_memory_among_ties([r for r in ok if not r["fits"]], lambda r: r[key], lambda r: max(r["peak_bytes"])))
    # an error row once per schedule and reason (a placement's refusal holds with and without vocabulary)
    errors = {(r["schedule"], r["error"]): r for r in rows if "error" in r}
    return ok + list(errors.values())


#: the schedules whose rows share searches (and their remembered results, ``memo``) when their
#: vocabulary setting is the same: v-auto's at 1F1B's peak is zb-v's, v-half's and v-min's rounds
#: and placements are zb-v's kind
FAMILIES = {"zb-v": "v", "v-auto": "v", "v-half": "v", "v-min": "v"}


class Workers:
    """Processes for plan's rows: ``run(one, todo)`` gives ``one(job)`` for each (schedule,
    vocabulary barriers or None) job, in this process (``jobs`` 1, or a single job before any
    worker started) or by up to ``jobs`` worker processes that live as long as this object, each job
    always on the same worker: its full search (plan's second pass, and the re-plan within 1F1B's
    memory) goes on from what its worker remembers, and the jobs of one family (``FAMILIES``) share
    a worker and what it remembers (a pool that took any job on any worker searched those again:
    23% more CPU for Llama-3-8B at P=8 on two workers). Families go to the least loaded worker, the
    searched ones (seconds each) first. A context manager: the workers end with it."""

    def __init__(self, jobs: int):
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ScheduleError(f"jobs must be an integer >= 1 (processes generating schedules), got {jobs!r}")
        self.jobs, self.pools, self.worker, self.load = jobs, [], {}, []  # worker: family -> its worker

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self.pools = []

    def run(self, one, todo: list) -> List[dict]:
        if not self.pools and (self.jobs == 1 or len(todo) <= 1):
            return [one(job) for job in todo]
        if not self.pools:
            # fork where there is one: the workers need nothing re-imported (and the caller's main
            # module may be a script that cannot be, e.g. stdin)
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            n = min(self.jobs, len(todo))
            self.pools = [concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) for _ in range(n)]
            self.load = [0] * n
        self._assign(todo)
        # on each worker the searched schedules first, the longest first (they take seconds, the
        # others milliseconds)
        order = sorted(range(len(todo)), key=lambda i: SEARCHED.index(todo[i][0]) if todo[i][0] in SEARCHED
                       else len(SEARCHED))
        futures = {i: self.pools[self.worker[_family(todo[i])]].submit(one, todo[i]) for i in order}
        return [futures[i].result() for i in range(len(todo))]

    def _assign(self, todo: list) -> None:
        """A worker for each family not seen before, the heaviest first."""
        weight: dict = {}
        for job in todo:
            g = _family(job)
            if g not in self.worker:
                weight[g] = weight.get(g, 0) + (10 if job[0] in SEARCHED else 1)
        for g in sorted(weight, key=lambda g: -weight[g]):  # (stable: the order of ``todo`` among equals)
            w = min(range(len(self.pools)), key=lambda k: self.load[k])
            self.load[w] += weight[g]
            self.worker[g] = w


def _family(job: tuple) -> tuple:
    """A (schedule, vocabulary barriers or None) job's family (``FAMILIES``): its worker's key."""
    name, vocab = job
    return FAMILIES.get(name, name), vocab


def margin(row: dict, p: int, m: int) -> Optional[float]:
    """How far behind the leader a quickly searched row may lie and still be searched in full
    (``FULL_MARGIN``), or None where its full search adds no building block: the quick row stays
    (its flags build it)."""
    name = row["schedule"]
    limit = row.get("memory_limit_microbatches")
    v_family = name in ("zb-v", "v-half", "v-min", "v-auto")
    blocks = name in ("v-half", "v-min") or (v_family and p * m <= 64) or \
        (name == "v-auto" and limit is not None and limit < p - 1e-9)
    return FULL_MARGIN if blocks else None


def _leading_quick(rows: List[dict], key: str, p: int, m: int) -> List[int]:
    """Indices of the quickly searched rows within their ``margin`` of the leading row's ``key``
    (the fastest fitting row; where none fits, the fastest): those the full search could bring first."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return []
    fits = any(r["fits"] for r in ok)
    top = min(r[key] for r in ok if r["fits"] or not fits)
    return [i for i, r in enumerate(rows) if "error" not in r and r.get("search_effort") == "quick"
            and (r["fits"] or not fits) and margin(r, p, m) is not None and r[key] <= top * (1 + margin(r, p, m))]


def _leader(rows: List[dict], key: str) -> Optional[int]:
    """The index of the row plan suggests (the fastest that fits; of equally fast ones the least
    memory), None where none fits."""
    fit = [i for i, r in enumerate(rows) if "error" not in r and r["fits"]]
    order = by_memory_among_ties([rows[i] for i in fit], lambda r: r[key], lambda r: max(r["peak_bytes"]))
    return next(i for i in fit if rows[i] is order[0]) if fit else None


def room_limit(row: dict) -> bool:
    """Whether a searched row's memory limit is the budget's room, above its schedule's peak."""
    lim = row.get("memory_limit_microbatches")
    return bool(lim) and lim > needed_limit(max(row["activation_bytes"]) / row["activation_unit_bytes"]) + 1e-9


def _at_effort(name: str, vocab: Optional[int], request: PlanRequest, effort: str) -> dict:
    """One row at ``effort``, its searched limit tightened (a lever's variant built again)."""
    return one_row(name, vocab, request, effort, True)


def _lever_builder(rows: List[dict]):
    """``fit_rows``'s ``build_row``: a lever's variant of a row at the effort the row was searched with."""
    efforts = {(r["schedule"], r.get("vocab_parallel")): r.get("search_effort", "full")
               for r in rows if "error" not in r}
    return lambda name, vocab, req, fit_only=False: one_row(name, vocab, req, efforts.get((name, vocab), "full"), True,
                                                            fit_only)


def _job(job, request: PlanRequest, effort: str, tighten: bool) -> dict:
    """One (schedule, vocabulary barriers or None) row (``core.plan.row.row``)."""
    name, vocab = job
    return one_row(name, vocab, request, effort, tighten)


def by_memory_among_ties(rows: List[dict], time, peak, tie: float = TIE) -> List[dict]:
    """``rows`` by ``time(row)``, where times within ``tie`` (0.1%) of the fastest row not yet
    placed count as equal: those go first, least ``peak(row)`` first (then faster), then the
    rest the same way."""
    rest = sorted(rows, key=lambda r: (time(r), peak(r)))
    out = []
    while rest:
        top = time(rest[0]) * (1 + tie) + 1e-12
        group = [r for r in rest if time(r) <= top]
        rest = [r for r in rest if time(r) > top]
        out += sorted(group, key=lambda r: (round(peak(r), 6), time(r)))
    return out


def within_1f1b_memory(rows: List[dict], replan, full=None) -> Optional[dict]:
    """The fastest row that needs no more memory on any rank than Megatron's 1F1B (its row without
    vocabulary parallelism, fitting the budget), where the fastest fitting row needs more: the rows
    already made, and the searched schedules (v-auto, zb-auto, with their rows' vocabulary setting)
    planned again by ``replan(gib, names)`` with 1F1B's peak as the budget, so that their memory
    limit is the room under it. None where the fastest fitting row already needs no more, or
    without a 1F1B row. The row carries ``budget_gib`` and its speed over that 1F1B row. A row
    chosen that was searched quickly (``search_effort``) is built again by ``full(row, gib)`` (gib:
    the budget it was planned with; None: the plan's own) where that gives another row (the CLI's:
    searched in full where that adds building blocks, ``margin``; else its memory limit brought to
    its peak) and the choice made again; where it gives None the row is taken as it is."""
    ok = [r for r in rows if "error" not in r and r["fits"]]
    base = next((r for r in ok if r["schedule"] == "1f1b" and not r.get("vocab_parallel")), None)
    if base is None or not ok:
        return None
    key, cap = base["ranked_by"], max(base["peak_bytes"]) * (1 + 1e-9)
    if max(ok[0]["peak_bytes"]) <= cap:
        return None
    names = sorted({r["schedule"] for r in ok if r["schedule"] in ("v-auto", "zb-auto")})
    gib = max(base["peak_bytes"]) / 1024 ** 3
    again = [r for r in replan(gib, names) if "error" not in r and r["fits"]] if names else []
    cands = [(r, None) for r in ok] + [(r, gib) for r in again]
    while True:
        fit = [(r, g) for r, g in cands if max(r["peak_bytes"]) <= cap]
        if not fit:
            return None
        i = min(range(len(fit)), key=lambda i: (fit[i][0][key], max(fit[i][0]["peak_bytes"])))
        r, g = fit[i]
        redone = full(r, g) if r.get("search_effort") == "quick" and full is not None else None
        if redone is None:
            break
        cands = [(x, h) for x, h in cands if x is not r] + \
            ([(redone, g)] if "error" not in redone and redone["fits"] else [])
    best = dict(r)
    best["budget_gib"] = max(base["peak_bytes"]) / 1024 ** 3
    best["throughput_vs_1f1b"] = round(base[key] / best[key], 4) if best[key] else None
    return best

