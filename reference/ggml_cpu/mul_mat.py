"""Which kernel a matmul takes (ggml_compute_forward_mul_mat and the CPU extra buffer types)."""
import copy
from typing import Callable, NamedTuple

import numpy as np

from .blocks import DECODERS, decode_rows, row_block
from .build import GgmlCpuError
from .float_dots import tinyblas, tinyblas_bf16, vec_dot_bf16, vec_dot_f16, vec_dot_f32
from .int_dots import k_repacked_rows, k_vec_dot, neon_k_repacked_rows, q0_lanes, q0_repacked, q5_1_vec_dot, tiled
from .int_dots import q2_k_vec_dot, q8_0_pre_avx2, wide_block_vec_dot
from .int_dots import iq1_vec_dot, neon_iq4_nl_vec_dot, neon_k_vec_dot, neon_q1_vec_dot, neon_wide_block_vec_dot
from .int_dots import MMLA_TYPES, mmla_vec_dot
from .quantize import quantize_q8_0, quantize_q8_k
from .rounding import F32, round_bf16, round_f16
from .target import AVX512


FLOAT_KERNELS = {  # type -> (activation rounding, vec_dot kernel)
    "F32": (lambda x: x, vec_dot_f32),
    "F16": (round_f16, vec_dot_f16),
    "BF16": (round_bf16, vec_dot_bf16),
}


REPACK_GEMM_ELEMENTS = {"Q4_K": 64, "Q2_K": 128}  # elements per FMA step of the repacked gemm
TILED = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_XXS", "IQ2_S", "IQ3_XXS",  # tiled kernel from 8 rows
         "IQ2_XS", "IQ3_S", "IQ1_S", "IQ1_M")
TILED_MIN_ROWS = 8
NEON_REPACKED_BY_4 = ("Q4_0", "IQ4_NL", "Q8_0", "Q1_0")  # repacked 4 rows at a time on NEON (repack.cpp:4975-5140)
# The NEON layouts emulated -> ((gemv, gemm) of the dotprod layout, (gemv, gemm) of the i8mm one), each how it adds
# a block's integer I into one float per output (d = d_w*d_a, m = dmin_w*d_a): "fma", acc = fma(f32(I), d, acc)
# (vfmaq_f32, asm fmla); "mla", acc - f32(M)*m where the type has mins, then + f32(I)*d (vmlsq_f32, vmlaq_f32:
# a multiply then an add under GCC, one FMA under clang, Target.mla_fused); "mul_add", acc + f32(I)*d by
# vmulq_f32 then vaddq_f32, a multiply then an add under both; (s, g): fma(f32(I_s), d, acc) per s elements, then
# acc - f32(M_g)*m (vmlsq_f32, as "mla") per g elements; "wide", per 128-block inner = fma(f32(I_k), d_a_k, inner) over its
# four Q8_0 blocks, then acc = fma(inner, d_w, acc) (vfmaq_n_f32 / vfmaq_laneq_f32, vfmaq_f32). Source lines: llama.cpp/ggml/src/ggml-cpu/arch/arm/repack.cpp.
NEON_REPACKED_EPILOGUES = {
    "Q8_0": (("fma", "mla"), ("fma", "fma")),  # q8_0_4x4 / 4x8: 1762, 5134-5137 / 1831, 5283-5286
    "Q4_0": (("fma", "fma"), ("fma", "fma")),  # q4_0_4x4 / 4x8: 278, asm fmla 2102-2114 / 344, asm fmla 2567-2582
    "Q1_0": (("wide", "wide"), ("wide", "wide")),  # q1_0_4x4 / 4x8: 1893-1895, 5358-5367 / 1955-1958, 5444-5453
    "IQ4_NL": (("mla", "mla"), ("mla", "mla")),  # iq4_nl_4x4 on both targets: 509, 3370-3373
    "Q6_K": (("mul_add", "mla"), ("mul_add", "mla")),  # q6_K_8x4 / 8x8: 1500-1504, 4845-4846 / 1699-1705, 5060-5061
    # q4_K_8x4: 696-702, 716-717; 3621-3627, 3646-3648. q4_K_8x8: 846-850, 866-867; 4393-4395
    "Q4_K": (((64, 256), (64, 256)), ((32, 256), "mla")),
    # q5_K_8x4: 1009-1015, 1027-1028; 3850-3856, 3875-3877. q5_K_8x8: 1302-1313; 4640-4642
    "Q5_K": (((64, 256), (64, 256)), ((32, 64), "mla")),
}
NEON_Q8_K_REPACKED = ("Q6_K", "Q4_K", "Q5_K")  # against Q8_K activations (the others Q8_0)


