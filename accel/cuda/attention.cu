// Scaled dot-product attention, float64 inside, rounded once: reference/ops.py attention's numerics.
// One block of ATT_THREADS threads per (query token, head). Two passes over the keys: the largest
// visible score, then exp(score - max) weighting V, summed in float64 (a masked key adds nothing, as in
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

// A block's threads are ATT_GROUPS groups of ATT_DIM_THREADS, a thread a dim (and dim + 128) of V:
// group g sums keys g, g + ATT_GROUPS, ... of each round, and the groups' sums are added in group
// order at the end. A decode step has only H blocks, so each must keep many loads in flight: with
// one group of 128 threads the 30B layer's attention took 330 us at 512 keys on an H200.
#define ATT_THREADS 512
#define ATT_DIM_THREADS 128
#define ATT_GROUPS (ATT_THREADS / ATT_DIM_THREADS)
#define ATT_MAX_D 256
#define ATT_DIMS (ATT_MAX_D / ATT_DIM_THREADS)  // dims a thread of a group holds

struct AttendShared {  // the shared memory of one attend()
    float q[ATT_MAX_D];
    double p[ATT_THREADS];                  // a round's weights
    double scratch[WARP];                   // block_max
    double acc[ATT_GROUPS][ATT_MAX_D];      // the groups' sums of V ...
    double total[ATT_GROUPS];               // ... and of the weights
};

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

// One key's score, by a whole warp: lane l takes dims l, l + 32, ... (a key row is read coalesced),
// the float64 sums meet in a butterfly. Called by every lane of the warp with the same key.
__device__ __forceinline__ double warp_score(const float* q, const float* k, int D, double scale) {
    double s = 0.0;
    for (int d = threadIdx.x % WARP; d < D; d += WARP) s = fma((double)q[d], (double)k[d], s);  // exact products
    return warp_sum(s) * scale;
}

// q [D] (this query, this head); key s at k + s * row_stride, value at v + s * row_stride.
// -> out_d [ATT_DIMS] on the first group's threads: dims d = threadIdx.x + ATT_DIM_THREADS * i.
// Scores go a key per warp (warp_score); in the second pass lane l of warp w keeps the score of key
// 32 w + l of the round and takes its exp, and the groups sum V over the round's weights.
template <class Visible>
__device__ void attend(const float* q, const float* k, const float* v, i64 row_stride, int s_begin, int s_end,
                       int D, double scale, Visible visible, AttendShared& sh, float* out_d) {
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    int group = tid / ATT_DIM_THREADS, dim = tid % ATT_DIM_THREADS;
    for (int d = tid; d < D; d += ATT_THREADS) sh.q[d] = q[d];
    __syncthreads();
    double best = neg_inf();
    for (int s = s_begin + warp; s < s_end; s += ATT_THREADS / WARP)
        if (visible(s)) best = fmax(best, warp_score(sh.q, k + s * row_stride, D, scale));
    best = block_max(best, sh.scratch);
    double acc[ATT_DIMS], total = 0.0;
    for (int i = 0; i < ATT_DIMS; i++) acc[i] = 0.0;
    if (best > neg_inf()) {  // the same on every thread of the block
        for (int base = s_begin; base < s_end; base += ATT_THREADS) {
            double mine = 0.0;
            bool seen = false;
            for (int i = 0; i < WARP; i++) {
                int s = base + warp * WARP + i;
                if (s < s_end && visible(s)) {  // the same on every lane
                    double score_i = warp_score(sh.q, k + s * row_stride, D, scale);
                    if (lane == i) mine = score_i, seen = true;
                }
            }
            __syncthreads();  // the previous round's weights have been read
            sh.p[tid] = seen ? exp(mine - best) : 0.0;
            __syncthreads();
            int n = imin(ATT_THREADS, s_end - base);
            for (int j = group; j < n; j += ATT_GROUPS) {
                double pj = sh.p[j];
                if (pj == 0.0) continue;
                total += pj;
                const float* vr = v + (base + j) * row_stride;
                for (int i = 0; i * ATT_DIM_THREADS + dim < D; i++)
                    acc[i] = fma(pj, (double)vr[i * ATT_DIM_THREADS + dim], acc[i]);
            }
        }
    }
    for (int i = 0; i * ATT_DIM_THREADS + dim < D; i++) sh.acc[group][i * ATT_DIM_THREADS + dim] = acc[i];
    if (dim == 0) sh.total[group] = total;
    __syncthreads();
    if (group != 0) return;
    total = 0.0;
    for (int g = 0; g < ATT_GROUPS; g++) total += sh.total[g];
    for (int i = 0; i * ATT_DIM_THREADS + dim < D; i++) {
        double sum = 0.0;
        for (int g = 0; g < ATT_GROUPS; g++) sum += sh.acc[g][i * ATT_DIM_THREADS + dim];
        out_d[i] = total > 0.0 ? (float)(sum / total) : 0.0f;
    }
}

