"""Loading the three GGUF roles: configs against the transformers configs they came from, and every
bad input as one line naming the file (GGUFError from the API, exit 2 from the CLI)."""
import json
import os
import struct

import numpy as np
import pytest
from gguf import GGUFValueType

from reference import gguf
from tools.make_synthetic import TextDims, text_tensors, write_text_gguf
from conftest import MODELS, model_manifest, run_cli


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
    data = open(src, "rb").read()
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


def test_missing_tensor(tmp_path):
    t = text_tensors(TextDims(), np.random.default_rng(0))
    del t["blk.2.ffn_up.weight"]
    path = planted(tmp_path, "missing_tensor", tensors=t)
    with pytest.raises(gguf.GGUFError, match="missing tensor blk.2.ffn_up.weight"):
        gguf.load(path, "text")


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    t = text_tensors(TextDims(), np.random.default_rng(0))
    t["blk.1.attn_k.weight"] = t["blk.1.attn_k.weight"][:64]
    path = planted(tmp_path, "bad_shape", tensors=t)
    with pytest.raises(gguf.GGUFError, match=r"blk.1.attn_k.weight has shape \[64, 256\].*\[128, 256\]"):
        gguf.load(path, "text")
    r = run_cli("reference.run", "--model", path)
    assert r.returncode == 2 and "blk.1.attn_k.weight" in r.stderr and r.stderr.count("\n") == 1


def test_unsupported_quant_type(tmp_path):
    # patch the type id of one tensor to a type gguf.quants cannot dequantize (Q8_1 = 9, same block size as Q8_0)
    path = planted(tmp_path, "q8_0", qtype="Q8_0")
    reader = gguf.open_reader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    type_offset = t.field.offset + sum(p.nbytes for p in t.field.parts[:4])
    with open(path, "r+b") as f:
        f.seek(type_offset)
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
