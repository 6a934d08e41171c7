// Elementwise activations with reference/ops.py's float32 operation order. exp, tanh and erf are
// taken in float64 and rounded: within an ulp of NumPy's float32 functions.
#include "common.cu"

#define SQRT2 1.4142135623730951  // np.sqrt(2), the float64 divisor of ops.gelu_erf

__device__ __forceinline__ i64 flat_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }

// grid (ceil(n / 256)), block (256) for all of these
extern "C" __global__ void sigmoid_flat(const float* x, float* out, i64 n) {
    i64 i = flat_index();
    if (i < n) out[i] = 1.0f / (1.0f + (float)exp(-(double)x[i]));
}

// ops.swiglu: silu(gate) * up
extern "C" __global__ void swiglu_flat(const float* gate, const float* up, float* out, i64 n) {
    i64 i = flat_index();
    if (i < n) out[i] = gate[i] / (1.0f + (float)exp(-(double)gate[i])) * up[i];
}

// z * scale, then ops.softcap (tanh(z * f32(1/cap)) * cap; cap 0 = none): the logits of the text model
extern "C" __global__ void scale_softcap_flat(const float* z, float* out, i64 n, float scale, float inv_cap, float cap) {
    i64 i = flat_index();
    if (i >= n) return;
    float v = z[i] * scale;
    out[i] = cap == 0.0f ? v : (float)tanh((double)(v * inv_cap)) * cap;
}

// ops.gelu_erf: 0.5 * x in float32, times 1 + erf(x / sqrt 2) in float64, one rounding
extern "C" __global__ void gelu_erf_flat(const float* x, float* out, i64 n) {
    i64 i = flat_index();
    if (i < n) out[i] = (float)((double)(0.5f * x[i]) * (1.0 + erf((double)x[i] / SQRT2)));
}

// y [rows, n] (rows y_stride apart) += b [n]
extern "C" __global__ void add_bias(float* y, int y_stride, const float* b, i64 rows, int n) {
    i64 i = flat_index();
    if (i < rows * n) y[i / n * y_stride + i % n] = y[i / n * y_stride + i % n] + b[i % n];
}
