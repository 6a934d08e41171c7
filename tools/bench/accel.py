"""Benchmarks of the accelerated backends on a mid-size synthetic model with the real widths of
Muse-Glimmer-30B (n_embd 6656, n_ff 19968, 32/2 heads of 128, vocab 202048) and 2 layers (one
sliding-window, one full): prefill and decode tokens/s of the numba backend, the numpy reference
and llama.cpp (llama-cpp-python) with the same number of threads, as ratios from one run.

    python -m tools.bench_accel make --llama-bin DIR [--out build/bench]
        writes mid-f16.gguf (seeded random weights) and, with llama-quantize from DIR,
        mid-q4_k_m.gguf and mid-iq2_xxs.gguf (a uniform importance matrix stands in for calibration)
    python -m tools.bench_accel make --layout 30b [--out build/bench]
        writes 30b-ud-iq2_xxs.gguf (the 52-layer release layout, 9.2 GB) and 30b-mmproj-f16.gguf
    python -m tools.bench_accel run build/bench/mid-q4_k_m.gguf [--threads 2 --prompt-len 64
        --n-decode 8 --engines numba,numpy,llama-cpp --turns --json-out out.json --plot out.png]
        numba-ggml (--numerics ggml-cpu on numba) beside llama-cpp also compares their logits (goal: 0);
        --one-shot runs each engine once in a process of its own: load included, and its peak RSS
    python -m tools.bench_accel kernels build/bench/mid-q4_k_m.gguf [--rows 8192 --tokens 1,64]
        one product per weight type of the file on its first rows: numba's kernel against the
        reference's (gguf-py dequantization, then a float64 matmul), weight-products per second
    python -m tools.bench_accel blocks build/bench/30b-ud-iq2_xxs.gguf [--tokens 1 --threads 2]
        every matrix of one forward of T tokens on its memory-mapped blocks (--numerics ggml-cpu on
        numba), in layer order, timed per weight type against the read floor of the same bytes
    python -m tools.bench_accel table build/bench/30b-ud-iq2_xxs.gguf [-p 512,2048 -n 32 -d 0,2048,16384 -r 1
        -t 2 --engines llama-cpp,numba-ggml,numba --quick --md-out t.md --json-out t.json --plot t.png]
        llama-bench's pp and tg tests for llama.cpp, numba ggml-cpu and numba exact in turns, as a
        markdown table with each engine's speed over llama.cpp's and its logits against llama.cpp's
        (tools/bench/table.py)
    python -m tools.bench_accel gemm build/bench/mid-ud-iq2_xxs.gguf [--tokens 512 --rows 4096 --threads 2]
        the exact mode's prefill product on each weight type's largest matrix against the float32
        FMA peak of the same threads, in turns (tools/bench/gemm.py)
    python -m tools.bench_accel vision build/bench/30b-mmproj-f16.gguf [--image-size 1024 --llama-bin DIR
        --model build/bench/30b-ud-iq2_xxs.gguf --plot out.png]
        one synthetic image through the tower on numba (exact numerics), and with --llama-bin through
        llama-mtmd-cli (its "mtmd batch encoding done" time): seconds each, and numba's share of its speed
    python -m tools.bench_accel ceiling build/bench/mid-q4_k_m.gguf [--threads 2]
        the floor loops of tools/bench/kernel_floor.py on streamed bytes, the decode tokens/s that bounds
        any numba kernel to on this model, and llama.cpp's and numba's decode tokens/s beside it

All engines compute the logits of every prompt position in prefill (llama.cpp with logits_all), as
the reference does. The GGUFs are large (7.5 GB F16): keep them under build/, never commit them.
Needs the `accel` extra, and the `parity` extra for llama.cpp.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
from gguf import GGUFWriter
from tqdm import tqdm

from reference import factory, gguf, ops
from reference.cli import OneLineParser, UsageError, add_json_out, exit_status, flag, int_in, names_in, write_json
from reference.provenance import args_record
from tools.bench.engines import (agreement, command_line, ggml_engine, llama_cpp_engine, prompt_ids, reference_engine,
                                 set_threads, text_vocab, timed, warmed)
from tools.bench.forward import LAYER_BAR, MAX_IMAGE_SIDE, MAX_REPEAT, peak_rss_gb
from tools.synthetic import (ARCH, Q, RELEASE_30B, RELEASE_MMPROJ, TensorSpec, random_spec, stream_gguf, text_keys,
                             text_shapes, write_layout_gguf, write_mmproj_gguf)

MID = replace(RELEASE_30B, n_layer=2)  # one sliding-window layer, one full layer
QUANTS = (("q4_k_m", "Q4_K_M"), ("iq2_xxs", "IQ2_XXS"))
ENGINES = ("numba", "numba-ggml", "numpy", "llama-cpp")  # numba-ggml: --numerics ggml-cpu on numba

# Bounds of the size arguments, checked as they are parsed.
# numba's pool has one thread per core (NUMBA_NUM_THREADS) and set_num_threads refuses more.
MAX_THREADS = os.cpu_count() or 1
# Every engine's prompt logits [prompt_len, n_vocab] float32 are kept for the agreement check:
# 2048 x 202048 x 4 B = 1.65 GB each at the mid model's vocabulary, three engines beside 7.5 GB of weights.
MAX_PROMPT = 2048
# With --logits last only the last position's row is computed and compared; what grows is the KV
# cache of the full layer (2 KB a position at the mid model) and the engines' time.
MAX_LAST_PROMPT = 1 << 17
# kernels: x is [T, n_in] and the output [T, rows]; 4096 tokens of 8192 rows is 134 MB of output.
MAX_TOKENS = 4096
# kernels copies at most a matrix's own rows (the release's tallest has 202048): a larger count takes it whole.
MAX_KERNEL_ROWS = 1 << 20
# ceiling: the floor loops' packed bytes are rows x n_in x 3/4, 1.6 GB at 65536 rows of the widest n_in;
# n_in up to 32768 is wider than any matrix input of the release (n_ff 19968).
MAX_CEILING_ROWS = 1 << 16
MAX_N_IN = 1 << 15


# ---------------------------------------------------------------------------------------------
# Making the models

def f16_spec(dims, name, shape, seed):  # make_synthetic's random rows of a tensor, matrices stored as F16
    spec = random_spec(name, shape, Q.F32, seed, dims.qk_scale)
    if len(shape) == 1:
        return spec
    return TensorSpec(name, shape, Q.F16, lambda start, stop: spec.rows(start, stop).astype(np.float16))


def write_uniform_imatrix(path, dims):  # an importance matrix of ones for every matrix but token_embd
    w = GGUFWriter(path, "imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["uniform"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 1)
    for name, shape in text_shapes(dims):
        if len(shape) == 2 and name != "token_embd.weight":
            w.add_tensor(name + ".in_sum2", np.ones(shape[1], np.float32))
            w.add_tensor(name + ".counts", np.ones(1, np.float32))
    gguf.write_out(w)


def make_release(out):  # -> exit status: the 30B layout's UD-IQ2_XXS text model (9.2 GB) and F16 projector
    """Random blocks of the release mix written directly (no llama-quantize), with the keys and
    tensor types llama.cpp loads a converted file with (tools/synthetic.py)."""
    os.makedirs(out, exist_ok=True)
    for name, write in (("30b-ud-iq2_xxs.gguf", lambda path: write_layout_gguf(path, RELEASE_30B, "ud-iq2_xxs")),
                        ("30b-mmproj-f16.gguf", lambda path: write_mmproj_gguf(path, RELEASE_MMPROJ, "F16", progress=True))):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            write(path + ".part")
            os.replace(path + ".part", path)
    return 0


def llama_tool(llama_bin, name):  # -> the path of llama.cpp's executable `name` in llama_bin; UsageError if none
    path = os.path.join(llama_bin, name)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UsageError(f"--llama-bin {llama_bin}: no executable {name} there")
    return path


def make(args):  # -> exit status
    if args.layout == "30b":
        return make_release(args.out)
    if not args.llama_bin:
        raise UsageError("--layout mid quantizes with llama-quantize: --llama-bin DIR")
    quantize = llama_tool(args.llama_bin, "llama-quantize")  # before writing 7.5 GB of F16
    os.makedirs(args.out, exist_ok=True)
    f16 = os.path.join(args.out, "mid-f16.gguf")
    if not os.path.exists(f16):
        specs = [f16_spec(MID, name, shape, i) for i, (name, shape) in enumerate(text_shapes(MID))]
        stream_gguf(f16 + ".part", ARCH, text_keys(MID), specs, progress=True)
        os.replace(f16 + ".part", f16)
    imatrix = os.path.join(args.out, "mid.imatrix.gguf")
    write_uniform_imatrix(imatrix, MID)
    env = dict(os.environ, LD_LIBRARY_PATH=args.llama_bin)
    for suffix, qtype in QUANTS:
        dst = os.path.join(args.out, f"mid-{suffix}.gguf")
        if not os.path.exists(dst):
            status = subprocess.run([quantize, "--imatrix", imatrix, f16, dst + ".part", qtype, str(args.threads)],
                                    env=env).returncode
            if status:  # llama-quantize has printed why
                raise UsageError(f"llama-quantize exited with status {status} making {dst}")
            os.replace(dst + ".part", dst)
    return 0


# ---------------------------------------------------------------------------------------------
# Running them

def bench_round(engine, ids, n_decode):  # -> (prompt logits, {prefill_s, prefill_cpu_s, decode_s, decode_cpu_s})
    prefill, decode = engine
    logits, wall, cpu = timed(prefill, ids)
    steps = [timed(decode, int(token))[1:] for token in ids[:n_decode]]
    return logits, {"prefill_s": wall, "prefill_cpu_s": cpu, "decode_s": sum(w for w, _ in steps),
                    "decode_cpu_s": sum(c for _, c in steps)}


def best_rounds(rounds, n_prompt, n_decode):  # [(logits, times)] -> (last logits, the best of each time, tok/s)
    best = {key: min(times[key] for _, times in rounds) for key in rounds[0][1]}
    speeds = {"prefill_tok_s": n_prompt / best["prefill_s"], "decode_tok_s": n_decode / best["decode_s"]}
    return rounds[-1][0], {**best, **speeds}


def bench_engine(make_engine, ids, n_decode, repeat):  # -> (prompt logits, {prefill_tok_s, decode_tok_s, ...})
    """The best of `repeat` rounds of (prefill the prompt, decode n_decode tokens after it): on a
    shared machine the least disturbed round is the closest to the engine's own speed. CPU seconds
    (all threads) are reported beside wall seconds: they move less when other jobs share the cores."""
    engine = warmed(make_engine, ids)
    return best_rounds([bench_round(engine, ids, n_decode) for _ in range(repeat)], len(ids), n_decode)


def bench_in_turns(makers, ids, plans):  # plans {name: (n_decode, repeat)} -> {name: (logits, report)}
    """bench_engine's rounds with every engine held at once and the rounds taken in turns (engine 1,
    engine 2, ..., again): a busy spell of a shared machine slows one round of each engine, not one
    engine's every round."""
    engines = {name: warmed(makers[name], ids) for name in plans}
    rounds = {name: [] for name in plans}
    for turn in range(max(repeat for _, repeat in plans.values())):
        for name, (n_decode, repeat) in plans.items():
            if turn < repeat:
                rounds[name].append(bench_round(engines[name], ids, n_decode))
    return {name: best_rounds(rounds[name], len(ids), plans[name][0]) for name in plans}