// ops.sigmoid in float32, exp taken in float64 and rounded (NumPy's float32 exp is within an ulp)
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + (float)exp(-(double)x)); }

// grid (H, T), block (ATT_THREADS). q [T, H, D] rows q_stride apart; caches [rows, Hkv, D]; key_pos [rows];
// step = [key count, position of token 0, ..., position of token T-1]; gate [T, H*D] rows
// gate_stride apart or null. -> out [T, H*D] = attn * sigmoid(gate); attn_out and gate_sig
// (trace copies, [T, H*D]) when not null.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_cache(const float* q, int q_stride, const float* k_cache, const float* v_cache,
                                           const int* key_pos, int rows, const int* step, int H, int Hkv, int D,
                                           int window, double scale, const float* gate, int gate_stride, float* out,
                                           float* attn_out, float* gate_sig) {
    __shared__ AttendShared sh;
    int h = blockIdx.x, t = blockIdx.y, kv = h / (H / Hkv);
    CacheVisible visible = {key_pos, step[1 + t], window};
    float o[ATT_DIMS];
    attend(q + (i64)t * q_stride + h * D, k_cache + kv * D, v_cache + kv * D, (i64)Hkv * D, 0, imin(rows, step[0]),
           D, scale, visible, sh, o);
    if (threadIdx.x >= ATT_DIM_THREADS) return;  // the first group holds the result
    for (int i = 0; i * ATT_DIM_THREADS + threadIdx.x < D; i++) {
        int d = h * D + i * ATT_DIM_THREADS + threadIdx.x;
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

// grid (H, T), block (ATT_THREADS). q [T, H, D], k/v [S, Hkv, D], mask [T, S] (nonzero = visible) -> out [T, H, D]
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_mask(const float* q, const float* k, const float* v, const u8* mask, int S,
                                          int H, int Hkv, int D, double scale, float* out) {
    __shared__ AttendShared sh;
    int h = blockIdx.x, t = blockIdx.y, kv = h / (H / Hkv);
    MaskVisible visible = {mask + (i64)t * S};
    float o[ATT_DIMS];
    attend(q + ((i64)t * H + h) * D, k + kv * D, v + kv * D, (i64)Hkv * D, 0, S, D, scale, visible, sh, o);
    if (threadIdx.x >= ATT_DIM_THREADS) return;
    for (int i = 0; i * ATT_DIM_THREADS + threadIdx.x < D; i++) out[((i64)t * H + h) * D + i * ATT_DIM_THREADS + threadIdx.x] = o[i];
}

// grid (H, T), block (ATT_THREADS). q/k/v [N, H, D] (no GQA); query t sees keys [start[t], stop[t]) -> out [T, H, D]
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_spans(const float* q, const float* k, const float* v, const int* start,
                                           const int* stop, int H, int D, double scale, float* out) {
    __shared__ AttendShared sh;
    int h = blockIdx.x, t = blockIdx.y;
    float o[ATT_DIMS];
    attend(q + ((i64)t * H + h) * D, k + h * D, v + h * D, (i64)H * D, start[t], stop[t], D, scale, AllVisible(),
           sh, o);
    if (threadIdx.x >= ATT_DIM_THREADS) return;
    for (int i = 0; i * ATT_DIM_THREADS + threadIdx.x < D; i++) out[((i64)t * H + h) * D + i * ATT_DIM_THREADS + threadIdx.x] = o[i];
}
