"""Post-validation's cost on one process: a megatron GPT stage (bf16, Megatron's Adam), Megatron's
synchronous step against the post-validated eager step + its validation, and the rollback path.
``tests/test_postval_gpu.py`` and the GPU check (``benchmarks/gpu_check.py``) run it on a GPU; with
``case["device"] = "cpu"`` the same logic runs on a CPU (a smoke check, no figures); with
``case["compare_in_rank"]`` the rank compares the two runs' parameters itself and returns
``bit_identical`` instead of them."""
from __future__ import annotations

__all__ = ["gpu_step_timing"]


def gpu_step_timing(case):
    """One CUDA process: a megatron GPT stage (bf16, Megatron's Adam, clipping), Megatron's
    synchronous step vs the post-validated eager step + validation, and the rollback path; the
    post-validated parameters must equal Megatron's bit for bit."""
    import time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_zb.core.ir import Placement
    from megatron_zb.megatron.features.optimizer import post_validated
    from megatron_zb.megatron.layout import placement as P
    from megatron_zb.runtime.features.postval import PostValidation
    from megatron_zb.verify.model import tinygpt as M

    cuda = case.get("device", "cuda") == "cuda"  # "cpu": the same logic on a CPU (a smoke check)
    cfg = M.TinyGPTConfig(num_layers=case["layers"], hidden_size=case["hidden"], num_attention_heads=16,
                          seq_length=case["seq"], micro_batch_size=1, vocab_size=32000,
                          attention_backend=case.get("attention_backend", "auto"))

    def setup():
        M.init_parallel_state(1, 1)
        chunks = M.build_model_chunks(cfg, Placement.single(1), params_dtype=torch.bfloat16,
                                      pipeline_dtype=torch.bfloat16, bf16=True)
        if cuda:
            chunks = [c.cuda() for c in chunks]
        chunks = P.float16_chunks(chunks[0].config, chunks)
        chunks = M.wrap_ddp(chunks)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=case["clip"], bf16=True,
                                                     params_dtype=torch.bfloat16), chunks,
                                     use_gloo_process_groups=False)
        return chunks, opt

    def grads(chunks, opt, it):
        M.zero_grads_(chunks)
        opt.zero_grad()
        batches = [{k: (v.cuda() if cuda and torch.is_tensor(v) else v) for k, v in b.items()}
                   for b in M.make_batches(cfg, 2, it)]
        forward_backward_no_pipelining(forward_step_func=M.forward_step_func, data_iterator=iter(batches),
                                       model=chunks[0], num_microbatches=2, seq_length=cfg.seq_length,
                                       micro_batch_size=1, decoder_seq_length=cfg.seq_length)

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    results = {}
    for mode in ("megatron", "post-validated"):
        chunks, opt = setup()
        pv = PostValidation(timeout_s=60)
        v = post_validated(opt, chunks, pv, pp_group=parallel_state.get_pipeline_model_parallel_group(),
                           eager_with_one_stage=True, log=lambda m: None) if mode == "post-validated" else None
        times, redo = [], []
        for it in range(case["iterations"]):
            grads(chunks, opt, it)
            if v is None:
                _, t = timed(opt.step)
            else:
                _, t1 = timed(opt.step)  # eager step: the added critical-path work is here
                ok, t2 = timed(pv.validate)  # the validation at the next iteration's first backward
                if not ok:
                    _, t3 = timed(pv.recover)  # rollback + Megatron's own step
                    redo.append(t3)
                t = t1 + t2
            times.append(t)
        params = M.collect_full_grads(chunks, params=True)
        results[mode] = {"times": times, "redo": redo, "params": {k: [x.cpu() for x in vs] for k, vs in params.items()},
                         "rollbacks": v.rollbacks if v else 0}
    dist.barrier()
    if case.get("compare_in_rank"):  # the bit-for-bit verdict instead of every parameter, twice
        meg, pv = results["megatron"].pop("params"), results["post-validated"].pop("params")
        results["bit_identical"] = sorted(meg) == sorted(pv) and all(
            len(meg[k]) == len(pv[k]) and all(torch.equal(a, b) for a, b in zip(meg[k], pv[k])) for k in meg)
    return results
