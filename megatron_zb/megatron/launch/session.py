"""megatron-zb inside Megatron's training loop, once the flags are parsed and validated: the schedule
installed and announced, the losses handed to the rank Megatron logs them on, post-validation
wired into Megatron's training functions, the placement recorded in checkpoints, the stall watch
(off while a checkpoint is written), a line at the end, and everything undone by ``close()``.

Both routes use it: megatron-zb's entry point (``megatron.pretrain_gpt``) and a user's own
Megatron-LM script (``megatron.dropin``, the launcher ``python -m megatron_zb.run``).

Also the run's error reporting for both routes: ``run_reporting(fn)`` runs the training and turns
a known error into one line (once for the job) and exit code 2 (``megatron.launch.rank_errors``).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional

from ...core.ir import ScheduleError
from ..errors import ZeroBubbleArgumentError, ZeroBubbleConfigError
from ..execution.options import ScheduleOptions, preview
from .startup import MegatronTrainingMissing, layer_kw, placement_of

__all__ = ["start_up_done", "TrainingSession", "print0", "run_reporting", "supervise"]


def print0(msg: str) -> None:
    """Print once (global rank 0), before or after torch.distributed exists."""
    if os.environ.get("RANK", "0") == "0":
        print(msg, flush=True)


#: the route of megatron-zb's own entry point (``megatron.pretrain_gpt``)
ENTRY_ROUTE = "megatron-zb's pretrain_gpt"


class TrainingSession:
    """What megatron-zb adds to one Megatron training run (``zb``: ``install()``'s keyword
    arguments from the flags, None when no zero-bubble flag was given)."""

    def __init__(self, args, zb: Optional[dict], num_microbatches: int, *, route: str):
        self.args, self.zb, self.m, self.route = args, zb, int(num_microbatches), route
        self.placement = placement_of(args)
        self.handle = None
        self._preview = None
        self._undos: List[Callable[[], None]] = []

    @property
    def forward_backward(self):
        return None if self.handle is None else self.handle.forward_backward

    def _check_packing(self) -> None:
        if self.zb and self.zb.get("balance_pack") and self.route != ENTRY_ROUTE and \
                not getattr(self.args, "sft", False):
            raise ZeroBubbleArgumentError(
                "--zero-bubble-pack-sequences hands the forward step packed microbatches (tokens [1, N] with "
                "cu_seqlens): your script's forward step must pass them to the model as packed_seq_params, as "
                "Megatron-LM's pretrain_gpt.py does with --sft; add --sft, or run megatron-zb's entry point")

    def check(self) -> "TrainingSession":
        """Build the schedule once as training will (a memory limit it cannot meet, a microbatch
        count it cannot run: one line here, not at iteration 1)."""
        self._check_packing()
        if self.zb is not None and self._preview is None:
            self._preview = preview(ScheduleOptions(**self.zb), self.placement.num_ranks, self.m)
        return self

    def start(self) -> "TrainingSession":
        """Install the schedule (checked first) and its companions; announce it in one line on rank 0."""
        from ..layout import checkpoint_placement
        from .startup import check_load
        zb, args, pl = self.zb, self.args, self.placement
        self._check_packing()
        note = check_load(args)
        if note:
            print0(note)
        if zb is None:
            print0(f"megatron-zb: no zero-bubble flag given; Megatron's own pipeline schedules run ({self.route})")
        else:
            from ..install import install
            kwargs = dict(zb)
            built, base = self.check()._preview
            self.handle = install(kwargs.pop("schedule"), **kwargs)
            self._undos.append(self.handle.uninstall)
            self._announce(built, base)
            if pl.style in ("v", "bitpipe"):
                from ..layout.routing import route_losses_to_last_rank
                self._undos.append(route_losses_to_last_rank(pl.loss_rank))
            from .flags import optimizer_offload_flags
            shares, trough = optimizer_offload_flags(args)
            if getattr(args, "optimizer_cpu_offload", False):
                from ..features.optimizer_offload import use_cpu_as_device
                use_cpu_as_device()  # on a CPU-only torch: the CPU stands in for the GPU (nothing with CUDA)
            if shares == "auto":  # from each rank's need: states + the schedule's peak under the GPU's memory
                shares = _auto_shares(args, built, pl)
            if trough:  # the states on the host visit the GPU in each rank's trough
                self._undos.append(_trough(args, self.handle, pl, shares is not None))
            if shares is not None:  # each pipeline rank's own share of Megatron's CPU offload
                from ..features.optimizer_offload import use_rank_shares
                self._undos.append(use_rank_shares(shares))
                print0("megatron-zb: optimizer states on the host per pipeline rank: "
                       + ", ".join(f"{x:g}" for x in shares))
            if zb.get("post_validation"):
                from ..features.post_validation_training import FORK_MIN_CLEAN_STEPS, patch_megatron_training
                n = getattr(args, "zero_bubble_post_validation_min_clean_steps", None)
                n = FORK_MIN_CLEAN_STEPS if n is None else n
                self._undos.append(patch_megatron_training(self.handle, min_clean_steps=n))
                print0(f"megatron-zb: optimizer post-validation on (steps synchronous until {n} in a row were "
                       "neither clipped nor skipped; Megatron's log line shows the grad norm of the previous "
                       "iteration's step)")
        try:
            record = checkpoint_placement.record(pl, args.num_layers, zb["schedule"] if zb else None,
                                                 vocab_parallel=checkpoint_placement.vocab_of_args(args),
                                                 **layer_kw(args))
            self._undos.append(checkpoint_placement.install(record))
        except ScheduleError:  # a layout our tables do not describe (Megatron's own uneven splits): no record
            pass
        if zb is not None:
            from ...runtime.observe import progress
            progress.enable_stall_watch(zb["timeout_s"], on_stall=_on_stall)
            self._undos.append(progress.stop)
            self._undos.append(_watch_saves())
        return self

    def _announce(self, built, base) -> None:
        zb, pl, sim = self.zb, self.placement, built.result
        limit = zb.get("memory_limit")
        given = any(getattr(self.args, f"zero_bubble_{k}", None) is not None for k in ("cost_f", "cost_b", "cost_w"))
        layout = getattr(self.args, "zero_bubble_layout", None)
        vocab = zb.get("vocab_parallel")
        costs = ("given costs (--zero-bubble-cost-f/-b/-w)" if given else
                 f"each chunk's share of the model's FLOPs and activations for the layout {layout or 'split evenly'}"
                 if getattr(self.args, "zero_bubble_chunk_costs", None) else
                 "unit costs F=B=W=1, not measured ones (--zero-bubble-cost-f/-b/-w give yours)")
        if vocab:
            from ..features.flags.vocab import ASSUMED_LINK_GBPS, ASSUMED_TFLOPS
            costs += (f"; vocabulary parallelism with {vocab} barrier(s): every rank's output-layer shard in VS/VT/VW "
                      f"passes, the barriers at {ASSUMED_LINK_GBPS:g} GB/s against {ASSUMED_TFLOPS:g} TFLOPS of "
                      "compute (1f1b: the same passes)"
                      + ("; the input embedding split too: every rank's rows in VI/VG passes (--split-vocab-embedding)"
                         if zb.get("vocab_embedding") else ""))
        print0(f"megatron-zb: schedule {zb['schedule']} installed ({pl.style} placement, {pl.models_per_rank} "
               f"chunk(s) per rank, pipeline size {pl.num_ranks}, {self.m} microbatches"
               + (f", memory limit {limit:.3g} microbatches" if limit else "") + f"; {self.route})"
               + f": simulated with {costs}: bubble {100 * sim.bubble_rate:.1f}%"
               + (f" (1f1b {100 * base.bubble_rate:.1f}%)" if base is not None else "")
               + f", peak activation {max(sim.peak_memory):.3g} microbatches per rank")
        if zb.get("ep_overlap"):
            a2a = max(built.setting.cost_a2a)
            pairs = len(built.lowered().meta.get("overlap_pairs", ()))
            print0(f"megatron-zb: EP all-to-all overlap: the schedule core planned with an all-to-all of {a2a:.3g} per "
                   f"pass (F={max(built.setting.cost_f):.3g}; --zero-bubble-cost-a2a "
                   + ("given" if zb.get("cost_a2a") is not None else "default: half of F") + f") and paired {pairs} "
                   "F&B passes to hide it; 1f1b above carries the same all-to-all serially")
        if zb.get("offload_ratio") is not None:
            streams = "two copy streams" if zb.get("offload_overlap", True) else "one copy stream"
            if sim.offload is None:  # --auto-offload-time: K is measured on the device first
                print0(f"megatron-zb: activation offload ratio {zb['offload_ratio']}, {streams}; K is measured "
                       "at the first iteration and the offloaded schedule built then (the preview above is "
                       "without offload)")
            else:
                o = sim.offload.to_dict()
                print0(f"megatron-zb: activation offload ratio {zb['offload_ratio']}, K {zb.get('offload_time')}, "
                       f"{streams}; peak activation without offload {max(o['peak_memory_without_offload']):.3g} "
                       "microbatches")

    def summary(self) -> Optional[str]:
        """The line at the end: iterations run through megatron-zb; with a profile window, the
        measured time per iteration next to the simulator's for the profiled F/B/W."""
        fb = self.forward_backward
        if fb is None:
            return None
        line = f"megatron-zb: {fb.iterations} training iteration(s) ran through {self.zb['schedule']}"
        bal = getattr(fb, "balancer", None)
        if bal is not None and bal.iterations:
            line += (f"; balanced microbatches in {bal.iterations} (per replica in the last: "
                     f"{bal.last.microbatches_per_replica}; {bal.summary()})")
        prof, sched = fb.profile, fb.last_training_schedule
        if prof is not None and prof.get("iteration_s") and sched is not None:
            from ...core.ir import Setting
            from ...core.sim.iteration import iteration_times
            from ...runtime.observe.profile_data import profile_to_setting_kwargs
            try:  # the order that ran, timed with each chunk's profiled costs (seconds; host costs on a CPU)
                kw = profile_to_setting_kwargs(prof, per_chunk=True)
                st = Setting(sched.num_ranks, sched.num_microbatches, chunks=sched.placement.chunks,
                             **{k: v for k, v in kw.items() if k in ("cost_f", "cost_b", "cost_w", "cost_bw", "cost_comm")})
                it = iteration_times(sched, st)
                sim = it.iteration_time_post_validated if self.zb.get("post_validation") else it.iteration_time
                meas = prof["iteration_s"]
                line += (f"; profiled iterations {prof['window'][0]}-{prof['window'][1]}: {1e3 * meas:.1f} ms "
                         f"measured, {1e3 * sim:.1f} ms simulated from their F/B/W ({100 * (meas / sim - 1):+.1f}%)")
            except (ScheduleError, KeyError, ValueError, ZeroDivisionError):
                pass
        return line

    def close(self) -> None:
        from .shutdown import stop_checkpoint_writer
        stop_checkpoint_writer()  # megatron's checkpoint-writer Manager process, if a save started it
        while self._undos:
            self._undos.pop()()


