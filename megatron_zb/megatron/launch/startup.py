"""What every megatron-zb entry point does before Megatron trains: make megatron importable and fit
for this machine (the CPU shims without CUDA), parse Megatron's + megatron-zb's flags, validate
ours (``megatron.launch.flags``) and then Megatron's, and read the placement the flags select. Used by the
entry point (``megatron.pretrain_gpt``), the preflight check (``megatron.preflight``) and the
launcher for users' own scripts."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence

from .args import add_zero_bubble_args, chain_providers, has_flag
from ..features.flags.attention import check_attention_args
from ..features.flags.balance import after_megatron_validation
from ..errors import ZeroBubbleArgumentError
from .flags import validate_zero_bubble_args

__all__ = ["MegatronTrainingMissing", "add_entry_args", "cuda", "prepare_megatron", "machine_adjustments",
           "prepare_args", "check_sizes", "check_load", "microbatches", "megatron_check_message", "placement_of", "layer_kw"]


class MegatronTrainingMissing(RuntimeError):
    """The installed megatron-core has no ``megatron.training`` with the 0.18+ ``pretrain()``."""


def add_entry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--zero-bubble-deterministic-init`` (once per parser)."""
    if has_flag(parser, "--zero-bubble-deterministic-init"):
        return parser
    g = parser.add_argument_group("megatron-zb entry point")
    g.add_argument("--zero-bubble-start-fresh", action="store_true", default=False,
                   help="Train from new weights when --load holds no checkpoint (without it such a --load is "
                        "refused: Megatron would silently start from random weights, Megatron's "
                        "--exit-on-missing-checkpoint made the default).")
    g.add_argument("--zero-bubble-deterministic-init", action="store_true", default=False,
                   help="Initialise every parameter from a seed derived from its name in the whole model "
                        "(normal(0, --init-method-std) for matrices), independent of the pipeline placement: "
                        "1F1B, ZB-H1 and a V schedule then start from identical weights (for comparing "
                        "schedules; use dropout 0 for identical loss curves).")
    return parser



def cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def prepare_megatron() -> None:
    """CPU shims (no CUDA) and the dataset-helper fallback; then check megatron.training is usable."""
    from ..cpu import cpu_shims
    cpu_shims.python_compat()
    if not cuda():
        cpu_shims.apply()
    try:
        import megatron.training.training as T  # noqa: F401
        from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: F401
    except ImportError as e:
        try:
            from megatron.core import package_info
            ver = package_info.__version__
        except Exception:  # pragma: no cover
            ver = "unknown"
        raise MegatronTrainingMissing(
            f"megatron-zb's pretrain_gpt needs megatron.training with the config-container pretrain() "
            f"(megatron-core >= 0.18; tested with 0.19.2); this megatron-core is {ver} ({e}). With an older "
            "megatron-core use your Megatron-LM checkout's pretrain_gpt.py with patches/megatron-lm-pretrain_gpt.patch, "
            "or call megatron_zb.megatron.install.install() yourself.") from None
    cpu_shims.dataset_helpers()
    if not cuda():
        cpu_shims.apply_training()


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except Exception:
        return False


