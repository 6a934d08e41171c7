"""Line two traces up by name and find the first trace point where they diverge.

    python -m tools.bisect A B [--threshold T | --noise-floor A64] [--table OUT.txt] [--plot OUT.png] [--json OUT.json]
                               [--reproduce --model M.gguf [--cpu TARGET]]

Run it as a module from the repository root (a plain `python tools/parity/bisect.py` would shadow the
standard library's `bisect`). A and B are each one of (readers in tools/parity/dump_parse.py):
- a trace directory of this reference (index.json plus one .npy per point, `python -m reference.run
  --trace DIR`), or of transformers written by `python -m tools.hf_trace` (same format);
- a directory of transformers' `model_addition_debugger_context(model, debug_path=DIR,
  do_prune_layers=False, use_repr=False)` (its *_debug_tree_FULL_TENSORS.json and safetensors
  files), or that JSON file: 14 points per layer plus embd_norm, result_norm and result_output
  (tools/parity/hf_names.py, HF_DEBUGGER_POINTS, says which module call each comes from and which points
  it cannot hold); a pruned tree or one of printed tensors (the defaults) is refused;
- a raw float32 .bin of llama.cpp's examples/model-conversion (`llama-debug --save-logits`): the
  last token's logits (result_output), or with `--embedding --embd-normalize -1` every token's
  result_norm (X-embeddings.bin); it holds one point, so it tells whether, not where;
- a text dump of llama.cpp's `llama-eval-callback` / `llama-debug --verbose`.
Points are taken in A's order
(the forward order: embd_norm, then per layer attn_norm ... l_out, then result_norm, result_output);
points only one side has are listed, not compared, except a layer point whose op the other side
records on other layers only (`Qcur_rope-0` where the other side ropes layers 1-3): that is a
difference of structure (RoPE or the layer type on the wrong layers) and counts as a divergence.

Per point the error is NMSE = sum((a-b)^2) / sum(a^2) in float64 (llama.cpp test-backend-ops), A as
the reference. Full tensors are compared whole. A dump holds only the first and last 3 entries of
each dimension, printed to 4 decimals, plus the float32 sum: there the NMSE covers the printed
entries, and each difference is first reduced by the print rounding (5e-5 per dumped side), so
printing alone never counts as error (and an error smaller than that is invisible: about NMSE 1e-9
for activations of unit size). The sums guard the entries not printed: they disagree when their
difference exceeds the worst-case rounding of a float32 running sum, (n-1) * 2^-24 * sum|x|, plus
the most an error within the threshold can move a sum, sqrt(n * threshold) * ||a||.
When the two sides hold different numbers of tokens (llama.cpp keeps only the output rows after the
last layer's attention), the last rows of both are compared. Any other difference of shape (another
row length, no tokens on one side) is a difference of structure and counts as a divergence, as a
point recorded on the wrong layers does.

Threshold (a point diverges when its NMSE is above it, or its sums disagree):
  --noise-floor A64   per point, 64 * NMSE(A64, A) (and never below 64 * 2^-48, one float32
                      rounding), where A64 is the float64 trace of the run that made A. 64 = 8^2:
                      the tolerated RMS error is 8 times the float32 noise of A: 2 because B carries
                      its own independent rounding, 4 more for engines that sum float32 blockwise or
                      sequentially where NumPy sums pairwise. A64 is refused when a point's shape
                      differs from A's, or when the median NMSE(A64, A) over the points is above
                      1e-2 (float32 rounding stays decades below it: that is a run of another
                      prompt or model);
  --threshold T       T for every point;
  neither             1e-9, for two runs of this reference (backends, chunking, ring vs uniform
                      cache): float32 math that differs only in summation order sits far below it,
                      and it is still 100x under test-backend-ops' 1e-7 per-op tolerance. Compare
                      another engine with --threshold (e.g. 5e-4 for quantized matmuls) or --noise-floor.

llama.cpp's configuration. A text dump shows how llama.cpp was set up: the CPU build (its
system_info line: avx2, avx512, neon or neon-i8mm; a clang build of an ARM target shows the same line,
and is --cpu neon-clang or neon-i8mm-clang), the cache types (the type of the cache_k_l* /
cache_v_l* nodes), flash attention (FLASH_ATTN_EXT nodes) and the ubatches (the passes). The exact
reference rounds as float32 math, as llama.cpp does with `-ctk f32 -ctv f32 -fa off`; an F16 or
Q8_0 cache or flash attention rounds otherwise from the first attention output on
(`llama-eval-callback` with its defaults: F16 cache, flash attention on this CPU, attn_out-0 at NMSE
~2e-7). bisect prints the configuration and the `reference.run --numerics ggml-cpu` command that
rounds the same, with --cpu the target the system_info line shows (where the dump logs none, or
shows another CPU, the default avx512, and a line says so; --cpu TARGET chooses). With --reproduce
it runs that command (--model: the dump's GGUF; the token ids are the ones the dump logs) and
bisects the dump against it under the same threshold: when that agrees, the difference from the
exact reference is reported as explained by the configuration (exit 0); otherwise its first
divergence is the one named. A divergence before the first attention output is never put down to
the configuration.

Exit status: 0 no point above threshold (or every difference explained by the dump's configuration),
1 a divergence was found (printed as "first divergence: <name> (layer L, op OP) nmse=...", layer "-"
for points outside the layers), 2 bad input.
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from reference import artifacts, metrics
from reference.cli import OneLineParser, UsageError, add_json_out, check_output, fail, flag, float_in
from reference.ggml_cpu import CPU_CHOICES
from reference.trace import INDEX, TraceError, load_trace

from tools.common import check_plot, pyplot, save_figure, write_text
from tools.parity.dump_parse import (DEBUG_TREE, DumpError, PartialTensor, debug_tree_path, emulated_target, load_dump,
                                     load_hf_debugger, load_logits_bin, token_axis)

EXACT_THRESHOLD = 1e-9
NOISE_FACTOR = 8  # tolerated RMS error over the float32 noise of A; squared for NMSE (module doc)
F32_ROUNDING_NMSE = 2.0 ** -48  # (2^-24)^2: one float32 rounding of every element
NOISE_FLOOR_LIMIT = 1e-2  # median NMSE(A64, A) above it: A64 is not the float64 run of A (module doc)
PRINT_SLACK = 0.5e-4  # a dumped value is printed with %12.4f
SUM_PRINT_SLACK = 0.5e-6  # the sum with %f
NONFINITE = re.compile(r"\b(NaN|Inf) in [AB] \(")  # the note nonfinite() writes
LAYER_NAME = re.compile(r"^(?P<op>.+?)-(?P<layer>\d+)(?P<view>( \(\w+\))*)$")  # "Qcur-0 (view) (permuted)"


def load_source(path, other=None):  # source path, the other side's {name: tensor} -> (trace, [notes], config)
    """A trace directory, a transformers debugger tree, a model-conversion .bin or a llama.cpp text
    dump. `other` (the other side, loaded first) tells a dump's warm-up pass apart and gives a .bin
    its row length. config: the LlamaConfig of a llama.cpp text dump, None otherwise."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or directory")
    try:
        if debug_tree_path(path) and not os.path.exists(os.path.join(path, INDEX)):
            return load_hf_debugger(path)
        if os.path.isdir(path):
            if not os.path.exists(os.path.join(path, INDEX)):
                raise UsageError(f"{path}: a trace directory needs {INDEX} (or one transformers debugger "
                                 f"tree *{DEBUG_TREE})")
            return load_trace(path), [], None
        if path.endswith(".bin"):
            return load_logits_bin(path, other)
        return load_dump(path, tokens_of(other) if other else None)
    except (TraceError, DumpError) as e:
        raise UsageError(str(e)) from None


