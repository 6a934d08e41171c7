"""llama.cpp goldens for the ggml-cpu numerics mode: golden/ggml_cpu/.

    python -m tools.make_ggml_cpu_goldens --llama-bin LLAMA_CPP/build/bin \\
        --imatrix build/tiny/tiny-b.imatrix.gguf [--out golden/ggml_cpu]
    python -m tools.make_ggml_cpu_goldens --only-q8-0-kv [--out golden/ggml_cpu]
    python -m tools.make_ggml_cpu_goldens --only-mixed-kv [--out golden/ggml_cpu]

1. models/: the tiny-b types golden/models lacks, quantized from golden/models/tiny-b-f32.gguf with
   llama-quantize: Q4_0, Q5_K_M and IQ3_XXS (with the importance matrix).
2. logits/<type>/kv-<f16|f32>_fa-<off|on>.npy, float32 [18 + 8, n_vocab]: llama.cpp (llama-cpp-python
   0.3.36 through its C API, CPU, 2 threads, n_ctx 1024, n_batch = n_ubatch = 512) on the first 18
   ids of golden/prompts/text.jsonl "len33" in one llama_decode (the 18 prompt rows), then 8 greedy
   single-token decodes (one row each, after feeding generated token i). Types: f16, bf16, q8_0,
   q4_0, q4_k_m, q5_k_m, q6_k, iq2_xxs, iq3_xxs, iq4_xs; runs: F16 KV (llama.cpp's default) with
   flash attention off and on, and F32 KV with it off for the three new types (golden/logits/llama-cpp
   has F32 KV prefills of the others; flash attention casts an F32 cache to F16 anyway).
3. ops/<model>.npz: tensors from llama.cpp's graph callback (the ones llama-eval-callback prints, in
   full precision) of a 10-token prefill and one decode step with F16 KV: each op's inputs and
   output, so that a failing test names the op. Matmul outputs keep their first 32 columns.
   ops/geometry.npz: the same for head sizes the tiny models lack (synthetic f32 models from
   tools.make_synthetic, not kept): RoPE over 10 pairs (GCC leaves the last n mod 4 pairs
   uncontracted) and attention with head_dim 24 (kq_scale = 1.0f/sqrtf(24) in float32).
4. The q8_0 KV cache (llama.cpp requires flash attention for a quantized V cache):
   logits/tiny-a-<type>/kv-q8_0_fa-on.npy for tiny-a f32 and q8_0 (head_dim 32: blocks of 32, no
   Hadamard rotation) on the same prompt rows and decodes as 2., and ops/q8_0_kv.npz: layer-0
   attention of synthetic f32 models with head sizes 64 and 128, where llama.cpp rotates q, k, v and
   the output by Walsh-Hadamard transforms (K by 64 or 128, V by 64-element blocks).
   logits/synthetic-hd<64|128>/kv-q8_0_fa-on.npy: the same prompt rows and decodes as 2. on those
   two synthetic models, end to end through the rotation. The models are not kept: the manifest
   gives their TextDims fields, seed and sha256, and `synthetic_gguf` rebuilds them byte for byte.
   `--only-q8-0-kv` rewrites just these files and the manifest's "kv_q8_0" entry.
5. K and V caches of different types (-ctk and -ctv): logits/<model>/ctk-<K>_ctv-<V>_fa-<on|off>.npy
   on the prompt rows and decodes of 2.: tiny-a-f32 with F16 K and F32 V and the reverse, flash
   attention off (each product takes its own side's type; V stored transposed), and with a Q8_0 K
   and an F16 V and the reverse, flash attention on (the one-chunk kernel; tiny-a's head_dim 32 is
   not rotated), and a Q8_0 K with an F16 V, flash attention off (K.Q a Q8_0 mul_mat); the synthetic
   head_dim 64 model of 4. with the three Q8_0 pairs (only the quantized side rotated). `--only-mixed-kv` rewrites just these files and the manifest's
   "kv_mixed" entry.
manifest.json describes every file: model and sha256, engine and version, options, token ids,
generated tokens, date.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tools.common import KV_TYPES, LLAMA_CPP_COMMIT, REPO, sha256, today
from tools.synthetic import TextDims, write_text_gguf

MODELS = REPO / "golden" / "models"
NEW_TYPES = [("q4_0", "Q4_0", False), ("q5_k_m", "Q5_K_M", False), ("iq3_xxs", "IQ3_XXS", True)]
TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "iq2_xxs", "iq3_xxs", "iq4_xs"]
RUNS = [("f16", False), ("f16", True), ("f32", False)]
# F32 KV with flash attention off is already in golden/logits/llama-cpp (prefill) for these types
SHARED_F32_KV = ("f16", "bf16", "q8_0", "q4_k_m", "q6_k", "iq2_xxs", "iq4_xs")
N_PROMPT, N_DECODE, N_OPS_PROMPT = 18, 8, 10
N_THREADS, N_CTX, N_UBATCH = 2, 1024, 512
GEOMETRY_HEAD_DIMS = (20, 24)  # RoPE with 2 leftover pairs; a head size whose 1/sqrt is not exact
Q8_0_KV_TYPES = ("f32", "q8_0")  # tiny-a types run with a q8_0 cache
Q8_0_KV_HEAD_DIMS = (64, 128)  # rotated heads: K by H_64 / H_128, V by 64-blocks
# (K type, V type, flash attention): llama.cpp takes a quantized K without flash attention, a quantized V only with it
MIXED_KV = [("f16", "f32", False), ("f32", "f16", False), ("q8_0", "f16", True), ("f16", "q8_0", True),
            ("q8_0", "f16", False)]
MIXED_KV_ROTATED = [c for c in MIXED_KV if "q8_0" in c[:2]]  # on the synthetic head_dim 64 model: one side rotated
MATMUL_COLUMNS = 32  # columns of a matmul output kept in a fixture
WIDE_COLUMNS = 64    # columns of swiglu / softcap tensors kept in a fixture


class GgmlTensor(ctypes.Structure):  # struct ggml_tensor of ggml.h at 0c1e570
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


NUMPY_OF_GGML = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16


def tensor_values(t):  # GgmlTensor (host memory) -> float32 array of shape ne[::-1], or None
    if t.type not in NUMPY_OF_GGML:
        return None
    dtype = np.dtype(NUMPY_OF_GGML[t.type])
    shape, strides = list(t.ne)[::-1], list(t.nb)[::-1]
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
    buf = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype)
    return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=strides).astype(np.float32)


class Recorder:
    """The graph callback: every computed tensor of one llama_decode, in graph order."""

    def __init__(self, llama_cpp):
        self.nodes = []
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._seen)

    def _seen(self, tensor, ask, user_data):
        if ask:
            return True
        t = ctypes.cast(tensor, ctypes.POINTER(GgmlTensor)).contents
        self.nodes.append((t.name.decode(), tensor_values(t)))
        return True


def run_llama(model, ids, n_decode, kv_type, flash_attn, record=False, v_type=None):
    """kv_type: the K cache type, and V's unless v_type.
    -> (logits [len(ids) + n_decode, n_vocab], generated ids, [graph nodes of each llama_decode])"""
    import llama_cpp as lc

    silence = lc.llama_log_callback(lambda level, text, user_data: None)
    lc.llama_backend_init()
    lc.llama_log_set(silence, None)
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model_p = lc.llama_model_load_from_file(str(model).encode(), mparams)
    if not model_p:
        raise SystemExit(f"{model}: llama.cpp cannot load it")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = N_CTX, N_UBATCH, N_UBATCH
    cparams.n_threads = cparams.n_threads_batch = N_THREADS
    cparams.type_k, cparams.type_v = KV_TYPES[kv_type], KV_TYPES[v_type or kv_type]
    cparams.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
    recorder = Recorder(lc) if record else None
    if recorder:
        cparams.cb_eval = recorder.callback
    ctx = lc.llama_init_from_model(model_p, cparams)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model_p))
    graphs = []

    def decode(tokens, first_pos):  # one llama_decode, every row's logits
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, first_pos + i, 1, 1
            batch.seq_id[i][0] = 0
        if recorder:
            recorder.nodes = []
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"{model}: llama_decode failed")
        rows = [np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                for i in range(len(tokens))]
        lc.llama_batch_free(batch)
        if recorder:
            graphs.append(recorder.nodes)
        return rows

    rows = decode(list(ids), 0)
    generated = []
    for step in range(n_decode):
        generated.append(int(np.argmax(rows[-1])))
        rows += decode([generated[-1]], len(ids) + step)
    lc.llama_free(ctx)
    lc.llama_model_free(model_p)
    return np.array(rows, np.float32), generated, graphs


def engine_info():  # -> the manifest's engine fields
    import llama_cpp as lc
    return {"engine": "llama-cpp", "version": f"llama-cpp-python {lc.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
            "system_info": lc.llama_print_system_info().decode().strip(),
            "options": {"n_ctx": N_CTX, "n_batch": N_UBATCH, "n_ubatch": N_UBATCH, "n_threads": N_THREADS,
                        "backend": "cpu", "logits": "every row", "api": "llama_decode through llama_cpp's C API"}}


# ---------------------------------------------------------------------------------------------
# Per-op fixtures: which graph tensors feed and leave each emulated op

def named(nodes):  # [(name, values)] -> {name: values of the last node with that name}
    return {name: values for name, values in nodes if values is not None}


def node_after(nodes, name):  # the tensor computed right after the node called `name`
    names = [n for n, _ in nodes]
    return nodes[len(names) - 1 - names[::-1].index(name) + 1][1]


def rows2(x):  # graph tensor [1, 1, T, n] -> [T, n]
    return x.reshape(-1, x.shape[-1])


def matmul_fixture(nodes, prefix):  # -> {key: array} for blk.0.ffn_up and blk.0.attn_output
    t = named(nodes)
    return {f"{prefix}ffn_up.in": rows2(t["ffn_norm-0"]),
            f"{prefix}ffn_up.out": rows2(t["ffn_up-0"])[:, :MATMUL_COLUMNS],
            f"{prefix}attn_output.in": rows2(t["attn_gated-0"]),
            f"{prefix}attn_output.out": rows2(t["attn_o_proj-0"])[:, :MATMUL_COLUMNS]}


def attention_fixture(graphs, suffix):  # prefill + decode of layer 0: q/k/v in, attn_out out
    out = {}
    for step, nodes in zip(("prefill", "decode"), graphs):
        t = named(nodes)
        out[f"{step}.q"] = t["Qcur_rope-0"].reshape(t["Qcur_rope-0"].shape[-3:])
        out[f"{step}.k"] = t["Kcur_rope-0"].reshape(t["Kcur_rope-0"].shape[-3:])
        out[f"{step}.v"] = t["Vcur-0"].reshape(-1, *t["Kcur_rope-0"].shape[-2:])
        out[f"{step}.attn_out.{suffix}"] = rows2(t["attn_out-0"])
    return out


def float_op_fixture(nodes):  # prefill tensors of the element-wise ops (f32 model, F16 KV, no flash)
    t = named(nodes)
    return {
        "rms_norm.in": rows2(t["embd"]), "rms_norm.out": rows2(t["embd_norm"])[:, :WIDE_COLUMNS],
        "post_norm.in": rows2(t["attn_o_proj-0"]),
        "post_norm.out": rows2(node_after(nodes, "attn_o_proj-0"))[:, :WIDE_COLUMNS],
        "rope.in": t["Qcur_normed-0"].reshape(t["Qcur_normed-0"].shape[-3:]),
        "rope.out": t["Qcur_rope-0"].reshape(t["Qcur_rope-0"].shape[-3:]),
        "soft_max.in": t["kq-0"][0, :, :, :16], "soft_max.out": t["kq_soft_max-0"][0, :, :, :16],
        "sigmoid.in": rows2(t["attn_gate_proj-0"]), "sigmoid.out": rows2(t["attn_gate_sig-0"]),
        "swiglu.gate": rows2(t["ffn_gate-0"])[:, :WIDE_COLUMNS], "swiglu.up": rows2(t["ffn_up-0"])[:, :WIDE_COLUMNS],
        "swiglu.out": rows2(t["ffn_swiglu-0"])[:, :WIDE_COLUMNS],
        # result_norm -> lm_head MUL_MAT -> SCALE(logit_scale) -> SCALE(1/cap) -> tanh -> SCALE(cap)
        "logit_scale.in": rows2(node_after(nodes, "result_norm"))[:, :WIDE_COLUMNS],
        "softcap.in": rows2(nodes[[n for n, _ in nodes].index("result_norm") + 2][1])[:, :WIDE_COLUMNS],
        "softcap.out": rows2(t["result_output"])[:, :WIDE_COLUMNS],
    }


# ---------------------------------------------------------------------------------------------

def quantize(llama_bin, imatrix, out_dir):  # -> {type: {"path", "quantize"}} of the new GGUFs
    """llama-quantize runs inside the imatrix's directory with that file's bare name: the quantizer
    copies the imatrix path into the GGUF metadata, which must not name this machine's folders."""
    made = {}
    for suffix, qtype, needs_imatrix in NEW_TYPES:
        dst = (out_dir / f"tiny-b-{suffix}.gguf").resolve()
        shown = ["llama-quantize"] + (["--imatrix", imatrix.name] if needs_imatrix else []) \
            + ["tiny-b-f32.gguf", dst.name, qtype, "2"]
        cmd = [str((llama_bin / "llama-quantize").resolve())] + shown[1:-4] \
            + [str(MODELS / "tiny-b-f32.gguf"), str(dst), qtype, "2"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=imatrix.resolve().parent)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize {qtype} failed: {done.stderr.strip().splitlines()[-1:]}")
        made[suffix] = {"path": dst, "quantize": shown}
    return made


