"""numba twins of reference/ggml_cpu: the same files and function names, the same float32 operations
in the same order, so each kernel is bit-identical to its NumPy statement (tests/test_numba_ggml.py).
Integer sums may run in any order (they are exact); float code is compiled without fastmath, so LLVM
keeps every rounding and never reassociates."""
from .backend import GgmlCpuNumbaBackend

__all__ = ["GgmlCpuNumbaBackend"]
