"""Every `python -m` command the READMEs show must still parse: the module exists and its argument
parser accepts the command's flags. The command is not run (most need minutes or files outside the
repository): each module's own parser reads the argv and the test stops it right there, so a flag
renamed or removed in the code fails here instead of in a reader's shell."""
import argparse
import ast
import importlib
import itertools
import pathlib
import re
import runpy
import shlex
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
READMES = sorted([p.relative_to(REPO).as_posix() for p in REPO.glob("**/README.md")
                  if not {".git", "build", ".venv"} & set(p.relative_to(REPO).parts)]
                 + ["docs/benchmarks.md"])  # the README's measurements, each with its command
GUIDES = ("README.md", "docs/benchmarks.md")  # their examples run from the repository root
OWN_PACKAGES = ("reference", "tools", "accel")  # `python -m venv`, `python -m pytest` are not ours
METAVAR = re.compile(r"^[A-Z][A-Z0-9_]*$")
ALTERNATIVES = re.compile(r"^[\w.-]+(\|[\w.-]+)+$")  # reference|llama-cpp|transformers: one of them


def command_lines(text):  # README text -> shell lines shown as code (indented or fenced), continuations joined
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    return lines


def python_m_commands(line):  # shell line -> ["python -m MOD ARGS", ...] of our modules
    parts = [p.strip() for p in line.split("&&")]
    return [p for p in parts if p.startswith("python -m ") and p.split()[2].split(".")[0] in OWN_PACKAGES]


def bracket_variants(command):  # "a [--x 1 | --y] b" -> ["a --x 1 b", "a --y b"]: optional parts, each choice once
    groups = re.findall(r"\[([^\[\]]*)\]", command)
    template = re.sub(r"\[[^\[\]]*\]", "{}", command.replace("{", "{{").replace("}", "}}"))
    choices = [[alt.strip() for alt in g.split(" | ")] for g in groups]
    return [template.format(*pick) for pick in itertools.product(*choices)] if groups else [command]


def argvs(command):  # "python -m MOD ARGS" -> (MOD, [argv, ...]) with placeholders resolved
    module, variants = command.split()[2], []
    for text in bracket_variants(command):
        words = shlex.split(text, comments=True)[3:]
        options = [w.split("|") if ALTERNATIVES.match(w) else [w] for w in words]
        variants.extend(list(v) for v in itertools.product(*options))
    return module, variants


def readme_commands():  # -> [(readme, module, argv)]
    found = []
    for readme in READMES:
        for line in command_lines((REPO / readme).read_text(encoding="utf-8")):
            for command in python_m_commands(line):
                module, variants = argvs(command)
                found.extend((readme, module, argv) for argv in variants)
    return found


COMMANDS = readme_commands()


class Parsed(Exception):
    pass


def option(parser, flag):  # the action of --flag in the parser or one of its sub-commands, or None
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for p in [parser] + [sub for a in subparsers for sub in a.choices.values()]:
        if flag in p._option_string_actions:
            return p._option_string_actions[flag]
    return None


def placeholders(parser, argv):  # README argv -> argv the parser can take
    """`...` after an option that reads a value is that value, elsewhere it elides arguments; a
    METAVAR for an option with choices (`--step STEP`) stands for any of them: the first."""
    out = []
    for i, word in enumerate(argv):
        action = option(parser, argv[i - 1]) if i > 0 else None
        if word == "..." and (action is None or action.nargs == 0):
            continue
        out.append(action.choices[0] if METAVAR.match(word) and action and action.choices else word)
    return out


