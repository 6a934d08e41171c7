"""The vision encoder against the committed goldens of llama.cpp's mtmd and of the transformers tower
(golden/vision/, made by tools/regen/make_vision_goldens.py), the image prompt end to end, and bad input.

NMSE is sum((ref - x)^2) / sum(ref^2) over the whole [n_tokens, n_embd] output, ref = the engine's.
"""
import functools
import hashlib
import json
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from reference import gguf, ops, vision
from reference.chat import IMAGE_PLACEHOLDER, token_id
from reference.image import ImageError, load_rgb, resize_lanczos
from reference.text import TextModel
from reference.trace import Tracer
from tools.synthetic import TextDims, write_text_gguf
from tools.synthetic import VisionDims, write_mmproj_gguf
from tools.regen.make_vision_goldens import CASES
from tools.synthetic import synthetic_image
from reference.metrics import nmse, top1_agreement
from reference.ggml_cpu import GgmlCpuBackend
from conftest import GOLDEN, MODELS, require, run_cli

VISION = os.path.join(GOLDEN, "vision")
with open(os.path.join(VISION, "manifest.json")) as f:
    MANIFEST = json.load(f)
LLAMA, HF = MANIFEST["llama-cpp"], MANIFEST["transformers"]
CASE = {c[0]: c for c in CASES}
MMPROJ = {k: os.path.join(MODELS, v["file"]) for k, v in LLAMA["mmproj"].items()}
TEXT_MODEL = os.path.join(MODELS, LLAMA["text_model"]["file"])


