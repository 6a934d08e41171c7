"""Op-by-op check of an accelerated backend against reference/ops.py, in the spirit of llama.cpp's
test-backend-ops: every op x weight type x shape on seeded random inputs, compared by NMSE
(sum((ref - x)^2) / sum(ref^2), test-backend-ops' convention) with a threshold per op, plus a
NaN/inf check.

    python -m accel.harness [--backend numba] [--ops linear,attention] [--seed 0]

prints one table row per case and exits 1 if any case fails. tests/test_numba.py runs the same cases.
`--numerics ggml-cpu` runs accel/ggml_harness.py instead: every accel/numba/ggml kernel against its
reference/ggml_cpu twin, bit for bit (tests/test_numba_ggml.py runs those cases).

Thresholds. The backend computes on the same float32 activations and the same exactly dequantized
weights as the reference. Norms and attention keep every sum the reference keeps in float64 in
float64: what may differ is the order of float64 additions, and libm's exp/tanh/erf against numpy's
vectorized ones. Either moves a float32 output by at most about one unit in the last place, and an
NMSE made of one-ulp differences is at most (2^-24)^2 = 3.6e-15 however many outputs move. Products
sum in float32 within a 256-value super-block (or a 1024-column tile) and in float64 across them:
a float32 sum of k products carries an error of about sqrt(k) 2^-24 relative to sum |w x|, which on
these random inputs is an NMSE of about k 2^-48 = 3.6e-12 even for k = 1024, and far less in
practice (random-walk cancellation; a row whose sum cancels can show more). The gates
sit above that (so a changed summation order never fails) and far below any real bug, which shows at
1e-6 and up; ggml's 5e-4 for products comes from quantizing the activations, which neither side does.
"""
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter

from reference import ops
from reference.cli import OneLineParser, fail, flag, int_in, names_in
from reference.gguf import Weights, open_reader, write_out
from reference.random_blocks import F16_SCALE_OFFSETS, random_weights
from reference.metrics import max_abs_diff, nmse

GGML_OPS = ("quantize", "int_dots", "float_dots", "elementwise", "libm", "attention")  # the ggml kernel files ggml_harness checks

# Gates per op, with why. One-ulp noise is <= 3.6e-15 (see above).
GATES = {
    "linear": (1e-11, "exact weights, float32 sums within a super-block or tile (<= 1024 terms: "
                      "<= 3.6e-12), float64 across: measured <= 3.6e-14 (float32)"),
    "attention": (1e-12, "scores, softmax and sum of V in float64 on both sides, one rounding"),
    "rms_norm": (1e-13, "float32 squares summed in float64 (order differs), mean rounded once"),
    "layer_norm": (1e-13, "float64 mean and variance (order differs), rounded once"),
    "rope": (1e-13, "numpy's cos/sin on both sides, the same float32 operations: expect 0"),
    "activation": (1e-12, "libm exp/tanh/erf against numpy's vectorized ones: <= 2 ulp per value, "
                          "measured <= 2.6e-15"),
}

# The quantized types are those whose f16 scale offsets reference.random_blocks knows: random blocks with
# finite scales planted there are valid blocks.
LINEAR_TYPES = (GT.F32, GT.F16, GT.BF16) + tuple(F16_SCALE_OFFSETS) + (GT.IQ1_M,)


@dataclass
class Case:
    op: str
    name: str
    dtype: str
    run: object  # backend -> (reference output, backend output)


class TensorFile:
    """Random weight tensors written to a small GGUF and read back through reference.gguf.Weights,
    so the backend sees them exactly as it sees a model's: memory-mapped raw blocks."""

    def __init__(self, specs, rng):  # specs: [(name, qtype, n_out, n_in)]
        self.dir = tempfile.TemporaryDirectory()
        path = os.path.join(self.dir.name, "weights.gguf")
        w = GGUFWriter(path, "harness")
        for name, qtype, n_out, n_in in specs:
            data = random_weights(qtype, n_out, n_in, rng)
            w.add_tensor(name, data, raw_dtype=qtype)  # raw blocks: the shape follows from the row bytes
        write_out(w)
        self.weights = Weights(open_reader(path), path)


# ---------------------------------------------------------------------------------------------
# The cases

# (rows of x, n_out, n_in): decode, a short batch (both take the row-by-row path), and a prefill
# batch with rows and tokens left over from the kernel's blocks of 4 and 32
LINEAR_SHAPES = ((1, 64, 512), (2, 48, 768), (37, 70, 768))


