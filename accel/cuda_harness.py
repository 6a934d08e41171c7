"""End-to-end checks of the CuPy CUDA backend (accel/cupy, kernels in accel/cuda) against the NumPy
reference, and a benchmark. The op-by-op checks are accel/harness.py's (`--backend cupy`).

    python -m accel.cuda_harness parity [MODEL]   tiny models (or MODEL.gguf): logits of every prompt position,
                                                  chunked prefill then decode steps, ring vs uniform cache
    python -m accel.cuda_harness products MODEL   the decode and prefill products of each distinct matrix of a
                                                  (large) model against ops.linear on its first rows
    python -m accel.cuda_harness graph            decode steps replayed from the captured graph vs the same
                                                  launches run eagerly: identical bits
    python -m accel.cuda_harness bench MODEL.gguf prefill and decode tokens/s; weight bytes per decode token
                                                  against the H200's 4.8 TB/s
    python -m accel.cuda_harness profile MODEL    one decode step's launches, eager, each between CUDA events:
                                                  device time by kernel, the largest first
    python -m accel.cuda_harness tune MODEL.gguf  the decode kernel's shapes (rows per block, warps per row,
                                                  chunks in flight) on each distinct matrix: the time of a
                                                  decode step's products under each, the best first

NMSE is sum((ref - x)^2) / sum(ref^2) (test-backend-ops' convention); each check also gives max |diff|
and, for logits, top-1 agreement. Each prints one line per check and ends with 'N passed, N failed';
--json writes the records. The functions take the backend, so tests run them on a CPU runtime too.
"""
import argparse
import json
from collections import Counter
import os
import sys
import time

import numpy as np

from reference import gguf, ops
from reference.cli import OneLineParser, add_json_out, exit_status, flag, int_in, write_json
from reference.text import TextModel
from reference.metrics import max_abs_diff, nmse

from .cupy import launch
from .cupy.text import DeviceTextModel

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "models")
TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q4_k_m", "iq4_xs", "iq2_xxs")
PARITY_MODELS = tuple(f"tiny-{c}-{t}" for c in "ab" for t in TYPES)  # every tiny text GGUF in golden/models
PROMPT = [497, 5, 17, 99, 123, 7, 300, 42, 11, 250, 3, 77, 64, 128, 9, 31, 400, 2, 88, 150]
H200_BYTES_PER_S = 4.8e12

# The gate for whole-model logits against the numpy reference. Per op (accel/harness.py) the
# kernels stay within float32 rounding of the reference: the products' 8-term float32 group sums
# add ~6e-8 relative error per group, the rest differs in float64 summation order and the last bit
# of exp/tanh/erf. Through a few layers that stays near 1e-13 (measured on the CPU emulation), so
# 1e-11 leaves 100x; a real bug is larger: the model's eps in place of the post-norm's moves the
# logits by 1.1e-11 (tiny-b, eps 1e-6) and 1.4e-9 (tiny-a).
MODEL_GATE = 1e-11
# products at real widths: 8-term float32 group sums measure ~4e-15 on the emulation; 250x that
PRODUCT_GATE = 1e-12
# Prefill logits [prompt_len, n_vocab] float32 come back to the host: 6.6 GB at 8192 positions of the
# release's vocabulary of 202048.
MAX_PROMPT = 8192
# A decode step reads every weight once; 4096 steps is far past any benchmark's need, and the cache
# grows by a position a step.
MAX_DECODE = 4096


def record(check, ref, got, limit, **extra):  # -> {check, nmse, max_abs_diff, limit, passed, ...}
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    error = float(nmse(ref.ravel(), got.ravel()))
    return dict(check=check, nmse=error, max_abs_diff=float(np.max(max_abs_diff(ref.reshape(len(ref), -1),
                                                                              got.reshape(len(got), -1)))),
                limit=limit, passed=bool(error <= limit and got.shape == ref.shape), **extra)