def start_up_done() -> None:
    """Where an entry point ran its start-up (the imports of torch, megatron and megatron-zb:
    millions of objects, none of them cyclic garbage) without the cyclic garbage collector
    (``megatron.pretrain_gpt``, ``megatron_zb.run``: ``gc.disable()`` first thing): freeze what
    it made, so that no collection in training traverses it again, and turn the collector on.
    A CPU rank spent about a sixth of a short training's CPU in those passes. Nothing where the
    collector is on (the process did not start that way)."""
    import gc
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def supervise() -> None:
    """Under torchrun (or with MZB_EXIT_WITH_LAUNCHER=1): end this rank at once if its launcher dies."""
    flag = os.environ.get("MZB_EXIT_WITH_LAUNCHER")
    if flag == "1" or (flag != "0" and os.environ.get("TORCHELASTIC_RUN_ID")):
        from ...runtime.supervise import watch_parent
        watch_parent(what="the launcher (torchrun agent)")


def _watch_saves() -> Callable[[], None]:
    """Checkpoint saving may take long: the stall watch (runtime.observe.progress) counts its writes as
    progress, and a rank stuck in a save is named like a stuck pass."""
    import megatron.training.training as T

    from ...runtime.observe import progress
    inner = T.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        iteration = args[0] if args else kwargs.get("iteration")
        progress.saving(f"saving checkpoint iter {iteration}")
        try:
            return inner(*args, **kwargs)
        finally:
            progress.saving(None)
    T.save_checkpoint = save_checkpoint

    def undo():
        if T.save_checkpoint is save_checkpoint:
            T.save_checkpoint = inner
    return undo


