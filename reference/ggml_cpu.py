"""The `ggml-cpu` numerics mode: what llama.cpp's CPU backend rounds, emulated in NumPy so that the
reference reproduces its logits bit for bit (docs/ggml-cpu-numerics.md).

The build it models (BUILD): llama.cpp 0c1e570 as llama-cpp-python 0.3.36 compiles it on x86-64
with GGML_NATIVE (GCC, -march=native on an AVX512 F/BW/DQ/VL/VNNI/BF16 CPU), llamafile tinyBLAS and
CPU repack on, glibc 2.36 libm, 2 threads. The emulation itself runs anywhere; `host_differences`
says where this machine's own llama.cpp build would round differently.

Each llama.cpp kernel is one function doing the same float32 operations in the same order: every
rounding is explicit (float32 arrays, `fma32` for a fused multiply-add, the lane layout and the
reduction tree of each SIMD kernel), every integer dot product is exact. Which kernel a matmul takes
depends on the weight type, on the number of rows in the batch (the ubatch) and on whether the
weight was repacked at load time: `mul_mat` chooses as ggml_compute_forward_mul_mat does.

The model calls it through `GgmlCpuBackend`: linear and attention as every backend, plus the
element-wise hooks rms_norm, rope_norm, sigmoid, swiglu and softcap. Attention reads cache row j as
llama.cpp's KV cell j (one sequence from position 0, so cell = position) and applies the cache type
when it reads K and V, which is the same as rounding them when they are stored.

A q8_0 cache (K and V) is llama.cpp's quantized cache: V quantized forces flash attention, K and V
rows are stored as Q8_0 blocks, Q is converted to Q8_0 for the K dot products, and for head sizes
that are multiples of 64 q, k, v and the attention output are rotated by Walsh-Hadamard transforms
(llama-kv-cache.cpp attn_rot_k / attn_rot_v).

Not modelled (GgmlCpuError): other quantized KV types, weight types without a decoder below, the
Q2_K vec_dot (a Q2_K matrix whose row count is not a multiple of 8, in batches of fewer than 8
rows). The vision tower keeps the exact numerics.
"""
import ctypes
import ctypes.util
import functools
import os
import platform
import warnings

import numpy as np

F32, F64 = np.float32, np.float64
BUILD = ("llama.cpp 0c1e570 (llama-cpp-python 0.3.36), x86-64 GCC -march=native, "
         "AVX512 F/BW/DQ/VL/VNNI/BF16, llamafile + CPU repack, glibc 2.36, 2 threads")
BUILD_CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "fma", "f16c")
BUILD_GLIBC = "2.36"
KV_TYPES = ("f16", "f32", "q8_0")
UBATCH = 512  # llama-cpp-python's n_batch = n_ubatch: a longer prompt is computed 512 rows at a time


class GgmlCpuError(Exception):
    """A request the emulation does not model (KV type, weight type, kernel path); one line."""


def host_differences():  # -> [str]: how this machine's llama.cpp build would differ from BUILD
    found = []
    if platform.machine() not in ("x86_64", "AMD64"):
        found.append(f"CPU architecture {platform.machine()}, not x86-64")
    elif os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        missing = [flag for flag in BUILD_CPU_FLAGS if flag not in flags]
        if missing:
            found.append(f"CPU lacks {' '.join(missing)}")
    libc, version = platform.libc_ver()
    if (libc, version) != ("glibc", BUILD_GLIBC):
        found.append(f"C library {libc or 'unknown'} {version}, not glibc {BUILD_GLIBC} (expf/cosf/sinf/tanhf "
                     "may differ in the last bit)")
    return found


# ---------------------------------------------------------------------------------------------
# Float rounding, exactly as the hardware does it

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


