"""The ggml-cpu numerics mode against llama.cpp's own outputs (llama-cpp-python 0.3.36, llama.cpp
0c1e570, CPU, 2 threads; golden/ggml_cpu/manifest.json and golden/logits/llama-cpp).

Every assertion is bit-for-bit: the mode performs llama.cpp's float32 operations in llama.cpp's
order, so the only right answer is the identical float (docs/ggml-cpu-numerics.md: one ULP anywhere
flips an int8 activation rounding and spreads to ~1e-4). Failures report NMSE
(sum((ref-x)^2)/sum(ref^2)), max |diff| and top-1 agreement. The per-op tests feed llama.cpp's own
input tensors to one emulated op, so a failure names the op.
"""
import functools
import hashlib
import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDEN, run_cli
from reference import ggml_cpu, gguf, ops
from reference.ggml_cpu import UBATCH, GgmlCpuBackend, GgmlCpuError
from reference.ggml_cpu.mul_mat import decoded_bytes
from reference.text import TextModel
from tools.common import sha256
from tools.regen.make_ggml_cpu_goldens import synthetic_gguf
from reference.metrics import max_abs_diff, nmse, top1_agreement

HERE = os.path.join(GOLDEN, "ggml_cpu")
MANIFEST = json.loads(Path(HERE, "manifest.json").read_text(encoding="utf-8"))
OPS = MANIFEST["ops"]


@functools.lru_cache(maxsize=None)
def model(rel):  # path under golden/ -> GGUFModel (loaded once per test run)
    return gguf.load(os.path.join(GOLDEN, rel), "text")


def ggml_logits(text_model, ids, fed, kv_type, flash_attn, backend=GgmlCpuBackend, v_type=None):  # -> [len(ids) + len(fed), V]
    lm = TextModel(text_model, backend=backend(kv_type, flash_attn, check_host=False, v_type=v_type))
    cache = lm.new_cache(len(ids) + len(fed), "uniform")
    rows = [lm.prefill(ids, cache, UBATCH)] + [lm.prefill([t], cache, UBATCH) for t in fed]
    return np.concatenate(rows)


def assert_identical(ref, got, what):  # bit-identical logits, with the figures when they are not
    if np.array_equal(ref, got):
        return
    raise AssertionError(f"{what}: NMSE {float(np.max(nmse(ref, got))):.3g}, max |diff| "
                         f"{float(np.max(max_abs_diff(ref, got))):.3g}, top-1 "
                         f"{float(np.mean(top1_agreement(ref, got))):.3f} (expected bit-identical)")


def check_run(run, text_model, backend=GgmlCpuBackend):  # a manifest run: its prompt and decode rows
    ref = np.load(os.path.join(HERE, run["file"]), allow_pickle=False)
    ids, fed = MANIFEST["prompt"]["token_ids"], run["generated"]
    # a run of one cache type names it kv_type; one of two types, cache_type_k and cache_type_v
    got = ggml_logits(text_model, ids, fed, run.get("kv_type") or run["cache_type_k"], run["flash_attn"], backend,
                      run.get("cache_type_v"))
    assert_identical(ref[:len(ids)], got[:len(ids)], f"{run['file']} prefill")
    assert_identical(ref[len(ids):], got[len(ids):], f"{run['file']} decode")


# ---------------------------------------------------------------------------------------------
# Logits: every type, F16 and F32 KV, flash attention off and on, prefill and decode


@pytest.mark.parametrize("run", MANIFEST["runs"], ids=lambda r: r["file"][len("logits/"):-len(".npy")])
def test_logits_bit_identical(run):
    check_run(run, model(run["model"]))


@pytest.mark.parametrize("run", MANIFEST["kv_q8_0"]["runs"], ids=lambda r: r["file"][len("logits/"):-len(".npy")])
def test_q8_0_kv_logits_bit_identical(run):  # tiny-a (head_dim 32: Q8_0 rows, no Hadamard rotation)
    check_run(run, model(run["model"]))