def needs_other(path):  # -> True for a source read against the other side (a text dump or a .bin)
    return os.path.isfile(path) and not debug_tree_path(path)


def load_pair(path_a, path_b):  # -> ((trace, notes, config) of A, same of B)
    """The side that stands alone is read first, so that a dump or .bin can be read against it."""
    if needs_other(path_a) and not needs_other(path_b):
        b = load_source(path_b)
        return load_source(path_a, b[0]), b
    a = load_source(path_a)
    return a, load_source(path_b, a[0])


def layer_and_op(name):  # "attn_post_norm-2" -> (2, "attn_post_norm"); "result_norm" -> (None, "result_norm")
    m = LAYER_NAME.match(name)
    return (int(m["layer"]), m["op"] + m["view"]) if m else (None, name)


def row_length(t):  # array | PartialTensor -> elements per token (tokens are the slowest axis)
    if isinstance(t, np.ndarray):
        return int(np.prod(t.shape[1:])) if t.ndim > 1 else t.size
    return int(np.prod(t.ne[:token_axis([t.ne])]))


def n_rows(t, row_len):  # array | PartialTensor, elements per token -> number of tokens, or None
    """A dump's ne does not say which axis counts tokens when it is 1 ({D, H, 1}): any split of ne
    whose inner part holds row_len elements will do."""
    if isinstance(t, np.ndarray):
        return (t.shape[0] if t.ndim > 1 else 1) if row_length(t) == row_len else None
    inner = [int(np.prod(t.ne[:k])) for k in (1, 2, 3, 4)]
    return t.size // row_len if row_len in inner else None


