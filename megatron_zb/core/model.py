"""The GPT model behind `megatron-zb plan` and a byte memory limit: F/B/W FLOPs, activation bytes
(held from F to B, and from B to W) and parameters per layer, for dense and MoE layers, with or without
activation recompute, per pipeline stage. Pure Python; formulas in ``ModelSpec``'s methods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .ir import ScheduleError

__all__ = ["ModelSpec", "layer_split", "stage_activation_bytes"]


@dataclass
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int = 1
    vocab_size: int = 32000
    ffn_hidden_size: Optional[int] = None
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    data_parallel_size: int = 1
    distributed_optimizer: bool = False
    flash_attention: bool = True  # drops the 5 a s attention-score term
    activation_bytes: int = 2  # bytes per activation element: 2 (bf16/fp16), 4 (fp32)
    dropout: bool = True  # dropout keeps its masks (1 byte per element) and its outputs
    # MoE: experts per layer (None: dense MLP), experts per token, expert MLP size, experts' ranks
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    # activation recompute: 'full' (F keeps each block's input; B runs the forward again) or
    # 'selective' (the attention core is recomputed: no scores kept); blocks of recompute_num_layers
    recompute: Optional[str] = None
    recompute_num_layers: int = 1

    def validate(self):
        for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                  "vocab_size", "tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ScheduleError(f"--{k.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.num_experts is not None:
            for k in ("num_experts", "moe_router_topk", "expert_model_parallel_size"):
                v = getattr(self, k)
                if not isinstance(v, int) or v < 1:
                    raise ScheduleError(f"--{k.replace('_', '-')} must be an integer >= 1, got {v!r}")
            if self.moe_router_topk > self.num_experts:
                raise ScheduleError(f"--moe-router-topk {self.moe_router_topk} is more than --num-experts {self.num_experts}")
            if self.num_experts % self.expert_model_parallel_size:
                raise ScheduleError(f"--num-experts {self.num_experts} is not divisible by --expert-model-parallel-size "
                                    f"{self.expert_model_parallel_size}")
        if self.recompute not in (None, "full", "selective"):
            raise ScheduleError(f"--recompute-granularity must be full or selective, got {self.recompute!r}")
        if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
            raise ScheduleError(f"--recompute-num-layers must be an integer >= 1, got {self.recompute_num_layers!r}")
        if self.activation_bytes not in (1, 2, 4):
            raise ScheduleError(f"--activation-bytes must be 1, 2 or 4, got {self.activation_bytes!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ScheduleError(f"--hidden-size {self.hidden_size} is not divisible by "
                                f"--num-attention-heads {self.num_attention_heads}")
        t = self.tensor_parallel_size
        if self.num_attention_heads % t:
            raise ScheduleError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                                f"--tensor-parallel-size {t}: each tensor-parallel rank holds whole heads")
        if (self.ffn_hidden_size or 4 * self.hidden_size) % t:
            raise ScheduleError(f"the MLP hidden size {self.ffn_hidden_size or 4 * self.hidden_size} is not divisible "
                                f"by --tensor-parallel-size {t}")
        if self.sequence_parallel and self.seq_length % t:
            raise ScheduleError(f"--seq-length {self.seq_length} is not divisible by --tensor-parallel-size {t} "
                                "(sequence parallelism splits the sequence over the tensor-parallel ranks)")

    # -- per layer, per microbatch ------------------------------------------------------------
    def _mlp_width(self):
        """(MLP GEMM width per token: 4 x the FFN size, k x 4 x the expert FFN size for MoE, the router)"""
        h = self.hidden_size
        if self.num_experts:
            f = self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * h
            return self.moe_router_topk * 4 * f + 2 * self.num_experts
        return 4 * (self.ffn_hidden_size or 4 * h)

    def layer_flops(self):
        """(F, B, W) FLOPs of one layer per microbatch; MoE: each token through k experts (the
        experts' ranks share the tokens, on average k per token per rank); full recompute runs the
        forward again in B, selective recompute the attention core."""
        b, s, h, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.tensor_parallel_size
        gemm = b * s * h * (8 * h + self._mlp_width())  # 2 x (4 h^2 attention + MLP) per token
        core = 4 * b * s * s * h
        f = (gemm + core) / t
        bb = (gemm + 2 * core) / t
        if self.recompute == "full":
            bb += f
        elif self.recompute == "selective":
            bb += core / t
        w = gemm / t
        return f, bb, w

    def output_flops(self):
        b, s, h, v, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.vocab_size, self.tensor_parallel_size
        x = 2.0 * b * s * h * v / t
        return x, x, x

    def layer_activation_bytes(self):
        """(M_B, M_W) of one layer per microbatch. Per token, in activation elements of ``e`` bytes:
        the layer norms and the QKV and MLP inputs 4 h (replicated over TP unless sequence parallel),
        attention 4 h, the MLP's activation input and fc2 input 2 ffn (split over TP), the softmax
        output a s (twice with dropout: its output too; not with flash attention or selective
        recompute); dropout's masks add 2 h + a s bytes. With e = 2, ffn = 4 h and dropout this is
        Megatron's s b (34 h + 5 a s) / t. MoE: per routed copy (k per token) the dispatched token h
        and the expert's 2 f. M_W (the linears' inputs and output gradients, held from B until W):
        (6 h + 2 h + 2 ffn) e s b / t, per routed copy 2 h + 2 f for MoE (the router's weight
        gradient stays in B). Full recompute: F keeps each block's input (e h per token per
        recompute_num_layers layers); B recreates the rest, and what W needs outlives it, so M_W is
        then larger than M_B."""
        b, s, h, a, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.num_attention_heads, self.tensor_parallel_size
        e = self.activation_bytes
        drop = self.dropout
        keep_scores = not (self.flash_attention or self.recompute == "selective")
        scores = ((2 * e + 1) if drop else e) * a * s if keep_scores else 0
        if self.num_experts:
            k, f = self.moe_router_topk, self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * h
            mlp_rep, mlp_split, mlp_w = h + k * h, 2 * k * f, k * (2 * h + 2 * f)
        else:
            f = self.ffn_hidden_size or 4 * h
            mlp_rep, mlp_split, mlp_w = h, 2 * f, 2 * h + 2 * f
        rep = e * (3 * h + mlp_rep) + (2 * h if drop else 0)
        split = e * (4 * h + mlp_split) + scores
        m_b = s * b * ((rep + split) / t if self.sequence_parallel else rep + split / t)
        m_w = e * s * b * (6 * h + mlp_w) / t
        if self.recompute == "full":
            m_b = e * s * b * h / (t if self.sequence_parallel else 1) / self.recompute_num_layers
        return m_b, m_w

    def loss_activation_bytes(self):
        """(M_B, M_W) the loss stage adds per microbatch: the fp32 softmax of the cross entropy
        (4 s b V / t), the final norm's input and the output layer's input (2 e s b h; / t with
        sequence parallelism); W keeps the output layer's input and output gradient (the logits'
        gradient, e s b V / t: its weight gradient is deferred like any linear's)."""
        b, s, h, v, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.vocab_size, self.tensor_parallel_size
        e = self.activation_bytes
        norm = 2 * e * s * b * h / (t if self.sequence_parallel else 1)
        m_b = 4.0 * s * b * v / t + norm
        return m_b, e * s * b * (h + v) / t

    def embedding_activation_bytes(self):
        """M_B the embedding stage adds per microbatch: its output (e s b h)."""
        return float(self.activation_bytes * self.seq_length * self.micro_batch_size * self.hidden_size)

    def layer_a2a_bytes(self):
        """Bytes one layer's expert-parallel all-to-all sends per microbatch from one rank in a
        forward (dispatch + combine: 2 x tokens x k x h x e), counting only the routed copies that
        leave the rank ((EP-1)/EP of them, uniform routing); the backward sends as much again. The
        tokens are the rank's s b (s b / t with sequence parallelism). 0 for a dense model or EP 1."""
        ep = self.expert_model_parallel_size
        if not self.num_experts or ep < 2:
            return 0.0
        tokens = self.seq_length * self.micro_batch_size / (self.tensor_parallel_size if self.sequence_parallel else 1)
        return 2.0 * tokens * self.moe_router_topk * self.hidden_size * self.activation_bytes * (ep - 1) / ep

    def params_per_layer(self):
        h, t = self.hidden_size, self.tensor_parallel_size
        if self.num_experts:  # this rank's experts (EP), split over TP, and the router
            f = self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * h
            experts = self.num_experts // self.expert_model_parallel_size
            return (4 * h * h + experts * 2 * h * f) / t + self.num_experts * h + 9 * h
        ffn = self.ffn_hidden_size or 4 * h
        return (4 * h * h + 2 * h * ffn) / t + 9 * h

    def state_bytes(self, n_params):
        opt = 12.0 / (self.data_parallel_size if self.distributed_optimizer else 1)
        return n_params * (2 + 4 + opt)


def layer_split(num_layers: int, num_stages: int, pad_ends: bool = False) -> List[int]:
    """Layers per stage; with pad_ends the first and last stage take one layer less."""
    total = num_layers + (2 if pad_ends else 0)
    base, extra = divmod(total, num_stages)
    counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    if pad_ends:
        counts[0] -= 1
        counts[-1] -= 1
    if min(counts) < 0:
        raise ScheduleError(f"{num_layers} layers cannot fill {num_stages} stages")
    return counts


def stage_activation_bytes(spec: ModelSpec, num_stages: int, pad_ends: bool = False) -> dict:
    """{stage: (mem_f, mem_w)} in bytes per microbatch of every pipeline stage (chunk): its layers,
    the embedding on stage 0, the loss on the last (what ``core.simulate.stage_memory_trace`` takes)."""
    m_b, m_w = spec.layer_activation_bytes()
    loss_f, loss_w = spec.loss_activation_bytes()
    out = {}
    for s, n in enumerate(layer_split(spec.num_layers, num_stages, pad_ends)):
        f, w = n * m_b, n * m_w
        if s == 0:
            f += spec.embedding_activation_bytes()
        if s == num_stages - 1:
            f, w = f + loss_f, w + loss_w
        out[s] = (f, w)
    return out
