"""Runtime features on top of a schedule, each behind a narrow interface: activation offload,
optimizer post-validation, optimizer states on the host, the EP all-to-all overlap, vocabulary parallelism, variable-length batches,
core attention through torch's scaled_dot_product_attention (--attention-backend flash/fused without Transformer Engine),
recompute per model chunk."""
