"""GgmlCpuNumbaBackend: reference GgmlCpuBackend with its quantized matmuls (activation quantizers,
integer dots and their float epilogues) and its glibc-bound element-wise ops on numba; attention,
the norms, RoPE and SwiGLU are still the NumPy emulation."""
import numpy as np

from reference.ggml_cpu import GgmlCpuBackend

from . import elementwise
from .mul_mat import mul_mat


class GgmlCpuNumbaBackend(GgmlCpuBackend):
    name = "numba-ggml-cpu"

    def linear(self, x, weights, name):  # x [T, in] f32, GGUF tensor name [out, in] -> [T, out]
        cache = self.decoded.setdefault(weights, {})
        return mul_mat(np.ascontiguousarray(x, np.float32), weights, name, cache, self.repack, self.cache_bytes)

    def sigmoid(self, x):  # [...] -> [...]
        return elementwise.sigmoid(x)

    def gelu_erf(self, x):  # [...] -> [...]
        return elementwise.gelu_erf(x)

    def softcap(self, z, cap):  # z [...] -> [...]
        return elementwise.softcap(np.asarray(z, np.float32), cap)
