"""What tests/test_recompute_chunks.py runs inside a launched rank (module-level, so ranks can import it)."""
from __future__ import annotations


def layer_calls_report(case):
    """Every rank's chunks of a placement built in this one process, each chunk with its own recompute
    count (verify's tiny GPT, ``ChunkOptions.recompute_layers``), run stage by stage forward and
    backward on one microbatch: how often each decoder layer's forward ran (twice: recomputed in B),
    what each chunk's block says it recomputes, and the gradients against the same chunks without."""
    import torch
    from megatron_zb.megatron.features.recompute import recomputed_layers
    from megatron_zb.megatron.layout import placement as P
    from megatron_zb.verify.model import tinygpt as M

    style, p, chunks, num_layers, counts = case
    cfg = M.TinyGPTConfig(num_layers=num_layers)
    M.init_parallel_state(1, 1)
    pl = P.make_placement(style, p, chunks)
    batch = M.make_batches(cfg, 1, 0)[0]

    def run(recompute):
        by_stage = {}
        for r in range(pl.num_ranks):
            # Megatron's full recompute on the shared config, as verify's run gives it; each chunk its own count
            for c in M.build_model_chunks(cfg, pl, M.ChunkOptions(pp_rank=r, recompute_layers=recompute),
                                          **({"recompute_granularity": "full", "recompute_method": "block",
                                              "recompute_num_layers": 1} if recompute else {})):
                by_stage[c.mzb_chunk_info.stage] = c
        stages = [by_stage[s] for s in range(pl.num_stages)]
        calls = {}
        for s, m in enumerate(stages):
            for layer in m.decoder.layers:
                key = int(layer.layer_number) - 1
                calls[key] = 0
                layer.register_forward_hook(lambda mod, i, o, key=key: calls.__setitem__(key, calls[key] + 1))
        x, ins, outs = None, [], []
        for s, m in enumerate(stages):
            if s > 0:
                x = x.detach().requires_grad_(True)
                m.set_input_tensor(x)
            ins.append(x)
            x, loss_fn = M.forward_step_func(iter([batch]), m)
            outs.append(x)
        sum_loss, ntok, _ = loss_fn(x)
        (sum_loss / ntok).backward()
        for s in range(len(stages) - 1, 0, -1):  # across the detached boundaries, stage by stage
            outs[s - 1].backward(ins[s].grad)
        grads = {q.mzb_global_name: q.grad.detach().clone() for m in stages for q in m.parameters()
                 if q.grad is not None}
        return stages, calls, grads

    stages, calls, grads = run(list(counts))
    _, plain_calls, plain_grads = run(None)
    worst = max(float((grads[k] - g).abs().max()) for k, g in plain_grads.items())
    return {"megatron_version": M.megatron_version(),
            "chunks": [{"stage": m.mzb_chunk_info.stage, "layers": list(m.mzb_chunk_info.layers),
                        "recomputed": recomputed_layers(m), "shares_config": m.decoder.config is m.config}
                       for m in stages],
            "calls": calls, "plain_calls": plain_calls, "max_abs_grad_diff": worst,
            "same_params": sorted(grads) == sorted(plain_grads)}
