"""Per-rank progress, readable without the rank's help, and naming the rank that stopped first.

When one rank of a pipeline stops (SIGSTOP, a crash, a pass that hangs), every other rank ends
up waiting for a message from its own neighbour, so a timeout message that names "the peer I
waited for" blames a healthy rank. This module lets a rank that times out name the right one:

* **Publishing.** Each rank that runs a megatron-zb schedule keeps what it runs now, what it
  finished last and which message it waits for in plain attributes (the executor and the p2p
  layer set them: no I/O on the hot path). A daemon thread copies them, with a heartbeat
  counter, into the job's key-value store every ``PERIOD_S`` seconds: torch.distributed's
  default ``TCPStore`` (under torchrun the agent hosts it; in ``megatron_zb.verify.processes.launch`` the
  launching process does), through a connection of its own. A rank that stops stops publishing,
  and its last record stays readable.
* **Diagnosing.** ``Progress.diagnose`` (called by a rank whose wait timed out) reads the records
  of its pipeline group twice, ``CHECK_S`` apart. Ranks whose heartbeat did not move are not
  responding (stopped, dead, or hung holding the interpreter); the one whose last heartbeat is
  oldest stopped first. If every rank responds, it follows "rank a waits for rank b" from the
  waiting rank to the first rank that is not waiting for a pipeline message (stuck in a pass, a
  collective or data loading), or finds a cycle (a deadlock: a schedule bug).
* **Outside the schedule** (``enable_stall_watch``, the training entry point turns it on): a rank
  stopped between iterations leaves the others blocked in Megatron's collectives (optimizer,
  loss and gradient reductions), which wait for ``--distributed-timeout-minutes``, not for our
  timeout. With the stall watch on, the publishing thread also checks that the rank has not
  spent more than the timeout outside the schedule's actions; if it has, it diagnoses as above,
  prints one line and ends the process.
* **Checkpoint saves** (``saving``): a save may take long, so while one runs the watch counts
  bytes written (by this process and its children, e.g. Megatron's asynchronous checkpoint
  writer) as progress, and a rank past the timeout without writing ends only when another rank
  of its pipeline does not respond (a slow filesystem or a slower peer is not a stuck rank): it
  names that rank and what it was doing ("saving checkpoint iter N") like a stuck pass.
* A culprit found **stopped** (``SIGSTOP``, state ``T``) on this host is killed (``SIGKILL``),
  ``KILL_GRACE_S`` after the diagnosis, from a thread (``finish_kills`` waits for it before the
  process exits; meanwhile the other ranks' timeouts fire and name it too): the
  job is failing anyway, and a stopped process ignores the launcher's ``SIGTERM`` (torchrun
  would wait 30 s before its ``SIGKILL``).

Records are JSON under ``mzb/progress/<restart>/<global rank>`` (``<restart>``: torchrun's
``TORCHELASTIC_RESTART_COUNT``, so an earlier attempt's records are not read).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

from ..hooks import Hook
from .stack_dump import DUMP_AFTER_S, dump_stuck_pass

__all__ = ["Progress", "tracker", "read_records", "diagnose_records", "enable_stall_watch", "pause", "saving",
           "written_bytes", "stop",
           "finish_kills",
           "PERIOD_S", "CHECK_S"]

PERIOD_S = 0.5   # heartbeat period
CHECK_S = 1.2    # a rank whose heartbeat did not move over this long is not responding (> 2 periods)
KILL_GRACE_S = 2.5  # before killing a stopped rank: the other ranks' timeouts fire meanwhile


def _key(global_rank: int) -> str:
    return f"mzb/progress/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{global_rank}"


def _tcp_endpoint(store):
    """(host, port) of the TCPStore under torch's default store (PrefixStores unwrapped), or None."""
    seen = 0
    while store is not None and hasattr(store, "underlying_store") and seen < 8:
        store = store.underlying_store
        seen += 1
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is None or port is None:
        return None
    return host, int(port)


