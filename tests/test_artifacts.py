"""Every stored artifact can be trusted (reference/artifacts.py): one test per class of failure a
careful or hostile user found, each failing on the tree before reference/artifacts.py and passing
now. tests/test_fuzz.py draws the same contract at random points."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import MODELS, ROOT, JsonServer, cli_error, run_cli

from reference import artifacts
from reference.trace import Tracer, TraceError, load_trace
from tools import common
from tools.parity import golden

TINY_A = os.path.join(MODELS, "tiny-a-f32.gguf")
TINY_B = os.path.join(MODELS, "tiny-b-f32.gguf")
DEFAULT, MMPROJ = (os.path.join(MODELS, f"glimmer-default{part}-f16.gguf") for part in ("", "-mmproj"))
FIX = os.path.join(ROOT, "tests", "fixtures")
TEXT = os.path.join(FIX, "perplexity", "text-crlf.txt")
DUMP = os.path.join(FIX, "tiny-a-f32.eval-callback.txt")


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prompts_file(path, prompts):  # [(id, token ids)] -> path of a JSON-lines prompt set
    path.write_text("".join(json.dumps({"id": i, "token_ids": ids}) + "\n" for i, ids in prompts))
    return path


# ---------------------------------------------------------------------------------------------
# An output path that is an input

def test_a_base_named_as_the_model_or_text_is_refused(tmp_path):
    model = shutil.copy(TINY_A, tmp_path / "m.gguf")
    text = shutil.copy(TEXT, tmp_path / "t.txt")
    before = digest(model), digest(text)
    cli_error(run_cli("tools.perplexity", "-m", model, "-f", text, "-c", "128", "--kl-divergence-base", model),
              "--kl-divergence-base", "would overwrite the input -m")
    os.link(text, tmp_path / "hard.txt")  # another name of the same file counts too
    cli_error(run_cli("tools.perplexity", "-m", model, "-f", text, "-c", "128", "--kl-divergence-base",
                      tmp_path / "hard.txt"), "would overwrite the input -f")
    assert (digest(model), digest(text)) == before


def test_diff_json_over_ref_and_logits_over_the_prompt_are_refused(tmp_path):
    ref = tmp_path / "ref.npy"
    np.save(ref, np.eye(4, dtype=np.float32))
    before = digest(ref)
    cli_error(run_cli("tools.diff", ref, ref, "--json-out", ref), "--json-out", "would overwrite the input REF")
    prompt = tmp_path / "p.npy"
    prompt.write_bytes(b"hello")
    cli_error(run_cli("reference.run", "--prompt-file", prompt, "--n-predict", "0", "--logits-out", prompt),
              "--logits-out", "would overwrite the input --file")
    assert digest(ref) == before and prompt.read_bytes() == b"hello"


# ---------------------------------------------------------------------------------------------
# Writes in place: a signal, an error or a full disk leave the older artifact as it was

INTERRUPTED_WRITE = """
import os, signal, sys
from reference import artifacts
def half(f):
    f.write(b"new" * 1000)
    os.kill(os.getpid(), signal.{sig})
    f.write(b"never")
with artifacts.interruptible("writer"):
    artifacts.write_file(sys.argv[1], half)
