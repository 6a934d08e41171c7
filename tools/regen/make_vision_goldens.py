"""Goldens for the vision encoder, from llama.cpp's mtmd (llama-cpp-python 0.3.36, CPU) and from the
transformers tower; none comes from this project's reference.

    python -m tools.make_vision_goldens --checkpoint build/tiny/tiny-a [--out golden/vision] \\
        [--step cases|sweeps|decode|prompt|graph|transformers ...] [--images-out DIR]

Test images are made here from integers only (PCG64 raw words, integer triangle waves), so the
tests rebuild the same pixels on any machine (their sha256 is in the manifest); --images-out also
writes them as PNG for llama-mtmd-cli. llama.cpp reads them through mtmd_bitmap_init, and the
pixels its tower saw are read back from the graph input `inp_raw` through cb_eval. Steps:
- cases: llama-cpp/<case>.<variant>.npy, the mmproj output float32 [n_tokens, n_embd] (every
  `row_stride`-th row for the 4096-token case) with flash attention off and on and the f16
  mmproj, and the sha256 of the resized uint8 pixels;
- sweeps: the resized pixels (sha256) of noise images of RESIZE_SIZES, and the grid llama.cpp picks
  for grid_sweep_sizes();
- decode: decode/*.png, *.jpg in awkward formats (gray, gray + alpha, palette with tRNS, 1-bit,
  16-bit, RGBA, EXIF orientation, CMYK JPEG) and what stb_image makes of them (sha256; the array
  for JPEGs, whose decoders differ);
- prompt: prompt/*.logits.npy, every position of <BOS><|image_start|> image <|image_end|> text,
  f32 KV cache, flash attention off;
- graph: the names and shapes of the tower graph's named tensors (the trace point names);
- transformers: transformers/<case>.npy, tower + adapter + projection in float64 on llama.cpp's
  resized pixels with the position table's padding set to "border" (ggml's clamp; one run keeps
  transformers' "zeros"), smart_resize's grid over the sweep (executed from its source file), and
  convert_to_rgb (alpha on white) for the decode files with alpha.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import ctypes
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
from tools.common import REPO, today
from tools.synthetic import raw_words, synthetic_image

MODELS = REPO / "golden" / "models"
TEXT_MODEL = "tiny-a-f32.gguf"
MMPROJ = {"f32": "tiny-a-mmproj-f32.gguf", "f16": "tiny-a-mmproj-f16.gguf"}
LLAMA_CPP_COMMIT = "0c1e570"  # vendored in llama-cpp-python 0.3.36
THREADS = 2

# name, width, height, kind, seed, --image-max-tokens (None: llama.cpp's 4096), stored row stride
CASES = [
    ("one-pixel", 1, 1, "noise", 1, None, 1),                 # 28x28, one token, pos table shrunk
    ("noise-56", 56, 56, "noise", 2, None, 1),                # no resample, inside one window
    ("noise-150x130", 150, 130, "noise", 3, None, 1),         # noise: the worst case for the f16 im2col
    ("tie-100", 100, 100, "smooth", 4, None, 1),              # 3x3 vs 4x4 tie: 4x4, the table verbatim
    ("rect-200x150", 200, 150, "smooth", 5, None, 1),
    ("wide-300x30", 300, 30, "smooth", 6, None, 1),           # 1 x 10 tokens, 3 windows in a row
    ("tall-40x500", 40, 500, "smooth", 7, None, 1),
    ("square-336", 336, 336, "smooth", 8, None, 1),           # no resample, 9 windows, table 3x upsampled
    ("photo-640x480", 640, 480, "smooth", 9, None, 1),        # 46x34 patches, 30 windows
    ("cap-64", 640, 480, "smooth", 9, 64, 1),
    ("cap-1", 200, 150, "smooth", 5, 1, 1),
    ("fallback-1000x10-cap4", 1000, 10, "smooth", 10, 4, 1),  # nothing fits: rounds, 20 tokens > cap
    ("cap-4096", 1900, 1900, "smooth", 11, None, 16),         # at the default cap: 64 x 64 tokens
]
SLOW_CASES = {"cap-4096"}
HF_ZEROS_CASE = "square-336"  # transformers' own zero padding, to show what the border clamp changes

# Sizes whose resized pixels are compared bit for bit (noise sources, so every tap matters), with
# the token cap: both axes up, both down, width up with height down and the reverse, one axis
# unchanged, non-integer ratios, and through small caps a 36x downscale (a 217-tap kernel).
RESIZE_SIZES = [(1, 1, None), (20, 200, None), (200, 20, None), (27, 29, None), (30, 300, None),
                (300, 30, None), (13, 57, None), (57, 13, None), (56, 100, None), (100, 56, None),
                (29, 1000, None), (1000, 29, None), (97, 89, None), (113, 111, None), (140, 141, None),
                (250, 251, None), (333, 222, None), (222, 333, None), (2, 3, None), (17, 170, None),
                (301, 299, None), (64, 48, None), (48, 64, None), (500, 40, None), (1000, 1000, 1),
                (1500, 60, 2), (700, 900, 6)]


def case_image(case):  # CASES entry -> uint8 [H, W, 3]
    _, w, h, kind, seed, _, _ = case
    return synthetic_image(w, h, seed, kind)


def sha256(data) -> str:
    return hashlib.sha256(data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()).hexdigest()


def file_sha256(path: Path) -> str:
    return sha256(path.read_bytes())


# ---------------------------------------------------------------------------------------------
# Awkward files for the decoder (written with Pillow; the golden is what stb_image makes of them)

def write_png_chunks(path: Path, width, height, bit_depth, color_type, rows):  # a PNG by hand
    """Pillow cannot write 16-bit RGB; the bytes are simple enough to write directly."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    raw = b"".join(b"\x00" + r for r in rows)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
                     + chunk(b"IEND", b""))


