"""What a verification rank runs: the tiny GPT, its data, loss and gradients (``tinygpt``), the
reference and the pipelined run through ``install`` (``rank``), the same with Megatron's optimizer
and post-validation (``optimizer_cases``), a naive executor for any placement (``sequential``),
the features' own checks (``feature_checks``), step timings (``step_timing``), offload's measured K
(``offload_auto``)."""
