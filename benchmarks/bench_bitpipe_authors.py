"""Our ``bitpipe`` against the BitPipe authors' own schedule, setting by setting.

    python benchmarks/bench_bitpipe_authors.py /path/to/BitPipe [--ps 4 6 8] [--ks 1 2 4]
        [--random N] [--out benchmarks/results/bitpipe_vs_authors.json]

The authors' repository (wuhouming/BitPipe, checked against 6fb0e22f) is not a dependency: give the
path of a local checkout. Their ``forward_backward_pipelining_with_BitPipe``
(``megatron/core/pipeline_parallel/bitpipe_schedule.py``) is run unmodified, rank by rank, with
torch, megatron and the p2p calls replaced by stubs given to its ``import`` statements only (nothing
is installed in ``sys.modules``). The stubs record the order of its forward and backward calls:
a forward is named by its model chunk and its place in that chunk's queue (the data iterator of a
chunk yields microbatches in order), a backward by the output tensor it is given (their queues are
first in, first out). The orders are mapped onto ``Placement.bitpipe`` (chunk 0/2: the first / second
half of the "down" pipeline, 1/3: of the "up" one) and timed by our simulator, as is our ``bitpipe``
for the same setting.

Grid: P in 4..16 (even), M in {P, 2P, 4P}, costs F=B=W=1 and F=1 B=2 W=1 (and F=B=W=1 with comm
0.1); ``--random N`` adds N settings with random F, B, W and comm (seeded). Prints the bubble rates
(theirs / ours) and every setting where ours is slower; writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from megatron_zb.core.ir import BW, F, Action, Placement, Schedule, Setting  # noqa: E402
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402

SOURCE = os.path.join("megatron", "core", "pipeline_parallel", "bitpipe_schedule.py")
COSTS = {"F=B=W=1": (1.0, 1.0, 1.0, 0.0), "F=1 B=2 W=1": (1.0, 2.0, 1.0, 0.0),
         "F=B=W=1 comm 0.1": (1.0, 1.0, 1.0, 0.1)}
REL = 1e-9


class _Tensor:
    """What the stubs hand around: an output tensor knows which forward made it."""

    def __init__(self, tag=None):
        self.tag = tag

    def detach(self):
        return _Tensor(self.tag)

    def requires_grad_(self):
        return self


class _Module:  # torch.nn.Module for their isinstance checks
    def __init__(self, chunk=None):
        self.chunk = chunk


class _DDP:  # no chunk is wrapped in DDP: their no-sync context is a null one
    pass


def _rank_env(p: int, r: int, log: list):
    """Stub modules for one rank; ``log`` receives ("F" | "B", chunk, index in the chunk's queue)."""
    state = {"v": None}
    seen = [0, 0, 0, 0]

    def first(ignore_virtual=False):
        if ignore_virtual:
            return r == 0
        return (r == p - 1 and state["v"] == 1) or (r == 0 and state["v"] == 0)

    def last(ignore_virtual=False):
        if ignore_virtual:
            return r == p - 1
        return (r == 0 and state["v"] == 2) or (r == p - 1 and state["v"] == 3)

    ps = types.SimpleNamespace(
        get_pipeline_model_parallel_world_size=lambda: p, get_pipeline_model_parallel_rank=lambda: r,
        get_tensor_model_parallel_world_size=lambda: 1,
        set_virtual_pipeline_model_parallel_rank=lambda v: state.__setitem__("v", v),
        get_virtual_pipeline_model_parallel_rank=lambda: state["v"],
        get_virtual_pipeline_model_parallel_world_size=lambda: 4,
        is_pipeline_first_stage=first, is_pipeline_last_stage=last,
        is_rank_in_bd_group=lambda: False, get_bd_parallel_group=lambda: None,
        get_pipeline_model_parallel_group=lambda: None, get_pipeline_model_parallel_next_rank=lambda: None,
        get_pipeline_model_parallel_prev_rank=lambda: None)

    def forward_step(func, data_iterator, model, num_microbatches, input_tensor, *rest):
        c = model.chunk
        log.append(("F", c, seen[c]))
        seen[c] += 1
        return _Tensor((c, seen[c] - 1))

    def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        log.append(("B",) + output_tensor.tag)
        return _Tensor()

    def comm(*args, **kwargs):
        return _Tensor()

    p2p = types.SimpleNamespace(**{n: comm for n in (
        "recv_forward", "recv_backward", "send_forward_recv_forward", "send_forward_recv_forward_bd0",
        "send_forward_recv_backward", "send_backward_recv_forward", "send_backward_recv_backward",
        "send_backward_recv_backward_bd")})
    nothing = lambda *a, **k: None  # noqa: E731
    sched = types.SimpleNamespace(recv_forward=comm, send_forward=nothing, recv_backward=comm, send_backward=nothing,
                                  deallocate_output_tensor=nothing, forward_step=forward_step,
                                  backward_step=backward_step, get_tensor_shapes=nothing)
    config = types.SimpleNamespace(overlap_p2p_comm=False, batch_p2p_comm=True, no_sync_func=None,
                                   grad_sync_func=None, param_sync_func=None, hidden_size=8,
                                   sequence_parallel=False, deallocate_pipeline_outputs=False,
                                   num_microbatches_with_partial_activation_checkpoints=None)
    enums = types.SimpleNamespace(ModelType=types.SimpleNamespace(encoder_or_decoder=1, encoder_and_decoder=2))
    utils = types.SimpleNamespace(get_model_config=lambda m: config, get_model_type=lambda m: 1)
    torch = types.SimpleNamespace(nn=types.SimpleNamespace(Module=_Module), distributed=None)
    core = types.SimpleNamespace(parallel_state=ps, utils=utils, enums=enums,
                                 pipeline_parallel=types.SimpleNamespace(p2p_communication=p2p, schedules=sched))
    megatron = types.SimpleNamespace(core=core, get_args=nothing, get_num_microbatches=nothing,
                                     print_rank_0=nothing)
    return {
        "torch": torch,
        "torch._utils": types.SimpleNamespace(_flatten_dense_tensors=None, _unflatten_dense_tensors=None),
        "torch.nn.utils": types.SimpleNamespace(parameters_to_vector=None, vector_to_parameters=None),
        "torch.nn.parallel.distributed": types.SimpleNamespace(DistributedDataParallel=_DDP),
        "megatron": megatron, "megatron.core": core, "megatron.core.parallel_state": ps,
        "megatron.core.utils": utils, "megatron.core.pipeline_parallel.schedules": sched,
        "megatron.core.enums": enums, "megatron.core.pipeline_parallel": core.pipeline_parallel,
    }


class AuthorsBitPipe:
    """Their schedule function, run under stubs (one fresh namespace per rank)."""

    def __init__(self, root: str):
        path = os.path.join(root, SOURCE)
        if not os.path.isfile(path):
            raise SystemExit(f"{root!r} has no {SOURCE}: give the path of a local checkout of wuhouming/BitPipe")
        with open(path) as f:
            self.code = compile(f.read(), path, "exec")

    def rank_log(self, p: int, m: int, r: int) -> list:
        log: list = []
        mods = _rank_env(p, r, log)
        real_import = __import__

        def imp(name, globals=None, locals=None, fromlist=(), level=0):
            if name.split(".")[0] in ("torch", "megatron"):
                return mods[name] if fromlist else mods[name.split(".")[0]]
            return real_import(name, globals, locals, fromlist, level)
        import builtins
        ns = {"__name__": "bitpipe_schedule", "__builtins__": {**vars(builtins), "__import__": imp}}
        exec(self.code, ns)
        ns["forward_backward_pipelining_with_BitPipe"](
            forward_step_func=None, data_iterator=[None] * 4, model=[_Module(c) for c in range(4)],
            num_microbatches=m, seq_length=4, micro_batch_size=1)
        return log

    def schedule(self, p: int, m: int) -> Schedule:
        """Their per-rank order as our Schedule (microbatch numbering as ``bitpipe``'s routes)."""
        pl = Placement.bitpipe(p)
        half = p // 2
        orders = []
        for r in range(p):
            o = []
            for kind, c, n in self.rank_log(p, m, r):
                k, h = c % 2, c // 2  # direction, first / second half
                logical = (r if h == 0 else 2 * p - 1 - r) if k == 0 else (p - 1 - r if h == 0 else p + r)
                unit, j = divmod(n, half)
                o.append(Action(F if kind == "F" else BW, k * 2 * p + logical, unit * p + k * half + j))
            orders.append(o)
            assert pl.stages_of(r) and all(pl.rank_of(a.stage) == r for a in o)
        return Schedule("authors-bitpipe", pl, m, orders)


def timed(sched: Schedule, st: Setting):
    r = simulate(sched, Setting(**{**st.to_dict(), "chunks": sched.placement.chunks}))
    return r.makespan, r.bubble_rate, max(r.peak_memory)


def compare(A: AuthorsBitPipe, p, m, f, b, w, comm, label):
    st = Setting(p, m, cost_f=f, cost_b=b, cost_w=w, cost_comm=comm)
    theirs = timed(A.schedule(p, m), st)
    ours_s = generate("bitpipe", st)
    ours = timed(ours_s, st)
    verdict = ("worse" if ours[0] > theirs[0] * (1 + REL) else "better" if ours[0] < theirs[0] * (1 - REL)
               else "equal")
    return {"p": p, "m": m, "costs": label, "f": f, "b": b, "w": w, "comm": comm,
            "theirs_makespan": theirs[0], "theirs_bubble": theirs[1], "theirs_peak": theirs[2],
            "ours_makespan": ours[0], "ours_bubble": ours[1], "ours_peak": ours[2],
            "ours_interleaving": ours_s.meta.get("interleaving"), "verdict": verdict}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bitpipe_repo", help="local checkout of wuhouming/BitPipe")
    ap.add_argument("--ps", type=int, nargs="+", default=list(range(4, 17, 2)))
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4], help="M = k x P for these k")
    ap.add_argument("--random", type=int, default=0, help="also N random cost settings (P 4..12, M = P..3P)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bitpipe_vs_authors.json"))
    args = ap.parse_args()
    A = AuthorsBitPipe(args.bitpipe_repo)
    rows = []
    print(f"{'setting':<32} {'theirs':>8} {'ours':>8}  interleaving")
    for label, p, k in itertools.product(COSTS, args.ps, args.ks):
        row = compare(A, p, k * p, *COSTS[label], label)
        rows.append(row)
        print(f"P={p:<2} M={k * p:<3} {label:<20} {row['theirs_bubble']:8.4f} {row['ours_bubble']:8.4f}  "
              f"{row['ours_interleaving']}" + ("  WORSE" if row["verdict"] == "worse" else ""), flush=True)
    rng = random.Random(args.seed)
    for _ in range(args.random):
        p = rng.choice([4, 6, 8, 10, 12])
        m = p * rng.choice([1, 2, 3])
        f, b, w = (round(rng.uniform(0.2, 3.0), 3) for _ in range(3))
        comm = rng.choice([0.0, 0.0, round(rng.uniform(0.0, 0.5), 3)])
        rows.append(compare(A, p, m, f, b, w, comm, "random"))
        if rows[-1]["verdict"] == "worse":
            print(f"  worse: P={p} M={m} F={f} B={b} W={w} comm={comm}: ours {rows[-1]['ours_makespan']:.6g} "
                  f"theirs {rows[-1]['theirs_makespan']:.6g}", flush=True)
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in ("worse", "equal", "better")}
    print(f"{len(rows)} settings: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"authors_source": SOURCE, "counts": counts, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
