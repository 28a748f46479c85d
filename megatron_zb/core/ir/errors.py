"""The core's error and the checks of a setting's values (``ir.Setting``). Pure Python."""
from __future__ import annotations

from typing import List, Optional

__all__ = ["ScheduleError", "is_nonneg_number", "setting_values"]


class ScheduleError(ValueError):
    """A schedule or setting is malformed. The message names what is wrong and what is right."""


def is_nonneg_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and 0 <= x < float("inf")


def setting_values(name: str, values, p: int, chunks: Optional[int]) -> List[float]:
    """One value (for every rank), one per rank, or one per model chunk (P x chunks, chunks > 1)."""
    if isinstance(values, (int, float)):
        values = [values]
    values = list(values)
    for x in values:
        if not is_nonneg_number(x):
            raise ScheduleError(f"{name} must be non-negative numbers, got {x!r}")
    if len(values) == 1:
        return [float(values[0])] * p
    if len(values) == p or (chunks and chunks > 1 and len(values) == p * chunks):
        return [float(x) for x in values]
    per_chunk = (f", or one per model chunk ({p} x {chunks} = {p * chunks})" if chunks and chunks > 1
                 else " (one per model chunk where a schedule runs several chunks per rank)")
    raise ScheduleError(f"{name} has {len(values)} values; give one value or one per stage ({p}){per_chunk}")
