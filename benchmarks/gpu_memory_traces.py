"""Per-pass activation memory on one GPU, measured (CUDA allocator) against the simulator: 1f1b and
zb-v at PP=4, M=8, the GPU check's memory model, every rank a process sharing the GPU (gloo,
messages staged through the host). Writes OUTDIR/traces.json (verify's results with
``memory_traces``: each pass's bytes measured and predicted) and prints each case's peaks.

    python benchmarks/gpu_memory_traces.py OUTDIR       # on a GPU machine, megatron-core importable

Found on an H200 (2026-11-27): every sent tensor stayed allocated to the iteration's end (a gloo
send reports complete only once waited on, and the runtime held the tensor beside the work),
+2 MiB per message; ``benchmarks/results/gpu_check_h200/memory_traces_{before,after}_fix.json``.
"""
import json, os, sys
sys.path.insert(0, os.getcwd())
from megatron_zb import verify as V
MM = dict(hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=2, vocab_size=1024)
cases = [V.make_case(n, 4, num_microbatches=8, iterations=2, device="cuda",
                     config_overrides={"deallocate_pipeline_outputs": True}, **MM) for n in ("1f1b", "zb-v")]
res = V.run_verify_many(cases, timeout=120)
with open(os.path.join(sys.argv[1], "traces.json"), "w") as f:
    json.dump(res, f, default=str)
for r in res:
    print(r["case"], r.get("passed"), r.get("peak_activation_bytes_measured"), r.get("peak_activation_bytes_predicted"),
          str(r.get("error"))[:500])
