"""tools.golden (engines, top-k goldens of llama-server, teacher-forced scoring), the one-command gate
of tools.diff on golden directories, and the pytest plugin tools.pytest_parity.

Independent goldens used here: golden/logits/llama-cpp/tiny-a-f32/kv-f32_fa-off (llama-cpp-python
0.3.36, F32 KV, flash attention off: prompt logits, greedy tokens and decode-step logits) and
tests/fixtures/llama-server-completion.json, a reply of a real llama-server of the same llama.cpp
build (command in tests/fixtures/README.md). NMSE is sum((ref - x)^2) / sum(ref^2).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from conftest import GOLDEN, MODELS, ROOT, cli_error, run_cli

from tools import common
from tools.parity.engines import llama_server as server_engine
from reference import metrics
from tools.parity import diff, golden

LLAMA_CPP_RUN = os.path.join(GOLDEN, "logits", "llama-cpp", "tiny-a-f32", "kv-f32_fa-off")
SERVER_REPLY = os.path.join(ROOT, "tests", "fixtures", "llama-server-completion.json")
TINY_A = os.path.join(MODELS, "tiny-a-f32.gguf")
# A float32 softmax over the 512-token vocabulary: expf, then a running float32 sum of 512 terms,
# each addition rounding by up to 2^-24 of the sum; log of that. Worst case 512 * 2^-24 = 3.1e-5
# in every log-probability llama-server prints.
SERVER_SOFTMAX_ROUNDING = 512 * 2.0 ** -24
# Largest |reference - llama.cpp| logit over every position of the tiny-a-f32 F32-KV goldens (measured
# 7.2e-5, on len100); a log-probability moves by at most twice a logit's error (the logit and logsumexp).
F32_LOGIT_ERROR = 7.2e-5
EXACT_NMSE = 1e-10  # the f32 gate of test_text_parity (measured 5e-12 against llama.cpp)


def llama_cpp_golden(prompt_id):  # -> (manifest entry, prompt logits, decode-step logits)
    with open(os.path.join(LLAMA_CPP_RUN, "manifest.json")) as f:
        entry = next(e for e in json.load(f)["entries"] if e["id"] == prompt_id)
    def load(name):  # -> float32 logits of the run
        return np.load(os.path.join(LLAMA_CPP_RUN, name), allow_pickle=False)

    return entry, load(entry["file"]), load(entry["greedy"]["decode_logits"])


def server_topk(reply=None):  # -> (TopK of the recorded reply, its prompt's llama.cpp golden entry)
    entry = llama_cpp_golden("len33")[0]
    with open(SERVER_REPLY) as f:
        arrays = server_engine.parse_completion(reply or json.load(f), entry["token_ids"], 5, SERVER_REPLY)
    return diff.TopK(arrays["prompt_ids"], arrays["tokens"], arrays["positions"].astype(np.int64),
                     arrays["top_ids"].astype(np.int64), arrays["top_logprobs"].astype(np.float64)), entry


def test_recorded_server_reply_parses_and_agrees_with_llama_cpp():
    top, entry = server_topk()
    assert top.tokens.tolist() == entry["greedy"]["tokens"][:8]  # the same greedy tokens as llama-cpp-python
    # tokens 2 and 3 (bytes 244 and 'X') end in an incomplete UTF-8 character: the server reports
    # their probabilities with nobody, the next entry carries their bytes
    assert top.positions.tolist() == [0, 1, 4, 5, 6, 7]
    _, prompt_logits, decode_logits = llama_cpp_golden("len33")
    full = np.concatenate([prompt_logits, decode_logits])  # row 32 + i chose generated token i
    report = diff.diff_pair(top, full)
    s = report["summary"]
    assert report["per_position"]["position"] == [32, 33, 36, 37, 38, 39]
    assert s["top1"] == 1.0 and s["topk"] == 1.0 and s["n_real"] == 0
    assert s["max_abs"] <= SERVER_SOFTMAX_ROUNDING  # measured 1.7e-6: the same logits, rounded once more


def test_llama_servers_softmax_on_llama_cpps_logits_gives_its_reply_to_the_bit():
    """server_top_logprobs (llama-server's float32 softmax: std::partial_sort's order, expf, a float32
    running sum, logf) on llama-cpp-python's logits of the same build gives the recorded reply's top-5
    ids and log-probabilities bit for bit at every decode step. The first row (the prompt's last)
    llama-cpp-python computed with all 33 rows through the output matrix, the server with one: the
    same ids, within 1e-6 (measured 7.2e-7, 3 of 5 to the bit)."""
    top, _ = server_topk()
    _, prompt_logits, decode_logits = llama_cpp_golden("len33")
    full = np.concatenate([prompt_logits, decode_logits]).astype(np.float32)
    exact = 0
    for position, ids, logprobs in zip(top.positions, top.ids, top.logprobs):
        ours_ids, ours = server_engine.server_top_logprobs(full[32 + position], 5)
        assert ours_ids == ids.tolist()
        if position > 0:
            assert ours == logprobs.tolist(), position
        else:
            assert np.max(np.abs(np.array(ours) - logprobs)) <= 1e-6
            exact = sum(a == b for a, b in zip(ours, logprobs.tolist()))
    assert top.positions.tolist()[1:] == [1, 4, 5, 6, 7] and exact == 3


def test_reference_teacher_forced_against_the_server_golden(tmp_path):
    top, entry = server_topk()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "len33", "token_ids": entry["token_ids"],
                                   "continuation_ids": top.tokens.tolist()}) + "\n")
    assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts),
                        "--out", str(tmp_path / "ref")]) == 0
    logits = np.load(tmp_path / "ref" / "len33.npy")
    assert logits.shape == (33 + 8, 512)
    report = diff.diff_pair(top, logits)
    s = report["summary"]
    # measured: NMSE 5.7e-12, max |d log p| 1.4e-5
    assert s["nmse"] <= EXACT_NMSE and s["top1"] == 1.0 and s["n_real"] == 0
    assert s["max_abs"] <= 2 * F32_LOGIT_ERROR + SERVER_SOFTMAX_ROUNDING
    # the same through the command line, both ways round, with the one-command gate
    np.savez(tmp_path / "len33.topk.npz", prompt_ids=top.prompt_ids, tokens=top.tokens, positions=top.positions,
             top_ids=top.ids, top_logprobs=top.logprobs)
    for a, b in ((tmp_path / "len33.topk.npz", tmp_path / "ref" / "len33.npy"),
                 (tmp_path / "ref" / "len33.npy", tmp_path / "len33.topk.npz")):
        r = run_cli("tools.diff", a, b, "--gate", "nmse=1e-10,top1=1")
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_server_reply_errors():
    with open(SERVER_REPLY) as f:
        good = json.load(f)
    bad_replies = {
        "no probabilities": {k: v for k, v in good.items() if k != "completion_probabilities"},
        "post-sampling": {**good, "completion_probabilities": [
            {**{k: v for k, v in s.items() if k != "top_logprobs"}, "top_probs": s["top_logprobs"]}
            for s in good["completion_probabilities"]]},
        "unsorted": {**good, "completion_probabilities": [
            {**s, "top_logprobs": [{**s["top_logprobs"][0], "logprob": -99.0}] + s["top_logprobs"][1:]}
            for s in good["completion_probabilities"]]},
        "not greedy": {**good, "completion_probabilities": [
            {**s, "id": s["top_logprobs"][1]["id"]} for s in good["completion_probabilities"]]},
    }
    messages = {"no probabilities": "lacks", "post-sampling": "post_sampling_probs", "unsorted": "sorted",
                "not greedy": "not the top-1"}
    for name, reply in bad_replies.items():
        with pytest.raises(common.GoldenError, match=messages[name]):
            server_topk(reply)
    with pytest.raises(common.GoldenError, match=r"tokens\[0\] \"a\" is not an integer"):
        server_topk({**good, "tokens": ["a"] * 8})


def test_probability_entries_line_up_with_repeated_tokens():
    def step(token, waiting=b""):  # an entry whose token is the argmax; its bytes = waiting pieces + its own
        return {"id": token, "bytes": list(waiting + PIECES[token]), "logprob": -0.1,
                "top_logprobs": [{"id": token, "bytes": list(PIECES[token]), "logprob": -0.1}]}
    PIECES = {7: b"\xe2", 8: b"\x82", 9: b"\xac", 5: b"a"}
    # "€" = e2 82 ac split over three byte tokens: only the last one is reported
    assert server_engine.line_up([5, 7, 8, 9, 5], [step(5), step(9, b"\xe2\x82"), step(5)], "x") == [0, 3, 4]
    # a token id that is waiting and then reported: the entry carries the waiting piece, so it is the second
    PIECES[7] = b"\xe2\x82"
    assert server_engine.line_up([7, 7], [step(7, b"\xe2\x82")], "x") == [1]


def test_reference_engine_goldens_are_marked_and_match_llama_cpp(tmp_path):
    prompts = tmp_path / "p.jsonl"
    entries = [llama_cpp_golden(p)[0] for p in ("len7", "len33")]
    prompts.write_text("".join(json.dumps({"id": e["id"], "token_ids": e["token_ids"]}) + "\n" for e in entries)
                       + json.dumps({"id": "text", "text": "the sun"}) + "\n")
    out = tmp_path / "ref"
    assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts), "--out", str(out),
                        "--n-predict", "4"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"] == "reference" and manifest["self_made"] is True and "never" in manifest["independent"]
    assert manifest["model"]["sha256"] == common.sha256(TINY_A)
    by_id = {e["id"]: e for e in manifest["entries"]}
    # llama.cpp's tokenization of "the sun" (tests/fixtures/tiny-a-f32.eval-callback.txt)
    assert by_id["text"]["token_ids"] == [497, 319, 261, 84, 77]
    for e in entries:
        assert by_id[e["id"]]["greedy"]["tokens"] == e["greedy"]["tokens"][:4]
    # the one-command gate on golden directories: llama.cpp as REF, the reference's goldens as TEST
    r = run_cli("tools.diff", LLAMA_CPP_RUN, out, "--gate", "nmse=1e-10,top1=1")
    assert r.returncode == 2 and "no logits for 3 of the 5 prompts" in r.stderr and "len1" in r.stderr  # every REF prompt
    subset = tmp_path / "llama-cpp"
    subset.mkdir()
    for e in entries:
        shutil.copy(os.path.join(LLAMA_CPP_RUN, e["file"]), subset)
    # TEST holds a prompt REF has not ("text"): compared only when a subset is meant
    cli_error(run_cli("tools.diff", subset, out), "no logits for 1 of the 3 prompts", "--allow-subset")
    r = run_cli("tools.diff", subset, out, "--gate", "nmse=1e-10,top1=1", "--json", tmp_path / "d.json", "--allow-subset")
    assert r.returncode == 0 and "TEST" in r.stdout and "self_made" in r.stdout, r.stdout
    assert json.loads((tmp_path / "d.json").read_text())["overall"]["n_pos"] == 7 + 33
    r = run_cli("tools.diff", subset, out, "--gate", "nmse=1e-14", "--allow-subset")
    assert r.returncode == 1 and "nmse = " in r.stdout


def test_teacher_forced_score_of_llama_cpp_greedy_output(tmp_path):
    """Scoring llama.cpp's 32-token greedy continuation in one forward of the reference gives the
    log-probabilities llama.cpp's own decode steps assigned to those tokens."""
    entry, prompt_logits, decode_logits = llama_cpp_golden("len33")
    tokens = entry["greedy"]["tokens"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "g", "token_ids": entry["token_ids"], "continuation_ids": tokens}) + "\n")
    assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts),
                        "--out", str(tmp_path / "s")]) == 0
    scored = json.loads((tmp_path / "s" / "manifest.json").read_text())["entries"][0]
    assert scored["n_prompt"] == 33 and scored["continuation_ids"] == tokens
    chose = np.concatenate([prompt_logits[-1:], decode_logits])  # llama.cpp's row that chose token i
    llama_logprob = np.take_along_axis(metrics.log_softmax(chose), np.array(tokens)[:, None], -1)[:, 0]
    # the same f32 math: a log-probability differs by at most twice the largest logit difference
    assert np.max(np.abs(np.array(scored["score"]["logprob"]) - llama_logprob)) <= 2 * F32_LOGIT_ERROR
    assert scored["score"]["rank"] == [0] * 32 and scored["score"]["n_top1"] == 32  # greedy: all argmax
    assert scored["score"]["sum_logprob"] == pytest.approx(float(llama_logprob.sum()), abs=64 * F32_LOGIT_ERROR)


