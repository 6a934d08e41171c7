"""What every route shares: the oracle behind it with its limits and its one forward queue (Served),
the greedy-only checks of a request's sampling fields, errors in the format of the API a request came
through, and server-sent events. The routes (llama.py, openai.py, sglang.py) import this module; the
application (app.py) imports them."""
import asyncio
import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .oracle import Expired, ForwardQueue, Release, RequestError

SGLANG_PATHS = ("/generate", "/tokenizer_info")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "unavailable_error",
               504: "timeout_error", 500: "server_error"}


@dataclass(frozen=True)
class Limits:
    queue: int            # requests waiting or running
    body_bytes: int       # a request body
    max_logprobs: int     # n_probs, logprobs, top_logprobs, prompt_logprobs, top_logprobs_num
    timeout_s: float      # a request's deadline, queue wait included
    images: int = 8       # image parts in one request
    image_bytes: int = 1 << 23  # one image's encoded bytes


def error_body(path, status, message):  # -> the JSON error of the API `path` belongs to, one line
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    if path.startswith("/v1/"):  # OpenAI's
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}
    if path in SGLANG_PATHS:  # SGLang's (vLLM's ErrorResponse)
        return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return {"error": {"code": status, "message": message, "type": kind}}  # llama-server's format_error_response


# -------------------------------------------------------------------------------------------------
# Greedy only: the fields that would sample or reshape the logits

NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repeat_penalty": 1, "repetition_penalty": 1,
           "min_p": 0, "top_p": 1, "typical_p": 1, "n": 1, "best_of": 1, "dry_multiplier": 0,
           "xtc_probability": 0, "mirostat": 0}
UNSUPPORTED = ("logit_bias", "grammar", "json_schema", "response_format", "tools", "stop_token_ids")


def greedy_problem(fields):  # dict of a request's sampling fields -> why it is not greedy, or None
    """Greedy: temperature 0 (a non-positive one, as llama.cpp's sampler), top_k 1, or no sampler named.
    The oracle never samples silently: anything else is refused."""
    temperature, top_k, samplers = fields.get("temperature"), fields.get("top_k"), fields.get("samplers")
    if samplers is not None and not (("temperature" in samplers and temperature is not None and temperature <= 0)
                                     or ("top_k" in samplers and top_k == 1)):
        return "samplers must keep temperature (with temperature 0) or top_k (with top_k 1): this oracle is greedy"
    if top_k != 1 and temperature is not None and temperature > 0:
        return f"temperature {temperature:g} samples: this oracle is greedy (send temperature 0 or top_k 1)"
    for name, neutral in NEUTRAL.items():
        if fields.get(name) is not None and fields[name] != neutral:
            return f"{name} {fields[name]!r}: this oracle is greedy and takes only {name} {neutral}"
    for name in UNSUPPORTED:
        if fields.get(name):
            return f"{name} is not supported by this oracle"
    return None


def check_greedy(fields):
    problem = greedy_problem(fields)
    if problem:
        raise RequestError(problem)


def stop_strings(stop):  # a request's stop: None, a string or a list of them -> a tuple
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if "" in stops:
        raise RequestError("an empty stop string would stop before the first token")
    return stops


def check_top(n, name, limits):  # a top-N count -> n; refused past --max-logprobs
    if n is not None and not 0 <= n <= limits.max_logprobs:
        raise RequestError(f"{name} {n} is outside [0, {limits.max_logprobs}] (--max-logprobs)")
    return n or 0


# -------------------------------------------------------------------------------------------------
# Running a request on the oracle

class Served:
    """What a route needs: the oracle, the limits, the forward queue, the model's served name."""

    def __init__(self, oracle, limits, props):
        self.oracle, self.limits, self.props = oracle, limits, props
        self.queue = ForwardQueue(limits.queue)

    async def complete(self, request, ids, ask):  # ids, Ask -> Completion
        self.oracle.check_length(len(ids), ask.n_predict)  # refused before it queues (images add rows: checked again)
        return await self.queue.run(lambda cancelled: self.oracle.complete(ids, ask, cancelled),
                                    self.limits.timeout_s, request.is_disconnected)

    def stream(self, request, ids, ask, events):  # ids, Ask -> a text/event-stream response
        """events(kind, value, text) -> SSE payloads: ("token", Scored, the text it releases) per token as it
        is chosen, then ("done", Completion, the text still held); an error ends the stream in the API's
        error format instead. The request is admitted (or refused: Busy) before any byte."""
        self.oracle.check_length(len(ids), ask.n_predict)
        loop, tokens, release = asyncio.get_running_loop(), asyncio.Queue(), Release(self.oracle, ask.stops)

        def work(cancelled):
            return self.oracle.complete(ids, ask, cancelled, lambda s: loop.call_soon_threadsafe(tokens.put_nowait, s))
        job = asyncio.ensure_future(self.queue.run(work, self.limits.timeout_s, request.is_disconnected))

        def token_events(scored):
            return events("token", scored, release.token(scored.token))

        async def body():
            try:
                while True:
                    get = asyncio.ensure_future(tokens.get())
                    await asyncio.wait({get, job}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        break
                    for payload in token_events(get.result()):
                        yield sse(payload)
                while not tokens.empty():  # each token was queued before the job's result
                    for payload in token_events(tokens.get_nowait()):
                        yield sse(payload)
                try:
                    done = job.result()
                    payloads = events("done", done, release.rest(done))
                except (Expired, RequestError) as e:  # headers are sent: the error is the stream's last event
                    status = 504 if isinstance(e, Expired) else 400
                    path = request.url.path
                    payloads = [error_body(path, status, " ".join(str(e).split()))] + \
                        (["[DONE]"] if path.startswith("/v1/") else [])
                for payload in payloads:
                    yield sse(payload)
            finally:
                job.cancel()  # the client went away mid-stream: the forwards stop
        return StreamingResponse(body(), media_type="text/event-stream")


def json_reply(content):  # a reply's dict -> its response, encoded as it is
    """FastAPI would first walk every value of a returned dict (jsonable_encoder), a cost per log-probability
    listed; these dicts hold only JSON types already."""
    return JSONResponse(content)


def sse(payload):  # -> one server-sent event: a JSON object, or the literal [DONE]
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def served_of(request: Request) -> Served:
    return request.app.state.served
