"""CPU adjustments for megatron-core's MoE (part of ``cpu_shims.apply()``): the all-to-all token
dispatcher over gloo, and 0.16's MoE utilities without Transformer Engine."""
from __future__ import annotations

import functools

__all__ = ["apply"]


def apply() -> None:
    _split_sizes_as_lists()
    _moe_without_te()


def _split_sizes_as_lists():
    """MoE's all-to-all token dispatcher hands ``all_to_all_single`` split sizes that it moved to
    the host as NumPy arrays on CUDA (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` only converts
    CUDA tensors): on CPU they stay tensors, which the process group's binding refuses. Tensor or
    array split sizes become lists of ints."""
    import torch.distributed as dist
    orig = dist.all_to_all_single
    if getattr(orig, "_mzb_shim", False):
        return

    def as_list(sizes):
        return sizes.tolist() if hasattr(sizes, "tolist") else sizes

    @functools.wraps(orig)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return orig(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)
    all_to_all_single._mzb_shim = True
    dist.all_to_all_single = all_to_all_single


_TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_and_pad_with_probs", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
                 "te_general_gemm")


def _moe_without_te():
    """megatron-core 0.16's MoE utilities test ``te_general_gemm is not None`` (the router's gating
    linear) but only define the Transformer Engine names when TE imports: without TE they are set to
    None, as 0.19 does itself."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - a megatron without MoE
        return
    if getattr(moe_utils, "HAVE_TE", True):
        return
    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
