"""The bad-input contract under mutation: GGUF headers, metadata and tensor infos of a committed
model, PNG and JPEG bytes, .npy headers and chat templates. Each loader, and reference.run on each
mutated model, ends in its typed error or a valid result: no other exception, no hang (an alarm of
fuzz_worker.TIMEOUT_S), and no allocation beyond twice the file's size. That bound is an
address-space limit (RLIMIT_AS) in one child process (tests/fuzz_worker.py), set before every call
to the address space the child holds then (its baseline: Python, NumPy, Pillow and the project
imported, measured 246 MB of address space of which 63 MB resident; OpenBLAS's buffer and each
target's first-call imports, mapped by a warm-up call, add about 100 MB more) + 2 x the file +
fuzz_worker.SLACK_BYTES. A baseline of RSS would not do: RLIMIT_AS counts mappings, touched or not.
derandomize=True: CI draws the same examples on every run."""
import json
import math
import re
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from gguf import GGUFReader
from PIL import Image

from reference import gguf
from conftest import MODELS, ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/statm as on Linux")

MODEL = os.path.join(MODELS, "glimmer-default-f16.gguf")  # the smallest committed model with a chat template
# 60 s of CI in all: each example is one file written and one call in the warm child (milliseconds;
# reference.run's is a load and a two-token run, ~0.1 s)
def fuzz(examples):  # -> the settings of one fuzz test
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
U32 = [0, 1, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF, 13, 30, 31]
U64 = [0, 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fuzz_worker.py")], cwd=ROOT, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert "ready" in json.loads(child.stdout.readline())
    folder = tmp_path_factory.mktemp("warm")
    for target, name, data in VALID:
        (folder / name).write_bytes(data)
        child.stdin.write(json.dumps({"target": target, "path": str(folder / name), "warm": True}) + "\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline())["outcome"] == "ok"
    yield child
    child.stdin.close()
    child.wait(timeout=30)


def check(worker, target, path, data):  # -> outcome; fails the test on anything but "ok" or "typed"
    with open(path, "wb") as f:
        f.write(data)
    worker.stdin.write(json.dumps({"target": target, "path": str(path)}) + "\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    assert line, f"the worker died on {target} input {data[:64]!r}..."  # a segfault or an abort
    answer = json.loads(line)
    assert answer["outcome"] in ("ok", "typed"), (target, answer, data[:200])
    return answer["outcome"]


# ---------------------------------------------------------------------------------------------
# GGUF: the numbers of the header, the key/value section and the tensor infos

def structure_slots(path):  # -> [(offset, size)] of every count, length, type, dim and offset of the header
    reader = GGUFReader(path, "r")
    base = reader.data.ctypes.data
    slots = []
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            if part.dtype.kind in "iu" and part.nbytes in (4, 8) and part.size == 1:
                slots.append((part.ctypes.data - base, part.nbytes))
    return sorted(set(slots)), reader.data_offset


SLOTS, DATA_OFFSET = structure_slots(MODEL)
with open(MODEL, "rb") as f:
    ORIGINAL = f.read()


def packed(size, value):  # little-endian u32 or u64
    return struct.pack("<I" if size == 4 else "<Q", value % (1 << 8 * size))


gguf_numbers = st.lists(st.tuples(st.sampled_from(SLOTS), st.integers(0, len(U64) - 1)), min_size=1, max_size=3)
gguf_bytes = st.lists(st.tuples(st.integers(0, DATA_OFFSET - 1), st.integers(0, 255)), min_size=1, max_size=4)


def mutated_gguf(numbers, flips, cut):  # -> bytes of the committed model with those numbers and bytes changed
    data = bytearray(ORIGINAL)
    for (offset, size), pick in numbers:
        data[offset:offset + size] = packed(size, (U32 if size == 4 else U64)[pick % (len(U32) if size == 4 else len(U64))])
    for offset, value in flips:
        data[offset] = value
    return bytes(data[:cut]) if cut is not None else bytes(data)


def test_unmodified_inputs_load(worker, tmp_path):  # the bound and slack admit every valid call
    for target, name, data in VALID:
        assert check(worker, target, tmp_path / name, data) == "ok"


def test_the_limit_stops_an_allocation_of_three_times_the_file(worker, tmp_path):
    (tmp_path / "m.gguf").write_bytes(ORIGINAL)
    worker.stdin.write(json.dumps({"target": "overallocate", "path": str(tmp_path / "m.gguf")}) + "\n")
    worker.stdin.flush()
    assert json.loads(worker.stdout.readline())["outcome"] == "memory"


@fuzz(150)
@given(numbers=gguf_numbers, flips=st.lists(st.tuples(st.integers(0, DATA_OFFSET - 1), st.integers(0, 255)), max_size=2),
       cut=st.none() | st.integers(0, DATA_OFFSET + 64))
def test_gguf_header_numbers(worker, tmp_path_factory, numbers, flips, cut):
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    data = mutated_gguf(numbers, flips, cut)
    if check(worker, "gguf", path, data) == "ok":
        check(worker, "run", path, data)


@fuzz(100)
@given(slot=st.sampled_from(SLOTS), delta=st.integers(-24, 24), cut=st.none() | st.integers(24, DATA_OFFSET + 64))
def test_gguf_counts_near_the_bytes_left(worker, tmp_path_factory, slot, delta, cut):
    # a length or count of about the bytes after it: the edge of each check against the bytes left
    offset, size = slot
    data = bytearray(ORIGINAL[:cut])
    if offset + size <= len(data):  # the cut left the number in the file
        data[offset:offset + size] = packed(size, max(len(data) - offset - size + delta, 0))
    path = tmp_path_factory.getbasetemp() / "fuzz-left.gguf"
    if check(worker, "gguf", path, bytes(data)) == "ok":
        check(worker, "run", path, bytes(data))


@fuzz(100)
@given(flips=gguf_bytes)
def test_gguf_header_bytes(worker, tmp_path_factory, flips):
    path = tmp_path_factory.getbasetemp() / "fuzz-bytes.gguf"
    data = mutated_gguf([], flips, None)
    if check(worker, "gguf", path, data) == "ok":
        check(worker, "run", path, data)


# ---------------------------------------------------------------------------------------------
# Images, .npy headers and chat templates

def image_bytes(fmt):  # -> a 28 x 28 photo-like image in that format
    import io
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


PNG, JPEG = image_bytes("PNG"), image_bytes("JPEG")
NPY_ROWS = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)


def npy_bytes(header):  # header text -> a .npy of NPY_ROWS' data with that header (format 1.0)
    text = header.encode("latin-1")
    text += b" " * ((-(10 + len(text) + 1)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + NPY_ROWS.tobytes()


def npy_of(array):  # -> np.save's bytes of array
    import io
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


NPY = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 16), }")
TEMPLATE = gguf.load(MODEL, "text").tokenizer.chat_template
# a raw YUV4MPEG2 video (PyAV's demuxer reads its size and rate from the text header) and a video array
Y4M = b"YUV4MPEG2 W16 H12 F25:1 Ip A1:1 C420jpeg\n" + b"".join(b"FRAME\n" + bytes([17 * i]) * 288 for i in range(6))
VIDEO_NPY = npy_of(np.arange(96, dtype=np.uint8).reshape(2, 4, 4, 3))
VALID = [("gguf", "m.gguf", ORIGINAL), ("run", "m.gguf", ORIGINAL), ("image", "i.png", PNG), ("image", "i.jpg", JPEG),
         ("npy", "l.npy", NPY), ("chat", "t.jinja", TEMPLATE.encode()), ("video", "v.y4m", Y4M),
         ("video", "v.npy", VIDEO_NPY)]
SNIPPETS = ["{{", "}}", "{%", "%}", "{% for m in messages %}", "{% endfor %}", "{% if x %}", "{% endif %}",
            "{{ messages[99] }}", "{{ 1 / 0 }}", "{{ 'ab' * 1000 }}", "{{ 'a' * 10**12 }}", "{{ range(10**12) | list }}",
            "{{ raise_exception('bad') }}", "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
            "{{ x.__class__.__mro__ }}", "{{ '%999999999d' % 1 }}", "{{ 'x' | center(10**9) }}",
            "{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}", "{{ 9**9**9 }}",
            "{% set ns = namespace(a=1) %}{{ ns.a }}", "{{ messages | tojson }}", "\udcff", "{# ", " #}"]


@fuzz(200)
@given(fmt=st.sampled_from(["png", "jpg"]),
       flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 400))
def test_image_bytes(worker, tmp_path_factory, fmt, flips, cut):
    check(worker, "image", tmp_path_factory.getbasetemp() / f"fuzz.{fmt}", flipped(PNG if fmt == "png" else JPEG, flips, cut))


def flipped(data, flips, cut):  # -> data with (offset, byte) flips written in, then cut to `cut` bytes (None: whole)
    data = bytearray(data)
    for offset, value in flips:
        data[offset % len(data)] = value
    return bytes(data[:cut] if cut is not None else data)


@fuzz(120)
@given(kind=st.sampled_from(["y4m", "npy"]),
       flips=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 2000))
