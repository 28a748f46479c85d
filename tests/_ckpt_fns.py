"""Rank code for tests/test_checkpoint_resume.py (module-level, so launched ranks can import it).

One case = one schedule/placement. On every rank:

1. *Uninterrupted*: build the tiny GPT, run ``iterations`` training iterations (megatron's
   ``get_forward_backward_func()`` after ``install(schedule)``), record the losses and the final
   parameters. The step is plain SGD like the harness, or (``case["optimizer"]``) megatron's own
   optimizer (``get_megatron_optimizer``, Adam with clipping, so it has state to checkpoint).
2. *Interrupted*: rebuild parallel state and model from the same initial weights, run ``split``
   iterations, save a megatron-core distributed checkpoint: ``dist_checkpointing.save`` of the
   DDP-unwrapped chunks' ``sharded_state_dict()``, under ``model`` (one chunk) or ``model0``,
   ``model1``, ... (several), plus ``optimizer.sharded_state_dict(...)`` — the layout of
   ``megatron.training.checkpointing.generate_state_dict``. Then drop model, optimizer and parallel
   state, rebuild them, give the chunks *different* weights (another init seed), load the checkpoint
   (``dist_checkpointing.load``, ``load_state_dict``) and run the remaining iterations.

The parent compares the two runs' losses and final parameters.

``case["last"]`` (default True): the launch's last case on this rank stops megatron's checkpoint writer
(its results-queue Manager); the cases before it leave it running for the next, as one training does.

Vocabulary parallelism: ``case["vocab"]`` (barriers, or None) for the uninterrupted run and the
saving one, ``case["resume_vocab"]`` for the resumed one (default the same): a checkpoint saved with
it resumes without it and the other way round (the shards are the output layer's rows);
``case["emb"]`` / ``case["resume_emb"]``: with the input embedding split too (--split-vocab-embedding).
"""
from __future__ import annotations

import gc
import os

_DIFFERENT_SEED = 98765


def _allow_save_without_psutil():
    """megatron's checkpoint writer (``FileSystemWriterAsync.write_preloaded_data``, both 0.16.1 and
    0.19.2) calls ``_process_memory()`` for a debug log line, which raises when psutil is absent;
    psutil is not a megatron-core dependency and not in this venv. The writer runs in forked
    worker processes, the exception kills them and the parent then waits forever on the queue.
    The value is only logged, so answer 0 when psutil is missing."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa
    if not getattr(fa, "HAVE_PSUTIL", True):
        fa._process_memory = lambda: 0


def _setup(case, M, vocab=None, emb=False):
    """(Re)initialise parallel state, build (optionally DDP-wrapped) chunks and the optimizer."""
    from megatron_zb.megatron.execution import finalize as F
    from megatron_zb.megatron.layout import placement as P
    import torch
    from megatron.core import parallel_state

    placement = P.make_placement(case["placement"], case["pp"], case.get("chunks"))
    M.init_parallel_state(case["tp"], case["pp"], placement, seed=1234, vocab_parallel=bool(vocab))
    cfg = M.TinyGPTConfig(num_layers=case.get("num_layers", 4), tie_embeddings=not case.get("untied"))
    chunks = M.build_model_chunks(cfg, placement, M.ChunkOptions(vocab_parallel=bool(vocab),
                                                                 vocab_embedding=bool(vocab and emb)))
    config = chunks[0].config
    ddp = bool(case.get("ddp") or case.get("optimizer"))
    if ddp:
        chunks = M.wrap_ddp(chunks)
    F.configure_grad_sync(config, chunks, placement=placement, ddp=ddp)
    opt = None
    if case.get("optimizer"):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        # Adam, megatron's default (torch's AdamW without apex/TE). Not SGD with momentum: megatron
        # gives SGD no init_state_fn, so FP32Optimizer.sharded_state_dict(is_loading=True) on a fresh
        # optimizer calls None (0.16.1 and 0.19.2) and an SGD-momentum torch_dist checkpoint cannot
        # be loaded into a new process's optimizer.
        ocfg = OptimizerConfig(optimizer="adam", lr=case["adam_lr"], weight_decay=0.01, clip_grad=1.0,
                               bf16=False, fp16=False, params_dtype=torch.float32)
        opt = get_megatron_optimizer(ocfg, list(chunks), use_gloo_process_groups=False)
    infos = [P.unwrap(c).mzb_chunk_info for c in chunks]
    reports = any(i.post_process for i in infos) and parallel_state.get_tensor_model_parallel_rank() == 0
    return {"placement": placement, "cfg": cfg, "chunks": chunks, "opt": opt, "reports_loss": reports}


def _train(case, M, state, iterations):
    import torch.distributed as dist
    import megatron.core.pipeline_parallel as mpp

    fb = mpp.get_forward_backward_func()
    cfg, chunks, opt = state["cfg"], state["chunks"], state["opt"]
    losses = {}
    for it in iterations:
        M.zero_grads_(chunks)
        if opt is not None:
            opt.zero_grad()
        batches = M.make_batches(cfg, case["num_microbatches"], it)
        out = fb(forward_step_func=M.forward_step_func, data_iterator=M.batch_iterators(batches, len(chunks)),
                 model=list(chunks), num_microbatches=case["num_microbatches"], seq_length=cfg.seq_length,
                 micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length, forward_only=False)
        if state["reports_loss"]:
            losses[it] = M.iteration_loss(out)
        if opt is not None:
            ok = opt.step()[0]
            assert ok, f"megatron optimizer step failed at iteration {it}"
        else:
            M.sgd_step_(chunks, case["lr"])
    dist.barrier()
    return losses


def _key(i, n):
    return "model" if n == 1 else f"model{i}"


def _checkpoint_state(state, is_loading: bool):
    """The sharded state dict megatron.training builds (torch_dist format): per-chunk model entries
    from the DDP-unwrapped chunks (``unwrap_model``), then the optimizer's, keyed by those."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    md = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    models = unwrap_model(list(state["chunks"]))
    sd = {_key(i, len(models)): m.sharded_state_dict(metadata=md) for i, m in enumerate(models)}
    if state["opt"] is not None:
        sd["optimizer"] = state["opt"].sharded_state_dict(sd, is_loading=is_loading, metadata=md)
    return sd


