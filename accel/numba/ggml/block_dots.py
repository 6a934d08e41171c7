"""The vec_dots of reference/ggml_cpu/int_dots.py (k_vec_dot, q0_lanes) on the GGUF's own block bytes,
where they lie in the memory-mapped tensor: no decoded copy of a matrix is made. Each block is
unpacked in vector registers as ggml's vec_dot unpacks it (nibbles, grids with their signs, 5th and
6th bits; with AVX512-VBMI the IQ2_XXS/IQ3_XXS grids and signs by register permutes, no table
read), 64 elements at a time, into one 512-bit vpdpbusd against the Q8_K activations; the
integer lanes are the reference's exact integers and the float epilogue runs in its order.

raw: uint8 [O, row bytes], the tensor as stored (rows of nb blocks). The lanes of a 64-element part
are vpdpbusd's 16 int32 lanes: lanes 0-7 the first 32-chunk's k_vec_dot lanes (4 neighbours each),
8-15 the second's; scaled, summed over the block's 4 parts and folded to the 8 lanes."""
import functools
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import binding as llvm, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from reference.ggml_cpu.blocks import KVALUES_IQ4NL, iq_grid
from reference.quant_blocks import IQ2_XXS, IQ3_XXS, IQ4_XS, Q4_K, Q5_K, Q6_K, Q8_0, QuantBlock

from . import int_dots
from ..operands import operands
from .int_dots import I8X64, I32X16, dpbusd, load_at, splat, store_at, vector_fma
from .quantize import quantize_q8_0, quantize_q8_k
from .rounding import fma32, hsum8

F32 = np.float32
I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
I8X32 = ir.VectorType(I8, 32)
I32X8 = ir.VectorType(I32, 8)


@functools.lru_cache(maxsize=None)
def tables(kind):  # -> (grid, signs): the lookup tables a type's unpacking reads (empty where it has none)
    """IQ2_XXS: grid uint64 [256] (8 unsigned values an entry); IQ3_XXS: uint32 [256] (4 values);
    signs uint64 [128]: keven_signs as byte masks, 0xFF where the element is negated; IQ4_XS:
    kvalues_iq4nl as int8 [16]."""
    from gguf import quants
    none = np.zeros(1, np.uint8)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    masks = (np.unpackbits(ksigns[:, None], axis=1, bitorder="little") * 255).astype(np.uint8)
    signs = np.ascontiguousarray(masks).view(np.uint64)[:, 0]
    if kind == "IQ2_XXS":
        return np.ascontiguousarray(iq_grid(quants.IQ2_XXS).astype(np.uint8)).view(np.uint64)[:, 0], signs
    if kind == "IQ3_XXS":
        return np.ascontiguousarray(iq_grid(quants.IQ3_XXS).astype(np.uint8)).view(np.uint32)[:, 0], signs
    if kind == "IQ4_XS":
        return KVALUES_IQ4NL.astype(np.int8), none
    return none, none


def constant(ty, v):
    return ir.Constant(ty, v)


def shuffle(builder, a, b, indices):  # shufflevector with constant i32 indices
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(indices)), list(indices)))


def concat(builder, a, b):  # two <n x T> -> <2n x T>
    return shuffle(builder, a, b, range(2 * a.type.count))


def splat8(builder, x, n):  # an i8 constant -> <n x i8>
    return ir.Constant(ir.VectorType(I8, n), [x] * n)


def table_entry(builder, table, index, ty):  # table i8* of entries of type ty, index an i8 (zero-extended) -> entry
    at = builder.gep(builder.bitcast(table, ty.as_pointer()), [builder.zext(index, I64)])
    return builder.load(at, align=1)


def byte_at(builder, block, offset):
    return load_at(builder, block, offset, I8)


def sign_split(builder, values):  # signed <64 x i8> values -> (|v|, mask 0xFF where v < 0)
    """|v| times q with v's sign moved onto q (psignb's trick, as ggml's mul_add_epi8): exact, |q| <= 127."""
    negative = builder.icmp_signed("<", values, ir.Constant(I8X64, None))
    return builder.select(negative, builder.sub(ir.Constant(I8X64, None), values), values), builder.sext(negative, I8X64)


def signed(builder, q, mask):  # q with the elements under mask (0xFF bytes, or <64 x i1>) negated; mask None: q
    if mask is None:
        return q
    if mask.type.element == I1:  # AVX-512: one masked vpsubb
        return builder.select(mask, builder.sub(ir.Constant(q.type, None), q), q)
    return builder.sub(builder.xor(q, mask), mask)


