"""Megatron wiring of activation offload (docs/offload.md): the schedule with its offload actions,
one offload manager per rank, and ``--auto-offload-time``'s measurement.

``install(..., offload_ratio=R)`` (or the flags ``--cpu-offload`` / ``--zero-bubble-offload-ratio``)
gets here from ``install.ZeroBubbleForwardBackward``: the schedule core places OFFLOAD/RELOAD
(``core.offload``), the executor calls the manager (``runtime.offload``) at those points, and the
W queue reports the tensors its deferred weight-gradient closures keep, so they can travel between
B and W too.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ..core.ir import Schedule, ScheduleError, Setting
from ..core.offload import OffloadOptions, generate_with_offload
from ..runtime.offload import OffloadError, OffloadManager, measure_host_link, measure_matmul

__all__ = ["offload_schedule", "manager_for", "resolve_auto_offload_time", "estimate_offload_time"]


def _config_error(msg):
    from .install import ZeroBubbleConfigError
    return ZeroBubbleConfigError(msg)


def offload_schedule(options, setting: Setting, chunks: int) -> Schedule:
    """The schedule ``options.schedule`` with the offload ``options`` ask for (pure schedule core)."""
    o = options
    if o.offload_chunks is not None and o.offload_chunks > chunks:
        raise _config_error(f"offload of the first {o.offload_chunks} model chunk(s) of each rank, but schedule "
                            f"{o.schedule} runs {chunks} chunk(s) per rank (--offload-chunk-num 1..{chunks})")
    if o.offload_time == "auto":
        raise ScheduleError("offload_time 'auto' is measured at the first training iteration")
    auto = o.offload_ratio == "auto"
    opts = OffloadOptions(ratio=None if auto else float(o.offload_ratio), time=float(o.offload_time),
                          overlap=bool(o.offload_overlap), memory_limit=o.memory_limit if auto else None,
                          chunks=o.offload_chunks)
    return generate_with_offload(o.schedule, setting, opts)


def manager_for(fb, models, queues, chunk_of, *_unused) -> OffloadManager:
    """This rank's offload manager (made once per forward-backward object), pointed at this call's
    W queues and told to leave the model's weights alone."""
    o = fb.options
    if fb.offload is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        try:
            fb.offload = OffloadManager(device, overlap=o.offload_overlap, cpu_test=o.offload_cpu_test,
                                        min_elements=o.offload_min_elements)
        except OffloadError as e:
            raise _config_error(str(e)) from None
    mgr = fb.offload
    mgr.w_tensors = lambda stage, mb: queues[chunk_of[stage]].held_tensors(mb)
    mgr.ignore(p for m in models for p in m.parameters())
    for m in models:  # megatron DDP keeps parameters (and main grads) in contiguous buffers
        bufs = getattr(m, "buffers", None)  # (a plain module's .buffers is a method)
        for buf in bufs if isinstance(bufs, (list, tuple)) else []:
            for name in ("param_data", "grad_data"):
                t = getattr(buf, name, None)
                if isinstance(t, torch.Tensor):
                    mgr.ignore([t])
    return mgr


def estimate_offload_time(*, hidden_size: int, num_attention_heads: int, seq_length: int, micro_batch_size: int,
                          ffn_hidden_size: Optional[int] = None, tensor_parallel_size: int = 1,
                          sequence_parallel: bool = False, flash_attention: bool = True, device=None) -> dict:
    """K = one-way transfer time of one layer's activation / its F + B time, from this device's
    measured matmul speed and host-link bandwidth (not a table of GPU names). The layer's FLOPs
    and activation bytes follow the zero-bubble paper's counts (``core.plan.ModelSpec``); per
    layer both scale alike, so the ratio holds for a whole stage. On a CPU both measurements
    are CPU stand-ins and say so."""
    from ..core.plan import ModelSpec
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    spec = ModelSpec(num_layers=1, hidden_size=int(hidden_size), num_attention_heads=int(num_attention_heads),
                     seq_length=int(seq_length), micro_batch_size=int(micro_batch_size),
                     ffn_hidden_size=ffn_hidden_size, tensor_parallel_size=int(tensor_parallel_size),
                     sequence_parallel=bool(sequence_parallel), flash_attention=flash_attention)
    f, b, _ = spec.layer_flops()
    act, _ = spec.layer_activation_bytes()
    link = measure_host_link(device)
    mm = measure_matmul(device)
    compute_s = (f + b) / (mm["tflops"] * 1e12)
    transfer_s = 0.5 * (act / (link["d2h_gbps"] * 1e9) + act / (link["h2d_gbps"] * 1e9))
    return {"offload_time": transfer_s / compute_s, "activation_bytes_per_layer": act, "fb_flops_per_layer": f + b,
            "transfer_s": transfer_s, "compute_s": compute_s, "host_link": link, "matmul": mm}


def resolve_auto_offload_time(fb, config, seq_length: int, micro_batch_size: int, tp_group, cp_group) -> None:
    """--auto-offload-time: measure K once, on every rank, and agree on the largest (every rank
    must generate the same schedule); the cached schedules are dropped."""
    tp = tp_group.size() if tp_group is not None else 1
    cp = cp_group.size() if cp_group is not None else 1
    est = estimate_offload_time(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                                seq_length=max(1, seq_length // cp), micro_batch_size=micro_batch_size,
                                ffn_hidden_size=getattr(config, "ffn_hidden_size", None), tensor_parallel_size=tp,
                                sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
                                flash_attention=torch.cuda.is_available())
    if dist.is_available() and dist.is_initialized():
        nccl = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
        k = torch.tensor([est["offload_time"]], dtype=torch.float64, device="cuda" if nccl else "cpu")
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
    else:
        k = torch.tensor([est["offload_time"]], dtype=torch.float64)
    est["offload_time_local"] = est["offload_time"]
    est["offload_time"] = float(k.item())
    fb.offload_time_measured = est
    fb.options = dataclasses.replace(fb.options, offload_time=est["offload_time"])
    fb._schedules.clear()
