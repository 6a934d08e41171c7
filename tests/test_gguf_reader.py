"""reference.gguf's GGUF reader (GGUFFile) against gguf-py's GGUFReader, an independent parser of the
same bytes: every key's type and value and every tensor's name, type, shape, offset, size and data
in every committed GGUF; and each bad header, metadata entry or tensor info refused by GGUFError
in one line naming the file."""
import os
import struct
import subprocess

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from reference import gguf
from conftest import ROOT, cli_error, run_cli

COMMITTED = subprocess.run(["git", "ls-files", "*.gguf"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
GGUF_PY_TYPES = frozenset(int(t) for t in GGML_QUANT_SIZES)
V = GGUFValueType


class GgufPy(GGUFReader):
    """gguf-py's parse, keeping its tensor-info fields: it builds no tensor of a type it lacks (the
    pinned ggml's Q2_0 = 42), so those are compared from their fields alone."""

    def _build_tensors(self, start_offs, fields):
        self.info_fields = fields
        super()._build_tensors(start_offs, [f for f in fields if int(f.parts[4][0]) in GGUF_PY_TYPES])


def padded(n, alignment):
    return -(-int(n) // int(alignment)) * int(alignment)


def assert_same_as_gguf_py(path):
    theirs, ours = GgufPy(path), gguf.open_reader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # gguf-py's own header entries
    assert keys == list(ours.fields)
    for key in keys:
        f, g = theirs.fields[key], ours.fields[key]
        assert (g.types, g.value) == (f.types, f.contents()), key
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    built = {t.name: t for t in theirs.tensors}
    assert [t.name for t in ours.tensors] == [str(bytes(f.parts[1]), "utf-8") for f in theirs.info_fields]
    for f, t in zip(theirs.info_fields, ours.tensors):
        assert t.shape == tuple(f.parts[3].tolist()) and int(t.tensor_type) == int(f.parts[4][0]), t.name
        assert t.data_offset == theirs.data_offset + int(f.parts[5][0]), t.name
        assert t.type_offset == f.offset + sum(p.nbytes for p in f.parts[:4]), t.name
        assert t.data.tobytes() == theirs.data[t.data_offset:t.data_offset + t.n_bytes].tobytes(), t.name
        r = built.get(t.name)
        if r is not None:
            assert (t.tensor_type, t.n_elements, t.n_bytes) == (r.tensor_type, r.n_elements, r.n_bytes), t.name
            assert (t.data.shape, t.data.dtype) == (r.data.shape, r.data.dtype) and np.array_equal(
                t.data.view(np.uint8), r.data.view(np.uint8)), t.name
    # n_bytes of every tensor, those gguf-py cannot size included: the writer put each tensor at the
    # padded end of the one before, and padded the last to the end of the file
    ends = [t.data_offset - theirs.data_offset for t in ours.tensors[1:]] + [len(theirs.data) - theirs.data_offset]
    for t, end in zip(ours.tensors, ends):
        assert padded(t.data_offset - theirs.data_offset + t.n_bytes, ours.alignment) == end, t.name
    return ours


@pytest.mark.parametrize("path", COMMITTED)
def test_every_committed_gguf_reads_as_gguf_py_reads_it(path):
    assert_same_as_gguf_py(os.path.join(ROOT, path))


def test_committed_ggufs_cover_the_types():  # the comparison above met each kind of value and tensor
    kinds, types = set(), set()
    for path in COMMITTED:
        r = gguf.open_reader(os.path.join(ROOT, path))
        kinds |= {tuple(f.types) for f in r.fields.values()}
        types |= {t.tensor_type.name for t in r.tensors}
    assert {(V.STRING,), (V.UINT32,), (V.FLOAT32,), (V.BOOL,), (V.ARRAY, V.STRING), (V.ARRAY, V.INT32),
            (V.ARRAY, V.BOOL)} <= kinds
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "IQ2_XXS", "Q1_0", "Q2_0"} <= types


# ---------------------------------------------------------------------------------------------
# A small file of every value kind, written by gguf-py's GGUFWriter, and its bad copies

KEYS = {"t.string": ("héllo", V.STRING), "t.u8": (200, V.UINT8), "t.i8": (-5, V.INT8), "t.u16": (60000, V.UINT16),
        "t.i16": (-30000, V.INT16), "t.u32": (4000000000, V.UINT32), "t.i32": (-2000000000, V.INT32),
        "t.f32": (0.1, V.FLOAT32), "t.u64": (2**63 + 5, V.UINT64), "t.i64": (-2**62, V.INT64),
        "t.f64": (0.1, V.FLOAT64), "t.bool": (True, V.BOOL)}
TOKENS = ["a", "bc", "", "d\u00e9", "<|x|>", "\U0001f600"]


def small_gguf(path, alignment=None, endianess=GGUFEndian.LITTLE):  # -> path of a GGUF of KEYS, arrays and 3 tensors
    w = GGUFWriter(str(path), "test", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype) in KEYS.items():
        w.add_key_value(key, value, vtype)
    w.add_array("t.tokens", TOKENS)
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.0])
    w.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    w.add_tensor("w", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("h", rng.standard_normal((2, 5)).astype(np.float16))
    w.add_tensor("q", rng.integers(0, 256, (2, 2 * 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    gguf.write_out(w)
    return str(path)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_gguf(tmp_path_factory.mktemp("small") / "small.gguf")


def test_every_value_kind_reads_as_written(small):
    r = assert_same_as_gguf_py(small)
    f32 = float(np.float32(0.1))
    values = {k: v for k, (v, _) in KEYS.items()} | {"t.f32": f32, "t.tokens": TOKENS, "t.ints": [3, -1, 7],
                                                     "t.floats": [0.5, -2.0], "t.bools": [True, False, True]}
    assert {k: f.value for k, f in r.fields.items() if k.startswith("t.")} == values
    assert r.fields["t.tokens"].types == [V.ARRAY, V.STRING] and r.fields["t.u64"].types == [V.UINT64]
    assert [(t.name, t.shape, t.data.shape) for t in r.tensors] == [("w", (8, 3), (3, 8)), ("h", (5, 2), (2, 5)),
                                                                    ("q", (64, 2), (2, 68))]


def test_an_empty_array_keeps_its_item_type(tmp_path):  # gguf-py's writer writes none; llama.cpp's can
    key = b"t.empty"
    entry = u64(len(key)) + key + u32(V.ARRAY) + u32(V.INT32) + u64(0)
    (tmp_path / "e.gguf").write_bytes(b"GGUF" + u32(3) + u64(0) + u64(1) + entry)
    f = gguf.open_reader(str(tmp_path / "e.gguf")).fields["t.empty"]
    assert (f.types, f.value) == ([V.ARRAY, V.INT32], [])
    # gguf-py takes the item type from the first item: it has none to name here
    assert GGUFReader(str(tmp_path / "e.gguf")).fields["t.empty"].types == [V.ARRAY]


@pytest.mark.parametrize("alignment", [1, 64, 4096])
def test_general_alignment_places_the_data(tmp_path, alignment):
    r = assert_same_as_gguf_py(small_gguf(tmp_path / "a.gguf", alignment))
    assert r.alignment == alignment and r.data_offset % alignment == 0


def test_version_2_reads_as_version_3(tmp_path, small):  # the layouts are one; v3 only added big-endian files
    data = bytearray(open(small, "rb").read())
    data[4:8] = struct.pack("<I", 2)
    (tmp_path / "v2.gguf").write_bytes(bytes(data))
    assert assert_same_as_gguf_py(str(tmp_path / "v2.gguf")).version == 2


def test_a_big_endian_file_is_refused(tmp_path):  # gguf-py swaps it; llama.cpp on a little-endian host refuses it
    path = small_gguf(tmp_path / "be.gguf", endianess=GGUFEndian.BIG)
    assert GGUFReader(path).fields["t.u32"].contents() == 4000000000
    with pytest.raises(gguf.GGUFError, match=r"unsupported GGUF version 50331648 \(a big-endian file\?\)"):
        gguf.open_reader(path)


def slots(path):  # -> {name: (offset, size)} of the numbers and bytes of the small file, from gguf-py's parse
    reader = GgufPy(path)
    base = reader.data.ctypes.data
    where = lambda part: (part.ctypes.data - base, part.nbytes)  # noqa: E731
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[f"{key} key length"], out[f"{key} key"], out[f"{key} type"] = map(where, f.parts[:3])
        if f.types[0] == V.ARRAY:
            out[f"{key} item type"], out[f"{key} count"] = map(where, f.parts[3:5])
    tokens = reader.fields["t.tokens"]
    out["token 3 length"], out["token 3"] = where(tokens.parts[tokens.data[3] - 1]), where(tokens.parts[tokens.data[3]])
    out["last token length"] = where(tokens.parts[tokens.data[-1] - 1])
    for f in reader.info_fields:
        name = str(bytes(f.parts[1]), "utf-8")
        for part, what in zip(f.parts, ("name length", "name", "n_dims", "dims", "type", "offset")):
            out[f"{name} {what}"] = where(part)
    return out, reader.data_offset


def patched(tmp_path, src, changes):  # changes: [(slot, bytes)] -> path of a copy with those bytes written
    data = bytearray(open(src, "rb").read())
    for (offset, _), value in changes:
        data[offset:offset + len(value)] = value
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    return str(path)


def refusal(path):  # -> the GGUFError's message; the error is one line naming the file
    with pytest.raises(gguf.GGUFError) as e:
        gguf.open_reader(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return e.value.problem


def test_every_cut_inside_the_header_is_refused(tmp_path, small):
    data = open(small, "rb").read()
    where, _ = slots(small)
    infos_end = sum(where["q offset"])
    last = gguf.open_reader(small).tensors[-1]
    cut_path = tmp_path / "cut.gguf"
    # every byte of the header, the metadata, the tensor infos and the data; the padding after the last
    # tensor is no tensor's (src/llama-model-loader.h:47 checks each tensor's end against the file's size)
    for cut in range(last.data_offset + last.n_bytes):
        cut_path.write_bytes(data[:cut])
        problem = refusal(str(cut_path))
        if cut < 24:
            expected = "too short"
        elif cut < infos_end:  # the counts cannot fit, or a read of the metadata or infos runs out
            expected = "cannot fit in" if "cannot fit in" in problem else "left)"
        else:  # the padding or a tensor's data is short
            expected = "runs past the end of the file (truncated?)"
        assert expected in problem, (cut, problem)


def u64(n):
    return struct.pack("<Q", n % (1 << 64))


def u32(n):
    return struct.pack("<I", n % (1 << 32))


LEFT = object()  # a count of exactly one more than the bytes that follow it


ABSURD = [  # (slot, value, what the refusal says)
    ("t.tokens key length", u64(2**62), "the key of metadata entry"),
    ("t.tokens key length", LEFT, "runs past the end"),
    ("t.tokens count", u64(2**62), "key t.tokens (4611686018427387904 strings) runs past the end"),
    ("t.tokens count", u64(2**64 - 1), "runs past the end"),
    ("t.tokens count", LEFT, "runs past the end"),
    ("t.ints count", u64(2**62), "key t.ints (4611686018427387904 values) runs past the end"),
    ("t.ints count", LEFT, "runs past the end"),
    ("token 3 length", u64(2**62), "string 3 of key t.tokens runs past the end of the file (4611686018427387904 bytes"),
    ("token 3 length", LEFT, "string 3 of key t.tokens"),
    ("last token length", LEFT, "string 5 of key t.tokens"),
    ("t.string type", u32(13), "key t.string has unknown value type 13"),
    ("t.string type", u32(2**32 - 1), "key t.string has unknown value type 4294967295"),
    ("t.ints item type", u32(99), "key t.ints has unknown value type 99"),
    ("t.ints item type", u32(int(V.ARRAY)), "key t.ints is an array of arrays"),
    ("t.u8 key", b"t.\xff8", "the key of metadata entry 2 is not UTF-8"),  # entry 0 is general.architecture
    ("t.u8 key length", u64(0), "key of metadata entry 2 is empty"),
    ("t.i8 key", b"t.u8", "duplicated key t.u8"),
    ("token 3", b"d\xff", "string 3 of key t.tokens is not UTF-8"),
    ("t.string key length", u64(2**62), "runs past the end"),
    ("w name length", u64(2**62), "the name of tensor 0"),
    ("w name length", LEFT, "the name of tensor 0"),
    ("w name", b"\xfe", "the name of tensor 0 is not UTF-8"),
    ("w name length", u64(64), "tensor 0's name is 64 bytes, ggml's limit 63"),
    ("h name", b"w", "duplicated tensor name w"),
    ("w n_dims", u32(2**31), "tensor w has 2147483648 dimensions, ggml at most 4"),
    ("w n_dims", u32(5), "tensor w has 5 dimensions"),
    ("w dims", u64(2**40), "tensor w runs past the end of the file"),
    ("w dims", u64(2**62), "more than ggml's int64 counts hold"),  # 2**62 x 3
    ("w dims", u64(2**63), "more than ggml's int64 counts hold"),
    ("w dims", u64(2**64 - 1), "more than ggml's int64 counts hold"),
    ("w type", u32(4), "unsupported tensor type id 4 in tensor w"),  # Q4_2, removed from ggml
    ("w type", u32(2**32 - 1), "unsupported tensor type id 4294967295 in tensor w"),
    ("q dims", u64(48), "tensor q: rows of 48 values are not whole Q8_0 blocks of 32"),
    ("q offset", u64(2**62), "tensor q runs past the end of the file"),
    ("q offset", u64(8), "offset 8 is not a multiple of the alignment 32"),
]


@pytest.mark.parametrize("slot, value, words", ABSURD, ids=[f"{s}={v if v is LEFT else v.hex()}" for s, v, _ in ABSURD])
def test_bad_counts_types_and_names_are_refused_by_name(tmp_path, small, slot, value, words):
    where, _ = slots(small)
    offset, size = where[slot]
    if value is LEFT:
        value = (u32 if size == 4 else u64)(os.path.getsize(small) - offset - size + 1)
    assert words in refusal(patched(tmp_path, small, [(where[slot], value)]))


@pytest.mark.parametrize("value, vtype, words", [
    (64, V.UINT64, "general.alignment must be a uint32, not UINT64"),
    (0, V.UINT32, "general.alignment 0 is not a power of 2"),
    (48, V.UINT32, "general.alignment 48 is not a power of 2"),
])
def test_a_bad_alignment_is_refused(tmp_path, value, vtype, words):
    w = GGUFWriter(str(tmp_path / "a.gguf"), "test")
    w.add_key_value("general.alignment", value, vtype)
    w.add_tensor("w", np.ones((2, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    assert words in refusal(str(tmp_path / "a.gguf"))


@pytest.mark.parametrize("slot, value", [("t.tokens count", u64(2**62)), ("token 3", b"d\xff"),
                                         ("w n_dims", u32(5))])
def test_the_cli_says_it_in_one_line(tmp_path, small, slot, value):
    where, _ = slots(small)
    path = patched(tmp_path, small, [(where[slot], value)])
    assert path in cli_error(run_cli("reference.run", "--model", path, "--n-predict", "1"))
