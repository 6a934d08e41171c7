"""Simulated tensor parallelism reproduces TP=1, and a reduction placed after the post-norm is caught."""
import os

import numpy as np
import pytest

from reference import gguf, ops
from reference.text import TextModel
from reference.tp import TensorParallelBackend, TPError, check_tp
from reference.metrics import nmse
from conftest import MODELS, run_cli

MODEL = os.path.join(MODELS, "tiny-a-f32.gguf")  # 4 heads, 2 kv heads: TP=2 is the most it allows


def logits(model, backend=None, n=60):
    lm = TextModel(model, backend=backend)
    ids = list(np.random.default_rng(0).integers(0, 400, n))
    return lm.prefill(ids, lm.new_cache(n))


def test_tp2_equals_tp1():
    m = gguf.load(MODEL, "text")
    # the only difference is the f32 sum of two rounded partial products per row-parallel layer
    assert nmse(logits(m).ravel(), logits(m, TensorParallelBackend(np.float32, 2)).ravel()) <= 1e-12


class ReduceAfterPostNorm(TensorParallelBackend):
    """The planted bug: each rank applies the 1e-8 post-norm to its own partial before the sum."""

    def all_reduce(self, partials):  # [[T, out] per rank] -> [T, out]
        return super().all_reduce([ops.rms_norm(p, 1e-8) for p in partials])


def test_reduction_after_post_norm_is_caught():
    m = gguf.load(MODEL, "text")
    bad = logits(m, ReduceAfterPostNorm(np.float32, 2))
    assert nmse(logits(m).ravel(), bad.ravel()) > 1e-3  # measured 0.2: far outside any float noise


def test_tp_must_split_kv_heads():
    cfg = gguf.load(MODEL, "text").config
    with pytest.raises(TPError, match="must divide n_head_kv"):
        check_tp(cfg, 4)
    r = run_cli("reference.run", "--model", MODEL, "--tp", "4", "--n-predict", "1")
    assert r.returncode == 2 and "--tp 4" in r.stderr and r.stderr.count("\n") == 1


def test_cli_tp2_same_tokens():
    one = run_cli("reference.run", "--model", MODEL, "--json", "--n-predict", "6")
    two = run_cli("reference.run", "--model", MODEL, "--json", "--n-predict", "6", "--tp", "2")
    assert one.returncode == two.returncode == 0
    import json
    assert json.loads(one.stdout)["tokens"] == json.loads(two.stdout)["tokens"]