BAD_PROMPTS = {  # case -> (prompt file, what the error says)
    "not_json": ("{id: 1}", "1: not JSON"),
    "not_object": ("[1, 2]", "1: need an id and exactly one of token_ids or text"),
    "two_sources": ('{"id": "a", "token_ids": [1], "text": "x"}', "1: need an id and exactly one"),
    "bad_id": ('{"id": "../a", "token_ids": [1]}', "1: prompt id '../a' is not a plain file name"),
    "null_id": ('{"id": null, "token_ids": [1]}', "1: id must be a string or an integer, got null"),
    "duplicate": ('{"id": "a", "token_ids": [1]}\n{"id": "a", "token_ids": [2]}', "2: prompt id 'a' appears twice"),
    "images": ('{"id": "a", "token_ids": [1], "images": ["x.png"]}', "1: image prompts are not supported"),
    "bad_ids": ('{"id": "a", "token_ids": [1, "two"]}', "1: token_ids must be a list of integers"),
    "bool_ids": ('{"id": "a", "token_ids": [true, false]}', "1: token_ids must be a list of integers"),
    "float_ids": ('{"id": "a", "token_ids": [1.5]}', "1: token_ids must be a list of integers"),
    "empty_ids": ('{"id": "a", "token_ids": []}', "1: token_ids is empty"),
    "bool_continuation": ('{"id": "a", "token_ids": [1], "continuation_ids": [true]}',
                          "1: continuation_ids must be a list of integers"),
    "text_int": ('{"id": "a", "text": 5}', "1: text must be a string, got 5"),
    "continuation_int": ('{"id": "a", "token_ids": [1, 2], "continuation": 5}', "1: continuation must be a string"),
    "surrogate": ('{"id": "a", "text": "hello \\ud800"}', "1: text is not valid Unicode"),
    "no_prompts": ("\n", "no prompts"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_bad_prompt_file_exits_2_with_one_line(tmp_path, case):
    prompts = tmp_path / "p.jsonl"
    text, problem = BAD_PROMPTS[case]
    prompts.write_text(text + "\n")
    r = run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts,
                "--out", tmp_path / "out")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith(f"tools.golden: {prompts}") and problem in err[0], err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["model", "range", "negative"])
