"""Build the tiny Muse-Glimmer models in golden/models/ with transformers and llama.cpp's converter.

    python -m tools.make_tiny --llama-cpp-dir LLAMA_CPP_DIR --out golden/models [--work build/tiny]

Steps (all seeded, so a rerun gives the same weights and the same GGUF bytes):
1. train a tiny byte-level BPE tokenizer on tools/data/tiny_corpus.txt (Llama-4 split regex, the
   model's special tokens appended at the end of the vocabulary, the real chat template);
2. build MuseGlimmerForConditionalGeneration checkpoints (text + tiny vision tower) and one
   MuseGlimmerAssistantModel (DFlash drafter) with transformers, save them under --work;
3. convert them with llama.cpp's convert_hf_to_gguf.py (through tools/regen/hf_to_gguf.py, which pins the
   pre-tokenizer name to "llama4"), quantize with llama-quantize (imatrix from llama-imatrix where
   a type needs one);
4. write golden/models/manifest.json and a copy of every checkpoint's config.json.

LLAMA_CPP_DIR is a llama.cpp source tree with the muse-glimmer converter and a build of
llama-quantize and llama-imatrix in build/bin (or pass --llama-bin).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from reference import artifacts
from tools.common import LLAMA_CPP_COMMIT, REPO, GoldenError, sha256, today

CORPUS = REPO / "tools" / "data" / "tiny_corpus.txt"

LLAMA_CPP_SOURCE = "llama-cpp-python 0.3.36 sdist (vendor/llama.cpp)"

VOCAB_SIZE = 512
# appended after the BPE vocabulary, in this order (the real model also keeps them at the end)
SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start|>", "<|message|>", "<|eot|>",
    "<|eom|>", "<|image_start|>", "<|image_end|>", "<|patch|>", "<|video|>", "<|vid_start|>",
    "<|vid_end|>", "<|vid_frame_separator|>", "<|mask|>",
]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

# the Llama-4 pre-tokenizer split (llama.cpp: LLAMA_VOCAB_PRE_TYPE_GPT4O, "original regex")
LLAMA4_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Two text models. Layer counts are not multiples of 4 (HF's layer_types rule and llama.cpp's
# scalar fallback disagree: HF makes layers 0 and 4 of tiny-a and layer 2 of tiny-b full, the
# scalar rule would make only layer 3 of tiny-a full), GQA ratios differ (2 and 8),
# head_dim != n_embd / n_head, small windows. Sized so that golden/models/ stays under 45 MB.
# n_embd and n_ff are multiples of 256 so K-quant and IQ rows fit; n_head*head_dim = 128 is not,
# so llama-quantize uses its fallback type for attn_output.
TEXT_MODELS = {
    "tiny-a": dict(
        seed=1001, hidden_size=256, intermediate_size=256, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
        final_logit_softcapping=25.0, output_multiplier=0.7, qk_scale_factor=2.5,
        rms_norm_eps=1e-5, rope_theta=10000.0,
    ),
    "tiny-b": dict(
        seed=1002, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=1, head_dim=16, sliding_window=8,
        final_logit_softcapping=35.0, output_multiplier=0.4, qk_scale_factor=1.7,
        rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
}
# tiny vision tower: patch 14, merge 2 as the release; an 8x8 position table makes the attention
# window 8x8 patches (112 px) in both HF and llama.cpp, so small images already span several windows.
# 6 layers: global layers 3 ((il+1) % 4 == 0) and 5 (the last), windowed 0, 1, 2, 4.
VISION = dict(
    patch_size=14, pos_emb_height=8, pos_emb_width=8, max_position_embeddings=64, merge_size=2,
    patch_temporal=2, num_attention_heads=2, num_hidden_layers=6, hidden_size=64,
    intermediate_size=128, layer_norm_eps=1e-5,
)
PROJECTOR_HIDDEN = 128
MMPROJ_OF = "tiny-a"
DRAFTER = dict(
    name="tiny-a-dflash", target="tiny-a", seed=1003, hidden_size=256, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rms_norm_eps=1e-5, rope_theta=50000.0, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"], block_size=4, target_layer_ids=[1, 3],
)
LOGIT_STD = 5.0  # aimed spread of the final logits (before the softcap): clear top-1 margins

CONVERT_TYPES = ["f32", "f16", "bf16", "q8_0"]
# (file suffix, llama-quantize type, needs an importance matrix)
QUANT_TYPES = [("q4_k_m", "Q4_K_M", False), ("q6_k", "Q6_K", False),
               ("iq4_xs", "IQ4_XS", False), ("iq2_xxs", "IQ2_XXS", True)]
IMATRIX_ARGS = ["-c", "64", "-b", "64", "-t", "2"]


def log(msg: str) -> None:
    print(f"[make_tiny] {msg}", flush=True)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the GGUF holds (quantize falls back on narrow rows)."""
    from reference.gguf import open_reader  # also lays out the pinned ggml's Q2_0, which gguf-py lacks

    counts: dict[str, int] = {}
    for t in open_reader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------------------