def model_path(kind, out):  # tiny-b type -> its GGUF (shared golden/models or this directory's models/)
    shared = MODELS / f"tiny-b-{kind}.gguf"
    return shared if shared.exists() else out / "models" / f"tiny-b-{kind}.gguf"


def relative(path, root):  # -> path relative to root (golden/ for the default --out), as the manifest names it
    return os.path.relpath(Path(path).resolve(), Path(root).resolve())


def config_name(kv_type, flash_attn):  # "f16", True -> "kv-f16_fa-on"
    return f"kv-{kv_type}_fa-{'on' if flash_attn else 'off'}"


def write_logits(out, ids):  # -> manifest runs; logits/<type>/<config>.npy
    runs = []
    for kind in TYPES:
        model = model_path(kind, out)
        for kv_type, flash_attn in RUNS:
            if kv_type == "f32" and kind in SHARED_F32_KV:
                continue
            logits, generated, _ = run_llama(model, ids, N_DECODE, kv_type, flash_attn)
            name = f"logits/{kind}/{config_name(kv_type, flash_attn)}.npy"
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            np.save(out / name, logits, allow_pickle=False)
            runs.append({"type": kind, "model": relative(model, out.parent), "sha256": sha256(model),
                         "kv_type": kv_type, "flash_attn": flash_attn, "file": name, "generated": generated})
            print(f"{name}: {logits.shape}, generated {generated}", flush=True)
    return runs


