"""Norms, RoPE and activations in numba, one pass over the data each, with reference/ops.py's
roundings: the same operations in the activation dtype (float32, or float64 for the noise floor),
sums of squares and means in float64 and rounded once to the dtype. Scalars come in already cast
to the dtype (`one`, `eps`, ...) so each kernel is compiled once per dtype and computes in it.

The cos/sin of the RoPE angles are taken by numpy before the kernel: the very values ops.rope_norm
uses. exp, tanh and erf come from libm, which may differ from numpy's vectorized versions in the
last bit (whole tiny models: NMSE ~1e-13, next to the products' float32 sums).
"""
import math

import numpy as np
from numba import njit, prange

SQRT2 = math.sqrt(2.0)


@njit(cache=True, parallel=True)
def rms_norm_rows(x, eps, one, out):  # x [R, n] -> out [R, n]
    n = x.shape[1]
    for r in prange(x.shape[0]):
        s = 0.0
        for j in range(n):
            s += np.float64(x[r, j] * x[r, j])  # the square in the dtype, the sum in float64 (ggml)
        out[r, 0] = s / n  # rounds the mean to the dtype through the output row, overwritten below
        scale = one / np.sqrt(out[r, 0] + eps)
        for j in range(n):
            out[r, j] = x[r, j] * scale


@njit(cache=True, parallel=True)
def layer_norm_rows(x, w, b, eps, out):  # x [R, n], w [n], b [n] -> out [R, n]
    n = x.shape[1]
    for r in prange(x.shape[0]):
        s = 0.0
        for j in range(n):
            s += np.float64(x[r, j])
        out[r, 0] = s / n
        mean = out[r, 0]
        s = 0.0
        for j in range(n):
            c = np.float64(x[r, j] - mean)
            s += c * c
        out[r, 0] = s / n
        std = np.sqrt(out[r, 0] + eps)
        for j in range(n):
            out[r, j] = (x[r, j] - mean) / std * w[j] + b[j]


@njit(cache=True, parallel=True)
def rope_pairs(x, cos, sin, first, stride, out):  # x/out [T, H, D], cos/sin [T, P]: pair i = (first + i*step, + stride)
    """Rotates P pairs per head: pair i is (a, a + stride) with a = first + i (stride > 1, NEOX) or
    a = first + 2i (stride 1, NORM); elements of no pair are left as they are in `out`."""
    T, H = x.shape[0], x.shape[1]
    step = 2 if stride == 1 else 1
    for th in prange(T * H):
        t, h = th // H, th % H
        for i in range(cos.shape[1]):
            a = first + i * step
            e, o = x[t, h, a], x[t, h, a + stride]
            out[t, h, a] = e * cos[t, i] - o * sin[t, i]
            out[t, h, a + stride] = e * sin[t, i] + o * cos[t, i]


@njit(cache=True, parallel=True)
def sigmoid_flat(x, one, out):  # x [n] -> out [n]
    for i in prange(x.shape[0]):
        out[i] = one / (one + np.exp(-x[i]))


@njit(cache=True, parallel=True)
def swiglu_flat(gate, up, one, out):  # gate [n], up [n] -> out [n]: silu(gate) * up
    for i in prange(gate.shape[0]):
        out[i] = gate[i] / (one + np.exp(-gate[i])) * up[i]


@njit(cache=True, parallel=True)
def softcap_flat(z, inv_cap, cap, out):  # z [n] -> out [n]: tanh(z / cap) * cap, dividing by the rounded reciprocal
    for i in prange(z.shape[0]):
        out[i] = np.tanh(z[i] * inv_cap) * cap


@njit(cache=True, parallel=True)
def gelu_erf_flat(x, half, out):  # x [n] -> out [n]
    # ops.gelu_erf: 0.5 * x in the dtype, erf(x / sqrt 2) and the product in float64, one rounding
    for i in prange(x.shape[0]):
        out[i] = np.float64(half * x[i]) * (1.0 + math.erf(np.float64(x[i]) / SQRT2))
