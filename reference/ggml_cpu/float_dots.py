"""Float dot products: llamafile tinyBLAS (batches of 2+ rows) and ggml_vec_dot_* (one row)."""
import numpy as np

from .rounding import F32, F64, fma32, hsum16


def tinyblas(x, w):  # x [T, K], w [O, K] f32 (values of the weight's type) -> [T, O]
    """tinyBLAS<16, __m512>: lane l of each output accumulates k = l (mod 16) with FMA, in k order."""
    T, K = x.shape
    xs, ws = x.reshape(T, 1, K // 16, 16), w.reshape(1, len(w), K // 16, 16)
    acc = np.zeros((T, len(w), 16), F32)
    for s in range(K // 16):
        acc = fma32(xs[:, :, s], ws[:, :, s], acc)
    return hsum16(acc)


def tinyblas_bf16(x, w):  # x [T, K], w [O, K] f32 (bf16 values) -> [T, O]
    """tinyBLAS<32, __m512bh>: vdpbf16ps, lane l takes the pair (2l, 2l+1) of every 32-element step."""
    T, K = x.shape
    xs, ws = x.reshape(T, 1, K // 32, 16, 2), w.reshape(1, len(w), K // 32, 16, 2)
    acc = np.zeros((T, len(w), 16), F32)
    for s in range(K // 32):
        acc = dpbf16(acc, xs[:, :, s], ws[:, :, s])
    return hsum16(acc)


def dpbf16(acc, a, b):  # acc [..., 16], a/b [..., 16, 2] bf16 values -> acc + a.b per lane
    # bf16 products are exact in f32, so each add is one rounding: the odd element first (SDM order)
    acc = acc + a[..., 1] * b[..., 1]
    return acc + a[..., 0] * b[..., 0]


def four_by_sixteen(x, y):  # x, y [..., n] f32, n a multiple of 64 -> [...] f32
    """The SIMD body of ggml_vec_dot_f32/f16: 4 accumulators of 16 FMA lanes over 64-element steps,
    folded (0+2) + (1+3), then _mm512_reduce_add_ps."""
    acc = np.zeros(x.shape[:-1] + (4, 16), F32)
    xs, ys = x.reshape(acc.shape[:-2] + (-1, 4, 16)), y.reshape(acc.shape[:-2] + (-1, 4, 16))
    for s in range(xs.shape[-3]):
        acc = fma32(xs[..., s, :, :], ys[..., s, :, :], acc)
    return hsum16((acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :]))


def vec_dot_f32(x, y):  # x [..., n], y [..., n] f32 -> [...]: ggml_vec_dot_f32 (AVX512 build)
    """Whole 64-element steps through the SIMD body; GCC vectorises the leftover loop as products
    added one by one in order (16 or 8 at a time) and fuses the last < 8 into FMAs."""
    x, y = np.broadcast_arrays(x, y)
    n = x.shape[-1]
    n64 = n - n % 64
    total = four_by_sixteen(x[..., :n64], y[..., :n64])
    rest = n - n64
    plain = rest - rest % 16 + (8 if rest % 16 >= 8 else 0)
    products = x[..., n64:n64 + plain] * y[..., n64:n64 + plain]
    for i in range(plain):
        total = total + products[..., i]
    for i in range(n64 + plain, n):
        total = fma32(x[..., i], y[..., i], total)
    return total


def vec_dot_f16(x, y):  # x [..., n], y [..., n] f32 (f16 values) -> [...]: ggml_vec_dot_f16
    """Whole 64-element steps through the SIMD body; the leftover products (exact in f32) are added
    to a double sum that is rounded to float at the end."""
    x, y = np.broadcast_arrays(x, y)
    n = x.shape[-1]
    n64 = n - n % 64
    total = four_by_sixteen(x[..., :n64], y[..., :n64]).astype(F64)
    products = (x[..., n64:] * y[..., n64:]).astype(F64)
    for i in range(n - n64):
        total = total + products[..., i]
    return total.astype(F32)


def vec_dot_bf16(x, y):  # x [..., n], y [..., n] f32 (bf16 values) -> [...]: ggml_vec_dot_bf16 (AVX512BF16)
    x, y = np.broadcast_arrays(x, y)
    n = x.shape[-1]
    n64 = n - n % 64
    c = np.zeros(x.shape[:-1] + (2, 16), F32)
    xs, ys = x[..., :n64].reshape(c.shape[:-2] + (-1, 2, 16, 2)), y[..., :n64].reshape(c.shape[:-2] + (-1, 2, 16, 2))
    for s in range(n64 // 64):
        c = dpbf16(c, xs[..., s, :, :, :], ys[..., s, :, :, :])
    total = hsum16(c[..., 0, :]).astype(F64) + hsum16(c[..., 1, :]).astype(F64)
    products = (x[..., n64:] * y[..., n64:]).astype(F64)
    for i in range(n - n64):
        total = total + products[..., i]
    return total.astype(F32)
