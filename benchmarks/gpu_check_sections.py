"""The GPU check's sections that time one process (``benchmarks/gpu_check.py``): env, offload,
postval, fbw; and ``Context``, what every section gets. The verify-based sections (memory,
pipeline, ep_overlap) are in ``gpu_check_verify.py``.

A section fills its record through the context: ``plan`` (what it runs: command lines, cases,
sizes), ``figures`` (every number, for the JSON), ``row(what, measured, predicted)`` (the markdown)
and ``fail(problem)`` (it ran, a check did not pass). In a dry run it plans and predicts only; with
``tiny`` it runs on the CPU at tiny sizes; else on the GPU, at the sizes below. Each reuses the
benchmark or verify code that already measures its figure."""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import zipfile

import gpu_check_report as R


class UsageError(Exception):
    """Bad input: one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# one H100 layer, fp32, as recorded (benchmarks/results/fbw_h100_h4096_s4096.json): the dry run's costs
RECORDED_H100_FBW_S = (43.8e-3, 59.2e-3, 32.0e-3)


class SectionError(RuntimeError):
    """A section cannot run here (e.g. no CUDA device): its one-line error."""


class Context:
    def __init__(self, name, *, dry, tiny, deadline, scratch, mcore_path, wheels, gpu_python, record):
        self.name, self.dry, self.tiny, self.deadline = name, dry, tiny, deadline
        self.scratch, self.mcore_path, self.wheels, self.gpu_python = scratch, mcore_path, wheels, gpu_python
        self.record = record
        self.figures, self.plan = record["figures"], record["plan"]
        self.attention_backend = "auto"  # --attention-backend: flash/fused = torch's SDPA core attention
        self.outdir = None  # OUTDIR (a section's own files beside gpu_check.json)

    def attention_argv(self) -> list:
        """A benchmark script's ``--attention-backend`` (none for the default)."""
        return [] if self.attention_backend == "auto" else ["--attention-backend", self.attention_backend]

    @property
    def runs(self) -> bool:
        """Whether this section executes anything (a dry run without --tiny only plans)."""
        return self.tiny or not self.dry

    @property
    def device(self) -> str:
        """Where the section's work runs: the GPU's sizes unless --tiny (planned, in a dry run)."""
        return "cpu" if self.tiny else "cuda"

    def remaining(self) -> float:
        return self.deadline - time.time()

    def launch_timeout(self, after: float = 0.0) -> float:
        """A verify launch's timeout: what is left, less what stopping a launch that ran out takes
        (its report and clean-up, up to ~15 s) and ``after`` (work after the launch)."""
        return max(10.0, self.remaining() - 15.0 - after)

    def row(self, what, measured, predicted="") -> None:
        self.record["rows"].append({"what": what, "measured": measured, "predicted": predicted})

    def fail(self, problem: str) -> None:
        self.record["status"] = "failed"
        self.record.setdefault("problems", []).append(problem)

    def need_cuda(self) -> None:
        if self.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise SectionError("no CUDA device here: run it on the GPU machine (or --dry-run / --tiny on a CPU)")


def bench(name: str):
    """A benchmark script of benchmarks/ as a module (its command-line parsing and measuring code)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return importlib.import_module(name)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _med(xs):
    xs = list(xs)
    return statistics.median(xs[1:] or xs) if xs else None


# ------------------------------------------------------------------------------------------------
# env: the machine and the wheels brought along
# ------------------------------------------------------------------------------------------------

# what the GPU machine's image holds of megatron-core's requirements (device tool's KINDS.md, read
# 2026-11; None: there, version not recorded)
GPU_IMAGE = {"torch": "2.11.0", "numpy": "2.5.2", "packaging": None}


def _unmet(requires, carried) -> list:
    """Requirements neither carried as a wheel nor met by the GPU machine's image."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging comes with megatron-core
        return []
    out = []
    for text in requires:
        try:
            req = Requirement(text)
        except ValueError:
            continue
        name = req.name.lower().replace("_", "-")
        if name in carried:
            continue
        if name not in GPU_IMAGE:
            out.append(f"needs {text}, which the GPU machine lacks: carry its wheel too")
        elif GPU_IMAGE[name] and not req.specifier.contains(GPU_IMAGE[name], prereleases=True):
            out.append(f"needs {text}, the GPU machine has {name} {GPU_IMAGE[name]}")
    return out


