"""Functions the harness tests run inside launched ranks (module-level, so ranks can import them)."""
from __future__ import annotations

import os
import time


# -- launcher checks (no megatron) -------------------------------------------------------------

def allreduce_rank(case):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank()) + case["add"]])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t), "pid": os.getpid(),
            "tensor": torch.arange(3, dtype=torch.bfloat16) * dist.get_rank(),
            "threads": torch.get_num_threads()}


def raise_on_rank1_in_case1(case):
    import torch.distributed as dist
    if case == 1 and dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()
    return case


def hang_on_rank1(case):
    import torch
    import torch.distributed as dist
    from megatron_zb.verify.processes.launch import set_status
    if dist.get_rank() == 1:
        set_status("waiting RECV_F stage 1 mb 0 from rank 0")
        t = torch.zeros(1)
        dist.recv(t, src=0)  # rank 0 never sends
    return "unreachable for rank 1"


def sleep_then_return(case):
    time.sleep(case)
    return case


# -- placement checks (megatron, one process) ----------------------------------------------------

def _run_stages(M, stages, batches):
    """Run the stages in pipeline order in this process, forward then backward, per microbatch."""
    losses = []
    n = len(batches)
    for mb in batches:
        x = None
        for s, m in enumerate(stages):
            if s > 0:
                x = x.detach().requires_grad_(True)
                inputs_grad_holder = x
                m.set_input_tensor(x)
            out, loss_fn = M.forward_step_func(iter([mb]), m)
            if s > 0:
                m._mzb_in = inputs_grad_holder
            m._mzb_out = out
            x = out
        sum_loss, ntok, _ = loss_fn(out)
        losses.append((float(sum_loss), int(ntok)))
        loss = sum_loss / ntok / n
        loss.backward()
        # the backward went through detached boundaries: push grads stage by stage
        for s in range(len(stages) - 1, 0, -1):
            g = stages[s]._mzb_in.grad
            stages[s - 1]._mzb_out.backward(g)
    return losses


def placement_report(case):
    """Build every rank's chunks of several placements in one process and compare with the
    reference: layer assignment, megatron layer numbers, initial weights, gradients."""
    import torch
    from megatron.core import parallel_state
    from megatron_zb.megatron.execution import finalize as F
    from megatron_zb.megatron.layout import placement as P
    from megatron_zb.verify.model import tinygpt as M

    out = {"megatron_version": M.megatron_version(), "placements": []}
    specs = [
        dict(style="v", p=2, num_layers=4),
        dict(style="v", p=4, num_layers=8),
        dict(style="v", p=2, num_layers=6, allow_padding_num_layers=True),
        dict(style="v", p=2, num_layers=4, tie_embeddings=False),
        dict(style="looped", p=2, chunks=3, num_layers=9, layers_per_stage=[1, 2, 2, 1, 2, 1]),
    ]
    for spec in specs:
        cfg = M.TinyGPTConfig(num_layers=spec["num_layers"], tie_embeddings=spec.get("tie_embeddings", True))
        M.init_parallel_state(1, 1)
        ref = M.build_reference_model(cfg)
        batches = M.make_batches(cfg, 3, 0)
        ref_params = {p.mzb_global_name: p.detach().clone() for p in ref.parameters()}
        ref_losses = []
        for mb in batches:
            o, lf = M.forward_step_func(iter([mb]), ref)
            sl, nt, _ = lf(o)
            ref_losses.append((float(sl), int(nt)))
            (sl / nt / len(batches)).backward()
        ref_grads = {p.mzb_global_name: p.grad.detach().clone() for p in ref.parameters()}

        pl = P.make_placement(spec["style"], spec["p"], spec.get("chunks"))
        by_stage = {}
        chunks_of_rank = {}
        for r in range(pl.num_ranks):
            chunks = M.build_model_chunks(cfg, pl, M.ChunkOptions(
                pp_rank=r, layers_per_stage=spec.get("layers_per_stage"),
                allow_padding_num_layers=spec.get("allow_padding_num_layers", False)))
            chunks_of_rank[r] = chunks
            for c in chunks:
                by_stage[c.mzb_chunk_info.stage] = c
        stages = [by_stage[s] for s in range(pl.num_stages)]
        info = []
        for s, m in enumerate(stages):
            i = m.mzb_chunk_info
            info.append({"stage": s, "rank": i.rank, "vp_stage": i.vp_stage, "pre": i.pre_process,
                         "post": i.post_process, "layers": list(i.layers),
                         "layer_numbers": [int(l.layer_number) for l in m.decoder.layers],
                         "has_embedding": hasattr(m, "embedding"),
                         "has_output_layer": hasattr(m, "output_layer"),
                         "has_final_norm": getattr(m.decoder, "final_layernorm", None) is not None,
                         "params": sorted({p.mzb_global_name for p in m.parameters()})})
        init_diff = 0.0
        for m in stages:
            for p in m.parameters():
                init_diff = max(init_diff, float((p.detach() - ref_params[p.mzb_global_name]).abs().max()))
        losses = _run_stages(M, stages, batches)
        # what finalize does on each rank: sum the tied copies it holds (both on rank 0 for V)
        for r, chunks in chunks_of_rank.items():
            F.sum_local_tied_copies(chunks)
        if not P.embedding_and_loss_on_one_rank(pl):
            # copies on different ranks: the embedding group's all-reduce, done by hand here
            copies = F.tied_embedding_copies(stages)
            if len(copies) == 2:
                total = copies[0].grad + copies[1].grad
                for p in copies:
                    p.grad = total.clone()
        got = M.collect_full_grads(stages)
        worst = 0.0
        for name, copies in got.items():
            for g in copies:
                d = float((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30))
                worst = max(worst, d)
        out["placements"].append({
            "spec": spec, "stage_to_rank": list(pl.stage_to_rank), "stages": info,
            "init_max_abs_diff": init_diff, "max_rel_grad_diff": worst,
            "missing": sorted(set(ref_grads) - set(got)), "extra": sorted(set(got) - set(ref_grads)),
            "copies": {k: len(v) for k, v in got.items() if len(v) > 1},
            "losses": losses, "ref_losses": ref_losses,
        })
    # configs not built by megatron-zb fall through to megatron's own layer offsets
    import megatron.core.transformer.transformer_layer as tl
    import megatron.core.transformer.transformer_block as tb
    from megatron.core.transformer.transformer_config import TransformerConfig
    plain = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=4,
                              pipeline_dtype=torch.float32,
                              use_cpu_initialization=True)
    out["fallthrough"] = {
        "wrapped": bool(getattr(tl.get_transformer_layer_offset, "_mzb_wrapped", False)),
        "offsets": [tl.get_transformer_layer_offset(plain, None, r) for r in range(4)],
        "counts": [tb.get_num_layers_to_build(plain, None, r) for r in range(4)],
    }
    parallel_state.destroy_model_parallel()
    return out


