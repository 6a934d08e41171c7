"""Video input against the committed goldens of transformers 5.23.0 with torchvision 0.28.0
(golden/video/, made by tools/regen/make_video_goldens.py), the mmproj's video extension
(tools.video_mmproj), and bad input.

NMSE is sum((ref - x)^2) / sum(ref^2) over the whole array, ref = transformers'.
"""
import functools
import hashlib
import json
import os
import struct

import numpy as np
import pytest
from PIL import Image

from reference import gguf, ops, video, vision
from reference.chat import expand_videos
from reference.tokenizer import Tokenizer
from reference.metrics import nmse
from tools.regen.make_video_goldens import VIDEOS, video_frames
from tools.regen.make_vision_goldens import CASES
from tools.synthetic import synthetic_image
from tools.regen.video_mmproj import PATCH_EMBEDDING
from conftest import GOLDEN, MODELS, cli_error, require, run_cli

VIDEO = os.path.join(GOLDEN, "video")
with open(os.path.join(VIDEO, "manifest.json")) as f:
    MANIFEST = json.load(f)
PRE = MANIFEST["preprocess"]
MMPROJ = os.path.join(MODELS, "tiny-a-mmproj-f32.gguf")
MMPROJ_VIDEO = os.path.join(MODELS, "tiny-a-mmproj-video-f32.gguf")
TEXT_MODEL = os.path.join(MODELS, "tiny-a-f32.gguf")
UNIT = 28
VIDEO_OF = {v[0]: v for v in VIDEOS}
TOKENIZER = Tokenizer(gguf.load(TEXT_MODEL, "text").tokenizer)


