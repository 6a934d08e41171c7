"""The Muse-Glimmer vision encoder (mmproj) as llama.cpp's mtmd computes it (docs/vision.md).

    grid:    the merged-token grid closest to the image's aspect under the token cap (ties: more tokens)
    pixels:  uint8 Lanczos-3 stretch to 28*cols x 28*rows, (u8/255 - mean) / std
    E = patches(14x14, c-ky-kx) Wp + bilinear(pos 32x32 -> gh x gw, border clamp)
    X = LN_pre(E[perm])                               perm: 32x32-patch windows, raster in each
    50 x  X += attn(LN1(X)) Wo + bo                   2D NORM rope (column | row, 1-indexed),
          X += fc2(gelu_erf(fc1(LN2(X))))             window-local except every 4th and the last layer
    Y = LN_post(X)[inverse perm]
    Z = pixel_shuffle_2x2(Y)                          channel-outer: Z[o, c*4 + s]
    out = gelu(gelu(Z M0) M1) M2                      the raw projection; the text model's embd_norm follows

Attention runs window by window, never through an N x N mask. Sizes come from the mmproj: the
window side is the side of the position table (32 on the release, 8 on the tiny model).
"""
import math

import numpy as np

from . import gguf, ops, video
from .backend import NumpyBackend
from .gguf import GGUFError
from .image import resize_lanczos
from .trace import NO_TRACE, layer_range
DEFAULT_MAX_TOKENS = 4096    # llama.cpp's set_limit_image_tokens(1, 4096) for this projector
SUPPORTED_MERGE = 2          # llama.cpp counts merged tokens with a literal 2 (clip.cpp)


# ---------------------------------------------------------------------------------------------
# Preprocessing

def lround(x):  # C's lround: halves away from zero
    whole = math.floor(x)
    return whole + 1 if x - whole >= 0.5 else whole


def grid_size(width, height, unit, max_tokens):  # image px -> (cols, rows) in merged tokens
    """llama.cpp's muse_glimmer_grid_size, in doubles like the C++. Of the floor/ceil candidates
    under the cap, the one nearest the image's aspect (rows/cols vs H/W) wins; on an exact tie the
    one with more tokens (transformers keeps whichever its set() yields first)."""
    rows_ideal, cols_ideal = height / unit, width / unit
    ratio = cols_ideal / rows_ideal if rows_ideal > 0 else 1.0
    if rows_ideal * cols_ideal > max_tokens:
        rows_ideal = math.sqrt(max_tokens / ratio)
        cols_ideal = rows_ideal * ratio
    target = height / width
    best, best_d = None, 0.0
    for rows in (math.floor(rows_ideal), math.ceil(rows_ideal)):
        for cols in (math.floor(cols_ideal), math.ceil(cols_ideal)):
            if rows < 1 or cols < 1 or rows * cols > max_tokens:
                continue
            d = abs(rows / cols - target)
            if best is None or d < best_d or (d == best_d and rows * cols > best[0] * best[1]):
                best, best_d = (rows, cols), d
    if best is None:  # nothing fits under the cap: round (this may exceed it, as llama.cpp does)
        best = (max(1, lround(rows_ideal)), max(1, lround(cols_ideal)))
    return best[1], best[0]


def normalize(rgb, mean, std, dtype):  # uint8 [H, W, 3] -> [H, W, 3]; llama.cpp's (u8/255 - mean)/std
    v = rgb.astype(dtype) / dtype(255)
    return (v - np.asarray(mean, np.float32).astype(dtype)) / np.asarray(std, np.float32).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The tower

