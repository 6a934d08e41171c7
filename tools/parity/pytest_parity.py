"""A pytest plugin: parity gates of an engine against golden logits, for CI.

Enable it with `pytest -p tools.pytest_parity`, or in a conftest.py:
`pytest_plugins = ["tools.pytest_parity"]`. Then mark a test with the golden directory it checks
(a tools.golden output; paths are relative to pytest's rootdir) and use the `parity` fixture:

    @pytest.mark.parity(golden="golden/logits/llama-cpp/tiny-a-f32/kv-f32_fa-off",
                        gate="nmse=1e-4,top1=0.999")
    def test_my_engine(parity):
        for prompt in parity.prompts:                     # the golden manifest's entries
            parity.check(prompt["id"], my_engine_logits(prompt["token_ids"]))

`parity.check` diffs the logits against the golden exactly as `python -m tools.diff GOLDEN TEST
--gate ...` does (the golden is REF) and fails the test with the report when the gate fails or a
top-1 flip is a real divergence. Marker arguments: golden (required), gate (tools.diff keys; none:
only real divergences fail), near_tie_margin (a number or "typical"; default: the rounding of the
golden's logits), model and prompts (what --update-goldens runs when the directory has no manifest
yet). A terminal summary lists every check.

Options:
  --parity-gate nmse=...,top1=...   replaces the gate of every parity test
  --update-goldens ENGINE           before each parity test, rewrite its golden directory with
                                    `python -m tools.golden --engine ENGINE` on the same prompts (the
                                    manifest's token ids), model file and options (KV type, flash
                                    attention, greedy length): reference, llama-cpp, llama-server or
                                    transformers
  --parity-models DIR               where --update-goldens finds the GGUF or checkpoint a manifest
                                    names (default: golden/models under the rootdir)
  --parity-engine-args "ARGS"       more tools.golden arguments for --update-goldens, e.g.
                                    "--server-url http://127.0.0.1:8080"

A bare `@pytest.mark.parity` (no golden) only tags a test for `-m parity` selection.
"""
import json
import shlex
import tempfile
from pathlib import Path

import numpy as np
import pytest

from reference.cli import UsageError

from tools.parity import diff, golden

MARKER = ("parity(golden, gate=None, near_tie_margin=None, model=None, prompts=None): compare an engine's "
          "logits with a golden directory through the `parity` fixture (tools/parity/pytest_parity.py)")
RESULTS = pytest.StashKey[list]()
ENGINE_OPTIONS = {"llama-cpp": ("kv_type", "flash_attn"), "reference": ("dtype", "kv")}  # kept from the manifest


def pytest_addoption(parser):
    group = parser.getgroup("parity", "parity gates against golden logits (tools/parity/pytest_parity.py)")
    group.addoption("--parity-gate", help="gate for every parity test, e.g. nmse=1e-4,top1=0.999")
    group.addoption("--update-goldens", choices=sorted(golden.ENGINES), metavar="ENGINE",
                    help="rewrite each parity test's golden directory with this engine "
                         f"({', '.join(sorted(golden.ENGINES))})")
    group.addoption("--parity-models", help="directory of the models the golden manifests name")
    group.addoption("--parity-engine-args", default="", help="extra tools.golden arguments for --update-goldens")


def pytest_configure(config):
    config.addinivalue_line("markers", MARKER)
    config.stash[RESULTS] = []


class Parity:
    """One golden directory and its gate; `check` compares a prompt's logits with it."""

    def __init__(self, directory, gate, near_tie_margin, results):
        self.directory = Path(directory)
        try:
            self.files, self.manifest, _ = diff.read_manifest(str(self.directory))
            self.gate = diff.parse_gate(gate or "")
        except UsageError as e:
            raise pytest.UsageError(f"parity: {e}") from None
        self.prompts = self.manifest.get("entries", [])
        self.near_tie_margin = near_tie_margin if near_tie_margin != "typical" else diff.TYPICAL
        self.results = results

    def check(self, prompt_id, logits):  # logits [n_pos, n_vocab] of the engine under test -> report
        if str(prompt_id) not in self.files:
            pytest.fail(f"parity: {self.directory} has no golden for prompt {prompt_id!r}", pytrace=False)
        try:
            report = diff.diff_pair(diff.load_golden(self.files[str(prompt_id)]), np.asarray(logits),
                                    self.near_tie_margin)
        except UsageError as e:
            pytest.fail(f"parity: prompt {prompt_id!r}: {e}", pytrace=False)
        failures = diff.check_gate(report, self.gate)
        self.results.append((f"{self.directory.name}/{prompt_id}", report, failures))
        if failures:
            rule = f"M = {report['near_tie_margin']:.3g}"
            pytest.fail(f"parity gate failed for {self.directory}, prompt {prompt_id!r}:\n"
                        + diff.format_report([(str(prompt_id), report, failures)], self.gate, rule), pytrace=False)
        return report


