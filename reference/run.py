"""`python -m reference.run`: slow, exact runs of the reference. Flags are extended, never renamed.

With no arguments it runs the embedded default model from golden/ on a default prompt and prints a
greedy continuation with timings; `--model` naming that file runs the same prompt. Prompt text,
from -p/--prompt or -f/--file, is read as bytes, as llama.cpp reads it (a CRLF file keeps its \\r).
--logits-out F.npy holds the logits of every prompt position; with --logits-positions or
--logits-topk it is F.positions.npz (reference/positions.py's POSITIONS_FORMAT), and only the kept
positions pass through the output head, so a long prompt's golden costs megabytes.
"""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import date as Date
from functools import partial

import numpy as np
from tqdm import tqdm

from . import artifacts, factory, gguf, kv, video
from .chat import ChatError, chat_prompt, image_prompt_rows, parse_date, prompt_ids, timestamp_text, video_prompt_rows
from .cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, MAX_THREADS, OneLineParser, UsageError, add_numerics_flags,
                  add_sampling_flags, build_of, check_greedy, check_output, check_output_dir, check_token_ids,
                  check_train_context, exit_status, flag, float_in, int_in, parse_token_ids)
from .dflash import Speculator, acceptance
from .factory import DEFAULT_MODEL, Build, FactoryError
from .ggml_cpu import GgmlCpuError
from .governor import CostGovernor, FloorBandit
from .image import ImageError, load_rgb
from .kv import CacheError
from .provenance import numerics_record, numerics_summary, provenance, sidecar
from .positions import SUFFIX, clamped, output_rows, parse_positions, write_logits
from .tokenizer import Tokenizer, TokenizerError, detokenize, llama_text
from .tp import TPError
from .trace import OURS as TRACE_OURS, Tracer, TraceError
from .video import VideoError
from .vision import DEFAULT_MAX_TOKENS, check_compatible, check_video_extension

DEFAULT_PROMPT = "initial value. If it"  # a held-out docstring line (golden/prompts/glimmer-default.jsonl)
HINT = ("[more: -p TEXT | --chat -p TEXT | -md golden/models/glimmer-default-dflash-f16.gguf"
        " | --mmproj golden/models/glimmer-default-mmproj-f16.gguf --image IMG | --logits-out F.npy | --trace DIR"
        " | -m GGUF | --json | --help]")
DEFAULT_N_PREDICT = 16
SHOWN_PROMPT_TOKENS = 64  # a longer prompt is printed as its first and last 32 tokens, unless --verbose-prompt
PROGRESS_BYTES = 1 << 30
# Token counts (-n, -c, -ub) beyond any machine's memory; check_context then
# refuses a context whose KV cache would not fit here, before it is allocated.
MAX_TOKENS = 1 << 40
MAX_DRAFT = 1 << 10  # drafted tokens a step: the drafter clamps it to its block_size - 1 anyway
MAX_TP = 1 << 10  # simulated tensor-parallel ranks; check_tp then asks that they divide n_head_kv
MAX_TOP_K = 1 << 31  # top-k is clamped to the vocabulary


def p_min_type(text):  # argparse type: --spec-draft-p-min -> a float in [0, 1] or "auto"
    if text == "auto":
        return text
    try:
        return float_in(0.0, 1.0)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; or 'auto'") from None


def build_parser():  # -> the parser; every number is range-checked as it is parsed, before any load
    p = OneLineParser(prog="python -m reference.run", description=__doc__)
    flag(p, "model", help="text GGUF (default: the embedded tiny model in golden/models)")
    add_prompt_flags(p)
    add_output_flags(p)
    add_compute_flags(p)
    add_draft_flags(p)
    add_image_flags(p)
    add_video_flags(p)
    return p


