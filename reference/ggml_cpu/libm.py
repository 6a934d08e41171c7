"""glibc's libm through ctypes (its expf/cosf/sinf/tanhf/erff are not NumPy's) and ggml's own
vectorised exp and silu (vec.h: the AVX512 variant, and the AVX2/NEON one)."""
import ctypes
import ctypes.util
import functools

import numpy as np

from .rounding import F32, fma32, madd
from .target import AVX512


@functools.lru_cache(maxsize=None)
def _libm_fn(name):  # "expf" -> ctypes function float(float)
    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    fn = getattr(lib, name)
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return fn


def libm(name, x):  # "expf" | "cosf" | "sinf" | "tanhf" | "erff", [...] f32 -> [...] f32 from glibc
    x = np.asarray(x, F32)
    fn = _libm_fn(name)
    return np.array([fn(v) for v in x.ravel().tolist()], F32).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# ggml's vectorised exp and silu (vec.h)

def hexf(text):  # "0x1.8p23" -> float32, the C hex-float constants of vec.h
    return F32(float.fromhex(text))


EXP_R = hexf("0x1.8p23")
C_LOG2E, C_LN2_HI, C_LN2_LO = hexf("0x1.715476p+0"), hexf("0x1.62e4p-1"), hexf("0x1.7f7d1cp-20")
C5, C4, C3, C2, C1 = (hexf(h) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                                         "0x1.ffffecp-1"))
ONE_BITS, SCALE_BITS, SCALE_SIGN = np.uint32(0x3F800000), np.uint32(0x7F000000), np.uint32(0x82000000)


