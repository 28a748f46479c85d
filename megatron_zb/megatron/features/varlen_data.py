"""Megatron's GPT samples cut to variable lengths (``--zero-bubble-mock-seq-lengths``): each sample
``i`` keeps its first ``length(i)`` tokens (a length distribution's draw, deterministic per sample),
so mock data looks like post-training data whose lengths vary 10-100x. Needs
``--variable-seq-lengths`` (and ``--micro-batch-size 1``: Megatron's loader stacks a microbatch)."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["VariableLengthDataset"]


class VariableLengthDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, length: Callable[[int], int], seq_length: int):
        self.dataset, self.length, self.seq_length = dataset, length, int(seq_length)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample = self.dataset[i]
        n = max(1, min(self.seq_length, int(self.length(int(i)))))
        out = {}
        for k, v in sample.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[-1] == self.seq_length:
                v = v[..., :n]
                if v.dim() >= 2 and v.shape[-2] == self.seq_length:  # an [.., s, s] attention mask
                    v = v[..., :n, :]
            out[k] = v
        return out

    def __getattr__(self, name):  # Megatron reads the wrapped dataset's attributes (config, index, ...)
        if name in ("dataset", "length", "seq_length"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
