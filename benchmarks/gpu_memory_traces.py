"""Per-pass activation memory on one GPU, measured (CUDA allocator) against the simulator: 1f1b and
zb-v at PP=4, M=8, the GPU check's memory model, every rank a process sharing the GPU (gloo,
messages staged through the host). Writes OUTDIR/traces.json (verify's results with
``memory_traces``: each pass's bytes measured and predicted) and prints each case's peaks.

    python benchmarks/gpu_memory_traces.py OUTDIR [--schedules 1f1b,zb-v]   # on a GPU, megatron-core importable

Found on an H200 (2026-11-27): every sent tensor stayed allocated to the iteration's end (a gloo
send reports complete only once waited on, and the runtime held the tensor beside the work),
+2 MiB per message; ``benchmarks/results/gpu_check_h200/memory_traces_{before,after}_fix.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the GPU check's memory model (benchmarks/gpu_check_verify.py): activations well above the allocator's rounding
MODEL = dict(hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=2, vocab_size=1024)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        sys.stderr.write(f"gpu_memory_traces.py: error: {message}\n")
        sys.exit(2)


def main(argv=None) -> int:
    ap = _Parser(description="per-pass GPU activation memory, measured against the simulator")
    ap.add_argument("outdir", help="folder for traces.json (created if missing)")
    ap.add_argument("--schedules", default="1f1b,zb-v", help="comma-separated (default 1f1b,zb-v)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the launch (default 120)")
    a = ap.parse_args(argv)
    try:
        os.makedirs(a.outdir, exist_ok=True)
        out = os.path.join(a.outdir, "traces.json")
        open(out, "a").close()
    except OSError as e:
        ap.error(f"cannot write to {a.outdir!r}: {e.strerror}")
    import torch
    if not torch.cuda.is_available():
        ap.error("no CUDA device: this measures the CUDA allocator (on a CPU, megatron-zb verify measures the same passes)")
    from megatron_zb import verify as V
    try:
        cases = [V.make_case(n, 4, num_microbatches=8, iterations=2, device="cuda",
                             config_overrides={"deallocate_pipeline_outputs": True}, **MODEL)
                 for n in a.schedules.split(",") if n]
    except V.VerifyUsageError as e:
        ap.error(str(e))
    res = V.run_verify_many(cases, timeout=a.timeout)
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    mib = 2 ** 20
    for r in res:
        meas, pred = r.get("peak_activation_bytes_measured") or [], r.get("peak_activation_bytes_predicted") or []
        dev = " / ".join(f"{m / p - 1:+.1%}" for m, p in zip(meas, pred) if p)
        print(f"{r['case']}: {'passed' if r.get('passed') else 'FAILED'}; peak MiB measured "
              f"{' / '.join(f'{m / mib:.1f}' for m in meas)}, simulated {' / '.join(f'{p / mib:.1f}' for p in pred)} ({dev})"
              + (f"; {str(r.get('error')).splitlines()[0]}" if r.get("error") else ""))
    print(f"wrote {out}")
    return 0 if all(r.get("passed") for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
