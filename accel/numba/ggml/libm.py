"""reference/ggml_cpu/libm.py's glibc calls inside numba kernels: numba calls the same ctypes
functions of libm from compiled code, so a whole array costs one Python call, not one per element."""
import numba
import numpy as np

from reference.ggml_cpu.libm import _libm_fn

LIBM = {name: _libm_fn(name) for name in ("expf", "cosf", "sinf", "tanhf", "erff")}


def libm_kernel(fn):  # ctypes float(float) -> njit(x f32 [n]) -> f32 [n]
    @numba.njit
    def apply(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = fn(x[i])
        return out
    return apply


KERNELS = {name: libm_kernel(fn) for name, fn in LIBM.items()}


def libm(name, x):  # as reference libm: "expf" | "cosf" | "sinf" | "tanhf" | "erff", [...] f32 -> [...] f32
    x = np.ascontiguousarray(x, np.float32)
    return KERNELS[name](x.ravel()).reshape(x.shape)
