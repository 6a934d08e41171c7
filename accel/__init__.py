"""The ops of reference/, faster. `make_backend` is the one entry point the command line uses, so
that reference/ imports accel only when a faster backend is asked for."""


class BackendError(Exception):
    """A backend that cannot be made here (unknown name, missing package); one-line message."""


def make_backend(name, dtype):  # "numpy" | "numba", dtype -> backend object
    if name == "numpy":
        from reference.backend import NumpyBackend
        return NumpyBackend(dtype)
    if name == "numba":
        try:
            from .numba import NumbaBackend
        except ImportError as e:
            raise BackendError(f"--backend numba needs numba ({e}); install the accel extra") from None
        return NumbaBackend(dtype)
    raise BackendError(f"unknown backend {name!r} (numpy or numba)")
