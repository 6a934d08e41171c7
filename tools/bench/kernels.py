"""`python -m tools.bench_accel kernels`: one product per weight type of a file on its first rows,
numba's kernel against the reference's (gguf-py dequantization, then a float64 matmul)."""
import os
import tempfile

import numpy as np
from gguf import GGUFWriter

from reference import factory, gguf, ops
from tools.bench.engines import set_threads, timed


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
                engines = {"numba": lambda: numba.linear(x, weights.tensor(name)),
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
