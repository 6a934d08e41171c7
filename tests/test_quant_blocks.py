"""reference/quant_blocks.py: ggml's block structs as declared layouts, each size asserted at import
against gguf-py (an independent table); here the offsets against ggml-common.h's declarations as
gguf-py's own dequantizers read them."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GT, quants

from reference import quant_blocks
from reference.quant_blocks import BLOCKS, Q6_K, QuantBlock, declare


def test_every_block_is_gguf_pys_size():  # Q2_0, which gguf-py lacks: ggml-common.h:192's sizeof
    for name, block in BLOCKS.items():
        expected = GGML_QUANT_SIZES[GT[name]] if name in GT.__members__ else (64, 2 + 64 // 4)
        assert (block.elements, block.size) == expected, name


def test_a_wrong_layout_is_refused_at_declaration():
    with pytest.raises(AssertionError, match="block_q4_k: 256 elements in 143 bytes"):
        declare("Q4_K", 256, [("d", 2), ("dmin", 2), ("scales", 11), ("qs", 128)])


SCALE_FIELDS = ("d", "dmin", "m")  # the f16 factors every value of a block is linear in
DEQUANTIZED = sorted(set(BLOCKS) - {"IQ1_M", "Q8_K", "Q1_0", "Q2_0"})  # IQ1_M's scale is spread over its scales'
# nibbles; Q8_K is an activation type; gguf-py dequantizes neither it nor Q1_0 and Q2_0


@pytest.mark.parametrize("name", DEQUANTIZED)
def test_the_scale_fields_are_where_gguf_py_reads_them(name):
    """Random codes, the scale fields (d, dmin, m as f16; MXFP4's E8M0 exponent e) at the declared
    offsets: doubling them doubles every value gguf-py dequantizes, exactly. Bytes anywhere else are
    codes or sub-block scales, and changing them would not scale the row by exactly 2."""
    block = BLOCKS[name]
    raw = np.random.default_rng(7).integers(0, 256, block.size, dtype=np.uint8)
    halves = [getattr(block, f) for f in SCALE_FIELDS if hasattr(block, f)]

    def with_scale(k):  # the block with its f16 scale fields k (the MXFP4 exponent 2^(k - 1))
        out = raw.copy()
        if name == "MXFP4":
            out[block.e] = 127 + k
        for at in halves:
            out[at:at + 2] = np.frombuffer(np.float16(k).tobytes(), np.uint8)
        return quants.dequantize(out, GT[name])
    once, twice = with_scale(1), with_scale(2)
    assert np.abs(once).max() > 0
    np.testing.assert_array_equal(twice, 2 * once)


def test_q6_k_scales_and_ql_at_their_offsets():
    """Q6_K: value 0 = d * scales[0] * ((ql[0] & 15 | (qh[0] & 3) << 4) - 32)."""
    raw = np.zeros(Q6_K.size, np.uint8)
    raw[Q6_K.d:Q6_K.d + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    raw[Q6_K.scales] = 3
    raw[Q6_K.ql] = 5
    raw[Q6_K.qh] = 2
    assert quants.dequantize(raw, GT.Q6_K)[0] == 3 * ((5 | 2 << 4) - 32)


def test_the_table_is_the_modules_blocks():
    declared = {v.name for v in vars(quant_blocks).values() if isinstance(v, QuantBlock)}
    assert declared == set(BLOCKS)


def test_numba_reads_a_block_s_offsets_as_constants():
    from numba import njit

    @njit
    def scale_byte(row):  # a Q6_K block's first scale
        return row[Q6_K.scales] + Q6_K.size
    assert scale_byte(np.arange(Q6_K.size)) == Q6_K.scales + Q6_K.size == 192 + 210
