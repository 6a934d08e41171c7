"""Named trace points: one f32 .npy per point plus index.json, as docs/architecture.md describes.

Names follow llama.cpp's graph-callback names (`attn_norm-3`, `l_out-3`, `result_output`) so a trace
lines up one to one with a `llama-eval-callback` dump. The text forward (reference/text.py, and the
device forward of accel/cupy/text.py) and the DFlash drafter name their points from the tables
below through `point`, so that a name cannot drift between them.
"""
import math
import os
import re
import tokenize

import numpy as np

from . import artifacts

INDEX = "index.json"
PROVENANCE = "provenance.json"  # beside the index: what made the trace (reference.provenance)


def is_index(value):  # -> whether a JSON value is a trace index as Tracer.close writes it
    return isinstance(value, list) and all(isinstance(e, dict) and "name" in e and "shape" in e for e in value)


OURS = {INDEX: artifacts.json_marker(is_index, "trace index")}  # a directory with this is a trace (check_output_dir)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


# The per-layer points of the text model, in llama.cpp's graph order (src/models/muse-glimmer.cpp);
# the *_rope points exist on sliding-window layers only. The graph's other points have no layer:
TEXT_POINTS = ("attn_norm", "Qcur", "Kcur", "Vcur", "attn_gate_proj", "Qcur_normed", "Kcur_normed",
               "Qcur_rope", "Kcur_rope", "attn_out", "attn_gate_sig", "attn_gated", "attn_o_proj",
               "attn_post_norm", "ffn_inp", "ffn_norm", "ffn_out", "ffn_post_norm", "l_out")
TEXT_MODEL_POINTS = ("embd_norm", "result_norm", "result_output")
# The DFlash drafter's (llama.cpp's dflash graph); its FFN is the text model's, so are those names.
DFLASH_POINTS = ("Kcur_injected", "Vcur_injected", "noise_norm", "Qcur", "Kcur", "Vcur", "ffn_inp",
                 "ffn_norm", "ffn_out", "l_out")
LAYER_POINTS = frozenset(TEXT_POINTS + DFLASH_POINTS)


class TraceError(Exception):
    pass


def point(op, il):  # "attn_norm", 3 -> "attn_norm-3": a per-layer point of the tables above
    if op not in LAYER_POINTS:
        raise TraceError(f"{op!r} is not a per-layer trace point of the text model or the drafter")
    return f"{op}-{il}"


def layer_input(il):  # -> the text point holding the residual entering layer il (il = n_layer: the last output)
    return "embd_norm" if il == 0 else point("l_out", il - 1)


def layer_range(n_layer, progress=None):  # -> the layer ids, through the caller's progress wrapper (e.g. tqdm)
    return progress(range(n_layer)) if progress else range(n_layer)


def check_npy_header(f, size):  # .npy stream at its start, its length in bytes -> None, or ValueError
    """np.load allocates the whole array its header describes before reading the data: a corrupt
    header claiming 7e10 rows is a MemoryError of terabytes. The data cannot be larger than the
    file, so a claim beyond it is refused before anything is allocated, and so is one beyond the
    memory this process can still have (a sparse file holds any size it claims). Shared by every
    .npy reader of the project's tools (traces here, logits and top-k goldens in tools.diff)."""
    version = np.lib.format.read_magic(f)
    # format 3.0 differs from 2.0 only in the text encoding of field names, not in the layout
    read_header = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
    try:
        shape, _, dtype = read_header(f)
    except tokenize.TokenError as e:  # numpy's header parser lets this one through, not as a ValueError
        raise ValueError(f"corrupt .npy header ({e})") from None
    if dtype.hasobject:
        return  # np.load(allow_pickle=False) refuses it with its own message before reading any data
    data = size - f.tell()
    claimed = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or claimed > data:
        raise ValueError(f"header claims shape {list(shape)} of {dtype} ({claimed} bytes), "
                         f"the file holds {data} bytes of data")
    artifacts.check_allocation(claimed, f"header claims shape {list(shape)} of {dtype}", ValueError)


