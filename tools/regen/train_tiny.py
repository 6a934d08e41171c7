"""Train the small default Muse-Glimmer model (golden/models/glimmer-default-*.gguf) and its drafter.

    python -m tools.train_tiny --llama-cpp-dir LLAMA_CPP [--llama-bin DIR] [--work build/train]
                               [--out golden/models] [--only STAGE ...]

Stages, in order (each reads what the earlier ones wrote; seeded, so a rerun with the same Python,
torch and thread count gives the same weights):
- corpus: the docstrings of the pure-Python standard library of the running interpreter (PSF
  licence), read with `ast` from the source files (nothing is imported), one document per docstring,
  repeats dropped; whole modules are held out by a hash of their name;
- target: make_tiny's byte-level BPE tokenizer (Llama-4 split, the model's special tokens at the end,
  the real chat template) trained on the training split, then a MuseGlimmerForConditionalGeneration
  with every text feature on, trained with AdamW on windows of BOS doc EOS BOS doc EOS ...; its
  matrices are rounded to f16 at the end, so the f16 GGUF holds exactly the trained weights;
- drafter: a MuseGlimmerAssistantModel distilled from the target: the target's greedy
  continuations of training prefixes give the token blocks, its hidden states at the target layers
  the context, and the drafter learns the next block_size - 1 greedy tokens after every anchor;
- convert: llama.cpp's converter (tools/regen/hf_to_gguf.py) writes the text, mmproj and drafter GGUFs
  and their entries in golden/models/manifest.json;
- prompts: golden/prompts/glimmer-default.jsonl, the first words of held-out docstring lines;
- goldens: tools.golden with llama.cpp (64-token greedy continuations) and transformers;
- acceptance: llama-server's DFlash speculative decoding on the same prompts (LLAMA_BIN holds it);
- eval: golden/models/glimmer-default.eval.json: corpus provenance, losses, a held-out sample,
  the corpus's words and llama-server's acceptance.

The work directory (corpus, HF checkpoints) is not committed. The committed model's run, on 2
shared cores (its eval.json): 2926 s for the target, 804 s (787 CPU s) for the drafter.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from tools.regen import make_tiny
from tools.common import REPO, sha256, today
from tools.regen.make_tiny import (BOS, EOS, Runner, save_tokenizer, special_ids, tensor_types, versions,
                             write_preprocessor_config)

NAME = "glimmer-default"
GGUF_TYPE = "f16"
THREADS = 2

# 5 layers (not a multiple of 4): HF's layer_types make 0 and 4 full (NoPE), 1-3 sliding; GQA 2:1;
# head_dim 16 != n_embd / n_head. Sized so that the text GGUF is about 1.3 MB in f16.
TEXT = dict(
    seed=2001, hidden_size=128, intermediate_size=192, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=24, final_logit_softcapping=30.0,
    output_multiplier=0.8, qk_scale_factor=3.0, rms_norm_eps=1e-5, rope_theta=10000.0,
)
# the tiny vision tower of make_tiny at half width (the projector is random: no image data)
VISION = dict(make_tiny.VISION, hidden_size=32, intermediate_size=64)
PROJECTOR_HIDDEN = 64
# one full-attention layer: transformers' and llama.cpp's window rules differ, a full layer has none;
# sliding_window 0 makes the converter write no window (llama.cpp refuses one without a sliding layer).
# block_size 4 = llama.cpp's default --spec-draft-n-max 3 + the anchor; GGUF target_layers [2, 4].
DRAFTER = dict(
    seed=2003, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    layer_types=["full_attention"], sliding_window=0, block_size=4, target_layer_ids=[1, 3],
)
TRAIN = dict(steps=1000, batch=16, seq=128, lr=3e-3, warmup=60, final_lr=0.1, weight_decay=0.1,
             clip=1.0, seed=2002)
DISTILL = dict(sequences=4096, prefix=12, generate=52, generate_batch=128, batch=32, steps=600, lr=2e-3,
               warmup=40, final_lr=0.1, weight_decay=0.01, clip=1.0, seed=2004)
HELD_OUT_EVERY = 10        # a module is held out when sha256(name) % 10 == 0
N_PROMPTS, PROMPT_TOKENS = 10, 12  # BOS + words: 12 rows of 2 KB per golden prompt
EVAL_SAMPLE = (2, 128)     # held-out windows kept in the eval file: [n, tokens]


def log(msg: str) -> None:  # a timestamped progress line on stdout
    print(f"[train_tiny {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# corpus

def stdlib_sources() -> list[tuple[str, Path]]:  # -> sorted (module name, file) of the stdlib's .py files
    """Pure-Python modules of the running interpreter, without test packages (their docstrings
    describe tests) and without site-packages or build directories (not identifiers)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if not all(p.isidentifier() for p in parts) or {"test", "tests", "idle_test"} & set(parts):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append((name, path))
    return found


