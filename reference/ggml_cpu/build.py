"""The build the mode models, and how this machine's own llama.cpp build would differ from it."""
import os
import platform

BUILD = ("llama.cpp 0c1e570 (llama-cpp-python 0.3.36), x86-64 GCC -march=native, "
         "AVX512 F/BW/DQ/VL/VNNI/BF16, llamafile + CPU repack, glibc 2.36, 2 threads")
BUILD_CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "fma", "f16c")
BUILD_GLIBC = "2.36"
KV_TYPES = ("f16", "f32", "q8_0")
UBATCH = 512  # llama-cpp-python's n_batch = n_ubatch: a longer prompt is computed 512 rows at a time


class GgmlCpuError(Exception):
    """A request the emulation does not model (KV type, weight type, kernel path); one line."""


def host_differences():  # -> [str]: how this machine's llama.cpp build would differ from BUILD
    found = []
    if platform.machine() not in ("x86_64", "AMD64"):
        found.append(f"CPU architecture {platform.machine()}, not x86-64")
    elif os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        missing = [flag for flag in BUILD_CPU_FLAGS if flag not in flags]
        if missing:
            found.append(f"CPU lacks {' '.join(missing)}")
    libc, version = platform.libc_ver()
    if (libc, version) != ("glibc", BUILD_GLIBC):
        found.append(f"C library {libc or 'unknown'} {version}, not glibc {BUILD_GLIBC} (expf/cosf/sinf/tanhf "
                     "may differ in the last bit)")
    return found
