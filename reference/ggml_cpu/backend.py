"""The backend: the model's hooks mapped onto the emulated kernels."""
import warnings

import numpy as np

from .. import ops
from .attention import attention_flash, attention_graph, attention_mul_mat, attention_q8_0, flash_types
from .elementwise import gelu_erf, interpolate_bilinear, layer_norm, rms_norm, rope_2d, rope_neox, rope_norm, sigmoid, softcap, swiglu
from .build import BUILD, KV_TYPES, GgmlCpuError
from .mul_mat import FLOAT_KERNELS, float_mul_mat, mul_mat
from .rounding import F32
from .target import DEFAULT_TARGET, host_differences, target


class GgmlCpuBackend:
    """The backend interface of reference/backend.py plus the element-wise hooks, computing what
    llama.cpp's CPU backend computes. kv_type: the K cache type (-ctk), and V's unless v_type (-ctv)
    names another: "f16" (llama.cpp's default), "f32" or "q8_0" (a q8_0 V needs flash attention, as in
    llama.cpp); flash_attn as the llama.cpp context had it (llama-cpp-python's default: off);
    repack: whether llama.cpp's CPU_REPACK buffer holds the weights (its default;
off for llama-cpp-python's use_extra_bufts=False or the tools' --no-repack); n_threads matters only for the KV-split flash-attention decode;
    cpu: the CPU build of llama.cpp to round as (target.py: "avx2", "avx512", "neon", "neon-i8mm",
    "neon-clang", "neon-i8mm-clang", the pre-AVX2 x86 variants "sandybridge", "ivybridge", "piledriver",
    "sse42", "x64", or a llama.cpp variant name that rounds as one; the default avx512).
    cache_bytes bounds the decoded weights kept between calls (the rest are decoded per call). Use a uniform cache
    and prompt chunks of at most UBATCH rows:

        lm = TextModel(gguf.load(path, "text"), backend=GgmlCpuBackend())
        logits = lm.prefill(ids, lm.new_cache(n_ctx, "uniform"), chunk=UBATCH)

    With check_host it warns when this machine could not run that build as modelled."""
    name = "ggml-cpu"
    float_product = staticmethod(float_mul_mat)  # the float kernels patch_embed calls (the numba twin's its own)
    attention_kernels = None

    def __init__(self, kv_type="f16", flash_attn=False, n_threads=2, check_host=True, repack=True, cache_bytes=None,
                 cpu=DEFAULT_TARGET, v_type=None):
        v_type = v_type or kv_type
        for cache_type in (kv_type, v_type):
            if cache_type not in KV_TYPES:
                raise GgmlCpuError(f"KV cache type {cache_type!r} is not emulated ({', '.join(KV_TYPES)})")
        if v_type == "q8_0" and not flash_attn:
            raise GgmlCpuError("a q8_0 V cache needs flash attention (llama.cpp refuses a quantized V cache without it)")
        self.target = target(cpu)
        if "q8_0" in (kv_type, v_type) and not self.target.quantized:
            raise GgmlCpuError(f"a q8_0 KV cache is not emulated on the {cpu} target (its Q8_0 quantizer and "
                               "vec_dot below AVX2)")
        if "q8_0" in (kv_type, v_type) and self.target.neon:
            raise GgmlCpuError(f"a q8_0 KV cache is not emulated on the {cpu} target (its Q8_0 K dot products: "
                               "ggml_vec_dot_q8_0_q8_0's NEON lanes)")
        for difference in host_differences(self.target) if check_host else ():
            warnings.warn(f"ggml-cpu numerics model the {cpu} build of {BUILD}; this machine's llama.cpp differs: "
                          f"{difference}", stacklevel=2)
        self.dtype = np.dtype(F32)
        self.k_type, self.v_type = kv_type, v_type
        self.flash_attn, self.n_threads, self.repack = flash_attn, n_threads, repack
        self.decoded = {}  # Weights -> {tensor name: decoded}: a drafter's blk.* names are also its target's
        self.cache_bytes = cache_bytes  # of decoded quantized weights per Weights (None: mul_mat's DECODED_CACHE_BYTES)

    def linear(self, x, w):  # x [T, in] f32, w a GGUF tensor [out, in] -> [T, out]
        cache = self.decoded.setdefault(w.weights, {})
        return mul_mat(np.ascontiguousarray(x, F32), w.weights, w.name, cache, self.repack, self.cache_bytes, self.target)

    def patch_embed(self, frames, kernel):  # frames [1, H, W, C], kernel [E, 1, C, p, p] -> [(H/p)*(W/p), E]
        """ggml_conv_2d: the im2col in F16 is the mul_mat's src0, the kernel converted to F16 its src1
        (docs/vision.md, Numerics that matter for tolerances)."""
        if len(frames) != 1:
            raise GgmlCpuError(f"llama.cpp's graph embeds one image, not {len(frames)} frames: "
                               "video runs in the exact numerics only")
        to_f16 = FLOAT_KERNELS["F16"][0]
        patches = to_f16(ops.im2col(np.asarray(frames, F32), kernel.shape[-1]))
        w = np.ascontiguousarray(to_f16(np.asarray(kernel, F32).reshape(len(kernel), -1)))
        return self.float_product(w, np.ascontiguousarray(patches), "F16", self.target).T

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        # scale is used as a float32: llama.cpp's kq_scale is 1.0f/sqrtf(head_dim), computed in float32
        q, k, v = (np.asarray(a, F32) for a in (q, k, v))
        if not self.flash_attn:
            return attention_mul_mat(q, k, v, visible, scale, self.k_type, self.target, v_type=self.v_type)
        k_type, v_type = flash_types(self.k_type, self.v_type)
        if (k_type, v_type) == ("f16", "f16"):
            return attention_flash(q, k, v, visible, scale, self.n_threads, self.target)
        return attention_q8_0(q, k, v, visible, scale, self.target, k_type=k_type, v_type=v_type)

    def window_attention(self, q, k, v, windows, scale):  # [T, H, D] x3, windows [W] -> [T, H, D]
        """As clip.cpp builds it: over all T tokens of the graph, no KV cache, the windows through a
        block-diagonal mask."""
        window = np.repeat(np.arange(len(windows)), windows)
        return attention_graph(*(np.asarray(a, F32) for a in (q, k, v)), window[:, None] == window[None, :], scale,
                               self.flash_attn, self.target, self.attention_kernels)

    def interpolate(self, grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]: bilinear ggml_interpolate
        return interpolate_bilinear(np.asarray(grid, F32), out_h, out_w)

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        return rms_norm(np.asarray(x, F32), eps)

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        return layer_norm(np.asarray(x, F32), w, b, eps, self.target)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return rope_norm(np.asarray(x, F32), theta, self.target)

    def rope_neox(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]
        return rope_neox(np.asarray(x, F32), theta, self.target)

    def rope_2d(self, x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]
        return rope_2d(np.asarray(x, F32), theta_a, theta_b, self.target)

    def sigmoid(self, x):  # [...] -> [...]
        return sigmoid(x)

    def gelu_erf(self, x):  # [...] -> [...]
        return gelu_erf(x)

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        return swiglu(np.asarray(gate, F32), np.asarray(up, F32), self.target)

    def softcap(self, z, cap):  # z [...] -> [...]
        return softcap(np.asarray(z, F32), cap, self.target)
