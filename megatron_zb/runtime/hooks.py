"""The one way runtime features attach to the executor: a ``Hook`` subclass per feature.

The executor (``runtime.executor``) walks a rank's lowered action list and calls every hook it was
given at these points, in the order the hooks were given (context managers nest: the first hook's
is the outermost):

==========================  ===============================================================
``prepare(actions)``        the rank's list is about to run (once per ``execute``)
``begin(a)`` / ``end(a)``   around every action (progress: what the rank runs, what it finished)
``wait(what)``              context around waiting for a received tensor (``what`` names it,
                            e.g. "the input of F3.1"): the receive's posting and its wait
``compute(a, inputs)``      context around the computation of a pass (F, B, BW, W), after its
                            inputs arrived; ``inputs`` are the stage's input tensors
``handlers()``              the action kinds the feature runs itself (kind -> handler): they join
                            the executor's dispatch table (offload's OFFLOAD / RELOAD / ..._W)
``validate()``              once, right before the rank's first backward; False drains the rest
                            of the iteration (messages still flow, nothing is computed)
``before_last_backward(s)`` right before the last B/BW of stage ``s`` (its gradients' last pass
                            that depends on the next stage: data-parallel sync windows open)
``after_last_backward(s)``  after the last pass (B, BW or W) that touches stage ``s``'s weight
                            gradients (their sync may start)
``finish(completed)``       the list ran to its end; ``completed`` is False after a drain
==========================  ===============================================================

Features that use them: progress (``runtime.observe.progress``: begin/end), activation offload
(``runtime.features.offload.OffloadHook``: prepare/compute/handlers/finish), optimizer post-validation
(``runtime.features.postval.ValidationPoint``: validate), the profiler (``runtime.observe.profiler``: wait/compute),
pass timing (``PassTimes`` below), gradient synchronisation (Megatron's DDP and replicated stages,
``megatron.execution.gradsync``: before/after_last_backward) and optimizer states visiting the GPU in
the troughs (``runtime.features.optim_trough.TroughHook``: begin/end at its plan's passes).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Optional, Sequence

__all__ = ["Hook", "Hooks", "PassTimes"]


class Hook:
    """A runtime feature at the executor's points; override what the feature needs."""

    def prepare(self, actions) -> None:
        pass

    def begin(self, action) -> None:
        pass

    def end(self, action) -> None:
        pass

    def wait(self, what: str):
        return None  # a context manager, or None

    def compute(self, action, inputs):
        return None  # a context manager, or None

    def handlers(self) -> dict:
        """The action kinds this feature runs itself: kind -> handler(run, action, position)
        (``runtime.executor``'s dispatch table takes them; activation offload's OFFLOAD/RELOAD)."""
        return {}

    def validate(self) -> bool:
        return True

    def before_last_backward(self, stage: int) -> None:
        pass

    def after_last_backward(self, stage: int) -> None:
        pass

    def finish(self, completed: bool) -> None:
        pass


def _overrides(h: Hook, name: str) -> bool:
    return getattr(type(h), name) is not getattr(Hook, name)


class Hooks:
    """The hooks of one ``execute`` call, fanned out per point (only to the hooks that override
    it, so an absent feature costs nothing on the hot path)."""

    def __init__(self, hooks: Sequence[Optional[Hook]] = ()):
        self.all: List[Hook] = [h for h in hooks if h is not None]
        self._by = {name: [h for h in self.all if _overrides(h, name)]
                    for name in ("prepare", "begin", "end", "wait", "compute", "validate",
                                 "before_last_backward", "after_last_backward", "finish")}

    def has(self, name: str) -> bool:
        return bool(self._by[name])

    def prepare(self, actions) -> None:
        for h in self._by["prepare"]:
            h.prepare(actions)

    def begin(self, action) -> None:
        for h in self._by["begin"]:
            h.begin(action)

    def end(self, action) -> None:
        for h in self._by["end"]:
            h.end(action)

    def wait(self, what: str):
        return self._nest([h.wait(what) for h in self._by["wait"]])

    def compute(self, action, inputs):
        return self._nest([h.compute(action, inputs) for h in self._by["compute"]])

    def handlers(self) -> dict:
        """Every hook's own action kinds (``Hook.handlers``); a kind two hooks claim is refused."""
        out: dict = {}
        for h in self.all:
            for kind, fn in h.handlers().items():
                if kind in out:
                    raise RuntimeError(f"two runtime features run {kind} actions")
                out[kind] = fn
        return out

    def validate(self) -> bool:
        ok = True
        for h in self._by["validate"]:
            ok = h.validate() and ok
        return ok

    def before_last_backward(self, stage: int) -> None:
        for h in self._by["before_last_backward"]:
            h.before_last_backward(stage)

    def after_last_backward(self, stage: int) -> None:
        for h in self._by["after_last_backward"]:
            h.after_last_backward(stage)

    def finish(self, completed: bool) -> None:
        for h in self._by["finish"]:
            h.finish(completed)

    @staticmethod
    def _nest(cms):
        cms = [c for c in cms if c is not None]
        if not cms:
            return contextlib.nullcontext()
        if len(cms) == 1:
            return cms[0]
        stack = contextlib.ExitStack()
        for c in cms:
            stack.enter_context(c)
        return stack


class PassTimes(Hook):
    """Calls ``record(kind, stage, mb, seconds)`` after every compute pass (wall time of the pass
    itself, waits for its inputs excluded)."""

    def __init__(self, record: Callable[[str, int, int, float], None]):
        self.record = record

    @contextlib.contextmanager
    def compute(self, action, inputs):
        t0 = time.perf_counter()
        yield
        self.record(action.kind, action.stage, action.mb, time.perf_counter() - t0)
