"""reference/ggml_cpu/mul_mat.py's dispatch onto the numba kernels: the same kernel for the same
weight type, batch rows and repacking; float weights (F32/F16/BF16) through the numba tinyBLAS and
vec_dot twins."""
import numba
import numpy as np

from reference.ggml_cpu.blocks import decode_rows
from reference.ggml_cpu.build import GgmlCpuError
from reference.ggml_cpu.mul_mat import (TILED_MIN_ROWS, QuantKernels, bounded_mul_mat, float_weight_mul_mat, kernel_path,
                                        quant_paths)
from reference.ggml_cpu.target import AVX512

from . import block_dots, float_dots, int_dots
from .blocks import DECODERS
from .quantize import quantize_q8_0, quantize_q8_k, x86_only

F32 = np.float32
NONE_INT, NONE_F32 = np.zeros((0, 0, 0), np.int8), np.zeros((0, 0), F32)
NONE_1D = np.zeros(0, np.int32)
GROUP = int_dots.GROUP


class KernelRows:
    """A decoded QuantRows with every field as a contiguous array the kernels take (empty when absent)."""

    def __init__(self, w):
        # each value times its sub-block's scale (int16, |v * s| <= 127 * 63), which the Q2_K and IQ1
        # kernels read in place of the int8 values; types without scales keep the values themselves
        self.vs = np.ascontiguousarray(w.values) if w.scales is None else np.ascontiguousarray(
            w.values.astype(np.int16) * np.repeat(w.scales, w.sub, axis=-1).astype(np.int16))
        self.d = np.ascontiguousarray(w.d, F32)
        self.scales = NONE_INT if w.scales is None else np.ascontiguousarray(w.scales)
        self.mins = NONE_INT if w.mins is None else np.ascontiguousarray(w.mins)
        self.dmin = NONE_F32 if w.dmin is None else np.ascontiguousarray(w.dmin, F32)
        self.m = NONE_F32 if w.m is None else np.ascontiguousarray(w.m, F32)
        self.d0 = (self.d * F32(w.post)).astype(F32)  # the tiled kernel's d times the IQ power of two
        self.sub = w.sub