def hsum8(v):  # [..., 8] f32 -> [...]: hsum_float_8 / tinyBLAS hsum(__m256): (0+4, 1+5, ...) then pairs
    t = v[..., 4:] + v[..., :4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def hsum16(v):  # [..., 16] f32 -> [...]: GCC's _mm512_reduce_add_ps, halves folded 8, 4, then pairs
    return hsum8(v[..., 8:] + v[..., :8])


# ---------------------------------------------------------------------------------------------
# glibc libm, called through ctypes: its expf/cosf/sinf/tanhf are not NumPy's

@functools.lru_cache(maxsize=None)
def _libm_fn(name):  # "expf" -> ctypes function float(float)
    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    fn = getattr(lib, name)
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return fn


def libm(name, x):  # "expf" | "cosf" | "sinf" | "tanhf", [...] f32 -> [...] f32 from glibc
    x = np.asarray(x, F32)
    fn = _libm_fn(name)
    return np.array([fn(v) for v in x.ravel().tolist()], F32).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# ggml's vectorised exp and silu (vec.h, the AVX512 variants)

def hexf(text):  # "0x1.8p23" -> float32, the C hex-float constants of vec.h
    return F32(float.fromhex(text))


EXP_R = hexf("0x1.8p23")


def v_expf(x):  # [...] f32 -> [...] f32: ggml_v_expf for __m512 (max error 1.5 ulp, not expf)
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma32(x, hexf("0x1.715476p+0"), EXP_R)
        n = z - EXP_R
        b = fma32(-n, hexf("0x1.7f7d1cp-20"), fma32(-n, hexf("0x1.62e4p-1"), x))
        u = b * b
        j = fma32(fma32(fma32(hexf("0x1.0e4020p-7"), b, hexf("0x1.573e2ep-5")), u,
                        fma32(hexf("0x1.555e66p-3"), b, hexf("0x1.fffdb6p-2"))),
                  u, fma32(hexf("0x1.ffffecp-1"), b, F32(1)))
        res = np.ldexp(j, np.where(np.isfinite(n), n, 0).astype(np.int32)).astype(F32)  # vscalefps
        big = ~(np.abs(n) <= 192)
        return np.where(big, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)


def v_silu(x):  # [...] f32 -> [...] f32: ggml_v_silu, x / (1 + v_expf(-x))
    x = np.asarray(x, F32)
    return x / (F32(1) + v_expf(F32(0) - x))


def silu_rows(x):  # [..., n] f32 -> [..., n]: ggml_v_silu on 16-lane blocks, glibc x/(1+expf(-x)) on the tail
    n16 = x.shape[-1] - x.shape[-1] % 16
    head = v_silu(x[..., :n16])
    tail = x[..., n16:] / (F32(1) + libm("expf", -x[..., n16:]))
    return np.concatenate([head, tail], axis=-1)


# ---------------------------------------------------------------------------------------------
# Element-wise ops (ops.cpp, unary-ops.cpp)

def rms_norm(x, eps):  # x [..., n] f32 -> [..., n]: ggml_compute_forward_rms_norm_f32
    # the squares are rounded to f32, then summed in double strictly left to right
    sum_sq = np.cumsum((x * x).astype(F64), axis=-1)[..., -1]
    mean = (sum_sq / x.shape[-1]).astype(F32)
    scale = F32(1) / np.sqrt(mean + F32(eps))
    return x * scale[..., None]


def rope_norm(x, theta):  # x [T, H, D], theta [T, D/2] (ops.rope_angles) -> [T, H, D]; pairs (2i, 2i+1)
    """rotate_pairs with glibc cosf/sinf. GCC vectorises the loop (8 pairs, then 4) and there
    contracts x0*c - x1*s and x0*s + x1*c into one FMA each; the last n_pairs mod 4 pairs are
    computed without contraction."""
    cos, sin = libm("cosf", theta)[:, None, :], libm("sinf", theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    n4 = theta.shape[-1] - theta.shape[-1] % 4
    out = np.empty_like(x)
    out[..., 0:2 * n4:2] = fma32(x0[..., :n4], cos[..., :n4], -(x1[..., :n4] * sin[..., :n4]))
    out[..., 1:2 * n4:2] = fma32(x0[..., :n4], sin[..., :n4], x1[..., :n4] * cos[..., :n4])
    out[..., 2 * n4::2] = x0[..., n4:] * cos[..., n4:] - x1[..., n4:] * sin[..., n4:]
    out[..., 2 * n4 + 1::2] = x0[..., n4:] * sin[..., n4:] + x1[..., n4:] * cos[..., n4:]
    return out


def sigmoid(x):  # [...] -> [...]: op_sigmoid, 1/(1 + expf(-x)) with glibc expf
    return F32(1) / (F32(1) + libm("expf", -np.asarray(x, F32)))


def swiglu(gate, up):  # gate [T, F], up [T, F] -> [T, F]: ggml_vec_swiglu_f32, silu(gate) * up
    return silu_rows(gate) * up


def softcap(z, cap):  # z [...] -> [...]: ggml_scale(1/cap), glibc tanhf, ggml_scale(cap)
    if cap == 0:
        return z
    return libm("tanhf", z * F32(1.0 / cap)) * F32(cap)


def soft_max(scores, visible, scale):  # scores [R, S] f32, visible [R, S] -> [R, S]: soft_max_ext, F32 mask
    """x*scale + mask, ggml_v_expf(x - max) over 16-lane blocks (scalar glibc expf on a tail),
    each block's f32 reduction added to a double sum, then times (float)(1/sum)."""
    w = np.where(visible, scores * F32(scale), F32(-np.inf)).astype(F32)
    m = np.max(w, axis=-1, keepdims=True)
    n16 = w.shape[-1] - w.shape[-1] % 16
    with np.errstate(invalid="ignore"):
        e = np.concatenate([v_expf(w[:, :n16] - m), libm("expf", w[:, n16:] - m)], axis=-1)
    blocks = hsum16(e[:, :n16].reshape(len(e), -1, 16)).astype(F64)
    total = np.cumsum(np.concatenate([blocks, e[:, n16:].astype(F64)], axis=-1), axis=-1)[:, -1]
    return e * (1.0 / total).astype(F32)[:, None]


# ---------------------------------------------------------------------------------------------
# Float dot products: llamafile tinyBLAS (batches of 2+ rows) and ggml_vec_dot_* (one row)

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


# ---------------------------------------------------------------------------------------------
# Weights as integers: each block format decoded to its f16 scales and integer values

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)


class QuantRows:
    """One quantized matrix [O, K] as ggml's kernels see it: w = d * post * scale * value - dmin * min
    per element, with d/dmin/m the f16 block fields widened to f32 and value an integer. `sub` is the
    width of a scale's sub-block; `post` the exact power of two some IQ kernels apply at the end;
    `unsigned_offset` the bias a kernel removes through the activation sums (Q6_K's 32); `min_lanes`
    how many float lanes the vec_dot accumulates the min part in (Q4_K 4, Q5_K 1)."""

    def __init__(self, d, values, scales=None, mins=None, dmin=None, m=None, sub=32, post=1.0, unsigned_offset=0,
                 min_lanes=1):
        self.d, self.values, self.scales, self.mins, self.dmin, self.m = d, values, scales, mins, dmin, m
        self.sub, self.post, self.unsigned_offset, self.min_lanes = sub, post, unsigned_offset, min_lanes


def f16_at(blocks, offset):  # uint8 [..., nbytes] -> f32 [...]: the little-endian half at byte offset
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(F32)


def bits_at(blocks, offset, n_bytes):  # uint8 [..., nbytes] -> uint8 [..., 8*n_bytes]: bit i of the little-endian field
    return np.unpackbits(blocks[..., offset:offset + n_bytes], axis=-1, bitorder="little")


def nibbles(qs):  # uint8 [..., n] -> int [..., 2n]: low nibbles of all bytes, then high nibbles
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)


def k_scale_min(scales):  # uint8 [..., 12] -> (scale [..., 8], min [..., 8]): get_scale_min_k4
    s = scales.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def iq_grid(qtype):  # gguf.quants class -> int [entries, 4 or 8]: the IQ lattice as integers
    qtype.init_grid()
    return qtype.grid.reshape(qtype.grid_shape).astype(np.int64)


def iq_signs(sign_index):  # int [...] (7 bits) -> +-1 [..., 8]: ksigns_iq2xs, bit 7 makes the parity even
    from gguf.quants import IQ2_XXS
    ksigns = np.frombuffer(IQ2_XXS.ksigns, np.uint8)[sign_index]
    return 1 - 2 * np.unpackbits(ksigns[..., None], axis=-1, bitorder="little").astype(np.int64)


def decode_q8_0(b):  # [O, nb, 34]
    return QuantRows(f16_at(b, 0), b[..., 2:34].view(np.int8).astype(np.int64))


def decode_q4_0(b):  # [O, nb, 18]
    return QuantRows(f16_at(b, 0), nibbles(b[..., 2:18]) - 8)


