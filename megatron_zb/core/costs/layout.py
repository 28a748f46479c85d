"""Model layouts: which layers each pipeline stage (model chunk) holds. Pure Python, no torch.

A layout lists the virtual stages in pipeline order (stage 0 holds the embedding, the last one the
output layer and loss). Each stage is a string of Megatron's layer letters: ``E`` embedding, ``t``
transformer layer, ``m`` multi-token-prediction layer, ``L`` loss (with the final norm and the
output layer). Megatron's grammar for ``--pipeline-model-parallel-layout`` is accepted as it is:
``|`` between stages, ``*N`` repeats the letter before it, ``(...)*N`` repeats a group, commas are
cosmetic, e.g. ``"E|(tt|)*3,m|L"`` or ``"Et*3|(t*4|)*6t*3L"``.

How a stage maps to a rank is the placement's business (``ir.Placement``): one chunk per rank
(stage r on rank r), Megatron's interleaving (stage s on rank s % P) or a V (the 2P stages are
ranks 0..P-1 then P-1..0, so the first and the last stage both sit on rank 0). Megatron reads its
layout string with the interleaved mapping; megatron-zb reads it in pipeline order under every
placement, so the same string describes the same model cut whichever schedule runs it.

Megatron's rules hold: the embedding comes first and once, the loss last and once, every MTP layer
after every transformer layer and all MTP layers in one stage. A stage may hold nothing but the
embedding or the loss.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..ir import ScheduleError

__all__ = ["EMBEDDING", "LAYER", "MTP", "LOSS", "Layout", "parse", "from_counts", "from_megatron_flags"]

EMBEDDING, LAYER, MTP, LOSS = "E", "t", "m", "L"
_LETTERS = (EMBEDDING, LAYER, MTP, LOSS)
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")


@dataclass(frozen=True)
class Layout:
    """One string of layer letters per virtual stage, in pipeline order."""

    stages: Tuple[str, ...]

    def __post_init__(self):
        stages = tuple(str(s) for s in self.stages)
        object.__setattr__(self, "stages", stages)
        if not stages:
            raise ScheduleError("a layout needs at least one stage")
        for i, s in enumerate(stages):
            bad = sorted(set(s) - set(_LETTERS))
            if bad:
                raise ScheduleError(f"layout stage {i} ({s!r}) has unknown layer letter(s) {''.join(bad)}: use E "
                                    "(embedding), t (transformer layer), m (MTP layer), L (loss)")
        flat = "".join(stages)
        if flat.count(EMBEDDING) != 1 or flat.count(LOSS) != 1:
            raise ScheduleError(f"a layout holds the embedding E and the loss L exactly once each, got "
                                f"{flat.count(EMBEDDING)} E and {flat.count(LOSS)} L in {self}")
        if not stages[0].startswith(EMBEDDING):
            raise ScheduleError(f"the embedding E must open the first stage of the layout, got {self}")
        if not stages[-1].endswith(LOSS):
            raise ScheduleError(f"the loss L must close the last stage of the layout, got {self}")
        if MTP in flat:
            if LAYER in flat[flat.index(MTP):]:
                raise ScheduleError(f"MTP layers (m) come after every transformer layer (t), got {self}")
            if sum(1 for s in stages if MTP in s) > 1:
                raise ScheduleError(f"all MTP layers (m) must sit in one stage, got {self}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def layers(self) -> List[int]:
        """Transformer layers per stage."""
        return [s.count(LAYER) for s in self.stages]

    def mtp_layers(self) -> List[int]:
        return [s.count(MTP) for s in self.stages]

    @property
    def num_layers(self) -> int:
        return sum(self.layers())

    @property
    def num_mtp_layers(self) -> int:
        return sum(self.mtp_layers())

    def layer_ranges(self) -> List[range]:
        """The global (0-based) transformer layer indices of each stage."""
        out, start = [], 0
        for n in self.layers():
            out.append(range(start, start + n))
            start += n
        return out

    def check(self, num_layers: Optional[int] = None, mtp_layers: Optional[int] = None,
              pipeline_parallel_size: Optional[int] = None, num_stages: Optional[int] = None,
              flag: str = "--pipeline-model-parallel-layout") -> "Layout":
        """Raise a one-line error unless the layout matches the model and the pipeline."""
        if num_layers is not None and self.num_layers != num_layers:
            raise ScheduleError(f"{flag} {self} holds {self.num_layers} transformer layer(s) (t), but --num-layers "
                                f"is {num_layers}")
        if mtp_layers is not None and self.num_mtp_layers != mtp_layers:
            raise ScheduleError(f"{flag} {self} holds {self.num_mtp_layers} MTP layer(s) (m), but --mtp-num-layers "
                                f"is {mtp_layers}")
        if pipeline_parallel_size is not None and self.num_stages % pipeline_parallel_size:
            raise ScheduleError(f"{flag} {self} has {self.num_stages} stages, not a multiple of "
                                f"--pipeline-model-parallel-size {pipeline_parallel_size}")
        if num_stages is not None and self.num_stages != num_stages:
            raise ScheduleError(f"{flag} {self} has {self.num_stages} stages; this schedule runs {num_stages} "
                                "model chunks in all (pipeline ranks x chunks per rank)")
        return self

    def __str__(self) -> str:
        return to_str(self.stages)


def _expand(text: str) -> str:
    s = text.replace(",", "").replace(" ", "")
    for _ in range(64):  # innermost groups first, so nested groups work too
        new = _GROUP.sub(lambda g: g.group(1) * int(g.group(2)), s)
        if new == s:
            break
        s = new
    if "(" in s or ")" in s:
        raise ScheduleError(f"layout {text!r}: a parenthesised group must be followed by *N (e.g. (tt|)*3)")
    s = _REPEAT.sub(lambda g: g.group(1) * int(g.group(2)), s)
    if "*" in s:
        raise ScheduleError(f"layout {text!r}: '*' must follow a layer letter or a group and precede a count")
    return s


def parse(text: str, pipeline_parallel_size: Optional[int] = None) -> Layout:
    """A layout from Megatron's ``--pipeline-model-parallel-layout`` grammar."""
    if not isinstance(text, str) or not text.strip():
        raise ScheduleError("--pipeline-model-parallel-layout is empty: give e.g. 'E|(tt|)*3,m|L'")
    layout = Layout(tuple(_expand(text).split("|")))
    return layout.check(pipeline_parallel_size=pipeline_parallel_size)


