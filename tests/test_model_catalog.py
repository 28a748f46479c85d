"""The model behind `megatron-zb plan` per layer type (GQA, SwiGLU, MoE vs dense layers, shared
experts, MTP, multi-latent attention) and the named public models / HuggingFace configs. Pure Python."""
import itertools
import json

import pytest

from megatron_zb.core.costs import models as M
from megatron_zb.core.ir import ScheduleError
from megatron_zb.core.costs.model import ModelSpec, stage_activation_bytes

# a small model worked by hand: h 64, 8 heads of 8, 2 KV groups, SwiGLU ffn 96; layer 0 dense, 1-3 MoE
# (4 experts of 32, top-2, shared 16); one MTP layer; b 2, s 16, vocab 100
H, A, D, G, FFN, V, B, S = 64, 8, 8, 2, 96, 100, 2, 16
SMALL = dict(num_layers=4, hidden_size=H, num_attention_heads=A, seq_length=S, micro_batch_size=B, vocab_size=V,
             ffn_hidden_size=FFN, num_query_groups=G, swiglu=True, num_experts=4, moe_router_topk=2,
             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1, 1, 1],
             mtp_num_layers=1, untie_embeddings_and_output_weights=True)
ATT = H * (A * D + 2 * G * D) + A * D * H  # QKV 64 x 96, projection 64 x 64 multiply-adds per token
DENSE_MLP = 3 * H * FFN  # gate, up, down
MOE_MLP = 2 * 3 * H * 32 + 3 * H * 16 + H * 4  # two routed experts, the shared one, the router
CORE = 4 * B * S * S * H  # Q.K^T and scores.V, the whole s x s


def test_hand_counted_flops_per_layer_type():
    spec = ModelSpec(**SMALL)
    spec.validate()
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    for i, mlp in ((0, DENSE_MLP), (2, MOE_MLP)):
        gemm = 2 * B * S * (ATT + mlp)
        assert spec.layer_flops(i) == (gemm + CORE, gemm + 2 * CORE, gemm)
    assert spec.layer_flops(0)[0] == 2 * B * S * (6144 + 4096 + 18432) + 131072 == 1966080
    assert spec.layer_flops(1)[0] == 2 * B * S * (6144 + 4096 + 12288 + 3072 + 256) + 131072 == 1785856
    # the generic layer where MoE and dense mix: the mean, so num_layers x it is the decoder's total
    total = [sum(spec.layer_flops(i)[k] for i in range(4)) for k in range(3)]
    assert [4 * x for x in spec.layer_flops()] == pytest.approx(total)
    assert 4 * spec.params_per_layer() == pytest.approx(sum(spec.params_per_layer(i) for i in range(4)))
    out = 2 * B * S * H * V
    assert spec.output_flops() == (out, out, out)
    assert spec.embedding_flops() == (0.0, 0.0, B * S * H)
    proj = 2 * B * S * 2 * H * H  # the MTP's 2h -> h projection, then a layer like the last (MoE), then the output
    moe = spec.layer_flops(3)
    assert spec.mtp_layer_flops() == pytest.approx(tuple(proj + m + e + out for m, e in zip(moe, (0, 0, B * S * H))))
    assert spec.mtp_layer_flops(with_output=False) == pytest.approx(
        tuple(proj + m + e for m, e in zip(moe, (0, 0, B * S * H))))
    with pytest.raises(ScheduleError, match="outside the model's layers 0..3"):
        spec.layer_flops(4)


