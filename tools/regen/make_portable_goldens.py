"""llama.cpp's AVX2 build as users make it, run through llama-cpp-python: golden/cpu_targets/avx2-portable.

    python -m tools.regen.make_portable_goldens --llama-src LLAMA_CPP --build-root DIR [--out golden/cpu_targets]

1. Builds llama.cpp (the sources llama-cpp-python 0.3.36 vendors, commit 0c1e570) in DIR/build-portable
   with PORTABLE_FLAGS only, every other option at its default (GGML_NATIVE=OFF on a native compile turns
   SSE4.2, AVX, AVX2, BMI2, FMA and F16C on; llamafile and OpenMP on; gcc as found).
2. Runs `tools.golden --engine llama-cpp` with LLAMA_CPP_LIB_PATH set to that build's libraries, on
   every model of MODELS, repack on and off, F32 KV, flash attention off, n_ctx 4096, 2 threads, the
   70-token prompt of golden/prompts/text-70.jsonl (where 1-ulp RoPE differences reach quantization edges).
3. manifest.json: the build (cmake line, compiler, system_info) and per run the greedy tokens and the
   sha256 and argmax rows of the prefill and decode logits, in golden/cpu_targets/<target>'s run format
   (tests/test_cpu_target_numerics.py checks `--cpu avx2` against them); no arrays.

Needs cmake, gcc and llama-cpp-python 0.3.36. Not needed by CI.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from reference.cli import OneLineParser, UsageError, exit_status

from tools import common
from tools.common import REPO
from tools.regen.make_cpu_target_goldens import first_line, prompt_record, run_tool, save_manifest

PORTABLE_FLAGS = ["-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=ON"]
PROMPTS = REPO / "golden" / "prompts" / "text-70.jsonl"
MODELS = {  # name in the manifest -> model file: the float models (every matmul unquantized) and presets it moved
    "F32": "golden/models/tiny-b-f32.gguf", "F16": "golden/models/tiny-b-f16.gguf",
    "BF16": "golden/models/tiny-b-bf16.gguf", "Q5_0": "golden/presets/models/tiny-b-q5_0.gguf",
    "Q5_K_M": "golden/presets/models/tiny-b-q5_k_m.gguf", "Q4_K_M": "golden/presets/models/tiny-b-q4_k_m.gguf",
    "IQ3_XXS": "golden/presets/models/tiny-b-iq3_xxs.gguf"}
OPTIONS = {"n_ctx": 4096, "n_threads": 2, "n_predict": 8, "kv_type": "f32", "flash_attn": "off"}


def build(args) -> Path:  # -> the directory holding the build's libllama
    build_dir = args.build_root / "build-portable"
    build_dir.mkdir(parents=True, exist_ok=True)
    cmake = Path(shutil.which("cmake") or "cmake")
    run_tool(cmake, ["-S", str(args.llama_src), "-B", str(build_dir), *PORTABLE_FLAGS], build_dir)
    run_tool(cmake, ["--build", str(build_dir), "-j2", "--target", "llama"], build_dir)
    return build_dir / "bin"


def golden_run(lib: Path, name: str, repack: str, work: Path) -> tuple[dict, dict]:  # -> (tools.golden's manifest, run)
    out = work / f"{name}-{repack}"
    argv = [sys.executable, "-m", "tools.golden", "--engine", "llama-cpp", "-m", MODELS[name], "--prompts",
            str(PROMPTS.relative_to(REPO)), "--out", str(out), "-ctk", OPTIONS["kv_type"], "-ctv", OPTIONS["kv_type"],
            "-fa", OPTIONS["flash_attn"], "-n", str(OPTIONS["n_predict"]), "-t", str(OPTIONS["n_threads"]),
            "-c", str(OPTIONS["n_ctx"]), *(["-nr"] if repack == "off" else [])]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)})
    if proc.returncode:
        raise UsageError(f"{name} repack {repack}: tools.golden failed: {proc.stderr.strip().splitlines()[-1:]}")
    made = json.loads((out / "manifest.json").read_text())
    prompts = []
    for e in made["entries"]:
        rows = {"prefill": np.load(out / e["file"]), "decode": np.load(out / e["greedy"]["decode_logits"])}
        prompts.append(prompt_record(rows, e["id"], e["greedy"]["tokens"], None))
    model = REPO / MODELS[name]
    return made, {"preset": name, "model": MODELS[name], "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(), "repack": repack,
                  "kv_type": OPTIONS["kv_type"], "flash_attn": OPTIONS["flash_attn"], "prompts": prompts}


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m tools.regen.make_portable_goldens", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-src", type=Path, required=True, help="llama.cpp sources (llama-cpp-python 0.3.36's vendor/llama.cpp)")
    p.add_argument("--build-root", type=Path, required=True, help="directory for the build")
    p.add_argument("--out", type=Path, default=REPO / "golden" / "cpu_targets", help="parent of avx2-portable/")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def work() -> int:
        lib = build(args)
        runs, made = [], {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in MODELS:
                for repack in ("on", "off"):
                    made, run = golden_run(lib, name, repack, Path(tmp))
                    runs.append(run)
        prompt = json.loads(PROMPTS.read_text().splitlines()[0])
        (args.out / "avx2-portable").mkdir(parents=True, exist_ok=True)
        save_manifest(args.out / "avx2-portable" / "manifest.json", {
            "target": "avx2", "build": "portable", "llama_cpp_commit": common.LLAMA_CPP_COMMIT,
            "cmake_flags": PORTABLE_FLAGS, "compiler": first_line(["gcc", "--version"]),
            "runner": made["version"], "system_info": made["options"]["system_info"], "options": OPTIONS,
            "prompts_file": str(PROMPTS.relative_to(REPO)), "prompts": [prompt],
            "logits": "sha256 of float32 C-order bytes: prefill [n_tokens, n_vocab], decode [n_predict - 1, n_vocab] "
                      "(row i after feeding greedy token i); argmax per row",
            "runs": runs})
        return 0
    return exit_status(build_parser().prog, work)


if __name__ == "__main__":
    sys.exit(main())
