"""Weight-gradient deferral (the B/W split) for megatron-core's linear layers.

``attach_wgrad_queue(model_chunk, queue)`` makes every eligible linear layer of one model chunk
report to that chunk's :class:`~megatron_zb.runtime.wqueue.WQueue`:

* **Local spec** (``megatron.core.tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear``):
  the layer instance gets its own ``_forward_impl`` (megatron's per-layer hook point, which
  normally calls ``linear_with_grad_accumulation_and_async_allreduce``). Ours runs the same forward
  math and the same tensor-/sequence-parallel communication (megatron's own helpers), through our
  autograd Function. Megatron's files are not touched; layers of a chunk without a queue, frozen
  weights, weights supplied at call time (a tied output layer), ``defer_embedding_wgrad_compute``
  and GTP-sharded weights keep megatron's original path.

  In a **B** pass (inside ``queue.defer(mb)``) its backward computes the input gradient (and the
  bias gradient: a cheap reduction whose parameter is then final) and enqueues a closure for the
  weight gradient. A **W** pass (``queue.run(mb)``) runs the closures. A **BW** pass (a backward
  outside ``defer``) computes both at once, as megatron does.

* **Transformer Engine** modules built with ``delay_wgrad_compute=True`` (GPU only) keep their own
  FIFO of deferred work per module; we only decide *when* ``backward_dw()`` runs: at the W pass of
  the microbatch (W order must equal B order per chunk; the queue enforces it), or at the end of
  the backward for a BW pass.

How the weight gradient reaches the parameter (why DDP keeps working)
--------------------------------------------------------------------
The weight is **not** an autograd input of our Function (it gets ``weight.detach()``), so a B pass
never touches the weight's ``AccumulateGrad`` node: had the weight been an input, autograd would
run that node, and megatron DDP's grad-ready hook registered on it, with a ``None`` gradient at B
time (``overlap_grad_reduce`` asserts on that). Instead, whenever the weight gradient exists (at
W, or inline in a BW pass) we run the autograd engine rooted at a view of the parameter with that
gradient, which runs the weight's own ``AccumulateGrad`` node with every hook on it, exactly as a
normal backward would (a W pass does this once for all its layers; the gradient is adopted as
``param.grad`` without a copy). With ``gradient_accumulation_fusion`` we accumulate into
``weight.main_grad`` with the fused kernel and feed megatron's dummy gradient with
``weight.grad_added_to_main_grad = True`` (megatron's own convention), so DDP's hook skips the add
but still marks the parameter ready. Megatron DDP therefore sees a linear weight become ready at
its W, and ``overlap_grad_reduce=True`` works.

For the executor: as with megatron's schedules, everything but the end of the iteration runs under
``ddp.no_sync()``; what must run outside it is the **last B** (norms, embeddings, biases get their
final gradient there) and the **last W** in time of the chunk (linear weights). DDP then launches
each bucket's reduce when its last parameter is delivered (megatron counts grad-ready calls per
parameter against those of the first iteration, so keep the pattern the same every iteration).

Sequence parallel
-----------------
With sequence parallelism the weight gradient needs the all-gathered input. B does not gather: the
input gradient does not need it. W **re-gathers** the (sequence-sharded) input saved by the forward
(megatron's own forward already saves only the shard and re-gathers in backward). Keeping the
gathered input from B instead would hold ``tp`` times more activation memory from B to W and put a
collective on the critical path for nothing. The cost is one all-gather per layer inside W, i.e. in
a bubble; all ranks of a tensor-parallel group must therefore run their W passes in the same order,
which they do as they run the same schedule.

Limitations
-----------
* A layer whose ``forward`` runs more than once in one forward pass (MTP's shared output layer) is
  left on megatron's path (detected for GPTModel with ``mtp_num_layers``); within one deferred B,
  repeated calls of a layer are merged into one delivery at W.
* Megatron-FSDP parameters and GTP weight rematerialisation keep megatron's path (no deferral).
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Iterator, List, Optional

import torch

from megatron_zb.runtime.wqueue import WQueue, WQueueError

from .wgrad_te import QUEUE_ATTR as _QUEUE
from .wgrad_te import TE_HOOK_ATTR as _TE_HOOK
from .wgrad_te import find_ddp, is_te_delayed, te_forward_hook

__all__ = [
    "attach_wgrad_queue",
    "detach_wgrad_queue",
    "deferrable_layers",
    "wgrad_parameters",
    "queue_of",
    "fused_weights",
]

_PATCHED = "_mzb_wgrad_patched"  # marks our instance-level _forward_impl
_LAST_TASK = "_mzb_last_wtask"   # last W task of the layer (merges repeated calls in one B)
_DELIVERY = "wgrad_delivery"     # key in WQueue.scratch: the B pass's shared _Delivery
_DELIVERY_BYTES = 256 << 20      # a W pass hands gradients to autograd at least every 256 MiB

_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")

_KNOWN_KWARGS = frozenset({
    "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
    "grad_output_buffer", "wgrad_deferral_limit", "tp_group", "gtp_remat_size",
})


def _mcore_layers():
    from megatron.core.tensor_parallel import layers
    return layers


# ----------------------------------------------------------------------------- call site
class _Site:
    """What one call of a deferrable layer needs in backward and W."""
    __slots__ = ("layer", "param", "gaf", "allreduce_dgrad", "sequence_parallel", "tp_group")

    def __init__(self, layer, param, gaf, allreduce_dgrad, sequence_parallel, tp_group):
        self.layer = layer
        self.param = param
        self.gaf = gaf
        self.allreduce_dgrad = allreduce_dgrad
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group


def _deferrable_forward_impl(self, input, weight, *args, **kwargs):
    """Instance-level replacement of ``ColumnParallelLinear/RowParallelLinear._forward_impl``."""
    site = _site_for_call(self, weight, args, kwargs)
    if site is None:
        return type(self)._forward_impl(self, input, weight, *args, **kwargs)
    return _DeferrableLinear.apply(input, weight.detach(), kwargs.get("bias"), site)


def _site_for_call(layer, weight, args, kwargs) -> Optional[_Site]:
    if layer.__dict__.get(_QUEUE) is None or args or not torch.is_grad_enabled():
        return None
    if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return None  # frozen weight: megatron's linear_with_frozen_weight
    if weight is not layer._parameters.get("weight"):
        return None  # weight supplied at call time (tied output layer): its grad is not ours alone
    if not _KNOWN_KWARGS.issuperset(kwargs):
        return None  # a calling convention we do not know: stay on megatron's path
    if kwargs.get("grad_output_buffer") is not None or kwargs.get("gtp_remat_size", 1) != 1:
        return None
    allreduce_dgrad = bool(kwargs.get("allreduce_dgrad", False))
    sequence_parallel = bool(kwargs.get("sequence_parallel", False))
    tp_group = kwargs.get("tp_group")
    if allreduce_dgrad or sequence_parallel:
        tp_group = _mcore_layers().get_tensor_model_parallel_group_if_none(tp_group)
        if allreduce_dgrad and sequence_parallel:
            raise RuntimeError("allreduce_dgrad and sequence_parallel cannot both be set")
    return _Site(layer, weight, bool(kwargs.get("gradient_accumulation_fusion", False)),
                 allreduce_dgrad, sequence_parallel, tp_group)


def _all_gather_input(input, tp_group, async_op=False):
    L = _mcore_layers()
    dim_size = list(input.size())
    dim_size[0] = dim_size[0] * tp_group.size()
    buf = L.get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
    handle = L.dist_all_gather_func(buf, input, group=tp_group, async_op=async_op)
    return buf, handle


# ----------------------------------------------------------------------------- autograd
class _DeferrableLinear(torch.autograd.Function):
    """Megatron's linear with async TP communication, with a weight gradient that can be deferred.

    ``weight`` is a detached alias of the parameter (see the module docstring); the parameter
    itself travels in ``site``.
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight, bias, site):
        param = site.param
        ctx.save_for_backward(input, weight)
        ctx.site = site
        # like megatron: hold main_grad in ctx (a layer may be reused, e.g. MTP logits)
        ctx.main_grad = param.main_grad if site.gaf and hasattr(param, "main_grad") else None
        ctx.use_bias = bias is not None
        if site.sequence_parallel:
            total_input, _ = _all_gather_input(input, site.tp_group)
        else:
            total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        site = ctx.site
        queue = site.layer.__dict__.get(_QUEUE)  # B or BW is decided now, not at forward time
        defer = queue is not None and queue.deferring

        total_input = gather = None
        if not defer and site.sequence_parallel:
            total_input, gather = _all_gather_input(input, site.tp_group, async_op=True)
        grad_input = grad_output.matmul(weight)
        if gather is not None:
            gather.wait()

        handle = None
        if site.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=site.tp_group, async_op=True)
        if site.sequence_parallel:
            sub_grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device,
                                         requires_grad=False)
            handle = _mcore_layers().dist_reduce_scatter_func(
                sub_grad_input, grad_input, group=site.tp_group, async_op=True)
            grad_input = sub_grad_input

        grad_bias = None
        if ctx.use_bias:
            grad_bias = grad_output.contiguous().view(-1, grad_output.shape[-1]).sum(dim=0)

        grad_weight = None
        if defer:
            # detached: the closure keeps the tensors, not the autograd graph behind them
            _enqueue(queue, site, ctx.main_grad, (input.detach(), None, grad_output.detach()))
        else:  # BW: the wgrad GEMM overlaps the dgrad communication, as in megatron
            task = _WgradTask(site, ctx.main_grad, [(input, total_input, grad_output)], None)
            grad_weight = task.compute()
        if handle is not None:
            handle.wait()
        if grad_weight is not None:
            # where megatron would return it to autograd: after the dgrad communication
            _run_backward([site.param], [grad_weight])
        return grad_input, None, grad_bias, None