def engine_makers(args):  # -> {engine name: () -> (prefill, decode)} of the run's model and options
    last = args.logits == "last"
    return {"numba": lambda: reference_engine(args.model, "numba", last),
            "numba-ggml": lambda: ggml_engine(args.model, args.threads, last),
            "numpy": lambda: reference_engine(args.model, "numpy", last),
            "llama-cpp": lambda: llama_cpp_engine(args.model, args.threads, args.prompt_len, last)}


def one_shot(name, args, ids, n_decode, logits_path, conn):  # in a process of its own -> conn gets its times
    """What a user's one command costs: load, one prefill, n_decode steps, nothing warmed; the peak
    RSS is this process's alone (the mapped weights it touched included, as for llama.cpp)."""
    set_threads(args.threads)
    t0, c0 = time.perf_counter(), time.process_time()
    engine = engine_makers(args)[name]()
    load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    logits, times = bench_round(engine, ids, n_decode)
    np.save(logits_path, logits)
    conn.send({**times, "load_s": load_s, "load_cpu_s": load_cpu_s,
               "total_s": load_s + times["prefill_s"] + times["decode_s"],
               "peak_rss_gb": peak_rss_gb()})


def read_through(path):  # -> None: the file's pages into the page cache, as a second run of any command finds them
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


