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

import numpy as np
import pytest
from conftest import MODELS, ROOT, run_cli
from test_planted_bugs import GateAfterOProj, NormWeightOff, PostNormEps, ScalarSwaRule

from reference import gguf, ops
from reference.text import TextModel
from reference.trace import Tracer, load_trace
from tools import bisect as bisect_tool
from reference import metrics
from tools import golden, hf_trace

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
             (["--checkpoint", str(tmp_path / "missing"), "--token-ids", "1"], "cannot read"),
             (["--checkpoint", str(tmp_path / "other"), "--token-ids", "1"], "not a Muse-Glimmer checkpoint"),
             (["--checkpoint", str(config), "--token-ids", "1", "--without", "attn_nrom"], "unknown trace op")]
    for args, problem in cases:
        assert hf_trace.main([*args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and problem in err[0], err
    r = run_cli("tools.hf_trace", "--checkpoint", config, "--token-ids", "-1", "--out", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_regenerated_trace_equals_the_fixture(tmp_path):
    pytest.importorskip("torch", reason="regenerating the transformers trace needs torch (the [parity] extra)")
    pytest.importorskip("transformers", reason="regenerating the transformers trace needs transformers")
    if not os.path.exists(os.path.join(CHECKPOINT, "model.safetensors")):
        pytest.skip("build/tiny/tiny-a is missing: make it with tools/make_tiny.py")
    about = fixture_manifest()
    assert golden.sha256(os.path.join(CHECKPOINT, "model.safetensors")) == about["weights_sha256"]
    ops_kept = [op for op in hf_trace.TRACE_OPS if op not in about["left_out"]]
    fresh = hf_trace.hf_trace(CHECKPOINT, about["token_ids"], str(tmp_path / "hf"), ops_kept)
    fixture = load_trace(FIXTURE)
    assert list(fresh) == list(fixture) == list(load_trace(str(tmp_path / "hf")))
    for name, x in fixture.items():
        assert fresh[name].shape == x.shape
        # another CPU or torch build may sum in another order: NMSE 2^-40 (9e-13) is 4x the
        # one-rounding floor 64 x 2^-48 and under the 1.5e-12 that two engines' orders give here
        assert metrics.nmse(x.reshape(-1), fresh[name].reshape(-1)) <= 2.0 ** -40, name