def linear_cases(rng):
    specs = [(f"{t.name}.{i}", t, n_out, n_in)
             for t in LINEAR_TYPES for i, (_, n_out, n_in) in enumerate(LINEAR_SHAPES)]
    specs += [("F32.odd", GT.F32, 20, 588), ("F16.odd", GT.F16, 20, 588)]  # a row that is no multiple of 256
    tensors = TensorFile(specs, rng)
    cases = []
    for name, qtype, n_out, n_in in specs:
        T = LINEAR_SHAPES[int(name.split(".")[1])][0] if name[-1].isdigit() else 5
        for dtype in (np.float32, np.float64) if qtype in (GT.Q4_K, GT.IQ2_XXS, GT.F16) else (np.float32,):
            x = rng.standard_normal((T, n_in)).astype(dtype)
            cases.append(Case("linear", f"{qtype.name} x[{T},{n_in}] w[{n_out},{n_in}]", np.dtype(dtype).name,
                              lambda be, x=x, name=name: (ops.linear(x, tensors.weights.get(name, np.float64)),
                                                          be.linear(x, tensors.weights.tensor(name)))))
    return cases


def attention_inputs(rng, T, S, H, Hkv, D, dtype):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    k = rng.standard_normal((S, Hkv, D)).astype(dtype)
    v = rng.standard_normal((S, Hkv, D)).astype(dtype)
    return q, k, v


def window_visible(n, window):  # the vision tower's window attention: full attention inside each window
    ids = np.arange(n) // window
    return ids[:, None] == ids[None, :]


def attention_cases(rng):
    ring_pos = np.array([16, 17, 18, 19, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, -1])  # slots pos % 16, two empty
    setups = [  # name, (T, S, H, Hkv, D), visible
        ("decode, uniform cache", (1, 40, 4, 2, 32), ops.causal_visible([39], np.arange(40), 0)),
        ("prefill, causal GQA 8/1", (24, 24, 8, 1, 16), ops.causal_visible(np.arange(24), np.arange(24), 0)),
        ("prefill chunk, SWA ring", (4, 18, 4, 2, 32), ops.causal_visible(np.arange(16, 20), ring_pos, 8)),
        ("vision windows of 16", (64, 64, 2, 2, 32), window_visible(64, 16)),
        ("a query with no key", (2, 6, 2, 1, 8), np.array([[True] * 6, [False] * 6])),
        # 42 query rows per kv head: the blocked route (attention.ROW_BLOCK), edges in rows and keys;
        # query t sees keys s < t % 11, so queries 0 and 11 see none
        ("blocks, queries with no key", (21, 11, 4, 2, 8), np.arange(11)[None, :] < np.arange(21)[:, None] % 11),
    ]
    cases = []
    for name, (T, S, H, Hkv, D), visible in setups:
        for dtype in (np.float32, np.float64):
            q, k, v = attention_inputs(rng, T, S, H, Hkv, D, dtype)
            scale = 1.0 / np.sqrt(D)
            cases.append(Case("attention", f"{name} q[{T},{H},{D}] kv[{S},{Hkv}]", np.dtype(dtype).name,
                              lambda be, a=(q, k, v, visible, scale): (ops.attention(*a), be.attention(*a))))
    return cases


