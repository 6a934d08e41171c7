"""The op harness, in the shape of llama.cpp's test-backend-ops: one table of op x type x shape on
seeded random inputs, each row with its gate and the gate's reason, run on every backend asked for.
A backend that cannot run a row refuses it in one line, counted as refused, never as passed.

    python -m accel.harness [--backend numba,numpy,cupy,cupy-emulated|all] [--numerics exact,ggml-cpu]
                            [-o|--ops linear,attention] [--seed 0]

prints one line per row and backend, the gates with their reasons, and exits 1 if any row fails
(-o is test-backend-ops' op flag; its -b is the batch size in llama.cpp's other tools, so no -b).
tests/test_numba.py, test_numba_ggml.py and test_cuda.py run the same rows through `check`.

Two kinds of row. Exact rows (`--numerics exact`, the default) compare a backend's op against
reference/ops.py by NMSE (sum((ref - x)^2) / sum(ref^2), test-backend-ops' convention) under a
gate per op, plus a NaN/inf check; numpy, numba, cupy and cupy-emulated (the CUDA kernels
compiled for the CPU, accel/cupy/emulated.py) run them; the two cupys have no float64 kernels and
refuse those rows. ggml-cpu rows (`--numerics ggml-cpu`) compare each accel/numba/ggml kernel
against its twin of the same name in reference/ggml_cpu, which is their reference as
reference/ops.py is the exact rows': numba runs them; numpy, whose kernels those are, refuses them.

Thresholds. The backend computes on the same float32 activations and the same exactly dequantized
weights as the reference. Norms and attention keep every sum the reference keeps in float64 in
float64: what may differ is the order of float64 additions, and libm's exp/tanh/erf against numpy's
vectorized ones. Either moves a float32 output by at most about one unit in the last place, and an
NMSE made of one-ulp differences is at most (2^-24)^2 = 3.6e-15 however many outputs move. Products
sum in float32 within a 256-value super-block (the GEMM of a prefill: within 256 columns) and in
float64 across them: a float32 sum of k products carries an error of about sqrt(k) 2^-24
relative to sum |w x| (k 2^-24 at worst), which on these random inputs is an NMSE of about
k 2^-48 = 9.1e-13 for k = 256 (measured: up to 9.1e-14 from the GEMM, which sums an output's 256
products in one chain of FMAs, up to 7.0e-14 from the row kernels), and far less in practice (random-walk cancellation; a row whose sum cancels can show more). The gates
sit above that (so a changed summation order never fails) and far below any real bug, which shows at
1e-6 and up; ggml's 5e-4 for products comes from quantizing the activations, which neither side does.

The ggml-cpu rows' gate is 0: each twin does the same float32 operations in the same order as its
NumPy statement (integer sums are exact in any order), so the outputs must agree in every bit
(compared as uint32 patterns, NaNs included), and a difference of one ulp anywhere is a bug, not
noise. Their inputs plant the edge cases (zero blocks, ties, rows that see no key, odd lengths and
head counts, head sizes 32/40/64/96/128). The integer kernels are reached through reference
mul_mat's kernel choice (`kernel_path`): each quantized type, batch rows 1, 3, 4, 8, 10 and repack
on/off, the reference's QuantRows against the numba layout (GroupRows or KernelRows) its mul_mat
decodes them into.
"""
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter

from reference import ops
from reference.cli import OneLineParser, fail, flag, int_in, names_in
from reference.ggml_cpu.blocks import DECODERS, decode
from reference.ggml_cpu.build import GgmlCpuError
from reference.ggml_cpu.mul_mat import QUANT_PATHS, TILED_MIN_ROWS, kernel_path
from reference.ggml_cpu.rounding import round_bf16, round_f16
from reference.ggml_cpu.target import AVX512, TARGETS
from reference.gguf import GgmlType, Weights, open_reader, write_out
from reference.random_blocks import F16_SCALE_OFFSETS, random_weights
from reference.metrics import max_abs_diff, nmse

GGML_OPS = ("quantize", "int_dots", "float_dots", "elementwise", "libm", "attention")  # the ggml kernel files of the ggml-cpu rows