def from_counts(counts: Sequence[int], mtp_layers: int = 0) -> Layout:
    """A layout with ``counts[i]`` transformer layers on stage i, the embedding on the first stage
    and the loss (after the MTP layers) on the last."""
    counts = [int(c) for c in counts]
    if not counts or any(c < 0 for c in counts):
        raise ScheduleError(f"layer counts per stage must be non-negative, got {counts}")
    stages = [LAYER * c for c in counts]
    stages[0] = EMBEDDING + stages[0]
    stages[-1] = stages[-1] + MTP * int(mtp_layers) + LOSS
    return Layout(tuple(stages))


def to_str(stages: Sequence[str]) -> str:
    """Megatron's grammar, compact: runs of a letter as ``t*N`` (N >= 3), runs of equal stages as
    ``(stage|)*N``."""
    def one(s: str) -> str:
        return "".join(ch * n if n < 3 else f"{ch}*{n}" for ch, n in _runs(s))

    parts = [one(s) for s in stages]
    out, i = [], 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1] == parts[i]:
            j += 1
        n = j - i + 1
        last_run = j == len(parts) - 1
        reps = n - 1 if last_run else n  # a group ends with '|'; the last stage cannot
        if reps >= 2:
            out.append(f"({parts[i]}|)*{reps}" + ("," if i + reps < len(parts) else ""))
            i += reps
        else:
            out.append(parts[i] + ("" if i == len(parts) - 1 else "|"))
            i += 1
    return "".join(out)