def check_wheels(folder: str, gpu_python: str) -> dict:
    """The megatron-core wheel(s) in ``folder``: one version only (pip stops on two), built for the
    GPU machine's Python (cpXY tag or py3), Requires-Python met, and each Requires-Dist carried too or
    met by the GPU machine's image (``GPU_IMAGE``)."""
    tag = "cp" + gpu_python.replace(".", "")
    out = {"folder": folder, "python": gpu_python, "wheels": [], "problems": []}
    paths = sorted(glob.glob(os.path.join(folder, "*.whl")))
    out["wheels"] = [os.path.basename(p) for p in paths]
    mc = [p for p in paths if os.path.basename(p).lower().startswith("megatron_core-")]
    if not mc:
        out["problems"].append(f"no megatron-core wheel in {folder} (bash scripts/gpu_check.sh --fetch-wheels)")
    versions = sorted({os.path.basename(p).split("-")[1] for p in mc})
    if len(versions) > 1:
        out["problems"].append(f"several megatron-core versions {versions}: pip installs one (keep one)")
    for p in mc:
        name = os.path.basename(p)
        if not (f"-{tag}-" in name or "-py3-none-" in name):
            out["problems"].append(f"{name} is not built for Python {gpu_python} ({tag})")
        try:
            with zipfile.ZipFile(p) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                text = z.read(meta).decode("utf-8", "replace")
        except (OSError, zipfile.BadZipFile, StopIteration) as e:
            out["problems"].append(f"{name}: not a readable wheel ({type(e).__name__})")
            continue
        out["requires"] = [l.split(":", 1)[1].strip() for l in text.splitlines()
                           if l.startswith("Requires-Dist:") and "extra ==" not in l]
        req_py = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("Requires-Python:")), "")
        out["requires_python"] = req_py
        carried = {os.path.basename(q).split("-")[0].lower().replace("_", "-") for q in paths}
        out["problems"] += [f"{name}: {u}" for u in _unmet(out["requires"], carried)]
        try:
            from packaging.specifiers import SpecifierSet
            if req_py and gpu_python not in SpecifierSet(req_py):
                out["problems"].append(f"{name} requires Python {req_py}, the GPU machine has {gpu_python}")
        except ImportError:  # pragma: no cover - packaging comes with megatron-core
            pass
    out["ok"] = not out["problems"]
    out["gpu_image"] = GPU_IMAGE
    return out


