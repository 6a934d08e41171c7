"""What made an artifact: the model, how the reference computed (numerics, dtype, KV types, flash
attention, CPU target, repack, backend, threads, prefill chunk) and the software (this project's
version and commit, numpy's and numba's versions). Every artifact carries this record: reference.run's
--json and its logits' sidecar F.npy.json, golden manifests, trace index.json, perplexity's float32
base, the bench reports; tools.diff prints both sides' and names a setting that explains a difference.

    record = provenance(model_path, build, backend, prefill_chunk)   # a dict of JSON values
"""
import functools
import json
import importlib.metadata
import os
import subprocess

import numpy as np

from . import artifacts

PROJECT = "muse-glimmer-reference"  # setup.cfg's name
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDECAR = ".json"  # F.npy -> F.npy.json
# the settings that change logits beyond float noise when two sides differ in them: tools.diff names them
EXPLAINING = {"numerics": "numerics", "dtype": "dtype", "cache_type_k": "K cache type", "cache_type_v": "V cache type",
              "flash_attn": "flash attention", "cpu": "CPU target", "repack": "repack"}


def numerics_record(build, backend=None):  # factory.Build, the backend made of it -> how the reference rounds
    record = {"numerics": build.numerics, "dtype": build.dtype, "backend": build.backend}
    if build.tp != 1:
        record["tp"] = build.tp
    if build.ggml_cpu and backend is not None:
        record.update(cache_type_k=backend.k_type, cache_type_v=backend.v_type,
                      flash_attn="on" if backend.flash_attn else "off", cpu=backend.target.name,
                      repack="on" if backend.repack else "off", threads=backend.n_threads)
    return record


def numerics_summary(record):  # numerics_record -> one line for a terminal
    if record.get("numerics") != "ggml-cpu":
        return f"numerics {record.get('numerics', '?')} {record.get('dtype', '?')}, backend {record.get('backend', '?')}"
    return (f"numerics ggml-cpu ({record['cpu']}), K {record['cache_type_k']} V {record['cache_type_v']}, "
            f"flash attention {record['flash_attn']}, repack {record['repack']}, {record['threads']} threads, "
            f"backend {record['backend']}")


@functools.cache
def software_record():  # -> the project's version and commit (absent outside a git checkout), numpy's, numba's
    record = {"project": PROJECT, "version": package_version(PROJECT) or "unknown", "numpy": np.__version__}
    commit = git_commit()
    if commit:
        record["commit"] = commit
    numba = package_version("numba")
    if numba:
        record["numba"] = numba
    return record


def package_version(name):  # -> the installed distribution's version, or None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit():  # -> HEAD's hash (with "-dirty" for uncommitted changes) where the sources are a git checkout
    if not os.path.exists(os.path.join(REPO, ".git")):
        return None  # an sdist or a wheel
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def model_record(path):  # -> {"file", "sha256"} of a GGUF
    return {"file": os.path.basename(str(path)), "sha256": artifacts.cached_sha256(path)}


def provenance(model_path, build, backend=None, prefill_chunk=None, **extra):  # -> the record of an artifact
    record = {"model": model_record(model_path), **numerics_record(build, backend)}
    if prefill_chunk is not None:
        record["prefill_chunk"] = prefill_chunk
    return {**record, **extra, "software": software_record()}


def args_record(args, model_keys=("model", "mmproj")):  # parsed args of a bench -> its report's provenance
    """The models it read (file and sha256), every plain setting it ran with, the software."""
    models = [getattr(args, key, None) for key in model_keys]
    settings = {key: value for key, value in vars(args).items() if key not in (*model_keys, "model_path")
                and isinstance(value, (bool, int, float, str, list, type(None)))}
    return {"models": [model_record(m) for m in models if m and os.path.isfile(m)], **settings,
            "software": software_record()}


def sidecar(path):  # an artifact's path -> its provenance file's
    return str(path) + SIDECAR


def read_sidecar(path):  # -> the provenance record beside an artifact, or None
    try:
        with open(sidecar(path), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def settings(record):  # a provenance record or a golden manifest's header -> {EXPLAINING key: its value}
    """Golden manifests keep an engine's options under "options" (llama-cpp: kv_type or cache_type_k/v,
    flash_attn, repack, system_info); llama.cpp's CPU backend is what numerics ggml-cpu emulates."""
    from .ggml_cpu.target import target_of_system_info
    flat = {**record.get("options", {}), **record}
    out = {"numerics": "ggml-cpu" if record.get("engine") == "llama-cpp" else flat.get("numerics"),
           "dtype": flat.get("dtype"),
           "cache_type_k": flat.get("cache_type_k") or flat.get("kv_type"),
           "cache_type_v": flat.get("cache_type_v") or flat.get("kv_type"),
           "flash_attn": on_off(flat.get("flash_attn")), "repack": on_off(flat.get("repack")),
           "cpu": flat.get("cpu") or target_of_system_info(flat.get("system_info") or "")}
    return {key: value for key, value in out.items() if value is not None}


def on_off(value):  # True | "on" | False | "off" | None -> "on" | "off" | None
    return {True: "on", False: "off"}.get(value, value) if value is not None else None


def describe(record):  # -> one line: the model, the engine and the settings a record shows
    model = record.get("model") or {}
    what = [f"{model.get('file', '?')} sha256 {str(model.get('sha256', '?'))[:12]}"]
    if record.get("engine"):
        what.append(str(record.get("version") or record["engine"]))
    what += [f"{EXPLAINING[key]} {value}" for key, value in settings(record).items()]
    software = record.get("software") or record.get("provenance") or {}
    if software.get("version"):
        what.append(f"{software.get('project', PROJECT)} {software['version']} {software.get('commit', '')}".strip())
    return ", ".join(what)


def differences(a, b):  # two records -> ["flash attention on vs off", ...]: the settings that explain a difference
    sa, sb = settings(a), settings(b)
    return [f"{EXPLAINING[key]} {sa[key]} vs {sb[key]}" for key in EXPLAINING
            if key in sa and key in sb and sa[key] != sb[key]]
