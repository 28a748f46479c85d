"""Rewrite a per-rank (``--ckpt-format torch``) checkpoint for another layer placement.

    python -m megatron_zb.megatron.convert_checkpoint --load CKPT --save NEW --to-schedule 1f1b
    python -m megatron_zb.megatron.convert_checkpoint --load CKPT --save NEW --to-schedule interleaved-1f1b --chunks 2

Megatron's ``torch`` format stores each pipeline rank's layers under local names, so a checkpoint
saved by a V schedule (rank r: stages r and 2P-1-r) cannot be loaded by a 1F1B or interleaved run
(``checkpoint_placement`` refuses it). This command reads every rank's file, gives each layer its
global number (from the placement recorded in the checkpoint, or the one its saved arguments imply),
and writes one file per rank of the target placement with the layers that rank holds there. The
pipeline and tensor-parallel sizes stay the same.

Converted: the model weights (embedding, layers, final norm, output layer), the iteration, the
learning-rate scheduler and RNG states. **Not** converted: the optimizer state (its entries are
indexed by each rank's parameter order): load the result with ``--no-load-optim`` (a fresh
optimizer, as after ``--finetune`` but keeping the iteration). ``--ckpt-format torch_dist``
checkpoints need no conversion: they map layers by global names.

Exit codes: 0 written, 2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from .layout import checkpoint_placement as CP

__all__ = ["convert", "main"]

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


class ConvertError(ValueError):
    """Bad input for the conversion; the message says what and why."""


def _iteration_dir(load: str, iteration: Optional[int]) -> Tuple[str, str]:
    if iteration is None:
        tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
        if not os.path.isfile(tracker):
            raise ConvertError(f"--load {load}: no latest_checkpointed_iteration.txt (not a Megatron checkpoint "
                               "directory?); give --iteration N")
        text = open(tracker).read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
    else:
        name = f"iter_{int(iteration):07d}"
    path = os.path.join(load, name)
    if not os.path.isdir(path):
        raise ConvertError(f"--load {load}: no {name} directory")
    return path, name


def _rank_files(path: str) -> Dict[Tuple[int, int], str]:
    """{(tp, pp): file} of a torch-format iteration directory."""
    out = {}
    for d in sorted(os.listdir(path)):
        m = _RANK_DIR.match(d)
        f = os.path.join(path, d, "model_optim_rng.pt")
        if not m or not os.path.isfile(f):
            continue
        if m.group(3) is not None:
            raise ConvertError(f"{path}/{d}: expert-parallel checkpoints are not supported by the conversion")
        out[(int(m.group(1)), int(m.group(2) or 0))] = f
    if not out:
        if os.path.isfile(os.path.join(path, "common.pt")) or os.path.isfile(os.path.join(path, ".metadata")):
            raise ConvertError(f"{path} is a torch_dist checkpoint: it maps layers by global names and loads into any "
                               "placement as it is; nothing to convert")
        raise ConvertError(f"{path}: no mp_rank_*/model_optim_rng.pt files (not a --ckpt-format torch checkpoint)")
    return out


def _load(f: str):
    import torch
    return torch.load(f, map_location="cpu", weights_only=False)


def _model_key(n_chunks: int, chunk: int) -> str:
    return "model" if n_chunks == 1 else f"model{chunk}"


def _target_record(source: dict, schedule: str, chunks: Optional[int], allow_padding: bool,
                   layout: Optional[str] = None) -> dict:
    from ..core import schedules
    from ..core.ir import ScheduleError
    from .layout.placement import make_placement
    try:
        style = schedules.get(schedule).placement
    except ScheduleError as e:
        raise ConvertError(str(e)) from None
    if style == "looped" and not chunks:
        raise ConvertError(f"--to-schedule {schedule} runs several chunks per rank: give --chunks V (Megatron's "
                           "virtual pipeline size of the run that will load it)")
    try:
        placement = make_placement(style, source["pipeline_size"], chunks if style == "looped" else None)
        if layout is not None:  # the loading run's --pipeline-model-parallel-layout, in pipeline order
            from ..core.costs.layout import parse
            lay = parse(layout).check(num_layers=source["num_layers"], num_stages=placement.num_logical_stages,
                                      flag="--to-layout")
            return CP.record(placement, source["num_layers"], schedule, layers_per_stage=lay.layers())
        return CP.record(placement, source["num_layers"], schedule, allow_padding_num_layers=allow_padding)
    except ScheduleError as e:
        raise ConvertError(f"--to-schedule {schedule}: {e}") from None


def convert(load: str, save: str, schedule: str, chunks: Optional[int] = None,
            iteration: Optional[int] = None, layout: Optional[str] = None) -> str:
    """Write the converted checkpoint; returns a one-line summary. Raises ``ConvertError``."""
    src_dir, it_name = _iteration_dir(load, iteration)
    files = _rank_files(src_dir)
    if os.path.exists(save) and os.listdir(save):
        raise ConvertError(f"--save {save} exists and is not empty")
    tps = sorted({tp for tp, _ in files})
    pps = sorted({pp for _, pp in files})
    states = {k: _load(f) for k, f in files.items()}
    first = states[(tps[0], pps[0])]
    source = first.get(CP.KEY) or CP.record_from_args(first.get("args"))
    if source is None:
        raise ConvertError(f"{src_dir}: the checkpoint records no placement and its arguments do not give one")
    if pps != list(range(source["pipeline_size"])):
        raise ConvertError(f"{src_dir}: rank directories for pipeline ranks {pps}, but the placement has "
                           f"{source['pipeline_size']} ranks")
    allow_padding = bool(getattr(first.get("args"), "allow_padding_num_layers", False))
    target = _target_record(source, schedule, chunks, allow_padding, layout)
    if CP.same_placement(source, target):
        raise ConvertError(f"the checkpoint already has the placement of {schedule} ({CP.describe(source)}); "
                           "load it as it is")

    def chunk_table(rec):  # (rank, chunk) -> (layers, pre, post)
        n = len(rec["stages"])
        emb = {tuple(x) for x in rec.get("embedding", [rec["stages"][0][:2]])}
        loss = {tuple(x) for x in rec.get("loss", [rec["stages"][n - 1][:2]])}
        return {(r, c): (layers, (r, c) in emb, (r, c) in loss) for r, c, layers in rec["stages"]}

    src_tab, dst_tab = chunk_table(source), chunk_table(target)
    src_chunks, dst_chunks = source["chunks"], target["chunks"]
    for tp in tps:
        pre, post = OrderedDict(), OrderedDict()
        layers: Dict[int, "OrderedDict[str, object]"] = {}
        for (r, c), (lay, is_pre, is_post) in sorted(src_tab.items()):
            sd = states[(tp, r)][_model_key(src_chunks, c)]
            for key, value in sd.items():
                m = _LAYER.match(key)
                if m:
                    local = int(m.group(1))
                    if local >= len(lay):
                        raise ConvertError(f"pipeline rank {r} chunk {c}: {key} but the placement gives it "
                                           f"{len(lay)} layer(s)")
                    layers.setdefault(lay[local], OrderedDict())[m.group(2)] = value
                elif is_pre and (key.startswith("embedding.") or not is_post):
                    pre[key] = value
                elif is_post:
                    post[key] = value
                else:
                    raise ConvertError(f"pipeline rank {r} chunk {c}: cannot place {key} (neither a layer nor the "
                                       "embedding / output stage)")
        for (r, c), (lay, is_pre, is_post) in dst_tab.items():
            out = OrderedDict()
            if is_pre:
                out.update(pre)
            for local, g in enumerate(lay):
                for rest, value in layers[g].items():
                    out[f"decoder.layers.{local}.{rest}"] = value
            if is_post:
                out.update(post)
            state = states[(tp, r)]
            state.setdefault("_new", {})[_model_key(dst_chunks, c)] = out
    for (tp, pp), state in states.items():
        new = {k: v for k, v in state.items() if not (k == "model" or re.fullmatch(r"model\d+", k) or k == "_new"
                                                      or k == "optimizer")}
        new.update(state["_new"])
        new[CP.KEY] = dict(target, converted_from=source)
        args = new.get("args")
        if args is not None:
            args.virtual_pipeline_model_parallel_size = dst_chunks if dst_chunks > 1 else None
            if hasattr(args, "num_virtual_stages_per_pipeline_rank"):
                args.num_virtual_stages_per_pipeline_rank = dst_chunks if dst_chunks > 1 else None
            args.zero_bubble_placement = target["style"]
            args.zero_bubble_resolved_schedule = schedule
            args.no_save_optim = True
        rel = os.path.relpath(files[(tp, pp)], src_dir)
        dst = os.path.join(save, it_name, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        import torch
        torch.save(new, dst)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if it_name == "release" else str(int(it_name[len("iter_"):])))
    return (f"converted {src_dir}: {CP.describe(source)} -> {CP.describe(target)}; {len(states)} rank file(s) "
            f"written to {save}. Load it with --no-load-optim (the optimizer state is not converted)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.megatron.convert_checkpoint",
                                 description="Rewrite a --ckpt-format torch checkpoint for another schedule's layer "
                                             "placement (model weights; the optimizer state is dropped).")
    ap.add_argument("--load", required=True, help="the checkpoint directory (holding latest_checkpointed_iteration.txt)")
    ap.add_argument("--save", required=True, help="a new directory for the converted checkpoint")
    ap.add_argument("--to-schedule", required=True, metavar="NAME", help="the schedule of the run that will load it")
    ap.add_argument("--chunks", type=int, default=None, help="chunks per rank for looped schedules (interleaved-1f1b)")
    ap.add_argument("--iteration", type=int, default=None, help="default: the latest")
    ap.add_argument("--to-layout", default=None, metavar="LAYOUT",
                    help="the loading run's --pipeline-model-parallel-layout (pipeline order; default: an even split)")
    a = ap.parse_args(argv)
    try:
        from .cpu import cpu_shims
        cpu_shims.python_compat()
        if not cpu_shims.cuda_available():
            cpu_shims.apply()  # unpickling the saved arguments imports megatron
        print(convert(a.load, a.save, a.to_schedule, a.chunks, a.iteration, a.to_layout), flush=True)
    except ConvertError as e:
        print(f"megatron-zb convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
