"""`python -m tools.bench_accel blocks`: every matrix of one forward on its memory-mapped blocks
(--numerics ggml-cpu on numba), in layer order, timed per weight type against the read floor of the
same bytes (kernel_floor.read_floor)."""
import os

import numpy as np
from tqdm import tqdm

from reference import factory, gguf
from tools.bench.engines import command_line, set_threads, timed


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
        backend.linear(xs[weights.shape(m)[1]], weights.tensor(m))
    kernel_s, floor_s, n_bytes, count = ({t: 0 for t in kind.values()} for _ in range(4))
    for m in kind:
        n_bytes[kind[m]] += data[m].nbytes
        count[kind[m]] += 1
    for m in tqdm(kind, desc="products", unit="matrix"):
        kernel_s[kind[m]] += timed(backend.linear, xs[weights.shape(m)[1]], weights.tensor(m))[1]
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
