"""The GPU check's sections that run ``megatron-zb verify``'s machinery on the GPU
(``benchmarks/gpu_check.py``): memory, pipeline, ep_overlap; and ``stream_overlap``, which reads
a torch profiler trace.

Every rank is a process of its own on the one GPU (``VerifyCase(device="cuda")``): NCCL refuses two
ranks on one device, so they talk over gloo, point-to-point messages staged through host copies
(``megatron_zb.verify.processes.cuda_gloo``). The single-process reference runs on the same GPU. With
``--tiny`` the same cases run on the CPU at verify's tiny sizes, the staging included
(``MZB_VERIFY_STAGE_P2P=1``)."""
from __future__ import annotations

import glob
import json
import os

import gpu_check_report as R
from gpu_check_sections import Context, bench

# the memory section's model: activations large enough that the allocator's rounding does not count
MEMORY_MODEL = dict(hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=2, vocab_size=1024)
MOE = dict(num_experts=4, expert_model_parallel_size=2, data_parallel_size=2, moe_router_topk=2,
           moe_aux_loss_coeff=0.01, ep_overlap=True)
EP_MODEL = dict(hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=2, vocab_size=1024,
                moe_ffn_hidden_size=1024)
GPU_EVENT_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _stage_on_cpu(ctx: Context) -> None:
    if ctx.device == "cpu":  # the CPU check runs the GPU path's message staging too
        from megatron_zb.verify.processes.cuda_gloo import STAGE_ENV
        os.environ[STAGE_ENV] = "1"


def _verdicts(ctx: Context, results) -> list:
    bad = [f"{r['case']}: " + (str(r.get("error")).strip().splitlines() or [""])[0] if r.get("error") else
           f"{r['case']}: {'; '.join(map(str, r.get('problems') or []))}" for r in results if not r.get("passed")]
    for b in bad:
        ctx.fail(b[:400])
    return bad


def _case_figures(r: dict) -> dict:
    keep = ("case", "schedule", "passed", "max_rel_grad_diff", "max_abs_loss_diff", "error", "problems",
            "peak_activation_bytes_measured", "peak_activation_bytes_predicted", "overlapped_pairs", "megatron_core")
    out = {k: r.get(k) for k in keep if k in r}
    out["median_iteration_ms"] = (r.get("timing") or {}).get("median_iteration_ms")
    return out


# ------------------------------------------------------------------------------------------------
# memory: the CUDA allocator's activation peak against the simulator's and plan's
# ------------------------------------------------------------------------------------------------

def memory(ctx: Context) -> None:
    from megatron_zb import verify as V
    from megatron_zb.core.sim.simulate import stage_memory_trace
    BM = bench("bench_memory")
    gpu = ctx.device == "cuda"
    pp, m = (4, 8) if gpu else (2, 4)
    chosen = BM.CASES if gpu else [c for c in BM.CASES if c[0] in ("zb-h1", "zb-v")]
    cases = [V.make_case(name, pp, num_microbatches=m, iterations=2, device=ctx.device,
                         attention_backend=ctx.attention_backend,
                         config_overrides={"deallocate_pipeline_outputs": True}, **(MEMORY_MODEL if gpu else {}), **kw)
             for name, kw in chosen]
    plans = [[max([0.0] + stage_memory_trace(o, BM.formula_stage_mem(c))) for o in BM.orders(c)] for c in cases]
    ctx.plan.update(cases=[c.describe() for c in cases], model=MEMORY_MODEL if gpu else "verify's tiny GPT",
                    measured="torch.cuda.memory_allocated over the iteration's start, after every pass (runtime.observe.memory)")
    if not ctx.runs:
        for c, p in zip(cases, plans):
            ctx.row(f"activation peak per rank, {c.schedule}" + (" + offload" if c.offload_ratio else ""),
                    "(GPU run)", "plan " + " / ".join(f"{x / 2 ** 20:.0f}" for x in p) + " MiB")
        return
    ctx.need_cuda()
    _stage_on_cpu(ctx)
    results = V.run_verify_many(cases, timeout=ctx.launch_timeout(), mcore_path=ctx.mcore_path)
    _verdicts(ctx, results)
    ctx.figures["cases"] = []
    worst = 0.0
    for c, r, p in zip(cases, results, plans):
        fig = dict(_case_figures(r), plan_bytes=[round(x) for x in p])
        ctx.figures["cases"].append(fig)
        meas, pred = r.get("peak_activation_bytes_measured"), r.get("peak_activation_bytes_predicted")
        if not meas or not pred:
            continue
        dev = [s / x - 1 for x, s in zip(meas, pred) if x]
        worst = max([worst] + [abs(d) for d in dev])
        ctx.row(f"activation peak per rank (MiB), {c.schedule}" + (" + offload 1" if c.offload_ratio else ""),
                " / ".join(f"{x / 2 ** 20:.1f}" for x in meas),
                "simulated " + " / ".join(f"{x / 2 ** 20:.1f}" for x in pred) + f" (worst {R.pct(max(dev, key=abs))});"
                " plan " + " / ".join(f"{x / 2 ** 20:.1f}" for x in p))
    ctx.figures["max_abs_simulated_dev"] = worst


