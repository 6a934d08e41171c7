"""glibc's libm through ctypes (its expf/cosf/sinf/tanhf/erff are not NumPy's) and ggml's own
vectorised exp and silu (vec.h, the AVX512 variants)."""
import ctypes
import ctypes.util
import functools

import numpy as np

from .rounding import F32, fma32


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
# ggml's vectorised exp and silu (vec.h, the AVX512 variants)

def hexf(text):  # "0x1.8p23" -> float32, the C hex-float constants of vec.h
    return F32(float.fromhex(text))


EXP_R = hexf("0x1.8p23")


def v_expf(x):  # [...] f32 -> [...] f32: ggml_v_expf for __m512 (max error 1.5 ulp, not expf)
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma32(x, hexf("0x1.715476p+0"), EXP_R)
        n = z - EXP_R
        b = fma32(-n, hexf("0x1.7f7d1cp-20"), fma32(-n, hexf("0x1.62e4p-1"), x))
        u = b * b
        j = fma32(fma32(fma32(hexf("0x1.0e4020p-7"), b, hexf("0x1.573e2ep-5")), u,
                        fma32(hexf("0x1.555e66p-3"), b, hexf("0x1.fffdb6p-2"))),
                  u, fma32(hexf("0x1.ffffecp-1"), b, F32(1)))
        res = np.ldexp(j, np.where(np.isfinite(n), n, 0).astype(np.int32)).astype(F32)  # vscalefps
        big = ~(np.abs(n) <= 192)
        return np.where(big, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)


def v_silu(x):  # [...] f32 -> [...] f32: ggml_v_silu, x / (1 + v_expf(-x))
    x = np.asarray(x, F32)
    return x / (F32(1) + v_expf(F32(0) - x))


def silu_rows(x):  # [..., n] f32 -> [..., n]: ggml_v_silu on 16-lane blocks, glibc x/(1+expf(-x)) on the tail
    n16 = x.shape[-1] - x.shape[-1] % 16
    head = v_silu(x[..., :n16])
    tail = x[..., n16:] / (F32(1) + libm("expf", -x[..., n16:]))
    return np.concatenate([head, tail], axis=-1)
