"""A Megatron-LM-style GPT pretraining script, written for megatron-zb's tests.

It has the shape of Megatron-LM's own ``pretrain_gpt.py`` (0.19 line) — a ``model_provider``, a
``forward_step`` with its ``get_batch`` and ``loss_func``, a datasets provider, the arguments
parsed with ``parse_and_validate_args`` and ``pretrain(...)`` from ``megatron.training`` — and
nothing of megatron-zb: ``tests/test_dropin.py`` runs it unmodified through
``python -m megatron_zb.run``. Tied embeddings, Megatron-LM's embedding ranks (first and last
pipeline rank), data read only where a chunk embeds or computes the loss.

``MZB_TEST_BUILDER=1``: the model is built by ``megatron.training``'s GPT model builder (what
Megatron-LM 0.19's script does) instead of ``get_model`` calling ``model_provider``.
"""
import os
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.utils import is_first_or_last_pipeline_stage


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, pg_collection=pg_collection,
                    vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage=None):
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    batch = {k: (v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                              split=args.split, tokenizer=get_tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False,
                              mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         partial(is_dataset_built_on_rank, vp_stage), config).build()


train_valid_test_datasets_provider.is_distributed = True


def get_embedding_ranks(pp_ranks):
    """Megatron-LM's rule: the first pipeline rank holds the embedding, the last its tied copy."""
    args = get_args()
    return pp_ranks if args.untie_embeddings_and_output_weights else [pp_ranks[0], pp_ranks[-1]]


if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    if os.environ.get("MZB_TEST_BUILDER") == "1":
        cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 get_embedding_ranks=get_embedding_ranks)
    else:
        pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider,
                 get_embedding_ranks=get_embedding_ranks)
