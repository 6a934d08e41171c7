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


@numba.njit(cache=True, inline="always")
def hsum16(v):  # f32 [16] -> f32: _mm512_reduce_add_ps, halves folded 8, 4, then pairs (reference hsum16)
    a0, a1, a2, a3 = v[8] + v[0], v[9] + v[1], v[10] + v[2], v[11] + v[3]
    a4, a5, a6, a7 = v[12] + v[4], v[13] + v[5], v[14] + v[6], v[15] + v[7]
    b0, b1, b2, b3 = a4 + a0, a5 + a1, a6 + a2, a7 + a3
    return (b0 + b2) + (b1 + b3)


@intrinsic
def f32_bits(typingctx, x):  # float32 -> its uint32 bit pattern
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):  # uint32 bit pattern -> the float32
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


F16_MAX_BITS = np.uint32(0x477FE000)  # 65504, the largest half
F16_MIN_NORMAL = np.float32(2.0 ** -14)
HALF = np.float32(0.5)
SIGN_BIT = np.uint32(0x80000000)


@numba.njit(cache=True, inline="always")
def round_f16(x):  # f32 -> f32 holding the nearest-even IEEE half, as reference round_f16 (numba has no float16)
    """Normal halves: the 13 low mantissa bits rounded off to nearest even (a carry may reach the
    exponent; past 65504 it is infinity). Subnormal halves are multiples of 2^-24, the float32 ulp
    in [0.5, 1): adding 0.5 rounds to that grid with ties to even, and subtracting it is exact."""
    if x != x:
        return x
    sign = f32_bits(x) & SIGN_BIT
    ax = abs(x)
    if ax < F16_MIN_NORMAL:
        u = f32_bits((ax + HALF) - HALF)
    else:
        u = f32_bits(ax)
        u = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        u = f32_bits(np.float32(np.inf)) if u > F16_MAX_BITS else u
    return bits_f32(u | sign)


@numba.njit(cache=True, inline="always")
def sqrt32(x):  # f32 -> f32 correctly rounded sqrtf (a float64 sqrt rounded to float32 rounds once in effect)
    return np.float32(np.sqrt(np.float64(x)))


@intrinsic
def bits_f64(typingctx, u):  # uint64 bit pattern -> the float64
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.uint64), codegen


ONE_STEP, NO_STEP, BACK_STEP = np.uint64(1), np.uint64(0), np.uint64(0xFFFFFFFFFFFFFFFF)  # +1, 0, -1 mod 2^64


@numba.njit(cache=True, inline="always")
def fma32_lanes(a, b, c):  # f32 scalars -> f32: fma32's result without a branch, so LLVM vectorises its loops
    """The TwoSum error and the midpoint nudge always computed, the nudge (one float64 step away
    from zero when the exact sum is larger in magnitude, towards it when smaller) selected in."""
    p = np.float64(a) * np.float64(b)
    c64 = np.float64(c)
    s = p + c64
    v = s - p
    err = (p - (s - v)) + (c64 - v)
    u = f64_bits(s)
    step = ONE_STEP if (err > 0) == (s > 0) else BACK_STEP
    return np.float32(bits_f64(u + (step if u << SHIFT == MIDPOINT_BITS and err != 0 else NO_STEP)))
