"""`python -m reference.run`: the command-line contract of docs/architecture.md for text."""
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from reference import gguf, run
from reference.text import TextModel
from reference.trace import load_trace
from reference.metrics import nmse
from conftest import GOLDEN, MODELS, cli_error, run_cli
from test_gguf import A, ARR, F32, planted, planted_role, role_cli

MODEL = os.path.join(MODELS, "tiny-a-f32.gguf")
MMPROJ = os.path.join(MODELS, "tiny-a-mmproj-f32.gguf")
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
    (["--token-ids", "1,2", "--prefill-chunk", "0"], "argument --prefill-chunk: 0 is out of range"),
    (["--token-ids", "1,,2"], "--token-ids has an empty item: '1,,2'"),
    (["--token-ids", "1,2,"], "--token-ids has an empty item"),
    (["--token-ids", ""], "--token-ids is empty"),  # not the default prompt
    (["--token-ids", " , ,"], "--token-ids is empty"),
    # a context no machine holds is refused before its KV cache is allocated (about 1 PiB, 95 TiB)
    (["--token-ids", "1", "--n-predict", "1000000000000"], "a context of 1000000000001 tokens"),
    (["--token-ids", "1", "--ctx", "100000000000"], "a context of 100000000000 tokens"),
])
def test_bad_arguments_one_line_exit_2(args, message):
    r = run_cli("reference.run", "--model", MODEL, *args)
    assert r.returncode == 2 and message in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag", ["--logits-out", "--embeddings-out"])
@pytest.mark.parametrize("name, message", [
    ("", "is a directory"),
    ("logits", "must name a .npy file"),  # np.save would write logits.npy instead
    ("missing/logits.npy", "no such directory"),
])
def test_bad_output_path_is_refused_before_the_run(tmp_path, flag, name, message):
    path = tmp_path / name if name else tmp_path
    line = cli_error(run_cli("reference.run", "--model", MODEL, "--token-ids", "1", "--n-predict", "0",
                             flag, str(path)))
    assert flag in line and message in line
    assert os.listdir(tmp_path) == [] and not os.path.exists(f"{path}.npy")  # nothing written anywhere


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into a folder whatever its mode")
def test_output_into_a_read_only_folder_is_refused_before_the_run(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    line = cli_error(run_cli("reference.run", "--model", MODEL, "--token-ids", "1", "--n-predict", "0",
                             "--logits-out", str(folder / "logits.npy")))
    assert "is not writable" in line


@pytest.mark.parametrize("kind, message", [("directory", "a directory, not a regular file"),
                                           ("device", "a character device, not a regular file")])
def test_model_that_is_not_a_file(tmp_path, kind, message):
    if kind == "device" and not os.path.exists(os.devnull):
        pytest.skip("no null device")
    path = str(tmp_path) if kind == "directory" else os.devnull
    with pytest.raises(gguf.GGUFError, match=message):
        gguf.load(path, "text")
    line = cli_error(run_cli("reference.run", "--model", path, "--token-ids", "1"))
    assert path in line and message in line


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.token_type", ([1, 1, 1], ARR), "tokenizer.ggml.token_type has 3 entries for 512 tokens"),
    (A + "attention.layer_norm_rms_epsilon", (-1.0, F32), "rms_epsilon must be positive and finite, not -1.0"),
    (A + "attention.layer_norm_rms_epsilon", (0.0, F32), "rms_epsilon must be positive and finite, not 0.0"),
    (A + "attention.layer_norm_rms_epsilon", (NAN, F32), "rms_epsilon must be positive and finite, not nan"),
    (A + "rope.freq_base", (0.0, F32), "rope.freq_base must be positive and finite, not 0.0"),
    (A + "rope.freq_base_swa", (INF, F32), "rope.freq_base_swa must be positive and finite, not inf"),
    (A + "logit_scale", (-0.5, F32), "logit_scale must be positive and finite, not -0.5"),
    (A + "final_logit_softcapping", (-20.0, F32), "final_logit_softcapping must be finite and not negative"),
    (A + "final_logit_softcapping", (NAN, F32), "final_logit_softcapping must be finite and not negative"),
])
def test_text_metadata_that_would_give_nan_or_crash(tmp_path, key, value, message):
    path = planted(tmp_path, "bad", extra_keys={key: value})
    with pytest.raises(gguf.GGUFError, match=message):
        gguf.load(path, "text")
    line = cli_error(run_cli("reference.run", "--model", path, "--token-ids", "1", "--n-predict", "1"))
    assert path in line and message in line