def docstrings(source: bytes) -> list[str]:  # a module's source -> its docstrings in source order
    tree = ast.parse(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    return [d for d in (ast.get_docstring(n, clean=True) for n in nodes) if d]


def held_out(module: str) -> bool:  # module name -> in the held-out split
    return int(hashlib.sha256(module.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def extract_corpus(work: Path) -> dict:  # writes work/corpus/{train,heldout}.json -> provenance
    seen, split, modules = set(), {"train": [], "heldout": []}, []
    for name, path in stdlib_sources():
        try:
            docs = docstrings(path.read_bytes())
        except (SyntaxError, ValueError):  # lib2to3 test data and the like: not Python 3
            continue
        modules.append(name)
        for doc in docs:
            if doc not in seen:
                seen.add(doc)
                split["heldout" if held_out(name) else "train"].append(doc)
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    prov = {"source": "docstrings of the Python standard library (PSF licence), read with ast from the "
                      "source files; one document per docstring (ast.get_docstring, clean=True), first "
                      "occurrence kept; a module is held out when int(sha256(name), 16) % 10 == 0",
            "python": sys.version.split()[0], "modules": modules}
    for part, docs in split.items():
        data = json.dumps(docs, ensure_ascii=False).encode("utf-8")
        (out / f"{part}.json").write_bytes(data)
        prov[part] = {"documents": len(docs), "characters": sum(map(len, docs)),
                      "sha256": hashlib.sha256(data).hexdigest()}
    (out / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n", encoding="utf-8")
    log(f"corpus: {len(modules)} modules, train {prov['train']}, held out {prov['heldout']}")
    return prov


def read_split(work: Path, part: str) -> list[str]:  # "train" | "heldout" -> its docstrings
    return json.loads((work / "corpus" / f"{part}.json").read_text(encoding="utf-8"))


def train_tokenizer(work: Path):  # -> tokenizers.Tokenizer
    """make_tiny's tokenizer trained on the training docstrings, written one document after another
    to a text file (make_tiny trains on a file's lines)."""
    text = work / "corpus" / "train.txt"
    text.write_text("\n\n".join(read_split(work, "train")) + "\n", encoding="utf-8")
    return make_tiny.build_tokenizer(text)


def token_stream(tok, docs: list[str]) -> np.ndarray:  # -> int64 [n]: BOS doc EOS BOS doc EOS ...
    eos = tok.token_to_id(EOS)
    ids = [e.ids + [eos] for e in tok.encode_batch(docs)]  # the post-processor adds BOS
    return np.fromiter((t for doc in ids for t in doc), dtype=np.int64)


def load_tokenizer(work: Path):  # -> the trained tokenizers.Tokenizer saved with the checkpoint
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(work / NAME / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# the target

def lr_at(step: int, cfg: dict) -> float:  # linear warm-up, then cosine down to final_lr * lr
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    t = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * (cfg["final_lr"] + (1 - cfg["final_lr"]) * 0.5 * (1 + math.cos(math.pi * t)))


def optimizer(model, cfg: dict):  # -> AdamW, weight decay on matrices only
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95))


def step(model, opt, loss, lr: float, clip: float) -> float:  # one optimiser step -> grad norm
    import torch

    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
    opt.step()
    return float(norm)


def lm_loss(model, windows):  # windows [B, T + 1] -> mean next-token cross-entropy (nats)
    import torch

    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def held_out_loss(model, stream: np.ndarray, seq: int, batch: int = 32) -> tuple[float, int]:
    """Mean cross-entropy over every non-overlapping window of seq + 1 tokens -> (nats, tokens)."""
    import torch

    n = (len(stream) - 1) // seq
    windows = torch.from_numpy(np.stack([stream[i * seq:i * seq + seq + 1] for i in range(n)]))
    total = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            total += float(lm_loss(model, windows[i:i + batch])) * len(windows[i:i + batch])
    model.train()
    return total / n, n * seq


def round_to_f16(model) -> None:  # matrices -> f16-representable f32 (the f16 GGUF stores them exactly)
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(p.to(torch.float16).to(torch.float32))


def train_target(work: Path, llama_dir: Path) -> dict:  # writes work/<NAME>/ -> the training report
    import torch

    log("training the tokenizer on the training split")
    tok = train_tokenizer(work)
    ids = special_ids(tok)
    train = token_stream(tok, read_split(work, "train"))
    heldout = token_stream(tok, read_split(work, "heldout"))
    log(f"  tokens: train {len(train)}, held out {len(heldout)}")
    # make_tiny's init at unit head gain (N(0, 1/fan_in) matrices): training sets the logit spread
    model = make_tiny.text_checkpoint(TEXT, ids, VISION, PROJECTOR_HIDDEN, lm_head_gain=1.0)
    model.train()
    cfg = TRAIN
    untrained, n_eval = held_out_loss(model, heldout, cfg["seq"])
    log(f"  untrained held-out loss {untrained:.4f} over {n_eval} tokens (ln V = {math.log(make_tiny.VOCAB_SIZE):.4f})")
    opt = optimizer(model, cfg)
    gen = np.random.default_rng(cfg["seed"])
    curve, t0, cpu0 = [], time.perf_counter(), time.process_time()
    for i in range(cfg["steps"]):
        starts = gen.integers(0, len(train) - cfg["seq"] - 1, cfg["batch"])
        windows = torch.from_numpy(np.stack([train[s:s + cfg["seq"] + 1] for s in starts]))
        loss = lm_loss(model, windows)
        norm = step(model, opt, loss, lr_at(i, cfg), cfg["clip"])
        if i % 20 == 0 or i == cfg["steps"] - 1:
            curve.append([i, round(loss.item(), 4)])
            log(f"  step {i}/{cfg['steps']} loss {loss.item():.4f} grad norm {norm:.2f} "
                f"lr {lr_at(i, cfg):.2e} ({time.perf_counter() - t0:.0f} s)")
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    round_to_f16(model)
    trained, _ = held_out_loss(model, heldout, cfg["seq"])
    train_loss, n_train = held_out_loss(model, train[:len(heldout)], cfg["seq"])
    log(f"  held-out loss {trained:.4f} (training split, first {n_train} tokens: {train_loss:.4f}), {seconds:.0f} s")

    hf_dir = work / NAME
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    model.eval().save_pretrained(hf_dir)
    template = (llama_dir / "models" / "templates" / "muse-glimmer.jinja").read_text(encoding="utf-8")
    save_tokenizer(tok, template, hf_dir)
    write_preprocessor_config(hf_dir)
    report = {"train": cfg, "threads": THREADS, "seconds": round(seconds), "cpu_seconds": round(cpu_seconds),
              "tokens_seen": cfg["steps"] * cfg["batch"] * cfg["seq"],
              "train_tokens": len(train), "heldout_tokens": len(heldout), "eval_tokens": n_eval,
              "untrained_loss": untrained, "heldout_loss": trained, "train_split_loss": train_loss,
              "ln_vocab": math.log(make_tiny.VOCAB_SIZE), "curve": curve}
    (work / "target.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


# ---------------------------------------------------------------------------------------------
# the drafter

def load_target(work: Path):  # -> the trained MuseGlimmerForConditionalGeneration, f32, eval mode
    import torch
    from transformers import MuseGlimmerForConditionalGeneration

    return MuseGlimmerForConditionalGeneration.from_pretrained(work / NAME, dtype=torch.float32).eval()


def prefixes(stream: np.ndarray, bos: int, n: int, length: int, seed: int) -> np.ndarray:
    """[n, length] windows of the stream: half start at a document (BOS), half anywhere."""
    gen = np.random.default_rng(seed)
    doc_starts = np.flatnonzero(stream[:-length] == bos)
    starts = np.concatenate([gen.choice(doc_starts, n // 2, replace=False),
                             gen.integers(0, len(stream) - length, n - n // 2)])
    return np.stack([stream[s:s + length] for s in starts])


def greedy_continuations(target, prefix: np.ndarray, n: int, batch: int):  # [N, P] -> [N, P + n]
    """The target's argmax continuation of every prefix (no stop at EOS: the drafter also learns
    what the target does after it)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(prefix), batch):
            seq = torch.from_numpy(prefix[i:i + batch])
            step_out = target(input_ids=seq, use_cache=True)
            for j in range(n):
                next_ids = step_out.logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, next_ids], 1)
                if j < n - 1:
                    step_out = target(input_ids=next_ids, past_key_values=step_out.past_key_values, use_cache=True)
            out.append(seq)
    return torch.cat(out)


def target_features(target, seqs, layer_ids: list[int], batch: int = 64):  # [N, T] -> [N, T, len(ids) * E]
    """The residual stream after each HF target layer in layer_ids (hidden_states[i + 1]): what
    llama.cpp captures as the input of GGUF layer i + 1."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            hs = target(input_ids=seqs[i:i + batch], output_hidden_states=True).hidden_states
            out.append(torch.cat([hs[k + 1] for k in layer_ids], -1))
    return torch.cat(out)


def block_batch(seqs, first_anchor: int, block: int, mask_id: int):
    """Every anchor a >= first_anchor of sequences [B, T] as one drafter pass: the block
    [seq[a], MASK x (block - 1)] at positions a .. a + block - 1 sees the context rows < a and its
    own rows (llama.cpp's drafter mask, no causal cut inside the block).
    -> block ids [B, K * block], labels [B, K, block - 1], position ids [B, T + K * block], additive
    mask [1, 1, K * block, T + K * block]."""
    import torch

    n, t = seqs.shape
    anchors = torch.arange(first_anchor, t - block + 1)
    offsets = torch.arange(block)
    ids = torch.full((n, len(anchors), block), mask_id, dtype=seqs.dtype)
    ids[:, :, 0] = seqs[:, anchors]
    labels = seqs[:, anchors[:, None] + offsets[None, 1:]]
    positions = torch.cat([torch.arange(t), (anchors[:, None] + offsets).reshape(-1)]).expand(n, -1)
    query_anchor = anchors.repeat_interleave(block)
    sees_context = torch.arange(t)[None, :] < query_anchor[:, None]
    same_block = query_anchor[:, None] == query_anchor[None, :]
    visible = torch.cat([sees_context, same_block], 1)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    return ids.reshape(n, -1), labels, positions, mask


def draft_logits(drafter, target, features, seqs, first_anchor: int):  # -> [B, K, block, V], labels [B, K, block - 1]
    """The drafter on every anchor of the sequences: raw target embedding rows in (no embedding
    norm), the target's output matrix out (no logit scale, no softcap), as llama.cpp runs it."""
    cfg = drafter.config
    ids, labels, positions, mask = block_batch(seqs, first_anchor, cfg.block_size, cfg.mask_token_id)
    embeds = target.get_input_embeddings().weight[ids]
    hidden = drafter(noise_embeds=embeds, context_hidden_states=features, position_ids=positions,
                     attention_mask={"full_attention": mask}, use_cache=False).last_hidden_state
    logits = hidden @ target.lm_head.weight.T
    return logits.reshape(*labels.shape[:2], cfg.block_size, -1), labels


def draft_accuracy(drafter, target, features, seqs, first_anchor: int) -> dict:
    """Top-1 agreement of each draft row with the target's greedy token, and the share of drafts a
    greedy verifier would accept (the drafts up to the first miss)."""
    import torch

    with torch.no_grad():
        logits, labels = draft_logits(drafter, target, features, seqs, first_anchor)
    hit = (logits[:, :, 1:].argmax(-1) == labels)
    accepted = torch.cumprod(hit.to(torch.int64), -1).sum(-1)
    return {"row_top1": [round(float(v), 4) for v in hit.float().mean((0, 1))],
            "accepted_share": round(float(accepted.float().mean()) / hit.shape[-1], 4)}


def train_drafter(work: Path) -> dict:  # writes work/<NAME>-dflash/ -> the distillation report
    import torch

    cfg = DISTILL
    target = load_target(work)
    for p in target.parameters():
        p.requires_grad_(False)
    tok = load_tokenizer(work)
    special = special_ids(tok)
    train = token_stream(tok, read_split(work, "train"))
    heldout = token_stream(tok, read_split(work, "heldout"))
    n_eval = 256
    log(f"drafter: greedy continuations of {cfg['sequences']} + {n_eval} prefixes")
    seqs = greedy_continuations(target, prefixes(train, special[BOS], cfg["sequences"], cfg["prefix"], cfg["seed"]),
                                cfg["generate"], cfg["generate_batch"])
    eval_seqs = greedy_continuations(target, prefixes(heldout, special[BOS], n_eval, cfg["prefix"], cfg["seed"] + 1),
                                     cfg["generate"], cfg["generate_batch"])
    layer_ids = DRAFTER["target_layer_ids"]
    features = target_features(target, seqs, layer_ids)
    eval_features = target_features(target, eval_seqs, layer_ids)
    log(f"  features {list(features.shape)}")

    drafter = make_tiny.drafter_checkpoint(special, DRAFTER)
    drafter.train()
    first = cfg["prefix"] - 1  # the last prompt token is the first anchor; its block is all greedy tokens
    untrained = draft_accuracy(drafter, target, eval_features, eval_seqs, first)
    opt = optimizer(drafter, cfg)
    gen = np.random.default_rng(cfg["seed"])
    curve, t0, cpu0 = [], time.perf_counter(), time.process_time()
    for i in range(cfg["steps"]):
        pick = torch.from_numpy(gen.integers(0, len(seqs), cfg["batch"]))
        logits, labels = draft_logits(drafter, target, features[pick], seqs[pick], first)
        loss = torch.nn.functional.cross_entropy(logits[:, :, 1:].reshape(-1, logits.shape[-1]), labels.reshape(-1))
        norm = step(drafter, opt, loss, lr_at(i, cfg), cfg["clip"])
        if i % 20 == 0 or i == cfg["steps"] - 1:
            curve.append([i, round(loss.item(), 4)])
            log(f"  drafter step {i}/{cfg['steps']} loss {loss.item():.4f} grad norm {norm:.2f} "
                f"({time.perf_counter() - t0:.0f} s)")
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    round_to_f16(drafter)
    drafter.eval()
    trained = draft_accuracy(drafter, target, eval_features, eval_seqs, first)
    log(f"  held-out drafts: untrained {untrained}, trained {trained}, {seconds:.0f} s")
    d_dir = work / f"{NAME}-dflash"
    if d_dir.exists():
        shutil.rmtree(d_dir)
    drafter.save_pretrained(d_dir)
    report = {"distill": cfg, "drafter": DRAFTER, "seconds": round(seconds), "cpu_seconds": round(cpu_seconds),
              "untrained": untrained, "heldout": trained, "heldout_sequences": n_eval, "curve": curve}
    (work / "drafter.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


# ---------------------------------------------------------------------------------------------
# GGUFs, prompts, goldens, evaluation

WEIGHTS = {"text": "trained on the docstrings of the Python standard library (training split)",
           "mmproj": "random vision tower and projector (no image data), sized to the text model",
           "dflash": f"distilled from {NAME}'s greedy continuations of training-split prefixes"}


def convert(work: Path, out: Path, runner: Runner, llama_dir: Path) -> None:
    """The three f16 GGUFs and their manifest entries (other entries are kept)."""
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    files = {e["name"]: e for e in manifest["files"]}
    vers = versions(llama_dir)
    date = today()
    target, drafter = work / NAME, work / f"{NAME}-dflash"
    jobs = [(f"{NAME}-{GGUF_TYPE}.gguf", "text", target, []),
            (f"{NAME}-mmproj-{GGUF_TYPE}.gguf", "mmproj", target, ["--mmproj"]),
            (f"{NAME}-dflash-{GGUF_TYPE}.gguf", "dflash", drafter, ["--target-model-dir", str(target)])]
    for name, role, hf_dir, extra in jobs:
        dst = out / name
        log(f"converting {name}")
        ok, tail, shown = runner.convert(hf_dir, dst, GGUF_TYPE, extra)
        if not ok:
            raise SystemExit(f"converting {name} failed:\n{tail}")
        shutil.copyfile(hf_dir / "config.json", out / f"{hf_dir.name}.config.json")
        made = {"convert": shown, "tool": f"python -m tools.train_tiny (figures: {NAME}.eval.json)",
                "weights": WEIGHTS[role]}
        if role == "dflash":
            made["target"] = NAME
        files[name] = {"name": name, "role": role, "sha256": sha256(dst), "size": dst.stat().st_size,
                       "tensor_types": tensor_types(dst), "checkpoint": hf_dir.name,
                       "config": json.loads((hf_dir / "config.json").read_text(encoding="utf-8")),
                       "made": made, "versions": vers, "date": date}
        log(f"  wrote {name} ({dst.stat().st_size / 1e6:.2f} MB)")
    manifest["files"] = [files[k] for k in sorted(files)]
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def prompt_cut(tok, line: str) -> str:  # -> the longest run of whole words whose BOS + tokens fit PROMPT_TOKENS
    words = line.split(" ")
    fits = [k for k in range(1, len(words) + 1) if len(tok.encode(" ".join(words[:k])).ids) <= PROMPT_TOKENS]
    return " ".join(words[:max(fits, default=0)])


def heldout_prompts(work: Path, tok) -> list[dict]:  # -> prompt lines of golden/prompts/<NAME>.jsonl
    """N_PROMPTS held-out docstring lines, evenly spread over those whose first three words or more
    fit BOS + PROMPT_TOKENS - 1 tokens, each cut after its last whole word that fits (so the text
    gives back the same ids)."""
    lines = list(dict.fromkeys(line.strip() for doc in read_split(work, "heldout") for line in doc.splitlines()))
    cuts = [(line, prompt_cut(tok, line)) for line in lines if len(line) >= 40 and line[0].isalpha()]
    cuts = [(line, text) for line, text in cuts if len(text.split(" ")) >= 3]
    prompts = []
    for i in range(N_PROMPTS):
        line, text = cuts[i * len(cuts) // N_PROMPTS]
        prompts.append({"id": f"heldout-{i:02d}", "token_ids": tok.encode(text).ids, "prompt_text": text,
                        "line": line})
    return prompts


def corpus_words(docs: list[str], min_count: int = 5) -> list[str]:  # -> sorted words of 3+ letters seen min_count times
    counts: dict[str, int] = {}
    for doc in docs:
        for word in doc.lower().split():
            word = word.strip(".,;:()[]'\"`")
            if len(word) >= 3 and word.isalpha():
                counts[word] = counts.get(word, 0) + 1
    return sorted(w for w, n in counts.items() if n >= min_count)


def sample_loss(work: Path, windows: np.ndarray) -> float:  # transformers' mean cross-entropy on [n, T + 1]
    import torch

    with torch.no_grad():
        return float(lm_loss(load_target(work), torch.from_numpy(windows)))


def write_eval(work: Path, out: Path, prompts_path: Path) -> None:
    """golden/models/<name>.eval.json: corpus provenance, training figures (transformers, f32), a
    held-out sample with its loss, the corpus's words, llama-server's speculative acceptance."""
    tok = load_tokenizer(work)
    heldout = token_stream(tok, read_split(work, "heldout"))
    n, t = EVAL_SAMPLE
    sample = np.stack([heldout[i * t:(i + 1) * t + 1] for i in range(n)])
    target = json.loads((work / "target.json").read_text(encoding="utf-8"))
    drafter = json.loads((work / "drafter.json").read_text(encoding="utf-8"))
    evaluation = {
        "about": f"How {NAME} was trained and what it scored; losses are mean next-token cross-entropy "
                 "in nats, computed by transformers 5.23.0 (float32) on the checkpoint whose matrices "
                 "the f16 GGUF holds exactly",
        "corpus": json.loads((work / "corpus" / "provenance.json").read_text(encoding="utf-8")),
        "tokenizer": {"vocab_size": make_tiny.VOCAB_SIZE, "special_ids": special_ids(tok),
                      "trained_on": "the training split", "made": "tools.make_tiny.build_tokenizer"},
        "target": target,
        "heldout_sample": {"token_ids": sample.tolist(), "loss": sample_loss(work, sample),
                           "what": f"the first {n} windows of {t + 1} tokens of the held-out stream"},
        "drafter": drafter,
        "prompts": prompts_path.name,
        "corpus_words": {"what": "lower-case words of 3+ letters seen 5 times or more in the training split",
                         "words": corpus_words(read_split(work, "train"))},
    }
    if (work / "acceptance.json").exists():
        evaluation["speculative"] = json.loads((work / "acceptance.json").read_text(encoding="utf-8"))
    path = out / f"{NAME}.eval.json"
    path.write_text(json.dumps(evaluation, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {path.name}: held-out loss {target['heldout_loss']:.4f}, untrained {target['untrained_loss']:.4f}")


def golden_commands(work: Path, out: Path, prompts_path: Path, logits: Path) -> list[list[str]]:
    """tools.golden runs: llama.cpp with 64-token greedy continuations, transformers prompt logits
    only (golden/ must stay small)."""
    model = f"{NAME}-{GGUF_TYPE}"
    return [["--engine", "llama-cpp", "--model", str(out / f"{model}.gguf"), "--kv-type", "f32",
             "--flash-attn", "off", "--n-predict", "64", "--prompts", str(prompts_path),
             "--out", str(logits / "llama-cpp" / model / "kv-f32_fa-off")],
            ["--engine", "transformers", "--checkpoint", str(work / NAME), "--prompts", str(prompts_path),
             "--out", str(logits / "transformers" / NAME)]]


def server_acceptance(llama_bin: Path, out: Path, prompts: list[dict], n_predict: int, n_max: int) -> dict:
    """Speculative greedy decoding in llama-server (--spec-type draft-dflash) on every prompt:
    the tokens and, from the reply's timings, how many drafts it made and accepted."""
    import socket
    import subprocess

    from tools.common import GoldenError
    from tools.parity.engines.http import http_json
    from tools.parity.engines.llama_server import completion_request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", f"{NAME}-{GGUF_TYPE}.gguf", "-md", f"{NAME}-dflash-{GGUF_TYPE}.gguf", "--spec-type",
            "draft-dflash", "--spec-draft-n-max", str(n_max), "--spec-draft-p-min", "0", "-c", "512",
            "-np", "1", "-t", str(THREADS), "--temp", "0", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(llama_bin / "llama-server"), *args], cwd=str(out),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if http_json(f"{url}/health", timeout=1).get("status") == "ok":
                    break
            except GoldenError:  # not listening yet
                time.sleep(0.2)
        props = http_json(f"{url}/props")
        runs = []
        for p in prompts:
            reply = http_json(f"{url}/completion", completion_request(p["token_ids"], n_predict, 1))
            timings = reply["timings"]
            runs.append({"id": p["id"], "tokens": reply["tokens"], "drafted": timings.get("draft_n", 0),
                         "accepted": timings.get("draft_n_accepted", 0)})
    finally:
        server.terminate()
        server.wait(timeout=30)
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    return {"engine": f"llama-server {props.get('build_info', 'unknown')}",
            "command": ["llama-server", *args[:-4]], "request": completion_request([], n_predict, 1),
            "n_predict": n_predict, "spec_draft_n_max": n_max, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None, "runs": runs}


# ---------------------------------------------------------------------------------------------

STAGES = ["corpus", "target", "drafter", "convert", "prompts", "goldens", "acceptance", "eval"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-dir", required=True, type=Path, help="llama.cpp source tree")
    ap.add_argument("--llama-bin", type=Path, help="llama-server's directory (default DIR/build/bin)")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "models")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "train")
    ap.add_argument("--only", action="append", choices=STAGES,
                    help="run only these stages (repeatable; default all); later stages read earlier ones' files")
    args = ap.parse_args(argv)

    import subprocess

    import torch

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    stages = args.only or STAGES
    work, out, llama_dir = args.work.resolve(), args.out.resolve(), args.llama_cpp_dir.resolve()
    llama_bin = (args.llama_bin or llama_dir / "build" / "bin").resolve()
    prompts_path = out.parent / "prompts" / f"{NAME}.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    if "corpus" in stages:
        extract_corpus(work)
    if "target" in stages:
        train_target(work, llama_dir)
    if "drafter" in stages:
        train_drafter(work)
    if "convert" in stages:
        convert(work, out, Runner(llama_dir, llama_bin, work, out), llama_dir)
    if "prompts" in stages:
        prompts = heldout_prompts(work, load_tokenizer(work))
        prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
        log(f"wrote {prompts_path.name}: " + " | ".join(p["prompt_text"] for p in prompts))
    if "goldens" in stages:
        for cmd in golden_commands(work, out, prompts_path, out.parent / "logits"):
            log("python -m tools.golden " + " ".join(cmd))
            subprocess.run([sys.executable, "-m", "tools.golden", *cmd], cwd=str(REPO), check=True)
    if "acceptance" in stages:
        prompts = [json.loads(line) for line in prompts_path.read_text(encoding="utf-8").splitlines()]
        spec = server_acceptance(llama_bin, out, prompts, 64, DRAFTER["block_size"] - 1)
        (work / "acceptance.json").write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
        log(f"llama-server accepted {spec['accepted']} of {spec['drafted']} drafts")
    if "eval" in stages:
        write_eval(work, out, prompts_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
