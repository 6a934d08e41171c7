"""numba CPU backend: NumbaBackend has the interface of reference/backend.py NumpyBackend."""
import numba

# numba's default OpenMP pool spins after each kernel, and so does OpenBLAS's pool after each numpy
# product; when both run in one process (this backend next to the numpy reference, in tests and
# benchmarks) the two spinning pools slowed a tiny-model prefill 10x on 2 cores. The workqueue
# pool sleeps between kernels. (Without effect once a parallel numba kernel has run in the process.)
numba.config.THREADING_LAYER = "workqueue"

from .backend import NumbaBackend  # noqa: E402

__all__ = ["NumbaBackend"]
