"""The block decoders of reference/ggml_cpu/blocks.py as numba kernels, for the types of the 30B
UD-IQ2_XXS files (IQ2_XXS, IQ3_XXS, IQ4_XS, Q4_K, Q6_K): a model too big for the weight cache is
decoded again on every forward, so these run per call. Each fills the int8 fields of the reference
QuantRows (after its int8 narrowing) loop by loop; the f16 block scales are NumPy's f16 (numba
has no float16). The other types keep the NumPy decoders."""
import functools

import numba
import numpy as np

from reference.ggml_cpu import blocks as reference
from reference.ggml_cpu.blocks import KVALUES_IQ4NL, QuantRows, f16, iq_grid, iq_signs
from reference.quant_blocks import IQ2_XXS, IQ3_XXS, IQ4_XS, Q4_K, Q6_K


@functools.lru_cache(maxsize=None)
def iq_tables(qtype):  # gguf.quants class -> (grid int8 [entries, 4 or 8], signs int8 [128, 8] of +-1)
    return iq_grid(qtype).astype(np.int8), iq_signs(np.arange(128)).astype(np.int8)


@numba.njit(cache=True, inline="always")
def u32_at(block, offset):  # uint8 [n] -> the little-endian uint32 at byte offset, as int64
    return (np.int64(block[offset]) | (np.int64(block[offset + 1]) << 8) | (np.int64(block[offset + 2]) << 16)
            | (np.int64(block[offset + 3]) << 24))


