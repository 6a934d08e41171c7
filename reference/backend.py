"""The backend interface: every op a model forward (text, vision, DFlash drafter) computes through.
`Backend` declares them; `NumpyBackend` is the reference; ggml_cpu.GgmlCpuBackend rounds as
llama.cpp's CPU backend does, tp.TensorParallelBackend sums row-parallel products like an
all-reduce, and accel/ provides others (numba, CuPy) that must agree with the reference op by op.
tests/test_backend.py checks that every backend implements every op declared here.

What stays outside the backend is host-side bookkeeping every engine does on the host too: RoPE
angles, masks, the vision window permutation and the residual adds and norm-weight products (plain
float32 element-wise arithmetic, the same on every backend).
"""
from typing import Protocol

import numpy as np

from . import ops


STREAM_ROWS = 4096


class Backend(Protocol):
    name: str

    def linear(self, x, w):  # x [T, in], w a GGUF tensor (gguf.Tensor, resolved at load) [out, in] -> [T, out]
        ...

    def matmul(self, x, w):  # x [T, in], w [out, in] (an array, not a GGUF tensor) -> [T, out]
        ...

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        ...

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        ...

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        ...

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (2i, 2i+1)
        ...

    def rope_neox(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (i, i + D/2)
        ...

    def rope_2d(self, x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]
        ...

    def sigmoid(self, x):  # [...] -> [...]
        ...

    def gelu_erf(self, x):  # [...] -> [...]
        ...

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        ...

    def softcap(self, z, cap):  # z [...] -> [...]
        ...


class GgmlGraph(Protocol):
    """What mtmd's CPU graph of the vision tower computes beyond Backend's ops, declared by the
    ggml-cpu backends only (the tower's numerics "ggml-cpu" needs one of them)."""

    def float_matmul(self, x, w, kind):  # x [T, in], w [out, in] arrays, "F32" | "F16" -> [T, out]
        ...

    def graph_attention(self, q, k, v, visible, scale):  # [T, H, D] x3, [T, T] -> [T, H, D]: no KV cache
        ...

    def interpolate(self, grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]: bilinear, border clamp
        ...


def declared(protocol):  # -> the op names a Protocol declares
    return tuple(name for name in vars(protocol) if not name.startswith("_") and callable(vars(protocol)[name]))


OPS, GRAPH_OPS = declared(Backend), declared(GgmlGraph)


class NumpyBackend:
    name = "numpy"

    def __init__(self, dtype):
        self.dtype = dtype

    def linear(self, x, w):  # x [T, in], w a GGUF tensor (gguf.Tensor) [out, in] -> [T, out]
        # f64 weights because ops.linear accumulates in f64. A matrix too big for the weight cache
        # (the 202048-row output head of the 30B model is 10 GB in f64) is streamed in row blocks.
        if w.dense_bytes(np.float64) <= w.weights.cache_bytes // 4:
            return ops.linear(x, w.get(np.float64))
        n_out = w.shape[0]
        out = np.empty((x.shape[0], n_out), x.dtype)
        for start in range(0, n_out, STREAM_ROWS):
            rows = slice(start, min(start + STREAM_ROWS, n_out))
            out[:, rows] = ops.linear(x, w.rows(rows, np.float64))
        return out

    def matmul(self, x, w):  # x [T, in], w [out, in] -> [T, out]
        return ops.linear(x, w)

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        return ops.attention(q, k, v, visible, scale)

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        return ops.rms_norm(x, eps)

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        return ops.layer_norm(x, w, b, eps)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return ops.rope_norm(x, theta)

    def rope_neox(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return ops.rope_neox(x, theta)

    def rope_2d(self, x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]
        return ops.rope_2d(x, theta_a, theta_b)

    def sigmoid(self, x):  # [...] -> [...]
        return ops.sigmoid(x)

    def gelu_erf(self, x):  # [...] -> [...]
        return ops.gelu_erf(x)

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        return ops.swiglu(gate, up)

    def softcap(self, z, cap):  # z [...] -> [...]
        return ops.softcap(z, cap)
