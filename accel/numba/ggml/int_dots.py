"""The quantized dot products of reference/ggml_cpu/int_dots.py as numba kernels, one per kernel
family with the same name: the integer sums exact in int32 vector code (loops numba vectorizes, or
LLVM vectors where its loops would not), then each kernel's float epilogue in reference order (one
fma32 per block, lane by lane). Arrays as reference QuantRows / QuantActs hold them; a field a type
lacks is an empty array."""
import numba
import numpy as np
from llvmlite import binding as llvm, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..operands import operands
from .rounding import fma32, hsum8

F32 = np.float32


@numba.njit(cache=True, inline="always")
def whole_block_dot(vs, aq, t, o, b):  # int32 exact sum of value * q over block b, |v| < 2^15, |q| <= 127
    """One loop from 0 to a length read off the array: LLVM vectorizes it with vpmaddwd (a constant
    trip count gets unrolled first and is not; a shifted start keeps numba's negative-index check)."""
    total = np.int32(0)
    for k in range(vs.shape[2]):  # int32 is exact: 256 * (2^15 - 1) * 127 < 2^31
        total = np.int32(total + np.int32(vs[o, b, k]) * np.int32(aq[t, b, k]))
    return total


@numba.njit(cache=True, inline="always")
def scaled_sum(per_sub, sub_sums, t, o, b):  # int32 sum over the sub-blocks of (scale or min) * activation sum
    total = np.int32(0)
    for s in range(sub_sums.shape[2]):  # |per_sub| <= 255, |sum| <= 32 * 127 over at most 16 sub-blocks
        total = np.int32(total + np.int32(per_sub[o, b, s]) * sub_sums[t, b, s])
    return total


TILE = 4  # activation rows per tile_dots call


@numba.njit(cache=True, inline="always")
def tiled_block(s1, d0, dmin, mins, ad, sub_sums, t, o, b, buf):  # -> buf after block b of row t
    r = F32(s1) * d0[o, b]
    if mins.size:
        r = fma32(-dmin[o, b], F32(scaled_sum(mins, sub_sums, t, o, b)), r)
    return fma32(r, ad[t, b], buf)


@numba.njit(cache=True, parallel=True)
def tiled(vs, d0, dmin, mins, aq, ad, sub_sums):  # -> [T, O]: reference tiled on KernelRows (Q2_K, IQ1_S, IQ1_M)
    """vs [O, nb, 256] int16: each value times its sub-block's scale, so s1 = sum(scale * dot) is one
    dot product; these types have no unsigned offset (the others take group_tiled); sub_sums [T, nb,
    256/sub] int32 carry the mins' activation sums. A thread takes whole rows and runs every
    activation row past each, TILE rows per weight load (aq int16: no widening in the loop); the
    weights stream once."""
    O, nb, _ = vs.shape
    T = aq.shape[0]
    tiles = T - T % TILE
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        s1 = np.zeros(TILE, np.int32)
        buf = np.zeros(TILE, F32)
        for t0 in range(0, tiles, TILE):
            buf[:] = 0
            for b in range(nb):
                tile_dots(vs, o, b, aq, t0, TILE, s1)
                for j in range(TILE):
                    buf[j] = tiled_block(np.int64(s1[j]), d0, dmin, mins, ad, sub_sums, t0 + j, o, b, buf[j])
            out[t0:t0 + TILE, o] = buf
        for t in range(tiles, T):
            acc = F32(0)
            for b in range(nb):
                s_t = np.int64(whole_block_dot(vs, aq, t, o, b))
                acc = tiled_block(s_t, d0, dmin, mins, ad, sub_sums, t, o, b, acc)
            out[t, o] = acc
    return out


@numba.njit(cache=True, parallel=True)
def k_repacked_rows(vs, d, dmin, mins, aq, ad, sub_sums, elements_per_fma):  # -> [T, O]
    """sub_sums [T, nb, 256/sub] int32: the activation sums of the sub-blocks."""
    O, nb, bs = vs.shape
    T = aq.shape[0]
    parts = bs // elements_per_fma
    step = sub_sums.shape[2] // parts  # sub-blocks per FMA step
    groups = vs.reshape((O, nb * parts, elements_per_fma))  # each FMA step's elements, one vector dot
    groups_q = aq.reshape((T, nb * parts, elements_per_fma))
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        for t in range(T):
            acc, acc_min = F32(0), F32(0)
            for b in range(nb):
                scale, scale_min = d[o, b] * ad[t, b], dmin[o, b] * ad[t, b]
                for p in range(parts):
                    dots = whole_block_dot(groups, groups_q, t, o, b * parts + p)
                    mn = np.int32(0)
                    for i in range(step):
                        mn = np.int32(mn + np.int32(mins[o, b, p * step + i]) * sub_sums[t, b, p * step + i])
                    acc = fma32(F32(dots), scale, acc)
                    acc_min = fma32(F32(mn), scale_min, acc_min)
            out[t, o] = acc - acc_min
    return out