@pytest.mark.parametrize("run", MANIFEST["kv_q8_0"]["rotated_runs"], ids=lambda r: r["type"])
def test_q8_0_kv_rotated_logits_bit_identical(run, tmp_path):  # head sizes 64, 128: q, k, v and output rotated
    """The synthetic models are not committed: rebuilt from the manifest's fields and seed, they must be
    the very file llama.cpp ran before their logits mean anything."""
    check_rotated(run, tmp_path)


def check_rotated(run, tmp_path, backend=GgmlCpuBackend):  # a synthetic model rebuilt, then its run
    check_run(run, rebuilt_model(run, tmp_path), backend)


def rebuilt_model(run, tmp_path):  # a manifest run on a synthetic model -> its GGUFModel, rebuilt
    path = tmp_path / f"{run['type']}.gguf"
    synthetic_gguf(path, run["fields"], run["seed"])
    assert sha256(path) == run["sha256"], \
        f"{run['type']}: the rebuilt GGUF is not the one llama.cpp ran (tools.make_synthetic or gguf-py changed)"
    return gguf.load(str(path), "text")


def mixed_run_id(run):  # -> "tiny-a-f32/ctk-f16_ctv-f32_fa-off"
    return run["file"][len("logits/"):-len(".npy")]


@pytest.mark.parametrize("run", MANIFEST["kv_mixed"]["runs"], ids=mixed_run_id)
def test_mixed_kv_logits_bit_identical(run, tmp_path):
    """-ctk and -ctv apart: flash attention off, K.Q in K's type and V^T.P in V's; on, an F32 side cast
    to F16, a Q8_0 side quantized (and rotated where the head size is 64) alone, the one-chunk kernel."""
    check_run(run, model(run["model"]) if "model" in run else rebuilt_model(run, tmp_path))


SHARED = [  # (model, run directory, prompt id): goldens of golden/logits/llama-cpp, same engine and options
    *[(f"tiny-b-{t}", "kv-f32_fa-off", "len33")
      for t in ("f16", "bf16", "q8_0", "q4_k_m", "q6_k", "iq2_xxs", "iq4_xs")],
    ("tiny-b-f32", "kv-f16_fa-on", "len64-nobos"),  # 64 rows: the tiled flash-attention kernel
    ("tiny-b-f32", "kv-f16_fa-off", "len64-nobos"),
    ("tiny-a-iq2_xxs", "kv-f32_fa-off", "len33"),  # held-out geometry (head_dim 32); Q2_K repacked
]


@pytest.mark.parametrize("name,run,prompt", SHARED, ids=[f"{m}-{r}-{p}" for m, r, p in SHARED])
def test_shared_llama_cpp_goldens(name, run, prompt):
    check_shared(name, run, prompt)


def check_shared(name, run, prompt, backend=GgmlCpuBackend):  # one golden of golden/logits/llama-cpp
    folder = os.path.join(GOLDEN, "logits", "llama-cpp", name, run)
    manifest = json.loads(Path(folder, "manifest.json").read_text(encoding="utf-8"))
    entry = next(e for e in manifest["entries"] if e["id"] == prompt)
    options = manifest["options"]
    assert (options["n_ubatch"], options["n_threads"], options["backend"]) == (512, 2, "cpu")
    ref = np.load(os.path.join(folder, entry["file"]), allow_pickle=False)
    got = ggml_logits(model(f"models/{name}.gguf"), entry["token_ids"], [], options["kv_type"],
                      options["flash_attn"] == "on", backend)
    assert_identical(ref, got, f"{name}/{run}/{prompt}")


def test_f32_kv_decode_steps():  # greedy decode of the shared F32-KV f32 golden, token by token
    folder = os.path.join(GOLDEN, "logits", "llama-cpp", "tiny-b-f32", "kv-f32_fa-off")
    entries = json.loads(Path(folder, "manifest.json").read_text(encoding="utf-8"))["entries"]
    entry = next(e for e in entries if e["id"] == "len7")
    ref = np.load(os.path.join(folder, entry["greedy"]["decode_logits"]), allow_pickle=False)[:8]
    fed = entry["greedy"]["tokens"][:8]
    got = ggml_logits(model("models/tiny-b-f32.gguf"), entry["token_ids"], fed, "f32", False)
    assert_identical(ref, got[len(entry["token_ids"]):], "tiny-b-f32 F32 KV decode")


