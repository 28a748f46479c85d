"""A TCP port for a test's rendezvous (torchrun's MASTER_PORT, a TCPStore) that nothing else takes
in the meantime. A port the OS hands out for ``bind(0)`` is from its ephemeral range, where any
process's next connection or ``bind(0)`` may take it before our server listens (the two test
passes of ``scripts/run_tests.sh`` run side by side and open many sockets); a port below that
range is only ever taken on purpose, so a random free one there is safe."""
from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    hi = min(_ephemeral_low(), 32768)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in 20000..{hi - 1}")
