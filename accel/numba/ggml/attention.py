"""reference/ggml_cpu/attention.py on numba: the flash-attention kernels (one-chunk, KV-split,
tiled) as one compiled loop per query row and head, visiting the cells and rounding as the NumPy
statement does, and the Hadamard transform. attention_mul_mat, attention_flash and attention_q8_0
are the reference's own functions (the cache padding, the f16 rounding of K and V, the head
mapping: array glue) called with this module's kernels: the numba softmax, float matmuls,
vec_dot_f32, quantize_q8_0, fwht and flash kernels."""
import numba
import numpy as np

from reference.ggml_cpu import attention as reference
from reference.ggml_cpu.attention import FA_TILE, AttentionKernels, flash_normalise
from reference.ggml_cpu.rounding import round_f16 as round_f16_array
from reference.ggml_cpu.target import AVX512

from .attention_tiles import LANES, row_attention, tiled_attention
from .elementwise import soft_max
from .float_dots import dot_f16, float_mul_mat, vec_dot_f32
from .libm import EXPF, v_expf_lane
from .mul_mat import mul_mat  # K.Q of a Q8_0 K cache
from .quantize import quantize_q8_0
from .rounding import fma32, hsum8, register_sum, round_f16, sqrt32
from .threads import threaded

F32, F64 = np.float32, np.float64
NEG_INF = F32(-np.inf)
CELL_TILE = 64  # cells a task of head_cells transposes: 32 KB of V at head size 128


@threaded
def head_cells(k, v, n_kv, k_f16, v_f16):  # k/v [S, Hkv, D] -> K [Hkv, n_kv, D], V^T [Hkv, D, n_kv]: reference cells_by_head
    """Tasks of CELL_TILE cells of one kv head: V's tile is read whole from L1 for each row of V^T."""
    S, Hkv, D = k.shape
    k_heads, v_heads = np.zeros((Hkv, n_kv, D), F32), np.zeros((Hkv, D, n_kv), F32)
    n_tiles = (S + CELL_TILE - 1) // CELL_TILE
    for task in numba.prange(Hkv * n_tiles):
        g, s0 = task // n_tiles, task % n_tiles * CELL_TILE
        s1 = min(s0 + CELL_TILE, S)
        for s in range(s0, s1):
            for d in range(D):
                k_heads[g, s, d] = round_f16(k[s, g, d]) if k_f16 else k[s, g, d]
        for d in range(D):
            for s in range(s0, s1):
                v_heads[g, d, s] = round_f16(v[s, g, d]) if v_f16 else v[s, g, d]
    return k_heads, v_heads


def cells_by_head(k, v, n_kv, k_type, v_type):  # k/v [S, Hkv, D] -> K [Hkv, n_kv, D], V^T [Hkv, D, n_kv]: one pass over the cells
    return head_cells(2 * k.size, np.ascontiguousarray(k, F32), np.ascontiguousarray(v, F32), n_kv, k_type == "f16",
                      v_type == "f16")


def attention_mul_mat(q, k, v, visible, scale, kv_type, target=AVX512, v_type=None):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """An F16 cache's products on 16-lane targets, head size a multiple of 16, in attention_tiles'
    kernels over the cells reference attention_mul_mat reads: one query row by vec_dot_f16 over the
    cache in place, more through tinyBLAS in fused blocks; every other case as the reference runs
    it, with this module's kernels."""
    T, _, D = q.shape
    if kv_type == (v_type or kv_type) == "f16" and D % LANES == 0 and target.lanes == LANES:
        n_kv = reference.n_kv_cells(len(k))
        skip = reference.unseen_cells(visible, n_kv)
        visible = reference.pad_cells(np.asarray(visible).T, n_kv).T[:, skip:]
        if T == 1:
            return row_attention(q, k, v, visible[0], scale, skip, n_kv - skip, target)
        return tiled_attention(q, k[skip:], v[skip:], visible, scale, n_kv - skip, target)
    return reference.attention_mul_mat(q, k, v, visible, scale, kv_type, target, KERNELS, v_type=v_type)


