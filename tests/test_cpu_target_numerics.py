"""--numerics ggml-cpu for each CPU target against that target's own llama.cpp build
(golden/cpu_targets/<target>/manifest.json: per preset x repack x KV type x flash attention x prompt,
the sha256 of the float32 prefill logits [n_tokens, n_vocab] and of the decode-step logits fed
llama.cpp's own greedy tokens). Bit-exact or not at all: the sha256 of our float32 logits must be
llama.cpp's. CI runs a derived subset of presets (CPU_TARGET_FULL=1: every run of the manifest)."""
import hashlib
import json
import os
import warnings

import numpy as np
import pytest

from conftest import IN_CI, require
from reference import gguf
from reference.ggml_cpu import UBATCH, GgmlCpuBackend
from reference.text import TextModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "golden", "cpu_targets")
PROMPTS = os.path.join(ROOT, "golden", "prompts", "text-short.jsonl")
FULL = os.environ.get("CPU_TARGET_FULL") == "1"
SUBSET = ("Q4_K_M", "Q2_K", "IQ4_NL", "Q6_K")  # repacked on avx2 (Q4_K, IQ4_NL) and not (Q2_K), tiled (Q6_K)


def manifest(target):  # -> the target's manifest; a skip only where the goldens are absent outside CI
    path = os.path.join(GOLDEN, target, "manifest.json")
    if not os.path.exists(path) and not IN_CI:
        pytest.skip(f"{path} absent (the cpu_targets goldens are committed by the tool that makes them)")
    with open(path) as f:
        return json.load(f)


def sha256(a):  # float32 array -> hex digest of its C-order bytes
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


def check_run(run, target, backend_class=GgmlCpuBackend):  # manifest run -> [(prompt id, prefill ok, decode ok)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gguf.load(os.path.join(ROOT, run["model"]), "text")
    backend = backend_class(run["kv_type"], flash_attn=run["flash_attn"] == "on", check_host=False,
                            repack=run["repack"] == "on", cpu=target)
    lm = TextModel(model, backend=backend)
    with open(PROMPTS) as f:
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
    failed = []
    for run in manifest(target)["runs"]:
        if not FULL and run["preset"] not in SUBSET:
            continue
        for prompt, prefill_ok, decode_ok in check_run(run, target, backend_class):
            if not (prefill_ok and decode_ok):
                failed.append(f"{run['preset']} repack {run['repack']} kv {run['kv_type']} fa {run['flash_attn']} "
                              f"{prompt}: prefill {'ok' if prefill_ok else 'DIFF'}, decode {'ok' if decode_ok else 'DIFF'}")
    return failed


@pytest.mark.parametrize("target", ["avx2", "avx512"])
def test_target_bit_identical_to_its_llama_cpp(target):
    failed = failures(target)
    assert not failed, "\n".join(failed)


def test_numba_twin_of_avx2_bit_identical_to_its_llama_cpp():  # the twins take the target too
    require("numba")
    from accel.numba.ggml import GgmlCpuNumbaBackend
    failed = failures("avx2", GgmlCpuNumbaBackend)
    assert not failed, "\n".join(failed)
