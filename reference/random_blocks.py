"""Random but valid quantized GGUF blocks: random quant bits with the f16 scales set, so that a
weight matrix of any quantized type has a chosen standard deviation. tools.make_synthetic writes the
release layout from them; random_weights draws the op harnesses' weight tensors over the same scale
offsets.
"""
import numpy as np
from gguf import GGMLQuantizationType as Q, GGML_QUANT_SIZES
from gguf import quants

from .gguf.reader import EXTRA_SIZES

# byte offsets of the f16 super-block scales in each block (ggml-common.h block layouts)
F16_SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.IQ4_NL: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
                     Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,), Q.IQ3_XXS: (0,),
                     Q.IQ2_XXS: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.IQ1_S: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,),
                     Q.IQ3_S: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,)}


PROBE_BLOCKS = 64  # random blocks block_scale_for_unit_std calibrates on


def block_scale_for_unit_std(qtype):  # -> f16 scale that gives random blocks of this type std 1
    block, size = GGML_QUANT_SIZES[qtype]
    probe = np.random.default_rng(0).integers(0, 256, (PROBE_BLOCKS, size), dtype=np.uint8)
    set_scales(probe, qtype, 1.0)
    return 1.0 / float(np.std(quants.dequantize(probe.reshape(1, -1), qtype)))


def set_scales(blocks, qtype, scale):  # blocks [n, block_bytes] uint8, in place
    f16 = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    for off in F16_SCALE_OFFSETS[qtype]:
        blocks[:, off:off + 2] = f16


def random_rows(qtype, n_rows, n_cols, std, rng, unit_scale):  # -> raw rows [n_rows, row_bytes] uint8
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    set_scales(blocks, qtype, std * unit_scale)
    return blocks.reshape(n_rows, -1)


def random_weights(qtype, n_out, n_in, rng, scale_offsets=F16_SCALE_OFFSETS):  # -> floats, or blocks [n_out, row_bytes]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
        return w if qtype == Q.F32 else quants.quantize(w, qtype)
    block, size = {**GGML_QUANT_SIZES, **EXTRA_SIZES}[qtype]
    blocks = rng.integers(0, 256, (n_out * n_in // block, size), dtype=np.uint8)
    for o in scale_offsets.get(qtype, ()):  # scales around 1/(32 sqrt(n_in)): values of order 1/sqrt(n_in)
        scale = rng.uniform(0.5, 1.5, len(blocks)) / (32 * np.sqrt(n_in))
        blocks[:, o:o + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:
        set_iq1_m_scales(blocks, rng.uniform(0.5, 1.5, len(blocks)) / (32 * np.sqrt(n_in)))
    return blocks.reshape(n_out, -1)


def set_iq1_m_scales(blocks, scales):  # IQ1_M blocks [n, 56], scales [n]; in place
    # IQ1_M holds its f16 d in the top nibbles of its four u16 scales (bytes 48..55), lowest first
    packed = blocks[:, 48:].copy().view(np.uint16)
    nibbles = scales.astype(np.float16).view(np.uint16)[:, None] >> np.arange(0, 16, 4, dtype=np.uint16)
    blocks[:, 48:] = ((packed & 0x0FFF) | ((nibbles & 15) << 12)).view(np.uint8)
