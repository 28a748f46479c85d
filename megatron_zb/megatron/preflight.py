"""Check a training command line in one process before torchrun starts the ranks.

    python -m megatron_zb.megatron.preflight --world-size 8 -- <the entry point's flags>

``scripts/pretrain_gpt_zb.sh`` runs it before torchrun, so a bad input is one line on stderr and
exit code 2 in a few seconds, not N tracebacks after the ranks started. Checked, in this order:

* the flags parse (Megatron's parser + megatron-zb's; no usage dump) and megatron-zb's combination
  rules hold (``validate_zero_bubble_args``);
* Megatron's own argument validation (``validate_args``) with this world size, e.g. the world size
  against TP x PP x CP, layers against pipeline stages;
* the global batch size is a multiple of micro batch size x data-parallel size;
* attention heads (and query groups) divide by the tensor-parallel size, and Megatron's
  TransformerConfig accepts the model (what the ranks build first);
* the data: every ``--data-path`` / per-split prefix has its ``.bin`` and ``.idx``, blend files exist;
* the tokenizer: its files exist and it can be built (GPT2BPETokenizer without --vocab-file
  would try to download one);
* the schedule can be generated with the run's microbatch count (e.g. a memory limit it cannot meet).

Exit codes: 0 fine, 2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings
from typing import List, Optional, Sequence

from .errors import ZeroBubbleArgumentError
from .execution.options import ScheduleOptions, preview
from .launch.startup import (MegatronTrainingMissing, megatron_check_message, microbatches, placement_of, prepare_args,
                      prepare_megatron)

__all__ = ["check", "main"]


class PreflightError(ZeroBubbleArgumentError):
    """A bad input found before the ranks start."""


def _prefixes(args) -> List[str]:
    from megatron.core.datasets.utils import get_blend_from_list
    out = []
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        blend = get_blend_from_list(getattr(args, dest, None))
        if blend is not None:
            out += [(dest, p) for p in blend[0]]
    return out


def _check_data(args) -> None:
    if getattr(args, "mock_data", False):
        return
    for dest in ("data_args_path", "per_split_data_args_path"):
        path = getattr(args, dest, None)
        if path and not os.path.isfile(path):
            raise PreflightError(f"--{dest.replace('_', '-')} {path}: no such file")
    for dest, prefix in _prefixes(args):
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise PreflightError(
                f"--{dest.replace('_', '-')}: dataset {prefix!r} has no {' and '.join(prefix + e for e in missing)} "
                "(give the prefix of a Megatron indexed dataset, without .bin/.idx; or no data path for mock data)")


def _check_tokenizer(args, build: bool = True) -> None:
    for dest in ("vocab_file", "merge_file"):
        path = getattr(args, dest, None)
        if path and not os.path.isfile(path):
            raise PreflightError(f"--{dest.replace('_', '-')} {path}: no such file")
    model = getattr(args, "tokenizer_model", None)
    kind = getattr(args, "tokenizer_type", None)
    if model and kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                          "TikTokenizer") and not os.path.exists(model):
        raise PreflightError(f"--tokenizer-model {model}: no such file (needed by --tokenizer-type {kind})")
    if kind == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise PreflightError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file (gpt2-vocab.json, "
                             "gpt2-merges.txt; VOCAB_FILE / MERGE_FILE in the launch script); without them Megatron "
                             "tries to download them, which needs the wget package and a network")
    if not build:
        return
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    try:
        build_tokenizer(args)
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer library raises
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PreflightError(f"the tokenizer (--tokenizer-type {kind}) cannot be built: {type(e).__name__}: {first}") \
            from None


def _check_model(args) -> None:
    tp = int(args.tensor_model_parallel_size)
    heads = int(args.num_attention_heads)
    if heads % tp:
        raise PreflightError(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}: "
                             "each tensor-parallel rank holds whole heads")
    groups = getattr(args, "num_query_groups", None)
    if getattr(args, "group_query_attention", False) and groups and int(groups) % tp:
        raise PreflightError(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
    from megatron.training.argument_utils import core_transformer_config_from_args
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            core_transformer_config_from_args(args)
    except (AssertionError, ValueError, TypeError) as e:
        raise PreflightError(megatron_check_message(e).replace("argument check", "model configuration check")) \
            from None


def check_in_rank(args) -> None:
    """The checks that need no extra work, on Megatron's validated ``args`` inside a rank (for a
    job started with torchrun directly): the model configuration, the data paths, the tokenizer's
    files. Raises ``PreflightError`` (reported once by the entry point)."""
    _check_model(args)
    _check_data(args)
    _check_tokenizer(args, build=False)


def check(argv: Sequence[str], world_size: int) -> Optional[str]:
    """Run the checks for ``argv`` on ``world_size`` ranks; returns a summary line, or raises
    ``ZeroBubbleArgumentError`` / ``MegatronTrainingMissing`` with the one-line reason."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size))
    prepare_megatron()
    args, zb, _notes = prepare_args(argv=list(argv), set_globals=False)
    m = microbatches(args)
    _check_model(args)
    _check_data(args)
    _check_tokenizer(args)
    if zb is not None and m:
        preview(ScheduleOptions(**zb), placement_of(args).num_ranks, m)
    return (f"{zb['schedule'] if zb else 'megatron'} schedule, world size {world_size}, "
            f"{m or '?'} microbatches per iteration")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.megatron.preflight",
                                 description="Check the training flags before the ranks start.")
    ap.add_argument("--world-size", type=int, required=True, help="NNODES x processes per node")
    ap.add_argument("--quiet", action="store_true")
    if "--" not in argv:
        print("preflight: usage: --world-size N -- <training flags>", file=sys.stderr)
        return 2
    cut = argv.index("--")
    opts = ap.parse_args(argv[:cut])
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            summary = check(argv[cut + 1:], opts.world_size)
    except (ZeroBubbleArgumentError, MegatronTrainingMissing) as e:
        print(f"megatron-zb: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - anything else Megatron raises on these flags is bad input too
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"megatron-zb: error: checking the flags failed: {type(e).__name__}: {first}", file=sys.stderr)
        return 2
    if not opts.quiet:
        print(f"megatron-zb: flags checked ({summary})", flush=True)
    return 0


if __name__ == "__main__":
    import gc
    gc.disable()  # a short check that ends before training: no cyclic collector passes over its imports
    sys.exit(main())
