"""Where the vocabulary passes go in a schedule: of a few ways to place them (``core.vocab``), the
fastest (then the least memory) within the memory limit. Pure Python."""
from __future__ import annotations

from typing import Optional

from .ir import Schedule, ScheduleError, Setting
from .simulate import simulate
from .vocab import add_vocab, delay_backwards

__all__ = ["VARIANTS", "place_vocab"]


# the variants ``place_vocab`` tries: (backwards delayed by k forwards, or the loss stage's by k
# passes when k is negative; VW left pending at most)
VARIANTS = tuple((k, cap) for k in (0, 1, 2, -1, -2, -3) for cap in (1, 2, 4))


def place_vocab(schedule: Schedule, setting: Setting, memory_limit: Optional[float] = None) -> Schedule:
    """The vocabulary passes placed into ``schedule``: of the ``VARIANTS`` (``delay_backwards`` k,
    then ``add_vocab`` with that VW cap), the one with the shortest makespan, then the least peak
    memory, among those within ``memory_limit`` where any is (deterministic)."""
    if schedule.placement.replicated:
        raise ScheduleError(f"vocabulary parallelism with replicated stages ({schedule.name}) is not supported: "
                            "each path would need its own output layer's shards")
    best, best_key = None, None
    for k, cap in VARIANTS:
        try:
            s = add_vocab(delay_backwards(schedule, abs(k), only_loss=k < 0), setting, w_cap=cap)
            res = simulate(s, setting)
        except ScheduleError:
            continue
        peak = max(res.peak_memory)
        over = memory_limit is not None and peak > memory_limit + 1e-9
        key = (over, round(res.makespan, 9), round(peak, 9), k, cap)
        if best_key is None or key < best_key:
            best, best_key = s, key
    if best is None:
        raise ScheduleError(f"vocabulary passes cannot be placed into {schedule.name}")
    best.meta = dict(best.meta, vocab_variant={"delay": best_key[3], "w_cap": best_key[4]})
    return best