def _params(M, chunks):
    """{global name: [full value of each copy]} on TP rank 0 (collective over TP)."""
    return M.collect_full_grads(chunks, params=True)


def _optimizer_state(M, state):
    """{global name/state key: [tensor of each copy]} of megatron's optimizer (empty without one)."""
    from megatron_zb.megatron.execution import finalize as F
    from megatron_zb.megatron.layout import placement as P
    opt = state["opt"]
    if opt is None:
        return {}
    by_id = {}
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(sub, "optimizer", None)
        if inner is not None:
            by_id.update({id(p): st for p, st in inner.state.items()})
    out = {}
    for c in state["chunks"]:
        for _, p in P.unwrap(c).named_parameters():
            st = by_id.get(id(p), {})
            for k in ("exp_avg", "exp_avg_sq", "step"):
                v = st.get(k)
                out.setdefault(f"{p.mzb_global_name}/{k}", []).append(
                    None if v is None else v.detach().clone().float().reshape(-1) if k == "step" else v.detach().clone())
    return out


def _max_diff(a, b):
    """Largest difference of each name's copies; where one side holds fewer copies of a name (the
    input embedding split on one side only: no whole embedding beside the shards), every copy
    against that side's first (the copies of one name hold the same values)."""
    worst = 0.0
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name, copies in a.items():
        other = b[name]
        if len(copies) != len(other):
            assert min(len(copies), len(other)) >= 1, name
            copies, other = copies + other, [(copies + other)[0]] * (len(copies) + len(other))
        for x, y in zip(copies, other):
            if x is None or y is None:
                return float("inf")
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def _max_abs(d):
    """Largest |value| of the tensor state (Adam's moments; not the step counter)."""
    return max((float(t.abs().max()) for k, copies in d.items() if not k.endswith("/step")
                for t in copies if t is not None), default=0.0)


def _running_children():
    """Command lines of this rank's running child processes (multiprocessing's resource tracker
    left out: it ends with the rank)."""
    import psutil
    out = []
    for c in psutil.Process().children():
        try:
            cmd = " ".join(c.cmdline())
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmd:
                out.append(cmd)
        except psutil.NoSuchProcess:
            pass
    return out


