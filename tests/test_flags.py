"""The command lines speak llama.cpp's dialect: every parser of the project's tools is read, and one
concept has one set of spellings everywhere (reference/cli.py's FLAG_NAMES), one option string means
one concept everywhere, and the llama.cpp flags each tool must take (LLAMA_FLAGS) are there."""
import argparse
import importlib
import json
import os

import numpy as np
import pytest
from conftest import MODELS, ROOT, run_cli

from reference import cli
from reference.cli import FLAG_NAMES

# tool -> (module, argv that reaches its parser; a subcommand tool is read through its subparsers)
TOOLS = {
    "reference.run": ("reference.run", []),
    "tools.perplexity": ("tools.parity.perplexity", []),
    "tools.golden": ("tools.parity.golden", []),
    "tools.bisect": ("tools.parity.bisect", []),
    "tools.diff": ("tools.parity.diff", []),
    "tools.hf_trace": ("tools.parity.hf_trace", []),
    "reference.serve": ("reference.serve.server", []),
    "tools.bench_accel": ("tools.bench.accel", []),
    "tools.bench": ("tools.bench.forward", []),
    "tools.bench_ggml_numba": ("tools.bench.ggml_numba", []),
    "tools.bench_tokenizer": ("tools.bench.tokenizer", []),
    "tools.bench.serve": ("tools.bench.serve", []),
    "accel.harness": ("accel.harness", []),
    "accel.cuda_harness": ("accel.cuda_harness", []),
}
# the llama.cpp flags (common/arg.cpp of llama.cpp 0c1e570) each tool takes wherever the concept exists in it
NUMERICS = ["-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "-fa", "--flash-attn", "-nr", "--no-repack", "--repack"]
LLAMA_FLAGS = {
    "reference.run": ["-m", "--model", "-p", "--prompt", "-f", "--file", "-n", "--n-predict", "-c", "--ctx-size",
                      "-t", "--threads", "-b", "--batch-size", "-ub", "--ubatch-size", "-sys", "--system-prompt",
                      "-md", "--model-draft", "--spec-draft-n-max", "--spec-draft-p-min", "--temp", "--top-k",
                      "-s", "--seed", "--verbose-prompt", *NUMERICS],
    "tools.perplexity": ["-m", "--model", "-f", "--file", "-c", "--ctx-size", "-b", "--batch-size", "-ub",
                         "--ubatch-size", "-t", "--threads", "--chunks", "--kl-divergence-base", "--kl-divergence",
                         *NUMERICS],
    "tools.golden": ["-m", "--model", "-n", "--n-predict", "-c", "--ctx-size", "-ub", "--ubatch-size", "-t",
                     "--threads", *NUMERICS],
    "tools.bisect": ["-m", "--model"],
    "reference.serve": ["-m", "--model", "-c", "--ctx-size", "-t", "--threads", "-ub", "--ubatch-size", *NUMERICS],
    "tools.bench_accel": ["-m", "--model", "-t", "--threads", "-n", "--n-predict"],
    "tools.bench": ["-m", "--model", "-n", "--n-predict"],
    "tools.bench_ggml_numba": ["-n", "--n-predict", "-ctk", "-ctv", "-fa"],
}


class Captured(BaseException):  # raised from parse_args with the parser: not an Exception a main() catches
    def __init__(self, parser):
        self.parser = parser


def parser_of(module):  # -> the top-level parser module.main builds
    def capture(self, args=None, namespace=None):
        raise Captured(self)
    own = vars(cli.OneLineParser).get("parse_args")  # None: it inherits argparse's, which must stay visible
    cli.OneLineParser.parse_args = capture
    try:
        importlib.import_module(module).main([])
    except Captured as c:
        return c.parser
    finally:
        if own is None:
            del cli.OneLineParser.parse_args
        else:
            cli.OneLineParser.parse_args = own
    raise AssertionError(f"{module}.main never parsed its arguments")


def options(parser, prefix=""):  # -> [(command, option strings, dest)] of every visible option, subcommands too
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += options(sub, f"{prefix}{name} ")
        elif action.option_strings and action.help is not argparse.SUPPRESS and action.dest != "help":
            found.append((prefix.strip(), tuple(action.option_strings), action.dest))
    return found


@pytest.fixture(scope="module")
def parsed():  # -> {tool: [(command, option strings, dest)]}
    return {tool: options(parser_of(module)) for tool, (module, _) in TOOLS.items()}


def test_one_concept_one_spelling(parsed):
    meaning, spellings = {}, {}
    for tool, found in parsed.items():
        for command, strings, dest in found:
            where = f"{tool} {command}".strip()
            for s in strings:
                meaning.setdefault(s, {}).setdefault(dest, []).append(where)
            spellings.setdefault(dest, {}).setdefault(strings, []).append(where)
    two_meanings = {s: m for s, m in meaning.items() if len(m) > 1}
    assert not two_meanings, f"one option string, several concepts: {two_meanings}"
    for concept, names in FLAG_NAMES.items():
        other = {strings: where for strings, where in spellings.get(concept, {}).items() if strings != names}
        assert not other, f"{concept} is spelled {names} in reference/cli.py but otherwise in {other}"
    for s, m in meaning.items():  # a shared name is only ever used through reference.cli.flag
        for concept, names in FLAG_NAMES.items():
            if s in names:
                assert list(m) == [concept], f"{s} means {list(m)} in {m}, not {concept}"


@pytest.mark.parametrize("tool", sorted(LLAMA_FLAGS))
def test_llama_cpp_flags_present(parsed, tool):
    have = {s for _, strings, _ in parsed[tool] for s in strings}
    missing = [f for f in LLAMA_FLAGS[tool] if f not in have]
    assert not missing, f"{tool} lacks llama.cpp's {missing}"


def test_json_is_a_switch_and_json_out_a_path(parsed):
    """--json prints on stdout; a file is --json-out: one spelling never does both."""
    for tool, found in parsed.items():
        for command, strings, dest in found:
            if "--json" in strings:
                assert dest == "json", (tool, command, strings)
            if "--json-out" in strings:
                assert dest == "json_out", (tool, command, strings)


def test_no_abbreviations():
    """-ctv was read as -c with the value 'tv' when -ctv was not an option, and --n as a guess among
    --n-*: the parsers match options whole."""
    from tools.parity import perplexity
    args = perplexity.build_parser().parse_args(["-m", "M", "-ctk", "f32", "-ctv", "f32", "-fa", "off"])
    assert (args.cache_type_k, args.cache_type_v, args.flash_attn, args.ctx_size) == ("f32", "f32", "off", 512)
    with pytest.raises(SystemExit):
        perplexity.build_parser().parse_args(["-m", "M", "--kl-div"])


# -------------------------------------------------------------------------------------------------
# The terminal: what a run prints about itself

DEFAULT = os.path.join(MODELS, "glimmer-default-f16.gguf")
DRAFTER = os.path.join(MODELS, "glimmer-default-dflash-f16.gguf")
PPL_TEXT = os.path.join(ROOT, "tests", "fixtures", "perplexity", "text-crlf.txt")


def test_llama_cpp_command_line_runs_and_is_recorded():
    """reference.run -m M -p Hello -n 4 -c 64 -t 2 --temp 0 --seed 7, as a llama.cpp user types it."""
    r = run_cli("reference.run", "-m", DEFAULT, "-p", "Hello", "-n", "4", "-c", "64", "-t", "2", "--temp", "0",
                "--seed", "7", "--numerics", "ggml-cpu", "-ctk", "f32", "-ctv", "f32", "-fa", "auto", "--json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)["provenance"]
    assert (made["numerics"], made["cache_type_k"], made["cache_type_v"], made["flash_attn"], made["threads"],
            made["seed"], made["prefill_chunk"]) == ("ggml-cpu", "f32", "f32", "on", 2, 7, 512)
    assert len(made["model"]["sha256"]) == 64 and made["software"]["numpy"]


def test_k_and_v_cache_types_apart_are_recorded_apart():  # their logits: test_ggml_cpu's mixed-KV goldens
    r = run_cli("reference.run", "-m", os.path.join(MODELS, "tiny-a-f32.gguf"), "-p", "Hello", "-n", "1",
                "--numerics", "ggml-cpu", "-ctk", "f16", "-ctv", "q8_0", "--json")  # head_dim 32: one Q8_0 block
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)["provenance"]
    assert (made["cache_type_k"], made["cache_type_v"], made["flash_attn"]) == ("f16", "q8_0", "on")  # -fa auto: on


@pytest.mark.parametrize("args, message", [
    (["--temp", "0.8"], "--temp 0.8 samples; the reference decodes greedily only"),
    (["--top-k", "40", "--temp", "0.7"], "--temp 0.7 samples"),
    (["--numerics", "ggml-cpu", "-ctk", "f16", "-ctv", "q8_0", "-fa", "off"], "a q8_0 V cache needs flash attention"),
])
def test_what_the_reference_cannot_do_is_one_line(args, message):
    r = run_cli("reference.run", "-m", DEFAULT, "-n", "1", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_a_long_prompt_is_shown_cut_unless_verbose_prompt():
    text = " ".join(["word"] * 200)
    r = run_cli("reference.run", "-m", DEFAULT, "-p", text, "-n", "1")
    assert r.returncode == 0, r.stderr
    assert "prompt tokens not shown: --verbose-prompt" in r.stdout and text not in r.stdout
    r = run_cli("reference.run", "-m", DEFAULT, "-p", text, "-n", "1", "--verbose-prompt")
    assert r.returncode == 0 and text in r.stdout and "not shown" not in r.stdout


def test_clamps_say_so_in_one_warning_line(tmp_path):
    r = run_cli("reference.run", "-m", DEFAULT, "-md", DRAFTER, "--spec-draft-n-max", "7", "-n", "2")
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "--spec-draft-n-max 7 runs as 3" in warning[0], r.stderr
    r = run_cli("reference.run", "-m", DEFAULT, "--token-ids", "1,2,3,4", "-n", "0", "--logits-positions",
                "last,0:8", "--logits-out", tmp_path / "clamp.positions.npz")
    assert r.returncode == 0, r.stderr
    assert "warning: --logits-positions on a prompt of 4 tokens: 0:8 runs as 0:4" in r.stderr, r.stderr
    r = run_cli("tools.perplexity", "-m", os.path.join(MODELS, "tiny-a-f32.gguf"), "-f", PPL_TEXT, "-c", "128",
                "-b", "128", "--chunks", "1000")
    assert r.returncode == 0, r.stderr
    chunks = [line for line in r.stderr.splitlines() if "--chunks 1000" in line]
    assert len(chunks) == 1 and "warning" in chunks[0] and "running" in chunks[0], r.stderr
    assert "seconds per chunk - ETA" in r.stderr


def test_golden_positions_past_the_prompt_say_so_in_one_warning_line(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "four", "token_ids": [1, 2, 3, 4]}\n')
    r = run_cli("tools.golden", "--engine", "reference", "-m", DEFAULT, "--prompts", prompts, "--out", tmp_path / "g",
                "--logits-positions", "last,0:8")
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stderr.splitlines() if "warning" in line]
    assert warning == ["tools.golden: warning: prompt four: --logits-positions last,0:8 on 4 tokens: 0:8 runs as 0:4"], \
        r.stderr
    kept = np.load(tmp_path / "g" / "four.positions.npz")["positions"]
    assert kept.tolist() == [0, 1, 2, 3]


def test_golden_engine_reference_writes_ggml_cpu_goldens_and_diff_names_the_configuration(tmp_path):
    """tools.golden --engine reference takes reference.run's numerics flags: with llama.cpp's F16 cache
    and flash attention it writes llama.cpp's own logits (the committed llama-cpp golden, made by
    llama-cpp-python 0.3.36, bit for bit: NMSE 0 is the gate), and tools.diff shows both sides'
    provenance; against the F32-cache golden it says the cache types differ before its verdict."""
    out = tmp_path / "ref"
    r = run_cli("tools.golden", "--engine", "reference", "-m", os.path.join(MODELS, "tiny-a-f32.gguf"), "--prompts",
                os.path.join(ROOT, "golden", "prompts", "text.jsonl"), "--out", out, "--numerics", "ggml-cpu",
                "-ctk", "f16", "-ctv", "f16", "-fa", "on")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["options"]["numerics"], manifest["options"]["cache_type_k"], manifest["options"]["flash_attn"]) \
        == ("ggml-cpu", "f16", "on") and manifest["provenance"]["numpy"]
    goldens = os.path.join(ROOT, "golden", "logits", "llama-cpp", "tiny-a-f32")
    r = run_cli("tools.diff", os.path.join(goldens, "kv-f16_fa-on"), out, "--allow-subset", "--gate", "nmse=0",
                "--json-out", tmp_path / "d.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("REF: tiny-a-f32.gguf") and "\nTEST: tiny-a-f32.gguf" in r.stdout
    assert "configurations differ" not in r.stdout
    overall = json.loads((tmp_path / "d.json").read_text())["overall"]
    assert (overall["nmse_max"], overall["kl_max"], overall["top1"], overall["n_pos"]) == (0.0, 0.0, 1.0, 105)
    r = run_cli("tools.diff", os.path.join(goldens, "kv-f32_fa-off"), out, "--allow-subset")
    lines = r.stdout.splitlines()
    differ = [i for i, line in enumerate(lines) if line.startswith(
        "the configurations differ in K cache type f32 vs f16, V cache type f32 vs f16, flash attention off vs on")]
    verdict = next(i for i, line in enumerate(lines) if line.startswith("overall:"))
    assert len(differ) == 1 and differ[0] < verdict, r.stdout
