"""The numba twins of the ggml-cpu emulation (accel/numba/ggml) against their oracles:
- every kernel against its NumPy statement in reference/ggml_cpu, bit for bit (same name, same
  float32 operations in the same order; integer sums are exact in any order);
- whole-model logits with `GgmlCpuNumbaBackend` against llama.cpp's, bit for bit, on every committed
  ggml-cpu golden of golden/ggml_cpu/manifest.json (prefill and token-by-token decode, KV f16/f32/q8_0,
  flash attention off and on): the same check test_ggml_cpu.py makes of the NumPy emulation;
- `python -m reference.run --backend numba --numerics ggml-cpu`;
- the op harness's ggml-cpu cases (accel/harness.py's ggml-cpu rows: attention, norms, RoPE, softmax, SwiGLU,
  float dots, libm, quantizers, every integer kernel path) against their NumPy twins, every bit, and
  its command line; the drafter on numba; tools.bench_ggml_numba.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, require

require("numba")  # the [accel] extra

from accel.numba.ggml import GgmlCpuNumbaBackend, block_dots, mul_mat as numba_mul_mat  # noqa: E402
from accel.numba.ggml import elementwise as numba_elementwise, quantize as numba_quantize  # noqa: E402
from reference import ggml_cpu  # noqa: E402
from reference.ggml_cpu.mul_mat import kernel_path  # noqa: E402
from test_ggml_cpu import (MANIFEST, OPS, SHARED, assert_identical, check_cli_run, check_rotated, check_run,
                            rebuilt_model,  # noqa: E402
                           check_shared, fixture, model)
from test_ggml_presets import text_model as preset_model  # noqa: E402
from test_ggml_cpu import IQ_KERNELS, check_iq_kernel, iq_block_rows  # noqa: E402
from test_ggml_cpu import BOUNDED_RUNS, STREAM_MODELS, check_bounded_logits, check_streamed_mul_mat  # noqa: E402

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


GROUPED_TYPES = ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                 "TQ1_0", "TQ2_0"]


@pytest.mark.parametrize("kind,repack", [(kind, False) for kind in GROUPED_TYPES] + [("Q4_K", True)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])  # k_vec_dot; from 8 the tiled kernel, a tile of 8 and a tail
def test_group_rows_of_a_partial_group_are_the_numpy_twins(kind, repack, rows):  # 40 rows: 8 real, 8 padded
    """numba decodes these types into GroupRows, 16 weight rows interleaved; a row count that is no
    multiple of 16 pads the last group with zero rows, which must not reach the output. Q4_K with the
    repack (40 rows: whole groups of 8) takes the repacked gemm (4-row groups) and gemv (the rest)."""
    rng = np.random.default_rng(7)
    weights = harness.BlockWeights(kind, 40, 768, rng)  # 3 blocks: sums carried across blocks
    x = rng.standard_normal((rows, 768)).astype(np.float32)
    cache = {}
    got = numba_mul_mat.mul_mat(x, weights, "w", cache, repack=repack)
    if numba_mul_mat.block_dots.reads(kind, kernel_path(kind, rows, weights, "w", repack)):
        assert cache == {}  # block_dots read the blocks themselves: no decoded copy
    else:
        assert isinstance(cache["w"], numba_mul_mat.GroupRows) and cache["w"].codes.shape[0] == 3
    ref = ggml_cpu.mul_mat(x, weights, "w", {}, repack=repack)
    assert_identical(ref, got, f"{kind}, 40 rows, {rows} activation rows, repack {repack}")


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


@pytest.mark.parametrize("run", MANIFEST["kv_mixed"]["runs"], ids=run_id)
def test_mixed_kv_logits_bit_identical(run, tmp_path):  # -ctk and -ctv apart: the one-chunk kernel's two types
    check_run(run, model(run["model"]) if "model" in run else rebuilt_model(run, tmp_path), GgmlCpuNumbaBackend)


@pytest.mark.parametrize("name,run,prompt", SHARED, ids=[f"{m}-{r}-{p}" for m, r, p in SHARED])
def test_shared_llama_cpp_goldens(name, run, prompt):  # BF16, the tiled flash attention, tiny-a's Q2_K repack
    check_shared(name, run, prompt, GgmlCpuNumbaBackend)


def test_cli_backend_numba_numerics_ggml_cpu(tmp_path):
    run = next(r for r in MANIFEST["runs"] if r["type"] == "q4_k_m" and r["kv_type"] == "f16" and not r["flash_attn"])
    check_cli_run(tmp_path, run, "--backend", "numba")


class JoinedRows:
    """A preset's weights with each pair of rows of one tensor joined into one: K = 512, so every kernel
    accumulates over more than one 256-block (the tiny models' K is at most 256)."""

    def __init__(self, weights, name):
        self.weights, self.name = weights, name

    def type_name(self, name):
        return self.weights.type_name(name)

    def raw(self, name):
        raw = np.asarray(self.weights.raw(name))
        return raw.reshape(len(raw) // 2, -1) if name == self.name else raw


@pytest.mark.parametrize("kind", ["Q4_1", "Q1_0", "Q2_0", "TQ1_0", "TQ2_0", "Q2_K"])  # presets of these names
@pytest.mark.parametrize("rows", [1, 3, 8, 10])  # vec_dot; from 8 rows Q2_K's tiled kernel, the others' vec_dot still
@pytest.mark.parametrize("joined", [False, True])
def test_preset_type_kernels_are_their_numpy_twins(kind, rows, joined):  # the vec_dot-only types, Q2_K's vec_dot
    weights, name = preset_model(kind).weights, "blk.0.ffn_up.weight"
    assert weights.type_name(name) == kind
    x = activations(rows, weights.shape(name)[1] * (2 if joined else 1), rows)
    if joined:
        weights = JoinedRows(weights, name)
    ref = ggml_cpu.mul_mat(x, weights, name, {}, repack=False)
    assert_identical(ref, numba_mul_mat.mul_mat(x, weights, name, {}, repack=False), f"{kind}, {rows} rows")


@pytest.mark.parametrize("kind", sorted(IQ_KERNELS["models"]))
@pytest.mark.parametrize("rows", [1, 3, 8, 10])  # the vec_dot (IQ1: iq1_vec_dot) and the tiled kernel
@pytest.mark.parametrize("row_blocks", [1, 4])  # the presets' 256-wide rows, and 4 blocks regrouped into one row
def test_iq_mul_mat_kernels_are_their_numpy_twins(kind, rows, row_blocks):
    weights = iq_block_rows(kind, row_blocks)
    x = activations(rows, 256 * row_blocks, rows)
    x[:, 256:] *= np.float32(1e-3)  # later blocks of another magnitude
    ref = ggml_cpu.mul_mat(x, weights, kind, {}, repack=False)
    assert_identical(ref, numba_mul_mat.mul_mat(x, weights, kind, {}, repack=False), f"{kind}, {rows} rows")


@pytest.mark.parametrize("kind", sorted(IQ_KERNELS["models"]))
@pytest.mark.parametrize("rows", IQ_KERNELS["rows"])
def test_iq_kernels_bit_identical_to_llama_cpp(kind, rows):  # golden/ggml_cpu/kernels: rows of 4 blocks
    check_iq_kernel(kind, rows, numba_mul_mat.mul_mat)
# ---------------------------------------------------------------------------------------------
# The block decoders of the 30B UD-IQ2_XXS mix, and the bounded weight cache

from gguf import GGMLQuantizationType, quants  # noqa: E402

from accel.numba.ggml import blocks as numba_blocks  # noqa: E402
from reference.ggml_cpu import blocks as reference_blocks  # noqa: E402

DECODED_TYPES = {  # type -> a committed GGUF that holds tensors of it (llama-quantize's blocks)
    "IQ2_XXS": "models/tiny-a-iq2_xxs.gguf", "IQ3_XXS": "ggml_cpu/models/tiny-b-iq3_xxs.gguf",
    "IQ4_XS": "models/tiny-a-iq4_xs.gguf", "Q4_K": "ggml_cpu/models/tiny-b-iq3_xxs.gguf",
    "Q6_K": "models/tiny-b-q6_k.gguf",
}
QUANT_ROWS_FIELDS = ("d", "values", "scales", "mins", "dmin", "m", "sub", "post", "unsigned_offset", "min_lanes")


def assert_same_rows(ref, got, what):  # two QuantRows: every field of the same dtype, shape and bits
    for field in QUANT_ROWS_FIELDS:
        a, b = getattr(ref, field), getattr(got, field)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {field}"
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: {field}"
        else:
            assert type(a) is type(b) and a == b, f"{what}: {field}"


def weight_terms(rows):  # QuantRows -> (d * post * scale * (value - offset), dmin * min + m) in float64 [O, K]
    v = rows.values.astype(np.float64) - rows.unsigned_offset
    if rows.scales is not None:
        v *= np.repeat(rows.scales, rows.sub, axis=-1)
    scaled = rows.d[..., None].astype(np.float64) * rows.post * v
    shift = np.zeros_like(scaled)
    if rows.mins is not None:
        shift -= rows.dmin[..., None].astype(np.float64) * np.repeat(rows.mins, rows.sub, axis=-1)
    return scaled.reshape(len(v), -1), shift.reshape(len(v), -1)


@pytest.mark.parametrize("kind", sorted(DECODED_TYPES))
def test_block_decoders_are_their_numpy_twins_on_committed_tensors(kind):
    weights = model(DECODED_TYPES[kind]).weights
    names = [n for n in weights.tensors if weights.type_name(n) == kind]
    assert names, f"{DECODED_TYPES[kind]} holds no {kind} tensor"
    for name in names:
        n_rows = len(weights.raw(name))
        ref = reference_blocks.decode_rows(weights, name, 0, n_rows)
        got = reference_blocks.decode_rows(weights, name, 0, n_rows, numba_blocks.DECODERS)
        assert_same_rows(ref, got, f"{kind} {name}")
        # and against gguf-py's float32 dequantization: each weight is at most two float32 products
        # and a difference, so it is within 3 float32 roundings (2^-24 relative) of its terms
        scaled, shift = weight_terms(got)
        theirs = quants.dequantize(np.asarray(weights.raw(name)), GGMLQuantizationType[kind]).astype(np.float64)
        bound = 3 * 2.0 ** -24 * (np.abs(scaled) + np.abs(shift))
        assert np.all(np.abs(scaled + shift - theirs) <= bound), f"{kind} {name} against gguf-py"


@pytest.mark.parametrize("kind", sorted(DECODED_TYPES))
def test_block_decoders_are_their_numpy_twins_on_random_bytes(kind):  # every bit of every field set somewhere
    n_bytes = reference_blocks.DECODERS[kind][0]
    raw = np.random.default_rng(len(kind)).integers(0, 256, (40, 3, n_bytes), dtype=np.uint8)
    ref = reference_blocks.narrow(reference_blocks.DECODERS[kind][1](raw))
    assert_same_rows(ref, numba_blocks.DECODERS[kind][1](raw), f"{kind} random blocks")


@pytest.mark.parametrize("kind", STREAM_MODELS)
@pytest.mark.parametrize("step", ["", "decode."])
def test_streamed_mul_mat_on_llama_cpp_tensors(kind, step, monkeypatch):  # no cache, 8-row blocks
    check_streamed_mul_mat(kind, step, numba_mul_mat.mul_mat, monkeypatch, numba_decodes)


def numba_decodes(weights, name, rows):  # -> whether the numba mul_mat decodes the matrix (else it reads the blocks)
    kind = weights.type_name(name)
    return not block_dots.reads(kind, kernel_path(kind, rows, weights, name))


# iq2_xxs: every matrix numba multiplies there reads its blocks (block_dots), so nothing is left to stream
@pytest.mark.parametrize("run", [r for r in BOUNDED_RUNS if r["type"] != "iq2_xxs"], ids=run_id)
def test_bounded_cache_logits_bit_identical_to_llama_cpp(run, monkeypatch):  # some matrices kept, the rest streamed
    check_bounded_logits(run, GgmlCpuNumbaBackend, monkeypatch)
# ---------------------------------------------------------------------------------------------
# The rest of the emulation's twins (attention, norms, RoPE, softmax, SwiGLU, float dots, libm),
# through the op harness's ggml-cpu cases: every bit equal, NaN patterns included

import numba  # noqa: E402

from accel import harness  # noqa: E402
from accel.numba.ggml import attention as numba_attention, float_dots as numba_float_dots  # noqa: E402
from accel.numba.ggml import rounding as numba_rounding  # noqa: E402
from conftest import cli_error, run_cli  # noqa: E402
from reference import ops  # noqa: E402
from reference.ggml_cpu import attention as ref_attention, elementwise as ref_elementwise  # noqa: E402

GGML_CASES = harness.ggml_cases(seed=0)


@pytest.mark.parametrize("case", GGML_CASES, ids=[f"{c.op}-{c.name}" for c in GGML_CASES])
def test_ggml_harness_case(case):  # gate 0: the same float32 operations in the same order
    differing, worst, gate, problem = harness.check(case)
    assert not problem, f"{case.name}: {problem}, max |diff| {worst:.3g}"


def test_harness_compare_sees_one_ulp():  # the gate can fail: one ulp in one element, a NaN's sign
    ref = [np.float32([1.0, np.nan, 3.0])]
    one_ulp = [np.float32([np.nextafter(np.float32(1), np.float32(2)), np.nan, 3.0])]
    other_nan = [np.float32([1.0, -np.float32(np.nan), 3.0])]
    assert harness.compare(ref, one_ulp)[:2] == (1, float(np.spacing(np.float32(1))))
    assert harness.compare(ref, other_nan)[0] == 1
    assert harness.compare([np.int64([1, 2])], [np.int8([1, 3])])[0] == 1


@pytest.mark.parametrize("fn", ["vec_dot_f32", "vec_dot_f16", "vec_dot_bf16", "float_mul_mat"])
def test_float_dots_refuse_a_target_without_x86_lanes(fn):  # vec_body's registers are 16 or 8 floats: NEON's 4 refused
    from reference.ggml_cpu.build import GgmlCpuError
    from reference.ggml_cpu.target import TARGETS
    x = np.ones((1, 64), np.float32)
    args = (x, x, "F32") if fn == "float_mul_mat" else (x, x)
    with pytest.raises(GgmlCpuError, match="numba twins model"):
        getattr(numba_float_dots, fn)(*args, TARGETS["neon"])


@numba.njit
def rounded_f16(x):  # f32 [n] -> [n] through the numba scalar round_f16
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = numba_rounding.round_f16(x[i])
    return out


def test_round_f16_is_numpys_float16():  # every exponent, the subnormal grid, ties, overflow to infinity
    rng = np.random.default_rng(7)
    bits = np.concatenate([rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x33000000, 0x38800400, 3, dtype=np.uint32),  # subnormal halves and ties
                           np.arange(0x477FE000, 0x47800100, dtype=np.uint32)])  # 65504 .. 65536: to infinity
    x = np.concatenate([bits, bits | np.uint32(1 << 31)]).view(np.float32)
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):
        assert np.array_equal(ggml_cpu.round_f16(x).view(np.uint32), rounded_f16(x).view(np.uint32))


