"""The verification harness: does a schedule train exactly like non-pipelined Megatron?

* ``launch``  — runs a function on N real torch.distributed processes (gloo), never hanging.
* ``tinygpt`` — the tiny real megatron-core GPT, its synthetic data, loss, gradient collection.
* ``harness`` — verification cases: the single-process reference, the pipelined run through
  ``megatron_zb.megatron.install``, the comparison.
* ``command`` — ``megatron-zb verify``.

Tests and benchmarks import their helpers from here; the product's Megatron adapters live in
``megatron_zb.megatron`` and never import this package.
"""
from .harness import (DEFAULT_GRAD_RTOL, DEFAULT_LOSS_ATOL, PSEUDO_SCHEDULES, SequentialForwardBackward, VerifyCase,
                      VerifyUsageError, compare, make_case, run_verify, run_verify_many)
from .command import main_verify

__all__ = ["VerifyCase", "VerifyUsageError", "make_case", "run_verify", "run_verify_many", "compare", "main_verify",
           "PSEUDO_SCHEDULES", "DEFAULT_GRAD_RTOL", "DEFAULT_LOSS_ATOL", "SequentialForwardBackward"]