def prompt_of(entry):  # manifest entry -> the tools.golden prompt that made it
    n = entry.get("n_prompt", len(entry["token_ids"]))
    prompt = {"id": entry["id"], "token_ids": entry["token_ids"][:n]}
    if n < len(entry["token_ids"]):
        prompt["continuation_ids"] = entry["token_ids"][n:]
    return prompt


def update_goldens(config, directory, model, prompts):  # rewrite one golden directory with --update-goldens
    engine = config.getoption("--update-goldens")
    root = Path(config.rootpath)
    models = Path(config.getoption("--parity-models") or root / "golden" / "models")
    manifest = {}
    if (directory / diff.MANIFEST).exists():
        manifest = json.loads((directory / diff.MANIFEST).read_text(encoding="utf-8"))
    name = model or manifest.get("model", {}).get("file") or manifest.get("model", {}).get("checkpoint")
    if not name:
        raise pytest.UsageError(f"parity: {directory} has no manifest naming a model; give model= in the marker")
    args = ["--engine", engine, "--out", str(directory)]
    args += ["--checkpoint" if engine == "transformers" else "--model", str(models / Path(name).name)]
    options = manifest.get("options", {})
    for key in ENGINE_OPTIONS.get(engine, ()):
        if key in options:
            args += [f"--{key.replace('_', '-')}", str(options[key])]
    greedy = [e["greedy"]["n_predict"] for e in manifest.get("entries", []) if "greedy" in e]
    if greedy:
        args += ["--n-predict", str(greedy[0])]
    args += shlex.split(config.getoption("--parity-engine-args"))
    with tempfile.TemporaryDirectory() as tmp:
        if prompts:
            prompt_file = root / prompts
        else:
            prompt_file = Path(tmp) / "prompts.jsonl"
            prompt_file.write_text("".join(json.dumps(prompt_of(e)) + "\n" for e in manifest.get("entries", [])),
                                   encoding="utf-8")
        status = golden.main(args + ["--prompts", str(prompt_file)])
    if status != 0:
        pytest.fail(f"parity: --update-goldens {engine} failed for {directory} (status {status})", pytrace=False)


@pytest.fixture
def parity(request):  # -> Parity for the golden directory named by the test's parity marker
    marker = request.node.get_closest_marker("parity")
    if marker is None or "golden" not in marker.kwargs:
        raise pytest.UsageError(f"{request.node.nodeid}: the parity fixture needs @pytest.mark.parity(golden=DIR)")
    config = request.config
    directory = Path(config.rootpath) / marker.kwargs["golden"]
    if config.getoption("--update-goldens"):
        update_goldens(config, directory, marker.kwargs.get("model"), marker.kwargs.get("prompts"))
    gate = config.getoption("--parity-gate") or marker.kwargs.get("gate")
    return Parity(directory, gate, marker.kwargs.get("near_tie_margin"), config.stash[RESULTS])


def pytest_terminal_summary(terminalreporter, config):
    results = config.stash.get(RESULTS, [])
    if not results:
        return
    terminalreporter.section("parity")
    terminalreporter.write_line(diff.NMSE_DEFINITION)
    for key, r, failures in results:
        s = r["summary"]
        terminalreporter.write_line(
            f"{key:<40.40} n_pos {r['n_pos']:>5} nmse {s['nmse']:.2e} max|d| {s['max_abs']:.2e} top1 {s['top1']:.4f} "
            f"near-ties {s['n_near_tie']} real {s['n_real']} {'FAIL' if failures else 'ok'}")
