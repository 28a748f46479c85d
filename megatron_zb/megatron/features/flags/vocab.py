"""``--enable-vocab-parallel`` in training (the VocabularyParallelism fork's flags, with their
meaning): what it runs with, refused in one line otherwise, and the costs the schedule core places
the vocabulary passes with (``core.costs.chunk_costs.vocab_setting``, in the units of the schedule's other
costs). The runtime side: ``megatron.features.vocab_parallel``.

* ``--enable-vocab-parallel``: every pipeline rank holds V / (P x TP) rows of the output layer (or
  of the tied embedding's weight); one all-reduce barrier per microbatch (the paper's Algorithm 2).
* ``--disable-backward-fusion``: the input gradient in its own pass after a second barrier (the
  paper's Algorithm 1: less memory per microbatch in flight, one more collective).
* ``--split-vocab-embedding`` (megatron-zb's; the fork always splits): the input embedding's rows
  over the pipeline ranks too (``features.vocab_embedding``).
* Without a zero-bubble schedule flag the fork's vocabulary-parallel 1F1B runs (``1f1b``).
* ``--use-interlaced-schedule`` (the fork's baseline that interlaces the vocabulary passes with the
  transformer passes by hand) is not a schedule megatron-zb builds: refused, naming what to use.

This module imports neither torch nor megatron.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ....core.ir import Placement, ScheduleError
from ....core.costs.layout import Layout
from ...errors import ZeroBubbleArgumentError

__all__ = ["vocab_barriers", "check_vocab_args", "vocab_cost_kwargs", "ASSUMED_TFLOPS", "ASSUMED_LINK_GBPS"]

# what a cost unit (a stage's F) and a barrier's bytes are compared with before anything was measured:
# an H100's bf16 peak at half efficiency, a collective's bandwidth between pipeline ranks
ASSUMED_TFLOPS = 989.0 * 0.5
ASSUMED_LINK_GBPS = 50.0


def vocab_barriers(args) -> Optional[int]:
    """1 or 2 barriers with ``--enable-vocab-parallel`` (2: ``--disable-backward-fusion``), None off."""
    if not getattr(args, "enable_vocab_parallel", False):
        return None
    return 2 if getattr(args, "disable_backward_fusion", False) else 1


def _given(args, dest) -> bool:
    v = getattr(args, dest, None)
    return v is not None and v is not False


def check_vocab_args(args, *, name: Optional[str], style: Optional[str], p: int) -> Optional[int]:
    """Refuse what vocabulary parallelism cannot run with (one line each); the barriers or None."""
    err = ZeroBubbleArgumentError
    if getattr(args, "use_interlaced_schedule", False):
        raise err("--use-interlaced-schedule is not available in megatron-zb: its schedules place the vocabulary "
                  "passes themselves; use --enable-vocab-parallel (one barrier) or add --disable-backward-fusion (two)")
    barriers = vocab_barriers(args)
    if barriers is None:
        for dest, flag in (("disable_backward_fusion", "--disable-backward-fusion"),
                           ("split_vocab_embedding", "--split-vocab-embedding")):
            if getattr(args, dest, False):
                raise err(f"{flag} is a setting of vocabulary parallelism: add --enable-vocab-parallel")
        return None
    if p < 2:
        raise err(f"--enable-vocab-parallel spreads the output layer over the pipeline ranks: "
                  f"--pipeline-model-parallel-size is {p}; it needs at least 2")
    if style == "bitpipe":
        raise err(f"--enable-vocab-parallel cannot be combined with {name}: its replicated stages would each need "
                  "their own output layer's shards")
    blockers = (("sequence_parallel", "--sequence-parallel"), ("mtp_num_layers", "--mtp-num-layers"),
                ("enable_optimizer_post_validation", "--enable-optimizer-post-validation"),
                ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),
                ("overlap_grad_reduce", "--overlap-grad-reduce"), ("use_megatron_fsdp", "--use-megatron-fsdp"),
                ("use_torch_fsdp2", "--use-torch-fsdp2"))
    for dest, flag in blockers:
        if _given(args, dest):
            raise err(f"--enable-vocab-parallel cannot be combined with {flag} yet: drop one of them")
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise err("--enable-vocab-parallel cannot be combined with --context-parallel-size > 1 yet")
    if int(getattr(args, "encoder_num_layers", 0) or 0) and getattr(args, "encoder_num_layers", None) != \
            getattr(args, "num_layers", None):
        raise err("--enable-vocab-parallel runs GPT models (a decoder and its output layer) only")
    div = int(getattr(args, "make_vocab_size_divisible_by", 128) or 128)
    if div % p:
        raise err(f"--enable-vocab-parallel splits the padded vocabulary over {p} pipeline ranks: give "
                  f"--make-vocab-size-divisible-by a multiple of {p} (it is {div}; e.g. {_lcm(div, p)})")
    return barriers


def _lcm(a: int, b: int) -> int:
    import math
    return a * b // math.gcd(a, b)


def vocab_cost_kwargs(spec, layout: Optional[Layout], placement: Placement, barriers: int,
                      embedding: bool = False) -> Dict[str, Any]:
    """``install()``'s per-chunk costs without the output layer (``chunk_cost_kwargs``' units: the
    busiest rank's F, the fullest rank's activation) and ``vocab_costs``: VS, VT, VW and their
    memory in the same units, the barriers' communication at ``ASSUMED_LINK_GBPS`` against a
    stage computing at ``ASSUMED_TFLOPS`` (``core.costs.chunk_costs.unit_costs``: what plan builds its rows
    with). ``layout`` None: the even split. ``embedding``: the input embedding split too (VI, VG and
    their collectives; --split-vocab-embedding)."""
    from ....core.costs.chunk_costs import unit_costs
    try:
        uc = unit_costs(spec, layout, placement, barriers, embedding, flops_per_s=ASSUMED_TFLOPS * 1e12,
                        link_bytes_per_s=ASSUMED_LINK_GBPS * 1e9)
    except ScheduleError as e:
        raise ZeroBubbleArgumentError(str(e)) from None
    costs = {k: v for k, v in uc.vocab.to_dict().items() if k != "barriers"}
    return {"cost_f": uc.cost_f, "cost_b": uc.cost_b, "cost_w": uc.cost_w, "mem_f": uc.mem_f, "mem_w": uc.mem_w,
            "unit_bytes": uc.unit_bytes, "vocab_costs": costs, **({"cost_bw": uc.cost_bw} if uc.cost_bw is not None else {})}
