"""Optimizer post-validation inside Megatron's training loop (``megatron.training``): the patches
our entry point applies (``features.optimizer`` is the optimizer side)."""
from __future__ import annotations

from typing import Callable

__all__ = ["FORK_MIN_CLEAN_STEPS", "patch_megatron_training"]

FORK_MIN_CLEAN_STEPS = 10  # the authors' fork steps synchronously until 10 steps in a row were not clipped


def patch_megatron_training(handle, *, min_clean_steps: int = FORK_MIN_CLEAN_STEPS) -> Callable[[], None]:
    """Wire post-validation into ``megatron.training.training`` (our entry point calls it):

    * ``setup_model_and_optimizer``: Megatron's optimizer gets post-validation attached, with its
      learning-rate scheduler (steps stay synchronous until ``min_clean_steps`` in a row were
      neither clipped nor skipped, and again after each rollback: the fork's rule);
    * ``logical_and_across_model_parallel_group`` / ``reduce_max_stat_across_model_parallel_group``:
      ``train_step`` all-reduces the step's success and grad norm, and ``training_log`` the learning
      rate, over the model-parallel group, pipeline ranks included, right after the step: a barrier
      that would undo post-validation. Every rank holds the same values here (the validated ones),
      so these reductions return the local value;
    * ``save_checkpoint``: the last step is validated (and if needed redone) before saving.

    Returns a function that undoes the patches."""
    import megatron.training.training as T
    saved = []

    def patch(name, fn):
        if hasattr(T, name):
            saved.append((name, getattr(T, name)))
            setattr(T, name, fn)

    orig_setup = T.setup_model_and_optimizer
    state = {"validator": None}

    def setup_model_and_optimizer(*a, **k):
        model, optimizer, scheduler = orig_setup(*a, **k)
        if optimizer is not None:
            v = handle.post_validated_optimizer(optimizer, model if isinstance(model, list) else [model],
                                                min_clean_steps=min_clean_steps)
            v.attach_scheduler(scheduler)
            state["validator"] = v
        return model, optimizer, scheduler

    def logical_and_across_model_parallel_group(input, group=None):
        return bool(input)

    def reduce_max_stat_across_model_parallel_group(stat, group=None):
        return None if stat is None else float(stat)

    orig_save = getattr(T, "save_checkpoint", None)

    def save_checkpoint(*a, **k):
        if state["validator"] is not None:
            state["validator"].finish()
        return orig_save(*a, **k)

    patch("setup_model_and_optimizer", setup_model_and_optimizer)
    patch("logical_and_across_model_parallel_group", logical_and_across_model_parallel_group)
    patch("reduce_max_stat_across_model_parallel_group", reduce_max_stat_across_model_parallel_group)
    if orig_save is not None:
        patch("save_checkpoint", save_checkpoint)

    def undo():
        for name, fn in reversed(saved):
            setattr(T, name, fn)
        saved.clear()
    undo.state = state
    return undo
