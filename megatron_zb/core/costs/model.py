"""The GPT model behind `megatron-zb plan` and a byte memory limit: F/B/W FLOPs, activation bytes
(held from F to B, and from B to W) and parameters per layer (each layer by its index: dense or MoE),
for the embedding, the output layer and loss, and multi-token prediction layers; GQA, SwiGLU, shared
experts, multi-latent attention; with or without activation recompute, per pipeline stage. Pure
Python; formulas in ``ModelSpec``'s methods, the layer's shapes in ``core.costs.model_shapes``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from ..ir import ScheduleError
from .model_shapes import attention, ffn_size, mlp, moe_ffn_size, moe_pattern, validate_shapes

__all__ = ["ModelSpec", "SPLIT_OVERHEAD_S", "layer_split", "stage_activation_bytes"]


#: seconds a split backward adds per transformer layer on a GPU: the median of B + W against the fused
#: backward in ``benchmarks/results/`` (H100 fp32 h1024-h4096, H200 bf16 h2048/h4096: 0.21-0.52 ms, a
#: fixed cost whatever the layer's size: 0.4% of the backward at h4096 s4096, 15-20% at h2048 s2048)
SPLIT_OVERHEAD_S = 0.4e-3


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
    # full recompute's method (Megatron's --recompute-method): 'uniform' (every layer, in blocks of
    # recompute_num_layers; None means it) or 'block' (the first recompute_num_layers layers of each
    # model chunk, each on its own; the rest keep their activations); with 'block', counts of its own
    # per pipeline rank (each of its chunks) or per model chunk in pipeline order (megatron-zb's
    # --zero-bubble-recompute-num-layers: the ranks that hold more microbatches recompute more), else
    # recompute_num_layers in every chunk
    recompute_method: Optional[str] = None
    recompute_counts: Optional[Tuple[int, ...]] = None
    # shapes beyond a plain GPT (Megatron's flags)
    num_query_groups: Optional[int] = None  # --num-query-groups (GQA); None: one per head
    kv_channels: Optional[int] = None  # --kv-channels: each head's width; None: hidden / heads
    swiglu: bool = False  # --swiglu: gated MLP, three h x ffn matrices (ffn: --ffn-hidden-size)
    moe_layer_freq: Union[int, List[int]] = 1  # --moe-layer-freq: layer i MoE iff i % k == 0, or one 0/1 per layer
    moe_shared_expert_intermediate_size: Optional[int] = None  # --moe-shared-expert-intermediate-size (all of them)
    untie_embeddings_and_output_weights: bool = False  # --untie-embeddings-and-output-weights (default: tied)
    mtp_num_layers: int = 0  # --mtp-num-layers: multi-token prediction layers after the decoder's --num-layers
    # --multi-latent-attention (DeepSeek-V2/V3) and its widths (megatron-core's MLATransformerConfig defaults):
    # --q-lora-rank (None: no query down projection), --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # what splitting a backward into B and W adds per transformer layer, in seconds (the output
    # layer counts a quarter: one linear of a layer's four): more kernels, the W queue's bookkeeping,
    # the inputs read again. Half goes to B, half to W; a fused backward (BW) pays none. On the GPU
    # check's H100/H200 layers it measured 0.2-0.5 ms whatever the shape (``SPLIT_OVERHEAD_S``)
    split_overhead_s: float = 0.0

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
        if self.recompute_method not in (None, "uniform", "block"):
            raise ScheduleError(f"--recompute-method must be uniform or block, got {self.recompute_method!r}")
        if self.recompute_method is not None and self.recompute != "full":
            raise ScheduleError("--recompute-method applies to --recompute-granularity full")
        if self.recompute_counts is not None:
            if self.recompute_method != "block":
                raise ScheduleError("recompute per rank (--zero-bubble-recompute-num-layers) takes "
                                    "--recompute-granularity full --recompute-method block")
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.recompute_counts):
                raise ScheduleError(f"recompute per rank takes layer counts >= 0, got {list(self.recompute_counts)}")
        if not (isinstance(self.split_overhead_s, (int, float)) and 0 <= self.split_overhead_s < 1):
            raise ScheduleError(f"the split backward's overhead must be 0 or more seconds per layer (below 1 s), got "
                                f"{self.split_overhead_s!r}")
        if self.activation_bytes not in (1, 2, 4):
            raise ScheduleError(f"--activation-bytes must be 1, 2 or 4, got {self.activation_bytes!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ScheduleError(f"--hidden-size {self.hidden_size} is not divisible by "
                                f"--num-attention-heads {self.num_attention_heads}")
        t = self.tensor_parallel_size
        if self.num_attention_heads % t:
            raise ScheduleError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                                f"--tensor-parallel-size {t}: each tensor-parallel rank holds whole heads")
        if ffn_size(self) % t:
            raise ScheduleError(f"the MLP hidden size {ffn_size(self)} is not divisible "
                                f"by --tensor-parallel-size {t}")
        if self.sequence_parallel and self.seq_length % t:
            raise ScheduleError(f"--seq-length {self.seq_length} is not divisible by --tensor-parallel-size {t} "
                                "(sequence parallelism splits the sequence over the tensor-parallel ranks)")
        validate_shapes(self)

    # -- recompute by chunk (the block method) ---------------------------------------------------
    def recomputed_layers(self, rank: int, chunk: int, chunks: int, layers: int) -> int:
        """How many of model chunk ``chunk``'s ``layers`` transformer layers (of ``chunks`` chunks in
        pipeline order) on pipeline ``rank`` recompute their forward in B, each on its own (the block
        method: the chunk's first N; 0 for the other methods, which ``layer_flops`` and
        ``layer_activation_bytes`` count for every layer). Counts of one's own (``recompute_counts``):
        one per rank or one per chunk; else ``recompute_num_layers``. A count above the chunk's
        layers is refused."""
        if self.recompute != "full" or self.recompute_method != "block":
            return 0
        counts = self.recompute_counts
        if counts is None:
            return min(self.recompute_num_layers, layers)
        if len(counts) != chunks and not 0 <= rank < len(counts):
            raise ScheduleError(f"recompute per rank has {len(counts)} values; give one per pipeline rank or one per "
                                f"model chunk ({chunks})")
        n = counts[chunk] if len(counts) == chunks else counts[rank]
        if n > layers:
            raise ScheduleError(f"recompute per rank asks {n} layers of model chunk {chunk}, which holds {layers}")
        return n

    def recomputing(self) -> "ModelSpec":
        """This model with every layer recomputed on its own (a block-method chunk's first layers)."""
        return dataclasses.replace(self, recompute="full", recompute_method=None, recompute_num_layers=1,
                                   recompute_counts=None)

    # -- per layer, per microbatch ------------------------------------------------------------
    # i: the global 0-based decoder layer; None: the generic layer of today's callers (every layer
    # where all are alike; else the mean over the num_layers layers, so num_layers x it is the total)
    def is_moe_layer(self, i: int) -> bool:
        """Layer i has experts: --num-experts set and --moe-layer-freq marks it."""
        self._check_layer(i)
        return moe_pattern(self)[i]

    def _check_layer(self, i):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ScheduleError(f"layer index {i!r} is outside the model's layers 0..{self.num_layers - 1}")

    def _per_layer(self, fn, i):
        """fn(moe) for layer i; for i None: fn of the one kind, or the layers' mean where MoE and dense mix."""
        if i is not None:
            return fn(self.is_moe_layer(i))
        pat = moe_pattern(self)
        n, k = len(pat), sum(pat)
        if k in (0, n):
            return fn(bool(k))
        x, y = fn(True), fn(False)
        if isinstance(x, tuple):
            return tuple((k * p + (n - k) * q) / n for p, q in zip(x, y))
        return (k * x + (n - k) * y) / n

    def layer_flops(self, i: Optional[int] = None):
        """(F, B, W) FLOPs of layer i per microbatch: F = 2 x the linears' multiply-adds (QKV with
        GQA's narrower K and V, the projection, the MLP: 2 GEMMs, 3 with SwiGLU; MoE: each token
        through its k routed experts, the shared experts and the router) + the attention core's
        Q.K^T and scores.V over the whole s x s (4 b s^2 h for plain attention: no causal halving);
        B = the linears' input-gradient GEMMs + twice the core; W = the weight-gradient GEMMs. The
        experts' ranks share the routed copies (k per token per rank on average). Full recompute
        runs the forward again in B, selective recompute the attention core."""
        return self._per_layer(self._layer_flops, i)

    def _layer_flops(self, moe):
        b, s, t = self.micro_batch_size, self.seq_length, self.tensor_parallel_size
        att, mlp_ = attention(self), mlp(self, moe)
        gemm = 2 * b * s * (att.macs + mlp_.macs)
        core = 2 * b * s * s * att.core
        f = (gemm + core) / t
        bb = (gemm + 2 * core) / t
        if self.recompute == "full" and self.recompute_method != "block":
            bb += f
        elif self.recompute == "selective":
            bb += core / t
        return f, bb, gemm / t

    def output_flops(self):
        """(F, B, W) of the output layer per microbatch: 2 b s h V / t each. The loss's own softmax
        and cross entropy (a few FLOPs per logit against the GEMM's 2 h) are left out: under 0.2%
        of it for h >= 2048."""
        b, s, h, v, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.vocab_size, self.tensor_parallel_size
        x = 2.0 * b * s * h * v / t
        return x, x, x

    def embedding_flops(self):
        """(F, B, W) of the input embedding per microbatch: F a gather (0 FLOPs), no input gradient,
        W the scatter-add of the output gradient into the rows (b s h / t adds: each TP rank adds
        the tokens of its vocabulary shard)."""
        return 0.0, 0.0, self.micro_batch_size * self.seq_length * self.hidden_size / self.tensor_parallel_size

    def layer_activation_bytes(self, i: Optional[int] = None):
        """(M_B, M_W) of layer i per microbatch. Per token, in activation elements of ``e`` bytes:
        the layer norms and the QKV and MLP inputs 4 h (replicated over TP unless sequence parallel),
        attention Q, K, V and its output (4 h; a d + 2 g d + a d with GQA), the MLP's fc1 output and
        fc2 input 2 ffn (3 ffn with SwiGLU) (split over TP), the softmax output a s (twice with
        dropout: its output too; not with flash attention or selective recompute); dropout's masks
        add 2 h + a s bytes. With e = 2, ffn = 4 h and dropout this is Megatron's s b (34 h + 5 a s)
        / t. MoE: per routed copy (k per token) the dispatched token h and the expert's 2 f (3 f),
        the shared experts' 2 fs (3 fs). M_W (the linears' inputs and output gradients, held from B
        until W): (6 h + 2 h + 2 ffn) e s b / t for the plain layer, per routed copy 2 h + 2 f for
        MoE (the router's weight gradient stays in B). Full recompute: F keeps each block's input
        (e h per token per recompute_num_layers layers); B recreates the rest, and what W needs
        outlives it, so M_W is then larger than M_B."""
        return self._per_layer(self._layer_activation_bytes, i)

    def _layer_activation_bytes(self, moe):
        b, s, h, a, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.num_attention_heads, self.tensor_parallel_size
        e = self.activation_bytes
        drop = self.dropout
        att, mlp_ = attention(self), mlp(self, moe)
        keep_scores = not (self.flash_attention or self.recompute == "selective")
        scores = ((2 * e + 1) if drop else e) * a * s if keep_scores else 0
        rep = e * (4 * h + mlp_.kept_rep) + (2 * h if drop else 0)
        split = e * (att.kept + mlp_.kept) + scores
        m_b = s * b * ((rep + split) / t if self.sequence_parallel else rep + split / t)
        m_w = e * s * b * (att.w_elems + mlp_.w_elems) / t
        if self.recompute == "full" and self.recompute_method != "block":
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

    def layer_a2a_bytes(self, i: Optional[int] = None):
        """Bytes layer i's expert-parallel all-to-all sends per microbatch from one rank in a
        forward (dispatch + combine: 2 x tokens x k x h x e), counting only the routed copies that
        leave the rank ((EP-1)/EP of them, uniform routing); the backward sends as much again. The
        tokens are the rank's s b (s b / t with sequence parallelism). 0 for a dense layer or EP 1."""
        return self._per_layer(self._layer_a2a_bytes, i)

    def _layer_a2a_bytes(self, moe):
        ep = self.expert_model_parallel_size
        if not moe or ep < 2:
            return 0.0
        tokens = self.seq_length * self.micro_batch_size / (self.tensor_parallel_size if self.sequence_parallel else 1)
        return 2.0 * tokens * self.moe_router_topk * self.hidden_size * self.activation_bytes * (ep - 1) / ep

    def params_per_layer(self, i: Optional[int] = None):
        """Parameters of layer i on one rank: the linears / t (MoE: this rank's experts, EP, and
        the shared experts), the router (experts x h, whole) and the norms and biases (9 h, plus
        the latent norms with multi-latent attention)."""
        return self._per_layer(self._params_per_layer, i)

    def _params_per_layer(self, moe):
        h, t = self.hidden_size, self.tensor_parallel_size
        att = attention(self)
        small = 9 * h + ((self.q_lora_rank or 0) + self.kv_lora_rank if self.multi_latent_attention else 0)
        if moe:
            f, n = moe_ffn_size(self), 3 if self.swiglu else 2
            fs = self.moe_shared_expert_intermediate_size or 0
            experts = self.num_experts // self.expert_model_parallel_size
            return (att.macs + experts * n * h * f + n * h * fs) / t + self.num_experts * h + small
        return (att.macs + mlp(self, False).macs) / t + small

    def embedding_params(self):
        """The input embedding's parameters on one rank: V h / t (the vocabulary split over TP)."""
        return self.vocab_size * self.hidden_size / self.tensor_parallel_size

    def output_params(self):
        """The output layer's own parameters on one rank: V h / t untied, 0 tied (it is the
        embedding's; the caller decides where the tied copy lives). The final norm (h) is left out."""
        return self.embedding_params() if self.untie_embeddings_and_output_weights else 0.0

    # -- multi-token prediction (DeepSeek-V3): one MTP layer; a model has mtp_num_layers of them --
    def _mtp_moe(self):
        return self.is_moe_layer(self.num_layers - 1)  # Megatron builds it like the last decoder layer

    def mtp_layer_flops(self, with_output: bool = True):
        """(F, B, W) of one MTP layer per microbatch: the embedding of the shifted tokens, the two
        norms, the 2h -> h projection, one transformer layer like the last decoder layer, and (with
        ``with_output``) the shared output layer and loss computed again (in Megatron these run
        where the loss runs, 'L' in a layout; the rest where the 'm' is)."""
        b, s, h, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.tensor_parallel_size
        proj = 2.0 * b * s * 2 * h * h / t
        layer, emb = self._layer_flops(self._mtp_moe()), self.embedding_flops()
        out = self.output_flops() if with_output else (0.0, 0.0, 0.0)
        return tuple(proj + x + y + z for x, y, z in zip(layer, emb, out))

    def mtp_activation_bytes(self, with_output: bool = True):
        """(M_B, M_W) of one MTP layer per microbatch: the two norms' inputs and the projection's
        input (4 h per token, replicated like a layer's norms), its transformer layer's, and (with
        ``with_output``) what the loss adds again; W: the projection's input and output gradient
        (3 h) and the layer's and the output layer's."""
        b, s, h, t = self.micro_batch_size, self.seq_length, self.hidden_size, self.tensor_parallel_size
        e = self.activation_bytes
        m_b = 4 * e * s * b * h / (t if self.sequence_parallel else 1)
        m_w = 3 * e * s * b * h / t
        lb, lw = self._layer_activation_bytes(self._mtp_moe())
        ob, ow = self.loss_activation_bytes() if with_output else (0.0, 0.0)
        return m_b + lb + ob, m_w + lw + ow

    def mtp_params(self):
        """Parameters of one MTP layer on one rank: two norms (2 h), the projection (2 h^2 / t) and
        its transformer layer; the embedding and output layer are the model's own (shared)."""
        h, t = self.hidden_size, self.tensor_parallel_size
        return 2 * h + 2 * h * h / t + self._params_per_layer(self._mtp_moe())

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
    the embedding on stage 0, the loss on the last (what ``core.sim.simulate.stage_memory_trace`` takes)."""
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
