"""tools.golden --engine openai against recorded replies of a real llama-server (tests/fixtures/openai/,
replayed by a local http.server that also checks each request is the one recorded), and live where a
llama-server binary is present. The independent side is llama.cpp's own arithmetic as the server
reported it; the reference's teacher-forced logits of the same model are compared with it.
"""
import http.server
import json
import os
import re
import shutil
import threading

import numpy as np
import pytest
from conftest import GOLDEN, MODELS, ROOT, cli_error, run_cli

from tools import common
from tools.parity.engines import llama_server
from tools.parity.engines import openai
from tools.parity import diff, golden

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "openai")
GLIMMER = os.path.join(MODELS, "glimmer-default-f16.gguf")
TINY_A = os.path.join(MODELS, "tiny-a-f32.gguf")
PROMPTS = os.path.join(GOLDEN, "prompts", "text.jsonl")
# The bound of tests/test_golden.py for a llama-server log-probability against the reference: the
# server's float32 softmax over 512 tokens (512 * 2^-24) plus twice the largest f32 logit error
# between the reference and llama.cpp (7.2e-5, measured on tiny-a-f32), since a log-probability is
# a logit minus a logsumexp. The f16 model changes nothing here: the reference widens its f16 weights
# exactly, and this server build computed in f32 (measured 3.5e-6, far inside the bound).
LOGPROB_BOUND = 512 * 2.0 ** -24 + 2 * 7.2e-5
EXACT_NMSE = 1e-10  # the f32 gate of test_text_parity (measured 5e-12 against llama.cpp)


def exchanges(name):  # -> the recorded [{"method", "path", "request", "response"}] of a server run
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


class Replay(http.server.BaseHTTPRequestHandler):
    """Answers each request with its recorded reply; a request unlike every recorded one is a 400."""
    recorded: list = []

    def answer(self, request):
        found = [e["response"] for e in self.recorded if (e["method"], e["path"], e["request"]) ==
                 (self.command, self.path, request)]
        body = json.dumps(found[0] if found else {"error": f"no recorded {self.command} {self.path} like this"})
        self.send_response(200 if found else 400)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        self.answer(None)

    def do_POST(self):
        self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def replay():  # -> a function: fixture file name -> URL of a server replaying it
    servers = []

    def serve(name):  # a fixture file name, or the exchanges themselves
        handler = type("Handler", (Replay,), {"recorded": exchanges(name) if isinstance(name, str) else name})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"
    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def prompts_file(tmp_path, ids, continuations=None):  # -> P.jsonl of these prompts of golden/prompts/text.jsonl
    with open(PROMPTS) as f:
        chosen = [p for p in map(json.loads, f) if p["id"] in ids]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({**p, **({"continuation_ids": continuations[p["id"]]} if continuations else {})})
                            + "\n" for p in chosen))
    return path


def openai_golden(url, tmp_path, model, ids, n_probs, out="srv"):  # -> the manifest of tools.golden --engine openai
    assert golden.main(["--engine", "openai", "--server-url", url, "--model", model, "--n-predict", "8",
                        "--n-probs", str(n_probs), "--prompts", str(prompts_file(tmp_path, ids)),
                        "--out", str(tmp_path / out)]) == 0
    return json.loads((tmp_path / out / "manifest.json").read_text())


def reference_against(tmp_path, manifest):  # -> {prompt id: diff report of the reference (teacher-forced) vs the golden}
    tokens = {e["id"]: e["greedy"]["tokens"] for e in manifest["entries"]}
    model = os.path.join(MODELS, manifest["model"]["file"])
    assert golden.main(["--engine", "reference", "--model", model, "--prompts",
                        str(prompts_file(tmp_path, tokens, tokens)), "--out", str(tmp_path / "ref")]) == 0
    return {pid: diff.diff_pair(np.load(tmp_path / "ref" / f"{pid}.npy"),
                                diff.load_topk(str(tmp_path / "srv" / f"{pid}.topk.npz"))) for pid in tokens}


def test_recorded_llama_server_golden_against_the_reference(replay, tmp_path):
    manifest = openai_golden(replay("llama-server-glimmer-default-f16.json"), tmp_path, GLIMMER,
                             ("len1", "len7", "len33"), 20)
    assert manifest["engine"] == "openai" and manifest["model"]["sha256"] == common.sha256(GLIMMER)
    request = manifest["options"]["request"]
    assert request["temperature"] == 0 and "samplers" not in request and "ignore_eos" not in request
    runs = {e["id"]: e["server_run"] for e in manifest["entries"]}
    # len33 ends in the end-of-generation token 498 after 6 tokens: the server stops there
    assert runs["len33"] == {"finish_reason": "stop", "n_generated": 6, "n_with_logprobs": 6,
                             "system_fingerprint": "b1-0c1e570"}
    assert all("prompt_logprobs" not in e for e in manifest["entries"])  # llama-server reports none
    for pid, r in reference_against(tmp_path, manifest).items():
        s = r["summary"]
        # measured: top-1 and top-20 all equal, max |d log p| 3.5e-6 (len33), NMSE 1.8e-13
        assert s["top1"] == 1.0 and s["topk"] == 1.0 and s["n_real"] == 0, pid
        assert s["max_abs"] <= LOGPROB_BOUND and s["nmse"] <= EXACT_NMSE, (pid, s)


