"""``--zero-bubble-recompute-num-layers``: recompute per model chunk (issue 55), the flag and its checks.

Megatron's full recompute with the block method (``--recompute-granularity full --recompute-method
block --recompute-num-layers N``) recomputes the first N transformer layers of every model chunk
alike. The flag gives each chunk its own N: one count per pipeline rank (each of its chunks) or one
per model chunk in pipeline order (P x chunks values; a V rank r holds chunks r and 2P-1-r), what
``megatron-zb plan`` prints for a row that recomputes (``core.plan.levers.recompute_flags``) and
what plan's model costs (``core.costs.model.ModelSpec.recompute_counts``). ``stage_counts`` turns
the values into one count per model chunk and refuses, in one line, what cannot apply; training
(``megatron.launch.flags``) and verify (``verify.case``) share it; ``megatron.features.recompute``
makes each built chunk recompute its count. No torch import.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence, Tuple

from ....core.ir import Placement
from ...errors import ZeroBubbleArgumentError

__all__ = ["FLAG", "parse_counts", "add_recompute_args", "stage_counts", "training_stage_counts"]

FLAG = "--zero-bubble-recompute-num-layers"


def parse_counts(text: str) -> Tuple[int, ...]:
    """argparse type: a comma list of integers (their range is checked with the placement)."""
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{FLAG} takes layer counts, one per pipeline rank or one per model chunk "
                                         f"in pipeline order, comma-separated (e.g. 2,1,0,0), got {text!r}") from None


def add_recompute_args(group) -> None:
    group.add_argument(FLAG, type=parse_counts, default=None, metavar="N0,N1,...",
                       help="With --recompute-granularity full --recompute-method block: how many of its first layers "
                            "each model chunk recomputes in B (Megatron's --recompute-num-layers gives every chunk the "
                            "same): one count per pipeline rank (each of its chunks) or one per model chunk in "
                            "pipeline order (P x chunks values; a V rank r holds chunks r and 2P-1-r), 0 for none; "
                            "what `megatron-zb plan` prints for a row that recomputes.")


def stage_counts(counts: Sequence[int], placement: Placement, layers: Sequence[int], *, granularity: Optional[str],
                 method: Optional[str]) -> Tuple[int, ...]:
    """Each model chunk's recomputed layers, in pipeline order (``placement``'s stages), from the
    flag's values; ``layers``: the layers each chunk holds; ``granularity`` / ``method``: Megatron's
    --recompute-granularity / --recompute-method. Raises ``ValueError`` (one line) where they cannot
    apply."""
    p, s = placement.num_ranks, placement.num_stages
    if granularity != "full" or method != "block":
        raise ValueError(f"{FLAG} sets the block method's count per model chunk: add --recompute-granularity full "
                         "--recompute-method block")
    if placement.replicated:
        raise ValueError(f"{FLAG} is not available with replicated stages (bitpipe): give Megatron's "
                         "--recompute-num-layers")
    if len(counts) not in (p, s):
        per_chunk = f" or one per model chunk in pipeline order ({s})" if s != p else ""
        raise ValueError(f"{FLAG} has {len(counts)} values: give one per pipeline rank ({p}){per_chunk}")
    if any(n < 0 for n in counts):
        raise ValueError(f"{FLAG} takes layer counts >= 0, got {','.join(map(str, counts))}")
    out = tuple(int(counts[c] if len(counts) == s else counts[placement.rank_of(c)]) for c in range(s))
    for c, (n, held) in enumerate(zip(out, layers)):
        if n > held:
            raise ValueError(f"{FLAG} asks {n} recomputed layers of model chunk {c} (pipeline rank "
                             f"{placement.rank_of(c)}), which holds {held}")
    return out


def training_stage_counts(args, placement: Placement) -> Optional[Tuple[int, ...]]:
    """``stage_counts`` from Megatron's parsed arguments (megatron-zb's flags validated: the layers
    each chunk holds are the layout's, ``args.zero_bubble_layers_per_stage``, or the even split);
    None without the flag. Sets Megatron's ``--recompute-num-layers`` to the largest count where it
    was not given (Megatron asks for one with full recompute). Raises ``ZeroBubbleArgumentError``."""
    counts = getattr(args, "zero_bubble_recompute_num_layers", None)
    if counts is None:
        return None
    layers = getattr(args, "zero_bubble_layers_per_stage", None)
    if not layers:
        n = int(getattr(args, "num_layers", 0) or 0)
        layers = [n // placement.num_stages] * placement.num_stages
    try:
        out = stage_counts(counts, placement, layers, granularity=getattr(args, "recompute_granularity", None),
                           method=getattr(args, "recompute_method", None))
    except ValueError as e:
        raise ZeroBubbleArgumentError(str(e)) from None
    if getattr(args, "recompute_num_layers", None) is None:
        args.recompute_num_layers = max(1, max(out))
    return out
