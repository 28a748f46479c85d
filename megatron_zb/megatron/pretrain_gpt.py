"""GPT pretraining with megatron-zb schedules: Megatron-LM's ``pretrain_gpt.py``, on ``megatron.training``.

    torchrun --nproc-per-node 4 -m megatron_zb.megatron.pretrain_gpt \\
        --pipeline-model-parallel-size 4 --zero-bubble-schedule zb-v \\
        --num-layers 16 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \\
        --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 32 \\
        --train-iters 100 --lr 3e-4 --tokenizer-type NullTokenizer --vocab-size 32000 ...

Every Megatron flag works as in Megatron-LM's script, plus megatron-zb's flags and the ZB authors'
fork's (``megatron_zb.megatron.launch.args``). What this module adds to Megatron's flow:

* the flags: Megatron's parser gets ``add_zero_bubble_args`` (chained with any other
  ``extra_args_provider``); they are validated (``validate_zero_bubble_args``) **before** Megatron's
  own ``validate_args``, so a bad combination fails before any process starts talking, and a V
  schedule gets Megatron's virtual pipeline size 2;
* ``install()``: Megatron's ``get_forward_backward_func`` returns the megatron-zb schedule;
* V placement (zb-v, v-half, v-min, v-auto, dualpipe-v, gpipe-v): rank r builds stages r and
  2P-1-r, so the embedding and the loss both live on pipeline rank 0. The layer numbering uses
  ``megatron_zb.megatron.layout.placement``'s layer-table hooks, the embedding group is rank 0 alone, the
  tied output weight is summed locally (``finalize_model_grads_for``), and the losses are handed to
  the last pipeline rank, where Megatron's training loop reads and logs them;
* BitPipe (bitpipe): four chunks per rank (``Placement.bitpipe``: two V pipelines in opposite
  directions), handled like V (layer table, one-rank embedding group, losses to the last rank);
  every weight is drawn from its global name (``--zero-bubble-deterministic-init`` is implied) so
  the two replicas of each stage start identical, and the schedule runner sums their gradients;
* no CUDA: the CPU shims (``cpu_shims.apply`` / ``apply_training``), the gloo backend, the local
  transformer implementation and no fused kernels;
* no Transformer Engine (``--transformer-impl local``): ``--attention-backend flash`` or ``fused``
  builds Megatron's local spec with torch's ``scaled_dot_product_attention`` as its core attention
  (``features.sdpa_attention``); ``local``, ``unfused`` and ``auto`` keep megatron's own;
* data: Megatron's mock GPT dataset unless ``--data-path`` (Megatron indexed datasets) is given.

Needs ``megatron.training`` with the config-container ``pretrain()`` (megatron-core >= 0.18 wheels,
tested with 0.19.2). With megatron-core 0.16/0.17, patch your Megatron-LM checkout's
``pretrain_gpt.py`` (``patches/``) or call ``install()`` yourself.
"""
from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()

import gc  # noqa: E402

if __name__ == "__main__":
    gc.disable()  # the start-up without the cyclic collector: see ``launch.session.start_up_done``

import sys  # noqa: E402
import warnings  # noqa: E402
from functools import partial  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

from .launch.chunks import ChunkPlan  # noqa: E402
from .launch.session import ENTRY_ROUTE, TrainingSession, print0, run_reporting, start_up_done, supervise  # noqa: E402
from .launch.startup import layer_kw, placement_of, prepare_args, prepare_megatron  # noqa: E402

__all__ = ["main", "model_provider", "forward_step", "train_valid_test_datasets_provider"]


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------

