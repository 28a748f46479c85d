"""The pass profiler: aggregation and the profile JSON (pure), instrumentation on one process,
and real gloo pipelines (plain torch, and megatron through install()): each sample is the pass it
times (checked against the pass's own timing, not against the clock: the host may be busy), and no
collective outside the profiling window."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from megatron_zb.core.ir import Placement, Setting
from megatron_zb.core.schedules import generate
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.runtime.observe import profile_data as PD
from megatron_zb.runtime.observe import profiler as P


def _stats(rank, stages, f, b=None, w=None, bw=None, mem_f=None, mem_w=None, probe=(), n=3, waits=()):
    times = {"F": {}, "B": {}, "W": {}, "BW": {}}
    for s in stages:
        times["F"][str(s)] = [f[s]] * n
        if b is not None:
            times["B"][str(s)] = [b[s] * 0.9, b[s], b[s] * 1.5][:n]  # median = b[s]
        if w is not None:
            times["W"][str(s)] = [w[s]] * n
        if bw is not None:
            times["BW"][str(s)] = [bw[s]] * n
    return {"rank": rank, "stages": list(stages), "device": "cpu", "mem_method": "saved_tensors_hooks",
            "times": times,
            "mem_f": {str(s): [mem_f[s]] * n for s in stages} if mem_f else {},
            "mem_w": {str(s): [mem_w[s]] * n for s in stages} if mem_w else {},
            "recv_wait": {"F": {str(s): list(waits) for s in stages}, "B": {}},
            "iteration_s": [1.0, 1.2, 1.1], "iterations": [2, 3, 4], "comm_probe": list(probe)}


def test_build_profile_sums_chunk_medians_per_rank():
    pl = Placement.vshape(2)  # rank 0: stages 0, 3; rank 1: stages 1, 2
    f = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    b = {s: 2 * v for s, v in f.items()}
    w = {s: 0.5 * v for s, v in f.items()}
    mf = {s: 100 * (s + 1) for s in f}
    mw = {s: 10 * (s + 1) for s in f}
    stats = [_stats(r, pl.stages_of(r), f, b, w, mem_f=mf, mem_w=mw, probe=[0.1, 0.3, 0.2], waits=[0.5, 0.7])
             for r in (1, 0)]  # any gather order
    prof = PD.build_profile(stats, schedule="zb-v", placement=pl, microbatches=8, window=(2, 4))
    assert prof["pipeline_size"] == 2 and prof["chunks"] == 2 and prof["microbatches"] == 8
    assert prof["cost_f"] == [5.0, 5.0] and prof["cost_b"] == [10.0, 10.0] and prof["cost_w"] == [2.5, 2.5]
    assert prof["mem_f"] == [100 + 400, 200 + 300] and prof["mem_w"] == [10 + 40, 20 + 30]
    assert prof["cost_comm"] == pytest.approx(0.2)
    assert prof["window"] == [2, 4] and prof["iterations"] == 3 and prof["iteration_s"] == pytest.approx(1.1)
    assert prof["samples"]["F"] == 12 and prof["samples"]["comm_probe"] == 6 and prof["samples"]["recv_wait"] == 8
    assert prof["backward_split"] == "measured" and prof["cost_bw"] is None
    assert prof["p2p_wait_per_iter"] == pytest.approx([(2 * 1.2) / 3] * 2)
    chunk3 = [c for c in prof["per_chunk"] if c["stage"] == 3][0]
    assert chunk3["rank"] == 0 and chunk3["chunk"] == 1 and chunk3["b"] == 8.0


def test_build_profile_replicated_stages_average_the_paths():
    pl = Placement.bitpipe(2)  # every rank holds 4 chunks, 2 per direction; a microbatch runs through 2
    bw = {s: 2.0 for s in range(8)}
    f = {s: 1.0 for s in range(8)}
    stats = [_stats(r, pl.stages_of(r), f, bw=bw, mem_f={s: 100 for s in range(8)}) for r in (0, 1)]
    prof = PD.build_profile(stats, schedule="bitpipe", placement=pl, microbatches=4, window=(1, 1))
    assert prof["cost_f"] == [2.0, 2.0] and prof["cost_bw"] == [4.0, 4.0] and prof["mem_f"] == [200, 200]


def test_build_profile_fused_backward_only_and_missing_rank():
    pl = Placement.single(2)
    f = {0: 1.0, 1: 1.0}
    stats = [_stats(r, [r], f, bw={0: 3.0, 1: 4.0}, mem_f={0: 1000, 1: 1000}) for r in (0, 1)]
    prof = PD.build_profile(stats, schedule="1f1b", placement=pl, microbatches=4, window=(1, 1))
    assert prof["cost_b"] == [1.5, 2.0] and prof["cost_w"] == [1.5, 2.0] and prof["cost_bw"] == [3.0, 4.0]
    assert prof["backward_split"].startswith("assumed")
    assert prof["mem_w"] == [500.0, 500.0] and "DEFAULT_MEM_W_RATIO" in prof["mem_w_source"]
    assert prof["cost_comm"] == 0.0 and prof["cost_comm_source"] == "not measured"
    with pytest.raises(P.ProfileError, match=r"no samples from pipeline rank\(s\) \[1\]"):
        PD.build_profile(stats[:1], schedule="1f1b", placement=pl, microbatches=4, window=(1, 1))


def test_build_profile_host_costs_cpu_only():
    """On a CPU each chunk carries its passes' host costs: the median handling (messages, executor,
    hooks around the pass) and the interference (the mean beyond the median, a rare stall capped at
    the median + 5 MADs); a fused-only chunk splits BW's in halves for B and W. The simulator's costs
    get them added (per chunk and per rank, once); a CUDA profile has none."""
    pl = Placement.single(2)
    f = {0: 0.010, 1: 0.010}
    stats = [_stats(r, [r], f, bw={0: 0.020, 1: 0.020}) for r in (0, 1)]
    stats[0]["times"]["F"]["0"] = [0.010, 0.010, 0.011, 0.012, 0.100]  # median 11 ms, MAD 1 ms: 100 ms capped at 16
    for st in stats:
        st["handling"] = {"F": {str(st["rank"]): [0.001, 0.002, 0.003]}, "BW": {str(st["rank"]): [0.004] * 3}}
    prof = PD.build_profile(stats, schedule="1f1b", placement=pl, microbatches=4, window=(1, 1))
    assert prof["chunk_handling_f"] == pytest.approx([0.002, 0.002])
    assert prof["chunk_handling_bw"] == pytest.approx([0.004, 0.004])
    assert prof["chunk_handling_b"] == pytest.approx([0.002, 0.002]) == prof["chunk_handling_w"]
    assert prof["chunk_interference_f"] == pytest.approx([(0.010 + 0.010 + 0.011 + 0.012 + 0.016) / 5 - 0.011, 0.0])
    assert prof["chunk_interference_bw"] == [0.0, 0.0]
    kw = PD.profile_to_setting_kwargs(prof, per_chunk=True)
    assert kw["cost_f"] == pytest.approx([0.011 + 0.002 + 0.0008, 0.012])
    assert kw["cost_bw"] == pytest.approx([0.024, 0.024]) and kw["cost_b"] == pytest.approx([0.012, 0.012])
    assert PD.profile_to_setting_kwargs(prof, per_chunk=True, host_costs=False)["cost_f"] == pytest.approx([0.011, 0.010])
    assert PD.profile_to_setting_kwargs(prof)["cost_f"] == pytest.approx([0.0138, 0.012])  # per rank
    once = PD.with_host_costs(prof)
    assert PD.with_host_costs(once) is once and prof["chunk_cost_f"] == pytest.approx([0.011, 0.010])
    for st in stats:
        st["device"] = "cuda"
    cuda = PD.build_profile(stats, schedule="1f1b", placement=pl, microbatches=4, window=(1, 1))
    assert not any(k in cuda for k in PD.HOST_KEYS) and PD.with_host_costs(cuda) is cuda


def test_between_iterations_is_the_last_ranks_gap():
    """Megatron's step as the simulator charges it (after the last pass of any rank): the gap from the end of
    a forward-backward call to the next one's start on the rank that ended last, i.e. the shortest; a rank
    that ended earlier also waited for that one (its gap is given per rank beside it)."""
    pl = Placement.single(2)
    stats = [_stats(r, [r], {0: 0.01, 1: 0.01}, bw={0: 0.02, 1: 0.02}) for r in (0, 1)]
    stats[0]["between_s"], stats[1]["between_s"] = [0.05, 0.06], [0.15, 0.16]  # rank 1 ended 0.1 s earlier
    prof = PD.build_profile(stats, schedule="1f1b", placement=pl, microbatches=4, window=(1, 3))
    assert prof["between_iterations_s"] == pytest.approx(0.055)
    assert prof["between_iterations_s_per_rank"] == pytest.approx([0.055, 0.155])


def test_json_round_trip_and_setting_kwargs(tmp_path):
    pl = Placement.single(4)
    f = {s: 0.01 * (1 + s / 10) for s in range(4)}
    stats = [_stats(r, [r], f, {s: 0.02 for s in f}, {s: 0.01 for s in f}, mem_f={s: 4e6 for s in f},
                    mem_w={s: 1e6 for s in f}, probe=[1e-4]) for r in range(4)]
    prof = PD.build_profile(stats, schedule="zb-h1", placement=pl, microbatches=8, window=(3, 5))
    path = str(tmp_path / "sub" / "profile.json")
    PD.save_profile(prof, path)
    back = PD.load_profile(path)
    assert back == json.loads(json.dumps(prof))
    kw = PD.profile_to_setting_kwargs(back)
    assert kw["cost_f"] == pytest.approx([f[s] for s in range(4)]) and kw["cost_comm"] == pytest.approx(1e-4)
    assert kw["mem_f"] == [4e6] * 4 and kw["mem_w"] == [1e6] * 4
    st = Setting(4, 8, **kw)  # the simulator takes it as it is (seconds, bytes)
    res = simulate(generate("zb-h1", st), st)
    assert res.makespan > 8 * (0.01 + 0.02 + 0.01)
    norm = PD.profile_to_setting_kwargs(back, normalize=True)
    assert sum(norm["cost_f"]) / 4 == pytest.approx(1.0) and max(norm["mem_f"]) == 1.0
    assert norm["mem_w"] == [0.25] * 4
    res_n = simulate(generate("zb-h1", Setting(4, 8, **norm)), Setting(4, 8, **norm))
    assert res_n.makespan * sum(kw["cost_f"]) / 4 == pytest.approx(res.makespan)
    # the planner reads the same file
    from megatron_zb.core import plan as core_plan
    assert core_plan.profile_costs(core_plan.load_profile(path), 4)["cost_b"] == [0.02] * 4


def test_load_profile_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(P.ProfileError, match="cannot read profile"):
        PD.load_profile(str(bad))
    bad.write_text(json.dumps({"cost_f": [1], "cost_b": [1]}))
    with pytest.raises(P.ProfileError, match="no cost_w"):
        PD.load_profile(str(bad))
    bad.write_text(json.dumps({"cost_f": [1, -1], "cost_b": [1, 1], "cost_w": [1, 1]}))
    with pytest.raises(P.ProfileError, match="non-negative"):
        PD.load_profile(str(bad))
    bad.write_text(json.dumps({"cost_f": [1, 1], "cost_b": [1, 1, 1], "cost_w": [1, 1]}))
    with pytest.raises(P.ProfileError, match="different lengths"):
        PD.load_profile(str(bad))
    with pytest.raises(P.ProfileError, match="cannot read"):
        PD.load_profile(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("window", [(0, 2), (3, 2), (1,), "ab", (1.5, 2), None])
def test_bad_window(window):
    with pytest.raises(P.ProfileError, match="profile window"):
        P.PassProfiler(window)


def test_auto_replans_names():
    assert PD.auto_replans("zb-auto") and PD.auto_replans("v-auto") and PD.auto_replans("zb-auto-foo")
    assert not PD.auto_replans("zb-h1") and not PD.auto_replans("1f1b") and not PD.auto_replans(None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_instrument_single_process(tmp_path, device):
    """One rank holding both stages of a 2-stage pipeline (no p2p): timing, activation bytes, mem_w.
    CPU: saved-tensor bytes; CUDA: events and memory_allocated deltas."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron_zb.core.ir import Schedule
    from megatron_zb.core.sim.lower import lower
    from megatron_zb.runtime.executor import StagePasses, execute

    torch.manual_seed(0)
    mbs, h = 64, 256
    params = {s: (torch.randn(h, h, device=device, requires_grad=True),
                  torch.randn(h, device=device, requires_grad=True)) for s in (0, 1)}
    graphs = {}

    def forward(s, mb, inp):
        x = torch.randn(mbs, h, device=device) if s == 0 else inp
        y = torch.tanh(x @ params[s][0] + params[s][1])
        return y.square().mean() if s == 1 else y

    def backward(s, mb, inp, out, grad, split):
        grad = torch.ones_like(out) if s == 1 else grad
        gi = torch.autograd.grad(out, [inp], grad, retain_graph=True)[0] if inp is not None else None
        graphs[(s, mb)] = (out, grad)
        return gi

    def weight(s, mb):
        out, grad = graphs.pop((s, mb))
        torch.autograd.grad(out, list(params[s]), grad)

    pl = Placement((0, 0))  # both stages on rank 0: local hand-over, no p2p
    order = sorted((a for o in generate("zb-h1", Setting(2, 3)).orders for a in o),  # runnable order
                   key=lambda a: (a.mb, {"F": 0, "B": 1, "W": 2}[a.kind], a.stage if a.kind == "F" else -a.stage))
    one = lower(Schedule("seq", pl, 3, [order]), Setting(1, 3, chunks=2))
    prof = P.PassProfiler((2, 2), str(tmp_path / "p.json"), schedule="seq", probe_rounds=0)
    prof.ignore_parameters([t for ps in params.values() for t in ps])
    passes = StagePasses(forward=forward, backward=backward, weight=weight, recv_shape=lambda s, mb: (mbs, h),
                         device=torch.device(device))
    got = []
    for it in (1, 2, 3):
        hooks = [prof.hook(device)] if prof.in_window(it) else []
        execute(one.orders[0], 0, pl, passes, None, hooks=hooks)
        if prof.in_window(it):
            got.append(prof.end_iteration(it, P.WindowCall(placement=pl, num_microbatches=3, rank=0)))
    assert got[0] is not None and prof.done and not prof.in_window(2)
    prof_ = got[0]
    assert PD.load_profile(str(tmp_path / "p.json")) == json.loads(json.dumps(prof_))
    assert prof_["samples"]["F"] == 6 and prof_["samples"]["B"] == 6 and prof_["samples"]["W"] == 6
    assert all(x > 0 for x in prof_["cost_f"] + prof_["cost_b"] + prof_["cost_w"])
    assert prof_["iterations"] == 1 and prof_["device"] == device
    act = mbs * h * 4
    if device == "cpu":
        assert prof_["mem_method"] == "saved_tensors_hooks"
        # each stage saves its input (x, also stage 0's fresh batch) and the tanh output (square()
        # saves the same y); the weights are ignored
        assert prof_["mem_f"] == [2 * 2 * act]
        assert prof_["mem_w"] == prof_["mem_f"]  # the retained graph keeps everything until W
    else:
        assert prof_["mem_method"] == "cuda.memory_allocated"
        # allocated and still held after F: stage 0 its batch and y; stage 1 its y (its input is
        # stage 0's output, allocated before), plus the scalar loss
        assert 3 * act <= prof_["mem_f"][0] <= 3 * act + 4096, prof_["mem_f"]
        assert 0 <= prof_["mem_w"][0] <= prof_["mem_f"][0]


