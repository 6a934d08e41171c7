"""The build the mode models by default; the CPU targets and how this machine differs from them are
in target.py."""
BUILD = "llama.cpp 0c1e570 (llama-cpp-python 0.3.36), GCC, llamafile + CPU repack, glibc 2.36, 2 threads"
BUILD_GLIBC = "2.36"
KV_TYPES = ("f16", "f32", "q8_0")
UBATCH = 512  # llama-cpp-python's n_batch = n_ubatch: a longer prompt is computed 512 rows at a time


class GgmlCpuError(Exception):
    """A request the emulation does not model (KV type, weight type, kernel path); one line."""
