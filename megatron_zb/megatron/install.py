"""Install a megatron-zb schedule as megatron-core's forward-backward function (no fork).

    from megatron_zb.megatron.install import install
    handle = install("zb-h1")            # before megatron's training loop asks for its schedule
    ...                                  # megatron calls get_forward_backward_func() as usual
    handle.uninstall()

``install`` patches ``megatron.core.pipeline_parallel.get_forward_backward_func`` (and the name
bound in ``megatron.core.pipeline_parallel.schedules`` and ``megatron.training.training``, which
imports it by name). With pipeline size 1 Megatron's own no-pipelining function is returned.

Our forward-backward keeps megatron-core's keyword signature and reuses megatron's own
``forward_step`` / ``backward_step`` (loss scaling, token counts, aux losses); the pipeline order
comes from the schedule core, lowered to SEND/RECV and run by ``runtime.executor``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..core import schedules as core_schedules
from ..core.ir import F, Placement, Schedule, ScheduleError, Setting
from ..core.lower import forward_only as forward_only_schedule
from ..core.lower import lower
from ..core.validate import validate
from ..runtime.executor import StagePasses, execute
from ..runtime.p2p import P2P, PairGroups
from ..runtime.postval import PostValidation, replayable
from ..runtime.profiler import PassProfiler, ProfileError, auto_replans, profile_to_setting_kwargs
from ..runtime.progress import tracker as progress_tracker
from ..runtime.replica import ReplicaGradSync, ReplicaGroups, grads_of
from ..runtime.wqueue import WQueue
from .placement import grad_of
from .wgrad import attach_wgrad_queue


class ZeroBubbleConfigError(ValueError):
    """A schedule or Megatron configuration the plugin cannot run; raised before any communication."""


@dataclasses.dataclass
class ScheduleOptions:
    schedule: str
    chunks: Optional[int] = None
    memory_limit: Optional[float] = None  # per rank, in microbatches of one stage's activation
    cost_f: Any = 1.0
    cost_b: Any = 1.0
    cost_w: Any = 1.0
    cost_comm: float = 0.0
    cost_sync: float = 0.0  # replicated stages (bitpipe): the replica gradient all-reduce of a stage
    mem_w: Optional[float] = None
    timeout_s: float = 300.0
    overlap: Optional[Callable] = None  # overlap(run_f, run_b) for overlapped F&B pairs (dualpipe-v)
    # profiler (runtime.profiler): time passes over iterations [start, end] (counted from 1, calls
    # with forward_only=False) and write the profile JSON to profile_path at the window's end
    profile_window: Optional[tuple] = None
    profile_path: Optional[str] = None
    # activation offload (core.offload + runtime.offload; docs/offload.md): offload_ratio R (0..1),
    # or 'auto' (as little as fits memory_limit); offload_time K, or 'auto' (measured at the first
    # iteration: matmul speed and host-link bandwidth); full-duplex copies unless offload_overlap
    # is False; only the first offload_chunks chunks of each rank; offload_cpu_test allows the
    # synchronous CPU test mode without CUDA
    offload_ratio: Any = None
    offload_time: Any = 1.0
    offload_overlap: bool = True
    offload_chunks: Optional[int] = None
    offload_cpu_test: bool = False
    offload_min_elements: int = 1024
    # optimizer post-validation (runtime.postval; the optimizer side: megatron.optimizer): wrap
    # Megatron's optimizer with handle.post_validated_optimizer(...)
    post_validation: bool = False


class ZeroBubbleForwardBackward:
    """Megatron's forward_backward_func signature, running a schedule from the core.

    State kept across iterations (none of it module-level): the generated and lowered schedules
    (per pipeline size, microbatches, chunks, forward-only), the pairwise process groups, and one
    W queue per model chunk.
    """

    def __init__(self, options: ScheduleOptions):
        try:
            spec = core_schedules.get(options.schedule)
        except ScheduleError as e:
            raise ZeroBubbleConfigError(str(e)) from None
        self.options = options
        self.spec = spec
        self._schedules: Dict[tuple, Schedule] = {}
        self._groups: Dict[tuple, PairGroups] = {}
        self._replica_groups: Dict[tuple, ReplicaGroups] = {}
        self._replicas_checked = False
        self._queues: Dict[int, WQueue] = {}
        self.last_schedule: Optional[Schedule] = None
        self.post_validation: Optional[PostValidation] = (
            PostValidation(options.timeout_s) if options.post_validation else None)
        self.pass_times: Optional[List] = None  # set to a list to record (kind, stage, mb, s)
        # -- profiler wiring ----------------------------------------------------------------------
        self.iterations = 0  # forward-backward calls with forward_only=False
        self.profile: Optional[dict] = None  # the gathered profile once the window has ended
        self.offload = None  # runtime.offload.OffloadManager, made at the first training call
        self.offload_stats: Optional[dict] = None  # the manager's counts of the last iteration
        self.offload_time_measured: Optional[dict] = None  # --auto-offload-time's measurement
        _check_offload_options(options)
        self.profiler = None
        if options.profile_window is not None:
            try:
                self.profiler = PassProfiler(options.profile_window, options.profile_path,
                                             schedule=options.schedule)
            except ProfileError as e:
                raise ZeroBubbleConfigError(str(e)) from None

    def replan_from(self, profile: dict) -> None:
        """Take the cost options (F/B/W per stage, comm, mem_w ratio) from a profile and drop the
        cached schedules: the next call generates the schedule again from the measured costs.
        Every pipeline rank must call it at the same iteration (it does, after the window)."""
        kw = profile_to_setting_kwargs(profile, normalize=True)
        upd = {k: kw[k] for k in ("cost_f", "cost_b", "cost_w", "cost_comm")}
        if "mem_f" in kw:
            ratios = sorted(w / f for f, w in zip(kw["mem_f"], kw["mem_w"]) if f > 0)
            if ratios:
                upd["mem_w"] = min(1.0, ratios[len(ratios) // 2])
        self.options = dataclasses.replace(self.options, **upd)
        self._schedules.clear()

    # -- schedule ---------------------------------------------------------------------------
    def schedule_for(self, p: int, m: int, chunks: int, forward_only: bool) -> Schedule:
        key = (p, m, chunks, forward_only)
        if key not in self._schedules:
            o = self.options
            try:
                c = self.spec.resolve_chunks(chunks if self.spec.chunks is None else None)
            except ScheduleError as e:
                raise ZeroBubbleConfigError(str(e)) from None
            want = self.spec.models(c)
            if want != chunks:
                how = (f", i.e. virtual pipeline size {want} in the order of "
                       f"megatron_zb.megatron.placement.make_placement('bitpipe', {p}))" if self.spec.models_per_rank
                       else ", i.e. virtual pipeline size 2 in V order)" if self.spec.chunks == 2 else ")")
                raise ZeroBubbleConfigError(
                    f"schedule {o.schedule} runs {want} model chunk(s) per rank, but Megatron passed {chunks} "
                    f"(build the model with {want} chunk(s) per pipeline rank" + how)
            try:
                setting = Setting(p, m, chunks=c, cost_f=o.cost_f, cost_b=o.cost_b, cost_w=o.cost_w,
                                  cost_comm=o.cost_comm,
                                  mem_w=None if o.mem_w is None else [o.mem_w],
                                  memory_limit=o.memory_limit, cost_sync=o.cost_sync)
                if o.offload_ratio is not None and not forward_only:
                    from .offload import offload_schedule
                    sched = offload_schedule(o, setting, c)
                else:
                    sched = core_schedules.generate(o.schedule, setting)
                validate(sched, setting)
            except ScheduleError as e:
                raise ZeroBubbleConfigError(f"{o.schedule} with pipeline size {p}, {m} microbatches: {e}") from None
            _check_forward_order(sched)
            if forward_only:
                sched = forward_only_schedule(sched)
            self._schedules[key] = lower(sched, setting)
        return self._schedules[key]

    def queue(self, chunk_module) -> WQueue:
        key = id(chunk_module)
        if key not in self._queues:
            q = WQueue(name=f"chunk {len(self._queues)}")
            attach_wgrad_queue(chunk_module, q)
            self._queues[key] = q
        return self._queues[key]

    def groups(self, pp_ranks: List[int], placement: Placement) -> PairGroups:
        pairs = {(placement.rank_of(s), placement.rank_of(n)) for s in range(placement.num_stages)
                 for n in [placement.next_stage(s)] if n is not None}
        key = (tuple(pp_ranks), tuple(sorted(pairs)))
        if key not in self._groups or not self._groups[key].alive():
            self._groups[key] = PairGroups(pp_ranks, pairs)
        return self._groups[key]

    def replica_groups(self, pp_ranks: List[int], placement: Placement) -> ReplicaGroups:
        members = {l: [placement.rank_of(placement.path(k)[l]) for k in range(placement.num_paths)]
                   for l in range(placement.num_logical_stages)}
        key = (tuple(pp_ranks), tuple(sorted((l, tuple(v)) for l, v in members.items())))
        if key not in self._replica_groups or not self._replica_groups[key].alive():
            self._replica_groups[key] = ReplicaGroups(pp_ranks, members)
        return self._replica_groups[key]

    # -- megatron's forward_backward_func ----------------------------------------------------
    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step: Optional[bool] = None, adjust_tensor_shapes_fn: Optional[Callable] = None,
                 p2p_communicator=None, pg_collection=None, force_all_reduce: Optional[bool] = False,
                 **unsupported):
        from megatron.core.pipeline_parallel import schedules as S
        from megatron.core.utils import get_model_config

        if unsupported:
            raise ZeroBubbleConfigError(f"megatron-zb forward_backward got unsupported arguments "
                                        f"{sorted(unsupported)}")
        if not forward_only:
            self.iterations += 1
        prof = self.profiler if (self.profiler is not None and not forward_only
                                 and self.profiler.in_window(self.iterations)) else None
        models = model if isinstance(model, list) else [model]
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(models)
        config = get_model_config(models[0])
        pp_group, tp_group, cp_group = _groups_of(pg_collection, p2p_communicator)
        p, me = pp_group.size(), pp_group.rank()
        if p == 1:
            return S.forward_backward_no_pipelining(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step)
        _check_config(config, models, self.options.schedule)
        if self.options.offload_ratio is not None and self.options.offload_time == "auto" and not forward_only:
            from .offload import resolve_auto_offload_time  # --auto-offload-time: measured once, here
            resolve_auto_offload_time(self, config, seq_length, micro_batch_size, tp_group, cp_group)
        sched = self.schedule_for(p, num_microbatches, len(models), forward_only)
        self.last_schedule = sched
        pl = sched.placement
        pp_ranks = dist.get_process_group_ranks(pp_group)
        prog = progress_tracker(pp_rank=me, group=pp_ranks)
        if prog is not None:
            prog.iteration = self.iterations
        p2p = P2P(self.groups(pp_ranks, pl), me, timeout_s=self.options.timeout_s,
                  exchange_shapes=bool(config.variable_seq_lengths), progress=prog)
        if pl.replicated:
            if not isinstance(data_iterator, list) and len(models) > 1 and data_iterator is not None:
                raise ZeroBubbleConfigError(f"{self.options.schedule}: replicated stages need one data iterator per "
                                            "model chunk (a list, as Megatron passes for virtual pipelines)")
            if self.post_validation is not None:
                raise ZeroBubbleConfigError(f"{self.options.schedule}: optimizer post-validation is not supported "
                                            "with replicated stages yet; train it with the synchronous optimizer step")
            if not forward_only and not self._replicas_checked:
                _check_replicas_equal(models, pl.stages_of(me), pl, self.replica_groups(pp_ranks, pl))
                self._replicas_checked = True
        queues = [self.queue(m) for m in models] if not forward_only else []
        cp_size = cp_group.size() if cp_group is not None else 1
        offload = None
        if self.options.offload_ratio is not None and not forward_only:
            from .offload import manager_for
            offload = manager_for(self, models, queues, {s: i for i, s in enumerate(pl.stages_of(me))})

        seq = decoder_seq_length if decoder_seq_length is not None else seq_length
        seq = seq // cp_size
        if config.sequence_parallel:
            seq = seq // tp_group.size()
        shape = [seq, micro_batch_size, config.hidden_size]
        if adjust_tensor_shapes_fn is not None:
            recv_shapes, _ = adjust_tensor_shapes_fn([shape], [shape])
            shape = list(recv_shapes[0])

        pv = self.post_validation
        if pv is not None and forward_only:
            pv.finish()  # evaluation sees validated weights
        validate = pv.validate if (pv is not None and pv.due and not forward_only) else None
        if validate is not None:
            iters = replayable(iters)  # a rolled-back iteration runs again on the same microbatches
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        while True:  # one attempt; a second one only after a post-validation rollback
            forward_data_store, total_num_tokens, completed = self._attempt(
                forward_step_func, iters, models, num_microbatches, forward_only, collect_non_loss_data,
                first_val_step, config, sched, me, p2p, queues, shape, cp_size, prof, validate, pp_group, pp_ranks,
                offload)
            if completed:
                break
            pv.recover()  # restore the eager step and redo it exactly as Megatron's synchronous step
            for m in models:
                if hasattr(m, "zero_grad_buffer"):
                    m.zero_grad_buffer()
            for it in iters:
                if it is not None:
                    it.rewind()
            validate = None

        if prof is not None:
            profile = prof.end_iteration(self.iterations, placement=pl, num_microbatches=num_microbatches,
                                         rank=me, group=pp_group, p2p=p2p, shape=shape,
                                         dtype=config.pipeline_dtype, device=_device(),
                                         schedule=self.options.schedule)
            if profile is not None:
                self.profile = profile
                if auto_replans(self.options.schedule):
                    self.replan_from(profile)

        if config.finalize_model_grads_func is not None and not forward_only:
            _call_finalize(config, models, total_num_tokens if config.calculate_per_token_loss else None,
                           pg_collection, force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return forward_data_store

    def _attempt(self, forward_step_func, iters, models, num_microbatches, forward_only, collect_non_loss_data,
                 first_val_step, config, sched, me, p2p, queues, shape, cp_size, prof, validate, pp_group, pp_ranks,
                 offload=None):
        """Run this rank's list once; returns (forward data, token count, completed)."""
        from megatron.core.pipeline_parallel import schedules as S

        pl = sched.placement
        replicated = pl.replicated
        run_iters, sync = iters, None
        if replicated:  # each chunk reads only the microbatches of its path
            run_iters = [_RoutedIterator(it) for it in iters]
            if not forward_only:
                sync = ReplicaGradSync(self.replica_groups(pp_ranks, pl), timeout_s=self.options.timeout_s)
        stages = pl.stages_of(me)
        chunk_of = {s: i for i, s in enumerate(stages)}
        forward_data_store: List = []
        total_num_tokens = torch.zeros([], dtype=torch.int)
        if torch.cuda.is_available():
            total_num_tokens = total_num_tokens.cuda()

        no_sync = _per_chunk(config.no_sync_func, len(models))
        grad_sync = _per_chunk(config.grad_sync_func, len(models))
        param_sync = _per_chunk(config.param_sync_func, len(models))
        sync_off: Dict[int, contextlib.ExitStack] = {}
        if not forward_only:
            for c, fn in enumerate(no_sync):
                if fn is not None:
                    stack = contextlib.ExitStack()
                    stack.enter_context(fn())
                    sync_off[c] = stack
        first_f_done = set()
        mb_of_entry: List[int] = []  # microbatch of each forward_data_store entry (replicated: merged by mb)
        deferred_grad_sync: List[int] = []
        bwd_kwargs = {"model_type": _model_type(models[0])} if "model_type" in inspect.signature(S.backward_step).parameters else {}

        def forward(stage, mb, inp):
            nonlocal total_num_tokens
            c = chunk_of[stage]
            first = c not in first_f_done  # mb 0 except on a replica (it sees its path's microbatches)
            if first:
                first_f_done.add(c)
                if param_sync[c] is not None and c > 0 and not forward_only:
                    param_sync[c](models[c].parameters())
            if replicated:
                run_iters[c].target = mb
            out, num_tokens = S.forward_step(
                forward_step_func, run_iters[c], models[c], num_microbatches, inp, forward_data_store,
                config, cp_size, collect_non_loss_data, None,
                is_first_microbatch=S.check_first_val_step(first_val_step, forward_only, first),
                current_microbatch=mb, vp_stage=None, is_last_stage=pl.is_last(stage))
            mb_of_entry.extend([mb] * (len(forward_data_store) - len(mb_of_entry)))
            total_num_tokens += num_tokens
            return out

        def backward(stage, mb, inp, out, grad, split):
            c = chunk_of[stage]
            ctx = queues[c].defer(mb) if split else contextlib.nullcontext()
            with ctx:
                return S.backward_step(inp, out, grad, config=config, **bwd_kwargs)

        def weight(stage, mb):
            queues[chunk_of[stage]].run(mb)

        def before_last_backward(stage):  # open the chunk's grad-sync window (Megatron's 1F1B rule)
            c = chunk_of[stage]
            if grad_sync[c] is None and c in sync_off:
                sync_off.pop(c).close()

        def after_last_backward(stage):
            c = chunk_of[stage]
            if sync is not None and sync.start(pl.logical(stage), grads_of(models[c].parameters(), grad_of)):
                # replica sum first; the data-parallel reduction of this chunk starts after it
                if grad_sync[c] is not None:
                    if c in sync_off:
                        sync_off.pop(c).close()
                    deferred_grad_sync.append(c)
                return
            if grad_sync[c] is not None:
                if c in sync_off:
                    sync_off.pop(c).close()
                grad_sync[c](models[c].parameters())

        def release(out):
            S.deallocate_output_tensor(out, config.deallocate_pipeline_outputs)

        on_pass = None
        if self.pass_times is not None:
            def on_pass(kind, stage, mb, secs):
                self.pass_times.append((kind, stage, mb, secs))

        passes = StagePasses(forward=forward, backward=backward, weight=weight,
                             recv_shape=lambda s, mb: shape, dtype=config.pipeline_dtype,
                             device=_device(), before_last_backward=before_last_backward,
                             after_last_backward=after_last_backward, on_pass=on_pass,
                             release_output=release, overlap=self.options.overlap, offload=offload)
        pairs = {i: j for r, i, j in sched.meta.get("overlap_pairs", ()) if r == me}
        run_passes, run_p2p = passes, p2p
        if prof is not None:
            prof.ignore_parameters(prm for m in models for prm in m.parameters())
            run_passes, run_p2p = prof.instrument(passes, p2p)
        try:
            completed = execute(sched.orders[me], me, pl, run_passes, run_p2p, forward_only=forward_only,
                                overlap_pairs=pairs, validate=validate)
        finally:
            for stack in sync_off.values():
                stack.close()
        if completed:
            for q in queues:
                q.assert_empty()
        else:
            for q in queues:
                q.clear()
        if offload is not None and not completed:
            offload.discard()  # post-validation drained the rest of the iteration
        elif offload is not None:
            self.offload_stats = dict(offload.end_iteration(), offload_time=self.options.offload_time)
            if prof is not None:
                prof.offload_stats.append(self.offload_stats)
        if replicated:
            for it in run_iters:
                it.drain(num_microbatches)
            if sync is not None:
                sync.finish()
                for c in deferred_grad_sync:
                    grad_sync[c](models[c].parameters())
            forward_data_store = _merge_losses(forward_data_store, mb_of_entry, pl, me, pp_group)
            if config.calculate_per_token_loss and not forward_only:
                dist.all_reduce(total_num_tokens, group=pp_group)  # the loss stages of every path
        return forward_data_store, total_num_tokens, completed


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _per_chunk(fn, n):
    if fn is None:
        return [None] * n
    if isinstance(fn, (list, tuple)):
        if len(fn) != n:
            raise ZeroBubbleConfigError(f"config has {len(fn)} per-chunk sync functions for {n} model chunks")
        return list(fn)
    return [fn] * n


