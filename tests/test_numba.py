"""The numba backend (accel/numba) against its oracles:
- dequantization against gguf-py (bit-exact with ggml) on every tensor of the committed GGUFs;
- every op x type x shape of accel/harness.py against reference/ops.py, each under its gate;
- whole-model logits against the numpy backend on every committed tiny text model, and against the
  committed llama.cpp and transformers goldens of the f32 models;
- `python -m reference.run --backend numba`, including its bad input.

NMSE is sum((ref - x)^2) / sum(ref^2), ref being the oracle.
"""
import glob
import json
import os

import numpy as np
import pytest

from conftest import GOLDEN, MODELS, require, run_cli

require("numba")  # the [accel] extra

from gguf import GGMLQuantizationType as GT, GGUFReader, GGUFWriter  # noqa: E402
from gguf import quants  # noqa: E402

from accel import harness  # noqa: E402
from accel.numba import NumbaBackend, quant  # noqa: E402
from reference import factory, gguf, ops, vision  # noqa: E402
from reference.backend import NumpyBackend  # noqa: E402
from reference.gguf import Weights  # noqa: E402
from reference.text import TextModel  # noqa: E402
from reference.metrics import nmse  # noqa: E402

TEXT_MODELS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(MODELS, "tiny-*.gguf"))
                     if "mmproj" not in p and "dflash" not in p)
ALL_MODELS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(MODELS, "tiny-*.gguf")))
ROLE = {"mmproj": "mmproj", "dflash": "dflash"}

# The gate for whole-model logits, numba against numpy. Both multiply the same exact weights; numba
# sums in float32 within a super-block or tile and takes exp/tanh/erf from libm: measured NMSE
# 1.8e-13 .. 8.6e-13 on the 16 tiny models (max |diff| <= 3.6e-5), top-1 identical. The float32
# lanes follow the CPU's vector width, so another machine's sums differ in their last bits: 1e-11
# leaves 12x over the worst. A real bug is larger: the model's eps in place of the post-norm's
# moves tiny-a's logits by 7e-9.
WHOLE_MODEL_GATE = 1e-11


def role_of(name):
    return next((role for key, role in ROLE.items() if key in name), "text")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_dequantization_is_bit_exact_with_gguf_py(name):
    weights = gguf.load(os.path.join(MODELS, name), role_of(name)).weights
    checked = 0
    for tensor, t in weights.tensors.items():
        if len(weights.shape(tensor)) != 2 or t.tensor_type not in quant.KERNEL_TYPES:
            continue
        n_out, n_in = weights.shape(tensor)
        expected = weights.get(tensor, np.float32)
        for dtype in (np.float32, np.float64):  # the tiles of float32 runs, and of float64 runs
            ours = np.empty((n_out, n_in), dtype)
            quant.dequantize_rows(int(t.tensor_type), quant.as_blocks(weights.raw(tensor), n_out), n_in, 0, ours,
                                  quant.TABLES)
            assert np.array_equal(ours.astype(np.float32).view(np.uint32), expected.view(np.uint32)), tensor
        checked += 1
    assert checked


CASES = harness.all_cases(seed=0)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-{c.name}-{c.dtype}".replace(" ", "_") for c in CASES])
def test_harness_case(case):
    err, diff, gate, problem = harness.check(case, NumbaBackend(np.float32))
    assert not problem, f"{case.name}: {problem} (max |diff| {diff:.3g})"