def decode_q5_0(b):  # [O, nb, 22]
    return QuantRows(f16_at(b, 0), nibbles(b[..., 6:22]) + 16 * bits_at(b, 2, 4) - 16)


def decode_q5_1(b):  # [O, nb, 24]: w = d * value + m
    return QuantRows(f16_at(b, 0), nibbles(b[..., 8:24]) + 16 * bits_at(b, 4, 4), m=f16_at(b, 2))


def decode_iq4_nl(b):  # [O, nb, 18]
    return QuantRows(f16_at(b, 0), KVALUES_IQ4NL[nibbles(b[..., 2:18])])


def decode_q4_k(b):  # [O, nb, 144]: d, dmin, 12 scale bytes, 128 nibble bytes (64 elements per 32 bytes)
    qs = b[..., 16:144].reshape(b.shape[:-1] + (4, 32))
    sc, mn = k_scale_min(b[..., 4:16])
    return QuantRows(f16_at(b, 0), nibbles(qs).reshape(b.shape[:-1] + (256,)), sc, mn, f16_at(b, 2), min_lanes=4)


def decode_q5_k(b):  # [O, nb, 176]: as Q4_K plus 32 bytes of fifth bits (bit 2j: low half of chunk j)
    qs = b[..., 48:176].reshape(b.shape[:-1] + (4, 32))
    high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little").astype(np.int64)  # [..., 32, 8]
    high = high.transpose(tuple(range(high.ndim - 2)) + (high.ndim - 1, high.ndim - 2))  # [..., 8, 32]
    sc, mn = k_scale_min(b[..., 4:16])
    values = nibbles(qs).reshape(b.shape[:-1] + (256,)) + 16 * high.reshape(b.shape[:-1] + (256,))
    return QuantRows(f16_at(b, 0), values, sc, mn, f16_at(b, 2))


