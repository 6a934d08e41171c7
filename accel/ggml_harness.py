"""The op harness's ggml-cpu section: every kernel of accel/numba/ggml against its twin of the same
name in reference/ggml_cpu, on seeded random inputs with the edge cases planted (zero blocks, ties,
rows that see no key, odd lengths and head counts, head sizes 32/40/64/96/128).

    python -m accel.harness --numerics ggml-cpu [--ops attention,int_dots] [--seed 0]

The gate is 0: each twin does the same float32 operations in the same order as its NumPy statement
(integer sums are exact in any order), so the outputs must agree in every bit (compared as uint32
patterns, NaNs included), and a difference of one ulp anywhere is a bug, not noise. The integer
kernels are reached through reference mul_mat's kernel choice (`kernel_path`): each quantized type,
batch rows 1, 3, 4, 8, 10 and repack on/off, the reference's QuantRows against the numba layout
(GroupRows or KernelRows) its mul_mat decodes them into.
"""
import importlib
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GT

from accel.numba.ggml.quantize import NUMBA_TARGETS

from reference import ops
from reference.ggml_cpu.blocks import DECODERS, decode
from reference.ggml_cpu.build import GgmlCpuError
from reference.ggml_cpu.mul_mat import QUANT_PATHS, TILED_MIN_ROWS, kernel_path
from reference.ggml_cpu.rounding import round_bf16, round_f16
from reference.ggml_cpu.target import AVX512, TARGETS
from reference.gguf import GgmlType
from reference.random_blocks import F16_SCALE_OFFSETS, random_weights

F32 = np.float32
WHY = "the same float32 operations in the same order (integer sums exact in any order): every bit equal"
EMULATED = list(NUMBA_TARGETS)  # the CPU targets the float kernels take
SCALE_OFFSETS = {**F16_SCALE_OFFSETS, GT.Q1_0: (0,), GgmlType.Q2_0: (0,)}  # f16 d (and m) of each block; IQ1_M: its own


@dataclass
class TwinCase:
    op: str  # the file both twins live in
    name: str
    run: object  # () -> (reference outputs, numba outputs): lists of arrays


def outputs(result):  # a kernel's result -> [arrays]: QuantActs fields, a tuple's items, or the array
    if hasattr(result, "bsums"):
        return [a for a in (result.d, result.q, result.s, result.bsums) if a is not None]
    return [np.asarray(a) for a in result] if isinstance(result, tuple) else [np.asarray(result)]


def twin(module, fn, *args, label="", reference_module=None):  # -> TwinCase: reference module.fn(*args) against accel's
    ref = importlib.import_module(f"reference.ggml_cpu.{reference_module or module}")
    numba_twin = importlib.import_module(f"accel.numba.ggml.{module}")
    return TwinCase(module, fn + label, lambda: (outputs(getattr(ref, fn)(*args)),
                                                 outputs(getattr(numba_twin, fn)(*args))))


def compare(ref, got):  # [arrays] x2 -> (differing elements, max |diff| over finite ones, problem or "")
    if len(ref) != len(got) or any(np.shape(r) != np.shape(g) for r, g in zip(ref, got)):
        return -1, float("nan"), "outputs of another shape"
    differing, worst = 0, 0.0
    for r, g in zip(ref, got):
        floats = np.issubdtype(r.dtype, np.floating)
        r = r.astype(F32).view(np.uint32) if floats else r.astype(np.int64)
        g = g.astype(F32).view(np.uint32) if floats else g.astype(np.int64)
        differing += int(np.count_nonzero(r != g))
        values = [a.view(F32).astype(np.float64) if floats else a.astype(np.float64) for a in (r, g)]
        finite = np.isfinite(values[0]) & np.isfinite(values[1])
        if finite.any():
            worst = max(worst, float(np.max(np.abs(values[0][finite] - values[1][finite]))))
    return differing, worst, f"{differing} elements differ" if differing else ""


# ---------------------------------------------------------------------------------------------
# The cases

def rows_with_edges(rng, rows, width, scale=1.0):  # f32 [rows, width]: a zero row, a +-max tie, exact halves
    x = (scale * rng.standard_normal((rows, width))).astype(F32)
    x[-1, :min(width, 256)] = 0
    x[0, :8] = [-5, 1, 2, 3, 4, 5, 0.5, 1.5]
    return x


def quantize_cases(rng):
    x = rows_with_edges(rng, 6, 512)
    x[1, 32:64] = F32(0.5) * np.arange(32, dtype=F32)  # exact halves: round half to even
    return [twin("quantize", "quantize_q8_0", x, label=" x[6,512]"),
            twin("quantize", "quantize_q8_k", x, False, label=" x[6,512]"),
            twin("quantize", "quantize_q8_k", x, True, label=" x[6,512] prefer_positive")]


