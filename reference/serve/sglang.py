"""SGLang's POST /generate (text or input_ids, sampling_params, return_logprob, logprob_start_len,
top_logprobs_num, return_text_in_logprobs), its logprobs as meta_info's [logprob, token_id, text]
triples, and vLLM's GET /tokenizer_info (lm-evaluation-harness's remote tokenizer)."""
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt

from .served import check_greedy, check_top, json_reply, served_of, stop_strings
from .llama import special
from .oracle import Ask, RequestError, piece_text

router = APIRouter()
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's sampling_params default


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra: dict[str, Any] | None = None


def triple(oracle, t, lp, with_text):  # -> SGLang's [logprob, token_id, text or null]
    return [lp, t, piece_text(oracle.piece(t)) if with_text else None]


@router.post("/generate")
async def generate(body: GenerateBody, request: Request):
    served = served_of(request)
    oracle = served.oracle
    params = body.sampling_params
    check_greedy(params.model_dump())
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("give text or input_ids (one prompt)")
    if body.stream:
        raise RequestError("stream is not supported on /generate")
    if params.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens {params.max_new_tokens} is negative")
    ids = oracle.tokenize(body.text, True) if body.text is not None else oracle.check_ids(body.input_ids)
    n_top = check_top(body.top_logprobs_num, "top_logprobs_num", served.limits) if body.return_logprob else 0
    start = body.logprob_start_len
    if body.return_logprob and not -1 <= start < len(ids):
        raise RequestError(f"logprob_start_len {start} is outside [-1, {len(ids) - 1}] for {len(ids)} prompt tokens")
    t0 = time.perf_counter()
    done = await served.complete(request, ids, Ask(params.max_new_tokens, n_top, body.return_logprob and start >= 0,
                                                   not params.ignore_eos, stop_strings(params.stop)))
    finish = {"type": "length", "length": len(done.tokens)} if done.finish == "length" else \
        {"type": "stop", "matched": done.stop_word or done.tokens[-1]}
    meta = {"id": f"gen-{time.time_ns()}", "finish_reason": finish, "prompt_tokens": len(ids),
            "completion_tokens": len(done.tokens), "cached_tokens": 0, "e2e_latency": time.perf_counter() - t0}
    if body.return_logprob:
        meta.update(logprobs(oracle, body, done, start, n_top))
    return json_reply({"text": oracle.completion_text(done), "output_ids": done.tokens, "meta_info": meta})


def logprobs(oracle, body, done, start, n_top):  # -> meta_info's input/output token and top logprobs
    """Input position p (from logprob_start_len) is prompt token p under the row before it; position 0
    has no row: its logprob is null, as SGLang writes it. -1 asks for the output's only."""
    with_text = body.return_text_in_logprobs
    scored = [None] + done.prompt_scores
    inputs = [] if start < 0 else list(range(start, len(done.prompt)))
    out = {"input_token_logprobs": [triple(oracle, done.prompt[p], scored[p].logprob if scored[p] else None, with_text)
                                    for p in inputs],
           "output_token_logprobs": [triple(oracle, s.token, s.logprob, with_text) for s in done.token_scores]}
    if n_top:
        def top(s):
            return [triple(oracle, t, lp, with_text) for t, lp in zip(s.top_ids, s.top_logprobs)] if s else None
        out["input_top_logprobs"] = [top(scored[p]) for p in inputs]
        out["output_top_logprobs"] = [top(s) for s in done.token_scores]
    return out


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    oracle = served_of(request).oracle
    return {"tokenizer_class": "llama.cpp GGUF (reference.tokenizer)", "eos_token": special(oracle, oracle.tok.eos),
            "bos_token": special(oracle, oracle.tok.bos), "model_max_length": oracle.n_ctx,
            "chat_template": oracle.tok.chat_template or ""}


@router.get("/get_model_info")
async def model_info(request: Request):
    return {"model_path": served_of(request).props["model_path"], "is_generation": True}