def _enqueue(queue: WQueue, site: _Site, main_grad, item) -> None:
    layer = site.layer
    delivery = queue.scratch.get(_DELIVERY)  # one per (queue, B pass): scratch resets per defer
    last = layer.__dict__.get(_LAST_TASK)
    if (delivery is not None and last is not None and last.delivery is delivery
            and last.items is not None and last.site.param is site.param):
        last.items.append(item)  # the layer ran twice in this microbatch: one delivery at W
        return
    if delivery is None:
        delivery = queue.scratch[_DELIVERY] = _Delivery()
    task = _WgradTask(site, main_grad, [item], delivery)
    delivery.expected += 1
    layer.__dict__[_LAST_TASK] = task
    queue.put(task)


class _WgradTask:
    """One layer's weight-gradient work for one microbatch (one or more calls of the layer)."""
    __slots__ = ("site", "main_grad", "items", "delivery")

    def __init__(self, site, main_grad, items, delivery):
        self.site = site
        self.main_grad = main_grad
        self.items = items  # [(input, gathered input or None, grad_output)]
        self.delivery = delivery  # shared by the tasks of one B pass (None in a BW pass)

    def held_tensors(self):
        """The tensors this task keeps for W (for activation offload between B and W)."""
        return [t for item in (self.items or ()) for t in item if isinstance(t, torch.Tensor)]

    def __call__(self):
        """The W pass of this layer: compute, then hand over to the pass's shared delivery."""
        self.delivery.add(self.site.param, self.compute())

    def compute(self):
        """Compute (and with fusion accumulate) the weight gradient; returns what autograd must
        receive for the parameter (the gradient, megatron's dummy, or None)."""
        items, self.items = self.items, None  # free the saved activations as soon as possible
        if items is None:
            raise WQueueError("weight-gradient task ran twice")
        with torch.no_grad():  # a W pass builds no graph (and may run with grad mode on)
            grad_weight = self._compute(items)
        del items
        site = self.site
        return _grad_to_deliver(site.param, self.main_grad, site.gaf, grad_weight)

    def _compute(self, items):
        site = self.site
        param = site.param
        L = _mcore_layers()
        grad_weight = None
        for input, total_input, grad_output in items:
            if total_input is None:
                total_input = (_all_gather_input(input, site.tp_group)[0]
                               if site.sequence_parallel else input)
            g, x = L.prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
            if site.gaf:
                _fused_accumulate(param, self.main_grad, x, g)
            else:
                gw = g.t().matmul(x)
                grad_weight = gw if grad_weight is None else grad_weight + gw
            del total_input, x, g
        return grad_weight