# tokenizer

def build_tokenizer(corpus: Path = CORPUS):  # text file -> tokenizers.Tokenizer of VOCAB_SIZE ids
    """Byte-level BPE trained on the corpus file's lines; special tokens get the last ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA4_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(corpus.read_text(encoding="utf-8").splitlines(keepends=True), trainer=trainer)
    n_bpe = tok.get_vocab_size()
    if n_bpe != VOCAB_SIZE - len(SPECIAL_TOKENS):
        raise SystemExit(f"BPE training gave {n_bpe} tokens, wanted {VOCAB_SIZE - len(SPECIAL_TOKENS)}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def special_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def save_tokenizer(tok, chat_template: str, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(out_dir)
    # keep the template inside tokenizer_config.json (the converter reads it from there first)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = chat_template
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# checkpoints

def init_weights(model, seed: int, lm_head_gain: float) -> None:
    """Seeded weights with more spread than the HF init, so outputs are peaked.

    Matrices ~ N(0, 1/fan_in) (lm_head scaled by lm_head_gain), embeddings ~ N(0, 1), the centred
    (1 + w) text norms w ~ N(0, 0.2^2), plain norm weights 1 + N(0, 0.1^2), biases N(0, 0.05^2).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    centred = set()
    for mname, module in model.named_modules():
        if type(module).__name__ == "MuseGlimmerTextCenteredRMSNorm":
            centred.add(f"{mname}.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name in centred:
                value = 0.2 * noise
            elif p.ndim == 1 and name.endswith("bias"):
                value = 0.05 * noise
            elif p.ndim == 1:
                value = 1.0 + 0.1 * noise
            elif "embed_tokens" in name or "position_embedding" in name:
                value = noise
            else:
                fan_in = p[0].numel()
                gain = lm_head_gain if name == "lm_head.weight" else 1.0
                value = noise * (gain / fan_in ** 0.5)
            p.copy_(value.to(p.dtype))


def text_checkpoint(spec: dict, ids: dict[str, int], vision: dict = VISION,
                    projector_hidden: int = PROJECTOR_HIDDEN, lm_head_gain: float | None = None):
    """MuseGlimmerForConditionalGeneration of spec (the TEXT_MODELS keys) with a random vision tower
    and projector, in eval mode. lm_head_gain None aims the final logits at a spread of LOGIT_STD
    (the output multiplier scales them after lm_head); train_tiny starts training from 1.0."""
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    text = {k: v for k, v in spec.items() if k not in ("seed", "rope_theta")}
    text.update(
        vocab_size=VOCAB_SIZE, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
    )
    cfg = MuseGlimmerConfig(
        text_config=text, vision_config=dict(vision),
        image_token_id=ids["<|patch|>"], video_token_id=ids["<|video|>"],
        out_hidden_size=vision["hidden_size"] * vision["merge_size"] ** 2,
        projector_hidden_size=projector_hidden, tie_word_embeddings=False,
        bos_token_id=ids[BOS], eos_token_id=ids[EOS],
    )
    torch.manual_seed(spec["seed"])
    model = MuseGlimmerForConditionalGeneration(cfg).to(torch.float32).eval()
    if lm_head_gain is None:
        lm_head_gain = LOGIT_STD / spec["output_multiplier"]
    init_weights(model, spec["seed"], lm_head_gain)
    return model


def drafter_checkpoint(ids: dict[str, int], spec: dict = DRAFTER):  # -> MuseGlimmerAssistantModel
    """The DFlash drafter of spec (the DRAFTER keys; name and target are not read here)."""
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "layer_types",
            "block_size", "target_layer_ids")
    cfg = MuseGlimmerAssistantConfig(
        **{k: spec[k] for k in keep}, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids["<|pad|>"],
        mask_token_id=ids["<|mask|>"],
    )
    torch.manual_seed(spec["seed"])
    model = MuseGlimmerAssistantModel(cfg).to(torch.float32).eval()
    init_weights(model, spec["seed"], 1.0)
    return model


