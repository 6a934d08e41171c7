"""The ops of reference/, faster. reference/factory.py finds them through the tables below, importing
a module only when its backend is asked for, so that reference/ never names numba or CuPy."""
import numpy as np

from reference.factory import FactoryError

BACKENDS = {  # (--backend, --numerics) -> "module:callable": (factory.Build) -> the backend, as factory.own_backend
    ("numba", "exact"): "accel.numba.backend:numba_backend",
    ("numba", "ggml-cpu"): "accel.numba.ggml.backend:ggml_cpu_numba_backend",
    ("cupy", "exact"): "accel:cupy_backend",
}
TEXT_MODELS = {  # (--backend, --numerics) -> "module:callable": a TextModel of the backend's own (gguf_model, dtype, backend)
    ("cupy", "exact"): "accel.cupy.text:DeviceTextModel",
}
EXTRAS = {"numba": ("numba", "accel"), "cupy": ("CuPy", "cuda")}  # --backend -> (package it needs, extra installing it)


class BackendError(FactoryError):
    """A backend that cannot be made here (a missing package or device); one-line message."""


def cupy_backend(build):  # factory.Build -> CupyBackend on the current CUDA device, or BackendError saying why not
    try:
        import cupy
    except ImportError as e:
        raise BackendError(f"--backend cupy needs CuPy ({e}); install the cuda extra") from None
    from .cupy import CupyBackend
    try:
        return CupyBackend(np.dtype(build.dtype))
    except ValueError as e:
        raise BackendError(f"--backend cupy: {e}") from None
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise BackendError(f"--backend cupy needs an NVIDIA GPU ({e})") from None