def write_ops(out, ids):  # -> manifest entries; ops/<type>.npz
    files = []
    (out / "ops").mkdir(exist_ok=True)
    for kind in ["f32"] + TYPES:
        model = model_path(kind, out)
        _, generated, graphs = run_llama(model, ids, 1, "f16", False, record=True)
        arrays = {**matmul_fixture(graphs[0], ""), **matmul_fixture(graphs[1], "decode.")}
        if kind == "f32":
            arrays.update(float_op_fixture(graphs[0]))
            arrays.update(attention_fixture(graphs, config_name("f16", False)))
            for kv_type, flash_attn in (("f16", True), ("f32", False)):
                _, _, other = run_llama(model, ids, 1, kv_type, flash_attn, record=True)
                attention = attention_fixture(other, config_name(kv_type, flash_attn))
                arrays.update({k: v for k, v in attention.items() if ".attn_out." in k})
        name = f"ops/{kind}.npz"
        np.savez(out / name, **arrays)
        files.append({"type": kind, "model": relative(model, out.parent), "sha256": sha256(model),
                      "file": name, "generated": generated, "keys": sorted(arrays)})
        print(f"{name}: {len(arrays)} tensors", flush=True)
    return files


GEOMETRY_DIMS = dict(n_layer=2, n_embd=256, n_ff=256, n_head=4, n_head_kv=1, n_vocab=512, n_swa=8)
GEOMETRY_SEED = 0


