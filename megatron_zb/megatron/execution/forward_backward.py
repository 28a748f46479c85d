"""Megatron's forward-backward function, running a megatron-zb schedule.

``ZeroBubbleForwardBackward`` keeps megatron-core's keyword signature; ``install()`` makes Megatron's
``get_forward_backward_func()`` return it. One call is one training (or evaluation) iteration:

1. the schedule for (pipeline size, microbatches, chunks) from ``core.build`` (cached; lowered);
2. this call's context (``_Call``): models, data, groups, the activation shape, the hooks;
3. an attempt: Megatron's passes (``megatron.execution.passes``) run by ``runtime.executor`` with the
   runtime features as hooks (progress, gradient sync, post-validation, offload, profiler); a
   second attempt only after a post-validation rollback;
4. the profile window's end (re-planning the automatic schedules), ``finalize_model_grads``.

State kept across iterations (none of it module-level): the built schedules, the pairwise process
groups, one W queue per model chunk, the offload manager, the profiler and post-validation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ...core.build import Built, build
from ...core.ir import F, Placement, Schedule, ScheduleError
from ...runtime.executor import execute, rank_pairs
from ...runtime.observe.memory import ActivationMeter, MemoryHook, measured_memory
from ...runtime.features.offload_hook import OffloadHook
from ...runtime.p2p import P2P, PairGroups
from ...runtime.features.postval import PostValidation, ValidationPoint, replayable
from ...runtime.observe.profile_data import ProfileError, auto_replans, profile_to_setting_kwargs
from ...runtime.observe.profiler import PassProfiler, WindowCall
from ...runtime.observe.progress import tracker as progress_tracker
from ...runtime.features.replica import ReplicaGradSync, ReplicaGroups
from ...runtime.wqueue import WQueue
from ..errors import ZeroBubbleConfigError
from .finalize import call_finalize
from .gradsync import GradSync
from .options import ScheduleOptions, check_ep_overlap
from .passes import MegatronPasses, MegatronStep, device
from ..layout.routing import check_replicas_equal, merge_losses
from .wgrad import attach_wgrad_queue, fused_weights

__all__ = ["ZeroBubbleForwardBackward"]


@dataclasses.dataclass
class _Call:
    """One call of the forward-backward function: what every attempt at it needs."""

    step: MegatronStep  # what Megatron passed, as the passes read it
    schedule: Schedule  # lowered
    me: int  # pipeline rank
    pp_group: Any
    pp_ranks: List[int]
    p2p: P2P
    queues: List[WQueue]
    shape: List[int]
    # the features of every attempt, as executor hooks (runtime.hooks); None where off
    progress: Any = None
    offload: Optional[OffloadHook] = None
    profiling: Any = None
    memory: Optional[MemoryHook] = None
    attached: List[Any] = dataclasses.field(default_factory=list)  # hooks of the features attach() added

    @property
    def placement(self) -> Placement:
        return self.schedule.placement


class ZeroBubbleForwardBackward:
    """Megatron's forward_backward_func signature, running a schedule from the core."""

    def __init__(self, options: ScheduleOptions):
        try:
            self.spec = options.spec
        except ScheduleError as e:
            raise ZeroBubbleConfigError(str(e)) from None
        options.check(cuda=torch.cuda.is_available())
        self.options = options
        self._built: Dict[tuple, Built] = {}
        self._groups: Dict[tuple, PairGroups] = {}
        self._replica_groups: Dict[tuple, ReplicaGroups] = {}
        self._replicas_checked = False
        self._queues: Dict[int, WQueue] = {}
        self.last_schedule: Optional[Schedule] = None  # the lowered schedule of the last call
        self.last_training_schedule: Optional[Schedule] = None  # ... of the last training call
        self.post_validation: Optional[PostValidation] = (
            PostValidation(options.timeout_s) if options.post_validation else None)
        self.iterations = 0  # forward-backward calls with forward_only=False
        self.profile: Optional[dict] = None  # the gathered profile once the window has ended
        self.offload = None  # runtime.features.offload.OffloadManager, made at the first training call
        self.offload_stats: Optional[dict] = None  # the manager's counts of the last iteration
        self.memory: Optional[dict] = None  # runtime.observe.memory: the last measured training iteration
        self.overlapped_pairs = 0  # --overlap-moe-expert-parallel-comm: pairs run as one pass, last iteration
        self.offload_time_measured: Optional[dict] = None  # --auto-offload-time's measurement
        self.vocab = None  # vocabulary parallelism: megatron.vocab_parallel.VocabParallel, made at the first call
        self.balancer = None  # --zero-bubble-balance-microbatches: megatron.balanced.MicrobatchBalancer
        self.profiler = None
        self.attached: List[Callable] = []  # attach(): factories (built, pipeline rank) -> Hook | None
        if options.profile_window is not None:
            try:
                self.profiler = PassProfiler(options.profile_window, options.profile_path, schedule=options.schedule)
            except ProfileError as e:
                raise ZeroBubbleConfigError(str(e)) from None

    def attach(self, hook_for: Callable) -> None:
        """A feature's executor hook for every training call: ``hook_for(built, pipeline rank)``."""
        self.attached.append(hook_for)

    def replan_from(self, profile: dict) -> None:
        """Take the cost options (F/B/W per stage, comm, mem_w ratio) from a profile and drop the
        built schedules: the next call builds the schedule again from the measured costs. Every
        pipeline rank must call it at the same iteration (it does, after the window)."""
        kw = profile_to_setting_kwargs(profile, normalize=True, per_chunk=True)
        upd = {k: kw[k] for k in ("cost_f", "cost_b", "cost_w", "cost_comm")}
        upd["cost_bw"] = kw.get("cost_bw")  # the fused backward as measured, where the run had one
        if "mem_f" in kw and len(kw["mem_f"]) == len(kw["cost_f"]) and len(kw["cost_f"]) != profile.get("stages", len(kw["cost_f"])):
            upd["mem_f"], upd["mem_w"] = kw["mem_f"], kw["mem_w"]  # each chunk's own (in units of the fullest rank)
        elif "mem_f" in kw:
            ratios = sorted(w / f for f, w in zip(kw["mem_f"], kw["mem_w"]) if f > 0)
            if ratios:
                upd["mem_w"] = ratios[len(ratios) // 2]  # above 1 with full recompute
        if self.options.vocab_parallel is not None and "vocab_cost_s" in kw:  # the vocabulary passes, measured
            # (their barriers' communication stays the model's estimate, in units of a stage's F)
            upd["vocab_costs"] = dict(self.options.vocab_costs or {}, cost_s=kw["vocab_cost_s"],
                                      cost_t=kw["vocab_cost_t"], cost_w=kw["vocab_cost_w"])
        self._replace_options(**upd)

    def _replace_options(self, **changes) -> None:
        self.options = dataclasses.replace(self.options, **changes)
        self._built.clear()

    # -- schedule ---------------------------------------------------------------------------
    def built_for(self, p: int, m: int, chunks: int, forward_only: bool) -> Built:
        """The schedule for ``p`` ranks, ``m`` microbatches and the ``chunks`` model chunks per rank
        Megatron built (evaluation: without offload; its lowered form drops the backwards)."""
        key = (p, m, chunks, forward_only)
        if key not in self._built:
            o = self.options
            try:
                req = o.request()
                c = self.spec.resolve_chunks(req.chunks)
            except ScheduleError as e:
                raise ZeroBubbleConfigError(str(e)) from None
            want = self.spec.models(c)
            if want != chunks:
                how = (f", i.e. virtual pipeline size {want} in the order of "
                       f"megatron_zb.megatron.layout.placement.make_placement('bitpipe', {p}))" if self.spec.models_per_rank
                       else ", i.e. virtual pipeline size 2 in V order)" if self.spec.chunks == 2 else ")")
                raise ZeroBubbleConfigError(
                    f"schedule {o.schedule} runs {want} model chunk(s) per rank, but Megatron passed {chunks} "
                    f"(build the model with {want} chunk(s) per pipeline rank" + how)
            try:
                built = build(req.replace(chunks=c if self.spec.chunks is None else None,
                                          offload=None if forward_only else req.offload), p, m)
            except ScheduleError as e:
                raise ZeroBubbleConfigError(f"{o.schedule} with pipeline size {p}, {m} microbatches: {e}") from None
            _check_forward_order(built.schedule)
            if o.ep_overlap and not forward_only:
                check_ep_overlap(built)
            self._built[key] = built
        return self._built[key]

    def schedule_for(self, p: int, m: int, chunks: int, forward_only: bool) -> Schedule:
        """This call's lowered schedule (``built_for``, with SEND/RECV)."""
        return self.built_for(p, m, chunks, forward_only).lowered(forward_only)

    def queue(self, chunk_module) -> WQueue:
        key = id(chunk_module)
        if key not in self._queues:
            q = WQueue(name=f"chunk {len(self._queues)}")
            attach_wgrad_queue(chunk_module, q)
            _say_fused(chunk_module, q.name)
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
        """One iteration. The keywords are megatron-core's own forward-backward signature, as Megatron's
        training loop calls ``get_forward_backward_func()``'s result: they cannot be grouped."""
        from megatron.core.pipeline_parallel import schedules as S
        from megatron.core.utils import get_model_config

        if unsupported:
            raise ZeroBubbleConfigError(f"megatron-zb forward_backward got unsupported arguments "
                                        f"{sorted(unsupported)}")
        if not forward_only:
            self.iterations += 1
        models = model if isinstance(model, list) else [model]
        config = get_model_config(models[0])
        pp_group, tp_group, cp_group = _groups_of(pg_collection, p2p_communicator)
        p = pp_group.size()
        if p == 1:
            return S.forward_backward_no_pipelining(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step)
        _check_config(config, self.options.schedule)
        if collect_non_loss_data and self.options.vocab_parallel is not None:
            raise ZeroBubbleConfigError("--enable-vocab-parallel: collect_non_loss_data (a forward step that returns "
                                        "the logits, e.g. Megatron's non-loss evaluation data) cannot run: no rank holds "
                                        "the whole output layer's logits; drop it or the flag")
        if getattr(config, "overlap_moe_expert_parallel_comm", False) and not self.options.ep_overlap:
            self._replace_options(ep_overlap=True)  # Megatron's flag in the model config: the same option
        o = self.options
        if o.offload_ratio is not None and o.offload_time == "auto" and not forward_only:
            from ..features.offload import measure_offload_time  # --auto-offload-time: measured once, here
            self.offload_time_measured = measure_offload_time(config, seq_length, micro_batch_size, tp_group, cp_group)
            self._replace_options(offload_time=self.offload_time_measured["offload_time"])
        balanced = None
        if o.balance_microbatches and not forward_only:  # this iteration's batch over replicas and microbatches
            balanced = self._balance(data_iterator, models, num_microbatches, config, p, seq_length)
            data_iterator, num_microbatches = balanced.iterators, balanced.num_microbatches
        shape = self._shape(config, seq_length, decoder_seq_length, micro_batch_size, tp_group, cp_group,
                            adjust_tensor_shapes_fn)
        built = (balanced.built if balanced is not None
                 else self.built_for(p, num_microbatches, len(models), forward_only))
        if built.schedule.placement.replicated and not isinstance(data_iterator, list) and len(models) > 1 \
                and data_iterator is not None:
            raise ZeroBubbleConfigError(f"{o.schedule}: replicated stages need one data iterator per model chunk "
                                        "(a list, as Megatron passes for virtual pipelines)")
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(models)
        step = MegatronStep(forward_step_func, list(iters), models, num_microbatches, config,
                            cp_group.size() if cp_group is not None else 1, forward_only, collect_non_loss_data,
                            first_val_step)
        call = self._call(step, pp_group, shape, built)
        if balanced is not None and call.profiling is not None:  # the window times passes of several lengths
            self.profiler.shapes = balanced.shapes()
        pv = self.post_validation
        if pv is not None and forward_only:
            pv.finish()  # evaluation sees validated weights
        point = ValidationPoint(pv) if (pv is not None and pv.due and not forward_only) else None
        if point is not None:
            call.step.iterators = replayable(call.step.iterators)  # a rolled-back iteration: the same data again
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        while True:  # one attempt; a second one only after a post-validation rollback
            store, num_tokens, completed = self._attempt(call, point)
            if completed:
                break
            pv.recover()  # restore the eager step and redo it exactly as Megatron's synchronous step
            for m in models:
                if hasattr(m, "zero_grad_buffer"):
                    m.zero_grad_buffer()
            for it in call.step.iterators:
                if it is not None:
                    it.rewind()
            point = None
        self._end_profile_window(call, forward_only, seq_length)
        if config.finalize_model_grads_func is not None and not forward_only:
            call_finalize(config, models, num_tokens if config.calculate_per_token_loss else None,
                           pg_collection, force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return store

    def _shape(self, config, seq_length, decoder_seq_length, micro_batch_size, tp_group, cp_group, adjust):
        """The activation shape on the pipeline: [sequence (/CP, /TP with sequence parallel), micro-batch, hidden]."""
        seq = decoder_seq_length if decoder_seq_length is not None else seq_length
        seq = seq // (cp_group.size() if cp_group is not None else 1)
        if config.sequence_parallel:
            seq = seq // tp_group.size()
        shape = [seq, micro_batch_size, config.hidden_size]
        if adjust is not None:
            recv_shapes, _ = adjust([shape], [shape])
            shape = list(recv_shapes[0])
        return shape

    def _balance(self, data_iterator, models, m, config, p, seq_length):
        from megatron.core import parallel_state as ps

        from ..features.balanced import MicrobatchBalancer, check_balance_config
        if self.balancer is None:
            check_balance_config(config, self.options, self.built_for(p, m, len(models), False).schedule.placement)
            self.balancer = MicrobatchBalancer(self.options)
        if not isinstance(data_iterator, list) and len(models) > 1 and data_iterator is not None:
            raise ZeroBubbleConfigError("--zero-bubble-balance-microbatches with several model chunks per rank needs one "
                                        "data iterator per chunk (a list, as Megatron passes for virtual pipelines)")
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        out = self.balancer(iters, m, p, config, seq_length, ps.get_data_parallel_group(),
                            ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        _check_forward_order(out.built.schedule)
        if not isinstance(data_iterator, list):
            out.iterators = out.iterators[0]
        return out

    def _call(self, step: MegatronStep, pp_group, shape: List[int], built: Built) -> _Call:
        """This call's context: the lowered schedule of ``built``, the groups, the hooks of its features."""
        models, forward_only, config, me = step.models, step.forward_only, step.config, pp_group.rank()
        sched = built.lowered(forward_only)
        self.last_schedule = sched
        if not forward_only:
            self.last_training_schedule = sched
        pl = sched.placement
        pp_ranks = dist.get_process_group_ranks(pp_group)
        prog = progress_tracker(pp_rank=me, group=pp_ranks)
        if prog is not None:
            prog.iteration = self.iterations
        p2p = P2P(self.groups(pp_ranks, pl), me, timeout_s=self.options.timeout_s,
                  exchange_shapes=bool(config.variable_seq_lengths), progress=prog)
        if pl.replicated:
            if self.post_validation is not None:
                raise ZeroBubbleConfigError(f"{self.options.schedule}: optimizer post-validation is not supported "
                                            "with replicated stages yet; train it with the synchronous optimizer step")
            if not forward_only and not self._replicas_checked:
                check_replicas_equal(models, pl.stages_of(me), pl, self.replica_groups(pp_ranks, pl))
                self._replicas_checked = True
        queues = [self.queue(mod) for mod in models] if not forward_only else []
        offload = profiling = memory = None
        if not forward_only:
            offload = self._offload_hook(models, queues, pl, me)
            prof = self.profiler
            in_window = prof is not None and prof.in_window(self.iterations)
            if self.options.measure_memory or in_window:
                memory = self._memory_hook(models, queues, pl, me, offload)
            if in_window:
                prof.ignore_parameters(prm for mod in models for prm in mod.parameters())
                # the F's saved tensors are already captured (nested capture hooks hide each other)
                source = offload.manager if offload is not None else memory.meter
                profiling = prof.hook(device(), offload=source)
        attached = [h for f in self.attached for h in [f(built, me)] if h is not None] if not forward_only else []
        return _Call(step, sched, me, pp_group, pp_ranks, p2p, queues, shape, prog, offload, profiling, memory,
                     attached)

    def _memory_hook(self, models, queues, pl: Placement, me: int, offload: Optional[OffloadHook]) -> MemoryHook:
        meter = ActivationMeter()
        meter.ignore(prm for mod in models for prm in mod.parameters())
        chunk_of = {s: i for i, s in enumerate(pl.stages_of(me))}
        dev = device()
        return MemoryHook(meter, cuda=dev.type == "cuda", offload=offload.manager if offload is not None else None,
                          w_tensors=lambda stage, mb: queues[chunk_of[stage]].held_tensors(mb))

    def _offload_hook(self, models, queues, pl: Placement, me: int) -> Optional[OffloadHook]:
        if self.options.offload_ratio is None:
            return None
        from ..features.offload import make_manager, point_manager
        if self.offload is None:
            self.offload = make_manager(self.options, device())
        point_manager(self.offload, models, queues, {s: i for i, s in enumerate(pl.stages_of(me))})
        return OffloadHook(self.offload)

    def _attempt(self, call: _Call, point: Optional[ValidationPoint]):
        """Run this rank's list once; returns (forward data, token count, completed)."""
        pl, me, step = call.placement, call.me, call.step
        chunk_of = {s: i for i, s in enumerate(pl.stages_of(me))}
        passes = MegatronPasses(step, queues=call.queues, chunk_of=chunk_of, placement=pl,
                                ep_overlap=self.options.ep_overlap)
        sync = None
        if self.options.vocab_parallel is not None:  # every rank's vocabulary shard (evaluating too)
            from ..features.vocab_embedding import setup_vocab_passes  # (the input embedding's rows too)
            self.vocab = setup_vocab_passes(self.vocab, self.options, pl, step.models, step.config, passes, device(),
                                            step.forward_only)
        if not step.forward_only:
            replicas = (ReplicaGradSync(self.replica_groups(call.pp_ranks, pl), timeout_s=self.options.timeout_s)
                        if pl.replicated else None)
            sync = GradSync(step.config, step.models, chunk_of, pl, replicas)
        # the profiler reads the captured bytes after the inner capture (memory around offload) finished
        hooks = [call.progress, sync, point, call.profiling, call.memory, call.offload] + call.attached
        pairs = rank_pairs(call.schedule, me)
        try:
            completed = execute(call.schedule.orders[me], me, pl, passes.stage_passes(call.shape),
                                call.p2p, forward_only=step.forward_only, overlap_pairs=pairs, hooks=hooks)
        finally:
            if sync is not None:
                sync.close()
        if passes.plans is not None:
            if completed and self.iterations == 1:
                _say(f"megatron-zb: pipeline rank {me}: EP all-to-all overlap (--overlap-moe-expert-parallel-comm): "
                     f"every pass through megatron-core's schedule plans, {passes.plans.pairs_run} overlapped F&B "
                     "pair(s) per iteration run as one pass")
            self.overlapped_pairs = passes.plans.pairs_run
        for q in call.queues:
            if completed:
                q.assert_empty()
            else:
                q.clear()
        if passes.vocab is not None and completed:
            passes.vocab.finish()
        if call.memory is not None and completed:
            self.memory = measured_memory(call.memory.result, call.schedule.orders[me])
        if call.offload is not None and completed:
            self.offload_stats = dict(call.offload.stats, offload_time=self.options.offload_time)
            prof = self.profiler
            if prof is not None and prof.in_window(self.iterations):
                prof.offload_stats.append(self.offload_stats)
        store = passes.forward_data_store
        if pl.replicated:
            passes.drain_iterators()
            if sync is not None:
                sync.finish_replicas()
            store = merge_losses(store, passes.mb_of_entry, pl, me, call.pp_group)
            if step.config.calculate_per_token_loss and not step.forward_only:
                dist.all_reduce(passes.total_num_tokens, group=call.pp_group)  # the loss stages of every path
        return store, passes.total_num_tokens, completed

    def _end_profile_window(self, call: _Call, forward_only: bool, seq_length: int) -> None:
        prof = self.profiler
        if prof is None or forward_only or not prof.in_window(self.iterations):
            return
        prof.memory = self.memory
        profile = prof.end_iteration(self.iterations, WindowCall(
            placement=call.placement, num_microbatches=call.step.num_microbatches, rank=call.me, group=call.pp_group,
            p2p=call.p2p, shape=call.shape, dtype=call.step.config.pipeline_dtype, device=device(),
            schedule=self.options.schedule, built=call.schedule))
        if profile is not None:
            self.profile = profile
            _say_memory(call.me, self.memory)
            if self.balancer is not None:  # the length cost model from the window's passes (agreed next call)
                _say(f"megatron-zb: pipeline rank {call.me}: " + self.balancer.calibrate(profile, seq_length))
            if auto_replans(self.options.schedule):
                self.replan_from(profile)


def _groups_of(pg_collection, p2p_communicator):
    from megatron.core import parallel_state as ps
    if pg_collection is not None:
        return pg_collection.pp, getattr(pg_collection, "tp", None), getattr(pg_collection, "cp", None)
    if p2p_communicator is not None and getattr(p2p_communicator, "pp_group", None) is not None:
        return p2p_communicator.pp_group, ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    return (ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group(),
            ps.get_context_parallel_group())


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


def _check_config(config, name):
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise ZeroBubbleConfigError(f"{name}: num_microbatches_with_partial_activation_checkpoints is "
                                    "not supported by the megatron-zb runtime")


def _say(line: str) -> None:
    """Print once per pipeline rank: on its first data- and tensor-parallel rank."""
    from megatron.core import parallel_state
    if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
        print(line, flush=True)


def _say_fused(chunk_module, name: str) -> None:
    """One line per pipeline rank and chunk naming the matrix weights whose gradient stays in B
    (correct, just not moved into W)."""
    fused = fused_weights(chunk_module)
    if fused:
        from megatron.core import parallel_state
        _say(f"megatron-zb: pipeline rank {parallel_state.get_pipeline_model_parallel_rank()} {name}: weight "
             f"gradients computed in B, not deferred to W: {', '.join(fused)}")


def _say_memory(pp_rank: int, memory: Optional[dict]) -> None:
    """At the end of the profile window, one line per pipeline rank: its activation peak as
    measured and as the simulator predicts it."""
    if memory is not None:
        m, p = memory["measured_peak_bytes"], memory["predicted_peak_bytes"]
        _say(f"megatron-zb: pipeline rank {pp_rank}: activations peak {m / 2**20:.3f} MiB measured, "
             f"{p / 2**20:.3f} MiB predicted ({100 * (m / p - 1) if p else 0.0:+.1f}%; {memory['method']})")
