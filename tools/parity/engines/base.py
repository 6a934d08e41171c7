"""What every engine of tools.golden is: an Engine, and the checks of its input files that load no engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from reference.cli import check_train_context
from tools.common import GoldenError

TOPK_FORMAT = ("<id>.topk.npz: prompt_ids int32 [n_prompt]; tokens int32 [n_gen], the greedy tokens; "
               "positions int32 [n], top_ids int32 [n, k] and top_logprobs float32 [n, k]: for generated token "
               "positions[r], the k most probable tokens (best first) of the full softmax of the raw logits "
               "that chose it, i.e. at position n_prompt - 1 + positions[r] of prompt_ids + tokens. "
               "llama-server reports no probabilities for a token after which the text ends in an "
               "incomplete UTF-8 character: such tokens have no row")


@dataclass
class Engine:
    name: str
    version: str
    model: dict                                   # file name, sha256 (never a machine path)
    options: dict
    tokenize: Callable[[str, bool], list[int]]    # text, whether it starts a sequence (BOS) -> ids
    prefill: Callable[[list[int]], np.ndarray] | None = None     # ids -> float32 [n, n_vocab]
    # ids, n -> (generated ids, decode-step logits float32 [n-1, n_vocab])
    greedy: Callable[[list[int], int], tuple[list[int], np.ndarray]] | None = None
    topk: Callable[[list[int], int], dict] | None = None          # ids, n -> the arrays of TOPK_FORMAT
    # ids, positions int64 [m] -> float32 [m, n_vocab], the rows of a prefill at those positions, without
    # holding all of them at once (default: prefill's rows)
    rows: Callable[[list[int], np.ndarray], np.ndarray] | None = None
    keep: tuple | None = None     # (--logits-positions spec, --logits-topk k or None), set by make_engine
    n_vocab: int | None = None                                    # to refuse token ids out of range
    n_ctx: int | None = None      # positions one sequence may take (prompt, continuation, generated)
    n_ctx_train: int | None = None  # the model's training context: longer sequences need --beyond-n-ctx-train
    beyond_train: bool = False      # --beyond-n-ctx-train, set by make_engine
    max_batch: int | None = None  # tokens one forward may take
    # prompt id, ids holding one <|video|> per video, the prompt's "videos" (tools.golden read_videos_field)
    # -> (the ids with each video expanded, the engine whose prefill, rows and greedy run those ids with
    # the videos' rows, a record of each video); None: the engine takes no videos
    with_videos: Callable[[str, list[int], list[dict]], tuple[list[int], "Engine", list[dict]]] | None = None
    extra: dict = field(default_factory=dict)


def is_token_list(value) -> bool:  # JSON true/false are Python ints: refuse them by name
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def load_text_gguf(args):  # -> --model as a validated reference.gguf text model
    """Also checks the lengths asked for against the model's training context: past it a golden means
    nothing, and llama.cpp allocates its KV cache and logits for all of --n-ctx."""
    from reference import gguf

    try:
        model = gguf.load(args.model, "text")
    except gguf.GGUFError as e:
        raise GoldenError(str(e)) from None
    n_train = model.config.n_ctx_train
    check_train_context(args.n_predict, n_train, "--n-predict", args.model, args.beyond_n_ctx_train, GoldenError)
    if args.engine == "llama-cpp":
        check_train_context(args.ctx_size, n_train, "--ctx-size", args.model, args.beyond_n_ctx_train, GoldenError)
    return model


def model_vocab(path) -> int:  # -> the vocabulary of a text GGUF: what a server serving it may report
    from reference import gguf

    try:
        return gguf.load(path, "text").config.n_vocab
    except gguf.GGUFError as e:
        raise GoldenError(str(e)) from None


def check_checkpoint(checkpoint: str) -> Path:  # -> the directory, once it looks like an HF checkpoint
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise GoldenError(f"{ckpt}: not a Hugging Face checkpoint directory (no config.json)")
    return ckpt


def greedy_steps(last: np.ndarray, n: int, step: Callable, dtype=np.float32) -> tuple[list[int], np.ndarray]:
    """last [n_vocab], the prefill's last row; step(token) -> the row after feeding it -> (n greedy ids,
    the n-1 decode steps' rows [n-1, n_vocab]). Exactly n tokens and no stop at EOG, so that every
    engine's goldens have the same length (reference.run's decode_greedy stops)."""
    gen, steps = [int(np.argmax(last))], []
    while len(gen) < n:
        steps.append(step(gen[-1]))
        gen.append(int(np.argmax(steps[-1])))
    return gen, np.array(steps, dtype=dtype).reshape(len(steps), len(last))  # [0, n_vocab] for n = 1
