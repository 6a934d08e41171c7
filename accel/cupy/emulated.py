"""CUDA's execution model on the CPU: every kernel of accel/cuda compiled by the host C++ compiler
into one library, and EmulatedRuntime, CupyRuntime's methods over numpy arrays launching them. It
checks the kernels where no GPU is (tests/test_cuda.py; `python -m accel.harness --backend
cupy-emulated`): a CupyBackend on it runs the device code paths bit for bit as written, but on the
CPU's float arithmetic without fused multiply-adds."""
import ctypes
import os
import platform
import re
import shutil
import subprocess
import tempfile
import weakref

import numpy as np

from . import kernels
from .backend import CupyBackend

CXX = shutil.which("g++")


EMULATOR = r"""
// CUDA's execution model on the CPU, for tests. Each thread of a block is a coroutine on this one OS
// thread (its stack made once per launch by makecontext and entered by swapcontext, then switched with
// _setjmp/_longjmp, which make no system call); blocks run one after another, each coroutine looping
// over them. __syncthreads and the warp shuffles are barriers that switch to the next thread. A
// barrier that not every thread reaches, or a shuffle from a lane that is not there, is an error.
#include <math.h>
#include <setjmp.h>
#include <string.h>
#include <ucontext.h>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__ static

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
uint3 blockIdx;
dim3 blockDim, gridDim;

namespace emu {
enum State { RUNNABLE, AT_BLOCK, AT_WARP, DONE };
struct Thread { ucontext_t ctx; jmp_buf jb; uint3 idx; State state; bool started; int shuffles; };
const size_t STACK = 256 * 1024;
std::vector<Thread> threads;
std::vector<char> stacks;
std::vector<int> warp_arrived;
std::vector<unsigned long long> slots[2];
int block_arrived, n_threads;
Thread* current;
ucontext_t scheduler_ctx;
jmp_buf scheduler_jb;
const std::function<void()>* body;
const char* error;

int tid() { return (int)(current - threads.data()); }
int lanes_in_warp(int w) { int n = n_threads - 32 * w; return n < 32 ? n : 32; }

void yield_to_scheduler(State state) {
    current->state = state;
    if (!_setjmp(current->jb)) _longjmp(scheduler_jb, 1);
}

void block_barrier() {
    if (++block_arrived == n_threads) {
        block_arrived = 0;
        for (auto& t : threads) if (t.state == AT_BLOCK) t.state = RUNNABLE;
        return;
    }
    yield_to_scheduler(AT_BLOCK);
}

void warp_barrier() {
    int w = tid() / 32;
    if (++warp_arrived[w] == lanes_in_warp(w)) {
        warp_arrived[w] = 0;
        for (int i = 32 * w; i < 32 * w + lanes_in_warp(w); i++) if (threads[i].state == AT_WARP) threads[i].state = RUNNABLE;
        return;
    }
    yield_to_scheduler(AT_WARP);
}

template <class T> T exchange(T v, int src_lane) {
    int me = tid(), w = me / 32;
    if (src_lane < 0 || src_lane >= lanes_in_warp(w)) { error = "a shuffle reads a lane the warp does not have"; src_lane = me % 32; }
    // two sets of slots, alternating: a lane writes set g % 2 again only after the barrier of
    // shuffle g + 1, which every lane reaches after reading its value of shuffle g
    std::vector<unsigned long long>& set = slots[current->shuffles++ % 2];
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    set[me] = bits;
    warp_barrier();
    bits = set[32 * w + src_lane];
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}

void entry() {
    for (;;) {
        (*body)();
        yield_to_scheduler(DONE);  // resumed for the next block
    }
}

void resume(Thread& t) {
    current = &t;
    if (_setjmp(scheduler_jb)) return;
    if (t.started) _longjmp(t.jb, 1);
    t.started = true;
    swapcontext(&scheduler_ctx, &t.ctx);
}

int launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {  // 0, or 1 with `error` set
    gridDim = grid;
    blockDim = block;
    n_threads = block.x * block.y * block.z;
    body = &kernel;
    error = 0;
    threads.assign(n_threads, Thread());
    if (stacks.size() < n_threads * STACK) stacks.resize(n_threads * STACK);
    warp_arrived.assign((n_threads + 31) / 32, 0);
    for (auto& set : slots) set.assign(n_threads, 0);
    for (int i = 0; i < n_threads; i++) {
        Thread& t = threads[i];
        t.idx = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / (block.x * block.y))};
        t.started = false;
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = stacks.data() + i * STACK;
        t.ctx.uc_stack.ss_size = STACK;
        t.ctx.uc_link = 0;
        makecontext(&t.ctx, entry, 0);
    }
    for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
        blockIdx = {bx, by, bz};
        block_arrived = 0;
        for (auto& t : threads) { t.state = RUNNABLE; t.shuffles = 0; }
        for (;;) {
            bool ran = false, done = true;
            for (auto& t : threads) {
                if (t.state == RUNNABLE) { resume(t); ran = true; }
                done = done && t.state == DONE;
            }
            if (error) return 1;
            if (done) break;
            if (!ran) { error = "deadlock: a barrier that not every thread of the block reaches"; return 1; }
        }
    }
    return 0;
}
}  // namespace emu

#define threadIdx (emu::current->idx)
#define MG_CHECK_ALIGNED(p, n) if ((unsigned long long)(p) % (n)) emu::error = "a misaligned load (it faults on the device)"
inline void __syncthreads() { emu::block_barrier(); }
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) { return emu::exchange(v, emu::tid() % 32 ^ mask); }
extern "C" const char* emu_error() { return emu::error ? emu::error : ""; }
"""

