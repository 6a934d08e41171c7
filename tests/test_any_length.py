"""Prompts of any length on every backend and numerics mode, with every logits option.

A prefill runs in chunks; a chunk whose rows keep no logits (all but the last chunk when only the last
position is asked for) still stores its K/V and computes nothing after its last attention
(TextModel.forward). The sweep: backend (numpy, numba) x numerics (exact, ggml-cpu) x a committed
model of each weight family x prompt lengths around the chunk x the logits options of reference.run x
--n-predict 0, 1, 2. Every run completes and is checked against the one-chunk run of the same prompt:

- numpy exact: bit for bit. Every dot product sums in float64 and rounds once, so neither the chunk
  nor the rows kept change a bit (docs/architecture.md, Numerics modes).
- numba exact: under test_numba's whole-model gate against the numpy one-chunk run (NMSE 1e-11), top-1
  identical: numba sums float32 within a tile whose path follows the batch's rows, so its bits move
  with the chunking as they do with the batch.
- ggml-cpu (numpy and numba): the batch shape is part of llama.cpp's arithmetic (the tiled kernel from
  8 rows, the vec_dot below; the repacked gemm by 4 rows; the kept rows' last FFN at their own count;
  docs/ggml-cpu-numerics.md), so llama.cpp's own logits change in their last bits with its ubatch and
  with the rows it keeps, and so do these: no bit-for-bit promise against the one-chunk run. What is
  promised: the numba twin gives the NumPy emulation's bits for the same chunks and rows, and both
  stay within GGML_CHUNK_GATE of the one-chunk run (derived below).
"""
import functools
import os

import numpy as np
import pytest

from conftest import MODELS, require
from reference import factory, gguf, run
from reference.metrics import nmse
from reference.positions import output_rows, parse_positions

CHUNK = 4
LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 2)  # one token, around one chunk, three chunks
MODEL_FILES = ("tiny-a-f32.gguf", "tiny-a-f16.gguf", "tiny-a-q4_k_m.gguf", "tiny-a-iq2_xxs.gguf")
BUILDS = (("numpy", "exact"), ("numba", "exact"), ("numpy", "ggml-cpu"), ("numba", "ggml-cpu"))
# reference.run's logits options -> (--logits-positions spec of a prompt of n or None, whether --logits-out
# is written, --logits-topk or None). "none" computes the last row only (decoding reads it); "all" every row.
LOGITS = {"none": (lambda n: None, False, None), "all": (lambda n: None, True, None),
          "first": (lambda n: "0", True, None), "last": (lambda n: "last", True, None),
          "middle": (lambda n: f"{n // 3}:{max(n // 3 + 1, 2 * n // 3)}", True, None),
          "topk": (lambda n: None, True, 3)}
N_PREDICT = 2  # the greedy tokens after each prefill: --n-predict 0 and 1 are its prefixes
# test_numba's whole-model gate, numba against numpy (measured there 1.8e-13 .. 8.6e-13).
WHOLE_MODEL_GATE = 1e-11


def prompt(n):  # -> n token ids of tiny-a's vocabulary (497 ordinary tokens), BOS first
    return [1] + [int(i) for i in np.random.default_rng(n).integers(2, 497, n - 1)]


def rows_of(option, n):  # -> (the rows the output head computes, or None: all; the positions whose logits are used)
    spec, written, _ = LOGITS[option]
    rows, kept = output_rows(parse_positions(spec(n)) if spec(n) else None, n, written, False)
    return rows, kept if written else rows  # without --logits-out only the last row is read, by decoding


@functools.lru_cache(maxsize=None)
def sweep(name, backend, numerics):  # -> {(n, option or "one chunk"): (kept positions' logits [m, V], greedy ids)}
    """Every prompt length and logits option in chunks of CHUNK, each as reference.run computes it,
    and each length in one chunk with every row's logits (the comparison)."""
    if backend == "numba":
        require("numba")
    build = factory.Build(backend, numerics)
    lm = factory.text_model(gguf.load(os.path.join(MODELS, name), "text"), build)
    out = {}
    for n in LENGTHS:
        ids = prompt(n)
        out[n, "one chunk"] = prefill(lm, build, ids, None, np.arange(n), n)
        for option in LOGITS:
            out[n, option] = prefill(lm, build, ids, *rows_of(option, n), CHUNK)
    return out


