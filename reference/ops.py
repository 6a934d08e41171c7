"""The math, one pure function per concept. Nothing here knows a model, a file or a cache.

Every function keeps the dtype of its input (float32 in `exact` mode, float64 for the noise floor),
except where a comment says a sum is carried in float64 because llama.cpp does so.
"""
import numpy as np
from scipy.special import erf


def linear(x, w):  # x [T, in], w [out, in] -> [T, out]
    # Dot products accumulate in float64 and round once: the result then does not depend on the
    # BLAS kernel, the batch size or the thread count, so chunked and one-shot prefills agree.
    return (x.astype(np.float64) @ w.astype(np.float64, copy=False).T).astype(x.dtype)


def rms_norm(x, eps):  # x [..., n] -> [..., n]
    # ggml sums the f32 squares in double, then rounds the mean back to f32 (ops.cpp rms_norm).
    sum_sq = np.sum((x * x).astype(np.float64), axis=-1)
    mean = (sum_sq / x.shape[-1]).astype(x.dtype)
    scale = x.dtype.type(1) / np.sqrt(mean + x.dtype.type(eps))
    return x * scale[..., None]


def layer_norm(x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
    mean = np.mean(x.astype(np.float64), axis=-1, keepdims=True)
    centered = x - mean.astype(x.dtype)
    var = np.mean(centered.astype(np.float64) ** 2, axis=-1, keepdims=True).astype(x.dtype)
    return centered / np.sqrt(var + x.dtype.type(eps)) * w + b


def rope_angles(positions, n_dims, base, dtype):  # positions [T] -> theta [T, n_dims/2]
    """ggml's angles: theta_0 = p, theta_{i+1} = theta_i * base^(-2/n_dims), multiplied in float32.
    In float64 the exact p * base^(-2i/n_dims) is the noise-floor reference."""
    p = np.asarray(positions)
    if dtype == np.float64:
        return p[:, None].astype(np.float64) * base ** (-2.0 * np.arange(n_dims // 2) / n_dims)
    theta_scale = np.float32(base) ** np.float32(-2.0 / n_dims)
    theta = np.empty((len(p), n_dims // 2), np.float32)
    theta[:, 0] = p.astype(np.float32)
    for i in range(1, n_dims // 2):
        theta[:, i] = theta[:, i - 1] * theta_scale
    return theta


def rope_norm(x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (2i, 2i+1)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def rope_neox(x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (i, i + D/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def softmax(x, axis=-1):  # x [..., n] -> [..., n]; rows that are all -inf give 0
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s > 0, s, 1)


def sigmoid(x):  # [...] -> [...]
    return 1 / (1 + np.exp(-x))


def silu(x):  # [...] -> [...]
    return x / (1 + np.exp(-x))


def gelu_erf(x):  # [...] -> [...]; the exact GELU, not the tanh approximation
    return (0.5 * x * (1 + erf(x / np.sqrt(2)))).astype(x.dtype, copy=False)


def swiglu(gate, up):  # gate [T, F], up [T, F] -> [T, F]; SiLU on the gate projection only
    return silu(gate) * up


def softcap(z, cap):  # z [...] -> [...]; llama.cpp order: scale by the f32 reciprocal, tanh, scale back
    if cap == 0:
        return z
    return np.tanh(z * z.dtype.type(1.0 / cap)) * z.dtype.type(cap)


def attention(q, k, v, visible, scale):  # q [T, H, D], k/v [S, Hkv, D], visible [T, S] bool -> [T, H, D]
    """Scaled dot-product attention with contiguous GQA groups (q head h reads kv head h // (H/Hkv)),
    computed per kv head on a [group*T, S] score block so K and V are never repeated."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    group = H // Hkv
    # float64 inside, for the same reason as in linear: the result must not depend on how many
    # (masked) cache rows a batch happens to read.
    qg = q.astype(np.float64).reshape(T, Hkv, group, D).transpose(1, 2, 0, 3).reshape(Hkv, group * T, D)
    scores = (qg @ k.astype(np.float64).transpose(1, 2, 0)) * scale        # [Hkv, group*T, S]
    scores = scores.reshape(Hkv, group, T, S)
    scores = np.where(visible[None, None], scores, -np.inf)
    probs = softmax(scores).reshape(Hkv, group * T, S)
    out = probs @ v.astype(np.float64).transpose(1, 0, 2)                   # [Hkv, group*T, D]
    return out.reshape(Hkv, group, T, D).transpose(2, 0, 1, 3).reshape(T, H, D).astype(q.dtype)


def causal_visible(query_pos, key_pos, window, causal=True):  # [T], [S] (-1 = empty slot), window or 0 -> [T, S] bool
    """llama.cpp's KV mask: a key is visible iff it is filled, not in the future, and on a
    sliding-window layer closer than the window (p_q - p_k < n_swa, self included). causal=False
    is the DFlash drafter's mask: no cut at the future, the window rule as it is (llama.cpp's;
    transformers keeps |p_q - p_k| <= window, one row more)."""
    qp, kp = np.asarray(query_pos)[:, None], np.asarray(key_pos)[None, :]
    visible = (kp >= 0) & (kp <= qp) if causal else np.broadcast_to(kp >= 0, (len(qp), kp.shape[1])).copy()
    if window:
        visible &= (qp - kp) < window
    return visible


# ---------------------------------------------------------------------------------------------
# Vision (docs/vision.md, The tower)

def rope_2d(x, theta_a, theta_b):  # x [T, H, D], theta_a/theta_b [T, D/4] -> [T, H, D]
    """Two NORM ropes side by side: pairs (2i, 2i+1) of the first half of every head turn by
    theta_a (the column), those of the second half by theta_b (the row)."""
    half = x.shape[-1] // 2
    return np.concatenate([rope_norm(x[..., :half], theta_a), rope_norm(x[..., half:], theta_b)], axis=-1)


def im2col(frames, p):  # frames [F, H, W, C] -> [(H/p)*(W/p), F*C*p*p]; patches raster, columns (f, c, y, x)
    """The patches a stride-p, p x p convolution multiplies: ggml_im2col's rows for one image (F = 1),
    transformers' patchify of a video's frame pair (F = 2)."""
    F, H, W, C = frames.shape
    gh, gw = H // p, W // p
    x = frames.reshape(F, gh, p, gw, p, C).transpose(1, 3, 0, 5, 2, 4)  # [gy, gx, f, c, y, x]
    return x.reshape(gh * gw, F * C * p * p)


def bilinear_taps(n_in, n_out, dtype):  # -> lo [n_out], hi [n_out], frac [n_out]
    """ggml_interpolate's bilinear taps without align-corners: half-pixel centres in the input's
    float type, both taps and the fraction clamped to the border (transformers zero-pads instead)."""
    s = (np.arange(n_out).astype(dtype) + dtype(0.5)) / (dtype(n_out) / dtype(n_in)) - dtype(0.5)
    i0 = np.floor(s).astype(np.int64)
    lo, hi = np.clip(i0, 0, n_in - 1), np.clip(i0 + 1, 0, n_in - 1)
    return lo, hi, np.clip(s - lo.astype(dtype), 0, 1).astype(dtype)


def bilinear_corners(grid, out_h, out_w):  # grid [h, w, C] -> a, b, c, d [out_h, out_w, C], dx [1, out_w, 1], dy [out_h, 1, 1]
    dtype = grid.dtype.type
    y0, y1, dy = bilinear_taps(grid.shape[0], out_h, dtype)
    x0, x1, dx = bilinear_taps(grid.shape[1], out_w, dtype)
    return grid[y0][:, x0], grid[y0][:, x1], grid[y1][:, x0], grid[y1][:, x1], dx[None, :, None], dy[:, None, None]


def resize_bilinear_border(grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]
    a, b, c, d, dx, dy = bilinear_corners(grid, out_h, out_w)
    one = grid.dtype.type(1)
    # ggml's expression order, so float32 rounds as it does
    return a * (one - dx) * (one - dy) + b * dx * (one - dy) + c * (one - dx) * dy + d * dx * dy


def zero_padded_taps(n_in, n_out):  # -> taps int64 [n_out, 2], float32 weights [n_out, 2]
    """transformers' bilinear taps (vision_utils.py _interpolation_axis_taps_weights, align_corners
    False, padding "zeros"), in its float32: a tap outside the table gets weight 0, not the border."""
    f32 = np.float32
    src = (np.arange(n_out, dtype=f32) + f32(0.5)) * f32(n_in) / f32(n_out) - f32(0.5)
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.maximum(f32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=f32)), f32(0))
    weights = weights * ((raw >= 0) & (raw <= n_in - 1))
    return np.clip(raw, 0, n_in - 1), weights.astype(f32)


def resize_bilinear_zeros(grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]; transformers' resize
    """The four taps' sum, each weight the float32 product of its row and column weights
    (get_vision_interpolation_indices_and_weights), in the grid's dtype."""
    ty, wy = zero_padded_taps(grid.shape[0], out_h)
    tx, wx = zero_padded_taps(grid.shape[1], out_w)
    out = np.zeros((out_h, out_w, grid.shape[2]), grid.dtype)
    for a in range(2):
        for b in range(2):
            weight = (wy[:, a, None] * wx[None, :, b]).astype(grid.dtype)
            out += grid[ty[:, a]][:, tx[:, b]] * weight[..., None]
    return out


def window_permutation(rows, cols, side):  # -> perm [rows*cols], window lengths [n_windows]
    """Raster order over side x side windows, raster order inside each; edge windows are clipped.
    perm[i] is the raster index of the i-th token in window order."""
    raster = np.arange(rows * cols).reshape(rows, cols)
    windows = [raster[wy:wy + side, wx:wx + side].reshape(-1)
               for wy in range(0, rows, side) for wx in range(0, cols, side)]
    return np.concatenate(windows), [len(w) for w in windows]


def pixel_shuffle_channel_outer(x, rows, cols, m):  # x [rows*cols, C] raster -> [rows*cols/m^2, C*m^2]
    """Each m x m block of tokens becomes one row, channel-outer: out[o, c*m*m + s] with
    s = ry*m + rx (top-left, top-right, bottom-left, bottom-right for m = 2)."""
    C = x.shape[-1]
    blocks = x.reshape(rows // m, m, cols // m, m, C).transpose(0, 2, 4, 1, 3)  # [oy, ox, c, ry, rx]
    return blocks.reshape((rows // m) * (cols // m), C * m * m)
