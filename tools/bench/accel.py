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
Needs the `accel` extra, and the `parity` extra for llama.cpp. Each subcommand is a module of
tools/bench of its name; this one holds the command line.
"""
import os
import sys

from reference import factory, gguf
from reference.cli import OneLineParser, UsageError, add_json_out, exit_status, flag, int_in, names_in, write_json
from reference.provenance import args_record
from tools.bench import blocks, ceiling, gemm, kernels, make, run, table, vision
from tools.bench.forward import MAX_IMAGE_SIDE, MAX_REPEAT

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
    r.add_argument("--engines", type=names_in(run.ENGINES, "engine", once=True), default=["numba", "numpy", "llama-cpp"])
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
    table.add_parser(sub, threads, add_model)
    gemm.add_parser(sub, threads, add_model)
    c = sub.add_parser("ceiling", help="decode tokens/s no numba kernel exceeds here (floor loops), beside llama.cpp")
    add_model(c)
    flag(c, "threads", type=threads, default=2)
    c.add_argument("--rows", type=int_in(1, MAX_CEILING_ROWS), default=8192,
                   help="rows of the floor loops' packed bytes")
    c.add_argument("--n-in", type=int_in(4, MAX_N_IN), default=make.MID.n_embd, help="a multiple of 4")
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


def shown(report, show, plot):  # -> a subcommand that prints its report and plots it where asked
    def subcommand(args):
        out = report(args)
        show(out)
        if args.plot:
            plot(out, args.plot)
        return out
    return subcommand


def main(argv=None):
    args = build_parser().parse_args(argv)
    reports = {"run": shown(run.run, run.print_ratios, run.plot_run), "kernels": kernels.kernels,
               "blocks": blocks.blocks, "table": table.main, "gemm": gemm.gemm, "ceiling": ceiling.ceiling,
               "vision": shown(vision.vision, vision.print_vision, vision.plot_vision)}  # subcommand -> its report

    def work():
        check_args(args)
        if args.what == "make":
            return make.make(args)
        report = reports[args.what](args)
        if args.json_out:
            write_json(args.json_out, {**report, "provenance": args_record(args)})
        return 0
    return exit_status("tools.bench_accel", work, (gguf.GGUFError, factory.FactoryError))


if __name__ == "__main__":
    sys.exit(main())
