"""The ASGI application: the routes of each API (llama.py, openai.py, sglang.py) behind one guard (the
bearer token, the body cap, a one-line 500 in place of any traceback), and the errors every route may
raise, each a JSON error in the format of the API the request came through (served.py)."""
import logging
import os

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException

from . import llama, openai, sglang
from .oracle import Busy, Expired, RequestError
from .served import error_body

log = logging.getLogger("reference.serve")
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")
OPEN_PATHS = ("/health", "/")  # no token needed: liveness, and the static page (its requests carry the token)
RETRY_AFTER_S = 1


def error_response(path, status, message, headers=None):
    message = " ".join(str(message).split())  # one line, whatever the source
    return JSONResponse(error_body(path, status, message), status, headers)


def validation_message(e):  # RequestValidationError -> "body.prompt: Input should be ..." (the first problem)
    first = e.errors()[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}"
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
    return f"{where}: {first.get('msg', 'invalid')}"


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
