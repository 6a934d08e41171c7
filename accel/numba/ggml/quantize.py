"""The activation quantizers of reference/ggml_cpu/quantize.py as numba kernels; the f16 rounding of
the Q8_0 scales is done by NumPy outside (numba has no float16)."""
import numba
import numpy as np

from reference.ggml_cpu.quantize import QuantActs
from reference.ggml_cpu.rounding import round_f16
from reference.ggml_cpu.build import GgmlCpuError
from reference.ggml_cpu.target import AVX512

NUMBA_TARGETS = ("avx2", "avx512")  # the CPU targets the twins model; the NEON kernels are the reference's alone


def x86_only(target):  # Target -> None, or GgmlCpuError for a target the twins do not model
    if target.name not in NUMBA_TARGETS:
        raise GgmlCpuError(f"the numba twins model the {' and '.join(NUMBA_TARGETS)} targets, not {target.name} "
                           "(--backend numpy emulates it)")


@numba.njit(cache=True)
def q8_0_blocks(x):  # x f32 [T, nb, 32] -> (d f32 [T, nb] unrounded, q int8 [T, nb, 32], sum q [T, nb])
    T, nb, _ = x.shape
    d = np.zeros((T, nb), np.float32)
    q = np.zeros((T, nb, 32), np.int8)
    sums = np.zeros((T, nb), np.int32)
    for t in range(T):
        for b in range(nb):
            amax = np.float32(0)
            for i in range(32):
                amax = max(amax, abs(x[t, b, i]))
            d[t, b] = amax / np.float32(127)
            inv = np.float32(127) / amax if amax != 0 else np.float32(0)
            for i in range(32):
                q[t, b, i] = np.int8(np.rint(x[t, b, i] * inv))  # |q| <= 127
                sums[t, b] += q[t, b, i]
    return d, q, sums


def quantize_q8_0(x, target=AVX512):  # x [T, K] f32, an x86 Target -> QuantActs: as reference quantize_q8_0
    x86_only(target)
    d, q, sums = q8_0_blocks(np.ascontiguousarray(x, np.float32).reshape(len(x), -1, 32))
    return QuantActs(round_f16(d), q, s=round_f16(d * sums.astype(np.float32)))


@numba.njit(cache=True)
def q8_k_blocks(x, prefer_positive):  # x f32 [T, nb, 256] -> (d [T, nb], q int8 [T, nb, 256], bsums [T, nb, 16])
    T, nb, _ = x.shape
    d = np.zeros((T, nb), np.float32)
    q = np.zeros((T, nb, 256), np.int8)
    bsums = np.zeros((T, nb, 16), np.int32)
    for t in range(T):
        for b in range(nb):
            amax, signed_max = np.float32(0), np.float32(0)
            for i in range(256):  # the first element of largest |x|
                if abs(x[t, b, i]) > amax:
                    amax, signed_max = abs(x[t, b, i]), x[t, b, i]
            if prefer_positive:
                for i in range(256):
                    if x[t, b, i] == amax:
                        signed_max = amax
            if amax == 0:
                continue
            iscale = np.float32(-127) / signed_max
            d[t, b] = np.float32(1) / iscale
            for i in range(256):
                q[t, b, i] = min(127, np.int32(np.rint(x[t, b, i] * iscale)))  # >= -127: |x| <= |max|
                bsums[t, b, i // 16] += q[t, b, i]
    return d, q, bsums


def quantize_q8_k(x, prefer_positive=False, target=AVX512):  # x [T, K] f32, an x86 Target -> QuantActs: as reference
    x86_only(target)
    d, q, bsums = q8_k_blocks(np.ascontiguousarray(x, np.float32).reshape(len(x), -1, 256), prefer_positive)
    return QuantActs(d, q, bsums=bsums)