def long_prompt(T, S, H, Hkv, D, seed):  # q, k, v, visible, scale of a causal chunk ending a cache of S cells
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((T, H, D), (S, Hkv, D), (S, Hkv, D)))
    return q, k, v, ops.causal_visible(np.arange(S - T, S), np.arange(S), 0), 1 / np.sqrt(D)


@pytest.mark.parametrize("path", ["mul_mat f16", "mul_mat f32", "flash"])
def test_attention_over_several_tiles_and_padded_cells(path):  # 130 rows over 300 cells (n_kv 512), GQA 3/1
    args = long_prompt(130, 300, 3, 1, 64, 11)
    fn, extra = ("attention_flash", (2,)) if path == "flash" else ("attention_mul_mat", (path.split()[1],))
    ref, got = getattr(ref_attention, fn)(*args, *extra), getattr(numba_attention, fn)(*args, *extra)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
@pytest.mark.parametrize("T", [1, 40])
def test_attention_leaves_out_unseen_cells_without_changing_a_bit(kv_type, T, monkeypatch):
    """A 300-key window ending a 1300-cell cache (n_kv 1536): its first 768 cells are left out. Every
    cell read, as the cache has them, gives the same bits, on both implementations."""
    q, k, v, _, scale = long_prompt(T, 1300, 4, 2, 64, 13)
    visible = ops.causal_visible(np.arange(1300 - T, 1300), np.arange(1300), 300)
    assert ref_attention.unseen_cells(visible, 1536) == 768
    windowed = [module.attention_mul_mat(q, k, v, visible, scale, kv_type) for module in (ref_attention, numba_attention)]
    monkeypatch.setattr(ref_attention, "unseen_cells", lambda visible, n_kv: 0)
    whole = ref_attention.attention_mul_mat(q, k, v, visible, scale, kv_type)
    for got in windowed:
        assert np.array_equal(whole.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("T, D", [(1, 48), (1, 128), (37, 48), (37, 128)])
def test_f16_attention_kernels_at_the_release_grouping(T, D):
    """16 query heads a kv head, as the release's 32 over 2: one row (vec_dot_f16 over the cache in
    place), 37 rows (592 a kv head: 19 row blocks, the last padded); head sizes 48 (K.Q's dot with a
    leftover register) and 128; a 500-key window over 600 cells (n_kv 768): masked and padded cells in
    both products."""
    q, k, v, _, scale = long_prompt(T, 600, 32, 2, D, 17)
    visible = ops.causal_visible(np.arange(600 - T, 600), np.arange(600), 500)
    ref, got = ref_attention.attention_mul_mat(q, k, v, visible, scale, "f16"), numba_attention.attention_mul_mat(
        q, k, v, visible, scale, "f16")
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_f16_attention_reads_every_cell_where_v_is_not_finite():
    """Rows that see only part of the cells read only those; a V cell of 1e6 (infinity in f16) among
    the cells read that no row sees (258: the first 256 are left out, the rows see 264 on) still makes
    the reference's products NaN (0 times inf) in its dimension, and the kernels' too."""
    q, k, v, _, scale = long_prompt(37, 600, 32, 2, 64, 18)
    visible = ops.causal_visible(np.arange(563, 600), np.arange(600), 300)
    v[258, 1, 5] = 1e6
    with np.errstate(over="ignore", invalid="ignore"):
        ref = ref_attention.attention_mul_mat(q, k, v, visible, scale, "f16")
    got = numba_attention.attention_mul_mat(q, k, v, visible, scale, "f16")
    assert np.isnan(ref[:, 16:, 5]).all() and np.isnan(ref).sum() == 37 * 16
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_flash_split_with_three_threads():  # chunks of ceil(n_kv / 3) cells, the last one shorter
    args = long_prompt(1, 700, 2, 2, 32, 12)
    ref, got = ref_attention.attention_flash(*args, 3), numba_attention.attention_flash(*args, 3)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_soft_max_ties_and_zero_scale():  # equal scores (ties for the max) and scale 0: every weight 1/n
    scores = np.repeat(np.float32([[2.0, 2.0, -1.0] * 11]), 3, axis=0)
    visible = np.ones_like(scores, bool)
    for scale in (1.0, 0.0):
        ref, got = ref_elementwise.soft_max(scores, visible, scale), numba_elementwise.soft_max(scores, visible, scale)
        assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_float_mul_mat_on_a_model_weight():  # tiny-b's F16 and BF16 ffn_up, 1 and 5 rows
    for kind in ("f16", "bf16"):
        weights = model(f"models/tiny-b-{kind}.gguf").weights
        w = weights.get("blk.0.ffn_up.weight", np.float32)
        x = activations(5, w.shape[1], 3)
        for rows in (1, 5):
            ref = ggml_cpu.mul_mat(x[:rows], weights, "blk.0.ffn_up.weight", {})
            got = GgmlCpuNumbaBackend(check_host=False).linear(x[:rows], weights.tensor("blk.0.ffn_up.weight"))
            assert_identical(ref, got, f"{kind} {rows} rows")


def test_harness_cli_numerics_ggml_cpu():
    r = run_cli("accel.harness", "--numerics", "ggml-cpu", "--ops", "libm")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("all passed") and "v_silu" in r.stdout and "attention_flash" not in r.stdout


@pytest.mark.parametrize("args, words", [
    (("--numerics", "ggml-cpu", "--backend", "numpy"), "compares the numba ggml kernels, not --backend numpy"),
    (("--numerics", "ggml-cpu", "--ops", "linear"), "linear: not a ggml-cpu kernel file"),
    (("--ops", "quantize"), "quantize: ggml-cpu kernel files, for --numerics ggml-cpu"),
    (("--numerics", "float"), "unknown numerics 'float'"),
])


def test_harness_cli_refuses(args, words):
    assert words in cli_error(run_cli("accel.harness", *args))


@numba.njit
def fused(a, b, c):  # f32 [n] x3 -> [n] through numba fma32, in a loop LLVM may vectorise
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = numba_rounding.fma32(a[i], b[i], c[i])
    return out


def midpoint_operands(n, seed):  # a, b, c f32 whose a*b + c lands on (or a hair off) a float32 midpoint
    """a*b = h (1 - 2^-2k) or h (1 - 2^-k)(1 + 2^-k) with h half an ulp of c: in float64 the sum rounds
    onto the midpoint c + h, while the exact sum is just below it (the double-rounding trap)."""
    rng = np.random.default_rng(seed)
    c = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-20, 20, n) * rng.choice([-1, 1], n)).astype(np.float32)
    h = np.spacing(np.abs(c)) / 2
    k = rng.integers(8, 23, n)
    a = (h * (1 - 2.0 ** -k) * rng.choice([-1, 1], n)).astype(np.float32)
    b = np.where(rng.random(n) < 0.9, 1 + 2.0 ** -k, 1.0).astype(np.float32)  # b = 1: an exact midpoint, a tie
    return a, b, c