# Gates per op, with why. One-ulp noise is <= 3.6e-15 (see above).
GATES = {
    "linear": (1e-11, "exact weights, float32 sums within a super-block or the GEMM's 256 columns "
                      "(<= 256 terms: <= 9.1e-13), float64 across: measured <= 9.1e-14 (float32)"),
    "attention": (1e-12, "scores, softmax and sum of V in float64 on both sides, one rounding"),
    "rms_norm": (1e-13, "float32 squares summed in float64 (order differs), mean rounded once"),
    "layer_norm": (1e-13, "float64 mean and variance (order differs), rounded once"),
    "rope": (1e-13, "numpy's cos/sin on both sides, the same float32 operations: expect 0"),
    "activation": (1e-12, "libm exp/tanh/erf against numpy's vectorized ones: <= 2 ulp per value, "
                          "measured <= 2.6e-15"),
}

# The quantized types are those whose f16 scale offsets reference.random_blocks knows: random blocks with
# finite scales planted there are valid blocks.
LINEAR_TYPES = (GT.F32, GT.F16, GT.BF16) + tuple(F16_SCALE_OFFSETS) + (GT.IQ1_M,)


F32 = np.float32
TWIN_GATE = (0, "the same float32 operations in the same order (integer sums exact in any order): every bit equal")
NUMERICS = ("exact", "ggml-cpu")
BACKENDS = ("numpy", "numba", "cupy", "cupy-emulated")  # --backend all; cupy-emulated: accel/cupy/emulated.py


@dataclass
class Row:
    op: str  # an exact op (GATES), or the ggml kernel file both twins live in
    name: str  # its type and shape
    dtype: str
    numerics: str  # "exact": against reference/ops.py under GATES[op]; "ggml-cpu": against its reference/ggml_cpu twin
    run: object  # backend -> (reference output, backend output); a ggml-cpu row's are lists of arrays

    @property
    def gate(self):  # -> (bound, why)
        return GATES[self.op] if self.numerics == "exact" else TWIN_GATE


class TensorFile:
    """Random weight tensors written to a small GGUF and read back through reference.gguf.Weights,
    so the backend sees them exactly as it sees a model's: memory-mapped raw blocks."""

    def __init__(self, specs, rng):  # specs: [(name, qtype, n_out, n_in)]
        self.dir = tempfile.TemporaryDirectory()
        path = os.path.join(self.dir.name, "weights.gguf")
        w = GGUFWriter(path, "harness")
        for name, qtype, n_out, n_in in specs:
            data = random_weights(qtype, n_out, n_in, rng)
            w.add_tensor(name, data, raw_dtype=qtype)  # raw blocks: the shape follows from the row bytes
        write_out(w)
        self.weights = Weights(open_reader(path), path)


# ---------------------------------------------------------------------------------------------
# The cases

# (rows of x, n_out, n_in): decode, a short batch (both take the row-by-row path), and a prefill
# batch (the GEMM) with tokens left over from its blocks of 12 (AVX-512; 6 with AVX2) and rows
# left over from its bands of 32 float32 / 16 float64 rows (16 / 8 with AVX2), three 256-column steps
LINEAR_SHAPES = ((1, 64, 512), (2, 48, 768), (37, 70, 768))


def linear_cases(rng):
    specs = [(f"{t.name}.{i}", t, n_out, n_in)
             for t in LINEAR_TYPES for i, (_, n_out, n_in) in enumerate(LINEAR_SHAPES)]
    specs += [("F32.odd", GT.F32, 20, 588), ("F16.odd", GT.F16, 20, 588)]  # a row that is no multiple of 256
    tensors = TensorFile(specs, rng)
    cases = []
    for name, qtype, n_out, n_in in specs:
        T = LINEAR_SHAPES[int(name.split(".")[1])][0] if name[-1].isdigit() else 5
        for dtype in (np.float32, np.float64) if qtype in (GT.Q4_K, GT.IQ2_XXS, GT.F16) else (np.float32,):
            x = rng.standard_normal((T, n_in)).astype(dtype)
            cases.append(Row("linear", f"{qtype.name} x[{T},{n_in}] w[{n_out},{n_in}]", np.dtype(dtype).name, "exact",
                             lambda be, x=x, name=name: (ops.linear(x, tensors.weights.get(name, np.float64)),
                                                         be.linear(x, tensors.weights.tensor(name)))))
    return cases


