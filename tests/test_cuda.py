"""The CuPy CUDA backend: kernels in accel/cuda/*.cu, the backend and the device-resident text model
in accel/cupy.

Without a GPU (CI, developers' machines):
- where nvcc is installed, every .cu compiles with it for sm_80 and sm_90, so syntax and type
  errors are caught; the sources as the runtime inlines them compile with NVRTC where libnvrtc is
  installed;
- the kernels themselves run on the CPU: the same .cu files compiled as C++ together with a small
  emulation of CUDA's execution model (EMULATOR below: each thread a coroutine, __syncthreads and
  warp shuffles as barriers, guard zones around every array), behind a runtime with CupyRuntime's
  methods. On it: dequantization bit-exact with gguf-py, accel/harness.py's op cases under its
  gates, the wide decode kernel and the prefill kernel's edge tiles, whole-model logits against the
  numpy reference and against the committed transformers golden, every trace point, the drafter's
  layer inputs, rollback of the cache, graph replay against eager launches (bit for bit) and
  `reference.run --backend cupy`. The emulation also fails a launch on a misaligned load or a write
  outside its arrays, and any copy or allocation while a graph is being captured, as the device would;
- `factory.backend(Build(backend="cupy"))` and `--backend cupy` fail with one line where CuPy or the GPU is missing.
With CuPy and a GPU the op harness, parity and graph checks also run on the device; elsewhere they
are skipped with the reason (a skipped check is not a passed one).

NMSE is sum((ref - x)^2) / sum(ref^2), ref being the oracle.
"""
import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import weakref

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT, GGUFWriter

from accel import BackendError, cuda_harness, harness
from accel.cupy import CupyBackend, kernels, launch
from accel.cupy.text import DeviceTextModel
from reference import factory, gguf, ops
from reference.gguf import Weights
from reference.text import TextModel
from reference.trace import Capture, Tracer, layer_input
from reference.metrics import nmse
from conftest import GOLDEN, IN_CI, MODELS, run_cli

NVCC = shutil.which("nvcc")
CXX = shutil.which("g++")


def gpu_available():  # -> "" when CuPy sees a CUDA device, else why not
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return ""
        return "CuPy sees no CUDA device"
    except ImportError:
        return "CuPy is not installed (pip install -e .[cuda])"
    except Exception as e:  # CUDARuntimeError: no driver or no device
        return f"no CUDA device ({type(e).__name__}: {e})"


NO_GPU = gpu_available()
needs_gpu = pytest.mark.skipif(bool(NO_GPU), reason=f"needs an NVIDIA GPU: {NO_GPU}")


# ---------------------------------------------------------------------------------------------
# Compiling the sources

@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (the CUDA toolkit's compiler)")
def test_every_cu_compiles_with_nvcc_for_sm80_and_sm90(tmp_path):
    jobs = []
    for name in sorted(os.listdir(kernels.CUDA_DIR)):
        if name.endswith(".cu"):
            for arch in ("sm_80", "sm_90"):
                out = tmp_path / f"{name}.{arch}.cubin"
                cmd = [NVCC, *kernels.NVCC_OPTIONS, f"-arch={arch}", "-cubin", "-o", str(out), name]
                jobs.append((name, arch, subprocess.Popen(cmd, cwd=kernels.CUDA_DIR, stdout=subprocess.PIPE,
                                                          stderr=subprocess.STDOUT, text=True)))
    assert len(jobs) >= 2 * len(kernels.FILES)
    for name, arch, job in jobs:
        log = job.communicate(timeout=600)[0]
        assert job.returncode == 0, f"{name} for {arch}:\n{log}"
        assert "warning" not in log.lower(), f"{name} for {arch}:\n{log}"


def find_nvrtc():  # -> loaded libnvrtc, or None
    import ctypes.util
    candidates = [ctypes.util.find_library("nvrtc"), "libnvrtc.so", "libnvrtc.so.13"]
    try:  # the nvidia-cuda-nvrtc wheel, as CuPy finds it
        import nvidia.cu13
        candidates.append(os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so.13"))
    except ImportError:
        pass
    for c in filter(None, candidates):
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


NVRTC = find_nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc to compile as CuPy does)")
@pytest.mark.parametrize("filename", kernels.FILES)
def test_runtime_source_compiles_with_nvrtc(filename):
    """What CupyRuntime hands to cupy.RawModule: includes inlined, no headers, CuPy's own -ftz=true last."""
    program = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(program), kernels.source(filename).encode(), filename.encode(),
                                    0, None, None) == 0
    options = [*kernels.NVRTC_OPTIONS, "-arch=compute_90", "-ftz=true"]
    rc = NVRTC.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*map(str.encode, options)))
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(program, log)
    assert rc == 0 and "warning" not in log.value.decode().lower(), log.value.decode()


