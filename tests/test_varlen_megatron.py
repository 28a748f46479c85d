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
             # the length cost model fitted to the profile window's passes (iterations 1-2), planned with in the third
             V.make_case("zb-h1", 2, iterations=3, schedule_options={"profile_window": (1, 2)}, label="calibrated", **kw),
             V.make_case("zb-v", 2, iterations=3, post_validation=True, label="post-validation", **kw),
             # the other families (interleaved, V-Half's memory), and the microbatches in Megatron's
             # packed-sequence format (THD: several sequences, each attending within itself)
             V.make_case("interleaved-zb", 2, iterations=2, label="interleaved", **kw),
             V.make_case("v-half", 2, iterations=2, label="v-half", **kw),
             V.make_case("zb-h1", 2, iterations=2, pack_sequences=True, label="packed", **kw)]
    results = V.run_verify_many(cases + extra, timeout=900, mcore_path=mcore_path)
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')} "
           f"loss={r.get('max_abs_loss_diff')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert not mcore_version or r["megatron_core"].startswith(mcore_version)
    assert results[5]["bit_identical_to_synchronous"]
    cal = results[4]  # fitted after the window, every rank planning with the same fit
    assert cal["balance_calibration"][:2] == [None, None] and cal["balance_calibration"][2] is not None, cal
    assert cal["balance_calibration_agrees"] and cal["balance_calibration"][2]["samples"] > 0
    for r in results[:4]:
        counts = r["microbatches_per_replica"]
        assert len(counts) == 2 and all(sum(c) == 8 for c in counts), counts  # every sequence, once
        assert any(c[0] != c[1] for c in counts), counts  # the replicas ran different microbatch counts
    packed = results[-1]["microbatches_per_replica"]  # 8 sequences per iteration, several in some microbatch
    assert all(sum(c) < 8 for c in packed), packed


