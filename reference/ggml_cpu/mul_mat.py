"""Which kernel a matmul takes (ggml_compute_forward_mul_mat and the CPU extra buffer types)."""
import sys

import numpy as np

from .blocks import DECODERS, decode
from .build import GgmlCpuError
from .float_dots import tinyblas, tinyblas_bf16, vec_dot_bf16, vec_dot_f16, vec_dot_f32
from .int_dots import k_repacked_rows, k_vec_dot, q0_lanes, q0_repacked, q5_1_vec_dot, tiled
from .int_dots import q2_k_vec_dot, wide_block_vec_dot
from .int_dots import iq1_vec_dot
from .quantize import quantize_q8_0, quantize_q8_k
from .rounding import F32, round_bf16, round_f16


FLOAT_KERNELS = {  # type -> (activation rounding, (tinyBLAS kernel, its K step), vec_dot kernel)
    "F32": (lambda x: x, (tinyblas, 16), vec_dot_f32),
    "F16": (round_f16, (tinyblas, 16), vec_dot_f16),
    "BF16": (round_bf16, (tinyblas_bf16, 32), vec_dot_bf16),
}


REPACKED = ("Q4_0", "IQ4_NL", "Q4_K", "Q2_K")  # repacked when the row count is a multiple of 8 (AVX512)
REPACK_GEMM_ELEMENTS = {"Q4_K": 64, "Q2_K": 128}  # elements per FMA step of the repacked gemm
TILED = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_XXS", "IQ2_S", "IQ3_XXS",  # tiled kernel from 8 rows
         "IQ2_XS", "IQ3_S", "IQ1_S", "IQ1_M")
TILED_MIN_ROWS = 8


def kernel_path(kind, n_rows, weights, name, repack=True):  # -> the name of the kernel a matmul of n_rows rows takes
    """"float", "k_repacked", "q0_repacked", "q0_lanes", "q5_1_vec_dot", "wide_block_vec_dot", "tiled",
    "q2_k_vec_dot", "iq1_vec_dot" or "k_vec_dot"; one decision for this emulation and its numba twin.
    repack: whether llama.cpp loaded the weights into its CPU_REPACK extra buffer (the default;
    llama-cpp-python's use_extra_bufts=False and the tools' --no-repack keep them in plain buffers)."""
    if kind in FLOAT_KERNELS:
        return "float"
    if kind not in DECODERS:
        raise GgmlCpuError(f"{name}: {kind} weights are not emulated")
    repacked = repack and kind in REPACKED and len(weights.raw(name)) % 8 == 0  # rows of blocks
    if kind in REPACK_GEMM_ELEMENTS and repacked:
        return "k_repacked"
    if kind in ("Q4_0", "IQ4_NL") and repacked:
        return "q0_repacked"
    if kind in ("Q8_0", "Q5_0", "Q4_0", "IQ4_NL"):
        return "q0_lanes"
    if kind in ("Q5_1", "Q4_1"):  # neither tinyBLAS nor the CPU repack takes them: vec_dot at every batch size
        return "q5_1_vec_dot"
    if kind in ("Q1_0", "Q2_0"):  # vec_dot at every batch size too (Q1_0 is repacked on ARM only)
        return "wide_block_vec_dot"
    if kind in TILED and n_rows >= TILED_MIN_ROWS:
        return "tiled"
    if kind == "Q2_K":
        return "q2_k_vec_dot"
    if kind in ("IQ1_S", "IQ1_M"):
        return "iq1_vec_dot"
    return "k_vec_dot"


def quant_paths(kernels):  # module of the kernels and quantizers -> {kernel path: (x, rows, type) -> [T, O]}
    """The call each path makes; the numba twin (accel/numba/ggml/mul_mat.py) passes its own module."""
    k = kernels
    return {
        "k_repacked": lambda x, w, kind: k_repacked(x, w, REPACK_GEMM_ELEMENTS[kind], k),
        "q0_repacked": lambda x, w, kind: k.q0_repacked(w, k.quantize_q8_0(x)),
        "q0_lanes": lambda x, w, kind: k.q0_lanes(w, k.quantize_q8_0(x), 2 if kind == "IQ4_NL" and len(x) == 1 else 1),
        "q5_1_vec_dot": lambda x, w, kind: k.q5_1_vec_dot(w, k.quantize_q8_0(x)),
        "wide_block_vec_dot": lambda x, w, kind: k.wide_block_vec_dot(w, k.quantize_q8_0(x),
                                                                      8 if kind == "Q1_0" else 1),
        "q2_k_vec_dot": lambda x, w, kind: k.q2_k_vec_dot(w, k.quantize_q8_k(x)),
        "tiled": lambda x, w, kind: k.tiled(w, k.quantize_q8_k(x)),
        "k_vec_dot": lambda x, w, kind: k.k_vec_dot(w, k.quantize_q8_k(x)),
        "iq1_vec_dot": lambda x, w, kind: k.iq1_vec_dot(w, k.quantize_q8_k(x), 8 if kind == "IQ1_M" else 1),
    }


def mul_mat(x, weights, name, cache, repack=True):  # x [T, K] f32 -> [T, O]; cache: dict for decoded weights
    kind = weights.type_name(name)
    path = kernel_path(kind, len(x), weights, name, repack)
    if name not in cache:
        cache[name] = weights.get(name, F32) if path == "float" else decode(weights, name)
    if path == "float":
        return float_mul_mat(FLOAT_KERNELS[kind][0](x), cache[name], kind)
    return QUANT_PATHS[path](x, cache[name], kind)


def float_mul_mat(x, w, kind):  # x [T, K] (already in the weight's type), w [O, K] f32 -> [T, O]
    """tinyBLAS when llamafile_sgemm takes it (2+ rows, O a multiple of 4, K of its vector step),
    else ggml_vec_dot_* row by row."""
    _, (batched, k_step), single = FLOAT_KERNELS[kind]
    if len(x) >= 2 and len(w) % 4 == 0 and w.shape[1] % k_step == 0:
        return batched(x, w)
    return single(w[None], x[:, None, :])


def k_repacked(x, w, gemm_elements, kernels):  # x [T, K] f32, Q4_K/Q2_K rows (repacked) -> [T, O]
    """Rows in groups of 4 take the gemm (activations through the 4x8 quantizer), the last T mod 4
    rows the gemv (activations through quantize_row_q8_K); kernels: the module of both."""
    n4 = len(x) - len(x) % 4
    parts = []
    if n4:
        parts.append(kernels.k_repacked_rows(w, kernels.quantize_q8_k(x[:n4], prefer_positive=True), gemm_elements))
    if n4 < len(x):
        parts.append(kernels.k_repacked_rows(w, kernels.quantize_q8_k(x[n4:]), 256))
    return np.concatenate(parts)


QUANT_PATHS = quant_paths(sys.modules[__name__])
