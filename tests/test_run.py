"""`python -m reference.run`: the command-line contract of ARCHITECTURE.md for text."""
import json
import os

import numpy as np
import pytest

from reference import gguf
from reference.text import TextModel
from reference.trace import load_trace
from tools.metrics import nmse
from conftest import GOLDEN, MODELS, run_cli

MODEL = os.path.join(MODELS, "tiny-a-f32.gguf")
IDS = [497, 85, 318, 217, 394, 109, 23]  # golden/prompts/text.jsonl "len7"


def test_default_run_uses_the_embedded_model():
    r = run_cli("reference.run", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"prompt_tokens", "tokens", "text", "timings"}
    assert set(out["timings"]) == {"load", "prefill", "decode"} and out["tokens"]


def test_logits_out_matches_llama_cpp_golden(tmp_path):
    path = str(tmp_path / "logits.npy")
    r = run_cli("reference.run", "--model", MODEL, "--token-ids", ",".join(map(str, IDS)),
                "--n-predict", "0", "--logits-out", path)
    assert r.returncode == 0, r.stderr
    ours = np.load(path, allow_pickle=False)
    golden = np.load(os.path.join(GOLDEN, "logits", "llama-cpp", "tiny-a-f32", "kv-f32_fa-off", "len7.npy"))
    assert ours.dtype == np.float32 and ours.shape == (len(IDS), 512)
    assert nmse(golden.ravel(), ours.ravel()) <= 1e-10  # same gate as tests/test_text_parity.py


def test_trace_names_follow_llama_cpp(tmp_path):
    r = run_cli("reference.run", "--model", MODEL, "--token-ids", ",".join(map(str, IDS)), "--n-predict", "0",
                "--trace", str(tmp_path))
    assert r.returncode == 0, r.stderr
    trace = load_trace(str(tmp_path))
    index = json.load(open(tmp_path / "index.json"))
    names = [e["name"] for e in index]
    assert names[0] == "embd_norm" and names[-2:] == ["result_norm", "result_output"]
    assert "Qcur_rope-1" in names and "Qcur_rope-0" not in names  # layer 0 is full: NoPE
    assert trace["Qcur-0"].shape == (len(IDS), 4, 32) and trace["l_out-4"].shape == (len(IDS), 256)
    e = next(e for e in index if e["name"] == "attn_out-2")
    assert np.isclose(e["sum"], trace["attn_out-2"].astype(np.float64).sum())


def test_float64_is_the_noise_floor():
    m = gguf.load(MODEL, "text")
    ids = list(np.random.default_rng(0).integers(0, 490, 100))
    f32 = TextModel(m).prefill(ids, TextModel(m).new_cache(100))
    f64 = TextModel(m, np.float64).prefill(ids, TextModel(m, np.float64).new_cache(100))
    assert f64.dtype == np.float64
    # measured 8.3e-13; f32 activations between f64-accumulated ops can do no worse than ~1e-11
    assert 0 < nmse(f64.ravel(), f32.ravel()) <= 1e-11


@pytest.mark.parametrize("args, message", [
    (["--token-ids", "1,2,99999"], "token id 99999 is out of range"),
    (["--token-ids", "1,x"], "--token-ids must be comma-separated integers"),
    (["--token-ids", "1,2", "--ctx", "1"], "context full"),
    (["--token-ids", "1,2", "--dtype", "float16"], "invalid choice"),
    (["--token-ids", "1,2", "--prefill-chunk", "0"], "must not be negative"),
])
def test_bad_arguments_one_line_exit_2(args, message):
    r = run_cli("reference.run", "--model", MODEL, *args)
    assert r.returncode == 2 and message in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
