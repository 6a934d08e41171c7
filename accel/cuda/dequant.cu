// Exact float32 weights from GGUF blocks, 8 values at a time: the unit every product kernel reads.
// Each decoder does the float32 operations gguf-py's dequantize_blocks does, in its order (d * sc
// rounded, then * q, then - m), so the weights are bit for bit gguf.quants.dequantize's; the CPU
// test runs this very code against it. Block layouts: ggml-common.h. The IQ grids and the IQ4
// non-linear values come in `tab` (built from gguf-py by accel/cupy/kernels.py), not copied here.
#ifndef MG_DEQUANT_CU
#define MG_DEQUANT_CU
#include "common.cu"

// GGML type ids (ggml.h)
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ2_XXS 16
#define T_IQ3_XXS 18
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30

// Offsets in the table buffer: IQ2_XXS grid [256][8] bytes, IQ3_XXS grid [256][4], IQ4 values int8[16]
#define TAB_IQ2XXS 0
#define TAB_IQ3XXS 2048
#define TAB_KVALUES 3072
#define TAB_BYTES 3088

// The types whose decoders read `tab`: their products copy it into shared memory first, since a
// warp's lanes look up 32 unrelated grid rows at once, which global memory serves a line at a time.
#define READS_TAB(QT) (QT == T_IQ2_XXS || QT == T_IQ3_XXS || QT == T_IQ4_NL || QT == T_IQ4_XS)

// A grid row of the table (aligned to its size): one load on the device
__host__ __device__ __forceinline__ unsigned long long ld_row8(const u8* p) {
#ifdef __CUDA_ARCH__
    return *(const unsigned long long*)p;
#else
    unsigned long long v;
    __builtin_memcpy(&v, p, 8);
    return v;
#endif
}

// Runs CALL(QT) for the type id `qtype` (a runtime value; the branch is uniform across a launch).
#define DISPATCH_QTYPE(qtype, CALL)                                                           \
    switch (qtype) {                                                                          \
        case T_F32: CALL(T_F32); break;         case T_F16: CALL(T_F16); break;               \
        case T_BF16: CALL(T_BF16); break;       case T_Q4_0: CALL(T_Q4_0); break;             \
        case T_Q5_0: CALL(T_Q5_0); break;       case T_Q8_0: CALL(T_Q8_0); break;             \
        case T_IQ4_NL: CALL(T_IQ4_NL); break;   case T_Q2_K: CALL(T_Q2_K); break;             \
        case T_Q3_K: CALL(T_Q3_K); break;       case T_Q4_K: CALL(T_Q4_K); break;             \
        case T_Q5_K: CALL(T_Q5_K); break;       case T_Q6_K: CALL(T_Q6_K); break;             \
        case T_IQ4_XS: CALL(T_IQ4_XS); break;   case T_IQ3_XXS: CALL(T_IQ3_XXS); break;       \
        case T_IQ2_XXS: CALL(T_IQ2_XXS); break; default: break;                               \
    }

// The sign byte of IQ2/IQ3 (ggml's ksigns_iq2xs): 7 stored bits, the eighth makes the parity even.
__host__ __device__ __forceinline__ u32 ksign(u32 i) { return i | ((u32)(popcount(i) & 1) << 7); }

// Low (hi = 0) or high (hi = 1) nibbles of the 16 bytes at qs: values 0..15 or 16..31 of a block.
__host__ __device__ __forceinline__ int nibble(const u8* qs, int e) {
    return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
}

// 6-bit scale and min of sub-block j from the 12 packed bytes s of Q4_K / Q5_K (get_scale_min).
__host__ __device__ __forceinline__ void k_scale_min(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 48);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 48);
    }
}

