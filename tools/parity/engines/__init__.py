"""The engines of tools.golden, one module each: ENGINES maps --engine to a function (args) -> Engine."""
from __future__ import annotations

import argparse
from typing import Callable

from tools.common import import_extra
from . import llama_cpp, llama_server, openai, reference, transformers
from .base import Engine, check_checkpoint, load_text_gguf

ENGINE_PACKAGES = {"llama-cpp": ("llama_cpp",), "transformers": ("torch", "transformers")}
ENGINE_NEEDS = {"reference": "model", "llama-cpp": "model", "transformers": "checkpoint"}


def preflight(args) -> None:
    """The checks of an engine's input files and lengths that load no engine: run before Ray workers
    load it, a bad model is one line here instead of a failed task per worker."""
    for module in ENGINE_PACKAGES.get(args.engine, ()):
        import_extra(module, f"--engine {args.engine}")
    if args.engine in ("reference", "llama-cpp"):
        load_text_gguf(args)
    elif args.engine == "transformers":
        check_checkpoint(args.checkpoint)


ENGINES: dict[str, Callable[[argparse.Namespace], Engine]] = {
    "reference": reference.reference_engine,
    "llama-cpp": llama_cpp.llama_cpp_engine,
    "llama-server": llama_server.llama_server_engine,
    "openai": openai.openai_engine,
    "transformers": transformers.transformers_engine,
}


def make_engine(args) -> Engine:  # -> the engine of --engine, keeping the rows --logits-positions asks for
    engine = ENGINES[args.engine](args)
    engine.beyond_train = args.beyond_n_ctx_train
    if args.logits_positions:
        engine.keep = (args.logits_positions, args.logits_topk)
        engine.options.update(logits_positions=args.logits_positions[0], logits_topk=args.logits_topk)
    return engine