def kernel_path(kind, n_rows, weights, name, repack=True, target=AVX512):  # -> the kernel a matmul of n_rows rows takes
    """"float", "k_repacked", "q0_repacked", "q0_lanes", "q5_1_vec_dot", "wide_block_vec_dot", "tiled",
    "q2_k_vec_dot", "iq1_vec_dot", "k_vec_dot" or a NEON one ("neon_repacked", ...); one decision for this emulation and its numba twin.
    repack: whether llama.cpp loaded the weights into its CPU_REPACK extra buffer (the default;
    llama-cpp-python's use_extra_bufts=False and the tools' --no-repack keep them in plain buffers),
    which takes the target's types (ggml_repack_get_optimal_repack_type,
    llama.cpp/ggml/src/ggml-cpu/repack.cpp:4925-5140: Q2_K only where AVX512 is)."""
    if kind == "BF16" and target.neon:  # NEON's BF16 dots (vbfdotq, armv8.6's BF16) are not read
        raise GgmlCpuError(f"{name}: BF16 weights are not emulated on the {target.name} target")
    if kind in FLOAT_KERNELS:
        return "float"
    if not target.quantized and kind == "Q8_0":  # tinyBLAS_Q0_AVX (AVX, 2+ rows), else the vec_dot's AVX or scalar arm
        return "q0_lanes" if target.avx and target.llamafile and n_rows >= 2 else "q8_0_pre_avx2"
    if not target.quantized:
        raise GgmlCpuError(f"{name}: {kind} weights are not emulated on the {target.name} target (its quantized "
                           "vec_dots take their AVX, SSSE3 or scalar arms; F32, F16, BF16 and Q8_0 weights are)")
    if kind not in DECODERS:
        raise GgmlCpuError(f"{name}: {kind} weights are not emulated")
    group = 4 if target.neon and kind in NEON_REPACKED_BY_4 else 8  # the repacked layout's rows
    repacked = repack and kind in target.repacked and len(weights.raw(name)) % group == 0
    if target.neon and repacked:  # every NEON layout: NEON_REPACKED_EPILOGUES
        return "neon_repacked"
    if kind in REPACK_GEMM_ELEMENTS and repacked:
        return "k_repacked"
    if kind in ("Q4_0", "IQ4_NL") and repacked:
        return "q0_repacked"
    if target.mmla and kind in MMLA_TYPES and mmla_chunks(len(weights.raw(name)), n_rows, name):
        return "mmla_vec_dot"
    if kind == "IQ4_NL" and target.neon:
        return "neon_iq4_nl_vec_dot"
    if kind in ("Q8_0", "Q5_0", "Q4_0", "IQ4_NL"):
        odd_blocks = target.neon and kind == "Q4_0" and weights.shape(name)[1] // 32 % 2
        if odd_blocks and q0_accumulators(kind, n_rows, target) == 2:
            # the NEON vec_dot's odd last block rounds f32(isum)*d_w before d_a (arch/arm/quants.c:584)
            raise GgmlCpuError(f"{name}: Q4_0 rows of an odd number of blocks are not emulated on {target.name}")
        return "q0_lanes"
    if kind in ("Q5_1", "Q4_1"):  # neither tinyBLAS nor the CPU repack takes them: vec_dot at every batch size
        return "neon_q1_vec_dot" if target.neon else "q5_1_vec_dot"
    if kind in ("Q1_0", "Q2_0"):  # vec_dot at every batch size too (Q1_0 is repacked on ARM only)
        return "neon_wide_block_vec_dot" if target.neon else "wide_block_vec_dot"
    if target.tiled and kind in TILED and n_rows >= TILED_MIN_ROWS:
        return "tiled"
    if kind == "Q2_K":
        return "q2_k_vec_dot"
    if target.neon:
        return "neon_k_vec_dot"
    if kind in ("IQ1_S", "IQ1_M"):
        return "iq1_vec_dot"
    return "k_vec_dot"