# -- the install() path of the verifier, with a stand-in install module ---------------------------

_STUB_CALLS = []


def _stub_install(schedule, *, chunks=None, memory_limit=None, **options):
    """Stands in for megatron_zb.megatron.install.install: patches megatron's
    get_forward_backward_func to return the harness's sequential executor on the schedule's
    placement (from the schedule core)."""
    import megatron.core.pipeline_parallel as mpp
    from megatron.core import parallel_state
    from megatron_zb.verify.case import schedule_placement
    from megatron_zb.verify.model.sequential import SequentialForwardBackward
    from megatron_zb.megatron.execution import finalize as F
    from megatron_zb.megatron.layout import placement as P
    from megatron_zb.verify.model import tinygpt as M

    p = parallel_state.get_pipeline_model_parallel_world_size()
    style, c = schedule_placement(schedule, chunks)
    placement = P.make_placement(style, p, c)
    orig = mpp.get_forward_backward_func
    mpp.get_forward_backward_func = lambda *a, **k: SequentialForwardBackward(placement)
    _STUB_CALLS.append([schedule, chunks, memory_limit, sorted(options)])

    class Handle:
        def uninstall(self):
            mpp.get_forward_backward_func = orig
            _STUB_CALLS.append("uninstall")
    return Handle()


def rank_case_with_stub_install(case):
    import sys
    import types
    mod = types.ModuleType("megatron_zb.megatron.install")
    mod.install = _stub_install
    sys.modules["megatron_zb.megatron.install"] = mod
    from megatron_zb.verify.model.rank import rank_case
    del _STUB_CALLS[:]
    r = rank_case(case)
    r["stub_calls"] = list(_STUB_CALLS)
    return r


# -- replicated stages (runtime/features/replica.py, install's first-call check) -------------------------

def replica_sync_and_check(case):
    """Two ranks, each holding one copy of logical stages 0 and 1: the gradient all-reduce sums
    copies (whatever order the ranks start them in); replicas with different weights are refused."""
    import torch
    import torch.distributed as dist
    from megatron_zb.core.ir import Placement
    from megatron_zb.megatron.errors import ZeroBubbleConfigError
    from megatron_zb.megatron.layout.routing import check_replicas_equal
    from megatron_zb.runtime.features.replica import ReplicaGradSync, ReplicaGroups
    me = dist.get_rank()
    pl = Placement.bitpipe(2)
    groups = ReplicaGroups([0, 1], {l: [pl.rank_of(pl.path(k)[l]) for k in range(2)] for l in range(4)})
    sync = ReplicaGradSync(groups, timeout_s=60)
    grads = {l: torch.full((3,), float(10 * l + me + 1)) for l in range(4)}
    for l in (range(4) if me == 0 else reversed(range(4))):  # opposite orders on the two ranks
        sync.start(l, [grads[l]])
    sync.finish()
    out = {"sums": {l: grads[l].tolist() for l in range(4)}}
    stages = pl.stages_of(me)
    models = [torch.nn.Linear(2, 2) for _ in stages]
    for mdl in models:
        with torch.no_grad():
            for prm in mdl.parameters():
                prm.fill_(0.5 + (case == "differ" and me == 1 and mdl is models[0]))
    try:
        check_replicas_equal(models, stages, pl, groups)
        out["check"] = "ok"
    except ZeroBubbleConfigError as e:
        out["check"] = str(e)
    return out
