"""Activation offload on one GPU: one pipeline rank's share of a schedule with and without offload.

    python benchmarks/bench_offload_gpu.py                           # 1f1b rank 0, p=8, h=4096, s=4096, bf16
    python benchmarks/bench_offload_gpu.py --schedule zb-v --layers 2
    python benchmarks/bench_offload_gpu.py --device cpu --tiny       # smoke run of the code path (no figures)

The rank's lowered action list (``--rank``, default 0: the rank holding the most microbatches in
flight) is run back to back on a real megatron-core transformer chunk (local spec, ``--layers``
layers per chunk; V schedules build the rank's two chunks): F on a random input, B with a random
output gradient, W through the W queue, OFFLOAD/RELOAD through the offload manager on CUDA
streams. No other rank exists, so sends and receives are dropped and nothing waits for a peer:
the time per microbatch is the rank's compute plus whatever the copies add, a pessimistic setting
for offload (no pipeline gaps to hide the reloads in).

Reported per run: ``torch.cuda.max_memory_allocated`` above the model's own memory, the peak of
resident activation bytes the manager counts, time per microbatch (median of ``--repeats``), each
pass kind's median time (``pass_s``: CUDA events on the compute stream, waits for reloads included), and,
for the offload run, the measured K (one-way copy time of one microbatch's stage activation over
its F + B time, from the manager's byte count and the measured host-link bandwidth) next to the
estimate ``--auto-offload-time`` would use. Writes JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def setup_process(device):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)


def _chunk(a, device, dtype):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_zb.megatron.cpu.local_spec import layer_spec
    from megatron_zb.megatron.features.sdpa_attention import core_attention_for
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            ffn_hidden_size=4 * a.hidden, params_dtype=dtype, pipeline_dtype=dtype,
                            bf16=dtype.is_floating_point and str(dtype) == "torch.bfloat16",
                            use_cpu_initialization=device.type == "cpu", hidden_dropout=0.0, attention_dropout=0.0,
                            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    block = TransformerBlock(cfg, spec=layer_spec(cfg, a.layers, core_attention=core_attention_for(a.attention_backend)),
                             post_layer_norm=False)
    return block.to(device=device, dtype=dtype)


def run(a, offload: bool):
    import torch
    from megatron_zb.core.ir import B, BW, F, OFFLOAD, OFFLOAD_W, RELOAD, RELOAD_W, W, Setting
    from megatron_zb.core.sim.lower import lower
    from megatron_zb.core.sim.hostlink import OffloadOptions
    from megatron_zb.core.passes.offload import add_offload
    from megatron_zb.core.schedules import generate, get
    from megatron_zb.megatron.execution.wgrad import attach_wgrad_queue
    from megatron_zb.runtime.features.offload import OffloadManager
    from megatron_zb.runtime.wqueue import WQueue

    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    cuda = device.type == "cuda"
    spec = get(a.schedule)
    st = Setting(a.stages, a.microbatches, chunks=spec.resolve_chunks(None))
    sched = generate(a.schedule, st)
    if offload:
        sched = add_offload(sched, st, OffloadOptions(ratio=a.ratio, time=a.offload_time))
    actions = [x for x in lower(sched, st).orders[a.rank] if x.is_compute or x.kind in (OFFLOAD, RELOAD, OFFLOAD_W,
                                                                                          RELOAD_W)]
    stages = sched.placement.stages_of(a.rank)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    chunks = {s: _chunk(a, device, dtype) for s in stages}
    queues = {s: WQueue(f"stage {s}") for s in stages}
    for s in stages:
        attach_wgrad_queue(chunks[s], queues[s])
    mgr = None
    if offload:
        mgr = OffloadManager(device, cpu_test=not cuda, w_tensors=lambda s, mb: queues[s].held_tensors(mb))
        mgr.ignore(p for c in chunks.values() for p in c.parameters())
    shape = (a.seq, a.micro_batch, a.hidden)
    grads = torch.randn(shape, device=device, dtype=dtype)
    base_mem = torch.cuda.memory_allocated() if cuda else 0
    times, peaks, stats = [], [], []
    pass_s = {}  # F/B/BW/W -> every measured pass's time (CUDA events on the compute stream, or the clock)
    for it in range(a.repeats + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        saved, marks = {}, []
        for x in actions:
            key = (x.stage, x.mb)
            if x.is_compute:
                marks.append((x.kind, _mark(cuda)))
            if x.kind == F:
                inp = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                if mgr is not None:
                    with mgr.capture(x.stage, x.mb, any(y.kind == OFFLOAD and (y.stage, y.mb) == key for y in actions),
                                     (inp,)):
                        out = chunks[x.stage](inp, attention_mask=None)
                else:
                    out = chunks[x.stage](inp, attention_mask=None)
                saved[key] = (inp, out)
            elif x.kind in (B, BW):
                if mgr is not None:
                    mgr.wait(*key)
                inp, out = saved.pop(key)
                if x.kind == B:
                    with queues[x.stage].defer(x.mb):
                        torch.autograd.backward(out, grads)
                else:
                    torch.autograd.backward(out, grads)
                del inp, out
            elif x.kind == W:
                if mgr is not None:
                    mgr.wait_w(*key)
                queues[x.stage].run(x.mb)
            elif x.kind == OFFLOAD:
                mgr.offload(*key)
            elif x.kind == RELOAD:
                mgr.reload(*key)
            elif x.kind == OFFLOAD_W:
                mgr.offload_w(*key)
            elif x.kind == RELOAD_W:
                mgr.reload_w(*key)
            if x.is_compute:
                marks[-1] += (_mark(cuda),)
        if cuda:
            torch.cuda.synchronize()
        if it > 0:
            for kind, t_start, t_end in marks:
                pass_s.setdefault(kind, []).append(_elapsed(t_start, t_end))
        if it > 0:  # the first iteration warms up (and allocates the host buffers)
            times.append((time.perf_counter() - t0) / a.microbatches)
            peaks.append((torch.cuda.max_memory_allocated() - base_mem) if cuda else 0)
            if mgr is not None:
                stats.append(mgr.end_iteration())
        elif mgr is not None:
            mgr.end_iteration()
        for c in chunks.values():
            c.zero_grad(set_to_none=True)
    out = {"offload": offload, "time_per_microbatch_s": statistics.median(times),
           "pass_s": {k: statistics.median(v) for k, v in pass_s.items()},
           "max_memory_allocated_above_model_bytes": max(peaks), "actions": len(actions)}
    if stats:
        out["manager"] = stats[-1]
    return out


def _mark(cuda):
    """A point in time: a CUDA event recorded on the current stream, or the clock."""
    import torch
    if not cuda:
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _elapsed(t_start, t_end) -> float:
    """Seconds between two marks (the events' stream work, once synchronized)."""
    if isinstance(t_start, float):
        return t_end - t_start
    return t_start.elapsed_time(t_end) / 1e3


def measured_k(a, res_off):
    """K from this GPU: one microbatch's captured bytes over the measured link, over F + B."""
    import torch
    from megatron_zb.core.costs.model import ModelSpec
    from megatron_zb.megatron.features.offload import estimate_offload_time
    from megatron_zb.runtime.observe.measure import measure_host_link
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    chunk = _chunk(a, device, dtype)
    shape = (a.seq, a.micro_batch, a.hidden)
    g = torch.randn(shape, device=device, dtype=dtype)
    fb = []
    for _ in range(4):
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = chunk(x, attention_mask=None)
        torch.autograd.backward(y, g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fb.append(time.perf_counter() - t0)
    link = measure_host_link(device)
    nbytes = res_off["manager"]["captured_bytes_per_forward"]
    one_way = 0.5 * (nbytes / (link["d2h_gbps"] * 1e9) + nbytes / (link["h2d_gbps"] * 1e9))
    est = estimate_offload_time(ModelSpec(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads,
                                          seq_length=a.seq, micro_batch_size=a.micro_batch, flash_attention=False),
                                device=device)
    return {"measured_k": one_way / statistics.median(fb[1:]), "fb_s": statistics.median(fb[1:]),
            "captured_bytes_per_forward": nbytes, "host_link": link,
            "auto_offload_time_estimate": est["offload_time"], "estimate": {k: est[k] for k in
                                                                           ("transfer_s", "compute_s", "matmul")}}


def parse_args(argv=None, parser=None):
    """The benchmark's settings (``--tiny``: its tiny dimensions filled in); ``parser``: an
    ``argparse.ArgumentParser`` (sub)class to use, e.g. one that fails in one line."""
    ap = (parser or argparse.ArgumentParser)(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=1, help="transformer layers per model chunk")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--ratio", type=float, default=1.0)
    ap.add_argument("--offload-time", type=float, default=0.5, help="K the schedule core plans with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions: checks the code path, no figures")
    from megatron_zb.megatron.features.flags.attention import ATTENTION_BACKENDS
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                    help="flash or fused: torch's scaled_dot_product_attention as the core attention")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.hidden, a.heads, a.seq, a.layers, a.dtype, a.repeats = 64, 4, 32, 1, "fp32", 1
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.device == "cpu":
        from megatron_zb.megatron.cpu import cpu_shims
        cpu_shims.apply()
    import torch
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_offload_gpu: no CUDA device here; run it on a GPU machine (or --device cpu --tiny to check "
                 "the code path)")
    setup_process(torch.device(a.device))
    base = run(a, offload=False)
    off = run(a, offload=True)
    k = measured_k(a, off)
    gib = 2 ** 30
    rows = [("no offload", base), (f"offload ratio {a.ratio:g}", off)]
    print(f"{a.schedule} rank {a.rank} of p={a.stages}, m={a.microbatches}; chunk: {a.layers} layer(s), h={a.hidden}, "
          f"s={a.seq}, b={a.micro_batch}, {a.dtype} on {torch.device(a.device)}")
    for name, r in rows:
        print(f"{name:<20} max_memory_allocated above model {r['max_memory_allocated_above_model_bytes'] / gib:8.2f} GiB"
              f"   time per microbatch {1e3 * r['time_per_microbatch_s']:8.2f} ms")
    if base["max_memory_allocated_above_model_bytes"]:
        print(f"activation memory {100 * (1 - off['max_memory_allocated_above_model_bytes'] / base['max_memory_allocated_above_model_bytes']):.1f}% "
              f"less, time {100 * (off['time_per_microbatch_s'] / base['time_per_microbatch_s'] - 1):+.2f}%")
    print(f"measured K {k['measured_k']:.3f} (captured {k['captured_bytes_per_forward'] / gib:.2f} GiB per F, "
          f"link {k['host_link']['d2h_gbps']:.1f}/{k['host_link']['h2d_gbps']:.1f} GB/s D2H/H2D, F+B "
          f"{1e3 * k['fb_s']:.1f} ms); --auto-offload-time estimate {k['auto_offload_time_estimate']:.3f}")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"offload_gpu_{a.schedule}_{'tiny_' if a.tiny else ''}{torch.device(a.device).type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() and a.device.startswith("cuda") else "cpu"
    with open(out, "w") as f:
        json.dump({"command": "python benchmarks/bench_offload_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "device": dev, "args": vars(a), "no_offload": base, "offload": off, "k": k}, f, indent=1, default=str)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
