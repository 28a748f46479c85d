"""One gloo transport device for all of a process's gloo groups.

torch gives every gloo process group a transport device of its own, and each device runs a thread
that wakes from ``epoll_wait`` a hundred times a second whether or not anything is sent. Megatron
creates a few dozen groups per rank (tensor, pipeline, data, context, expert, embedding, and their
combinations), megatron-zb a few more, so a CPU rank's idle wake-ups cost more than its messages:
measured on this 2-core box, the ``gloo_tcp_loop`` threads took 29% of all CPU samples of
``tests/test_postval_megatron.py`` (mostly in the kernel), and more when the box is busy.

``apply()`` makes every gloo group created from then on in this process (``torch.distributed``'s
``new_group`` / ``init_process_group``) share one device: one loop thread, the same transport
(TCP on the default interface, or each of ``GLOO_SOCKET_IFNAME``'s), the same messages. A group
created with explicit options keeps them. A device made before a fork is not used after it (its
thread is not in the child): the child makes its own.

Applied in verify's ranks (``verify.processes.zygote``), which end with ``os._exit``. Not in training ranks,
which end through the interpreter's clean-up: one torchrun job of the test suite's (fork/vocab,
Megatron's own 1F1B) ended with "terminate called without an active exception" (SIGABRT) after
training had finished, once in four full runs, and the shared device's tear-down is the suspect.
"""
from __future__ import annotations

import datetime
import os

__all__ = ["apply"]


def apply() -> None:
    """Share one gloo device between the process groups created from now on (idempotent)."""
    import torch.distributed.distributed_c10d as c10d
    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or getattr(base, "mzb_shared_device", False):
        return

    class SharedDeviceGloo(base):
        """torch's ProcessGroupGloo on this process's one device (``megatron.cpu.gloo_device``)."""
        mzb_shared_device = True
        devices: list = []  # made by the first group, in the process that uses them
        pid = 0  # that process: a forked child makes its own (the parent's loop thread is not in it)

        def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
            if isinstance(timeout, base._Options):  # the caller's own options
                super().__init__(store, rank, size, timeout)
                return
            if not SharedDeviceGloo.devices or SharedDeviceGloo.pid != os.getpid():
                names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
                SharedDeviceGloo.devices = [base.create_device(interface=n) for n in names] or \
                    [base.create_default_device()]
                SharedDeviceGloo.pid = os.getpid()
            opts = base._Options()
            opts._devices = SharedDeviceGloo.devices
            opts._threads = 2 * len(SharedDeviceGloo.devices)  # torch's own choice per group
            opts._timeout = timeout
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = SharedDeviceGloo