def write_decode_files(out: Path) -> list[dict]:  # -> [{file, what}]
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rgb = synthetic_image(23, 17, 21, "smooth")
    alpha = synthetic_image(23, 17, 22, "noise")[..., 0]
    files = []

    def save(name, img, what, **kw):
        img.save(out / name, **kw)
        files.append({"file": name, "what": what})

    save("gray.png", Image.fromarray(rgb[..., 0]), "8-bit gray (L)")
    save("gray-alpha.png", Image.fromarray(np.stack([rgb[..., 0], alpha], -1), "LA"), "gray + alpha (LA)")
    save("rgba.png", Image.fromarray(np.dstack([rgb, alpha])), "RGBA with varied alpha")
    palette = Image.fromarray(rgb).quantize(16)
    save("palette.png", palette, "16-colour palette (P)")
    save("palette-trns.png", palette, "palette with a transparent index (tRNS)", transparency=3)
    save("bilevel.png", Image.fromarray(rgb[..., 0] > 127), "1-bit (mode 1)")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display; llama.cpp ignores it
    save("exif-rotate.png", Image.fromarray(rgb), "RGB with EXIF orientation 6", exif=exif)
    wide = (synthetic_image(23, 17, 23, "noise").astype(np.uint16) << 8) | synthetic_image(23, 17, 24, "noise")
    write_png_chunks(out / "rgb16.png", 23, 17, 16, 2, [r.astype(">u2").tobytes() for r in wide])
    files.append({"file": "rgb16.png", "what": "16-bit RGB"})
    write_png_chunks(out / "gray16.png", 23, 17, 16, 0, [r.astype(">u2").tobytes() for r in wide[..., 0]])
    files.append({"file": "gray16.png", "what": "16-bit gray"})
    save("rgb.jpg", Image.fromarray(rgb), "baseline RGB JPEG (decoders differ)", quality=90)
    save("cmyk.jpg", Image.fromarray(rgb).convert("CMYK"), "CMYK JPEG (Adobe)", quality=90)
    return files