def test_fma32_is_reference_fma32_on_midpoints():  # the hardware fma of the kernels against reference fma32
    a, b, c = midpoint_operands(200000, 21)
    ref = ggml_cpu.fma32(a, b, c)
    naive = (a.astype(np.float64) * b + c).astype(np.float32)
    assert np.count_nonzero(ref != naive) > 10000  # the operands do reach the midpoint correction
    assert np.array_equal(ref.view(np.uint32), fused(a, b, c).view(np.uint32))


def test_bench_ggml_numba_runs_bit_identical(tmp_path):  # numpy and numba in one run: logits max |diff| 0
    r = run_cli("tools.bench_ggml_numba", "--models", "tiny-b-q4_k_m", "--prompt-len", "4", "--n-decode", "1",
                "--repeat", "1", "--plot", str(tmp_path / "speed.png"))
    assert r.returncode == 0, r.stderr
    assert "max |diff| 0, NMSE 0" in r.stdout and (tmp_path / "speed.png").stat().st_size > 0


@pytest.mark.parametrize("args, words", [
    (("--models", "tiny-b-q4_k_m,nope"), "no model 'nope': neither a GGUF file nor a name in golden/models"),
    (("--kv-type", "q8_0"), "a q8_0 V cache needs -fa on"),
    (("--prompt-len", "0"), "--prompt-len: 0 is out of range"),
    (("--plot", "no/such/dir/x.png"), "no such directory"),
])


