"""Golden logits from an engine: this reference, llama.cpp (in-process or a running llama-server),
or transformers.

    python -m tools.golden --engine llama-cpp --model M.gguf --prompts P.jsonl --out DIR \\
        [-ctk f32|f16|q8_0] [-ctv f32|f16|q8_0] [-fa on|off|auto] [-nr] [-n N] [-c N] [-ub N]
    python -m tools.golden --engine transformers --checkpoint HF_DIR --prompts P.jsonl --out DIR
    python -m tools.golden --engine reference --model M.gguf --prompts P.jsonl --out DIR \\
        [--dtype float32|float64] [--kv uniform|ring] [--numerics ggml-cpu [-ctk T -ctv T -fa on|off] [--cpu T]]
    python -m tools.golden --engine llama-server --server-url http://127.0.0.1:8080 \\
        --n-predict N [--n-probs K] --prompts P.jsonl --out DIR
    python -m tools.golden --engine openai --server-url http://127.0.0.1:8000 \\
        --n-predict N [--n-probs K] [--model M.gguf] --prompts P.jsonl --out DIR
    python -m tools.golden ... --corpus [--task-size N] [--ray | --ray-address ADDR] [--workers N]

P.jsonl holds one prompt a line: {"id": ..., "token_ids": [...]} or {"id": ..., "text": ...}, and
optionally an engine's output to score, "continuation_ids": [...] or "continuation": "text" (text
is tokenized on its own, without BOS: give ids to score exactly what an engine emitted).
A prompt may name videos, "videos": ["a.npy", {"path": "frames/", "fps": 30}, ...] (--engine reference
with --mmproj, an mmproj with the video extension): a directory of frames, a .npy uint8 [T, H, W, 3]
or a video file, as reference.run --video takes them, a relative path from P.jsonl's directory, "fps"
the source's frame rate (reference.run's --video-fps). The prompt holds one <|video|> per video; each
is expanded as transformers' processor does (its timestamps and one <|video|> a merged token), and
the entry's token_ids are the expanded ids, the rows of the logits.

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
interruption and can fan out over Ray (tools/parity/corpus.py). The engines sit in tools/parity/engines/, one
module each, named in its ENGINES.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import urllib.parse
from pathlib import Path

import numpy as np

from reference import artifacts, metrics
from reference.cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, OneLineParser, add_numerics_flags, check_train_context,
                           exit_status, flag, float_in, int_in)
from reference.factory import GGML_CPU_BACKENDS
from reference.provenance import software_record
from reference.positions import POSITIONS_FORMAT, SUFFIX, clamped, parse_positions, resolve, sparse_golden
from tools.common import GoldenError, save_atomic, save_json, today
from .engines import ENGINE_NEEDS, ENGINES, Engine, make_engine
from .engines.base import TOPK_FORMAT, is_token_list
from .engines.http import CONNECT_TIMEOUT_S, REPLY_FLOOR_S, SECONDS_PER_TOKEN

PROMPT_LOGPROBS_FORMAT = ("<id>.positions.npz (reference.positions top-k form) of the prompt logprobs a server "
                          "reports (vLLM prompt_logprobs): positions p = 0 .. n_prompt - 2, the top k of the "
                          "distribution of prompt token p + 1; top_logits are log-probabilities and logsumexp "
                          "is 0; n_vocab 0 when the server does not say")
# What --n-ctx, --n-predict, --n-ubatch and --prefill-chunk can be bounded by before a model is read:
# 2^20 tokens (llama.cpp's logits buffer alone is n_ctx x n_vocab floats, 2 GiB at 2^20 x 512, the
# tiny models' vocabulary). Once the GGUF is read, its training context bounds them further.
MAX_TOKENS = 1 << 20
MANIFEST = "manifest.json"
MAX_THREADS = 512    # llama.cpp's GGML_MAX_N_THREADS
LLAMA_UBATCH = 512  # llama-cpp's default n_ubatch (= n_batch)
REFERENCE_UBATCH = 2048  # the reference's default prefill chunk
MAX_WORKERS = 1024   # Ray actors, each a process holding a model: a cluster of 1024 model slots


def positions_spec(text: str) -> tuple:  # argparse type: --logits-positions -> (its text, parse_positions's items)
    return text, parse_positions(text)


# ---------------------------------------------------------------------------------------------
# prompts and goldens

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
        if "videos" in p:
            p["videos"] = read_videos_field(p["videos"], path.parent, f"{path}:{n}")
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


def read_videos_field(value, base: Path, where: str) -> list[dict]:  # -> [{"path", "fps", "file"}]; GoldenError
    """A prompt's "videos": paths or {"path", "fps"} objects; "file" is the path from `base` (P.jsonl's
    directory), "path" as it was given (the manifest's)."""
    if not isinstance(value, list) or not value:
        raise GoldenError(f"{where}: videos must be a non-empty list of paths or {{\"path\", \"fps\"}} objects")
    out = []
    for v in value:
        entry = {"path": v} if isinstance(v, str) else v
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"] \
                or set(entry) - {"path", "fps"}:
            raise GoldenError(f"{where}: a video is a path or {{\"path\", \"fps\"}}, not {json.dumps(v)[:60]}")
        fps = entry.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf")):
            raise GoldenError(f"{where}: a video's fps must be a positive number, not {json.dumps(fps)[:40]}")
        out.append({"path": entry["path"], "fps": fps, "file": str(base / entry["path"])})
    return out


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


def prompt_tokens(engine: Engine, p: dict, n_predict: int) -> tuple[list[int], list[int], Engine, list[dict]]:
    """-> a prompt's ids (its videos expanded) and continuation ids (text tokenized), the engine that
    runs them (bound to the prompt's videos) and what each video became, checked against what the
    engine can run: its vocabulary, its context and batch, whether it scores continuations."""
    pid = str(p["id"])
    ids = list(p["token_ids"]) if "token_ids" in p else engine.tokenize(p["text"], True)
    if "continuation_ids" in p:
        continuation = list(p["continuation_ids"])
    else:
        continuation = engine.tokenize(p["continuation"], False) if "continuation" in p else []
    check_ids(engine, pid, ids + continuation)
    if not ids:  # an empty text without BOS: no position to take logits (or score a continuation) from
        raise GoldenError(f"prompt {pid}: the prompt has no tokens")
    videos = []
    if "videos" in p:
        if engine.with_videos is None:
            raise GoldenError(f"prompt {pid}: names videos, which need --engine reference with --mmproj")
        ids, engine, videos = engine.with_videos(pid, ids, p["videos"])
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
        cut = clamped(engine.keep[0][1], n)
        if cut:  # a range past the prompt is cut as a slice is: said once, before the progress bar
            print(f"tools.golden: warning: prompt {pid}: --logits-positions {engine.keep[0][0]} on {n} tokens: "
                  f"{', '.join(cut)}", file=sys.stderr)
    return ids, continuation, engine, videos


def golden_entry(engine: Engine, p: dict, out: Path, n_predict: int, tokens: tuple | None = None) -> dict:
    """Runs one prompt and writes its files into `out` -> its manifest entry. `tokens`: what
    prompt_tokens gave for it, when the caller checked every prompt first."""
    pid = str(p["id"])
    ids, continuation, engine, videos = tokens or prompt_tokens(engine, p, n_predict)
    entry = {"id": pid, "token_ids": ids + continuation}
    if "text" in p:
        entry["text"] = p["text"]
    if videos:
        entry["videos"] = videos
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


def is_manifest(value) -> bool:  # -> whether a JSON value is a golden manifest as run_header and the entries make it
    return isinstance(value, dict) and "engine" in value and isinstance(value.get("entries"), list)


# a directory holding this is a golden directory (artifacts.check_output_dir); corpus.OURS adds its tasks/
OURS = {MANIFEST: artifacts.json_marker(is_manifest, "golden manifest")}


def refuse_overwrite(args, prompts: list[dict], out: Path, ours: dict = OURS) -> None:
    """No golden written over an input file, nor into a directory of files this project did not write."""
    artifacts.check_output_dir(out, "--out", ours, GoldenError)
    inputs = [("--prompts", args.prompts), ("--model", args.model), ("--mmproj", args.mmproj)]
    inputs += [("a prompt's video", v["file"]) for p in prompts for v in p.get("videos", [])]
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


DIGESTS = ("each entry's sha256 lists every file of it with its sha256: tools.diff refuses a file that does "
           "not match (one written after this manifest)")


def run_header(engine: Engine, prompts_file: Path) -> dict:  # -> the manifest fields every entry shares
    return {"digests": DIGESTS,
        "engine": engine.name, "version": engine.version, "model": engine.model, "options": engine.options,
        "prompts_file": prompts_file.name, "date": today(), "provenance": software_record(),
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
    ap = OneLineParser(prog="python -m tools.golden", description=__doc__)
    ap.add_argument("--engine", required=True, choices=sorted(ENGINES))
    flag(ap, "model", help="GGUF file (reference, llama-cpp; llama-server, openai: the served file, for its sha256)")
    ap.add_argument("--checkpoint", help="HF checkpoint directory (transformers)")
    ap.add_argument("--mmproj", help="reference: the vision projector GGUF, with the video extension, of prompts "
                                     "that name videos (tools.video_mmproj)")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    flag(ap, "n_predict", type=int_in(0, MAX_TOKENS), default=0,
         help="greedy continuation length (0: none; at most the model's training context)")
    flag(ap, "ubatch_size", type=tokens,
         help=f"prompt rows per forward (default: {LLAMA_UBATCH} for llama-cpp, as n_batch = n_ubatch; "
              f"{REFERENCE_UBATCH} for reference, at most {LLAMA_UBATCH} under --numerics ggml-cpu)")
    flag(ap, "ctx_size", type=tokens, default=1024, help="llama-cpp's n_ctx (at most the model's training context)")
    flag(ap, "threads", type=int_in(0, MAX_THREADS), default=0,
         help="0: all cores for llama-cpp (results do not depend on it), 1 for transformers, 2 (the modelled "
              "build's) for reference --numerics ggml-cpu")
    engine_flags = ap.add_argument_group(
        "how reference and llama-cpp compute: the cache and flash-attention flags set llama-cpp's context "
        "(default F16 K and V, flash attention off, as llama-cpp-python's) and, with --numerics ggml-cpu, "
        "the build the reference rounds as")
    add_numerics_flags(engine_flags, GGML_CPU_BACKENDS, "off, as llama-cpp-python's")
    ap.add_argument("--kv", choices=["uniform", "ring"], default="uniform", help="reference KV cache")
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
    per_request = (f"default {REPLY_FLOOR_S:g} s + {SECONDS_PER_TOKEN:g} s per token of prompt and generation, "
                   "tools/parity/engines/http.py says why")
    ap.add_argument("--read-timeout", type=wait, metavar="S",
                    help=f"llama-server, openai: seconds without a byte of a reply ({per_request}; "
                         "a reply comes once its generation is done)")
    ap.add_argument("--request-deadline", type=wait, metavar="S",
                    help=f"llama-server, openai: seconds for a whole request, however it trickles ({per_request})")
    corpus = ap.add_argument_group("corpus mode (tools/parity/corpus.py)")
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
    reference_only = [name for name, given in (("--numerics", args.numerics != "exact"), ("--backend", args.backend != "numpy"),
                                               ("--dtype", args.dtype != "float32"), ("--cpu", args.cpu)) if given]
    if reference_only and args.engine != "reference":
        ap.error(f"{', '.join(reference_only)} choose how --engine reference computes, not --engine {args.engine}")
    if args.mmproj and args.engine != "reference":
        ap.error(f"--mmproj is --engine reference's (the tower of prompts that name videos), not --engine {args.engine}'s")
    if args.ubatch_size is None:
        args.ubatch_size = REFERENCE_UBATCH if args.engine == "reference" else LLAMA_UBATCH
    args.corpus = args.corpus or args.ray or bool(args.ray_address)
    return args


def run_prompts(args: argparse.Namespace, prompts: list[dict]) -> int:  # one process, one pass -> exit status
    from tqdm import tqdm

    refuse_overwrite(args, prompts, args.out)
    engine = make_engine(args)
    # every prompt tokenized and checked before the progress bar, so that bad input gets one clean line
    tokens = [prompt_tokens(engine, p, args.n_predict) for p in prompts]
    make_dir(args.out)
    entries = []
    try:
        # the bar is closed (its line ended) before an error is printed, so the error is stderr's last line
        with tqdm(total=len(prompts), desc=f"{engine.name} {args.out.name}", unit="prompt") as bar:
            for p, t in zip(prompts, tokens):
                entries.append(golden_entry(engine, p, args.out, args.n_predict, t))
                bar.update()
    except BaseException as e:  # an error or a signal: the goldens already whole get a manifest that says so
        if entries:
            with artifacts.signals_held():
                save_json(args.out / MANIFEST, {**run_header(engine, args.prompts), "entries": entries,
                                                "incomplete": incomplete(entries, prompts, e)})
        raise
    # written last, listing the digest of every file: a killed run leaves an older manifest,
    # which tools.diff then finds does not match the files written since
    save_json(args.out / MANIFEST, {**run_header(engine, args.prompts), "entries": entries})
    return missing_goldens(entries, len(prompts))


def incomplete(entries: list[dict], prompts: list[dict], why: BaseException) -> dict:  # -> the manifest's "incomplete"
    reason = signal.Signals(why.args[0]).name if isinstance(why, artifacts.Interrupted) \
        else "SIGPIPE" if isinstance(why, BrokenPipeError) else str(why)[:200]
    return {"reason": reason, "prompts_done": len(entries), "prompts": len(prompts),
            "not_done": [str(p["id"]) for p in prompts[len(entries):]][:100]}


def missing_goldens(entries: list[dict], n_prompts: int) -> int:  # -> exit status: 0 when every prompt has its golden
    """A run is a success only if it gave what was asked: a prompt without a golden (a server reply
    with no row) is named, and any such prompt makes the exit status 1."""
    skipped = [e for e in entries if e.get("skipped")]
    for e in skipped:
        print(f"tools.golden: prompt {e['id']}: no golden ({e['skipped']})", file=sys.stderr)
    made = len(entries) - len(skipped)
    if made < n_prompts:
        print(f"tools.golden: {made} of {n_prompts} prompts have a golden; {n_prompts - made} missing",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def work():
        prompts = read_prompts(args.prompts)
        if args.corpus:
            from tools.parity.corpus import run_corpus
            return run_corpus(args, prompts)
        return run_prompts(args, prompts)
    # OSError too: a golden that cannot be written (disk full, permissions changed mid-run)
    return exit_status("tools.golden", work, (GoldenError,))


if __name__ == "__main__":
    sys.exit(main())