def test_every_kernel_named_in_python_exists_and_its_parameters_parse():
    params = {}
    for filename in kernels.FILES:
        params.update(kernels.kernel_params(kernels.source(filename)))
    named = set()
    for module in ("launch", "backend", "text"):
        with open(os.path.join(os.path.dirname(kernels.__file__), module + ".py")) as f:
            named |= set(re.findall(r'(?:rt\.launch\(|elementwise\([^"]*)"(\w+)"', f.read()))
    assert named <= set(params), sorted(named - set(params))
    assert all(params.values())


# ---------------------------------------------------------------------------------------------
# The kernels on the CPU

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


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):  # -> EmulatedRuntime
    if CXX is None:  # CI's machine has one: there a missing compiler must not pass as ~95 skips
        (pytest.fail if IN_CI else pytest.skip)("g++ not found: the CPU emulation of the kernels needs a C++ compiler")
    if platform.system() != "Linux":
        pytest.skip("the CPU emulation of the kernels uses Linux's ucontext")
    return EmulatedRuntime(*build_emulator(str(tmp_path_factory.mktemp("emulated"))))


@pytest.fixture(scope="module")
def backend(emulated):  # CupyBackend on the emulated runtime
    return CupyBackend(np.float32, runtime=emulated)


def one_tensor_gguf(path, name, values):  # -> Weights of a GGUF holding one tensor (its numpy dtype's type)
    w = GGUFWriter(path, "test")
    w.add_tensor(name, values)
    gguf.write_out(w)
    return Weights(gguf.open_reader(path), path)


def test_float16_decoding_matches_numpy_for_every_bit_pattern(backend, tmp_path):
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(1, -1)
    weights = one_tensor_gguf(str(tmp_path / "f16.gguf"), "f16", every)
    assert weights.type_name("f16") == "F16"
    got = dequantized(backend, weights, "f16")
    assert np.array_equal(got.view(np.uint32), every.astype(np.float32).view(np.uint32))


def dequantized(backend, weights, name):  # -> the device kernel's float32 rows of a tensor
    t = backend.tensor(weights.tensor(name))
    out = backend.rt.empty((t.n_out, t.n_in))
    launch.dequantize_rows(backend.rt, t, 0, t.n_out, out, backend.tables)
    return backend.rt.to_host(out)


@pytest.mark.parametrize("qtype", sorted(kernels.KERNEL_TYPES, key=int), ids=lambda t: t.name)
def test_dequantization_is_bit_exact_with_gguf_py(backend, qtype):
    """Random blocks (every bit pattern but the f16 scales is a valid block); 32 rows, so the
    IQ sign tables see each of their 128 entries."""
    weights = harness.TensorFile([("w", qtype, 32, 512)], np.random.default_rng(int(qtype))).weights
    got = dequantized(backend, weights, "w")
    assert np.array_equal(got.view(np.uint32), weights.get("w").view(np.uint32))


@pytest.mark.parametrize("name", ["tiny-b-q4_k_m.gguf", "tiny-b-iq2_xxs.gguf", "tiny-b-iq4_xs.gguf",
                                  "tiny-b-q6_k.gguf", "tiny-b-bf16.gguf"])
def test_dequantization_of_the_converters_tensors(backend, name):
    weights = gguf.load(os.path.join(MODELS, name), "text").weights
    seen = set()
    for tensor in weights.tensors:
        if launch.supported(weights.tensor(tensor)) and weights.type_name(tensor) not in seen:
            seen.add(weights.type_name(tensor))
            assert np.array_equal(dequantized(backend, weights, tensor).view(np.uint32),
                                  weights.get(tensor).view(np.uint32)), tensor
    assert seen


