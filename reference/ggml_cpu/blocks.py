"""Weights as integers: each block format decoded to its f16 scales and integer values."""
import copy

import numpy as np

from reference.quant_blocks import (BLOCKS, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS,
                                     Q1_0, Q2_0, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TQ1_0, TQ2_0)

from .rounding import F32

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)


class QuantRows:
    """One quantized matrix [O, K] as ggml's kernels see it: w = d * post * scale * value - dmin * min
    per element, with d/dmin/m the f16 block fields widened to f32 and value an integer. `sub` is the
    width of a scale's sub-block; `post` the exact power of two some IQ kernels apply at the end;
    `unsigned_offset` the bias a kernel removes through the activation sums (Q6_K's 32); `min_lanes`
    how many float lanes the vec_dot accumulates the min part in (Q4_K 4, Q5_K 1)."""

    def __init__(self, d, values, scales=None, mins=None, dmin=None, m=None, sub=32, post=1.0, unsigned_offset=0,
                 min_lanes=1):
        self.d, self.values, self.scales, self.mins, self.dmin, self.m = d, values, scales, mins, dmin, m
        self.sub, self.post, self.unsigned_offset, self.min_lanes = sub, post, unsigned_offset, min_lanes


def f16(field):  # uint8 [..., 2] -> f32 [...]: the little-endian half
    return np.ascontiguousarray(field).view(np.float16)[..., 0].astype(F32)


def bits(field):  # uint8 [..., n] -> int [..., 8n]: bit i of the little-endian field
    return np.unpackbits(field, axis=-1, bitorder="little").astype(np.int64)


def nibbles(qs):  # uint8 [..., n] -> int [..., 2n]: low nibbles of all bytes, then high nibbles
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)


def k_scale_min(scales):  # uint8 [..., 12] -> (scale [..., 8], min [..., 8]): get_scale_min_k4
    s = scales.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def iq_grid(qtype):  # gguf.quants class -> int [entries, 4 or 8]: the IQ lattice as integers
    qtype.init_grid()
    return qtype.grid.reshape(qtype.grid_shape).astype(np.int64)


def iq_signs(sign_index):  # int [...] (7 bits) -> +-1 [..., 8]: ksigns_iq2xs, bit 7 makes the parity even
    from gguf.quants import IQ2_XXS
    ksigns = np.frombuffer(IQ2_XXS.ksigns, np.uint8)[sign_index]
    return 1 - 2 * np.unpackbits(ksigns[..., None], axis=-1, bitorder="little").astype(np.int64)


def decode_q8_0(b):  # [O, nb, 34]
    q = Q8_0.of(b)
    return QuantRows(f16(q.d), q.qs.view(np.int8).astype(np.int64))


def decode_q4_0(b):  # [O, nb, 18]
    q = Q4_0.of(b)
    return QuantRows(f16(q.d), nibbles(q.qs) - 8)


def decode_q5_0(b):  # [O, nb, 22]
    q = Q5_0.of(b)
    return QuantRows(f16(q.d), nibbles(q.qs) + 16 * bits(q.qh) - 16)


def decode_q5_1(b):  # [O, nb, 24]: w = d * value + m
    q = Q5_1.of(b)
    return QuantRows(f16(q.d), nibbles(q.qs) + 16 * bits(q.qh), m=f16(q.m))


def decode_iq4_nl(b):  # [O, nb, 18]
    q = IQ4_NL.of(b)
    return QuantRows(f16(q.d), KVALUES_IQ4NL[nibbles(q.qs)])


def decode_q4_k(b):  # [O, nb, 144]: d, dmin, 12 scale bytes, 128 nibble bytes (64 elements per 32 bytes)
    q = Q4_K.of(b)
    sc, mn = k_scale_min(q.scales)
    values = nibbles(q.qs.reshape(b.shape[:-1] + (4, 32))).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, sc, mn, f16(q.dmin), min_lanes=4)


