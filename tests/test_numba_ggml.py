"""The numba twins of the ggml-cpu emulation (accel/numba/ggml) against their oracles:
- every kernel against its NumPy statement in reference/ggml_cpu, bit for bit (same name, same
  float32 operations in the same order; integer sums are exact in any order);
- whole-model logits with `GgmlCpuNumbaBackend` against llama.cpp's, bit for bit, on every committed
  ggml-cpu golden of golden/ggml_cpu/manifest.json (prefill and token-by-token decode, KV f16/f32/q8_0,
  flash attention off and on): the same check test_ggml_cpu.py makes of the NumPy emulation;
- `python -m reference.run --backend numba --numerics ggml-cpu`.
"""
import os

import numpy as np
import pytest

from conftest import require

require("numba")  # the [accel] extra

from accel.numba.ggml import GgmlCpuNumbaBackend, mul_mat as numba_mul_mat  # noqa: E402
from accel.numba.ggml import elementwise as numba_elementwise, quantize as numba_quantize  # noqa: E402
from reference import ggml_cpu  # noqa: E402
from test_ggml_cpu import (MANIFEST, OPS, SHARED, assert_identical, check_cli_run, check_rotated, check_run,  # noqa: E402
                           check_shared, fixture, model)

QUANT_TYPES = [f["type"] for f in OPS["files"] if not f["type"].startswith(("f", "bf"))]


def activations(rows, width, seed):  # -> f32 [rows, width] with the quantizers' edge cases planted
    x = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    x[-1, :256] = 0  # an all-zero block: d = 0, q = 0 (the last row: the vec_dot tail of a repacked gemm)
    x[0, 3], x[0, 7] = -5, 5  # +max and -max tie: the reference quantizer takes the first, repack the positive
    x[0, 32:64] = np.float32(0.5) * np.arange(32, dtype=np.float32)  # exact halves: round half to even
    return x


@pytest.mark.parametrize("prefer_positive", [False, True])
def test_quantize_q8_k_is_its_numpy_twin(prefer_positive):
    x = activations(6, 512, 0)
    ref = ggml_cpu.quantize_q8_k(x, prefer_positive)
    got = numba_quantize.quantize_q8_k(x, prefer_positive)
    assert np.array_equal(ref.d, got.d) and np.array_equal(ref.q, got.q) and np.array_equal(ref.bsums, got.bsums)


def test_quantize_q8_0_is_its_numpy_twin():
    x = activations(6, 512, 1)
    ref, got = ggml_cpu.quantize_q8_0(x), numba_quantize.quantize_q8_0(x)
    assert np.array_equal(ref.d, got.d) and np.array_equal(ref.q, got.q) and np.array_equal(ref.s, got.s)


@pytest.mark.parametrize("op", ["sigmoid", "softcap", "gelu_erf"])
def test_elementwise_ops_are_their_numpy_twins(op):  # glibc from numba: every bit, NaN and infinities too
    x = np.concatenate([np.random.default_rng(3).standard_normal(5192).astype(np.float32) * 30,
                        np.float32([0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 88.8, -104])]).reshape(-1, 13)
    args = (x, 30.0) if op == "softcap" else (x,)
    with np.errstate(over="ignore", invalid="ignore"):
        ref, got = getattr(ggml_cpu, op)(*args), getattr(numba_elementwise, op)(*args)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 10])  # vec_dot, gemv tails, the repack gemm, the tiled kernel
