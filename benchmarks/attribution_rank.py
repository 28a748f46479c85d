"""The rank side of ``bench_attribution.py``: megatron-zb's training entry point with every place a
real-compute iteration spends its time timed.

    torchrun ... benchmarks/attribution_rank.py <the entry point's flags>     (MZB_ATTRIBUTION_OUT=dir)

Before Megatron's ``pretrain()`` runs, the functions below are wrapped (module and class attributes
looked up at call time; nothing of megatron-zb or Megatron is changed on disk). Each wrapper adds its
call's **exclusive** time (its own time, what the wrapped functions it called took excluded) to its
name in the current iteration's totals, so the names add up to the iteration:

=================  ===========================================================================
``train_step``     Megatron's iteration (zeroing gradients, the optimizer step, loss reduction)
``fb``             the forward-backward call outside what follows (megatron-zb: building the call's
                   context and hooks; Megatron's 1F1B: its own loop between passes)
``finalize``       ``finalize_model_grads`` (both)
``execute``        megatron-zb's executor walking the rank's list between actions
``step``           one action's own work in the executor (``executor._step``/``_pair`` exclusive)
``hooks``          every hook point (``runtime.hooks.Hooks``: begin/end, the compute and wait
                   contexts' entry and exit, prepare, finish, validate, the sync windows)
``glue``           megatron-zb's passes around Megatron's (``megatron.execution.passes``)
``forward_step``   Megatron's ``forward_step`` (F, both loops)
``backward_step``  Megatron's ``backward_step`` (B or BW, both loops)
``w``              a W pass: the chunk's W queue run (``WQueue.run``)
``p2p_post``       megatron-zb: ``P2P.send`` / ``P2P.recv`` (posting) / ``reap_sends`` / ``_wait``'s
                   own time; Megatron: posting its sends and receives (``_p2p_ops``)
``p2p_wait``       megatron-zb: ``P2P._wait_work`` (blocked on a message); Megatron: ``_communicate``
                   exclusive (the requests' ``wait``)
``gc``             Python's cyclic garbage collector (``gc.callbacks``), taken out of what it interrupted
=================  ===========================================================================

Per iteration also the main thread's CPU seconds and its **run delay** (``/proc/<tid>/schedstat``: time
runnable but waiting for a core another thread or process held), over the iteration and inside the
passes: what a shared host takes from the rank, whichever name it landed in.

Every pass is also recorded on its own: (iteration, kind F/B/BW/W, stage, microbatch, seconds of
Megatron's ``forward_step``/``backward_step`` or the W queue run, its start on the host's monotonic
clock). After each iteration the rank writes
``<dir>/rank<global rank>.json``. A wrapper costs about a microsecond; it is counted in its caller's
exclusive time.
"""
from __future__ import annotations

import gc
import time

if __name__ == "__main__":
    gc.disable()  # as megatron-zb's entry point starts (``launch.session.start_up_done``)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections import defaultdict  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

__all__ = ["Recorder", "instrument"]


