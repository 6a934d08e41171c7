"""Golden logits from an engine: this reference, llama.cpp (in-process or a running llama-server),
or transformers.

    python -m tools.golden --engine llama-cpp --model M.gguf --prompts P.jsonl --out DIR \\
        [--kv-type f32|f16|q8_0] [--flash-attn on|off] [--n-predict N]
    python -m tools.golden --engine transformers --checkpoint HF_DIR --prompts P.jsonl --out DIR
    python -m tools.golden --engine reference --model M.gguf --prompts P.jsonl --out DIR \\
        [--dtype float32|float64] [--kv uniform|ring]
    python -m tools.golden --engine llama-server --server-url http://127.0.0.1:8080 \\
        --n-predict N [--n-probs K] --prompts P.jsonl --out DIR
    python -m tools.golden ... --corpus [--task-size N] [--ray | --ray-address ADDR] [--workers N]

P.jsonl holds one prompt a line: {"id": ..., "token_ids": [...]} or {"id": ..., "text": ...}, and
optionally an engine's output to score, "continuation_ids": [...] or "continuation": "text" (text
is tokenized on its own, without BOS: give ids to score exactly what an engine emitted).

For every prompt DIR gets <id>.npy, float32 [n_tokens, n_vocab]: the logits of every position of
one prefill of the prompt, followed by the continuation if there is one (teacher forcing: the whole
continuation is checked in one forward, without the engine generating it). The manifest entry of a
scored prompt holds per continuation token its log-probability and rank (0 = the argmax) under the
logits of the position before it. With --n-predict N the greedy continuation (argmax, exactly N
tokens, no stop at end-of-generation tokens; llama-cpp also records the model's EOG ids and the
index of the first generated one) is recorded in the manifest, and <id>.decode.npy holds the logits
of its N-1 single-token decode steps (row i: after feeding generated token i).

llama-server gives no logits, only the top n_probs log-probabilities of each generated token, so its
golden is <id>.topk.npz (see TOPK_FORMAT); tools.diff compares one against full logits.

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
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from reference import metrics
from reference.cli import OneLineParser, exit_status, int_in

LLAMA_CPP_COMMIT = "0c1e570"  # vendored in llama-cpp-python 0.3.36
REPO = Path(__file__).resolve().parent.parent
TEXT_SOURCES = ("gguf", "ops", "kv", "text", "backend", "trace", "tokenizer")  # what a reference golden runs
TOPK_FORMAT = ("<id>.topk.npz: prompt_ids int32 [n_prompt]; tokens int32 [n_gen], the greedy tokens; "
               "positions int32 [n], top_ids int32 [n, k] and top_logprobs float32 [n, k]: for generated token "
               "positions[r], the k most probable tokens (best first) of the full softmax of the raw logits "
               "that chose it, i.e. at position n_prompt - 1 + positions[r] of prompt_ids + tokens. "
               "llama-server reports no probabilities for a token after which the text ends in an "
               "incomplete UTF-8 character: such tokens have no row")
# What --n-ctx, --n-predict, --n-ubatch and --prefill-chunk can be bounded by before a model is read:
# 2^20 tokens (llama.cpp's logits buffer alone is n_ctx x n_vocab floats, 2 GiB at 2^20 x 512, the
# tiny models' vocabulary). Once the GGUF is read, its training context bounds them further.
MAX_TOKENS = 1 << 20
MAX_THREADS = 512    # llama.cpp's GGML_MAX_N_THREADS
MAX_WORKERS = 1024   # Ray actors, each a process holding a model: a cluster of 1024 model slots


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
    n_vocab: int | None = None                                    # to refuse token ids out of range
    n_ctx: int | None = None      # positions one sequence may take (prompt, continuation, generated)
    max_batch: int | None = None  # tokens one forward may take
    extra: dict = field(default_factory=dict)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_atomic(path: Path, write: Callable) -> None:  # write(binary file) -> None
    """The file appears under its name complete or not at all: a killed run leaves at most a hidden
    temporary (swept by the next corpus run), never a truncated golden."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_json(path: Path, data) -> None:
    save_atomic(path, lambda f: f.write((json.dumps(data, indent=1) + "\n").encode("utf-8")))


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
    if args.n_predict > n_train:
        raise GoldenError(f"--n-predict {args.n_predict} exceeds the training context of "
                          f"{Path(args.model).name} ({n_train} tokens)")
    if args.engine == "llama-cpp" and args.n_ctx > n_train:
        raise GoldenError(f"--n-ctx {args.n_ctx} exceeds the training context of {Path(args.model).name} "
                          f"({n_train} tokens)")
    return model


