"""Megatron's expert-parallel all-to-all overlap (``--overlap-moe-expert-parallel-comm``) under
megatron-zb schedules: every training pass runs through megatron-core's schedule plans
(``megatron.ep_overlap``), each overlapped F&B pair of the schedule as one combined pass, and the
result equals the non-pipelined reference (losses, every gradient, the per-layer aux losses) on both
megatron-core versions. On CPU the streams are no-ops: this checks correctness, not overlap."""
from __future__ import annotations

import pytest

from megatron_zb import verify as V
from megatron_zb.core.build import build
from megatron_zb.megatron.execution.options import ScheduleOptions

MOE = dict(num_experts=4, expert_model_parallel_size=2, data_parallel_size=2, moe_router_topk=2,
           moe_aux_loss_coeff=0.01, ep_overlap=True)


def _pairs(schedule: str, p: int, m: int) -> int:
    """The pairs of the schedule training builds with the option (the all-to-all at half of F)."""
    req = ScheduleOptions(schedule, ep_overlap=True).request()
    return len(build(req, p, m).lowered().meta.get("overlap_pairs", ()))


@pytest.mark.megatron
@pytest.mark.dist
def test_ep_overlap_equals_reference(mcore_path, mcore_version):
    """World size 4 (PP=2 x DP=2, experts over EP=2): dualpipe-v (pairs in its order) with routed and
    shared experts, zb-v (pairs the core forms); each of the schedule's pairs ran as one pass through
    megatron's plans."""
    cases = [V.make_case("dualpipe-v", 2, num_microbatches=8, iterations=2, **MOE),
             V.make_case("zb-v", 2, num_microbatches=8, iterations=2, **MOE),
             V.make_case("dualpipe-v", 2, num_microbatches=6, iterations=2, label="shared experts",
                         moe_shared_expert_intermediate_size=64, **MOE)]
    results = V.run_verify_many(cases, timeout=900, mcore_path=mcore_path)
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')}"
           for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for case, r in zip(cases, results):
        assert r["megatron_core"].startswith(mcore_version or ""), r["megatron_core"]
        assert r["max_rel_grad_diff"] <= 1e-5 and r["max_abs_aux_loss_diff"] is not None, r["case"]
        want = _pairs(case.schedule, case.pipeline_parallel_size, case.num_microbatches)
        assert want > 0 and r["overlapped_pairs"] == want, (r["case"], r["overlapped_pairs"], want)


def test_ep_overlap_refused_without_pairs_or_experts(capsys):
    """One line, exit 2: a schedule without overlapped pairs, or no expert parallelism."""
    from megatron_zb.verify.command import main_verify
    base = ["-p", "2", "-d", "2", "--num-experts", "4", "--overlap-moe-expert-parallel-comm"]
    for argv, msg in [(["--schedule", "zb-h1", "--expert-model-parallel-size", "2"], "has no overlapped F&B pair"),
                      (["--schedule", "dualpipe-v"], "--expert-model-parallel-size >= 2"),
                      (["--schedule", "dualpipe-v", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "allgather"], "alltoall")]:
        assert main_verify(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err


def test_ep_overlap_flag_with_training_flags():
    """Megatron's flag is taken where the built schedule has overlapped pairs (dualpipe-v's own, those the
    core forms in zb-v with the all-to-all) and refused in one line, at start-up, where it has none."""
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError, ZeroBubbleConfigError
    from megatron_zb.megatron.execution.options import ScheduleOptions, check_ep_overlap, preview
    from tests.test_args import BASE, validate
    _, kw = validate(BASE + " --zero-bubble-schedule zb-v --overlap-moe-expert-parallel-comm --zero-bubble-cost-a2a 0.4"
                     " --zero-bubble-cost-f 1 --zero-bubble-cost-b 1 --zero-bubble-cost-w 1")  # every stage alike
    assert kw["ep_overlap"] and kw["cost_a2a"] == 0.4
    built, base = preview(ScheduleOptions(**kw), 4, 16)
    assert built.setting.cost_a2a == [0.4] * 4 and built.lowered().meta["overlap_pairs"]
    assert built.result.makespan < base.makespan
    for name in ("dualpipe-v", "interleaved-1f1b"):
        check_ep_overlap(preview(ScheduleOptions(name, ep_overlap=True), 4, 16)[0])
    with pytest.raises(ZeroBubbleArgumentError, match="schedule 1f1b at pipeline size 4 with 16 microbatches has no"):
        preview(ScheduleOptions("1f1b", ep_overlap=True), 4, 16)
    assert ScheduleOptions("zb-v").request().cost_a2a == 0.0  # without the flag: no all-to-all, no pairs
