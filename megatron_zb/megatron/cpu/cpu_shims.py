"""Make stock megatron-core run on a CPU-only torch with gloo.

megatron-core hard-codes CUDA in a few places (RNG tracker, ``device="cuda"`` token counters,
p2p receive buffers, DDP streams, optimizer type checks, one unconditional ``import triton``).
``apply()`` patches exactly those, and only when CUDA is absent; on a GPU machine it does nothing.
Used by the tests, ``megatron-zb verify`` and the CPU quickstart. Call it before importing megatron.

Things it does NOT fix (use a supported configuration instead):
* PP=2 with interleaving and ``batch_p2p_comm=True`` silently corrupts gradients in megatron's own
  schedules (a tag-less batched send to the same peer in both directions). Our executor does not use
  that path; megatron's interleaved schedule needs ``overlap_p2p_comm=True, batch_p2p_comm=False``
  (``megatron_zb.megatron.config_checks`` refuses the bad combination).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
import typing

import torch

from . import cpu_jit, cpu_moe

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply(force: bool = False) -> bool:
    """Install every shim when CUDA is absent (or ``force``). Returns True if shims are active."""
    global _APPLIED
    if _APPLIED:
        return True
    if cuda_available() and not force:
        return False
    _typing_override()
    _triton_stub()
    _cuda_api()
    _cuda_factories()
    # before _rng(), which imports megatron: layers.py's fused-wgrad probe and jit_fuser act at import
    _fake_gradient_accumulation_fusion()
    cpu_jit.apply()
    _rng()
    _cuda_streams()
    _cuda_type_names()
    cpu_moe.apply()
    _quiet_logs()
    _APPLIED = True
    return True


def python_compat() -> None:
    """Python 3.11 with megatron-core >= 0.17 (declared for 3.12): ``typing.override``. Safe with or
    without CUDA; ``apply()`` includes it."""
    _typing_override()


def _typing_override():
    # megatron.training uses typing.override (Python 3.12); 3.11 has it in typing_extensions.
    if not hasattr(typing, "override"):
        try:
            from typing_extensions import override
        except ImportError:  # pragma: no cover
            def override(f):
                return f
        typing.override = override


def _triton_stub():
    """Megatron modules that import triton unconditionally (kernels for GPUs: MoE's paged stash in
    >= 0.17, the SSM ops that ``megatron.training`` reaches on ``main``, ...) load as stand-ins
    without triton: importing them works, calling what they define says it needs triton and a GPU.
    Any ``megatron.*`` module whose import fails for want of ``triton`` gets this, so no list of
    module names has to follow Megatron's releases. Never fake ``triton`` itself: torch probes it."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.abc
    import importlib.machinery

    class _StandInLoader(cpu_jit.WrappingLoader):
        def exec_module(self, module):
            try:
                self.inner.exec_module(module)
            except ModuleNotFoundError as e:
                if not (e.name or "").split(".")[0] == "triton":
                    raise
                what = module.__name__

                def _missing(*_a, **_k):
                    raise RuntimeError(f"{what} needs triton and a GPU (this machine has neither)")

                def _getattr(attr):
                    if attr.startswith("__"):
                        raise AttributeError(attr)
                    return _missing
                module.__doc__ = "megatron-zb CPU stand-in: triton is not available on this machine"
                module.__getattr__ = _getattr

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if not name.startswith("megatron."):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
                spec.loader = _StandInLoader(spec.loader)
            return spec

    if not any(type(f).__name__ == "_Finder" and getattr(f, "_mzb", False) for f in sys.meta_path):
        finder = _Finder()
        finder._mzb = True
        sys.meta_path.insert(0, finder)


def _cuda_api():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 0
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):
        return "cpu"
    return device


