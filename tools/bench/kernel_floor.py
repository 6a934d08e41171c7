"""Floor loops: the least work a decode product with float32 activations must do per weight, as
numba compiles it. Each weight's b-bit field is taken out of its packed bytes, converted to float32
and multiply-added into a running sum; there are no scales, no offsets and no super-block
structure, so a real kernel of a b-bit type does all of this and more. Their speed on packed bytes
streamed from memory (the decode case) bounds what any numba kernel of that width can reach here;
`python -m tools.bench_accel ceiling` turns the bounds into tokens/s of a whole model.

The prefill's floor is arithmetic instead: fma_loop runs the float32 FMA peak of the threads, the
vector FMAs the exact mode's GEMM microkernel (quant.gemm_tile) issues with nothing else;
`python -m tools.bench_accel gemm` measures the GEMM against it.

A field is (low >> low_shift) & 15, with (high >> high_shift) & (2^high_bits - 1) above it: 4-bit
values (Q4_K, IQ4_XS, ...) have high_bits 0, 5-bit ones (Q5_K) 1, 6-bit ones (Q6_K) 2, as in
ggml's block layouts. The fields are taken in int8 arithmetic by the decode kernels' own LLVM
intrinsic (quant.field_value): numba widens integer operations to 64 bits, which would leave 8
lanes per vector instead of 16 and make the floor too slow to be one.
"""
import functools
import operator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from accel.numba import quant
from accel.numba.quant import FAST, field_value


def floor_loop(high_bits):  # -> njit(low [R, n/2], high [R, n/4], x [n], out [R]), high_bits a constant
    """Four values per step: both nibbles of low[i] and low[n/4 + i], four 2-bit fields of high[i].
    high_bits is frozen into the loop, so with 0 LLVM drops the high plane entirely. Each value has
    its own running sum: one sum would chain four dependent FMAs a step, and that latency, not the
    work, set the speed of the 4-bit loop (10-20 % slower, measured)."""
    @njit(parallel=True, fastmath=FAST)
    def loop(low, high, x, out):
        m = x.shape[0] // 4
        for r in prange(low.shape[0]):
            lo, hi = low[r], high[r]
            s0 = s1 = s2 = s3 = np.float32(0)
            for i in range(m):
                s0 += field_value(lo[i], 0, hi[i], 0, high_bits, 0) * x[i]
                s1 += field_value(lo[m + i], 0, hi[i], 2, high_bits, 0) * x[m + i]
                s2 += field_value(lo[i], 4, hi[i], 4, high_bits, 0) * x[2 * m + i]
                s3 += field_value(lo[m + i], 4, hi[i], 6, high_bits, 0) * x[3 * m + i]
            out[r] = (s0 + s1) + (s2 + s3)
    return loop


UNIT_SCALES = (np.float32(1),) * 8


def q4_k_step(with_scales):  # -> njit(blocks [R, row_bytes], x [n], out [R], tab): numba's Q4_K decode, in part
    """Where the Q4_K kernel's time goes beyond its floor, a step at a time, on the same blocks:
    without scales, the super-block structure (quant.q45_k_block: the fields of the real blocks,
    four running sums, float64 across super-blocks; a multiply by 1 folds away); with_scales, times
    each sub-block's d * scale as well (quant.k_scales, whose mins LLVM drops as unused). The step
    after is the kernel itself, which also subtracts the mins term (quant.matmul_rows)."""
    @njit(parallel=True, fastmath=FAST)
    def loop(blocks, x, out, tab):
        nsb = x.shape[0] // 256
        xs = x.reshape(nsb, 8, 32)
        for r in prange(blocks.shape[0]):
            blk, acc = blocks[r].reshape(nsb, -1), 0.0
            for sb in range(nsb):
                dl = quant.k_scales(blk, sb, tab)[0] if with_scales else UNIT_SCALES
                acc += np.float64(quant.q45_k_block(blk[sb, 16:], blk[sb], 0, dl, xs[sb]))
            out[r] = acc
    return loop


