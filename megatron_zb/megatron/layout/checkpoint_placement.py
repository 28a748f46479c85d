"""Checkpoints know their placement: which global layers each pipeline rank and chunk holds.

Plain Megatron never needs this: its layer placement is fixed by the pipeline and virtual
pipeline sizes. megatron-zb's V placement (rank r holds stages r and 2P-1-r) can differ from a
1F1B or interleaved run with the same sizes, and Megatron's per-rank ``torch`` format stores each
rank's layers under *local* names (``decoder.layers.0`` = the rank's first layer), so a zb-v
checkpoint loaded into a 1F1B run would silently train on misplaced layers.

* **Saving** (``install``): every checkpoint the entry point writes carries, under the key
  ``megatron_zb``, the schedule, the placement (for each stage: its rank, its chunk on that rank
  and its global layers) and megatron-zb's version (``record``). In ``torch_dist`` it sits in the
  common state; in ``torch`` in every rank's file.
* **Loading**: the record (or, for a checkpoint without one, the placement Megatron's saved
  arguments imply) is compared with this run's. Equal: load. Different and the format maps
  layers by global names (``torch_dist``): load, and say so in one line. Different and the
  format is per-rank (``torch``, ``torch_dcp``, local non-persistent checkpoints): refuse with
  ``CheckpointPlacementError``, naming both placements and the ways out (``torch_dist``, or
  ``python -m megatron_zb.megatron.convert_checkpoint``).

Torch-free helpers (``record``, ``describe``, ``same_placement``, ``record_from_args``) are used
by the conversion command too.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence

from ...core.ir import Placement

__all__ = ["KEY", "CheckpointPlacementError", "record", "record_from_args", "describe", "same_placement",
           "check", "install", "version", "vocab_of_args"]

KEY = "megatron_zb"
MAPS_BY_GLOBAL_NAMES = ("torch_dist",)


class CheckpointPlacementError(RuntimeError):
    """A checkpoint saved with another layer placement, in a format that cannot map it."""


def version() -> str:
    try:
        from importlib.metadata import version as v
        return v("megatron-zb")
    except Exception:  # noqa: BLE001 - a source checkout without an installed distribution
        return "0.1.0"


def record(placement: Placement, num_layers: int, schedule: Optional[str], vocab_parallel: Optional[dict] = None,
           **layer_kw) -> dict:
    """The placement record stored in checkpoints (plain data: ints, strings, lists);
    ``vocab_parallel``: ``{"barriers": 1|2, "tied": bool}`` under ``--enable-vocab-parallel``."""
    from . import placement as P
    infos = [i for r in range(placement.num_ranks) for i in P.chunk_infos(placement, num_layers, r, **layer_kw)]
    infos.sort(key=lambda i: i.stage)
    return {"schedule": schedule or "megatron", "style": placement.style, "pipeline_size": placement.num_ranks,
            "chunks": placement.models_per_rank, "num_layers": int(num_layers),
            "stages": [[i.rank, i.vp_stage, list(i.layers)] for i in infos],
            "embedding": [[i.rank, i.vp_stage] for i in infos if i.pre_process],
            "loss": [[i.rank, i.vp_stage] for i in infos if i.post_process], "version": version(),
            "vocab_parallel": vocab_parallel}


def vocab_of_args(args) -> Optional[dict]:
    """``record``'s ``vocab_parallel`` for a run's (or a checkpoint's saved) Megatron arguments."""
    if not (getattr(args, "enable_vocab_parallel", False) and getattr(args, "zero_bubble_resolved_schedule", None)):
        return None
    return {"barriers": 2 if getattr(args, "disable_backward_fusion", False) else 1,
            "tied": not bool(getattr(args, "untie_embeddings_and_output_weights", False))}


def record_from_args(args) -> Optional[dict]:
    """The placement a checkpoint's saved Megatron arguments imply (checkpoints without a record:
    plain Megatron, or megatron-zb before records). None if the arguments do not say enough."""
    from . import placement as P
    p = getattr(args, "pipeline_model_parallel_size", None)
    L = getattr(args, "num_layers", None)
    if not p or not L:
        return None
    style = getattr(args, "zero_bubble_placement", None)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if style not in ("single", "looped", "v", "bitpipe"):
        style = "looped" if vpp > 1 else "single"
    try:
        placement = P.make_placement(style, int(p), int(vpp) if style == "looped" else None)
        counts = getattr(args, "zero_bubble_layers_per_stage", None)
        layer_kw = ({"layers_per_stage": list(counts)} if counts else
                    {"allow_padding_num_layers": bool(getattr(args, "allow_padding_num_layers", False))})
        return record(placement, int(L), getattr(args, "zero_bubble_resolved_schedule", None),
                      vocab_parallel=vocab_of_args(args), **layer_kw)
    except Exception:  # noqa: BLE001 - a layout we cannot reconstruct (e.g. uneven first/last stages)
        return None


def same_placement(a: dict, b: dict) -> bool:
    return a.get("stages") == b.get("stages")


def _span(layers: Sequence[int]) -> str:
    if not layers:
        return "-"
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def describe(rec: dict, max_ranks: int = 4) -> str:
    """'zb-v, v placement, PP=4 (rank 0: layers 0-1 + 14-15, rank 1: ...)'."""
    per_rank: Dict[int, List[str]] = {}
    for rank, chunk, layers in rec["stages"]:
        per_rank.setdefault(rank, []).append((chunk, _span(layers)))
    parts = []
    for r in sorted(per_rank)[:max_ranks]:
        parts.append(f"rank {r}: layers " + " + ".join(s for _, s in sorted(per_rank[r])))
    if len(per_rank) > max_ranks:
        parts.append("...")
    return (f"{rec.get('schedule', '?')}, {rec['style']} placement, PP={rec['pipeline_size']}"
            f" ({', '.join(parts)})")


def check(saved: Optional[dict], current: dict, ckpt_format: str, where: str = "the checkpoint") -> Optional[str]:
    """Compare a checkpoint's placement with this run's.

    Returns None (same placement, or nothing known about the checkpoint's), or a one-line note
    (different, but ``ckpt_format`` maps layers by global names); raises
    ``CheckpointPlacementError`` when the format is per-rank.
    """
    if saved is not None:
        _check_vocab(saved.get("vocab_parallel"), current.get("vocab_parallel"), ckpt_format, where)
    if saved is None or same_placement(saved, current):
        return None
    if ckpt_format in MAPS_BY_GLOBAL_NAMES:
        return (f"megatron-zb: {where} was saved with {describe(saved)}; this run uses {describe(current)}; "
                f"the {ckpt_format} format maps layers by their global names, so it loads into this placement")
    if saved.get("pipeline_size") != current.get("pipeline_size"):
        convert = "re-save it in torch_dist format with the saving run's pipeline size"
    else:
        convert = (f"or convert it: python -m megatron_zb.megatron.convert_checkpoint --load <dir> --save <new dir> "
                   f"--to-schedule {current.get('schedule')}"
                   + (f" --chunks {current['chunks']}" if current.get("style") == "looped" else "")
                   + " (model weights; then load with --no-load-optim)")
    raise CheckpointPlacementError(
        f"{where} was saved with {describe(saved)}, but this run uses {describe(current)}; its '{ckpt_format}' "
        f"format stores each rank's layers under local names, so loading it would put layers in the wrong place. "
        f"Save with --ckpt-format torch_dist (it maps layers by global names), {convert}")


def _check_vocab(saved: Optional[dict], current: Optional[dict], ckpt_format: str, where: str) -> None:
    """Vocabulary parallelism on one side only: torch_dist maps the shards to the output layer's rows
    (``megatron.features.vocab_parallel.VocabShard``), except where the saving run had tied embeddings without it
    (no output layer saved) and this run holds shards; a per-rank format maps nothing."""
    if bool(saved) == bool(current):
        return
    flag = "--enable-vocab-parallel"
    if ckpt_format not in MAPS_BY_GLOBAL_NAMES:
        raise CheckpointPlacementError(
            f"{where} was saved {'with' if saved else 'without'} {flag} in the per-rank '{ckpt_format}' format, which "
            f"cannot map the output layer to this run ({'without' if saved else 'with'} it): resume "
            f"{'with' if saved else 'without'} {flag}, or save with --ckpt-format torch_dist")
    if current and current.get("tied"):
        raise CheckpointPlacementError(
            f"{where} was saved without {flag} and with tied embeddings, so it holds no output layer to shard: "
            f"resume it without {flag} (or with --untie-embeddings-and-output-weights from a checkpoint that has one)")


# --------------------------------------------------------------------------------------------
# hooks into megatron.training.checkpointing
# --------------------------------------------------------------------------------------------

def _format_of(ckpt_type) -> str:
    name = getattr(ckpt_type, "name", str(ckpt_type))
    return {"GLOBAL": "torch_dist", "LEGACY": "torch", "TORCH_DCP": "torch_dcp", "FSDP_DTENSOR": "fsdp_dtensor",
            "LOCAL": "local (non-persistent)"}.get(name, name.lower())


def _rank0() -> bool:
    try:
        import torch.distributed as dist
        return not dist.is_initialized() or dist.get_rank() == 0
    except Exception:  # noqa: BLE001
        return os.environ.get("RANK", "0") == "0"


def install(current: dict, note: Optional[Callable[[str], None]] = None) -> Callable[[], None]:
    """Record ``current`` in every checkpoint Megatron's training saves, and check each loaded one.

    ``note(line)`` prints the one-line notice of a mapped placement (default: print on rank 0).
    Returns a function that undoes the hooks.
    """
    import megatron.training.checkpointing as C

    gen, base = C.generate_state_dict, C._load_base_checkpoint
    noted = set()

    def generate_state_dict(*args, **kwargs):
        sd = gen(*args, **kwargs)
        sd[KEY] = dict(current)
        return sd

    def _load_base_checkpoint(*args, **kwargs):
        out = base(*args, **kwargs)
        state_dict, name, _release, ckpt_type = out
        if state_dict is not None and ckpt_type is not None:
            saved = state_dict.get(KEY) if isinstance(state_dict, dict) else None
            if saved is None and isinstance(state_dict, dict) and state_dict.get("args") is not None:
                saved = record_from_args(state_dict["args"])
            path = os.path.dirname(os.path.dirname(name)) if str(name).endswith(".pt") else str(name)
            where = f"checkpoint {path}"
            line = check(saved, current, _format_of(ckpt_type), where=where)
            if line and where not in noted:
                noted.add(where)
                if note is not None:
                    note(line)
                elif _rank0():
                    print(line, flush=True)
        return out

    C.generate_state_dict = generate_state_dict
    C._load_base_checkpoint = _load_base_checkpoint

    def undo():
        if C.generate_state_dict is generate_state_dict:
            C.generate_state_dict = gen
        if C._load_base_checkpoint is _load_base_checkpoint:
            C._load_base_checkpoint = base
    return undo
