"""`python -m reference.run`: slow, exact runs of the reference (the command-line contract of
ARCHITECTURE.md; flags are extended, never renamed).

With no arguments it runs the embedded default model from golden/ on a default prompt and prints
a greedy continuation with timings.
"""
import json
import os
import resource
import sys
import time

import numpy as np

from . import gguf
from .chat import IMAGE_PLACEHOLDER, ChatError, chat_prompt, expand_images, prompt_ids, token_id
from .cli import OneLineParser, UsageError, check_output, exit_status, parse_token_ids
from .dflash import Drafter, Speculator, acceptance
from .ggml_cpu import KV_TYPES, UBATCH, GgmlCpuBackend, GgmlCpuError, host_differences
from .governor import CostGovernor, FloorBandit
from .image import ImageError, load_rgb
from .kv import CacheError, layer_rows
from .text import TextModel
from .tokenizer import Tokenizer, TokenizerError, detokenize
from .tp import TensorParallelBackend, TPError, check_tp
from .trace import Tracer, TraceError
from .vision import DEFAULT_MAX_TOKENS, VisionModel, check_compatible

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
DEFAULT_MODEL = os.path.join(GOLDEN, "models", "glimmer-default-f16.gguf")  # trained: tools/train_tiny.py
DEFAULT_PROMPT = "initial value. If it"  # a held-out docstring line (golden/prompts/glimmer-default.jsonl)
HINT = ("[more: --prompt TEXT | --chat --prompt TEXT | --draft-model golden/models/glimmer-default-dflash-f16.gguf"
        " | --mmproj golden/models/glimmer-default-mmproj-f16.gguf --image IMG | --logits-out F.npy | --trace DIR"
        " | --model GGUF | --json | --help]")
DEFAULT_N_PREDICT = 16
PROGRESS_BYTES = 1 << 30


