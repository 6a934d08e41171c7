"""tools.hf_trace: transformers' forward as a trace source for tools.bisect.

tests/fixtures/hf-trace-tiny-a/ is `python -m tools.hf_trace` on build/tiny/tiny-a (the HF checkpoint
of golden/models/tiny-a-f32.gguf), float32, eager attention, for the first 4 tokens of the "len7"
prompt, without attn_gate_sig and ffn_inp (command and manifest in golden/README.md and the
fixture's manifest.json). It holds 84 points: every op of our trace on every layer but those two
(sigmoid(attn_gate_proj) and a residual add, the two that only repeat their neighbours).

Threshold: tools.bisect's --noise-floor rule, per point 64 x NMSE(float64 trace, float32 trace) of
the reference's clean run: transformers is one more float32 engine with its own rounding, which is
what that rule was set for (64 = 8^2: 2 for the second engine's rounding, 4 for a different summation
order). Measured: NMSE(reference f32, transformers) at most 1.5e-12 (ffn_post_norm-3), at least
2.9x under its threshold on every point (attn_post_norm-1).
"""
import json
import os
import re

import numpy as np
import pytest
from conftest import MODELS, ROOT, run_cli
from test_bisect import planted_copy
from test_planted_bugs import GateAfterOProj, NormWeightOff, PostNormEps, ScalarSwaRule

from reference import gguf, ops
from reference.text import TextModel
from reference.trace import Tracer, load_trace
from tools import common
from tools.parity import bisect as bisect_tool
from tools.parity import dump_parse, hf_names, hf_trace

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf-trace-tiny-a")
CHECKPOINT = os.path.join(ROOT, "build", "tiny", "tiny-a")


def fixture_manifest():  # -> the fixture's manifest.json
    with open(os.path.join(FIXTURE, "manifest.json")) as f:
        return json.load(f)


def trace_of(lm, ids):  # -> {name: tensor} of one prefill
    tracer = Tracer(keep_in_memory=True)
    lm.prefill(ids, lm.new_cache(len(ids), "uniform"), trace=tracer)
    return tracer.points


@pytest.fixture(scope="module")
def setup():  # -> (token ids, HF trace, GGUFModel, clean reference trace, per-point thresholds)
    ids = fixture_manifest()["token_ids"]
    model = gguf.load(os.path.join(MODELS, "tiny-a-f32.gguf"), "text")
    clean = trace_of(TextModel(model), ids)
    thresholds = bisect_tool.noise_thresholds(clean, trace_of(TextModel(model, np.float64), ids))
    return ids, load_trace(FIXTURE), model, clean, thresholds


def test_fixture_is_small_and_says_what_made_it():
    about = fixture_manifest()
    assert (about["engine"], about["version"], about["checkpoint"]) == ("transformers", "5.23.0", "tiny-a")
    assert about["options"]["dtype"] == "float32" and about["options"]["attn_implementation"] == "eager"
    assert about["token_ids"] == [497, 85, 318, 217]
    size = sum(os.path.getsize(os.path.join(FIXTURE, f)) for f in os.listdir(FIXTURE))
    assert size < 300_000


def test_reference_matches_transformers_within_the_noise_floor(setup):
    ids, hf, _, clean, thresholds = setup
    assert set(hf) <= set(clean) and len(hf) == 84
    left_out = set(fixture_manifest()["left_out"])
    assert {name.rpartition("-")[0] for name in set(clean) - set(hf)} == left_out
    assert all(hf[name].shape == clean[name].shape for name in hf)  # [T, H, D] heads, GGUF row order
    result = bisect_tool.bisect(clean, hf, thresholds)
    assert result["first"] is None
    compared = [p for p in result["points"] if p["nmse"] is not None]
    assert len(compared) == 84
    logits_ref, logits_hf = clean["result_output"], hf["result_output"]
    assert (logits_ref.argmax(-1) == logits_hf.argmax(-1)).all()


def test_rope_points_only_on_sliding_window_layers(setup):
    _, hf, model, _, _ = setup
    roped = sorted(int(n.rpartition("-")[2]) for n in hf if n.startswith("Qcur_rope-"))
    assert roped == [il for il, swa in enumerate(model.config.swa_layers) if swa] == [1, 2, 3]


@pytest.mark.parametrize("bug, name, only_in", [
    (PostNormEps, "attn_post_norm-0", None),
    (NormWeightOff, "attn_post_norm-2", None),
    (GateAfterOProj, "attn_o_proj-0", None),
    (ScalarSwaRule, "Qcur_rope-0", "B"),  # RoPE on layer 0, which transformers leaves NoPE
])
def test_planted_bug_is_named_against_transformers(setup, bug, name, only_in):
    """transformers' trace as A, a reference with a planted bug as B."""
    ids, hf, model, _, thresholds = setup
    first = bisect_tool.bisect(hf, trace_of(bug(model), ids), thresholds)["first"]
    assert first is not None and (first["name"], first["only_in"]) == (name, only_in)


