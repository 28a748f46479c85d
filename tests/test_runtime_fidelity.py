"""Runtime fidelity, quick version: with compute replaced by sleeps, the measured iteration time
over real gloo processes is never below the simulator's for the same costs (what holds on any
host, however busy). How close it comes is a figure: benchmarks/bench_runtime_fidelity.py (the
full table) and benchmarks/bench_test_figures.py (this test's settings, with the load average)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from megatron_zb.core.ir import Placement, Setting
from megatron_zb.runtime.emulate.sleep_passes import precise_sleep, sleep_passes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_runtime_fidelity as bench  # noqa: E402


@pytest.mark.timing
def test_sleep_passes_durations(monkeypatch):
    """Each pass sleeps its per-chunk cost: never less (measured), and it never asks for more (the
    sleep it requests, recorded): both hold whatever the host's load. How late a sleep ends on a
    busy host is a figure: benchmarks/bench_test_figures.py."""
    from megatron_zb.runtime.emulate import sleep_passes as SP
    st = Setting(2, 4, cost_f=2, cost_b=3, cost_w=1)
    ps = sleep_passes(st, 1, Placement.vshape(2), shape=(2, 3), unit=0.002)  # 2 chunks: half each
    assert ps.seconds == {"F": pytest.approx(0.002), "B": pytest.approx(0.003), "W": pytest.approx(0.001),
                          "BW": pytest.approx(0.004)}
    asked = []
    monkeypatch.setattr(SP, "precise_sleep", lambda sec: (asked.append(sec), precise_sleep(sec)))
    t0 = time.perf_counter()
    out = ps.forward(1, 0, None)
    t_f = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = ps.backward(1, 0, None, out, None, False)  # BW = (B + W) / 2 chunks
    t_bw = time.perf_counter() - t0
    assert out.shape == (2, 3) and g.shape == (2, 3)
    assert ps.backward(0, 0, None, out, None, True) is None  # stage 0 has no input gradient
    assert t_f >= 0.002 and t_bw >= 0.004
    assert len(asked) == 3 and asked[0] <= 0.002 and asked[1] <= 0.004 and asked[2] <= 0.003


@pytest.mark.timing
def test_precise_sleep_sleeps_then_yields_to_the_deadline(monkeypatch):
    """``precise_sleep``: ``time.sleep`` until ``spin_s`` before the deadline, then yields until it:
    never ends early, never asks the OS for more than the time left."""
    t0 = time.perf_counter()
    precise_sleep(0.003)
    assert time.perf_counter() - t0 >= 0.003
    slept = []
    real = time.sleep
    monkeypatch.setattr(time, "sleep", lambda sec: (slept.append(sec), real(sec)))
    t0 = time.perf_counter()
    precise_sleep(0.003, spin_s=0.0004)
    assert time.perf_counter() - t0 >= 0.003
    assert slept == [pytest.approx(0.0026)]
    slept.clear()
    precise_sleep(0.0002, spin_s=0.0004)  # shorter than the spin: no OS sleep at all
    precise_sleep(0.0)
    assert slept == []


@pytest.mark.dist
@pytest.mark.timing
def test_measured_iterations_on_real_processes():
    """The benchmark's runner on 2 real processes: zb-h1 and 1f1b run, every iteration at least the
    simulated time (sleeps cannot run faster than the plan), the simulated times and speed-up are
    the simulator's. How close measured comes to simulated is the benchmark's figure (5 % at P=4,
    benchmarks/bench_runtime_fidelity.py; a 2-process check: benchmarks/bench_test_figures.py)."""
    cases = [{"schedule": "zb-h1", "p": 2, "m": 4, "chunks": None, "costs": "F=B=W=10",
              "kw": dict(cost_f=10, cost_b=10, cost_w=10)},
             {"schedule": "1f1b", "p": 2, "m": 4, "chunks": None, "costs": "F=B=W=10",
              "kw": dict(cost_f=10, cost_b=10, cost_w=10)}]
    rows, hop = bench.run_cases(2, cases, unit=1e-3, iterations=3, warmup=1, timeout=120)
    for r in rows:
        assert "error" not in r, r
        # zb-h1, p=2, m=4, F=B=W=10 ms: 130 ms; 1f1b: 150 ms
        assert r["simulated_s"] == pytest.approx({"zb-h1": 0.130, "1f1b": 0.150}[r["schedule"]])
        # sleeps cannot run faster than the plan: not one iteration
        assert len(r["per_iteration_s"]) == 3 and min(r["per_iteration_s"]) >= 0.98 * r["simulated_s"], r
        assert r["error_pct"] == pytest.approx(100 * (r["measured_s"] - r["simulated_s"]) / r["simulated_s"], abs=0.01)
    assert hop >= 0
    z = [r for r in rows if r["schedule"] == "zb-h1"][0]
    assert z["speedup_simulated"] == pytest.approx(150 / 130)
