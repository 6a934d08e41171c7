"""`python -m reference.serve`: the reference behind the HTTP APIs engines and harnesses speak.

    python -m reference.serve -m M.gguf [-md DRAFT.gguf] [--host 127.0.0.1] [--port 8080] [--api-key KEY] \\
        [--backend numpy|numba|cupy] [--numerics exact|ggml-cpu] [--kv-type T] [--flash-attn on|off] ...

llama-server's /completion, /tokenize, /detokenize, /apply-template, /props, /health, /v1/models;
OpenAI's /v1/completions (echo, logprobs; vLLM's prompt_logprobs, return_tokens_as_token_ids) and
/v1/chat/completions (image parts as data: URLs with --mmproj); SGLang's /generate; vLLM's /tokenizer_info; a page at /. Greedy only: a request
that asks for sampling is refused. Every log-probability is the log-softmax of the float32 logit row
of the exact forward, as tools.golden computes it, and no prefix is reused between requests. One
forward at a time behind a bounded queue (--queue; past it 503 with Retry-After), each request within
--timeout seconds. SIGINT or SIGTERM finishes the running request and exits 0. With -md/--model-draft
(a DFlash drafter) text prompts are decoded speculatively: the same tokens and log-probabilities.
"""
import argparse
import asyncio
import logging
import os
import sys

from .. import factory, gguf, kv, run
from ..cli import OneLineParser, build_of, exit_status, flag, float_in, int_in
from ..factory import FactoryError
from ..ggml_cpu import GgmlCpuError
from ..kv import CacheError
from ..tokenizer import TokenizerError
from ..vision import check_compatible
from .oracle import Oracle, context_size

DEFAULT_PORT = 8080           # llama-server's
DEFAULT_TIMEOUT_S = 600.0     # llama-server's -to, --timeout
DEFAULT_QUEUE = 64            # requests waiting or running
DEFAULT_BODY_BYTES = 1 << 24  # a 16 MiB body: a prompt of millions of tokens as JSON
DEFAULT_MAX_LOGPROBS = 20     # vLLM's --max-logprobs
DEFAULT_IMAGES = 8
DEFAULT_IMAGE_BYTES = 1 << 23  # 8 MiB: a large PNG