def describe(t):  # array | PartialTensor -> its shape as text
    return str(list(t.shape)) if isinstance(t, np.ndarray) else f"ne {list(t.ne)}"


def printed(t, offset, count):  # PartialTensor, first flat index kept, how many -> (index, values) re-based
    keep = (t.index >= offset) & (t.index < offset + count)
    return t.index[keep] - offset, t.values[keep]


def shrink_toward(ref, x, slack):  # [k], [k] -> [k]: x moved toward ref by up to slack
    return ref + np.sign(x - ref) * np.maximum(np.abs(x - ref) - slack, 0.0)


def sums_agree(a, b, start_a, start_b, threshold):  # -> True/False, or None when no sum can be compared
    """Can the two sums come from tensors within `threshold` NMSE of each other? A dump's sum covers
    its whole tensor, so it counts only when none of its rows was cut. Allowed difference: per dumped
    side the worst-case rounding of a float32 running sum, (n-1) 2^-24 sum|x|, plus the %f print
    rounding; plus the most an error of NMSE `threshold` can move a sum, sqrt(n threshold) ||a||."""
    sides = [(a, start_a), (b, start_b)]
    if any(isinstance(t, PartialTensor) and (t.sum is None or start) for t, start in sides):
        return None
    full = [t.reshape(-1)[start:].astype(np.float64) for t, start in sides if isinstance(t, np.ndarray)]
    dumps = [t for t in (a, b) if isinstance(t, PartialTensor)]
    n = dumps[0].size
    # sum|x| and ||x|| are exact from a full side; with two dumps the printed values estimate them
    shown = full[0] if full else dumps[0].values
    l1, l2 = n * np.mean(np.abs(shown)), np.sqrt(n * np.mean(shown ** 2))
    totals = [float(x.sum()) for x in full] + [t.sum for t in dumps]
    tolerance = len(dumps) * ((n - 1) * 2.0 ** -24 * l1 + SUM_PRINT_SLACK) + np.sqrt(n * threshold) * l2
    return bool(abs(totals[0] - totals[1]) <= tolerance) and squares_agree(full, dumps, l2 ** 2, threshold) is not False


def squares_agree(full, dumps, l2_squared, threshold):  # -> True/False, or None where no dump prints sum_sq
    """The second check, where a dump prints sum_sq (newer llama.cpp debug tools): a float32 running sum
    of n squares is off by at most (n-1) 2^-24 of it, plus the %f print; and tensors within NMSE t
    differ in sum of squares by at most ||a||^2 (2 sqrt(t) + t) (|  |a|^2 - |b|^2 | <= |a-b| (|a| + |b|))."""
    squares = [float(np.dot(x, x)) for x in full] + [t.sum_sq for t in dumps]
    if None in squares:
        return None
    n = dumps[0].size
    tolerance = len(dumps) * ((n - 1) * 2.0 ** -24 * l2_squared + SUM_PRINT_SLACK) \
        + l2_squared * (2 * np.sqrt(threshold) + threshold)
    return bool(abs(squares[0] - squares[1]) <= tolerance)


MAX_DUMP_TOKENS = 1 << 20  # tokens one dumped tensor may hold: tools.golden's bound on any context


def check_claimed_shape(name, a, b, sources=("A", "B")):  # -> None; UsageError when a dump's ne cannot be the traced tensor's
    """A dump's header states its tensor's shape (ne) and the printed values are placed by it, so a
    lying ne would be compared as if it were the model's tensor: against a trace (the model's own
    shapes) it must hold the same elements per token, and no more tokens than any run holds. An
    input error naming the point, never a divergence."""
    dumps, full = [t for t in (a, b) if isinstance(t, PartialTensor)], [t for t in (a, b) if isinstance(t, np.ndarray)]
    if len(dumps) != 1 or not full:
        return
    rows = n_rows(dumps[0], row_length(full[0]))
    if rows is None or rows > MAX_DUMP_TOKENS:
        source = sources[0] if isinstance(a, PartialTensor) else sources[1]
        raise UsageError(f"{source}: {name} claims ne {list(dumps[0].ne)}, which cannot be the model's {name} "
                         f"{list(full[0].shape)} ({row_length(full[0])} elements a token, at most "
                         f"{MAX_DUMP_TOKENS} tokens): a corrupt dump or another model")


