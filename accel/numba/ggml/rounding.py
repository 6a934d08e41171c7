"""Scalar float rounding of reference/ggml_cpu/rounding.py inside numba kernels."""
import numba
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
