"""`megatron-zb plan`'s table: the model and the costs in a header, the rows ranked (time per
iteration, bubble, speed-up over 1F1B and over Megatron's best configuration that fits, what the
split backward costs, memory per rank, the layout), then the flags to paste."""
from __future__ import annotations

from ..core.schedules import get
from .plan_optim import print_optimizer_offload

__all__ = ["print_plan"]


def print_plan(args, spec, rows, profile, tflops, advice, within=None, baseline=(None, None)) -> None:
    """The table (``baseline``: Megatron's best configuration that fits and why there is none)."""
    from ..core import plan as P
    gib = 1024 ** 3
    p, m = args.pipeline_parallel_size, args.num_microbatches
    extras = [f"TP={spec.tensor_parallel_size}" + (" (sequence parallel)" if spec.sequence_parallel else ""),
              f"DP={spec.data_parallel_size}" + (" (distributed optimizer)" if spec.distributed_optimizer else "")]
    name = f"{args.model}: " if args.model else f"{args.hf_config}: " if args.hf_config else ""
    shape = [f"{spec.num_layers} layers", f"hidden {spec.hidden_size}"]
    if spec.num_query_groups:
        shape.append(f"{spec.num_query_groups} KV heads")
    if spec.num_experts:
        shape.append(f"{spec.num_experts} experts top-{spec.moe_router_topk}")
    if spec.mtp_num_layers:
        shape.append(f"MTP {spec.mtp_num_layers}")
    shape.append(f"vocabulary {spec.vocab_size}" + ("" if spec.untie_embeddings_and_output_weights else " (tied)"))
    print(f"plan: {p} pipeline ranks, {m} microbatches; {name}{', '.join(shape)}, sequence {spec.seq_length}, "
          f"micro-batch {spec.micro_batch_size}, " + ", ".join(extras))
    print(f"      {args.gpu_memory_gb:g} GiB per GPU; F/B/W times "
          + (f"from the profile {args.profile}" if profile else
             f"from FLOPs at {tflops:g} TFLOPS x {args.efficiency:g} efficiency"
             + (f", the split backward {1e3 * spec.split_overhead_s:g} ms more per layer than the fused one (split "
                "column: what it costs the iteration)" if spec.split_overhead_s else ""))
          + "; activations by Megatron's per-layer formula, model states 18 bytes/parameter; each model chunk "
          "costed by what it holds (embedding, layers, output layer + loss)"
          + ("" if profile else f"; layouts: {args.pipeline_model_parallel_layout}" if args.pipeline_model_parallel_layout
             else "; layouts: the even split (Megatron's) or a balanced one, whichever is faster (an interleaved row "
             "that does not fit also tries each rank's first chunk a layer lighter)"
             if not args.no_layout_search else "; layouts: the even split (Megatron's)"))
    a2a = next((r["cost_a2a_s"] for r in rows if r.get("cost_a2a_s")), None)
    if a2a:
        gbps = args.ep_bandwidth_gbps if args.ep_bandwidth_gbps is not None else 50.0
        print(f"      MoE all-to-all (EP={spec.expert_model_parallel_size}): {spec.layer_a2a_bytes() / 2 ** 20:.1f} MiB "
              f"per layer and microbatch in an F (as much in a B) at {gbps:g} GB/s: {1e3 * max(a2a):.2f} ms per F "
              "and per B of the busiest rank, "
              + ("hidden in the overlapped F&B pairs a schedule forms (pairs column)" if not args.no_overlap
                 else "not hidden (--no-overlap)"))
    print("      ranked by the time per training iteration "
          + ("with optimizer post-validation" if args.optimizer_post_validation
             else "with Megatron's synchronous optimizer step")
          + (f" (optimizer step {1e3 * args.cost_optimizer:g} ms)" if args.cost_optimizer else ""))
    ref, why = baseline
    if ref is not None:
        print(f"      vs Megatron: against Megatron's best configuration that fits, {ref['schedule']}"
              + (f" x{ref['chunks']}" if ref.get("chunks", 1) > 1 else "")
              + (f", {ref['recompute']}" if ref.get("recompute") else ", no recompute")
              + f": {1e3 * ref['iteration_time_s']:.1f} ms, peak {max(ref['peak_bytes']) / gib:.1f} GiB "
              f"({ref['flags']})")
    elif why:
        print(f"      vs Megatron: none ({why})")
    ok = [r for r in rows if "error" not in r]
    w = max([17] + [len(_label(r)) for r in ok])  # the schedule column: its longest label
    split = any("split_cost_s" in r for r in ok)  # what the split backward costs each row
    hdr1 = (f"{'#':>3}  {'schedule':<{w}} {'iteration ms':^19} {'bubble':>7} {'vs 1f1b':>8} {'vs Mcore':>8}"
            + (f" {'split':>6}" if split else "") + f"  {'act GiB':^13}  "
            f"{'peak GiB':^14}  fits" + ("  pairs" if a2a else "") + "  layout (pipeline order)")
    hdr2 = (f"{'':>3}  {'':<{w}} {'sync':>9} {'postval':>9} {'':>7} {'':>8} {'':>8}" + (f" {'ms':>6}" if split else "")
            + f"  {'min':>6} {'max':>6}  {'max':>6} "
            f"{'on rank':>7}" + (" " * 13 if a2a else ""))
    print(hdr1)
    print(hdr2)
    print("-" * len(hdr2))
    for i, r in enumerate(ok, 1):
        act = [x / gib for x in r["activation_bytes"]]
        peak = [x / gib for x in r["peak_bytes"]]
        worst = max(range(len(peak)), key=peak.__getitem__)
        tp, vm = r.get("throughput_vs_1f1b"), r.get("speedup_vs_megatron")
        print(f"{i:>3}  {_label(r):<{w}} {1e3 * r['iteration_time_s']:>9.1f} "
              f"{1e3 * r['iteration_time_post_validated_s']:>9.1f} {100 * r['bubble_rate']:>6.1f}% "
              f"{(f'{tp:.3f}x' if tp else '-'):>8} {(f'{vm:.3f}x' if vm else '-'):>8}"
              + (f" {1e3 * r.get('split_cost_s', 0.0):>6.1f}" if split else "")
              + f"  {min(act):>6.1f} {max(act):>6.1f}  {peak[worst]:>6.1f} "
              f"{worst:>7}  {'yes' if r['fits'] else 'NO ':<4}" + (f" {r.get('overlap_pairs', 0):>6}" if a2a else "")
              + f"  {r.get('layout', '')}")
    for r in rows:
        if "error" in r:
            print(f"{'-':>3}  {_label(r):<{w}} n/a: {r['error']}")
    fitting = [r for r in ok if r["fits"]]
    print()
    if not ok:
        errors = [r["error"] for r in rows if "error" in r]
        print(f"no schedule can be built for this model and pipeline: {errors[0] if errors else 'no rows'}")
        return
    if not fitting:
        print(f"no schedule fits {args.gpu_memory_gb:g} GiB per GPU: more pipeline or tensor parallelism, "
              "--use-distributed-optimizer or fewer microbatches in flight would help")
        return
    best, rest = fitting[0], fitting[1:]
    pv = " --enable-optimizer-post-validation" if args.optimizer_post_validation else ""
    print(f"suggested flags ({_label(best)}, the fastest that fits; of equally fast ones the least memory), "
          "ready to paste into your Megatron command:")
    print(f"  {best['flags']}{pv}")
    if rest:
        print("the other schedules that fit:")
        width = max(len(_label(r)) for r in rest)
        for r in rest:
            print(f"  {_label(r):<{width}}  {r['flags']}{pv}")
    for r in fitting:
        lim = r.get("memory_limit_microbatches")
        if lim:
            unit = r["activation_unit_bytes"] / gib
            need = max(r["activation_bytes"]) / r["activation_unit_bytes"]
            # the limit is its peak rounded up (``core.plan.row``), or the budget's room where the row was
            # searched quickly or a schedule built under its peak is slower
            what = "what it needs" if lim <= P.needed_limit(need) + 1e-9 else \
                f"the room the budget leaves (its schedule peaks at {need:.2f})"
            print(f"{r['schedule']}: --zero-bubble-memory-limit counts microbatches: {lim:g} x {unit:.2f} GiB "
                  f"(one microbatch's activations on the fullest rank) = {lim * unit:.1f} GiB, {what}")
    if within is not None:
        print(f"within Megatron 1F1B's memory ({within['budget_gib']:.1f} GiB on its fullest rank): {_label(within)}, "
              f"{100 * within['bubble_rate']:.1f}% bubble, {within['throughput_vs_1f1b']:.3f}x 1f1b, peak "
              f"{max(within['peak_bytes']) / gib:.1f} GiB:")
        print(f"  {within['flags']}{pv}")
    if advice:
        print(advice)
    print_optimizer_offload(rows, args)


def _label(r: dict) -> str:
    """A row's name in the table: the schedule (an interleaved one's chunks per rank: 'x4'), '+vocab'
    with vocabulary parallelism (2 barriers: '+vocab2')."""
    v = r.get("vocab_parallel")
    quick = "~" if r.get("search_effort") == "quick" else ""
    chunks = f" x{r['chunks']}" if get(r["schedule"]).chunks is None and r.get("chunks") else ""  # interleaved
    return quick + r["schedule"] + chunks + ("" if not v else " +vocab" if v == 1 else " +vocab2") + \
        ("+emb" if r.get("vocab_embedding") else "") + (" +rc" if r.get("recompute_layers") else "") + \
        (" +off" if r.get("offload") else "")
