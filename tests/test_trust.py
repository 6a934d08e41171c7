"""Trust, second round: one test per class of failure a hostile probe found past the artifact layer
(output directories, aliased outputs, numbers, server replies, lying headers, waits and signals,
partial success, JSON depth). Each fails on the tree before its fix and passes now;
tests/test_fuzz.py draws classes 3-6 at random points."""
import argparse
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from conftest import MODELS, ROOT, JsonServer, cli_error, run_cli

from reference import artifacts, cli, positions
from tools import common
from tools.parity import golden
from tools.parity.engines import http as server_http, llama_server, openai

TINY_A = os.path.join(MODELS, "tiny-a-f32.gguf")
FIX = os.path.join(ROOT, "tests", "fixtures")
DUMP = os.path.join(FIX, "tiny-a-f32.eval-callback.txt")
HF_TRACE = os.path.join(FIX, "hf-trace-tiny-a")
DEBUGGER = os.path.join(FIX, "hf-debugger-tiny-a")
RECORDED = os.path.join(FIX, "openai", "llama-server-glimmer-default-f16.json")


def prompts_file(path, prompts):  # [(id, token ids)] -> path of a JSON-lines prompt set
    path.write_text("".join(json.dumps({"id": i, "token_ids": ids}) + "\n" for i, ids in prompts))
    return path


def recorded_reply():  # -> a copy of the recorded /v1/completions reply to len7 on glimmer-default (8 tokens, top 20)
    with open(RECORDED) as f:
        exchange = json.load(f)[2]
    return exchange["request"]["prompt"], exchange["response"]


# ---------------------------------------------------------------------------------------------
# 2. An output directory holding someone else's files

def test_an_output_directory_of_other_files_is_refused_before_anything_is_written(tmp_path):
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "chapter1.tex").write_text("mine")
    prompts = prompts_file(tmp_path / "p.jsonl", [("a", [1, 2, 3])])
    run = ("reference.run", "--model", TINY_A, "--token-ids", "1,2,3", "--n-predict", "1")
    cli_error(run_cli(*run, "--trace", user), "--trace", "holds files this project did not write", "chapter1.tex")
    cli_error(run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts, "--out", user),
              "--out", "holds files this project did not write")
    assert os.listdir(user) == ["chapter1.tex"] and (user / "chapter1.tex").read_text() == "mine"
    # new, empty or the project's own: written, and written again
    (tmp_path / "empty").mkdir()
    for out in ("new", "empty", "new"):
        assert run_cli(*run, "--trace", tmp_path / out).returncode == 0
    for _ in range(2):
        assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts),
                            "--out", str(tmp_path / "g")]) == 0
    # a file of the user's own named manifest.json does not make a directory the project's
    (user / "manifest.json").write_text('{"name": "my-web-app"}')
    cli_error(run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts, "--out", user),
              "holds files this project did not write")


# ---------------------------------------------------------------------------------------------
# 3. Two outputs of one command named as one file

def test_two_outputs_spelled_differently_are_one_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(artifacts.ArtifactError, match="--b ./x.npz and --a x.npz are one file"):
        artifacts.refuse_overwrite([("--a", "x.npz"), ("--b", "./x.npz")], [])
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(artifacts.ArtifactError, match="are one file"):
        artifacts.refuse_overwrite([("--a", "real/t.json"), ("--b", "link/../real/t.json")], [])
    ref = tmp_path / "ref.npy"
    np.save(ref, np.eye(4, dtype=np.float32))
    cli_error(run_cli("tools.diff", ref, ref, "--json", tmp_path / "r.png", "--plot", f"{tmp_path}/./r.png"),
              "are one file")
    cli_error(run_cli("tools.bisect", HF_TRACE, DUMP, "--table", tmp_path / "real" / "t.txt",
                      "--json", tmp_path / "link" / "t.txt"), "are one file")
    (tmp_path / "trace").mkdir()  # a file inside a --trace directory, which replaces it whole
    cli_error(run_cli("reference.run", "--model", TINY_A, "--token-ids", "1,2", "--trace", tmp_path / "trace",
                      "--logits-out", tmp_path / "trace" / "l.npy"), "lies inside --trace")
    assert not (tmp_path / "r.png").exists() and os.listdir(tmp_path / "trace") == []


# ---------------------------------------------------------------------------------------------
# 4. Numbers read too kindly