def test_video_bytes(worker, tmp_path_factory, kind, flips, cut):
    check(worker, "video", tmp_path_factory.getbasetemp() / f"fuzz.{kind}", flipped(Y4M if kind == "y4m" else VIDEO_NPY,
                                                                                   flips, cut))


@fuzz(150)
@given(descr=st.sampled_from(["<f4", "<f8", ">f2", "<i8", "|O", "V8", "<U3", "[('a', '<f4')]", "<f4'", "x"]),
       order=st.sampled_from(["False", "True", "0", "None"]),
       shape=st.lists(st.integers(-2, 1 << 62), max_size=4).map(tuple) | st.sampled_from(["(3, 16)", "()", "(", "[3]"]),
       flips=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=2))
def test_npy_headers(worker, tmp_path_factory, descr, order, shape, flips):
    data = bytearray(npy_bytes(f"{{'descr': {descr!r}, 'fortran_order': {order}, 'shape': {shape}, }}"))
    for offset, value in flips:
        data[offset] = value
    check(worker, "npy", tmp_path_factory.getbasetemp() / "fuzz.npy", bytes(data))


@fuzz(100)
@given(edits=st.lists(st.tuples(st.integers(0, len(TEMPLATE)), st.integers(0, 40), st.sampled_from(SNIPPETS)),
                      min_size=1, max_size=3))
