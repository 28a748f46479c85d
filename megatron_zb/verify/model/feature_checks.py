"""Checks of verify options that belong to one feature, kept beside ``case.py`` (no import of it):
each takes the case and raises the given error class with one line naming what is wrong."""
from __future__ import annotations

__all__ = ["balance_problem", "check_ep_overlap", "check_recompute"]


def balance_problem(case, pseudo_schedules, error) -> bool:
    """--zero-bubble-balance-microbatches: refuse what it does not run with; otherwise turn on the
    loss normalised over the global token count (the reference's too, so both train the same
    objective) and the install option. Returns False (nothing else to do)."""
    flag = "--zero-bubble-balance-microbatches"
    if case.pack_sequences and not case.balance_microbatches:
        raise error("--zero-bubble-pack-sequences packs the balanced microbatches: give --zero-bubble-balance-microbatches")
    if not case.balance_microbatches:
        return False
    if not case.variable_seq_lengths:
        raise error(f"{flag} balances microbatches of different lengths: give --variable-seq-lengths")
    blockers = [(case.schedule in pseudo_schedules, f"the pseudo-schedule {case.schedule}"),
                (case.placement == "bitpipe", "replicated stages (bitpipe)"),
                (case.vocab_parallel is not None, "--enable-vocab-parallel"), (case.forward_only, "--forward-only"),
                (case.overlap_grad_reduce and case.chunks > 1, "--overlap-grad-reduce with several chunks per rank"),
                (case.ep_overlap, "--overlap-moe-expert-parallel-comm")]
    for on, what in blockers:
        if on:
            raise error(f"{flag} cannot be combined with {what} yet")
    case.config_overrides = {**case.config_overrides, "calculate_per_token_loss": True}
    case.schedule_options = {**case.schedule_options, "balance_microbatches": True}
    if case.pack_sequences:
        case.schedule_options["balance_pack"] = True
    return False


def check_ep_overlap(case, pseudo_schedules, error) -> None:
    """Megatron's own rules for --overlap-moe-expert-parallel-comm, and a schedule with pairs."""
    flag = "--overlap-moe-expert-parallel-comm"
    if case.schedule in pseudo_schedules:
        raise error(f"{flag} runs through megatron-zb's runtime: give a megatron-zb schedule, not "
                               f"{case.schedule}")
    if case.num_experts is None or case.expert_model_parallel_size < 2:
        raise error(f"{flag} overlaps the expert-parallel all-to-all: it needs --num-experts and "
                               "--expert-model-parallel-size >= 2 (Megatron's rule)")
    if case.moe_token_dispatcher_type != "alltoall":
        raise error(f"{flag} needs --moe-token-dispatcher-type alltoall (Megatron's rule)")
    if case.recompute_granularity is not None:
        raise error(f"{flag} cannot be combined with --recompute-granularity (Megatron's rule for "
                               "full recompute; selective is not covered here)")
    if case.mtp_num_layers:
        raise error(f"{flag} with --mtp-num-layers is not covered by verify")
    if case.forward_only:
        raise error(f"{flag} changes training passes only; drop --forward-only")
    from ...core.build import build
    from ...core.ir import ScheduleError
    from ...megatron.errors import ZeroBubbleConfigError
    from ...megatron.execution.options import ScheduleOptions
    from ...megatron.execution.options import check_ep_overlap as pairs_or_refuse
    opts = ScheduleOptions(case.schedule, chunks=case.chunks, memory_limit=case.memory_limit, ep_overlap=True,
                           **dict(case.schedule_options))
    try:  # the schedule the ranks will build must have pairs
        pairs_or_refuse(build(opts.request(), case.pipeline_parallel_size, case.num_microbatches))
    except ZeroBubbleConfigError as e:
        raise error(str(e)) from None
    except ScheduleError:
        pass  # a schedule that cannot be built says so where it is built


def check_recompute(case, error) -> None:
    """Megatron's recompute flags, and --zero-bubble-recompute-num-layers (``case.recompute_counts``: one
    count per pipeline rank or per model chunk, made one per model chunk in pipeline order here)."""
    g, method, n = case.recompute_granularity, case.recompute_method, case.recompute_num_layers
    if g is not None and g not in ("full", "selective"):
        raise error(f"--recompute-granularity must be full or selective, got {g!r}")
    if g != "full" and (method is not None or n is not None):
        raise error("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    if method is not None and method not in ("uniform", "block"):
        raise error(f"--recompute-method must be uniform or block, got {method!r}")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise error(f"--recompute-num-layers must be an integer >= 1, got {n!r}")
    if case.recompute_counts is None:
        return
    from ...core.ir import ScheduleError
    from ...megatron.features.flags.recompute import FLAG, stage_counts
    from ...megatron.layout.placement import make_placement, stage_layer_counts
    if case.optimizer or case.post_validation or case.optimizer_trough:
        raise error(f"{FLAG} is not covered with Megatron's optimizer here (--optimizer, --optimizer-post-validation)")
    if any(isinstance(c, bool) or not isinstance(c, int) for c in case.recompute_counts):
        raise error(f"{FLAG} takes integer layer counts, got {case.recompute_counts!r}")
    try:
        placement = make_placement(case.placement, case.pipeline_parallel_size, case.chunks)
        layers = stage_layer_counts(case.num_layers, placement.num_stages, layers_per_stage=case.layers_per_stage,
                                    allow_padding_num_layers=case.allow_padding_num_layers)
        case.recompute_counts = list(stage_counts(case.recompute_counts, placement, layers, granularity=g,
                                                  method=method))
    except (ValueError, ScheduleError) as e:
        raise error(str(e)) from None