def check_checkpoint(checkpoint: str) -> Path:  # -> the directory, once it looks like an HF checkpoint
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise GoldenError(f"{ckpt}: not a Hugging Face checkpoint directory (no config.json)")
    return ckpt


def preflight(args) -> None:
    """The checks of an engine's input files and lengths that load no engine: run before Ray workers
    load it, a bad model is one line here instead of a failed task per worker."""
    if args.engine in ("reference", "llama-cpp"):
        load_text_gguf(args)
    elif args.engine == "transformers":
        check_checkpoint(args.checkpoint)


def reference_engine(args) -> Engine:
    from reference.text import TextModel
    from reference.tokenizer import Tokenizer, TokenizerError

    path = Path(args.model)
    model = load_text_gguf(args)
    lm = TextModel(model, np.dtype(args.dtype))
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
        tokenize=tokenize, prefill=prefill, greedy=greedy, n_vocab=model.config.n_vocab,
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


def llama_cpp_engine(args) -> Engine:
    path = Path(args.model)
    load_text_gguf(args)  # llama.cpp answers a truncated file or a projector with a ValueError and log lines

    import llama_cpp
    silence_llama_cpp(llama_cpp)
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
        options={"kv_type": args.kv_type, "flash_attn": args.flash_attn, "n_ubatch": n_ubatch,
                 "n_batch": n_ubatch, "n_ctx": args.n_ctx, "n_threads": threads, "backend": "cpu",
                 "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                 "tokenize": "add_bos=True, special=True (text prompts only)"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, n_vocab=vocab_llm.n_vocab(),
        n_ctx=args.n_ctx, max_batch=n_ubatch, extra={"eog_ids": eog_ids},
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
    if not np.all(np.isfinite(top_logprobs)) or np.any(np.diff(top_logprobs, axis=1) > 0):
        raise GoldenError(f"{where}: top_logprobs are not finite and sorted best first")
    return {"prompt_ids": np.array(ids, np.int32), "tokens": np.array(tokens, np.int32),
            "positions": np.array(positions, np.int32),
            "top_ids": np.array(top_ids, np.int32), "top_logprobs": top_logprobs}


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        raise GoldenError(f"{url}: HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise GoldenError(f"{url}: {getattr(e, 'reason', e)}") from None
    except ValueError:
        raise GoldenError(f"{url}: reply is not JSON") from None


def llama_server_engine(args) -> Engine:
    url = args.server_url.rstrip("/")
    props = http_json(f"{url}/props")
    settings = props.get("default_generation_settings", {})
    served = os.path.basename(str(props.get("model_path", "")))
    model = {"file": served}
    if args.model:
        if Path(args.model).name != served:
            raise GoldenError(f"{url} serves {served!r}, not {Path(args.model).name!r}")
        model["sha256"] = sha256(Path(args.model))

    def topk(ids: list[int], n: int) -> dict:
        if n <= 0:
            raise GoldenError("--engine llama-server needs --n-predict N > 0 (it scores generated tokens)")
        reply = http_json(f"{url}/completion", completion_request(ids, n, args.n_probs))
        return parse_completion(reply, ids, args.n_probs, f"{url}/completion")

    def tokenize(text: str, first: bool) -> list[int]:
        return [int(t) for t in http_json(f"{url}/tokenize", {"content": text, "add_special": first,
                                                              "parse_special": True})["tokens"]]

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
# transformers

def transformers_engine(args) -> Engine:
    ckpt = check_checkpoint(args.checkpoint)  # from_pretrained answers a wrong path with a 40-line OSError

    import torch
    import transformers
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
    "transformers": transformers_engine,
}
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
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise GoldenError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    prompts, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
        except ValueError:
            raise GoldenError(f"{path}:{n}: not a JSON object") from None
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
        top = engine.topk(ids, n_predict)
        save_atomic(out / f"{pid}.topk.npz", lambda f: np.savez(f, **top))
        entry.update(file=f"{pid}.topk.npz", kind="topk", n_probs=int(top["top_ids"].shape[1]),
                     greedy={"n_predict": n_predict, "tokens": top["tokens"].tolist()})
        return entry
    logits = engine.prefill(ids + continuation)
    if logits.shape[0] != len(ids) + len(continuation) or not np.isfinite(logits).all():
        raise GoldenError(f"prompt {pid}: bad logits {list(logits.shape)}")
    save_atomic(out / f"{pid}.npy", lambda f: np.save(f, logits, allow_pickle=False))
    entry.update(file=f"{pid}.npy", shape=list(logits.shape))
    if continuation:
        entry["score"] = continuation_score(logits, len(ids), continuation)
    if n_predict > 0:
        gen, steps = engine.greedy(ids + continuation, n_predict)
        save_atomic(out / f"{pid}.decode.npy", lambda f: np.save(f, steps, allow_pickle=False))
        entry["greedy"] = {"n_predict": n_predict, "stop_at_eog": False, "tokens": gen,
                           "decode_logits": f"{pid}.decode.npy"}
        if "eog_ids" in engine.extra:
            eog = [i for i, t in enumerate(gen) if t in engine.extra["eog_ids"]]
            entry["greedy"]["first_eog_index"] = eog[0] if eog else None
    return entry


def run_header(engine: Engine, prompts_file: Path) -> dict:  # -> the manifest fields every entry shares
    return {
        "engine": engine.name, "version": engine.version, "model": engine.model, "options": engine.options,
        "prompts_file": prompts_file.name, "date": today(),
        "logits": ("top-k log-probabilities of generated tokens: " + TOPK_FORMAT) if engine.prefill is None
        else "float32 [n_tokens, n_vocab], all positions of one prefill of token_ids",
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
    ap.add_argument("--model", help="GGUF file (reference, llama-cpp; llama-server: the served file, for its sha256)")
    ap.add_argument("--checkpoint", help="HF checkpoint directory (transformers)")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f16", help="llama-cpp KV cache type")
    ap.add_argument("--flash-attn", choices=["on", "off"], default="off", help="llama-cpp")
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
    ap.add_argument("--server-url", type=server_url, default="http://127.0.0.1:8080", help="llama-server")
    ap.add_argument("--n-probs", type=tokens, default=10, help="llama-server: top-k per generated token")
    ap.add_argument("--server-launch", help="llama-server: its command line, recorded in the manifest")
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
    if args.engine == "llama-server" and args.n_predict == 0:
        ap.error("--engine llama-server needs --n-predict N > 0 (it scores generated tokens)")
    args.corpus = args.corpus or args.ray or bool(args.ray_address)
    return args


def run_prompts(args: argparse.Namespace, prompts: list[dict]) -> int:  # one process, one pass -> exit status
    from tqdm import tqdm

    engine = ENGINES[args.engine](args)
    # every prompt tokenized and checked before the progress bar, so that bad input gets one clean line
    tokens = [prompt_tokens(engine, p, args.n_predict) for p in prompts]
    make_dir(args.out)
    entries = [golden_entry(engine, p, args.out, args.n_predict, t)
               for p, t in zip(tqdm(prompts, desc=f"{engine.name} {args.out.name}", unit="prompt"), tokens)]
    save_json(args.out / "manifest.json", {**run_header(engine, args.prompts), "entries": entries})
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