F32_CASES = [c for c in harness.all_cases() if c.dtype == "float32"]


@pytest.mark.parametrize("case", F32_CASES, ids=lambda c: f"{c.op} {c.name}")
def test_op_harness_case(backend, case):
    """accel/harness.py's cases and gates (its docstring gives them; the products' float32 sums of
    8 terms sit near NMSE 4e-15, under its 1e-11). CupyBackend has no float64 kernels."""
    err, diff, gate, problem = harness.check(case, backend)
    assert not problem, f"{problem} (max |diff| {diff:.3g})"


@pytest.mark.parametrize("qtype, n_out, n_in, T", [
    (GT.IQ2_XXS, 4100, 256, 1),   # 4 rows per warp in the decode kernel, a partial last warp
    (GT.Q6_K, 4100, 256, 2),
    (GT.Q8_0, 130, 352, 70),      # prefill: a K-step past the row's end, 3 row tiles, 2 token tiles
    (GT.F16, 70, 200, 130),
], ids=lambda v: v.name if isinstance(v, GT) else str(v))
def test_product_edges(backend, qtype, n_out, n_in, T):
    weights = harness.TensorFile([("w", qtype, n_out, n_in)], np.random.default_rng(1)).weights
    x = np.random.default_rng(2).standard_normal((T, n_in)).astype(np.float32)
    ref = ops.linear(x, weights.get("w", np.float64))
    got = backend.linear(x, weights.tensor("w"))
    assert nmse(ref.ravel(), got.ravel()) <= harness.GATES["linear"][0]


@pytest.mark.parametrize("rows, warps, blocks", [(1, 1, 2048), (2, 3, 2), (4, 4, 1), (2, 8, 3)])
@pytest.mark.parametrize("qtype, n_out, n_in", [
    (GT.IQ2_XXS, 7, 1280),   # 5 chunks: fewer than some warp counts, uneven over others; a partial last block
    (GT.F16, 9, 1288),       # a row that ends 8 values into its last chunk: lanes of one warp end apart
], ids=lambda v: v.name if isinstance(v, GT) else str(v))
def test_decode_kernel_shapes(backend, qtype, n_out, n_in, rows, warps, blocks):
    """launch.matvec under the shapes accel.cuda_harness tune tries, on rows they split unevenly, and
    with fewer blocks than row groups (a block loops over several)."""
    weights = harness.TensorFile([("w", qtype, n_out, n_in)], np.random.default_rng(1)).weights
    x = np.random.default_rng(2).standard_normal((2, n_in)).astype(np.float32)
    rt, t = backend.rt, backend.tensor(weights.tensor("w"))
    y = rt.empty((2, n_out))
    launch.matvec(rt, (int(t.qtype), t.data, t.row_bytes, n_out, n_in, rt.to_device(x), n_in, y, n_out),
                  backend.tables, n_out, 2, rows, warps, blocks)
    ref = ops.linear(x, weights.get("w", np.float64))
    assert nmse(ref.ravel(), rt.to_host(y).ravel()) <= harness.GATES["linear"][0]


def test_attention_of_vision_windows(backend):
    """The tower's window_attention: each window's keys all visible and no GQA, the spans kernel."""
    q, k, v = (np.random.default_rng(i).standard_normal((20, 2, 48)).astype(np.float32) for i in range(3))
    got = backend.window_attention(q, k, v, [8, 12], 48 ** -0.5)
    for window in (slice(0, 8), slice(8, 20)):
        n = window.stop - window.start
        ref = ops.attention(q[window], k[window], v[window], np.ones((n, n), bool), 48 ** -0.5)
        assert nmse(ref.ravel(), got[window].ravel()) <= harness.GATES["attention"][0]


def test_float64_is_refused(emulated):
    with pytest.raises(ValueError, match="float32 only"):
        CupyBackend(np.float64, runtime=emulated)


