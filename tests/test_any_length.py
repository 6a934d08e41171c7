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
import importlib
import json
import os
import tracemalloc

import numpy as np
import pytest

from conftest import GOLDEN, MODELS, require, run_cli
from reference import factory, gguf, run
from reference.ggml_cpu import GgmlCpuBackend
from reference.metrics import nmse
from reference.positions import output_rows, parse_positions
from tools.parity import golden

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
MUL_MAT = importlib.import_module("reference.ggml_cpu.mul_mat")  # the module (the package exports its function)
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
        out[n, "one chunk"] = chunked_prefill(lm, build, ids, None, n)
        runs = {}  # options that compute the same rows ("none" and "last", "all" and "topk") share a run
        for option in LOGITS:
            rows, kept = rows_of(option, n)
            key = None if rows is None else tuple(rows)
            if key not in runs:
                runs[key] = chunked_prefill(lm, build, ids, rows, CHUNK)
            logits, tokens = runs[key]
            out[n, option] = logits[kept if rows is None else np.searchsorted(rows, kept)], tokens
    return out


def chunked_prefill(lm, build, ids, rows, chunk):  # -> (logits of `rows` [r or T, V], N_PREDICT greedy ids)
    kind, chunk = factory.cache_layout(build, "ring", chunk)
    cache = lm.new_cache(len(ids) + N_PREDICT, kind, chunk)
    logits = lm.prefill(ids, cache, chunk, out_rows=rows)
    assert logits.shape == (len(ids) if rows is None else len(rows), lm.cfg.n_vocab)
    return logits, lm.decode_greedy(logits[-1], N_PREDICT, cache, chunk)


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


# -------------------------------------------------------------------------------------------------
# The command lines: reference.run, tools.golden on the reference engine, tools.bench_accel's engines

def run_json(capsys, *argv):  # -> reference.run's --json object, run in this process
    assert run.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("backend,numerics", BUILDS)
def test_run_every_logits_option_and_n_predict(backend, numerics, capsys, tmp_path):
    """reference.run in chunks of 4 on a 10-token prompt: each logits option with --n-predict 1, and
    --n-predict 0 and 2; every file holds the rows asked for, and the greedy tokens are the API's."""
    if backend == "numba":
        require("numba")
    n, model = 2 * CHUNK + 2, os.path.join(MODELS, MODEL_FILES[0])
    common = ["--model", model, "--token-ids", ",".join(map(str, prompt(n))), "--prefill-chunk", str(CHUNK),
              "--backend", backend, "--numerics", numerics]
    tokens = sweep(MODEL_FILES[0], backend, numerics)[n, "none"][1]
    for n_predict in (0, 2):
        assert run_json(capsys, *common, "--n-predict", str(n_predict))["tokens"] == tokens[:n_predict]
    for option, (spec, written, k) in LOGITS.items():
        out = tmp_path / f"{option}{'.positions.npz' if spec(n) or k else '.npy'}"
        flags = (["--logits-out", str(out)] if written else []) + (["--logits-positions", spec(n)] if spec(n) else []) \
            + (["--logits-topk", str(k)] if k else [])
        assert run_json(capsys, *common, "--n-predict", "1", *flags)["tokens"] == tokens[:1], option
        if written:
            kept = rows_of(option, n)[1]
            saved = np.load(out) if out.suffix == ".npy" else dict(np.load(out))
            if isinstance(saved, dict):
                assert np.array_equal(saved["positions"], kept), option
                rows = saved["top_ids"] if k else saved["logits"]
            else:
                rows = saved
            assert len(rows) == len(kept) and np.isfinite(saved["top_logits"] if k else rows).all(), option


@pytest.mark.parametrize("backend,numerics", [("numba", "exact"), ("numpy", "ggml-cpu")])
def test_the_reported_long_prompt_runs(backend, numerics, tmp_path):
    """The report's case as a new user typed it: tiny-a F32, 200 tokens in chunks of 64, which ended in
    `ValueError: cannot reshape array of size 0` on these two builds."""
    if backend == "numba":
        require("numba")
    out = tmp_path / "last.positions.npz"
    r = run_cli("reference.run", "--model", os.path.join(MODELS, MODEL_FILES[0]),
                "--token-ids", ",".join(map(str, [1] + list(range(2, 201)))), "--prefill-chunk", "64",
                "--backend", backend, "--numerics", numerics, "--n-predict", "2", "--json",
                "--logits-out", str(out), "--logits-positions", "last")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 2
    assert np.array_equal(np.load(out)["positions"], [199])