class VisionModel:
    """The tower on a backend (default NumpyBackend(dtype)). On a ggml-cpu one (reference.ggml_cpu or
    its numba twin) it is mtmd's CPU graph: the convolution's F16 im2col (nearly all of what separates
    it from the exact mode: docs/vision.md, Numerics that matter for tolerances), every product and op
    as ggml rounds it, the window attention over all patches through a block-diagonal mask."""

    def __init__(self, gguf_model, dtype=np.float32, backend=None):
        self.path = gguf_model.path
        self.cfg = gguf_model.config
        self.tensors = gguf_model.tensors
        self.dtype = np.dtype(dtype)
        self.backend = backend or NumpyBackend(self.dtype)
        n_pos = self.tensors.position_embd.shape[0]
        self.pos_side = math.isqrt(n_pos)
        if self.pos_side ** 2 != n_pos:
            raise GGUFError(self.path, f"{self.tensors.position_embd.name} has {n_pos} rows, not a square grid")
        if self.cfg.merge_size != SUPPORTED_MERGE:
            raise GGUFError(self.path, f"clip.vision.spatial_merge_size {self.cfg.merge_size} is not supported "
                                       f"(llama.cpp counts merged tokens with a literal {SUPPORTED_MERGE})")
        if self.cfg.head_dim % 4:
            raise GGUFError(self.path, f"head size {self.cfg.head_dim} cannot hold two rope halves of pairs")

    @property
    def n_out(self):  # width of one image embedding (the text model's n_embd)
        return self.tensors.mm_2.shape[0]

    @property
    def unit(self):  # pixels per merged token side (28)
        return self.cfg.patch_size * self.cfg.merge_size

    def preprocess(self, rgb, max_tokens=DEFAULT_MAX_TOKENS):  # uint8 [H, W, 3] -> uint8 [h, w, 3]
        cols, rows = grid_size(rgb.shape[1], rgb.shape[0], self.unit, max_tokens)
        return resize_lanczos(rgb, cols * self.unit, rows * self.unit)

    def encode(self, rgb, max_tokens=DEFAULT_MAX_TOKENS, trace=NO_TRACE, progress=None):  # uint8 [H, W, 3] -> [N, n_out]
        return self.forward(self.preprocess(rgb, max_tokens), trace, progress)

    def forward(self, resized, trace=NO_TRACE, progress=None):  # uint8 [h, w, 3] (multiples of 28) -> [h*w/784, n_out]
        """`progress` wraps the layer range (tqdm, or None)."""
        c, p = self.cfg, self.cfg.patch_size
        gh, gw = resized.shape[0] // p, resized.shape[1] // p
        if resized.shape[0] % self.unit or resized.shape[1] % self.unit or gh == 0 or gw == 0:
            raise ValueError(f"tower input {resized.shape[1]}x{resized.shape[0]} is not a positive "
                             f"multiple of {self.unit}")
        pixels = normalize(resized, c.image_mean, c.image_std, self.dtype.type)
        return self.tower(self.patch_embed(pixels) + self.position_embed(gh, gw), gh, gw, trace, progress)

    def tower(self, x, gh, gw, trace=NO_TRACE, progress=None):  # embedded patches [gh*gw, E] raster -> [gh*gw/4, n_out]
        c = self.cfg
        trace("after_posemb", x)
        perm, window_lengths = ops.window_permutation(gh, gw, self.pos_side)
        x = x[perm]
        trace("after_sp_perm", x)
        x = self.layer_norm(x, self.tensors.pre_ln)
        trace("pre_ln", x)
        rows, cols = np.divmod(perm, gw)  # 1-indexed positions of the permuted tokens (clip.cpp)
        theta_w = ops.rope_angles(cols + 1, c.head_dim // 2, c.rope_theta, self.dtype)
        theta_h = ops.rope_angles(rows + 1, c.head_dim // 2, c.rope_theta, self.dtype)
        for il in layer_range(c.n_layer, progress):
            windows = [len(perm)] if self.is_global(il) else window_lengths
            x = self.block(il, x, theta_w, theta_h, windows, trace)
        x = self.layer_norm(x, self.tensors.post_ln)
        y = np.empty_like(x)
        y[perm] = x  # the inverse permutation: back to raster order
        trace("after_inv_perm", y)
        z = ops.pixel_shuffle_channel_outer(y, gh, gw, c.merge_size)
        trace("encoder_out", z)
        out = self.adapter(z)
        trace("projected", out)
        return out

    def encode_video(self, prepared, pair_trace=lambda g: NO_TRACE, progress=None):  # video.Prepared -> [n_pairs * rows*cols, n_out]
        """Each frame pair through the image tower on its own, as transformers runs a video
        (modeling_muse_glimmer.py get_video_features = get_image_features): the pair's patches
        [f0 | f1] times [W0 | W1] (W1 the extension's tensor, W0 = the summed kernel - W1), plus the
        position table resized with transformers' zero padding, the same for every pair; RoPE
        positions, windows and global layers within the pair; pixel shuffle and adapter per pair.
        pair_trace(g) is pair g's Tracer (reference.run: a directory video-<v>-pair-<g>), closed here."""
        check_video_extension(self.path, self.cfg, self.tensors)
        c = self.cfg
        rows, cols = prepared.grid
        gh, gw = rows * c.merge_size, cols * c.merge_size
        table = self.tensors.position_embd.get(self.dtype).reshape(self.pos_side, self.pos_side, -1)
        # transformers' own resize, host-side: no engine has a video graph (a ggml-cpu backend refuses the pair)
        position = ops.resize_bilinear_zeros(table, gh, gw).reshape(gh * gw, -1)
        kernel = self.pair_kernel()
        out = []
        for g, pair in enumerate(prepared.pairs):
            pixels = video.normalize(pair, c.image_mean, c.image_std).astype(self.dtype)  # float32 first, as transformers
            embedded = self.backend.patch_embed(pixels, kernel) + position
            trace = pair_trace(g)
            out.append(self.tower(embedded, gh, gw, trace, progress))
            trace.close()
        return np.concatenate(out)

    def pair_kernel(self):  # -> float64 [E, 2, 3, p, p]: [W0 | W1], transformers' Linear over a pair's patch
        p = self.cfg.patch_size
        summed = self.tensors.patch_embd.get(np.float64).reshape(self.cfg.n_embd, 3, p, p)
        second = self.tensors.patch_embd_t1.get(np.float64).reshape(self.cfg.n_embd, 3, p, p)
        return np.stack([summed - second, second], axis=1)

    def is_global(self, il):  # every sparse_factor-th layer and the last attend to the whole image
        return il == self.cfg.n_layer - 1 or (il + 1) % self.cfg.sparse_factor == 0

    def patch_embed(self, pixels):  # [H, W, 3] -> [gh*gw, E] raster order; a stride-14 conv, no bias
        p = self.cfg.patch_size
        kernel = self.tensors.patch_embd.get(np.float64).reshape(self.cfg.n_embd, 1, 3, p, p)
        return self.backend.patch_embed(pixels[None], kernel)

    def position_embed(self, gh, gw):  # -> [gh*gw, E]; table row y*side + x
        side = self.pos_side
        table = self.tensors.position_embd.get(self.dtype).reshape(side, side, -1)
        return self.backend.interpolate(table, gh, gw).reshape(gh * gw, -1)

    def layer_norm(self, x, norm):  # x [T, E], norm an Affine (weight, bias) -> [T, E]
        return self.backend.layer_norm(x, norm.weight.get(self.dtype), norm.bias.get(self.dtype), self.cfg.layer_norm_eps)

    def linear(self, x, w):  # x [T, in], w a GGUF tensor [out, in] -> [T, out]
        return self.backend.linear(x, w)

    def dense(self, x, affine):  # x [T, in], affine (weight [out, in], bias [out]) -> [T, out]; a GGUF linear with its bias
        out = self.linear(x, affine.weight)
        out += affine.bias.get(self.dtype)  # in place: a new [5476, 8960] array cost 0.1 s a call
        return out

    def block(self, il, x, theta_w, theta_h, windows, trace):  # x [T, E] (window order) -> [T, E]
        c, layer = self.cfg, self.tensors.layers[il]
        T, H, D = x.shape[0], c.n_head, c.head_dim
        h = self.layer_norm(x, layer.ln1)
        trace(f"layer_inp_normed-{il}", h)
        q, k, v = (self.dense(h, w).reshape(T, H, D) for w in (layer.attn_q, layer.attn_k, layer.attn_v))
        trace(f"Qcur-{il}", q), trace(f"Kcur-{il}", k), trace(f"Vcur-{il}", v)
        q, k = self.backend.rope_2d(q, theta_w, theta_h), self.backend.rope_2d(k, theta_w, theta_h)
        trace(f"Qcur_pos-{il}", q), trace(f"Kcur_pos-{il}", k)
        a = self.backend.window_attention(q, k, v, windows, 1.0 / math.sqrt(D)).reshape(T, H * D)
        trace(f"kqv_out-{il}", a)
        a = self.dense(a, layer.attn_out)
        trace(f"attn_out-{il}", a)
        x = x + a
        trace(f"ffn_inp-{il}", x)
        h = self.layer_norm(x, layer.ln2)
        trace(f"ffn_inp_normed-{il}", h)
        f = self.dense(self.backend.gelu_erf(self.dense(h, layer.ffn_up)), layer.ffn_down)
        trace(f"ffn_out-{il}", f)
        x = x + f
        trace(f"layer_out-{il}", x)
        return x

    def adapter(self, z):  # [N, E*4] -> [N, n_out]; GELU after fc1 and fc2, none after the projection
        a = self.backend.gelu_erf(self.linear(z, self.tensors.mm_0))
        a = self.backend.gelu_erf(self.linear(a, self.tensors.mm_1))
        return self.linear(a, self.tensors.mm_2)


def check_video_extension(path, cfg, tensors):  # an mmproj's -> None; GGUFError naming the tool that adds it
    if not cfg.temporal_patch_size or tensors.patch_embd_t1 is None:
        raise GGUFError(path, f"has no video extension ({gguf.PATCH_EMBD_T1}): add it with python -m "
                                    "tools.video_mmproj --mmproj THIS.gguf --checkpoint HF_DIR -o OUT.gguf")


def check_compatible(vision, text_cfg, text_path):  # raise GGUFError when the widths differ
    if vision.n_out != text_cfg.n_embd:
        raise GGUFError(vision.path, f"mmproj projects to {vision.n_out} features but the text model "
                                     f"{text_path} has n_embd {text_cfg.n_embd}")
