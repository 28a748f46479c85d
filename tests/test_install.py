"""install()/uninstall() and the errors raised before any communication starts."""
import pytest

pytestmark = pytest.mark.megatron


@pytest.fixture()
def megatron():
    from megatron_zb.megatron.cpu import cpu_shims
    cpu_shims.apply()
    import megatron.core.pipeline_parallel as mpp
    return mpp


def test_install_patches_and_uninstall_restores(megatron):
    from megatron.core.pipeline_parallel import schedules as S
    from megatron_zb.megatron.execution.forward_backward import ZeroBubbleForwardBackward
    from megatron_zb.megatron.install import install
    before = (megatron.get_forward_backward_func, S.get_forward_backward_func)
    h = install("zb-h1")
    try:
        assert isinstance(megatron.get_forward_backward_func(pp_size=4, vp_size=None), ZeroBubbleForwardBackward)
        assert S.get_forward_backward_func(pp_size=4, vp_size=None) is h.forward_backward
        assert megatron.get_forward_backward_func(pp_size=1, vp_size=None) is S.forward_backward_no_pipelining
        try:
            import megatron.training.training as T
            assert T.get_forward_backward_func is megatron.get_forward_backward_func
        except ImportError:
            pass  # megatron-core 0.16.1's wheel has no megatron.training
    finally:
        h.uninstall()
    assert (megatron.get_forward_backward_func, S.get_forward_backward_func) == before


def test_bad_schedule_and_options(megatron):
    from megatron_zb.megatron.install import ZeroBubbleConfigError, install
    with pytest.raises(ZeroBubbleConfigError, match="unknown schedule 'nope'; known schedules: gpipe"):
        install("nope")
    with pytest.raises(ZeroBubbleConfigError, match="unknown install option"):
        install("zb-h1", frobnicate=1)


def test_chunk_mismatch_and_memory_limit_fail_before_communication(megatron):
    from megatron_zb.megatron.install import ZeroBubbleConfigError, install
    fb = install("gpipe-v").forward_backward
    with pytest.raises(ZeroBubbleConfigError, match="runs 2 model chunk"):
        fb.schedule_for(p=2, m=4, chunks=1, forward_only=False)
    fb = install("zb-h2", memory_limit=3).forward_backward
    with pytest.raises(ZeroBubbleConfigError, match="over the limit 3"):
        fb.schedule_for(p=4, m=8, chunks=1, forward_only=False)
    fb = install("interleaved-1f1b").forward_backward
    assert fb.schedule_for(p=2, m=4, chunks=2, forward_only=False).placement.style == "looped"


def test_modules_that_imported_the_function_by_name_get_ours(megatron):
    """Megatron-Bridge's train.py / eval.py do ``from megatron.core.pipeline_parallel(.schedules) import
    get_forward_backward_func`` at import time: install() reaches them too (and uninstall restores)."""
    import sys
    import types

    from megatron.core.pipeline_parallel import schedules as S
    from megatron_zb.megatron.install import install
    original = S.get_forward_backward_func
    train = types.ModuleType("megatron.bridge_like.training.train")
    train.get_forward_backward_func = original  # bound by name before install()
    sys.modules[train.__name__] = train
    try:
        h = install("zb-v")
        try:
            assert train.get_forward_backward_func(pp_size=2, vp_size=2) is h.forward_backward
        finally:
            h.uninstall()
        assert train.get_forward_backward_func is original
    finally:
        del sys.modules[train.__name__]


_NO_COMPILE_CHECK = """
import sys, torch
compile_fn = torch.compile
from megatron_zb.megatron.cpu import cpu_shims
cpu_shims.apply()
import megatron.core.jit as jit
from megatron.core.models.gpt import GPTModel  # noqa: F401  (imports the fusions and the MoE router)
from megatron.core.fusions import fused_bias_gelu
assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
assert torch.compile is compile_fn  # only while megatron's modules import
assert "torch._inductor.compile_fx" not in sys.modules  # no inductor backend loaded
assert not hasattr(fused_bias_gelu.bias_gelu, "_torchdynamo_orig_callable")  # the function itself, not compiled
print("ok")
"""


def test_cpu_imports_of_megatron_core_compile_nothing():
    """Without CUDA, megatron-core's import-time torch.compile decorations are left out (cpu_jit):
    jit_fuser is Megatron's no-op, torch.compile is torch's own again afterwards, and no process
    loads the inductor backend (a fresh process: this one may have imported megatron already)."""
    import os
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _NO_COMPILE_CHECK], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]