class BlockWeights:
    """Random raw blocks of one type, scales planted finite, served as reference.gguf.Weights is
    to the kernel choice and the decoders (type_name, raw)."""

    def __init__(self, kind, n_out, n_in, rng):
        qtype = GT[kind] if kind in GT.__members__ else GgmlType[kind]
        self.kind, self.blocks = kind, random_weights(qtype, n_out, n_in, rng, SCALE_OFFSETS)

    def type_name(self, name):
        return self.kind

    def raw(self, name):
        return self.blocks


def int_dot_cases(rng):  # every quantized type x batch rows x repack, through its kernel path
    from accel.numba.ggml import mul_mat as numba_mul_mat
    cases = []
    for kind in sorted(DECODERS):
        w = BlockWeights(kind, 16, 512, rng)
        rows = decode(w, "w")
        # the layout numba's mul_mat decodes the matrix into, for the paths of decode and prefill
        layouts = {repack: numba_mul_mat.kernel_rows(rows, kind, [kernel_path(kind, n, w, "w", repack)
                                                                  for n in (1, TILED_MIN_ROWS)])
                   for repack in (True, False)}
        for n_rows in (1, 3, 4, 8, 10):
            x = rows_with_edges(rng, n_rows, 512)
            for repack in (True, False):
                try:
                    path = kernel_path(kind, n_rows, w, "w", repack)
                except GgmlCpuError:  # a kernel the emulation refuses (the Q2_K vec_dot)
                    continue
                kernel_rows = layouts[repack]
                run = (lambda x=x, path=path, kind=kind, rows=rows, kernel_rows=kernel_rows:
                       ([QUANT_PATHS[path](x, kind, AVX512)(rows)],
                        [numba_mul_mat.QUANT_PATHS[path](x, kind, AVX512)(kernel_rows)]))
                cases.append(TwinCase("int_dots", f"{path} {kind} x[{n_rows},512] repack {'on' if repack else 'off'}",
                                      run))
    return cases


def float_dot_cases(rng):
    cases = []
    for n in (64, 256, 300, 72, 13):  # whole 64-steps, tails of 16 + 8, of 8, of < 8
        x, y = rng.standard_normal((5, 1, n)).astype(F32), rng.standard_normal((1, 4, n)).astype(F32)
        for cpu in EMULATED:
            cases += [twin("float_dots", "vec_dot_f32", x, y, TARGETS[cpu], label=f" [5,4,{n}] {cpu}"),
                      twin("float_dots", "vec_dot_f16", round_f16(x), round_f16(y), TARGETS[cpu],
                           label=f" [5,4,{n}] {cpu}"),
                      twin("float_dots", "vec_dot_bf16", round_bf16(x), round_bf16(y), TARGETS[cpu],
                           label=f" [5,4,{n}] {cpu}")]
    x, w = rng.standard_normal((7, 256)).astype(F32), rng.standard_normal((12, 256)).astype(F32)
    cases += [twin("float_dots", "tinyblas", x, w, TARGETS[cpu], label=f" x[7,256] w[12,256] {cpu}")
              for cpu in EMULATED]
    cases.append(twin("float_dots", "tinyblas_bf16", round_bf16(x), round_bf16(w), label=" x[7,256] w[12,256]"))
    for T, O in ((1, 12), (3, 12), (3, 10)):  # vec_dot rows, tinyBLAS, vec_dot for O not a multiple of 4
        for kind, rounding in (("F32", np.asarray), ("F16", round_f16), ("BF16", round_bf16)):
            cases += [twin("float_dots", "float_mul_mat", rounding(x[:T]), rounding(w[:O]), kind, TARGETS[cpu],
                           label=f" {kind} x[{T},256] w[{O},256] {cpu}", reference_module="mul_mat")
                      for cpu in EMULATED]
    return cases


