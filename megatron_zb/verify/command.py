"""`megatron-zb verify`: the command line of the verification harness (``verify.harness``).

Exit codes: 0 passed, 1 failed (or a rank crashed / hung), 2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

from ..argtypes import int_at_least, nonneg, positive_float, positive_int, share_or_auto
from ..megatron.features.flags.attention import ATTENTION_BACKENDS
from ..megatron.features.flags.recompute import parse_counts
from .case import DEFAULT_GRAD_RTOL, DEFAULT_LOSS_ATOL, PSEUDO_SCHEDULES, VerifyUsageError, make_case
from .harness import run_verify_many

__all__ = ["main_verify"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise VerifyUsageError(f"{self.prog}: {message}")


def _build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="megatron-zb verify",
                 description="Train a tiny megatron-core GPT on P x T x D CPU processes with a pipeline schedule and "
                             "compare losses and gradients with the non-pipelined single-process reference.")
    ap.add_argument("--schedule", required=True,
                    help="a megatron-zb schedule (installed through megatron_zb.megatron.install) or one of "
                         + ", ".join(PSEUDO_SCHEDULES))
    ap.add_argument("--pipeline-parallel-size", "-p", type=positive_int("--pipeline-parallel-size"), required=True)
    ap.add_argument("--tensor-parallel-size", "-t", type=positive_int("--tensor-parallel-size"), default=1)
    ap.add_argument("--data-parallel-size", "-d", type=positive_int("--data-parallel-size"), default=1,
                    help="data-parallel replicas (world size P x T x D); the reference trains on all their microbatches")
    ap.add_argument("--use-distributed-optimizer", action="store_true",
                    help="megatron's DistributedOptimizer: alone, it steps with Adam instead of SGD and gradients are "
                         "compared (ZeroPP's sharded data parallelism); with --optimizer it is that optimizer's "
                         "DistributedOptimizer")
    ap.add_argument("--num-microbatches", "-m", type=positive_int("--num-microbatches"), default=None,
                    help="per data-parallel replica; default 2 x pipeline size")
    ap.add_argument("--iterations", "-n", type=positive_int("--iterations"), default=3)
    ap.add_argument("--chunks", "-v", type=positive_int("--chunks"), default=None, help="model chunks per rank")
    ap.add_argument("--placement", choices=("single", "looped", "v"), default=None,
                    help="only for --schedule sequential")
    ap.add_argument("--num-layers", type=positive_int("--num-layers"), default=None)
    ap.add_argument("--allow-padding-num-layers", action="store_true",
                    help="first and last stage get one layer less when layers do not split evenly")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--no-ddp", action="store_true", help="plain autograd grads instead of megatron DDP")
    ap.add_argument("--overlap-grad-reduce", action="store_true")
    ap.add_argument("--gradient-accumulation-fusion", action="store_true")
    ap.add_argument("--variable-seq-lengths", action="store_true")
    ap.add_argument("--micro-batch-size", type=positive_int("--micro-batch-size"), default=2,
                    help="sequences per microbatch (default 2; with --variable-seq-lengths a microbatch's rows share "
                         "its length)")
    ap.add_argument("--zero-bubble-balance-microbatches", action="store_true",
                    help="with --variable-seq-lengths: each iteration's global batch (skewed lengths) balanced over the "
                         "data-parallel replicas and microbatches, replicas running different microbatch counts, the "
                         "loss normalised over the global token count (the reference's too)")
    ap.add_argument("--zero-bubble-pack-sequences", action="store_true",
                    help="with --zero-bubble-balance-microbatches: each balanced microbatch in Megatron's packed-sequence "
                         "format (THD: its sequences one after another, attention within each; the CPU model's "
                         "attention takes it as TE's does on a GPU)")
    ap.add_argument("--untied", action="store_true", help="untie embedding and output weights")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--memory-limit", type=nonneg("--memory-limit"), default=None,
                    help="passed to install() (zb-auto, v-auto)")
    ap.add_argument("--search-effort", choices=("full", "quick"), default="full",
                    help="passed to install(): how hard the searched schedules look and how many ways vocabulary "
                         "passes are placed (training's --zero-bubble-search-effort; default full)")
    ap.add_argument("--offload-ratio", type=share_or_auto("--offload-ratio"), default=None, metavar="R|auto",
                    help="train with activation offload (CPU test mode: synchronous copies to separate CPU "
                         "buffers): this share of each rank's activations, or 'auto' (as little as fits "
                         "--memory-limit)")
    ap.add_argument("--offload-time", type=_offload_time, default=0.25, metavar="K|auto",
                    help="transfer time the schedule core plans with, in F+B of a stage (default 0.25); 'auto': "
                         "measured at the first iteration (here: CPU memcpy and matmul stand-ins)")
    ap.add_argument("--offload-half-duplex", action="store_true", help="one copy queue instead of two")
    vg = ap.add_argument_group("vocabulary parallelism (the output layer and loss spread over every pipeline rank)")
    vg.add_argument("--enable-vocab-parallel", action="store_true",
                    help="the output layer as every rank's vocabulary shard, its passes placed by the schedule core")
    vg.add_argument("--disable-backward-fusion", action="store_true",
                    help="with --enable-vocab-parallel: two barriers per microbatch instead of one")
    vg.add_argument("--split-vocab-embedding", action="store_true",
                    help="with --enable-vocab-parallel: the input embedding split over the pipeline ranks too")
    lay = ap.add_argument_group("Megatron's model layout (read in pipeline order, under every schedule; a V's 2P "
                                "stages are ranks 0..P-1 then P-1..0)")
    lay.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                     help="e.g. 'E|(tt|)*3,t|L': E embedding, t transformer layer, m MTP layer, L loss, | between stages")
    for which in ("first", "last"):
        lay.add_argument(f"--decoder-{which}-pipeline-num-layers", default=None, metavar="N",
                         type=int_at_least(f"--decoder-{which}-pipeline-num-layers", 0),
                         help=f"layers of the {which} pipeline rank (the others share the rest evenly)")
    lay.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                     help="the embedding counts as one layer: its chunk holds one layer less")
    lay.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                     help="the loss counts as one layer: its chunk holds one layer less")
    f = ap.add_argument_group("Megatron's model features (Megatron's flag names; the reference trains the same model "
                              "non-pipelined, without expert parallelism or recompute)")
    f.add_argument("--num-experts", type=positive_int("--num-experts"), default=None,
                   help="MoE: experts per layer (megatron's SequentialMLP of local experts)")
    f.add_argument("--expert-model-parallel-size", type=positive_int("--expert-model-parallel-size"), default=1,
                   help="experts sharded over this many data-parallel ranks (must divide --data-parallel-size)")
    f.add_argument("--moe-router-topk", type=positive_int("--moe-router-topk"), default=2)
    f.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (Megatron requires it with --moe-router-topk 1)")
    f.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall")
    f.add_argument("--moe-aux-loss-coeff", type=nonneg("--moe-aux-loss-coeff"), default=0.0,
                   help="load-balancing loss coefficient (compared per layer with the reference's)")
    f.add_argument("--moe-ffn-hidden-size", type=positive_int("--moe-ffn-hidden-size"), default=None)
    f.add_argument("--moe-shared-expert-intermediate-size", type=positive_int("--moe-shared-expert-intermediate-size"),
                   default=None, help="shared experts of this size beside the routed ones")
    f.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="Megatron's EP all-to-all overlap: every pass through megatron-core's schedule plans, the "
                        "schedule's overlapped F&B pairs as one pass (schedules with pairs; EP >= 2, alltoall)")
    f.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="the core attention without Transformer Engine: flash or fused = torch's "
                        "scaled_dot_product_attention (its math or CPU kernels here); local, unfused or auto (default) "
                        "= megatron's DotProductAttention")
    f.add_argument("--num-query-groups", type=positive_int("--num-query-groups"), default=None,
                   help="grouped-query attention: key/value heads (Megatron's --group-query-attention "
                        "--num-query-groups N; the tiny GPT has 4 attention heads)")
    f.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    f.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    f.add_argument("--recompute-num-layers", type=positive_int("--recompute-num-layers"), default=None)
    f.add_argument("--zero-bubble-recompute-num-layers", type=parse_counts, default=None, metavar="N0,N1,...",
                   help="with --recompute-granularity full --recompute-method block: each model chunk's own number of "
                        "first layers recomputed in B, one per pipeline rank or one per model chunk in pipeline order")
    f.add_argument("--mtp-num-layers", type=positive_int("--mtp-num-layers"), default=None,
                   help="multi-token prediction layers (one-chunk schedules, with --untied; rotary positions)")
    o = ap.add_argument_group("Megatron's optimizer (instead of the harness's plain SGD step)")
    o.add_argument("--optimizer", choices=("adam", "sgd"), default=None,
                   help="train with megatron.core.optimizer (get_megatron_optimizer); the reference is one process "
                        "with the same optimizer")
    o.add_argument("--optimizer-post-validation", action="store_true",
                   help="also train with optimizer post-validation (implies --optimizer adam) and require it to be "
                        "bit-identical to the synchronous pipelined run")
    o.add_argument("--optimizer-offload", type=share_or_auto("--optimizer-offload"), default=None, metavar="F|auto",
                   help="Megatron's --optimizer-cpu-offload: this fraction of every rank's optimizer state on the "
                        "host (--optimizer-offload-fraction F), or 'auto': each rank its own share "
                        "(docs/optimizer_offload.md); the reference is one process with the same flags")
    o.add_argument("--zero-bubble-optimizer-offload", choices=("trough",), default=None,
                   help="the host-resident states (--optimizer-offload F, default 1: all) visit the GPU in each rank's "
                        "troughs as the core's trough plan says (implies --optimizer adam); the reference keeps "
                        "Megatron's static offload")
    o.add_argument("--clip-grad", type=nonneg("--clip-grad"), default=0.0, help="Megatron's clip_grad (default 0: off)")
    o.add_argument("--inject-nonfinite-at", type=int_at_least("--inject-nonfinite-at", 0), default=None, metavar="ITER",
                   help="put an inf into one gradient at this iteration (Megatron then skips the step; needs a "
                        "loss scaler: --fp16, or --bf16 / --use-distributed-optimizer, which get --loss-scale 1)")
    o.add_argument("--bf16", action="store_true")
    o.add_argument("--fp16", action="store_true", help="fp16 with Megatron's dynamic loss scaler")
    o.add_argument("--loss-scale", type=positive_float("--loss-scale"), default=None,
                   help="constant loss scale (Megatron's --loss-scale)")
    o.add_argument("--lr", type=positive_float("--lr"), default=1e-3, help="the optimizer's learning rate (default 1e-3)")
    o.add_argument("--param-rtol", type=positive_float("--param-rtol"), default=None,
                   help="final parameters vs the reference (default 1e-3; 0.1 for bf16/fp16)")
    ap.add_argument("--grad-rtol", type=positive_float("--grad-rtol"), default=DEFAULT_GRAD_RTOL)
    ap.add_argument("--loss-atol", type=positive_float("--loss-atol"), default=DEFAULT_LOSS_ATOL)
    ap.add_argument("--timeout", type=positive_float("--timeout"), default=300.0,
                    help="seconds for the whole run (default 300)")
    ap.add_argument("--mcore-path", default=None, help="a directory holding another megatron-core (megatron/core)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the flags and build the schedule (its simulated bubble and peak), start no process")
    return ap


# Largest verification: processes (P x T x D) and stage-microbatches, and the memory a rank takes
MAX_PROCESSES = 64
MAX_STAGE_MICROBATCHES = 4096
RANK_BYTES = 400 << 20  # a rank with torch and megatron imported, the tiny GPT, gloo buffers


def _check_size(a) -> None:
    """Refuse in one line, before any process starts, what this machine cannot run."""
    world = a.pipeline_parallel_size * a.tensor_parallel_size * a.data_parallel_size
    if world > MAX_PROCESSES:
        raise VerifyUsageError(f"{world} processes (--pipeline-parallel-size x --tensor-parallel-size x "
                               f"--data-parallel-size) is more than verify starts (at most {MAX_PROCESSES})")
    m = a.num_microbatches or 2 * a.pipeline_parallel_size
    n = a.pipeline_parallel_size * m * (a.chunks or 2)
    if n > MAX_STAGE_MICROBATCHES:
        raise VerifyUsageError(f"{n} stage-microbatches (pipeline size x microbatches x chunks) is more than a tiny-GPT "
                               f"check needs (at most {MAX_STAGE_MICROBATCHES}); use fewer microbatches")
    if a.inject_nonfinite_at is not None and a.inject_nonfinite_at >= a.iterations:
        raise VerifyUsageError(f"--inject-nonfinite-at {a.inject_nonfinite_at} is not one of the {a.iterations} "
                               f"iterations (0..{a.iterations - 1})")
    try:
        import psutil
        avail = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001 - no psutil: no memory check
        return
    need = (world + 1) * RANK_BYTES
    if need > avail:
        raise VerifyUsageError(f"{world} processes need about {need / 2**30:.1f} GiB and this machine has "
                               f"{avail / 2**30:.1f} GiB available; use fewer ranks")


def _layout(a):
    """(--num-layers, layers per stage or None) from the layout flags, read for the schedule's
    placement (``megatron.layout.layout_args``, as training reads them)."""
    from ..core.ir import Placement
    from ..megatron.errors import ZeroBubbleArgumentError
    from ..megatron.layout.layout_args import given_layout_flags, layout_from_args
    from .case import schedule_placement
    if not given_layout_flags(a):
        return a.num_layers, None
    if a.schedule in PSEUDO_SCHEDULES and a.schedule != "sequential":
        raise VerifyUsageError(f"the layout flags apply to megatron-zb's schedules and sequential, not {a.schedule}")
    if a.schedule == "sequential":
        style, chunks = a.placement or "single", a.chunks or (2 if a.placement in ("v", "looped") else 1)
    else:
        style, chunks = schedule_placement(a.schedule, a.chunks)
    p = a.pipeline_parallel_size
    pl = {"single": lambda: Placement.single(p), "looped": lambda: Placement.looped(p, chunks),
          "v": lambda: Placement.vshape(p), "bitpipe": lambda: Placement.bitpipe(p)}[style]()
    ns = argparse.Namespace(**vars(a))
    if ns.num_layers is None and ns.pipeline_model_parallel_layout is not None:
        from ..core.costs.layout import parse
        from ..core.ir import ScheduleError
        try:
            ns.num_layers = parse(ns.pipeline_model_parallel_layout).num_layers
        except ScheduleError as e:
            raise VerifyUsageError(str(e)) from None
    if ns.num_layers is None:
        raise VerifyUsageError(f"{given_layout_flags(a)[0]} needs --num-layers")
    try:
        layout = layout_from_args(ns, pl)
    except ZeroBubbleArgumentError as e:
        raise VerifyUsageError(str(e)) from None
    return ns.num_layers, layout.layers()


def _offload_time(text):
    if str(text).strip().lower() == "auto":
        return "auto"
    return nonneg("--offload-time")(text)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3e}"


def main_verify(argv: Optional[Sequence[str]] = None) -> int:
    """`megatron-zb verify ...`: 0 passed, 1 failed (or a rank crashed / hung), 2 bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = _build_parser().parse_args(argv)
        if a.disable_backward_fusion and not a.enable_vocab_parallel:
            raise VerifyUsageError("--disable-backward-fusion needs --enable-vocab-parallel")
        if a.placement is not None and a.schedule != "sequential":
            raise VerifyUsageError("--placement only applies to --schedule sequential")
        _check_size(a)
        if a.mcore_path is not None:
            from .processes.launch import LaunchError, resolve_mcore_path
            try:
                resolve_mcore_path(a.mcore_path)
            except LaunchError as e:
                raise VerifyUsageError(str(e)) from None
        num_layers, layers_per_stage = _layout(a)
        opts = dict(chunks=a.chunks, placement=a.placement, num_layers=num_layers, layers_per_stage=layers_per_stage,
                    allow_padding_num_layers=a.allow_padding_num_layers, sequence_parallel=a.sequence_parallel,
                    ddp=not a.no_ddp, overlap_grad_reduce=a.overlap_grad_reduce,
                    gradient_accumulation_fusion=a.gradient_accumulation_fusion,
                    variable_seq_lengths=a.variable_seq_lengths, tie_embeddings=not a.untied,
                    forward_only=a.forward_only, memory_limit=a.memory_limit, grad_rtol=a.grad_rtol,
                    loss_atol=a.loss_atol, data_parallel_size=a.data_parallel_size, optimizer=a.optimizer,
                    post_validation=a.optimizer_post_validation, clip_grad=a.clip_grad,
                    optimizer_offload=a.optimizer_offload,
                    optimizer_trough=a.zero_bubble_optimizer_offload == "trough",
                    inject_nonfinite_at=a.inject_nonfinite_at, bf16=a.bf16, fp16=a.fp16,
                    use_distributed_optimizer=a.use_distributed_optimizer, loss_scale=a.loss_scale,
                    optimizer_lr=a.lr, param_rtol=a.param_rtol,
                    offload_ratio=a.offload_ratio, offload_time=a.offload_time,
                    offload_half_duplex=a.offload_half_duplex, num_experts=a.num_experts,
                    expert_model_parallel_size=a.expert_model_parallel_size, moe_router_topk=a.moe_router_topk,
                    moe_router_pre_softmax=a.moe_router_pre_softmax,
                    vocab_parallel=(2 if a.disable_backward_fusion else 1) if a.enable_vocab_parallel else None,
                    vocab_embedding=a.split_vocab_embedding,
                    moe_token_dispatcher_type=a.moe_token_dispatcher_type, moe_aux_loss_coeff=a.moe_aux_loss_coeff,
                    moe_ffn_hidden_size=a.moe_ffn_hidden_size,
                    moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
                    recompute_granularity=a.recompute_granularity,
                    recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers,
                    recompute_counts=a.zero_bubble_recompute_num_layers and list(a.zero_bubble_recompute_num_layers),
                    mtp_num_layers=a.mtp_num_layers, ep_overlap=a.overlap_moe_expert_parallel_comm,
                    balance_microbatches=a.zero_bubble_balance_microbatches, micro_batch_size=a.micro_batch_size,
                    pack_sequences=a.zero_bubble_pack_sequences, attention_backend=a.attention_backend)
        if a.num_query_groups is not None:
            opts["config_overrides"] = {"num_query_groups": a.num_query_groups}
        if a.search_effort != "full":
            opts["schedule_options"] = {"effort": a.search_effort}
        case = make_case(a.schedule, a.pipeline_parallel_size, a.tensor_parallel_size, a.num_microbatches,
                         a.iterations, **opts)
        g = a.num_query_groups
        if g is not None and (case.num_attention_heads % g or g % a.tensor_parallel_size):
            raise VerifyUsageError(f"--num-query-groups {g} must divide the {case.num_attention_heads} attention heads "
                                   f"and be divisible by --tensor-parallel-size {a.tensor_parallel_size}")
    except VerifyUsageError as e:
        msg = str(e).splitlines()[0] if str(e) else "bad input"
        if not msg.startswith("megatron-zb verify"):
            msg = f"megatron-zb verify: {msg}"
        print(msg, file=sys.stderr)
        return 2
    print(f"megatron-zb verify: {case.describe()} on {case.world_size} CPU process(es), "
          f"{case.iterations} iteration(s)", flush=True)
    if a.dry_run:
        return _dry_run(case, a.json)
    res = run_verify_many([case], timeout=a.timeout, mcore_path=a.mcore_path)[0]
    if res.get("error_type") == "MegatronConfigRefused":  # found before any rank started
        print(f"megatron-zb verify: {res['error']}", file=sys.stderr)
        return 2
    if res.get("error"):
        print(f"ERROR ({res['error_type']}): {res['error']}")
    else:
        print(f"megatron-core {res.get('megatron_core')}")
        for row in res["per_iteration"]:
            line = (f"iteration {row['iteration']}: loss {_loss(row['loss'])} (reference {_loss(row['reference_loss'])}, "
                    f"|diff| {_fmt(row['abs_loss_diff'])})")
            if "max_rel_grad_diff" in row:
                line += f", max rel grad diff {_fmt(row['max_rel_grad_diff'])}"
            if "max_abs_aux_loss_diff" in row:
                line += f", aux loss {sum(row.get('aux_losses', {}).values()):.6f} (|diff| {_fmt(row['max_abs_aux_loss_diff'])})"
            print(line)
        for p in res["problems"]:
            print(f"problem: {p}")
        if case.optimizer:
            print(f"megatron optimizer: {res.get('skipped_iterations')} skipped step(s), "
                  f"{res.get('clipped_iterations')} clipped in the reference; max rel param diff "
                  f"{_fmt(res.get('max_rel_param_diff'))} (tol {case.param_rtol:g})")
            if case.post_validation:
                print(f"post-validation: {res.get('rollbacks')} rollback(s); bit-identical to the synchronous "
                      f"pipelined run: {'yes' if res.get('bit_identical_to_synchronous') else 'NO'}")
            if res.get("offloaded"):
                print("optimizer state on the host: " + ", ".join(
                    f"rank {r} {h}/{t} ({h / max(t, 1):.0%})" for r, (h, t) in sorted(res["offloaded"].items())))
            for r, by_mode in sorted((res.get("trough") or {}).items()):
                t = by_mode.get("synchronous") or {}
                for line in t.get("plans") or []:
                    print(f"optimizer states in the troughs, {line}; {t.get('visited')} visit(s), "
                          f"{t.get('synchronous_visits')} copied at the step")
        w = res.get("worst_param")
        if w and not case.forward_only and not case.optimizer:
            print(f"worst gradient: {w['param']} (rank {w['rank']}, iteration {w['iteration']}): "
                  f"{_fmt(w['rel_diff'])}")
        if case.ep_overlap:
            print(f"EP overlap: {res.get('overlapped_pairs')} overlapped F&B pair(s) per iteration ran as one pass "
                  "through megatron-core's schedule plans")
        for it, counts in enumerate(res.get("microbatches_per_replica", [])):
            print(f"balanced: iteration {it}: microbatches per replica {counts}, planned in "
                  f"{res['balance_plan_ms'][it]:.1f} ms")
        for o in res.get("offload", []):
            last = o["iterations"][-1] if o["iterations"] else {}
            print(f"offload rank {o['rank']}: peak resident activation {last.get('peak_resident_bytes', 0)} B, "
                  f"{last.get('captured_bytes_per_forward', 0)} B per F, offloaded {last.get('offloaded_bytes', 0)} B "
                  f"in {last.get('offloaded_parts', 0)} part(s), reloaded {last.get('reloaded_bytes', 0)} B")
        t = res["timing"]
        if case.optimizer:
            print(f"timing: median iteration {t.get('median_iteration_ms')} ms"
                  + (f" post-validated, {t.get('synchronous_median_iteration_ms')} ms synchronous"
                     if case.post_validation else "") + f", wall {t.get('launch_wall_s')} s")
        else:
            print(f"timing: median iteration {t.get('median_iteration_ms')} ms "
                  f"(reference {t.get('reference_median_iteration_ms')} ms), wall {t.get('launch_wall_s')} s")
        verdict = "PASSED" if res["passed"] else "FAILED"
        grad_part = "" if case.forward_only or case.optimizer else \
            f"max rel grad diff {_fmt(res['max_rel_grad_diff'])} (tol {case.grad_rtol:g}), "
        print(f"{verdict}: {grad_part}max abs loss diff {_fmt(res['max_abs_loss_diff'])} (tol {case.loss_atol:g})")
    if a.json:
        print(json.dumps(_jsonable(res), sort_keys=True))
    return 0 if res["passed"] else 1


