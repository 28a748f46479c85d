"""Vocabulary parallelism at run time: every pipeline rank's shard of the output layer and its
passes VS, VT, VW (the schedule core places them: ``core.ir.vocab``). No Megatron here: the shard's
weight, the groups and what Megatron's loss step does come from the caller
(``megatron.features.vocab_parallel``).

Per microbatch j (T tokens, hidden h, shard rows [v0, v1) of the vocabulary on this rank):

* the loss stage's forward hands its hidden states X_j [s, b, h] and the labels over
  (``loss_output``): they are broadcast to the pipeline ranks (asynchronously, group ``bcast``);
* **VS**: logits_r = X W_r^T (fp32), the shard's maximum m_r, sum of exp(logits_r - m_r) s_r and
  the target's logit where the target falls in the shard; these statistics are all-gathered over
  every shard (group ``stats``, asynchronous: barrier C0). With one barrier VS also computes the
  shard's part of the input gradient, unnormalised: A_r = exp(logits_r - m_r) W_r and the target
  rows G_r, gathered to the loss stage's rank with C0 (group ``grad``);
* **VT**: from C0, M = max m_r, S = sum s_r exp(m_r - M): the shard's softmax exp(logits_r - M) / S
  minus the one-hot target is the logits' gradient d_r per unit loss. The loss stage's rank computes
  each token's loss log S + M - target logit, runs Megatron's loss step on it (``loss_step``: the
  user's loss function, its scaling) and gets each token's gradient scale g, which it broadcasts
  (group ``scale``). With two barriers VT computes the input gradient's part d_r W_r, summed over
  the shards by an all-reduce (group ``grad``: barrier C1); with one barrier the loss stage's rank
  sums the gathered parts, each rescaled by exp(m_r - M) / S. The loss stage's backward takes
  dX = g * (the sum) as its output gradient (``loss_grad``);
* **VW**: the shard's weight gradient (g d_r)^T X, given to the weight (``deliver``).

Evaluation (``forward_only``): VS computes the statistics alone, VT the loss (the loss stage's
rank runs the loss step on it); no gradient, no VW.

Tensor parallelism: the shards are V / (P x TP) rows each, ordered by global rank; the statistics
and the two-barrier gradient sum run over all P x TP shards; with one barrier each tensor-parallel
slice gathers its pipeline ranks' parts and the loss stage sums them over its tensor-parallel group.

Every collective of one group is issued in microbatch order on every rank (the schedule runs each
rank's VS, VT, VW in microbatch order, the loss stage its forwards), so ranks agree on them
without any handshake. Nothing waits for a collective it does not need: the loss stage's
broadcasts are waited for at its VW, a VS waits only for the hidden states it reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...core.ir import VOCAB_KINDS, VS, VT, VW

__all__ = ["VocabGroups", "VocabConfig", "VocabRuntime", "handlers"]


@dataclass
class VocabGroups:
    """The process groups of one model replica's vocabulary passes."""

    bcast: object  # this TP slice's pipeline ranks: X and labels from the loss stage
    scale: object  # the same ranks: the per-token gradient scale from the loss stage
    stats: object  # every shard of the replica (P x TP ranks, by global rank): the statistics
    grad: object  # two barriers: every shard (all-reduce); one barrier: this TP slice's pipeline ranks (gather)
    tp: Optional[object]  # the loss stage's tensor-parallel group (one barrier, TP > 1), else None
    loss_src: int  # global rank of this TP slice's loss-stage rank
    num_shards: int
    slice_shards: List[int]  # one barrier: the shard index of each rank of ``grad``, in its rank order


@dataclass
class VocabConfig:
    """One rank's side of the vocabulary passes: its groups, the barriers per microbatch (1 or 2),
    whether it holds the loss stage, and the hidden states' width, dtype and device."""

    groups: VocabGroups
    barriers: int
    is_loss_rank: bool
    hidden_size: int
    dtype: torch.dtype
    device: object


@dataclass
class _Micro:
    x: Optional[torch.Tensor] = None  # [T, h]
    labels: Optional[torch.Tensor] = None  # [T] (s-major, as X)
    shape: Optional[Tuple[int, ...]] = None  # X's [s, b, h]
    logits: Optional[torch.Tensor] = None
    gathered: Optional[torch.Tensor] = None  # [n, 3, T] every shard's (m, s, target logit)
    parts: Optional[torch.Tensor] = None  # one barrier: this shard's [2, T, h]; gathered [P, 2, T, h]
    d: Optional[torch.Tensor] = None  # the logits' gradient per unit loss [T, V_r]
    dx: Optional[torch.Tensor] = None  # the input gradient (summed), per unit loss
    g: Optional[torch.Tensor] = None  # [T] per-token gradient scale
    handles: Dict[str, object] = field(default_factory=dict)
    keep: List[torch.Tensor] = field(default_factory=list)  # buffers of collectives in flight


