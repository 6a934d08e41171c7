"""`python -m reference.run`: slow, exact runs of the reference (the command-line contract of
ARCHITECTURE.md; flags are extended, never renamed).

With no arguments it runs the embedded default model from golden/ on a default prompt and prints
a greedy continuation with timings.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from . import gguf
from .kv import CacheError
from .text import TextModel
from .tokenizer import detokenize
from .tp import TensorParallelBackend, TPError, check_tp
from .trace import Tracer, TraceError

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
DEFAULT_MODEL = os.path.join(GOLDEN, "models", "tiny-a-f32.gguf")
DEFAULT_N_PREDICT = 16


class UsageError(Exception):
    pass


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; the contract is one line, exit 2
        print(f"reference.run: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser():
    p = OneLineParser(prog="python -m reference.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="text GGUF (default: the embedded tiny model in golden/models)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--token-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--n-predict", type=int, default=DEFAULT_N_PREDICT, help="greedy tokens to generate")
    p.add_argument("--logits-out", help="write float32 [n_prompt_tokens, n_vocab] logits of one prefill")
    p.add_argument("--trace", help="write one .npy per named trace point and index.json into this directory")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--kv", choices=("ring", "uniform"), default="ring")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=0, help="context size (default: prompt + n-predict)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--tp", type=int, default=1, help="simulate N-way tensor parallelism (N divides n_head_kv)")
    return p


def parse_token_ids(text, n_vocab):  # "1,2,3" -> [1, 2, 3], each in [0, n_vocab)
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise UsageError(f"--token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--token-ids is empty")
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        raise UsageError(f"token id {bad[0]} is out of range for a vocabulary of {n_vocab}")
    return ids


def default_prompt(tok):  # the BOS token and a few ordinary tokens, so no tokenizer is needed
    first = [tok.bos] if tok.bos >= 0 else []
    return first + [i for i, t in enumerate(tok.token_types) if t == 1][:8]


def run(args):  # parsed args -> exit status
    timings = {}
    t0 = time.perf_counter()
    model = gguf.load(args.model or DEFAULT_MODEL, "text")
    backend = None
    if args.tp != 1:
        check_tp(model.config, args.tp)
        backend = TensorParallelBackend(np.dtype(args.dtype), args.tp)
    lm = TextModel(model, dtype=np.dtype(args.dtype), backend=backend)
    timings["load"] = time.perf_counter() - t0
    tok = model.tokenizer
    prompt = parse_token_ids(args.token_ids, tok.n_vocab) if args.token_ids else default_prompt(tok)
    if args.n_predict < 0 or args.prefill_chunk <= 0 or args.ctx < 0:
        raise UsageError("--n-predict, --prefill-chunk and --ctx must not be negative (chunk must be positive)")
    n_ctx = args.ctx or len(prompt) + args.n_predict
    cache = lm.new_cache(n_ctx, args.kv, args.prefill_chunk)
    tracer = Tracer(args.trace)

    t0 = time.perf_counter()
    logits = lm.prefill(prompt, cache, args.prefill_chunk, tracer)
    timings["prefill"] = time.perf_counter() - t0
    tracer.close()
    if args.logits_out:
        np.save(args.logits_out, logits.astype(np.float32))

    t0 = time.perf_counter()
    generated = []
    if args.n_predict:
        generated = lm.decode_greedy(logits[-1], args.n_predict, cache, args.prefill_chunk)
    timings["decode"] = time.perf_counter() - t0
    text = detokenize(tok, generated)
    if args.json:
        print(json.dumps({"prompt_tokens": prompt, "tokens": generated, "text": text, "timings": timings}))
    else:
        print(detokenize(tok, prompt) + text)
        rate = len(generated) / timings["decode"] if generated and timings["decode"] > 0 else 0.0
        print(f"\n[{len(prompt)} prompt tokens in {timings['prefill']:.3f} s, {len(generated)} generated "
              f"at {rate:.1f} tok/s, load {timings['load']:.3f} s]", file=sys.stderr)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (gguf.GGUFError, CacheError, TraceError, TPError, UsageError) as e:
        print(f"reference.run: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"reference.run: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
