"""Cost of splitting a backward into B + W versus megatron's fused backward.

One megatron-core TransformerLayer (local spec), one process, one thread:

  fused : megatron's own backward (no W queue attached)
  BW    : queue attached, backward outside defer() (our fused path)
  B, W  : queue attached, backward under queue.defer(0), then queue.run(0)

Reported ratio = median(B + W) / median(fused). Goal: <= 1.05. Each repetition runs the variants
back to back (in rotating order), so slow drifts of a shared machine hit them alike.

    OMP_NUM_THREADS=1 python benchmarks/bench_split_overhead.py [--hidden 1024 --seq 512]
        [--reps 7] [--out benchmarks/results/split_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_zb.megatron.features.flags.attention import ATTENTION_BACKENDS, uses_sdpa  # noqa: E402


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(args):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn or 4 * args.hidden, use_cpu_initialization=args.device == "cpu",
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DTYPES[args.dtype],
        pipeline_dtype=DTYPES[args.dtype], bf16=args.dtype == "bf16",
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=args.gaf)
    from megatron_zb.megatron.cpu.local_spec import with_core_attention
    from megatron_zb.megatron.features.sdpa_attention import core_attention_for
    spec = with_core_attention(get_gpt_layer_local_spec(), core_attention_for(args.attention_backend))
    return build_module(spec, config=cfg, layer_number=1)


def parse_args(argv=None, parser=None):
    """The benchmark's settings; ``parser``: an ``argparse.ArgumentParser`` (sub)class to use."""
    ap = (parser or argparse.ArgumentParser)(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=0, help="default 4*hidden")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gaf", action="store_true", help="gradient_accumulation_fusion on")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="parameters and activations")
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                    help="flash or fused: torch's scaled_dot_product_attention as the core attention (causal, no "
                         "mask tensor); default megatron's DotProductAttention")
    ap.add_argument("--out", default="benchmarks/results/split_overhead.json")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from megatron_zb.megatron.cpu import cpu_shims
    # before megatron is imported; on a CUDA host --device cpu still needs them (megatron would put
    # its buffers on the GPU)
    cpu_shims.apply(force=args.device != "cuda")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import megatron.core
    from megatron_zb.megatron.execution.wgrad import attach_wgrad_queue, detach_wgrad_queue
    from megatron_zb.runtime.wqueue import WQueue

    dev = torch.device(args.device)
    # the whole layer in the run's dtype, as Megatron's Float16Module makes it (torch's LayerNorm,
    # the fallback without Apex or TE, is built in fp32 whatever params_dtype says)
    layer = build(args).to(dev, DTYPES[args.dtype])
    if args.gaf:
        for p in layer.parameters():
            p.main_grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.seq, args.batch, args.hidden, generator=g).to(dev, DTYPES[args.dtype])
    dy = torch.randn(args.seq, args.batch, args.hidden, generator=g).to(dev, DTYPES[args.dtype])
    mask = None if uses_sdpa(args.attention_backend) else \
        torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1).to(dev)  # SDPA: is_causal
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    queue = WQueue("bench")

    def forward():
        x = x0.clone().requires_grad_()
        out = layer(x, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    def clear():
        for p in layer.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()

    def grads():
        out = {}
        for n, p in layer.named_parameters():
            gr = p.main_grad.clone() if hasattr(p, "main_grad") else torch.zeros_like(p)
            out[n] = gr + p.grad if p.grad is not None else gr
        return out

    def fused():
        detach_wgrad_queue(layer)
        y = forward()
        sync()
        t0 = time.perf_counter()
        y.backward(dy)
        sync()
        return {"fused": time.perf_counter() - t0}

    def attached_bw():
        attach_wgrad_queue(layer, queue)
        y = forward()
        sync()
        t0 = time.perf_counter()
        y.backward(dy)
        sync()
        return {"bw": time.perf_counter() - t0}

    def split():
        attach_wgrad_queue(layer, queue)
        sync()
        tf = time.perf_counter()
        y = forward()
        sync()
        t0 = time.perf_counter()
        with queue.defer(0):
            y.backward(dy)
        sync()
        t1 = time.perf_counter()
        queue.run(0)
        sync()
        t2 = time.perf_counter()
        return {"f": t0 - tf, "b": t1 - t0, "w": t2 - t1, "b+w": t2 - t0}

    # correctness spot check: B + W gives megatron's gradients
    clear()
    fused()
    ref = grads()
    clear()
    split()
    worst = max(((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item()
                for n, g in grads().items())

    variants = [fused, attached_bw, split]
    times = {k: [] for k in ("fused", "bw", "f", "b", "w", "b+w")}
    for rep in range(args.warmup + args.reps):
        order = variants[rep % 3:] + variants[:rep % 3]
        for fn in order:
            clear()
            r = fn()
            if rep >= args.warmup:
                for k, v in r.items():
                    times[k].append(v)
    detach_wgrad_queue(layer)
    queue.assert_empty()

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["b+w"] / med["fused"]
    ratio_bw = med["bw"] / med["fused"]
    print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, {args.device}, "
          f"{torch.get_num_threads()} thread(s); TransformerLayer hidden={args.hidden} "
          f"ffn={args.ffn or 4 * args.hidden} heads={args.heads} seq={args.seq} "
          f"batch={args.batch} gaf={args.gaf} {args.dtype}; median of {args.reps}")
    print(f"{'variant':<28} {'median s':>10} {'min s':>10} {'vs fused':>9}")
    rows = [("forward", "f"), ("fused backward (megatron)", "fused"), ("BW (queue attached)", "bw"),
            ("B (defer)", "b"), ("W (run)", "w"), ("B + W", "b+w")]
    for label, k in rows:
        print(f"{label:<28} {med[k]:>10.4f} {min(times[k]):>10.4f} {med[k] / med['fused']:>8.3f}x")
    print(f"split overhead (B+W)/fused = {ratio:.3f}x (goal <= 1.05); max rel grad diff {worst:.1e}")

    result = {
        "benchmark": "split_overhead",
        "megatron_core": megatron.core.__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "device": args.device,
        "config": {"hidden": args.hidden, "ffn": args.ffn or 4 * args.hidden,
                   "heads": args.heads, "seq": args.seq, "batch": args.batch, "dtype": args.dtype,
                   "gradient_accumulation_fusion": args.gaf, "reps": args.reps,
                   "warmup": args.warmup, "attention_backend": args.attention_backend},
        "median_s": med, "samples_s": times,
        "ratio_b_plus_w_over_fused": ratio, "ratio_bw_attached_over_fused": ratio_bw,
        "goal": 1.05, "meets_goal": ratio <= 1.05, "max_rel_grad_diff": worst,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
