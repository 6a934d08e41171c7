"""Products with GGUF weights straight from their quantized blocks, in numba. No dequantized
matrix ever exists. The weights are gguf-py's float32 values exactly (Q1_0 and Q2_0, which gguf-py
lacks: reference/gguf/weights.py's decoders of ggml's dequantize_row_q1_0/q2_0). With float32 activations
a row sums in float32 within a block of 16 to 256 values (each family's section says which) and
in float64 across blocks, a tile within 1024 columns and in float64 across tiles; float64
activations sum in float64 everywhere. Against reference/ops.py linear (float64 sums) only the
summation differs: NMSE <= 3.6e-14 per product in the op harness on random inputs (more where a
row's sum cancels: the error is relative to sum |w x|), 1.8e-13 .. 8.6e-13 on whole tiny models.
The float32 lanes follow the CPU's vector width, so the last bits may differ between machines.

The file goes by family, each type's decoder next to its row kernel: floats (F32, F16, BF16),
legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and ggml's Q1_0, Q2_0), K-quants (Q2_K ..
Q6_K, IQ4_XS), IQ grids (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and ternary (TQ1_0,
TQ2_0). KERNELS, after them, is the one table of type -> (decoder, row kernel) that the products
dispatch through. The types the GGUF loader accepts without a kernel here, MXFP4 and NVFP4, are
refused with TypeWithoutKernel; NumbaBackend gives them the reference's product.

Two routes:
- matmul_rows (decode): each weight row is read once per row of x and multiplied block by block
  in factored form, sum_i w_i x_i = sum_blocks scale * sum_j q_j x_j (see the comment above the
  families for why that multiplies the very same weights).
- matmul_tiles (prefill): a tile of weights is decoded once by the decoders, which reproduce
  gguf-py's dequantization bit for bit (the same float32 operations in the same order), and
  multiplied with every row of x by a 4x4 register-blocked kernel.

Block layouts follow ggml-common.h / ggml-quants.c (dequantize_row_*) and gguf-py's quants.py; the
IQ grids, sign table and non-linear 4-bit values are taken from gguf-py rather than copied.
numba has no float16, so half and bfloat16 bits are decoded through 65536-entry float32 tables.
One file rather than a package: numba's cache of a function is invalidated by its own file alone,
so products cached in one module would keep running the old kernels of another after an edit.
"""
from collections import namedtuple

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import quants
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from reference import quant_blocks as qb
from reference.gguf import GgmlType, UnsupportedTensorType
from .operands import operands

CHUNK = 256  # values decoded per step: one K-quant super-block, or eight 32-value blocks

# reassoc lets LLVM split the sums into vector lanes, contract fuses a*b+c into an FMA. Both only
# move roundings of products and sums; the weights' own factors are exact.
FAST = {"reassoc", "contract"}

Tables = namedtuple("Tables", "halves bfloats ksigns kvalues iq2xxs_signed iq3xxs_signed iq2xxs_grid iq3xxs_grid "
                               "sign_bits iq1s_grid iq2xs_signed iq2s_signed iq3s_signed")


def lookup_tables():  # -> Tables, every entry a float32/int8/uint8/uint32 array
    every_u16 = np.arange(1 << 16, dtype=np.uint16)
    quants.IQ2_XXS.init_grid()
    quants.IQ3_XXS.init_grid()
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).copy()  # 7 sign bits -> 8 (even parity)
    sign_rows = np.where((ksigns[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1))  # [128, 8] of +-1
    nibble_signs = np.where((np.arange(16)[:, None] >> np.arange(4)) & 1, np.float32(-1), np.float32(1))  # [16, 4]
    iq2xxs_grid = np.ascontiguousarray(quants.IQ2_XXS.grid.reshape(256, 8), np.float32)
    iq3xxs_grid = np.ascontiguousarray(quants.IQ3_XXS.grid.reshape(256, 4), np.float32)
    return Tables(halves=every_u16.view(np.float16).astype(np.float32),
                  bfloats=(every_u16.astype(np.uint32) << 16).view(np.float32),
                  ksigns=ksigns, kvalues=np.array(quants.IQ4_NL.kvalues, np.float32),
                  # every grid row with every sign pattern, as int8 (grid values <= 62): one load
                  # gives 8 signed values (IQ2_XXS: row 128 * grid byte + 7 sign bits) or 4 (IQ3_XXS:
                  # row 16 * grid byte + 4 sign bits), and the tables (256 KB, 16 KB) stay in L2
                  iq2xxs_signed=(iq2xxs_grid[:, None] * sign_rows[None]).reshape(-1, 8).astype(np.int8),
                  iq3xxs_signed=(iq3xxs_grid[:, None] * nibble_signs[None]).reshape(-1, 4).astype(np.int8),
                  # the row kernels' (xxs_row): float32 grid rows (8 KB, 4 KB) and each 7-bit ksigns
                  # index as 8 float sign bits (4 KB), all in L1
                  iq2xxs_grid=iq2xxs_grid, iq3xxs_grid=iq3xxs_grid,
                  sign_bits=np.where(sign_rows < 0, np.uint32(1 << 31), np.uint32(0)),
                  **iq_grids())


def iq_grids():  # -> the tables of IQ1_S/M, IQ2_XS, IQ2_S, IQ3_S, all int8 (grid values -1..1 or <= 43)
    for cls in (quants.IQ1_S, quants.IQ2_XS, quants.IQ2_S, quants.IQ3_S):
        cls.init_grid()
    grid = lambda cls: cls.grid.reshape(cls.grid_shape).astype(np.int8)  # noqa: E731
    bit_signs = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.int8)  # bit j set -> -1
    ksign_rows = bit_signs[np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)]  # [128, 8]: 7 sign bits -> 8 signs
    # every grid row with every sign pattern, as for IQ2_XXS: row u16 q of IQ2_XS (sign bits 9.., grid
    # row 0..8), row 256 grid + sign byte of IQ2_S, row 16 grid + 4 sign bits of IQ3_S (512, 2048, 32 KB)
    return dict(iq1s_grid=grid(quants.IQ1_S),
                iq2xs_signed=(ksign_rows[:, None] * grid(quants.IQ2_XS)[None]).reshape(-1, 8),
                iq2s_signed=(grid(quants.IQ2_S)[:, None] * bit_signs[None]).reshape(-1, 8),
                iq3s_signed=(grid(quants.IQ3_S)[:, None] * bit_signs[:16, :4][None]).reshape(-1, 4))


TABLES = lookup_tables()


def as_blocks(raw, n_out):  # memory-mapped tensor data -> uint8 [n_out, row_bytes], no copy
    return np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1)


# ---------------------------------------------------------------------------------------------
# Little helpers on a row of bytes

@njit(cache=True)
def u16(row, o):  # little-endian uint16 at row[o]
    return np.int64(row[o]) | (np.int64(row[o + 1]) << 8)


@njit(cache=True)
def u32(row, o):  # little-endian uint32 at row[o]
    return u16(row, o) | (u16(row, o + 2) << 16)


@njit(cache=True)
def i8(byte):  # a uint8 read as two's-complement int8
    return (np.int64(byte) ^ 128) - 128


@njit(cache=True)
def half_at(blk, b, o, halves):  # the f16 at bytes o, o+1 of block b -> float32
    return halves[np.int64(blk[b, o]) | (np.int64(blk[b, o + 1]) << 8)]


I8 = ir.IntType(8)


@intrinsic
def field_value(typingctx, low, low_shift, high, high_shift, high_bits, offset):  # -> float32 of (field - offset)
    """The field ((low >> low_shift) & 15) | ((high >> high_shift) & (2^high_bits - 1)) << 4 of ggml's
    block layouts, minus offset, in int8 arithmetic (exact: a 6-bit field and field - 32 fit int8).
    numba widens integer operations to 64 bits, eight lanes per vector where int8 has 32, so the
    decode kernels and tools/bench/kernel_floor.py take their fields in LLVM IR directly. The shifts,
    high_bits and offset are constants at every call: LLVM folds them (high_bits 0 drops high)."""
    def codegen(context, builder, signature, args):
        lo, lo_shift, hi, hi_shift, hi_bits, off = args
        mask = builder.sub(builder.shl(ir.Constant(I8, 1), builder.trunc(hi_bits, I8)), ir.Constant(I8, 1))
        low_bits = builder.and_(builder.lshr(lo, builder.trunc(lo_shift, I8)), ir.Constant(I8, 15))
        high_field = builder.and_(builder.lshr(hi, builder.trunc(hi_shift, I8)), mask)
        field = builder.or_(low_bits, builder.shl(high_field, ir.Constant(I8, 4)))
        return builder.sitofp(builder.sub(field, builder.trunc(off, I8)), ir.FloatType())
    return types.float32(types.uint8, types.int64, types.uint8, types.int64, types.int64, types.int64), codegen


# Integer fields of a byte, taken in float32 arithmetic: a byte converted to float32 is exact, and
# floor(byte / 2^k) is too, so every field comes out exact while LLVM keeps sixteen float32 lanes
# per vector (numba widens integer arithmetic to 64 bits, eight lanes).

@njit(cache=True)
def nibbles(byte):  # float32 holding a byte -> (low nibble, high nibble)
    high = np.floor(byte * np.float32(1 / 16))
    return byte - np.float32(16) * high, high


@njit(cache=True)
def bit_pair(byte, first):  # float32 holding a byte -> its bits first and first + 1 as 0.0 / 1.0
    v = np.floor(byte * np.float32(1 / (1 << first)))
    v1 = np.floor(v * np.float32(0.5))
    return v - np.float32(2) * v1, v1 - np.float32(2) * np.floor(v1 * np.float32(0.5))


