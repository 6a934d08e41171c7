"""Every llama-quantize preset (golden/presets/) under `--numerics ggml-cpu`, on the NumPy emulation and
on its numba twin, against llama.cpp's own logits of the same file: bit for bit (NMSE 0, max |diff| 0).

The goldens were taken with llama-cpp-python's use_extra_bufts=False (golden/presets/manifest.json:
this machine's llama.cpp crashes in its AMX buffer on quantized weights), an F32 KV cache and flash
attention off, so the backend runs with repack=False: Q4_0/IQ4_NL/Q4_K/Q2_K rows stay in plain
buffers and take the tiled kernel (8 rows or more) or the vec_dot (decode, and the 1- and 7-token
prompts). Every position of the four prompts and every single-token decode step fed llama.cpp's own
greedy tokens is compared: no tolerance, since the emulation claims ggml's roundings exactly.
"""
import functools
import os
import warnings

import numpy as np
import pytest

from conftest import require
from reference import gguf
from reference.ggml_cpu import UBATCH, GgmlCpuBackend
from reference.text import TextModel
from test_ggml_cpu import assert_identical
from test_quant_presets import GATES, PRESETS, golden_runs, preset_entry


def make_backend(name):  # "numpy" | "numba" -> the ggml-cpu backend as the presets' goldens were taken
    cls = GgmlCpuBackend
    if name == "numba":
        require("numba")
        from accel.numba.ggml import GgmlCpuNumbaBackend as cls
    return cls("f32", flash_attn=False, check_host=False, repack=False)


@functools.lru_cache(maxsize=None)
def text_model(preset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gguf.load(os.path.join(PRESETS, preset_entry(preset)["file"]), "text")


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("preset", sorted(GATES))
def test_preset_bit_identical_to_llama_cpp(preset, backend):
    lm = TextModel(text_model(preset), backend=make_backend(backend))
    for ids, prompt, tokens, steps in golden_runs(preset):
        cache = lm.new_cache(len(ids) + len(tokens), "uniform")
        assert_identical(prompt, lm.prefill(ids, cache, UBATCH), f"{preset} {len(ids)}-token prompt")
        decoded = np.array([lm.prefill([t], cache, UBATCH)[-1] for t in tokens[:-1]])
        assert_identical(steps, decoded, f"{preset} decode after {len(ids)} tokens")
