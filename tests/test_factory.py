"""reference/factory.py: one place builds every model. Its flag checks (one line, before any load),
the registry it finds accel's backends in, and the vision tower on the text model's backend, its
embeddings against the committed llama.cpp golden (golden/vision, tools/regen/make_vision_goldens.py).

NMSE is sum((ref - x)^2) / sum(ref^2) over the whole [n_tokens, n_embd] output, ref = llama.cpp's.
"""
import ast
import importlib
import inspect
import json
import os
import re
import sys

import numpy as np
import pytest

import accel
from reference import factory, gguf
from reference.backend import NumpyBackend
from reference.factory import Build, FactoryError
from reference.ggml_cpu import GgmlCpuBackend
from reference.metrics import nmse
from reference.run import main as run_main
from reference.tp import TensorParallelBackend
from reference.vision import DEFAULT_MAX_TOKENS
from tools.regen.make_vision_goldens import CASES
from tools.synthetic import synthetic_image
from conftest import GOLDEN, MODELS, ROOT, cli_error, require, run_cli

VISION = os.path.join(GOLDEN, "vision")
with open(os.path.join(VISION, "manifest.json")) as f:
    LLAMA = json.load(f)["llama-cpp"]
MMPROJ = os.path.join(MODELS, LLAMA["mmproj"]["f32"]["file"])
TEXT_MODEL = os.path.join(MODELS, LLAMA["text_model"]["file"])
CASE = "rect-200x150"
# test_vision.py's gate for the exact tower against llama.cpp, flash off: llama.cpp's F16 im2col is
# the residual [3e-8 .. 1e-7 on the cases but the 1-token ones]; 3x its worst, 1e-6
EXACT_GATE = 1e-6


def case_image(variant="f32-fa-off"):  # -> (the case's uint8 image, llama.cpp's embeddings [n, n_embd] every row_stride rows)
    _, w, h, kind, seed, _, _ = {c[0]: c for c in CASES}[CASE]
    entry = LLAMA["cases"][CASE]
    ref = np.load(os.path.join(VISION, "llama-cpp", entry["files"][variant]))
    return synthetic_image(w, h, seed, kind), ref, entry["row_stride"]


def case_files(tmp_path, rgb):  # uint8 image -> (a PNG of it, the --embeddings-out path beside it)
    from PIL import Image
    png, emb = str(tmp_path / "img.png"), str(tmp_path / "emb.npy")
    Image.fromarray(rgb).save(png)
    return png, emb


# ---------------------------------------------------------------------------------------------
# The flags

@pytest.mark.parametrize("build, message", [
    (Build(numerics="ggml-cpu", dtype="float64"), "--numerics ggml-cpu computes in float32"),
    (Build(numerics="ggml-cpu", backend="cupy"), "--numerics ggml-cpu computes in float32"),
    (Build(kv_type="f32"), "choose llama.cpp's build for --numerics ggml-cpu only"),
    (Build(flash_attn=False), "choose llama.cpp's build for --numerics ggml-cpu only"),
    (Build(repack=False), "choose llama.cpp's build for --numerics ggml-cpu only"),
    (Build(backend="numba", tp=2), "--tp simulates tensor parallelism on the numpy backend only"),
    (Build(tp=0), "--tp 0: at least 1"),
    (Build(backend="tpu"), r"unknown backend 'tpu' \(numpy, numba or cupy\)"),
    (Build(numerics="fast"), r"unknown numerics 'fast' \(exact or ggml-cpu\)"),
    (Build(numerics="ggml-cpu", kv_type="q4_0"), "-ctk q4_0: one of"),
    (Build(numerics="ggml-cpu", v_type="q4_0"), "-ctv q4_0: one of"),
    (Build(v_type="f32"), "choose llama.cpp's build for --numerics ggml-cpu only"),
])
def test_contradicting_flags_are_one_typed_error(build, message):
    with pytest.raises(FactoryError, match=message) as e:
        factory.backend(build)
    assert "\n" not in str(e.value)


def test_the_reference_builds_its_own_backends():
    assert type(factory.backend(Build())) is NumpyBackend
    assert isinstance(factory.backend(Build(tp=2)), TensorParallelBackend)
    be = factory.backend(Build(numerics="ggml-cpu"))
    assert type(be) is GgmlCpuBackend and (be.k_type, be.v_type, be.flash_attn, be.repack) == ("f16", "f16", False, True)
    q8 = factory.backend(Build(numerics="ggml-cpu", kv_type="q8_0", repack=False, n_threads=3))
    # llama.cpp's flash attention "auto" is on for a quantized V cache
    assert (q8.k_type, q8.v_type, q8.flash_attn, q8.repack, q8.n_threads) == ("q8_0", "q8_0", True, False, 3)


