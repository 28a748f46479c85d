"""Use a megatron-zb schedule inside your own megatron-core training loop.

The only change to a Megatron training script is the ``install`` call: megatron's
``get_forward_backward_func()`` then returns our schedule runner (same keyword signature).
Run under torchrun with a pipeline-parallel megatron setup, e.g.

    torchrun --nproc-per-node 2 examples/megatron_training_loop.py

On a CPU-only machine it uses gloo and megatron_zb.megatron.cpu.cpu_shims; it trains the tiny GPT that
``megatron-zb verify`` uses, for a few iterations, and prints the loss.
"""
import os

import torch
import torch.distributed as dist

from megatron_zb.megatron.cpu import cpu_shims

cpu_shims.apply()  # no-op when CUDA is present

import megatron.core.pipeline_parallel as mpp  # noqa: E402

from megatron_zb.megatron.execution import finalize  # noqa: E402
from megatron_zb.megatron.layout import placement as P  # noqa: E402
from megatron_zb.verify.model import tinygpt as M  # noqa: E402
from megatron_zb.megatron.install import install  # noqa: E402

SCHEDULE = os.environ.get("SCHEDULE", "zb-h1")


def main():
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    pp = dist.get_world_size()
    handle = install(SCHEDULE)  # the one line a Megatron script needs
    fb = handle.forward_backward
    placement = P.make_placement("v" if SCHEDULE in ("zb-v", "v-half", "v-min", "v-auto", "dualpipe-v") else "single", pp)
    M.init_parallel_state(1, pp, placement)
    cfg = M.TinyGPTConfig(num_layers=2 * placement.num_stages)
    chunks = M.build_model_chunks(cfg, placement)
    finalize.configure_grad_sync(chunks[0].config, chunks, placement=placement, ddp=False)
    m = 2 * pp
    for it in range(5):
        M.zero_grads_(chunks)
        batches = M.make_batches(cfg, m, it)
        # look the function up through the module (or import it by name after install()):
        # a name imported before install() still points at megatron's own function
        out = mpp.get_forward_backward_func()(
            forward_step_func=M.forward_step_func, data_iterator=M.batch_iterators(batches, len(chunks)),
            model=chunks, num_microbatches=m, seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size)
        M.sgd_step_(chunks, 0.1)
        if out:
            print(f"[{SCHEDULE}] iteration {it}: loss {M.iteration_loss(out):.4f}")
    assert fb.last_schedule is not None
    handle.uninstall()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