def v_expf(x, scalef=True, fused=True):  # [...] f32 -> [...] f32: ggml_v_expf (max error 1.5 ulp, not expf)
    """n = round(x*log2 e), b = x - n*ln2 in two FMAs, u = b*b and the polynomial. scalef: the __m512
    variant (llama.cpp/ggml/src/ggml-cpu/vec.h:1191-1217) adds the 1 into the polynomial j and scales
    by 2^n with vscalefps, exactly; otherwise (__m256 at vec.h:1234-1272, float32x4_t at vec.h:1152-1174,
    the same operations) j lacks the 1, k = 2^n is built in the exponent bits of z and the result is
    fma(j, k, k), one rounding of k + k*j; |n| > 126 takes (s2 + s2*j) * s1, |n| > 192 s1 * s1.
    Not fused: the __m128 variant of a build without FMA (vec.h:1284-1322), whose MADD128 and NMADD128
    are a multiply and an add or subtract, each rounded."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        z = madd(x, C_LOG2E, EXP_R, fused)
        n = z - EXP_R
        b = madd(-n, C_LN2_LO, madd(-n, C_LN2_HI, x, fused), fused)
        u = b * b
        poly = madd(madd(C5, b, C4, fused), u, madd(C3, b, C2, fused), fused)
        if scalef:
            j = fma32(poly, u, fma32(C1, b, F32(1)))
            res = np.ldexp(j, np.where(np.isfinite(n), n, 0).astype(np.int32)).astype(F32)  # vscalefps
            big = ~(np.abs(n) <= 192)
            return np.where(big, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)
        j = madd(poly, u, C1 * b, fused)
        e = np.asarray(z).view(np.uint32) << np.uint32(23)
        k = (e + ONE_BITS).view(F32)
        g = np.where(n <= 0, SCALE_SIGN, np.uint32(0)).astype(np.uint32)
        s1, s2 = (g + SCALE_BITS).view(F32), (e - g).view(F32)
        # a NaN x: which NaN comes out (its sign) depends on the operand order GCC gives the FMAs; x itself
        out = np.where(np.abs(n) > 192, s1 * s1, np.where(np.abs(n) > 126, madd(s2, j, s2, fused) * s1,
                                                          madd(k, j, k, fused)))
        return np.where(np.isnan(x), x, out).astype(F32)


def v_silu(x, scalef=True, fused=True):  # [...] f32 -> [...] f32: ggml_v_silu, x / (1 + v_expf(-x))
    x = np.asarray(x, F32)
    return x / (F32(1) + v_expf(F32(0) - x, scalef, fused))


def silu_rows(x, target=AVX512):  # [..., n] f32 -> [..., n]: ggml_v_silu on blocks of the target's lanes, glibc on the tail
    """ggml_vec_swiglu_f32 (llama.cpp/ggml/src/ggml-cpu/vec.cpp:278-314): the vector loop while a whole
    register remains (the SSE2 loop's 4 lanes below AVX2, vec.cpp:431-434), then ggml_silu_f32,
    x/(1+expf(-x)) with glibc expf."""
    whole = x.shape[-1] - x.shape[-1] % target.blocks
    head = v_silu(x[..., :whole], target.scalef, target.fma)
    tail = x[..., whole:] / (F32(1) + libm("expf", -x[..., whole:]))
    return np.concatenate([head, tail], axis=-1)


# ---------------------------------------------------------------------------------------------
# glibc's tanhf as its aarch64 build computes it: the fdlibm float code (sysdeps/ieee754/flt-32/s_tanhf.c,
# s_expm1f.c of glibc 2.36), which GCC contracts into fused multiply-adds there (fmadd/fmsub/fnmsub in
# Debian's libm.so.6 for arm64); the x86-64 build has no FMA, so libm("tanhf") is that one.

EXPM1_LN2_HI, EXPM1_LN2_LO, EXPM1_INVLN2 = (np.uint32(b).view(F32) for b in (0x3F317180, 0x3717F7D1, 0x3FB8AA3B))
EXPM1_Q = [np.uint32(b).view(F32) for b in (0xBD088889, 0x3AD00D01, 0xB8A670CD, 0x36867E54, 0xB457EDBB)]  # Q1..Q5


def fdlibm_expm1f(x, fused):  # [...] f32 -> [...] f32: __expm1f, every a*b+c fused where fused (aarch64's GCC)
    """Argument reduction x = k ln2 + r (k = +-1 between 0.5 and 1.5 ln2, else trunc(x/ln2 +- 0.5)),
    the rational approximation on r, then the reconstruction by k's cases (s_expm1f.c)."""
    x = np.asarray(x, F32)
    one, half = F32(1), F32(0.5)

    def madd(a, b, c):  # a*b + c as the build rounds it
        return fma32(a, b, c) if fused else (a * b + c).astype(F32)

    bits = x.view(np.uint32)
    hx, negative = bits & np.uint32(0x7FFFFFFF), (bits >> np.uint32(31)) == 1
    with np.errstate(all="ignore"):
        near = hx < 0x3F851592  # |x| < 1.5 ln2: k = +-1
        k_far = (x * EXPM1_INVLN2 + np.where(negative, -half, half)).astype(F32)
        k = np.where(near, np.where(negative, -1, 1), np.trunc(k_far)).astype(np.int64)
        t = k.astype(F32)
        hi = np.where(near, x - np.where(negative, -EXPM1_LN2_HI, EXPM1_LN2_HI), madd(-t, EXPM1_LN2_HI, x))
        lo = np.where(near, np.where(negative, -EXPM1_LN2_LO, EXPM1_LN2_LO), t * EXPM1_LN2_LO)
        reduced = hx > 0x3EB17218
        k = np.where(reduced, k, 0)
        r = np.where(reduced, hi - lo, x).astype(F32)
        c = np.where(reduced, (hi - r) - lo, F32(0)).astype(F32)
        hfx = half * r
        hxs = r * hfx
        p = madd(hxs, EXPM1_Q[4], EXPM1_Q[3])
        for q in (EXPM1_Q[2], EXPM1_Q[1], EXPM1_Q[0], one):
            p = madd(p, hxs, q)
        t3 = madd(-hfx, p, F32(3))
        e = hxs * ((p - t3) / madd(-r, t3, F32(6)))
        k0 = r - madd(r, e, -hxs)
        e = madd(e - c, r, -c) - hxs
        k_minus1 = madd(r - e, half, -half)
        k1 = np.where(r < F32(-0.25), F32(-2) * (e - (r + half)), madd(r - e, F32(2), one))
        scale = (k << 23).astype(np.uint32)
        wide = ((one - (e - r)).view(np.uint32) + scale).view(F32) - one
        small_t = (np.uint32(0x3F800000) - (np.uint32(0x1000000) >> np.clip(k, 0, 31).astype(np.uint32))).view(F32)
        small = ((small_t - (e - r)).view(np.uint32) + scale).view(F32)
        big_t = (np.clip(0x7F - k, 0, 255).astype(np.uint32) << np.uint32(23)).view(F32)
        big = (((r - (e + big_t)) + one).view(np.uint32) + scale).view(F32)
        out = np.select([k == 0, k == -1, k == 1, (k <= -2) | (k > 56), k < 23], [k0, k_minus1, k1, wide, small], big)
        out = np.where(hx < 0x33000000, x, out)  # |x| < 2^-25: x
        huge_x = hx >= 0x4195B844  # |x| >= 27 ln2: -1 below, overflow above 88.72, NaN and inf as they are
        out = np.where(huge_x & negative, F32(-1), out)
        out = np.where(huge_x & ~negative & (x > np.uint32(0x42B17180).view(F32)), F32(np.inf), out)
        out = np.where(np.isnan(x), x + x, out)
    return out.astype(F32)


def fdlibm_tanhf(x, fused):  # [...] f32 -> [...] f32: __tanhf on fdlibm_expm1f
    """|x| < 1: -t/(t+2) with t = expm1f(-2|x|); 1 <= |x| < 22: 1 - 2/(t+2) with t = expm1f(2|x|);
    beyond: 1; the sign of x restored; |x| < 2^-55: x*(1+x) (s_tanhf.c)."""
    x = np.asarray(x, F32)
    ax = np.abs(x)
    one, two = F32(1), F32(2)
    with np.errstate(all="ignore"):
        below = ax < one
        t = fdlibm_expm1f(np.where(below, -two * ax, two * ax).astype(F32), fused)
        z = np.where(below, -t / (t + two), one - two / (t + two)).astype(F32)
        z = np.where(ax >= F32(22), one, z)
        out = np.where(x < 0, -z, z)
        out = np.where(ax < np.uint32(0x24000000).view(F32), x * (one + x), out)
        out = np.where(np.isnan(x), x, out)
    return out.astype(F32)
