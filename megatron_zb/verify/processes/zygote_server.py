"""A warm zygote for many launches (``verify.processes.launch``): one process imports torch, applies the CPU
shims and imports megatron-core once, then forks each launch's zygote (``verify.processes.zygote``) when
asked, so a launch pays no import of its own (about 2.5 CPU seconds each on a 2-core box). The test
suite starts one per pytest process that runs multi-process tests (``tests/conftest.py``) and names
its socket in ``$MZB_ZYGOTE_SERVER``; a launch that finds it there asks it first.

    python -m megatron_zb.verify.processes.zygote_server SOCKET PARENT_PID [MEGATRON_CORE_DIR [CPU_SHIMS]]

(``CPU_SHIMS`` 0: a server that imports torch alone, for launches without the shims.)

One JSON line each way on a Unix socket; the connection stays open for the launch:

* request ``{"workdir", "env", "sys_path", "mcore_path", "cpu_shims", "backend", "package", "python"}``;
* reply ``{"pid": zygote}``, or ``{"refused": why}`` where this server's imports are not what the
  launch needs (another megatron-core, another megatron-zb checkout or Python, the CUDA backend, no
  CPU shims, or an ``MZB_*``/torch/CUDA variable set otherwise): the launch starts its own zygote.

The zygote runs in its own session with the launch's environment, its output in the launch
folder's ``zygote.log``, and dies with the server; the server writes its exit code into
``<workdir>/zexit`` when it reaps it. The launch's connection closing while its zygote runs (the
launcher died) kills the zygote's session, its ranks with it. The server is a child subreaper,
reaps whatever comes back to it, and dies with ``PARENT_PID``.
"""
from __future__ import annotations

import gc
import json
import os
import select
import socket
import subprocess
import sys
import time
from typing import Dict, Optional, Tuple

from ...runtime.supervise import become_subreaper, die_with_parent
from .rankio import read_int, repo_root
from .zygote import import_runtime, kill_group, zygote_main

__all__ = ["serve", "ask_server", "ServedZygote", "import_env", "exit_file", "request_fields", "ENV_NAME"]

ENV_NAME = "MZB_ZYGOTE_SERVER"  # the server's socket, for the launches of this process and its children

#: environment variables a warm import may depend on: a launch that sets one otherwise is refused
_IMPORT_ENV = ("MZB_", "TORCH_", "PYTORCH_", "CUDA_VISIBLE_DEVICES", "NVTE_", "MEGATRON", "OMP_", "MKL_")
_PER_LAUNCH = ("MZB_LAUNCHER_PID", ENV_NAME)


def import_env(env: Dict[str, str]) -> Dict[str, str]:
    """The part of ``env`` a warm import may depend on (``_IMPORT_ENV``, but the per-launch names)."""
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_ENV) and k not in _PER_LAUNCH}


def exit_file(workdir: str) -> str:
    return os.path.join(workdir, "zexit")


def request_fields(mcore_path: Optional[str]) -> dict:
    """What a request must match in this process (the server's own, or a launcher's)."""
    return {"mcore_path": mcore_path or None, "package": repo_root(), "python": os.path.realpath(sys.executable)}


# --------------------------------------------------------------------------------------------
# the launcher's side
# --------------------------------------------------------------------------------------------

class ServedZygote:
    """A zygote the server forked, for the launcher: ``pid``, ``poll()``, ``wait(timeout)`` and
    ``returncode`` as a ``subprocess.Popen``'s (its exit code from ``zexit``; -1 where the server
    died first); ``close()`` ends the connection (the server then kills it if it still runs)."""

    def __init__(self, conn: socket.socket, pid: int, workdir: str):
        self.conn, self.pid, self.workdir, self.returncode = conn, pid, workdir, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = read_int(exit_file(self.workdir))
        if self.returncode is None and not self._server_alive():
            self.returncode = read_int(exit_file(self.workdir))
            if self.returncode is None:
                self.returncode = -1
        return self.returncode

    def _server_alive(self) -> bool:
        try:
            return self.conn.recv(1, socket.MSG_PEEK) != b""  # non-blocking: nothing to read yet
        except BlockingIOError:
            return True
        except OSError:
            return False

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def close(self) -> None:
        self.conn.close()


def ask_server(workdir: str, env: Dict[str, str], header: dict, timeout: float) -> Optional[ServedZygote]:
    """The zygote of a server ``env[ENV_NAME]`` names (sockets separated by ``os.pathsep``: the
    first that serves), forked for this launch, or None (none named, none answering, every one
    refused: the launch starts its own)."""
    req = dict(request_fields(header["mcore_path"]), workdir=workdir, env=env, backend=header["backend"],
               cpu_shims=header["cpu_shims"], sys_path=header["sys_path"])
    for path in (env.get(ENV_NAME) or "").split(os.pathsep):
        if path:
            served = _ask(path, req, timeout)
            if served is not None:
                return served
    return None