def _on_stall(message: str) -> None:
    from .rank_errors import record_for_torchrun
    line = f"megatron-zb: error: {message}"
    record_for_torchrun(line)
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _known_errors():
    """Errors whose message says everything: one line, once, exit code 2."""
    from ..layout.checkpoint_placement import CheckpointPlacementError
    return (ZeroBubbleArgumentError, ZeroBubbleConfigError, MegatronTrainingMissing, CheckpointPlacementError)


def run_reporting(fn: Callable[[], None]) -> int:
    """Run ``fn()``; errors are reported once for the whole job (``rank_errors``): known ones as one
    line with exit code 2, a pipeline timeout as one line per rank (each names the rank that
    stopped first), anything else with its traceback on the first failing rank."""
    from .rank_errors import record_for_torchrun, report
    try:
        fn()
    except _known_errors() as e:
        report(e, known=True)
        return 2
    except SystemExit as e:  # argparse's exit, or the script's own sys.exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # noqa: BLE001
        from ...runtime.p2p import PipelineTimeout
        if isinstance(e, PipelineTimeout):  # a timeout, a lost peer, a validation timeout
            from ...runtime.observe.progress import finish_kills
            line = f"megatron-zb: error: {e}"
            record_for_torchrun(line)
            print(line, file=sys.stderr, flush=True)
            finish_kills()  # a stopped rank this rank named is ended before it exits
            return 1
        report(e, known=False)
        return 1
    return 0


