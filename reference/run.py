"""`python -m reference.run`: slow, exact runs of the reference. Flags are extended, never renamed.

With no arguments it runs the embedded default model from golden/ on a default prompt and prints a
greedy continuation with timings; `--model` naming that file runs the same prompt. Prompt text,
from --prompt or --prompt-file, is read as bytes, as llama.cpp reads it (a CRLF file keeps its \\r).
--logits-out F.npy holds the logits of every prompt position; with --logits-positions or
--logits-topk it is F.positions.npz (reference/positions.py's POSITIONS_FORMAT), and only the kept
positions pass through the output head, so a long prompt's golden costs megabytes.
"""
import argparse
import json
import os
import resource
import sys
import time
from functools import partial

import numpy as np
from tqdm import tqdm

from . import artifacts, factory, gguf
from .chat import IMAGE_PLACEHOLDER, ChatError, chat_prompt, expand_images, prompt_ids, token_id
from .cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, OneLineParser, UsageError, check_output, check_train_context,
                  exit_status, float_in, int_in, parse_token_ids)
from .dflash import Speculator, acceptance
from .factory import DEFAULT_MODEL, Build, FactoryError
from .ggml_cpu import KV_TYPES, TARGETS, UBATCH, GgmlCpuError
from .governor import CostGovernor, FloorBandit
from .image import ImageError, load_rgb
from .kv import CacheError, layer_rows
from .positions import SUFFIX, parse_positions, resolve, sparse_golden
from .tokenizer import Tokenizer, TokenizerError, detokenize
from .tp import TPError
from .trace import Tracer, TraceError
from .vision import DEFAULT_MAX_TOKENS, check_compatible

DEFAULT_PROMPT = "initial value. If it"  # a held-out docstring line (golden/prompts/glimmer-default.jsonl)
HINT = ("[more: --prompt TEXT | --chat --prompt TEXT | --draft-model golden/models/glimmer-default-dflash-f16.gguf"
        " | --mmproj golden/models/glimmer-default-mmproj-f16.gguf --image IMG | --logits-out F.npy | --trace DIR"
        " | --model GGUF | --json | --help]")
DEFAULT_N_PREDICT = 16
PROGRESS_BYTES = 1 << 30
# Token counts (--n-predict, --ctx, --prefill-chunk) beyond any machine's memory; check_context then
# refuses a context whose KV cache would not fit here, before it is allocated.
MAX_TOKENS = 1 << 40
MAX_DRAFT = 1 << 10  # drafted tokens a step: the drafter clamps it to its block_size - 1 anyway
MAX_TP = 1 << 10  # simulated tensor-parallel ranks; check_tp then asks that they divide n_head_kv
MAX_TOP_K = 1 << 31  # top-k is clamped to the vocabulary
TOPK_BLOCK = 16  # kept rows reduced to their top-k at a time (26 MB of float64 a pass at the 30B's vocabulary)


def p_min_type(text):  # argparse type: --spec-p-min -> a float in [0, 1] or "auto"
    if text == "auto":
        return text
    try:
        return float_in(0.0, 1.0)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; or 'auto'") from None


def build_parser():  # -> the parser; every number is range-checked as it is parsed, before any load
    p = OneLineParser(prog="python -m reference.run", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="text GGUF (default: the embedded tiny model in golden/models)")
    add_prompt_flags(p)
    add_output_flags(p)
    add_compute_flags(p)
    add_draft_flags(p)
    add_image_flags(p)
    return p


