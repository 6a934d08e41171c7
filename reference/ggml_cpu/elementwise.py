"""Element-wise ops (ops.cpp, unary-ops.cpp, vec.h)."""
import numpy as np

from ..ops import bilinear_corners

from .libm import libm, silu_rows, v_expf
from .rounding import F32, F64, fma32, hsum16


def rms_norm(x, eps):  # x [..., n] f32 -> [..., n]: ggml_compute_forward_rms_norm_f32
    # the squares are rounded to f32, then summed in double strictly left to right
    sum_sq = np.cumsum((x * x).astype(F64), axis=-1)[..., -1]
    mean = (sum_sq / x.shape[-1]).astype(F32)
    scale = F32(1) / np.sqrt(mean + F32(eps))
    return x * scale[..., None]


def layer_norm(x, w, b, eps):  # x [..., n] f32, w [n], b [n] -> [..., n]: ggml_norm, then ggml_mul and ggml_add
    """ggml_compute_forward_norm_f32: the mean from a double sum rounded to float and divided in float;
    the variance (ggml_vec_cvar_f32) sums the f32 squares of x - mean per 16-lane block
    (_mm512_reduce_add_ps) and one by one on the tail in double, divided in double then rounded;
    scale = 1/sqrtf(var + eps). The weight and the bias are separate ops (no fusion for NORM)."""
    n = x.shape[-1]
    mean = (np.cumsum(x.astype(F64), axis=-1)[..., -1].astype(F32) / F32(n)).astype(F32)
    centered = x - mean[..., None]
    n16 = n - n % 16
    squares = centered * centered
    blocks = hsum16(squares[..., :n16].reshape(x.shape[:-1] + (-1, 16))).astype(F64)
    total = np.cumsum(np.concatenate([blocks, squares[..., n16:].astype(F64)], axis=-1), axis=-1)[..., -1]
    scale = F32(1) / np.sqrt((total / n).astype(F32) + F32(eps))
    return (centered * scale[..., None]) * np.asarray(w, F32) + np.asarray(b, F32)


def interpolate_bilinear(grid, out_h, out_w):  # grid [h, w, C] f32 -> [out_h, out_w, C]: ggml_interpolate
    """upscale_f32 in bilinear mode (ops.bilinear_taps: half-pixel centres, border clamp), its
    a*(1-dx)*(1-dy) + b*dx*(1-dy) + c*(1-dx)*dy + d*dx*dy as GCC contracts it: the first product
    fused with the second, then one FMA per further term."""
    a, b, c, d, dx, dy = bilinear_corners(grid, out_h, out_w)
    one = F32(1)
    val = fma32(a * (one - dx), one - dy, (b * dx) * (one - dy))
    val = fma32(c * (one - dx), dy, val)
    return fma32(d * dx, dy, val)


