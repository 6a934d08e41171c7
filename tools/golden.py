"""Golden logits from an engine: this reference, llama.cpp (in-process or a running llama-server),
or transformers.

    python -m tools.golden --engine llama-cpp --model M.gguf --prompts P.jsonl --out DIR \\
        [--kv-type f32|f16|q8_0] [--flash-attn on|off] [--n-predict N]
    python -m tools.golden --engine transformers --checkpoint HF_DIR --prompts P.jsonl --out DIR
    python -m tools.golden --engine reference --model M.gguf --prompts P.jsonl --out DIR \\
        [--dtype float32|float64] [--kv uniform|ring]
    python -m tools.golden --engine llama-server --server-url http://127.0.0.1:8080 \\
        --n-predict N [--n-probs K] --prompts P.jsonl --out DIR
    python -m tools.golden --engine openai --server-url http://127.0.0.1:8000 \\
        --n-predict N [--n-probs K] [--model M.gguf] --prompts P.jsonl --out DIR
    python -m tools.golden ... --corpus [--task-size N] [--ray | --ray-address ADDR] [--workers N]

P.jsonl holds one prompt a line: {"id": ..., "token_ids": [...]} or {"id": ..., "text": ...}, and
optionally an engine's output to score, "continuation_ids": [...] or "continuation": "text" (text
is tokenized on its own, without BOS: give ids to score exactly what an engine emitted).

For every prompt DIR gets <id>.npy, float32 [n_tokens, n_vocab]: the logits of every position of
one prefill of the prompt, followed by the continuation if there is one (teacher forcing: the whole
continuation is checked in one forward, without the engine generating it). With --logits-positions
SPEC [--logits-topk K] it gets <id>.positions.npz instead (reference.positions: those positions of
prompt + continuation, whole rows or their K largest logits and logsumexp; no continuation score),
so that a 16K-token golden at a 202048 vocabulary is megabytes; the reference engine then holds one
prefill chunk of logits at a time. The manifest entry of a
scored prompt holds per continuation token its log-probability and rank (0 = the argmax) under the
logits of the position before it. With --n-predict N the greedy continuation (argmax, exactly N
tokens, no stop at end-of-generation tokens; llama-cpp also records the model's EOG ids and the
index of the first generated one) is recorded in the manifest, and <id>.decode.npy holds the logits
of its N-1 single-token decode steps (row i: after feeding generated token i).

llama-server gives no logits, only the top n_probs log-probabilities of each generated token, so its
golden is <id>.topk.npz (see TOPK_FORMAT); tools.diff compares one against full logits.

--engine openai does the same through POST /v1/completions of any OpenAI-compatible server (llama-server,
vLLM, SGLang, ...), token_ids prompts only (see openai_request for what is sent, and why nothing else).
It reads llama-server's logprobs.content and OpenAI's legacy tokens/top_logprobs (vLLM, with
return_tokens_as_token_ids). Generation stops where the server stops (end of generation): the entry's
server_run says why and how many tokens had logprobs. A server that reports prompt logprobs (vLLM
prompt_logprobs) also gives <id>.positions.npz (PROMPT_LOGPROBS_FORMAT).

Goldens of --engine reference are made by this project's own forward: the manifest says so
("self_made": true). Engine projects use them as their oracle; they are never an independent golden
for testing the reference itself.

DIR/manifest.json describes the run: model file and sha256, engine and version, options, date, and
per prompt its token ids and files. Every file appears complete or not at all (written to a
temporary name, then renamed). --corpus splits the prompts into tasks that resume after an
interruption and can fan out over Ray (tools/corpus.py). The engines sit in ENGINES; each is a
function (args) -> Engine.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import http.client
import importlib
import json
import os
import socket
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from reference import artifacts, metrics
from reference.cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, OneLineParser, UsageError, check_train_context, exit_status,
                           float_in, int_in)
from reference.positions import POSITIONS_FORMAT, SUFFIX, parse_positions, resolve, sparse_golden

LLAMA_CPP_COMMIT = "0c1e570"  # vendored in llama-cpp-python 0.3.36
REPO = Path(__file__).resolve().parent.parent
TEXT_SOURCES = ("gguf", "ops", "kv", "text", "backend", "trace", "tokenizer")  # what a reference golden runs
TOPK_FORMAT = ("<id>.topk.npz: prompt_ids int32 [n_prompt]; tokens int32 [n_gen], the greedy tokens; "
               "positions int32 [n], top_ids int32 [n, k] and top_logprobs float32 [n, k]: for generated token "
               "positions[r], the k most probable tokens (best first) of the full softmax of the raw logits "
               "that chose it, i.e. at position n_prompt - 1 + positions[r] of prompt_ids + tokens. "
               "llama-server reports no probabilities for a token after which the text ends in an "
               "incomplete UTF-8 character: such tokens have no row")
PROMPT_LOGPROBS_FORMAT = ("<id>.positions.npz (reference.positions top-k form) of the prompt logprobs a server "
                          "reports (vLLM prompt_logprobs): positions p = 0 .. n_prompt - 2, the top k of the "
                          "distribution of prompt token p + 1; top_logits are log-probabilities and logsumexp "
                          "is 0; n_vocab 0 when the server does not say")
# What --n-ctx, --n-predict, --n-ubatch and --prefill-chunk can be bounded by before a model is read:
# 2^20 tokens (llama.cpp's logits buffer alone is n_ctx x n_vocab floats, 2 GiB at 2^20 x 512, the
# tiny models' vocabulary). Once the GGUF is read, its training context bounds them further.
MAX_TOKENS = 1 << 20
MAX_THREADS = 512    # llama.cpp's GGML_MAX_N_THREADS
MAX_WORKERS = 1024   # Ray actors, each a process holding a model: a cluster of 1024 model slots
EXTRAS = {"llama_cpp": "parity", "torch": "parity", "transformers": "parity", "tokenizers": "tokenizer"}  # setup.cfg
# HTTP, per request: a server on the same LAN connects in milliseconds; a non-streamed reply comes
# when the whole generation is done (minutes for a 30B on CPU), so the wait for its first byte is long
# and a total deadline bounds a server that trickles. All three are options.
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, REQUEST_DEADLINE_S = 10.0, 300.0, 900.0
# A reply's JSON holds per token of prompt and generation at most n_probs + 1 entries of an id, a
# logprob, a token text and its bytes: 512 bytes each is several times what llama-server and vLLM
# write (~90), and a megabyte more covers the fixed fields. Past that a reply is not one of these.
REPLY_ENTRY_BYTES, REPLY_FLOOR_BYTES = 512, 1 << 20
ENGINE_PACKAGES = {"llama-cpp": ("llama_cpp",), "transformers": ("torch", "transformers")}


class GoldenError(Exception):
    """A prompt set, engine reply or option that cannot give a golden; the message is one line."""


@dataclass
class Engine:
    name: str
    version: str
    model: dict                                   # file name, sha256 (never a machine path)
    options: dict
    tokenize: Callable[[str, bool], list[int]]    # text, whether it starts a sequence (BOS) -> ids
    prefill: Callable[[list[int]], np.ndarray] | None = None     # ids -> float32 [n, n_vocab]
    # ids, n -> (generated ids, decode-step logits float32 [n-1, n_vocab])
    greedy: Callable[[list[int], int], tuple[list[int], np.ndarray]] | None = None
    topk: Callable[[list[int], int], dict] | None = None          # ids, n -> the arrays of TOPK_FORMAT
    # ids, positions int64 [m] -> float32 [m, n_vocab], the rows of a prefill at those positions, without
    # holding all of them at once (default: prefill's rows)
    rows: Callable[[list[int], np.ndarray], np.ndarray] | None = None
    keep: tuple | None = None     # (--logits-positions spec, --logits-topk k or None), set by make_engine
    n_vocab: int | None = None                                    # to refuse token ids out of range
    n_ctx: int | None = None      # positions one sequence may take (prompt, continuation, generated)
    n_ctx_train: int | None = None  # the model's training context: longer sequences need --beyond-n-ctx-train
    beyond_train: bool = False      # --beyond-n-ctx-train, set by make_engine
    max_batch: int | None = None  # tokens one forward may take
    extra: dict = field(default_factory=dict)


def import_extra(module: str, user: str):  # -> the imported module; UsageError naming the extra that installs it
    """An optional package that is absent is one line and exit status 2, not an import traceback.
    Only the module's own absence counts: a package that is there but broken keeps its traceback."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UsageError(f"{user} needs the {module} package: pip install -e \".[{EXTRAS[module]}]\"") from None