def compare_point(a, b, threshold=0.0):  # a (reference), b: array | PartialTensor -> dict
    """{nmse, n, size, sum_ok, shape_ok, note}. shape_ok is False when the two cannot be the same
    tensor: another row length, or tokens on one side only (a different number of tokens is fine:
    the last rows are compared)."""
    full_a, full_b = isinstance(a, np.ndarray), isinstance(b, np.ndarray)
    row_len = row_length(a if full_a or not full_b else b)
    rows_a, rows_b = n_rows(a, row_len), n_rows(b, row_len)
    if rows_a is None or rows_b is None or (rows_a == 0) != (rows_b == 0):
        note = f"shapes differ: {describe(a)} vs {describe(b)}"
        return {"nmse": None, "n": 0, "size": 0, "sum_ok": None, "shape_ok": False, "note": note}
    rows = min(rows_a, rows_b)
    count, start_a, start_b = rows * row_len, (rows_a - rows) * row_len, (rows_b - rows) * row_len
    note = f"last {rows} of {rows_a} vs {rows_b} tokens" if rows_a != rows_b else ""
    if count == 0:
        return {"nmse": None, "n": 0, "size": 0, "sum_ok": None, "shape_ok": True, "note": note or "empty"}
    if full_a and full_b:
        va, vb = a.reshape(-1)[start_a:], b.reshape(-1)[start_b:]
        return {"nmse": float(metrics.nmse(va, vb)), "n": count, "size": count, "sum_ok": None, "shape_ok": True,
                "note": nonfinite(va, vb) or note}
    if full_a:
        index, vb = printed(b, start_b, count)
        va = a.reshape(-1)[start_a + index]
    elif full_b:
        index, va = printed(a, start_a, count)
        vb = b.reshape(-1)[start_b + index]
    else:
        index_a, va = printed(a, start_a, count)
        index_b, vb = printed(b, start_b, count)
        index, in_a, in_b = np.intersect1d(index_a, index_b, return_indices=True)
        va, vb = va[in_a], vb[in_b]
    # printing rounds each dumped value by up to PRINT_SLACK: only the difference beyond it is error
    va, vb = va.astype(np.float64), vb.astype(np.float64)
    vb = shrink_toward(va, vb, PRINT_SLACK * ((not full_a) + (not full_b)))
    return {"nmse": float(metrics.nmse(va, vb)) if index.size else None, "n": int(index.size), "size": count,
            "sum_ok": sums_agree(a, b, start_a, start_b, threshold), "shape_ok": True, "note": nonfinite(va, vb) or note}


def nonfinite(va, vb):  # compared values of A and B -> "NaN in B (3 values)"-like kinds, or ""
    kinds = [f"{kind} in {side} ({int(count)} values)" for side, v in (("A", va), ("B", vb))
             for kind, count in (("NaN", np.isnan(v).sum()), ("Inf", np.isinf(v).sum())) if count]
    return ", ".join(kinds)


def noise_thresholds(trace_a, trace_a64, source="noise floor"):  # {name: f32}, {name: f64} -> {name: threshold}
    """Raises UsageError when trace_a64 cannot be the float64 run of A (module doc): thresholds taken
    from another prompt's run would be ~1e2 and hide every divergence."""
    floors = {}
    for name in (n for n in trace_a if n in trace_a64):
        c = compare_point(trace_a64[name], trace_a[name])
        if not c["shape_ok"]:
            raise UsageError(f"{source}: point {name} {c['note']} (noise floor vs A): not the float64 run of A")
        if c["nmse"] is not None:
            floors[name] = c["nmse"]
    median = float(np.median(list(floors.values()))) if floors else 0.0
    if not median <= NOISE_FLOOR_LIMIT:  # "not <=": a NaN floor is refused too
        raise UsageError(f"{source}: median NMSE against A is {median:.3g} over {len(floors)} points, above "
                       f"{NOISE_FLOOR_LIMIT:g}: not the float64 run of A (another prompt or model?)")
    return {name: NOISE_FACTOR ** 2 * max(floor, F32_ROUNDING_NMSE) for name, floor in floors.items()}


def merged_order(names_a, names_b):  # -> all names: A's order, each B-only name after the one it follows in B
    in_a, followers, last = set(names_a), {}, None
    for name in names_b:
        if name in in_a:
            last = name
        else:
            followers.setdefault(last, []).append(name)
    order = list(followers.get(None, []))
    for name in names_a:
        order += [name] + followers.get(name, [])
    return order


def layered_ops(trace):  # {name: tensor} -> ops that the source records inside layers
    return {op for layer, op in map(layer_and_op, trace) if layer is not None}


