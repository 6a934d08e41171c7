"""--engine transformers: the Hugging Face model on CPU, float32, eager attention."""
from __future__ import annotations

import numpy as np

from tools.common import import_extra, sha256
from .base import Engine, check_checkpoint, greedy_steps


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
        past = out.past_key_values

        def step(token: int) -> np.ndarray:
            nonlocal past
            out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            return out.logits[0, -1].float().numpy()
        return greedy_steps(out.logits[0, -1].float().numpy(), n, step)

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
