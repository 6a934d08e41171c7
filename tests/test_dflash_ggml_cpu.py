"""The DFlash drafter under --numerics ggml-cpu: its norms, SwiGLU and RoPE now go through
GgmlCpuBackend, so its block logits must stay near transformers' float64 goldens (golden/dflash).
NMSE is sum((ref - x)^2) / sum(ref^2) per logits row, the transformers golden as ref."""
import dataclasses
import json
import os

import numpy as np
import pytest

from reference import gguf
from reference.dflash import Drafter, Speculator
from reference.ggml_cpu import UBATCH, GgmlCpuBackend
from reference.metrics import nmse
from reference.text import TextModel
from conftest import GOLDEN, MODELS

GOLDEN_DIR = os.path.join(GOLDEN, "dflash")
with open(os.path.join(GOLDEN_DIR, "manifest.json")) as f:
    MANIFEST = json.load(f)
CASE = next(c for c in MANIFEST["cases"] if c["id"] == "len7-n3")
# The f16 K/V cache rounds every K and V element by up to 2^-11 relative; with float32 sums and
# glibc/ggml elementwise ops that left NMSE 3e-7..1.5e-6 per row on every llama.cpp-rule case when
# the decoded weights are keyed per GGUF (keyed by name alone, the drafter multiplied by its target's
# blk.* matrices: NMSE 1.4). 1e-5 is 7x the worst row; top-1 must agree everywhere.
GGML_CPU_NMSE = 1e-5


def drafter_blocks(backend):  # -> (transformers' block logits, ours) [rows, V] with this backend
    lm = TextModel(gguf.load(os.path.join(MODELS, "tiny-a-f32.gguf"), "text"), backend=backend)
    draft = gguf.load(os.path.join(MODELS, "tiny-a-dflash-f32.gguf"), "dflash")
    config = dataclasses.replace(draft.config, block_size=max(draft.config.block_size, CASE["n_max"] + 1))
    drafter = Drafter(dataclasses.replace(draft, config=config), lm)
    seq = MANIFEST["sequences"][CASE["prompt"]]["tokens"]
    sp = Speculator(lm, drafter, lm.new_cache(len(seq) + 1, "uniform"), drafter.new_cache(len(seq) + 1), UBATCH)
    sp.forward(seq[:CASE["pos0"][0]])
    blocks = []
    for pos0 in CASE["pos0"]:
        blocks.append(drafter.draft_logits(seq[pos0], pos0, CASE["n_max"], sp.draft_cache))
        sp.forward([seq[pos0]])
    ref = np.load(os.path.join(GOLDEN_DIR, CASE["file"]), allow_pickle=False)
    return ref.reshape(-1, ref.shape[-1]), np.stack(blocks).reshape(-1, ref.shape[-1])


def test_ggml_cpu_drafter_draft_logits_near_transformers():
    ref, ours = drafter_blocks(GgmlCpuBackend(check_host=False))
    assert nmse(ref, ours).max() <= GGML_CPU_NMSE
    assert np.array_equal(ref.argmax(-1), ours.argmax(-1))
