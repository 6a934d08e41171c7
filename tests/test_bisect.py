"""tools.bisect, tools.dump_parse and tools.hf_names.

The fixture tests/fixtures/eval_callback_dump.txt is in the exact format of llama.cpp's
common/debug.cpp: two passes (ubatches of 8 and 3 tokens) of a few nodes, plus a log line before and
after. Every printed value of tensor NAME is `fixture_values(NAME, joined numpy shape)` at its
place in the joined 11-token tensor, and every sum is the float32 sum of its ubatch's tensor; the
values are multiples of 1/16, so printing and summing them is exact. `Qcur-0` is printed twice per
pass, as the matmul {16, T} (other values) and then as its reshape {8, 2, T}.

tests/fixtures/tiny-a-f32.eval-callback.txt is a real dump: llama-eval-callback of the llama.cpp
build behind the goldens on golden/models/tiny-a-f32.gguf, 5 tokens, F32 KV cache (command in
tests/fixtures/README.md).
"""
import json
import os
import re
import shutil

import numpy as np
import pytest
from reference.cli import UsageError
from conftest import MODELS, ROOT, cli_error, require, run_cli
from test_diff import npy_claiming

from reference.ggml_cpu import CLANG_BUILDS, TARGETS, target_of_system_info
from reference.trace import Tracer
from tools.parity import bisect as bisect_tool
from tools.parity import dump_parse
from tools.parity.hf_names import HF_TEXT_MODULES, hf_module, hf_rope_rows_to_gguf

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "eval_callback_dump.txt")
REAL_DUMP = os.path.join(ROOT, "tests", "fixtures", "tiny-a-f32.eval-callback.txt")  # see tests/fixtures/README.md
N_LAYER, T, E, H, D = 4, 5, 16, 2, 8
LAYER_OPS = ["attn_norm", "Qcur", "Qcur_normed", "attn_out", "attn_o_proj", "attn_post_norm", "ffn_inp",
             "ffn_norm", "ffn_out", "ffn_post_norm", "l_out"]


def fixture_values(name, shape):  # -> values of the fixture's tensor `name` joined over both passes
    flat = np.arange(int(np.prod(shape)))
    return ((((flat * 7 + sum(map(ord, name))) % 33) - 16) / 16.0).reshape(shape)


def rms(x):  # [..., n] -> [..., n]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def toy_trace(inject=None, dtype=np.float32, prompt=2):  # -> {name: tensor} in forward order
    """A small pre-norm transformer-like forward; `inject` adds an error at one point, which then
    flows into every later point as a real bug would. `prompt` seeds the input rows."""
    rng = np.random.default_rng(0)
    shapes = {"q": (E, H * D), "o": (H * D, E), "up": (E, 3 * E), "down": (3 * E, E), "out": (E, 40)}
    w = {k: rng.normal(size=shape).astype(dtype) / np.sqrt(shape[0]) for k, shape in shapes.items()}
    trace = {}

    def record(name, x):  # [...] -> [...] as stored, with the injected error if any
        if name == inject:
            x = x + 1e-3 * np.std(x) * np.random.default_rng(1).normal(size=x.shape).astype(dtype)
        trace[name] = x.astype(dtype)
        return trace[name]

    x = record("embd_norm", rms(np.random.default_rng(prompt).normal(size=(T, E)).astype(dtype)))
    for il in range(N_LAYER):
        h = record(f"attn_norm-{il}", rms(x))
        q = record(f"Qcur-{il}", (h @ w["q"]).reshape(T, H, D))
        q = record(f"Qcur_normed-{il}", rms(q))
        a = record(f"attn_out-{il}", np.tanh(q).reshape(T, H * D))
        a = record(f"attn_o_proj-{il}", a @ w["o"])
        a = record(f"attn_post_norm-{il}", rms(a))
        x = record(f"ffn_inp-{il}", x + a)
        u = record(f"ffn_norm-{il}", rms(x))
        f = record(f"ffn_out-{il}", np.maximum(u @ w["up"], 0) @ w["down"])
        f = record(f"ffn_post_norm-{il}", rms(f))
        x = record(f"l_out-{il}", x + f)
    record("result_output", record("result_norm", rms(x)) @ w["out"])
    return trace


def save_trace(trace, directory):  # {name: tensor} -> trace dir as reference.run writes it
    tracer = Tracer(str(directory))
    for name, x in trace.items():
        tracer(name, x)
    tracer.close()
    return str(directory)


def test_error_injected_at_layer_2_attn_post_norm_is_found():
    clean = toy_trace()
    result = bisect_tool.bisect(clean, toy_trace(inject="attn_post_norm-2"), bisect_tool.EXACT_THRESHOLD)
    first = result["first"]
    assert (first["name"], first["layer"], first["op"]) == ("attn_post_norm-2", 2, "attn_post_norm")
    names = [p["name"] for p in result["points"]]
    assert names == list(clean)  # A's forward order
    assert all(p["diverged"] for p in result["points"][names.index("attn_post_norm-2"):])
    assert not any(p["diverged"] for p in result["points"][:names.index("attn_post_norm-2")])
    assert bisect_tool.bisect(clean, toy_trace(), bisect_tool.EXACT_THRESHOLD)["first"] is None


def test_noise_floor_thresholds_separate_rounding_from_a_bug():
    exact = toy_trace(dtype=np.float64)
    clean, buggy = toy_trace(), toy_trace(inject="ffn_out-1")
    thresholds = bisect_tool.noise_thresholds(clean, exact)
    assert set(thresholds) == set(clean)

    def engine(noisier):  # an engine whose rounding error is `noisier` times the reference's
        return {n: (a + noisier * (exact[n] - a)).astype(np.float32) for n, a in clean.items()}

    assert bisect_tool.bisect(clean, engine(3), thresholds)["first"] is None
    assert bisect_tool.bisect(clean, engine(12), thresholds)["first"] is not None
    assert bisect_tool.bisect(clean, buggy, thresholds)["first"]["name"] == "ffn_out-1"


def test_cli_names_the_first_divergence(tmp_path, capsys):
    a = save_trace(toy_trace(), tmp_path / "a")
    b = save_trace(toy_trace(inject="attn_post_norm-2"), tmp_path / "b")
    r = run_cli("tools.bisect", a, b, "--table", tmp_path / "t.txt", "--json", tmp_path / "r.json")
    assert r.returncode == 1, r.stderr
    assert "first divergence: attn_post_norm-2 (layer 2, op attn_post_norm) nmse=" in r.stdout
    table = (tmp_path / "t.txt").read_text()
    assert "attn_post_norm" in table.splitlines()[4] and "DIVERGED" in table
    assert bisect_tool.main([a, a]) == 0
    assert "no divergence above threshold" in capsys.readouterr().out


