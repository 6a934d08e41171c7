"""The integer-path floor of the ggml-cpu numba kernels: the least work a quantized product on
GroupRows (16 weight rows interleaved, int8 codes) and int8 activations does, as numba compiles it.
One vpdpbusd pass over each block of a group per activation row (GROUP_TOKENS rows per pass from 8
rows, as the tiled kernel reads them), the sums kept, no sub-block scales, no lanes, no epilogue, in
the kernels' loop order (a thread takes whole groups). Its speed bounds what those kernels reach
here; the measured kernels beside it (Q4_K and Q6_K rows: k_vec_dot below 8 activation rows, the
tiled kernel from 8) say what scales, lanes and float epilogues cost. Floor and kernels run in
turns, the best of each counts: the ratio is what holds on a shared machine.

    python -m tools.int_floor [--rows 8192 --n-in 6656 --tokens 1 64 --threads 2 --repeat 3]
"""
import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from accel.numba.ggml import int_dots
from accel.numba.ggml import mul_mat as ggml_mul_mat
from accel.numba.ggml.quantize import quantize_q8_k
from accel.numba.operands import operands
from reference.cli import OneLineParser, exit_status, flag, int_in
from reference.ggml_cpu.blocks import QuantRows
from tools.bench.forward import best_of


@intrinsic
def block_sums_only(typingctx, codes, g, b, aq, t0, tokens, ones, out):  # out[j] += block_sums of one sub-block
    """int_dots.block_sums with one sub-block of scale 1 (ones [16] int8): the dots and nothing else."""
    def codegen(context, builder, signature, args):
        a = operands(block_sums_only, context, builder, signature, args)
        g, b, t0 = a.g.index(), a.b.index(), a.t0.index()
        acts = [a.aq.at([builder.add(t0, t0.type(j)), b]) for j in range(tokens.literal_value)]
        sums, _ = int_dots.block_sums(builder, a.codes.at([g, b]), a.ones.data(), acts, 1, 1,
                                      a.aq.ty.dtype == types.uint8)
        out = a.out.data()
        for j, per_lane in enumerate(sums):
            kept = int_dots.load_at(builder, out, 64 * j, int_dots.I32X16)
            builder.store(builder.add(kept, per_lane[0]),
                          builder.bitcast(builder.gep(out, [t0.type(64 * j)]), int_dots.I32X16.as_pointer()), align=1)
        return context.get_dummy_value()
    if isinstance(tokens, types.IntegerLiteral):
        return types.none(codes, g, b, aq, t0, tokens, ones, out), codegen


@numba.njit(parallel=True, cache=True)
def int_floor(codes, aq):  # GroupRows codes [G, nb, 64, 16, 4], aq [T, nb, 256] (group_acts) -> int32 [G, 8, 16]
    G, nb = codes.shape[:2]
    T = aq.shape[0]
    ones = np.ones(int_dots.GROUP, np.int8)
    out = np.zeros((G, int_dots.GROUP_TOKENS, int_dots.GROUP), np.int32)
    for g in numba.prange(G):
        for t0 in range(0, T - T % int_dots.GROUP_TOKENS, int_dots.GROUP_TOKENS):
            for b in range(nb):
                block_sums_only(codes, g, b, aq, t0, 8, ones, out[g])
        for t in range(T - T % int_dots.GROUP_TOKENS, T):
            for b in range(nb):
                block_sums_only(codes, g, b, aq, t, 1, ones, out[g])
    return out


def q4_k_rows(rows, n_in, rng):  # -> GroupRows of a random Q4_K-shaped matrix (codes 0..15, 6-bit scales and mins)
    nb = n_in // 256
    w = QuantRows(rng.random((rows, nb), np.float32), rng.integers(0, 16, (rows, nb, 256)).astype(np.int8),
                  rng.integers(0, 64, (rows, nb, 8)).astype(np.int8), rng.integers(0, 64, (rows, nb, 8)).astype(np.int8),
                  rng.random((rows, nb), np.float32), min_lanes=4)
    return ggml_mul_mat.GroupRows(w)


def q6_k_rows(rows, n_in, rng):  # -> GroupRows of a random Q6_K-shaped matrix (codes 0..63 offset 32, int8 scales per 16)
    nb = n_in // 256
    w = QuantRows(rng.random((rows, nb), np.float32), rng.integers(0, 64, (rows, nb, 256)).astype(np.int8),
                  rng.integers(-128, 128, (rows, nb, 16)).astype(np.int8), sub=16, unsigned_offset=32)
    return ggml_mul_mat.GroupRows(w)


def measure(rows, n_in, tokens, repeat, rng):  # -> {name: G MAC/s} of the floor and each kernel at `tokens` rows
    a = quantize_q8_k(rng.standard_normal((tokens, n_in)).astype(np.float32))
    kernel = ggml_mul_mat.k_vec_dot if tokens < 8 else ggml_mul_mat.tiled
    runs = {"floor": lambda w=q4_k_rows(rows, n_in, rng): int_floor(w.codes, ggml_mul_mat.group_acts(w, a))}
    for kind, make in (("Q4_K", q4_k_rows), ("Q6_K", q6_k_rows)):
        runs[f"{kind} {kernel.__name__}"] = lambda w=make(rows, n_in, rng): kernel(w, a)
    best = {}
    for name, run in runs.items():
        run()  # compile, or load the numba cache
    for _ in range(repeat):  # in turns: a busy moment of the machine slows one round of each, not one entry
        for name, run in runs.items():
            best[name] = min(best.get(name, np.inf), best_of(1, run))
    return {name: rows * n_in * tokens / seconds / 1e9 for name, seconds in best.items()}


def main(argv=None):
    p = OneLineParser(prog="python -m tools.int_floor")
    p.add_argument("--rows", type=int_in(1, 1 << 16), default=8192)
    p.add_argument("--n-in", type=int_in(256, 1 << 15), default=6656, help="a multiple of 256")
    p.add_argument("--tokens", type=int_in(1, 512), nargs="+", default=[1, 64])
    flag(p, "threads", type=int_in(1, numba.config.NUMBA_NUM_THREADS), default=2)
    p.add_argument("--repeat", type=int_in(1, 100), default=3)
    args = p.parse_args(argv)

    def work():
        numba.set_num_threads(args.threads)
        rng = np.random.default_rng(0)
        for tokens in args.tokens:
            rates = measure(args.rows, args.n_in - args.n_in % 256, tokens, args.repeat, rng)
            kernels = ", ".join(f"{name} {rate:6.2f} ({rate / rates['floor']:.0%})"
                                for name, rate in rates.items() if name != "floor")
            print(f"{tokens:4d} tokens: floor {rates['floor']:6.2f} G MAC/s; {kernels}", flush=True)
        return 0
    return exit_status("int_floor", work)


if __name__ == "__main__":
    raise SystemExit(main())
