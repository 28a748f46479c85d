"""Activation offload on real megatron-core (CPU test mode: synchronous copies to separate CPU
buffers), through ``install()`` and megatron's ``get_forward_backward_func()``: gradients and
losses equal the non-pipelined reference for every schedule family at PP=4 and TP=2 x PP=2, with
ratios 0.5 and 1, with the W queue (weight-gradient inputs travelling between B and W) and with
recomputation; ratio 0 moves nothing; the measured peak of resident activation bytes is the
simulator's. All cases share one launch of 4 gloo processes."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_zb import verify as V
from megatron_zb.core.ir import Setting
from megatron_zb.core.sim.lower import lower
from megatron_zb.core.sim.hostlink import OffloadOptions
from megatron_zb.core.passes.offload import add_offload
from megatron_zb.core.schedules import generate, get
from megatron_zb.core.sim.simulate import simulate

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

FAMILIES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "interleaved-1f1b")
K = 0.1  # short transfers: most activations of these small pipelines have time to travel


def _m(name, p):
    return 8 if get(name).chunks != 2 else 4 * p // 2


# one family per placement and kind of backward: what a second megatron-core runs (see results())
SECOND_VERSION_FAMILIES = ("1f1b", "zb-h2", "zb-v", "interleaved-1f1b")  # zb-h2: the W queue test


def _cases(profile_path, ratios=(0.5, 1.0), second_version=False):
    cases = []
    for name in (SECOND_VERSION_FAMILIES if second_version else FAMILIES):
        for ratio in ratios:
            cases.append(V.make_case(name, 4, num_microbatches=_m(name, 4), iterations=2, offload_ratio=ratio,
                                     offload_time=K, label=f"pp4 {name} {ratio}"))
            cases.append(V.make_case(name, 2, tensor_parallel_size=2, num_microbatches=_m(name, 2), iterations=2,
                                     offload_ratio=ratio, offload_time=K, sequence_parallel=(ratio == 1.0),
                                     label=f"tp2pp2 {name} {ratio}"))
    cases += [
        V.make_case("zb-h1", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time=K,
                    config_overrides={"recompute_granularity": "full", "recompute_method": "uniform",
                                      "recompute_num_layers": 1}, label="recompute full"),
        V.make_case("zb-v", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time=K,
                    config_overrides={"recompute_granularity": "selective"}, label="recompute selective"),
        V.make_case("zb-h2", 2, tensor_parallel_size=2, num_microbatches=6, iterations=2, offload_ratio=1.0,
                    offload_time=K, overlap_grad_reduce=True, gradient_accumulation_fusion=True,
                    config_overrides={"deallocate_pipeline_outputs": True}, label="ddp overlap + gaf + dealloc"),
        V.make_case("zb-h2", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time=K,
                    offload_half_duplex=True, ddp=False, label="half duplex, no ddp"),
        V.make_case("bitpipe", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time=K,
                    label="bitpipe (replicated stages)"),
        V.make_case("interleaved-zb", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time=K,
                    label="interleaved-zb"),
        V.make_case("zb-h1", 4, num_microbatches=8, iterations=3, offload_ratio=1.0, offload_time=K,
                    post_validation=True, clip_grad=0.5, label="post-validation with rollbacks"),
        V.make_case("zb-h2", 4, num_microbatches=8, iterations=2, offload_ratio=0.0, label="ratio 0"),
        V.make_case("zb-v", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time="auto",
                    label="auto offload time"),
        V.make_case("zb-h1", 4, num_microbatches=8, iterations=2, offload_ratio=1.0, offload_time=K,
                    schedule_options={"profile_window": (1, 2), "profile_path": profile_path}, label="profiled"),
        V.make_case("zb-h2", 4, num_microbatches=8, iterations=2, label="no offload"),
    ]
    cases += [V.make_case("1f1b", 4, num_microbatches=8, iterations=2, offload_ratio=r, offload_time=K,
                          label=f"memory 1f1b {r}") for r in (0.0, 0.5, 1.0)]
    if not second_version:  # which activations zb-auto offloads under a limit: megatron-zb's own search
        cases.append(V.make_case("zb-auto", 4, num_microbatches=8, iterations=2, offload_ratio="auto",
                                 offload_time=K, memory_limit=3.0, label="auto under limit 3"))
    return cases


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("offload") / "profile.json")


@pytest.fixture(scope="module")
def results(mcore_path, profile_path):
    # every family at both ratios on the installed megatron-core; on the second one (MZB_MCORE,
    # run_tests.sh's pass 2) ratio 1 and one family per placement and kind of backward only: what
    # differs between versions is megatron's side (hooks, DDP buffers, TP/SP layers), which every
    # case still exercises; which activations move and when is megatron-zb's own
    second = mcore_path is not None
    cases = _cases(profile_path, ratios=(1.0,) if second else (0.5, 1.0), second_version=second)
    res = V.run_verify_many(cases, timeout=1500, mcore_path=mcore_path)
    return {c.label: (c, r) for c, r in zip(cases, res)}


def test_gradients_and_losses_equal_the_reference(results, mcore_version):
    bad = [f"{label}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')} "
           f"loss={r.get('max_abs_loss_diff')}" for label, (c, r) in results.items() if not r["passed"]]
    assert not bad, "\n".join(bad)
    for label, (c, r) in results.items():
        assert not mcore_version or r["megatron_core"].startswith(mcore_version), (label, r["megatron_core"])
        if c.offload_ratio not in (None, 0.0) and not c.post_validation:  # (that report has no byte counts)
            moved = sum(it["offloaded_parts"] for o in r["offload"] for it in o["iterations"])
            assert moved > 0, label
            for o in r["offload"]:
                last = o["iterations"][-1]
                assert last["offloaded_bytes"] == last["reloaded_bytes"], label
                assert last["host_allocations"] == 0, (label, "host buffers are reused after the first iteration")


def test_w_queue_tensors_travel(results):
    # split-backward schedules offload what W needs between B and W as well (OFFLOAD_W)
    c, r = results["pp4 zb-h2 1.0"]
    parts = {o["rank"]: o["iterations"][-1]["offloaded_parts"] for o in r["offload"]}
    c1, r1 = results["pp4 1f1b 1.0"]
    parts_1f1b = {o["rank"]: o["iterations"][-1]["offloaded_parts"] for o in r1["offload"]}
    assert parts[3] > 0 and parts_1f1b[3] == 0  # the last stage's F->B gap is empty; its B->W gap is not


def test_ratio_zero_moves_nothing_and_matches_plain_run(results):
    _, r0 = results["ratio 0"]
    _, rn = results["no offload"]
    assert r0["losses"] == rn["losses"]
    assert all(it["offloaded_bytes"] == 0 and it["offloaded_parts"] == 0 for o in r0["offload"] for it in o["iterations"])
    assert "offload" not in rn


def test_measured_peak_is_the_simulators(results):
    # the executor runs the lowered list in order and its CPU copies are synchronous: simulate
    # the same schedule with instantaneous transfers; the measured peak, in units of one F's
    # captured bytes, is the simulated peak on every rank
    peaks = {}
    for ratio in (0.0, 0.5, 1.0):
        c, r = results[f"memory 1f1b {ratio}"]
        st = Setting(4, 8, chunks=1)
        sched = generate("1f1b", st)
        if ratio:
            sched = add_offload(sched, st, OffloadOptions(ratio=ratio, time=K))
            sched = dataclasses.replace(sched, meta=dict(sched.meta, offload=dict(sched.meta["offload"], time=0.0)))
        sim = simulate(lower(sched, st) if ratio else sched, st)
        by_pp = {o["pp_rank"]: o["iterations"][-1] for o in r["offload"]}
        measured = [by_pp[q]["peak_resident_bytes"] / by_pp[q]["captured_bytes_per_forward"] for q in range(4)]
        assert measured == pytest.approx(sim.peak_memory, abs=0.05), (ratio, measured, sim.peak_memory)
        peaks[ratio] = measured
    assert peaks[0.0] == pytest.approx([4, 3, 2, 1], abs=0.05)
    assert max(peaks[1.0]) < max(peaks[0.5]) < max(peaks[0.0])


def test_profiler_reports_the_managers_counts(results, profile_path):
    import json
    assert results["profiled"][1]["passed"]
    prof = json.loads(open(profile_path).read())
    assert prof["mem_method"] == "saved_tensors_hooks (OffloadManager)"  # the manager's capture counted
    assert all(x > 0 for x in prof["mem_f"]) and prof["mem_w_source"] == "measured"
    rows = prof["offload"]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3] and all(r["iterations"] == 2 for r in rows)
    assert all(r["peak_resident_bytes"] > 0 and r["captured_bytes_per_forward"] > 0 for r in rows)
    assert rows[0]["offloaded_bytes"] > 0 and rows[0]["host_allocations"][-1] == 0


def test_auto_offload_time_is_measured_once_and_agreed(results):
    # --auto-offload-time: every rank measures (here: CPU memcpy and matmul stand-ins) and all
    # take the largest K, so they run the same schedule (else the run would hang or fail)
    c, r = results["auto offload time"]
    ks = {it["offload_time"] for o in r["offload"] for it in o["iterations"]}
    assert len(ks) == 1 and isinstance(ks.pop(), float)


def test_post_validation_rollbacks_with_offload(results):
    # a rolled-back step drains the rest of its iteration: the manager forgets those parts
    c, r = results["post-validation with rollbacks"]
    assert r["passed"] and r["rollbacks"] > 0 and r["bit_identical_to_synchronous"], r.get("problems")
