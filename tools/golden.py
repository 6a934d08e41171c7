"""Golden logits from the external engines (llama.cpp through llama-cpp-python, transformers).

    python -m tools.golden --engine llama-cpp --model M.gguf --prompts P.jsonl --out DIR \\
        [--kv-type f32|f16|q8_0] [--flash-attn on|off] [--n-predict N]
    python -m tools.golden --engine transformers --checkpoint HF_DIR --prompts P.jsonl --out DIR

P.jsonl holds one prompt a line: {"id": ..., "token_ids": [...]} or {"id": ..., "text": ...}.
For every prompt DIR gets <id>.npy, float32 [n_prompt_tokens, n_vocab]: the logits of every prompt
position from one prefill. With --n-predict N the greedy continuation (argmax, exactly N tokens,
no stop at end-of-generation tokens; llama-cpp also records the model's EOG ids and the index
of the first generated one) is recorded in the manifest, and <id>.decode.npy holds the
logits of its N-1 single-token decode steps (row i: after feeding generated token i).
DIR/manifest.json describes the run: model file and sha256, engine and version, options, date, and
per prompt its token ids and files. The engines sit in ENGINES; each is a function
(args) -> Engine.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

LLAMA_CPP_COMMIT = "0c1e570"  # vendored in llama-cpp-python 0.3.36


@dataclass
class Engine:
    name: str
    version: str
    model: dict                                   # file name, sha256 (never a machine path)
    options: dict
    tokenize: Callable[[str], list[int]]
    prefill: Callable[[list[int]], np.ndarray]    # ids -> float32 [n, n_vocab]
    # ids, n -> (generated ids, decode-step logits float32 [n-1, n_vocab])
    greedy: Callable[[list[int], int], tuple[list[int], np.ndarray]] | None = None
    extra: dict = field(default_factory=dict)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# llama.cpp

KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type ids


def llama_cpp_engine(args) -> Engine:
    import llama_cpp

    path = Path(args.model)
    threads = args.threads or os.cpu_count() or 1
    n_ubatch = args.n_ubatch

    def make(n_tokens: int):
        if n_tokens > n_ubatch:
            raise SystemExit(f"prompt of {n_tokens} tokens does not fit one ubatch of {n_ubatch}")
        return llama_cpp.Llama(
            model_path=str(path), n_ctx=args.n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch,
            logits_all=True, type_k=KV_TYPES[args.kv_type], type_v=KV_TYPES[args.kv_type],
            flash_attn=args.flash_attn == "on", n_threads=threads, n_threads_batch=threads,
            n_gpu_layers=0, seed=0, verbose=False,
        )

    def scores(llm, start: int, stop: int) -> np.ndarray:
        return np.array(llm.scores[start:stop], dtype=np.float32, copy=True)

    def prefill(ids: list[int]) -> np.ndarray:
        llm = make(len(ids))
        llm.eval(ids)  # one llama_decode: n_batch = n_ubatch >= len(ids)
        out = scores(llm, 0, len(ids))
        llm.close()
        return out

    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        llm = make(len(ids))
        llm.eval(ids)
        last = scores(llm, len(ids) - 1, len(ids))[0]
        gen, steps = [], []
        for i in range(n):
            gen.append(int(np.argmax(last)))
            if i == n - 1:
                break
            llm.eval([gen[-1]])
            last = scores(llm, len(ids) + i, len(ids) + i + 1)[0]
            steps.append(last)
        llm.close()
        return gen, np.array(steps, dtype=np.float32).reshape(len(steps), -1)

    vocab_llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = vocab_llm._model.vocab
    eog_ids = [i for i in range(vocab_llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]

    def tokenize(text: str) -> list[int]:
        return vocab_llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    return Engine(
        name="llama-cpp",
        version=f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
        model={"file": path.name, "sha256": sha256(path)},
        options={"kv_type": args.kv_type, "flash_attn": args.flash_attn, "n_ubatch": n_ubatch,
                 "n_batch": n_ubatch, "n_ctx": args.n_ctx, "n_threads": threads, "backend": "cpu",
                 "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                 "tokenize": "add_bos=True, special=True (text prompts only)"},
        tokenize=tokenize, prefill=prefill, greedy=greedy,
        extra={"eog_ids": eog_ids},
    )


# ---------------------------------------------------------------------------------------------
# transformers

def transformers_engine(args) -> Engine:
    import torch
    import transformers
    from transformers import AutoTokenizer, MuseGlimmerForConditionalGeneration

    ckpt = Path(args.checkpoint)
    threads = args.threads or 1  # one thread: torch's reductions then do not depend on the machine
    torch.set_num_threads(threads)
    model = MuseGlimmerForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    weights = sorted(ckpt.glob("*.safetensors"))

    @torch.no_grad()
    def prefill(ids: list[int]) -> np.ndarray:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        return logits.float().numpy().astype(np.float32)

    @torch.no_grad()
    def greedy(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        past, last = out.past_key_values, out.logits[0, -1]
        gen, steps = [], []
        for i in range(n):
            gen.append(int(torch.argmax(last)))
            if i == n - 1:
                break
            out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=past, use_cache=True)
            past, last = out.past_key_values, out.logits[0, -1]
            steps.append(last.float().numpy())
        return gen, np.array(steps, dtype=np.float32).reshape(len(steps), -1)

    tokenizer = None

    def tokenize(text: str) -> list[int]:
        nonlocal tokenizer
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(ckpt)
        return list(tokenizer(text)["input_ids"])

    return Engine(
        name="transformers",
        version=f"transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]})",
        model={"checkpoint": ckpt.name,
               "files": [{"file": w.name, "sha256": sha256(w)} for w in weights]},
        options={"dtype": "float32", "attn_implementation": "eager", "device": "cpu", "n_threads": threads,
                 "tokenize": "AutoTokenizer defaults (text prompts only)"},
        tokenize=tokenize, prefill=prefill, greedy=greedy,
    )


ENGINES: dict[str, Callable[[argparse.Namespace], Engine]] = {
    "llama-cpp": llama_cpp_engine,
    "transformers": transformers_engine,
}


# ---------------------------------------------------------------------------------------------

def read_prompts(path: Path) -> list[dict]:
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        p = json.loads(line)
        if "id" not in p or ("token_ids" in p) == ("text" in p):
            raise SystemExit(f"{path}:{n}: need an id and exactly one of token_ids or text")
        pid = str(p["id"])
        if not pid or Path(pid).name != pid or pid.startswith("."):
            raise SystemExit(f"{path}:{n}: prompt id {pid!r} is not a plain file name")
        prompts.append(p)
    return prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, choices=sorted(ENGINES))
    ap.add_argument("--model", help="GGUF file (llama-cpp)")
    ap.add_argument("--checkpoint", help="HF checkpoint directory (transformers)")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f16")
    ap.add_argument("--flash-attn", choices=["on", "off"], default="off")
    ap.add_argument("--n-predict", type=int, default=0, help="greedy continuation length (0: none)")
    ap.add_argument("--n-ubatch", type=int, default=512, help="llama.cpp n_batch = n_ubatch")
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0,
                    help="0: all cores for llama-cpp (results do not depend on it), 1 for transformers")
    args = ap.parse_args(argv)
    need = {"llama-cpp": "model", "transformers": "checkpoint"}.get(args.engine)
    if need and not getattr(args, need):
        ap.error(f"--engine {args.engine} needs --{need}")

    from tqdm import tqdm

    prompts = read_prompts(args.prompts)
    engine = ENGINES[args.engine](args)
    args.out.mkdir(parents=True, exist_ok=True)
    entries = []
    for p in tqdm(prompts, desc=f"{engine.name} {args.out.name}", unit="prompt"):
        ids = [int(t) for t in p["token_ids"]] if "token_ids" in p else engine.tokenize(p["text"])
        logits = engine.prefill(ids)
        if logits.shape[0] != len(ids) or not np.isfinite(logits).all():
            raise SystemExit(f"prompt {p['id']}: bad logits {logits.shape}")
        np.save(args.out / f"{p['id']}.npy", logits, allow_pickle=False)
        entry = {"id": str(p["id"]), "file": f"{p['id']}.npy", "shape": list(logits.shape),
                 "token_ids": ids}
        if "text" in p:
            entry["text"] = p["text"]
        if args.n_predict > 0:
            gen, steps = engine.greedy(ids, args.n_predict)
            np.save(args.out / f"{p['id']}.decode.npy", steps, allow_pickle=False)
            entry["greedy"] = {"n_predict": args.n_predict, "stop_at_eog": False, "tokens": gen,
                               "decode_logits": f"{p['id']}.decode.npy"}
            if "eog_ids" in engine.extra:
                eog = [i for i, t in enumerate(gen) if t in engine.extra["eog_ids"]]
                entry["greedy"]["first_eog_index"] = eog[0] if eog else None
        entries.append(entry)

    manifest = {
        "engine": engine.name, "version": engine.version, "model": engine.model,
        "options": engine.options, "prompts_file": args.prompts.name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "logits": "float32 [n_prompt_tokens, n_vocab], all positions of one prefill",
        "entries": entries, **engine.extra,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
