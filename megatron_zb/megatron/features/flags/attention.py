"""Megatron's ``--attention-backend`` where Transformer Engine is absent: which core attention a
local-spec model (``--transformer-impl local``) gets. The module: ``features.sdpa_attention``.

* ``flash``, ``fused``: torch's ``scaled_dot_product_attention`` (``SDPAttention``): on a GPU its
  FlashAttention / memory-efficient / cuDNN kernels, which keep no s x s scores; on a CPU its own
  kernels or the math path.
* ``local``, ``unfused``, ``auto`` (Megatron's default): megatron's ``DotProductAttention``, as
  Megatron builds it (unfused: the s x s scores materialised and kept for the backward).

With Transformer Engine the flag means what it means in Megatron (TE's backends). The same names
select the layer in ``megatron-zb verify`` and the GPU check (``--attention-backend``).

This module imports neither torch nor megatron.
"""
from __future__ import annotations

from ... import errors

__all__ = ["ATTENTION_BACKENDS", "SDPA_BACKENDS", "backend_name", "uses_sdpa", "check_attention_args"]

ATTENTION_BACKENDS = ("auto", "local", "unfused", "flash", "fused")  # Megatron's AttnBackend names
SDPA_BACKENDS = ("flash", "fused")  # the ones that select torch's SDPA without Transformer Engine


def backend_name(backend) -> str:
    """Megatron's ``AttnBackend`` member or its name -> the name (``'auto'`` for None)."""
    if backend is None:
        return "auto"
    name = str(getattr(backend, "name", backend))
    if name not in ATTENTION_BACKENDS:
        raise errors.ZeroBubbleConfigError(f"attention backend {name!r}: one of {', '.join(ATTENTION_BACKENDS)}")
    return name


def uses_sdpa(backend) -> bool:
    """Whether ``--attention-backend`` (a name or Megatron's enum) selects torch's SDPA core attention
    for a model built without Transformer Engine."""
    return backend_name(backend) in SDPA_BACKENDS


def check_attention_args(args) -> None:
    """Training's flags (after the machine's adjustments): what torch's SDPA core attention does not
    do, refused in one line before any process group exists. Nothing to check with Transformer Engine."""
    if getattr(args, "transformer_impl", "local") != "local" or not uses_sdpa(getattr(args, "attention_backend", None)):
        return
    why = "--attention-backend flash/fused without Transformer Engine (torch's scaled_dot_product_attention)"
    for flag, on in (("--context-parallel-size > 1", (getattr(args, "context_parallel_size", 1) or 1) > 1),
                     ("--window-size", getattr(args, "window_size", None) is not None),
                     ("--softmax-type " + str(getattr(args, "softmax_type", "vanilla")),
                      getattr(args, "softmax_type", "vanilla") not in (None, "vanilla")),
                     ("--multi-latent-attention", bool(getattr(args, "multi_latent_attention", False)))):
        if on:
            raise errors.ZeroBubbleArgumentError(f"{why} does not run with {flag}: use --attention-backend local "
                                                 "(megatron's attention) or Transformer Engine")
