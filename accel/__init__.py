"""The ops of reference/, faster. `make_backend` is the one entry point the command line uses, so
that reference/ imports accel only when a faster backend is asked for."""


class BackendError(Exception):
    """A backend that cannot be made here (unknown name, missing package); one-line message."""


def make_backend(name, dtype):  # "numpy" | "numba" | "cupy", dtype -> backend object
    if name == "numpy":
        from reference.backend import NumpyBackend
        return NumpyBackend(dtype)
    if name == "numba":
        try:
            from .numba import NumbaBackend
        except ImportError as e:
            raise BackendError(f"--backend numba needs numba ({e}); install the accel extra") from None
        return NumbaBackend(dtype)
    if name == "cupy":
        return cupy_backend(dtype)
    raise BackendError(f"unknown backend {name!r} (numpy, numba or cupy)")


def cupy_backend(dtype):  # -> CupyBackend on the current CUDA device, or BackendError saying why not
    try:
        import cupy
    except ImportError as e:
        raise BackendError(f"--backend cupy needs CuPy ({e}); install the cuda extra") from None
    from .cupy import CupyBackend
    try:
        return CupyBackend(dtype)
    except ValueError as e:
        raise BackendError(f"--backend cupy: {e}") from None
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise BackendError(f"--backend cupy needs an NVIDIA GPU ({e})") from None