class _Delivery:
    """The weight gradients of one W pass, handed to autograd in as few engine calls as possible.

    Each engine call costs tens of microseconds (and on GPU a hand-over to the device thread), so
    a W pass delivers all its layers at once: when its last task has run, or earlier once
    ``_DELIVERY_BYTES`` of real gradients are waiting (bounds the extra memory).
    """
    __slots__ = ("expected", "params", "grads", "nbytes")

    def __init__(self):
        self.expected = 0
        self.params, self.grads, self.nbytes = [], [], 0

    def add(self, param, grad):
        self.expected -= 1
        if grad is not None:
            self.params.append(param)
            self.grads.append(grad)
            self.nbytes += grad.numel() * grad.element_size()
        if self.expected == 0 or self.nbytes >= _DELIVERY_BYTES:
            params, grads = self.params, self.grads
            self.params, self.grads, self.nbytes = [], [], 0
            if params:
                _run_backward(params, grads)


def _fused_accumulate(param, main_grad, total_input, grad_output):
    if main_grad is None:
        raise RuntimeError(
            "gradient_accumulation_fusion=True needs weight.main_grad (megatron DDP creates it); "
            f"parameter of shape {tuple(param.shape)} has none")
    param.main_grad = main_grad  # megatron's backward does the same
    import fused_weight_gradient_mlp_cuda as fused
    if main_grad.dtype == torch.float32:
        fused.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        fused.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")


