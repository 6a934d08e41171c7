"""Goldens for the DFlash drafter: block logits of transformers' MuseGlimmerAssistantModel on the
tiny drafter and its tiny target, in llama.cpp's block convention.

    python -m tools.make_dflash_goldens --checkpoints build/tiny [--out golden/dflash]

For a prompt and its greedy continuation S (the transformers target), a case holds, for every pos0
in its range, the logits of one drafter forward over the block [S[pos0], MASK x n_max] at positions
pos0 .. pos0 + n_max, with the target's hidden states of S[:pos0] as context (a fresh DFlashCache):
exactly what the drafter sees when it drafts after S[:pos0] is committed, whatever happened before.
<case>.npy is float32 [n_pos0, n_max + 1, n_vocab]; row 0 is the anchor's row (llama.cpp and
transformers drop it). Logits are the target's lm_head on the drafter's last hidden state, with no
output multiplier and no softcap, as transformers' DFlashTokenCandidateGenerator computes them.

Two deliberate departures from transformers' own generate loop, both to follow llama.cpp:
- the block has n_max + 1 rows (llama.cpp's --spec-draft-n-max), not always block_size;
- sliding-window layers: transformers keeps |q - k| <= sliding_window, llama.cpp q - k < n_swa. The
  drafter is loaded with sliding_window = n_swa - 1 so both rules select the same rows; the case
  with window "transformers" keeps transformers' own rule (it differs once the context is longer
  than the window). llama.cpp's rule is one-sided (a later block row is never hidden), transformers'
  symmetric, so the two agree only while the block is shorter than the window: n_max < n_swa.
<prompt>.g.npy holds the encoder output g = RMSNorm(fc(features)) for every context row of S.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tools.common import REPO, sha256, today

from tools.parity.golden import read_prompts

TARGET, DRAFTER = "tiny-a", "tiny-a-dflash"
GGUFS = {"target": "tiny-a-f32.gguf", "drafter": "tiny-a-dflash-f32.gguf"}

# (case id, prompt id, greedy tokens after the prompt, n_max, number of pos0 (None: all), window rule)
CASES = [
    ("len1-n3", "len1", 12, 3, None, "llama.cpp"),
    ("len7-n3", "len7", 24, 3, None, "llama.cpp"),
    ("len7-n1", "len7", 24, 1, None, "llama.cpp"),
    ("len33-n3", "len33", 16, 3, None, "llama.cpp"),
    ("len33-n7", "len33", 16, 7, 8, "llama.cpp"),
    ("len33-n3-hf-window", "len33", 16, 3, 8, "transformers"),
]


def load_models(checkpoints: Path):
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, MuseGlimmerForConditionalGeneration

    target = MuseGlimmerForConditionalGeneration.from_pretrained(
        checkpoints / TARGET, dtype=torch.float64, attn_implementation="eager").eval()
    window = MuseGlimmerAssistantConfig.from_pretrained(checkpoints / DRAFTER).sliding_window
    drafters = {
        "transformers": MuseGlimmerAssistantModel.from_pretrained(
            checkpoints / DRAFTER, dtype=torch.float64, attn_implementation="eager").eval(),
        "llama.cpp": MuseGlimmerAssistantModel.from_pretrained(
            checkpoints / DRAFTER, dtype=torch.float64, attn_implementation="eager",
            sliding_window=window - 1).eval(),
    }
    return target, drafters, window


def greedy(target, ids: list[int], n: int) -> list[int]:  # n argmax tokens, no stop at end-of-generation
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(torch.argmax(target(input_ids=torch.tensor([seq])).logits[0, -1])))
    return seq[len(ids):]


def context_features(target, drafter, seq: list[int]):  # -> [1, len(seq), n_target_layers * E]
    import torch

    with torch.no_grad():
        hidden = target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    # hidden_states[0] is the embedding, [i + 1] the output of layer i (= input of GGUF layer i + 1)
    return torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)


def draft_logits(target, drafter, features, anchor: int, pos0: int, n_max: int) -> np.ndarray:
    import torch
    from transformers import GenerationConfig
    from transformers.cache_utils import DFlashCache
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    generator = DFlashTokenCandidateGenerator(drafter, target.get_input_embeddings(), target.get_output_embeddings(),
                                              GenerationConfig(max_length=4096))
    mask = drafter.config.mask_token_id
    with torch.no_grad():
        noise = generator._get_noise_embeds(torch.tensor([[anchor] + [mask] * n_max]))  # raw rows, no embed_norm
        cache = DFlashCache(config=drafter.config)
        cache.set_previous_accepted_tokens(pos0)
        out = drafter(noise_embeds=noise, context_hidden_states=features[:, :pos0],
                      position_ids=torch.arange(pos0 + n_max + 1)[None], past_key_values=cache)
        return target.get_output_embeddings()(out.last_hidden_state)[0].numpy().astype(np.float32)


def encoder_output(drafter, features) -> np.ndarray:  # -> float32 [n, E]
    import torch

    with torch.no_grad():
        return drafter.encoder(features)[0].numpy().astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=Path, required=True, help="HF checkpoint dirs (tools.make_tiny --work)")
    ap.add_argument("--prompts", type=Path, default=REPO / "golden" / "prompts" / "text.jsonl")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "dflash")
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(1)
    target, drafters, window = load_models(args.checkpoints)
    prompts = {p["id"]: p["token_ids"] for p in read_prompts(args.prompts) if "token_ids" in p}
    args.out.mkdir(parents=True, exist_ok=True)
    sequences, cases = {}, []
    for case_id, prompt_id, n_gen, n_max, n_pos0, rule in CASES:
        prompt = prompts[prompt_id]
        if prompt_id not in sequences:
            seq = prompt + greedy(target, prompt, n_gen)
            feats = context_features(target, drafters["llama.cpp"], seq[:-1])
            np.save(args.out / f"{prompt_id}.g.npy", encoder_output(drafters["llama.cpp"], feats), allow_pickle=False)
            sequences[prompt_id] = (seq, feats)
        seq, feats = sequences[prompt_id]
        pos0s = list(range(len(prompt), len(seq)))[:n_pos0]
        logits = np.stack([draft_logits(target, drafters[rule], feats, seq[p], p, n_max) for p in pos0s])
        np.save(args.out / f"{case_id}.npy", logits, allow_pickle=False)
        cases.append({"id": case_id, "file": f"{case_id}.npy", "shape": list(logits.shape), "prompt": prompt_id,
                      "n_max": n_max, "pos0": pos0s, "window_rule": rule})
        print(f"{case_id}: {logits.shape}", flush=True)

    models = REPO / "golden" / "models"
    manifest = {
        "engine": "transformers",
        "version": f"transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]})",
        "model": {"target": TARGET, "drafter": DRAFTER,
                  "files": [{"file": w.name, "checkpoint": c, "sha256": sha256(w)}
                            for c in (TARGET, DRAFTER) for w in sorted((args.checkpoints / c).glob("*.safetensors"))],
                  "gguf": {role: {"file": f, "sha256": sha256(models / f)} for role, f in GGUFS.items()}},
        "options": {"dtype": "float64 (transformers runs RMSNorm, softmax and RoPE angles in float32 inside)",
                    "attn_implementation": "eager", "device": "cpu", "cache": "a fresh DFlashCache per block",
                    "noise_embeds": "DFlashTokenCandidateGenerator._get_noise_embeds (token_embd rows, no embed_norm)",
                    "logits": "target lm_head on the drafter's last hidden state (no output_multiplier, no softcap)",
                    "window": {"n_swa": window,
                               "llama.cpp": f"sliding_window={window - 1}: |q - k| <= {window - 1} == q - k < {window}",
                               "transformers": f"sliding_window={window}: |q - k| <= {window}"}},
        "date": today(),
        "sequences": {pid: {"prompt_tokens": prompts[pid], "tokens": seq, "g": f"{pid}.g.npy",
                            "g_rows": len(seq) - 1}
                      for pid, (seq, _) in sequences.items()},
        "logits": "float32 [n_pos0, n_max + 1, n_vocab]: per pos0 the drafter block [tokens[pos0], MASK x n_max] "
                  "at positions pos0.., context = the target's hidden states of tokens[:pos0]",
        "cases": cases,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