def synthetic_gguf(path, fields, seed):  # {TextDims field: value}, seed -> TextDims of the f32 GGUF written to path
    """The synthetic models llama.cpp runs here; tests rebuild them from the manifest's fields and seed
    (the writer is deterministic: same fields and seed, same bytes)."""
    return write_text_gguf(path, TextDims(**fields), seed=seed)


def geometry_fields(head_dim):  # -> {TextDims field: value} of the synthetic model with that head size
    return {**GEOMETRY_DIMS, "head_dim": head_dim}


def geometry_model(path, head_dim):  # -> TextDims of a synthetic f32 GGUF written to path
    return synthetic_gguf(path, geometry_fields(head_dim), GEOMETRY_SEED)


def geometry_entry(dims):  # TextDims -> the manifest's description of a synthetic geometry model
    made = ", ".join(f"{k}={v}" for k, v in geometry_fields(dims.head_dim).items())
    return {"head_dim": dims.head_dim, "rope_base": dims.rope_base, "n_swa": dims.n_swa,
            "made": f"tools.make_synthetic TextDims({made}), seed {GEOMETRY_SEED}"}


def write_rotated_logits(out, ids, path, head_dim):  # -> manifest run; logits/synthetic-hd<D>/kv-q8_0_fa-on.npy
    logits, generated, _ = run_llama(path, ids, N_DECODE, "q8_0", True)
    name = f"logits/synthetic-hd{head_dim}/{config_name('q8_0', True)}.npy"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    np.save(out / name, logits, allow_pickle=False)
    print(f"{name}: {logits.shape}, generated {generated}", flush=True)
    return {"type": f"synthetic-hd{head_dim}", "head_dim": head_dim, "fields": geometry_fields(head_dim),
            "seed": GEOMETRY_SEED, "made": "tools.make_ggml_cpu_goldens.synthetic_gguf(fields, seed) (f32)",
            "sha256": sha256(path), "kv_type": "q8_0", "flash_attn": True, "file": name, "generated": generated}


