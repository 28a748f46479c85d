"""The runtime on real megatron-core: every schedule, through ``install()`` and megatron's own
``get_forward_backward_func()``, gives the losses and gradients of the non-pipelined single-process
reference with identical weights and data (real gloo processes, several iterations with an SGD
step between them). Cases of one world size share one launch."""
from __future__ import annotations

import pytest

from megatron_zb import verify as V
from megatron_zb.core.schedules import get, names

pytestmark = [pytest.mark.megatron, pytest.mark.dist]


def _schedules(mcore_path):
    """Every schedule on the installed megatron-core; on a second one (``MZB_MCORE``, the test
    script's 0.19.2 pass) the first schedule of each placement and backward kind (single, looped, V,
    replicated x fused, split: 7 of 16). What differs between megatron-core versions is megatron's
    side of a pass (its forward and backward step, DDP, the layers), which the placement and the
    kind of backward decide; the order of the passes is megatron-zb's own, the same on every version."""
    if mcore_path is None:
        return names()
    seen, out = set(), []
    for n in names():
        key = (get(n).placement, get(n).split_backward)
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def _check(results, mcore_version=None):
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')} "
           f"loss={r.get('max_abs_loss_diff')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:  # the ranks ran the megatron-core under test
        assert not mcore_version or r["megatron_core"].startswith(mcore_version), (r["case"], r["megatron_core"])


def test_pp2_every_schedule_and_megatron_options(mcore_path, mcore_version):
    cases = [V.make_case(n, 2, num_microbatches=4, iterations=2) for n in _schedules(mcore_path)]
    if mcore_path is None:  # microbatch counts: megatron-zb's own orders
        cases += [V.make_case("zb-h1", 2, num_microbatches=1, iterations=2, label="m<p"),
                  V.make_case("zb-h2", 2, num_microbatches=3, iterations=2, label="odd m")]
    cases += [
        V.make_case("zb-h1", 2, num_microbatches=4, iterations=3, overlap_grad_reduce=True, label="ddp overlap"),
        V.make_case("zb-h2", 2, num_microbatches=4, iterations=2, overlap_grad_reduce=True,
                    gradient_accumulation_fusion=True, label="ddp overlap + gaf"),
        V.make_case("zb-h1", 2, num_microbatches=4, iterations=2, gradient_accumulation_fusion=True, label="gaf"),
        V.make_case("zb-h1", 2, num_microbatches=4, iterations=2, ddp=False, label="no ddp"),
        V.make_case("gpipe-v", 2, num_microbatches=4, iterations=2, overlap_grad_reduce=True, label="V + overlap"),
        V.make_case("zb-h2", 2, num_microbatches=4, iterations=2, variable_seq_lengths=True, label="varseq"),
        V.make_case("zb-h1", 2, num_microbatches=4, iterations=2, forward_only=True, label="forward only"),
        V.make_case("gpipe-v", 2, num_microbatches=3, iterations=2, forward_only=True, label="V forward only"),
        V.make_case("interleaved-1f1b", 2, num_microbatches=4, iterations=2, overlap_grad_reduce=True,
                    label="interleaved + overlap"),
        V.make_case("zb-h1", 2, num_microbatches=4, iterations=2,
                    config_overrides={"deallocate_pipeline_outputs": True}, label="dealloc outputs"),
    ]
    _check(V.run_verify_many(cases, timeout=900, mcore_path=mcore_path), mcore_version)


def test_pp6_bitpipe_authors_order(mcore_path, mcore_version):
    """From P=6 on, bitpipe runs the BitPipe authors' per-rank order (both directions alternating
    after the warm-up): on real processes too."""
    _check(V.run_verify_many([V.make_case("bitpipe", 6, num_microbatches=12, iterations=2)], timeout=900,
                             mcore_path=mcore_path), mcore_version)


