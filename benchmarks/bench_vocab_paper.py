"""Vocabulary parallelism (issue 33): the comparison of *Balancing Pipeline Parallelism with
Vocabulary Parallelism* (Yeung et al., MLSys 2025; code github.com/sail-sg/VocabularyParallelism)
reproduced in simulation with megatron-zb's model (``core.plan``: FLOPs per model chunk, the
vocabulary passes placed by ``core.passes.vocab_place``, memory per rank), their reported figures beside.

    OMP_NUM_THREADS=1 python benchmarks/bench_vocab_paper.py [--quick] [--out benchmarks/results/vocab_paper.json]

Their setting (the repository's artifact, ``artifact/README.md`` and ``artifact/exp_one_host.csv``,
the paper's single-host experiment): a GPT of about 4B parameters, 32 layers, hidden 3072, FFN 12288,
24 heads, untied output layer, fp16, flash attention, sequence 2048 or 4096, micro-batch 1, 128
microbatches per iteration, pipeline size 8 (one A100 each), vocabulary 32k, 64k, 128k, 256k (their
``32000`` ... ``256000``). Their methods:

* ``baseline``: 1F1B, 4 layers per stage, the output layer + loss on the last stage;
* ``redis``: 1F1B with fewer layers on the last stage (``--final-stage-num-layers`` k: 0 for 256k,
  2 for 128k, 3 for 64k, 4 for 32k; the other layers spread as their ``get_num_layers_to_build``
  does: evenly, the remainder on the stages just before the last);
* ``vocab-1`` / ``vocab-2``: 1F1B with vocabulary parallelism, one barrier (their default) or two
  (``--disable-backward-fusion``), 4 layers per stage.

Their figures: MFU and peak memory per method from ``artifact/example-results/full-exp.txt`` (8
A100s; MFU from the measured iteration with their FLOPs formula, so MFU ratios are throughput
ratios). Their headline: 5% to 51% more throughput than the naive approaches (README).

Ours, simulated with the same shape: ``1f1b`` with their baseline and redis layouts, 1F1B + VP
with one and two barriers, V-Half + VP (their V-Half branch: ``v-half`` here, 2 chunks per rank in a
V, 2 layers per chunk), ZB-V + VP (the same placement, 1F1B's memory), and plan's best schedule with
VP (``--quick``, ``--no-best``: left out). F/B/W from FLOPs at an A100's 312 TFLOPS x
``--efficiency`` (0.6: their 1F1B + VP reaches 52-58% MFU at 5% bubble), the barriers' collectives at ``--vocab-gbps`` GB/s (NVLink within the host), memory by
Megatron's per-layer formula plus model states at 18 bytes per parameter (fp16 with fp32 master
weights and Adam; they use the distributed optimizer with DP=1, the same). Throughput gains are
iteration-time ratios (the same FLOPs per iteration in every method of a setting).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_zb.core.costs.layout import from_counts  # noqa: E402
from megatron_zb.core.costs.model import ModelSpec  # noqa: E402
from megatron_zb.core.plan import PlanRequest, VocabLever, plan  # noqa: E402

P, M, LAYERS = 8, 128, 32
VOCABS = (32000, 64000, 128000, 256000)
SEQS = (2048, 4096)
# their --final-stage-num-layers for redis (artifact/exp_one_host.csv, column 12)
REDIS_LAST = {256000: 0, 128000: 2, 64000: 3, 32000: 4}
# artifact/example-results/full-exp.txt: (seq, vocab) -> method -> (MFU %, peak memory GB)
THEIRS = {
    (2048, 32000): {"baseline": (47.52, 16.01), "redis": (47.52, 16.01), "vocab-2": (52.56, 15.87),
                    "vocab-1": (53.10, 16.64), "interlaced": (54.01, 17.87)},
    (2048, 64000): {"baseline": (40.82, 17.74), "redis": (49.15, 17.74), "vocab-2": (52.36, 16.64),
                    "vocab-1": (52.74, 17.48), "interlaced": (53.81, 18.63)},
    (2048, 128000): {"baseline": (33.70, 21.00), "redis": (44.12, 21.00), "vocab-2": (51.95, 17.56),
                     "vocab-1": (52.22, 18.40), "interlaced": (53.55, 19.70)},
    (2048, 256000): {"baseline": (17.29, 35.56), "redis": (38.21, 27.63), "vocab-2": (51.20, 18.85),
                     "vocab-1": (51.73, 19.44), "interlaced": (53.14, 21.15)},
    (4096, 32000): {"baseline": (52.82, 22.23), "redis": (52.81, 22.23), "vocab-2": (58.23, 23.39),
                    "vocab-1": (58.52, 24.97), "interlaced": (59.39, 27.38)},
    (4096, 64000): {"baseline": (45.78, 23.98), "redis": (53.81, 23.98), "vocab-2": (57.94, 23.14),
                    "vocab-1": (58.22, 24.58), "interlaced": (59.01, 27.43)},
    (4096, 128000): {"baseline": (37.13, 27.22), "redis": (49.56, 27.22), "vocab-2": (57.40, 24.56),
                     "vocab-1": (57.87, 26.10), "interlaced": (58.61, 29.04)},
    (4096, 256000): {"baseline": (27.63, 33.86), "redis": (42.45, 33.72), "vocab-2": (56.61, 26.25),
                     "vocab-1": (57.31, 27.38), "interlaced": (58.04, 30.72)},
}


def spec_for(seq: int, vocab: int) -> ModelSpec:
    return ModelSpec(num_layers=LAYERS, hidden_size=3072, num_attention_heads=24, seq_length=seq,
                     ffn_hidden_size=12288, vocab_size=vocab, untie_embeddings_and_output_weights=True,
                     activation_bytes=2, dropout=False, flash_attention=True)


def redis_counts(last: int):
    """Their ``get_num_layers_to_build`` with ``--final-stage-num-layers last``."""
    per, rem = divmod(LAYERS - last, P - 1)
    counts = [per] * P
    for r in range(P - 2, P - rem - 2, -1):
        counts[r] += 1
    counts[-1] = last
    return counts


def one(spec, schedule, layout, vocab, args):
    """plan's row for ``schedule`` (with ``layout`` where given; vocab: None or the barriers)."""
    lever = VocabLever("off" if vocab is None else "on", barriers=vocab or 1, gbps=args.vocab_gbps,
                       embedding=vocab is not None and args.split_vocab_embedding)
    rows = plan(PlanRequest(spec, P, M, args.gpu_memory_gb, tflops=312.0, efficiency=args.efficiency,
                            schedules=[schedule], vocab=lever, layout=None if layout is None else str(layout)))
    r = rows[0]
    if "error" in r:
        raise SystemExit(f"bench_vocab_paper: {schedule} {layout}: {r['error']}")
    return r