def test_exp_nonpositive_against_libm():  # the attention's own exp, which the harness cases reach only at a few values
    from accel.numba.attention import exp_nonpositive
    x = np.concatenate([-np.logspace(-300, np.log10(708), 20001), [0.0, -1e-320, -707.9, -708.1, -745.0, -1e300]])
    ours, libm = np.array([exp_nonpositive(v) for v in x]), np.exp(x)
    normal = x > -708
    # 2 ulp: Horner's rounding (13 steps with |r| <= ln2/2, each within half an ulp of a value < 1.5)
    # and one product by 2^k, exact; measured 1 ulp over these 20007 values
    ulp = np.spacing(libm[normal])
    assert np.max(np.abs(ours[normal] - libm[normal]) / ulp) <= 2
    assert ours[-6] == 1.0 and ours[-5] == 1.0  # exp(0) and exp of a subnormal are exactly 1, as libm's
    # from -708 down exp is < 3.31e-308, nothing beside the softmax's largest term (exp(0) = 1)
    assert np.all(ours[~normal] == 0) and np.all(libm[~normal] < 3.31e-308)
    assert np.isnan(exp_nonpositive(np.nan))


def test_blocked_attention_keeps_nans_and_huge_scores():
    # 40 query rows per kv head: the blocked route. A NaN in one query is NaN in its output, as the
    # reference's; scores of ~1e19 (a query scaled by 1e18) leave each row's largest at exp(0) = 1
    rng = np.random.default_rng(0)
    T, S, H, Hkv, D = 20, 20, 4, 2, 8
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((T, H, D), (S, Hkv, D), (S, Hkv, D)))
    q[3, 0, 0] = np.nan
    q[5, 1] *= np.float32(1e18)
    visible = ops.causal_visible(np.arange(T), np.arange(S), 0)
    ref, got = ops.attention(q, k, v, visible, 0.25), NumbaBackend(np.float32).attention(q, k, v, visible, 0.25)
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(ref[3, 0]).all()
    finite = ~np.isnan(ref)
    assert nmse(ref[finite], got[finite]) <= harness.GATES["attention"][0]  # the harness's attention gate


def logits_of(model, backend, ids, decode):  # -> [len(ids) + len(decode), V]: chunked prefill, then decode steps
    lm = TextModel(model, np.float32, backend)
    cache = lm.new_cache(len(ids) + len(decode), "ring", 16)
    prompt = lm.prefill(ids, cache, 16)  # chunks of 16 (tiled products), a last chunk of 2 (row by row)
    steps = [lm.prefill([t], cache, 16)[-1] for t in decode]
    return np.vstack([prompt, steps])


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_whole_model_matches_numpy_backend(name):
    model = gguf.load(os.path.join(MODELS, name), "text")
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 497, 34)]
    ref = logits_of(model, NumpyBackend(np.float32), ids, [3, 17, 250])
    ours = logits_of(model, NumbaBackend(np.float32), ids, [3, 17, 250])
    assert nmse(ref.ravel(), ours.ravel()) <= WHOLE_MODEL_GATE
    assert np.array_equal(ref.argmax(-1), ours.argmax(-1))


@pytest.mark.parametrize("name", [n for n in ALL_MODELS if "mmproj" in n])
def test_vision_tower_matches_numpy_backend(name):
    model = gguf.load(os.path.join(MODELS, name), "mmproj")
    rgb = (np.random.default_rng(4).random((56, 84, 3)) * 255).astype(np.uint8)
    ref = vision.VisionModel(model, np.float32, NumpyBackend(np.float32)).encode(rgb)
    ours = vision.VisionModel(model, np.float32, NumbaBackend(np.float32)).encode(rgb)
    assert nmse(ref.ravel(), ours.ravel()) <= WHOLE_MODEL_GATE  # measured: 7.0e-14 (f32), 6.8e-14 (f16)


def f32_goldens():  # -> [(run dir, manifest)] of the engines that compute in f32 on f32 weights
    runs = []
    for path in sorted(glob.glob(os.path.join(GOLDEN, "logits", "**", "manifest.json"), recursive=True)):
        with open(path) as f:
            m = json.load(f)
        opts = m.get("options", {})
        file = m["model"].get("file", f"{m['model'].get('checkpoint')}-f32.gguf")
        if not os.path.isfile(os.path.join(MODELS, file)):  # glimmer-default: an f16 GGUF only
            continue
        exact_kv = m["engine"] == "transformers" or (opts.get("kv_type") == "f32" and opts.get("flash_attn") == "off")
        if file.endswith("-f32.gguf") and exact_kv:
            runs.append((os.path.dirname(path), m, file))
    return runs


