"""llama-server's endpoints (tools/server/README.md of llama.cpp 0c1e570): /completion, /tokenize,
/detokenize, /apply-template, /props, /health, /v1/models; /tokenize and /detokenize also take
vLLM's field names (lm-evaluation-harness's remote tokenizer)."""
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt

from .served import check_greedy, check_top, json_reply, served_of, stop_strings
from .oracle import Ask, RequestError, piece_text

router = APIRouter()
BUILD_INFO = "reference.serve"  # what /props and system_fingerprint report in place of llama.cpp's build


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of other servers are ignored, as llama-server does


class CompletionBody(Body):
    prompt: str | list[StrictInt | str]
    n_predict: int = -1                 # -1: until an end-of-generation token or the context's end
    n_probs: int = 0
    post_sampling_probs: bool = False
    cache_prompt: bool = True           # accepted; no prefix is ever reused (oracle.py)
    stream: bool = False
    return_tokens: bool = False
    ignore_eos: bool = False
    temperature: float | None = None
    top_k: int | None = None
    samplers: list[str] | None = None
    stop: list[str] | None = None


class TokenizeBody(Body):
    content: str | list[StrictInt | str] | None = None   # llama-server's
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    prompt: str | None = None                             # vLLM's
    add_special_tokens: bool = True


class DetokenizeBody(Body):
    tokens: list[StrictInt]


class TemplateBody(Body):
    messages: list[dict[str, Any]]


def token_entry(oracle, token, logprob, post_sampling):  # -> {id, token, bytes, logprob | prob}
    data = oracle.piece(token)
    return {"id": token, "token": piece_text(data), "bytes": list(data),
            **({"prob": logprob} if post_sampling else {"logprob": logprob})}


def probabilities(oracle, scored, post_sampling):  # Scored -> a completion_probabilities entry
    """Without post_sampling_probs: the top n_probs of the softmax of the raw logits. With it, the
    distribution after the sampler chain, which greedy leaves as the argmax alone: 1 for it, 0 for the rest."""
    if post_sampling:
        top = [token_entry(oracle, t, 1.0 if r == 0 else 0.0, True) for r, t in enumerate(scored.top_ids)]
        return {**token_entry(oracle, scored.token, 1.0, True), "top_probs": top}
    top = [token_entry(oracle, t, lp, False) for t, lp in zip(scored.top_ids, scored.top_logprobs)]
    return {**token_entry(oracle, scored.token, scored.logprob, False), "top_logprobs": top}


def completion_json(served, body, done):  # Completion -> /completion's reply
    oracle = served.oracle
    out = {"index": 0, "content": oracle.completion_text(done), "tokens": done.tokens if body.return_tokens else [],
           "id_slot": 0, "stop": True, "model": oracle.name, "tokens_predicted": len(done.tokens),
           "tokens_evaluated": len(done.prompt), "stop_type": "word" if done.stop_word else "eos" if done.finish == "stop" else "limit",
           "stopping_word": done.stop_word, "tokens_cached": 0, "truncated": False}
    if body.n_probs:
        out["completion_probabilities"] = [probabilities(oracle, s, body.post_sampling_probs) for s in done.token_scores]
    return out


@router.post("/completion")
@router.post("/completions")
async def completion(body: CompletionBody, request: Request):
    served = served_of(request)
    check_greedy(body.model_dump())
    k = check_top(body.n_probs, "n_probs", served.limits)
    ids = served.oracle.tokenize_mixed(body.prompt)
    ask = Ask(body.n_predict, k, stop_at_eog=not body.ignore_eos, stops=stop_strings(body.stop))
    if body.stream:
        return served.stream(request, ids, ask, lambda *event: stream_events(served, body, *event))
    done = await served.complete(request, ids, ask)
    return json_reply(completion_json(served, body, done))


def stream_events(served, body, kind, value, text):  # -> the SSE payloads of one event
    oracle = served.oracle
    if kind == "token":
        chunk = {"index": 0, "content": text, "tokens": [value.token], "stop": False, "id_slot": 0}
        if body.n_probs:
            chunk["completion_probabilities"] = [probabilities(oracle, value, body.post_sampling_probs)]
        return [chunk]
    final = completion_json(served, body, value)
    final.update(content=text, tokens=[])
    final.pop("completion_probabilities", None)
    return [final]


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request):
    oracle = served_of(request).oracle
    if body.content is None and body.prompt is None:
        raise RequestError("give content (llama-server) or prompt (vLLM)")
    if body.content is not None:
        ids = oracle.tokenize_mixed(body.content, body.add_special) if not isinstance(body.content, str) else \
            oracle.tokenize(body.content, body.add_special, body.parse_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": piece_json(oracle.piece(t))} for t in ids]}
        return {"tokens": ids}
    ids = oracle.tokenize(body.prompt, body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": oracle.n_ctx}


def piece_json(data):  # a piece -> its text, or its byte values when it is not valid UTF-8 (llama-server's)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request):
    text = served_of(request).oracle.text(body.tokens)
    return {"content": text, "prompt": text}  # llama-server's name, vLLM's name


@router.post("/apply-template")
async def apply_template(body: TemplateBody, request: Request):
    return {"prompt": served_of(request).oracle.chat_text(body.messages)}


@router.get("/health")
@router.get("/v1/health")
async def health():
    return {"status": "ok"}


@router.get("/props")
async def props(request: Request):
    served = served_of(request)
    oracle = served.oracle
    return {"default_generation_settings": {"n_ctx": oracle.n_ctx, "params": {"temperature": 0.0, "top_k": 1}},
            "total_slots": 1, "model_alias": oracle.name, "model_path": served.props["model_path"],
            "model_ftype": served.props["ftype"], "modalities": {"vision": served.props["vision"], "audio": False},
            "chat_template": oracle.tok.chat_template or "", "bos_token": special(oracle, oracle.tok.bos),
            "eos_token": special(oracle, oracle.tok.eos), "build_info": BUILD_INFO,
            "numerics": served.props["numerics"], "model_draft": served.props["model_draft"]}


def special(oracle, i):  # -> the text of a special token, "" when the vocabulary has none
    return oracle.tok.tokens[i] if i is not None and i >= 0 else ""


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request):
    served = served_of(request)
    oracle = served.oracle
    meta = {"vocab_type": 2, "n_vocab": oracle.n_vocab, "n_ctx": oracle.n_ctx, "n_ctx_train": oracle.lm.cfg.n_ctx_train,
            "n_embd": oracle.lm.cfg.n_embd, "size": served.props["size"], "ftype": served.props["ftype"]}
    return {"object": "list", "data": [{"id": oracle.name, "object": "model", "created": 0, "owned_by": "reference",
                                        "meta": meta}]}