sha256 = artifacts.cached_sha256  # path -> hex digest, hashed again only when the file's stat changes


def save_atomic(path: Path, write: Callable) -> str:  # write(binary file) -> None; -> the file's sha256
    """The file appears under its name complete or not at all (reference.artifacts.write_file): a
    killed run leaves at most a hidden temporary (swept by the next corpus run), never a truncated golden."""
    return artifacts.write_file(path, write, GoldenError)


def save_json(path: Path, data) -> str:  # -> the file's sha256
    return artifacts.write_json(path, data, GoldenError)


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


# ---------------------------------------------------------------------------------------------
# this reference

def load_text_gguf(args):  # -> --model as a validated reference.gguf text model
    """Also checks the lengths asked for against the model's training context: past it a golden means
    nothing, and llama.cpp allocates its KV cache and logits for all of --n-ctx."""
    from reference import gguf

    try:
        model = gguf.load(args.model, "text")
    except gguf.GGUFError as e:
        raise GoldenError(str(e)) from None
    n_train = model.config.n_ctx_train
    check_train_context(args.n_predict, n_train, "--n-predict", args.model, args.beyond_n_ctx_train, GoldenError)
    if args.engine == "llama-cpp":
        check_train_context(args.n_ctx, n_train, "--n-ctx", args.model, args.beyond_n_ctx_train, GoldenError)
    return model


def check_checkpoint(checkpoint: str) -> Path:  # -> the directory, once it looks like an HF checkpoint
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise GoldenError(f"{ckpt}: not a Hugging Face checkpoint directory (no config.json)")
    return ckpt


def preflight(args) -> None:
    """The checks of an engine's input files and lengths that load no engine: run before Ray workers
    load it, a bad model is one line here instead of a failed task per worker."""
    for module in ENGINE_PACKAGES.get(args.engine, ()):
        import_extra(module, f"--engine {args.engine}")
    if args.engine in ("reference", "llama-cpp"):
        load_text_gguf(args)
    elif args.engine == "transformers":
        check_checkpoint(args.checkpoint)


def reference_engine(args) -> Engine:
    from reference import factory
    from reference.tokenizer import Tokenizer, TokenizerError

    path = Path(args.model)
    model = load_text_gguf(args)
    lm = factory.text_model(model, factory.Build(dtype=args.dtype))
    try:
        tokenizer = Tokenizer(model.tokenizer)
    except TokenizerError as e:
        raise GoldenError(f"{path}: {e}") from None

    def tokenize(text: str, first: bool) -> list[int]:
        try:
            return tokenizer.tokenize(text, add_special=first, parse_special=True)
        except TokenizerError as e:  # such as a vocabulary that asks for BOS but has none
            raise GoldenError(f"{path}: {e}") from None

    def new_cache(n: int):
        return lm.new_cache(n, args.kv, args.prefill_chunk)

    def prefill(ids: list[int]) -> np.ndarray:
        return lm.prefill(ids, new_cache(len(ids)), args.prefill_chunk)

    def rows(ids: list[int], positions: np.ndarray) -> np.ndarray:
        # one prefill chunk of logits at a time: a 16K prompt at a 202048 vocabulary never holds 13 GB
        cache, kept = new_cache(len(ids)), []
        for start in range(0, len(ids), args.prefill_chunk):
            logits = lm.prefill(ids[start:start + args.prefill_chunk], cache, args.prefill_chunk)
            at = positions[(positions >= start) & (positions < start + len(logits))]
            kept.append(logits[at - start].astype(np.float32))
        return np.concatenate(kept)

    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        # exactly n tokens and no stop at EOG, as the other engines' goldens (decode_greedy stops)
        cache = new_cache(len(ids) + n)
        last = lm.prefill(ids, cache, args.prefill_chunk)[-1]
        gen, steps = [], []
        for i in range(n):
            gen.append(int(np.argmax(last)))
            if i == n - 1:
                break
            last = lm.prefill([gen[-1]], cache)[-1]
            steps.append(last)
        return gen, np.array(steps, dtype=lm.dtype).reshape(len(steps), -1)

    sources = [REPO / "reference" / f"{name}.py" for name in TEXT_SOURCES]
    source_hash = hashlib.sha256(b"".join(s.name.encode() + s.read_bytes() for s in sources)).hexdigest()
    return Engine(
        name="reference",
        version=f"muse-glimmer reference (sha256 of reference/{{{','.join(TEXT_SOURCES)}}}.py {source_hash[:16]})",
        model={"file": path.name, "sha256": sha256(path)},
        options={"dtype": args.dtype, "kv": args.kv, "prefill_chunk": args.prefill_chunk, "backend": "numpy",
                 "numerics": "exact", "tokenize": "reference.tokenizer, BOS and special tokens parsed"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, rows=rows, n_vocab=model.config.n_vocab,
        n_ctx_train=model.config.n_ctx_train,
        extra={"self_made": True,
               "independent": "no: made by this project's reference; an oracle for engines, never a "
                              "golden that tests the reference itself"},
    )


# ---------------------------------------------------------------------------------------------
# llama.cpp

KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type ids
_LLAMA_LOG_SINK = None  # the ctypes callback that drops llama.cpp's log: it must outlive every call


def silence_llama_cpp(llama_cpp) -> None:
    """llama.cpp logs warnings and errors to stderr even with verbose=False; a golden run reports its
    own errors, each one line, so its log goes nowhere."""
    global _LLAMA_LOG_SINK
    if _LLAMA_LOG_SINK is None:
        _LLAMA_LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LLAMA_LOG_SINK, ctypes.c_void_p(0))


def plain_cpu_buffers(bindings):  # llama_cpp.llama_cpp -> None; every Llama made afterwards loads plain CPU buffers
    """use_extra_bufts = False (llama-cli's --no-repack): no CPU_REPACK or AMX weight buffers, every
    product through ggml's plain mul_mat. llama-cpp-python 0.3.36's Llama() has no argument for it,
    so the default model parameters it starts from are replaced."""
    defaults = bindings.llama_model_default_params
    if getattr(defaults, "plain_buffers", False):
        return

    def plain():
        params = defaults()
        params.use_extra_bufts = False
        return params
    plain.plain_buffers = True
    bindings.llama_model_default_params = plain


