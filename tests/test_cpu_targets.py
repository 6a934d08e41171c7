"""golden/cpu_targets/: llama.cpp built for each CPU target (tools/regen/make_cpu_target_goldens.py) on
every preset file. CI checks the committed manifests are whole and consistent, and the committed
arrays against their hashes; it needs neither the toolchains nor qemu. The live tests rerun runs
where a build root made by the tool is given (CPU_TARGET_BUILDS=DIR) and, for the ARM targets,
qemu-aarch64 is installed; they skip otherwise."""
import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDEN, ROOT
from reference.ggml_cpu import target_of_system_info
from tools import common
from tools.parity import golden
from tools.regen import make_cpu_target_goldens as cpu

TARGET_DIR = os.path.join(GOLDEN, "cpu_targets")
BUILDS = os.environ.get("CPU_TARGET_BUILDS")
# What each target's system_info line must and must not show (ggml-cpu.c ggml_cpu_has_*)
FEATURES = {
    "avx2": ({"AVX = 1", "AVX2 = 1", "FMA = 1", "F16C = 1", "BMI2 = 1", "REPACK = 1"}, {"AVX512", "AVX_VNNI", "AMX"}),
    "avx512": ({"AVX2 = 1", "AVX512 = 1", "AVX512_VBMI = 1", "AVX512_VNNI = 1", "AVX512_BF16 = 1",
                "REPACK = 1"}, {"AMX", "AVX_VNNI"}),  # AVX_VNNI: tools/regen/make_cpu_target_goldens.py AVX512_FLAGS
    "neon": ({"NEON = 1", "ARM_FMA = 1", "FP16_VA = 1", "DOTPROD = 1", "REPACK = 1"}, {"MATMUL_INT8", "SVE", "AVX"}),
    "neon-i8mm": ({"NEON = 1", "ARM_FMA = 1", "FP16_VA = 1", "DOTPROD = 1", "MATMUL_INT8 = 1", "REPACK = 1"},
                  {"SVE", "AVX"}),
}


@functools.lru_cache(maxsize=None)
def manifest(target):
    with open(os.path.join(TARGET_DIR, target, "manifest.json")) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def presets():
    with open(os.path.join(GOLDEN, "presets", "manifest.json")) as f:
        return json.load(f)


def runs_by_key(target):  # -> {(preset, repack, kv, fa): run}
    return {cpu.run_key(r): r for r in manifest(target)["runs"]}


def float_sha256(a):  # array -> sha256 of its float32 C-order bytes
    return hashlib.sha256(np.ascontiguousarray(a, "<f4").tobytes()).hexdigest()


@pytest.mark.parametrize("target", sorted(cpu.TARGETS))
def test_build_is_the_target(target):
    m = manifest(target)
    assert m["target"] == target and m["llama_cpp_commit"] == common.LLAMA_CPP_COMMIT
    assert set(cpu.COMMON_FLAGS + cpu.TARGETS[target]) <= set(m["cmake_flags"])
    shown = {f.strip() for f in m["system_info"].removeprefix("CPU :").split("|") if f.strip()}
    must, must_not = FEATURES[target]
    assert must <= shown, m["system_info"]
    assert not [f for f in shown if any(f.startswith(x) for x in must_not)], m["system_info"]
    assert m["runner"] == ("native" if target not in cpu.ARM else " ".join(cpu.QEMU))


