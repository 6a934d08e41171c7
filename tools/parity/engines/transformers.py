"""--engine transformers: the Hugging Face model on CPU, float32, eager attention."""
from __future__ import annotations

import numpy as np

from tools.common import import_extra, sha256
from .base import Engine, check_checkpoint


def transformers_engine(args) -> Engine:
    ckpt = check_checkpoint(args.checkpoint)  # from_pretrained answers a wrong path with a 40-line OSError
    torch = import_extra("torch", "--engine transformers")
    transformers = import_extra("transformers", "--engine transformers")
    from transformers import AutoTokenizer, MuseGlimmerForConditionalGeneration

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

    def tokenize(text: str, first: bool) -> list[int]:
        nonlocal tokenizer
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(ckpt)
        return list(tokenizer(text, add_special_tokens=first)["input_ids"])

    return Engine(
        name="transformers",
        version=f"transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]})",
        model={"checkpoint": ckpt.name,
               "files": [{"file": w.name, "sha256": sha256(w)} for w in weights]},
        options={"dtype": "float32", "attn_implementation": "eager", "device": "cpu", "n_threads": threads,
                 "tokenize": "AutoTokenizer defaults (text prompts only)"},
        tokenize=tokenize, prefill=prefill, greedy=greedy, n_vocab=model.config.get_text_config().vocab_size,
    )
