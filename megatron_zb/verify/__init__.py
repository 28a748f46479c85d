"""The verification harness: does a schedule train exactly like non-pipelined Megatron?

* ``launch``  — runs a function on N real torch.distributed processes (gloo), never hanging.
* ``tinygpt`` — the tiny real megatron-core GPT, its synthetic data, loss, gradient collection.
* ``case`` — a verification case: its options, checks and defaults.
* ``harness`` — runs cases (one launch) and compares each with its reference; ``rank`` is what
  every process runs: the single-process reference and the pipelined run through
  ``megatron_zb.megatron.install``; ``optimizer_cases`` the same with Megatron's optimizer;
  ``sequential`` a naive pipelined executor for any placement.
* ``command`` — ``megatron-zb verify``.

Tests and benchmarks import their helpers from here; the product's Megatron adapters live in
``megatron_zb.megatron`` and never import this package.
"""
from .case import DEFAULT_GRAD_RTOL, DEFAULT_LOSS_ATOL, PSEUDO_SCHEDULES, VerifyCase, VerifyUsageError, make_case
from .command import main_verify
from .harness import compare, run_verify, run_verify_many
from .model.sequential import SequentialForwardBackward

__all__ = ["VerifyCase", "VerifyUsageError", "make_case", "run_verify", "run_verify_many", "compare", "main_verify",
           "PSEUDO_SCHEDULES", "DEFAULT_GRAD_RTOL", "DEFAULT_LOSS_ATOL", "SequentialForwardBackward"]