def test_bench_ggml_numba_refuses(args, words):
    assert words in cli_error(run_cli("tools.bench_ggml_numba", *args))


def test_drafter_on_numba_near_transformers_and_bit_identical_to_numpy():  # rope_neox, norms, SwiGLU
    from test_dflash_ggml_cpu import GGML_CPU_NMSE, drafter_blocks
    from reference.metrics import nmse
    ref, ours = drafter_blocks(GgmlCpuNumbaBackend(check_host=False))
    assert nmse(ref, ours).max() <= GGML_CPU_NMSE  # test_dflash_ggml_cpu's gate, derived there
    assert np.array_equal(ref.argmax(-1), ours.argmax(-1))
    _, emulated = drafter_blocks(ggml_cpu.GgmlCpuBackend(check_host=False))
    assert_identical(emulated, ours, "drafter block logits, numba against the NumPy emulation")


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("rows", [3, 10])
def test_pair_sum_kernels_on_generic_vectors_are_the_numpy_twins(kind, rows, monkeypatch):  # CPUs without AVX2
    import numba
    from accel.numba.ggml import int_dots
    from reference.ggml_cpu.blocks import decode
    monkeypatch.setattr(int_dots, "PMADDWD", False)  # read when a kernel compiles: fresh, uncached ones
    weights = model(fixture(kind)[0]["model"]).weights
    name = "blk.0.ffn_down.weight"
    x = activations(rows, weights.shape(name)[1], rows)
    w, a = numba_mul_mat.KernelRows(decode(weights, name)), numba_quantize.quantize_q8_0(x)
    got = numba.njit(parallel=True)(int_dots.q0_lanes.py_func)(w.vs, w.d, a.q, a.d, 1)  # chunk_sums' pair sums
    ref = ggml_cpu.mul_mat(x, weights, name, {}, repack=False)  # the repacked Q4_0 would take another kernel
    assert_identical(ref, got, f"{weights.type_name(name)}, {rows} rows, generic vectors")