# ------------------------------------------------------------------------------------------------
# pipeline: PP=2 and PP=4 sharing the GPU, every schedule against the reference
# ------------------------------------------------------------------------------------------------

def pipeline(ctx: Context) -> None:
    from megatron_zb import verify as V
    from megatron_zb.core.schedules import get, names
    gpu = ctx.device == "cuda"
    scheds = names() if gpu else ["zb-h1", "zb-v", "interleaved-zb"]
    launches = {pp: [V.make_case(n, pp, num_microbatches=4 if pp == 2 or get(n).chunks == 2 else 8, iterations=2,
                                 device=ctx.device, attention_backend=ctx.attention_backend) for n in scheds]
                for pp in ((2, 4) if gpu else (2,))}
    ctx.plan.update(launches={f"PP={pp}": [c.describe() for c in cs] for pp, cs in launches.items()},
                    transport="gloo, point-to-point staged through the host (NCCL refuses two ranks on one GPU)")
    if not ctx.runs:
        for pp, cs in launches.items():
            ctx.row(f"PP={pp}: {len(cs)} schedules against the reference", "(GPU run)",
                    f"exact: gradients within {V.DEFAULT_GRAD_RTOL:g}, losses within {V.DEFAULT_LOSS_ATOL:g}")
        return
    ctx.need_cuda()
    _stage_on_cpu(ctx)
    # both launches at once (2 + 4 processes on the one GPU): correctness, not timing
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {pp: pool.submit(V.run_verify_many, cs, timeout=ctx.launch_timeout(),
                                   mcore_path=ctx.mcore_path) for pp, cs in launches.items()}
    for pp, cs in launches.items():
        results = futures[pp].result()
        bad = _verdicts(ctx, results)
        ctx.figures[f"pp{pp}"] = [_case_figures(r) for r in results]
        grads = [r["max_rel_grad_diff"] for r in results if r.get("max_rel_grad_diff") is not None]
        losses = [r["max_abs_loss_diff"] for r in results if r.get("max_abs_loss_diff") is not None]
        ctx.row(f"PP={pp}: every schedule against the reference ({len(cs)})",
                f"{len(cs) - len(bad)}/{len(cs)} pass; max rel grad diff {max(grads, default=float('nan')):.1e}, "
                f"loss diff {max(losses, default=float('nan')):.1e}",
                f"exact: gradients within {V.DEFAULT_GRAD_RTOL:g}, losses within {V.DEFAULT_LOSS_ATOL:g}")


# ------------------------------------------------------------------------------------------------
# ep_overlap: the overlapped F&B pairs' streams, from torch's profiler
# ------------------------------------------------------------------------------------------------