def load_npy(path):  # .npy file -> array; OSError, or ValueError for anything but a plain array that fits the file
    with artifacts.open_regular(path, ValueError, what=".npy array") as f:
        check_npy_header(f, os.fstat(f.fileno()).st_size)
        f.seek(0)
        return np.load(f, allow_pickle=False)


class Tracer:
    """Collects named tensors; a Tracer with no directory records nothing and costs nothing. The
    directory is built beside its name (reference.artifacts.staged_dir) and replaces an older trace
    there only at close(): an interrupted run leaves the older trace whole, never its index beside
    new arrays. `parent`: a Tracer whose directory this one is a subdirectory of (an image's trace
    inside the text trace), written in place and made whole by the parent's close()."""

    def __init__(self, directory=None, keep_in_memory=False, parent=None):
        self.keep_in_memory = keep_in_memory
        self.points = {}  # name -> f32 array (only when keep_in_memory)
        self.index = []
        self.provenance = None  # a reference.provenance record, written beside the index at close()
        self.stage = None
        if directory is not None and parent is not None:
            directory = os.path.join(parent.directory, directory)
            os.makedirs(directory)
        elif directory is not None:
            artifacts.check_output_dir(directory, "trace", OURS, TraceError)
            self.stage = artifacts.staged_dir(directory, TraceError)
            directory = self.stage.__enter__()
        self.directory = directory

    @property
    def enabled(self):
        return self.directory is not None or self.keep_in_memory

    def wants(self, name):  # -> whether __call__(name, ...) records anything (a device copies to the host only then)
        return self.enabled

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
            path = os.path.join(self.directory, name + ".npy")
            try:  # inside a directory not yet in place: a file cut short here is never seen under the trace's name
                np.save(path, a)
            except OSError as e:
                raise artifacts.write_failed(path, e, TraceError) from None
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

    def close(self):  # -> None: the index written and the directory in place under its name
        if self.directory is not None:
            artifacts.write_json(os.path.join(self.directory, INDEX), self.index, TraceError)
            if self.provenance is not None:
                artifacts.write_json(os.path.join(self.directory, PROVENANCE), self.provenance, TraceError)
        if self.stage is not None:
            stage, self.stage = self.stage, None
            stage.__exit__(None, None, None)

    def discard(self):  # -> None: a trace left unfinished (the run failed) goes, an older one stays
        if self.stage is not None:
            stage, self.stage = self.stage, None
            stage.__exit__(TraceError, TraceError("discarded"), None)


NO_TRACE = Tracer()


class Capture:
    """A trace that keeps the latest tensor of each of `names` as computed (no copy, no float32
    cast) and passes every point on to `inner`: how the DFlash drafter reads its target's layer
    inputs. A chunked forward replaces the tensors chunk by chunk."""
    enabled = True

    def __init__(self, names, inner=NO_TRACE):
        self.names, self.inner = frozenset(names), inner
        self.points = {}  # name -> the last tensor traced under it

    def wants(self, name):
        return name in self.names or self.inner.wants(name)

    def __call__(self, name, x):  # name: str, x: [...] -> None
        if name in self.names:
            self.points[name] = x
        self.inner(name, x)


def load_trace(directory):  # directory -> {name: f32 array}, in recorded order
    path = os.path.join(directory, INDEX)
    index = artifacts.read_json(path, TraceError, what="trace index")
    if not isinstance(index, list):
        raise TraceError(f"{path}: a trace index is a JSON list of trace points, not {type(index).__name__}")
    points = {}
    for entry in index:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _SAFE_NAME.match(name):
            raise TraceError(f"{path}: bad trace point name {name!r}")
        try:
            a = load_npy(os.path.join(directory, name + ".npy"))
        except (OSError, ValueError) as e:
            raise TraceError(f"{directory}/{name}.npy: {e}") from None
        # Tracer records every point's shape and writes float32: a file replaced or cut since then
        # would otherwise be compared as if it were the traced tensor
        if entry.get("shape") != list(a.shape):
            raise TraceError(f"{directory}/{name}.npy: holds shape {list(a.shape)}, {INDEX} records "
                             f"{entry.get('shape')!r}")
        if a.dtype.kind != "f":
            raise TraceError(f"{directory}/{name}.npy: dtype {a.dtype} is not a float tensor")
        points[name] = a
    return points
