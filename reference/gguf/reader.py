"""The GGUF reader: the header, the metadata and the tensor infos of a file (ggml/include/gguf.h:1-30
is the layout, ggml/src/gguf.cpp gguf_init_from_file_impl the checks), every count checked against
the bytes left before anything is allocated for it; each tensor's data a view of the memory map.
`Metadata` gives typed access to the keys. The tensor types of the pinned ggml are gguf-py's plus
the one it lacks (Q2_0).
"""
import math
import os
import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGMLQuantizationType

from .. import artifacts

GGUF_MAGIC = b"GGUF"
MIN_KV_BYTES = 12       # key length (u64) + value type (u32): no metadata entry is smaller
MIN_TENSOR_BYTES = 24   # name length (u64) + n_dims (u32) + type (u32) + offset (u64)


class GGUFError(Exception):
    """A GGUF that cannot be used; the message is one line naming the file and the problem."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


# ---------------------------------------------------------------------------------------------
# Tensor types of the pinned ggml that gguf-py 0.19.0 does not know (Q2_0) or cannot decode (Q1_0):
# their ids and blocks from ggml.h / ggml-common.h

class GgmlType(IntEnum):  # ggml.h type ids missing from gguf-py's GGMLQuantizationType
    Q2_0 = 42


EXTRA_SIZES = {GGMLQuantizationType.Q1_0: (128, 2 + 16),  # values per block, bytes per block
               GgmlType.Q2_0: (64, 2 + 16)}
_GGUF_PY_IDS = frozenset(int(t) for t in GGML_QUANT_SIZES)
TENSOR_SIZES = {**GGML_QUANT_SIZES, GgmlType.Q2_0: EXTRA_SIZES[GgmlType.Q2_0]}


# ---------------------------------------------------------------------------------------------
# Reading the header, the metadata and the tensor infos

GGUF_DEFAULT_ALIGNMENT = 32  # gguf.h:46
GGML_MAX_DIMS = 4            # ggml.h:222
GGML_MAX_NAME = 64           # ggml.h:229: a tensor name is shorter (gguf.cpp:658)
INT64_MAX = (1 << 63) - 1    # ggml's ne are int64 (gguf.cpp:692, 706)


def _check_header(path, file_size):  # refuse absurd counts before the metadata is walked
    if file_size < 24:
        raise GGUFError(path, f"file too short for a GGUF header ({file_size} bytes)")
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(path, f"not a GGUF file (magic {head[:4]!r})")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):  # v2 and v3 share the layout; a big-endian v3 reads as 0x03000000 here
        byte_order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFError(path, f"unsupported GGUF version {version}{byte_order}")
    n_tensors = int.from_bytes(head[8:16], "little")
    n_kv = int.from_bytes(head[16:24], "little")
    if n_kv * MIN_KV_BYTES > file_size or n_tensors * MIN_TENSOR_BYTES > file_size:
        raise GGUFError(path, f"corrupt header: {n_kv} metadata entries and {n_tensors} tensors "
                              f"cannot fit in {file_size} bytes")


def write_out(writer):  # a GGUFWriter with its keys and tensors added -> the file written and closed
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_file(path):  # path -> its size; GGUFError unless a regular file with a sane GGUF header
    """What open_reader refuses from the first 24 bytes, cheap enough to ask of every GGUF a command
    names before the first one loads."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise GGUFError(path, "no such file")
    # a directory, FIFO or device: nothing to map, and a FIFO would block the header's read
    artifacts.check_regular(path, artifacts.path_error(GGUFError, path), "GGUF file")
    file_size = os.path.getsize(path)
    _check_header(path, file_size)
    return file_size


def open_reader(path):  # path -> GGUFFile, memory-mapped, every tensor inside the file
    path = os.fspath(path)
    check_file(path)
    return GGUFFile(path)


