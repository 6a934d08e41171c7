"""The libm-bound element-wise ops of reference/ggml_cpu/elementwise.py with glibc called from numba
(libm.py): the same float32 operations in the same order, one compiled loop per array."""
import numpy as np

from reference.ggml_cpu.elementwise import SQRT_2_INV

from .libm import libm

F32 = np.float32


def sigmoid(x):  # [...] -> [...]: op_sigmoid, 1/(1 + expf(-x)) with glibc expf
    return F32(1) / (F32(1) + libm("expf", -np.asarray(x, F32)))


def softcap(z, cap):  # z [...] -> [...]: ggml_scale(1/cap), glibc tanhf, ggml_scale(cap)
    if cap == 0:
        return z
    return libm("tanhf", z * F32(1.0 / cap)) * F32(cap)


def gelu_erf(x):  # [...] f32 -> [...]: ggml_vec_gelu_erf_f32 with glibc erff
    x = np.asarray(x, F32)
    return (F32(0.5) * x) * (F32(1) + libm("erff", x * SQRT_2_INV))