def add_prompt_flags(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--token-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text, tokenized with the GGUF's tokenizer")
    src.add_argument("--prompt-file", help="file holding the prompt text (its bytes as they are, as llama.cpp)")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user message with the GGUF's chat template")
    p.add_argument("--system", help="system message for --chat (default: the template's own system block)")
    p.add_argument("--date", help="YYYY-MM-DD the chat template sees as today (default: today): reproducible prompts")
    p.add_argument("--no-special", action="store_true", help="tokenize special-token text in the prompt as plain text")
    p.add_argument("--tokenize-only", action="store_true", help="print the JSON list of prompt token ids and exit")


def add_output_flags(p):
    p.add_argument("--n-predict", type=int_in(0, MAX_TOKENS), default=DEFAULT_N_PREDICT,
                   help=f"greedy tokens to generate (default {DEFAULT_N_PREDICT})")
    p.add_argument("--logits-out", help="write the float32 logits of one prefill: [n_prompt_tokens, n_vocab] "
                                        f"to a .npy path, or the kept positions to a {SUFFIX} path")
    p.add_argument("--logits-positions", type=parse_positions, metavar="SPEC",
                   help="keep these prompt positions' logits: last, 0,5,100:120, or --logits-positions=-256: "
                        f"(Python slices, negative from the end; '=' before a leading '-'); "
                        f"--logits-out names a {SUFFIX} file")
    p.add_argument("--logits-topk", type=int_in(1, MAX_TOP_K), metavar="K",
                   help="keep the K largest logits of each kept position and its logsumexp, not the whole row")
    p.add_argument("--trace", help="write one .npy per named trace point and index.json into this directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def add_compute_flags(p):
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--kv", choices=("ring", "uniform"), default="ring",
                   help="ring: sliding-window layers keep their window only; uniform: every layer every position")
    p.add_argument("--prefill-chunk", type=int_in(1, MAX_TOKENS), default=2048, help="prompt rows per forward")
    p.add_argument("--ctx", type=int_in(0, MAX_TOKENS), default=0, help="context size (default: prompt + n-predict)")
    p.add_argument(BEYOND_TRAIN, action="store_true", help=BEYOND_TRAIN_HELP + " (--json: beyond_n_ctx_train)")
    p.add_argument("--tp", type=int_in(1, MAX_TP), default=1,
                   help="simulate N-way tensor parallelism (N divides n_head_kv)")
    p.add_argument("--backend", choices=("numpy", "numba", "cupy"), default="numpy",
                   help="numba: the accel/ kernels, multiplying straight from the quantized blocks (same logits); "
                        "cupy: CUDA kernels, the text forward resident on the GPU with a captured decode graph")
    p.add_argument("--numerics", choices=("exact", "ggml-cpu"), default="exact",
                   help="ggml-cpu: round as llama.cpp's CPU backend does (by default F16 KV cache, flash attention "
                        "off; a uniform cache, prompts in ubatches of at most 512 rows), for bit-identical logits")
    p.add_argument("--kv-type", choices=KV_TYPES,
                   help="with --numerics ggml-cpu: llama.cpp's KV cache type (default f16; q8_0 turns flash "
                        "attention on)")
    p.add_argument("--flash-attn", choices=("on", "off"),
                   help="with --numerics ggml-cpu: llama.cpp's flash attention (default off, on for --kv-type q8_0)")
    p.add_argument("--cpu", choices=tuple(TARGETS),
                   help="with --numerics ggml-cpu: the CPU build of llama.cpp to round as (default avx512; "
                        "neon and neon-i8mm are not emulated yet)")
    p.add_argument("--repack", choices=("on", "off"),
                   help="with --numerics ggml-cpu: llama.cpp's CPU repack of Q4_0/IQ4_NL/Q4_K/Q2_K weights "
                        "(default on; off as llama-cpp-python's use_extra_bufts=False or the tools' --no-repack)")


def add_draft_flags(p):
    p.add_argument("--draft-model", help="DFlash drafter GGUF: speculative greedy decoding (same tokens)")
    p.add_argument("--spec-draft-n-max", type=int_in(0, MAX_DRAFT), default=3,
                   help="draft tokens per step: a block of n + 1 rows, clamped to the drafter's block_size - 1")
    p.add_argument("--spec-p-min", type=p_min_type, default=0.0,
                   help="confidence floor in [0, 1], or 'auto': adaptive floor and a cost governor")


def add_image_flags(p):
    p.add_argument("--mmproj", help="vision projector GGUF (clip, projector muse-glimmer) for --image")
    p.add_argument("--image", action="append", default=[],
                   help="image file (repeatable); each <|patch|> in the prompt takes the next image, "
                        "with none they go right after BOS")
    p.add_argument("--image-max-tokens", type=int_in(1, MAX_TOKENS), default=DEFAULT_MAX_TOKENS,
                   help="merged-token cap per image (llama.cpp's --image-max-tokens)")
    p.add_argument("--embeddings-out",
                   help="write float32 [n_image_tokens, n_embd]: the raw image projections (a .npy path)")


# -------------------------------------------------------------------------------------------------
# What the flags say together, checked before anything loads

def check_flags(args, compute):  # args, their factory.Build -> None; UsageError (FactoryError) for contradictions
    check_prompt_flags(args)
    factory.check(compute)
    check_output_flags(args)
    if args.image and args.draft_model:
        raise UsageError("--draft-model with --image is not supported")
    if not args.image and (args.mmproj or args.embeddings_out):
        raise UsageError("--mmproj and --embeddings-out need --image")
    if args.image and not args.mmproj:
        raise UsageError("--image needs --mmproj")
    if args.image:
        factory.check_tower(compute)


def check_prompt_flags(args):
    text = args.prompt is not None or args.prompt_file is not None
    if (args.system is not None or args.date is not None) and not args.chat:
        raise UsageError("--system and --date only apply with --chat")
    if args.chat and not text:
        raise UsageError("--chat needs --prompt or --prompt-file")
    if args.chat and args.no_special:
        raise UsageError("--chat parses the template's special tokens: it takes no --no-special")
    if args.no_special and not text:
        raise UsageError("--no-special only applies to --prompt or --prompt-file")


def check_output_flags(args):
    """np.save appends .npy to a name without it, so such a file would not be where it was asked
    for: the name must end in its suffix. Refused before the run rather than after it."""
    sparse = args.logits_positions is not None or args.logits_topk is not None
    if sparse and not args.logits_out:
        raise UsageError(f"--logits-positions and --logits-topk need --logits-out F{SUFFIX}")
    if args.logits_out is not None:
        check_output(args.logits_out, "--logits-out", SUFFIX if sparse else ".npy")
    if args.embeddings_out is not None:
        check_output(args.embeddings_out, "--embeddings-out", ".npy")
    inputs = [("--model", model_path(args)), ("--draft-model", args.draft_model), ("--mmproj", args.mmproj),
              ("--prompt-file", args.prompt_file)] + [("--image", image) for image in args.image]
    artifacts.refuse_overwrite([("--logits-out", args.logits_out), ("--embeddings-out", args.embeddings_out),
                                ("--trace", args.trace)], inputs, UsageError)


# -------------------------------------------------------------------------------------------------
# The prompt

def utf8_code_point(data, i):  # -> (code point, bytes read) at data[i], as llama.cpp's unicode_cpt_from_utf8
    """The lead byte says the length and the bytes after it need only be 10xxxxxx: an overlong
    form (C1 81) is read as its code point (A). A byte that starts no such sequence is U+FFFD,
    and the read goes on at the next byte."""
    lead = data[i]
    size = 1 if lead < 0x80 else 0 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF8 else 0
    tail = data[i + 1:i + size]
    if size == 0 or len(tail) < size - 1 or any(b & 0xC0 != 0x80 for b in tail):
        return 0xFFFD, 1
    cpt = lead & (0x7F >> size if size > 1 else 0x7F)
    for b in tail:
        cpt = cpt << 6 | b & 0x3F
    return cpt, size


def llama_text(data, source):  # bytes -> the str llama.cpp's tokenizer sees in them
    try:
        return data.decode("utf-8")  # valid UTF-8 reads the same in both
    except UnicodeDecodeError:
        pass
    chars, i = [], 0
    while i < len(data):
        cpt, size = utf8_code_point(data, i)
        if 0xD800 <= cpt <= 0xDFFF or cpt > 0x10FFFF:  # llama.cpp aborts on the second, tokenizes the first
            raise UsageError(f"{source}: byte {i} encodes U+{cpt:X}, a surrogate or no code point")
        chars.append(chr(cpt))
        i += size
    return "".join(chars)


def prompt_text(args):  # -> the text of --prompt or --prompt-file, from their bytes, or None
    if args.prompt_file is not None:
        # bytes: text mode would turn CRLF into LF
        return llama_text(artifacts.read_bytes(args.prompt_file, UsageError, what="prompt file"), args.prompt_file)
    if args.prompt is not None:  # argv's bytes, as the shell passed them (undecodable ones survive as escapes)
        return llama_text(os.fsencode(args.prompt), "--prompt")
    return None


def default_prompt(tok, embedded):  # -> prompt ids
    """DEFAULT_PROMPT for the embedded model; for another model the BOS token and a few ordinary
    tokens, so that any vocabulary works without a tokenizer."""
    if embedded:
        return Tokenizer(tok).tokenize(DEFAULT_PROMPT, add_special=True)
    first = [tok.bos] if tok.bos >= 0 else []
    return first + [i for i, t in enumerate(tok.token_types) if t == 1][:8]


def is_embedded(path):  # -> whether `path` is the embedded default model
    return os.path.exists(path) and os.path.samefile(path, DEFAULT_MODEL)


def prompt_tokens(args, tok):  # -> ids from --token-ids, --prompt/--prompt-file (plain or --chat), or the default
    text = prompt_text(args)
    if text is None:
        if args.token_ids is not None:
            return parse_token_ids(args.token_ids, tok.n_vocab)
        return default_prompt(tok, is_embedded(model_path(args)))
    tokenizer = Tokenizer(tok)
    if not args.chat:
        return tokenizer.tokenize(text, add_special=True, parse_special=not args.no_special)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    images = [{"type": "image"}] * len(args.image)  # before the text, where llama-mtmd-cli puts its markers
    user = {"role": "user", "content": images + [{"type": "text", "text": text}] if images else text}
    return prompt_ids(tokenizer, chat_prompt(tok, system + [user], date=args.date))


# -------------------------------------------------------------------------------------------------
# Memory

def kv_cache_bytes(cfg, n_ctx, kind, chunk, dtype):  # -> bytes the KV cache of TextModel.new_cache takes
    rows = sum(layer_rows(cfg.swa_layers, cfg.n_swa, n_ctx, kind, chunk))
    return rows * (2 * cfg.n_head_kv * cfg.head_dim * np.dtype(dtype).itemsize + 8)  # K and V rows, a position


def memory_bytes():  # -> what this process may allocate: the machine's memory, or less under `ulimit -v`
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return physical if limit == resource.RLIM_INFINITY else min(physical, limit)


def check_context(cfg, n_ctx, layout, dtype):  # refuse a context whose KV cache could never be allocated here
    need, have = kv_cache_bytes(cfg, n_ctx, *layout, dtype), memory_bytes()
    if need > have:
        raise UsageError(f"a context of {n_ctx} tokens (--ctx, or the prompt + --n-predict) needs a "
                         f"{need / 2**30:.3g} GiB KV cache, more than the {have / 2**30:.3g} GiB of memory here")


# -------------------------------------------------------------------------------------------------
# Images

def image_embeddings(args, lm, tracer):  # -> [[n_i, n_embd] per --image]
    if not args.image:
        return []
    vision = factory.vision_model(gguf.load(args.mmproj, "mmproj"), build(args), lm.backend)
    check_compatible(vision, lm.cfg, model_path(args))
    # one trace directory per image: the tower's point names (attn_out-0, ...) are also text ones
    traces = [Tracer(f"image-{i}" if args.trace else None, parent=tracer) for i in range(len(args.image))]
    big = os.path.getsize(args.mmproj) > PROGRESS_BYTES
    progress = partial(tqdm, desc="tower layers", leave=False) if big else None
    out = [vision.encode(load_rgb(path), args.image_max_tokens, trace, progress)
           for path, trace in zip(args.image, traces)]
    for trace in traces:
        trace.close()
    return out


def image_prompt_rows(lm, prompt, images):  # ids with <|patch|> per image -> embeddings [T, n_embd]
    """Each placeholder becomes <|image_start|>, the image's rows, <|image_end|> (one position per
    row, as mtmd decodes them). The rows are raw projections: the text model's embedding norm
    then treats them as it treats token rows."""
    tok = lm.tokenizer
    patch = token_id(tok, IMAGE_PLACEHOLDER)
    if patch not in prompt:  # llama-mtmd-cli puts its media markers at the start of the prompt
        at = 1 if prompt and prompt[0] == tok.bos else 0
        prompt = prompt[:at] + [patch] * len(images) + prompt[at:]
    ids = np.asarray(expand_images(prompt, tok, [len(e) for e in images]))
    rows = lm.embed(ids)
    rows[ids == patch] = np.concatenate(images).astype(rows.dtype)
    return rows


# -------------------------------------------------------------------------------------------------
# The backend and the model

def model_path(args):  # -> the text GGUF that runs
    return args.model or DEFAULT_MODEL


def cache_layout(args):  # -> (KV cache kind, prefill chunk): llama.cpp's under --numerics ggml-cpu
    if args.numerics == "ggml-cpu":  # one cell per position, as llama.cpp's cache holds a single sequence
        return "uniform", min(args.prefill_chunk, UBATCH)
    return args.kv, args.prefill_chunk


def build(args):  # -> factory.Build: what --backend, --numerics, --dtype, --tp and llama.cpp's build flags ask for
    return Build(args.backend, args.numerics, args.dtype, args.tp, args.kv_type, factory.ON_OFF[args.flash_attn],
                 factory.ON_OFF[args.repack], cpu=args.cpu)


# -------------------------------------------------------------------------------------------------
# Prefill and generation

def logit_rows(args, n):  # -> (prompt rows the output head computes, None for all; positions --logits-out keeps)
    """Decoding reads the last row, so it is always computed; a trace, a drafter and plain
    --logits-out see every row."""
    try:
        kept = resolve(args.logits_positions, n) if args.logits_positions is not None else np.arange(n)
    except ValueError as e:
        raise UsageError(f"--logits-positions: {e}") from None
    if args.trace or args.draft_model or (args.logits_out and args.logits_positions is None):
        return None, kept
    return np.union1d(kept if args.logits_out else [], [n - 1]).astype(np.int64), kept


def write_logits(args, logits, rows, kept, n_vocab):  # prefill logits of `rows` (None: all) -> --logits-out
    if args.logits_positions is None and args.logits_topk is None:
        artifacts.save_npy(args.logits_out, logits.astype(np.float32), UsageError)
        return
    at = kept if rows is None else np.searchsorted(rows, kept)
    if args.logits_topk is None:
        golden = sparse_golden(logits[at], kept, n_vocab)
    else:  # block by block: top-k's index and float64 passes take 8 bytes x vocabulary a row
        blocks = [sparse_golden(logits[at[i:i + TOPK_BLOCK]], kept[i:i + TOPK_BLOCK], n_vocab, args.logits_topk)
                  for i in range(0, len(at), TOPK_BLOCK)]
        golden = {key: np.concatenate([b[key] for b in blocks]) if blocks[0][key].ndim else blocks[0][key]
                  for key in blocks[0]}
    artifacts.save_npz(args.logits_out, golden, UsageError)


def prompt_input(args, lm, prompt, timings, tracer):  # -> (token ids or embedding rows [T, E], image embeddings)
    t0 = time.perf_counter()
    images = image_embeddings(args, lm, tracer)
    if not images:
        return prompt, images
    timings["image_encode"] = time.perf_counter() - t0
    if args.embeddings_out:
        artifacts.save_npy(args.embeddings_out, np.concatenate(images).astype(np.float32), UsageError)
    return image_prompt_rows(lm, prompt, images), images


def prefill(args, lm, speculator, cache, inputs, rows, tracer, progress):  # -> logits [len(rows) or T, V]
    _, chunk = cache_layout(args)
    if speculator:  # the drafter is caught up on every prompt row as the target prefills
        return speculator.forward(inputs, tracer)
    if isinstance(inputs, np.ndarray) and inputs.ndim == 2:
        return lm.prefill_embeddings(inputs, cache, chunk, tracer, progress, out_rows=rows)
    return lm.prefill(inputs, cache, chunk, tracer, progress, out_rows=rows)


def decode(args, lm, speculator, cache, next_logits, progress):  # -> (generated ids, speculative steps)
    if not args.n_predict:
        return [], []
    if speculator:
        p_min, governor = (None, CostGovernor(floors=FloorBandit())) if args.spec_p_min == "auto" else \
                          (args.spec_p_min, None)
        return speculator.decode(next_logits, args.n_predict, args.spec_draft_n_max, p_min or 0.0, governor)
    return lm.decode_greedy(next_logits, args.n_predict, cache, cache_layout(args)[1], progress), []


def new_caches(args, lm, drafter, n_rows):  # -> (target cache, Speculator or None)
    layout = cache_layout(args)
    n_ctx = args.ctx or n_rows + args.n_predict
    if not args.ctx:  # a given --ctx was checked before the images
        check_context(lm.cfg, n_ctx, layout, args.dtype)
        args.beyond_train = check_train_context(n_ctx, lm.cfg.n_ctx_train, "a context (prompt + --n-predict) of",
                                                model_path(args), args.beyond_n_ctx_train)
    cache = lm.new_cache(n_ctx, *layout)
    return cache, Speculator(lm, drafter, cache, drafter.new_cache(n_ctx), layout[1]) if drafter else None


def generate(args, lm, drafter, prompt):  # -> result: generated tokens, image token counts, steps, timings
    if args.ctx:  # known before the images are encoded: refused before that work
        check_context(lm.cfg, args.ctx, cache_layout(args), args.dtype)
        args.beyond_train = check_train_context(args.ctx, lm.cfg.n_ctx_train, "--ctx", model_path(args),
                                                args.beyond_n_ctx_train)
    timings, tracer = {}, Tracer(args.trace)
    try:
        return traced_generate(args, lm, drafter, prompt, timings, tracer)
    finally:
        tracer.discard()  # a run that failed before the trace was whole leaves an older trace as it was


def traced_generate(args, lm, drafter, prompt, timings, tracer):  # -> generate's result
    inputs, images = prompt_input(args, lm, prompt, timings, tracer)
    rows, kept = logit_rows(args, len(inputs))
    cache, speculator = new_caches(args, lm, drafter, len(inputs))
    big = os.path.getsize(model_path(args)) > PROGRESS_BYTES  # a bar per layer where a forward takes long
    progress = partial(tqdm, desc="layers", leave=False) if big else None
    t0 = time.perf_counter()
    logits = prefill(args, lm, speculator, cache, inputs, rows, tracer, progress)
    timings["prefill"] = time.perf_counter() - t0
    tracer.close()
    if args.logits_out:
        write_logits(args, logits, rows, kept, lm.cfg.n_vocab)
    t0 = time.perf_counter()
    tokens, steps = decode(args, lm, speculator, cache, logits[-1], progress)
    timings["decode"] = time.perf_counter() - t0
    return {"tokens": tokens, "image_tokens": [len(e) for e in images], "steps": steps if speculator else None,
            "timings": timings}


# -------------------------------------------------------------------------------------------------
# The report

def json_report(args, prompt, result, text):  # -> the --json object
    out = {"model": {"file": os.path.basename(model_path(args)), "path": model_path(args)},
           "prompt_tokens": prompt, "tokens": result["tokens"], "text": text, "timings": result["timings"]}
    if result["image_tokens"]:
        out["image_tokens"] = result["image_tokens"]
    if result["steps"] is not None:
        out["speculative"] = acceptance(result["steps"])
    if args.beyond_train:
        out["beyond_n_ctx_train"] = True
    return out


PROMPT_STYLE, PLAIN_STYLE = "\x1b[2m", "\x1b[0m"  # on a terminal the prompt is dim, the generated text plain
GENERATED_MARK = "\u25b6"  # between the prompt and the generated text, wherever stdout goes


def marked_output(prompt_text, text, terminal):  # -> stdout's text: the prompt, the mark, the generated text
    """The mark shows where the model's own text begins in a log or a pipe too; a terminal also dims
    the prompt. The text without a mark is --json's (what a script compares)."""
    return f"{PROMPT_STYLE}{prompt_text}{PLAIN_STYLE}{GENERATED_MARK}{text}" if terminal \
        else f"{prompt_text}{GENERATED_MARK}{text}"


def print_report(args, tok, prompt, result, text):  # the prompt and its continuation on stdout, figures on stderr
    print(marked_output(detokenize(tok, prompt), text, sys.stdout.isatty()))
    timings, generated = result["timings"], result["tokens"]
    rate = len(generated) / timings["decode"] if generated and timings["decode"] > 0 else 0.0
    print(f"\n[{os.path.basename(model_path(args))} ({model_path(args)}): {len(prompt)} prompt tokens in "
          f"{timings['prefill']:.3f} s, {len(generated)} generated at {rate:.1f} tok/s, load {timings['load']:.3f} s]",
          file=sys.stderr)
    if result["steps"] is not None:
        spec = acceptance(result["steps"])
        print(f"[speculative: {spec['accepted']} of {spec['drafted']} drafts accepted in {len(result['steps'])} "
              "verification steps]", file=sys.stderr)
    if not args.model:
        print(HINT, file=sys.stderr)


def run(args):  # parsed args -> exit status
    compute = build(args)
    check_flags(args, compute)
    for warning in factory.host_warnings(compute):
        print(f"reference.run: warning: {warning}", file=sys.stderr)
    t0 = time.perf_counter()
    backend = factory.backend(compute)  # numba or CuPy missing: refused before any GGUF loads
    model = gguf.load(model_path(args), "text")
    lm = factory.text_model(model, compute, backend)
    drafter = factory.drafter(gguf.load(args.draft_model, "dflash"), lm) if args.draft_model else None
    load_s = time.perf_counter() - t0
    prompt = prompt_tokens(args, model.tokenizer)
    if args.tokenize_only:
        print(json.dumps(prompt))
        return 0
    if not prompt:
        raise UsageError("the prompt has no tokens")
    args.beyond_train = False
    result = generate(args, lm, drafter, prompt)
    result["timings"] = {"load": load_s, **result["timings"]}
    text = detokenize(model.tokenizer, result["tokens"])
    if args.json:
        print(json.dumps(json_report(args, prompt, result, text)))
    else:
        print_report(args, model.tokenizer, prompt, result, text)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    return exit_status("reference.run", lambda: run(args), (gguf.GGUFError, CacheError, TraceError, TPError,
                                                            TokenizerError, ChatError, ImageError, GgmlCpuError,
                                                            FactoryError))


if __name__ == "__main__":
    sys.exit(main())