def sha256(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def ggml_backend(engine, flash_attn):  # "numpy" | "numba" -> the ggml-cpu emulation or its numba twin
    if engine == "numba":
        require("numba")  # the [accel] extra
        from accel.numba.ggml import GgmlCpuNumbaBackend
        return GgmlCpuNumbaBackend(flash_attn=flash_attn)
    return GgmlCpuBackend(flash_attn=flash_attn)


@functools.lru_cache(maxsize=None)
def tower(mmproj="f32", numerics="exact", dtype="float32", flash_attn=False, engine="numpy"):
    backend = ggml_backend(engine, flash_attn) if numerics == "ggml-cpu" else None
    return vision.VisionModel(gguf.load(MMPROJ[mmproj], "mmproj"), np.dtype(dtype), backend)


@functools.lru_cache(maxsize=None)
def image(name):  # the case's synthetic image; its sha256 is the one llama.cpp was fed
    _, w, h, kind, seed, _, _ = CASE[name]
    img = synthetic_image(w, h, seed, kind)
    assert sha256(img) == LLAMA["cases"][name]["image_sha256"], "the test image generator changed"
    return img


@functools.lru_cache(maxsize=None)
def resized(name):
    return tower().preprocess(image(name), LLAMA["cases"][name]["max_tokens"] or vision.DEFAULT_MAX_TOKENS)


@functools.lru_cache(maxsize=None)
def embeddings(name, mmproj="f32", numerics="exact", flash_attn=False, engine="numpy"):  # -> float32 [n_tokens, n_embd]
    return tower(mmproj, numerics, flash_attn=flash_attn, engine=engine).forward(resized(name))


def golden(subdir, file):
    return np.load(os.path.join(VISION, subdir, file), allow_pickle=False)


def case_param(name, *rest):  # the 4096-token case runs two 16384-patch global layers: ~1 min
    marks = [pytest.mark.slow] if name == "cap-4096" else []
    return pytest.param(name, *rest, id="-".join([name, *rest]), marks=marks)


# ---------------------------------------------------------------------------------------------
# Preprocessing: grid and resize, bit for bit

@pytest.mark.parametrize("name", list(LLAMA["cases"]))
def test_resized_pixels_identical_to_llama_cpp(name):
    entry = LLAMA["cases"][name]
    px = resized(name)
    assert px.shape == (entry["resized_height"], entry["resized_width"], 3)
    assert sha256(px) == entry["resized_sha256"]


@pytest.mark.parametrize("entry", LLAMA["resize"], ids=lambda e: f"{e['width']}x{e['height']}")
def test_lanczos_identical_to_llama_cpp(entry):
    src = synthetic_image(entry["width"], entry["height"], entry["seed"], entry["kind"])
    out = resize_lanczos(src, entry["resized_width"], entry["resized_height"])
    assert sha256(out) == entry["resized_sha256"]


def test_resize_sweep_covers_the_pass_order_trap():
    # Pillow 13 runs the vertical pass first when the width grows and the height shrinks (docs/traps.md, trap 18)
    sizes = [(e["width"], e["height"], e["resized_width"], e["resized_height"]) for e in LLAMA["resize"]]
    assert len(sizes) >= 20
    assert any(w < rw and h > rh for w, h, rw, rh in sizes)
    assert any(w > rw and h < rh for w, h, rw, rh in sizes)
    assert any(w > 30 * rw or h > 30 * rh for w, h, rw, rh in sizes)  # a very wide downscale kernel


def test_grid_identical_to_llama_cpp():
    sweep = LLAMA["grid_sweep"]
    for w, h, cols, rows in sweep["llama-cpp"]:
        assert vision.grid_size(w, h, 28, sweep["max_tokens"]) == (cols, rows), (w, h)


def test_transformers_grid_differs_only_on_ties():
    """transformers breaks an exact aspect tie by set() order, llama.cpp takes more tokens: where
    the two differ, both grids are equally close to the image's aspect and llama.cpp's is larger."""
    ours = {(w, h): (c, r) for w, h, c, r in LLAMA["grid_sweep"]["llama-cpp"]}
    differ = 0
    for w, h, c, r in HF["grid_sweep"]:
        lc, lr = ours[(w, h)]
        if (c, r) != (lc, lr):
            differ += 1
            assert abs(r / c - h / w) == abs(lr / lc - h / w) and r * c < lr * lc, (w, h)
    assert differ > 0  # the sweep does contain ties (e.g. squares whose side is not a multiple of 28)


def test_grid_examples_from_the_spec():
    assert vision.grid_size(1024, 1024, 28, 4096) == (37, 37)
    assert vision.grid_size(1920, 1080, 28, 4096) == (69, 39)
    assert vision.grid_size(4000, 3000, 28, 4096) == (73, 55)
    assert vision.grid_size(2048, 2048, 28, 4096) == (64, 64)
    assert vision.grid_size(29, 29, 28, 4096) == (2, 2)        # transformers: (1, 1)
    assert vision.grid_size(1000, 10, 28, 4) == (20, 1)        # nothing fits: lround, over the cap


# ---------------------------------------------------------------------------------------------
# The tower against llama.cpp and transformers

# Gates of the exact tower, max NMSE over a case's whole output, measured on this machine (worst case
# in brackets):
# - flash off: llama.cpp's conv_2d builds its im2col in F16, so it sees pixels and kernel rounded to
#   f16. That alone is the residual and is largest for 1-token images [3.0e-7; 3e-8 .. 1e-7
#   otherwise]: 3x its worst, 1e-6.
# - flash on: K and V (and Q below 64 patches, with an f16 accumulator) in f16 [8.2e-7]: 1e-6.
# - the f16 mmproj: activations are rounded to f16 before every F16 matmul; one flipped f16
#   rounding then grows through the random tiny tower [9.8e-7]: 3e-6.
EXACT_GATES = {"f32-fa-off": 1e-6, "f32-fa-on": 1e-6, "f16-fa-off": 3e-6}


def llama_rows(name, variant):  # -> (mtmd's rows of the case and variant, the row stride they keep)
    entry = LLAMA["cases"][name]
    return golden("llama-cpp", entry["files"][variant]), entry["row_stride"]


def variant_args(variant):  # -> (mmproj, flash_attn) of a golden variant
    v = LLAMA["variants"][variant]
    return v["mmproj"], v["flash_attn"] == "on"


@pytest.mark.parity
@pytest.mark.parametrize("name, variant", [case_param(n, v) for n in LLAMA["cases"] for v in EXACT_GATES])
def test_embeddings_match_llama_cpp(name, variant):
    ref, stride = llama_rows(name, variant)
    ours = embeddings(name, variant_args(variant)[0])
    assert ours.shape[0] == LLAMA["cases"][name]["n_tokens"]
    ours = ours[::stride]
    assert ours.shape == ref.shape
    assert nmse(ref.ravel(), ours.ravel()) <= EXACT_GATES[variant]


# --numerics ggml-cpu computes mtmd's CPU graph: every case, variant and engine gives mtmd's rows
# bit for bit. The NumPy emulation runs the cases up to 576 patches (square-336 takes 15 s per variant;
# its vec_dot and tinyBLAS emulations loop in Python), the numba twin all of them, the 16384-patch
# cap-4096 (two global layers over all patches: 52 s with flash attention, 98 s without) with flash
# attention only: its tiled kernel with a partial last KV tile is the path only a large case reaches.
EMULATED_PATCHES = 576


def ggml_cpu_params():
    for name, entry in LLAMA["cases"].items():
        for variant in EXACT_GATES:
            if entry["n_tokens"] * 4 <= EMULATED_PATCHES:
                yield case_param(name, variant, "numpy")
            if name != "cap-4096" or variant == "f32-fa-on":
                yield case_param(name, variant, "numba")


@pytest.mark.parity
@pytest.mark.parametrize("name, variant, engine", list(ggml_cpu_params()))
def test_ggml_cpu_embeddings_identical_to_llama_cpp(name, variant, engine):
    ref, stride = llama_rows(name, variant)
    mmproj, flash_attn = variant_args(variant)
    ours = embeddings(name, mmproj, "ggml-cpu", flash_attn, engine)[::stride]
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) == 0