def llama_cpp_engine(args) -> Engine:
    path = Path(args.model)
    n_train = load_text_gguf(args).config.n_ctx_train  # llama.cpp answers a truncated file or a projector with a ValueError and log lines
    llama_cpp = import_extra("llama_cpp", "--engine llama-cpp")
    silence_llama_cpp(llama_cpp)
    if args.no_repack:
        plain_cpu_buffers(llama_cpp.llama_cpp)
    threads = args.threads or os.cpu_count() or 1
    n_ubatch = args.n_ubatch

    def make():
        return llama_cpp.Llama(
            model_path=str(path), n_ctx=args.n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch,
            logits_all=True, type_k=KV_TYPES[args.kv_type], type_v=KV_TYPES[args.kv_type],
            flash_attn=args.flash_attn == "on", n_threads=threads, n_threads_batch=threads,
            n_gpu_layers=0, seed=0, verbose=False,
        )

    def scores(llm, start: int, stop: int) -> np.ndarray:
        return np.array(llm.scores[start:stop], dtype=np.float32, copy=True)

    def prefill(ids: list[int]) -> np.ndarray:
        llm = make()
        llm.eval(ids)  # one llama_decode: n_batch = n_ubatch >= len(ids) (Engine.max_batch)
        out = scores(llm, 0, len(ids))
        llm.close()
        return out

    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        llm = make()
        llm.eval(ids)
        last = scores(llm, len(ids) - 1, len(ids))[0]
        gen, steps = [], []
        for i in range(n):
            gen.append(int(np.argmax(last)))
            if i == n - 1:
                break
            llm.eval([gen[-1]])
            last = scores(llm, len(ids) + i, len(ids) + i + 1)[0]
            steps.append(last)
        llm.close()
        return gen, np.array(steps, dtype=np.float32).reshape(len(steps), -1)

    try:
        vocab_llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    except ValueError as e:  # a GGUF the reference reads but this llama.cpp does not
        raise GoldenError(f"{path}: llama.cpp cannot load it ({e})") from None
    vocab = vocab_llm._model.vocab
    eog_ids = [i for i in range(vocab_llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]

    def tokenize(text: str, first: bool) -> list[int]:
        return vocab_llm.tokenize(text.encode("utf-8"), add_bos=first, special=True)

    return Engine(
        name="llama-cpp",
        version=f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
        model={"file": path.name, "sha256": sha256(path)},
        options={"kv_type": args.kv_type, "flash_attn": args.flash_attn, "repack": not args.no_repack, "n_ubatch": n_ubatch,
                 "n_batch": n_ubatch, "n_ctx": args.n_ctx, "n_threads": threads, "backend": "cpu",
                 "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                 "tokenize": "add_bos=True, special=True (text prompts only)"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, n_vocab=vocab_llm.n_vocab(),
        n_ctx=args.n_ctx, n_ctx_train=n_train, max_batch=n_ubatch, extra={"eog_ids": eog_ids},
    )


# ---------------------------------------------------------------------------------------------
# llama-server over HTTP

def completion_request(ids: list[int], n_predict: int, n_probs: int) -> dict:
    """The body of POST /completion. Greedy is temperature 0 and nothing else: the default sampler
    chain then ends in the temperature sampler, which keeps only the argmax (penalties, DRY and XTC
    are off by default, top-k/top-p/min-p keep the argmax). `"samplers": []` would drop it and sample
    the raw distribution: non-deterministic goldens. post_sampling_probs false asks for the top
    n_probs of the softmax of the raw logits (after the chain only the argmax would be left);
    cache_prompt false makes every request one full prefill, as the other engines' goldens."""
    return {"prompt": ids, "n_predict": n_predict, "n_probs": n_probs, "temperature": 0,
            "post_sampling_probs": False, "return_tokens": True, "cache_prompt": False}


def token_bytes(entry) -> bytes:  # a JSON item of completion_probabilities or top_logprobs -> its bytes
    return bytes(int(b) for b in entry.get("bytes", []))


def line_up(tokens: list[int], steps: list[dict], where: str) -> list[int]:  # -> index in tokens of each step
    """llama-server adds a generated token's probabilities only once the text ends in a complete
    UTF-8 character; that entry's bytes then hold the pieces of the tokens it waited for, then its own.
    So entry s belongs to the next token with its id after which exactly those waiting pieces lie,
    checked with every piece the reply shows (each top_logprobs item carries its token's bytes)."""
    pieces = {int(t["id"]): token_bytes(t) for step in steps for t in step["top_logprobs"]}
    rows, start = [], 0
    for s, step in enumerate(steps):
        own = pieces[int(step["id"])]
        waiting = token_bytes(step)[:len(token_bytes(step)) - len(own)]

        def fits(skipped):  # the tokens between the last entry and this one -> could they be the waiting bytes?
            if not skipped or not waiting:
                return not skipped and not waiting
            if all(t in pieces for t in skipped):
                return b"".join(pieces[t] for t in skipped) == waiting
            return len(skipped) <= len(waiting)

        found = [j for j in range(start, len(tokens)) if tokens[j] == int(step["id"]) and fits(tokens[start:j])]
        if len(found) != 1:
            raise GoldenError(f"{where}: cannot tell which generated token probability entry {s} belongs to")
        rows.append(found[0])
        start = found[0] + 1
    return rows


def parse_completion(reply: dict, ids: list[int], n_probs: int, where: str) -> dict:  # -> TOPK_FORMAT arrays
    """Reads the JSON of a /completion reply: tokens (return_tokens) and completion_probabilities,
    per reported token its id, bytes and top_logprobs, best first."""
    probs = reply.get("completion_probabilities") if isinstance(reply, dict) else None
    tokens = reply.get("tokens") if isinstance(reply, dict) else None
    if not isinstance(probs, list) or not probs or not isinstance(tokens, list) or not tokens:
        raise GoldenError(f"{where}: reply lacks tokens or completion_probabilities (were return_tokens "
                          "and n_probs > 0 sent?)")
    top_ids, top_logprobs = [], []
    for i, step in enumerate(probs):
        top = step.get("top_logprobs") if isinstance(step, dict) else None
        if not isinstance(top, list) or len(top) != n_probs:
            raise GoldenError(f"{where}: entry {i} has no list of {n_probs} top_logprobs "
                              "(post_sampling_probs must be false)")
        try:
            top_ids.append([int(t["id"]) for t in top])
            top_logprobs.append([float(t["logprob"]) for t in top])
            greedy = int(step["id"]) == top_ids[-1][0]
        except (KeyError, TypeError, ValueError):
            raise GoldenError(f"{where}: entry {i}: malformed id or logprob") from None
        if not greedy:
            raise GoldenError(f"{where}: entry {i}: token {step['id']} is not the top-1: not a greedy run")
    try:
        tokens = [int(t) for t in tokens]
        positions = line_up(tokens, probs, where)
    except (KeyError, TypeError, ValueError):
        raise GoldenError(f"{where}: malformed tokens or bytes") from None
    top_logprobs = np.array(top_logprobs, np.float32)
    if not np.all(np.isfinite(top_logprobs)) or np.any(top_logprobs > 0) or np.any(np.diff(top_logprobs, axis=1) > 0):
        raise GoldenError(f"{where}: top_logprobs are not finite, <= 0 and sorted best first")
    return {"prompt_ids": np.array(ids, np.int32), "tokens": np.array(tokens, np.int32),
            "positions": np.array(positions, np.int32),
            "top_ids": np.array(top_ids, np.int32), "top_logprobs": top_logprobs}


@dataclass
class HttpLimits:
    connect: float = CONNECT_TIMEOUT_S   # seconds to open the connection
    read: float = READ_TIMEOUT_S         # seconds without a byte of the reply
    deadline: float = REQUEST_DEADLINE_S  # seconds for the whole request, however the bytes trickle
    max_bytes: int = REPLY_FLOOR_BYTES   # the reply's size


def http_limits(args, n_items: int = 0) -> HttpLimits:  # -> the limits of a request whose reply lists n_items entries
    return HttpLimits(args.connect_timeout, args.read_timeout, args.request_deadline,
                      REPLY_FLOOR_BYTES + n_items * REPLY_ENTRY_BYTES)


def read_reply(reply, url: str, limit: int) -> bytes:  # -> the body, refused once it passes `limit` bytes
    length = reply.getheader("Content-Length")
    if length and length.isdigit() and int(length) > limit:
        raise GoldenError(f"{url}: the reply says {length} bytes, more than the {limit} such a reply can need")
    data = reply.read(limit + 1)
    if len(data) > limit:
        raise GoldenError(f"{url}: the reply passes {limit} bytes, more than such a reply can need")
    if length and length.isdigit() and len(data) < int(length):  # read(n) returns what came before the close
        raise GoldenError(f"{url}: broken HTTP reply (IncompleteRead: {len(data)} of its {length} bytes)")
    return data


def http_bytes(url: str, body: dict | None, limits: HttpLimits) -> bytes:  # -> the body of a 200 reply
    """One request under separate connect and read timeouts, and a total deadline enforced by a
    timer that shuts the socket (a server sending a byte every few seconds never trips a read
    timeout). Every failure of the socket or of HTTP is a GoldenError naming the URL."""
    parts = urllib.parse.urlsplit(url)
    connection = (http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection)(
        parts.hostname, parts.port, timeout=limits.connect)
    expired = threading.Event()

    def expire():
        expired.set()
        if connection.sock is not None:
            connection.sock.shutdown(socket.SHUT_RDWR)
    timer = threading.Timer(limits.deadline, expire)
    timer.daemon = True
    timer.start()
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    data = None if body is None else json.dumps(body).encode("utf-8")
    try:
        connection.connect()
        connection.sock.settimeout(limits.read)
        connection.request("GET" if data is None else "POST", path, data, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        payload = read_reply(reply, url, limits.max_bytes)
    except (http.client.HTTPException, OSError) as e:
        if expired.is_set():
            raise GoldenError(f"{url}: no whole reply within the deadline of {limits.deadline:g} s "
                              "(--request-deadline)") from None
        if isinstance(e, TimeoutError):
            which = "to connect" if connection.sock is None else "for a byte of the reply"
            option = "--connect-timeout" if connection.sock is None else "--read-timeout"
            wait = limits.connect if connection.sock is None else limits.read
            raise GoldenError(f"{url}: waited {wait:g} s {which} ({option})") from None
        if isinstance(e, http.client.HTTPException):
            raise GoldenError(f"{url}: broken HTTP reply ({type(e).__name__}: {ascii(str(e)[:80])})") from None
        raise GoldenError(f"{url}: {e.strerror or e}") from None
    finally:
        timer.cancel()
        connection.close()
    if reply.status != 200:
        raise GoldenError(f"{url}: HTTP {reply.status}: {payload[:200].decode('utf-8', 'replace')}")
    return payload


def http_json(url: str, body: dict | None = None, limits: HttpLimits = HttpLimits()):  # -> the reply's JSON value
    return artifacts.parse_json(http_bytes(url, body, limits), f"{url}: reply", GoldenError)


def json_object(value, url: str) -> dict:  # -> value, refused unless it is a JSON object
    if not isinstance(value, dict):
        raise GoldenError(f"{url}: the reply is a JSON {type(value).__name__}, not an object")
    return value


def check_topk_reply(top: dict, n_predict: int, n_vocab: int | None, where: str) -> None:
    """A reply checked against its request before it is stored: no more tokens than asked for,
    ids inside the vocabulary (never negative), log-probabilities <= 0 and each top list best first."""
    if top["tokens"].size > n_predict:
        raise GoldenError(f"{where}: {top['tokens'].size} tokens in a reply to a request of {n_predict}")
    for name in ("tokens", "top_ids"):
        ids = top[name]
        if ids.size and (ids.min() < 0 or (n_vocab and ids.max() >= n_vocab)):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise GoldenError(f"{where}: token id {bad} in {name} is outside [0, {n_vocab or 'n_vocab'})")
    lp = top["top_logprobs"]
    if not np.all(np.isfinite(lp)) or np.any(lp > 0) or np.any(np.diff(lp, axis=1) > 0):
        raise GoldenError(f"{where}: top logprobs are not finite, <= 0 and sorted best first")


def completion_topk(url: str, args, ids: list[int], n: int, n_vocab: int | None = None) -> dict:  # -> TOPK_FORMAT
    """POST /completion of llama-server: the arrays of TOPK_FORMAT, checked against the request."""
    where = f"{url}/completion"
    reply = http_json(where, completion_request(ids, n, args.n_probs), http_limits(args, (len(ids) + n) * (args.n_probs + 1)))
    top = parse_completion(reply, ids, args.n_probs, where)
    check_topk_reply(top, n, n_vocab, where)
    return top


def llama_server_engine(args) -> Engine:
    url = args.server_url.rstrip("/")
    props = json_object(http_json(f"{url}/props", limits=http_limits(args)), f"{url}/props")
    settings = props.get("default_generation_settings")
    settings = settings if isinstance(settings, dict) else {}
    served = os.path.basename(str(props.get("model_path", "")))
    model = {"file": served}
    if args.model:
        if Path(args.model).name != served:
            raise GoldenError(f"{url} serves {served!r}, not {Path(args.model).name!r}")
        model["sha256"] = sha256(Path(args.model))

    def topk(ids: list[int], n: int) -> dict:
        if n <= 0:
            raise GoldenError("--engine llama-server needs --n-predict N > 0 (it scores generated tokens)")
        return completion_topk(url, args, ids, n)

    def tokenize(text: str, first: bool) -> list[int]:
        where = f"{url}/tokenize"
        reply = http_json(where, {"content": text, "add_special": first, "parse_special": True},
                          http_limits(args, len(text.encode("utf-8"))))
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not is_token_list(tokens):
            raise GoldenError(f"{where}: the reply holds no list of token ids")
        return tokens

    return Engine(
        name="llama-server",
        version=f"llama-server {props.get('build_info', 'unknown')}",
        model=model,
        options={"request": {k: v for k, v in completion_request([], 0, args.n_probs).items()
                             if k not in ("prompt", "n_predict")},
                 "n_ctx": settings.get("n_ctx"), "total_slots": props.get("total_slots"),
                 "model_ftype": props.get("model_ftype"), "server_launch": args.server_launch or "not given",
                 "golden": TOPK_FORMAT},
        tokenize=tokenize, topk=topk,
    )


# ---------------------------------------------------------------------------------------------
# any OpenAI-compatible completions server (llama-server, vLLM, SGLang, ...)

def openai_request(model: str, ids: list[int], n_predict: int, n_probs: int) -> dict:
    """The body of POST /v1/completions. Greedy is temperature 0 and nothing else, as in
    completion_request: no "samplers", and no ignore_eos, which llama-server implements as a -inf
    logit bias on the end-of-generation tokens, so a run may stop before n_predict tokens.
    logprobs k: the top k of each generated token; prompt_logprobs k (vLLM): the top k of each
    prompt position; return_tokens_as_token_ids (vLLM): tokens named "token_id:N", not by text;
    cache_prompt false (llama-server): one full prefill per request, since a cached prefix was
    computed in other batches and rounds differently (measured on glimmer-default-f16: 4.8e-7 on a
    log-probability). A server ignores the fields it does not know."""
    return {"model": model, "prompt": ids, "max_tokens": n_predict, "temperature": 0, "logprobs": n_probs,
            "prompt_logprobs": n_probs, "return_tokens_as_token_ids": True, "cache_prompt": False}


def token_id(name, where: str) -> int:  # an id or vLLM's "token_id:N" -> N
    text = str(name)
    try:
        return int(text.removeprefix("token_id:"))
    except ValueError:
        raise GoldenError(f"{where}: token {text[:40]!r} is not an id (return_tokens_as_token_ids)") from None


def content_steps(content: list) -> list[tuple[int, list[int], list[float]]]:
    """llama-server's logprobs.content -> (token, top ids, top logprobs) per generated token, up to the
    first one whose entry also carries the bytes of tokens it reported nothing for (see line_up):
    past it the tokens' positions are not known."""
    steps = []
    for entry in content:
        top = entry["top_logprobs"]
        pieces = {int(t["id"]): token_bytes(t) for t in top}
        if pieces.get(int(entry["id"])) != token_bytes(entry):
            break
        steps.append((int(entry["id"]), [int(t["id"]) for t in top], [float(t["logprob"]) for t in top]))
    return steps


def legacy_steps(logprobs: dict, where: str) -> list[tuple[int, list[int], list[float]]]:
    """OpenAI's legacy completions logprobs (vLLM): tokens and top_logprobs, one {token: logprob}
    per generated token -> (token, top ids, top logprobs) sorted best first."""
    steps = []
    for name, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        ranked = sorted(((float(lp), token_id(t, where)) for t, lp in top.items()), key=lambda x: -x[0])
        steps.append((token_id(name, where), [t for _, t in ranked], [lp for lp, _ in ranked]))
    return steps


def openai_topk(reply: dict, ids: list[int], n_probs: int, where: str) -> tuple[dict, dict]:
    """-> (the TOPK_FORMAT arrays of a /v1/completions reply, what the manifest says of the run)."""
    try:
        choice = reply["choices"][0]
        logprobs = choice["logprobs"]
        steps = content_steps(logprobs["content"]) if "content" in logprobs else legacy_steps(logprobs, where)
        n_gen = int(reply["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise GoldenError(f"{where}: reply lacks choices[0].logprobs or usage (was logprobs > 0 sent?)") from None
    if not steps:
        raise NoRows(f"{where}: no generated token with logprobs")
    for i, (token, top_ids, _) in enumerate(steps):
        if len(top_ids) != n_probs:
            raise GoldenError(f"{where}: token {i} has {len(top_ids)} top logprobs, not {n_probs}")
        if token != top_ids[0]:
            raise GoldenError(f"{where}: token {i} ({token}) is not the top-1: not a greedy run")
    top = {"prompt_ids": np.array(ids, np.int32), "tokens": np.array([t for t, _, _ in steps], np.int32),
           "positions": np.arange(len(steps), dtype=np.int32),
           "top_ids": np.array([t for _, t, _ in steps], np.int32),
           "top_logprobs": np.array([lp for _, _, lp in steps], np.float32)}
    run = {"finish_reason": choice.get("finish_reason"), "n_generated": n_gen, "n_with_logprobs": len(steps)}
    return top, run


def openai_prompt_logprobs(reply: dict, n_prompt: int, n_probs: int, n_vocab: int, where: str) -> dict | None:
    """vLLM's choices[0].prompt_logprobs -> the top-k arrays of POSITIONS_FORMAT, or None when the
    server gives none (llama-server). Entry i is the distribution of prompt token i given the ones
    before it, that is the logits of position i - 1; it holds the n_probs best by rank, and the prompt's
    own token when that ranks lower, which is left out. Only log-probabilities are known, so top_logits
    are the log-probabilities and logsumexp is 0: top_logits - logsumexp is the log-probability, as
    for any top-k golden of reference.positions."""
    rows = reply["choices"][0].get("prompt_logprobs")
    if rows is None or n_prompt < 2:  # one prompt token: no position chooses a prompt token
        return None
    try:
        ranked = [sorted((int(v["rank"]), token_id(t, where), float(v["logprob"])) for t, v in row.items()
                         if int(v["rank"]) <= n_probs) for row in rows[1:]]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise GoldenError(f"{where}: malformed prompt_logprobs") from None
    if len(rows) != n_prompt or any(len(r) != n_probs for r in ranked):
        raise GoldenError(f"{where}: prompt_logprobs is not {n_prompt} entries of the {n_probs} best tokens")
    return {"positions": np.arange(n_prompt - 1, dtype=np.int64), "n_vocab": np.int64(n_vocab),
            "top_ids": np.array([[t for _, t, _ in r] for r in ranked], np.int32).reshape(-1, n_probs),
            "top_logits": np.array([[lp for _, _, lp in r] for r in ranked], np.float32).reshape(-1, n_probs),
            "logsumexp": np.zeros(len(ranked), np.float32)}


class NoRows(GoldenError):
    """A reply with no generated token whose position is known (see content_steps)."""


def served_model(url: str, args) -> tuple[dict, dict]:  # -> (the first model of GET /v1/models, its meta)
    where = f"{url}/v1/models"
    listed = json_object(http_json(where, limits=http_limits(args)), where).get("data") or [{}]
    if not isinstance(listed, list) or not isinstance(listed[0], dict):
        raise GoldenError(f"{where}: \"data\" is not a list of model objects")
    meta = listed[0].get("meta") or {}  # llama-server's: n_vocab, n_ctx_train, ftype
    if not isinstance(meta, dict):
        raise GoldenError(f"{where}: the model's \"meta\" is not an object")
    return listed[0], meta


def meta_count(meta: dict, key: str, where: str) -> int | None:  # -> a count the server reports, None if not
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GoldenError(f"{where}: meta.{key} {json.dumps(value)[:40]} is not a positive integer")
    return value


def first_token_split(url: str, args, ids: list[int], n: int, n_vocab: int | None, why: NoRows) -> dict:
    """The first generated token ends inside a UTF-8 character: llama-server then reports it only
    merged into the next entry, and /v1/completions no position at all. Its native /completion
    returns the token ids too, which place the entries (line_up); a server without /completion
    gives no row, and the prompt is recorded without a golden (the run goes on)."""
    try:
        top = completion_topk(url, args, ids, n, n_vocab)
    except GoldenError as e:
        return {"skip": f"{why}; {e}"}
    note = ("the first generated token ends inside a UTF-8 character: /v1/completions gives no position, "
            "rows and token ids from llama-server's /completion")
    return {**top, "run": {"n_generated": int(top["tokens"].size), "n_with_logprobs": int(top["positions"].size),
                           "note": note}}


def openai_engine(args) -> Engine:
    url = args.server_url.rstrip("/")
    listed, meta = served_model(url, args)
    served = str(listed.get("id", ""))
    model = {"file": os.path.basename(served), "served_as": served}
    if args.model:
        model["sha256"] = sha256(Path(args.model))
    n_vocab = meta_count(meta, "n_vocab", f"{url}/v1/models")  # None: the server does not say

    def topk(ids: list[int], n: int) -> dict:
        where = f"{url}/v1/completions"
        reply = http_json(where, openai_request(served, ids, n, args.n_probs),
                          http_limits(args, (len(ids) + n) * (args.n_probs + 1)))
        try:
            top, run = openai_topk(json_object(reply, where), ids, args.n_probs, where)
        except NoRows as e:
            return first_token_split(url, args, ids, n, n_vocab, e)
        check_topk_reply(top, n, n_vocab, where)
        prompt = openai_prompt_logprobs(reply, len(ids), args.n_probs, n_vocab or 0, where)
        run["system_fingerprint"] = reply.get("system_fingerprint")  # llama-server: its build, e.g. b1-0c1e570
        return {**top, "run": run, **({"prompt": prompt} if prompt else {})}

    def tokenize(text: str, first: bool) -> list[int]:
        raise GoldenError("--engine openai takes token_ids prompts: the OpenAI API has no tokenizer endpoint")

    return Engine(
        name="openai",
        version=f"OpenAI-compatible server ({listed.get('owned_by', 'owner not given')}); build per entry",
        model=model,
        options={"request": {k: v for k, v in openai_request(served, [], 0, args.n_probs).items()
                             if k not in ("prompt", "max_tokens")},
                 "server_meta": meta, "server_launch": args.server_launch or "not given", "golden": TOPK_FORMAT},
        tokenize=tokenize, topk=topk, n_vocab=n_vocab,
        n_ctx_train=meta_count(meta, "n_ctx_train", f"{url}/v1/models"),
    )


# ---------------------------------------------------------------------------------------------
# transformers

def transformers_engine(args) -> Engine:
    ckpt = check_checkpoint(args.checkpoint)  # from_pretrained answers a wrong path with a 40-line OSError
    torch = import_extra("torch", "--engine transformers")
    transformers = import_extra("transformers", "--engine transformers")
    from transformers import AutoTokenizer, MuseGlimmerForConditionalGeneration

    threads = args.threads or 1  # one thread: torch's reductions then do not depend on the machine
    torch.set_num_threads(threads)
    model = MuseGlimmerForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    weights = sorted(ckpt.glob("*.safetensors"))

    @torch.no_grad()
    def prefill(ids: list[int]) -> np.ndarray:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        return logits.float().numpy().astype(np.float32)

    @torch.no_grad()
    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        past, last = out.past_key_values, out.logits[0, -1]
        gen, steps = [], []
        for i in range(n):
            gen.append(int(torch.argmax(last)))
            if i == n - 1:
                break
            out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=past, use_cache=True)
            past, last = out.past_key_values, out.logits[0, -1]
            steps.append(last.float().numpy())
        return gen, np.array(steps, dtype=np.float32).reshape(len(steps), -1)

    tokenizer = None

    def tokenize(text: str, first: bool) -> list[int]:
        nonlocal tokenizer
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(ckpt)
        return list(tokenizer(text, add_special_tokens=first)["input_ids"])

    return Engine(
        name="transformers",
        version=f"transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]})",
        model={"checkpoint": ckpt.name,
               "files": [{"file": w.name, "sha256": sha256(w)} for w in weights]},
        options={"dtype": "float32", "attn_implementation": "eager", "device": "cpu", "n_threads": threads,
                 "tokenize": "AutoTokenizer defaults (text prompts only)"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, n_vocab=model.config.get_text_config().vocab_size,
    )


ENGINES: dict[str, Callable[[argparse.Namespace], Engine]] = {
    "reference": reference_engine,
    "llama-cpp": llama_cpp_engine,
    "llama-server": llama_server_engine,
    "openai": openai_engine,
    "transformers": transformers_engine,
}
def make_engine(args) -> Engine:  # -> the engine of --engine, keeping the rows --logits-positions asks for
    engine = ENGINES[args.engine](args)
    engine.beyond_train = args.beyond_n_ctx_train
    if args.logits_positions:
        engine.keep = (args.logits_positions, args.logits_topk)
        engine.options.update(logits_positions=args.logits_positions[0], logits_topk=args.logits_topk)
    return engine


def positions_spec(text: str) -> tuple:  # argparse type: --logits-positions -> (its text, parse_positions's items)
    return text, parse_positions(text)


ENGINE_NEEDS = {"reference": "model", "llama-cpp": "model", "transformers": "checkpoint"}


# ---------------------------------------------------------------------------------------------
# prompts and goldens

def is_token_list(value) -> bool:  # JSON true/false are Python ints: refuse them by name
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def text_problem(value) -> str | None:  # -> what makes a prompt's text unusable, None when nothing does
    if not isinstance(value, str):
        return f"must be a string, got {json.dumps(value)[:40]}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON "\ud800" decodes to a lone surrogate: no tokenizer takes it
        return f"is not valid Unicode (a lone surrogate at character {e.start})"
    return None


def read_prompts(path: Path) -> list[dict]:
    """-> the prompts of a JSON-lines file, every field the engines read checked for its type (other
    fields are kept as they are); a bad line raises GoldenError naming the file and line."""
    try:
        lines = artifacts.read_bytes(path, GoldenError, what="prompt set").decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise GoldenError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    prompts, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        p = artifacts.parse_json(line, f"{path}:{n}", GoldenError)
        if not isinstance(p, dict) or "id" not in p or ("token_ids" in p) == ("text" in p):
            raise GoldenError(f"{path}:{n}: need an id and exactly one of token_ids or text")
        if "continuation_ids" in p and "continuation" in p:
            raise GoldenError(f"{path}:{n}: give continuation_ids or continuation, not both")
        if "images" in p:
            raise GoldenError(f"{path}:{n}: image prompts are not supported by these text engines")
        if isinstance(p["id"], bool) or not isinstance(p["id"], (str, int)):  # the id names files
            raise GoldenError(f"{path}:{n}: id must be a string or an integer, got {json.dumps(p['id'])[:40]}")
        pid = str(p["id"])
        if not pid or Path(pid).name != pid or pid.startswith("."):
            raise GoldenError(f"{path}:{n}: prompt id {pid!r} is not a plain file name")
        if pid in seen:
            raise GoldenError(f"{path}:{n}: prompt id {pid!r} appears twice")
        seen.add(pid)
        for key in ("token_ids", "continuation_ids"):
            if key in p and not is_token_list(p[key]):
                raise GoldenError(f"{path}:{n}: {key} must be a list of integers")
        if p.get("token_ids") == []:
            raise GoldenError(f"{path}:{n}: token_ids is empty")
        for key in ("text", "continuation"):
            problem = text_problem(p[key]) if key in p else None
            if problem:
                raise GoldenError(f"{path}:{n}: {key} {problem}")
        prompts.append(p)
    if not prompts:
        raise GoldenError(f"{path}: no prompts")
    return prompts


def continuation_score(logits: np.ndarray, n_prompt: int, continuation: list[int]) -> dict:
    """logits [n_prompt + n_cont, V] of prompt + continuation -> per continuation token its
    log-probability and rank (how many tokens have a strictly larger logit) under the row before it."""
    rows = logits[n_prompt - 1:n_prompt - 1 + len(continuation)]
    token = np.array(continuation)[:, None]
    logprob = np.take_along_axis(metrics.log_softmax(rows), token, axis=-1)[:, 0]
    rank = np.sum(rows > np.take_along_axis(rows, token, axis=-1), axis=-1)
    return {"logprob": [float(v) for v in logprob], "rank": [int(r) for r in rank],
            "sum_logprob": float(logprob.sum()), "n_top1": int(np.sum(rank == 0))}


def check_ids(engine: Engine, pid: str, ids: list[int]) -> None:
    bad = [t for t in ids if engine.n_vocab is not None and not 0 <= t < engine.n_vocab]
    if bad:
        raise GoldenError(f"prompt {pid}: token id {bad[0]} is out of range for a vocabulary of {engine.n_vocab}")


def prompt_tokens(engine: Engine, p: dict, n_predict: int) -> tuple[list[int], list[int]]:
    """-> a prompt's ids and continuation ids (text tokenized), checked against what the engine can
    run: its vocabulary, its context and batch, whether it scores continuations."""
    pid = str(p["id"])
    ids = list(p["token_ids"]) if "token_ids" in p else engine.tokenize(p["text"], True)
    if "continuation_ids" in p:
        continuation = list(p["continuation_ids"])
    else:
        continuation = engine.tokenize(p["continuation"], False) if "continuation" in p else []
    check_ids(engine, pid, ids + continuation)
    if not ids:  # an empty text without BOS: no position to take logits (or score a continuation) from
        raise GoldenError(f"prompt {pid}: the prompt has no tokens")
    if continuation and engine.prefill is None:
        raise GoldenError(f"prompt {pid}: {engine.name} only reports generated tokens, it cannot score a continuation")
    n = len(ids) + len(continuation)
    if engine.n_ctx is not None and n + max(n_predict - 1, 0) > engine.n_ctx:  # the last token is never fed
        raise GoldenError(f"prompt {pid}: {n} tokens and {n_predict} generated do not fit --n-ctx {engine.n_ctx}")
    if engine.max_batch is not None and n > engine.max_batch:
        raise GoldenError(f"prompt {pid}: {n} tokens do not fit one ubatch of {engine.max_batch}")
    if check_train_context(n + max(n_predict - 1, 0), engine.n_ctx_train, f"prompt {pid}: a sequence (prompt + generation) of",
                           engine.model.get("file") or engine.model.get("checkpoint"), engine.beyond_train, GoldenError):
        engine.options["beyond_n_ctx_train"] = True  # the manifest says that some prompt ran past it
    if engine.keep:
        kept_positions(engine, pid, n)
    return ids, continuation


def golden_entry(engine: Engine, p: dict, out: Path, n_predict: int,
                 tokens: tuple[list[int], list[int]] | None = None) -> dict:
    """Runs one prompt and writes its files into `out` -> its manifest entry. `tokens`: what
    prompt_tokens gave for it, when the caller checked every prompt first."""
    pid = str(p["id"])
    ids, continuation = tokens or prompt_tokens(engine, p, n_predict)
    entry = {"id": pid, "token_ids": ids + continuation}
    if "text" in p:
        entry["text"] = p["text"]
    if continuation:
        entry.update(n_prompt=len(ids), continuation_ids=continuation)
    if engine.prefill is None:
        return topk_entry(engine, entry, ids, out, n_predict)
    if engine.keep:
        positions_entry(engine, entry, ids + continuation, out)
    else:
        full_entry(engine, entry, ids, continuation, out)
    if n_predict > 0:
        greedy_entry(engine, entry, ids + continuation, out, n_predict)
    return entry


def vouch(entry: dict, name: str, digest: str) -> None:  # the manifest entry lists the file with its sha256
    entry.setdefault("sha256", {})[name] = digest


def output_files(prompts: list[dict]) -> list[str]:  # -> every file name a golden run may write into --out
    kinds = (".npy", ".decode.npy", SUFFIX, ".topk.npz")
    return [MANIFEST] + [f"{p['id']}{kind}" for p in prompts for kind in kinds]


def refuse_overwrite(args, prompts: list[dict], out: Path) -> None:  # no golden written over an input file
    inputs = [("--prompts", args.prompts), ("--model", args.model)]
    if args.checkpoint and Path(args.checkpoint).is_dir():
        inputs += [("--checkpoint", f) for f in Path(args.checkpoint).iterdir()]
    artifacts.refuse_overwrite([("--out", out / name) for name in output_files(prompts)], inputs, GoldenError)


def kept_positions(engine: Engine, pid: str, n: int) -> np.ndarray:  # -> int64 [m], --logits-positions of n tokens
    spec = engine.keep[0]
    try:
        return resolve(spec[1], n)
    except ValueError as e:
        raise GoldenError(f"prompt {pid}: --logits-positions {spec[0]}: {e}") from None


def positions_entry(engine: Engine, entry: dict, ids: list[int], out: Path) -> None:  # -> <id>.positions.npz
    """The rows of --logits-positions, whole or their --logits-topk largest (reference.positions)."""
    pid, k = entry["id"], engine.keep[1]
    positions = kept_positions(engine, pid, len(ids))
    rows = engine.rows(ids, positions) if engine.rows else engine.prefill(ids)[positions]
    if rows.shape[0] != positions.size or not np.isfinite(rows).all():
        raise GoldenError(f"prompt {pid}: bad logits {list(rows.shape)}")
    sparse = sparse_golden(rows, positions, rows.shape[1], k)
    vouch(entry, f"{pid}{SUFFIX}", save_atomic(out / f"{pid}{SUFFIX}", lambda f: np.savez(f, **sparse)))
    entry.update(file=f"{pid}{SUFFIX}", kind="positions", n_positions=int(positions.size))


def full_entry(engine: Engine, entry: dict, ids: list[int], continuation: list[int], out: Path) -> None:
    """<id>.npy, the logits of every position, and the score of the continuation."""
    pid = entry["id"]
    logits = engine.prefill(ids + continuation)
    if logits.shape[0] != len(ids) + len(continuation) or not np.isfinite(logits).all():
        raise GoldenError(f"prompt {pid}: bad logits {list(logits.shape)}")
    vouch(entry, f"{pid}.npy", save_atomic(out / f"{pid}.npy", lambda f: np.save(f, logits, allow_pickle=False)))
    entry.update(file=f"{pid}.npy", shape=list(logits.shape))
    if continuation:
        entry["score"] = continuation_score(logits, len(ids), continuation)


def greedy_entry(engine: Engine, entry: dict, ids: list[int], out: Path, n_predict: int) -> None:  # -> <id>.decode.npy
    pid = entry["id"]
    gen, steps = engine.greedy(ids, n_predict)
    vouch(entry, f"{pid}.decode.npy", save_atomic(out / f"{pid}.decode.npy", lambda f: np.save(f, steps, allow_pickle=False)))
    entry["greedy"] = {"n_predict": n_predict, "stop_at_eog": False, "tokens": gen,
                       "decode_logits": f"{pid}.decode.npy"}
    if "eog_ids" in engine.extra:
        eog = [i for i, t in enumerate(gen) if t in engine.extra["eog_ids"]]
        entry["greedy"]["first_eog_index"] = eog[0] if eog else None


def topk_entry(engine: Engine, entry: dict, ids: list[int], out: Path, n_predict: int) -> dict:
    """A server's golden: <id>.topk.npz, and <id>.positions.npz when it reports prompt logprobs too."""
    pid = entry["id"]
    top = engine.topk(ids, n_predict)
    if "skip" in top:  # a prompt that gives no row: recorded without a golden, the run goes on
        entry.update(file=None, kind="none", skipped=top["skip"])
        return entry
    run, prompt = top.pop("run", None), top.pop("prompt", None)
    vouch(entry, f"{pid}.topk.npz", save_atomic(out / f"{pid}.topk.npz", lambda f: np.savez(f, **top)))
    entry.update(file=f"{pid}.topk.npz", kind="topk", n_probs=int(top["top_ids"].shape[1]),
                 greedy={"n_predict": n_predict, "tokens": top["tokens"].tolist()})
    if run:
        entry["server_run"] = run
    if prompt:
        vouch(entry, f"{pid}{SUFFIX}", save_atomic(out / f"{pid}{SUFFIX}", lambda f: np.savez(f, **prompt)))
        entry["prompt_logprobs"] = {"file": f"{pid}{SUFFIX}", "k": int(prompt["top_ids"].shape[1]),
                                    "format": PROMPT_LOGPROBS_FORMAT}
    return entry


MANIFEST = "manifest.json"
DIGESTS = ("each entry's sha256 lists every file of it with its sha256: tools.diff refuses a file that does "
           "not match (one written after this manifest)")


def run_header(engine: Engine, prompts_file: Path) -> dict:  # -> the manifest fields every entry shares
    return {"digests": DIGESTS,
        "engine": engine.name, "version": engine.version, "model": engine.model, "options": engine.options,
        "prompts_file": prompts_file.name, "date": today(),
        "logits": ("top-k log-probabilities of generated tokens: " + TOPK_FORMAT) if engine.prefill is None
        else ("<id>.positions.npz, the --logits-positions of one prefill of token_ids: " + POSITIONS_FORMAT)
        if engine.keep else "float32 [n_tokens, n_vocab], all positions of one prefill of token_ids",
        **engine.extra,
    }


def server_url(text: str) -> str:  # an argparse type: an http(s) URL with a host
    url = urllib.parse.urlsplit(text)
    try:
        url.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has a bad port") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text


def make_dir(path: Path) -> None:  # creates an output directory, or says in one line why it cannot
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, a missing or read-only parent
        raise GoldenError(f"{path}: cannot create the output directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise GoldenError(f"{path}: the output directory is not writable")


def build_parser() -> argparse.ArgumentParser:
    tokens = int_in(1, MAX_TOKENS)
    ap = OneLineParser(prog="python -m tools.golden", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, choices=sorted(ENGINES))
    ap.add_argument("--model", help="GGUF file (reference, llama-cpp; llama-server, openai: the served file, for its sha256)")
    ap.add_argument("--checkpoint", help="HF checkpoint directory (transformers)")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f16", help="llama-cpp KV cache type")
    ap.add_argument("--flash-attn", choices=["on", "off"], default="off", help="llama-cpp")
    ap.add_argument("--no-repack", action="store_true",
                    help="llama-cpp: weights in plain CPU buffers (use_extra_bufts=False, llama-cli's --no-repack); "
                         "reference.run --numerics ggml-cpu --repack off rounds as such a run")
    ap.add_argument("--n-predict", type=int_in(0, MAX_TOKENS), default=0,
                    help="greedy continuation length (0: none; at most the model's training context)")
    ap.add_argument("--n-ubatch", type=tokens, default=512, help="llama.cpp n_batch = n_ubatch")
    ap.add_argument("--n-ctx", type=tokens, default=1024, help="llama-cpp (at most the model's training context)")
    ap.add_argument("--threads", type=int_in(0, MAX_THREADS), default=0,
                    help="0: all cores for llama-cpp (results do not depend on it), 1 for transformers")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="reference (float64: the noise floor for tools.diff --noise-floor)")
    ap.add_argument("--kv", choices=["uniform", "ring"], default="uniform", help="reference KV cache")
    ap.add_argument("--prefill-chunk", type=tokens, default=2048, help="reference")
    ap.add_argument("--server-url", type=server_url, default="http://127.0.0.1:8080", help="llama-server, openai")
    ap.add_argument("--n-probs", type=tokens, default=10,
                    help="llama-server, openai: top-k per generated token (vLLM allows at most 20)")
    ap.add_argument("--server-launch", help="llama-server, openai: its command line, recorded in the manifest")
    ap.add_argument("--logits-positions", type=positions_spec, metavar="SPEC",
                    help="reference, llama-cpp, transformers: keep the logits of these prompt positions only, in "
                         "<id>.positions.npz (last, 0,5,100:120, or with '=' when it starts with '-': "
                         "--logits-positions=-256:; reference.positions)")
    # k beyond the vocabulary keeps whole rows (reference.positions.top_k caps it)
    ap.add_argument("--logits-topk", type=int_in(1, MAX_TOKENS), metavar="K",
                    help="with --logits-positions: the K largest logits of each kept row and its logsumexp")
    ap.add_argument(BEYOND_TRAIN, action="store_true", help=BEYOND_TRAIN_HELP + " (the manifest's options)")
    wait = float_in(0.001, 1e6)
    ap.add_argument("--connect-timeout", type=wait, default=CONNECT_TIMEOUT_S, metavar="S",
                    help=f"llama-server, openai: seconds to connect (default {CONNECT_TIMEOUT_S:g})")
    ap.add_argument("--read-timeout", type=wait, default=READ_TIMEOUT_S, metavar="S",
                    help=f"llama-server, openai: seconds without a byte of a reply (default {READ_TIMEOUT_S:g}; "
                         "a reply comes once its generation is done)")
    ap.add_argument("--request-deadline", type=wait, default=REQUEST_DEADLINE_S, metavar="S",
                    help=f"llama-server, openai: seconds for a whole request (default {REQUEST_DEADLINE_S:g})")
    corpus = ap.add_argument_group("corpus mode (tools/corpus.py)")
    corpus.add_argument("--corpus", action="store_true", help="tasks that resume; implied by --ray")
    # any size is safe: a task holds at most every prompt
    corpus.add_argument("--task-size", type=int_in(1, 1 << 30), default=1, help="prompts per task")
    corpus.add_argument("--ray", action="store_true", help="fan tasks out over a local Ray cluster")
    corpus.add_argument("--ray-address", help="connect to this Ray cluster (e.g. ray://head:10001 or auto)")
    corpus.add_argument("--workers", type=int_in(0, MAX_WORKERS), default=0,
                        help="Ray workers, one model each (0: one per CPU)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    need = ENGINE_NEEDS.get(args.engine)
    if need and not getattr(args, need):
        ap.error(f"--engine {args.engine} needs --{need}")
    if args.engine in ("llama-server", "openai") and args.n_predict == 0:
        ap.error(f"--engine {args.engine} needs --n-predict N > 0 (it scores generated tokens)")
    if args.logits_positions and args.engine in ("llama-server", "openai"):
        ap.error(f"--engine {args.engine} gives no prompt logits: --logits-positions is for reference, llama-cpp, "
                 "transformers")
    if args.logits_topk and not args.logits_positions:
        ap.error("--logits-topk needs --logits-positions (all positions: --logits-positions 0:)")
    args.corpus = args.corpus or args.ray or bool(args.ray_address)
    return args


def run_prompts(args: argparse.Namespace, prompts: list[dict]) -> int:  # one process, one pass -> exit status
    from tqdm import tqdm

    refuse_overwrite(args, prompts, args.out)
    engine = make_engine(args)
    # every prompt tokenized and checked before the progress bar, so that bad input gets one clean line
    tokens = [prompt_tokens(engine, p, args.n_predict) for p in prompts]
    make_dir(args.out)
    # the bar is closed (its line ended) before an error is printed, so the error is stderr's last line
    with tqdm(total=len(prompts), desc=f"{engine.name} {args.out.name}", unit="prompt") as bar:
        entries = []
        for p, t in zip(prompts, tokens):
            entries.append(golden_entry(engine, p, args.out, args.n_predict, t))
            bar.update()
    # written last, listing the digest of every file: an interrupted run leaves an older manifest,
    # which tools.diff then finds does not match the files written since
    save_json(args.out / MANIFEST, {**run_header(engine, args.prompts), "entries": entries})
    skipped = [e for e in entries if e.get("skipped")]
    for e in skipped:
        print(f"tools.golden: prompt {e['id']}: no golden ({e['skipped']})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def work():
        prompts = read_prompts(args.prompts)
        if args.corpus:
            from .corpus import run_corpus
            return run_corpus(args, prompts)
        return run_prompts(args, prompts)
    # OSError too: a golden that cannot be written (disk full, permissions changed mid-run)
    return exit_status("tools.golden", work, (GoldenError,))


if __name__ == "__main__":
    # run the imported module's main: tools/corpus.py raises that module's GoldenError, not __main__'s
    from tools import golden
    sys.exit(golden.main())