# ---------------------------------------------------------------------------------------------
# One op at a time, on llama.cpp's intermediate tensors (eval callback, layer 0 of a 10-token prompt)


@functools.lru_cache(maxsize=None)
def fixture(kind):  # -> (manifest entry, {name: array}) of golden/ggml_cpu/ops/<kind>.npz
    entry = next(f for f in OPS["files"] if f["type"] == kind)
    with np.load(os.path.join(HERE, entry["file"]), allow_pickle=False) as data:
        return entry, {k: data[k] for k in data.files}


@pytest.mark.parametrize("kind", [f["type"] for f in OPS["files"]])
@pytest.mark.parametrize("step", ["", "decode."])


@pytest.mark.parametrize("weight", ["ffn_up", "attn_output"])
def test_op_mul_mat(kind, step, weight):  # the matmul kernel of each weight type and batch shape
    entry, t = fixture(kind)
    x, ref = t[f"{step}{weight}.in"], t[f"{step}{weight}.out"]
    weights = model(entry["model"]).weights
    got = ggml_cpu.mul_mat(x, weights, f"blk.0.{weight}.weight", {})[:, :ref.shape[1]]
    assert_identical(ref, got, f"mul_mat {weights.type_name(f'blk.0.{weight}.weight')} with {len(x)} rows")


def f32_fixture():  # -> (config of the f32 model, its fixture tensors)
    entry, t = fixture("f32")
    return model(entry["model"]).config, t


def kq_scale(head_dim):  # the muse graph's 1.0f/sqrtf(float(n_embd_head)), in float32
    return np.float32(1) / np.sqrt(np.float32(head_dim))


def test_op_rms_norm():
    cfg, t = f32_fixture()
    assert_identical(t["rms_norm.out"], ggml_cpu.rms_norm(t["rms_norm.in"], cfg.rms_eps)[:, :64], "rms_norm")
    post = ggml_cpu.rms_norm(t["post_norm.in"], cfg.post_norm_eps)[:, :64]
    assert_identical(t["post_norm.out"], post, "rms_norm (post-norm eps 1e-8)")


def test_op_rope():
    cfg, t = f32_fixture()
    theta = ops.rope_angles(np.arange(len(t["rope.in"])), cfg.n_rot, cfg.rope_base_swa, np.float32)
    assert_identical(t["rope.out"], ggml_cpu.rope_norm(t["rope.in"], theta), "rope_norm")


def test_op_soft_max():  # layer 0 slides an 8-token window; the 16 cells kept hold every live one
    cfg, t = f32_fixture()
    kq = t["soft_max.in"]  # [H, T, 16]
    visible = ops.causal_visible(np.arange(kq.shape[1]), np.arange(kq.shape[2]), cfg.n_swa)
    got = ggml_cpu.soft_max(kq.reshape(-1, kq.shape[2]), np.tile(visible, (len(kq), 1)), kq_scale(cfg.head_dim))
    assert_identical(t["soft_max.out"], got.reshape(kq.shape), "soft_max_ext")


def test_op_sigmoid_swiglu_softcap():
    cfg, t = f32_fixture()
    assert_identical(t["sigmoid.out"], ggml_cpu.sigmoid(t["sigmoid.in"]), "sigmoid")
    assert_identical(t["swiglu.out"], ggml_cpu.swiglu(t["swiglu.gate"], t["swiglu.up"]), "swiglu")
    assert_identical(t["softcap.in"], t["logit_scale.in"] * np.float32(cfg.logit_scale), "logit scale")
    assert_identical(t["softcap.out"], ggml_cpu.softcap(t["softcap.in"], cfg.softcap), "softcap")