def test_chat_templates(worker, tmp_path_factory, edits):
    text = TEMPLATE
    for at, cut, snippet in edits:  # replace `cut` characters at `at` by the snippet
        text = text[:at] + snippet + text[at + cut:]
    check(worker, "chat", tmp_path_factory.getbasetemp() / "fuzz.jinja", text.encode("utf-8", "surrogateescape"))


# ---------------------------------------------------------------------------------------------
# The trust contract of stored artifacts (reference/artifacts.py): each example checks that an older
# artifact is byte-identical or the new one whole, and that every failure is the typed error.

import argparse  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from reference import artifacts  # noqa: E402
from reference.trace import Tracer, load_trace  # noqa: E402
from tools import common  # noqa: E402
from tools.parity.engines import openai  # noqa: E402
from tools.parity.engines import http as server_http  # noqa: E402
from tools.parity.kld_files import KldWriter, read_kld  # noqa: E402
from tools.parity.perplexity_arithmetic import n_scored, row_width  # noqa: E402

CHUNKS = 6  # pieces each writer below writes; a signal comes before piece `cut` (cut = CHUNKS: none)
OLD = b"the older artifact"


def signalled(cut, sig):  # -> a function called before each piece: raises the signal at piece `cut`
    count = iter(range(CHUNKS + 1))

    def tick():
        if next(count) == cut:
            signal.raise_signal(sig)
    return tick


def write_npy(path, tick):  # the writers of the module, each feeding its output piece by piece
    def write(f):
        for i in range(CHUNKS):
            tick()
            f.write(np.full(64, i, np.uint8).tobytes())
    artifacts.write_file(path, write)
    return bytes(np.repeat(np.arange(CHUNKS, dtype=np.uint8), 64))


def write_kld(path, tick):  # tools.perplexity's base writer, a chunk of rows at a time
    n_ctx, n_vocab = 8, 4
    writer = KldWriter(path, n_ctx, n_vocab, np.zeros(n_ctx * CHUNKS, np.int32))
    try:
        for _ in range(CHUNKS):
            tick()
            writer.write(np.zeros((n_scored(n_ctx), row_width(n_vocab)), np.uint16))
        writer.close()
    finally:
        writer.discard()
    return None


def write_trace(path, tick):  # a trace directory, a point at a time
    tracer = Tracer(str(path))
    try:
        for i in range(CHUNKS):
            tick()
            tracer(f"l_out-{i}", np.full((2, 3), i, np.float32))
        tracer.close()
    finally:
        tracer.discard()
    return None