def one_sided_point(name, side, other_ops):  # point only one side has -> structural divergence, or None
    """A layer point that one side records while the other records the same op only on other
    layers is a difference of structure, not of numbers: RoPE on a layer the other side treats as
    NoPE, or missing on one it ropes. Ops the other side never records (llama.cpp's kq-0, views)
    are just not comparable."""
    layer, op = layer_and_op(name)
    if layer is None or op not in other_ops:
        return None
    other = "B" if side == "A" else "A"
    return {"name": name, "layer": layer, "op": op, "threshold": float("nan"), "diverged": True, "nmse": None,
            "n": 0, "size": 0, "sum_ok": None, "shape_ok": True, "only_in": side,
            "note": f"only in {side}: {other} records {op} on other layers, not on layer {layer}"}


def lost_points(whole, cut):  # {name: tensor} of a whole side, of a side whose tail was lost -> names it lost
    """The whole side's points that the cut side lacks on the layer it stopped in and after it (the
    two graphs order a layer's ops differently), and the output points after the last layer."""
    layers = [layer_and_op(name)[0] for name in whole]
    reached = max((layer for layer, _ in map(layer_and_op, cut) if layer is not None), default=-1)
    last_layered = max((i for i, layer in enumerate(layers) if layer is not None), default=len(layers))
    return [name for i, (name, layer) in enumerate(zip(whole, layers)) if name not in cut
            and (layer >= reached if layer is not None else i > last_layered)]


def bisect(trace_a, trace_b, threshold=EXACT_THRESHOLD, sources=("A", "B"), lost=()):  # {name: tensor} x2 -> result
    """`sources`: the two sides' names for messages (a dump whose ne is not the model's is refused by
    its name, check_claimed_shape). Compares the common points in A's order; `first` is the first
    point above its threshold, or the first structural difference (one_sided_point), whichever
    comes first in forward order. `lost`: points one side lost with a dump's tail, missing and never
    a divergence."""
    points, first = [], None
    ops_a, ops_b = layered_ops(trace_a), layered_ops(trace_b)
    for name in merged_order(list(trace_a), list(trace_b)):
        if name in lost:
            continue
        if name not in trace_b or name not in trace_a:
            point = one_sided_point(name, "A", ops_b) if name in trace_a else one_sided_point(name, "B", ops_a)
            if point is None:
                continue
        else:
            limit = threshold.get(name) if isinstance(threshold, dict) else threshold
            if limit is None:
                raise UsageError(f"no noise floor for trace point {name}")
            layer, op = layer_and_op(name)
            check_claimed_shape(name, trace_a[name], trace_b[name], sources)
            c = compare_point(trace_a[name], trace_b[name], limit)
            # written as "not <=" so that a NaN counts as diverged; a shape that cannot be A's is structure
            diverged = not c["shape_ok"] or (c["nmse"] is not None and not c["nmse"] <= limit) or c["sum_ok"] is False \
                or NONFINITE.search(c["note"]) is not None
            point = {"name": name, "layer": layer, "op": op, "threshold": limit, "diverged": diverged,
                     "only_in": None, **c}
        points.append(point)
        if point["diverged"] and first is None:
            first = point
    return {"points": points, "first": first, "only_in_a": [n for n in trace_a if n not in trace_b],
            "only_in_b": [n for n in trace_b if n not in trace_a]}


def first_line(result):  # -> the one-line verdict
    f = result["first"]
    if f is None:
        return f"no divergence above threshold ({sum(p['nmse'] is not None for p in result['points'])} points compared)"
    where = f"layer {'-' if f['layer'] is None else f['layer']}, op {f['op']}"
    if f["only_in"] or not f["shape_ok"]:
        return f"first divergence: {f['name']} ({where}) {f['note']}"
    nmse = "n/a" if f["nmse"] is None else f"{f['nmse']:.3e}"
    if NONFINITE.search(f["note"]):
        return f"first divergence: {f['name']} ({where}) {f['note']}"
    why = " (sum check failed)" if f["sum_ok"] is False else ""
    return f"first divergence: {f['name']} ({where}) nmse={nmse} threshold={f['threshold']:.3e}{why}"


def layer_grid(result):  # -> (row labels, op columns, {(row, op): point})
    cells = {("-" if p["layer"] is None else str(p["layer"]), p["op"]): p for p in result["points"]}
    rows = list(dict.fromkeys(row for row, _ in cells))
    # an op that only some layers have (RoPE on sliding-window layers) goes after the op it follows there
    ops, at = [], -1
    for p in result["points"]:
        if p["op"] not in ops:
            ops.insert(at + 1, p["op"])
        at = ops.index(p["op"])
    return rows, ops, cells


def cell_text(p):  # point -> "1.2e-07*"
    if p is not None and p["only_in"]:
        return f"{p['only_in']} only"
    if p is not None and not p["shape_ok"]:
        return "shape"
    if p is None or p["nmse"] is None:
        return "."
    return f"{p['nmse']:.1e}" + ("!" if p["sum_ok"] is False else "*" if p["diverged"] else "")