def test_neox_rope_is_named_against_transformers(setup, monkeypatch):
    ids, hf, model, _, thresholds = setup
    monkeypatch.setattr(ops, "rope_norm", ops.rope_neox)
    first = bisect_tool.bisect(hf, trace_of(TextModel(model), ids), thresholds)["first"]
    assert (first["name"], first["layer"], first["op"]) == ("Qcur_rope-1", 1, "Qcur_rope")
    assert first["nmse"] > 1e-3


def test_bisect_command_line_takes_the_fixture_directly(setup, tmp_path, capsys):
    ids, _, model, _, _ = setup
    for dtype, directory in ((np.float32, tmp_path / "t32"), (np.float64, tmp_path / "t64")):
        lm, tracer = TextModel(model, dtype), Tracer(str(directory))
        lm.prefill(ids, lm.new_cache(len(ids), "uniform"), trace=tracer)
        tracer.close()
    assert bisect_tool.main([str(tmp_path / "t32"), FIXTURE, "--noise-floor", str(tmp_path / "t64")]) == 0
    assert "no divergence above threshold (84 points compared)" in capsys.readouterr().out


def test_bad_input(tmp_path, capsys):
    config = tmp_path / "ckpt"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"model_type": "muse_glimmer", "text_config": {"vocab_size": 512}}))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases = [(["--checkpoint", str(config), "--token-ids", "1,x"], "must be comma-separated integers"),
             (["--checkpoint", str(config), "--token-ids", "1,512"], "token id 512 out of range"),
             (["--checkpoint", str(tmp_path / "missing"), "--token-ids", "1"], "config.json: No such file or directory"),
             (["--checkpoint", str(tmp_path / "other"), "--token-ids", "1"], "not a Muse-Glimmer checkpoint"),
             (["--checkpoint", str(config), "--token-ids", "1", "--without", "attn_nrom"], "unknown trace op"),
             (["--checkpoint", str(config), "--token-ids", "1", "--only-read"], "--only-read goes with --debugger"),
             (["--checkpoint", str(config), "--token-ids", "1", "--debugger", "--without", "ffn_inp"],
              "--without without it")]
    for args, problem in cases:
        assert hf_trace.main([*args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and problem in err[0], err
    r = run_cli("tools.hf_trace", "--checkpoint", config, "--token-ids", "-1", "--out", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_regenerated_trace_equals_the_fixture(setup, tmp_path):
    pytest.importorskip("torch", reason="regenerating the transformers trace needs torch (the [parity] extra)")
    pytest.importorskip("transformers", reason="regenerating the transformers trace needs transformers")
    if not os.path.exists(os.path.join(CHECKPOINT, "model.safetensors")):
        pytest.skip("build/tiny/tiny-a is missing: make it with tools/regen/make_tiny.py")
    about = fixture_manifest()
    assert common.sha256(os.path.join(CHECKPOINT, "model.safetensors")) == about["weights_sha256"]
    ops_kept = [op for op in hf_trace.TRACE_OPS if op not in about["left_out"]]
    fresh = hf_trace.hf_trace(CHECKPOINT, about["token_ids"], str(tmp_path / "hf"), ops_kept)
    fixture = load_trace(FIXTURE)
    assert list(fresh) == list(fixture) == list(load_trace(str(tmp_path / "hf")))
    for name, x in fixture.items():
        assert fresh[name].shape == x.shape
    assert_within_noise_floor(fixture, fresh, setup[4])


def assert_within_noise_floor(fixture, fresh, thresholds):  # {name: array} x2 -> None
    """Another CPU or torch build sums in another order: it is one more float32 engine, which is what
    the noise-floor rule is for. Measured: the hf-trace fixture (made on an AVX-512 host) against a
    rerun on an AMX host, NMSE up to 1.2e-12 (ffn_out-2), above the one-rounding floor 2^-40 once used."""
    result = bisect_tool.bisect(fixture, fresh, thresholds)
    assert result["first"] is None, bisect_tool.first_line(result)


DEBUGGER = os.path.join(ROOT, "tests", "fixtures", "hf-debugger-tiny-a")  # model_addition_debugger_context
DEBUGGER_TREE = os.path.join(DEBUGGER, "MuseGlimmerForConditionalGeneration_debug_tree_FULL_TENSORS.json")


def debugger_manifest():  # -> the debugger fixture's manifest.json
    with open(os.path.join(DEBUGGER, "manifest.json")) as f:
        return json.load(f)


def planted_model(directory):  # -> GGUFModel of a copy of tiny-a-f32.gguf, one post-norm weight 1 % larger
    return gguf.load(planted_copy(directory), "text")


def test_debugger_fixture_is_small_and_says_what_made_it():
    about = debugger_manifest()
    assert (about["tool"], about["version"], about["checkpoint"]) == (
        "transformers.model_addition_debugger_context", "5.23.0", "tiny-a")
    assert about["options"]["do_prune_layers"] is False and about["options"]["use_repr"] is False
    assert about["weights_sha256"] == fixture_manifest()["weights_sha256"]  # the checkpoint of tiny-a-f32.gguf
    assert sum(os.path.getsize(os.path.join(DEBUGGER, f)) for f in os.listdir(DEBUGGER)) < 450_000


def test_debugger_dump_matches_the_reference_within_the_noise_floor(setup):
    """Every point the debugger holds (73: embd_norm, 14 per layer, result_norm, result_output) in our
    names and layout. Measured: NMSE at most 4.0e-13 (ffn_out-4), 21x under its threshold there."""
    ids, _, _, clean, thresholds = setup
    assert debugger_manifest()["token_ids"] == ids
    points, notes, config = dump_parse.load_hf_debugger(DEBUGGER)
    assert config is None and len(points) == 73 and set(points) <= set(clean)
    assert all(points[name].shape == clean[name].shape for name in points)
    missing = {name.rpartition("-")[0] or name for name in set(clean) - set(points)}
    assert missing == set(debugger_manifest()["left_out"]) == set(hf_names.HF_DEBUGGER_MISSING)
    result = bisect_tool.bisect(clean, points, thresholds)
    assert result["first"] is None and sum(p["nmse"] is not None for p in result["points"]) == 73
    assert max(p["nmse"] for p in result["points"]) < 1e-12
    assert (points["result_output"].argmax(-1) == clean["result_output"].argmax(-1)).all()


def test_planted_post_norm_change_is_named_against_the_debugger_dump(setup, tmp_path):
    """The debugger's dump as A, the reference on a copy of the GGUF whose layer-2 post-attention norm
    weight is 1 % larger as B: the first divergence is that norm's output."""
    ids, _, _, _, thresholds = setup
    points = dump_parse.load_hf_debugger(DEBUGGER_TREE).points
    first = bisect_tool.bisect(points, trace_of(TextModel(planted_model(tmp_path)), ids), thresholds)["first"]
    assert (first["name"], first["layer"], first["op"]) == ("attn_post_norm-2", 2, "attn_post_norm")
    assert first["nmse"] > 1e-5  # (1.01 - 1)^2 = 1e-4 on that point, far above the noise


def test_debugger_dump_through_the_command_line(setup, tmp_path):
    ids, _, model, _, _ = setup
    for dtype, directory in ((np.float32, tmp_path / "t32"), (np.float64, tmp_path / "t64")):
        lm, tracer = TextModel(model, dtype), Tracer(str(directory))
        lm.prefill(ids, lm.new_cache(len(ids), "uniform"), trace=tracer)
        tracer.close()
    r = run_cli("tools.bisect", tmp_path / "t32", DEBUGGER, "--noise-floor", tmp_path / "t64")
    assert r.returncode == 0 and "no divergence above threshold (73 points compared)" in r.stdout, r.stdout + r.stderr


def copy_of_debugger(directory):  # -> a writable copy of the debugger fixture
    import shutil
    return shutil.copytree(DEBUGGER, os.path.join(directory, "dbg"))


def rewrite_header(path, change):  # safetensors file, change(header dict) -> None: the data left as it was
    blob = open(path, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: the offsets still point into the data
    assert len(text) == n
    open(path, "wb").write(blob[:8] + text + blob[8 + n:])


L2_NORM = "MuseGlimmerForConditionalGeneration.model.language_model.layers.2.post_attention_layernorm_outputs.safetensors"


@pytest.mark.parametrize("case, message", [
    ("lying_shape", "claims shape [4, 512] of F32 at bytes [0, 4096) of 4096: sizes do not agree"),
    ("lying_offsets", "claims shape [1, 4, 256] of F32 at bytes [0, 8192) of 4096: sizes do not agree"),
    ("long_header", "header length 1000000 beyond the file's"),
    ("other_shape", "holds shape [1, 4, 256], the tree records torch.Size([1, 4, 255])"),
    ("missing_file", "No such file or directory"),
    ("escaping_path", "is not a file beside the tree"),
    ("not_json", "cannot read the debugger tree"),
    ("no_qk_norm", "no text-model layer with a recorded self_attn.qk_norm output"),
])
def test_bad_debugger_dump_exits_2_with_one_line(setup, tmp_path, case, message):
    from conftest import cli_error
    directory = copy_of_debugger(tmp_path)
    tree_file = os.path.join(directory, os.path.basename(DEBUGGER_TREE))
    target = os.path.join(directory, L2_NORM)
    if case == "lying_shape":
        rewrite_header(target, lambda h: h["data"].update(shape=[4, 512]))
    elif case == "lying_offsets":
        rewrite_header(target, lambda h: h["data"].update(data_offsets=[0, 8192]))
    elif case == "long_header":
        blob = open(target, "rb").read()
        open(target, "wb").write((1_000_000).to_bytes(8, "little") + blob[8:])
    elif case == "missing_file":
        os.remove(target)
    elif case == "not_json":
        open(tree_file, "w").write("{")
    else:
        text = open(tree_file).read()
        value = f'"./{L2_NORM}"'
        text = {"other_shape": lambda t: re.sub(r"256\]\)(\",\s+\"dtype\": \"torch.float32\",\s+\"value\": )"
                                                + re.escape(value), r"255])\1" + value, t),
                "escaping_path": lambda t: t.replace(value, '"../../etc/x.safetensors"'),
                "no_qk_norm": lambda t: t.replace("self_attn.qk_norm", "self_attn.qk_nrom")}[case](text)
        open(tree_file, "w").write(text)
    t32 = tmp_path / "t32"
    tracer = Tracer(str(t32))
    for name, x in setup[3].items():
        tracer(name, x)
    tracer.close()
    cli_error(run_cli("tools.bisect", t32, directory), "tools.bisect: ", message)


def test_regenerated_debugger_dump_equals_the_fixture(setup, tmp_path):
    pytest.importorskip("torch", reason="rerunning transformers' debugger needs torch (the [parity] extra)")
    pytest.importorskip("transformers", reason="rerunning transformers' debugger needs transformers")
    if not os.path.exists(os.path.join(CHECKPOINT, "model.safetensors")):
        pytest.skip("build/tiny/tiny-a is missing: make it with tools/regen/make_tiny.py")
    assert common.sha256(os.path.join(CHECKPOINT, "model.safetensors")) == debugger_manifest()["weights_sha256"]
    files = hf_trace.debugger_dump(CHECKPOINT, debugger_manifest()["token_ids"], str(tmp_path / "dbg"), True)
    assert files == sorted(os.listdir(DEBUGGER))
    fresh, fixture = dump_parse.load_hf_debugger(str(tmp_path / "dbg")).points, dump_parse.load_hf_debugger(DEBUGGER).points
    assert list(fresh) == list(fixture)
    assert_within_noise_floor(fixture, fresh, setup[4])


def test_debugger_tree_of_printed_tensors_exits_2(setup, tmp_path):
    """use_repr=True (the debugger's default) stores printed text, not tensors: refused, naming the fix."""
    from conftest import cli_error
    directory = copy_of_debugger(tmp_path)
    tree_file = os.path.join(directory, os.path.basename(DEBUGGER_TREE))
    text = open(tree_file).read()
    open(tree_file, "w").write(re.sub(r'"value": "\./[^"]*qk_norm_outputs\.safetensors"', '"value": ["tensor([1.0])"]',
                                      text))
    with pytest.raises(dump_parse.DumpError, match="use_repr=True, the default"):
        dump_parse.load_hf_debugger(directory)
    cli_error(run_cli("tools.bisect", FIXTURE, directory), "rerun model_addition_debugger_context with use_repr=False")


def test_debugger_tree_with_pruned_layers_exits_2(setup, tmp_path):
    """do_prune_layers=True (the default) keeps the first and last layer only: refused, naming the fix."""
    from conftest import cli_error
    directory = copy_of_debugger(tmp_path)
    tree_file = os.path.join(directory, os.path.basename(DEBUGGER_TREE))
    tree = json.load(open(tree_file))
    text_model = tree["children"][0]["children"][1]
    assert text_model["module_path"].endswith(".model.language_model")
    text_model["children"] = [c for c in text_model["children"] if not re.search(r"\.layers\.[123]$", c["module_path"])]
    json.dump(tree, open(tree_file, "w"))
    cli_error(run_cli("tools.bisect", FIXTURE, directory), "holds layers 0, 4 only: pruned (do_prune_layers=True",
              "rerun with do_prune_layers=False")