def trough_inputs(args, placement) -> dict:
    """--zero-bubble-optimizer-offload trough: the plan's inputs from Megatron's arguments (plan's
    model of the run): the GPU's memory as the budget (none without a GPU), one microbatch's
    activation per unit of the schedule's memory, one stage's forward at the vocabulary feature's
    assumed GPU speed per unit of its time (``features.optimizer_trough.TroughOffload``'s keywords)."""
    import math

    import torch
    from ..features.flags.vocab import ASSUMED_TFLOPS
    from ..layout.model_args import memory_limit_in_microbatches, model_spec
    spec = model_spec(args)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    flops = sum(spec.layer_flops(i)[0] for i in range(spec.num_layers)) / placement.num_ranks / tp
    budget = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
              if torch.cuda.is_available() else math.inf)
    return dict(budget_bytes=budget, unit_bytes=1e9 / memory_limit_in_microbatches(1.0, args),
                unit_s=max(flops / (ASSUMED_TFLOPS * 1e12), 1e-6))


def _trough(args, handle, placement, per_rank: bool):
    from ..features.optimizer_trough import use_trough
    feature = use_trough(handle.forward_backward, log=print0, **trough_inputs(args, placement))
    share = ("each rank's own share" if per_rank else
             f"Megatron's --optimizer-offload-fraction {getattr(args, 'optimizer_offload_fraction', 1.0):g}")
    print0(f"megatron-zb: optimizer states in host memory ({share}), visiting the GPU in each rank's trough "
           "(the plan per rank follows at the first iteration)")
    return feature.uninstall


def _auto_shares(args, built, placement):
    import torch
    from ..features.optimizer_offload import auto_shares
    if not torch.cuda.is_available():
        raise ZeroBubbleArgumentError("--zero-bubble-optimizer-offload auto takes the GPU's memory as the budget: "
                                      "without a GPU give the shares (`megatron-zb plan --optimizer-offload auto`)")
    budget = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return auto_shares(args, built.result.peak_memory, placement, budget)
    except ValueError as e:
        raise ZeroBubbleArgumentError(str(e)) from None