def test_bad_model_or_token_exits_2_with_one_line(tmp_path, case):
    prompts = tmp_path / "p.jsonl"
    ids = {"range": [497, 512], "negative": [497, -1]}.get(case, [1])
    prompts.write_text(json.dumps({"id": "a", "token_ids": ids}) + "\n")
    model = tmp_path / "missing.gguf" if case == "model" else TINY_A
    r = run_cli("tools.golden", "--engine", "reference", "--model", model, "--prompts", prompts,
                "--out", tmp_path / "out")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    expected = {"model": f"{model}: no such file", "range": "prompt a: token id 512 is out of range",
                "negative": "prompt a: token id -1 is out of range"}[case]
    assert expected in err[0]


BAD_OPTIONS = [  # (arguments, what the error says); {io} is --prompts P --out DIR
    ("", "the following arguments are required: --engine, --prompts, --out"),
    ("--engine bogus {io}", "argument --engine: invalid choice: 'bogus'"),
    ("--engine reference {io}", "--engine reference needs --model"),
    ("--engine transformers {io}", "--engine transformers needs --checkpoint"),
    ("{reference} {io} --corpus --task-size 0", "argument --task-size: 0 is out of range"),
    ("{reference} {io} --workers -1", "argument --workers: -1 is out of range"),
    ("{reference} {io} --n-predict -5", "argument --n-predict: -5 is out of range"),
    ("{reference} {io} --n-predict 1000000000000", "argument --n-predict: 1000000000000 is out of range"),
    ("{reference} {io} --n-predict x", "argument --n-predict: expected an integer, got 'x'"),
    ("{reference} {io} --n-predict 5000", "--n-predict 5000 exceeds the training context of tiny-a-f32.gguf (4096"),
    ("{reference} {io} --prefill-chunk 0", "argument --prefill-chunk: 0 is out of range"),
    ("{reference} {io} --prefill-chunk -3", "argument --prefill-chunk: -3 is out of range"),
    ("{reference} {io} --dtype float16", "argument --dtype: invalid choice"),
    ("{reference} --prompts {missing} --out {out}", "missing: No such file or directory"),
    ("{reference} --prompts {prompts} --out {file}", "file exists and is not a directory"),
    ("{reference} --prompts {prompts} --out {file}/sub", "cannot create the output directory (Not a directory)"),
    ("{reference} --bogus {io}", "unrecognized arguments: --bogus"),
    # llama-cpp: all refused before llama.cpp loads anything
    ("{llama_cpp} {io} --n-ctx 2000000000", "argument --n-ctx: 2000000000 is out of range [1, 1048576]"),
    ("{llama_cpp} {io} --n-ctx -1", "argument --n-ctx: -1 is out of range"),
    ("{llama_cpp} {io} --n-ctx 8192", "--ctx-size 8192 exceeds the training context of tiny-a-f32.gguf (4096"),
    ("{llama_cpp} {io} --n-ubatch 0", "argument --n-ubatch: 0 is out of range"),
    ("{llama_cpp} {io} --threads -4", "argument --threads: -4 is out of range [0, 512]"),
    ("--engine llama-cpp --model {truncated} {io}", "truncated.gguf: corrupt GGUF"),
    ("--engine llama-cpp --model {mmproj} {io}", "expected a muse-glimmer text model, found a muse-glimmer mmproj"),
    ("--engine llama-cpp --model {missing} {io}", "missing: no such file"),
    # transformers: refused before torch is imported
    ("--engine transformers --checkpoint {missing} {io}", "not a Hugging Face checkpoint directory (no config.json)"),
    ("--engine transformers --checkpoint {file} {io}", "not a Hugging Face checkpoint directory (no config.json)"),
    ("--engine llama-server --n-predict 2 --server-url notaurl {io}", "--server-url: expected http://HOST:PORT"),
    ("--engine llama-server --n-predict 2 --server-url http://h:99999 {io}",
     "--server-url: 'http://h:99999' has a bad port"),
    ("--engine llama-server {io}", "--engine llama-server needs --n-predict N > 0"),
]


