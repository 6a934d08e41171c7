"""Named trace points: one f32 .npy per point plus index.json, as ARCHITECTURE.md describes.

Names follow llama.cpp's graph-callback names (`attn_norm-3`, `l_out-3`, `result_output`) so a trace
lines up one to one with a `llama-eval-callback` dump.
"""
import json
import os
import re

import numpy as np

INDEX = "index.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TraceError(Exception):
    pass


class Tracer:
    """Collects named tensors; a Tracer with no directory records nothing and costs nothing."""

    def __init__(self, directory=None, keep_in_memory=False):
        self.directory = directory
        self.keep_in_memory = keep_in_memory
        self.points = {}  # name -> f32 array (only when keep_in_memory)
        self.index = []
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    @property
    def enabled(self):
        return self.directory is not None or self.keep_in_memory

    def __call__(self, name, x):  # name: str, x: [...] -> None
        if not self.enabled:
            return
        if not _SAFE_NAME.match(name):
            raise TraceError(f"trace point name {name!r} is not a plain file name")
        a = np.ascontiguousarray(x, dtype=np.float32)
        if name in self.points or any(e["name"] == name for e in self.index):
            # A chunked prefill calls each point once per chunk: rows are appended along the token axis.
            a = np.concatenate([self._load(name), a], axis=0)
            self.index = [e for e in self.index if e["name"] != name]
        if self.keep_in_memory:
            self.points[name] = a
        if self.directory is not None:
            np.save(os.path.join(self.directory, name + ".npy"), a)
        flat = a.reshape(-1).astype(np.float64)
        self.index.append({
            "name": name, "shape": list(a.shape), "sum": float(flat.sum()),
            "sum_sq": float(np.dot(flat, flat)),
            "first": [float(v) for v in flat[:3]], "last": [float(v) for v in flat[-3:]],
        })

    def _load(self, name):
        if name in self.points:
            return self.points[name]
        return np.load(os.path.join(self.directory, name + ".npy"), allow_pickle=False)

    def close(self):
        if self.directory is not None:
            with open(os.path.join(self.directory, INDEX), "w") as f:
                json.dump(self.index, f, indent=1)


def load_trace(directory):  # directory -> {name: f32 array}, in recorded order
    path = os.path.join(directory, INDEX)
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: cannot read trace index ({e})") from None
    points = {}
    for entry in index:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _SAFE_NAME.match(name):
            raise TraceError(f"{path}: bad trace point name {name!r}")
        try:
            points[name] = np.load(os.path.join(directory, name + ".npy"), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise TraceError(f"{directory}/{name}.npy: {e}") from None
    return points