MUL_MAT_THREADS = 2  # the modelled build's threads: they chunk the vec_dot matmul (BUILD)


def mmla_chunks(n_rows0, n_rows1, name):  # weight rows, batch rows -> whether the i8mm kernels take 2 x 2 rows
    """ggml_compute_forward_mul_mat's chunks (llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c:1414-1463): 16 rows a side (64
    where one side is 1), re-chunked by thread when fewer than 4 per thread; a chunk takes the
    nrc == 2 vec_dot where both its sides and both matrices' row counts are even. Chunks that
    disagree are refused: their outputs would mix the two epilogues."""
    size = 64 if 1 in (n_rows0, n_rows1) else 16
    chunks0, chunks1 = -(-n_rows0 // size), -(-n_rows1 // size)
    if chunks0 * chunks1 < MUL_MAT_THREADS * 4:
        chunks0, chunks1 = (MUL_MAT_THREADS, 1) if n_rows0 > n_rows1 else (1, MUL_MAT_THREADS)
    step0, step1 = -(-n_rows0 // chunks0), -(-n_rows1 // chunks1)
    modes = {n_rows0 % 2 == n_rows1 % 2 == min(step0, n_rows0 - start0) % 2 == min(step1, n_rows1 - start1) % 2 == 0
             for start0 in range(0, n_rows0, step0) for start1 in range(0, n_rows1, step1)}
    if len(modes) > 1:
        raise GgmlCpuError(f"{name}: a {n_rows1}-row batch splits into chunks of both i8mm kernels (not emulated)")
    return modes.pop()


class QuantKernels(NamedTuple):
    """The activation quantizers and integer kernels the kernel paths call (quant_paths): this
    module's NumPy ones (QUANT_KERNELS), or the numba twins (accel/numba/ggml/mul_mat.py). The
    kernels of the ARM and pre-AVX2 targets are None in a set for the AVX2 and AVX512 ones only."""
    quantize_q8_0: Callable
    quantize_q8_k: Callable
    q0_repacked: Callable
    q0_lanes: Callable
    q5_1_vec_dot: Callable
    wide_block_vec_dot: Callable
    q2_k_vec_dot: Callable
    tiled: Callable
    k_vec_dot: Callable
    k_repacked_rows: Callable
    iq1_vec_dot: Callable
    q8_0_pre_avx2: Callable | None = None
    mmla_vec_dot: Callable | None = None
    neon_wide_block_vec_dot: Callable | None = None
    neon_iq4_nl_vec_dot: Callable | None = None
    neon_q1_vec_dot: Callable | None = None
    neon_k_vec_dot: Callable | None = None
    neon_k_repacked_rows: Callable | None = None


def quant_paths(kernels):  # QuantKernels -> {kernel path: (x, type, Target) -> product}
    """The call each path makes, on this module's kernels or the numba twin's. A path quantizes the
    activations x [T, K] once and returns product(rows) -> [T, O], which any block of weight rows
    can take."""
    k = kernels
    return {
        "k_repacked": lambda x, kind, target: k_repacked(x, REPACK_GEMM_ELEMENTS[kind], k),
        "q0_repacked": lambda x, kind, target: bind(k.q0_repacked, k.quantize_q8_0(x)),
        "q0_lanes": lambda x, kind, target: bind(k.q0_lanes, k.quantize_q8_0(x, target),
                                                 q0_accumulators(kind, len(x), target), target),
        "q8_0_pre_avx2": lambda x, kind, target: bind(k.q8_0_pre_avx2, k.quantize_q8_0(x, target), target),
        "q5_1_vec_dot": lambda x, kind, target: bind(k.q5_1_vec_dot, k.quantize_q8_0(x)),
        "mmla_vec_dot": lambda x, kind, target: bind(
            k.mmla_vec_dot,
            k.quantize_q8_k(x, target=target) if kind in ("Q4_K", "Q6_K") else k.quantize_q8_0(x, target),
            kind, target.mla_fused),
        "neon_repacked": lambda x, kind, target: neon_repacked(x, kind, target, k),
        "neon_wide_block_vec_dot": lambda x, kind, target: bind(k.neon_wide_block_vec_dot, k.quantize_q8_0(x, target),
                                                                target),
        "neon_iq4_nl_vec_dot": lambda x, kind, target: bind(k.neon_iq4_nl_vec_dot, k.quantize_q8_0(x, target)),
        "neon_q1_vec_dot": lambda x, kind, target: bind(k.neon_q1_vec_dot, k.quantize_q8_0(x, target), kind, target),
        "wide_block_vec_dot": lambda x, kind, target: bind(k.wide_block_vec_dot, k.quantize_q8_0(x),
                                                           8 if kind == "Q1_0" else 1),
        "q2_k_vec_dot": lambda x, kind, target: bind(k.q2_k_vec_dot, k.quantize_q8_k(x, target=target), target),
        "tiled": lambda x, kind, target: bind(k.tiled, k.quantize_q8_k(x)),
        "k_vec_dot": lambda x, kind, target: bind(k.k_vec_dot, k.quantize_q8_k(x)),
        "neon_k_vec_dot": lambda x, kind, target: bind(k.neon_k_vec_dot, k.quantize_q8_k(x, target=target), kind),
        "iq1_vec_dot": lambda x, kind, target: bind(k.iq1_vec_dot, k.quantize_q8_k(x), 8 if kind == "IQ1_M" else 1),
    }


def bind(kernel, acts, *args):  # a kernel (rows, acts, *args) -> [T, O], quantized activations -> product(rows)
    return lambda rows: kernel(rows, acts, *args)


def stacked(products):  # products of consecutive activation rows -> product(rows) of all of them, [T, O]
    return lambda rows: np.concatenate([product(rows) for product in products])


def neon_repacked(x, kind, target, kernels):  # x [T, K] f32, a NEON_REPACKED_EPILOGUES type -> product(rows)
    """CPU repack on NEON (q8_0_4x4/4x8, q4_0_4x4/4x8, q1_0_4x4/4x8, iq4_nl_4x4, q4_K/q5_K/q6_K_8x4/8x8): rows in
    groups of 4 take the gemm, the last T mod 4 rows the gemv. Every kernel forms exact integers per
    block and weight row (Q4_0's codes sit in the high nibble, 16 I, which scvtf #4 / vcvtq_n_f32_s32(., 4)
    divides exactly; Q6_K's codes less 32 per bsum) and adds them into one float per output as
    NEON_REPACKED_EPILOGUES says. The 32-block layouts quantize as quantize_row_q8_0 (repack.cpp:69-110,
    137-220 take 1/d as the NEON quantizer does); the Q8_K ones as quantize_row_q8_K, on NEON by the
    generic ggml_quantize_mat_q8_K_4x4/4x8 (llama.cpp/ggml/src/ggml-cpu/repack.cpp:211-310: the first
    element of largest |x|, nearest_int of iscale*x contracted as in quantize_row_q8_K_ref)."""
    epilogues = NEON_REPACKED_EPILOGUES[kind][target.mmla]
    k_quant = kind in NEON_Q8_K_REPACKED

    def product(rows, epilogue):  # activation rows, an epilogue -> product(weight rows)
        a = kernels.quantize_q8_k(rows, target=target) if k_quant else kernels.quantize_q8_0(rows, target)
        if epilogue == "fma":
            return bind(kernels.q0_repacked, a)
        if epilogue == "wide":
            return bind(kernels.wide_block_vec_dot, a, 1)
        if epilogue in ("mla", "mul_add"):
            return bind(kernels.mmla_vec_dot, a, kind if k_quant else "Q8_0", epilogue == "mla" and target.mla_fused)
        return bind(kernels.neon_k_repacked_rows, a, *epilogue, target)

    n4 = len(x) - len(x) % 4
    parts = []
    if n4:
        parts.append(product(x[:n4], epilogues[1]))
    if n4 < len(x):
        parts.append(product(x[n4:], epilogues[0]))
    return stacked(parts)


def q0_accumulators(kind, n_rows, target):  # -> the float accumulators of the Q0 kernel a batch of n_rows takes
    """x86: one (tinyBLAS_Q0_AVX, the AVX2 vec_dots) but for the IQ4_NL vec_dot's two. NEON: one in
    tinyBLAS_Q0_ARM (Q8_0 and Q4_0 in batches of 2+ rows where llamafile is built,
    llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp:4041-4097), two in every vec_dot."""
    if target.neon:
        return 1 if target.llamafile and n_rows >= 2 and kind in ("Q8_0", "Q4_0") else 2
    return 2 if kind == "IQ4_NL" and n_rows == 1 else 1


def mul_mat(x, weights, name, cache, repack=True, cache_bytes=None, target=AVX512):  # x [T, K] f32 -> [T, O]
    """cache: dict of decoded weights; a quantized matrix is kept in it while the dict would hold at
    most cache_bytes (None: DECODED_CACHE_BYTES), else decoded per call; float ones are always kept."""
    kind = weights.type_name(name)
    path = kernel_path(kind, len(x), weights, name, repack, target)
    if path == "float":
        return float_weight_mul_mat(x, weights, name, cache, lambda x, w, kind: float_mul_mat(x, w, kind, target))
    product = QUANT_PATHS[path](x, kind, target)
    return bounded_mul_mat(len(weights.raw(name)), name, cache, cache_bytes,
                           lambda start, stop: decode_rows(weights, name, start, stop),
                           lambda rows: by_row_blocks(lambda start, stop: product(row_block(rows, start, stop)),
                                                      len(rows.values), len(x) * x.shape[1]))


def float_weight_mul_mat(x, weights, name, cache, product):  # x [T, K] f32, an F32/F16/BF16 tensor -> [T, O]
    """Activations rounded to the weight's type, the weights kept as float32; product: float_mul_mat
    here, its numba twin in accel/numba/ggml."""
    kind = weights.type_name(name)
    if name not in cache:
        cache[name] = np.ascontiguousarray(weights.get(name, F32))
    return product(FLOAT_KERNELS[kind][0](x), cache[name], kind)


def float_mul_mat(x, w, kind, target=AVX512, batch_rows=None):  # x [T, K] (already in the weight's type), w [O, K] f32 -> [T, O]
    """tinyBLAS when llamafile_sgemm takes it (the target's fewest rows, O a multiple of 4, K of its
    vector step: the target's lanes, its F16 lanes for F16, twice the lanes for vdpbf16ps), else
    ggml_vec_dot_* row by row. batch_rows: the rows of x one llamafile_sgemm call sees (one attention
    head's, where x stacks several heads; None: all of x). Either way each output is its own dot."""
    dpbf16 = kind == "BF16" and target.dpbf16
    step = target.f16_lanes if kind == "F16" else target.lanes * (2 if dpbf16 else 1)
    min_rows = target.sgemm_min_rows(kind)
    if (target.llamafile and min_rows is not None and (batch_rows or len(x)) >= min_rows and len(w) % 4 == 0
            and w.shape[1] % step == 0):
        product = (lambda rows: tinyblas_bf16(x, rows)) if dpbf16 else \
            (lambda rows: tinyblas(x, rows, target, kind == "F16"))
    else:
        product = lambda rows: FLOAT_KERNELS[kind][1](rows[None], x[:, None, :], target)
    return by_row_blocks(lambda start, stop: product(w[start:stop]), len(w), len(x) * w.shape[1])


def k_repacked(x, gemm_elements, kernels):  # x [T, K] f32 -> product(Q4_K/Q2_K rows, repacked) -> [T, O]
    """Rows in groups of 4 take the gemm (activations through the 4x8 quantizer), the last T mod 4
    rows the gemv (activations through quantize_row_q8_K); kernels: QuantKernels."""
    n4 = len(x) - len(x) % 4
    parts = []
    if n4:
        parts.append(bind(kernels.k_repacked_rows, kernels.quantize_q8_k(x[:n4], prefer_positive=True), gemm_elements))
    if n4 < len(x):
        parts.append(bind(kernels.k_repacked_rows, kernels.quantize_q8_k(x[n4:]), 256))
    return stacked(parts)


QUANT_KERNELS = QuantKernels(
    quantize_q8_0=quantize_q8_0, quantize_q8_k=quantize_q8_k, q0_repacked=q0_repacked, q0_lanes=q0_lanes,
    q5_1_vec_dot=q5_1_vec_dot, wide_block_vec_dot=wide_block_vec_dot, q2_k_vec_dot=q2_k_vec_dot, tiled=tiled,
    k_vec_dot=k_vec_dot, k_repacked_rows=k_repacked_rows, iq1_vec_dot=iq1_vec_dot, q8_0_pre_avx2=q8_0_pre_avx2,
    mmla_vec_dot=mmla_vec_dot, neon_wide_block_vec_dot=neon_wide_block_vec_dot,
    neon_iq4_nl_vec_dot=neon_iq4_nl_vec_dot, neon_q1_vec_dot=neon_q1_vec_dot, neon_k_vec_dot=neon_k_vec_dot,
    neon_k_repacked_rows=neon_k_repacked_rows)
QUANT_PATHS = quant_paths(QUANT_KERNELS)


# Decoded weights kept between calls: the mid-size benchmark models (4.5 GiB decoded) fit, and beside the
# 30B model's 9 GB file, mapped, the process stays under 16 GB.
DECODED_CACHE_BYTES = 5 << 30
# Rows decoded at a time, a multiple of the repacked 8-row groups. A block's int16 arrays (256 x 19968 x 2 B =
# 10 MB) stay under glibc's 32 MB mmap threshold, so the allocator reuses them instead of mapping and
# faulting in fresh pages on every call: 1024-row blocks took 1.6x as long per decoded token.
STREAM_ROWS = 256
# Elements of T x weight rows x K one NumPy product computes at a time: its temporaries take at most
# 24/width bytes an element (int_dot's float64 sums, their int64 copy and the scaled copy, per `width`
# products; 4 the narrowest), 384 MB, plus the block's weights as float64, at most 8 bytes an element
# (T >= 1), whatever the batch. A whole Q6_K head of the release vocabulary as float64 is 10.7 GB.
PRODUCT_ELEMENTS = 1 << 26
PRODUCT_ROWS = 16  # blocks of weight rows keep repacked groups of 8 and the i8mm pairs whole
STREAMED = "streamed"  # the cache's entry for a matrix decoded per call


def by_row_blocks(product, n_rows, row_elements):  # product(start, stop) -> [T, stop - start]; -> [T, n_rows]
    """The NumPy kernels hold temporaries of T x weight rows x (up to) K elements (int_dot's float64
    and int64 partial sums, tinyBLAS's float64 FMAs, vec_dot's broadcast operands) and the weights as
    float64: a whole 512-row ubatch against a 19968-row matrix of the mid-size model would be 17 GB a
    copy, and one row against its 202048-row output head 10.7 GB. So a product takes its weight rows
    a block at a time, about PRODUCT_ELEMENTS of T x rows x K (row_elements: T x K). Every kernel
    computes each output column from its own weight row alone, and a block is a multiple of
    PRODUCT_ROWS rows, so the blocks give the same bits as one product."""
    step = max(PRODUCT_ROWS, PRODUCT_ELEMENTS // max(row_elements, 1) // PRODUCT_ROWS * PRODUCT_ROWS)
    if step >= n_rows:
        return product(0, n_rows)
    return np.concatenate([product(start, min(start + step, n_rows)) for start in range(0, n_rows, step)], axis=1)


def bounded_mul_mat(n_rows, name, cache, cache_bytes, decode, multiply):  # -> [T, n_rows]
    """decode(start, stop) -> the decoded rows [start, stop); multiply(rows) -> [T, stop - start].
    A matrix is decoded once and kept while the cache has room for it (first come, first kept: a
    forward reads the matrices in order, so evicting would only make every later one miss too);
    one that does not fit is decoded STREAM_ROWS rows at a time on every call. Every kernel path
    computes each output column from its own weight row alone (a repacked group of 8 rows stays
    whole), so both ways give the same bits."""
    entry = cache.get(name)
    if entry is None:
        probe = min(n_rows, 16)  # whole repacked groups of 8 and numba's GroupRows of 16
        need = decoded_bytes(decode(0, probe)) * n_rows // probe
        room = (DECODED_CACHE_BYTES if cache_bytes is None else cache_bytes) - sum(map(decoded_bytes, cache.values()))
        entry = cache[name] = decode_whole(decode, n_rows) if need <= room else STREAMED
    if entry is not STREAMED:
        return multiply(entry)
    return np.concatenate([multiply(decode(start, min(start + STREAM_ROWS, n_rows)))  # one block alive at a time
                           for start in range(0, n_rows, STREAM_ROWS)], axis=1)


def decoded_bytes(entry):  # a cache entry (array, decoded rows or STREAMED) -> the bytes its arrays hold
    if isinstance(entry, np.ndarray):
        return entry.nbytes
    return sum(a.nbytes for a in vars(entry).values() if isinstance(a, np.ndarray)) if entry is not STREAMED else 0


def decode_whole(decode, n_rows):  # -> the decoded matrix, filled in STREAM_ROWS row blocks
    """Decoding 200k rows in one call would hold the decoders' temporaries (wider integer copies of
    every code) for all of them: several times the result. The arrays whose first axis is the
    block's rows are allocated once and filled block by block; the rest are the first block's."""
    first = decode(0, min(STREAM_ROWS, n_rows))
    step = getattr(first, "group", 1)  # rows per entry of the first axis: numba's GroupRows hold 16
    block_rows = -(-STREAM_ROWS // step) * step  # whole groups, so no padding lands inside the matrix
    if block_rows != STREAM_ROWS:
        first = decode(0, min(block_rows, n_rows))
    if n_rows <= block_rows:
        return first
    whole = copy.copy(first)
    keys = [key for key, a in vars(first).items()  # absent fields are empty and stay as they are
            if isinstance(a, np.ndarray) and a.size and len(a) == block_rows // step]
    for key in keys:
        a = getattr(first, key)
        setattr(whole, key, np.empty((-(-n_rows // step),) + a.shape[1:], a.dtype))
    for start in range(0, n_rows, block_rows):
        block = first if start == 0 else decode(start, min(start + block_rows, n_rows))
        for key in keys:
            getattr(whole, key)[start // step:(start + block_rows) // step] = getattr(block, key)
    if hasattr(first, "rows"):  # a row count of its own beside padded groups
        whole.rows = n_rows
    return whole
