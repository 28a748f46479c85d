"""Where the vocabulary passes go in a schedule: of a few ways to place them (``core.ir.vocab``), the
fastest (then the least memory) within the memory limit. Pure Python.

Plan's quick first pass over its rows (search effort 'quick') tries ``QUICK_VARIANTS`` alone: on
every row of four plans (Llama-3-8B at P=8 and P=16, Llama-3-70B and Llama-3.2-1B at P=8) the best
of them was within 0.6% of the best of all ``VARIANTS`` (without the delay of 2, 6.1% at P=16);
plan places the passes again with every variant where a row could lead (``core.plan``)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from ..ir import Schedule, ScheduleError, Setting
from ..ir.memo import Memo, setting_key
from ..sim.simulate import makespan_and_peak, simulate
from .vocab import delay_backwards, placed

if TYPE_CHECKING:  # (for an annotation only; the schedules are imported where used, as below)
    from .. import schedules

__all__ = ["VARIANTS", "place_vocab", "placer", "with_vocab", "vocab_alternatives"]


# the variants ``place_vocab`` tries: (backwards delayed by k forwards, or the loss stage's by k
# passes when k is negative; VW left pending at most)
VARIANTS = tuple((k, cap) for k in (0, 1, 2, -1, -2, -3) for cap in (1, 2, 4))
#: the variants of the quick effort: no delay and one VW pending at most; a delay of one forward,
#: and of two, with four
QUICK_VARIANTS = ((0, 1), (1, 4), (2, 4))

#: every variant's placement of one schedule and setting (``variants``): plan asks again for a
#: schedule it rebuilt under another memory limit (the limit only chooses among them)
_PLACED = Memo(32)


def place_vocab(schedule: Schedule, setting: Setting, memory_limit: Optional[float] = None,
                effort: str = "full") -> Schedule:
    """The vocabulary passes placed into ``schedule``: of the ``VARIANTS`` (``delay_backwards`` k,
    then ``add_vocab`` with that VW cap; ``effort`` 'quick': the ``QUICK_VARIANTS``), the one with
    the shortest makespan, then the least peak memory, among those within ``memory_limit`` where
    any is (deterministic)."""
    if schedule.placement.replicated:
        raise ScheduleError(f"vocabulary parallelism with replicated stages ({schedule.name}) is not supported: "
                            "each path would need its own output layer's shards")
    tried = QUICK_VARIANTS if effort == "quick" else VARIANTS
    found = variants(schedule, setting, tried)
    best, best_key = None, None
    for k, cap in tried:
        if found[(k, cap)] is None:
            continue
        _, makespan, peak = found[(k, cap)]
        over = memory_limit is not None and peak > memory_limit + 1e-9
        key = (over, round(makespan, 9), round(peak, 9), k, cap)
        if best_key is None or key < best_key:
            best_key = key
    if best_key is None:
        raise ScheduleError(f"vocabulary passes cannot be placed into {schedule.name}")
    k, cap = best_key[3:]
    # as ``add_vocab`` of that delay gives it: the delayed schedule's meta and the vocabulary's
    meta = dict(schedule.meta, vocab_delay=abs(k)) if k else dict(schedule.meta)
    meta = dict(meta, vocab=setting.vocab.to_dict(), vocab_variant={"delay": k, "w_cap": cap})
    best = Schedule(schedule.name, schedule.placement, schedule.num_microbatches,
                    [list(o) for o in found[(k, cap)][0]], meta)
    return best


def variants(schedule: Schedule, setting: Setting,
             tried: Tuple[Tuple[int, int], ...] = VARIANTS) -> Dict[Tuple[int, int], Optional[tuple]]:
    """Per entry of ``tried`` (default ``VARIANTS``): (the orders with the vocabulary passes placed,
    makespan, peak memory), or None where they cannot be placed. Remembered variant by variant
    (``_PLACED``; a function of the orders and the setting, whatever its memory limit: plan's full
    placement of a row goes on from its quick one). A variant that must place the passes as one
    tried before (the same delayed orders, or a larger cap where a smaller one never decided) is
    not placed again."""
    key = (schedule.placement, schedule.num_microbatches, tuple(tuple(o) for o in schedule.orders),
           setting_key(dataclasses.replace(setting, memory_limit=None)))
    placements = _PLACED.get(key, lambda: _Placements(schedule, setting))
    return {v: placements.get(*v) for v in tried}


class _Placements:
    """The variants placed so far into one schedule with one setting (``variants``)."""

    def __init__(self, schedule: Schedule, setting: Setting):
        self.schedule, self.setting = schedule, setting
        self.delayed: Dict[int, Tuple[Schedule, tuple]] = {}  # delay -> (delayed schedule, its orders)
        self.found: Dict[tuple, Dict[int, Tuple[Optional[tuple], bool]]] = {}  # orders -> cap -> (result, decided)
        self.coded: dict = {}  # each pass's inputs and cost (``placed``)

    def get(self, k: int, cap: int) -> Optional[tuple]:
        if k not in self.delayed:
            d = delay_backwards(self.schedule, abs(k), only_loss=k < 0)
            self.delayed[k] = (d, tuple(tuple(o) for o in d.orders))
        d, orders = self.delayed[k]
        found = self.found.setdefault(orders, {})  # another delay's with the same orders: the same placements
        if cap not in found:
            # a smaller cap that never decided: this one places the passes as it did
            loose = [c for c in sorted(found) if c < cap and not found[c][1] and found[c][0] is not None]
            if loose:
                found[cap] = found[loose[0]]
            else:
                try:
                    s, capped = placed(d, self.setting, w_cap=cap, coded=self.coded)
                    makespan, top = makespan_and_peak(s, self.setting)  # simulate's, without its timeline
                    found[cap] = ((tuple(tuple(o) for o in s.orders), makespan, top), capped)
                except ScheduleError:
                    found[cap] = (None, True)
        return found[cap][0]


def placer(st: Setting, limit: Optional[float], effort: str):
    """zb-auto's and v-auto's ``finish``: a schedule with its vocabulary passes placed, and its
    (makespan, -, peak)."""
    def finish(s: Schedule):
        placed = place_vocab(s, st, memory_limit=limit, effort=effort)
        makespan, top = makespan_and_peak(placed, st)
        return placed, (makespan, 0.0, top)
    return finish


def with_vocab(generate, spec, sched: Schedule, base: Setting, setting: Setting, effort: str = "full") -> Schedule:
    """The vocabulary passes placed into ``sched`` (``place_vocab``, at ``effort``; where
    it has them already, as zb-auto and v-auto place them at each limit they search: ``placer``).
    A search chose ``sched`` among its candidates without the vocabulary passes, so the passes also
    go into a few others it builds (``vocab_alternatives``): the fastest placed (then the least
    peak), within the memory limit where any is. A searched schedule whose passes then peak over the
    memory limit is searched again under a limit lowered by what they add (the vocabulary
    activations and the backwards they delay), until it fits."""
    st = dataclasses.replace(setting, chunks=sched.placement.chunks)
    limit = setting.memory_limit
    out, best, peak = None, None, None
    for cand in [sched] + vocab_alternatives(spec, base, effort):
        placed = cand if any(a.is_vocab for o in cand.orders for a in o) else \
            place_vocab(cand, st, memory_limit=limit, effort=effort)
        makespan, top = makespan_and_peak(placed, st)  # (top: simulate's highest peak)
        key = (limit is not None and top > limit + 1e-9, round(makespan, 9), round(top, 9))
        if best is None or key < best:
            out, best, peak = placed, key, top
    out = dataclasses.replace(out, name=sched.name)
    if limit is None or not spec.searched:
        return out
    # no schedule holds less than one microbatch's activations of its fullest rank (a rank's B waits
    # for its F's, a V rank's for both chunks'): a search under less fails (after seconds of looking
    # for the least memory that works)
    floor = st.stage_peak_unit(sched.placement)
    for step in range(1, 5):
        if peak <= limit + 1e-9:
            break
        lower = limit - (peak - limit) * step
        if lower < floor - 1e-9:
            break
        try:
            again = place_vocab(generate(dataclasses.replace(base, memory_limit=lower)), st, memory_limit=limit,
                                effort=effort)
        except ScheduleError:
            break
        p2 = max(simulate(again, st).peak_memory)
        if p2 < peak:
            out, peak = again, p2
    return out


def vocab_alternatives(spec: schedules.ScheduleSpec, base: Setting, effort: str):
    """Schedules a search builds besides the one it returns that may take the vocabulary passes
    better: the full search's quick one (the V family, zb-auto), zb-auto's hand-crafted ZB-H1 and
    ZB-H2 (zb-auto and v-auto also place the passes at each limit they search, 1F1B's peak
    among them, ``placer``). Without them v-auto with vocabulary parallelism was up to 15% slower
    than zb-v with it, zb-auto 18% slower than zb-h2 (plan's rows for Llama-3-8B at P=8 and
    Qwen2.5-7B at P=4)."""
    out = []
    if not spec.effort:
        return out
    if effort == "full":
        out.append(spec.generate(base, effort="quick"))
    if spec.name == "zb-auto":
        from ..schedules.zb_handcrafted import zb_h1, zb_h2
        for f in (zb_h1, zb_h2):
            try:
                out.append(f(dataclasses.replace(base, chunks=1)))
            except ScheduleError:
                pass
    return out
