"""`python -m tools.bench_accel table MODEL`: llama-bench's table for llama.cpp (llama-cpp-python, plain
CPU buffers), numba under `--numerics ggml-cpu` and numba exact, in one process, the engines' rounds
in turns, each engine's tokens/s beside llama.cpp's of the same run.

The tests are llama-bench's: `pp N` prefills N tokens into an empty context, `tg N @ dD` decodes N
tokens one at a time after a D-token prompt (not timed; at depth 0 the first step is a one-token
prefill, as llama-bench's first decode is). The flags are llama-bench's: -p, -n, -d, -r, -t; each
depth applies to the tg tests (llama-bench also runs its pp tests at each depth). Every prefill
computes the last position's logits only, as llama-bench's batches do; those logits and each
decode step's are compared with llama.cpp's, the goal of the ggml-cpu mode being NMSE 0.
"""
import os

import numpy as np

from reference import gguf
from reference.cli import UsageError, add_json_out, check_output, flag, int_in, names_in
from tools.bench.engines import (agreement, command_line, ggml_engine, llama_cpp_engine, prompt_ids,
                                 reference_engine, set_threads, text_vocab, timed, warmed)
from tools.bench.forward import MAX_REPEAT, peak_rss_gb

ENGINES = ("llama-cpp", "numba-ggml", "numba")
LABELS = {"llama-cpp": "llama.cpp", "numba-ggml": "numba ggml-cpu", "numba": "numba exact"}
SEED = {"prompts": [512, 2048], "gens": [32], "depths": [0, 2048, 16384]}  # the seed's table
QUICK = {"prompts": [16, 40], "gens": [4], "depths": [0, 24]}  # seconds on the committed tiny models
MAX_CONTEXT = 1 << 17  # a depth or prompt, as tools.bench_accel run --logits last
MAX_GEN = 256  # every decode step's logits are kept for the comparison: 256 x 202048 x 4 B = 207 MB an engine


def sizes(text):  # argparse type: "512,2048" -> [512, 2048], llama-bench's comma lists
    return [int_in(0, MAX_CONTEXT)(t) for t in text.split(",")]


def tests(prompts, gens, depths):  # -> [(name, kind, n, depth)] in the order they run
    return ([(f"pp{p}", "pp", p, 0) for p in prompts if p]
            + [(f"tg{n} @ d{d}", "tg", n, d) for d in depths for n in gens if n])


def run_test(engine, kind, n, depth, ids):  # -> (logits [rows, V], seconds, the depth's prefill seconds or None)
    prefill, decode = engine
    if kind == "pp":
        return (*timed(prefill, ids[:n])[:2], None)
    depth_s = timed(prefill, ids[:depth])[1] if depth else None  # not the test's, but a long prefill's time

    def steps():  # -> [n, V]: at depth 0 the first token is the context's first, a one-token prefill
        first = prefill(ids[:1])[-1] if depth == 0 else decode(ids[depth])
        return np.stack([first] + [decode(token) for token in ids[depth + 1:depth + n]])
    return (*timed(steps)[:2], depth_s)


def model_size(path):  # -> (bytes, parameters) of the file's tensors, llama-bench's size and params
    tensors = gguf.open_reader(path).tensors
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors)


def makers(path, threads, context, room):  # -> {engine: () -> (prefill, decode)} holding `context` tokens
    """room: the decode steps after the longest prefill (llama.cpp's context has DECODE_ROOM more)."""
    return {"llama-cpp": lambda: llama_cpp_engine(path, threads, context, last=True),
            "numba-ggml": lambda: ggml_engine(path, threads, last=True, room=room),
            "numba": lambda: reference_engine(path, "numba", last=True, room=room)}


def table(args):  # -> report dict
    set_threads(args.threads)
    shape = QUICK if args.quick else SEED
    prompts, gens, depths = (getattr(args, flag_) or shape[key] for flag_, key in
                             (("prompt", "prompts"), ("n_predict", "gens"), ("n_depth", "depths")))
    plan = tests(prompts, gens, depths)
    if not plan:
        raise UsageError("no test: every -p and -n is 0")
    context = max(max(p for p in prompts), max(d + n for d in depths for n in gens))
    ids = prompt_ids(text_vocab(args.model), max(context, 8), np.random.default_rng(0))
    made = makers(args.model, args.threads, context, max(gens))
    engines = {name: warmed(made[name], ids) for name in args.engines}
    results = {name: {} for name in engines}
    for name, kind, n, depth in plan:
        rounds = {engine: [] for engine in engines}
        for _ in range(args.repetitions):  # in turns: a busy spell of the machine slows every engine's round
            for engine in engines:
                logits, seconds, depth_s = run_test(engines[engine], kind, n, depth, ids)
                rounds[engine].append((seconds, depth_s))
                results[engine][name] = {"logits": logits}
        for engine, times in rounds.items():
            speeds = n / np.array([seconds for seconds, _ in times])
            results[engine][name].update(seconds=[seconds for seconds, _ in times], tok_s=float(speeds.mean()),
                                         tok_s_std=float(speeds.std(ddof=1)) if len(speeds) > 1 else 0.0)  # llama-bench's stdev
            if depth:  # the prompt before the decode: a prefill of `depth` tokens, timed as pp would be
                results[engine][name]["depth_prefill_tok_s"] = max(depth / depth_s for _, depth_s in times)
        print_progress(name, {engine: results[engine][name] for engine in engines})
    size, params = model_size(args.model)
    report = {"model": os.path.basename(args.model), "size_bytes": size, "params": params, "threads": args.threads,
              "repetitions": args.repetitions, "command": command_line(), "tests": [name for name, *_ in plan],
              "engines": {engine: {name: without_logits(r) for name, r in tests_of.items()}
                          for engine, tests_of in results.items()},
              "peak_rss_gb": peak_rss_gb()}
    if "llama-cpp" in results:
        for engine, tests_of in results.items():
            for name, r in tests_of.items():
                base = results["llama-cpp"][name]
                if engine != "llama-cpp":
                    report["engines"][engine][name].update(over_llama_cpp=r["tok_s"] / base["tok_s"],
                                                           logits_vs_llama_cpp=agreement(base["logits"], r["logits"]))
    return report