# ---------------------------------------------------------------------------------------------
# llama.cpp

class GGMLTensor(ctypes.Structure):  # ggml.h struct ggml_tensor (GGML_MAX_DIMS 4, MAX_SRC 10)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


@contextlib.contextmanager
def quiet_stderr(log: Path):  # llama.cpp logs to fd 2; keep it in a file
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Mtmd:
    """One mtmd context on the tiny text model; `encode` returns the mmproj output and the
    normalised pixels the tower read (the graph input inp_raw, caught through cb_eval)."""

    def __init__(self, llama_cpp, mmproj: Path, flash: bool, max_tokens: int | None):
        from llama_cpp import mtmd_cpp

        self.lc, self.M = llama_cpp, mtmd_cpp
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(MODELS / TEXT_MODEL).encode(), params)
        p = mtmd_cpp.mtmd_context_params_default()
        p.use_gpu, p.n_threads, p.warmup, p.print_timings = False, THREADS, False, False
        p.flash_attn_type = 1 if flash else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        p.image_max_tokens = max_tokens or -1
        self.inp_raw, self.stop_after_input, self.names = None, False, None
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self.on_tensor)
        p.cb_eval = self.callback
        self.ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), self.model, p)
        if not self.ctx:
            raise SystemExit(f"mtmd_init_from_file failed for {mmproj}")
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)

    def on_tensor(self, t, ask, _):  # ggml_backend_sched_eval_callback
        if ask:
            return True
        node = ctypes.cast(t, ctypes.POINTER(GGMLTensor)).contents
        name = node.name.decode()
        if self.names is not None and name and not name.startswith("node_") and " (" not in name:
            self.names.append([name, [int(n) for n in node.ne]])  # the graph's own cb() names
        for s in node.src:
            src = ctypes.cast(s, ctypes.POINTER(GGMLTensor)).contents if s else None
            if src is not None and src.name == b"inp_raw" and self.inp_raw is None:
                nx, ny, nc = src.ne[0], src.ne[1], src.ne[2]
                data = (ctypes.c_float * (nx * ny * nc)).from_address(src.data)
                self.inp_raw = np.ctypeslib.as_array(data).reshape(nc, ny, nx).transpose(1, 2, 0).copy()
                return not self.stop_after_input
        return True

    def bitmap(self, rgb):  # uint8 [H, W, 3] -> mtmd_bitmap
        buf = (ctypes.c_uint8 * rgb.size).from_buffer_copy(np.ascontiguousarray(rgb).tobytes())
        return self.M.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], buf)

    def image_chunks(self, bitmap, text=b""):  # -> mtmd_input_chunks of "<marker>text"
        M = self.M
        chunks = M.mtmd_input_chunks_init()
        t = M.mtmd_input_text()
        t.text = M.mtmd_default_marker() + text
        t.text_len, t.add_special, t.parse_special = len(t.text), True, True
        if M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(t), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
            raise SystemExit("mtmd_tokenize failed")
        return chunks

    def encode(self, rgb, stop_after_input=False):  # -> (float32 [n, n_embd] or None, f32 [h, w, 3])
        M = self.M
        bitmap = self.bitmap(rgb)
        chunks = self.image_chunks(bitmap)
        try:
            all_chunks = (M.mtmd_input_chunks_get(chunks, i) for i in range(M.mtmd_input_chunks_size(chunks)))
            chunk = next(c for c in all_chunks if M.mtmd_input_chunk_get_type(c) == 1)  # TYPE_IMAGE
            n = M.mtmd_input_chunk_get_n_tokens(chunk)
            self.inp_raw, self.stop_after_input = None, stop_after_input
            status = M.mtmd_encode_chunk(self.ctx, chunk)
            self.stop_after_input = False  # later encodes (the prompt's) run the whole graph
            emb = None
            if not stop_after_input:
                if status != 0:
                    raise SystemExit(f"mtmd_encode_chunk failed ({status})")
                out = M.mtmd_get_output_embd(self.ctx)
                emb = np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
            return emb, self.inp_raw
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def decode_file(self, path: Path):  # -> uint8 [H, W, 3] as stb_image reads it
        M = self.M
        bitmap = M.mtmd_helper_bitmap_init_from_file(self.ctx, str(path).encode(), False)
        if not bitmap:
            return None
        try:
            nx, ny = M.mtmd_bitmap_get_nx(bitmap), M.mtmd_bitmap_get_ny(bitmap)
            data = M.mtmd_bitmap_get_data(bitmap)
            return np.ctypeslib.as_array(data, shape=(ny * nx * 3,)).reshape(ny, nx, 3).copy()
        finally:
            M.mtmd_bitmap_free(bitmap)

    def close(self):
        self.M.mtmd_free(self.ctx)
        self.lc.llama_model_free(self.model)


