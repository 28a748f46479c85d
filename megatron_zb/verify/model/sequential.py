"""A deliberately naive pipelined forward-backward for any placement (the ``sequential``
pseudo-schedule of ``megatron-zb verify``): it checks a model placement independently of any
real schedule."""
from __future__ import annotations

__all__ = ["SequentialForwardBackward"]


class SequentialForwardBackward:
    """A naive, obviously-correct pipelined forward-backward for any placement.

    Megatron's forward-backward signature. Microbatch by microbatch: the forward through stages
    0..S-1 (activations sent to the next stage's rank, or handed over locally), the loss, then
    the backward through S-1..0. Deadlock-free because every rank walks the same stage order.
    Used to check model placement (e.g. V) independently of any real schedule.
    """

    def __init__(self, placement):
        self.placement = placement

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length=None,
                 micro_batch_size=None, decoder_seq_length=None, forward_only=False, collect_non_loss_data=False,
                 first_val_step=None, **_ignored):
        """One iteration. The keywords are megatron-core's forward-backward signature (it stands in for
        ``get_forward_backward_func()``'s result, called as Megatron calls it): they cannot be grouped."""
        import contextlib

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.utils import get_attr_wrapped_model, get_model_config

        from ..processes.rankio import set_status

        chunks = model if isinstance(model, list) else [model]
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        config = get_model_config(chunks[0])
        pl = self.placement
        S = pl.num_stages
        pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        me = parallel_state.get_pipeline_model_parallel_rank()
        mine = {s: i for i, s in enumerate(pl.stages_of(me))}
        store = []
        total_tokens = torch.zeros([], dtype=torch.int)

        def send(t, to_stage, what):
            dst = pl.rank_of(to_stage)
            set_status(f"sequential: send {what} to stage {to_stage} on pp rank {dst}")
            shape = torch.tensor(list(t.shape), dtype=torch.int64)
            dist.send(shape, pp_ranks[dst])
            dist.send(t.detach().contiguous(), pp_ranks[dst])

        def recv(from_stage, what):
            src = pl.rank_of(from_stage)
            set_status(f"sequential: wait for {what} from stage {from_stage} on pp rank {src}")
            shape = torch.zeros(3, dtype=torch.int64)
            dist.recv(shape, pp_ranks[src])
            t = torch.empty(tuple(int(x) for x in shape), dtype=config.pipeline_dtype)
            dist.recv(t, pp_ranks[src])
            return t

        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            ctxs = [f() for f in no_sync]
        elif no_sync is not None:
            ctxs = [no_sync()]
        else:
            ctxs = []
        with contextlib.ExitStack() as stack:
            for c in ctxs:
                stack.enter_context(c)
            for mb in range(num_microbatches):
                inputs, outputs = {}, {}
                local = None
                for s in range(S):
                    owner = pl.rank_of(s)
                    if owner != me:
                        if s > 0 and pl.rank_of(s - 1) == me:
                            send(local, s, f"activation of mb {mb}")
                        continue
                    if s == 0:
                        x = None
                    elif pl.rank_of(s - 1) == me:
                        x = local.detach().requires_grad_(not forward_only)
                    else:
                        x = recv(s - 1, f"activation of mb {mb}").requires_grad_(not forward_only)
                    m = chunks[mine[s]]
                    set_status(f"sequential: F stage {s} mb {mb}")
                    get_attr_wrapped_model(m, "set_input_tensor")(x)
                    with (torch.no_grad() if forward_only else contextlib.nullcontext()):
                        out, loss_fn = forward_step_func(iters[mine[s]], m)
                        if s == S - 1:
                            sum_loss, ntok, report = loss_fn(out)
                            total_tokens += ntok.to(torch.int)
                            if not config.calculate_per_token_loss:
                                out = sum_loss / torch.clamp(ntok, min=1) / num_microbatches
                            else:
                                out = sum_loss
                            store.append(report)
                    inputs[s], outputs[s] = x, out
                    local = out
                if forward_only:
                    continue
                grad = None
                for s in reversed(range(S)):
                    owner = pl.rank_of(s)
                    if owner != me:
                        if s < S - 1 and pl.rank_of(s + 1) == me:
                            send(grad, s, f"input gradient of mb {mb}")
                        continue
                    if s < S - 1 and pl.rank_of(s + 1) != me:
                        grad = recv(s + 1, f"input gradient of mb {mb}")
                    set_status(f"sequential: B stage {s} mb {mb}")
                    if s == S - 1:
                        torch.autograd.backward(outputs[s])
                    else:
                        torch.autograd.backward(outputs[s], grad_tensors=grad)
                    grad = inputs[s].grad if inputs[s] is not None else None
        if not forward_only and config.finalize_model_grads_func is not None:
            set_status("sequential: finalize_model_grads")
            config.finalize_model_grads_func(chunks, total_tokens if config.calculate_per_token_loss else None)
        holds_last = pl.rank_of(S - 1) == me
        return store if holds_last else []
