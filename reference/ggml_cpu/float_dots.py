"""Float dot products: llamafile tinyBLAS (batches of 2+ rows) and ggml_vec_dot_* (one row), with the
register width and reduction tree of the CPU target (target.py)."""
import numpy as np

from .rounding import F32, F64, fma32, hsum4, hsum16, madd, register_sum, vec_reduce
from .target import AVX512


def tinyblas(x, w, target=AVX512, f16=False):  # x [T, K], w [O, K] f32 (values of the weight's type) -> [T, O]
    """tinyBLAS<KN = lanes>: lane l of each output accumulates k = l (mod lanes) with FMA, in k order,
    then hsum of the register (llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp:3832-3850, 3910-3917,
    3958-3972; hsum at 251-278). On AVX2 BF16 takes this kernel too (bf16 widened to f32: the products
    are exact, so each FMA is one rounding of the sum, as an add is). f16 on NEON: tinyBLAS<8,
    float16x8_t>, 8 half lanes whose FMAs round to half (vfmaq_f16, sgemm.cpp:170-173), hsum as two
    float32x4 halves added, then vaddvq_f32 (sgemm.cpp:238-243)."""
    T, K = x.shape
    half = f16 and target.neon
    lanes = target.f16_lanes if half else target.lanes
    xs, ws = x.reshape(T, 1, K // lanes, lanes), w.reshape(1, len(w), K // lanes, lanes)
    acc = np.zeros((T, len(w), lanes), F32)
    for s in range(K // lanes):
        acc = fma16(xs[:, :, s], ws[:, :, s], acc) if half else madd(xs[:, :, s], ws[:, :, s], acc, target.fma)
    return hsum4(acc[..., :4] + acc[..., 4:]) if half else register_sum(acc)


def fma16(a, b, c):  # f32 arrays of f16 values (broadcast) -> a*b + c rounded once to half (vfmaq_f16)
    """The product of two halves is exact in float32, the sum with a half exact in float64 whenever
    the two lie within 53 bits; otherwise c alone decides the rounding (c is a half, never a midpoint)."""
    return (np.multiply(a, b, dtype=F64) + c).astype(np.float16).astype(F32)


def add16(a, b):  # f32 arrays of f16 values -> a + b rounded to half (vaddq_f16): exact in float64 first
    return (np.asarray(a, F64) + b).astype(np.float16).astype(F32)


def tinyblas_bf16(x, w):  # x [T, K], w [O, K] f32 (bf16 values) -> [T, O]
    """tinyBLAS<32, __m512bh> (AVX512_BF16): vdpbf16ps, lane l takes the pair (2l, 2l+1) of every
    32-element step."""
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


def vec_body(x, y, target):  # x, y [..., n] f32, n a multiple of the target's step -> [...] f32
    """The SIMD body of ggml_vec_dot_f32/f16: GGML_F32_ARR accumulators (target.accumulators) of
    `lanes` lanes over steps of GGML_F32_STEP, each GGML_F32_VEC_FMA (a multiply and an add without
    FMA, llama.cpp/ggml/src/ggml-cpu/simd-mappings.h:595-599, 914-918), then GGML_F32_VEC_REDUCE."""
    arr, lanes = target.accumulators, target.lanes
    acc = np.zeros(x.shape[:-1] + (arr, lanes), F32)
    xs, ys = x.reshape(acc.shape[:-2] + (-1, arr, lanes)), y.reshape(acc.shape[:-2] + (-1, arr, lanes))
    for s in range(xs.shape[-3]):
        acc = madd(xs[..., s, :, :], ys[..., s, :, :], acc, target.fma)
    return vec_reduce(acc)


def double_sum(x, y, total=0.0):  # x, y [..., n] f32, total [...] -> [...] f64: the f32 products added one by one to a double
    """The scalar loops of ggml_vec_dot_f32 without GGML_SIMD (x64: SSE3 is needed for it,
    llama.cpp/ggml/src/ggml-cpu/vec.cpp:110-115) and of every leftover of vec_dot_f16/bf16."""
    products = (x * y).astype(F64)
    total = np.broadcast_to(np.asarray(total, F64), x.shape[:-1])
    for i in range(x.shape[-1]):
        total = total + products[..., i]
    return total


def half_body(x, y, lanes):  # x, y [..., n] f32 (f16 values), n a multiple of 4*lanes -> [...] f32
    """The NEON FP16 body of ggml_vec_dot_f16: GGML_F16_ARR = 4 accumulators of 8 halves, vfmaq_f16
    over steps of 32, reduced in half (0+2, 1+3, then 0+1), the register's halves widened to float32,
    added, and vaddvq_f32 (llama.cpp/ggml/src/ggml-cpu/simd-mappings.h:378-400)."""
    acc = np.zeros(x.shape[:-1] + (4, lanes), F32)
    xs, ys = x.reshape(acc.shape[:-2] + (-1, 4, lanes)), y.reshape(acc.shape[:-2] + (-1, 4, lanes))
    for s in range(xs.shape[-3]):
        acc = fma16(xs[..., s, :, :], ys[..., s, :, :], acc)
    v = add16(add16(acc[..., 0, :], acc[..., 2, :]), add16(acc[..., 1, :], acc[..., 3, :]))
    return hsum4(v[..., :4] + v[..., 4:])


def vec_dot_f32(x, y, target=AVX512):  # x [..., n], y [..., n] f32 -> [...]: ggml_vec_dot_f32
    """Whole steps of 4*lanes through the SIMD body (llama.cpp/ggml/src/ggml-cpu/vec.cpp:104-126);
    GCC vectorises the leftover loop as products added one by one in order, a register and then half
    a register at a time, and fuses the last (fewer than lanes/2) into FMAs: the AVX512 build's
    16 + 8 then < 8, the AVX2 build's 8 + 4 then < 4 (both read in their disassembly); the NEON
    build 4 at a time, then < 4 fused (vec.cpp compiled with its flags by GCC 12); a build without FMA
    adds every product rounded, and one without GGML_SIMD (x64) sums them in double. clang 14 makes it
    an ordered reduction of two registers of products at a time, the last < 8 by FMA (the
    disassembly of its neon-i8mm build's libggml-cpu.so; llama.cpp/ggml/src/ggml-cpu/vec.cpp:124-126)."""
    x, y = np.broadcast_arrays(x, y)
    if not target.lanes:
        return double_sum(x, y).astype(F32)
    n, step = x.shape[-1], target.accumulators * target.lanes
    whole = n - n % step
    total = vec_body(x[..., :whole], y[..., :whole], target)
    rest = n - whole
    if target.compiler == "clang":
        group = 2 * target.lanes
    else:
        group = target.lanes if target.neon else target.lanes // 2
    plain = rest - rest % group if target.fma else rest
    products = x[..., whole:whole + plain] * y[..., whole:whole + plain]
    for i in range(plain):
        total = total + products[..., i]
    for i in range(whole + plain, n):
        total = fma32(x[..., i], y[..., i], total)
    return total


def vec_dot_f16(x, y, target=AVX512):  # x [..., n], y [..., n] f32 (f16 values) -> [...]: ggml_vec_dot_f16
    """Whole steps through the SIMD body (llama.cpp/ggml/src/ggml-cpu/vec.cpp:345-367, F16 loaded as
    f32: GGML_F32Cx16 / GGML_F32Cx8 / GGML_F32Cx4, converted by F16C or by ggml's own conversion, the
    same values; on NEON the half body above); the leftover products (exact in f32) are added to a
    double sum that is rounded to float at the end, as are all of them without GGML_SIMD (x64)."""
    x, y = np.broadcast_arrays(x, y)
    if not target.lanes:
        return double_sum(x, y).astype(F32)
    n = x.shape[-1]
    if target.neon:
        whole = n - n % (4 * target.f16_lanes)
        total = half_body(x[..., :whole], y[..., :whole], target.f16_lanes)
    else:
        whole = n - n % (target.accumulators * target.lanes)
        total = vec_body(x[..., :whole], y[..., :whole], target)
    return double_sum(x[..., whole:], y[..., whole:], total.astype(F64)).astype(F32)


def vec_dot_bf16(x, y, target=AVX512):  # x [..., n], y [..., n] f32 (bf16 values) -> [...]: ggml_vec_dot_bf16
    """AVX512_BF16 (llama.cpp/ggml/src/ggml-cpu/vec.cpp:148-157): two vdpbf16ps accumulators over
    64-element steps, each _mm512_reduce_add_ps into a double. AVX2 (vec.cpp:172-195): four 8-lane
    accumulators over 32-element steps (mul then add; exact products), folded (0+2) + (1+3), then
    movehl/movehdup; AVX without AVX2 (vec.cpp:175-180) loads the same values. The leftover products go
    into the double sum; without AVX (sse42, x64) all of them."""
    x, y = np.broadcast_arrays(x, y)
    n = x.shape[-1]
    if not target.avx:
        return double_sum(x, y).astype(F32)
    step = 64 if target.dpbf16 else 32
    whole = n - n % step
    xs, ys = x[..., :whole], y[..., :whole]
    if target.dpbf16:
        c = np.zeros(x.shape[:-1] + (2, 16), F32)
        xs, ys = xs.reshape(c.shape[:-2] + (-1, 2, 16, 2)), ys.reshape(c.shape[:-2] + (-1, 2, 16, 2))
        for s in range(whole // 64):
            c = dpbf16(c, xs[..., s, :, :, :], ys[..., s, :, :, :])
        total = hsum16(c[..., 0, :]).astype(F64) + hsum16(c[..., 1, :]).astype(F64)
    else:
        c = np.zeros(x.shape[:-1] + (4, 8), F32)
        xs, ys = xs.reshape(c.shape[:-2] + (-1, 4, 8)), ys.reshape(c.shape[:-2] + (-1, 4, 8))
        for s in range(whole // 32):
            c = c + xs[..., s, :, :] * ys[..., s, :, :]
        total = register_sum((c[..., 0, :] + c[..., 2, :]) + (c[..., 1, :] + c[..., 3, :])).astype(F64)
    products = (x[..., whole:] * y[..., whole:]).astype(F64)
    for i in range(n - whole):
        total = total + products[..., i]
    return total.astype(F32)
