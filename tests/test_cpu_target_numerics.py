"""--numerics ggml-cpu for each CPU target against that target's own llama.cpp build
(golden/cpu_targets/<target>/manifest.json: per preset x repack x KV type x flash attention x prompt,
the sha256 of the float32 prefill logits [n_tokens, n_vocab] and of the decode-step logits fed
llama.cpp's own greedy tokens; for the clang builds of the ARM targets, the manifest's "clang" entry). Bit-exact or not at all: the sha256 of our float32 logits must be
llama.cpp's. CI runs a derived subset of presets (CPU_TARGET_FULL=1: every run of the manifest the target
emulates)."""
import hashlib
import json
import os
import platform
import warnings

import numpy as np
import pytest

from conftest import IN_CI, require
from reference import gguf
from reference.ggml_cpu import UBATCH, GgmlCpuBackend, GgmlCpuError
from reference.ggml_cpu.libm import fdlibm_tanhf, libm
from reference.text import TextModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "golden", "cpu_targets")
PROMPTS = os.path.join(ROOT, "golden", "prompts", "text-short.jsonl")
FULL = os.environ.get("CPU_TARGET_FULL") == "1"
SUBSET = ("Q4_K_M", "Q2_K", "IQ4_NL", "Q6_K")  # repacked on avx2 (Q4_K, IQ4_NL) and not (Q2_K), tiled (Q6_K)
# neon, neon-i8mm: every preset with repack on and off. CI: with repack off on neon tinyBLAS_Q0_ARM for Q8_0
# and Q4_0, the NEON vec_dots of Q4_K, Q5_0 and Q6_K (Q4_K_M); on neon-i8mm the i8mm kernels of Q8_0, Q4_1, Q4_K
# and Q6_K (the 64-row prompt) and the vec_dots without llamafile. With repack on, on both, every NEON layout
# (mul_mat.NEON_REPACKED_EPILOGUES): q8_0, q4_0, q1_0 and iq4_nl 4-row layouts, q4_K, q5_K (IQ4_NL) and q6_K
# 8-row ones, gemm and gemv (prompts of 33 and 7 rows): 32 runs on each
NEON_REPACKED_CI = ("Q8_0", "Q4_0", "Q4_K_M", "IQ4_NL", "Q1_0")
CI = {"avx2": {"on": SUBSET, "off": SUBSET}, "avx512": {"on": SUBSET, "off": SUBSET},  # target -> repack -> presets
      "neon": {"off": ("Q8_0", "Q4_0", "Q4_K_M"), "on": NEON_REPACKED_CI},
      "neon-i8mm": {"off": ("Q8_0", "Q4_1", "Q4_K_M"), "on": NEON_REPACKED_CI}}
CLANG = {"neon-clang": "neon", "neon-i8mm-clang": "neon-i8mm"}  # clang target -> the GCC one whose manifest has its runs
CI.update({clang: CI[gcc] for clang, gcc in CLANG.items()})  # the same kernels, with clang's contractions
FULL_RUNS = {target: {"on": None, "off": None} for target in CI}  # None: every preset
# llama.cpp's variants below AVX2 (golden/cpu_targets/<variant>, tools/regen/make_variant_goldens.py): repack off
# only (no CPU_REPACK layout exists there); the mode emulates their F32, F16 and BF16 weights and Q8_0 (the
# manifests' other presets are refused, test_pre_avx2_refuses_other_quantized_weights)
PRE_AVX2 = ("sandybridge", "ivybridge", "piledriver", "sse42", "x64")
PRE_AVX2_EMULATED = ("F32", "F16", "BF16", "Q8_0")
# CI: F16 weights with an F16 cache (tinyBLAS F16 where F16C is, else vec_dot_f16; the F16 P.V) and Q8_0 with
# flash attention (tinyBLAS_Q0_AVX or the vec_dot's AVX or scalar arm, the quantizer, the tiled and one-chunk
# flash kernels' madds, the SSE2 soft_max)
PRE_AVX2_CI = (("F16", "f16", "off"), ("Q8_0", "f32", "on"))


def checked(run, target):  # manifest run -> whether the test checks it for target
    if target in PRE_AVX2:
        if FULL:
            return run["preset"] in PRE_AVX2_EMULATED
        return (run["preset"], run["kv_type"], run["flash_attn"]) in PRE_AVX2_CI
    presets = (FULL_RUNS if FULL else CI)[target].get(run["repack"], ())
    return presets is None or run["preset"] in presets


def manifest(target):  # -> the target's manifest; a skip only where the goldens are absent outside CI
    path = os.path.join(GOLDEN, target, "manifest.json")
    if not os.path.exists(path) and not IN_CI:
        pytest.skip(f"{path} absent (the cpu_targets goldens are committed by the tool that makes them)")
    with open(path) as f:
        return json.load(f)


