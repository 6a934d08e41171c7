"""`python -m tools.bench_accel run`: prefill and decode tokens/s of numba, numba-ggml, the numpy
reference and llama.cpp on one GGUF, as ratios from one run, and their logits against each other:
the best of rounds (in turns with --turns), or each engine once in a process of its own (--one-shot)."""
import os
import tempfile
import time

import numpy as np

from reference.cli import UsageError
from tools.bench.engines import (agreement, command_line, ggml_engine, llama_cpp_engine, prompt_ids, reference_engine,
                                 set_threads, text_vocab, timed, warmed)
from tools.bench.forward import peak_rss_gb

ENGINES = ("numba", "numba-ggml", "numpy", "llama-cpp")  # numba-ggml: --numerics ggml-cpu on numba


def bench_round(engine, ids, n_decode):  # -> (prompt logits, {prefill_s, prefill_cpu_s, decode_s, decode_cpu_s})
    prefill, decode = engine
    logits, wall, cpu = timed(prefill, ids)
    steps = [timed(decode, int(token))[1:] for token in ids[:n_decode]]
    return logits, {"prefill_s": wall, "prefill_cpu_s": cpu, "decode_s": sum(w for w, _ in steps),
                    "decode_cpu_s": sum(c for _, c in steps)}


def best_rounds(rounds, n_prompt, n_decode):  # [(logits, times)] -> (last logits, the best of each time, tok/s)
    best = {key: min(times[key] for _, times in rounds) for key in rounds[0][1]}
    speeds = {"prefill_tok_s": n_prompt / best["prefill_s"], "decode_tok_s": n_decode / best["decode_s"]}
    return rounds[-1][0], {**best, **speeds}


def bench_engine(make_engine, ids, n_decode, repeat):  # -> (prompt logits, {prefill_tok_s, decode_tok_s, ...})
    """The best of `repeat` rounds of (prefill the prompt, decode n_decode tokens after it): on a
    shared machine the least disturbed round is the closest to the engine's own speed. CPU seconds
    (all threads) are reported beside wall seconds: they move less when other jobs share the cores."""
    engine = warmed(make_engine, ids)
    return best_rounds([bench_round(engine, ids, n_decode) for _ in range(repeat)], len(ids), n_decode)


def bench_in_turns(makers, ids, plans):  # plans {name: (n_decode, repeat)} -> {name: (logits, report)}
    """bench_engine's rounds with every engine held at once and the rounds taken in turns (engine 1,
    engine 2, ..., again): a busy spell of a shared machine slows one round of each engine, not one
    engine's every round."""
    engines = {name: warmed(makers[name], ids) for name in plans}
    rounds = {name: [] for name in plans}
    for turn in range(max(repeat for _, repeat in plans.values())):
        for name, (n_decode, repeat) in plans.items():
            if turn < repeat:
                rounds[name].append(bench_round(engines[name], ids, n_decode))
    return {name: best_rounds(rounds[name], len(ids), plans[name][0]) for name in plans}


def engine_makers(args):  # -> {engine name: () -> (prefill, decode)} of the run's model and options
    last = args.logits == "last"
    return {"numba": lambda: reference_engine(args.model, "numba", last),
            "numba-ggml": lambda: ggml_engine(args.model, args.threads, last),
            "numpy": lambda: reference_engine(args.model, "numpy", last),
            "llama-cpp": lambda: llama_cpp_engine(args.model, args.threads, args.prompt_len, last)}


def one_shot(name, args, ids, n_decode, logits_path, conn):  # in a process of its own -> conn gets its times
    """What a user's one command costs: load, one prefill, n_decode steps, nothing warmed; the peak
    RSS is this process's alone (the mapped weights it touched included, as for llama.cpp)."""
    set_threads(args.threads)
    t0, c0 = time.perf_counter(), time.process_time()
    engine = engine_makers(args)[name]()
    load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    logits, times = bench_round(engine, ids, n_decode)
    np.save(logits_path, logits)
    conn.send({**times, "load_s": load_s, "load_cpu_s": load_cpu_s,
               "total_s": load_s + times["prefill_s"] + times["decode_s"],
               "peak_rss_gb": peak_rss_gb()})


def read_through(path):  # -> None: the file's pages into the page cache, as a second run of any command finds them
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


def bench_one_shot(name, args, ids, n_decode):  # -> (prompt logits, report) of one_shot in a spawned process
    """Every engine starts from the same page cache (the model read through first): otherwise the
    first engine pays the disk reads of the mapped weights and the next one finds them cached."""
    import multiprocessing
    read_through(args.model)
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing loaded, nothing compiled
    receive, send = spawn.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "logits.npy")
        t0 = time.perf_counter()
        child = spawn.Process(target=one_shot, args=(name, args, ids, n_decode, path, send))
        child.start()
        send.close()  # the child's end only: its exit without a reply is then an EOF here, not a wait
        try:
            times = receive.recv()
        except EOFError:
            times = None
        child.join()
        if child.exitcode or times is None:
            raise UsageError(f"the {name} engine's process failed (exit status {child.exitcode})")
        times["process_s"] = time.perf_counter() - t0  # the interpreter's start and imports too
        logits = np.load(path)
    return logits, {**times, "prefill_tok_s": len(ids) / times["prefill_s"], "decode_tok_s": n_decode / times["decode_s"]}


