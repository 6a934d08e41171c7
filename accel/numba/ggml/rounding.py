"""Scalar float rounding of reference/ggml_cpu/rounding.py inside numba kernels."""
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

MIDPOINT_BITS = np.uint64(1 << 63)
SHIFT = np.uint64(35)


@intrinsic
def f64_bits(typingctx, x):  # float64 -> its uint64 bit pattern (a register move, no array)
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@numba.njit(cache=True, inline="always")
def fma32(a, b, c):  # f32 scalars -> f32 a*b + c rounded once, as reference fma32 (float64, midpoint nudge)
    p = np.float64(a) * np.float64(b)  # exact: 24 x 24 bits
    s = p + np.float64(c)
    if f64_bits(s) << SHIFT == MIDPOINT_BITS:  # on a float32 midpoint: round towards the exact sum first
        v = s - p
        err = (p - (s - v)) + (np.float64(c) - v)
        if err > 0:
            s = np.nextafter(s, np.inf)
        elif err < 0:
            s = np.nextafter(s, -np.inf)
    return np.float32(s)


@numba.njit(cache=True, inline="always")
def hsum8(v):  # f32 [8] -> f32: hsum_float_8, (0+4, 1+5, 2+6, 3+7) then (0+2) + (1+3)
    t0, t1, t2, t3 = v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]
    return (t0 + t2) + (t1 + t3)