def without_logits(result):  # a test's result -> what the report keeps of it
    return {key: value for key, value in result.items() if key != "logits"}


def print_progress(name, results):  # one line a test, as its rounds end
    print(f"{name}: " + ", ".join(f"{LABELS[engine]} {r['tok_s']:.2f} tok/s" for engine, r in results.items())
          + "".join(f"; its prompt, {LABELS[engine]} {r['depth_prefill_tok_s']:.2f} tok/s" for engine, r in results.items()
                    if "depth_prefill_tok_s" in r), flush=True)


def markdown(report):  # -> llama-bench's markdown table, a column for the speed and the logits against llama.cpp
    lines = ["| model | size | params | engine | threads | test | t/s | x llama.cpp | logits vs llama.cpp |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | --- |"]
    size, params = human(report["size_bytes"], 2**20, ("MiB", "GiB")), human(report["params"], 1e6, ("M", "B"))
    for name in report["tests"]:
        for engine, tests_of in report["engines"].items():
            r = tests_of[name]
            ratio = f"x{r['over_llama_cpp']:.2f}" if "over_llama_cpp" in r else ""
            a = r.get("logits_vs_llama_cpp")
            logits = f"NMSE {a['nmse']:.3g}, max \\|diff\\| {a['max_abs_diff']:.3g}" if a else ""
            lines.append(f"| {report['model']} | {size} | {params} | {LABELS[engine]} | {report['threads']} | {name} "
                         f"| {r['tok_s']:.2f} ± {r['tok_s_std']:.2f} | {ratio} | {logits} |")
    return "\n".join(lines) + "\n"


def human(value, unit, names):  # -> "12.34 MiB" below 1024 MiB, else GiB (llama-bench's size and params)
    big = unit * (1024 if unit == 2**20 else 1000)
    return f"{value / big:.2f} {names[1]}" if value >= big else f"{value / unit:.2f} {names[0]}"


def plot(report, path):  # -> None: each test's tokens/s per engine as grouped bars, log scale
    from tools.common import pyplot, save_figure
    plt = pyplot(path)
    names, engines = report["tests"], list(report["engines"])
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    for i, engine in enumerate(engines):
        ax.bar(np.arange(len(names)) + i * width, [report["engines"][engine][name]["tok_s"] for name in names],
               width, label=LABELS[engine])
    ax.set_xticks(np.arange(len(names)) + width * (len(engines) - 1) / 2, names)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.legend()
    ax.set_title(f"{report['model']}, {report['threads']} threads, engines in turns")
    fig.tight_layout()
    save_figure(plt, fig, path)


def add_parser(sub, threads, add_model):  # the `table` subcommand of tools.bench_accel
    t = sub.add_parser("table", help="llama-bench's pp and tg tests for llama.cpp, numba ggml-cpu and numba exact")
    add_model(t)
    flag(t, "prompt", type=sizes, metavar="N,...",
         help=f"pp tests: prompt lengths from an empty context, llama-bench's -p (default {SEED['prompts']})")
    flag(t, "n_predict", type=sizes, metavar="N,...",
         help=f"tg tests: tokens decoded, llama-bench's -n (default {SEED['gens']}; at most {MAX_GEN})")
    flag(t, "n_depth", type=sizes, metavar="D,...",
         help=f"the tg tests' prompt before decoding, llama-bench's -d (default {SEED['depths']})")
    flag(t, "repetitions", type=int_in(1, MAX_REPEAT), default=1, help="rounds of each test per engine")
    flag(t, "threads", type=threads, default=2)
    t.add_argument("--engines", type=names_in(ENGINES, "engine", once=True), default=list(ENGINES))
    t.add_argument("--quick", action="store_true",
                   help=f"the shapes default to {QUICK} (a tiny model in seconds)")
    t.add_argument("--md-out", metavar="F.md", help="write the markdown table to this file too")
    add_json_out(t, "the report")
    t.add_argument("--plot", help="an image of the tokens/s (PNG unless the extension says otherwise)")


def check(args):  # what the argument types cannot see alone -> UsageError
    if args.n_predict and max(args.n_predict) > MAX_GEN:
        raise UsageError(f"-n {max(args.n_predict)}: at most {MAX_GEN} (every step's logits are kept)")
    if args.md_out:
        check_output(args.md_out, "--md-out")


def main(args):  # -> the report, printed as markdown and written where asked
    check(args)
    report = table(args)
    text = markdown(report)
    print(text, end="")
    if args.md_out:
        from tools.common import write_text
        write_text(args.md_out, "--md-out", f"    {report['command']}\n\n" + text)
    if args.plot:
        plot(report, args.plot)
    return report
