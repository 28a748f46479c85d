"""Megatron's layout flags under every megatron-zb schedule: which layers each model chunk holds.

Megatron describes an uneven model cut with ``--pipeline-model-parallel-layout`` (``core.costs.layout``'s
grammar), ``--decoder-first/last-pipeline-num-layers`` and ``--account-for-embedding/loss-in-
pipeline-split`` (the ZB fork adds ``--allow-padding-num-layers``). megatron-zb reads them in
pipeline order for every placement (``core.costs.layout``): under one chunk per rank and Megatron's
interleaving that is Megatron's own reading, so Megatron keeps its flags and builds the same layers
(the placement's layer table says the same); under a V or BitPipe Megatron would read the stages as
interleaved, so the flags are taken over here before Megatron validates them: the layer counts go
to ``args.zero_bubble_layers_per_stage`` (the placement's layer table builds them) and Megatron's
own layout flags are cleared. After Megatron validated (a patched script), a V or BitPipe layout
cannot be taken over any more and is refused in one line.

This module imports neither torch nor megatron.
"""
from __future__ import annotations

from typing import List, Optional

from ...core.ir import Placement, ScheduleError
from ...core.costs.layout import Layout, from_megatron_flags, parse
from ..errors import ZeroBubbleArgumentError

__all__ = ["LAYOUT_FLAGS", "given_layout_flags", "layout_from_args", "apply_layout", "layers_per_stage",
           "chunk_cost_kwargs"]

LAYOUT_FLAGS = (("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
                ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
                ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
                ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
                ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"))


def _given(args, dest) -> bool:
    v = getattr(args, dest, None)
    return v is not None and v is not False


def given_layout_flags(args) -> List[str]:
    return [flag for dest, flag in LAYOUT_FLAGS if _given(args, dest)]


def layout_from_args(args, placement: Placement) -> Optional[Layout]:
    """The layout the flags describe for ``placement`` (None: no layout flag, an even split)."""
    err = ZeroBubbleArgumentError
    num_layers = getattr(args, "num_layers", None)
    mtp = int(getattr(args, "mtp_num_layers", None) or 0)
    text = getattr(args, "pipeline_model_parallel_layout", None)
    p = placement.num_ranks
    S = placement.num_logical_stages
    try:
        if text is not None:
            if not isinstance(text, str):  # Megatron's parsed object (after its validation)
                text = getattr(text, "input_data", text)
                text = text if isinstance(text, str) else None
            others = [f for f in given_layout_flags(args) if f != "--pipeline-model-parallel-layout"]
            if others:
                raise err(f"--pipeline-model-parallel-layout cannot be combined with {others[0]} (Megatron refuses it "
                          "too): the layout says where every layer goes")
            if text is None:
                raise err("--pipeline-model-parallel-layout: give it as a string, e.g. 'E|(tt|)*3,m|L'")
            layout = parse(text)
            layout.check(num_layers=num_layers, mtp_layers=mtp)
            if layout.num_stages != S:
                raise err(f"--pipeline-model-parallel-layout {layout} has {layout.num_stages} stages; schedule "
                          f"{getattr(args, 'zero_bubble_resolved_schedule', None) or '(the one given)'} runs {S} model "
                          f"chunks ({p} pipeline ranks x {S // p}), in pipeline order"
                          + (": ranks 0..P-1, then P-1..0 for a V" if placement.style in ("v", "bitpipe") else ""))
        elif any(_given(args, d) for d, _ in LAYOUT_FLAGS[1:]) or \
                (getattr(args, "allow_padding_num_layers", False) and num_layers is not None and num_layers % S):
            layout = from_megatron_flags(
                int(num_layers), p, S // p, _logical_rank(placement),
                first=getattr(args, "decoder_first_pipeline_num_layers", None),
                last=getattr(args, "decoder_last_pipeline_num_layers", None),
                account_for_embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
                account_for_loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
                pad_ends=bool(getattr(args, "allow_padding_num_layers", False))
                and getattr(args, "decoder_first_pipeline_num_layers", None) is None,
                mtp_layers=mtp)
        else:
            return None
    except ScheduleError as e:
        raise err(str(e)) from None
    if mtp and layout.mtp_layers()[-1] != mtp:
        raise err(f"layout {layout}: megatron-zb runs the MTP layers (m) in the loss's model chunk, the last stage; "
                  "put them there")
    middle = [s for s, n in enumerate(layout.layers()) if n == 0 and 0 < s < S - 1]
    if middle:
        raise err(f"layout {layout}: model chunk {middle[0]} holds no layer; only the first (embedding) and the "
                  "last (loss) may hold none")
    return layout


def _logical_rank(placement: Placement):
    """Rank of each logical stage along the placement's first path (its layout order)."""
    path = placement.path(0)
    return lambda s: placement.rank_of(path[s])


def apply_layout(args, layout: Optional[Layout], placement: Placement, before_megatron_validation: bool) -> None:
    """Record the layer counts for the layer table; take Megatron's layout flags over where its own
    reading would differ (V, BitPipe)."""
    args.zero_bubble_layers_per_stage = None if layout is None else layout.layers()
    args.zero_bubble_layout = None if layout is None else str(layout)
    if layout is None or placement.style not in ("v", "bitpipe"):
        return
    if not before_megatron_validation:
        raise ZeroBubbleArgumentError(
            f"{given_layout_flags(args)[0] if given_layout_flags(args) else '--allow-padding-num-layers'} with a "
            f"{placement.style} placement: Megatron has read the layout as interleaved here; run your script through "
            "`python -m megatron_zb.run` (or apply patches/megatron-lm-<line>), which lays the V out itself")
    for dest, _ in LAYOUT_FLAGS:
        setattr(args, dest, False if dest.startswith("account_for") else None)


def layers_per_stage(args) -> Optional[List[int]]:
    """The layer counts megatron-zb builds (None: the even split)."""
    counts = getattr(args, "zero_bubble_layers_per_stage", None)
    return list(counts) if counts else None


def chunk_cost_kwargs(spec, layout: Optional[Layout], placement: Placement) -> dict:
    """``install()``'s cost options per model chunk for a laid-out model (``spec``: plan's model of
    it, ``core.costs.model.ModelSpec``; ``layout`` None: the even split): each chunk's F/B/W in units of the
    busiest rank's F, its activation in units of the fullest rank's (so a memory limit in microbatches
    keeps meaning "this many microbatches of the fullest rank's activation"), and that unit in bytes
    (``core.costs.chunk_costs.unit_costs``: what plan builds its rows with)."""
    from ...core.costs.chunk_costs import unit_costs
    try:
        uc = unit_costs(spec, layout, placement)
    except ScheduleError as e:
        raise ZeroBubbleArgumentError(str(e)) from None
    return {"cost_f": uc.cost_f, "cost_b": uc.cost_b, "cost_w": uc.cost_w, "mem_f": uc.mem_f, "mem_w": uc.mem_w,
            "unit_bytes": uc.unit_bytes, **({"cost_bw": uc.cost_bw} if uc.cost_bw is not None else {})}
