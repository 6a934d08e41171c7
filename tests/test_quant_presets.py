"""Every llama-quantize preset (golden/presets/, made by tools/regen/make_quant_presets.py) in the exact mode,
NumPy and numba backends, against llama.cpp's own logits of the same file; the decoders of every
tensor against ggml's to_float; the refusal of a type that cannot be decoded.

NMSE is sum((ref - x)^2) / sum(ref^2) with llama.cpp's logits as ref, over every prompt position of
the preset's four prompts (105 positions) and, separately, its 4 x 7 single-token decode steps fed
llama.cpp's own greedy tokens.

    python tests/test_quant_presets.py      # prints the README's table of these figures
"""
import functools
import hashlib
import json
import os
import struct
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from reference import gguf
from reference.text import TextModel
from reference.metrics import max_abs_diff, nmse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import GOLDEN, require  # noqa: E402

PRESETS = os.path.join(GOLDEN, "presets")

# Gates on NMSE against llama.cpp (prefill and decode alike). The exact mode multiplies ggml's own
# weights (test_every_tensor_decodes_as_ggml_does: bit for bit) with float32 activations; llama.cpp's
# CPU path first rounds every activation row to the weight's vec_dot type: Q8_0 (blocks of 32, step
# amax/127; Q8_1 for Q4_1/Q5_1, the same values) for Q4_0..Q8_0, Q1_0, Q2_0, MXFP4 and IQ4_NL; Q8_K
# (blocks of 256, step amax/127) for the K, IQ (but IQ4_NL) and TQ types. One rounding adds a
# relative error (amax/127)^2/12 / mean(x^2) per product: E[amax^2] of N(0, 1) is 2.36^2 over 32
# values and 3.04^2 over 256, so ~3.0e-5 (Q8_0) and ~4.9e-5 (Q8_K), a ratio of 1.63. The 25
# products per token (8 per layer and the output) and 3 layers of random weights amplify it to the
# logits' NMSE, but alike for every weight type: the measurements fall into exactly these two
# classes, 4.9e-4 .. 7.1e-4 for presets whose matrices are (mostly) Q8_0-dot types, 9.7e-4 ..
# 1.27e-3 for the Q8_K ones (ratio ~1.8, near the derived 1.63), whatever the weights' bit width.
# tiny-b's committed converter Q8_0 run measures 6.2e-4 too (test_text_parity). Each class's gate
# is 3x its largest measurement (as test_text_parity's gates): room for another thread count or
# summation order in llama.cpp. A layout bug is far above it: Q2_0 with the four 2-bit fields of a
# byte read high first measures NMSE 1.7. A 1 % error in every Q2_0 scale is not (6.3e-4, inside
# the activation rounding): the decoders are held to ggml bit for bit by
# test_every_tensor_decodes_as_ggml_does, not by these gates. Where top-1 differs, llama.cpp's own
# top1-top2 margin must be a near tie (tools.diff typical-error rule, as in test_text_parity): no
# real flip is allowed.
Q8_0_ACTS = 2.2e-3
Q8_K_ACTS = 3.9e-3
GATES = {  # preset: max NMSE          measured NMSE (numpy backend) prefill / decode, top-1 prefill
    "Q1_0": Q8_0_ACTS,      # 4.9e-4 / 4.6e-4, 96.2 %
    "Q2_0": Q8_0_ACTS,      # 5.9e-4 / 5.7e-4, 96.2 %
    "Q4_0": Q8_0_ACTS,      # 5.7e-4 / 5.8e-4, 95.2 %
    "Q4_1": Q8_0_ACTS,      # 6.4e-4 / 6.7e-4, 96.2 %
    "MXFP4_MOE": Q8_0_ACTS,  # 6.2e-4 / 5.0e-4, 94.3 % (no MoE tensors: every matrix Q8_0)
    "Q5_0": Q8_0_ACTS,      # 5.9e-4 / 5.1e-4, 97.1 %
    "Q5_1": Q8_0_ACTS,      # 6.5e-4 / 6.2e-4, 94.3 %
    "IQ4_NL": Q8_0_ACTS,    # 7.1e-4 / 6.3e-4, 97.1 %: the largest of this class
    "Q8_0": Q8_0_ACTS,      # 6.2e-4 / 5.0e-4, 94.3 %
    "IQ2_XXS": Q8_K_ACTS,   # 1.14e-3 / 1.10e-3, 96.2 %
    "IQ2_XS": Q8_K_ACTS,    # 1.12e-3 / 1.08e-3, 94.3 %
    "IQ2_S": Q8_K_ACTS,     # 1.12e-3 / 1.15e-3, 94.3 %
    "IQ2_M": Q8_K_ACTS,     # 1.10e-3 / 1.13e-3, 95.2 %
    "IQ1_S": Q8_K_ACTS,     # 1.15e-3 / 1.21e-3, 95.2 %
    "IQ1_M": Q8_K_ACTS,     # 1.14e-3 / 1.09e-3, 93.3 %
    "TQ1_0": Q8_K_ACTS,     # 1.09e-3 / 9.8e-4, 93.3 %
    "TQ2_0": Q8_K_ACTS,     # 1.09e-3 / 9.8e-4, 93.3 % (the same ternary values as TQ1_0, packed otherwise)
    "Q2_K": Q8_K_ACTS,      # 1.18e-3 / 1.04e-3, 95.2 %
    "Q2_K_S": Q8_K_ACTS,    # 1.15e-3 / 1.15e-3, 94.3 %
    "IQ3_XXS": Q8_K_ACTS,   # 1.17e-3 / 1.08e-3, 94.3 %
    "IQ3_S": Q8_K_ACTS,     # 1.16e-3 / 1.01e-3, 95.2 %
    "IQ3_M": Q8_K_ACTS,     # 1.11e-3 / 1.00e-3, 88.6 %
    "IQ3_XS": Q8_K_ACTS,    # 1.18e-3 / 1.03e-3, 94.3 %
    "Q3_K_S": Q8_K_ACTS,    # 1.00e-3 / 1.07e-3, 98.1 %
    "Q3_K_M": Q8_K_ACTS,    # 9.9e-4 / 1.00e-3, 93.3 %
    "Q3_K_L": Q8_K_ACTS,    # 9.8e-4 / 9.7e-4, 94.3 %
    "IQ4_XS": Q8_K_ACTS,    # 1.13e-3 / 1.12e-3, 96.2 %
    "Q4_K_S": Q8_K_ACTS,    # 1.15e-3 / 1.04e-3, 94.3 %
    "Q4_K_M": Q8_K_ACTS,    # 1.19e-3 / 1.27e-3, 94.3 %: the largest of this class
    "Q5_K_S": Q8_K_ACTS,    # 1.11e-3 / 1.26e-3, 93.3 %
    "Q5_K_M": Q8_K_ACTS,    # 1.11e-3 / 1.22e-3, 97.1 %
    "Q6_K": Q8_K_ACTS,      # 1.10e-3 / 1.10e-3, 94.3 %
}