@pytest.mark.parametrize("run", f32_goldens(), ids=lambda r: os.path.relpath(r[0], GOLDEN))
def test_logits_match_external_goldens(run):
    # the reference's own gate for these goldens (tests/test_text_parity.py): f32 math on both
    # sides, only summation order differs; measured 1e-13..1e-11
    run_dir, manifest, file = run
    model = gguf.load(os.path.join(MODELS, file), "text")
    lm = TextModel(model, np.float32, NumbaBackend(np.float32))
    for e in manifest["entries"]:
        golden = np.load(os.path.join(run_dir, e["file"]), allow_pickle=False)
        ids = e["token_ids"]
        ours = lm.prefill(ids, lm.new_cache(len(ids), "ring", 2048))
        assert nmse(golden.ravel(), ours.ravel()) <= 1e-10, e["id"]
        assert np.array_equal(golden.argmax(-1), ours.argmax(-1)), e["id"]


def test_type_without_kernel_falls_back_to_the_reference(tmp_path):
    # MXFP4: gguf-py decodes it; llama-quantize writes it only for 3-d expert tensors (llama-quant.cpp)
    path = str(tmp_path / "mxfp4.gguf")
    w = GGUFWriter(path, "test")
    w.add_tensor("w", quants.quantize(np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32), GT.MXFP4),
                 raw_dtype=GT.MXFP4)
    gguf.write_out(w)
    weights = Weights(gguf.open_reader(path), path)
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    assert GT.MXFP4 not in quant.KERNEL_TYPES
    assert np.array_equal(NumbaBackend(np.float32).linear(x, weights.tensor("w")), ops.linear(x, weights.get("w", np.float64)))


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan, 3e38])
def test_activations_the_kernels_do_not_take_get_the_reference_product(special):
    # an inf meeting a zero weight gives NaN in the factored K-quant form, and 3e38 times an unscaled
    # integer weight overflows in float32 where the reference's product does not: both take the
    # reference's product, whose inf and NaN are numpy's
    types = (GT.Q4_K, GT.Q6_K, GT.Q8_0, GT.IQ2_XXS)
    weights = harness.TensorFile([(t.name, t, 8, 512) for t in types], np.random.default_rng(5)).weights
    for T in (1, 5):  # the row route and the tiles
        x = np.random.default_rng(6).standard_normal((T, 512)).astype(np.float32)
        x[0, 7] = special
        for t in types:
            with np.errstate(over="ignore"):  # the reference's float64 sum of 3e38 rounds to inf in float32
                ours = NumbaBackend(np.float32).linear(x, weights.tensor(t.name))
                ref = ops.linear(x, weights.get(t.name, np.float64))
            assert np.array_equal(ours, ref, equal_nan=True), t.name


def test_float16_activations_get_the_reference_product():
    weights = harness.TensorFile([("Q4_K", GT.Q4_K, 8, 512)], np.random.default_rng(5)).weights
    x = np.random.default_rng(6).standard_normal((1, 512)).astype(np.float16)
    assert np.array_equal(NumbaBackend(np.float32).linear(x, weights.tensor("Q4_K")), ops.linear(x, weights.get("Q4_K", np.float64)))


def test_the_factory_builds_the_numba_backend():
    assert isinstance(factory.backend(factory.Build(backend="numba")), NumbaBackend)
    assert isinstance(factory.backend(factory.Build()), NumpyBackend)
    with pytest.raises(factory.FactoryError):
        factory.backend(factory.Build(backend="tpu"))


