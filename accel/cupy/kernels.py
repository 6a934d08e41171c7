"""The CUDA C sources of accel/cuda as a runtime loads them: each file with its includes inlined,
the parameter kinds of every `extern "C"` kernel parsed from the source (a launch with the wrong
number or kind of arguments fails on the host, before anything reaches a device), and the table
buffer the IQ decoders read (grids and non-linear values taken from gguf-py, not copied)."""
import os
import re

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import quants

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda")
FILES = ("matmul.cu", "attention.cu", "norm.cu", "rope.cu", "activation.cu")
# -fmad=false: `a * b + c` rounds twice as in NumPy; the kernels ask for fused float64 sums with fma()
NVRTC_OPTIONS = ("-fmad=false",)
NVCC_OPTIONS = ("--fmad=false",)

# The types dequant.cu decodes (DISPATCH_QTYPE); any other falls back to the NumPy reference
KERNEL_TYPES = frozenset((GT.F32, GT.F16, GT.BF16, GT.Q4_0, GT.Q5_0, GT.Q8_0, GT.IQ4_NL, GT.Q2_K, GT.Q3_K,
                          GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_XS, GT.IQ3_XXS, GT.IQ2_XXS))

_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)
KERNEL_DECLARATION = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\w+\) )?(\w+)\(([^)]*)\)')
_SCALARS = {"int": "int", "i64": "i64", "float": "float", "double": "double"}


def source(filename, seen=None):  # file in accel/cuda -> its text, each included file inlined once
    seen = set() if seen is None else seen
    seen.add(filename)
    with open(os.path.join(CUDA_DIR, filename)) as f:
        text = f.read()
    return _INCLUDE.sub(lambda m: "" if m.group(1) in seen else source(m.group(1), seen), text)


def kernel_params(text):  # source text -> {kernel name: (kind, ...)}, kind "ptr" | "int" | "i64" | "float" | "double"
    kernels = {}
    for name, params in KERNEL_DECLARATION.findall(text):
        kinds = []
        for p in params.split(","):
            decl = " ".join(p.split())
            if "*" in decl:
                kinds.append("ptr")
                continue
            ctype = decl.rsplit(" ", 1)[0].replace("const ", "")
            if ctype not in _SCALARS:
                raise ValueError(f"kernel {name}: parameter {decl!r} has a type the runtimes cannot pass")
            kinds.append(_SCALARS[ctype])
        kernels[name] = tuple(kinds)
    return kernels


def check_args(name, kinds, args):  # raise TypeError unless args fit the kernel's parameters
    if len(args) != len(kinds):
        raise TypeError(f"kernel {name} takes {len(kinds)} arguments, got {len(args)}")
    for i, (kind, a) in enumerate(zip(kinds, args)):
        is_array = hasattr(a, "shape") and getattr(a, "ndim", 0) > 0
        if (kind == "ptr") != (is_array or a is None):
            raise TypeError(f"kernel {name} argument {i}: expected {kind}, got {type(a).__name__}")


def lookup_tables():  # -> uint8 [3088]: IQ2_XXS grid [256, 8], IQ3_XXS grid [256, 4], IQ4 values int8 [16]
    quants.IQ2_XXS.init_grid()
    quants.IQ3_XXS.init_grid()
    iq2 = np.asarray(quants.IQ2_XXS.grid, np.float32).reshape(256, 8)
    iq3 = np.asarray(quants.IQ3_XXS.grid, np.float32).reshape(256, 4)
    kvalues = np.array(quants.IQ4_NL.kvalues, np.int8)
    return np.concatenate([iq2.astype(np.uint8).ravel(), iq3.astype(np.uint8).ravel(), kvalues.view(np.uint8)])
