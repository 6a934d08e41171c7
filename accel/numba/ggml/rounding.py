"""Scalar float rounding of reference/ggml_cpu/rounding.py inside numba kernels."""
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def fma32(typingctx, a, b, c):  # f32 scalars -> f32 a*b + c rounded once: llvm.fma, the vfmadd231ss of ggml
    """The reference (reference/ggml_cpu/rounding.py fma32) emulates this single rounding in float64;
    here it is the hardware's own fused multiply-add, one instruction, bit for bit the same."""
    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)])
    return types.float32(a, b, c), codegen


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


@numba.njit(cache=True, inline="always")
def hsum4(v):  # f32 [>= 4] -> f32: vaddvq_f32 and two haddps, (0+1) + (2+3) (reference hsum4)
    return (v[0] + v[1]) + (v[2] + v[3])


@numba.njit(cache=True, inline="always")
def register_sum(v):  # f32 [lanes] -> f32: reference register_sum, by the register's width 16, 8 or 4
    if v.size == 16:
        return hsum16(v)
    if v.size == 8:
        return hsum8(v)
    return hsum4(v)


@numba.njit(cache=True, inline="always")
def vec_reduce(acc, lanes):  # scratch f32 [4, >= lanes] -> f32: reference vec_reduce of acc[:, :lanes]
    for lane in range(lanes):
        acc[0, lane] = (acc[0, lane] + acc[2, lane]) + (acc[1, lane] + acc[3, lane])
    if lanes == 8:  # AVX: low plus high half, then two haddps
        for lane in range(4):
            acc[1, lane] = acc[0, lane] + acc[0, lane + 4]
        return hsum4(acc[1])
    return register_sum(acc[0, :lanes])


def bitcast_intrinsic(name, source, result, llvm_result):  # -> intrinsic: a `source` scalar -> its bits as `result`
    def cast(typingctx, x):
        def codegen(context, builder, signature, args):
            (value,) = args
            return builder.bitcast(value, llvm_result)
        return result(source), codegen
    cast.__name__ = cast.__qualname__ = name  # numba tells intrinsics apart by name
    return intrinsic(cast)


f32_bits = bitcast_intrinsic("f32_bits", types.float32, types.uint32, ir.IntType(32))  # float32 -> its bit pattern
bits_f32 = bitcast_intrinsic("bits_f32", types.uint32, types.float32, ir.FloatType())  # bit pattern -> the float32
bits_f64 = bitcast_intrinsic("bits_f64", types.uint64, types.float64, ir.DoubleType())  # bit pattern -> the float64


@numba.njit(cache=True, inline="always")
def pow2_f64(n):  # f32 holding an integer in [-1022, 1023] -> 2^n in float64, built in its exponent bits (exact)
    return bits_f64(np.uint64(np.int64(n) + 1023) << np.uint64(52))


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
