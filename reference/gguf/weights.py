"""A GGUF's tensors: they stay quantized in the memory map; `Weights.get` dequantizes one on demand
through gguf.quants (bit-exact with ggml), or for the two types of the pinned ggml that gguf-py lacks
(Q1_0, Q2_0) through decoders written from ggml's dequantize_row_*, and keeps a bounded LRU of
dequantized tensors, so a 30B file never needs to be dequantized whole. A `Tensor` is one of them
as the models hold it: a handle, resolved and shape-checked once at load (tensors.py), read through
its Weights.
"""
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants

from .reader import EXTRA_SIZES, GGUFError, GgmlType

DEFAULT_CACHE_BYTES = 2 << 30


class Tensor(NamedTuple):
    """One tensor of a GGUF, as a model's record of its tensors holds it (llama.cpp's
    `struct ggml_tensor *` in a llama_layer): its Weights and name, no decoded data of its own."""
    weights: object  # Weights
    name: str

    @property
    def shape(self):  # NumPy shape (reversed ggml ne)
        return self.weights.shape(self.name)

    @property
    def tensor_type(self):  # a GGMLQuantizationType, or a GgmlType gguf-py lacks
        return self.weights.tensors[self.name].tensor_type

    @property
    def type_name(self):
        return self.tensor_type.name

    @property
    def raw(self):  # the bytes/values as stored, memory-mapped
        return self.weights.raw(self.name)

    def get(self, dtype=np.float32):  # -> dequantized array of self.shape, through the Weights' cache
        return self.weights.get(self.name, dtype)

    def rows(self, ids, dtype=np.float32):  # ids [T] or a slice -> [T, n_cols], only those rows
        return self.weights.rows(self.name, ids, dtype)

    def dense_bytes(self, dtype):  # bytes it takes once dequantized to dtype
        return self.weights.dense_bytes(self.name, dtype)


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

    def tensor(self, name):  # name -> Tensor, the handle a forward reads it through
        self._tensor(name)
        return Tensor(self, name)

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


class UnsupportedTensorType(Exception):
    """A tensor of a type this reference cannot read: a file that is valid, only not for us."""


def unsupported(qtype, name):  # the one refusal of a type, by its name
    return f"unsupported tensor type {qtype.name} in tensor {name}"


def decodable(qtype):  # a GGMLQuantizationType or GgmlType -> can dequantize() decode it?
    return qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or \
        qtype in quants._type_traits or qtype in EXTRA_DECODERS


# ---------------------------------------------------------------------------------------------
# The two types of the pinned ggml that gguf-py 0.19.0 cannot decode (Q1_0) or does not know (Q2_0):
# their values from ggml-quants.c dequantize_row_*

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