@pytest.mark.parametrize("target", sorted(cpu.TARGETS))
def test_every_preset_and_config_is_recorded(target):
    """Every preset file x repack on/off x KV F32/F16 x flash attention on/off, of the committed
    preset files, with every prompt of the prompts file: ids, lengths, and greedy tokens that are
    the argmax rows they follow from (the first from the last prefill row, each next from a decode
    row), a consistency the driver's output must have."""
    m = manifest(target)
    prompts = {p["id"]: p["token_ids"] for p in golden.read_prompts(Path(ROOT) / m["prompts_file"])}
    assert {p["id"]: p["token_ids"] for p in m["prompts"]} == prompts
    files = {p["preset"]: p for p in presets()["presets"]}
    expected = {(p, r, kv, fa) for p in files for r in cpu.REPACK for kv, fa in cpu.CONFIGS}
    runs = runs_by_key(target)
    assert set(runs) == expected and len(m["runs"]) == len(expected)
    n_predict = m["options"]["n_predict"]
    for key, run in runs.items():
        assert run["model"] == f"golden/presets/{files[key[0]]['file']}"
        assert run["model_sha256"] == files[key[0]]["sha256"]
        assert [p["id"] for p in run["prompts"]] == list(prompts)
        for p in run["prompts"]:
            assert len(p["prefill_argmax"]) == len(prompts[p["id"]]) and len(p["decode_argmax"]) == n_predict - 1
            assert p["greedy"] == [p["prefill_argmax"][-1], *p["decode_argmax"]], (key, p["id"])
            assert all(len(p[k]) == 64 for k in ("prefill_sha256", "decode_sha256"))


@pytest.mark.parametrize("target", sorted(cpu.TARGETS))
def test_committed_arrays_are_the_hashed_logits(target):
    runs = runs_by_key(target)
    for key in cpu.ARRAY_RUNS:
        for p in runs[key]["prompts"]:
            for part in ("prefill", "decode"):
                a = np.load(os.path.join(TARGET_DIR, target, p[f"{part}_file"]), allow_pickle=False)
                assert a.dtype == np.float32 and a.shape == (len(p[f"{part}_argmax"]), 512), (key, p["id"])
                assert float_sha256(a) == p[f"{part}_sha256"], (key, p["id"], part)
                assert a.argmax(-1).tolist() == p[f"{part}_argmax"]


@pytest.mark.parametrize("target", cpu.ARM)
def test_clang_entry_is_whole(target):
    """make_cpu_target_goldens --clang reran every run with the clang build and recorded the prompts
    whose hashes or greedy tokens differ from GCC's: each names a run of the manifest, and what it
    records differs from GCC's. The clang build's system_info shows the same features but OPENMP
    (built without it, as macOS builds are); the compiler is not in it."""
    m = manifest(target)
    clang, runs = m["clang"], runs_by_key(target)
    assert clang["n_runs"] == len(runs) and clang["compiler"].startswith("Debian clang version 14")
    assert clang["system_info"] == m["system_info"].replace(" OPENMP = 1 |", "")
    assert "-DGGML_OPENMP=OFF" in clang["cmake_flags"] and target_of_system_info(clang["system_info"]) == target
    keys = set()
    for d in clang["differing"]:
        key = (d["preset"], d["repack"], d["kv_type"], d["flash_attn"])
        gcc = next(p for p in runs[key]["prompts"] if p["id"] == d["prompt"])
        assert d["differs"] and all(d[k] != gcc[k] for k in d["differs"]), (key, d["prompt"])
        keys.add(key)
    assert clang["n_runs_differing"] == len(keys)


def test_avx512_plain_buffers_are_the_native_builds():
    """The explicit-flag AVX512 build with plain buffers (repack off), F32 KV, flash attention off,
    is the build golden/presets/logits came from (llama-cpp-python's GGML_NATIVE build, AMX unused
    with plain buffers): the same float32 bytes, prefill and decode, on every preset."""
    runs = runs_by_key("avx512")
    for e in presets()["presets"]:
        run_dir = os.path.join(GOLDEN, "presets", e["logits"])
        with open(os.path.join(run_dir, "manifest.json")) as f:
            entries = {x["id"]: x for x in json.load(f)["entries"]}
        for p in runs[(e["preset"], "off", "f32", "off")]["prompts"]:
            x = entries[p["id"]]
            assert float_sha256(np.load(os.path.join(run_dir, x["file"]))) == p["prefill_sha256"], (e["preset"], p["id"])
            assert float_sha256(np.load(os.path.join(run_dir, x["greedy"]["decode_logits"]))) == p["decode_sha256"]
            assert x["greedy"]["tokens"] == p["greedy"]