@pytest.mark.parametrize("kind", ["IQ4_XS", "IQ2_XXS", "IQ3_XXS"])
@pytest.mark.parametrize("rows, path", [(3, "k_vec_dot"), (10, "tiled")])  # a tile of 8, then 2 rows
def test_block_dots_on_generic_vectors_are_the_numpy_twins(kind, rows, path, monkeypatch):  # CPUs without AVX512-VNNI
    """block_dots compiled as on a CPU without AVX512-VNNI: the vpdpbusd sums (int_dots.dpbusd),
    IQ4_XS's table lookup (lookup16, vpshufb there) and the IQ2_XXS/IQ3_XXS grids and signs from
    their tables in memory (vpermi2w/vpermi2b/vpermb there) from generic LLVM vectors. Fresh,
    uncached kernels: the flag is read when a kernel compiles."""
    import numba
    from accel.numba.ggml import int_dots
    from reference.ggml_cpu import int_dots as reference_dots, quantize as reference_quantize
    from reference.ggml_cpu.blocks import decode
    monkeypatch.setattr(int_dots, "VPDPBUSD", False)
    monkeypatch.setattr(block_dots, "KERNELS", {})
    monkeypatch.setattr(block_dots, "FACTORIES", {p: lambda kind, f=f: numba.njit(parallel=True)(f(kind).py_func)
                                                  for p, f in block_dots.FACTORIES.items()})
    weights = harness.BlockWeights(kind, 13, 512, np.random.default_rng(rows))
    x = activations(rows, 512, rows)
    ref = getattr(reference_dots, path)(decode(weights, "w"), reference_quantize.quantize_q8_k(x))
    assert_identical(ref, block_dots.mul_mat(x, weights, "w", path), f"block_dots {kind}, {rows} rows, generic vectors")
    ir = "".join(block_dots.KERNELS[kind, path].inspect_llvm().values())
    assert not any(f in ir for f in ("vpdpbusd", "pshuf.b.512", "vpermi2var", "permvar")), "the kernel compiled the AVX-512 arm"


