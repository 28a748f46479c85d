"""The rank side of a verification: the non-pipelined reference (rank 0) and the pipelined run
through ``megatron_zb.megatron.install`` (every rank), with identical weights and data; what each
rank returns for the parent's comparison (``verify.harness``)."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Dict

from ...megatron.execution.finalize import configure_grad_sync
from ..case import PSEUDO_SCHEDULES, VerifyCase, reference_key, reference_overrides
from .sequential import SequentialForwardBackward

__all__ = ["rank_case", "install_case", "forward_backward_func"]

_REFERENCE_CACHE: Dict[tuple, dict] = {}

def _reference_finalize(model, num_tokens=None, *args, **kwargs) -> None:
    """The reference's finalize: only the per-token-loss scaling (one process, one replica)."""
    if num_tokens is not None and int(num_tokens) > 0:
        for m in model:
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / num_tokens)


def _run_reference(case: VerifyCase) -> dict:
    """PP=1, TP=1, full model on this process; megatron's forward_backward_no_pipelining."""
    import torch
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from ..processes.rankio import set_status
    from . import tinygpt as M
    cfg = case.model_config()
    dev = _device(case)
    ref = M.build_reference_model(cfg, **reference_overrides(case))
    if dev is not None:
        ref = ref.to(dev)
    ref.config.finalize_model_grads_func = _reference_finalize
    losses, grads, params, times, aux = [], [], [], [], []
    m = case.num_microbatches * case.data_parallel_size  # every data-parallel replica's microbatches
    M.take_aux_losses()
    for it in range(case.iterations):
        set_status(f"reference: iteration {it}")
        M.zero_grads_([ref])
        batches = _on(M.make_batches(cfg, m, it), dev)
        t0 = time.perf_counter()
        out = forward_backward_no_pipelining(
            forward_step_func=M.forward_step_func, data_iterator=iter(batches), model=ref,
            num_microbatches=m, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length,
            forward_only=case.forward_only)
        times.append(time.perf_counter() - t0)
        losses.append(M.iteration_loss(out))
        aux.append(M.take_aux_losses())
        if not case.forward_only:
            grads.append(M.collect_full_grads([ref]))
            if case.use_distributed_optimizer:
                if it == 0:
                    adam = torch.optim.AdamW(ref.parameters(), **_ADAM)
                adam.step()
            else:
                M.sgd_step_([ref], case.lr)
        else:
            grads.append({})
    del ref
    return {"losses": losses, "grads": grads, "times": times, "aux_losses": aux}


def _device(case: VerifyCase):
    """None on CPU; with ``device="cuda"`` this rank's GPU (``verify.processes.cuda_gloo``: ranks may share it,
    their messages staged through the host over gloo). ``MZB_VERIFY_STAGE_P2P=1`` stages them on CPU too."""
    from ..processes import cuda_gloo
    if case.device == "cuda":
        return cuda_gloo.use_cuda()
    if os.environ.get(cuda_gloo.STAGE_ENV) == "1":
        cuda_gloo.apply(stage_host=True)
    return None


def _on(batches, dev):
    """The microbatches on ``dev`` (unchanged for None)."""
    if dev is None:
        return batches
    return [{k: (v.to(dev) if hasattr(v, "to") else v) for k, v in b.items()} for b in batches]


@contextlib.contextmanager
def _profiled(case: VerifyCase, rank: int, on: bool):
    """With ``case.profile_dir``: torch's profiler around the block (CUDA kernels too on a GPU), its
    Chrome trace written to ``<profile_dir>/rank<r>.json``."""
    if not (on and case.profile_dir):
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = case.device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(case.profile_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(case.profile_dir, f"rank{rank}.json"))