@threaded
def fwht_blocks(y):  # f32 [R, n] -> [R, n]: reference fwht of each row
    R, n = y.shape
    norm = F32(1) / sqrt32(F32(n))
    out = np.empty_like(y)
    for r in numba.prange(R):
        row = y[r] * norm
        half = 1
        while half < n:
            for g in range(0, n, 2 * half):
                for i in range(g, g + half):
                    u, w = row[i], row[i + half]
                    row[i], row[i + half] = u + w, u - w
            half *= 2
        out[r] = row
    return out


def fwht(x, n):  # x [..., D] f32, n a power of two dividing D -> [..., D]: reference fwht
    x = np.ascontiguousarray(x, F32)
    return fwht_blocks(x.size * int(np.log2(n)), x.reshape(-1, n)).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Flash attention: the one-chunk kernel (F16 or Q8_0 cache), the KV split, the tiled kernel

@numba.njit(inline="always")
def online_step(s, v_row, m, s_sum, acc, f16_acc):  # one visible cell -> (M, S); VKQ acc [Dv] in place
    """The one-chunk kernel's online softmax: a new maximum rescales VKQ by expf(M - s), else the
    cell's weight is expf(s - M); VKQ += v * weight by FMA (rounded to f16 for an F16 cache)."""
    new_max = s > m
    ms = EXPF(m - s) if new_max else F32(1)
    vs = F32(1) if new_max else EXPF(s - m)
    if new_max:
        m = s
        for i in range(acc.size):
            acc[i] = round_f16(acc[i] * ms) if f16_acc else acc[i] * ms
    for i in range(acc.size):
        acc[i] = round_f16(fma32(v_row[i], vs, acc[i])) if f16_acc else fma32(v_row[i], vs, acc[i])
    return m, fma32(s_sum, ms, vs)


@numba.njit(cache=True, inline="always")
def vec_dot_q8_0(kd, kq, qd, qq, lanes):  # K row d [nb], q [nb, 32], Q row the same, scratch f32 [8] -> f32
    """reference int_dots.vec_dot_q8_0 of one pair: 8 lanes of 4 neighbouring exact products,
    fma(d_k*d_q, lane, acc) block after block, then hsum_float_8."""
    lanes[:] = 0
    for b in range(kd.size):
        scale = kd[b] * qd[b]
        for lane in range(8):
            total = 0
            for i in range(4 * lane, 4 * lane + 4):
                total += np.int32(kq[b, i]) * np.int32(qq[b, i])
            lanes[lane] = fma32(scale, F32(total), lanes[lane])
    return hsum8(lanes)


@threaded
def chunk_f16(q16, k, v, visible, scale, start, stop, lanes, f16_acc):  # q16 [T, H, D] f16 values -> (M [T, H], S [T, H], VKQ)
    T, H, _ = q16.shape
    m, s_sum, acc = np.empty((T, H), F32), np.empty((T, H), F32), np.zeros((T, H, v.shape[-1]), F32)
    for th in numba.prange(T * H):
        t, h = th // H, th % H
        scratch = np.empty((4, 16), F32)
        mt, st = NEG_INF, F32(0)
        for j in range(start, stop):
            if visible[t, j]:
                s = dot_f16(k[j, h], q16[t, h], scratch, lanes) * scale
                mt, st = online_step(s, v[j, h], mt, st, acc[t, h], f16_acc)
        m[t, h], s_sum[t, h] = mt, st
    return m, s_sum, acc


