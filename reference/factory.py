"""The one place a model is built: the text model, the vision tower and the DFlash drafter, on a
backend (numpy, tp, numba, cupy) in a numerics mode (exact, ggml-cpu).

    build = Build(backend="numba", numerics="ggml-cpu")    # what the flags ask for; check(build) says no
    be = backend(build)                                    # made once, before any GGUF loads
    lm = text_model(gguf.load(path, "text"), build, be)
    tower = vision_model(gguf.load(mmproj, "mmproj"), build, lm.backend)   # the text model's backend
    draft = drafter(gguf.load(path, "dflash"), lm)         # computes through lm.backend

The reference's own backends are built here (own_backend). accel's are found through its registry
(the table `accel.BACKENDS` of "module:callable" strings, each callable (Build) -> backend, as
own_backend is), imported only when such a backend is asked for, so reference/ runs, and is tested,
without numba or CuPy.
"""
import importlib
import os
from dataclasses import dataclass

import numpy as np

from .backend import NumpyBackend
from .dflash import Drafter
from .ggml_cpu import (DEFAULT_TARGET, KV_TYPES, UBATCH, GgmlCpuBackend, GgmlCpuError, host_differences, host_variant,
                       target as cpu_target)
from .text import TextModel
from .tp import TensorParallelBackend, check_tp
from .vision import VisionModel

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
DEFAULT_MODEL = os.path.join(GOLDEN, "models", "glimmer-default-f16.gguf")  # trained: tools/regen/train_tiny.py
ACCEL = "accel"  # the package whose BACKENDS and TEXT_MODELS tables name the faster backends
BACKENDS = ("numpy", "numba", "cupy")
DTYPES = ("float32", "float64")
NUMERICS = ("exact", "ggml-cpu")
GGML_CPU_BACKENDS = ("numpy", "numba")
ON_OFF = {None: None, "on": True, "off": False}  # a command line's on|off switch (None: not given) -> Build's


class FactoryError(Exception):
    """Flags that build no model (a contradiction, a missing package or device); one-line message."""


@dataclass(frozen=True)
class Build:
    """What a model computes with. kv_type (the K cache type, and V's unless v_type), flash_attn
    (None: on for a q8_0 V cache, as llama.cpp's "auto"), repack and n_threads are llama.cpp's build
    under numerics "ggml-cpu"; tp > 1 simulates tensor parallelism on the numpy backend."""
    backend: str = "numpy"
    numerics: str = "exact"
    dtype: str = "float32"
    tp: int = 1
    kv_type: str | None = None
    flash_attn: bool | None = None
    repack: bool | None = None
    n_threads: int = 2
    cpu: str | None = None  # the llama.cpp CPU build emulated under ggml-cpu (None: avx512, with host warnings)
    v_type: str | None = None  # -ctv where it differs from kv_type (-ctk)

    @property
    def ggml_cpu(self):  # -> whether llama.cpp's CPU rounding is emulated
        return self.numerics == "ggml-cpu"


def check(build):  # -> None; FactoryError for flags that contradict each other
    for what, value, known in (("backend", build.backend, BACKENDS), ("numerics", build.numerics, NUMERICS),
                               ("dtype", build.dtype, DTYPES)):
        if value not in known:
            raise FactoryError(f"unknown {what} {value!r} ({', '.join(known[:-1])} or {known[-1]})")
    if build.ggml_cpu and (build.dtype != "float32" or build.backend not in GGML_CPU_BACKENDS or build.tp != 1):
        raise FactoryError("--numerics ggml-cpu computes in float32 on the numpy or numba backend, without --tp")
    if not build.ggml_cpu and (build.kv_type or build.v_type or build.flash_attn is not None
                               or build.repack is not None or build.cpu is not None):
        raise FactoryError("--kv-type, --flash-attn, --repack/--no-repack and --cpu choose llama.cpp's build "
                           "for --numerics ggml-cpu only")
    if build.cpu is not None:
        try:
            cpu_target(build.cpu)
        except GgmlCpuError as e:
            raise FactoryError(f"--cpu {build.cpu}: {e}") from None
    for flag, cache_type in (("-ctk", build.kv_type), ("-ctv", build.v_type)):
        if cache_type is not None and cache_type not in KV_TYPES:
            raise FactoryError(f"{flag} {cache_type}: one of {', '.join(KV_TYPES)}")
    if build.tp != 1 and build.backend != "numpy":
        raise FactoryError("--tp simulates tensor parallelism on the numpy backend only")
    if build.tp < 1:
        raise FactoryError(f"--tp {build.tp}: at least 1")