def test_pp4_every_schedule(mcore_path, mcore_version):
    cases = [V.make_case(n, 4, num_microbatches=8 if get(n).chunks != 2 else 4, iterations=2)
             for n in _schedules(mcore_path)]
    cases += [V.make_case("gpipe-v", 4, num_microbatches=5, iterations=2, allow_padding_num_layers=True,
                          num_layers=14, label="V + padding"),
              # replicated stages over two units (both directions twice), eager replica sync with DDP overlap
              V.make_case("bitpipe", 4, num_microbatches=8, iterations=2, overlap_grad_reduce=True,
                          gradient_accumulation_fusion=True, schedule_options={"cost_f": 1.0, "cost_b": 2.0},
                          label="bitpipe 2 units, overlap + gaf"),
              V.make_case("bitpipe", 4, num_microbatches=4, iterations=2, forward_only=True, label="bitpipe fwd only")]
    if mcore_path is None:  # orders of megatron-zb's own (the same passes on every megatron-core)
        cases += [V.make_case("zb-h1", 4, num_microbatches=2, iterations=2, label="m<p"),
                  V.make_case("zb-h2", 4, num_microbatches=3, iterations=2, label="m<p"),
                  # building-block orders with unequal costs: reordered warm-up/cool-down, refilled W's
                  V.make_case("v-half", 4, num_microbatches=10, iterations=2,
                              schedule_options={"cost_f": 1.0, "cost_b": 2.0, "cost_w": 1.0}, label="B = 2F"),
                  V.make_case("v-auto", 4, num_microbatches=9, iterations=2, memory_limit=3.0,
                              schedule_options={"cost_f": 1.3, "cost_b": 2.1, "cost_w": 0.7, "cost_comm": 0.1},
                              label="limit 3, measured-like costs"),
                  V.make_case("zeropp", 4, num_microbatches=10, iterations=2, memory_limit=6.0,
                              label="zeropp limit 6"),
                  # a fused backward cheaper than B + W: back-to-back B;W pairs run as one BW pass
                  V.make_case("zb-v", 4, num_microbatches=8, iterations=2, schedule_options={"cost_bw": 1.5},
                              label="fused B;W pairs")]
        from megatron_zb.core.build import build
        from megatron_zb.megatron.execution.options import ScheduleOptions
        assert build(ScheduleOptions("zb-v", cost_bw=1.5).request(), 4, 8).schedule.meta["fused_backwards"] > 0
    _check(V.run_verify_many(cases, timeout=900, mcore_path=mcore_path), mcore_version)


def test_tp2_pp2_sequence_parallel(mcore_path, mcore_version):
    """World size 4: TP=2 x PP=2 (sequence parallel), and PP=2 x DP=2 (data parallelism composed with the
    replica gradient sync; megatron's distributed optimizer as ZeroPP's sharded data parallelism)."""
    cases = [V.make_case(n, 2, tensor_parallel_size=2, num_microbatches=4, iterations=2, sequence_parallel=True)
             for n in ("zb-h1", "zb-h2", "gpipe-v", "bitpipe")]
    cases += [V.make_case("bitpipe", 2, num_microbatches=4, iterations=2, data_parallel_size=2, label="dp2"),
              V.make_case("bitpipe", 2, num_microbatches=4, iterations=2, data_parallel_size=2,
                          overlap_grad_reduce=True, label="dp2 overlap"),
              V.make_case("bitpipe", 2, num_microbatches=4, iterations=2, data_parallel_size=2,
                          use_distributed_optimizer=True, label="dp2 distributed optimizer"),
              V.make_case("zeropp", 2, num_microbatches=4, iterations=2, data_parallel_size=2,
                          use_distributed_optimizer=True, label="ZeroPP + ZeRO-1"),
              V.make_case("interleaved-zb", 2, num_microbatches=4, iterations=2, data_parallel_size=2, label="dp2")]
    cases.append(V.make_case("zb-h1", 2, tensor_parallel_size=2, num_microbatches=4, iterations=2,
                             sequence_parallel=True, overlap_grad_reduce=True, gradient_accumulation_fusion=True,
                             label="tp+sp+overlap+gaf"))
    # fused B;W pairs in a split schedule: W's gradients (and DDP's grad-ready hooks) inside the backward
    cases.append(V.make_case("zb-h1", 2, tensor_parallel_size=2, num_microbatches=4, iterations=2,
                             sequence_parallel=True, overlap_grad_reduce=True, gradient_accumulation_fusion=True,
                             schedule_options={"cost_bw": 1.5}, label="tp+sp+overlap+gaf, fused pairs"))
    _check(V.run_verify_many(cases, timeout=900, mcore_path=mcore_path), mcore_version)
