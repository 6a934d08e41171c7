"""What the tools share: the pinned llama.cpp, the repository root, the error of a golden that cannot
be made, atomic artifact writes, optional packages, the llama-cpp-python switches, plots."""
from __future__ import annotations

import ctypes
import datetime
import importlib
import os
from pathlib import Path
from typing import Callable

from reference import artifacts
from reference.cli import UsageError, check_output

LLAMA_CPP_COMMIT = "0c1e570"  # vendored in llama-cpp-python 0.3.36
REPO = Path(__file__).resolve().parent.parent
EXTRAS = {"llama_cpp": "parity", "torch": "parity", "transformers": "parity", "tokenizers": "tokenizer"}  # setup.cfg
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type ids
_LLAMA_LOG_SINK = None  # the ctypes callback that drops llama.cpp's log: it must outlive every call


class GoldenError(Exception):
    """A prompt set, engine reply or option that cannot give a golden; the message is one line."""


def import_extra(module: str, user: str):  # -> the imported module; UsageError naming the extra that installs it
    """An optional package that is absent is one line and exit status 2, not an import traceback.
    Only the module's own absence counts: a package that is there but broken keeps its traceback."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UsageError(f"{user} needs the {module} package: pip install -e \".[{EXTRAS[module]}]\"") from None


sha256 = artifacts.cached_sha256  # path -> hex digest, hashed again only when the file's stat changes


def save_atomic(path: Path, write: Callable) -> str:  # write(binary file) -> None; -> the file's sha256
    """The file appears under its name complete or not at all (reference.artifacts.write_file): a
    killed run leaves at most a hidden temporary (swept by the next corpus run), never a truncated golden."""
    return artifacts.write_file(path, write, GoldenError)


def save_json(path: Path, data) -> str:  # -> the file's sha256
    return artifacts.write_json(path, data, GoldenError)


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def silence_llama_cpp(llama_cpp) -> None:
    """llama.cpp logs warnings and errors to stderr even with verbose=False; a golden run reports its
    own errors, each one line, so its log goes nowhere."""
    global _LLAMA_LOG_SINK
    if _LLAMA_LOG_SINK is None:
        _LLAMA_LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LLAMA_LOG_SINK, ctypes.c_void_p(0))


def plain_cpu_buffers(bindings):  # llama_cpp.llama_cpp -> None; every Llama made afterwards loads plain CPU buffers
    """use_extra_bufts = False (llama-cli's --no-repack): no CPU_REPACK or AMX weight buffers, every
    product through ggml's plain mul_mat. llama-cpp-python 0.3.36's Llama() has no argument for it,
    so the default model parameters it starts from are replaced."""
    defaults = bindings.llama_model_default_params
    if getattr(defaults, "plain_buffers", False):
        return

    def plain():
        params = defaults()
        params.use_extra_bufts = False
        return params
    plain.plain_buffers = True
    bindings.llama_model_default_params = plain


def pyplot(path):  # -> matplotlib.pyplot on the file-only Agg backend; UsageError when matplotlib is missing
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"{path}: --plot needs matplotlib (pip install matplotlib)") from None
    return plt


def check_plot(path):  # -> None; UsageError unless matplotlib can write `path` (checked before the work)
    check_output(path, "--plot")
    pyplot(path)
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension and extension not in formats:  # no extension: matplotlib writes PNG
        raise UsageError(f"--plot {path}: matplotlib cannot write .{extension} (formats: {', '.join(formats)})")


def write_text(path, option, text):  # -> None, the file whole or as it was; one that cannot be written is UsageError
    artifacts.write_text(path, text, UsageError)


def save_figure(plt, fig, path):  # -> None, the image whole or as it was; one that cannot be written is UsageError
    try:
        artifacts.save_figure(fig, path, UsageError)
    finally:
        plt.close(fig)
