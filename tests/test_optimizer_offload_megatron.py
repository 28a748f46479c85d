"""Megatron's optimizer CPU offload (``--optimizer-cpu-offload``, ``HybridDeviceOptimizer``) under
megatron-zb's schedules with optimizer post-validation, on real megatron-core (gloo processes;
the CPU stands in for the GPU, ``megatron.features.optimizer_offload.use_cpu_as_device``): a static
fraction and per-rank shares ('auto'), fp32 and bf16 with the distributed optimizer (Megatron's
precision-aware path), clipping (rollbacks), an injected non-finite gradient (a skipped step),
activation offload on top; and the states visiting the GPU in each rank's troughs
(``--zero-bubble-optimizer-offload trough``: the core's trough plan executed, half of the subgroups
updated on the "GPU", half on the CPU; post-validation rolling them back from their host copy).
Each run must be bit-identical to the synchronous pipelined run and match the one-process
reference with the same optimizer flags (Megatron's static offload). One launch of 2 ranks."""
from __future__ import annotations

import pytest

from megatron_zb import verify as V

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

ITERATIONS = 3  # the trough cases keep the launch near its old time (4 before them)


def _cases():
    return [
        V.make_case("zb-h1", 2, 1, num_microbatches=4, iterations=ITERATIONS, post_validation=True, clip_grad=0.9,
                    optimizer_offload=0.5, label="static"),
        V.make_case("zb-h1", 2, 1, num_microbatches=4, iterations=ITERATIONS, post_validation=True, clip_grad=0.9,
                    optimizer_offload=0.5, optimizer_trough=True, label="static, trough"),
        V.make_case("zb-v", 2, 1, num_microbatches=4, iterations=ITERATIONS, post_validation=True, clip_grad=1.5,
                    optimizer_offload=1.0, bf16=True, use_distributed_optimizer=True, inject_nonfinite_at=1,
                    optimizer_trough=True, label="bf16 dist-opt all, trough"),
        V.make_case("zb-h2", 2, 1, num_microbatches=4, iterations=ITERATIONS, post_validation=True, clip_grad=0.9,
                    optimizer_offload="auto", offload_ratio=0.5, optimizer_trough=True,
                    label="auto + activation offload, trough"),
        V.make_case("zb-v", 2, 1, num_microbatches=4, iterations=ITERATIONS, post_validation=True,
                    optimizer_offload="auto", label="auto eager"),
    ]


@pytest.fixture(scope="module")
def results(mcore_path):
    cases = _cases()
    return cases, V.run_verify_many(cases, timeout=900, mcore_path=mcore_path)


def test_equal_to_the_reference_and_bit_identical_to_synchronous(results, mcore_version):
    cases, res = results
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} loss={r.get('max_abs_loss_diff')} "
           f"param={r.get('max_rel_param_diff')}" for r in res if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in res:
        assert r["bit_identical_to_synchronous"] is True, r["case"]
        assert not mcore_version or r["megatron_core"].startswith(mcore_version)


def test_states_are_on_the_host_as_asked(results):
    cases, res = results
    for c, r in zip(cases, res):
        shares = {rank: h / t for rank, (h, t) in r["offloaded"].items()}
        assert all(s > 0 for s in shares.values()), (c.label, shares)
        if c.optimizer_offload == 1.0:
            assert all(s == 1.0 for s in shares.values()), shares
        if c.optimizer_offload == "auto":  # each rank its own share
            assert len({round(s, 3) for s in shares.values()}) > 1, (c.label, shares)


def test_rollbacks_skips_and_eager_steps(results):
    cases, res = results
    by = {c.label: r for c, r in zip(cases, res)}
    assert by["static"]["rollbacks"] > 0  # clipped steps redone by Megatron's step, host copies restored
    assert by["bf16 dist-opt all, trough"]["skipped_iterations"] == 1
    assert by["auto + activation offload, trough"]["rollbacks"] > 0
    assert by["auto eager"]["rollbacks"] == 0 and by["auto eager"]["eager_steps"] == ITERATIONS


def test_trough_is_static_offload_bit_for_bit(results):
    """Half of the subgroups updated on the "GPU" in the troughs (the same optimizer on the same
    values, host and device one memory here), rolled back from their host copy: the losses of
    Megatron's static offload, bit for bit, synchronous and post-validated (every step clipped)."""
    cases, res = results
    by = {c.label: r for c, r in zip(cases, res)}
    static, trough = by["static"], by["static, trough"]
    assert trough["rollbacks"] == static["rollbacks"] > 0
    assert trough["losses"] == static["losses"] and trough["synchronous_losses"] == static["synchronous_losses"]


def test_trough_plan_is_executed(results):
    """Every trough run: both kinds of subgroups on every rank; each visit prefetched at the plan's
    point in the synchronous run (none copied at the step), written back and released; a
    post-validation rollback drops the visiting copies (and the redo copies them at the step)."""
    cases, res = results
    for c, r in zip(cases, res):
        if not c.optimizer_trough:
            assert "trough" not in r
            continue
        for rank, by_mode in r["trough"].items():
            for mode, t in by_mode.items():
                where = (c.label, rank, mode, t)
                assert t["on_gpu"] > 0 and t["on_cpu"] > 0, where
                assert t["written_back"] == t["visited"] and t["released"] > 0, where
                if mode == "synchronous":
                    assert t["visited"] == t["on_gpu"] * (ITERATIONS - r["skipped_iterations"]), where  # a skip: no update
                    assert t["synchronous_visits"] == 0 and t["prefetched"] == t["visited"], where
                else:
                    assert t["rollbacks"] == r["rollbacks"], where


def test_bad_offload_options_are_refused():
    with pytest.raises(V.VerifyUsageError, match="fraction"):
        V.make_case("zb-h1", 2, 1, optimizer="adam", optimizer_offload=1.5)
    with pytest.raises(V.VerifyUsageError, match="distributed-optimizer"):
        V.make_case("zb-h1", 2, 1, optimizer="adam", optimizer_offload=0.5, bf16=True)
    with pytest.raises(V.VerifyUsageError, match="needs --bf16"):
        V.make_case("zb-h1", 2, 1, optimizer="adam", optimizer_offload=0.5, use_distributed_optimizer=True)
    with pytest.raises(V.VerifyUsageError, match="optimizer"):
        V.make_case("zb-h1", 2, 1, optimizer_offload=0.5)
    c = V.make_case("zb-h1", 2, 1, optimizer_trough=True)  # Adam, every state on the host
    assert (c.optimizer, c.optimizer_offload) == ("adam", 1.0)
    with pytest.raises(V.VerifyUsageError, match="no pipeline"):
        V.make_case("zb-h1", 1, 1, optimizer_trough=True)