@pytest.mark.parametrize("args, problem", BAD_OPTIONS, ids=[a or "no-arguments" for a, _ in BAD_OPTIONS])
def test_bad_options_exit_2_with_one_line(tmp_path, args, problem):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [497, 1, 2]}\n')
    (tmp_path / "file").write_text("x")
    with open(TINY_A, "rb") as f:  # the header and metadata whole, the last tensor cut short
        data = f.read()
    (tmp_path / "truncated.gguf").write_bytes(data[:-1000])
    paths = {"prompts": prompts, "out": tmp_path / "out", "file": tmp_path / "file",
             "missing": tmp_path / "missing", "truncated": tmp_path / "truncated.gguf",
             "mmproj": os.path.join(MODELS, "tiny-a-mmproj-f32.gguf")}
    engines = {"reference": f"--engine reference --model {TINY_A}", "llama_cpp": f"--engine llama-cpp --model {TINY_A}",
               "io": f"--prompts {prompts} --out {tmp_path / 'out'}"}
    r = run_cli("tools.golden", *args.format(**engines, **paths).split())
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith("tools.golden: ") and problem in err[0], err[0]
    assert not (tmp_path / "out").exists()


def without(modules, module, *args):  # -> CompletedProcess of `python -m module args` with `modules` unimportable
    """sys.modules[name] = None makes `import name` raise ModuleNotFoundError, as when it is not installed."""
    code = (f"import sys, runpy; sys.modules.update(dict.fromkeys({list(modules)!r})); sys.argv = ['x', *{list(args)!r}]; "
            f"runpy.run_module({module!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.parametrize("engine, missing", [("llama-cpp", "llama_cpp"), ("transformers", "torch")])
@pytest.mark.parametrize("corpus", [False, True], ids=["direct", "corpus"])
def test_missing_engine_package_is_one_line_naming_the_extra(tmp_path, engine, missing, corpus):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [497, 1, 2]}\n')
    source = ["--model", TINY_A] if engine == "llama-cpp" else ["--checkpoint", str(tmp_path)]
    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory as check_checkpoint sees one
    r = without([missing], "tools.golden", "--engine", engine, *source, "--prompts", str(prompts),
                "--out", str(tmp_path / "out"), *(["--corpus"] if corpus else []))
    line = cli_error(r, f"--engine {engine} needs the {missing} package", 'pip install -e ".[parity]"')
    assert line.startswith("tools.golden: "), line
    assert corpus or not (tmp_path / "out").exists()  # a corpus run makes its task folder first