I16X16, I32X8 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
# vpmaddwd where numba compiles for a CPU with AVX2 (every build ggml-cpu is emulated for); elsewhere the
# same pair sums from generic LLVM vectors
PMADDWD = numba.config.CPU_NAME is None and llvm.get_host_cpu_features().get("avx2", False)


def pair_sums(builder, w, q):  # two <16 x i16> -> <8 x i32>: w[2i]*q[2i] + w[2i+1]*q[2i+1] (vpmaddwd)
    if PMADDWD:
        fn = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(I32X8, [I16X16, I16X16]))
        return builder.call(fn, [w, q])
    wide = ir.VectorType(ir.IntType(32), 16)
    products = builder.mul(builder.sext(w, wide), builder.sext(q, wide))
    even, odd = ([2 * i + h for i in range(8)] for h in (0, 1))
    return builder.add(builder.shuffle_vector(products, products, ir.Constant(I32X8, even)),
                       builder.shuffle_vector(products, products, ir.Constant(I32X8, odd)))


def sixteen_at(builder, row, i):  # elements 16i..16i+15 after row as <16 x i16>
    at = builder.gep(row, [ir.Constant(ir.IntType(64), 16 * i)])
    v = builder.load(builder.bitcast(at, ir.VectorType(at.type.pointee, 16).as_pointer()), align=1)
    return v if at.type.pointee.width == 16 else builder.sext(v, I16X16)


@intrinsic
def chunk_sums(typingctx, w, o, q, t, b, chunks, out):  # out [16] <- pair sums over the chunks c < chunks
    """out[p] = sum over c of w[o, b, 32c + 2p] * q[t, b, 32c + 2p] + (the same at 2p + 1), p < 16:
    the 4 neighbours of lane l are the pairs 2l and 2l + 1. w [O, nb, 32 * chunks], q [T, nb, 32 *
    chunks]: C-contiguous int arrays (int16 or int8), read with no bounds check as LLVM vectors
    (vpmaddwd), int32 exact for chunks <= 8 (8 * 2 * (2^15 - 1) * 127 < 2^31), stored into out's integer
    type; chunks: a constant. numba's own loops keep this sum in memory between chunks and run at half
    the speed."""
    def codegen(context, builder, signature, args):
        a = operands(chunk_sums, context, builder, signature, args)
        w_row, q_row = a.w.element_at([a.o.index(), a.b.index()]), a.q.element_at([a.t.index(), a.b.index()])
        halves = [None, None]  # the pairs of the chunks' first and second 16 elements
        for c in range(chunks.literal_value):
            for h in (0, 1):
                pairs = pair_sums(builder, sixteen_at(builder, w_row, 2 * c + h), sixteen_at(builder, q_row, 2 * c + h))
                halves[h] = pairs if halves[h] is None else builder.add(halves[h], pairs)
        out_data = a.out.view().data
        stored = ir.VectorType(out_data.type.pointee, 8)
        for h, total in enumerate(halves):
            total = builder.sext(total, stored) if stored.element.width > 32 else total
            at = builder.gep(out_data, [ir.Constant(ir.IntType(64), 8 * h)])
            builder.store(total, builder.bitcast(at, stored.as_pointer()), align=1)
        return context.get_dummy_value()
    # numba retries with the literal; any other layout is refused when the kernel compiles
    if isinstance(chunks, types.IntegerLiteral) and all(a.layout == "C" for a in (w, q, out)):
        return types.none(w, o, q, t, b, chunks, out), codegen


@intrinsic
def tile_dots(typingctx, w, o, b, q, t0, tokens, out):  # out[j] <- sum_k w[o, b, k] * q[t0 + j, b, k], j < tokens
    """The tiled kernel's block dot for `tokens` (a constant) activation rows at once: each 16
    weights are loaded once for all of them. w [O, nb, 256], q [T, nb, 256] C-contiguous int16 (or
    int8); int32 exact as whole_block_dot."""
    def codegen(context, builder, signature, args):
        a = operands(tile_dots, context, builder, signature, args)
        b, t0 = a.b.index(), a.t0.index()
        w_row = a.w.element_at([a.o.index(), b])
        q_rows = [a.q.element_at([builder.add(t0, ir.Constant(t0.type, j)), b]) for j in range(tokens.literal_value)]
        acc = [None] * len(q_rows)
        for i in range(16):
            w16 = sixteen_at(builder, w_row, i)
            for j, q_row in enumerate(q_rows):
                pairs = pair_sums(builder, w16, sixteen_at(builder, q_row, i))
                acc[j] = pairs if acc[j] is None else builder.add(acc[j], pairs)
        add_lanes = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [I32X8]),
                                                   "llvm.vector.reduce.add.v8i32")
        out_data = a.out.view().data
        for j, total in enumerate(acc):
            builder.store(builder.call(add_lanes, [total]), builder.gep(out_data, [ir.Constant(ir.IntType(64), j)]))
        return context.get_dummy_value()
    if isinstance(tokens, types.IntegerLiteral) and all(a.layout == "C" for a in (w, q)) and out.dtype == types.int32:
        return types.none(w, o, b, q, t0, tokens, out), codegen