def logits_record(check, ref, got, limit):
    r = record(check, ref, got, limit)
    r["top1"] = float(np.mean(np.argmax(ref, -1) == np.argmax(got, -1)))
    return r


def check_model(backend, path, prompt=PROMPT, n_decode=4, chunk=3):  # -> records of one model
    model = gguf.load(path, "text")
    ref_lm, dev_lm = TextModel(model), DeviceTextModel(model, np.float32, backend)
    name, limit, out = os.path.basename(path), MODEL_GATE, []
    n_ctx = len(prompt) + n_decode + 1
    ref_logits = ref_lm.prefill(prompt, ref_lm.new_cache(n_ctx, "ring", len(prompt)), len(prompt))
    dev_logits = dev_lm.prefill(prompt, dev_lm.new_cache(n_ctx, "ring", len(prompt)), len(prompt))
    out.append(logits_record(f"{name} prefill {len(prompt)} positions", ref_logits, dev_logits, limit))
    # chunked prefill, then decode steps both fed the reference's greedy tokens
    ref_cache, dev_cache = ref_lm.new_cache(n_ctx, "ring", chunk), dev_lm.new_cache(n_ctx, "ring", chunk)
    ref_chunked = ref_lm.prefill(prompt, ref_cache, chunk)
    dev_chunked = dev_lm.prefill(prompt, dev_cache, chunk)
    out.append(logits_record(f"{name} prefill in chunks of {chunk}", ref_chunked, dev_chunked, limit))
    token, ref_steps, dev_steps = int(np.argmax(ref_chunked[-1])), [], []
    for _ in range(n_decode):
        ref_steps.append(ref_lm.prefill([token], ref_cache, chunk)[-1])
        dev_steps.append(dev_lm.prefill([token], dev_cache, chunk)[-1])
        token = int(np.argmax(ref_steps[-1]))
    out.append(logits_record(f"{name} decode {n_decode} steps", np.stack(ref_steps), np.stack(dev_steps), limit))
    uniform = dev_lm.prefill(prompt, dev_lm.new_cache(n_ctx, "uniform", chunk), chunk)
    out.append(logits_record(f"{name} device ring vs uniform", dev_chunked, uniform, limit))
    return out


def check_products(backend, path, rows=512, tokens=(1, 5)):  # -> records, one per distinct matrix and T
    """The products at a real model's widths without a whole numpy forward: the device multiplies
    the whole matrix, ops.linear the first `rows` rows, exactly dequantized; they are compared there."""
    weights = gguf.load(path, "text").weights
    rng, out, seen = np.random.default_rng(0), [], set()
    for name in weights.tensors:
        shape = weights.shape(name)
        if name == "token_embd.weight" or len(shape) != 2 or (weights.type_name(name), shape) in seen:
            continue
        seen.add((weights.type_name(name), shape))
        ref_w = weights.rows(name, slice(0, rows), np.float64)
        for T in tokens:
            x = rng.standard_normal((T, shape[1])).astype(np.float32)
            got = backend.linear(x, weights.tensor(name))[:, :rows]
            out.append(record(f"{name} {weights.type_name(name)} {list(shape)} T={T}", ops.linear(x, ref_w), got,
                              PRODUCT_GATE))
    return out


def decode_run(lm, prompt, n_decode):  # -> logits [1 + n_decode, V]: the prompt's last, then each greedy step
    cache = lm.new_cache(len(prompt) + n_decode + 1, "ring", len(prompt))
    steps = [lm.prefill(prompt, cache, len(prompt))[-1]]
    for _ in range(n_decode):
        steps.append(lm.prefill([int(np.argmax(steps[-1]))], cache, 1)[-1])
    return np.stack(steps)