@pytest.mark.parametrize("role, key, value, message", [
    ("mmproj", "clip.vision.image_std", ([0.0, 0.0, 0.0], ARR), "image_std must be positive and finite, not 0.0"),
    ("mmproj", "clip.vision.image_std", ([0.5, NAN, 0.5], ARR), "image_std must be 3 finite numbers"),
    ("mmproj", "clip.vision.image_mean", ([0.5], ARR), r"image_mean must be 3 finite numbers \(R, G, B\), not \[0.5\]"),
    ("mmproj", "clip.vision.attention.layer_norm_epsilon", (-1.0, F32), "layer_norm_epsilon must be positive"),
    ("dflash", "dflash.attention.layer_norm_rms_epsilon", (0.0, F32), "layer_norm_rms_epsilon must be positive"),
    ("dflash", "dflash.rope.freq_base", (NAN, F32), "rope.freq_base must be positive and finite, not nan"),
])
def test_projector_and_drafter_metadata_that_would_give_nan(tmp_path, role, key, value, message):
    path = planted_role(tmp_path, role, {key: value})
    with pytest.raises(gguf.GGUFError, match=message):
        gguf.load(path, role)
    line = cli_error(role_cli(role, path))
    assert path in line and re.search(message, line)


def test_model_named_is_the_default_run_and_is_reported():
    default = json.loads(run_cli("reference.run", "--json", "--n-predict", "2").stdout)
    path = os.path.join("golden", "models", "glimmer-default-f16.gguf")
    named = json.loads(run_cli("reference.run", "--model", path, "--json", "--n-predict", "2").stdout)
    assert named["prompt_tokens"] == default["prompt_tokens"] and named["tokens"] == default["tokens"]
    assert named["model"] == {"file": "glimmer-default-f16.gguf", "path": path}
    assert default["model"]["file"] == "glimmer-default-f16.gguf"
    r = run_cli("reference.run", "--model", MODEL, "--token-ids", "1,2", "--n-predict", "1")
    assert r.returncode == 0 and f"[tiny-a-f32.gguf ({MODEL}): 2 prompt tokens" in r.stderr


@pytest.mark.parametrize("flag, value, message", [
    ("--n-predict", "-1", "argument --n-predict: -1 is out of range"),
    ("--ctx", "-1", "argument --ctx: -1 is out of range"),
    ("--prefill-chunk", "x", "argument --prefill-chunk: expected an integer, got 'x'"),
    ("--spec-draft-n-max", "-1", "argument --spec-draft-n-max: -1 is out of range"),
    ("--spec-p-min", "nan", "argument --spec-p-min: expected a number, got 'nan'"),
    ("--tp", "0", "argument --tp: 0 is out of range"),
    ("--image-max-tokens", "0", "argument --image-max-tokens: 0 is out of range"),
    ("--logits-topk", "-5", "argument --logits-topk: -5 is out of range"),
])
def test_numbers_are_refused_before_anything_loads(flag, value, message):
    # the model does not exist: a number refused first was checked before any load
    line = cli_error(run_cli("reference.run", "--model", "missing.gguf", f"{flag}={value}"))
    assert message in line


