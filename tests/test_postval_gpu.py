"""On a GPU (skipped without CUDA): the cost of post-validation on a real megatron GPT stage.

Megatron's synchronous step vs the post-validated eager step (local statistics, saved bytes, the
step) plus its validation, and the rollback path (restore + Megatron's own step), with clipping so
that rollbacks happen; the post-validated parameters must equal Megatron's bit for bit. Prints the
times (``pytest -s``). Not run in this project's sessions so far: no GPU was lent to the one that
wrote it."""
from __future__ import annotations

import statistics

import pytest
import torch

from megatron_zb.verify.model.step_timing import gpu_step_timing

pytestmark = [pytest.mark.megatron, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_eager_step_and_rollback_cost_on_one_gpu(rank_pool):
    # clip 0: every step stands (the eager path); clip 1e-3: every step is clipped (the rollback path)
    cases = [{"layers": 4, "hidden": 2048, "seq": 2048, "clip": c, "iterations": 8} for c in (0.0, 1e-3)]
    eager, rollback = [r[0] for r in rank_pool(gpu_step_timing, cases, 1, timeout=900, backend="nccl",
                                               cpu_shims=False)]
    for res in (eager, rollback):
        meg, pv = res["megatron"], res["post-validated"]
        for name, copies in meg["params"].items():
            for a, b in zip(copies, pv["params"][name]):
                assert torch.equal(a, b), name
    assert eager["post-validated"]["rollbacks"] == 0 and rollback["post-validated"]["rollbacks"] == 8
    med = statistics.median
    print(f"\nMegatron step {1e3 * med(eager['megatron']['times'][1:]):.2f} ms; post-validated eager step + "
          f"validation {1e3 * med(eager['post-validated']['times'][1:]):.2f} ms; rollback + redo "
          f"{1e3 * med(rollback['post-validated']['redo'][1:]):.2f} ms")