CONFIGS = ["kv-f16_fa-off", "kv-f32_fa-off", "kv-f16_fa-on"]


def check_attention(t, prefix, config, head_dim, n_swa):  # layer 0, a sliding-window layer: prefill and decode
    backend = GgmlCpuBackend(config[len("kv-"):config.index("_fa-")], config.endswith("on"), check_host=False)
    scale = kq_scale(head_dim)
    n = len(t[f"{prefix}prefill.q"])
    prefill = backend.attention(t[f"{prefix}prefill.q"], t[f"{prefix}prefill.k"], t[f"{prefix}prefill.v"],
                                ops.causal_visible(np.arange(n), np.arange(n), n_swa), scale)
    assert_identical(t[f"{prefix}prefill.attn_out.{config}"], prefill.reshape(n, -1), f"attention {config}, {n} rows")
    k, v = (np.concatenate([t[f"{prefix}prefill.{p}"], t[f"{prefix}decode.{p}"]]) for p in "kv")
    decode = backend.attention(t[f"{prefix}decode.q"], k, v, ops.causal_visible([n], np.arange(n + 1), n_swa), scale)
    assert_identical(t[f"{prefix}decode.attn_out.{config}"], decode.reshape(1, -1), f"attention {config}, decode")


@pytest.mark.parametrize("config", CONFIGS)
def test_op_attention(config):
    cfg, t = f32_fixture()
    check_attention(t, "", config, cfg.head_dim, cfg.n_swa)


@functools.lru_cache(maxsize=None)
def geometry():  # -> (manifest entry, {name: array}) of ops/geometry.npz (head sizes 20 and 24)
    entry = OPS["geometry"]
    with np.load(os.path.join(HERE, entry["file"]), allow_pickle=False) as data:
        return entry, {k: data[k] for k in data.files}


@pytest.mark.parametrize("head", ["hd20", "hd24"])
def test_op_rope_vector_tails(head):  # 10 pairs: 8 by FMA, the last 2 without; 12 pairs: 8 + 4, all by FMA
    entry, t = geometry()
    dims = entry["models"][head]
    x = t[f"{head}.rope.in"]
    theta = ops.rope_angles(np.arange(len(x)), dims["head_dim"], dims["rope_base"], np.float32)
    assert_identical(t[f"{head}.rope.out"], ggml_cpu.rope_norm(x, theta), f"rope_norm, head_dim {dims['head_dim']}")


@pytest.mark.parametrize("head", ["hd20", "hd24"])
@pytest.mark.parametrize("config", CONFIGS)


def test_op_attention_head_sizes(head, config):  # 1/sqrtf(24) is not 1/sqrt(24) rounded to float
    entry, t = geometry()
    dims = entry["models"][head]
    check_attention(t, f"{head}.", config, dims["head_dim"], dims["n_swa"])


@pytest.mark.parametrize("head", ["hd64", "hd128"])
def test_op_attention_q8_0_rotated(head):  # q, k, v and the output through Walsh-Hadamard transforms
    entry = MANIFEST["kv_q8_0"]["ops"]
    dims = entry["models"][head]
    with np.load(os.path.join(HERE, entry["file"]), allow_pickle=False) as data:
        t = {k: data[k] for k in data.files}
    check_attention(t, f"{head}.", "kv-q8_0_fa-on", dims["head_dim"], dims["n_swa"])


# ---------------------------------------------------------------------------------------------
# The float tools the kernels are built from, against independent formulations


