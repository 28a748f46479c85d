"""Validation of megatron-zb's flags (``megatron.launch.args`` defines them) against each other and
against Megatron's, before any process group exists; the result is ``install()``'s keyword
arguments (``megatron.execution.options.ScheduleOptions``).

``validate_zero_bubble_args`` raises ``ZeroBubbleArgumentError`` with a message naming the flags.
Called **before** Megatron's own ``validate_args`` (as megatron-zb's entry point and launcher do)
it also sets the Megatron layout arguments the schedule needs: two virtual stages per rank for V
schedules, the first/last stage layer counts for ``--allow-padding-num-layers``. Called after
Megatron validated, schedules that need a different model layout are refused.

This module imports neither torch nor megatron.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ...core import schedules as core_schedules
from ...core.ir import Placement, ScheduleError
from ...core.costs.layout import parse as parse_layout
from .args import DEFAULT_TIMEOUT_S, FORK_TIMERS_DEFAULT, NOT_AVAILABLE_FLAGS, WHAT_INSTEAD
from ..features.flags.balance import BALANCE_FLAGS, balance_kwargs
from ..errors import ZeroBubbleArgumentError
from ..layout.layout_args import apply_layout, chunk_cost_kwargs, given_layout_flags, layout_from_args
from ..layout.model_args import has_model, mem_w_ratio, memory_limit_in_microbatches, model_spec
from ..features.flags.vocab import check_vocab_args, vocab_cost_kwargs
from ..features.flags.recompute import training_stage_counts

__all__ = ["validate_zero_bubble_args", "memory_limit_in_microbatches", "mem_w_ratio", "ZeroBubbleArgumentError"]


def _resolve_schedule(args) -> Optional[str]:
    ours = getattr(args, "zero_bubble_schedule", None)
    v_flag = bool(getattr(args, "zero_bubble_v_schedule", False))
    enable = bool(getattr(args, "enable_zero_bubble", False))
    mem_setup = getattr(args, "zero_bubble_v_schedule_mem_setup", None)
    fork = None
    if v_flag:
        fork = {"zb": "zb-v", "half": "v-half", "min": "v-min"}[mem_setup or "zb"]
    elif enable:
        fork = "zb-auto" if "zb-auto" in core_schedules.names() else "zb-h1"
    if mem_setup is not None and not v_flag:
        raise ZeroBubbleArgumentError("--zero-bubble-v-schedule-mem-setup only applies with --zero-bubble-v-schedule")
    if fork is not None:
        try:
            core_schedules.get(fork)
        except ScheduleError as e:
            flags = "--zero-bubble-v-schedule" + (f" --zero-bubble-v-schedule-mem-setup {mem_setup}" if mem_setup
                                                    else "") if v_flag else "--enable-zero-bubble"
            raise ZeroBubbleArgumentError(f"{flags} selects schedule {fork!r}, which this megatron-zb does not have "
                                          f"yet: {e}") from None
    if ours is not None and fork is not None and ours != fork:
        raise ZeroBubbleArgumentError(
            f"--zero-bubble-schedule {ours} conflicts with the fork's flags, which select {fork}; give one of them")
    name = ours or fork
    if name is None and getattr(args, "enable_vocab_parallel", False):
        name = "1f1b"  # the VocabularyParallelism fork's schedule: its flag alone selects it
    if name is not None:
        try:
            core_schedules.get(name)
        except ScheduleError as e:
            raise ZeroBubbleArgumentError(str(e)) from None
    return name


def _megatrons_own_layout(args) -> None:
    """Megatron's own schedules: its layout flags, read as Megatron reads them (one chunk per rank or
    its interleaving), so that megatron-zb's entry point builds the same layers (deterministic init)."""
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if p < 2 or not given_layout_flags(args) or not getattr(args, "num_layers", None):
        args.zero_bubble_layers_per_stage = None
        return
    text = getattr(args, "pipeline_model_parallel_layout", None)
    v = getattr(args, "virtual_pipeline_model_parallel_size", None) or \
        getattr(args, "num_virtual_stages_per_pipeline_rank", None) or 1
    if isinstance(text, str):
        try:
            v = max(1, parse_layout(text).num_stages // p)
        except ScheduleError as e:
            raise ZeroBubbleArgumentError(str(e)) from None
    apply_layout(args, layout_from_args(args, Placement.looped(p, int(v))), Placement.looped(p, int(v)), True)


def _even(args, placement) -> bool:
    """The layers split evenly over the placement's model chunks (no layout flag needed)."""
    return int(args.num_layers) % placement.num_logical_stages == 0


def optimizer_offload_flags(args):
    """(each rank's shares: None | 'auto' | a list, trough: bool) from --zero-bubble-optimizer-offload."""
    v = getattr(args, "zero_bubble_optimizer_offload", None)
    if v == "trough":
        return None, True
    if isinstance(v, tuple):
        return v[1], True
    return v, False


def _given(args, dest, default=None):
    v = getattr(args, dest, default)
    return v is not None and v is not False


def validate_zero_bubble_args(args, *, before_megatron_validation: Optional[bool] = None) -> Optional[Dict[str, Any]]:
    """Check megatron-zb's flags against each other and against Megatron's; return ``install()`` kwargs.

    Returns None when no flag selects a megatron-zb schedule (Megatron's own schedules run), after
    still refusing the fork's flags for features that are not available yet.

    ``before_megatron_validation`` (default: detected — Megatron's ``validate_args`` sets
    ``args.virtual_pipeline_model_parallel_size``): when True, the Megatron layout arguments the
    schedule needs are set here (V schedules: ``num_virtual_stages_per_pipeline_rank = 2``;
    ``--allow-padding-num-layers`` with one chunk per rank: ``decoder_first/last_pipeline_num_layers``).
    Also sets ``args.zero_bubble_placement`` ('single' / 'looped' / 'v') and
    ``args.zero_bubble_resolved_schedule``.
    """
    err = ZeroBubbleArgumentError
    for dest, (flag, given) in NOT_AVAILABLE_FLAGS.items():
        if given(getattr(args, dest, None)):
            hint = WHAT_INSTEAD.get(dest)
            raise err(f"{flag} is not available yet in megatron-zb" + (f" ({hint})" if hint else ""))

    name = _resolve_schedule(args)
    if name is None:
        for flag, dest in (("--enable-optimizer-post-validation", "enable_optimizer_post_validation"),
                           ("--zero-bubble-memory-limit", "zero_bubble_memory_limit"),
                           ("--zero-bubble-max-pending-backward", "zero_bubble_max_pending_backward"),
                           ("--zero-bubble-profile-window", "zero_bubble_profile_window"),
                           ("--zero-bubble-pipeline-timers-start-iter", "zero_bubble_pipeline_timers_start_iter"),
                           ("--zero-bubble-pipeline-timers-end-iter", "zero_bubble_pipeline_timers_end_iter"),
                           ("--cpu-offload", "cpu_offload"),
                           ("--zero-bubble-offload-ratio", "zero_bubble_offload_ratio"),
                           ("--zero-bubble-recompute-num-layers", "zero_bubble_recompute_num_layers")) + BALANCE_FLAGS:
            if _given(args, dest):
                raise err(f"{flag} needs a megatron-zb schedule: add --zero-bubble-schedule NAME "
                          "(or the fork's --enable-zero-bubble / --zero-bubble-v-schedule)")
        _offload_kwargs(args, name=None, chunks=1, limit=None)  # stray offload flags get their message
        balance_kwargs(args, None)  # --zero-bubble-mock-seq-lengths works with Megatron's own schedules too
        check_vocab_args(args, name=None, style=None, p=int(getattr(args, "pipeline_model_parallel_size", 1) or 1))
        args.zero_bubble_resolved_schedule = None
        args.zero_bubble_placement = None
        _megatrons_own_layout(args)
        if getattr(args, "allow_padding_num_layers", False):
            _apply_padding_single(args, before_megatron_validation, name=None)
        return None

    if before_megatron_validation is None:
        before_megatron_validation = not hasattr(args, "virtual_pipeline_model_parallel_size")
    spec = core_schedules.get(name)
    style = spec.placement
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if p < 2:
        raise err(f"schedule {name} needs pipeline parallelism: --pipeline-model-parallel-size is {p}, and "
                  "zero-bubble schedules remove pipeline bubbles, which need at least 2 stages (with PP=1 drop "
                  "the zero-bubble flags; Megatron's no-pipelining schedule is already bubble-free)")
    L = getattr(args, "num_layers", None)
    pad = bool(getattr(args, "allow_padding_num_layers", False))
    nlpvs = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    nvspr = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    barriers = check_vocab_args(args, name=name, style=style, p=p)  # vocabulary parallelism (None: off)

    # -- Megatron options our runtime cannot honour --------------------------------------------
    conflicts = [
        ("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute",
         "megatron-zb already defers weight gradients (W passes)"),
        ("num_microbatches_with_partial_activation_checkpoints",
         "--num-microbatches-with-partial-activation-checkpoints", "not supported by the megatron-zb runtime"),
        ("overlap_p2p_comm_warmup_flush", "--overlap-p2p-communication-warmup-flush",
         "it tunes Megatron's interleaved schedule; megatron-zb does its own pipeline communication"),
        ("microbatch_group_size_per_vp_stage", "--microbatch-group-size-per-virtual-pipeline-stage",
         "it tunes Megatron's interleaved schedule; the megatron-zb schedule fixes the order"),
    ]
    for dest, flag, why in conflicts:
        if _given(args, dest):
            raise err(f"{flag} cannot be combined with megatron-zb schedule {name}: {why}")
    if getattr(args, "cuda_graph_impl", None) == "full_iteration":
        raise err(f"--cuda-graph-impl full_iteration captures Megatron's own schedule; it cannot be combined with "
                  f"megatron-zb schedule {name}")

    # -- model layout ------------------------------------------------------------------------------
    if style in ("v", "bitpipe"):
        models = 4 if style == "bitpipe" else 2
        what = "in BitPipe order (two V pipelines)" if style == "bitpipe" else "in V order"
        if nlpvs is not None or nvspr not in (None, models) or \
                (not before_megatron_validation and vpp not in (None, models)):
            raise err(f"schedule {name} places {models} model chunks per rank {what} itself; drop "
                      "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
        if not before_megatron_validation:
            raise err(f"V schedule {name} needs megatron-zb's model layout (2 chunks per rank in V order, "
                      "embedding and loss on rank 0), which Megatron has validated away here: run your script "
                      "through `python -m megatron_zb.run` (or apply patches/megatron-lm-<line>), which builds it")
        if L is not None and not given_layout_flags(args):
            S = 2 * p
            if L % S:
                if not pad:
                    raise err(f"V schedule {name} needs an even number of layers per pipeline stage: --num-layers "
                              f"{L} is not divisible by 2 x --pipeline-model-parallel-size = {S}; use a multiple "
                              f"of {S}, or --allow-padding-num-layers with --num-layers = k x {S} - 2")
                if (L + 2) % S or (L + 2) // S < 2:
                    raise err(f"--allow-padding-num-layers with V schedule {name} needs --num-layers = k x {S} - 2 "
                              f"(k >= 2, first and last stage one layer less), got {L}")
        args.num_virtual_stages_per_pipeline_rank = models
        chunks = 2
        if style == "bitpipe" and not getattr(args, "zero_bubble_deterministic_init", False):
            # the two replicas of every stage must start identical: draw every weight from its global name
            args.zero_bubble_deterministic_init = True
    elif style == "looped":
        if before_megatron_validation:
            if layout is not None:  # Megatron takes the chunks per rank from the layout's stages
                try:
                    chunks = parse_layout(layout).num_stages // p
                except ScheduleError as e:
                    raise err(str(e)) from None
            elif nvspr is not None:
                chunks = int(nvspr)
            elif nlpvs is not None and L is not None:
                per_rank = L // p
                chunks = per_rank // int(nlpvs) if per_rank % int(nlpvs) == 0 else 0
                if not chunks:
                    raise err(f"--num-layers-per-virtual-pipeline-stage {nlpvs} does not divide the {per_rank} "
                              "layers per pipeline rank")
            else:
                chunks = 0
        else:
            chunks = int(vpp or 1)
        if chunks < 2:
            raise err(f"schedule {name} runs several model chunks per rank (Megatron's virtual pipeline): add "
                      "--num-layers-per-virtual-pipeline-stage N or --num-virtual-stages-per-pipeline-rank V "
                      "(V >= 2)")
        if pad:
            raise err(f"--allow-padding-num-layers is not supported with {name} (looped placement); it works with "
                      "one chunk per rank and with V schedules")
        if p == 2 and getattr(args, "overlap_p2p_comm", True) is False:
            raise err("--no-overlap-p2p-communication: Megatron refuses a virtual pipeline at PP=2 without p2p "
                      "overlap; megatron-zb does its own pipeline communication, so drop the flag")
    else:  # single
        if nlpvs is not None or nvspr is not None or (vpp not in (None, 1)):
            raise err(f"schedule {name} runs one model chunk per rank; drop --num-layers-per-virtual-pipeline-stage "
                      "/ --num-virtual-stages-per-pipeline-rank (or pick interleaved-1f1b, or a V schedule such as "
                      "zb-v)")
        chunks = 1
        if L is not None and L % p and not pad and not given_layout_flags(args):
            raise err(f"--num-layers {L} cannot be split evenly over {p} pipeline stages: use a multiple of {p}, "
                      f"or --allow-padding-num-layers with --num-layers = k x {p} - 2 (first and last stage one "
                      "layer less)")
        _apply_padding_single(args, before_megatron_validation, name=name)

    # the layers each model chunk holds (Megatron's layout flags, read in pipeline order)
    args.zero_bubble_resolved_schedule = name
    placement = {"single": lambda: Placement.single(p), "looped": lambda: Placement.looped(p, chunks),
                 "v": lambda: Placement.vshape(p), "bitpipe": lambda: Placement.bitpipe(p)}[style]()
    if getattr(args, "zero_bubble_layout_taken", False):  # taken over by an earlier call (V, BitPipe)
        pass
    else:
        laid = layout_from_args(args, placement)
        apply_layout(args, laid, placement, before_megatron_validation)
        args.zero_bubble_layout_taken = style in ("v", "bitpipe") and laid is not None
        training_stage_counts(args, placement)  # recompute per model chunk: refused in one line where it cannot apply
        # the schedule sees each chunk's share of the work and memory (what it holds), unless costs are given
        if barriers is not None:  # the output layer leaves the loss's chunk for every rank's vocabulary passes
            args.zero_bubble_chunk_costs = (vocab_cost_kwargs(model_spec(args), laid, placement, barriers,
                                                              bool(getattr(args, "split_vocab_embedding", False)))
                                            if has_model(args) else None)
        else:
            args.zero_bubble_chunk_costs = (chunk_cost_kwargs(model_spec(args), laid, placement)
                                            if has_model(args) and (laid is not None or _even(args, placement))
                                            else None)

    if style == "v" and p == 2 and getattr(args, "overlap_p2p_comm", True) is False:
        raise err("--no-overlap-p2p-communication: Megatron refuses a virtual pipeline at PP=2 without p2p overlap; "
                  "megatron-zb does its own pipeline communication, so drop the flag")

    # -- memory limit ------------------------------------------------------------------------------
    limit = None
    ours = getattr(args, "zero_bubble_memory_limit", None)
    pending = getattr(args, "zero_bubble_max_pending_backward", None)
    if ours is not None:
        value, unit = ours
        if unit == "microbatches":
            limit = value
        else:
            for need in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
                if getattr(args, need, None) is None:
                    raise err(f"--zero-bubble-memory-limit in {unit} needs --{need.replace('_', '-')}")
            limit = memory_limit_in_microbatches(value, args, gib=(unit == "GiB"))
            if limit < 1:
                raise err(f"--zero-bubble-memory-limit {value:g}{unit} holds {limit:.2f} microbatches of one stage's "
                          "activation; a pipeline needs at least 1")
    if pending is not None and pending != "auto" and style != "v":
        if limit is not None and abs(limit - pending) > 1e-9:
            raise err(f"--zero-bubble-memory-limit and --zero-bubble-max-pending-backward {pending} disagree; "
                      "give one")
        limit = float(pending)

    # -- profiling window --------------------------------------------------------------------------
    window = getattr(args, "zero_bubble_profile_window", None)
    ts = getattr(args, "zero_bubble_pipeline_timers_start_iter", None)
    te = getattr(args, "zero_bubble_pipeline_timers_end_iter", None)
    if ts is not None or te is not None:
        if window is not None:
            raise err("give either --zero-bubble-profile-window or the fork's --zero-bubble-pipeline-timers-*-iter")
        span = FORK_TIMERS_DEFAULT[1] - FORK_TIMERS_DEFAULT[0]
        start = ts if ts is not None else max(1, te - span)
        end = te if te is not None else start + span
        window = (start, end)
    if window is not None:
        start, end = int(window[0]), int(window[1])
        if start < 1 or end < start:
            raise err(f"profiling window {start}..{end}: need 1 <= START <= END (iterations counted from 1)")
        window = (start, end)

    kwargs: Dict[str, Any] = {"schedule": name, "chunks": chunks, "memory_limit": limit,
                              "timeout_s": float(getattr(args, "zero_bubble_timeout", None) or DEFAULT_TIMEOUT_S)}
    if getattr(args, "zero_bubble_search_effort", None) is not None:
        kwargs["effort"] = args.zero_bubble_search_effort
    laid_out = getattr(args, "zero_bubble_chunk_costs", None)
    given = {opt: getattr(args, f"zero_bubble_{opt}", None) for opt in ("cost_f", "cost_b", "cost_w", "cost_bw", "mem_w")}
    if laid_out and all(v is None for v in given.values()):
        kwargs.update({k: v for k, v in laid_out.items() if k not in ("unit_bytes", "vocab_costs")})
    if barriers is not None:
        kwargs["vocab_parallel"] = barriers
        if getattr(args, "split_vocab_embedding", False):
            kwargs["vocab_embedding"] = True
        if laid_out and laid_out.get("vocab_costs"):
            kwargs["vocab_costs"] = laid_out["vocab_costs"]
    for opt in ("cost_f", "cost_b", "cost_w", "cost_bw", "cost_comm", "cost_a2a", "mem_w"):
        v = getattr(args, f"zero_bubble_{opt}", None)
        if v is not None:
            kwargs[opt] = v
    if _given(args, "overlap_moe_expert_parallel_comm"):
        kwargs["ep_overlap"] = True  # also on in the model config, except on CPU (machine_adjustments)
    if ours is not None and ours[1] != "microbatches" and "mem_w" not in kwargs:
        kwargs["mem_w"] = mem_w_ratio(args)  # a byte budget: W's share from the same model, not 0.5
    if window is not None:
        kwargs["profile_window"] = window
        path = getattr(args, "zero_bubble_profile_path", None)
        if path is None:
            import os
            path = os.path.join(getattr(args, "save", None) or ".", "zero_bubble_profile.json")
        kwargs["profile_path"] = path
    elif getattr(args, "zero_bubble_profile_path", None):
        raise err("--zero-bubble-profile-path needs a profiling window (--zero-bubble-profile-window START END)")

    shares, trough = optimizer_offload_flags(args)
    if shares is not None or trough:
        if not _given(args, "optimizer_cpu_offload"):
            raise err("--zero-bubble-optimizer-offload sets each rank's share of Megatron's CPU offload: add "
                      "--optimizer-cpu-offload (and --use-precision-aware-optimizer, as Megatron requires)")
        if shares not in (None, "auto") and len(shares) != p:
            raise err(f"--zero-bubble-optimizer-offload takes 'auto', 'trough' or one share per pipeline rank ({p}), as "
                      f"`megatron-zb plan --optimizer-offload auto` prints them")
    if getattr(args, "enable_optimizer_post_validation", False):
        offload = _given(args, "optimizer_cpu_offload")  # Megatron's CPU offload: the host copies roll back too
        for dest, flag in (("overlap_param_gather", "--overlap-param-gather"),
                           ("overlap_param_gather_with_optimizer_step", "--overlap-param-gather-with-optimizer-step"),
                           ("use_precision_aware_optimizer", "--use-precision-aware-optimizer"),
                           ("use_megatron_fsdp", "--use-megatron-fsdp")):
            if _given(args, dest) and not (offload and dest == "use_precision_aware_optimizer"):
                raise err(f"--enable-optimizer-post-validation cannot be combined with {flag}: the rollback needs "
                          "the optimizer step (and its parameter all-gather) whole on this rank")
        kwargs["post_validation"] = True
    elif _given(args, "zero_bubble_post_validation_min_clean_steps"):
        raise err("--zero-bubble-post-validation-min-clean-steps needs --enable-optimizer-post-validation")
    kwargs.update(_offload_kwargs(args, name=name, chunks=chunks, limit=limit))
    kwargs.update(balance_kwargs(args, name))

    args.zero_bubble_resolved_schedule = name
    args.zero_bubble_placement = style
    args.zero_bubble_split_backward = bool(spec.split_backward)
    return kwargs


_OFFLOAD_DETAIL_FLAGS = (("--offload-time", "offload_time"), ("--auto-offload-time", "auto_offload_time"),
                         ("--offload-chunk-num", "offload_chunk_num"), ("--offload-overlap-sr", "offload_overlap_sr"),
                         ("--offload-continuous-buffers", "offload_continuous_buffers"),
                         ("--zero-bubble-offload-half-duplex", "zero_bubble_offload_half_duplex"),
                         ("--zero-bubble-offload-cpu-test", "zero_bubble_offload_cpu_test"))


def _offload_kwargs(args, *, name: Optional[str], chunks: int, limit: Optional[float]) -> Dict[str, Any]:
    """install() keyword arguments for activation offload (none when it is off); one clear error
    for a combination that cannot work."""
    err = ZeroBubbleArgumentError
    ratio = getattr(args, "zero_bubble_offload_ratio", None)
    on = bool(getattr(args, "cpu_offload", False)) or ratio is not None
    chunk_num = getattr(args, "offload_chunk_num", None)
    if not on:
        for flag, dest in _OFFLOAD_DETAIL_FLAGS:
            v = getattr(args, dest, None)
            if dest == "offload_chunk_num" and v == 0:
                continue  # the fork's default: nothing to do
            if v is not None and v is not False:
                raise err(f"{flag} needs activation offload: add --cpu-offload (or --zero-bubble-offload-ratio R)")
        return {}
    if name is None:
        return {}
    if getattr(args, "offload_time", None) is not None and getattr(args, "auto_offload_time", False):
        raise err("give either --offload-time K or --auto-offload-time (which measures K at start-up), not both")
    if getattr(args, "offload_overlap_sr", False) and getattr(args, "zero_bubble_offload_half_duplex", False):
        raise err("--offload-overlap-sr (separate copy streams) and --zero-bubble-offload-half-duplex (one stream) "
                  "contradict each other; give one")
    if chunk_num is not None and not (1 <= chunk_num <= max(1, chunks or 1)):
        raise err(f"--offload-chunk-num {chunk_num}: schedule {name} runs {chunks or 1} model chunk(s) per rank, so "
                  f"give 1..{chunks or 1} (or drop it to offload every chunk)")
    if ratio == "auto" and limit is None:
        raise err("--zero-bubble-offload-ratio auto offloads as little as fits the memory limit: add "
                  "--zero-bubble-memory-limit L")
    time = "auto" if getattr(args, "auto_offload_time", False) else getattr(args, "offload_time", None)
    return {"offload_ratio": 1.0 if ratio is None else ratio, "offload_time": 1.0 if time is None else time,
            "offload_overlap": not getattr(args, "zero_bubble_offload_half_duplex", False),
            "offload_chunks": chunk_num, "offload_cpu_test": bool(getattr(args, "zero_bubble_offload_cpu_test", False))}


def _apply_padding_single(args, before_megatron_validation, name):
    """--allow-padding-num-layers with one chunk per rank: Megatron's first/last stage layer counts."""
    if not getattr(args, "allow_padding_num_layers", False):
        return
    L = getattr(args, "num_layers", None)
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if L is None or p < 2 or L % p == 0:
        return  # nothing to pad
    err = ZeroBubbleArgumentError
    if getattr(args, "decoder_first_pipeline_num_layers", None) is not None or \
            getattr(args, "decoder_last_pipeline_num_layers", None) is not None:
        raise err("--allow-padding-num-layers sets the first and last stage's layer counts itself; drop "
                  "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
    if (L + 2) % p or (L + 2) // p < 2:
        raise err(f"--allow-padding-num-layers needs --num-layers = k x --pipeline-model-parallel-size - 2 "
                  f"(k >= 2; first and last stage one layer less), got {L} layers on {p} stages")
    if before_megatron_validation is False or (before_megatron_validation is None
                                               and hasattr(args, "virtual_pipeline_model_parallel_size")):
        raise err("--allow-padding-num-layers changes the model layout: run your script through "
                  "`python -m megatron_zb.run` (or megatron-zb's entry point, `python -m megatron_zb.megatron.pretrain_gpt`), "
                  "or give Megatron's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers yourself")
    k = (L + 2) // p
    args.decoder_first_pipeline_num_layers = k - 1
    args.decoder_last_pipeline_num_layers = k - 1
