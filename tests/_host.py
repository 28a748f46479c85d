"""How busy the test machine is, for the few timing bounds in the suite (a timeout fires, a hang
is named: bounds that are the point of their test; everything else compares no times)."""
import os


def runnable_now() -> int:
    """Processes runnable right now (the 4th field of /proc/loadavg, this one excluded): it sees a
    load that began a few seconds ago, which the 1-minute average shows only a minute later."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return 0


def overload() -> float:
    """How much busier than its cores the host is (>= 1): the larger of the 1-minute load average
    and the processes runnable now, over the core count. A timing bound that a scheduling delay can
    break stretches by it."""
    return max(1.0, max(os.getloadavg()[0], runnable_now()) / (os.cpu_count() or 1))