def write_preprocessor_config(out_dir: Path) -> None:
    """MuseGlimmerImageProcessor defaults (written by hand: saving the processor needs torchvision)."""
    cfg = {
        "image_processor_type": "MuseGlimmerImageProcessor",
        "do_resize": True, "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "patch_size": VISION["patch_size"],
        "temporal_patch_size": VISION["patch_temporal"], "merge_size": VISION["merge_size"],
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


# MuseGlimmerVideoProcessor's fields (transformers/models/muse_glimmer/video_processing_muse_glimmer.py:96-115),
# with the frame and token caps cut to the tiny tower's size
VIDEO_PREPROCESSOR = {
    "video_processor_type": "MuseGlimmerVideoProcessor", "do_resize": True, "resample": 1, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True, "patch_size": VISION["patch_size"], "temporal_patch_size": VISION["patch_temporal"],
    "merge_size": VISION["merge_size"], "max_video_frame_tokens": 36, "num_frames": 8, "fps": 2.0,
    "do_sample_frames": True, "frame_timestamp_format": "Time: {timestamp:.1f}s",
}


def write_video_preprocessor_config(out_dir: Path) -> None:  # VIDEO_PREPROCESSOR, by hand as the image one
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR, indent=2) + "\n",
                                                            encoding="utf-8")