@numba.njit(cache=True, inline="always")
def four_sum(pairs, lane):  # chunk_sums' pairs [16] -> the sum of lane's 4 neighbours 4*lane..4*lane+3
    return pairs[2 * lane] + pairs[2 * lane + 1]


@numba.njit(cache=True, inline="always")
def vec_dot_lanes(vs, aq, t, o, b, chunk, lanes):  # int64 [8] <- the 8 lane sums
    """Lane l holds elements 4l..4l+3 of every 32-element chunk: the chunks' neighbour pairs are
    summed into chunk [>= 16] (int32 or int64), then each lane's 2 pairs. vs [O, nb, 256], aq [T, nb, 256]."""
    chunk_sums(vs, o, aq, t, b, 8, chunk)
    for lane in range(8):
        lanes[lane] = four_sum(chunk, lane)


@numba.njit(cache=True, parallel=True)
def q0_lanes(values, d, aq, ad, accumulators):  # 32-blocks -> [T, O]: reference q0_lanes / q0_accumulate
    O, nb, _ = values.shape
    T = aq.shape[0]
    paired = nb - nb % accumulators
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        acc = np.zeros((2, 8), F32)
        chunk = np.zeros(32, np.int32)
        for t in range(T):
            acc[:] = 0
            for b in range(paired):
                scale = d[o, b] * ad[t, b]
                chunk_sums(values, o, aq, t, b, 1, chunk)  # the block's 16 pair sums
                for lane in range(8):
                    acc[b % accumulators, lane] = fma32(scale, F32(four_sum(chunk, lane)), acc[b % accumulators, lane])
            r = hsum8(acc[0] + acc[1]) if accumulators == 2 else hsum8(acc[0])
            for b in range(paired, nb):
                r = fma32(d[o, b] * ad[t, b], F32(whole_block_dot(values, aq, t, o, b)), r)
            out[t, o] = r
    return out


@numba.njit(cache=True, parallel=True)
def q0_repacked(values, d, aq, ad):  # 32-blocks -> [T, O]: per block fma(f32(isum), f32(d_w*d_a), acc)
    O, nb, _ = values.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        for t in range(T):
            acc = F32(0)
            for b in range(nb):
                acc = fma32(F32(whole_block_dot(values, aq, t, o, b)), d[o, b] * ad[t, b], acc)
            out[t, o] = acc
    return out


@numba.njit(cache=True, parallel=True)
def q5_1_vec_dot(values, d, m, aq, ad, a_s):  # Q5_1 rows, Q8_1 acts -> [T, O]: reference q5_1_vec_dot
    O, nb, _ = values.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        acc = np.zeros(8, F32)
        chunk = np.zeros(32, np.int32)
        for t in range(T):
            acc[:] = 0
            summs = F32(0)
            for b in range(nb):
                summs = fma32(m[o, b], a_s[t, b], summs)
                scale = d[o, b] * ad[t, b]
                chunk_sums(values, o, aq, t, b, 1, chunk)
                for lane in range(8):
                    acc[lane] = fma32(F32(four_sum(chunk, lane)), scale, acc[lane])
            out[t, o] = hsum8(acc) + summs
    return out


@numba.njit(cache=True, parallel=True)
def wide_block_vec_dot(values, d, aq, ad, lanes):  # Q1_0/Q2_0 rows, Q8_0 acts -> [T, O]: reference wide_block_vec_dot
    O, nb, bs = values.shape
    T = aq.shape[0]
    spans, width = bs // 32, 32 // lanes
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        acc = np.zeros(lanes, F32)
        for t in range(T):
            acc[:] = 0
            for b in range(nb):
                for lane in range(lanes):
                    inner = F32(0)
                    for k in range(spans):
                        total = 0
                        for i in range(k * 32 + lane * width, k * 32 + (lane + 1) * width):
                            total += np.int64(values[o, b, i]) * np.int64(aq[t, b * spans + k, i - k * 32])
                        scale = ad[t, b * spans + k]
                        inner = scale * F32(total) if k == 0 else fma32(scale, F32(total), inner)
                    acc[lane] = fma32(d[o, b], inner, acc[lane])
            out[t, o] = hsum8(acc) if lanes == 8 else acc[0]
    return out


@numba.njit(cache=True, inline="always")
def q2_k_block(vs, d, dmin, mins, aq, ad, bsums, t, o, b, chunk, lanes, acc):  # acc [8] <- block b: mins, then codes
    vec_dot_lanes(vs, aq, t, o, b, chunk, lanes)
    dm = -ad[t, b] * dmin[o, b]
    for lane in range(8):
        mn = np.int64(mins[o, b, 2 * lane]) * bsums[t, b, 2 * lane] \
            + np.int64(mins[o, b, 2 * lane + 1]) * bsums[t, b, 2 * lane + 1]
        acc[lane] = fma32(dm, F32(mn), acc[lane])
    scale = ad[t, b] * d[o, b]
    for lane in range(8):
        acc[lane] = fma32(scale, F32(lanes[lane]), acc[lane])