class Recorder:
    """Exclusive time per name for the current iteration, every pass's time, the iterations so far."""

    def __init__(self, out_dir: str, rank: int):
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self.rank = rank
        self.stack = []  # per open wrapped call: the time its wrapped callees took
        self.cur = defaultdict(float)
        self.calls = defaultdict(int)  # calls per name this iteration
        self.iterations = []
        self.passes = []  # [iteration, kind, stage, mb, seconds]
        self.iteration = 0
        self.kind = None  # the pass megatron-zb runs now: (kind, stage, mb); None in Megatron's loop
        self.counts = defaultdict(int)  # Megatron's loop: F / BW passes seen this iteration (their mb)
        # the main thread's scheduler counters (CPU time, time runnable but waiting for a core), ns
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._sched = open(path, "rb", buffering=0) if os.path.exists(path) else None
        self._it0 = (0, 0)
        self.delayed = 0.0  # this iteration's passes: seconds runnable but off the core
        self._gc0 = None
        gc.callbacks.append(self._gc)
        self.cprofile = None
        if os.environ.get("MZB_ATTRIBUTION_CPROFILE") == str(rank):
            import cProfile
            self.cprofile = cProfile.Profile()

    def sched(self):
        """(CPU seconds, seconds runnable but waiting for a core) of the main thread so far."""
        if self._sched is None:
            return 0.0, 0.0
        self._sched.seek(0)
        cpu, delay = self._sched.read().split()[:2]
        return int(cpu) * 1e-9, int(delay) * 1e-9

    def _gc(self, phase, info) -> None:
        """The cyclic collector's time: its own name, taken out of whoever it interrupted."""
        if phase == "start":
            self._gc0 = time.perf_counter()
        elif self._gc0 is not None:
            self.charge("gc", time.perf_counter() - self._gc0, 0.0)
            self._gc0 = None

    def charge(self, name: str, dt: float, child: float, call: bool = True) -> None:
        self.cur[name] += dt - child
        if call:
            self.calls[name] += 1
        if self.stack:
            self.stack[-1] += dt

    def wrap(self, name: str, fn, on_done=None, sched: bool = False):
        """``fn`` timed as ``name``; ``sched``: also the time it spent off the core (a pass)."""
        rec = self

        def timed(*a, **k):
            d0 = rec.sched()[1] if sched else 0.0
            t0 = time.perf_counter()
            rec.stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                rec.charge(name, dt, rec.stack.pop())
                if sched:
                    rec.delayed += rec.sched()[1] - d0
                if on_done is not None:
                    on_done(dt, a, k)
        timed.__wrapped__ = fn
        return timed

    def wrap_cm(self, name: str, fn):
        """``fn`` returns a context manager: its making, entry and exit are charged to ``name``, its
        body to whoever runs it."""
        rec = self

        class Timed:
            def __init__(self, a, k):
                self.a, self.k = a, k

            def __enter__(self):
                t0 = time.perf_counter()
                self.cm = fn(*self.a, **self.k)
                r = self.cm.__enter__()
                rec.charge(name, time.perf_counter() - t0, 0.0)
                return r

            def __exit__(self, *exc):
                t0 = time.perf_counter()
                r = self.cm.__exit__(*exc)
                rec.charge(name, time.perf_counter() - t0, 0.0, call=False)
                return r

        return lambda *a, **k: Timed(a, k)

    def start_iteration(self) -> None:
        self.iteration += 1
        if self.cprofile is not None and self.iteration == 5:  # MZB_ATTRIBUTION_CPROFILE: this rank's timed part
            self.cprofile.enable()
        self.cur = defaultdict(float)
        self.calls = defaultdict(int)
        self.counts = defaultdict(int)
        self.delayed = 0.0
        self._it0 = self.sched()

    def end_iteration(self, seconds: float) -> None:
        cpu, delay = self.sched()
        self.iterations.append({"iteration": self.iteration, "seconds": seconds, "exclusive": dict(self.cur),
                                "calls": dict(self.calls), "cpu_s": cpu - self._it0[0],
                                "run_delay_s": delay - self._it0[1], "pass_run_delay_s": self.delayed})
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "iterations": self.iterations, "passes": self.passes}, f)
        os.replace(tmp, self.path)
        if self.cprofile is not None and self.iteration >= 5:
            self.cprofile.dump_stats(self.path.replace(".json", ".pstats"))

    def record_pass(self, kind: str, stage: int, mb: int, seconds: float) -> None:
        # the start on CLOCK_MONOTONIC (perf_counter on Linux): comparable between the ranks of one host
        self.passes.append([self.iteration, kind, stage, mb, seconds, time.perf_counter() - seconds])


def _set(obj, name, value):
    setattr(obj, name, value)