@njit(cache=True, nogil=True)
def xor_words(words):  # uint64 [n] -> their xor, which no pass can give without reading every byte
    acc = np.uint64(0)
    for w in words:
        acc ^= w
    return acc


def read_floor(words, n_threads):  # uint64 [n] -> their xor, n_threads contiguous parts read at once
    """The least any product of these weights does: read them once. At the release layout the
    weights (9.2 GB) do not stay in any cache, so this pass streams them from memory as a decode
    step does; it is the floor of the block kernels (`python -m tools.bench_accel blocks`). The parts
    run on threads of their own, not in a prange: numba compiles a prange body without the
    vectorised loop it gives the same loop alone (4.5 against 23 GB/s, one thread, measured)."""
    parts = thread_pool(n_threads).map(xor_words, np.array_split(words, n_threads))
    return functools.reduce(operator.xor, parts)


@functools.lru_cache(maxsize=None)
def thread_pool(n_threads):  # -> one pool for every read_floor call: starting threads costs ms, a matrix's read about 1
    return ThreadPoolExecutor(n_threads)


# type -> high_bits of its values; every other type has no floor and counts as free in the bound. (The
# 5-bit floor reads a high plane of n/4 bytes where Q5_K has n/8: the loop is bound by its arithmetic,
# not by memory, at these sizes.)
FLOOR_BITS = {"Q4_0": 0, "Q4_1": 0, "Q4_K": 0, "IQ4_NL": 0, "IQ4_XS": 0, "Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}


def model_bound(weights_per_type, floor_gw_s):  # -> seconds per decoded token at least; floor_gw_s: high_bits -> G/s
    return sum(n / (floor_gw_s[FLOOR_BITS[t]] * 1e9) for t, n in weights_per_type.items() if t in FLOOR_BITS)


FMA_CHAINS = 2 * quant.GEMM_TOKENS  # the vector sums quant.gemm_tile keeps in registers


@intrinsic
def fma_chains(typingctx, steps, seed):  # -> float32: 2 GEMM_TOKENS vector FMA chains of `steps` steps each
    """The float32 FMA peak: as many independent chains of vector FMAs on registers as
    quant.gemm_tile keeps sums (AVX-512: 24 of 16 lanes), no loads or stores; x <- x c + seed
    stays finite (c < 1). Their sum is returned, so no chain is dropped as unused."""
    def codegen(context, builder, signature, args):
        n, s = args
        f32, i32 = ir.FloatType(), ir.IntType(32)
        lanes = quant.VECTOR_BYTES // 4
        vec = ir.VectorType(f32, lanes)
        fma = builder.module.declare_intrinsic(f"llvm.fma.v{lanes}f32", fnty=ir.FunctionType(vec, [vec] * 3))
        one = builder.insert_element(ir.Constant(vec, None), s, ir.Constant(i32, 0))
        spread = builder.shuffle_vector(one, ir.Constant(vec, None), ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))
        factor = ir.Constant(vec, [0.999] * lanes)
        chains = [cgutils.alloca_once_value(builder, builder.fadd(spread, ir.Constant(vec, [float(i)] * lanes)))
                  for i in range(FMA_CHAINS)]
        with cgutils.for_range(builder, n):
            for c in chains:
                builder.store(builder.call(fma, [builder.load(c), factor, spread]), c)
        total = builder.load(chains[0])
        for c in chains[1:]:
            total = builder.fadd(total, builder.load(c))
        return builder.extract_element(total, ir.Constant(i32, 0))
    if isinstance(steps, types.Integer) and seed == types.float32:
        return types.float32(types.int64, types.float32), codegen



@njit(parallel=True)
def fma_loop(steps, out):  # out [n_threads] -> one thread's chains each
    for i in prange(out.shape[0]):
        out[i] = fma_chains(steps, np.float32(i))


def fma_peak_flops(steps, n_threads):  # -> float32 flops of one fma_loop call on n_threads
    return n_threads * steps * FMA_CHAINS * (quant.VECTOR_BYTES // 4) * 2