@pytest.mark.parametrize("text", ["٣", "1_0", "+3", " 3", "3 ", "３", "0x10", "1e3", "3\n"])
def test_a_number_is_ascii_digits_and_nothing_else(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer"):
        cli.int_in(0, 1 << 20)(text)
    with pytest.raises(cli.UsageError, match="--token-ids must be comma-separated integers"):
        cli.parse_token_ids(f"1,{text}")
    with pytest.raises(argparse.ArgumentTypeError, match="bad position"):
        positions.parse_positions(f"{text}:")
    assert cli.int_in(-1, 5)("-1") == -1 and cli.parse_token_ids("0,17") == [0, 17]
    assert positions.parse_positions("-256:,last,3") == [slice(-256, None), -1, 3]


def test_unicode_digits_are_refused_by_every_command():
    cli_error(run_cli("reference.run", "--model", TINY_A, "--token-ids", "1,٢", "--n-predict", "1"), "--token-ids")
    cli_error(run_cli("reference.run", "--model", TINY_A, "--token-ids", "1,2", "--n-predict", "٣"), "--n-predict")
    cli_error(run_cli("tools.perplexity", "-m", TINY_A, "-f", os.path.join(FIX, "perplexity", "text-crlf.txt"),
                      "-c", "１２８"), "argument -c:", "expected an integer")  # the option as typed


# ---------------------------------------------------------------------------------------------
# 5. Numbers from a server used before they are checked

def test_every_number_of_a_reply_is_checked_before_it_is_converted():
    ids, good = recorded_reply()
    content = lambda r: r["choices"][0]["logprobs"]["content"]  # noqa: E731
    cases = []
    for value in (1e999, 2 ** 64, -1, 2.0, "3"):
        count = json.loads(json.dumps(good))
        count["usage"]["completion_tokens"] = value
        cases.append((count, "usage.completion_tokens"))
    for value in (2 ** 31, 2 ** 40, 2 ** 64, 1e999, -1):
        token = json.loads(json.dumps(good))
        content(token)[3]["id"] = content(token)[3]["top_logprobs"][0]["id"] = value
        cases.append((token, "token id"))
    logprob = json.loads(json.dumps(good))
    content(logprob)[1]["top_logprobs"][2]["logprob"] = "-1"
    cases.append((logprob, "logprob"))
    for reply, field in cases:
        with pytest.raises(common.GoldenError, match=re.escape(field)) as e:
            openai.openai_topk(reply, ids, 20, "x", 512)
        assert "\n" not in str(e.value)
    # llama-server's own /completion: an id of 1e999 (JSON's inf) and a byte of 300
    completion = {"tokens": [5], "completion_probabilities": [
        {"id": 5, "bytes": [65], "logprob": -0.1, "top_logprobs": [{"id": 5, "bytes": [65], "logprob": -0.1}]}]}
    for path, value, field in ((("tokens", 0), 1e999, "tokens[0]"), (("completion_probabilities", 0, "bytes", 0), 300, "bytes")):
        bad = json.loads(json.dumps(completion))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(common.GoldenError, match=re.escape(field)):
            llama_server.parse_completion(bad, [1], 1, "x", 512)
    # vLLM's prompt_logprobs: a rank of 1e999
    vllm = {"choices": [{"prompt_logprobs": [None, {"token_id:5": {"rank": 1e999, "logprob": -0.5}}]}]}
    with pytest.raises(common.GoldenError, match="rank"):
        openai.openai_prompt_logprobs(vllm, 2, 1, 512, "x")


def test_a_served_vocabulary_and_tokenize_ids_are_bounded(tmp_path):
    models = {"data": [{"id": "tiny-a-f32.gguf", "meta": {"n_vocab": 10 ** 30}}]}
    args = argparse.Namespace(model=None, n_probs=2, server_launch=None, connect_timeout=2.0, read_timeout=None,
                              request_deadline=None)
    with JsonServer({"/v1/models": models}) as server:
        with pytest.raises(common.GoldenError, match=r"meta.n_vocab 1000000000000000000000000000000 is not an integer"):
            openai.openai_engine(argparse.Namespace(**vars(args), server_url=server.url))
    models["data"][0]["meta"]["n_vocab"] = 1024  # more than the --model it says it serves
    with JsonServer({"/v1/models": models}) as server:
        with pytest.raises(common.GoldenError, match=r"meta.n_vocab 1024 is not an integer in \[1, 513\)"):
            openai.openai_engine(argparse.Namespace(**{**vars(args), "model": TINY_A}, server_url=server.url))
    props = {"model_path": "tiny-a-f32.gguf", "default_generation_settings": {"n_ctx": 512}}
    with JsonServer({"/props": props, "/tokenize": {"tokens": [1, -1]}}) as server:
        engine = llama_server.llama_server_engine(argparse.Namespace(**vars(args), server_url=server.url))
        with pytest.raises(common.GoldenError, match=r"tokens\[1\] -1 is not an integer in \[0, "):
            engine.tokenize("hi", True)


# ---------------------------------------------------------------------------------------------
# 6. Headers that claim more than they hold

def test_a_sparse_npy_that_claims_a_terabyte_is_one_line(tmp_path):
    big = tmp_path / "big.npy"
    with open(big, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (1 << 18, 1 << 20)})
        f.truncate(f.tell() + (1 << 40))  # sparse: the file holds every byte its header promises
    cli_error(run_cli("tools.diff", big, big), "big.npy", "more than the", "this process can still allocate")