def test_recorded_reply_with_an_incomplete_character_keeps_the_known_rows(replay, tmp_path):
    """On tiny-a-f32, generated token 2 of len33 leaves the text inside a UTF-8 character: llama-server
    reports nothing for it and hands its bytes to the next entry, whose position is then unknown. The
    golden keeps rows 0 and 1, and they equal the native /completion reply of the same build bit for bit."""
    manifest = openai_golden(replay("llama-server-tiny-a-f32.json"), tmp_path, TINY_A, ("len33",), 5)
    assert manifest["entries"][0]["server_run"]["n_generated"] == 8
    assert manifest["entries"][0]["server_run"]["n_with_logprobs"] == 2
    top = diff.load_topk(str(tmp_path / "srv" / "len33.topk.npz"))
    with open(os.path.join(ROOT, "tests", "fixtures", "llama-server-completion.json")) as f:
        native = json.load(f)["completion_probabilities"][:2]
    assert top.tokens.tolist() == [step["id"] for step in native]
    np.testing.assert_array_equal(top.ids, [[t["id"] for t in step["top_logprobs"]] for step in native])
    np.testing.assert_array_equal(top.logprobs, np.float32([[t["logprob"] for t in step["top_logprobs"]]
                                                            for step in native]))


def recorded_reply():  # -> a copy of the recorded len7 reply on glimmer-default-f16
    return json.loads(json.dumps(exchanges("llama-server-glimmer-default-f16.json")[2]["response"]))


def test_bad_replies_are_one_line_errors():
    ids = exchanges("llama-server-glimmer-default-f16.json")[2]["request"]["prompt"]
    good = recorded_reply()
    assert openai.openai_topk(good, ids, 20, "x")[0]["tokens"].size == 8
    content = lambda r: r["choices"][0]["logprobs"]["content"]  # noqa: E731
    bad = {"lacks choices": {"choices": []}, "lacks choices[0].logprobs": {**good, "usage": None}}
    not_greedy, short, unsorted, none = recorded_reply(), recorded_reply(), recorded_reply(), recorded_reply()
    second = content(not_greedy)[3]["top_logprobs"][1]
    content(not_greedy)[3].update(id=second["id"], bytes=second["bytes"])
    content(short)[0]["top_logprobs"].pop()
    content(unsorted)[1]["top_logprobs"][0]["logprob"] = -99.0
    none["choices"][0]["logprobs"]["content"] = []
    positive, beyond, negative = recorded_reply(), recorded_reply(), recorded_reply()
    content(positive)[2]["top_logprobs"][0]["logprob"] = 0.25
    for reply, at in ((beyond, 512), (negative, -1)):  # the id of the top-1 and of the token it chose
        content(reply)[4]["top_logprobs"][0]["id"] = content(reply)[4]["id"] = at
    bad.update({"not the top-1": not_greedy, "has 19 top logprobs": short, "sorted best first": unsorted,
                "no generated token": none, "<= 0": positive, "token id 512 in tokens is outside [0, 512)": beyond,
                "token id -1 is not an integer in [0, ": negative, "8 tokens in a reply to a request of 7": good})
    for message, reply in bad.items():
        with pytest.raises(common.GoldenError, match=re.escape(message)):
            # the request asked for 8 tokens (7 for the last case) of a vocabulary of 512 (glimmer-default)
            top, _ = openai.openai_topk(reply, ids, 20, "x")
            llama_server.check_topk_reply(top, 7 if reply is good else 8, 512, "x")


