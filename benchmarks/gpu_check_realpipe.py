"""The GPU check's ``realpipe`` section (``benchmarks/gpu_check.py``): a real pipeline on one GPU.

P = 2 and 4 pipeline ranks as processes on the one GPU, each in a CUDA green context of 1/P of the
SMs (``megatron_zb.verify.processes.green_context``; refused in one line where torch or the driver lacks them),
train a GPT of h4096 s2048 with 2 layers per rank (bf16, torch's scaled_dot_product_attention unless
``--attention-backend`` names megatron's local one, untied vocabulary 8192), M = 2P: Megatron's own
1F1B (megatron-core's ``get_forward_backward_func``, no megatron-zb), megatron-zb's zb-h1, zb-v,
v-half and zb-v with activation offload 0.5 (K measured at start-up). Messages go over gloo, staged
through the host (as the ``pipeline`` section's). The rank side is ``megatron_zb.verify.timing.realpipe``.

Measured per case: time per iteration (median of the iterations after the profiler's window, the
slowest rank's, each after a barrier) and each rank's CUDA allocator peak above the iteration's start.
Predicted: the simulator's synchronous iteration time (``core.iteration.iteration_times``) and peak
activation for the schedule that ran, fed by that run's own profile (megatron-zb's profiler:
``ScheduleOptions.profile_window``; Megatron's 1F1B: its own forward and backward steps timed with CUDA
events, its order the core's ``1f1b``, the message time from zb-h1's probe). A probe first says what
the green contexts did: a matmul's time on the whole GPU and in the share, a backward's in the share,
and every rank at once against one at a time (``concurrency``: P when the ranks ran at once).

A dry run predicts the same cases from plan's FLOP model (an H100 at 50% of its peak, each rank at its
share of the SMs); ``--tiny`` runs them on the CPU at tiny sizes without green contexts. Each launch's
raw records (profiles included) go to ``OUTDIR/realpipe_p<P>.jsonl``."""
from __future__ import annotations

import json
import os
import statistics
import time

import gpu_check_report as R
from gpu_check_sections import Context, SectionError

MODEL = dict(hidden=4096, heads=32, seq=2048, layers_per_rank=2, vocab=8192, mbs=1)
TINY_MODEL = dict(hidden=64, heads=4, seq=64, layers_per_rank=2, vocab=256, mbs=1)
RUNS = ((2, 4), (4, 8))  # (P, M): M = 2P
TINY_RUNS = ((2, 4),)
# (label, megatron-zb schedule or None for Megatron's own 1F1B, offload ratio)
CASES = (("megatron-1f1b", None, None), ("zb-h1", "zb-h1", None), ("zb-v", "zb-v", None),
         ("v-half", "v-half", None), ("zb-v+offload0.5", "zb-v", 0.5))
ITERATIONS, WINDOW = 5, (2, 2)  # warm-up 1, profiled 2, timed 3-5
FIRST_SHARE = 0.35  # of the section's time, for P=2's launch (its cases cost a third of P=4's or less)
PROBE, TINY_PROBE = dict(n=4096, reps=8), dict(n=64, reps=2)
DRY_GPU = ("h100", 132, 9)  # the dry run's GPU: name, SMs, compute capability major
DRY_EFFICIENCY, DRY_HOST_GBPS = 0.5, 25.0  # plan's efficiency; a PCIe 5 x16 link one way, for K
MEGATRON = "megatron-1f1b"
TURNS = 0.75  # concurrency under this share of P: the ranks took turns (a check that fails)
BACKWARD_LEFT = 0.7  # a backward matmul's time over a forward one's under this: it ran outside the share


def _attention(ctx: Context) -> str:
    return "flash" if ctx.attention_backend == "auto" else ctx.attention_backend


def make_job(ctx: Context, p: int, m: int, deadline: float, out: str) -> dict:
    """The one 'case' every rank of a launch gets (``verify.timing.realpipe.realpipe_rank``)."""
    gpu = ctx.device == "cuda"
    cases = [{"name": n, "schedule": s, **({"offload_ratio": r, "offload_time": "auto" if gpu else 0.5}
                                           if r is not None else {})} for n, s, r in CASES]
    return {"p": p, "m": m, "device": ctx.device, "green": gpu, "model": MODEL if gpu else TINY_MODEL,
            "attention_backend": _attention(ctx), "cases": cases, "iterations": ITERATIONS,
            "window": list(WINDOW), "probe": PROBE if gpu else TINY_PROBE, "deadline": deadline, "out": out,
            "timeout_s": 120.0, "first_case_s": 12.0 if gpu else 8.0}