def test_plot(tmp_path):
    require("matplotlib")  # an extra: [test] and [parity]
    a = save_trace(toy_trace(), tmp_path / "a")
    b = save_trace(toy_trace(inject="Qcur-1"), tmp_path / "b")
    assert bisect_tool.main([a, b, "--plot", str(tmp_path / "p.png")]) == 1
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input(tmp_path, capsys):
    a = save_trace(toy_trace(), tmp_path / "a")
    (tmp_path / "junk.txt").write_text("not a dump\n")
    for source in (tmp_path / "missing", tmp_path / "junk.txt"):
        assert bisect_tool.main([a, str(source)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(source) in err[0]
    r = run_cli("tools.bisect", a, tmp_path / "junk.txt")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("case, message", [
    ("index_number", "index.json: a trace index is a JSON list of trace points, not int"),
    ("index_null", "index.json: a trace index is a JSON list of trace points, not NoneType"),
    ("no_shape", "attn_norm-0.npy: holds shape [5, 16], index.json records None"),
    ("other_shape", "attn_norm-0.npy: holds shape [5, 16], index.json records [5, 8]"),
    ("huge_header", "attn_norm-0.npy: header claims shape [70000000000, 16]"),
    ("integers", "attn_norm-0.npy: dtype int64 is not a float tensor"),
])
def test_bad_trace_exits_2_with_one_line(tmp_path, case, message):
    a = save_trace(toy_trace(), tmp_path / "a")
    b = save_trace(toy_trace(), tmp_path / "b")
    index_file, point = tmp_path / "b" / "index.json", tmp_path / "b" / "attn_norm-0.npy"
    index = json.loads(index_file.read_text())
    if case == "index_number":
        index_file.write_text("5")
    elif case == "index_null":
        index_file.write_text("null")
    elif case in ("no_shape", "other_shape"):
        entry = next(e for e in index if e["name"] == "attn_norm-0")
        if case == "no_shape":
            del entry["shape"]
        else:
            entry["shape"] = [T, E // 2]
        index_file.write_text(json.dumps(index))
    elif case == "huge_header":  # 4 TiB claimed: refused from the header, nothing allocated
        point.write_bytes(npy_claiming((70_000_000_000, E)))
    else:
        np.save(point, np.zeros((T, E), np.int64))
    cli_error(run_cli("tools.bisect", a, b), "tools.bisect: ", message)


@pytest.mark.parametrize("replacement", ["row_length", "scalar", "no_tokens"])
def test_a_point_of_another_shape_is_a_divergence(tmp_path, replacement):
    """Both sides record attn_out-1, but B's cannot be the same tensor: a difference of structure,
    reported as the first divergence (module doc), never skipped as if nothing were there."""
    name = "attn_out-1"
    buggy = toy_trace()
    buggy[name] = {"row_length": np.ones((T, 2 * H * D)), "scalar": np.array(0.5),
                   "no_tokens": np.ones((0, H * D))}[replacement].astype(np.float32)
    result = bisect_tool.bisect(toy_trace(), buggy)
    first = result["first"]
    assert (first["name"], first["diverged"], first["shape_ok"], first["nmse"]) == (name, True, False, None)
    assert first["note"] == f"shapes differ: [{T}, {H * D}] vs {list(buggy[name].shape)}"
    # the same through the command line, from a trace whose index.json records that shape
    r = run_cli("tools.bisect", save_trace(toy_trace(), tmp_path / "a"), save_trace(buggy, tmp_path / "b"))
    assert r.returncode == 1, r.stderr
    assert f"first divergence: {name} (layer 1, op attn_out) shapes differ" in r.stdout


def test_noise_floor_of_another_run_is_refused(tmp_path):
    """Thresholds from the float64 run of another prompt would be ~1e2 and hide every bug."""
    clean = toy_trace()
    with pytest.raises(UsageError, match="median NMSE against A is .* not the float64 run of A"):
        bisect_tool.noise_thresholds(clean, toy_trace(dtype=np.float64, prompt=5))
    wider = toy_trace(dtype=np.float64)
    wider["ffn_out-2"] = np.concatenate([wider["ffn_out-2"]] * 2, axis=-1)
    with pytest.raises(UsageError, match=r"point ffn_out-2 shapes differ: \[5, 32\] vs \[5, 16\]"):
        bisect_tool.noise_thresholds(clean, wider)
    a = save_trace(clean, tmp_path / "a")
    other = save_trace(toy_trace(dtype=np.float64, prompt=5), tmp_path / "other")
    r = run_cli("tools.bisect", a, a, "--noise-floor", other)
    cli_error(r, f"tools.bisect: {other}: median NMSE", "not the float64 run of A")


def test_dump_with_a_sum_that_is_not_a_number_exits_2(tmp_path):
    lines = open(FIXTURE).read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("sum = "))
    lines[at] = "    sum = xyz"
    dump = tmp_path / "dump.txt"
    dump.write_text("\n".join(lines) + "\n")
    with pytest.raises(dump_parse.DumpError, match=f"dump.txt:{at + 1}: sum 'xyz' is not a number"):
        dump_parse.load_dump(str(dump))
    cli_error(run_cli("tools.bisect", dump, dump), f"tools.bisect: {dump}:{at + 1}: sum 'xyz' is not a number")


@pytest.mark.parametrize("option, target, message", [
    ("--table", "missing/t.txt", "no such directory"),
    ("--json-out", "missing/r.json", "no such directory"),
    ("--plot", "missing/p.png", "no such directory"),
    ("--json-out", ".", "is a directory"),
], ids=["table-no-dir", "json-no-dir", "plot-no-dir", "json-is-dir"])
def test_unwritable_output_exits_2_before_the_work(tmp_path, option, target, message):
    a = save_trace(toy_trace(), tmp_path / "a")
    r = run_cli("tools.bisect", a, a, option, tmp_path / target)
    cli_error(r, f"tools.bisect: {option} {tmp_path / target}", message)
    assert r.stdout == ""  # refused before anything was compared


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: a, b"),
    (["--threshold", "x"], "--threshold: expected a number, got 'x'"),
    (["--threshold", "-1"], "--threshold: -1 is out of range"),
    (["--threshold", "nan"], "--threshold: expected a number, got 'nan'"),
    (["--threshold", "1", "--noise-floor", "a64"], "--noise-floor: not allowed with argument --threshold"),
    (["--bogus"], "unrecognized arguments: --bogus"),
], ids=["no-args", "threshold-text", "threshold-negative", "threshold-nan", "two-rules", "unknown"])
def test_bad_arguments_exit_2_with_one_line(tmp_path, args, message):
    a = save_trace(toy_trace(), tmp_path / "a")
    cli_error(run_cli("tools.bisect", *([a, a] if args else []), *args), "tools.bisect: ", message)


def test_parse_fixture_dump():
    with open(FIXTURE) as f:
        passes = dump_parse.parse_dump(f.read(), FIXTURE)
    assert len(passes) == 2
    assert list(passes[0]) == ["embd_norm", "attn_norm-0", "Qcur-0", "cache_k_l0 (view)", "attn_post_norm-0",
                               "result_output"]
    first = passes[0]["embd_norm"]
    assert first.ne == (8, 8, 1, 1) and first.op == "RMS_NORM"
    assert (first.index[0], first.values[0], first.sum) == (0, 0.4375, 0.4375)
    assert first.index.size == 36  # 6 of 8 rows, 6 of 8 values each
    assert passes[0]["Qcur-0"].op == "RESHAPE"  # the last node of that name
    quantized = passes[0]["cache_k_l0 (view)"]
    assert quantized.index.size == 0 and quantized.sum is None

    points, notes, _ = dump_parse.load_dump(FIXTURE)
    assert notes == []
    expected_ne = {"embd_norm": (8, 11, 1, 1), "Qcur-0": (8, 2, 11, 1), "attn_post_norm-0": (8, 11, 1, 1),
                   "result_output": (32, 1, 1, 1)}
    for name, ne in expected_ne.items():
        t = points[name]
        assert t.ne == ne
        full = fixture_values(name, tuple(reversed(ne))).reshape(-1)
        np.testing.assert_array_equal(t.values, full[t.index])
        assert t.sum == full.sum()
    assert points["embd_norm"].index.size == 36 + 18
    assert points["Qcur-0"].index.size == (6 + 3) * 2 * 6


def test_warm_up_pass_is_dropped_only_when_the_token_count_says_so():
    whole = dump_parse.load_dump(FIXTURE, n_tokens=11).points
    assert whole["embd_norm"].ne == (8, 11, 1, 1)
    last, notes, _ = dump_parse.load_dump(FIXTURE, n_tokens=3)
    assert last["embd_norm"].ne == (8, 3, 1, 1) and "warm-up" in notes[0]