# The exact tower on numba against the same tower in NumPy. Each op stays within its accel.harness
# gate; on the F32/F16 products, norms, attention and GELU the harness measures one-ulp noise, at most
# 3.6e-15 per op. The tiny tower chains about 60 such ops (6 layers x 9, the adapter), and its
# layer norms keep the noise from growing: at most 60 x 3.6e-15 = 2.2e-13 if every op added its
# worst. Measured 6.2e-14 .. 7.2e-14; the gate, 1e-12.
@pytest.mark.parametrize("mmproj", ["f32", "f16"])
@pytest.mark.parametrize("name", ["one-pixel", "square-336", "photo-640x480"])
def test_numba_tower_is_the_numpy_tower(name, mmproj):
    require("numba")
    from accel.numba import NumbaBackend
    numba_tower = vision.VisionModel(gguf.load(MMPROJ[mmproj], "mmproj"), backend=NumbaBackend(np.float32))
    ref, out = embeddings(name, mmproj), numba_tower.forward(resized(name))
    assert nmse(ref.ravel(), out.ravel()) <= 1e-12


@pytest.mark.parity
@pytest.mark.parametrize("name", [n for n in HF["cases"] if not n.endswith(".zeros")])
def test_embeddings_match_transformers(name):
    # transformers runs in float64 on llama.cpp's resized pixels; f32 rounding here gives 3e-14..9e-14
    entry = HF["cases"][name]
    assert sha256(resized(name)) == entry["pixels_sha256"]
    ref = golden("transformers", entry["file"])
    assert nmse(ref.ravel(), embeddings(name).ravel()) <= 1e-10


@pytest.mark.parity
def test_float64_is_the_noise_floor_of_float32():
    # the float64 tower agrees with transformers to the float32 storage of the golden; float32 sits above
    name = "square-336"
    ref = golden("transformers", HF["cases"][name]["file"])
    out64 = tower(dtype="float64").forward(resized(name))
    assert nmse(ref.ravel(), out64.ravel()) <= 1e-13
    assert nmse(out64.ravel(), embeddings(name).ravel()) <= 1e-12


@pytest.mark.parity
def test_transformers_zero_padding_is_a_different_position_table():
    # trap 2: transformers zero-pads the bilinear taps when the grid is upsampled; ggml clamps
    name = "square-336"
    zeros = golden("transformers", HF["cases"][name + ".zeros"]["file"])
    assert nmse(zeros.ravel(), embeddings(name).ravel()) > 1e-4


# ---------------------------------------------------------------------------------------------
# Trace points and the op rules

def test_trace_points_line_up_with_the_llama_cpp_graph():
    graph = {name: ne for name, ne in LLAMA["graph"]["tensors"]}
    trace = Tracer(keep_in_memory=True)
    tower().forward(resized(LLAMA["graph"]["case"]), trace)
    assert trace.points
    for name, x in trace.points.items():
        assert name in graph, name
        ne = [n for n in graph[name] if n != 1] or [1]
        assert list(reversed([n for n in x.shape if n != 1])) == ne, name