def test_fma32_rounds_once():  # against exact rational arithmetic, including double-rounding traps
    from fractions import Fraction
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    c = (rng.standard_normal(300) * 2.0 ** rng.integers(-30, 30, 300)).astype(np.float32)
    # a*b = 2^-24 - 2^-54 and c = 1 + 2^-23: the exact sum lies just below a float32 midpoint that
    # the float64 sum rounds onto, where ties-to-even would then go up (scaled by powers of two)
    scale = 2.0 ** np.arange(-20, 20)
    a[:40] = 2.0 ** -12 * (1 + 2.0 ** -15) * scale
    b[:40] = 2.0 ** -12 * (1 - 2.0 ** -15)
    c[:40] = (1 + 2.0 ** -23) * scale
    got = ggml_cpu.fma32(a, b, c)
    for x, y, z, r in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        near = np.float32(float(exact))
        candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
        best = min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact), int(np.float32(f).view(np.uint32)) & 1))
        assert r == best, (x, y, z)
    assert got[20] == np.float32(1 + 2.0 ** -23)  # float64 then float32 would give 1 + 2^-22


@pytest.mark.parametrize("n", [64, 128])
def test_fwht_is_the_normalised_sylvester_hadamard(n):  # against scipy's matrix product in float64
    from scipy.linalg import hadamard
    x = np.random.default_rng(n).standard_normal((3, 2 * n)).astype(np.float32)
    want = (x.astype(np.float64).reshape(-1, n) @ hadamard(n).T / np.sqrt(n)).reshape(x.shape)
    # the 1/sqrtf(n) scaling and each of the log2(n) butterfly levels round once to float32 (2^-24
    # relative, 2^-23 to be safe) on values at most sqrt(n) * max|x|
    tol = (np.log2(n) + 1) * np.sqrt(n) * 2.0 ** -23 * np.max(np.abs(x))
    assert np.max(np.abs(ggml_cpu.fwht(x, n) - want)) < tol


U = 2.0 ** -24  # float32 unit roundoff: each rounding moves a value by at most U times its magnitude


def test_layer_norm_against_float64():  # ggml_norm, mul, add on rows of widths with and without a 16-lane tail
    rng = np.random.default_rng(1)
    for n in (48, 70):
        x = (rng.standard_normal((5, n)) * 3 + 2).astype(np.float32)  # a mean away from 0 exercises x - mean
        w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        x64 = x.astype(np.float64)
        centered = x64 - x64.mean(-1, keepdims=True)
        scale = 1 / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-6)
        want = centered * scale * w + b
        got = ggml_cpu.layer_norm(x, w, b, 1e-6)
        # the f32 mean is off by 2U|mean| (sum, division): that moves every centred value by it; the
        # subtraction, the variance (squares, block sums, division: relative 4U, halved by the sqrt),
        # 1/sqrtf, the scaling, the weight and the bias each round once: 8U of the scaled term, U of b
        scaled = np.abs(centered * scale * w)
        tol = (8 * U * scaled + 2 * U * np.abs(x64.mean(-1, keepdims=True)) * scale * np.abs(w)
               + 2 * U * np.abs(want))
        assert np.all(np.abs(got - want) <= tol)


def test_gelu_erf_against_float64():
    from scipy.special import erf
    x = np.linspace(-6, 6, 2001).astype(np.float32)
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + erf(x64 / np.sqrt(2)))
    got = ggml_cpu.gelu_erf(x)
    # z = x*SQRT_2_INV is off by 2U|z| (the f32 constant, the product); erf' <= 2/sqrt(pi) turns that into
    # 2.3U|z| in erf, glibc erff adds an ulp (2U); 1 + erf and the two products round once each (U of 2
    # and of the result)
    z = np.abs(x64) / np.sqrt(2)
    tol = 0.5 * np.abs(x64) * (2.3 * U * z + 2 * U + 2 * U) + 3 * U * np.abs(want)
    assert np.all(np.abs(got - want) <= tol)


def test_rope_2d_against_float64():  # the first half of each head by theta_a, the second by theta_b
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 3, 40)).astype(np.float32)  # 10 pairs per half: the FMA and the plain tail
    theta_a = ops.rope_angles(np.arange(6), 20, 10000.0, np.float32)
    theta_b = ops.rope_angles(np.arange(6)[::-1].copy(), 20, 10000.0, np.float32)
    want = np.concatenate([ops.rope_norm(x[..., :20].astype(np.float64), theta_a.astype(np.float64)),
                           ops.rope_norm(x[..., 20:].astype(np.float64), theta_b.astype(np.float64))], axis=-1)
    got = ggml_cpu.rope_2d(x, theta_a, theta_b)
    # cosf/sinf within an ulp (2U), the products and the sum (or FMA) one rounding each: 4U of |x0| + |x1|
    pair = np.repeat(np.abs(x[..., 0::2]) + np.abs(x[..., 1::2]), 2, axis=-1).astype(np.float64)
    assert np.all(np.abs(got - want) <= 4 * U * pair)