def check_graph(backend, path, prompt=PROMPT[:8], n_decode=4):  # -> record: graph replay vs eager, bit for bit
    """The prompt (T = 8) and every decode step (T = 1) run from captured graphs, then the same
    launches eagerly on a fresh cache: the logits must be identical, bit for bit."""
    lm = DeviceTextModel(gguf.load(path, "text"), np.float32, backend)
    replayed = decode_run(lm, prompt, n_decode)
    lm.use_graphs = False
    eager = decode_run(lm, prompt, n_decode)
    lm.use_graphs = True
    r = record(f"{os.path.basename(path)} graph replay vs eager, {n_decode} decode steps", eager, replayed, 0.0)
    r["passed"] = bool(np.array_equal(eager.view(np.uint32), replayed.view(np.uint32)))
    return r


def timed(fn, repeat, sync):  # -> seconds per call of fn, after one warm-up call
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeat


def bench(backend, path, prompt_len=512, n_decode=32, repeat=50):  # -> report dict
    """Prefill of prompt_len tokens and greedy decode, end to end (host work included); then the
    decode graph replayed alone (the device's time per token) and the decode product of every
    matrix alone, as bandwidth: weight bytes read / time, against 4.8 TB/s. For a model of a few
    layers of the release widths (tools.make_synthetic --layout 30b --layers 2), the projection
    puts 52 layers of its layer 0 (products, plus its share of the rest of the step) before its head."""
    model = gguf.load(path, "text")
    lm = DeviceTextModel(model, np.float32, backend)
    c, rt = lm.cfg, backend.rt
    ids = [int(i) for i in np.random.default_rng(0).integers(0, c.n_vocab - 3, prompt_len)]
    decode_run(lm, ids[:8], 1)  # uploads the weights
    cache = lm.new_cache(prompt_len + n_decode + 2, "ring", prompt_len)
    t0 = time.perf_counter()
    logits = lm.prefill(ids, cache, prompt_len)
    t_prefill = time.perf_counter() - t0
    token = int(np.argmax(lm.prefill([int(np.argmax(logits[-1]))], cache, prompt_len)[-1]))  # captures the graph
    t0 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(lm.prefill([token], cache, prompt_len)[-1]))
    t_decode = (time.perf_counter() - t0) / n_decode
    t_graph = timed(cache.graphs[1].replay, repeat, rt.synchronize)
    matrices = [t for t in backend.tensors.values() if t is not None]
    products = {}
    x = rt.zeros((1, max(t.n_in for t in matrices)))
    for t in matrices:
        y = rt.empty((1, t.n_out))
        seconds = timed(lambda: launch.linear(rt, x[:, :t.n_in], t, y, backend.tables), repeat, rt.synchronize)
        products[t.name] = dict(type=t.qtype.name, shape=[t.n_out, t.n_in], bytes=t.data.nbytes, us=seconds * 1e6,
                                bandwidth=t.data.nbytes / seconds / H200_BYTES_PER_S)
    step_bytes = sum(p["bytes"] for p in products.values())
    layer = [p for name, p in products.items() if name.startswith("blk.0.")]
    head = [p for name, p in products.items() if not name.startswith("blk.")]
    rest_us = (t_graph * 1e6 - sum(p["us"] for p in products.values())) / c.n_layer  # norms, attention, launches
    layer_us = sum(p["us"] for p in layer) + rest_us
    us_52 = 52 * layer_us + sum(p["us"] for p in head)
    bytes_52 = 52 * sum(p["bytes"] for p in layer) + sum(p["bytes"] for p in head)
    return dict(model=os.path.basename(path), n_layer=c.n_layer, prompt_len=prompt_len, n_decode=n_decode,
                prefill_tok_s=prompt_len / t_prefill, decode_tok_s=1 / t_decode, decode_graph_us=t_graph * 1e6,
                weight_bytes_per_token=step_bytes, decode_bandwidth=step_bytes / t_graph / H200_BYTES_PER_S,
                projected_52_layers=dict(decode_us=us_52, weight_bytes=bytes_52,
                                         bandwidth=bytes_52 / (us_52 * 1e-6) / H200_BYTES_PER_S),
                products=products)