def pointwise_table(rng, dtype):  # -> [(op, case name, reference fn, backend fn)] on inputs of one dtype
    def arr(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dtype)
    x3, x2 = arr(5, 4, 64), arr(7, 6656, scale=3.0)
    w, b = arr(64), arr(64)
    theta = ops.rope_angles(np.arange(100, 105), 64, 10000.0, dtype)
    theta_a = ops.rope_angles(np.arange(5) % 3 + 1, 32, 10000.0, dtype)  # vision: column and row angles
    theta_b = ops.rope_angles(np.arange(5) // 3 + 1, 32, 10000.0, dtype)
    gate, up, z = arr(6, 300, scale=4.0), arr(6, 300), arr(3, 512, scale=40.0)
    return [
        ("rms_norm", "x[7,6656]", lambda: ops.rms_norm(x2, 1e-5), lambda be: be.rms_norm(x2, 1e-5)),
        ("rms_norm", "per head x[5,4,64]", lambda: ops.rms_norm(x3, 1e-6), lambda be: be.rms_norm(x3, 1e-6)),
        ("layer_norm", "x[5,4,64]", lambda: ops.layer_norm(x3, w, b, 1e-6), lambda be: be.layer_norm(x3, w, b, 1e-6)),
        ("rope", "norm x[5,4,64]", lambda: ops.rope_norm(x3, theta), lambda be: be.rope_norm(x3, theta)),
        ("rope", "neox x[5,4,64]", lambda: ops.rope_neox(x3, theta), lambda be: be.rope_neox(x3, theta)),
        ("rope", "2d x[5,4,64]", lambda: ops.rope_2d(x3, theta_a, theta_b),
         lambda be: be.rope_2d(x3, theta_a, theta_b)),
        ("activation", "sigmoid x[6,300]", lambda: ops.sigmoid(gate), lambda be: be.sigmoid(gate)),
        ("activation", "swiglu x[6,300]", lambda: ops.swiglu(gate, up), lambda be: be.swiglu(gate, up)),
        ("activation", "softcap 30 z[3,512]", lambda: ops.softcap(z, 30.0), lambda be: be.softcap(z, 30.0)),
        ("activation", "gelu_erf x[6,300]", lambda: ops.gelu_erf(gate), lambda be: be.gelu_erf(gate)),
    ]


def pointwise_cases(rng):
    return [Case(op, name, np.dtype(dtype).name, lambda be, ref=ref, run=run: (ref(), run(be)))
            for dtype in (np.float32, np.float64) for op, name, ref, run in pointwise_table(rng, dtype)]


def all_cases(seed=0):  # -> [Case]
    rng = np.random.default_rng(seed)
    return linear_cases(rng) + attention_cases(rng) + pointwise_cases(rng)


# ---------------------------------------------------------------------------------------------
# Checking

def finite_mismatch(ref, got):  # -> description of the first NaN/inf disagreement, or ""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"shape/dtype {got.shape} {got.dtype}, expected {ref.shape} {ref.dtype}"
    if np.isnan(got).any() and not np.isnan(ref).any():
        return "NaN in the backend's output"
    ref_inf, got_inf = np.isinf(ref), np.isinf(got)
    if (ref_inf != got_inf).any() or (ref[ref_inf] != got[got_inf]).any():
        return "inf where the reference has none (or of the other sign)"
    return ""


def check(case, backend):  # -> (nmse, max |diff|, gate, problem or "")
    ref, got = case.run(backend)
    gate = GATES[case.op][0]
    problem = finite_mismatch(ref, got)
    if problem:
        return float("nan"), float("nan"), gate, problem
    finite = np.isfinite(ref)
    err = float(nmse(ref[finite].ravel(), got[finite].ravel()))
    diff = float(max_abs_diff(ref[finite].ravel(), got[finite].ravel())) if finite.any() else 0.0
    return err, diff, gate, "" if err <= gate else f"NMSE {err:.3g} > {gate:g}"


def main(argv=None):
    p = OneLineParser(prog="python -m accel.harness", description=__doc__)
    flag(p, "backend", default="numba", help="the accelerated backend checked against the reference")
    flag(p, "numerics", choices=("exact", "ggml-cpu"), default="exact",
                   help="ggml-cpu: the numba ggml kernels against their NumPy twins (--backend numba only)")
    p.add_argument("--ops", type=names_in(tuple(GATES) + GGML_OPS, "op"), default=None,
                   help="comma-separated ops to run (default: all): " + ",".join(GATES)
                   + "; with --numerics ggml-cpu the kernel files " + ",".join(GGML_OPS))
    flag(p, "seed", type=int_in(0, 2**63 - 1), default=0, help="the random inputs' numpy seed")
    args = p.parse_args(argv)
    if args.numerics == "ggml-cpu":
        return ggml_table(args)
    args.ops = args.ops or list(GATES)
    if set(args.ops) - set(GATES):
        return fail("accel.harness", f"{', '.join(sorted(set(args.ops) - set(GATES)))}: ggml-cpu kernel files, "
                                     "for --numerics ggml-cpu")
    from reference import factory
    try:
        backend = factory.backend(factory.Build(backend=args.backend))
    except factory.FactoryError as e:
        return fail("accel.harness", e)
    dtypes = getattr(backend, "dtypes", ("float32", "float64"))  # cupy computes in float32 only
    failed = skipped = 0
    print(f"{'op':10s} {'case':52s} {'dtype':7s} {'NMSE':>10s} {'gate':>7s} {'max|diff|':>10s}  result")
    for case in all_cases(args.seed):
        if case.op not in args.ops:
            continue
        if case.dtype not in dtypes:
            skipped += 1
            print(f"{case.op:10s} {case.name:52s} {case.dtype:7s} {'':>10s} {'':>7s} {'':>10s}  skipped: "
                  f"{args.backend} has no {case.dtype} kernels")
            continue
        err, diff, gate, problem = check(case, backend)
        failed += bool(problem)
        print(f"{case.op:10s} {case.name:52s} {case.dtype:7s} {err:10.2e} {gate:7.0e} {diff:10.2e}  "
              f"{'FAIL ' + problem if problem else 'ok'}")
    for op, (gate, why) in GATES.items():
        if op in args.ops:
            print(f"gate {op}: NMSE <= {gate:g}: {why}")
    print((f"{failed} failed" if failed else "all passed") + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


def ggml_table(args):  # --numerics ggml-cpu -> exit status of accel/ggml_harness.py's table
    if args.backend != "numba":
        return fail("accel.harness",
                    f"--numerics ggml-cpu compares the numba ggml kernels, not --backend {args.backend}")
    if set(args.ops or ()) - set(GGML_OPS):
        return fail("accel.harness", f"{', '.join(sorted(set(args.ops) - set(GGML_OPS)))}: not a ggml-cpu kernel "
                                     f"file ({', '.join(GGML_OPS)})")
    try:
        from . import ggml_harness
    except ImportError as e:
        return fail("accel.harness", f"--numerics ggml-cpu needs numba ({e}); install the accel extra")
    return ggml_harness.run_table(args.ops or GGML_OPS, args.seed)


if __name__ == "__main__":
    sys.exit(main())
