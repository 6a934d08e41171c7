"""reference/ggml_cpu/mul_mat.py's dispatch onto the numba kernels: the same kernel for the same
weight type, batch rows and repacking; float weights (F32/F16/BF16) through the numba tinyBLAS and
vec_dot twins."""
import sys

import numpy as np

from reference.ggml_cpu.blocks import decode_rows
from reference.ggml_cpu.mul_mat import bounded_mul_mat, float_weight_mul_mat, kernel_path, quant_paths

from . import float_dots, int_dots
from .blocks import DECODERS
from .quantize import quantize_q8_0, quantize_q8_k

F32 = np.float32
NONE_INT, NONE_F32 = np.zeros((0, 0, 0), np.int8), np.zeros((0, 0), F32)


class KernelRows:
    """A decoded QuantRows with every field as a contiguous array the kernels take (empty when absent)."""

    def __init__(self, w):
        # each value times its sub-block's scale (int16, |v * s| <= 127 * 63), which the K-quant and IQ
        # kernels read in place of the int8 values; types without scales keep the values themselves
        self.vs = np.ascontiguousarray(w.values) if w.scales is None else np.ascontiguousarray(
            w.values.astype(np.int16) * np.repeat(w.scales, w.sub, axis=-1).astype(np.int16))
        self.d = np.ascontiguousarray(w.d, F32)
        self.scales = NONE_INT if w.scales is None else np.ascontiguousarray(w.scales)
        self.mins = NONE_INT if w.mins is None else np.ascontiguousarray(w.mins)
        self.dmin = NONE_F32 if w.dmin is None else np.ascontiguousarray(w.dmin, F32)
        self.m = NONE_F32 if w.m is None else np.ascontiguousarray(w.m, F32)
        self.d0 = (self.d * F32(w.post)).astype(F32)  # the tiled kernel's d times the IQ power of two
        self.sub, self.post, self.offset, self.min_lanes = w.sub, F32(w.post), w.unsigned_offset, w.min_lanes


def q0_repacked(w, a):  # KernelRows (Q4_0/IQ4_NL, repacked), Q8_0 acts -> [T, O]
    return int_dots.q0_repacked(w.vs, w.d, a.q, a.d)


def q0_lanes(w, a, accumulators):  # KernelRows (32-blocks), Q8_0 acts -> [T, O]
    return int_dots.q0_lanes(w.vs, w.d, a.q, a.d, accumulators)


def q5_1_vec_dot(w, a):  # KernelRows (Q5_1), Q8_1 acts -> [T, O]
    return int_dots.q5_1_vec_dot(w.vs, w.d, w.m, a.q, a.d, a.s)


def sub_block_sums(a, width):  # Q8_K acts -> int32 [T, nb, 256/width]: the activation sums of each sub-block
    return np.ascontiguousarray(a.bsums.reshape(a.bsums.shape[:2] + (-1, width // 16)).sum(-1), np.int32)


def tiled(w, a):  # KernelRows, Q8_K acts -> [T, O]
    q16 = a.q.astype(np.int16)  # widened once here, not in the kernel's loop
    return int_dots.tiled(w.vs, w.offset, w.scales, w.d0, w.dmin, w.mins, q16, a.d, sub_block_sums(a, w.sub))


def k_vec_dot(w, a):  # KernelRows, Q8_K acts -> [T, O]
    return int_dots.k_vec_dot(w.vs, w.offset, w.scales, w.d, w.dmin, w.mins, w.min_lanes, w.post, a.q, a.d, a.bsums,
                              sub_block_sums(a, 32))


def k_repacked_rows(w, a, elements_per_fma):  # KernelRows (Q4_K/Q2_K), Q8_K acts -> [T, O]
    return int_dots.k_repacked_rows(w.vs, w.d, w.dmin, w.mins, a.q, a.d, sub_block_sums(a, w.sub), elements_per_fma)


def mul_mat(x, weights, name, cache, repack=True, cache_bytes=None):  # x [T, K] f32 -> [T, O] on the numba kernels
    kind = weights.type_name(name)
    path = kernel_path(kind, len(x), weights, name, repack)
    if path == "float":
        return float_weight_mul_mat(x, weights, name, cache, float_dots.float_mul_mat)
    return bounded_mul_mat(len(weights.raw(name)), name, cache, cache_bytes,
                           lambda start, stop: KernelRows(decode_rows(weights, name, start, stop, DECODERS)),
                           lambda rows: QUANT_PATHS[path](x, rows, kind))


QUANT_PATHS = quant_paths(sys.modules[__name__])


def wide_block_vec_dot(w, a, lanes):  # KernelRows (Q1_0/Q2_0), Q8_0 acts -> [T, O]
    return int_dots.wide_block_vec_dot(w.vs, w.d, a.q, a.d, lanes)


def q2_k_vec_dot(w, a):  # KernelRows (Q2_K), Q8_K acts -> [T, O]
    return int_dots.q2_k_vec_dot(w.vs, w.d, w.dmin, w.mins, a.q, a.d, a.bsums)


def iq1_vec_dot(w, a, delta_lanes):  # KernelRows (IQ1_S/IQ1_M), Q8_K acts -> [T, O]
    return int_dots.iq1_vec_dot(w.vs, w.scales, w.sub, w.d, a.q, a.d, delta_lanes)