@threaded
def chunk_q8_0(qd, qq, kd, kq, v, visible, scale, start, stop, f16_acc):  # Q and K rows in Q8_0 -> (M, S, VKQ)
    T, H, _ = qd.shape
    m, s_sum, acc = np.empty((T, H), F32), np.empty((T, H), F32), np.zeros((T, H, v.shape[-1]), F32)
    for th in numba.prange(T * H):
        t, h = th // H, th % H
        lanes = np.empty(8, F32)
        mt, st = NEG_INF, F32(0)
        for j in range(start, stop):
            if visible[t, j]:
                s = vec_dot_q8_0(kd[j, h], kq[j, h], qd[t, h], qq[t, h], lanes) * scale
                mt, st = online_step(s, v[j, h], mt, st, acc[t, h], f16_acc)
        m[t, h], s_sum[t, h] = mt, st
    return m, s_sum, acc


def flash_chunk(q, k, v, visible, scale, cells, kv_type, target=AVX512, partial=False, v_type=None):  # q [T, H, D] -> [T, H, D] (reference)
    T, H, D = q.shape
    visible, scale = np.ascontiguousarray(visible, np.bool_), F32(scale)
    f16_acc = (v_type or kv_type) == "f16"
    if kv_type == "f16":
        m, s_sum, acc = chunk_f16(q.size * len(cells), round_f16_array(q), k, v, visible, scale, cells.start,
                                  cells.stop, target.lanes, f16_acc)
    else:
        q8 = quantize_q8_0(q.reshape(T * H, D))
        m, s_sum, acc = chunk_q8_0(q.size * len(cells), q8.d.reshape(T, H, -1), q8.q.reshape(T, H, -1, 32), k[0],
                                   k[1], v, visible, scale, cells.start, cells.stop, f16_acc)
    return (m, s_sum, acc) if partial else flash_normalise(s_sum, acc)


@threaded
def merge_split(m, s_sum, acc):  # the chunks' M, S [C, T, H], VKQ [C, T, H, Dv] -> [T, H, Dv]: reference flash_split
    """Chunk by chunk (those with S != 0): M grows to the larger maximum, VKQ = VKQ*expf(M_old - M)
    + VKQ_chunk*expf(M_chunk - M) and the same for S (contracted into FMAs); finally VKQ / S."""
    C, T, H, Dv = acc.shape
    out = np.empty((T, H, Dv), F32)
    for th in numba.prange(T * H):
        t, h = th // H, th % H
        m_all, s_all, acc_all = NEG_INF, F32(0), np.zeros(Dv, F32)
        for c in range(C):
            if s_sum[c, t, h] == 0:
                continue
            m_new = max(m_all, m[c, t, h])
            old, new = EXPF(m_all - m_new), EXPF(m[c, t, h] - m_new)
            for i in range(Dv):
                acc_all[i] = fma32(acc_all[i], old, acc[c, t, h, i] * new)
            s_all = fma32(s_all, old, s_sum[c, t, h] * new)
            m_all = m_new
        inv = F32(1) / s_all if s_all != 0 else F32(1)
        for i in range(Dv):
            out[t, h, i] = acc_all[i] * inv
    return out


