// Scaled dot-product attention, float64 inside, rounded once: reference/ops.py attention's numerics.
// One block of 128 threads per (query token, head). Two passes over the keys: the largest visible
// score, then exp(score - max) weighting V, summed in float64 (a masked key adds nothing, as in
// ops.softmax; a query with no visible key gives 0). GQA: query head h reads kv head h / (H / Hkv).
//
// Three ways to say which keys a query sees, one template:
//   attention_cache  the device KV cache of a text layer: uniform or the persistent SWA ring, the
//                    mask made from the per-slot positions (ops.causal_visible), the step's query
//                    positions and key count read from a device buffer (so a captured graph replays
//                    for any step); the sigmoid gate of the Muse-Glimmer block is applied on the way out
//   attention_mask   any [T, S] boolean mask (backend.attention)
//   attention_spans  each query sees keys [start, stop) (the vision tower's windows)
#include "common.cu"

#define ATT_THREADS 128
#define ATT_MAX_D 256

struct CacheVisible {  // ops.causal_visible on ring or uniform slots
    const int* key_pos;
    int query_pos, window;
    __device__ bool operator()(int s) const {
        int kp = key_pos[s];
        return kp >= 0 && kp <= query_pos && (window == 0 || query_pos - kp < window);
    }
};

struct MaskVisible {
    const u8* mask_row;
    __device__ bool operator()(int s) const { return mask_row[s] != 0; }
};

struct AllVisible {
    __device__ bool operator()(int) const { return true; }
};

__device__ __forceinline__ double score(const float* q, const float* k, int D, double scale) {
    double s = 0.0;
    for (int d = 0; d < D; d++) s = fma((double)q[d], (double)k[d], s);  // products of floats are exact
    return s * scale;
}

// q [D] (this query, this head); key s at k + s * row_stride, value at v + s * row_stride.
// -> out_d [D / ATT_THREADS rounded up] per thread: dims d = threadIdx.x + ATT_THREADS * i.
template <class Visible>
__device__ void attend(const float* q, const float* k, const float* v, i64 row_stride, int s_begin, int s_end,
                       int D, double scale, Visible visible, float* q_shared, double* p_shared, double* scratch,
                       float* out_d) {
    int tid = threadIdx.x;
    for (int d = tid; d < D; d += ATT_THREADS) q_shared[d] = q[d];
    __syncthreads();
    double best = neg_inf();
    for (int s = s_begin + tid; s < s_end; s += ATT_THREADS)
        if (visible(s)) best = fmax(best, score(q_shared, k + s * row_stride, D, scale));
    best = block_max(best, scratch);
    double acc[ATT_MAX_D / ATT_THREADS], total = 0.0;
    for (int i = 0; i < ATT_MAX_D / ATT_THREADS; i++) acc[i] = 0.0;
    if (best > neg_inf()) {  // the same on every thread of the block
        for (int base = s_begin; base < s_end; base += ATT_THREADS) {
            int s = base + tid;
            double p = 0.0;
            if (s < s_end && visible(s)) p = exp(score(q_shared, k + s * row_stride, D, scale) - best);
            __syncthreads();  // the previous round's weights have been read
            p_shared[tid] = p;
            __syncthreads();
            int n = imin(ATT_THREADS, s_end - base);
            for (int j = 0; j < n; j++) {
                double pj = p_shared[j];
                if (pj == 0.0) continue;
                total += pj;
                const float* vr = v + (base + j) * row_stride;
                for (int i = 0; i * ATT_THREADS + tid < D; i++) acc[i] = fma(pj, (double)vr[i * ATT_THREADS + tid], acc[i]);
            }
        }
    }
    for (int i = 0; i * ATT_THREADS + tid < D; i++) out_d[i] = total > 0.0 ? (float)(acc[i] / total) : 0.0f;
}

// ops.sigmoid in float32, exp taken in float64 and rounded (NumPy's float32 exp is within an ulp)
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + (float)exp(-(double)x)); }

