"""The integer-path floor of the ggml-cpu numba kernels: the least work a quantized product on
decoded weights and int8 activations does, as numba compiles it. One int32 vector dot of value * q
per weight row and activation row (vpmaddwd), no lanes, no scales, no epilogue, over the same
[rows, n_in] int16 layout the K-quant kernels read (accel/numba/ggml keeps each value times its
scale) and in the same loop order (a thread takes whole rows, every activation row runs past each).
Its speed bounds what those kernels reach here; the measured kernels beside it (Q4_K and Q6_K rows:
k_vec_dot below 8 activation rows, the tiled kernel from 8) say what lanes, scales and float
epilogues cost. Floor and kernels run in turns, the best of each counts: the ratio is what holds
on a shared machine.

    python -m tools.int_floor [--rows 8192 --n-in 6656 --tokens 1 64 --threads 2 --repeat 3]
"""
import numba
import numpy as np

from accel.numba.ggml import mul_mat as ggml_mul_mat
from accel.numba.ggml.quantize import quantize_q8_k
from reference.cli import OneLineParser, exit_status, int_in
from reference.ggml_cpu.blocks import QuantRows
from tools.bench import best_of


@numba.njit(parallel=True, cache=True)
def int_floor(values, aq):  # values int16 [O, K], aq int8 [T, K] -> int32 [T, O]: sums of products only
    O, K = values.shape
    out = np.zeros((aq.shape[0], O), np.int32)
    for o in numba.prange(O):
        for t in range(aq.shape[0]):
            total = np.int32(0)
            for k in range(K):  # wraps past 2^31 on long rows: the floor times the loop, not the value
                total = np.int32(total + np.int32(values[o, k]) * np.int32(aq[t, k]))
            out[t, o] = total
    return out


def q4_k_rows(rows, n_in, rng):  # -> KernelRows of a random Q4_K-shaped matrix (codes 0..15, 6-bit scales and mins)
    nb = n_in // 256
    w = QuantRows(rng.random((rows, nb), np.float32), rng.integers(0, 16, (rows, nb, 256)).astype(np.int8),
                  rng.integers(0, 64, (rows, nb, 8)).astype(np.int8), rng.integers(0, 64, (rows, nb, 8)).astype(np.int8),
                  rng.random((rows, nb), np.float32), min_lanes=4)
    return ggml_mul_mat.KernelRows(w)


def q6_k_rows(rows, n_in, rng):  # -> KernelRows of a random Q6_K-shaped matrix (codes 0..63 offset 32, int8 scales per 16)
    nb = n_in // 256
    w = QuantRows(rng.random((rows, nb), np.float32), rng.integers(0, 64, (rows, nb, 256)).astype(np.int8),
                  rng.integers(-128, 128, (rows, nb, 16)).astype(np.int8), sub=16, unsigned_offset=32)
    return ggml_mul_mat.KernelRows(w)


def measure(rows, n_in, tokens, repeat, rng):  # -> {name: G MAC/s} of the floor and each kernel at `tokens` rows
    a = quantize_q8_k(rng.standard_normal((tokens, n_in)).astype(np.float32))
    aq = np.ascontiguousarray(a.q.reshape(tokens, -1))
    kernel = ggml_mul_mat.k_vec_dot if tokens < 8 else ggml_mul_mat.tiled
    runs = {"floor": lambda w=q4_k_rows(rows, n_in, rng): int_floor(w.vs.reshape(rows, -1), aq)}
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
    p.add_argument("--threads", type=int_in(1, numba.config.NUMBA_NUM_THREADS), default=2)
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