def cache_layout(build, kind, chunk):  # --kv, --prefill-chunk -> (KV cache kind, prefill chunk) `build` runs with
    if build.ggml_cpu:  # llama.cpp's: one cell per position, as its cache holds a single sequence; ubatches of UBATCH
        return "uniform", min(chunk, UBATCH)
    return kind, chunk


def check_tower(build):  # -> None; FactoryError where the tower cannot be built on this backend
    if build.tp != 1:
        raise FactoryError("--tp shards the text model only: the vision tower has no tensor-parallel plan")


def host_warnings(build):  # -> lines: where this machine's llama.cpp would round unlike the emulated build
    if not build.ggml_cpu or build.cpu is not None:  # a target named on purpose (or by auto) is no surprise
        return []
    return [f"ggml-cpu models llama.cpp's x86-64 AVX512 build; here {d}" for d in host_differences()]


def notes(build):  # -> lines said at start-up, not warnings: which variant --cpu auto took, numba's first compilation
    return auto_notes(build) + compile_notes(build)


def auto_notes(build):  # -> the line that says which llama.cpp variant --cpu auto took, and how it rounds
    if not (build.ggml_cpu and build.cpu == "auto"):
        return []
    return [f"--cpu auto: llama.cpp's portable build loads libggml-cpu-{host_variant()}.so on this CPU, "
            f"which rounds as {cpu_target('auto').name}"]


def compile_notes(build):  # -> lines: numba's first compilation, which is silent for about a minute otherwise
    if build.backend != "numba":
        return []
    package = os.path.join(os.path.dirname(GOLDEN), ACCEL)
    cache = os.environ.get("NUMBA_CACHE_DIR") or package
    if any(name.endswith(".nbi") for _, _, names in os.walk(cache) for name in names):
        return []  # compiled before: numba loads its cache (a kernel whose file changed compiles again)
    return ["numba compiles the accel kernels for this machine on first use: about a minute on 2 cores, once "
            "(cached for the next runs)"]


def backend(build):  # -> the backend object `build` asks for (FactoryError: unknown, or not here)
    check(build)
    make = accel_callable("BACKENDS", build) or own_backend  # every maker: (Build) -> backend
    return make(build)


def own_backend(build):  # -> the reference's own backend `build` asks for: numpy, tensor-parallel numpy, ggml-cpu
    if build.ggml_cpu:
        return GgmlCpuBackend(**ggml_cpu_options(build))
    if build.tp != 1:
        return TensorParallelBackend(np.dtype(build.dtype), build.tp)
    return NumpyBackend(np.dtype(build.dtype))


def ggml_cpu_options(build):  # -> the keyword arguments of GgmlCpuBackend (and its numba twin) `build` asks for
    k_type = build.kv_type or "f16"
    v_type = build.v_type or k_type
    # a quantized V cache needs flash attention: llama.cpp's "auto" turns it on, "off" refuses it
    flash = v_type == "q8_0" if build.flash_attn is None else build.flash_attn
    return {"kv_type": k_type, "flash_attn": flash, "n_threads": build.n_threads, "check_host": False,
            "repack": build.repack is not False, "cpu": build.cpu or DEFAULT_TARGET, "v_type": v_type}


def accel_callable(table, build):  # "BACKENDS" | "TEXT_MODELS", Build -> what accel registers for it, or None
    if build.backend == "numpy":  # the reference's own
        return None
    accel = importlib.import_module(ACCEL)
    entry = getattr(accel, table).get((build.backend, build.numerics))
    if entry is None:
        return None
    module, _, name = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        package, extra = accel.EXTRAS[build.backend]
        raise FactoryError(f"--backend {build.backend} needs {package} ({e}); install the {extra} extra") from None


def text_model(gguf_model, build, be=None):  # GGUFModel (text) -> TextModel on `be` (default: backend(build))
    be = be or backend(build)
    if build.tp != 1:
        check_tp(gguf_model.config, build.tp)
    # a backend with its own text forward (cupy: resident on the device) registers its TextModel
    model = accel_callable("TEXT_MODELS", build) or TextModel
    return model(gguf_model, np.dtype(build.dtype), be)


def vision_model(gguf_model, build, be=None):  # GGUFModel (mmproj) -> VisionModel on `be` (the text model's)
    check_tower(build)
    return VisionModel(gguf_model, np.dtype(build.dtype), be or backend(build))


def drafter(gguf_model, target):  # GGUFModel (dflash), its target TextModel -> Drafter on the target's backend
    return Drafter(gguf_model, target)