def test_hand_counted_bytes_and_parameters():
    spec = ModelSpec(**SMALL, expert_model_parallel_size=2)
    e, tok = 2, S * B
    # dense: norms and inputs 4h, dropout masks 2h bytes; Q, K, V (a d + 2 g d) and the core's output a d;
    # SwiGLU keeps fc1's 2 ffn and the activation's ffn. W: each linear's input and output gradient
    qkv = A * D + 2 * G * D
    assert spec.layer_activation_bytes(0) == (tok * (e * 4 * H + 2 * H + e * (qkv + A * D + 3 * FFN)),
                                              e * tok * ((H + qkv) + (A * D + H) + (H + 2 * FFN) + (FFN + H)))
    # MoE: + the k dispatched copies (h each), per copy 3 f, the shared expert's 3 fs; W per copy 2h + 3f
    m_b = tok * (e * (4 * H + 2 * H) + 2 * H + e * (qkv + A * D + 2 * 3 * 32 + 3 * 16))
    m_w = e * tok * ((H + qkv) + (A * D + H) + 2 * (2 * H + 3 * 32) + (2 * H + 3 * 16))
    assert spec.layer_activation_bytes(1) == (m_b, m_w) == (54272, 58368)
    small = 9 * H
    assert spec.params_per_layer(0) == ATT + DENSE_MLP + small
    assert spec.params_per_layer(1) == ATT + 2 * 3 * H * 32 + 3 * H * 16 + 4 * H + small  # 2 of 4 experts (EP 2)
    assert spec.layer_a2a_bytes(0) == 0 and spec.layer_a2a_bytes(1) == 2 * tok * 2 * H * e / 2
    assert spec.embedding_params() == spec.output_params() == V * H
    assert ModelSpec(**{**SMALL, "untie_embeddings_and_output_weights": False}).output_params() == 0
    assert spec.mtp_params() == 2 * H + 2 * H * H + spec.params_per_layer(3)
    lb, lw = spec.layer_activation_bytes(3)
    ob, ow = spec.loss_activation_bytes()
    assert spec.mtp_activation_bytes() == (4 * e * tok * H + lb + ob, 3 * e * tok * H + lw + ow)
    assert spec.mtp_activation_bytes(with_output=False) == (4 * e * tok * H + lb, 3 * e * tok * H + lw)
    # every k-th layer from layer 0 (Megatron's int --moe-layer-freq)
    two = ModelSpec(**{**SMALL, "moe_layer_freq": 2})
    assert [two.is_moe_layer(i) for i in range(4)] == [True, False, True, False]


def test_multi_latent_attention_shapes():
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8, multi_latent_attention=True,
              q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    spec = ModelSpec(**kw)
    spec.validate()
    att = 64 * 24 + 24 * 4 * 12 + 64 * (16 + 4) + 16 * 4 * 16 + 4 * 8 * 64  # q down/up, kv down/up, projection
    assert spec.params_per_layer(0) == att + 2 * 64 * 256 + 9 * 64 + 24 + 16
    core = 2 * 8 * 8 * (4 * 12 + 4 * 8)  # Q.K^T over qk + rope dims, scores.V over v dims
    assert spec.layer_flops(0)[0] == 2 * 8 * (att + 2 * 64 * 256) + core
    no_q = ModelSpec(**{**kw, "q_lora_rank": None})
    assert no_q.params_per_layer(0) == spec.params_per_layer(0) - att + (64 * 4 * 12 + 64 * 20 + 16 * 64 + 32 * 64) - 24


