"""Float rounding exactly as the hardware does it: f16/bf16 conversion, the fused multiply-add,
and the horizontal sums of the SIMD registers."""
import numpy as np

F32, F64 = np.float32, np.float64


def round_f16(x):  # [...] f32 -> [...] f32 holding the nearest-even IEEE half (F16C, _cvtss_sh)
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def round_bf16(x):  # [...] f32 -> [...] f32 holding the nearest-even bfloat16 (vcvtneps2bf16)
    u = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(F32)


def fma32(a, b, c):  # f32 arrays (broadcast) -> f32 a*b + c rounded once, as vfmadd does
    """a*b is exact in float64; a*b + c is then rounded twice (to float64, then float32), which is
    wrong only when the float64 sum lands exactly on a float32 midpoint (its 29 low bits 100...0)
    while the exact sum does not: there it is moved one float64 step towards the exact sum first."""
    s = np.multiply(a, b, dtype=F64)
    if s.shape == np.broadcast_shapes(s.shape, np.shape(c)):
        s += c
    else:
        s = s + c
    if (s.view(np.uint64) << np.uint64(35) == np.uint64(1 << 63)).any():
        p, c = np.broadcast_arrays(np.multiply(a, b, dtype=F64), np.asarray(c, F64))
        v = s - p
        err = (p - (s - v)) + (c - v)  # TwoSum: s + err == p + c exactly
        midpoint = (s.view(np.uint64) << np.uint64(35) == np.uint64(1 << 63)) & (err != 0)
        s = np.where(midpoint, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def madd(a, b, c, fused=True):  # f32 arrays (broadcast) -> a*b + c: one FMA, or (without FMA) a rounded product, then the add
    return fma32(a, b, c) if fused else (np.multiply(a, b, dtype=F32) + np.asarray(c, F32)).astype(F32)


def hsum8(v):  # [..., 8] f32 -> [...]: hsum_float_8 / tinyBLAS hsum(__m256): (0+4, 1+5, ...) then pairs
    t = v[..., 4:] + v[..., :4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def hsum16(v):  # [..., 16] f32 -> [...]: GCC's _mm512_reduce_add_ps, halves folded 8, 4, then pairs
    return hsum8(v[..., 8:] + v[..., :8])


def hsum4(v):  # [..., 4] f32 -> [...]: vaddvq_f32 (faddp twice) and two haddps alike: (0+1) + (2+3)
    return (v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])


def register_sum(v):  # [..., lanes] f32 -> [...]: one register's horizontal sum, as the target's kernels form it
    """16 lanes: _mm512_reduce_add_ps; 8: hsum_float_8, tinyBLAS's hsum(__m256) and the soft_max/cvar
    loops (movehl, then movehdup); 4: vaddvq_f32."""
    return {16: hsum16, 8: hsum8, 4: hsum4}[v.shape[-1]](v)


def movehl_sum(v):  # [..., 4] f32 -> [...]: the SSE2 soft_max/cvar loops' sum on an AVX build, movehl then movehdup
    return (v[..., 0] + v[..., 2]) + (v[..., 1] + v[..., 3])


def vec_reduce(acc):  # [..., ARR, lanes] f32 -> [...]: GGML_F32_VEC_REDUCE of the GGML_F32_ARR accumulators
    """The upper half added to the lower until one is left: 4 accumulators (0+2, 1+3), then (0+1), 8 (SSE)
    (0+4 .. 3+7) first (llama.cpp/ggml/src/ggml-cpu/simd-mappings.h:349-364,464-481,602-620,922-938);
    the register then as AVX512's _mm512_reduce_add_ps, NEON's vaddvq_f32, or, on AVX, low plus high
    half and two haddps: (0+1) + (2+3), not hsum_float_8's (0+2) + (1+3); SSE's two haddps alike."""
    while acc.shape[-2] > 1:
        half = acc.shape[-2] // 2
        acc = acc[..., :half, :] + acc[..., half:, :]
    v = acc[..., 0, :]
    return hsum4(v[..., :4] + v[..., 4:]) if v.shape[-1] == 8 else register_sum(v)
