"""llama.cpp built for each CPU target the ggml-cpu numerics models, run on every preset file of
golden/presets: golden/cpu_targets/<target>/.

    python -m tools.make_cpu_target_goldens --llama-src LLAMA_CPP --build-root DIR \\
        [--targets avx2,avx512,neon,neon-i8mm] [--presets Q4_K_M,IQ2_XXS] [--out golden/cpu_targets]
        [--publish DIR] [--clang]

1. Builds llama.cpp (the sources llama-cpp-python 0.3.36 vendors, commit 0c1e570) for each target
   in DIR/build-<target>: shared libraries, Release, GGML_NATIVE=OFF and the target's explicit
   GGML_* flags (TARGETS); never AMX. x86 targets with this machine's gcc, run natively; ARM
   targets cross-compiled with Debian's aarch64-linux-gnu-gcc and run under
   `qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu` (the sysroot of Debian's cross packages).
   The same build compiles tools/regen/cpu_targets/logits.c against that libllama.
2. Runs the driver on every preset of golden/presets/manifest.json with the prompts of
   golden/prompts/text-short.jsonl: for repack on and off (use_extra_bufts), F32 and F16 KV, flash
   attention on and off, n_ctx 1024, n_batch = n_ubatch 512, 2 threads: one prefill with the logits
   of every position, then single-token decodes of llama.cpp's own greedy tokens (n_predict 8: the
   7 decode rows tests/test_quant_presets.py compares), as tools.golden --engine llama-cpp does.
3. manifest.json per target: the build (cmake flags, compiler, runner, llama.cpp's system_info
   line), and per run and prompt the greedy tokens, the sha256 of the float32 C-order prefill
   logits [n_tokens, n_vocab] and decode logits [n_predict - 1, n_vocab], and the argmax of every
   row. Full arrays (<id>.npy, <id>.decode.npy) only for ARRAY_RUNS, the runs tests read numbers
   from. --publish copies each target's directory there as soon as it is complete.
4. --clang (ARM targets): builds the target with clang --target=aarch64-linux-gnu too (lld, no
   OpenMP: macOS's clang has none; ggml's own thread pool splits the work as OpenMP's threads
   would), reruns every run and records in the target's manifest which logits differ from gcc's.
5. neon with --fixtures: the llama-perplexity --kl-divergence-base file and the llama-eval-callback
   dump of FIXTURES, with their commands (tests/test_cpu_targets.py).

Needs cmake, gcc, and for the ARM targets g++-aarch64-linux-gnu and qemu-user (clang and lld for
--clang). Not needed by CI: tests/test_cpu_targets.py reads the committed manifests.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.cli import OneLineParser, UsageError, exit_status, names_in

from tools import common
from tools.parity import golden
from tools.regen.make_quant_presets import PROMPTS, run_tool
from tools.common import REPO

PRESETS = REPO / "golden" / "presets"
DRIVER = REPO / "tools" / "regen" / "cpu_targets" / "logits.c"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's aarch64 cross packages
QEMU = ["qemu-aarch64", "-cpu", "max", "-L", SYSROOT]

COMMON_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
                "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_MTMD=OFF"]
X86_FLAGS = ["-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON"]
# AVX_VNNI stays off on both: with it gcc encodes _mm256_dpbusd_epi32 as VEX vpdpbusd, which a CPU
# with AVX512_VNNI but no AVX-VNNI (Ice Lake server) faults on. Every use in ggml-cpu takes the
# AVX512VNNI+VL branch first (arch/x86/quants.c:109, arch/x86/repack.cpp:152, llamafile/sgemm.cpp:1756),
# so the arithmetic is the same vpdpbusd either way.
AVX512_FLAGS = ["-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512={0}", "-DGGML_AVX512_VBMI={0}", "-DGGML_AVX512_VNNI={0}",
                "-DGGML_AVX512_BF16={0}"]
NO_AMX = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
TARGETS = {  # target -> its own cmake flags (beside COMMON_FLAGS and the toolchain's)
    "avx2": X86_FLAGS + [f.format("OFF") for f in AVX512_FLAGS] + NO_AMX,
    "avx512": X86_FLAGS + [f.format("ON") for f in AVX512_FLAGS] + NO_AMX,
    "neon": ["-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"],
    "neon-i8mm": ["-DGGML_CPU_ARM_ARCH=armv8.6-a+dotprod+i8mm+fp16"],
}
ARM = ("neon", "neon-i8mm")
TOOLS = {  # target -> the llama.cpp programs its build makes besides libllama
    "avx512": ["llama-mtmd-cli", "llama-bench", "llama-quantize", "llama-perplexity", "llama-eval-callback",
               "llama-imatrix"],
    "neon": ["llama-perplexity", "llama-eval-callback"],
}
CONFIGS = [("f32", "off"), ("f32", "on"), ("f16", "off"), ("f16", "on")]  # (KV type, flash attention)
REPACK = ("on", "off")
ARRAY_RUNS = {(p, r, "f32", "off") for p in ("Q4_K_M", "IQ2_XXS") for r in REPACK}  # full .npy committed
N_CTX, N_UBATCH, N_THREADS = 1024, 512, 2  # logits.c's, as golden/presets/logits/*/manifest.json


@dataclass(frozen=True)
class Toolchain:
    name: str
    cc: list[str]      # the C compiler as the driver's build calls it
    flags: list[str]   # cmake flags selecting it


def toolchain(target: str, compiler: str) -> Toolchain:
    if target not in ARM:
        return Toolchain("gcc", ["gcc"], [])  # the default compiler: a cache made without the flag stays valid
    if compiler == "gcc":
        return Toolchain("gcc", ["aarch64-linux-gnu-gcc"], [
            "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64", f"-DCMAKE_FIND_ROOT_PATH={SYSROOT}",
            "-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc", "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++"])
    lld = "-fuse-ld=lld"
    return Toolchain("clang", ["clang", "--target=aarch64-linux-gnu", lld], [
        "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64", f"-DCMAKE_FIND_ROOT_PATH={SYSROOT}",
        "-DCMAKE_C_COMPILER=clang", "-DCMAKE_CXX_COMPILER=clang++", "-DCMAKE_C_COMPILER_TARGET=aarch64-linux-gnu",
        "-DCMAKE_CXX_COMPILER_TARGET=aarch64-linux-gnu", f"-DCMAKE_EXE_LINKER_FLAGS={lld}",
        f"-DCMAKE_SHARED_LINKER_FLAGS={lld}", "-DGGML_OPENMP=OFF"])


def first_line(argv: list[str]) -> str:  # -> the first line a program's --version prints
    return subprocess.run(argv, capture_output=True, text=True).stdout.splitlines()[0].strip()


def build_target(target: str, chain: Toolchain, args) -> tuple[Path, dict]:  # -> (the driver, the manifest's build entry)
    build = args.build_root / (f"build-{target}" if chain.name == "gcc" else f"build-{target}-{chain.name}")
    build.mkdir(parents=True, exist_ok=True)
    flags = COMMON_FLAGS + TARGETS[target] + chain.flags
    cmake = Path(shutil.which("cmake") or "cmake")
    run_tool(cmake, ["-S", str(args.llama_src), "-B", str(build), *flags], build)
    start = time.monotonic()
    run_tool(cmake, ["--build", str(build), "-j2", "--target", "llama", *TOOLS.get(target, [])], build)
    bin_dir = build / "bin"
    driver = bin_dir / "cpu-target-logits"
    include = [f"-I{args.llama_src / 'include'}", f"-I{args.llama_src / 'ggml' / 'include'}"]
    cc = [shutil.which(chain.cc[0]) or chain.cc[0], *chain.cc[1:]]
    run_tool(Path(cc[0]), [*cc[1:], "-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", *include, str(DRIVER),
                           f"-L{bin_dir}", "-lllama", f"-Wl,-rpath,{bin_dir}", "-o", str(driver)], build)
    runner = {"runner": "native"} if target not in ARM else {
        "runner": " ".join(QEMU), "runner_version": first_line(["qemu-aarch64", "--version"])}
    return driver, {"cmake_flags": flags, "compiler": first_line([chain.cc[0], "--version"]),
                    "driver": str(DRIVER.relative_to(REPO)), "build_s": round(time.monotonic() - start), **runner}


def runner_argv(target: str, driver: Path) -> list[str]:
    return [*QEMU, str(driver)] if target in ARM else [str(driver)]


def prompt_lines(prompts: list[dict]) -> str:  # logits.c's stdin: "id tok tok ..." a line
    return "".join(f"{p['id']} {' '.join(map(str, p['token_ids']))}\n" for p in prompts)


def run_driver(argv: list[str], model: Path, repack: str, prompts: list[dict], n_predict: int,
               work: Path) -> tuple[str, dict]:  # -> (system_info, {(kv, fa): {prompt id: greedy tokens}})
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    configs = [f"{kv}:{fa}" for kv, fa in CONFIGS]
    proc = subprocess.run([*argv, str(model), "1" if repack == "on" else "0", str(n_predict), str(work), *configs],
                          input=prompt_lines(prompts), capture_output=True, text=True)
    if proc.returncode:
        raise UsageError(f"{model.name} repack {repack}: the driver failed (exit {proc.returncode}): "
                         f"{' | '.join(proc.stderr.strip().splitlines()[-3:])}")
    system_info, *rows = proc.stdout.strip().splitlines()
    greedy: dict = {}
    for row in rows:
        tag, pid, *tokens = row.split()
        kv, fa = re.fullmatch(r"(f32|f16)-fa(on|off)", tag).groups()
        greedy.setdefault((kv, fa), {})[pid] = [int(t) for t in tokens]
    return system_info.strip(), greedy


def read_rows(path: Path, n_vocab: int) -> np.ndarray:  # raw float32 file -> [n, n_vocab]
    return np.fromfile(path, dtype="<f4").reshape(-1, n_vocab)


def prompt_record(rows: dict, pid: str, tokens: list[int], keep: Path | None) -> dict:
    """rows: {"prefill": [n, V], "decode": [n_predict - 1, V]} -> the manifest's prompt entry; the
    arrays saved under `keep` (relative names in the entry) when it is given."""
    entry = {"id": pid, "greedy": tokens}
    for part, logits in rows.items():
        entry[f"{part}_sha256"] = hashlib.sha256(np.ascontiguousarray(logits, "<f4").tobytes()).hexdigest()
        entry[f"{part}_argmax"] = logits.argmax(-1).tolist()
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for part, name in (("prefill", f"{pid}.npy"), ("decode", f"{pid}.decode.npy")):
            common.save_atomic(keep / name, lambda f, a=rows[part]: np.save(f, a, allow_pickle=False))
            entry[f"{part}_file"] = str((keep / name).relative_to(keep.parents[2]))  # from the target's directory
    return entry


def preset_runs(argv: list[str], preset: dict, prompts: list[dict], n_predict: int, out: Path | None,
                work: Path) -> tuple[str, list[dict]]:  # -> (system_info, the 8 runs of one preset file)
    model = PRESETS / preset["file"]
    n_vocab = None
    runs, info = [], ""
    for repack in REPACK:
        info, greedy = run_driver(argv, model, repack, prompts, n_predict, work)
        for kv, fa in CONFIGS:
            entries = []
            for p in prompts:
                pid, d = p["id"], work / f"{kv}-fa{fa}"
                n_vocab = n_vocab or (d / f"{pid}.prefill.f32").stat().st_size // 4 // len(p["token_ids"])
                rows = {"prefill": read_rows(d / f"{pid}.prefill.f32", n_vocab),
                        "decode": read_rows(d / f"{pid}.decode.f32", n_vocab)}
                keep = (out / "logits" / preset["preset"] / f"repack-{repack}_kv-{kv}_fa-{fa}"
                        if out is not None and (preset["preset"], repack, kv, fa) in ARRAY_RUNS else None)
                entries.append(prompt_record(rows, pid, greedy[(kv, fa)][pid], keep))
            runs.append({"preset": preset["preset"], "model": str(model.relative_to(REPO)),
                         "model_sha256": preset["sha256"], "repack": repack, "kv_type": kv, "flash_attn": fa,
                         "prompts": entries})
    return info, runs


def compact_json(data) -> bytes:  # indented JSON with every list of numbers on one line
    text = json.dumps(data, indent=1)
    text = re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]",
                  text)
    return (text + "\n").encode("utf-8")


def save_manifest(path: Path, data: dict) -> None:
    common.save_atomic(path, lambda f: f.write(compact_json(data)))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_target(target: str, args, prompts: list[dict], presets: list[dict], n_predict: int) -> None:
    out = args.out / target
    shutil.rmtree(out / "logits", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    driver, build = build_target(target, toolchain(target, "gcc"), args)
    start = time.monotonic()
    runs, info = [], ""
    for preset in presets:
        info, more = preset_runs(runner_argv(target, driver), preset, prompts, n_predict, out,
                                 args.build_root / f"work-{target}")
        runs += more
    manifest = {
        "target": target, "llama_cpp_commit": common.LLAMA_CPP_COMMIT, "date": common.today(), **build,
        "system_info": info, "runs_s": round(time.monotonic() - start),
        "options": {"n_ctx": N_CTX, "n_batch": N_UBATCH, "n_ubatch": N_UBATCH, "n_threads": N_THREADS,
                    "n_predict": n_predict, "repack": "use_extra_bufts (on: llama.cpp's default buffers)",
                    "configs": [{"kv_type": kv, "flash_attn": fa} for kv, fa in CONFIGS]},
        "prompts_file": str(args.prompts.relative_to(REPO)) if args.prompts.is_relative_to(REPO) else args.prompts.name,
        "prompts": [{"id": p["id"], "token_ids": p["token_ids"]} for p in prompts],
        "logits": "sha256 of float32 C-order bytes: prefill [n_tokens, n_vocab] (one llama_decode, every "
                  "position), decode [n_predict - 1, n_vocab] (row i after feeding greedy token i); argmax "
                  "per row; <id>.npy / <id>.decode.npy only for array_runs",
        "array_runs": sorted(f"{p} repack-{r} kv-{kv} fa-{fa}" for p, r, kv, fa in ARRAY_RUNS),
        "arrays_bytes": tree_bytes(out / "logits"), "runs": runs}
    save_manifest(out / "manifest.json", manifest)
    publish(out, args)


def publish(out: Path, args) -> None:  # copies a finished target directory to --publish, whole
    if args.publish is None:
        return
    dst = args.publish / out.name
    tmp = args.publish / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def run_key(run: dict) -> tuple:
    return run["preset"], run["repack"], run["kv_type"], run["flash_attn"]


def compare_clang(target: str, args, prompts: list[dict], presets: list[dict], n_predict: int) -> None:
    """Reruns every run of the target's manifest with a clang build; the manifest gets a "clang"
    entry: the build, and every run and prompt whose logits hash differs from gcc's."""
    path = args.out / target / "manifest.json"
    manifest = json.loads(path.read_text())
    driver, build = build_target(target, toolchain(target, "clang"), args)
    start = time.monotonic()
    gcc_runs = {run_key(r): r for r in manifest["runs"]}
    differing, info, n_runs = [], "", 0
    for preset in presets:
        info, runs = preset_runs(runner_argv(target, driver), preset, prompts, n_predict, None,
                                 args.build_root / f"work-{target}-clang")
        for run in runs:
            n_runs += 1
            ours = {p["id"]: p for p in gcc_runs[run_key(run)]["prompts"]}
            for p in run["prompts"]:
                parts = [k for k in ("prefill_sha256", "decode_sha256", "greedy") if p[k] != ours[p["id"]][k]]
                if parts:
                    differing.append({"preset": run["preset"], "repack": run["repack"], "kv_type": run["kv_type"],
                                      "flash_attn": run["flash_attn"], "prompt": p["id"], "differs": parts,
                                      **{k: p[k] for k in parts}})
    manifest["clang"] = {**build, "system_info": info, "runs_s": round(time.monotonic() - start), "n_runs": n_runs,
                         "n_runs_differing": len({tuple(d[k] for k in ("preset", "repack", "kv_type", "flash_attn"))
                                                  for d in differing}),
                         "differing": differing}
    save_manifest(path, manifest)
    publish(args.out / target, args)


