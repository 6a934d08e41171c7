"""The libm-bound element-wise ops of reference/ggml_cpu/elementwise.py with glibc called from numba
(libm.py): the same float32 operations in the same order, one compiled loop per array."""
import numpy as np

from reference.ggml_cpu.elementwise import SQRT_2_INV

from .libm import libm

F32 = np.float32


def sigmoid(x):  # [...] -> [...]: op_sigmoid, 1/(1 + expf(-x)) with glibc expf
    return F32(1) / (F32(1) + libm("expf", -np.asarray(x, F32)))


def gelu_erf(x):  # [...] f32 -> [...]: ggml_vec_gelu_erf_f32 with glibc erff
    x = np.asarray(x, F32)
    return (F32(0.5) * x) * (F32(1) + libm("erff", x * SQRT_2_INV))


# ---------------------------------------------------------------------------------------------
# Norms, RoPE, SwiGLU and softmax: one compiled loop per row, in the reference's order

import numba  # noqa: E402

from reference.ggml_cpu.target import AVX512  # noqa: E402

from .libm import EXPF, lane, silu_rows, v_expf_lane  # noqa: E402
from .rounding import fma32, register_sum, sqrt32  # noqa: E402
from .threads import threaded  # noqa: E402

F64 = np.float64
NEG_INF = F32(-np.inf)


def rows_of(x):  # [..., n] -> contiguous f32 [R, n]
    x = np.ascontiguousarray(x, F32)
    return x.reshape(-1, x.shape[-1])


def softcap(z, cap):  # z [...] -> [...]: ggml_scale(1/cap), glibc tanhf, ggml_scale(cap)
    if cap == 0:
        return z
    z = np.ascontiguousarray(z, F32)
    return softcap_lanes(z.size, z.ravel(), F32(1.0 / cap), F32(cap)).reshape(z.shape)


@threaded
def softcap_lanes(z, inv_cap, cap):  # f32 [n] -> [n]: the three ops in one pass (the logits: 52 MB a 64-token prefill)
    out = np.empty_like(z)
    for i in numba.prange(z.size):
        out[i] = lane("tanhf", z[i] * inv_cap, False) * cap
    return out


@threaded
def rms_norm_rows(x, eps):  # f32 [R, n], f32 eps -> [R, n]: squares in f32, summed in double left to right
    R, n = x.shape
    out = np.empty_like(x)
    for r in numba.prange(R):
        sum_sq = 0.0
        for i in range(n):
            sum_sq += F64(x[r, i] * x[r, i])
        scale = F32(1) / sqrt32(F32(sum_sq / n) + eps)
        for i in range(n):
            out[r, i] = x[r, i] * scale
    return out


def rms_norm(x, eps):  # x [..., n] f32 -> [..., n]: reference rms_norm
    rows = rows_of(x)
    return rms_norm_rows(rows.size, rows, F32(eps)).reshape(np.shape(x))


@threaded
def layer_norm_rows(x, w, b, eps, lanes):  # f32 [R, n], w/b [n] -> [R, n]: reference layer_norm's sums and roundings
    R, n = x.shape
    whole = n - n % lanes
    out = np.empty_like(x)
    for r in numba.prange(R):
        total = 0.0
        for i in range(n):
            total += F64(x[r, i])
        mean = F32(total) / F32(n)
        centered = x[r] - mean
        squares = centered * centered
        var = 0.0
        for s in range(0, whole, lanes):
            var += F64(register_sum(squares[s:s + lanes]))
        for i in range(whole, n):
            var += F64(squares[i])
        scale = F32(1) / sqrt32(F32(var / n) + eps)
        for i in range(n):
            out[r, i] = (centered[i] * scale) * w[i] + b[i]
    return out


def layer_norm(x, w, b, eps, target=AVX512):  # x [..., n] f32, w [n], b [n] -> [..., n]: reference layer_norm
    rows = rows_of(x)
    return layer_norm_rows(rows.size, rows, np.ascontiguousarray(w, F32), np.ascontiguousarray(b, F32),
                           F32(eps), target.lanes).reshape(np.shape(x))


