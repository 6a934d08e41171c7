"""--engine openai: POST /v1/completions of any OpenAI-compatible server (llama-server, vLLM, SGLang, ...)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tools.common import GoldenError, sha256
from reference.cli import strict_int
from .base import TOPK_FORMAT, Engine, model_vocab
from .http import MAX_COUNT, MAX_VOCAB, http_json, http_limits, json_object, reply_int, reply_logprob
from .llama_server import check_topk_reply, completion_topk, token_bytes


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


def token_id(name, where: str, n_vocab: int | None = None) -> int:  # an id or vLLM's "token_id:N" -> N in [0, n_vocab)
    if isinstance(name, str):
        try:
            name = strict_int(name.removeprefix("token_id:"))
        except ValueError:
            raise GoldenError(f"{where}: token {name[:40]!r} is not an id (return_tokens_as_token_ids)") from None
    return reply_int(name, "token id", where, 0, n_vocab or MAX_VOCAB)


def content_steps(content: list, where: str, n_vocab: int | None) -> list[tuple[int, list[int], list[float]]]:
    """llama-server's logprobs.content -> (token, top ids, top logprobs) per generated token, up to the
    first one whose entry also carries the bytes of tokens it reported nothing for (see line_up):
    past it the tokens' positions are not known."""
    steps = []
    for i, entry in enumerate(content):
        field = f"logprobs.content[{i}]"
        top = entry["top_logprobs"]
        top_ids = [token_id(t["id"], f"{where}: {field}.top_logprobs", n_vocab) for t in top]
        pieces = dict(zip(top_ids, (token_bytes(t, where) for t in top)))
        token = token_id(entry["id"], f"{where}: {field}", n_vocab)
        if pieces.get(token) != token_bytes(entry, where):
            break
        steps.append((token, top_ids, [reply_logprob(t["logprob"], f"{field}.top_logprobs.logprob", where) for t in top]))
    return steps


def legacy_steps(logprobs: dict, where: str, n_vocab: int | None) -> list[tuple[int, list[int], list[float]]]:
    """OpenAI's legacy completions logprobs (vLLM): tokens and top_logprobs, one {token: logprob}
    per generated token -> (token, top ids, top logprobs) sorted best first."""
    steps = []
    for name, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        ranked = sorted(((reply_logprob(lp, "top_logprobs", where), token_id(t, where, n_vocab)) for t, lp in top.items()),
                        key=lambda x: -x[0])
        steps.append((token_id(name, where, n_vocab), [t for _, t in ranked], [lp for lp, _ in ranked]))
    return steps


def openai_topk(reply: dict, ids: list[int], n_probs: int, where: str,
                n_vocab: int | None = None) -> tuple[dict, dict]:
    """-> (the TOPK_FORMAT arrays of a /v1/completions reply, what the manifest says of the run);
    every id, log-probability and count checked before any conversion."""
    try:
        choice = reply["choices"][0]
        logprobs = choice["logprobs"]
        steps = content_steps(logprobs["content"], where, n_vocab) if "content" in logprobs \
            else legacy_steps(logprobs, where, n_vocab)
        n_gen = reply_int(reply["usage"]["completion_tokens"], "usage.completion_tokens", where)
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
        ranked = [sorted((reply_int(v["rank"], "prompt_logprobs rank", where, 1), token_id(t, where, n_vocab),
                          reply_logprob(v["logprob"], "prompt_logprobs logprob", where)) for t, v in row.items()
                         if reply_int(v["rank"], "prompt_logprobs rank", where, 1) <= n_probs) for row in rows[1:]]
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


def meta_count(meta: dict, key: str, where: str, most: int = MAX_COUNT) -> int | None:
    """-> a count the server reports, in [1, most], None if it reports none."""
    value = meta.get(key)
    return None if value is None else reply_int(value, f"meta.{key}", where, 1, most + 1)


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
    # None: the server does not say; never more than --model's vocabulary, or MAX_VOCAB without one
    n_vocab = meta_count(meta, "n_vocab", f"{url}/v1/models", model_vocab(args.model) if args.model else MAX_VOCAB)

    def topk(ids: list[int], n: int) -> dict:
        where = f"{url}/v1/completions"
        reply = http_json(where, openai_request(served, ids, n, args.n_probs),
                          http_limits(args, (len(ids) + n) * (args.n_probs + 1), len(ids) + n))
        try:
            top, run = openai_topk(json_object(reply, where), ids, args.n_probs, where, n_vocab)
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