TUNE_ROWS, TUNE_WARPS, TUNE_UNROLL = (1, 2, 4), (2, 4, 8), (1, 2)


def device_us(rt, fn, repeat):  # -> device microseconds per call of fn's launches: `repeat` calls in one graph
    graph = rt.capture(lambda: [fn() for _ in range(repeat)])
    return 1e6 * timed(graph.replay, 3, rt.synchronize) / repeat


def tune(path, repeat=20):  # -> [{rows, warps, unroll, step_us, bandwidth}], fastest first
    """Every decode-kernel shape on each distinct (type, shape) matrix of the model, T = 1, timed on
    the device (launches replayed from a graph, so the host's launch cost is out). A step's time is
    the sum over all of the model's matrices, each timed as its distinct twin; MV_UNROLL is a
    compile-time constant, so each value gets its own runtime."""
    from .cupy import kernels
    from .cupy.runtime import CupyRuntime
    weights = gguf.load(path, "text").weights
    names = [n for n in weights.tensors if launch.supported(weights.tensor(n)) and n != "token_embd.weight"]
    kind = lambda n: (weights.type_name(n), weights.shape(n))  # noqa: E731
    count, twin = Counter(map(kind, names)), {}
    for n in names:
        twin.setdefault(kind(n), n)
    out = []
    for unroll in TUNE_UNROLL:
        rt = CupyRuntime((f"-DMV_UNROLL={unroll}",))
        tables = rt.to_device(kernels.lookup_tables())
        tensors = {key: launch.DeviceTensor(rt, weights.tensor(name)) for key, name in twin.items()}
        x = rt.zeros((1, max(t.n_in for t in tensors.values())))
        for rows in TUNE_ROWS:
            for warps in TUNE_WARPS:
                step_us, step_bytes = 0.0, 0
                for key, t in tensors.items():
                    y = rt.empty((1, t.n_out))
                    args = (int(t.qtype), t.data, t.row_bytes, t.n_out, t.n_in, x[:, :t.n_in], t.n_in, y, t.n_out)
                    us = device_us(rt, lambda: launch.matvec(rt, args, tables, t.n_out, 1, rows, warps), repeat)
                    step_us += count[key] * us
                    step_bytes += count[key] * t.data.nbytes
                out.append(dict(rows=rows, warps=warps, unroll=unroll, step_us=step_us,
                                bandwidth=step_bytes / (step_us * 1e-6) / H200_BYTES_PER_S))
    return sorted(out, key=lambda r: r["step_us"])


class EventRuntime:
    """A runtime whose every launch sits between two CUDA events: device time by kernel name."""

    def __init__(self, rt):
        self.rt, self.events = rt, []

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def launch(self, name, *args):
        cupy = self.rt.cupy
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(self.rt.stream)
        self.rt.launch(name, *args)
        stop.record(self.rt.stream)
        self.events.append((name, start, stop))

    def times_us(self):  # -> {kernel: (launches, total microseconds)}
        self.rt.synchronize()
        out = {}
        for name, start, stop in self.events:
            n, us = out.get(name, (0, 0.0))
            out[name] = (n + 1, us + 1e3 * self.rt.cupy.cuda.get_elapsed_time(start, stop))
        return out


def profile(backend, path, prompt_len=512):  # -> {kernel: (launches, us)} of one eager decode step at that depth
    lm = DeviceTextModel(gguf.load(path, "text"), np.float32, backend)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, lm.cfg.n_vocab - 3, prompt_len)]
    cache = lm.new_cache(prompt_len + 2, "ring", prompt_len)
    token = int(np.argmax(lm.prefill(ids, cache, prompt_len)[-1]))
    lm.use_graphs, rt = False, backend.rt
    backend.rt = lm.rt = EventRuntime(rt)
    try:
        lm.prefill([token], cache, prompt_len)
        return lm.rt.times_us()
    finally:
        backend.rt = lm.rt = rt


