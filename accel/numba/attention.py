"""Scaled dot-product attention over whatever K/V rows a cache hands out, in numba.

One task per (query, head): scores against the visible keys, softmax, weighted sum of V, all in
float64 and rounded once, as reference/ops.py attention does. GQA reads kv head h // (H / Hkv)
in place, so K and V are never repeated. The mask is all there is to the cache layout: the uniform
cache, the persistent SWA ring (slots out of position order) and the vision tower's windows are
the same kernel with different `visible` matrices.
"""
import numpy as np
from numba import njit, prange

from .quant import FAST


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


def attention(q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] bool -> [T, H, D]
    out = np.empty(q.shape, q.dtype)
    attention_kernel(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                     np.ascontiguousarray(visible), float(scale), out)
    return out