# ------------------------------------------------------------------------------------------------
# the simulator's predictions
# ------------------------------------------------------------------------------------------------

def _timed(sched, st) -> tuple:
    from megatron_zb.core.sim.iteration import iteration_times
    from megatron_zb.core.sim.simulate import simulate
    return iteration_times(sched, st, 0.0).iteration_time, list(simulate(sched, st).peak_memory)


def predict_profile(profile: dict, p: int, m: int) -> dict:
    """The schedule that ran (the profile's ``built_schedule``) timed with the profile's per-chunk costs."""
    from megatron_zb.core.ir import io as sched_io
    from megatron_zb.core.ir import Setting
    from megatron_zb.runtime.observe.profile_data import profile_to_setting_kwargs
    sched = sched_io.from_json(json.dumps(profile["built_schedule"]))
    kw = profile_to_setting_kwargs(profile, per_chunk=True)
    st = Setting(p, m, chunks=sched.placement.chunks,
                 **{k: v for k, v in kw.items() if k in ("cost_f", "cost_b", "cost_w", "cost_bw", "cost_comm",
                                                         "mem_f", "mem_w")})
    t, peak = _timed(sched, st)
    return {"iteration_s": t, "peak_bytes": peak, "cost_comm_s": kw.get("cost_comm")}


def predict_megatron(passes: list, p: int, m: int, comm: float) -> dict:
    """Megatron's 1F1B as the core's ``1f1b`` order, each rank's F and fused backward as timed in its run."""
    from megatron_zb.core.build import ScheduleRequest, build
    f = [x["f"] or 0.0 for x in passes]
    bw = [x["bw"] or 0.0 for x in passes]
    mf = [float(x["mem_f"] or 0.0) for x in passes]
    req = ScheduleRequest("1f1b", cost_f=f, cost_b=bw, cost_w=[0.0] * p, cost_comm=comm, mem_f=mf,
                          mem_w=[0.0] * p)
    built = build(req, p, m)
    t, peak = _timed(built.schedule, built.setting)
    return {"iteration_s": t, "peak_bytes": peak, "cost_comm_s": comm}


def flop_prediction(model: dict, p: int, m: int) -> list:
    """The dry run's: every case from plan's FLOP and activation model of one layer (an H100 at
    ``DRY_EFFICIENCY`` of its peak, each rank at its share of the SMs; the output layer left out), K
    from an assumed host link of ``DRY_HOST_GBPS``. Rows: case, iteration seconds, peak bytes per rank."""
    from megatron_zb.core.build import OffloadRequest, ScheduleRequest, build
    from megatron_zb.core.costs.model import ModelSpec
    from megatron_zb.core.plan import GPU_PEAK_TFLOPS
    from megatron_zb.verify.processes.green_context import sm_share
    gpu, sms, major = DRY_GPU
    spec = ModelSpec(num_layers=model["layers_per_rank"] * p, hidden_size=model["hidden"],
                     num_attention_heads=model["heads"], seq_length=model["seq"], micro_batch_size=model["mbs"],
                     vocab_size=model["vocab"], flash_attention=True, activation_bytes=2, dropout=False,
                     untie_embeddings_and_output_weights=True)
    speed = GPU_PEAK_TFLOPS[gpu] * 1e12 * DRY_EFFICIENCY * sm_share(sms, p, major) / sms
    f, b, w = (model["layers_per_rank"] * x / speed for x in spec.layer_flops(0))
    mf, mw = (model["layers_per_rank"] * x for x in spec.layer_activation_bytes(0))
    k = mf / (DRY_HOST_GBPS * 1e9) / (f + b)
    out = []
    for label, sched, ratio in CASES:
        req = ScheduleRequest(sched or "1f1b", cost_f=[f] * p, cost_b=[b] * p, cost_w=[w] * p, mem_f=[mf] * p,
                              mem_w=[mw] * p, offload=OffloadRequest(ratio=ratio, time=k) if ratio else None)
        built = build(req, p, m)
        t, peak = _timed(built.schedule, built.setting)
        out.append({"case": label, "iteration_s": t, "peak_bytes": peak, "offload_time_k": k if ratio else None})
    return out


def _speedups(cases: list, key: str) -> None:
    base = next((c for c in cases if c["case"] == MEGATRON and c.get(key)), None)
    for c in cases:
        if base is not None and c.get(key):
            c[f"speedup_{key.split('_')[0]}"] = base[key] / c[key]


