"""Goldens for video input from transformers 5.23.0 with torchvision 0.28.0 (CPU); none comes from
this project's reference.

    python -m tools.make_video_goldens --checkpoint build/tiny/tiny-a --torchvision-site DIR [--out golden/video]

--checkpoint is tiny-a as tools/regen/make_tiny.py builds it (with its video_preprocessor_config.json);
golden/models/tiny-a-mmproj-video-f32.gguf is its mmproj with the video extension (tools.video_mmproj).
Frames are made here from integers only (tools.synthetic), so the tests rebuild them; their sha256
is in the manifest. Steps:
- preprocess: what MuseGlimmerVideoProcessor computes, step by step: sample_frames' indices over a
  sweep of (frames, source fps, fps, max frames), the float32 timestamps' strings, smart_resize's grid,
  the torchvision-resized uint8 frames (sha256 per frame, and the arrays of RESIZE_ARRAYS) and the
  patches (pixel_values_videos, sha256 of the float32 bytes) with video_grid_thw;
- llama-cpp: the extended mmproj loaded by llama.cpp's mtmd (llama-cpp-python 0.3.36, CPU): the
  sha256 of its image embeddings for LLAMA_CASES of tools/regen/make_vision_goldens.py, which the
  tests compare with the committed embeddings of the mmproj without the extension;
- videos: per video of VIDEOS, the video embeddings (vision_projection's output, before
  perception_emb_norm, float64 run stored float32, and a float32 run), the logits of every position of
  a chat prompt holding the video (float64), and 8 greedy tokens.

torchvision: the 0.28.0 wheel on PyPI is a CUDA build; its package __init__ loads the C extension
and registers fake kernels for its C ops (nms, ...), which fails against a CPU-only torch. The
transforms transformers calls (transforms.v2.functional.resize, normalize) are pure Python over
torch, so `load_torchvision` puts an empty `torchvision` package module (its real __path__, its
__init__ not run) in sys.modules and imports only those; install the wheel with
`pip install --no-deps --target DIR torchvision==0.28.0` and pass DIR.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
from tools.common import REPO, save_json, today
from tools.synthetic import synthetic_image

DATE = "2026-01-01"   # the chat template's current_date
PROMPT = "What happens in the video?"
N_GREEDY = 8
THREADS = 2

# name, frames, width, height, kind, first seed, source fps (None: unknown, sampled as 24)
VIDEOS = [
    ("pairs-8", 8, 200, 150, "noise", 300, 2.0),    # all 8 kept: 4 pairs of 10x14 patches, table 8x8 zero-padded, 4 windows a pair
    ("odd-11", 11, 130, 90, "smooth", 320, 5.0),    # an odd source sampled to 4 frames [0, 3, 6, 10], timestamps 0.0 and 1.2
    ("one-frame", 1, 60, 60, "smooth", 340, None),  # one frame, padded by repeating it to one pair; fps unknown
]
# (frames, source fps, fps, max frames): sample_frames over rates and counts where float32 linspace truncates
SAMPLING_SWEEP = [(t, s, f, m) for t in (1, 2, 3, 7, 8, 30, 97, 300, 352, 1000, 4097)
                  for s in (None, 1.0, 2.0, 23.976, 29.97, 30.0, 60.0) for f in (0.5, 2.0, 7.0) for m in (8, 96)]
# resize cases, each a 2-frame noise video: (width, height, max_frame_tokens); up, down, mixed, ties, tiny
RESIZE_CASES = [(200, 150, 36), (1920, 1080, 144), (1920, 800, 144), (640, 480, 144), (31, 17, 144),
                (56, 56, 144), (28, 300, 36), (500, 500, 144), (97, 311, 36), (1000, 29, 4), (300, 301, 144)]
RESIZE_ARRAYS = {(200, 150, 36), (97, 311, 36)}  # whose resized frames are committed as arrays


def load_torchvision(site: Path):  # -> torchvision.transforms.v2.functional, without torchvision's __init__
    sys.path.insert(0, str(site))
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--torchvision-site {site}: no torchvision package there")
    package = types.ModuleType("torchvision")
    package.__path__, package.__spec__, package.__file__ = list(spec.submodule_search_locations), spec, spec.origin
    sys.modules["torchvision"] = package
    from torchvision.transforms.v2 import functional
    return functional


def video_frames(entry) -> np.ndarray:  # VIDEOS entry -> uint8 [T, H, W, 3]
    _, n, w, h, kind, seed, _ = entry
    return np.stack([synthetic_image(w, h, seed + i, kind) for i in range(n)])


def sha256(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def metadata(n, fps):
    return {"total_num_frames": n, "fps": fps}


def preprocess_goldens(processor, out: Path) -> dict:
    import torch
    from transformers.video_utils import VideoMetadata

    sampling = []
    for t, s, f, m in SAMPLING_SWEEP:
        meta = VideoMetadata(total_num_frames=t, fps=s)
        idx = processor.sample_frames(meta, temporal_patch_size=processor.temporal_patch_size, num_frames=m, fps=f)
        meta.frames_indices = idx
        stamps = [processor.frame_timestamp_format.format(timestamp=ts) for ts in meta.timestamps]
        sampling.append({"frames": t, "source_fps": s, "fps": f, "max_frames": m, "indices": idx.tolist(),
                         "timestamps": stamps})
    resize = []
    (out / "resized").mkdir(parents=True, exist_ok=True)
    for i, (w, h, cap) in enumerate(RESIZE_CASES):
        frames = np.stack([synthetic_image(w, h, 400 + 2 * i + k, "noise") for k in range(2)])
        video = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]  # (B, T, C, H, W) uint8
        resized = processor.resize(video, resample=processor.resample, patch_size=processor.patch_size,
                                   merge_size=processor.merge_size, max_tokens=cap)[0].permute(0, 2, 3, 1).numpy()
        batch = processor(videos=[frames], video_metadata=[metadata(2, 2.0)], max_video_frame_tokens=cap,
                          return_tensors="pt")
        entry = {"width": w, "height": h, "max_frame_tokens": cap, "seeds": [400 + 2 * i, 401 + 2 * i], "kind": "noise",
                 "frames_sha256": sha256(frames), "resized_shape": list(resized.shape),
                 "resized_sha256": [sha256(f) for f in resized],
                 "grid_thw": batch["video_grid_thw"][0].tolist(),
                 "patches_sha256": sha256(batch["pixel_values_videos"].numpy().astype(np.float32)),
                 "patches_shape": list(batch["pixel_values_videos"].shape)}
        if (w, h, cap) in RESIZE_ARRAYS:
            entry["resized_file"] = f"resized/{w}x{h}-cap{cap}.npy"
            np.save(out / entry["resized_file"], resized, allow_pickle=False)
        resize.append(entry)
        print(f"preprocess {w}x{h} cap {cap}: {resized.shape[2]}x{resized.shape[1]}", flush=True)
    return {"sampling": sampling, "resize": resize}


def load_model(checkpoint: Path, dtype):
    from transformers import MuseGlimmerForConditionalGeneration

    return MuseGlimmerForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype,
                                                               attn_implementation="eager").eval()


def video_goldens(checkpoint: Path, processor_cls, out: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, MuseGlimmerImageProcessor, MuseGlimmerProcessor

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    vcfg = json.loads((checkpoint / "video_preprocessor_config.json").read_text())
    video_processor = processor_cls(**{k: v for k, v in vcfg.items() if k != "video_processor_type"})
    processor = MuseGlimmerProcessor(image_processor=MuseGlimmerImageProcessor(), video_processor=video_processor,
                                     tokenizer=tok, chat_template=tok.chat_template)
    models = {"float64": load_model(checkpoint, torch.float64), "float32": load_model(checkpoint, torch.float32)}
    (out / "videos").mkdir(parents=True, exist_ok=True)
    videos = {}
    for entry in VIDEOS:
        name, n, w, h, kind, seed, fps = entry
        frames = video_frames(entry)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, current_date=DATE)
        # MuseGlimmerProcessor reads video_metadata without asking for it: return_metadata must be passed.
        # A tensor: a one-frame NumPy video is taken for a list of images (a 3-D frame fails to permute).
        # The rendered template holds its BOS: no second one (apply_chat_template(tokenize=True) does the same)
        batch = processor(text=[text], videos=[torch.from_numpy(frames)], video_metadata=[metadata(n, fps)],
                          return_metadata=True, add_special_tokens=False, return_tensors="pt")
        record = {"frames": n, "width": w, "height": h, "kind": kind, "first_seed": seed, "fps": fps,
                  "frames_sha256": sha256(frames), "grid_thw": batch["video_grid_thw"][0].tolist(),
                  "indices": batch["video_metadata"][0].frames_indices.tolist(),
                  "patches_sha256": sha256(batch["pixel_values_videos"].numpy().astype(np.float32)),
                  "prompt_text": text, "prompt_ids": batch["input_ids"][0].tolist(), "files": {}}
        for dtype, model in models.items():
            with torch.no_grad():
                pixels = batch["pixel_values_videos"]
                feats = model.model.vision_tower(pixel_values=pixels, grid_thw=batch["video_grid_thw"]).last_hidden_state
                emb = model.model.vision_projection(model.model.vision_adapter(feats)).numpy()
            file = f"videos/{name}.embeddings.{dtype}.npy"
            np.save(out / file, emb.astype(np.float32), allow_pickle=False)
            record["files"][f"embeddings-{dtype}"] = file
        model = models["float64"]
        with torch.no_grad():
            logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values_videos",
                                                    "video_grid_thw")}).logits[0].numpy()
            ids = batch["input_ids"]
            greedy = []
            for _ in range(N_GREEDY):  # the whole sequence again each step: no cache, nothing to differ
                step = model(input_ids=ids, pixel_values_videos=batch["pixel_values_videos"],
                             video_grid_thw=batch["video_grid_thw"]).logits[0, -1]
                greedy.append(int(step.argmax()))
                ids = torch.cat([ids, torch.tensor([[greedy[-1]]])], dim=1)
        file = f"videos/{name}.logits.npy"
        np.save(out / file, logits.astype(np.float32), allow_pickle=False)
        record["files"]["logits"] = file
        record["greedy"] = greedy
        videos[name] = record
        print(f"video {name}: grid {record['grid_thw']}, {len(record['prompt_ids'])} prompt tokens, greedy {greedy}",
              flush=True)
    return {"videos": videos, "prompt": PROMPT, "chat_date": DATE,
            "options": {"dtype": "float64 (embeddings also float32)", "attn_implementation": "eager", "device": "cpu",
                        "embeddings": "vision_projection output before perception_emb_norm (the raw projection)",
                        "greedy": f"{N_GREEDY} argmax steps, each a full forward of the sequence"}}


LLAMA_CASES = ("rect-200x150", "square-336", "photo-640x480")
MMPROJ_VIDEO = REPO / "golden" / "models" / "tiny-a-mmproj-video-f32.gguf"


def llama_cpp_goldens(work: Path) -> dict:  # -> {mmproj, cases: {name: sha256 of mtmd's float32 embeddings}}
    import llama_cpp
    from tools.regen.make_vision_goldens import CASES, Mtmd, case_image, file_sha256, quiet_stderr

    llama_cpp.llama_backend_init()
    cases = {}
    with quiet_stderr(work / "llama.log"):
        for case in (c for c in CASES if c[0] in LLAMA_CASES):
            mtmd = Mtmd(llama_cpp, MMPROJ_VIDEO, False, case[5])
            emb, _ = mtmd.encode(case_image(case))
            mtmd.close()
            cases[case[0]] = sha256(emb.astype(np.float32))
    return {"version": f"llama-cpp-python {llama_cpp.__version__}, mtmd, CPU, flash attention off",
            "mmproj": {"file": MMPROJ_VIDEO.name, "sha256": file_sha256(MMPROJ_VIDEO)}, "cases": cases}


STEPS = ("preprocess", "llama-cpp", "videos")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="tiny-a's transformers directory")
    ap.add_argument("--torchvision-site", type=Path, required=True,
                    help="a directory holding torchvision 0.28.0 (pip install --no-deps --target DIR)")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "video")
    ap.add_argument("--step", action="append", choices=STEPS, help="only these parts (default: all)")
    args = ap.parse_args(argv)
    steps = set(args.step or STEPS)
    load_torchvision(args.torchvision_site)
    import torch
    import transformers
    from transformers.models.muse_glimmer.video_processing_muse_glimmer import MuseGlimmerVideoProcessor

    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    from importlib.metadata import version
    manifest.update(engine="transformers", date=today(),
                    version=f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}, "
                            f"torchvision {version('torchvision')} (transforms only, see load_torchvision), CPU",
                    checkpoint=args.checkpoint.name,
                    video_preprocessor_config=json.loads((args.checkpoint / "video_preprocessor_config.json").read_text()))
    if "preprocess" in steps:
        processor = MuseGlimmerVideoProcessor(max_video_frame_tokens=36)
        manifest["preprocess"] = preprocess_goldens(processor, args.out)
    if "llama-cpp" in steps:
        work = REPO / "build" / "video-goldens"
        work.mkdir(parents=True, exist_ok=True)
        manifest["llama-cpp"] = llama_cpp_goldens(work)
    if "videos" in steps:
        manifest.update(video_goldens(args.checkpoint, MuseGlimmerVideoProcessor, args.out))
    manifest["about"] = __doc__.split("\n\n")[0].replace("\n", " ")
    save_json(manifest_path, manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