@pytest.mark.parametrize("opts, match", [
    (dict(variable_seq_lengths=False), "give --variable-seq-lengths"),
    (dict(schedule="megatron-1f1b"), "pseudo-schedule megatron-1f1b"),
    (dict(schedule="bitpipe", num_microbatches=4), "replicated stages"),
    (dict(schedule="zb-v", overlap_grad_reduce=True), "--overlap-grad-reduce with several chunks"),
    (dict(balance_microbatches=False, pack_sequences=True), "packs the balanced microbatches"),
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
    from megatron_zb.megatron.features.flags.balance import after_megatron_validation
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError
    from tests.test_args import BASE, validate
    args, kw = validate(BASE + " --zero-bubble-schedule zb-v --zero-bubble-balance-microbatches "
                               "--zero-bubble-attention-share 0.2")
    assert kw["balance_microbatches"] and kw["balance_attention_share"] == 0.2 and "balance_pack" not in kw
    args, kw = validate(BASE + " --zero-bubble-schedule zb-v --zero-bubble-balance-microbatches --zero-bubble-pack-sequences")
    assert kw["balance_pack"]
    from megatron_zb.megatron.launch.session import ENTRY_ROUTE, TrainingSession
    with pytest.raises(ZeroBubbleArgumentError, match="add --sft"):  # a script of the user's: its forward step must take them
        TrainingSession(args, kw, 8, route="the user's script").check()
    TrainingSession(args, kw, 8, route=ENTRY_ROUTE).check()
    args.sft = True
    TrainingSession(args, kw, 8, route="the user's script").check()
    assert args.calculate_per_token_loss and args.zero_bubble_set_per_token_loss
    args.variable_seq_lengths = False  # what Megatron's validate_args does
    after_megatron_validation(args)
    assert args.variable_seq_lengths and args.moe_token_dispatcher_type == "alltoall"
    for cmd, match in ((" --zero-bubble-balance-microbatches", "needs a megatron-zb schedule"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-attention-share 0.2", "give that flag too"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-pack-sequences", "give that flag too"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-balance-microbatches --tensor-model-parallel-size 2",
                        "--tensor-model-parallel-size > 1 is not supported yet"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-mock-seq-lengths lognormal:512:1 --micro-batch-size 2",
                        "--micro-batch-size 1"),
                       (" --zero-bubble-schedule zb-h1 --zero-bubble-seq-lengths eod --micro-batch-size 2",
                        "--micro-batch-size 1")):
        with pytest.raises(ZeroBubbleArgumentError, match=match):
            validate(BASE + cmd)
    args, _ = validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-seq-lengths eod --micro-batch-size 1")
    assert args.zero_bubble_mock_seq_lengths == "eod"
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


def test_the_profile_windows_passes_calibrate_the_length_model():
    """A profile's length samples (as the profiler records them with balancing on) give each
    stage's reference costs (units of their mean F) and the shares; B and W fused (BW) count as B;
    every pipeline's fit agreed as their mean."""
    from megatron_zb.megatron.features.balanced import agree, calibration_of
    from megatron_zb.runtime.observe.profile_data import build_profile
    from megatron_zb.core.ir import Placement

    def t(c, tok, q):
        return c[0] + c[1] * tok + c[2] * q
    c = {"F": (1e-3, 1e-5, 2e-9), "BW": (3e-3, 3e-5, 7e-9)}
    shapes = [(s, s * s) for s in (64, 256, 512, 1024, 2048)]
    stats = [{"rank": r, "times": {k: {str(r): [t(v, *sh) for sh in shapes]} for k, v in c.items()},
              "length_samples": {k: {str(r): [[*sh, t(v, *sh) * (1 + r)] for sh in shapes]} for k, v in c.items()}}
             for r in range(2)]
    prof = build_profile(stats, schedule="1f1b", placement=Placement.single(2), microbatches=5, window=(1, 1))
    got = calibration_of(prof, 1024)
    f_ref = t(c["F"], 1024, 1024 ** 2)
    assert got["cost_f"] == pytest.approx([1 / 1.5, 2 / 1.5])  # mean F = 1
    assert got["cost_b"] == pytest.approx([x * t(c["BW"], 1024, 1024 ** 2) / f_ref for x in got["cost_f"]])
    assert got["cost_w"] == [0.0, 0.0] and "W" not in got["attention"]
    assert got["attention"]["F"] == pytest.approx(2e-9 * 1024 ** 2 / f_ref)
    mean = agree([got, dict(got, cost_f=[1.0, 1.0], attention={"F": 0.0, "B": 0.5})])
    assert mean["cost_f"] == pytest.approx([(1 / 1.5 + 1) / 2, (2 / 1.5 + 1) / 2])
    assert mean["attention"]["B"] == pytest.approx((got["attention"]["B"] + 0.5) / 2)
    flat = dict(prof, length_samples={k: {"0": [[512, 512 ** 2, 1.0]] * 3} for k in ("F", "BW")})
    assert calibration_of(flat, 1024) is None  # one length: nothing to fit



def test_samples_cut_to_a_distribution_or_at_their_first_end_of_document():
    import torch

    from megatron_zb.megatron.features.varlen_data import VariableLengthDataset, up_to_eod

    s = 8
    eod = 9
    rows = [[1, 2, eod, 4, 5, eod, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]]  # labels; the second has no EOD

    def sample(i):
        lab = torch.tensor(rows[i])
        return {"tokens": torch.cat([torch.tensor([0]), lab[:-1]]), "labels": lab, "loss_mask": torch.ones(s),
                "position_ids": torch.arange(s), "attention_mask": torch.ones(1, s, s, dtype=torch.bool)}
    ds = VariableLengthDataset([sample(0), sample(1)], up_to_eod(eod), s)
    first = ds[0]
    assert first["labels"].tolist() == [1, 2, eod] and first["tokens"].shape == (3,)
    assert first["attention_mask"].shape == (1, 3, 3)
    assert ds[1]["labels"].shape == (s,)  # no end of document: the whole sample
    drawn = VariableLengthDataset([sample(1)], lambda i, smp: 5, s)
    assert drawn[0]["tokens"].shape == (5,) and len(drawn) == 1


def test_causal_masks_travel_as_their_size():
    """Between the replicas a row's causal attention mask goes as its size (an n x n tensor per row
    would dwarf the tokens); any other mask as it is."""
    import pickle

    import torch

    from megatron_zb.megatron.features.balanced import CausalMask, pack_masks, unpack_masks
    n = 64
    causal = (torch.tril(torch.ones(n, n)).unsqueeze(0) < 0.5)
    other = causal.clone()
    other[0, 5, 2] = True  # e.g. a document boundary (--reset-attention-mask)
    row = {"tokens": torch.arange(n), "attention_mask": causal}
    packed = pack_masks(row)
    assert isinstance(packed["attention_mask"], CausalMask)
    assert len(pickle.dumps(packed)) < len(pickle.dumps(row)) / 4
    assert torch.equal(unpack_masks(packed)["attention_mask"], causal)
    assert unpack_masks(packed)["attention_mask"].dtype == torch.bool
    kept = pack_masks({"tokens": torch.arange(n), "attention_mask": other})
    assert kept["attention_mask"] is other