# ---------------------------------------------------------------------------------------------
# Wiring, CLI and bad input


def test_text_model_routes_elementwise_ops_through_the_backend():
    calls = []

    class Spy(GgmlCpuBackend):
        def __getattribute__(self, name):
            if name in ("rms_norm", "rope_norm", "sigmoid", "swiglu", "softcap"):
                calls.append(name)
            return super().__getattribute__(name)

    lm = TextModel(model("models/tiny-b-f32.gguf"), backend=Spy(check_host=False))
    lm.prefill([1, 2], lm.new_cache(2, "uniform"))
    assert set(calls) == {"rms_norm", "rope_norm", "sigmoid", "swiglu", "softcap"}, \
        "reference/text.py must call backend.rms_norm/rope_norm/sigmoid/swiglu/softcap for the ggml-cpu mode"


def check_cli_run(tmp_path, run, *flags):  # reference.run --numerics ggml-cpu FLAGS: logits equal to llama.cpp's run
    ids = MANIFEST["prompt"]["token_ids"]
    out = tmp_path / "logits.npy"
    done = run_cli("reference.run", "--model", os.path.join(GOLDEN, run["model"]), "--numerics", "ggml-cpu", *flags,
                   "--token-ids", ",".join(map(str, ids)), "--n-predict", "0", "--logits-out", str(out))
    assert done.returncode == 0, done.stderr
    ref = np.load(os.path.join(HERE, run["file"]), allow_pickle=False)[:len(ids)]
    assert_identical(ref, np.load(out, allow_pickle=False), " ".join(("reference.run --numerics ggml-cpu",) + flags))


def test_cli_logits_bit_identical(tmp_path):
    run = next(r for r in MANIFEST["runs"] if r["type"] == "q4_0" and r["kv_type"] == "f16" and not r["flash_attn"])
    check_cli_run(tmp_path, run)


def test_cli_q8_0_kv_logits_bit_identical(tmp_path):  # --kv-type q8_0 turns flash attention on
    check_cli_run(tmp_path, next(r for r in MANIFEST["kv_q8_0"]["runs"] if r["type"] == "q8_0"), "--kv-type", "q8_0")


@pytest.mark.parametrize("k_type, v_type, fa, flash_attn", [
    ("f16", "q8_0", "auto", True),  # -fa auto is on, as in llama.cpp
    ("q8_0", "f16", "off", False),  # K.Q a Q8_0 mul_mat
])
def test_cli_mixed_kv_logits_bit_identical(tmp_path, k_type, v_type, fa, flash_attn):
    run = next(r for r in MANIFEST["kv_mixed"]["runs"] if r["type"] == "tiny-a-f32"
               and (r["cache_type_k"], r["cache_type_v"], r["flash_attn"]) == (k_type, v_type, flash_attn))
    check_cli_run(tmp_path, run, "-ctk", k_type, "-ctv", v_type, "-fa", fa)


@pytest.mark.parametrize("args, message", [
    (("--numerics", "ggml"), "invalid choice: 'ggml'"),
    (("--numerics", "ggml-cpu", "--dtype", "float64"), "computes in float32"),
    (("--kv-type", "q8_0"), "for --numerics ggml-cpu only"),
    (("--flash-attn", "on"), "for --numerics ggml-cpu only"),
    (("--kv-type", "q4_0"), "invalid choice: 'q4_0'"),
    (("--numerics", "ggml-cpu", "--kv-type", "q8_0", "--flash-attn", "off"), "needs flash attention"),
    (("--numerics", "ggml-cpu", "-ctk", "f16", "-ctv", "q8_0", "-fa", "off"), "a q8_0 V cache needs flash attention"),
    (("-ctk", "f16", "-ctv", "f32"), "for --numerics ggml-cpu only")])


