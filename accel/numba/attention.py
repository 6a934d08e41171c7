"""Scaled dot-product attention over whatever K/V rows a cache hands out, in numba.

Scores against the visible keys, softmax, weighted sum of V, all in float64 and rounded once, as
reference/ops.py attention does. The mask is all there is to the cache layout: the uniform cache,
the persistent SWA ring (slots out of position order) and the vision tower's windows are the same
kernels with different `visible` matrices. Two routes, as linear's:
- fewer than ROW_BLOCK query rows per kv head (T * H / Hkv; a decode step of a model with fewer than
  16 heads per kv head): one task per (query, head), GQA reading kv head h // (H / Hkv) in place;
- more (prefill, the vision tower, the release's decode with 32 heads over 2): the query rows of
  one kv head in blocks of ROW_BLOCK, each block's scores and weighted sum of V as two
  register-blocked products (quant.tile_product) on float64 copies of K and V^T. A key row then
  serves ROW_BLOCK queries instead of one: a global layer of the vision tower (5476 queries and
  keys, 16 heads) attends in 5.4-5.6 s, where one task per (query, head) took about 45 s (2
  threads, measured).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .quant import FAST, tile_product

ROW_BLOCK = 16  # query rows of one kv head per task: a block's [16, S] scores stay in L2 up to S ~ 8000


@njit(cache=True, fastmath=FAST)
def dot64(a, b):  # a [D], b [D] -> sum a * b in float64
    s = 0.0
    for j in range(a.shape[0]):
        s += np.float64(a[j]) * np.float64(b[j])
    return s


@njit(cache=True, fastmath=FAST)
def add_scaled(acc, p, v):  # acc [D] += p * v [D], in float64
    for j in range(acc.shape[0]):
        acc[j] += p * np.float64(v[j])


@njit(cache=True, parallel=True)
def attention_kernel(q, k, v, visible, scale, out):  # q [T, H, D], k/v [S, Hkv, D], visible [T, S] -> out [T, H, D]
    T, H, D = q.shape
    S, group = k.shape[0], H // k.shape[1]
    for task in prange(T * H):
        t, h = task // H, task % H
        kv = h // group
        scores = np.empty(S, np.float64)
        best = -np.inf
        for s in range(S):
            if visible[t, s]:
                scores[s] = dot64(q[t, h], k[s, kv]) * scale
                best = max(best, scores[s])
        acc = np.zeros(D, np.float64)
        total = 0.0
        if best > -np.inf:  # a row with no visible key gives 0, as ops.softmax does
            for s in range(S):
                if visible[t, s]:
                    p = np.exp(scores[s] - best)
                    total += p
                    add_scaled(acc, p, v[s, kv])
        for j in range(D):
            out[t, h, j] = acc[j] / total if total > 0 else 0.0


LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # fdlibm's split: k * LN2_HI is exact


@intrinsic
def float64_of_bits(typingctx, bits):  # int64 -> the float64 with these bits
    def codegen(context, builder, signature, args):
        (bits_,) = args
        return builder.bitcast(bits_, ir.DoubleType())
    return types.float64(types.int64), codegen


@njit(cache=True, fastmath=FAST)
def exp_nonpositive(x):  # float64 x <= 0 or NaN -> exp(x) within 2 ulp; 0 from -708 down, where exp(x) < 3.31e-308
    """2^k e^r with |r| <= ln2 / 2, e^r by its Taylor series to r^13 (truncation 4e-18): a
    polynomial that LLVM vectorises, where a libm call takes one score at a time (0.7 against 4.7 ns
    a score, measured). Below -708 the term is lost beside the row's largest, exp(0) = 1."""
    k = np.floor(max(x, -708.0) * LOG2E + 0.5)  # -1021 .. 0: 2^k is a normal float64
    r = (x - k * LN2_HI) - k * LN2_LO
    p = ((((((((((((1 / 6227020800 * r + 1 / 479001600) * r + 1 / 39916800) * r + 1 / 3628800) * r
                  + 1 / 362880) * r + 1 / 40320) * r + 1 / 5040) * r + 1 / 720) * r + 1 / 120) * r
              + 1 / 24) * r + 1 / 6) * r + 0.5) * r + 1.0) * r + 1.0
    two_k = float64_of_bits((np.int64(k) + 1023) << 52)
    if x != x:  # NaN (a NaN or inf score, as the reference's inf - inf) stays NaN
        return x
    return p * two_k if x > -708.0 else 0.0


