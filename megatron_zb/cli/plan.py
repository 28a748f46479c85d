"""`megatron-zb plan`: rank every schedule for one GPT model, pipeline size and GPU memory budget
(``core.plan``), print the table and the flags to paste."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import List, Optional

from ..argtypes import nonneg, positive_float, positive_int, share_or_auto
from ..core.costs.model import SPLIT_OVERHEAD_S
from ..core.costs.models import names as model_names
from ..core.plan.baseline import against, megatron_baseline
from .common import UsageError, add_exact_args, add_post_validation_arg, check_size
from .plan_optim import add_optimizer_offload_args, host_costs
from .plan_table import print_plan
from .varlen import DEFAULT_SCHEDULES, add_varlen_args, check_varlen_args


def _split_overhead(text):
    v = nonneg("--split-overhead-ms")(text)
    if v >= 1000:
        raise argparse.ArgumentTypeError(f"--split-overhead-ms is milliseconds per layer, below 1000, got {text!r}")
    return v


def _efficiency(text):
    v = positive_float("--efficiency")(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"--efficiency is the fraction of the GPU's peak a pass reaches, in (0, 1], "
                                         f"got {text!r}")
    return v


def _virtual_stages(text):
    v = positive_int("--num-virtual-stages-per-pipeline-rank")(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"--num-virtual-stages-per-pipeline-rank is 2 or more model chunks per rank "
                                         f"(1 is no interleaving: the 1f1b rows), got {text!r}")
    return v


def add_parser(sub) -> None:
    pn = sub.add_parser("plan", help="rank schedules for a GPT model and a GPU memory budget",
                        description="Rank every schedule for one GPT model, pipeline size and GPU memory "
                        "budget: simulated time per iteration, bubble, speed-up over 1F1B, memory per "
                        "pipeline rank and whether it fits; then the Megatron flags to use. F/B/W times come "
                        "from the ZB paper's per-layer FLOPs at a GPU's peak x --efficiency, or from a profile "
                        "written while training (--profile); activation memory from Megatron's per-layer "
                        "formula, model states at 18 bytes per parameter.",
                        epilog=PLAN_COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = pn.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="NAME", default=None,
                     help="a public model's shape (no download): " + ", ".join(model_names()) + "; the flags below "
                          "override its values (give --seq-length: the default is 4096, not its context length)")
    src.add_argument("--hf-config", metavar="FILE", default=None,
                     help="a HuggingFace config.json (or a folder holding one): hidden_size, intermediate_size, "
                          "num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, "
                          "tie_word_embeddings, MoE and MTP keys; the flags below override it")
    pn.add_argument("--num-layers", type=positive_int("--num-layers"), default=None,
                    help="transformer layers of the model (Megatron's --num-layers; required without --model / "
                         "--hf-config)")
    pn.add_argument("--hidden-size", type=positive_int("--hidden-size"), default=None, help="hidden size h")
    pn.add_argument("--num-attention-heads", type=positive_int("--num-attention-heads"), default=None,
                    help="attention heads a (must divide --hidden-size)")
    pn.add_argument("--num-query-groups", type=positive_int("--num-query-groups"), default=None,
                    help="grouped-query attention: key/value heads (default: one per attention head)")
    pn.add_argument("--swiglu", action="store_true", default=None,
                    help="gated MLP (SwiGLU): three h x ffn matrices, ffn = --ffn-hidden-size")
    pn.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                    help="the output layer has its own weight (Megatron's default: tied to the embedding)")
    pn.add_argument("--seq-length", type=positive_int("--seq-length"), default=None,
                    help="sequence length s (default 4096 with --model / --hf-config)")
    pn.add_argument("--micro-batch-size", type=positive_int("--micro-batch-size"), default=None,
                    help="sequences per microbatch b (default 1)")
    pn.add_argument("--vocab-size", type=positive_int("--vocab-size"), default=None,
                    help="vocabulary size: the output layer's cost and logits memory on the loss stage "
                         "(default 32000)")
    pn.add_argument("--mtp-num-layers", type=positive_int("--mtp-num-layers"), default=None,
                    help="multi-token prediction layers (DeepSeek-V3), on the loss's model chunk")
    pn.add_argument("--ffn-hidden-size", type=positive_int("--ffn-hidden-size"), default=None,
                    help="MLP hidden size (default 4 x --hidden-size)")
    pn.add_argument("--tensor-parallel-size", type=positive_int("--tensor-parallel-size"), default=None,
                    help="tensor-parallel size t: divides costs and most memory (default 1)")
    pn.add_argument("--sequence-parallel", action="store_true",
                    help="sequence parallelism: the LayerNorm/dropout activations are divided by t too")
    pn.add_argument("--data-parallel-size", type=positive_int("--data-parallel-size"), default=None,
                    help="data-parallel size: only matters with --use-distributed-optimizer (default 1)")
    pn.add_argument("--use-distributed-optimizer", action="store_true",
                    help="optimizer states sharded over the data-parallel ranks (12 of the 18 bytes/parameter)")
    pn.add_argument("--no-flash-attention", action="store_true",
                    help="count the 5as attention-score activations (no flash attention)")
    pn.add_argument("--activation-bytes", type=int, choices=(2, 4), default=2,
                    help="bytes per activation element: 2 with --bf16/--fp16 (default), 4 for fp32 training")
    pn.add_argument("--num-experts", type=positive_int("--num-experts"), default=None,
                    help="MoE: experts per layer (Megatron's flag); F/B/W, memory and parameters per expert routing")
    pn.add_argument("--moe-router-topk", type=positive_int("--moe-router-topk"), default=None,
                    help="experts each token goes through (default 2)")
    pn.add_argument("--moe-layer-freq", type=_layer_freq, default=None, metavar="K|PATTERN",
                    help="which layers are MoE: every K-th from layer 0, or Megatron's pattern, e.g. "
                         "'([0]*3+[1]*58)' for DeepSeek-V3's three dense first layers (default: every layer)")
    pn.add_argument("--moe-shared-expert-intermediate-size", type=positive_int("--moe-shared-expert-intermediate-size"),
                    default=None, help="MLP size of the shared experts every token goes through")
    pn.add_argument("--moe-ffn-hidden-size", type=positive_int("--moe-ffn-hidden-size"), default=None,
                    help="an expert's MLP size (default --ffn-hidden-size)")
    pn.add_argument("--expert-model-parallel-size", type=positive_int("--expert-model-parallel-size"), default=None,
                    help="ranks the experts are spread over (their parameters per rank)")
    pn.add_argument("--ep-bandwidth-gbps", type=positive_float("--ep-bandwidth-gbps"), default=None, metavar="GB/s",
                    help="MoE with --expert-model-parallel-size > 1: all-to-all bandwidth per GPU in GB/s; each F and "
                         "B moves 2 x tokens x topk x hidden x --activation-bytes per layer (the share routed to "
                         "other ranks, (EP-1)/EP), hidden inside the overlapped F&B pairs a schedule forms "
                         "(default 50: one 400 Gb/s InfiniBand NIC per GPU)")
    pn.add_argument("--no-overlap", action="store_true",
                    help="MoE: the all-to-all is not hidden inside overlapped F&B pairs (to compare)")
    pn.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                    help="activation recompute: full (F keeps each block's input, B runs the forward again; W then "
                         "holds more than F kept) or selective (no attention scores kept)")
    pn.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                    help="full recompute's method, as Megatron's: uniform (every layer, in blocks of "
                         "--recompute-num-layers; the default) or block (the first --recompute-num-layers layers of "
                         "each model chunk). Without --recompute-granularity, plan tries recompute per chunk itself "
                         "where a row does not fit (docs/memory.md)")
    pn.add_argument("--recompute-num-layers", type=positive_int("--recompute-num-layers"), default=1,
                    help="layers per recomputed block (uniform method) or recomputed per chunk (block method)")
    pn.add_argument("--no-dropout", action="store_true",
                    help="no dropout (--hidden-dropout 0 --attention-dropout 0): no masks, no dropout outputs kept")
    pn.add_argument("--pipeline-parallel-size", type=positive_int("--pipeline-parallel-size"), required=True,
                    help="pipeline ranks P (>= 2)")
    pn.add_argument("--num-microbatches", type=positive_int("--num-microbatches"), default=None,
                    help="microbatches per iteration M (global batch / (micro-batch x data-parallel size)); required "
                         "without --seq-lengths")
    pn.add_argument("--gpu-memory-gb", type=positive_float("--gpu-memory-gb"), default=80.0,
                    help="memory budget per GPU in GiB (default 80); zb-auto and v-auto search under it")
    pn.add_argument("--gpu", choices=["h100", "h200", "a100", "b200", "mi300x"], default="h100",
                    help="GPU whose dense bf16 peak sets the FLOP-based times (default h100: 989 TFLOPS)")
    pn.add_argument("--peak-tflops", type=positive_float("--peak-tflops"), default=None,
                    help="peak TFLOPS to use instead of --gpu's")
    pn.add_argument("--efficiency", type=_efficiency, default=0.5,
                    help="fraction of the peak a pass reaches (default 0.5)")
    pn.add_argument("--split-overhead-ms", type=_split_overhead, default=None, metavar="MS",
                    help="what splitting a backward into B and W adds per transformer layer, in ms (default "
                         f"{1e3 * SPLIT_OVERHEAD_S:g}: the GPU figures in benchmarks/results/; 0: the split is free). "
                         "A fused backward pays none; a schedule's B and W that run back to back are fused where "
                         "that delays no pass. With --profile: what the profile measured")
    pn.add_argument("--profile", metavar="JSON",
                    help="take F/B/W (and message) times, in seconds, from a profile JSON written while training "
                         "(--zero-bubble-profile-window) instead of FLOPs")
    pn.add_argument("--allow-padding-num-layers", action="store_true",
                    help="first and last stage take one layer less (they hold the embedding and the loss)")
    pn.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT", default=None,
                    help="Megatron's layout (E embedding, t transformer layer, m MTP layer, L loss, | between stages, "
                         "*N repeats; in pipeline order: a V's 2P stages are ranks 0..P-1 then P-1..0) for every row "
                         "whose model chunks it matches; default: each row tries the even split and a balanced one")
    pn.add_argument("--num-virtual-stages-per-pipeline-rank", type=_virtual_stages, default=None, metavar="V",
                    help="model chunks per rank of the interleaved schedules (interleaved-1f1b, interleaved-zb, "
                         "zeropp, looped-bfs); default: each of their rows tries 2 and 4 (4 where the layers fill "
                         "4 chunks per rank) and keeps the faster")
    pn.add_argument("--no-layout-search", action="store_true",
                    help="only the even split (Megatron's default layout), no balanced layout")
    vg = pn.add_argument_group("vocabulary parallelism (the output layer and loss spread over every pipeline rank)")
    vx = vg.add_mutually_exclusive_group()
    vx.add_argument("--enable-vocab-parallel", action="store_true",
                    help="only rows with vocabulary parallelism (default: a row with and one without for every schedule)")
    vx.add_argument("--no-vocab-parallel", action="store_true", help="only rows without it")
    vg.add_argument("--disable-backward-fusion", action="store_true",
                    help="two all-reduce barriers per microbatch instead of one (the ZB authors' flag)")
    vg.add_argument("--whole-vocab-embedding", action="store_true",
                    help="the '+vocab' rows keep the input embedding whole on the first stage's rank (default: split "
                         "over the pipeline ranks too, --split-vocab-embedding: '+vocab+emb')")
    vg.add_argument("--vocab-comm-gbps", type=positive_float("--vocab-comm-gbps"), default=None, metavar="GB/s",
                    help="bandwidth of the vocabulary barriers' collectives over the pipeline ranks (default 50)")
    pn.add_argument("--cost-optimizer", type=nonneg("--cost-optimizer"), default=0.0,
                    help="seconds of one optimizer step, added to the time per iteration (default 0)")
    add_post_validation_arg(pn, "rank by the time per iteration")
    og = pn.add_argument_group("activation offload (docs/offload.md)")
    og.add_argument("--offload-ratio", type=share_or_auto("--offload-ratio"), default=None, metavar="R|auto",
                    help="offload this share of each schedule's activations; 'auto': as little as fits the budget")
    og.add_argument("--offload-time", type=nonneg("--offload-time"), default=None, metavar="K",
                    help="one-way transfer of a stage activation takes K x (F + B) (or give --host-link-gbps)")
    og.add_argument("--host-link-gbps", type=positive_float("--host-link-gbps"), default=None, metavar="GB/s",
                    help="one-way host link bandwidth per GPU; K follows from the activation bytes and F + B")
    og.add_argument("--offload-half-duplex", action="store_true",
                    help="D2H and H2D share one queue (one copy stream)")
    add_optimizer_offload_args(pn)
    pn.add_argument("--full-search", action="store_true",
                    help="search every row of zb-auto, zb-v, v-half, v-min and v-auto in full and place every "
                         "row's vocabulary passes every way (what training builds without "
                         "--zero-bubble-search-effort); default: a quick search, and the full one where it adds "
                         "building blocks (v-half, v-min, v-auto under 1F1B's peak, the V family at P x M <= 64) for "
                         "the rows within 6%% of the leading row and the row chosen within 1F1B's memory (rows marked "
                         "~ were searched quickly: their flags carry --zero-bubble-search-effort quick, which builds "
                         "that very schedule)")
    pn.add_argument("--json", action="store_true",
                    help="print one JSON object instead (per-rank lists in bytes and seconds)")
    pn.add_argument("--jobs", type=positive_int("--jobs"), default=None, metavar="N",
                    help="generate the schedules in N processes at once (default: the CPUs this process may "
                         "use, at most 8; 1: in this process). The rows are the same whatever N")
    add_exact_args(pn)
    add_varlen_args(pn, model_flags=False)
    pn.add_argument("--schedules", nargs="+", metavar="NAME", default=None,
                    help="the schedules to rank (default: every schedule; 1f1b is always planned, the reference of "
                         "'vs 1f1b'; with --seq-lengths: " + ", ".join(DEFAULT_SCHEDULES) + ")")
    pn.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from ..core import plan as P
    spec = P.ModelSpec(**model_kwargs(args))
    tflops = args.peak_tflops if args.peak_tflops is not None else P.GPU_PEAK_TFLOPS[args.gpu]
    profile = P.load_profile(args.profile) if args.profile else None
    if args.offload_ratio is None and (args.offload_time is not None or
                                       (args.host_link_gbps is not None and args.optimizer_offload is None)):
        raise UsageError("--offload-time / --host-link-gbps need --offload-ratio R (0..1) or auto")
    if args.offload_time is not None and args.host_link_gbps is not None:
        raise UsageError("give --offload-time K or --host-link-gbps B, not both")
    if args.offload_ratio is not None and args.offload_time is None and args.host_link_gbps is None:
        raise UsageError("--offload-ratio needs the host link it copies over: give --host-link-gbps B (one-way GB/s "
                         "per GPU, e.g. 50 for PCIe 5.0 x16, 25 for PCIe 4.0 x16) or --offload-time K")
    check_varlen_args(args, "plan")
    if args.seq_lengths:  # variable-length batches: sequential vs balanced rows (cli.plan_varlen)
        from .plan_varlen import cmd_plan_varlen
        return cmd_plan_varlen(args, spec, tflops * 1e12 * args.efficiency)
    if args.num_microbatches is None:
        raise UsageError("--num-microbatches is required (or --seq-lengths FILE)")
    check_size(args.pipeline_parallel_size, args.num_microbatches, 2,
               flags=("--pipeline-parallel-size", "--num-microbatches"))
    a, gbps = args, P.EP_BANDWIDTH_GBPS
    request = P.PlanRequest(
        spec, a.pipeline_parallel_size, a.num_microbatches, a.gpu_memory_gb, tflops=tflops, efficiency=a.efficiency,
        profile=profile, schedules=_schedules(a.schedules), pad_ends=a.allow_padding_num_layers,
        layout=a.pipeline_model_parallel_layout, interleave_chunks=a.num_virtual_stages_per_pipeline_rank,
        layout_search=not a.no_layout_search, cost_optimizer=a.cost_optimizer,
        post_validation=a.optimizer_post_validation,
        offload=None if a.offload_ratio is None else P.OffloadLever(a.offload_ratio, a.offload_time, a.host_link_gbps,
                                                                    overlap=not a.offload_half_duplex),
        vocab=P.VocabLever("on" if a.enable_vocab_parallel else "off" if a.no_vocab_parallel else "both",
                           barriers=2 if a.disable_backward_fusion else 1, embedding=not a.whole_vocab_embedding,
                           gbps=gbps if a.vocab_comm_gbps is None else a.vocab_comm_gbps),
        moe=P.MoeLever(gbps if a.ep_bandwidth_gbps is None else a.ep_bandwidth_gbps, overlap=not a.no_overlap),
        optimizer_offload=None if a.optimizer_offload is None else P.OptimizerOffload(a.optimizer_offload,
                                                                                      host_costs(a)),
        exact=(a.exact_nodes, a.exact_seconds) if a.exact else None, search="full" if a.full_search else "quick")
    # one set of worker processes for every plan below
    with P.Workers(args.jobs if args.jobs is not None else min(8, _usable_cpus())) as workers:
        rows = P.plan(request, workers=workers)

        def again(gib, names, **more):  # the quick rows as they are: ``full`` searches the one chosen again
            return P.plan(request.replace(gpu_memory_gb=args.gpu_memory_gb if gib is None else gib, schedules=names,
                                          refine=False, **more), workers=workers)

        def full(row, gib):  # a quickly searched row chosen: in full where that adds blocks, else its limit tightened
            vocab = dataclasses.replace(request.vocab, parallel="on" if row.get("vocab_parallel") else "off")
            if P.margin(row, args.pipeline_parallel_size, args.num_microbatches) is not None:
                return again(gib, [row["schedule"]], search="full", vocab=vocab)[0]
            if P.room_limit(row):
                redone = again(gib, [row["schedule"]], tighten=True, vocab=vocab)[0]
                return None if "error" in redone or P.room_limit(redone) else redone
            return None

        within = P.within_1f1b_memory(rows, again, full)
    baseline = megatron_baseline(request)
    against(rows + ([within] if within else []), baseline[0], request.ranked_by)
    advice = post_validation_advice(rows, args.optimizer_post_validation)
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(spec), "pipeline_parallel_size": args.pipeline_parallel_size,
                          "num_microbatches": args.num_microbatches, "gpu_memory_gb": args.gpu_memory_gb,
                          "costs_from": "profile" if profile else f"FLOPs at {tflops:g} TFLOPS x {args.efficiency:g}",
                          "cost_optimizer_s": args.cost_optimizer,
                          "optimizer_post_validation": args.optimizer_post_validation,
                          "post_validation_advice": advice, "within_1f1b_memory": within,
                          "megatron_baseline": baseline[0], "megatron_baseline_reason": baseline[1], "rows": rows}))
        return 0
    print_plan(args, spec, rows, profile, tflops, advice, within, baseline)
    return 0


# ModelSpec field -> the plan flag's dest (flags left at None keep the named model's / config's value)
_MODEL_FLAGS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "seq_length": "seq_length", "micro_batch_size": "micro_batch_size", "vocab_size": "vocab_size",
    "ffn_hidden_size": "ffn_hidden_size", "tensor_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size", "num_experts": "num_experts", "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size", "expert_model_parallel_size": "expert_model_parallel_size",
    "num_query_groups": "num_query_groups", "swiglu": "swiglu", "moe_layer_freq": "moe_layer_freq",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights", "mtp_num_layers": "mtp_num_layers",
}
DEFAULT_SEQ_LENGTH = 4096


def model_kwargs(args) -> dict:
    """ModelSpec keywords: a named model's or a HuggingFace config's shape, the flags given over it."""
    from ..core.costs import models
    from ..core.ir import ScheduleError
    base = {}
    try:
        if args.model:
            base = models.spec_kwargs(args.model, seq_length=args.seq_length or DEFAULT_SEQ_LENGTH)
        elif args.hf_config:
            base = models.load_hf_config(args.hf_config, seq_length=args.seq_length or DEFAULT_SEQ_LENGTH)
    except ScheduleError as e:
        raise UsageError(str(e)) from None
    for field, dest in _MODEL_FLAGS.items():
        v = getattr(args, dest, None)
        if v is not None:
            base[field] = v
    missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
               if base.get(k) is None]
    if missing:
        raise UsageError(f"plan needs the model: give {', '.join(missing)} (or --model NAME / --hf-config FILE)")
    base.update(sequence_parallel=args.sequence_parallel, distributed_optimizer=args.use_distributed_optimizer,
                flash_attention=not args.no_flash_attention, activation_bytes=args.activation_bytes,
                dropout=not args.no_dropout, recompute=args.recompute_granularity,
                split_overhead_s=0.0 if getattr(args, "profile", None) else
                (SPLIT_OVERHEAD_S if args.split_overhead_ms is None else args.split_overhead_ms / 1e3),
                recompute_num_layers=args.recompute_num_layers, recompute_method=args.recompute_method)
    return base


def _layer_freq(text):
    """--moe-layer-freq: an integer K, or Megatron's list pattern such as ([0]*3+[1]*58) or [1,0,1,0]."""
    import re
    t = str(text).strip()
    if re.fullmatch(r"\d+", t):
        return positive_int("--moe-layer-freq")(t)
    body = t[1:-1] if t.startswith("(") and t.endswith(")") else t
    out = []
    for part in body.split("+"):
        m = re.fullmatch(r"\s*\[([01](?:\s*,\s*[01])*)\]\s*(?:\*\s*(\d+))?\s*", part)
        if not m:
            raise argparse.ArgumentTypeError(f"--moe-layer-freq takes an integer or a pattern like ([0]*3+[1]*58), "
                                             f"got {text!r}")
        out += [int(x) for x in m.group(1).split(",")] * int(m.group(2) or 1)
    return out


