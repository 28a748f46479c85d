"""Point-to-point transport for the executor: torch.distributed isend/irecv, gloo or NCCL.

One process group per pair of pipeline ranks that exchange messages. The lowering pass guarantees that
both ranks of a pair post that pair's messages in the same order, so receives match sends
first-in first-out without tags, and a pair's traffic never queues behind another pair's
(NCCL runs each communicator on its own stream).
"""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def registered_groups() -> List[dist.ProcessGroup]:
    """The process groups torch still holds (WORLD included); a destroyed group is gone from it."""
    return list(dist.distributed_c10d._world.pg_map)


class PipelineTimeout(RuntimeError):
    """A rank waited too long for a message; names the rank, the pass and the peer."""


class PeerLost(PipelineTimeout):
    """A rank's send or receive failed because the transport to the peer broke (the peer's
    process exited or closed its connection, e.g. after its own timeout); names the rank, the
    pass and the peer, as a timeout does."""


class PairGroups:
    """Process groups for the pairs of pipeline ranks that exchange messages.

    ``pp_ranks[i]`` is the global rank of pipeline rank i in this rank's pipeline group;
    ``pairs`` are pipeline-rank pairs (a, b). Creating them is a collective over the whole
    world (every rank must call it, as Megatron's training loop does on its first step): the
    ranks first gather every pipeline group's pairs, then all create the same groups in the same
    order (torch requires that of ``new_group``).
    """

    def __init__(self, pp_ranks: Sequence[int], pairs: Iterable[Tuple[int, int]],
                 backend: Optional[str] = None):
        self.pp_ranks = list(pp_ranks)
        self.groups: Dict[Tuple[int, int], dist.ProcessGroup] = {}
        mine = sorted({tuple(sorted((self.pp_ranks[a], self.pp_ranks[b])))
                       for a, b in pairs if a != b})
        everyone: List = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        all_pairs = sorted({tuple(p) for lst in everyone for p in lst})
        me = dist.get_rank()
        back = {g: i for i, g in enumerate(self.pp_ranks)}
        for ga, gb in all_pairs:
            group = dist.new_group([ga, gb], backend=backend)
            if me in (ga, gb):
                self.groups[tuple(sorted((back[ga], back[gb])))] = group

    def group(self, a: int, b: int) -> dist.ProcessGroup:
        return self.groups[tuple(sorted((a, b)))]

    def alive(self) -> bool:
        """False once any of these groups was destroyed (e.g. model parallel state re-initialised)."""
        live = set(map(id, registered_groups()))
        return all(id(g) in live for g in self.groups.values())

    def destroy(self):
        for g in self.groups.values():
            try:
                dist.destroy_process_group(g)
            except Exception:  # pragma: no cover - best effort on shutdown
                pass
        self.groups.clear()


