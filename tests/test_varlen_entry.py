"""--zero-bubble-balance-microbatches in Megatron's own training loop (``python -m
megatron_zb.megatron.pretrain_gpt`` through ``scripts/pretrain_gpt_zb.sh``): a tiny GPT at PP=2 x
DP=2 on gloo, with Megatron's GPT dataset (an indexed dataset written here, its documents' own
lengths: ``--zero-bubble-seq-lengths eod``; the balanced microbatches packed in Megatron's
packed-sequence format, ``--zero-bubble-pack-sequences``) and with mock data cut to lognormal lengths, with
optimizer post-validation (and the profile window calibrating the length cost model) and with
activation offload. The balanced runs' losses are those of Megatron's order through 1f1b on the same
data from the same weights (the loss normalised over the global token count on both sides: the same
sequences, each token once). Needs megatron.training (0.18+: ``MZB_MCORE=0.19.2``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.test_pretrain_entry import ROOT, _check_ok, _env, needs_training, parse_log, run_script

pytestmark = [pytest.mark.megatron, pytest.mark.dist, needs_training]

ITERS = 4
VOCAB = 128  # NullTokenizer: end of document = VOCAB - 1
COMMON = "--zero-bubble-deterministic-init --calculate-per-token-loss"
GPT = f"--zero-bubble-seq-lengths eod --vocab-size {VOCAB} " + COMMON
MOCK = "--zero-bubble-seq-lengths lognormal:10:0.8 " + COMMON
BAL = " --zero-bubble-balance-microbatches"
RUNS = {
    "1f1b/gpt": dict(SCHEDULE="1f1b", EXTRA_ARGS=GPT, data=True),
    "zb-v/gpt/balanced/packed": dict(SCHEDULE="zb-v", EXTRA_ARGS=GPT + BAL + " --zero-bubble-pack-sequences", data=True),
    "1f1b/mock": dict(SCHEDULE="1f1b", EXTRA_ARGS=MOCK),
    "zb-h2/mock/balanced/post-validation": dict(
        SCHEDULE="zb-h2", PROFILE_WINDOW="1 2",
        EXTRA_ARGS=MOCK + BAL + " --enable-optimizer-post-validation --zero-bubble-post-validation-min-clean-steps 0"),
    "zb-h1/mock/balanced/offload": dict(
        SCHEDULE="zb-h1", EXTRA_ARGS=MOCK + BAL + " --cpu-offload --offload-time 0.1 --offload-chunk-num 1 "
                                                  "--zero-bubble-offload-cpu-test"),
}


_CORPUS = """
import random, sys
import numpy as np, torch
from megatron_zb.megatron.cpu import cpu_shims
cpu_shims.apply()  # megatron-core 0.19 imports triton without CUDA otherwise
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
prefix, vocab, documents = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
for _ in range(documents):
    n = rng.randint(2, 30)
    b.add_document(torch.tensor([rng.randrange(vocab - 2) for _ in range(n - 1)] + [vocab - 1]), [n])
b.finalize(prefix + ".idx")
"""


def _write_corpus(prefix: str, documents: int = 400) -> None:
    """A Megatron indexed dataset (.bin/.idx) of documents 2..30 tokens long, each ending with EOD
    (written by megatron-core's IndexedDatasetBuilder in a process of its own)."""
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("MZB_MCORE_PATH"), ROOT, env.get("PYTHONPATH")) if x)
    proc = subprocess.run([sys.executable, "-c", _CORPUS, prefix, str(VOCAB), str(documents)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    prefix = os.path.join(str(d), "docs_text_document")
    _write_corpus(prefix)
    out = {}
    for name, spec in RUNS.items():
        env = {k: v for k, v in spec.items() if k != "data"}
        if "PROFILE_WINDOW" in env:  # the profile JSON into the test's folder, not the repository
            env["EXTRA_ARGS"] += f" --zero-bubble-profile-path {os.path.join(str(d), 'profile.json')}"
        if spec.get("data"):
            env.update(DATA_PATH=prefix, TOKENIZER_TYPE="NullTokenizer")
        rc, text = run_script(timeout=900, ITERS=ITERS, PP=2, NPROC=4, MBS=1, GBS=16, VOCAB=VOCAB, PREFLIGHT=0, **env)
        out[name] = (rc, text, parse_log(text))
    return out


def _ok(runs, name):
    return _check_ok(runs, name, ITERS)


@pytest.mark.parametrize("name, ref", [("zb-v/gpt/balanced/packed", "1f1b/gpt"),
                                       ("zb-h2/mock/balanced/post-validation", "1f1b/mock"),
                                       ("zb-h1/mock/balanced/offload", "1f1b/mock")])
def test_balanced_training_equals_megatrons_order(runs, name, ref):
    text, rows = _ok(runs, name)
    _, base = _ok(runs, ref)
    counts = re.search(r"balanced microbatches in (\d+) \(per replica in the last: \[(\d+), (\d+)\]", text)
    assert counts and int(counts.group(1)) == ITERS, text[-3000:]
    if "packed" in name:  # several sequences in one microbatch (Megatron's packed-sequence format, THD)
        assert int(counts.group(2)) + int(counts.group(3)) < 16, text[-3000:]
    else:
        assert int(counts.group(2)) + int(counts.group(3)) == 16  # every sequence of the global batch, once
    for (i, _, _, la), (_, _, _, lb) in zip(base, rows):
        assert lb == pytest.approx(la, rel=1e-5), f"iteration {i}: {ref} {la} vs {name} {lb}"
    if "post-validation" in name:  # the window's passes (several lengths) calibrate the balancer's cost model
        assert "megatron-zb: optimizer post-validation on" in text
        assert re.search(r"length cost model fitted to the profile window's \d+ forward passes", text), text[-3000:]
    if "offload" in name:
        assert "megatron-zb: activation offload ratio" in text


def test_the_gpt_datasets_documents_give_the_lengths(runs):
    """With --data-path, Megatron's GPTDataset (not its mock data) gives the samples, cut at their
    first end-of-document token."""
    text, _ = _ok(runs, "zb-v/gpt/balanced/packed")
    assert "GPTDataset" in text and "MockGPTDataset" not in text
