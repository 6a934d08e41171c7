"""NumbaBackend: the interface of reference/backend.py NumpyBackend (linear on GGUF tensors,
attention over cache rows, norms, RoPE, activations), computed by numba kernels straight from the
memory-mapped quantized blocks.

linear multiplies the same exact float32 weights as the reference, with sums in float32 inside a
super-block or tile and in float64 across them (quant.py says which types and why), by one of two
routes:
- few rows of x (decode, a draft verification): every weight row is read once per row of x
  straight from its blocks (quant.matmul_rows), nothing is dequantized;
- many rows (prefill): tiles of weights are decoded once into a small buffer and multiplied with
  every row of x (quant.matmul_tiles).
No BLAS call: one thread pool (numba's) does all the work, and sums do not depend on a BLAS build.
A type without a kernel falls back to the numpy reference's product.
"""
import numpy as np

from reference.backend import NumpyBackend, attention_by_window

from . import attention as attention_kernels
from . import pointwise, quant

LARGEST_KERNEL_INPUT = 1e30  # the kernels multiply x by unscaled integer weights (up to 127) in float32
FUSED_MAX_ROWS = 2   # rows of x up to which the row route is used: it beats the tiles up to 2 rows of x
                     # (Q4_K, Q5_K, IQ2_XXS) or 3 (Q6_K), measured on 4096x6656 matrices
TOKEN_BLOCK = 1024   # rows of x per tiled product: each tile of weights is decoded once per block;
                     # a 5476-token F16 product (the vision tower's ffn_up) ran at 134 GFLOP/s
                     # against 119 with 256 rows (measured, 2 threads), the block's 4 MB in L3


class NumbaBackend:
    name = "numba"

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.fallback = NumpyBackend(self.dtype)

    # -- products --------------------------------------------------------------------------

    def linear(self, x, w):  # x [T, in], w a GGUF tensor (gguf.Tensor) [out, in] -> [T, out]
        qtype = w.tensor_type
        if qtype not in quant.KERNEL_TYPES or not kernel_input(x):
            return self.fallback.linear(x, w)
        n_out, n_in = w.shape
        blocks = quant.as_blocks(w.raw, n_out)
        x = np.ascontiguousarray(x)
        out = np.empty((len(x), n_out), x.dtype)
        if len(x) <= FUSED_MAX_ROWS:
            quant.matmul_rows(int(qtype), blocks, x, block_sums16(x), out, quant.TABLES)
            return out
        for t0 in range(0, len(x), TOKEN_BLOCK):
            quant.matmul_tiles(int(qtype), blocks, x[t0:t0 + TOKEN_BLOCK], out[t0:t0 + TOKEN_BLOCK], quant.TABLES)
        return out

    def patch_embed(self, frames, kernel):  # frames [F, H, W, C], kernel [E, F, C, p, p] -> [(H/p)*(W/p), E]
        return self.fallback.patch_embed(frames, kernel)  # one product per image, against a kernel no tensor cache holds

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        return attention_kernels.attention(q, k, v, visible, scale)

    def window_attention(self, q, k, v, windows, scale):  # [T, H, D] x3, windows [W] -> [T, H, D]
        return attention_by_window(self.attention, q, k, v, windows, scale)

    def interpolate(self, grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]: the reference's, on the host
        return self.fallback.interpolate(grid, out_h, out_w)

    # -- norms, RoPE, activations (the functions of reference/ops.py) ----------------------

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        rows = rows_of(x)
        out = np.empty_like(rows)
        pointwise.rms_norm_rows(rows, x.dtype.type(eps), x.dtype.type(1), out)
        return out.reshape(x.shape)

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        rows = rows_of(x)
        out = np.empty_like(rows)
        pointwise.layer_norm_rows(rows, w.astype(x.dtype), b.astype(x.dtype), x.dtype.type(eps), out)
        return out.reshape(x.shape)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (2i, 2i+1)
        return rotate(x, [(theta, 0, 1)])

    def rope_neox(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (i, i + D/2)
        return rotate(x, [(theta, 0, x.shape[-1] // 2)])

    def rope_2d(self, x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]
        return rotate(x, [(theta_a, 0, 1), (theta_b, x.shape[-1] // 2, 1)])

    def sigmoid(self, x):  # [...] -> [...]
        return elementwise(pointwise.sigmoid_flat, x, x.dtype.type(1))

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        return elementwise(pointwise.swiglu_flat, gate, flat(up.astype(gate.dtype, copy=False)), gate.dtype.type(1))

    def softcap(self, z, cap):  # z [...] -> [...]
        if cap == 0:
            return z
        return elementwise(pointwise.softcap_flat, z, z.dtype.type(1.0 / cap), z.dtype.type(cap))

    def gelu_erf(self, x):  # [...] -> [...]
        return elementwise(pointwise.gelu_erf_flat, x, x.dtype.type(0.5))


def numba_backend(build):  # factory.Build -> NumbaBackend of its dtype (accel.BACKENDS' maker)
    return NumbaBackend(np.dtype(build.dtype))


def kernel_input(x):  # x [T, in] -> whether the kernels give what the reference gives on it
    """float32/float64 activations below 1e30 in magnitude. Larger ones could overflow an unscaled
    product that the reference never forms, and an inf meets a zero weight (NaN) in the factored
    K-quant form where the reference's inf passes through; no real model makes either, and the
    reference's product gives numpy's inf and NaN exactly."""
    if x.dtype not in (np.float32, np.float64):
        return False
    # max and min without a temporary the size of x (np.abs took 200 ms of a 1.6 s vision product);
    # a NaN makes both comparisons false
    return x.size == 0 or bool(x.max() < LARGEST_KERNEL_INPUT and x.min() > -LARGEST_KERNEL_INPUT)


def block_sums16(x):  # x [T, n] -> [T, n/16] float64: the sums the K-quant mins multiply
    if x.shape[1] % 16:
        return np.zeros((len(x), 1))
    return x.reshape(len(x), -1, 16).sum(-1, dtype=np.float64)


def rows_of(x):  # [..., n] -> C-contiguous [R, n]
    return np.ascontiguousarray(x).reshape(-1, x.shape[-1])


def flat(x):  # [...] -> C-contiguous [n]
    return np.ascontiguousarray(x).reshape(-1)


def elementwise(kernel, x, *scalars):  # apply a *_flat kernel: [...] -> [...]
    out = np.empty(x.shape, x.dtype)
    kernel(flat(x), *scalars, out.reshape(-1))
    return out


def rotate(x, parts):  # x [T, H, D], [(theta [T, P], first, stride)] -> [T, H, D]
    x = np.ascontiguousarray(x)
    out = x.copy()
    for theta, first, stride in parts:
        # numpy's cos/sin, the very values ops.rope_norm uses
        cos, sin = np.ascontiguousarray(np.cos(theta), x.dtype), np.ascontiguousarray(np.sin(theta), x.dtype)
        pointwise.rope_pairs(x, cos, sin, first, stride, out)
    return out