def pixels_u8(inp_raw):  # normalised f32 [h, w, 3] -> the uint8 pixels behind it
    # the tiny mmproj's clip.vision.image_mean/std are 0.5: v = (u8/255 - 0.5)/0.5 is one-to-one
    u = (inp_raw * np.float32(0.5) + np.float32(0.5)) * 255
    exact = np.rint(u)
    if np.max(np.abs(u - exact)) > 1e-3:
        raise SystemExit("inp_raw is not a normalised uint8 image")
    return exact.astype(np.uint8)


VARIANTS = {"f32-fa-off": ("f32", False), "f32-fa-on": ("f32", True), "f16-fa-off": ("f16", False)}


def llama_cases(llama_cpp, out: Path, work: Path) -> dict:  # the mmproj output for every case and variant
    (out / "llama-cpp").mkdir(parents=True, exist_ok=True)
    cases, contexts = {}, {}
    for case in CASES:
        name, w, h, kind, seed, cap, stride = case
        rgb = case_image(case)
        entry = {"width": w, "height": h, "kind": kind, "seed": seed, "image_sha256": sha256(rgb),
                 "max_tokens": cap, "row_stride": stride, "files": {}}
        for variant, (mm, flash) in VARIANTS.items():
            key = (mm, flash, cap)
            if key not in contexts:
                contexts[key] = Mtmd(llama_cpp, MODELS / MMPROJ[mm], flash, cap)
            emb, inp_raw = contexts[key].encode(rgb)
            resized = pixels_u8(inp_raw)
            entry.update(resized_width=resized.shape[1], resized_height=resized.shape[0],
                         resized_sha256=sha256(resized), n_tokens=emb.shape[0])
            file = f"{name}.{variant}.npy"
            np.save(out / "llama-cpp" / file, emb[::stride].astype(np.float32), allow_pickle=False)
            entry["files"][variant] = file
            np.save(work / f"{name}.resized.npy", resized)  # for the transformers run
            print(f"llama.cpp {name} {variant}: {resized.shape[1]}x{resized.shape[0]} px, {emb.shape[0]} tokens",
                  flush=True)
        cases[name] = entry
    for c in contexts.values():
        c.close()
    return {"cases": cases,
            "variants": {k: {"mmproj": m, "flash_attn": "on" if f else "off"} for k, (m, f) in VARIANTS.items()}}