def test_cli_bad_numerics_is_one_line_exit_2(args, message):
    done = run_cli("reference.run", *args, "--token-ids", "1,2", "--n-predict", "0")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert message in done.stderr


def test_unmodelled_requests_raise_typed_errors():
    with pytest.raises(GgmlCpuError, match="q4_0"):
        GgmlCpuBackend("q4_0", True, check_host=False)
    with pytest.raises(GgmlCpuError, match="flash attention"):  # llama.cpp refuses a quantized V cache without it
        GgmlCpuBackend("q8_0", False, check_host=False)
    with pytest.raises(GgmlCpuError, match="multiple of 32"):  # tiny-b's head_dim 16 holds no Q8_0 block
        ggml_logits(model("models/tiny-b-f32.gguf"), [1, 2], [], "q8_0", True)

    class Weights:  # a weight type the emulation has no kernel for
        def type_name(self, name):
            return "MXFP4"

    with pytest.raises(GgmlCpuError, match="MXFP4"):
        ggml_cpu.mul_mat(np.zeros((1, 256), np.float32), Weights(), "blk.0.ffn_up.weight", {})


# IQ1_S, IQ1_M, IQ2_XS, IQ3_S: rows of several blocks (the presets' logits only hold one per row)

IQ_KERNELS = json.loads(Path(HERE, "kernels", "manifest.json").read_text(encoding="utf-8"))


class BlockRows:  # the weights mul_mat reads: one matrix of raw blocks of one type, under any name
    def __init__(self, kind, blocks):
        self.kind, self.blocks = kind, blocks

    def type_name(self, name):
        return self.kind

    def raw(self, name):
        return self.blocks


def iq_block_rows(kind, row_blocks=None):  # -> BlockRows of every `kind` tensor of its preset model, regrouped
    from tools.regen.make_iq_kernel_goldens import ROW_BLOCKS, regrouped
    entry = IQ_KERNELS["models"][kind]
    path = os.path.join(GOLDEN, entry["file"])
    assert sha256(Path(path)) == entry["sha256"], path
    return BlockRows(kind, regrouped(Path(path), kind, row_blocks or ROW_BLOCKS))


def check_iq_kernel(kind, rows, mul_mat):  # llama.cpp's product (golden/ggml_cpu/kernels) against mul_mat's
    golden = np.load(os.path.join(HERE, "kernels", IQ_KERNELS["file"]), allow_pickle=False)
    got = mul_mat(golden["x"][:rows], iq_block_rows(kind), kind, {}, repack=False)
    assert_identical(golden[f"{kind}.out{rows}"], got, f"{kind} x {rows} rows of 4 blocks")


@pytest.mark.parametrize("kind", sorted(IQ_KERNELS["models"]))
@pytest.mark.parametrize("rows", IQ_KERNELS["rows"])  # the vec_dot below 8 rows, the tiled kernel from 8


def test_iq_kernels_bit_identical_to_llama_cpp(kind, rows):
    check_iq_kernel(kind, rows, ggml_cpu.mul_mat)


@pytest.mark.parametrize("kind", sorted(IQ_KERNELS["models"]))
def test_iq_decoders_are_ggml_to_float(kind):  # every tensor: d * post * scale * value is ggml's float, bit for bit
    """The products are exact in float32 (an f16 d, a scale of at most 4 bits, a code of at most 6),
    as in dequantize_row_*, so one rounding of the float64 product is ggml's value; the digests are
    llama-quantize's F32 requantization (golden/presets/manifest.json)."""
    from test_quant_presets import preset_entry
    entry = preset_entry(kind)
    weights = gguf.load(os.path.join(GOLDEN, "presets", entry["file"]), "text").weights
    for name in [n for n, t in entry["tensor_types"].items() if t == kind]:
        rows = ggml_cpu.decode(weights, name)
        scales = np.repeat(rows.scales, rows.sub, axis=-1).astype(np.float64)
        values = rows.d.astype(np.float64)[..., None] * rows.post * scales * rows.values
        floats = values.astype(np.float32).reshape(len(values), -1)
        assert sha256_of(floats) == entry["ggml_f32_sha256"][name], name


