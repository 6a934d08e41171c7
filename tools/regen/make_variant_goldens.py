"""llama.cpp's portable x86 build, one CPU variant at a time, on every preset: golden/cpu_targets/variants.

    python -m tools.regen.make_variant_goldens --llama-src LLAMA_CPP --build-root DIR [--variants haswell,zen4]
        [--presets Q8_0,Q4_K_M]

1. Builds llama.cpp (commit 0c1e570) as the release does, `GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON`
   (VARIANT_FLAGS, every other option at its default) in DIR/build-variants, and
   tools/regen/cpu_targets/logits.c with LOAD_ALL_BACKENDS (a DL build registers no backend until asked).
2. Forces each variant by a directory holding the shared libraries, the driver and that variant's
   libggml-cpu-<variant>.so only; ggml_backend_load_all loads it, and the directory's check program
   prints llama.cpp's own `load_backend: loaded CPU backend from .../libggml-cpu-<variant>.so` line,
   which the manifest keeps.
3. Runs the driver as tools/regen/make_cpu_target_goldens.py does (the presets, repack on/off, F32/F16
   KV, flash attention on/off, the prompts of golden/prompts/text-short.jsonl) and compares every hash
   with the manifest of the target the variant rounds as (reference/ggml_cpu/target.py VARIANT_TARGET),
   or for skylakex, cannonlake, cascadelake and icelake, avx512's (they differ on BF16 weights only).
   The variants below AVX2 (sandybridge, ivybridge, piledriver, sse42, x64) are targets of their own:
   for them it runs the F32, F16 and BF16 models too (FLOAT_MODELS; the mode emulates only float
   weights there), repack off only (no CPU_REPACK layout exists below AVX2: x86's all need it), and
   writes golden/cpu_targets/<variant>/manifest.json, the runs tests/test_cpu_target_numerics.py checks.
4. variants/manifest.json: per variant its features, system_info, load line, how many runs are
   identical to that target's, and runs_sha256, the sha256 of its sorted "preset repack kv fa prompt
   prefill decode" lines (tests/test_cpu_targets.py recomputes it from the target's manifest, restricted
   to the entry's "presets" where --presets ran a subset); entries of variants not run this time are
   kept; a variant this CPU scores 0 is skipped and said so.

Needs cmake and gcc, and a CPU that scores each variant above 0 (cpu-feats.cpp). Not needed by CI.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from reference.cli import OneLineParser, UsageError, exit_status
from reference.ggml_cpu.target import PRE_AVX2, VARIANT_TARGET, X86_VARIANTS, cpu_flags, variant_score

from tools import common
from tools.common import REPO
from tools.parity import golden
from tools.regen import make_cpu_target_goldens as targets
from tools.regen.make_cpu_target_goldens import (CONFIGS, DRIVER, PRESETS, first_line, preset_runs, run_key, run_tool,
                                                 save_manifest)

VARIANT_FLAGS = ["-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"]
# variant -> the target manifest its runs are compared with: the emulated ones, and the AVX512 ones without BF16,
# which differ from avx512 on BF16 weights only (none among the presets)
COMPARED = {**VARIANT_TARGET, **{v: "avx512" for v in ("skylakex", "cannonlake", "cascadelake", "icelake")}}
CHECK = '#include "ggml-backend.h"\nint main(void) { ggml_backend_load_all(); return 0; }\n'  # prints the load line
OWN_TARGETS = tuple(t.name for t in PRE_AVX2)  # variants that are targets of their own: golden/cpu_targets/<variant>
FLOAT_MODELS = ("F32", "F16", "BF16")  # golden/models/tiny-b-<name>.gguf: the weights the mode emulates below AVX2


def run_lines(runs: list[dict]) -> list[str]:  # manifest runs -> one sorted line per run and prompt
    return sorted(f"{' '.join(run_key(r))} {p['id']} {p['prefill_sha256']} {p['decode_sha256']}"
                  for r in runs for p in r["prompts"])


def runs_sha256(runs: list[dict]) -> str:
    return hashlib.sha256("\n".join(run_lines(runs)).encode()).hexdigest()


def build(args) -> Path:  # -> the build's bin directory
    build_dir = args.build_root / "build-variants"
    build_dir.mkdir(parents=True, exist_ok=True)
    cmake = Path(shutil.which("cmake") or "cmake")
    run_tool(cmake, ["-S", str(args.llama_src), "-B", str(build_dir), *VARIANT_FLAGS], build_dir)
    run_tool(cmake, ["--build", str(build_dir), "-j2", "--target", "llama"], build_dir)
    return build_dir / "bin"


def forced(bin_dir: Path, variant: str, args) -> tuple[Path, str]:  # -> (the driver loading only `variant`, its load line)
    d = args.build_root / f"variant-{variant}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for lib in [*bin_dir.glob("libggml.so*"), *bin_dir.glob("libggml-base.so*"), *bin_dir.glob("libllama.so*"),
                bin_dir / f"libggml-cpu-{variant}.so"]:
        shutil.copy2(lib, d / lib.name, follow_symlinks=False)
    include = [f"-I{args.llama_src / 'include'}", f"-I{args.llama_src / 'ggml' / 'include'}"]
    link = [f"-L{d}", "-Wl,-rpath,$ORIGIN"]
    run_tool(Path(shutil.which("gcc") or "gcc"), ["-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-DLOAD_ALL_BACKENDS",
                                                  *include, str(DRIVER), *link, "-lllama", "-lggml", "-o", "cpu-target-logits"], d)
    (d / "check.c").write_text(CHECK)
    run_tool(Path(shutil.which("gcc") or "gcc"), ["-std=c11", *include, "check.c", *link, "-lggml", "-o", "check"], d)
    line = subprocess.run([str(d / "check")], capture_output=True, text=True).stderr.strip()
    if f"libggml-cpu-{variant}.so" not in line:
        raise UsageError(f"{variant}: llama.cpp loaded no such variant ({line or 'no load line'})")
    return d / "cpu-target-logits", line


def float_models() -> list[dict]:  # -> preset-like entries of the float models (file under golden/models)
    models = []
    for name in FLOAT_MODELS:
        path = REPO / "golden" / "models" / f"tiny-b-{name.lower()}.gguf"
        models.append({"preset": name, "file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    return models


def variant_runs(driver: Path, variant: str, args, prompts: list[dict], presets: list[dict]) -> tuple[str, list]:
    """-> (system_info, runs): below AVX2 the float models first and repack off only."""
    own = variant in OWN_TARGETS
    repacks, targets.REPACK = targets.REPACK, ("off",) if own else targets.REPACK
    try:
        runs, info = [], ""
        for preset in (float_models() if own else []) + presets:
            info, more = preset_runs([str(driver)], preset, prompts, 8, None, args.build_root / "work")
            runs += more
        return info, runs
    finally:
        targets.REPACK = repacks


def variant_entry(variant: str, bin_dir: Path, args, prompts: list[dict], presets: list[dict]) -> dict:
    driver, line = forced(bin_dir, variant, args)
    line = line.replace(str(driver.parent), "DIR")
    target = COMPARED[variant]
    info, runs = variant_runs(driver, variant, args, prompts, presets)
    if variant in OWN_TARGETS:
        save_own_target(variant, info, line, runs, args)
    expected = json.loads((REPO / "golden" / "cpu_targets" / target / "manifest.json").read_text())["runs"]
    ours = set(run_lines(runs))
    ran = sorted({r["preset"] for r in runs})
    theirs = set(run_lines([r for r in expected if r["preset"] in ran]))
    return {"features": list(X86_VARIANTS[variant]), "compared_with": target, "system_info": info, "load_line": line,
            **({"presets": ran} if args.presets else {}), "runs": len(runs), "prompt_records": len(ours),
            "identical_to_target": len(ours & theirs), "runs_sha256": runs_sha256(runs)}


def save_own_target(variant: str, info: str, line: str, runs: list[dict], args) -> None:
    """golden/cpu_targets/<variant>/manifest.json: the runs of a variant that is a target of its own,
    in make_cpu_target_goldens' run format (hashes and argmax rows, no arrays)."""
    out = args.out.parent / variant
    out.mkdir(parents=True, exist_ok=True)
    save_manifest(out / "manifest.json", {
        "target": variant, "build": "GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON, this variant forced",
        "llama_cpp_commit": common.LLAMA_CPP_COMMIT, "cmake_flags": VARIANT_FLAGS,
        "compiler": first_line(["gcc", "--version"]), "driver": str(DRIVER.relative_to(REPO)) + " -DLOAD_ALL_BACKENDS",
        "system_info": info, "load_line": line,
        "options": {"n_ctx": targets.N_CTX, "n_batch": targets.N_UBATCH, "n_ubatch": targets.N_UBATCH,
                    "n_threads": targets.N_THREADS, "n_predict": 8, "repack": "off (no CPU_REPACK layout below AVX2)",
                    "configs": [{"kv_type": kv, "flash_attn": fa} for kv, fa in CONFIGS]},
        "prompts_file": "golden/prompts/text-short.jsonl",
        "logits": "sha256 of float32 C-order bytes: prefill [n_tokens, n_vocab], decode [n_predict - 1, n_vocab] "
                  "(row i after feeding greedy token i); argmax per row; no arrays",
        "runs": runs})


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m tools.regen.make_variant_goldens", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-src", type=Path, required=True, help="llama.cpp sources (llama-cpp-python 0.3.36's vendor/llama.cpp)")
    p.add_argument("--build-root", type=Path, required=True, help="directory for the build and the variant directories")
    p.add_argument("--variants", default=",".join(COMPARED), help="the variants to run (comma-separated)")
    p.add_argument("--presets", help="the presets to run (comma-separated; default: every one)")
    p.add_argument("--out", type=Path, default=REPO / "golden" / "cpu_targets" / "variants", help="manifest directory")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def work() -> int:
        variants = args.variants.split(",")
        unknown = [v for v in variants if v not in COMPARED]
        if unknown:
            raise UsageError(f"--variants: {', '.join(unknown)} has no target to compare with (one of {', '.join(COMPARED)})")
        for v in [v for v in variants if variant_score(v, cpu_flags()) == 0]:
            print(f"{build_parser().prog}: {v} skipped: this CPU cannot load it (llama.cpp scores it 0)", file=sys.stderr)
            variants.remove(v)
        presets = json.loads((PRESETS / "manifest.json").read_text())["presets"]
        if args.presets:
            names = args.presets.split(",")
            missing = sorted(set(names) - {p["preset"] for p in presets})
            if missing:
                raise UsageError(f"--presets: no such preset {', '.join(missing)}")
            presets = [p for p in presets if p["preset"] in names]
        bin_dir = build(args)
        prompts = golden.read_prompts(REPO / "golden" / "prompts" / "text-short.jsonl")
        path = args.out / "manifest.json"
        entries = json.loads(path.read_text())["variants"] if path.exists() else {}
        entries.update({v: variant_entry(v, bin_dir, args, prompts, presets) for v in variants})
        args.out.mkdir(parents=True, exist_ok=True)
        save_manifest(path, {
            "llama_cpp_commit": common.LLAMA_CPP_COMMIT, "cmake_flags": VARIANT_FLAGS,
            "compiler": first_line(["gcc", "--version"]), "driver": str(DRIVER.relative_to(REPO)) + " -DLOAD_ALL_BACKENDS",
            "forced_by": "a directory holding libggml, libggml-base, libllama, the driver and only libggml-cpu-<variant>.so",
            "built": "cmake --build --target llama: ggml depends on every ggml-cpu-<variant> module of a DL build",
            "prompts_file": "golden/prompts/text-short.jsonl", "runs_sha256": "sha256 of the sorted lines "
            "'preset repack kv_type flash_attn prompt prefill_sha256 decode_sha256', joined by newlines",
            "variants": entries})
        return 0
    return exit_status(build_parser().prog, work)


if __name__ == "__main__":
    sys.exit(main())