def rope_norm(x, theta):  # x [T, H, D], theta [T, D/2] (ops.rope_angles) -> [T, H, D]; pairs (2i, 2i+1)
    """rotate_pairs with glibc cosf/sinf. GCC vectorises the loop (8 pairs, then 4) and there
    contracts x0*c - x1*s and x0*s + x1*c into one FMA each; the last n_pairs mod 4 pairs are
    computed without contraction."""
    cos, sin = libm("cosf", theta)[:, None, :], libm("sinf", theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    n4 = theta.shape[-1] - theta.shape[-1] % 4
    out = np.empty_like(x)
    out[..., 0:2 * n4:2] = fma32(x0[..., :n4], cos[..., :n4], -(x1[..., :n4] * sin[..., :n4]))
    out[..., 1:2 * n4:2] = fma32(x0[..., :n4], sin[..., :n4], x1[..., :n4] * cos[..., :n4])
    out[..., 2 * n4::2] = x0[..., n4:] * cos[..., n4:] - x1[..., n4:] * sin[..., n4:]
    out[..., 2 * n4 + 1::2] = x0[..., n4:] * sin[..., n4:] + x1[..., n4:] * cos[..., n4:]
    return out


def rope_neox(x, theta):  # x [T, H, D], theta [T, D/2] (ops.rope_angles) -> [T, H, D]; pairs (i, i + D/2)
    """rotate_pairs with n_offset D/2: the same loop body as rope_norm's, so the same rounding is
    assumed (contracted FMAs on the vectorised groups of 4 pairs, plain products on the tail); no
    llama.cpp golden pins this one (the drafter's goldens come from transformers)."""
    cos, sin = libm("cosf", theta)[:, None, :], libm("sinf", theta)[:, None, :]
    half = theta.shape[-1]
    x0, x1 = x[..., :half], x[..., half:2 * half]
    n4 = half - half % 4
    out = np.empty_like(x)
    out[..., :n4] = fma32(x0[..., :n4], cos[..., :n4], -(x1[..., :n4] * sin[..., :n4]))
    out[..., half:half + n4] = fma32(x0[..., :n4], sin[..., :n4], x1[..., :n4] * cos[..., :n4])
    out[..., n4:half] = x0[..., n4:] * cos[..., n4:] - x1[..., n4:] * sin[..., n4:]
    out[..., half + n4:2 * half] = x0[..., n4:] * sin[..., n4:] + x1[..., n4:] * cos[..., n4:]
    out[..., 2 * half:] = x[..., 2 * half:]
    return out


def rope_2d(x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]: clip build_rope_2d
    """Two ggml_rope_ext calls of n_dims D/2 (NORM mode): the first half of every head turned by
    theta_a, the second half (rope_set_offset D/2) by theta_b, each as rope_norm rounds it."""
    half = x.shape[-1] // 2
    return np.concatenate([rope_norm(x[..., :half], theta_a), rope_norm(x[..., half:], theta_b)], axis=-1)


def sigmoid(x):  # [...] -> [...]: op_sigmoid, 1/(1 + expf(-x)) with glibc expf
    return F32(1) / (F32(1) + libm("expf", -np.asarray(x, F32)))


SQRT_2_INV = F32(0.70710678118654752440084436210484)  # vec.h's float constant


def gelu_erf(x):  # [...] f32 -> [...]: ggml_vec_gelu_erf_f32, 0.5f*x*(1 + erff(x*SQRT_2_INV)) with glibc erff
    x = np.asarray(x, F32)
    return (F32(0.5) * x) * (F32(1) + libm("erff", x * SQRT_2_INV))


def swiglu(gate, up):  # gate [T, F], up [T, F] -> [T, F]: ggml_vec_swiglu_f32, silu(gate) * up
    return silu_rows(gate) * up


def softcap(z, cap):  # z [...] -> [...]: ggml_scale(1/cap), glibc tanhf, ggml_scale(cap)
    if cap == 0:
        return z
    return libm("tanhf", z * F32(1.0 / cap)) * F32(cap)


def soft_max(scores, visible, scale):  # scores [R, S] f32, visible [R, S] -> [R, S]: soft_max_ext, F32 mask
    """x*scale + mask, ggml_v_expf(x - max) over 16-lane blocks (scalar glibc expf on a tail),
    each block's f32 reduction added to a double sum, then times (float)(1/sum)."""
    w = np.where(visible, scores * F32(scale), F32(-np.inf)).astype(F32)
    m = np.max(w, axis=-1, keepdims=True)
    n16 = w.shape[-1] - w.shape[-1] % 16
    with np.errstate(invalid="ignore"):
        e = np.concatenate([v_expf(w[:, :n16] - m), libm("expf", w[:, n16:] - m)], axis=-1)
    blocks = hsum16(e[:, :n16].reshape(len(e), -1, 16)).astype(F64)
    total = np.cumsum(np.concatenate([blocks, e[:, n16:].astype(F64)], axis=-1), axis=-1)[:, -1]
    return e * (1.0 / total).astype(F32)[:, None]
