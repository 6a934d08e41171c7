"""The backend interface: the hot ops a model forward calls. `NumpyBackend` is the reference;
accel/ provides others (numba, CuPy) that must agree with it op by op."""
import numpy as np

from . import ops


STREAM_ROWS = 4096


class NumpyBackend:
    name = "numpy"

    def __init__(self, dtype):
        self.dtype = dtype

    def linear(self, x, weights, name):  # x [T, in], GGUF tensor name [out, in] -> [T, out]
        # f64 weights because ops.linear accumulates in f64. A matrix too big for the weight cache
        # (the 202048-row output head of the 30B model is 10 GB in f64) is streamed in row blocks.
        if weights.dense_bytes(name, np.float64) <= weights.cache_bytes // 4:
            return ops.linear(x, weights.get(name, np.float64))
        n_out = weights.shape(name)[0]
        out = np.empty((x.shape[0], n_out), x.dtype)
        for start in range(0, n_out, STREAM_ROWS):
            rows = slice(start, min(start + STREAM_ROWS, n_out))
            out[:, rows] = ops.linear(x, weights.rows(name, rows, np.float64))
        return out

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        return ops.attention(q, k, v, visible, scale)

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        return ops.rms_norm(x, eps)

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        return ops.layer_norm(x, w, b, eps)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return ops.rope_norm(x, theta)

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
