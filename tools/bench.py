"""Benchmarks as ratios against a peer run in the same process: prefill and decode tokens/s of this
reference vs transformers eager (CPU, float32) on the same weights.

    python -m tools.bench text --model golden/models/tiny-b-f32.gguf --checkpoint build/tiny/tiny-b \
        [--prompt-len 100 --n-decode 32 --repeat 3 --json out.json]

The checkpoint is the transformers directory the GGUF was converted from (tools.make_tiny writes
it under build/). Needs the `parity` extra (torch, transformers).
"""
import argparse
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from reference import gguf
from reference.text import TextModel


def best_of(repeat, fn):  # -> the fastest wall time of `repeat` calls (the least disturbed run)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def reference_runs(model_path, ids, n_decode, dtype=np.float32):  # -> (prefill fn, decode fn)
    lm = TextModel(gguf.load(model_path, "text"), dtype)
    n_ctx = len(ids) + n_decode

    def prefill():
        lm.prefill(ids, lm.new_cache(n_ctx, "ring"))

    def decode():
        cache = lm.new_cache(n_ctx, "ring")
        lm.prefill(ids, cache)
        for t in range(n_decode):
            lm.prefill([t], cache)
    return prefill, decode


def transformers_runs(checkpoint, ids, n_decode):  # -> (prefill fn, decode fn)
    import torch
    from transformers import AutoModelForImageTextToText
    torch.set_grad_enabled(False)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    input_ids = torch.tensor([ids])

    def prefill():
        model(input_ids=input_ids, use_cache=False)

    def decode():
        out = model(input_ids=input_ids, use_cache=True)
        past = out.past_key_values
        for t in range(n_decode):
            out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return prefill, decode


def bench_text(args):  # -> report dict
    ids = list(np.random.default_rng(0).integers(0, 400, args.prompt_len))
    engines = {"reference": lambda: reference_runs(args.model, ids, args.n_decode),
               "transformers-eager": lambda: transformers_runs(args.checkpoint, ids, args.n_decode)}
    report = {"prompt_len": args.prompt_len, "n_decode": args.n_decode, "repeat": args.repeat, "engines": {}}
    for name, make in tqdm(engines.items(), desc="engines"):
        prefill, decode = make()
        prefill()  # warm-up: caches, lazy imports, allocator
        t_prefill = best_of(args.repeat, prefill)
        t_decode = best_of(args.repeat, decode) - t_prefill
        report["engines"][name] = {"prefill_tok_s": args.prompt_len / t_prefill,
                                   "decode_tok_s": args.n_decode / t_decode}
    ref, peer = report["engines"]["reference"], report["engines"]["transformers-eager"]
    report["ratio_reference_over_transformers"] = {k: ref[k] / peer[k] for k in ref}
    return report


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("text", help="text model prefill and decode, reference vs transformers eager")
    t.add_argument("--model", required=True)
    t.add_argument("--checkpoint", required=True)
    t.add_argument("--prompt-len", type=int, default=100)
    t.add_argument("--n-decode", type=int, default=32)
    t.add_argument("--repeat", type=int, default=3)
    t.add_argument("--json")
    args = p.parse_args(argv)
    report = bench_text(args)
    for name, r in report["engines"].items():
        print(f"{name:20s} prefill {r['prefill_tok_s']:9.1f} tok/s   decode {r['decode_tok_s']:8.1f} tok/s")
    ratio = report["ratio_reference_over_transformers"]
    print(f"reference / transformers: prefill x{ratio['prefill_tok_s']:.2f}, decode x{ratio['decode_tok_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
