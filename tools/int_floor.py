"""The integer-path floor of the ggml-cpu numba kernels: the least work a quantized product on
decoded weights and int8 activations does, as numba compiles it. One exact int64 sum of
value * q per weight row, no scales and no epilogue, over the same [rows, n_in] int16 layout the
K-quant kernels read (accel/numba/ggml keeps each value times its scale). Its speed bounds what
those kernels can reach here; the measured kernel beside it says what the scales and the float
epilogues cost.

    python -m tools.int_floor [--rows 8192 --n-in 6656 --tokens 1,64 --threads 2 --repeat 3]
"""
import numba
import numpy as np

from accel.numba.ggml import mul_mat as ggml_mul_mat
from accel.numba.ggml.quantize import quantize_q8_k
from reference.cli import OneLineParser, exit_status, int_in
from reference.ggml_cpu.blocks import QuantRows
from tools.bench import best_of


@numba.njit(parallel=True, cache=True)
def int_floor(values, aq):  # values int16 [O, K], aq int8 [T, K] -> int64 [T, O]: sums of products only
    O, K = values.shape
    out = np.zeros((aq.shape[0], O), np.int64)
    for o in numba.prange(O):
        for t in range(aq.shape[0]):
            total = 0
            for k in range(K):
                total += np.int64(values[o, k]) * np.int64(aq[t, k])
            out[t, o] = total
    return out


def best_seconds(fn, repeat):  # -> the least wall seconds of repeat calls, after one warm-up (compilation)
    fn()
    return best_of(repeat, fn)


def q4_k_rows(rows, n_in, rng):  # -> KernelRows of a random Q4_K-shaped matrix (codes 0..15, 6-bit scales)
    nb = n_in // 256
    w = QuantRows(rng.random((rows, nb), np.float32), rng.integers(0, 16, (rows, nb, 256)).astype(np.int8),
                  rng.integers(0, 64, (rows, nb, 8)).astype(np.int8), rng.integers(0, 64, (rows, nb, 8)).astype(np.int8),
                  rng.random((rows, nb), np.float32), min_lanes=4)
    return ggml_mul_mat.KernelRows(w)


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
        n_in = args.n_in - args.n_in % 256
        w = q4_k_rows(args.rows, n_in, rng)
        for tokens in args.tokens:
            a = quantize_q8_k(rng.standard_normal((tokens, n_in)).astype(np.float32))
            aq = np.ascontiguousarray(a.q.reshape(tokens, -1).astype(np.int8))
            floor = best_seconds(lambda: int_floor(w.vs.reshape(args.rows, -1), aq), args.repeat)
            kernel = (ggml_mul_mat.k_vec_dot if tokens < 8 else ggml_mul_mat.tiled)
            used = best_seconds(lambda: kernel(w, a), args.repeat)
            macs = args.rows * n_in * tokens / 1e9
            print(f"{tokens:4d} tokens: floor {macs / floor:6.2f} G MAC/s, {kernel.__name__} {macs / used:6.2f} G MAC/s "
                  f"({floor / used:.0%} of the floor)")
        return 0
    return exit_status("int_floor", work)


if __name__ == "__main__":
    raise SystemExit(main())