// Values v0 .. v0+7 of one row (v0 a multiple of 8) -> w[8].
template <int QT>
__host__ __device__ __forceinline__ void decode8(const u8* row, int v0, const u8* tab, float* w) {
    const signed char* kvalues = (const signed char*)(tab + TAB_KVALUES);
    if (QT == T_F32) {
        const float* f = (const float*)row + v0;
        for (int j = 0; j < 8; j++) w[j] = f[j];
    } else if (QT == T_F16) {
        for (int j = 0; j < 8; j++) w[j] = ld_half(row + 2 * (v0 + j));
    } else if (QT == T_BF16) {
        for (int j = 0; j < 8; j++) w[j] = bfloat_float((u16)ld16(row + 2 * (v0 + j)));
    } else if (QT == T_Q8_0) {  // 34 bytes: f16 d, int8 q[32]
        const u8* b = row + (v0 / 32) * 34;
        float d = ld_half(b);
        for (int j = 0; j < 8; j++) w[j] = (float)(signed char)b[2 + v0 % 32 + j] * d;
    } else if (QT == T_Q4_0 || QT == T_IQ4_NL) {  // 18 bytes: f16 d, qs[16] (low nibbles first)
        const u8* b = row + (v0 / 32) * 18;
        float d = ld_half(b);
        for (int j = 0; j < 8; j++) {
            int q = nibble(b + 2, v0 % 32 + j);
            w[j] = QT == T_Q4_0 ? d * (float)(q - 8) : d * (float)kvalues[q];
        }
    } else if (QT == T_Q5_0) {  // 22 bytes: f16 d, u32 qh (fifth bits), qs[16]
        const u8* b = row + (v0 / 32) * 22;
        float d = ld_half(b);
        u32 qh = ld32(b + 2);
        for (int j = 0; j < 8; j++) {
            int e = v0 % 32 + j;
            int q = nibble(b + 6, e) | (int)(((qh >> e) & 1) << 4);
            w[j] = d * (float)(q - 16);
        }
    } else if (QT == T_Q2_K) {  // 84 bytes: scales[16], qs[64], f16 d, f16 dmin
        const u8* b = row + (v0 / 256) * 84;
        int e = v0 % 256, sc = b[e / 16];
        float dl = ld_half(b + 80) * (float)(sc & 15), ml = ld_half(b + 82) * (float)(sc >> 4);
        const u8* qs = b + 16 + e / 128 * 32 + e % 32;
        int shift = 2 * (e % 128 / 32);
        for (int j = 0; j < 8; j++) w[j] = dl * (float)((qs[j] >> shift) & 3) - ml;
    } else if (QT == T_Q3_K) {  // 110 bytes: hmask[32], qs[64], scales[12], f16 d
        const u8* b = row + (v0 / 256) * 110;
        int e = v0 % 256, i = e / 16;
        int low = (b[96 + i % 8] >> (4 * (i / 8))) & 15, high = (b[104 + i % 4] >> (2 * (i / 4))) & 3;
        float dl = ld_half(b + 108) * (float)((low | (high << 4)) - 32);
        const u8* qs = b + 32 + e / 128 * 32 + e % 32;
        const u8* hmask = b + e % 32;
        int shift = 2 * (e % 128 / 32), bit = e / 32;
        for (int j = 0; j < 8; j++) {
            int q = ((qs[j] >> shift) & 3) - ((((hmask[j] >> bit) & 1) ^ 1) << 2);  // a clear bit subtracts 4
            w[j] = dl * (float)q;
        }
    } else if (QT == T_Q4_K || QT == T_Q5_K) {  // f16 d, f16 dmin, scales[12], (Q5_K: qh[32]), qs[128]
        const int size = QT == T_Q4_K ? 144 : 176, qs_at = QT == T_Q4_K ? 16 : 48;
        const u8* b = row + (v0 / 256) * size;
        int e = v0 % 256, sc, m;
        k_scale_min(b + 4, e / 32, &sc, &m);
        float dl = ld_half(b) * (float)sc, ml = ld_half(b + 2) * (float)m;
        const u8* qs = b + qs_at + e / 64 * 32 + e % 32;
        int shift = 4 * (e / 32 % 2);
        for (int j = 0; j < 8; j++) {
            int q = (qs[j] >> shift) & 15;
            if (QT == T_Q5_K) q |= ((b[16 + e % 32 + j] >> (e / 32)) & 1) << 4;
            w[j] = dl * (float)q - ml;
        }
    } else if (QT == T_Q6_K) {  // 210 bytes: ql[128], qh[64], int8 scales[16], f16 d
        const u8* b = row + (v0 / 256) * 210;
        int e = v0 % 256, r = e % 128;
        float dl = ld_half(b + 208) * (float)(signed char)b[192 + e / 16];
        const u8* ql = b + e / 128 * 64 + r % 64;
        const u8* qh = b + 128 + e / 128 * 32 + r % 32;
        int lo_shift = 4 * (r / 64), hi_shift = 2 * (r / 32);
        for (int j = 0; j < 8; j++) {
            int q = (((ql[j] >> lo_shift) & 15) | (((qh[j] >> hi_shift) & 3) << 4)) - 32;
            w[j] = dl * (float)q;
        }
    } else if (QT == T_IQ4_XS) {  // 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128]
        const u8* b = row + (v0 / 256) * 136;
        int e = v0 % 256, sb = e / 32, l = e % 32;
        int ls = ((b[4 + sb / 2] >> (4 * (sb % 2))) & 15) | (((ld16(b + 2) >> (2 * sb)) & 3) << 4);
        float dl = ld_half(b) * (float)(ls - 32);
        const u8* qs = b + 8 + sb * 16 + l % 16;
        int shift = 4 * (l / 16);
        for (int j = 0; j < 8; j++) w[j] = dl * (float)kvalues[(qs[j] >> shift) & 15];
    } else if (QT == T_IQ2_XXS) {  // 66 bytes: f16 d, 8 x (4 grid indices, u32 signs + scale)
        const u8* b = row + (v0 / 256) * 66;
        int e = v0 % 256, l = e % 32 / 8;
        const u8* a = b + 2 + 8 * (e / 32);
        u32 aux = ld32(a + 4);
        float db = ld_half(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
        unsigned long long grid = ld_row8(tab + TAB_IQ2XXS + 8 * a[l]);  // 8 grid values, byte j = value j
        u32 signs = ksign((aux >> (7 * l)) & 127);
        for (int j = 0; j < 8; j++) {
            float v = db * (float)((grid >> (8 * j)) & 255);
            w[j] = (signs >> j) & 1 ? -v : v;
        }
    } else if (QT == T_IQ3_XXS) {  // 98 bytes: f16 d, grid indices[64], 8 x u32 signs + scale
        const u8* b = row + (v0 / 256) * 98;
        int e = v0 % 256, ib = e / 32, l = e % 32 / 8;
        u32 aux = ld32(b + 66 + 4 * ib);
        float db = ld_half(b) * (0.5f + (float)(aux >> 28)) * 0.5f;
        u32 signs = ksign((aux >> (7 * l)) & 127);
        for (int j = 0; j < 8; j++) {
            int index = b[2 + 8 * ib + 2 * l + j / 4];
            float v = db * (float)tab[TAB_IQ3XXS + 4 * index + j % 4];
            w[j] = (signs >> j) & 1 ? -v : v;
        }
    }
}

// The product of 8 weights with 8 activations, summed in float32 in this fixed order. Every
// product kernel forms the same 8-term sums, so a token gets the same bits from the decode and the
// prefill kernels; the sums of the groups are carried in float64.
__host__ __device__ __forceinline__ float dot8(const float* w, const float* x) {
    float s = w[0] * x[0];
    for (int j = 1; j < 8; j++) s = fmaf(w[j], x[j], s);
    return s;
}

#endif
