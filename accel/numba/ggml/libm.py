"""reference/ggml_cpu/libm.py's glibc calls inside numba kernels: numba calls the same ctypes
functions of libm from compiled code, so a whole array costs one Python call, not one per element."""
import numba
import numpy as np

from reference.ggml_cpu.libm import _libm_fn

from .threads import threaded

LIBM = {name: _libm_fn(name) for name in ("expf", "cosf", "sinf", "tanhf", "erff")}


def libm_kernel(fn):  # ctypes or njit float(float) -> Threaded (work, x f32 [n]) -> f32 [n]
    def apply(x):  # glibc's float functions are pure: the elements may go to any thread
        out = np.empty_like(x)
        for i in numba.prange(x.size):
            out[i] = fn(x[i])
        return out
    return threaded(cache=False)(apply)  # not cached: the glibc functions are ctypes pointers


KERNELS = {name: libm_kernel(fn) for name, fn in LIBM.items()}


def libm(name, x):  # as reference libm: "expf" | "cosf" | "sinf" | "tanhf" | "erff", [...] f32 -> [...] f32
    x = np.ascontiguousarray(x, np.float32)
    return KERNELS[name](x.size, x.ravel()).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# ggml's vectorised exp and silu (reference libm.py), one lane at a time

from reference.ggml_cpu.libm import EXP_R, hexf  # noqa: E402

from .rounding import fma32  # noqa: E402

EXPF = LIBM["expf"]
C_LOG2E, C_LN2_HI, C_LN2_LO = hexf("0x1.715476p+0"), hexf("0x1.62e4p-1"), hexf("0x1.7f7d1cp-20")
C5, C4, C3, C2, C1 = (hexf(h) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                                         "0x1.ffffecp-1"))
ONE, INF = np.float32(1), np.float32(np.inf)


@numba.njit(cache=True, inline="always")
def v_expf_lane(x):  # f32 -> f32: one lane of reference v_expf (ggml_v_expf for __m512)
    z = fma32(x, C_LOG2E, EXP_R)
    n = z - EXP_R
    b = fma32(-n, C_LN2_LO, fma32(-n, C_LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(C5, b, C4), u, fma32(C3, b, C2)), u, fma32(C1, b, ONE))
    if not abs(n) <= 192:  # NaN too, as the reference's ~(|n| <= 192)
        return np.float32(0) if n <= 0 else INF
    return np.float32(np.float64(j) * 2.0 ** np.float64(n))  # vscalefps: exact in float64, rounded once


@numba.njit(cache=True, inline="always")
def v_silu_lane(x):  # f32 -> f32: x / (1 + v_expf(0 - x))
    return x / (ONE + v_expf_lane(np.float32(0) - x))


v_expf_flat, v_silu_flat = libm_kernel(v_expf_lane), libm_kernel(v_silu_lane)  # (work, f32 [n]) -> [n]


@threaded(cache=False)  # not cached: glibc expf is a ctypes pointer
def silu_rows_2d(x):  # f32 [R, n] -> [R, n]: v_silu on 16-lane blocks, glibc x/(1+expf(-x)) on the tail
    R, n = x.shape
    n16 = n - n % 16
    out = np.empty_like(x)
    for r in numba.prange(R):
        for i in range(n16):
            out[r, i] = v_silu_lane(x[r, i])
        for i in range(n16, n):
            out[r, i] = x[r, i] / (ONE + EXPF(-x[r, i]))
    return out


def v_expf(x):  # [...] f32 -> [...] f32: reference v_expf
    x = np.ascontiguousarray(x, np.float32)
    return v_expf_flat(x.size, x.ravel()).reshape(x.shape)


def v_silu(x):  # [...] f32 -> [...] f32: reference v_silu
    x = np.ascontiguousarray(x, np.float32)
    return v_silu_flat(x.size, x.ravel()).reshape(x.shape)


def silu_rows(x):  # [..., n] f32 -> [..., n]: reference silu_rows
    x = np.ascontiguousarray(x, np.float32)
    return silu_rows_2d(x.size, x.reshape(-1, x.shape[-1])).reshape(x.shape)
