"""One launcher per kernel of accel/cuda: device arrays and shapes in, grid and block sizes chosen
here, results written into the arrays given. An array whose rows are a strided view (a column
slice of a fused QKV product) passes its row stride; the last axis is always contiguous."""
import numpy as np

from . import kernels

MATVEC_MAX_TOKENS = 4   # up to this many rows of x, each weight row is read per token (decode)
# The decode kernel's shape (matmul.cu, matvec): output rows per block and warps splitting each row.
# Chosen by `python -m accel.cuda_harness tune` on an H200, best over the release's matrices.
MATVEC_ROWS = 4
MATVEC_WARPS = 4
MATVEC_BLOCKS = 2048  # at most: a block loops over row groups, its shared IQ tables copied once
MAX_HEAD_DIM = 256      # ATT_MAX_D, HEAD_MAX_D in the kernels
ATT_THREADS = 512       # attention.cu's block size


class DeviceTensor:
    """A GGUF matrix [n_out, n_in] as its raw blocks in device memory."""

    def __init__(self, rt, w):  # w: gguf.Tensor
        self.name, self.qtype = w.name, w.tensor_type
        self.n_out, self.n_in = w.shape
        host = np.ascontiguousarray(w.raw).view(np.uint8).reshape(self.n_out, -1)
        self.row_bytes = host.shape[1]
        self.data = rt.to_device(host)


def supported(w):  # gguf.Tensor -> can the kernels multiply it?
    return w.tensor_type in kernels.KERNEL_TYPES and len(w.shape) == 2 and w.shape[1] % 8 == 0


def cdiv(a, b):  # ceil(a / b) for ints
    return (a + b - 1) // b


def row_stride(a):  # [rows, n] with contiguous rows -> elements between rows
    assert a.ndim == 2 and a.strides[1] == a.itemsize, "rows must be contiguous"
    return a.strides[0] // a.itemsize


def linear(rt, x, t, y, tables):  # x [T, n_in], DeviceTensor -> y [T, n_out]
    T = x.shape[0]
    args = (int(t.qtype), t.data, t.row_bytes, t.n_out, t.n_in, x, row_stride(x), y, row_stride(y))
    if T <= MATVEC_MAX_TOKENS:
        matvec(rt, args, tables, t.n_out, T, MATVEC_ROWS, MATVEC_WARPS)
    else:
        rt.launch("matmul_tiled", (cdiv(t.n_out, 64), cdiv(T, 64)), (256,), *args, T, tables)


def matvec(rt, args, tables, n_out, T, rows, warps, blocks=MATVEC_BLOCKS):
    """The decode kernel: `rows` output rows a block at a time, `warps` splitting each row, at most `blocks` blocks."""
    assert rows in (1, 2, 4), rows  # matvec_rows' instances
    rt.launch("matvec_rows", (min(cdiv(n_out, rows), blocks), T), (32 * warps,), *args, tables, rows)


def dequantize_rows(rt, t, first, n_rows, out, tables):  # rows [first, first + n_rows) -> out [n_rows, n_in]
    n = n_rows * t.n_in // 8
    rt.launch("dequantize_rows", (cdiv(n, 256),), (256,), int(t.qtype), t.data, t.row_bytes, t.n_in, first, n_rows,
              out, tables)


def residual_norm(rt, a, w1, eps1, x, x_out, w2, eps2, u, a_normed=None):
    """x_out = x + rms(a, eps1) * w1 (x None: no residual; w1 None: no weight); then, unless u is
    None, u = rms(x_out, eps2) * w2. a [rows, n] (strided rows allowed); the rest [rows, n]."""
    rt.launch("residual_norm", (a.shape[0],), (256,), a, row_stride(a), w1, np.float32(eps1), a_normed, x, x_out,
              w2, np.float32(eps2), u, a.shape[1])


def layer_norm(rt, x, w, b, eps, out):  # x [rows, n] -> out [rows, n]
    rt.launch("layer_norm", (x.shape[0],), (256,), x, w, b, np.float32(eps), out, x.shape[1])


def check_head_dim(D):
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head size {D} exceeds the kernels' {MAX_HEAD_DIM}")


def qk_norm_rope_store(rt, q, k, v, q_norm, k_norm, eps, cos, sin, step, H, Hkv, D, q_out, layer,
                       q_normed=None, k_normed=None, k_roped=None):
    """q [T, H*D], k/v [T, Hkv*D] (strided rows allowed) -> q_out [T, H, D]; K, V and the positions
    into the layer's cache slots. cos/sin [T, D/2], or None on NoPE layers."""
    check_head_dim(D)
    rt.launch("qk_norm_rope_store", (H + 2 * Hkv, q.shape[0]), (32,), q, row_stride(q), k, row_stride(k), v,
              row_stride(v), q_norm, k_norm, np.float32(eps), cos, sin, step, H, Hkv, D, q_out, layer.k, layer.v,
              layer.pos, layer.rows, q_normed, k_normed, k_roped)


def attention_cache(rt, q, layer, step, H, Hkv, D, window, scale, gate, out, attn_out=None, gate_sig=None):
    """q [T, H, D] over the layer's cache rows -> out [T, H*D] = attention * sigmoid(gate [T, H*D])."""
    check_head_dim(D)
    T = q.shape[0]
    rt.launch("attention_cache", (H, T), (ATT_THREADS,), q, H * D, layer.k, layer.v, layer.pos, layer.rows, step, H, Hkv,
              D, window, float(scale), gate, row_stride(gate), out, attn_out, gate_sig)


def attention_mask(rt, q, k, v, mask, scale, out):  # q [T, H, D], k/v [S, Hkv, D], mask u8 [T, S] -> out [T, H, D]
    T, H, D = q.shape
    check_head_dim(D)
    rt.launch("attention_mask", (H, T), (ATT_THREADS,), q, k, v, mask, k.shape[0], H, k.shape[1], D, float(scale), out)


def attention_spans(rt, q, k, v, start, stop, scale, out):  # q/k/v [N, H, D], start/stop int32 [N] -> out [N, H, D]
    T, H, D = q.shape
    check_head_dim(D)
    rt.launch("attention_spans", (H, T), (ATT_THREADS,), q, k, v, start, stop, H, D, float(scale), out)


def rope_pairs(rt, x, cos, sin, first, pair_stride, out):  # x/out [T, H, D], cos/sin [T, P]
    T, H, D = x.shape
    P = cos.shape[1]
    rt.launch("rope_pairs", (cdiv(T * H * P, 256),), (256,), x, cos, sin, T, H, D, P, first, pair_stride, out)


def truncate_positions(rt, layer, n_keep):
    rt.launch("truncate_positions", (cdiv(layer.rows, 256),), (256,), layer.pos, layer.rows, n_keep)


def elementwise(rt, kernel, out, *inputs):  # sigmoid_flat, gelu_erf_flat, swiglu_flat: [...] -> out
    n = out.size
    rt.launch(kernel, (cdiv(n, 256),), (256,), *inputs, out, n)


def scale_softcap(rt, z, scale, cap, out):  # out = softcap(z * scale, cap), ops.softcap's roundings
    n = out.size
    inv_cap = np.float32(1.0 / cap) if cap else np.float32(0)
    rt.launch("scale_softcap_flat", (cdiv(n, 256),), (256,), z, out, n, np.float32(scale), inv_cap, np.float32(cap))


def add_bias(rt, y, b):  # y [rows, n] (strided rows allowed) += b [n]
    rows, n = y.shape
    rt.launch("add_bias", (cdiv(rows * n, 256),), (256,), y, row_stride(y), b, rows, n)
