"""ggml's quant block structs (ggml/src/ggml-common.h:181-460), one declared layout per type: each
field's byte offset by name, the block's size (numba kernels read them as compile-time constants). The decoders and kernels read `Q4_K.qs + 32 * p`
where they would otherwise write 16 + 32 * p; each size is asserted at import against gguf-py's
GGML_QUANT_SIZES, as ggml asserts sizeof(block_q4_K).

Fields are (name, bytes) in declaration order; ggml's unions of d and dmin (ggml_half2 dm) are
their two halves. IQ3_XXS declares one qs[3 * QK_K / 8]; its last QK_K / 8 bytes are what
dequantize_row_iq3_xxs reads as scales_and_signs = qs + QK_K/4 (ggml-quants.c), named so here.
Q8_1 (an activation type, never in a file) is left out: gguf-py sizes it 40 bytes (float d, s),
ggml-common.h:259-269 36 (ggml_half2 ds)."""
from collections import namedtuple
from types import SimpleNamespace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
HALF = 2  # ggml_half


class QuantBlock:
    """What every block struct has besides its offsets: its type's `name`, `fields` ((name, bytes) in
    order) and the views of its fields. Each struct is a namedtuple of ints (each field's offset,
    `size`, `elements`) with this as its base, so numba's compiled code reads `Q4_K.qs` as a constant."""
    __slots__ = ()
    name, fields = "", ()

    def of(self, blocks):  # uint8 [..., size] -> its fields by name, each uint8 [..., bytes] (views)
        return SimpleNamespace(**{field: blocks[..., getattr(self, field):getattr(self, field) + nbytes]
                                  for field, nbytes in self.fields})

    def __repr__(self):
        return f"block_{self.name}({', '.join(f'{f}@{getattr(self, f)}' for f, _ in self.fields)}; {self.size} B)"


def declare(name, elements, fields, size=None):  # -> the QuantBlock of ggml's block_<name>
    """fields: (name, bytes) in declaration order. size: ggml's static_assert for a type gguf-py does
    not know; otherwise gguf-py's size is the check."""
    offsets, at = [], 0
    for _, nbytes in fields:
        offsets.append(at)
        at += nbytes
    expected = GGML_QUANT_SIZES[GGMLQuantizationType[name]] if size is None else (elements, size)
    if (elements, at) != expected:
        raise AssertionError(f"block_{name.lower()}: {elements} elements in {at} bytes, "
                             f"{'gguf-py' if size is None else 'ggml'} says {expected}")
    struct = namedtuple(f"block_{name}", [f for f, _ in fields] + ["size", "elements"])
    block = type(f"block_{name}", (QuantBlock, struct), {"__slots__": (), "name": name, "fields": tuple(fields)})
    return block(*offsets, at, elements)


Q1_0 = declare("Q1_0", 128, [("d", HALF), ("qs", 128 // 8)])
Q2_0 = declare("Q2_0", 64, [("d", HALF), ("qs", 64 // 4)], size=HALF + 64 // 4)  # ggml-common.h:188-192
Q4_0 = declare("Q4_0", 32, [("d", HALF), ("qs", 16)])
Q4_1 = declare("Q4_1", 32, [("d", HALF), ("m", HALF), ("qs", 16)])
Q5_0 = declare("Q5_0", 32, [("d", HALF), ("qh", 4), ("qs", 16)])
Q5_1 = declare("Q5_1", 32, [("d", HALF), ("m", HALF), ("qh", 4), ("qs", 16)])
Q8_0 = declare("Q8_0", 32, [("d", HALF), ("qs", 32)])
Q2_K = declare("Q2_K", QK_K, [("scales", QK_K // 16), ("qs", QK_K // 4), ("d", HALF), ("dmin", HALF)])
Q3_K = declare("Q3_K", QK_K, [("hmask", QK_K // 8), ("qs", QK_K // 4), ("scales", 12), ("d", HALF)])
Q4_K = declare("Q4_K", QK_K, [("d", HALF), ("dmin", HALF), ("scales", 12), ("qs", QK_K // 2)])
Q5_K = declare("Q5_K", QK_K, [("d", HALF), ("dmin", HALF), ("scales", 12), ("qh", QK_K // 8), ("qs", QK_K // 2)])
Q6_K = declare("Q6_K", QK_K, [("ql", QK_K // 2), ("qh", QK_K // 4), ("scales", QK_K // 16), ("d", HALF)])
Q8_K = declare("Q8_K", QK_K, [("d", 4), ("qs", QK_K), ("bsums", QK_K // 16 * 2)])
IQ2_XXS = declare("IQ2_XXS", QK_K, [("d", HALF), ("qs", QK_K // 8 * 2)])
IQ2_XS = declare("IQ2_XS", QK_K, [("d", HALF), ("qs", QK_K // 8 * 2), ("scales", QK_K // 32)])
IQ2_S = declare("IQ2_S", QK_K, [("d", HALF), ("qs", QK_K // 4), ("qh", QK_K // 32), ("scales", QK_K // 32)])
IQ3_XXS = declare("IQ3_XXS", QK_K, [("d", HALF), ("qs", QK_K // 4), ("scales_and_signs", QK_K // 8)])
IQ3_S = declare("IQ3_S", QK_K, [("d", HALF), ("qs", QK_K // 4), ("qh", QK_K // 32), ("signs", QK_K // 8),
                                   ("scales", QK_K // 64)])
IQ1_S = declare("IQ1_S", QK_K, [("d", HALF), ("qs", QK_K // 8), ("qh", QK_K // 32 * 2)])
IQ1_M = declare("IQ1_M", QK_K, [("qs", QK_K // 8), ("qh", QK_K // 16), ("scales", QK_K // 32)])
IQ4_NL = declare("IQ4_NL", 32, [("d", HALF), ("qs", 16)])
IQ4_XS = declare("IQ4_XS", QK_K, [("d", HALF), ("scales_h", 2), ("scales_l", QK_K // 64), ("qs", QK_K // 2)])
TQ1_0 = declare("TQ1_0", QK_K, [("qs", (QK_K - 4 * QK_K // 64) // 5), ("qh", QK_K // 64), ("d", HALF)])
TQ2_0 = declare("TQ2_0", QK_K, [("qs", QK_K // 4), ("d", HALF)])
MXFP4 = declare("MXFP4", 32, [("e", 1), ("qs", 16)])

BLOCKS = {b.name: b for b in (Q1_0, Q2_0, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ2_XXS,
                              IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4)}
