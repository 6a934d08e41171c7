"""`python -m tools.bench_accel gemm MODEL`: the exact mode's prefill product (accel/numba/quant.py
matmul_tiles) on the largest matrix of each weight type, against the float32 FMA peak of the same
threads (tools/bench/kernel_floor.py fma_loop), the two timed in turns so that a busy spell of the
machine slows both. Its share of the peak is what the GEMM leaves on the table: the decoding of the
weights (once per call), packing, and the float64 sums across super-blocks are in the kernel's time,
and every flop counted is a product of the model's (2 T n_out n_in)."""
import os

import numpy as np

from reference import gguf
from reference.cli import add_json_out, flag, int_in
from tools.bench.engines import command_line, set_threads, timed

MAX_TOKENS = 4096
MAX_ROWS = 1 << 20
PEAK_STEPS = 1 << 20  # steps of the peak loop's chains: about 50 GFLOP a call with AVX-512 on 2 threads


def largest_matrices(weights):  # -> {type name: tensor name}: the largest 2-D weight of each type, the embedding aside
    largest = {}
    for name, t in weights.tensors.items():
        if len(t.shape) == 2 and name != "token_embd.weight":  # the embedding is looked up, not multiplied
            kind = weights.type_name(name)
            if kind not in largest or t.n_elements > weights.tensors[largest[kind]].n_elements:
                largest[kind] = name
    return largest


def gemm(args):  # -> report dict: per weight type, the product's GFLOP/s, the peak's and the share
    set_threads(args.threads)
    from accel.numba import quant
    from tools.bench import kernel_floor
    weights = gguf.load(args.model, "text").weights
    rng = np.random.default_rng(0)
    cases = {}
    for kind, name in sorted(largest_matrices(weights).items()):
        n_out, n_in = weights.shape(name)
        blocks = quant.as_blocks(weights.raw(name), n_out)[:args.rows]
        x = rng.standard_normal((args.tokens, n_in)).astype(np.float32)
        out = np.empty((args.tokens, len(blocks)), np.float32)
        qtype = int(weights.tensors[name].tensor_type)
        cases[kind] = {"matrix": name, "rows": len(blocks), "n_in": n_in, "flops": 2 * x.size * len(blocks),
                       "run": lambda qtype=qtype, blocks=blocks, x=x, out=out:
                       quant.matmul_tiles(qtype, blocks, x, out, quant.TABLES)}
    peak_out = np.empty(args.threads, np.float32)
    kernel_floor.fma_loop(1, peak_out)  # compile, or load the numba caches
    for case in cases.values():
        case["run"]()
    kernel_s = {kind: np.inf for kind in cases}
    peak_s = np.inf
    for _ in range(args.repeat):
        for kind, case in cases.items():
            kernel_s[kind] = min(kernel_s[kind], timed(case["run"])[1])
            peak_s = min(peak_s, timed(kernel_floor.fma_loop, PEAK_STEPS, peak_out)[1])
    peak = kernel_floor.fma_peak_flops(PEAK_STEPS, args.threads) / peak_s / 1e9
    rows = []
    for kind, case in cases.items():
        rate = case["flops"] / kernel_s[kind] / 1e9
        rows.append({"type": kind, **{k: case[k] for k in ("matrix", "rows", "n_in")}, "gflop_s": rate,
                     "share": rate / peak})
        print(f"{kind:8s} {case['matrix']:28s} [{case['rows']}, {case['n_in']}] x {args.tokens} tokens: "
              f"{rate:7.1f} GFLOP/s, x{rate / peak:.2f} of the FMA peak", flush=True)
    print(f"float32 FMA peak, {args.threads} threads: {peak:.1f} GFLOP/s "
          f"({kernel_floor.FMA_CHAINS} chains of {quant.VECTOR_BYTES // 4} lanes each)")
    return {"model": os.path.basename(args.model), "threads": args.threads, "tokens": args.tokens,
            "command": command_line(), "peak_gflop_s": peak, "types": rows}


def add_parser(sub, threads, add_model):  # the `gemm` subcommand of tools.bench_accel
    g = sub.add_parser("gemm", help="the exact prefill product per weight type against the float32 FMA peak")
    add_model(g)
    g.add_argument("--tokens", type=int_in(3, MAX_TOKENS), default=512,
                   help="rows of x (from 3: fewer take the row route)")
    g.add_argument("--rows", type=int_in(1, MAX_ROWS), default=4096, help="first rows of each type's largest matrix")
    flag(g, "threads", type=threads, default=2)
    g.add_argument("--repeat", type=int_in(1, 100), default=3, help="rounds, the best counts for each")
    add_json_out(g, "the report")
