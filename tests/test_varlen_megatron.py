"""--zero-bubble-balance-microbatches on real megatron-core: skewed variable-length batches balanced
over DP=2 replicas of a PP=2 pipeline (replicas running different microbatch counts) give the
losses and gradients of the non-pipelined reference on the same sequences, the loss normalised
over the global token count on both sides (real gloo processes, two iterations with an SGD step
between them). The refusals are one line each."""
from __future__ import annotations

import pytest

from megatron_zb import verify as V
from megatron_zb.verify.case import VerifyUsageError

pytestmark = [pytest.mark.megatron, pytest.mark.dist]


def test_balanced_dp2_pp2_equals_the_reference(mcore_path, mcore_version):
    kw = dict(num_microbatches=4, data_parallel_size=2, micro_batch_size=1, variable_seq_lengths=True,
              balance_microbatches=True)
    cases = [V.make_case(n, 2, iterations=2, **kw) for n in ("1f1b", "zb-h1", "zb-v")]
    # with activation offload (CPU test mode), and post-validated (bit-identical to the synchronous run)
    extra = [V.make_case("zb-h1", 2, iterations=2, offload_ratio=0.5, label="offload", **kw),
             V.make_case("zb-v", 2, iterations=3, post_validation=True, label="post-validation", **kw)]
    results = V.run_verify_many(cases + extra, timeout=900, mcore_path=mcore_path)
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')} "
           f"loss={r.get('max_abs_loss_diff')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert not mcore_version or r["megatron_core"].startswith(mcore_version)
    assert results[-1]["bit_identical_to_synchronous"]
    for r in results[:4]:
        counts = r["microbatches_per_replica"]
        assert len(counts) == 2 and all(sum(c) == 8 for c in counts), counts  # every sequence, once
        assert any(c[0] != c[1] for c in counts), counts  # the replicas ran different microbatch counts


@pytest.mark.parametrize("opts, match", [
    (dict(variable_seq_lengths=False), "give --variable-seq-lengths"),
    (dict(schedule="megatron-1f1b"), "pseudo-schedule megatron-1f1b"),
    (dict(schedule="bitpipe", num_microbatches=4), "replicated stages"),
    (dict(schedule="zb-v", overlap_grad_reduce=True), "--overlap-grad-reduce with several chunks"),
])
def test_balance_refusals(opts, match):
    kw = dict(variable_seq_lengths=True, balance_microbatches=True, data_parallel_size=2)
    kw.update(opts)
    name = kw.pop("schedule", "zb-h1")
    with pytest.raises(VerifyUsageError, match=match):
        V.make_case(name, 2, **kw)
