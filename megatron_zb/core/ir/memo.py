"""Results of the searches remembered within one process, so that one ``megatron-zb plan`` (or a
compare) does not search the same thing twice: zb-v is v-auto's search at 1F1B's peak, v-auto's
and zb-auto's ladders search at 1F1B's peak again when plan rebuilds them under the limit they
need, the V searches under different limits build the same building blocks, and the rows of one
placement ask for the same balanced layout.

A search is a pure function of its arguments (deterministic, no clocks), so a remembered result
is the result: a hit hands back what the same call computed, copied where a caller could change
it. Keys hold every field of the setting (``setting_key``). The memory is small and bounded (the
oldest entries go first); nothing else in the core keeps state between calls.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Callable, Hashable, TypeVar

from . import Schedule, Setting

T = TypeVar("T")


def setting_key(setting: Setting) -> tuple:
    """Every field of ``setting`` as a hashable tuple (lists as tuples)."""
    return tuple((f.name, tuple(v) if isinstance(v, list) else v)
                 for f in dataclasses.fields(setting) for v in (getattr(setting, f.name),))


class Memo:
    """A bounded map from keys to results, least recently used out first."""

    def __init__(self, size: int):
        self.size = size
        self._data: "OrderedDict[Hashable, object]" = OrderedDict()

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The remembered result for ``key``, else ``compute()`` (remembered unless it raises, or
        ``key`` holds a part that cannot be a key, e.g. a setting's per-microbatch costs)."""
        try:
            hash(key)
        except TypeError:
            return compute()
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        value = compute()
        self._data[key] = value
        while len(self._data) > self.size:
            self._data.popitem(last=False)
        return value


def copy_schedule(s: Schedule, name: str) -> Schedule:
    """A copy a caller may change (fresh order lists and meta), named ``name``."""
    return Schedule(name, s.placement, s.num_microbatches, [list(o) for o in s.orders], dict(s.meta))
