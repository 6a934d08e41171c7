"""reference/ggml_cpu/libm.py's glibc calls inside numba kernels: compiled code calls the same
glibc functions, so a whole array costs one Python call, not one per element."""
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from reference.ggml_cpu.target import AVX512

from .threads import threaded

GLIBC = ("expf", "cosf", "sinf", "tanhf", "erff")


def glibc_call(name):  # "expf" -> intrinsic f32 -> f32: a call of glibc's function by its symbol
    """The symbol is resolved when the compiled code is loaded, so the kernels that call it can be
    cached (a ctypes pointer is an address of one process). The function is nobuiltin: LLVM neither
    folds it nor swaps it for a vector library's variant, so every value is glibc's own, as
    reference libm's ctypes call gives it (both resolve the symbol's default version)."""
    def call(typingctx, x):
        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32]), name)
            fn.attributes.add("nobuiltin")
            return builder.call(fn, args)
        if x == types.float32:
            return types.float32(x), codegen
    call.__name__ = call.__qualname__ = f"glibc_{name}"  # numba tells intrinsics apart by name
    return intrinsic(call)


GLIBC_CALLS = {name: glibc_call(name) for name in GLIBC}
EXPF = GLIBC_CALLS["expf"]


def lane(which, x, scalef):  # which a literal: a GLIBC name, "v_expf" or "v_silu"; f32, bool -> f32
    raise TypeError("lane is compiled by numba, for a literal function name")


def lane_kernel(which, scalef=False):  # -> Threaded (work, x f32 [n]) -> f32 [n] of lane(which, ., scalef)
    def apply(x):  # the lane functions are pure: the elements may go to any thread
        out = np.empty_like(x)
        for i in numba.prange(x.size):
            out[i] = lane(which, x[i], scalef)
        return out
    return threaded(apply)


KERNELS = {name: lane_kernel(name) for name in GLIBC}


def libm(name, x):  # as reference libm: "expf" | "cosf" | "sinf" | "tanhf" | "erff", [...] f32 -> [...] f32
    x = np.ascontiguousarray(x, np.float32)
    return KERNELS[name](x.size, x.ravel()).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# ggml's vectorised exp and silu (reference libm.py), one lane at a time

from reference.ggml_cpu.libm import (C1, C2, C3, C4, C5, C_LN2_HI, C_LN2_LO, C_LOG2E, EXP_R,  # noqa: E402
                                     ONE_BITS, SCALE_BITS, SCALE_SIGN)

from .rounding import bits_f32, f32_bits, fma32, pow2_f64  # noqa: E402

ONE, INF = np.float32(1), np.float32(np.inf)
LOW32 = np.uint64(0xFFFFFFFF)


@numba.njit(cache=True, inline="always")
def v_expf_lane(x, scalef):  # f32, bool -> f32: one lane of reference v_expf
    z = fma32(x, C_LOG2E, EXP_R)
    n = z - EXP_R
    b = fma32(-n, C_LN2_LO, fma32(-n, C_LN2_HI, x))
    u = b * b
    poly = fma32(fma32(C5, b, C4), u, fma32(C3, b, C2))
    if scalef:  # the __m512 variant
        j = fma32(poly, u, fma32(C1, b, ONE))
        scaled = abs(n) <= 192  # not for a NaN either, as the reference's ~(|n| <= 192)
        # vscalefps: exact in float64, rounded once; selects, not branches, so that a loop of lanes vectorises
        res = np.float32(np.float64(j) * pow2_f64(n if scaled else np.float32(0)))
        return res if scaled else (np.float32(0) if n <= 0 else INF)
    if x != x:  # the reference's rule for a NaN
        return x
    j = fma32(poly, u, C1 * b)  # the __m256 / float32x4_t variant: 2^n in the exponent bits, fma(j, k, k)
    e = (np.uint64(f32_bits(z)) << np.uint64(23)) & LOW32
    if abs(n) > 126:  # 2^n is not a normal float32: scale in two factors, or saturate past 192
        g = np.uint64(SCALE_SIGN) if n <= 0 else np.uint64(0)
        s1 = bits_f32(np.uint32((g + np.uint64(SCALE_BITS)) & LOW32))
        if abs(n) > 192:
            return s1 * s1
        s2 = bits_f32(np.uint32((e - g) & LOW32))
        return fma32(s2, j, s2) * s1
    k = bits_f32(np.uint32((e + np.uint64(ONE_BITS)) & LOW32))
    return fma32(k, j, k)


@numba.njit(cache=True, inline="always")
def v_silu_lane(x, scalef):  # f32, bool -> f32: x / (1 + v_expf(0 - x))
    return x / (ONE + v_expf_lane(np.float32(0) - x, scalef))


@overload(lane, inline="always")
def lane_overload(which, x, scalef):
    if isinstance(which, types.StringLiteral) and which.literal_value in ("v_expf", "v_silu"):
        lane_fn = v_expf_lane if which.literal_value == "v_expf" else v_silu_lane
        return lambda which, x, scalef: lane_fn(x, scalef)
    if isinstance(which, types.StringLiteral) and which.literal_value in GLIBC_CALLS:
        call = GLIBC_CALLS[which.literal_value]
        return lambda which, x, scalef: call(x)


V_EXPF = {scalef: lane_kernel("v_expf", scalef) for scalef in (True, False)}  # (work, f32 [n]) -> [n]
V_SILU = {scalef: lane_kernel("v_silu", scalef) for scalef in (True, False)}


@threaded
def silu_rows_2d(x, lanes, scalef):  # f32 [R, n] -> [R, n]: v_silu on whole registers, glibc x/(1+expf(-x)) on the tail
    R, n = x.shape
    whole = n - n % lanes
    out = np.empty_like(x)
    for r in numba.prange(R):
        for i in range(whole):
            out[r, i] = v_silu_lane(x[r, i], scalef)
        for i in range(whole, n):
            out[r, i] = x[r, i] / (ONE + EXPF(-x[r, i]))
    return out


def v_expf(x, scalef=True):  # [...] f32 -> [...] f32: reference v_expf
    x = np.ascontiguousarray(x, np.float32)
    return V_EXPF[bool(scalef)](x.size, x.ravel()).reshape(x.shape)


def v_silu(x, scalef=True):  # [...] f32 -> [...] f32: reference v_silu
    x = np.ascontiguousarray(x, np.float32)
    return V_SILU[bool(scalef)](x.size, x.ravel()).reshape(x.shape)


def silu_rows(x, target=AVX512):  # [..., n] f32 -> [..., n]: reference silu_rows
    x = np.ascontiguousarray(x, np.float32)
    return silu_rows_2d(x.size, x.reshape(-1, x.shape[-1]), target.lanes, target.scalef).reshape(x.shape)
