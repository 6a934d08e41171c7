"""llama.cpp's own CPU product of IQ1_S, IQ1_M, IQ2_XS and IQ3_S weights whose rows hold several
blocks: golden/ggml_cpu/kernels/.

    python -m tools.make_iq_kernel_goldens [--out golden/ggml_cpu/kernels]

The preset models (golden/presets) are 256 wide, one block per row, so their logits cannot tell how
a kernel carries its accumulators from block to block. Here the blocks of every tensor of the type in
its preset model tiny-b-<type>.gguf are regrouped 4 to a row (K = 1024) and multiplied by llama-cpp-python
0.3.36's libggml-cpu (ggml_mul_mat in a plain ggml context, ggml_graph_compute_with_ctx, 2 threads:
no repacked or AMX buffer) with the first 1, 3, 8 and 10 rows of one activation matrix: the vec_dot
below 8 rows, the tiled kernel from 8.

kernels.npz: x f32 [10, 1024]; <type>.out<T> f32 [T, O] (O: the type's rows of blocks, `regrouped`).
manifest.json: the source models and their sha256, engine, version, options, date.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from reference import gguf
from reference.cli import OneLineParser, UsageError, exit_status
from reference.ggml_cpu import DECODERS

from tools import common
from tools.regen.make_ggml_cpu_goldens import GgmlTensor
from tools.common import REPO

PRESET_MODELS = REPO / "golden" / "presets" / "models"
TYPES = ("IQ1_S", "IQ1_M", "IQ2_XS", "IQ3_S")
ROW_BLOCKS, ROWS, N_THREADS = 4, (1, 3, 8, 10), 2


class InitParams(ctypes.Structure):  # ggml.h struct ggml_init_params
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


P, I64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = [  # (library, function, restype, argtypes) of ggml.h and ggml-cpu.h
    ("base", "ggml_init", P, [InitParams]), ("base", "ggml_new_tensor_2d", P, [P, ctypes.c_int, I64, I64]),
    ("base", "ggml_mul_mat", P, [P, P, P]), ("base", "ggml_new_graph", P, [P]),
    ("base", "ggml_build_forward_expand", None, [P, P]), ("base", "ggml_free", None, [P]),
    ("cpu", "ggml_graph_compute_with_ctx", ctypes.c_int, [P, P, ctypes.c_int])]


def ggml_libs():  # -> (libggml-base, libggml-cpu) of llama-cpp-python, the calls used here typed
    try:
        import llama_cpp
    except ImportError:
        raise UsageError("needs llama-cpp-python 0.3.36 (its libggml-cpu computes the goldens)") from None
    where = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base, cpu = (ctypes.CDLL(os.path.join(where, f)) for f in ("libggml-base.so", "libggml-cpu.so"))
    for lib, name, restype, argtypes in SIGNATURES:
        function = getattr(base if lib == "base" else cpu, name)
        function.restype, function.argtypes = restype, argtypes
    cpu.ggml_cpu_init()
    return base, cpu


def tensor_data(tensor):  # ggml_tensor * -> its data pointer
    return ctypes.cast(tensor, ctypes.POINTER(GgmlTensor)).contents.data


def ggml_mul_mat(type_id, blocks, x):  # uint8 [O, row bytes], f32 [T, K] -> f32 [T, O]: llama.cpp's CPU product
    base, cpu = ggml_libs()
    ctx = base.ggml_init(InitParams(64 << 20, None, False))
    try:
        w = base.ggml_new_tensor_2d(ctx, type_id, x.shape[1], len(blocks))
        a = base.ggml_new_tensor_2d(ctx, GGMLQuantizationType.F32.value, x.shape[1], len(x))
        for tensor, values in ((w, np.ascontiguousarray(blocks)), (a, np.ascontiguousarray(x, np.float32))):
            ctypes.memmove(tensor_data(tensor), values.ctypes.data, values.nbytes)
        out = base.ggml_mul_mat(ctx, w, a)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        if cpu.ggml_graph_compute_with_ctx(ctx, graph, N_THREADS) != 0:
            raise UsageError("ggml_graph_compute_with_ctx failed")
        result = np.empty((len(x), len(blocks)), np.float32)
        ctypes.memmove(result.ctypes.data, tensor_data(out), result.nbytes)
        return result
    finally:
        base.ggml_free(ctx)


def activations(width):  # -> f32 [10, width]: standard normal, row 1's later blocks 1000x smaller, one zero block
    x = np.random.default_rng(0).standard_normal((max(ROWS), width)).astype(np.float32)
    x[1, 256:] *= np.float32(1e-3)
    x[2, 256:512] = 0
    return x


def regrouped(model, kind, row_blocks=ROW_BLOCKS):  # -> uint8 [rows * nb / row_blocks, row_blocks * block bytes]
    """Every tensor of type `kind` in the model, in name order, its blocks row_blocks to a row."""
    weights = gguf.load(model, "text").weights
    names = sorted(n for n in weights.tensors if weights.type_name(n) == kind)
    if not names:
        raise UsageError(f"{model.name}: no {kind} tensor")
    blocks = np.concatenate([np.asarray(weights.raw(n)).view(np.uint8).reshape(-1, DECODERS[kind][0]) for n in names])
    return blocks.reshape(-1, row_blocks * DECODERS[kind][0])


def make(out: Path) -> None:  # kernels.npz and manifest.json written to out
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    x, models = activations(256 * ROW_BLOCKS), {}
    arrays = {"x": x}
    for kind in tqdm(TYPES, desc="types", unit="type"):
        model = PRESET_MODELS / f"tiny-b-{kind.lower()}.gguf"
        blocks = regrouped(model, kind)
        for rows in ROWS:
            arrays[f"{kind}.out{rows}"] = ggml_mul_mat(GGMLQuantizationType[kind].value, blocks, x[:rows])
        models[kind] = {"file": f"presets/models/{model.name}", "sha256": common.sha256(model)}
    np.savez(out / "kernels.npz", **arrays)
    common.save_json(out / "manifest.json", manifest(models))


def manifest(models):  # {type: model file and sha256} -> the manifest of kernels.npz
    version = f"llama.cpp {common.LLAMA_CPP_COMMIT} (llama-cpp-python 0.3.36 libggml-cpu)"
    return {"engine": "llama.cpp", "version": version,
            "date": common.today(), "file": "kernels.npz", "models": models,
            "weights": "every tensor of the type, in name order", "row_blocks": ROW_BLOCKS, "rows": list(ROWS),
            "options": {"call": "ggml_mul_mat, ggml_graph_compute_with_ctx", "threads": N_THREADS,
                        "buffers": "plain ggml context (no repack, no AMX)"},
            "activations": "numpy default_rng(0) standard normal [10, 1024]; row 1 columns 256: times 1e-3, "
                           "row 2 columns 256:512 zero"}


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m tools.make_iq_kernel_goldens", description=__doc__)
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "ggml_cpu" / "kernels")
    args = ap.parse_args(argv)
    return exit_status("make_iq_kernel_goldens", lambda: make(args.out) or 0, (gguf.GGUFError,))


if __name__ == "__main__":
    raise SystemExit(main())
