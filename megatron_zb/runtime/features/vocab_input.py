"""The input embedding split over the pipeline ranks at run time (``--split-vocab-embedding``; the
schedule core places its passes: ``core.ir.vocab``). No Megatron here: the shard, the groups and the
token source come from the caller (``megatron.features.vocab_parallel``).

Every rank holds rows [v0, v1) of the embedding (tied embeddings: the rows of its output-layer
shard, the same tensor). Per microbatch j:

* **VI**: the token source (the first stage's rank, tensor-parallel rank 0) reads j's tokens and
  broadcasts them (group ``tokens``: every shard); every rank looks up its rows, zeros for the
  tokens outside them, and the partial outputs are summed over every shard (group ``total``, an
  asynchronous all-reduce: barrier CI). A rank other than the first stage's posts here the receive
  of j's output gradient (group ``grad``: this tensor-parallel slice's pipeline ranks);
* **F(0, j)** on the first stage's rank takes the sum (``output``) as the embedding's output: a
  leaf that requires a gradient, waited for there;
* after **B(0, j)** (``backward_done``) the leaf's gradient is broadcast from the first stage's
  rank (barrier CG), asynchronously;
* **VG**: once it is in, each rank's rows' weight gradient (a scatter-add of the gradient of the
  tokens inside its rows), given to the weight (``deliver``).

Evaluation (``forward_only``): VI and F only. Every collective of a group is issued in microbatch
order on every rank, so the ranks agree on them without a handshake.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["InputGroups", "InputRuntime"]


@dataclass
class InputGroups:
    """The process groups of one model replica's split embedding."""

    tokens: object  # every shard of the replica (P x TP ranks): the tokens from the source
    total: object  # the same ranks: the sum of the partial outputs
    grad: object  # this TP slice's pipeline ranks: the output gradient from the first stage's rank
    token_src: int  # global rank of the token source
    grad_src: int  # global rank of this TP slice's first-stage rank


@dataclass
class _Micro:
    idx: Optional[torch.Tensor] = None  # [T] row within the shard (0 outside it)
    inside: Optional[torch.Tensor] = None  # [T] the token falls in the shard
    out: Optional[torch.Tensor] = None  # the partial output, summed in place [b, s, h]
    leaf: Optional[torch.Tensor] = None  # the first stage's rank: the output F took
    grad: Optional[torch.Tensor] = None  # the output gradient [b, s, h]
    handles: Dict[str, object] = field(default_factory=dict)
    keep: List[torch.Tensor] = field(default_factory=list)  # buffers of collectives in flight