def add_prompt_flags(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--token-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    flag(src, "prompt", help="prompt text, tokenized with the GGUF's tokenizer")
    flag(src, "file", help="file holding the prompt text (its bytes as they are, as llama.cpp reads them)")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user message with the GGUF's chat template")
    flag(p, "system_prompt", help="system message for --chat (default: the template's own system block)")
    p.add_argument("--date", help="YYYY-MM-DD the chat template sees as today (default: today): reproducible prompts")
    p.add_argument("--no-special", action="store_true", help="tokenize special-token text in the prompt as plain text")
    p.add_argument("--tokenize-only", action="store_true", help="print the JSON list of prompt token ids and exit")
    flag(p, "verbose_prompt", action="store_true",
         help=f"print the whole prompt (a prompt of more than {SHOWN_PROMPT_TOKENS} tokens is shown cut otherwise)")


def add_output_flags(p):
    flag(p, "n_predict", type=int_in(0, MAX_TOKENS), default=DEFAULT_N_PREDICT, help="greedy tokens to generate")
    add_sampling_flags(p)
    p.add_argument("--logits-out", help="write the float32 logits of one prefill: [n_prompt_tokens, n_vocab] "
                                        f"to a .npy path, or the kept positions to a {SUFFIX} path")
    p.add_argument("--logits-positions", type=parse_positions, metavar="SPEC",
                   help="keep these prompt positions' logits: last, 0,5,100:120, or --logits-positions=-256: "
                        f"(Python slices, negative from the end; '=' before a leading '-'); "
                        f"--logits-out names a {SUFFIX} file")
    p.add_argument("--logits-topk", type=int_in(1, MAX_TOP_K), metavar="K",
                   help="keep the K largest logits of each kept position and its logsumexp, not the whole row")
    p.add_argument("--trace", help="write one .npy per named trace point and index.json into this directory")
    flag(p, "json", action="store_true", help="print one JSON object on stdout instead of text")


def add_compute_flags(p):
    add_numerics_flags(p, factory.BACKENDS, "off, as llama-cpp-python's default context")
    p.add_argument("--kv", choices=("ring", "uniform"), default="ring",
                   help="ring: sliding-window layers keep their window only; uniform: every layer every position")
    flag(p, "ubatch_size", type=int_in(1, MAX_TOKENS), default=2048,
         help="prompt rows per forward (ggml-cpu: at most 512, llama-cpp-python's ubatch)")
    flag(p, "batch_size", type=int_in(1, MAX_TOKENS),
         help="llama.cpp's logical batch: a forward takes at most this many rows too (default: -ub)")
    flag(p, "ctx_size", type=int_in(0, MAX_TOKENS), default=0, help="context size (0: prompt + --n-predict)")
    flag(p, "threads", type=int_in(1, MAX_THREADS),
         help="with --numerics ggml-cpu: llama.cpp's thread count, which splits a flash-attention decode over the "
              "KV cells (default 2, the modelled build's)")
    p.add_argument(BEYOND_TRAIN, action="store_true", help=BEYOND_TRAIN_HELP + " (--json: beyond_n_ctx_train)")
    p.add_argument("--tp", type=int_in(1, MAX_TP), default=1,
                   help="simulate N-way tensor parallelism (N divides n_head_kv)")


def add_draft_flags(p):
    flag(p, "model_draft", help="DFlash drafter GGUF: speculative greedy decoding (the same tokens)")
    flag(p, "spec_draft_n_max", type=int_in(0, MAX_DRAFT), default=3,
         help="draft tokens per step: a block of n + 1 rows, at most the drafter's block_size - 1 (a warning says "
              "when it is lowered)")
    flag(p, "spec_draft_p_min", type=p_min_type, default=0.0,
         help="confidence floor in [0, 1], or 'auto': an adaptive floor and a cost governor")


def add_image_flags(p):
    add_tower_flags(p)
    p.add_argument("--image", action="append", default=[],
                   help="image file (repeatable); each <|patch|> in the prompt takes the next image, "
                        "with none they go right after BOS")
    p.add_argument("--embeddings-out",
                   help="write float32 [n_image_tokens, n_embd]: the raw image projections (a .npy path)")


def frame_rate(text):  # argparse type: a positive, finite frame rate
    x = float_in(0.0, math.inf)(text)
    if not (0 < x < math.inf):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite frame rate")
    return x


def add_video_flags(p):
    p.add_argument("--video", action="append", default=[],
                   help="video (repeatable): a directory of frame images, a .npy uint8 [T, H, W, 3] array, or a "
                        "video file (PyAV, the [video] extra); each <|video|> in the prompt takes the next, with none "
                        "they go right after BOS. Needs an mmproj with the video extension (tools.video_mmproj)")
    p.add_argument("--video-fps", type=frame_rate,
                   help="the source's frame rate (transformers' VideoMetadata.fps; default: a file's own, else "
                        "unknown and sampled as 24)")
    p.add_argument("--video-max-frames", type=int_in(1, video.MAX_FRAMES_READ),
                   help="frames kept at most (default: the mmproj's clip.vision.video.max_frames, else 96)")
    p.add_argument("--video-max-frame-tokens", type=int_in(1, MAX_TOKENS),
                   help="merged tokens per frame pair at most (default: clip.vision.video.max_frame_tokens, else 144)")


def add_tower_flags(p):  # the vision tower's (reference.serve's too)
    p.add_argument("--mmproj", help="vision projector GGUF (clip, projector muse-glimmer) for the prompt's images")
    p.add_argument("--image-max-tokens", type=int_in(1, MAX_TOKENS), default=DEFAULT_MAX_TOKENS,
                   help="merged-token cap per image (llama.cpp's --image-max-tokens)")


# -------------------------------------------------------------------------------------------------
# What the flags say together, and the files they name: all checked before any GGUF loads

@dataclass(frozen=True)
class Request:
    """The command line's inputs once read and checked, before any GGUF loads."""
    build: Build
    layout: tuple           # (KV cache kind, prefill chunk): factory.cache_layout
    text: str | None        # --prompt / --prompt-file, as llama.cpp's tokenizer reads their bytes
    token_ids: list | None  # --token-ids; their range is checked once the vocabulary is known
    date: Date | None       # --date (None: today)
    images: list            # uint8 [H, W, 3] per --image
    videos: list            # (video.Prepared, timestamp texts) per --video


def check_flags(args, build):  # args, their factory.Build -> None; UsageError (FactoryError) for contradictions
    check_greedy(args)
    check_prompt_flags(args)
    factory.check(build)
    check_output_flags(args)
    media = "--image" if args.image else "--video" if args.video else None
    if media and args.model_draft:
        raise UsageError(f"--model-draft with {media} is not supported")
    if not media and (args.mmproj or args.embeddings_out):
        raise UsageError("--mmproj and --embeddings-out need --image or --video")
    if media and not args.mmproj:
        raise UsageError(f"{media} needs --mmproj")
    if media:
        factory.check_tower(build)
    check_video_flags(args, build)


def check_video_flags(args, build):
    given = [f for f, v in (("--video-fps", args.video_fps), ("--video-max-frames", args.video_max_frames),
                            ("--video-max-frame-tokens", args.video_max_frame_tokens)) if v is not None]
    if given and not args.video:
        raise UsageError(f"{given[0]} needs --video")
    if args.video and args.image:
        raise UsageError("--video with --image is not supported: one kind of media a prompt")
    if args.video and build.numerics != "exact":
        raise UsageError("--video runs with --numerics exact only: llama.cpp has no video graph to emulate")


def check_prompt_flags(args):
    text = args.prompt is not None or args.file is not None
    if (args.system_prompt is not None or args.date is not None) and not args.chat:
        raise UsageError("-sys/--system-prompt and --date only apply with --chat")
    if args.chat and not text:
        raise UsageError("--chat needs -p/--prompt or -f/--file")
    if args.chat and args.no_special:
        raise UsageError("--chat parses the template's special tokens: it takes no --no-special")
    if args.no_special and not text:
        raise UsageError("--no-special only applies to -p/--prompt or -f/--file")


def check_output_flags(args):
    """np.save appends .npy to a name without it, so such a file would not be where it was asked
    for: the name must end in its suffix. Refused before the run rather than after it."""
    if sparse_logits(args) and not args.logits_out:
        raise UsageError(f"--logits-positions and --logits-topk need --logits-out F{SUFFIX}")
    if args.logits_out is not None:
        check_output(args.logits_out, "--logits-out", SUFFIX if sparse_logits(args) else ".npy")
    if args.embeddings_out is not None:
        check_output(args.embeddings_out, "--embeddings-out", ".npy")
    if args.trace is not None:
        check_output_dir(args.trace, "--trace", TRACE_OURS)
    inputs = [("--model", model_path(args)), ("--model-draft", args.model_draft), ("--mmproj", args.mmproj),
              ("--file", args.file)] + [("--image", image) for image in args.image] + [("--video", v) for v in args.video]
    artifacts.refuse_overwrite([("--logits-out", args.logits_out), ("--embeddings-out", args.embeddings_out),
                                ("--trace", args.trace)], inputs, UsageError)


def read_request(args, build):  # -> Request: every input file read (a GGUF: its header), every value parsed
    for path in (model_path(args), args.model_draft, args.mmproj):
        if path is not None:
            gguf.check_file(path)
    return Request(build, factory.cache_layout(build, args.kv, prefill_chunk(args)), prompt_text(args),
                   parse_token_ids(args.token_ids) if args.token_ids is not None else None,
                   parse_date(args.date) if args.date is not None else None,
                   [load_rgb(path) for path in args.image], read_videos(args))


def read_videos(args):  # -> [(video.Prepared, timestamp texts)] per --video, sampled and resized before any model loads
    if not args.video:
        return []
    mmproj = gguf.load(args.mmproj, "mmproj")  # its metadata: the tensors stay in the memory map
    check_video_extension(args.mmproj, mmproj.config, mmproj.tensors)
    return [read_video(path, args.video_fps, mmproj.config, args.video_max_frames, args.video_max_frame_tokens)
            for path in args.video]


def read_video(path, source_fps, cfg, max_frames=None, cap=None):  # mmproj config -> (video.Prepared, timestamp texts)
    """One video sampled, resized and paired as transformers does, under the mmproj's video defaults
    unless max_frames or cap (merged tokens a pair) say otherwise; VideoError or ChatError in one line."""
    fps = cfg.video["fps"]
    max_frames = max_frames or cfg.video["max_frames"]
    cap = cap or cfg.video["max_frame_tokens"]
    source = video.load(path, source_fps, lambda total, rate: video.sample_indices(total, rate, fps, max_frames))
    rows, cols = video.smart_resize(source.frames.shape[1], source.frames.shape[2], cfg.patch_size * cfg.merge_size,
                                    cap)
    if rows * cols > cap:  # smart_resize rounds when no grid fits under the cap
        raise VideoError(path, f"frames of {source.frames.shape[2]}x{source.frames.shape[1]} take {rows}x{cols} = "
                               f"{rows * cols} tokens a pair, over the cap of {cap} (--video-max-frame-tokens)")
    prepared = video.prepare(source, fps, max_frames, cap, cfg.patch_size * cfg.merge_size)
    return prepared, [timestamp_text(cfg.video["timestamp_format"], t) for t in prepared.timestamps]


def prompt_text(args):  # -> the text of --prompt or --prompt-file, from their bytes, or None
    if args.file is not None:
        # bytes: text mode would turn CRLF into LF
        return llama_text(artifacts.read_bytes(args.file, UsageError, what="prompt file"), args.file)
    if args.prompt is not None:  # argv's bytes, as the shell passed them (undecodable ones survive as escapes)
        return llama_text(os.fsencode(args.prompt), "--prompt")
    return None


def model_path(args):  # -> the text GGUF that runs
    return args.model or DEFAULT_MODEL


def prefill_chunk(args):  # -> prompt rows per forward: llama.cpp's n_ubatch = min(n_batch, n_ubatch)
    return min(args.ubatch_size, args.batch_size or args.ubatch_size)


def sparse_logits(args):  # -> whether --logits-out is a POSITIONS_FORMAT file rather than every row's logits
    return args.logits_positions is not None or args.logits_topk is not None


# -------------------------------------------------------------------------------------------------
# The prompt

def default_prompt(tok, embedded):  # -> prompt ids
    """DEFAULT_PROMPT for the embedded model; for another model the BOS token and a few ordinary
    tokens, so that any vocabulary works without a tokenizer."""
    if embedded:
        return Tokenizer(tok).tokenize(DEFAULT_PROMPT, add_special=True)
    first = [tok.bos] if tok.bos >= 0 else []
    return first + [i for i, t in enumerate(tok.token_types) if t == 1][:8]


def is_embedded(path):  # -> whether `path` is the embedded default model
    return os.path.exists(path) and os.path.samefile(path, DEFAULT_MODEL)


def prompt_tokens(args, request, tok, n_ctx_train):  # -> ids from --token-ids, --prompt/--prompt-file (plain or --chat), or the default
    if request.text is None:
        if request.token_ids is not None:
            return check_token_ids(request.token_ids, tok.n_vocab)
        return default_prompt(tok, is_embedded(model_path(args)))
    tokenizer = Tokenizer(tok)
    # refused by its bytes before the pre-tokenizer: past the training context (or memory) it cannot run
    tokenizer.check_length(request.text, None if args.beyond_n_ctx_train else n_ctx_train or None)
    if not args.chat:
        return tokenizer.tokenize(request.text, add_special=True, parse_special=not args.no_special)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    # before the text, where llama-mtmd-cli puts its markers
    images = [{"type": "image"}] * len(args.image) + [{"type": "video"}] * len(args.video)
    user = {"role": "user", "content": images + [{"type": "text", "text": request.text}] if images else request.text}
    return prompt_ids(tokenizer, chat_prompt(tok, system + [user], date=request.date))


# -------------------------------------------------------------------------------------------------
# Images

def image_embeddings(args, request, lm, tracer):  # -> [[n_i, n_embd] per --image]
    if not request.images:
        return []
    vision = factory.vision_model(gguf.load(args.mmproj, "mmproj"), request.build, lm.backend)
    check_compatible(vision, lm.cfg, model_path(args))
    # one trace directory per image: the tower's point names (attn_out-0, ...) are also text ones
    traces = [Tracer(f"image-{i}" if args.trace else None, parent=tracer) for i in range(len(request.images))]
    big = os.path.getsize(args.mmproj) > PROGRESS_BYTES
    progress = partial(tqdm, desc="tower layers", leave=False) if big else None
    out = [vision.encode(rgb, args.image_max_tokens, trace, progress) for rgb, trace in zip(request.images, traces)]
    for trace in traces:
        trace.close()
    return out


# -------------------------------------------------------------------------------------------------
# Prefill and generation

def check_context(args, request, cfg, n_ctx, what):  # -> whether n_ctx runs past the training context
    """A context whose KV cache could never be allocated here is refused before it is; one past the
    training context unless --beyond-n-ctx-train asks for it."""
    kv.check_fits(cfg, n_ctx, *request.layout, args.dtype,
                  f"a context of {n_ctx} tokens (--ctx-size, or the prompt + --n-predict)")
    return check_train_context(n_ctx, cfg.n_ctx_train, what, model_path(args), args.beyond_n_ctx_train)


def video_embeddings(args, request, lm, tracer):  # -> [[n_v, n_embd] per --video]
    vision = factory.vision_model(gguf.load(args.mmproj, "mmproj"), request.build, lm.backend)
    check_compatible(vision, lm.cfg, model_path(args))
    big = os.path.getsize(args.mmproj) > PROGRESS_BYTES
    progress = partial(tqdm, desc="tower layers", leave=False) if big else None
    # one trace directory per frame pair, video-<v>-pair-<g>: each pair runs the tower on its own
    return [vision.encode_video(prepared, lambda g, v=v: Tracer(f"video-{v}-pair-{g}" if args.trace else None,
                                                                 parent=tracer), progress)
            for v, (prepared, _) in enumerate(request.videos)]


def video_input(args, request, lm, prompt, timings, tracer):  # -> (embedding rows [T, E], video embeddings)
    t0 = time.perf_counter()
    videos = video_embeddings(args, request, lm, tracer)
    timings["video_encode"] = time.perf_counter() - t0
    if args.embeddings_out:
        artifacts.save_npy(args.embeddings_out, np.concatenate(videos).astype(np.float32), UsageError)
    per_pair = [prepared.grid[0] * prepared.grid[1] for prepared, _ in request.videos]
    rows = video_prompt_rows(Tokenizer(lm.tokenizer), lm.embed, prompt,
                             [(stamps, n, e) for (_, stamps), n, e in zip(request.videos, per_pair, videos)])
    return rows, videos


def prompt_input(args, request, lm, prompt, timings, tracer):  # -> (token ids or embedding rows [T, E], image embeddings)
    if request.videos:
        return video_input(args, request, lm, prompt, timings, tracer)
    t0 = time.perf_counter()
    images = image_embeddings(args, request, lm, tracer)
    if not images:
        return prompt, images
    timings["image_encode"] = time.perf_counter() - t0
    if args.embeddings_out:
        artifacts.save_npy(args.embeddings_out, np.concatenate(images).astype(np.float32), UsageError)
    return image_prompt_rows(lm.tokenizer, lm.embed, prompt, images), images


def prefill(lm, speculator, cache, chunk, inputs, rows, tracer, progress):  # -> logits [len(rows) or T, V]
    if speculator:  # the drafter is caught up on every prompt row as the target prefills
        return speculator.forward(inputs, tracer)
    if isinstance(inputs, np.ndarray) and inputs.ndim == 2:
        return lm.prefill_embeddings(inputs, cache, chunk, tracer, progress, out_rows=rows)
    return lm.prefill(inputs, cache, chunk, tracer, progress, out_rows=rows)


def decode(args, lm, speculator, cache, chunk, next_logits, progress):  # -> (generated ids, speculative steps)
    if not args.n_predict:
        return [], []
    if speculator:
        return speculator.decode(next_logits, args.n_predict, args.spec_draft_n_max, *draft_floor(args.spec_draft_p_min))
    return lm.decode_greedy(next_logits, args.n_predict, cache, chunk, progress), []


def logit_rows(args, n):  # -> positions.output_rows of a prompt of n rows under the flags
    try:
        rows = output_rows(args.logits_positions, n, bool(args.logits_out), bool(args.trace or args.model_draft))
    except ValueError as e:  # refused in one line: no warning about the cut before it
        raise UsageError(f"--logits-positions: {e}") from None
    cut = clamped(args.logits_positions or [], n)
    if cut:
        warn(f"--logits-positions on a prompt of {n} tokens: {', '.join(cut)}")
    return rows


def new_caches(args, request, lm, drafter, n_rows):  # -> (target cache, Speculator or None, past the training context)
    n_ctx = args.ctx_size or n_rows + args.n_predict
    # a given -c was checked before the images
    beyond = not args.ctx_size and check_context(args, request, lm.cfg, n_ctx, "a context (prompt + --n-predict) of")
    cache = lm.new_cache(n_ctx, *request.layout)
    speculator = Speculator(lm, drafter, cache, drafter.new_cache(n_ctx), request.layout[1]) if drafter else None
    return cache, speculator, beyond


def generate(args, request, lm, drafter, prompt):  # -> result: tokens, image token counts, steps, timings, beyond_train
    # a given -c is known before the images are encoded: refused before that work
    beyond = bool(args.ctx_size) and check_context(args, request, lm.cfg, args.ctx_size, "--ctx-size")
    timings, tracer = {}, Tracer(args.trace)
    tracer.provenance = run_provenance(args, request, lm) if args.trace else None
    try:
        result = traced_generate(args, request, lm, drafter, prompt, timings, tracer)
        return {**result, "beyond_train": beyond or result["beyond_train"]}
    finally:
        tracer.discard()  # a run that failed before the trace was whole leaves an older trace as it was


def traced_generate(args, request, lm, drafter, prompt, timings, tracer):  # -> generate's result
    inputs, images = prompt_input(args, request, lm, prompt, timings, tracer)
    rows, kept = logit_rows(args, len(inputs))
    cache, speculator, beyond = new_caches(args, request, lm, drafter, len(inputs))
    big = os.path.getsize(model_path(args)) > PROGRESS_BYTES  # a bar per layer where a forward takes long
    progress = partial(tqdm, desc="layers", leave=False) if big else None
    t0 = time.perf_counter()
    logits = prefill(lm, speculator, cache, request.layout[1], inputs, rows, tracer, progress)
    timings["prefill"] = time.perf_counter() - t0
    tracer.close()
    if args.logits_out:
        write_logits(args.logits_out, logits, rows, kept, lm.cfg.n_vocab, sparse_logits(args), args.logits_topk,
                     UsageError)
        artifacts.write_json(sidecar(args.logits_out), run_provenance(args, request, lm), UsageError)
    t0 = time.perf_counter()
    tokens, steps = decode(args, lm, speculator, cache, request.layout[1], logits[-1], progress)
    timings["decode"] = time.perf_counter() - t0
    media = "video_tokens" if request.videos else "image_tokens"  # rows per video or per image
    return {"tokens": tokens, media: [len(e) for e in images], "steps": steps if speculator else None,
            "timings": timings, "beyond_train": beyond}


# -------------------------------------------------------------------------------------------------
# The report

def run_provenance(args, request, lm):  # -> reference.provenance's record of this run
    return provenance(model_path(args), request.build, lm.backend, request.layout[1], kv=request.layout[0],
                      seed=args.seed)


def json_report(args, request, lm, prompt, result, text):  # -> the --json object
    out = {"model": {"file": os.path.basename(model_path(args)), "path": model_path(args)},
           "provenance": run_provenance(args, request, lm), "prompt_tokens": prompt, "tokens": result["tokens"], "text": text, "timings": result["timings"]}
    for key in ("image_tokens", "video_tokens"):
        if result.get(key):
            out[key] = result[key]
    if result["steps"] is not None:
        out["speculative"] = acceptance(result["steps"])
    if result["beyond_train"]:
        out["beyond_n_ctx_train"] = True
    return out


PROMPT_STYLE, PLAIN_STYLE = "\x1b[2m", "\x1b[0m"  # on a terminal the prompt is dim, the generated text plain
GENERATED_MARK = "\u25b6"  # between the prompt and the generated text, wherever stdout goes


def marked_output(prompt_text, text, terminal):  # -> stdout's text: the prompt, the mark, the generated text
    """The mark shows where the model's own text begins in a log or a pipe too; a terminal also dims
    the prompt. The text without a mark is --json's (what a script compares)."""
    return f"{PROMPT_STYLE}{prompt_text}{PLAIN_STYLE}{GENERATED_MARK}{text}" if terminal \
        else f"{prompt_text}{GENERATED_MARK}{text}"


def shown_prompt(args, tok, prompt):  # -> the prompt's text as printed: whole, or its ends and a count
    if args.verbose_prompt or len(prompt) <= SHOWN_PROMPT_TOKENS:
        return detokenize(tok, prompt)
    half = SHOWN_PROMPT_TOKENS // 2
    return (f"{detokenize(tok, prompt[:half])} [... {len(prompt) - 2 * half} of {len(prompt)} prompt tokens not "
            f"shown: --verbose-prompt ...] {detokenize(tok, prompt[-half:])}")


def print_report(args, request, lm, tok, prompt, result, text):  # the prompt and its continuation on stdout, figures on stderr
    print(marked_output(shown_prompt(args, tok, prompt), text, sys.stdout.isatty()))
    timings, generated = result["timings"], result["tokens"]
    rate = len(generated) / timings["decode"] if generated and timings["decode"] > 0 else 0.0
    numerics = numerics_summary(numerics_record(request.build, lm.backend))
    print(f"\n[{os.path.basename(model_path(args))} ({model_path(args)}): {len(prompt)} prompt tokens in "
          f"{timings['prefill']:.3f} s, {len(generated)} generated at {rate:.1f} tok/s, load {timings['load']:.3f} s; "
          f"{numerics}, prefill chunk {request.layout[1]}]", file=sys.stderr)
    if result["steps"] is not None:
        spec = acceptance(result["steps"])
        print(f"[speculative: {spec['accepted']} of {spec['drafted']} drafts accepted in {len(result['steps'])} "
              "verification steps]", file=sys.stderr)
    if not args.model:
        print(HINT, file=sys.stderr)


def report(args, request, lm, tok, prompt, result):  # -> None: --json's object on stdout, or print_report's text and figures
    text = detokenize(tok, result["tokens"])
    if args.json:
        print(json.dumps(json_report(args, request, lm, prompt, result, text)))
    else:
        print_report(args, request, lm, tok, prompt, result, text)


def load_models(args, build):  # -> (the text GGUFModel, its TextModel, the Drafter or None)
    backend = factory.backend(build)  # numba or CuPy missing: refused before any GGUF loads
    model = gguf.load(model_path(args), "text")
    lm = factory.text_model(model, build, backend)
    return model, lm, load_drafter(args, lm, warn)


def load_drafter(args, lm, warn):  # -> the Drafter of -md/--model-draft for lm, or None; warn(line) for a lowered n_max
    if not args.model_draft:
        return None
    drafter = factory.drafter(gguf.load(args.model_draft, "dflash"), lm)
    if drafter.clamp_n_max(args.spec_draft_n_max) != args.spec_draft_n_max:
        warn(f"--spec-draft-n-max {args.spec_draft_n_max} runs as {drafter.clamp_n_max(args.spec_draft_n_max)}, "
             f"the drafter's block_size {drafter.cfg.block_size} - 1")
    return drafter


def draft_floor(p_min):  # --spec-draft-p-min -> (floor, CostGovernor or None): "auto" is a governor's adaptive floor
    return (0.0, CostGovernor(floors=FloorBandit())) if p_min == "auto" else (p_min, None)


def warn(message):  # one line on stderr
    print(f"reference.run: warning: {message}", file=sys.stderr)


def run(args):  # parsed args -> exit status
    build = build_of(args)  # what --backend, --numerics, --dtype, --tp and llama.cpp's build flags ask for
    check_flags(args, build)
    request = read_request(args, build)
    for warning in factory.host_warnings(build):
        warn(warning)
    for note in factory.notes(build):
        print(f"reference.run: {note}", file=sys.stderr)
    t0 = time.perf_counter()
    model, lm, drafter = load_models(args, build)
    load_s = time.perf_counter() - t0
    prompt = prompt_tokens(args, request, model.tokenizer, model.config.n_ctx_train)
    if args.tokenize_only:
        print(json.dumps(prompt))
        return 0
    if not prompt:
        raise UsageError("the prompt has no tokens")
    result = generate(args, request, lm, drafter, prompt)
    result["timings"] = {"load": load_s, **result["timings"]}
    report(args, request, lm, model.tokenizer, prompt, result)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    return exit_status("reference.run", lambda: run(args), (gguf.GGUFError, CacheError, TraceError, TPError,
                                                            TokenizerError, ChatError, ImageError, VideoError,
                                                            GgmlCpuError, FactoryError))


if __name__ == "__main__":
    sys.exit(main())