def write_q8_0_kv(out, ids, ops_ids):  # -> manifest "kv_q8_0"; logits/{tiny-a,synthetic}-*/, ops/q8_0_kv.npz
    runs, rotated_runs = [], []
    for kind in Q8_0_KV_TYPES:
        model = MODELS / f"tiny-a-{kind}.gguf"
        logits, generated, _ = run_llama(model, ids, N_DECODE, "q8_0", True)
        name = f"logits/tiny-a-{kind}/{config_name('q8_0', True)}.npy"
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        np.save(out / name, logits, allow_pickle=False)
        runs.append({"type": kind, "model": relative(model, out.parent), "sha256": sha256(model),
                     "kv_type": "q8_0", "flash_attn": True, "file": name, "generated": generated})
        print(f"{name}: {logits.shape}, generated {generated}", flush=True)
    arrays, models = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for head_dim in Q8_0_KV_HEAD_DIMS:
            path = Path(tmp) / f"hd{head_dim}.gguf"
            models[f"hd{head_dim}"] = geometry_entry(geometry_model(path, head_dim))
            rotated_runs.append(write_rotated_logits(out, ids, path, head_dim))
            _, _, graphs = run_llama(path, ops_ids, 1, "q8_0", True, record=True)
            found = attention_fixture(graphs, config_name("q8_0", True))
            arrays.update({f"hd{head_dim}.{k}": v for k, v in found.items()})
    (out / "ops").mkdir(exist_ok=True)
    np.savez_compressed(out / "ops" / "q8_0_kv.npz", **arrays)  # keeps golden/ggml_cpu/ small
    print(f"ops/q8_0_kv.npz: {len(arrays)} tensors", flush=True)
    return {"date": today(), "runs": runs, "rotated_runs": rotated_runs,
            "ops": {"token_ids": ops_ids, "file": "ops/q8_0_kv.npz", "models": models, "keys": sorted(arrays)}}


def mixed_config_name(k_type, v_type, flash_attn):  # "q8_0", "f16", True -> "ctk-q8_0_ctv-f16_fa-on"
    return f"ctk-{k_type}_ctv-{v_type}_fa-{'on' if flash_attn else 'off'}"


def write_mixed_kv(out, ids):  # -> manifest "kv_mixed"; logits/{tiny-a-f32,synthetic-hd64}/ctk-*_ctv-*_fa-*.npy
    runs = []

    def write(path, kind, k_type, v_type, flash_attn, **fields):
        logits, generated, _ = run_llama(path, ids, N_DECODE, k_type, flash_attn, v_type=v_type)
        name = f"logits/{kind}/{mixed_config_name(k_type, v_type, flash_attn)}.npy"
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        np.save(out / name, logits, allow_pickle=False)
        runs.append({"type": kind, **fields, "sha256": sha256(path), "cache_type_k": k_type, "cache_type_v": v_type,
                     "flash_attn": flash_attn, "file": name, "generated": generated})
        print(f"{name}: {logits.shape}, generated {generated}", flush=True)

    model = MODELS / "tiny-a-f32.gguf"
    for k_type, v_type, flash_attn in MIXED_KV:
        write(model, "tiny-a-f32", k_type, v_type, flash_attn, model=relative(model, out.parent))
    with tempfile.TemporaryDirectory() as tmp:
        head_dim = Q8_0_KV_HEAD_DIMS[0]
        path = Path(tmp) / f"hd{head_dim}.gguf"
        geometry_model(path, head_dim)
        for k_type, v_type, flash_attn in MIXED_KV_ROTATED:
            write(path, f"synthetic-hd{head_dim}", k_type, v_type, flash_attn, head_dim=head_dim,
                  fields=geometry_fields(head_dim), seed=GEOMETRY_SEED,
                  made="tools.make_ggml_cpu_goldens.synthetic_gguf(fields, seed) (f32)")
    return {"date": today(), "runs": runs}


