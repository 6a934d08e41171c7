"""Loading the three GGUF roles: configs against the transformers configs they came from, and every
bad input as one line naming the file (GGUFError from the API, exit 2 from the CLI)."""
import json
import os
import re
import shutil
import struct

import numpy as np
import pytest
from gguf import GGUFValueType

from reference import gguf
from tools.synthetic import (Q, DraftDims, EditingKeys, TextDims, VisionDims, draft_keys, draft_shapes,
                                  random_spec, stream_gguf, text_tensors, vision_keys, vision_shapes,
                                  write_text_gguf)
from conftest import GOLDEN, MODELS, cli_error, model_manifest, run_cli


def text_models():
    return [e for e in model_manifest() if e["role"] == "text"]


@pytest.mark.parametrize("entry", text_models(), ids=lambda e: e["name"])
def test_text_config_matches_transformers(entry):
    m = gguf.load(os.path.join(MODELS, entry["name"]), "text")
    with open(os.path.join(MODELS, entry["checkpoint"] + ".config.json")) as f:
        hf = json.load(f)["text_config"]
    c = m.config
    assert (c.n_layer, c.n_embd, c.n_ff) == (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"])
    assert (c.n_head, c.n_head_kv, c.head_dim) == (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    assert c.n_swa == hf["sliding_window"]
    assert c.swa_layers == tuple(t == "sliding_attention" for t in hf["layer_types"])
    # f32 keys: compare at f32 precision
    assert np.float32(c.logit_scale) == np.float32(hf["output_multiplier"])
    assert np.float32(c.softcap) == np.float32(hf["final_logit_softcapping"])
    assert np.float32(c.rms_eps) == np.float32(hf["rms_norm_eps"])
    assert np.float32(c.rope_base_swa) == np.float32(hf["rope_parameters"]["rope_theta"])
    assert c.n_vocab == hf["vocab_size"]
    # what the converter folded in: q_norm carries qk_scale_factor, k_norm is ones, norms got +1
    assert np.all(m.weights.get("blk.0.attn_q_norm.weight") == np.float32(hf["qk_scale_factor"]))
    assert np.all(m.weights.get("blk.0.attn_k_norm.weight") == 1)


def test_layer_count_is_not_a_multiple_of_4_so_the_array_matters():
    # the scalar rule (period 4) and HF's backward rule disagree exactly when n_layer % 4 != 0
    for entry in text_models():
        c = gguf.load(os.path.join(MODELS, entry["name"]), "text").config
        scalar_rule = tuple((i % 4) < 3 for i in range(c.n_layer))
        assert c.n_layer % 4 != 0 and c.swa_layers != scalar_rule


def test_file_sha256_matches_manifest():
    import hashlib
    for entry in model_manifest():
        with open(os.path.join(MODELS, entry["name"]), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == entry["sha256"], entry["name"]


@pytest.mark.parametrize("pattern, omit, expected", [
    (None, (), (True, False, True, True, True, False)),            # the converter's array (HF rule)
    (4, (), (True, True, True, False, True, True)),                # scalar period: full iff i % 4 == 3
    (0, (), (True,) * 6),                                          # period 0: every layer SWA
    (None, ("muse-glimmer.attention.sliding_window_pattern",), (True, True, True, False, True, True)),
    ([True, True, False], (), (True, True, False, False, False, False)),  # short array: rest full
])
def test_swa_pattern_forms(tmp_path, pattern, omit, expected):
    path = str(tmp_path / "pattern.gguf")
    write_text_gguf(path, TextDims(n_layer=6, swa_pattern=pattern), omit_keys=omit)
    assert gguf.load(path, "text").config.swa_layers == expected


def test_pattern_without_swa_layer_is_refused(tmp_path):
    path = str(tmp_path / "nofull.gguf")
    write_text_gguf(path, TextDims(n_layer=6, swa_pattern=1))  # period 1: every layer full
    with pytest.raises(gguf.GGUFError, match="no sliding-window layer"):
        gguf.load(path, "text")


def test_defaults_softcap_and_freq_base_swa(synthetic_gguf, tmp_path):
    d = TextDims()
    path = str(tmp_path / "nosoftcap.gguf")
    write_text_gguf(path, d, extra_keys={"muse-glimmer.rope.freq_base_swa": (5000.0, GGUFValueType.FLOAT32)})
    c = gguf.load(path, "text").config
    assert c.rope_base_swa == 5000.0 and c.rope_base == 10000.0
    assert gguf.load(synthetic_gguf, "text").config.rope_base_swa == 10000.0  # falls back to freq_base


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file, GGUFError / exit 2, nothing allocated from a corrupt header

def corrupt_copies(src, tmp_path):  # -> {case: path}
    with open(src, "rb") as f:
        data = f.read()
    cases = {
        "missing": str(tmp_path / "does-not-exist.gguf"),
        "truncated": data[: len(data) // 2],
        "wrong_magic": b"GGUX" + data[4:],
        "random": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "empty": b"",
        "absurd_counts": data[:8] + struct.pack("<QQ", 2**62, 2**62) + data[24:],
        "bad_version": data[:4] + struct.pack("<I", 99) + data[8:],
    }
    paths = {}
    for name, content in cases.items():
        if isinstance(content, str):
            paths[name] = content
            continue
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(content)
        paths[name] = str(p)
    return paths


@pytest.mark.parametrize("case", ["missing", "truncated", "wrong_magic", "random", "empty", "absurd_counts",
                                  "bad_version"])
def test_bad_file_api_and_cli(case, synthetic_gguf, tmp_path):
    path = corrupt_copies(synthetic_gguf, tmp_path)[case]
    with pytest.raises(gguf.GGUFError) as e:
        gguf.load(path, "text")
    assert path in str(e.value) and "\n" not in str(e.value)
    r = run_cli("reference.run", "--model", path, "--n-predict", "1")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and path in r.stderr and "Traceback" not in r.stderr


def planted(tmp_path, name, **kw):  # a synthetic GGUF with one thing wrong
    path = str(tmp_path / f"{name}.gguf")
    write_text_gguf(path, **kw)
    return path


# ---------------------------------------------------------------------------------------------
# Tensors resolved at load (gguf/tensors.py): a missing or misshapen tensor is one TensorError
# naming it, raised by gguf.load, so before any forward; exit 2 and one line from the CLI

def assert_tensor_refused(path, role, tensor, message):  # the API's TensorError and the CLI's one line
    with pytest.raises(gguf.TensorError, match=message) as e:
        gguf.load(path, role)
    assert e.value.tensor == tensor and e.value.path == path and "\n" not in str(e.value)
    r = run_cli("reference.run", "--model", path, "-n", "1") if role == "text" else role_cli(role, path)
    assert r.returncode == 2 and r.stdout == ""  # nothing generated: no forward ran
    assert re.search(message, cli_error(r)) and path in r.stderr


def test_missing_tensor(tmp_path):
    t = text_tensors(TextDims(), np.random.default_rng(0))
    del t["blk.2.ffn_up.weight"]
    path = planted(tmp_path, "missing_tensor", tensors=t)
    assert_tensor_refused(path, "text", "blk.2.ffn_up.weight", "missing tensor blk.2.ffn_up.weight")


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    t = text_tensors(TextDims(), np.random.default_rng(0))
    t["blk.1.attn_k.weight"] = t["blk.1.attn_k.weight"][:64]
    path = planted(tmp_path, "bad_shape", tensors=t)
    assert_tensor_refused(path, "text", "blk.1.attn_k.weight",
                          r"blk.1.attn_k.weight has shape \[64, 256\], the metadata implies \[128, 256\]")


def test_an_optional_tensor_of_the_wrong_shape_is_refused(tmp_path):
    t = text_tensors(TextDims(), np.random.default_rng(0))
    t["blk.3.attn_v.bias"] = np.zeros(5, np.float32)  # optional, and then checked as the required ones
    path = planted(tmp_path, "bad_bias", tensors=t)
    assert_tensor_refused(path, "text", "blk.3.attn_v.bias", r"blk.3.attn_v.bias has shape \[5\], the metadata implies \[128\]")


def dropped(name):  # -> an edit of a role's [(name, shape)] that leaves `name` out
    return lambda shapes: [(n, s) for n, s in shapes if n != name]


def halved(name):  # -> an edit of a role's [(name, shape)] that halves the first dimension of `name`
    return lambda shapes: [(n, (s[0] // 2, *s[1:]) if n == name else s) for n, s in shapes]


ROLE_TENSOR_CASES = [
    ("mmproj", dropped("v.blk.1.attn_v.bias"), "v.blk.1.attn_v.bias", "missing tensor v.blk.1.attn_v.bias"),
    ("mmproj", dropped("mm.2.weight"), "mm.2.weight", "missing tensor mm.2.weight"),
    ("mmproj", halved("v.blk.0.ffn_down.weight"), "v.blk.0.ffn_down.weight",
     r"v.blk.0.ffn_down.weight has shape \[32, \d+\], the metadata implies \[64, \d+\]"),
    ("mmproj", halved("v.post_ln.bias"), "v.post_ln.bias", r"v.post_ln.bias has shape \[32\], the metadata implies \[64\]"),
    ("dflash", dropped("blk.1.attn_k_norm.weight"), "blk.1.attn_k_norm.weight", "missing tensor blk.1.attn_k_norm.weight"),
    ("dflash", halved("fc.weight"), "fc.weight", r"fc.weight has shape \[\d+, \d+\], the metadata implies"),
]


@pytest.mark.parametrize("role, edit, tensor, message", ROLE_TENSOR_CASES, ids=[c[2] for c in ROLE_TENSOR_CASES])
def test_mmproj_and_drafter_tensors_missing_or_misshapen(tmp_path, role, edit, tensor, message):
    assert_tensor_refused(planted_role(tmp_path, role, edit_shapes=edit), role, tensor, message)


def test_records_hold_every_tensor_of_the_committed_models_undecoded():
    """The default model's three files: the records name each tensor of the file once, with its
    shape, and loading decodes none of them (the weights stay in the memory map)."""
    for name, role in (("glimmer-default-f16.gguf", "text"), ("glimmer-default-mmproj-f16.gguf", "mmproj"),
                       ("glimmer-default-dflash-f16.gguf", "dflash")):
        m = gguf.load(os.path.join(MODELS, name), role)
        held = list(handles(m.tensors))
        assert sorted(t.name for t in held) == sorted(m.weights.tensors), name
        assert all(t.weights is m.weights and t.shape == m.weights.shape(t.name) for t in held)
        assert m.weights._cached_bytes == 0 and not m.weights._cache


def handles(record):  # a record of tensors (nested tuples) -> every gguf.Tensor in it
    for field in record:
        if isinstance(field, gguf.Tensor):
            yield field
        elif isinstance(field, tuple):
            yield from handles(field)


def test_a_fused_qkv_layer_among_split_ones(tmp_path):
    """Layer 1's q, k and v stored as one attn_qkv [q | k | v] (llama.cpp's create_tensor_qkv, per
    layer): the same logits as the split file. Each output column is the same float64 dot product
    of the same float32 values, rounded once to float32, so the two agree bit for bit."""
    from reference.text import TextModel
    t = text_tensors(TextDims(), np.random.default_rng(0))
    split = planted(tmp_path, "split", tensors=dict(t))
    t["blk.1.attn_qkv.weight"] = np.concatenate([t.pop(f"blk.1.attn_{p}.weight") for p in "qkv"])
    fused = planted(tmp_path, "fused", tensors=t)
    models = [gguf.load(p, "text") for p in (split, fused)]
    assert models[1].tensors.layers[1].attn_q is None and models[1].tensors.layers[1].attn_qkv is not None
    assert models[1].tensors.layers[0].attn_qkv is None
    logits = [TextModel(m).prefill([1, 5, 9, 2], TextModel(m).new_cache(8)) for m in models]
    assert np.array_equal(logits[0], logits[1])


def test_unsupported_quant_type(tmp_path):
    # patch the type id of one tensor to a type gguf.quants cannot dequantize (Q8_1 = 9, same block size as Q8_0)
    path = planted(tmp_path, "q8_0", qtype="Q8_0")
    t = next(t for t in gguf.open_reader(path).tensors if t.name == "blk.0.ffn_up.weight")
    with open(path, "r+b") as f:
        f.seek(t.type_offset)
        f.write(struct.pack("<I", 9))
    with pytest.raises(gguf.GGUFError, match="Q8_1"):
        gguf.load(path, "text")


def test_wrong_role(tmp_path, synthetic_gguf):
    with pytest.raises(gguf.GGUFError, match="expected a muse-glimmer mmproj"):
        gguf.load(synthetic_gguf, "mmproj")
    mmproj = [e for e in model_manifest() if e["role"] == "mmproj"]
    if mmproj:
        path = os.path.join(MODELS, mmproj[0]["name"])
        r = run_cli("reference.run", "--model", path)
        assert r.returncode == 2 and "expected a muse-glimmer text model" in r.stderr


@pytest.mark.parametrize("key", ["muse-glimmer.logit_scale", "muse-glimmer.attention.sliding_window",
                                 "muse-glimmer.attention.layer_norm_rms_epsilon", "muse-glimmer.block_count"])
def test_missing_required_key(tmp_path, key):
    path = str(tmp_path / "nokey.gguf")
    write_text_gguf(path, omit_keys=(key,))
    with pytest.raises(gguf.GGUFError, match=f"missing required key {key}"):
        gguf.load(path, "text")


def test_softcap_defaults_to_30_when_absent(tmp_path):
    path = str(tmp_path / "nosoftcap.gguf")
    write_text_gguf(path, omit_keys=("muse-glimmer.final_logit_softcapping",))
    assert gguf.load(path, "text").config.softcap == 30.0


def test_key_of_wrong_type(tmp_path):
    path = str(tmp_path / "wrongtype.gguf")
    write_text_gguf(path, extra_keys={"muse-glimmer.logit_scale": ("half", GGUFValueType.STRING)})
    with pytest.raises(gguf.GGUFError, match="logit_scale should be a float"):
        gguf.load(path, "text")


def test_lazy_weights_bounded_cache(synthetic_gguf):
    m = gguf.load(synthetic_gguf, "text", cache_bytes=600_000)
    for il in range(5):
        m.weights.get(f"blk.{il}.ffn_up.weight")  # 512 KB each
    assert m.weights._cached_bytes <= 600_000 and len(m.weights._cache) == 1
    rows = m.weights.rows("token_embd.weight", [3, 7])
    assert np.array_equal(rows, m.weights.get("token_embd.weight")[[3, 7]])


def test_matrices_larger_than_the_cache_stream_in_row_blocks(monkeypatch):
    # with a 2 MB cache the 1 MB (f64) output head is streamed in blocks of 100 rows: same logits
    from reference import backend
    from reference.text import TextModel
    monkeypatch.setattr(backend, "STREAM_ROWS", 100)
    path = os.path.join(MODELS, "tiny-a-q8_0.gguf")
    small, big = gguf.load(path, "text", cache_bytes=2_000_000), gguf.load(path, "text")
    ids = list(range(40))
    streamed = TextModel(small).prefill(ids, TextModel(small).new_cache(40))
    cached = TextModel(big).prefill(ids, TextModel(big).new_cache(40))
    assert np.array_equal(streamed, cached)
    assert small.weights._cached_bytes <= 2_000_000


# ---------------------------------------------------------------------------------------------
# Bad metadata: every check of the three roles' keys, from the API and from the CLI

A = "muse-glimmer."
U32, I32, F32, STR, BOOL, ARR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                                 GGUFValueType.STRING, GGUFValueType.BOOL, GGUFValueType.ARRAY)


def case_id(extra, omit):  # "block_count='five'", "no tokenizer.ggml.tokens"
    edits = [f"{k.removeprefix(A)}={v!r}" for k, (v, _) in extra.items()] + [f"no {k}" for k in omit]
    return ",".join(edits)


TEXT_CASES = [
    # a key of the wrong type
    ({"tokenizer.ggml.model": (3, U32)}, (), "key tokenizer.ggml.model should be a string"),
    ({A + "block_count": ("five", STR)}, (), "key muse-glimmer.block_count should be an integer"),
    ({A + "context_length": (4096.0, F32)}, (), "key muse-glimmer.context_length should be an integer"),
    ({A + "block_count": (True, BOOL)}, (), "key muse-glimmer.block_count should be an integer"),
    ({A + "block_count": ([5], ARR)}, (), "key muse-glimmer.block_count should be an integer"),
    ({"tokenizer.ggml.merges": ("a b", STR)}, (), "key tokenizer.ggml.merges should be an array"),
    # per-layer arrays: only one value for every layer, and only integers
    ({A + "attention.head_count": ([4, 4, 8, 4, 4], ARR)}, (),
     r"attention.head_count: per-layer values \[4, 4, 8, 4, 4\] are not supported"),
    ({A + "feed_forward_length": ([512.0] * 5, ARR)}, (), "feed_forward_length: per-layer values"),
    ({A + "attention.sliding_window_pattern": ([1.0] * 5, ARR)}, (),
     "sliding_window_pattern should be an array of bool or int"),
    ({A + "attention.sliding_window_pattern": (["yes"] * 5, ARR)}, (),
     "sliding_window_pattern should be an array of bool or int"),
    # the tokenizer
    ({}, ("tokenizer.ggml.tokens",), "missing required key tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.bos_token_id": (512, U32)}, (),
     r"tokenizer.ggml.bos_token_id 512 is outside the vocabulary \(512\)"),
    # sizes no model has
    ({A + "block_count": (0, U32)}, (), "implausible sizes: n_layer=0 "),
    ({A + "block_count": (600, U32)}, (), "implausible sizes: n_layer=600 "),
    ({A + "attention.head_count": (0, U32)}, (), "implausible sizes: .* n_head=0 "),
    ({A + "attention.head_count_kv": (0, U32)}, (), "implausible sizes: .* n_head_kv=0 "),
    ({A + "feed_forward_length": (0, U32)}, (), "implausible sizes: .* n_ff=0"),
    ({A + "attention.head_count_kv": (3, U32)}, (), "head_count 4 is not a multiple of head_count_kv 3"),
    # head geometry llama.cpp's muse-glimmer graph does not build
    ({A + "attention.value_length": (32, U32)}, (), "unsupported head geometry: key_length=64 value_length=32 "),
    ({A + "rope.dimension_count": (32, U32)}, (), "unsupported head geometry: .* rope.dimension_count=32"),
    ({A + "attention.key_length": (63, U32), A + "attention.value_length": (63, U32)}, (),
     "unsupported head geometry: key_length=63 value_length=63 rope.dimension_count=63"),
    # the sliding window
    ({A + "attention.sliding_window": (0, U32)}, (), "sliding_window must be positive, not 0"),
    ({A + "attention.sliding_window": (-4, I32)}, (), "sliding_window must be positive, not -4"),
]


@pytest.mark.parametrize("extra, omit, message", TEXT_CASES, ids=[case_id(e, o) for e, o, _ in TEXT_CASES])
def test_bad_text_metadata_api_and_cli(tmp_path, extra, omit, message):
    path = planted(tmp_path, "bad_meta", extra_keys=extra, omit_keys=omit)
    with pytest.raises(gguf.GGUFError, match=message) as e:
        gguf.load(path, "text")
    assert e.value.path == path and "\n" not in str(e.value)
    line = cli_error(run_cli("reference.run", "--model", path, "--n-predict", "0"))
    assert path in line and re.search(message, line)


def test_empty_vocabulary(tmp_path):
    # load() reads the tokenizer first and refuses the missing list there (above); read_text_config
    # guards callers that read the config on its own, as tools do
    path = planted(tmp_path, "novocab", omit_keys=("tokenizer.ggml.tokens",))
    meta = gguf.Metadata(gguf.open_reader(path), path)
    with pytest.raises(gguf.GGUFError, match=r"the vocabulary \(tokenizer.ggml.tokens\) is empty"):
        gguf.read_text_config(meta)


def test_per_layer_array_shorter_than_the_layers(tmp_path):
    # llama.cpp copies the array into its per-layer table and leaves the layers past its end at 0 heads
    path = planted(tmp_path, "short", extra_keys={A + "attention.head_count": ([4, 4], ARR)})
    with pytest.raises(gguf.GGUFError, match="attention.head_count.*per-layer"):
        gguf.load(path, "text")


def planted_role(tmp_path, role, extra_keys=None, omit_keys=(), edit_shapes=list):
    """A synthetic mmproj or drafter with keys edited, its [(name, shape)] passed through edit_shapes."""
    keys, shapes, arch = {"mmproj": (vision_keys, vision_shapes, "clip"),
                          "dflash": (draft_keys, draft_shapes, "dflash")}[role]
    dims = VisionDims() if role == "mmproj" else DraftDims()
    specs = [random_spec(name, shape, Q.F32, i) for i, (name, shape) in enumerate(edit_shapes(shapes(dims)))]
    path = str(tmp_path / f"{role}.gguf")
    stream_gguf(path, arch, EditingKeys(keys(dims), omit_keys, extra_keys or {}), specs)
    return path


IMAGE = os.path.join(GOLDEN, "vision", "decode", "rgba.png")  # any image: every input is read before a GGUF loads


def role_cli(role, path):  # the CLI run that loads `path` in `role`
    flags = ["--mmproj", path, "--image", IMAGE] if role == "mmproj" else ["--draft-model", path]
    return run_cli("reference.run", *flags, "--n-predict", "0")


ROLE_CASES = [
    ("mmproj", {"clip.projector_type": ("gemma3", STR)}, (), "clip.projector_type is 'gemma3', not 'muse-glimmer'"),
    ("mmproj", {}, ("clip.projector_type",), "missing required key clip.projector_type"),
    ("mmproj", {"clip.has_vision_encoder": (False, BOOL)}, (), r"mmproj has no vision encoder"),
    ("mmproj", {}, ("clip.has_vision_encoder",), r"mmproj has no vision encoder"),
    ("mmproj", {"clip.vision.attention.head_count": (3, U32)}, (), "implausible vision sizes: .* width=64 heads=3 "),
    ("mmproj", {"clip.vision.attention.head_count": (0, U32)}, (), "implausible vision sizes: .* heads=0 "),
    ("mmproj", {"clip.vision.block_count": (0, U32)}, (), "implausible vision sizes: layers=0 "),
    ("mmproj", {"clip.vision.patch_size": (0, U32)}, (), "implausible vision sizes: .* patch=0"),
    ("dflash", {}, ("dflash.target_layers",), "missing required key dflash.target_layers"),
    ("dflash", {"dflash.block_count": (0, U32)}, (), "implausible drafter sizes: layers=0 "),
    ("dflash", {"dflash.attention.head_count": (0, U32)}, (), "implausible drafter sizes: .* heads=0/2"),
    ("dflash", {"dflash.attention.head_count_kv": (3, U32)}, (), "implausible drafter sizes: .* heads=4/3"),
    ("dflash", {"dflash.attention.head_count_kv": (0, U32)}, (), "implausible drafter sizes: .* heads=4/0"),
]


def role_case_id(case):  # a case -> "dflash:dflash.block_count=0"
    role, extra, omit, _ = case
    return f"{role}:{case_id(extra, omit)}"


@pytest.mark.parametrize("role, extra, omit, message", ROLE_CASES, ids=[role_case_id(c) for c in ROLE_CASES])
def test_bad_mmproj_and_drafter_metadata_api_and_cli(tmp_path, role, extra, omit, message):
    path = planted_role(tmp_path, role, extra, omit)
    with pytest.raises(gguf.GGUFError, match=message) as e:
        gguf.load(path, role)
    assert e.value.path == path and "\n" not in str(e.value)
    line = cli_error(role_cli(role, path))
    assert path in line and re.search(message, line)


# ---------------------------------------------------------------------------------------------
# A path that is not a readable file

@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_file_without_read_permission(tmp_path, synthetic_gguf):
    path = tmp_path / "locked.gguf"
    shutil.copyfile(synthetic_gguf, path)
    path.chmod(0)
    with pytest.raises(gguf.GGUFError, match=r"cannot read \(Permission denied\)"):
        gguf.load(path, "text")
    line = cli_error(run_cli("reference.run", "--model", str(path)))
    assert str(path) in line and "Permission denied" in line


def test_read_error_while_mapping(monkeypatch, synthetic_gguf):
    # the same refusal as a file without read permission, where the test runs as root: the header
    # was read, then mapping the file fails
    def refuse(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(gguf.reader, "GGUFFile", refuse)
    with pytest.raises(gguf.GGUFError, match=r"cannot read \(Permission denied\)") as e:
        gguf.load(synthetic_gguf, "text")
    assert e.value.path == synthetic_gguf