def llama_sweeps(llama_cpp, mtmd: Mtmd) -> dict:  # resized pixels of RESIZE_SIZES, grid_sweep_sizes()'s grid
    resize, capped = [], {}
    for i, (w, h, cap) in enumerate(RESIZE_SIZES):
        if cap and cap not in capped:
            capped[cap] = Mtmd(llama_cpp, MODELS / MMPROJ["f32"], False, cap)
        _, inp_raw = (capped[cap] if cap else mtmd).encode(synthetic_image(w, h, 100 + i, "noise"),
                                                           stop_after_input=True)
        resized = pixels_u8(inp_raw)
        resize.append({"width": w, "height": h, "max_tokens": cap, "seed": 100 + i, "kind": "noise",
                       "resized_width": resized.shape[1], "resized_height": resized.shape[0],
                       "resized_sha256": sha256(resized)})
    for c in capped.values():
        c.close()
    grid = []
    for w, h in grid_sweep_sizes():
        _, inp_raw = mtmd.encode(np.zeros((h, w, 3), np.uint8), stop_after_input=True)
        grid.append([w, h, inp_raw.shape[1] // 28, inp_raw.shape[0] // 28])
    return {"resize": resize, "grid_sweep": {"columns": ["width", "height", "cols", "rows"], "max_tokens": 4096,
                                             "llama-cpp": grid}}


def llama_decode(mtmd: Mtmd, out: Path) -> list:  # stb_image's RGB for every file of write_decode_files
    decode_dir = out / "decode"
    files = write_decode_files(decode_dir)
    for f in files:
        stb = mtmd.decode_file(decode_dir / f["file"])
        f.update(sha256=file_sha256(decode_dir / f["file"]), stb_rgb_sha256=None if stb is None else sha256(stb),
                 stb_shape=None if stb is None else list(stb.shape))
        if stb is not None and f["file"].endswith(".jpg"):
            np.save(decode_dir / (f["file"] + ".stb.npy"), stb, allow_pickle=False)
            f["stb_rgb"] = f["file"] + ".stb.npy"
    return files


def llama_graph_names(mtmd: Mtmd) -> dict:  # named tensors of the tower graph, in order, with ggml ne
    case = next(c for c in CASES if c[0] == "rect-200x150")
    mtmd.names = []
    mtmd.encode(case_image(case))
    names, mtmd.names = mtmd.names, None
    return {"case": case[0], "tensors": names}


def grid_sweep_sizes():  # -> [(w, h)]: every square side 1..160, seeded sizes up to 1300, ties
    sizes = [(s, s) for s in range(1, 161)]
    words = raw_words(7, 400) % np.uint64(1300)
    sizes += [(int(a) + 1, int(b) + 1) for a, b in words.reshape(-1, 2)]
    sizes += [(28 * a + 14, 28 * b + 14) for a in range(1, 8) for b in range(1, 8)]  # half-token sizes
    return sizes


PROMPT_TEXT = b" what is in the picture?"


def prompt_golden(llama_cpp, mtmd: Mtmd, out: Path) -> dict:
    """Logits of every position of <BOS> <|image_start|> image <|image_end|> text, decoded as llama.cpp's
    mtmd helper does (text rows as tokens, image rows as embeddings, one position each), one batch."""
    lc, M = llama_cpp, mtmd.M
    case = next(c for c in CASES if c[0] == "rect-200x150")
    bitmap = mtmd.bitmap(case_image(case))
    chunks = mtmd.image_chunks(bitmap, PROMPT_TEXT)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 256, 256, 256
    cparams.n_threads = cparams.n_threads_batch = THREADS
    cparams.type_k = cparams.type_v = 0  # f32 KV
    cparams.flash_attn_type = 0
    ctx = lc.llama_init_from_model(mtmd.model, cparams)
    n_embd, n_vocab = mtmd.n_embd, lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(mtmd.model))
    sequence, rows, pos = [], [], 0
    for i in range(M.mtmd_input_chunks_size(chunks)):
        chunk = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(chunk) == 0:
            n = ctypes.c_size_t()
            toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            ids = [int(toks[j]) for j in range(n.value)]
            sequence.append({"tokens": ids})
            batch = lc.llama_batch_init(len(ids), 0, 1)
            for j, t in enumerate(ids):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, pos + j, 1, True
                batch.seq_id[j][0] = 0
        else:
            if M.mtmd_encode_chunk(mtmd.ctx, chunk) != 0:
                raise SystemExit("mtmd_encode_chunk failed")
            n_img = M.mtmd_input_chunk_get_n_tokens(chunk)
            emb = np.ctypeslib.as_array(M.mtmd_get_output_embd(mtmd.ctx), shape=(n_img * n_embd,)).copy()
            sequence.append({"image": case[0], "n_tokens": n_img})
            batch = lc.llama_batch_init(n_img, n_embd, 1)
            ctypes.memmove(batch.embd, emb.astype(np.float32).ctypes.data, emb.nbytes)
            ids = range(n_img)
            for j in ids:
                batch.pos[j], batch.n_seq_id[j], batch.logits[j] = pos + j, 1, True
                batch.seq_id[j][0] = 0
        batch.n_tokens = len(ids)
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        for j in range(len(ids)):
            rows.append(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).copy())
        pos += len(ids)
        lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bitmap)
    (out / "prompt").mkdir(parents=True, exist_ok=True)
    np.save(out / "prompt" / "rect-200x150.logits.npy", np.array(rows, np.float32), allow_pickle=False)
    return {"file": "prompt/rect-200x150.logits.npy", "sequence": sequence, "text": PROMPT_TEXT.decode(),
            "options": {"kv_type": "f32", "flash_attn": "off", "mmproj": MMPROJ["f32"],
                        "mtmd_flash_attn": "off", "batches": "one llama_decode per chunk"}}


