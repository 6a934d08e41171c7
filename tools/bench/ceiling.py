"""`python -m tools.bench_accel ceiling`: the floor loops of kernel_floor.py on streamed bytes, the
decode tokens/s they bound any numba kernel to on a model, and llama.cpp's and numba's decode beside it."""
import os
import tempfile

import numpy as np

from reference import factory, gguf
from reference.cli import UsageError
from tools.bench.engines import command_line, llama_cpp_engine, prompt_ids, reference_engine, set_threads, text_vocab, timed
from tools.bench.kernels import slice_gguf
from tools.bench.run import bench_engine


def weights_per_type(path):  # -> {type name: weights of the multiplied matrices}, token_embd is looked up
    counts = {}
    for t in gguf.open_reader(path).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return counts


def ceiling(args):  # -> report dict
    """Decode tokens/s at most, if every kernel ran at its floor loop's speed, against llama.cpp's
    and numba's measured decode in the same process; and numba's own decode kernel of each floor
    type on the model's largest matrix of it, timed in the same rounds as the floors."""
    with tempfile.TemporaryDirectory() as tmp:
        return timed_ceiling(args, os.path.join(tmp, "rows.gguf"))


def ceiling_runs(args, rows_path, counts, rng):  # -> ({(what, name): (run, weight-products)}, floor loops, kernels)
    """The floor loops of every bit width the model's types need, and numba's decode product of each
    type on rows copied from the model (kernel_floor), each a closure timed in the same rounds."""
    from tools.bench import kernel_floor
    numba = factory.backend(factory.Build(backend="numba"))
    low = rng.integers(0, 256, (args.rows, args.n_in // 2), dtype=np.uint8)  # 40 MB in all: streamed, as in decode
    high = rng.integers(0, 256, (args.rows, args.n_in // 4), dtype=np.uint8)
    x = rng.standard_normal(args.n_in).astype(np.float32)
    out = np.empty(args.rows, np.float32)
    loops = {b: kernel_floor.floor_loop(b) for b in {kernel_floor.FLOOR_BITS[t] for t in counts if t in kernel_floor.FLOOR_BITS}}
    if not loops:  # an F16 or IQ-only model: no bound to give
        raise UsageError(f"{args.model}: no weight type with a floor loop ({', '.join(sorted(counts))}; floors: "
                         f"{', '.join(kernel_floor.FLOOR_BITS)})")
    slice_gguf(args.model, rows_path, args.rows)
    weights = gguf.Weights(gguf.open_reader(rows_path), rows_path)
    kernels = {}  # type -> (tensor, its x): numba's decode product (one row of x) on the copied rows
    for name in weights.tensors:
        if weights.type_name(name) in kernel_floor.FLOOR_BITS:
            kernels[weights.type_name(name)] = name, rng.standard_normal((1, weights.shape(name)[1])).astype(np.float32)
    runs = {**{("floor", f"{4 + b}-bit"): (lambda loop=loop: loop(low, high, x, out), args.rows * args.n_in)
               for b, loop in loops.items()},
            **{("kernel", t): (lambda name=name, xk=xk: numba.linear(xk, weights.tensor(name)),
                               int(np.prod(weights.shape(name)))) for t, (name, xk) in kernels.items()},
            **q4_k_steps(weights, kernels)}
    return runs, loops, kernels


def timed_ceiling(args, rows_path):  # -> report dict; rows_path: where the kernels' rows are copied
    set_threads(args.threads)
    from tools.bench import kernel_floor
    n_vocab = text_vocab(args.model)
    counts = weights_per_type(args.model)
    rng = np.random.default_rng(0)
    runs, loops, kernels = ceiling_runs(args, rows_path, counts, rng)
    for run, _ in runs.values():
        run()  # compile, or load the numba cache
    rounds = {key: [] for key in runs}  # wall seconds of every round

    def time_floors():  # rounds of every loop in turn: the machine's quiet moments count for all of them
        for _ in range(args.repeat_floor):
            for key, (run, _) in runs.items():
                rounds[key].append(timed(run)[1])
    time_floors()
    ids = prompt_ids(n_vocab, args.prompt_len, rng)
    decode = {name: bench_engine(make_engine, ids, args.n_predict, args.repeat)[1]["decode_tok_s"]
              for name, make_engine in (("llama-cpp", lambda: llama_cpp_engine(args.model, args.threads, args.prompt_len)),
                                        ("numba", lambda: reference_engine(args.model, "numba")))}
    time_floors()  # before and after the engines: the best of both for the bound, which only gets looser
    rates = {key: runs[key][1] / min(seconds) / 1e9 for key, seconds in rounds.items()}  # G weight-products/s, best round
    floors = {b: rates["floor", f"{4 + b}-bit"] for b in loops}
    kernel_gw_s = {t: rates["kernel", t] for t in kernels}
    shares = floor_shares(rounds, runs)
    print_rates(floors, shares, rates)
    bound_s = kernel_floor.model_bound(counts, floors)
    llama = decode["llama-cpp"]
    report = {"model": os.path.basename(args.model), "threads": args.threads,
              "command": command_line(), "weights_per_type": counts,
              "floor_gw_s": {f"{4 + b}-bit": v for b, v in floors.items()}, "kernel_gw_s": kernel_gw_s,
              "kernel_over_floor": {t: v / floors[kernel_floor.FLOOR_BITS[t]] for t, v in kernel_gw_s.items()},
              "share_of_floor": {f"{t} {what}": share for (what, t), share in shares.items()},
              "decode_tok_s": decode,
              "bound_tok_s": 1 / bound_s, "bound_over_llama_cpp": 1 / bound_s / llama,
              "numba_over_llama_cpp": decode["numba"] / llama}
    free = sorted(t for t in counts if t not in kernel_floor.FLOOR_BITS)
    print(f"decode at most {report['bound_tok_s']:.2f} tok/s (types without a floor counted free: {free or 'none'}), "
          f"x{report['bound_over_llama_cpp']:.2f} of llama.cpp's {llama:.2f}; numba {decode['numba']:.2f} tok/s, "
          f"x{report['numba_over_llama_cpp']:.2f}")
    return report


def print_rates(floors, shares, rates):  # -> None: each floor loop's rate, each kernel's with its share of its floor
    for b, rate in sorted(floors.items()):
        print(f"floor loop, {4 + b}-bit fields: {rate:6.2f} G weight-products/s")
    for (what, t), share in shares.items():
        label = f"numba's {t} decode kernel" if what == "kernel" else t.replace(" ", " kernel ", 1)
        print(f"{label}: {rates[what, t]:6.2f} G weight-products/s, {share:.0%} of its floor")


def q4_k_steps(weights, kernels):  # -> {("step", name): (run, weight-products)}: kernel_floor.q4_k_step on the Q4_K rows
    if "Q4_K" not in kernels:
        return {}
    from accel.numba import quant
    from tools.bench import kernel_floor
    name, xk = kernels["Q4_K"]
    n_out, n_in = weights.shape(name)
    blocks, out = quant.as_blocks(weights.raw(name), n_out), np.empty(n_out)
    return {("step", f"Q4_K {label}"): (lambda loop=kernel_floor.q4_k_step(scaled): loop(blocks, xk[0], out, quant.TABLES),
                                        n_out * n_in)
            for label, scaled in (("without scales or mins", False), ("without mins", True))}


def floor_shares(rounds, runs):  # -> {(what, type): its speed / its floor's}, the median over the rounds
    """Each round's own ratio: a loop and its floor run next to each other in a round, under the same
    load; the best rounds of each (what the G/s figures give) can fall in different quiet moments."""
    from tools.bench import kernel_floor
    shares = {}
    for key, seconds in rounds.items():
        if key[0] != "floor":
            floor = ("floor", f"{4 + kernel_floor.FLOOR_BITS[key[1].split()[0]]}-bit")
            per_round = [runs[key][1] / s / (runs[floor][1] / f) for s, f in zip(seconds, rounds[floor])]
            shares[key] = float(np.median(per_round))
    return shares