def target_runs(target):  # -> the manifest runs of the target's own llama.cpp build
    """A clang build's runs are its GCC twin's, with the prompts whose logits differ taken from the
    manifest's "clang" entry (make_cpu_target_goldens --clang records those, with the hashes and
    greedy tokens that differ)."""
    if target not in CLANG:
        return manifest(target)["runs"]
    m = manifest(CLANG[target])
    differing = {(d["preset"], d["repack"], d["kv_type"], d["flash_attn"], d["prompt"]): d
                 for d in m["clang"]["differing"]}
    runs = []
    for run in m["runs"]:
        key = (run["preset"], run["repack"], run["kv_type"], run["flash_attn"])
        prompts = []
        for p in run["prompts"]:
            d = differing.get(key + (p["id"],))
            prompts.append(p if d is None else {**p, **{k: d[k] for k in d["differs"]}})
        runs.append({**run, "prompts": prompts})
    return runs


def sha256(a):  # float32 array -> hex digest of its C-order bytes
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


def check_run(run, target, backend_class=GgmlCpuBackend, prompts_file=PROMPTS):  # manifest run -> [(prompt id, prefill ok, decode ok)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gguf.load(os.path.join(ROOT, run["model"]), "text")
    backend = backend_class(run["kv_type"], flash_attn=run["flash_attn"] == "on", check_host=False,
                            repack=run["repack"] == "on", cpu=target)
    lm = TextModel(model, backend=backend)
    with open(prompts_file) as f:
        prompts = {p["id"]: p["token_ids"] for p in map(json.loads, f)}
    results = []
    for p in run["prompts"]:
        ids, tokens = prompts[p["id"]], p["greedy"]
        cache = lm.new_cache(len(ids) + len(tokens), "uniform")
        prefill = lm.prefill(ids, cache, UBATCH)
        decode = np.array([lm.prefill([t], cache, UBATCH)[-1] for t in tokens[:-1]])
        results.append((p["id"], sha256(prefill) == p["prefill_sha256"], sha256(decode) == p["decode_sha256"]))
    return results


def failures(target, backend_class=GgmlCpuBackend):  # -> one line per run and prompt whose logits differ
    """CI: the target's subset; CPU_TARGET_FULL=1: every run of the manifest the target emulates."""
    failed = []
    for run in target_runs(target):
        if not checked(run, target):
            continue
        for prompt, prefill_ok, decode_ok in check_run(run, target, backend_class):
            if not (prefill_ok and decode_ok):
                failed.append(f"{run['preset']} repack {run['repack']} kv {run['kv_type']} fa {run['flash_attn']} "
                              f"{prompt}: prefill {'ok' if prefill_ok else 'DIFF'}, decode {'ok' if decode_ok else 'DIFF'}")
    return failed


@pytest.mark.parametrize("target", ["avx2", "avx512", "neon", "neon-i8mm", *CLANG, *PRE_AVX2])
def test_target_bit_identical_to_its_llama_cpp(target):
    failed = failures(target)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("target", PRE_AVX2)
def test_pre_avx2_refuses_other_quantized_weights(target):
    """The variants' manifests hold presets the mode does not emulate there (their Q4_K, Q6_K, ... vec_dots
    take the AVX, SSSE3 or scalar arms): each is refused with a typed error naming the weight type, never
    run with another target's arithmetic. A q8_0 cache likewise."""
    others = [run for run in manifest(target)["runs"] if run["preset"] not in PRE_AVX2_EMULATED]
    assert others, "the manifest records a preset the mode refuses"
    for run in others[:1]:
        with pytest.raises(GgmlCpuError, match=f"weights are not emulated on the {target} target"):
            check_run(run, target)
    with pytest.raises(GgmlCpuError, match=f"q8_0 KV cache is not emulated on the {target} target"):
        GgmlCpuBackend("q8_0", flash_attn=True, cpu=target, check_host=False)


PORTABLE_CI = ("F32", "F16", "Q5_0")  # the float matmuls, and a preset the RoPE's rounding moved on this prompt


def test_avx2_is_the_portable_build():
    """llama.cpp built `cmake -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON` and run through llama-cpp-python
    (golden/cpu_targets/avx2-portable, tools/regen/make_portable_goldens.py): the F32, F16 and BF16
    models and 4 presets on a prompt of 70 tokens, repack on and off. Where rotate_pairs' second lane
    was fused on x1*c, the F32 model missed from its second row on (docs/ggml-cpu-numerics.md).
    CI: PORTABLE_CI with plain buffers; CPU_TARGET_FULL=1: every run."""
    m = manifest("avx2-portable")
    failed = []
    for run in m["runs"]:
        if not FULL and (run["preset"] not in PORTABLE_CI or run["repack"] != "off"):
            continue
        for prompt, prefill_ok, decode_ok in check_run(run, m["target"], prompts_file=os.path.join(ROOT, m["prompts_file"])):
            if not (prefill_ok and decode_ok):
                failed.append(f"{run['preset']} repack {run['repack']} {prompt}: prefill {prefill_ok}, decode {decode_ok}")
    assert not failed, "\n".join(failed)


def test_numba_twin_of_avx2_bit_identical_to_its_llama_cpp():  # the twins take the target too
    require("numba")
    from accel.numba.ggml import GgmlCpuNumbaBackend
    failed = failures("avx2", GgmlCpuNumbaBackend)
    assert not failed, "\n".join(failed)


