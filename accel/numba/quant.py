"""Products with GGUF weights straight from their quantized blocks, in numba. No dequantized
matrix ever exists, and every dot product accumulates in float64 and rounds once to the activation
dtype, as reference/ops.py linear does, so the result is the reference's up to float64 summation
order (bit-identical logits on every committed tiny model).

Two routes:
- matmul_rows (decode): each weight row is read once per row of x and multiplied block by block
  in integer-factored form, sum_i w_i x_i = sum_blocks scale * sum_j q_j x_j (see the comment
  above the row functions for why that is exact).
- matmul_tiles (prefill): a tile of weights is decoded once into float64 by the decoders below,
  which reproduce gguf-py's dequantization bit for bit (the same float32 operations in the same
  order), and multiplied with every row of x by a 4x4 register-blocked kernel.

Block layouts follow ggml-common.h / ggml-quants.c (dequantize_row_*) and gguf-py's quants.py; the
IQ grids, sign table and non-linear 4-bit values are taken from gguf-py rather than copied.
numba has no float16, so half and bfloat16 bits are decoded through 65536-entry float32 tables.
"""
from collections import namedtuple

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import quants
from numba import njit, prange

CHUNK = 256  # values decoded per step: one K-quant super-block, or eight 32-value blocks

F32, F16, BF16 = int(GT.F32), int(GT.F16), int(GT.BF16)
Q4_0, Q5_0, Q8_0, IQ4_NL = int(GT.Q4_0), int(GT.Q5_0), int(GT.Q8_0), int(GT.IQ4_NL)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(GT.Q2_K), int(GT.Q3_K), int(GT.Q4_K), int(GT.Q5_K), int(GT.Q6_K)
IQ4_XS, IQ3_XXS, IQ2_XXS = int(GT.IQ4_XS), int(GT.IQ3_XXS), int(GT.IQ2_XXS)

KERNEL_TYPES = frozenset(GT(t) for t in (F32, F16, BF16, Q4_0, Q5_0, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K,
                                         Q5_K, Q6_K, IQ4_XS, IQ3_XXS, IQ2_XXS))

Tables = namedtuple("Tables", "halves bfloats iq2xxs_grid iq3xxs_grid ksigns sign_rows kvalues")


def lookup_tables():  # -> Tables, every entry a float32/uint8 array
    every_u16 = np.arange(1 << 16, dtype=np.uint16)
    quants.IQ2_XXS.init_grid()
    quants.IQ3_XXS.init_grid()
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).copy()  # 7 sign bits -> 8 (even parity)
    return Tables(halves=every_u16.view(np.float16).astype(np.float32),
                  bfloats=(every_u16.astype(np.uint32) << 16).view(np.float32),
                  iq2xxs_grid=np.ascontiguousarray(quants.IQ2_XXS.grid.reshape(256, 8), np.float32),
                  iq3xxs_grid=np.ascontiguousarray(quants.IQ3_XXS.grid.reshape(256, 4), np.float32),
                  ksigns=ksigns,
                  sign_rows=np.where((ksigns[:, None] >> np.arange(8)) & 1, -1.0, 1.0),  # [128, 8] of +-1
                  kvalues=np.array(quants.IQ4_NL.kvalues, np.float32))


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
def k_scale_min(row, o, j):  # 12 packed bytes at row[o] -> 6-bit (scale, min) of sub-block j (Q4_K, Q5_K)
    if j < 4:
        return np.int64(row[o + j]) & 63, np.int64(row[o + 4 + j]) & 63
    high = np.int64(row[o + 4 + j])  # bytes 8..11 hold the low 4 bits; the top 2 bits sit in bytes 0..7
    return (high & 15) | ((np.int64(row[o + j - 4]) >> 2) & 48), (high >> 4) | ((np.int64(row[o + j]) >> 2) & 48)


# ---------------------------------------------------------------------------------------------
# Decoders: values [start, start + n) of one row -> out[:n] (float64 holding gguf-py's float32
# values). start is a multiple of CHUNK, n a multiple of the block size and at most CHUNK. No
# fastmath here: a contracted `dl * q - ml` would round once where gguf-py rounds twice.

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