def test_text_prompts_and_server_errors_exit_2(replay, tmp_path):
    url = replay("llama-server-glimmer-default-f16.json")
    text = tmp_path / "t.jsonl"
    text.write_text('{"id": "a", "text": "the sun"}\n')
    r = run_cli("tools.golden", "--engine", "openai", "--server-url", url, "--n-predict", "8", "--prompts", text,
                "--out", tmp_path / "o")
    assert cli_error(r, "--engine openai takes token_ids prompts")
    # a request the server was not recorded answering (n_probs 5): its HTTP error is the message, after
    # the progress bar (a server fails mid-run), with no traceback
    r = run_cli("tools.golden", "--engine", "openai", "--server-url", url, "--n-predict", "8", "--n-probs", "5",
                "--prompts", prompts_file(tmp_path, ("len7",)), "--out", tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"tools.golden: {url}/v1/completions: HTTP 400: " in r.stderr, r.stderr
    r = run_cli("tools.golden", "--engine", "openai", "--prompts", text, "--out", tmp_path / "o")
    assert cli_error(r, "--engine openai needs --n-predict N > 0")
    from test_golden import free_port
    nobody = f"http://127.0.0.1:{free_port()}"
    r = run_cli("tools.golden", "--engine", "openai", "--server-url", nobody, "--n-predict", "8", "--prompts", text,
                "--out", tmp_path / "none")
    assert cli_error(r, f"tools.golden: {nobody}/v1/models: ", "Connection refused")
    assert not (tmp_path / "none").exists()


def vllm_exchanges(n_probs=20):  # -> replies in vLLM's shape, made from llama.cpp's committed golden of len7
    """No vLLM runs here: this checks the parsing of its documented shape (legacy logprobs with
    return_tokens_as_token_ids, prompt_logprobs entries {id: {logprob, rank, decoded_token}}), with
    llama.cpp's logits of tiny-a-f32 as the numbers, so the golden must give them back."""
    from test_golden import llama_cpp_golden
    from reference.metrics import log_softmax
    entry, prompt, decode = llama_cpp_golden("len7")
    lp_prompt, lp_gen = log_softmax(prompt), log_softmax(np.concatenate([prompt[-1:], decode[:7]]))

    def ranked(row, own=None):  # -> {"token_id:N" or "N": ...} of the n_probs best (+ the prompt's own token)
        order = [int(t) for t in np.argsort(-row, kind="stable")]
        keep = order[:n_probs] + ([own] if own is not None and own not in order[:n_probs] else [])
        return {t: float(row[t]) for t in keep}, {t: order.index(t) + 1 for t in keep}
    top = [ranked(row)[0] for row in lp_gen]
    tokens = entry["greedy"]["tokens"][:8]
    prompt_logprobs = [None] + [{str(t): {"logprob": lp, "rank": rank[t], "decoded_token": "?"} for t, lp in values.items()}
                                for values, rank in (ranked(lp_prompt[i - 1], own) for i, own in
                                                     enumerate(entry["token_ids"]) if i > 0)]
    reply = {"object": "text_completion", "model": "tiny-a", "usage": {"completion_tokens": 8}, "choices": [{
        "index": 0, "text": "?", "finish_reason": "length", "prompt_logprobs": prompt_logprobs,
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [row[t] for row, t in zip(top, tokens)],
                     "top_logprobs": [{f"token_id:{t}": lp for t, lp in row.items()} for row in top]}}]}
    request = openai.openai_request("tiny-a", entry["token_ids"], 8, n_probs)
    return [{"method": "GET", "path": "/v1/models", "request": None,
             "response": {"object": "list", "data": [{"id": "tiny-a", "object": "model", "owned_by": "vllm"}]}},
            {"method": "POST", "path": "/v1/completions", "request": request, "response": reply}], prompt, decode


def test_vllm_shaped_reply_gives_back_the_logits_it_was_made_of(replay, tmp_path):
    recorded, prompt, decode = vllm_exchanges()
    manifest = openai_golden(replay(recorded), tmp_path, TINY_A, ("len7",), 20)
    e = manifest["entries"][0]
    assert e["prompt_logprobs"]["k"] == 20 and e["server_run"]["n_with_logprobs"] == 8
    sparse = diff.load_positions(str(tmp_path / "srv" / e["prompt_logprobs"]["file"]))
    assert sparse.positions.tolist() == list(range(6))  # prompt token i + 1 is chosen at position i
    full = np.concatenate([prompt, decode[:7]])
    for golden_file in (sparse, diff.load_topk(str(tmp_path / "srv" / e["file"]))):
        s = diff.diff_pair(full, golden_file)["summary"]
        # float32 log-probabilities stored: half a float32 spacing at |log p| < 32
        assert s["top1"] == 1.0 and s["topk"] == 1.0 and s["max_abs"] <= np.spacing(np.float32(32))


# ---------------------------------------------------------------------------------------------
# a live llama-server: LLAMA_SERVER names its binary, else llama-server on PATH

@pytest.fixture(scope="module")
def live_server():  # -> URL of a llama-server on glimmer-default-f16, started in golden/models (served by file name)
    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        pytest.skip("no llama-server binary (set LLAMA_SERVER or put it on PATH); the recorded replies are "
                    "checked by the other tests of this file")
    from test_golden import served
    yield from served(binary, os.path.basename(GLIMMER), cwd=MODELS)


def test_live_server_reproduces_the_recorded_golden(live_server, replay, tmp_path):
    """A llama-server of llama.cpp 0c1e570 built for the CPU (x86-64, AVX512) reproduces the CPU recording
    bit for bit. The older recording, llama-server-glimmer-default-f16.json, came from a build whose f16
    products kept float32 activations (within 3.5e-6 of the exact reference, 2.3e-3 from this build)."""
    ids = ("len1", "len7", "len33")
    live = openai_golden(live_server, tmp_path, GLIMMER, ids, 20, out="live")
    recorded = openai_golden(replay("llama-server-glimmer-default-f16-cpu.json"), tmp_path, GLIMMER, ids, 20)
    assert [e["greedy"] for e in live["entries"]] == [e["greedy"] for e in recorded["entries"]]
    for pid in ids:
        a, b = (diff.load_topk(str(tmp_path / d / f"{pid}.topk.npz")) for d in ("live", "srv"))
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)  # same build, same options: bit for bit