def evaluate(records: list, p: int, m: int) -> dict:
    """The section's figures for one launch from its JSON lines: the probe and, per case, measured
    against predicted (errors kept per case)."""
    out = {"p": p, "m": m, "probe": None, "green": None, "cases": []}
    comm = next((r["profile"].get("cost_comm") or 0.0 for r in records
                 if r.get("schedule") == "zb-h1" and r.get("profile")), 0.0)
    for r in records:
        if "probe" in r:
            out["probe"] = {k: v for k, v in r["probe"].items() if k != "ranks"}
            out["green"] = r.get("green")
            continue
        c = {"case": r["case"], "schedule": r.get("schedule"), "offload_ratio": r.get("offload_ratio")}
        if r.get("skipped"):
            c["skipped"] = r["skipped"]
            out["cases"].append(c)
            continue
        c.update(measured_s=r.get("median_iteration_s"), iteration_s=r.get("iteration_s"),
                 peak_bytes=r.get("peak_bytes"), loss=r.get("loss"), wall_s=r.get("wall_s"))
        try:
            if r.get("profile"):
                pred = predict_profile(r["profile"], p, m)
            elif r.get("megatron_passes"):
                pred = predict_megatron(r["megatron_passes"], p, m, comm)
                c["passes"] = r["megatron_passes"]
            else:
                raise ValueError("no profile in the record")
            c.update(simulated_s=pred["iteration_s"], predicted_peak_bytes=pred["peak_bytes"],
                     cost_comm_s=pred["cost_comm_s"])
            if c["measured_s"] and c["simulated_s"]:
                c["error_pct"] = 100.0 * (c["measured_s"] / c["simulated_s"] - 1.0)
        except Exception as e:  # noqa: BLE001 - one case's prediction; the others go on
            c["prediction_error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        out["cases"].append(c)
    _speedups(out["cases"], "measured_s")
    _speedups(out["cases"], "simulated_s")
    return out


# ------------------------------------------------------------------------------------------------
# rows
# ------------------------------------------------------------------------------------------------

def _gib_list(xs) -> str:
    """Bytes per rank in GiB (MiB where every one is under 0.1 GiB: the tiny run's)."""
    if not xs or any(x is None for x in xs):
        return "-"
    unit, name = (2 ** 30, "GiB") if max(xs) >= 0.1 * 2 ** 30 else (2 ** 20, "MiB")
    return " / ".join(f"{x / unit:.2f}" for x in xs) + f" {name}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.3f}x"


def probe_row(ctx: Context, run: dict) -> None:
    pr, g, p = run.get("probe") or {}, run.get("green"), run["p"]
    share = f"{g['num_sms']} of {g['total_sms']} SMs per rank" if g else "no green context (CPU)"
    conc = pr.get("concurrency")
    ctx.row(f"P={p}: green contexts; a matmul's speed in the share, a backward's against a forward's, "
            "every rank at once against one at a time",
            f"{share}; share speed {_x(pr.get('share_speed'))} of the whole GPU; backward/forward "
            f"{_x(pr.get('backward_ratio'))}; concurrency {'-' if conc is None else f'{conc:.2f}'} of {p}",
            f"a real pipeline: concurrency {p} (ranks at once), backward/forward 1.0x")
    if g and conc is not None and conc < TURNS * p:
        ctx.row(f"P={p}: the ranks took turns on the GPU", "the times below are not a real pipeline's",
                "processes of one GPU time-slice it unless MPS runs (green contexts split SMs within one process)")
        ctx.fail(f"P={p}: the ranks took turns on the GPU (concurrency {conc:.2f} of {p}): not a real pipeline")
    back = pr.get("backward_ratio")
    if g and back is not None and back < BACKWARD_LEFT:
        ctx.fail(f"P={p}: a backward matmul ran {1 / back:.1f}x faster than a forward one: the backward left the "
                 "green context (its SMs are not the rank's share)")


def case_row(ctx: Context, run: dict, c: dict) -> None:
    what = f"P={run['p']} M={run['m']} {c['case']}: ms per iteration; allocator peak above its start, per rank"
    if c.get("skipped"):
        ctx.row(what, f"skipped: {c['skipped']}")
        return
    meas = f"{R.ms(c.get('measured_s'))} ({_x(c.get('speedup_measured'))} Megatron's 1F1B); peak " \
           f"{_gib_list(c.get('peak_bytes'))}"
    if c.get("prediction_error"):
        ctx.row(what, meas, f"no prediction: {c['prediction_error']}")
        return
    ctx.row(what, meas, f"simulated {R.ms(c.get('simulated_s'))} ({R.pct((c.get('error_pct') or 0) / 100)} "
            f"measured), {_x(c.get('speedup_simulated'))}; activations {_gib_list(c.get('predicted_peak_bytes'))}")


def _read(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------
# the section
# ------------------------------------------------------------------------------------------------

def realpipe(ctx: Context) -> None:
    gpu = ctx.device == "cuda"
    model, runs = (MODEL, RUNS) if gpu else (TINY_MODEL, TINY_RUNS)
    outdir = getattr(ctx, "outdir", None) or ctx.scratch
    outs = {p: os.path.join(outdir, f"realpipe_p{p}.jsonl") for p, _ in runs}
    jobs = {p: make_job(ctx, p, m, 0.0, outs[p]) for p, m in runs}
    ctx.plan.update(
        launches={f"P={p}": f"verify.processes.launch.run_cases(megatron_zb.verify.timing.realpipe.realpipe_rank, [job], {p}, "
                            f"backend='gloo'): {', '.join(c['name'] for c in jobs[p]['cases'])} at M={m}"
                  for p, m in runs},
        model=dict(model, dtype="bf16", attention=_attention(ctx), ranks="processes sharing one GPU"),
        green="a green context of 1/P of the SMs per rank (torch.cuda.green_contexts)" if gpu else
              "none on a CPU: the tiny mode runs without green contexts",
        iterations=f"{ITERATIONS} per case: the first warms up, the profiler's window {WINDOW[0]}-{WINDOW[1]}, "
                   "the rest timed",
        measured="slowest rank's time per iteration after a barrier; torch.cuda.max_memory_allocated above "
                 "each iteration's start", predicted="core.iteration.iteration_times and the simulator's peak "
                                                     "for the schedule that ran, fed by that run's profile",
        outputs=[outs[p] for p, _ in runs])
    dry = {f"P={p}": flop_prediction(MODEL, p, m) for p, m in RUNS}
    ctx.figures["flop_prediction"] = dry
    if not ctx.runs:
        for (p, m), (key, rows) in zip(RUNS, dry.items()):
            _speedups(rows, "iteration_s")
            for r in rows:
                ctx.row(f"{key} M={m} {r['case']}: ms per iteration; activation peak per rank", "(GPU run)",
                        f"plan's FLOPs at {DRY_EFFICIENCY:.0%} of an H100 share: {R.ms(r['iteration_s'])} "
                        f"({_x(r.get('speedup_iteration'))} 1F1B); {_gib_list(r['peak_bytes'])}")
        return
    ctx.need_cuda()
    from megatron_zb.verify.processes import launch as L
    from megatron_zb.verify.processes.green_context import api_problem
    from megatron_zb.verify.timing.realpipe import realpipe_rank
    if gpu:
        problem = api_problem()
        if problem:
            raise SectionError(f"green contexts unavailable: {problem}")
    else:
        ctx.row("green contexts", "none on a CPU: the tiny mode runs without them", "")
    ctx.figures["runs"] = []
    for i, (p, m) in enumerate(runs):
        left = ctx.remaining()
        budget = left * (FIRST_SHARE if i == 0 and len(runs) > 1 else 1.0) - 5.0
        if budget < 20.0:
            ctx.fail(f"P={p}: no time left ({left:.0f} s)")
            continue
        if os.path.exists(outs[p]):
            os.remove(outs[p])
        job = make_job(ctx, p, m, time.time() + budget - 8.0, outs[p])  # the ranks' last case start
        t0 = time.time()
        try:
            L.run_cases(realpipe_rank, [job], p, L.LaunchOptions(timeout=budget, backend="gloo", cpu_shims=not gpu,
                                                                 mcore_path=ctx.mcore_path))
            error = None
        except L.LaunchError as e:
            error = (str(e).strip().splitlines() or [type(e).__name__])[0][:400]
            if "GreenContextUnavailable" in str(e):
                raise SectionError(f"green contexts unavailable: {error}") from None
        run = evaluate(_read(outs[p]), p, m)
        run.update(wall_s=round(time.time() - t0, 1), error=error, records=outs[p])
        ctx.figures["runs"].append(run)
        if error:
            ctx.fail(f"P={p}: {error}")
        probe_row(ctx, run)
        for c in run["cases"]:
            case_row(ctx, run, c)
            if c.get("prediction_error"):
                ctx.fail(f"P={p} {c['case']}: no prediction ({c['prediction_error']})")
        done = [c for c in run["cases"] if c.get("measured_s")]
        if not done:
            ctx.fail(f"P={p}: no case ran to the end")
        errs = [abs(c["error_pct"]) for c in done if c.get("error_pct") is not None]
        if errs:
            run["median_abs_error_pct"] = statistics.median(errs)
