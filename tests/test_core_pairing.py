"""Overlapped F&B pairs the schedule core forms for MoE's all-to-all (issue 27, item 3):
``core.passes.pairing`` pairs adjacent forwards and backwards of other microbatches (moving forwards one
backward earlier where memory allows, as Megatron's combined 1F1B does) only where the simulated
iteration gets shorter; the pairs survive lowering in the form the runtime runs; a pair starts when
both passes have their inputs; Megatron's combined 1F1B is what the post-pass builds from its
interleaved 1F1B under the same memory; plan estimates the all-to-all from the MoE flags."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from megatron_zb.cli import main
from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import (B, BW, F, OFFLOAD_KINDS, OVERLAP, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                 Placement, Schedule, Setting)
from megatron_zb.core.sim.lower import check_pair_order
from megatron_zb.core.passes.pairing import advance_forwards, form_pairs
from megatron_zb.core.schedules import generate
from megatron_zb.core.schedules.interleaved import combined_1f1b
from megatron_zb.core.sim.simulate import paired_cost, simulate

COSTS = dict(cost_f=[1.0], cost_b=[1.0], cost_w=[1.0])


def _pairs(sched):
    return sum(1 for o in sched.orders for a in o if a.kind == OVERLAP)


def test_without_an_all_to_all_nothing_changes():
    st = Setting(4, 8, chunks=2)
    s = generate("zb-v", st)
    assert form_pairs(s, st) is s
    assert form_pairs(s, dataclasses.replace(st, cost_a2a=[0.5], a2a_overlap=False)) is s
    for name in ("zb-v", "zb-h1", "interleaved-1f1b"):
        built = build(ScheduleRequest(name, a2a_overlap=True), 4, 8)
        assert _pairs(built.schedule) == 0 and "pairs_formed" not in built.schedule.meta


@pytest.mark.parametrize("name,limit", [("zb-v", None), ("v-auto", None), ("zb-h1", 5.0), ("zb-v", 6.0),
                                        ("interleaved-1f1b", None), ("dualpipe-v", None)])
def test_pairs_shorten_the_iteration_and_lower_to_what_the_runtime_runs(name, limit):
    req = ScheduleRequest(name, cost_a2a=[0.5], memory_limit=limit, **COSTS)
    on = build(req, 4, 16, enforce_limit=False)
    off = build(req.replace(a2a_overlap=False), 4, 16, enforce_limit=False)
    assert _pairs(on.schedule) > 0
    assert on.result.makespan < off.result.makespan - 1  # P=4 M=16: 3 to 12 units of 56..76
    budget = limit if limit is not None else max(generate(name, on.setting).meta.get("memory_claim", 0),
                                                 max(off.result.peak_memory))
    assert max(on.result.peak_memory) <= budget + 1e-9  # advancing forwards stays within the memory
    low = on.lowered()
    check_pair_order(low)
    pairs = low.meta["overlap_pairs"]
    assert len(pairs) == _pairs(on.schedule)
    for r, i, j in pairs:  # an F, then its B or BW, only messages (or offload actions) in between
        order = low.orders[r]
        assert order[i].kind == F and order[j].kind in (B, BW) and order[i].mb != order[j].mb
        assert all(a.kind in (RECV_F, RECV_B, SEND_F, SEND_B) + OFFLOAD_KINDS for a in order[i + 1:j])


def test_zb_h1_pairs_need_one_more_activation_and_get_it_only_under_a_limit():
    req = ScheduleRequest("zb-h1", cost_a2a=[0.5], **COSTS)
    own = build(req, 4, 16)
    assert _pairs(own.schedule) == 0  # its last rank meets a B only of the F's own microbatch
    roomy = build(req.replace(memory_limit=5.0), 4, 16)
    assert roomy.schedule.meta["advanced_ranks"] == [0, 1, 2, 3]
    assert max(roomy.result.peak_memory) == pytest.approx(5.0)
    # a pair hands its F's output on at its end: the next rank's F waits for the whole pair
    assert roomy.result.makespan == pytest.approx(68.5) and own.result.makespan == pytest.approx(70.0)


def test_advance_forwards_is_one_more_warm_up_forward():
    order = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(F, 0, 2), Action(B, 0, 1), Action(W, 0, 0),
             Action(F, 0, 3), Action(B, 0, 2), Action(W, 0, 1), Action(B, 0, 3), Action(W, 0, 2), Action(W, 0, 3)]
    got = [str(a) for a in advance_forwards(order)]
    assert got == ["F0.0", "F0.1", "F0.2", "B0.0", "F0.3", "B0.1", "W0.0", "B0.2", "W0.1", "B0.3", "W0.2", "W0.3"]


def test_megatrons_combined_1f1b_and_the_post_pass_under_its_memory():
    st = Setting(4, 8, chunks=2, cost_a2a=[0.5], **COSTS)
    c = combined_1f1b(st)
    plain = generate("interleaved-1f1b", st)
    for r in range(4):  # one more warm-up forward, then every steady-state step a pair
        first_b = [next(i for i, a in enumerate(s.flat().orders[r]) if a.kind != F) for s in (plain, c)]
        assert first_b[1] == first_b[0] + 1  # forwards before the first backward
        warm = sum(a.kind == F for a in c.orders[r][:first_b[1]])  # the plain forwards before the first pair
        assert sum(a.kind == OVERLAP for a in c.orders[r]) == 16 - warm
    rc = simulate(c, st)
    assert max(rc.peak_memory) == max(simulate(plain, st).peak_memory) + 0.5  # one chunk's activation more
    ours = form_pairs(plain, dataclasses.replace(st, memory_limit=max(rc.peak_memory)))
    assert simulate(ours, st).makespan == pytest.approx(rc.makespan)
    assert [[str(a) for a in o] for o in ours.flat().orders] == [[str(a) for a in o] for o in c.flat().orders]


def test_a_pair_starts_when_both_passes_have_their_inputs():
    # two ranks, 1F1B order on rank 0 with F0.1 paired with BW0.0: BW0.0 needs rank 1's BW1.0
    pl = Placement.single(2)
    r0 = [Action(F, 0, 0), Action.overlap(Action(F, 0, 1), Action(BW, 0, 0)), Action(BW, 0, 1)]
    r1 = [Action(F, 1, 0), Action(BW, 1, 0), Action(F, 1, 1), Action(BW, 1, 1)]
    sched = Schedule("t", pl, 2, [r0, r1])
    st = Setting(2, 2, cost_f=1, cost_b=1, cost_w=1, cost_a2a=0.5)
    tl = {str(t.action): t for tl in simulate(sched, st).timeline for t in tl}
    assert tl["F0.1"].start == pytest.approx(tl["BW1.0"].end)  # waits for BW0.0's gradient
    f, b = Action(F, 0, 1), Action(BW, 0, 0)
    assert tl["F0.1"].end - tl["F0.1"].start == pytest.approx(paired_cost(st, 0, f, b))
    assert paired_cost(st, 0, f, b) + paired_cost(st, 0, b, f) == pytest.approx(1 + 2 + 0 + 0)  # both hidden
    st_off = dataclasses.replace(st, a2a_overlap=False)  # no hiding: plain passes, no waiting
    tl = {str(t.action): t for tl in simulate(sched, st_off).timeline for t in tl}
    assert tl["F0.1"].start == pytest.approx(1.5)


def test_simulate_and_compare_show_the_pairs(capsys):
    assert main(["simulate", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "16", "--cost-a2a", "0.5",
                 "--memory-limit", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["overlap_pairs"] > 0 and d["advanced_ranks"] == [0, 1, 2, 3] and d["makespan"] == pytest.approx(68.5)
    assert main(["simulate", "--schedule", "zb-v", "--stages", "4", "--microbatches", "16", "--cost-a2a", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "overlapped F&B pairs hide it" in out and "lower bound" not in out  # the bound counts a2a serial


@pytest.mark.timing
def test_the_post_pass_is_quick_at_p16():
    st = Setting(16, 64, chunks=2, cost_a2a=[0.6], memory_limit=24.0, **COSTS)
    # zb-v's order as generated without the all-to-all (0.3 CPU s; with it, the generator's own
    # search takes 26 s at P=16 since 5126f8e, the pairing's input either way)
    s = generate("zb-v", dataclasses.replace(st, cost_a2a=[0.0]))
    t0 = time.process_time()  # CPU time: what the pass costs, not how busy the host is
    got = form_pairs(s, st)
    assert time.process_time() - t0 < 20  # about 1-2 s
    assert simulate(got, st).makespan < simulate(s, st).makespan


def test_plan_estimates_the_all_to_all_from_the_moe_flags(capsys):
    from megatron_zb.core.costs.model import ModelSpec
    spec = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=2048, num_experts=8,
                     moe_router_topk=2, expert_model_parallel_size=4)
    assert spec.layer_a2a_bytes() == 2 * 2048 * 2 * 1024 * 2 * 3 / 4  # 2 x tokens x k x h x e, 3/4 leave
    assert dataclasses.replace(spec, expert_model_parallel_size=1).layer_a2a_bytes() == 0
    args = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "2048",
            "--num-experts", "8", "--expert-model-parallel-size", "4", "--pipeline-parallel-size", "4",
            "--num-microbatches", "8", "--jobs", "1", "--ep-bandwidth-gbps", "25", "--json"]
    assert main(args) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"]
            if "error" not in r and not r.get("vocab_parallel")}  # (vocabulary parallelism: no EP overlap yet)
    per_layer = spec.layer_a2a_bytes() / 25e9
    assert rows["1f1b"]["cost_a2a_s"] == pytest.approx([2 * per_layer] * 4)  # 2 layers per rank
    assert rows["dualpipe-v"]["overlap_pairs"] > 0 and "--overlap-moe-expert-parallel-comm" in rows["dualpipe-v"]["flags"]
    assert main(args + ["--no-overlap"]) == 0
    serial = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r}
    assert serial["dualpipe-v"]["iteration_time_s"] > rows["dualpipe-v"]["iteration_time_s"]
    assert main(args[:-3] + ["--ep-bandwidth-gbps", "0"]) == 2
    assert "--ep-bandwidth-gbps" in capsys.readouterr().err


@pytest.mark.timing
def test_sleep_passes_charge_a_pair_what_the_simulator_does(monkeypatch):
    from megatron_zb.runtime.emulate import sleep_passes as SP
    from megatron_zb.runtime.emulate.sleep_passes import precise_sleep, sleep_passes
    st = Setting(2, 4, cost_f=2, cost_b=3, cost_w=1, cost_a2a=1.5)  # per chunk (V): F 1, B 1.5, W .5, a2a .75
    pl = Placement.vshape(2)
    f, b = Action(F, 1, 1), Action(B, 2, 0)
    ps = sleep_passes(st, 1, pl, unit=0.002, pairs_as_one=True)
    assert sleep_passes(st, 1, pl).overlap is None  # by default a pair runs as its two passes
    v = dataclasses.replace(st, chunks=2)
    want = paired_cost(v, 1, f, b) + paired_cost(v, 1, b, f)
    assert want == pytest.approx(1 + 1.5)  # each all-to-all (0.75) hidden behind the other's compute
    assert ps.pair_seconds(1, 2, True) == pytest.approx(want * 0.002)
    assert ps.seconds[F] == pytest.approx(1.75 * 0.002)  # a plain F: compute + all-to-all
    assert ps.pair_seconds(1, 2, False) == pytest.approx((1 + 2.0) * 0.002)  # with a BW (B + W 2.0)
    asked = []  # the pair's sleep: aimed at its start + pair_seconds, never later (whatever the load)
    monkeypatch.setattr(SP, "precise_sleep", lambda sec: (asked.append(sec), precise_sleep(sec)))
    t0 = time.perf_counter()
    out, g = ps.overlap((1, 1, None), (2, 0, None, None, None, True))  # the executor's pair call
    took = time.perf_counter() - t0
    assert out.shape == (4,) and g.shape == (4,) and took >= 0.005
    assert len(asked) == 1 and asked[0] <= 0.005
    serial = sleep_passes(dataclasses.replace(st, a2a_overlap=False), 1, pl, unit=0.002)
    assert serial.pair_seconds(1, 2, True) == pytest.approx((1.75 + 2.25) * 0.002)


@pytest.mark.dist
@pytest.mark.timing
def test_emulated_pairs_run_as_one_pass_in_the_schedules_order():
    """dualpipe-v's and zb-v's pairs on 4 real processes (sleeping passes, real messages): each rank
    runs its schedule's passes in order (the recorded sequence, not sorted clock readings), every
    pair as one pass (its B inside its F's interval, the two back to back), no pass and no
    iteration shorter than the plan allows. What holds whatever the host's load; the measured
    speed-up of the hidden all-to-all (measured < the serial prediction, error vs the simulator)
    is a figure: benchmarks/bench_test_figures.py (and bench_moe_overlap.py)."""
    from megatron_zb.core.sim.iteration import iteration_times
    from megatron_zb.verify.timing.emulate import Entry, Timing, emulate, predicted_iteration, schedule_for
    unit = 2e-3
    entries = [Entry("dualpipe-v"), Entry("zb-v")]
    # timeout: a hang guard (the 4 ranks start in seconds on a quiet host, minutes at a load of 50)
    rows = emulate(entries, Setting(4, 8, cost_f=10.0, cost_b=10.0, cost_w=6.0, cost_a2a=6.0),
                   Timing(unit_s=unit, iterations=2, warmup=1, timeout=900))
    by = {r["label"]: r for r in rows}
    for name in ("dualpipe-v", "zb-v"):
        r = by[name]
        st = Setting(4, 8, cost_f=10, cost_b=10, cost_w=6, cost_a2a=6, cost_comm=r["hop"])
        sched, built = schedule_for(Entry(name), st)
        assert _pairs(sched) > 0 and r["hop"] >= 0
        assert r["predicted"] == pytest.approx(predicted_iteration(Entry(name), st))
        # sleeps cannot end early: no iteration beats the same schedule simulated without message time
        floor = iteration_times(sched, dataclasses.replace(built, cost_comm=0.0)).iteration_time
        assert len(r["per_iteration"]) == 2 and min(r["per_iteration"]) >= 0.98 * floor, (r["per_iteration"], floor)
        flat = sched.flat()
        tl = r["timeline"].timeline  # what ran, in the order each rank ran it (a pair: F then B)
        for rank in range(4):
            assert [(t.action.kind, t.action.stage, t.action.mb) for t in tl[rank]] == \
                [(a.kind, a.stage, a.mb) for a in flat.orders[rank] if a.is_compute]
        pairs = flat.meta["overlap_pairs"]
        assert len(pairs) == _pairs(sched)
        for rank, k in pairs:
            f, b = tl[rank][k], tl[rank][k + 1]
            assert f.start <= b.start and b.end <= f.end, (name, rank, k, f, b)  # one pass: B inside F's
            assert f.end - f.start >= 0.98 * (paired_cost(built, rank, f.action, b.action)
                                               + paired_cost(built, rank, b.action, f.action)), (name, f, b)
        for rank in range(4):  # one pass at a time: each begins after the previous one ended (pairs: F's)
            outer = [t for i, t in enumerate(tl[rank]) if (rank, i - 1) not in pairs]
            assert all(x.end <= y.start for x, y in zip(outer, outer[1:])), (name, rank)
    serial = predicted_iteration(Entry("dualpipe-v"), Setting(4, 8, cost_f=10, cost_b=10, cost_w=6, cost_a2a=6,
                                                              a2a_overlap=False))
    hidden = predicted_iteration(Entry("dualpipe-v"), Setting(4, 8, cost_f=10, cost_b=10, cost_w=6, cost_a2a=6))
    assert serial == pytest.approx(343.0) and hidden == pytest.approx(301.0)  # without message time
