"""The shapes inside one transformer layer that ``core.costs.model.ModelSpec`` counts FLOPs, bytes and
parameters from: the linears per token (input width, output width), the attention core's width, the
elements kept for the backward, and the checks of the fields that set them (GQA, SwiGLU, MoE layer
pattern, shared experts, multi-latent attention, MTP). Pure Python; takes any object with
ModelSpec's fields."""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

from ..ir import ScheduleError

__all__ = ["Part", "ffn_size", "moe_ffn_size", "moe_pattern", "attention", "mlp", "validate_shapes"]


class Part(NamedTuple):
    """One half of a layer (attention or MLP), per token. ``linears``: (input, output) widths of each
    linear whose weight gradient W computes, each once per token (an MoE expert's once per routed
    copy, so they repeat); ``extra_macs``: multiply-adds with no deferred weight gradient of its own
    counted in F/B/W all the same (the router); ``core``: the attention core's FLOPs per token per
    key position / 2 (Q.K^T and scores.V: 2 x sum of the heads' q/k and v widths); ``kept``: elements
    it keeps for B that TP splits (besides its input, the layer norm's output); ``kept_rep``: kept
    elements TP replicates unless sequence parallel (MoE's dispatched copies)."""
    linears: Tuple[Tuple[int, int], ...]
    extra_macs: int = 0
    core: int = 0
    kept: int = 0
    kept_rep: int = 0

    @property
    def macs(self) -> int:
        return sum(i * o for i, o in self.linears) + self.extra_macs

    @property
    def w_elems(self) -> int:
        """What W needs per token: each linear's input and its output's gradient."""
        return sum(i + o for i, o in self.linears)


def ffn_size(spec) -> int:
    """The MLP width as Megatron takes it: --ffn-hidden-size, else 4 h, or with --swiglu the 8 h / 3
    rounded down to a multiple of 64 that Megatron's argument parsing picks."""
    if spec.ffn_hidden_size:
        return spec.ffn_hidden_size
    h = spec.hidden_size
    return 8 * h // 192 * 64 if spec.swiglu else 4 * h


def moe_ffn_size(spec) -> int:
    return spec.moe_ffn_hidden_size or ffn_size(spec)


def moe_pattern(spec) -> List[bool]:
    """Which layers are MoE: --moe-layer-freq k (layer i when i % k == 0) or its 0/1 list; none
    without --num-experts."""
    n, f = spec.num_layers, spec.moe_layer_freq
    if not spec.num_experts:
        return [False] * n
    if isinstance(f, int):
        return [i % f == 0 for i in range(n)]
    return [bool(x) for x in f]


def attention(spec) -> Part:
    """GQA: QKV is h x (a d + 2 g d) for a heads of d = --kv-channels (h / a) and g query groups;
    the core keeps Q, K, V and its output (a d, the projection's input). Multi-latent attention
    (DeepSeek-V2/V3, Megatron's linear_q_down/up_proj, linear_kv_down/up_proj): the down projections'
    outputs, their norms' outputs, Q, K (qk + rope dims per head), V and the core's output; the
    rope part of K shared by the heads is not counted apart, and the down projections, which TP
    duplicates in Megatron, are counted as split like the rest."""
    h, a = spec.hidden_size, spec.num_attention_heads
    if spec.multi_latent_attention:
        ql, kl = spec.q_lora_rank, spec.kv_lora_rank
        dq, dr, dv = spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
        q = ((h, ql), (ql, a * (dq + dr))) if ql else ((h, a * (dq + dr)),)
        lin = q + ((h, kl + dr), (kl, a * (dq + dv)), (a * dv, h))
        down = (2 * ql if ql else 0) + 2 * kl
        return Part(lin, core=a * (dq + dr) + a * dv, kept=down + 2 * a * (dq + dr) + 2 * a * dv)
    d = spec.kv_channels or h // a
    g = spec.num_query_groups or a
    qkv = a * d + 2 * g * d
    return Part(((h, qkv), (a * d, h)), core=2 * a * d, kept=qkv + a * d)


def mlp(spec, moe: bool) -> Part:
    """Dense: fc1 h x ffn (h x 2 ffn with SwiGLU: gate and up) and fc2 ffn x h; keeps fc1's output
    and the activation's output. MoE: per routed copy (top-k per token) the same with the expert
    width, the shared experts once per token, the router (h x experts, its weight gradient stays in
    B, not deferred), and the k dispatched copies of each token."""
    h, n = spec.hidden_size, 3 if spec.swiglu else 2
    if not moe:
        f = ffn_size(spec)
        return Part(((h, (n - 1) * f), (f, h)), kept=n * f)
    f, k, fs = moe_ffn_size(spec), spec.moe_router_topk, spec.moe_shared_expert_intermediate_size or 0
    lin = ((h, (n - 1) * f), (f, h)) * k + (((h, (n - 1) * fs), (fs, h)) if fs else ())
    return Part(lin, extra_macs=h * spec.num_experts, kept=k * n * f + n * fs, kept_rep=k * h)


def _positive(spec, names, optional=False):
    for k in names:
        v = getattr(spec, k)
        if optional and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ScheduleError(f"--{k.replace('_', '-')} must be an integer >= 1, got {v!r}")


def validate_shapes(spec):
    """The checks of the fields beyond a plain GPT (called by ``ModelSpec.validate``)."""
    for k in ("swiglu", "untie_embeddings_and_output_weights", "multi_latent_attention"):
        if not isinstance(getattr(spec, k), bool):
            raise ScheduleError(f"--{k.replace('_', '-')} is a switch: True or False, got {getattr(spec, k)!r}")
    _positive(spec, ("num_query_groups", "kv_channels", "moe_shared_expert_intermediate_size"), optional=True)
    a, t, n = spec.num_attention_heads, spec.tensor_parallel_size, spec.num_layers
    g = spec.num_query_groups
    if g is not None and not spec.multi_latent_attention:
        if a % g:
            raise ScheduleError(f"--num-attention-heads {a} is not divisible by --num-query-groups {g}")
        if g % t:
            raise ScheduleError(f"--num-query-groups {g} is not divisible by --tensor-parallel-size {t}: each "
                                "tensor-parallel rank holds whole key/value groups")
    f = spec.moe_layer_freq
    if isinstance(f, bool) or not (isinstance(f, int) and f >= 1 or isinstance(f, (list, tuple))
                                   and all(x in (0, 1) and not isinstance(x, float) for x in f)):
        raise ScheduleError(f"--moe-layer-freq must be an integer >= 1 or a list of one 0/1 per layer, got {f!r}")
    if isinstance(f, (list, tuple)) and len(f) != n:
        raise ScheduleError(f"--moe-layer-freq lists {len(f)} layers, but --num-layers is {n}: give one 0/1 per layer")
    if not spec.num_experts and (f != 1 and (isinstance(f, int) or any(f))):
        raise ScheduleError(f"--moe-layer-freq {f!r} marks MoE layers, but --num-experts is not set")
    fs = spec.moe_shared_expert_intermediate_size
    if fs is not None:
        if not spec.num_experts:
            raise ScheduleError("--moe-shared-expert-intermediate-size needs --num-experts (shared experts sit "
                                "beside routed ones)")
        if fs % t:
            raise ScheduleError(f"--moe-shared-expert-intermediate-size {fs} is not divisible by "
                                f"--tensor-parallel-size {t}")
    m = spec.mtp_num_layers
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ScheduleError(f"--mtp-num-layers must be an integer >= 0, got {m!r}")
    if spec.multi_latent_attention:
        _positive(spec, ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"))
        _positive(spec, ("q_lora_rank",), optional=True)
