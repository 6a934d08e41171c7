"""glibc's libm through ctypes (its expf/cosf/sinf/tanhf/erff are not NumPy's) and ggml's own
vectorised exp and silu (vec.h: the AVX512 variant, and the AVX2/NEON one)."""
import ctypes
import ctypes.util
import functools

import numpy as np

from .rounding import F32, fma32
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


def v_expf(x, scalef=True):  # [...] f32 -> [...] f32: ggml_v_expf (max error 1.5 ulp, not expf)
    """n = round(x*log2 e), b = x - n*ln2 in two FMAs, u = b*b and the polynomial. scalef: the __m512
    variant (llama.cpp/ggml/src/ggml-cpu/vec.h:1191-1217) adds the 1 into the polynomial j and scales
    by 2^n with vscalefps, exactly; otherwise (__m256 at vec.h:1234-1272, float32x4_t at vec.h:1152-1174,
    the same operations) j lacks the 1, k = 2^n is built in the exponent bits of z and the result is
    fma(j, k, k), one rounding of k + k*j; |n| > 126 takes (s2 + s2*j) * s1, |n| > 192 s1 * s1."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        z = fma32(x, C_LOG2E, EXP_R)
        n = z - EXP_R
        b = fma32(-n, C_LN2_LO, fma32(-n, C_LN2_HI, x))
        u = b * b
        poly = fma32(fma32(C5, b, C4), u, fma32(C3, b, C2))
        if scalef:
            j = fma32(poly, u, fma32(C1, b, F32(1)))
            res = np.ldexp(j, np.where(np.isfinite(n), n, 0).astype(np.int32)).astype(F32)  # vscalefps
            big = ~(np.abs(n) <= 192)
            return np.where(big, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)
        j = fma32(poly, u, C1 * b)
        e = np.asarray(z).view(np.uint32) << np.uint32(23)
        k = (e + ONE_BITS).view(F32)
        g = np.where(n <= 0, SCALE_SIGN, np.uint32(0)).astype(np.uint32)
        s1, s2 = (g + SCALE_BITS).view(F32), (e - g).view(F32)
        # a NaN x: which NaN comes out (its sign) depends on the operand order GCC gives the FMAs; x itself
        out = np.where(np.abs(n) > 192, s1 * s1, np.where(np.abs(n) > 126, fma32(s2, j, s2) * s1, fma32(k, j, k)))
        return np.where(np.isnan(x), x, out).astype(F32)


def v_silu(x, scalef=True):  # [...] f32 -> [...] f32: ggml_v_silu, x / (1 + v_expf(-x))
    x = np.asarray(x, F32)
    return x / (F32(1) + v_expf(F32(0) - x, scalef))


def silu_rows(x, target=AVX512):  # [..., n] f32 -> [..., n]: ggml_v_silu on blocks of the target's lanes, glibc on the tail
    """ggml_vec_swiglu_f32 (llama.cpp/ggml/src/ggml-cpu/vec.cpp:278-314): the vector loop while a whole
    register remains, then ggml_silu_f32, x/(1+expf(-x)) with glibc expf."""
    whole = x.shape[-1] - x.shape[-1] % target.lanes
    head = v_silu(x[..., :whole], target.scalef)
    tail = x[..., whole:] / (F32(1) + libm("expf", -x[..., whole:]))
    return np.concatenate([head, tail], axis=-1)