def _model_type(model):
    from megatron.core.utils import get_model_type
    return get_model_type(model)


def _groups_of(pg_collection, p2p_communicator):
    from megatron.core import parallel_state as ps
    if pg_collection is not None:
        return pg_collection.pp, getattr(pg_collection, "tp", None), getattr(pg_collection, "cp", None)
    if p2p_communicator is not None and getattr(p2p_communicator, "pp_group", None) is not None:
        return p2p_communicator.pp_group, ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    return (ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group(),
            ps.get_context_parallel_group())


def _call_finalize(config, models, num_tokens, pg_collection, force_all_reduce):
    fn = config.finalize_model_grads_func
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    kw = {}
    if "pg_collection" in params and pg_collection is not None:
        kw["pg_collection"] = pg_collection
    if "force_all_reduce" in params:
        kw["force_all_reduce"] = force_all_reduce
    fn(models, num_tokens, **kw)


def _check_forward_order(sched: Schedule) -> None:
    """Megatron's data iterators are read in order: each stage's forwards must run mb 0, 1, ...
    (with replicated stages: its path's microbatches in increasing order)."""
    routed = sched.placement.replicated
    for r, order in enumerate(sched.flat().orders):
        nxt = {}
        for i, a in enumerate(order):
            if a.kind == F:
                want = nxt.get(a.stage, 0)
                if (a.mb < want) if routed else (a.mb != want):
                    raise ZeroBubbleConfigError(
                        f"rank {r} position {i}: {a} runs before F{a.stage}.{want}; the runtime reads "
                        "each stage's data iterator in order, so forwards must follow microbatch order")
                nxt[a.stage] = want + 1


