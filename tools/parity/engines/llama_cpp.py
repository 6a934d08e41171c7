"""--engine llama-cpp: llama.cpp in this process, through llama-cpp-python's bindings."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tools.common import KV_TYPES, LLAMA_CPP_COMMIT, GoldenError, import_extra, plain_cpu_buffers, sha256, silence_llama_cpp
from reference.cli import cache_types, flash_choice, repack_choice
from .base import Engine, greedy_steps, load_text_gguf


def scores(llm, start: int, stop: int) -> np.ndarray:  # -> float32 [stop - start, n_vocab], a copy of llm's rows
    return np.array(llm.scores[start:stop], dtype=np.float32, copy=True)


def vocabulary(llama_cpp, path: Path):  # -> (a vocab-only Llama, the ids llama.cpp ends generation at)
    try:
        vocab_llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    except ValueError as e:  # a GGUF the reference reads but this llama.cpp does not
        raise GoldenError(f"{path}: llama.cpp cannot load it ({e})") from None
    vocab = vocab_llm._model.vocab
    return vocab_llm, [i for i in range(vocab_llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def llama_cpp_engine(args) -> Engine:
    path = Path(args.model)
    n_train = load_text_gguf(args).config.n_ctx_train  # llama.cpp answers a truncated file or a projector with a ValueError and log lines
    llama_cpp = import_extra("llama_cpp", "--engine llama-cpp")
    silence_llama_cpp(llama_cpp)
    repack = repack_choice(args) is not False
    if not repack:
        plain_cpu_buffers(llama_cpp.llama_cpp)
    threads = args.threads or os.cpu_count() or 1
    n_ubatch = args.ubatch_size
    type_k, type_v = cache_types(args)
    flash = flash_choice(args, "off")  # llama-cpp-python's default; auto is on for a CPU build

    def make():
        return llama_cpp.Llama(
            model_path=str(path), n_ctx=args.ctx_size, n_batch=n_ubatch, n_ubatch=n_ubatch,
            logits_all=True, type_k=KV_TYPES[type_k], type_v=KV_TYPES[type_v],
            flash_attn=flash, n_threads=threads, n_threads_batch=threads,
            n_gpu_layers=0, seed=0, verbose=False,
        )

    def prefill(ids: list[int]) -> np.ndarray:
        llm = make()
        llm.eval(ids)  # one llama_decode: n_batch = n_ubatch >= len(ids) (Engine.max_batch)
        out = scores(llm, 0, len(ids))
        llm.close()
        return out

    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        llm = make()
        llm.eval(ids)

        def step(token: int) -> np.ndarray:  # -> the row of the position the token was fed at
            llm.eval([token])
            return scores(llm, llm.n_tokens - 1, llm.n_tokens)[0]
        out = greedy_steps(scores(llm, len(ids) - 1, len(ids))[0], n, step)
        llm.close()
        return out

    vocab_llm, eog_ids = vocabulary(llama_cpp, path)
    return Engine(
        name="llama-cpp",
        version=f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
        model={"file": path.name, "sha256": sha256(path)},
        options={"kv_type": type_k if type_k == type_v else None, "cache_type_k": type_k, "cache_type_v": type_v,
                 "flash_attn": "on" if flash else "off", "repack": repack, "n_ubatch": n_ubatch,
                 "n_batch": n_ubatch, "n_ctx": args.ctx_size, "n_threads": threads, "backend": "cpu",
                 "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                 "tokenize": "add_bos=True, special=True (text prompts only)"},
        tokenize=lambda text, first: vocab_llm.tokenize(text.encode("utf-8"), add_bos=first, special=True),
        prefill=prefill, greedy=greedy, n_vocab=vocab_llm.n_vocab(),
        n_ctx=args.ctx_size, n_ctx_train=n_train, max_batch=n_ubatch, extra={"eog_ids": eog_ids},
    )