def decode_q5_k(b):  # [O, nb, 176]: as Q4_K plus 32 bytes of fifth bits (bit 2j: low half of chunk j)
    q = Q5_K.of(b)
    high = np.unpackbits(q.qh[..., None], axis=-1, bitorder="little").astype(np.int64)  # [..., 32, 8]
    high = high.transpose(tuple(range(high.ndim - 2)) + (high.ndim - 1, high.ndim - 2))  # [..., 8, 32]
    sc, mn = k_scale_min(q.scales)
    values = nibbles(q.qs.reshape(b.shape[:-1] + (4, 32))).reshape(b.shape[:-1] + (256,)) + 16 * high.reshape(
        b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, sc, mn, f16(q.dmin))


def decode_q6_k(b):  # [O, nb, 210]: ql[128], qh[64], int8 scales[16], d; unsigned 6-bit codes, offset 32
    q = Q6_K.of(b)
    ql = q.ql.reshape(b.shape[:-1] + (2, 64)).astype(np.int64)
    qh = q.qh.reshape(b.shape[:-1] + (2, 32)).astype(np.int64)
    parts = [(ql[..., 0:32] & 15) | ((qh & 3) << 4), (ql[..., 32:64] & 15) | (((qh >> 2) & 3) << 4),
             (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
    codes = np.concatenate(parts, axis=-1).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), codes, q.scales.view(np.int8).astype(np.int64), sub=16, unsigned_offset=32)


def decode_q2_k(b):  # [O, nb, 84]: 16 scale bytes (scale | min << 4), 64 bytes of 2-bit codes, d, dmin
    q = Q2_K.of(b)
    qs = q.qs.reshape(b.shape[:-1] + (2, 1, 32)).astype(np.int64)
    codes = (qs >> (2 * np.arange(4))[:, None]) & 3  # [..., 2, 4, 32]
    s = q.scales.astype(np.int64)
    return QuantRows(f16(q.d), codes.reshape(b.shape[:-1] + (256,)), s & 15, s >> 4, f16(q.dmin), sub=16)