# ---------------------------------------------------------------------------------------------
# block_dots: the vec_dots on the mmapped block bytes

BLOCK_DOT_MODELS = {"IQ2_XXS": "iq2_xxs", "IQ3_XXS": "iq3_xxs", "IQ4_XS": "iq4_xs", "Q4_K": "q4_k_m",
                    "Q5_K": "q5_k_m", "Q6_K": "q6_k", "Q8_0": "q8_0"}  # type -> its ops fixture (llama-quantize's blocks)


@pytest.mark.parametrize("kind", sorted(BLOCK_DOT_MODELS))
def test_block_dots_on_llama_cpp_decode_products(kind):  # llama.cpp's own 1-row product of a tensor of the type
    entry, t = fixture(BLOCK_DOT_MODELS[kind])
    weights = model(entry["model"]).weights
    name = "blk.0.ffn_up.weight"
    if weights.type_name(name) != kind:
        pytest.skip(f"{entry['model']}'s ffn_up is {weights.type_name(name)}: covered by its own fixture")
    x, ref = t["decode.ffn_up.in"], t["decode.ffn_up.out"]
    path = kernel_path(kind, 1, weights, name)  # the ops goldens were taken with llama.cpp's default repack
    if not block_dots.reads(kind, path):
        pytest.skip(f"llama.cpp took {path} for this {kind} golden; the presets' plain-buffer logits cover the vec_dot")
    got = block_dots.mul_mat(x, weights, name, path)
    assert_identical(ref, got[:, :ref.shape[1]], f"block_dots {kind}, llama.cpp's decode step")