# ---------------------------------------------------------------------------------------------
# transformers

def hf_smart_resize():  # -> transformers' smart_resize, executed from its source file
    import transformers

    src = Path(transformers.__file__).parent / "models" / "muse_glimmer" / "image_processing_muse_glimmer.py"
    tree = ast.parse(src.read_text(encoding="utf-8"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    scope = {"math": math, "itertools": __import__("itertools")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), scope)
    return scope["smart_resize"]


def hf_convert_to_rgb(decode_dir: Path, files: list) -> dict:  # file -> sha256 of transformers' RGB
    """What transformers' convert_to_rgb (alpha composited on white) makes of the files with alpha."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    hashes = {}
    for f in files:
        with Image.open(decode_dir / f["file"]) as img:
            if "A" in img.getbands() or img.info.get("transparency") is not None:
                hashes[f["file"]] = sha256(convert_to_rgb(img, return_numpy=True))
    return hashes


def transformers_goldens(checkpoint: Path, out: Path, work: Path, llama: dict) -> dict:
    import torch
    import transformers
    from transformers import MuseGlimmerForConditionalGeneration

    torch.set_num_threads(THREADS)
    model = MuseGlimmerForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation="eager").eval()
    vcfg = model.config.vision_config
    p, m = vcfg.patch_size, vcfg.merge_size
    embedder = model.model.vision_tower.patch_embedder
    (out / "transformers").mkdir(parents=True, exist_ok=True)
    result = {"engine": "transformers", "version": f"transformers {transformers.__version__} "
                                                   f"(torch {torch.__version__.split('+')[0]})",
              "checkpoint": checkpoint.name,
              "options": {"dtype": "float64", "attn_implementation": "eager", "device": "cpu",
                          "pixels": "llama.cpp's resized uint8 pixels, normalised as (u8/255 - 0.5)/0.5",
                          "output": "vision_projection output before perception_emb_norm (the raw projection)",
                          "position_padding": "border (ggml's clamp) unless the entry says zeros"},
              "cases": {}}

    @torch.no_grad()
    def project(resized, padding):
        embedder.interpolation_padding = padding
        x = torch.from_numpy(resized.astype(np.float64) / 255.0 - 0.5) / 0.5          # [H, W, 3]
        gh, gw = resized.shape[0] // p, resized.shape[1] // p
        patches = x.reshape(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3).reshape(gh * gw, 1, 3 * p * p)
        pixel_values = patches.expand(-1, vcfg.patch_temporal, -1).reshape(gh * gw, -1)
        grid = torch.tensor([[1, gh, gw]])
        feats = model.model.vision_tower(pixel_values=pixel_values, grid_thw=grid).last_hidden_state
        return model.model.vision_projection(model.model.vision_adapter(feats)).numpy()

    for name, entry in llama["cases"].items():
        if name in SLOW_CASES:
            continue
        resized = np.load(work / f"{name}.resized.npy")
        out_hf = project(resized, "border")
        np.save(out / "transformers" / f"{name}.npy", out_hf.astype(np.float32), allow_pickle=False)
        result["cases"][name] = {"file": f"{name}.npy", "pixels_sha256": sha256(resized), "padding": "border"}
        print(f"transformers {name}: {out_hf.shape}", flush=True)
    resized = np.load(work / f"{HF_ZEROS_CASE}.resized.npy")
    np.save(out / "transformers" / f"{HF_ZEROS_CASE}.zeros.npy", project(resized, "zeros").astype(np.float32))
    result["cases"][HF_ZEROS_CASE + ".zeros"] = {"file": f"{HF_ZEROS_CASE}.zeros.npy", "padding": "zeros",
                                                 "pixels_sha256": sha256(resized)}
    smart_resize = hf_smart_resize()
    result["grid_sweep"] = [[w, h, *reversed([v // (p * m) for v in smart_resize(h, w, p * m, 4096)])]
                            for w, h, _, _ in llama["grid_sweep"]["llama-cpp"]]
    result["convert_to_rgb"] = hf_convert_to_rgb(out / "decode", llama["decode"])
    return result


# ---------------------------------------------------------------------------------------------

STEPS = ("cases", "sweeps", "decode", "prompt", "graph", "transformers")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="the HF directory of tiny-a")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "vision")
    ap.add_argument("--step", action="append", choices=STEPS,
                    help="regenerate only these parts (default: all); the manifest keeps the others")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "vision-goldens",
                    help="scratch: the llama.cpp log and its resized pixels for the transformers step")
    ap.add_argument("--images-out", type=Path, help="also write the test images here as PNG")
    args = ap.parse_args(argv)
    steps = set(args.step or STEPS)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if args.images_out:
        from PIL import Image
        args.images_out.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            Image.fromarray(case_image(case)).save(args.images_out / f"{case[0]}.png")
    date = today()
    lc = manifest.setdefault("llama-cpp", {})
    if steps - {"transformers"}:
        import llama_cpp

        llama_cpp.llama_backend_init()
        lc.update(engine="llama-cpp", date=date,
                  version=f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT}), mtmd, CPU",
                  text_model={"file": TEXT_MODEL, "sha256": file_sha256(MODELS / TEXT_MODEL)},
                  mmproj={k: {"file": v, "sha256": file_sha256(MODELS / v)} for k, v in MMPROJ.items()},
                  options={"n_threads": THREADS, "use_gpu": False, "warmup": False,
                           "bitmaps": "mtmd_bitmap_init on the synthetic RGB (no file decoding)",
                           "pixels": "read back from the graph input inp_raw through cb_eval"})
        with quiet_stderr(args.work / "llama.log"):
            if "cases" in steps:
                lc.update(llama_cases(llama_cpp, args.out, args.work))
            mtmd = Mtmd(llama_cpp, MODELS / MMPROJ["f32"], False, None)
            if "sweeps" in steps:
                lc.update(llama_sweeps(llama_cpp, mtmd))
            if "decode" in steps:
                lc["decode"] = llama_decode(mtmd, args.out)
            if "prompt" in steps:
                lc["prompt"] = prompt_golden(llama_cpp, mtmd, args.out)
            if "graph" in steps:
                lc["graph"] = llama_graph_names(mtmd)
            mtmd.close()
    if "transformers" in steps:
        manifest["transformers"] = {**transformers_goldens(args.checkpoint, args.out, args.work, lc),
                                    "date": date}
    manifest["about"] = __doc__.split("\n\n")[0].replace("\n", " ")
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