def _dry_run(case, as_json: bool) -> int:
    """--dry-run: the schedule the run would build (a megatron-zb schedule; the pseudo-schedules
    need none), simulated with unit costs; no process starts."""
    from ..core import schedules as core_schedules
    from ..core.build import ScheduleRequest, build
    from ..core.ir import ScheduleError
    out = {"dry_run": True, "schedule": case.schedule, "world_size": case.world_size}
    if case.schedule in core_schedules.names():
        try:
            req = ScheduleRequest(case.schedule, chunks=case.chunks if core_schedules.get(case.schedule).chunks is None
                                  else None, memory_limit=case.memory_limit,
                                  effort=case.schedule_options.get("effort", "full"))
            res = build(req, case.pipeline_parallel_size, case.num_microbatches).result
        except ScheduleError as e:
            print(f"megatron-zb verify: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        out.update(bubble_rate=round(res.bubble_rate, 6), peak_memory=[round(x, 6) for x in res.peak_memory])
        print(f"schedule {case.schedule}: bubble {100 * res.bubble_rate:.1f}% at unit costs, peak activation "
              f"{max(res.peak_memory):g} microbatches; --dry-run: no process started")
    else:
        print("--dry-run: no process started")
    if as_json:
        print(json.dumps(out))
    return 0


def _loss(x) -> str:
    return "n/a" if x is None else f"{x:.6f}"


def _jsonable(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else (None if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
