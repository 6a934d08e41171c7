"""GgmlCpuNumbaBackend: reference GgmlCpuBackend with every kernel on its numba twin: the quantized
matmuls (activation quantizers, integer dots and their float epilogues), the float (F32/F16/BF16)
matmuls, attention (both paths, F16/F32/Q8_0 caches), the norms, RoPE, SwiGLU and the glibc-bound
element-wise ops."""
import numpy as np

from reference.factory import ggml_cpu_options
from reference.ggml_cpu import GgmlCpuBackend
from reference.ggml_cpu.attention import flash_types

from . import attention, elementwise
from .float_dots import float_mul_mat
from .mul_mat import mul_mat
from .quantize import x86_only

F32 = np.float32


class GgmlCpuNumbaBackend(GgmlCpuBackend):
    name = "numba-ggml-cpu"
    float_product = staticmethod(float_mul_mat)
    attention_kernels = attention.KERNELS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        x86_only(self.target)

    def linear(self, x, w):  # x [T, in] f32, w a GGUF tensor [out, in] -> [T, out]
        cache = self.decoded.setdefault(w.weights, {})
        return mul_mat(np.ascontiguousarray(x, np.float32), w.weights, w.name, cache, self.repack, self.cache_bytes,
                       self.target)

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        q, k, v = (np.asarray(a, F32) for a in (q, k, v))
        if not self.flash_attn:
            return attention.attention_mul_mat(q, k, v, visible, scale, self.k_type, self.target, self.v_type)
        k_type, v_type = flash_types(self.k_type, self.v_type)
        if (k_type, v_type) == ("f16", "f16"):
            return attention.attention_flash(q, k, v, visible, scale, self.n_threads, self.target)
        return attention.attention_q8_0(q, k, v, visible, scale, self.target, k_type, v_type)

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        return elementwise.rms_norm(x, eps)

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        return elementwise.layer_norm(x, w, b, eps, self.target)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return elementwise.rope_norm(x, theta, self.target)

    def rope_neox(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return elementwise.rope_neox(x, theta, self.target)

    def rope_2d(self, x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]
        return elementwise.rope_2d(x, theta_a, theta_b, self.target)

    def sigmoid(self, x):  # [...] -> [...]
        return elementwise.sigmoid(x)

    def gelu_erf(self, x):  # [...] -> [...]
        return elementwise.gelu_erf(x)

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        return elementwise.swiglu(gate, up, self.target)

    def softcap(self, z, cap):  # z [...] -> [...]
        return elementwise.softcap(np.asarray(z, np.float32), cap)


def ggml_cpu_numba_backend(build):  # factory.Build -> GgmlCpuNumbaBackend (accel.BACKENDS' maker)
    return GgmlCpuNumbaBackend(**ggml_cpu_options(build))