@njit(cache=True)
def crumbs(byte):  # float32 holding a byte -> its four 2-bit fields, lowest first
    a = np.floor(byte * np.float32(1 / 4))
    b = np.floor(byte * np.float32(1 / 16))
    c = np.floor(byte * np.float32(1 / 64))
    return byte - np.float32(4) * a, a - np.float32(4) * b, b - np.float32(4) * c, c


@njit(cache=True, fastmath=FAST)
def dot(w, x):  # w [n] of any real type, x [n] -> sum w * x in x's dtype
    s = x.dtype.type(0)
    for j in range(x.shape[0]):
        s += w[j] * x[j]
    return s


# ---------------------------------------------------------------------------------------------
# What every family below holds to.
#
# Decoders, decode_*(qtype, row, start, n, out, tab): values [start, start + n) of one row -> out[:n]
# (gguf-py's float32 values, widened if out is float64). start is a multiple of CHUNK, n a multiple
# of the block size and at most CHUNK. No fastmath here: a contracted `dl * q - ml` would round
# once where gguf-py rounds twice.
#
# Row kernels, row_*(qtype, row, x, xsum16, tab) -> float64: one weight row [row_bytes] . x [n_in]
# (float32 or float64), factored per block:
#     sum_i w_i x_i = sum_blocks scale * sum_j q_j x_j   (- min * sum_j x_j for Q2_K, Q4_K, Q5_K)
# xsum16 [n_in / 16] holds the float64 sums of x per 16 values that the mins multiply. Both kinds
# take the same arguments whether they read qtype and xsum16 or not, so that one table holds them.
# Every dequantized weight is a product of an f16 scale, a small integer scale and a small integer
# (or grid value) q with at most 23 significant bits (Q6_K: 11 x 8 x 6 bits, 2047 * 128 * 32 <
# 2^23), so gguf-py's float32 weight holds that product without rounding and the factored form
# multiplies the very same weights. (The K-quants' `scale * q - min` and Q4_1/Q5_1's `d q + m` round
# in gguf-py only where a block's two f16 factors differ by more than about 2^8: an NMSE of ~1e-15.)
# Sums run in the activations' dtype inside a block (float32 lanes: twice as many per vector as
# float64, and float32 x fits the L1 cache where float64 x does not) and in float64 across blocks.
# A product q x rounds once in float32, then the sums round: against the reference's float64 sums
# of exact products, a relative error of about 2^-24 sqrt(256) of sum |w x| per super-block
# (measured NMSE 3e-14 at n_in 6656 on random x).
#
# The row kernels view a row as [blocks, block bytes] and x as [blocks, ..., values] and index
# both with loop counters only: numba then knows every index is non-negative and LLVM vectorizes
# the inner loops (offset arithmetic on a flat row cost a factor 2-4 here).

# ---------------------------------------------------------------------------------------------
# Floats: F32, F16, BF16. The row sums in float64.

F32, F16, BF16 = int(GT.F32), int(GT.F16), int(GT.BF16)


@njit(cache=True)
def decode_float(qtype, row, start, n, out, tab):  # F32, F16, BF16
    if qtype == F32:
        values = row.view(np.float32)
        for j in range(n):
            out[j] = values[start + j]
    else:
        bits = row.view(np.uint16)
        table = tab.halves if qtype == F16 else tab.bfloats
        for j in range(n):
            out[j] = table[bits[start + j]]


@njit(cache=True, fastmath=FAST)
def row_float(qtype, row, x, xsum16, tab):  # F32, F16, BF16
    s = 0.0
    if qtype == F32:
        w = row.view(np.float32)
        for j in range(x.shape[0]):
            s += np.float64(w[j]) * x[j]
        return s
    bits, table = row.view(np.uint16), tab.halves if qtype == F16 else tab.bfloats
    for j in range(x.shape[0]):
        s += np.float64(table[bits[j]]) * x[j]
    return s


# ---------------------------------------------------------------------------------------------
# Legacy blocks: an f16 d per block of 32 values (Q8_0; Q4_0, Q5_0, and IQ4_NL, whose 4-bit codes
# pick non-linear values; Q4_1 and Q5_1, which add an f16 m), and ggml's Q1_0 (128 values) and Q2_0
# (64). Rows sum in float64 (Q4_0, Q5_0, IQ4_NL) or in the activations' dtype
# within a block (Q8_0, Q4_1, Q5_1, Q1_0, Q2_0).

Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL = int(GT.Q4_0), int(GT.Q5_0), int(GT.Q4_1), int(GT.Q5_1), int(GT.IQ4_NL)


