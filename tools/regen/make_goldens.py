"""Regenerate every golden in golden/logits/ by running tools.golden once per model and option set.

    python -m tools.make_goldens --checkpoints build/tiny [--engine llama-cpp|transformers ...]

Runs (each one `python -m tools.golden ...` in its own process; the command is printed):
- llama.cpp, every text GGUF listed in golden/models/manifest.json: --kv-type f32 --flash-attn off
  (f32 models also --n-predict 32) into golden/logits/llama-cpp/<model>/kv-f32_fa-off/; every run
  but these exact f32 ones reads text-short.jsonl beside the prompt file (no 100-token prompt);
- llama.cpp, the f32 models again with the default F16 KV cache, and with flash attention on:
  kv-f16_fa-off/, kv-f16_fa-on/ (on the CPU, flash attention rounds K and V to F16 whatever the
  cache type: an F32-cache run with it on gave byte-identical logits, so it is not stored);
- transformers (float32, eager attention), every HF checkpoint of a text model under
  --checkpoints, --n-predict 32, into golden/logits/transformers/<checkpoint>/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from tools.common import REPO

N_PREDICT = 32
TRAINED_DEFAULT = "glimmer-default"


def runs(models: Path, checkpoints: Path | None, prompts: Path, out: Path, engines: set[str]):
    manifest = json.loads((models / "manifest.json").read_text(encoding="utf-8"))
    # the trained default model's goldens come from `python -m tools.train_tiny --only goldens`
    tiny = [f for f in manifest["files"] if f["role"] == "text" and f["checkpoint"] != TRAINED_DEFAULT]
    texts = [f["name"] for f in tiny]
    if "llama-cpp" in engines:
        for name in texts:
            stem = name[: -len(".gguf")]
            f32 = stem.endswith("-f32")
            option_sets = [("f32", "off")] + ([("f16", "off"), ("f16", "on")] if f32 else [])
            for kv, fa in option_sets:
                cmd = ["--engine", "llama-cpp", "--model", str(models / name), "--kv-type", kv, "--flash-attn", fa]
                exact = f32 and (kv, fa) == ("f32", "off")
                if exact:
                    cmd += ["--n-predict", str(N_PREDICT)]
                # runs gated at a measured NMSE (rounded weights or KV) skip the 100-token prompt: the
                # 64-token one already spans 4 to 8 windows, and golden/ must stay small
                run_prompts = prompts if exact else prompts.with_name(prompts.stem + "-short.jsonl")
                yield cmd + ["--prompts", str(run_prompts), "--out", str(out / "llama-cpp" / stem / f"kv-{kv}_fa-{fa}")]
    if "transformers" in engines:
        if checkpoints is None:
            raise SystemExit("--checkpoints (the HF dirs made by tools.make_tiny, e.g. build/tiny) is needed")
        for ckpt in sorted({f["checkpoint"] for f in tiny}):
            yield ["--engine", "transformers", "--checkpoint", str(checkpoints / ckpt), "--n-predict", str(N_PREDICT),
                   "--prompts", str(prompts), "--out", str(out / "transformers" / ckpt)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=REPO / "golden" / "models")
    ap.add_argument("--checkpoints", type=Path, help="HF checkpoint dirs (tools.make_tiny --work)")
    ap.add_argument("--prompts", type=Path, default=REPO / "golden" / "prompts" / "text.jsonl")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "logits")
    ap.add_argument("--engine", action="append", choices=["llama-cpp", "transformers"],
                    help="repeatable; default both")
    args = ap.parse_args(argv)
    engines = set(args.engine or ["llama-cpp", "transformers"])
    failed = []
    for cmd in runs(args.models, args.checkpoints, args.prompts, args.out, engines):
        full = [sys.executable, "-m", "tools.golden", *cmd]
        print("+ python -m tools.golden " + " ".join(cmd), flush=True)
        if subprocess.run(full, cwd=str(REPO)).returncode != 0:
            failed.append(" ".join(cmd))
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
