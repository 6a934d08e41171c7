"""Quantized dot products: exact integer sums, then each kernel family's float epilogue in its own
lane and accumulation order."""
import numpy as np

from .blocks import QuantRows
from .build import GgmlCpuError
from .rounding import F32, F64, fma32, hsum4, hsum8, madd
from .target import AVX512


def int_dot(w, a, width):  # w [O, nb, bs], a [T, nb, bs] int -> [T, O, nb, bs/width]: exact partial sums
    O, nb, bs = w.shape
    wf = w.reshape(O, nb, bs // width, width).astype(F64)
    af = a.reshape(len(a), nb, bs // width, width).astype(F64)
    return np.einsum("onsw,tnsw->tons", wf, af).astype(np.int64)  # integers < 2^53: exact


def f32_of(i):  # int [...] -> f32 [...]: vcvtdq2ps, round to nearest even
    return np.asarray(i).astype(F32)


def multiply_add(acc, x, y, fused):  # f32 arrays (broadcast) -> acc + x*y: one FMA, or a multiply then an add
    """NEON's vmlaq_f32 / vmlaq_n_f32 are fused where the build's compiler fuses them
    (Target.mla_fused: clang, not GCC)."""
    return fma32(x, y, acc) if fused else acc + x * y


def multiply_subtract(acc, x, y, fused):  # -> acc - x*y, as vmlsq_f32 (Target.mla_fused)
    return fma32(-x, y, acc) if fused else acc - x * y


# ---------------------------------------------------------------------------------------------
# Quantized dot products, one function per kernel family


def q0_lanes(w, a, accumulators=1, target=AVX512):  # QuantRows/QuantActs 32-blocks -> [T, O]
    """tinyBLAS_Q0_AVX and ggml_vec_dot_{q8_0,q5_0,q4_0,iq4_nl}_q8_0 (AVX2), every row against every
    activation row; on NEON tinyBLAS_Q0_ARM and the NEON vec_dots, in 4 lanes."""
    return q0_accumulate(int_dot(w.values, a.q, 4), w.d[None] * a.d[:, None], accumulators, target)


def q0_accumulate(lanes, scale, accumulators=1, target=AVX512):  # lanes [..., nb, 8] int, scale [..., nb] f32 -> [...]
    """x86: 8 lanes, each the exact sum of 4 neighbouring products of a block, fma(f32(d_w*d_a),
    f32(lane), acc) block after block, then hsum_float_8. The IQ4_NL vec_dot takes blocks in pairs
    into two accumulators, summed before the hsum, and an odd last block as a scalar
    fma(d, f32(isum), sum). NEON: two vdotq_s32 over the block's halves, added: lane l holds elements
    4l..4l+3 and 16+4l..16+4l+3 (llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp:1305-1314); tinyBLAS_Q0_ARM
    keeps one accumulator, the vec_dots two (even and odd blocks, llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:1355-1382),
    each reduced by vaddvq_f32 and the two sums added; acc + f32(lane) * d_w*d_a by vmlaq_n_f32 (fused
    where the compiler fuses it, Target.mla_fused); the odd last block as on x86."""
    if target.neon:
        lanes = lanes[..., :4] + lanes[..., 4:]
    nb = lanes.shape[-2]
    paired = nb - nb % accumulators
    acc = np.zeros((accumulators,) + lanes.shape[:-2] + (lanes.shape[-1],), F32)
    fused = target.mla_fused if target.neon else target.fma  # x86: madd, FMA where the build has it
    for b in range(paired):
        acc[b % accumulators] = multiply_add(acc[b % accumulators], f32_of(lanes[..., b, :]), scale[..., b, None], fused)
    if target.neon:
        out = hsum4(acc[0]) + hsum4(acc[1]) if accumulators == 2 else hsum4(acc[0])
    else:
        out = hsum8(acc[0] + acc[1] if accumulators == 2 else acc[0])
    for b in range(paired, nb):
        out = madd(scale[..., b], f32_of(lanes[..., b, :].sum(-1)), out, target.neon or target.fma)
    return out


def q8_0_pre_avx2(w, a, target):  # Q8_0 rows, Q8_0 acts, a pre-AVX2 x86 Target -> [T, O]: ggml_vec_dot_q8_0_q8_0
    """The __AVX__ arm (llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c:1343-1360): blocks in pairs, each
    block 4 int32 lanes of SSE maddubs/madd (lane l: elements 4l..4l+3 and 16+4l..16+4l+3,
    mul_sum_i8_quad_float, quants.c:247-262), the pair's 8 lanes times its two d_w*d_a
    (quad_fp16_delta_float) added into one accumulator, a multiply and an add (fused where the build has
    FMA: GCC contracts the intrinsics), hsum_float_8; then every block left (an odd last one; all of
    them without AVX) by the scalar loop, sumf += f32(isum) * (d_w*d_a) (quants.c:1363-1371)."""
    sums = int_dot(w.values, a.q, 4)  # [T, O, nb, 8]
    quads = f32_of(sums[..., :4] + sums[..., 4:])  # [T, O, nb, 4]
    scale = w.d[None] * a.d[:, None]  # [T, O, nb]
    nb = sums.shape[2]
    paired = nb - nb % 2 if target.avx else 0
    acc = np.zeros(sums.shape[:2] + (8,), F32)
    for b in range(0, paired, 2):
        lanes = np.concatenate([quads[:, :, b], quads[:, :, b + 1]], axis=-1)
        deltas = np.repeat(scale[:, :, b:b + 2], 4, axis=-1)
        acc = madd(deltas, lanes, acc, target.fma)
    out = hsum8(acc)
    for b in range(paired, nb):
        out = madd(f32_of(sums[:, :, b].sum(-1)), scale[:, :, b], out, target.fma)
    return out


def vec_dot_q8_0(k, q):  # QuantActs k, q of matching (broadcast) leading shapes, [..., nb, 32] -> [...]
    """ggml_vec_dot_q8_0_q8_0 of one K row and one Q row: the q0_lanes arithmetic, pairwise."""
    products = k.q * q.q
    lanes = products.reshape(products.shape[:-1] + (8, 4)).sum(-1)
    return q0_accumulate(lanes, k.d * q.d)


def q0_repacked(w, a):  # QuantRows/QuantActs 32-blocks -> [T, O]
    """CPU repack q4_0_8x8 / iq4_nl_8x8, gemm and gemv alike: per block fma(f32(isum), f32(d_w*d_a), acc)."""
    sums = f32_of(int_dot(w.values, a.q, 32)[..., 0])  # [T, O, nb]
    scale = w.d[None] * a.d[:, None]
    acc = np.zeros(sums.shape[:2], F32)
    for b in range(sums.shape[2]):
        acc = fma32(sums[:, :, b], scale[:, :, b], acc)
    return acc


def q5_1_vec_dot(w, a):  # Q5_1 rows, Q8_1 acts -> [T, O]: ggml_vec_dot_q5_1_q8_1 (AVX2)
    """Unsigned 5-bit values times int8: 8 lanes fma(f32(lane), f32(d_w*d_a), acc); the block
    minimums add m_w*s_a into a scalar (contracted to FMA), added after hsum_float_8."""
    lanes = f32_of(int_dot(w.values, a.q, 4))
    scale = (w.d[None] * a.d[:, None])[..., None]
    acc = np.zeros(lanes.shape[:2] + (8,), F32)
    summs = np.zeros(lanes.shape[:2], F32)
    for b in range(lanes.shape[2]):
        summs = fma32(w.m[None, :, b], a.s[:, None, b], summs)
        acc = fma32(lanes[:, :, b], scale[:, :, b], acc)
    return hsum8(acc) + summs


def neon_q1_vec_dot(w, a, kind, target):  # Q4_1/Q5_1 rows, Q8_1 acts, a NEON Target -> [T, O]: ggml_vec_dot_q{4,5}_1_q8_1
    """Blocks in pairs into two 4-lane accumulators as the NEON Q0 vec_dots (q0_accumulate), the
    minimums m_w*s_a into scalars: Q5_1 two, each by FMA (llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:1071-1072, 1122),
    Q4_1 one, adding fma(m_0, s_0, m_1*s_1) per pair (quants.c:700, 727); the result is
    vaddvq(acc0) + vaddvq(acc1) + the scalars in order; an odd last block adds fma(d_w*d_a, f32(isum), m_w*s_a)."""
    lanes = int_dot(w.values, a.q, 4)
    lanes = f32_of(lanes[..., :4] + lanes[..., 4:])  # [T, O, nb, 4]
    scale = w.d[None] * a.d[:, None]
    mins = (w.m[None] * a.s[:, None]).astype(F32)  # [T, O, nb]: the products m_w*s_a, rounded
    T, O, nb = lanes.shape[:3]
    paired = nb - nb % 2
    acc = np.zeros((2, T, O, 4), F32)
    summs = np.zeros((2, T, O), F32)
    for b in range(paired):
        acc[b % 2] = multiply_add(acc[b % 2], lanes[:, :, b], scale[:, :, b, None], target.mla_fused)
        if kind == "Q5_1":
            summs[b % 2] = fma32(w.m[None, :, b], a.s[:, None, b], summs[b % 2])
        elif b % 2:
            summs[0] = summs[0] + fma32(w.m[None, :, b - 1], a.s[:, None, b - 1], mins[:, :, b])
    out = hsum4(acc[0]) + hsum4(acc[1]) + summs[0]
    if kind == "Q5_1":
        out = out + summs[1]
    for b in range(paired, nb):
        out = out + fma32(scale[:, :, b], lanes[:, :, b].sum(-1), mins[:, :, b])
    return out


def neon_wide_block_vec_dot(w, a, target):  # Q1_0/Q2_0 rows (blocks of 128/64), Q8_0 acts, a NEON Target -> [T, O]
    """ggml_vec_dot_q{1,2}_0_q8_0 (llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:140-296): per Q8_0 block the
    tinyBLAS_Q0_ARM lanes and multiply-add with d_w*d_a into one register, vaddvq_f32 at the end:
    q0_accumulate on the weight block cut into 32s, each with its block's d."""
    O, nb, bs = w.values.shape
    rows32 = QuantRows(np.repeat(w.d, bs // 32, axis=1), w.values.reshape(O, nb * bs // 32, 32))
    return q0_accumulate(int_dot(rows32.values, a.q, 4), rows32.d[None] * a.d[:, None], 1, target)


def neon_iq4_nl_vec_dot(w, a):  # IQ4_NL rows, Q8_0 acts -> [T, O]: ggml_vec_dot_iq4_nl_q8_0 (NEON)
    """Whole-block integers, blocks in pairs into one float: sumf += d_0*f32(i_0) + d_1*f32(i_1), GCC
    fusing the first product and rounding the second (llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:4238-4240);
    an odd last block fma(d, f32(i), sumf)."""
    sums = f32_of(int_dot(w.values, a.q, 32)[..., 0])  # [T, O, nb]
    scale = w.d[None] * a.d[:, None]
    nb = sums.shape[2]
    acc = np.zeros(sums.shape[:2], F32)
    for b in range(0, nb - nb % 2, 2):
        acc = acc + fma32(scale[..., b], sums[..., b], scale[..., b + 1] * sums[..., b + 1])
    for b in range(nb - nb % 2, nb):
        acc = fma32(scale[..., b], sums[..., b], acc)
    return acc


def sub_block_sums(a, width):  # QuantActs (Q8_K) -> int [T, nb, 256/width]: activation sums per sub-block
    return a.bsums.reshape(a.bsums.shape[:-1] + (-1, width // 16)).sum(-1)


def k_repacked_rows(w, a, elements_per_fma):  # Q4_K/Q2_K rows, Q8_K acts -> [T, O]
    """CPU repack q4_K_8x8 / q2_K_8x8: the scale part sum(scale*dot) and the min part sum(min*bsum)
    go through two FMA accumulators, d_w*d_a and dmin_w*d_a, once per `elements_per_fma` (the gemm:
    64 for Q4_K, 128 for Q2_K; the gemv: a whole 256-block); out = acc - acc_min."""
    dots = int_dot(w.values, a.q, w.sub) * w.scales[None]  # [T, O, nb, nsub]
    mins = sub_block_sums(a, w.sub)[:, None] * w.mins[None]
    step = elements_per_fma // w.sub
    dots = dots.reshape(dots.shape[:3] + (-1, step)).sum(-1)
    mins = mins.reshape(mins.shape[:3] + (-1, step)).sum(-1)
    scale, scale_min = w.d[None] * a.d[:, None], w.dmin[None] * a.d[:, None]
    acc = np.zeros(dots.shape[:2], F32)
    acc_min = np.zeros(dots.shape[:2], F32)
    for b in range(dots.shape[2]):
        for p in range(dots.shape[3]):
            acc = fma32(f32_of(dots[:, :, b, p]), scale[:, :, b], acc)
            acc_min = fma32(f32_of(mins[:, :, b, p]), scale_min[:, :, b], acc_min)
    return acc - acc_min


def neon_k_repacked_rows(w, a, scale_elements, min_elements, target):  # Q4_K/Q5_K rows, Q8_K acts -> [T, O]
    """The NEON repacked q4_K/q5_K kernels that add the scale part by FMA every scale_elements
    elements, acc = fma(f32(S), d_w*d_a, acc), and take the min part away every min_elements,
    acc - f32(M) * dmin_w*d_a by vmlsq_f32 (fused where the compiler fuses it, Target.mla_fused)."""
    dots = int_dot(w.values, a.q, w.sub) * w.scales[None]  # [T, O, nb, nsub]
    mins = sub_block_sums(a, w.sub)[:, None] * w.mins[None]
    T, O, nb, nsub = dots.shape
    per_min = min_elements // scale_elements
    S = f32_of(dots.reshape(T, O, nb, -1, per_min, scale_elements // w.sub).sum(-1))  # [T, O, nb, min group, part]
    M = f32_of(mins.reshape(T, O, nb, -1, min_elements // w.sub).sum(-1))  # [T, O, nb, min group]
    d, m = w.d[None] * a.d[:, None], w.dmin[None] * a.d[:, None]
    acc = np.zeros((T, O), F32)
    for b in range(nb):
        for g in range(M.shape[3]):
            for p in range(per_min):
                acc = fma32(S[:, :, b, g, p], d[:, :, b], acc)
            acc = multiply_subtract(acc, M[:, :, b, g], m[:, :, b], target.mla_fused)
    return acc


def tiled(w, a):  # K-quant/IQ rows, Q8_K acts -> [T, O]: the tiled AVX512-VNNI kernel (tiled/)
    """Per 256-slab: s1 = sum(scale * dot) exact, r = f32(s1) * d0 (d0 = f16 d times the IQ power of
    two), minus dmin*f32(s2) by one fnmadd for types with mins, then buf = fma(r, d_act, buf)."""
    dots = int_dot(w.values - w.unsigned_offset, a.q, w.sub) * w.scales[None]  # [T, O, nb, nsub]
    s1 = f32_of(dots.sum(-1))
    d0 = (w.d * F32(w.post)).astype(F32)
    buf = np.zeros(s1.shape[:2], F32)
    s2 = None if w.mins is None else f32_of((sub_block_sums(a, w.sub)[:, None] * w.mins[None]).sum(-1))
    for b in range(s1.shape[2]):
        r = s1[:, :, b] * d0[None, :, b]
        if s2 is not None:
            r = fma32(-w.dmin[None, :, b], s2[:, :, b], r)
        buf = fma32(r, a.d[:, None, b], buf)
    return buf


# The NEON K-quant vec_dots form one exact integer per block (its codes times scales, less Q6_K's 32 per
# bsum) and, for types with mins, one for sum(min * bsum); the float steps per block are these, read in
# the disassembly of arch/arm/quants.c as GCC 12 compiles it for the build (d = d_a * d_w, m = d_a * dmin_w).
NEON_K_EPILOGUES = {
    # sum = fma(f32(S), d, sum), times the IQ power of two at the end: llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:3582
    # (Q6_K), 2297 (Q3_K), 4307 (IQ4_XS), 3755-3757 (IQ2_XS), 3850-3853 (IQ2_S), 4024-4026 (IQ3_S), 1555 (TQ1_0), 1666 (TQ2_0)
    "Q6_K": "scaled", "Q3_K": "scaled", "IQ4_XS": "scaled", "IQ2_XS": "scaled", "IQ2_S": "scaled",
    "IQ3_S": "scaled", "TQ1_0": "scaled", "TQ2_0": "scaled",
    # per 32 f32(dot) * (ls + 0.5) by FMA into two floats (even, odd sub-blocks), then fma(d, s_even + s_odd,
    # sum); times 2*post at the end (0.25, 0.5): quants.c:3678-3683 (IQ2_XXS), 3911-3916 (IQ3_XXS)
    "IQ2_XXS": "half_scales", "IQ3_XXS": "half_scales",
    # the grid part A and the delta part B (IQ1_S sumi3, IQ1_M sumi2) as integers, then
    # fma(d, fma(f32(B), 1/8, f32(A)), sum): quants.c:4089 (IQ1_S), 4182 (IQ1_M)
    "IQ1_S": "delta", "IQ1_M": "delta",
    # sumf -= m * f32(M) (fmsub), then sumf += d * f32(S) (fmadd): quants.c:2819, 2848
    "Q4_K": "mins_first",
    # sumf += d * f32(S) - m * f32(M): m*M rounded, fused into d*S, then added: quants.c:2949
    "Q5_K": "mins_inside",
}


MMLA_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")  # type_traits_cpu nrows = 2 under i8mm (ggml-cpu.c:240-332)


def mmla_vec_dot(w, a, kind, fused):  # rows, Q8_0/Q8_1/Q8_K acts -> [T, O]: the i8mm vec_dots with nrc == 2
    """vmmlaq_s32 gives each (weight row, activation row) its whole-block integer; one float32 lane per
    output then takes, block by block, acc + f32(I) * d_w*d_a (vmlaq_f32; fused: as one FMA, Target.mla_fused):
    Q8_0, Q4_0 (llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:1169-1225, 316-382), Q6_K with the 32 per bsum
    inside I (quants.c:3178-3340); Q4_K first subtracts f32(M) * dmin_w*d_a, then adds f32(S) * d_w*d_a
    (vmlsq_f32, vmlaq_f32, quants.c:2689, 2697); Q4_1 adds the minimums m_w*s_a, accumulated (GCC fuses
    the vaddq of their products, quants.c:630; clang does not, but the product of two halves is exact
    in float32, so both round the sum alone), after the blocks (quants.c:609-680). The repacked
    kernels whose epilogue is this one pass fused=False where they multiply and add by separate
    intrinsics (vmulq_f32, vaddq_f32), which no compiler here fuses."""
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        S, M = f32_of(int_dot(w.values, a.q, 32)[..., 0]), None
    else:
        S = f32_of((int_dot(w.values - w.unsigned_offset, a.q, w.sub) * w.scales[None]).sum(-1))
        M = None if w.mins is None else f32_of((sub_block_sums(a, w.sub)[:, None] * w.mins[None]).sum(-1))
    d = a.d[:, None] * w.d[None]
    acc = np.zeros(S.shape[:2], F32)
    summs = np.zeros(S.shape[:2], F32)
    for b in range(S.shape[2]):
        if M is not None:
            acc = multiply_subtract(acc, M[..., b], a.d[:, None, b] * w.dmin[None, :, b], fused)
        acc = multiply_add(acc, S[..., b], d[..., b], fused)
        if kind == "Q4_1":
            summs = fma32(w.m[None, :, b], a.s[:, None, b], summs)
    return acc + summs if kind == "Q4_1" else acc


def neon_k_vec_dot(w, a, kind):  # K-quant rows, Q8_K acts -> [T, O]: ggml_vec_dot_*_q8_K (NEON dotprod)
    """The block integers S = sum(scale * dot) and M = sum(min * bsum) are exact; per block the
    epilogue NEON_K_EPILOGUES[kind] into one float32 sum."""
    if kind not in NEON_K_EPILOGUES:
        raise GgmlCpuError(f"the NEON vec_dot of {kind} is not emulated")
    epilogue = NEON_K_EPILOGUES[kind]
    values = w.values - w.unsigned_offset
    if epilogue == "delta":  # the codes 8*grid +- 1 taken apart as in iq1_vec_dot
        grid = (values + 4) // 8
        B = f32_of((int_dot(values - 8 * grid, a.q, w.sub) * w.scales[None]).sum(-1))
        values = grid
    dots = int_dot(values, a.q, w.sub) * w.scales[None]  # [T, O, nb, n_sub]
    S = f32_of(dots.sum(-1))
    d = a.d[:, None] * w.d[None]
    M = None if w.mins is None else f32_of((sub_block_sums(a, w.sub)[:, None] * w.mins[None]).sum(-1))
    m = None if w.mins is None else a.d[:, None] * w.dmin[None]
    acc = np.zeros(S.shape[:2], F32)
    for b in range(S.shape[2]):
        if epilogue == "scaled":
            acc = fma32(S[..., b], d[..., b], acc)
        elif epilogue == "mins_first":
            acc = fma32(S[..., b], d[..., b], fma32(-M[..., b], m[..., b], acc))
        elif epilogue == "mins_inside":
            acc = acc + fma32(d[..., b], S[..., b], -(m[..., b] * M[..., b]))
        elif epilogue == "delta":
            acc = fma32(d[..., b], fma32(B[..., b], F32(0.125), S[..., b]), acc)
        else:  # half_scales: the odd scale 2 ls + 1 halved is ls + 0.5, exact
            sub_dots = f32_of(int_dot(values, a.q, w.sub)[:, :, b])  # [T, O, n_sub]
            halves = (w.scales[:, b] / 2).astype(F32)
            pair = np.zeros((2,) + acc.shape, F32)
            for sb in range(sub_dots.shape[-1]):
                pair[sb % 2] = fma32(sub_dots[..., sb], halves[None, :, sb], pair[sb % 2])
            acc = fma32(d[..., b], pair[0] + pair[1], acc)
    final = {"scaled": w.post, "half_scales": 2 * w.post}.get(epilogue, 1.0)
    return acc if final == 1.0 else F32(final) * acc


def k_vec_dot(w, a):  # K-quant/IQ rows, Q8_K acts -> [T, O]: ggml_vec_dot_*_q8_K (AVX2 builds)
    """8 int32 lanes, lane l holding 4 neighbouring products of every 32-element chunk times that
    chunk's (or 16-half's) scale; per block fma(d_w*d_a, f32(lane), acc), then hsum_float_8 times the
    IQ power of two. Q6_K takes its unsigned codes and subtracts 32*scale*bsum per lane pair of
    16-sums; the min part sum(min*bsum) * (-dmin*d_a) goes by FMA into a scalar (Q5_K, contracted)
    or into 4 lanes of sub-block pairs (Q4_K), added after the hsum."""
    T, O, nb = len(a.q), len(w.values), w.values.shape[1]
    products = int_dot(w.values, a.q, 4).reshape(T, O, nb, 8, 8)  # [.., chunk, lane]
    lane_scale = np.repeat(w.scales, 8 * w.sub // 32, axis=-1).reshape(O, nb, 8, 8)  # scale per (chunk, lane)
    lanes = (products * lane_scale[None]).sum(3)  # [T, O, nb, 8]
    if w.unsigned_offset:
        pairs = (a.bsums[:, None] * w.scales[None]).reshape(T, O, nb, 8, 2).sum(-1)
        lanes = lanes - w.unsigned_offset * pairs
    scale = w.d[None] * a.d[:, None]
    acc = np.zeros((T, O, 8), F32)
    summs = np.zeros((T, O, w.min_lanes), F32)
    for b in range(nb):
        if w.mins is not None:
            dmin = -a.d[:, None, b] * w.dmin[None, :, b]
            mins = (sub_block_sums(a, 32)[:, None, b] * w.mins[None, :, b]).reshape(T, O, w.min_lanes, -1).sum(-1)
            summs = fma32(dmin[..., None], f32_of(mins), summs)
        acc = fma32(scale[:, :, b, None], f32_of(lanes[:, :, b]), acc)
    out = F32(w.post) * hsum8(acc)
    if w.mins is None:
        return out
    if w.min_lanes == 4:  # Q4_K's __m128 of mins, folded (0+2) + (1+3)
        return out + ((summs[..., 0] + summs[..., 2]) + (summs[..., 1] + summs[..., 3]))
    return out + summs[..., 0]


def wide_block_vec_dot(w, a, lanes):  # Q1_0/Q2_0 rows (blocks of 128/64), Q8_0 acts -> [T, O]
    """ggml_vec_dot_q1_0_q8_0 (AVX2, lanes=8: lane l the exact sum of 4 neighbouring products of each
    32-block) and ggml_vec_dot_q2_0_q8_0 (the scalar generic, lanes=1: the 32-block's sum). Per weight
    block the Q8_0 blocks it spans go into inner = d_a*f32(lane), then fma(d_a, f32(lane), inner);
    then acc = fma(d_w, inner, acc); at the end hsum_float_8 (Q1_0). The scalar code starts inner at
    fma(d_a, f32(sum), 0), which differs from the product only in the sign of a zero, and a zero's
    sign cannot reach acc, which starts at +0 and so is never -0."""
    T, (O, nb, bs) = len(a.q), w.values.shape
    spans = bs // 32
    sums = int_dot(w.values, a.q.reshape(T, nb, bs), 32 // lanes).reshape(T, O, nb, spans, lanes)
    ad = a.d.reshape(T, 1, nb, spans, 1)
    acc = np.zeros((T, O, lanes), F32)
    for b in range(nb):
        inner = ad[:, :, b, 0] * f32_of(sums[:, :, b, 0])
        for k in range(1, spans):
            inner = fma32(ad[:, :, b, k], f32_of(sums[:, :, b, k]), inner)
        acc = fma32(w.d[None, :, b, None], inner, acc)
    return hsum8(acc) if lanes == 8 else acc[..., 0]


def q2_k_vec_dot(w, a, target=AVX512):  # Q2_K rows, Q8_K acts -> [T, O]: ggml_vec_dot_q2_K_q8_K
    """AVX2: one 8-lane accumulator per weight and activation row. Per block first the mins: lane l = min_2l*bsum_2l +
    min_2l+1*bsum_2l+1 (madd of the 16-sums), acc = fma(-d_a*dmin_w, f32(lane), acc); then the scaled
    codes, lane l holding 4 neighbouring products of every 32-chunk times its 16-half's scale (the
    k_vec_dot lanes), acc = fma(d_a*d_w, f32(lane), acc); hsum_float_8 at the end. NEON
    (llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c:1972, 2005): the same two steps on the block's whole
    integers into one float, sum = fma(f32(M), -(d_a*dmin_w), sum), then fma(f32(S), d_a*d_w, sum)."""
    T, O, nb = len(a.q), len(w.values), w.values.shape[1]
    if target.neon:
        S = f32_of((int_dot(w.values, a.q, w.sub) * w.scales[None]).sum(-1))
        M = f32_of((a.bsums[:, None] * w.mins[None]).sum(-1))
        acc = np.zeros((T, O), F32)
        for b in range(nb):
            acc = fma32(M[..., b], -(a.d[:, None, b] * w.dmin[None, :, b]), acc)
            acc = fma32(S[..., b], a.d[:, None, b] * w.d[None, :, b], acc)
        return acc
    products = int_dot(w.values, a.q, 4).reshape(T, O, nb, 8, 8)  # [.., chunk, lane]
    lane_scale = np.repeat(w.scales, 4, axis=-1).reshape(O, nb, 8, 8)  # a 32-chunk's lanes 0-3 and 4-7: its two 16s
    lanes = (products * lane_scale[None]).sum(3)  # [T, O, nb, 8]
    min_lanes = (a.bsums[:, None] * w.mins[None]).reshape(T, O, nb, 8, 2).sum(-1)
    acc = np.zeros((T, O, 8), F32)
    for b in range(nb):
        dmin = -a.d[:, None, b] * w.dmin[None, :, b]
        acc = fma32(dmin[..., None], f32_of(min_lanes[:, :, b]), acc)
        acc = fma32((a.d[:, None, b] * w.d[None, :, b])[..., None], f32_of(lanes[:, :, b]), acc)
    return hsum8(acc)


def iq1_vec_dot(w, a, delta_lanes):  # IQ1_S/IQ1_M rows, Q8_K acts -> [T, O]: ggml_vec_dot_iq1_{s,m}_q8_K (AVX2)
    """The codes 8*grid + delta taken apart: the grid part is the k_vec_dot arithmetic (8 lanes of
    scale * grid * q, fma(d_w*d_a, f32(lane), acc), hsum_float_8); the delta part sum(scale * delta * q)
    goes the same way into 8 lanes of its own for IQ1_M (delta_lanes 8), and for IQ1_S (delta_lanes 1,
    sumi1 from the bsums) as one integer per block into a scalar, by FMA (contracted). out = grid part
    + 1/8 * delta part (IQ1S_DELTA, IQ1M_DELTA: an exact product, so contraction cannot change it)."""
    grid = (w.values.astype(np.int64) + 4) // 8  # 8*grid + delta with delta = +-1: the nearest multiple of 8
    delta = w.values - 8 * grid
    grid_part = k_vec_dot(QuantRows(w.d, grid, w.scales, sub=w.sub), a)
    if delta_lanes == 8:
        return grid_part + F32(0.125) * k_vec_dot(QuantRows(w.d, delta, w.scales, sub=w.sub), a)
    sumi1 = (int_dot(delta, a.q, w.sub) * w.scales[None]).sum(-1)  # [T, O, nb]
    scale = w.d[None] * a.d[:, None]
    acc = np.zeros(sumi1.shape[:2], F32)
    for b in range(sumi1.shape[2]):
        acc = fma32(scale[:, :, b], f32_of(sumi1[:, :, b]), acc)
    return grid_part + F32(0.125) * acc