def decode_q3_k(b):  # [O, nb, 110]: hmask[32], qs[64], 12 scale bytes (6-bit, minus 32), d
    q = Q3_K.of(b)
    qs = q.qs.reshape(b.shape[:-1] + (2, 1, 32)).astype(np.int64)
    low = (qs >> (2 * np.arange(4))[:, None]) & 3  # [..., 2, 4, 32]
    high = np.unpackbits(q.hmask[..., None], axis=-1, bitorder="little").astype(np.int64)  # [..., 32, 8]
    high = np.moveaxis(high, -1, -2).reshape(b.shape[:-1] + (2, 4, 32))
    s = q.scales.astype(np.int64)
    i = np.arange(16)
    low4 = np.where(i < 8, s[..., i % 8] & 15, s[..., i % 8] >> 4)
    scales = (low4 | (((s[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32
    return QuantRows(f16(q.d), (low + 4 * high - 4).reshape(b.shape[:-1] + (256,)), scales, sub=16)


def decode_iq2_xxs(b):  # [O, nb, 66]: per 32: 4 grid bytes, then 4x7 sign bits + 4-bit scale
    from gguf import quants
    q = IQ2_XXS.of(b)
    chunks = q.qs.reshape(b.shape[:-1] + (8, 8))
    aux = np.ascontiguousarray(chunks[..., 4:8]).view(np.uint32)[..., 0].astype(np.int64)
    grid = iq_grid(quants.IQ2_XXS)[chunks[..., 0:4]]  # [..., 8, 4, 8]
    signs = iq_signs((aux[..., None] >> (7 * np.arange(4))) & 127)
    values = (grid * signs).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, 2 * (aux >> 28) + 1, post=0.125)


def decode_iq2_s(b):  # [O, nb, 82]: qs[64] (32 grid low bytes, then 32 sign bytes), qh[8], scales[8] (two 4-bit per 32)
    from gguf import quants
    q = IQ2_S.of(b)
    low = q.qs[..., :32].reshape(b.shape[:-1] + (8, 4)).astype(np.int64)
    index = low | ((q.qh.astype(np.int64)[..., None] << (8 - 2 * np.arange(4))) & 0x300)
    grid = iq_grid(quants.IQ2_S)[index]  # [..., 8, 4, 8]
    signs = 1 - 2 * np.unpackbits(q.qs[..., 32:, None], axis=-1, bitorder="little").astype(np.int64)
    values = (grid * signs.reshape(grid.shape)).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, odd_scales(q.scales), sub=16, post=0.125)


def decode_iq3_xxs(b):  # [O, nb, 98]: 64 grid bytes (4 values each), then per 32 a word of signs + scale
    from gguf import quants
    q = IQ3_XXS.of(b)
    grid = iq_grid(quants.IQ3_XXS)[q.qs.reshape(b.shape[:-1] + (8, 8))]  # [..., 8, 8, 4]
    aux = np.ascontiguousarray(q.scales_and_signs).view(np.uint32).astype(np.int64)  # [..., 8]
    signs = iq_signs((aux[..., None] >> (7 * np.arange(4))) & 127)  # [..., 8, 4, 8]
    values = (grid.reshape(signs.shape) * signs).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, 2 * (aux >> 28) + 1, post=0.25)


def decode_iq4_xs(b):  # [O, nb, 136]: d, scales_h (u16), scales_l[4], qs[128] (16 bytes per 32)
    q = IQ4_XS.of(b)
    sh = np.ascontiguousarray(q.scales_h).view(np.uint16)[..., 0].astype(np.int64)[..., None]
    sl = q.scales_l.astype(np.int64)
    j = np.arange(8)
    ls = ((sl[..., j // 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
    values = KVALUES_IQ4NL[nibbles(q.qs.reshape(b.shape[:-1] + (8, 16)))].reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, ls - 32)


def decoders(*pairs):  # (type, decoder) ... -> {type: (bytes per block, decoder)}
    return {kind: (BLOCKS[kind].size, decoder) for kind, decoder in pairs}


DECODERS = decoders(  # type -> (bytes per block, decoder)
    ("Q8_0", decode_q8_0), ("Q4_0", decode_q4_0), ("Q5_0", decode_q5_0), ("Q5_1", decode_q5_1),
    ("IQ4_NL", decode_iq4_nl), ("Q2_K", decode_q2_k), ("Q3_K", decode_q3_k), ("Q4_K", decode_q4_k),
    ("Q5_K", decode_q5_k), ("Q6_K", decode_q6_k), ("IQ2_XXS", decode_iq2_xxs), ("IQ2_S", decode_iq2_s),
    ("IQ3_XXS", decode_iq3_xxs), ("IQ4_XS", decode_iq4_xs))


DECODE_ROWS = 4096  # rows decoded at a time: the decoders' int64 intermediates stay small for a 202048-row head


def decode(weights, name):  # GGUF tensor -> QuantRows with arrays [O, nb, ...]
    return decode_rows(weights, name, 0, len(weights.raw(name)))


INT_FIELDS = ("values", "scales", "mins")
ROW_FIELDS = INT_FIELDS + ("d", "dmin", "m")  # QuantRows' arrays, weight rows first


def row_block(rows, start, stop):  # QuantRows -> the same of weight rows [start, stop) (views)
    block = copy.copy(rows)
    for field in ROW_FIELDS:
        if getattr(rows, field) is not None:
            setattr(block, field, getattr(rows, field)[start:stop])
    return block


def narrow(rows):  # QuantRows -> the same with int8 codes and scales
    # every code and scale fits in int8 (the widest: Q8_0's int8, IQ4_NL's -127..113, Q6_K's 0..63)
    for field in INT_FIELDS:
        if getattr(rows, field) is not None:
            setattr(rows, field, getattr(rows, field).astype(np.int8, copy=False))
    return rows


def decode_rows(weights, name, start, stop, decoders=DECODERS):  # GGUF tensor -> QuantRows of rows [start, stop)
    """decoders: {type: (bytes per block, decoder)}, these or the numba twins'."""
    n_bytes, decoder = decoders[weights.type_name(name)]
    raw = np.asarray(weights.raw(name)[start:stop]).view(np.uint8)
    raw = raw.reshape(len(raw), -1, n_bytes)
    parts = [narrow(decoder(raw[i:i + DECODE_ROWS])) for i in range(0, len(raw), DECODE_ROWS)]
    rows = parts[0]
    for field in ROW_FIELDS if len(parts) > 1 else ():
        if getattr(rows, field) is not None:
            setattr(rows, field, np.concatenate([getattr(part, field) for part in parts]))
    return rows


def decode_q4_1(b):  # [O, nb, 20]: w = d * value + m, as Q5_1 without the fifth bits
    q = Q4_1.of(b)
    return QuantRows(f16(q.d), nibbles(q.qs), m=f16(q.m))


def decode_q1_0(b):  # [O, nb, 18]: 128 sign bits, value j = +1 where bit j of qs is set, else -1
    q = Q1_0.of(b)
    return QuantRows(f16(q.d), 2 * bits(q.qs) - 1)


def decode_q2_0(b):  # [O, nb, 18]: 64 2-bit codes (value j in bits 2(j%4) of byte j/4), value = code - 1
    q = Q2_0.of(b)
    codes = (q.qs[..., None].astype(np.int64) >> (2 * np.arange(4))) & 3
    return QuantRows(f16(q.d), codes.reshape(b.shape[:-1] + (64,)) - 1)


def trits(qs, n):  # uint8 [...] -> int [..., n]: base-3 digits 0..2 of each byte (byte * 3^i mod 256, times 3, >> 8)
    q = (qs[..., None].astype(np.int64) * 3 ** np.arange(n)) & 255
    return (3 * q) >> 8


def ternary_rows(d, codes):  # f32 [O, nb], codes 0..2 [O, nb, 256] -> QuantRows
    """The ternary vec_dots multiply the unsigned codes and subtract the 1 through the activation
    sums of 16 (lane l takes the sums 2l and 2l+1), as Q6_K removes its 32: unit scales of 16."""
    return QuantRows(d, codes, np.ones(codes.shape[:-1] + (16,), np.int64), sub=16, unsigned_offset=1)


def decode_tq1_0(b):  # [O, nb, 54]: qs[48] five trits a byte, qh[4] four trits a byte, d
    q = TQ1_0.of(b)
    lead = np.moveaxis(trits(q.qs[..., 0:32], 5), -1, -2)  # value 32n + m: trit n of byte m
    tail = np.moveaxis(trits(q.qs[..., 32:48], 5), -1, -2)  # value 160 + 16n + m
    high = np.moveaxis(trits(q.qh, 4), -1, -2)  # value 240 + 4n + j: trit n of qh[j]
    codes = np.concatenate([part.reshape(b.shape[:-1] + (-1,)) for part in (lead, tail, high)], axis=-1)
    return ternary_rows(f16(q.d), codes)


def decode_tq2_0(b):  # [O, nb, 66]: qs[64] four 2-bit codes a byte (value 128j + 32l + m: bits 2l of byte 32j + m), d
    q = TQ2_0.of(b)
    qs = q.qs.reshape(b.shape[:-1] + (2, 1, 32)).astype(np.int64)
    codes = (qs >> (2 * np.arange(4))[:, None]) & 3  # [..., 2, 4, 32]
    return ternary_rows(f16(q.d), codes.reshape(b.shape[:-1] + (256,)))


DECODERS.update(decoders(  # Q4_1, the pinned ggml's own Q1_0 and Q2_0, the ternary TQ1_0 and TQ2_0
    ("Q4_1", decode_q4_1), ("Q1_0", decode_q1_0), ("Q2_0", decode_q2_0), ("TQ1_0", decode_tq1_0),
    ("TQ2_0", decode_tq2_0)))


def odd_scales(scale_bytes):  # uint8 [..., n] -> int [..., 2n]: 2 * nibble + 1, low nibble first
    s = scale_bytes.astype(np.int64)
    return np.stack([2 * (s & 15) + 1, 2 * (s >> 4) + 1], axis=-1).reshape(s.shape[:-1] + (-1,))


def decode_iq2_xs(b):  # [O, nb, 74]: d, 32 u16 (9-bit grid index | 7 sign bits << 9), scales[8] (two 4-bit per 32)
    from gguf import quants
    q = IQ2_XS.of(b)
    words = np.ascontiguousarray(q.qs).view(np.uint16).astype(np.int64)  # [..., 32]: one per 8 values
    values = (iq_grid(quants.IQ2_XS)[words & 511] * iq_signs(words >> 9)).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16(q.d), values, odd_scales(q.scales), sub=16, post=0.125)


def decode_iq3_s(b):  # [O, nb, 110]: d, qs[64] grid low bytes, qh[8] (their 9th bits), signs[32], scales[4]
    from gguf import quants
    q = IQ3_S.of(b)
    index = q.qs.astype(np.int64) | (bits(q.qh) << 8)  # [..., 64]: 4 values each
    values = iq_grid(quants.IQ3_S)[index].reshape(b.shape[:-1] + (256,)) * (1 - 2 * bits(q.signs))
    return QuantRows(f16(q.d), values, odd_scales(q.scales))


def iq1_codes(index, negative_delta):  # grid index int [..., g], delta sign bool [..., g] -> int [..., 8g]
    """The tiled kernel's IQ1 codes 8 * grid + delta (grid -1/0/1, delta = +-1 for IQ1S_DELTA = IQ1M_DELTA
    = 1/8, the 8 folded into d by post = 1/8); the vec_dot takes them apart (iq1_vec_dot)."""
    from gguf import quants
    codes = 8 * iq_grid(quants.IQ1_S)[index] + np.where(negative_delta, -1, 1)[..., None]
    return codes.reshape(index.shape[:-1] + (-1,))


def decode_iq1_s(b):  # [O, nb, 50]: d, qs[32] grid low bytes, per 32 a u16: 4x3 index bits, 3-bit scale, delta sign
    q = IQ1_S.of(b)
    qh = np.ascontiguousarray(q.qh).view(np.uint16).astype(np.int64)  # [..., 8]
    high = (qh[..., None] >> (3 * np.arange(4))) & 7  # [..., 8, 4]
    index = (q.qs.astype(np.int64) | (high << 8).reshape(b.shape[:-1] + (32,)))
    negative = np.repeat(qh >= 0x8000, 4, axis=-1)  # one delta per 32, i.e. per 4 grid entries
    return QuantRows(f16(q.d), iq1_codes(index, negative), 2 * ((qh >> 12) & 7) + 1, post=0.125)


def decode_iq1_m(b):  # [O, nb, 56]: qs[32], qh[16] (a nibble per 8: 3 index bits, delta sign), 4 u16 of scales
    """The f16 d is spread over the top nibbles of the four scale words (iq1m_scale_t); the other 12 bits
    of each word are four 3-bit scales, one per 16 values."""
    q = IQ1_M.of(b)
    nibble = q.qh.astype(np.int64)[..., None] >> np.array([0, 4])  # [..., 16, 2]
    index = q.qs.astype(np.int64) | ((nibble & 7) << 8).reshape(b.shape[:-1] + (32,))
    negative = (nibble & 8).reshape(b.shape[:-1] + (32,)) != 0
    sc = np.ascontiguousarray(q.scales).view(np.uint16).astype(np.int64)  # [..., 4]
    scales = (2 * ((sc[..., None] >> (3 * np.arange(4))) & 7) + 1).reshape(b.shape[:-1] + (16,))
    d = ((sc >> 12) << (4 * np.arange(4))).sum(-1).astype(np.uint16).view(np.float16).astype(F32)
    return QuantRows(d, iq1_codes(index, negative), scales, sub=16, post=0.125)


DECODERS.update(decoders(("IQ2_XS", decode_iq2_xs), ("IQ3_S", decode_iq3_s), ("IQ1_S", decode_iq1_s),
                         ("IQ1_M", decode_iq1_m)))
