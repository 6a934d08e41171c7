"""The `ggml-cpu` numerics mode: what llama.cpp's CPU backend rounds, emulated in NumPy so that the
reference reproduces its logits bit for bit (docs/ggml-cpu-numerics.md).

The builds it models (BUILD, target.py): llama.cpp 0c1e570 as llama-cpp-python 0.3.36 compiles it
with GCC, llamafile tinyBLAS and CPU repack on, glibc 2.36 libm, 2 threads, for one CPU target:
`avx512` (the default: x86-64 AVX512 F/BW/DQ/VL/VNNI/BF16, what GGML_NATIVE makes on this kind of
machine) or `avx2` (AVX2 + FMA + F16C + BMI2, most prebuilt x86 builds), or the ARM builds `neon` and
`neon-i8mm` with CPU_REPACK off and on, and the same ARM builds compiled by clang (`neon-clang`,
`neon-i8mm-clang`, as macOS builds are), or llama.cpp's portable x86 variants below AVX2
(`sandybridge`, `ivybridge`, `piledriver`, `sse42`, `x64`: F32, F16, BF16 and Q8_0 weights). The emulation itself runs anywhere; `host_differences` says where this
machine could not run the modelled build.

Each llama.cpp kernel is one function doing the same float32 operations in the same order: every
rounding is explicit (float32 arrays, `fma32` for a fused multiply-add, the lane layout and the
reduction tree of each SIMD kernel), every integer dot product is exact. Which kernel a matmul takes
depends on the weight type, on the number of rows in the batch (the ubatch) and on whether the
weight was repacked at load time: `mul_mat` chooses as ggml_compute_forward_mul_mat does.

The model calls it through `GgmlCpuBackend`: linear and attention as every backend, plus the
element-wise hooks rms_norm, rope_norm, sigmoid, swiglu and softcap. Attention reads cache row j as
llama.cpp's KV cell j (one sequence from position 0, so cell = position) and applies the cache type
when it reads K and V, which is the same as rounding them when they are stored.

A q8_0 cache is llama.cpp's quantized cache: V quantized forces flash attention, K and V rows are
stored as Q8_0 blocks, Q is converted to Q8_0 for the K dot products, and for head sizes that are
multiples of 64 q, k, v and the attention output are rotated by Walsh-Hadamard transforms
(llama-kv-cache.cpp attn_rot_k / attn_rot_v). K and V types may differ (-ctk, -ctv): each side is
stored, rotated and read by its own type (a q8_0 K with flash attention off: K.Q a Q8_0 mul_mat).

Not modelled (GgmlCpuError): other quantized KV types, weight types without a decoder below (MXFP4
among them).

The package maps llama.cpp's CPU backend file by file: `target` (the CPU builds), `rounding` (f16/bf16, fma32, SIMD horizontal
sums), `libm` (glibc through ctypes, ggml's vectorised expf and silu), `elementwise` (norms, RoPE,
activations, softmax), `float_dots` (tinyBLAS and vec_dot for F32/F16/BF16 weights), `blocks` (the
block decoders), `quantize` (the activation quantizers), `int_dots` (the integer kernels and their
float epilogues), `mul_mat` (the kernel dispatch), `attention` and `backend`. accel/numba/ggml
mirrors it with the same file and function names.
"""
from .attention import fwht
from .backend import GgmlCpuBackend
from .blocks import DECODERS, decode
from .build import KV_TYPES, UBATCH, GgmlCpuError
from .elementwise import gelu_erf, layer_norm, rms_norm, rope_2d, rope_norm, sigmoid, soft_max, softcap, swiglu
from .libm import libm
from .mul_mat import mul_mat
from .quantize import quantize_q8_0, quantize_q8_k
from .rounding import fma32, round_f16
from .target import (CLANG_BUILDS, CPU_CHOICES, DEFAULT_TARGET, TARGETS, VARIANT_TARGET, host_differences, host_variant,
                     target, target_of_system_info)

__all__ = [  # what the package's users import from it; every other name from the module that defines it
    "GgmlCpuBackend", "GgmlCpuError", "KV_TYPES", "UBATCH",  # the backend and its build
    "CLANG_BUILDS", "CPU_CHOICES", "DEFAULT_TARGET", "TARGETS", "VARIANT_TARGET", "host_differences", "host_variant",
    "target", "target_of_system_info",  # the CPU builds modelled
    "DECODERS", "decode", "mul_mat", "quantize_q8_0", "quantize_q8_k",  # the weight products
    "fma32", "round_f16", "libm", "fwht",  # the rounding primitives
    "gelu_erf", "layer_norm", "rms_norm", "rope_2d", "rope_norm", "sigmoid", "soft_max", "softcap", "swiglu",
]