def format_table(result, rule):  # -> the layers x ops grid and the per-point list
    rows, ops, cells = layer_grid(result)
    width = {op: max(len(op), 9) for op in ops}
    lines = ["NMSE = sum((a-b)^2) / sum(a^2), float64, A as reference (llama.cpp test-backend-ops)",
             f"threshold: {rule}",
             "* above threshold, ! sums disagree, A/B only: recorded by one side only (structure), "
             "shape: shapes differ (structure), . not compared", "",
             "layer " + " ".join(f"{op:>{width[op]}}" for op in ops)]
    for row in rows:
        lines.append(f"{row:>5} " + " ".join(f"{cell_text(cells.get((row, op))):>{width[op]}}" for op in ops))
    lines += ["", f"{'point':<24} {'nmse':>10} {'threshold':>10} {'compared':>12} {'sums':>6}  note"]
    for p in result["points"]:
        nmse = "n/a" if p["nmse"] is None else f"{p['nmse']:.3e}"
        sums = {None: "-", True: "ok", False: "DIFF"}[p["sum_ok"]]
        lines.append(f"{p['name']:<24} {nmse:>10} {p['threshold']:>10.2e} {p['n']:>5}/{p['size']:<6} {sums:>6}  "
                     f"{'DIVERGED ' if p['diverged'] else ''}{p['note']}")
    return "\n".join(lines)


def format_summary(result, rule, notes):  # -> what goes to stdout
    lines = [f"threshold: {rule}"] + notes
    for side in ("only_in_a", "only_in_b"):
        if result[side]:
            lines.append(f"{len(result[side])} points {side.replace('_', ' ')}: {', '.join(result[side][:6])}"
                         + (" ..." if len(result[side]) > 6 else ""))
    rows, ops, cells = layer_grid(result)
    lines.append(f"{'layer':>5} {'max nmse':>10}  {'at op':<16} first op above threshold")
    for row in rows:
        points = [cells[(row, op)] for op in ops if (row, op) in cells]
        worst = max((p for p in points if p["nmse"] is not None), key=lambda p: p["nmse"], default=None)
        above = next((p["op"] for p in points if p["diverged"]), "-")
        if worst is not None:
            lines.append(f"{row:>5} {worst['nmse']:>10.2e}  {worst['op']:<16} {above}")
        elif above != "-":  # only structural differences on this row
            lines.append(f"{row:>5} {'n/a':>10}  {'-':<16} {above}")
    return "\n".join(lines + [first_line(result)])


def plot_result(result, path):  # -> PNG: heatmap layers x ops and the NMSE curve in forward order
    plt = pyplot(path)
    rows, ops, cells = layer_grid(result)
    points = result["points"]
    # a log scale cannot show an exact 0: draw it a decade under the smallest error or threshold
    positive = [v for p in points for v in (p["nmse"], p["threshold"]) if v and np.isfinite(v)]
    floor = 0.1 * min(positive, default=1e-30)
    grid = np.full((len(rows), len(ops)), np.nan)
    for (row, op), p in cells.items():
        if p["nmse"] is not None:
            grid[rows.index(row), ops.index(op)] = np.log10(max(p["nmse"], floor))
    fig, (heat, curve) = plt.subplots(2, 1, figsize=(12, 4 + 0.18 * len(rows)),
                                      gridspec_kw={"height_ratios": [max(len(rows), 3), 4]})
    image = heat.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=heat, label=f"log10 NMSE (0 at {np.log10(floor):.1f})")
    heat.set_xticks(range(len(ops)), ops, rotation=60, ha="right", fontsize=7)
    heat.set_yticks(range(len(rows)), rows, fontsize=7)
    heat.set_ylabel("layer")
    first = result["first"]
    if first is not None:
        row = "-" if first["layer"] is None else str(first["layer"])
        heat.add_patch(plt.Rectangle((ops.index(first["op"]) - 0.5, rows.index(row) - 0.5), 1, 1,
                                     fill=False, edgecolor="red", lw=2))
    x = np.arange(len(points))
    nmse = np.array([np.nan if p["nmse"] is None else max(p["nmse"], floor) for p in points])
    curve.semilogy(x, nmse, ".-", lw=0.8, ms=3, label="NMSE(A, B)")
    curve.semilogy(x, [p["threshold"] for p in points], "--", color="grey", lw=0.8, label="threshold")
    if first is not None:
        curve.axvline(points.index(first), color="red", lw=1, label=f"first divergence: {first['name']}")
    curve.set_xlabel("trace point, forward order")
    curve.set_ylabel("NMSE")
    curve.legend(fontsize=7, loc="upper left")
    curve.grid(True, alpha=0.3)
    heat.set_title(first_line(result), fontsize=9)
    fig.tight_layout()
    save_figure(plt, fig, path)


