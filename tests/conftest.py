import os

# The tiny models' matrices are far too small for threaded BLAS: on 2 cores it only thrashes.
# Set before numpy is imported (conftest is imported before the test modules and the CLIs they start).
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import http.server
import importlib
import json
import subprocess
import sys
import threading
import time

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


class JsonServer(threading.Thread):
    """A local HTTP server answering each path with a JSON body, after `delay` seconds; `trickle`
    sends it a byte at a time without a Content-Length (a reply cut short then still parses as bytes)."""

    def __init__(self, replies, delay=0.0, trickle=None):
        super().__init__(daemon=True)
        replies_, delay_, trickle_ = replies, delay, trickle

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                body = replies_.get(self.path.split("?")[0])
                data = json.dumps(body).encode()
                time.sleep(delay_)
                self.send_response(200 if body is not None else 404)
                if trickle_:
                    self.end_headers()
                    for byte in data:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(trickle_)
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.answer()

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.answer()

            def log_message(self, *args):
                pass
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.start()

    def run(self):
        self.httpd.serve_forever()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