class Progress(Hook):
    """This rank's progress (hot-path attributes) and the thread that publishes it. As an executor
    hook (``runtime.hooks``) it hears every action's begin and end."""

    def __init__(self, global_rank: int, endpoint, period_s: float = PERIOD_S):
        self.rank = int(global_rank)
        self.endpoint = endpoint
        self.period_s = period_s
        self.pp_rank: Optional[int] = None
        self.iteration = 0
        self.current = None          # the action running now (an Action, or text)
        self.current_t = 0.0
        self.last_done = None        # the last finished action
        self.last_done_t = 0.0
        self.wait = None             # (what, peer pipeline rank, peer global rank, since)
        self._seq = 0
        self._lock = threading.Lock()
        self._client = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._host = socket.gethostname()
        self.group: Sequence[int] = ()  # global ranks of this rank's pipeline group
        self.paused: Optional[str] = None  # the stall watch is off meanwhile
        self.saving: Optional[str] = None  # e.g. "saving checkpoint iter 10": writes count as progress
        self._written = 0
        self.last_activity = time.time()
        self._dumped = 0.0  # the start of the last pass whose stacks were written (stack_dump)

    # -- hot path: attribute writes only ------------------------------------------------------
    def begin(self, action) -> None:
        self.current = action
        self.current_t = self.last_activity = time.time()

    def end(self, action) -> None:
        self.last_done = action
        self.last_done_t = self.last_activity = time.time()
        self.current = None

    def waiting(self, what: str, peer: int, peer_global: int) -> None:
        self.wait = (what, peer, peer_global, time.time())

    def wait_over(self) -> None:
        self.wait = None
        self.last_activity = time.time()

    def pause(self, why: Optional[str]) -> None:
        """Turn the stall watch off while ``why``; ``None``: on again."""
        self.paused = why
        self.last_activity = time.time()

    def save(self, what: Optional[str]) -> None:
        """A checkpoint save begins (``what``, e.g. "saving checkpoint iter 10") or ends (None)."""
        self.saving = what
        self._written = written_bytes()
        self.last_activity = time.time()

    # -- publishing -----------------------------------------------------------------------------
    def record(self) -> dict:
        w = self.wait
        return {"rank": self.rank, "pp": self.pp_rank, "host": self._host, "pid": os.getpid(),
                "seq": self._seq, "hb": time.time(), "it": self.iteration,
                "cur": self.saving if self.current is None and self.saving else
                       (None if self.current is None else str(self.current)), "cur_t": self.current_t,
                "done": None if self.last_done is None else str(self.last_done), "done_t": self.last_done_t,
                "wait": None if w is None else {"what": w[0], "pp": w[1], "rank": w[2], "since": w[3]}}

    def _connect(self):
        import datetime

        import torch.distributed as dist
        host, port = self.endpoint
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))

    def start(self) -> "Progress":
        if self._thread is None:
            self._client = self._connect()
            self.publish()
            self._thread = threading.Thread(target=self._run, name="megatron-zb-progress", daemon=True)
            self._thread.start()
            atexit.register(self.stop)
        return self

    def publish(self) -> None:
        self._seq += 1
        data = json.dumps(self.record())
        with self._lock:
            self._client.set(_key(self.rank), data)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.period_s):
            try:
                self.publish()
                failures = 0
            except Exception:  # noqa: BLE001 - the store is gone (job ending): stop quietly
                failures += 1
                if failures >= 3:
                    return
            if _STALL_S is not None:
                self._check_stall(_STALL_S)
            cur, since, running = self.current, self.current_t, time.time() - self.current_t
            if cur is not None and self.wait is None and since != self._dumped and running > DUMP_AFTER_S:
                self._dumped = since  # once per pass
                dump_stuck_pass(f"pipeline rank {self.pp_rank} (global rank {self.rank})", str(cur), running)

    def _check_stall(self, limit: float) -> None:
        """The stall watch: too long outside the schedule's actions and waits -> diagnose and exit."""
        if self.paused is not None or self.current is not None or self.wait is not None:
            return
        if self.saving is not None:
            written = written_bytes()
            if written != self._written:  # the save is writing: progress
                self._written = written
                self.last_activity = time.time()
                return
        idle = time.time() - self.last_activity
        if idle <= limit:
            return
        who = f"pipeline rank {self.pp_rank} (global rank {self.rank})"
        if self.saving is not None:
            group = self.group or (self.rank,)
            try:
                first = self.read(group)
                time.sleep(CHECK_S)
                second = self.read(group)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            silent = [g for g in group if g != self.rank and
                      (first.get(g) is None or second.get(g) is None or second[g]["seq"] == first[g]["seq"])]
            if not silent:  # every peer responds: a slow filesystem or a slower peer, not a stuck rank
                self.last_activity = time.time()
                return
            blame = diagnose_records(first, second, self.rank, None, kill_stopped=True)
            msg = (f"{who} has been {self.saving} for {idle:.0f}s without writing (iteration {self.iteration}), "
                   f"more than the timeout {limit:g}s; {blame}")
        else:
            after = f"after {self.last_done}" if self.last_done is not None else "before its first pipeline action"
            blame = self.diagnose(self.group or (self.rank,), None)
            msg = (f"{who} spent {idle:.0f}s outside the pipeline schedule ({after} in iteration {self.iteration}: "
                   f"optimizer step, gradient or loss collectives), more than the timeout {limit:g}s; {blame}")
        if _ON_STALL is not None:
            _ON_STALL(msg)
        else:
            try:
                os.write(2, f"megatron-zb: error: {msg}\n".encode())
            except OSError:
                pass
        finish_kills()
        from ..supervise import exit_now
        exit_now(1)

    def stop(self) -> None:
        self._stop.set()

    def read(self, ranks: Sequence[int]) -> Dict[int, Optional[dict]]:
        with self._lock:
            return read_records(self._client, ranks)

    # -- diagnosing -----------------------------------------------------------------------------
    def diagnose(self, group_ranks: Sequence[int], waited_for: Optional[int], check_s: float = CHECK_S) -> str:
        """One sentence naming the rank of ``group_ranks`` (global ranks) that stopped first.

        ``waited_for``: the global rank this rank's timed-out wait was for (None: this rank is
        stuck outside the schedule, e.g. in a collective). Takes ``check_s``
        seconds (two reads of the records).
        """
        try:
            first = self.read(group_ranks)
            time.sleep(check_s)
            second = self.read(group_ranks)
        except Exception as e:  # noqa: BLE001 - diagnosis is best effort; the timeout stands
            return f"that rank is stuck or has failed (progress records unreadable: {type(e).__name__}: {e})"
        return diagnose_records(first, second, self.rank, waited_for, kill_stopped=True)