def fixture_as_full_trace():  # -> the fixture's tensors, whole, in the reference's layout
    rng = np.random.default_rng(3)
    trace = {name: fixture_values(name, (11, E // 2)).astype(np.float32)
             for name in ("embd_norm", "attn_norm-0", "attn_post_norm-0")}
    trace["Qcur-0"] = fixture_values("Qcur-0", (11, 2, 8)).astype(np.float32)
    logits = rng.normal(size=(11, 32)).astype(np.float32)
    logits[-1] = fixture_values("result_output", (1, 32))[0]  # llama.cpp keeps only the last row
    trace["result_output"] = logits
    return trace


def test_dump_against_full_trace_uses_printed_values_and_sums():
    dump = dump_parse.load_dump(FIXTURE, n_tokens=11).points
    trace = fixture_as_full_trace()
    result = bisect_tool.bisect(trace, dump, bisect_tool.EXACT_THRESHOLD)
    assert result["first"] is None
    by_name = {p["name"]: p for p in result["points"]}
    assert by_name["attn_post_norm-0"]["sum_ok"] is True
    assert by_name["result_output"]["note"] == "last 1 of 11 vs 1 tokens"
    assert by_name["result_output"]["n"] == 6

    within_print = fixture_as_full_trace()
    within_print["attn_norm-0"][0, 0] += 4e-5  # under the %12.4f rounding of the dump
    assert bisect_tool.bisect(within_print, dump, 1e-12)["first"] is None

    hidden = fixture_as_full_trace()
    hidden["attn_post_norm-0"][4, 4] += 0.5  # row 4, column 4: never printed, only summed
    first = bisect_tool.bisect(hidden, dump, bisect_tool.EXACT_THRESHOLD)["first"]
    assert first["name"] == "attn_post_norm-0" and first["nmse"] == 0 and first["sum_ok"] is False
    # the same error is within a loose threshold (whole-tensor NMSE ~ 8e-3), and the sums must say so too
    assert bisect_tool.bisect(hidden, dump, 1e-2)["first"] is None

    shown = fixture_as_full_trace()
    shown["attn_norm-0"][10, 7] += 0.01  # the last printed value
    first = bisect_tool.bisect(shown, dump, bisect_tool.EXACT_THRESHOLD)["first"]
    assert first["name"] == "attn_norm-0" and first["nmse"] > 1e-6


def test_older_prefix_and_nan_values():
    text = """ggml_debug:                   norm-0 = (f32)       NORM(inp_embd{4, 2, 1, 1}, }) = {4, 2, 1, 1}
                                     [
                                      [
                                       [  1.0000,   -nan,   2.0000,   3.0000],
                                       [  0.5000,   0.2500,   0.1250,   inf],
                                      ],
                                     ]
"""
    (points,) = dump_parse.parse_dump(text)
    t = points["norm-0"]
    assert t.sum is None and t.index.tolist() == list(range(8))
    assert np.isnan(t.values[1]) and np.isinf(t.values[7])
    result = bisect_tool.bisect({"norm-0": np.arange(8, dtype=np.float32).reshape(2, 4)}, points, 1.0)
    assert result["first"]["name"] == "norm-0"  # NaN never passes a threshold


def test_hf_names_cover_the_trace_and_undo_rotate_half():
    for op in LAYER_OPS + ["attn_gate_proj", "Kcur", "Vcur", "Kcur_normed", "Qcur_rope", "Kcur_rope",
                           "attn_gate_sig", "attn_gated"]:
        assert op + "-{il}" in HF_TEXT_MODULES
    assert hf_module("attn_post_norm-7")[0] == "model.language_model.layers.7.post_attention_layernorm"
    assert hf_module("result_norm")[0] == "model.language_model.norm"
    # llama.cpp's converter reorders the q_proj rows of each head: HF row s*D/2 + j -> GGUF row 2j + s
    rng = np.random.default_rng(0)
    w_hf, x = rng.normal(size=(H * D, E)), rng.normal(size=(3, E))
    w_gguf = w_hf.reshape(H, 2, D // 2, E).swapaxes(1, 2).reshape(H * D, E)
    np.testing.assert_array_equal(hf_rope_rows_to_gguf(x @ w_hf.T, D), x @ w_gguf.T)
    per_head = hf_rope_rows_to_gguf((x @ w_hf.T).reshape(3, H, D), D)
    np.testing.assert_array_equal(per_head, (x @ w_gguf.T).reshape(3, H, D))


def dump_prompt(path):  # -> the token ids llama-eval-callback logs before its dump
    with open(path) as f:
        lines = f.read().splitlines()
    at = next(i for i, line in enumerate(lines) if "number of input tokens = " in line)
    n = int(lines[at].rsplit("=", 1)[1])
    return [int(line.split()[-1]) for line in lines[at + 1:at + 1 + n]]


@pytest.fixture(scope="module")
def real_dump():  # -> (prompt ids, the dump's tensors, GGUFModel of the dumped model)
    from reference import gguf
    ids = dump_prompt(REAL_DUMP)
    points, notes, _ = dump_parse.load_dump(REAL_DUMP, len(ids))
    assert notes == []
    return ids, points, gguf.load(os.path.join(MODELS, "tiny-a-f32.gguf"), "text")


def reference_trace(model, ids, dtype=np.float32, forward=None):  # -> {name: tensor} of one prefill
    from reference.text import TextModel
    lm = (forward or TextModel)(model, dtype)
    tracer = Tracer(keep_in_memory=True)
    lm.prefill(ids, lm.new_cache(len(ids), "uniform"), trace=tracer)
    return tracer.points


def test_real_llama_cpp_dump_matches_the_reference(real_dump):
    """Every tensor llama.cpp dumped that the reference also traces (94 points: all of them, the last
    layer's FFN and the output on the last token only) agrees to within the printed precision, and
    every whole-tensor sum agrees."""
    ids, dump, model = real_dump
    assert ids == [497, 319, 261, 84, 77]
    trace = reference_trace(model, ids)
    thresholds = bisect_tool.noise_thresholds(trace, reference_trace(model, ids, np.float64))
    result = bisect_tool.bisect(trace, dump, thresholds)
    assert result["first"] is None
    compared = [p for p in result["points"] if p["nmse"] is not None]
    assert len(compared) == len(trace) == 94
    assert all(p["sum_ok"] for p in compared)
    # measured: NMSE 0 on 86 points once the 5e-5 print rounding is taken off, at most 3.8e-14 (l_out-4)
    assert max(p["nmse"] for p in compared) < 1e-12
    assert {p["name"] for p in compared if p["note"]} == {"ffn_inp-4", "ffn_norm-4", "ffn_out-4", "ffn_post_norm-4",
                                                          "l_out-4", "result_norm", "result_output"}


def test_real_dump_end_to_end_through_the_command_line(real_dump, tmp_path):
    ids = ",".join(map(str, real_dump[0]))
    for dtype, trace in (("float32", tmp_path / "t32"), ("float64", tmp_path / "t64")):
        r = run_cli("reference.run", "--model", os.path.join(MODELS, "tiny-a-f32.gguf"), "--token-ids", ids, "--n-predict", "1", "--kv", "uniform", "--dtype", dtype,
                    "--trace", trace)
        assert r.returncode == 0, r.stderr
    r = run_cli("tools.bisect", tmp_path / "t32", REAL_DUMP, "--noise-floor", tmp_path / "t64",
                "--table", tmp_path / "table.txt")
    assert r.returncode == 0 and "no divergence above threshold (94 points compared)" in r.stdout, r.stdout
    assert "Qcur_rope" in (tmp_path / "table.txt").read_text()


def test_planted_bugs_against_the_real_dump(real_dump, monkeypatch):
    """llama.cpp's dump as A, a reference with a planted bug as B: bisect names the bug's op."""
    from reference import ops
    from test_planted_bugs import ScalarSwaRule
    ids, dump, model = real_dump
    clean = reference_trace(model, ids)
    thresholds = bisect_tool.noise_thresholds(clean, reference_trace(model, ids, np.float64))

    first = bisect_tool.bisect(dump, reference_trace(model, ids, forward=ScalarSwaRule), thresholds)["first"]
    assert (first["name"], first["only_in"]) == ("Qcur_rope-0", "B")  # RoPE on layer 0, which llama.cpp ropes not

    monkeypatch.setattr(ops, "rope_norm", ops.rope_neox)
    first = bisect_tool.bisect(dump, reference_trace(model, ids), thresholds)["first"]
    assert (first["name"], first["layer"], first["op"]) == ("Qcur_rope-1", 1, "Qcur_rope")
    assert first["nmse"] > 1e-3


DEFAULT_DUMP = os.path.join(ROOT, "tests", "fixtures", "tiny-a-f32.default.eval-callback.txt")  # llama.cpp defaults
PLANTED_WEIGHT = "blk.2.post_attention_norm.weight"


def planted_copy(directory, scale=1.01):  # -> path of a copy of tiny-a-f32.gguf, PLANTED_WEIGHT times scale
    import shutil
    from reference import gguf
    path = os.path.join(directory, "tiny-a-planted.gguf")
    shutil.copyfile(os.path.join(MODELS, "tiny-a-f32.gguf"), path)
    tensor = next(t for t in gguf.open_reader(path).tensors if t.name == PLANTED_WEIGHT)
    weight = np.memmap(path, np.float32, "r+", offset=int(tensor.data_offset), shape=(int(tensor.n_elements),))
    weight *= np.float32(scale)
    weight.flush()
    return path


def exact_traces(model, ids, directory):  # -> (float32 trace dir, float64 trace dir) of reference.run
    dirs = (os.path.join(directory, "t32"), os.path.join(directory, "t64"))
    for dtype, trace in zip(("float32", "float64"), dirs):
        r = run_cli("reference.run", "--model", model, "--token-ids", ",".join(map(str, ids)), "--n-predict", "1",
                    "--kv", "uniform", "--dtype", dtype, "--trace", trace)
        assert r.returncode == 0, r.stderr
    return dirs


def test_default_dump_configuration_is_read():
    """The cache types come from the cache_k_l*/cache_v_l* nodes, flash attention from FLASH_ATTN_EXT,
    the ubatches from the passes; the f32 fixture was made with -ctk f32 -ctv f32 -fa off -ub 64."""
    config = dump_parse.load_dump(DEFAULT_DUMP).config
    assert (config.cache_k, config.cache_v, config.flash_attn, config.ubatches) == ("f16", "f16", True, [5])
    assert config.prompt == [497, 319, 261, 84, 77] and not config.exact
    assert config.reference_options() == ["--numerics", "ggml-cpu", "-ctk", "f16", "-ctv", "f16", "-fa", "on",
                                          "--cpu", "avx512"]
    exact = dump_parse.load_dump(REAL_DUMP).config
    assert (exact.cache_k, exact.cache_v, exact.flash_attn, exact.exact) == ("f32", "f32", False, True)
    several = dump_parse.LlamaConfig("q8_0", "q8_0", True, [512, 512, 76], None)
    assert several.reference_options()[-2:] == ["-ub", "512"]
    mixed = dump_parse.LlamaConfig("f16", "f32", False, [5], None)  # K and V types apart, as llama.cpp takes them
    assert mixed.reference_options()[2:8] == ["-ctk", "f16", "-ctv", "f32", "-fa", "off"]
    for bad, message in ((dump_parse.LlamaConfig("q4_0", "f16", False, [5], None), "the dump's are K q4_0, V f16"),
                         (dump_parse.LlamaConfig("bf16", "bf16", True, [5], None), "K bf16, V bf16"),
                         (dump_parse.LlamaConfig("f16", "f16", True, [600], None), "at most 512 tokens")):
        with pytest.raises(dump_parse.DumpError, match=message):
            bad.reference_options()


def test_default_dump_of_the_unmodified_model_is_explained_not_a_bug(tmp_path):
    model = os.path.join(MODELS, "tiny-a-f32.gguf")
    t32, t64 = exact_traces(model, [497, 319, 261, 84, 77], tmp_path)
    command = ("python -m reference.run -m MODEL.gguf --token-ids 497,319,261,84,77 -n 1 "
               "--numerics ggml-cpu -ctk f16 -ctv f16 -fa on --cpu avx512 --trace TRACE_DIR")
    r = run_cli("tools.bisect", t32, DEFAULT_DUMP, "--noise-floor", t64)
    assert r.returncode == 1, r.stderr
    # measured: attn_out-0 NMSE 2.3e-7 (F16 K/V and flash attention), 3.5e5 x its noise-floor threshold
    assert "first divergence: attn_out-0 (layer 0, op attn_out)" in r.stdout
    assert ("llama.cpp configuration: CPU avx512, K cache f16, V cache f16, flash attention on, 1 ubatch of 5 tokens"
            in r.stdout)
    assert f"the reference rounds as it does with: {command}" in r.stdout
    assert "the configuration may explain it: rerun with --reproduce --model MODEL.gguf" in r.stdout
    r = run_cli("tools.bisect", t32, DEFAULT_DUMP, "--noise-floor", t64, "--reproduce", "--model", model,
                "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("explained by the configuration, not a bug: the exact reference differs from attn_out-0 on "
            "(nmse=2.305e-07), the reference with the dump's configuration agrees at all 94 points") in r.stdout
    reproduced = json.loads((tmp_path / "r.json").read_text())["reproduced"]["points"]
    # --numerics ggml-cpu rounds as llama.cpp: every printed value within its 5e-5 print rounding
    assert len(reproduced) == 94 and max(p["nmse"] for p in reproduced) == 0.0
    assert all(p["sum_ok"] is not False for p in reproduced)


def test_planted_post_norm_change_is_named_against_the_default_dump(tmp_path):
    """The dump is llama.cpp on the committed model; the reference runs a copy whose layer-2
    post-attention norm weight is 1 % larger. Against the exact reference the configuration's
    rounding comes first (attn_out-0); against the reference with the dump's configuration the
    planted change is named."""
    model = planted_copy(tmp_path)
    t32, t64 = exact_traces(model, [497, 319, 261, 84, 77], tmp_path)
    r = run_cli("tools.bisect", t32, DEFAULT_DUMP, "--noise-floor", t64, "--reproduce", "--model", model)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("first divergence: attn_post_norm-2 (layer 2, op attn_post_norm) nmse="), last
    assert last.endswith("(against the reference with the dump's configuration)")


def test_reproduce_bad_input_exits_2_with_one_line(tmp_path):
    t32, _ = exact_traces(os.path.join(MODELS, "tiny-a-f32.gguf"), [497, 319, 261, 84, 77], tmp_path)
    cli_error(run_cli("tools.bisect", t32, DEFAULT_DUMP, "--reproduce"),
              "tools.bisect: --reproduce needs --model, the GGUF the dump was made from")
    no_prompt = tmp_path / "no-prompt.txt"
    no_prompt.write_text("".join(line for line in open(DEFAULT_DUMP) if "number of input tokens" not in line))
    cli_error(run_cli("tools.bisect", t32, no_prompt, "--reproduce", "--model", MODELS),
              "tools.bisect: --reproduce: the dump does not log its prompt token ids")
    cli_error(run_cli("tools.bisect", t32, DEFAULT_DUMP, "--reproduce", "--model", tmp_path / "missing.gguf"),
              "tools.bisect: --reproduce: reference.run failed")
    mixed = tmp_path / "mixed.txt"
    mixed.write_text(open(REAL_DUMP).read().replace("cache_k_l0 (view) = (f32)", "cache_k_l0 (view) = (q4_0)"))
    cli_error(run_cli("tools.bisect", t32, mixed, "--reproduce", "--model", MODELS),
              "tools.bisect: --reproduce: reference.run --numerics ggml-cpu models the cache types f32, f16, q8_0; "
              "the dump's are K q4_0, V f32")
    cli_error(run_cli("tools.bisect", DEFAULT_DUMP, mixed, "--reproduce", "--model", MODELS, "--threshold", "0"),
              "tools.bisect: --reproduce needs one llama.cpp dump and one trace")


MODEL_CONVERSION = os.path.join(ROOT, "tests", "fixtures", "model-conversion")  # llama-debug --save-logits
LOGITS_BIN = os.path.join(MODEL_CONVERSION, "llamacpp-tiny-a-f32.bin")
EMBEDDINGS_BIN = os.path.join(MODEL_CONVERSION, "llamacpp-tiny-a-f32-embeddings.bin")


@pytest.fixture(scope="module")
def exact_trace(tmp_path_factory):  # -> (float32 trace dir, float64 trace dir) of tiny-a-f32 on the dumps' prompt
    return exact_traces(os.path.join(MODELS, "tiny-a-f32.gguf"), [497, 319, 261, 84, 77], tmp_path_factory.mktemp("t"))


@pytest.mark.parametrize("path, name", [(LOGITS_BIN, "result_output"), (EMBEDDINGS_BIN, "result_norm")])
def test_model_conversion_bin_matches_the_reference(exact_trace, path, name):
    """llama-debug's raw float32: the last token's logits, or every token's result_norm. Measured:
    NMSE 2.4e-13 (logits) and below 1e-12 (result_norm), 30x under the noise-floor threshold."""
    from reference.trace import load_trace
    t32, t64 = exact_trace
    trace = load_trace(t32)
    points, notes, config = dump_parse.load_logits_bin(path, trace)
    assert list(points) == [name] and config is None and notes[0].endswith("prompt 497,319,261,84,77")
    thresholds = bisect_tool.noise_thresholds(trace, load_trace(t64))
    result = bisect_tool.bisect(trace, points, thresholds)
    assert result["first"] is None and [p["name"] for p in result["points"]] == [name]
    assert result["points"][0]["nmse"] < thresholds[name] / 10
    assert (points[name].argmax(-1) == trace[name][-len(points[name]):].argmax(-1)).all()
    r = run_cli("tools.bisect", t32, path, "--noise-floor", t64)
    assert r.returncode == 0 and "no divergence above threshold (1 points compared)" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("path, name", [(LOGITS_BIN, "result_output"), (EMBEDDINGS_BIN, "result_norm")])
def test_planted_post_norm_change_is_seen_in_the_bin(tmp_path, path, name):
    """A 1 % larger layer-2 post-attention norm weight in the reference's copy of the model: the one
    point the .bin holds diverges (the format tells whether, not where)."""
    planted, planted64 = exact_traces(planted_copy(tmp_path), [497, 319, 261, 84, 77], tmp_path)
    r = run_cli("tools.bisect", planted, path, "--noise-floor", planted64)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"first divergence: {name} (layer -, op {name}) nmse=" in r.stdout


def test_bad_model_conversion_bin_exits_2_with_one_line(tmp_path, exact_trace):
    t32, _ = exact_trace
    logits = open(LOGITS_BIN, "rb").read()
    cases = {"odd.bin": (logits[:-2], "2046 bytes are not float32 rows of 512 (the other side's result_output)"),
             "short.bin": (logits[:-4 * 256], "1024 bytes are not float32 rows of 512"),
             "two.bin": (logits * 2, "2 rows of 512; llama-debug writes the last token's logits (1 row)"),
             "empty.bin": (b"", "0 bytes are not float32 rows")}
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        cli_error(run_cli("tools.bisect", t32, tmp_path / name), f"tools.bisect: {tmp_path / name}: {message}")
    embeddings = np.fromfile(EMBEDDINGS_BIN, np.float32).reshape(5, -1)
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)  # llama-debug's default --embd-normalize 2
    unit.astype(np.float32).tofile(tmp_path / "unit-embeddings.bin")
    cli_error(run_cli("tools.bisect", t32, tmp_path / "unit-embeddings.bin"), "every row has unit L2 norm",
              "--embd-normalize -1")
    (tmp_path / "x-embeddings.bin").write_bytes(open(EMBEDDINGS_BIN, "rb").read())
    (tmp_path / "x-embeddings-tokens.bin").write_bytes(np.arange(4, dtype=np.int32).tobytes())
    cli_error(run_cli("tools.bisect", t32, tmp_path / "x-embeddings.bin"), "5 rows of 256", "(4 tokens)")
    (tmp_path / "y.bin").write_bytes(logits)
    (tmp_path / "y-tokens.bin").write_bytes(np.arange(4, dtype=np.int32).tobytes())
    cli_error(run_cli("tools.bisect", t32, tmp_path / "y.bin"), "made from 4 tokens, the other side from 5")
    (tmp_path / "y-tokens.bin").write_bytes(b"123")
    cli_error(run_cli("tools.bisect", t32, tmp_path / "y.bin"), "y-tokens.bin: 3 bytes are not int32 token ids")
    cli_error(run_cli("tools.bisect", FIXTURE, LOGITS_BIN), "16 rows of 32; llama-debug writes the last token")
    cli_error(run_cli("tools.bisect", LOGITS_BIN, EMBEDDINGS_BIN), "the other side records no result_output")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.replace("{256, 5, 1, 1}", "{256, 5, 1}", 1), "is not 4 plausible dimensions"),
    (lambda t: t.replace("0.8535,", "0.85x5,", 1), "'0.85x5' is not a number"),
    (lambda t: t.replace("-0.7065  ]", "-0.7065, 1.0  ]", 1), "more values than ne [256, 5, 1, 1] allows"),
], ids=["three-dims", "not-a-number", "too-many-values"])
def test_malformed_real_dump_exits_2_with_one_line(tmp_path, change, message):
    text = open(DEFAULT_DUMP).read()
    bad = change(text)
    assert bad != text
    (tmp_path / "bad.txt").write_text(bad)
    cli_error(run_cli("tools.bisect", FIXTURE, tmp_path / "bad.txt"), f"tools.bisect: {tmp_path / 'bad.txt'}:",
              message)


