"""The declared backend (reference/backend.py Backend): every backend class implements every op a
model calls, with the declared parameters, and the models call no op outside the declaration; and
the one table of text trace names (reference/trace.py) is what the text forward traces.

The classes are inspected, never instantiated: the CuPy backend's class imports without CuPy or a
GPU, so the check runs in CI for all five.
"""
import ast
import inspect
import os

import pytest
from conftest import MODELS as TEST_MODELS

from accel.cupy import CupyBackend
from accel.numba import NumbaBackend
from accel.numba.ggml import GgmlCpuNumbaBackend
from reference import gguf
from reference.backend import OPS, Backend, NumpyBackend
from reference.ggml_cpu import GgmlCpuBackend
from reference.text import TextModel
from reference.tp import TensorParallelBackend
from reference.trace import TEXT_MODEL_POINTS, TEXT_POINTS, TraceError, Tracer, point

BACKENDS = [NumpyBackend, GgmlCpuBackend, GgmlCpuNumbaBackend, NumbaBackend, CupyBackend, TensorParallelBackend]
MODELS = ("text.py", "vision.py", "dflash.py")
REFERENCE = os.path.join(os.path.dirname(__file__), os.pardir, "reference")


def parameters(fn):  # -> the parameter names after self
    return list(inspect.signature(fn).parameters)[1:]


def case(backend, op):  # -> pytest param
    return pytest.param(backend, op, id=f"{backend.__name__}.{op}")


@pytest.mark.parametrize("backend, op", [case(backend, op) for backend in BACKENDS for op in OPS])
def test_backend_implements_the_declared_op(backend, op):
    fn = getattr(backend, op, None)
    assert callable(fn), f"{backend.__name__} lacks {op}"
    assert parameters(fn) == parameters(getattr(Backend, op)), f"{backend.__name__}.{op} parameters"


def backend_calls(source):  # -> {op names called as <x>.backend.<op>(...) or <name>.<op>(...) in a model file}
    """<name> is a local that holds a backend: a parameter `backend` or `be`, or a name assigned
    one (`be = self.backend`, `be = self.target.backend`, `b = be`)."""
    tree = ast.parse(source)
    holders = {"backend", "be"}
    assigned = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    while True:  # until no assignment adds a holder (b = be after be = self.backend)
        new = {t.id for n in assigned if is_backend(n.value, holders) for t in n.targets if isinstance(t, ast.Name)}
        if new <= holders:
            break
        holders |= new
    return {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and is_backend(node.func.value, holders)}


def is_backend(node, holders):  # -> whether the expression is `<x>.backend` or a name in `holders`
    return ((isinstance(node, ast.Attribute) and node.attr == "backend")
            or (isinstance(node, ast.Name) and node.id in holders))


def test_backend_calls_sees_every_spelling_of_a_backend():
    source = ("def forward(self, x, be):\n"
              "    self.backend.rms_norm(x, 1e-6)\n"
              "    self.target.backend.softcap(x, 30.0)\n"
              "    be.swiglu(x, x)\n"
              "    local = self.backend\n"
              "    alias = local\n"
              "    alias.gelu_erf(x)\n"
              "    ops.softmax(x)\n"
              "    self.linear(x, 'w')\n")
    assert backend_calls(source) == {"rms_norm", "softcap", "swiglu", "gelu_erf"}


def test_the_models_call_only_declared_ops_and_every_declared_op_is_called():
    called = set()
    for name in MODELS:
        with open(os.path.join(REFERENCE, name)) as f:
            called |= backend_calls(f.read())
    assert called <= set(OPS), f"called but not declared: {sorted(called - set(OPS))}"
    assert set(OPS) <= called, f"declared but no model calls: {sorted(set(OPS) - called)}"


def test_the_models_compute_nothing_through_ops_directly():
    """Only host-side bookkeeping (RoPE angles, masks, the window permutation and pixel shuffle,
    transformers' zero-padded position table of a video pair, which no engine's graph has; the draft
    sampler's softmax) may call reference.ops from a model; the math goes through the backend (the
    stills' position table too: ggml_interpolate rounds as the exact resize does not)."""
    allowed = {"rope_angles", "causal_visible", "window_permutation", "resize_bilinear_zeros",
               "pixel_shuffle_channel_outer", "softmax"}
    for name in MODELS:
        with open(os.path.join(REFERENCE, name)) as f:
            tree = ast.parse(f.read())
        direct = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id == "ops"}
        assert direct <= allowed, f"{name} computes {sorted(direct - allowed)} outside the backend"


def test_the_models_leave_the_numerics_mode_to_their_backend():
    """text.py, dflash.py, vision.py and video.py read no numerics mode and name no backend but the
    NumpyBackend default: what llama.cpp rounds differently (the F16 im2col, ggml_interpolate, clip's
    masked window attention) is the ggml-cpu backends' business, behind the declared ops."""
    for name in MODELS + ("video.py",):
        with open(os.path.join(REFERENCE, name)) as f:
            tree = ast.parse(f.read())
        modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names = ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                 | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not [m for m in modules if "ggml_cpu" in m], f"{name} imports the ggml-cpu package"
        assert not {"numerics", "GgmlCpuBackend", "GgmlCpuNumbaBackend"} & names, f"{name} reads a numerics mode"
        assert not {"ggml-cpu", "exact"} & strings, f"{name} compares a numerics mode"


def test_text_forward_traces_the_table_in_graph_order():
    """reference/text.py names its points from trace.TEXT_POINTS (accel/cupy/text.py too; tests/test_cuda.py
    checks its names against these): llama.cpp's order, the *_rope points on sliding-window layers only."""
    lm = TextModel(gguf.load(os.path.join(TEST_MODELS, "tiny-a-f32.gguf"), "text"))
    tracer = Tracer(keep_in_memory=True)
    lm.prefill([497, 5, 17], lm.new_cache(4), trace=tracer)
    per_layer = [point(op, il) for il, swa in enumerate(lm.cfg.swa_layers)
                 for op in TEXT_POINTS if swa or not op.endswith("_rope")]
    assert list(tracer.points) == ["embd_norm"] + per_layer + ["result_norm", "result_output"]
    assert [p for p in tracer.points if p not in per_layer] == list(TEXT_MODEL_POINTS)  # the table is what it traces
    with pytest.raises(TraceError, match="not a per-layer trace point"):
        point("attn_nrom", 0)