def attention_inputs(rng, T, S, H, Hkv, D, dtype):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    k = rng.standard_normal((S, Hkv, D)).astype(dtype)
    v = rng.standard_normal((S, Hkv, D)).astype(dtype)
    return q, k, v


def window_visible(n, window):  # the vision tower's window attention: full attention inside each window
    ids = np.arange(n) // window
    return ids[:, None] == ids[None, :]


def attention_cases(rng):
    ring_pos = np.array([16, 17, 18, 19, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, -1])  # slots pos % 16, two empty
    setups = [  # name, (T, S, H, Hkv, D), visible
        ("decode, uniform cache", (1, 40, 4, 2, 32), ops.causal_visible([39], np.arange(40), 0)),
        ("prefill, causal GQA 8/1", (24, 24, 8, 1, 16), ops.causal_visible(np.arange(24), np.arange(24), 0)),
        ("prefill chunk, SWA ring", (4, 18, 4, 2, 32), ops.causal_visible(np.arange(16, 20), ring_pos, 8)),
        ("vision windows of 16", (64, 64, 2, 2, 32), window_visible(64, 16)),
        ("a query with no key", (2, 6, 2, 1, 8), np.array([[True] * 6, [False] * 6])),
        # 42 query rows per kv head: the blocked route (attention.ROW_BLOCK), edges in rows and keys;
        # query t sees keys s < t % 11, so queries 0 and 11 see none
        ("blocks, queries with no key", (21, 11, 4, 2, 8), np.arange(11)[None, :] < np.arange(21)[:, None] % 11),
    ]
    cases = []
    for name, (T, S, H, Hkv, D), visible in setups:
        for dtype in (np.float32, np.float64):
            q, k, v = attention_inputs(rng, T, S, H, Hkv, D, dtype)
            scale = 1.0 / np.sqrt(D)
            cases.append(Row("attention", f"{name} q[{T},{H},{D}] kv[{S},{Hkv}]", np.dtype(dtype).name, "exact",
                             lambda be, a=(q, k, v, visible, scale): (ops.attention(*a), be.attention(*a))))
    return cases