def env(ctx: Context) -> None:
    ctx.plan.update(checks="Python, torch and its CUDA, the GPU, megatron-core importable (the carried wheel), "
                           "numpy, packaging >= 24.2" + ("; the wheels to bring" if ctx.dry else ""),
                    wheels=ctx.wheels, gpu_python=ctx.gpu_python)
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "host": platform.node()}
    import torch
    info.update(torch=torch.__version__, cuda_runtime=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))), gpus=torch.cuda.device_count())
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    try:
        from megatron_zb.megatron.cpu import cpu_shims
        cpu_shims.python_compat()
        cpu_shims.apply()  # without CUDA only (megatron-core >= 0.19 imports triton): as every CPU run here
        import megatron.core
        from megatron.core import package_info
        info["megatron_core"] = package_info.__version__
        info["megatron_core_path"] = os.path.dirname(megatron.core.__file__)
    except Exception as e:  # noqa: BLE001 - recorded: every megatron section needs it
        ctx.fail(f"megatron-core does not import: {type(e).__name__}: {e}")
    for mod in ("numpy", "packaging"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001
            ctx.fail(f"{mod} does not import (megatron-core needs it)")
    try:
        from packaging.version import Version
        if Version(info.get("packaging", "0")) < Version("24.2"):
            ctx.fail(f"packaging {info.get('packaging')} < 24.2 (megatron-core's requirement)")
    except Exception:  # noqa: BLE001
        pass
    ctx.figures.update(info)
    ctx.row("machine", f"{info.get('gpu', 'no GPU')}, {info['cpus']} CPUs, Python {info['python']}")
    ctx.row("torch / megatron-core", f"torch {info['torch']} (CUDA {info['cuda_runtime']}), "
                                     f"megatron-core {info.get('megatron_core', 'MISSING')}")
    if ctx.dry:  # the wheels to carry to the GPU machine (it has no network)
        w = check_wheels(ctx.wheels, ctx.gpu_python)
        ctx.figures["wheels"] = w
        ctx.row("wheels to bring", ", ".join(w["wheels"]) or "none", "; ".join(w["problems"]) or "ready")
        for p in w["problems"]:
            if "no megatron-core wheel" not in p:  # absent here (CI) is fine: fetched before a GPU run
                ctx.fail(p)
    elif ctx.device == "cuda" and not info["cuda_available"]:
        ctx.fail("no CUDA device")


# ------------------------------------------------------------------------------------------------
# offload: one GPT stage with and without activation offload (benchmarks/bench_offload_gpu.py)
# ------------------------------------------------------------------------------------------------

OFFLOAD_ARGV = ["--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--rank", "0", "--layers", "1",
                "--hidden", "4096", "--heads", "32", "--seq", "4096", "--dtype", "bf16", "--repeats", "2",
                "--offload-time", "0.5", "--device", "cuda"]
OFFLOAD_TINY_ARGV = ["--schedule", "zb-h1", "--stages", "4", "--microbatches", "4", "--device", "cpu", "--tiny"]
OFFLOAD_RATIOS = (0.5, 1.0)


def offload_prediction(a, f, b, w, k, ratio):
    """The simulator for the benchmark's rank: its peak (mem-f units) and makespan with and without
    offload at these costs (seconds) and K."""
    from megatron_zb.core.build import OffloadRequest, ScheduleRequest, build
    req = ScheduleRequest(a.schedule, cost_f=[f], cost_b=[b], cost_w=[w])
    base = build(req, a.stages, a.microbatches).result
    off = build(req.replace(offload=OffloadRequest(ratio=ratio, time=k)), a.stages, a.microbatches).result
    return {"peak_mem_f": off.peak_memory[a.rank], "peak_mem_f_no_offload": base.peak_memory[a.rank],
            "makespan_s": off.makespan, "makespan_no_offload_s": base.makespan,
            "time_ratio": off.makespan / base.makespan}


def offload(ctx: Context) -> None:
    B = bench("bench_offload_gpu")
    argv = (OFFLOAD_TINY_ARGV if ctx.device == "cpu" else OFFLOAD_ARGV) + ctx.attention_argv()
    a = B.parse_args(argv, parser=OneLineParser)
    ctx.plan.update(command="python benchmarks/bench_offload_gpu.py " + " ".join(argv) + " --ratio R",
                    ratios=list(OFFLOAD_RATIOS), note="one rank's action list back to back, no peers: no "
                    "pipeline gap hides a reload (pessimistic for the time)")
    if ctx.dry:  # the simulator with the recorded fp32 H100 layer costs and the planned K
        f, b, w = RECORDED_H100_FBW_S
        for r in OFFLOAD_RATIOS:
            p = offload_prediction(a, f, b, w, a.offload_time, r)
            ctx.figures[f"dry_prediction_ratio_{r:g}"] = p
            ctx.row(f"simulated, ratio {r:g} (recorded H100 costs, K {a.offload_time:g})",
                    f"rank {a.rank} peak {p['peak_mem_f']:.2f} of {p['peak_mem_f_no_offload']:.2f} microbatches",
                    f"time x{p['time_ratio']:.3f}")
    if not ctx.runs:
        return
    ctx.need_cuda()
    if ctx.device == "cpu":
        from megatron_zb.megatron.cpu import cpu_shims
        cpu_shims.apply()
    import torch
    os.environ["MASTER_PORT"] = free_port()
    B.setup_process(torch.device(a.device))
    base = B.run(a, offload=False)
    runs = {}
    for r in OFFLOAD_RATIOS:
        a.ratio = r
        runs[r] = B.run(a, offload=True)
    k = B.measured_k(a, runs[max(OFFLOAD_RATIOS)])
    ctx.figures.update(no_offload=base, **{f"ratio_{r:g}": v for r, v in runs.items()}, k=k)
    ps = base["pass_s"]
    f, b, w = ps.get("F"), ps.get("B", ps.get("BW")), ps.get("W", 0.0)
    nbytes = k["captured_bytes_per_forward"]
    peak0 = base["max_memory_allocated_above_model_bytes"]
    ctx.row("no offload: peak allocator above the model; F / B / W",
            f"{R.gib(peak0)}; {R.ms(f)} / {R.ms(b)} / {R.ms(w)}; {R.ms(base['time_per_microbatch_s'])} per microbatch")
    for r, res in runs.items():
        p = offload_prediction(a, f, b, w, k["measured_k"], r)
        p["peak_bytes"] = p["peak_mem_f"] * nbytes
        ctx.figures[f"prediction_ratio_{r:g}"] = p
        q = res["pass_s"]
        peak = res["max_memory_allocated_above_model_bytes"]
        saved = (1 - peak / peak0) if peak0 else None
        ctx.row(f"offload ratio {r:g}: peak allocator; F / B / W; time per microbatch",
                f"{R.gib(peak)} ({R.pct(-saved) if saved is not None else '-'}); {R.ms(q.get('F'))} / "
                f"{R.ms(q.get('B', q.get('BW')))} / {R.ms(q.get('W'))}; time "
                f"{R.pct(res['time_per_microbatch_s'] / base['time_per_microbatch_s'] - 1)}",
                f"peak {p['peak_mem_f']:.2f} x {R.gib(nbytes)} = {R.gib(p['peak_bytes'])} of activations "
                f"(no offload {p['peak_mem_f_no_offload']:.2f}); pipeline time {R.pct(p['time_ratio'] - 1)}")
    ctx.row("measured K (one-way copy of a stage activation / (F+B))",
            f"{k['measured_k']:.3f} (link {k['host_link']['d2h_gbps']:.1f} / {k['host_link']['h2d_gbps']:.1f} GB/s "
            f"D2H / H2D, {R.gib(nbytes)} per F)", f"--auto-offload-time estimate {k['auto_offload_time_estimate']:.3f}")


# ------------------------------------------------------------------------------------------------
# postval: the eager step and the rollback against Megatron's step (verify.model.step_timing)
# ------------------------------------------------------------------------------------------------

POSTVAL_SIZE = {"layers": 2, "hidden": 2048, "seq": 2048, "iterations": 6}
POSTVAL_TINY = {"layers": 2, "hidden": 64, "seq": 32, "iterations": 3, "device": "cpu"}


def postval(ctx: Context) -> None:
    from megatron_zb.verify.processes import launch as L
    from megatron_zb.verify.model.step_timing import gpu_step_timing
    size = POSTVAL_TINY if ctx.device == "cpu" else POSTVAL_SIZE
    # clip 0: every step stands (the eager path); clip 1e-3: every step is clipped (the rollback path)
    cases = [dict(size, clip=c, compare_in_rank=True, attention_backend=ctx.attention_backend) for c in (0.0, 1e-3)]
    gpu = ctx.device == "cuda"
    ctx.plan.update(cases=cases, ranks=1, backend="nccl" if gpu else "gloo", model="megatron GPT, bf16, "
                    "Megatron's Adam, vocabulary 32000", function="megatron_zb.verify.model.step_timing.gpu_step_timing")
    shape = f"{size['layers']} layers h{size['hidden']} s{size['seq']}"
    if not ctx.runs:
        ctx.row(f"Megatron's step / eager step + validation / rollback ({shape}, one rank, {size['iterations']} "
                "iterations each)", "(GPU run)", "the eager step does the step's work; a rollback costs one step")
        return
    ctx.need_cuda()
    eager, rollback = [r[0] for r in L.run_cases(gpu_step_timing, cases, 1, L.LaunchOptions(
        timeout=ctx.launch_timeout(), backend="nccl" if gpu else "gloo", cpu_shims=not gpu, mcore_path=ctx.mcore_path))]
    meg, pv = _med(eager["megatron"]["times"]), _med(eager["post-validated"]["times"])
    meg_clipped, redo = _med(rollback["megatron"]["times"]), _med(rollback["post-validated"]["redo"])
    ctx.figures.update(eager=eager, rollback=rollback, megatron_step_s=meg, eager_step_and_validation_s=pv,
                       megatron_clipped_step_s=meg_clipped, rollback_and_redo_s=redo)
    n = size["iterations"]
    for res, what in ((eager, "clean steps"), (rollback, "clipped steps")):
        if not res.get("bit_identical"):
            ctx.fail(f"post-validated parameters differ from Megatron's ({what})")
    if eager["post-validated"]["rollbacks"] != 0 or rollback["post-validated"]["rollbacks"] != n:
        ctx.fail(f"rollbacks {eager['post-validated']['rollbacks']} (clean) / {rollback['post-validated']['rollbacks']} "
                 f"(clipped), expected 0 / {n}")
    ctx.row(f"Megatron's synchronous step ({shape}, one rank)", R.ms(meg))
    ctx.row("post-validated eager step + its validation", f"{R.ms(pv)} ({pv / meg:.3f}x)" if meg else R.ms(pv),
            "the same work as the step (simulator: no added time on the critical path)")
    ctx.row("rollback + Megatron's own step (every step clipped)", f"{R.ms(redo)} (Megatron's clipped step "
            f"{R.ms(meg_clipped)})", "one extra step per rollback (docs/post_validation.md)")


# ------------------------------------------------------------------------------------------------
# fbw: one megatron-core layer's F/B/W at two sizes (benchmarks/bench_split_overhead.py)
# ------------------------------------------------------------------------------------------------

FBW_SIZES = ((4096, 32, 4096), (2048, 16, 2048))  # hidden, heads, sequence
FBW_TINY = ((64, 4, 32), (128, 4, 64))


def plan_layer_costs(h, heads, s, dtype_bytes=2):
    """plan's F/B/W of one layer (FLOPs; seconds at its default H100 peak x efficiency)."""
    from megatron_zb.core.costs.model import ModelSpec
    from megatron_zb.core.plan import GPU_PEAK_TFLOPS
    spec = ModelSpec(num_layers=1, hidden_size=h, num_attention_heads=heads, seq_length=s, micro_batch_size=1,
                     flash_attention=False, activation_bytes=dtype_bytes, dropout=False)
    flops = spec.layer_flops(0)
    peak, eff = GPU_PEAK_TFLOPS["h100"] * 1e12, 0.5
    return {"flops": list(flops), "peak_tflops": peak / 1e12, "efficiency": eff,
            "seconds": [x / (peak * eff) for x in flops]}


def fbw(ctx: Context) -> None:
    gpu = ctx.device == "cuda"
    sizes = FBW_SIZES if gpu else FBW_TINY
    runs = []
    for h, heads, s in sizes:
        out = os.path.join(ctx.scratch, f"fbw_h{h}_s{s}.json")
        argv = ["--device", ctx.device, "--dtype", "bf16" if gpu else "fp32", "--hidden", str(h), "--heads",
                str(heads), "--seq", str(s), "--reps", "5" if gpu else "1", "--warmup", "2" if gpu else "0", "--out", out] \
            + ctx.attention_argv()
        runs.append(((h, heads, s), argv, out))
    ctx.plan.update(commands=["python benchmarks/bench_split_overhead.py " + " ".join(v) for _, v, _ in runs])
    if ctx.dry:  # its command lines parse (importing it applies the CPU shims: fine in this process)
        S = bench("bench_split_overhead")
        for _, argv, _ in runs:
            S.parse_args(argv, parser=OneLineParser)
    for i, ((h, heads, s), argv, out) in enumerate(runs):
        p = plan_layer_costs(h, heads, s)
        ctx.figures[f"plan_h{h}_s{s}"] = p
        pred = " / ".join(R.ms(x) for x in p["seconds"])
        if not ctx.runs:
            ctx.row(f"one layer h{h} s{s} bf16: F / B / W", "(GPU run)", f"plan {pred} at {p['efficiency']:.0%} "
                    f"of {p['peak_tflops']:g} TFLOPS")
            continue
        ctx.need_cuda()
        proc = subprocess.run([sys.executable, os.path.join(HERE, "bench_split_overhead.py")] + argv, cwd=ROOT,
                              timeout=max(5.0, ctx.remaining() / (len(runs) - i)))
        if proc.returncode != 0:
            ctx.fail(f"bench_split_overhead h{h} s{s} exited with {proc.returncode}")
            continue
        import json
        with open(out) as fh:
            res = json.load(fh)
        ctx.figures.setdefault("runs", []).append(res)
        m = res["median_s"]
        eff = [fl / (t * p["peak_tflops"] * 1e12) if t else None for fl, t in zip(p["flops"], (m["f"], m["b"], m["w"]))]
        ctx.figures[f"efficiency_h{h}_s{s}"] = eff
        ctx.row(f"one layer h{h} s{s} {res['config']['dtype']}: F / B / W",
                f"{R.ms(m['f'])} / {R.ms(m['b'])} / {R.ms(m['w'])} (B+W {res['ratio_b_plus_w_over_fused']:.3f}x the "
                f"fused backward); " + " / ".join("-" if e is None else f"{e:.0%}" for e in eff) + " of peak",
                f"plan {pred} at {p['efficiency']:.0%} of {p['peak_tflops']:g} TFLOPS")