def decode_q6_k(b):  # [O, nb, 210]: ql[128], qh[64], int8 scales[16], d; unsigned 6-bit codes, offset 32
    ql = b[..., 0:128].reshape(b.shape[:-1] + (2, 64)).astype(np.int64)
    qh = b[..., 128:192].reshape(b.shape[:-1] + (2, 32)).astype(np.int64)
    parts = [(ql[..., 0:32] & 15) | ((qh & 3) << 4), (ql[..., 32:64] & 15) | (((qh >> 2) & 3) << 4),
             (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
    codes = np.concatenate(parts, axis=-1).reshape(b.shape[:-1] + (256,))
    scales = b[..., 192:208].view(np.int8).astype(np.int64)
    return QuantRows(f16_at(b, 208), codes, scales, sub=16, unsigned_offset=32)


def decode_q2_k(b):  # [O, nb, 84]: 16 scale bytes (scale | min << 4), 64 bytes of 2-bit codes, d, dmin
    qs = b[..., 16:80].reshape(b.shape[:-1] + (2, 1, 32)).astype(np.int64)
    codes = (qs >> (2 * np.arange(4))[:, None]) & 3  # [..., 2, 4, 32]
    s = b[..., 0:16].astype(np.int64)
    return QuantRows(f16_at(b, 80), codes.reshape(b.shape[:-1] + (256,)), s & 15, s >> 4, f16_at(b, 82), sub=16)


def decode_q3_k(b):  # [O, nb, 110]: hmask[32], qs[64], 12 scale bytes (6-bit, minus 32), d
    qs = b[..., 32:96].reshape(b.shape[:-1] + (2, 1, 32)).astype(np.int64)
    low = (qs >> (2 * np.arange(4))[:, None]) & 3  # [..., 2, 4, 32]
    high = np.unpackbits(b[..., 0:32, None], axis=-1, bitorder="little").astype(np.int64)  # [..., 32, 8]
    high = np.moveaxis(high, -1, -2).reshape(b.shape[:-1] + (2, 4, 32))
    s = b[..., 96:108].astype(np.int64)
    i = np.arange(16)
    low4 = np.where(i < 8, s[..., i % 8] & 15, s[..., i % 8] >> 4)
    scales = (low4 | (((s[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32
    return QuantRows(f16_at(b, 108), (low + 4 * high - 4).reshape(b.shape[:-1] + (256,)), scales, sub=16)


def decode_iq2_xxs(b):  # [O, nb, 66]: per 32: 4 grid bytes, then 4x7 sign bits + 4-bit scale
    from gguf.quants import IQ2_XXS
    q = b[..., 2:66].reshape(b.shape[:-1] + (8, 8))
    aux = np.ascontiguousarray(q[..., 4:8]).view(np.uint32)[..., 0].astype(np.int64)
    grid = iq_grid(IQ2_XXS)[q[..., 0:4]]  # [..., 8, 4, 8]
    signs = iq_signs((aux[..., None] >> (7 * np.arange(4))) & 127)
    values = (grid * signs).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16_at(b, 0), values, 2 * (aux >> 28) + 1, post=0.125)


def decode_iq2_s(b):  # [O, nb, 82]: qs[32] grid low bytes, signs[32], qh[8], scales[8] (two 4-bit per 32)
    from gguf.quants import IQ2_S
    qs = b[..., 2:34].reshape(b.shape[:-1] + (8, 4)).astype(np.int64)
    qh = b[..., 66:74].astype(np.int64)[..., None]
    index = qs | ((qh << (8 - 2 * np.arange(4))) & 0x300)
    grid = iq_grid(IQ2_S)[index]  # [..., 8, 4, 8]
    signs = 1 - 2 * np.unpackbits(b[..., 34:66, None], axis=-1, bitorder="little").astype(np.int64)
    values = (grid * signs.reshape(grid.shape)).reshape(b.shape[:-1] + (256,))
    s = b[..., 74:82].astype(np.int64)
    scales = np.stack([2 * (s & 15) + 1, 2 * (s >> 4) + 1], axis=-1).reshape(b.shape[:-1] + (16,))
    return QuantRows(f16_at(b, 0), values, scales, sub=16, post=0.125)


def decode_iq3_xxs(b):  # [O, nb, 98]: 64 grid bytes (4 values each), then per 32 a word of signs + scale
    from gguf.quants import IQ3_XXS
    grid = iq_grid(IQ3_XXS)[b[..., 2:66].reshape(b.shape[:-1] + (8, 8))]  # [..., 8, 8, 4]
    aux = np.ascontiguousarray(b[..., 66:98]).view(np.uint32).astype(np.int64)  # [..., 8]
    signs = iq_signs((aux[..., None] >> (7 * np.arange(4))) & 127)  # [..., 8, 4, 8]
    values = (grid.reshape(signs.shape) * signs).reshape(b.shape[:-1] + (256,))
    return QuantRows(f16_at(b, 0), values, 2 * (aux >> 28) + 1, post=0.25)


def decode_iq4_xs(b):  # [O, nb, 136]: d, scales_h (u16), scales_l[4], qs[128] (16 bytes per 32)
    sh = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0].astype(np.int64)[..., None]
    sl = b[..., 4:8].astype(np.int64)
    j = np.arange(8)
    ls = ((sl[..., j // 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
    values = KVALUES_IQ4NL[nibbles(b[..., 8:136].reshape(b.shape[:-1] + (8, 16)))].reshape(b.shape[:-1] + (256,))
    return QuantRows(f16_at(b, 0), values, ls - 32)


DECODERS = {  # type -> (bytes per block, decoder)
    "Q8_0": (34, decode_q8_0), "Q4_0": (18, decode_q4_0), "Q5_0": (22, decode_q5_0),
    "Q5_1": (24, decode_q5_1), "IQ4_NL": (18, decode_iq4_nl),
    "Q2_K": (84, decode_q2_k), "Q3_K": (110, decode_q3_k), "Q4_K": (144, decode_q4_k),
    "Q5_K": (176, decode_q5_k), "Q6_K": (210, decode_q6_k),
    "IQ2_XXS": (66, decode_iq2_xxs), "IQ2_S": (82, decode_iq2_s),
    "IQ3_XXS": (98, decode_iq3_xxs), "IQ4_XS": (136, decode_iq4_xs),
}


def decode(weights, name):  # GGUF tensor -> QuantRows with arrays [O, nb, ...]
    n_bytes, decoder = DECODERS[weights.type_name(name)]
    raw = np.asarray(weights.raw(name)).view(np.uint8)
    rows = decoder(raw.reshape(len(raw), -1, n_bytes))
    rows.values = rows.values.astype(np.int16)  # every code fits; a quarter of the int64 memory
    return rows


# ---------------------------------------------------------------------------------------------
# Activation quantizers: the f32 rows converted to the weight's vec_dot type

class QuantActs:
    """Quantized activation rows: d [T, nb] f32, q [T, nb, bs] int; s (Q8_1) or bsums (Q8_K)."""

    def __init__(self, d, q, s=None, bsums=None):
        self.d, self.q, self.s, self.bsums = d, q, s, bsums


def quantize_q8_0(x):  # x [T, K] f32 -> QuantActs: quantize_row_q8_0 (AVX2) and its 4x8 repack twin
    """d = amax/127 stored as f16, q = round-half-even(x * (127/amax)): the scale that rounds the
    values is not the stored one."""
    blocks = x.reshape(len(x), -1, 32)
    amax = np.max(np.abs(blocks), axis=-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    return QuantActs(round_f16(d), q, s=round_f16(d * q.sum(-1).astype(F32)))


def quantize_q8_k(x, prefer_positive=False):  # x [T, K] f32 -> QuantActs: quantize_row_q8_K_ref
    """iscale = -127/max with max the signed element of largest |x| (the first one; the 4x8 repack
    quantizer takes the positive one when +max and -max tie), q = min(127, rint(iscale*x)),
    d = 1/iscale (f32, not rounded to f16)."""
    blocks = x.reshape(len(x), -1, 256)
    absx = np.abs(blocks)
    amax = np.max(absx, axis=-1)
    first = np.take_along_axis(blocks, np.argmax(absx, axis=-1)[..., None], axis=-1)[..., 0]
    signed_max = np.where(prefer_positive & np.any(blocks == amax[..., None], axis=-1), amax, first)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(amax != 0, F32(-127) / signed_max, F32(0)).astype(F32)
        d = np.where(amax != 0, F32(1) / iscale, F32(0)).astype(F32)
    q = np.minimum(127, np.rint(blocks * iscale[..., None])).astype(np.int64)
    return QuantActs(d, q, bsums=q.reshape(q.shape[:-1] + (16, 16)).sum(-1))


def int_dot(w, a, width):  # w [O, nb, bs], a [T, nb, bs] int -> [T, O, nb, bs/width]: exact partial sums
    O, nb, bs = w.shape
    wf = w.reshape(O, nb, bs // width, width).astype(F64)
    af = a.reshape(len(a), nb, bs // width, width).astype(F64)
    return np.einsum("onsw,tnsw->tons", wf, af).astype(np.int64)  # integers < 2^53: exact


def f32_of(i):  # int [...] -> f32 [...]: vcvtdq2ps, round to nearest even
    return np.asarray(i).astype(F32)


# ---------------------------------------------------------------------------------------------
# Quantized dot products, one function per kernel family

def q0_lanes(w, a, accumulators=1):  # QuantRows/QuantActs 32-blocks -> [T, O]
    """tinyBLAS_Q0_AVX and ggml_vec_dot_{q8_0,q5_0,q4_0,iq4_nl}_q8_0 (AVX2), every row against every
    activation row."""
    return q0_accumulate(int_dot(w.values, a.q, 4), w.d[None] * a.d[:, None], accumulators)


def q0_accumulate(lanes, scale, accumulators=1):  # lanes [..., nb, 8] int, scale [..., nb] f32 -> [...]
    """8 lanes, each the exact sum of 4 neighbouring products of a block, fma(f32(d_w*d_a), f32(lane),
    acc) block after block, then hsum_float_8. The IQ4_NL vec_dot takes blocks in pairs into two
    accumulators, summed before the hsum, and an odd last block as a scalar fma(d, f32(isum), sum)."""
    nb = lanes.shape[-2]
    paired = nb - nb % accumulators
    acc = np.zeros((accumulators,) + lanes.shape[:-2] + (8,), F32)
    for b in range(paired):
        acc[b % accumulators] = fma32(scale[..., b, None], f32_of(lanes[..., b, :]), acc[b % accumulators])
    out = hsum8(acc[0] + acc[1] if accumulators == 2 else acc[0])
    for b in range(paired, nb):
        out = fma32(scale[..., b], f32_of(lanes[..., b, :].sum(-1)), out)
    return out


def vec_dot_q8_0(k, q):  # QuantActs k, q of matching (broadcast) leading shapes, [..., nb, 32] -> [...]
    """ggml_vec_dot_q8_0_q8_0 of one K row and one Q row: the q0_lanes arithmetic, pairwise."""
    products = k.q * q.q
    lanes = products.reshape(products.shape[:-1] + (8, 4)).sum(-1)
    return q0_accumulate(lanes, k.d * q.d)


def q0_repacked(w, a):  # QuantRows/QuantActs 32-blocks -> [T, O]
    """CPU repack q4_0_8x8 / iq4_nl_8x8, gemm and gemv alike: per block fma(f32(isum), f32(d_w*d_a), acc)."""
    sums = f32_of(int_dot(w.values, a.q, 32)[..., 0])  # [T, O, nb]
    scale = w.d[None] * a.d[:, None]
    acc = np.zeros(sums.shape[:2], F32)
    for b in range(sums.shape[2]):
        acc = fma32(sums[:, :, b], scale[:, :, b], acc)
    return acc


def q5_1_vec_dot(w, a):  # Q5_1 rows, Q8_1 acts -> [T, O]: ggml_vec_dot_q5_1_q8_1 (AVX2)
    """Unsigned 5-bit values times int8: 8 lanes fma(f32(lane), f32(d_w*d_a), acc); the block
    minimums add m_w*s_a into a scalar (contracted to FMA), added after hsum_float_8."""
    lanes = f32_of(int_dot(w.values, a.q, 4))
    scale = (w.d[None] * a.d[:, None])[..., None]
    acc = np.zeros(lanes.shape[:2] + (8,), F32)
    summs = np.zeros(lanes.shape[:2], F32)
    for b in range(lanes.shape[2]):
        summs = fma32(w.m[None, :, b], a.s[:, None, b], summs)
        acc = fma32(lanes[:, :, b], scale[:, :, b], acc)
    return hsum8(acc) + summs


def sub_block_sums(a, width):  # QuantActs (Q8_K) -> int [T, nb, 256/width]: activation sums per sub-block
    return a.bsums.reshape(a.bsums.shape[:-1] + (-1, width // 16)).sum(-1)


def k_repacked_rows(w, a, elements_per_fma):  # Q4_K/Q2_K rows, Q8_K acts -> [T, O]
    """CPU repack q4_K_8x8 / q2_K_8x8: the scale part sum(scale*dot) and the min part sum(min*bsum)
    go through two FMA accumulators, d_w*d_a and dmin_w*d_a, once per `elements_per_fma` (the gemm:
    64 for Q4_K, 128 for Q2_K; the gemv: a whole 256-block); out = acc - acc_min."""
    dots = int_dot(w.values, a.q, w.sub) * w.scales[None]  # [T, O, nb, nsub]
    mins = sub_block_sums(a, w.sub)[:, None] * w.mins[None]
    step = elements_per_fma // w.sub
    dots = dots.reshape(dots.shape[:3] + (-1, step)).sum(-1)
    mins = mins.reshape(mins.shape[:3] + (-1, step)).sum(-1)
    scale, scale_min = w.d[None] * a.d[:, None], w.dmin[None] * a.d[:, None]
    acc = np.zeros(dots.shape[:2], F32)
    acc_min = np.zeros(dots.shape[:2], F32)
    for b in range(dots.shape[2]):
        for p in range(dots.shape[3]):
            acc = fma32(f32_of(dots[:, :, b, p]), scale[:, :, b], acc)
            acc_min = fma32(f32_of(mins[:, :, b, p]), scale_min[:, :, b], acc_min)
    return acc - acc_min


def tiled(w, a):  # K-quant/IQ rows, Q8_K acts -> [T, O]: the tiled AVX512-VNNI kernel (tiled/)
    """Per 256-slab: s1 = sum(scale * dot) exact, r = f32(s1) * d0 (d0 = f16 d times the IQ power of
    two), minus dmin*f32(s2) by one fnmadd for types with mins, then buf = fma(r, d_act, buf)."""
    dots = int_dot(w.values - w.unsigned_offset, a.q, w.sub) * w.scales[None]  # [T, O, nb, nsub]
    s1 = f32_of(dots.sum(-1))
    d0 = (w.d * F32(w.post)).astype(F32)
    buf = np.zeros(s1.shape[:2], F32)
    s2 = None if w.mins is None else f32_of((sub_block_sums(a, w.sub)[:, None] * w.mins[None]).sum(-1))
    for b in range(s1.shape[2]):
        r = s1[:, :, b] * d0[None, :, b]
        if s2 is not None:
            r = fma32(-w.dmin[None, :, b], s2[:, :, b], r)
        buf = fma32(r, a.d[:, None, b], buf)
    return buf


def k_vec_dot(w, a):  # K-quant/IQ rows, Q8_K acts -> [T, O]: ggml_vec_dot_*_q8_K (AVX2 builds)
    """8 int32 lanes, lane l holding 4 neighbouring products of every 32-element chunk times that
    chunk's (or 16-half's) scale; per block fma(d_w*d_a, f32(lane), acc), then hsum_float_8 times the
    IQ power of two. Q6_K takes its unsigned codes and subtracts 32*scale*bsum per lane pair of
    16-sums; the min part sum(min*bsum) * (-dmin*d_a) goes by FMA into a scalar (Q5_K, contracted)
    or into 4 lanes of sub-block pairs (Q4_K), added after the hsum."""
    T, O, nb = len(a.q), len(w.values), w.values.shape[1]
    products = int_dot(w.values, a.q, 4).reshape(T, O, nb, 8, 8)  # [.., chunk, lane]
    lane_scale = np.repeat(w.scales, 8 * w.sub // 32, axis=-1).reshape(O, nb, 8, 8)  # scale per (chunk, lane)
    lanes = (products * lane_scale[None]).sum(3)  # [T, O, nb, 8]
    if w.unsigned_offset:
        pairs = (a.bsums[:, None] * w.scales[None]).reshape(T, O, nb, 8, 2).sum(-1)
        lanes = lanes - w.unsigned_offset * pairs
    scale = w.d[None] * a.d[:, None]
    acc = np.zeros((T, O, 8), F32)
    summs = np.zeros((T, O, w.min_lanes), F32)
    for b in range(nb):
        if w.mins is not None:
            dmin = -a.d[:, None, b] * w.dmin[None, :, b]
            mins = (sub_block_sums(a, 32)[:, None, b] * w.mins[None, :, b]).reshape(T, O, w.min_lanes, -1).sum(-1)
            summs = fma32(dmin[..., None], f32_of(mins), summs)
        acc = fma32(scale[:, :, b, None], f32_of(lanes[:, :, b]), acc)
    out = F32(w.post) * hsum8(acc)
    if w.mins is None:
        return out
    if w.min_lanes == 4:  # Q4_K's __m128 of mins, folded (0+2) + (1+3)
        return out + ((summs[..., 0] + summs[..., 2]) + (summs[..., 1] + summs[..., 3]))
    return out + summs[..., 0]


# ---------------------------------------------------------------------------------------------
# Which kernel a matmul takes (ggml_compute_forward_mul_mat and the CPU extra buffer types)

FLOAT_KERNELS = {  # type -> (activation rounding, (tinyBLAS kernel, its K step), vec_dot kernel)
    "F32": (lambda x: x, (tinyblas, 16), vec_dot_f32),
    "F16": (round_f16, (tinyblas, 16), vec_dot_f16),
    "BF16": (round_bf16, (tinyblas_bf16, 32), vec_dot_bf16),
}


REPACKED = ("Q4_0", "IQ4_NL", "Q4_K", "Q2_K")  # repacked when the row count is a multiple of 8 (AVX512)
REPACK_GEMM_ELEMENTS = {"Q4_K": 64, "Q2_K": 128}  # elements per FMA step of the repacked gemm
TILED = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_XXS", "IQ2_S", "IQ3_XXS")  # tiled kernel from 8 rows
TILED_MIN_ROWS = 8


def mul_mat(x, weights, name, cache):  # x [T, K] f32 -> [T, O]; cache: dict for decoded weights
    kind = weights.type_name(name)
    T = len(x)
    if kind in FLOAT_KERNELS:
        if name not in cache:
            cache[name] = weights.get(name, F32)
        return float_mul_mat(FLOAT_KERNELS[kind][0](x), cache[name], kind)
    if kind not in DECODERS:
        raise GgmlCpuError(f"{name}: {kind} weights are not emulated")
    if name not in cache:
        cache[name] = decode(weights, name)
    w = cache[name]
    repacked = kind in REPACKED and len(w.values) % 8 == 0
    if kind in REPACK_GEMM_ELEMENTS and repacked:
        return k_repacked(x, w, REPACK_GEMM_ELEMENTS[kind])
    if kind in ("Q4_0", "IQ4_NL") and repacked:
        return q0_repacked(w, quantize_q8_0(x))
    if kind in ("Q8_0", "Q5_0", "Q4_0", "IQ4_NL"):
        return q0_lanes(w, quantize_q8_0(x), 2 if kind == "IQ4_NL" and T == 1 else 1)
    if kind == "Q5_1":
        return q5_1_vec_dot(w, quantize_q8_0(x))
    if kind in TILED and T >= TILED_MIN_ROWS:
        return tiled(w, quantize_q8_k(x))
    if kind == "Q2_K":
        raise GgmlCpuError(f"{name}: the Q2_K vec_dot (fewer than 8 rows, not repacked) is not emulated")
    return k_vec_dot(w, quantize_q8_k(x))


def float_mul_mat(x, w, kind):  # x [T, K] (already in the weight's type), w [O, K] f32 -> [T, O]
    """tinyBLAS when llamafile_sgemm takes it (2+ rows, O a multiple of 4, K of its vector step),
    else ggml_vec_dot_* row by row."""
    _, (batched, k_step), single = FLOAT_KERNELS[kind]
    if len(x) >= 2 and len(w) % 4 == 0 and w.shape[1] % k_step == 0:
        return batched(x, w)
    return single(w[None], x[:, None, :])


def k_repacked(x, w, gemm_elements):  # x [T, K] f32, Q4_K/Q2_K rows (repacked) -> [T, O]
    """Rows in groups of 4 take the gemm (activations through the 4x8 quantizer), the last T mod 4
    rows the gemv (activations through quantize_row_q8_K)."""
    n4 = len(x) - len(x) % 4
    parts = []
    if n4:
        parts.append(k_repacked_rows(w, quantize_q8_k(x[:n4], prefer_positive=True), gemm_elements))
    if n4 < len(x):
        parts.append(k_repacked_rows(w, quantize_q8_k(x[n4:]), 256))
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------
# Attention over the KV cells (llama-graph.cpp build_attn_mha, ops.cpp flash_attn_ext)

def n_kv_cells(n_rows):  # rows a layer has filled -> the n_kv the graph reads (llama_kv_cache::get_n_kv)
    return max(256, -(-n_rows // 256) * 256)


def pad_cells(a, n_kv):  # [S, ...] -> [n_kv, ...], zero cells past the filled ones (the cleared buffer)
    return np.concatenate([a, np.zeros((n_kv - len(a),) + a.shape[1:], a.dtype)]) if n_kv > len(a) else a


def attention_mul_mat(q, k, v, visible, scale, kv_type):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """Flash attention off: kq = K.Q (mul_mat), soft_max_ext(kq, F32 mask, scale), kqv = V^T.P."""
    H = q.shape[1]
    group = H // k.shape[1]
    n_kv = n_kv_cells(len(k))
    visible = pad_cells(visible.T, n_kv).T
    if kv_type == "f16":
        k, v = round_f16(k), round_f16(v)
    k, v = pad_cells(k, n_kv), pad_cells(v, n_kv)
    out = np.empty_like(q)
    for h in range(H):
        kh, vh, qh = k[:, h // group], v[:, h // group], q[:, h]
        if kv_type == "f16":  # Q converted to f16 first, then contiguous: the F16 matmul
            kq = float_mul_mat(round_f16(qh), kh, "F16")
        else:  # the permuted Q is not contiguous, so llamafile refuses it: vec_dot_f32 row by row
            kq = vec_dot_f32(qh[:, None, :], kh[None])
        p = soft_max(kq, visible, scale)
        out[:, h] = float_mul_mat(round_f16(p), vh.T, "F16") if kv_type == "f16" else float_mul_mat(p, vh.T, "F32")
    return out


def hadamard_sizes(head_dim):  # -> (K rotation size, V rotation size), or None: llama.cpp's attn_rot
    """A quantized cache rotates when the head size is a multiple of 64: K (and q) by the largest
    power-of-two Hadamard that divides it, V (and the attention output) by 64-element blocks."""
    if head_dim % 64:
        return None
    n_k = 64
    while head_dim % (2 * n_k) == 0:
        n_k *= 2
    return n_k, 64


def fwht(x, n):  # x [..., D] f32, n a power of two dividing D -> [..., D]: each n-element block times H_n
    """ggml_compute_forward_fwht (the CPU's llama_mul_mat_hadamard): the block times 1.0f/sqrtf(n)
    first, then the butterflies (u + v, u - v) with the half-width growing from 1."""
    y = np.asarray(x, F32).reshape(-1, n) * (F32(1) / np.sqrt(F32(n)))
    half = 1
    while half < n:
        y = y.reshape(len(y), n // (2 * half), 2, half)
        y = np.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2)
        half *= 2
    return y.reshape(np.shape(x))


def attention_q8_0(q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """A Q8_0 cache (flash attention on): q, k, v rotated (head sizes multiple of 64), K and V rows
    stored through quantize_row_q8_0, the one-chunk kernel (tiled and KV-split kernels take only F16/F32
    caches) with Q in Q8_0 and V dequantized exactly, the output rotated back."""
    H, D = q.shape[1:]
    if D % 32:
        raise GgmlCpuError(f"a q8_0 KV cache needs a head size that is a multiple of 32, not {D}")
    rotation = hadamard_sizes(D)
    if rotation:
        q, k, v = fwht(q, rotation[0]), fwht(k, rotation[0]), fwht(v, rotation[1])
    heads = np.arange(H) // (H // k.shape[1])
    k_rows = quantize_q8_0(k[:, heads].reshape(-1, D))
    v_rows = quantize_q8_0(v[:, heads].reshape(-1, D))
    # dequantize_row_q8_0: f16 scale times int8 is exact in float32
    v_values = (v_rows.d[..., None] * v_rows.q.astype(F32)).reshape(len(v), H, D).astype(F32)
    out = flash_chunk(q, (k_rows.d.reshape(len(k), H, -1), k_rows.q.reshape(len(k), H, -1, 32)), v_values,
                      visible, scale, range(len(k)), "q8_0")
    return fwht(out, rotation[1]) if rotation else out


FA_TILE = 64  # GGML_FA_TILE_Q = GGML_FA_TILE_KV
FA_SPLIT_MIN_CELLS = 512  # decode rows read cells split across threads from this n_kv on


def attention_flash(q, k, v, visible, scale, n_threads):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """ggml_compute_forward_flash_attn_ext_f16 with K and V in F16 (an F32 cache is cast): the tiled
    kernel for ubatches of 64+ rows, the KV-split one for a single row over 512+ cells, else the
    one-chunk kernel."""
    T, H, D = q.shape
    n_kv = n_kv_cells(len(k))
    heads = np.arange(H) // (H // k.shape[1])
    k, v = round_f16(pad_cells(k, n_kv))[:, heads], round_f16(pad_cells(v, n_kv))[:, heads]  # [n_kv, H, D]
    visible = pad_cells(visible.T, n_kv).T
    if T >= FA_TILE:
        return flash_tiled(q, k, v, visible, scale)
    if T == 1 and n_kv >= FA_SPLIT_MIN_CELLS:
        return flash_split(q, k, v, visible, scale, n_threads)
    return flash_chunk(q, k, v, visible, scale, range(n_kv), "f16")


def flash_normalise(s_sum, acc):  # S [T, H], VKQ [T, H, D] -> [T, H, D]: VKQ * (S == 0 ? 0 : 1/S)
    return acc * np.where(s_sum == 0, F32(0), F32(1) / np.where(s_sum == 0, F32(1), s_sum))[..., None]


def flash_chunk(q, k, v, visible, scale, cells, kv_type, partial=False):  # q [T, H, D] -> [T, H, D]
    """The one-chunk kernel over v [n_kv, H, D] (partial: M [T, H], S [T, H] and the unnormalised
    VKQ [T, H, D]). Cells are visited in order skipping masked ones; the score is the K row's
    vec_dot with Q converted to K's vec_dot type, times scale; an online softmax with glibc expf.
    F16 cache (k [n_kv, H, D]): Q rounded to f16, vec_dot_f16, an f16 V accumulator scaled
    (vec_scale_f16) and accumulated (vec_mad_f16, fused) with a rounding to f16 at every step.
    Q8_0 cache (k = (d [n_kv, H, nb], q [n_kv, H, nb, 32])): Q through quantize_row_q8_0,
    vec_dot_q8_0_q8_0, an f32 accumulator (vec_scale_f32, vec_mad_f32 fused)."""
    T, H, D = q.shape
    if kv_type == "f16":
        q16 = round_f16(q)
        rounding = round_f16
    else:
        q8 = quantize_q8_0(q.reshape(T * H, D))
        q8 = QuantActs(q8.d.reshape(T, H, -1), q8.q.reshape(T, H, -1, 32))
        rounding = np.asarray  # the f32 accumulator keeps every FMA's float32 result
    acc = np.zeros((T, H, v.shape[-1]), F32)
    m = np.full((T, H), -np.inf, F32)
    s_sum = np.zeros((T, H), F32)
    for j in cells:
        live = np.repeat(visible[:, j, None], H, axis=1)
        if not live.any():
            continue
        if kv_type == "f16":
            s = vec_dot_f16(k[j][None], q16) * F32(scale)
        else:
            s = vec_dot_q8_0(QuantActs(k[0][j][None], k[1][j][None]), q8) * F32(scale)
        new_max = live & (s > m)
        grow = live & ~new_max
        with np.errstate(invalid="ignore"):
            ms = np.where(new_max, libm("expf", np.where(new_max, m - s, 0)), F32(1))
            vs = np.where(grow, libm("expf", np.where(grow, s - m, 0)), F32(1))
        m = np.where(new_max, s, m)
        acc = np.where(new_max[..., None], rounding(acc * ms[..., None]), acc)
        acc = np.where(live[..., None], rounding(fma32(v[j][None], vs[..., None], acc)), acc)
        s_sum = np.where(live, fma32(s_sum, ms, vs), s_sum)
    return (m, s_sum, acc) if partial else flash_normalise(s_sum, acc)


def flash_split(q, k, v, visible, scale, n_threads):  # one query row over n_kv >= 512 cells -> [1, H, D]
    """Each thread runs the one-chunk kernel over ceil(n_kv/n_threads) cells; the partials are merged
    with glibc expf and the contracted products VKQ*scale_old + VKQ_chunk*scale_new."""
    n_kv = len(k)
    size = -(-n_kv // n_threads)
    m_all = np.full(q.shape[:2], -np.inf, F32)
    s_all = np.zeros(q.shape[:2], F32)
    acc_all = np.zeros(q.shape[:2] + (v.shape[-1],), F32)
    for start in range(0, n_kv, size):
        m, s_sum, acc = flash_chunk(q, k, v, visible, scale, range(start, min(start + size, n_kv)), "f16", True)
        use = s_sum != 0
        m_new = np.maximum(m_all, m)
        with np.errstate(invalid="ignore"):
            old = libm("expf", np.where(use, m_all - m_new, 0))
            new = libm("expf", np.where(use, m - m_new, 0))
        acc_all = np.where(use[..., None], fma32(acc_all, old[..., None], acc * new[..., None]), acc_all)
        s_all = np.where(use, fma32(s_all, old, s_sum * new), s_all)
        m_all = np.where(use, m_new, m_all)
    return acc_all * np.where(s_all != 0, F32(1) / np.where(s_all != 0, s_all, F32(1)), F32(1))[..., None]


def flash_tiled(q, k, v, visible, scale):  # [T, H, D], [n_kv, H, D] x2 (f16 values), [T, n_kv] -> [T, H, D]
    """The tiled kernel: per 64-cell tile, KQ = f32 Q times the K tile by FMA chains over the head
    dimension (simd_gemm), times scale, plus the mask; the online softmax takes the tile max, rescales
    by glibc expf when it grows, adds the tile's ggml_vec_soft_max_f32 sum (double) to S, and
    VKQ += P.V by FMA chains over the 64 cells."""
    T, H, D = q.shape
    m = np.full((T, H), -np.inf, F32)
    s_sum = np.zeros((T, H), F32)
    acc = np.zeros((T, H, v.shape[-1]), F32)
    for start in range(0, len(k), FA_TILE):
        tile = slice(start, start + FA_TILE)
        live = visible[:, tile]  # [T, 64]
        if not live.any():
            continue
        kq = np.zeros((T, H, FA_TILE), F32)
        for dk in range(D):
            kq = fma32(k[tile, :, dk].T[None], q[:, :, dk, None], kq)
        kq = np.where(live[:, None, :], kq * F32(scale), F32(-np.inf))
        tile_max = kq.max(-1)
        rows = tile_max > -np.inf
        m_new = np.where(rows, np.maximum(m, tile_max), m)
        grow = rows & (m_new > m)
        with np.errstate(invalid="ignore"):
            ms = libm("expf", np.where(grow, m - m_new, 0))
        acc = np.where(grow[..., None], acc * ms[..., None], acc)
        s_sum = np.where(grow, s_sum * ms, s_sum)
        m = m_new
        with np.errstate(invalid="ignore"):
            p = v_expf(kq - np.where(rows, m, 0)[..., None])
        block_sums = hsum16(p.reshape(T, H, -1, 16)).astype(F64)
        total = np.cumsum(block_sums, axis=-1)[..., -1]
        s_sum = np.where(rows, (s_sum.astype(F64) + total).astype(F32), s_sum)
        for kk in range(FA_TILE):
            acc = np.where(rows[..., None], fma32(v[start + kk][None], p[:, :, kk, None], acc), acc)
    return flash_normalise(s_sum, acc)


# ---------------------------------------------------------------------------------------------
# The backend

class GgmlCpuBackend:
    """The backend interface of reference/backend.py plus the element-wise hooks, computing what
    llama.cpp's CPU backend computes. kv_type: "f16" (llama.cpp's default), "f32" or "q8_0" (needs
    flash attention, as in llama.cpp); flash_attn as the llama.cpp context had it (llama-cpp-python's
    default: off); n_threads matters only for the KV-split flash-attention decode. Use a uniform cache
    and prompt chunks of at most UBATCH rows:

        lm = TextModel(gguf.load(path, "text"), backend=GgmlCpuBackend())
        logits = lm.prefill(ids, lm.new_cache(n_ctx, "uniform"), chunk=UBATCH)

    With check_host it warns when this machine's llama.cpp build would round differently."""
    name = "ggml-cpu"

    def __init__(self, kv_type="f16", flash_attn=False, n_threads=2, check_host=True):
        if kv_type not in KV_TYPES:
            raise GgmlCpuError(f"KV cache type {kv_type!r} is not emulated ({', '.join(KV_TYPES)})")
        if kv_type == "q8_0" and not flash_attn:
            raise GgmlCpuError("a q8_0 KV cache needs flash attention "
                               "(llama.cpp refuses a quantized V cache without it)")
        for difference in host_differences() if check_host else ():
            warnings.warn(f"ggml-cpu numerics model {BUILD}; this machine's llama.cpp differs: {difference}",
                          stacklevel=2)
        self.dtype = np.dtype(F32)
        self.kv_type, self.flash_attn, self.n_threads = kv_type, flash_attn, n_threads
        self.decoded = {}

    def linear(self, x, weights, name):  # x [T, in] f32, GGUF tensor name [out, in] -> [T, out]
        return mul_mat(np.ascontiguousarray(x, F32), weights, name, self.decoded)

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        # scale is used as a float32: llama.cpp's kq_scale is 1.0f/sqrtf(head_dim), computed in float32
        q, k, v = (np.asarray(a, F32) for a in (q, k, v))
        if self.kv_type == "q8_0":
            return attention_q8_0(q, k, v, visible, scale)
        if self.flash_attn:
            return attention_flash(q, k, v, visible, scale, self.n_threads)
        return attention_mul_mat(q, k, v, visible, scale, self.kv_type)

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        return rms_norm(np.asarray(x, F32), eps)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return rope_norm(np.asarray(x, F32), theta)

    def sigmoid(self, x):  # [...] -> [...]
        return sigmoid(x)

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        return swiglu(np.asarray(gate, F32), np.asarray(up, F32))

    def softcap(self, z, cap):  # z [...] -> [...]
        return softcap(np.asarray(z, F32), cap)