_CTYPES = {"ptr": ctypes.c_void_p, "int": ctypes.c_int, "i64": ctypes.c_longlong, "float": ctypes.c_float,
           "double": ctypes.c_double}


def build_emulator(out_dir):  # -> (shared library path, {kernel: parameter kinds})
    """Every kernel file in one C++ translation unit, each kernel with a host entry point
    emu_<name>(grid, block, its own parameters) that runs it under the emulator."""
    units, entries, params = [EMULATOR], [], {}
    for filename in kernels.FILES:
        text = kernels.source(filename)
        units.append(f'#include "{filename}"')
        for name, plist in kernels.KERNEL_DECLARATION.findall(text):
            decls = [" ".join(p.split()) for p in plist.split(",")]
            names = [re.findall(r"\w+", d)[-1] for d in decls]
            entries.append(f'extern "C" int emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
                           f'unsigned bz, {", ".join(decls)}) {{ return emu::launch(dim3{{gx, gy, gz}}, '
                           f'dim3{{bx, by, bz}}, [&] {{ {name}({", ".join(names)}); }}); }}')
        params.update(kernels.kernel_params(text))
    source, library = os.path.join(out_dir, "emulated.cpp"), os.path.join(out_dir, "emulated.so")
    with open(source, "w") as f:
        f.write("\n".join(units + entries) + "\n")
    # -ffp-contract=off: no fused multiply-adds but the kernels' explicit fma(), as -fmad=false on the device
    subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-U_FORTIFY_SOURCE",
                    "-I", kernels.CUDA_DIR, source, "-o", library], check=True, capture_output=True)
    return library, params


GUARD = 256  # bytes of 0xFF before and after every array: a kernel writing outside one is caught


class EmulatedRuntime:
    """CupyRuntime's methods over numpy arrays, launching the emulated kernels. A capture records
    the launches (as stream capture does, running none) and its graph replays them."""

    def __init__(self, library, params):
        self.lib = ctypes.CDLL(library)
        self.lib.emu_error.restype = ctypes.c_char_p
        self.params, self.functions, self.buffers, self.recording = params, {}, [], None
        for name, kinds in params.items():
            fn = getattr(self.lib, "emu_" + name)
            fn.argtypes = [ctypes.c_uint] * 6 + [_CTYPES[k] for k in kinds]
            fn.restype = ctypes.c_int
            self.functions[name] = fn

    def outside_capture(self, what):  # as on the device: a capturing stream takes launches only
        if self.recording is not None:
            raise RuntimeError(f"{what} while a stream captures")

    def empty(self, shape, dtype=np.float32):
        self.outside_capture("allocation")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buffer = np.full(n + 2 * GUARD, 0xFF, np.uint8)
        self.buffers.append(weakref.ref(buffer))
        return buffer[GUARD:GUARD + n].view(dtype).reshape(shape)

    def zeros(self, shape, dtype=np.float32):
        return self.full(shape, 0, dtype)

    def full(self, shape, value, dtype):
        a = self.empty(shape, dtype)
        a[...] = value
        return a

    def to_device(self, host):
        self.outside_capture("copy to the device")
        host = np.ascontiguousarray(host)
        a = self.empty(host.shape, host.dtype)
        a[...] = host
        return a

    def to_host(self, dev):
        self.outside_capture("copy to the host")
        return np.array(dev)

    def copy_in(self, dev, host):
        self.outside_capture("copy to the device")
        np.copyto(dev, host)

    def synchronize(self):
        pass

    def launch(self, name, grid, block, *args):
        kernels.check_args(name, self.params[name], args)
        if self.recording is not None:
            self.recording.append((name, grid, block, args))
        else:
            self.run(name, grid, block, args)

    def run(self, name, grid, block, args):
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        values = [None if a is None else a.ctypes.data if kind == "ptr" else a
                  for kind, a in zip(self.params[name], args)]
        if self.functions[name](*grid, *block, *values):
            raise RuntimeError(f"{name}: {self.lib.emu_error().decode()}")
        self.buffers = [ref for ref in self.buffers if ref() is not None]
        for ref in self.buffers:
            b = ref()
            if b is not None and ((b[:GUARD] != 0xFF).any() or (b[-GUARD:] != 0xFF).any()):
                raise RuntimeError(f"{name} wrote outside an array")

    def capture(self, issue):
        self.recording = []
        try:
            issue()
        finally:
            launches, self.recording = self.recording, None
        return RecordedGraph(self, launches)


class RecordedGraph:
    def __init__(self, rt, launches):
        self.rt, self.launches = rt, launches

    def replay(self):
        for launch_args in self.launches:
            self.rt.run(*launch_args)


def emulated_backend(build=None):  # -> CupyBackend (float32) on a freshly built EmulatedRuntime; RuntimeError: why not
    if CXX is None:
        raise RuntimeError("g++ not found: the CPU emulation of the kernels needs a C++ compiler")
    if platform.system() != "Linux":
        raise RuntimeError("the CPU emulation of the kernels uses Linux's ucontext")
    build_dir = tempfile.TemporaryDirectory()
    runtime = EmulatedRuntime(*build_emulator(build_dir.name))
    runtime.build_dir = build_dir  # the library lives as long as the runtime
    return CupyBackend(np.float32, runtime=runtime)