def _grad_to_deliver(param, main_grad, gaf, grad_weight):
    """What megatron's backward would return to autograd as the weight gradient."""
    if not gaf:
        return grad_weight
    if not hasattr(param, "grad_added_to_main_grad"):
        return None  # megatron returns no weight grad here either
    # megatron's dummy-grad convention: the real gradient is already in main_grad; DDP's hook sees
    # grad_added_to_main_grad and only marks the parameter ready
    if getattr(param, "zero_out_wgrad", False):
        dummy = torch.zeros(main_grad.shape, dtype=param.dtype, device=param.device)
    else:
        dummy = torch.empty(main_grad.shape, dtype=param.dtype, device=param.device)
    param.grad_added_to_main_grad = True
    return dummy


def _run_backward(params, grads):
    """Run the parameters' AccumulateGrad nodes (and every hook on them) with these gradients.

    Each root is a fresh view of its parameter, not the leaf itself: the gradient then reaches
    AccumulateGrad as a new tensor that it can adopt as ``param.grad`` without a copy (a leaf root
    always gets cloned). Inside a BW backward grad mode is off, hence enable_grad. The engine is
    called directly, as megatron's own ``custom_backward`` does.
    """
    with torch.enable_grad():
        roots = tuple(p.view_as(p) for p in params)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=roots, grad_tensors=tuple(grads), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


# ----------------------------------------------------------------------------- attach / detach
def _reused_layers(model_chunk) -> set:
    """Layers megatron calls more than once per forward: GPTModel's output layer under MTP."""
    out = set()
    for m in model_chunk.modules():
        cfg = getattr(m, "config", None)
        layer = getattr(m, "output_layer", None)
        if layer is not None and getattr(cfg, "mtp_num_layers", None):
            out.add(id(layer))
    return out


def _is_local_deferrable(module, L) -> bool:
    for base in (L.ColumnParallelLinear, L.RowParallelLinear):
        if isinstance(module, base):
            break
    else:
        return False
    if type(module)._forward_impl is not base._forward_impl:
        return False  # a subclass with its own linear implementation
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.nn.Parameter):
        return False  # skip_weight_param_allocation: the weight comes with each call
    if getattr(module, "gtp_remat_size", 1) != 1 or hasattr(weight, "__fsdp_param__"):
        return False
    return True


def _candidates(model_chunk) -> Iterator[tuple]:
    # no megatron layer can exist unless megatron's layers module was imported: do not import it
    L = sys.modules.get("megatron.core.tensor_parallel.layers")
    reused = _reused_layers(model_chunk)
    te_names: List[str] = []
    for name, m in model_chunk.named_modules():
        if L is not None and id(m) not in reused and _is_local_deferrable(m, L):
            yield name, m, "local"
        elif is_te_delayed(m) and not any(name.startswith(p + ".") for p in te_names):
            te_names.append(name)  # an enclosing TE module already owns its children's FIFOs
            yield name, m, "te"


