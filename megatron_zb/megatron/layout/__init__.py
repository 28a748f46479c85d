"""The model's layout over the pipeline: which layers and stages each rank and chunk holds (V and
replicated placements, Megatron's layout flags), where microbatches and losses go, checkpoints that
know their placement."""
