"""Megatron's GPT samples cut to variable lengths (``--zero-bubble-seq-lengths``, also spelt
``--zero-bubble-mock-seq-lengths``): each sample ``i`` keeps its first ``length(i, sample)`` tokens:
a length distribution's draw, deterministic per sample (mock data then looks like post-training data
whose lengths vary 10-100x), or, with ``eod``, the sample up to its first end-of-document token (a
real GPT dataset's documents as the sequences). Needs ``--variable-seq-lengths`` (and
``--micro-batch-size 1``: Megatron's loader stacks a microbatch)."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["VariableLengthDataset", "up_to_eod"]


def up_to_eod(eod: int) -> Callable[[int, dict], int]:
    """A sample's length up to and including its first label that is the end-of-document token
    ``eod`` (the whole sample where none is)."""
    def length(i: int, sample: dict) -> int:
        labels = sample.get("labels")
        if labels is None:
            labels = sample["tokens"][1:]
        hits = (torch.as_tensor(labels) == eod).nonzero()
        return int(hits[0, -1]) + 1 if hits.numel() else int(torch.as_tensor(labels).shape[-1])
    return length


class VariableLengthDataset(torch.utils.data.Dataset):
    """``length(i, sample)``: how many of sample ``i``'s tokens to keep (at least 1, at most the
    sequence length)."""

    def __init__(self, dataset, length: Callable[[int, dict], int], seq_length: int):
        self.dataset, self.length, self.seq_length = dataset, length, int(seq_length)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample = self.dataset[i]
        n = max(1, min(self.seq_length, int(self.length(int(i), sample))))
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
