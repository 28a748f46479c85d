"""The automatic schedulers' search (issue 13): the ZB paper's Table-5 cells, the candidate
families, local search, the lower bound and the exact MILP mode."""
import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as stg

from megatron_zb.core.ir import Placement, Schedule, ScheduleError, Setting
from megatron_zb.core.schedules import generate
from megatron_zb.core.schedules.search import vslots
from megatron_zb.core.schedules.search.bounds import lower_bound
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.schedules.search.evaluate import Coder
from megatron_zb.core.schedules.search.exact import refine, solve
from megatron_zb.core.schedules.search.greedy import capped_variants
from megatron_zb.core.schedules.search.improve import improve
from megatron_zb.core.schedules.search.rounds import round_variants
from megatron_zb.core.schedules.search.vrounds import v_round_variants
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate


def table5(p, m, f, b, w, comm, h, a, s=1024):
    """The ZB paper's Table 5 setting: memory in units of M_B = 34h + 5as (M_W = 32h), limit 2p M_B."""
    m_b, m_w = 34 * h + 5 * a * s, 32 * h
    return Setting(p, m, cost_f=f, cost_b=b, cost_w=w, cost_comm=comm, mem_f=1.0, mem_w=m_w / m_b,
                   memory_limit=2 * p)


@pytest.mark.parametrize("cell,paper", [
    (dict(p=8, m=24, f=18.522, b=18.086, w=9.337, comm=0.601, h=2304, a=24), 0.0433),  # 1.5B
    (dict(p=32, m=96, f=10.419, b=10.207, w=7.715, comm=0.408, h=6144, a=48), 0.0038),  # 28.3B
])
def test_zb_auto_matches_the_papers_table5_cells(cell, paper):
    st = table5(**cell)
    s = generate("zb-auto", st)
    r = validate(s, st)
    assert max(r.peak_memory) <= st.memory_limit + 1e-9
    assert r.bubble_rate <= paper + 5e-5  # the paper prints 4 digits
    assert s.meta["lower_bound"] <= r.makespan + 1e-9


def test_table5_small_cell_is_optimal():
    st = table5(p=8, m=24, f=18.522, b=18.086, w=9.337, comm=0.601, h=2304, a=24)
    s = generate("zb-auto", st)
    assert s.meta["gap_to_lower_bound"] == pytest.approx(0.0, abs=1e-6)  # meets the lower bound


def test_zb_auto_never_worse_than_handcrafted_that_fit():
    for p, m, costs in [(4, 12, (1, 2, 1)), (6, 13, (1.2, 1.4, 0.6)), (8, 16, (18.522, 18.086, 9.337))]:
        f, b, w = costs
        for lim, names in [(p, ("zb-h1", "1f1b")), (2 * p - 1, ("zb-h1", "zb-h2", "1f1b"))]:
            st = Setting(p, m, cost_f=f, cost_b=b, cost_w=w, cost_comm=0.05, memory_limit=lim)
            auto = simulate(generate("zb-auto", st), st).makespan
            for n in names:
                assert auto <= simulate(generate(n, st), st).makespan + 1e-9, (p, m, lim, n)


def test_deterministic():
    st = table5(p=8, m=24, f=18.522, b=18.086, w=9.337, comm=0.601, h=2304, a=24)
    st = dataclasses.replace(st, memory_limit=12)
    a, b = generate("zb-auto", st), generate("zb-auto", st)
    assert [[str(x) for x in o] for o in a.orders] == [[str(x) for x in o] for o in b.orders]


costs = stg.tuples(stg.sampled_from([0.5, 1, 1.3, 18.522]), stg.sampled_from([1, 1.35, 2, 18.086]),
                   stg.sampled_from([0.3, 0.73, 1, 9.337]))


@given(p=stg.integers(2, 6), k=stg.integers(1, 3), c=costs, comm=stg.sampled_from([0, 0.1, 0.601]),
       mw=stg.sampled_from([0.5, 0.88, 1.0]), lim=stg.sampled_from([1.0, 1.5, 2.0]))
