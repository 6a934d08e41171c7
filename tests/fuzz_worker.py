"""The child process of tests/test_fuzz.py: reads one JSON request a line ({"target", "path"}),
runs that loader on the file under an address-space limit and an alarm (a request with "warm"
runs it once unlimited on a valid file first, so that first-call imports are not counted), and answers one JSON line
{"outcome": "ok" | "typed" | "crash" | "hang" | "memory", "error": text}.

The limit is set before each call to the address space the process holds right then (Python,
NumPy, Pillow and the project's modules, already imported, and what earlier calls left mapped)
plus twice the file's size plus SLACK_BYTES, so what a call may add is twice its file (see SLACK_BYTES)."""
import contextlib
import io
import json
import os
import resource
import signal
import sys

import numpy as np

from reference import gguf, run
from reference.chat import MAX_CHARS, ChatError, render_chat
from reference.image import ImageError, load_rgb
from reference.video import VideoError, load as load_video, sample_indices
from reference.cli import UsageError
from tools.parity.diff import load_logits

# Address space a valid call of every target adds beyond twice its file, as measured on the
# unmodified inputs (tests/test_fuzz.py checks they stay "ok"): glibc's heap grows in 128 KiB
# steps and Python's allocator in 1 MiB arenas; reference.run's forward adds its activations.
SLACK_BYTES = 24 << 20
# A chat template may legitimately build a value of up to MAX_CHARS characters (the sandbox's own
# cap, then refused): as UCS-4 text, with the printed copy and one more, 3 x 4 bytes a character.
CHAT_ALLOWANCE = 3 * 4 * MAX_CHARS
TIMEOUT_S = 20  # a call on these kilobyte files takes milliseconds; one that runs longer hangs
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


class Hang(Exception):
    pass


def address_space():  # -> bytes of this process's virtual memory now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_cli(path):  # -> reference.run's exit status on the model `path`, its output discarded
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = run.main(["--model", path, "--prompt", "hi there", "--n-predict", "2"])
    if status not in (0, 2):
        raise RuntimeError(f"exit status {status}")


def chat(path):  # a template file rendered over a short conversation
    with open(path, "rb") as f:
        render_chat(f.read().decode("utf-8", "replace"), MESSAGES, bos_token="<s>", eos_token="</s>", date="2026-01-02")


TARGETS = {  # name -> (call on the path, the typed errors of its contract, bytes allowed beyond 2 x file + slack)
    "gguf": (lambda p: gguf.load(p, "text"), (gguf.GGUFError,), 0),
    "run": (run_cli, (), 0),  # run.main turns its typed errors into exit status 2 itself
    "image": (load_rgb, (ImageError,), 0),
    # a video file or array, its frames kept as the tiny mmproj's defaults keep them (PyAV decodes files)
    "video": (lambda p: load_video(p, None, lambda total, rate: sample_indices(total, rate, 2.0, 8)), (VideoError,), 0),
    "npy": (load_logits, (UsageError,), 0),
    "chat": (chat, (ChatError,), CHAT_ALLOWANCE),
    # the limit's own check: what a loader trusting a header that claims 3 x its file would allocate
    "overallocate": (lambda p: np.ones(3 * os.path.getsize(p) + SLACK_BYTES, np.uint8), (), 0),
}


def on_alarm(signum, frame):
    raise Hang()


def limited(call, path, allowance):  # -> None; call(path) with the address space and the time bounded
    limit = address_space() + 2 * os.path.getsize(path) + SLACK_BYTES + allowance
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    signal.alarm(TIMEOUT_S)
    try:
        call(path)
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def answer(request):  # -> {"outcome", "error"}
    call, typed, allowance = TARGETS[request["target"]]
    if request.get("warm"):  # a valid input's first call, unlimited: its lazy imports join the baseline
        call(request["path"])
        return {"outcome": "ok", "error": ""}
    try:
        limited(call, request["path"], allowance)
    except typed as e:
        return {"outcome": "typed", "error": str(e)}
    except Hang:
        return {"outcome": "hang", "error": f"over {TIMEOUT_S} s"}
    except MemoryError as e:
        return {"outcome": "memory", "error": f"MemoryError {e}"}
    except Exception as e:  # the contract's breach: what the test reports
        return {"outcome": "crash", "error": f"{type(e).__name__}: {e}"}
    return {"outcome": "ok", "error": ""}


def main():
    signal.signal(signal.SIGALRM, on_alarm)
    # OpenBLAS maps its work buffer at the first product and aborts the process, not raising,
    # when that fails: mapped here, before any limit, it is part of every call's baseline
    np.ones((512, 512), np.float32) @ np.ones((512, 512), np.float32)
    print(json.dumps({"ready": address_space()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
