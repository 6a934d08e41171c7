import os

# The tiny models' matrices are far too small for threaded BLAS: on 2 cores it only thrashes.
# Set before numpy is imported (conftest is imported before the test modules and the CLIs they start).
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import importlib
import json
import subprocess
import sys

import pytest

pytest_plugins = ["tools.parity.pytest_parity", "pytester"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "golden")
MODELS = os.path.join(GOLDEN, "models")


# .ci/run sets REFERENCE_CI: there the extras it installs and the machine's C++ compiler are part of
# what is tested, so a missing one fails the run instead of quietly skipping a whole test module.
IN_CI = bool(os.environ.get("REFERENCE_CI"))


def require(module):  # -> the imported module; a skip where it is not installed, a failure under .ci/run
    return importlib.import_module(module) if IN_CI else pytest.importorskip(module)


def model_manifest():  # -> list of manifest entries for the committed tiny models
    with open(os.path.join(MODELS, "manifest.json")) as f:
        data = json.load(f)
    return data["files"] if isinstance(data, dict) else data


def run_cli(module, *args, timeout=600):  # -> CompletedProcess of `python -m module args`
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def cli_error(r, *expected):  # CompletedProcess of a CLI -> its one stderr line: exit 2, no traceback, naming `expected`
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    # --numerics ggml-cpu warns first on a host unlike llama.cpp's build; those lines are not the error
    lines = [x for x in r.stderr.strip().splitlines() if ": warning: ggml-cpu models" not in x]
    assert len(lines) == 1, r.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def synthetic_gguf(tmp_path_factory):  # a small random text GGUF with the real keys and names
    from tools.synthetic import write_text_gguf
    path = str(tmp_path_factory.mktemp("syn") / "syn.gguf")
    write_text_gguf(path)
    return path