def rank_case(case: VerifyCase) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ...megatron.layout import placement as _pl
    from ..processes.rankio import set_status
    from . import tinygpt as M

    t_start = time.perf_counter()
    rank = dist.get_rank()
    tag = case.describe()
    # DDP's per-bucket parameter lists (INFO once megatron.training configured logging) would fill
    # the rank logs that a failure or a timeout quotes
    logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)
    # 1. the reference, on rank 0 (cached per launch for identical model/data)
    if case.optimizer is not None:
        return _rank_optimizer_case(case, t_start)
    set_status(f"[{tag}] reference: setting up")
    dev = _device(case)  # before megatron seeds its CUDA generators
    M.init_parallel_state(1, 1, seed=case.seed)
    reference = None
    if rank == 0:
        key = reference_key(case)
        if key not in _REFERENCE_CACHE:
            _REFERENCE_CACHE[key] = _run_reference(case)
        reference = _REFERENCE_CACHE[key]
    # 2. the pipelined run
    set_status(f"[{tag}] pipelined: initialising parallel state (other ranks may still run the reference)")
    placement = _pl.make_placement(case.placement, case.pipeline_parallel_size, case.chunks)
    M.init_parallel_state(case.tensor_parallel_size, case.pipeline_parallel_size, placement, seed=case.seed,
                          vocab_parallel=bool(case.vocab_parallel),
                          expert_model_parallel_size=case.expert_model_parallel_size)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cfg = case.model_config()
    handle = None
    try:
        overrides = {**case.model_overrides(), **case.run_overrides(), **case.config_overrides}
        if case.schedule == "megatron-interleaved" and case.pipeline_parallel_size == 2:
            # megatron's batched p2p at PP=2 + VPP pairs the two same-peer sends ambiguously
            overrides.setdefault("overlap_p2p_comm", True)
            overrides.setdefault("batch_p2p_comm", False)
        if case.schedule not in PSEUDO_SCHEDULES:
            set_status(f"[{tag}] installing schedule {case.schedule}")
            handle = install_case(case)
        set_status(f"[{tag}] building model chunks")
        chunks = M.build_model_chunks(cfg, placement, M.ChunkOptions(
                                          layers_per_stage=case.layers_per_stage,
                                          allow_padding_num_layers=case.allow_padding_num_layers,
                                          vocab_parallel=bool(case.vocab_parallel),
                                          vocab_embedding=case.vocab_embedding,
                                          recompute_layers=case.recompute_counts),
                                      sequence_parallel=case.sequence_parallel,
                                      gradient_accumulation_fusion=case.gradient_accumulation_fusion, **overrides)
        config = chunks[0].config
        if dev is not None:
            chunks = [c.to(dev) for c in chunks]
        if case.ddp:
            chunks = M.wrap_ddp(chunks, overlap_grad_reduce=case.overlap_grad_reduce,
                                use_distributed_optimizer=case.use_distributed_optimizer)
        configure_grad_sync(config, chunks, placement=placement, ddp=case.ddp,
                              overlap_grad_reduce=case.overlap_grad_reduce)
        optimizer = _distributed_adam(chunks) if case.use_distributed_optimizer else None
        fb = forward_backward_func(case, placement)
        infos = [_pl.unwrap(c).mzb_chunk_info for c in chunks]
        holds_last = pp_rank == placement.loss_rank  # replicated stages: the loss rank gets every path's losses
        dp_rank = parallel_state.get_data_parallel_rank()
        keep_params = placement.replicated
        losses, loss_parts, grads, params, times, offload, aux = [], [], [], [], [], [], []
        memory = None  # the last iteration's measured and predicted activation peak
        pairs = 0  # overlapped F&B pairs run as one pass (megatron's schedule plans), last iteration
        balanced = []  # --zero-bubble-balance-microbatches: per iteration, each replica's microbatch count
        M.take_aux_losses()  # the reference's, or an earlier case's, are not this run's
        m = case.num_microbatches
        for it in range(case.iterations):
            set_status(f"[{tag}] pipelined: iteration {it} forward-backward")
            M.zero_grads_(chunks)
            if optimizer is not None:
                optimizer.zero_grad()
            batches = M.make_batches(cfg, m * case.data_parallel_size, it)[dp_rank * m:(dp_rank + 1) * m]
            iters = M.batch_iterators(_on(batches, dev), len(chunks))
            dist.barrier()  # time the schedule, not the ranks' skew
            t0 = time.perf_counter()
            with _profiled(case, rank, it == case.iterations - 1):
                out = fb(forward_step_func=M.forward_step_func, data_iterator=iters, model=list(chunks),
                         num_microbatches=case.num_microbatches, seq_length=cfg.seq_length,
                         micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length,
                         forward_only=case.forward_only)
                if dev is not None:
                    torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            aux.append(M.take_aux_losses())  # summed over every rank (TP ranks hold shares under SP)
            fbo = getattr(handle, "forward_backward", None)
            if getattr(fbo, "memory", None) is not None:
                memory = fbo.memory
            pairs = getattr(fbo, "overlapped_pairs", 0)
            if getattr(fbo, "balancer", None) is not None and fbo.balancer.last is not None:
                balanced.append({"microbatches_per_replica": fbo.balancer.last.microbatches_per_replica,
                                 "plan_seconds": fbo.balancer.last.plan_seconds,
                                 "calibrated": fbo.balancer.calibrated})
            stats = getattr(fbo, "offload_stats", None)
            if stats is not None:
                offload.append(dict(stats))
            if holds_last and tp_rank == 0:
                losses.append(M.iteration_loss(out))
                loss_parts.append(M.iteration_loss_parts(out))
            if not case.forward_only:
                set_status(f"[{tag}] pipelined: iteration {it} gathering gradients")
                if optimizer is not None:
                    _gather_grad_shards(chunks)
                grads.append(M.collect_full_grads(chunks))
                if optimizer is not None:
                    ok, _, _ = optimizer.step()
                    if not ok:
                        raise RuntimeError(f"megatron's optimizer step failed at iteration {it}")
                else:
                    M.sgd_step_(chunks, case.lr)
                params.append(M.collect_full_grads(chunks, params=True) if keep_params else {})
            else:
                grads.append({})
                params.append({})
    finally:
        if handle is not None:
            handle.uninstall()
    set_status(f"[{tag}] done")
    reports = holds_last and tp_rank == 0
    return {"rank": rank, "pp_rank": pp_rank, "tp_rank": tp_rank, "dp_rank": dp_rank, "reference": reference,
            "losses": losses if reports else None, "loss_parts": loss_parts if reports else None,
            "grads": grads, "params": params, "times": times, "aux_losses": aux, "memory": memory,
            "overlapped_pairs": pairs, "balanced": balanced,
            "wall_s": time.perf_counter() - t_start, "megatron_version": M.megatron_version(), "offload": offload,
            "stages": [i.stage for i in infos], "layers": [list(i.layers) for i in infos]}