class _RoutedIterator:
    """A chunk's data iterator where the chunk sees only some microbatches (replicated stages):
    reading microbatch ``target`` skips the items of the microbatches routed to other replicas,
    and ``drain(m)`` skips the rest of the iteration's m items, so every chunk that reads data
    consumes exactly m items per call, as Megatron expects. A chunk that never reads (a middle
    stage whose ``forward_step_func`` ignores the iterator) consumes nothing."""

    def __init__(self, it):
        self.it = it
        self.pos = 0  # items consumed in this call
        self.target = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.it is None:
            raise StopIteration
        while self.pos < self.target:
            next(self.it)
            self.pos += 1
        self.pos += 1
        return next(self.it)

    def drain(self, m: int) -> None:
        if self.it is None or self.pos == 0:
            return
        while self.pos < m:
            next(self.it)
            self.pos += 1


def _check_replicas_equal(models, stages, pl: Placement, groups) -> None:
    """Replicas must start identical (a fingerprint of each chunk's weights, compared once)."""
    for c in sorted(range(len(models)), key=lambda c: pl.logical(stages[c])):
        group = groups.group(pl.logical(stages[c]))
        if group is None:
            continue
        with torch.no_grad():
            acc = torch.zeros(2, dtype=torch.float64)
            for i, prm in enumerate(models[c].parameters()):
                x = prm.detach().double().reshape(-1).cpu()
                acc[0] += x.sum()
                acc[1] += (x * torch.arange(1, x.numel() + 1, dtype=torch.float64)).sum() * (i + 1)
        if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
            acc = acc.cuda()
        lo, hi = acc.clone(), acc.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            raise ZeroBubbleConfigError(
                f"the replicas of logical stage {pl.logical(stages[c])} (global ranks "
                f"{dist.get_process_group_ranks(group)}) start with different weights; build them identically "
                "(megatron_zb.megatron.placement.deterministic_init_, --zero-bubble-deterministic-init) or copy "
                "one replica into the other before creating the optimizer")