def methods(spec, vocab, quick):
    even = from_counts([LAYERS // P] * P)
    out = [("baseline", "1f1b", even, None), ("redis", "1f1b", from_counts(redis_counts(REDIS_LAST[vocab])), None),
           ("vocab-1", "1f1b", None, 1), ("vocab-2", "1f1b", None, 2), ("v-half + vocab-1", "v-half", None, 1),
           ("zb-v + vocab-1", "zb-v", None, 1)]
    if not quick:
        out.append(("plan's best + vocab-1", None, None, 1))
    return out


def best_vocab(spec, args):
    lever = VocabLever("on", barriers=1, gbps=args.vocab_gbps, embedding=args.split_vocab_embedding)
    rows = plan(PlanRequest(spec, P, M, args.gpu_memory_gb, tflops=312.0, efficiency=args.efficiency, vocab=lever,
                            schedules=["1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "interleaved-1f1b"]),
                jobs=args.jobs)
    return next(r for r in rows if "error" not in r and r["fits"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sequence 4096 only, without plan's best row")
    ap.add_argument("--no-best", action="store_true", help="without plan's best row (its search at M=128 is slow)")
    ap.add_argument("--efficiency", type=float, default=0.6)
    ap.add_argument("--vocab-gbps", type=float, default=100.0)
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--split-vocab-embedding", action="store_true",
                    help="our vocabulary-parallel rows split the input embedding too, as their implementation does "
                         "(default out: results/vocab_paper_split.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "vocab_paper_split.json" if args.split_vocab_embedding else "vocab_paper.json")
    t0 = time.time()
    results = []
    for seq in ((4096,) if args.quick else SEQS):
        for vocab in VOCABS:
            spec = spec_for(seq, vocab)
            theirs = THEIRS[(seq, vocab)]
            ours = {}
            for name, sched, layout, vp in methods(spec, vocab, args.quick or args.no_best):
                r = best_vocab(spec, args) if sched is None else one(spec, sched, layout, vp, args)
                ours[name] = {"schedule": r["schedule"], "layout": r["layout"],
                              "vocab_parallel": r.get("vocab_parallel"),
                              "iteration_s": r["iteration_time_s"], "bubble": r["bubble_rate"],
                              "peak_gb": max(r["peak_bytes"]) / 1e9,
                              "activation_gb": [x / 1e9 for x in r["activation_bytes"]], "flags": r["flags"]}
            base, redis = ours["baseline"]["iteration_s"], ours["redis"]["iteration_s"]
            for o in ours.values():
                o["gain_vs_baseline"] = base / o["iteration_s"]
                o["gain_vs_redis"] = redis / o["iteration_s"]
            their_gain = {k: {"vs_baseline": v[0] / theirs["baseline"][0], "vs_redis": v[0] / theirs["redis"][0],
                              "mfu_pct": v[0], "peak_gb": v[1]} for k, v in theirs.items()}
            results.append({"seq": seq, "vocab": vocab, "ours": ours, "theirs": their_gain})
    print(f"Vocabulary parallelism, the paper's single-host setting: 4B GPT (32 layers, h 3072, FFN 12288), P={P}, "
          f"M={M}; theirs measured on 8 A100s (artifact/example-results/full-exp.txt), ours simulated "
          f"(A100 312 TFLOPS x {args.efficiency}, barriers at {args.vocab_gbps:g} GB/s"
          + ("; our vocabulary rows split the input embedding too" if args.split_vocab_embedding else "") + ")")
    print("throughput gain over their baseline (1F1B, output layer on the last stage) and peak memory per GPU")
    hdr = f"{'seq':>5} {'vocab':>6} {'method':<22}{'theirs':>8}{'ours':>8}{'theirs/redis':>13}{'ours/redis':>11}" \
          f"{'their GB':>9}{'our GB':>8}  layout / schedule"
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        for name, o in res["ours"].items():
            key = name if name in res["theirs"] else None
            th = res["theirs"].get(key) if key else None
            tg = f"{th['vs_baseline']:>7.3f}x" if th else f"{'-':>8}"
            tr = f"{th['vs_redis']:>12.3f}x" if th else f"{'-':>13}"
            tm = f"{th['peak_gb']:>9.1f}" if th else f"{'-':>9}"
            print(f"{res['seq']:>5} {res['vocab'] // 1000:>5}k {name:<22}{tg}{o['gain_vs_baseline']:>7.3f}x{tr}"
                  f"{o['gain_vs_redis']:>10.3f}x{tm}{o['peak_gb']:>8.1f}  {o['schedule']} {o['layout']}")
        print()
    vs = [r["theirs"]["vocab-1"]["vs_redis"] for r in results] + \
        [r["theirs"]["vocab-1"]["vs_baseline"] for r in results]
    os_ = [r["ours"]["vocab-1"]["gain_vs_redis"] for r in results] + \
        [r["ours"]["vocab-1"]["gain_vs_baseline"] for r in results]
    print(f"vocab-1 over the naive layouts (baseline and redis): theirs {min(vs):.2f}-{max(vs):.2f}x, ours "
          f"{min(os_):.2f}-{max(os_):.2f}x (their README: 5% to 51% more throughput)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"setting": {"p": P, "microbatches": M, "layers": LAYERS, "hidden": 3072, "ffn": 12288, "heads": 24,
                               "gpu": "A100 312 TFLOPS", "efficiency": args.efficiency, "vocab_gbps": args.vocab_gbps,
                               "gpu_memory_gb": args.gpu_memory_gb},
                   "source": "github.com/sail-sg/VocabularyParallelism artifact/example-results/full-exp.txt",
                   "command": "python benchmarks/bench_vocab_paper.py" + (" --quick" if args.quick else "") +
                   (" --no-best" if args.no_best else "") +
                   (" --split-vocab-embedding" if args.split_vocab_embedding else ""),
                   "host": platform.node(), "seconds": time.time() - t0, "results": results}, f, indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
