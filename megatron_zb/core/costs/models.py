"""Named public models for `megatron-zb plan`, and ModelSpec keyword arguments from a HuggingFace
``config.json``. Numbers only, from the models' published configs; nothing is downloaded. Pure Python.

``seq_length`` in an entry is the published context (``max_position_embeddings``), a default only:
the caller's sequence length wins (``spec_kwargs(name, seq_length=4096)``)."""
from __future__ import annotations

import copy
import json
import os
from typing import List, Optional

from ..ir import ScheduleError
from .model import ModelSpec

__all__ = ["MODELS", "names", "spec_kwargs", "from_hf_config", "load_hf_config"]

_LLAMA3 = dict(vocab_size=128256, swiglu=True, untie_embeddings_and_output_weights=True, num_query_groups=8)
_QWEN25 = dict(vocab_size=152064, swiglu=True, untie_embeddings_and_output_weights=True, seq_length=131072)

MODELS = {
    # Meta Llama 3 / 3.1 / 3.2 (8 KV heads, SwiGLU, RoPE, no biases)
    "llama-3-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
                       seq_length=8192),
    "llama-3-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672,
                        seq_length=8192),
    "llama-3.1-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
                         seq_length=131072),
    "llama-3.1-405b": dict(_LLAMA3, num_layers=126, hidden_size=16384, num_attention_heads=128,
                           ffn_hidden_size=53248, seq_length=131072),
    "llama-3.2-1b": dict(_LLAMA3, num_layers=16, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192,
                         seq_length=131072, untie_embeddings_and_output_weights=False),
    "llama-3.2-3b": dict(_LLAMA3, num_layers=28, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192,
                         seq_length=131072, untie_embeddings_and_output_weights=False),
    # Qwen2.5 (its QKV biases, a + 2 g head widths per layer, are left out: under 0.01% of the parameters)
    "qwen2.5-7b": dict(_QWEN25, num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                       ffn_hidden_size=18944),
    "qwen2.5-72b": dict(_QWEN25, num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                        ffn_hidden_size=29568),
    # Mistral's Mixtral: every layer MoE, 8 experts of the full FFN width, top-2
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                         ffn_hidden_size=14336, vocab_size=32000, swiglu=True, untie_embeddings_and_output_weights=True,
                         num_experts=8, moe_router_topk=2, seq_length=32768),
    "mixtral-8x22b": dict(num_layers=56, hidden_size=6144, num_attention_heads=48, num_query_groups=8,
                          ffn_hidden_size=16384, vocab_size=32768, swiglu=True,
                          untie_embeddings_and_output_weights=True, num_experts=8, moe_router_topk=2,
                          seq_length=65536),
    # DeepSeek-V3-like: MLA, 3 dense layers then 58 MoE layers of 256 routed experts (top-8) + 1 shared,
    # one MTP layer. Approximated: the router's sigmoid scores, its per-expert bias (256) and node-limited
    # routing (FLOPs as for plain top-8, uniform over the experts); MLA's K rope part is not kept apart;
    # the MTP layer shares the model's embedding and output layer (as Megatron does; the released
    # checkpoint stores copies: its "14B MTP module" is this model's 11.6B plus 2 x 0.93B).
    "deepseek-v3": dict(num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
                        vocab_size=129280, swiglu=True, untie_embeddings_and_output_weights=True,
                        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                        qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256, moe_router_topk=8,
                        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                        moe_layer_freq=[0] * 3 + [1] * 58, mtp_num_layers=1, seq_length=163840),
}


def names() -> List[str]:
    return sorted(MODELS)


def spec_kwargs(name: str, seq_length: Optional[int] = None) -> dict:
    """ModelSpec keyword arguments of a catalogued model (a copy); ``seq_length`` replaces its default."""
    key = str(name).lower()
    if key not in MODELS:
        raise ScheduleError(f"unknown model {name!r}; known models: {', '.join(names())}")
    kw = copy.deepcopy(MODELS[key])
    if seq_length is not None:
        kw["seq_length"] = seq_length
    return kw


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _int(cfg, key, default=None, low=1):
    v = cfg.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ScheduleError(f"the HuggingFace config's {key} must be an integer >= {low}, got {v!r}")
    return v


