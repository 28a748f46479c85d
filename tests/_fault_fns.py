"""Rank code for tests/test_faults.py (module-level, so launched ranks can import it)."""
from __future__ import annotations

import os
import signal
import threading
import time


def _stop_me(stop_file, delay):
    time.sleep(delay)
    with open(stop_file, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def stop_one_rank(case):
    """Train a tiny GPT with a megatron-zb schedule; ``case['stop_rank']`` stops itself (SIGSTOP)
    at iteration ``case['stop_at']``; every other rank records its PipelineTimeout message in
    ``case['out']/rank<r>.txt`` (with the seconds from the stop to the error) and re-raises."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import megatron_zb.megatron.execution.finalize as F
    import megatron_zb.megatron.layout.placement as P
    import megatron_zb.verify.model.tinygpt as M
    from megatron_zb.megatron.install import install

    rank = dist.get_rank()
    placement = P.make_placement(case["placement"], case["pp"], case.get("chunks"))
    M.init_parallel_state(1, case["pp"], placement, seed=1234)
    cfg = M.TinyGPTConfig(num_layers=placement.num_stages)
    chunks = M.build_model_chunks(cfg, placement)
    F.configure_grad_sync(chunks[0].config, chunks, placement=placement, ddp=False)
    handle = install(case["schedule"], chunks=placement.chunks, timeout_s=case["timeout"])
    import megatron.core.pipeline_parallel as mpp
    fb = mpp.get_forward_backward_func()
    stop_file = os.path.join(case["out"], "stopped_at")
    try:
        for it in range(case.get("iterations", 10**6)):
            if it == case["stop_at"]:
                dist.barrier()
                if rank == case["stop_rank"]:  # stop in the middle of an iteration, from a thread
                    threading.Thread(target=_stop_me, args=(stop_file, case.get("stop_delay", 0.0)),
                                     daemon=True).start()
            M.zero_grads_(chunks)
            batches = M.make_batches(cfg, 2 * case["pp"], it)
            try:
                fb(forward_step_func=M.forward_step_func, data_iterator=M.batch_iterators(batches, len(chunks)),
                   model=list(chunks), num_microbatches=2 * case["pp"], seq_length=cfg.seq_length,
                   micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length)
            except Exception as e:
                t = time.time()
                with open(os.path.join(case["out"], f"rank{rank}.txt"), "w") as f:
                    f.write(f"{t}\n{type(e).__name__}: {e}")
                from megatron_zb.runtime.observe.progress import finish_kills
                finish_kills()
                raise
            M.sgd_step_(chunks, 0.1)
    finally:
        handle.uninstall()
    return parallel_state.get_pipeline_model_parallel_rank()


def write_pid_and_sleep(case):
    """Record this rank's pid, then train forever (until killed)."""
    with open(os.path.join(case["out"], f"pid{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)


def stop_outside_schedule(case):
    """Like ``stop_one_rank``, but ``stop_rank`` stops itself between iterations (after its
    forward-backward returned), while the others enter an all-reduce (a collective outside the
    schedule, as Megatron's optimizer step and loss reductions are). The others' stall watch
    (``runtime.observe.progress.enable_stall_watch``) writes its message to ``out/rank<r>.txt`` and ends
    the process."""
    import torch
    import torch.distributed as dist

    import megatron_zb.megatron.execution.finalize as F
    import megatron_zb.megatron.layout.placement as P
    import megatron_zb.verify.model.tinygpt as M
    from megatron_zb.megatron.install import install
    from megatron_zb.runtime.observe import progress

    rank = dist.get_rank()

    def on_stall(message):
        with open(os.path.join(case["out"], f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.time()}\n{message}")

    progress.enable_stall_watch(case["timeout"], on_stall=on_stall)
    placement = P.make_placement(case["placement"], case["pp"], case.get("chunks"))
    M.init_parallel_state(1, case["pp"], placement, seed=1234)
    cfg = M.TinyGPTConfig(num_layers=placement.num_stages)
    chunks = M.build_model_chunks(cfg, placement)
    F.configure_grad_sync(chunks[0].config, chunks, placement=placement, ddp=False)
    install(case["schedule"], chunks=placement.chunks, timeout_s=case["timeout"])
    import megatron.core.pipeline_parallel as mpp
    fb = mpp.get_forward_backward_func()
    for it in range(case["stop_at"] + 1):
        M.zero_grads_(chunks)
        batches = M.make_batches(cfg, 2 * case["pp"], it)
        fb(forward_step_func=M.forward_step_func, data_iterator=M.batch_iterators(batches, len(chunks)),
           model=list(chunks), num_microbatches=2 * case["pp"], seq_length=cfg.seq_length,
           micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length)
    if rank == case["stop_rank"]:
        with open(os.path.join(case["out"], "stopped_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))  # the others wait here for the stopped rank
    time.sleep(60)


def slow_forward_on_one_rank(case):
    """Train; at iteration ``case['slow_at']`` pipeline rank ``case['slow_rank']``'s forward steps
    sleep ``case['sleep']`` seconds each (a rank that responds but does not progress)."""
    import torch.distributed as dist

    import megatron_zb.megatron.execution.finalize as F
    import megatron_zb.megatron.layout.placement as P
    import megatron_zb.verify.model.tinygpt as M
    from megatron_zb.megatron.install import install

    rank = dist.get_rank()
    placement = P.make_placement(case["placement"], case["pp"], case.get("chunks"))
    M.init_parallel_state(1, case["pp"], placement, seed=1234)
    cfg = M.TinyGPTConfig(num_layers=placement.num_stages)
    chunks = M.build_model_chunks(cfg, placement)
    F.configure_grad_sync(chunks[0].config, chunks, placement=placement, ddp=False)
    install(case["schedule"], chunks=placement.chunks, timeout_s=case["timeout"])
    import megatron.core.pipeline_parallel as mpp
    fb = mpp.get_forward_backward_func()
    for it in range(case["slow_at"] + 1):
        slow = it == case["slow_at"] and rank == case["slow_rank"]

        def step(data_iterator, model, slow=slow):
            if slow:
                time.sleep(case["sleep"])
            return M.forward_step_func(data_iterator, model)
        M.zero_grads_(chunks)
        batches = M.make_batches(cfg, 2 * case["pp"], it)
        fb(forward_step_func=step, data_iterator=M.batch_iterators(batches, len(chunks)),
           model=list(chunks), num_microbatches=2 * case["pp"], seq_length=cfg.seq_length,
           micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length)
    return rank


def stop_while_saving(case):
    """Like ``stop_outside_schedule``, but every rank is in a checkpoint save (``progress.saving``)
    when ``stop_rank`` stops; the others wait in a collective inside the save, writing nothing.
    Their stall watch names the stopped rank and what it was doing."""
    import torch
    import torch.distributed as dist

    import megatron_zb.megatron.execution.finalize as F
    import megatron_zb.megatron.layout.placement as P
    import megatron_zb.verify.model.tinygpt as M
    from megatron_zb.megatron.install import install
    from megatron_zb.runtime.observe import progress

    rank = dist.get_rank()

    def on_stall(message):
        with open(os.path.join(case["out"], f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.time()}\n{message}")

    progress.enable_stall_watch(case["timeout"], on_stall=on_stall)
    placement = P.make_placement("single", case["pp"])
    M.init_parallel_state(1, case["pp"], placement, seed=1234)
    cfg = M.TinyGPTConfig(num_layers=placement.num_stages)
    chunks = M.build_model_chunks(cfg, placement)
    F.configure_grad_sync(chunks[0].config, chunks, placement=placement, ddp=False)
    install("1f1b", timeout_s=case["timeout"])
    import megatron.core.pipeline_parallel as mpp
    fb = mpp.get_forward_backward_func()
    batches = M.make_batches(cfg, 2 * case["pp"], 0)
    fb(forward_step_func=M.forward_step_func, data_iterator=M.batch_iterators(batches, len(chunks)),
       model=list(chunks), num_microbatches=2 * case["pp"], seq_length=cfg.seq_length,
       micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length)
    progress.saving("saving checkpoint iter 7")
    if rank == case["stop_rank"]:
        with open(os.path.join(case["out"], "stopped_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))  # the others wait here, inside the "save", for the stopped rank
    time.sleep(60)