def read_records(client, ranks: Sequence[int]) -> Dict[int, Optional[dict]]:
    """{global rank: its last record, or None if it never published} (no blocking on absent keys)."""
    out: Dict[int, Optional[dict]] = {}
    for g in ranks:
        k = _key(g)
        if client.check([k]):
            try:
                out[g] = json.loads(client.get(k))
            except ValueError:
                out[g] = None
        else:
            out[g] = None
    return out


def _who(rec: Optional[dict], g: int) -> str:
    if rec is None or rec.get("pp") is None:
        return f"global rank {g}"
    return f"pipeline rank {rec['pp']} (global rank {g}, {rec['host']} pid {rec['pid']})"


def _state(rec: dict, now: float) -> str:
    parts = []
    w = rec.get("wait")
    if w:
        parts.append(f"waiting {now - w['since']:.0f}s for {w['what']} from pipeline rank {w['pp']}")
    elif rec.get("cur"):
        parts.append(f"running {rec['cur']} for {now - rec['cur_t']:.0f}s")
    else:
        parts.append("between pipeline actions (outside the schedule: optimizer, collectives, data)")
    if rec.get("done"):
        parts.append(f"last finished {rec['done']} {now - rec['done_t']:.0f}s ago")
    parts.append(f"iteration {rec.get('it')}")
    return ", ".join(parts)