def _moe_kwargs(cfg, n_layers) -> dict:
    """MoE keys: num_local_experts (Mixtral) / n_routed_experts (DeepSeek) / num_experts (Qwen-MoE),
    num_experts_per_tok, moe_intermediate_size, n_shared_experts (DeepSeek: each of the expert width)
    or shared_expert_intermediate_size (Qwen-MoE); which layers: DeepSeek's first_k_dense_replace and
    moe_layer_freq (i >= k and i % freq == 0), Qwen-MoE's decoder_sparse_step ((i + 1) % step == 0)
    and mlp_only_layers."""
    key = next((k for k in ("num_local_experts", "n_routed_experts", "num_experts") if cfg.get(k)), None)
    if key is None:
        return {}
    kw = dict(num_experts=_int(cfg, key))
    if cfg.get("num_experts_per_tok") is not None:
        kw["moe_router_topk"] = _int(cfg, "num_experts_per_tok")
    f = _int(cfg, "moe_intermediate_size")
    if f is not None:
        kw["moe_ffn_hidden_size"] = f
    shared = _int(cfg, "shared_expert_intermediate_size")
    n_shared = _int(cfg, "n_shared_experts", low=0)
    if shared is None and n_shared:
        shared = n_shared * (f or cfg["intermediate_size"])
    if shared:
        kw["moe_shared_expert_intermediate_size"] = shared
    first = _int(cfg, "first_k_dense_replace", 0, low=0)
    freq = _int(cfg, "moe_layer_freq", 1)
    step = _int(cfg, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ScheduleError(f"the HuggingFace config's mlp_only_layers must be a list of layer indices, got {only!r}")
    pattern = [int(i >= first and i % freq == 0 and (i + 1) % step == 0 and i not in only) for i in range(n_layers)]
    if not all(pattern):
        kw["moe_layer_freq"] = pattern
    return kw


def from_hf_config(cfg: dict, seq_length: Optional[int] = None) -> dict:
    """ModelSpec keyword arguments from a HuggingFace ``config.json`` (as a dict; a multimodal one's
    ``text_config`` is read where the top level has no hidden_size). The sequence length is
    ``seq_length``, else the config's max_position_embeddings. hidden_act silu (swish) means a
    gated MLP (--swiglu); other activations a plain one. tie_word_embeddings absent means untied
    (the default of the Llama, Qwen2, Mixtral and DeepSeek configs)."""
    if not isinstance(cfg, dict):
        raise ScheduleError(f"a HuggingFace config is a JSON object, got {type(cfg).__name__}")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ScheduleError(f"the HuggingFace config lacks {', '.join(missing)} (a decoder model's config.json "
                            f"has {', '.join(_REQUIRED)})")
    h, a, n = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads"), _int(cfg, "num_hidden_layers")
    seq = seq_length if seq_length is not None else _int(cfg, "max_position_embeddings")
    if seq is None:
        raise ScheduleError("the HuggingFace config has no max_position_embeddings: give the sequence length")
    kw = dict(num_layers=n, hidden_size=h, num_attention_heads=a, seq_length=seq,
              vocab_size=_int(cfg, "vocab_size"), ffn_hidden_size=_int(cfg, "intermediate_size"),
              swiglu=cfg.get("hidden_act", cfg.get("hidden_activation")) in ("silu", "swish"),
              untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False))
    kv = _int(cfg, "num_key_value_heads")
    if kv is not None and kv != a:
        kw["num_query_groups"] = kv
    d = _int(cfg, "head_dim")
    if d is not None and d * a != h:
        kw["kv_channels"] = d
    if cfg.get("kv_lora_rank"):
        kw.update(multi_latent_attention=True, q_lora_rank=_int(cfg, "q_lora_rank"),
                  kv_lora_rank=_int(cfg, "kv_lora_rank"), qk_head_dim=_int(cfg, "qk_nope_head_dim", 128),
                  qk_pos_emb_head_dim=_int(cfg, "qk_rope_head_dim", 64), v_head_dim=_int(cfg, "v_head_dim", 128))
        kw.pop("num_query_groups", None)
    kw.update(_moe_kwargs(cfg, n))
    mtp = _int(cfg, "num_nextn_predict_layers", 0, low=0)
    if mtp:
        kw["mtp_num_layers"] = mtp
    ModelSpec(**kw).validate()  # a config no Megatron model could take fails here, in one line
    return kw


def load_hf_config(path: str, seq_length: Optional[int] = None) -> dict:
    """``from_hf_config`` of a ``config.json`` file (or a directory holding one)."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(p, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise ScheduleError(f"no HuggingFace config at {p}") from None
    except json.JSONDecodeError as e:
        raise ScheduleError(f"{p} is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ScheduleError(f"cannot read {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return from_hf_config(cfg, seq_length)
    except ScheduleError as e:
        raise ScheduleError(f"{p}: {e}") from None
