"""The models people train, exact under every schedule family: MoE with expert parallelism (megatron's
all-to-all and all-gather token dispatchers over gloo, the router's auxiliary loss), activation
recompute (full and selective, with TP + sequence parallelism), and both at once. Each case trains a
tiny megatron-core GPT through ``install()`` and compares losses, every gradient and the per-layer
auxiliary losses with the non-pipelined single-process reference (same model, no expert parallelism,
no recompute). Cases of one world size share one launch; both megatron-core versions."""
from __future__ import annotations

import pytest

from megatron_zb import verify as V

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

MOE = dict(num_experts=4, expert_model_parallel_size=2, data_parallel_size=2, moe_router_topk=2,
           moe_aux_loss_coeff=0.01)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FAMILIES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "bitpipe")  # 1F1B-like, ZB, V, looped, bitpipe


def _check(results, mcore_version=None):
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')} "
           f"loss={r.get('max_abs_loss_diff')} aux={r.get('max_abs_aux_loss_diff')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert not mcore_version or r["megatron_core"].startswith(mcore_version), (r["case"], r["megatron_core"])


def test_moe_expert_parallel_every_family_and_recompute(mcore_path, mcore_version):
    """World size 4 (PP=2 x DP=2, experts over EP=2): every family with MoE + EP, the all-gather
    dispatcher, MoE + full recompute, and the aux loss tracked per layer."""
    cases = [V.make_case(n, 2, num_microbatches=4, iterations=2, **MOE) for n in FAMILIES]
    cases += [
        V.make_case("megatron-1f1b", 2, num_microbatches=4, iterations=2, label="megatron's own", **MOE),
        V.make_case("zb-h2", 2, num_microbatches=4, iterations=2, label="allgather",
                    **{**MOE, "moe_token_dispatcher_type": "allgather"}),
        V.make_case("zb-v", 2, num_microbatches=4, iterations=2, label="moe + full recompute", **MOE, **FULL),
        V.make_case("v-half", 2, num_microbatches=6, iterations=2, label="moe + block recompute",
                    **{**MOE, **FULL, "recompute_method": "block"}),
        V.make_case("zb-v", 2, num_microbatches=4, iterations=2, label="shared experts",
                    moe_shared_expert_intermediate_size=128, **MOE),
    ]
    results = V.run_verify_many(cases, timeout=900, mcore_path=mcore_path)
    _check(results, mcore_version)
    for r in results:  # the aux loss was compared (a non-zero coefficient)
        assert r.get("max_abs_aux_loss_diff") is not None, r["case"]
        assert all(row.get("aux_losses") for row in r["per_iteration"]), r["case"]


def test_recompute_tp_sequence_parallel(mcore_path, mcore_version):
    """World size 4 (TP=2 x PP=2, sequence parallel): full and selective recompute, and MoE under TP."""
    sp = dict(tensor_parallel_size=2, sequence_parallel=True, num_microbatches=4, iterations=2)
    cases = [V.make_case("zb-v", 2, label="selective", recompute_granularity="selective", **sp),
             V.make_case("zb-h1", 2, label="full", **FULL, **sp),
             V.make_case("interleaved-1f1b", 2, label="selective", recompute_granularity="selective", **sp),
             V.make_case("bitpipe", 2, label="full", **FULL, **sp),
             V.make_case("zb-v", 2, label="moe tp+sp + selective", num_experts=4, moe_aux_loss_coeff=0.01,
                         recompute_granularity="selective", **sp)]
    _check(V.run_verify_many(cases, timeout=900, mcore_path=mcore_path), mcore_version)


def test_verify_flags_for_model_features():
    """Megatron's flag names reach the case; impossible combinations are refused with one line."""
    from megatron_zb.verify.command import _build_parser
    a = _build_parser().parse_args(
        ["--schedule", "zb-v", "-p", "2", "-d", "2", "--num-experts", "4", "--expert-model-parallel-size", "2",
         "--moe-router-topk", "1", "--moe-token-dispatcher-type", "allgather", "--moe-aux-loss-coeff", "0.01",
         "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"])
    assert (a.num_experts, a.expert_model_parallel_size, a.moe_router_topk) == (4, 2, 1)
    c = V.make_case("zb-v", 2, data_parallel_size=2, num_experts=4, expert_model_parallel_size=2,
                    recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert c.model_overrides()["num_moe_experts"] == 4
    assert "expert_model_parallel_size" not in c.model_overrides()  # the reference has no EP
    assert c.run_overrides()["recompute_method"] == "block"
    assert "moe=4x" in c.describe() and "recompute=full/block/2" in c.describe()
    for kw, msg in [(dict(expert_model_parallel_size=2), "needs --num-experts"),
                    (dict(num_experts=4, expert_model_parallel_size=2), "must divide --data-parallel-size"),
                    (dict(num_experts=3, expert_model_parallel_size=2, data_parallel_size=2), "divisible"),
                    (dict(num_experts=2, moe_router_topk=3), "more than --num-experts"),
                    (dict(recompute_method="uniform"), "need --recompute-granularity full"),
                    (dict(num_experts=4, tensor_parallel_size=2), "needs --sequence-parallel")]:
        tp = kw.pop("tensor_parallel_size", 1)
        with pytest.raises(V.VerifyUsageError, match=msg):
            V.make_case("zb-h1", 2, tp, **kw)


def test_multi_token_prediction(mcore_path, mcore_version):
    """MTP (one block on the loss stage, rotary positions, untied embeddings) under one-chunk
    schedules, Megatron's own 1F1B included; with MoE too."""
    mtp = dict(mtp_num_layers=1, tie_embeddings=False, num_microbatches=4, iterations=2)
    cases = [V.make_case(n, 2, **mtp) for n in ("1f1b", "zb-h1", "zb-h2", "megatron-1f1b")]
    cases.append(V.make_case("zb-h1", 2, label="mtp + moe", num_experts=4, moe_aux_loss_coeff=0.01, **mtp))
    _check(V.run_verify_many(cases, timeout=900, mcore_path=mcore_path), mcore_version)
    with pytest.raises(V.VerifyUsageError, match="needs --untied"):
        V.make_case("zb-h1", 2, mtp_num_layers=1)
    with pytest.raises(V.VerifyUsageError, match="one-chunk"):
        V.make_case("zb-v", 2, mtp_num_layers=1, tie_embeddings=False)