def flash_split(q, k, v, visible, scale, n_threads, target=AVX512):  # one query row over n_kv >= 512 cells -> [1, H, D]
    size = -(-len(k) // n_threads)
    parts = [flash_chunk(q, k, v, visible, scale, range(start, min(start + size, len(k))), "f16", target, True)
             for start in range(0, len(k), size)]
    m, s_sum, acc = (np.stack(part) for part in zip(*parts))
    return merge_split(acc.size, m, s_sum, acc)


@numba.njit(inline="always")
def tile_scores(q_row, k_t, h, start, live, scale, kq):  # KQ of one row over a 64-cell tile -> its max
    """FMA chains over the head dimension (simd_gemm), each cell's in dk order, the 64 cells side by
    side over K transposed (k_t [H, D, n_kv]); times scale, masked cells -inf. The max is np.max's:
    a NaN wins."""
    kq[:] = 0
    for dk in range(q_row.size):
        k_row, qv = k_t[h, dk, start:start + FA_TILE], q_row[dk]
        for c in range(FA_TILE):
            kq[c] = fma32(k_row[c], qv, kq[c])
    tile_max = NEG_INF
    for c in range(FA_TILE):
        kq[c] = kq[c] * scale if live[start + c] else NEG_INF
        if kq[c] > tile_max or kq[c] != kq[c]:
            tile_max = kq[c]
    return tile_max


@numba.njit(inline="always")
def tile_softmax(kq, tile_max, m, s_sum, acc, lanes, scalef):  # a tile's scores -> (M, S); kq becomes P, VKQ rescaled
    """The online softmax over one tile: M grows to the tile max (VKQ and S rescaled by glibc expf
    when it does), P = ggml_v_expf(KQ - M), S += the tile's sum (register by register, in double)."""
    m_new = max(m, tile_max)
    if m_new > m:
        ms = EXPF(m - m_new)
        for i in range(acc.size):
            acc[i] = acc[i] * ms
        s_sum = s_sum * ms
    for c in range(FA_TILE):
        kq[c] = v_expf_lane(kq[c] - m_new, scalef)
    total = 0.0
    for b in range(0, FA_TILE, lanes):
        total += F64(register_sum(kq[b:b + lanes]))
    return m_new, F32(F64(s_sum) + total)


@threaded
def tiled_rows(q, k_t, v, visible, scale, lanes, scalef):  # [T, H, D], K^T [H, D, n_kv], V [n_kv, H, D], [T, n_kv] -> (S, VKQ)
    T, H, _ = q.shape
    s_sum, acc = np.zeros((T, H), F32), np.zeros((T, H, v.shape[-1]), F32)
    for th in numba.prange(T * H):
        t, h = th // H, th % H
        kq = np.empty(FA_TILE, F32)
        a = acc[t, h]
        m, st = NEG_INF, F32(0)
        for start in range(0, v.shape[0], FA_TILE):
            tile_max = tile_scores(q[t, h], k_t, h, start, visible[t], scale, kq)
            if not tile_max > NEG_INF:  # nothing visible in this tile: M, S and VKQ stay
                continue
            m, st = tile_softmax(kq, tile_max, m, st, a, lanes, scalef)
            for c in range(FA_TILE):  # VKQ += P.V, an FMA chain per output over the 64 cells
                v_row = v[start + c, h]
                for i in range(a.size):
                    a[i] = fma32(v_row[i], kq[c], a[i])
        s_sum[t, h] = st
    return s_sum, acc


def flash_tiled(q, k, v, visible, scale, target=AVX512):  # [T, H, D], [n_kv, H, D] x2 (f16 values), [T, n_kv] -> [T, H, D]
    q, visible = np.ascontiguousarray(q, F32), np.ascontiguousarray(visible, np.bool_)
    k_t = np.ascontiguousarray(k.transpose(1, 2, 0))  # [H, D, n_kv]: a tile's cells side by side
    s_sum, acc = tiled_rows(q.size * len(k), q, k_t, v, visible, F32(scale), target.lanes, target.scalef)
    return flash_normalise(s_sum, acc)


def attention_flash(q, k, v, visible, scale, n_threads, target=AVX512):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    return reference.attention_flash(q, k, v, visible, scale, n_threads, target, KERNELS)


def attention_q8_0(q, k, v, visible, scale, target=AVX512, k_type="q8_0", v_type="q8_0"):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    return reference.attention_q8_0(q, k, v, visible, scale, target, KERNELS, k_type, v_type)


KERNELS = AttentionKernels(
    cells_by_head=cells_by_head, fwht=fwht, quantize_q8_0=quantize_q8_0, mul_mat=mul_mat,
    float_mul_mat=float_mul_mat, vec_dot_f32=vec_dot_f32, soft_max=soft_max, flash_chunk=flash_chunk,
    flash_split=flash_split, flash_tiled=flash_tiled)
