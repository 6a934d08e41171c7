"""Flash attention off with an F16 cache, many query rows (reference attention_mul_mat's tinyBLAS
route) as register-tiled kernels: K.Q, the soft_max and V^T.P of a block of query rows in one task,
so neither K.Q nor P is ever held for more than ROW_BLOCK rows.

tinyBLAS<16> forms each output as 16 lanes, lane l an FMA chain over k = l (mod 16) in k order, then
_mm512_reduce_add_ps (hsum16). Both products keep exactly those chains and that tree; only which
output is computed when changes.
- K.Q (a contraction over the head size, 8 steps at 128): 16 cells side by side in a register, one
  register per lane chain, 4 query rows at once; the 16 lanes' chains are added in hsum16's tree
  as registers (vertical adds), so no horizontal sum is left.
- V^T.P (a contraction over the cells): tinyBLAS's own layout, the 16 lanes in a register, 4 rows
  times 4 head dimensions of chains, run CELL_BLOCK cells at a time with the chains kept in memory
  between blocks (the same FMAs in the same order), then hsum16 once per output."""
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..operands import operands
from .elementwise import soft_max_row
from .int_dots import vector_fma
from .float_dots import dot_f16
from .rounding import hsum16, round_f16, vec_reduce
from .threads import threaded

F32 = np.float32
LANES = 16  # tinyBLAS<16, __m512>: the AVX512 targets
QUAD = 4  # query rows (and, in V^T.P, head dimensions) of one register tile
ROW_BLOCK = 32  # query rows of one task: its K.Q scores [32, n_kv] and chains [32, D, 16]
CELL_BLOCK = 256  # cells of V^T one pass of the V^T.P tiles reads: 128 KB at head size 128
PAIRS = (0, 4, 2, 6, 1, 5, 3, 7)  # hsum16's first adds are lanes (p, p + 8): the pairs in its tree's order
VEC = ir.VectorType(ir.FloatType(), LANES)
F32P = ir.FloatType().as_pointer()


def float_at(builder, base, i):  # float* base, intp i -> float* base + i
    return builder.gep(base, [i])


def load_vec(builder, at):  # float* -> <16 x float> from it on
    return builder.load(builder.bitcast(at, VEC.as_pointer()), align=4)