@pytest.mark.parametrize("kind", sorted(BLOCK_DOT_MODELS))
@pytest.mark.parametrize("rows", [1, 3, 8, 17])  # the vec_dot's loop over activation rows, past a vector's 16
@pytest.mark.parametrize("path", ["k_vec_dot", "tiled"])  # the decode kernel, and the prefill one from 8 rows
def test_block_dots_are_the_numpy_vec_dots(kind, rows, path):  # every tensor of the type in its committed model
    from reference.ggml_cpu import int_dots as reference_dots, quantize as reference_quantize
    from reference.ggml_cpu.blocks import decode
    weights = model(fixture(BLOCK_DOT_MODELS[kind])[0]["model"]).weights
    names = [n for n in weights.tensors if weights.type_name(n) == kind]
    assert names
    if kind == "Q8_0":
        path = "q0_lanes"
    for name in names:
        x = activations(rows, weights.shape(name)[1], rows)
        quantize = reference_quantize.quantize_q8_0 if kind == "Q8_0" else reference_quantize.quantize_q8_k
        ref = getattr(reference_dots, path)(decode(weights, name), quantize(x))
        assert_identical(ref, block_dots.mul_mat(x, weights, name, path), f"block_dots {kind} {name}, {rows} rows")


@pytest.mark.parametrize("kind", sorted(block_dots.TYPES))
@pytest.mark.parametrize("n_out", [5, 13, 29])  # bands of 8 weight rows past the last row, in a task of 16 and in two
def test_block_dots_on_random_blocks_with_rows_past_the_last_band(kind, n_out):
    """row_dot and the tiled kernel's bands on random blocks of every type, against the reference's
    vec_dot and tiled kernel: the last band reads row O - 1 again and its sums are dropped."""
    from accel import harness
    from reference.ggml_cpu import int_dots as reference_dots, quantize as reference_quantize
    from reference.ggml_cpu.blocks import decode
    weights = harness.BlockWeights(kind, n_out, 512, np.random.default_rng(n_out))
    for rows, path in ((1, "k_vec_dot"), (5, "k_vec_dot"), (8, "tiled"), (21, "tiled")):
        x = activations(rows, 512, rows + n_out)
        ref = getattr(reference_dots, path)(decode(weights, "w"), reference_quantize.quantize_q8_k(x))
        assert_identical(ref, block_dots.mul_mat(x, weights, "w", path), f"block_dots {kind}, {n_out} x 512, {rows} rows")


CACHED_KERNEL_RUN = """
import numpy as np
from accel import harness
from accel.numba.ggml import block_dots, mul_mat
w = harness.BlockWeights("IQ2_XXS", 16, 256, np.random.default_rng(0))
for rows in (1, 8):  # k_vec_dot, then tiled
    mul_mat.mul_mat(np.ones((rows, 256), np.float32), w, "w", {})
print(sum(len(k.stats.cache_hits) for k in block_dots.KERNELS.values()), len(block_dots.KERNELS))
"""


def test_block_dot_kernels_load_from_numbas_cache_in_a_new_process(tmp_path):
    """The per-type kernels are closures; one holding a dispatcher or an intrinsic gets a new cache
    key in every process, and each start compiled every kernel again (2 s each here)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    runs = [subprocess.run([sys.executable, "-c", CACHED_KERNEL_RUN], env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs == [["0", "2"], ["2", "2"]]  # the first process compiles both kernels, the second loads both
