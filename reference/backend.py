"""The backend interface: the hot ops a model forward calls. `NumpyBackend` is the reference;
accel/ provides others (numba, CuPy) that must agree with it op by op."""
import numpy as np

from . import ops


class NumpyBackend:
    name = "numpy"

    def __init__(self, dtype):
        self.dtype = dtype

    def linear(self, x, weights, name):  # x [T, in], GGUF tensor name [out, in] -> [T, out]
        return ops.linear(x, weights.get(name, np.float64))  # f64 products, see ops.linear

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        return ops.attention(q, k, v, visible, scale)