def _runs(s: str) -> List[Tuple[str, int]]:
    out: List[Tuple[str, int]] = []
    for ch in s:
        if out and out[-1][0] == ch:
            out[-1] = (ch, out[-1][1] + 1)
        else:
            out.append((ch, 1))
    return out


def from_megatron_flags(num_layers: int, pipeline_parallel_size: int, chunks: int, rank_of_stage,
                        first: Optional[int] = None, last: Optional[int] = None,
                        account_for_embedding: bool = False, account_for_loss: bool = False,
                        pad_ends: bool = False, mtp_layers: int = 0) -> Layout:
    """The layout Megatron's uneven-split flags describe, for a placement (``rank_of_stage(s)``
    over P x chunks stages in pipeline order).

    Megatron's meaning, per pipeline rank: ``--decoder-first-pipeline-num-layers N`` gives rank 0
    N layers and ``--decoder-last-pipeline-num-layers N`` rank P-1, the other ranks share the rest
    evenly, and each rank's layers spread evenly over its chunks.
    ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` count
    the embedding / the loss as one layer of the split: the stage holding it gets one layer less.
    ``--allow-padding-num-layers`` (the ZB fork's): the first and the last stage one layer less.
    Ten parameters, on purpose: the placement's two (``chunks``, ``rank_of_stage``) and one per Megatron
    flag the split depends on (--num-layers, --pipeline-model-parallel-size, the four uneven-split flags,
    --allow-padding-num-layers, --mtp-num-layers), each its own keyword as Megatron names it, so that a
    caller passes Megatron's arguments through one for one."""
    p, v = int(pipeline_parallel_size), int(chunks)
    S = p * v
    stages_of = [[s for s in range(S) if rank_of_stage(s) == r] for r in range(p)]
    if first is not None or last is not None:
        if account_for_embedding or account_for_loss:
            raise ScheduleError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                                "--account-for-embedding/loss-in-pipeline-split (Megatron refuses it too)")
        per_rank = [None] * p
        rest, left = num_layers, p
        for r, n, flag in ((0, first, "--decoder-first-pipeline-num-layers"),
                           (p - 1, last, "--decoder-last-pipeline-num-layers")):
            if n is None:
                continue
            if n < 0 or n > num_layers:
                raise ScheduleError(f"{flag} {n} must lie in 0..--num-layers ({num_layers})")
            per_rank[r] = n
            rest -= n
            left -= 1
        if rest < 0:
            raise ScheduleError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}) hold more than "
                                f"--num-layers {num_layers}")
        if left > 0 and rest % left:
            raise ScheduleError(f"with --decoder-first/last-pipeline-num-layers the other {left} pipeline ranks share "
                                f"{rest} layers, which does not divide evenly")
        if left == 0 and rest:
            raise ScheduleError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}) leave {rest} layer(s) "
                                f"of --num-layers {num_layers} on no rank")
        per_rank = [n if n is not None else (rest // left if left else 0) for n in per_rank]
        counts = [0] * S
        for r in range(p):
            if per_rank[r] % v:
                raise ScheduleError(f"pipeline rank {r} holds {per_rank[r]} layers, which do not spread evenly over "
                                    f"its {v} model chunks")
            for s in stages_of[r]:
                counts[s] = per_rank[r] // v
        return from_counts(counts, mtp_layers)
    extra = int(bool(account_for_embedding)) + int(bool(account_for_loss))
    if pad_ends:
        extra = 2
        account_for_embedding = account_for_loss = True
    total = num_layers + extra
    if total % S:
        what = (" (counting the embedding and/or loss as a layer)" if extra else "")
        raise ScheduleError(f"{num_layers} layers{what} do not split evenly over {S} model chunks "
                            f"({p} ranks x {v}); give --pipeline-model-parallel-layout for an uneven split")
    counts = [total // S] * S
    if account_for_embedding:
        counts[0] -= 1
    if account_for_loss:
        counts[-1] -= 1
    if min(counts) < 0:
        raise ScheduleError(f"{num_layers} layers cannot fill {S} model chunks")
    return from_counts(counts, mtp_layers)