"""


@pytest.mark.parametrize("sig, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_mid_write_leaves_the_old_file_and_one_line(tmp_path, sig, status):
    target = tmp_path / "base.kld"
    target.write_bytes(b"old base")
    r = subprocess.run([sys.executable, "-c", INTERRUPTED_WRITE.replace("{sig}", sig), str(target)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == status, r.stderr
    assert r.stderr.strip() == f"writer: interrupted; {target} left as it was"  # no KeyboardInterrupt traceback
    assert target.read_bytes() == b"old base" and os.listdir(tmp_path) == ["base.kld"]


def test_a_failed_trace_over_an_older_one_leaves_the_older_trace(tmp_path):
    old = Tracer(str(tmp_path / "t"))
    old("embd_norm", np.ones((2, 4)))
    old.close()
    new = Tracer(str(tmp_path / "t"))
    new("embd_norm", np.zeros((3, 4)))
    new("l_out-0", np.zeros((3, 4)))
    new.discard()  # what an error or a signal does before close()
    trace = load_trace(str(tmp_path / "t"))
    assert list(trace) == ["embd_norm"] and trace["embd_norm"].shape == (2, 4)
    assert os.listdir(tmp_path) == ["t"]


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "g.npy"
    target.write_bytes(b"old")

    def full(f):
        f.write(b"x" * 100)
        raise OSError(28, "No space left on device")
    with pytest.raises(artifacts.ArtifactError, match=f"{target}: cannot write it \\(No space left on device\\); "
                                                      f"{target} left as it was"):
        artifacts.write_file(target, full)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["g.npy"]


def test_diff_refuses_files_the_manifest_does_not_vouch_for(tmp_path):
    """An interrupted golden run into an older --out leaves the older manifest beside newer files."""
    prompts = prompts_file(tmp_path / "p.jsonl", [("a", [1, 2, 3]), ("b", [4, 5])])
    out = tmp_path / "g"
    assert golden.main(["--engine", "reference", "--model", TINY_A, "--prompts", str(prompts), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(e["sha256"][e["file"]] == digest(out / e["file"]) for e in manifest["entries"])
    np.save(out / "b.npy", np.load(out / "b.npy") + 1)  # a newer golden written after the manifest
    cli_error(run_cli("tools.diff", out, out), "b.npy: not the file", "manifest.json vouches for")


def test_a_directory_without_a_manifest_is_compared_with_a_note(tmp_path):
    for side in ("r", "t"):
        (tmp_path / side).mkdir()
        np.save(tmp_path / side / "a.npy", np.eye(3, dtype=np.float32))
    r = run_cli("tools.diff", tmp_path / "r", tmp_path / "t")
    assert r.returncode == 0 and f"{tmp_path / 'r'}: no manifest.json vouches for these files" in r.stdout


# ---------------------------------------------------------------------------------------------
# Resume by content

def corpus(prompts, out, model):
    return ["--engine", "reference", "--model", str(model), "--prompts", str(prompts), "--out", str(out), "--corpus"]


def test_a_corpus_reruns_what_a_new_model_or_edited_prompt_changed(tmp_path, capsys):
    model = shutil.copy(TINY_A, tmp_path / "m.gguf")
    prompts = prompts_file(tmp_path / "p.jsonl", [("a", [1, 2, 3]), ("b", [4, 5])])
    out = tmp_path / "c"
    assert golden.main(corpus(prompts, out, model)) == 0
    capsys.readouterr()
    assert golden.main(corpus(prompts, out, model)) == 0
    assert "0 done, 0 failed, 2 skipped" in capsys.readouterr().out
    prompts_file(prompts, [("a", [1, 2, 3]), ("b", [4, 6])])  # b's ids edited under its id
    assert golden.main(corpus(prompts, out, model)) == 0
    assert "1 done, 0 failed, 1 skipped" in capsys.readouterr().out
    shutil.copy(TINY_B, model)  # another model under the same name
    assert golden.main(corpus(prompts, out, model)) == 0
    assert "2 done, 0 failed, 0 skipped" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["sha256"] == digest(TINY_B)


# ---------------------------------------------------------------------------------------------
# Non-regular and endless inputs

@pytest.mark.parametrize("tool, args", [
    ("reference.run", ["--prompt-file", "{fifo}", "--n-predict", "0"]),
    ("tools.golden", ["--engine", "reference", "--model", TINY_A, "--prompts", "{fifo}", "--out", "{tmp}/o"]),
    ("tools.perplexity", ["-m", TINY_A, "-f", "{fifo}"]),
    ("tools.diff", ["{fifo}", "{fifo}"]),
    ("tools.bisect", ["{fifo}", "{fifo}"]),
    ("reference.run", ["--model", "{fifo}", "--n-predict", "0"]),  # gguf.load
    ("reference.run", ["--model", DEFAULT, "--mmproj", MMPROJ, "--image", "{fifo}", "--n-predict", "0"]),  # load_rgb
])
def test_a_fifo_is_refused_by_name(tmp_path, tool, args):
    fifo = tmp_path / "f.npy"
    os.mkfifo(fifo)
    args = [a.replace("{fifo}", str(fifo)).replace("{tmp}", str(tmp_path)) for a in args]
    # a read that blocks on the FIFO would wait for ever: the timeout turns that into a failure
    cli_error(run_cli(tool, *args, timeout=120), f"{fifo}: a FIFO, not a regular file")


def test_devices_and_a_zip_bomb_are_refused_before_they_are_read(tmp_path):
    cli_error(run_cli("tools.perplexity", "-m", TINY_A, "-f", "/dev/zero"), "/dev/zero: a character device")
    bomb = tmp_path / "b.positions.npz"
    np.savez_compressed(bomb, positions=np.arange(3), n_vocab=np.int64(4), logits=np.zeros((1 << 14, 1 << 12), np.float32))
    assert os.path.getsize(bomb) < 1 << 20  # 256 MiB of zeros in well under a megabyte
    cli_error(run_cli("tools.diff", bomb, bomb), "inflates", "more than 32x")


# ---------------------------------------------------------------------------------------------
# Parsers

def test_nested_json_is_a_typed_error_everywhere(tmp_path):
    deep = "[" * 900 + "]" * 900
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(deep + "\n")
    with pytest.raises(common.GoldenError, match="nested more than 128 deep"):
        golden.read_prompts(prompts)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "index.json").write_text(deep)
    with pytest.raises(TraceError, match="nested more than"):
        load_trace(str(tmp_path / "t"))
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "manifest.json").write_text('{"entries": ' + deep + "}")
    cli_error(run_cli("tools.diff", tmp_path / "g", tmp_path / "g"), "manifest.json", "nested more than 128 deep")


def test_a_positions_golden_with_a_text_n_vocab_and_a_narrow_f32_base_are_one_line(tmp_path):
    bad = tmp_path / "x.positions.npz"
    np.savez(bad, positions=np.arange(2), n_vocab=np.array("many"), logits=np.zeros((2, 4), np.float32))
    cli_error(run_cli("tools.diff", bad, bad), "n_vocab a number")
    base = tmp_path / "b.npz"
    np.savez(base, n_ctx=np.int64(8), n_vocab=np.int64(512), tokens=np.zeros(8, np.int32),
             log_probs=np.zeros((1, 3, 7), np.float32))  # rows of 7, not of the 512 n_vocab says
    cli_error(run_cli("tools.perplexity", "-m", TINY_A, "--kl-divergence-base-f32", base, "--kl-divergence"),
              "do not fit n_ctx 8, n_vocab 512")


# ---------------------------------------------------------------------------------------------
# Wrong answers from bad input

def test_a_cut_dump_is_truncated_not_a_divergence(tmp_path):
    trace = tmp_path / "t"
    assert run_cli("reference.run", "--model", TINY_A, "--token-ids", "1,2", "--n-predict", "0",
                   "--trace", trace).returncode == 0
    lines = open(DUMP).read().splitlines()
    heads = [i for i, line in enumerate(lines) if " = (f32) " in line]
    (tmp_path / "mid.txt").write_text("\n".join(lines[:heads[40] + 3]) + "\n")  # inside tensor 41
    (tmp_path / "between.txt").write_text("\n".join(lines[:heads[40]]) + "\n")  # at a tensor boundary
    for cut in ("mid.txt", "between.txt"):  # a lost tail: compared up to the last whole point, and said so
        r = run_cli("tools.bisect", trace, tmp_path / cut)
        assert r.returncode in (0, 1) and "the dump's tail is missing after" in r.stdout, r.stdout + r.stderr
    (tmp_path / "gap.txt").write_text("\n".join(lines[:heads[40] + 3] + lines[heads[41]:]) + "\n")
    line = cli_error(run_cli("tools.bisect", trace, tmp_path / "gap.txt"), "truncated", "the last whole point is")
    assert "its values stop before the next tensor" in line  # cut in the middle: refused
    (tmp_path / "empty.txt").write_text(lines[heads[0]] + "\n")  # one header and no values
    cli_error(run_cli("tools.bisect", trace, tmp_path / "empty.txt"), "truncated")


def test_a_base_with_nan_scales_is_refused(tmp_path):
    n_ctx, n_vocab = 8, 512
    from tools.parity.kld_files import MAGIC
    from tools.parity.perplexity_arithmetic import n_scored, row_width
    rows = np.zeros((n_scored(n_ctx), row_width(n_vocab)), np.uint16)
    rows[1, :2] = np.array([np.nan], np.float32).view(np.uint16)  # row 1's scale
    path = tmp_path / "nan.kld"
    path.write_bytes(MAGIC + np.uint32(n_ctx).tobytes() + np.array([n_vocab, 1], np.int32).tobytes()
                     + np.zeros(n_ctx, np.int32).tobytes() + rows.tobytes())
    cli_error(run_cli("tools.perplexity", "-m", TINY_A, "--kl-divergence-base", path, "--kl-divergence"),
              "chunk 0 row 1 has scale nan")


def test_lengths_past_the_training_context_are_refused_the_same_way(tmp_path):
    ids = ",".join(["1"] * 4097)  # the tiny models were trained on 4096 positions
    cli_error(run_cli("reference.run", "--model", TINY_A, "--token-ids", ids, "--n-predict", "0"),
              "exceeds the training context of tiny-a-f32.gguf (4096 tokens; --beyond-n-ctx-train")
    cli_error(run_cli("reference.run", "--model", TINY_A, "--token-ids", "1", "--ctx", "8192"),
              "--ctx-size 8192 exceeds the training context")
    cli_error(run_cli("tools.perplexity", "-m", TINY_A, "-f", TEXT, "-c", "8192"), "-c 8192 exceeds the training context")
    prompts = prompts_file(tmp_path / "p.jsonl", [("long", [1] * 4097)])
    cli_error(run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts,
                      "--out", tmp_path / "o"), "prompt long: a sequence (prompt + generation) of 4097 exceeds")
    r = run_cli("reference.run", "--model", TINY_A, "--token-ids", "1,2", "--ctx", "4100", "--n-predict", "1",
                "--json", "--beyond-n-ctx-train")
    assert r.returncode == 0 and json.loads(r.stdout)["beyond_n_ctx_train"] is True


# ---------------------------------------------------------------------------------------------
# Messages

def test_a_golden_error_is_stderr_s_last_line_after_the_bar(tmp_path):
    prompts = prompts_file(tmp_path / "p.jsonl", [("a", [1, 2]), ("b", [1, 2])])
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "manifest.json").write_text('{"engine": "reference", "entries": []}')  # a golden directory
    (tmp_path / "o" / "b.npy").mkdir()  # the second golden cannot be written
    r = run_cli("tools.golden", "--engine", "reference", "--model", TINY_A, "--prompts", prompts, "--out", tmp_path / "o")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert last.startswith(f"tools.golden: {tmp_path / 'o' / 'b.npy'}: cannot write it"), r.stderr


def test_the_prompt_end_is_marked_on_a_terminal_and_in_a_pipe():
    from reference.run import GENERATED_MARK, PLAIN_STYLE, PROMPT_STYLE, marked_output
    assert marked_output("the prompt", " and more", True) == \
        f"{PROMPT_STYLE}the prompt{PLAIN_STYLE}{GENERATED_MARK} and more"
    assert marked_output("the prompt", " and more", False) == f"the prompt{GENERATED_MARK} and more"


def test_diff_names_a_missing_side(tmp_path):
    (tmp_path / "a").mkdir()
    cli_error(run_cli("tools.diff", tmp_path / "a", tmp_path / "missing"), f"{tmp_path / 'missing'}: no such file")


def test_signals_are_restored_after_a_command():
    before = signal.getsignal(signal.SIGINT)
    with artifacts.interruptible("x"):
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------------------------------------
# A first generated token that ends inside a UTF-8 character (llama-server merges it into the next entry)

def split_first_token_server(with_completion):  # -> a JsonServer whose first token is half of "€"
    def top(first, second):
        return [{"id": i, "logprob": lp, "bytes": b} for i, lp, b in (first, second)]
    # token 5 is b"\xe2\x82", token 6 b"\x80" (together "€"), token 7 b"A"; greedy: 5, 6, 7
    steps = [{"id": 6, "bytes": [0xE2, 0x82, 0x80], "logprob": -0.1,
              "top_logprobs": top((6, -0.1, [0x80]), (5, -3.0, [0xE2, 0x82]))},
             {"id": 7, "bytes": [0x41], "logprob": -0.2, "top_logprobs": top((7, -0.2, [0x41]), (5, -2.0, [0xE2, 0x82]))}]
    replies = {"/v1/models": {"data": [{"id": "m.gguf", "meta": {"n_vocab": 512}}]},
               "/v1/completions": {"choices": [{"logprobs": {"content": steps}, "finish_reason": "length"}],
                                   "usage": {"completion_tokens": 3}},
               "/completion": {"tokens": [5, 6, 7], "completion_probabilities": steps} if with_completion else None}
    return JsonServer(replies)


@pytest.mark.parametrize("with_completion", [True, False])
def test_a_split_first_token_keeps_what_can_be_kept_and_the_run_goes_on(tmp_path, with_completion):
    with split_first_token_server(with_completion) as server:
        url = server.url
        prompts = prompts_file(tmp_path / "p.jsonl", [("a", [1, 2]), ("b", [3])])
        out = tmp_path / "srv"
        status = golden.main(["--engine", "openai", "--server-url", url, "--n-predict", "3", "--n-probs", "2",
                              "--prompts", str(prompts), "--out", str(out)])
        assert status == (0 if with_completion else 1)  # no prompt got a golden: not a success
    entries = json.loads((out / "manifest.json").read_text())["entries"]
    assert [e["id"] for e in entries] == ["a", "b"]  # both prompts, the run did not stop
    if with_completion:  # llama-server's /completion token ids place the merged entry at token 1
        top = np.load(out / "a.topk.npz")
        assert top["tokens"].tolist() == [5, 6, 7] and top["positions"].tolist() == [1, 2]
        assert "UTF-8" in entries[0]["server_run"]["note"]
    else:  # no row can be placed: the manifest says so of each prompt, and tools.diff finds nothing to compare
        assert all(e["file"] is None and "no generated token with logprobs" in e["skipped"] for e in entries)
        cli_error(run_cli("tools.diff", out, out), "no logits found")