def sha256(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def golden(path):
    return np.load(os.path.join(VIDEO, path))


def resize_frames(entry):  # a PRE["resize"] entry -> its two source frames
    return np.stack([synthetic_image(entry["width"], entry["height"], s, entry["kind"]) for s in entry["seeds"]])


def prepared_resize(entry):  # -> video.Prepared of the entry's 2-frame video, as the processor ran it
    frames = resize_frames(entry)
    assert sha256(frames) == entry["frames_sha256"]
    return video.prepare(video.Video(frames, 2.0, "case"), 2.0, 8, entry["max_frame_tokens"], UNIT)


@functools.lru_cache(maxsize=None)
def tower(dtype="float32", path=MMPROJ_VIDEO):
    return vision.VisionModel(gguf.load(path, "mmproj"), np.dtype(dtype))


def prepared_video(name):  # a VIDEOS entry -> video.Prepared with the tiny config's defaults
    entry = VIDEO_OF[name]
    frames = video_frames(entry)
    assert sha256(frames) == MANIFEST["videos"][name]["frames_sha256"]
    cfg = MANIFEST["video_preprocessor_config"]
    return video.prepare(video.Video(frames, entry[6], name), cfg["fps"], cfg["num_frames"],
                         cfg["max_video_frame_tokens"], UNIT)


# ---------------------------------------------------------------------------------------------
# Preprocessing, step by step against the processor

def test_sampling_and_timestamps_match_transformers():
    for e in PRE["sampling"]:
        indices = video.sample_indices(e["frames"], e["source_fps"], e["fps"], e["max_frames"])
        assert indices.tolist() == e["indices"], e
        stamps = [float(np.float32(i) / np.float32(e["source_fps"] or video.UNKNOWN_FPS)) for i in indices]
        assert [f"Time: {t:.1f}s" for t in stamps] == e["timestamps"], e


def test_float32_linspace_is_not_the_exact_quotient():
    # trap: torch truncates a float32 linspace; floor(i (T-1) / (n-1)) differs on some golden cases
    differ = [e for e in PRE["sampling"] if len(e["indices"]) > 1 and e["indices"] != [
        (i * (e["frames"] - 1)) // (len(e["indices"]) - 1) for i in range(len(e["indices"]))]]
    assert any(e["frames"] == 352 and e["indices"][7] == 116 for e in differ)


def test_float32_timestamps_are_not_float64_ones():
    # trap: transformers' stamps are float32 quotients; float64 ones print otherwise on some golden cases
    differ = [e for e in PRE["sampling"] for i, text in zip(e["indices"], e["timestamps"])
              if f"Time: {i / (e['source_fps'] or video.UNKNOWN_FPS):.1f}s" != text]
    assert differ


@pytest.mark.parametrize("entry", PRE["resize"], ids=lambda e: f"{e['width']}x{e['height']}-cap{e['max_frame_tokens']}")
def test_resized_frames_equal_torchvision_pixel_for_pixel(entry):
    prepared = prepared_resize(entry)
    frames = prepared.pairs.reshape(-1, *prepared.pairs.shape[2:])
    assert list(frames.shape) == entry["resized_shape"]
    assert [sha256(f) for f in frames] == entry["resized_sha256"]
    if "resized_file" in entry:  # the committed arrays: every pixel, counted
        ref = golden(entry["resized_file"])
        assert np.count_nonzero(ref != frames) == 0


def test_int16_weights_differ_from_pillows_22_bits():
    # trap: the image path's Pillow weights are not torchvision's; some pixels of the committed
    # frames differ by a level
    entry = next(e for e in PRE["resize"] if "resized_file" in e)
    ref = golden(entry["resized_file"])
    frames = resize_frames(entry)
    pillow = np.stack([vision.resize_lanczos(f, ref.shape[2], ref.shape[1]) for f in frames])
    assert 0 < np.count_nonzero(pillow != ref) and np.abs(pillow.astype(int) - ref).max() <= 2


@pytest.mark.parametrize("entry", PRE["resize"], ids=lambda e: f"{e['width']}x{e['height']}-cap{e['max_frame_tokens']}")
def test_patches_equal_transformers(entry):
    prepared = prepared_resize(entry)
    patches = np.concatenate([ops.im2col(pair, 14) for pair in video.normalize(prepared.pairs, [0.5] * 3, [0.5] * 3)])
    rows, cols = prepared.grid
    assert [len(prepared.pairs), rows * 2, cols * 2] == entry["grid_thw"]
    assert list(patches.shape) == entry["patches_shape"] and sha256(patches) == entry["patches_sha256"]


def test_odd_frame_counts_repeat_the_last_frame():
    prepared = prepared_video("one-frame")
    assert prepared.pairs.shape[:2] == (1, 2) and np.array_equal(prepared.pairs[0, 0], prepared.pairs[0, 1])
    assert prepared.timestamps == [0.0]


# ---------------------------------------------------------------------------------------------
# The tower per pair and the prompt, against transformers

@pytest.mark.parity
@pytest.mark.parametrize("name", [v[0] for v in VIDEOS])
def test_video_embeddings_match_transformers(name):
    # the float64 tower agrees with transformers' float64 run to the golden's float32 storage and
    # W0 = S - W1 rebuilt from the float32 sum (measured 4.0e-15..5.9e-15; gate 1e-13 as the image
    # goldens'); float32 adds its own rounding (4.0e-14..5.2e-14; gate 1e-10 as the image goldens')
    entry = MANIFEST["videos"][name]
    prepared = prepared_video(name)
    assert prepared.indices.tolist() == entry["indices"]
    assert [len(prepared.pairs), prepared.grid[0] * 2, prepared.grid[1] * 2] == entry["grid_thw"]
    ref = golden(entry["files"]["embeddings-float64"])
    out64, out32 = tower("float64").encode_video(prepared), tower("float32").encode_video(prepared)
    assert nmse(ref.ravel(), out64.ravel()) <= 1e-13
    assert nmse(ref.ravel(), out32.ravel()) <= 1e-10


@pytest.mark.parity
@pytest.mark.parametrize("name", [v[0] for v in VIDEOS])
def test_video_prompt_matches_transformers(name, tmp_path):
    # gates as the text goldens' EXACT (tests/test_text_parity.py): transformers' float64 model runs
    # its RMSNorms in float32, so its logits are float32-exact; measured NMSE 1.5e-12..2.9e-12, top-1
    # everywhere, greedy tokens identical
    entry = MANIFEST["videos"][name]
    frames = tmp_path / f"{name}.npy"
    np.save(frames, video_frames(VIDEO_OF[name]))
    fps = [] if VIDEO_OF[name][6] is None else ["--video-fps", str(VIDEO_OF[name][6])]
    logits, emb = tmp_path / "logits.npy", tmp_path / "emb.npy"
    r = run_cli("reference.run", "-m", TEXT_MODEL, "--mmproj", MMPROJ_VIDEO, "--video", str(frames), *fps, "--chat",
                "-p", MANIFEST["prompt"], "--date", MANIFEST["chat_date"], "-n", str(len(entry["greedy"])), "--json",
                "--logits-out", str(logits), "--embeddings-out", str(emb))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    prepared = prepared_video(name)
    stamps = [f"Time: {t:.1f}s" for t in prepared.timestamps]
    expanded = expand_videos(out["prompt_tokens"], TOKENIZER, [(stamps, prepared.grid[0] * prepared.grid[1])])
    assert expanded == entry["prompt_ids"]
    assert out["tokens"] == entry["greedy"]
    ref = golden(entry["files"]["logits"])
    got = np.load(logits)
    assert got.shape == ref.shape
    assert nmse(ref.ravel(), got.ravel()) <= 1e-10
    assert np.array_equal(ref.argmax(-1), got.argmax(-1))
    assert nmse(golden(entry["files"]["embeddings-float64"]).ravel(), np.load(emb).ravel()) <= 1e-10


def golden_video_prompts(folder, videos):  # -> P.jsonl naming each golden video's frames (.npy beside it)
    with open(folder / "prompts.jsonl", "w") as f:
        for name in videos:
            np.save(folder / f"{name}.npy", video_frames(VIDEO_OF[name]))
            text = MANIFEST["videos"][name]["prompt_text"].removeprefix("<|begin_of_text|>")  # tools.golden adds BOS
            f.write(json.dumps({"id": name, "text": text,
                                "videos": [{"path": f"{name}.npy", "fps": VIDEO_OF[name][6]}]}) + "\n")
    return folder / "prompts.jsonl"


@pytest.mark.parity
def test_golden_tool_prompts_name_videos(tmp_path):
    # tools.golden --engine reference --mmproj: a prompt naming a video gets transformers' expanded ids
    # (timestamps, one <|video|> a merged token), and its logits and greedy tokens under the gates of
    # test_video_prompt_matches_transformers (measured NMSE 1.5e-12..2.9e-12, max |diff| 5.7e-5..8.6e-5)
    prompts = golden_video_prompts(tmp_path, VIDEO_OF)
    out = tmp_path / "out"
    r = run_cli("tools.golden", "--engine", "reference", "--model", TEXT_MODEL, "--mmproj", MMPROJ_VIDEO,
                "--prompts", str(prompts), "--out", str(out), "-n", "8")
    assert r.returncode == 0, r.stderr
    made = json.loads((out / "manifest.json").read_text())
    assert made["model"]["mmproj"]["file"] == os.path.basename(MMPROJ_VIDEO)
    for entry in made["entries"]:
        ref = MANIFEST["videos"][entry["id"]]
        assert entry["token_ids"] == ref["prompt_ids"]
        (video_record,) = entry["videos"]
        assert video_record["indices"] == ref["indices"] and video_record["grid_thw"] == ref["grid_thw"]
        want, got = golden(ref["files"]["logits"]), np.load(out / entry["file"])
        assert got.shape == want.shape
        assert nmse(want.ravel(), got.ravel()) <= 1e-10
        assert np.array_equal(want.argmax(-1), got.argmax(-1))
        assert entry["greedy"]["tokens"] == ref["greedy"]


@pytest.mark.parametrize("field, extra, expected", [
    ([], [], "videos must be a non-empty list"),
    ([{"path": "v.npy", "fps": 0}], [], "fps must be a positive number"),
    ([{"path": "v.npy", "rate": 2}], [], "a video is a path or"),
    (["missing.npy"], [], "missing.npy: no such file or directory"),
    (["v.npy"], ["--mmproj", MMPROJ], "has no video extension"),
    (["v.npy"], None, "need --engine reference with --mmproj"),
    (["v.npy", "v.npy"], [], "2 videos"),
])
def test_golden_tool_refuses_bad_video_prompts(tmp_path, field, extra, expected):
    np.save(tmp_path / "v.npy", np.zeros((2, 28, 28, 3), np.uint8))
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "text": "<|video|>Hi", "videos": field}) + "\n")
    mmproj = [] if extra is None else extra or ["--mmproj", MMPROJ_VIDEO]
    r = run_cli("tools.golden", "--engine", "reference", "--model", TEXT_MODEL, *mmproj,
                "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"))
    cli_error(r, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parity
def test_video_tower_on_numba_matches_transformers():
    # the numba backend runs the same tower per pair; gate as the float32 numpy run's
    require("numba")  # the [accel] extra
    from reference import factory
    model = factory.vision_model(gguf.load(MMPROJ_VIDEO, "mmproj"), factory.Build(backend="numba"))
    ref = golden(MANIFEST["videos"]["odd-11"]["files"]["embeddings-float64"])
    assert nmse(ref.ravel(), model.encode_video(prepared_video("odd-11")).ravel()) <= 1e-10


def test_ggml_cpu_backends_refuse_a_pair_in_one_line():
    # llama.cpp has no video graph: the ggml-cpu backends' convolution takes one image and says so
    from reference.ggml_cpu import GgmlCpuBackend, GgmlCpuError
    model = vision.VisionModel(gguf.load(MMPROJ_VIDEO, "mmproj"), backend=GgmlCpuBackend(check_host=False))
    with pytest.raises(GgmlCpuError, match="^llama.cpp's graph embeds one image, not 2 frames: video runs in the "
                                           "exact numerics only$"):
        model.encode_video(prepared_video("odd-11"))


def test_pairs_never_attend_to_each_other():
    # a pair's rows depend on its own two frames only: changing pair 1 leaves pairs 0, 2, 3 as they were
    prepared = prepared_video("pairs-8")
    base = tower().encode_video(prepared)
    pairs = prepared.pairs.copy()
    pairs[1] = 255 - pairs[1]
    other = tower().encode_video(video.Prepared(pairs, prepared.indices, prepared.timestamps, prepared.grid))
    n = prepared.grid[0] * prepared.grid[1]
    changed = [not np.array_equal(base[g * n:(g + 1) * n], other[g * n:(g + 1) * n]) for g in range(4)]
    assert changed == [False, True, False, False]


def test_trace_names_the_pair(tmp_path):
    frames = tmp_path / "v.npy"
    np.save(frames, video_frames(VIDEO_OF["odd-11"]))
    r = run_cli("reference.run", "-m", TEXT_MODEL, "--mmproj", MMPROJ_VIDEO, "--video", str(frames), "--video-fps", "5",
                "-n", "0", "--trace", str(tmp_path / "trace"))
    assert r.returncode == 0, r.stderr
    assert sorted(p for p in os.listdir(tmp_path / "trace") if p.startswith("video")) == ["video-0-pair-0",
                                                                                        "video-0-pair-1"]
    assert os.path.exists(tmp_path / "trace" / "video-0-pair-1" / "projected.npy")


# ---------------------------------------------------------------------------------------------
# The extension

def fake_checkpoint(folder, mmproj):  # -> W1: a checkpoint whose halves sum exactly to the mmproj's kernel
    """W0 keeps the top 12 bits of each float32 of S, W1 = S - W0 (exact), so W0 + W1 == S in float32."""
    s = np.asarray(next(t for t in gguf.open_reader(mmproj).tensors if t.name == "v.patch_embd.weight").data,
                   np.float32)
    w0 = (s.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
    w1 = (s - w0).astype(np.float32)
    assert np.array_equal(w0 + w1, s) and not np.array_equal(w0, w1)
    weight = np.stack([w0, w1], axis=1).reshape(s.shape[0], -1)
    header = json.dumps({"model.vision_tower." + PATCH_EMBEDDING: {
        "dtype": "F32", "shape": list(weight.shape), "data_offsets": [0, weight.nbytes]}}).encode()
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + weight.tobytes())
    (folder / "config.json").write_text(json.dumps({"vision_config": {"patch_temporal": 2}}))
    return w1


def test_extension_keeps_every_byte_of_the_mmproj(tmp_path):
    w1 = fake_checkpoint(tmp_path / "ckpt", MMPROJ)
    out = tmp_path / "ext.gguf"
    r = run_cli("tools.video_mmproj", "--mmproj", MMPROJ, "--checkpoint", str(tmp_path / "ckpt"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    old, new = gguf.open_reader(MMPROJ), gguf.open_reader(str(out))
    assert bytes(new.data[24:old.metadata_end]) == bytes(old.data[24:old.metadata_end])  # every old entry, as it was
    assert {k: f.value for k, f in new.fields.items() if k in old.fields} == {k: f.value for k, f in old.fields.items()}
    assert new.fields[gguf.TEMPORAL_PATCH_SIZE].value == 2
    old_data = bytes(old.data[old.data_offset:])
    assert bytes(new.data[new.data_offset:new.data_offset + len(old_data)]) == old_data  # every old tensor byte
    for t in old.tensors:
        n = next(x for x in new.tensors if x.name == t.name)
        assert n.data_offset - new.data_offset == t.data_offset - old.data_offset and np.array_equal(n.data, t.data)
    assert np.array_equal(next(t for t in new.tensors if t.name == gguf.PATCH_EMBD_T1).data, w1)
    assert os.path.getsize(MMPROJ) == old.data.size  # the input as it was


def test_committed_extended_mmproj_is_the_f32_one_plus_the_extension():
    old, new = gguf.open_reader(MMPROJ), gguf.open_reader(MMPROJ_VIDEO)
    old_data = bytes(old.data[old.data_offset:])
    assert bytes(new.data[new.data_offset:new.data_offset + len(old_data)]) == old_data
    assert sorted(set(new.fields) - set(old.fields)) == sorted([gguf.TEMPORAL_PATCH_SIZE, gguf.VIDEO_FPS,
                                                                gguf.VIDEO_MAX_FRAMES, gguf.VIDEO_MAX_FRAME_TOKENS,
                                                                gguf.VIDEO_TIMESTAMP_FORMAT])


def test_extended_mmproj_gives_the_same_image_embeddings():
    case = next(c for c in CASES if c[0] == "rect-200x150")
    rgb = synthetic_image(case[1], case[2], case[4], case[3])
    assert np.array_equal(tower(path=MMPROJ).encode(rgb), tower().encode(rgb))


@pytest.mark.parity
def test_llama_cpp_gave_the_extended_mmproj_the_same_image_embeddings():
    # recorded by mtmd on the extended file (golden/video, llama-cpp); the embeddings of the file
    # without the extension are golden/vision's: bit for bit the same
    with open(os.path.join(GOLDEN, "vision", "manifest.json")) as f:
        llama = json.load(f)["llama-cpp"]
    recorded = MANIFEST["llama-cpp"]
    assert recorded["mmproj"]["sha256"] == hashlib.sha256(open(MMPROJ_VIDEO, "rb").read()).hexdigest()
    assert len(recorded["cases"]) == 3
    for name, digest in recorded["cases"].items():
        ref = np.load(os.path.join(GOLDEN, "vision", "llama-cpp", llama["cases"][name]["files"]["f32-fa-off"]))
        assert sha256(ref) == digest, name


@pytest.mark.parity
def test_llama_cpp_loads_the_extended_mmproj_with_the_same_image_embeddings():
    llama_cpp = pytest.importorskip("llama_cpp")  # the [parity] extra
    from tools.regen.make_vision_goldens import Mtmd
    with open(os.path.join(GOLDEN, "vision", "manifest.json")) as f:
        llama = json.load(f)["llama-cpp"]
    llama_cpp.llama_backend_init()
    for name in ("rect-200x150", "square-336"):
        case = next(c for c in CASES if c[0] == name)
        mtmd = Mtmd(llama_cpp, MMPROJ_VIDEO, False, case[5])
        emb, _ = mtmd.encode(synthetic_image(case[1], case[2], case[4], case[3]))
        mtmd.close()
        ref = np.load(os.path.join(GOLDEN, "vision", "llama-cpp", llama["cases"][name]["files"]["f32-fa-off"]))
        assert np.array_equal(emb, ref), name


def test_extension_tool_refusals(tmp_path):
    fake_checkpoint(tmp_path / "ckpt", MMPROJ)
    cli_error(run_cli("tools.video_mmproj", "--mmproj", MMPROJ, "--checkpoint", str(tmp_path / "ckpt"), "-o", MMPROJ),
              "would overwrite the input")
    cli_error(run_cli("tools.video_mmproj", "--mmproj", MMPROJ_VIDEO, "--checkpoint", str(tmp_path / "ckpt"),
                      "-o", str(tmp_path / "x.gguf")), "already has", gguf.PATCH_EMBD_T1)
    fake_checkpoint(tmp_path / "other", os.path.join(MODELS, "tiny-a-mmproj-f16.gguf"))
    cli_error(run_cli("tools.video_mmproj", "--mmproj", MMPROJ, "--checkpoint", str(tmp_path / "other"),
                      "-o", str(tmp_path / "y.gguf")), "is not the checkpoint of this mmproj")
    assert not os.path.exists(tmp_path / "y.gguf")


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before any model loads

def run_video(path, *extra, mmproj=MMPROJ_VIDEO):
    return run_cli("reference.run", "-m", TEXT_MODEL, "--mmproj", mmproj, "--video", str(path), "-n", "1", *extra)


def write_y4m(path, width, height, n_frames):  # a raw YUV4MPEG2 file: its header alone claims the size
    frame = b"FRAME\n" + bytes(width * height * 3 // 2)
    path.write_bytes(f"YUV4MPEG2 W{width} H{height} F25:1 Ip A1:1 C420jpeg\n".encode() + frame * n_frames)


def write_mp4(path, frames, fps=10):
    av = require("av")  # the [video] extra, in [test]
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def test_without_the_extension_images_work_and_video_is_refused(tmp_path):
    np.save(tmp_path / "v.npy", video_frames(VIDEO_OF["one-frame"]))
    line = cli_error(run_video(tmp_path / "v.npy", mmproj=MMPROJ), "has no video extension", "tools.video_mmproj")
    assert "--checkpoint" in line
    cols, rows = vision.grid_size(40, 30, UNIT, vision.DEFAULT_MAX_TOKENS)
    assert tower(path=MMPROJ).encode(np.zeros((30, 40, 3), np.uint8)).shape == (cols * rows, 256)


@pytest.mark.parametrize("frames, expected", [
    (np.zeros((0, 20, 20, 3), np.uint8), "no frames"),
    (np.zeros((2, 20, 20, 3), np.float32), "must be uint8"),
    (np.zeros((20, 20, 3), np.uint8), "must be an array [T, H, W, 3]"),
    (np.zeros((2, 20, 20, 4), np.uint8), "must be an array [T, H, W, 3]"),
])
def test_bad_arrays(tmp_path, frames, expected):
    np.save(tmp_path / "v.npy", frames)
    cli_error(run_video(tmp_path / "v.npy"), expected)


def test_npy_header_claiming_more_than_the_file(tmp_path):
    path = tmp_path / "v.npy"
    with open(path, "wb") as f:  # 300 GB promised, 10 bytes held
        np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False,
                                                 "shape": (100000, 1000, 1000, 3)})
        f.write(bytes(10))
    cli_error(run_video(path), "not a readable .npy array", "header claims")


def test_frames_of_different_sizes(tmp_path):
    frames = tmp_path / "frames"
    frames.mkdir()
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(frames / "000.png")
    Image.fromarray(np.zeros((20, 31, 3), np.uint8)).save(frames / "001.png")
    cli_error(run_video(frames), "frames must share one size")


def test_empty_frame_directory(tmp_path):
    (tmp_path / "frames").mkdir()
    cli_error(run_video(tmp_path / "frames"), "holds no frame images")


@pytest.mark.parametrize("fps", ["0", "-2", "nan", "inf"])
def test_bad_frame_rates(tmp_path, fps):
    cli_error(run_video(tmp_path / "never-read.npy", f"--video-fps={fps}"), "--video-fps")


def test_over_the_token_cap(tmp_path):
    np.save(tmp_path / "v.npy", np.zeros((2, 10, 1000, 3), np.uint8))  # no grid under 1 token: rounds to 1x10
    cli_error(run_video(tmp_path / "v.npy", "--video-max-frame-tokens", "1"), "over the cap of 1")


def test_corrupt_and_truncated_files(tmp_path):
    require("av")
    (tmp_path / "junk.mp4").write_bytes(b"\x00not a video" * 64)
    cli_error(run_video(tmp_path / "junk.mp4"), "cannot decode")
    write_mp4(tmp_path / "ok.mp4", np.zeros((6, 32, 48, 3), np.uint8))
    data = (tmp_path / "ok.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[:len(data) // 2])
    cli_error(run_video(tmp_path / "cut.mp4"), "cut.mp4")


def test_gigapixel_frames_refused_from_the_header(tmp_path):
    require("av")
    path = tmp_path / "huge.y4m"
    path.write_bytes(b"YUV4MPEG2 W10000 H8000 F25:1 Ip A1:1 C420jpeg\nFRAME\n" + bytes(64))  # 6 GB a frame, 100 bytes
    cli_error(run_video(path), "more than 50000000 pixels")


def test_millions_of_frames_refused_from_the_header(tmp_path):
    # an AVI of 4 frames whose main and stream headers claim 5 million (avih dwTotalFrames, strh dwLength):
    # PyAV reports the claim as the stream's frame count, refused before any frame is decoded
    av = require("av")
    path = tmp_path / "claims.avi"
    with av.open(str(path), "w") as c:
        s = c.add_stream("mjpeg", rate=10)
        s.width, s.height, s.pix_fmt = 16, 16, "yuvj420p"
        for p in [*s.encode(av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")), *s.encode()]:
            c.mux(p)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, data.find(b"avih") + 8 + 16, 5_000_000)
    struct.pack_into("<I", data, data.find(b"strh") + 8 + 32, 5_000_000)
    path.write_bytes(data)
    cli_error(run_video(path), "claims 5000000 frames, more than 100000")


@pytest.mark.parametrize("bound, value, expected", [
    ("MAX_FRAMES_READ", 20, "more than 20"),                   # counted before decoding: 30 frames
    ("DECODE_SECONDS", 0.0, "decoding took longer than 0 s"),  # the wall-clock bound on one file
])
def test_decode_bounded(tmp_path, monkeypatch, bound, value, expected):
    require("av")
    write_y4m(tmp_path / "many.y4m", 4, 4, 30)
    monkeypatch.setattr(video, bound, value)
    with pytest.raises(video.VideoError, match=expected):
        video.load(str(tmp_path / "many.y4m"), None, lambda total, rate: video.sample_indices(total, rate, 2.0, 8))


def test_video_file_decodes_the_sampled_frames(tmp_path):
    require("av")
    write_y4m(tmp_path / "v.y4m", 6, 4, 50)  # 25 fps, 2 s: 4 frames kept at 2 fps
    v = video.load(str(tmp_path / "v.y4m"), None, lambda total, rate: video.sample_indices(total, rate, 2.0, 8))
    assert (v.total, v.fps, v.frames.shape) == (50, 25.0, (4, 4, 6, 3))
    indices = video.sample_indices(50, 25.0, 2.0, 8)  # 0, 49/3, 98/3, 49 truncated
    assert indices.tolist() == [0, 16, 32, 49]
    assert [f"{t:.2f}" for t in video.pair_timestamps(indices, 25.0)] == ["0.00", "1.28"]


def test_bisect_names_the_pair_and_the_point_of_a_planted_bug(tmp_path, monkeypatch, capsys):
    # planted: pair 1's two frames enter the patch embedding swapped (W0 f1 + W1 f0); tools.bisect on
    # each pair's trace directory finds nothing in pair 0 and names pair 1's first point
    from tools.parity.bisect import main as bisect_main
    from reference.trace import Tracer
    prepared = prepared_video("odd-11")
    tower().encode_video(prepared, lambda g: Tracer(str(tmp_path / f"a-pair-{g}")))
    im2col, calls = ops.im2col, []

    def swapped_in_pair_1(frames, patch):
        calls.append(len(calls))
        return im2col(frames[::-1] if len(calls) == 2 else frames, patch)
    monkeypatch.setattr(ops, "im2col", swapped_in_pair_1)
    tower().encode_video(prepared, lambda g: Tracer(str(tmp_path / f"b-pair-{g}")))
    capsys.readouterr()
    assert bisect_main([str(tmp_path / "a-pair-0"), str(tmp_path / "b-pair-0")]) == 0
    assert bisect_main([str(tmp_path / "a-pair-1"), str(tmp_path / "b-pair-1")]) == 1
    assert "first divergence: after_posemb (layer -, op after_posemb)" in capsys.readouterr().out
