"""Run the ZB authors' public schedulers on our settings (benchmark use only; never imported by
the package, never vendored).

The authors' repository (sail-sg/zero-bubble-pipeline-parallelism) must be present locally; its
scheduler files are loaded by path from ``<repo>/megatron/core/pipeline_parallel/zerobubble/
scheduler/``:

* ``zb.py`` (``Graph.build_graph`` + ``initial_solution``): the automatic ZB scheduler, one stage
  per rank, memory limit ``max_mem`` per stage;
* ``zbv.py`` (``PipelineGraph.try_v_schedule``, best of its fill_b x fill_f variants, as its
  ``create_schedule`` does): the adaptive V scheduler under ``max_mem``;
* ``v_auto_schedule.py`` (``schedule``): the building-block V search of "Pipeline Parallelism
  with Controllable Memory" (unit slots; its memory model frees a chunk's activation at W).

Each returns our ``Schedule`` (per-rank order), so it is timed by our simulator, or None where
the authors' code finds no schedule (it raises). Their modules import ``torch`` (a type hint)
and ``pulp`` (``pulp.value`` on floats); both are stubbed when missing.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import types
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from megatron_zb.core.ir import B, F, W, Action, Placement, Schedule, Setting  # noqa: E402

SUBDIR = os.path.join("megatron", "core", "pipeline_parallel", "zerobubble", "scheduler")
PKG = "megatron.core.pipeline_parallel.zerobubble.scheduler"


class Authors:
    """The authors' scheduler modules loaded from a local checkout at ``root``."""

    def __init__(self, root: str):
        d = os.path.join(root, SUBDIR)
        if not os.path.isfile(os.path.join(d, "zb.py")):
            raise SystemExit(f"{root!r} has no {os.path.join(SUBDIR, 'zb.py')}: give the path of a local "
                             "checkout of sail-sg/zero-bubble-pipeline-parallelism")
        for name in ("pulp", "torch"):
            try:
                __import__(name)
            except ImportError:
                stub = types.ModuleType(name)
                stub.value = lambda x: x
                stub.Tensor = object
                sys.modules[name] = stub
        parts = PKG.split(".")
        for i in range(1, len(parts) + 1):  # empty parent packages so their absolute imports resolve
            name = ".".join(parts[:i])
            if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
                mod = types.ModuleType(name)
                mod.__path__ = []
                sys.modules[name] = mod
        self.graph = self._load(d, "graph")
        self.zb = self._load(d, "zb")
        self.zbv = self._load(d, "zbv")
        self.vauto = self._load(d, "v_auto_schedule")

    @staticmethod
    def _load(d: str, name: str):
        spec = importlib.util.spec_from_file_location(f"{PKG}.{name}", os.path.join(d, name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    # -- zb.py -----------------------------------------------------------------------------------
    def zb_schedule(self, st: Setting, limit: float) -> Optional[Schedule]:
        p, m = st.stages, st.microbatches
        q = float(2 ** 20)  # integral memory (their config asserts f + b + w == 0 exactly)
        mf = [float(round(x * q)) for x in st.mem_f]
        mw = [float(round(x * q)) for x in st.mem_w]
        cfg = self.graph.GraphConfig(
            mem_f=mf, mem_b=[-(a - b) for a, b in zip(mf, mw)], mem_w=[-b for b in mw],
            max_mem=[float(limit) * q] * p, cost_f=[float(x) for x in st.cost_f],
            cost_b=[float(x) for x in st.cost_b], cost_w=[float(x) for x in st.cost_w],
            cost_comm=float(st.cost_comm), n_stages=p, n_micro=m)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                g = self.zb.Graph.build_graph(p, m, cfg)
                _, _, done = self.zb.initial_solution(g, print_result=False)
        except (ValueError, AssertionError):
            return None
        orders = []
        for s in range(p):
            keys = [(k, s, j) for k in range(3) for j in range(m)]
            keys.sort(key=lambda x: float(done[g.get_id(*x)]))  # stable: F, B, W on ties, as theirs
            orders.append([Action((F, B, W)[k], s, j) for k, s, j in keys])
        return Schedule("authors-zb", Placement.single(p), m, orders)

    # -- zbv.py ----------------------------------------------------------------------------------
    def zbv_schedule(self, st: Setting, limit: float) -> Optional[Schedule]:
        """Scalar costs only (their V scheduler takes one F, B, W per chunk)."""
        p, m = st.stages, st.microbatches
        f, b, w = st.cost_f[0] / 2, st.cost_b[0] / 2, st.cost_w[0] / 2
        mf, mw = st.mem_f[0] / 2, st.mem_w[0] / 2
        best = None
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                g = self.zbv.PipelineGraph(p, m, f, b, w, st.cost_comm, mf, -(mf - mw), -mw, max_mem=2 * limit * mf)
                for fill_b in (True, False):
                    for fill_f in (True, False):
                        try:
                            sched, _, bubble = g.try_v_schedule(fill_b=fill_b, fill_f=fill_f)
                        except AssertionError:
                            continue
                        if best is None or bubble < best[1]:
                            best = (sched, bubble)
        except (AssertionError, ValueError, IndexError):
            return None
        if best is None:
            return None
        orders = []
        for s in range(p):
            o = []
            for cat, ch, mb in best[0][s]:
                if cat == 0:
                    stage = s if ch == 0 else 2 * p - 1 - s
                else:
                    stage = 2 * p - 1 - s if ch == 0 else s
                o.append(Action((F, B, W)[cat], stage, mb))
            orders.append(o)
        return Schedule("authors-zbv", Placement.vshape(p), m, orders)

    # -- v_auto_schedule.py ----------------------------------------------------------------------
    def vauto_schedule(self, st: Setting, limit: float) -> Optional[Schedule]:
        """Their unit-slot memory model: F +1 chunk activation, W -1 (B frees nothing); the limit
        is given to it in chunk activations (2 per stage activation)."""
        p, m = st.stages, st.microbatches
        f, b, w = st.cost_f[0] / 2, st.cost_b[0] / 2, st.cost_w[0] / 2
        chunks = int(2 * limit / st.mem_f[0] + 1e-9)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                res = self.vauto.schedule(p, m, (f, b, w, st.cost_comm), chunks)
        except Exception:  # their search ends in a TypeError/AssertionError when nothing fits
            return None
        orders = []
        for s, nodes in enumerate(res):
            o = []
            for n in nodes:
                kind = {"F": F, "B": B, "W": W}[n.type]
                stage = 2 * p - 1 - s if n.chunk else s  # their chunk flag: f, B, W (second chunk)
                o.append(Action(kind, stage, n.minibatch))
            orders.append(o)
        return Schedule("authors-v-auto", Placement.vshape(p), m, orders)
