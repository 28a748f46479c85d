"""Install a megatron-zb schedule as megatron-core's forward-backward function (no fork).

    from megatron_zb.megatron.install import install
    handle = install("zb-h1")            # before megatron's training loop asks for its schedule
    ...                                  # megatron calls get_forward_backward_func() as usual
    handle.uninstall()

``install`` patches ``megatron.core.pipeline_parallel.get_forward_backward_func`` and every loaded
module that imported it by name (``megatron.core.pipeline_parallel.schedules``,
``megatron.training.training``, Megatron-Bridge's ``megatron.bridge.training.train`` and ``.eval``);
modules imported later get ours. With pipeline size 1 Megatron's own no-pipelining function is
returned.

Our forward-backward keeps megatron-core's keyword signature and reuses megatron's own
``forward_step`` / ``backward_step`` (loss scaling, token counts, aux losses); the pipeline order
comes from the schedule core, lowered to SEND/RECV and run by ``runtime.executor``
(``megatron.execution.forward_backward``; the options: ``megatron.execution.options``).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import List, Optional

from .errors import ZeroBubbleConfigError
from .execution.forward_backward import ZeroBubbleForwardBackward
from .execution.options import ScheduleOptions

__all__ = ["install", "InstallHandle", "ZeroBubbleConfigError"]


# -- install / uninstall ---------------------------------------------------------------------

@dataclasses.dataclass
class InstallHandle:
    forward_backward: ZeroBubbleForwardBackward
    _restore: List = dataclasses.field(default_factory=list)

    @property
    def post_validation(self):
        """The pipeline side of optimizer post-validation (``runtime.features.postval.PostValidation``), or
        None when installed without ``post_validation=True``."""
        return self.forward_backward.post_validation

    def post_validated_optimizer(self, optimizer, model_chunks, **kw):
        """Attach optimizer post-validation to Megatron's ``optimizer`` (``megatron.features.optimizer``;
        ``kw``: min_clean_steps, log, pp_group). Returns the ``PostValidator``."""
        if self.post_validation is None:
            raise ZeroBubbleConfigError("post_validated_optimizer() needs install(..., post_validation=True)")
        from .features.optimizer import PostValidationError, post_validated
        try:
            return post_validated(optimizer, model_chunks, self.post_validation, **kw)
        except PostValidationError as e:
            raise ZeroBubbleConfigError(str(e)) from None

    def uninstall(self) -> None:
        for mod, name, old in reversed(self._restore):
            setattr(mod, name, old)
        self._restore.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()


def install(schedule: str, *, chunks: Optional[int] = None, memory_limit: Optional[float] = None,
            **options) -> InstallHandle:
    """Make megatron's ``get_forward_backward_func()`` return a megatron-zb schedule runner.

    Raises ``ZeroBubbleConfigError`` for an unknown schedule or bad options (before anything is
    patched). ``options``: cost_f, cost_b, cost_w, cost_comm, mem_w (schedule tuning),
    timeout_s (how long a rank waits for a message before failing with its rank, pass and peer),
    profile_window=(start, end) and profile_path (``runtime.observe.profiler``: time F/B/W/p2p over those
    training iterations, write the profile JSON; zb-auto*/v-auto* re-plan from it afterwards),
    post_validation=True (optimizer post-validation: then attach it to Megatron's optimizer with
    ``handle.post_validated_optimizer(optimizer, model_chunks)``).
    """
    known = {f.name for f in dataclasses.fields(ScheduleOptions)} - {"schedule", "chunks", "memory_limit"}
    bad = sorted(set(options) - known)
    if bad:
        raise ZeroBubbleConfigError(f"unknown install option(s) {bad}; known: {sorted(known)}")
    fb = ZeroBubbleForwardBackward(ScheduleOptions(schedule, chunks, memory_limit, **options))
    import megatron.core.pipeline_parallel as mpp
    from megatron.core.pipeline_parallel import schedules as S
    original = S.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        pp_size = kwargs.get("pp_size", args[0] if args else None)
        if pp_size is None:
            from megatron.core import parallel_state as ps
            pp_size = ps.get_pipeline_model_parallel_world_size()
        if pp_size is not None and pp_size <= 1:
            return original(*args, **kwargs)
        return fb

    get_forward_backward_func.__wrapped__ = original
    handle = InstallHandle(fb)
    try:
        import megatron.training.training  # noqa: F401 - 0.17+: megatron.training ships in the wheel
    except Exception:
        pass
    # every loaded module that bound Megatron's function by name: megatron.core's own, Megatron-LM's
    # training loop, Megatron-Bridge's train.py / eval.py (``from ... import get_forward_backward_func``)
    for name, mod in [("", mpp), ("", S)] + sorted(sys.modules.items(), key=lambda kv: kv[0]):
        if mod is None or not (mod in (mpp, S) or name.startswith("megatron.")):
            continue
        if getattr(mod, "__dict__", {}).get("get_forward_backward_func") is original:
            handle._restore.append((mod, "get_forward_backward_func", original))
            setattr(mod, "get_forward_backward_func", get_forward_backward_func)
    return handle