def _merge_losses(store, mb_of_entry, pl: Placement, me: int, pp_group):
    """Replicated stages: every path's loss stage holds its own microbatches' loss dicts; send them to
    ``pl.loss_rank`` and return them there in microbatch order (elsewhere: [])."""
    dst = pl.loss_rank
    holders = sorted({pl.rank_of(pl.path(k)[-1]) for k in range(pl.num_paths)} - {dst})
    if me not in holders and me != dst:
        return store
    ranks = dist.get_process_group_ranks(pp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if me != dst:
        dist.send_object_list([[(mb, _to_cpu(e)) for mb, e in zip(mb_of_entry, store)]], dst=ranks[dst],
                              group=pp_group, device=device)
        return []
    tagged = list(zip(mb_of_entry, store))
    for src in holders:
        box = [None]
        dist.recv_object_list(box, src=ranks[src], group=pp_group, device=device)
        tagged += [(mb, _to_device(e)) for mb, e in box[0]]
    tagged.sort(key=lambda x: x[0])
    return [e for _, e in tagged]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _to_device(obj):
    if not torch.cuda.is_available():
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: _to_device(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v) for v in obj)
    return obj


def _check_offload_options(o: ScheduleOptions) -> None:
    if o.offload_ratio is None:
        return
    r = o.offload_ratio
    if r != "auto" and not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1):
        raise ZeroBubbleConfigError(f"offload_ratio must be a number in 0..1 or 'auto', got {r!r}")
    if r == "auto" and o.memory_limit is None:
        raise ZeroBubbleConfigError("offload_ratio='auto' offloads as little as fits memory_limit: give memory_limit")
    k = o.offload_time
    if k != "auto" and not (isinstance(k, (int, float)) and not isinstance(k, bool) and 0 <= k < float("inf")):
        raise ZeroBubbleConfigError(f"offload_time must be a number >= 0 or 'auto', got {k!r}")
    if o.offload_chunks is not None and (not isinstance(o.offload_chunks, int) or o.offload_chunks < 1):
        raise ZeroBubbleConfigError(f"offload_chunks must be an integer >= 1, got {o.offload_chunks!r}")
    if not torch.cuda.is_available() and not o.offload_cpu_test:
        raise ZeroBubbleConfigError(
            "activation offload moves activations from the GPU to host memory, and this machine has no CUDA "
            "device; without a GPU it only runs in its CPU test mode (offload_cpu_test=True, "
            "--zero-bubble-offload-cpu-test), which checks correctness, not speed")