class Field(NamedTuple):  # one metadata value
    types: list     # [value type], or [ARRAY, item type] (gguf-py's ReaderField.types, which has no item type for [])
    value: object   # int, float, bool or str; a list of them for an array


class TensorInfo(NamedTuple):  # one tensor, its data a view of the memory map
    name: str
    tensor_type: IntEnum  # a GGMLQuantizationType, or a GgmlType gguf-py lacks
    shape: tuple          # ggml's ne: the NumPy shape reversed
    n_elements: int
    n_bytes: int
    data_offset: int      # in the file
    data: np.ndarray      # the NumPy shape (F16, F32, F64, I8-I64), or uint8 [..., row bytes] for blocks
    type_offset: int      # in the file, of the tensor info's u32 type id


_VALUE_DTYPES = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
                 GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
                 GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
                 GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
_VALUE_DTYPES = {t: np.dtype(d) for t, d in _VALUE_DTYPES.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Cursor:
    """The file's bytes and a position in them: each read checks the bytes left first and names
    what it was reading when they run out."""

    def __init__(self, path, data):
        self.path, self.view, self.pos, self.end = path, memoryview(data), 0, len(data)

    def fail(self, problem):
        raise GGUFError(self.path, f"corrupt GGUF: {problem}")

    def take(self, n_bytes, what):  # -> offset of the next n_bytes, now read
        if n_bytes > self.end - self.pos:
            self.fail(f"{what} runs past the end of the file ({n_bytes} bytes at offset {self.pos}, "
                      f"{self.end - self.pos} left)")
        self.pos += n_bytes
        return self.pos - n_bytes

    def u32(self, what):
        return _U32.unpack_from(self.view, self.take(4, what))[0]

    def u64(self, what):
        return _U64.unpack_from(self.view, self.take(8, what))[0]

    def string(self, what):  # -> str; GGUF strings are a u64 length and that many UTF-8 bytes
        n = self.u64(f"the length of {what}")
        start = self.take(n, f"{what} ({n} bytes)")
        try:
            return str(self.view[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start})")

    def numbers(self, dtype, n, what):  # -> NumPy view [n] of the next n values of dtype
        return np.frombuffer(self.view, dtype, n, self.take(n * dtype.itemsize, f"{what} ({n} values)"))

    def strings(self, n, what):  # -> list of n str, in one pass over the bytes
        self.take(8 * n, f"{what} ({n} strings)")  # each string has its 8-byte length at least
        self.pos -= 8 * n
        view, pos, end, length_at, out = self.view, self.pos, self.end, _U64.unpack_from, []
        for i in range(n):
            if end - pos < 8:
                self.fail(f"the length of string {i} of {what} runs past the end of the file (8 bytes at offset "
                          f"{pos}, {end - pos} left)")
            length = length_at(view, pos)[0]
            pos += 8
            if length > end - pos:
                self.fail(f"string {i} of {what} runs past the end of the file ({length} bytes at offset {pos}, "
                          f"{end - pos} left)")
            try:
                out.append(str(view[pos:pos + length], "utf-8"))
            except UnicodeDecodeError as e:
                self.fail(f"string {i} of {what} is not UTF-8 ({e.reason} at byte {e.start})")
            pos += length
        self.pos = pos
        return out


def _value_type(cursor, raw, what):  # u32 -> GGUFValueType, refused by number when GGUF has none
    try:
        return GGUFValueType(raw)
    except ValueError:
        cursor.fail(f"{what} has unknown value type {raw}")


def _read_field(cursor, index):  # -> (key, Field) of metadata entry `index`
    key = cursor.string(f"the key of metadata entry {index}")
    if not key:  # gguf.cpp:571
        cursor.fail(f"the key of metadata entry {index} is empty")
    what = f"key {key}"
    vtype = _value_type(cursor, cursor.u32(f"the type of {what}"), what)
    if vtype != GGUFValueType.ARRAY:
        if vtype == GGUFValueType.STRING:
            return key, Field([vtype], cursor.string(f"the value of {what}"))
        return key, Field([vtype], _as_values(vtype, cursor.numbers(_VALUE_DTYPES[vtype], 1, what))[0])
    item = _value_type(cursor, cursor.u32(f"the item type of {what}"), what)
    n = cursor.u64(f"the length of {what}")
    if item == GGUFValueType.ARRAY:  # gguf.cpp:606: nested arrays are not GGUF
        cursor.fail(f"{what} is an array of arrays")
    if item == GGUFValueType.STRING:
        return key, Field([vtype, item], cursor.strings(n, what))
    return key, Field([vtype, item], _as_values(item, cursor.numbers(_VALUE_DTYPES[item], n, what)))


def _as_values(vtype, numbers):  # NumPy [n] -> list of Python numbers; a bool is a byte, 0 false (gguf.cpp:316-322)
    return (numbers != 0).tolist() if vtype == GGUFValueType.BOOL else numbers.tolist()


def _alignment(cursor, fields):  # -> general.alignment: a u32 power of 2, 32 when absent (gguf.cpp:622-635)
    f = fields.get("general.alignment")
    if f is None:
        return GGUF_DEFAULT_ALIGNMENT
    if f.types != [GGUFValueType.UINT32]:
        cursor.fail(f"general.alignment must be a uint32, not {f.types[-1].name}")
    if f.value == 0 or f.value & (f.value - 1):
        cursor.fail(f"general.alignment {f.value} is not a power of 2")
    return f.value


def _tensor_type(cursor, raw, name):  # u32 -> GGMLQuantizationType | GgmlType
    if raw in _GGUF_PY_IDS:
        return GGMLQuantizationType(raw)
    if raw in GgmlType._value2member_map_:
        return GgmlType(raw)
    raise GGUFError(cursor.path, f"unsupported tensor type id {raw} in tensor {name} (not a type of the pinned ggml)")


def _read_tensor_info(cursor, index):  # -> (name, ne, type, type_offset, offset in the data section)
    name = cursor.string(f"the name of tensor {index}")
    name_bytes = len(name.encode())
    if name_bytes >= GGML_MAX_NAME:
        cursor.fail(f"tensor {index}'s name is {name_bytes} bytes, ggml's limit {GGML_MAX_NAME - 1}")
    n_dims = cursor.u32(f"the dimension count of tensor {name}")
    if n_dims > GGML_MAX_DIMS:
        cursor.fail(f"tensor {name} has {n_dims} dimensions, ggml at most {GGML_MAX_DIMS}")
    ne = tuple(cursor.numbers(_VALUE_DTYPES[GGUFValueType.UINT64], n_dims, f"the dimensions of tensor {name}").tolist())
    if math.prod(ne) > INT64_MAX or max(ne, default=0) > INT64_MAX:
        cursor.fail(f"tensor {name} has {ne} elements, more than ggml's int64 counts hold")
    type_offset = cursor.pos
    qtype = _tensor_type(cursor, cursor.u32(f"the type of tensor {name}"), name)
    return name, ne, qtype, type_offset, cursor.u64(f"the offset of tensor {name}")


_PLAIN_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


class GGUFFile:
    """A GGUF's metadata (`fields`: key -> Field) and tensor infos (`tensors`, in the file's order),
    parsed from its memory map; each tensor's data is a view of the map."""

    def __init__(self, path):  # open_reader's; check_file has refused a bad magic, version or count
        self.data = np.memmap(path, mode="r")
        cursor = _Cursor(path, self.data)
        cursor.take(4, "the magic")
        self.version = cursor.u32("the version")
        n_tensors, n_kv = cursor.u64("the tensor count"), cursor.u64("the metadata count")
        self.fields = {}
        for i in range(n_kv):
            key, f = _read_field(cursor, i)
            if key in self.fields:  # gguf.cpp:575
                cursor.fail(f"duplicated key {key}")
            self.fields[key] = f
        self.metadata_end = cursor.pos  # where the tensor infos begin
        self.alignment = _alignment(cursor, self.fields)
        infos = [_read_tensor_info(cursor, i) for i in range(n_tensors)]
        self.infos_end = cursor.pos  # the data section starts at the next multiple of the alignment
        self.data_offset = -(-cursor.pos // self.alignment) * self.alignment
        self.tensors = [self._tensor(cursor, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):  # gguf.cpp:665
            names = [t.name for t in self.tensors]
            cursor.fail(f"duplicated tensor name {next(n for n in names if names.count(n) > 1)}")

    def _tensor(self, cursor, name, ne, qtype, type_offset, offset):  # -> TensorInfo, its data inside the file
        block, size = TENSOR_SIZES[qtype]
        row = ne[0] if ne else 1
        if row % block:  # gguf.cpp:740
            cursor.fail(f"tensor {name}: rows of {row} values are not whole {qtype.name} blocks of {block}")
        if offset % self.alignment:  # gguf.cpp:216: a multiple of the alignment
            cursor.fail(f"tensor {name}'s offset {offset} is not a multiple of the alignment {self.alignment}")
        n_elements = math.prod(ne)
        n_bytes = n_elements // block * size
        start = self.data_offset + offset
        if start + n_bytes > cursor.end:
            cursor.fail(f"tensor {name} runs past the end of the file (truncated?)")
        np_shape = tuple(reversed(ne))
        dtype = _PLAIN_DTYPES.get(qtype)
        if dtype is None:  # blocks: rows of bytes
            dtype, np_shape = np.uint8, (*np_shape[:-1], (np_shape or (1,))[-1] // block * size)
        data = self.data[start:start + n_bytes].view(dtype).reshape(np_shape)
        return TensorInfo(name, qtype, ne, n_elements, n_bytes, start, data, type_offset)


INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


class Metadata:
    """Typed access to a reader's keys; every failure names the file and key."""

    def __init__(self, reader, path):
        self.reader, self.path = reader, path

    def _field(self, key, required):
        f = self.reader.fields.get(key)
        if f is None and required:
            raise GGUFError(self.path, f"missing required key {key}")
        return f

    def str(self, key, default=None, required=False):
        f = self._field(key, required)
        if f is None:
            return default
        if f.types != [GGUFValueType.STRING]:
            raise GGUFError(self.path, f"key {key} should be a string")
        return f.value

    def int(self, key, default=None, required=False, per_layer=None):  # per_layer: n_layer, if an array may hold the value
        f = self._field(key, required)
        if f is None:
            return default
        if f.types[0] == GGUFValueType.ARRAY and per_layer is not None:
            values = f.value
            if len(values) != per_layer:  # llama.cpp would give the layers past its end 0
                raise GGUFError(self.path, f"key {key}: {len(values)} per-layer values for {per_layer} layers")
            if f.types[-1] not in INT_TYPES or len(set(values)) != 1:
                raise GGUFError(self.path, f"key {key}: per-layer values {values[:8]} are not supported "
                                           "(this model has one value for every layer)")
            return int(values[0])
        if f.types[0] not in INT_TYPES:
            raise GGUFError(self.path, f"key {key} should be an integer")
        return int(f.value)

    def float(self, key, default=None, required=False):
        f = self._field(key, required)
        if f is None:
            return default
        if f.types[0] not in FLOAT_TYPES:
            raise GGUFError(self.path, f"key {key} should be a float")
        return float(f.value)

    def bool(self, key, default=None):
        f = self._field(key, False)
        if f is None:
            return default
        return bool(f.value)

    def array(self, key, default=None):
        f = self._field(key, False)
        if f is None:
            return default
        if f.types[0] != GGUFValueType.ARRAY:
            raise GGUFError(self.path, f"key {key} should be an array")
        return f.value