@functools.lru_cache(maxsize=None)
def manifest():
    with open(os.path.join(PRESETS, "manifest.json")) as f:
        return json.load(f)


def preset_entry(preset):
    return next(e for e in manifest()["presets"] if e["preset"] == preset)


def golden_runs(preset):  # -> [(token ids, prompt logits, greedy tokens, decode logits)] of llama.cpp
    run = os.path.join(PRESETS, preset_entry(preset)["logits"])
    with open(os.path.join(run, "manifest.json")) as f:
        entries = json.load(f)["entries"]
    load = lambda name: np.load(os.path.join(run, name), allow_pickle=False)  # noqa: E731
    return [(e["token_ids"], load(e["file"]), e["greedy"]["tokens"], load(e["greedy"]["decode_logits"]))
            for e in entries]


def make_backend(name):  # "numpy" | "numba" -> backend, or None for numpy's default
    if name == "numpy":
        return None
    require("numba")
    from accel.numba import NumbaBackend
    return NumbaBackend(np.float32)


@functools.lru_cache(maxsize=None)
def exact_run(preset, backend):  # -> (prompt logits stacked, decode logits stacked), ours and llama.cpp's
    lm = TextModel(gguf.load(os.path.join(PRESETS, preset_entry(preset)["file"]), "text"), np.float32,
                   make_backend(backend))
    ours, theirs = ([], []), ([], [])
    for ids, prompt, tokens, steps in golden_runs(preset):
        cache = lm.new_cache(len(ids) + len(tokens), "ring", 2048)
        ours[0].append(lm.prefill(ids, cache))
        ours[1].extend(lm.prefill([t], cache)[-1] for t in tokens[:-1])
        theirs[0].append(prompt)
        theirs[1].append(steps)
    return (np.concatenate(ours[0]), np.array(ours[1])), (np.concatenate(theirs[0]), np.concatenate(theirs[1]))