class VocabRuntime:
    """One rank's shard and its passes (``run``), plus the loss stage's hand-over (``loss_output``)
    and output gradient (``loss_grad``). ``loss_step(mb, losses [b, s]) -> g [b, s]`` runs on the
    loss stage's rank; ``deliver(weight, grad)`` gives the shard's weight gradient to its parameter.
    ``wait(handle, what)`` waits for a collective (the caller's timeout and message)."""

    def __init__(self, weight: torch.nn.Parameter, vocab_start: int, config: VocabConfig,
                 loss_step: Optional[Callable], deliver: Callable, wait: Optional[Callable] = None):
        self.weight, self.v0, self.groups, self.barriers = weight, int(vocab_start), config.groups, int(config.barriers)
        self.is_loss_rank, self.loss_step, self.deliver = config.is_loss_rank, loss_step, deliver
        self.h, self.dtype, self.device = int(config.hidden_size), config.dtype, config.device
        self.wait = wait or (lambda handle, what: handle.wait())
        self.mb: Dict[int, _Micro] = {}
        self.forward_only = False  # this call evaluates: statistics and losses only

    @property
    def v1(self) -> int:
        return self.v0 + self.weight.shape[0]

    # -- the loss stage's side --------------------------------------------------------------------
    def loss_output(self, mb: int, hidden: torch.Tensor, labels: torch.Tensor) -> None:
        """The loss stage's forward of ``mb`` ended: X [s, b, h] and labels [b, s] to every rank."""
        st = self.mb.setdefault(mb, _Micro())
        st.shape = tuple(hidden.shape)
        st.x = hidden.detach().reshape(-1, self.h).contiguous()
        st.labels = labels.detach().t().reshape(-1).to(torch.int64).contiguous()
        g = self.groups
        head = torch.tensor(list(st.shape), dtype=torch.int64)
        st.keep += [head]
        st.handles["send"] = [dist.broadcast(t, g.loss_src, group=g.bcast, async_op=True)
                              for t in (head, st.x, st.labels)]

    def loss_grad(self, mb: int) -> torch.Tensor:
        """The loss stage's output gradient dX [s, b, h] of ``mb`` (after the last barrier)."""
        st = self.mb[mb]
        if "grad" in st.handles:  # two barriers: the all-reduce of the parts
            self.wait(st.handles.pop("grad"), f"the vocabulary input gradient of microbatch {mb}")
        out = (st.dx * st.g.unsqueeze(1)).to(self.dtype).reshape(st.shape)
        st.dx = None
        if st.d is None and not st.handles:  # its VW ran: nothing of it is left
            self.mb.pop(mb, None)
        return out

    # -- the passes -----------------------------------------------------------------------------
    def run(self, kind: str, mb: int) -> None:
        {VS: self._vs, VT: self._vt, VW: self._vw}[kind](mb)

    def _received(self, mb: int) -> _Micro:
        """X and the labels of ``mb`` on this rank (a non-loss rank joins the broadcasts here)."""
        st = self.mb.setdefault(mb, _Micro())
        if self.is_loss_rank:
            return st
        g = self.groups
        head = torch.zeros(3, dtype=torch.int64)
        self.wait(dist.broadcast(head, g.loss_src, group=g.bcast, async_op=True),
                  f"the hidden states of microbatch {mb} from the loss stage")
        shape = tuple(int(v) for v in head.tolist())
        tokens = shape[0] * shape[1]
        st.shape = shape
        st.x = torch.empty(tokens, self.h, dtype=self.dtype, device=self.device)
        st.labels = torch.empty(tokens, dtype=torch.int64, device=self.device)
        for t in (st.x, st.labels):
            self.wait(dist.broadcast(t, g.loss_src, group=g.bcast, async_op=True),
                      f"the hidden states of microbatch {mb} from the loss stage")
        return st

    def _target(self, st: _Micro):
        inside = (st.labels >= self.v0) & (st.labels < self.v1)
        idx = torch.where(inside, st.labels - self.v0, torch.zeros_like(st.labels))
        return inside, idx

    def _vs(self, mb: int) -> None:
        st = self._received(mb)
        w = self.weight.detach()
        logits = torch.matmul(st.x, w.t()).float()  # [T, V_r]
        m = logits.max(dim=1).values
        e = torch.exp(logits - m.unsqueeze(1))
        inside, idx = self._target(st)
        tgt = torch.where(inside, logits.gather(1, idx.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
        stats = torch.stack([m, e.sum(dim=1), tgt])  # [3, T]
        g = self.groups
        st.gathered = torch.empty((g.num_shards,) + tuple(stats.shape), dtype=stats.dtype, device=stats.device)
        st.keep.append(stats)
        st.handles["stats"] = dist.all_gather(list(st.gathered.unbind(0)), stats, group=g.stats, async_op=True)
        if self.forward_only:  # the loss needs the statistics alone
            return
        st.logits = logits
        if self.barriers == 1:  # the input gradient's part, relative to this shard's maximum
            a = torch.matmul(e.to(w.dtype), w).float()
            rows = torch.where(inside.unsqueeze(1), w.index_select(0, idx).float(), torch.zeros_like(a))
            part = torch.stack([a, rows])
            st.keep.append(part)
            n = dist.get_world_size(g.grad)
            if self.is_loss_rank:
                st.parts = torch.empty((n,) + tuple(part.shape), dtype=part.dtype, device=part.device)
                st.handles["grad"] = dist.gather(part, list(st.parts.unbind(0)), dst=g.loss_src, group=g.grad,
                                                 async_op=True)
            else:
                st.handles["grad"] = dist.gather(part, None, dst=g.loss_src, group=g.grad, async_op=True)

    def _vt(self, mb: int) -> None:
        st = self.mb[mb]
        self.wait(st.handles.pop("stats"), f"the vocabulary statistics of microbatch {mb}")
        gm, gs, gt = st.gathered[:, 0], st.gathered[:, 1], st.gathered[:, 2]
        M = gm.max(dim=0).values
        S = (gs * torch.exp(gm - M.unsqueeze(0))).sum(dim=0)
        if self.forward_only:
            self._evaluated(mb, st, (torch.log(S) + M - gt.sum(dim=0)))
            return
        inside, idx = self._target(st)
        d = torch.exp(st.logits - M.unsqueeze(1)) / S.unsqueeze(1)
        rows = torch.arange(d.shape[0], device=d.device)[inside]
        d[rows, idx[inside]] -= 1.0
        st.d, st.logits = d, None
        g = self.groups
        if self.is_loss_rank:
            s, b = st.shape[0], st.shape[1]
            losses = (torch.log(S) + M - gt.sum(dim=0)).reshape(s, b).t().contiguous()  # [b, s], Megatron's layout
            st.g = self.loss_step(mb, losses).detach().t().reshape(-1).float().contiguous()
        else:
            st.g = torch.empty(d.shape[0], dtype=torch.float32, device=d.device)
        st.handles["scale"] = dist.broadcast(st.g, g.loss_src, group=g.scale, async_op=True)
        w = self.weight.detach()
        if self.barriers == 2:
            st.dx = torch.matmul(d.to(w.dtype), w).float()
            st.handles["grad"] = dist.all_reduce(st.dx, group=g.grad, async_op=True)
            return
        self.wait(st.handles.pop("grad"), f"the vocabulary input gradient parts of microbatch {mb}")
        if self.is_loss_rank:  # one barrier: the gathered parts, rescaled to the global maximum
            shard_m = gm[torch.tensor(g.slice_shards, device=gm.device)]  # [P, T]
            weight = torch.exp(shard_m - M.unsqueeze(0)) / S.unsqueeze(0)
            dx = (st.parts[:, 0] * weight.unsqueeze(2)).sum(dim=0) - st.parts[:, 1].sum(dim=0)
            if g.tp is not None:
                dist.all_reduce(dx, group=g.tp)
            st.dx = dx
        st.parts = None

    def _evaluated(self, mb: int, st: _Micro, losses: torch.Tensor) -> None:
        """Evaluation: the loss stage's rank runs the loss step on the per-token losses; the
        microbatch is done on every rank."""
        if self.is_loss_rank:
            s, b = st.shape[0], st.shape[1]
            self.loss_step(mb, losses.reshape(s, b).t().contiguous())
            for h in st.handles.pop("send", []):
                h.wait()
        self.mb.pop(mb, None)

    def _vw(self, mb: int) -> None:
        st = self.mb[mb]
        self.wait(st.handles.pop("scale"), f"the loss scale of microbatch {mb} from the loss stage")
        gw = torch.matmul((st.d * st.g.unsqueeze(1)).t(), st.x.float())
        self.deliver(self.weight, gw.to(self.weight.dtype))
        for h in st.handles.pop("send", []):  # the loss stage's broadcasts: long received by now
            h.wait()
        if not self.is_loss_rank:
            if "grad" in st.handles:  # two barriers: this rank's part is summed (the loss rank took it)
                st.handles.pop("grad").wait()
            self.mb.pop(mb, None)
            return
        st.d = st.x = st.labels = st.gathered = None
        st.keep.clear()
        if st.dx is None and not st.handles:  # the loss stage's backward took its gradient already
            self.mb.pop(mb, None)

    def finish(self) -> None:
        """The end of an iteration: nothing may be left."""
        left = sorted(self.mb)
        if any(self.mb[mb].handles or self.mb[mb].d is not None for mb in left):
            raise RuntimeError(f"vocabulary passes of microbatch(es) {left} did not finish")
        self.mb.clear()


def handlers(vocab) -> dict:
    """The executor's handlers of the vocabulary passes (VS, VT, VW, VI, VG): each runs on this
    rank's shard through ``vocab.run(kind, mb)`` (``StagePasses.vocab``) inside the passes' compute
    hooks."""
    def one(run, a, i):
        with run.hooks.compute(a, ()):
            vocab.run(a.kind, a.mb)
    return {kind: one for kind in VOCAB_KINDS}