def instrument(rec: Recorder) -> None:
    """Wrap the functions listed in the module docstring (megatron-core 0.19.2's names)."""
    from megatron.core.pipeline_parallel import p2p_communication as P, schedules as S
    from megatron.training import training as T

    from megatron_zb.megatron.execution import forward_backward as FB, passes as PS
    from megatron_zb.runtime import executor as E, hooks as H, p2p as ZP, wqueue as WQ
    from megatron_zb.runtime.features import pairs as PR

    def on_train_step(dt, a, k):
        rec.end_iteration(dt)

    inner = rec.wrap("train_step", T.train_step, on_train_step)

    def train_step(*a, **k):
        rec.start_iteration()
        return inner(*a, **k)
    _set(T, "train_step", train_step)
    _set(T, "finalize_model_grads", rec.wrap("finalize", T.finalize_model_grads))
    # Megatron's own 1F1B (get_forward_backward_func reads the module global when train() starts)
    _set(S, "forward_backward_pipelining_without_interleaving",
         rec.wrap("fb", S.forward_backward_pipelining_without_interleaving))
    _set(FB.ZeroBubbleForwardBackward, "__call__", rec.wrap("fb", FB.ZeroBubbleForwardBackward.__call__))
    _set(FB, "execute", rec.wrap("execute", FB.execute))
    _set(FB, "call_finalize", rec.wrap("finalize", FB.call_finalize))

    def megatron_pass(kind):
        def done(dt, a, k):
            if rec.kind is not None:  # megatron-zb's pass: its own kind, stage and microbatch
                rec.record_pass(*rec.kind, dt)
            else:
                rec.record_pass(kind, -1, rec.counts[kind], dt)
                rec.counts[kind] += 1
        return done
    _set(S, "forward_step", rec.wrap("forward_step", S.forward_step, megatron_pass("F"), sched=True))
    _set(S, "backward_step", rec.wrap("backward_step", S.backward_step, megatron_pass("BW"), sched=True))

    def zb_pass(name, kind_of, fn):
        w = rec.wrap("glue", fn)

        def run(self, stage, mb, *a):
            rec.kind = (kind_of(a), stage, mb)
            try:
                return w(self, stage, mb, *a)
            finally:
                rec.kind = None
        return run
    _set(PS.MegatronPasses, "forward", zb_pass("forward", lambda a: "F", PS.MegatronPasses.forward))
    _set(PS.MegatronPasses, "backward", zb_pass("backward", lambda a: "B" if a[-1] else "BW",
                                                PS.MegatronPasses.backward))

    _set(PS.MegatronPasses, "weight", zb_pass("weight", lambda a: "W", PS.MegatronPasses.weight))

    def w_done(dt, a, k):
        if rec.kind is not None:
            rec.record_pass(*rec.kind, dt)
    _set(WQ.WQueue, "run", rec.wrap("w", WQ.WQueue.run, w_done, sched=True))
    _set(E, "step", rec.wrap("step", E.step))  # (the executor's dispatch of one action: runtime.path.step)
    _set(PR, "run_pair", rec.wrap("step", PR.run_pair))
    for name in ("prepare", "begin", "end", "validate", "before_last_backward", "after_last_backward", "finish"):
        _set(H.Hooks, name, rec.wrap("hooks", getattr(H.Hooks, name)))
    for name in ("wait", "compute"):
        _set(H.Hooks, name, rec.wrap_cm("hooks", getattr(H.Hooks, name)))
    for name in ("send", "recv", "reap_sends", "_wait"):
        _set(ZP.P2P, name, rec.wrap("p2p_post", getattr(ZP.P2P, name)))
    _set(ZP.P2P, "_wait_work", rec.wrap("p2p_wait", ZP.P2P._wait_work))
    # Megatron's p2p: posting (module functions _communicate picks), the rest of _communicate is the wait
    _set(P, "_p2p_ops", rec.wrap("p2p_post", P._p2p_ops))
    _set(P, "_batched_p2p_ops", rec.wrap("p2p_post", P._batched_p2p_ops))
    _set(P.P2PCommunicator, "_communicate", rec.wrap("p2p_wait", P.P2PCommunicator._communicate))


def main() -> int:
    from megatron_zb.megatron import pretrain_gpt
    from megatron_zb.megatron.launch.session import run_reporting
    from megatron_zb.megatron.launch.startup import prepare_megatron

    prepare_megatron()  # megatron importable and fit for this machine (the CPU shims) before wrapping
    rec = Recorder(os.environ["MZB_ATTRIBUTION_OUT"], int(os.environ.get("RANK", "0")))
    instrument(rec)
    return run_reporting(pretrain_gpt.main)


if __name__ == "__main__":
    _code = main()
    if _code:
        from megatron_zb.runtime.supervise import exit_now
        exit_now(_code)
    sys.exit(0)
