"""OpenAI's /v1/completions (echo, logprobs, a prompt as text, ids or a list of either) with vLLM's
prompt_logprobs and return_tokens_as_token_ids, and /v1/chat/completions (logprobs, top_logprobs,
streaming). A generated token's logprob is that of the raw logits' softmax, as vLLM's default
--logprobs-mode raw_logprobs."""
import base64
import binascii
import io
import time
import urllib.parse
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt

from .served import check_greedy, check_top, json_reply, served_of, stop_strings
from ..image import ImageError, decode_rgb
from .llama import BUILD_INFO
from .oracle import Ask, RequestError, piece_text

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's for /v1/completions


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    stream: bool = False
    ignore_eos: bool = False
    temperature: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None


class CompletionsBody(Body):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False


class ChatBody(Body):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def prompts_of(oracle, prompt):  # -> [(ids, text)] one per choice
    if isinstance(prompt, str):
        return [(oracle.tokenize(prompt, True), prompt)]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [(oracle.check_ids(prompt), oracle.text(prompt))]
    if not prompt:
        raise RequestError("prompt is empty")
    return [prompts_of(oracle, p)[0] for p in prompt]


def token_name(oracle, t, as_ids):  # -> a token as the legacy logprobs name it: its text, or vLLM's "token_id:N"
    return f"token_id:{t}" if as_ids else piece_text(oracle.piece(t))


def top_dict(oracle, scored, n, as_ids):  # -> {token: logprob}: the top n and the chosen token
    top = {token_name(oracle, t, as_ids): lp for t, lp in zip(scored.top_ids[:n], scored.top_logprobs[:n])}
    top.setdefault(token_name(oracle, scored.token, as_ids), scored.logprob)
    return top


def legacy_logprobs(oracle, ids, scores, n, as_ids, offset):  # -> choices[i].logprobs of ids, scored (None: unscored)
    names = [token_name(oracle, t, as_ids) for t in ids]
    offsets, at = [], offset
    for t in ids:
        offsets.append(at)
        at += len(piece_text(oracle.piece(t)))
    return {"tokens": names, "token_logprobs": [s.logprob if s else None for s in scores],
            "top_logprobs": [top_dict(oracle, s, n, as_ids) if s else None for s in scores], "text_offset": offsets}


def vllm_prompt_logprobs(oracle, done, n):  # -> vLLM's prompt_logprobs: per position {id: {logprob, rank, decoded_token}}
    def entry(t, lp, rank):
        return {"logprob": lp, "rank": rank, "decoded_token": piece_text(oracle.piece(t))}

    rows = [None]
    for s in done.prompt_scores:
        row = {str(t): entry(t, lp, r + 1) for r, (t, lp) in enumerate(zip(s.top_ids[:n], s.top_logprobs[:n]))}
        row.setdefault(str(s.token), entry(s.token, s.logprob, s.rank))
        rows.append(row)
    return rows


def choice(oracle, body, index, done, prompt_text):  # one prompt's Completion -> its choice
    n, as_ids = body.logprobs, body.return_tokens_as_token_ids
    out = {"index": index, "text": (prompt_text if body.echo else "") + oracle.completion_text(done),
           "finish_reason": done.finish, "logprobs": None}
    if n is not None:
        ids, scores = done.tokens, list(done.token_scores)
        if body.echo:
            ids, scores = done.prompt + ids, [None] + done.prompt_scores + scores
        out["logprobs"] = legacy_logprobs(oracle, ids, scores, n, as_ids, 0 if body.echo else len(prompt_text))
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(oracle, done, body.prompt_logprobs)
    return out


def usage(dones):
    prompt, generated = sum(len(d.prompt) for d in dones), sum(len(d.tokens) for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def max_tokens(value, default):
    if value is not None and value < 0:
        raise RequestError(f"max_tokens {value} is negative")
    return default if value is None else value


@router.post("/v1/completions")
async def completions(body: CompletionsBody, request: Request):
    served = served_of(request)
    oracle = served.oracle
    check_greedy(body.model_dump())
    k = max(check_top(body.logprobs, "logprobs", served.limits), check_top(body.prompt_logprobs, "prompt_logprobs",
                                                                            served.limits))
    prompts = prompts_of(oracle, body.prompt)
    n_predict = max_tokens(body.max_tokens, DEFAULT_MAX_TOKENS)
    score_prompt = body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)
    ask = Ask(n_predict, k, score_prompt, not body.ignore_eos, stop_strings(body.stop))
    head = {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": oracle.name, "system_fingerprint": BUILD_INFO}
    if body.stream:
        if len(prompts) != 1 or score_prompt or body.echo:
            raise RequestError("stream takes one prompt, without echo or prompt_logprobs")
        return served.stream(request, prompts[0][0], ask, lambda *event: completion_events(oracle, body, head, *event))
    dones = [await served.complete(request, ids, ask) for ids, _ in prompts]
    return json_reply({**head, "choices": [choice(oracle, body, i, d, text) for i, (d, (_, text)) in
                                           enumerate(zip(dones, prompts))], "usage": usage(dones)})


def completion_events(oracle, body, head, kind, value, text):  # -> SSE payloads of /v1/completions
    if kind == "token":
        logprobs = None if body.logprobs is None else \
            legacy_logprobs(oracle, [value.token], [value], body.logprobs, body.return_tokens_as_token_ids, 0)
        return [{**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}]}]
    return [{**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": value.finish}],
             "usage": usage([value])}, "[DONE]"]