def report(records):  # print one line per record and the closing counts -> exit status
    for r in records:
        extra = f" top1={r['top1']:.3f}" if "top1" in r else ""
        print(f"{'PASS' if r['passed'] else 'FAIL'} {r['check']}: NMSE {r['nmse']:.3g} (limit {r['limit']:g}) "
              f"max|diff| {r['max_abs_diff']:.3g}{extra}", flush=True)
    failed = sum(not r["passed"] for r in records)
    print(f"{len(records) - failed} passed, {failed} failed")
    return 1 if failed else 0


def model_names(text):  # argparse type: "tiny-a-f32,tiny-b-q8_0" -> paths of those GGUFs in golden/models
    paths = [os.path.join(MODELS, name + ".gguf") for name in text.split(",")]
    for name, path in zip(text.split(","), paths):
        if not os.path.isfile(path):
            raise argparse.ArgumentTypeError(f"no model {name!r} in golden/models (e.g. {PARITY_MODELS[0]})")
    return paths


def main(argv=None):
    p = OneLineParser(prog="python -m accel.cuda_harness", description=__doc__)
    p.add_argument("what", choices=("parity", "products", "graph", "bench", "tune", "profile"))
    p.add_argument("model", nargs="?", help="the text GGUF (bench, products, tune, profile; parity instead of the tiny models)")
    p.add_argument("--models", type=model_names, default=",".join(PARITY_MODELS),
                   help="parity/graph: tiny model names in golden/models")
    p.add_argument("--prompt-len", type=int_in(1, MAX_PROMPT), help="default: 512 (bench), 20 (parity)")
    flag(p, "n_predict", type=int_in(1, MAX_DECODE), help="decode steps (default: 32 for bench, 4 for parity)")
    add_json_out(p, "the records (or the benchmark report)")
    args = p.parse_args(argv)
    if args.what in ("bench", "products", "tune", "profile") and not args.model:
        p.error(f"{args.what} needs a model")
    from reference import factory
    return exit_status("accel.cuda_harness", lambda: run(args, factory.backend(factory.Build(backend="cupy"))),
                       (factory.FactoryError, gguf.GGUFError))


def run(args, backend):  # -> exit status
    paths = [args.model] if args.model else args.models
    if args.what == "bench":
        result = bench(backend, args.model, args.prompt_len or 512, args.n_predict or 32)
        print(json.dumps({k: v for k, v in result.items() if k != "products"}, indent=1))
        for name, r in result["products"].items():
            print(f"{name:28s} {r['type']:8s} {str(r['shape']):16s} {r['us']:9.1f} us  {100 * r['bandwidth']:5.1f}% of 4.8 TB/s")
        status = 0
    elif args.what == "profile":
        result = profile(backend, args.model, args.prompt_len or 512)
        total = sum(us for _, us in result.values())
        for name, (n, us) in sorted(result.items(), key=lambda kv: -kv[1][1]):
            print(f"{name:24s} {n:5d} launches {us:10.1f} us  {100 * us / total:5.1f}%")
        print(f"{'all':24s} {sum(n for n, _ in result.values()):5d} launches {total:10.1f} us")
        status = 0
    elif args.what == "tune":
        result = tune(args.model)
        for r in result:
            print(f"rows {r['rows']} warps {r['warps']} unroll {r['unroll']}: {r['step_us']:9.1f} us a step's products, "
                  f"{100 * r['bandwidth']:5.1f}% of 4.8 TB/s")
        status = 0
    else:
        if args.what == "parity":
            prompt = PROMPT[:args.prompt_len] if args.prompt_len else PROMPT
            result = [r for path in paths for r in check_model(backend, path, prompt, args.n_predict or 4)]
        elif args.what == "products":
            result = check_products(backend, args.model)
        else:
            result = [check_graph(backend, path) for path in paths]
        status = report(result)
    if args.json_out:
        write_json(args.json_out, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
