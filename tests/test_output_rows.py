"""Kept output rows under `--numerics ggml-cpu` against llama.cpp's logits of those rows alone
(tests/fixtures/output-rows, made by tools/regen/make_output_rows_golden.py: one llama_decode asking for
logits at positions 0 and the last three). llama.cpp keeps its output rows from the last layer's
FFN on (inp_out_ids), so that FFN runs at 4 rows where the all-position run has 33 or 64, and ggml
chooses another kernel there (the vec_dot, not the tiled kernel): the kept rows of the 33- and
64-token prompts differ from llama.cpp's all-position rows by up to 4.8e-6. The reference keeps the
rows at the same place, so they must be bit for bit llama.cpp's (NMSE 0, max |diff| 0).
"""
import json
import os

import numpy as np
import pytest

from conftest import ROOT, require
from reference import gguf
from reference.ggml_cpu import UBATCH, GgmlCpuBackend
from reference.text import TextModel
from test_ggml_cpu import assert_identical

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "output-rows")
with open(os.path.join(FIXTURES, "manifest.json")) as f:
    MANIFEST = json.load(f)
MODEL = os.path.join(ROOT, "golden", "presets", "models", MANIFEST["model"]["file"])


def backend(name):  # -> the ggml-cpu backend as the fixture's llama.cpp context ran
    cls = GgmlCpuBackend
    if name == "numba":
        require("numba")
        from accel.numba.ggml import GgmlCpuNumbaBackend as cls
    return cls("f32", flash_attn=False, check_host=False, repack=False)


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_kept_rows_are_llama_cpps(name):
    lm = TextModel(gguf.load(MODEL, "text"), backend=backend(name))
    for e in MANIFEST["entries"]:
        ids = e["token_ids"]
        got = lm.prefill(ids, lm.new_cache(len(ids), "uniform"), UBATCH, out_rows=np.array(e["positions"]))
        assert_identical(np.load(os.path.join(FIXTURES, e["file"])), got, f"{e['id']} rows {e['positions']}")


def test_the_fixture_differs_from_the_all_position_rows():
    """The check above can fail: where llama.cpp's FFN ran at fewer rows, its kept rows are not its
    all-position rows (golden/presets/logits/Q4_K_M)."""
    worst = 0.0
    for e in MANIFEST["entries"]:
        full = np.load(os.path.join(ROOT, "golden", "presets", "logits", "Q4_K_M", e["file"]))
        worst = max(worst, float(np.abs(full[e["positions"]] - np.load(os.path.join(FIXTURES, e["file"]))).max()))
    assert worst > 0
