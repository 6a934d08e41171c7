"""Add the video extension to a llama.cpp-converted Muse-Glimmer mmproj (docs/vision.md, Video).

    python -m tools.video_mmproj --mmproj MMPROJ.gguf --checkpoint HF_DIR -o OUT.gguf

llama.cpp's converter sums the two temporal halves of transformers' patch embedding into one conv
kernel (llama.cpp/conversion/muse_glimmer.py:121-126): exact for stills, but a frame pair needs
W0 f0 + W1 f1. This writes OUT as MMPROJ plus
- tensor `v.patch_embd.weight.t1`: F32, the second-frame half W1 = weight.view(n_embd, 2, 3, p, p)[:, 1],
  shaped and laid out as `v.patch_embd.weight` (which keeps the sum S; W0 = S - W1);
- key `clip.vision.temporal_patch_size` (u32, the checkpoint's vision_config.patch_temporal);
- the video defaults of the checkpoint's video_preprocessor_config.json where it has one:
  `clip.vision.video.fps` (f32), `.max_frames` (u32), `.max_frame_tokens` (u32), `.timestamp_format` (str).
Every metadata entry, tensor info and tensor byte of MMPROJ is copied as it is; the new entries
follow the old ones and the new tensor's data follows the old data, so every old tensor keeps its
offset. llama.cpp reads only the names it asks for (llama.cpp/tools/mtmd/clip.cpp:2165-2183) and
loads the file as before. OUT is written whole (a temporary file, then a rename), never over MMPROJ.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from reference import artifacts, gguf
from reference.cli import OneLineParser, UsageError, exit_status

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
PATCH_EMBEDDING = "patch_embedder.patch_embedding.weight"  # transformers' Linear(pt*3*p*p -> n_embd)
MAX_HEADER = 1 << 26  # a safetensors JSON header past 64 MiB is not a checkpoint's


def read_safetensor(folder: Path, suffix: str):  # -> (name, float32 array) of the one tensor named ...suffix
    """The tensor from the checkpoint's safetensors file(s), without loading the rest: a u64 header
    length, a JSON header of {name: {dtype, shape, data_offsets}}, the data."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"--checkpoint {folder}: no .safetensors file")
    for path in files:
        with artifacts.open_regular(path, UsageError, what="safetensors file") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:
                raise UsageError(f"{path}: a {n}-byte header is not a safetensors file's")
            header = artifacts.parse_json(f.read(n), str(path), UsageError)
            name = next((k for k in header if k.endswith(suffix)), None)
            if name is None:
                continue
            entry = header[name]
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise UsageError(f"{path}: {name} is {entry['dtype']}, not one of {sorted(SAFETENSORS_DTYPES)}")
            start, stop = entry["data_offsets"]
            f.seek(8 + n + start)
            raw = np.frombuffer(f.read(stop - start), dtype).reshape(entry["shape"])
            if entry["dtype"] == "BF16":  # the high half of a float32
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            return name, raw.astype(np.float32)
    raise UsageError(f"--checkpoint {folder}: no tensor named *{suffix}")


def video_defaults(folder: Path) -> list:  # -> [(key, value type, value)] from video_preprocessor_config.json
    path = folder / "video_preprocessor_config.json"
    if not path.exists():
        return []
    cfg = artifacts.read_json(path, UsageError)
    fields = [(gguf.VIDEO_FPS, GGUFValueType.FLOAT32, "fps"), (gguf.VIDEO_MAX_FRAMES, GGUFValueType.UINT32, "num_frames"),
              (gguf.VIDEO_MAX_FRAME_TOKENS, GGUFValueType.UINT32, "max_video_frame_tokens"),
              (gguf.VIDEO_TIMESTAMP_FORMAT, GGUFValueType.STRING, "frame_timestamp_format")]
    return [(key, vtype, cfg[name]) for key, vtype, name in fields if cfg.get(name) is not None]


def encode_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def encode_kv(key: str, vtype: GGUFValueType, value) -> bytes:  # one GGUF metadata entry (gguf.h layout)
    body = {GGUFValueType.UINT32: lambda v: struct.pack("<I", int(v)),
            GGUFValueType.FLOAT32: lambda v: struct.pack("<f", float(v)),
            GGUFValueType.STRING: encode_string}[vtype](value)
    return encode_string(key) + struct.pack("<I", vtype) + body


