"""CPU start-up without megatron-core's import-time ``torch.compile`` (part of ``cpu_shims.apply()``).

megatron-core decorates functions with ``torch.compile`` when its modules are imported: the fusable
ones (bias+GeLU/SwiGLU/GeGLU, bias+dropout+add, ...) through ``megatron.core.jit.jit_fuser``, and
0.19's ``InferenceTopKRouter`` directly. The first decoration loads the inductor backend: about
1.7 CPU seconds of every process that imports megatron-core, a tenth of a tiny CPU training's
start-up, per rank. On a CPU the fusions are off (``launch.startup.machine_adjustments``), so
nothing compiled runs in training. Here, without CUDA, ``jit_fuser`` is Megatron's own
``noop_decorator`` (its ``disable_jit_fuser()``), and while a ``megatron.*`` module is being
imported ``torch.compile`` leaves what it decorates as it is: such functions run eagerly, the same
operations. ``torch.compile`` called at run time is untouched.
"""
from __future__ import annotations

import importlib.abc
import sys

import torch

__all__ = ["apply", "WrappingLoader"]

_JIT = "megatron.core.jit"


def apply() -> None:
    """Call before megatron is imported (modules imported already stay as they are)."""
    if _JIT in sys.modules:
        _disable(sys.modules[_JIT])
    if not any(getattr(f, "_mzb_jit", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _disable(module) -> None:
    disable = getattr(module, "disable_jit_fuser", None)
    if disable is not None:
        disable()


def _no_compile(model=None, **_kwargs):
    """``torch.compile`` as a decorator, with or without arguments, that returns what it decorates."""
    return model if model is not None else (lambda fn: fn)


class WrappingLoader(importlib.abc.Loader):
    """A module's own loader, wrapped: everything but ``exec_module`` (which a subclass gives) is the
    inner loader's (the CPU shims' import hooks: this one's and the triton stand-ins')."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, attr):  # get_source, get_filename, ...: the file's own loader
        return getattr(self.inner, attr)

    def create_module(self, spec):
        return self.inner.create_module(spec) if hasattr(self.inner, "create_module") else None


class _Loader(WrappingLoader):
    def exec_module(self, module):
        compile_fn, torch.compile = torch.compile, _no_compile
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = compile_fn
        if module.__name__ == _JIT:
            _disable(module)


class _Finder(importlib.abc.MetaPathFinder):
    _mzb_jit = True

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("megatron."):
            return None
        for finder in sys.meta_path:  # whoever else would load it (the triton stand-in's finder included)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None