def _schedules(names):
    """plan's --schedules: the names asked for (each one known), 1f1b added as the reference of
    'vs 1f1b'; None (every schedule) where none was given."""
    if not names:
        return None
    from ..core import schedules
    from ..core.ir import ScheduleError
    try:
        for name in names:
            schedules.get(name)
    except ScheduleError as e:
        raise UsageError(f"--schedules: {e}") from None
    return list(dict.fromkeys(names + ["1f1b"]))


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, e.g. not macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


PLAN_COLUMNS = """columns:
  #              ranking: schedules that fit first, then by time per iteration (sync, or
                 postval with --optimizer-post-validation); times within 0.1% of each other
                 count as equal and the one needing the least memory (peak GiB) goes first
  iteration ms   simulated time of one training iteration in milliseconds, from one iteration's
                 start to the next: "sync" with Megatron's synchronous optimizer step (every rank
                 waits at its global norm/inf all-reduce), "postval" with optimizer post-validation
                 (--enable-optimizer-post-validation); --cost-optimizer adds the step, data
                 loading is not included
  bubble         idle share of the pipeline ranks over that time
  vs 1f1b        iteration speed relative to 1F1B with the same costs (1.10x = 10% faster)
  act GiB min/max  peak activation memory of a pipeline rank, smallest and largest over the ranks
  peak GiB       activations + model states (weights, gradients, optimizer) of the fullest
                 pipeline rank, and which rank that is
  fits           peak GiB <= --gpu-memory-gb
  pairs          MoE with expert parallelism: the overlapped F&B pairs of the schedule, whose
                 all-to-all hides behind the other pass's compute (--ep-bandwidth-gbps)
  ~schedule      searched quickly (fewer candidates, a shorter local search, the vocabulary
                 passes placed three ways instead of eighteen); its flags carry
                 --zero-bubble-search-effort quick, so training builds that very schedule. Where
                 the full search adds building blocks (v-half, v-min, v-auto under 1F1B's peak,
                 the V family at P x M <= 64) the rows within 6% of the first and the one within
                 1F1B's memory are searched in full; elsewhere it was at most 0.6% faster on
                 seven plans. --full-search searches every row in full
Below the table: the flags of the first schedule that fits (the fastest; among equally fast
ones the cheapest in memory), ready to paste into a Megatron command, then those of the others
that fit (--zero-bubble-memory-limit counts microbatches: one is the activation memory of one
microbatch on the fullest rank, given in GiB below them; for the suggested row and the one within
1F1B's memory it is what the schedule needs, its peak, not the room left on the GPU; another row's
may be that room, which builds the same schedule: the line says which). Where the fastest that fits needs more memory on some rank than
Megatron's 1F1B, "within Megatron 1F1B's memory" names the fastest schedule that needs no more
(v-auto and zb-auto planned again with 1F1B's peak as their budget) and its flags."""


def post_validation_advice(rows: List[dict], post_validation: bool) -> Optional[str]:
    """A line recommending optimizer post-validation when it makes the best fitting schedule
    faster (by more than 0.5%), naming the schedule that wins each way."""
    fit = [r for r in rows if "error" not in r and r["fits"]]
    if not fit:
        return None
    by_sync = min(fit, key=lambda r: (r["iteration_time_s"], r["makespan_s"]))
    by_post = min(fit, key=lambda r: (r["iteration_time_post_validated_s"], r["makespan_s"]))
    t_sync, t_post = by_sync["iteration_time_s"], by_post["iteration_time_post_validated_s"]
    if t_post <= 0 or t_sync / t_post < 1.005:
        return None
    if post_validation:
        return (f"optimizer post-validation pays here: {by_post['schedule']} {t_post:.4g} s per iteration; "
                f"without it the best is {by_sync['schedule']} at {t_sync:.4g} s")
    return (f"recommended: --enable-optimizer-post-validation with {by_post['schedule']}: {t_post:.4g} s per "
            f"iteration vs {t_sync:.4g} s for the best synchronous choice {by_sync['schedule']} "
            f"({t_sync / t_post:.3f}x); --optimizer-post-validation ranks by it")