def splat(builder, x):  # float -> <16 x float> of it
    v = builder.insert_element(ir.Constant(VEC, None), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(VEC, None), ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


@intrinsic
def kq_tile(typingctx, q, row, k_tile, out, out_row, cell):
    """out[out_row + i, cell:cell + 16] <- the K.Q of q rows row + i (i < 4) with the tile's 16 cells
    (k_tile [D, 16]: K transposed), each as tinyBLAS sums it: lane l's chain over d = 16s + l, s in
    order, then hsum16's tree, (v8 + v0, ...), (a4 + a0, ...), (b0 + b2) + (b1 + b3)."""
    def codegen(context, builder, signature, args):
        a = operands(kq_tile, context, builder, signature, args)
        intp = ir.IntType(64)
        steps = builder.udiv(a.q.shape(1), ir.Constant(intp, LANES))
        q_rows = [builder.bitcast(a.q.element_at([builder.add(a.row.index(), ir.Constant(intp, i))]), F32P)
                  for i in range(QUAD)]
        tile = builder.bitcast(a.k_tile.data(), F32P)
        chains = {(lane, i): cgutils.alloca_once(builder, VEC) for lane in range(LANES) for i in range(QUAD)}
        pair_sums = {}
        for pair in PAIRS:
            lanes = (pair, pair + 8)
            for key in ((lane, i) for lane in lanes for i in range(QUAD)):
                builder.store(ir.Constant(VEC, [0.0] * LANES), chains[key])
            with cgutils.for_range(builder, steps) as loop:
                for lane in lanes:
                    d = builder.add(builder.mul(loop.index, ir.Constant(intp, LANES)), ir.Constant(intp, lane))
                    k_vec = load_vec(builder, float_at(builder, tile, builder.mul(d, ir.Constant(intp, LANES))))
                    for i in range(QUAD):
                        q_vec = splat(builder, builder.load(float_at(builder, q_rows[i], d)))
                        chain = chains[lane, i]
                        builder.store(vector_fma(builder, q_vec, k_vec, builder.load(chain)), chain)
            for i in range(QUAD):
                pair_sums[pair, i] = builder.fadd(builder.load(chains[pair + 8, i]), builder.load(chains[pair, i]))
        for i in range(QUAD):
            b = [builder.fadd(pair_sums[j + 4, i], pair_sums[j, i]) for j in range(4)]
            total = builder.fadd(builder.fadd(b[0], b[2]), builder.fadd(b[1], b[3]))
            dest = a.out.element_at([builder.add(a.out_row.index(), ir.Constant(intp, i)), a.cell.index()])
            builder.store(total, builder.bitcast(dest, VEC.as_pointer()), align=4)
        return context.get_dummy_value()
    arrays = (q, k_tile, out)
    if all(isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2 and x.layout == "C" for x in arrays):
        return types.none(q, row, k_tile, out, out_row, cell), codegen


@intrinsic
def pv_tile(typingctx, p, row, v_t, dim, start, stop, chains):
    """chains[row + i, dim + j] (i, j < 4: 16 lane sums each) continue tinyBLAS's chains of V^T.P over
    the cells start..stop (multiples of 16): lane l of output (row + i, dim + j) adds p[row + i, c]
    times v_t[dim + j, c] for c = l (mod 16), in c order, one FMA each."""
    def codegen(context, builder, signature, args):
        a = operands(pv_tile, context, builder, signature, args)
        intp = ir.IntType(64)
        p_rows = [builder.bitcast(a.p.element_at([builder.add(a.row.index(), ir.Constant(intp, i))]), F32P)
                  for i in range(QUAD)]
        v_rows = [builder.bitcast(a.v_t.element_at([builder.add(a.dim.index(), ir.Constant(intp, j))]), F32P)
                  for j in range(QUAD)]
        homes = [[builder.bitcast(a.chains.element_at([builder.add(a.row.index(), ir.Constant(intp, i)),
                                                       builder.add(a.dim.index(), ir.Constant(intp, j))]),
                                  VEC.as_pointer()) for j in range(QUAD)] for i in range(QUAD)]
        sums = [[cgutils.alloca_once_value(builder, builder.load(homes[i][j], align=4)) for j in range(QUAD)]
                for i in range(QUAD)]
        start_ = a.start.index()
        steps = builder.udiv(builder.sub(a.stop.index(), start_), ir.Constant(intp, LANES))
        with cgutils.for_range(builder, steps) as loop:
            c = builder.add(start_, builder.mul(loop.index, ir.Constant(intp, LANES)))
            p_vecs = [load_vec(builder, float_at(builder, p_rows[i], c)) for i in range(QUAD)]
            v_vecs = [load_vec(builder, float_at(builder, v_rows[j], c)) for j in range(QUAD)]
            for i in range(QUAD):
                for j in range(QUAD):
                    builder.store(vector_fma(builder, p_vecs[i], v_vecs[j], builder.load(sums[i][j])), sums[i][j])
        for i in range(QUAD):
            for j in range(QUAD):
                builder.store(builder.load(sums[i][j]), homes[i][j], align=4)
        return context.get_dummy_value()
    if (all(isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" for x in (p, v_t, chains))
            and p.ndim == v_t.ndim == 2 and chains.ndim == 3):
        return types.none(p, row, v_t, dim, start, stop, chains), codegen


def f16_vec(builder, x):  # <16 x float> -> the nearest-even halves as floats (vcvtps2ph, vcvtph2ps: numpy's astype)
    return builder.fpext(builder.fptrunc(x, ir.VectorType(ir.HalfType(), LANES)), VEC)


@intrinsic
def f16_row(typingctx, src, dst):  # f32 [n] x2, n a multiple of 16: dst <- src rounded to f16, a register at a time
    def codegen(context, builder, signature, args):
        a = operands(f16_row, context, builder, signature, args)
        intp = ir.IntType(64)
        x, y = builder.bitcast(a.src.data(), F32P), builder.bitcast(a.dst.data(), F32P)
        with cgutils.for_range(builder, builder.udiv(a.src.shape(0), ir.Constant(intp, LANES))) as loop:
            e = builder.mul(loop.index, ir.Constant(intp, LANES))
            builder.store(f16_vec(builder, load_vec(builder, float_at(builder, x, e))),
                          builder.bitcast(float_at(builder, y, e), VEC.as_pointer()), align=4)
        return context.get_dummy_value()
    if all(isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C" for x in (src, dst)):
        return types.none(src, dst), codegen


@threaded
def pack_heads(q, k, v, group, T, rows, n_kv):  # [T, H, D], [S, Hkv, D] x2 -> Q [Hkv, rows, D], K tiles [Hkv, n_kv/16, D, 16], V^T [Hkv, D, n_kv]
    """Everything rounded to f16 (Q converted for the F16 mul_mat; the cache's F16 cells), zero past
    the filled cells and the group's rows (group*T of them, head after head, then padding rows)."""
    S, Hkv, D = k.shape
    q16 = np.zeros((Hkv, rows, D), F32)
    k_tiles, v_t = np.zeros((Hkv, n_kv // LANES, D, LANES), F32), np.zeros((Hkv, D, n_kv), F32)
    n_tiles = (S + LANES - 1) // LANES
    for task in numba.prange(Hkv * n_tiles):
        g, tile = task // n_tiles, task % n_tiles
        for c in range(tile * LANES, min(tile * LANES + LANES, S)):
            for d in range(D):
                k_tiles[g, tile, d, c - tile * LANES] = round_f16(k[c, g, d])
                v_t[g, d, c] = round_f16(v[c, g, d])
    for task in numba.prange(Hkv * group * T):
        g, r = task // (group * T), task % (group * T)
        for d in range(D):
            q16[g, r, d] = round_f16(q[r % T, g * group + r // T, d])
    return q16, k_tiles, v_t


@threaded
def block_products(q16, k_tiles, v_t, visible, scale, T, lanes, scalef):  # -> [Hkv, rows, D]
    """Task (kv head, ROW_BLOCK rows): K.Q tile by tile (each 8 KB tile read from L1 by the block's
    row quads), each row's soft_max and its f16 rounding in place, then V^T.P CELL_BLOCK cells at a
    time over the block's chains, and hsum16 of each output's lanes. Row r is query row r % T."""
    Hkv, rows, D = q16.shape
    n_kv = v_t.shape[2]
    n_blocks = rows // ROW_BLOCK
    out = np.empty((Hkv, rows, D), F32)
    for task in numba.prange(Hkv * n_blocks):
        g, r0 = task // n_blocks, task % n_blocks * ROW_BLOCK
        kq = np.empty((ROW_BLOCK, n_kv), F32)
        for tile in range(n_kv // LANES):
            for i in range(0, ROW_BLOCK, QUAD):
                kq_tile(q16[g], r0 + i, k_tiles[g, tile], kq, i, tile * LANES)
        scratch = np.empty(n_kv, F32)
        for i in range(ROW_BLOCK):
            soft_max_row(kq[i], visible[(r0 + i) % T], scale, lanes, scalef, scratch, kq[i])
            f16_row(kq[i], kq[i])
        chains = np.zeros((ROW_BLOCK, D, LANES), F32)
        for start in range(0, n_kv, CELL_BLOCK):
            stop = min(start + CELL_BLOCK, n_kv)
            for i in range(0, ROW_BLOCK, QUAD):
                for d in range(0, D, QUAD):
                    pv_tile(kq, i, v_t[g], d, start, stop, chains)
        for i in range(ROW_BLOCK):
            for d in range(D):
                out[g, r0 + i, d] = hsum16(chains[i, d])
    return out


def tiled_attention(q, k, v, visible, scale, n_kv, target):  # [T, H, D], [S, Hkv, D] x2 (S <= n_kv), [T, n_kv] -> [T, H, D]
    """reference attention_mul_mat's F16 products (both through tinyBLAS: T >= 2, D a multiple of 16)
    over the cells given (k, v and visible already past the unseen ones)."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    rows = -(-group * T // ROW_BLOCK) * ROW_BLOCK
    q16, k_tiles, v_t = pack_heads(2 * k.size + q.size, np.ascontiguousarray(q, F32), np.ascontiguousarray(k, F32),
                                   np.ascontiguousarray(v, F32), group, T, rows, n_kv)
    out = block_products(rows * n_kv * D * Hkv, q16, k_tiles, v_t, np.ascontiguousarray(visible, np.bool_), F32(scale),
                         T, target.lanes, target.scalef)
    return out[:, :group * T].reshape(Hkv, group, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)


# ---------------------------------------------------------------------------------------------
# One query row (a decode step): both products are vec_dot_f16 (tinyBLAS takes 2+ rows), over the
# cache's own cells, rounded to f16 as they are read: no copy of K or V is made.

STEP_CELLS = 4 * LANES  # vec_dot_f16's step: 4 registers of 16 lanes, cell c in register c // 16 % 4, lane c % 16
ROW_GROUP = 8  # query rows of a V^T.P task: its chains [8, 64, 16] are 32 KB


@intrinsic
def cell_fmas(typingctx, p16, h0, h1, cell, v_row, d0, chains, slot):
    """chains[h - h0, slot] += p16[h, cell] times v_row[d0:d0 + 16] rounded to f16, h0 <= h < h1:
    one FMA per lane, the cell's step of 16 vec_dot_f16 chains side by side."""
    def codegen(context, builder, signature, args):
        a = operands(cell_fmas, context, builder, signature, args)
        values = f16_vec(builder, load_vec(builder, builder.bitcast(a.v_row.element_at([a.d0.index()]), F32P)))
        h0_ = a.h0.index()
        with cgutils.for_range(builder, builder.sub(a.h1.index(), h0_)) as loop:
            weight = splat(builder, builder.load(builder.bitcast(
                a.p16.element_at([builder.add(h0_, loop.index), a.cell.index()]), F32P)))
            home = builder.bitcast(a.chains.element_at([loop.index, a.slot.index()]), VEC.as_pointer())
            builder.store(vector_fma(builder, weight, values, builder.load(home, align=4)), home, align=4)
        return context.get_dummy_value()
    if (all(isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" for x in (p16, v_row, chains))
            and p16.ndim == 2 and v_row.ndim == 1 and chains.ndim == 3):
        return types.none(p16, h0, h1, cell, v_row, d0, chains, slot), codegen


@threaded
def row_scores(q16, k, skip, live, n_kv, group):  # q16 [H, D], cache K [S, Hkv, D] -> K.Q [H, n_kv], 0 past the live cells
    H, D = q16.shape
    Hkv = k.shape[1]
    kq = np.zeros((H, n_kv), F32)
    n_blocks = (live + CELL_BLOCK - 1) // CELL_BLOCK
    for task in numba.prange(Hkv * n_blocks):
        g, c0 = task // n_blocks, task % n_blocks * CELL_BLOCK
        k_row, scratch = np.empty(D, F32), np.empty((4, 16), F32)
        for c in range(c0, min(c0 + CELL_BLOCK, live)):
            f16_row(k[skip + c, g], k_row)
            for h in range(g * group, (g + 1) * group):
                kq[h, c] = dot_f16(q16[h], k_row, scratch, LANES)
    return kq


@threaded
def row_outputs(p16, v, skip, live, group):  # P [H, n_kv] (f16 values), cache V [S, Hkv, D] -> [H, D]
    """vec_dot_f16 of each P row with each V^T row, its 64 chains kept 16 head dimensions side by
    side (a task: one kv head, 16 dimensions, ROW_GROUP rows), cell by cell from the cache; the cells
    past the live ones add zero products, so they are left out."""
    H, n_kv = p16.shape
    D, Hkv = v.shape[2], v.shape[1]
    out = np.empty((H, D), F32)
    n_dims, n_rows = D // LANES, (group + ROW_GROUP - 1) // ROW_GROUP
    for task in numba.prange(Hkv * n_dims * n_rows):
        g, rest = task // (n_dims * n_rows), task % (n_dims * n_rows)
        d0, h0 = rest // n_rows * LANES, g * group + rest % n_rows * ROW_GROUP
        h1 = min(h0 + ROW_GROUP, (g + 1) * group)
        chains = np.zeros((ROW_GROUP, STEP_CELLS, LANES), F32)
        for c in range(live):
            cell_fmas(p16, h0, h1, c, v[skip + c, g], d0, chains, c % STEP_CELLS)
        scratch = np.empty((4, 16), F32)
        for h in range(h0, h1):
            for lane in range(LANES):
                for j in range(4):
                    scratch[j, :] = chains[h - h0, LANES * j:LANES * (j + 1), lane]
                out[h, d0 + lane] = vec_reduce(scratch, LANES)
    return out


@threaded
def row_soft_max(kq, visible, scale, lanes, scalef):  # K.Q [H, n_kv], visible [n_kv] -> P [H, n_kv] f16 values, in place
    for h in numba.prange(kq.shape[0]):
        soft_max_row(kq[h], visible, scale, lanes, scalef, np.empty(kq.shape[1], F32), kq[h])
        f16_row(kq[h], kq[h])
    return kq


@numba.njit(cache=True)
def round_f16_rows(x):  # f32 [R, D] -> [R, D] f16 values
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for d in range(x.shape[1]):
            out[r, d] = round_f16(x[r, d])
    return out


def row_attention(q, k, v, visible, scale, skip, n_kv, target):  # [1, H, D], cache [S, Hkv, D] x2, [n_kv] -> [1, H, D]
    """reference attention_mul_mat's F16 products of one query row over the cells skip .. skip + n_kv."""
    _, H, D = q.shape
    group = H // k.shape[1]
    live = min(len(k) - skip, n_kv)
    q16 = round_f16_rows(np.ascontiguousarray(q[0], F32))
    kq = row_scores(live * D * H, q16, k, skip, live, n_kv, group)
    p16 = row_soft_max(kq.size, kq, np.ascontiguousarray(visible, np.bool_), F32(scale), target.lanes, target.scalef)
    return row_outputs(live * D * H, p16, v, skip, live, group)[None]