def prefill(lm, build, ids, rows, kept, chunk):  # -> (logits of the positions `kept` [m, V], N_PREDICT greedy ids)
    kind, chunk = factory.cache_layout(build, "ring", chunk)
    cache = lm.new_cache(len(ids) + N_PREDICT, kind, chunk)
    logits = lm.prefill(ids, cache, chunk, out_rows=rows)
    assert logits.shape == (len(ids) if rows is None else len(rows), lm.cfg.n_vocab)
    at = kept if rows is None else np.searchsorted(rows, kept)
    return logits[at], lm.decode_greedy(logits[-1], N_PREDICT, cache, chunk)


def kept_pairs(name, backend, numerics, reference=("numpy", "exact")):  # -> [(case, one-chunk rows, chunked rows)]
    """The logits each chunked run kept beside the same positions of the one-chunk run of `reference`."""
    ours, ref = sweep(name, backend, numerics), sweep(name, *reference)
    return [((n, option), ref[n, "one chunk"][0][rows_of(option, n)[1]], ours[n, option][0])
            for n in LENGTHS for option in LOGITS]


@pytest.mark.parametrize("name", MODEL_FILES)
def test_numpy_exact_chunks_change_no_bit(name):
    runs = sweep(name, "numpy", "exact")
    for case, whole, kept in kept_pairs(name, "numpy", "exact"):
        assert np.array_equal(whole, kept), case
        assert runs[case][1] == runs[case[0], "one chunk"][1], case  # the same greedy tokens


@pytest.mark.parametrize("name", MODEL_FILES)
def test_numba_exact_chunks_stay_under_the_whole_model_gate(name):
    ref = sweep(name, "numpy", "exact")
    for case, whole, kept in kept_pairs(name, "numba", "exact"):  # measured: NMSE <= 6.0e-13, max |diff| 9.6e-6
        assert nmse(whole.ravel(), kept.ravel()) <= WHOLE_MODEL_GATE, case
        assert np.array_equal(whole.argmax(-1), kept.argmax(-1)), case
        assert sweep(name, "numba", "exact")[case][1] == ref[case[0], "one chunk"][1], case


@pytest.mark.parametrize("name", MODEL_FILES)
def test_ggml_cpu_chunks_move_less_than_ggml_rounding(name):
    """Another batch shape moves llama.cpp's logits by less than its rounding moves them from exact
    arithmetic: per case, NMSE(one chunk, chunked) <= NMSE(exact, one chunk), both under ggml-cpu.
    Measured (chunks of 4 against one chunk): F32 9.1e-14 (exact 9.3e-7), F16 2.3e-7 (2.2e-6), Q4_K_M
    3.0e-14 (3.0e-3), IQ2_XXS 1.5e-4 (4.1e-3: IQ2's activations quantized to Q8_K flip with an ulp,
    and so do 6 of the 30 greedy continuations there, near ties). Tokens are not compared."""
    exact = {case: whole for case, whole, _ in kept_pairs(name, "numpy", "ggml-cpu")}
    for case, whole, kept in kept_pairs(name, "numpy", "ggml-cpu", ("numpy", "ggml-cpu")):
        assert nmse(whole.ravel(), kept.ravel()) <= nmse(exact[case].ravel(), whole.ravel()), case


@pytest.mark.parametrize("name", MODEL_FILES)
def test_numba_ggml_cpu_chunks_are_the_numpy_emulations_bits(name):
    ours, ref = sweep(name, "numba", "ggml-cpu"), sweep(name, "numpy", "ggml-cpu")
    for case in ref:
        assert np.array_equal(ours[case][0], ref[case][0]), case
        assert ours[case][1] == ref[case][1], case