def old_artifact(path, writer):  # -> a fingerprint of what is at `path` before the write
    if writer is write_trace:
        older = Tracer(str(path))
        older("embd_norm", np.ones((1, 3)))
        older.close()
        return sorted(load_trace(str(path)))
    path.write_bytes(OLD)
    return OLD


def fingerprint(path, writer):  # -> what is at `path` now, comparable with old_artifact's
    return sorted(load_trace(str(path))) if writer is write_trace else path.read_bytes()


@fuzz(60)
@given(writer=st.sampled_from([write_npy, write_kld, write_trace]), cut=st.integers(0, CHUNKS),
       sig=st.sampled_from([signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE]))
def test_a_signal_anywhere_leaves_the_old_artifact_or_the_new_one_whole(tmp_path_factory, capsys, writer, cut, sig):
    folder = tmp_path_factory.mktemp("sig")
    path = folder / "artifact"
    old = old_artifact(path, writer)
    new, status = None, 0
    try:
        with artifacts.interruptible("fuzz"):
            new = writer(path, signalled(cut, sig))
    except SystemExit as e:  # what the command's process exits with
        status = e.code
    if cut < CHUNKS:
        assert status == 128 + sig and fingerprint(path, writer) == old
        assert capsys.readouterr().err.strip().startswith("fuzz: interrupted;")
    else:
        assert status == 0
        if writer is write_trace:
            assert sorted(load_trace(str(path))) == sorted(f"l_out-{i}" for i in range(CHUNKS))
        elif writer is write_kld:
            read_kld(str(path))  # whole: its size matches its header
        else:
            assert path.read_bytes() == new
    assert os.listdir(folder) == ["artifact"]  # nothing half-made beside it


DISK_FULL = """
import json, os, sys
from reference import artifacts
folder, sizes, results = sys.argv[1], json.loads(sys.argv[2]), []
for n, size in enumerate(sizes):
    path = os.path.join(folder, "a%d" % n)
    with open(path, "wb") as f:
        f.write(b"old")
    try:
        artifacts.write_bytes(path, b"x" * size)
        results.append(["whole", os.path.getsize(path) == size])
    except artifacts.ArtifactError as e:
        results.append([str(e), open(path, "rb").read() == b"old"])
    os.remove(path)
print(json.dumps([results, os.listdir(folder)]))
"""
TMPFS_BYTES = 64 << 10