UB3_DUMP = os.path.join(ROOT, "tests", "fixtures", "tiny-a-f32.ub3.eval-callback.txt")  # defaults and -ub 3


def test_ubatches_of_a_default_dump_are_reproduced(tmp_path, exact_trace):
    """The prompt in ubatches of 3 + 2 tokens: the second attends over the first's F16 cache. bisect
    passes -ub 3, and the reference with that configuration agrees at every point."""
    config = dump_parse.load_dump(UB3_DUMP).config
    assert (config.cache_k, config.flash_attn, config.ubatches) == ("f16", True, [3, 2])
    assert config.reference_options()[-2:] == ["-ub", "3"]
    t32, t64 = exact_trace
    r = run_cli("tools.bisect", t32, UB3_DUMP, "--noise-floor", t64, "--reproduce", "--model",
                os.path.join(MODELS, "tiny-a-f32.gguf"), "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 ubatches of 3+2 tokens" in r.stdout and "-ub 3 --trace TRACE_DIR" in r.stdout
    assert "explained by the configuration, not a bug" in r.stdout
    reproduced = json.loads((tmp_path / "r.json").read_text())["reproduced"]["points"]
    assert len(reproduced) == 94 and max(p["nmse"] for p in reproduced) == 0.0


LLAMA_DEBUG_DUMP = os.path.join(ROOT, "tests", "fixtures", "tiny-a-f32.llama-debug.txt")  # --verbose, filtered


def test_llama_debug_dump_with_warm_up_and_filter(tmp_path, exact_trace):
    """llama-debug --verbose with its defaults: a warm-up pass of 2 tokens first, the prompt logged
    after the tensors as `piece(id)`, and a --tensor-filter keeping 18 trace points, the cache views
    and the node_* tensors (the FLASH_ATTN_EXT nodes among them)."""
    t32, t64 = exact_trace
    dump = dump_parse.load_dump(LLAMA_DEBUG_DUMP, n_tokens=5)
    assert dump.notes == [f"{LLAMA_DEBUG_DUMP}: dropped the first pass (2 tokens) as a warm-up run"]
    config = dump.config
    assert (config.cache_k, config.cache_v, config.flash_attn, config.ubatches) == ("f16", "f16", True, [5])
    assert config.prompt == [497, 319, 261, 84, 77]
    model = os.path.join(MODELS, "tiny-a-f32.gguf")
    r = run_cli("tools.bisect", t32, LLAMA_DEBUG_DUMP, "--noise-floor", t64, "--reproduce", "--model", model)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the reference with the dump's configuration agrees at all 18 points" in r.stdout
    planted, planted64 = exact_traces(planted_copy(tmp_path), config.prompt, tmp_path)
    r = run_cli("tools.bisect", planted, LLAMA_DEBUG_DUMP, "--noise-floor", planted64, "--reproduce", "--model",
                planted_copy(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("first divergence: attn_post_norm-2 (layer 2, op attn_post_norm)")


def test_a_configuration_the_dump_hides_is_not_guessed(tmp_path, exact_trace):
    """A --tensor-filter that leaves out the cache views and the attention nodes: neither the cache
    types nor flash attention can be read, so nothing is put down to them and nothing is reproduced."""
    t32, _ = exact_trace
    text = open(DEFAULT_DUMP).read()
    blocks = text.split("common_debug_cb_eval:")
    kept = [b for b in blocks[1:] if not any(k in b.split("=", 1)[0] for k in ("cache_", "node_", "kq"))]
    hidden = tmp_path / "filtered.txt"
    hidden.write_text(blocks[0] + "".join("common_debug_cb_eval:" + b for b in kept))
    config = dump_parse.load_dump(str(hidden)).config
    assert (config.cache_k, config.cache_v, config.flash_attn, config.exact) == (None, None, None, False)
    assert config.describe() == "CPU avx512, K cache ?, V cache ?, flash attention ?, 1 ubatch of 5 tokens"
    r = run_cli("tools.bisect", t32, hidden)
    assert r.returncode == 1 and "not reproducible: the dump does not show its cache types" in r.stdout
    cli_error(run_cli("tools.bisect", t32, hidden, "--reproduce", "--model", MODELS),
              "tools.bisect: --reproduce: the dump does not show its cache types")


# ---------------------------------------------------------------------------------------------
# The CPU build: the dump's system_info line, --cpu

def system_info_of(target):  # -> the "CPU : ..." features that target's llama.cpp build logged (golden/cpu_targets)
    with open(os.path.join(ROOT, "golden", "cpu_targets", target, "manifest.json")) as f:
        return json.load(f)["system_info"]


def dump_with_system_info(tmp_path, features):  # -> DEFAULT_DUMP, its system_info showing `features` (None: no line)
    lines = open(DEFAULT_DUMP).read().splitlines(keepends=True)
    assert sum("system_info:" in x for x in lines) == 1
    edited = [x if "system_info:" not in x else "" if features is None else re.sub(r"CPU : .*", features, x)
              for x in lines]
    path = tmp_path / f"dump-{features and target_of_system_info(features)}.txt"
    path.write_text("".join(edited))
    return str(path)


# x64 logs no CPU feature at all: its load_backend line names it (test_cpu_variant_is_read_from_the_load_line)
@pytest.mark.parametrize("target", [name for name, t in TARGETS.items() if t.compiler == "gcc" and name != "x64"])
def test_cpu_target_is_read_from_system_info(tmp_path, target):
    """Each target's own build logged its features (golden/cpu_targets/<target>/manifest.json): the
    dump's configuration names that target and reproduces with --cpu <target>. An ARM build's line is
    read the same under clang (test_cpu_targets.py: it lacks only OPENMP, which a GCC build may lack
    too): the note says which --cpu that build is, and --cpu naming it is no mismatch."""
    config = dump_parse.load_dump(dump_with_system_info(tmp_path, system_info_of(target))).config
    clang = CLANG_BUILDS.get(target)
    assert config.cpu == target and config.cpu_note() == (clang and (
        f"system_info does not show the compiler: a clang build (as on macOS) is --cpu {clang.name}"))
    if clang is not None:
        assert config.cpu_note(clang.name) is None and config.cpu_note("avx2") is not None
    assert config.describe().startswith(f"CPU {target}, K cache f16")
    assert config.reference_options()[-2:] == ["--cpu", target]


def dump_with_loaded_variant(tmp_path, variant):  # -> DEFAULT_DUMP with the load_backend line a DL build logs first
    path = tmp_path / f"dump-{variant}.txt"
    path.write_text(f"load_backend: loaded CPU backend from /opt/llama/libggml-cpu-{variant}.so\n"
                    + open(DEFAULT_DUMP).read())
    return str(path)


@pytest.mark.parametrize("variant, target", [("haswell", "avx2"), ("alderlake", "avx2"), ("zen4", "avx512"),
                                             ("x64", "x64")])
def test_cpu_variant_is_read_from_the_load_line(tmp_path, variant, target):
    """A GGML_BACKEND_DL build logs the variant it loaded (ggml-backend-reg.cpp:259); it names the
    build over the system_info line (here the avx512 build's), and --cpu proposes it by llama.cpp's
    name; --cpu naming the target it rounds as is no mismatch, another target is."""
    config = dump_parse.load_dump(dump_with_loaded_variant(tmp_path, variant)).config
    assert config.cpu == variant and config.cpu_note() is None
    assert config.reference_options()[-2:] == ["--cpu", variant]
    assert config.cpu_note(target) is None and config.cpu_note(variant) is None
    other = "avx512" if target == "avx2" else "avx2"
    assert config.cpu_note(other) == f"--cpu {other}: the dump's load_backend line shows the {variant} build"


def test_unmodelled_cpu_variant_is_refused_with_its_reason(tmp_path):
    config = dump_parse.load_dump(dump_with_loaded_variant(tmp_path, "sapphirerapids")).config
    with pytest.raises(dump_parse.DumpError, match="sapphirerapids variant: its AMX buffer type"):
        config.reference_options()


def test_system_info_of_an_unmodelled_cpu_is_said(tmp_path):
    """A line with no CPU feature (x86's x64 variant, or an architecture not modelled) is none of the
    targets: the default, with a line."""
    config = dump_parse.load_dump(dump_with_system_info(tmp_path, "CPU : LLAMAFILE = 1 | OPENMP = 1 |")).config
    assert config.cpu is None and config.describe().startswith("CPU ?, ")
    assert config.cpu_note() == ("the dump's system_info shows none of the CPU builds avx2, avx512, neon, neon-i8mm, "
                                 "neon-clang, neon-i8mm-clang, sandybridge, ivybridge, piledriver, sse42, x64: the "
                                 "reference rounds as avx512, the default")
    assert config.reference_options()[-2:] == ["--cpu", "avx512"]


def test_reproduction_runs_with_the_dumps_cpu(tmp_path, exact_trace, monkeypatch, capsys):
    """DEFAULT_DUMP (printed by the AVX512 build) with the system_info line of the AVX2 build: the
    printed command and the reference.run that --reproduce starts both round as avx2, and the
    reproduction then differs from the dump, which the same reproduction as avx512 does not
    (test_default_dump_of_the_unmodified_model_is_explained_not_a_bug: all 94 points at NMSE 0)."""
    t32, t64 = exact_trace
    started = []
    run = bisect_tool.subprocess.run
    monkeypatch.setattr(bisect_tool.subprocess, "run",
                        lambda command, **kw: started.append(command) or run(command, **kw))
    dump = dump_with_system_info(tmp_path, system_info_of("avx2"))
    status = bisect_tool.main([t32, dump, "--noise-floor", t64, "--reproduce", "--model",
                               os.path.join(MODELS, "tiny-a-f32.gguf")])
    out = capsys.readouterr().out
    assert "llama.cpp configuration: CPU avx2, K cache f16" in out
    assert "-fa on --cpu avx2 --trace TRACE_DIR" in out
    assert len(started) == 1 and started[0][started[0].index("--cpu") + 1] == "avx2"
    # measured: attn_o_proj-4 at NMSE 1.7e-9, about 190 x its noise-floor threshold
    assert status == 1 and out.strip().endswith("(against the reference with the dump's configuration)")


def test_dump_without_system_info_is_reproduced_as_the_default(tmp_path, exact_trace):
    t32, t64 = exact_trace
    r = run_cli("tools.bisect", t32, dump_with_system_info(tmp_path, None), "--noise-floor", t64)
    assert r.returncode == 1, r.stderr
    assert "llama.cpp configuration: CPU ?, K cache f16" in r.stdout
    assert ("the dump logs no system_info line (its CPU build): the reference rounds as avx512, the default"
            in r.stdout.splitlines())
    assert "-fa on --cpu avx512 --trace TRACE_DIR" in r.stdout


def test_cpu_flag_overrides_the_dump(exact_trace):
    t32, t64 = exact_trace
    r = run_cli("tools.bisect", t32, DEFAULT_DUMP, "--noise-floor", t64, "--cpu", "avx2")
    assert r.returncode == 1, r.stderr
    assert "--cpu avx2: the dump's system_info shows the avx512 build" in r.stdout.splitlines()
    assert "-fa on --cpu avx2 --trace TRACE_DIR" in r.stdout


def test_bad_cpu_exits_2_with_one_line(exact_trace):
    t32, t64 = exact_trace
    cli_error(run_cli("tools.bisect", t32, DEFAULT_DUMP, "--cpu", "sse4"), "argument --cpu: invalid choice: 'sse4'")
    cli_error(run_cli("tools.bisect", t32, t64, "--cpu", "avx2"),
              "tools.bisect: --cpu chooses the CPU build a llama.cpp text dump is reproduced as; neither side is one")


NEON_FIXTURES = os.path.join(ROOT, "golden", "cpu_targets", "neon")  # the neon build under qemu (make_cpu_target_goldens --fixtures)


def test_neon_dump_of_llama_cpp_is_the_reference_at_every_point(tmp_path):
    """llama-eval-callback of the neon (armv8.2-a+dotprod+fp16) build, run under qemu on tiny-b-q8_0
    with llama.cpp's default CPU_REPACK (Q8_0 as q8_0_4x4), "the sun", F32 KV, flash attention off;
    the reference with --cpu neon and the same options. bisect reads the target from the dump's
    system_info. Gate: NMSE 0 at every point, because both sides print the same float32 values."""
    manifest = json.loads(open(os.path.join(NEON_FIXTURES, "manifest.json")).read())["fixtures"]
    model = os.path.join(ROOT, manifest["model"]["file"])
    dump = os.path.join(NEON_FIXTURES, manifest["eval_callback"]["file"])
    r = run_cli("reference.run", "--model", model, "--prompt", "the sun", "--n-predict", "1", "--numerics", "ggml-cpu",
                "--cpu", "neon", "--kv-type", "f32", "--flash-attn", "off", "--trace", tmp_path / "trace")
    assert r.returncode == 0, r.stderr
    r = run_cli("tools.bisect", tmp_path / "trace", dump, "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "llama.cpp configuration: CPU neon, K cache f32, V cache f32, flash attention off" in r.stdout
    points = [p for p in json.loads((tmp_path / "b.json").read_text())["points"] if p["only_in"] is None]
    assert len(points) == 58  # measured: every named point the dump and the trace share
    assert all(p["nmse"] == 0.0 and p["sum_ok"] is not False for p in points), [p["name"] for p in points if p["nmse"]]


@pytest.fixture(scope="module")
def real_traces(tmp_path_factory):  # -> (float32 trace, float64 trace) of the real dump's prompt, through the CLI
    out, ids = tmp_path_factory.mktemp("real"), ",".join(map(str, dump_prompt(REAL_DUMP)))
    for dtype in ("float32", "float64"):
        r = run_cli("reference.run", "-m", os.path.join(MODELS, "tiny-a-f32.gguf"), "--token-ids", ids, "-n", "1",
                    "--kv", "uniform", "--dtype", dtype, "--trace", out / dtype)
        assert r.returncode == 0, r.stderr
    return out / "float32", out / "float64"


@pytest.mark.parametrize("cut", [0.97, 0.8, 0.5, 0.2, "boundary"])
def test_a_dump_whose_tail_was_lost_is_compared_up_to_its_last_whole_point(real_traces, tmp_path, cut):
    """llama-eval-callback's logger can lose a dump's tail at exit (210 and 198 of 217 points kept through
    a pipe): the real dump cut inside a tensor near its end, at 80%, half way and 20% of its lines, and
    at a tensor boundary. The whole points agree (as the whole dump does, 94 points), the lost ones are
    counted in one line and never a divergence, and compared + lost = the 94 of the whole dump."""
    t32, t64 = real_traces
    lines = open(REAL_DUMP).read().splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("common_debug_cb_eval:")]
    end = heads[len(heads) // 2] if cut == "boundary" else int(len(lines) * cut)
    if cut != "boundary":
        end += 2 if end in heads or end - 1 in heads else 0  # inside a tensor, past its header
    dump = tmp_path / "cut.txt"
    dump.write_text("\n".join(lines[:end]) + "\n")
    r = run_cli("tools.bisect", t32, dump, "--noise-floor", t64, "--json-out", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    note = next(line for line in r.stdout.splitlines() if "the dump's tail is missing" in line)
    lost = int(re.search(r": (\d+) points of the other side", note)[1])
    assert "more often through a pipe" in note and lost > 0
    result = json.loads((tmp_path / "r.json").read_text())
    compared = sum(p["nmse"] is not None for p in result["points"])
    assert result["first"] is None and compared + lost == 94, (compared, lost)
    assert f"no divergence above threshold ({compared} points compared)" in r.stdout


def test_a_dump_cut_in_the_middle_is_still_refused(tmp_path, real_traces):
    lines = open(REAL_DUMP).read().splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("common_debug_cb_eval:")]
    middle = tmp_path / "middle.txt"  # a tensor's last rows and sum gone, the dump going on after it
    middle.write_text("\n".join(lines[:heads[40] + 3] + lines[heads[41]:]) + "\n")
    cli_error(run_cli("tools.bisect", real_traces[0], middle), "truncated", "its values stop before the next tensor")


@pytest.mark.parametrize("kind, value", [("NaN", np.nan), ("Inf", np.inf)])
def test_a_nonfinite_value_is_the_first_divergence_with_its_kind(real_traces, tmp_path, kind, value):
    """A NaN or Inf in a trace is named as what it is, at the first point that holds one."""
    t32 = real_traces[0]
    broken = tmp_path / "broken"
    shutil.copytree(t32, broken)
    index = json.loads((broken / "index.json").read_text())
    name = index[10]["name"]
    a = np.load(broken / f"{name}.npy")
    a.reshape(-1)[7] = value
    np.save(broken / f"{name}.npy", a)
    r = run_cli("tools.bisect", t32, broken, "--threshold", "1e-6")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"first divergence: {name} (" in r.stdout and f"{kind} in B (1 values)" in r.stdout, r.stdout


def debug_print(name, a, n, sum_sq):  # [.., ] f32 -> common_debug_print_tensor's lines for it, n values a side
    """The printing loop of llama.cpp 0c1e570's common/debug.cpp with another n (as a build printing
    more or fewer values would) and, with sum_sq, the sum of squares a later llama-debug prints beside sum."""
    ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
    x = a.reshape(ne[3], ne[2], ne[1], ne[0]).astype(np.float32)
    lines = [f"common_debug_cb_eval: {name:>24} = (f32) {'ADD':>10}(x{{{ne[0]}, 1, 1, 1}}, }}) = "
             f"{{{', '.join(map(str, ne))}}}"]

    def shown(count):  # -> the indices printed of a dimension, None where "..." stands
        return list(range(count)) if count <= 2 * n else [*range(n), None, *range(count - n, count)]
    for i3 in range(ne[3]):
        lines.append("    [")
        for i2 in shown(ne[2]):
            if i2 is None:
                lines.append("        ..., ")
                continue
            lines.append("        [")
            for i1 in shown(ne[1]):
                if i1 is None:
                    lines.append("            ..., ")
                    continue
                row = "".join("   ..., " if i0 is None else f"{x[i3, i2, i1, i0]:12.4f}" + (", " if i0 < ne[0] - 1 else "")
                              for i0 in shown(ne[0]))
                lines.append(f"            [{row}  ],")
            lines.append("        ],")
        lines.append("    ]")
        lines.append(f"    sum = {float(x.sum(dtype=np.float32)):f}")
        if sum_sq:
            lines.append(f"    sum_sq = {float(np.square(x).sum(dtype=np.float32)):f}")
    return lines


@pytest.mark.parametrize("n, sum_sq", [(1, False), (3, True), (8, True)])
def test_dumps_of_any_print_count_and_with_sum_sq(real_traces, tmp_path, n, sum_sq):
    """A dump printing n values a side (1, the 3 of 0c1e570, 8) is read at the right indices, and a
    printed sum_sq is a second check: the reference's own trace printed so agrees at every point; a
    sum_sq changed by 1% fails its point."""
    from reference.trace import load_trace
    trace = load_trace(real_traces[0])
    names = [name for name in trace if name != "result_output"] + ["result_output"]
    lines = [line for name in names for line in debug_print(name, trace[name], n, sum_sq)]
    dump = tmp_path / "dump.txt"
    dump.write_text("\n".join(lines) + "\n")
    r = run_cli("tools.bisect", real_traces[0], dump, "--threshold", "1e-9", "--json-out", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    assert len(points) == len(trace) and all(p["sum_ok"] for p in points)
    if sum_sq:
        at = next(i for i, line in enumerate(lines) if line.strip().startswith("sum_sq") and i > len(lines) // 2)
        value = float(lines[at].split("=")[1])
        lines[at] = f"    sum_sq = {value * 1.01:f}"
        dump.write_text("\n".join(lines) + "\n")
        r = run_cli("tools.bisect", real_traces[0], dump, "--threshold", "1e-9")
        assert r.returncode == 1 and "(sum check failed)" in r.stdout, r.stdout


LOG_STAMP = "0.00.010.601 D "  # common_init's log prefix with timestamps, on by default


def later_llama_debug(lines):  # debug_print's lines (with sum_sq) -> as a later llama-debug --verbose logs them
    """examples/debug after 0c1e570 prints a tensor through LOG_DBG, one call per piece ("[", each
    value, each ", ", "],"), so the log's prefix stands before every piece; its sums read
    `sum    = ` and `sum_sq = `; its header names ggml_debug."""
    out = []
    for line in lines:
        start = line.find("[")
        if start >= 0 and line.rstrip().endswith("],") and any(c.isdigit() for c in line):  # a row of values
            pieces = [line[:start + 1], *(p for p in re.split(r"(, )", line[start + 1:line.rindex("]")]) if p), "],"]
            out.append("".join(LOG_STAMP + p for p in pieces))
        else:
            out.append(LOG_STAMP + line.replace("common_debug_cb_eval:", "ggml_debug:").replace("sum = ", "sum    = "))
    return out


def test_a_later_llama_debug_dump_is_read_with_its_sum_sq(real_traces, tmp_path):
    """A later llama-debug's output (a prefix before each logged piece, padded sums, sum_sq) of the
    reference's own trace agrees at every point, both sums checked; a sum_sq changed by 1% fails."""
    from reference.trace import load_trace
    trace = load_trace(real_traces[0])
    names = [name for name in trace if name != "result_output"] + ["result_output"]
    lines = later_llama_debug([line for name in names for line in debug_print(name, trace[name], 3, True)])
    dump = tmp_path / "debug.txt"
    dump.write_text("\n".join(lines) + "\n")
    points = dump_parse.load_dump(str(dump)).points
    assert all(points[name].sum_sq is not None and points[name].values.size for name in names)
    r = run_cli("tools.bisect", real_traces[0], dump, "--threshold", "1e-9", "--json-out", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert len(result["points"]) == len(trace) and all(p["sum_ok"] for p in result["points"])
    at = max(i for i, line in enumerate(lines) if "sum_sq = " in line)
    value = float(lines[at].split("=")[1])
    lines[at] = f"{LOG_STAMP}    sum_sq = {value * 1.01:f}"
    dump.write_text("\n".join(lines) + "\n")
    r = run_cli("tools.bisect", real_traces[0], dump, "--threshold", "1e-9")
    assert r.returncode == 1 and "first divergence: result_output" in r.stdout and "(sum check failed)" in r.stdout


def at_verbosity(lines, level):  # the real dump's lines (made at -lv 3, the default) -> as -lv `level` logs them
    """0c1e570's -lv is the log threshold (common/log.h): tensors are LOG output (level 0, no prefix),
    kept at every level; I lines (3) go below 3, W (2) below 2, E (1) at 0; at 5 debug lines come,
    here between tensors and inside a tensor's body."""
    kept = {"I": 3, "W": 2, "E": 1}
    out = [line for line in lines
           if not (dump_parse.LOG_PREFIX.match(line) and kept[line.split(" ")[1]] > level)]
    if level >= 5:
        out = [x for line in out for x in (line, f"{LOG_STAMP}ggml_backend_sched: debug line") if x]
    return out


@pytest.mark.parametrize("level", [0, 1, 2, 3, 4, 5])
def test_every_verbosity_level_of_eval_callback_bisects_alike(real_traces, tmp_path, level):
    """The real dump as each -lv level of llama-eval-callback would log it: the same points, the same
    NMSE at each, the same verdict; below 3 the prompt's token ids are not logged."""
    lines = open(REAL_DUMP).read().splitlines()
    dump = tmp_path / f"lv{level}.txt"
    dump.write_text("\n".join(at_verbosity(lines, level)) + "\n")
    reference = dump_parse.load_dump(REAL_DUMP)
    parsed = dump_parse.load_dump(str(dump))
    assert parsed.config.prompt == (reference.config.prompt if level >= 3 else None)
    assert list(parsed.points) == list(reference.points)
    for name, t in parsed.points.items():
        assert np.array_equal(t.values, reference.points[name].values) and t.sum == reference.points[name].sum, name
    r = run_cli("tools.bisect", real_traces[0], dump, "--noise-floor", real_traces[1])
    expected = run_cli("tools.bisect", real_traces[0], REAL_DUMP, "--noise-floor", real_traces[1])

    def verdict(out):  # -> the verdict line of a bisect's output
        return next(line for line in out.splitlines() if re.match(r"(first|no) divergence", line))
    assert r.returncode == expected.returncode and verdict(r.stdout) == verdict(expected.stdout)
    assert ("the dump logs no system_info line" in r.stdout) == (level < 3)  # system_info is an I line


@pytest.mark.parametrize("printed, kind", [("nan", "NaN"), ("-nan", "NaN"), ("inf", "Inf"), ("-inf", "Inf")])
def test_a_nonfinite_value_in_a_dump_is_the_first_divergence_with_its_kind(real_traces, tmp_path, printed, kind):
    """%12.4f prints a NaN as nan or -nan and an Inf as inf or -inf: read as such, the first point
    holding one is the first divergence, named with its kind."""
    lines = open(REAL_DUMP).read().splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("common_debug_cb_eval:")]
    at = next(i for i in range(heads[30], heads[31]) if lines[i].strip().startswith("[") and "," in lines[i])
    name = dump_parse.HEADER.match(lines[heads[30]])["name"].strip()
    first = lines[at].index("[") + 1
    value = lines[at][first:].split(",")[0]
    lines[at] = lines[at][:first] + f"{printed:>12}" + lines[at][first + len(value):]
    dump = tmp_path / "nonfinite.txt"
    dump.write_text("\n".join(lines) + "\n")
    r = run_cli("tools.bisect", real_traces[0], dump, "--threshold", "inf")
    assert r.returncode == 1, r.stdout + r.stderr
    verdict = next(line for line in r.stdout.splitlines() if line.startswith("first divergence"))
    assert verdict.startswith(f"first divergence: {name} (") and verdict.endswith(f"{kind} in B (1 values)"), r.stdout