# -- the text model on the device ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-a-f32", "tiny-a-q4_k_m", "tiny-b-f32", "tiny-b-iq2_xxs"])
def test_whole_model_matches_numpy(backend, name):  # tiny-a's norm eps (1e-5) shows eps bugs tiny-b's hides
    """Prefill (one chunk and chunks of 3), decode steps and ring vs uniform, each under
    cuda_harness.MODEL_GATE (1e-11, its reason there); measured on this emulation: NMSE 1.2e-13
    (tiny-b) .. 3.8e-13 (tiny-a), max |diff| <= 1.2e-5."""
    records = cuda_harness.check_model(backend, os.path.join(MODELS, name + ".gguf"), cuda_harness.PROMPT[:8],
                                       n_decode=2, chunk=3)
    for r in records:
        assert r["passed"] and r["top1"] == 1.0, r


@pytest.mark.parametrize("checkpoint", ["tiny-a", "tiny-b"])
def test_logits_match_the_transformers_golden(backend, checkpoint):
    """The 7-token golden and its first 3 decode steps fed its own continuation. Gate: the
    reference's for f32 against transformers (1e-10, test_text_parity.EXACT); the kernels' float32
    group sums add ~1e-13."""
    run_dir = os.path.join(GOLDEN, "logits", "transformers", checkpoint)
    with open(os.path.join(run_dir, "manifest.json")) as f:
        entry = next(e for e in json.load(f)["entries"] if e["id"] == "len7")
    golden = np.load(os.path.join(run_dir, entry["file"]), allow_pickle=False)
    golden_steps = np.load(os.path.join(run_dir, entry["greedy"]["decode_logits"]), allow_pickle=False)[:3]
    lm = DeviceTextModel(gguf.load(os.path.join(MODELS, f"{checkpoint}-f32.gguf"), "text"), np.float32, backend)
    cache = lm.new_cache(16)
    logits = lm.prefill(entry["token_ids"], cache)
    steps = np.stack([lm.prefill([t], cache)[-1] for t in entry["greedy"]["tokens"][:3]])
    assert nmse(golden.ravel(), logits.ravel()) <= 1e-10
    assert nmse(golden_steps.ravel(), steps.ravel()) <= 1e-10
    assert np.array_equal(golden.argmax(-1), logits.argmax(-1))


def test_graph_replay_equals_eager_launches(backend):
    r = cuda_harness.check_graph(backend, os.path.join(MODELS, "tiny-b-f32.gguf"), n_decode=3)
    assert r["passed"], r


def test_trace_points_match_the_reference(backend):
    """Every point of an eager device step: the reference's names in its order, its shapes, and
    its values (NMSE per point under the whole-model gate)."""
    model = gguf.load(os.path.join(MODELS, "tiny-b-q4_k_m.gguf"), "text")
    traces = []
    for lm in (TextModel(model), DeviceTextModel(model, np.float32, backend)):
        trace = Tracer(keep_in_memory=True)
        lm.prefill([497, 5, 17, 99, 123], lm.new_cache(8), trace=trace)
        traces.append(trace.points)
    ref, dev = traces
    assert list(dev) == list(ref)
    for name in ref:
        assert dev[name].shape == ref[name].shape, name
        assert nmse(ref[name].ravel(), dev[name].ravel()) <= cuda_harness.MODEL_GATE, name


def test_per_op_path_with_a_reference_cache(backend):
    """DeviceTextModel given a reference KVCache: TextModel's forward, each op a CupyBackend kernel
    on the emulated runtime (its device methods replace none of TextModel's). The reference's
    logits, prefill and decode, under the whole-model gate, as the device path's; both paths agree."""
    model = gguf.load(os.path.join(MODELS, "tiny-b-q4_k_m.gguf"), "text")
    ref_lm, dev_lm = TextModel(model), DeviceTextModel(model, np.float32, backend)
    calls = []
    linear = backend.linear
    backend.linear = lambda *a: calls.append(a[1].name) or linear(*a)  # the per-op path's products, by name
    try:
        logits = {}
        runs = (("ref", ref_lm, ref_lm.new_cache(8)), ("per-op", dev_lm, TextModel.new_cache(dev_lm, 8)),
                ("device", dev_lm, dev_lm.new_cache(8)))
        for name, lm, cache in runs:
            first = lm.prefill([497, 5, 17, 99, 123], cache)
            logits[name] = np.concatenate([first, *(lm.prefill([t], cache) for t in (7, 8))])
    finally:
        del backend.linear
    assert "output.weight" in calls and "blk.0.ffn_down.weight" in calls
    for name in ("per-op", "device"):
        assert nmse(logits["ref"].ravel(), logits[name].ravel()) <= cuda_harness.MODEL_GATE, name
    assert nmse(logits["device"].ravel(), logits["per-op"].ravel()) <= cuda_harness.MODEL_GATE


