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


NPY = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 16), }")
TEMPLATE = gguf.load(MODEL, "text").tokenizer.chat_template
VALID = [("gguf", "m.gguf", ORIGINAL), ("run", "m.gguf", ORIGINAL), ("image", "i.png", PNG), ("image", "i.jpg", JPEG),
         ("npy", "l.npy", NPY), ("chat", "t.jinja", TEMPLATE.encode())]
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
    data = bytearray(PNG if fmt == "png" else JPEG)
    for offset, value in flips:
        data[offset % len(data)] = value
    check(worker, "image", tmp_path_factory.getbasetemp() / f"fuzz.{fmt}", bytes(data[:cut] if cut is not None else data))


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