# Q8_0 with llama.cpp's defaults (repack on): NEON repacks Q8_0 to q8_0_4x4 with dotprod
# (ggml-cpu/repack.cpp), the layout reference/ggml_cpu/mul_mat.py emulated first on NEON.
FIXTURE_MODEL = PRESETS / "models" / "tiny-b-q8_0.gguf"
FIXTURE_TEXT = REPO / "tests" / "fixtures" / "perplexity" / "text-crlf.txt"
DRAIN_C = "#include <stdlib.h>\n#include <unistd.h>\nstatic void drain(void) { sleep(2); }\n" \
          "__attribute__((constructor)) static void init(void) { atexit(drain); }\n"


def shown(argv: list[str]) -> list[str]:  # a command as the manifest records it: repository paths relative
    return [str(Path(a).relative_to(REPO)) if a.startswith(str(REPO)) else a for a in argv]


def make_fixtures(target: str, args) -> None:
    """The target's llama-perplexity --kl-divergence-base file of FIXTURE_MODEL on FIXTURE_TEXT (the
    text tests/test_perplexity.py reads, -c 128 -b 128 as there, llama.cpp's defaults otherwise:
    F16 KV, flash attention auto, repack on), and its llama-eval-callback dump of "the sun" with the
    options of tests/fixtures/tiny-a-f32.eval-callback.txt (F32 KV, flash attention off, 1 thread).
    drain.so (tests/fixtures/README.md) lets the asynchronous logger finish the dump."""
    chain = toolchain(target, "gcc")
    _, build = build_target(target, chain, args)
    bin_dir = args.build_root / f"build-{target}" / "bin"
    (bin_dir / "drain.c").write_text(DRAIN_C)
    cc = shutil.which(chain.cc[0]) or chain.cc[0]
    run_tool(Path(cc), ["-shared", "-fPIC", "-o", str(bin_dir / "drain.so"), str(bin_dir / "drain.c")], bin_dir)
    runner = [*QEMU, "-E", f"LD_PRELOAD={bin_dir / 'drain.so'}"] if target in ARM else []
    out = args.out / target
    kld = out / f"{FIXTURE_MODEL.stem}.kld"
    dump = out / f"{FIXTURE_MODEL.stem}.eval-callback.txt"
    model, text_file = str(FIXTURE_MODEL.relative_to(REPO)), str(FIXTURE_TEXT.relative_to(REPO))  # run in REPO: logs name them so
    perplexity = [str(bin_dir / "llama-perplexity"), "-m", model, "-f", text_file,
                  "-c", "128", "-b", "128", "-t", "2", "--kl-divergence-base", str(kld)]
    callback = [str(bin_dir / "llama-eval-callback"), "-m", model, "-p", "the sun", "-t", "1",
                "-tb", "1", "-c", "64", "-b", "64", "-ub", "64", "-ctk", "f32", "-ctv", "f32", "-fa", "off",
                "--seed", "0", "--no-perf"]
    proc = subprocess.run([*runner, *perplexity], capture_output=True, text=True, cwd=REPO)
    if proc.returncode or not kld.is_file():
        raise UsageError(f"llama-perplexity failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    text = subprocess.run([*runner, *callback], capture_output=True, text=True, cwd=REPO)
    if text.returncode:
        raise UsageError(f"llama-eval-callback failed (exit {text.returncode}): {text.stderr.strip()[-300:]}")
    common.save_atomic(dump, lambda f: f.write((text.stdout + text.stderr).encode("utf-8")))
    manifest = json.loads((out / "manifest.json").read_text())
    where = {"llama-perplexity": "$BUILD/bin/llama-perplexity", "llama-eval-callback": "$BUILD/bin/llama-eval-callback"}
    runner_shown = [*QEMU, "-E", "LD_PRELOAD=$BUILD/bin/drain.so"] if target in ARM else []
    manifest["fixtures"] = {
        "build": "$BUILD: this target's build above; drain.so: tests/fixtures/README.md's, built by its compiler",
        "model": {"file": str(FIXTURE_MODEL.relative_to(REPO)), "sha256": common.sha256(FIXTURE_MODEL)},
        "kld": {"file": kld.name, "sha256": common.sha256(kld), "size": kld.stat().st_size,
                "command": runner[:len(QEMU)] + [where["llama-perplexity"], *shown(perplexity[1:])],
                "stdout_tail": proc.stdout.strip().splitlines()[-2:]},
        "eval_callback": {"file": dump.name, "sha256": common.sha256(dump), "size": dump.stat().st_size,
                          "command": runner_shown + [where["llama-eval-callback"], *shown(callback[1:])],
                          "output": "stdout and stderr together, as written"}}
    save_manifest(out / "manifest.json", manifest)
    publish(out, args)


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m tools.make_cpu_target_goldens", description=__doc__)
    ap.add_argument("--llama-src", type=Path, required=True, help="llama.cpp sources (llama-cpp-python 0.3.36's vendor/llama.cpp)")
    ap.add_argument("--build-root", type=Path, required=True, help="where build-<target>/ are made")
    ap.add_argument("--targets", type=names_in(list(TARGETS), "target"), default=list(TARGETS))
    ap.add_argument("--presets", type=lambda text: text.split(","), help="comma-separated subset (default: all 32)")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "cpu_targets")
    ap.add_argument("--publish", type=Path, help="copy each finished target directory here")
    ap.add_argument("--build-only", action="store_true", help="build the targets and their drivers, run nothing")
    ap.add_argument("--clang", action="store_true", help="ARM targets: compare a clang build with the committed gcc runs")
    ap.add_argument("--fixtures", action="store_true", help="neon: the .kld base and eval-callback dump (after its runs)")
    return ap


