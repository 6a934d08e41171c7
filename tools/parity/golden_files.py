"""A prompt's golden files and the manifest entry that lists them: one prompt run on an engine
(prefill logits of every position or of --logits-positions, the greedy decode steps, a server's
top-k), each file written whole and vouched for by its sha256; the manifest's shared header, and the
guard that writes goldens only into a directory of goldens. tools.golden runs every prompt in one
pass with them, its corpus mode (corpus.py) task by task."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from reference import artifacts, metrics
from reference.cli import check_train_context
from reference.provenance import software_record
from reference.positions import POSITIONS_FORMAT, SUFFIX, clamped, resolve, sparse_golden
from tools.common import GoldenError, save_atomic, today
from .engines import Engine
from .engines.base import TOPK_FORMAT

PROMPT_LOGPROBS_FORMAT = ("<id>.positions.npz (reference.positions top-k form) of the prompt logprobs a server "
                          "reports (vLLM prompt_logprobs): positions p = 0 .. n_prompt - 2, the top k of the "
                          "distribution of prompt token p + 1; top_logits are log-probabilities and logsumexp "
                          "is 0; n_vocab 0 when the server does not say")
MANIFEST = "manifest.json"


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


def make_dir(path: Path) -> None:  # creates an output directory, or says in one line why it cannot
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, a missing or read-only parent
        raise GoldenError(f"{path}: cannot create the output directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise GoldenError(f"{path}: the output directory is not writable")


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