def _ask(path: str, req: dict, timeout: float) -> Optional[ServedZygote]:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)  # the server may still be importing
        conn.connect(path)
        conn.sendall(json.dumps(req).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            data = conn.recv(1 << 16)
            if not data:
                raise OSError("the server closed the connection")
            reply += data
        msg = json.loads(reply)
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in msg:
        conn.close()
        return None
    conn.setblocking(False)  # from now on only asked whether the server closed it
    return ServedZygote(conn, int(msg["pid"]), req["workdir"])


# --------------------------------------------------------------------------------------------
# the server's side
# --------------------------------------------------------------------------------------------

def _refusal(req: dict, own: dict) -> Optional[str]:
    if req.get("backend") != "gloo":
        return f"backend {req.get('backend')!r} (the server is warm for gloo)"
    if bool(req.get("cpu_shims")) != own["cpu_shims"]:
        return "a launch " + ("without" if own["cpu_shims"] else "with") + " the CPU shims (the server's imports are " + \
            ("torch, the shims and megatron-core)" if own["cpu_shims"] else "torch alone)")
    env = own["env"]
    for k, v in own.items():
        if k not in ("env", "cpu_shims") and req.get(k) != v:
            return f"{k} {req.get(k)!r} (the server's: {v!r})"
    theirs = import_env(req.get("env") or {})
    if theirs != env:
        diff = sorted(k for k in set(theirs) | set(env) if theirs.get(k) != env.get(k))
        return f"environment variable(s) {', '.join(diff)} set otherwise than in the server"
    return None


def serve(path: str, parent: int, mcore_path: Optional[str], cpu_shims: bool = True) -> None:
    """Listen on ``path``; import (torch, and with ``cpu_shims`` the shims and megatron-core, as a
    zygote does); fork a zygote for each request it can serve (never returns)."""
    die_with_parent(parent)
    become_subreaper()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # a launch may connect while the imports run: it waits for its reply
    import_runtime({"cpu_shims": cpu_shims})
    gc.freeze()  # the imports' objects: no zygote's or rank's collection traverses (copies) their pages
    own = dict(request_fields(mcore_path), env=import_env(dict(os.environ)), cpu_shims=cpu_shims)
    conns: Dict[socket.socket, bytes] = {}  # connection -> what it sent so far
    answered = set()  # connections whose request was answered
    launches: Dict[int, Tuple[socket.socket, str]] = {}  # zygote pid -> (its connection, its folder)
    while True:
        ready, _, _ = select.select([listener, *conns], [], [], 0.1)
        for s in ready:
            if s is listener:
                conn, _ = listener.accept()
                conns[conn] = b""
                continue
            data = s.recv(1 << 16)
            if data and s not in answered:
                conns[s] += data
                if b"\n" in conns[s]:
                    answered.add(s)
                    started = _start(conns[s], s, [listener, *conns], own)
                    if started is not None:
                        launches[started[0]] = (s, started[1])
                continue
            if data:  # nothing more is asked on a connection: ignore it
                continue
            # the connection ended: the launcher is done with its zygote, or died
            for pid, (c, _) in list(launches.items()):
                if c is s:
                    kill_group(pid)
            del conns[s]
            answered.discard(s)
            s.close()
        _reap(launches)


def _start(line: bytes, conn: socket.socket, sockets: list, own: dict) -> Optional[Tuple[int, str]]:
    """Answer one request: fork its zygote (returning its pid and the launch's folder) or refuse it
    (None). ``sockets``: the server's, which the zygote closes."""
    try:
        req = json.loads(line)
        why = _refusal(req, own)
    except ValueError as e:
        req, why = {}, f"a request that is not JSON ({e})"
    if why is not None:
        print(f"refused {req.get('workdir')}: {why}", flush=True)  # the server's log
        _reply(conn, {"refused": why})
        return None
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        _zygote_child(req, server, sockets)  # never returns
    print(f"zygote {pid} for {req['workdir']}", flush=True)
    _reply(conn, {"pid": pid})  # a launcher already gone: its connection's end kills the zygote
    return pid, req["workdir"]


def _reply(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


def _zygote_child(req: dict, server: int, sockets) -> None:
    try:
        for s in sockets:  # only the server holds the launches' connections (their end means: kill)
            s.close()
        os.setsid()
        workdir = req["workdir"]
        log = os.open(os.path.join(workdir, "zygote.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        zygote_main(workdir, parent=server)
    finally:
        os._exit(1)


def _reap(launches: Dict[int, Tuple[socket.socket, str]]) -> None:
    """Reap every child that ended (zygotes: their exit code into ``zexit``; orphans: nothing)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        launch = launches.pop(pid, None)
        if launch is not None:
            kill_group(pid)  # whatever the zygote left in its session
            path = exit_file(launch[1])
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)
            except OSError:  # the launch's folder is gone: its launcher no longer asks
                pass


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None,
          cpu_shims=sys.argv[4] != "0" if len(sys.argv) > 4 else True)