def check_args(args) -> list[dict]:  # -> the presets' manifest entries to run
    if not (args.llama_src / "include" / "llama.h").is_file():
        raise UsageError(f"{args.llama_src}: no include/llama.h there")
    args.llama_src, args.build_root = args.llama_src.resolve(), args.build_root.resolve()
    args.out, args.prompts = args.out.resolve(), args.prompts.resolve()
    if args.publish is not None:
        args.publish = args.publish.resolve()
        args.publish.mkdir(parents=True, exist_ok=True)
    presets = json.loads((PRESETS / "manifest.json").read_text())["presets"]
    unknown = sorted(set(args.presets or ()) - {p["preset"] for p in presets})
    if unknown:
        raise UsageError(f"--presets: {', '.join(unknown)} not in golden/presets")
    if args.fixtures and args.targets != ["neon"]:
        raise UsageError("--fixtures: --targets neon only")
    if args.clang and not set(args.targets) <= set(ARM):
        raise UsageError("--clang: ARM targets only (neon, neon-i8mm)")
    return [p for p in presets if p["preset"] in (args.presets or [p["preset"]])]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def work() -> int:
        presets = check_args(args)
        prompts = golden.read_prompts(args.prompts)
        if any("token_ids" not in p or "continuation_ids" in p or "continuation" in p for p in prompts):
            raise UsageError(f"{args.prompts}: the driver takes token_ids prompts only, without continuations")
        n_predict = json.loads((PRESETS / "manifest.json").read_text())["options"]["n_predict"]
        for target in args.targets:
            if args.build_only:
                build_target(target, toolchain(target, "clang" if args.clang else "gcc"), args)
            elif args.fixtures:
                make_fixtures(target, args)
            elif args.clang:
                compare_clang(target, args, prompts, presets, n_predict)
            else:
                make_target(target, args, prompts, presets, n_predict)
        return 0

    return exit_status("make_cpu_target_goldens", work, (common.GoldenError,))


if __name__ == "__main__":
    raise SystemExit(main())
