"""The executor's side of activation offload (``runtime.features.offload.OffloadManager`` moves the
bytes): a hook that captures each F's activation, starts the OFFLOAD/RELOAD copies the lowered
schedule asks for (its own action kinds in the executor's dispatch table) and waits for a reload
before the pass that needs it."""
from __future__ import annotations

from typing import Optional

from ...core.ir import BW, OFFLOAD, OFFLOAD_W, RELOAD, RELOAD_W, B, F, W
from ..hooks import Hook
from .offload import OffloadManager

__all__ = ["OffloadHook"]


class OffloadHook(Hook):
    """The executor's side of activation offload: each F runs under ``capture`` (offloaded when
    the list holds its OFFLOAD), OFFLOAD/RELOAD(_W) start the copies, B/BW first ``wait`` for
    their reload and W for its ``reload_w``; at the end the iteration's counts are kept
    (``stats``), or, after a post-validation drain, what is still captured is dropped."""

    def __init__(self, manager: OffloadManager):
        self.manager = manager
        self.offloaded: set = set()
        self.stats: Optional[dict] = None  # the manager's counts of the last completed iteration

    def prepare(self, actions) -> None:
        self.offloaded = {(a.stage, a.mb) for a in actions if a.kind == OFFLOAD}

    def compute(self, a, inputs):
        m = self.manager
        if a.kind == F:
            return m.capture(a.stage, a.mb, (a.stage, a.mb) in self.offloaded, inputs)
        if a.kind in (B, BW):
            m.wait(a.stage, a.mb)
        elif a.kind == W:
            m.wait_w(a.stage, a.mb)
        return None

    def handlers(self) -> dict:  # OFFLOAD / RELOAD / OFFLOAD_W / RELOAD_W start their copies
        m = self.manager
        moves = {OFFLOAD: m.offload, RELOAD: m.reload, OFFLOAD_W: m.offload_w, RELOAD_W: m.reload_w}
        return {kind: (lambda run, a, i, move=move: move(a.stage, a.mb)) for kind, move in moves.items()}

    def finish(self, completed: bool) -> None:
        if completed:
            self.stats = self.manager.end_iteration()
        else:
            self.manager.discard()
