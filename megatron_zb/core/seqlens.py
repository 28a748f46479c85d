"""Sequence-length files (``--seq-lengths FILE``): one sequence length per line, a blank line
between global batches; a line starting with ``#`` is a comment. Pure Python.

    4096
    517
    1203

    88
    2301
"""
from __future__ import annotations

from typing import List

from .ir import ScheduleError

__all__ = ["parse_seq_lengths", "format_seq_lengths"]

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
