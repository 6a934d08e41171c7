"""Quantize one tiny model with an importance matrix for every preset llama-quantize lists, and
record what llama.cpp makes of each file: golden/presets/.

    python -m tools.make_quant_presets --llama-bin LLAMA_CPP/build/bin \\
        [--model golden/models/tiny-b-f32.gguf] [--presets Q4_K_M,IQ2_XXS] [--out golden/presets]

1. llama-imatrix over tools/data/tiny_corpus.txt -> imatrix.gguf;
2. for every preset of `llama-quantize --help` (aliases once; F32, F16, BF16 and COPY, which do not
   quantize, are listed in the manifest as skipped) llama-quantize --imatrix -> models/<stem>.gguf;
3. llama-quantize --allow-requantize <stem>.gguf F32: ggml's own to_float of every tensor (the
   decoders of ggml-quants.c), recorded as the sha256 of each tensor's float32 bytes;
4. tools.golden --engine llama-cpp (llama-cpp-python, F32 KV, flash attention off, the logits of
   every prompt position of one prefill and of --n-predict single-token decode steps) ->
   logits/<preset>/, run in this process with llama_model_params.use_extra_bufts = false: no
   repacked or AMX weight buffers, every product through ggml's plain CPU mul_mat (vec_dot or
   llamafile's tinyBLAS). A llama.cpp built with AMX_INT8 crashes in ggml_backend_amx_mul_mat on
   these files on a CPU that has AMX; a Q8_0 file gives byte-identical logits either way;
5. crafted_blocks.npz: Q1_0 and Q2_0 blocks of random bits (every code, which a quantized model
   does not hold: Q2_0's quantizer never writes the code for 2d) and ggml's to_float of them, called
   in llama-cpp-python's libggml-base;
6. manifest.json: source model sha256, tools and versions, commands, date, and per file its sha256,
   size, the type of every tensor and the digests of step 3.

The binaries are not part of the repository; they are built from the llama.cpp that
llama-cpp-python 0.3.36 vendors (golden/README.md, Regenerating). Needs llama-cpp-python.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from reference import gguf
from reference.cli import OneLineParser, UsageError, exit_status, int_in

from tools import common
from tools.parity import golden
from tools.common import REPO

CORPUS = REPO / "tools" / "data" / "tiny_corpus.txt"
PROMPTS = REPO / "golden" / "prompts" / "text-short.jsonl"
IMATRIX_ARGS = ["-c", "64", "-b", "64", "-t", "2"]  # the corpus holds ~1000 tokens: 64-token chunks
NOT_QUANTIZING = {"F32": "no quantization", "F16": "no quantization (covered by golden/models *-f16)",
                  "BF16": "no quantization (covered by golden/models *-bf16)", "COPY": "copies the source"}
IMATRIX = "imatrix.gguf"
PRESET_LINE = re.compile(r"^\s*(?:\d+\s+or\s+)?([A-Z][A-Z0-9_]*)\s*:\s*(.*)$")


def listed_presets(quantize: Path) -> tuple[list[str], dict]:  # -> presets to make, {skipped: why}
    text = subprocess.run([str(quantize), "--help"], capture_output=True, text=True).stdout
    body = text.split("allowed quantization types", 1)[-1]
    presets, skipped = [], {}
    for name, what in (m.groups() for m in map(PRESET_LINE.match, body.splitlines()) if m):
        if what.startswith("alias for"):
            skipped[name] = what.strip()
        elif name in NOT_QUANTIZING:
            skipped[name] = NOT_QUANTIZING[name]
        elif name not in presets:
            presets.append(name)
    return presets, skipped


def run_tool(tool: Path, args: list[str], work: Path) -> list[str]:  # -> the command as recorded
    """Runs in `work` with every file given by its bare name there: llama-imatrix and llama-quantize
    copy the names of the calibration text and the imatrix into the GGUFs they write."""
    with open(work / f"{tool.name}.log", "w") as log:  # the last run's; a failure quotes its tail
        proc = subprocess.run([str(tool), *args], stdout=log, stderr=subprocess.STDOUT, cwd=str(work))
    if proc.returncode:
        tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-3:]
        raise UsageError(f"{tool.name} {' '.join(args)} failed (exit {proc.returncode}): {' | '.join(tail)}")
    return [tool.name, *args]


def tensor_types(path: Path) -> dict:  # GGUF -> {tensor name: ggml type name}
    return {t.name: t.tensor_type.name for t in gguf.open_reader(path).tensors}


def ggml_float_digests(quantize: Path, path: Path, work: Path) -> dict:  # -> {tensor: sha256 of its float32 bytes}
    """ggml's to_float of every tensor of `path`: llama-quantize requantizing it to F32."""
    shutil.copyfile(path, work / path.name)
    as_f32 = f"{path.stem}.ggml-f32.gguf"
    run_tool(quantize, ["--allow-requantize", path.name, as_f32, "F32", "2"], work)
    digests = {}
    for t in gguf.open_reader(work / as_f32).tensors:
        if t.tensor_type.name != "F32":
            raise UsageError(f"{as_f32}: tensor {t.name} is {t.tensor_type.name}, not F32")
        digests[t.name] = hashlib.sha256(t.data.astype("<f4").tobytes()).hexdigest()
    (work / as_f32).unlink()
    return digests


