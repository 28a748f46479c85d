"""What each rank runs in the GPU check's ``realpipe`` section (``benchmarks/gpu_check_realpipe.py``):
P pipeline ranks as processes on one GPU, each in a green context of 1/P of its SMs
(``verify.processes.green_context``), training a GPT of a realistic size per rank in bf16 with Megatron's own
1F1B (megatron-core's ``get_forward_backward_func``) and megatron-zb's schedules, one after the other.

``realpipe_rank(job)`` (launched with ``verify.processes.launch.run_cases(realpipe_rank, [job], P)``):

1. its GPU (``verify.processes.cuda_gloo``: messages over gloo, staged through the host, as the GPU check's
   ``pipeline`` section), a matmul probe on the whole GPU (rank 0), the green context, the probe in
   the share (``green_context.probe``: alone and all at once), every backward on the calling thread;
2. each case of ``job["cases"]``, if the time left allows it (rank 0 decides for every rank from the
   last case's wall time and ``job["deadline"]``): the model built for the case's placement, megatron-zb
   installed with its profiler over ``job["window"]`` (Megatron's own 1F1B: its ``forward_step`` /
   ``backward_step`` timed with CUDA events over the same iterations), ``job["iterations"]`` training
   forward-backward calls each after a barrier; the iterations after the window are timed (host clock
   around the call and a device synchronisation) with the CUDA allocator's peak above the iteration's
   start;
3. rank 0 appends one JSON line per probe and per case to ``job["out"]`` as it ends, so a launch
   stopped later keeps what finished.

The gradients are not reduced or stepped (``finalize_model_grads_func`` off: no data parallelism, no
tied embedding): the time measured is the pipeline's. On a CPU (``job["device"] == "cpu"``, the
check's ``--tiny``) the same runs without green contexts, the messages staged all the same."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import statistics
import time
from typing import Optional

__all__ = ["realpipe_rank", "MegatronPassClock", "MEGATRON_1F1B"]

MEGATRON_1F1B = "megatron-1f1b"  # a case whose schedule is Megatron's own (no megatron-zb installed)


def _write(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def _agree(go: Optional[bool]) -> bool:
    """Rank 0's decision, on every rank."""
    import torch.distributed as dist
    box = [go]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def realpipe_rank(job: dict) -> dict:
    """One rank of the section's launch: the probe, then every case in turn (see the module)."""
    import torch
    import torch.distributed as dist

    from ..processes import cuda_gloo
    from ..processes.green_context import GreenShare, probe, single_threaded_backward
    from ..processes.rankio import set_status
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    rank, p = dist.get_rank(), job["p"]
    cuda = job["device"] == "cuda"
    if cuda:
        dev = cuda_gloo.use_cuda()
    else:
        dev = torch.device("cpu")
        cuda_gloo.apply(stage_host=True)  # the GPU path's message staging, checked on the CPU too
    share = None
    pr = job["probe"]
    set_status("probe on the whole GPU")
    full = probe(pr["n"], pr["reps"], device=dev, whole_gpu=True) if cuda else {}
    try:
        if cuda and job["green"]:
            set_status("entering a green context")
            share = GreenShare.enter(p, dev.index)
        with single_threaded_backward():
            set_status("probe in the share")
            got = probe(pr["n"], pr["reps"], device=dev, share=share, full_fwd_s=full.get("full_fwd_s"))
            if rank == 0:
                _write(job["out"], {"probe": got, "green": share.describe() if share else None, "p": p})
            estimate = job.get("first_case_s", 30.0)
            for case in job["cases"]:
                left = job["deadline"] - time.time()
                if not _agree(left > 1.2 * estimate if rank == 0 else None):
                    if rank == 0:
                        _write(job["out"], {"case": case["name"], "skipped": f"{left:.0f} s left, the last case "
                                            f"took {estimate:.0f} s"})
                    continue
                t0 = time.time()
                set_status(f"case {case['name']}: starting")
                mine = _run_case(job, case, dev)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                estimate = time.time() - t0
                if rank == 0:
                    _write(job["out"], _case_record(job, case, every, estimate))
    finally:
        if share is not None:
            with contextlib.suppress(Exception):  # never in place of the error that brought us here
                share.exit()
    from ..model import tinygpt as M
    M.destroy_parallel_state()
    set_status("done")
    return {"rank": rank}


