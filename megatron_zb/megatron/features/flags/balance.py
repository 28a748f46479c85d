"""The training flags of variable-length batches: ``--zero-bubble-balance-microbatches`` (each
iteration's global batch balanced over the data-parallel replicas and microbatches, with its
per-microbatch schedule; ``megatron.features.balanced``), ``--zero-bubble-attention-share`` (the cost model's
attention term) and ``--zero-bubble-seq-lengths`` (alias ``--zero-bubble-mock-seq-lengths``:
Megatron's GPT samples, mock or from --data-path, cut to lengths drawn from a distribution or at
their first end-of-document token). Added to megatron-zb's flag group (``megatron.launch.args``), checked with the rest
(``megatron.launch.flags``). No torch import."""
from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from ....core.ir import ScheduleError
from ....core.varlen.seqlens import length_sampler
from ...errors import ZeroBubbleArgumentError

__all__ = ["add_balance_args", "balance_kwargs", "after_megatron_validation", "BALANCE_FLAGS"]

#: flags that need a megatron-zb schedule (``megatron.launch.flags`` says so in one line without one)
BALANCE_FLAGS = (("--zero-bubble-balance-microbatches", "zero_bubble_balance_microbatches"),
                 ("--zero-bubble-attention-share", "zero_bubble_attention_share"),
                 ("--zero-bubble-pack-sequences", "zero_bubble_pack_sequences"))


def _share(text):
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"--zero-bubble-attention-share must be a share between 0 and 1, got {text!r}")
    return v


def _lengths(text):
    if text == "eod":
        return text
    try:
        length_sampler(text)
    except ScheduleError as e:
        raise argparse.ArgumentTypeError(f"--zero-bubble-seq-lengths: {e}") from None
    return text


def add_balance_args(g) -> None:
    g.add_argument("--zero-bubble-balance-microbatches", action="store_true", default=False,
                   help="Variable-length batches (sets Megatron's variable_seq_lengths): balance each iteration's global batch over the data-parallel "
                        "replicas and microbatches (Karmarkar-Karp on each sequence's cost; replicas may run different "
                        "microbatch counts) and run each replica's per-microbatch schedule; the loss is normalised "
                        "over the global token count (--calculate-per-token-loss, turned on), so the gradient is the "
                        "unbalanced run's (docs/varlen.md).")
    g.add_argument("--zero-bubble-attention-share", type=_share, default=None, metavar="A",
                   help="The balancer's cost model: share of F and B at --seq-length spent in attention (default: from "
                        "the model's shape).")
    g.add_argument("--zero-bubble-pack-sequences", action="store_true", default=False,
                   help="With --zero-bubble-balance-microbatches: each balanced microbatch in Megatron's packed-sequence "
                        "format (THD: its sequences one after another, each attending within itself; no padding), "
                        "as many tokens as --micro-batch-size x --seq-length at most. The model's attention must take "
                        "packed sequences: TE's (--transformer-impl transformer_engine) on a GPU; megatron-zb's "
                        "entry point gives the local spec a CPU attention that does. A script of your own needs "
                        "Megatron-LM's --sft path (its forward step passes packed_seq_params).")
    g.add_argument("--zero-bubble-seq-lengths", "--zero-bubble-mock-seq-lengths", type=_lengths, default=None,
                   metavar="DIST", dest="zero_bubble_mock_seq_lengths",
                   help="Variable-length samples from Megatron's GPT dataset (--data-path) or its mock data: cut each "
                        "sample to a length drawn from DIST (lognormal:MEDIAN:SIGMA, or a file of lengths, one per "
                        "line; deterministic per sample), or with 'eod' up to its first end-of-document token (the "
                        "documents' own lengths). Needs --micro-batch-size 1 (Megatron's data loader stacks a "
                        "microbatch's samples).")


def balance_kwargs(args, name: Optional[str]) -> Dict[str, Any]:
    """``install()`` keywords of the flags above, after their checks (one line each). Turns on
    ``args.calculate_per_token_loss`` (and records that it did in ``args.zero_bubble_set_per_token_loss``)."""
    err = ZeroBubbleArgumentError
    mock = getattr(args, "zero_bubble_mock_seq_lengths", None)
    if mock is not None:
        if int(getattr(args, "micro_batch_size", 1) or 1) != 1:
            raise err("--zero-bubble-seq-lengths needs --micro-batch-size 1 (Megatron's data loader stacks a "
                      "microbatch's samples, which must then have one length)")
    if not getattr(args, "zero_bubble_balance_microbatches", False):
        for dest, what in (("zero_bubble_attention_share", "--zero-bubble-attention-share tunes"),
                           ("zero_bubble_pack_sequences", "--zero-bubble-pack-sequences packs")):
            if getattr(args, dest, None) not in (None, False):
                raise err(f"{what} --zero-bubble-balance-microbatches: give that flag too")
        return {}
    flag = "--zero-bubble-balance-microbatches"
    for dest, what in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("context_parallel_size", "--context-parallel-size")):
        if int(getattr(args, dest, 1) or 1) > 1:
            raise err(f"{flag} with {what} > 1 is not supported yet (Megatron broadcasts a batch over those ranks "
                      "with fixed shapes)")
    if getattr(args, "num_experts", None) and getattr(args, "moe_token_dispatcher_type", "allgather") != "alltoall":
        raise err(f"{flag} with MoE needs --moe-token-dispatcher-type alltoall (Megatron's rule for variable "
                  "sequence lengths)")
    for dest, what in (("enable_vocab_parallel", "--enable-vocab-parallel"),):
        if getattr(args, dest, False):
            raise err(f"{flag} cannot be combined with {what} yet")
    args.variable_seq_lengths = True  # Megatron's validation resets it: after_megatron_validation sets it again
    if not getattr(args, "calculate_per_token_loss", False):
        args.calculate_per_token_loss = True
        args.zero_bubble_set_per_token_loss = True
    out: Dict[str, Any] = {"balance_microbatches": True}
    if getattr(args, "zero_bubble_attention_share", None) is not None:
        out["balance_attention_share"] = args.zero_bubble_attention_share
    if getattr(args, "zero_bubble_pack_sequences", False):
        out["balance_pack"] = True
    return out


def after_megatron_validation(args) -> None:
    """Megatron's ``validate_args`` sets ``variable_seq_lengths`` False (its data paths that vary the
    length turn it on themselves): variable-length mock samples and balanced microbatches need it
    (each activation's shape travels with it)."""
    if getattr(args, "zero_bubble_balance_microbatches", False) or getattr(args, "zero_bubble_mock_seq_lengths", None):
        args.variable_seq_lengths = True
        if not getattr(args, "num_experts", None):  # Megatron's config refuses allgather with it, even dense
            args.moe_token_dispatcher_type = "alltoall"
