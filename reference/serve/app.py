"""The ASGI application: the routes of each API (llama.py, openai.py, sglang.py), and what every
request shares: the bearer token, the body cap, errors as one line in the format of the API a request
came through, greedy-only sampling fields, and the one forward queue."""
import asyncio
import json
import logging
import os
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .oracle import Busy, Expired, ForwardQueue, RequestError

log = logging.getLogger("reference.serve")
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")
SGLANG_PATHS = ("/generate", "/tokenizer_info")
OPEN_PATHS = ("/health", "/")  # no token needed: liveness, and the static page (its requests carry the token)
RETRY_AFTER_S = 1
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


def error_response(path, status, message, headers=None):
    message = " ".join(str(message).split())  # one line, whatever the source
    return JSONResponse(error_body(path, status, message), status, headers)


def validation_message(e):  # RequestValidationError -> "body.prompt: Input should be ..." (the first problem)
    first = e.errors()[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}"
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
    return f"{where}: {first.get('msg', 'invalid')}"


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
        """events(kind, value) -> SSE payloads: ("token", Scored) per token as it is chosen, then ("done",
        Completion); an error ends the stream in the API's error format instead. The request is
        admitted (or refused: Busy) before any byte."""
        if ask.stops:  # a stop string's first tokens would be sent before it is known to be one
            raise RequestError("stop strings are not supported with stream")
        self.oracle.check_length(len(ids), ask.n_predict)
        loop, tokens = asyncio.get_running_loop(), asyncio.Queue()

        def work(cancelled):
            return self.oracle.complete(ids, ask, cancelled, lambda s: loop.call_soon_threadsafe(tokens.put_nowait, s))
        job = asyncio.ensure_future(self.queue.run(work, self.limits.timeout_s, request.is_disconnected))

        async def body():
            try:
                while True:
                    get = asyncio.ensure_future(tokens.get())
                    await asyncio.wait({get, job}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        break
                    for payload in events("token", get.result()):
                        yield sse(payload)
                while not tokens.empty():  # each token was queued before the job's result
                    for payload in events("token", tokens.get_nowait()):
                        yield sse(payload)
                try:
                    payloads = events("done", job.result())
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


def sse(payload):  # -> one server-sent event: a JSON object, or the literal [DONE]
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# -------------------------------------------------------------------------------------------------
# The application

class Guard:
    """ASGI middleware: the bearer token, the body cap, and a one-line 500 in place of any traceback."""

    def __init__(self, app, api_key, body_bytes):
        self.app, self.api_key, self.body_bytes = app, api_key, body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        # every body is JSON whatever its Content-Type says (curl -d sends a form's), as llama-server reads it
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                 + [(b"content-type", b"application/json")]}
        started = False

        async def reply(status, message, extra=None):
            await error_response(path, status, message, extra)(scope, receive, send)

        if self.api_key and path not in OPEN_PATHS:
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                return await reply(401, "Invalid API Key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.body_bytes:
            return await reply(413, f"the body has {int(length)} bytes, more than {self.body_bytes} (--max-body-bytes)")
        seen = 0

        async def capped_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.body_bytes:
                raise BodyTooLarge(f"the body passes {self.body_bytes} bytes (--max-body-bytes)")
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, capped_receive, tracked_send)
        except BodyTooLarge as e:
            if not started:
                await reply(413, str(e))
        except Exception as e:  # a bug: one line in the log and to the client, never a traceback
            log.error("%s %s: %s: %s", scope.get("method"), path, type(e).__name__, " ".join(str(e).split())[:200])
            if not started:
                await reply(500, f"internal error ({type(e).__name__})")


class BodyTooLarge(Exception):
    pass


def create_app(served, api_key=None):  # Served -> the FastAPI application
    from . import llama, openai, sglang

    app = FastAPI(title="reference.serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e):
        return error_response(request.url.path, 400, validation_message(e))

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        return error_response(request.url.path, e.status_code, e.detail)

    @app.exception_handler(RequestError)
    async def refused(request, e):
        return error_response(request.url.path, 400, e)

    @app.exception_handler(Busy)
    async def busy(request, e):
        return error_response(request.url.path, 503, e, {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(Expired)
    async def expired(request, e):
        return error_response(request.url.path, 504, e)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    for module in (llama, openai, sglang):
        app.include_router(module.router)
    app.add_middleware(Guard, api_key=api_key, body_bytes=served.limits.body_bytes)
    return app


def served_of(request: Request) -> Served:
    return request.app.state.served