def test_prompts_checked_before_any_golden(tmp_path):
    """A bad prompt after good ones is refused before the progress bar starts and before any file is
    written: one line, no partial output."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [497, 1]}\n{"id": "b", "text": "the sun", '
                       '"continuation_ids": [600]}\n')
    r = run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts,
                "--out", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.strip() == \
        "tools.golden: prompt b: token id 600 is out of range for a vocabulary of 512", r.stderr
    assert not (tmp_path / "out").exists()


def test_prompt_ids_may_be_integers(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 7, "token_ids": [497, 1], "note": "extra fields are kept out of the way"}\n')
    assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts),
                        "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["entries"][0]["file"] == "7.npy"


# ---------------------------------------------------------------------------------------------
# --logits-positions and --logits-topk: sparse goldens against llama.cpp's full ones

def positions_run(tmp_path, name, *options):  # -> manifest of a reference run over the committed llama.cpp prompts
    with open(os.path.join(LLAMA_CPP_RUN, "manifest.json")) as f:
        entries = json.load(f)["entries"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": e["id"], "token_ids": e["token_ids"]}) + "\n" for e in entries))
    # chunks of 16: the rows are kept chunk by chunk, across chunk boundaries of len33 and len100
    assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts), "--out",
                        str(tmp_path / name), "--prefill-chunk", "16", *options]) == 0
    return json.loads((tmp_path / name / "manifest.json").read_text())


def test_positions_goldens_against_llama_cpp(tmp_path):
    top = positions_run(tmp_path, "top", "--logits-positions", "0,15:18,-8:", "--logits-topk", "20")
    assert top["options"]["logits_positions"] == "0,15:18,-8:" and top["options"]["logits_topk"] == 20
    assert "positions.npz" in top["logits"]
    rows = positions_run(tmp_path, "rows", "--logits-positions=-3:")  # "=": argparse takes -3: for an option
    assert rows["options"]["logits_topk"] is None
    for e in top["entries"]:
        full = np.load(os.path.join(LLAMA_CPP_RUN, f"{e['id']}.npy"))
        n = full.shape[0]
        kept = sorted({0, *range(15, min(18, n)), *range(max(n - 8, 0), n)})
        sparse = diff.load_positions(str(tmp_path / "top" / e["file"]))
        assert sparse.positions.tolist() == kept and sparse.ids.shape == (len(kept), 20)
        s = diff.diff_pair(full, sparse)["summary"]
        # measured: top-1 and top-20 all equal, max |d log p| 3.3e-5; a log-probability is a logit minus
        # a logsumexp, each off by at most F32_LOGIT_ERROR, and the stored float32 logsumexp by half a
        # spacing (|logsumexp| < 16 here)
        assert s["top1"] == 1.0 and s["topk"] == 1.0 and s["n_real"] == 0, e["id"]
        assert s["max_abs"] <= 2 * F32_LOGIT_ERROR + np.spacing(np.float32(16)), (e["id"], s)
        whole = diff.diff_pair(full, diff.load_positions(str(tmp_path / "rows" / f"{e['id']}.positions.npz")))
        assert whole["n_pos"] == min(3, n) and whole["summary"]["nmse"] <= EXACT_NMSE, e["id"]
    # the one-command gate over the directories, both ways round, and the two sparse runs against each other
    for a, b in ((LLAMA_CPP_RUN, tmp_path / "top"), (tmp_path / "top", LLAMA_CPP_RUN), (tmp_path / "top", tmp_path / "rows")):
        r = run_cli("tools.diff", a, b, "--gate", "top1=1,topk=1")
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert "len100: compared at 3 positions on the top 20 tokens; REF lists the top 20 only, 9 positions only in REF" \
        in r.stdout


def test_llama_cpp_positions_golden_keeps_its_own_logits(tmp_path):
    """--engine llama-cpp with --logits-positions: the kept top-20 logits equal those of the committed
    all-position golden of the same build and options bit for bit, so the log-probabilities differ by
    the float32 rounding of the stored logsumexp alone (half a spacing at |logsumexp| < 16). A live
    check: llama-cpp-python is no extra CI installs (the parity extra builds llama.cpp)."""
    pytest.importorskip("llama_cpp")
    with open(os.path.join(LLAMA_CPP_RUN, "manifest.json")) as f:
        options = json.load(f)["options"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": e, "token_ids": llama_cpp_golden(e)[0]["token_ids"]}) + "\n"
                               for e in ("len33", "len100")))
    assert golden.main(["--engine", "llama-cpp", "--model", TINY_A, "--kv-type", options["kv_type"], "--prompts",
                        str(prompts), "--out", str(tmp_path / "lc"), "--logits-positions", "0,-8:",
                        "--logits-topk", "20"]) == 0
    for pid in ("len33", "len100"):
        full = llama_cpp_golden(pid)[1]
        with np.load(tmp_path / "lc" / f"{pid}.positions.npz") as z:
            kept = np.take_along_axis(full[z["positions"]], z["top_ids"].astype(np.int64), axis=1)
            np.testing.assert_array_equal(kept, z["top_logits"])
        s = diff.diff_pair(full, diff.load_positions(str(tmp_path / "lc" / f"{pid}.positions.npz")))["summary"]
        assert s["top1"] == 1.0 and s["topk"] == 1.0 and s["max_abs"] <= np.spacing(np.float32(16)) / 2, s


def test_llama_cpp_no_repack_remakes_the_presets_goldens(tmp_path):
    """--no-repack (use_extra_bufts=False) is how golden/presets' llama.cpp logits were taken: the
    command the preset manifest records remakes the Q4_K_M preset's goldens bit for bit (Q4_K is a
    repacked type: the emulation with repack on misses these goldens by up to 0.46, on the 64-token
    prompt). A live check: llama-cpp-python."""
    pytest.importorskip("llama_cpp")
    with open(os.path.join(GOLDEN, "presets", "manifest.json")) as f:
        entry = next(e for e in json.load(f)["presets"] if e["preset"] == "Q4_K_M")
    argv = entry["golden_command"][3:]
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    argv[argv.index("--model") + 1] = os.path.join(ROOT, argv[argv.index("--model") + 1])
    argv[argv.index("--prompts") + 1] = os.path.join(ROOT, argv[argv.index("--prompts") + 1])
    assert "--no-repack" in argv and golden.main(argv) == 0
    recorded = os.path.join(GOLDEN, "presets", entry["logits"])
    for name in sorted(os.listdir(recorded)):
        if name.endswith(".npy"):
            np.testing.assert_array_equal(np.load(os.path.join(recorded, name)), np.load(tmp_path / "out" / name))


@pytest.mark.parametrize("args, problem", [
    ("--logits-topk 5", "--logits-topk needs --logits-positions"),
    ("--logits-positions 0,x", "argument --logits-positions: bad position 'x'"),
    ("--logits-positions 0 --logits-topk 0", "argument --logits-topk: 0 is out of range"),
    ("--logits-positions 7", "prompt a: --logits-positions 7: position 7 is outside a prompt of 3 tokens"),
    ("--logits-positions 5:9", "prompt a: --logits-positions 5:9: the positions select none of the prompt's 3 tokens"),
])
def test_bad_positions_options_exit_2(tmp_path, args, problem):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [497, 1, 2]}\n')
    r = run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts,
                "--out", tmp_path / "out", *args.split())
    assert cli_error(r, problem).startswith("tools.golden: ")
    assert not (tmp_path / "out").exists()
    r = run_cli("tools.golden", "--engine", "openai", "--n-predict", "2", "--prompts", prompts, "--out",
                tmp_path / "out", "--logits-positions", "last")
    cli_error(r, "--engine openai gives no prompt logits")


# ---------------------------------------------------------------------------------------------
# a real llama-server, when LLAMA_SERVER names its binary (not in CI)

def free_port():  # -> a TCP port nobody listens on now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_OPTIONS = ["-c", "512", "-t", "1", "-tb", "1", "-np", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off",
                  "--no-webui", "-cram", "0"]  # as tests/fixtures/README.md records the fixtures


def served(binary, model, cwd=None):  # a fixture's body: yields the URL of llama-server on `model`, then stops it
    port = free_port()
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *SERVER_OPTIONS],
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("llama-server did not come up")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def llama_server():  # -> URL of a llama-server on tiny-a-f32, launched as tests/fixtures/README.md says
    binary = os.environ.get("LLAMA_SERVER")
    if not binary:
        pytest.skip("set LLAMA_SERVER to a llama-server binary to test against a live server")
    yield from served(binary, TINY_A)


def test_live_server_reproduces_the_recorded_golden(llama_server, tmp_path):
    top, entry = server_topk()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "len33", "token_ids": entry["token_ids"]}) + "\n")
    assert golden.main(["--engine", "llama-server", "--server-url", llama_server, "--model", TINY_A,
                        "--n-predict", "8", "--n-probs", "5", "--prompts", str(prompts),
                        "--out", str(tmp_path / "srv")]) == 0
    live = diff.load_topk(str(tmp_path / "srv" / "len33.topk.npz"))
    assert live.tokens.tolist() == top.tokens.tolist() and live.positions.tolist() == top.positions.tolist()
    np.testing.assert_array_equal(live.ids, top.ids)
    np.testing.assert_array_equal(live.logprobs, top.logprobs)  # same build, same options: bit for bit
    manifest = json.loads((tmp_path / "srv" / "manifest.json").read_text())
    assert manifest["options"]["request"]["temperature"] == 0 and "samplers" not in manifest["options"]["request"]


# ---------------------------------------------------------------------------------------------
# the pytest plugin

ENGINE_TEST = """
import numpy as np
import pytest