def bench_one_shot(name, args, ids, n_decode):  # -> (prompt logits, report) of one_shot in a spawned process
    """Every engine starts from the same page cache (the model read through first): otherwise the
    first engine pays the disk reads of the mapped weights and the next one finds them cached."""
    import multiprocessing
    read_through(args.model)
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing loaded, nothing compiled
    receive, send = spawn.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "logits.npy")
        t0 = time.perf_counter()
        child = spawn.Process(target=one_shot, args=(name, args, ids, n_decode, path, send))
        child.start()
        send.close()  # the child's end only: its exit without a reply is then an EOF here, not a wait
        try:
            times = receive.recv()
        except EOFError:
            times = None
        child.join()
        if child.exitcode or times is None:
            raise UsageError(f"the {name} engine's process failed (exit status {child.exitcode})")
        times["process_s"] = time.perf_counter() - t0  # the interpreter's start and imports too
        logits = np.load(path)
    return logits, {**times, "prefill_tok_s": len(ids) / times["prefill_s"], "decode_tok_s": n_decode / times["decode_s"]}


def run(args):  # -> report dict
    set_threads(args.threads)
    ids = prompt_ids(text_vocab(args.model), args.prompt_len, np.random.default_rng(0))
    makers = engine_makers(args)
    report = {"model": os.path.basename(args.model), "threads": args.threads, "prompt_len": args.prompt_len,
              "logits": args.logits,
              "command": command_line(),
              "engines": {}, "logits_vs_numba": {}}
    logits = {}
    plans = {name: (args.n_decode_numpy, 1) if name == "numpy" else (args.n_predict, 1 if args.one_shot else args.repeat)
             for name in args.engines}
    results = bench_in_turns(makers, ids, plans) if args.turns else {}
    for name, (n_decode, repeat) in plans.items():
        if args.one_shot:
            results[name] = bench_one_shot(name, args, ids, n_decode)
        logits[name], report["engines"][name] = results.get(name) or bench_engine(makers[name], ids, n_decode, repeat)
        report["engines"][name].update(n_decode=n_decode, repeat=repeat)
        r = report["engines"][name]
        print(f"{name:10s} prefill {r['prefill_tok_s']:8.3f} tok/s ({r['prefill_cpu_s']:7.2f} CPU s)   "
              f"decode {r['decode_tok_s']:8.3f} tok/s ({r['decode_cpu_s'] / n_decode:6.2f} CPU s/token)"
              + (f"   one shot {r['total_s']:7.2f} s (load {r['load_s']:.2f} s), peak RSS {r['peak_rss_gb']:.2f} GB"
                 if args.one_shot else ""), flush=True)
    for name in logits:
        if name != "numba" and "numba" in logits:
            report["logits_vs_numba"][name] = agreement(logits[name], logits["numba"])
    if "numba-ggml" in logits and "llama-cpp" in logits:  # the ggml-cpu mode's goal is 0
        report["logits_vs_numba"]["llama-cpp vs numba-ggml"] = agreement(logits["llama-cpp"], logits["numba-ggml"])
        ggml, lcpp = report["engines"]["numba-ggml"], report["engines"]["llama-cpp"]
        print(f"numba-ggml/llama-cpp: prefill x{ggml['prefill_tok_s'] / lcpp['prefill_tok_s']:.3f}, "
              f"decode x{ggml['decode_tok_s'] / lcpp['decode_tok_s']:.3f}"
              + (f", one shot x{lcpp['total_s'] / ggml['total_s']:.3f} of llama.cpp's speed, peak RSS "
                 f"{ggml['peak_rss_gb'] - lcpp['peak_rss_gb']:+.2f} GB" if args.one_shot else ""))
    ours = report["engines"].get("numba")
    report["ratios"] = {f"numba/{name}": {"prefill_tok_s": ours["prefill_tok_s"] / r["prefill_tok_s"],
                                          "decode_tok_s": ours["decode_tok_s"] / r["decode_tok_s"],
                                          "prefill_per_cpu_s": r["prefill_cpu_s"] / ours["prefill_cpu_s"],
                                          "decode_per_cpu_s": (r["decode_cpu_s"] / r["n_decode"])
                                          / (ours["decode_cpu_s"] / ours["n_decode"])}
                        for name, r in report["engines"].items() if name != "numba" and ours}
    return report