def attach_wgrad_queue(model_chunk: torch.nn.Module, queue: WQueue) -> int:
    """Make the linear layers of ``model_chunk`` defer their weight gradients into ``queue``.

    Works on a bare chunk and on DDP / Float16Module-wrapped chunks (it walks all submodules).
    Idempotent: attaching again (to the same or another queue) re-points the layers, never wraps
    twice. Returns the number of layers made deferrable (local-spec linears plus Transformer
    Engine modules with ``delay_wgrad_compute``).
    """
    if not isinstance(queue, WQueue):
        raise TypeError(f"queue must be a megatron_zb WQueue, got {type(queue).__name__}")
    if not isinstance(model_chunk, torch.nn.Module):
        raise TypeError(f"model_chunk must be a torch.nn.Module, got {type(model_chunk).__name__}")
    found = list(_candidates(model_chunk))
    te = [m for _, m, kind in found if kind == "te"]
    if te:
        ddp = find_ddp(model_chunk)
        if ddp is not None and not getattr(ddp.ddp_config, "delay_wgrad_compute", False):
            raise ValueError(
                "this chunk has Transformer Engine modules with delay_wgrad_compute=True; megatron "
                "DDP must then be built with DistributedDataParallelConfig(delay_wgrad_compute="
                "True) so its grad-ready hooks fire from backward_dw() (i.e. at W)")
    for _, m, kind in found:
        m.__dict__[_QUEUE] = queue
        if kind == "local":
            if not m.__dict__.get(_PATCHED):
                m.__dict__["_forward_impl"] = types.MethodType(_deferrable_forward_impl, m)
                m.__dict__[_PATCHED] = True
        elif _TE_HOOK not in m.__dict__:
            m.__dict__[_TE_HOOK] = m.register_forward_hook(te_forward_hook)
    return len(found)


def detach_wgrad_queue(model_chunk) -> None:
    """Undo :func:`attach_wgrad_queue`: the layers go back to megatron's own backward.

    Already queued closures stay valid (they hold what they need) and can still be run.
    """
    for m in model_chunk.modules():
        d = m.__dict__
        d.pop(_QUEUE, None)
        d.pop(_LAST_TASK, None)
        if d.pop(_PATCHED, False):
            d.pop("_forward_impl", None)
        handle = d.pop(_TE_HOOK, None)
        if handle is not None:
            handle.remove()


def deferrable_layers(model_chunk) -> List[str]:
    """Names of the submodules :func:`attach_wgrad_queue` would make deferrable."""
    return [name for name, _, _ in _candidates(model_chunk)]


def fused_weights(model_chunk) -> List[str]:
    """Matrix weights of ``model_chunk`` whose gradient is still computed in B after
    :func:`attach_wgrad_queue` (e.g. MoE's router gating, a tied output layer, layers megatron runs
    through its own autograd functions), as ``name (count)`` with layer and expert indices
    collapsed. Embedding tables (lookups, no GEMM) are not listed."""
    import re
    deferred = {id(p) for p in wgrad_parameters(model_chunk)}
    counts: dict = {}
    for name, p in model_chunk.named_parameters():
        if not p.requires_grad or p.dim() < 2 or id(p) in deferred or "embedding" in name or \
                getattr(p, "mzb_vocab_rows", None) is not None:  # a vocabulary shard: its own VW pass
            continue
        key = re.sub(r"\.(\d+)\.", ".*.", name.replace("module.", ""))
        counts[key] = counts.get(key, 0) + 1
    return [f"{k} ({n})" if n > 1 else k for k, n in sorted(counts.items())]


def queue_of(module) -> Optional[WQueue]:
    """The W queue a layer is attached to, or None."""
    return module.__dict__.get(_QUEUE)


def wgrad_parameters(model_chunk) -> List[torch.nn.Parameter]:
    """Parameters of attached layers whose gradient is complete only after W (linear weights).

    Everything else (norms, embeddings, biases, tied output weights) is final after B.
    """
    out = []
    for m in model_chunk.modules():
        if m.__dict__.get(_QUEUE) is None:
            continue
        if m.__dict__.get(_PATCHED):
            out.append(m._parameters["weight"])
        else:
            out.extend(p for p in m.parameters(recurse=True) if p.requires_grad)
    return out
