"""Bad input outside the GGUF reader (tests/test_gguf.py has that): a typed exception from the API
and, where the command line can reach it, one stderr line and exit status 2."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from reference import gguf, vision
from reference.chat import IMAGE_PLACEHOLDER, ChatError, token_id
from reference.dflash import DraftCache
from reference.ggml_cpu import GgmlCpuError, mul_mat
from reference.image import ImageError, load_rgb, to_rgb
from reference.kv import CacheError
from reference.trace import TraceError, Tracer, load_trace
from tools.synthetic import (ARCH, Q, TextDims, VisionDims, array_spec, random_spec, stream_gguf, text_keys,
                                  text_shapes, write_mmproj_gguf)
from conftest import MODELS, cli_error, run_cli
from test_gguf import BOOL, IMAGE, planted

TINY_MMPROJ = os.path.join(MODELS, "tiny-a-mmproj-f32.gguf")  # 256 wide, as the synthetic text models
DEFAULT_MMPROJ = os.path.join(MODELS, "glimmer-default-mmproj-f16.gguf")  # the default model's projector
DEFAULT_DRAFTER = os.path.join(MODELS, "glimmer-default-dflash-f16.gguf")


def write_png(path):  # -> str path of a gray 28 x 28 image
    Image.fromarray(np.full((28, 28, 3), 128, np.uint8)).save(path)
    return str(path)


# ---------------------------------------------------------------------------------------------
# reference.run arguments

@pytest.mark.parametrize("source", ["--prompt", "--prompt-file"])
def test_prompt_with_no_tokens(tmp_path, source):
    # a model that adds no BOS makes an empty prompt zero tokens (the committed models all add one)
    path = planted(tmp_path, "nobos", extra_keys={"tokenizer.ggml.add_bos_token": (False, BOOL)})
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    value = "" if source == "--prompt" else str(empty)
    line = cli_error(run_cli("reference.run", "--model", path, source, value, "--n-predict", "1"))
    assert "the prompt has no tokens" in line


def test_draft_model_with_image():
    # refused before the image is read: the file need not exist
    line = cli_error(run_cli("reference.run", "--draft-model", DEFAULT_DRAFTER, "--image", "unread.png",
                             "--n-predict", "1"))
    assert "--model-draft with --image is not supported" in line


# ---------------------------------------------------------------------------------------------
# Images: a file is ImageError naming it; a bad argument to the API is ValueError

def float_tiff(tmp_path):  # Pillow mode F: 32-bit float samples, which stb_image (llama.cpp) never yields
    path = str(tmp_path / "float.tiff")
    Image.fromarray(np.linspace(0, 1, 28 * 28, dtype=np.float32).reshape(28, 28)).save(path)
    return path


def test_floating_point_image_file(tmp_path):
    path = float_tiff(tmp_path)
    with pytest.raises(ImageError, match=r"cannot convert to RGB \(floating-point pixels \(mode F\)") as e:
        load_rgb(path)
    assert e.value.path == path and "\n" not in str(e.value)
    line = cli_error(run_cli("reference.run", "--mmproj", DEFAULT_MMPROJ, "--image", path, "--n-predict", "0"))
    assert path in line and "mode F" in line


def test_image_api_misuse_is_value_error(tmp_path):
    png = write_png(tmp_path / "gray.png")
    with pytest.raises(ValueError, match="alpha must be 'drop'"):
        load_rgb(png, alpha="black")
    with Image.open(png) as img, pytest.raises(ValueError, match="alpha must be 'drop'"):
        to_rgb(img, alpha="black")
    with pytest.raises(ValueError, match=r"floating-point pixels \(mode F\)"):  # an image object, no file to name
        to_rgb(Image.new("F", (4, 4)))


# ---------------------------------------------------------------------------------------------
# The vision tower

def test_vision_head_size_without_two_rope_halves(tmp_path):
    path = write_mmproj_gguf(tmp_path / "mm.gguf", VisionDims(n_head=32))  # 64 wide: heads of 2
    with pytest.raises(gguf.GGUFError, match="head size 2 cannot hold two rope halves") as e:
        vision.VisionModel(gguf.load(path, "mmproj"))
    assert e.value.path == path
    # refused when the tower is built
    line = cli_error(run_cli("reference.run", "--mmproj", path, "--image", IMAGE, "--n-predict", "0"))
    assert path in line and "head size 2" in line


@pytest.mark.parametrize("shape", [(27, 28, 3), (28, 42, 3), (0, 28, 3)])
def test_tower_input_not_a_multiple_of_28(shape):
    # encode() resizes to a multiple first; forward() on another size is a caller's mistake
    tower = vision.VisionModel(gguf.load(TINY_MMPROJ, "mmproj"))
    with pytest.raises(ValueError, match=f"tower input {shape[1]}x{shape[0]} is not a positive multiple of 28"):
        tower.forward(np.zeros(shape, np.uint8))


def test_vocabulary_without_image_tokens(tmp_path):
    path = planted(tmp_path, "noimagetokens")  # a vocabulary of t0, t1, ... and BOS/EOS/EOT
    tok = gguf.load(path, "text").tokenizer
    with pytest.raises(ChatError, match=r"the vocabulary has no <\|patch\|> token"):
        token_id(tok, IMAGE_PLACEHOLDER)
    # the synthetic model is as wide as the tiny projector's output, so the image is encoded first
    png = write_png(tmp_path / "gray.png")
    line = cli_error(run_cli("reference.run", "--model", path, "--mmproj", TINY_MMPROJ, "--image", png,
                             "--n-predict", "0"))
    assert "the vocabulary has no <|patch|> token" in line


# ---------------------------------------------------------------------------------------------
# The DFlash drafter's cache

def test_drafter_cache_full():
    # not reachable from the command line: run sizes the cache for the whole context plus one block,
    # and the target's own cache refuses a longer context first
    cache = DraftCache(n_layer=1, n_cells=2, n_head_kv=1, head_dim=4, dtype=np.float32)
    cache.allocate([0, 1])
    with pytest.raises(CacheError, match=r"drafter cache full \(2 cells\)"):
        cache.allocate([2])


# ---------------------------------------------------------------------------------------------
# ggml-cpu numerics: a weight type without a kernel (MXFP4, which llama-quantize writes for MoE tensors only)

def test_weight_type_without_a_kernel_is_refused(tmp_path):
    class Weights:
        def type_name(self, name):
            return "MXFP4"

    with pytest.raises(GgmlCpuError, match="output.weight: MXFP4 weights are not emulated"):
        mul_mat(np.zeros((1, 256), np.float32), Weights(), "output.weight", {})
    # from the command line: a Q8_0 model whose output head is MXFP4, and a 2-token prompt
    dims = TextDims()
    path = str(tmp_path / "mxfp4.gguf")
    head = np.random.default_rng(0).standard_normal((dims.n_vocab, dims.n_embd)).astype(np.float32)
    specs = [array_spec(name, head, Q.MXFP4) if name == "output.weight" else random_spec(name, shape, Q.Q8_0, i)
             for i, (name, shape) in enumerate(text_shapes(dims))]
    stream_gguf(path, ARCH, text_keys(dims), specs)
    line = cli_error(run_cli("reference.run", "--model", path, "--numerics", "ggml-cpu", "--token-ids", "1,2",
                             "--n-predict", "0"))
    assert "output.weight: MXFP4 weights are not emulated" in line


# ---------------------------------------------------------------------------------------------
# Traces

@pytest.mark.parametrize("directory", [False, True])
def test_trace_point_name_that_is_not_a_file_name(tmp_path, directory):
    # the name becomes <name>.npy in the trace directory: a path in it would write elsewhere
    tracer = Tracer(str(tmp_path) if directory else None, keep_in_memory=not directory)
    with pytest.raises(TraceError, match=r"trace point name '\.\./escape' is not a plain file name"):
        tracer("../escape", np.zeros(3))
    assert not (tmp_path.parent / "escape.npy").exists()


def trace_dir(tmp_path, index):  # a trace directory holding only index.json
    directory = tmp_path / "trace"
    directory.mkdir()
    (directory / "index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return str(directory)


@pytest.mark.parametrize("index, message", [
    (5, "a trace index is a JSON list"),
    ([{"name": "../escape"}], r"bad trace point name '\.\./escape'"),
    ([{"name": 3}], "bad trace point name 3"),
    ([["attn_norm-0"]], "bad trace point name None"),
    ("not json", "cannot read the trace index"),
    ([{"name": "attn_norm-0"}], r"attn_norm-0\.npy: .*No such file"),
], ids=["not a list", "path", "number", "not an object", "not json", "npy missing"])
def test_bad_trace_directory(tmp_path, index, message):
    directory = trace_dir(tmp_path, index)
    with pytest.raises(TraceError, match=message) as e:
        load_trace(directory)
    assert directory in str(e.value) and "\n" not in str(e.value)
    # tools.bisect reads traces with load_trace
    r = run_cli("tools.bisect", directory, directory)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and directory in r.stderr


def test_missing_trace_directory(tmp_path):
    with pytest.raises(TraceError, match="index.json: No such file or directory"):
        load_trace(str(tmp_path / "absent"))



# tools.make_iq_kernel_goldens: a model without the type, an --out that cannot be a folder

def test_iq_kernel_goldens_refuse_a_model_without_the_type():
    from pathlib import Path

    from reference.cli import UsageError
    from tools.regen.make_iq_kernel_goldens import regrouped
    with pytest.raises(UsageError, match="tiny-b-f32.gguf: no IQ1_S tensor"):
        regrouped(Path(MODELS, "tiny-b-f32.gguf"), "IQ1_S")


def test_iq_kernel_goldens_bad_out_is_one_line_exit_2(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    r = run_cli("tools.make_iq_kernel_goldens", "--out", str(not_a_folder))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_iq_kernel_goldens_without_llama_cpp_python(monkeypatch):
    import sys

    from reference.cli import UsageError
    from tools.regen.make_iq_kernel_goldens import ggml_libs
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(UsageError, match="needs llama-cpp-python"):
        ggml_libs()
