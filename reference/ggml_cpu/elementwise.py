"""Element-wise ops (ops.cpp, unary-ops.cpp, vec.h)."""
import numpy as np

from ..ops import bilinear_corners

from .build import GgmlCpuError
from .libm import fdlibm_tanhf, libm, silu_rows, v_expf
from .rounding import F32, F64, fma32, madd, movehl_sum, register_sum
from .target import AVX512


def rms_norm(x, eps):  # x [..., n] f32 -> [..., n]: ggml_compute_forward_rms_norm_f32
    # the squares are rounded to f32, then summed in double strictly left to right
    sum_sq = np.cumsum((x * x).astype(F64), axis=-1)[..., -1]
    mean = (sum_sq / x.shape[-1]).astype(F32)
    scale = F32(1) / np.sqrt(mean + F32(eps))
    return x * scale[..., None]


def block_sums(v, target=AVX512):  # [..., n] f32, n a multiple of target.blocks -> [..., n / blocks] f32
    """The horizontal sum of each register of the soft_max and cvar loops (vec.cpp:531-599, 469-518):
    _mm512_reduce_add_ps, the __m256 one's movehl/movehdup, vaddvq_f32, and the SSE2 loop's (below
    AVX2): movehl then movehdup on an AVX build, (0+1) + (2+3) by shuffles without AVX (vec.cpp:565-574)."""
    regs = v.reshape(v.shape[:-1] + (-1, target.blocks))
    return movehl_sum(regs) if target.blocks == 4 and target.avx and not target.neon else register_sum(regs)


def layer_norm(x, w, b, eps, target=AVX512):  # x [..., n] f32, w [n], b [n] -> [..., n]: ggml_norm, ggml_mul, ggml_add
    """ggml_compute_forward_norm_f32: the mean from a double sum rounded to float and divided in float;
    the variance (ggml_vec_cvar_f32, llama.cpp/ggml/src/ggml-cpu/vec.cpp:316-390) sums the f32 squares
    of x - mean per register (its horizontal sum) and one by one on the tail in double, divided in
    double then rounded; scale = 1/sqrtf(var + eps). The weight and the bias are separate ops."""
    n = x.shape[-1]
    mean = (np.cumsum(x.astype(F64), axis=-1)[..., -1].astype(F32) / F32(n)).astype(F32)
    centered = x - mean[..., None]
    whole = n - n % target.blocks
    squares = centered * centered
    blocks = block_sums(squares[..., :whole], target).astype(F64)
    total = np.cumsum(np.concatenate([blocks, squares[..., whole:].astype(F64)], axis=-1), axis=-1)[..., -1]
    scale = F32(1) / np.sqrt((total / n).astype(F32) + F32(eps))
    return (centered * scale[..., None]) * np.asarray(w, F32) + np.asarray(b, F32)


def interpolate_bilinear(grid, out_h, out_w, target=AVX512):  # grid [h, w, C] f32 -> [out_h, out_w, C]: ggml_interpolate
    """upscale_f32 in bilinear mode (ops.bilinear_taps: half-pixel centres, border clamp), its
    a*(1-dx)*(1-dy) + b*dx*(1-dy) + c*(1-dx)*dy + d*dx*dy as GCC contracts it: the first product
    fused with the second, then one FMA per further term; every product rounded without FMA."""
    a, b, c, d, dx, dy = bilinear_corners(grid, out_h, out_w)
    one = F32(1)
    val = madd(a * (one - dx), one - dy, (b * dx) * (one - dy), target.fma)
    val = madd(c * (one - dx), dy, val, target.fma)
    return madd(d * dx, dy, val, target.fma)


def rotate(x0, x1, cos, sin, fused, sin_fused=False, tail_fused=False):  # pairs [..., P] x2, cos/sin [..., P] -> (out0, out1)
    """rotate_pairs' x0*c - x1*s and x0*s + x1*c (llama.cpp/ggml/src/ggml-cpu/ops.cpp:6292-6308) as GCC
    compiles them: the first `fused` pairs contracted, fma(x0, c, -(x1*s)) (or with sin_fused
    fma(-x1, s, x0*c), NEON's fmls) and fma(x0, s, x1*c) (AVX2's vfmaddsub231ps too: x0 duplicated into
    both lanes times the cache's (c, s), fused; x1 times (s, c) rounded first); the pairs after them plain products, or
    with tail_fused scalar FMAs, fma(x0, c, -(x1*s)) and the second lane as in the first pairs."""
    out0 = np.empty_like(x0)
    out1 = np.empty_like(x0)

    def second(part):  # the x0*s + x1*c lane of the pairs in part, contracted
        return fma32(x0[..., part], sin[..., part], x1[..., part] * cos[..., part])

    head, tail = (slice(None, fused), slice(fused, None))
    out0[..., head] = (fma32(-x1[..., head], sin[..., head], x0[..., head] * cos[..., head]) if sin_fused
                       else fma32(x0[..., head], cos[..., head], -(x1[..., head] * sin[..., head])))
    out1[..., head] = second(head)
    if tail_fused:
        out0[..., tail] = fma32(x0[..., tail], cos[..., tail], -(x1[..., tail] * sin[..., tail]))
        out1[..., tail] = second(tail)
    else:
        out0[..., tail] = x0[..., tail] * cos[..., tail] - x1[..., tail] * sin[..., tail]
        out1[..., tail] = x0[..., tail] * sin[..., tail] + x1[..., tail] * cos[..., tail]
    return out0, out1


def contracted(pairs, group, target):  # -> how many of the pairs GCC contracts (none without FMA)
    return pairs - pairs % group if target.fma else 0