class GroupRows:
    """A K-quant/IQ/ternary QuantRows for the int_dots.group_* kernels: rows side by side GROUP at a
    time (the last group padded with zero rows), each field [G, nb, ..., GROUP]. codes [G, nb, 64,
    GROUP, 4] int8 are QuantRows' values in 4-element chunks (all within -127..127); scales and mins
    int8 per sub-block. vpdpbusd multiplies unsigned by signed bytes: types with mins or an unsigned
    offset have codes >= 0 and take the Q8_K codes as they are; the others take them plus 128
    (biased), and lane_bias [G, nb, 8, GROUP] int32 = 128 * sum(scale * code) over each k_vec_dot lane
    takes that bias off again (1-D when unused). 1.0-1.2 bytes per weight where KernelRows take 2."""
    group = GROUP  # weight rows per entry of the first axis (decode_whole reads it)

    def __init__(self, w):
        O, nb, _ = w.values.shape
        self.rows = O
        G, n_sub = -(-O // GROUP), w.scales.shape[-1]
        if w.unsigned_offset and n_sub != 16:  # group_vec_dot_block takes the offset per pair of 16-groups
            raise GgmlCpuError(f"an unsigned offset with {n_sub} sub-blocks a block")
        self.biased = w.mins is None and not w.unsigned_offset
        self.codes = np.zeros((G, nb, 64, GROUP, 4), np.int8)
        self.scales = np.zeros((G, nb, n_sub, GROUP), np.int8)
        lane_bias = np.zeros((G, nb, 8, GROUP), np.int32)
        group_codes(np.ascontiguousarray(w.values), np.ascontiguousarray(w.scales), self.codes, self.scales, lane_bias)
        self.lane_bias = lane_bias if self.biased else NONE_1D
        self.d, self.d0 = grouped(w.d, F32), grouped(w.d * F32(w.post), F32)
        # an absent field is 1-D: its number of dimensions tells the kernels' code at compile time
        self.dmin = NONE_1D.astype(F32) if w.dmin is None else grouped(w.dmin, F32)
        self.mins = NONE_1D.astype(np.int8) if w.mins is None else grouped(w.mins, np.int8)
        self.sub, self.post, self.offset, self.min_lanes = w.sub, F32(w.post), np.int32(w.unsigned_offset), w.min_lanes


@numba.njit(cache=True, parallel=True)
def group_codes(values, scales, codes, grouped_scales, lane_bias):  # fills GroupRows' codes, scales and lane_bias
    """values [O, nb, 256], scales [O, nb, nsub] (integers within int8); rows past O stay zero. A
    group's block (4 KB of codes) is filled row by row while it stays in the L1 cache."""
    O, nb, _ = values.shape
    chunks_per_sub = 64 // scales.shape[2]
    for g in numba.prange(codes.shape[0]):
        lanes = np.zeros(8, np.int32)
        for b in range(nb):
            for r in range(min(GROUP, O - g * GROUP)):
                o = g * GROUP + r
                grouped_scales[g, b, :, r] = scales[o, b]
                lanes[:] = 0
                for c in range(64):
                    total = np.int32(0)
                    for i in range(4):
                        codes[g, b, c, r, i] = values[o, b, 4 * c + i]
                        total += np.int32(values[o, b, 4 * c + i])
                    lanes[c % 8] += total * np.int32(scales[o, b, c // chunks_per_sub])
                lane_bias[g, b, :, r] = 128 * lanes


def grouped(a, dtype):  # [O, nb, ...] -> [ceil(O / GROUP), nb, ..., GROUP] of dtype, zero rows padding the last group
    padded = np.zeros((-(-len(a) // GROUP) * GROUP,) + a.shape[1:], dtype)
    padded[:len(a)] = a
    return np.ascontiguousarray(np.moveaxis(padded.reshape((-1, GROUP) + a.shape[1:]), 1, -1))


UNGROUPED = ("Q2_K", "IQ1_S", "IQ1_M")  # their own vec_dots read KernelRows, so their tiled kernel does too


def kernel_rows(w, kind, paths):  # QuantRows, its type, the kernel paths it takes -> GroupRows or KernelRows
    # k_repacked among the grouped types: Q4_K in the CPU repack
    in_groups = kind not in UNGROUPED and set(paths) <= {"tiled", "k_vec_dot", "k_repacked"}
    return GroupRows(w) if in_groups else KernelRows(w)


def group_acts(w, a):  # GroupRows, Q8_K acts -> [T, nb, 256]: q + 128 as uint8 for biased codes, else q
    if w.biased:  # vpdpbusd's unsigned operand
        return np.ascontiguousarray((a.q.astype(np.int16) + 128).astype(np.uint8))
    return np.ascontiguousarray(a.q)


def q0_repacked(w, a):  # KernelRows (Q4_0/IQ4_NL, repacked), Q8_0 acts -> [T, O]
    return int_dots.q0_repacked(w.vs, w.d, a.q, a.d)


def q0_lanes(w, a, accumulators, target):  # KernelRows (32-blocks), Q8_0 acts, an x86 Target -> [T, O]
    x86_only(target)
    return int_dots.q0_lanes(w.vs, w.d, a.q, a.d, accumulators)



def q5_1_vec_dot(w, a):  # KernelRows (Q5_1), Q8_1 acts -> [T, O]
    return int_dots.q5_1_vec_dot(w.vs, w.d, w.m, a.q, a.d, a.s)


def sub_block_sums(a, width):  # Q8_K acts -> int32 [T, nb, 256/width]: the activation sums of each sub-block
    return np.ascontiguousarray(a.bsums.reshape(a.bsums.shape[:2] + (-1, width // 16)).sum(-1), np.int32)


def tiled(w, a):  # GroupRows or KernelRows, Q8_K acts -> [T, O]
    if isinstance(w, GroupRows):
        return int_dots.group_tiled(*group_tiled_args(w, a))[:, :w.rows]
    q16 = a.q.astype(np.int16)  # widened once here, not in the kernel's loop
    return int_dots.tiled(w.vs, w.d0, w.dmin, w.mins, q16, a.d, sub_block_sums(a, w.sub))


def group_tiled_args(w, a):  # GroupRows, Q8_K acts -> int_dots.group_tiled's arguments
    return (w.codes, w.scales, w.lane_bias, w.offset, w.d0, w.dmin, w.mins, group_acts(w, a), a.d,
            sub_block_sums(a, w.sub))


def k_vec_dot(w, a):  # GroupRows, Q8_K acts -> [T, O]
    return int_dots.group_vec_dot(*group_vec_dot_args(w, a))[:, :w.rows]


def group_vec_dot_args(w, a):  # GroupRows, Q8_K acts -> int_dots.group_vec_dot's arguments
    return (w.codes, w.scales, w.lane_bias, w.offset, w.d, w.dmin, w.mins, w.min_lanes, w.post, group_acts(w, a),
            a.d, np.ascontiguousarray(a.bsums, np.int32), sub_block_sums(a, 32))


def k_repacked_rows(w, a, elements_per_fma):  # GroupRows (Q4_K) or KernelRows (Q2_K), Q8_K acts -> [T, O]
    if isinstance(w, GroupRows):
        return int_dots.group_repacked(w.codes, w.scales, w.mins, w.d, w.dmin, group_acts(w, a), a.d,
                                       sub_block_sums(a, w.sub), elements_per_fma)[:, :w.rows]
    return int_dots.k_repacked_rows(w.vs, w.d, w.dmin, w.mins, a.q, a.d, sub_block_sums(a, w.sub), elements_per_fma)


def mul_mat(x, weights, name, cache, repack=True, cache_bytes=None, target=AVX512):  # x [T, K] f32 -> [T, O] on numba
    kind = weights.type_name(name)
    path = kernel_path(kind, len(x), weights, name, repack, target)
    if path == "float":
        return float_weight_mul_mat(x, weights, name, cache,
                                    lambda x, w, kind: float_dots.float_mul_mat(x, w, kind, target))
    if block_dots.reads(kind, path):  # no decoded copy: the kernels unpack the mmapped blocks (avx2 and avx512 vec_dots round alike)
        return block_dots.mul_mat(x, weights, name, path)
    paths = [kernel_path(kind, n, weights, name, repack, target) for n in (1, TILED_MIN_ROWS)]  # decode and prefill
    return bounded_mul_mat(len(weights.raw(name)), name, cache, cache_bytes,
                           lambda start, stop: kernel_rows(decode_rows(weights, name, start, stop, DECODERS), kind,
                                                           paths),
                           QUANT_PATHS[path](x, kind, target))


def wide_block_vec_dot(w, a, lanes):  # KernelRows (Q1_0/Q2_0), Q8_0 acts -> [T, O]
    return int_dots.wide_block_vec_dot(w.vs, w.d, a.q, a.d, lanes)


def q2_k_vec_dot(w, a, target):  # KernelRows (Q2_K), Q8_K acts, an x86 Target -> [T, O]
    x86_only(target)
    return int_dots.q2_k_vec_dot(w.vs, w.d, w.dmin, w.mins, a.q, a.d, a.bsums)


def iq1_vec_dot(w, a, delta_lanes):  # KernelRows (IQ1_S/IQ1_M), Q8_K acts -> [T, O]
    return int_dots.iq1_vec_dot(w.vs, w.scales, w.sub, w.d, a.q, a.d, delta_lanes)


# the twins of reference/ggml_cpu/mul_mat.py's QUANT_KERNELS for the AVX2 and AVX512 targets (x86_only refuses others)
QUANT_PATHS = quant_paths(QuantKernels(
    quantize_q8_0=quantize_q8_0, quantize_q8_k=quantize_q8_k, q0_repacked=q0_repacked, q0_lanes=q0_lanes,
    q5_1_vec_dot=q5_1_vec_dot, wide_block_vec_dot=wide_block_vec_dot, q2_k_vec_dot=q2_k_vec_dot, tiled=tiled,
    k_vec_dot=k_vec_dot, k_repacked_rows=k_repacked_rows, iq1_vec_dot=iq1_vec_dot))