def _check_config(config, models, name):
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ZeroBubbleConfigError(f"{name}: overlap_moe_expert_parallel_comm (megatron's combined-1F1B "
                                    "EP overlap) is not supported together with a megatron-zb schedule")
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise ZeroBubbleConfigError(f"{name}: num_microbatches_with_partial_activation_checkpoints is "
                                    "not supported by the megatron-zb runtime")


# -- install / uninstall ---------------------------------------------------------------------

@dataclasses.dataclass
class InstallHandle:
    forward_backward: ZeroBubbleForwardBackward
    _restore: List = dataclasses.field(default_factory=list)

    @property
    def post_validation(self):
        """The pipeline side of optimizer post-validation (``runtime.postval.PostValidation``), or
        None when installed without ``post_validation=True``."""
        return self.forward_backward.post_validation

    def post_validated_optimizer(self, optimizer, model_chunks, **kw):
        """Attach optimizer post-validation to Megatron's ``optimizer`` (``megatron.optimizer``;
        ``kw``: min_clean_steps, log, pp_group). Returns the ``PostValidator``."""
        if self.post_validation is None:
            raise ZeroBubbleConfigError("post_validated_optimizer() needs install(..., post_validation=True)")
        from .optimizer import PostValidationError, post_validated
        try:
            return post_validated(optimizer, model_chunks, self.post_validation, **kw)
        except PostValidationError as e:
            raise ZeroBubbleConfigError(str(e)) from None

    def uninstall(self) -> None:
        for mod, name, old in reversed(self._restore):
            setattr(mod, name, old)
        self._restore.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()