def tokens_of(trace):  # {name: tensor} -> prompt length from the first full tensor, or None
    return next((int(t.shape[0]) for t in trace.values() if isinstance(t, np.ndarray) and t.ndim > 1), None)


def threshold_rule(args, trace_a):  # parsed args, A -> (threshold or {name: threshold}, its description)
    if args.noise_floor:
        threshold = noise_thresholds(trace_a, load_source(args.noise_floor)[0], args.noise_floor)
        return threshold, f"per point 64 x NMSE({args.noise_floor}, A), at least 64 x 2^-48"
    if args.threshold is not None:
        return args.threshold, f"{args.threshold:g} (--threshold)"
    return EXACT_THRESHOLD, f"{EXACT_THRESHOLD:g} (default, exact vs exact)"


def reproduce_command(config, model, trace_dir, cpu):  # LlamaConfig, --cpu -> reference.run argv rounding as that dump
    ids = ",".join(map(str, config.prompt)) if config.prompt else "IDS"
    return ["python", "-m", "reference.run", "-m", model or "MODEL.gguf", "--token-ids", ids,
            "-n", "1", *config.reference_options(cpu), "--trace", trace_dir]


def check_reproducible(args, trace_a, trace_b, config):  # -> None, or UsageError before any work
    if is_dump(trace_a) == is_dump(trace_b):
        raise UsageError("--reproduce needs one llama.cpp dump and one trace")
    if not args.model:
        raise UsageError("--reproduce needs --model, the GGUF the dump was made from")
    if not config.prompt:
        raise UsageError("--reproduce: the dump does not log its prompt token ids (llama-eval-callback does)")
    try:
        config.reference_options(args.cpu)
    except DumpError as e:
        raise UsageError(f"--reproduce: {e}") from None


def run_reproduction(config, model, cpu):  # -> {name: array}: reference.run's trace with the dump's configuration
    with tempfile.TemporaryDirectory(prefix="bisect-") as directory:
        command = [sys.executable, *reproduce_command(config, model, directory, cpu)[1:]]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            why = (run.stderr.strip().splitlines() or ["no message"])[-1]
            raise UsageError(f"--reproduce: reference.run failed ({why})")
        return load_trace(directory)


def before_attention(result, point):  # -> True when `point` precedes the first attention output
    names = [p["name"] for p in result["points"]]
    attention = next((i for i, p in enumerate(result["points"]) if p["op"] == "attn_out"), None)
    return attention is not None and names.index(point["name"]) < attention


def config_verdict(result, config, args, reproduced):  # -> (lines, exit status) for a dump's configuration
    """The exact reference rounds as float32 math. A dump made with an F16/Q8_0 cache or flash attention
    rounds otherwise from the first attention output on: a difference from there is only a bug if the
    reference run with the same configuration (`reproduced`, the comparison against it) differs too."""
    first, model = result["first"], args.model
    note = config.cpu_note(args.cpu)
    lines = [f"llama.cpp configuration: {config.describe()}"] + ([note] if note else [])
    if config.exact or first is None or before_attention(result, first):
        return lines, 1 if first else 0
    try:
        lines.append("the reference rounds as it does with: "
                     + " ".join(reproduce_command(config, model, "TRACE_DIR", args.cpu)))
    except DumpError as e:
        return lines + [f"not reproducible: {e}", first_line(result)], 1
    if reproduced is None:
        return lines + [f"{first_line(result)} (the configuration may explain it: rerun with --reproduce --model "
                        f"{model or 'MODEL.gguf'})"], 1
    if reproduced["first"] is None:
        compared = sum(p["nmse"] is not None for p in reproduced["points"])
        return lines + [f"explained by the configuration, not a bug: the exact reference differs from "
                        f"{first['name']} on (nmse={first['nmse']:.3e}), the reference with the dump's "
                        f"configuration agrees at all {compared} points"], 0
    return lines + [f"{first_line(reproduced)} (against the reference with the dump's configuration)"], 1


def is_dump(trace):  # {name: tensor} -> True for a llama.cpp text dump (printed parts of tensors)
    return isinstance(next(iter(trace.values()), None), PartialTensor)


def against_reproduction(args, trace_a, trace_b, config, threshold, lost=()):  # -> bisect result, the trace side reproduced
    reproduced = run_reproduction(config, args.model, args.cpu)
    if is_dump(trace_a):
        return bisect(trace_a, reproduced, threshold, lost=lost)
    return bisect(reproduced, trace_b, threshold, lost=lost)


