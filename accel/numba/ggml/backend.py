"""GgmlCpuNumbaBackend: reference GgmlCpuBackend with its quantized matmuls (activation quantizers,
integer dots and their float epilogues) on the numba kernels; attention and the element-wise ops
are still the NumPy emulation."""
import numpy as np

from reference.ggml_cpu import GgmlCpuBackend

from .mul_mat import mul_mat


class GgmlCpuNumbaBackend(GgmlCpuBackend):
    name = "numba-ggml-cpu"

    def linear(self, x, weights, name):  # x [T, in] f32, GGUF tensor name [out, in] -> [T, out]
        return mul_mat(np.ascontiguousarray(x, np.float32), weights, name, self.decoded)
