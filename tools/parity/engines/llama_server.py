"""--engine llama-server: a running llama-server's POST /completion (top-k log-probabilities, no logits)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import numpy as np

from tools.common import GoldenError, sha256
from .base import TOPK_FORMAT, Engine, model_vocab
from .http import MAX_VOCAB, http_json, http_limits, json_object, reply_int, reply_logprob, shown


def completion_request(ids: list[int], n_predict: int, n_probs: int) -> dict:
    """The body of POST /completion. Greedy is temperature 0 and nothing else: the default sampler
    chain then ends in the temperature sampler, which keeps only the argmax (penalties, DRY and XTC
    are off by default, top-k/top-p/min-p keep the argmax). `"samplers": []` would drop it and sample
    the raw distribution: non-deterministic goldens. post_sampling_probs false asks for the top
    n_probs of the softmax of the raw logits (after the chain only the argmax would be left);
    cache_prompt false makes every request one full prefill, as the other engines' goldens."""
    return {"prompt": ids, "n_predict": n_predict, "n_probs": n_probs, "temperature": 0,
            "post_sampling_probs": False, "return_tokens": True, "cache_prompt": False}


def token_bytes(entry, where: str = "reply") -> bytes:  # a JSON item of completion_probabilities or top_logprobs -> its bytes
    pieces = entry.get("bytes", [])
    if not isinstance(pieces, list):
        raise GoldenError(f"{where}: bytes {shown(pieces)} is not a list of bytes")
    return bytes(reply_int(b, "bytes", where, 0, 256) for b in pieces)


def line_up(tokens: list[int], steps: list[dict], where: str) -> list[int]:  # -> index in tokens of each step
    """llama-server adds a generated token's probabilities only once the text ends in a complete
    UTF-8 character; that entry's bytes then hold the pieces of the tokens it waited for, then its own.
    So entry s belongs to the next token with its id after which exactly those waiting pieces lie,
    checked with every piece the reply shows (each top_logprobs item carries its token's bytes)."""
    pieces = {t["id"]: token_bytes(t, where) for step in steps for t in step["top_logprobs"]}
    rows, start = [], 0
    for s, step in enumerate(steps):
        own = pieces[step["id"]]
        waiting = token_bytes(step, where)[:len(token_bytes(step, where)) - len(own)]

        def fits(skipped):  # the tokens between the last entry and this one -> could they be the waiting bytes?
            if not skipped or not waiting:
                return not skipped and not waiting
            if all(t in pieces for t in skipped):
                return b"".join(pieces[t] for t in skipped) == waiting
            return len(skipped) <= len(waiting)

        found = [j for j in range(start, len(tokens)) if tokens[j] == step["id"] and fits(tokens[start:j])]
        if len(found) != 1:
            raise GoldenError(f"{where}: cannot tell which generated token probability entry {s} belongs to")
        rows.append(found[0])
        start = found[0] + 1
    return rows


def parse_completion(reply: dict, ids: list[int], n_probs: int, where: str,
                     n_vocab: int | None = None) -> dict:  # -> TOPK_FORMAT arrays
    """Reads the JSON of a /completion reply: tokens (return_tokens) and completion_probabilities,
    per reported token its id, bytes and top_logprobs, best first; every id in [0, n_vocab) and
    every log-probability finite and <= 0, checked before any conversion."""
    high = n_vocab or MAX_VOCAB
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
        field = f"completion_probabilities[{i}]"
        try:
            top_ids.append([reply_int(t["id"], f"{field}.top_logprobs[{j}].id", where, 0, high)
                            for j, t in enumerate(top)])
            top_logprobs.append([reply_logprob(t["logprob"], f"{field}.top_logprobs[{j}].logprob", where)
                                 for j, t in enumerate(top)])
            greedy = reply_int(step["id"], f"{field}.id", where, 0, high) == top_ids[-1][0]
        except (KeyError, TypeError):
            raise GoldenError(f"{where}: entry {i}: malformed id or logprob") from None
        if not greedy:
            raise GoldenError(f"{where}: entry {i}: token {step['id']} is not the top-1: not a greedy run")
    try:
        tokens = [reply_int(t, f"tokens[{j}]", where, 0, high) for j, t in enumerate(tokens)]
        positions = line_up(tokens, probs, where)
    except (KeyError, TypeError, ValueError):
        raise GoldenError(f"{where}: malformed tokens or bytes") from None
    top_logprobs = np.array(top_logprobs, np.float32)
    if not np.all(np.isfinite(top_logprobs)) or np.any(top_logprobs > 0) or np.any(np.diff(top_logprobs, axis=1) > 0):
        raise GoldenError(f"{where}: top_logprobs are not finite, <= 0 and sorted best first")
    return {"prompt_ids": np.array(ids, np.int32), "tokens": np.array(tokens, np.int32),
            "positions": np.array(positions, np.int32),
            "top_ids": np.array(top_ids, np.int32), "top_logprobs": top_logprobs}


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
    reply = http_json(where, completion_request(ids, n, args.n_probs), http_limits(args, (len(ids) + n) * (args.n_probs + 1), len(ids) + n))
    top = parse_completion(reply, ids, args.n_probs, where, n_vocab)
    check_topk_reply(top, n, n_vocab, where)
    return top


