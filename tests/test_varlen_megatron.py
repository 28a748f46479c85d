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


def test_training_flags():
    """--zero-bubble-balance-microbatches in the flags: Megatron's variable_seq_lengths and the
    per-token loss turned on, the install option given; what it cannot run with refused in one line."""
    from megatron_zb.megatron.features.balance_args import after_megatron_validation
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError
    from tests.test_args import BASE, validate
    args, kw = validate(BASE + " --zero-bubble-schedule zb-v --zero-bubble-balance-microbatches "
                               "--zero-bubble-attention-share 0.2")
    assert kw["balance_microbatches"] and kw["balance_attention_share"] == 0.2
    assert args.calculate_per_token_loss and args.zero_bubble_set_per_token_loss
    args.variable_seq_lengths = False  # what Megatron's validate_args does
    after_megatron_validation(args)
    assert args.variable_seq_lengths and args.moe_token_dispatcher_type == "alltoall"
    for cmd, match in ((" --zero-bubble-balance-microbatches", "needs a megatron-zb schedule"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-attention-share 0.2", "give that flag too"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-balance-microbatches --tensor-model-parallel-size 2",
                        "--tensor-model-parallel-size > 1 is not supported yet"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-mock-seq-lengths lognormal:512:1 --micro-batch-size 2",
                        "--micro-batch-size 1")):
        with pytest.raises(ZeroBubbleArgumentError, match=match):
            validate(BASE + cmd)
    with pytest.raises(SystemExit):  # argparse: a distribution it cannot read
        validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-mock-seq-lengths gamma:1")


def test_rows_are_padded_so_no_real_token_sees_a_pad():
    import torch

    from megatron_zb.megatron.features.balanced import collate, split_rows

    def batch(s, b=2):
        return {"tokens": torch.arange(b * s).view(b, s), "labels": torch.arange(b * s).view(b, s),
                "loss_mask": torch.ones(b, s), "position_ids": torch.arange(s).expand(b, s),
                "attention_mask": (torch.tril(torch.ones(s, s)).unsqueeze(0) < 0.5).expand(b, 1, s, s)}
    short, long = split_rows(batch(3))[0], split_rows(batch(5))[1]
    out = collate([short, long])
    assert out["tokens"].shape == (2, 5) and out["attention_mask"].shape == (2, 1, 5, 5)
    assert out["loss_mask"][0].tolist() == [1, 1, 1, 0, 0] and out["position_ids"][0].tolist() == [0, 1, 2, 3, 4]
    m = out["attention_mask"][0, 0]
    assert m[:3, 3:].all()  # the short row's real tokens never see its pads (True = masked)
    assert not m[4, :5].any() and m[3, 4]  # a pad sees what causal attention lets it
    assert torch.equal(out["attention_mask"][1], batch(5)["attention_mask"][1])