@settings(max_examples=40, deadline=None)
def test_new_zb_passes_valid_and_within_the_limit(p, k, c, comm, mw, lim):
    """Round heuristic, capped greedy, local search: complete, deadlock-free (validate), within
    the limit; the round heuristic's own timing is the simulator's; search never worsens."""
    m = k * p
    st = Setting(p, m, cost_f=c[0], cost_b=c[1], cost_w=c[2], cost_comm=comm, mem_w=mw, memory_limit=lim * p)
    lb = lower_bound(st, Placement.single(p), st.memory_limit)
    for s in round_variants(st, st.memory_limit) + capped_variants(st, st.memory_limit, "x"):
        r = validate(s, st)
        assert max(r.peak_memory) <= st.memory_limit + 1e-9
        assert lb <= r.makespan + 1e-6
        if "timing" in s.meta:
            assert s.meta["timing"][0] == pytest.approx(r.makespan, abs=1e-6)
            better = improve(s, st, st.memory_limit, max_evals=60)
            r2 = validate(better, st)
            assert max(r2.peak_memory) <= st.memory_limit + 1e-9
            assert r2.makespan <= r.makespan + 1e-9


@given(p=stg.integers(2, 4), k=stg.integers(1, 3), c=costs, comm=stg.sampled_from([0, 0.1]),
       mw=stg.sampled_from([0.5, 1.0]), lim=stg.sampled_from([0.5, 0.75, 1.0, 1.5]))
@settings(max_examples=10, deadline=None)
def test_new_v_passes_valid_and_within_the_limit(p, k, c, comm, mw, lim):
    m = k * p
    st = Setting(p, m, chunks=2, cost_f=c[0], cost_b=c[1], cost_w=c[2], cost_comm=comm, mem_w=mw,
                 memory_limit=lim * p)
    lb = lower_bound(st, Placement.vshape(p), st.memory_limit)
    for s in v_round_variants(st, st.memory_limit) + vslots.search(st, st.memory_limit, "x", keep=3):
        r = validate(s, st)
        assert max(r.peak_memory) <= st.memory_limit + 1e-9
        assert lb <= r.makespan + 1e-6
        assert s.meta["timing"][0] == pytest.approx(r.makespan, abs=1e-6)


@given(p=stg.integers(1, 5), m=stg.integers(1, 9), c=costs, comm=stg.sampled_from([0, 0.3]),
       name=stg.sampled_from(["zb-h1", "zb-h2", "1f1b", "gpipe-v", "interleaved-1f1b", "dualpipe-v"]))
@settings(max_examples=40, deadline=None)
def test_fast_timing_agrees_with_the_simulator(p, m, c, comm, name):
    st = Setting(p, m, cost_f=c[0], cost_b=c[1], cost_w=c[2], cost_comm=comm)
    try:
        s = generate(name, st)
    except ScheduleError:
        return
    s = s.flat()
    st = dataclasses.replace(st, chunks=s.placement.chunks)
    coder = Coder(st, s.placement, m)
    t = coder.time(coder.encode(s.orders))
    r = simulate(s, st)
    assert t.makespan == pytest.approx(r.makespan, abs=1e-9)
    assert t.spans == pytest.approx(r.spans, abs=1e-9)
    # and the post-validated iteration time, iterations back to back (the searches' tie-break)
    post = iteration_times(s, st).iteration_time_post_validated
    assert coder.post_validated(coder.encode(s.orders), comm) == pytest.approx(post, abs=1e-6)
    assert post >= r.makespan - 1e-9  # what _cheapest's early stop relies on


def test_fast_timing_reports_a_deadlock():
    st = Setting(2, 1)
    s = generate("zb-h1", st)
    orders = [list(s.orders[0]), list(s.orders[1])]
    orders[1] = [orders[1][1], orders[1][0]] + orders[1][2:]  # B before its own F
    coder = Coder(st, s.placement, 1)
    assert coder.time(coder.encode(orders)) is None