def test_cli_backend_numba_gives_the_numpy_logits_and_tokens(tmp_path):
    model = os.path.join(MODELS, "tiny-a-q4_k_m.gguf")
    out = {}
    for backend in ("numpy", "numba"):
        logits = str(tmp_path / f"{backend}.npy")
        r = run_cli("reference.run", "--model", model, "--token-ids", "497,10,20,30,40,50", "--n-predict", "4",
                    "--backend", backend, "--logits-out", logits, "--json")
        assert r.returncode == 0, r.stderr
        out[backend] = (np.load(logits), json.loads(r.stdout)["tokens"])
    assert nmse(out["numpy"][0].ravel(), out["numba"][0].ravel()) <= WHOLE_MODEL_GATE
    assert out["numpy"][1] == out["numba"][1]


@pytest.mark.parametrize("args, message", [(["--backend", "numba", "--tp", "2"], "--tp simulates tensor parallelism"),
                                           (["--backend", "cupy-or-else"], "invalid choice: 'cupy-or-else'")])
def test_cli_bad_backend_use_is_one_line_exit_2(args, message):
    r = run_cli("reference.run", "--model", os.path.join(MODELS, "tiny-a-f32.gguf"), "--token-ids", "1,2", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and message in r.stderr


def unpacked_values(low, high, high_bits):  # -> float64 [R, n]: the fields floor_loop multiplies, in x's order
    m = low.shape[1] // 2  # n/4
    mask = (1 << high_bits) - 1
    fields = [(low[:, :m] & 15) | (((high >> 0) & mask) << 4), (low[:, m:] & 15) | (((high >> 2) & mask) << 4),
              (low[:, :m] >> 4) | (((high >> 4) & mask) << 4), (low[:, m:] >> 4) | (((high >> 6) & mask) << 4)]
    return np.concatenate(fields, axis=1).astype(np.float64)


@pytest.mark.parametrize("high_bits", [0, 1, 2])
def test_floor_loops_compute_the_sums_the_ceiling_bound_assumes(high_bits):
    # tools/bench/kernel_floor.py bounds decode speed by these loops: they must do the whole work they
    # stand for (every field extracted, converted and multiplied), or the bound is too high.
    # Fields 0..63 times N(0, 1), float32 sums of 4 x 416 terms against float64: a relative error of
    # about 2^-24 sqrt(1664) per row, NMSE ~1e-12 at most; 1e-10 leaves room and still fails on any
    # wrong field (which moves whole products, NMSE > 1e-4).
    from tools.bench import kernel_floor
    rng = np.random.default_rng(high_bits)
    low = rng.integers(0, 256, (64, 832), dtype=np.uint8)
    high = rng.integers(0, 256, (64, 416), dtype=np.uint8)
    x = rng.standard_normal(1664).astype(np.float32)
    out = np.empty(64, np.float32)
    kernel_floor.floor_loop(high_bits)(low, high, x, out)
    values = unpacked_values(low, high, high_bits)
    assert values.max() == (16 << high_bits) - 1
    assert nmse(values @ x.astype(np.float64), out) <= 1e-10


def test_ceiling_bound_sums_each_types_time_at_its_floor():
    from tools.bench import kernel_floor
    from tools.bench.ceiling import weights_per_type
    # 2e9 4-bit weights at 2 G/s and 1e9 6-bit at 1 G/s: 2 s; IQ2_XXS has no floor and counts as free
    assert kernel_floor.model_bound({"Q4_K": 2 * 10**9, "Q6_K": 10**9, "IQ2_XXS": 5 * 10**9}, {0: 2.0, 2: 1.0}) == 2.0
    path = os.path.join(MODELS, "tiny-a-q4_k_m.gguf")
    matrices = [t for t in GGUFReader(path).tensors if len(t.shape) == 2]
    embedding = [t.n_elements for t in matrices if t.name == "token_embd.weight"]
    assert sum(weights_per_type(path).values()) == sum(t.n_elements for t in matrices) - sum(embedding) > 0
