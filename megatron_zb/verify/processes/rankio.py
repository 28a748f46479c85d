"""What a launch (``verify.processes.launch``) and its ranks (``verify.processes.zygote``) exchange through the launch's
folder: each rank's status text (a small mmap'd file, written by ``set_status`` from rank code),
its pid and exit code (written by the zygote), its result or error (pickled, tensors as numpy
arrays) and its log."""
from __future__ import annotations

import mmap
import os
import pickle
import sys
import time
import traceback
from typing import Optional

__all__ = ["set_status", "get_status", "attach_status", "STATUS_BYTES", "status_file", "result_file", "read_status",
           "log_tail", "load_result", "write_result", "read_int", "write_int", "td", "TensorPickler", "repo_root"]

STATUS_BYTES = 4096
_status_map: Optional[mmap.mmap] = None  # this rank's status file, once attached (one per process)
_status_text = ""


def set_status(text: str) -> None:
    """Record what this rank is doing now (shown if the launch times out). No-op outside a launch."""
    global _status_text
    _status_text = text
    m = _status_map
    if m is None:
        return
    data = text.encode("utf-8", "replace")[: STATUS_BYTES - 1]
    m[: len(data)] = data
    m[len(data)] = 0


def get_status() -> str:
    return _status_text


def attach_status(workdir: str, rank: int) -> None:
    """In a rank: ``set_status`` writes into this rank's status file from now on."""
    global _status_map
    fd = os.open(status_file(workdir, rank), os.O_RDWR)
    _status_map = mmap.mmap(fd, STATUS_BYTES)
    os.close(fd)


def repo_root() -> str:
    """The directory holding the ``megatron_zb`` package (the repository root in a checkout)."""
    import megatron_zb
    return os.path.dirname(os.path.dirname(os.path.abspath(megatron_zb.__file__)))


def td(seconds: float):
    from datetime import timedelta
    return timedelta(seconds=max(1.0, float(seconds)))


def status_file(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"status{r}.bin")


def result_file(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"result{r}.pkl")


def read_status(workdir: str, r: int) -> str:
    try:
        with open(status_file(workdir, r), "rb") as f:
            data = f.read(STATUS_BYTES)
        return data.split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return ""


def log_tail(workdir: str, r: int, n: int = 60) -> str:
    try:
        with open(os.path.join(workdir, f"rank{r}.log"), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        keep = [l for l in lines if "UserWarning" not in l and not l.strip().startswith("warnings.warn")]
        return "\n".join(keep[-n:])
    except OSError:
        return ""


def load_result(workdir: str, r: int):
    path = result_file(workdir, r)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def write_int(path: str, value: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)


def _rebuild_tensor(array, dtype_name: str):
    import torch
    t = torch.from_numpy(array)
    if dtype_name in _VIEW_DTYPES:
        t = t.view(getattr(torch, dtype_name))
    return t


_VIEW_DTYPES = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


class TensorPickler(pickle.Pickler):
    """Pickles torch tensors as numpy arrays: megatron-core >= 0.19 replaces
    ``torch.storage._load_from_bytes`` with its own function, so a plainly pickled tensor would
    only unpickle where that same megatron is imported."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            name = str(t.dtype).replace("torch.", "")
            if name in _VIEW_DTYPES:
                t = t.view(getattr(torch, _VIEW_DTYPES[name]))
            return _rebuild_tensor, (t.numpy().copy(), name)
        return NotImplemented


def write_result(workdir: str, rank: int, obj) -> None:
    tmp = result_file(workdir, rank) + ".tmp"
    with open(tmp, "wb") as f:
        try:
            TensorPickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as e:  # an unpicklable result is the rank's error
            f.seek(0)
            f.truncate()
            pickle.dump({"ok": False, "case": None, "exc_type": type(e).__name__,
                         "message": f"result not picklable: {e}", "traceback": traceback.format_exc(),
                         "time": time.time()}, f)
    os.replace(tmp, result_file(workdir, rank))