@pytest.mark.parity(golden="golden", gate="nmse=1e-4,top1=0.999")
def test_engine(parity):
    rng = np.random.default_rng(0)
    for prompt in parity.prompts:
        logits = np.load("golden/" + prompt["file"])
        noise = rng.normal(size=logits.shape).astype(np.float32) * 1e-5
        if prompt["id"] == "len7" and {bug}:
            noise[3, int(np.argsort(logits[3])[-5])] += 30  # a clear new winner: a real divergence
        parity.check(prompt["id"], logits + noise)
"""


def golden_copy(directory, ids=("len1", "len7")):  # a small golden directory in `directory`/golden
    target = directory / "golden"
    target.mkdir()
    with open(os.path.join(LLAMA_CPP_RUN, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["entries"] = [e for e in manifest["entries"] if e["id"] in ids]
    for e in manifest["entries"]:
        shutil.copy(os.path.join(LLAMA_CPP_RUN, e["file"]), target)
        shutil.copy(os.path.join(LLAMA_CPP_RUN, e["greedy"]["decode_logits"]), target)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_plugin_gates(pytester, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    golden_copy(pytester.path)
    pytester.makepyfile(test_clean=ENGINE_TEST.format(bug="False"), test_buggy=ENGINE_TEST.format(bug="True"))
    result = pytester.runpytest("-p", "tools.pytest_parity", "test_clean.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*= parity =*", "golden/len1 *ok", "golden/len7 *ok"])
    strict = pytester.runpytest("-p", "tools.pytest_parity", "test_clean.py", "--parity-gate", "nmse=1e-20")
    strict.assert_outcomes(failed=1)
    bogus = pytester.runpytest("-p", "tools.pytest_parity", "test_clean.py", "--parity-gate", "bogus")
    assert bogus.ret != 0 and "parity: " in bogus.stdout.str() + bogus.stderr.str()  # a usage error, no traceback
    assert "Traceback" not in bogus.stdout.str() + bogus.stderr.str()
    result = pytester.runpytest("-p", "tools.pytest_parity", "test_buggy.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*real divergence at position 3*"])


def test_plugin_update_goldens_from_the_reference(pytester, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    target = golden_copy(pytester.path, ids=("len7",))
    old = np.load(target / "len7.npy")
    pytester.makepyfile(test_engine=ENGINE_TEST.format(bug="False"))
    result = pytester.runpytest("-p", "tools.pytest_parity", "--update-goldens", "reference",
                                f"--parity-models={MODELS}", f"--rootdir={pytester.path}")
    result.assert_outcomes(passed=1)
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["engine"] == "reference" and manifest["self_made"] is True
    assert manifest["entries"][0]["greedy"]["n_predict"] == 32  # the old manifest's greedy length
    new = np.load(target / "len7.npy")
    assert not np.array_equal(new, old) and metrics.nmse(old.ravel(), new.ravel()) <= EXACT_NMSE


@pytest.mark.parametrize("args, message", [([], "usage:"), (["golden"], "is not a llama.cpp source tree")])
def test_hf_to_gguf_bad_llama_dir_is_one_line_exit_2(args, message):
    done = run_cli("tools.hf_to_gguf", *args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_hf_to_gguf_help_is_usage_exit_0():  # --help asked for is not an error
    done = run_cli("tools.hf_to_gguf", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage:") and not done.stderr, done