CRAFTED = "crafted_blocks.npz"
CRAFTED_TYPES = {"q1_0": 41, "q2_0": 42}  # ggml.h type ids


class TypeTraits(ctypes.Structure):  # ggml.h struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)),
                ("from_float_ref", ctypes.c_void_p)]


def ggml_to_float(type_id, blocks):  # uint8 [n, type_size] -> float32 [n * blck_size]: ggml's own decoder
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    traits = lib.ggml_get_type_traits(type_id).contents
    if blocks.shape[1] != traits.type_size:
        raise UsageError(f"ggml's {traits.type_name.decode()} blocks are {traits.type_size} bytes, "
                         f"not {blocks.shape[1]}")
    blocks = np.ascontiguousarray(blocks)
    out = np.empty(len(blocks) * traits.blck_size, np.float32)
    traits.to_float(blocks.ctypes.data, out.ctypes.data, out.size)
    return out


def crafted_blocks(out: Path) -> dict:  # -> the manifest entry of CRAFTED, written to out
    rng = np.random.default_rng(0)
    arrays = {}
    for name, type_id in CRAFTED_TYPES.items():
        d = rng.standard_normal(64).astype(np.float16)  # finite scales of both signs
        blocks = np.concatenate([d.view(np.uint8).reshape(64, 2), rng.integers(0, 256, (64, 16), np.uint8)], axis=1)
        arrays[f"{name}_blocks"], arrays[f"{name}_values"] = blocks, ggml_to_float(type_id, blocks)
    np.savez(out / CRAFTED, **arrays)
    return {"file": CRAFTED, "blocks": "64 per type, numpy default_rng(0): f16 d standard normal, random qs bytes",
            "values": "ggml_get_type_traits(type)->to_float of llama-cpp-python 0.3.36's libggml-base"}


def make_preset(preset: str, args, work: Path) -> dict:  # -> the manifest entry
    name = f"{args.model.stem.removesuffix('-f32')}-{preset.lower()}.gguf"
    quantize = args.llama_bin / "llama-quantize"
    command = run_tool(quantize, ["--imatrix", IMATRIX, args.model.name, name, preset, "2"], work)
    dst = args.out / "models" / name
    shutil.move(work / name, dst)
    digests = ggml_float_digests(quantize, dst, work)
    logits = args.out / "logits" / preset
    golden_args = ["--engine", "llama-cpp", "--model", str(dst), "--kv-type", "f32", "--flash-attn", "off", "--no-repack",
                   "--n-predict", str(args.n_predict), "--threads", "2", "--prompts", str(args.prompts),
                   "--out", str(logits)]
    if golden.main(golden_args):
        raise UsageError(f"tools.golden failed on {name}")
    shown = [str(Path(a).relative_to(REPO)) if Path(a).is_absolute() and Path(a).is_relative_to(REPO) else a
             for a in golden_args]
    return {"preset": preset, "file": f"models/{name}", "sha256": common.sha256(dst), "size": dst.stat().st_size,
            "quantize_command": command, "tensor_types": tensor_types(dst), "ggml_f32_sha256": digests,
            "logits": f"logits/{preset}", "golden_command": ["python", "-m", "tools.golden", *shown],
            "llama_model_params": {"use_extra_bufts": False}}