# Adam for the distributed-optimizer cases (the reference runs torch's AdamW, megatron's Adam on a CPU)
_ADAM = dict(lr=0.01, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)


def _distributed_adam(chunks):
    """megatron's DistributedOptimizer (Adam, no weight decay or clipping) over the DDP chunks."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ocfg = OptimizerConfig(optimizer="adam", lr=_ADAM["lr"], min_lr=_ADAM["lr"], weight_decay=0.0,
                           adam_beta1=_ADAM["betas"][0], adam_beta2=_ADAM["betas"][1], adam_eps=_ADAM["eps"],
                           clip_grad=0.0, use_distributed_optimizer=True, bf16=False, fp16=False,
                           params_dtype=torch.float32)
    return get_megatron_optimizer(ocfg, list(chunks), use_gloo_process_groups=False)


def _gather_grad_shards(chunks) -> None:
    """After a reduce-scatter each data-parallel rank holds only its shard of every bucket reduced:
    zero the rest and sum over data parallelism, so every rank holds the whole reduced gradient
    (its own shard is unchanged, which is all the optimizer reads)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    group = parallel_state.get_data_parallel_group()
    d, n = dist.get_rank(group), dist.get_world_size(group)
    for c in chunks:
        for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
            for bucket in buf.buckets:
                g = bucket.grad_data
                size = g.numel() // n
                g[:d * size].zero_()
                g[(d + 1) * size:].zero_()
                dist.all_reduce(g, group=group)


def install_case(case: VerifyCase, **extra):
    try:
        from ...megatron.install import install
    except ImportError as e:
        raise RuntimeError(f"schedule {case.schedule!r} needs megatron_zb.megatron.install, which is not "
                           f"available ({e}); the pseudo-schedules {', '.join(PSEUDO_SCHEDULES)} work without it")
    kw = dict(case.schedule_options)
    kw.setdefault("measure_memory", True)  # runtime.observe.memory: verify reports measured vs predicted peaks
    if case.offload_ratio is not None:  # on a GPU: CUDA copy streams; else the synchronous CPU test mode
        kw.update(offload_ratio=case.offload_ratio, offload_time=case.offload_time,
                  offload_overlap=not case.offload_half_duplex, offload_cpu_test=case.device != "cuda")
    if case.ep_overlap:
        kw["ep_overlap"] = True
    if case.vocab_parallel:
        kw["vocab_parallel"] = case.vocab_parallel
        if case.vocab_embedding:
            kw["vocab_embedding"] = True
    kw.update(extra)
    return install(case.schedule, chunks=case.chunks, memory_limit=case.memory_limit, **kw)


def _rank_optimizer_case(case: VerifyCase, t_start: float) -> dict:
    """An optimizer case on this rank: the synchronous and (optionally) post-validated runs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ...megatron.layout import placement as _pl
    from ..processes.rankio import set_status
    from . import tinygpt as M
    from .optimizer_cases import rank_runs
    logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)
    logging.getLogger("megatron.core.optimizer").setLevel(logging.WARNING)
    placement = _pl.make_placement(case.placement, case.pipeline_parallel_size, case.chunks)

    def install_fn(c, post_validation):
        if c.schedule in PSEUDO_SCHEDULES:
            return None
        return install_case(c, **({"post_validation": True} if post_validation else {}))
    runs = rank_runs(case, placement, install_fn, forward_backward_func)
    set_status(f"[{case.describe()}] done")
    return {"rank": dist.get_rank(), "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "reference": None, "runs": runs,
            "wall_s": time.perf_counter() - t_start, "megatron_version": M.megatron_version()}


def forward_backward_func(case: VerifyCase, placement):
    from megatron.core.pipeline_parallel import schedules as S
    if case.schedule == "megatron-1f1b":
        return S.forward_backward_pipelining_without_interleaving
    if case.schedule == "megatron-interleaved":
        return S.forward_backward_pipelining_with_interleaving
    if case.schedule == "sequential":
        return SequentialForwardBackward(placement)
    import megatron.core.pipeline_parallel as mpp
    return mpp.get_forward_backward_func()