def build_parser():
    p = OneLineParser(prog="python -m reference.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="text GGUF (default: the embedded tiny model in golden/models)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--token-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text, tokenized with the GGUF's tokenizer")
    src.add_argument("--prompt-file", help="file holding the prompt text (UTF-8)")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user message with the GGUF's chat template")
    p.add_argument("--system", help="system message for --chat (default: the template's own system block)")
    p.add_argument("--date", help="YYYY-MM-DD the chat template sees as today (default: today): reproducible prompts")
    p.add_argument("--no-special", action="store_true", help="tokenize special-token text in the prompt as plain text")
    p.add_argument("--tokenize-only", action="store_true", help="print the JSON list of prompt token ids and exit")
    p.add_argument("--n-predict", type=int, default=DEFAULT_N_PREDICT, help="greedy tokens to generate")
    p.add_argument("--logits-out", help="write float32 [n_prompt_tokens, n_vocab] logits of one prefill (a .npy path)")
    p.add_argument("--trace", help="write one .npy per named trace point and index.json into this directory")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--kv", choices=("ring", "uniform"), default="ring")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=0, help="context size (default: prompt + n-predict)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--draft-model", help="DFlash drafter GGUF: speculative greedy decoding (same tokens)")
    p.add_argument("--spec-draft-n-max", type=int, default=3,
                   help="draft tokens per step: a block of n + 1 rows, clamped to the drafter's block_size - 1")
    p.add_argument("--spec-p-min", default="0.0",
                   help="confidence floor in [0, 1], or 'auto': adaptive floor and a cost governor")
    p.add_argument("--tp", type=int, default=1, help="simulate N-way tensor parallelism (N divides n_head_kv)")
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
    p.add_argument("--mmproj", help="vision projector GGUF (clip, projector muse-glimmer) for --image")
    p.add_argument("--image", action="append", default=[],
                   help="image file (repeatable); each <|patch|> in the prompt takes the next image, "
                        "with none they go right after BOS")
    p.add_argument("--image-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="merged-token cap per image (llama.cpp's --image-max-tokens)")
    p.add_argument("--embeddings-out",
                   help="write float32 [n_image_tokens, n_embd]: the raw image projections (a .npy path)")
    return p


def default_prompt(tok, embedded):  # -> prompt ids
    """DEFAULT_PROMPT for the embedded model; for another model the BOS token and a few ordinary
    tokens, so that any vocabulary works without a tokenizer."""
    if embedded:
        return Tokenizer(tok).tokenize(DEFAULT_PROMPT, add_special=True)
    first = [tok.bos] if tok.bos >= 0 else []
    return first + [i for i, t in enumerate(tok.token_types) if t == 1][:8]


def spec_governor(p_min):  # --spec-p-min text -> (fixed floor or None, CostGovernor or None)
    if p_min == "auto":
        return None, CostGovernor(floors=FloorBandit())
    try:
        value = float(p_min)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"--spec-p-min must be a number in [0, 1] or 'auto', got {p_min!r}")
    return value, None


def read_prompt_file(path):  # -> its text
    with open(path, encoding="utf-8") as f:
        try:
            return f.read()
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None


def prompt_tokens(args, tok):  # -> ids from --token-ids, --prompt/--prompt-file (plain or --chat), or the default
    text = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
    if (args.system is not None or args.date is not None) and not args.chat:
        raise UsageError("--system and --date only apply with --chat")
    if args.chat and (text is None or args.no_special):
        raise UsageError("--chat needs --prompt or --prompt-file, and parses the template's special tokens "
                         "(no --no-special)")
    if args.no_special and text is None:
        raise UsageError("--no-special only applies to --prompt or --prompt-file")
    if text is None:
        if args.token_ids is not None:
            return parse_token_ids(args.token_ids, tok.n_vocab)
        return default_prompt(tok, not args.model)
    tokenizer = Tokenizer(tok)
    if not args.chat:
        return tokenizer.tokenize(text, add_special=True, parse_special=not args.no_special)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    images = [{"type": "image"}] * len(args.image or [])  # before the text, where llama-mtmd-cli puts its markers
    user = {"role": "user", "content": images + [{"type": "text", "text": text}] if images else text}
    return prompt_ids(tokenizer, chat_prompt(tok, system + [user], date=args.date))


def check_output_paths(args):  # --logits-out and --embeddings-out, refused before the run rather than after it
    """np.save appends .npy to a name without it, so such a file would not be where it was asked
    for: the name must end in .npy."""
    for flag, path in (("--logits-out", args.logits_out), ("--embeddings-out", args.embeddings_out)):
        if path is not None:
            check_output(path, flag, ".npy")


def kv_cache_bytes(cfg, n_ctx, kind, chunk, dtype):  # -> bytes the KV cache of TextModel.new_cache takes
    rows = sum(layer_rows(cfg.swa_layers, cfg.n_swa, n_ctx, kind, chunk))
    return rows * (2 * cfg.n_head_kv * cfg.head_dim * np.dtype(dtype).itemsize + 8)  # K and V rows, a position


def memory_bytes():  # -> what this process may allocate: the machine's memory, or less under `ulimit -v`
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return physical if limit == resource.RLIM_INFINITY else min(physical, limit)


def check_context(cfg, args, n_ctx):  # refuse a context whose KV cache could never be allocated here
    need, have = kv_cache_bytes(cfg, n_ctx, args.kv, args.prefill_chunk, args.dtype), memory_bytes()
    if need > have:
        raise UsageError(f"a context of {n_ctx} tokens (--ctx, or the prompt + --n-predict) needs a "
                         f"{need / 2**30:.3g} GiB KV cache, more than the {have / 2**30:.3g} GiB of memory here")


def image_embeddings(args, lm):  # -> [[n_i, n_embd] per --image]
    if not args.image:
        if args.mmproj or args.embeddings_out:
            raise UsageError("--mmproj and --embeddings-out need --image")
        return []
    if not args.mmproj:
        raise UsageError("--image needs --mmproj")
    if args.image_max_tokens < 1:
        raise UsageError(f"--image-max-tokens must be at least 1, got {args.image_max_tokens}")
    vision = VisionModel(gguf.load(args.mmproj, "mmproj"), dtype=lm.dtype, numerics=args.numerics)
    check_compatible(vision, lm.cfg, args.model or DEFAULT_MODEL)
    # one trace directory per image: the tower's point names (attn_out-0, ...) are also text ones
    traces = [Tracer(os.path.join(args.trace, f"image-{i}") if args.trace else None) for i in range(len(args.image))]
    progress = os.path.getsize(args.mmproj) > PROGRESS_BYTES
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


def ggml_cpu_backend(args):  # --numerics ggml-cpu -> GgmlCpuBackend; args get llama.cpp's cache and ubatch
    if args.dtype != "float32" or args.backend not in ("numpy", "numba") or args.tp != 1:
        raise UsageError("--numerics ggml-cpu computes in float32 on the numpy or numba backend, without --tp")
    args.kv = "uniform"  # one cell per position, as llama.cpp's cache holds a single sequence
    args.prefill_chunk = min(args.prefill_chunk, UBATCH)
    for difference in host_differences():
        print(f"reference.run: warning: ggml-cpu models llama.cpp's x86-64 AVX512 build; here {difference}",
              file=sys.stderr)
    kv_type = args.kv_type or "f16"
    # a quantized V cache needs flash attention: llama.cpp's "auto" turns it on, "off" refuses the context
    flash_attn = args.flash_attn == "on" if args.flash_attn else kv_type == "q8_0"
    if args.backend == "numba":
        from accel.numba.ggml import GgmlCpuNumbaBackend
        return GgmlCpuNumbaBackend(kv_type, flash_attn, check_host=False)
    return GgmlCpuBackend(kv_type, flash_attn, check_host=False)


def accel_backend(args):  # --backend other than numpy -> backend from accel/ (imported only then)
    from accel import BackendError, make_backend
    if args.tp != 1:
        raise UsageError("--tp simulates tensor parallelism on the numpy backend only")
    try:
        return make_backend(args.backend, np.dtype(args.dtype))
    except BackendError as e:
        raise UsageError(str(e)) from None


def run(args):  # parsed args -> exit status
    check_output_paths(args)
    timings = {}
    t0 = time.perf_counter()
    model = gguf.load(args.model or DEFAULT_MODEL, "text")
    backend = None
    if args.backend != "numpy" and args.numerics != "ggml-cpu":
        backend = accel_backend(args)
    if args.tp != 1:
        check_tp(model.config, args.tp)
        backend = TensorParallelBackend(np.dtype(args.dtype), args.tp)
    if args.numerics == "ggml-cpu":
        backend = ggml_cpu_backend(args)
    elif args.kv_type or args.flash_attn:
        raise UsageError("--kv-type and --flash-attn choose llama.cpp's cache for --numerics ggml-cpu only")
    device_model = getattr(backend, "text_model", None)  # cupy: the whole forward on the GPU
    lm = device_model(model, np.dtype(args.dtype)) if device_model else TextModel(model, np.dtype(args.dtype), backend)
    drafter = Drafter(gguf.load(args.draft_model, "dflash"), lm) if args.draft_model else None
    timings["load"] = time.perf_counter() - t0
    tok = model.tokenizer
    prompt = prompt_tokens(args, tok)
    if args.tokenize_only:
        print(json.dumps(prompt))
        return 0
    if not prompt:
        raise UsageError("the prompt has no tokens")
    if args.n_predict < 0 or args.prefill_chunk <= 0 or args.ctx < 0:
        raise UsageError("--n-predict, --prefill-chunk and --ctx must not be negative (chunk must be positive)")
    if args.image and drafter:
        raise UsageError("--draft-model with --image is not supported")
    if args.spec_draft_n_max < 0:
        raise UsageError("--spec-draft-n-max must not be negative")
    if args.ctx:  # known before the images are encoded: refused before that work
        check_context(model.config, args, args.ctx)
    tracer = Tracer(args.trace)
    t0 = time.perf_counter()
    images = image_embeddings(args, lm)
    if images:
        timings["image_encode"] = time.perf_counter() - t0
    if args.embeddings_out:
        np.save(args.embeddings_out, np.concatenate(images).astype(np.float32))
    rows = image_prompt_rows(lm, prompt, images) if images else None
    n_ctx = args.ctx or (len(prompt) if rows is None else len(rows)) + args.n_predict
    if not args.ctx:  # a given --ctx was checked above
        check_context(model.config, args, n_ctx)
    cache = lm.new_cache(n_ctx, args.kv, args.prefill_chunk)
    p_min, governor = spec_governor(args.spec_p_min)
    speculator = Speculator(lm, drafter, cache, drafter.new_cache(n_ctx), args.prefill_chunk) if drafter else None

    progress = os.path.getsize(model.path) > PROGRESS_BYTES  # a bar per layer where a forward takes long
    t0 = time.perf_counter()
    if speculator:  # the drafter is caught up on every prompt row as the target prefills
        logits = speculator.forward(prompt, tracer)
    elif rows is not None:
        logits = lm.prefill_embeddings(rows, cache, args.prefill_chunk, tracer, progress)
    else:
        logits = lm.prefill(prompt, cache, args.prefill_chunk, tracer, progress)
    timings["prefill"] = time.perf_counter() - t0
    tracer.close()
    if args.logits_out:
        np.save(args.logits_out, logits.astype(np.float32))

    t0 = time.perf_counter()
    generated, steps = [], []
    if args.n_predict and speculator:
        generated, steps = speculator.decode(logits[-1], args.n_predict, args.spec_draft_n_max, p_min or 0.0, governor)
    elif args.n_predict:
        generated = lm.decode_greedy(logits[-1], args.n_predict, cache, args.prefill_chunk, progress)
    timings["decode"] = time.perf_counter() - t0
    text = detokenize(tok, generated)
    if args.json:
        result = {"prompt_tokens": prompt, "tokens": generated, "text": text, "timings": timings}
        if images:
            result["image_tokens"] = [len(e) for e in images]
        if speculator:
            result["speculative"] = acceptance(steps)
        print(json.dumps(result))
    else:
        print(detokenize(tok, prompt) + text)
        rate = len(generated) / timings["decode"] if generated and timings["decode"] > 0 else 0.0
        print(f"\n[{len(prompt)} prompt tokens in {timings['prefill']:.3f} s, {len(generated)} generated "
              f"at {rate:.1f} tok/s, load {timings['load']:.3f} s]", file=sys.stderr)
        if speculator:
            spec = acceptance(steps)
            print(f"[speculative: {spec['accepted']} of {spec['drafted']} drafts accepted in {len(steps)} "
                  "verification steps]", file=sys.stderr)
        if not args.model:
            print(HINT, file=sys.stderr)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    return exit_status("reference.run", lambda: run(args), (gguf.GGUFError, CacheError, TraceError, TPError,
                                                            TokenizerError, ChatError, ImageError, GgmlCpuError))


if __name__ == "__main__":
    sys.exit(main())