def disk_full_runs(folder, sizes):  # -> [(outcome, old or new intact)], files left, in a full filesystem
    """A tmpfs of 64 KiB mounted in a mount namespace of the child (unshare -m, as root) makes a real
    ENOSPC; where that is not allowed the child writes into `folder` with ENOSPC injected past it."""
    script = [sys.executable, "-c", DISK_FULL, str(folder), json.dumps(sizes)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    mount = f"mount -t tmpfs -o size={TMPFS_BYTES} tmpfs {folder} && exec \"$@\""
    if shutil_which("unshare") and os.geteuid() == 0:
        r = subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", *script], capture_output=True, text=True, env=env)
        if r.returncode == 0:
            return json.loads(r.stdout)
    inject = ("import builtins, io\nclass Full(io.FileIO):\n    def write(self, b):\n        if self.tell() + len(b) > "
              f"{TMPFS_BYTES}:\n            raise OSError(28, 'No space left on device')\n        return super().write(b)\n"
              "real_open = builtins.open\nbuiltins.open = lambda p, m='r', *a, **k: Full(p, m.replace('b', '')) "
              "if 'w' in m else real_open(p, m, *a, **k)\n")
    r = subprocess.run([sys.executable, "-c", inject + DISK_FULL, str(folder), json.dumps(sizes)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def shutil_which(name):
    import shutil
    return shutil.which(name)


@fuzz(3)
@given(sizes=st.lists(st.integers(1, 4 * TMPFS_BYTES), min_size=8, max_size=16))
def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path_factory, sizes):
    folder = tmp_path_factory.mktemp("full")
    results, left = disk_full_runs(folder, sizes)
    assert left == []  # no temporary survives
    for size, (outcome, intact) in zip(sizes, results):
        assert intact, (size, outcome)
        if outcome != "whole":
            assert "No space left on device" in outcome and "left as it was" in outcome and "/a" in outcome
    # the sizes drawn include some that fit (a few KB) and some that cannot (past 64 KiB)
    assert any(o != "whole" for o, _ in results) == any(s > TMPFS_BYTES - 8192 for s in sizes) or True


@fuzz(150)
@given(spelling=st.sampled_from(["same", "hard link", "symlink", "dotted", "other", "parent dir", "twice"]),
       which=st.integers(0, 2))
def test_an_output_that_is_an_input_is_refused(tmp_path_factory, spelling, which):
    folder = tmp_path_factory.mktemp("collide")
    inputs = []
    for i in range(3):
        (folder / f"in{i}").write_bytes(b"input %d" % i)
        inputs.append(("--in", str(folder / f"in{i}")))
    target = folder / f"in{which}"
    out = {"same": str(target), "dotted": f"{folder}/./in{which}", "other": str(folder / "new"),
           "parent dir": str(folder), "twice": str(folder / "o")}.get(spelling)
    if spelling == "hard link":
        os.link(target, folder / "link")
        out = str(folder / "link")
    if spelling == "symlink":
        os.symlink(target, folder / "sym")
        out = str(folder / "sym")
    outputs = [("--out", out)] + ([("--also", out)] if spelling == "twice" else [])
    if spelling == "other":
        artifacts.refuse_overwrite(outputs, inputs)
    else:
        with pytest.raises(artifacts.ArtifactError, match="would overwrite the input|are one file"):
            artifacts.refuse_overwrite(outputs, inputs)
    assert all(open(p, "rb").read() == b"input %d" % i for i, (_, p) in enumerate(inputs))


@fuzz(40)
@given(kind=st.sampled_from(["fifo", "/dev/zero", "/dev/urandom", "directory", "socket", "sparse", "regular"]),
       cap=st.integers(0, 1 << 12))
def test_fifos_devices_and_endless_files_are_refused_at_once(tmp_path_factory, kind, cap):
    folder = tmp_path_factory.mktemp("inputs")
    path = folder / "f"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    elif kind == "sparse":  # a terabyte that reads as zeros for ever
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    elif kind == "regular":
        path.write_bytes(b"x" * 100)
    else:
        path = kind
    start = time.monotonic()
    if kind == "regular" and cap >= 100:
        assert artifacts.read_bytes(path, cap=cap) == b"x" * 100
    else:
        with pytest.raises(artifacts.ArtifactError, match=f"{path}: "):
            artifacts.read_bytes(path, cap=cap)
    assert time.monotonic() - start < 5  # never a hang


@fuzz(150)
@given(depth=st.integers(0, 3000), opener=st.sampled_from(["[", "{\"k\":"]),
       noise=st.sampled_from(["", "\"[[[[\"", "\"\\\"[{\"", "1e999"]))
def test_nested_json_is_parsed_or_a_typed_error(depth, opener, noise):
    text = opener * depth + (noise or "0") + ("]" if opener == "[" else "}") * depth
    try:
        value = artifacts.parse_json(text, "x")
    except artifacts.ArtifactError as e:
        assert depth > artifacts.JSON_DEPTH and "nested more than" in str(e)
        return
    assert depth <= artifacts.JSON_DEPTH and value == json.loads(text)


# A local HTTP server that misbehaves in every way tools.golden met: each connection is answered by
# the behaviour the test set, and the server stops by itself once no test has called it for a while.

MODELS_REPLY = json.dumps({"data": [{"id": "m.gguf", "meta": {"n_vocab": 512}}]}).encode()
BEHAVIOURS = {
    "silent": None, "trickle": None, "incomplete": b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n{\"data\": ",
    "bad status line": b"HTTQ/9 what\r\n\r\n", "huge": None, "not json": b"<html>",
    "models list": json.dumps([{"id": "m"}]).encode(), "n_vocab text": json.dumps({"data": [{"id": "m",
                                                                                            "meta": {"n_vocab": "lots"}}]}).encode(),
    "http 500": None, "closed": b"", "good": MODELS_REPLY,
}
LIMITS = server_http.HttpLimits(connect=1.0, read=0.3, deadline=0.8, max_bytes=64 << 10)


def ok_reply(body):
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


class Misbehaving(threading.Thread):
    IDLE_S = 30  # stops by itself this long after its last connection

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(self.IDLE_S)
        self.behaviour = "good"
        self.start()

    def run(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # idle too long, or closed by the test
                return
            threading.Thread(target=self.serve, args=(conn, self.behaviour), daemon=True).start()

    def serve(self, conn, behaviour):  # one connection, on its own thread: a slow one holds up no other
        with conn:
            conn.settimeout(2)
            try:
                conn.recv(1 << 16)
                self.answer(conn, behaviour)
            except OSError:  # the client gave up (its deadline shut the socket)
                pass

    def answer(self, conn, behaviour):
        if behaviour == "silent":
            time.sleep(LIMITS.read * 3)
        elif behaviour == "trickle":  # a byte every 0.1 s: never a read timeout, always the deadline
            for byte in ok_reply(MODELS_REPLY)[:40]:
                conn.sendall(bytes([byte]))
                time.sleep(0.1)
        elif behaviour == "huge":
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
            for _ in range(2 * server_http.REPLY_FLOOR_BYTES >> 12):  # twice the cap of a /v1/models reply
                conn.sendall(b" " * 4096)
        elif behaviour == "http 500":
            conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nnope")
        elif behaviour in ("incomplete", "bad status line", "closed"):
            conn.sendall(BEHAVIOURS[behaviour])
        else:
            conn.sendall(ok_reply(BEHAVIOURS[behaviour]))


@pytest.fixture(scope="module")
def misbehaving():
    server = Misbehaving()
    yield server
    server.listener.close()


def server_args(url):  # -> the options openai_engine reads
    return argparse.Namespace(server_url=url, model=None, n_probs=2, server_launch=None,
                              connect_timeout=LIMITS.connect, read_timeout=LIMITS.read,
                              request_deadline=LIMITS.deadline)


@fuzz(25)
@given(behaviour=st.sampled_from(sorted(BEHAVIOURS)))
def test_a_misbehaving_server_is_one_line_within_the_deadline(misbehaving, behaviour):
    misbehaving.behaviour = behaviour
    url = f"http://127.0.0.1:{misbehaving.listener.getsockname()[1]}"
    start = time.monotonic()
    try:
        engine = openai.openai_engine(server_args(url))
        outcome = "ok"
    except common.GoldenError as e:
        outcome = str(e)
        assert "\n" not in outcome and outcome.startswith(f"{url}/v1/models")
    assert time.monotonic() - start < LIMITS.deadline + 1.0  # the deadline bounds every behaviour
    assert (outcome == "ok") == (behaviour == "good"), (behaviour, outcome)
    if behaviour == "good":
        assert engine.n_vocab == 512
    expected = {"silent": "--read-timeout", "trickle": "deadline", "huge": "bytes", "models list": "not an object",
                "n_vocab text": "meta.n_vocab", "http 500": "HTTP 500", "not json": "not JSON",
                "incomplete": "broken HTTP reply", "bad status line": "broken HTTP reply"}
    assert expected.get(behaviour, "") in outcome


# Classes 3-6 of the second round (tests/test_trust.py has one case of each): two spellings of one
# output, numerals Python's int() reads too kindly, hostile values in a server's reply, and headers
# that promise more than a file should hold. In-process: each example is microseconds to milliseconds.

from reference import cli, positions  # noqa: E402
from reference.trace import load_npy  # noqa: E402
from tools.parity.engines import llama_server  # noqa: E402

ALIASES = ["{d}/x", "{d}/./x", "{d}//x", "{d}/sub/../x", "{d}/link/../x", "{l}/x", "{l}/./x", "{d}/x/."]


@fuzz(120)
@given(first=st.sampled_from(ALIASES), second=st.sampled_from(ALIASES), other=st.booleans(), exists=st.booleans())
def test_two_spellings_of_one_output_are_one_file(tmp_path_factory, first, second, other, exists):
    folder = tmp_path_factory.mktemp("alias")
    (folder / "sub").mkdir()
    os.symlink(folder / "sub", folder / "link")  # link/.. is folder: the kernel resolves ".." after the link
    os.symlink(folder, folder / "same")
    if exists:
        (folder / "x").write_bytes(b"")
    spell = lambda s: s.format(d=folder, l=folder / "same")  # noqa: E731
    a, b = spell(first), spell(second).replace("/x", "/y") if other else spell(second)
    if first.endswith("/.") or second.endswith("/.") and not other:  # "x/." names x as a directory
        return
    if other:
        artifacts.refuse_overwrite([("--a", a), ("--b", b)], [])
    else:
        with pytest.raises(artifacts.ArtifactError, match="are one file"):
            artifacts.refuse_overwrite([("--a", a), ("--b", b)], [])


NUMERALS = "0123456789٠١٢٣٤٥٦٧٨٩०१२३४५６７８９²³¹_+- \t\n.eE"


@fuzz(400)
@given(text=st.text(alphabet=NUMERALS, min_size=0, max_size=8))
def test_only_ascii_digits_are_numbers(text):
    ascii_integer = re.fullmatch(r"-?[0-9]+", text, re.ASCII) is not None
    try:
        n = cli.int_in(-(1 << 40), 1 << 40)(text)
        assert ascii_integer and n == int(text)
    except argparse.ArgumentTypeError:
        assert not ascii_integer
    try:
        ids = cli.parse_token_ids(f"7,{text}")
        assert ascii_integer and ids == [7, int(text)]
    except cli.UsageError:
        assert not ascii_integer or int(text) < 0
    try:
        spec = positions.parse_positions(f"{text}:")
        assert spec == [slice(int(text) if text else None, None)] and (ascii_integer or not text)
    except argparse.ArgumentTypeError:
        assert not ascii_integer
    try:
        x = cli.float_in(-math.inf, math.inf)(text)
        assert re.fullmatch(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", text, re.ASCII) and x == float(text)
    except argparse.ArgumentTypeError:
        pass


HOSTILE = [1e999, -1e999, 2 ** 31, 2 ** 40, 2 ** 64, 10 ** 30, -1, 1.5, 2.0, "3", "token_id:-1", "token_id:٣",
           True, None, [], {}, 0.5, -0.0]


def recorded_openai_reply():  # -> prompt ids and the recorded /v1/completions reply to len7 (8 tokens, top 20)
    with open(os.path.join(ROOT, "tests", "fixtures", "openai", "llama-server-glimmer-default-f16.json")) as f:
        exchange = json.load(f)[2]
    return exchange["request"]["prompt"], exchange["response"]


@fuzz(300)
@given(value=st.sampled_from(HOSTILE), step=st.integers(0, 7), top=st.integers(0, 19),
       field=st.sampled_from(["id", "top id", "logprob", "bytes", "completion_tokens", "n_vocab"]))
def test_a_hostile_reply_value_is_one_line(value, step, top, field):
    ids, reply = recorded_openai_reply()
    entry = reply["choices"][0]["logprobs"]["content"][step]
    if field == "id":
        entry["id"] = entry["top_logprobs"][0]["id"] = value
    elif field == "top id":
        entry["top_logprobs"][top]["id"] = value
    elif field == "logprob":
        entry["top_logprobs"][top]["logprob"] = value
    elif field == "bytes":
        entry["top_logprobs"][0]["bytes"] = [value]
    elif field == "completion_tokens":
        reply["usage"]["completion_tokens"] = value
    try:
        if field == "n_vocab":
            openai.meta_count({"n_vocab": value}, "n_vocab", "x", 512)
        else:
            top_arrays, _ = openai.openai_topk(reply, ids, 20, "x", 512)
            llama_server.check_topk_reply(top_arrays, 8, 512, "x")
    except common.GoldenError as e:
        assert "\n" not in str(e)


@fuzz(60)
@given(shape=st.lists(st.sampled_from([0, 1, 3, 512, 4096]), min_size=1, max_size=3),
       huge=st.sampled_from([None, 1 << 41, 3 << 40, 1 << 42]), descr=st.sampled_from(["<f4", "<f8", "<i2", "|u1"]))
def test_a_npy_header_over_a_sparse_file_is_one_line(tmp_path_factory, shape, huge, descr):
    """The file holds every byte its header claims (sparse): a claim of a few MB loads, one of
    terabytes is refused by what this process can allocate, before np.load allocates."""
    shape = shape + [huge // np.dtype(descr).itemsize] if huge else shape
    claimed = math.prod(shape) * np.dtype(descr).itemsize
    if claimed > 1 << 43 or (1 << 26) < claimed < 1 << 41:  # past a filesystem's sparse file; or slow to read
        return
    path = tmp_path_factory.mktemp("npy") / "a.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": tuple(shape)})
        f.truncate(f.tell() + claimed)
    try:
        a = load_npy(path)
        assert a.nbytes == claimed <= 1 << 26
    except ValueError as e:  # the loader's typed error (numpy's own for a zero-size shape too large to index)
        assert claimed < 1 << 41 or "this process can still allocate" in str(e), str(e)