class P2P:
    """isend/irecv between pipeline ranks of one pipeline group."""

    def __init__(self, groups: PairGroups, my_pp_rank: int, timeout_s: float = 300.0,
                 exchange_shapes: bool = False, progress=None):
        self.groups = groups
        self.me = my_pp_rank
        self.timeout_s = timeout_s
        self.exchange_shapes = exchange_shapes
        # runtime.observe.progress.Progress: waits are published, and a timeout names the rank that
        # stopped first (the executor also reports its actions to it)
        self.progress = progress
        # (work, doing, peer) of sends not yet known complete. The work keeps its buffer alive
        # (NCCL: the allocator's stream record; gloo: the tensor itself; a host-staged send: its
        # host copy), so no tensor is held here: a gloo send reports complete only once waited
        # on, and holding the tensor too kept every sent GPU tensor to the iteration's end
        self._sends: List[Tuple[dist.Work, str, int]] = []
        self._peers: Dict[int, Tuple[dist.ProcessGroup, int]] = {}  # pp rank -> (pair group, global rank)
        self._timeouts: Dict[float, datetime.timedelta] = {}

    def _peer_global(self, pp_rank: int) -> int:
        return self.groups.pp_ranks[pp_rank]

    def _peer(self, peer: int) -> Tuple[dist.ProcessGroup, int]:
        """(the pair's process group, the peer's global rank), looked up once per peer."""
        got = self._peers.get(peer)
        if got is None:
            got = self._peers[peer] = (self.groups.group(self.me, peer), self._peer_global(peer))
        return got

    def send(self, tensor: torch.Tensor, peer: int, what: str = "a tensor") -> None:
        g, dst = self._peer(peer)
        tensor = tensor.detach().contiguous()
        doing = f"waited {{s}}s to send {what} to"
        with self._transport(doing, peer):  # gloo raises a broken pair's error when a send is posted
            if self.exchange_shapes:
                shape = torch.tensor(list(tensor.shape), dtype=torch.int64, device=tensor.device)
                n = torch.tensor([shape.numel()], dtype=torch.int64, device=tensor.device)
                self._sends.append((dist.isend(n, dst, group=g), doing, peer))
                self._sends.append((dist.isend(shape, dst, group=g), doing, peer))
            self._sends.append((dist.isend(tensor, dst, group=g), doing, peer))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device, peer: int, what: str):
        """Post a receive; returns a handle whose ``wait()`` gives the tensor."""
        g, src = self._peer(peer)
        if self.exchange_shapes:
            n = torch.empty(1, dtype=torch.int64, device=device)
            self._wait(self._irecv(n, src, g, what, peer), what, peer)
            shp = torch.empty(int(n.item()), dtype=torch.int64, device=device)
            self._wait(self._irecv(shp, src, g, what, peer), what, peer)
            shape = [int(x) for x in shp.tolist()]
        buf = torch.empty(tuple(shape), dtype=dtype, device=device, requires_grad=False)
        return _Pending(self, buf, self._irecv(buf, src, g, what, peer), what, peer)

    def _irecv(self, buf, src, g, what, peer):
        with self._transport(f"waited {{s}}s to post the receive of {what} from", peer):
            return dist.irecv(buf, src, group=g)

    def _wait(self, work, what: str, peer: int):
        """Wait (at most the timeout) for the receive of ``what`` from ``peer``, published as this
        rank's wait (runtime.observe.progress) while it lasts."""
        prog = self.progress
        if prog is not None:
            prog.waiting(what, peer, self._peer_global(peer))
        try:
            with self._transport(f"waited {{s}}s for {what} from", peer):
                self._wait_work(work)
        finally:
            if prog is not None:
                prog.wait_over()

    def _wait_work(self, work):
        t = self.timeout_s
        if t is None:
            work.wait()
        else:
            delta = self._timeouts.get(t)
            if delta is None:
                delta = self._timeouts[t] = datetime.timedelta(seconds=t)
            work.wait(timeout=delta)

    @contextlib.contextmanager
    def _transport(self, doing: str, peer: int):
        """A transport error inside the block becomes a PipelineTimeout (the wait ran out) or a
        PeerLost (the connection to the peer broke), one line: this rank, what it did (``doing``,
        with ``{s}`` for the seconds, followed by the peer), the peer, the rank diagnosed as the
        culprit and, for PeerLost, the transport's own words."""
        t0 = time.monotonic()
        try:
            yield
        except PipelineTimeout:
            raise
        except RuntimeError as e:
            timed_out = "imed out" in str(e) or "imeout" in str(e)
            head = (f"pipeline rank {self.me} (global rank {dist.get_rank()}) "
                    f"{doing.replace('{s}', f'{time.monotonic() - t0:.0f}')} "
                    f"pipeline rank {peer} (global rank {self._peer_global(peer)})")
            prog = self.progress
            blame = "that rank is stuck or has failed" if prog is None else \
                prog.diagnose(self.groups.pp_ranks, self._peer_global(peer))
            if timed_out:
                raise PipelineTimeout(f"{head}; {blame}") from None
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLost(f"{head} and lost the connection to it; {blame} "
                           f"(transport: {first_line[:300]})") from None

    def reap_sends(self, block: bool = False) -> None:
        """Forget completed sends (their buffers may be freed); with block, wait for all (each at
        most the timeout). Without block, one pass over the pending sends' flags (gloo marks a send
        complete only once waited on: the list holds the iteration's sends until the end)."""
        if not block:
            try:
                self._sends = [x for x in self._sends if not x[0].is_completed()]
                return
            except RuntimeError:  # a broken transport: below, each send in turn, its peer named
                pass
        keep = []
        for work, doing, peer in self._sends:
            with self._transport(doing, peer):
                if block:
                    self._wait_work(work)
                elif not work.is_completed():
                    keep.append((work, doing, peer))
        self._sends = keep


class _Pending:
    def __init__(self, p2p: P2P, buf: torch.Tensor, work, what: str, peer: int):
        self.p2p, self.buf, self.work, self.what, self.peer = p2p, buf, work, what, peer

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.p2p._wait(self.work, self.what, self.peer)
            self.work = None
        return self.buf