def live_driver(target):  # -> the argv that runs the target's driver, or a skip saying what is missing
    if not BUILDS:
        pytest.skip("CPU_TARGET_BUILDS (the tool's --build-root) not set")
    driver = os.path.join(BUILDS, f"build-{target}", "bin", "cpu-target-logits")
    if not os.path.isfile(driver):
        pytest.skip(f"no {driver}: python -m tools.make_cpu_target_goldens --build-only --targets {target}")
    if target in cpu.ARM and not shutil.which(cpu.QEMU[0]):
        pytest.skip("qemu-aarch64 not installed")
    return cpu.runner_argv(target, Path(driver))


@pytest.mark.parametrize("target", sorted(cpu.TARGETS))
@pytest.mark.parametrize("preset", ["Q4_0", "IQ2_XXS"])
def test_live_rerun_gives_the_committed_hashes(target, preset, tmp_path):
    argv = live_driver(target)
    m = manifest(target)
    entry = next(p for p in presets()["presets"] if p["preset"] == preset)
    prompts = golden.read_prompts(Path(ROOT) / m["prompts_file"])
    info, runs = cpu.preset_runs(argv, entry, prompts, m["options"]["n_predict"], None, tmp_path / "work")
    assert info == m["system_info"]
    committed = runs_by_key(target)
    for run in runs:
        assert run["prompts"] == [{k: v for k, v in p.items() if not k.endswith("_file")}
                                  for p in committed[cpu.run_key(run)]["prompts"]], cpu.run_key(run)


def test_variants_are_their_targets_builds():
    """golden/cpu_targets/variants (tools/regen/make_variant_goldens.py): llama.cpp's portable build
    (GGML_BACKEND_DL, all variants), each variant forced by loading only its library, on every preset x
    repack x KV type x flash attention x prompt. Each one's hashes are, line for line, those of the
    target it is compared with: haswell's the avx2 build's, zen4's the avx512 build's, skylakex's too
    (its BF16 arithmetic, absent from the presets, is not). The variants below AVX2 are targets of their
    own, their runs golden/cpu_targets/<variant> (checked by tests/test_cpu_target_numerics.py). The
    load line shows the variant loaded."""
    from reference.ggml_cpu.target import VARIANT_TARGET, X86_VARIANTS
    from tools.regen.make_variant_goldens import COMPARED, OWN_TARGETS, run_lines, runs_sha256
    with open(os.path.join(TARGET_DIR, "variants", "manifest.json")) as f:
        m = json.load(f)
    assert m["llama_cpp_commit"] == common.LLAMA_CPP_COMMIT and "-DGGML_CPU_ALL_VARIANTS=ON" in m["cmake_flags"]
    assert {"haswell", "zen4", *OWN_TARGETS} <= set(m["variants"])
    for variant, e in m["variants"].items():
        target = COMPARED[variant]
        assert e["compared_with"] == target and VARIANT_TARGET.get(variant, target) == target
        assert e["features"] == list(X86_VARIANTS[variant])
        assert e["load_line"].endswith(f"/libggml-cpu-{variant}.so") and "loaded CPU backend" in e["load_line"]
        # x64 shows no x86 feature: only its load line tells it
        assert target_of_system_info(e["system_info"]) == (None if variant == "x64" else target), variant
        if variant in OWN_TARGETS:
            own = manifest(variant)
            assert (own["target"], own["load_line"], own["system_info"]) == (variant, e["load_line"], e["system_info"])
            assert {r["repack"] for r in own["runs"]} == {"off"}
        runs = [r for r in manifest(target)["runs"] if r["preset"] in e.get("presets", [r["preset"]])]
        assert e["runs"] == len(runs) and e["identical_to_target"] == e["prompt_records"] == len(run_lines(runs))
        assert e["runs_sha256"] == runs_sha256(runs), variant
