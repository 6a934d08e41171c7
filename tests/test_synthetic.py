"""The synthetic writer: the release layouts have the converter's tensor counts and shapes, random
quantized blocks are valid with the intended spread, and every role loads."""
import os
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGML_QUANT_SIZES, quants

from reference import gguf, random_blocks
from conftest import MODELS
from tools import synthetic as ms


def test_release_tensor_counts():
    # docs/vision.md, GGUF: 4 + 50*16 + 2 + 3 = 809 tensors; text: 3 + 52*14; drafter: 3 + 5*11
    assert len(ms.vision_shapes(ms.RELEASE_MMPROJ)) == 809
    assert len(ms.text_shapes(ms.RELEASE_30B)) == 3 + 52 * 14
    assert len(ms.draft_shapes(ms.RELEASE_DRAFTER)) == 3 + 5 * 11
    shapes = dict(ms.text_shapes(ms.RELEASE_30B))
    assert shapes["blk.0.attn_q.weight"] == (4096, 6656) and shapes["output.weight"] == (202048, 6656)
    assert dict(ms.draft_shapes(ms.RELEASE_DRAFTER))["fc.weight"] == (6656, 33280)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ4_XS, Q.Q4_K, Q.Q6_K, Q.Q8_0])
def test_random_blocks_dequantize_with_the_intended_std(qtype):
    rng = np.random.default_rng(0)
    unit = random_blocks.block_scale_for_unit_std(qtype)
    rows = random_blocks.random_rows(qtype, 64, 1024, 0.03, rng, unit)
    w = quants.dequantize(rows, qtype)
    assert w.shape == (64, 1024) and np.all(np.isfinite(w))
    # The scale was calibrated on 64 other random blocks (block_scale_for_unit_std), and this sample
    # has n blocks. The blocks' mean squares vary with relative spread r (their random sub-scales and
    # grids; measured 0.16 for Q8_0 to 0.33), so std(w) / 0.03 has a sampling sigma of
    # 0.5 r sqrt(1/64 + 1/n): 1.0 % (Q8_0, 2048 blocks of 32) to 2.3 % (256 blocks of 256); 40
    # reseeded calibrations and samples spread 1.0 % to 2.3 % as well. The f16 scale adds at most
    # 0.05 %. Gate: 4 sigma (measured at most 1.4 sigma, IQ4_XS -3.2 %).
    block = GGML_QUANT_SIZES[qtype][0]
    mean_square = (w.reshape(-1, block).astype(np.float64) ** 2).mean(-1)
    sigma = 0.5 * mean_square.std() / mean_square.mean() * np.sqrt(1 / random_blocks.PROBE_BLOCKS + 1 / len(mean_square))
    assert abs(np.std(w) / 0.03 - 1) <= 4 * sigma


def test_every_role_loads(tmp_path):
    text = ms.write_text_gguf(str(tmp_path / "t.gguf"))
    assert gguf.load(str(tmp_path / "t.gguf"), "text").config.n_layer == text.n_layer
    v = gguf.load(ms.write_mmproj_gguf(tmp_path / "v.gguf", qtype="F16"), "mmproj")
    assert (v.config.n_layer, v.config.n_embd, v.weights.type_name("v.blk.0.attn_q.weight")) == (2, 64, "F16")
    d = gguf.load(ms.write_draft_gguf(tmp_path / "d.gguf", qtype="Q8_0"), "dflash")
    assert d.config.target_layers == (2, 4) and d.weights.type_name("fc.weight") == "Q8_0"


def test_release_layout_streams_with_two_layers(tmp_path):
    # real widths, 2 layers (layer 0 sliding, layer 1 full), the UD-IQ2_XXS mix; a 4096-token vocabulary
    # keeps the file at 190 MB (the release's 202048 rows would add 1.9 GB of embeddings and head)
    path = str(tmp_path / "l2.gguf")
    ms.write_layout_gguf(path, replace(ms.RELEASE_30B, n_layer=2, n_vocab=4096), "ud-iq2_xxs", progress=False)
    m = gguf.load(path, "text")
    assert m.config.swa_layers == (True, False) and m.config.head_dim == 128
    types = {n: m.weights.type_name(n) for n in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                                                 "blk.0.attn_v.weight", "token_embd.weight", "output.weight")}
    assert types == {"blk.0.attn_q.weight": "IQ2_XXS", "blk.0.ffn_down.weight": "IQ3_XXS",
                     "blk.0.attn_v.weight": "IQ4_XS", "token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
    rows = m.weights.rows("blk.1.ffn_up.weight", slice(0, 8))
    assert 0.5 / np.sqrt(6656) < np.std(rows) < 2 / np.sqrt(6656)


# convert_hf_to_gguf's own outputs (golden/models, made from the tiny transformers checkpoints) and the
# --outtype each was made with: the synthetic writers must store every tensor in the type it chose
CONVERTED = {"tiny-a-f32.gguf": Q.F32, "tiny-a-f16.gguf": Q.F16, "tiny-a-bf16.gguf": Q.BF16, "tiny-a-q8_0.gguf": Q.Q8_0,
             "tiny-a-mmproj-f32.gguf": Q.F32, "tiny-a-mmproj-f16.gguf": Q.F16,
             "glimmer-default-mmproj-f16.gguf": Q.F16, "glimmer-default-dflash-f16.gguf": Q.F16}


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_stored_types_are_the_converters(name):
    from gguf import GGUFReader
    reader = GGUFReader(os.path.join(MODELS, name))
    chosen = {t.name: ms.stored_type(t.name, tuple(int(n) for n in t.shape[::-1]), CONVERTED[name]).name
              for t in reader.tensors}
    assert chosen == {t.name: t.tensor_type.name for t in reader.tensors}


def test_mmproj_writes_position_embedding_in_f32(tmp_path):
    # mtmd's ggml_interpolate asserts an F32 position table: an F16 one aborted llama-mtmd-cli
    from gguf import GGUFReader
    types = {t.name: t.tensor_type for t in GGUFReader(ms.write_mmproj_gguf(tmp_path / "m.gguf", qtype="F16")).tensors}
    assert types["v.position_embd.weight"] == Q.F32 and types["v.patch_embd.weight"] == Q.F16
    assert types["v.blk.0.attn_q.weight"] == Q.F16 and types["v.blk.0.attn_q.bias"] == Q.F32


def test_llama_cpp_loads_the_synthetic_files(tmp_path):
    # where llama-cpp-python is installed (the parity extra): every small synthetic layout loads in
    # llama.cpp as a converted file does, the projector through mtmd on the text model
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_cpp import mtmd_cpp
    for qtype in ("F32", "F16", "Q8_0"):
        text = str(tmp_path / f"t-{qtype}.gguf")
        ms.write_text_gguf(text, qtype=qtype)
        model = llama_cpp.llama_model_load_from_file(text.encode(), llama_cpp.llama_model_default_params())
        assert model, f"llama.cpp cannot load the synthetic {qtype} text model"
        if qtype == "F32":
            text_model = model
            continue
        llama_cpp.llama_model_free(model)
    dims = ms.VisionDims(n_out=ms.TextDims().n_embd)
    for qtype in ("F32", "F16"):
        mmproj = ms.write_mmproj_gguf(tmp_path / f"m-{qtype}.gguf", dims, qtype)
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu, params.warmup = False, False
        ctx = mtmd_cpp.mtmd_init_from_file(mmproj.encode(), text_model, params)
        assert ctx, f"mtmd cannot load the synthetic {qtype} projector"
        mtmd_cpp.mtmd_free(ctx)
    llama_cpp.llama_model_free(text_model)