def make_imatrix(args, work: Path) -> dict:  # -> the imatrix's manifest entry; copies it to --out
    shutil.copyfile(CORPUS, work / CORPUS.name)
    shutil.copyfile(args.model, work / args.model.name)
    command = run_tool(args.llama_bin / "llama-imatrix",
                       ["-m", args.model.name, "-f", CORPUS.name, "-o", IMATRIX, *IMATRIX_ARGS], work)
    shutil.copyfile(work / IMATRIX, args.out / IMATRIX)
    return {"file": IMATRIX, "sha256": common.sha256(args.out / IMATRIX),
            "calibration": "tools/data/tiny_corpus.txt", "command": command}


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m tools.make_quant_presets", description=__doc__)
    ap.add_argument("--llama-bin", type=Path, required=True, help="directory with llama-quantize, llama-imatrix")
    ap.add_argument("--model", type=Path, default=REPO / "golden" / "models" / "tiny-b-f32.gguf")
    ap.add_argument("--presets", type=lambda text: text.split(","), help="comma-separated subset (default: all listed)")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--n-predict", type=int_in(0, 64), default=8, help="greedy decode steps recorded per prompt")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "presets")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "presets")
    return ap


def check_args(args) -> tuple[list[str], dict]:  # -> presets to make, skipped ones
    for tool in ("llama-quantize", "llama-imatrix"):
        if not (args.llama_bin / tool).is_file():
            raise UsageError(f"{args.llama_bin}: no {tool} there")
    args.model = args.model.resolve()
    args.out, args.prompts, args.work = args.out.resolve(), args.prompts.resolve(), args.work.resolve()
    gguf.load(args.model, "text")
    listed, skipped = listed_presets(args.llama_bin / "llama-quantize")
    unknown = sorted(set(args.presets or ()) - set(listed))
    if unknown:
        raise UsageError(f"--presets: {', '.join(unknown)} not among llama-quantize's {', '.join(listed)}")
    return [p for p in listed if p in (args.presets or listed)], skipped


def main(argv=None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)

    def work() -> int:
        presets, skipped = check_args(args)
        for d in (args.work, args.out / "models", args.out / "logits"):
            d.mkdir(parents=True, exist_ok=True)
        imatrix_entry = make_imatrix(args, args.work)
        entries = [make_preset(p, args, args.work) for p in tqdm(presets, desc="presets", unit="preset")]
        common.save_json(args.out / "manifest.json", {
            "source_model": {"file": args.model.name, "sha256": common.sha256(args.model)},
            "engine": "llama.cpp", "version": f"llama.cpp {common.LLAMA_CPP_COMMIT} (llama-quantize, llama-imatrix); "
                                              "logits: llama-cpp-python 0.3.36", "date": common.today(),
            "options": {"kv_type": "f32", "flash_attn": "off", "n_predict": args.n_predict,
                        "prompts": args.prompts.name, "use_extra_bufts": False, "quantize_threads": 2},
            "imatrix": imatrix_entry, "crafted_blocks": crafted_blocks(args.out),
            "skipped_presets": skipped, "presets": entries,
            "ggml_f32_sha256": "per tensor: sha256 of the little-endian float32 values ggml's to_float gives "
                               "(llama-quantize --allow-requantize FILE F32)"})
        return 0

    return exit_status("make_quant_presets", work, (gguf.GGUFError, common.GoldenError))


if __name__ == "__main__":
    raise SystemExit(main())
