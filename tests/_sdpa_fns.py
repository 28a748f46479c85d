"""What tests/test_sdpa.py runs inside launched ranks (module-level, so ranks can import it): torch's
SDPA core attention against megatron's own ``DotProductAttention`` on the same random inputs."""
from __future__ import annotations


def _inputs(case, heads, groups, tp_rank):
    """This tensor-parallel rank's slice of one set of query/key/value [s, b, n, d] and output grad."""
    import torch
    g = torch.Generator().manual_seed(case.get("seed", 0))
    s, b, d = case["seq"], case["batch"], case["head_dim"]
    q = torch.randn(s, b, case["heads"], d, generator=g)
    k = torch.randn(s, b, case["groups"], d, generator=g)
    v = torch.randn(s, b, case["groups"], d, generator=g)
    dy = torch.randn(s, b, case["heads"] * d, generator=g)
    q, k, v = q[:, :, tp_rank * heads:(tp_rank + 1) * heads], k[:, :, tp_rank * groups:(tp_rank + 1) * groups], \
        v[:, :, tp_rank * groups:(tp_rank + 1) * groups]
    dy = dy.view(s, b, case["heads"], d)[:, :, tp_rank * heads:(tp_rank + 1) * heads].reshape(s, b, heads * d)
    return [t.contiguous().requires_grad_() for t in (q, k, v)], dy


def compare_with_megatron(case):
    """Forward and input gradients of ``SDPAttention`` and megatron's ``DotProductAttention`` (or the
    packed-sequence one) built the same way: the largest relative differences, per SDPA backend."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_zb.megatron.cpu.local_spec import packed_attention
    from megatron_zb.megatron.features.sdpa_attention import SDPAttention
    from megatron_zb.verify.model.tinygpt import TinyGPTConfig, init_parallel_state, make_transformer_config

    tp = case["tp"]
    init_parallel_state(tensor_parallel_size=tp)
    cfg = make_transformer_config(TinyGPTConfig(hidden_size=case["heads"] * case["head_dim"],
                                                num_attention_heads=case["heads"]),
                                  tensor_parallel_size=tp, num_query_groups=case["groups"])
    mask_type = AttnMaskType[case.get("mask_type", "causal")]
    kw = dict(config=cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self",
              softmax_scale=case.get("scale"))
    ref_cls = packed_attention() if case.get("packed") else DotProductAttention
    ref, sdpa = ref_cls(**kw), SDPAttention(**kw)
    rank = ps.get_tensor_model_parallel_rank()
    (q, k, v), dy = _inputs(case, case["heads"] // tp, case["groups"] // tp, rank)
    mask, packed = None, None
    if case.get("padding_mask"):  # megatron's boolean mask, True = masked: the last keys of batch row 0 hidden
        mask = torch.zeros(case["batch"], 1, case["seq"], case["seq"], dtype=torch.bool)
        mask[0, :, :, -3:] = True
    if case.get("packed"):  # THD: [t, n, d], sequences one after another
        q, k, v = [t.detach()[:, 0].contiguous().requires_grad_() for t in (q, k, v)]
        dy = dy[:, 0:1]
        cu = torch.tensor(case["packed"], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=int((cu[1:] - cu[:-1]).max()), max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))

    def run(module):
        for t in (q, k, v):
            t.grad = None
        out = module(q, k, v, mask, attn_mask_type=mask_type, packed_seq_params=packed)
        out.backward(dy.reshape(out.shape))
        return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    want = run(ref)
    out = {"shape": list(want[0].shape), "rank": rank}
    for name, backends in (("default", None), ("math", [SDPBackend.MATH])):
        if backends is None:
            got = run(sdpa)
        else:
            with sdpa_kernel(backends):
                got = run(sdpa)
        out[name] = {"shape": list(got[0].shape), "rel": [rel(a, b) for a, b in zip(got, want)]}
    return out


def core_attention_of_model(case):
    """The core-attention classes of the tiny GPT verify builds with ``case["backend"]``."""
    from megatron_zb.verify.model.tinygpt import TinyGPTConfig, build_reference_model, init_parallel_state
    init_parallel_state()
    model = build_reference_model(TinyGPTConfig(num_layers=2, attention_backend=case["backend"]))
    return sorted({type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers})


def run(case):
    """One rank function for the launch: a comparison, or (``kind: model``) the model's attention."""
    return core_attention_of_model(case) if case.get("kind") == "model" else compare_with_megatron(case)
