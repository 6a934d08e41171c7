"""The float dot products of reference/ggml_cpu/float_dots.py as numba kernels: tinyBLAS (batches
of 2+ rows) and ggml_vec_dot_f32/f16/bf16 (one row), each lane's FMA chain and each reduction tree
as the NumPy statement has it; plus float_mul_mat, reference mul_mat.py's choice between the two."""
import numba
import numpy as np

from .rounding import fma32, hsum16
from .threads import threaded

F32, F64 = np.float32, np.float64
F32_DOT, F16_DOT, BF16_DOT = 0, 1, 2  # which ggml_vec_dot_* a kernel runs


@numba.njit(cache=True, inline="always")
def four_by_sixteen(x, y, n64, acc):  # x, y f32 [>= n64], scratch acc f32 [4, 16] -> f32: reference four_by_sixteen
    acc[:] = 0
    for s in range(0, n64, 64):
        for j in range(4):
            for lane in range(16):
                acc[j, lane] = fma32(x[s + 16 * j + lane], y[s + 16 * j + lane], acc[j, lane])
    for lane in range(16):
        acc[0, lane] = (acc[0, lane] + acc[2, lane]) + (acc[1, lane] + acc[3, lane])
    return hsum16(acc[0])


@numba.njit(cache=True, inline="always")
def dot_f32(x, y, acc):  # f32 [n] x2, scratch [4, 16] -> f32: reference vec_dot_f32 of one pair
    n = x.size
    n64 = n - n % 64
    total = four_by_sixteen(x, y, n64, acc)
    rest = n - n64
    plain = rest - rest % 16 + (8 if rest % 16 >= 8 else 0)
    for i in range(n64, n64 + plain):
        total = total + x[i] * y[i]
    for i in range(n64 + plain, n):
        total = fma32(x[i], y[i], total)
    return total


@numba.njit(cache=True, inline="always")
def dot_f16(x, y, acc):  # f32 [n] x2 (f16 values), scratch [4, 16] -> f32: reference vec_dot_f16 of one pair
    n = x.size
    n64 = n - n % 64
    total = F64(four_by_sixteen(x, y, n64, acc))
    for i in range(n64, n):
        total += F64(x[i] * y[i])
    return F32(total)


@numba.njit(cache=True, inline="always")
def dot_bf16(x, y, acc):  # f32 [n] x2 (bf16 values), scratch [4, 16] -> f32: reference vec_dot_bf16 of one pair
    n = x.size
    n64 = n - n % 64
    acc[:] = 0
    for s in range(0, n64, 64):
        for j in range(2):
            for lane in range(16):
                e = s + 32 * j + 2 * lane  # dpbf16: the odd element first
                acc[j, lane] = acc[j, lane] + x[e + 1] * y[e + 1]
                acc[j, lane] = acc[j, lane] + x[e] * y[e]
    total = F64(hsum16(acc[0])) + F64(hsum16(acc[1]))
    for i in range(n64, n):
        total += F64(x[i] * y[i])
    return F32(total)


@numba.njit(cache=True, inline="always")
def dot_of(kind, x, y, acc):  # F32_DOT | F16_DOT | BF16_DOT, f32 [n] x2, scratch [4, 16] -> f32
    if kind == F16_DOT:
        return dot_f16(x, y, acc)
    if kind == BF16_DOT:
        return dot_bf16(x, y, acc)
    return dot_f32(x, y, acc)


@threaded()
def dot_rows(kind, x, y):  # f32 [R, n] x2 -> [R]: the vec_dot of each row pair
    out = np.empty(x.shape[0], F32)
    for r in numba.prange(x.shape[0]):
        out[r] = dot_of(kind, x[r], y[r], np.empty((4, 16), F32))
    return out


