"""megatron-zb inside a user's own, unmodified Megatron-LM training script.

    torchrun ... -m megatron_zb.run path/to/pretrain_gpt.py <Megatron flags> <megatron-zb flags>

or, in the script itself (what ``patches/`` add), before it parses its arguments::

    from megatron_zb.megatron import dropin
    dropin.enable()

``enable()`` changes names in Megatron's modules (never its files), so that the script's own flow
runs megatron-zb:

1. **Flags.** ``megatron.training.arguments.add_megatron_arguments`` also adds megatron-zb's flags
   (ours, the ZB authors' fork's, ``--zero-bubble-deterministic-init``); a parse error is one line.
2. **Validation.** Megatron's ``validate_args`` first validates ours (``megatron.launch.flags``; before
   Megatron's own, so a V schedule gets two virtual stages per rank), applies this machine's
   adjustments without CUDA (said in one line: gloo, the local transformer, no fused kernels,
   fp32), then runs Megatron's checks; a failed check is one line, before Megatron's argument dump.
3. **Training.** After validation a ``TrainingSession`` starts (``megatron.launch.session``): the schedule
   installed and announced, losses handed to the rank Megatron logs them on, post-validation,
   the placement recorded in checkpoints, the stall watch.
4. **Placements Megatron does not have** (V schedules, BitPipe), built through Megatron's own model
   construction: ``get_model`` calls the script's ``model_provider`` once per chunk with the
   chunk's ``pre_process``/``post_process``/``vp_stage`` and a config whose layer table numbers
   the chunk's layers globally (0.19+: the same inside the model builders,
   ``unimodal_build_distributed_models``); the stage predicates Megatron asks per virtual stage
   (``parallel_state.is_pipeline_first/last_stage``) answer from the placement, so data and
   datasets go to the chunks that embed and compute the loss; the embedding group is the rank
   holding both the embedding and the tied output layer; ``finalize_model_grads`` sums those
   two copies.

Without CUDA Megatron's CUDA-only spots are shimmed first (``megatron.cpu.cpu_shims``), as in
megatron-zb's own entry point.
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
from functools import partial
from typing import Callable, List, Optional

from .launch.args import add_zero_bubble_args
from .features.flags.balance import after_megatron_validation
from .launch.chunks import ChunkPlan
from .errors import ZeroBubbleArgumentError
from .launch.flags import validate_zero_bubble_args
from .launch.session import TrainingSession, print0, start_up_done
from .launch.startup import (MegatronTrainingMissing, add_entry_args, check_load, check_sizes, cuda, machine_adjustments,
                      megatron_check_message, microbatches)

__all__ = ["DropIn", "enable"]


def _rebind(original, replacement, only=None) -> Callable[[], None]:
    """Put ``replacement`` wherever a loaded megatron module or the running script binds
    ``original`` (modules that imported it by name included; ``only``: in that module alone);
    returns the undo."""
    done = []
    for name, mod in ([(only.__name__, only)] if only is not None else list(sys.modules.items())):
        if mod is None or not (name in ("megatron", "__main__") or name.startswith("megatron.")):
            continue
        for attr, value in list(getattr(mod, "__dict__", {}).items()):
            if value is original:
                setattr(mod, attr, replacement)
                done.append((mod, attr))

    def undo():
        for mod, attr in done:
            if getattr(mod, attr, None) is replacement:
                setattr(mod, attr, original)
    return undo


class DropIn:
    """What ``enable()`` installed, and the session it starts after validation."""

    def __init__(self, route: str):
        self.route = route
        self.session: Optional[TrainingSession] = None
        self.plan: Optional[ChunkPlan] = None
        self._undos: List[Callable[[], None]] = []
        self._finished = False

    # -- 1 and 2: flags and validation ------------------------------------------------------------
    def enable(self) -> "DropIn":
        from .cpu import cpu_shims
        cpu_shims.python_compat()
        if not cuda():
            cpu_shims.apply()
        try:
            import megatron.training.arguments as A
            import megatron.training.initialize  # noqa: F401 - it binds parse_args / validate_args by name
        except ImportError as e:
            if (getattr(e, "name", None) or "").startswith("megatron"):
                raise MegatronTrainingMissing(f"megatron-zb's drop-in needs megatron.training (a Megatron-LM checkout's "
                                              f"script, or megatron-core >= 0.17 with its training package): {e}") \
                    from None
            raise MegatronTrainingMissing(f"importing Megatron's training package failed: {e}; install what your "
                                          "Megatron-LM needs (its requirements)") from None
        active = getattr(A.validate_args, "mzb_dropin", None)
        if active is not None:  # a patched script run through the launcher: enabled once
            return active
        cpu_shims.dataset_helpers()
        if not cuda():
            cpu_shims.apply_training()
        self._patch(A.add_megatron_arguments, self._add_arguments(A.add_megatron_arguments))
        self._patch(A.parse_args, self._parse_args(A.parse_args))
        validate = self._validate_args(A.validate_args)
        validate.mzb_dropin = self
        self._patch(A.validate_args, validate)
        atexit.register(self.finish)
        return self

    def _patch(self, original, replacement, only=None) -> None:
        replacement.__wrapped__ = original
        self._undos.append(_rebind(original, replacement, only))

    @staticmethod
    def _add_arguments(orig):
        def add_megatron_arguments(parser):
            parser = orig(parser)
            return add_entry_args(add_zero_bubble_args(parser))
        return add_megatron_arguments

    @staticmethod
    def _parse_args(orig):
        def parse_args(*a, **k):
            saved = argparse.ArgumentParser.error

            def one_line(parser, message):  # not the usage (hundreds of lines) and exit 2 on every rank
                raise ZeroBubbleArgumentError(message)
            argparse.ArgumentParser.error = one_line
            try:
                return orig(*a, **k)
            finally:
                argparse.ArgumentParser.error = saved
        return parse_args

    def _validate_args(self, orig):
        def validate_args(args, *a, **k):
            zb = validate_zero_bubble_args(args, before_megatron_validation=True)
            notes = machine_adjustments(args)
            check_sizes(args)
            check_load(args)
            session = None
            if self.session is None:  # the schedule checked before Megatron prints its arguments
                session = TrainingSession(args, zb, _microbatches(args), route=self.route).check()
            try:
                out = orig(args, *a, **k)
            except (AssertionError, ValueError, TypeError) as e:  # Megatron's own argument checks
                raise ZeroBubbleArgumentError(megatron_check_message(e)) from None
            after_megatron_validation(args)  # variable-length batches: Megatron's variable_seq_lengths
            if notes:
                print0("megatron-zb: adjusted for this machine: " + ", ".join(notes))
            if session is not None:
                self._start(session)
            return out
        return validate_args

    # -- 3 and 4: the session, and placements Megatron does not have -----------------------------------
    def _start(self, session: TrainingSession) -> None:
        start_up_done()  # the script's imports are done: the collector on again (megatron_zb.run)
        self.session = session.start()
        args, zb = session.args, session.zb
        if zb is not None or getattr(args, "zero_bubble_deterministic_init", False):
            self.plan = ChunkPlan(args, self.session.placement)
            self._wrap_model_construction()
            if zb is not None and self.plan.reshapes:
                self._reshape()

    def _wrap_model_construction(self) -> None:
        """Every chunk Megatron builds goes through ``ChunkPlan`` (global names, initial weights;
        for a placement Megatron does not have, its stage, pre/post-process and layers)."""
        import megatron.training.training as T
        self._patch(T.get_model, self._get_model(T.get_model))
        try:
            import megatron.training.models.dist_utils as D
            import megatron.training.models.gpt  # noqa: F401 - binds the builder by name
            self._patch(D.unimodal_build_distributed_models, self._builder(D.unimodal_build_distributed_models))
        except ImportError:
            pass  # before 0.19 every model is built by get_model

    def _reshape(self) -> None:
        """Where the placement is not Megatron's: stage predicates, embedding group, finalize."""
        import megatron.core.parallel_state as ps
        import megatron.training.training as T

        from .execution.finalize import finalize_model_grads_for
        from .layout.placement import embedding_ranks

        plan = self.plan
        self._patch(ps.is_pipeline_first_stage, self._stage_predicate(ps.is_pipeline_first_stage, "pre_process"))
        self._patch(ps.is_pipeline_last_stage, self._stage_predicate(ps.is_pipeline_last_stage, "post_process"))
        get_embedding_ranks = embedding_ranks(plan.placement, plan.vocab_parallel)
        orig_init = ps.initialize_model_parallel

        def initialize_model_parallel(*a, **k):
            k["get_embedding_ranks"] = get_embedding_ranks  # the rank holding the embedding and its tied copy
            return orig_init(*a, **k)
        self._patch(orig_init, initialize_model_parallel)
        for where in ("megatron.core.utils", "megatron.training.utils"):
            fn = getattr(sys.modules.get(where), "get_batch_on_this_tp_rank", None)
            if fn is not None and not hasattr(fn, "__wrapped__"):
                self._patch(fn, self._tp_batch(fn))
        if hasattr(T, "finalize_model_grads"):  # what train() gives the config (<= 0.18); ours calls Megatron's
            self._patch(T.finalize_model_grads, partial(finalize_model_grads_for, placement=plan.placement), only=T)

    def _get_model(self, orig):
        plan = self.plan

        def get_model(model_provider_func, *a, **k):
            def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **kw):
                info = plan.info(vp_stage)
                if plan.reshapes:
                    from megatron.training import get_args
                    from megatron.training.arguments import core_transformer_config_from_args
                    if config is None:
                        config = core_transformer_config_from_args(get_args())
                    plan.prepare_config(config)
                    pre_process, post_process = info.pre_process, info.post_process
                    _describe(plan, info)
                model = model_provider_func(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                                            config=config, pg_collection=pg_collection, **kw)
                plan.finish(model, info)
                return model
            return orig(provider, *a, **k)
        return get_model

    def _builder(self, orig):
        plan = self.plan

        def unimodal_build_distributed_models(build_model_func, transformer_config, *a, **k):
            if plan.reshapes:
                plan.prepare_config(transformer_config)

            def build_model(pg_collection, pre_process=None, post_process=None, vp_stage=None, **kw):
                info = plan.info(vp_stage)
                if plan.reshapes:
                    pre_process, post_process = info.pre_process, info.post_process
                    _describe(plan, info)
                model = build_model_func(pg_collection, pre_process=pre_process, post_process=post_process,
                                         vp_stage=vp_stage, **kw)
                plan.finish(model, info)
                return model
            return orig(build_model, transformer_config, *a, **k)
        return unimodal_build_distributed_models

    def _stage_predicate(self, orig, which: str):
        plan = self.plan

        def predicate(ignore_virtual=True, vp_stage=None):
            if ignore_virtual or vp_stage is None:
                return orig(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            return getattr(plan.info(vp_stage), which)  # the chunk embeds / computes the loss
        return predicate

    def _tp_batch(self, orig):
        """Megatron broadcasts over tensor parallelism only the fields the rank's *physical* stage
        needs (the first: tokens; the last: labels). A rank whose chunks embed or compute the loss
        where its physical stage would not (V: rank 0 does both; BitPipe: every path's ends) needs
        all of them, which Megatron's multi-token-prediction case asks for."""
        import inspect
        sig = inspect.signature(orig)
        plan = self.plan

        def get_batch_on_this_tp_rank(*a, **k):
            from megatron.core import parallel_state as ps
            me, p = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
            infos = [plan.info(c) for c in range(len(plan.placement.stages_of(me)))]
            embeds, loss = any(i.pre_process for i in infos), any(i.post_process for i in infos)
            if "mtp_on_this_rank" in sig.parameters and ((embeds and me != 0) or (loss and me != p - 1)
                                                        or (embeds and loss)):
                bound = sig.bind_partial(*a, **k)
                bound.arguments["mtp_on_this_rank"] = True
                return orig(*bound.args, **bound.kwargs)
            return orig(*a, **k)
        return get_batch_on_this_tp_rank

    # -- the end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The line at the end (rank 0), then every change undone (idempotent)."""
        if self._finished:
            return
        self._finished = True
        if self.session is not None:
            line = self.session.summary()
            if line:
                print0(line)
            self.session.close()
        while self._undos:
            self._undos.pop()()


def _microbatches(args) -> int:
    """Microbatches per iteration, before Megatron's validation has set the data-parallel size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = (int(args.tensor_model_parallel_size or 1) * int(args.pipeline_model_parallel_size or 1)
             * int(getattr(args, "context_parallel_size", 1) or 1))
    return max(1, microbatches(args, max(1, world // model)))


def _describe(plan: ChunkPlan, info) -> None:
    from megatron.core import parallel_state
    if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
        print(" > megatron-zb: " + plan.describe(info, info.pre_process, info.post_process), flush=True)


def enable(route: Optional[str] = None) -> DropIn:
    """Make this process's Megatron training run megatron-zb (see the module docstring). Call it
    before the script parses its arguments. Returns the ``DropIn`` (its ``finish()`` runs at exit)."""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "your script"
    return DropIn(route or f"{script}, drop-in").enable()