def test_neon_q8_0_cache_and_numba_twins_refused():  # NEON's Q8_0 K dots and numba twins of the ARM kernels: not emulated
    with pytest.raises(GgmlCpuError, match="q8_0 KV cache is not emulated on the neon target"):
        GgmlCpuBackend("q8_0", flash_attn=True, cpu="neon", check_host=False)
    require("numba")
    from accel.numba.ggml import GgmlCpuNumbaBackend
    with pytest.raises(GgmlCpuError, match="numba twins model the avx2 and avx512 targets, not neon-i8mm"):
        GgmlCpuNumbaBackend(cpu="neon-i8mm", check_host=False)


def test_fdlibm_tanhf_unfused_is_this_glibc():
    """The NEON softcap's tanhf is glibc's fdlibm code with aarch64's fused multiply-adds (pinned by the
    neon goldens above); unfused, the same code must be x86-64 glibc's own tanhf, bit for bit, on the
    softcap's range and beyond (both branches, the |x| >= 22 and tiny cases)."""
    if platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
        pytest.skip("compares with x86-64 glibc's tanhf")
    x = np.concatenate([np.random.default_rng(0).uniform(-3, 3, 100000), [0, -0.0, 1, -1, 22, -23, 1e-30, np.inf]])
    x = x.astype(np.float32)
    np.testing.assert_array_equal(fdlibm_tanhf(x, fused=False).view(np.uint32), libm("tanhf", x).view(np.uint32))


HASWELL_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")
ZEN4_FLAGS = HASWELL_FLAGS + ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni",
                              "avx512_bf16")


@pytest.mark.parametrize("flags, variant", [
    ((), "x64"), (("sse4_2",), "sse42"), (("sse4_2", "avx", "f16c"), "ivybridge"), (HASWELL_FLAGS, "haswell"),
    (HASWELL_FLAGS + ("avx_vnni",), "alderlake"), (ZEN4_FLAGS[:11], "skylakex"), (ZEN4_FLAGS[:12], "cannonlake"),
    (ZEN4_FLAGS, "zen4"), (ZEN4_FLAGS + ("amx_tile", "amx_int8"), "sapphirerapids"),
    (HASWELL_FLAGS + ("avx512f",), "haswell"),  # AVX512F alone is no skylakex (CD, VL, DQ and BW are checked too)
])
def test_auto_picks_the_variant_llama_cpp_loads(flags, variant):
    """ggml_backend_cpu_x86_score (cpu-feats.cpp:263-322): 0 where a feature the variant was built with
    is missing, else the sum of the features' weights; the highest score loads."""
    from reference.ggml_cpu.target import host_variant
    assert host_variant(list(flags)) == variant


def test_cpu_auto_says_the_variant_and_rounds_as_it(tmp_path):
    """This machine's flags pick a variant; reference.run says which (an info line, not a warning) and
    rounds as its target: the logits equal those of --cpu <that target>."""
    from conftest import run_cli
    from reference.ggml_cpu import VARIANT_TARGET, host_variant
    variant = host_variant()
    if variant not in VARIANT_TARGET:
        pytest.skip(f"this CPU loads the {variant} variant, which is not emulated")
    model = os.path.join(ROOT, "golden", "presets", "models", "tiny-b-q4_0.gguf")
    outs, said = {}, {}
    for cpu in ("auto", VARIANT_TARGET[variant]):
        out = tmp_path / f"{cpu}.npy"
        r = run_cli("reference.run", "-m", model, "--token-ids", "497,85,318", "-n", "1", "--numerics", "ggml-cpu",
                    "--cpu", cpu, "--logits-out", str(out))
        assert r.returncode == 0, r.stderr
        outs[cpu], said[cpu] = np.load(out), r.stderr
    line = (f"reference.run: --cpu auto: llama.cpp's portable build loads libggml-cpu-{variant}.so on this CPU, which rounds as "
            f"{VARIANT_TARGET[variant]}")
    assert line in said["auto"].splitlines() and "--cpu auto" not in said[VARIANT_TARGET[variant]]
    np.testing.assert_array_equal(outs["auto"], outs[VARIANT_TARGET[variant]])


@pytest.mark.parametrize("variant, expected", [
    ("icelake", ("--cpu icelake: llama.cpp's icelake variant: ", "without AVX512_BF16")),
    ("sapphirerapids", ("--cpu sapphirerapids: llama.cpp's sapphirerapids variant: ", "AMX buffer type")),
    # modelled for F32/F16/BF16 and Q8_0 weights: a Q4_0 matrix is refused by its type
    ("sandybridge", ("Q4_0 weights are not emulated on the sandybridge target", "AVX, SSSE3 or scalar arms")),
])
def test_unmodelled_variant_is_refused_in_one_line(variant, expected):
    from conftest import cli_error, run_cli
    model = os.path.join(ROOT, "golden", "presets", "models", "tiny-b-q4_0.gguf")
    cli_error(run_cli("reference.run", "-m", model, "--token-ids", "497", "--numerics", "ggml-cpu", "--cpu", variant),
              *expected)