# -------------------------------------------------------------------------------------------------
# Chat

def chat_logprob(oracle, t, lp):  # -> {token, logprob, bytes}
    data = oracle.piece(t)
    return {"token": piece_text(data), "logprob": lp, "bytes": list(data)}


def chat_logprobs(oracle, scores, n):  # -> choices[0].logprobs.content
    return [{**chat_logprob(oracle, s.token, s.logprob),
             "top_logprobs": [chat_logprob(oracle, t, lp) for t, lp in zip(s.top_ids[:n], s.top_logprobs[:n])]}
            for s in scores]


def image_part(part, limits):  # an image_url content part -> uint8 [H, W, 3]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise RequestError("an image_url must be a data: URL (data:image/png;base64,...): this server fetches nothing")
    head, data = url[5:].split(",", 1)
    if len(data) * 3 // 4 > limits.image_bytes:
        raise RequestError(f"an image of about {len(data) * 3 // 4} bytes is more than {limits.image_bytes} "
                           "(--max-image-bytes)")
    try:
        raw = base64.b64decode(data, validate=True) if head.endswith(";base64") else urllib.parse.unquote_to_bytes(data)
        return decode_rgb(io.BytesIO(raw), "image_url")
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"image_url: not base64 ({e})") from None
    except ImageError as e:
        raise RequestError(str(e)) from None


def chat_inputs(oracle, messages, limits):  # -> (prompt ids, the images their <|patch|> tokens stand for)
    """Image parts become the template's {"type": "image"} (a <|patch|> each, as reference.run --chat
    --image renders them), the images decoded as reference.image decodes a file."""
    images, rendered = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    if oracle.vision is None:
                        raise RequestError("image input needs a vision tower: start the server with --mmproj")
                    if len(images) == limits.images:
                        raise RequestError(f"more than {limits.images} images in one request (--max-images)")
                    images.append(image_part(part, limits))
                    parts.append({"type": "image"})
                elif isinstance(part, dict) and part.get("type") == "text":
                    parts.append(part)
                else:
                    raise RequestError("a content part must be text or image_url")
            m = {**m, "content": parts}
        rendered.append(m)
    return oracle.chat(rendered), images


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request):
    served = served_of(request)
    oracle = served.oracle
    check_greedy(body.model_dump())
    k = check_top(body.top_logprobs, "top_logprobs", served.limits) if body.logprobs else 0
    ids, images = chat_inputs(oracle, body.messages, served.limits)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    n_predict = max_tokens(limit, -1)  # none given: until the end of generation or of the context
    ask = Ask(n_predict, k, False, not body.ignore_eos, stop_strings(body.stop), tuple(images))
    head = {"id": f"chatcmpl-{time.time_ns()}", "created": int(time.time()), "model": oracle.name,
            "system_fingerprint": BUILD_INFO}
    if body.stream:
        return served.stream(request, ids, ask, lambda *event: chat_events(oracle, body, head, k, *event))
    done = await served.complete(request, ids, ask)
    message = {"role": "assistant", "content": oracle.completion_text(done)}
    logprobs = {"content": chat_logprobs(oracle, done.token_scores, k)} if body.logprobs else None
    choices = [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": done.finish}]
    return json_reply({**head, "object": "chat.completion", "choices": choices, "usage": usage([done])})


def chat_events(oracle, body, head, k, kind, value, text):  # -> SSE payloads of /v1/chat/completions
    chunk = {**head, "object": "chat.completion.chunk"}
    if kind == "token":
        logprobs = {"content": chat_logprobs(oracle, [value], k)} if body.logprobs else None
        delta = {"role": "assistant", "content": text}
        return [{**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}]
    delta = {"content": text} if text else {}
    return [{**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": value.finish}],
             "usage": usage([value])}, "[DONE]"]
