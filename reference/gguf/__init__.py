"""Open a GGUF file of one of the three Muse-Glimmer roles, validate it, and hand out its tensors.

Roles: `text` (general.architecture = muse-glimmer), `mmproj` (clip with clip.projector_type =
muse-glimmer) and `dflash` (the speculative drafter). `load` reads the file (reader.py), its config
(configs.py), and resolves the role's tensors into the record its forward reads (tensors.py), every
one present and of the shape the metadata implies; their data stays in the memory map, dequantized
on demand into a bounded cache (weights.py).
"""
import os
from dataclasses import dataclass

from .configs import (EOG_TOKEN_NAMES, PATCH_EMBD_T1, TEMPORAL_PATCH_SIZE, VIDEO_DEFAULTS, VIDEO_FPS, VIDEO_MAX_FRAME_TOKENS,
                      VIDEO_MAX_FRAMES, VIDEO_TIMESTAMP_FORMAT, DraftConfig, TextConfig, TokenizerConfig, VisionConfig,
                      read_draft_config, read_text_config, read_tokenizer, read_vision_config)
from .reader import GGUFError, GGUFFile, Field, GgmlType, Metadata, TensorInfo, check_file, open_reader, write_out
from .tensors import DraftTensors, TensorError, TextTensors, VisionTensors, check_types, draft_tensors, text_tensors, \
    vision_tensors
from .weights import DEFAULT_CACHE_BYTES, Tensor, UnsupportedTensorType, Weights, decodable, dequantize

__all__ = [
    "GGUFModel", "ROLES", "load", "role_of",
    "EOG_TOKEN_NAMES", "PATCH_EMBD_T1", "TEMPORAL_PATCH_SIZE", "VIDEO_DEFAULTS", "VIDEO_FPS", "VIDEO_MAX_FRAME_TOKENS",
    "VIDEO_MAX_FRAMES", "VIDEO_TIMESTAMP_FORMAT", "DraftConfig", "TextConfig", "TokenizerConfig", "VisionConfig",
    "read_draft_config", "read_text_config", "read_tokenizer", "read_vision_config",
    "GGUFError", "GGUFFile", "Field", "GgmlType", "Metadata", "TensorInfo", "check_file", "open_reader", "write_out",
    "DraftTensors", "TensorError", "TextTensors", "VisionTensors",
    "DEFAULT_CACHE_BYTES", "Tensor", "UnsupportedTensorType", "Weights", "decodable", "dequantize",
]


@dataclass
class GGUFModel:
    path: str
    role: str
    config: object
    weights: Weights
    meta: Metadata
    tensors: object                 # TextTensors | VisionTensors | DraftTensors
    tokenizer: TokenizerConfig = None


ROLES = ("text", "mmproj", "dflash")


def role_of(meta):  # Metadata -> "text" | "mmproj" | "dflash" | description of something else
    arch = meta.str("general.architecture", required=True)
    if arch == "muse-glimmer":
        return "text"
    if arch == "dflash":
        return "dflash"
    if arch == "clip":
        return "mmproj"
    return f"architecture {arch!r}"


_ROLE_NAMES = {"text": "a muse-glimmer text model", "mmproj": "a muse-glimmer mmproj (clip)",
               "dflash": "a dflash drafter"}


def load(path, role, cache_bytes=DEFAULT_CACHE_BYTES):  # path, role -> GGUFModel (validated, its tensors resolved)
    path = os.fspath(path)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    try:
        reader = open_reader(path)
    except OSError as e:
        raise GGUFError(path, f"cannot read ({e.strerror or e})") from None
    meta = Metadata(reader, path)
    found = role_of(meta)
    if found != role:
        raise GGUFError(path, f"expected {_ROLE_NAMES[role]}, found {_ROLE_NAMES.get(found, found)}")
    weights = Weights(reader, path, cache_bytes)
    try:
        if role == "text":
            tokenizer = read_tokenizer(meta)
            config = read_text_config(meta)
            tensors = text_tensors(config, weights)
        elif role == "mmproj":
            tokenizer = None
            config = read_vision_config(meta)
            tensors = vision_tensors(config, weights, PATCH_EMBD_T1)
            if config.temporal_patch_size and tensors.patch_embd_t1 is None:
                raise TensorError(path, PATCH_EMBD_T1,
                                  f"{TEMPORAL_PATCH_SIZE} is set but the tensor {PATCH_EMBD_T1} is missing")
        else:
            tokenizer = read_tokenizer(meta) if "tokenizer.ggml.tokens" in reader.fields else None
            config = read_draft_config(meta)
            tensors = draft_tensors(config, weights)
        check_types(weights)
    except (ValueError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise GGUFError(path, f"bad metadata ({type(e).__name__}: {e})") from None
    return GGUFModel(path, role, config, weights, meta, tensors, tokenizer)
