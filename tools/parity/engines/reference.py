"""--engine reference: this project's own forward (its goldens say so: "self_made")."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tools.common import REPO, GoldenError, sha256
from .base import Engine, greedy_steps, load_text_gguf

TEXT_SOURCES = ("gguf", "ops", "kv", "text", "backend", "trace", "tokenizer")  # what a reference golden runs


def reference_engine(args) -> Engine:
    from reference import factory
    from reference.cli import UsageError, build_of
    from reference.ggml_cpu import GgmlCpuError
    from reference.provenance import numerics_record
    from reference.tokenizer import Tokenizer, TokenizerError

    path = Path(args.model)
    model = load_text_gguf(args)
    try:
        build = build_of(args)
        lm = factory.text_model(model, build)
    except (factory.FactoryError, UsageError, GgmlCpuError) as e:
        raise GoldenError(str(e)) from None
    kind, chunk = factory.cache_layout(build, args.kv, args.ubatch_size)
    try:
        tokenizer = Tokenizer(model.tokenizer)
    except TokenizerError as e:
        raise GoldenError(f"{path}: {e}") from None

    def tokenize(text: str, first: bool) -> list[int]:
        try:
            # by its bytes first: a text past the training context (or memory) never reaches the pre-tokenizer
            limit = None if args.beyond_n_ctx_train else model.config.n_ctx_train or None
            return tokenizer.tokenize(text, add_special=first, parse_special=True, max_tokens=limit)
        except TokenizerError as e:  # such as a vocabulary that asks for BOS but has none
            raise GoldenError(f"{path}: {e}") from None

    def new_cache(n: int):
        return lm.new_cache(n, kind, chunk)

    def prefill(ids: list[int]) -> np.ndarray:
        return lm.prefill(ids, new_cache(len(ids)), chunk)

    def rows(ids: list[int], positions: np.ndarray) -> np.ndarray:
        # one prefill chunk of logits at a time: a 16K prompt at a 202048 vocabulary never holds 13 GB
        cache, kept = new_cache(len(ids)), []
        for start in range(0, len(ids), chunk):
            logits = lm.prefill(ids[start:start + chunk], cache, chunk)
            at = positions[(positions >= start) & (positions < start + len(logits))]
            kept.append(logits[at - start].astype(np.float32))
        return np.concatenate(kept)

    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        cache = new_cache(len(ids) + n)
        return greedy_steps(lm.prefill(ids, cache, chunk)[-1], n,
                            lambda token: lm.prefill([token], cache)[-1], lm.dtype)

    sources = [REPO / "reference" / f"{name}.py" for name in TEXT_SOURCES]
    source_hash = hashlib.sha256(b"".join(s.name.encode() + s.read_bytes() for s in sources)).hexdigest()
    return Engine(
        name="reference",
        version=f"muse-glimmer reference (sha256 of reference/{{{','.join(TEXT_SOURCES)}}}.py {source_hash[:16]})",
        model={"file": path.name, "sha256": sha256(path)},
        options={"dtype": build.dtype, "kv": kind, "prefill_chunk": chunk, "backend": build.backend,
                 **numerics_record(build, lm.backend), "tokenize": "reference.tokenizer, BOS and special tokens parsed"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, rows=rows, n_vocab=model.config.n_vocab,
        n_ctx_train=model.config.n_ctx_train,
        extra={"self_made": True,
               "independent": "no: made by this project's reference; an oracle for engines, never a "
                              "golden that tests the reference itself"},
    )