def parse_only(module, argv, monkeypatch):  # -> the Namespace module.main(argv) parses, without running it
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(original(self, placeholders(self, list(args)), namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        importlib.import_module(module).main(argv)
    except Parsed as done:
        return done.args[0]
    raise AssertionError(f"python -m {module}: main() returned without parsing its arguments")


def test_the_readmes_show_commands():
    # The extraction itself can regress (a changed indent rule finds nothing and every check passes):
    # the top README alone shows dozens.
    assert sum(r == "README.md" for r, _, _ in COMMANDS) >= 30, [c for c in COMMANDS if c[0] == "README.md"]
    assert {"reference.run", "tools.golden", "tools.diff", "tools.bisect", "tools.bench"} <= {m for _, m, _ in COMMANDS}


@pytest.mark.parametrize("readme, module, argv", COMMANDS, ids=[f"{r}:{m} {' '.join(a)}"[:120] for r, m, a in COMMANDS])
def test_readme_command_parses(readme, module, argv, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    try:
        parse_only(module, argv, monkeypatch)
    except SystemExit as e:
        pytest.fail(f"{readme}: python -m {module} {shlex.join(argv)}: exit {e.code}: {capsys.readouterr().err.strip()}")


def test_a_wrong_flag_is_caught(monkeypatch, capsys):
    # The check must be able to fail: a flag the parser lacks is refused.
    with pytest.raises(SystemExit):
        parse_only("reference.run", ["--no-such-flag"], monkeypatch)
    assert "--no-such-flag" in capsys.readouterr().err


def test_placeholders_are_resolved():
    assert argvs("python -m tools.golden --engine reference|llama-cpp ... --out DIR")[1] == [
        ["--engine", "reference", "...", "--out", "DIR"], ["--engine", "llama-cpp", "...", "--out", "DIR"]]
    parser = importlib.import_module("reference.run").build_parser()
    assert placeholders(parser, ["--token-ids", "...", "--json"]) == ["--token-ids", "...", "--json"]
    assert placeholders(parser, ["...", "--json", "..."]) == ["--json"]
    assert placeholders(parser, ["--kv", "KIND", "--model", "M"]) == ["--kv", "ring", "--model", "M"]
    assert argvs("python -m tools.golden --corpus [--task-size 4] [--ray | --ray-address auto]")[1] == [
        ["--corpus", "--task-size", "4", "--ray"], ["--corpus", "--task-size", "4", "--ray-address", "auto"]]
    assert argvs('python -m reference.run --prompt "<|eot|>"   # comment')[1] == [["--prompt", "<|eot|>"]]


LIBRARIES = {"__init__", "common", "synthetic"}  # tools/'s own modules; every other tools/<name>.py is a command alias
ALIASES = sorted(p.stem for p in (REPO / "tools").glob("*.py") if p.stem not in LIBRARIES)


def test_the_readmes_commands_are_aliases_or_packages():
    # Every `python -m tools.X` the READMEs show is a thin alias module or a package with a __main__,
    # so the tools can live in parity/, regen/ and bench/ without breaking a user's command.
    shown = {m.split(".")[1] for _, m, _ in COMMANDS if m.startswith("tools.")}
    packages = {p.parent.name for p in (REPO / "tools").glob("*/__main__.py")}
    assert shown - packages <= set(ALIASES), shown - packages - set(ALIASES)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: the alias was imported first
@pytest.mark.parametrize("name", ALIASES)
def test_alias_runs_its_tool(name, monkeypatch, capsys):
    # Run as `python -m tools.<name> --help` would: the alias hands argv to the tool it names, which
    # prints its usage and exits 0; corpus (not a command) says so with exit 2; the pytest plugin
    # alias names an importable plugin. Each alias stays a few lines of forwarding, no logic.
    source = (REPO / "tools" / f"{name}.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 8, f"tools/{name}.py is more than an alias"
    module = importlib.import_module(f"tools.{name}")
    if hasattr(module, "pytest_plugins"):
        assert all(importlib.import_module(p) for p in module.pytest_plugins)
        return
    monkeypatch.setattr("sys.argv", [f"tools/{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"tools.{name}", run_name="__main__")
    out = capsys.readouterr()
    if name == "corpus":
        assert done.value.code == 2 and "not a command" in out.err, out.err
    else:
        assert done.value.code == 0 and "usage:" in out.out, (done.value.code, out.err[-300:])


OUTPUT_DESTS = ("out", "trace", "logits_out", "embeddings_out", "json_out", "plot", "png", "table", "md_out")
BASE_DESTS = ("kl_divergence_base", "kl_divergence_base_f32")  # written unless --kl-divergence reads them


SHELL_LINE = re.compile(r"^(python|pip|head|llama-\S+|\(cd) ")  # code lines that are commands, not printed output


def shell_commands(text):  # README text -> its command lines, a quoted string open across lines joined
    commands = []
    for line in command_lines(text):
        if commands and commands[-1].count('"') % 2:
            commands[-1] += "\n" + line
        elif SHELL_LINE.match(line):
            commands.append(line)
    return commands


def written_paths(line, monkeypatch):  # README shell line -> the paths its commands and `> FILE` write
    words = shlex.split(line, comments=True)
    paths = [words[i + 1] for i, w in enumerate(words[:-1]) if w == ">"]
    for command in python_m_commands(line):
        module, variants = argvs(command)
        for argv in variants:
            args = vars(parse_only(module, argv, monkeypatch))
            dests = OUTPUT_DESTS + (() if args.get("kl_divergence") else BASE_DESTS)
            paths += [str(args[d]) for d in dests if isinstance(args.get(d), (str, pathlib.Path))]
    return paths


@pytest.mark.skipif(not shutil.which("git") or not (REPO / ".git").exists(), reason="not a git checkout")
def test_what_the_examples_write_is_ignored(monkeypatch):
    # An example run from the repository root leaves no untracked file for `git status` to show: every
    # output it names there is in .gitignore (build/ is ignored whole; DIR, OUT.json name no file).
    monkeypatch.chdir(REPO)
    written = {p for guide in GUIDES for line in shell_commands((REPO / guide).read_text(encoding="utf-8"))
               for p in written_paths(line, monkeypatch)}
    named = {p for p in written if not is_placeholder(p)}
    assert {"t32", "img.npy", "forced.jsonl", "30b.gguf"} <= {p.rstrip("/") for p in named}
    # a trailing / matches both file and directory patterns of .gitignore
    probe = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v", "-n"], cwd=REPO, text=True,
                           input="".join(p.rstrip("/") + "/\n" for p in sorted(named)), capture_output=True)
    not_ignored = [x.split("\t")[1] for x in probe.stdout.splitlines() if x.startswith("::")]
    assert not not_ignored, not_ignored


def test_python_c_examples_import_what_they_name():
    # `python -c "from tools.X import Y; ..."` is not a `python -m` command and was not checked: a
    # module moved (tools.make_synthetic's writers into tools.synthetic) broke the long-context
    # example. Each snippet must compile and its imports must resolve (the rest is not run).
    snippets = [shlex.split(c)[2] for guide in GUIDES for c in shell_commands((REPO / guide).read_text(encoding="utf-8"))
                if c.startswith("python -c ")]
    assert len(snippets) >= 3, snippets
    for code in snippets:
        imports = [n for n in ast.walk(ast.parse(code)) if isinstance(n, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), "README python -c", "exec"), {})


def is_placeholder(word):  # "M.gguf", "DIR", "OUT.json", "...": a word the reader replaces
    return word == "..." or bool(METAVAR.match(pathlib.PurePath(word).name.split(".")[0]))


def test_only_synopsis_lines_have_optional_parts():
    # `[--x 1]` is a synopsis's optional part: a line without a placeholder is an example to paste,
    # where a literal `[--logits-topk 64]` reaches the shell (the long-context example did).
    pasted = [line for readme in READMES for line in command_lines((REPO / readme).read_text(encoding="utf-8"))
              for command in python_m_commands(line) if re.search(r"\[-", command)
              and not any(is_placeholder(w) for w in shlex.split(re.sub(r"[\[\]|]", " ", command), comments=True))]
    assert not pasted, pasted