def iq_xxs_part(entry_ty, entries_per_8, aux_offset, aux_step):
    """IQ2_XXS (i64 entries of 8 values, aux words after each chunk's 4 grid bytes) and IQ3_XXS (i32
    entries of 4 values, 8 grid bytes a chunk, aux words after all 64): grid values >= 0, the
    ksigns of its 8-groups as the mask that negates q. Both have their grid bytes at qs (byte 2),
    8 a chunk."""
    per_chunk = 4 * entries_per_8

    def part(builder, block, grid, signs, p):  # -> (unsigned values, sign mask) <64 x i8> of elements 64p..64p+63
        vec_ty = ir.VectorType(entry_ty, 64 * 8 // entry_ty.width)
        values, masks = ir.Constant(vec_ty, None), ir.Constant(ir.VectorType(I64, 8), None)
        for half in range(2):
            c = 2 * p + half
            aux = load_at(builder, block, aux_offset + aux_step * c, I32)
            for e in range(per_chunk):
                index = byte_at(builder, block, IQ2_XXS.qs + 8 * c + e)
                values = builder.insert_element(values, table_entry(builder, grid, index, entry_ty),
                                                constant(I32, per_chunk * half + e))
            for g in range(4):
                sign_index = builder.trunc(builder.and_(builder.lshr(aux, constant(I32, 7 * g)), constant(I32, 127)), I8)
                masks = builder.insert_element(masks, table_entry(builder, signs, sign_index, I64),
                                               constant(I32, 4 * half + g))
        return builder.bitcast(values, I8X64), builder.bitcast(masks, I8X64)
    return part


# With AVX512-VBMI the grids and the signs are unpacked in registers, no table in memory read: as
# each IQ2_XXS grid value is one of 3 levels and each IQ3_XXS value one of 8, a grid entry is a
# 16-bit code of 2- or 3-bit level numbers, the 256 codes 8 registers that vpermi2w looks up 32
# entries at once; vpmultishiftqb moves each value's level number into a byte and vpermb turns it
# into the level. The 7-bit sign indices are moved into bytes by vpmultishiftqb too, and vpermi2b
# looks them up in keven_signs (128 bytes, 2 registers): a block's 32 sign bytes, the masks of 4
# masked vpsubb.
VBMI = numba.config.CPU_NAME is None and llvm.get_host_cpu_features().get("avx512vbmi", False)


def x86_call(builder, name, ty, args):  # an AVX-512 intrinsic of result type ty on args
    return builder.call(builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ty, [a.type for a in args])), args)


def multishift(builder, data, offsets):  # <8 x i64> data -> <64 x i8>: byte j of qword w is data[w] >> offsets[j] (8 bits)
    control = ir.Constant(I8X64, [offsets[j % 8] for j in range(64)])
    return x86_call(builder, "llvm.x86.avx512.pmultishift.qb.512", I8X64, [control, builder.bitcast(data, I8X64)])


def permute_bytes(builder, table, codes):  # <64 x i8> table, codes -> table[codes & 63] (vpermb)
    return x86_call(builder, "llvm.x86.avx512.permvar.qi.512", I8X64, [table, codes])


def lookup_words(builder, table, indices):  # <256 x i16> constant table, <32 x i16> indices 0..255 -> table[indices]
    """vpermi2w looks up 64 entries (2 registers) by the index's low 6 bits; bits 6 and 7 pick among the 4 lookups."""
    ty = ir.VectorType(I16, 32)
    quarter = [x86_call(builder, "llvm.x86.avx512.vpermi2var.hi.512", ty,
                        [ir.Constant(ty, table[64 * k:64 * k + 32]), indices, ir.Constant(ty, table[64 * k + 32:64 * k + 64])])
               for k in range(4)]
    bit = lambda b: builder.icmp_unsigned("!=", builder.and_(indices, ir.Constant(ty, [b] * 32)), ir.Constant(ty, None))
    low, high = (builder.select(bit(64), quarter[2 * h + 1], quarter[2 * h]) for h in range(2))
    return builder.select(bit(128), high, low)


def even_sign_bytes(builder, aux):  # <8 x i64>: chunk c's aux word in the low 32 bits of qword c -> <4 x i64> sign masks
    """Qword p is the mask of part p: bit 8k + i negates element 64p + 8k + i, keven_signs of the
    7-bit index (aux >> 7g) & 127 of 8-group g = k % 4 of chunk 2p + k // 4."""
    indices = multishift(builder, aux, [0, 7, 14, 21, 0, 0, 0, 0])  # vpermi2b reads the low 7 bits
    words = builder.trunc(builder.bitcast(indices, ir.VectorType(I64, 8)), ir.VectorType(I32, 8))
    compact = shuffle(builder, builder.bitcast(words, I8X32), ir.Constant(I8X32, None), range(64))
    from gguf import quants
    ksigns = list(quants.IQ2_XXS.ksigns)
    signs = x86_call(builder, "llvm.x86.avx512.vpermi2var.qi.512", I8X64,
                     [ir.Constant(I8X64, ksigns[:64]), compact, ir.Constant(I8X64, ksigns[64:])])
    return builder.bitcast(shuffle(builder, signs, signs, range(32)), ir.VectorType(I64, 4))


def level_codes(kind):  # -> (256 codes: the grid entry's level numbers, bits each, the levels)
    grid, _ = tables(kind)
    values = grid.view(np.uint8).reshape(256, -1)
    levels = np.unique(values)
    bits = int(len(levels) - 1).bit_length()
    codes = (np.searchsorted(levels, values).astype(np.int64) << (bits * np.arange(values.shape[1]))).sum(-1)
    return codes.tolist(), bits, levels.tolist()


