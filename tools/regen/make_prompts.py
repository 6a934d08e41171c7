"""Write the token-id prompt set golden/prompts/text.jsonl (seeded, reproducible).

    python -m tools.make_prompts [--models golden/models] [--out golden/prompts/text.jsonl]

Ids are drawn from the tiny vocabulary without its special tokens (read from the models'
manifest.json). Lengths 1, 7, 33, 64 and 100 tokens: 100 tokens span more than six windows of the
16-token (tiny-a) and twelve of the 8-token (tiny-b) sliding window. Every prompt starts with BOS
except "len64-nobos".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tools.common import REPO

SEED = 20261001
PROMPTS = [("len1", 1, True), ("len7", 7, True), ("len33", 33, True),
           ("len64-nobos", 64, False), ("len100", 100, True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=REPO / "golden" / "models")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "prompts" / "text.jsonl")
    args = ap.parse_args(argv)

    tok = json.loads((args.models / "manifest.json").read_text(encoding="utf-8"))["tokenizer"]
    special = set(tok["special_ids"].values())
    bos = tok["special_ids"]["<|begin_of_text|>"]
    plain = np.array([i for i in range(tok["vocab_size"]) if i not in special])
    rng = np.random.default_rng(SEED)
    lines = []
    for pid, n, with_bos in PROMPTS:
        ids = [bos] if with_bos else []
        ids += [int(t) for t in rng.choice(plain, size=n - len(ids))]
        lines.append(json.dumps({"id": pid, "token_ids": ids}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
