"""Weight-gradient deferral for Transformer Engine modules (GPU only; ``megatron.execution.wgrad`` does the
local spec). TE modules built with ``delay_wgrad_compute=True`` keep their own FIFO of deferred
weight-gradient work per module; we only decide *when* ``backward_dw()`` runs: at the W pass of
the microbatch (W order must equal B order per chunk; the queue enforces it), or at the end of the
backward for a BW pass. Duck-typed: nothing here imports transformer_engine."""
from __future__ import annotations

import functools

import torch

__all__ = ["QUEUE_ATTR", "TE_HOOK_ATTR", "is_te_delayed", "te_forward_hook", "find_ddp"]

QUEUE_ATTR = "_mzb_wqueue"      # the chunk's WQueue, on every attached layer
TE_HOOK_ATTR = "_mzb_te_hook"   # forward-hook handle on TE modules


def is_te_delayed(module) -> bool:
    """A module following Transformer Engine's delayed-wgrad protocol, with delay switched on.

    TE modules built with ``delay_wgrad_compute=True`` (megatron's TELinear & co. when
    ``config.delay_wgrad_compute``) have ``wgrad_store.delay_wgrad_compute()`` true: their backward
    pushes the weight-gradient work on a per-module FIFO and ``backward_dw()`` pops and runs one
    entry. Duck-typed, so nothing imports transformer_engine (no megatron module has a
    ``wgrad_store``; megatron's own ``backward_dw`` containers are not matched).
    """
    if not callable(getattr(module, "backward_dw", None)):
        return False
    probe = getattr(getattr(module, "wgrad_store", None), "delay_wgrad_compute", None)
    return callable(probe) and bool(probe())


def te_forward_hook(module, args, output):
    if module.__dict__.get(QUEUE_ATTR) is None or not torch.is_grad_enabled():
        return None
    out = output
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(functools.partial(_te_grad_hook, module))
    return None


def _te_grad_hook(module, grad):
    # Runs when the module's output gradient is ready, i.e. just before TE's backward of this call
    # pushes one entry on the module's FIFO.
    queue = module.__dict__.get(QUEUE_ATTR)
    if queue is not None and queue.deferring:
        queue.put(module.backward_dw, fifo=True)
    else:  # BW pass (or detached meanwhile): pop the entry at the end of this backward
        torch.autograd.Variable._execution_engine.queue_callback(module.backward_dw)
    return None


def find_ddp(model_chunk):
    m, seen = model_chunk, set()
    while m is not None and id(m) not in seen:
        seen.add(id(m))
        if hasattr(m, "ddp_config"):
            return m
        m = getattr(m, "module", None)
    return None
