"""Sequence-length files (``--seq-lengths FILE``): one sequence length per line, a blank line
between global batches; a line starting with ``#`` is a comment. Pure Python.

    4096
    517
    1203

    88
    2301
"""
from __future__ import annotations

from typing import List, Optional

from ..ir import ScheduleError

__all__ = ["parse_seq_lengths", "format_seq_lengths", "length_sampler"]

FORMAT = "one sequence length (an integer >= 1) per line, a blank line between global batches"


def parse_seq_lengths(text: str, source: str = "the file") -> List[List[int]]:
    """The global batches of a lengths file, each a list of sequence lengths in file order."""
    batches: List[List[int]] = []
    cur: List[int] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):
            continue
        if not line:
            if cur:
                batches.append(cur)
                cur = []
            continue
        try:
            v = int(line)
        except ValueError:
            v = None
        if v is None or v < 1:
            raise ScheduleError(f"{source} line {n}: {line[:40]!r} is not a sequence length ({FORMAT})")
        cur.append(v)
    if cur:
        batches.append(cur)
    if not batches:
        raise ScheduleError(f"{source} holds no sequence lengths ({FORMAT})")
    return batches


def format_seq_lengths(batches: List[List[int]]) -> str:
    """The text of a lengths file for ``batches``."""
    return "\n\n".join("\n".join(str(s) for s in b) for b in batches) + "\n"


def length_sampler(spec: str, max_length: Optional[int] = None):
    """A function index -> sequence length (deterministic) for ``spec``: ``lognormal:MEDIAN:SIGMA``
    (lengths e^N(ln MEDIAN, SIGMA), at least 1) or a lengths file (its lengths in turn, cycled).
    ``max_length`` caps every length."""
    import math
    import os
    import random
    text = str(spec)
    if text.startswith("lognormal:"):
        parts = text.split(":")
        try:
            median, sigma = float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            median = sigma = -1.0
        if len(parts) != 3 or not (median >= 1 and sigma >= 0):
            raise ScheduleError(f"{text!r}: give lognormal:MEDIAN:SIGMA (MEDIAN >= 1, SIGMA >= 0)")

        def draw(i: int) -> int:
            v = int(round(random.Random(i * 7919 + 17).lognormvariate(math.log(median), sigma)))
            return max(1, min(v, max_length) if max_length else v)
        return draw
    if not os.path.isfile(text):
        raise ScheduleError(f"{text!r} is neither lognormal:MEDIAN:SIGMA nor a lengths file")
    with open(text, encoding="utf-8") as f:
        flat = [s for b in parse_seq_lengths(f.read(), text) for s in b]
    return lambda i: max(1, min(flat[i % len(flat)], max_length) if max_length else flat[i % len(flat)])