@njit(cache=True)
def decode_q8_0(row, start, n, out, tab):  # 34-byte blocks: f16 d, int8 q[32]; w = q * d
    for b in range(n // 32):
        o = (start // 32 + b) * 34
        d = tab.halves[u16(row, o)]
        for j in range(32):
            out[b * 32 + j] = np.float32(i8(row[o + 2 + j])) * d


@njit(cache=True)
def decode_nibbles32(qtype, row, start, n, out, tab):  # Q4_0, Q5_0, IQ4_NL: low nibbles are values 0..15
    size = 22 if qtype == Q5_0 else 18
    qs_at = 6 if qtype == Q5_0 else 2
    for b in range(n // 32):
        o = (start // 32 + b) * size
        d = tab.halves[u16(row, o)]
        qh = u32(row, o + 2) if qtype == Q5_0 else 0
        for j in range(32):
            q = (np.int64(row[o + qs_at + j % 16]) >> (4 * (j // 16))) & 15
            if qtype == Q4_0:
                w = d * np.float32(q - 8)
            elif qtype == Q5_0:
                w = d * np.float32((q | (((qh >> j) & 1) << 4)) - 16)
            else:
                w = d * tab.kvalues[q]
            out[b * 32 + j] = w


@njit(cache=True)
def decode_q2_k(row, start, n, out, tab):  # 84 bytes: scales[16], qs[64], f16 d, f16 dmin
    sb, blk, w = start // 256, row.reshape(-1, 84), out[:256].reshape(2, 4, 2, 16)
    d, dmin = half_at(blk, sb, 80, tab.halves), half_at(blk, sb, 82, tab.halves)
    for h in range(2):
        for s in range(4):
            for part in range(2):
                sc = np.int64(blk[sb, h * 8 + s * 2 + part])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                for l in range(16):
                    q = (np.int64(blk[sb, 16 + h * 32 + part * 16 + l]) >> (2 * s)) & 3
                    w[h, s, part, l] = dl * np.float32(q) - ml


@njit(cache=True)
def decode_q3_k(row, start, n, out, tab):  # 110 bytes: hmask[32], qs[64], scales[12], f16 d
    o = start // 256 * 110
    d = tab.halves[u16(row, o + 108)]
    for e in range(256):
        i = e // 16
        low = (np.int64(row[o + 96 + i % 8]) >> (4 * (i // 8))) & 15
        high = (np.int64(row[o + 104 + i % 4]) >> (2 * (i // 4))) & 3
        dl = d * np.float32((low | (high << 4)) - 32)
        q = (np.int64(row[o + 32 + e // 128 * 32 + e % 32]) >> (2 * (e % 128 // 32))) & 3
        if (np.int64(row[o + e % 32]) >> (e // 32)) & 1 == 0:  # a clear high bit means q - 4
            q -= 4
        out[e] = dl * np.float32(q)


@njit(cache=True)
def decode_q45_k(qtype, row, start, n, out, tab):  # Q4_K 144 / Q5_K 176 bytes: d, dmin, scales[12], (qh[32]), qs[128]
    size, qs_at = (144, 16) if qtype == Q4_K else (176, 48)
    sb, blk, w = start // 256, row.reshape(-1, size), out[:256].reshape(8, 32)
    d, dmin = half_at(blk, sb, 0, tab.halves), half_at(blk, sb, 2, tab.halves)
    for j in range(8):
        sc, m = k_scale_min(blk[sb], 4, j)
        dl, ml = d * np.float32(sc), dmin * np.float32(m)
        shift = 4 * (j % 2)
        for l in range(32):
            q = (np.int64(blk[sb, qs_at + j // 2 * 32 + l]) >> shift) & 15
            if qtype == Q5_K:
                q |= ((np.int64(blk[sb, 16 + l]) >> j) & 1) << 4
            w[j, l] = dl * np.float32(q) - ml


@njit(cache=True)
def decode_q6_k(row, start, n, out, tab):  # 210 bytes: ql[128], qh[64], int8 scales[16], f16 d
    sb, blk, w = start // 256, row.reshape(-1, 210), out[:256].reshape(2, 4, 2, 16)
    sc = row.view(np.int8).reshape(-1, 210)
    d = half_at(blk, sb, 208, tab.halves)
    for h in range(2):
        for part in range(2):
            d0, d1 = d * np.float32(sc[sb, 192 + h * 8 + part]), d * np.float32(sc[sb, 194 + h * 8 + part])
            d2, d3 = d * np.float32(sc[sb, 196 + h * 8 + part]), d * np.float32(sc[sb, 198 + h * 8 + part])
            for l in range(16):
                lo0 = np.int64(blk[sb, h * 64 + part * 16 + l])
                lo1 = np.int64(blk[sb, h * 64 + 32 + part * 16 + l])
                qh = np.int64(blk[sb, 128 + h * 32 + part * 16 + l])
                w[h, 0, part, l] = d0 * np.float32(((lo0 & 15) | ((qh & 3) << 4)) - 32)
                w[h, 1, part, l] = d1 * np.float32(((lo1 & 15) | ((qh & 12) << 2)) - 32)
                w[h, 2, part, l] = d2 * np.float32(((lo0 >> 4) | (qh & 48)) - 32)
                w[h, 3, part, l] = d3 * np.float32(((lo1 >> 4) | ((qh >> 2) & 48)) - 32)


@njit(cache=True)
def decode_iq4_xs(row, start, n, out, tab):  # 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128]
    o = start // 256 * 136
    d = tab.halves[u16(row, o)]
    scales_h = u16(row, o + 2)
    for j in range(8):
        ls = ((np.int64(row[o + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        for l in range(32):
            q = (np.int64(row[o + 8 + j * 16 + l % 16]) >> (4 * (l // 16))) & 15
            out[j * 32 + l] = dl * tab.kvalues[q]


@njit(cache=True)
def decode_iq2_xxs(row, start, n, out, tab):  # 66 bytes: f16 d, 8 x (4 grid bytes, u32 signs+scale)
    o = start // 256 * 66
    d = tab.halves[u16(row, o)]
    for ib in range(8):
        a = o + 2 + 8 * ib
        aux = u32(row, a + 4)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
        for l in range(4):
            grid = tab.iq2xxs_grid[np.int64(row[a + l])]
            signs = tab.ksigns[(aux >> (7 * l)) & 127]
            for j in range(8):
                w = db * grid[j]
                out[ib * 32 + l * 8 + j] = -w if (signs >> j) & 1 else w


@njit(cache=True)
def decode_iq3_xxs(row, start, n, out, tab):  # 98 bytes: f16 d, grid bytes[64], 8 x u32 signs+scale
    o = start // 256 * 98
    d = tab.halves[u16(row, o)]
    for ib in range(8):
        aux = u32(row, o + 66 + 4 * ib)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
        for l in range(4):
            signs = tab.ksigns[(aux >> (7 * l)) & 127]
            for j in range(8):
                w = db * tab.iq3xxs_grid[np.int64(row[o + 2 + 8 * ib + 2 * l + j // 4]), j % 4]
                out[ib * 32 + l * 8 + j] = -w if (signs >> j) & 1 else w


@njit(cache=True)
def decode_chunk(qtype, row, start, n, out, tab):  # the decoder of qtype
    if qtype == F32 or qtype == F16 or qtype == BF16:
        decode_float(qtype, row, start, n, out, tab)
    elif qtype == Q8_0:
        decode_q8_0(row, start, n, out, tab)
    elif qtype == Q4_0 or qtype == Q5_0 or qtype == IQ4_NL:
        decode_nibbles32(qtype, row, start, n, out, tab)
    elif qtype == Q2_K:
        decode_q2_k(row, start, n, out, tab)
    elif qtype == Q3_K:
        decode_q3_k(row, start, n, out, tab)
    elif qtype == Q4_K or qtype == Q5_K:
        decode_q45_k(qtype, row, start, n, out, tab)
    elif qtype == Q6_K:
        decode_q6_k(row, start, n, out, tab)
    elif qtype == IQ4_XS:
        decode_iq4_xs(row, start, n, out, tab)
    elif qtype == IQ3_XXS:
        decode_iq3_xxs(row, start, n, out, tab)
    elif qtype == IQ2_XXS:
        decode_iq2_xxs(row, start, n, out, tab)


# ---------------------------------------------------------------------------------------------
# Dot products of one quantized row with float64 activations, factored per block:
#     sum_i w_i x_i = sum_blocks scale * sum_j q_j x_j   (- min * sum_j x_j for Q2_K, Q4_K, Q5_K)
# This is exact, not an approximation: every dequantized weight is a product of an f16 scale, a
# small integer scale and a small integer q with at most 23 significant bits (Q6_K: 11 x 8 x 6 bits,
# 2047 * 128 * 32 < 2^23), so gguf-py's float32 weight holds the real product without rounding.
# (The K-quants' `scale * q - min` is exact as well unless a block's d and dmin differ by more than
# about 2^8; then gguf-py rounds that weight by half an ulp and this product does not, an NMSE of
# ~1e-15. None of the Q2_K/Q4_K/Q5_K tensors of the committed models has such a block.)
# The inner sums take integer q and float64 x, so the products are exact too; what is left is
# float64 summation order, as for the reference's BLAS.

# reassoc lets LLVM split the float64 sums into vector lanes, contract fuses a*b+c into an FMA. Both
# only move float64 roundings: every float32 operation in these functions is exact (see above).
FAST = {"reassoc", "contract"}


@njit(cache=True, fastmath=FAST)
def dot(w, x):  # w [n] of any real type, x [n] float64 -> sum w * x
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(w[j]) * x[j]
    return s


@njit(cache=True, fastmath=FAST)
def dot_lut(qs, shift, lut, x):  # sum lut[(qs >> shift) & 15] * x: IQ4 non-linear values
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(lut[(np.int64(qs[j]) >> shift) & 15]) * x[j]
    return s


# The row functions view a row as [blocks, block bytes] and x as [blocks, ..., values] and index
# both with loop counters only: numba then knows every index is non-negative and LLVM vectorizes
# the inner loops (offset arithmetic on a flat row cost a factor 2-4 here).

@njit(cache=True)
def half_at(blk, b, o, halves):  # the f16 at bytes o, o+1 of block b -> float32
    return halves[np.int64(blk[b, o]) | (np.int64(blk[b, o + 1]) << 8)]


@njit(cache=True, fastmath=FAST)
def row_float(qtype, row, x, tab):  # F32, F16, BF16
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


@njit(cache=True, fastmath=FAST)
def row_q8_0(row, x, tab):  # 34-byte blocks: f16 d, int8 q[32]
    nb = x.shape[0] // 32
    blk, qi, xs = row.reshape(nb, 34), row.view(np.int8).reshape(nb, 34), x.reshape(nb, 32)
    acc = 0.0
    for b in range(nb):
        acc += np.float64(half_at(blk, b, 0, tab.halves)) * dot(qi[b, 2:], xs[b])
    return acc


@njit(cache=True, fastmath=FAST)
def row_blocks32(qtype, row, x, tab):  # Q4_0, Q5_0, IQ4_NL: f16 d, (Q5_0: u32 qh), 16 bytes: low nibbles first
    size = 22 if qtype == Q5_0 else 18
    nb = x.shape[0] // 32
    blk, xs, kv = row.reshape(nb, size), x.reshape(nb, 2, 16), tab.kvalues
    acc = 0.0
    for b in range(nb):
        lo = hi = 0.0
        if qtype == Q4_0:
            for l in range(16):
                q = np.int64(blk[b, 2 + l])
                lo += np.float64((q & 15) - 8) * xs[b, 0, l]
                hi += np.float64((q >> 4) - 8) * xs[b, 1, l]
        elif qtype == IQ4_NL:
            for l in range(16):
                q = np.int64(blk[b, 2 + l])
                lo += np.float64(kv[q & 15]) * xs[b, 0, l]
                hi += np.float64(kv[q >> 4]) * xs[b, 1, l]
        else:
            qh = u32(blk[b], 2)  # bit j: the fifth bit of value j
            for l in range(16):
                q = np.int64(blk[b, 6 + l])
                lo += np.float64(((q & 15) | (((qh >> l) & 1) << 4)) - 16) * xs[b, 0, l]
                hi += np.float64(((q >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16) * xs[b, 1, l]
        acc += np.float64(half_at(blk, b, 0, tab.halves)) * (lo + hi)
    return acc


@njit(cache=True, fastmath=FAST)
def row_q2_k(row, x, xsum16, tab):  # 84 bytes: scales[16], qs[64], f16 d, f16 dmin
    # value e is 2 bits of qs[e // 128 * 32 + e % 32] at shift 2 * (e % 128 // 32), scale e // 16
    nsb = x.shape[0] // 256
    blk, xs, sums = row.reshape(nsb, 84), x.reshape(nsb, 2, 4, 2, 16), xsum16.reshape(nsb, 2, 4, 2)
    acc = 0.0
    for sb in range(nsb):
        d, dmin = half_at(blk, sb, 80, tab.halves), half_at(blk, sb, 82, tab.halves)
        for h in range(2):
            for part in range(2):  # values 16 * part .. of each 32 group: another scale
                a0 = a1 = a2 = a3 = 0.0
                for l in range(16):
                    q = np.int64(blk[sb, 16 + h * 32 + part * 16 + l])
                    a0 += np.float64(q & 3) * xs[sb, h, 0, part, l]
                    a1 += np.float64((q >> 2) & 3) * xs[sb, h, 1, part, l]
                    a2 += np.float64((q >> 4) & 3) * xs[sb, h, 2, part, l]
                    a3 += np.float64(q >> 6) * xs[sb, h, 3, part, l]
                for s, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                    sc = np.int64(blk[sb, h * 8 + s * 2 + part])
                    acc += (np.float64(d * np.float32(sc & 15)) * a
                            - np.float64(dmin * np.float32(sc >> 4)) * sums[sb, h, s, part])
    return acc


@njit(cache=True, fastmath=FAST)
def row_q3_k(row, x, tab):  # 110 bytes: hmask[32], qs[64], scales[12], f16 d; q = 2 low bits - 4 unless the hmask bit
    nsb = x.shape[0] // 256
    blk, xs = row.reshape(nsb, 110), x.reshape(nsb, 2, 4, 2, 16)
    acc = 0.0
    for sb in range(nsb):
        d = half_at(blk, sb, 108, tab.halves)
        for h in range(2):
            for part in range(2):
                a0 = a1 = a2 = a3 = 0.0
                for l in range(16):
                    q = np.int64(blk[sb, 32 + h * 32 + part * 16 + l])
                    m = np.int64(blk[sb, part * 16 + l]) >> (4 * h)
                    a0 += np.float64((q & 3) - 4 + 4 * (m & 1)) * xs[sb, h, 0, part, l]
                    a1 += np.float64(((q >> 2) & 3) - 4 + 2 * (m & 2)) * xs[sb, h, 1, part, l]
                    a2 += np.float64(((q >> 4) & 3) - 4 + (m & 4)) * xs[sb, h, 2, part, l]
                    a3 += np.float64((q >> 6) - 4 + ((m >> 1) & 4)) * xs[sb, h, 3, part, l]
                for s, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                    i = h * 8 + s * 2 + part
                    low = (np.int64(blk[sb, 96 + i % 8]) >> (4 * (i // 8))) & 15
                    high = (np.int64(blk[sb, 104 + i % 4]) >> (2 * (i // 4))) & 3
                    acc += np.float64(d * np.float32((low | (high << 4)) - 32)) * a
    return acc


@njit(cache=True, fastmath=FAST)
def row_q45_k(qtype, row, x, xsum16, tab):  # Q4_K 144 / Q5_K 176 bytes: d, dmin, scales[12], (qh[32]), qs[128]
    size, qs_at = (144, 16) if qtype == Q4_K else (176, 48)
    nsb = x.shape[0] // 256
    blk, xs, sums = row.reshape(nsb, size), x.reshape(nsb, 4, 2, 32), xsum16.reshape(nsb, 8, 2)
    acc = 0.0
    for sb in range(nsb):
        d, dmin = half_at(blk, sb, 0, tab.halves), half_at(blk, sb, 2, tab.halves)
        for g in range(4):  # 32 bytes: the low nibbles are sub-block 2g, the high ones 2g + 1
            lo = hi = 0.0
            if qtype == Q4_K:
                for l in range(32):
                    q = np.int64(blk[sb, 16 + g * 32 + l])
                    lo += np.float64(q & 15) * xs[sb, g, 0, l]
                    hi += np.float64(q >> 4) * xs[sb, g, 1, l]
            else:
                for l in range(32):
                    q, qh = np.int64(blk[sb, 48 + g * 32 + l]), np.int64(blk[sb, 16 + l]) >> (2 * g)
                    lo += np.float64((q & 15) | ((qh & 1) << 4)) * xs[sb, g, 0, l]
                    hi += np.float64((q >> 4) | ((qh & 2) << 3)) * xs[sb, g, 1, l]
            for j, a in ((2 * g, lo), (2 * g + 1, hi)):
                sc, m = k_scale_min(blk[sb], 4, j)
                x_sum = sums[sb, j, 0] + sums[sb, j, 1]
                acc += np.float64(d * np.float32(sc)) * a - np.float64(dmin * np.float32(m)) * x_sum
    return acc


@njit(cache=True, fastmath=FAST)
def row_q6_k(row, x, tab):  # 210 bytes: ql[128], qh[64], int8 scales[16], f16 d
    nsb = x.shape[0] // 256
    blk, sc, xs = row.reshape(nsb, 210), row.view(np.int8).reshape(nsb, 210), x.reshape(nsb, 2, 4, 2, 16)
    acc = 0.0
    for sb in range(nsb):
        d = half_at(blk, sb, 208, tab.halves)
        for h in range(2):  # 128 values from ql[64 h..], qh[32 h..]
            for part in range(2):
                a0 = a1 = a2 = a3 = 0.0
                for l in range(16):
                    lo0 = np.int64(blk[sb, h * 64 + part * 16 + l])
                    lo1 = np.int64(blk[sb, h * 64 + 32 + part * 16 + l])
                    qh = np.int64(blk[sb, 128 + h * 32 + part * 16 + l])
                    a0 += np.float64(((lo0 & 15) | ((qh & 3) << 4)) - 32) * xs[sb, h, 0, part, l]
                    a1 += np.float64(((lo1 & 15) | ((qh & 12) << 2)) - 32) * xs[sb, h, 1, part, l]
                    a2 += np.float64(((lo0 >> 4) | (qh & 48)) - 32) * xs[sb, h, 2, part, l]
                    a3 += np.float64(((lo1 >> 4) | ((qh >> 2) & 48)) - 32) * xs[sb, h, 3, part, l]
                for s, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                    acc += np.float64(d * np.float32(sc[sb, 192 + h * 8 + s * 2 + part])) * a
    return acc


@njit(cache=True, fastmath=FAST)
def row_iq4_xs(row, x, tab):  # 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128]
    nsb = x.shape[0] // 256
    blk, xs, kv = row.reshape(nsb, 136), x.reshape(nsb, 8, 2, 16), tab.kvalues
    acc = 0.0
    for sb in range(nsb):
        d, scales_h = half_at(blk, sb, 0, tab.halves), u16(blk[sb], 2)
        for j in range(8):
            qs = blk[sb, 8 + j * 16:24 + j * 16]
            ls = ((np.int64(blk[sb, 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)
            s = dot_lut(qs, 0, kv, xs[sb, j, 0]) + dot_lut(qs, 4, kv, xs[sb, j, 1])
            acc += np.float64(d * np.float32(ls - 32)) * s
    return acc


@njit(cache=True, fastmath=FAST)
def dot_signed(values, signs, x):  # sum values * signs * x: grid values, +-1 from tab.sign_rows
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(values[j]) * signs[j] * x[j]
    return s


@njit(cache=True, fastmath=FAST)
def row_iq2_xxs(row, x, tab):  # 66 bytes: f16 d, 8 x (4 grid bytes, u32: 4 x 7 sign bits, 4-bit scale)
    nsb = x.shape[0] // 256
    blk, grid, signs = row.reshape(nsb, 66), tab.iq2xxs_grid, tab.sign_rows
    acc = 0.0
    for sb in range(nsb):
        d = half_at(blk, sb, 0, tab.halves)
        for ib in range(8):
            aux = u32(blk[sb], 6 + 8 * ib)
            s = 0.0
            for l in range(4):
                xo = sb * 256 + ib * 32 + l * 8
                s += dot_signed(grid[blk[sb, 2 + 8 * ib + l]], signs[(aux >> (7 * l)) & 127], x[xo:xo + 8])
            acc += np.float64(d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)) * s
    return acc


@njit(cache=True, fastmath=FAST)
def row_iq3_xxs(row, x, tab):  # 98 bytes: f16 d, 64 grid bytes (4 values each), 8 x u32 signs + scale
    nsb = x.shape[0] // 256
    blk, grid, signs = row.reshape(nsb, 98), tab.iq3xxs_grid, tab.sign_rows
    acc = 0.0
    for sb in range(nsb):
        d = half_at(blk, sb, 0, tab.halves)
        for ib in range(8):
            aux = u32(blk[sb], 66 + 4 * ib)
            s = 0.0
            for l in range(4):
                xo, sg = sb * 256 + ib * 32 + l * 8, signs[(aux >> (7 * l)) & 127]
                s += (dot_signed(grid[blk[sb, 2 + 8 * ib + 2 * l]], sg[:4], x[xo:xo + 4])
                      + dot_signed(grid[blk[sb, 3 + 8 * ib + 2 * l]], sg[4:], x[xo + 4:xo + 8]))
            acc += np.float64(d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)) * s
    return acc


@njit(cache=True)
def row_dot(qtype, row, x, xsum16, tab):  # one weight row [row_bytes] . x [n_in] float64 -> float64
    if qtype == F32 or qtype == F16 or qtype == BF16:
        return row_float(qtype, row, x, tab)
    if qtype == Q8_0:
        return row_q8_0(row, x, tab)
    if qtype == Q4_0 or qtype == Q5_0 or qtype == IQ4_NL:
        return row_blocks32(qtype, row, x, tab)
    if qtype == Q2_K:
        return row_q2_k(row, x, xsum16, tab)
    if qtype == Q3_K:
        return row_q3_k(row, x, tab)
    if qtype == Q4_K or qtype == Q5_K:
        return row_q45_k(qtype, row, x, xsum16, tab)
    if qtype == Q6_K:
        return row_q6_k(row, x, tab)
    if qtype == IQ4_XS:
        return row_iq4_xs(row, x, tab)
    if qtype == IQ3_XXS:
        return row_iq3_xxs(row, x, tab)
    return row_iq2_xxs(row, x, tab)


# ---------------------------------------------------------------------------------------------
# Kernels

ROWS_PER_TASK = 16


@njit(cache=True, parallel=True)
def matmul_rows(qtype, blocks, x, xsum16, out, tab):  # blocks [n_out, row_bytes], x [T, n_in] f64 -> out [T, n_out]
    """Each row straight from its blocks, once per row of x: the decode path (T of 1 to a few),
    where reading the weights is all the work."""
    T, n_out = x.shape[0], blocks.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for r in range(task * ROWS_PER_TASK, min(task * ROWS_PER_TASK + ROWS_PER_TASK, n_out)):
            for t in range(T):
                out[t, r] = row_dot(qtype, blocks[r], x[t], xsum16[t], tab)


TILE_ROWS, TILE_COLS = 32, 1024  # a tile of decoded weights: 256 KB of float64, held in L2


@njit(cache=True, fastmath=FAST)
def product_4x4(w, r, x, t, k0, n, acc):  # acc[r:r+4, t:t+4] += w[r:r+4, :n] . x[t:t+4, k0:k0+n]
    # 16 sums side by side: each loaded weight and activation serves four products
    w0, w1, w2, w3 = w[r, :n], w[r + 1, :n], w[r + 2, :n], w[r + 3, :n]
    x0, x1, x2, x3 = x[t, k0:k0 + n], x[t + 1, k0:k0 + n], x[t + 2, k0:k0 + n], x[t + 3, k0:k0 + n]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = 0.0
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = 0.0
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
def matmul_tiles(qtype, blocks, x, out, tab):  # blocks [n_out, row_bytes], x [T, n_in] f64 -> out [T, n_out]
    """Decode a tile of TILE_ROWS x TILE_COLS exact weights once and multiply it with all T rows of
    x: the prefill path, where the products, not the weights, are the work."""
    T, n_in = x.shape
    n_out = blocks.shape[0]
    for task in prange((n_out + TILE_ROWS - 1) // TILE_ROWS):
        r0 = task * TILE_ROWS
        rows = min(TILE_ROWS, n_out - r0)
        w = np.empty((TILE_ROWS, TILE_COLS), np.float64)
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
def dequantize_rows(qtype, blocks, n_in, first, out, tab):  # rows first.. of blocks -> out [R, n_in] f64
    """Exact float32 weights as float64 (what gguf-py's dequantize gives, widened)."""
    for i in prange(out.shape[0]):
        for start in range(0, n_in, CHUNK):
            decode_chunk(qtype, blocks[first + i], start, min(CHUNK, n_in - start), out[i, start:], tab)