class InputRuntime:
    """One rank's embedding rows and its passes VI and VG (``run``), plus the first stage's side
    (``output``, ``backward_done``). ``read_tokens(mb) -> [b, s]`` on the token source;
    ``deliver(weight, grad)`` gives the rows' gradient to the parameter; ``wait(handle, what)``
    waits for a collective (the caller's timeout and message)."""

    def __init__(self, weight: torch.nn.Parameter, vocab_start: int, groups: InputGroups, is_first: bool,
                 read_tokens: Optional[Callable], deliver: Callable, device, wait: Optional[Callable] = None):
        self.weight, self.v0, self.groups, self.is_first = weight, int(vocab_start), groups, bool(is_first)
        self.read_tokens, self.deliver = read_tokens, deliver
        self.device = device
        self.wait = wait or (lambda handle, what: handle.wait())
        self.mb: Dict[int, _Micro] = {}
        self.forward_only = False
        self.current: Optional[int] = None  # the microbatch the first stage's forward runs

    @property
    def is_source(self) -> bool:
        return dist.get_rank() == self.groups.token_src

    def run(self, kind: str, mb: int) -> None:
        (self._vi if kind == "VI" else self._vg)(mb)

    def _tokens(self, mb: int, st: _Micro) -> torch.Tensor:
        g = self.groups
        if self.is_source:
            tokens = self.read_tokens(mb).to(device=self.device, dtype=torch.int64).contiguous()
            head = torch.tensor(list(tokens.shape), dtype=torch.int64, device=self.device)
            st.keep += [head, tokens]
            st.handles["tokens"] = [dist.broadcast(t, g.token_src, group=g.tokens, async_op=True)
                                    for t in (head, tokens)]
            return tokens
        head = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.wait(dist.broadcast(head, g.token_src, group=g.tokens, async_op=True),
                  f"the tokens of microbatch {mb} from the first stage")
        tokens = torch.empty(*[int(v) for v in head.tolist()], dtype=torch.int64, device=self.device)
        self.wait(dist.broadcast(tokens, g.token_src, group=g.tokens, async_op=True),
                  f"the tokens of microbatch {mb} from the first stage")
        return tokens

    def _vi(self, mb: int) -> None:
        st = self.mb.setdefault(mb, _Micro())
        tokens = self._tokens(mb, st)
        w = self.weight.detach()
        st.inside = (tokens >= self.v0) & (tokens < self.v0 + w.shape[0])
        st.idx = torch.where(st.inside, tokens - self.v0, torch.zeros_like(tokens))
        out = torch.nn.functional.embedding(st.idx, w) * st.inside.unsqueeze(-1).to(w.dtype)
        st.out = out.contiguous()
        g = self.groups
        st.handles["sum"] = dist.all_reduce(st.out, group=g.total, async_op=True)
        if not self.forward_only and not self.is_first:  # the output gradient's receive, posted early
            st.grad = torch.empty_like(st.out)
            st.handles["grad"] = dist.broadcast(st.grad, g.grad_src, group=g.grad, async_op=True)

    def output(self) -> torch.Tensor:
        """The first stage's rank, in F(0, ``current``): the summed embedding output [b, s, h]."""
        mb = self.current
        st = self.mb.get(mb)
        if st is None or "sum" not in st.handles:
            raise RuntimeError(f"the split embedding's output of microbatch {mb} was not looked up (no VI ran)")
        self.wait(st.handles.pop("sum"), f"the embedding output of microbatch {mb} (the sum over the shards)")
        out, st.out = st.out, None
        if self.forward_only:
            self._done_if_empty(mb, st)
            return out
        st.leaf = out.detach().requires_grad_(True)
        return st.leaf

    def backward_done(self, mb: int) -> None:
        """The first stage's rank, after B(0, ``mb``): the output gradient to every rank of the slice."""
        st = self.mb[mb]
        leaf, st.leaf = st.leaf, None
        grad = leaf.grad if leaf is not None else None
        st.grad = (torch.zeros_like(leaf) if grad is None else grad).to(leaf.dtype).contiguous()
        g = self.groups
        st.handles["grad"] = dist.broadcast(st.grad, g.grad_src, group=g.grad, async_op=True)

    def _vg(self, mb: int) -> None:
        st = self.mb[mb]
        self.wait(st.handles.pop("grad"), f"the embedding output's gradient of microbatch {mb} from the first stage")
        if "sum" in st.handles:  # this rank's part of the sum (long done)
            st.handles.pop("sum").wait()
        for h in st.handles.pop("tokens", []):
            h.wait()
        w = self.weight
        rows = st.idx[st.inside]
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        gw.index_add_(0, rows, st.grad[st.inside].float())
        self.deliver(w, gw.to(w.dtype))
        self.mb.pop(mb)

    def _done_if_empty(self, mb: int, st: _Micro) -> None:
        for h in st.handles.pop("tokens", []):
            h.wait()
        if not st.handles:
            self.mb.pop(mb, None)

    def finish(self) -> None:
        """The end of a call: evaluation's partial sums are waited for; nothing else may be left."""
        for mb in sorted(self.mb):
            st = self.mb[mb]
            if self.forward_only and set(st.handles) <= {"sum", "tokens"}:
                for k in ("sum", "tokens"):
                    hs = st.handles.pop(k, [])
                    for h in (hs if isinstance(hs, list) else [hs]):
                        h.wait()
                self.mb.pop(mb)
        if self.mb:
            raise RuntimeError(f"the split embedding's passes of microbatch(es) {sorted(self.mb)} did not finish")