def install(schedule: str, *, chunks: Optional[int] = None, memory_limit: Optional[float] = None,
            **options) -> InstallHandle:
    """Make megatron's ``get_forward_backward_func()`` return a megatron-zb schedule runner.

    Raises ``ZeroBubbleConfigError`` for an unknown schedule or bad options (before anything is
    patched). ``options``: cost_f, cost_b, cost_w, cost_comm, mem_w (schedule tuning),
    timeout_s (how long a rank waits for a message before failing with its rank, pass and peer),
    profile_window=(start, end) and profile_path (``runtime.profiler``: time F/B/W/p2p over those
    training iterations, write the profile JSON; zb-auto*/v-auto* re-plan from it afterwards),
    post_validation=True (optimizer post-validation: then attach it to Megatron's optimizer with
    ``handle.post_validated_optimizer(optimizer, model_chunks)``).
    """
    known = {f.name for f in dataclasses.fields(ScheduleOptions)} - {"schedule", "chunks", "memory_limit"}
    bad = sorted(set(options) - known)
    if bad:
        raise ZeroBubbleConfigError(f"unknown install option(s) {bad}; known: {sorted(known)}")
    fb = ZeroBubbleForwardBackward(ScheduleOptions(schedule, chunks, memory_limit, **options))
    import megatron.core.pipeline_parallel as mpp
    from megatron.core.pipeline_parallel import schedules as S
    original = S.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        pp_size = kwargs.get("pp_size", args[0] if args else None)
        if pp_size is None:
            from megatron.core import parallel_state as ps
            pp_size = ps.get_pipeline_model_parallel_world_size()
        if pp_size is not None and pp_size <= 1:
            return original(*args, **kwargs)
        return fb

    get_forward_backward_func.__wrapped__ = original
    handle = InstallHandle(fb)
    targets = [mpp, S]
    try:
        import megatron.training.training as T  # 0.17+: megatron.training ships in the wheel
        targets.append(T)
    except Exception:
        pass
    for mod in targets:
        if hasattr(mod, "get_forward_backward_func"):
            handle._restore.append((mod, "get_forward_backward_func", getattr(mod, "get_forward_backward_func")))
            setattr(mod, "get_forward_backward_func", get_forward_backward_func)
    return handle