@threaded
def rotate_pairs(x, cos, sin, first, stride, group):  # x [T, H, D], cos/sin [T, P] -> [T, H, D]
    """Pair i is (first(i), first(i) + stride): rope_norm has first 2i, stride 1; rope_neox i, P.
    The pairs of whole groups take the contracted FMAs (reference rotate), the last P mod group
    plain products."""
    T, H, D = x.shape
    P = cos.shape[1]
    fused = P - P % group
    out = x.copy()
    for t in numba.prange(T):
        for h in range(H):
            for i in range(P):
                a = first * i
                x0, x1, c, s = x[t, h, a], x[t, h, a + stride], cos[t, i], sin[t, i]
                if i < fused:
                    out[t, h, a] = fma32(x0, c, -(x1 * s))
                    out[t, h, a + stride] = fma32(x0, s, x1 * c)
                else:
                    out[t, h, a] = x0 * c - x1 * s
                    out[t, h, a + stride] = x0 * s + x1 * c
    return out


def rope_norm(x, theta, target=AVX512):  # x [T, H, D], theta [T, D/2] -> [T, H, D]: reference rope_norm, pairs (2i, 2i+1)
    return rotate_pairs(np.size(x), np.ascontiguousarray(x, F32), libm("cosf", theta), libm("sinf", theta), 2, 1,
                        target.rope_group)


def rope_neox(x, theta, target=AVX512):  # x [T, H, D], theta [T, D/2] -> [T, H, D]: reference rope_neox, pairs (i, i + D/2)
    return rotate_pairs(np.size(x), np.ascontiguousarray(x, F32), libm("cosf", theta), libm("sinf", theta), 1,
                        theta.shape[-1], target.neox_group)


def rope_2d(x, theta_a, theta_b, target=AVX512):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]: reference rope_2d
    half = x.shape[-1] // 2
    return np.concatenate([rope_norm(x[..., :half], theta_a, target), rope_norm(x[..., half:], theta_b, target)],
                          axis=-1)


def swiglu(gate, up, target=AVX512):  # gate [T, F], up [T, F] -> [T, F]: silu(gate) * up
    return silu_rows(gate, target) * np.asarray(up, F32)


@numba.njit(cache=True, inline="always")
def soft_max_row(scores, visible, scale, lanes, scalef, w, e):  # f32 [S], bool [S], f32, scratch [S] -> e [S] in place
    """One row of reference soft_max: masked scaled scores, their max (np.max's: a NaN wins),
    v_expf of each minus it (glibc expf on the tail past whole registers), the sum register by
    register in double, then each weight times the float32 reciprocal."""
    S = scores.size
    whole = S - S % lanes
    m = NEG_INF
    for i in range(S):
        w[i] = scores[i] * scale if visible[i] else NEG_INF
        if w[i] > m or w[i] != w[i]:
            m = w[i]
    for i in range(whole):
        e[i] = v_expf_lane(w[i] - m, scalef)
    for i in range(whole, S):
        e[i] = EXPF(w[i] - m)
    total = 0.0
    for s in range(0, whole, lanes):
        total += F64(register_sum(e[s:s + lanes]))
    for i in range(whole, S):
        total += F64(e[i])
    inv = F32(1.0 / total)
    for i in range(S):
        e[i] *= inv


@threaded
def soft_max_rows(scores, visible, scale, lanes, scalef):  # f32 [R, S], bool [R, S], f32 -> [R, S]: reference soft_max
    R, S = scores.shape
    out = np.empty_like(scores)
    for r in numba.prange(R):
        soft_max_row(scores[r], visible[r], scale, lanes, scalef, np.empty(S, F32), out[r])
    return out


def soft_max(scores, visible, scale, target=AVX512):  # scores [R, S] f32, visible [R, S] -> [R, S]: reference soft_max
    visible = np.ascontiguousarray(np.broadcast_to(visible, np.shape(scores)), np.bool_)
    return soft_max_rows(np.size(scores), np.ascontiguousarray(scores, F32), visible, F32(scale), target.lanes,
                         target.scalef)