@numba.njit(cache=True, parallel=True)
def q2_k_vec_dot(vs, d, dmin, mins, aq, ad, bsums):  # Q2_K rows (vs: codes times scales), Q8_K acts -> [T, O]
    O, nb, _ = vs.shape
    out = np.zeros((aq.shape[0], O), F32)
    for o in numba.prange(O):
        chunk, lanes, acc = np.zeros(32, np.int64), np.zeros(8, np.int64), np.zeros(8, F32)
        for t in range(aq.shape[0]):
            acc[:] = 0
            for b in range(nb):
                q2_k_block(vs, d, dmin, mins, aq, ad, bsums, t, o, b, chunk, lanes, acc)
            out[t, o] = hsum8(acc)
    return out


@numba.njit(cache=True, inline="always")
def iq1_lanes(vs, scales, sub, aq, t, o, b, grid_lanes, delta_lanes):  # the 8 lane sums of each part
    """vs holds scale * (8 grid + delta): the code comes back by the exact division, then grid and delta
    as reference iq1_vec_dot takes them apart; lane l: elements 4l..4l+3 of every 32-element chunk."""
    grid_lanes[:] = 0
    delta_lanes[:] = 0
    for k in range(vs.shape[2]):
        scale = np.int64(scales[o, b, k // sub])
        code = np.int64(vs[o, b, k]) // scale
        grid = (code + 4) // 8
        q = np.int64(aq[t, b, k])
        grid_lanes[(k % 32) // 4] += scale * grid * q
        delta_lanes[(k % 32) // 4] += scale * (code - 8 * grid) * q


@numba.njit(cache=True, parallel=True)
def iq1_vec_dot(vs, scales, sub, d, aq, ad, delta_lanes):  # IQ1_S/IQ1_M -> [T, O]: reference iq1_vec_dot
    O, nb, _ = vs.shape
    T = aq.shape[0]
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        grid_sums, delta_sums = np.zeros(8, np.int64), np.zeros(8, np.int64)
        acc, acc_delta = np.zeros(8, F32), np.zeros(8, F32)
        for t in range(T):
            acc[:] = 0
            acc_delta[:] = 0
            for b in range(nb):
                iq1_lanes(vs, scales, sub, aq, t, o, b, grid_sums, delta_sums)
                scale = d[o, b] * ad[t, b]
                for lane in range(8):
                    acc[lane] = fma32(scale, F32(grid_sums[lane]), acc[lane])
                    if delta_lanes == 8:
                        acc_delta[lane] = fma32(scale, F32(delta_sums[lane]), acc_delta[lane])
                if delta_lanes == 1:  # IQ1_S: one integer per block into a scalar
                    acc_delta[0] = fma32(scale, F32(delta_sums.sum()), acc_delta[0])
            delta_part = hsum8(acc_delta) if delta_lanes == 8 else acc_delta[0]
            out[t, o] = hsum8(acc) + F32(0.125) * delta_part
    return out


# ---------------------------------------------------------------------------------------------
# The K-quant, IQ and ternary kernels on rows interleaved 16 at a time (mul_mat.GroupRows): one 512-bit
# vpdpbusd takes 4 elements of 16 rows against 4 activation bytes broadcast, 64 int8 products, and the
# float epilogue runs on 16 rows side by side. The integer sums are the same integers as the int16
# kernels'.

GROUP = 16  # weight rows side by side, one int32 lane each
GROUP_TOKENS = 8  # activation rows per group_tiled_block call
I8X64, I32X16 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.IntType(32), 16)
F32X16 = ir.VectorType(ir.FloatType(), 16)
# vpdpbusd where numba compiles for a CPU with AVX512-VNNI (llama.cpp's tiled kernel needs it too);
# elsewhere the same sums from generic LLVM vectors
VPDPBUSD = numba.config.CPU_NAME is None and llvm.get_host_cpu_features().get("avx512vnni", False)


def dpbusd(builder, acc, u, s):  # <16 x i32> + 4-sums of <64 x u8> u times <64 x i8> s, lane by lane
    if VPDPBUSD:
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512",
                                              fnty=ir.FunctionType(I32X16, [I32X16, I8X64, I8X64]))
        return builder.call(fn, [acc, u, s])
    wide = ir.VectorType(ir.IntType(32), 64)
    products = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(products, products, ir.Constant(I32X16, list(range(k, 64, 4)))))
    return acc


def load_at(builder, base, offset, ty):  # the value of LLVM type ty at byte offset after base (i8*)
    at = builder.gep(base, [ir.Constant(ir.IntType(64), offset)])
    return builder.load(builder.bitcast(at, ty.as_pointer()), align=1)


def store_at(builder, base, offset, v):  # the value v at byte offset after base (i8*)
    at = builder.gep(base, [ir.Constant(ir.IntType(64), offset)])
    builder.store(v, builder.bitcast(at, v.type.as_pointer()), align=1)


def int8_row(builder, base, offset):  # 16 int8 at byte offset after base -> <16 x i32>
    return builder.sext(load_at(builder, base, offset, ir.VectorType(ir.IntType(8), 16)), I32X16)


def splat(builder, x, lanes=16):  # an i32 or float scalar -> the vector of `lanes` of it
    vec = ir.VectorType(x.type, lanes)
    one = builder.insert_element(ir.Constant(vec, None), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vec, None), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def vector_fma(builder, a, b, c):  # float vectors -> a * b + c lane by lane, each lane rounded once (llvm.fma)
    fn = builder.module.declare_intrinsic(f"llvm.fma.v{a.type.count}f32", fnty=ir.FunctionType(a.type, [a.type] * 3))
    return builder.call(fn, [a, b, c])


def int_at(builder, base, i):  # the i-th int32 after base (i8*), as a 16-lane vector
    return splat(builder, load_at(builder, base, 4 * i, ir.IntType(32)))


def block_sums(builder, weights, sub_scales, acts, n_lanes, n_sub, biased, parts=False):  # -> (sums[j][l], scales)
    """Block b's scaled dots of 16 rows (weights: codes[g, b] as i8*) against activation rows (acts:
    aq[t, b] as i8* each), summed whole (n_lanes 1), into k_vec_dot's 8 lanes of 4 neighbours of each
    32-chunk (n_lanes 8), or with `parts` into n_lanes consecutive parts of the block (the repacked
    gemm's FMA steps): sums[j][l] lane r = sum over the 4-element chunks c with c % n_lanes == l (with
    parts: c * n_lanes // 64 == l) of scale(c, r) * sum_i aq[t_j, b, 4c + i] * codes[g, b, c, r, i],
    as <16 x i32>. vpdpbusd multiplies
    unsigned by signed bytes: unsigned codes (biased False) take the Q8_K codes as they are, signed ones
    the codes plus 128 (biased True). A sub-block's 4-sums are added unscaled, then multiplied by its
    scales once. int32 exact: |aq * code * scale| <= 255 * 127 * 128 and 256 of them < 2^31."""
    zero = ir.Constant(I32X16, None)
    sums = [[zero] * n_lanes for _ in acts]
    scales = []
    chunks_per_sub = 64 // n_sub
    for s in range(n_sub):
        scales.append(int8_row(builder, sub_scales, 16 * s))
        partial = {}
        for c in range(s * chunks_per_sub, (s + 1) * chunks_per_sub):
            w = load_at(builder, weights, 64 * c, I8X64)
            for j, act in enumerate(acts):
                four = builder.bitcast(int_at(builder, act, c), I8X64)
                key = (j, c * n_lanes // 64 if parts else c % n_lanes)
                previous = partial.get(key, zero)
                partial[key] = dpbusd(builder, previous, four, w) if biased else dpbusd(builder, previous, w, four)
        for (j, lane), p in partial.items():
            sums[j][lane] = builder.add(sums[j][lane], builder.mul(p, scales[s]))
    return sums, scales


def less_offset(builder, value, offset, terms):  # -> value - offset * sum(terms), offset an i32
    """Taken for the types with 16 sub-blocks a block, whose offset is 0 but for Q6_K and TQ1_0/TQ2_0
    (GroupRows refuses an offset with 8): a branch on the offset would split the block step and cost
    the tiled kernel half its speed."""
    total = ir.Constant(I32X16, None)
    for term in terms:
        total = builder.add(total, term)
    return builder.sub(value, builder.mul(splat(builder, offset), total))


def fma_f32x16(builder, a, b, c):  # a * b + c rounded once, lane by lane (vfmadd231ps)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32X16, [F32X16] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


@intrinsic
def group_tiled_block(typingctx, codes, g, b, aq, t0, tokens, subs, scales, lane_bias, offset, mins, sub_sums, d0,
                      dmin, ad, buf):  # buf [tokens, 16] f32 <- after block b: reference tiled's epilogue
    """For each activation row t0 + j: s1 = block_sums less the bias's 128 * sum(scale * code) (lane_bias
    [G, nb, 8, 16] int32, summed; 1-D for unsigned codes) less offset * sum_s scales[g, b, s] *
    sub_sums[t, b, s]; x = f32(s1) * d0[g, b]; with mins (int8 [G, nb, 8, 16]; 1-D when absent)
    x = fma(-dmin[g, b], f32(sum_s mins * sub_sums), x); buf[j] = fma(x, ad[t, b], buf[j]):
    tiled_block's operations on 16 rows at once, each lane rounding as the scalar code does. aq [T, nb,
    256]: uint8 (Q8_K codes + 128) for signed codes, int8 for unsigned; sub_sums [T, nb, nsub] int32,
    d0/dmin [G, nb, 16] f32, ad [T, nb] f32, offset int32."""
    arrays = (codes, aq, scales, lane_bias, mins, sub_sums, d0, dmin, ad, buf)
    if not (all(isinstance(x, types.IntegerLiteral) for x in (tokens, subs)) and all(x.layout == "C" for x in arrays)):
        return None
    n_tokens, n_sub = tokens.literal_value, subs.literal_value
    biased, with_mins = aq.dtype == types.uint8, mins.ndim == 4

    def codegen(context, builder, signature, args):
        a = operands(group_tiled_block, context, builder, signature, args)
        g, b, t0 = a.g.index(), a.b.index(), a.t0.index()
        rows = [builder.add(t0, ir.Constant(t0.type, j)) for j in range(n_tokens)]
        sums, scale_rows = block_sums(builder, a.codes.at([g, b]), a.scales.at([g, b]), [a.aq.at([t, b]) for t in rows],
                                      1, n_sub, biased)
        bias = ir.Constant(I32X16, None)
        for lane in range(8 if biased else 0):
            bias = builder.add(bias, load_at(builder, a.lane_bias.at([g, b]), 64 * lane, I32X16))
        offset = a.offset.int32()
        d0 = load_at(builder, a.d0.at([g, b]), 0, F32X16)
        neg_dmin = builder.fneg(load_at(builder, a.dmin.at([g, b]), 0, F32X16)) if with_mins else None
        buf = a.buf.data()
        for j, t in enumerate(rows):
            subs_t = a.sub_sums.at([t, b])
            s1 = builder.sub(sums[j][0], bias)
            if n_sub == 16:
                s1 = less_offset(builder, s1, offset, [builder.mul(row, int_at(builder, subs_t, s))
                                                       for s, row in enumerate(scale_rows)])
            x = builder.fmul(builder.sitofp(s1, F32X16), d0)
            if with_mins:
                s2 = ir.Constant(I32X16, None)
                for s in range(8):
                    s2 = builder.add(s2, builder.mul(int8_row(builder, a.mins.at([g, b]), 16 * s), int_at(builder, subs_t, s)))
                x = fma_f32x16(builder, neg_dmin, builder.sitofp(s2, F32X16), x)
            ad = builder.load(builder.bitcast(a.ad.at([t, b]), ir.FloatType().as_pointer()))
            store_at(builder, buf, 64 * j, fma_f32x16(builder, x, splat(builder, ad), load_at(builder, buf, 64 * j, F32X16)))
        return context.get_dummy_value()
    return types.none(codes, g, b, aq, t0, tokens, subs, scales, lane_bias, offset, mins, sub_sums, d0, dmin, ad,
                      buf), codegen


@numba.njit(cache=True, parallel=True)
def group_tiled(codes, scales, lane_bias, offset, d0, dmin, mins, aq, ad, sub_sums):  # -> [T, 16 G]
    """reference tiled on GroupRows ([G, nb, ...], 16 rows last), aq [T, nb, 256] (mul_mat.group_acts),
    sub_sums [T, nb, nsub] int32. A thread takes whole groups; each block's 4 KB of codes is read once
    per GROUP_TOKENS activation rows; group_tiled_block does the rest."""
    G, nb = codes.shape[:2]
    T = aq.shape[0]
    wide = scales.shape[2] == 8  # numba's intrinsics take constants from the call's own source only
    out = np.zeros((T, G * GROUP), F32)
    for g in numba.prange(G):
        buf = np.zeros((GROUP_TOKENS, GROUP), F32)
        for t0 in range(0, T, GROUP_TOKENS):
            n = min(GROUP_TOKENS, T - t0)
            buf[:] = 0
            for b in range(nb):
                if n == GROUP_TOKENS and wide:
                    group_tiled_block(codes, g, b, aq, t0, 8, 8, scales, lane_bias, offset, mins, sub_sums, d0, dmin,
                                      ad, buf)
                elif n == GROUP_TOKENS:
                    group_tiled_block(codes, g, b, aq, t0, 8, 16, scales, lane_bias, offset, mins, sub_sums, d0, dmin,
                                      ad, buf)
                else:
                    for j in range(n):
                        row = buf[j:j + 1]
                        if wide:
                            group_tiled_block(codes, g, b, aq, t0 + j, 1, 8, scales, lane_bias, offset, mins,
                                              sub_sums, d0, dmin, ad, row)
                        else:
                            group_tiled_block(codes, g, b, aq, t0 + j, 1, 16, scales, lane_bias, offset, mins,
                                              sub_sums, d0, dmin, ad, row)
            out[t0:t0 + n, g * GROUP:(g + 1) * GROUP] = buf[:n]
    return out


@intrinsic
def group_vec_dot_block(typingctx, codes, g, b, aq, t, subs, min_lanes, scales, lane_bias, offset, bsums, mins,
                        sums32, d, dmin, ad, acc, summs):  # acc [8, 16], summs [4, 16] f32 <- after block b
    """reference k_vec_dot's block step on 16 rows at once: block_sums' 8 lanes less the bias's lane_bias
    [G, nb, 8, 16] (1-D for unsigned codes) are its lane sums of the codes; with an unsigned offset lane
    p loses offset * (scales[2p] * bsums[2p] + scales[2p+1] * bsums[2p+1]) (bsums [T, nb, 16] int32, the
    16-groups' activation sums), as the reference takes it; acc[p] = fma(d[g, b] * ad[t, b], f32(lane
    p), acc[p]). With mins (int8 [G, nb, 8, 16], 1-D when absent): summs[j] = fma(-ad[t, b] *
    dmin[g, b], f32(sum over the min_lanes' share of the 8 sub-blocks of mins * sums32), summs[j]),
    sums32 [T, nb, 8] int32. aq as group_tiled_block's; subs, min_lanes: constants."""
    arrays = (codes, aq, scales, lane_bias, bsums, mins, sums32, d, dmin, ad, acc, summs)
    if not (all(isinstance(x, types.IntegerLiteral) for x in (subs, min_lanes)) and all(x.layout == "C" for x in arrays)):
        return None
    n_sub, n_min_lanes = subs.literal_value, min_lanes.literal_value
    biased, with_mins = aq.dtype == types.uint8, mins.ndim == 4

    def codegen(context, builder, signature, args):
        a = operands(group_vec_dot_block, context, builder, signature, args)
        g, b, t = a.g.index(), a.b.index(), a.t.index()
        sums, scale_rows = block_sums(builder, a.codes.at([g, b]), a.scales.at([g, b]), [a.aq.at([t, b])], 8, n_sub, biased)
        offset = a.offset.int32()
        ad = splat(builder, builder.load(builder.bitcast(a.ad.at([t, b]), ir.FloatType().as_pointer())))
        scale = builder.fmul(load_at(builder, a.d.at([g, b]), 0, F32X16), ad)
        acc, summs = a.acc.data(), a.summs.data()
        bsums = a.bsums.at([t, b])
        for p, lane in enumerate(sums[0]):
            if biased:
                lane = builder.sub(lane, load_at(builder, a.lane_bias.at([g, b]), 64 * p, I32X16))
            if n_sub == 16:  # the reference's offset pairs are the 16-sub-block scales 2p and 2p + 1
                lane = less_offset(builder, lane, offset, [builder.mul(scale_rows[s], int_at(builder, bsums, s))
                                                           for s in (2 * p, 2 * p + 1)])
            store_at(builder, acc, 64 * p, fma_f32x16(builder, scale, builder.sitofp(lane, F32X16),
                                                      load_at(builder, acc, 64 * p, F32X16)))
        if with_mins:
            dm = builder.fmul(builder.fneg(ad), load_at(builder, a.dmin.at([g, b]), 0, F32X16))
            per = 8 // n_min_lanes
            for j in range(n_min_lanes):
                mn = ir.Constant(I32X16, None)
                for i in range(j * per, (j + 1) * per):
                    mn = builder.add(mn, builder.mul(int8_row(builder, a.mins.at([g, b]), 16 * i),
                                                     int_at(builder, a.sums32.at([t, b]), i)))
                store_at(builder, summs, 64 * j, fma_f32x16(builder, dm, builder.sitofp(mn, F32X16),
                                                            load_at(builder, summs, 64 * j, F32X16)))
        return context.get_dummy_value()
    return types.none(codes, g, b, aq, t, subs, min_lanes, scales, lane_bias, offset, bsums, mins, sums32, d, dmin,
                      ad, acc, summs), codegen


@numba.njit(cache=True, parallel=True)
def group_vec_dot(codes, scales, lane_bias, offset, d, dmin, mins, min_lanes, post, aq, ad, bsums, sums32):
    """-> [T, 16 G]: reference k_vec_dot on GroupRows, group_vec_dot_block per block, then per row
    post * hsum_float_8 of the lanes plus the mins' part as the reference folds it."""
    G, nb = codes.shape[:2]
    T = aq.shape[0]
    wide = scales.shape[2] == 8  # numba's intrinsics take constants from the call's own source only
    out = np.zeros((T, G * GROUP), F32)
    for g in numba.prange(G):
        acc = np.zeros((8, GROUP), F32)
        summs = np.zeros((4, GROUP), F32)
        for t in range(T):
            acc[:] = 0
            summs[:] = 0
            for b in range(nb):
                if wide and min_lanes == 4:
                    group_vec_dot_block(codes, g, b, aq, t, 8, 4, scales, lane_bias, offset, bsums, mins, sums32, d,
                                        dmin, ad, acc, summs)
                elif wide:
                    group_vec_dot_block(codes, g, b, aq, t, 8, 1, scales, lane_bias, offset, bsums, mins, sums32, d,
                                        dmin, ad, acc, summs)
                else:
                    group_vec_dot_block(codes, g, b, aq, t, 16, 1, scales, lane_bias, offset, bsums, mins, sums32, d,
                                        dmin, ad, acc, summs)
            for r in range(GROUP):
                x = post * hsum8(acc[:, r])
                if mins.size and min_lanes == 4:  # Q4_K's __m128 of mins, folded (0+2) + (1+3)
                    x = x + ((summs[0, r] + summs[2, r]) + (summs[1, r] + summs[3, r]))
                elif mins.size:
                    x = x + summs[0, r]
                out[t, g * GROUP + r] = x
    return out


@intrinsic
def group_repacked_block(typingctx, codes, g, b, aq, t0, tokens, steps, scales, mins, sub_sums, d, dmin, ad, acc,
                         acc_min):  # acc, acc_min [tokens, 16] f32 <- after block b: reference k_repacked_rows
    """Q4_K (unsigned codes, 8 sub-blocks, mins) in the CPU repack's gemm and gemv: per FMA step p of
    the block's `steps` (4 of 64 elements in the gemm, 1 of 256 in the gemv; a constant) dots =
    block_sums' part p and mn = sum over the step's sub-blocks of mins * sub_sums; acc = fma(f32(dots),
    d[g, b] * ad[t, b], acc), acc_min = fma(f32(mn), dmin[g, b] * ad[t, b], acc_min), 16 rows at once.
    aq [T, nb, 256] int8, mins int8 [G, nb, 8, 16], sub_sums [T, nb, 8] int32."""
    arrays = (codes, aq, scales, mins, sub_sums, d, dmin, ad, acc, acc_min)
    if not (all(isinstance(x, types.IntegerLiteral) for x in (tokens, steps)) and all(x.layout == "C" for x in arrays)):
        return None
    n_tokens, n_steps = tokens.literal_value, steps.literal_value

    def codegen(context, builder, signature, args):
        a = operands(group_repacked_block, context, builder, signature, args)
        g, b, t0 = a.g.index(), a.b.index(), a.t0.index()
        rows = [builder.add(t0, ir.Constant(t0.type, j)) for j in range(n_tokens)]
        sums, _ = block_sums(builder, a.codes.at([g, b]), a.scales.at([g, b]), [a.aq.at([t, b]) for t in rows], n_steps,
                             8, False, parts=True)
        d, dmin = (load_at(builder, x.at([g, b]), 0, F32X16) for x in (a.d, a.dmin))
        acc, acc_min = a.acc.data(), a.acc_min.data()
        per_step = 8 // n_steps
        for j, t in enumerate(rows):
            ad = splat(builder, builder.load(builder.bitcast(a.ad.at([t, b]), ir.FloatType().as_pointer())))
            scale, scale_min = builder.fmul(d, ad), builder.fmul(dmin, ad)
            subs_t = a.sub_sums.at([t, b])
            for p in range(n_steps):
                mn = ir.Constant(I32X16, None)
                for i in range(p * per_step, (p + 1) * per_step):
                    mn = builder.add(mn, builder.mul(int8_row(builder, a.mins.at([g, b]), 16 * i), int_at(builder, subs_t, i)))
                store_at(builder, acc, 64 * j, fma_f32x16(builder, builder.sitofp(sums[j][p], F32X16), scale,
                                                          load_at(builder, acc, 64 * j, F32X16)))
                store_at(builder, acc_min, 64 * j, fma_f32x16(builder, builder.sitofp(mn, F32X16), scale_min,
                                                              load_at(builder, acc_min, 64 * j, F32X16)))
        return context.get_dummy_value()
    return types.none(codes, g, b, aq, t0, tokens, steps, scales, mins, sub_sums, d, dmin, ad, acc, acc_min), codegen


@numba.njit(cache=True, parallel=True)
def group_repacked(codes, scales, mins, d, dmin, aq, ad, sub_sums, elements_per_fma):  # -> [T, 16 G]
    """reference k_repacked_rows on Q4_K GroupRows: group_repacked_block per block, out = acc - acc_min."""
    G, nb = codes.shape[:2]
    T = aq.shape[0]
    gemm = elements_per_fma == 64  # numba's intrinsics take constants from the call's own source only
    out = np.zeros((T, G * GROUP), F32)
    for g in numba.prange(G):
        acc = np.zeros((GROUP_TOKENS, GROUP), F32)
        acc_min = np.zeros((GROUP_TOKENS, GROUP), F32)
        for t0 in range(0, T, GROUP_TOKENS):
            n = min(GROUP_TOKENS, T - t0)
            acc[:] = 0
            acc_min[:] = 0
            for b in range(nb):
                if n == GROUP_TOKENS and gemm:
                    group_repacked_block(codes, g, b, aq, t0, 8, 4, scales, mins, sub_sums, d, dmin, ad, acc, acc_min)
                elif n == GROUP_TOKENS:
                    group_repacked_block(codes, g, b, aq, t0, 8, 1, scales, mins, sub_sums, d, dmin, ad, acc, acc_min)
                else:
                    for j in range(n):
                        row, row_min = acc[j:j + 1], acc_min[j:j + 1]
                        if gemm:
                            group_repacked_block(codes, g, b, aq, t0 + j, 1, 4, scales, mins, sub_sums, d, dmin, ad,
                                                 row, row_min)
                        else:
                            group_repacked_block(codes, g, b, aq, t0 + j, 1, 1, scales, mins, sub_sums, d, dmin, ad,
                                                 row, row_min)
            out[t0:t0 + n, g * GROUP:(g + 1) * GROUP] = acc[:n] - acc_min[:n]
    return out