def iq_xxs_kernel(width, grid_at, aux_offset, aux_step):  # -> the fields kernel of IQ2_XXS or IQ3_XXS
    """Per 32 values: 8 grid bytes from grid_at (entries of `width` values), and a word of four
    7-bit sign indices (one per 8 values) and a 4-bit scale at aux_offset + aux_step * ib. The
    layout numbers are compile-time constants of each kernel (as runtime values they halve its speed)."""
    @numba.njit(cache=True, parallel=True)
    def fields(b, grid, signs):  # [O, nb, bytes] -> (values [O, nb, 256], scales [O, nb, 8])
        O, nb, _ = b.shape
        values, scales = np.empty((O, nb, 256), np.int8), np.empty((O, nb, 8), np.int8)
        for o in numba.prange(O):
            for k in range(nb):
                for ib in range(8):
                    aux = u32_at(b[o, k], aux_offset + aux_step * ib)
                    scales[o, k, ib] = 2 * (aux >> 28) + 1
                    for g in range(32 // width):
                        entry, sign_index = b[o, k, grid_at + 8 * ib + g], (aux >> (7 * (width * g // 8))) & 127
                        for i in range(width):
                            m = width * g + i
                            values[o, k, 32 * ib + m] = grid[entry, i] * signs[sign_index, m % 8]
        return values, scales
    return fields


iq2_xxs_fields = iq_xxs_kernel(8, IQ2_XXS.qs, IQ2_XXS.qs + 4, 8)  # a chunk's aux word after its 4 grid bytes
iq3_xxs_fields = iq_xxs_kernel(4, IQ3_XXS.qs, IQ3_XXS.scales_and_signs, 4)


@numba.njit(cache=True, parallel=True)
def iq4_xs_fields(b, kvalues):  # [O, nb, 136] -> (values [O, nb, 256], scales [O, nb, 8])
    O, nb, _ = b.shape
    values, scales = np.empty((O, nb, 256), np.int8), np.empty((O, nb, 8), np.int8)
    for o in numba.prange(O):
        for k in range(nb):
            sh = np.int64(b[o, k, IQ4_XS.scales_h]) | (np.int64(b[o, k, IQ4_XS.scales_h + 1]) << 8)
            for j in range(8):
                low = (np.int64(b[o, k, IQ4_XS.scales_l + j // 2]) >> (4 * (j % 2))) & 15
                scales[o, k, j] = (low | (((sh >> (2 * j)) & 3) << 4)) - 32
                for i in range(16):  # low nibbles of the 16 bytes, then the high nibbles
                    q = b[o, k, IQ4_XS.qs + 16 * j + i]
                    values[o, k, 32 * j + i], values[o, k, 32 * j + 16 + i] = kvalues[q & 15], kvalues[q >> 4]
    return values, scales


@numba.njit(cache=True, parallel=True)
def q4_k_fields(b):  # [O, nb, 144] -> (values [O, nb, 256], scales [O, nb, 8], mins [O, nb, 8])
    O, nb, _ = b.shape
    values = np.empty((O, nb, 256), np.int8)
    scales, mins = np.empty((O, nb, 8), np.int8), np.empty((O, nb, 8), np.int8)
    for o in numba.prange(O):
        for k in range(nb):
            s = b[o, k, Q4_K.scales:Q4_K.scales + 12]
            for j in range(4):  # get_scale_min_k4
                scales[o, k, j], mins[o, k, j] = s[j] & 63, s[j + 4] & 63
                scales[o, k, j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4)
                mins[o, k, j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4)
            for c in range(4):  # 32 bytes give 64 elements: low nibbles, then high nibbles
                for i in range(32):
                    q = b[o, k, Q4_K.qs + 32 * c + i]
                    values[o, k, 64 * c + i], values[o, k, 64 * c + 32 + i] = q & 15, q >> 4
    return values, scales, mins


@numba.njit(cache=True, parallel=True)
def q6_k_fields(b):  # [O, nb, 210] -> (codes [O, nb, 256] in 0..63, scales [O, nb, 16])
    O, nb, _ = b.shape
    values, scales = np.empty((O, nb, 256), np.int8), np.empty((O, nb, 16), np.int8)
    for o in numba.prange(O):
        for k in range(nb):
            for s in range(16):
                scales[o, k, s] = np.int8(b[o, k, Q6_K.scales + s])  # the byte as int8
            for h in range(2):  # ql[64] and qh[32] per 128 elements
                for i in range(32):
                    low, high = b[o, k, Q6_K.ql + 64 * h + i], b[o, k, Q6_K.ql + 64 * h + 32 + i]
                    qh, at = b[o, k, Q6_K.qh + 32 * h + i], 128 * h + i
                    values[o, k, at] = (low & 15) | ((qh & 3) << 4)
                    values[o, k, at + 32] = (high & 15) | (((qh >> 2) & 3) << 4)
                    values[o, k, at + 64] = (low >> 4) | (((qh >> 4) & 3) << 4)
                    values[o, k, at + 96] = (high >> 4) | (((qh >> 6) & 3) << 4)
    return values, scales


def decode_iq2_xxs(b):  # [O, nb, 66] -> QuantRows: as reference decode_iq2_xxs, narrowed
    from gguf import quants
    values, scales = iq2_xxs_fields(b, *iq_tables(quants.IQ2_XXS))
    return QuantRows(f16(IQ2_XXS.of(b).d), values, scales, post=0.125)


def decode_iq3_xxs(b):  # [O, nb, 98] -> QuantRows: as reference decode_iq3_xxs, narrowed
    from gguf import quants
    values, scales = iq3_xxs_fields(b, *iq_tables(quants.IQ3_XXS))
    return QuantRows(f16(IQ3_XXS.of(b).d), values, scales, post=0.25)


def decode_iq4_xs(b):  # [O, nb, 136] -> QuantRows: as reference decode_iq4_xs, narrowed
    values, scales = iq4_xs_fields(b, KVALUES_IQ4NL.astype(np.int8))
    return QuantRows(f16(IQ4_XS.of(b).d), values, scales)


def decode_q4_k(b):  # [O, nb, 144] -> QuantRows: as reference decode_q4_k, narrowed
    values, scales, mins = q4_k_fields(b)
    q = Q4_K.of(b)
    return QuantRows(f16(q.d), values, scales, mins, f16(q.dmin), min_lanes=4)


def decode_q6_k(b):  # [O, nb, 210] -> QuantRows: as reference decode_q6_k, narrowed
    values, scales = q6_k_fields(b)
    return QuantRows(f16(Q6_K.of(b).d), values, scales, sub=16, unsigned_offset=32)


DECODERS = {**reference.DECODERS, **{kind: (reference.DECODERS[kind][0], decoder) for kind, decoder in (
    ("IQ2_XXS", decode_iq2_xxs), ("IQ3_XXS", decode_iq3_xxs), ("IQ4_XS", decode_iq4_xs),
    ("Q4_K", decode_q4_k), ("Q6_K", decode_q6_k))}}
