"""The float dot products of reference/ggml_cpu/float_dots.py as numba kernels: tinyBLAS (batches
of 2+ rows) and ggml_vec_dot_f32/f16/bf16 (one row), each lane's FMA chain and each reduction tree
as the NumPy statement has it; plus float_mul_mat, reference mul_mat.py's choice between the two."""
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from reference.ggml_cpu.target import AVX512

from ..operands import operands
from .int_dots import vector_fma
from .quantize import x86_only
from .rounding import fma32, hsum8, hsum16, register_sum, vec_reduce
from .threads import threaded

F32, F64 = np.float32, np.float64
F32_DOT, F16_DOT, BF16_DOT = 0, 1, 2  # which ggml_vec_dot_* a kernel runs


def lane_fmas_intrinsic(lanes):  # -> the intrinsic (x, y, whole, acc) of one register width
    """acc[j, :lanes] <- the FMA chains of vec_body's four registers: acc[j, l] = fma(x[s + lanes j + l],
    y[s + lanes j + l], acc[j, l]) for s = 0, 4 lanes, .. < whole, each chain in registers (llvm.fma:
    one rounding, as vfmadd231ps). numba's own loop kept the 64 sums in memory, a store and a load
    per FMA, 5x slower on the attention's decode products. A C-contiguous x or y is read a register
    at a time; any other (a cache row numba cannot prove contiguous) element by element at its stride."""
    vec = ir.VectorType(ir.FloatType(), lanes)

    def lane_fmas(typingctx, x, y, whole, acc):
        def codegen(context, builder, signature, args):
            a = operands(lane_fmas, context, builder, signature, args)
            accp = a.acc.data()
            whole_ = a.whole.index()
            intp = whole_.type

            def register_of(v):  # x or y -> (index of element) -> <lanes x float> of it from that element on
                data = v.data()
                if v.ty.layout == "C":
                    return lambda e: builder.load(builder.bitcast(builder.gep(data, [builder.mul(e, ir.Constant(intp, 4))]),
                                                                  vec.as_pointer()), align=4)
                stride = v.stride(0)

                def strided(e):
                    out = ir.Constant(vec, None)
                    for lane in range(lanes):
                        at = builder.gep(data, [builder.mul(builder.add(e, ir.Constant(intp, lane)), stride)])
                        out = builder.insert_element(out, builder.load(builder.bitcast(at, ir.FloatType().as_pointer())),
                                                     ir.Constant(ir.IntType(32), lane))
                    return out
                return strided

            x_at, y_at = register_of(a.x), register_of(a.y)
            sums = [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(4)]
            steps = builder.udiv(whole_, ir.Constant(intp, 4 * lanes))
            with cgutils.for_range(builder, steps) as loop:
                first = builder.mul(loop.index, ir.Constant(intp, 4 * lanes))
                for j, total in enumerate(sums):
                    e = builder.add(first, ir.Constant(intp, lanes * j))
                    builder.store(vector_fma(builder, x_at(e), y_at(e), builder.load(total)), total)
            for j, total in enumerate(sums):  # acc is [4, 16]: row j at 64 bytes
                builder.store(builder.load(total), builder.bitcast(builder.gep(accp, [ir.Constant(ir.IntType(64), 64 * j)]),
                                                                   vec.as_pointer()), align=4)
            return context.get_dummy_value()
        if (all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (x, y, acc)) and acc.layout == "C"
                and x.ndim == y.ndim == 1 and acc.ndim == 2 and isinstance(whole, types.Integer)):
            return types.none(x, y, whole, acc), codegen
    lane_fmas.__name__ = lane_fmas.__qualname__ = f"lane_fmas_{lanes}"  # numba tells intrinsics apart by name
    return intrinsic(lane_fmas)


lane_fmas_8, lane_fmas_16 = lane_fmas_intrinsic(8), lane_fmas_intrinsic(16)


@numba.njit(cache=True, inline="always")
def vec_body(x, y, whole, acc, lanes):  # x, y f32 [>= whole], scratch acc f32 [4, 16] -> f32: reference vec_body
    if lanes == 16:  # the x86 targets' GGML_F32_EPR: AVX512, or AVX/AVX2 (vec_lanes refuses the others)
        lane_fmas_16(x, y, whole, acc)
    else:
        lane_fmas_8(x, y, whole, acc)
    return vec_reduce(acc, lanes)


