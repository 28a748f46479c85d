"""Each feature's training flags: how they parse, what they refuse in one line and what they give the
schedule (``attention``: Megatron's --attention-backend without TE; ``balance``: variable-length
batches; ``recompute``: --zero-bubble-recompute-num-layers; ``vocab``: vocabulary parallelism)."""