def pointwise_table(rng, dtype):  # -> [(op, case name, reference fn, backend fn)] on inputs of one dtype
    def arr(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dtype)
    x3, x2 = arr(5, 4, 64), arr(7, 6656, scale=3.0)
    w, b = arr(64), arr(64)
    theta = ops.rope_angles(np.arange(100, 105), 64, 10000.0, dtype)
    theta_a = ops.rope_angles(np.arange(5) % 3 + 1, 32, 10000.0, dtype)  # vision: column and row angles
    theta_b = ops.rope_angles(np.arange(5) // 3 + 1, 32, 10000.0, dtype)
    gate, up, z = arr(6, 300, scale=4.0), arr(6, 300), arr(3, 512, scale=40.0)
    return [
        ("rms_norm", "x[7,6656]", lambda: ops.rms_norm(x2, 1e-5), lambda be: be.rms_norm(x2, 1e-5)),
        ("rms_norm", "per head x[5,4,64]", lambda: ops.rms_norm(x3, 1e-6), lambda be: be.rms_norm(x3, 1e-6)),
        ("layer_norm", "x[5,4,64]", lambda: ops.layer_norm(x3, w, b, 1e-6), lambda be: be.layer_norm(x3, w, b, 1e-6)),
        ("rope", "norm x[5,4,64]", lambda: ops.rope_norm(x3, theta), lambda be: be.rope_norm(x3, theta)),
        ("rope", "neox x[5,4,64]", lambda: ops.rope_neox(x3, theta), lambda be: be.rope_neox(x3, theta)),
        ("rope", "2d x[5,4,64]", lambda: ops.rope_2d(x3, theta_a, theta_b),
         lambda be: be.rope_2d(x3, theta_a, theta_b)),
        ("activation", "sigmoid x[6,300]", lambda: ops.sigmoid(gate), lambda be: be.sigmoid(gate)),
        ("activation", "swiglu x[6,300]", lambda: ops.swiglu(gate, up), lambda be: be.swiglu(gate, up)),
        ("activation", "softcap 30 z[3,512]", lambda: ops.softcap(z, 30.0), lambda be: be.softcap(z, 30.0)),
        ("activation", "gelu_erf x[6,300]", lambda: ops.gelu_erf(gate), lambda be: be.gelu_erf(gate)),
    ]


def pointwise_cases(rng):
    return [Row(op, name, np.dtype(dtype).name, "exact", lambda be, ref=ref, run=run: (ref(), run(be)))
            for dtype in (np.float32, np.float64) for op, name, ref, run in pointwise_table(rng, dtype)]


def all_cases(seed=0):  # -> [Row] of the exact ops
    rng = np.random.default_rng(seed)
    return linear_cases(rng) + attention_cases(rng) + pointwise_cases(rng)

# ---------------------------------------------------------------------------------------------
# The ggml-cpu rows: accel/numba/ggml's kernels against their reference/ggml_cpu twins

SCALE_OFFSETS = {**F16_SCALE_OFFSETS, GT.Q1_0: (0,), GgmlType.Q2_0: (0,)}  # f16 d (and m) of each block; IQ1_M: its own


def emulated():  # -> the CPU targets the numba float kernels take (importing them needs numba)
    from accel.numba.ggml.quantize import NUMBA_TARGETS
    return list(NUMBA_TARGETS)


def outputs(result):  # a kernel's result -> [arrays]: QuantActs fields, a tuple's items, or the array
    if hasattr(result, "bsums"):
        return [a for a in (result.d, result.q, result.s, result.bsums) if a is not None]
    return [np.asarray(a) for a in result] if isinstance(result, tuple) else [np.asarray(result)]


def twin(module, fn, *args, label="", reference_module=None):  # -> Row: reference module.fn(*args) against accel's
    ref = importlib.import_module(f"reference.ggml_cpu.{reference_module or module}")
    numba_twin = importlib.import_module(f"accel.numba.ggml.{module}")
    return Row(module, fn + label, "float32", "ggml-cpu", lambda be: (outputs(getattr(ref, fn)(*args)),
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
                run = (lambda be, x=x, path=path, kind=kind, rows=rows, kernel_rows=kernel_rows:
                       ([QUANT_PATHS[path](x, kind, AVX512)(rows)],
                        [numba_mul_mat.QUANT_PATHS[path](x, kind, AVX512)(kernel_rows)]))
                cases.append(Row("int_dots", f"{path} {kind} x[{n_rows},512] repack {'on' if repack else 'off'}",
                                 "float32", "ggml-cpu", run))
    return cases


def float_dot_cases(rng):
    cases = []
    for n in (64, 256, 300, 72, 13):  # whole 64-steps, tails of 16 + 8, of 8, of < 8
        x, y = rng.standard_normal((5, 1, n)).astype(F32), rng.standard_normal((1, 4, n)).astype(F32)
        for cpu in emulated():
            cases += [twin("float_dots", "vec_dot_f32", x, y, TARGETS[cpu], label=f" [5,4,{n}] {cpu}"),
                      twin("float_dots", "vec_dot_f16", round_f16(x), round_f16(y), TARGETS[cpu],
                           label=f" [5,4,{n}] {cpu}"),
                      twin("float_dots", "vec_dot_bf16", round_bf16(x), round_bf16(y), TARGETS[cpu],
                           label=f" [5,4,{n}] {cpu}")]
    x, w = rng.standard_normal((7, 256)).astype(F32), rng.standard_normal((12, 256)).astype(F32)
    cases += [twin("float_dots", "tinyblas", x, w, TARGETS[cpu], label=f" x[7,256] w[12,256] {cpu}")
              for cpu in emulated()]
    cases.append(twin("float_dots", "tinyblas_bf16", round_bf16(x), round_bf16(w), label=" x[7,256] w[12,256]"))
    for T, O in ((1, 12), (3, 12), (3, 10)):  # vec_dot rows, tinyBLAS, vec_dot for O not a multiple of 4
        for kind, rounding in (("F32", np.asarray), ("F16", round_f16), ("BF16", round_bf16)):
            cases += [twin("float_dots", "float_mul_mat", rounding(x[:T]), rounding(w[:O]), kind, TARGETS[cpu],
                           label=f" {kind} x[{T},256] w[{O},256] {cpu}", reference_module="mul_mat")
                      for cpu in emulated()]
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
    for cpu in emulated():
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


def ggml_attention_case(rng, fn, shape, *extra, path=""):  # -> Row of a causal prefill chunk ending the cache
    T, S, H, Hkv, D = shape
    q, k, v = (rng.standard_normal(shape).astype(F32) for shape in ((T, H, D), (S, Hkv, D), (S, Hkv, D)))
    visible = ops.causal_visible(np.arange(S - T, S), np.arange(S), 0)
    if T > 1:
        visible[1] = False  # a query that sees no key
    return twin("attention", fn, q, k, v, visible, 1 / np.sqrt(D), *extra,
                label=f"{path} q[{T},{H},{D}] kv[{S},{Hkv}]")


def ggml_attention_cases(rng):
    cases = []
    for cpu in emulated():
        target = TARGETS[cpu]
        for shape in ((1, 40, 4, 2, 32), (5, 20, 3, 1, 64), (7, 7, 2, 2, 128), (3, 10, 2, 2, 40), (6, 9, 8, 1, 16)):
            cases += [ggml_attention_case(rng, "attention_mul_mat", shape, kv, target, path=f" {kv} {cpu}")
                      for kv in ("f16", "f32")]
        for path, shape in ((" one chunk", (1, 40, 4, 2, 32)), (" KV split", (1, 600, 2, 1, 64)),
                            (" one chunk", (5, 20, 3, 1, 40)), (" tiled", (70, 70, 2, 1, 32)),
                            (" tiled", (64, 300, 4, 2, 96))):
            cases.append(ggml_attention_case(rng, "attention_flash", shape, 2, target, path=f"{path} {cpu}"))
        for path, shape in (("", (1, 40, 4, 2, 32)), (" rotated", (5, 20, 3, 1, 64)),
                            (" rotated", (3, 30, 2, 2, 128))):
            cases.append(ggml_attention_case(rng, "attention_q8_0", shape, target, path=f"{path} {cpu}"))
    x = rng.standard_normal((5, 3, 128)).astype(F32)
    return cases + [twin("attention", "fwht", x, n, label=f" x[5,3,128] H_{n}") for n in (64, 128)]


def ggml_cases(seed=0):  # -> [Row] of every ggml kernel file
    rng = np.random.default_rng(seed)
    return (quantize_cases(rng) + int_dot_cases(rng) + float_dot_cases(rng) + elementwise_cases(rng)
            + ggml_attention_cases(rng))


# ---------------------------------------------------------------------------------------------
# Checking

def finite_mismatch(ref, got):  # -> description of the first NaN/inf disagreement, or ""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"shape/dtype {got.shape} {got.dtype}, expected {ref.shape} {ref.dtype}"
    if np.isnan(got).any() and not np.isnan(ref).any():
        return "NaN in the backend's output"
    ref_inf, got_inf = np.isinf(ref), np.isinf(got)
    if (ref_inf != got_inf).any() or (ref[ref_inf] != got[got_inf]).any():
        return "inf where the reference has none (or of the other sign)"
    return ""


def check(row, backend=None):  # -> (error, max |diff|, gate, problem or ""); error: NMSE, or differing elements
    gate = row.gate[0]
    with np.errstate(all="ignore"):  # the ggml-cpu rows' planted inf/NaN inputs
        ref, got = row.run(backend)
    if row.numerics == "ggml-cpu":
        differing, worst, problem = compare(ref, got)
        return differing, worst, gate, problem
    problem = finite_mismatch(ref, got)
    if problem:
        return float("nan"), float("nan"), gate, problem
    finite = np.isfinite(ref)
    err = float(nmse(ref[finite].ravel(), got[finite].ravel()))
    diff = float(max_abs_diff(ref[finite].ravel(), got[finite].ravel())) if finite.any() else 0.0
    return err, diff, gate, "" if err <= gate else f"NMSE {err:.3g} > {gate:g}"


def table_rows(numerics, ops, seed):  # -> [Row] of those numerics and ops (a ggml-cpu table needs numba)
    rows = all_cases(seed) if numerics == "exact" else ggml_cases(seed)
    return [row for row in rows if row.op in ops]


def make_backend(name, numerics):  # -> (backend or None, refusal or ""): what runs a table's rows
    if numerics == "ggml-cpu":
        if name != "numba":
            return None, ("its ggml-cpu kernels are these rows' reference" if name == "numpy"
                          else "--numerics ggml-cpu compares the numba ggml kernels")
        try:
            importlib.import_module("accel.numba.ggml")
        except ImportError as e:
            return None, f"--numerics ggml-cpu needs numba ({e}); install the accel extra"
        return None, ""  # the twins are module functions: the row names them
    if name == "cupy-emulated":  # the CUDA kernels compiled for the CPU (g++, Linux)
        from accel.cupy.emulated import emulated_backend
        try:
            return emulated_backend(), ""
        except RuntimeError as e:
            return None, str(e)
    from reference import factory
    try:
        return factory.backend(factory.Build(backend=name)), ""
    except factory.FactoryError as e:
        return None, str(e)


def run_table(name, numerics, ops, seed):  # -> (rows run, failed, rows refused, table refused); one line a row
    backend, refusal = make_backend(name, numerics)
    if refusal:
        print(f"{name} {numerics}: refused, every row: {refusal}")
        return 0, 0, 0, 1
    dtypes = getattr(backend, "dtypes", ("float32", "float64"))  # cupy computes in float32 only
    rows, failed, refused = table_rows(numerics, ops, seed), 0, 0
    print(f"{'backend':13s} {'op':11s} {'case':60s} {'dtype':7s} {'error':>9s} {'gate':>7s} {'max|diff|':>10s}  result")
    for row in rows:
        head = f"{name:13s} {row.op:11s} {row.name:60s} {row.dtype:7s}"
        if row.dtype not in dtypes:
            refused += 1
            print(f"{head} {'':>9s} {'':>7s} {'':>10s}  refused: {name} has no {row.dtype} kernels")
            continue
        err, diff, gate, problem = check(row, backend)
        failed += bool(problem)
        print(f"{head} {err:9.2e} {gate:7.0e} {diff:10.2e}  {'FAIL ' + problem if problem else 'ok'}")
    for bound, why in dict.fromkeys(row.gate for row in rows):
        ops_of = sorted({row.op for row in rows if row.gate == (bound, why)})
        print(f"gate {','.join(ops_of)}: {'NMSE' if numerics == 'exact' else 'differing elements'} <= {bound:g}: {why}")
    return len(rows) - refused, failed, refused, 0


def main(argv=None):
    p = OneLineParser(prog="python -m accel.harness", description=__doc__)
    p.add_argument("--backend", type=names_in(BACKENDS + ("all",), "backend"), default=["numba"],
                   help="comma-separated backends checked against the reference (all: " + ",".join(BACKENDS) + ")")
    p.add_argument("--numerics", type=names_in(NUMERICS, "numerics"), default=["exact"],
                   help="comma-separated row kinds: exact (ops against reference/ops.py), ggml-cpu (the numba "
                        "ggml kernels against their reference/ggml_cpu twins)")
    p.add_argument("-o", "--ops", type=names_in(tuple(GATES) + GGML_OPS, "op"), default=None,
                   help="comma-separated ops to run (default: all): " + ",".join(GATES)
                   + "; with --numerics ggml-cpu the kernel files " + ",".join(GGML_OPS))
    flag(p, "seed", type=int_in(0, 2**63 - 1), default=0, help="the random inputs' numpy seed")
    args = p.parse_args(argv)
    backends = BACKENDS if "all" in args.backend else args.backend
    table_ops = {"exact": tuple(GATES), "ggml-cpu": GGML_OPS}
    ops = args.ops or [op for numerics in args.numerics for op in table_ops[numerics]]
    unknown = ", ".join(sorted(set(ops) - {op for numerics in args.numerics for op in table_ops[numerics]}))
    if unknown and args.numerics == ["ggml-cpu"]:
        return fail("accel.harness", f"{unknown}: not a ggml-cpu kernel file ({', '.join(GGML_OPS)})")
    if unknown:
        return fail("accel.harness", f"{unknown}: ggml-cpu kernel files, for --numerics ggml-cpu")
    if args.numerics == ["ggml-cpu"] and backends == ["numpy"]:  # the one table asked for is numpy's own
        return fail("accel.harness", "--numerics ggml-cpu compares the numba ggml kernels, not --backend numpy")
    totals = [run_table(name, numerics, ops, args.seed) for numerics in args.numerics for name in backends]
    ran, failed, refused, tables_refused = (sum(column) for column in zip(*totals))
    print(f"{ran} rows run" + (f", {refused} rows refused" if refused else "")
          + (f", every row refused by {tables_refused} backend(s)" if tables_refused else "") + ": "
          + (f"{failed} failed" if failed else "all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