# --------------------------------------------------------------------------------------------
# real gloo pipelines
# --------------------------------------------------------------------------------------------

MBS, H = 256, 512  # a few ms per matmul on one core




def _count_collectives(counter):
    import torch.distributed as dist
    names = ("all_gather_object", "all_gather", "all_reduce", "barrier", "broadcast", "broadcast_object_list",
             "reduce", "gather", "scatter", "all_to_all", "reduce_scatter", "gather_object")
    saved = {}
    for n in names:
        orig = getattr(dist, n, None)
        if orig is None:
            continue
        saved[n] = orig

        def make(n, orig):
            def wrapper(*a, **k):
                counter.append(n)
                return orig(*a, **k)
            return wrapper
        setattr(dist, n, make(n, orig))
    return saved


def _run_case(rank, world, groups, case, iterations, window):
    import torch.distributed as dist
    from megatron_zb.core.sim.lower import lower
    from megatron_zb.runtime.executor import StagePasses, execute
    from megatron_zb.runtime.p2p import P2P
    from megatron_zb.runtime.emulate.sleep_passes import sleep_passes

    name, kind = case
    m = 2 * world
    setting = Setting(world, m, cost_f=20, cost_b=30, cost_w=10)
    low = lower(generate(name, setting))
    pl = low.placement
    if kind == "sleep":
        passes = sleep_passes(setting, rank, pl, shape=(MBS, H), unit=1e-3)
        weights = []
    else:
        g = torch.Generator().manual_seed(rank)
        params = {s: ((torch.randn(H, H, generator=g) / H ** 0.5).requires_grad_(),
                      torch.zeros(H, requires_grad=True)) for s in pl.stages_of(rank)}
        graphs = {}
        nst = pl.num_stages

        def forward(s, mb, inp):
            x = torch.randn(MBS, H, generator=torch.Generator().manual_seed(mb)) if s == 0 else inp
            y = torch.tanh(torch.tanh(x @ params[s][0] + params[s][1]) @ params[s][0])
            return y.square().mean() if s == nst - 1 else y

        def backward(s, mb, inp, out, grad, split):
            grad = torch.ones_like(out) if s == nst - 1 else grad
            if not split:
                torch.autograd.backward(out, grad)
                return inp.grad if inp is not None else None
            gi = torch.autograd.grad(out, [inp], grad, retain_graph=True)[0] if inp is not None else None
            graphs[(s, mb)] = (out, grad)
            return gi

        def weight(s, mb):
            out, grad = graphs.pop((s, mb))
            for p, gw in zip(params[s], torch.autograd.grad(out, list(params[s]), grad)):
                p.grad = gw if p.grad is None else p.grad + gw

        passes = StagePasses(forward=forward, backward=backward, weight=weight, recv_shape=lambda s, mb: (MBS, H))
        weights = [t for ps in params.values() for t in ps]
    own, in_window = {}, [False]
    passes = _timed(passes, own, in_window)
    p2p = P2P(groups, rank, timeout_s=60)
    prof = P.PassProfiler(window, None, schedule=name)
    prof.ignore_parameters(weights)
    counts, profile, raw = [], None, None
    calls = []
    saved = _count_collectives(calls)
    try:
        for it in range(1, iterations + 1):
            del calls[:]
            in_window[0] = prof.in_window(it)
            hooks = [prof.hook("cpu")] if prof.in_window(it) else []
            execute(low.orders[rank], rank, pl, passes, p2p, hooks=hooks)
            if prof.in_window(it):
                if it == window[1]:  # the profiler's own samples, before it turns them into the profile
                    raw = {f"{k}{s}": list(v) for (s, k), v in prof.times.items()}
                out = prof.end_iteration(it, P.WindowCall(placement=pl, num_microbatches=m, rank=rank, group=None,
                                                        p2p=p2p, shape=(MBS, H)))
                profile = out or profile
            counts.append(list(calls))
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return {"profile": profile, "collectives": counts, "samples": raw, "own": own}