class _ModelProvider:
    """Megatron's ``model_provider(pre_process, post_process, vp_stage, config, pg_collection)``.

    Builds each chunk with Megatron's own ``GPTModelBuilder`` (TE spec when Transformer Engine is
    present, the local spec otherwise, MoE etc. from the flags). For a V schedule the chunk's stage,
    pre/post-process and layers come from the V placement (``megatron.launch.chunks``) and megatron's
    layer count/offset functions answer from the placement's layer table.
    """

    def __init__(self):
        self.plan: Optional[ChunkPlan] = None

    def __call__(self, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import get_args
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.models.gpt import GPTModelBuilder

        from .cpu.local_spec import layer_spec, with_core_attention
        from .features.sdpa_attention import core_attention_for

        args = get_args()
        if self.plan is None:
            self.plan = ChunkPlan(args)
        plan = self.plan
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        model_cfg = gpt_config_from_args(args, config=config)
        tcfg = model_cfg.transformer
        info = plan.info(vp_stage)
        if plan.reshapes:
            pre_process, post_process = info.pre_process, info.post_process
            plan.prepare_config(tcfg)
        if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            print(" > " + plan.describe(info, pre_process, post_process), flush=True)
        packed = bool(getattr(args, "zero_bubble_pack_sequences", False))
        local = tcfg.transformer_impl == "local" and model_cfg.transformer_layer_spec is None
        # without TE, --attention-backend flash/fused: torch's SDPA as the core attention (features.flags.attention)
        core = core_attention_for(getattr(tcfg, "attention_backend", None)) if local else None
        if local and (tcfg.sequence_parallel or packed):
            # the local spec's torch norms refuse sequence parallelism (apex/TE norms are absent, e.g.
            # on CPU): megatron's local spec with sequence-parallel-capable torch norms; its attention
            # refuses packed sequences: one that takes them
            model_cfg.transformer_layer_spec = layer_spec(tcfg, len(info.layers), packed=packed, core_attention=core)
        elif core is not None:  # the spec Megatron would build, its core attention swapped
            from megatron.training.models.gpt import default_layer_spec
            model_cfg.transformer_layer_spec = with_core_attention(default_layer_spec(model_cfg, vp_stage), core)
        if core is not None and vp_stage in (None, 0) and parallel_state.get_data_parallel_rank() == 0 and \
                parallel_state.get_tensor_model_parallel_rank() == 0 and \
                parallel_state.get_pipeline_model_parallel_rank() == 0:
            print(" > core attention: torch's scaled_dot_product_attention (--attention-backend "
                  f"{tcfg.attention_backend.name}, no Transformer Engine)", flush=True)
        model = GPTModelBuilder(model_cfg).build_model(pg_collection, pre_process=pre_process,
                                                       post_process=post_process, vp_stage=vp_stage)
        plan.finish(model, info)
        return model


model_provider = _ModelProvider  # a fresh provider per run: ``model_provider()`` -> callable


# --------------------------------------------------------------------------------------------
# data, forward step, loss
# --------------------------------------------------------------------------------------------

def _unwrapped(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def get_batch(data_iterator, pre_process: bool, post_process: bool):
    """This chunk's microbatch: tokens/position ids where it embeds, labels/loss mask where it
    computes the loss (broadcast from tensor-parallel rank 0), nothing for a middle stage; and
    Megatron's ``PackedSeqParams`` of a packed microbatch (``--zero-bubble-pack-sequences``; every
    stage reads where its sequences start), else None."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    from .features.balanced import packed_seq_params
    args = get_args()
    if not (pre_process or post_process):
        if getattr(args, "zero_bubble_pack_sequences", False):  # packed microbatches: where its sequences start
            return None, None, None, None, None, packed_seq_params(next(data_iterator))
        return None, None, None, None, None, None
    batch = None
    if ps.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in data.items()}
        batch.setdefault("attention_mask", None)
    if ps.get_tensor_model_parallel_world_size() > 1:
        tp = ps.get_tensor_model_parallel_group()
        batch = get_batch_on_this_tp_rank(
            batch or {}, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(), broadcast_group=tp,
            cp_size=ps.get_context_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
            micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=pre_process, is_pipeline_last_stage=post_process)
    if ps.get_context_parallel_world_size() > 1:
        batch.setdefault("cu_seqlens", None)
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
    tokens = batch.get("tokens") if pre_process else None
    position_ids = batch.get("position_ids") if pre_process else None
    labels = batch.get("labels") if post_process else None
    loss_mask = batch.get("loss_mask") if post_process else None
    return tokens, labels, loss_mask, batch.get("attention_mask"), position_ids, packed_seq_params(batch)


def loss_func(loss_mask, output_tensor):
    """Megatron's GPT loss: (sum of masked token losses, token count, {'lm loss': [sum, count]})."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rsm = get_rerun_state_machine()
        rsm.validate_result(result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
        rsm.validate_result(result=loss, rejection_func=torch.isinf, message="found Inf in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's ``forward_step_func``: next microbatch through this chunk, loss on the loss stage."""
    from megatron.training import get_timers

    timers = get_timers()
    chunk = _unwrapped(model)
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(
        data_iterator, bool(getattr(chunk, "pre_process", True)), bool(getattr(chunk, "post_process", True)))
    timers("batch-generator").stop()
    if return_schedule_plan:  # --overlap-moe-expert-parallel-comm: the chunk's pass as megatron's schedule plan
        plan = chunk.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, packed_seq_params=packed)
    return output, partial(loss_func, loss_mask)


def _dataset_needed_on(vp_stage) -> bool:
    """Data is read where a chunk embeds or computes the loss, on tensor-parallel rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    from .layout import placement as zb_placement
    if ps.get_tensor_model_parallel_rank() != 0:
        return False
    args = get_args()
    infos = zb_placement.chunk_infos(placement_of(args), args.num_layers, ps.get_pipeline_model_parallel_rank(),
                                 **layer_kw(args))
    chosen = infos if vp_stage is None else [infos[vp_stage]]
    return any(i.pre_process or i.post_process for i in chosen)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's mock GPT dataset, or indexed datasets from --data-path / per-split paths."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(_dataset_needed_on, vp_stage), config).build()
    print_rank_0("> finished creating GPT datasets ...")
    if getattr(args, "zero_bubble_mock_seq_lengths", None) and train_ds is not None:  # variable-length samples
        from ..core.varlen.seqlens import length_sampler
        from .features.varlen_data import VariableLengthDataset, up_to_eod
        spec = args.zero_bubble_mock_seq_lengths
        if spec == "eod":  # the documents' own lengths
            length = up_to_eod(get_tokenizer().eod)
        else:
            draw = length_sampler(spec)
            length = lambda i, sample: draw(i)  # noqa: E731
        train_ds = VariableLengthDataset(train_ds, length, args.seq_length)
    return train_ds, valid_ds, test_ds


train_valid_test_datasets_provider.is_distributed = True


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None, extra_args_provider: Optional[Callable] = None,
         args_defaults: Optional[dict] = None) -> None:
    """Parse the flags (``argv``, default ``sys.argv``), install the schedule, run Megatron's pretrain()."""
    supervise()
    prepare_megatron()
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    args, zb, notes = prepare_args(extra_args_provider, args_defaults, argv)
    from .preflight import check_in_rank
    check_in_rank(args)  # what the launch script's preflight checks, for jobs started without it
    if notes:
        print0("megatron-zb: adjusted for this machine: " + ", ".join(notes))
    session = TrainingSession(args, zb, get_num_microbatches(), route=ENTRY_ROUTE).start()
    get_emb = None
    if zb is not None:  # the embedding group: the embedding's rank alone where the output layer is not on another
        from .layout.placement import embedding_ranks
        get_emb = embedding_ranks(session.placement, bool(zb.get("vocab_parallel")))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*recommended to use a ModelConfig")
        cfg = pretrain_cfg_container_from_args(args)
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    start_up_done()  # the collector on again, what start-up made frozen
    try:
        run(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
            model_provider=model_provider(), get_embedding_ranks=get_emb, store=store)
        line = session.summary()
        if line:
            print0(line)
    finally:
        session.close()


if __name__ == "__main__":
    _code = run_reporting(main)
    if _code:  # after a failure, no orderly teardown: collectives with a stuck peer could hang it
        from ..runtime.supervise import exit_now
        exit_now(_code)
    sys.exit(0)