def _today(spec):
    """The formulas before per-layer types (dense, or MoE in every layer), written out again."""
    b, s, h, a, t, v = (spec.micro_batch_size, spec.seq_length, spec.hidden_size, spec.num_attention_heads,
                        spec.tensor_parallel_size, spec.vocab_size)
    ffn, e, drop = spec.ffn_hidden_size or 4 * h, spec.activation_bytes, spec.dropout
    if spec.num_experts:
        k, f = spec.moe_router_topk, spec.moe_ffn_hidden_size or ffn
        width, rep_mlp, split_mlp, w_mlp = k * 4 * f + 2 * spec.num_experts, h + k * h, 2 * k * f, k * (2 * h + 2 * f)
        params = (4 * h * h + spec.num_experts // spec.expert_model_parallel_size * 2 * h * f) / t \
            + spec.num_experts * h + 9 * h
    else:
        width, rep_mlp, split_mlp, w_mlp = 4 * ffn, h, 2 * ffn, 2 * h + 2 * ffn
        params = (4 * h * h + 2 * h * ffn) / t + 9 * h
    gemm, core = b * s * h * (8 * h + width), 4 * b * s * s * h
    f_, b_ = (gemm + core) / t, (gemm + 2 * core) / t
    b_ += f_ if spec.recompute == "full" else core / t if spec.recompute == "selective" else 0
    keep = not (spec.flash_attention or spec.recompute == "selective")
    scores = ((2 * e + 1) if drop else e) * a * s if keep else 0
    rep = e * (3 * h + rep_mlp) + (2 * h if drop else 0)
    split = e * (4 * h + split_mlp) + scores
    m_b = s * b * ((rep + split) / t if spec.sequence_parallel else rep + split / t)
    if spec.recompute == "full":
        m_b = e * s * b * h / (t if spec.sequence_parallel else 1) / spec.recompute_num_layers
    return (f_, b_, gemm / t), (m_b, e * s * b * (6 * h + w_mlp) / t), params, (2.0 * b * s * h * v / t,) * 3


@pytest.mark.parametrize("tp,sp,fa,drop,moe,rc", itertools.product(
    [1, 2], [False, True], [False, True], [False, True], [None, 8], [None, "full", "selective"]))
def test_default_methods_give_todays_numbers(tp, sp, fa, drop, moe, rc):
    for ffn in (None, 3072):
        spec = ModelSpec(num_layers=6, hidden_size=1024, num_attention_heads=16, seq_length=512, micro_batch_size=2,
                         vocab_size=50000, ffn_hidden_size=ffn, tensor_parallel_size=tp, sequence_parallel=sp,
                         flash_attention=fa, dropout=drop, num_experts=moe,
                         moe_ffn_hidden_size=None if ffn else 1536, expert_model_parallel_size=4 if moe else 1,
                         recompute=rc, recompute_num_layers=2)
        spec.validate()
        flops, act, params, out = _today(spec)
        assert spec.layer_flops() == flops and spec.layer_activation_bytes() == act
        assert spec.params_per_layer() == params and spec.output_flops() == out
        assert all(spec.layer_flops(i) == flops and spec.layer_activation_bytes(i) == act
                   and spec.params_per_layer(i) == params and spec.layer_a2a_bytes(i) == spec.layer_a2a_bytes()
                   for i in range(6))
        assert stage_activation_bytes(spec, 3)[0][0] == 2 * act[0] + spec.embedding_activation_bytes()


PUBLIC_BILLIONS = {"llama-3-8b": 8.03, "llama-3-70b": 70.6, "llama-3.1-8b": 8.03, "llama-3.1-405b": 405.9,
                   "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "qwen2.5-7b": 7.61, "qwen2.5-72b": 72.7,
                   "mixtral-8x7b": 46.7, "mixtral-8x22b": 141, "deepseek-v3": 671}


def _total(spec):
    return sum(spec.params_per_layer(i) for i in range(spec.num_layers)) + spec.embedding_params() \
        + spec.output_params()


@pytest.mark.parametrize("name", M.names())
def test_catalogue_parameter_counts(name):
    spec = ModelSpec(**M.spec_kwargs(name, seq_length=4096))
    spec.validate()
    assert spec.seq_length == 4096 and M.spec_kwargs(name)["seq_length"] >= 8192
    assert _total(spec) / 1e9 == pytest.approx(PUBLIC_BILLIONS[name], rel=0.01)
    if name == "deepseek-v3":  # DeepSeek's "14B MTP module" stores its own embedding and head copies (2 x 0.93B)
        assert (spec.mtp_params() + 2 * 129280 * 7168) / 1e9 == pytest.approx(14, abs=0.6)  # 11.61 + 1.85
        assert [spec.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def _out_per_layer(name, seq):
    spec = ModelSpec(**M.spec_kwargs(name, seq_length=seq))
    f = spec.layer_flops(0)[0]
    return spec.output_flops()[0] / f, spec.output_flops()[0] / (f - 2 * seq * seq * spec.hidden_size)


def test_output_layer_in_transformer_layers():
    """The facts file: Llama-3-8B's output layer is about 2.2 layers, Llama-3.2-1B's about 4.3,
    Qwen2.5-7B's about 2. Here, forward FLOPs at seq 4096 with the whole s x s attention core (no
    causal halving, as the model counts it): 2.09, 3.39 and 2.08. The facts' 2.2 (2.24) for
    Llama-3-8B is the ratio with the causal half of the core (second value); their 4.3 for
    Llama-3.2-1B is the GEMMs alone (short sequences: 4.32), 3.80 with the causal core at 4096."""
    full, causal = _out_per_layer("llama-3-8b", 4096)
    assert full == pytest.approx(2.09, abs=0.01) and causal == pytest.approx(2.24, abs=0.01)
    full, causal = _out_per_layer("llama-3.2-1b", 4096)
    assert full == pytest.approx(3.39, abs=0.01) and causal == pytest.approx(3.80, abs=0.01)
    assert _out_per_layer("llama-3.2-1b", 1)[0] == pytest.approx(4.3, abs=0.03)
    spec = ModelSpec(**M.spec_kwargs("llama-3.2-1b", seq_length=1))  # "a fifth of all FLOPs"
    assert spec.output_flops()[0] / (spec.output_flops()[0] + 16 * spec.layer_flops()[0]) == pytest.approx(0.21, abs=0.01)
    assert _out_per_layer("qwen2.5-7b", 4096)[0] == pytest.approx(2.08, abs=0.01)


LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True, "hidden_act": "silu",
              "max_position_embeddings": 128, "rope_theta": 500000.0, "model_type": "llama"}


def test_from_hf_config():
    kw = M.from_hf_config(LLAMA_LIKE)
    assert kw == dict(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=128, vocab_size=100,
                      ffn_hidden_size=96, swiglu=True, untie_embeddings_and_output_weights=False, num_query_groups=2)
    assert M.from_hf_config(LLAMA_LIKE, seq_length=16)["seq_length"] == 16
    assert M.from_hf_config({"text_config": LLAMA_LIKE, "model_type": "vlm"}) == kw
    gelu = M.from_hf_config({**LLAMA_LIKE, "hidden_act": "gelu", "num_key_value_heads": 8, "head_dim": 16})
    assert not gelu["swiglu"] and "num_query_groups" not in gelu and gelu["kv_channels"] == 16
    mixtral = M.from_hf_config({**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2,
                                "tie_word_embeddings": False})
    assert (mixtral["num_experts"], mixtral["moe_router_topk"], mixtral["untie_embeddings_and_output_weights"]) == \
        (4, 2, True) and "moe_ffn_hidden_size" not in mixtral and "moe_layer_freq" not in mixtral
    deepseek = M.from_hf_config({**LLAMA_LIKE, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                 "moe_layer_freq": 1, "num_nextn_predict_layers": 1, "q_lora_rank": 24,
                                 "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
                                 "num_key_value_heads": 8})
    assert {k: deepseek[k] for k in ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                                     "moe_layer_freq", "mtp_num_layers", "multi_latent_attention", "q_lora_rank",
                                     "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")} == \
        dict(num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
             moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=1, multi_latent_attention=True, q_lora_rank=24,
             kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    qwen_moe = M.from_hf_config({**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
                                 "mlp_only_layers": [3], "shared_expert_intermediate_size": 48})
    assert qwen_moe["moe_layer_freq"] == [0, 1, 0, 0] and qwen_moe["moe_shared_expert_intermediate_size"] == 48


def test_hf_config_of_a_catalogued_model_gives_its_entry():
    llama3_8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "hidden_act": "silu",
                 "max_position_embeddings": 8192}
    assert M.from_hf_config(llama3_8b) == M.spec_kwargs("llama-3-8b")
    deepseek_v3 = {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                   "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
                   "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 163840,
                   "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                   "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                   "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                   "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert M.from_hf_config(deepseek_v3) == M.spec_kwargs("deepseek-v3")


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_hf_config_errors(tmp_path):
    with pytest.raises(ScheduleError) as ei:
        M.from_hf_config({k: v for k, v in LLAMA_LIKE.items() if k not in ("vocab_size", "intermediate_size")})
    _one_line(ei, "lacks intermediate_size, vocab_size")
    with pytest.raises(ScheduleError) as ei:
        M.from_hf_config({**LLAMA_LIKE, "hidden_size": "64"})
    _one_line(ei, "hidden_size", "integer")
    with pytest.raises(ScheduleError) as ei:
        M.from_hf_config([LLAMA_LIKE])
    _one_line(ei, "JSON object")
    with pytest.raises(ScheduleError) as ei:
        M.from_hf_config({k: v for k, v in LLAMA_LIKE.items() if k != "max_position_embeddings"})
    _one_line(ei, "sequence length")
    with pytest.raises(ScheduleError) as ei:
        M.from_hf_config({**LLAMA_LIKE, "num_key_value_heads": 3})
    _one_line(ei, "--num-query-groups 3")
    good = tmp_path / "config.json"
    good.write_text(json.dumps(LLAMA_LIKE))
    assert M.load_hf_config(str(good)) == M.load_hf_config(str(tmp_path)) == M.from_hf_config(LLAMA_LIKE)
    assert M.load_hf_config(str(good), seq_length=32)["seq_length"] == 32
    for text, words in (("{not json", ("is not JSON", "line 1")), ("[1, 2]", ("JSON object",)),
                        (json.dumps({"hidden_size": 64}), ("lacks", "vocab_size"))):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ScheduleError) as ei:
            M.load_hf_config(str(bad))
        _one_line(ei, str(bad), *words)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00{")
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    for path, words in ((tmp_path / "missing.json", ("no HuggingFace config",)), (tmp_path / "binary.json",
                        ("cannot read",)), (tmp_path / "dir", ("cannot read",))):
        with pytest.raises(ScheduleError) as ei:
            M.load_hf_config(str(path))
        _one_line(ei, *words)


def test_catalogue_lookup_and_new_field_checks():
    with pytest.raises(ScheduleError) as ei:
        M.spec_kwargs("llama-4")
    _one_line(ei, "unknown model 'llama-4'", "llama-3-8b", "deepseek-v3")
    kw = M.spec_kwargs("DeepSeek-V3")
    kw["moe_layer_freq"].append(1)  # a copy: the catalogue stays as it was
    assert len(M.spec_kwargs("deepseek-v3")["moe_layer_freq"]) == 61
    assert ModelSpec(8, 4096, 32, 128, swiglu=True).layer_flops(0)[2] == 2 * 128 * (4 * 4096 ** 2 + 3 * 4096 * 10880)
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=16)
    for extra, words in ((dict(num_query_groups=3), "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
                         (dict(num_query_groups=2, tensor_parallel_size=4), "--num-query-groups 2 is not divisible"),
                         (dict(num_experts=4, moe_layer_freq=[1, 0]), "--moe-layer-freq lists 2 layers"),
                         (dict(num_experts=4, moe_layer_freq=0), "--moe-layer-freq must be"),
                         (dict(moe_layer_freq=2), "--num-experts is not set"),
                         (dict(moe_shared_expert_intermediate_size=16), "needs --num-experts"),
                         (dict(mtp_num_layers=-1), "--mtp-num-layers must be an integer >= 0"),
                         (dict(swiglu=1), "--swiglu is a switch"),
                         (dict(multi_latent_attention=True, kv_lora_rank=0), "--kv-lora-rank must be")):
        with pytest.raises(ScheduleError) as ei:
            ModelSpec(**base, **extra).validate()
        _one_line(ei, words)