@pytest.mark.parametrize("args, message", [
    (["--kv-type", "f32"], "--kv-type, --flash-attn, --repack/--no-repack and --cpu choose llama.cpp's build for --numerics ggml-cpu only"),
    (["--repack", "off"], "--kv-type, --flash-attn, --repack/--no-repack and --cpu choose llama.cpp's build for --numerics ggml-cpu only"),
    (["--numerics", "ggml-cpu", "--tp", "2"], "--numerics ggml-cpu computes in float32"),
    (["--backend", "numba", "--tp", "2"], "--tp simulates tensor parallelism on the numpy backend only"),
    (["--system", "x", "--prompt", "y"], "-sys/--system-prompt and --date only apply with --chat"),
    (["--chat"], "--chat needs -p/--prompt or -f/--file"),
    (["--chat", "--prompt", "x", "--no-special"], "it takes no --no-special"),
    (["--no-special"], "--no-special only applies to -p/--prompt or -f/--file"),
])
def test_contradicting_flags_are_refused_before_anything_loads(args, message):
    line = cli_error(run_cli("reference.run", "--model", "missing.gguf", *args))
    assert message in line


# ---------------------------------------------------------------------------------------------
# Every input checked before any GGUF loads: gguf.load, replaced, fails the test if it is reached

def refuse_loads(monkeypatch):  # gguf.load -> an AssertionError, which run.main does not turn into exit 2
    def load(path, role, *rest):
        raise AssertionError(f"gguf.load({path!r}, {role!r}) ran before the input was refused")
    monkeypatch.setattr(gguf, "load", load)


def input_files(tmp_path):  # -> {name: path} of the files the cases below name
    files = {"missing": tmp_path / "missing", "dir": tmp_path, "surrogate": tmp_path / "surrogate.txt",
             "text": tmp_path / "text.txt", "png": tmp_path / "ok.png"}
    files["surrogate"].write_bytes(b"a\xed\xa0\x80")  # an encoded surrogate: no code point
    files["text"].write_text("not an image, not a GGUF")
    Image.new("RGB", (28, 28)).save(files["png"])
    return {name: str(path) for name, path in files.items()}


@pytest.mark.parametrize("args, message", [
    (["--token-ids", "1,x"], "--token-ids must be comma-separated integers"),
    (["--token-ids", "1,,2"], "--token-ids has an empty item"),
    (["--token-ids", "-3"], "token id -3 is out of range"),
    (["--chat", "--prompt", "hi", "--date", "2024-13-01"], "date must be YYYY-MM-DD, got '2024-13-01'"),
    (["--prompt-file", "{missing}"], "{missing}: No such file or directory"),
    (["--prompt-file", "{dir}"], "{dir}: a directory, not a regular file (prompt file)"),
    (["--prompt-file", "{surrogate}"], "{surrogate}: byte 1 encodes U+D800"),
    (["--prompt", "hi", "--mmproj", MMPROJ, "--image", "{missing}"], "{missing}: No such file or directory"),
    (["--prompt", "hi", "--mmproj", MMPROJ, "--image", "{text}"], "{text}: not an image file"),
    (["--prompt", "hi", "--mmproj", "{missing}", "--image", "{png}"], "{missing}: no such file"),
    (["--draft-model", "{missing}"], "{missing}: no such file"),
    (["--draft-model", "{text}"], "{text}: not a GGUF file"),
    (["--model", "{dir}"], "{dir}: a directory, not a regular file (GGUF file)"),
    (["--trace", "{text}"], "--trace {text} exists and is not a directory"),
])
def test_bad_input_is_refused_before_any_gguf_loads(monkeypatch, capsys, tmp_path, args, message):
    files = input_files(tmp_path)
    refuse_loads(monkeypatch)
    assert run.main(["--model", MODEL, *(a.format(**files) for a in args)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message.format(**files) in err[0], err


def test_the_refused_load_is_the_one_a_run_reaches(monkeypatch):
    """The cases above would pass with gguf.load never replaced at all; a good run reaches it."""
    refuse_loads(monkeypatch)
    with pytest.raises(AssertionError, match="gguf.load"):
        run.main(["--model", MODEL, "--token-ids", "1,2", "--n-predict", "1"])