def _cuda_factories():
    """``device='cuda'`` in tensor factories becomes cpu; ``Tensor.cuda()`` is a no-op."""
    for fname in ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
                  "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor"):
        orig = getattr(torch, fname)
        if getattr(orig, "_mzb_shim", False):
            continue

        def make(orig):
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                return orig(*args, **kwargs)
            factory._mzb_shim = True
            factory.__wrapped__ = orig
            return factory
        setattr(torch, fname, make(orig))

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self
    torch.Tensor.cuda = cuda
    orig_to = torch.Tensor.to
    if not getattr(orig_to, "_mzb_shim", False):
        def to(self, *args, **kwargs):
            args = tuple(_to_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            return orig_to(self, *args, **kwargs)
        to._mzb_shim = True
        torch.Tensor.to = to


def _rng():
    """The model-parallel RNG tracker runs on the CPU default generator."""
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    import importlib
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")

    def _get_state(device=-1, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    random_mod._get_cuda_rng_state = _get_state
    random_mod._set_cuda_rng_state = _set_state


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cuda_streams():
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # megatron's fine-grained schedule plans (--overlap-moe-expert-parallel-comm) mark ranges and
    # hand tensors between streams: both mean nothing on one CPU stream
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None


def _cuda_type_names():
    """megatron's optimizer and grad clipping check ``tensor.type()`` for CUDA type names."""
    orig_type = torch.Tensor.type
    if getattr(orig_type, "_mzb_shim", False):
        return
    names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
             "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            t = orig_type(self)
            return names.get(t, t)
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        return orig_type(self, dtype, non_blocking, **kwargs)
    type_._mzb_shim = True
    torch.Tensor.type = type_


def _fake_gradient_accumulation_fusion():
    """A CPU stand-in for apex's fused_weight_gradient_mlp_cuda: main_grad += g^T x."""
    name = "fused_weight_gradient_mlp_cuda"
    if name in sys.modules:
        return
    try:
        __import__(name)
        return
    except ImportError:
        pass
    mod = types.ModuleType(name)

    def wgrad_gemm_accum(total_input, grad_output, main_grad):
        x = total_input.reshape(-1, total_input.shape[-1])
        g = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.add_(g.t().to(main_grad.dtype) @ x.to(main_grad.dtype))

    mod.wgrad_gemm_accum_fp32 = wgrad_gemm_accum
    mod.wgrad_gemm_accum_fp16 = wgrad_gemm_accum
    mod.__doc__ = "megatron-zb CPU stand-in for apex's fused wgrad accumulation"
    sys.modules[name] = mod


class _DropRngWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _quiet_logs():
    # On CPU the "cuda" RNG *is* the CPU generator, so megatron's fork() check always fires.
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropRngWarning())


# --------------------------------------------------------------------------------------------
# megatron.training (0.17+ wheels): what ``pretrain()`` needs beyond megatron-core
# --------------------------------------------------------------------------------------------

_TRAINING_APPLIED = False


def apply_training(force: bool = False) -> bool:
    """Let ``megatron.training.pretrain()`` run on a CPU-only torch (gloo). Call after ``apply()``.

    * ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: the name ``pretrain`` calls
      gets ``allow_no_cuda=True``.
    * ``_initialize_distributed`` only creates megatron's model-parallel groups, and
      ``_set_random_seed`` only seeds the model-parallel RNG tracker, when
      ``torch.cuda.device_count() > 0``: both run as if one device were present (the CUDA calls
      inside are the ones ``apply()`` already made no-ops; the process group uses
      ``args.distributed_backend``, which must be ``gloo``).

    * megatron-core <= 0.17 compiles its legacy fused CUDA kernels at start-up (with nvcc), 0.18+
      warms the fused bias+activation and bias+dropout+add up (``torch.compile``, a third of a tiny
      run's start-up): neither on a CPU, where the fusions are off (``launch.startup.machine_adjustments``).
    * ``validate_args`` asks for the GPU architecture (``get_device_arch_version``) with tensor or
      context parallelism: it answers 0 (no GPU), and ``CUDA_DEVICE_MAX_CONNECTIONS`` defaults to 1
      (Megatron's requirement for TP before Blackwell; meaningless on CPU).

    Does nothing when CUDA is present (unless ``force``). Returns True if the shims are active.
    """
    global _TRAINING_APPLIED
    if _TRAINING_APPLIED:
        return True
    if cuda_available() and not force:
        return False
    import functools
    import importlib
    init_mod = importlib.import_module("megatron.training.initialize")
    train_mod = importlib.import_module("megatron.training.training")
    orig_init = init_mod.initialize_megatron

    @functools.wraps(orig_init)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return orig_init(*args, **kwargs)
    initialize_megatron._mzb_shim = True
    for mod in (init_mod, train_mod, importlib.import_module("megatron.training")):
        if getattr(mod, "initialize_megatron", None) is orig_init:
            mod.initialize_megatron = initialize_megatron

    def one_device(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            saved = torch.cuda.device_count
            torch.cuda.device_count = lambda: 1
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.device_count = saved
        wrapper._mzb_shim = True
        return wrapper
    for name in ("_initialize_distributed", "_set_random_seed"):
        fn = getattr(init_mod, name)
        if not getattr(fn, "_mzb_shim", False):
            setattr(init_mod, name, one_device(fn))
    try:  # <= 0.17 compiles the legacy fused CUDA kernels at start-up (nvcc): nothing to compile on a CPU
        fused = importlib.import_module("megatron.legacy.fused_kernels")
        fused.load = lambda *a, **k: None
    except ImportError:
        pass
    warmup = getattr(init_mod, "_warmup_jit_function", None)  # torch.compiles the fused bias+gelu/swiglu and
    if warmup is not None and not getattr(warmup, "_mzb_shim", False):  # bias+dropout+add: only if they run
        def warmup_if_fused(*a, **k):
            args = importlib.import_module("megatron.training.global_vars").get_args()
            if any(getattr(args, f, False) for f in ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion")):
                return warmup(*a, **k)
        warmup_if_fused._mzb_shim = True
        init_mod._warmup_jit_function = warmup_if_fused
    args_mod = importlib.import_module("megatron.training.arguments")
    if hasattr(args_mod, "get_device_arch_version"):
        args_mod.get_device_arch_version = lambda: 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _TRAINING_APPLIED = True
    return True


def dataset_helpers() -> bool:
    """Make megatron's dataset index helpers usable where the compiled module is not.

    megatron-core's wheels ship ``megatron/core/datasets/helpers_cpp`` compiled for one Python
    (cp312 for 0.17+: not importable on Python 3.11) and no Makefile, while ``initialize_megatron``
    runs ``make`` on it (``compile_helpers``, which exits the process when make fails). Here:
    if ``helpers_cpp`` does not import, a NumPy implementation with the same functions and results
    (``build_sample_idx_int32/64``, ``build_blending_indices``, ``build_exhaustive_blending_indices``)
    is registered in its place; and ``compile_helpers`` is skipped when the helpers import.
    Works with or without CUDA. Returns True if the NumPy stand-in is in use.
    """
    import importlib
    name = "megatron.core.datasets.helpers_cpp"
    stand_in = False
    try:
        importlib.import_module(name)
    except ImportError:
        sys.modules[name] = _numpy_dataset_helpers(name)
        stand_in = True
    utils = importlib.import_module("megatron.core.datasets.utils")
    orig = utils.compile_helpers
    if not getattr(orig, "_mzb_shim", False):
        def compile_helpers():
            try:
                importlib.import_module(name)
                return  # compiled (or stand-in) helpers are importable: nothing to build
            except ImportError:
                return orig()
        compile_helpers._mzb_shim = True
        compile_helpers.__wrapped__ = orig
        utils.compile_helpers = compile_helpers
    return stand_in


def _numpy_dataset_helpers(name: str):
    import numpy as np
    mod = types.ModuleType(name)
    mod.__doc__ = ("megatron-zb NumPy stand-in for megatron's compiled dataset helpers "
                   "(the wheel's helpers_cpp does not import on this Python)")

    def _sample_idx(dtype):
        def build(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                  drop_last_partial_sequence=True, add_extra_token_to_sequence=1):
            e = int(add_extra_token_to_sequence)
            seq = int(seq_length)
            total = int(num_epochs) * int(tokens_per_epoch) - e
            n = total // seq if drop_last_partial_sequence else int(np.ceil(np.float32(total) / np.float32(seq)))
            doc_sizes = np.asarray(sizes, dtype=np.int64)[np.asarray(document_idx, dtype=np.int64)]
            starts = np.zeros(len(doc_sizes) + 1, dtype=np.int64)
            np.cumsum(doc_sizes, out=starts[1:])
            end = starts[-1]
            out = np.zeros((n + 1, 2), dtype=dtype)
            if n:
                # sample k starts at stream position k*seq, in the document that holds the last token
                # of sample k-1 (position k*seq + e - 1), at offset k*seq - (that document's start)
                pos = np.arange(1, n + 1, dtype=np.int64) * seq
                last = pos + e - 1
                doc = np.searchsorted(starts[:-1], last, side="right") - 1
                off = pos - starts[doc]
                past = last >= end  # the final partial sample (drop_last_partial_sequence=False)
                if past.any():
                    doc[past] = len(doc_sizes) - 1
                    off[past] = doc_sizes[-1] - e
                out[1:, 0] = doc
                out[1:, 1] = off
            return out
        return build

    def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose):
        w = np.asarray(weights, dtype=np.float64)[: int(num_datasets)]
        current = np.zeros(int(num_datasets), dtype=np.int64)
        for i in range(int(size)):
            err = w * max(float(i), 1.0) - current
            j = int(np.argmax(err))  # first maximum, as the C++ loop's strict '>'
            dataset_index[i] = j
            dataset_sample_index[i] = current[j]
            current[j] += 1

    def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets):
        sz = np.asarray(sizes, dtype=np.int64)[: int(num_datasets)]
        w = sz / float(sz.sum())
        counts = np.zeros(int(num_datasets), dtype=np.int64)
        unspent = sz > 0
        i = 0
        while unspent.any():
            err = np.where(unspent, w * max(float(i), 1.0) - counts, -np.inf)
            j = int(np.argmax(err))
            dataset_index[i] = j
            dataset_sample_index[i] = counts[j]
            counts[j] += 1
            if counts[j] == sz[j]:
                unspent[j] = False
            i += 1

    def _unavailable(fn):
        def f(*_a, **_k):
            raise RuntimeError(f"{fn} (BERT/T5 index helpers) is not available in megatron-zb's NumPy stand-in "
                               "for megatron's compiled dataset helpers")
        return f

    mod.build_sample_idx_int32 = _sample_idx(np.int32)
    mod.build_sample_idx_int64 = _sample_idx(np.int64)
    mod.build_blending_indices = build_blending_indices
    mod.build_exhaustive_blending_indices = build_exhaustive_blending_indices
    mod.build_mapping = _unavailable("build_mapping")
    mod.build_blocks_mapping = _unavailable("build_blocks_mapping")
    return mod