def rope_norm(x, theta, target=AVX512):  # x [T, H, D], theta [T, D/2] (ops.rope_angles) -> [T, H, D]; pairs (2i, 2i+1)
    """rotate_pairs with glibc cosf/sinf. The AVX512 build vectorises the loop (8 pairs, then 4) and
    contracts x0*c - x1*s and x0*s + x1*c into one FMA each, the last n_pairs mod 4 pairs without
    contraction; the AVX2 build takes 4 pairs, then 2, by vfmaddsub231ps with the x0 products fused, as AVX512
    (x0*s + x1*c is fma(x0, s, x1*c): llama.cpp's own Qcur_rope of an F32 model agrees in every
    element), the last odd pair by vaddsubps, plain (read in its disassembly). The NEON build (ops.cpp compiled by GCC 12 with
    its flags) takes 4 pairs at a time by ld2, fmul and fmls/fmla (x0*c - x1*s fused on the sin
    product, x0*s + x1*c on the x0*s one: the Qcur_rope of its eval callback agrees in every element),
    the last pairs mod 4 by scalar FMAs on x0*c and x0*s; its rope cache calls sincosf, which gives
    glibc's cosf and sinf. A build without FMA rounds each product (the pre-AVX2 variants but piledriver,
    which GCC compiles as the AVX2 build: the same vfmaddsub231ps loop)."""
    cos, sin = libm("cosf", theta)[:, None, :], libm("sinf", theta)[:, None, :]
    pairs = theta.shape[-1]
    out = np.empty_like(x)
    out[..., 0:2 * pairs:2], out[..., 1:2 * pairs:2] = rotate(
        x[..., 0:2 * pairs:2], x[..., 1:2 * pairs:2], cos, sin, contracted(pairs, target.rope_group, target),
        target.rope_sin_fused, target.rope_tail_fused and target.fma)
    return out


def rope_neox(x, theta, target=AVX512):  # x [T, H, D], theta [T, D/2] (ops.rope_angles) -> [T, H, D]; pairs (i, i + D/2)
    """rotate_pairs with n_offset D/2: the AVX512 build is assumed to round as rope_norm (no llama.cpp
    golden pins this one: the drafter's goldens come from transformers); the AVX2 build keeps it a
    scalar loop, every pair contracted (its disassembly). Not read for NEON: refused there."""
    if target.neon:
        raise GgmlCpuError(f"rope_neox is not emulated on the {target.name} target")
    cos, sin = libm("cosf", theta)[:, None, :], libm("sinf", theta)[:, None, :]
    half = theta.shape[-1]
    out = x.copy()
    out[..., :half], out[..., half:2 * half] = rotate(x[..., :half], x[..., half:2 * half], cos, sin,
                                                      contracted(half, target.neox_group, target))
    return out


def rope_2d(x, theta_a, theta_b, target=AVX512):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]: clip build_rope_2d
    """Two ggml_rope_ext calls of n_dims D/2 (NORM mode): the first half of every head turned by
    theta_a, the second half (rope_set_offset D/2) by theta_b, each as rope_norm rounds it."""
    half = x.shape[-1] // 2
    return np.concatenate([rope_norm(x[..., :half], theta_a, target), rope_norm(x[..., half:], theta_b, target)],
                          axis=-1)


def sigmoid(x):  # [...] -> [...]: op_sigmoid, 1/(1 + expf(-x)) with glibc expf
    return F32(1) / (F32(1) + libm("expf", -np.asarray(x, F32)))


SQRT_2_INV = F32(0.70710678118654752440084436210484)  # vec.h's float constant


def gelu_erf(x):  # [...] f32 -> [...]: ggml_vec_gelu_erf_f32, 0.5f*x*(1 + erff(x*SQRT_2_INV)) with glibc erff
    x = np.asarray(x, F32)
    return (F32(0.5) * x) * (F32(1) + libm("erff", x * SQRT_2_INV))


def swiglu(gate, up, target=AVX512):  # gate [T, F], up [T, F] -> [T, F]: ggml_vec_swiglu_f32, silu(gate) * up
    return silu_rows(gate, target) * up


def softcap(z, cap, target=AVX512):  # z [...] -> [...]: ggml_scale(1/cap), glibc tanhf, ggml_scale(cap)
    """tanhf: this machine's glibc for x86 targets; for NEON ones aarch64 glibc's, whose FMAs round
    differently in about 1 of 1300 values (libm.fdlibm_tanhf)."""
    if cap == 0:
        return z
    scaled = z * F32(1.0 / cap)
    return (fdlibm_tanhf(scaled, fused=True) if target.neon else libm("tanhf", scaled)) * F32(cap)


def soft_max(scores, visible, scale, target=AVX512):  # scores [R, S] f32, visible [R, S] -> [R, S]: soft_max_ext
    """x*scale + the F32 mask, ggml_vec_soft_max_f32 (llama.cpp/ggml/src/ggml-cpu/vec.cpp:531-599):
    ggml_v_expf(x - max) a register at a time, each register's f32 horizontal sum added to a double,
    scalar glibc expf on a tail; then times (float)(1/sum). Below AVX2 the SSE2 loop: 4 lanes, its own
    ggml_v_expf (unfused without FMA) and sum (block_sums)."""
    w = np.where(visible, scores * F32(scale), F32(-np.inf)).astype(F32)
    m = np.max(w, axis=-1, keepdims=True)
    whole = w.shape[-1] - w.shape[-1] % target.blocks
    with np.errstate(invalid="ignore"):
        e = np.concatenate([v_expf(w[:, :whole] - m, target.scalef, target.fma), libm("expf", w[:, whole:] - m)],
                           axis=-1)
    blocks = block_sums(e[:, :whole], target).astype(F64)
    total = np.cumsum(np.concatenate([blocks, e[:, whole:].astype(F64)], axis=-1), axis=-1)[:, -1]
    return e * (1.0 / total).astype(F32)[:, None]