def _timed(passes, own, active):
    """``passes`` whose every call also times itself: own[kind + stage] lists each pass's own
    duration, in the order they ran (only while ``active[0]``, the profiling window)."""
    import dataclasses

    def wrap(kind_of, fn):
        def run(s, mb, *args):
            t0 = time.perf_counter()
            try:
                return fn(s, mb, *args)
            finally:
                if active[0]:
                    own.setdefault(f"{kind_of(args)}{s}", []).append(time.perf_counter() - t0)
        return run
    return dataclasses.replace(passes, forward=wrap(lambda a: "F", passes.forward),
                               backward=wrap(lambda a: "B" if a[-1] else "BW", passes.backward),
                               weight=wrap(lambda a: "W", passes.weight))


def _rank_case(job):
    """One case on a rank of a verify launch (the process group is up; forked from the warm
    torch-only server where there is one): ("ok", what ``_run_case`` returns) or ("err", its
    traceback), so that a failing case leaves the group to the next."""
    import traceback
    import torch.distributed as dist
    from megatron_zb.runtime.p2p import PairGroups
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = PairGroups(list(range(world)), {(r, (r + 1) % world) for r in range(world)})
    try:
        return "ok", _run_case(rank, world, groups, job["case"], job["iterations"], job["window"])
    except Exception:  # noqa: BLE001 - reported to the test
        return "err", traceback.format_exc()