def _case_record(job: dict, case: dict, every: list, wall: float) -> dict:
    """What rank 0 writes for one case from every rank's result."""
    timed = [r["times"] for r in every]
    per_iter = [max(xs) for xs in zip(*timed)] if all(timed) else []
    rec = {"case": case["name"], "schedule": case.get("schedule") or MEGATRON_1F1B, "p": job["p"], "m": job["m"],
           "offload_ratio": case.get("offload_ratio"), "iteration_s": per_iter,
           "median_iteration_s": statistics.median(per_iter) if per_iter else None,
           "peak_bytes": [r["peak"] for r in every], "base_bytes": [r["base"] for r in every],
           "loss": next((r["loss"] for r in every if r["loss"] is not None), None), "wall_s": round(wall, 2)}
    if every[0].get("profile") is not None:
        rec["profile"] = every[0]["profile"]
    clocks = [r.get("clock") for r in every]
    if all(clocks):
        rec["megatron_passes"] = clocks
    stats = [r.get("offload") for r in every]
    if any(stats):
        rec["offload_stats"] = stats
    return rec


class MegatronPassClock:
    """Megatron's own ``forward_step`` / ``backward_step`` timed while ``on`` (CUDA events read after the
    iteration's synchronisation; the host clock on a CPU), with the allocator bytes an F adds."""

    def __init__(self, cuda: bool):
        self.cuda, self.on = cuda, False
        self.pending, self.seconds, self.mem_f = [], {"F": [], "BW": []}, []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _timed(self, kind: str, fn):
        def run(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            import torch
            before = torch.cuda.memory_allocated() if self.cuda else None
            start = self._mark()
            out = fn(*args, **kwargs)
            self.pending.append((kind, start, self._mark()))
            if kind == "F" and before is not None:
                self.mem_f.append(torch.cuda.memory_allocated() - before)
            return out
        return run

    @contextlib.contextmanager
    def patched(self):
        from megatron.core.pipeline_parallel import schedules as S
        f0, b0 = S.forward_step, S.backward_step
        S.forward_step, S.backward_step = self._timed("F", f0), self._timed("BW", b0)
        try:
            yield self
        finally:
            S.forward_step, S.backward_step = f0, b0

    def end_iteration(self) -> None:
        """Read this iteration's marks (after the device synchronised)."""
        for kind, a, b in self.pending:
            self.seconds[kind].append(a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        self.pending = []

    def summary(self) -> dict:
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {"f": med(self.seconds["F"]), "bw": med(self.seconds["BW"]), "mem_f": med(self.mem_f),
                "samples": {k: len(v) for k, v in self.seconds.items()}}


def _model_config(job: dict):
    from ..model.tinygpt import TinyGPTConfig
    m = job["model"]
    return TinyGPTConfig(num_layers=m["layers_per_rank"] * job["p"], hidden_size=m["hidden"],
                         num_attention_heads=m["heads"], vocab_size=m["vocab"], seq_length=m["seq"],
                         micro_batch_size=m["mbs"], tie_embeddings=False, attention_backend=job["attention_backend"])


def _install(job: dict, case: dict, cuda: bool):
    from ...megatron.install import install
    kw = dict(profile_window=tuple(job["window"]), profile_path=None, timeout_s=job["timeout_s"])
    if case.get("offload_ratio") is not None:  # on a GPU: the copy streams; on a CPU the synchronous test mode
        kw.update(offload_ratio=case["offload_ratio"], offload_time=case.get("offload_time", 0.5),
                  offload_overlap=True, offload_cpu_test=not cuda)
    return install(case["schedule"], **kw)


def _build(job: dict, case: dict, cfg, dev):
    """The placement's parallel state and this rank's chunks (bf16, Float16Module, no DDP, no
    gradient reduction); on a GPU initialised there by megatron (no CPU copy of the weights)."""
    import torch

    from ...core.ir import Placement
    from ...megatron.execution.finalize import configure_grad_sync
    from ...megatron.layout import placement as P
    from ..case import schedule_placement
    from ..model import tinygpt as M
    p, cuda = job["p"], dev.type == "cuda"
    if case.get("schedule"):
        style, chunks = schedule_placement(case["schedule"], None)
        placement = P.make_placement(style, p, chunks)
    else:
        placement = Placement.single(p)
    M.init_parallel_state(1, p, placement, seed=1234)
    chunks = M.build_model_chunks(cfg, placement, M.ChunkOptions(init=not cuda), params_dtype=torch.bfloat16,
                                  pipeline_dtype=torch.bfloat16, bf16=True, deallocate_pipeline_outputs=True,
                                  batch_p2p_comm=False, use_cpu_initialization=not cuda)
    config = chunks[0].config
    if cuda:
        chunks = [c.to(dev) for c in chunks]
    chunks = P.float16_chunks(config, chunks)
    configure_grad_sync(config, chunks, placement=placement, ddp=False)
    config.finalize_model_grads_func = None  # the pipeline's time: no gradient reduction (see the module)
    return chunks


def _zero_grads(chunks) -> None:
    for c in chunks:
        for prm in c.parameters():
            if prm.grad is not None:
                prm.grad.zero_()


def _run_case(job: dict, case: dict, dev) -> dict:
    """This rank's part of one case: its timed iterations, allocator peaks, the loss, the profile."""
    import megatron.core.pipeline_parallel as mpp
    import torch
    import torch.distributed as dist

    from ..model import tinygpt as M
    from ..processes.rankio import set_status
    cuda = dev.type == "cuda"
    name = case["name"]
    cfg = _model_config(job)
    handle = _install(job, case, cuda) if case.get("schedule") else None
    clock = None if handle is not None else MegatronPassClock(cuda)
    times, peaks, bases, loss = [], [], [], None
    w0, w1 = job["window"]
    try:
        set_status(f"case {name}: building the model")
        chunks = _build(job, case, cfg, dev)
        fb = mpp.get_forward_backward_func()
        with clock.patched() if clock is not None else contextlib.nullcontext():
            for it in range(1, job["iterations"] + 1):
                set_status(f"case {name}: iteration {it}")
                _zero_grads(chunks)
                batches = [{k: (v.to(dev) if hasattr(v, "to") else v) for k, v in b.items()}
                           for b in M.make_batches(cfg, job["m"], it)]
                iters = M.batch_iterators(batches, len(chunks))
                timed = it > w1
                if clock is not None:
                    clock.on = w0 <= it <= w1
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                out = fb(forward_step_func=M.forward_step_func, data_iterator=iters, model=list(chunks),
                         num_microbatches=job["m"], seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
                         decoder_seq_length=cfg.seq_length, forward_only=False)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if clock is not None:
                    clock.end_iteration()
                if timed:
                    times.append(dt)
                    if cuda:
                        peaks.append(torch.cuda.max_memory_allocated() - base)
                        bases.append(base)
                got = M.iteration_loss(out)
                loss = got if got is not None else loss
        fbo = getattr(handle, "forward_backward", None)
        res = {"rank": dist.get_rank(), "times": times, "peak": max(peaks) if peaks else None,
               "base": max(bases) if bases else None, "loss": loss,
               "clock": clock.summary() if clock is not None else None,
               "offload": dict(fbo.offload_stats) if getattr(fbo, "offload_stats", None) else None}
        if dist.get_rank() == 0 and fbo is not None:
            res["profile"] = fbo.profile
        if loss is not None and loss != loss:
            raise RuntimeError(f"case {name}: the loss is NaN")
        return res
    finally:
        if handle is not None:
            handle.uninstall()
        chunks = fb = None  # noqa: F841 - the case's memory goes before the next one's model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
