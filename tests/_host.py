"""How busy the test machine is, for the few timing bounds in the suite."""
import os


def overload() -> float:
    """How much busier than its cores the host is (>= 1; the 1-minute load average over the core
    count): a timing bound that a scheduling delay can break stretches by it."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
