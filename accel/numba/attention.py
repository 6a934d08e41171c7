"""Scaled dot-product attention over whatever K/V rows a cache hands out, in numba.

Scores against the visible keys, softmax, weighted sum of V, all in float64 and rounded once, as
reference/ops.py attention does. The mask is all there is to the cache layout: the uniform cache,
the persistent SWA ring (slots out of position order) and the vision tower's windows are the same
kernels with different `visible` matrices. Two routes, as linear's:
- fewer than ROW_BLOCK query rows per kv head (T * H / Hkv; a decode step of a model with fewer than
  16 heads per kv head): one task per (query, head), GQA reading kv head h // (H / Hkv) in place;
- more (prefill, the vision tower, the release's decode with 32 heads over 2): the query rows of
  one kv head in blocks of ROW_BLOCK, each block's scores and weighted sum of V as
  register-blocked products (quant.tile_product) on tiles of KEY_TILE keys widened to float64 as
  they are read. A key row then serves ROW_BLOCK queries instead of one: a global layer of the
  vision tower (5476 queries and keys, 16 heads) attends in 5.4-5.6 s, where one task per (query,
  head) took about 45 s (2 threads, measured). A block reads only the keys from the first to the
  last its queries see, in the cache's own rows: a decode step costs its live window (a
  sliding-window layer's 2048 keys in a 16K-row uniform cache), not the cache.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .quant import FAST, tile_product

ROW_BLOCK = 16  # query rows of one kv head per task: a block's [16, S] scores stay in L2 up to S ~ 8000
KEY_TILE = 64  # keys widened to float64 at a time: 64 KB of K or V^T at head size 128, in L2


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


@njit(cache=True)
def visible_span(visible, t0, t1):  # visible [T, S], queries t0..t1-1 -> (lo, hi): the keys any of them sees
    S = visible.shape[1]
    lo, hi = S, 0
    for t in range(t0, t1):
        s = 0
        while s < lo and not visible[t, s]:
            s += 1
        lo = min(lo, s)
        s = S
        while s > hi and not visible[t, s - 1]:
            s -= 1
        hi = max(hi, s)
    return lo, max(lo, hi)


@njit(cache=True, inline="always")
def widen_tile(rows_of, first, g, n, tile, transposed):  # tile[s, d] (or [d, s]) = rows_of[first + s, g, d] -> n
    for s in range(n):
        for d in range(rows_of.shape[2]):
            if transposed:
                tile[d, s] = rows_of[first + s, g, d]
            else:
                tile[s, d] = rows_of[first + s, g, d]
    return n


@njit(cache=True, fastmath=FAST)
def block_scores(q, g, group, r0, rows, k, lo, scores):  # scores[i, s] = q_i . k[lo + s, g] in float64
    """KEY_TILE key rows at a time widened into a buffer, each a register-blocked product with the
    block's query rows: K is read in place, no copy of the cache."""
    D = q.shape[2]
    qb = np.empty((ROW_BLOCK, D))
    for i in range(rows):
        r = r0 + i
        for d in range(D):
            qb[i, d] = q[r // group, g * group + r % group, d]
    keys = np.empty((KEY_TILE, D))
    for s0 in range(0, scores.shape[1], KEY_TILE):
        n = widen_tile(k, lo + s0, g, min(KEY_TILE, scores.shape[1] - s0), keys, False)
        tile_product(qb, rows, keys[:n], 0, D, scores[:, s0:s0 + n])


@njit(cache=True, fastmath=FAST)
def block_weighted(scores, rows, v, lo, g, weighted):  # weighted[i, :] = sum_s p_is v[lo + s, g, :] in float64
    """V^T a tile of KEY_TILE keys at a time, widened into a buffer: float64 sums within a tile,
    then across tiles."""
    D = v.shape[2]
    values = np.zeros((D, KEY_TILE))
    for s0 in range(0, scores.shape[1], KEY_TILE):
        n = widen_tile(v, lo + s0, g, min(KEY_TILE, scores.shape[1] - s0), values, True)
        tile_product(scores[:, s0:s0 + n], rows, values, 0, n, weighted)


@njit(cache=True, parallel=True)
def attention_blocks(q, k, v, visible, group, scale, out):  # q [T, H, D], k/v [S, Hkv, D], visible [T, S] -> out [T, H, D]
    """Row r = t * group + j of kv head g is query t of head g * group + j. A block reads only the
    keys between the first and the last any of its queries sees (a sliding window's, or a causal
    prefix), from the cache's own rows."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    R = T * group
    n_blocks = (R + ROW_BLOCK - 1) // ROW_BLOCK
    for task in prange(Hkv * n_blocks):
        g, r0 = task // n_blocks, task % n_blocks * ROW_BLOCK
        rows = min(ROW_BLOCK, R - r0)
        lo, hi = visible_span(visible, r0 // group, (r0 + rows - 1) // group + 1)
        scores = np.zeros((ROW_BLOCK, hi - lo))
        block_scores(q, g, group, r0, rows, k, lo, scores)
        totals = softmax_rows(scores, rows, visible[:, lo:hi], r0, group, scale)
        weighted = np.zeros((ROW_BLOCK, D))
        block_weighted(scores, rows, v, lo, g, weighted)
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
    attention_blocks(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), visible, group,
                     float(scale), out)
    return out