@njit(cache=True)
def decode_q8_0(qtype, row, start, n, out, tab):  # 34-byte blocks: f16 d, int8 q[32]; w = q * d
    for b in range(n // 32):
        o = (start // 32 + b) * qb.Q8_0.size
        d = tab.halves[u16(row, o + qb.Q8_0.d)]
        for j in range(32):
            out[b * 32 + j] = np.float32(i8(row[o + qb.Q8_0.qs + j])) * d


@njit(cache=True, fastmath=FAST)
def row_q8_0(qtype, row, x, xsum16, tab):  # 34-byte blocks: f16 d, int8 q[32]
    nb = x.shape[0] // 32
    blk, qi, xs = row.reshape(nb, qb.Q8_0.size), row.view(np.int8).reshape(nb, qb.Q8_0.size), x.reshape(nb, 32)
    acc = 0.0
    for b in range(nb):
        acc += np.float64(half_at(blk, b, qb.Q8_0.d, tab.halves)) * dot(qi[b, qb.Q8_0.qs:], xs[b])
    return acc


@njit(cache=True)
def decode_nibbles32(qtype, row, start, n, out, tab):  # Q4_0, Q5_0, IQ4_NL: low nibbles are values 0..15
    size = qb.Q5_0.size if qtype == Q5_0 else qb.Q4_0.size  # IQ4_NL's block is Q4_0's
    qs_at = qb.Q5_0.qs if qtype == Q5_0 else qb.Q4_0.qs
    for b in range(n // 32):
        o = (start // 32 + b) * size
        d = tab.halves[u16(row, o)]
        qh = u32(row, o + qb.Q5_0.qh) if qtype == Q5_0 else 0
        for j in range(32):
            q = (np.int64(row[o + qs_at + j % 16]) >> (4 * (j // 16))) & 15
            if qtype == Q4_0:
                w = d * np.float32(q - 8)
            elif qtype == Q5_0:
                w = d * np.float32((q | (((qh >> j) & 1) << 4)) - 16)
            else:
                w = d * tab.kvalues[q]
            out[b * 32 + j] = w


@njit(cache=True, fastmath=FAST)
def row_blocks32(qtype, row, x, xsum16, tab):  # Q4_0, Q5_0, IQ4_NL: f16 d, (Q5_0: u32 qh), 16 bytes: low nibbles first
    size = qb.Q5_0.size if qtype == Q5_0 else qb.Q4_0.size
    nb = x.shape[0] // 32
    blk, xs, kv = row.reshape(nb, size), x.reshape(nb, 2, 16), tab.kvalues
    acc = 0.0
    for b in range(nb):
        lo = hi = 0.0
        if qtype == Q4_0:
            for l in range(16):
                q = np.int64(blk[b, qb.Q4_0.qs + l])
                lo += np.float64((q & 15) - 8) * xs[b, 0, l]
                hi += np.float64((q >> 4) - 8) * xs[b, 1, l]
        elif qtype == IQ4_NL:
            for l in range(16):
                q = np.int64(blk[b, qb.IQ4_NL.qs + l])
                lo += np.float64(kv[q & 15]) * xs[b, 0, l]
                hi += np.float64(kv[q >> 4]) * xs[b, 1, l]
        else:
            qh = u32(blk[b], qb.Q5_0.qh)  # bit j: the fifth bit of value j
            for l in range(16):
                q = np.int64(blk[b, qb.Q5_0.qs + l])
                lo += np.float64(((q & 15) | (((qh >> l) & 1) << 4)) - 16) * xs[b, 0, l]
                hi += np.float64(((q >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16) * xs[b, 1, l]
        acc += np.float64(half_at(blk, b, qb.Q4_0.d, tab.halves)) * (lo + hi)
    return acc


@njit(cache=True)
def decode_q45_1(qtype, row, start, n, out, tab):  # Q4_1 20 / Q5_1 24 bytes: f16 d, f16 m, (u32 qh), qs[16]; d q + m
    size, qs_at = (qb.Q4_1.size, qb.Q4_1.qs) if qtype == Q4_1 else (qb.Q5_1.size, qb.Q5_1.qs)
    for b in range(n // 32):
        o = (start // 32 + b) * size
        d, m = tab.halves[u16(row, o + qb.Q4_1.d)], tab.halves[u16(row, o + qb.Q4_1.m)]  # Q5_1's at the same bytes
        qh = u32(row, o + qb.Q5_1.qh) if qtype == Q5_1 else 0  # bit j: the fifth bit of value j
        for j in range(32):
            q = ((np.int64(row[o + qs_at + j % 16]) >> (4 * (j // 16))) & 15) | (((qh >> j) & 1) << 4)
            out[b * 32 + j] = d * np.float32(q) + m


@njit(cache=True, fastmath=FAST)
def row_q45_1(qtype, row, x, xsum16, tab):  # Q4_1 / Q5_1: sum (d q + m) x = d sum q x + m sum x per block
    size, qs_at = (qb.Q4_1.size, qb.Q4_1.qs) if qtype == Q4_1 else (qb.Q5_1.size, qb.Q5_1.qs)
    nb = x.shape[0] // 32
    blk, xs, sums = row.reshape(nb, size), x.reshape(nb, 2, 16), xsum16.reshape(nb, 2)
    acc = 0.0
    for b in range(nb):
        qh = u32(blk[b], qb.Q5_1.qh) if qtype == Q5_1 else 0
        s = x.dtype.type(0)
        for l in range(16):
            q = np.int64(blk[b, qs_at + l])
            lo, hi = (q & 15) | (((qh >> l) & 1) << 4), (q >> 4) | (((qh >> (l + 16)) & 1) << 4)
            s += x.dtype.type(lo) * xs[b, 0, l] + x.dtype.type(hi) * xs[b, 1, l]
        acc += (np.float64(half_at(blk, b, qb.Q4_1.d, tab.halves)) * s
                + np.float64(half_at(blk, b, qb.Q4_1.m, tab.halves)) * (sums[b, 0] + sums[b, 1]))
    return acc


@njit(cache=True)
def decode_q1_0(qtype, row, start, n, out, tab):  # 18-byte blocks: f16 d, qs[16]; bit j set: w = d, else -d
    for b in range(n // 128):
        o = (start // 128 + b) * qb.Q1_0.size
        d = tab.halves[u16(row, o + qb.Q1_0.d)]
        for j in range(128):
            out[b * 128 + j] = d if (np.int64(row[o + qb.Q1_0.qs + j // 8]) >> (j % 8)) & 1 else -d


@njit(cache=True, fastmath=FAST)
def row_q1_0(qtype, row, x, xsum16, tab):  # 18-byte blocks: f16 d, 128 sign bits; w = +-d
    nb = x.shape[0] // 128
    blk, xs = row.reshape(nb, qb.Q1_0.size), x.reshape(nb, 128)
    acc = 0.0
    for b in range(nb):
        s = x.dtype.type(0)
        for j in range(128):
            s += xs[b, j] if (np.int64(blk[b, qb.Q1_0.qs + j // 8]) >> (j % 8)) & 1 else -xs[b, j]
        acc += np.float64(half_at(blk, b, qb.Q1_0.d, tab.halves)) * s
    return acc


@njit(cache=True)
def decode_q2_0(qtype, row, start, n, out, tab):  # 18-byte blocks: f16 d, qs[16] of 2-bit q; w = (q - 1) d
    for b in range(n // 64):
        o = (start // 64 + b) * qb.Q2_0.size
        d = tab.halves[u16(row, o + qb.Q2_0.d)]
        for j in range(64):
            q = (np.int64(row[o + qb.Q2_0.qs + j // 4]) >> (2 * (j % 4))) & 3
            out[b * 64 + j] = np.float32(q - 1) * d


@njit(cache=True, fastmath=FAST)
def row_q2_0(qtype, row, x, xsum16, tab):  # 18-byte blocks: f16 d, 64 2-bit q; w = (q - 1) d
    nb = x.shape[0] // 64
    blk, xs = row.reshape(nb, qb.Q2_0.size), x.reshape(nb, 64)
    acc = 0.0
    for b in range(nb):
        s = x.dtype.type(0)
        for j in range(64):
            s += x.dtype.type(((np.int64(blk[b, qb.Q2_0.qs + j // 4]) >> (2 * (j % 4))) & 3) - 1) * xs[b, j]
        acc += np.float64(half_at(blk, b, qb.Q2_0.d, tab.halves)) * s
    return acc


# ---------------------------------------------------------------------------------------------
# K-quants: 256-value super-blocks with an f16 d (Q2_K, Q4_K, Q5_K: and dmin) and 4- to 8-bit
# scales of 16- or 32-value sub-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), and IQ4_XS, that layout
# with IQ4_NL's non-linear values. Rows sum in float64 (Q2_K, Q3_K) or in the activations' dtype
# within the super-block (Q4_K, Q5_K, Q6_K) or a 32-value sub-block (IQ4_XS).

Q4_K, Q5_K = int(GT.Q4_K), int(GT.Q5_K)


@njit(cache=True)
def decode_q2_k(qtype, row, start, n, out, tab):  # 84 bytes: scales[16], qs[64], f16 d, f16 dmin
    sb, blk, w = start // 256, row.reshape(-1, qb.Q2_K.size), out[:256].reshape(2, 4, 2, 16)
    d, dmin = half_at(blk, sb, qb.Q2_K.d, tab.halves), half_at(blk, sb, qb.Q2_K.dmin, tab.halves)
    for h in range(2):
        for s in range(4):
            for part in range(2):
                sc = np.int64(blk[sb, qb.Q2_K.scales + h * 8 + s * 2 + part])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                for l in range(16):
                    q = (np.int64(blk[sb, qb.Q2_K.qs + h * 32 + part * 16 + l]) >> (2 * s)) & 3
                    w[h, s, part, l] = dl * np.float32(q) - ml


@njit(cache=True, fastmath=FAST)
def row_q2_k(qtype, row, x, xsum16, tab):  # 84 bytes: scales[16], qs[64], f16 d, f16 dmin
    # value e is 2 bits of qs[e // 128 * 32 + e % 32] at shift 2 * (e % 128 // 32), scale e // 16
    nsb = x.shape[0] // 256
    blk, xs, sums = row.reshape(nsb, qb.Q2_K.size), x.reshape(nsb, 2, 4, 2, 16), xsum16.reshape(nsb, 2, 4, 2)
    acc = 0.0
    for sb in range(nsb):
        d, dmin = half_at(blk, sb, qb.Q2_K.d, tab.halves), half_at(blk, sb, qb.Q2_K.dmin, tab.halves)
        for h in range(2):
            for part in range(2):  # values 16 * part .. of each 32 group: another scale
                a0 = a1 = a2 = a3 = 0.0
                for l in range(16):
                    q = np.int64(blk[sb, qb.Q2_K.qs + h * 32 + part * 16 + l])
                    a0 += np.float64(q & 3) * xs[sb, h, 0, part, l]
                    a1 += np.float64((q >> 2) & 3) * xs[sb, h, 1, part, l]
                    a2 += np.float64((q >> 4) & 3) * xs[sb, h, 2, part, l]
                    a3 += np.float64(q >> 6) * xs[sb, h, 3, part, l]
                for s, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                    sc = np.int64(blk[sb, qb.Q2_K.scales + h * 8 + s * 2 + part])
                    acc += (np.float64(d * np.float32(sc & 15)) * a
                            - np.float64(dmin * np.float32(sc >> 4)) * sums[sb, h, s, part])
    return acc


@njit(cache=True)
def decode_q3_k(qtype, row, start, n, out, tab):  # 110 bytes: hmask[32], qs[64], scales[12], f16 d
    o = start // 256 * qb.Q3_K.size
    d = tab.halves[u16(row, o + qb.Q3_K.d)]
    for e in range(256):
        i = e // 16
        low = (np.int64(row[o + qb.Q3_K.scales + i % 8]) >> (4 * (i // 8))) & 15
        high = (np.int64(row[o + qb.Q3_K.scales + 8 + i % 4]) >> (2 * (i // 4))) & 3
        dl = d * np.float32((low | (high << 4)) - 32)
        q = (np.int64(row[o + qb.Q3_K.qs + e // 128 * 32 + e % 32]) >> (2 * (e % 128 // 32))) & 3
        if (np.int64(row[o + qb.Q3_K.hmask + e % 32]) >> (e // 32)) & 1 == 0:  # a clear high bit means q - 4
            q -= 4
        out[e] = dl * np.float32(q)


@njit(cache=True, fastmath=FAST)
def row_q3_k(qtype, row, x, xsum16, tab):  # 110 bytes: hmask[32], qs[64], scales[12], f16 d; q = 2 low bits - 4 unless the hmask bit
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, qb.Q3_K.size), x.reshape(nsb, 2, 4, 2, 16)
    acc = 0.0
    for sb in range(nsb):
        d = half_at(blk, sb, qb.Q3_K.d, tab.halves)
        for h in range(2):
            for part in range(2):
                a0 = a1 = a2 = a3 = 0.0
                for l in range(16):
                    q = np.int64(blk[sb, qb.Q3_K.qs + h * 32 + part * 16 + l])
                    m = np.int64(blk[sb, qb.Q3_K.hmask + part * 16 + l]) >> (4 * h)
                    a0 += np.float64((q & 3) - 4 + 4 * (m & 1)) * xs[sb, h, 0, part, l]
                    a1 += np.float64(((q >> 2) & 3) - 4 + 2 * (m & 2)) * xs[sb, h, 1, part, l]
                    a2 += np.float64(((q >> 4) & 3) - 4 + (m & 4)) * xs[sb, h, 2, part, l]
                    a3 += np.float64((q >> 6) - 4 + ((m >> 1) & 4)) * xs[sb, h, 3, part, l]
                for s, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                    i = h * 8 + s * 2 + part
                    low = (np.int64(blk[sb, qb.Q3_K.scales + i % 8]) >> (4 * (i // 8))) & 15
                    high = (np.int64(blk[sb, qb.Q3_K.scales + 8 + i % 4]) >> (2 * (i // 4))) & 3
                    acc += np.float64(d * np.float32((low | (high << 4)) - 32)) * a
    return acc


@njit(cache=True)
def k_scale_min(row, o, j):  # 12 packed bytes at row[o] -> 6-bit (scale, min) of sub-block j (Q4_K, Q5_K)
    if j < 4:
        return np.int64(row[o + j]) & 63, np.int64(row[o + 4 + j]) & 63
    high = np.int64(row[o + 4 + j])  # bytes 8..11 hold the low 4 bits; the top 2 bits sit in bytes 0..7
    return (high & 15) | ((np.int64(row[o + j - 4]) >> 2) & 48), (high >> 4) | ((np.int64(row[o + j]) >> 2) & 48)


@njit(cache=True)
def k_scale_ints(blk, sb):  # Q4_K/Q5_K super-block sb -> (6-bit scales, 6-bit mins) of its 8 sub-blocks
    b, at = blk[sb], qb.Q4_K.scales  # Q5_K's at the same byte
    s0, m0 = k_scale_min(b, at, 0)
    s1, m1 = k_scale_min(b, at, 1)
    s2, m2 = k_scale_min(b, at, 2)
    s3, m3 = k_scale_min(b, at, 3)
    s4, m4 = k_scale_min(b, at, 4)
    s5, m5 = k_scale_min(b, at, 5)
    s6, m6 = k_scale_min(b, at, 6)
    s7, m7 = k_scale_min(b, at, 7)
    return (s0, s1, s2, s3, s4, s5, s6, s7), (m0, m1, m2, m3, m4, m5, m6, m7)


@njit(cache=True)
def k_scales(blk, sb, tab):  # Q4_K/Q5_K super-block sb -> (d * scale, dmin * min) of its 8 sub-blocks
    d, dmin = half_at(blk, sb, qb.Q4_K.d, tab.halves), half_at(blk, sb, qb.Q4_K.dmin, tab.halves)
    (s0, s1, s2, s3, s4, s5, s6, s7), (m0, m1, m2, m3, m4, m5, m6, m7) = k_scale_ints(blk, sb)
    f = np.float32
    return ((d * f(s0), d * f(s1), d * f(s2), d * f(s3), d * f(s4), d * f(s5), d * f(s6), d * f(s7)),
            (dmin * f(m0), dmin * f(m1), dmin * f(m2), dmin * f(m3), dmin * f(m4), dmin * f(m5), dmin * f(m6),
             dmin * f(m7)))


@njit(cache=True)
def k_mins_term(blk, sb, sums, tab):  # -> sum_j dmin min_j sum(x of sub-block j), float64; sums [8, 2]
    # dmin min_j is exact in float32 (an f16 times 6 bits): dmin times the integer sum is the same term
    # with one float64 rounding more, and seven float32 multiplies fewer
    m0, m1, m2, m3, m4, m5, m6, m7 = k_scale_ints(blk, sb)[1]
    terms = ((m0 * (sums[0, 0] + sums[0, 1]) + m1 * (sums[1, 0] + sums[1, 1]))
             + (m2 * (sums[2, 0] + sums[2, 1]) + m3 * (sums[3, 0] + sums[3, 1]))
             + ((m4 * (sums[4, 0] + sums[4, 1]) + m5 * (sums[5, 0] + sums[5, 1]))
                + (m6 * (sums[6, 0] + sums[6, 1]) + m7 * (sums[7, 0] + sums[7, 1]))))
    return np.float64(half_at(blk, sb, qb.Q4_K.dmin, tab.halves)) * terms


@njit(cache=True)
def decode_q45_k(qtype, row, start, n, out, tab):  # Q4_K 144 / Q5_K 176 bytes: d, dmin, scales[12], (qh[32]), qs[128]
    size, qs_at = (qb.Q4_K.size, qb.Q4_K.qs) if qtype == Q4_K else (qb.Q5_K.size, qb.Q5_K.qs)
    sb, blk = start // 256, row.reshape(-1, size)
    dl, ml = k_scales(blk, sb, tab)
    for g in range(4):  # 32 bytes: the low nibbles are sub-block 2g, the high ones 2g + 1
        d0, ml0, d1, ml1 = dl[2 * g], ml[2 * g], dl[2 * g + 1], ml[2 * g + 1]
        for l in range(32):
            lo, hi = nibbles(np.float32(blk[sb, qs_at + 32 * g + l]))
            if qtype == Q5_K:
                fifth_lo, fifth_hi = bit_pair(np.float32(blk[sb, qb.Q5_K.qh + l]), 2 * g)
                lo, hi = lo + np.float32(16) * fifth_lo, hi + np.float32(16) * fifth_hi
            out[64 * g + l] = d0 * lo - ml0
            out[64 * g + 32 + l] = d1 * hi - ml1


@njit(cache=True, fastmath=FAST)
def q45_k_pair(qs, qh, fifth_bits, g, l, d_low, d_high, xs):  # -> d q x of value l of sub-blocks 2g and 2g + 1
    # byte l of 32-byte group g holds value l of sub-block 2g (low nibble) and of 2g + 1 (high);
    # Q5_K's fifth bits: bits 2g, 2g + 1 of qh[l]
    b, h = qs[32 * g + l], qh[l]
    return (d_low * (field_value(b, 0, h, 2 * g, fifth_bits, 0) * xs[2 * g, l])
            + d_high * (field_value(b, 4, h, 2 * g + 1, fifth_bits, 0) * xs[2 * g + 1, l]))


@njit(cache=True, fastmath=FAST)
def q45_k_block(qs, qh, fifth_bits, dl, xs):  # -> sum_j dl[j] sum_l q[j, l] x[j, l] of one super-block, xs [8, 32]
    # four running sums: one would chain eight dependent FMAs a step, and latency, not the
    # arithmetic, would set the speed (x1.2 measured)
    d0, d1, d2, d3, d4, d5, d6, d7 = dl
    s0 = s1 = s2 = s3 = xs.dtype.type(0)
    for l in range(32):
        s0 += q45_k_pair(qs, qh, fifth_bits, 0, l, d0, d1, xs)
        s1 += q45_k_pair(qs, qh, fifth_bits, 1, l, d2, d3, xs)
        s2 += q45_k_pair(qs, qh, fifth_bits, 2, l, d4, d5, xs)
        s3 += q45_k_pair(qs, qh, fifth_bits, 3, l, d6, d7, xs)
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, fastmath=FAST)
def row_q45_k(qtype, row, x, xsum16, tab):  # Q4_K 144 / Q5_K 176 bytes: d, dmin, scales[12], (qh[32]), qs[128]
    size = qb.Q4_K.size if qtype == Q4_K else qb.Q5_K.size
    nsb = x.shape[0] // 256
    blk, xs, sums = row.reshape(nsb, size), x.reshape(nsb, 8, 32), xsum16.reshape(nsb, 8, 2)
    acc = 0.0
    for sb in range(nsb):
        dl = k_scales(blk, sb, tab)[0]
        mins = k_mins_term(blk, sb, sums[sb], tab)
        if qtype == Q4_K:  # fifth_bits a constant at each call: the Q4_K loop reads no qh
            s = q45_k_block(blk[sb, qb.Q4_K.qs:], blk[sb], 0, dl, xs[sb])
        else:
            s = q45_k_block(blk[sb, qb.Q5_K.qs:], blk[sb, qb.Q5_K.qh:qb.Q5_K.qs], 1, dl, xs[sb])
        acc += np.float64(s) - mins
    return acc


@njit(cache=True)
def q6_k_values(blk, sb, h, l):  # Q6_K super-block sb -> values 128 h + l + (0, 32, 64, 96), q - 32
    lo0, hi0 = nibbles(np.float32(blk[sb, qb.Q6_K.ql + 64 * h + l]))
    lo1, hi1 = nibbles(np.float32(blk[sb, qb.Q6_K.ql + 64 * h + 32 + l]))
    f0, f1, f2, f3 = crumbs(np.float32(blk[sb, qb.Q6_K.qh + 32 * h + l]))
    k16, k32 = np.float32(16), np.float32(32)
    return lo0 + k16 * f0 - k32, lo1 + k16 * f1 - k32, hi0 + k16 * f2 - k32, hi1 + k16 * f3 - k32


@njit(cache=True)
def q6_k_scales(blk, sb, h, part, tab):  # -> d * scale of values 128 h + 32 s + 16 part.., s = 0..3
    d, sc = half_at(blk, sb, qb.Q6_K.d, tab.halves), qb.Q6_K.scales + 8 * h + part
    return (d * np.float32(i8(blk[sb, sc])), d * np.float32(i8(blk[sb, sc + 2])),
            d * np.float32(i8(blk[sb, sc + 4])), d * np.float32(i8(blk[sb, sc + 6])))


@njit(cache=True)
def decode_q6_k(qtype, row, start, n, out, tab):  # 210 bytes: ql[128], qh[64], int8 scales[16], f16 d
    sb, blk = start // 256, row.reshape(-1, qb.Q6_K.size)
    for h in range(2):
        for part in range(2):
            d0, d1, d2, d3 = q6_k_scales(blk, sb, h, part, tab)
            for l in range(16 * part, 16 * part + 16):
                q0, q1, q2, q3 = q6_k_values(blk, sb, h, l)
                out[128 * h + l], out[128 * h + 32 + l] = d0 * q0, d1 * q1
                out[128 * h + 64 + l], out[128 * h + 96 + l] = d2 * q2, d3 * q3


@njit(cache=True, fastmath=FAST)
def q6_k_quad(ql, qh, l, sc, xs):  # -> sum_k sc[k] (q_k - 32) x[k, l], values l + 32 k of a 128-value half
    lo, hi, top = ql[l], ql[32 + l], qh[l]
    return (sc[0] * (field_value(lo, 0, top, 0, 2, 32) * xs[0, l]) + sc[1] * (field_value(hi, 0, top, 2, 2, 32) * xs[1, l])
            + sc[2] * (field_value(lo, 4, top, 4, 2, 32) * xs[2, l]) + sc[3] * (field_value(hi, 4, top, 6, 2, 32) * xs[3, l]))


@njit(cache=True, fastmath=FAST)
def row_q6_k(qtype, row, x, xsum16, tab):  # 210 bytes: ql[128], qh[64], int8 scales[16], f16 d
    # half h: values from ql[64 h..], qh[32 h..]; the scale changes at l = 16. Four running sums, one
    # per (half, scale), for the latency as in q45_k_block.
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, qb.Q6_K.size), x.reshape(nsb, 2, 4, 32)
    ql, qh = qb.Q6_K.ql, qb.Q6_K.qh
    acc = 0.0
    for sb in range(nsb):
        ql0, ql1, qh0, qh1 = blk[sb, ql:ql + 64], blk[sb, ql + 64:ql + 128], blk[sb, qh:qh + 32], blk[sb, qh + 32:qh + 64]
        a0, b0 = q6_k_scales(blk, sb, 0, 0, tab), q6_k_scales(blk, sb, 0, 1, tab)
        a1, b1 = q6_k_scales(blk, sb, 1, 0, tab), q6_k_scales(blk, sb, 1, 1, tab)
        x0, x1 = xs[sb, 0], xs[sb, 1]
        s0 = s1 = s2 = s3 = x.dtype.type(0)
        for l in range(16):
            s0 += q6_k_quad(ql0, qh0, l, a0, x0)
            s1 += q6_k_quad(ql0, qh0, l + 16, b0, x0)
            s2 += q6_k_quad(ql1, qh1, l, a1, x1)
            s3 += q6_k_quad(ql1, qh1, l + 16, b1, x1)
        acc += np.float64((s0 + s1) + (s2 + s3))
    return acc


@njit(cache=True, fastmath=FAST)
def dot_lut(qs, shift, lut, x):  # sum lut[(qs >> shift) & 15] * x: IQ4 non-linear values
    s = x.dtype.type(0)
    for j in range(x.shape[0]):
        s += lut[(np.int64(qs[j]) >> shift) & 15] * x[j]
    return s


@njit(cache=True)
def decode_iq4_xs(qtype, row, start, n, out, tab):  # 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128]
    o = start // 256 * qb.IQ4_XS.size
    d = tab.halves[u16(row, o + qb.IQ4_XS.d)]
    scales_h = u16(row, o + qb.IQ4_XS.scales_h)
    for j in range(8):
        ls = ((np.int64(row[o + qb.IQ4_XS.scales_l + j // 2]) >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        for l in range(32):
            q = (np.int64(row[o + qb.IQ4_XS.qs + j * 16 + l % 16]) >> (4 * (l // 16))) & 15
            out[j * 32 + l] = dl * tab.kvalues[q]


@njit(cache=True, fastmath=FAST)
def row_iq4_xs(qtype, row, x, xsum16, tab):  # 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128]
    nsb = x.shape[0] // 256
    blk, xs, kv = row.reshape(nsb, qb.IQ4_XS.size), x.reshape(nsb, 8, 2, 16), tab.kvalues
    acc = 0.0
    for sb in range(nsb):
        d, scales_h = half_at(blk, sb, qb.IQ4_XS.d, tab.halves), u16(blk[sb], qb.IQ4_XS.scales_h)
        for j in range(8):
            qs = blk[sb, qb.IQ4_XS.qs + j * 16:qb.IQ4_XS.qs + 16 + j * 16]
            ls = ((np.int64(blk[sb, qb.IQ4_XS.scales_l + j // 2]) >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)
            s = dot_lut(qs, 0, kv, xs[sb, j, 0]) + dot_lut(qs, 4, kv, xs[sb, j, 1])
            acc += np.float64(d * np.float32(ls - 32)) * s
    return acc


# ---------------------------------------------------------------------------------------------
# IQ grids: each group of 8 values (IQ3: two groups of 4) is a row of one of gguf-py's grids with
# signs, times an f16 d and a small integer scale: IQ2_XXS and IQ3_XXS (256-row grids), IQ1_S and
# IQ1_M (2048 rows, grid + delta = k/8), IQ2_XS (512), IQ2_S (1024) and IQ3_S (512). Rows sum in the
# activations' dtype within 256 values (IQ2_XXS, IQ3_XXS: the weights themselves in registers, xxs_row),
# 32 (IQ3_S) or 16 (IQ1_S, IQ1_M, IQ2_XS, IQ2_S).

IQ1_S, IQ2_XS = int(GT.IQ1_S), int(GT.IQ2_XS)


@njit(cache=True)
def xxs_scale(d, aux, unit):  # f16 d, u32 with the 4-bit scale on top -> d (1/2 + scale) unit, as gguf-py rounds it
    return d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(unit)


@njit(cache=True)
def decode_iq2_xxs(qtype, row, start, n, out, tab):  # 66 bytes: f16 d, 8 x (4 grid bytes, u32: 4 x 7 sign bits, 4-bit scale)
    blk, signed = row.reshape(-1, qb.IQ2_XXS.size)[start // 256], tab.iq2xxs_signed
    d = tab.halves[u16(blk, qb.IQ2_XXS.d)]
    for ib in range(8):
        aux = u32(blk, qb.IQ2_XXS.qs + 4 + 8 * ib)
        db = xxs_scale(d, aux, 0.25)
        for l in range(4):  # db * (grid * sign) is gguf-py's (db * grid) * sign: a sign flip rounds alike
            values = signed[np.int64(blk[qb.IQ2_XXS.qs + 8 * ib + l]) * 128 + ((aux >> (7 * l)) & 127)]
            for j in range(values.shape[0]):
                out[32 * ib + 8 * l + j] = db * np.float32(values[j])


def xxs_row_intrinsic(name, block_bytes, grid_byte, aux_byte, aux_step, entries, unit):
    """The intrinsic (row, x, grid, sign_bits) -> float64: row [row_bytes] of IQ2_XXS (entries 1: a
    grid row of 8 values an 8-group, grid byte 2 + 8c + g, aux words after each chunk's 4) or IQ3_XXS
    (entries 2: two rows of 4, grid bytes 2 + 8c + 2g and + 1, aux words at 66) . x [n_in].

    Each 8-group's weights in one <8 x float> register: scale * grid row (the float32 product
    gguf-py's dequantization makes: scale = d (1/2 + aux >> 28) unit, xxs_scale's order), the
    sign bits of its ksigns index xored in; then one FMA with x's 8 values. The weights are gguf-py's
    exactly. Four accumulators (the 8-groups g of every chunk) sum a super-block in x's dtype,
    added together and widened into a float64 accumulator per super-block; its 8 lanes are summed
    at the end. The grid and sign tables stay in L1 (the signed int8 table of row_iq2_xxs' first
    form, 256 KB, did not)."""
    def xxs_row(typingctx, row, x, grid, sign_bits):
        def codegen(context, builder, signature, args):
            a = operands(xxs_row, context, builder, signature, args)
            row_, x_, grid_, signs_ = (v.data() for v in (a.row, a.x, a.grid, a.sign_bits))
            x_ty = context.get_value_type(a.x.ty.dtype)
            x_bytes = x_ty.get_abi_size(context.target_data)  # 4 or 8
            f32, f64, i32, i64 = ir.FloatType(), ir.DoubleType(), ir.IntType(32), ir.IntType(64)
            v8f, v8x, v8d, v8i = (ir.VectorType(t, 8) for t in (f32, x_ty, f64, i32))
            fma = builder.module.declare_intrinsic(f"llvm.fma.v8{'f32' if x_ty == f32 else 'f64'}",
                                                   fnty=ir.FunctionType(v8x, [v8x] * 3))

            def at(base, offset, ty):  # the value of type ty at byte offset (an i64 value or a constant) after base
                offset = offset if isinstance(offset, ir.Value) else ir.Constant(i64, offset)
                return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)

            def spread(v, ty):  # a scalar -> the vector of it
                one = builder.insert_element(ir.Constant(ty, None), v, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(ty, None), ir.Constant(v8i, [0] * 8))

            n_blocks = builder.udiv(a.x.shape(0), ir.Constant(i64, 256))
            total = cgutils.alloca_once_value(builder, ir.Constant(v8d, None))
            with cgutils.for_range(builder, n_blocks) as loop:
                block = builder.gep(row_, [builder.mul(loop.index, ir.Constant(i64, block_bytes))])
                x_block = builder.mul(loop.index, ir.Constant(i64, 256 * x_bytes))
                d = builder.fpext(builder.bitcast(at(block, 0, ir.IntType(16)), ir.HalfType()), f32)
                sums = [ir.Constant(v8x, None)] * 4
                for c in range(8):
                    aux = at(block, aux_byte + aux_step * c, i32)
                    high = builder.uitofp(builder.lshr(aux, ir.Constant(i32, 28)), f32)
                    scale = builder.fmul(builder.fmul(d, builder.fadd(ir.Constant(f32, 0.5), high)), ir.Constant(f32, unit))
                    for g in range(4):
                        index = lambda k: builder.zext(at(block, grid_byte + 8 * c + entries * g + k, I8), i64)
                        if entries == 1:
                            values = at(grid_, builder.mul(index(0), ir.Constant(i64, 32)), v8f)
                        else:
                            low, up = (at(grid_, builder.mul(index(k), ir.Constant(i64, 16)), ir.VectorType(f32, 4)) for k in (0, 1))
                            values = builder.shuffle_vector(low, up, ir.Constant(v8i, list(range(8))))
                        sign_index = builder.zext(builder.and_(builder.lshr(aux, ir.Constant(i32, 7 * g)), ir.Constant(i32, 127)), i64)
                        signs = at(signs_, builder.mul(sign_index, ir.Constant(i64, 32)), v8i)
                        weights = builder.bitcast(builder.xor(builder.bitcast(builder.fmul(values, spread(scale, v8f)), v8i), signs), v8f)
                        if x_ty != f32:
                            weights = builder.fpext(weights, v8x)
                        xs = at(x_, builder.add(x_block, ir.Constant(i64, (32 * c + 8 * g) * x_bytes)), v8x)
                        sums[g] = builder.call(fma, [weights, xs, sums[g]])
                block_sum = builder.fadd(builder.fadd(sums[0], sums[1]), builder.fadd(sums[2], sums[3]))
                widened = block_sum if x_ty == f64 else builder.fpext(block_sum, v8d)
                builder.store(builder.fadd(builder.load(total), widened), total)
            lanes = builder.load(total)
            out = builder.extract_element(lanes, ir.Constant(i32, 0))
            for k in range(1, 8):
                out = builder.fadd(out, builder.extract_element(lanes, ir.Constant(i32, k)))
            return out
        if (row.ndim == x.ndim == 1 and row.dtype == types.uint8 and x.dtype in (types.float32, types.float64)
                and grid.ndim == sign_bits.ndim == 2 and grid.dtype == types.float32 and sign_bits.dtype == types.uint32
                and all(a.layout == "C" for a in (row, x, grid, sign_bits))):
            return types.float64(row, x, grid, sign_bits), codegen
    xxs_row.__name__ = xxs_row.__qualname__ = name  # numba tells intrinsics apart by name
    return intrinsic(xxs_row)


iq2_xxs_row = xxs_row_intrinsic("iq2_xxs_row", qb.IQ2_XXS.size, qb.IQ2_XXS.qs, qb.IQ2_XXS.qs + 4, 8, 1, 0.25)
iq3_xxs_row = xxs_row_intrinsic("iq3_xxs_row", qb.IQ3_XXS.size, qb.IQ3_XXS.qs, qb.IQ3_XXS.scales_and_signs, 4, 2, 0.5)


@njit(cache=True)
def row_iq2_xxs(qtype, row, x, xsum16, tab):  # 66 bytes: f16 d, 8 x (4 grid bytes, u32: 4 x 7 sign bits, 4-bit scale)
    return iq2_xxs_row(row, x, tab.iq2xxs_grid, tab.sign_bits)


@njit(cache=True)
def decode_iq3_xxs(qtype, row, start, n, out, tab):  # 98 bytes: f16 d, grid bytes[64], 8 x u32 signs+scale
    blk, signed = row.reshape(-1, qb.IQ3_XXS.size)[start // 256], tab.iq3xxs_signed
    d = tab.halves[u16(blk, qb.IQ3_XXS.d)]
    for ib in range(8):
        aux = u32(blk, qb.IQ3_XXS.scales_and_signs + 4 * ib)
        db = xxs_scale(d, aux, 0.5)
        for l in range(4):  # two grid rows of 4 take the low and the high four of 8 sign bits
            ks = np.int64(tab.ksigns[(aux >> (7 * l)) & 127])
            lo = signed[np.int64(blk[qb.IQ3_XXS.qs + 8 * ib + 2 * l]) * 16 + (ks & 15)]
            hi = signed[np.int64(blk[qb.IQ3_XXS.qs + 1 + 8 * ib + 2 * l]) * 16 + (ks >> 4)]
            for j in range(lo.shape[0]):
                out[32 * ib + 8 * l + j] = db * np.float32(lo[j])
                out[32 * ib + 8 * l + 4 + j] = db * np.float32(hi[j])


@njit(cache=True)
def row_iq3_xxs(qtype, row, x, xsum16, tab):  # 98 bytes: f16 d, 64 grid bytes (4 values each), 8 x u32 signs + scale
    return iq3_xxs_row(row, x, tab.iq3xxs_grid, tab.sign_bits)


@njit(cache=True)
def iq1_scale(d, s):  # f16 d, 3-bit scale -> d (2 s + 1)
    return d * np.float32(2 * s + 1)


@njit(cache=True)
def iq1_delta(bit):  # the sign bit of an IQ1 group -> its float32 shift of the grid values
    return np.float32(-0.125) if bit else np.float32(0.125)


@njit(cache=True)
def iq1_m_d(blk):  # IQ1_M block -> the bits of its f16 d, the top nibbles of its four u16 scales
    at = qb.IQ1_M.scales
    return (u16(blk, at) >> 12) | ((u16(blk, at + 2) >> 12) << 4) | ((u16(blk, at + 4) >> 12) << 8) | (u16(blk, at + 6) >> 12 << 12)


@njit(cache=True)
def iq1_group(qtype, blk, g, tab):  # group g of 8 values -> (grid row, dl, delta) of IQ1_S 50 / IQ1_M 56 bytes
    if qtype == IQ1_S:  # f16 d, qs[32], u16 qh[8]: qh of 32-value block ib = 3 high grid bits x 4, scale, sign
        qh = u16(blk, qb.IQ1_S.qh + 2 * (g // 4))
        dl = iq1_scale(tab.halves[u16(blk, qb.IQ1_S.d)], (qh >> 12) & 7)
        return tab.iq1s_grid[np.int64(blk[qb.IQ1_S.qs + g]) | (((qh >> (3 * (g % 4))) & 7) << 8)], dl, iq1_delta(qh & 0x8000)
    # IQ1_M: qs[32], qh[16] (a nibble per group: 3 high grid bits, sign), u16 scales[4]: 3 bits per 16 values
    qh = (np.int64(blk[qb.IQ1_M.qh + g // 2]) >> (4 * (g % 2))) & 15
    s = (u16(blk, qb.IQ1_M.scales + 2 * (g // 8)) >> (3 * (g // 2 % 4))) & 7
    dl = iq1_scale(tab.halves[iq1_m_d(blk)], s)
    return tab.iq1s_grid[np.int64(blk[qb.IQ1_M.qs + g]) | ((qh & 7) << 8)], dl, iq1_delta(qh & 8)


@njit(cache=True)
def decode_iq1(qtype, row, start, n, out, tab):  # IQ1_S, IQ1_M: w = dl (grid + delta)
    blk = row.reshape(-1, qb.IQ1_S.size if qtype == IQ1_S else qb.IQ1_M.size)[start // 256]
    for g in range(32):
        grid, dl, delta = iq1_group(qtype, blk, g, tab)
        for j in range(8):
            out[8 * g + j] = dl * (np.float32(grid[j]) + delta)


@njit(cache=True, fastmath=FAST)
def row_iq1(qtype, row, x, xsum16, tab):  # IQ1_S 50 / IQ1_M 56 bytes: sum dl (grid + delta) x per 16 values
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, qb.IQ1_S.size if qtype == IQ1_S else qb.IQ1_M.size), x.reshape(nsb, 32, 8)
    acc = 0.0
    for sb in range(nsb):
        for g in range(0, 32, 2):  # two groups share dl (IQ1_S: four)
            grid0, dl, delta0 = iq1_group(qtype, blk[sb], g, tab)
            grid1, _, delta1 = iq1_group(qtype, blk[sb], g + 1, tab)
            s = x.dtype.type(0)
            for j in range(grid0.shape[0]):
                s += (np.float32(grid0[j]) + delta0) * xs[sb, g, j] + (np.float32(grid1[j]) + delta1) * xs[sb, g + 1, j]
            acc += np.float64(dl) * s
    return acc


@njit(cache=True)
def iq2_xs_signed(blk, g, tab):  # IQ2_XS group g of 8 values -> its grid row times signs
    # 74 bytes: f16 d, u16 qs[32] (9-bit grid row, 7 sign bits), 4-bit scales[16] (per 16 values)
    return tab.iq2xs_signed[u16(blk, qb.IQ2_XS.qs + 2 * g)]


@njit(cache=True)
def iq2_s_signed(blk, g, tab):  # IQ2_S group g of 8 values -> its grid row times signs
    # 82 bytes: f16 d, qs[32], signs[32], qh[8] (2 high grid bits per group), 4-bit scales[16]
    high = (np.int64(blk[qb.IQ2_S.qh + g // 4]) >> (2 * (g % 4))) & 3  # qs: 32 grid bytes, then 32 of signs
    return tab.iq2s_signed[(np.int64(blk[qb.IQ2_S.qs + g]) | (high << 8)) * 256 + np.int64(blk[qb.IQ2_S.qs + 32 + g])]


@njit(cache=True)
def iq2_scales(blk, scales_at, ib, tab):  # 32-value block ib -> gguf-py's d (1/2 + s) / 4 of its two halves
    d, scales = tab.halves[u16(blk, qb.IQ2_XS.d)], np.int64(blk[scales_at + ib])  # IQ2_S's d at the same byte
    return xxs_scale(d, (scales & 15) << 28, 0.25), xxs_scale(d, (scales >> 4) << 28, 0.25)


@njit(cache=True)
def scaled_group(db, signed, out):  # out[:8] = db * (grid * sign), which is gguf-py's (db * grid) * sign
    for j in range(8):
        out[j] = db * np.float32(signed[j])


@njit(cache=True)
def decode_iq2_xs(qtype, row, start, n, out, tab):  # 74 bytes: w = db grid sign
    blk = row.reshape(-1, qb.IQ2_XS.size)[start // 256]
    for g in range(32):
        scaled_group(iq2_scales(blk, qb.IQ2_XS.scales, g // 4, tab)[g // 2 % 2], iq2_xs_signed(blk, g, tab), out[8 * g:])


@njit(cache=True)
def decode_iq2_s(qtype, row, start, n, out, tab):  # 82 bytes: w = db grid sign
    blk = row.reshape(-1, qb.IQ2_S.size)[start // 256]
    for g in range(32):
        scaled_group(iq2_scales(blk, qb.IQ2_S.scales, g // 4, tab)[g // 2 % 2], iq2_s_signed(blk, g, tab), out[8 * g:])


# The IQ2_XS and IQ2_S row helpers are inlined into row_iq2 (inline="always"): as calls behind a
# qtype branch per group of 8 they made the rows 15-40x slower (measured).

@njit(cache=True, fastmath=FAST, inline="always")
def iq2_block_dot(g0, g1, g2, g3, xs, db_lo, db_hi):  # 4 grid rows times signs [8], xs [4, 8] -> float64
    # the four groups of a 32-value block side by side in one loop (to g0.shape[0], 8, not a literal
    # 8: LLVM unrolls a constant 8-step loop into scalar code before it can vectorize it); a scale per two
    lo = hi = xs.dtype.type(0)
    for j in range(g0.shape[0]):
        lo += np.float32(g0[j]) * xs[0, j] + np.float32(g1[j]) * xs[1, j]
        hi += np.float32(g2[j]) * xs[2, j] + np.float32(g3[j]) * xs[3, j]
    return np.float64(db_lo) * lo + np.float64(db_hi) * hi


@njit(cache=True, fastmath=FAST, inline="always")
def iq2_xs_block(b, ib, xs, tab):  # IQ2_XS super-block b, 32-value block ib . xs [4, 8] -> float64
    db_lo, db_hi = iq2_scales(b, 66, ib, tab)
    g = 4 * ib
    return iq2_block_dot(iq2_xs_signed(b, g, tab), iq2_xs_signed(b, g + 1, tab), iq2_xs_signed(b, g + 2, tab),
                         iq2_xs_signed(b, g + 3, tab), xs, db_lo, db_hi)


@njit(cache=True, fastmath=FAST, inline="always")
def iq2_s_block(b, ib, xs, tab):  # IQ2_S super-block b, 32-value block ib . xs [4, 8] -> float64
    db_lo, db_hi = iq2_scales(b, 74, ib, tab)
    g = 4 * ib
    return iq2_block_dot(iq2_s_signed(b, g, tab), iq2_s_signed(b, g + 1, tab), iq2_s_signed(b, g + 2, tab),
                         iq2_s_signed(b, g + 3, tab), xs, db_lo, db_hi)


@njit(cache=True, fastmath=FAST)
def row_iq2(qtype, row, x, xsum16, tab):  # IQ2_XS 74 / IQ2_S 82 bytes: sum db grid sign x per 16 values
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, qb.IQ2_XS.size if qtype == IQ2_XS else qb.IQ2_S.size), x.reshape(nsb, 8, 4, 8)
    acc = 0.0
    for sb in range(nsb):
        for ib in range(8):
            if qtype == IQ2_XS:
                acc += iq2_xs_block(blk[sb], ib, xs[sb, ib], tab)
            else:
                acc += iq2_s_block(blk[sb], ib, xs[sb, ib], tab)
    return acc


@njit(cache=True)
def iq3_s_rows(blk, g, tab):  # IQ3_S group g of 8 values -> grid rows times signs of values 0..3, 4..7
    qh, signs = np.int64(blk[qb.IQ3_S.qh + g // 4]), np.int64(blk[qb.IQ3_S.signs + g])  # qh bit i % 8: row i's ninth bit
    lo = tab.iq3s_signed[(np.int64(blk[qb.IQ3_S.qs + 2 * g]) | (((qh >> (2 * g % 8)) & 1) << 8)) * 16 + (signs & 15)]
    hi = tab.iq3s_signed[(np.int64(blk[qb.IQ3_S.qs + 1 + 2 * g]) | (((qh >> (2 * g % 8 + 1)) & 1) << 8)) * 16
                         + (signs >> 4)]
    return lo, hi


@njit(cache=True)
def iq3_s_scale(blk, ib, tab):  # IQ3_S 32-value block ib -> d (1 + 2 s)
    s = (np.int64(blk[qb.IQ3_S.scales + ib // 2]) >> (4 * (ib % 2))) & 15
    return tab.halves[u16(blk, qb.IQ3_S.d)] * np.float32(1 + 2 * s)


@njit(cache=True)
def decode_iq3_s(qtype, row, start, n, out, tab):  # 110 bytes: f16 d, qs[64], qh[8], signs[32], 4-bit scales[8]
    blk = row.reshape(-1, qb.IQ3_S.size)[start // 256]
    for g in range(32):
        db = iq3_s_scale(blk, g // 4, tab)
        lo, hi = iq3_s_rows(blk, g, tab)
        for j in range(4):  # db * (grid * sign) is gguf-py's (db * grid) * sign
            out[8 * g + j] = db * np.float32(lo[j])
            out[8 * g + 4 + j] = db * np.float32(hi[j])


@njit(cache=True, fastmath=FAST)
def row_iq3_s(qtype, row, x, xsum16, tab):  # 110 bytes: f16 d, qs[64], qh[8], signs[32], 4-bit scales[8]
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, qb.IQ3_S.size), x.reshape(nsb, 8, 4, 2, 4)
    acc = 0.0
    for sb in range(nsb):
        for ib in range(8):
            s = x.dtype.type(0)
            for l in range(4):
                lo, hi = iq3_s_rows(blk[sb], 4 * ib + l, tab)
                for j in range(lo.shape[0]):  # a runtime length (4), as in iq2_block_dot
                    s += np.float32(lo[j]) * xs[sb, ib, l, 0, j] + np.float32(hi[j]) * xs[sb, ib, l, 1, j]
            acc += np.float64(iq3_s_scale(blk[sb], ib, tab)) * s
    return acc


# ---------------------------------------------------------------------------------------------
# Ternary: w = d (q - 1) with q in 0..2, in 256-value super-blocks: TQ1_0 packs five base-3
# digits to a byte, TQ2_0 2-bit fields. Rows sum in the activations' dtype within the super-block.

TQ1_0 = int(GT.TQ1_0)


@njit(cache=True)
def trit(byte, power):  # TQ1_0: a byte holding five base-3 digits -> the digit that power (3^k) brings to the top
    return (((np.int64(byte) * power) & 255) * 3 >> 8) - 1  # q - 1 in -1, 0, 1


# TQ1_0's 54 bytes: qs[48], qh[4], f16 d. Parts (first byte, bytes, digits): digit k of byte at + l
# is value 5 at + k nbytes + l (qs[0:32] holds values 0..159, qs[32:48] 160..239, qh 240..255).
TQ1_0_PARTS = ((qb.TQ1_0.qs, 32, 5), (qb.TQ1_0.qs + 32, 16, 5), (qb.TQ1_0.qh, 4, 4))


@njit(cache=True)
def tq2_0_q(blk, h, k, l):  # TQ2_0 (66 bytes: qs[64], f16 d) -> q - 1 of value 128 h + 32 k + l
    return ((np.int64(blk[qb.TQ2_0.qs + 32 * h + l]) >> (2 * k)) & 3) - 1


@njit(cache=True)
def decode_tq(qtype, row, start, n, out, tab):  # TQ1_0 54 / TQ2_0 66 bytes: w = d (q - 1)
    size, d_at = (qb.TQ1_0.size, qb.TQ1_0.d) if qtype == TQ1_0 else (qb.TQ2_0.size, qb.TQ2_0.d)
    blk = row.reshape(-1, size)[start // 256]
    d = tab.halves[u16(blk, d_at)]
    if qtype == TQ1_0:
        for at, nbytes, digits in TQ1_0_PARTS:
            for k in range(digits):
                for l in range(nbytes):
                    out[5 * at + k * nbytes + l] = d * np.float32(trit(blk[at + l], 3 ** k))
        return
    for h in range(2):
        for k in range(4):
            for l in range(32):
                out[128 * h + 32 * k + l] = d * np.float32(tq2_0_q(blk, h, k, l))


@njit(cache=True, fastmath=FAST)
def trit_dot(qs, xs):  # TQ1_0 bytes [n], x [digits, n] -> sum of (digit k of qs[l] - 1) xs[k, l]
    s = xs.dtype.type(0)
    for k in range(xs.shape[0]):
        power = 3 ** k
        for l in range(qs.shape[0]):
            s += xs.dtype.type(trit(qs[l], power)) * xs[k, l]
    return s


@njit(cache=True, fastmath=FAST)
def row_tq(qtype, row, x, xsum16, tab):  # TQ1_0 54 / TQ2_0 66 bytes: w = d (q - 1)
    size, d_at = (qb.TQ1_0.size, qb.TQ1_0.d) if qtype == TQ1_0 else (qb.TQ2_0.size, qb.TQ2_0.d)
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, size), x.reshape(nsb, 256)
    acc = 0.0
    for sb in range(nsb):
        s = x.dtype.type(0)
        if qtype == TQ1_0:
            for at, nbytes, digits in TQ1_0_PARTS:
                s += trit_dot(blk[sb, at:at + nbytes], xs[sb, 5 * at:5 * at + digits * nbytes].reshape(digits, nbytes))
        else:
            for h in range(2):
                for k in range(4):
                    for l in range(32):
                        s += x.dtype.type(tq2_0_q(blk[sb], h, k, l)) * xs[sb, 128 * h + 32 * k + l]
        acc += np.float64(half_at(blk, sb, d_at, tab.halves)) * s
    return acc


# ---------------------------------------------------------------------------------------------
# The table: every type with a kernel -> its decoder and row kernel

Kernels = namedtuple("Kernels", "decode row")

KERNELS = {
    GT.F32: Kernels(decode_float, row_float),
    GT.F16: Kernels(decode_float, row_float),
    GT.BF16: Kernels(decode_float, row_float),
    GT.Q8_0: Kernels(decode_q8_0, row_q8_0),
    GT.Q4_0: Kernels(decode_nibbles32, row_blocks32),
    GT.Q5_0: Kernels(decode_nibbles32, row_blocks32),
    GT.IQ4_NL: Kernels(decode_nibbles32, row_blocks32),
    GT.Q4_1: Kernels(decode_q45_1, row_q45_1),
    GT.Q5_1: Kernels(decode_q45_1, row_q45_1),
    GT.Q1_0: Kernels(decode_q1_0, row_q1_0),
    GgmlType.Q2_0: Kernels(decode_q2_0, row_q2_0),  # the pinned ggml's; not in gguf-py
    GT.Q2_K: Kernels(decode_q2_k, row_q2_k),
    GT.Q3_K: Kernels(decode_q3_k, row_q3_k),
    GT.Q4_K: Kernels(decode_q45_k, row_q45_k),
    GT.Q5_K: Kernels(decode_q45_k, row_q45_k),
    GT.Q6_K: Kernels(decode_q6_k, row_q6_k),
    GT.IQ4_XS: Kernels(decode_iq4_xs, row_iq4_xs),
    GT.IQ2_XXS: Kernels(decode_iq2_xxs, row_iq2_xxs),
    GT.IQ3_XXS: Kernels(decode_iq3_xxs, row_iq3_xxs),
    GT.IQ1_S: Kernels(decode_iq1, row_iq1),
    GT.IQ1_M: Kernels(decode_iq1, row_iq1),
    GT.IQ2_XS: Kernels(decode_iq2_xs, row_iq2),
    GT.IQ2_S: Kernels(decode_iq2_s, row_iq2),
    GT.IQ3_S: Kernels(decode_iq3_s, row_iq3_s),
    GT.TQ1_0: Kernels(decode_tq, row_tq),
    GT.TQ2_0: Kernels(decode_tq, row_tq),
}
KERNEL_TYPES = frozenset(KERNELS)
KERNEL_IDS = tuple(sorted(int(t) for t in KERNELS))


class TypeWithoutKernel(UnsupportedTensorType):
    """A tensor type id that KERNELS has no kernel for: a type the loader accepts but these
    kernels do not take (MXFP4, NVFP4), or an id that is no type at all."""

    def __init__(self, type_id):
        known = {int(t): t.name for t in [*GT, *GgmlType]}
        super().__init__(f"no numba kernel for tensor type {known.get(type_id, f'id {type_id}')}")
        self.type_id = type_id


def dispatcher(kernel_of):  # {type: njit kernel(qtype, ...)} -> njit (qtype, args) -> kernel(qtype, *args)
    """numba cannot index a table of functions at run time, so the table becomes a chain of steps,
    one per kernel, which numba inlines into one branch per kernel: the first whose types hold qtype
    runs, the last raises TypeWithoutKernel for any other id (a last step that only raised would
    make every result an Optional). The arguments travel as one tuple: numba inlines no call with
    *args. Steps left as calls compiled 2.2x slower (each step's module re-optimizes every kernel
    after it), and a function chosen at run time would be an argument that numba's cache cannot
    key: every process would compile the products anew."""
    types_of = {}
    for qtype, kernel in kernel_of.items():
        types_of.setdefault(kernel, []).append(int(qtype))
    *firsts, (kernel, ids) = types_of.items()
    step = last_step(tuple(ids), kernel)
    for kernel, ids in reversed(firsts):
        step = first_step(tuple(ids), kernel, step)
    return step


def first_step(ids, kernel, otherwise):  # -> njit (qtype, args): kernel if qtype is one of ids, else otherwise
    @njit(inline="always")
    def step(qtype, args):
        if qtype in ids:
            return kernel(qtype, *args)
        return otherwise(qtype, args)
    return step


def last_step(ids, kernel):  # -> njit (qtype, args): kernel if qtype is one of ids, else TypeWithoutKernel
    @njit(inline="always")
    def step(qtype, args):
        if qtype not in ids:
            raise TypeWithoutKernel(qtype)
        return kernel(qtype, *args)
    return step


decoder_of = dispatcher({t: k.decode for t, k in KERNELS.items()})
row_kernel_of = dispatcher({t: k.row for t, k in KERNELS.items()})


@njit(cache=True)
def decode_chunk(qtype, row, start, n, out, tab):  # qtype's decoder (KERNELS) on values [start, start + n) of row
    decoder_of(qtype, (row, start, n, out, tab))


@njit(cache=True)
def row_dot(qtype, row, x, xsum16, tab):  # qtype's row kernel (KERNELS): row [row_bytes] . x [n_in] -> float64
    return row_kernel_of(qtype, (row, x, xsum16, tab))


@njit(cache=True)
def check_kernel_type(qtype):  # raises TypeWithoutKernel unless KERNELS has qtype
    # before the products' parallel loops: an exception raised inside one reaches Python as a
    # SystemError without its type
    if qtype not in KERNEL_IDS:
        raise TypeWithoutKernel(qtype)


# ---------------------------------------------------------------------------------------------
# Products

ROWS_PER_TASK = 16


@njit(cache=True, parallel=True)
def matmul_rows(qtype, blocks, x, xsum16, out, tab):  # blocks [n_out, row_bytes], x [T, n_in] -> out [T, n_out]
    """Each row straight from its blocks, once per row of x: the decode path (T of 1 to a few),
    where reading the weights is all the work."""
    check_kernel_type(qtype)
    T, n_out = x.shape[0], blocks.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for r in range(task * ROWS_PER_TASK, min(task * ROWS_PER_TASK + ROWS_PER_TASK, n_out)):
            for t in range(T):
                out[t, r] = row_dot(qtype, blocks[r], x[t], xsum16[t], tab)


TILE_ROWS, TILE_COLS = 32, 1024  # a tile of decoded weights in x's dtype: 128 KB (float32), held in L2


@njit(cache=True, fastmath=FAST)
def product_4x4(w, r, x, t, k0, n, acc):  # acc[r:r+4, t:t+4] += w[r:r+4, :n] . x[t:t+4, k0:k0+n]
    # 16 sums side by side: each loaded weight and activation serves four products
    w0, w1, w2, w3 = w[r, :n], w[r + 1, :n], w[r + 2, :n], w[r + 3, :n]
    x0, x1, x2, x3 = x[t, k0:k0 + n], x[t + 1, k0:k0 + n], x[t + 2, k0:k0 + n], x[t + 3, k0:k0 + n]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = x.dtype.type(0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = x.dtype.type(0)
    for k in range(n):
        b0, b1, b2, b3 = x0[k], x1[k], x2[k], x3[k]
        c = w0[k]
        a00 += c * b0; a01 += c * b1; a02 += c * b2; a03 += c * b3  # noqa: E702
        c = w1[k]
        a10 += c * b0; a11 += c * b1; a12 += c * b2; a13 += c * b3  # noqa: E702
        c = w2[k]
        a20 += c * b0; a21 += c * b1; a22 += c * b2; a23 += c * b3  # noqa: E702
        c = w3[k]
        a30 += c * b0; a31 += c * b1; a32 += c * b2; a33 += c * b3  # noqa: E702
    acc[r, t] += a00; acc[r, t + 1] += a01; acc[r, t + 2] += a02; acc[r, t + 3] += a03  # noqa: E702
    acc[r + 1, t] += a10; acc[r + 1, t + 1] += a11; acc[r + 1, t + 2] += a12; acc[r + 1, t + 3] += a13  # noqa: E702
    acc[r + 2, t] += a20; acc[r + 2, t + 1] += a21; acc[r + 2, t + 2] += a22; acc[r + 2, t + 3] += a23  # noqa: E702
    acc[r + 3, t] += a30; acc[r + 3, t + 1] += a31; acc[r + 3, t + 2] += a32; acc[r + 3, t + 3] += a33  # noqa: E702


@njit(cache=True)
def tile_product(w, rows, x, k0, n, acc):  # acc[:rows, :T] += w[:rows, :n] . x[:, k0:k0+n]
    T = x.shape[0]
    full_rows, full_t = rows - rows % 4, T - T % 4
    for t in range(0, full_t, 4):
        for r in range(0, full_rows, 4):
            product_4x4(w, r, x, t, k0, n, acc)
    for r in range(rows):  # the edges: rows and tokens left over from the blocks of four
        for t in range(T):
            if r >= full_rows or t >= full_t:
                acc[r, t] += dot(w[r, :n], x[t, k0:k0 + n])


@njit(cache=True, parallel=True)
def matmul_tiles(qtype, blocks, x, out, tab):  # blocks [n_out, row_bytes], x [T, n_in] -> out [T, n_out]
    """Decode a tile of TILE_ROWS x TILE_COLS exact weights once and multiply it with all T rows of
    x: the prefill path, where the products, not the weights, are the work. Sums in x's dtype
    within a tile, in float64 across tiles."""
    check_kernel_type(qtype)
    T, n_in = x.shape
    n_out = blocks.shape[0]
    for task in prange((n_out + TILE_ROWS - 1) // TILE_ROWS):
        r0 = task * TILE_ROWS
        rows = min(TILE_ROWS, n_out - r0)
        w = np.empty((TILE_ROWS, TILE_COLS), x.dtype)
        acc = np.zeros((TILE_ROWS, T), np.float64)
        for k0 in range(0, n_in, TILE_COLS):
            n = min(TILE_COLS, n_in - k0)
            for i in range(rows):
                for c in range(k0, k0 + n, CHUNK):
                    decode_chunk(qtype, blocks[r0 + i], c, min(CHUNK, n_in - c), w[i, c - k0:], tab)
            tile_product(w, rows, x, k0, n, acc)
        for i in range(rows):
            for t in range(T):
                out[t, r0 + i] = acc[i, t]


@njit(cache=True, parallel=True)
def dequantize_rows(qtype, blocks, n_in, first, out, tab):  # rows first.. of blocks -> out [R, n_in]
    """Exact float32 weights (what gguf-py's dequantize gives; widened when out is float64)."""
    check_kernel_type(qtype)
    for i in prange(out.shape[0]):
        for start in range(0, n_in, CHUNK):
            decode_chunk(qtype, blocks[first + i], start, min(CHUNK, n_in - start), out[i, start:], tab)
