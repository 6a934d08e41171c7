"""The engines the accelerator benchmarks time, each as (prefill(ids) -> logits, decode(id) -> logits):
this reference on a backend, its numba ggml-cpu twin, and llama.cpp through llama-cpp-python; and the
helpers every subcommand of tools.bench_accel shares (timing, warm-up, logit agreement, threads)."""
import sys
import time

import numpy as np

from reference import factory, gguf
from reference.cli import UsageError

LAST_BATCH = 2048  # llama.cpp's batch with --logits last: its logits buffer is one batch of rows
DECODE_ROOM = 64  # the decode steps every engine's context holds after its prompt


def reference_engine(path, backend, last=False, room=DECODE_ROOM):  # -> (prefill(ids) -> logits, decode(id) -> logits)
    """`last`: the prefill computes and returns the last position's logits only ([1, V]). The prompt
    goes in chunks of LAST_BATCH, as llama.cpp's; `room`: decode steps the cache holds after it."""
    lm = factory.text_model(gguf.load(path, "text"), factory.Build(backend=backend))
    state = {}

    def prefill(ids):
        chunk = min(len(ids), LAST_BATCH)
        state["cache"] = lm.new_cache(len(ids) + room, "ring", chunk)
        return lm.prefill(ids, state["cache"], chunk, out_rows=np.array([len(ids) - 1]) if last else None)

    def decode(token):
        return lm.prefill([token], state["cache"], 1)[-1]
    return prefill, decode


def ggml_engine(path, threads, last=False, room=DECODE_ROOM):  # -> (prefill, decode): GgmlCpuNumbaBackend as llama_cpp_engine's context
    """llama.cpp's defaults (F16 KV cache, flash attention off), weights outside the CPU_REPACK buffer
    (repack=False, as use_extra_bufts=False loads them) and the same ubatches: the same logits."""
    build = factory.Build(backend="numba", numerics="ggml-cpu", repack=False, n_threads=threads)
    lm = factory.text_model(gguf.load(path, "text"), build)
    state = {}

    def prefill(ids):
        state["cache"] = lm.new_cache(len(ids) + room, "uniform")
        chunk = min(len(ids), LAST_BATCH) if last else len(ids)
        return lm.prefill(ids, state["cache"], chunk, out_rows=np.array([len(ids) - 1]) if last else None)

    def decode(token):
        return lm.prefill([token], state["cache"], 1)[-1]
    return prefill, decode


def llama_cpp_engine(path, threads, n_prompt, last=False):  # -> (prefill, decode) as reference_engine
    """Room for n_prompt + DECODE_ROOM tokens. The prompt in one batch with logits_all; with `last`, in batches of LAST_BATCH with the last
    row's logits only (llama-cpp-python keeps none then: they are read from the context). The weights
    load into plain CPU buffers (use_extra_bufts=False): on a CPU with AMX, llama.cpp's AMX extra
    buffer crashes on quantized weights, and the CPU_REPACK one would change its kernels."""
    try:
        import llama_cpp
    except ImportError as e:
        raise UsageError(f"the llama-cpp engine needs llama-cpp-python, the parity extra ({e})") from None
    from tools.common import plain_cpu_buffers
    plain_cpu_buffers(llama_cpp.llama_cpp)
    n_batch = min(n_prompt, LAST_BATCH) if last else n_prompt
    llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=n_prompt + DECODE_ROOM,
                          n_batch=n_batch, n_ubatch=n_batch, logits_all=not last, verbose=False)

    def last_row():  # -> [V] the logits of the one row the last batch computed
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()

    def prefill(ids):
        llm.reset()
        llm.eval(ids)
        return last_row()[None] if last else np.array(llm.scores[:len(ids)])

    def decode(token):
        llm.eval([token])
        return last_row() if last else np.array(llm.scores[llm.n_tokens - 1])
    return prefill, decode


def command_line():  # -> the command that is running, as the reports record it
    return " ".join(["python -m tools.bench_accel"] + sys.argv[1:])


def timed(fn, *args):  # -> (result, wall seconds, CPU seconds of all threads of this process)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - t0, time.process_time() - c0


def warmed(make_engine, ids):  # -> (prefill, decode) of a new engine after one short prefill and one decode step
    prefill, decode = make_engine()
    prefill(ids[:8])  # warm-up: JIT compilation or the numba cache, page faults of the weights
    decode(ids[0])
    return prefill, decode


def agreement(ref, x):  # -> {nmse, max_abs_diff, top1} over the positions both kept
    from reference.metrics import max_abs_diff, nmse
    return {"nmse": float(nmse(ref.ravel(), x.ravel())), "max_abs_diff": float(np.max(max_abs_diff(ref, x))),
            "top1": float(np.mean(ref.argmax(-1) == x.argmax(-1)))}


def set_threads(n):  # numba's thread count, or UsageError where numba is missing
    try:
        import numba
    except ImportError as e:
        raise UsageError(f"needs numba, the accel extra ({e})") from None
    try:
        numba.set_num_threads(n)
    except ValueError as e:  # NUMBA_NUM_THREADS set below the core count
        raise UsageError(f"--threads {n}: {e}") from None


def text_vocab(path):  # -> n_vocab of a text GGUF; GGUFError for anything else, before any engine starts
    return gguf.load(path, "text").config.n_vocab


def prompt_ids(n_vocab, n, rng):  # -> n random ids of the vocabulary
    # the last three ids of make_synthetic's vocabulary are BOS, EOS and EOT: the prompt is ordinary tokens
    return [int(i) for i in rng.integers(0, max(n_vocab - 3, 1), n)]