def test_attention_runs_window_by_window():
    class Spy(vision.NumpyBackend):
        widest = 0

        def attention(self, q, k, v, visible, scale):
            Spy.widest = max(Spy.widest, k.shape[0])
            return super().attention(q, k, v, visible, scale)

    side = tower().pos_side
    spy = vision.VisionModel(gguf.load(MMPROJ["f32"], "mmproj"), backend=Spy(np.float32))
    spy.is_global = lambda il: False
    spy.forward(resized("square-336"))  # 24 x 24 patches: 9 windows of 8 x 8
    assert Spy.widest == side * side


def test_window_permutation_and_pixel_shuffle_layouts():
    perm, lengths = ops.window_permutation(3, 5, 2)
    assert perm.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert lengths == [4, 4, 2, 2, 2, 1]
    x = np.arange(4 * 4 * 2).reshape(16, 2)  # raster tokens of a 4 x 4 grid, 2 channels
    z = ops.pixel_shuffle_channel_outer(x, 4, 4, 2)
    # merged token 0 = tokens 0, 1, 4, 5 (TL, TR, BL, BR); channel-outer: c0 of all four, then c1
    assert z[0].tolist() == [0, 2, 8, 10, 1, 3, 9, 11]


def test_bilinear_border_clamps_where_transformers_zero_pads():
    grid = np.arange(4, dtype=np.float32).reshape(1, 4, 1) + 1
    up = ops.resize_bilinear_border(grid, 1, 8)[0, :, 0]
    # the first and last output columns sit outside the table's centres: a clamp repeats the edge
    assert up[0] == 1 and up[-1] == 4
    assert np.allclose(up, [1, 1.25, 1.75, 2.25, 2.75, 3.25, 3.75, 4])


# ---------------------------------------------------------------------------------------------
# The image prompt end to end

PROMPT = LLAMA["prompt"]
# Measured, max NMSE over the 62 positions: the exact tower's rows (4e-8 off llama.cpp's, the f16
# im2col) move the tiny model's logits by up to 1.2e-6 (max |diff| 0.018); ggml-cpu's rows are
# llama.cpp's own, and leave 1.5e-12, the exact text model's own f32 agreement.
# Gates: about 3x the worst (1e-10 for the f32 text model, as in test_text_parity); top-1 everywhere.
PROMPT_GATES = {"exact": 4e-6, "ggml-cpu": 1e-10}


def prompt_rows(lm, numerics):  # the golden's sequence as embedding rows
    parts = []
    for part in PROMPT["sequence"]:
        parts.append(embeddings(part["image"], "f32", numerics) if "image" in part else lm.embed(part["tokens"]))
    return np.concatenate(parts)


@pytest.mark.parity
@pytest.mark.parametrize("numerics", list(PROMPT_GATES))
def test_image_prompt_logits_match_llama_cpp(numerics):
    lm = TextModel(gguf.load(TEXT_MODEL, "text"))
    rows = prompt_rows(lm, numerics)
    logits = lm.forward(rows, np.arange(len(rows)), lm.new_cache(len(rows), "uniform"))
    ref = golden(".", PROMPT["file"])
    assert logits.shape == ref.shape
    assert np.max(nmse(ref, logits)) <= PROMPT_GATES[numerics]
    assert np.all(top1_agreement(ref, logits))


def write_png(path, rgb):
    Image.fromarray(rgb).save(path)
    return str(path)


def prompt_cli_args(tmp_path):  # the golden prompt as --token-ids with one <|patch|>, and its image
    text_after = PROMPT["sequence"][2]["tokens"][1:]  # after <|image_end|>
    bos = PROMPT["sequence"][0]["tokens"][0]
    placeholder = token_id(gguf.load(TEXT_MODEL, "text").tokenizer, IMAGE_PLACEHOLDER)
    png = write_png(tmp_path / "img.png", image(PROMPT["sequence"][1]["image"]))
    return [bos, placeholder, *text_after], png


