// RMSNorm and LayerNorm, one block per row, with reference/ops.py's roundings: squares and
// differences in float32, their sums in float64, the mean rounded to float32, then the scale and
// every product in float32 (ops.rms_norm: ggml's rms_norm).
#include "common.cu"

#define NORM_THREADS 256

// 1 / sqrt(mean(x^2) + eps) of one row, as ops.rms_norm rounds it; called by every thread of the block
__device__ float rms_scale(const float* x, int n, float eps, double* scratch) {
    double sum_sq = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float square = x[j] * x[j];
        sum_sq += (double)square;
    }
    float mean = (float)(block_sum(sum_sq, scratch) / n);
    return 1.0f / sqrtf(mean + eps);
}

// grid (rows), block (256). The norm steps between the products of a Muse-Glimmer layer, fused:
//   a_n   = rms(a, eps1) * w1                      (w1 null: no weight; the embedding norm)
//   x_out = x + a_n                                 (x null: x_out = a_n)
//   u     = rms(x_out, eps2) * w2                  (u null: skipped)
// a rows are a_stride apart; x, x_out, u, a_normed are [rows, n] (x_out may be x). a_normed, a
// trace copy of a_n, may be null.
extern "C" __global__ void residual_norm(const float* a, int a_stride, const float* w1, float eps1, float* a_normed,
                                         const float* x, float* x_out, const float* w2, float eps2, float* u, int n) {
    __shared__ double scratch[WARP];
    i64 row = blockIdx.x;
    const float* ar = a + row * a_stride;
    float scale = rms_scale(ar, n, eps1, scratch);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float v = ar[j] * scale;
        if (w1) v = v * w1[j];
        if (a_normed) a_normed[row * n + j] = v;
        if (x) v = x[row * n + j] + v;
        x_out[row * n + j] = v;
    }
    if (!u) return;
    scale = rms_scale(x_out + row * n, n, eps2, scratch);  // each thread reads back the values it wrote
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float v = x_out[row * n + j] * scale;
        u[row * n + j] = w2 ? v * w2[j] : v;
    }
}

// grid (rows), block (256). ops.layer_norm: x [rows, n], w [n], b [n] -> out [rows, n]
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float eps, float* out, int n) {
    __shared__ double scratch[WARP];
    i64 row = blockIdx.x;
    const float* xr = x + row * n;
    double sum = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) sum += (double)xr[j];
    float mean = (float)(block_sum(sum, scratch) / n);
    double sum_sq = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        double c = (double)(xr[j] - mean);
        sum_sq += c * c;
    }
    float var = (float)(block_sum(sum_sq, scratch) / n);
    float std = sqrtf(var + eps);
    for (int j = threadIdx.x; j < n; j += blockDim.x) out[row * n + j] = (xr[j] - mean) / std * w[j] + b[j];
}