def elementwise_cases(rng):
    x2, x3 = rows_with_edges(rng, 7, 6656, 3.0), rng.standard_normal((5, 3, 64)).astype(F32)
    odd = rng.standard_normal((4, 300)).astype(F32)
    theta = ops.rope_angles(np.arange(100, 105), 64, 10000.0, F32)
    theta_odd = ops.rope_angles(np.arange(5), 40, 10000.0, F32)  # 20 pairs: a tail of no FMA contraction
    quarter = ops.rope_angles(np.arange(5), 32, 10000.0, F32)  # 16 pairs of a 64 head: partial rotation
    x40 = rng.standard_normal((5, 3, 40)).astype(F32)
    scores = (5 * rng.standard_normal((9, 300))).astype(F32)
    visible = rng.random((9, 300)) < 0.7
    visible[0], visible[1] = False, True  # a row that sees nothing (NaN through the -inf max), one all
    special = np.concatenate([30 * rng.standard_normal(300), [0, -0.0, np.inf, -np.inf, np.nan, 88.8, -104]])
    special = special.astype(F32).reshape(-1, 1)
    theta_7 = ops.rope_angles(np.arange(5), 14, 10000.0, F32)  # 7 pairs: AVX2's 4 + 2 + a plain one
    x14 = rng.standard_normal((5, 3, 14)).astype(F32)
    cases = [
        twin("elementwise", "rms_norm", x2, 1e-5, label=" x[7,6656]"),
        twin("elementwise", "rms_norm", odd, 1e-6, label=" x[4,300]"),
        twin("elementwise", "sigmoid", special, label=" with inf/NaN"),
        twin("elementwise", "softcap", special, 30.0, label=" 30 with inf/NaN"),
        twin("elementwise", "gelu_erf", special, label=" with inf/NaN"),
    ]
    for cpu in EMULATED:
        target = TARGETS[cpu]
        cases += [
            twin("elementwise", "layer_norm", odd, odd[0], odd[1], 1e-6, target, label=f" x[4,300] {cpu}"),
            twin("elementwise", "rope_norm", x3, theta, target, label=f" x[5,3,64] {cpu}"),
            twin("elementwise", "rope_norm", x40, theta_odd, target, label=f" x[5,3,40] {cpu}"),
            twin("elementwise", "rope_norm", x14, theta_7, target, label=f" x[5,3,14] {cpu}"),
            twin("elementwise", "rope_neox", x3, theta, target, label=f" x[5,3,64] {cpu}"),
            twin("elementwise", "rope_neox", x3, quarter, target, label=f" x[5,3,64] 32 dims rotated {cpu}"),
            twin("elementwise", "rope_2d", x3, quarter, quarter * F32(0.5), target, label=f" x[5,3,64] {cpu}"),
            twin("elementwise", "swiglu", 4 * odd, odd[::-1].copy(), target, label=f" x[4,300] {cpu}"),
            twin("elementwise", "soft_max", scores, visible, 0.125, target, label=f" x[9,300] masked rows {cpu}"),
            twin("elementwise", "soft_max", scores[:, :64], visible[:, :64], 1.0, target, label=f" x[9,64] {cpu}"),
            twin("libm", "v_expf", special, target.scalef, label=f" with inf/NaN {cpu}"),
            twin("libm", "v_silu", special, target.scalef, label=f" with inf/NaN {cpu}"),
            twin("libm", "silu_rows", 4 * odd[:, :37], target, label=f" x[4,37] {cpu}"),
        ]
    return cases


def attention_case(rng, fn, shape, *extra, path=""):  # -> TwinCase of a causal prefill chunk ending the cache
    T, S, H, Hkv, D = shape
    q, k, v = (rng.standard_normal(shape).astype(F32) for shape in ((T, H, D), (S, Hkv, D), (S, Hkv, D)))
    visible = ops.causal_visible(np.arange(S - T, S), np.arange(S), 0)
    if T > 1:
        visible[1] = False  # a query that sees no key
    return twin("attention", fn, q, k, v, visible, 1 / np.sqrt(D), *extra,
                label=f"{path} q[{T},{H},{D}] kv[{S},{Hkv}]")


def attention_cases(rng):
    cases = []
    for cpu in EMULATED:
        target = TARGETS[cpu]
        for shape in ((1, 40, 4, 2, 32), (5, 20, 3, 1, 64), (7, 7, 2, 2, 128), (3, 10, 2, 2, 40), (6, 9, 8, 1, 16)):
            cases += [attention_case(rng, "attention_mul_mat", shape, kv, target, path=f" {kv} {cpu}")
                      for kv in ("f16", "f32")]
        for path, shape in ((" one chunk", (1, 40, 4, 2, 32)), (" KV split", (1, 600, 2, 1, 64)),
                            (" one chunk", (5, 20, 3, 1, 40)), (" tiled", (70, 70, 2, 1, 32)),
                            (" tiled", (64, 300, 4, 2, 96))):
            cases.append(attention_case(rng, "attention_flash", shape, 2, target, path=f"{path} {cpu}"))
        for path, shape in (("", (1, 40, 4, 2, 32)), (" rotated", (5, 20, 3, 1, 64)),
                            (" rotated", (3, 30, 2, 2, 128))):
            cases.append(attention_case(rng, "attention_q8_0", shape, target, path=f"{path} {cpu}"))
    x = rng.standard_normal((5, 3, 128)).astype(F32)
    return cases + [twin("attention", "fwht", x, n, label=f" x[5,3,128] H_{n}") for n in (64, 128)]


def ggml_cases(seed=0):  # -> [TwinCase] of every kernel file
    rng = np.random.default_rng(seed)
    return (quantize_cases(rng) + int_dot_cases(rng) + float_dot_cases(rng) + elementwise_cases(rng)
            + attention_cases(rng))


def run_table(selected, seed):  # the ops to run, seed -> exit status; prints the table
    failed = 0
    print(f"{'op':11s} {'case':60s} {'differing':>9s} {'gate':>5s} {'max|diff|':>10s}  result")
    for case in ggml_cases(seed):
        if case.op not in selected:
            continue
        with np.errstate(all="ignore"):  # the planted inf/NaN inputs
            differing, worst, problem = compare(*case.run())
        failed += bool(problem)
        print(f"{case.op:11s} {case.name:60s} {differing:9d} {0:5d} {worst:10.2e}  "
              f"{'FAIL ' + problem if problem else 'ok'}")
    print(f"gate: 0 differing bits, max |diff| 0: {WHY}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0
