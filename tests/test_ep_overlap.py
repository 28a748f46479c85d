"""Megatron's expert-parallel all-to-all overlap (``--overlap-moe-expert-parallel-comm``) under
megatron-zb schedules: every training pass runs through megatron-core's schedule plans
(``megatron.ep_overlap``), each overlapped F&B pair of the schedule as one combined pass, and the
result equals the non-pipelined reference (losses, every gradient, the per-layer aux losses) on both
megatron-core versions. On CPU the streams are no-ops: this checks correctness, not overlap."""
from __future__ import annotations

import pytest

from megatron_zb import verify as V
from megatron_zb.core import schedules as core_schedules
from megatron_zb.core.build import ScheduleRequest, build

MOE = dict(num_experts=4, expert_model_parallel_size=2, data_parallel_size=2, moe_router_topk=2,
           moe_aux_loss_coeff=0.01, ep_overlap=True)


def _pairs(schedule: str, p: int, m: int) -> int:
    return len(build(ScheduleRequest(schedule), p, m).lowered().meta.get("overlap_pairs", ()))


@pytest.mark.megatron
@pytest.mark.dist
def test_ep_overlap_equals_reference(mcore_path, mcore_version):
    """World size 4 (PP=2 x DP=2, experts over EP=2): dualpipe-v with routed and shared experts; each
    of the schedule's pairs ran as one pass through megatron's plans."""
    cases = [V.make_case("dualpipe-v", 2, num_microbatches=8, iterations=2, **MOE),
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
    for argv, msg in [(["--schedule", "zb-h1", "--expert-model-parallel-size", "2"], "needs a schedule with overlapped"),
                      (["--schedule", "dualpipe-v"], "--expert-model-parallel-size >= 2"),
                      (["--schedule", "dualpipe-v", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "allgather"], "alltoall")]:
        assert main_verify(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    assert "dualpipe-v" in core_schedules.overlapping()


def test_ep_overlap_flag_with_training_flags():
    """Megatron's flag is taken with schedules that have pairs and refused (naming them) otherwise."""
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError, ZeroBubbleConfigError
    from megatron_zb.megatron.options import ScheduleOptions
    from tests.test_args import BASE, validate
    _, kw = validate(BASE + " --zero-bubble-schedule dualpipe-v --overlap-moe-expert-parallel-comm")
    assert kw["schedule"] == "dualpipe-v"
    with pytest.raises(ZeroBubbleArgumentError, match="overlapped F&B pairs .*dualpipe-v"):
        validate(BASE + " --zero-bubble-schedule zb-h2 --overlap-moe-expert-parallel-comm")
    with pytest.raises(ZeroBubbleConfigError, match="schedule 1f1b has none"):
        ScheduleOptions("1f1b", ep_overlap=True).check(cuda=False)
    ScheduleOptions("dualpipe-v", ep_overlap=True).check(cuda=False)