def sha256_of(array):  # -> hex sha256 of the little-endian float32 bytes
    return hashlib.sha256(np.ascontiguousarray(array, "<f4").tobytes()).hexdigest()
# ---------------------------------------------------------------------------------------------
# The bounded weight cache: a matrix past the budget is decoded in row blocks on every call

STREAM_MODELS = ["q4_k_m", "iq2_xxs", "q6_k", "iq4_xs", "q8_0", "q4_0"]  # repacked Q4_K and Q4_0, tiled, lanes
BOUNDED_RUNS = [r for r in MANIFEST["runs"] if r["kv_type"] == "f16" and not r["flash_attn"]
                and r["type"] in ("q4_k_m", "iq2_xxs")]
BOUNDED_BYTES = 600_000  # keeps the first few of tiny-b's decoded matrices (262 kB for an int16 ffn_up)


def check_streamed_mul_mat(kind, step, mul_mat, monkeypatch, decodes=lambda weights, name, rows: True):
    """No cache, 8-row blocks: llama.cpp's outputs. decodes(weights, name, rows): whether mul_mat decodes
    the matrix (the numba kernels read some types' blocks as they lie, and leave the cache empty)."""
    monkeypatch.setattr(importlib.import_module("reference.ggml_cpu.mul_mat"), "STREAM_ROWS", 8)
    entry, t = fixture(kind)
    x, ref = t[f"{step}ffn_up.in"], t[f"{step}ffn_up.out"]  # llama.cpp's first 32 outputs: 4 blocks
    weights, cache = model(entry["model"]).weights, {}
    got = mul_mat(x, weights, "blk.0.ffn_up.weight", cache, cache_bytes=0)
    decoded = decodes(weights, "blk.0.ffn_up.weight", len(x))
    assert cache == ({"blk.0.ffn_up.weight": "streamed"} if decoded else {})
    assert_identical(ref, got[:, :ref.shape[1]], f"streamed mul_mat {kind} with {len(x)} rows")
    assert_identical(mul_mat(x, weights, "blk.0.ffn_up.weight", {}), got, f"streamed {kind}, all rows")


def check_bounded_logits(run, backend_class, monkeypatch):  # a manifest run under BOUNDED_BYTES, 64-row blocks
    monkeypatch.setattr(importlib.import_module("reference.ggml_cpu.mul_mat"), "STREAM_ROWS", 64)
    made = []

    def backend(*args, **kwargs):  # the run's backend with the budget, kept to look into its cache
        made.append(backend_class(*args, cache_bytes=BOUNDED_BYTES, **kwargs))
        return made[-1]

    check_run(run, model(run["model"]), backend)
    entries = [entry for cache in made[0].decoded.values() for entry in cache.values()]
    kept = sum(map(decoded_bytes, entries))
    assert "streamed" in entries and 0 < kept <= BOUNDED_BYTES, f"{kept} bytes kept"


@pytest.mark.parametrize("kind", STREAM_MODELS)
@pytest.mark.parametrize("step", ["", "decode."])


def test_streamed_mul_mat_on_llama_cpp_tensors(kind, step, monkeypatch):  # no cache, 8-row blocks
    check_streamed_mul_mat(kind, step, ggml_cpu.mul_mat, monkeypatch)


@pytest.mark.parametrize("run", BOUNDED_RUNS, ids=lambda r: r["file"][len("logits/"):-len(".npy")])
def test_bounded_cache_logits_bit_identical_to_llama_cpp(run, monkeypatch):  # some matrices kept, the rest streamed
    check_bounded_logits(run, GgmlCpuBackend, monkeypatch)