def lost_tails(args, side_a, side_b):  # (trace, config) x2 -> (points lost with a dump's tail, one note per cut dump)
    lost, notes = set(), []
    for path, (trace, config), (other, _) in ((args.a, side_a, side_b), (args.b, side_b, side_a)):
        if config is not None and config.last_whole:
            missing = lost_points(other, trace)
            lost.update(missing)
            notes.append(f"{path}: the dump's tail is missing after {config.last_whole}: {len(missing)} points of the "
                         "other side are not in it and are not compared (llama.cpp's logger can lose a dump's tail "
                         "at exit, more often through a pipe); compared up to its last whole point")
    return lost, notes


def run_bisect(args):  # parsed CLI args -> exit status
    for option, path in (("--table", args.table), ("--json-out", args.json_out)):
        if path:
            check_output(path, option)
    if args.plot:
        check_plot(args.plot)
    sources = [(option, path) for option, given in (("A", args.a), ("B", args.b), ("--noise-floor", args.noise_floor),
                                                    ("--model", args.model)) if given
               for path in [given, *(os.path.join(given, n) for n in (os.listdir(given) if os.path.isdir(given) else ()))]]
    artifacts.refuse_overwrite([("--table", args.table), ("--json-out", args.json_out), ("--plot", args.plot)], sources,
                               UsageError)
    if args.cpu:
        try:
            emulated_target(args.cpu)
        except DumpError as e:
            raise UsageError(str(e)) from None
    (trace_a, notes, config_a), (trace_b, notes_b, config_b) = load_pair(args.a, args.b)
    config = config_b or config_a
    if args.cpu and not config:
        raise UsageError("--cpu chooses the CPU build a llama.cpp text dump is reproduced as; neither side is one")
    if args.reproduce:
        check_reproducible(args, trace_a, trace_b, config)
    threshold, rule = threshold_rule(args, trace_a)
    lost, cut_notes = lost_tails(args, (trace_a, config_a), (trace_b, config_b))
    notes += cut_notes
    result = bisect(trace_a, trace_b, threshold, (args.a, args.b), lost)
    if not result["points"]:
        raise UsageError(f"{args.b}: no trace point in common with {args.a}")
    needed = args.reproduce and result["first"] is not None and not config.exact
    reproduced = against_reproduction(args, trace_a, trace_b, config, threshold, lost) if needed else None
    verdict, status = config_verdict(result, config, args, reproduced) if config else ([], None)
    print("\n".join([format_summary(result, rule, notes + notes_b)] + verdict))
    write_outputs(args, result, rule, reproduced)
    return (1 if result["first"] else 0) if status is None else status


def write_outputs(args, result, rule, reproduced):  # -> None: --table, --json, --plot as asked
    if args.table:
        write_text(args.table, "--table", format_table(result, rule) + "\n")
    if args.json_out:
        write_text(args.json_out, "--json-out", json.dumps({"threshold_rule": rule, **result, "reproduced": reproduced},
                                                   indent=1))
    if args.plot:
        plot_result(result, args.plot)


def build_parser():  # -> the parser
    p = OneLineParser(prog="python -m tools.bisect", description=__doc__)
    p.add_argument("a", help="reference side: trace directory or llama.cpp dump")
    p.add_argument("b", help="side under test: trace directory or llama.cpp dump")
    limit = p.add_mutually_exclusive_group()
    # an NMSE is never negative: any limit >= 0 is a rule (0: bit-identical; inf: only NaN and structure)
    limit.add_argument("--threshold", type=float_in(0.0, math.inf),
                       help="NMSE above which a point diverges")
    limit.add_argument("--noise-floor", help="float64 trace of the run that made A: per-point thresholds")
    p.add_argument("--table", help="write the layers x ops NMSE table and the per-point list")
    p.add_argument("--plot", help="write a PNG heatmap (layers x ops) and the NMSE curve")
    add_json_out(p, "the per-point results", checked=False)
    p.add_argument("--reproduce", action="store_true",
                   help="when a llama.cpp dump's cache type or flash attention could explain a divergence, run "
                        "reference.run with that configuration and bisect the dump against it too")
    flag(p, "model", help="the GGUF the dump was made from (for --reproduce and the printed command)")
    p.add_argument("--cpu", choices=CPU_CHOICES, metavar="CPU",
                   help="the CPU build of llama.cpp the dump's reproduction rounds as (default: the one its "
                        "system_info line shows, else avx512)")
    return p


def main(argv=None):  # -> exit status
    args = build_parser().parse_args(argv)
    with artifacts.interruptible("tools.bisect"):
        try:
            return run_bisect(args)
        except UsageError as e:
            return fail("tools.bisect", e)


if __name__ == "__main__":
    sys.exit(main())
