"""Attention over the KV cells (llama-graph.cpp build_attn_mha, ops.cpp flash_attn_ext): the
mul_mat path, the flash-attention kernels, and the Q8_0 cache with its Hadamard rotation."""
from typing import Callable, NamedTuple

import numpy as np

from .build import GgmlCpuError
from .elementwise import block_sums, soft_max
from .float_dots import vec_dot_f16, vec_dot_f32
from .int_dots import vec_dot_q8_0
from .libm import libm, v_expf
from .mul_mat import float_mul_mat, mul_mat
from .quantize import QuantActs, quantize_q8_0
from .rounding import F32, F64, madd, round_f16
from .target import AVX512


CELL_PAD = 256  # llama_kv_cache's n_pad


def n_kv_cells(n_rows):  # rows a layer has filled -> the n_kv the graph reads (llama_kv_cache::get_n_kv)
    return max(CELL_PAD, -(-n_rows // CELL_PAD) * CELL_PAD)


def unseen_cells(visible, n_kv):  # visible [T, S] -> the leading cells no query sees, a multiple of CELL_PAD
    """Below n_kv by CELL_PAD at least. Leaving them out changes no bit of a product: their scores are
    -inf, their weights exact zeros, and every sum over the cells (soft_max's registers, the F16 dots
    over V's cells) keeps its lanes, as CELL_PAD is a multiple of each vector step."""
    seen = visible.any(axis=0)
    first = int(seen.argmax()) if seen.any() else visible.shape[1]
    return min(first // CELL_PAD * CELL_PAD, n_kv - CELL_PAD)


def pad_cells(a, n_kv):  # [S, ...] -> [n_kv, ...], zero cells past the filled ones (the cleared buffer)
    return np.concatenate([a, np.zeros((n_kv - len(a),) + a.shape[1:], a.dtype)]) if n_kv > len(a) else a


def cells_by_head(k, v, n_kv, k_type, v_type):  # k/v [S, Hkv, D] -> K [Hkv, n_kv, D], V^T [Hkv, D, n_kv]
    """The cells as the products read them, each kv head's contiguous: in each side's cache type (F16
    values; F32 and Q8_0 cells as they are, the Q8_0 ones quantized by their product) and zero past
    the filled ones."""
    k = round_f16(k) if k_type == "f16" else k
    v = round_f16(v) if v_type == "f16" else v
    k, v = pad_cells(k, n_kv), pad_cells(v, n_kv)
    return np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 2, 0))


class CacheRows:
    """One KV head's Q8_0 cells served as mul_mat reads a weight matrix (type_name, raw): K.Q of a
    Q8_0 K cache is a Q8_0 mul_mat, its rows the cache's cells."""

    def __init__(self, rows):  # QuantActs of the cells: d [n_kv, nb], q [n_kv, nb, 32]
        d = rows.d.astype(np.float16).view(np.uint8).reshape(*rows.d.shape, 2)  # block_q8_0: f16 d, then 32 int8
        self.blocks = np.concatenate([d, rows.q.astype(np.int8).view(np.uint8)], axis=-1).reshape(len(d), -1)

    def type_name(self, name):
        return "Q8_0"

    def raw(self, name):
        return self.blocks


def attention_mul_mat(q, k, v, visible, scale, kv_type, target=AVX512, kernels=None, cells=True, v_type=None):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """Flash attention off: kq = K.Q (mul_mat), soft_max_ext(kq, F32 mask, scale), kqv = V^T.P (V
    stored transposed, which changes no value). kv_type: K's cache type, and V's unless v_type (each
    product takes its own side's type: f16 or f32; K also q8_0, its cells quantized, with q rotated
    alike where the head size is a multiple of 64). kernels: the module of float_mul_mat, mul_mat,
    vec_dot_f32, soft_max, fwht and quantize_q8_0 (default this emulation's; the numba twin passes its
    own; cells_by_head too). cells: K and V are a KV cache's cells (padded to n_kv_cells), of which
    those before every query's first visible one are left out (unseen_cells: a sliding window's
    step reads its window); False: a graph's tensors, as long as they are (attention_graph)."""
    kernels = kernels or KERNELS
    v_type = v_type or kv_type
    T, H, D = q.shape
    group = H // k.shape[1]
    n_kv = n_kv_cells(len(k)) if cells else len(k)
    if cells:
        skip = unseen_cells(visible, n_kv)
        k, v, visible, n_kv = k[skip:], v[skip:], visible[:, skip:], n_kv - skip
    visible = np.tile(pad_cells(visible.T, n_kv).T, (group, 1))  # the rows of a group's heads, one head after another
    if kv_type == "q8_0" and D % 32:
        raise GgmlCpuError(f"a q8_0 KV cache needs a head size that is a multiple of 32, not {D}")
    rotation = hadamard_sizes(D) if kv_type == "q8_0" else None
    if rotation:  # attn_rot_k: q and k by the largest power-of-two Hadamard dividing the head size
        q, k = kernels.fwht(q, rotation[0]), kernels.fwht(k, rotation[0])
    k_heads, v_heads = kernels.cells_by_head(k, v, n_kv, kv_type, v_type)
    out = np.empty_like(q)
    for g in range(len(k_heads)):  # the heads that share a KV head in one product: ggml's mul_mat takes each
        heads = slice(g * group, (g + 1) * group)  # head's T rows as one batch, hence batch_rows=T
        qg = q[:, heads].transpose(1, 0, 2).reshape(group * T, D)
        kg, vg_t = k_heads[g], v_heads[g]
        if kv_type == "f16":  # Q converted to f16 first, then contiguous: the F16 matmul
            kq = kernels.float_mul_mat(round_f16(qg), kg, "F16", target, batch_rows=T)
        elif kv_type == "q8_0":  # Q converted to Q8_0 (contiguous), each head's T rows one llamafile_sgemm call
            cache = CacheRows(kernels.quantize_q8_0(kg))
            kq = np.concatenate([kernels.mul_mat(qg[i:i + T], cache, "cache_k", {}, False, None, target)
                                 for i in range(0, group * T, T)])
        else:  # the permuted Q is not contiguous, so llamafile refuses it: vec_dot_f32 row by row
            kq = kernels.vec_dot_f32(qg[:, None, :], kg[None], target)
        p = kernels.soft_max(kq, visible, scale, target)
        kqv = (kernels.float_mul_mat(round_f16(p), vg_t, "F16", target, batch_rows=T) if v_type == "f16"
               else kernels.float_mul_mat(p, vg_t, "F32", target, batch_rows=T))
        out[:, heads] = kqv.reshape(group, T, D).transpose(1, 0, 2)
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


def flash_types(k_type, v_type):  # the cache types -> the types ggml_flash_attn_ext reads
    """llama-graph.cpp build_attn_mha casts an F32 K or V to F16 before the flash-attention op."""
    return tuple("f16" if t == "f32" else t for t in (k_type, v_type))


def attention_q8_0(q, k, v, visible, scale, target=AVX512, kernels=None, k_type="q8_0", v_type="q8_0"):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """Flash attention over a cache with a Q8_0 side (k_type, v_type: "q8_0" or "f16", at least one
    "q8_0"). A quantized side is rotated (llama_kv_cache's attn_rot_k, attn_rot_v: head sizes multiple
    of 64; K with q, V with the output rotated back) and stored through quantize_row_q8_0. The
    one-chunk kernel runs (the tiled and KV-split kernels take only equal F16/F32 types): Q in K's
    vec_dot type (Q8_0 or F16); a Q8_0 V dequantized exactly into an f32 accumulator, an F16 V
    accumulated in f16. kernels: the module of fwht, quantize_q8_0 and flash_chunk."""
    kernels = kernels or KERNELS
    H, D = q.shape[1:]
    if D % 32:
        raise GgmlCpuError(f"a q8_0 KV cache needs a head size that is a multiple of 32, not {D}")
    rotation = hadamard_sizes(D)
    rotate_k, rotate_v = (rotation and k_type == "q8_0"), (rotation and v_type == "q8_0")
    if rotate_k:
        q, k = kernels.fwht(q, rotation[0]), kernels.fwht(k, rotation[0])
    if rotate_v:
        v = kernels.fwht(v, rotation[1])
    heads = np.arange(H) // (H // k.shape[1])
    k, v = k[:, heads], v[:, heads]  # [S, H, D]
    if k_type == "q8_0":
        k_rows = kernels.quantize_q8_0(k.reshape(-1, D))
        k = (k_rows.d.reshape(len(k), H, -1), k_rows.q.reshape(len(k), H, -1, 32))
    else:
        k = round_f16(k)
    if v_type == "q8_0":  # dequantize_row_q8_0: f16 scale times int8 is exact in float32
        v_rows = kernels.quantize_q8_0(v.reshape(-1, D))
        v = (v_rows.d[..., None] * v_rows.q.astype(F32)).reshape(v.shape).astype(F32)
    else:
        v = round_f16(v)
    out = kernels.flash_chunk(q, k, v, visible, scale, range(len(v)), k_type, target, v_type=v_type)
    return kernels.fwht(out, rotation[1]) if rotate_v else out


FA_TILE = 64  # GGML_FA_TILE_Q = GGML_FA_TILE_KV
FA_SPLIT_MIN_CELLS = 512  # decode rows read cells split across threads from this n_kv on


def attention_flash(q, k, v, visible, scale, n_threads, target=AVX512, kernels=None):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
    """ggml_compute_forward_flash_attn_ext_f16 with K and V in F16 (an F32 cache is cast): the tiled
    kernel for ubatches of 64+ rows, the KV-split one for a single row over 512+ cells, else the
    one-chunk kernel. kernels: the module of flash_tiled, flash_split and flash_chunk."""
    kernels = kernels or KERNELS
    T, H, D = q.shape
    n_kv = n_kv_cells(len(k))
    heads = np.arange(H) // (H // k.shape[1])
    k, v = round_f16(pad_cells(k, n_kv))[:, heads], round_f16(pad_cells(v, n_kv))[:, heads]  # [n_kv, H, D]
    visible = pad_cells(visible.T, n_kv).T
    if T >= FA_TILE:
        return kernels.flash_tiled(q, k, v, visible, scale, target)
    if T == 1 and n_kv >= FA_SPLIT_MIN_CELLS:
        return kernels.flash_split(q, k, v, visible, scale, n_threads, target)
    return kernels.flash_chunk(q, k, v, visible, scale, range(n_kv), "f16", target)


def flash_normalise(s_sum, acc):  # S [T, H], VKQ [T, H, D] -> [T, H, D]: VKQ * (S == 0 ? 0 : 1/S)
    return acc * np.where(s_sum == 0, F32(0), F32(1) / np.where(s_sum == 0, F32(1), s_sum))[..., None]


def flash_chunk(q, k, v, visible, scale, cells, kv_type, target=AVX512, partial=False, v_type=None):  # q [T, H, D] -> [T, H, D]
    """The one-chunk kernel over v [n_kv, H, D] (partial: M [T, H], S [T, H] and the unnormalised
    VKQ [T, H, D]). Cells are visited in order skipping masked ones; the score is the K row's
    vec_dot with Q converted to K's vec_dot type, times scale; an online softmax with glibc expf.
    kv_type is K's type, and V's unless v_type. F16 K (k [n_kv, H, D]): Q rounded to f16, vec_dot_f16.
    Q8_0 K (k = (d [n_kv, H, nb], q [n_kv, H, nb, 32])): Q through quantize_row_q8_0,
    vec_dot_q8_0_q8_0. F16 V: an f16 accumulator scaled (vec_scale_f16) and accumulated (vec_mad_f16,
    fused) with a rounding to f16 at every step; another V (its values as float32): an f32
    accumulator (vec_scale_f32, vec_mad_f32 fused)."""
    T, H, D = q.shape
    if kv_type == "f16":
        q16 = round_f16(q)
    else:
        q8 = quantize_q8_0(q.reshape(T * H, D))
        q8 = QuantActs(q8.d.reshape(T, H, -1), q8.q.reshape(T, H, -1, 32))
    # the f32 accumulator keeps every FMA's float32 result
    rounding = round_f16 if (v_type or kv_type) == "f16" else np.asarray
    acc = np.zeros((T, H, v.shape[-1]), F32)
    m = np.full((T, H), -np.inf, F32)
    s_sum = np.zeros((T, H), F32)
    for j in cells:
        live = np.repeat(visible[:, j, None], H, axis=1)
        if not live.any():
            continue
        if kv_type == "f16":
            s = vec_dot_f16(k[j][None], q16, target) * F32(scale)
        else:
            s = vec_dot_q8_0(QuantActs(k[0][j][None], k[1][j][None]), q8) * F32(scale)
        new_max = live & (s > m)
        grow = live & ~new_max
        with np.errstate(invalid="ignore"):
            ms = np.where(new_max, libm("expf", np.where(new_max, m - s, 0)), F32(1))
            vs = np.where(grow, libm("expf", np.where(grow, s - m, 0)), F32(1))
        m = np.where(new_max, s, m)
        acc = np.where(new_max[..., None], rounding(acc * ms[..., None]), acc)
        acc = np.where(live[..., None], rounding(madd(v[j][None], vs[..., None], acc, target.fma)), acc)
        s_sum = np.where(live, madd(s_sum, ms, vs, target.fma), s_sum)
    return (m, s_sum, acc) if partial else flash_normalise(s_sum, acc)


def flash_split(q, k, v, visible, scale, n_threads, target=AVX512):  # one query row over n_kv >= 512 cells -> [1, H, D]
    """Each thread runs the one-chunk kernel over ceil(n_kv/n_threads) cells; the partials are merged
    with glibc expf and the contracted products VKQ*scale_old + VKQ_chunk*scale_new."""
    n_kv = len(k)
    size = -(-n_kv // n_threads)
    m_all = np.full(q.shape[:2], -np.inf, F32)
    s_all = np.zeros(q.shape[:2], F32)
    acc_all = np.zeros(q.shape[:2] + (v.shape[-1],), F32)
    for start in range(0, n_kv, size):
        m, s_sum, acc = flash_chunk(q, k, v, visible, scale, range(start, min(start + size, n_kv)), "f16", target,
                                    True)
        use = s_sum != 0
        m_new = np.maximum(m_all, m)
        with np.errstate(invalid="ignore"):
            old = libm("expf", np.where(use, m_all - m_new, 0))
            new = libm("expf", np.where(use, m - m_new, 0))
        acc_all = np.where(use[..., None], madd(acc_all, old[..., None], acc * new[..., None], target.fma), acc_all)
        s_all = np.where(use, madd(s_all, old, s_sum * new, target.fma), s_all)
        m_all = np.where(use, m_new, m_all)
    return acc_all * np.where(s_all != 0, F32(1) / np.where(s_all != 0, s_all, F32(1)), F32(1))[..., None]


def flash_tiled(q, k, v, visible, scale, target=AVX512):  # [T, H, D], [n_kv, H, D] x2 (f16 values), [T, n_kv] -> [T, H, D]
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
            kq = madd(k[tile, :, dk].T[None], q[:, :, dk, None], kq, target.fma)
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
            p = v_expf(kq - np.where(rows, m, 0)[..., None], target.scalef, target.fma)
        total = np.cumsum(block_sums(p, target).astype(F64), axis=-1)[..., -1]
        s_sum = np.where(rows, (s_sum.astype(F64) + total).astype(F32), s_sum)
        for kk in range(FA_TILE):
            acc = np.where(rows[..., None], madd(v[start + kk][None], p[:, :, kk, None], acc, target.fma), acc)
    return flash_normalise(s_sum, acc)


GRAPH_SCORES = 1 << 20  # scores per query block of a graph attention (with vec_dot_f32's [rows, T, D] products: 4 MiB x D)


def attention_graph(q, k, v, visible, scale, flash_attn, target=AVX512, kernels=None):  # [T, H, D] x3, [T, T] -> [T, H, D]
    """An attention inside a graph, over tensors and no KV cache (clip.cpp build_attn): n_kv is the
    graph's own T, not padded cells. Flash attention off: kq = K.Q by vec_dot_f32 (Q is permuted, so
    no tinyBLAS), soft_max_ext with the F32 mask, V^T.P as an F32 mul_mat. On: K, V and the mask cast
    to F16; from 64 query rows (the graph's, not a block's) the tiled kernel, whose last KV tile
    is padded with masked cells, else the one-chunk kernel. Each query row's result depends on its
    own row only, so the rows go in blocks that bound the scores held at once. kernels as for
    attention_mul_mat."""
    kernels = kernels or KERNELS
    T, H, _ = q.shape
    tiled = flash_attn and T >= FA_TILE
    if flash_attn:
        n_kv = -(-len(k) // FA_TILE) * FA_TILE if tiled else len(k)
        k, v = round_f16(pad_cells(k, n_kv)), round_f16(pad_cells(v, n_kv))
        visible = pad_cells(visible.T, n_kv).T
    out = np.empty_like(q)
    rows = max(1, GRAPH_SCORES // (H * len(k)))
    for q0 in range(0, T, rows):
        block = slice(q0, q0 + rows)
        if tiled:
            out[block] = kernels.flash_tiled(q[block], k, v, visible[block], scale, target)
        elif flash_attn:
            out[block] = kernels.flash_chunk(q[block], k, v, visible[block], scale, range(len(k)), "f16", target)
        else:
            out[block] = attention_mul_mat(q[block], k, v, visible[block], scale, "f32", target, kernels, cells=False)
    return out


class AttentionKernels(NamedTuple):
    """The kernels the attention functions call: this module's NumPy ones (KERNELS, unless given
    others), or the numba twins (accel/numba/ggml/attention.py)."""
    cells_by_head: Callable
    fwht: Callable
    quantize_q8_0: Callable
    mul_mat: Callable
    float_mul_mat: Callable
    vec_dot_f32: Callable
    soft_max: Callable
    flash_chunk: Callable
    flash_split: Callable
    flash_tiled: Callable


KERNELS = AttentionKernels(
    cells_by_head=cells_by_head, fwht=fwht, quantize_q8_0=quantize_q8_0, mul_mat=mul_mat,
    float_mul_mat=float_mul_mat, vec_dot_f32=vec_dot_f32, soft_max=soft_max, flash_chunk=flash_chunk,
    flash_split=flash_split, flash_tiled=flash_tiled)
