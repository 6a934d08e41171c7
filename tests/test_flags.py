"""The command lines speak llama.cpp's dialect: every parser of the project's tools is read, and one
concept has one set of spellings everywhere (reference/cli.py's FLAG_NAMES), one option string means
one concept everywhere, and the llama.cpp flags each tool must take (LLAMA_FLAGS) are there."""
import argparse
import importlib

import pytest

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
    "tools.bench_accel": ("tools.bench.accel", []),
    "tools.bench": ("tools.bench.forward", []),
    "tools.bench_ggml_numba": ("tools.bench.ggml_numba", []),
    "tools.bench_tokenizer": ("tools.bench.tokenizer", []),
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
    "tools.bench_accel": ["-t", "--threads", "-n", "--n-predict"],
    "tools.bench": ["-m", "--model", "-n", "--n-predict"],
    "tools.bench_ggml_numba": ["-n", "--n-predict", "-ctk", "-ctv", "-fa"],
}


class Captured(BaseException):  # raised from parse_args with the parser: not an Exception a main() catches
    def __init__(self, parser):
        self.parser = parser


def parser_of(module):  # -> the top-level parser module.main builds
    def capture(self, args=None, namespace=None):
        raise Captured(self)
    original = cli.OneLineParser.parse_args
    cli.OneLineParser.parse_args = capture
    try:
        importlib.import_module(module).main([])
    except Captured as c:
        return c.parser
    finally:
        cli.OneLineParser.parse_args = original
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
