"""One rank of the weight-gradient-deferral checks (tests/test_wgrad.py runs ``rank_case`` on the
ranks of a verify launch; ``python _wgrad_worker.py`` runs them on processes of its own).

Real megatron-core layers, real torch.distributed over gloo on 127.0.0.1, one process per rank.
Every case builds a model, then compares, with identical weights and data:

  ref : megatron's own fused backward (no queue attached)
  bw  : queue attached, plain backward outside defer() (our BW path)
  bw+w: queue attached, every B under queue.defer(mb), then the W passes in a shuffled order

on input gradients and weight gradients (``main_grad`` under gradient_accumulation_fusion or DDP).
It also checks that linear weights really got nothing during B, that the queue is empty at the end,
and the error for a W with nothing queued. Writes ``<out>/rank<r>.json``.

Usage: RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python _wgrad_worker.py OUT CASE...
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zb.megatron.cpu import cpu_shims  # noqa: E402

cpu_shims.apply()

import torch  # noqa: E402

# MZB_DEVICE=cuda (one GPU, one rank, NCCL): the same checks on CUDA, where autograd runs backward
# on a device thread. Without apex, gradient_accumulation_fusion uses the CPU shims' stand-in.
DEV = torch.device("cuda" if os.environ.get("MZB_DEVICE") == "cuda" else "cpu")
if DEV.type == "cuda":
    cpu_shims._fake_gradient_accumulation_fusion()
import torch.nn.functional as F  # noqa: E402

import megatron.core  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_zb.megatron.execution.wgrad import (  # noqa: E402
    attach_wgrad_queue, detach_wgrad_queue, wgrad_parameters)
from megatron_zb.runtime.wqueue import WQueue, WQueueError  # noqa: E402

M = 4          # microbatches per iteration
SEQ, MB, HID, FFN, VOCAB = 8, 2, 32, 64, 64


def init_tp(tp):
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)


def rel(a, b):
    d = (a.double() - b.double()).norm().item()
    n = b.double().norm().item()
    return d / n if n > 0 else d


# ----------------------------------------------------------------------------- models
class MLP(torch.nn.Module):
    """ColumnParallelLinear -> gelu -> RowParallelLinear (megatron's tensor-parallel MLP)."""

    def __init__(self, cfg):
        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            HID, FFN, config=cfg, init_method=init, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            FFN, HID, config=cfg, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False)

    def forward(self, x):
        h, _ = self.fc1(x)
        y, _ = self.fc2(F.gelu(h))
        return y


def build_mlp(tp, sp, gaf):
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                              gradient_accumulation_fusion=gaf, use_cpu_initialization=True,
                              params_dtype=torch.float32)
    model = MLP(cfg).to(DEV)
    if gaf:  # no DDP: give the weights the main_grad megatron's fused path accumulates into
        for mod in (model.fc1, model.fc2):
            mod.weight.main_grad = torch.zeros_like(mod.weight)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    seq = SEQ // tp if sp else SEQ
    data = []
    for mb in range(M):
        # without SP the input / output grad are replicated over the TP group, with SP sharded
        g = torch.Generator().manual_seed(100 * mb + (tp_rank if sp else 0))
        data.append((torch.randn(seq, MB, HID, generator=g).to(DEV),
                     torch.randn(seq, MB, HID, generator=g).to(DEV)))

    def step(mb):  # returns (the tensor to backward, its gradient, the leaf input)
        x = data[mb][0].clone().requires_grad_()
        return model(x), data[mb][1], x
    return model, model, step


class Reuse(torch.nn.Module):
    """One ColumnParallelLinear called twice per forward: one W closure per microbatch."""

    def __init__(self, cfg):
        super().__init__()
        self.lin = tensor_parallel.ColumnParallelLinear(
            HID, HID, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=True,
            gather_output=True)

    def forward(self, x):
        h, _ = self.lin(x)
        y, _ = self.lin(torch.tanh(h))
        return y