// grid (H, T), block (128). q [T, H, D] rows q_stride apart; caches [rows, Hkv, D]; key_pos [rows];
// step = [key count, position of token 0, ..., position of token T-1]; gate [T, H*D] rows
// gate_stride apart or null. -> out [T, H*D] = attn * sigmoid(gate); attn_out and gate_sig
// (trace copies, [T, H*D]) when not null.
extern "C" __global__ void attention_cache(const float* q, int q_stride, const float* k_cache, const float* v_cache,
                                           const int* key_pos, int rows, const int* step, int H, int Hkv, int D,
                                           int window, double scale, const float* gate, int gate_stride, float* out,
                                           float* attn_out, float* gate_sig) {
    __shared__ float q_shared[ATT_MAX_D];
    __shared__ double p_shared[ATT_THREADS];
    __shared__ double scratch[WARP];
    int h = blockIdx.x, t = blockIdx.y, kv = h / (H / Hkv);
    CacheVisible visible = {key_pos, step[1 + t], window};
    float o[ATT_MAX_D / ATT_THREADS];
    attend(q + (i64)t * q_stride + h * D, k_cache + kv * D, v_cache + kv * D, (i64)Hkv * D, 0, imin(rows, step[0]),
           D, scale, visible, q_shared, p_shared, scratch, o);
    for (int i = 0; i * ATT_THREADS + threadIdx.x < D; i++) {
        int d = h * D + i * ATT_THREADS + threadIdx.x;
        i64 at = (i64)t * H * D + d;
        float value = o[i];
        if (attn_out) attn_out[at] = value;
        if (gate) {
            float g = sigmoid_f(gate[(i64)t * gate_stride + d]);
            if (gate_sig) gate_sig[at] = g;
            value = value * g;
        }
        out[at] = value;
    }
}

// grid (H, T), block (128). q [T, H, D], k/v [S, Hkv, D], mask [T, S] (nonzero = visible) -> out [T, H, D]
extern "C" __global__ void attention_mask(const float* q, const float* k, const float* v, const u8* mask, int S,
                                          int H, int Hkv, int D, double scale, float* out) {
    __shared__ float q_shared[ATT_MAX_D];
    __shared__ double p_shared[ATT_THREADS];
    __shared__ double scratch[WARP];
    int h = blockIdx.x, t = blockIdx.y, kv = h / (H / Hkv);
    MaskVisible visible = {mask + (i64)t * S};
    float o[ATT_MAX_D / ATT_THREADS];
    attend(q + ((i64)t * H + h) * D, k + kv * D, v + kv * D, (i64)Hkv * D, 0, S, D, scale, visible, q_shared,
           p_shared, scratch, o);
    for (int i = 0; i * ATT_THREADS + threadIdx.x < D; i++) out[((i64)t * H + h) * D + i * ATT_THREADS + threadIdx.x] = o[i];
}

// grid (H, T), block (128). q/k/v [N, H, D] (no GQA); query t sees keys [start[t], stop[t]) -> out [T, H, D]
extern "C" __global__ void attention_spans(const float* q, const float* k, const float* v, const int* start,
                                           const int* stop, int H, int D, double scale, float* out) {
    __shared__ float q_shared[ATT_MAX_D];
    __shared__ double p_shared[ATT_THREADS];
    __shared__ double scratch[WARP];
    int h = blockIdx.x, t = blockIdx.y;
    float o[ATT_MAX_D / ATT_THREADS];
    attend(q + ((i64)t * H + h) * D, k + h * D, v + h * D, (i64)H * D, start[t], stop[t], D, scale, AllVisible(),
           q_shared, p_shared, scratch, o);
    for (int i = 0; i * ATT_THREADS + threadIdx.x < D; i++) out[((i64)t * H + h) * D + i * ATT_THREADS + threadIdx.x] = o[i];
}