@pytest.mark.parity
def test_cli_image_prompt(tmp_path):
    ids, png = prompt_cli_args(tmp_path)
    logits_out, emb_out = tmp_path / "logits.npy", tmp_path / "emb.npy"
    r = run_cli("reference.run", "--model", TEXT_MODEL, "--mmproj", MMPROJ["f32"], "--image", png,
                "--token-ids", ",".join(map(str, ids)), "--n-predict", "2", "--json",
                "--logits-out", str(logits_out), "--embeddings-out", str(emb_out))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["image_tokens"] == [PROMPT["sequence"][1]["n_tokens"]]
    ref = golden(".", PROMPT["file"])
    logits = np.load(logits_out)
    assert np.max(nmse(ref, logits)) <= PROMPT_GATES["exact"]
    emb = np.load(emb_out)
    ref_emb = golden("llama-cpp", LLAMA["cases"]["rect-200x150"]["files"]["f32-fa-off"])
    assert nmse(ref_emb.ravel(), emb.ravel()) <= EXACT_GATES["f32-fa-off"]
    # without a placeholder the image goes right after BOS, as llama-mtmd-cli puts its marker first
    r2 = run_cli("reference.run", "--model", TEXT_MODEL, "--mmproj", MMPROJ["f32"], "--image", png,
                 "--token-ids", ",".join(map(str, [ids[0], *ids[2:]])), "--n-predict", "0",
                 "--logits-out", str(tmp_path / "logits2.npy"))
    assert r2.returncode == 0, r2.stderr
    assert np.array_equal(np.load(tmp_path / "logits2.npy"), logits)