@pytest.mark.parametrize("weight", ["ffn_up", "attn_output", "ffn_down"])
def test_mul_mat_kernels_are_their_numpy_twins(kind, rows, weight):  # every weight type and kernel path
    entry, _ = fixture(kind)
    weights = model(entry["model"]).weights
    name = f"blk.0.{weight}.weight"
    x = activations(rows, weights.shape(name)[1], rows)
    x[:, 256:] *= np.float32(1e-3)  # a second block of another magnitude
    ref = ggml_cpu.mul_mat(x, weights, name, {})
    assert_identical(ref, numba_mul_mat.mul_mat(x, weights, name, {}), f"{weights.type_name(name)}, {rows} rows")


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("step", ["", "decode."])
def test_mul_mat_on_llama_cpp_tensors(kind, step):  # llama.cpp's own layer-0 input and output
    entry, t = fixture(kind)
    x, ref = t[f"{step}ffn_up.in"], t[f"{step}ffn_up.out"]
    got = numba_mul_mat.mul_mat(x, model(entry["model"]).weights, "blk.0.ffn_up.weight", {})[:, :ref.shape[1]]
    assert_identical(ref, got, f"numba mul_mat {kind} with {len(x)} rows")


def run_id(run):
    return run["file"][len("logits/"):-len(".npy")]


@pytest.mark.parametrize("run", MANIFEST["runs"] + MANIFEST["kv_q8_0"]["runs"], ids=run_id)
def test_logits_bit_identical_to_llama_cpp(run):
    check_run(run, model(run["model"]), GgmlCpuNumbaBackend)


@pytest.mark.parametrize("run", MANIFEST["kv_q8_0"]["rotated_runs"], ids=lambda r: r["type"])
def test_q8_0_kv_rotated_logits_bit_identical(run, tmp_path):  # head sizes 64, 128: the Hadamard rotation
    check_rotated(run, tmp_path, GgmlCpuNumbaBackend)


@pytest.mark.parametrize("name,run,prompt", SHARED, ids=[f"{m}-{r}-{p}" for m, r, p in SHARED])
def test_shared_llama_cpp_goldens(name, run, prompt):  # BF16, the tiled flash attention, tiny-a's Q2_K repack
    check_shared(name, run, prompt, GgmlCpuNumbaBackend)


def test_cli_backend_numba_numerics_ggml_cpu(tmp_path):
    run = next(r for r in MANIFEST["runs"] if r["type"] == "q4_k_m" and r["kv_type"] == "f16" and not r["flash_attn"])
    check_cli_run(tmp_path, run, "--backend", "numba")


@pytest.mark.parametrize("kind", ["q4_k_m", "q6_k", "iq2_xxs"])
@pytest.mark.parametrize("rows", [3, 10])  # k_vec_dot (its lanes), the tiled kernel (two tiles of 4, then 2 rows)
def test_kernels_on_generic_vectors_are_the_numpy_twins(kind, rows, monkeypatch):  # CPUs without AVX2: no vpmaddwd
    import numba
    from accel.numba.ggml import int_dots
    from reference.ggml_cpu.blocks import decode
    monkeypatch.setattr(int_dots, "PMADDWD", False)  # read when a kernel compiles: fresh, uncached ones
    weights = model(fixture(kind)[0]["model"]).weights
    name = "blk.0.ffn_down.weight"
    x = activations(rows, weights.shape(name)[1], rows)
    w, a = numba_mul_mat.KernelRows(decode(weights, name)), numba_quantize.quantize_q8_k(x)
    if rows < 8:
        generic = numba.njit(parallel=True)(int_dots.k_vec_dot.py_func)
        got = generic(w.vs, w.offset, w.scales, w.d, w.dmin, w.mins, w.min_lanes, w.post, a.q, a.d, a.bsums,
                      numba_mul_mat.sub_block_sums(a, 32))
    else:
        generic = numba.njit(parallel=True)(int_dots.tiled.py_func)
        got = generic(w.vs, w.offset, w.scales, w.d0, w.dmin, w.mins, a.q.astype(np.int16), a.d,
                      numba_mul_mat.sub_block_sums(a, w.sub))
    ref = ggml_cpu.mul_mat(x, weights, name, {}, repack=False)  # repacked Q4_K would take another kernel
    assert_identical(ref, got, f"{weights.type_name(name)}, {rows} rows, generic vectors")
