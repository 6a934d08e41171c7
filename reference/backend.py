"""The backend interface: every op a model forward (text, vision, DFlash drafter) computes through.
`Backend` declares them; `NumpyBackend` is the reference; ggml_cpu.GgmlCpuBackend rounds as
llama.cpp's CPU backend does, tp.TensorParallelBackend sums row-parallel products like an
all-reduce, and accel/ provides others (numba, CuPy) that must agree with the reference op by op.
tests/test_backend.py checks that every backend implements every op declared here.

The vision tower's convolution (its im2col and the product's operand order), the position table's
resize and the window attention are ops too: they are where llama.cpp's graph rounds unlike the
exact mode, so the ggml-cpu backends compute them as mtmd does, and refuse in one line what its
graph has no form of (a video's frame pair).

What stays outside the backend is host-side bookkeeping every engine does on the host too: RoPE
angles, masks, the vision window permutation and the residual adds and norm-weight products (plain
float32 element-wise arithmetic, the same on every backend).
"""
from typing import Protocol

import numpy as np

from . import ops


STREAM_ROWS = 4096
ATTENTION_SCORES_BUDGET = 1 << 25  # float64 scores per attention call (256 MiB): bounds global layers


class Backend(Protocol):
    name: str

    def linear(self, x, w):  # x [T, in], w a GGUF tensor (gguf.Tensor, resolved at load) [out, in] -> [T, out]
        ...

    def patch_embed(self, frames, kernel):  # frames [F, H, W, C], kernel [E, F, C, p, p] -> [(H/p)*(W/p), E]
        ...  # a stride-p convolution, no bias: the vision tower's patches, raster order

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        ...

    def window_attention(self, q, k, v, windows, scale):  # [T, H, D] x3, windows [W] token counts -> [T, H, D]
        ...  # bidirectional inside each run of `windows` consecutive tokens, no KV cache

    def interpolate(self, grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]: bilinear, border clamp
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



def declared(protocol):  # -> the op names a Protocol declares
    return tuple(name for name in vars(protocol) if not name.startswith("_") and callable(vars(protocol)[name]))


def attention_by_window(attention, q, k, v, windows, scale):  # a backend's attention, [T, H, D] x3, [W] -> [T, H, D]
    """Each window through `attention` on its own, never an N x N mask; queries go in blocks small
    enough that one block's scores fit ATTENTION_SCORES_BUDGET (a global layer at 4096 tokens has
    N = 16384)."""
    out = np.empty_like(q)
    stops = np.cumsum(windows)
    for start, stop in zip(stops - windows, stops):
        n = stop - start
        block = max(1, ATTENTION_SCORES_BUDGET // (q.shape[1] * n))
        for q0 in range(start, stop, block):
            q1 = min(q0 + block, stop)
            visible = np.ones((q1 - q0, n), dtype=bool)
            out[q0:q1] = attention(q[q0:q1], k[start:stop], v[start:stop], visible, scale)
    return out


OPS = declared(Backend)


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

    def patch_embed(self, frames, kernel):  # frames [F, H, W, C], kernel [E, F, C, p, p] -> [(H/p)*(W/p), E]
        return ops.linear(ops.im2col(frames, kernel.shape[-1]), kernel.reshape(len(kernel), -1))

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        return ops.attention(q, k, v, visible, scale)

    def window_attention(self, q, k, v, windows, scale):  # [T, H, D] x3, windows [W] -> [T, H, D]
        return attention_by_window(self.attention, q, k, v, windows, scale)

    def interpolate(self, grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]
        return ops.resize_bilinear_border(grid, out_h, out_w)

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
