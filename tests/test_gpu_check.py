"""The GPU check (``scripts/gpu_check.sh``, ``benchmarks/gpu_check.py``; issue 36) cannot break
unseen: its dry run goes through the script on this CPU (wheels, every section's command lines and
cases, output paths) and writes the JSON and the markdown table; bad input is one line and exit
code 2; a section that fails or hangs is recorded while the others go on; the pieces it measures
with (the profiler trace's stream overlap, the wheel check, point-to-point staging through host
copies for ranks that share a GPU) are checked on their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
from tests._host import overload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
SECTIONS = ("env", "offload", "postval", "memory", "pipeline", "ep_overlap", "fbw", "trough", "realpipe")


def _bench_path():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)


def _env(**extra):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _run(args, timeout=300, **env):
    return subprocess.run(["bash", SCRIPT] + args, cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.megatron
def test_dry_run_writes_every_section_json_and_markdown(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl")
    out = tmp_path / "out"
    # the budgets are the GPU run's; a CPU host busier than its cores stretches them (tests/_host.py)
    stretch = round(overload(), 2)
    p = _run(["--dry-run", str(out), "--stretch", str(stretch)], MZB_WHEELS=str(wheels))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["dry_run"] and rep["ok"] and list(rep["sections"]) == list(SECTIONS)
    assert rep["stretch"] == stretch and rep["wall_s"] < rep["budget_s"] <= 480 * stretch
    for name, sec in rep["sections"].items():
        assert sec["status"] == "dry-run", (name, sec)
        assert sec["plan"] and sec["rows"], name
        assert sec["wall_s"] <= sec["budget_s"], name
    assert sum(s["budget_s"] for s in rep["sections"].values()) <= 450 * stretch + 1
    env = rep["sections"]["env"]["figures"]
    assert env["megatron_core"] and env["wheels"]["ok"], env
    assert env["wheels"]["wheels"] == ["megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"]
    # what the GPU run would run, at the GPU's sizes
    plans = {n: s["plan"] for n, s in rep["sections"].items()}
    assert "--hidden 4096 --heads 32 --seq 4096 --dtype bf16" in plans["offload"]["command"]
    assert [len(v) for v in plans["pipeline"]["launches"].values()] == [16, 16]
    assert len(plans["memory"]["cases"]) == 9 and "ep-overlap" in plans["ep_overlap"]["case"]
    assert len(plans["fbw"]["commands"]) == 2 and all("--device cuda" in c for c in plans["fbw"]["commands"])
    assert plans["trough"]["subgroups"] * plans["trough"]["state_bytes_per_subgroup"] >= 2 ** 30  # GiB of states
    rp = plans["realpipe"]
    assert list(rp["launches"]) == ["P=2", "P=4"] and all(
        "realpipe_rank" in v and "megatron-1f1b, zb-h1, zb-v, v-half, zb-v+offload0.5" in v for v in rp["launches"].values())
    assert rp["model"]["hidden"] == 4096 and rp["model"]["seq"] == 2048 and rp["model"]["attention"] == "flash"
    assert [os.path.basename(o) for o in rp["outputs"]] == ["realpipe_p2.jsonl", "realpipe_p4.jsonl"]
    dry = rep["sections"]["realpipe"]["figures"]["flop_prediction"]
    assert [len(v) for v in dry.values()] == [5, 5]
    for rows in dry.values():  # the simulator at plan's FLOPs: zb-v beats Megatron's 1F1B, offload lowers zb-v's peak
        t = {r["case"]: r["iteration_s"] for r in rows}
        assert t["zb-v"] < t["zb-h1"] < t["megatron-1f1b"]
    assert max(dry["P=4"][4]["peak_bytes"]) <= max(dry["P=4"][2]["peak_bytes"])
    off = rep["sections"]["offload"]["figures"]
    assert off["dry_prediction_ratio_1"]["peak_mem_f"] < off["dry_prediction_ratio_1"]["peak_mem_f_no_offload"]
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: dry run")
    for name in SECTIONS:
        assert f"| {name} | dry-run |" in md, name
    assert (out / "gpu_check.log").stat().st_size > 0
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    for args in ([], ["--sections", "nope", str(tmp_path)], [str(afile)], ["--budgets", "offload=-1", str(tmp_path)],
                 ["--budget-s", "0", str(tmp_path)], ["--mcore-path", str(tmp_path), str(tmp_path)],
                 ["--fetch-wheels", "extra"]):
        p = _run(args, timeout=60)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, (args, p.stderr)


@pytest.mark.megatron
@pytest.mark.version_free  # the GPU check's own section runner (a raise, a hang, the budget): the same on every megatron-core
def test_failing_and_hanging_sections_are_recorded_and_the_rest_go_on(tmp_path):
    out = tmp_path / "out"
    p = _run(["--dry-run", "--sections", "offload,postval,pipeline", "--budgets", "postval=12", str(out)],
             MZB_GPU_CHECK_FAULT="offload:raise,postval:hang")
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads((out / "gpu_check.json").read_text())
    sec = rep["sections"]
    assert sec["offload"]["status"] == "error" and "fault injected" in sec["offload"]["error"]
    assert sec["postval"]["status"] == "timeout" and sec["postval"]["wall_s"] < 12 + 15, sec["postval"]
    assert sec["pipeline"]["status"] == "dry-run" and not rep["ok"]
    md = (out / "gpu_check.md").read_text()
    assert "| offload | ERROR |" in md and "| postval | TIMEOUT |" in md and "NOT every section passed" in md


def test_stream_overlap_from_a_trace():
    _bench_path()
    from gpu_check_verify import stream_overlap
    label = "pair"
    ev = [  # compute stream 7: 0-100, 150-250; comm stream 20: 50-200 (a kernel and a copy); pair window 0-120
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "ts": 150, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "ts": 50, "dur": 50, "args": {"stream": 20}},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 90, "dur": 110, "args": {"stream": 20}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": label, "ts": 0, "dur": 120, "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]
    o = stream_overlap(ev, label)
    assert o["compute_stream"] == "7" and o["gpu_events"] == 4 and o["pairs"] == 1
    assert o["whole"] == {"compute_busy_us": 200.0, "other_busy_us": 150.0, "overlap_us": 100.0,
                          "overlap_share": pytest.approx(2 / 3)}
    assert o["in_pairs"]["overlap_us"] == 50.0 and o["in_pairs"]["other_busy_us"] == 70.0
    assert stream_overlap([{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 5}]) == {"gpu_events": 0}


def _fake_wheel(folder, name, requires_python=">=3.12", requires=("torch>=2.6.0", "packaging>=24.2")):
    with zipfile.ZipFile(os.path.join(folder, name), "w") as z:
        dist = "-".join(name.split("-")[:2])
        z.writestr(f"{dist}.dist-info/METADATA", f"Name: {name.split('-')[0]}\nRequires-Python: {requires_python}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires) + "Requires-Dist: pytest; extra == 'test'\n")


def test_wheel_check(tmp_path):
    _bench_path()
    from gpu_check_sections import check_wheels
    assert "no megatron-core wheel" in check_wheels(str(tmp_path), "3.12")["problems"][0]
    _fake_wheel(tmp_path, "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl")
    w = check_wheels(str(tmp_path), "3.12")
    assert w["ok"] and w["requires"] == ["torch>=2.6.0", "packaging>=24.2"]
    assert any("not built for Python 3.11" in p for p in check_wheels(str(tmp_path), "3.11")["problems"])
    _fake_wheel(tmp_path, "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl", requires_python=">=3.13")
    problems = check_wheels(str(tmp_path), "3.12")["problems"]
    assert any("several megatron-core versions" in p for p in problems)
    assert any("requires Python >=3.13" in p for p in problems)
    (tmp_path / "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl").unlink()
    _fake_wheel(tmp_path, "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl",
                requires=("torch>=2.12", "einops", "numpy"))
    problems = check_wheels(str(tmp_path), "3.12")["problems"]
    assert any("needs torch>=2.12, the GPU machine has torch 2.11.0" in p for p in problems)
    assert any("needs einops, which the GPU machine lacks" in p for p in problems) and len(problems) == 2
    _fake_wheel(tmp_path, "einops-0.8.0-py3-none-any.whl")
    assert len(check_wheels(str(tmp_path), "3.12")["problems"]) == 1


def staged_exchange(_case):
    """Rank code: isend/irecv and send/recv through ``verify.processes.cuda_gloo``'s host staging, then a
    coalesced all-reduce as megatron-core's DDP issues it (reduced one tensor at a time)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager
    from megatron_zb.verify.processes import cuda_gloo
    cuda_gloo.apply(stage_host=True)
    r = dist.get_rank()
    a, b = torch.full((3,), r + 1.0), torch.full((2,), 10.0 * (r + 1))
    with _coalescing_manager(None, async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    c = torch.full((2,), r + 1.0)
    with _coalescing_manager(None, async_ops=False):
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
    reduced = (a.tolist(), b.tolist(), c.tolist())
    if r == 0:
        w = dist.isend(torch.arange(6.0).reshape(2, 3), 1)
        w.wait()
        dist.send(torch.full((2,), 7.0), 1)
        return type(w).__name__, reduced
    buf, two = torch.zeros(2, 3), torch.zeros(2)
    w = dist.irecv(buf, 0)
    w.wait()
    dist.recv(two, 0)
    return (type(w).__name__, buf.tolist(), two.tolist(), w.is_completed()), reduced


@pytest.mark.dist
def test_point_to_point_staged_through_host_copies():
    from megatron_zb.verify.processes.launch import LaunchOptions, run_cases
    (sent, red0), (got, red1) = run_cases(staged_exchange, [None], 2, LaunchOptions(cpu_shims=False, timeout=120))[0]
    assert sent == "_HostSend"
    assert red0 == red1 == ([3.0, 3.0, 3.0], [30.0, 30.0], [2.0, 2.0])
    assert got == ("_HostRecv", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [7.0, 7.0], True)


def test_green_context_share_and_refusal():
    """SMs per rank: 1/P down to the partition granularity; where torch lacks green contexts (this CPU
    build) the API check and entering one say so in one line."""
    from megatron_zb.verify.processes.green_context import GreenContextUnavailable, GreenShare, api_problem, sm_share, summarize
    assert (sm_share(132, 2, 9), sm_share(132, 4, 9), sm_share(108, 4, 8), sm_share(16, 4, 9)) == (64, 32, 26, 8)
    problem = api_problem()
    import torch
    if torch.cuda.is_available():  # pragma: no cover - the GPU machine
        pytest.skip("a CUDA build: green contexts may be there")
    assert problem and "\n" not in problem and "torch" in problem
    with pytest.raises(GreenContextUnavailable) as e:
        GreenShare.enter(2)
    assert "\n" not in str(e.value)
    # ranks one after the other (concurrency 1) against at once (2); a backward that left the share
    turns = summarize([{"alone": (1.0, 2.0), "together": (2.0, 4.0)}, {"alone": (1.0, 2.0), "together": (2.0, 4.0)}], 0.5)
    at_once = summarize([{"alone": (1.0, 0.5), "together": (1.0, 0.5)}, {"alone": (1.0, 0.5), "together": (1.0, 0.5)}])
    assert turns == {"concurrency": 1.0, "backward_ratio": 1.0, "share_speed": 0.5}
    assert at_once["concurrency"] == 2.0 and at_once["backward_ratio"] == 0.25


def test_realpipe_predictions_from_records():
    """The realpipe section's figures from its ranks' records: a megatron-zb case timed by the simulator
    with its own profile's costs, Megatron's 1F1B as the core's 1f1b order with its own passes' times (and
    zb-h1's message time), speed-ups over Megatron's, a skipped case kept."""
    _bench_path()
    import gpu_check_realpipe as G
    from megatron_zb.core.ir import io as sched_io
    from megatron_zb.core.build import ScheduleRequest, build
    from megatron_zb.core.sim.iteration import iteration_times
    from megatron_zb.core.sim.simulate import simulate
    p, m = 2, 4
    built = build(ScheduleRequest("zb-h1"), p, m)
    profile = {"cost_f": [0.01, 0.012], "cost_b": [0.011, 0.013], "cost_w": [0.006, 0.007], "cost_comm": 0.001,
               "chunk_cost_f": [0.01, 0.012], "chunk_cost_b": [0.011, 0.013], "chunk_cost_w": [0.006, 0.007],
               "mem_f": [1e9, 1e9], "mem_w": [4e8, 4e8], "chunk_mem_f": [1e9, 1e9], "chunk_mem_w": [4e8, 4e8],
               "built_schedule": json.loads(sched_io.to_json(built.lowered()))}
    passes = [{"f": 0.01, "bw": 0.018, "mem_f": 1e9}, {"f": 0.012, "bw": 0.02, "mem_f": 1e9}]
    records = [{"probe": {"concurrency": 1.95, "ranks": []}, "green": {"num_sms": 64, "total_sms": 132}, "p": p},
               {"case": "megatron-1f1b", "schedule": "megatron-1f1b", "median_iteration_s": 0.2, "iteration_s": [0.2],
                "peak_bytes": [3e9, 2e9], "megatron_passes": passes, "loss": 5.0},
               {"case": "zb-h1", "schedule": "zb-h1", "median_iteration_s": 0.18, "iteration_s": [0.18],
                "peak_bytes": [3e9, 2e9], "profile": profile, "loss": 5.0},
               {"case": "zb-v", "skipped": "10 s left, the last case took 9 s"}]
    run = G.evaluate(records, p, m)
    mg, zb, skipped = run["cases"]
    st = built.setting.__class__(p, m, cost_f=[0.01, 0.012], cost_b=[0.011, 0.013], cost_w=[0.006, 0.007],
                                 cost_comm=0.001, mem_f=[1e9, 1e9], mem_w=[4e8, 4e8])
    assert zb["simulated_s"] == pytest.approx(iteration_times(built.schedule, st).iteration_time)
    assert zb["predicted_peak_bytes"] == pytest.approx(simulate(built.schedule, st).peak_memory)
    assert zb["predicted_peak_bytes"][0] == pytest.approx(2 * 1e9)  # zb-h1's rank 0 holds P microbatches
    assert mg["cost_comm_s"] == 0.001 and mg["simulated_s"] > zb["simulated_s"]
    assert zb["speedup_measured"] == pytest.approx(0.2 / 0.18)
    assert zb["speedup_simulated"] == pytest.approx(mg["simulated_s"] / zb["simulated_s"])
    assert zb["error_pct"] == pytest.approx(100 * (0.18 / zb["simulated_s"] - 1))
    assert skipped == {"case": "zb-v", "schedule": None, "offload_ratio": None, "skipped": "10 s left, the last case took 9 s"}
    assert run["probe"] == {"concurrency": 1.95} and run["green"]["num_sms"] == 64
    # the probe's verdicts: ranks at once and backwards in the share pass; taking turns, or a backward
    # outside the share, fail the section with one line each
    from gpu_check_sections import Context
    for probe, problems in (({"concurrency": 1.9, "backward_ratio": 1.02}, 0),
                            ({"concurrency": 1.05, "backward_ratio": 1.0}, 1),
                            ({"concurrency": 1.02, "backward_ratio": 0.5}, 2)):
        rec = {"status": "error", "figures": {}, "rows": [], "plan": {}}
        ctx = Context("realpipe", dry=False, tiny=False, deadline=0.0, scratch="", mcore_path=None, wheels="",
                      gpu_python="3.12", record=rec)
        G.probe_row(ctx, {"p": 2, "probe": probe, "green": {"num_sms": 64, "total_sms": 132}})
        assert len(rec.get("problems", [])) == problems, rec
        assert all("\n" not in x for x in rec.get("problems", []))


@pytest.mark.megatron
@pytest.mark.dist
def test_realpipe_tiny_runs_every_case_on_the_cpu(tmp_path):
    """``--tiny``: Megatron's own 1F1B and megatron-zb's zb-h1, zb-v, v-half and zb-v with offload train
    the tiny GPT on two CPU ranks (messages staged as on the GPU, no green context), every case timed and
    predicted, the same loss for every schedule (same weights and data, no step)."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py"), "--tiny", "--sections", "realpipe",
                        "--stretch", str(round(max(1.0, overload()), 2)), str(out)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr + (out / "gpu_check.log").read_text()
    sec = json.loads((out / "gpu_check.json").read_text())["sections"]["realpipe"]
    (run,) = sec["figures"]["runs"]
    cases = run["cases"]
    assert [c["case"] for c in cases] == ["megatron-1f1b", "zb-h1", "zb-v", "v-half", "zb-v+offload0.5"]
    assert all(c["measured_s"] > 0 and c["simulated_s"] > 0 and not c.get("prediction_error") for c in cases), cases
    assert max(c["loss"] for c in cases) - min(c["loss"] for c in cases) < 1e-3 * cases[0]["loss"]
    assert run["green"] is None and run["probe"]["concurrency"] > 0
    assert (out / "realpipe_p2.jsonl").exists()
    assert "none on a CPU" in (out / "gpu_check.md").read_text()