def machine_adjustments(args) -> List[str]:
    """Adjust Megatron arguments that cannot work on this machine; returns what was changed."""
    changed = []
    if getattr(args, "transformer_impl", None) == "transformer_engine" and not have_transformer_engine():
        args.transformer_impl = "local"
        changed.append("--transformer-impl local (Transformer Engine is not installed)")
    if not cuda():
        if args.distributed_backend != "gloo":
            args.distributed_backend = "gloo"
            changed.append("--distributed-backend gloo")
        if not args.use_cpu_initialization:
            args.use_cpu_initialization = True
            changed.append("--use-cpu-initialization")
        for dest, flag in (("masked_softmax_fusion", "--no-masked-softmax-fusion"),
                           ("bias_gelu_fusion", "--no-bias-gelu-fusion"),
                           ("bias_swiglu_fusion", "--no-bias-swiglu-fusion"),
                           ("bias_dropout_fusion", "--no-bias-dropout-fusion"),
                           ("apply_rope_fusion", "--no-rope-fusion"),
                           ("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion")):
            if getattr(args, dest, False):
                setattr(args, dest, False)
                changed.append(flag)
        if not getattr(args, "no_persist_layer_norm", True):
            args.no_persist_layer_norm = True
            changed.append("--no-persist-layer-norm")
        for dest, flag in (("fp16", "--fp16"), ("bf16", "--bf16")):
            if getattr(args, dest, False):
                setattr(args, dest, False)
                changed.append(f"{flag} dropped (fp32 on CPU)")
        if getattr(args, "overlap_moe_expert_parallel_comm", False):
            # Megatron's config takes it with bf16/fp16 only; megatron-zb's runtime runs it (ep_overlap)
            args.overlap_moe_expert_parallel_comm = False
            changed.append("--overlap-moe-expert-parallel-comm run by megatron-zb alone (Megatron's config check "
                           "wants bf16/fp16; fp32 on CPU, streams are no-ops)")
    return changed


def prepare_args(extra_args_provider: Optional[Callable] = None, args_defaults: Optional[dict] = None,
                 argv: Optional[Sequence[str]] = None, set_globals: bool = True):
    """Parse Megatron's + megatron-zb's flags, validate ours, then Megatron's; set Megatron's globals.

    Returns ``(args, install_kwargs, notes)``; ``install_kwargs`` is None without zero-bubble flags.
    A bad flag or a failed Megatron argument check raises ``ZeroBubbleArgumentError`` (one line).
    """
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    defaults.update(args_defaults or {})
    provider = chain_providers(extra_args_provider, add_zero_bubble_args, add_entry_args)
    saved, error = sys.argv, argparse.ArgumentParser.error
    if argv is not None:
        sys.argv = [saved[0] if saved else "pretrain_gpt"] + list(argv)

    def one_line(parser, message):  # not the usage (hundreds of lines) and exit 2 on every rank
        raise ZeroBubbleArgumentError(message)
    argparse.ArgumentParser.error = one_line
    try:
        args = parse_args(extra_args_provider=provider)
    finally:
        sys.argv = saved
        argparse.ArgumentParser.error = error
    if getattr(args, "yaml_cfg", None) is not None:
        raise ZeroBubbleArgumentError("--yaml-cfg is not supported by megatron-zb's pretrain_gpt; give the flags")
    if args.use_checkpoint_args or defaults.get("use_checkpoint_args", False):
        from megatron.training.checkpointing import load_args_from_checkpoint
        load_args_from_checkpoint(args)
    zb = validate_zero_bubble_args(args, before_megatron_validation=True)
    notes = machine_adjustments(args)
    check_attention_args(args)  # without TE, --attention-backend flash/fused: what torch's SDPA does not do
    if getattr(args, "zero_bubble_set_per_token_loss", False):
        notes.append("--calculate-per-token-loss (--zero-bubble-balance-microbatches normalises the loss over the "
                     "global token count)")
    data_flags = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
                  "per_split_data_args_path")
    if not any(getattr(args, f, None) for f in data_flags) and not getattr(args, "mock_data", False):
        args.mock_data = True
        notes.append("--mock-data (no --data-path given)")
    check_sizes(args)
    check_load(args)
    try:
        validate_args(args, defaults)
    except (AssertionError, ValueError, TypeError) as e:  # Megatron's own argument checks
        raise ZeroBubbleArgumentError(megatron_check_message(e)) from None
    after_megatron_validation(args)  # variable-length batches: Megatron's variable_seq_lengths
    if set_globals:
        set_global_variables(args)
    return args, zb, notes


