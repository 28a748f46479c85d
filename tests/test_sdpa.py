"""A realistic layer without Transformer Engine (``megatron.features.sdpa_attention``): torch's
``scaled_dot_product_attention`` as megatron's core attention, selected by Megatron's
``--attention-backend flash|fused``. It equals megatron's own ``DotProductAttention`` (forward and
every input gradient: causal, grouped-query, a given scale, a padding mask, packed sequences, split
over tensor parallelism), and the tiny GPT built with it trains exactly as the non-pipelined
reference under zb-v and 1f1b (GQA, TP=2) and zb-h1 (packed sequences); both megatron-core versions.
The training entry point's run with the flag: tests/test_pretrain_entry.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_zb import verify as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOL = 1e-5  # float rounding: SDPA sums in another order than megatron's baddbmm / softmax / bmm

CASES = [  # world size 2: TP=1 (both ranks alike) and TP=2 (each rank half the heads and groups)
    dict(tp=1, heads=8, groups=2, head_dim=16, seq=24, batch=3),  # causal GQA, 1/sqrt(d)
    dict(tp=2, heads=8, groups=2, head_dim=16, seq=24, batch=2, scale=0.3, seed=1),  # causal GQA, a scale
    dict(tp=2, heads=4, groups=4, head_dim=8, seq=16, batch=2, padding_mask=True, mask_type="padding", seed=2),
    dict(tp=1, heads=4, groups=2, head_dim=8, seq=20, batch=1, packed=[0, 7, 12, 20], seed=3),  # THD
]


MODELS = [dict(kind="model", backend=b) for b in ("flash", "fused", "local", "auto")]


@pytest.mark.megatron
@pytest.mark.dist
def test_sdpa_equals_megatrons_dot_product_attention(rank_pool):
    from tests._sdpa_fns import run
    results = rank_pool(run, CASES + MODELS, 2, timeout=300)
    models, results = results[len(CASES):], results[:len(CASES)]
    # verify's tiny GPT: flash / fused build torch's SDPA core attention, the others megatron's
    assert [m[0] for m in models] == [["SDPAttention"], ["SDPAttention"], ["DotProductAttention"],
                                      ["DotProductAttention"]]
    for case, per_rank in zip(CASES, results):
        for r in per_rank:
            for backend in ("default", "math"):
                got = r[backend]
                assert got["shape"] == r["shape"], (case, got)
                assert max(got["rel"]) < TOL, (case, r["rank"], backend, got["rel"])
    # [s, b, heads per rank x d] (THD: [t, 1, heads x d])
    assert results[1][0]["shape"] == [24, 2, 4 * 16] and results[3][0]["shape"] == [20, 1, 4 * 8]


@pytest.mark.megatron
@pytest.mark.dist
def test_verify_with_sdpa_is_exact(mcore_path, mcore_version):
    """One launch of world size 4: zb-v with GQA at TP=2 x PP=2, 1f1b with GQA at PP=2 x DP=2, zb-h1 with
    packed sequences at PP=2 x DP=2."""
    gqa = {"num_query_groups": 2}
    cases = [V.make_case("zb-v", 2, tensor_parallel_size=2, num_microbatches=4, iterations=2, attention_backend="flash",
                         config_overrides=gqa, label="sdpa gqa tp2"),
             V.make_case("1f1b", 2, data_parallel_size=2, num_microbatches=4, iterations=2, attention_backend="flash",
                         config_overrides=gqa, label="sdpa gqa dp2"),
             # Megatron's packed sequences (THD), each sequence attending within itself
             V.make_case("zb-h1", 2, data_parallel_size=2, num_microbatches=4, iterations=2, attention_backend="fused",
                         variable_seq_lengths=True, balance_microbatches=True, pack_sequences=True, label="sdpa packed")]
    results = V.run_verify_many(cases, timeout=600, mcore_path=mcore_path)
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert r["max_rel_grad_diff"] <= V.DEFAULT_GRAD_RTOL and r["max_abs_loss_diff"] <= V.DEFAULT_LOSS_ATOL
        assert "sdpa" in r["case"] and "attention=f" in r["case"]
        assert not mcore_version or r["megatron_core"].startswith(mcore_version)


def test_the_flag_in_verify_and_the_gpu_check(tmp_path, capsys):
    """verify and the GPU check take Megatron's names; the GPU check's sections plan with the SDPA layer
    (a dry run of two of them); a name Megatron does not have is one line and exit code 2."""
    from megatron_zb.megatron.features.flags.attention import backend_name, uses_sdpa
    from megatron_zb.verify.command import _build_parser
    a = _build_parser().parse_args(["--schedule", "zb-v", "-p", "2", "--attention-backend", "fused",
                                    "--num-query-groups", "2"])
    assert (a.attention_backend, a.num_query_groups) == ("fused", 2)
    assert [uses_sdpa(n) for n in ("flash", "fused", "local", "unfused", "auto", None)] == [True] * 2 + [False] * 4
    assert backend_name(type("AttnBackend", (), {"name": "flash"})()) == "flash"
    import argparse
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError
    from megatron_zb.megatron.features.flags.attention import check_attention_args
    ok = dict(transformer_impl="local", attention_backend=type("AttnBackend", (), {"name": "flash"})(),
              context_parallel_size=1, window_size=None, softmax_type="vanilla", multi_latent_attention=False)
    check_attention_args(argparse.Namespace(**ok))
    for bad, flag in ((dict(context_parallel_size=2), "--context-parallel-size"), (dict(window_size=(8, 0)), "--window-size"),
                      (dict(softmax_type="learnable"), "--softmax-type learnable"),
                      (dict(multi_latent_attention=True), "--multi-latent-attention")):
        with pytest.raises(ZeroBubbleArgumentError, match=flag):
            check_attention_args(argparse.Namespace(**{**ok, **bad}))
        check_attention_args(argparse.Namespace(**{**ok, **bad, "transformer_impl": "transformer_engine"}))  # TE's own
    with pytest.raises(V.VerifyUsageError, match="--attention-backend must be one of"):
        V.make_case("zb-v", 2, attention_backend="sdpa")
    from megatron_zb.verify.command import main_verify
    for argv in (["--schedule", "zb-v", "-p", "2", "--attention-backend", "sdpa"],
                 ["--schedule", "zb-v", "-p", "2", "--num-query-groups", "3"]):
        assert main_verify(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "megatron-zb verify:" in err, err
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    out = tmp_path / "out"  # the parent hands the flag to each section's process
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run", str(out), "--sections",
                        "pipeline", "--attention-backend", "flash", "--stretch", "4"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["ok"] and rep["attention_backend"] == "flash"
    assert all("attention=flash" in c for cs in rep["sections"]["pipeline"]["plan"]["launches"].values() for c in cs)
    # the sections that run benchmark scripts pass it on (planned here, in this process)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check_sections as S
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    rec = {"status": "error", "figures": {}, "rows": [], "plan": {}}
    ctx = S.Context("fbw", dry=True, tiny=False, deadline=1e12, scratch=str(tmp_path), mcore_path=None,
                    wheels=str(tmp_path), gpu_python="3.12", record=rec)
    ctx.attention_backend = "flash"
    S.fbw(ctx)
    S.offload(ctx)
    assert all(c.endswith("--attention-backend flash") for c in rec["plan"]["commands"])
    assert "--attention-backend flash --ratio R" in rec["plan"]["command"]
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run", str(out),
                        "--attention-backend", "sdpa"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
