"""Adjustments that make stock megatron-core run on a CPU-only torch with gloo (tests, CPU boxes)."""