def peakedness(model, vocab: int, seed: int) -> str:
    """Median and 10th percentile of the top-1 minus top-2 logit margin on a random prompt."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_SIZE - len(SPECIAL_TOKENS), (1, 64), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).numpy()
    import numpy as np
    return f"top1-top2 margin median {np.median(margin):.3f}, p10 {np.percentile(margin, 10):.3f}, logit std {logits.std():.2f}"


# ---------------------------------------------------------------------------------------------
# llama.cpp

class Runner:
    def __init__(self, llama_cpp_dir: Path, llama_bin: Path, work: Path, out: Path):
        self.llama_cpp_dir, self.llama_bin, self.work, self.out = llama_cpp_dir, llama_bin, work, out

    def placeholder(self, arg: str) -> str:
        """Command arguments for the manifest, with machine paths replaced by {work}/{out}."""
        for root, tag in ((self.out, "{out}"), (self.work, "{work}"), (self.llama_cpp_dir, "{llama.cpp}")):
            root_s = str(root)
            if arg.startswith(root_s):
                return tag + arg[len(root_s):]
        return arg

    def run(self, cmd: list[str], log_name: str, cwd: Path = REPO) -> tuple[bool, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(self.llama_cpp_dir / "gguf-py")])
        env.setdefault("OMP_NUM_THREADS", "2")
        log_path = self.work / "logs" / f"{log_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w", encoding="utf-8") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(cwd))
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-6:]
        return proc.returncode == 0, "\n".join(tail)

    def convert(self, hf_dir: Path, outfile: Path, outtype: str, extra: list[str] = ()) -> tuple[bool, str, list[str]]:
        args = [str(hf_dir), "--outtype", outtype, "--outfile", str(outfile), *extra]
        cmd = [sys.executable, "-m", "tools.hf_to_gguf", str(self.llama_cpp_dir), *args]
        ok, tail = self.run(cmd, outfile.stem)
        shown = ["python", "-m", "tools.hf_to_gguf", "{llama.cpp}"] + [self.placeholder(a) for a in args]
        return ok, tail, shown

    def tool(self, name: str, args: list, log_name: str) -> tuple[bool, str, list[str]]:
        """Run a llama.cpp tool inside --work with file arguments relative to it: llama-imatrix and
        llama-quantize copy the imatrix and calibration file names into the GGUF metadata."""
        rel = [os.path.relpath(a, self.work) if isinstance(a, Path) else a for a in args]
        ok, tail = self.run([str(self.llama_bin / name), *rel], log_name, cwd=self.work)
        return ok, tail, [name, *rel]


def versions(llama_cpp_dir: Path) -> dict:
    import tokenizers
    import torch
    import transformers

    commit = LLAMA_CPP_COMMIT
    try:
        got = subprocess.run(["git", "-C", str(llama_cpp_dir), "rev-parse", "--short=7", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        if got:
            commit = got
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "tokenizers": tokenizers.__version__, "llama.cpp": commit, "llama.cpp_source": LLAMA_CPP_SOURCE}


# ---------------------------------------------------------------------------------------------

class Catalog:
    """golden/models/manifest.json as it is rebuilt: the files made, the ones that failed, each
    made file with its sha256, tensor types and how it was made."""

    def __init__(self, out: Path, vers: dict):
        self.out, self.vers, self.path = out, vers, out / "manifest.json"
        old = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.files: dict[str, dict] = {e["name"]: e for e in old.get("files", [])}
        self.failures: dict[str, str] = dict(old.get("failed", {}))
        self.today = today()

    def record(self, path: Path, role: str, ckpt: str, config: dict, made: dict) -> None:
        self.files[path.name] = {
            "name": path.name, "role": role, "sha256": sha256(path), "size": path.stat().st_size,
            "tensor_types": tensor_types(path), "checkpoint": ckpt, "config": config, "made": made,
            "versions": self.vers, "date": self.today,
        }
        self.failures.pop(path.name, None)
        log(f"  wrote {path.name} ({path.stat().st_size / 1e6:.2f} MB)")

    def fail(self, name: str, why: str) -> None:
        self.failures[name] = why
        self.files.pop(name, None)
        (self.out / name).unlink(missing_ok=True)
        log(f"  FAILED {name}: {why.splitlines()[-1] if why else ''}")

    def converted(self, run: tuple, dst: Path, role: str, ckpt: str, config: dict, **made) -> None:
        ok, tail, shown = run  # Runner.convert's or Runner.tool's (ok, log tail, command shown)
        if ok:
            self.record(dst, role, ckpt, config, {"convert": shown, **made})
        else:
            self.fail(dst.name, tail)

    def write(self, ids: dict[str, int]) -> None:
        manifest = {
            "about": "Tiny Muse-Glimmer models made by tools/regen/make_tiny.py; see golden/README.md.",
            "tokenizer": {"vocab_size": VOCAB_SIZE, "special_ids": ids, "pre": "llama4",
                          "corpus": "tools/data/tiny_corpus.txt"},
            "files": [self.files[k] for k in sorted(self.files)],
            "failed": dict(sorted(self.failures.items())),
        }
        artifacts.write_json(self.path, manifest, GoldenError)
        total = sum(p.stat().st_size for p in self.out.iterdir() if p.is_file())
        log(f"done: {len(self.files)} files, {total / 1e6:.1f} MB in {self.out.name}/, {len(self.failures)} failed")


def save_checkpoint(model, hf_dir: Path, out: Path, name: str) -> dict:  # -> its config.json, copied into out
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    model.save_pretrained(hf_dir)
    shutil.copyfile(hf_dir / "config.json", out / f"{name}.config.json")
    return json.loads((hf_dir / "config.json").read_text())


def build_checkpoints(tok, ids: dict[str, int], template: str, work: Path, out: Path) -> dict[str, dict]:
    """The transformers checkpoints under work/ -> {name: config} of the text models and the drafter."""
    configs: dict[str, dict] = {}
    for name, spec in TEXT_MODELS.items():
        log(f"building {name} (transformers)")
        model = text_checkpoint(spec, ids)
        log(f"  {name}: {peakedness(model, VOCAB_SIZE, spec['seed'])}")
        configs[name] = save_checkpoint(model, work / name, out, name)
        save_tokenizer(tok, template, work / name)
        write_preprocessor_config(work / name)
        write_video_preprocessor_config(work / name)
    log(f"building {DRAFTER['name']} (transformers)")
    configs[DRAFTER["name"]] = save_checkpoint(drafter_checkpoint(ids), work / DRAFTER["name"], out, DRAFTER["name"])
    return configs


def importance_matrix(runner, catalog: Catalog, name: str, work: Path) -> dict:  # -> the imatrix's manifest entry
    log(f"computing the importance matrix for {name}")
    calib, imatrix = work / CORPUS.name, work / f"{name}.imatrix.gguf"
    shutil.copyfile(CORPUS, calib)
    ok, tail, shown = runner.tool("llama-imatrix", ["-m", catalog.out / f"{name}-f32.gguf", "-f", calib, "-o", imatrix,
                                                    *IMATRIX_ARGS], f"{name}-imatrix")
    if not ok:
        log(f"  imatrix failed: {tail}")
    return {"command": shown, "cwd": "{work}", "calibration": "tools/data/tiny_corpus.txt",
            "sha256": sha256(imatrix) if ok else None, "ok": ok, "path": imatrix}


def quantize_text(runner, catalog: Catalog, name: str, config: dict, work: Path) -> None:
    """llama-quantize of name-f32.gguf into every QUANT_TYPES file, the importance matrix made once
    for the types that need one."""
    src, made_imatrix = catalog.out / f"{name}-f32.gguf", None
    for suffix, qtype, needs_imatrix in QUANT_TYPES:
        dst = catalog.out / f"{name}-{suffix}.gguf"
        qargs = []
        if needs_imatrix:
            made_imatrix = made_imatrix or importance_matrix(runner, catalog, name, work)
            if not made_imatrix["ok"]:
                catalog.fail(dst.name, "llama-imatrix failed")
                continue
            qargs = ["--imatrix", made_imatrix["path"]]
        log(f"quantizing {dst.name}")
        ok, tail, shown = runner.tool("llama-quantize", [*qargs, src, dst, qtype, "2"], dst.stem)
        if not ok:
            catalog.fail(dst.name, tail)
            continue
        made = {"convert": catalog.files.get(src.name, {}).get("made", {}).get("convert"),
                "quantize": shown, "cwd": "{work}"}
        if needs_imatrix:
            made["imatrix"] = {k: v for k, v in made_imatrix.items() if k != "path"}
        catalog.record(dst, "text", name, config, made)


def add_video_extension(catalog: Catalog, hf_dir: Path, config: dict) -> None:
    """tiny-a-mmproj-video-f32.gguf: the f32 mmproj with tools.video_mmproj's extension."""
    from tools.regen.video_mmproj import extend

    src, dst = catalog.out / f"{MMPROJ_OF}-mmproj-f32.gguf", catalog.out / f"{MMPROJ_OF}-mmproj-video-f32.gguf"
    log(f"adding the video extension: {dst.name}")
    extend(src, hf_dir, dst)
    made = {"convert": catalog.files.get(src.name, {}).get("made", {}).get("convert"),
            "extend": ["python", "-m", "tools.video_mmproj", "--mmproj", "{out}/" + src.name,
                       "--checkpoint", "{work}/" + MMPROJ_OF, "-o", "{out}/" + dst.name]}
    catalog.record(dst, "mmproj", MMPROJ_OF, config, made)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-dir", required=True, type=Path, help="llama.cpp source tree")
    ap.add_argument("--llama-bin", type=Path, help="llama-quantize/llama-imatrix dir (default DIR/build/bin)")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "models")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "tiny")
    ap.add_argument("--only", choices=["text", "quant", "mmproj", "dflash"], action="append",
                    help="do only these stages (repeatable; default all). Needs earlier stages' files.")
    args = ap.parse_args(argv)

    import torch

    torch.use_deterministic_algorithms(True)
    stages = set(args.only or ["text", "quant", "mmproj", "dflash"])
    llama_dir = args.llama_cpp_dir.resolve()
    out, work = args.out.resolve(), args.work.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(llama_dir, (args.llama_bin or llama_dir / "build" / "bin").resolve(), work, out)
    catalog = Catalog(out, versions(llama_dir))

    log("training the tiny tokenizer")
    tok = build_tokenizer()
    ids = special_ids(tok)
    template = (llama_dir / "models" / "templates" / "muse-glimmer.jinja").read_text(encoding="utf-8")
    log(f"  vocab {tok.get_vocab_size()}, special ids {ids[SPECIAL_TOKENS[0]]}..{ids[SPECIAL_TOKENS[-1]]}")
    configs = build_checkpoints(tok, ids, template, work, out)

    for name in TEXT_MODELS:
        for t in CONVERT_TYPES if "text" in stages else ():
            dst = out / f"{name}-{t}.gguf"
            log(f"converting {dst.name}")
            catalog.converted(runner.convert(work / name, dst, t), dst, "text", name, configs[name])
        if "quant" in stages:
            quantize_text(runner, catalog, name, configs[name], work)
    for t in ("f32", "f16") if "mmproj" in stages else ():
        dst = out / f"{MMPROJ_OF}-mmproj-{t}.gguf"
        log(f"converting {dst.name}")
        catalog.converted(runner.convert(work / MMPROJ_OF, dst, t, ["--mmproj"]), dst, "mmproj", MMPROJ_OF,
                          configs[MMPROJ_OF])
    if "mmproj" in stages:
        add_video_extension(catalog, work / MMPROJ_OF, configs[MMPROJ_OF])
    if "dflash" in stages:
        dst = out / f"{DRAFTER['name']}-f32.gguf"
        log(f"converting {dst.name}")
        run = runner.convert(work / DRAFTER["name"], dst, "f32", ["--target-model-dir", str(work / DRAFTER["target"])])
        catalog.converted(run, dst, "dflash", DRAFTER["name"], configs[DRAFTER["name"]], target=DRAFTER["target"])
    catalog.write(ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