def test_a_huge_one_line_prompt_is_refused_before_the_pre_tokenizer(tmp_path):
    prompt = tmp_path / "long.txt"
    with open(prompt, "wb") as f:
        for _ in range(64):
            f.write(b"a" * (1 << 20))
    cli_error(run_cli("reference.run", "--model", TINY_A, "--prompt-file", prompt, "--n-predict", "1"),
              "the text is 67108864 bytes", "training context of 4096")
    # past the training context on purpose: then memory decides, before the pre-tokenizer allocates
    env = {**os.environ, "PYTHONPATH": ROOT, "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "reference.run", "--model", TINY_A, "--prompt-file", str(prompt),
                        "--beyond-n-ctx-train", "--n-predict", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29)), timeout=300)
    cli_error(r, "tokenizing a text of 67108864 bytes", "this process can still allocate")


def test_a_dump_whose_ne_is_not_the_model_s_is_an_input_error(tmp_path):
    with open(DUMP) as f:
        text = f.read()
    lying = re.sub(r"(attn_norm-0 = .*\) = )\{256, 5, 1, 1\}", r"\1{256, 65536, 65536, 1}", text)
    assert lying != text
    (tmp_path / "lying.txt").write_text(lying)
    cli_error(run_cli("tools.bisect", HF_TRACE, tmp_path / "lying.txt"), "attn_norm-0 claims ne [256, 65536, 65536, 1]")


# ---------------------------------------------------------------------------------------------
# 7. Waits and signals

def test_default_waits_end_a_dead_server_in_tens_of_seconds():
    args = golden.parse_args(["--engine", "openai", "--n-predict", "8", "--prompts", "p", "--out", "o"])
    short = server_http.http_limits(args, 0, 16)  # 8 prompt tokens and 8 generated
    assert short.read <= 60 and short.deadline <= 60
    # a long generation of a slow server still fits: 4096 tokens at the 0.5 s a token of a 30B on CPU
    assert server_http.http_limits(args, 0, 4096).deadline >= 4096 * 0.5
    given = golden.parse_args(["--engine", "openai", "--n-predict", "8", "--prompts", "p", "--out", "o",
                               "--read-timeout", "7", "--request-deadline", "9"])
    assert (server_http.http_limits(given, 0, 4096).read, server_http.http_limits(given, 0, 4096).deadline) == (7, 9)