def iq_xxs_vbmi_parts(kind, aux_at):
    """The 4 parts of an IQ2_XXS or IQ3_XXS block (values and <64 x i1> sign masks), unpacked in
    registers. aux_at(builder, block) -> <8 x i64>, chunk c's aux word in qword c's low 32 bits."""
    codes, bits, levels = level_codes(kind)
    per_entry = 8 if kind == "IQ2_XXS" else 4  # values a grid entry holds
    number = lambda j: j & ((1 << bits) - 1)  # the level number in a byte's low bits
    level_of = ir.Constant(I8X64, [levels[number(j)] if number(j) < len(levels) else 0 for j in range(64)])

    def parts(builder, block, _, __):
        if kind == "IQ2_XXS":  # 4 grid bytes, then the aux word, a chunk
            qs = load_at(builder, block, IQ2_XXS.qs, ir.VectorType(I64, 8))
            indices = builder.bitcast(builder.trunc(qs, ir.VectorType(I32, 8)), I8X32)
        else:
            indices = load_at(builder, block, IQ3_XXS.qs, I8X64)
        wide = builder.zext(indices, ir.VectorType(I16, indices.type.count))
        entry_codes = [lookup_words(builder, codes, shuffle(builder, wide, wide, range(32 * h, 32 * h + 32)))
                       for h in range(indices.type.count // 32)]
        masks = even_sign_bytes(builder, aux_at(builder, block))
        out, n = [], 64 // per_entry  # entries a part: one a qword (IQ2_XXS) or a dword (IQ3_XXS)
        for p in range(4):
            # each entry's code into every word of its qword or dword (one vpermw): the level numbers
            # vpermb reads stay below the code's copies above it, which fall in bits vpermb ignores
            first = n * p % 32
            spread = ir.Constant(ir.VectorType(I16, 32), [first + w * n // 32 for w in range(32)])
            packed = builder.bitcast(x86_call(builder, "llvm.x86.avx512.permvar.hi.512", ir.VectorType(I16, 32),
                                              [entry_codes[n * p // 32], spread]), ir.VectorType(I64, 8))
            offsets = [bits * (j % per_entry) + 32 * (j // per_entry) for j in range(8)]
            values = permute_bytes(builder, level_of, multishift(builder, packed, offsets))
            mask = builder.bitcast(builder.extract_element(masks, constant(I32, p)), ir.VectorType(I1, 64))
            out.append((values, mask))
        return out
    return parts


def iq2_xxs_aux(builder, block):  # the aux word sits in the high half of each chunk's 8 bytes
    return builder.lshr(load_at(builder, block, IQ2_XXS.qs, ir.VectorType(I64, 8)), ir.Constant(ir.VectorType(I64, 8), [32] * 8))


def iq3_xxs_aux(builder, block):  # the 8 aux words after the grid bytes
    return builder.zext(load_at(builder, block, IQ3_XXS.scales_and_signs, ir.VectorType(I32, 8)), ir.VectorType(I64, 8))


def per_part(part):  # a type's part function -> the block's parts function
    return lambda builder, block, grid, signs: [part(builder, block, grid, signs, p) for p in range(4)]


def nibbles_of(builder, packed):  # <32 x i8> -> (low nibbles, high nibbles) <32 x i8>
    return builder.and_(packed, splat8(builder, 15, 32)), builder.lshr(packed, splat8(builder, 4, 32))


def iq4_xs_part(builder, block, kvalues, _, p):
    """16 bytes a 32-chunk: low nibbles its elements 0-15, high nibbles 16-31; kvalues by vpshufb
    (a 16-entry table lookup, kvalues_iq4nl broadcast), the sign moved onto q."""
    low, high = nibbles_of(builder, load_at(builder, block, IQ4_XS.qs + 32 * p, I8X32))
    codes = concat(builder, shuffle(builder, low, high, list(range(16)) + list(range(32, 48))),
                   shuffle(builder, low, high, list(range(16, 32)) + list(range(48, 64))))
    table = load_at(builder, kvalues, 0, ir.VectorType(I8, 16))
    values = lookup16(builder, shuffle(builder, table, table, list(range(16)) * 4), codes)
    return sign_split(builder, values)


def lookup16(builder, table, codes):  # <64 x i8> table (16 entries, 4 times), codes 0..15 -> table[codes]
    if int_dots.VPDPBUSD:  # AVX512-VNNI has AVX512BW's vpshufb (read at compile time, as dpbusd reads it)
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.pshuf.b.512", fnty=ir.FunctionType(I8X64, [I8X64, I8X64]))
        return builder.call(fn, [table, codes])
    out = ir.Constant(I8X64, None)
    for k in range(16):  # elsewhere one select per entry
        entry = shuffle(builder, table, table, [k] * 64)
        out = builder.select(builder.icmp_unsigned("==", codes, splat8(builder, k, 64)), entry, out)
    return out


def q4_k_part(builder, block, _, __, p):  # 32 bytes: low nibbles chunk 2p, high nibbles chunk 2p + 1
    low, high = nibbles_of(builder, load_at(builder, block, Q4_K.qs + 32 * p, I8X32))
    return concat(builder, low, high), None


def q5_k_part(builder, block, _, __, p):  # as Q4_K, plus bit c of qh[i] as 16 for element i of chunk c
    low, high = nibbles_of(builder, load_at(builder, block, Q5_K.qs + 32 * p, I8X32))
    qh = load_at(builder, block, Q5_K.qh, I8X32)
    fifth = [builder.shl(builder.and_(builder.lshr(qh, splat8(builder, c, 32)), splat8(builder, 1, 32)),
                         splat8(builder, 4, 32)) for c in (2 * p, 2 * p + 1)]
    return concat(builder, builder.or_(low, fifth[0]), builder.or_(high, fifth[1])), None


def q6_k_part(builder, block, _, __, p):
    """Half h = p // 2 of 128 elements: ql[64h:64h+64], qh[32h:32h+32]; part 2h takes the low nibbles
    of ql's two 32s with qh's bits 0-1 and 2-3, part 2h + 1 the high nibbles with bits 4-5 and 6-7."""
    h, upper = divmod(p, 2)
    qh = load_at(builder, block, Q6_K.qh + 32 * h, I8X32)
    pieces = []
    for k in range(2):
        ql = load_at(builder, block, Q6_K.ql + 64 * h + 32 * k, I8X32)
        nibble = nibbles_of(builder, ql)[upper]
        bits = builder.and_(builder.lshr(qh, splat8(builder, 4 * upper + 2 * k, 32)), splat8(builder, 3, 32))
        pieces.append(builder.or_(nibble, builder.shl(bits, splat8(builder, 4, 32))))
    return concat(builder, *pieces), None


def vbmi_or(vbmi_parts, parts):  # -> the VBMI unpacking where the CPU has it (and AVX512-VNNI), read when a kernel compiles
    return lambda builder, block, grid, signs: (vbmi_parts if VBMI and int_dots.VPDPBUSD else parts)(builder, block, grid, signs)


PARTS = {kind: per_part(part) for kind, part in (
    ("IQ4_XS", iq4_xs_part), ("Q4_K", q4_k_part), ("Q5_K", q5_k_part), ("Q6_K", q6_k_part))}
PARTS.update(IQ2_XXS=vbmi_or(iq_xxs_vbmi_parts("IQ2_XXS", iq2_xxs_aux), per_part(iq_xxs_part(I64, 1, IQ2_XXS.qs + 4, 8))),
             IQ3_XXS=vbmi_or(iq_xxs_vbmi_parts("IQ3_XXS", iq3_xxs_aux),
                             per_part(iq_xxs_part(I32, 2, IQ3_XXS.scales_and_signs, 4))))


# ---------------------------------------------------------------------------------------------
# Each type's block scales (8, or 16 for Q6_K) and mins, read from the block's bytes into vector
# registers: the kernels multiply by them without a trip through memory (a vector load of scales
# just stored one by one cannot be forwarded from the stores and waits for them to reach the cache)

def u8_at(builder, block, offset):  # the byte at offset as a zero-extended i32
    return builder.zext(byte_at(builder, block, offset), I32)


def shr_and(builder, v, shift, mask):  # (v >> shift) & mask, i32
    return builder.and_(builder.lshr(v, constant(I32, shift)), constant(I32, mask))


def vector_of(builder, values):  # i32 scalars -> <n x i32>
    out = ir.Constant(ir.VectorType(I32, len(values)), None)
    for i, v in enumerate(values):
        out = builder.insert_element(out, v, constant(I32, i))
    return out


def aux_scales(aux_at):  # IQ2_XXS/IQ3_XXS: 2 * (aux >> 28) + 1, the top nibble of each chunk's aux word
    def scales(builder, block):  # -> (<8 x i32> scales, None): one vector shift of the 8 aux words
        nibbles = builder.trunc(builder.lshr(aux_at(builder, block), ir.Constant(ir.VectorType(I64, 8), [28] * 8)), I32X8)
        return builder.or_(builder.shl(nibbles, ir.Constant(I32X8, [1] * 8)), ir.Constant(I32X8, [1] * 8)), None
    return scales


def iq4_xs_scales(builder, block):  # 4 low bits from scales_l, 2 high from the u16 scales_h, minus 32
    high = builder.or_(u8_at(builder, block, IQ4_XS.scales_h),
                       builder.shl(u8_at(builder, block, IQ4_XS.scales_h + 1), constant(I32, 8)))
    out = []
    for j in range(8):
        low = shr_and(builder, u8_at(builder, block, IQ4_XS.scales_l + j // 2), 4 * (j % 2), 15)
        top = builder.shl(shr_and(builder, high, 2 * j, 3), constant(I32, 4))
        out.append(builder.sub(builder.or_(low, top), constant(I32, 32)))
    return vector_of(builder, out), None


def k4_scales(builder, block):  # get_scale_min_k4 of the 12 scales bytes (Q4_K, Q5_K) -> (<8 x i32>, <8 x i32>)
    """Four bytes at a time, as ggml's vec_dot does it with kmask1-3 on the three words: scales 0-3
    and mins 0-3 are the low 6 bits of words 0 and 1; scales and mins 4-7 take the nibbles of word 2
    and the top 2 bits of words 0 and 1. Q4_K and Q5_K both hold them at byte 4."""
    w0, w1, w2 = (load_at(builder, block, Q4_K.scales + 4 * i, I32) for i in range(3))
    low6, nibble, top2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    high = lambda nibbles, word: builder.or_(nibbles, builder.shl(shr_and(builder, word, 6, top2), constant(I32, 4)))
    words = [builder.and_(w0, constant(I32, low6)), high(builder.and_(w2, constant(I32, nibble)), w0),
             builder.and_(w1, constant(I32, low6)), high(shr_and(builder, w2, 4, nibble), w1)]
    both = builder.zext(builder.bitcast(vector_of(builder, words), ir.VectorType(I8, 16)), I32X16)
    return shuffle(builder, both, both, range(8)), shuffle(builder, both, both, range(8, 16))


def q6_k_scales(builder, block):  # the 16 int8 scales
    return builder.sext(load_at(builder, block, Q6_K.scales, ir.VectorType(I8, 16)), I32X16), None


SCALES = {"IQ2_XXS": aux_scales(iq2_xxs_aux), "IQ3_XXS": aux_scales(iq3_xxs_aux),
          "IQ4_XS": iq4_xs_scales, "Q4_K": k4_scales, "Q5_K": k4_scales, "Q6_K": q6_k_scales}


def scale_vector(builder, scales, p):  # the block's <n x i32> scales -> <16 x i32>: part p's lanes' scales
    per = scales.type.count // 4  # a part's 16 lanes cover 64 elements: 2 scales of 32 or 4 of 16
    return shuffle(builder, scales, scales, [p * per + lane * per // 16 for lane in range(16)])


def elements(builder, v):  # <n x i32> -> its n i32 scalars
    return [builder.extract_element(v, constant(I32, i)) for i in range(v.type.count)]


def of_kind(fn, kind):  # an intrinsic's typing function -> the intrinsic, named for its type
    """numba tells intrinsics apart by name: the kinds' intrinsics under one name could load one
    another's code from the cache in a new process, as glibc_call's once did (libm.py)."""
    fn.__name__ = fn.__qualname__ = f"{fn.__name__}_{kind}"
    return intrinsic(fn)


def row_dot_intrinsic(kind):
    """The intrinsic sums f32 [12] <- row o of the weights against activation row t, block after
    block, as ggml_vec_dot_*_q8_K runs it (reference k_vec_dot): per block the 8 int32 lanes, lane
    l = sum over the 32-chunks c of scale(c, l) * sum_i code[32c + 4l + i] * q[t, b, 32c + 4l + i]
    with the codes as the type stores them, a type with an unsigned offset (Q6_K's 32) taking it off
    lane l through its pair of 16-sums, offset * (scale[2l] * bsums[t, b, 2l] + scale[2l + 1] *
    bsums[t, b, 2l + 1]); then acc = fma(d * d_a, f32(lanes), acc) and, for the types with mins,
    summs = fma(-d_a * dmin, f32(sum of mins times 32-sums), summs) on min_lanes lanes (Q4_K's pairs
    of sub-blocks, Q5_K's one sum). The accumulators stay in registers over the row; sums[:8] gets
    acc, sums[8:] summs. int32 exact: |scale * code * q| <= 127 * 127 * 127 and 32 of those a lane."""
    parts, read_scales = PARTS[kind], SCALES[kind]
    layout, offset, min_lanes = TYPES[kind].block, TYPES[kind].offset, TYPES[kind].min_lanes
    f32x8, f32xm = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.FloatType(), min_lanes)

    def row_dot(typingctx, raw, o, t, aq, ad, bsums, sums32, grid, signs, sums):
        def codegen(context, builder, signature, args):
            a = operands(row_dot, context, builder, signature, args)
            t_ = a.t.index()
            row = a.raw.at([a.o.index()])
            grid_, signs_ = a.grid.at([]), a.signs.at([])
            n_blocks = a.ad.shape(1)
            acc = cgutils.alloca_once_value(builder, ir.Constant(f32x8, None))
            summs = cgutils.alloca_once_value(builder, ir.Constant(f32xm, None))
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                block = builder.gep(row, [builder.mul(b, constant(b.type, layout.size))])
                acts = a.aq.at([t_, b])
                scales, mins = read_scales(builder, block)
                total = ir.Constant(I32X16, None)
                for p, (u, mask) in enumerate(parts(builder, block, grid_, signs_)):
                    four = dpbusd(builder, ir.Constant(I32X16, None), u, signed(builder, load_at(builder, acts, 64 * p, I8X64), mask))
                    total = builder.add(total, builder.mul(four, scale_vector(builder, scales, p)))
                lanes = builder.add(shuffle(builder, total, total, range(8)), shuffle(builder, total, total, range(8, 16)))
                if offset:
                    sums16 = load_at(builder, a.bsums.at([t_, b]), 0, I32X16)
                    weighted = builder.mul(sums16, scales)
                    pairs = builder.add(shuffle(builder, weighted, weighted, range(0, 16, 2)),
                                        shuffle(builder, weighted, weighted, range(1, 16, 2)))
                    lanes = builder.sub(lanes, builder.mul(pairs, ir.Constant(I32X8, [offset] * 8)))
                d_act = load_at(builder, a.ad.at([t_, b]), 0, ir.FloatType())
                d = builder.fmul(f16_of(builder, block, layout.d), d_act)
                builder.store(vector_fma(builder, splat(builder, d, 8), builder.sitofp(lanes, f32x8), builder.load(acc)), acc)
                if mins is not None:
                    dm = builder.fmul(builder.fneg(d_act), f16_of(builder, block, layout.dmin))
                    sums = load_at(builder, a.sums32.at([t_, b]), 0, I32X8)
                    products = builder.mul(mins, sums)
                    per_lane = 8 // min_lanes
                    mn = shuffle(builder, products, products, range(0, 8, per_lane))
                    for i in range(1, per_lane):
                        mn = builder.add(mn, shuffle(builder, products, products, range(i, 8, per_lane)))
                    builder.store(vector_fma(builder, splat(builder, dm, min_lanes), builder.sitofp(mn, f32xm), builder.load(summs)),
                                  summs)
            out = a.sums.at([])
            store_at(builder, out, 0, builder.load(acc))
            store_at(builder, out, 32, builder.load(summs))
            return context.get_dummy_value()
        if (raw.ndim == 2 and aq.ndim == 3 and aq.dtype == types.int8 and ad.ndim == 2 and ad.dtype == types.float32
                and bsums.ndim == sums32.ndim == 3 and bsums.dtype == sums32.dtype == types.int32
                and sums.ndim == 1 and sums.dtype == types.float32
                and all(a.layout == "C" for a in (raw, aq, ad, bsums, sums32, grid, signs, sums))):
            return types.none(raw, o, t, aq, ad, bsums, sums32, grid, signs, sums), codegen
    return of_kind(row_dot, kind)


def f16_of(builder, block, offset):  # the little-endian half at byte offset after block (i8*) -> f32, exact (vcvtph2ps)
    return builder.fpext(builder.bitcast(load_at(builder, block, offset, ir.IntType(16)), ir.HalfType()), ir.FloatType())


TILE = 16  # activation rows a tile takes: one int32 lane each, as the columns of llama.cpp's tiled kernel


BAND = 8  # weight rows tile_dots takes at once: each activation load serves all of them (tiled-kernel.cpp's NUM_ROWS)


def tile_dots_intrinsic(kind):
    """The intrinsic out f32 [ROWS_PER_TASK, G * TILE] (rows at..at + BAND - 1: the sums of weight
    rows o..o + BAND - 1, for every activation row) += block b of those rows against every tile g of TILE activation rows, the way llama.cpp's
    tiled kernel lays the product out (tiled-kernel.cpp:100-195): each block unpacked once into 256
    unsigned codes (value + 128 for the signed types; Q6_K's stored +32 kept), 4 codes broadcast
    against 4 elements of each of the TILE rows per vpdpbusd, so each lane is one row's sum, one
    load of 4 elements of the TILE rows serving the BAND weight rows; per sub-block the codes' bias
    times the rows' sub-block sums taken off and the scale multiplied in. Its s1 is the exact
    integer the vec_dot lanes sum to. Then per lane, as the tiled epilogue: r = f32(s1) * d0 with
    d0 = d * post, r = fma(-dmin, f32(s2), r) with s2 = sum of mins times 32-sums, out = fma(r,
    d_act, out). Weight rows from O on read row O - 1; their sums are not used.

    acts int8 [G, nb, 64, TILE * 4]: element 4k + i of block b of row TILE g + j at [g, b, k, 4j + i];
    bias_sums int32 [G, nb, n_sub, TILE]: tile_bias times each row's sub-block sums; min_sums
    int32 [G, nb, 8, TILE]: the 32-sums; ad f32 [G, nb, TILE]: the rows' Q8_K scales."""
    parts, read_scales, n_sub = PARTS[kind], SCALES[kind], N_SUB[kind]
    layout, has_min, post = TYPES[kind].block, TYPES[kind].has_min, TYPES[kind].post
    biased, per_sub = tile_bias(kind) != 0, 64 // N_SUB[kind]

    def tile_dots(typingctx, raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, out, at):
        def codegen(context, builder, signature, args):
            a = operands(tile_dots, context, builder, signature, args)
            o_, b_, at_ = a.o.index(), a.b.index(), a.at.index()
            last = builder.sub(a.raw.shape(0), constant(o_.type, 1))
            grid_, signs_ = a.grid.at([]), a.signs.at([])
            f32x16 = ir.VectorType(ir.FloatType(), 16)
            codes = builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(I8, 256 * BAND)), I8.as_pointer())
            scales, mins, d0, dmin = [], [], [], []
            for r in range(BAND):
                row = builder.add(o_, constant(o_.type, r))
                row = builder.select(builder.icmp_signed(">", row, last), last, row)
                block = builder.gep(a.raw.at([row]),
                                    [builder.mul(b_, constant(b_.type, layout.size))])
                row_scales, row_mins = read_scales(builder, block)
                scales.append(elements(builder, row_scales))
                mins.append(row_mins if row_mins is None else elements(builder, row_mins))
                d0.append(builder.fmul(f16_of(builder, block, layout.d), ir.Constant(ir.FloatType(), post)))
                dmin.append(f16_of(builder, block, layout.dmin) if has_min else None)
                for p, (u, mask) in enumerate(parts(builder, block, grid_, signs_)):
                    store_at(builder, codes, 256 * r + 64 * p,
                             u if mask is None else builder.add(signed(builder, u, mask), splat8(builder, 128, 64)))
            n_tiles = a.acts.shape(0)
            with cgutils.for_range(builder, n_tiles) as loop:
                g = loop.index
                acts_ = a.acts.at([g, b_])
                # the codes' address through an empty asm: LLVM would otherwise hoist the broadcasts
                # out of the loop and spill them, stores that cost more than the loop
                tile_codes = builder.asm(ir.FunctionType(codes.type, [codes.type]), "", "=r,0", [codes], True)
                s1 = [ir.Constant(I32X16, None)] * BAND
                for sub in range(n_sub):
                    acc = [ir.Constant(I32X16, None)] * BAND
                    for k in range(sub * per_sub, (sub + 1) * per_sub):
                        four_elements = load_at(builder, acts_, 64 * k, I8X64)
                        for r in range(BAND):
                            four = splat(builder, load_at(builder, tile_codes, 256 * r + 4 * k, I32))
                            acc[r] = dpbusd(builder, acc[r], builder.bitcast(four, I8X64), four_elements)
                    if biased:
                        bias = load_at(builder, a.bias_sums.at([g, b_, constant(b_.type, sub)]), 0, I32X16)
                        acc = [builder.sub(a, bias) for a in acc]
                    s1 = [builder.add(s1[r], builder.mul(acc[r], splat(builder, scales[r][sub]))) for r in range(BAND)]
                d_act = load_at(builder, a.ad.at([g, b_]), 0, f32x16)
                if has_min:
                    sums32 = [load_at(builder, a.min_sums.at([g, b_, constant(b_.type, j)]), 0, I32X16) for j in range(8)]
                for r in range(BAND):
                    result = builder.fmul(builder.sitofp(s1[r], f32x16), splat(builder, d0[r]))
                    if has_min:
                        s2 = ir.Constant(I32X16, None)
                        for j in range(8):
                            s2 = builder.add(s2, builder.mul(sums32[j], splat(builder, mins[r][j])))
                        result = vector_fma(builder, splat(builder, builder.fneg(dmin[r])), builder.sitofp(s2, f32x16), result)
                    row = builder.gep(a.out.at([builder.add(at_, constant(at_.type, r))]),
                                      [builder.mul(g, constant(g.type, 4 * TILE))])
                    store_at(builder, row, 0, vector_fma(builder, result, d_act, load_at(builder, row, 0, f32x16)))
            return context.get_dummy_value()
        arrays = (raw, acts, bias_sums, min_sums, ad, grid, signs, out)
        if raw.ndim == 2 and acts.ndim == 4 and out.ndim == 2 and all(a.layout == "C" for a in arrays):
            return types.none(raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, out, at), codegen
    return of_kind(tile_dots, kind)


@intrinsic
def f16_at(typingctx, raw, o, offset):  # raw uint8 [O, n], row, byte offset -> the little-endian half as f32
    def codegen(context, builder, signature, args):
        a = operands(f16_at, context, builder, signature, args)
        return f16_of(builder, a.raw.at([a.o.index(), a.offset.index()]), 0)
    if raw.ndim == 2:
        return types.float32(raw, o, offset), codegen


@intrinsic
def q8_0_lanes(typingctx, raw, o, b, aq, t, lanes):  # lanes int32 [8] <- block b of row o against q[t, b]: 4-sums
    """Q8_0's 32 signed values (its qs), as q0_lanes' lanes (the upper half of
    the 512-bit vpdpbusd is zeros)."""
    def codegen(context, builder, signature, args):
        a = operands(q8_0_lanes, context, builder, signature, args)
        b_ = a.b.index()
        block = a.raw.at([a.o.index(), builder.mul(b_, constant(b_.type, Q8_0.size))])
        acts = a.aq.at([a.t.index(), b_])
        zero = ir.Constant(I8X32, None)
        values = concat(builder, load_at(builder, block, Q8_0.qs, I8X32), zero)
        u, mask = sign_split(builder, values)
        four = dpbusd(builder, ir.Constant(I32X16, None), u, signed(builder, concat(builder, load_at(builder, acts, 0, I8X32), zero), mask))
        out = a.lanes.at([])
        builder.store(shuffle(builder, four, four, range(8)), builder.bitcast(out, I32X8.as_pointer()), align=1)
        return context.get_dummy_value()
    if raw.ndim == 2 and aq.dtype == types.int8 and all(a.layout == "C" for a in (raw, aq, lanes)):
        return types.none(raw, o, b, aq, t, lanes), codegen


@numba.njit(cache=True, parallel=True)
def q8_0_vec_dot(raw, aq, ad):  # raw Q8_0 [O, nb * Q8_0.size], Q8_0 acts -> [T, O]: reference q0_lanes, one accumulator
    O = raw.shape[0]
    T, nb = ad.shape
    out = np.zeros((T, O), F32)
    for o in numba.prange(O):
        lanes = np.zeros(8, np.int32)
        acc = np.zeros(8, F32)
        for t in range(T):
            acc[:] = 0
            for b in range(nb):
                q8_0_lanes(raw, o, b, aq, t, lanes)
                scale = f16_at(raw, o, Q8_0.size * b + Q8_0.d) * ad[t, b]
                for lane in range(8):
                    acc[lane] = fma32(scale, F32(lanes[lane]), acc[lane])
            out[t, o] = hsum8(acc)
    return out


class BlockDot(NamedTuple):  # how a type's vec_dot scales and folds its block's lanes
    block: QuantBlock  # the struct: its size, the bytes of d (and dmin)
    has_min: bool  # a dmin and per-sub-block mins (Q4_K, Q5_K)
    offset: int  # what the stored codes hold above the values (Q6_K's 32), taken off through the 16-sums
    min_lanes: int  # the lanes the mins' sums are kept in (Q4_K's __m128: 4)
    post: float  # the factor of the folded lanes (IQ2_XXS' 1/8, IQ3_XXS' 1/4)


TYPES = {
    "IQ2_XXS": BlockDot(IQ2_XXS, False, 0, 1, 0.125), "IQ3_XXS": BlockDot(IQ3_XXS, False, 0, 1, 0.25),
    "IQ4_XS": BlockDot(IQ4_XS, False, 0, 1, 1.0), "Q4_K": BlockDot(Q4_K, True, 0, 4, 1.0),
    "Q5_K": BlockDot(Q5_K, True, 0, 1, 1.0), "Q6_K": BlockDot(Q6_K, False, 32, 1, 1.0),
}
SIGNED_CODES = {"IQ2_XXS", "IQ3_XXS", "IQ4_XS"}  # their parts give |value| and a sign mask
N_SUB = {kind: 16 if kind == "Q6_K" else 8 for kind in TYPES}  # scales a block holds


def tile_bias(kind):  # -> what a tile's unsigned codes hold above the values: 128 added to signed ones, Q6_K's 32
    return 128 * (kind in SIGNED_CODES) + TYPES[kind].offset


ROWS_PER_TASK = 2 * BAND  # rows one parallel task takes, whole bands: its scratch is allocated once for them


@numba.njit(cache=True, inline="always")
def n_tasks(O):  # -> the parallel tasks of O rows, ROWS_PER_TASK each (the last fewer)
    return (O + ROWS_PER_TASK - 1) // ROWS_PER_TASK


@numba.njit(cache=True, inline="always")
def task_rows(task, O):  # -> (first row, row past the last) of one task
    return task * ROWS_PER_TASK, min(O, (task + 1) * ROWS_PER_TASK)


def row_dot(kind, raw, o, t, aq, ad, bsums, sums32, grid, signs, sums):  # kind a literal type name: its row_dot
    raise TypeError("row_dot is compiled by numba, for a literal type name")


def tile_dots(kind, raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, out, at):  # kind a literal type name
    raise TypeError("tile_dots is compiled by numba, for a literal type name")


ROW_DOTS = {kind: row_dot_intrinsic(kind) for kind in TYPES}
TILE_DOTS = {kind: tile_dots_intrinsic(kind) for kind in TYPES}


# The kernels below capture only the type's name and numbers, and reach the type's functions through
# these overloads: a closure holding a dispatcher or an intrinsic gets a new cache key in every process
# (their pickles carry a fresh uuid), so numba would compile each kernel again at every start.
@overload(row_dot, inline="always")
def row_dot_of(kind, raw, o, t, aq, ad, bsums, sums32, grid, signs, sums):
    if isinstance(kind, types.StringLiteral):
        dot_of = ROW_DOTS[kind.literal_value]
        return lambda kind, raw, o, t, aq, ad, bsums, sums32, grid, signs, sums: dot_of(
            raw, o, t, aq, ad, bsums, sums32, grid, signs, sums)


@overload(tile_dots, inline="always")
def tile_dots_of(kind, raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, out, at):
    if isinstance(kind, types.StringLiteral):
        dots_of = TILE_DOTS[kind.literal_value]
        return lambda kind, raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, out, at: dots_of(
            raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, out, at)


def k_vec_dot_kernel(kind):  # -> the njit kernel (raw, grid, signs, aq, ad, bsums, sums32) -> [T, O] of one type
    """reference k_vec_dot on the raw blocks: row_dot for each weight row and activation row (the
    weight row, a few KB, stays in L1 for the activation rows), then post * hsum_float_8 of its 8
    lanes plus the mins folded as the reference folds them. The layout numbers are constants of
    each type's kernel."""
    has_min, min_lanes, post = TYPES[kind].has_min, TYPES[kind].min_lanes, F32(TYPES[kind].post)

    @numba.njit(cache=True, parallel=True)
    def kernel(raw, grid, signs, aq, ad, bsums, sums32):
        O, T = raw.shape[0], ad.shape[0]
        out = np.zeros((T, O), F32)
        for task in numba.prange(n_tasks(O)):
            sums = np.zeros(12, F32)
            first, stop = task_rows(task, O)
            for o in range(first, stop):
                for t in range(T):
                    row_dot(kind, raw, o, t, aq, ad, bsums, sums32, grid, signs, sums)
                    x = post * hsum8(sums[:8])
                    if has_min and min_lanes == 4:  # Q4_K's __m128 of mins, folded (0+2) + (1+3)
                        x = x + ((sums[8] + sums[10]) + (sums[9] + sums[11]))
                    elif has_min:
                        x = x + sums[8]
                    out[t, o] = x
        return out
    return kernel


def tiled_kernel(kind):  # -> the njit kernel (raw, grid, signs, acts, bias_sums, min_sums, ad, T) -> [T, O]
    """reference tiled (the tiled AVX512-VNNI kernel, from 8 rows) on the raw blocks, as llama.cpp
    computes it: tile_dots per block and band of BAND weight rows. Any order of the integer sums
    gives the same s1; only the float epilogue is ggml's order, lane by lane. A task's sums stay in
    a scratch of its rows (4 KB at 64 activation rows, in L1) and go to out once, transposed."""
    @numba.njit(cache=True, parallel=True)
    def kernel(raw, grid, signs, acts, bias_sums, min_sums, ad, T):
        O = raw.shape[0]
        G, nb = ad.shape[:2]
        out = np.empty((T, O), F32)
        for task in numba.prange(n_tasks(O)):
            sums = np.zeros((ROWS_PER_TASK, G * TILE), F32)
            first, stop = task_rows(task, O)
            for b in range(nb):  # the task's bands one after another on block b: its activations stay in L1
                for o in range(first, stop, BAND):
                    tile_dots(kind, raw, o, b, acts, bias_sums, min_sums, ad, grid, signs, sums, o - first)
            for t in range(T):
                for o in range(first, stop):
                    out[t, o] = sums[o - first, t]
        return out
    return kernel


def tiles(x, T):  # x [T, nb, ...] -> [G, nb, ..., TILE]: rows padded with zeros to G tiles, each row a lane
    G = -(-T // TILE)
    padded = np.zeros((G * TILE,) + x.shape[1:], x.dtype)
    padded[:T] = x
    moved = padded.reshape((G, TILE) + x.shape[1:])
    return np.ascontiguousarray(np.moveaxis(moved, 1, -1))


def tiled_acts(kind, a):  # Q8_K acts of T rows -> tiled_kernel's (acts, bias_sums, min_sums, ad)
    T, nb = a.d.shape
    sums16 = a.bsums.astype(np.int32)
    sums32 = sums16.reshape(T, nb, 8, 2).sum(-1, dtype=np.int32)
    sub_sums = sums16 if N_SUB[kind] == 16 else sums32
    acts = tiles(a.q.reshape(T, nb, 64, 4), T)  # [G, nb, 64, 4, TILE] -> the 4 elements of a row side by side
    acts = np.ascontiguousarray(np.swapaxes(acts, -1, -2)).reshape(acts.shape[:3] + (4 * TILE,))
    return acts, tiles(np.int32(tile_bias(kind)) * sub_sums, T), tiles(sums32, T), tiles(a.d.astype(F32), T)


KERNELS = {}
FACTORIES = {"k_vec_dot": k_vec_dot_kernel, "tiled": tiled_kernel}


def k_quant_mul_mat(raw, kind, path, a):  # raw uint8 [O, row bytes] of `kind`, "k_vec_dot" | "tiled", Q8_K acts -> [T, O]
    if (kind, path) not in KERNELS:
        KERNELS[kind, path] = FACTORIES[path](kind)
    if path == "tiled":
        return KERNELS[kind, path](raw, *tables(kind), *tiled_acts(kind, a), len(a.d))
    sums32 = np.ascontiguousarray(a.bsums.reshape(a.bsums.shape[:2] + (8, 2)).sum(-1), np.int32)
    return KERNELS[kind, path](raw, *tables(kind), np.ascontiguousarray(a.q), np.ascontiguousarray(a.d, F32),
                               np.ascontiguousarray(a.bsums, np.int32), sums32)


def q8_0(raw, a):  # raw Q8_0 uint8 [O, row bytes], Q8_0 acts -> [T, O]
    return q8_0_vec_dot(raw, np.ascontiguousarray(a.q), np.ascontiguousarray(a.d, F32))


def reads(kind, path):  # whether the matmul of a `kind` weight on kernel `path` runs on the raw blocks here
    return (path in FACTORIES and kind in TYPES) or (path == "q0_lanes" and kind == "Q8_0")


def mul_mat(x, weights, name, path):  # x [T, K] f32, a tensor `reads` takes -> [T, O]
    kind, raw = weights.type_name(name), raw_rows(weights, name)
    if path == "q0_lanes":
        return q8_0(raw, quantize_q8_0(x))
    return k_quant_mul_mat(raw, kind, path, quantize_q8_k(x))


def raw_rows(weights, name):  # GGUF tensor -> its bytes as uint8 [O, row bytes], the mmap itself (no copy)
    raw = np.asarray(weights.raw(name)).view(np.uint8)
    return raw.reshape(len(raw), -1)