def counted(reply: dict, key: str, where: str) -> int | None:  # -> a count a reply reports, checked; None if absent
    return None if reply.get(key) is None else reply_int(reply[key], key, where, 1)


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
    n_vocab = model_vocab(args.model) if args.model else None  # None: ids are checked against MAX_VOCAB

    def topk(ids: list[int], n: int) -> dict:
        if n <= 0:
            raise GoldenError("--engine llama-server needs --n-predict N > 0 (it scores generated tokens)")
        return completion_topk(url, args, ids, n, n_vocab)

    def tokenize(text: str, first: bool) -> list[int]:
        where = f"{url}/tokenize"
        reply = http_json(where, {"content": text, "add_special": first, "parse_special": True},
                          http_limits(args, len(text.encode("utf-8"))))
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list):
            raise GoldenError(f"{where}: the reply holds no list of token ids")
        return [reply_int(t, f"tokens[{j}]", where, 0, n_vocab or MAX_VOCAB) for j, t in enumerate(tokens)]

    return Engine(
        name="llama-server",
        version=f"llama-server {props.get('build_info', 'unknown')}",
        model=model,
        options={"request": {k: v for k, v in completion_request([], 0, args.n_probs).items()
                             if k not in ("prompt", "n_predict")},
                 "n_ctx": counted(settings, "n_ctx", f"{url}/props default_generation_settings"),
                 "total_slots": counted(props, "total_slots", f"{url}/props"),
                 "model_ftype": props.get("model_ftype"), "server_launch": args.server_launch or "not given",
                 "golden": TOPK_FORMAT},
        tokenize=tokenize, topk=topk, n_vocab=n_vocab,
    )


# -------------------------------------------------------------------------------------------------
# llama-server's own arithmetic on a logit row: get_token_probabilities (tools/server/server-common.cpp)
# and completion_token_output::logarithm (tools/server/server-task.cpp)

def libm_float32() -> tuple:  # -> (expf, logf) of the C library, the functions llama-server calls
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for f in (libm.expf, libm.logf):
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.expf, libm.logf


def partial_sort(items: list, middle: int, before) -> None:
    """libstdc++'s std::partial_sort(first, first + middle, last, comp) in place: a heap of the first
    `middle`, every later item that comes before its top swapped in (__heap_select), then the heap
    sorted (__sort_heap). The items past `middle` are left in the order this leaves them, which fixes
    the order of llama-server's float32 sum."""
    def adjust(length, hole, value):  # __adjust_heap, then __push_heap
        top = child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if before(items[child], items[child - 1]):
                child -= 1
            items[hole], hole = items[child], child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            items[hole], hole = items[child - 1], child - 1
        parent = (hole - 1) // 2
        while hole > top and before(items[parent], value):
            items[hole], hole = items[parent], parent
            parent = (hole - 1) // 2
        items[hole] = value

    for parent in range((middle - 2) // 2, -1, -1) if middle >= 2 else ():  # __make_heap
        adjust(middle, parent, items[parent])
    for i in range(middle, len(items)):  # __pop_heap(first, middle, i) for each that comes first
        if before(items[i], items[0]):
            value, items[i] = items[i], items[0]
            adjust(middle, 0, value)
    for last in range(middle - 1, 0, -1):  # __sort_heap
        value, items[last] = items[last], items[0]
        adjust(last, 0, value)


def server_top_logprobs(row: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    """float32 logits [V] -> the top n (ids, log-probabilities) as llama-server computes and prints them:
    the n best first (std::partial_sort by logit), p = expf(logit - max) summed in float32 in the order
    the sort left, p / sum, logf; each a float32 (printed as the double that holds it)."""
    expf, logf = libm_float32()
    cur = [(i, np.float32(v)) for i, v in enumerate(np.asarray(row, np.float32))]
    partial_sort(cur, min(n, len(cur)), lambda a, b: a[1] > b[1])
    top = cur[0][1]
    p = np.array([expf(np.float32(v - top)) for _, v in cur], np.float32)
    total = np.cumsum(p, dtype=np.float32)[-1]  # a running float32 sum, as its loop
    return [i for i, _ in cur[:n]], [float(np.float32(logf(np.float32(q / total)))) for q in p[:n]]