def build_parser():  # -> the parser: llama-server's flag names, reference.run's numerics flags
    p = OneLineParser(prog="python -m reference.serve", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    flag(p, "model", help="text GGUF (default: the embedded tiny model in golden/models)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_in(0, 65535), default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--api-key", help="every endpoint but /health and / then needs 'Authorization: Bearer KEY'")
    p.add_argument("-to", "--timeout", type=float_in(0.001, 1e6), default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a request may take, its wait in the queue included (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--queue", type=int_in(1, 1 << 20), default=DEFAULT_QUEUE,
                   help=f"requests waiting or running; past it 503 with Retry-After (default {DEFAULT_QUEUE})")
    p.add_argument("--max-body-bytes", type=int_in(1, 1 << 40), default=DEFAULT_BODY_BYTES,
                   help=f"largest request body (default {DEFAULT_BODY_BYTES})")
    p.add_argument("--max-logprobs", type=int_in(0, run.MAX_TOP_K), default=DEFAULT_MAX_LOGPROBS,
                   help="largest n_probs, logprobs, top_logprobs, prompt_logprobs, top_logprobs_num "
                        f"(vLLM's, default {DEFAULT_MAX_LOGPROBS})")
    p.add_argument("--max-images", type=int_in(0, 1 << 10), default=DEFAULT_IMAGES,
                   help=f"image parts in one request (default {DEFAULT_IMAGES})")
    p.add_argument("--max-image-bytes", type=int_in(1, 1 << 40), default=DEFAULT_IMAGE_BYTES,
                   help=f"one image's encoded bytes (default {DEFAULT_IMAGE_BYTES})")
    run.add_tower_flags(p)
    run.add_draft_flags(p)
    run.add_compute_flags(p)  # --ctx (default: the training context) caps prompt + generation
    return p


def load_oracle(args):  # -> (Oracle, what /props says of the model)
    build = build_of(args)
    factory.check(build)
    path = run.model_path(args)
    for given in (path, args.model_draft):
        if given is not None:
            gguf.check_file(given)
    for warning in factory.host_warnings(build):
        print(f"reference.serve: warning: {warning}", file=sys.stderr)
    for note in factory.auto_notes(build):
        print(f"reference.serve: {note}", file=sys.stderr)
    backend = factory.backend(build)
    model = gguf.load(path, "text")
    layout = factory.cache_layout(build, args.kv, run.prefill_chunk(args))
    n_ctx = context_size(model.config, args.ctx_size, path, args.beyond_n_ctx_train)
    kv.check_fits(model.config, n_ctx, *layout, args.dtype, f"a context of {n_ctx} tokens (-c/--ctx-size)")
    lm = factory.text_model(model, build, backend)
    drafter = run.load_drafter(args, lm, lambda line: print(f"reference.serve: warning: {line}", file=sys.stderr))
    vision = None
    if args.mmproj:
        gguf.check_file(args.mmproj)
        vision = factory.vision_model(gguf.load(args.mmproj, "mmproj"), build, lm.backend)
        check_compatible(vision, lm.cfg, path)
    props = {"model_path": os.path.basename(path), "size": os.path.getsize(path),
             "ftype": model.meta.int("general.file_type", default=-1),
             "vision": vision is not None, "numerics": {"backend": args.backend, "numerics": args.numerics, "dtype": args.dtype, "kv": layout[0],
                          "prefill_chunk": layout[1], "kv_type": build.kv_type, "cache_type_v": build.v_type or build.kv_type,
                          "flash_attn": args.flash_attn,
                          "cpu": args.cpu},
             "model_draft": os.path.basename(args.model_draft) if drafter else None}
    return Oracle(lm, model.tokenizer, os.path.basename(path), layout, n_ctx, vision, args.image_max_tokens, drafter,
                  args.spec_draft_n_max, args.spec_draft_p_min), props


class OneSendPerTurn:
    """A transport that joins what is written in one turn of the event loop into one send. uvicorn writes
    a response's head and its body separately, and each send wakes the client: two wake-ups (on a busy
    machine, two waits for a core) for one answer."""

    def __init__(self, transport, loop):
        self.transport, self.loop, self.pending = transport, loop, []

    def write(self, data):
        if not self.pending:
            self.loop.call_soon(self.flush)
        self.pending.append(data)

    def flush(self):
        if self.pending and not self.transport.is_closing():
            self.transport.write(b"".join(self.pending))
        self.pending.clear()

    def close(self):
        self.flush()
        self.transport.close()

    def __getattr__(self, name):  # the rest is the transport's
        return getattr(self.transport, name)


def uvicorn_server(app, args):  # -> a uvicorn.Server that exits 0 on SIGINT/SIGTERM once its requests are done
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # uvicorn would re-raise the signal after its graceful shutdown
            self.should_exit = True

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(OneSendPerTurn(transport, asyncio.get_running_loop()))

    return Server(uvicorn.Config(app, host=args.host, port=args.port, http=Protocol, log_level="info",
                                 access_log=True))


def serve(args):  # -> exit status
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise FactoryError(f"reference.serve needs FastAPI and uvicorn ({e}); install the serve extra") from None
    from .app import create_app
    from .served import Limits, Served

    oracle, props = load_oracle(args)
    limits = Limits(args.queue, args.max_body_bytes, args.max_logprobs, args.timeout, args.max_images,
                    args.max_image_bytes)
    served = Served(oracle, limits, props)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    try:
        uvicorn_server(create_app(served, args.api_key), args).run()
    finally:
        served.queue.close()
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    return exit_status("reference.serve", lambda: serve(args),
                       (gguf.GGUFError, CacheError, TokenizerError, GgmlCpuError, FactoryError))