def figures(golden, ours):  # [n, V] x2 -> (NMSE, max |diff|, top-1 agreement)
    return (float(nmse(golden.ravel(), ours.ravel())), float(max_abs_diff(golden.ravel(), ours.ravel())),
            float(np.mean(golden.argmax(-1) == ours.argmax(-1))))


def numba_kernel_types():  # -> the ggml types accel/numba/quant.py multiplies from their blocks
    require("numba")
    from accel.numba import quant
    return quant.KERNEL_TYPES


def test_every_preset_is_gated_and_committed():
    made = [e["preset"] for e in manifest()["presets"]]
    assert sorted(made) == sorted(GATES), "a new preset needs a gate derived from its own measurement"
    for e in manifest()["presets"]:
        path = os.path.join(PRESETS, e["file"])
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == e["sha256"], e["file"]
        assert e["size"] < 2 << 20, e["file"]


@pytest.mark.parametrize("preset", sorted(GATES))
def test_every_tensor_decodes_as_ggml_does(preset):
    """Every tensor, dequantized by reference.gguf (gguf-py's decoders, and ours for Q1_0 and Q2_0),
    has exactly the float32 bytes of ggml's to_float (llama-quantize requantizing the file to F32);
    and the reader sees the types llama-quantize wrote."""
    e = preset_entry(preset)
    weights = gguf.load(os.path.join(PRESETS, e["file"]), "text").weights
    assert {name: weights.type_name(name) for name in weights.tensors} == e["tensor_types"]
    assert set(e["ggml_f32_sha256"]) == set(e["tensor_types"])
    for name, digest in e["ggml_f32_sha256"].items():
        assert hashlib.sha256(weights.get(name).astype("<f4").tobytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name, qtype", [("q1_0", GGMLQuantizationType.Q1_0), ("q2_0", gguf.GgmlType.Q2_0)])
def test_new_decoders_match_ggml_on_every_code(name, qtype):
    """Random Q1_0 / Q2_0 blocks and ggml's own to_float of them (crafted_blocks.npz): every code
    occurs, the 2d of Q2_0 too, which its quantizer never writes. NumPy and numba decoders alike."""
    from accel.numba import quant

    crafted = np.load(os.path.join(PRESETS, manifest()["crafted_blocks"]["file"]), allow_pickle=False)
    blocks, expected = crafted[f"{name}_blocks"], crafted[f"{name}_values"]
    codes = np.unpackbits(blocks[:, 2:], bitorder="little") if name == "q1_0" else \
        ((blocks[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).ravel()
    assert len(np.unique(codes)) == (2 if name == "q1_0" else 4)
    ours = gguf.dequantize(blocks.reshape(1, -1), qtype, "crafted", name).ravel()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))
    require("numba")
    tiles = np.empty((1, expected.size), np.float32)
    quant.dequantize_rows(int(qtype), blocks.reshape(1, -1), expected.size, 0, tiles, quant.TABLES)
    assert np.array_equal(tiles.ravel().view(np.uint32), expected.view(np.uint32))


def test_presets_hold_every_type_llama_quantize_writes_here():
    # F16 and BF16 are the converter's files in golden/models (test_text_parity)
    held = {t for e in manifest()["presets"] for t in e["tensor_types"].values()}
    assert held == {"F32", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                    "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"}


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("preset", sorted(GATES))
def test_exact_mode_against_llama_cpp(preset, backend):
    from tools.parity import diff

    (prompt, steps), (golden_prompt, golden_steps) = exact_run(preset, backend)
    assert prompt.shape == golden_prompt.shape and steps.shape == golden_steps.shape
    for golden, ours in ((golden_prompt, prompt), (golden_steps, steps)):
        assert figures(golden, ours)[0] <= GATES[preset]
        report = diff.diff_logits(golden, ours, diff.TYPICAL)
        assert report["summary"]["n_real"] == 0, f"real flips (M = {report['near_tie_margin']:.3g})"


@pytest.mark.parametrize("preset", sorted(GATES))
def test_numba_kernels_decode_as_numpy_does(preset):
    """Every matrix of every preset has a numba kernel, and its numba tiles (float32, and float64 for
    float64 runs) are bit-identical to reference.gguf's dequantization (gguf-py's, and ours for Q1_0
    and Q2_0), whichever of the 24 types llama-quantize wrote."""
    from accel.numba import quant

    kernels = numba_kernel_types()
    weights = gguf.load(os.path.join(PRESETS, preset_entry(preset)["file"]), "text").weights
    for name, t in weights.tensors.items():
        if len(weights.shape(name)) != 2:
            continue
        assert t.tensor_type in kernels, f"{name}: {t.tensor_type.name} has no numba kernel"
        n_out, n_in = weights.shape(name)
        expected = weights.get(name).view(np.uint32)
        for dtype in (np.float32, np.float64):
            ours = np.empty((n_out, n_in), dtype)
            quant.dequantize_rows(int(t.tensor_type), quant.as_blocks(weights.raw(name), n_out), n_in, 0, ours,
                                  quant.TABLES)
            assert np.array_equal(ours.astype(np.float32).view(np.uint32), expected), name


# The numba products of one matrix against the reference's (float64 sums of the same exact weights):
# accel/harness.py's linear gate, 1e-11 (float32 sums of at most 1024 terms: <= 3.6e-12). Measured
# on every preset matrix (these inputs): <= 1.6e-13 for the row route (Q5_K_M's Q5_K attn_k, whose
# sums cancel), <= 2.0e-14 for the tiles.
PRODUCT_GATE = 1e-11


@pytest.mark.parametrize("preset", sorted(GATES))
def test_numba_products_on_every_preset_matrix(preset):
    """Both numba routes (1 row of x: the row kernels; 5 rows: the tiles) on llama-quantize's own
    blocks of every matrix, against reference/ops.py's product of reference.gguf's weights."""
    from reference import ops

    backend = make_backend("numba")
    weights = gguf.load(os.path.join(PRESETS, preset_entry(preset)["file"]), "text").weights
    rng = np.random.default_rng(7)
    for name in (n for n in weights.tensors if len(weights.shape(n)) == 2):
        for rows in (1, 5):
            x = rng.standard_normal((rows, weights.shape(name)[1])).astype(np.float32)
            ref = ops.linear(x, weights.get(name, np.float64))
            assert nmse(ref.ravel(), backend.linear(x, weights.tensor(name)).ravel()) <= PRODUCT_GATE, (name, rows)


# numba against numpy on the same preset: tests/test_numba.py's whole-model gate, 1e-11 (the same
# exact weights, sums in float32 within a block or tile). Measured on the presets: 1.4e-13 .. 8.1e-13
# (Q5_K_M), max |diff| <= 2.4e-5, top-1 identical at every prefill and decode position.
NUMBA_GATE = 1e-11


@pytest.mark.parametrize("preset", sorted(GATES))
def test_numba_gives_the_numpy_logits(preset):
    numpy_run, numba_run = exact_run(preset, "numpy")[0], exact_run(preset, "numba")[0]
    for ours, theirs in zip(numba_run, numpy_run):
        assert nmse(theirs.ravel(), ours.ravel()) <= NUMBA_GATE
        assert np.array_equal(theirs.argmax(-1), ours.argmax(-1))


def patched_type(tmp_path, type_id, tensor="blk.0.ffn_up.weight"):  # -> the Q2_0 preset, one tensor's type id changed
    src = os.path.join(PRESETS, preset_entry("Q2_0")["file"])
    t = next(t for t in gguf.open_reader(src).tensors if t.name == tensor)
    path = tmp_path / f"type{type_id}.gguf"
    data = bytearray(open(src, "rb").read())
    data[t.type_offset:t.type_offset + 4] = struct.pack("<I", type_id)
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize("type_id, message", [
    (15, "unsupported tensor type Q8_K in tensor blk.0.ffn_up.weight"),    # ggml's activation type: no to_float
    (9, "unsupported tensor type Q8_1 in tensor blk.0.ffn_up.weight"),
    (4, "unsupported tensor type id 4 in tensor blk.0.ffn_up.weight"),     # Q4_2, removed from ggml
    (43, "unsupported tensor type id 43 in tensor blk.0.ffn_up.weight"),   # GGML_TYPE_COUNT
])
def test_a_type_that_cannot_be_decoded_is_refused_by_name(tmp_path, type_id, message):
    from conftest import cli_error, run_cli

    path = patched_type(tmp_path, type_id)
    with pytest.raises(gguf.GGUFError) as e:
        gguf.load(path, "text")
    assert message in str(e.value) and "corrupt" not in str(e.value)
    assert message in cli_error(run_cli("reference.run", "--model", path))


def test_a_q2_0_tensor_reads_as_q2_0():
    # gguf-py 0.19.0 knows no type 42: its own reader calls such a file corrupt
    from gguf import GGUFReader

    path = os.path.join(PRESETS, preset_entry("Q2_0")["file"])
    with pytest.raises(ValueError):
        GGUFReader(path)
    assert gguf.load(path, "text").weights.type_name("blk.0.ffn_up.weight") == "Q2_0"


@pytest.mark.parametrize("args, expected", [
    (["--llama-bin", "."], "no llama-quantize there"),
    (["--llama-bin", ".", "--n-predict", "65"], "--n-predict"),
    ([], "--llama-bin"),
])
def test_make_quant_presets_bad_input(args, expected):
    from conftest import cli_error, run_cli

    cli_error(run_cli("tools.make_quant_presets", *args), expected)


HELP = """usage: llama-quantize [--help] model-f32.gguf [model-quant.gguf] type [nthreads]
 allowed quantization types
  40  or  Q1_0    :  1.125 bpw quantization
  12  or  Q3_K    : alias for Q3_K_M
  12  or  Q3_K_M  :  3.74G, +0.6569 ppl @ Llama-3-8B
   1  or  F16     : 14.00G, +0.0020 ppl @ Mistral-7B
          COPY    : only copy tensors, no quantizing
"""


def fake_llama_bin(tmp_path):  # a directory whose llama-quantize prints HELP (in llama.cpp's layout)
    for tool in ("llama-quantize", "llama-imatrix"):
        (tmp_path / tool).write_text(f"#!/bin/sh\ncat <<'END'\n{HELP}END\n")
        (tmp_path / tool).chmod(0o755)
    return tmp_path


def test_presets_are_read_from_the_help(tmp_path):
    from tools.regen import make_quant_presets

    presets, skipped = make_quant_presets.listed_presets(fake_llama_bin(tmp_path) / "llama-quantize")
    assert presets == ["Q1_0", "Q3_K_M"] and sorted(skipped) == ["COPY", "F16", "Q3_K"]


def test_an_unlisted_preset_is_refused(tmp_path):
    from conftest import cli_error, run_cli

    line = cli_error(run_cli("tools.make_quant_presets", "--llama-bin", str(fake_llama_bin(tmp_path)),
                             "--presets", "Q1_0,Q9_9"))
    assert "Q9_9 not among llama-quantize's Q1_0, Q3_K_M" in line


def parity_table():  # -> the README's rows: preset, NMSE prefill / decode, max |diff|, top-1, numba's NMSE, gate
    rows = ["| preset | NMSE prefill | NMSE decode | max abs diff | top-1 prefill / decode | numba NMSE prefill "
            "| gate |",
            "|---|---|---|---|---|---|---|"]
    for preset in (e["preset"] for e in manifest()["presets"]):
        (prompt, steps), (golden_prompt, golden_steps) = exact_run(preset, "numpy")
        p, d = figures(golden_prompt, prompt), figures(golden_steps, steps)
        numba = figures(golden_prompt, exact_run(preset, "numba")[0][0])
        rows.append(f"| {preset} | {p[0]:.2e} | {d[0]:.2e} | {max(p[1], d[1]):.2f} | "
                    f"{100 * p[2]:.1f} % / {100 * d[2]:.1f} % | {numba[0]:.2e} | {GATES[preset]:.2g} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(parity_table())


def test_make_tiny_counts_the_types_gguf_py_lacks():
    """tools.make_tiny's per-type tensor counts (its manifests) read Q2_0 files, which gguf-py's own
    reader refuses: the counts are those of the preset manifest's per-tensor types."""
    from collections import Counter
    from tools.regen.make_tiny import tensor_types

    e = preset_entry("Q2_0")
    assert tensor_types(os.path.join(PRESETS, e["file"])) == dict(sorted(Counter(e["tensor_types"].values()).items()))