@pytest.mark.parametrize("corpus", [False, True])
@pytest.mark.parametrize("n_predict", [0, 1, 2])
def test_golden_on_the_reference_engine(n_predict, corpus, tmp_path):
    """tools.golden --engine reference ended in greedy_steps' reshape with --n-predict 1."""
    out = tmp_path / "golden"
    assert golden.main(["--engine", "reference", "--model", os.path.join(MODELS, MODEL_FILES[0]),
                        "--prompts", os.path.join(GOLDEN, "prompts", "text-short.jsonl"), "--out", str(out),
                        "--n-predict", str(n_predict)] + (["--corpus"] if corpus else [])) == 0
    with open(out / "manifest.json") as f:
        entries = json.load(f)["entries"]
    assert len(entries) == 4
    for e in entries:
        if n_predict:
            assert len(e["greedy"]["tokens"]) == n_predict
            assert np.load(out / e["greedy"]["decode_logits"]).shape == (n_predict - 1, 512)
        else:
            assert "greedy" not in e


def test_bench_ggml_engine_keeps_the_last_row_over_several_batches(monkeypatch):
    """tools.bench_accel run --logits last feeds a prompt longer than LAST_BATCH in batches whose
    rows all go unread but the last one's."""
    require("numba")
    from tools.bench import engines as bench
    monkeypatch.setattr(bench, "LAST_BATCH", CHUNK)
    path, ids = os.path.join(MODELS, MODEL_FILES[2]), prompt(2 * CHUNK + 2)
    prefill, _ = bench.ggml_engine(path, 1, last=True)
    build = factory.Build("numba", "ggml-cpu", repack=False, n_threads=1)  # the engine's
    last = np.array([len(ids) - 1])
    ref = chunked_prefill(factory.text_model(gguf.load(path, "text"), build), build, ids, last, CHUNK)[0]
    assert np.array_equal(prefill(ids), ref)


# -------------------------------------------------------------------------------------------------
# The NumPy ggml-cpu products by blocks of weight rows (what kept a 2,100-token prompt from 24 GB)

@pytest.mark.parametrize("name", MODEL_FILES[1:3])
def test_ggml_cpu_products_by_row_blocks_change_no_bit(name, monkeypatch):
    """The smallest blocks (PRODUCT_ROWS weight rows) give the one-block product's bits: tinyBLAS for
    F16; the repacked gemm and gemv (Q4_K), the tiled kernel (Q6_K) and the Q0 lanes (Q5_0) for Q4_K_M."""
    ids = prompt(CHUNK + 1)
    whole = sweep(name, "numpy", "ggml-cpu")[len(ids), "one chunk"][0]
    monkeypatch.setattr(MUL_MAT, "PRODUCT_ELEMENTS", 1)
    build = factory.Build("numpy", "ggml-cpu")
    lm = factory.text_model(gguf.load(os.path.join(MODELS, name), "text"), build)
    assert np.array_equal(chunked_prefill(lm, build, ids, None, len(ids))[0], whole)


def test_a_ggml_cpu_products_temporaries_are_bounded():
    """2048 activation rows against tiny-a's Q6_K output head (512 x 256, the tiled kernel). In one
    block int_dot's sums are 2048 x 512 x 16 elements in 8-byte copies, up to three alive: traced
    peak 265 MB (the product in one block, before the blocks). In blocks of PRODUCT_ELEMENTS /
    (2048 x 256) = 128 rows a quarter of that: 76 MB traced. 160 MB lies between the two."""
    be = GgmlCpuBackend(check_host=False)
    weights = gguf.load(os.path.join(MODELS, MODEL_FILES[2]), "text").weights
    x = np.random.default_rng(0).standard_normal((2048, 256)).astype(np.float32)
    be.linear(x[:8], weights.tensor("output.weight"))  # the head decoded and kept before the measurement
    tracemalloc.start()
    be.linear(x, weights.tensor("output.weight"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 160 << 20, peak
