"""The activation offload manager (runtime/features/offload.py) in one process: what it captures, what it
moves, that gradients are unchanged, byte accounting, buffer reuse, errors. The CPU test mode
runs everywhere; the CUDA-stream path runs where a GPU is present (skipped otherwise)."""
import pytest
import torch

from megatron_zb.runtime.observe.measure import measure_host_link, measure_matmul
from megatron_zb.runtime.features.offload import OffloadError, OffloadManager

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(torch.nn.Module):
    def __init__(self, h=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + y


def _run(device, offload, n_mb=3, iterations=2, overlap=True):
    """F of n_mb microbatches (stage input = a leaf, as the executor has it), then B in reverse
    order; returns grads, the input grads, and the manager's stats per iteration."""
    torch.manual_seed(0)
    model = Block().to(device)
    mgr = OffloadManager(device, cpu_test=True, overlap=overlap, min_elements=16)
    mgr.ignore(model.parameters())
    stats, in_grads = [], []
    for it in range(iterations):
        model.zero_grad()
        saved = {}
        for mb in range(n_mb):
            x = torch.randn(8, 32, 64, device=device, generator=None).requires_grad_()
            with mgr.capture(0, mb, offload, (x,)):
                out = model(x).square().mean()
            saved[mb] = (x, out)
            if offload:
                mgr.offload(0, mb)
                assert x.numel() == 0  # the stage input let go of its storage too
        for mb in reversed(range(n_mb)):
            if offload:
                mgr.reload(0, mb)
            mgr.wait(0, mb)
            x, out = saved.pop(mb)
            assert x.shape == (8, 32, 64)
            out.backward()
            in_grads.append(x.grad.detach().cpu().clone())
        stats.append(mgr.end_iteration())
    grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
    return grads, in_grads, stats


def test_offload_gives_the_same_gradients_and_moves_the_bytes():
    g0, i0, s0 = _run("cpu", offload=False)
    g1, i1, s1 = _run("cpu", offload=True)
    for a, b in zip(g0 + i0, g1 + i1):
        assert torch.equal(a, b)
    base, off = s0[-1], s1[-1]
    per_f = base["captured_bytes_per_forward"]
    assert per_f > 8 * 32 * 64 * 4 and off["captured_bytes_per_forward"] == per_f
    assert base["offloaded_bytes"] == 0 and base["peak_resident_bytes"] == 3 * per_f  # 3 forwards in flight
    assert off["offloaded_bytes"] == off["reloaded_bytes"] == 3 * per_f
    assert off["offloaded_parts"] == 3 and off["peak_resident_bytes"] < 2 * per_f
    # host buffers: allocated in the first iteration, reused in the second
    assert [s["host_allocations"] for s in s1] == [3, 0]
    assert off["host_buffer_bytes"] >= 3 * per_f


def test_views_and_aliases_are_stored_once():
    mgr = OffloadManager("cpu", cpu_test=True, min_elements=1)
    x = torch.randn(64, 64, requires_grad=True)
    with mgr.capture(0, 0, True):
        base = x * 2
        v = base[1:10]  # a view of a saved tensor's storage
        out = (base * base).sum() + (v * v).sum() + base.exp().sum()
    assert mgr.stats()["captured_bytes_per_forward"] == 2 * 64 * 64 * 4  # base and exp(base), once each
    mgr.offload(0, 0)
    mgr.reload(0, 0)
    mgr.wait(0, 0)
    out.backward()
    x2 = x.detach().clone().requires_grad_()  # the same math without offload
    b2 = x2 * 2
    ((b2 * b2).sum() + (b2[1:10] * b2[1:10]).sum() + b2.exp().sum()).backward()
    assert torch.allclose(x.grad, x2.grad)
    assert mgr.end_iteration()["offloaded_bytes"] == 2 * 64 * 64 * 4


def test_w_part_round_trip_keeps_the_values():
    held = {}

    def w_tensors(stage, mb):
        return held[(stage, mb)]

    mgr = OffloadManager("cpu", cpu_test=True, min_elements=1, w_tensors=w_tensors)
    a, g = torch.randn(32, 16), torch.randn(32, 8)
    held[(1, 0)] = [a[2:], g]  # a view, as the W queue's detached inputs can be
    before = [t.clone() for t in held[(1, 0)]]
    mgr.offload_w(1, 0)
    assert all(t.numel() == 0 for t in held[(1, 0)])
    mgr.reload_w(1, 0)
    mgr.wait_w(1, 0)
    assert all(torch.equal(t, b) for t, b in zip(held[(1, 0)], before))
    assert mgr.end_iteration()["offloaded_parts"] == 1


def test_misuse_is_named():
    with pytest.raises(OffloadError, match="on a CPU it only runs in its test mode"):
        OffloadManager("cpu")
    mgr = OffloadManager("cpu", cpu_test=True, min_elements=1)
    x = torch.randn(32, 32, requires_grad=True)
    with mgr.capture(2, 5, True, (x,)):
        out = (x.exp()).sum()
    mgr.offload(2, 5)
    with pytest.raises(OffloadError, match="needs what was offloaded for it, but no RELOAD ran before it"):
        mgr.wait(2, 5)
    with pytest.raises(OffloadError, match="RELOAD0.0: nothing captured"):
        mgr.reload(0, 0)
    mgr2 = OffloadManager("cpu", cpu_test=True, min_elements=1)
    with mgr2.capture(0, 1, True):
        y = torch.randn(32, 32, requires_grad=True).exp().sum()
    mgr2.offload(0, 1)
    with pytest.raises(OffloadError, match="still offloaded or captured at the end of the iteration: \\['B0.1'\\]"):
        mgr2.end_iteration()
    assert y is not None and out is not None


def test_storage_resized_after_capture_stays_on_device():
    # megatron's output-discarding recompute frees a saved output's storage after F and refills
    # it in place before B: such a storage must not travel
    mgr = OffloadManager("cpu", cpu_test=True, min_elements=1)
    x = torch.randn(16, 16, requires_grad=True)
    with mgr.capture(0, 0, True):
        h = x.exp()
        out = (h * 3).sum()  # saves nothing big; exp saves its output h
    saved = h.detach().clone()
    h.untyped_storage().resize_(0)
    mgr.offload(0, 0)
    h.untyped_storage().resize_(saved.numel() * 4)
    h.detach().copy_(saved)
    mgr.reload(0, 0)
    mgr.wait(0, 0)
    out.backward()
    assert torch.allclose(x.grad, 3 * saved)
    assert mgr.end_iteration()["kept_on_device_bytes"] == 16 * 16 * 4


def test_measurements_label_the_cpu_stand_ins():
    link = measure_host_link("cpu", nbytes=1 << 20, repeats=2)
    mm = measure_matmul("cpu", n=128, repeats=2)
    assert link["d2h_gbps"] > 0 and "CPU memcpy" in link["what"]
    assert mm["tflops"] > 0 and "CPU matmul" in mm["what"]


@cuda
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_streams_same_gradients_less_memory(overlap):
    g0, i0, _ = _run("cuda", offload=False, overlap=overlap)
    g1, i1, s1 = _run("cuda", offload=True, overlap=overlap)
    for a, b in zip(g0 + i0, g1 + i1):
        assert torch.equal(a, b)
    assert s1[-1]["copies"] == "cuda streams" and s1[-1]["offloaded_parts"] == 3
    assert [s["host_allocations"] for s in s1] == [3, 0]


@cuda
def test_cuda_offload_frees_device_memory():
    torch.cuda.synchronize()
    model = Block(1024).cuda()
    mgr = OffloadManager("cuda")
    mgr.ignore(model.parameters())
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    m0 = torch.cuda.memory_allocated()
    with mgr.capture(0, 0, True, (x,)):
        out = model(x).square().mean()
    held = torch.cuda.memory_allocated() - m0
    mgr.offload(0, 0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - m0 < held / 4
    mgr.reload(0, 0)
    mgr.wait(0, 0)
    out.backward()
    assert x.grad is not None and mgr.end_iteration()["offloaded_bytes"] > 0
    link = measure_host_link("cuda", nbytes=64 << 20, repeats=2)
    assert "GPU" in link["what"] and link["h2d_gbps"] > 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_install_refuses_offload_without_cuda_outside_the_test_mode():
    from megatron_zb.megatron.install import ZeroBubbleConfigError, install
    with pytest.raises(ZeroBubbleConfigError, match="this machine has no CUDA device; without a GPU it only runs in "
                                                    "its CPU test mode") as ei:
        install("zb-h1", offload_ratio=1.0)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("kw, msg", [
    (dict(offload_ratio=1.5), "offload ratio must be a number in 0..1 or 'auto', got 1.5"),
    (dict(offload_ratio="auto"), "give memory_limit"),
    (dict(offload_ratio=1.0, offload_time=-1), "offload time must be a number >= 0 or 'auto', got -1"),
    (dict(offload_ratio=1.0, offload_chunks=0), "offload chunk count must be an integer >= 1, got 0"),
])
def test_install_offload_options_checked(kw, msg):
    from megatron_zb.megatron.errors import ZeroBubbleConfigError
    from megatron_zb.megatron.execution.forward_backward import ZeroBubbleForwardBackward
    from megatron_zb.megatron.execution.options import ScheduleOptions
    with pytest.raises(ZeroBubbleConfigError, match=msg):
        ZeroBubbleForwardBackward(ScheduleOptions("zb-h1", offload_cpu_test=True, **kw))


def test_auto_offload_time_estimate_on_cpu_is_labelled():
    from megatron_zb.core.costs.model import ModelSpec
    from megatron_zb.megatron.features.offload import estimate_offload_time
    est = estimate_offload_time(ModelSpec(num_layers=1, hidden_size=256, num_attention_heads=4, seq_length=128,
                                          micro_batch_size=1), device="cpu")
    assert est["offload_time"] > 0 and est["transfer_s"] > 0 and est["compute_s"] > 0
    assert "CPU memcpy" in est["host_link"]["what"] and "CPU matmul" in est["matmul"]["what"]


@pytest.mark.parametrize("argv, msg", [
    (["--schedule", "megatron-1f1b", "-p", "2", "--offload-ratio", "1"], "offload runs with megatron-zb schedules"),
    (["--schedule", "zb-h1", "-p", "2", "--offload-half-duplex"], "--offload-half-duplex needs --offload-ratio"),
    (["--schedule", "zb-h1", "-p", "2", "--offload-ratio", "auto"], "give --memory-limit"),
    (["--schedule", "zb-h1", "-p", "2", "--offload-ratio", "2"], "takes a number in 0..1 or 'auto'"),
])
def test_verify_bad_offload_flags_one_line(argv, msg, capsys):
    from megatron_zb.verify import main_verify
    assert main_verify(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err


@cuda
@pytest.mark.megatron
def test_gpu_bench_runs_one_ranks_share(tmp_path):
    # benchmarks/bench_offload_gpu.py on a small chunk: offload saves memory on this GPU
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "g.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_offload_gpu.py"), "--hidden", "1024",
                    "--heads", "8", "--seq", "1024", "--stages", "4", "--microbatches", "8", "--out", str(out)],
                   check=True, cwd=root, timeout=600)
    d = json.loads(out.read_text())
    assert d["offload"]["max_memory_allocated_above_model_bytes"] < d["no_offload"]["max_memory_allocated_above_model_bytes"]
    assert d["k"]["measured_k"] > 0 and d["k"]["auto_offload_time_estimate"] > 0
