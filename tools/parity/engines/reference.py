"""--engine reference: this project's own forward (its goldens say so: "self_made")."""
from __future__ import annotations

import hashlib
from dataclasses import replace
from functools import cache as once, partial
from pathlib import Path

import numpy as np

from tools.common import REPO, GoldenError, sha256
from .base import Engine, greedy_steps, load_text_gguf

TEXT_SOURCES = ("gguf", "ops", "kv", "text", "backend", "trace", "tokenizer")  # what a reference golden runs
VIDEO_SOURCES = ("vision", "video", "image", "chat")  # and, with --mmproj, its video path


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

    prefill, rows, greedy = runs(lm, new_cache, chunk, lambda ids: ids)
    with_videos = video_binding(args, lm, tokenizer, build, new_cache, chunk)
    sources = [REPO / "reference" / f"{name}.py" for name in TEXT_SOURCES + (VIDEO_SOURCES if with_videos else ())]
    source_hash = hashlib.sha256(b"".join(s.name.encode() + s.read_bytes() for s in sources)).hexdigest()
    engine = Engine(
        name="reference",
        version=f"muse-glimmer reference (sha256 of reference/{{{','.join(s.stem for s in sources)}}}.py "
                f"{source_hash[:16]})",
        model={"file": path.name, "sha256": sha256(path)},
        options={"dtype": build.dtype, "kv": kind, "prefill_chunk": chunk, "backend": build.backend,
                 **numerics_record(build, lm.backend), "tokenize": "reference.tokenizer, BOS and special tokens parsed"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, rows=rows, n_vocab=model.config.n_vocab,
        n_ctx_train=model.config.n_ctx_train,
        extra={"self_made": True,
               "independent": "no: made by this project's reference; an oracle for engines, never a "
                              "golden that tests the reference itself"},
    )
    if with_videos:
        engine.model["mmproj"] = {"file": Path(args.mmproj).name, "sha256": sha256(args.mmproj)}
        engine.with_videos = partial(with_videos, engine)
    return engine


def runs(lm, new_cache, chunk, inputs):  # inputs(ids) -> token ids or embedding rows [T, E]; -> prefill, rows, greedy
    def forward(x, cache):  # token ids or rows [T, E] -> logits [T, V]
        if isinstance(x, np.ndarray) and x.ndim == 2:
            return lm.prefill_embeddings(x, cache, chunk)
        return lm.prefill(x, cache, chunk)

    def prefill(ids: list[int]) -> np.ndarray:
        return forward(inputs(ids), new_cache(len(ids)))

    def rows(ids: list[int], positions: np.ndarray) -> np.ndarray:
        # one prefill chunk of logits at a time: a 16K prompt at a 202048 vocabulary never holds 13 GB
        x, cache, kept = inputs(ids), new_cache(len(ids)), []
        for start in range(0, len(ids), chunk):
            logits = forward(x[start:start + chunk], cache)
            at = positions[(positions >= start) & (positions < start + len(logits))]
            kept.append(logits[at - start].astype(np.float32))
        return np.concatenate(kept)

    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        cache = new_cache(len(ids) + n)
        return greedy_steps(forward(inputs(ids), cache)[-1], n, lambda token: lm.prefill([token], cache)[-1], lm.dtype)
    return prefill, rows, greedy


def video_binding(args, lm, tokenizer, build, new_cache, chunk):  # -> with_videos(engine, pid, ids, videos), or None
    """With --mmproj: a prompt's videos read as reference.run --video reads them, expanded as
    transformers' processor expands them; their rows come from the tower per frame pair, once."""
    if not args.mmproj:
        return None
    from reference import factory, gguf
    from reference.chat import VIDEO_PLACEHOLDER, ChatError, expand_videos, token_id
    from reference.run import read_video
    from reference.video import VideoError
    from reference.vision import check_compatible, check_video_extension

    if build.numerics != "exact":
        raise GoldenError("--mmproj: videos run with --numerics exact only (llama.cpp has no video graph to model)")
    try:
        mmproj = gguf.load(args.mmproj, "mmproj")
        check_video_extension(args.mmproj, mmproj.config, mmproj.tensors)
        vision = factory.vision_model(mmproj, build, lm.backend)
        check_compatible(vision, lm.cfg, args.model)
        placeholder = token_id(lm.tokenizer, VIDEO_PLACEHOLDER)
    except (gguf.GGUFError, factory.FactoryError, ChatError) as e:
        raise GoldenError(f"--mmproj: {e}" if isinstance(e, ChatError) else str(e)) from None

    def with_videos(engine, pid, ids, videos):
        try:
            read = [read_video(v["file"], v["fps"], mmproj.config) for v in videos]
            expanded = expand_videos(ids, tokenizer, [(stamps, p.grid[0] * p.grid[1]) for p, stamps in read])
        except (VideoError, ChatError) as e:
            raise GoldenError(f"prompt {pid}: {e}") from None
        video_rows = once(lambda: np.concatenate([vision.encode_video(p) for p, _ in read]))

        def inputs(seq: list[int]) -> np.ndarray:  # the expanded prompt (+ tokens after it) -> rows [T, E]
            x = np.asarray(seq)
            if seq[:len(expanded)] != expanded or np.count_nonzero(x == placeholder) != expanded.count(placeholder):
                raise GoldenError(f"prompt {pid}: a continuation holds {VIDEO_PLACEHOLDER}, which has no video")
            rows = lm.embed(x)
            rows[x == placeholder] = video_rows().astype(rows.dtype)
            return rows
        prefill, rows, greedy = runs(lm, new_cache, chunk, inputs)
        record = [{"path": v["path"], "fps": v["fps"], "indices": p.indices.tolist(), "timestamps": stamps,
                   "grid_thw": [len(p.pairs), p.grid[0] * mmproj.config.merge_size, p.grid[1] * mmproj.config.merge_size]}
                  for v, (p, stamps) in zip(videos, read)]
        return expanded, replace(engine, prefill=prefill, rows=rows, greedy=greedy, with_videos=None), record
    return with_videos
