"""The command lines of the benchmarks (tools.bench, tools.bench_accel, tools.bench_tokenizer), the op and
CUDA harnesses (accel.harness, accel.cuda_harness) and the generators (tools.make_synthetic,
tools.hf_trace): bad input is one stderr line naming the problem and exit status 2, before anything
large is allocated or written; one cheap valid run of each tool that has one still works."""
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from gguf import GGUFValueType

from reference import gguf
from tools.synthetic import write_text_gguf
from conftest import MODELS, ROOT, cli_error, run_cli

TINY = os.path.join(MODELS, "tiny-a-f32.gguf")
TINY_Q4 = os.path.join(MODELS, "tiny-a-q4_k_m.gguf")
MMPROJ = os.path.join(MODELS, "tiny-a-mmproj-f32.gguf")


@pytest.fixture
def paths(tmp_path):  # the names a case's arguments may use, as {name}: committed models and bad files
    with open(TINY, "rb") as f:
        data = f.read()
    (tmp_path / "trunc.gguf").write_bytes(data[:100])  # the header's counts cannot fit
    (tmp_path / "half.gguf").write_bytes(data[:len(data) // 2])  # tensors run past the end
    return {"tiny": TINY, "q4": TINY_Q4, "mmproj": MMPROJ, "tmp": str(tmp_path),
            "trunc": str(tmp_path / "trunc.gguf"), "half": str(tmp_path / "half.gguf"),
            "missing": str(tmp_path / "missing.gguf")}


def refused(module, args, paths):  # -> the one stderr line of `python -m module args` (exit 2, no traceback)
    return cli_error(run_cli(module, *[a.format(**paths) for a in args]))


def cases(*table):  # (args, expected words) rows -> pytest params, each named by its arguments
    return [pytest.param(args, words, id=" ".join(args) or "no arguments") for args, words in table]


# ---------------------------------------------------------------------------------------------
# tools.bench

@pytest.mark.parametrize("args, words", cases(
    ((), "required: what"),
    (("foo",), "invalid choice: 'foo'"),
    (("scale",), "scale needs --model or --mmproj"),
    (("scale", "--model", "{missing}"), "no such file"),
    (("scale", "--model", "{trunc}"), "corrupt header"),
    (("scale", "--model", "{half}"), "corrupt GGUF"),
    (("scale", "--model", "{mmproj}"), "expected a muse-glimmer text model"),
    (("scale", "--mmproj", "{tiny}"), "expected a muse-glimmer mmproj"),
    (("scale", "--model", "{tiny}", "--backend", "cupy"), "invalid choice: 'cupy'"),
    (("scale", "--model", "{tiny}", "--prompt-len", "0"), "--prompt-len: 0 is out of range"),
    (("scale", "--model", "{tiny}", "--prompt-len", "-3"), "--prompt-len: -3 is out of range"),
    (("scale", "--model", "{tiny}", "--n-predict", "-5"), "--n-predict: -5 is out of range"),
    (("scale", "--model", "{tiny}", "--n-predict", "1000000000000"), "--n-predict: 1000000000000 is out of range"),
    (("scale", "--model", "{tiny}", "--n-predict", "1e12"), "expected an integer, got '1e12'"),
    (("scale", "--mmproj", "{mmproj}", "--image-size", "0"), "--image-size: 0 is out of range"),
    (("scale", "--mmproj", "{mmproj}", "--image-size", "-5"), "--image-size: -5 is out of range"),
    (("scale", "--mmproj", "{mmproj}", "--image-size", "100000"), "--image-size: 100000 is out of range"),
    (("scale", "--mmproj", "{mmproj}", "--video-frames", "0"), "--video-frames: 0 is out of range"),
    (("scale", "--mmproj", "{mmproj}", "--video-frames", "4"), "has no video extension"),
    (("scale", "--model", "{tiny}", "--json", "{tmp}/none/x.json"), "no such directory"),
    (("scale", "--model", "{tiny}", "--json", "{tmp}"), "is a directory"),
    (("text", "--model", "{missing}", "--checkpoint", "{tmp}"), "no such file"),
    (("text", "--model", "{tiny}", "--checkpoint", "{tmp}/none"), "--checkpoint"),
    (("text", "--model", "{tiny}", "--checkpoint", "{tmp}", "--repeat", "0"), "--repeat: 0 is out of range"),
    (("text", "--model", "{tiny}", "--checkpoint", "{tmp}", "--prompt-len", "-1"), "--prompt-len: -1 is out of range"),
    (("scale", "--model", "{tiny}", "--prompt-len", "4097"), "--prompt-len 4097 keeps all-position logits: at most 4096"),
    (("scale", "--model", "{tiny}", "--logits", "some"), "argument --logits: invalid choice"),
    (("vision", "--layers", "0"), "--layers: 0 is out of range"),
    (("vision", "--layers", "-1"), "--layers: -1 is out of range"),
))
def test_bench_refuses(paths, args, words):
    line = refused("tools.bench", args, paths)
    assert line.startswith("tools.bench") and words in line, line


def test_bench_text_checkpoint_that_will_not_load(paths):
    # a directory that is no transformers checkpoint: refused before either engine is timed
    line = refused("tools.bench", ("text", "--model", "{tiny}", "--checkpoint", "{tmp}"), paths)
    have_torch = importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")
    assert ("cannot load the checkpoint" if have_torch else "needs torch and transformers") in line, line


def test_bench_vision_shows_each_step_on_stderr(tmp_path):
    # 40 s at the defaults: a bar names each step; stdout keeps the report alone
    out = tmp_path / "vision.json"
    r = run_cli("tools.bench", "vision", "--layers", "1", "--repeat", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    for step in ("synthetic tower", "1 window", "4 windows", "9 windows", "1024x1024 window-local",
                 "1024x1024 all global", "6/6"):
        assert step in r.stderr, step
    assert "vision:" not in r.stdout and "s per window" in r.stdout
    assert json.loads(out.read_text())["layers"] == 1


def test_bench_ggml_numba_takes_paths_and_names_and_says_so_whole():
    from tools.bench import ggml_numba
    assert ggml_numba.model_file(TINY) == TINY  # README: M is a path
    assert ggml_numba.model_file("tiny-a-f32") == TINY
    r = run_cli("tools.bench_ggml_numba", "--help")
    assert r.returncode == 0, r.stderr
    description = " ".join(r.stdout.split("\n\n")[1].split())
    assert "token-by-token decode" in description and description.endswith("bit-identical."), description


def test_bench_scale_runs(tmp_path):
    out = tmp_path / "scale.json"
    r = run_cli("tools.bench", "scale", "--model", TINY, "--prompt-len", "4", "--n-predict", "2", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["prompt_len"] == 4 and 1 <= report["generated"] <= 2


def test_bench_scale_video_runs(tmp_path):
    # 5 frames at 2 fps: 4 kept (whole pairs), 2 pairs; 1280 x 720 under tiny-a's cap of 36 tokens a pair
    # is 4 x 8 (the release's 144 gives 9 x 16); a line per pair on stderr
    out = tmp_path / "scale.json"
    r = run_cli("tools.bench", "scale", "--mmproj", os.path.join(MODELS, "tiny-a-mmproj-video-f32.gguf"),
                "--video-frames", "5", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert (report["frames_kept"], report["pairs"], report["grid"], report["video_tokens"]) == (4, 2, [4, 8], 64)
    assert "pair 2/2:" in r.stderr


def test_bench_scale_last_position_lifts_the_prompt_cap(tmp_path):
    # 4100 tokens: over the all-position cap of 4096, through the tiny model's 2048-row chunks
    out = tmp_path / "scale.json"
    r = run_cli("tools.bench", "scale", "--model", TINY, "--prompt-len", "4100", "--n-predict", "1",
                "--logits", "last", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["prompt_len"] == 4100 and report["logits"] == "last"


# ---------------------------------------------------------------------------------------------
# tools.bench_accel

@pytest.mark.parametrize("args, words", cases(
    ((), "required: what"),
    (("run",), "run needs a GGUF: MODEL or -m MODEL"),
    (("run", "{missing}", "--engines", "numpy"), "no such file"),
    (("run", "{trunc}", "--engines", "numpy"), "corrupt header"),
    (("run", "{mmproj}", "--engines", "numpy"), "expected a muse-glimmer text model"),
    (("kernels", "{missing}"), "no such file"),
    (("kernels", "{trunc}"), "corrupt header"),
    (("kernels", "{half}"), "corrupt GGUF"),
    (("ceiling", "{missing}"), "no such file"),
    (("ceiling", "{trunc}"), "corrupt header"),
    (("ceiling", "{mmproj}"), "expected a muse-glimmer text model"),
    (("ceiling", "{tiny}"), "no weight type with a floor loop (F32"),  # refused before any timing
    (("run", "{tiny}", "--threads", "0"), "--threads: 0 is out of range"),
    (("run", "{tiny}", "--threads", "-1"), "--threads: -1 is out of range"),
    (("run", "{tiny}", "--threads", "100000"), "--threads: 100000 is out of range"),
    (("run", "{tiny}", "--engines", "foo"), "unknown engine 'foo'"),
    (("run", "{tiny}", "--engines", "numpy,,numba"), "unknown engine ''"),
    (("run", "{tiny}", "--engines", "numpy,numpy"), "an engine named twice"),
    (("run", "{tiny}", "--prompt-len", "-1"), "--prompt-len: -1 is out of range"),
    (("run", "{tiny}", "--prompt-len", "4"), "8 decode steps need a prompt of at least as many tokens"),
    (("run", "{tiny}", "--prompt-len", "2049"), "--prompt-len 2049 keeps all-position logits of every engine"),
    (("run", "{tiny}", "--prompt-len", "131073", "--logits", "last"), "--prompt-len: 131073 is out of range"),
    (("run", "{tiny}", "--json", "{tmp}/none/x.json"), "no such directory"),
    (("run", "{tiny}", "--plot", "{tmp}/none/x.png"), "no such directory"),
    (("run", "{tiny}", "--plot", "{tmp}/x.xyz"), "matplotlib cannot write .xyz"),
    (("run", "{tiny}", "--one-shot", "--turns"), "--turns takes rounds in one"),
    (("make", "--out", "{tmp}/b"), "--layout mid quantizes with llama-quantize: --llama-bin DIR"),
    (("kernels", "{q4}", "--tokens", "a,b"), "--tokens: expected an integer, got 'a'"),
    (("kernels", "{q4}", "--tokens", "1,,2"), "--tokens: expected an integer, got ''"),
    (("kernels", "{q4}", "--tokens", "0"), "--tokens: 0 is out of range"),
    (("kernels", "{q4}", "--rows", "0"), "--rows: 0 is out of range"),
    (("ceiling", "{q4}", "--rows", "-1"), "--rows: -1 is out of range"),
    (("ceiling", "{q4}", "--n-in", "6"), "--n-in 6 is not a multiple of 4"),
    (("blocks", "{missing}"), "no such file"),
    (("blocks", "{trunc}"), "corrupt header"),
    (("blocks", "{mmproj}"), "expected a muse-glimmer text model"),
    (("blocks", "{q4}", "--tokens", "0"), "--tokens: 0 is out of range"),
    (("blocks", "{q4}", "--json", "{tmp}/none/x.json"), "no such directory"),
    (("table", "{tiny}", "-n", "300"), "-n 300: at most 256"),
    (("table", "{tiny}", "-p", "0", "-n", "0"), "no test: every -p and -n is 0"),
    (("table", "{tiny}", "-d", "-1"), "-d: -1 is out of range"),
    (("table", "{tiny}", "-r", "0"), "-r: 0 is out of range"),
    (("table", "{tiny}", "--engines", "numpy"), "unknown engine 'numpy'"),
    (("table", "{mmproj}", "--engines", "numba"), "expected a muse-glimmer text model"),
    (("table", "{tiny}", "--md-out", "{tmp}/none/t.md"), "no such directory"),
    (("gemm", "{missing}"), "no such file"),
    (("gemm", "{mmproj}"), "expected a muse-glimmer text model"),
    (("gemm", "{q4}", "--tokens", "2"), "--tokens: 2 is out of range"),
    (("gemm", "{q4}", "--rows", "0"), "--rows: 0 is out of range"),
    (("vision",), "required: mmproj"),
    (("vision", "{missing}"), "no such file"),
    (("vision", "{trunc}"), "corrupt header"),
    (("vision", "{tiny}"), "expected a muse-glimmer mmproj (clip), found a muse-glimmer text model"),
    (("vision", "{mmproj}", "--image-size", "13"), "--image-size: 13 is out of range"),
    (("vision", "{mmproj}", "--llama-bin", "{tmp}"), "needs both --llama-bin DIR and --model"),
    (("vision", "{mmproj}", "--model", "{tiny}"), "needs both --llama-bin DIR and --model"),
    (("vision", "{mmproj}", "--llama-bin", "{tmp}", "--model", "{tiny}"), "no executable llama-mtmd-cli there"),
    (("vision", "{mmproj}", "--plot", "{tmp}/x.xyz"), "matplotlib cannot write .xyz"),
    (("vision", "{mmproj}", "--json", "{tmp}/none/x.json"), "no such directory"),
))
def test_bench_accel_refuses(paths, args, words):
    line = refused("tools.bench_accel", args, paths)
    assert line.startswith("tools.bench_accel") and words in line, line


def test_bench_accel_make_checks_llama_quantize_first(tmp_path):
    # the 7.5 GB F16 model would be written before the missing quantizer was found
    out = tmp_path / "bench"
    r = run_cli("tools.bench_accel", "make", "--llama-bin", tmp_path / "no-llama", "--out", out)
    assert "no executable llama-quantize" in cli_error(r)
    assert not out.exists()


def test_bench_accel_run_on_a_tiny_model(tmp_path):
    # the prompt's ids come from the model's own vocabulary (512 here), not the mid-size model's
    out = tmp_path / "run.json"
    r = run_cli("tools.bench_accel", "run", TINY, "--engines", "numpy", "--prompt-len", "4",
                "--n-decode-numpy", "1", "--repeat", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    assert list(json.loads(out.read_text())["engines"]) == ["numpy"]


def fake_mtmd_cli(directory, script):  # -> directory with an executable llama-mtmd-cli running `script` (sh)
    cli = directory / "llama-mtmd-cli"
    cli.write_text("#!/bin/sh\n" + script)
    cli.chmod(0o755)
    return directory


def test_bench_accel_vision_reads_llama_mtmd_clis_encoding_time(tmp_path):
    pytest.importorskip("numba")
    # mtmd-cli.cpp's own line after mtmd_batch_encode, among the loader's; the process is stopped there
    # (the sleep would otherwise hold the run for a minute)
    bin_dir = fake_mtmd_cli(tmp_path, 'echo "load_tensors: ..."\n'
                                      'echo "0.13.081.928 I encoding mtmd batch, n_chunks = 1"\n'
                                      'echo "3.28.303.083 I mtmd batch encoding done in 195220 ms"\nsleep 60\n')
    out, plot = tmp_path / "vision.json", tmp_path / "vision.png"
    r = run_cli("tools.bench_accel", "vision", MMPROJ, "--image-size", "56", "--threads", "1",
                "--llama-bin", bin_dir, "--model", TINY, "--json", out, "--plot", plot)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["llama_mtmd_cli_s"] == 195.22 and report["image_tokens"] == 4  # 56 px: 2 x 2 merged tokens
    assert report["numba_over_llama_mtmd_cli"] == pytest.approx(195.22 / report["numba_s"])
    assert plot.stat().st_size > 0


def test_bench_accel_vision_refuses_a_failed_llama_mtmd_cli(tmp_path):
    pytest.importorskip("numba")
    bin_dir = fake_mtmd_cli(tmp_path, 'echo "E Model does not have chat template."\nexit 1\n')
    r = run_cli("tools.bench_accel", "vision", MMPROJ, "--image-size", "56", "--threads", "1",
                "--llama-bin", bin_dir, "--model", TINY)
    line = cli_error(r)
    assert "llama-mtmd-cli exited with status 1 before encoding the image" in line
    assert "Model does not have chat template." in line


def test_bench_accel_blocks_times_every_matrix_of_a_forward(tmp_path):
    pytest.importorskip("numba")
    out = tmp_path / "blocks.json"
    r = run_cli("tools.bench_accel", "blocks", TINY_Q4, "--tokens", "3", "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    # gguf-py's reader counts the matrices: every 2-D weight but the looked-up embedding, by type
    from gguf import GGUFReader
    matrices = [t for t in GGUFReader(TINY_Q4).tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    assert {row["type"]: row["matrices"] for row in report["types"]} == dict(Counter(t.tensor_type.name for t in matrices))
    assert report["total"]["gb"] * 1e9 == sum(int(t.n_bytes) for t in matrices)
    assert all(row["kernel_s"] > 0 and row["floor_s"] > 0 for row in report["types"])


def test_bench_accel_gemm_times_each_weight_types_largest_matrix_against_the_fma_peak(tmp_path):
    pytest.importorskip("numba")
    out = tmp_path / "gemm.json"
    r = run_cli("tools.bench_accel", "gemm", TINY_Q4, "--tokens", "13", "--rows", "40", "--threads", "1",
                "--repeat", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    from gguf import GGUFReader  # gguf-py's reader names the types and their largest matrices' widths
    matrices = [t for t in GGUFReader(TINY_Q4).tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    largest = {}
    for t in matrices:
        if t.tensor_type.name not in largest or t.n_elements > largest[t.tensor_type.name].n_elements:
            largest[t.tensor_type.name] = t
    assert {row["type"]: (row["matrix"], row["n_in"]) for row in report["types"]} == \
        {kind: (t.name, int(t.shape[0])) for kind, t in largest.items()}
    assert all(row["rows"] == min(40, int(largest[row["type"]].shape[1])) for row in report["types"])
    assert report["peak_gflop_s"] > 0
    assert all(row["share"] == pytest.approx(row["gflop_s"] / report["peak_gflop_s"]) for row in report["types"])


def test_bench_accel_run_last_position_agrees_with_llama_cpp(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("numba")
    out = tmp_path / "run.json"
    r = run_cli("tools.bench_accel", "run", TINY, "--engines", "numba,llama-cpp", "--prompt-len", "2100",
                "--logits", "last", "--n-decode", "1", "--repeat", "1", "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    agreement = json.loads(out.read_text())["logits_vs_numba"]["llama-cpp"]
    # the last row only, after llama.cpp's two batches (2048 + 52) into its default F16 KV cache:
    # tests/test_text_parity.py's F16-cache gate (7e-6, its tiny-a runs measured 2.0e-6); here 3.7e-6
    assert agreement["nmse"] <= 7e-6 and agreement["top1"] == 1.0


def test_bench_accel_run_numba_ggml_is_llama_cpp_bit_for_bit(tmp_path):  # both in one run, rounds in turns
    pytest.importorskip("llama_cpp")
    pytest.importorskip("numba")
    out = tmp_path / "run.json"
    r = run_cli("tools.bench_accel", "run", TINY_Q4, "--engines", "numba-ggml,llama-cpp", "--prompt-len", "9",
                "--n-decode", "2", "--repeat", "2", "--threads", "2", "--turns", "--json", out,
                "--plot", tmp_path / "run.png")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    # the same file, F16 KV, flash attention off, plain buffers on both sides: the emulation's claim is every bit
    agreement = report["logits_vs_numba"]["llama-cpp vs numba-ggml"]
    assert agreement["nmse"] == 0 and agreement["max_abs_diff"] == 0 and agreement["top1"] == 1.0
    assert all(e["repeat"] == 2 and e["prefill_tok_s"] > 0 for e in report["engines"].values())


def test_bench_accel_table_quick(tmp_path):
    """llama-bench's tests (pp16, pp40, tg4 at depths 0 and 24: past tiny-a's 8-token window) for every
    engine here, in one command; where llama.cpp ran too, numba ggml-cpu's logits are its own, every bit."""
    pytest.importorskip("numba")
    engines = ["numba-ggml", "numba"] + (["llama-cpp"] if importlib.util.find_spec("llama_cpp") else [])
    out, md, plot = tmp_path / "table.json", tmp_path / "table.md", tmp_path / "table.png"
    r = run_cli("tools.bench_accel", "table", TINY_Q4, "--quick", "-t", "1", "--engines", ",".join(engines),
                "--json-out", out, "--md-out", md, "--plot", plot)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["tests"] == ["pp16", "pp40", "tg4 @ d0", "tg4 @ d24"]
    assert all(report["engines"][e][name]["tok_s"] > 0 for e in engines for name in report["tests"])
    assert md.read_text().count("| tiny-a-q4_k_m.gguf |") == len(engines) * 4 and "pp40" in r.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if "llama-cpp" in engines:  # the prefill's last row and every decode step's
        for name in report["tests"]:
            a = report["engines"]["numba-ggml"][name]["logits_vs_llama_cpp"]
            assert a["nmse"] == 0 and a["max_abs_diff"] == 0, (name, a)


# ---------------------------------------------------------------------------------------------
# tools.bench_tokenizer

@pytest.fixture
def paths_with_unknown_pre(paths, tmp_path):  # + {pre_foo}: a text GGUF whose pre-tokenizer nobody implements
    path = str(tmp_path / "pre_foo.gguf")
    write_text_gguf(path, extra_keys={"tokenizer.ggml.pre": ("foo", GGUFValueType.STRING)})
    return {**paths, "pre_foo": path}


@pytest.mark.parametrize("args, words", cases(
    (("--model", "{missing}"), "no such file"),
    (("--model", "{trunc}"), "corrupt header"),
    (("--model", "{mmproj}"), "missing required key tokenizer.ggml.tokens"),
    (("--model", "{pre_foo}"), "tokenizer.ggml.pre 'foo' is not supported"),
    (("--repeat", "0"), "--repeat: 0 is out of range"),
))
def test_bench_tokenizer_refuses(paths_with_unknown_pre, args, words):
    line = refused("tools.bench_tokenizer", args, paths_with_unknown_pre)
    assert line.startswith("tools.bench_tokenizer") and words in line, line


def test_bench_tokenizer_without_tokenizers_names_the_extra():
    # sys.modules[name] = None makes `import name` raise ModuleNotFoundError, as when it is not installed
    code = ("import sys, runpy; sys.modules['tokenizers'] = None; sys.argv = ['x']; "
            "runpy.run_module('tools.bench_tokenizer', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert cli_error(r) == 'tools.bench_tokenizer: its Rust side needs the tokenizers package: ' \
                           'pip install -e ".[tokenizer]"'


# ---------------------------------------------------------------------------------------------
# accel.harness and accel.cuda_harness

@pytest.mark.parametrize("args, words", cases(
    (("--ops", "foo"), "unknown op 'foo'"),
    (("--ops", ","), "unknown op ''"),
    (("--ops", "linear,foo"), "unknown op 'foo'"),
    (("--seed", "-1"), "--seed: -1 is out of range"),
    (("--seed", "x"), "--seed: expected an integer, got 'x'"),
    (("--backend", "foo"), "unknown backend 'foo'"),
))
def test_harness_refuses(paths, args, words):
    line = refused("accel.harness", args, paths)
    assert line.startswith("accel.harness") and words in line, line


def test_harness_runs_one_op():
    r = run_cli("accel.harness", "--backend", "numpy", "--ops", "rms_norm")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("all passed") and "rms_norm" in r.stdout


@pytest.mark.parametrize("args, words", cases(
    ((), "required: what"),
    (("foo",), "invalid choice: 'foo'"),
    (("bench",), "bench needs a model"),
    (("products",), "products needs a model"),
    (("parity", "--prompt-len", "0"), "--prompt-len: 0 is out of range"),
    (("graph", "--n-decode", "-1"), "--n-decode: -1 is out of range"),
    (("parity", "--models", "tiny-a-f32,nope"), "no model 'nope' in golden/models"),
    (("parity", "--json", "{tmp}/none/x.json"), "no such directory"),
))
def test_cuda_harness_refuses(paths, args, words):
    line = refused("accel.cuda_harness", args, paths)
    assert line.startswith("accel.cuda_harness") and words in line, line


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: parity would run")
def test_cuda_harness_without_cupy(paths):
    assert "needs CuPy" in refused("accel.cuda_harness", ("parity",), paths)


# ---------------------------------------------------------------------------------------------
# tools.make_synthetic and tools.hf_trace

@pytest.mark.parametrize("args, words", cases(
    (("{tmp}/none/out.gguf",), "No such file or directory"),
    (("{tmp}",), "Is a directory"),
    (("{tmp}/out.gguf", "--type", "FOO"), "unknown GGML type 'FOO'"),
    (("{tmp}/out.gguf", "--type", "Q4_K"), "gguf-py cannot quantize Q4_K"),
    # Q8_0 is refused no more: the converter keeps the patch embedding (rows of 3 x 14 x 14) in F32 there
    (("{tmp}/out.gguf", "--role", "mmproj", "--type", "Q2_K"), "not a multiple of Q2_K's block of 256"),
    (("{tmp}/out.gguf", "--role", "dflash", "--type", "Q2_K"), "not a multiple of Q2_K's block of 256"),
    (("{tmp}/out.gguf", "--layers", "-2"), "--layers: -2 is out of range"),
    (("{tmp}/out.gguf", "--layers", "0"), "--layers: 0 is out of range"),
    (("{tmp}/out.gguf", "--layers", "1"), "a text model needs at least 2 layers"),
    (("{tmp}/out.gguf", "--layout", "30b", "--role", "dflash", "--layers", "6"), "has at most 5 layers"),
    (("{tmp}/out.gguf", "--seed", "-1"), "--seed: -1 is out of range"),
    (("{tmp}/out.gguf", "--vocab", "3"), "--vocab: 3 is out of range"),
    (("{tmp}/out.gguf", "--role", "mmproj", "--vocab", "600"), "--vocab is the text role's"),
    (("{tmp}/out.gguf", "--video"), "--video is the mmproj role's"),
    (("{tmp}/out.gguf", "--role", "foo"), "invalid choice: 'foo'"),
))
def test_make_synthetic_refuses(paths, args, words):
    line = refused("tools.make_synthetic", args, paths)
    assert line.startswith("tools.make_synthetic") and words in line, line
    assert not os.path.exists(os.path.join(paths["tmp"], "out.gguf"))


@pytest.mark.parametrize("role, layers, qtype", [("text", "2", "F16"), ("mmproj", "1", "F16"), ("mmproj", "1", "Q8_0"),
                                                 ("dflash", "1", "F16")])
def test_make_synthetic_writes_what_the_loader_takes(tmp_path, role, layers, qtype):
    out = tmp_path / "out.gguf"
    r = run_cli("tools.make_synthetic", out, "--role", role, "--layers", layers, "--type", qtype)
    assert r.returncode == 0, r.stderr
    assert gguf.load(out, role).config.n_layer == int(layers)


def test_make_synthetic_video_extension(tmp_path):
    # --video: the extension tools.video_mmproj adds (the temporal key, W1 in F32 shaped as the kernel),
    # so that encode_video runs; the tower is random, so only the shape of its output is checked
    from reference import vision
    from reference.video import Video, prepare
    out = tmp_path / "out.gguf"
    r = run_cli("tools.make_synthetic", out, "--role", "mmproj", "--type", "F16", "--video")
    assert r.returncode == 0, r.stderr
    m = gguf.load(out, "mmproj")
    assert m.config.temporal_patch_size == 2
    assert (m.weights.type_name(gguf.PATCH_EMBD_T1), m.weights.shape(gguf.PATCH_EMBD_T1)) == \
        ("F32", m.weights.shape("v.patch_embd.weight"))
    prepared = prepare(Video(np.zeros((4, 56, 84, 3), np.uint8), 2.0, "v"), 2.0, 96, 144, 28)
    assert vision.VisionModel(m).encode_video(prepared).shape == (2 * 2 * 3, 256)


def test_make_synthetic_vocab_sets_the_vocabulary(tmp_path):
    out = tmp_path / "out.gguf"
    r = run_cli("tools.make_synthetic", out, "--layers", "2", "--vocab", "700")
    assert r.returncode == 0, r.stderr
    m = gguf.load(out, "text")
    assert m.config.n_vocab == 700 and m.weights.shape("token_embd.weight") == (700, 256)


@pytest.mark.parametrize("args, words", cases(
    ((), "required: --checkpoint, --token-ids, --out"),
    (("--checkpoint", "x"), "required: --token-ids, --out"),
))
def test_hf_trace_refuses(paths, args, words):
    line = refused("tools.hf_trace", args, paths)
    assert line.startswith("tools.hf_trace") and words in line, line


def test_bench_accel_one_shot_is_llama_cpps_logits(tmp_path):
    # --one-shot: each engine once in a process of its own, load included. The ggml-cpu mode on numba
    # gives llama.cpp's logits (plain buffers) bit for bit, so the comparison's NMSE is 0 exactly.
    pytest.importorskip("llama_cpp")
    out = tmp_path / "r.json"
    r = run_cli("tools.bench_accel", "run", TINY_Q4, "--engines", "numba-ggml,llama-cpp", "--one-shot",
                "--prompt-len", "8", "--n-decode", "2", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["logits_vs_numba"]["llama-cpp vs numba-ggml"] == {"nmse": 0.0, "max_abs_diff": 0.0, "top1": 1.0}
    for engine in report["engines"].values():  # a child's own peak RSS and wall seconds, load included
        assert engine["peak_rss_gb"] > 0 and engine["total_s"] >= engine["load_s"] > 0
