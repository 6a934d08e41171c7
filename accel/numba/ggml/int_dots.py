"""The quantized dot products of reference/ggml_cpu/int_dots.py as numba kernels, one per kernel
family with the same name: the integer sums exact in int64, then each kernel's float epilogue in
reference order (one fma32 per block, lane by lane). Arrays as reference QuantRows / QuantActs hold
them; a field a type lacks is an empty array."""
import numba
import numpy as np

from .rounding import fma32, hsum8

F32 = np.float32


@numba.njit(cache=True, inline="always")
def block_dot(values, aq, t, o, b, start, stop):  # exact sum of value * q over [start, stop)
    total = 0
    for k in range(start, stop):
        total += np.int64(values[o, b, k]) * np.int64(aq[t, b, k])
    return total


@numba.njit(cache=True, inline="always")
def bsum_of(bsums, t, b, s, sub):  # the activation sum of sub-block s (width sub) from the 16-sums
    total = 0
    for i in range(s * sub // 16, (s + 1) * sub // 16):
        total += np.int64(bsums[t, b, i])
    return total


@numba.njit(cache=True, inline="always")
def offset_part(offset, scales, sub, bsums, t, o, b):  # offset * sum(scale * bsum): Q6_K's 32 the kernels remove
    total = 0
    for s in range(scales.shape[2]):
        total += np.int64(scales[o, b, s]) * bsum_of(bsums, t, b, s, sub)
    return offset * total


@numba.njit(cache=True, parallel=True)
def tiled(vs, offset, scales, sub, d0, dmin, mins, aq, ad, bsums):  # -> [T, O]: reference tiled
    """vs [O, nb, 256] int16: each value times its sub-block's scale, so s1 = sum(scale * dot) is one
    dot product; the unsigned offset comes off through the activation sums (the same integer)."""
    O, nb, bs = vs.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        for t in range(T):
            buf = F32(0)
            for b in range(nb):
                s1 = block_dot(vs, aq, t, o, b, 0, bs)
                if offset:
                    s1 -= offset_part(offset, scales, sub, bsums, t, o, b)
                r = F32(s1) * d0[o, b]
                if mins.size:
                    s2 = 0
                    for s in range(bs // sub):
                        s2 += np.int64(mins[o, b, s]) * bsum_of(bsums, t, b, s, sub)
                    r = fma32(-dmin[o, b], F32(s2), r)
                buf = fma32(r, ad[t, b], buf)
            out[t, o] = buf
    return out


@numba.njit(cache=True, parallel=True)
def k_repacked_rows(vs, sub, d, dmin, mins, aq, ad, bsums, elements_per_fma):  # -> [T, O]
    O, nb, bs = vs.shape
    T = aq.shape[0]
    step = elements_per_fma // sub
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        for t in range(T):
            acc, acc_min = F32(0), F32(0)
            for b in range(nb):
                scale, scale_min = d[o, b] * ad[t, b], dmin[o, b] * ad[t, b]
                for p in range(bs // elements_per_fma):
                    dots = block_dot(vs, aq, t, o, b, p * elements_per_fma, (p + 1) * elements_per_fma)
                    mn = 0
                    for s in range(p * step, (p + 1) * step):
                        mn += bsum_of(bsums, t, b, s, sub) * np.int64(mins[o, b, s])
                    acc = fma32(F32(dots), scale, acc)
                    acc_min = fma32(F32(mn), scale_min, acc_min)
            out[t, o] = acc - acc_min
    return out


@numba.njit(cache=True, inline="always")
def vec_dot_lanes(vs, offset, scales, aq, bsums, t, o, b, chunk, lanes):  # int64 [8] <- the 8 lane sums
    """Lane l holds elements 4l..4l+3 of every 32-element chunk: the chunks are summed element-wise
    into chunk [32] (one vector loop), then each lane's 4 neighbours; Q6_K's offset comes off lane p
    through the activation sums of the 16-groups 2p and 2p+1."""
    for i in range(32):
        total = 0
        for c in range(8):
            total += np.int64(vs[o, b, c * 32 + i]) * np.int64(aq[t, b, c * 32 + i])
        chunk[i] = total
    for lane in range(8):
        lanes[lane] = chunk[4 * lane] + chunk[4 * lane + 1] + chunk[4 * lane + 2] + chunk[4 * lane + 3]
    if offset:
        for p in range(8):
            lanes[p] -= offset * (np.int64(bsums[t, b, 2 * p]) * scales[o, b, 2 * p]
                                  + np.int64(bsums[t, b, 2 * p + 1]) * scales[o, b, 2 * p + 1])


@numba.njit(cache=True, parallel=True)
def k_vec_dot(vs, offset, scales, d, dmin, mins, min_lanes, post, aq, ad, bsums):  # -> [T, O]
    O, nb, _ = vs.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        chunk = np.zeros(32, np.int64)
        lanes = np.zeros(8, np.int64)
        acc = np.zeros(8, F32)
        summs = np.zeros(4, F32)
        for t in range(T):
            acc[:] = 0
            summs[:] = 0
            for b in range(nb):
                vec_dot_lanes(vs, offset, scales, aq, bsums, t, o, b, chunk, lanes)
                if mins.size:
                    dm = -ad[t, b] * dmin[o, b]
                    per = 8 // min_lanes
                    for j in range(min_lanes):
                        mn = 0
                        for s in range(j * per, (j + 1) * per):
                            mn += bsum_of(bsums, t, b, s, 32) * np.int64(mins[o, b, s])
                        summs[j] = fma32(dm, F32(mn), summs[j])
                scale = d[o, b] * ad[t, b]
                for lane in range(8):
                    acc[lane] = fma32(scale, F32(lanes[lane]), acc[lane])
            r = post * hsum8(acc)
            if mins.size and min_lanes == 4:  # Q4_K's __m128 of mins, folded (0+2) + (1+3)
                r = r + ((summs[0] + summs[2]) + (summs[1] + summs[3]))
            elif mins.size:
                r = r + summs[0]
            out[t, o] = r
    return out


@numba.njit(cache=True, parallel=True)
def q0_lanes(values, d, aq, ad, accumulators):  # 32-blocks -> [T, O]: reference q0_lanes / q0_accumulate
    O, nb, _ = values.shape
    T = aq.shape[0]
    paired = nb - nb % accumulators
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        acc = np.zeros((2, 8), F32)
        for t in range(T):
            acc[:] = 0
            for b in range(paired):
                scale = d[o, b] * ad[t, b]
                for lane in range(8):
                    lane_sum = block_dot(values, aq, t, o, b, lane * 4, lane * 4 + 4)
                    acc[b % accumulators, lane] = fma32(scale, F32(lane_sum), acc[b % accumulators, lane])
            r = hsum8(acc[0] + acc[1]) if accumulators == 2 else hsum8(acc[0])
            for b in range(paired, nb):
                r = fma32(d[o, b] * ad[t, b], F32(block_dot(values, aq, t, o, b, 0, 32)), r)
            out[t, o] = r
    return out


@numba.njit(cache=True, parallel=True)
def q0_repacked(values, d, aq, ad):  # 32-blocks -> [T, O]: per block fma(f32(isum), f32(d_w*d_a), acc)
    O, nb, _ = values.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        for t in range(T):
            acc = F32(0)
            for b in range(nb):
                acc = fma32(F32(block_dot(values, aq, t, o, b, 0, 32)), d[o, b] * ad[t, b], acc)
            out[t, o] = acc
    return out


@numba.njit(cache=True, parallel=True)
def q5_1_vec_dot(values, d, m, aq, ad, a_s):  # Q5_1 rows, Q8_1 acts -> [T, O]: reference q5_1_vec_dot
    O, nb, _ = values.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        acc = np.zeros(8, F32)
        for t in range(T):
            acc[:] = 0
            summs = F32(0)
            for b in range(nb):
                summs = fma32(m[o, b], a_s[t, b], summs)
                scale = d[o, b] * ad[t, b]
                for lane in range(8):
                    acc[lane] = fma32(F32(block_dot(values, aq, t, o, b, lane * 4, lane * 4 + 4)), scale, acc[lane])
            out[t, o] = hsum8(acc) + summs
    return out


@numba.njit(cache=True, parallel=True)
def wide_block_vec_dot(values, d, aq, ad, lanes):  # Q1_0/Q2_0 rows, Q8_0 acts -> [T, O]: reference wide_block_vec_dot
    O, nb, bs = values.shape
    T = aq.shape[0]
    spans, width = bs // 32, 32 // lanes
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        acc = np.zeros(lanes, F32)
        for t in range(T):
            acc[:] = 0
            for b in range(nb):
                for lane in range(lanes):
                    inner = F32(0)
                    for k in range(spans):
                        total = 0
                        for i in range(k * 32 + lane * width, k * 32 + (lane + 1) * width):
                            total += np.int64(values[o, b, i]) * np.int64(aq[t, b * spans + k, i - k * 32])
                        scale = ad[t, b * spans + k]
                        inner = scale * F32(total) if k == 0 else fma32(scale, F32(total), inner)
                    acc[lane] = fma32(d[o, b], inner, acc[lane])
            out[t, o] = hsum8(acc) if lanes == 8 else acc[0]
    return out


@numba.njit(cache=True, inline="always")
def q2_k_block(vs, d, dmin, mins, aq, ad, bsums, t, o, b, chunk, lanes, acc):  # acc [8] <- block b: mins, then codes
    vec_dot_lanes(vs, 0, mins, aq, bsums, t, o, b, chunk, lanes)
    dm = -ad[t, b] * dmin[o, b]
    for lane in range(8):
        mn = np.int64(mins[o, b, 2 * lane]) * bsums[t, b, 2 * lane] \
            + np.int64(mins[o, b, 2 * lane + 1]) * bsums[t, b, 2 * lane + 1]
        acc[lane] = fma32(dm, F32(mn), acc[lane])
    scale = ad[t, b] * d[o, b]
    for lane in range(8):
        acc[lane] = fma32(scale, F32(lanes[lane]), acc[lane])


@numba.njit(cache=True, parallel=True)
def q2_k_vec_dot(vs, d, dmin, mins, aq, ad, bsums):  # Q2_K rows (vs: codes times scales), Q8_K acts -> [T, O]
    O, nb, _ = vs.shape
    out = np.zeros((aq.shape[0], O), F32)
    for o in numba.prange(O):
        chunk, lanes, acc = np.zeros(32, np.int64), np.zeros(8, np.int64), np.zeros(8, F32)
        for t in range(aq.shape[0]):
            acc[:] = 0
            for b in range(nb):
                q2_k_block(vs, d, dmin, mins, aq, ad, bsums, t, o, b, chunk, lanes, acc)
            out[t, o] = hsum8(acc)
    return out


@numba.njit(cache=True, inline="always")
def iq1_lanes(vs, scales, sub, aq, t, o, b, grid_lanes, delta_lanes):  # the 8 lane sums of each part
    """vs holds scale * (8 grid + delta): the code comes back by the exact division, then grid and delta
    as reference iq1_vec_dot takes them apart; lane l: elements 4l..4l+3 of every 32-element chunk."""
    grid_lanes[:] = 0
    delta_lanes[:] = 0
    for k in range(vs.shape[2]):
        scale = np.int64(scales[o, b, k // sub])
        code = np.int64(vs[o, b, k]) // scale
        grid = (code + 4) // 8
        q = np.int64(aq[t, b, k])
        grid_lanes[(k % 32) // 4] += scale * grid * q
        delta_lanes[(k % 32) // 4] += scale * (code - 8 * grid) * q


@numba.njit(cache=True, parallel=True)
def iq1_vec_dot(vs, scales, sub, d, aq, ad, delta_lanes):  # IQ1_S/IQ1_M -> [T, O]: reference iq1_vec_dot
    O, nb, _ = vs.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        grid_sums, delta_sums = np.zeros(8, np.int64), np.zeros(8, np.int64)
        acc, acc_delta = np.zeros(8, F32), np.zeros(8, F32)
        for t in range(T):
            acc[:] = 0
            acc_delta[:] = 0
            for b in range(nb):
                iq1_lanes(vs, scales, sub, aq, t, o, b, grid_sums, delta_sums)
                scale = d[o, b] * ad[t, b]
                for lane in range(8):
                    acc[lane] = fma32(scale, F32(grid_sums[lane]), acc[lane])
                    if delta_lanes == 8:
                        acc_delta[lane] = fma32(scale, F32(delta_sums[lane]), acc_delta[lane])
                if delta_lanes == 1:  # IQ1_S: one integer per block into a scalar
                    acc_delta[0] = fma32(scale, F32(delta_sums.sum()), acc_delta[0])
            delta_part = hsum8(acc_delta) if delta_lanes == 8 else acc_delta[0]
            out[t, o] = hsum8(acc) + F32(0.125) * delta_part
    return out