def _merge(ivs):
    out = []
    for a, b in sorted(ivs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(ivs) -> float:
    return sum(b - a for a, b in ivs)


def _intersect(xs, ys):
    """Two merged interval lists' intersection (merged)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append([a, b])
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def stream_overlap(events, label=None) -> dict:
    """From a Chrome trace's events (torch profiler): each GPU stream's busy time, the compute stream
    (the most kernel time) and how much of every other stream's activity (communication, copies)
    ran while it computed; the same inside the windows of the ``label`` annotation (the overlapped
    pairs), where the trace has them. Times in microseconds."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_CATS and "dur" in e]
    if not gpu:
        return {"gpu_events": 0}
    per, kern = {}, {}
    for e in gpu:
        s = str((e.get("args") or {}).get("stream", e.get("tid")))
        per.setdefault(s, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        if e["cat"] == "kernel":
            kern[s] = kern.get(s, 0.0) + float(e["dur"])
    busy_of = kern or {s: _length(_merge(ivs)) for s, ivs in per.items()}
    compute = max(busy_of, key=busy_of.get)
    windows = _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                     if label and e.get("name") == label and e.get("cat") == "gpu_user_annotation" and "dur" in e)

    def measure(clip):
        comp = _merge(per[compute])
        other = _merge(iv for s, ivs in per.items() if s != compute for iv in ivs)
        if clip is not None:
            comp, other = _intersect(comp, clip), _intersect(other, clip)
        ov = _length(_intersect(comp, other))
        busy = _length(other)
        return {"compute_busy_us": _length(comp), "other_busy_us": busy, "overlap_us": ov,
                "overlap_share": ov / busy if busy else None}
    return {"gpu_events": len(gpu), "compute_stream": compute,
            "streams": {s: {"busy_us": _length(_merge(ivs)), "events": len(ivs)} for s, ivs in per.items()},
            "whole": measure(None), "pairs": len(windows), "in_pairs": measure(windows) if windows else None}


def ep_overlap(ctx: Context) -> None:
    from megatron_zb import verify as V
    from megatron_zb.megatron.features.ep_overlap import PAIR_LABEL
    gpu = ctx.device == "cuda"
    traces = os.path.join(ctx.scratch, "ep_overlap_traces")
    case = V.make_case("dualpipe-v", 2, num_microbatches=8 if gpu else 4, iterations=2, device=ctx.device,
                       profile_dir=traces, attention_backend=ctx.attention_backend, **MOE, **(EP_MODEL if gpu else {}))
    ctx.plan.update(case=case.describe(), profile="torch.profiler over the last iteration, every rank",
                    note="all-to-all over gloo (through host copies) on one GPU, not NCCL across GPUs")
    if not ctx.runs:
        ctx.row("overlapped F&B pairs: other streams busy while the compute stream computes", "(GPU run)",
                "simulator: a pair hides each all-to-all behind the other's compute (docs/moe_overlap.md)")
        return
    ctx.need_cuda()
    _stage_on_cpu(ctx)
    # one hardware queue (Megatron's usual 1) would serialise the streams whose overlap this measures
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    ctx.figures["CUDA_DEVICE_MAX_CONNECTIONS"] = os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    r = V.run_verify_many([case], timeout=ctx.launch_timeout(5.0), mcore_path=ctx.mcore_path)[0]
    _verdicts(ctx, [r])
    ctx.figures["case"] = _case_figures(r)
    per_rank = {}
    for path in sorted(glob.glob(os.path.join(traces, "rank*.json"))):
        with open(path) as f:
            per_rank[os.path.basename(path)[:-5]] = stream_overlap(json.load(f).get("traceEvents", []), PAIR_LABEL)
    ctx.figures["streams"] = per_rank
    ctx.row("dualpipe-v PP=2 x DP=2 EP=2: equal to the reference; pairs run as one pass",
            f"{'yes' if r.get('passed') else 'NO'}; {r.get('overlapped_pairs')} pairs per iteration")
    for rank, o in per_rank.items():
        w = o.get("in_pairs") or o.get("whole")
        if not w:
            ctx.row(f"{rank}: streams", "no GPU events in the trace (CPU run)")
            continue
        where = f"in {o['pairs']} pair windows" if o.get("in_pairs") else "whole iteration (no pair windows)"
        share = "-" if w["overlap_share"] is None else f"{w['overlap_share']:.0%}"
        ctx.row(f"{rank}: other streams' activity during compute, {where}",
                f"{w['overlap_us'] / 1e3:.2f} of {w['other_busy_us'] / 1e3:.2f} ms ({share}); "
                f"compute busy {w['compute_busy_us'] / 1e3:.2f} ms", "all of it hidden (simulator's pair model)")