def write_geometry_ops(out, ids):  # -> manifest entry; ops/geometry.npz
    arrays, models = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for head_dim in GEOMETRY_HEAD_DIMS:
            path = Path(tmp) / f"hd{head_dim}.gguf"
            dims = geometry_model(path, head_dim)
            models[f"hd{head_dim}"] = geometry_entry(dims)
            for kv_type, flash_attn in RUNS:
                _, _, graphs = run_llama(path, ids, 1, kv_type, flash_attn, record=True)
                config = config_name(kv_type, flash_attn)
                found = attention_fixture(graphs, config)
                if kv_type == "f16" and not flash_attn:
                    t = named(graphs[0])
                    found["rope.in"] = t["Qcur_normed-0"].reshape(t["Qcur_normed-0"].shape[-3:])
                    found["rope.out"] = t["Qcur_rope-0"].reshape(t["Qcur_rope-0"].shape[-3:])
                else:
                    found = {k: v for k, v in found.items() if ".attn_out." in k}
                arrays.update({f"hd{head_dim}.{k}": v for k, v in found.items()})
    np.savez(out / "ops" / "geometry.npz", **arrays)
    print(f"ops/geometry.npz: {len(arrays)} tensors", flush=True)
    return {"type": "geometry", "file": "ops/geometry.npz", "models": models, "keys": sorted(arrays)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, help="directory with llama-quantize")
    ap.add_argument("--imatrix", type=Path, help="tiny-b importance matrix (for IQ3_XXS)")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "ggml_cpu")
    ap.add_argument("--only-q8-0-kv", action="store_true", help="rewrite only the q8_0 KV cache goldens")
    ap.add_argument("--only-mixed-kv", action="store_true", help="rewrite only the goldens of K and V types that differ")
    args = ap.parse_args(argv)

    prompts = (REPO / "golden" / "prompts" / "text.jsonl").read_text(encoding="utf-8").splitlines()
    base = next(p["token_ids"] for p in map(json.loads, filter(None, prompts)) if p["id"] == "len33")
    if args.only_q8_0_kv or args.only_mixed_kv:
        manifest = json.loads((args.out / "manifest.json").read_text(encoding="utf-8"))
        if args.only_q8_0_kv:
            manifest["kv_q8_0"] = write_q8_0_kv(args.out, base[:N_PROMPT], base[:N_OPS_PROMPT])
        if args.only_mixed_kv:
            manifest["kv_mixed"] = write_mixed_kv(args.out, base[:N_PROMPT])
        (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        return 0
    if not (args.llama_bin and args.imatrix):
        ap.error("--llama-bin and --imatrix are needed to rewrite the whole directory")
    (args.out / "models").mkdir(parents=True, exist_ok=True)
    quantized = quantize(args.llama_bin, args.imatrix, args.out / "models")
    manifest = {**engine_info(), "date": today(),
                "prompt": {"source": "golden/prompts/text.jsonl len33", "token_ids": base[:N_PROMPT]},
                "logits": f"float32 [{N_PROMPT} prompt rows of one llama_decode + {N_DECODE} decode rows, n_vocab]",
                "models": [{"file": relative(q["path"], args.out.parent), "sha256": sha256(q["path"]),
                            "made": q["quantize"], "source": "golden/models/tiny-b-f32.gguf"}
                           for q in quantized.values()],
                "runs": write_logits(args.out, base[:N_PROMPT]),
                "ops": {"token_ids": base[:N_OPS_PROMPT], "files": write_ops(args.out, base[:N_OPS_PROMPT]),
                        "geometry": write_geometry_ops(args.out, base[:N_OPS_PROMPT])},
                "kv_q8_0": write_q8_0_kv(args.out, base[:N_PROMPT], base[:N_OPS_PROMPT]),
                "kv_mixed": write_mixed_kv(args.out, base[:N_PROMPT])}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
