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
golden is <id>.topk.npz (see engines/base.py's TOPK_FORMAT); tools.diff compares one against full logits.

--engine openai does the same through POST /v1/completions of any OpenAI-compatible server (llama-server,
vLLM, SGLang, ...), token_ids prompts only (see openai_request for what is sent, and why nothing else).
It reads llama-server's logprobs.content and OpenAI's legacy tokens/top_logprobs (vLLM, with
return_tokens_as_token_ids). Generation stops where the server stops (end of generation): the entry's
server_run says why and how many tokens had logprobs. A server that reports prompt logprobs (vLLM
prompt_logprobs) also gives <id>.positions.npz (golden_files.py's PROMPT_LOGPROBS_FORMAT).

Goldens of --engine reference are made by this project's own forward: the manifest says so
("self_made": true). Engine projects use them as their oracle; they are never an independent golden
for testing the reference itself.

DIR/manifest.json describes the run: model file and sha256, engine and version, options, date, and
per prompt its token ids and files. Every file appears complete or not at all (written to a
temporary name, then renamed). --corpus splits the prompts into tasks that resume after an
interruption and can fan out over Ray (tools/parity/corpus.py). The engines sit in tools/parity/engines/, one
module each, named in its ENGINES; a prompt's run and files, and the manifest's fields, in golden_files.py.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import urllib.parse
from pathlib import Path

from reference import artifacts
from reference.cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, OneLineParser, add_numerics_flags, exit_status, flag,
                           float_in, int_in)
from reference.factory import GGML_CPU_BACKENDS
from reference.positions import parse_positions
from tools.common import GoldenError, save_json
from .engines import ENGINE_NEEDS, ENGINES, make_engine
from .engines.base import is_token_list
from .golden_files import MANIFEST, golden_entry, make_dir, missing_goldens, prompt_tokens, refuse_overwrite, run_header
from .engines.http import CONNECT_TIMEOUT_S, REPLY_FLOOR_S, SECONDS_PER_TOKEN

# What --n-ctx, --n-predict, --n-ubatch and --prefill-chunk can be bounded by before a model is read:
# 2^20 tokens (llama.cpp's logits buffer alone is n_ctx x n_vocab floats, 2 GiB at 2^20 x 512, the
# tiny models' vocabulary). Once the GGUF is read, its training context bounds them further.
MAX_TOKENS = 1 << 20
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


def server_url(text: str) -> str:  # an argparse type: an http(s) URL with a host
    url = urllib.parse.urlsplit(text)
    try:
        url.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has a bad port") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text




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
