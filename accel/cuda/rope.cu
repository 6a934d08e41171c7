// RoPE on pairs of a head, with cos/sin tables the host takes from ops.rope_angles (the very
// float32 values of the reference), and the text layer's fused query/key step: per-head RMSNorm,
// RoPE, and the store of K and V into the device cache (ring slot = position % rows).
#include "common.cu"

#define HEAD_MAX_D 256

// grid (ceil(T*H*P / 256)), block (256). x/out [T, H, D], cos/sin [T, P]. Pair p is (a, a + pair_stride)
// with a = first + 2p (pair_stride 1: ops.rope_norm) or a = first + p (NEOX, pair_stride = D/2).
// Values in no pair are not touched: out starts as a copy of x (or is x).
extern "C" __global__ void rope_pairs(const float* x, const float* cos_t, const float* sin_t, int T, int H, int D,
                                      int P, int first, int pair_stride, float* out) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * H * P) return;
    int p = (int)(i % P), h = (int)(i / P % H), t = (int)(i / P / H);
    int a = first + (pair_stride == 1 ? 2 * p : p), b = a + pair_stride;
    i64 base = ((i64)t * H + h) * D;
    float e = x[base + a], o = x[base + b], c = cos_t[(i64)t * P + p], s = sin_t[(i64)t * P + p];
    out[base + a] = e * c - o * s;
    out[base + b] = e * s + o * c;
}

// grid (H + 2 Hkv, T), block (32): one warp per head of one token.
//   q heads:  q_out[t, h]            = rope(rms(q[t, h]) * q_norm)
//   k heads:  k_cache[slot, h]       = rope(rms(k[t, h]) * k_norm);  key_pos[slot] = position
//   v heads:  v_cache[slot, h]       = v[t, h]
// with slot = step[1 + t] % rows. q/k/v rows are *_stride apart (views of one fused QKV product or
// three products). cos_t/sin_t [T, D/2] or null (NoPE on full-attention layers). q_normed
// [T, H, D], k_normed and k_roped [T, Hkv, D]: trace copies, or null.
extern "C" __global__ void qk_norm_rope_store(const float* q, int q_stride, const float* k, int k_stride,
                                              const float* v, int v_stride, const float* q_norm, const float* k_norm,
                                              float eps, const float* cos_t, const float* sin_t, const int* step,
                                              int H, int Hkv, int D, float* q_out, float* k_cache, float* v_cache,
                                              int* key_pos, int rows, float* q_normed, float* k_normed,
                                              float* k_roped) {
    __shared__ float normed[HEAD_MAX_D];
    int hh = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
    int pos = step[1 + t], slot = pos % rows;
    if (hh >= H + Hkv) {
        int h = hh - H - Hkv;
        for (int d = lane; d < D; d += WARP) v_cache[((i64)slot * Hkv + h) * D + d] = v[(i64)t * v_stride + h * D + d];
        return;
    }
    bool is_q = hh < H;
    int h = is_q ? hh : hh - H;
    const float* src = is_q ? q + (i64)t * q_stride + h * D : k + (i64)t * k_stride + h * D;
    const float* w = is_q ? q_norm : k_norm;
    float* normed_trace = is_q ? q_normed : k_normed;
    if (normed_trace) normed_trace += ((i64)t * (is_q ? H : Hkv) + h) * D;
    float* roped_trace = is_q || !k_roped ? 0 : k_roped + ((i64)t * Hkv + h) * D;
    float* dst = is_q ? q_out + ((i64)t * H + h) * D : k_cache + ((i64)slot * Hkv + h) * D;

    double sum_sq = 0.0;
    for (int d = lane; d < D; d += WARP) {
        float square = src[d] * src[d];
        sum_sq += (double)square;
    }
    float scale = 1.0f / sqrtf((float)(warp_sum(sum_sq) / D) + eps);
    for (int d = lane; d < D; d += WARP) {
        float y = src[d] * scale * w[d];
        normed[d] = y;
        if (normed_trace) normed_trace[d] = y;
    }
    __syncthreads();  // a pair's two values come from two lanes
    for (int d = lane; d < D; d += WARP) {
        float y = normed[d];
        if (cos_t) {
            int p = d / 2;
            float c = cos_t[(i64)t * (D / 2) + p], s = sin_t[(i64)t * (D / 2) + p];
            y = d % 2 == 0 ? normed[d] * c - normed[d + 1] * s : normed[d - 1] * s + normed[d] * c;
        }
        dst[d] = y;
        if (roped_trace) roped_trace[d] = y;
    }
    if (!is_q && h == 0 && lane == 0) key_pos[slot] = pos;
}

// grid (ceil(rows / 256)), block (256): forget positions >= n_keep (rollback of rejected drafts)
extern "C" __global__ void truncate_positions(int* key_pos, int rows, int n_keep) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows && key_pos[i] >= n_keep) key_pos[i] = -1;
}