def resume_case(case):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    from megatron_zb.megatron.execution import finalize as F
    from megatron_zb.megatron.layout import placement as P
    from megatron_zb.verify.model import tinygpt as M
    from megatron_zb.megatron.install import install
    from megatron_zb.megatron.launch.shutdown import stop_checkpoint_writer
    from megatron_zb.verify.processes.launch import set_status

    _allow_save_without_psutil()
    rank = dist.get_rank()
    tag = case["label"]
    n, split = case["iterations"], case["split"]
    vocab = case.get("vocab")
    resume_vocab = case.get("resume_vocab", vocab)
    emb, resume_emb = bool(case.get("emb")), bool(case.get("resume_emb", case.get("emb")))
    handle = install(case["schedule"], chunks=case.get("chunks"), vocab_parallel=vocab,
                     **({"vocab_embedding": True} if vocab and emb else {}))
    try:
        # 1. uninterrupted
        set_status(f"[{tag}] uninterrupted run")
        st = _setup(case, M, vocab, emb)
        full_losses = _train(case, M, st, range(n))
        full_params = _params(M, st["chunks"])
        del st
        gc.collect()

        # 2. first part, then save
        set_status(f"[{tag}] first {split} iterations")
        st = _setup(case, M, vocab, emb)
        first_losses = _train(case, M, st, range(split))
        saved_params = _params(M, st["chunks"])
        saved_opt = _optimizer_state(M, st)
        ckpt_dir = case["ckpt_dir"]
        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        set_status(f"[{tag}] dist_checkpointing.save")
        sd = _checkpoint_state(st, is_loading=False)
        sd["iteration"] = split
        dist_checkpointing.save(sd, ckpt_dir)
        dist.barrier()
        files = sorted(os.listdir(ckpt_dir)) if rank == 0 else None
        del st, sd
        gc.collect()
        M.destroy_parallel_state()

        # 3. fresh state: rebuild with different weights and a fresh optimizer, load, resume
        set_status(f"[{tag}] rebuild + dist_checkpointing.load")
        if (resume_vocab, resume_emb) != (vocab, emb):
            handle.uninstall()
            handle = install(case["schedule"], chunks=case.get("chunks"), vocab_parallel=resume_vocab,
                             **({"vocab_embedding": True} if resume_vocab and resume_emb else {}))
        st = _setup(case, M, resume_vocab, resume_emb)
        P.deterministic_init_([P.unwrap(c) for c in st["chunks"]], seed=_DIFFERENT_SEED)
        before_load = _params(M, st["chunks"])
        sharded = _checkpoint_state(st, is_loading=True)
        loaded = dist_checkpointing.load(sharded, ckpt_dir)
        # torch_dist loads in place into the tensors of ``sharded`` (the parameters themselves);
        # load_state_dict as megatron.training does on top of that.
        models = unwrap_model(list(st["chunks"]))
        for i, m in enumerate(models):
            m.load_state_dict(loaded[_key(i, len(models))], strict=True)
        if st["opt"] is not None:
            st["opt"].load_state_dict(loaded["optimizer"])
        after_load = _params(M, st["chunks"])
        loaded_opt = _optimizer_state(M, st)
        set_status(f"[{tag}] resumed iterations")
        rest_losses = _train(case, M, st, range(int(loaded["iteration"]), n))
        resumed_params = _params(M, st["chunks"])
        del st, loaded, sharded
        gc.collect()
        M.destroy_parallel_state()
    finally:
        handle.uninstall()
    writer = _running_children()
    # megatron's writer Manager: one spawned process per rank that imports torch when the first write
    # result reaches it (~3 CPU s), kept as training keeps it, for the launch's next cases; the last
    # case stops it (a process per rank otherwise)
    stopped = stop_checkpoint_writer() if case.get("last", True) else 0
    set_status(f"[{tag}] done")
    return {
        "writer_processes": writer, "writer_stopped": stopped, "children_after_stop": _running_children(),
        "rank": rank, "megatron_version": M.megatron_version(),
        "full_losses": full_losses, "first_losses": first_losses, "resumed_losses": rest_losses,
        "ckpt_files": files,
        "diff_before_load": _max_diff(before_load, saved_params) if before_load else None,
        "diff_after_load": _max_diff(after_load, saved_params) if after_load else None,
        "diff_final": _max_diff(resumed_params, full_params) if full_params else None,
        "opt_state_abs": _max_abs(saved_opt) if saved_opt else None,
        # (across vocabulary parallelism each rank holds other rows of the output layer's state: the
        # resumed losses and parameters show whether it came back)
        "diff_opt_state": _max_diff(loaded_opt, saved_opt) if saved_opt and resume_vocab == vocab else None,
        "param_names": sorted(full_params),
        "num_params": sum(len(v) for v in full_params.values()),
    }