def test_a_fired_deadline_is_named_not_the_reply_it_cut(tmp_path):
    limits = server_http.HttpLimits(connect=2.0, read=2.0, deadline=0.5)
    with JsonServer({"/v1/models": {"data": [{"id": "m"}]}}, trickle=0.05) as server:
        start = time.monotonic()
        with pytest.raises(common.GoldenError, match=r"no whole reply within the deadline of 0.5 s \(--request-deadline\)"):
            server_http.http_json(f"{server.url}/v1/models", limits=limits)
        assert time.monotonic() - start < 2


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGPIPE])
def test_sighup_and_sigpipe_stop_a_golden_run_with_one_line_and_a_manifest_of_what_is_whole(tmp_path, sig):
    ids, reply = recorded_reply()
    models = {"data": [{"id": "glimmer-default-f16.gguf", "meta": {"n_vocab": 512}}]}
    prompts = prompts_file(tmp_path / "p.jsonl", [(f"p{i}", ids) for i in range(6)])
    out = tmp_path / "srv"
    with JsonServer({"/v1/models": models, "/v1/completions": reply}, delay=0.4) as server:
        env = {**os.environ, "PYTHONPATH": ROOT}
        child = subprocess.Popen([sys.executable, "-m", "tools.golden", "--engine", "openai", "--server-url", server.url,
                                  "--n-predict", "8", "--n-probs", "20", "--prompts", str(prompts), "--out", str(out)],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (out / "p0.topk.npz").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(sig)
        _, stderr = child.communicate(timeout=60)
    assert child.returncode == 128 + sig, stderr
    assert stderr.strip().splitlines()[-1].startswith("tools.golden: interrupted; "), stderr
    manifest = json.loads((out / "manifest.json").read_text())
    done = [e["id"] for e in manifest["entries"]]
    assert done and manifest["incomplete"]["prompts"] == 6 and manifest["incomplete"]["prompts_done"] == len(done)
    assert all((out / f"{i}.topk.npz").exists() for i in done)
    cli_error(run_cli("tools.diff", out, out), "is incomplete", "--allow-subset")


# ---------------------------------------------------------------------------------------------
# 8. Success that is not

def test_diff_fails_when_the_prompt_sets_differ_unless_a_subset_is_allowed(tmp_path):
    for side, names in (("ref", ["a"]), ("test", ["a", "b"])):
        (tmp_path / side).mkdir()
        for name in names:
            np.save(tmp_path / side / f"{name}.npy", np.eye(4, dtype=np.float32))
    cli_error(run_cli("tools.diff", tmp_path / "ref", tmp_path / "test"), "ref: no logits for 1 of the 2 prompts",
              "--allow-subset")
    r = run_cli("tools.diff", tmp_path / "ref", tmp_path / "test", "--allow-subset")
    assert r.returncode == 0 and "left out (--allow-subset): b" in r.stdout, r.stdout + r.stderr


def test_a_golden_run_that_made_nothing_exits_non_zero(tmp_path):
    ids, _ = recorded_reply()
    models = {"data": [{"id": "m.gguf", "meta": {"n_vocab": 512}}]}
    no_row = {"choices": [{"logprobs": {"content": []}, "finish_reason": "stop"}], "usage": {"completion_tokens": 0}}
    prompts = prompts_file(tmp_path / "p.jsonl", [("a", ids), ("b", ids)])
    with JsonServer({"/v1/models": models, "/v1/completions": no_row}) as server:
        r = run_cli("tools.golden", "--engine", "openai", "--server-url", server.url, "--n-predict", "8",
                    "--n-probs", "20", "--prompts", prompts, "--out", tmp_path / "srv")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "tools.golden: 0 of 2 prompts have a golden; 2 missing"


def test_a_malformed_debugger_tree_is_an_input_error_not_a_divergence(tmp_path):
    directory = shutil.copytree(DEBUGGER, tmp_path / "dbg")
    tree_file = next(directory / n for n in os.listdir(directory) if n.endswith("_FULL_TENSORS.json"))
    tree = json.loads(tree_file.read_text())

    def nodes(node):
        yield node
        for child in node.get("children", []):
            yield from nodes(child)
    norm = next(n for n in nodes(tree) if n["module_path"].endswith("layers.0.input_layernorm"))
    norm["outputs"]["value"] = 5
    tree_file.write_text(json.dumps(tree))
    cli_error(run_cli("tools.bisect", HF_TRACE, directory), tree_file.name, "input_layernorm: outputs value 5")
    norm["outputs"] = [norm["outputs"]]  # a tuple output where a tensor was recorded on the other layers
    tree_file.write_text(json.dumps(tree))
    cli_error(run_cli("tools.bisect", HF_TRACE, directory), "no record of attn_norm-0", "a cut or edited tree")


# ---------------------------------------------------------------------------------------------
# 9. JSON depth without a second copy

def test_json_depth_is_checked_in_less_memory_than_the_document():
    document = json.dumps([{"id": f"p{i}", "text": 'a "quoted" [text] {x}\\', "token_ids": list(range(40))}
                           for i in range(150000)]).encode()
    tracemalloc.start()
    try:
        depth = artifacts.json_depth(document)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert depth == 3
    # was ~30 bytes a byte of the document (a regex copy, int64 steps); now ~50 bytes a byte of one block
    assert peak < min(len(document) / 2, 16 << 20), (peak, len(document))
    assert math.isclose(artifacts.json_depth(document.decode()), 3)