def check_load(args) -> Optional[str]:
    """``--load`` must hold a checkpoint (or ``--zero-bubble-start-fresh`` says to start from new
    weights). Returns a note when the tracker resumes from an older iteration than a newer save
    that was stopped part-way (its folder exists, the tracker does not name it)."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "non_persistent_ckpt_type", None):
        return None
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        if getattr(args, "zero_bubble_start_fresh", False):
            return None
        why = "no such directory" if not os.path.isdir(load) else "no checkpoint in it (no latest_checkpointed_iteration.txt)"
        raise ZeroBubbleArgumentError(
            f"--load {load}: {why}; Megatron would train from random weights (and --save into it would overwrite "
            "what is there): give a checkpoint directory, or add --zero-bubble-start-fresh to start from scratch")
    try:
        with open(tracker) as f:
            text = f.read().strip()
    except OSError as e:
        raise ZeroBubbleArgumentError(f"--load {load}: cannot read {tracker} ({e.strerror})") from None
    if not text.isdigit():
        return None  # 'release'
    saved = sorted(int(d[5:]) for d in os.listdir(load) if d.startswith("iter_") and d[5:].isdigit())
    newer = [i for i in saved if i > int(text)]
    if newer:
        return (f"megatron-zb: resuming from iteration {int(text)} (the checkpoint tracker's); iter_{newer[-1]:07d} "
                "was not finished (a save stopped part-way) and is ignored")
    return None


def check_sizes(args) -> None:
    """World size vs model parallelism, and batch divisibility: the checks Megatron makes with an
    assertion deep inside (or with a message about the *evaluation* batch size), said plainly."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = int(args.tensor_model_parallel_size or 1)
    pp = int(args.pipeline_model_parallel_size or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    model = tp * pp * cp
    if world % model:
        raise ZeroBubbleArgumentError(
            f"world size {world} (processes in the job) is not a multiple of tensor x pipeline x context parallel "
            f"size = {tp} x {pp} x {cp} = {model}")
    microbatches(args, world // model)


def microbatches(args, data_parallel_size: Optional[int] = None) -> int:
    """Microbatches per iteration (global batch / (micro batch x data-parallel size)); 0 where the
    batch size ramps up or is not given. A global batch that does not divide is an error."""
    dp = int(data_parallel_size or args.data_parallel_size)
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if not (mbs and gbs) or getattr(args, "rampup_batch_size", None):
        return 0
    if int(gbs) % (int(mbs) * dp):
        raise ZeroBubbleArgumentError(
            f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x data-parallel size {dp} "
            f"= {int(mbs) * dp}")
    return int(gbs) // (int(mbs) * dp)


def megatron_check_message(e: BaseException) -> str:
    """One line for a failed Megatron argument check (its message, or the failing assert's source)."""
    import traceback
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if not text:
        frames = traceback.extract_tb(e.__traceback__)
        text = f"assert {frames[-1].line}" if frames and frames[-1].line else type(e).__name__
    return f"Megatron's argument check failed: {text}"


def placement_of(args):
    """The placement the (validated) flags select; before Megatron's own validation the virtual
    pipeline size is read from the flags that set it."""
    from ...core.ir import Placement
    p = args.pipeline_model_parallel_size
    style = getattr(args, "zero_bubble_placement", None)
    if style == "v":
        return Placement.vshape(p)
    if style == "bitpipe":
        return Placement.bitpipe(p)
    v = getattr(args, "virtual_pipeline_model_parallel_size", None) or \
        getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if not v and per_stage and getattr(args, "num_layers", None):
        v = int(args.num_layers) // int(p) // int(per_stage)
    if v and v > 1:
        return Placement.looped(p, int(v))
    return Placement.single(p)


def layer_kw(args) -> dict:
    """How the placement splits the layers: the layout's counts (Megatron's layout flags, read by
    ``megatron.layout.layout_args``) or an even split (with the fork's padding)."""
    from ..layout.layout_args import layers_per_stage
    counts = layers_per_stage(args)
    if counts is not None:
        return {"layers_per_stage": counts}
    return {"allow_padding_num_layers": bool(getattr(args, "allow_padding_num_layers", False))}