def test_every_registered_backend_and_model_resolves():
    """Each "module:callable" of accel's tables names a callable of its table's one signature, the
    reference's own maker's: a backend from a Build (factory.own_backend), a text model from
    (gguf_model, dtype, backend) (TextModel); the cupy ones import without CuPy."""
    own = {"BACKENDS": factory.own_backend, "TEXT_MODELS": factory.TextModel}
    for table, reference_maker in own.items():
        for (backend, numerics), entry in getattr(accel, table).items():
            assert backend in factory.BACKENDS and numerics in ("exact", "ggml-cpu"), entry
            module, _, name = entry.partition(":")
            if backend == "numba" and importlib.util.find_spec("numba") is None:
                continue
            make = getattr(importlib.import_module(module), name)
            assert list(inspect.signature(make).parameters) == list(inspect.signature(reference_maker).parameters), entry


def test_a_missing_package_is_one_line(monkeypatch):
    module = accel.BACKENDS["numba", "exact"].partition(":")[0]
    monkeypatch.setitem(sys.modules, module, None)  # importing the module the registry names raises ImportError
    with pytest.raises(FactoryError, match=r"^--backend numba needs numba \(.*\); install the accel extra$"):
        factory.backend(Build(backend="numba"))


def test_reference_names_no_numba_or_cupy_module():
    """reference/ reaches accel only through factory.ACCEL's registry: no import of accel, numba or
    CuPy, and no string naming one of their modules ("accel.numba", "cupy.cuda:..."); the backend
    names "numba" and "cupy" are flag values, not modules."""
    module_name = re.compile(r"(accel|numba|cupy)([.:][\w.:]+)")
    named = []
    for folder, _, files in os.walk(os.path.join(ROOT, "reference")):
        for file in (f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    named += [a.name for a in node.names if a.name.split(".")[0] in ("accel", "numba", "cupy")]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    named += [node.module] if node.module.split(".")[0] in ("accel", "numba", "cupy") else []
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    named += [node.value] if module_name.fullmatch(node.value) else []
    assert named == []


# ---------------------------------------------------------------------------------------------
# The vision tower: on the text model's backend, or refused

@pytest.mark.parametrize("flags, message", [
    (["--tp", "2"], "--tp shards the text model only"),
])
def test_a_tower_the_backend_cannot_compute_is_refused_before_any_load(tmp_path, flags, message):
    missing = str(tmp_path / "absent.gguf")  # never opened: the flags are refused first
    cli_error(run_cli("reference.run", "--model", missing, "--mmproj", missing, "--image", missing, *flags), message)


def test_the_tower_runs_on_numba_and_matches_llama_cpp():
    require("numba")
    rgb, ref, stride = case_image()
    build = Build(backend="numba")
    tower = factory.vision_model(gguf.load(MMPROJ, "mmproj"), build)
    assert tower.backend.name == "numba"
    ours = tower.encode(rgb, LLAMA["cases"][CASE]["max_tokens"] or DEFAULT_MAX_TOKENS)[::stride]
    assert ours.shape == ref.shape
    assert nmse(ref.ravel(), ours.ravel()) <= EXACT_GATE


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_ggml_cpu_cli_tower_is_mtmds(tmp_path, backend, flash_attn):
    """`--numerics ggml-cpu --image` builds mtmd's CPU graph on the text model's ggml-cpu backend, with
    its --flash-attn: mtmd's committed rows bit for bit (no tolerance: the emulation claims ggml's
    roundings)."""
    if backend == "numba":
        require("numba")
    rgb, ref, stride = case_image(f"f32-fa-{flash_attn}")
    png, emb = case_files(tmp_path, rgb)
    assert run_main(["--model", TEXT_MODEL, "--mmproj", MMPROJ, "--image", png, "--numerics", "ggml-cpu",
                     "--backend", backend, "--flash-attn", flash_attn, "--n-predict", "0",
                     "--embeddings-out", emb]) == 0
    ours = np.load(emb)[::stride]
    assert ours.shape == ref.shape and np.max(np.abs(ours - ref)) == 0


def test_cli_builds_the_tower_on_the_text_models_backend(tmp_path, monkeypatch, capsys):
    """`--backend numba --image`: every tower op is the numba backend's (its layer_norm, which only
    the tower calls, counted), the very backend object the text model computes with."""
    require("numba")
    from accel.numba import NumbaBackend
    rgb, ref, stride = case_image()
    png, emb = case_files(tmp_path, rgb)
    seen = []
    layer_norm = NumbaBackend.layer_norm
    monkeypatch.setattr(NumbaBackend, "layer_norm", lambda self, *a: seen.append(self) or layer_norm(self, *a))
    built = []
    text_model = factory.text_model
    monkeypatch.setattr(factory, "text_model", lambda *a: built.append(text_model(*a)) or built[-1])
    assert run_main(["--model", TEXT_MODEL, "--mmproj", MMPROJ, "--image", png, "--backend", "numba",
                     "--n-predict", "0", "--embeddings-out", emb, "--json"]) == 0
    capsys.readouterr()
    assert seen and all(be is built[0].backend for be in seen)
    ours = np.load(emb)[::stride]
    assert nmse(ref.ravel(), ours.ravel()) <= EXACT_GATE
