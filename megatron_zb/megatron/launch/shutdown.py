"""Stop the helper processes megatron-core starts and does not stop itself.

megatron-core's checkpoint writer (``dist_checkpointing``'s ``FileSystemWriterAsync``, used by the
``torch_dist`` save strategy, synchronous saves included) keeps its results queue in a
``multiprocessing`` *spawn* ``Manager``: a separate Python process (about 270 MB) plus a resource
tracker, created on the first save and kept in a module global. Python stops it at a normal
interpreter exit, but a process that ends with ``os._exit`` (forked ranks, some launchers) leaves
both behind, one pair per rank and launch. :func:`stop_checkpoint_writer` shuts that Manager down
and forgets the queue (the next save starts a new one). It imports nothing new: if megatron's
module was never imported, there is nothing to stop.
"""
from __future__ import annotations

import sys

__all__ = ["stop_checkpoint_writer"]

_MODULES = ("megatron.core.dist_checkpointing.strategies.filesystem_async",
            "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")


def stop_checkpoint_writer() -> int:
    """Shut down the checkpoint writer's results-queue Manager(s); returns how many were stopped."""
    stopped = 0
    for name in _MODULES:
        mod = sys.modules.get(name)
        queue = getattr(mod, "_results_queue", None) if mod is not None else None
        if queue is None:
            continue
        mod._results_queue = None
        manager = getattr(queue, "_manager", None)  # a proxy keeps the Manager that made it
        if manager is not None and getattr(manager, "_process", None) is not None:
            try:
                manager.shutdown()
                stopped += 1
            except Exception:  # noqa: BLE001 - already gone
                pass
    return stopped