def encode_tensor_info(name: str, ne: tuple, qtype: GGMLQuantizationType, offset: int) -> bytes:
    return (encode_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", qtype, offset))


def second_half(checkpoint: Path, reader, temporal: int):  # -> float32 [n_embd, 3, p, p]: W1
    """W1 from the checkpoint, after checking that the mmproj's kernel is this checkpoint's W0 + W1
    (summed in float32 as the converter does, then stored F32 or F16)."""
    name, weight = read_safetensor(checkpoint, PATCH_EMBEDDING)
    kernel = next(t for t in reader.tensors if t.name == "v.patch_embd.weight")
    n_embd, _, p, _ = kernel.data.shape
    if weight.shape != (n_embd, temporal * 3 * p * p):
        raise UsageError(f"--checkpoint {checkpoint}: {name} has shape {list(weight.shape)}, the mmproj's kernel "
                         f"implies {[n_embd, temporal * 3 * p * p]}")
    halves = weight.reshape(n_embd, temporal, 3, p, p)
    summed = halves.sum(axis=1, dtype=np.float32).astype(kernel.data.dtype)
    if not np.array_equal(summed, kernel.data):
        raise UsageError(f"--checkpoint {checkpoint} is not the checkpoint of this mmproj: its {name} halves do not "
                         "sum to v.patch_embd.weight")
    return np.ascontiguousarray(halves[:, 1])


def extend(mmproj: Path, checkpoint: Path, out: Path) -> dict:  # -> what was added
    reader = gguf.open_reader(mmproj)
    if gguf.PATCH_EMBD_T1 in {t.name for t in reader.tensors}:
        raise UsageError(f"--mmproj {mmproj} already has {gguf.PATCH_EMBD_T1}")
    if reader.fields.get("clip.projector_type", gguf.Field([], None)).value != "muse-glimmer":
        raise UsageError(f"--mmproj {mmproj} is not a muse-glimmer mmproj")
    config = artifacts.read_json(checkpoint / "config.json", UsageError)
    temporal = int(config.get("vision_config", {}).get("patch_temporal", 2))
    w1 = second_half(checkpoint, reader, temporal)
    kvs = [(gguf.TEMPORAL_PATCH_SIZE, GGUFValueType.UINT32, temporal), *video_defaults(checkpoint)]
    old = reader.data
    n_tensors, n_kv = struct.unpack_from("<QQ", old, 8)
    align = reader.alignment
    old_data = old[reader.data_offset:]
    # the new tensor's data starts at the first aligned offset after the old data
    offset = -(-len(old_data) // align) * align
    infos = bytes(old[reader.metadata_end:reader.infos_end]) + encode_tensor_info(
        gguf.PATCH_EMBD_T1, tuple(reversed(w1.shape)), GGMLQuantizationType.F32, offset)
    head = (bytes(old[:8]) + struct.pack("<QQ", n_tensors + 1, n_kv + len(kvs)) + bytes(old[24:reader.metadata_end])
            + b"".join(encode_kv(*kv) for kv in kvs) + infos)

    def write(f):
        f.write(head)
        f.write(bytes(-len(head) % align))
        f.write(memoryview(old_data))
        f.write(bytes(offset - len(old_data)))
        f.write(w1.astype("<f4").tobytes())
    artifacts.write_file(out, write, UsageError)
    return {"tensor": gguf.PATCH_EMBD_T1, "shape": list(w1.shape), "keys": {k: v for k, _, v in kvs}}


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m tools.video_mmproj", description=__doc__.splitlines()[0])
    ap.add_argument("--mmproj", type=Path, required=True, help="the llama.cpp-converted mmproj GGUF")
    ap.add_argument("--checkpoint", type=Path, required=True,
                    help="its transformers checkpoint directory (config.json, *.safetensors, "
                         "video_preprocessor_config.json if any)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the extended mmproj to write")
    args = ap.parse_args(argv)

    def run():
        artifacts.refuse_overwrite([("--out", args.out)], [("--mmproj", args.mmproj)], UsageError)
        added = extend(args.mmproj, args.checkpoint, args.out)
        print(json.dumps({"out": str(args.out), **added}))
        return 0
    return exit_status("tools.video_mmproj", run, (gguf.GGUFError,))


if __name__ == "__main__":
    sys.exit(main())