def build_reuse(tp, gaf):
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, gradient_accumulation_fusion=gaf,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    model = Reuse(cfg).to(DEV)
    if gaf:
        model.lin.weight.main_grad = torch.zeros_like(model.lin.weight)
    data = []
    for mb in range(M):
        g = torch.Generator().manual_seed(300 + mb)
        data.append((torch.randn(SEQ, MB, HID, generator=g).to(DEV),
                     torch.randn(SEQ, MB, HID, generator=g).to(DEV)))

    def step(mb):
        x = data[mb][0].clone().requires_grad_()
        return model(x), data[mb][1], x
    return model, model, step


def gpt_config(tp, sp, gaf):
    return TransformerConfig(
        num_layers=2, hidden_size=HID, num_attention_heads=4, ffn_hidden_size=FFN,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sp, gradient_accumulation_fusion=gaf,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)


class SPLayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm usable under sequence parallelism.

    The local spec's norm is apex's FusedLayerNorm, or megatron's WrappedTorchNorm without apex,
    and the latter refuses sequence_parallel. This one marks its parameters like megatron does.
    """

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def local_spec(sp):
    """get_gpt_layer_local_spec(); under SP with the torch norm swapped for SPLayerNorm."""
    import dataclasses
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec()
    if not sp:
        return spec

    def swap(obj):
        if obj is WrappedTorchNorm:
            return SPLayerNorm
        if isinstance(obj, ModuleSpec):
            return dataclasses.replace(obj, module=swap(obj.module), submodules=swap(obj.submodules))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: swap(getattr(obj, f.name))
                                               for f in dataclasses.fields(obj) if f.init})
        return obj
    layer = swap(spec)
    return TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=SPLayerNorm)


def build_gpt(tp, sp, gaf, pre_process=True, ddp=None):
    cfg = gpt_config(tp, sp, gaf)
    model = GPTModel(config=cfg, transformer_layer_spec=local_spec(sp),
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre_process,
                     post_process=True, share_embeddings_and_output_weights=True)
    inner = model = model.to(DEV)
    if ddp is not None:
        ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=ddp, bucket_size=4000,
                                                use_distributed_optimizer=False)
        model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=inner)
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1).to(DEV)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MB, SEQ).to(DEV)
    data = []
    for mb in range(M):
        g = torch.Generator().manual_seed(1000 * mb + dp_rank)   # same over the TP group
        tokens = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        hs = SEQ // tp if sp else SEQ
        gh = torch.Generator().manual_seed(5000 * mb + dp_rank * 10 + (tp_rank if sp else 0))
        hidden = torch.randn(hs, MB, HID, generator=gh)
        data.append((tokens.to(DEV), labels.to(DEV), hidden.to(DEV)))

    def step(mb):
        tokens, labels, hidden = data[mb]
        x = None
        if pre_process:
            out = model(tokens, pos, mask, labels=labels)
        else:
            x = hidden.clone().requires_grad_()
            inner.set_input_tensor(x)
            out = model(None, pos, mask, labels=labels)
        loss = out.float().sum() / out.numel()
        return loss, None, x
    return model, inner, step


# ----------------------------------------------------------------------------- protocol
def grads_of(inner):
    out = {}
    for name, p in inner.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        elif p.grad is not None:
            g = g + p.grad
        out[name] = None if g is None else g.detach().clone()
    return out


def zero_grads(model, inner, ddp):
    if ddp is not None:
        model.zero_grad_buffer()
    for p in inner.parameters():
        p.grad = None
        if ddp is None and hasattr(p, "main_grad"):
            p.main_grad.zero_()


def no_sync(model, ddp, on):
    import contextlib
    return model.no_sync() if (ddp is not None and on) else contextlib.nullcontext()


def run_iteration(model, inner, step, mode, ddp, queue=None, order_seed=0):
    """One iteration of M microbatches. mode: 'ref'/'bw' (fused backward) or 'bw+w' (B then W)."""
    xgrads = []
    after_b = None
    if mode in ("ref", "bw"):
        for mb in range(M):
            with no_sync(model, ddp, mb < M - 1):
                y, gy, x = step(mb)
                torch.autograd.backward(y, gy)
            xgrads.append(None if x is None else x.grad.clone())
    else:
        for mb in range(M):
            with no_sync(model, ddp, mb < M - 1):   # the last B in time leaves no_sync
                y, gy, x = step(mb)
                with queue.defer(mb):
                    torch.autograd.backward(y, gy)
            xgrads.append(None if x is None else x.grad.clone())
        after_b = grads_of(inner)
        if ddp:  # overlap_grad_reduce: no bucket holding a linear weight may be reduced yet
            deferred = {id(p) for p in wgrad_parameters(inner)}
            early = [i for i, bg in enumerate(model.bucket_groups)
                     if bg.grad_reduce_handle is not None and any(id(p) in deferred for p in bg.params)]
            assert not early, f"bucket groups {early} started reducing before their W passes"
        order = list(range(M))
        random.Random(order_seed).shuffle(order)      # same order on every rank of the group
        for i, mb in enumerate(order):
            with no_sync(model, ddp, i < M - 1):     # the last W in time leaves no_sync
                queue.run(mb)
        queue.assert_empty()
    if ddp and mode != "ref":  # overlap: the hooks (not finish_grad_sync) launched every reduce
        idle = [i for i, bg in enumerate(model.bucket_groups) if bg.grad_reduce_handle is None]
        assert not idle, f"{mode}: bucket groups {idle} never started their reduce from the hooks"
        assert len(model.bucket_groups) > 1
    if ddp is not None:
        model.finish_grad_sync()
    return grads_of(inner), xgrads, after_b


def compare(ref, got, what):
    worst = 0.0
    for name, r in ref.items():
        g = got[name]
        if (r is None) != (g is None):
            raise AssertionError(f"{what}: gradient of {name} is {'missing' if g is None else 'extra'}")
        if r is not None:
            worst = max(worst, rel(g, r))
    return worst


def check_case(name, build, ddp):
    model, inner, step = build()
    ref, ref_x, _ = run_iteration(model, inner, step, "ref", ddp)
    n_nonzero = sum(1 for g in ref.values() if g is not None and g.abs().sum() > 0)
    assert n_nonzero >= 2, f"reference produced too few gradients ({n_nonzero})"
    queue = WQueue(name)
    n_layers = attach_wgrad_queue(model, queue)
    assert n_layers == attach_wgrad_queue(model, queue), "attach is not idempotent"
    deferred = {id(p) for p in wgrad_parameters(inner)}
    names_deferred = {n for n, p in inner.named_parameters() if id(p) in deferred}
    res = {"layers": n_layers, "deferred_params": sorted(names_deferred), "microbatches": M}

    zero_grads(model, inner, ddp)
    bw, bw_x, _ = run_iteration(model, inner, step, "bw", ddp)
    res["bw_rel"] = compare(ref, bw, "BW")
    res["bw_x_rel"] = max([rel(a, b) for a, b in zip(bw_x, ref_x) if b is not None] or [0.0])

    zero_grads(model, inner, ddp)
    puts_before = queue.closures_put
    split, split_x, after_b = run_iteration(model, inner, step, "bw+w", ddp, queue,
                                            order_seed=len(name))
    res["closures"] = queue.closures_put - puts_before
    res["split_rel"] = compare(ref, split, "B+W")
    res["split_x_rel"] = max([rel(a, b) for a, b in zip(split_x, ref_x) if b is not None] or [0.0])
    # during B the linear weights got nothing; everything else got its gradient
    leaked = [n for n in names_deferred if after_b[n] is not None and after_b[n].abs().sum() > 0]
    missing = [n for n, g in after_b.items() if n not in names_deferred and ref[n] is not None
               and ref[n].abs().sum() > 0 and (g is None or g.abs().sum() == 0)]
    assert not leaked, f"weight gradients computed during B: {leaked}"
    assert not missing, f"non-linear parameters without gradient after B: {missing}"
    # W with nothing queued names the chunk and the microbatch
    try:
        queue.run(0)
    except WQueueError as e:
        msg = str(e)
        assert repr(name) in msg and "microbatch 0" in msg, msg
        res["error_message"] = msg
    else:
        raise AssertionError("run() with nothing queued did not raise")
    queue.assert_empty()
    detach_wgrad_queue(model)
    assert not any("_mzb_wqueue" in m.__dict__ for m in model.modules())
    return res


CASES = {
    # name: (tp, builder(tp) -> (model, inner, step), ddp overlap or None)
    "mlp_tp1": (1, lambda: build_mlp(1, False, False), None),
    "mlp_tp1_gaf": (1, lambda: build_mlp(1, False, True), None),
    "mlp_tp2": (2, lambda: build_mlp(2, False, False), None),
    "mlp_tp2_gaf": (2, lambda: build_mlp(2, False, True), None),
    "mlp_tp2_sp": (2, lambda: build_mlp(2, True, False), None),
    "mlp_tp2_sp_gaf": (2, lambda: build_mlp(2, True, True), None),
    "reuse_tp2": (2, lambda: build_reuse(2, False), None),
    "reuse_tp2_gaf": (2, lambda: build_reuse(2, True), None),
    "gpt_tp1": (1, lambda: build_gpt(1, False, False), None),
    "gpt_tp2": (2, lambda: build_gpt(2, False, False), None),
    "gpt_tp2_sp_midstage": (2, lambda: build_gpt(2, True, False, pre_process=False), None),
    "gpt_tp1_midstage": (1, lambda: build_gpt(1, False, False, pre_process=False), None),
    "gpt_dp2_ddp": (1, lambda: build_gpt(1, False, False, ddp=False), False),
    "gpt_dp2_ddp_overlap": (1, lambda: build_gpt(1, False, False, ddp=True), True),
    "gpt_dp2_ddp_gaf": (1, lambda: build_gpt(1, False, True, ddp=False), False),
    "gpt_dp2_ddp_overlap_gaf": (1, lambda: build_gpt(1, False, True, ddp=True), True),
    "gpt_tp2_sp_ddp_overlap_gaf": (2, lambda: build_gpt(2, True, True, ddp=True), True),
    "gpt_tp2_sp_midstage_ddp_overlap": (2, lambda: build_gpt(2, True, False, pre_process=False,
                                                             ddp=True), True),
}


def rank_case(name):
    """One case on this rank (the process group is up): its result, with megatron-core's version
    and file. tests/test_wgrad.py runs every case this way on the ranks of one verify launch, forked
    from the warm zygote server (megatron imported once); ``main`` on processes of its own."""
    tp, build, ddp = CASES[name]
    t0 = time.time()
    try:
        init_tp(tp)
        r = check_case(name, build, ddp)
        r["ok"] = True
    except Exception:  # report, keep going (a collective mismatch would hang: none here)
        r = {"ok": False, "error": traceback.format_exc()}
    r["seconds"] = round(time.time() - t0, 3)
    r.update(mcore_version=megatron.core.__version__, mcore_file=megatron.core.__file__)
    return r


def main():
    out_dir, names = sys.argv[1], sys.argv[2:]
    if DEV.type == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if DEV.type == "cuda" else "gloo")
    rank = torch.distributed.get_rank()
    results = {"mcore_version": megatron.core.__version__, "mcore_file": megatron.core.__file__,
               "device": str(DEV), "torch": torch.__version__, "cases": {}}
    for name in names:
        results["cases"][name] = rank_case(name)
        torch.distributed.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
