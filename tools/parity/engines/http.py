"""One HTTP request of a server engine, bounded in time and size, every failure one line."""
from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import urllib.parse
from dataclasses import dataclass

from reference import artifacts
from tools.common import GoldenError

# HTTP, per request: a server on the same LAN connects in milliseconds. A non-streamed reply comes
# only once its whole generation is done, so both the wait for its first byte and the deadline for
# all of it (which bounds a server that trickles a byte at a time) grow with the tokens asked for:
# REPLY_FLOOR_S + SECONDS_PER_TOKEN x (prompt + generated tokens). Measured: llama-server (0c1e570)
# on the embedded glimmer-default-f16 takes 0.25 ms a generated token and 0.1-1 ms a prompt token
# (tests/fixtures/openai, its "timings"): a 33-token prompt and 8 generated in 5 ms, where this
# allows 40.5 s. A 30B Q4_K_M on a CPU server generates 2-5 tokens/s (0.2-0.5 s a token): 0.5 s a
# token covers it; slower servers take --read-timeout / --request-deadline. A dead server ends in
# REPLY_FLOOR_S (20 s) at its first request, /props or /v1/models.
CONNECT_TIMEOUT_S, REPLY_FLOOR_S, SECONDS_PER_TOKEN = 10.0, 20.0, 0.5
# A reply's JSON holds per token of prompt and generation at most n_probs + 1 entries of an id, a
# logprob, a token text and its bytes: 512 bytes each is several times what llama-server and vLLM
# write (~90), and a megabyte more covers the fixed fields. Past that a reply is not one of these.
REPLY_ENTRY_BYTES, REPLY_FLOOR_BYTES = 512, 1 << 20
# A vocabulary a server may report when no --model says what it is: 2^24 is 80x the largest in use
# (Gemma's 262144), and every id of it fits the int32 arrays of a golden.
MAX_VOCAB = 1 << 24
MAX_COUNT = 1 << 30  # a count of tokens a reply may report (usage, n_ctx_train): past any context


def shown(value) -> str:  # a JSON value as a message shows it: short, one line
    return json.dumps(value)[:40]


def reply_int(value, field: str, where: str, low: int = 0, high: int = MAX_COUNT) -> int:  # -> value in [low, high)
    """An integer of a reply, checked before any conversion: a bool, a float (JSON 1e999 is inf,
    2.0 is no id), a string or a value outside [low, high) is refused by its field's name, so that
    no int() or int32 array meets it (int(inf) is an OverflowError, 2^64 overflows int32)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise GoldenError(f"{where}: {field} {shown(value)} is not an integer in [{low}, {high})")
    return value


def reply_logprob(value, field: str, where: str) -> float:  # -> a finite log-probability, <= 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value <= 0:
        raise GoldenError(f"{where}: {field} {shown(value)} is not a finite log-probability <= 0")
    return float(value)


@dataclass
class HttpLimits:
    connect: float = CONNECT_TIMEOUT_S   # seconds to open the connection
    read: float = REPLY_FLOOR_S          # seconds without a byte of the reply
    deadline: float = REPLY_FLOOR_S      # seconds for the whole request, however the bytes trickle
    max_bytes: int = REPLY_FLOOR_BYTES   # the reply's size


def reply_seconds(n_tokens: int) -> float:  # -> the default wait for a reply that runs n_tokens (see above)
    return REPLY_FLOOR_S + SECONDS_PER_TOKEN * n_tokens


def http_limits(args, n_items: int = 0, n_tokens: int = 0) -> HttpLimits:
    """-> the limits of a request whose reply lists n_items entries and runs n_tokens (prompt and
    generated): --read-timeout and --request-deadline when given, else reply_seconds(n_tokens)."""
    wait = reply_seconds(n_tokens)
    return HttpLimits(args.connect_timeout, args.read_timeout or wait, args.request_deadline or wait,
                      REPLY_FLOOR_BYTES + n_items * REPLY_ENTRY_BYTES)


def read_reply(reply, url: str, limit: int) -> bytes:  # -> the body, refused once it passes `limit` bytes
    length = reply.getheader("Content-Length")
    length = length if length and length.isascii() and length.isdigit() and len(length) < 20 else None
    if length and int(length) > limit:
        raise GoldenError(f"{url}: the reply says {length} bytes, more than the {limit} such a reply can need")
    data = reply.read(limit + 1)
    if len(data) > limit:
        raise GoldenError(f"{url}: the reply passes {limit} bytes, more than such a reply can need")
    if length and len(data) < int(length):  # read(n) returns what came before the close
        raise GoldenError(f"{url}: broken HTTP reply (IncompleteRead: {len(data)} of its {length} bytes)")
    return data


def http_bytes(url: str, body: dict | None, limits: HttpLimits) -> bytes:  # -> the body of a 200 reply
    """One request under separate connect and read timeouts, and a total deadline enforced by a
    timer that shuts the socket (a server sending a byte every few seconds never trips a read
    timeout). Every failure of the socket or of HTTP is a GoldenError naming the URL."""
    parts = urllib.parse.urlsplit(url)
    connection = (http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection)(
        parts.hostname, parts.port, timeout=limits.connect)
    expired = threading.Event()

    def expire():
        expired.set()
        if connection.sock is not None:
            connection.sock.shutdown(socket.SHUT_RDWR)
    timer = threading.Timer(limits.deadline, expire)
    timer.daemon = True
    timer.start()
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    data = None if body is None else json.dumps(body).encode("utf-8")
    try:
        connection.connect()
        connection.sock.settimeout(limits.read)
        connection.request("GET" if data is None else "POST", path, data, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        payload = read_reply(reply, url, limits.max_bytes)
        if expired.is_set():  # the socket shut mid-reply can also read as a short, clean end
            raise GoldenError("deadline")
    except (http.client.HTTPException, OSError, GoldenError) as e:
        if expired.is_set():  # whatever the cut reply looked like, the deadline cut it
            raise GoldenError(f"{url}: no whole reply within the deadline of {limits.deadline:g} s "
                              "(--request-deadline)") from None
        if isinstance(e, GoldenError):
            raise
        if isinstance(e, TimeoutError):
            which = "to connect" if connection.sock is None else "for a byte of the reply"
            option = "--connect-timeout" if connection.sock is None else "--read-timeout"
            wait = limits.connect if connection.sock is None else limits.read
            raise GoldenError(f"{url}: waited {wait:g} s {which} ({option})") from None
        if isinstance(e, http.client.HTTPException):
            raise GoldenError(f"{url}: broken HTTP reply ({type(e).__name__}: {ascii(str(e)[:80])})") from None
        raise GoldenError(f"{url}: {e.strerror or e}") from None
    finally:
        timer.cancel()
        connection.close()
    if reply.status != 200:
        raise GoldenError(f"{url}: HTTP {reply.status}: {payload[:200].decode('utf-8', 'replace')}")
    return payload


def http_json(url: str, body: dict | None = None, limits: HttpLimits = HttpLimits()):  # -> the reply's JSON value
    return artifacts.parse_json(http_bytes(url, body, limits), f"{url}: reply", GoldenError)


def json_object(value, url: str) -> dict:  # -> value, refused unless it is a JSON object
    if not isinstance(value, dict):
        raise GoldenError(f"{url}: the reply is a JSON {type(value).__name__}, not an object")
    return value
