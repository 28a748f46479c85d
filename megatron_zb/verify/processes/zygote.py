"""The ranks' side of a launch (``verify.processes.launch``): the zygote imports torch and megatron once,
forks one process per rank and reaps them and whatever they leave behind; each rank joins the
process group, runs the cases and writes its result (``verify.processes.rankio``).

    python -m megatron_zb.verify.processes.zygote <launch folder>
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Optional

from ...runtime.supervise import become_subreaper, reap_orphans
from .rankio import attach_status, get_status, result_file, set_status, td, write_int, write_result

__all__ = ["zygote_main", "import_runtime", "kill_group"]

_PRELOAD = ("megatron.core.models.gpt", "megatron.core.pipeline_parallel.schedules",
            "megatron.core.distributed", "megatron.core.optimizer")


def zygote_main(workdir: str, parent: Optional[int] = None) -> None:
    """Import once, fork every rank, reap them (writing ``pid<r>`` and ``exit<r>`` files).
    ``parent``: the warm server that forked this zygote (``verify.processes.zygote_server``; imports done),
    else the launcher started it (``$MZB_LAUNCHER_PID``)."""
    body, world_size = None, 0
    try:
        from ...runtime.supervise import die_with_parent
        if parent is None and os.environ.get("MZB_LAUNCHER_PID"):
            parent = int(os.environ["MZB_LAUNCHER_PID"])
        if parent is not None:  # no unsupervised ranks: die with the launcher (or the server)
            die_with_parent(parent)
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            header = pickle.load(f)
            world_size = header["world_size"]
            for p in reversed(header["sys_path"]):
                if p in sys.path:
                    sys.path.remove(p)
                sys.path.insert(0, p)
            warm = header["backend"] == "gloo"
            if warm:
                import_runtime(header)
                body = pickle.load(f)
                if body.get("precheck") is not None:  # e.g. a model config Megatron refuses: before any fork
                    body["precheck"](body["cases"])
        gc.freeze()  # what is here now: no rank's collection traverses (and so copies) its pages again
        become_subreaper()  # orphans of the ranks (megatron's helpers) come back here to be reaped
        pids = {}
        zygote = os.getpid()
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                die_with_parent(zygote)  # the zygote dies with the launcher, the ranks with the zygote
                _rank_main(workdir, rank, header, body)  # never returns
            pids[pid] = rank
            write_int(os.path.join(workdir, f"pid{rank}"), pid)
        while pids:
            pid, status = os.wait()
            if pid in pids:
                kill_group(pid)  # whatever the rank left in its process group
                write_int(os.path.join(workdir, f"exit{pids.pop(pid)}"), os.waitstatus_to_exitcode(status))
        reap_orphans()
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - the ranks report the zygote's failure as theirs
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        sys.stderr.flush()
        for r in range(world_size):
            if not os.path.exists(result_file(workdir, r)):
                write_result(workdir, r, {"ok": False, "case": None, "exc_type": type(e).__name__,
                                           "message": f"before the rank started: {e}", "traceback": tb,
                                           "time": time.time(), "status": "starting"})
        os._exit(1)


def kill_group(pgid: int) -> None:
    """SIGKILL to the process group (session) ``pgid``; nothing where it is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_own_children() -> None:
    """In a rank about to end: stop megatron's checkpoint-writer Manager and any multiprocessing
    child still running (``os._exit`` skips the interpreter's own clean-up of both)."""
    if "megatron.core" in sys.modules:
        try:
            from ...megatron.launch.shutdown import stop_checkpoint_writer
            stop_checkpoint_writer()
        except Exception:  # noqa: BLE001 - the zygote kills what is left
            pass
    mp = sys.modules.get("multiprocessing")
    if mp is None:
        return
    try:
        children = mp.active_children()
    except Exception:  # noqa: BLE001
        return
    for c in children:
        c.terminate()
    for c in children:
        c.join(2)
        if c.is_alive():
            c.kill()
            c.join(1)


def import_runtime(header: dict) -> None:
    """torch with one thread, the CPU shims (no CUDA), and the megatron-core modules ranks use
    (without the cyclic garbage collector meanwhile: imports make no cycles worth its passes)."""
    was = gc.isenabled()
    gc.disable()
    try:
        _imports(header)
    finally:
        if was:
            gc.enable()


def _imports(header: dict) -> None:
    import importlib
    set_status("starting: importing torch")
    import torch
    torch.set_num_threads(1)
    if header.get("cpu_shims", True):
        set_status("starting: applying CPU shims / importing megatron")
        from megatron_zb.megatron.cpu import cpu_shims, gloo_device
        cpu_shims.apply()
        gloo_device.apply()  # the ranks end with os._exit: the shared device is never torn down
        for name in _PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the rank that needs it reports the error
                pass


def _rank_main(workdir: str, rank: int, header: dict, body: Optional[dict]) -> None:
    case_index = None
    try:
        os.setsid()
        log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
        import faulthandler
        faulthandler.enable()
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, ValueError):  # pragma: no cover
            pass
        attach_status(workdir, rank)
        if body is None:  # not warm: this rank imports for itself
            import_runtime(header)
            with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
                pickle.load(f)
                set_status("starting: loading the payload")
                body = pickle.load(f)
        import torch
        import torch.distributed as dist
        ws, timeout = header["world_size"], body["timeout"]
        set_status("starting: joining the process group")
        store = dist.TCPStore("127.0.0.1", body["port"], ws + 1, False, timeout=td(timeout + 30))
        backend = header["backend"]
        if backend == "nccl":  # pragma: no cover - GPU machines
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count()))
        dist.init_process_group(backend, store=store, rank=rank, world_size=ws, timeout=td(timeout + 30))
        results = []
        fn = body["fn"]
        for i, case in enumerate(body["cases"]):
            case_index = i
            set_status(f"case {i}: running")
            results.append(fn(case))
            if body.get("barrier_between", True) and ws > 1:
                set_status(f"case {i}: done, waiting for the other ranks (barrier)")
                dist.barrier()
        case_index = None
        set_status("done: writing results")
        write_result(workdir, rank, {"ok": True, "results": results})
        if ws > 1:
            dist.barrier()
        _stop_own_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - report everything, then die without cleanup hangs
        tb = traceback.format_exc()
        try:
            write_result(workdir, rank, {"ok": False, "case": case_index, "exc_type": type(e).__name__,
                                          "message": str(e), "traceback": tb, "time": time.time(),
                                          "status": get_status()})
            _stop_own_children()
        finally:
            sys.stderr.write(tb)
            sys.stderr.flush()
            os._exit(1)


if __name__ == "__main__":
    zygote_main(sys.argv[1])
