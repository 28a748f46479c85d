"""Installing megatron-zb from Megatron's parsed arguments, for a user's own Megatron-LM training
script (the patches under ``patches/``): validate the flags (``megatron.launch.flags``), preview the
schedule (``megatron.execution.options``), install it (``megatron.install``)."""
from __future__ import annotations

from .flags import validate_zero_bubble_args
from ..execution.options import ScheduleOptions, preview

__all__ = ["install_from_args", "install_on_first_use"]


def install_from_args(args):
    """Validate megatron-zb's flags on Megatron's parsed-and-validated ``args`` and install the schedule.

    For a Megatron-LM ``pretrain_gpt.py`` (0.18+) right after ``parse_and_validate_args``: returns the
    ``InstallHandle`` (None without zero-bubble flags). The model layout stays Megatron's, so V
    schedules and ``--allow-padding-num-layers`` are refused here with a pointer to megatron-zb's
    entry point. The schedule is generated once now (with Megatron's microbatch count), so an
    impossible memory limit fails before training.
    """
    kwargs = validate_zero_bubble_args(args, before_megatron_validation=False)
    if kwargs is None:
        return None
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        preview(ScheduleOptions(**kwargs), int(args.pipeline_model_parallel_size), int(get_num_microbatches()))
    except (ImportError, AssertionError, AttributeError):
        pass  # no microbatch calculator yet: the schedule is checked at the first iteration
    from ..install import install
    kwargs = dict(kwargs)
    return install(kwargs.pop("schedule"), **kwargs)


def install_on_first_use():
    """Install the schedule the flags select when Megatron's training loop first asks for one.

    For Megatron-LM scripts whose ``pretrain()`` parses the arguments itself (megatron-core <= 0.17:
    ``pretrain(..., extra_args_provider=chain_providers(..., add_zero_bubble_args))``): call this
    before ``pretrain()``. It wraps ``megatron.training.training.get_forward_backward_func``; the
    first call reads Megatron's global args, validates megatron-zb's flags and installs the schedule
    (or leaves Megatron's schedules when no zero-bubble flag was given). Returns a function that
    undoes the wrapping.
    """
    import megatron.training.training as T
    original = T.get_forward_backward_func
    state = {"handle": None, "done": False}

    def get_forward_backward_func(*a, **k):
        if not state["done"]:
            from megatron.training import get_args
            state["done"] = True
            state["handle"] = install_from_args(get_args())  # rebinds T.get_forward_backward_func
        current = T.get_forward_backward_func
        if current is not get_forward_backward_func:
            return current(*a, **k)
        if state["handle"] is not None:  # installed; this name was ours, so install() left it: ask its own
            import megatron.core.pipeline_parallel as mpp
            return mpp.get_forward_backward_func(*a, **k)
        return original(*a, **k)
    get_forward_backward_func.__wrapped__ = original
    T.get_forward_backward_func = get_forward_backward_func

    def undo():
        if state["handle"] is not None:
            state["handle"].uninstall()
        if T.get_forward_backward_func is get_forward_backward_func:
            T.get_forward_backward_func = original
    return undo