def run(args):  # -> report dict
    set_threads(args.threads)
    ids = prompt_ids(text_vocab(args.model), args.prompt_len, np.random.default_rng(0))
    makers = engine_makers(args)
    report = {"model": os.path.basename(args.model), "threads": args.threads, "prompt_len": args.prompt_len,
              "logits": args.logits,
              "command": command_line(),
              "engines": {}, "logits_vs_numba": {}}
    logits = {}
    plans = {name: (args.n_decode_numpy, 1) if name == "numpy" else (args.n_predict, 1 if args.one_shot else args.repeat)
             for name in args.engines}
    results = bench_in_turns(makers, ids, plans) if args.turns else {}
    for name, (n_decode, repeat) in plans.items():
        if args.one_shot:
            results[name] = bench_one_shot(name, args, ids, n_decode)
        logits[name], report["engines"][name] = results.get(name) or bench_engine(makers[name], ids, n_decode, repeat)
        report["engines"][name].update(n_decode=n_decode, repeat=repeat)
        r = report["engines"][name]
        print(f"{name:10s} prefill {r['prefill_tok_s']:8.3f} tok/s ({r['prefill_cpu_s']:7.2f} CPU s)   "
              f"decode {r['decode_tok_s']:8.3f} tok/s ({r['decode_cpu_s'] / n_decode:6.2f} CPU s/token)"
              + (f"   one shot {r['total_s']:7.2f} s (load {r['load_s']:.2f} s), peak RSS {r['peak_rss_gb']:.2f} GB"
                 if args.one_shot else ""), flush=True)
    for name in logits:
        if name != "numba" and "numba" in logits:
            report["logits_vs_numba"][name] = agreement(logits[name], logits["numba"])
    if "numba-ggml" in logits and "llama-cpp" in logits:  # the ggml-cpu mode's goal is 0
        report["logits_vs_numba"]["llama-cpp vs numba-ggml"] = agreement(logits["llama-cpp"], logits["numba-ggml"])
        ggml, lcpp = report["engines"]["numba-ggml"], report["engines"]["llama-cpp"]
        print(f"numba-ggml/llama-cpp: prefill x{ggml['prefill_tok_s'] / lcpp['prefill_tok_s']:.3f}, "
              f"decode x{ggml['decode_tok_s'] / lcpp['decode_tok_s']:.3f}"
              + (f", one shot x{lcpp['total_s'] / ggml['total_s']:.3f} of llama.cpp's speed, peak RSS "
                 f"{ggml['peak_rss_gb'] - lcpp['peak_rss_gb']:+.2f} GB" if args.one_shot else ""))
    ours = report["engines"].get("numba")
    report["ratios"] = {f"numba/{name}": {"prefill_tok_s": ours["prefill_tok_s"] / r["prefill_tok_s"],
                                          "decode_tok_s": ours["decode_tok_s"] / r["decode_tok_s"],
                                          "prefill_per_cpu_s": r["prefill_cpu_s"] / ours["prefill_cpu_s"],
                                          "decode_per_cpu_s": (r["decode_cpu_s"] / r["n_decode"])
                                          / (ours["decode_cpu_s"] / ours["n_decode"])}
                        for name, r in report["engines"].items() if name != "numba" and ours}
    return report


def print_ratios(report):  # the ratios and logit agreements of a run report, one line each
    for pair, ratio in report["ratios"].items():
        print(f"{pair}: prefill x{ratio['prefill_tok_s']:.2f}, decode x{ratio['decode_tok_s']:.2f} (per CPU second: "
              f"prefill x{ratio['prefill_per_cpu_s']:.2f}, decode x{ratio['decode_per_cpu_s']:.2f})")
    for name, a in report["logits_vs_numba"].items():
        pair = name if " vs " in name else f"{name} vs numba"
        print(f"logits {pair}: NMSE {a['nmse']:.3g}, max |diff| {a['max_abs_diff']:.3g}, "
              f"top-1 {a['top1']:.3f}")


def plot_run(report, path):  # -> None: a run report's prefill and decode tokens/s per engine as bars, one image
    from tools.common import pyplot, save_figure
    plt = pyplot(path)
    names = list(report["engines"])
    panels = [("prefill_tok_s", f"prefill, {report['prompt_len']} tokens", "tokens/s"),
              ("decode_tok_s", "decode, one token a step", "tokens/s")]
    if "peak_rss_gb" in report["engines"][names[0]]:  # --one-shot
        panels += [("total_s", "one shot, load included", "seconds"), ("peak_rss_gb", "peak RSS", "GB")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5))
    for ax, (key, title, unit) in zip(axes, panels):
        ax.bar(names, [report["engines"][name][key] for name in names], color="tab:blue")
        ax.set_title(title)
        ax.set_ylabel(unit)
    fig.suptitle(f"{report['model']}, {report['threads']} threads")
    fig.tight_layout()
    save_figure(plt, fig, path)