def test_drafter_layer_inputs_and_rollback(backend):
    """The residuals a DFlash drafter reads, and truncate() (rejected drafts): decoding again after
    a rollback gives the logits of the first time."""
    model = gguf.load(os.path.join(MODELS, "tiny-b-f32.gguf"), "text")
    ref_lm, dev_lm = TextModel(model), DeviceTextModel(model, np.float32, backend)
    wanted = [layer_input(il) for il in (0, 2, ref_lm.cfg.n_layer)]
    inputs = []
    for lm in (ref_lm, dev_lm):
        captured = Capture(wanted)
        lm.forward(lm.embed([497, 5, 17]), np.arange(3), lm.new_cache(8), captured)
        inputs.append(captured.points)
    for name in wanted:
        assert nmse(inputs[0][name].ravel(), inputs[1][name].ravel()) <= cuda_harness.MODEL_GATE, name
    cache = dev_lm.new_cache(12, "ring", 4)
    dev_lm.prefill([497, 5, 17, 99], cache, 4)
    first = [dev_lm.prefill([t], cache, 4)[-1] for t in (7, 8)]
    cache.truncate(4)
    again = [dev_lm.prefill([t], cache, 4)[-1] for t in (7, 8)]
    assert np.array_equal(np.stack(first), np.stack(again))


def test_cli_backend_cupy_runs_the_device_model(backend, monkeypatch, capsys):
    """`python -m reference.run --backend cupy` in process, its backend on the emulated runtime:
    the prompt and greedy tokens of the numpy backend, through DeviceTextModel's graphs."""
    import accel
    from reference import run
    monkeypatch.setattr(accel, "cupy_backend", lambda build: backend)  # the registry's "accel:cupy_backend"
    outputs = []
    for name in ("numpy", "cupy"):
        args = ["--model", os.path.join(MODELS, "tiny-b-f32.gguf"), "--backend", name, "--n-predict", "3", "--json"]
        assert run.main(args) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1]["tokens"] == outputs[0]["tokens"] and outputs[1]["prompt_tokens"] == outputs[0]["prompt_tokens"]


# ---------------------------------------------------------------------------------------------
# Without CuPy or a GPU: one line, exit 2

def test_cupy_backend_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(BackendError, match="needs CuPy"):
        factory.backend(factory.Build(backend="cupy"))


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present: --backend cupy runs here")
def test_cli_backend_cupy_without_gpu_is_one_line_and_exit_2():
    r = run_cli("reference.run", "--backend", "cupy", "--n-predict", "1")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--backend cupy needs" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# On the GPU

@pytest.fixture(scope="module")
def gpu_backend():
    return CupyBackend(np.float32)


@needs_gpu
@pytest.mark.parametrize("case", F32_CASES, ids=lambda c: f"{c.op} {c.name}")
def test_gpu_op_harness_case(gpu_backend, case):
    err, diff, gate, problem = harness.check(case, gpu_backend)
    assert not problem, f"{problem} (max |diff| {diff:.3g})"


@needs_gpu
@pytest.mark.parametrize("name", cuda_harness.PARITY_MODELS)
def test_gpu_whole_model_matches_numpy(gpu_backend, name):
    for r in cuda_harness.check_model(gpu_backend, os.path.join(MODELS, name + ".gguf")):
        assert r["passed"], r


@needs_gpu
def test_gpu_graph_replay_equals_eager_launches(gpu_backend):
    for name in ("tiny-a-f32", "tiny-b-iq2_xxs"):
        r = cuda_harness.check_graph(gpu_backend, os.path.join(MODELS, name + ".gguf"))
        assert r["passed"], r