@threaded()
def dot_pairs(kind, a, b):  # f32 [M, n], [N, n] -> [M, N]: the vec_dot of every row of a with every row of b
    out = np.empty((a.shape[0], b.shape[0]), F32)
    for i in numba.prange(a.shape[0]):
        acc = np.empty((4, 16), F32)
        for j in range(b.shape[0]):
            out[i, j] = dot_of(kind, a[i], b[j], acc)
    return out


def broadcast_dot(kind, x, y):  # x, y [..., n] (broadcast) -> [...]
    x, y = np.asarray(x, F32), np.asarray(y, F32)
    if x.ndim == y.ndim == 3 and x.shape[1] == 1 and y.shape[0] == 1:  # every row of x with every row of y
        return dot_pairs(x.size * len(y[0]), kind, np.ascontiguousarray(x[:, 0]), np.ascontiguousarray(y[0]))
    x, y = np.broadcast_arrays(x, y)
    shape = x.shape[:-1]
    rows = (np.ascontiguousarray(a).reshape(-1, a.shape[-1]) for a in (x, y))
    return dot_rows(x.size, kind, *rows).reshape(shape)


def vec_dot_f32(x, y):  # x [..., n], y [..., n] f32 -> [...]: reference vec_dot_f32
    return broadcast_dot(F32_DOT, x, y)


def vec_dot_f16(x, y):  # x [..., n], y [..., n] f32 (f16 values) -> [...]: reference vec_dot_f16
    return broadcast_dot(F16_DOT, x, y)


def vec_dot_bf16(x, y):  # x [..., n], y [..., n] f32 (bf16 values) -> [...]: reference vec_dot_bf16
    return broadcast_dot(BF16_DOT, x, y)


@threaded()
def tinyblas_kernel(x, w_t, bf16):  # x [T, K], w_t [K, O] f32 (the weight transposed) -> [T, O]
    """Lane l of each output: FMAs over k = l (mod 16) in k order (F32/F16), or the bf16 pairs
    (32s + 2l + 1, then 32s + 2l) of every 32-element step as vdpbf16ps adds them. Each lane's
    chain runs for all outputs at once (acc [16, O]), so the loop over outputs vectorises."""
    T, K = x.shape
    O = w_t.shape[1]
    out = np.empty((T, O), F32)
    for t in numba.prange(T):
        acc = np.zeros((16, O), F32)
        for s in range(0, K, 32 if bf16 else 16):
            for lane in range(16):
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
        for o in range(O):
            out[t, o] = hsum16(acc[:, o])
    return out


def tinyblas(x, w):  # x [T, K], w [O, K] f32 (values of the weight's type) -> [T, O]: reference tinyblas
    w_t = np.ascontiguousarray(np.asarray(w, F32).T)
    return tinyblas_kernel(len(x) * w_t.size, np.ascontiguousarray(x, F32), w_t, False)


def tinyblas_bf16(x, w):  # x [T, K], w [O, K] f32 (bf16 values) -> [T, O]: reference tinyblas_bf16
    w_t = np.ascontiguousarray(np.asarray(w, F32).T)
    return tinyblas_kernel(len(x) * w_t.size, np.ascontiguousarray(x, F32), w_t, True)


FLOAT_KERNELS = {  # type -> ((tinyBLAS kernel, its K step), vec_dot kind), as reference FLOAT_KERNELS
    "F32": ((tinyblas, 16), F32_DOT),
    "F16": ((tinyblas, 16), F16_DOT),
    "BF16": ((tinyblas_bf16, 32), BF16_DOT),
}


def float_mul_mat(x, w, kind):  # x [T, K] (already in the weight's type), w [O, K] f32 -> [T, O] (reference mul_mat.py)
    (batched, k_step), single = FLOAT_KERNELS[kind]
    if len(x) >= 2 and len(w) % 4 == 0 and w.shape[1] % k_step == 0:
        return batched(x, w)
    return dot_pairs(len(x) * np.size(w), single, np.ascontiguousarray(x, F32), np.ascontiguousarray(w, F32))