@njit(cache=True, fastmath={"reassoc"})
def softmax_rows(scores, rows, visible, r0, group, scale):  # scores [ROW_BLOCK, S] -> exp(scale s - max) in place; -> sums [ROW_BLOCK]
    """Each score scaled and rounded once, then less its row's largest, as ops.softmax takes them: no
    contraction here, which would fuse the two into fma(s, scale, -max), and the largest would then
    be off 0 by its own rounding (up to 32 ulp in its exp, and unbounded for huge scores)."""
    totals = np.zeros(ROW_BLOCK)
    for i in range(rows):
        t = (r0 + i) // group
        for s in range(scores.shape[1]):
            scores[i, s] *= scale
        best = -np.inf
        for s in range(scores.shape[1]):
            if visible[t, s]:
                best = max(best, scores[i, s])
        total = 0.0  # a local, not totals[i]: a store that may alias scores would keep the loop scalar
        for s in range(scores.shape[1]):  # a row with no visible key gives 0, as ops.softmax does
            p = exp_nonpositive(scores[i, s] - best) if visible[t, s] else 0.0
            scores[i, s] = p
            total += p
        totals[i] = total
    return totals


@njit(cache=True, parallel=True)
def attention_blocks(qg, kg, vtg, visible, group, scale, out):  # qg [Hkv, T*group, D], kg [Hkv, S, D], vtg [Hkv, D, S] float64 -> out [T, H, D]
    """Row r = t * group + j of kv head g is query t of head g * group + j."""
    Hkv, R, D = qg.shape
    S = kg.shape[1]
    n_blocks = (R + ROW_BLOCK - 1) // ROW_BLOCK
    for task in prange(Hkv * n_blocks):
        g, r0 = task // n_blocks, task % n_blocks * ROW_BLOCK
        rows = min(ROW_BLOCK, R - r0)
        scores = np.zeros((ROW_BLOCK, S))
        tile_product(qg[g, r0:r0 + rows], rows, kg[g], 0, D, scores)  # scores[i, s] = q_i . k_s
        totals = softmax_rows(scores, rows, visible, r0, group, scale)
        weighted = np.zeros((ROW_BLOCK, D))
        tile_product(scores, rows, vtg[g], 0, S, weighted)  # weighted[i, d] = sum_s p_is v_sd
        for i in range(rows):
            t, h = (r0 + i) // group, g * group + (r0 + i) % group
            for d in range(D):
                out[t, h, d] = 0.0 if totals[i] == 0 else weighted[i, d] / totals[i]  # a NaN total stays NaN


def attention(q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] bool -> [T, H, D]
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    out = np.empty(q.shape, q.dtype)
    visible = np.ascontiguousarray(visible)
    group = H // Hkv  # query heads per kv head
    if T * group < ROW_BLOCK:
        attention_kernel(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                         visible, float(scale), out)
        return out
    qg = np.ascontiguousarray(q.reshape(T, Hkv, group, D).transpose(1, 0, 2, 3), np.float64).reshape(Hkv, -1, D)
    kg = np.ascontiguousarray(k.transpose(1, 0, 2), np.float64)
    vtg = np.ascontiguousarray(v.transpose(1, 2, 0), np.float64)
    attention_blocks(qg, kg, vtg, visible, group, float(scale), out)
    return out