# -- exact mode (MILP, HiGHS) on small settings -----------------------------------------------------

EXACT = [  # p, m, (F, B, W, comm), mem-w, limit: zb-auto lies above the lower bound here
    (2, 5, (43.8, 59.2, 32, 0.5), 0.88, 3),
    (3, 4, (18.522, 18.086, 9.337, 0.601), 0.5, 3),
    (3, 5, (43.8, 59.2, 32, 0.5), 0.88, 4.5),
    (3, 5, (18.522, 18.086, 9.337, 0.601), 0.88, 4.5),
]


@pytest.mark.parametrize("p,m,c,mw,lim", EXACT)
def test_exact_mode_proves_zb_auto_optimal_on_small_settings(p, m, c, mw, lim):
    st = Setting(p, m, cost_f=c[0], cost_b=c[1], cost_w=c[2], cost_comm=c[3], mem_w=mw, memory_limit=lim)
    heur = generate("zb-auto", st)
    hm = simulate(heur, st).makespan
    assert heur.meta["lower_bound"] < hm - 1e-6  # the bound alone does not prove it
    exact = refine(heur, st, node_limit=20000)
    assert exact.meta["exact"]["optimal"], exact.meta["exact"]
    validate(exact, st)
    assert simulate(exact, st).makespan == pytest.approx(hm, abs=1e-6)  # zb-auto is optimal here
    assert exact.meta["gap_to_lower_bound"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("p,m,c,lim", [(2, 4, (1, 1, 1, 0), 2), (3, 4, (1, 2, 1, 0), 4)])
def test_exact_mode_without_a_cap_agrees(p, m, c, lim):
    st = Setting(p, m, cost_f=c[0], cost_b=c[1], cost_w=c[2], cost_comm=c[3], memory_limit=lim)
    res = solve(st, Placement.single(p), lim, node_limit=20000)
    assert res.optimal, res.status
    validate(res.schedule, st, memory_limit=lim)
    assert lower_bound(st, Placement.single(p), lim) <= res.makespan + 1e-6
    assert res.makespan == pytest.approx(simulate(generate("zb-auto", st), st).makespan, abs=1e-6)


def test_exact_mode_finds_better_than_a_weak_schedule():
    # under 1F1B's memory the MILP, capped by 1F1B's makespan, finds a shorter schedule
    st = Setting(3, 4, cost_b=2, memory_limit=3)
    one = simulate(generate("1f1b", st), st).makespan
    res = solve(st, Placement.single(3), 3, upper=one, node_limit=20000)
    assert res.optimal and res.makespan < one - 1e-9
    validate(res.schedule, st, memory_limit=3)


def test_exact_mode_is_deterministic_with_a_node_limit():
    st = Setting(3, 5, cost_f=43.8, cost_b=59.2, cost_w=32, cost_comm=0.5, mem_w=0.88, memory_limit=4.5)
    a = solve(st, Placement.single(3), 4.5, node_limit=20)
    b = solve(st, Placement.single(3), 4.5, node_limit=20)
    assert (a.makespan, a.dual_bound, a.nodes, a.status) == (b.makespan, b.dual_bound, b.nodes, b.status)


def test_cli_simulate_exact():
    out = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-auto", "-p", "3",
                          "-m", "5", "--cost-f", "43.8", "--cost-b", "59.2", "--cost-w", "32", "--cost-comm", "0.5",
                          "--mem-w", "0.88", "--memory-limit", "4.5", "--exact", "--exact-nodes", "5000", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["exact"]["optimal"] and d["exact"]["node_limit"] == 5000
    assert d["gap_to_lower_bound"] == pytest.approx(0.0, abs=1e-6)
    bad = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-h1", "-p", "3",
                          "-m", "5", "--exact"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--exact applies to the automatic schedules" in bad.stderr
    assert "Traceback" not in bad.stderr
