"""`--numerics ggml-cpu` on numba against the NumPy emulation, in the same run: prefill and
token-by-token decode of each model with GgmlCpuBackend and GgmlCpuNumbaBackend, the repeats
alternating between the two (so both see the same load), best of --repeat, after one untimed numba
run (its compilation). The logits of both are compared in that run: they must be bit-identical.

    python -m tools.bench_ggml_numba [--models tiny-b-q4_k_m,golden/models/tiny-a-f32.gguf] [--prompt-len 64]
        [--n-decode 8] [--repeat 3] [--kv-type f16] [--flash-attn off] [--plot speed.png]
"""
import os
import time

import numpy as np
from tqdm import tqdm

from reference import artifacts, factory, gguf
from reference.cli import OneLineParser, UsageError, add_cache_flags, exit_status, flag, flash_choice, cache_types, int_in, output_file
from reference.ggml_cpu import UBATCH
from reference.metrics import max_abs_diff, nmse
from tools.common import REPO

MODELS = os.path.join(REPO, "golden", "models")


def model_file(name):  # a GGUF path, or a name of golden/models -> the file
    return name if name.endswith(".gguf") or os.sep in name else os.path.join(MODELS, name + ".gguf")


def timed_run(lm, ids, fed):  # -> (prefill s, decode s per token, logits [len(ids) + len(fed), V])
    cache = lm.new_cache(len(ids) + len(fed), "uniform")
    t0 = time.perf_counter()
    rows = [lm.prefill(ids, cache, UBATCH)]
    t1 = time.perf_counter()
    rows += [lm.prefill([t], cache, UBATCH) for t in fed]
    return t1 - t0, (time.perf_counter() - t1) / max(len(fed), 1), np.concatenate(rows)


def bench_model(name, args):  # -> {engine: (best prefill s, best decode s/token)}, max |diff|, NMSE
    model = gguf.load(model_file(name), "text")
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, model.config.n_vocab, args.prompt_len)]
    fed = [int(i) for i in rng.integers(0, model.config.n_vocab, args.n_predict)]
    engines = ("numpy", "numba")
    k_type, v_type = cache_types(args)
    lms = {e: factory.text_model(model, factory.Build(e, "ggml-cpu", kv_type=k_type, v_type=v_type,
                                                      flash_attn=flash_choice(args, "off"))) for e in engines}
    timed_run(lms["numba"], ids[:UBATCH], fed[:2])  # compilation
    best, logits = {e: (np.inf, np.inf) for e in engines}, {}
    for _ in tqdm(range(args.repeat), desc=name, leave=False):
        for e, lm in lms.items():
            prefill, decode, logits[e] = timed_run(lm, ids, fed)
            best[e] = (min(best[e][0], prefill), min(best[e][1], decode))
    return best, float(np.max(max_abs_diff(logits["numpy"], logits["numba"]))), \
        float(np.max(nmse(logits["numpy"], logits["numba"])))


def plot(rows, path):  # [(model, prefill speed-up, decode speed-up)] -> PNG bar chart
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r[1] for r in rows], 0.4, label="prefill")
    ax.bar(x + 0.2, [r[2] for r in rows], 0.4, label="decode")
    ax.set_xticks(x, [r[0] for r in rows])
    ax.set_ylabel("numba / numpy speed (x)")
    ax.set_title("--numerics ggml-cpu: numba over the NumPy emulation, same run")
    ax.legend()
    fig.tight_layout()
    artifacts.save_figure(fig, path, UsageError, dpi=120)


def build_parser():  # -> the parser
    p = OneLineParser(prog="python -m tools.bench_ggml_numba", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", default="tiny-b-q4_k_m,tiny-a-f32",
                   help="comma-separated GGUF paths, or names of golden/models (tiny-a-f32)")
    p.add_argument("--prompt-len", type=int_in(1, 4096), default=64)
    flag(p, "n_predict", type=int_in(0, 256), default=8)
    p.add_argument("--repeat", type=int_in(1, 100), default=3)
    add_cache_flags(p, "off")
    p.add_argument("--plot", type=output_file, help="write a PNG bar chart of the speed-ups here")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    def work():
        names = args.models.split(",")
        for name in names:
            if not os.path.isfile(model_file(name)):
                raise UsageError(f"no model {name!r}: neither a GGUF file nor a name in golden/models")
        flash = flash_choice(args, "off")
        k_type, v_type = cache_types(args)
        if v_type == "q8_0" and not flash:
            raise UsageError("a q8_0 V cache needs -fa on (llama.cpp refuses a quantized V cache without it)")
        print(f"{args.prompt_len}-token prefill, {args.n_predict} decodes, K {k_type} V {v_type}, flash attention "
              f"{'on' if flash else 'off'}, best of {args.repeat}")
        print(f"{'model':16s} {'prefill numpy -> numba':>30s} {'decode/token numpy -> numba':>34s}  "
              "logits numba vs numpy")
        rows, identical = [], True
        for name in names:
            best, diff, err = bench_model(name, args)
            identical &= diff == 0
            (np_p, np_d), (nb_p, nb_d) = best["numpy"], best["numba"]
            rows.append((name, np_p / nb_p, np_d / nb_d if nb_d else float("nan")))
            print(f"{name:16s} {np_p:9.3f} s -> {nb_p:7.3f} s (x{rows[-1][1]:5.1f}) "
                  f"{1e3 * np_d:9.1f} ms -> {1e3 * nb_d:7.1f} ms (x{rows[-1][2]:5.1f})  "
                  f"max |diff| {diff:g}, NMSE {err:g}")
        if args.plot:
            plot(rows, args.plot)
        return 0 if identical else 1  # the twins must agree in every bit
    return exit_status("tools.bench_ggml_numba", work)


if __name__ == "__main__":
    raise SystemExit(main())