@numba.njit(cache=True, inline="always")
def dot_f32(x, y, acc, lanes):  # f32 [n] x2, scratch [4, 16], the target's lanes -> f32: reference vec_dot_f32
    n = x.size
    whole = n - n % (4 * lanes)
    total = vec_body(x, y, whole, acc, lanes)
    rest = n - whole
    plain = rest - rest % (lanes // 2)
    for i in range(whole, whole + plain):
        total = total + x[i] * y[i]
    for i in range(whole + plain, n):
        total = fma32(x[i], y[i], total)
    return total


@numba.njit(cache=True, inline="always")
def dot_f16(x, y, acc, lanes):  # f32 [n] x2 (f16 values), scratch [4, 16] -> f32: reference vec_dot_f16
    n = x.size
    whole = n - n % (4 * lanes)
    total = F64(vec_body(x, y, whole, acc, lanes))
    for i in range(whole, n):
        total += F64(x[i] * y[i])
    return F32(total)


@numba.njit(cache=True, inline="always")
def dot_bf16(x, y, acc, dpbf16):  # f32 [n] x2 (bf16 values), scratch [4, 16] -> f32: reference vec_dot_bf16
    n = x.size
    step = 64 if dpbf16 else 32
    whole = n - n % step
    acc[:] = 0
    for s in range(0, whole, step):
        if dpbf16:
            for j in range(2):
                for lane in range(16):
                    e = s + 32 * j + 2 * lane  # dpbf16: the odd element first
                    acc[j, lane] = acc[j, lane] + x[e + 1] * y[e + 1]
                    acc[j, lane] = acc[j, lane] + x[e] * y[e]
        else:
            for j in range(4):
                for lane in range(8):
                    acc[j, lane] = acc[j, lane] + x[s + 8 * j + lane] * y[s + 8 * j + lane]
    if dpbf16:
        total = F64(hsum16(acc[0])) + F64(hsum16(acc[1]))
    else:
        for lane in range(8):
            acc[0, lane] = (acc[0, lane] + acc[2, lane]) + (acc[1, lane] + acc[3, lane])
        total = F64(hsum8(acc[0, :8]))
    for i in range(whole, n):
        total += F64(x[i] * y[i])
    return F32(total)


@numba.njit(cache=True, inline="always")
def dot_of(kind, x, y, acc, lanes, dpbf16):  # F32_DOT | F16_DOT | BF16_DOT, f32 [n] x2, scratch [4, 16] -> f32
    if kind == F16_DOT:
        return dot_f16(x, y, acc, lanes)
    if kind == BF16_DOT:
        return dot_bf16(x, y, acc, dpbf16)
    return dot_f32(x, y, acc, lanes)


@threaded
def dot_rows(kind, x, y, lanes, dpbf16):  # f32 [R, n] x2 -> [R]: the vec_dot of each row pair
    out = np.empty(x.shape[0], F32)
    for r in numba.prange(x.shape[0]):
        out[r] = dot_of(kind, x[r], y[r], np.empty((4, 16), F32), lanes, dpbf16)
    return out


@threaded
def dot_pairs(kind, a, b, lanes, dpbf16):  # f32 [M, n], [N, n] -> [M, N]: the vec_dot of every row of a with every row of b
    out = np.empty((a.shape[0], b.shape[0]), F32)
    for i in numba.prange(a.shape[0]):
        acc = np.empty((4, 16), F32)
        for j in range(b.shape[0]):
            out[i, j] = dot_of(kind, a[i], b[j], acc, lanes, dpbf16)
    return out


def vec_lanes(target):  # -> the target's float32 lanes, which vec_body takes as 16 or 8 (x86's); GgmlCpuError elsewhere
    x86_only(target)
    return target.lanes


def broadcast_dot(kind, x, y, target):  # x, y [..., n] (broadcast) -> [...]
    x, y = np.asarray(x, F32), np.asarray(y, F32)
    if x.ndim == y.ndim == 3 and x.shape[1] == 1 and y.shape[0] == 1:  # every row of x with every row of y
        return dot_pairs(x.size * len(y[0]), kind, np.ascontiguousarray(x[:, 0]), np.ascontiguousarray(y[0]),
                         vec_lanes(target), target.dpbf16)
    x, y = np.broadcast_arrays(x, y)
    shape = x.shape[:-1]
    rows = (np.ascontiguousarray(a).reshape(-1, a.shape[-1]) for a in (x, y))
    return dot_rows(x.size, kind, *rows, vec_lanes(target), target.dpbf16).reshape(shape)


def vec_dot_f32(x, y, target=AVX512):  # x [..., n], y [..., n] f32 -> [...]: reference vec_dot_f32
    return broadcast_dot(F32_DOT, x, y, target)


def vec_dot_f16(x, y, target=AVX512):  # x [..., n], y [..., n] f32 (f16 values) -> [...]: reference vec_dot_f16
    return broadcast_dot(F16_DOT, x, y, target)


def vec_dot_bf16(x, y, target=AVX512):  # x [..., n], y [..., n] f32 (bf16 values) -> [...]: reference vec_dot_bf16
    return broadcast_dot(BF16_DOT, x, y, target)


@threaded
def tinyblas_kernel(x, w_t, bf16, lanes):  # x [T, K], w_t [K, O] f32 (the weight transposed) -> [T, O]
    """Lane l of each output: FMAs over k = l (mod lanes) in k order (F32/F16, BF16 without
    vdpbf16ps), or the bf16 pairs (32s + 2l + 1, then 32s + 2l) of every 32-element step as vdpbf16ps
    adds them (16 lanes). Each lane's chain runs for all outputs at once (acc [lanes, O]), so the
    loop over outputs vectorises."""
    T, K = x.shape
    O = w_t.shape[1]
    out = np.empty((T, O), F32)
    for t in numba.prange(T):
        acc = np.zeros((lanes, O), F32)
        for s in range(0, K, 2 * lanes if bf16 else lanes):
            for lane in range(lanes):
                a = acc[lane]
                if bf16:
                    e = s + 2 * lane
                    odd, even, w_odd, w_even = x[t, e + 1], x[t, e], w_t[e + 1], w_t[e]
                    for o in range(O):
                        a[o] = (a[o] + odd * w_odd[o]) + even * w_even[o]
                else:
                    xv, w_row = x[t, s + lane], w_t[s + lane]
                    for o in range(O):
                        a[o] = fma32(xv, w_row[o], a[o])
        lane_sums = np.empty(lanes, F32)
        for o in range(O):
            for lane in range(lanes):
                lane_sums[lane] = acc[lane, o]
            out[t, o] = register_sum(lane_sums)
    return out


def tinyblas(x, w, target=AVX512):  # x [T, K], w [O, K] f32 (values of the weight's type) -> [T, O]: reference tinyblas
    w_t = np.ascontiguousarray(np.asarray(w, F32).T)
    return tinyblas_kernel(len(x) * w_t.size, np.ascontiguousarray(x, F32), w_t, False, target.lanes)


def tinyblas_bf16(x, w):  # x [T, K], w [O, K] f32 (bf16 values) -> [T, O]: reference tinyblas_bf16
    w_t = np.ascontiguousarray(np.asarray(w, F32).T)
    return tinyblas_kernel(len(x) * w_t.size, np.ascontiguousarray(x, F32), w_t, True, 16)


DOT_KINDS = {"F32": F32_DOT, "F16": F16_DOT, "BF16": BF16_DOT}


def float_mul_mat(x, w, kind, target=AVX512, batch_rows=None):  # x [T, K] (in the weight's type), w [O, K] f32 -> [T, O] (reference mul_mat.py)
    dpbf16 = kind == "BF16" and target.dpbf16
    if (batch_rows or len(x)) >= 2 and len(w) % 4 == 0 and w.shape[1] % (target.lanes * (2 if dpbf16 else 1)) == 0:
        return tinyblas_bf16(x, w) if dpbf16 else tinyblas(x, w, target)
    return dot_pairs(len(x) * np.size(w), DOT_KINDS[kind], np.ascontiguousarray(x, F32), np.ascontiguousarray(w, F32),
                     vec_lanes(target), target.dpbf16)