def _stopped_here(rec: dict) -> bool:
    """The rank runs on this host and is stopped by a signal (state T in /proc)."""
    if rec.get("host") != socket.gethostname():
        return False
    try:
        with open(f"/proc/{int(rec['pid'])}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] == "T"
    except (OSError, ValueError, IndexError):
        return False


_KILLS: List[threading.Thread] = []


def _kill_later(rec: dict) -> None:
    """SIGKILL a stopped rank after KILL_GRACE_S, from a thread: meanwhile this rank reports and the
    other ranks' timeouts fire and name it too (they would see their connections to it close
    instead). A stopped process ignores the launcher's SIGTERM."""
    def run():
        time.sleep(KILL_GRACE_S)
        if _stopped_here(rec):
            try:
                os.kill(int(rec["pid"]), signal.SIGKILL)
            except OSError:
                pass
    t = threading.Thread(target=run, name="megatron-zb-end-stopped-rank", daemon=True)
    t.start()
    _KILLS.append(t)


def finish_kills() -> None:
    """Wait for the pending kills of stopped ranks (call before this process exits)."""
    while _KILLS:
        _KILLS.pop().join()


def diagnose_records(first: Dict[int, Optional[dict]], second: Dict[int, Optional[dict]], me: int,
                     waited_for: Optional[int], kill_stopped: bool = False, now: Optional[float] = None) -> str:
    """Name the rank that stopped progressing first, from two reads of the records (see module doc)."""
    now = time.time() if now is None else now
    silent = [g for g in second if g != me and (second[g] is None or first.get(g) is None
                                                 or second[g]["seq"] == first[g]["seq"])]
    if silent:
        g = min(silent, key=lambda r: second[r]["hb"] if second[r] is not None else float("-inf"))
        rec = second[g]
        if rec is None:
            return (f"the rank that stopped first is global rank {g}: it never published any progress "
                    "(stuck or dead before its first pipeline pass); read its log first")
        text = (f"the rank that stopped progressing first is {_who(rec, g)}: no heartbeat for "
                f"{now - rec['hb']:.0f}s (stopped, dead, or hung holding the interpreter); its last record: "
                f"{_state(rec, rec['hb'])}")
        if kill_stopped and _stopped_here(rec):
            _kill_later(rec)
            text += f"; it is stopped (SIGSTOP): megatron-zb ends it in {KILL_GRACE_S:g}s so that the job can end"
        return text + "; read its log first"
    if waited_for is None:  # this rank waits outside the schedule (a collective): who is still inside?
        inside = [g for g, rec in sorted(second.items()) if g != me and rec and (rec.get("wait") or rec.get("cur"))]
        if not inside:
            return ("every rank of this pipeline responds and is outside the schedule too: the collective may be "
                    "waiting for a rank of another pipeline (data parallelism) or for a slow step")
        return "ranks still inside the pipeline schedule: " + "; ".join(
            f"{_who(second[g], g)}: {_state(second[g], now)}" for g in inside)
    # every rank responds: follow who waits for whom
    chain = [me]
    cur = waited_for
    while True:
        rec = second.get(cur)
        if rec is None:
            return f"global rank {cur} is not in this pipeline's progress records"
        if cur in chain:
            loop = " -> ".join(_who(second.get(r), r) for r in chain[chain.index(cur):] + [cur])
            return f"the ranks wait for each other in a cycle (a deadlock, a schedule bug): {loop}"
        w = rec.get("wait")
        if not w:
            via = "" if cur == waited_for else \
                " (reached through " + " -> ".join(_who(second.get(r), r) for r in chain[1:] + [cur]) + ")"
            return (f"the rank that stopped progressing first is {_who(rec, cur)}{via}: it responds but is not "
                    f"waiting for a pipeline message: {_state(rec, now)}; read its log first")
        chain.append(cur)
        cur = w["rank"]


# --------------------------------------------------------------------------------------------
# the process's tracker
# --------------------------------------------------------------------------------------------

_TRACKER: Optional[Progress] = None
_DISABLED = False
_STALL_S: Optional[float] = None
_ON_STALL = None


def enable_stall_watch(seconds: Optional[float], on_stall=None) -> None:
    """Let this process's tracker end the process when it spends more than ``seconds`` outside the
    schedule's actions (see the module doc). ``on_stall(message)`` reports the line (default:
    stderr) before the process exits with status 1; ``None`` seconds turns the watch off."""
    global _STALL_S, _ON_STALL
    _STALL_S = None if seconds is None else float(seconds)
    _ON_STALL = on_stall


def pause(why: Optional[str]) -> None:
    """``tracker().pause(why)`` if this process has a tracker."""
    if _TRACKER is not None:
        _TRACKER.pause(why)


def saving(what: Optional[str]) -> None:
    """``tracker().save(what)`` if this process has a tracker: a checkpoint save begins or ends."""
    if _TRACKER is not None:
        _TRACKER.save(what)


def written_bytes() -> int:
    """Bytes this process and its children have written so far (Linux ``/proc/<pid>/io``; 0 elsewhere)."""
    me = os.getpid()
    pids = [me]
    try:
        for e in os.listdir("/proc"):
            if e.isdigit():
                try:
                    with open(f"/proc/{e}/stat") as f:
                        stat = f.read()
                    if int(stat[stat.rfind(")") + 2:].split()[1]) == me:
                        pids.append(int(e))
                except (OSError, ValueError, IndexError):
                    continue
    except OSError:
        return 0
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as f:
                for line in f:
                    if line.startswith("write_bytes:"):
                        total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total


def stop() -> None:
    """Stop this process's tracker (the end of training: nothing is watched any more)."""
    enable_stall_watch(None)
    if _TRACKER is not None:
        _TRACKER.stop()


def tracker(pp_rank: Optional[int] = None, group: Optional[Sequence[int]] = None) -> Optional[Progress]:
    """This process's ``Progress`` (started on first use), or None when torch.distributed has no
    TCPStore to publish to (or ``MZB_PROGRESS=0``). ``pp_rank``: this rank's pipeline rank."""
    global _TRACKER, _DISABLED
    if _TRACKER is not None and _TRACKER._stop.is_set() is False:
        if pp_rank is not None:
            _TRACKER.pp_rank = pp_rank
        if group is not None:
            _TRACKER.group = tuple(group)
        return _TRACKER
    if _DISABLED or os.environ.get("MZB_PROGRESS", "1") == "0":
        return None
    try:
        import torch.distributed as dist
        if not dist.is_initialized():
            return None
        endpoint = _tcp_endpoint(dist.distributed_c10d._get_default_store())
        if endpoint is None:
            _DISABLED = True
            return None
        prog = Progress(dist.get_rank(), endpoint)
        prog.pp_rank = pp_rank
        prog.group = tuple(group or ())
        _TRACKER = prog.start()
    except Exception:  # noqa: BLE001 - progress is a diagnostic; never fail training for it
        _DISABLED = True
        return None
    return _TRACKER


def group_summary(records: Dict[int, Optional[dict]], now: Optional[float] = None) -> List[str]:
    """One line per rank (for a launcher's timeout report)."""
    now = time.time() if now is None else now
    lines = []
    for g in sorted(records):
        rec = records[g]
        if rec is None:
            lines.append(f"global rank {g}: no progress published")
        else:
            lines.append(f"{_who(rec, g)}: heartbeat {now - rec['hb']:.0f}s ago; {_state(rec, now)}")
    return lines