def _run(rank_pool, world, cases, iterations, window, timeout=240):
    """{rank: [(status, payload) per case]}, every case in one launch of ``world`` ranks."""
    jobs = [{"case": c, "iterations": iterations, "window": window} for c in cases]
    res = rank_pool(_rank_case, jobs, world, timeout=timeout, cpu_shims=False)
    return {r: [res[ci][r] for ci in range(len(cases))] for r in range(world)}


@pytest.mark.dist
@pytest.mark.timing
def test_profiles_on_gloo_pipeline(rank_pool):
    """Each pass's profiled time is that pass: every sample encloses the pass's own run (the pass
    timed itself, same order) and, in the median, adds only the executor's few statements around
    it (no wait for inputs, no other pass); the profile's per-rank costs are the samples' medians;
    sleeps of known length are never reported shorter. These hold on a host of any load; how close
    B + W comes to the fused backward on real compute is a figure (benchmarks/bench_test_figures.py)."""
    world, iterations, window = 2, 5, (2, 4)
    cases = [("zb-h1", "sleep"), ("1f1b", "sleep"), ("zb-h1", "torch"), ("1f1b", "torch")]
    res = _run(rank_pool, world, cases, iterations, window)
    profiles = {}
    for ci, case in enumerate(cases):
        for r in range(world):
            status, payload = res[r][ci]
            assert status == "ok", f"{case} rank {r}:\n{payload}"
            # no collective before or after the window; exactly one all_gather_object at its end
            assert payload["collectives"] == [[], [], [], ["all_gather_object"], []], (case, r)
            samples, own = payload["samples"], payload["own"]
            assert sorted(samples) == sorted(own), (case, r, sorted(samples), sorted(own))
            for key, got in samples.items():
                mine = own[key]
                assert len(got) == len(mine) == 3 * 2 * world, (case, r, key)  # 3 iterations x 2*world mbs
                assert all(g >= m for g, m in zip(got, mine)), (case, r, key, got, mine)  # encloses the pass
                extra = sorted(g - m for g, m in zip(got, mine))
                assert extra[len(extra) // 2] < 0.002, (case, r, key, extra)  # not a wait, not a second pass
        p0 = res[0][ci][1]["profile"]
        assert p0 is not None and p0 == res[1][ci][1]["profile"]  # every rank builds the same
        # each pass's handling on a CPU: its messages' posting and the executor around it (a figure, >= 0)
        assert all(x >= 0 for k in PD.HOST_KEYS for x in p0[f"chunk_{k}"]), case
        assert p0["chunk_handling_f"][0] > 0 and p0["chunk_handling_f"][1] > 0  # rank 0 sends, rank 1 receives
        assert p0["window"] == [2, 4] and p0["iterations"] == 3 and p0["pipeline_size"] == 2
        assert p0["samples"]["F"] == 3 * 2 * (2 * world)
        assert p0["samples"]["comm_probe"] == 5 and p0["cost_comm"] > 0
        assert p0["samples"]["recv_wait"] == 3 * 2 * (2 * world)  # rank 1: every input, rank 0: every grad
        for r in range(world):  # the profile's costs: the medians of the samples (one stage per rank)
            samples = res[r][ci][1]["samples"]
            for kind, cost in (("F", "cost_f"), ("B", "cost_b"), ("W", "cost_w"), ("BW", "cost_bw")):
                if f"{kind}{r}" in samples:
                    assert p0[cost][r] == pytest.approx(PD.median(samples[f"{kind}{r}"])), (case, r, kind)
        profiles[case] = p0
    # sleeps of known length: F=20 ms, B=30, W=10 per stage; a sleep never ends early
    zs, fs = profiles[("zb-h1", "sleep")], profiles[("1f1b", "sleep")]
    for r in range(world):
        for got, want in ((zs["cost_f"][r], 0.020), (zs["cost_b"][r], 0.030), (zs["cost_w"][r], 0.010),
                          (fs["cost_bw"][r], 0.040)):
            assert got >= want, (r, got, want)
    assert fs["backward_split"].startswith("assumed") and zs["backward_split"] == "measured"
    assert zs["p2p_wait_per_iter"][1] > 0.015  # rank 1 waits at least for the first F of rank 0
    # real autograd work: positive times, saved bytes exact
    zt, ft = profiles[("zb-h1", "torch")], profiles[("1f1b", "torch")]
    act = MBS * H * 4
    assert all(x > 0 for x in zt["cost_f"] + zt["cost_b"] + zt["cost_w"] + ft["cost_bw"])
    assert zt["backward_split"] == "measured" and ft["backward_split"].startswith("assumed")
    for r in range(world):
        # x@W saves x, tanh saves t1 (the second matmul saves the same t1), tanh saves y (the
        # last stage's square() saves the same y); the weights are ignored
        assert zt["mem_f"][r] == 3 * act and ft["mem_f"][r] == 3 * act
        assert zt["mem_w"][r] == zt["mem_f"][r]  # the toy keeps its graph until W
    assert zt["mem_w_source"] == "measured" and "DEFAULT_MEM_W_RATIO" in ft["mem_w_source"]


# --------------------------------------------------------------------------------------------
# megatron through install()
# --------------------------------------------------------------------------------------------

@pytest.mark.megatron
def test_install_profile_options_and_replan(monkeypatch):
    from megatron_zb.megatron.cpu import cpu_shims
    cpu_shims.apply()
    from megatron_zb.megatron.install import ZeroBubbleConfigError, install
    with pytest.raises(ZeroBubbleConfigError, match="profile window"):
        install("zb-h1", profile_window=(0, 3))
    h = install("zb-h1", profile_window=(2, 3), profile_path="/tmp/x.json")
    try:
        fb = h.forward_backward
        assert fb.profiler is not None and fb.profiler.start == 2 and fb.iterations == 0
        s1 = fb.schedule_for(4, 8, 1, False)
        assert fb._built
        prof = {"cost_f": [0.01] * 4, "cost_b": [0.02] * 4, "cost_w": [0.005] * 4, "cost_comm": 0.001,
                "mem_f": [1e6] * 4, "mem_w": [3e5] * 4}
        fb.replan_from(prof)
        assert not fb._built
        assert fb.options.cost_f == [1.0] * 4 and fb.options.cost_b == [2.0] * 4
        assert fb.options.cost_comm == pytest.approx(0.1) and fb.options.mem_w == pytest.approx(0.3)
        s2 = fb.schedule_for(4, 8, 1, False)
        assert [[a for a in o if a.is_compute] for o in s2.orders] == [[a for a in o if a.is_compute] for o in s1.orders]
    finally:
        h.uninstall()
    # zb-auto: the re-planned schedule is the one generated from the measured costs
    with install("zb-auto") as h:
        fb = h.forward_backward
        prof = {"cost_f": [0.01] * 4, "cost_b": [0.03] * 4, "cost_w": [0.002] * 4, "cost_comm": 0.0}
        fb.schedule_for(4, 8, 1, False)
        fb.replan_from(prof)
        s = fb.schedule_for(4, 8, 1, False)
        st = Setting(4, 8, chunks=1, **PD.profile_to_setting_kwargs(prof, normalize=True))
        want = generate("zb-auto", st)
        assert [[a for a in o if a.is_compute] for o in s.orders] == want.orders


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.timing
def test_megatron_run_writes_profile(tmp_path, mcore_path):
    from megatron_zb import verify as V
    path = str(tmp_path / "profile.json")
    case = V.make_case("zb-h1", 2, num_microbatches=4, iterations=4,
                       schedule_options={"profile_window": (2, 3), "profile_path": path})
    res = V.run_verify_many([case], timeout=600, mcore_path=mcore_path)[0]
    assert res["passed"], res.get("error") or res.get("problems")  # profiling changes no numbers
    prof = PD.load_profile(path)
    assert prof["schedule"] == "zb-h1" and prof["pipeline_size"] == 2 and prof["microbatches"] == 4
    assert prof["window"] == [2, 3] and prof["iterations"] == 2 and prof["samples"]["F"] == 2 * 2 * 4
    assert all(x > 0 for x in prof["cost_f"] + prof["cost_b"] + prof["cost_w"])
    assert all(0 < w <= f for f, w in zip(prof["mem_f"], prof["mem_w"]))
    assert prof["backward_split"] == "measured" and prof["cost_comm"] > 0
    st = Setting(2, 4, **PD.profile_to_setting_kwargs(prof))
    assert simulate(generate("zb-h1", st), st).makespan > 0