def test_cli_image_max_tokens(tmp_path):
    png = write_png(tmp_path / "img.png", image("photo-640x480"))
    r = run_cli("reference.run", "--model", TEXT_MODEL, "--mmproj", MMPROJ["f32"], "--image", png, "--image-max-tokens", "4",
                "--n-predict", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["image_tokens"] == [4]


# ---------------------------------------------------------------------------------------------
# Decoding: what stb_image (llama.cpp) makes of awkward files

DECODE = {f["file"]: f for f in LLAMA["decode"]}


def decode_path(name):
    return os.path.join(VISION, "decode", name)


@pytest.mark.parametrize("name", [n for n in DECODE if not n.endswith(".jpg")])
def test_decoding_identical_to_stb_image(name):
    # gray, gray + alpha, RGBA and palette + tRNS (alpha dropped), 1-bit, 16-bit (high byte),
    # EXIF orientation 6 (ignored: the stored 23 x 17 pixels, not rotated)
    entry = DECODE[name]
    with open(decode_path(name), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == entry["sha256"]
    rgb = load_rgb(decode_path(name))
    assert list(rgb.shape) == entry["stb_shape"]
    assert sha256(rgb) == entry["stb_rgb_sha256"]


@pytest.mark.parametrize("name", [n for n in DECODE if n.endswith(".jpg")])
def test_jpeg_within_two_levels_of_stb_image(name):
    # libjpeg (Pillow) and stb_image differ in IDCT and chroma upsampling: measured 2 levels for
    # RGB, 1 for CMYK (Pillow's CMYK -> RGB vs stb's); a JPEG's pixels are not exact by nature.
    stb = np.load(decode_path(DECODE[name]["stb_rgb"]), allow_pickle=False)
    assert np.max(np.abs(load_rgb(decode_path(name)).astype(int) - stb)) <= 2


@pytest.mark.parametrize("name", sorted(HF["convert_to_rgb"]))
def test_alpha_white_is_transformers_composite(name):
    assert sha256(load_rgb(decode_path(name), alpha="white")) == HF["convert_to_rgb"][name]


# ---------------------------------------------------------------------------------------------
# Bad input: ImageError / GGUFError from the API, one line and exit 2 from the CLI

def png_header_only(width, height):  # a valid PNG claiming width x height whose pixel data stops at once
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def bad_images(tmp_path):  # -> {what: path}
    good = tmp_path / "good.png"
    write_png(good, synthetic_image(40, 30, 1, "smooth"))
    data = good.read_bytes()
    files = {
        "missing": tmp_path / "nope.png",
        "text named .png": tmp_path / "text.png",
        "truncated": tmp_path / "truncated.png",
        "corrupt data": tmp_path / "corrupt.png",
        "empty": tmp_path / "empty.png",
        "decompression bomb": tmp_path / "bomb.png",
        "over the pixel limit": tmp_path / "big.png",
    }
    files["text named .png"].write_text("this is not an image\n")
    files["truncated"].write_bytes(data[: len(data) // 2])
    idat = data.index(b"IDAT") + 4
    corrupt = bytearray(data)
    corrupt[idat + 20] ^= 0xFF  # inside the compressed pixels
    files["corrupt data"].write_bytes(bytes(corrupt))
    files["empty"].write_bytes(b"")
    # 100000 x 100000 promised by a 100-byte file: refused from the header, nothing allocated
    files["decompression bomb"].write_bytes(png_header_only(100000, 100000))  # over Pillow's own limit
    files["over the pixel limit"].write_bytes(png_header_only(8000, 8000))  # under Pillow's, over MAX_PIXELS
    return files


def test_bad_images_raise_image_error(tmp_path):
    for what, path in bad_images(tmp_path).items():
        with pytest.raises(ImageError) as e:
            load_rgb(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value), what


def test_cli_bad_images_exit_2(tmp_path):
    # the CLI catches the same ImageError; three kinds stand for all of them (a run costs a second)
    files = bad_images(tmp_path)
    for what in ("text named .png", "truncated", "decompression bomb"):
        path = files[what]
        r = run_cli("reference.run", "--model", TEXT_MODEL, "--mmproj", MMPROJ["f32"], "--image", str(path), "--n-predict", "0")
        assert r.returncode == 2, what
        assert len(r.stderr.strip().splitlines()) == 1 and str(path) in r.stderr, (what, r.stderr)


def test_mmproj_wider_or_narrower_than_the_text_model(tmp_path):
    text = str(tmp_path / "narrow.gguf")
    write_text_gguf(text, TextDims(n_embd=128))
    lm = TextModel(gguf.load(text, "text"))
    with pytest.raises(gguf.GGUFError, match="projects to 256 features"):
        vision.check_compatible(tower(), lm.cfg, text)
    png = write_png(tmp_path / "img.png", synthetic_image(30, 30, 1, "smooth"))
    r = run_cli("reference.run", "--model", text, "--mmproj", MMPROJ["f32"], "--image", png, "--n-predict", "0")
    assert r.returncode == 2 and "n_embd 128" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--image", "x.png"], "--image needs --mmproj"),
    (["--mmproj", "m.gguf"], "need --image"),
    (["--image", "x.png", "--mmproj", "MMPROJ", "--image-max-tokens", "0"], "argument --image-max-tokens: 0 is out of range"),
    (["--image", "IMAGE", "--mmproj", "TEXT"], "expected a muse-glimmer mmproj"),  # the image is read first
])
def test_cli_bad_image_arguments(args, message):
    image = os.path.join(VISION, "decode", "rgba.png")
    args = [{"MMPROJ": MMPROJ["f32"], "TEXT": TEXT_MODEL, "IMAGE": image}.get(a, a) for a in args]
    r = run_cli("reference.run", *args, "--n-predict", "0")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_text_model_as_mmproj_and_back():
    with pytest.raises(gguf.GGUFError, match="expected a muse-glimmer mmproj"):
        gguf.load(TEXT_MODEL, "mmproj")
    with pytest.raises(gguf.GGUFError, match="expected a muse-glimmer text model"):
        gguf.load(MMPROJ["f32"], "text")


def test_resize_refuses_absurd_targets():
    with pytest.raises(ValueError, match="target"):
        resize_lanczos(np.zeros((2, 2, 3), np.uint8), 0, 28)


# ---------------------------------------------------------------------------------------------
# Synthetic projectors: configurations llama.cpp cannot run, and the release's window geometry

@pytest.mark.parametrize("kwargs, message", [
    ({"n_pos": 48}, "not a square grid"),          # llama.cpp would take a 6 x 6 window of it
    ({"merge": 3}, "spatial_merge_size 3"),        # llama.cpp counts merged tokens with a literal 2
])
def test_projectors_llama_cpp_cannot_run(tmp_path, kwargs, message):
    path = write_mmproj_gguf(tmp_path / "mm.gguf", VisionDims(**kwargs))
    with pytest.raises(gguf.GGUFError, match=message):
        vision.VisionModel(gguf.load(path, "mmproj"))
