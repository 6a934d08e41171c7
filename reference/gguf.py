"""Open a GGUF file of one of the three Muse-Glimmer roles, validate it, and hand out its tensors.

Roles: `text` (general.architecture = muse-glimmer), `mmproj` (clip with clip.projector_type =
muse-glimmer) and `dflash` (the speculative drafter). Configs hold every key llama.cpp reads, with
llama.cpp's defaults where a key is absent (docs/text.md, docs/vision.md, docs/dflash.md).

Tensors stay quantized in the memory map; `Weights.get` dequantizes one on demand through
gguf.quants (bit-exact with ggml), or for the two types of the pinned ggml that gguf-py lacks (Q1_0,
Q2_0) through decoders written from ggml's dequantize_row_*, and keeps a bounded LRU of dequantized
tensors, so a 30B file never needs to be dequantized whole.
"""
import math
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGMLQuantizationType
from gguf import quants

from . import artifacts

GGUF_MAGIC = b"GGUF"
MIN_KV_BYTES = 12       # key length (u64) + value type (u32): no metadata entry is smaller
MIN_TENSOR_BYTES = 24   # name length (u64) + n_dims (u32) + type (u32) + offset (u64)
DEFAULT_CACHE_BYTES = 2 << 30


class GGUFError(Exception):
    """A GGUF that cannot be used; the message is one line naming the file and the problem."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


# ---------------------------------------------------------------------------------------------
# Reading the header, the metadata and the tensor infos (ggml/include/gguf.h:1-30 is the layout;
# ggml/src/gguf.cpp gguf_init_from_file_impl the checks), every count checked against the bytes
# left before anything is allocated for it

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


_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


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
            if f.types[-1] not in _INT_TYPES or len(set(values)) != 1:
                raise GGUFError(self.path, f"key {key}: per-layer values {values[:8]} are not supported "
                                           "(this model has one value for every layer)")
            return int(values[0])
        if f.types[0] not in _INT_TYPES:
            raise GGUFError(self.path, f"key {key} should be an integer")
        return int(f.value)

    def float(self, key, default=None, required=False):
        f = self._field(key, required)
        if f is None:
            return default
        if f.types[0] not in _FLOAT_TYPES:
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


# ---------------------------------------------------------------------------------------------
# Configs

def swa_layers_from(meta, key, n_layer, default_period):  # -> tuple[bool] per layer
    """llama.cpp's load_swa_pattern: an array is copied (missing entries are full layers);
    a scalar period P (default 4 when absent) makes layer i SWA iff P == 0 or i % P < P - 1."""
    f = meta.reader.fields.get(key)
    if f is not None and f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] not in _INT_TYPES | {GGUFValueType.BOOL}:
            raise GGUFError(meta.path, f"key {key} should be an array of bool or int")
        values = [bool(v) for v in f.value][:n_layer]
        return tuple(values + [False] * (n_layer - len(values)))
    period = meta.int(key, default=default_period)
    return tuple(period == 0 or (i % period) < period - 1 for i in range(n_layer))


# Token texts llama.cpp marks end-of-generation wherever they occur (llama-vocab.cpp, load).
# `<|eom|>` is not among them: it is EOG only when tokenizer.ggml.eom_token_id names it.
EOG_TOKEN_NAMES = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
])


@dataclass(frozen=True)
class TokenizerConfig:
    model: str
    pre: str
    tokens: list = field(repr=False)
    token_types: list = field(repr=False)
    merges: list = field(repr=False)
    bos: int
    eos: int
    eot: int
    eom: int
    pad: int
    mask: int
    add_bos: object        # True/False from the GGUF, None when absent (the pre-tokenizer decides)
    add_eos: bool
    chat_template: str = field(repr=False)

    @property
    def n_vocab(self):
        return len(self.tokens)

    @property
    def eog_ids(self):  # llama.cpp's end-of-generation set: EOS, EOT, EOM and its list of names
        named = {i for i, t in enumerate(self.tokens) if t in EOG_TOKEN_NAMES}
        return frozenset(named | {i for i in (self.eos, self.eot, self.eom) if i >= 0})


def read_tokenizer(meta):  # Metadata -> TokenizerConfig (ids are -1 where the key is absent)
    tokens = meta.array("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(meta.path, "missing required key tokenizer.ggml.tokens")
    n_vocab = len(tokens)

    def token_id(name):
        i = meta.int(f"tokenizer.ggml.{name}_token_id", default=-1)
        if i >= n_vocab:
            raise GGUFError(meta.path, f"tokenizer.ggml.{name}_token_id {i} is outside the vocabulary ({n_vocab})")
        return i

    token_types = meta.array("tokenizer.ggml.token_type", default=[1] * n_vocab)
    if len(token_types) != n_vocab:  # one type per token: the tokenizer looks them up by id
        raise GGUFError(meta.path, f"tokenizer.ggml.token_type has {len(token_types)} entries "
                                   f"for {n_vocab} tokens")
    return TokenizerConfig(
        model=meta.str("tokenizer.ggml.model", default="gpt2"),
        pre=meta.str("tokenizer.ggml.pre", default="default"),
        tokens=tokens, token_types=token_types,
        merges=meta.array("tokenizer.ggml.merges", default=[]),
        bos=token_id("bos"), eos=token_id("eos"), eot=token_id("eot"), eom=token_id("eom"),
        pad=token_id("padding"), mask=token_id("mask"),
        add_bos=meta.bool("tokenizer.ggml.add_bos_token", default=None),
        add_eos=meta.bool("tokenizer.ggml.add_eos_token", default=False),
        chat_template=meta.str("tokenizer.chat_template", default=""),
    )


@dataclass(frozen=True)
class TextConfig:
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int         # attention.key_length (128 on the release; n_embd/n_head would be 208)
    head_dim_v: int
    n_rot: int
    rope_base: float
    rope_base_swa: float  # rope.freq_base_swa, falling back to rope.freq_base (muse override)
    rms_eps: float
    n_swa: int
    swa_layers: tuple     # per layer: sliding-window attention and RoPE; full layers are NoPE
    logit_scale: float
    softcap: float        # 30.0 when absent (llama.cpp hparams default); 0 disables
    post_norm_eps: float = 1e-8  # hard-coded in llama.cpp's muse-glimmer graph, not a GGUF key


def read_text_config(meta):  # Metadata -> TextConfig
    a = lambda k: f"muse-glimmer.{k}"  # noqa: E731
    n_layer = meta.int(a("block_count"), required=True)
    n_embd = meta.int(a("embedding_length"), required=True)
    n_head = meta.int(a("attention.head_count"), required=True, per_layer=n_layer)
    n_head_kv = meta.int(a("attention.head_count_kv"), default=n_head, per_layer=n_layer)
    head_dim = meta.int(a("attention.key_length"), default=n_embd // max(n_head, 1))
    rope_base = meta.float(a("rope.freq_base"), default=10000.0)
    cfg = TextConfig(
        n_vocab=len(meta.array("tokenizer.ggml.tokens", default=[])),
        n_ctx_train=meta.int(a("context_length"), required=True),
        n_embd=n_embd, n_layer=n_layer,
        n_ff=meta.int(a("feed_forward_length"), required=True, per_layer=n_layer),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        head_dim_v=meta.int(a("attention.value_length"), default=n_embd // max(n_head, 1)),
        n_rot=meta.int(a("rope.dimension_count"), default=head_dim),
        rope_base=rope_base,
        rope_base_swa=meta.float(a("rope.freq_base_swa"), default=rope_base),
        rms_eps=meta.float(a("attention.layer_norm_rms_epsilon"), required=True),
        n_swa=meta.int(a("attention.sliding_window"), required=True),
        swa_layers=swa_layers_from(meta, a("attention.sliding_window_pattern"), n_layer, 4),
        logit_scale=meta.float(a("logit_scale"), required=True),
        softcap=meta.float(a("final_logit_softcapping"), default=30.0),
    )
    _validate_text(meta.path, cfg)
    return cfg


def _validate_text(path, c):
    if not (0 < c.n_layer <= 512 and 0 < c.n_embd and 0 < c.n_head and 0 < c.n_head_kv and 0 < c.n_ff):
        raise GGUFError(path, f"implausible sizes: n_layer={c.n_layer} n_embd={c.n_embd} "
                              f"n_head={c.n_head} n_head_kv={c.n_head_kv} n_ff={c.n_ff}")
    if c.n_head % c.n_head_kv:
        raise GGUFError(path, f"head_count {c.n_head} is not a multiple of head_count_kv {c.n_head_kv}")
    if c.head_dim != c.head_dim_v or c.n_rot != c.head_dim or c.head_dim % 2:
        raise GGUFError(path, f"unsupported head geometry: key_length={c.head_dim} "
                              f"value_length={c.head_dim_v} rope.dimension_count={c.n_rot}")
    if c.n_vocab == 0:
        raise GGUFError(path, "the vocabulary (tokenizer.ggml.tokens) is empty")
    if not any(c.swa_layers):
        raise GGUFError(path, "sliding_window_pattern has no sliding-window layer "
                              "(llama.cpp aborts on such a model)")
    if c.n_swa <= 0:
        raise GGUFError(path, f"sliding_window must be positive, not {c.n_swa}")
    for key, value in (("attention.layer_norm_rms_epsilon", c.rms_eps), ("rope.freq_base", c.rope_base),
                       ("rope.freq_base_swa", c.rope_base_swa), ("logit_scale", c.logit_scale)):
        _check_positive(path, f"muse-glimmer.{key}", value)
    if not (math.isfinite(c.softcap) and c.softcap >= 0):
        raise GGUFError(path, f"muse-glimmer.final_logit_softcapping must be finite and not negative "
                              f"(0 turns it off), not {c.softcap}")


def _check_positive(path, key, value):  # an epsilon, a RoPE base, a scale: 0, < 0, inf or nan make nan or nonsense
    if not (math.isfinite(value) and value > 0):
        raise GGUFError(path, f"{key} must be positive and finite, not {value}")


# The video extension (tools/video_mmproj.py; docs/vision.md, Video): names fixed for every reader and writer.
PATCH_EMBD_T1 = "v.patch_embd.weight.t1"  # the second frame's kernel half W1; v.patch_embd.weight keeps W0 + W1
TEMPORAL_PATCH_SIZE = "clip.vision.temporal_patch_size"
VIDEO_FPS = "clip.vision.video.fps"
VIDEO_MAX_FRAMES = "clip.vision.video.max_frames"
VIDEO_MAX_FRAME_TOKENS = "clip.vision.video.max_frame_tokens"
VIDEO_TIMESTAMP_FORMAT = "clip.vision.video.timestamp_format"
# MuseGlimmerVideoProcessor's class defaults (transformers/models/muse_glimmer/video_processing_muse_glimmer.py:96-115)
VIDEO_DEFAULTS = {"fps": 2.0, "max_frames": 96, "max_frame_tokens": 144, "timestamp_format": "Time: {timestamp:.1f}s"}


@dataclass(frozen=True)
class VisionConfig:
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    layer_norm_eps: float
    merge_size: int
    image_mean: tuple
    image_std: tuple
    projection_dim: int
    rope_theta: float = 10000.0     # hard-coded in llama.cpp's clip.cpp, not a key
    sparse_factor: int = 4          # every 4th tower layer attends globally (clip.cpp)
    temporal_patch_size: int = 0    # 0: no video extension
    video: dict = field(default_factory=lambda: dict(VIDEO_DEFAULTS))  # fps, max_frames, max_frame_tokens, timestamp_format

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


def read_vision_config(meta):  # Metadata -> VisionConfig
    projector = meta.str("clip.projector_type", required=True)
    if projector != "muse-glimmer":
        raise GGUFError(meta.path, f"clip.projector_type is {projector!r}, not 'muse-glimmer'")
    if not meta.bool("clip.has_vision_encoder", default=False):
        raise GGUFError(meta.path, "mmproj has no vision encoder (clip.has_vision_encoder)")
    v = lambda k: f"clip.vision.{k}"  # noqa: E731
    cfg = VisionConfig(
        image_size=meta.int(v("image_size"), required=True),
        patch_size=meta.int(v("patch_size"), required=True),
        n_embd=meta.int(v("embedding_length"), required=True),
        n_ff=meta.int(v("feed_forward_length"), required=True),
        n_layer=meta.int(v("block_count"), required=True),
        n_head=meta.int(v("attention.head_count"), required=True),
        layer_norm_eps=meta.float(v("attention.layer_norm_epsilon"), default=1e-6),
        merge_size=meta.int(v("spatial_merge_size"), default=2),
        image_mean=tuple(meta.array(v("image_mean"), default=[0.5, 0.5, 0.5])),
        image_std=tuple(meta.array(v("image_std"), default=[0.5, 0.5, 0.5])),
        projection_dim=meta.int(v("projection_dim"), default=0),
        temporal_patch_size=meta.int(TEMPORAL_PATCH_SIZE, default=0),
        video={"fps": meta.float(VIDEO_FPS, default=VIDEO_DEFAULTS["fps"]),
               "max_frames": meta.int(VIDEO_MAX_FRAMES, default=VIDEO_DEFAULTS["max_frames"]),
               "max_frame_tokens": meta.int(VIDEO_MAX_FRAME_TOKENS, default=VIDEO_DEFAULTS["max_frame_tokens"]),
               "timestamp_format": meta.str(VIDEO_TIMESTAMP_FORMAT, default=VIDEO_DEFAULTS["timestamp_format"])},
    )
    if cfg.temporal_patch_size not in (0, 2):
        raise GGUFError(meta.path, f"{TEMPORAL_PATCH_SIZE} is {cfg.temporal_patch_size}; the tower pairs frames (2)")
    if not (cfg.video["fps"] > 0 and math.isfinite(cfg.video["fps"]) and cfg.video["max_frames"] > 0
            and cfg.video["max_frame_tokens"] > 0):
        raise GGUFError(meta.path, f"implausible video defaults {cfg.video}")
    if not (0 < cfg.n_layer <= 512 and cfg.n_head > 0 and cfg.n_embd % cfg.n_head == 0 and cfg.patch_size > 0):
        raise GGUFError(meta.path, f"implausible vision sizes: layers={cfg.n_layer} width={cfg.n_embd} "
                                   f"heads={cfg.n_head} patch={cfg.patch_size}")
    _check_positive(meta.path, v("attention.layer_norm_epsilon"), cfg.layer_norm_eps)
    for key, values in (("image_mean", cfg.image_mean), ("image_std", cfg.image_std)):
        if len(values) != 3 or not all(math.isfinite(x) for x in values):
            raise GGUFError(meta.path, f"{v(key)} must be 3 finite numbers (R, G, B), not {list(values)}")
    for x in cfg.image_std:  # pixels are divided by it
        _check_positive(meta.path, v("image_std"), x)
    return cfg


@dataclass(frozen=True)
class DraftConfig:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rms_eps: float
    block_size: int
    target_layers: tuple  # GGUF convention: the *input* of each target layer (HF ids + 1)
    n_swa: int
    swa_layers: tuple
    mask_token: int
    n_ctx_train: int


def read_draft_config(meta):  # Metadata -> DraftConfig
    a = lambda k: f"dflash.{k}"  # noqa: E731
    n_layer = meta.int(a("block_count"), required=True)
    n_embd = meta.int(a("embedding_length"), required=True)
    n_head = meta.int(a("attention.head_count"), required=True, per_layer=n_layer)
    n_swa = meta.int(a("attention.sliding_window"), default=0)
    target_layers = meta.array(a("target_layers"))
    if not target_layers:
        raise GGUFError(meta.path, "missing required key dflash.target_layers")
    cfg = DraftConfig(
        n_embd=n_embd, n_layer=n_layer,
        n_ff=meta.int(a("feed_forward_length"), required=True, per_layer=n_layer),
        n_head=n_head,
        n_head_kv=meta.int(a("attention.head_count_kv"), default=n_head, per_layer=n_layer),
        head_dim=meta.int(a("attention.key_length"), default=n_embd // max(n_head, 1)),
        rope_base=meta.float(a("rope.freq_base"), default=10000.0),
        rms_eps=meta.float(a("attention.layer_norm_rms_epsilon"), required=True),
        block_size=meta.int(a("block_size"), default=16),
        target_layers=tuple(int(x) for x in target_layers),
        n_swa=n_swa,
        swa_layers=(swa_layers_from(meta, a("attention.sliding_window_pattern"), n_layer, 4)
                    if n_swa > 0 else (False,) * n_layer),
        mask_token=meta.int("tokenizer.ggml.mask_token_id", default=-1),
        n_ctx_train=meta.int(a("context_length"), default=0),
    )
    if not (0 < cfg.n_layer <= 512 and cfg.n_head > 0 and cfg.n_head_kv > 0 and cfg.n_head % cfg.n_head_kv == 0):
        raise GGUFError(meta.path, f"implausible drafter sizes: layers={cfg.n_layer} heads={cfg.n_head}/{cfg.n_head_kv}")
    _check_positive(meta.path, a("attention.layer_norm_rms_epsilon"), cfg.rms_eps)
    _check_positive(meta.path, a("rope.freq_base"), cfg.rope_base)
    return cfg


# ---------------------------------------------------------------------------------------------
# Expected tensors per role (NumPy [out, in] shapes); a shape that disagrees is an error at load

def text_tensor_shapes(c):  # TextConfig -> {name: shape}
    E, V, F, D = c.n_embd, c.n_vocab, c.n_ff, c.head_dim
    q, kv = c.n_head * D, c.n_head_kv * D
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,), "output.weight": (V, E)}
    for il in range(c.n_layer):
        b = f"blk.{il}."
        shapes.update({
            b + "attn_norm.weight": (E,), b + "attn_q.weight": (q, E), b + "attn_k.weight": (kv, E),
            b + "attn_v.weight": (kv, E), b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,),
            b + "attn_gate.weight": (q, E), b + "attn_output.weight": (E, q),
            b + "post_attention_norm.weight": (E,), b + "ffn_norm.weight": (E,),
            b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E), b + "ffn_down.weight": (E, F),
            b + "post_ffw_norm.weight": (E,),
        })
    return shapes


def text_optional_shapes(c):  # fused QKV replaces q/k/v; q/k/v biases are optional
    D = c.head_dim
    q, kv = c.n_head * D, c.n_head_kv * D
    shapes = {}
    for il in range(c.n_layer):
        b = f"blk.{il}."
        shapes.update({b + "attn_qkv.weight": (q + 2 * kv, c.n_embd), b + "attn_q.bias": (q,),
                       b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
    return shapes


# ---------------------------------------------------------------------------------------------
# Tensors

class Weights:
    """Tensors of one GGUF, dequantized on demand to float32 (or float64) with a bounded LRU cache."""

    def __init__(self, reader, path, cache_bytes=DEFAULT_CACHE_BYTES):
        self.path = path
        self.tensors = {t.name: t for t in reader.tensors}
        self.cache_bytes = cache_bytes
        self._cache = OrderedDict()
        self._cached_bytes = 0

    def __contains__(self, name):
        return name in self.tensors

    def shape(self, name):  # name -> NumPy shape (reversed ggml ne)
        return tuple(reversed(self.tensors[name].shape))

    def type_name(self, name):
        return self.tensors[name].tensor_type.name

    def raw(self, name):  # the tensor's bytes/values as stored, memory-mapped
        return self.tensors[name].data

    def get(self, name, dtype=np.float32):  # name -> dequantized array of self.shape(name)
        key = (name, np.dtype(dtype).str)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        t = self._tensor(name)
        w = dequantize(t.data, t.tensor_type, self.path, name).reshape(self.shape(name)).astype(dtype, copy=False)
        self._remember(key, w)
        return w

    def rows(self, name, ids, dtype=np.float32):  # name, ids [T] or a slice -> [T, n_cols], only those rows
        t = self._tensor(name)
        picked = t.data[ids if isinstance(ids, slice) else np.asarray(ids)]
        return dequantize(picked, t.tensor_type, self.path, name).astype(dtype, copy=False)

    def dense_bytes(self, name, dtype):  # bytes the tensor takes once dequantized to dtype
        return int(self._tensor(name).n_elements) * np.dtype(dtype).itemsize

    def _tensor(self, name):
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(self.path, f"missing tensor {name}")
        return t

    def _remember(self, key, w):
        self._cache[key] = w
        self._cached_bytes += w.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes


def dequantize(data, qtype, path, name):  # raw blocks [..., row_bytes] -> float32 [..., n_cols]
    decode = EXTRA_DECODERS.get(qtype)
    if decode is not None:
        return dequantize_blocks(np.asarray(data), qtype, decode)
    try:
        return np.asarray(quants.dequantize(np.asarray(data), qtype), dtype=np.float32)
    except NotImplementedError:
        raise GGUFError(path, unsupported(qtype, name)) from None


def check_tensors(weights, required, optional=()):  # raise on a missing tensor or wrong shape
    optional = dict(optional)
    for name, shape in list(required.items()) + [(n, s) for n, s in optional.items() if n in weights]:
        if name not in weights:
            raise GGUFError(weights.path, f"missing tensor {name}")
        have = weights.shape(name)
        if have != tuple(shape):
            raise GGUFError(weights.path, f"tensor {name} has shape {list(have)}, the metadata implies {list(shape)}")
    for name, t in weights.tensors.items():
        if not decodable(t.tensor_type):
            raise GGUFError(weights.path, unsupported(t.tensor_type, name))


# ---------------------------------------------------------------------------------------------
# Tensor types of the pinned ggml that gguf-py 0.19.0 cannot decode (Q1_0) or does not know (Q2_0):
# their ids and blocks from ggml.h / ggml-common.h, their values from ggml-quants.c dequantize_row_*

class GgmlType(IntEnum):  # ggml.h type ids missing from gguf-py's GGMLQuantizationType
    Q2_0 = 42


EXTRA_SIZES = {GGMLQuantizationType.Q1_0: (128, 2 + 16),  # values per block, bytes per block
               GgmlType.Q2_0: (64, 2 + 16)}
_GGUF_PY_IDS = frozenset(int(t) for t in GGML_QUANT_SIZES)
TENSOR_SIZES = {**GGML_QUANT_SIZES, GgmlType.Q2_0: EXTRA_SIZES[GgmlType.Q2_0]}


class UnsupportedTensorType(Exception):
    """A tensor of a type this reference cannot read: a file that is valid, only not for us."""


def unsupported(qtype, name):  # the one refusal of a type, by its name
    return f"unsupported tensor type {qtype.name} in tensor {name}"


def decodable(qtype):  # a GGMLQuantizationType or GgmlType -> can dequantize() decode it?
    return qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or \
        qtype in quants._type_traits or qtype in EXTRA_DECODERS


def block_scales(blocks):  # uint8 [n, bytes] opening with an f16 d -> float32 [n, 1]
    return np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32)


def dequantize_q1_0(blocks):  # uint8 [n, 18] -> float32 [n, 128]: bit j of qs set -> +d, clear -> -d
    d = block_scales(blocks)
    bits = np.unpackbits(blocks[:, 2:], axis=-1, bitorder="little")  # value j = bit j % 8 of byte j / 8
    return np.where(bits == 1, d, -d)


def dequantize_q2_0(blocks):  # uint8 [n, 18] -> float32 [n, 64]: 2-bit q -> (q - 1) d, so -d, 0, d, 2d
    d = block_scales(blocks)
    q = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # value j = bits 2 (j % 4) of byte j / 4
    return (q.reshape(len(blocks), -1).astype(np.float32) - np.float32(1)) * d


EXTRA_DECODERS = {GGMLQuantizationType.Q1_0: dequantize_q1_0, GgmlType.Q2_0: dequantize_q2_0}


def dequantize_blocks(data, qtype, decode):  # uint8 [..., row_bytes] -> float32 [..., n_cols]
    block, size = EXTRA_SIZES[qtype]
    blocks = data.view(np.uint8).reshape(-1, size)
    return decode(blocks).reshape(*data.shape[:-1], data.shape[-1] // size * block)


# ---------------------------------------------------------------------------------------------
# The three roles

@dataclass
class GGUFModel:
    path: str
    role: str
    config: object
    weights: Weights
    meta: Metadata
    tokenizer: TokenizerConfig = None


ROLES = ("text", "mmproj", "dflash")


def role_of(meta):  # Metadata -> "text" | "mmproj" | "dflash" | description of something else
    arch = meta.str("general.architecture", required=True)
    if arch == "muse-glimmer":
        return "text"
    if arch == "dflash":
        return "dflash"
    if arch == "clip":
        return "mmproj"
    return f"architecture {arch!r}"


_ROLE_NAMES = {"text": "a muse-glimmer text model", "mmproj": "a muse-glimmer mmproj (clip)",
               "dflash": "a dflash drafter"}


def load(path, role, cache_bytes=DEFAULT_CACHE_BYTES):  # path, role -> GGUFModel (validated)
    path = os.fspath(path)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    try:
        reader = open_reader(path)
    except OSError as e:
        raise GGUFError(path, f"cannot read ({e.strerror or e})") from None
    meta = Metadata(reader, path)
    found = role_of(meta)
    if found != role:
        raise GGUFError(path, f"expected {_ROLE_NAMES[role]}, found {_ROLE_NAMES.get(found, found)}")
    weights = Weights(reader, path, cache_bytes)
    try:
        if role == "text":
            tokenizer = read_tokenizer(meta)
            config = read_text_config(meta)
            check_tensors(weights, text_tensor_shapes(config) if "blk.0.attn_qkv.weight" not in weights
                          else _fused_shapes(config), text_optional_shapes(config))
        elif role == "mmproj":
            tokenizer = None
            config = read_vision_config(meta)
            check_tensors(weights, vision_tensor_shapes(config, weights),
                          {PATCH_EMBD_T1: (config.n_embd, 3, config.patch_size, config.patch_size)})
            if config.temporal_patch_size and PATCH_EMBD_T1 not in weights:
                raise GGUFError(path, f"{TEMPORAL_PATCH_SIZE} is set but the tensor {PATCH_EMBD_T1} is missing")
        else:
            tokenizer = read_tokenizer(meta) if "tokenizer.ggml.tokens" in reader.fields else None
            config = read_draft_config(meta)
            check_tensors(weights, draft_tensor_shapes(config))
    except (ValueError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise GGUFError(path, f"bad metadata ({type(e).__name__}: {e})") from None
    return GGUFModel(path, role, config, weights, meta, tokenizer)


def _fused_shapes(c):
    shapes = text_tensor_shapes(c)
    for il in range(c.n_layer):
        for part in ("q", "k", "v"):
            del shapes[f"blk.{il}.attn_{part}.weight"]
    return shapes


def vision_tensor_shapes(c, weights):  # VisionConfig -> {name: shape}
    E, F, P = c.n_embd, c.n_ff, c.patch_size
    n_pos = weights.shape("v.position_embd.weight")[0] if "v.position_embd.weight" in weights else 0
    merged = E * c.merge_size * c.merge_size
    shapes = {"v.patch_embd.weight": (E, 3, P, P), "v.position_embd.weight": (n_pos, E),
              "v.pre_ln.weight": (E,), "v.pre_ln.bias": (E,), "v.post_ln.weight": (E,), "v.post_ln.bias": (E,)}
    for il in range(c.n_layer):
        b = f"v.blk.{il}."
        for ln in ("ln1", "ln2"):
            shapes[b + ln + ".weight"] = (E,)
            shapes[b + ln + ".bias"] = (E,)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[b + proj + ".weight"] = (E, E)
            shapes[b + proj + ".bias"] = (E,)
        shapes.update({b + "ffn_up.weight": (F, E), b + "ffn_up.bias": (F,),
                       b + "ffn_down.weight": (E, F), b + "ffn_down.bias": (E,)})
    if "mm.0.weight" in weights:
        hidden = weights.shape("mm.0.weight")[0]
        shapes["mm.0.weight"] = (hidden, merged)
        shapes["mm.1.weight"] = (hidden, hidden)
        shapes["mm.2.weight"] = (weights.shape("mm.2.weight")[0] if "mm.2.weight" in weights else 0, hidden)
    else:
        shapes["mm.0.weight"] = (0, merged)
    return shapes


def draft_tensor_shapes(c):  # DraftConfig -> {name: shape}
    E, F, D = c.n_embd, c.n_ff, c.head_dim
    q, kv = c.n_head * D, c.n_head_kv * D
    shapes = {"fc.weight": (E, len(c.target_layers) * E), "enc.output_norm.weight": (E,),
              "output_norm.weight": (E,)}
    for il in range(c.n_layer):
        b = f"blk.{il}."
        shapes.update({
            b + "attn_norm.weight": (E,), b + "attn_q.weight": (q, E), b + "attn_k.weight": (kv, E),
            b + "attn_v.weight": (kv, E), b + "attn_output.weight": (E, q),
            b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,), b + "ffn_norm.weight": (E,),
            b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E), b + "ffn_down.weight": (E, F),
        })
    return shapes