def blocks(args):  # -> {"types": rows of {type, matrices, gb, kernel_s, floor_s, ...}, "total": ...}
    """The products of one forward of `tokens` rows, as the ggml-cpu numba backend makes them (no
    repack: llama.cpp's plain buffers), every 2-D weight but the embedding once in the file's order,
    summed per weight type; then the read floor (kernel_floor.read_floor) over the same bytes in the
    same order. Each weight type's kernel runs once on its first matrix before the timing: numba's
    compilation or its cache is not a forward's cost."""
    from tools.bench import kernel_floor
    set_threads(args.threads)
    weights = gguf.load(args.model, "text").weights  # a text model, or refused before anything is timed
    backend = factory.backend(factory.Build(backend="numba", numerics="ggml-cpu", repack=False, n_threads=args.threads))
    kind = {name: weights.type_name(name) for name, t in weights.tensors.items()  # the file's order
            if len(t.shape) == 2 and name != "token_embd.weight"}
    rng = np.random.default_rng(0)
    xs = {n_in: rng.standard_normal((args.tokens, n_in)).astype(np.float32) for n_in in {weights.shape(m)[1] for m in kind}}
    data = {m: np.asarray(weights.raw(m)).view(np.uint8).reshape(-1) for m in kind}
    words = {m: b[:len(b) // 8 * 8].view(np.uint64) for m, b in data.items()}  # a tensor's last < 8 bytes skipped
    kernel_floor.read_floor(words[next(iter(kind))][:2], args.threads)
    for t in set(kind.values()):
        m = next(m for m in kind if kind[m] == t)
        backend.linear(xs[weights.shape(m)[1]], weights, m)
    kernel_s, floor_s, n_bytes, count = ({t: 0 for t in kind.values()} for _ in range(4))
    for m in kind:
        n_bytes[kind[m]] += data[m].nbytes
        count[kind[m]] += 1
    for m in tqdm(kind, desc="products", unit="matrix"):
        kernel_s[kind[m]] += timed(backend.linear, xs[weights.shape(m)[1]], weights, m)[1]
    for m in kind:
        floor_s[kind[m]] += timed(kernel_floor.read_floor, words[m], args.threads)[1]
    rows = [{"type": t, "matrices": count[t], "gb": n_bytes[t] / 1e9, "kernel_s": kernel_s[t], "floor_s": floor_s[t],
             "kernel_gb_s": n_bytes[t] / 1e9 / kernel_s[t], "floor_gb_s": n_bytes[t] / 1e9 / floor_s[t]} for t in kernel_s]
    total = {key: sum(r[key] for r in rows) for key in ("matrices", "gb", "kernel_s", "floor_s")}
    for r in rows + [{"type": "all", **total}]:
        print(f"{r['type']:8s} {r['matrices']:4d} matrices {r['gb']:7.3f} GB: kernels {r['kernel_s']:7.3f} s "
              f"({r['gb'] / r['kernel_s']:6.2f} GB/s), read floor {r['floor_s']:7.3f} s ({r['gb'] / r['floor_s']:6.2f} GB/s): "
              f"x{r['floor_s'] / r['kernel_s']:.2f} of the floor", flush=True)
    return {"model": os.path.basename(args.model), "threads": args.threads, "tokens": args.tokens,
            "command": command_line(), "types": rows, "total": total}


def slice_gguf(src, dst, n_rows):  # -> names of the largest matrix of each weight type, first n_rows rows copied to dst
    largest = {}
    for t in gguf.open_reader(src).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":  # the embedding is looked up, not multiplied
            if t.tensor_type not in largest or t.n_elements > largest[t.tensor_type].n_elements:
                largest[t.tensor_type] = t
    w = GGUFWriter(dst, "bench")
    for t in largest.values():  # raw blocks [rows, row_bytes]: the shape follows from the row bytes
        w.add_tensor(t.name, np.ascontiguousarray(np.asarray(t.data)[:n_rows]), raw_dtype=t.tensor_type)
    gguf.write_out(w)
    return [t.name for t in largest.values()]


def kernels(args):  # -> rows of {type, tokens, numba_gw_s, numpy_gw_s, ratio, nmse}
    """numba's product against the reference's (gguf-py dequantization, float64 matmul) on the
    same rows and activations in one process, the best of `repeat` rounds each. One engine's rounds
    run together: OpenBLAS threads spin for a while after a call and would slow numba's next one."""
    set_threads(args.threads)
    from reference.metrics import nmse
    numba = factory.backend(factory.Build(backend="numba"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.gguf")
        names = slice_gguf(args.model, path, args.rows)
        weights = gguf.Weights(gguf.open_reader(path), path)
        for name in names:
            (n_out, n_in), type_name = weights.shape(name), weights.type_name(name)
            for T in args.tokens:
                x = np.random.default_rng(0).standard_normal((T, n_in)).astype(np.float32)
                engines = {"numba": lambda: numba.linear(x, weights, name),
                           # rows() dequantizes every call, as the reference does for a matrix too big to cache
                           "numpy": lambda: ops.linear(x, weights.rows(name, slice(None), np.float64))}
                out, best = {}, {}
                for key, fn in engines.items():
                    out[key] = fn()  # warm-up: JIT or the numba cache
                    best[key] = min(timed(fn)[1] for _ in range(args.repeat))
                products = n_out * n_in * T / 1e9
                row = {"type": type_name, "tensor": name, "rows": n_out, "n_in": n_in, "tokens": T,
                       "numba_gw_s": products / best["numba"], "numpy_gw_s": products / best["numpy"],
                       "ratio": best["numpy"] / best["numba"],
                       "nmse": float(nmse(out["numpy"].ravel(), out["numba"].ravel()))}
                print(f"{type_name:8s} {n_out}x{n_in} T={T:<3d}: numba {row['numba_gw_s']:6.2f}, numpy "
                      f"{row['numpy_gw_s']:6.2f} G weight-products/s (x{row['ratio']:.1f}), NMSE {row['nmse']:.1e}",
                      flush=True)
                results.append(row)
    return results


def weights_per_type(path):  # -> {type name: weights of the multiplied matrices}, token_embd is looked up
    counts = {}
    for t in gguf.open_reader(path).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return counts


def ceiling(args):  # -> report dict
    """Decode tokens/s at most, if every kernel ran at its floor loop's speed, against llama.cpp's
    and numba's measured decode in the same process; and numba's own decode kernel of each floor
    type on the model's largest matrix of it, timed in the same rounds as the floors."""
    with tempfile.TemporaryDirectory() as tmp:
        return timed_ceiling(args, os.path.join(tmp, "rows.gguf"))


def ceiling_runs(args, rows_path, counts, rng):  # -> ({(what, name): (run, weight-products)}, floor loops, kernels)
    """The floor loops of every bit width the model's types need, and numba's decode product of each
    type on rows copied from the model (kernel_floor), each a closure timed in the same rounds."""
    from tools.bench import kernel_floor
    numba = factory.backend(factory.Build(backend="numba"))
    low = rng.integers(0, 256, (args.rows, args.n_in // 2), dtype=np.uint8)  # 40 MB in all: streamed, as in decode
    high = rng.integers(0, 256, (args.rows, args.n_in // 4), dtype=np.uint8)
    x = rng.standard_normal(args.n_in).astype(np.float32)
    out = np.empty(args.rows, np.float32)
    loops = {b: kernel_floor.floor_loop(b) for b in {kernel_floor.FLOOR_BITS[t] for t in counts if t in kernel_floor.FLOOR_BITS}}
    if not loops:  # an F16 or IQ-only model: no bound to give
        raise UsageError(f"{args.model}: no weight type with a floor loop ({', '.join(sorted(counts))}; floors: "
                         f"{', '.join(kernel_floor.FLOOR_BITS)})")
    slice_gguf(args.model, rows_path, args.rows)
    weights = gguf.Weights(gguf.open_reader(rows_path), rows_path)
    kernels = {}  # type -> (tensor, its x): numba's decode product (one row of x) on the copied rows
    for name in weights.tensors:
        if weights.type_name(name) in kernel_floor.FLOOR_BITS:
            kernels[weights.type_name(name)] = name, rng.standard_normal((1, weights.shape(name)[1])).astype(np.float32)
    runs = {**{("floor", f"{4 + b}-bit"): (lambda loop=loop: loop(low, high, x, out), args.rows * args.n_in)
               for b, loop in loops.items()},
            **{("kernel", t): (lambda name=name, xk=xk: numba.linear(xk, weights, name),
                               int(np.prod(weights.shape(name)))) for t, (name, xk) in kernels.items()},
            **q4_k_steps(weights, kernels)}
    return runs, loops, kernels


def timed_ceiling(args, rows_path):  # -> report dict; rows_path: where the kernels' rows are copied
    set_threads(args.threads)
    from tools.bench import kernel_floor
    n_vocab = text_vocab(args.model)
    counts = weights_per_type(args.model)
    rng = np.random.default_rng(0)
    runs, loops, kernels = ceiling_runs(args, rows_path, counts, rng)
    for run, _ in runs.values():
        run()  # compile, or load the numba cache
    rounds = {key: [] for key in runs}  # wall seconds of every round

    def time_floors():  # rounds of every loop in turn: the machine's quiet moments count for all of them
        for _ in range(args.repeat_floor):
            for key, (run, _) in runs.items():
                rounds[key].append(timed(run)[1])
    time_floors()
    ids = prompt_ids(n_vocab, args.prompt_len, rng)
    decode = {name: bench_engine(make_engine, ids, args.n_predict, args.repeat)[1]["decode_tok_s"]
              for name, make_engine in (("llama-cpp", lambda: llama_cpp_engine(args.model, args.threads, args.prompt_len)),
                                        ("numba", lambda: reference_engine(args.model, "numba")))}
    time_floors()  # before and after the engines: the best of both for the bound, which only gets looser
    rates = {key: runs[key][1] / min(seconds) / 1e9 for key, seconds in rounds.items()}  # G weight-products/s, best round
    floors = {b: rates["floor", f"{4 + b}-bit"] for b in loops}
    kernel_gw_s = {t: rates["kernel", t] for t in kernels}
    shares = floor_shares(rounds, runs)
    print_rates(floors, shares, rates)
    bound_s = kernel_floor.model_bound(counts, floors)
    llama = decode["llama-cpp"]
    report = {"model": os.path.basename(args.model), "threads": args.threads,
              "command": command_line(), "weights_per_type": counts,
              "floor_gw_s": {f"{4 + b}-bit": v for b, v in floors.items()}, "kernel_gw_s": kernel_gw_s,
              "kernel_over_floor": {t: v / floors[kernel_floor.FLOOR_BITS[t]] for t, v in kernel_gw_s.items()},
              "share_of_floor": {f"{t} {what}": share for (what, t), share in shares.items()},
              "decode_tok_s": decode,
              "bound_tok_s": 1 / bound_s, "bound_over_llama_cpp": 1 / bound_s / llama,
              "numba_over_llama_cpp": decode["numba"] / llama}
    free = sorted(t for t in counts if t not in kernel_floor.FLOOR_BITS)
    print(f"decode at most {report['bound_tok_s']:.2f} tok/s (types without a floor counted free: {free or 'none'}), "
          f"x{report['bound_over_llama_cpp']:.2f} of llama.cpp's {llama:.2f}; numba {decode['numba']:.2f} tok/s, "
          f"x{report['numba_over_llama_cpp']:.2f}")
    return report


def print_rates(floors, shares, rates):  # -> None: each floor loop's rate, each kernel's with its share of its floor
    for b, rate in sorted(floors.items()):
        print(f"floor loop, {4 + b}-bit fields: {rate:6.2f} G weight-products/s")
    for (what, t), share in shares.items():
        label = f"numba's {t} decode kernel" if what == "kernel" else t.replace(" ", " kernel ", 1)
        print(f"{label}: {rates[what, t]:6.2f} G weight-products/s, {share:.0%} of its floor")


def q4_k_steps(weights, kernels):  # -> {("step", name): (run, weight-products)}: kernel_floor.q4_k_step on the Q4_K rows
    if "Q4_K" not in kernels:
        return {}
    from accel.numba import quant
    from tools.bench import kernel_floor
    name, xk = kernels["Q4_K"]
    n_out, n_in = weights.shape(name)
    blocks, out = quant.as_blocks(weights.raw(name), n_out), np.empty(n_out)
    return {("step", f"Q4_K {label}"): (lambda loop=kernel_floor.q4_k_step(scaled): loop(blocks, xk[0], out, quant.TABLES),
                                        n_out * n_in)
            for label, scaled in (("without scales or mins", False), ("without mins", True))}


def floor_shares(rounds, runs):  # -> {(what, type): its speed / its floor's}, the median over the rounds
    """Each round's own ratio: a loop and its floor run next to each other in a round, under the same
    load; the best rounds of each (what the G/s figures give) can fall in different quiet moments."""
    from tools.bench import kernel_floor
    shares = {}
    for key, seconds in rounds.items():
        if key[0] != "floor":
            floor = ("floor", f"{4 + kernel_floor.FLOOR_BITS[key[1].split()[0]]}-bit")
            per_round = [runs[key][1] / s / (runs[floor][1] / f) for s, f in zip(seconds, rounds[floor])]
            shares[key] = float(np.median(per_round))
    return shares


# ---------------------------------------------------------------------------------------------
# The vision tower against llama-mtmd-cli

MTMD_ENCODED = re.compile(rb"mtmd batch encoding done in (\d+) ms")  # mtmd-cli.cpp, after mtmd_batch_encode


def write_ppm(path, rgb):  # uint8 [H, W, 3] -> a binary PPM file, which llama.cpp's stb_image reads
    h, w, _ = rgb.shape
    with open(path, "wb") as f:
        f.write(b"P6\n%d %d\n255\n" % (w, h) + np.ascontiguousarray(rgb, np.uint8).tobytes())


def mtmd_encode_s(cli, model, mmproj, image, threads):  # -> seconds llama-mtmd-cli reports for encoding the image
    """Plain CPU buffers and no warm-up run, as the text engines; stopped once the encoding is
    reported, before the text model would take the embeddings and generate. The tower's image is one
    chunk, encoded in one batch: the first such line is all of it."""
    cmd = [cli, "-m", model, "--mmproj", mmproj, "--image", image, "-p", "x", "-n", "1", "-t", str(threads),
           "--no-repack", "--no-warmup", "--chat-template", "chatml"]
    last = b""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as proc:
        for line in proc.stdout:
            found = MTMD_ENCODED.search(line)
            if found:
                os.killpg(proc.pid, signal.SIGKILL)  # its process group: a wrapper's children too
                return int(found.group(1)) / 1000
            last = line.strip() or last
    raise UsageError(f"llama-mtmd-cli exited with status {proc.returncode} before encoding the image: "
                     f"{last.decode(errors='replace')[:200]}")


def vision(args):  # -> report dict
    from tools.synthetic import synthetic_image
    set_threads(args.threads)
    build = factory.Build(backend="numba")
    tower = factory.vision_model(gguf.load(args.mmproj, "mmproj"), build, factory.backend(build))
    if args.llama_bin:
        cli = llama_tool(args.llama_bin, "llama-mtmd-cli")
        text_vocab(args.model)
    image = synthetic_image(args.image_size, args.image_size, 0, "smooth")
    report = {"mmproj": os.path.basename(args.mmproj), "image_size": args.image_size, "threads": args.threads,
              "command": command_line()}
    if args.llama_bin:  # first: a llama.cpp that fails is found before the tower's minutes
        with tempfile.TemporaryDirectory() as tmp:
            write_ppm(os.path.join(tmp, "image.ppm"), image)
            report["llama_mtmd_cli_s"] = mtmd_encode_s(cli, args.model, args.mmproj, os.path.join(tmp, "image.ppm"),
                                                       args.threads)
    t0 = time.perf_counter()
    report["image_tokens"] = len(tower.encode(image, progress=LAYER_BAR))
    report["numba_s"] = time.perf_counter() - t0
    if args.llama_bin:
        report["numba_over_llama_mtmd_cli"] = report["llama_mtmd_cli_s"] / report["numba_s"]  # of its speed
    return report


def print_vision(report):
    line = f"{report['image_size']}x{report['image_size']} ({report['image_tokens']} tokens): numba {report['numba_s']:.1f} s"
    if "llama_mtmd_cli_s" in report:
        line += (f", llama-mtmd-cli {report['llama_mtmd_cli_s']:.1f} s: numba x{report['numba_over_llama_mtmd_cli']:.2f} "
                 "of its speed")
    print(line)


def plot_vision(report, path):  # -> None: each engine's seconds for the image as bars
    from tools.common import pyplot, save_figure
    plt = pyplot(path)
    seconds = {name: report[key] for name, key in (("numba", "numba_s"), ("llama-mtmd-cli", "llama_mtmd_cli_s"))
               if key in report}
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.bar(list(seconds), list(seconds.values()), color="tab:blue")
    ax.set_ylabel("seconds")
    ax.set_title(f"{report['image_size']} x {report['image_size']} image, {report['threads']} threads")
    fig.suptitle(report["mmproj"])
    fig.tight_layout()
    save_figure(plt, fig, path)


def print_ratios(report):  # the ratios and logit agreements of a run report, one line each
    for pair, ratio in report["ratios"].items():
        print(f"{pair}: prefill x{ratio['prefill_tok_s']:.2f}, decode x{ratio['decode_tok_s']:.2f} (per CPU second: "
              f"prefill x{ratio['prefill_per_cpu_s']:.2f}, decode x{ratio['decode_per_cpu_s']:.2f})")
    for name, a in report["logits_vs_numba"].items():
        pair = name if " vs " in name else f"{name} vs numba"
        print(f"logits {pair}: NMSE {a['nmse']:.3g}, max |diff| {a['max_abs_diff']:.3g}, "
              f"top-1 {a['top1']:.3f}")


def plot_run(report, path):  # -> None: a run report's prefill and decode tokens/s per engine as bars, one image
    from tools.common import pyplot, save_figure
    plt = pyplot(path)
    names = list(report["engines"])
    panels = [("prefill_tok_s", f"prefill, {report['prompt_len']} tokens", "tokens/s"),
              ("decode_tok_s", "decode, one token a step", "tokens/s")]
    if "peak_rss_gb" in report["engines"][names[0]]:  # --one-shot
        panels += [("total_s", "one shot, load included", "seconds"), ("peak_rss_gb", "peak RSS", "GB")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5))
    for ax, (key, title, unit) in zip(axes, panels):
        ax.bar(names, [report["engines"][name][key] for name in names], color="tab:blue")
        ax.set_title(title)
        ax.set_ylabel(unit)
    fig.suptitle(f"{report['model']}, {report['threads']} threads")
    fig.tight_layout()
    save_figure(plt, fig, path)


def token_counts(text):  # argparse type: "1,64" -> [1, 64]
    return [int_in(1, MAX_TOKENS)(t) for t in text.split(",")]


def build_parser():  # subparsers are made with the parent's class: their errors are one line too
    threads = int_in(1, MAX_THREADS)
    repeat = int_in(1, MAX_REPEAT)
    p = OneLineParser(prog="python -m tools.bench_accel", description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("make", help="write the mid-size F16 GGUF and its Q4_K_M and IQ2_XXS quantizations, "
                                    "or the 30B layout's files")
    m.add_argument("--layout", choices=("mid", "30b"), default="mid",
                   help="30b: the 52-layer UD-IQ2_XXS text model and the 50-layer F16 projector")
    m.add_argument("--llama-bin", help="mid: the directory with llama-quantize and its libraries")
    m.add_argument("--out", default=os.path.join("build", "bench"))
    flag(m, "threads", type=threads, default=2)
    r = sub.add_parser("run", help="prefill and decode tokens/s of numba, numpy and llama.cpp on one GGUF")
    add_model(r)
    flag(r, "threads", type=threads, default=2, help="numba and llama.cpp threads (BLAS: OPENBLAS_NUM_THREADS)")
    r.add_argument("--prompt-len", type=int_in(1, MAX_LAST_PROMPT), default=64,
                   help=f"at most {MAX_PROMPT} with --logits all, {MAX_LAST_PROMPT} with --logits last")
    r.add_argument("--logits", choices=("all", "last"), default="all",
                   help="the prompt positions whose logits are computed and compared")
    flag(r, "n_predict", type=int_in(1, MAX_PROMPT), default=8, help="at most --prompt-len")
    r.add_argument("--n-decode-numpy", type=int_in(1, MAX_PROMPT), default=2,
                   help="the numpy reference takes ~30 s a token here")
    r.add_argument("--repeat", type=repeat, default=3, help="rounds per engine, the best counts (numpy: one)")
    r.add_argument("--engines", type=names_in(ENGINES, "engine", once=True), default=["numba", "numpy", "llama-cpp"])
    r.add_argument("--one-shot", action="store_true",
                   help="each engine once in a process of its own, load included: wall seconds and peak RSS")
    r.add_argument("--turns", action="store_true",
                   help="hold every engine at once and take their rounds in turns (ratios fairer on a shared machine)")
    add_json_out(r, "the report")
    r.add_argument("--plot", help="an image of the engines' tokens/s (PNG unless the extension says otherwise)")
    k = sub.add_parser("kernels", help="numba's product against the reference's, per weight type of one GGUF")
    add_model(k)
    k.add_argument("--rows", type=int_in(1, MAX_KERNEL_ROWS), default=8192,
                   help="first rows of each type's largest matrix")
    k.add_argument("--tokens", type=token_counts, default=[1, 64],
                   help="rows of x: 1 takes the decode route, 64 the prefill route")
    flag(k, "threads", type=threads, default=2)
    k.add_argument("--repeat", type=repeat, default=3)
    add_json_out(k, "the report")
    b = sub.add_parser("blocks", help="one forward's products on the memory-mapped blocks (ggml-cpu numerics), "
                                      "per weight type, against the read floor of the same bytes")
    add_model(b)
    b.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=1, help="rows of x: 1 is a decode step")
    flag(b, "threads", type=threads, default=2)
    add_json_out(b, "the report")
    v = sub.add_parser("vision", help="one image through the tower on numba (exact), and through llama-mtmd-cli")
    v.add_argument("mmproj")
    v.add_argument("--image-size", type=int_in(14, MAX_IMAGE_SIDE), default=1024, help="a square synthetic image")
    v.add_argument("--llama-bin", help="the directory with llama-mtmd-cli; with --model, its time beside numba's")
    flag(v, "model", help="the text GGUF llama-mtmd-cli loads beside the projector")
    flag(v, "threads", type=threads, default=2)
    add_json_out(v, "the report")
    v.add_argument("--plot", help="an image of the engines' seconds (PNG unless the extension says otherwise)")
    from tools.bench import gemm, table
    table.add_parser(sub, threads, add_model)
    gemm.add_parser(sub, threads, add_model)
    c = sub.add_parser("ceiling", help="decode tokens/s no numba kernel exceeds here (floor loops), beside llama.cpp")
    add_model(c)
    flag(c, "threads", type=threads, default=2)
    c.add_argument("--rows", type=int_in(1, MAX_CEILING_ROWS), default=8192,
                   help="rows of the floor loops' packed bytes")
    c.add_argument("--n-in", type=int_in(4, MAX_N_IN), default=MID.n_embd, help="a multiple of 4")
    c.add_argument("--repeat-floor", type=int_in(1, 1000), default=50,
                   help="rounds of the loops, twice: the best counts for speeds, the median round for shares")
    c.add_argument("--prompt-len", type=int_in(1, MAX_PROMPT), default=64)
    flag(c, "n_predict", type=int_in(1, MAX_PROMPT), default=8, help="at most --prompt-len")
    c.add_argument("--repeat", type=repeat, default=3)
    add_json_out(c, "the report")
    return p


def add_model(p):  # the GGUF: a positional argument as before, or llama.cpp's -m/--model
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="the GGUF (or -m MODEL)")
    flag(p, "model", help="the GGUF, as llama.cpp's -m")


def check_args(args):  # what the argument types cannot see alone -> UsageError
    if args.what in ("run", "kernels", "blocks", "ceiling", "table", "gemm"):
        if args.model and args.model_path and args.model != args.model_path:
            raise UsageError(f"two models: {args.model_path} and -m {args.model}")
        args.model = args.model or args.model_path
        if not args.model:
            raise UsageError(f"{args.what} needs a GGUF: MODEL or -m MODEL")
    if args.what in ("run", "vision", "table") and args.plot:  # before the engines run: a path or format matplotlib refuses
        from tools.common import check_plot
        check_plot(args.plot)
    if args.what == "run" and args.one_shot and args.turns:
        raise UsageError("--one-shot runs each engine once in its own process: --turns takes rounds in one")
    if args.what == "run" and args.logits == "all" and args.prompt_len > MAX_PROMPT:
        raise UsageError(f"--prompt-len {args.prompt_len} keeps all-position logits of every engine: at most "
                         f"{MAX_PROMPT}; --logits last computes the last position only")
    if args.what in ("run", "ceiling"):  # the decode steps feed the prompt's tokens, one each
        engines = args.engines if args.what == "run" else ("llama-cpp", "numba")
        n_decode = max(args.n_decode_numpy if name == "numpy" else args.n_predict for name in engines)
        if n_decode > args.prompt_len:
            raise UsageError(f"{n_decode} decode steps need a prompt of at least as many tokens "
                             f"(--prompt-len {args.prompt_len})")
    if args.what == "vision" and bool(args.llama_bin) != bool(args.model):
        raise UsageError("llama-mtmd-cli needs both --llama-bin DIR and --model TEXT.gguf")
    if args.what == "ceiling" and args.n_in % 4:  # a floor loop takes four values a step
        raise UsageError(f"--n-in {args.n_in} is not a multiple of 4")


def main(argv=None):
    args = build_parser().parse_args(argv)

    def work():
        check_args(args)
        if args.what == "make":
            return make(args)
        if args.what == "kernels":
            report = kernels(args)
        elif args.what == "ceiling":
            report = ceiling(args)
        elif args.what == "blocks":
            report = blocks(args)
        elif args.what == "table":
            from tools.bench import table
            report = table.main(args)
        elif args.what == "gemm":
            from tools.bench import gemm
            report = gemm.gemm(args)
        elif args.what == "vision":
            report = vision(args)
            print_vision(report)
            if args.plot:
                plot_vision(report, args.plot)
        else:
            report = run(args)
            print_ratios(report)
            if args.plot:
                plot_run(report, args.plot)
        if args.json_out:
            write_json(args.json_out, {**report, "provenance": args_record(args)})
        return 0
    return exit_status("tools.bench_accel", work, (gguf.GGUFError, factory.FactoryError))



if __name__ == "__main__":
    sys.exit(main())
