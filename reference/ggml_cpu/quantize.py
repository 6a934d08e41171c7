"""Activation quantizers: the f32 rows converted to the weight's vec_dot type (Q8_0, Q8_K and the
4x8 repack twins)."""
import numpy as np

from .rounding import F32, round_f16
from .target import AVX512


class QuantActs:
    """Quantized activation rows: d [T, nb] f32, q [T, nb, bs] int; s (Q8_1) or bsums (Q8_K)."""

    def __init__(self, d, q, s=None, bsums=None):
        self.d, self.q, self.s, self.bsums = d, q, s, bsums


def quantize_q8_0(x, target=AVX512):  # x [T, K] f32 -> QuantActs: quantize_row_q8_0 and its 4x8 repack twin
    """d = amax/127 stored as f16, q = round-half-even(x * inverse): the scale that rounds the values
    is not the stored one. The inverse is 127/amax on x86 (AVX2), 1/d on NEON
    (llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:63-64, vcvtnq_s32_f32 rounding to nearest even too).
    x86 without AVX takes quantize_row_q8_0_ref (llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c:393-396,
    llama.cpp/ggml/src/ggml-quants.c): 1/d and roundf, halves away from zero."""
    blocks = x.reshape(len(x), -1, 32)
    amax = np.max(np.abs(blocks), axis=-1)
    d = amax / F32(127)
    reference = not (target.neon or target.avx)  # quantize_row_q8_0_ref: x86 without AVX (sse42, x64)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(1) / d if target.neon or reference else F32(127) / amax, F32(0)).astype(F32)
    scaled = blocks * inv[..., None]
    if reference:  # roundf: halves away from zero (the float32 product plus 0.5 is exact in float64)
        q = (np.sign(scaled) * np.floor(np.abs(scaled).astype(np.float64) + 0.5)).astype(np.int64)
    else:
        q = np.rint(scaled).astype(np.int64)
    return QuantActs(round_f16(d), q, s=round_f16(d * q.sum(-1).astype(F32)))


def quantize_q8_k(x, prefer_positive=False, target=AVX512):  # x [T, K] f32 -> QuantActs: quantize_row_q8_K_ref
    """iscale = -127/max with max the signed element of largest |x| (the first one; the 4x8 repack
    quantizer takes the positive one when +max and -max tie), q = min(127, rint(iscale*x)),
    d = 1/iscale (f32, not rounded to f16). On aarch64 GCC fuses nearest_int's iscale*x + 12582912
    (llama.cpp/ggml/src/ggml-quants.c:621-626, an fmla in the build), so the exact product is rounded;
    clang rounds the product first, an argument of nearest_int (Target.contracts_across_statements)."""
    blocks = x.reshape(len(x), -1, 256)
    absx = np.abs(blocks)
    amax = np.max(absx, axis=-1)
    first = np.take_along_axis(blocks, np.argmax(absx, axis=-1)[..., None], axis=-1)[..., 0]
    signed_max = np.where(prefer_positive & np.any(blocks == amax[..., None], axis=-1), amax, first)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(amax != 0, F32(-127) / signed_max, F32(0)).astype(F32)
        d = np.where(amax != 0, F32(1) / iscale, F32(0)).astype(F32)
    product = np.multiply(blocks, iscale[..., None], dtype=np.float64 if target.contracts_across_statements else F32)
    q = np.minimum(127, np.rint(product)).astype(np.int64)
    return QuantActs(d, q, bsums=q.reshape(q.shape[:-1] + (16, 16)).sum(-1))
