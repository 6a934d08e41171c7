// Products y = x W^T with W a GGUF tensor [n_out, n_in] in its quantized blocks, in device memory.
//
// Numerics: 8 exact weights times 8 float32 activations are summed in float32 by dot8 (fixed
// order), the sums of the groups in float64, rounded once to float32. The decode kernel (matvec)
// and the prefill kernel (matmul) form the same group sums, so a token's row depends on the batch
// only through the float64 order of the group sums.
//
// matvec: one block per R output rows and one token per blockIdx.y (decode and draft verification:
//   T of 1 to a few). The block's warps split the row: warp w takes the 256-value chunks c = w,
//   w + n_warps, ... (a chunk is one K-quant super-block or eight 32-value blocks), lane l the
//   values [256 c + 8 l, +8) of each, so a warp reads contiguous block bytes and the 8 activations
//   a lane loads serve its R rows. MV_UNROLL chunks are decoded per step so that their loads are in
//   flight together. The warps' float64 sums meet in shared memory and are added in warp order: the
//   result is the same from launch to launch. A block takes row groups blockIdx.x, + gridDim.x, ...
//   so that its copy of the IQ tables into shared memory serves many rows. Splitting the row over warps keeps thousands of small
//   independent loads in flight, which is what the bandwidth of a 2-bit matrix needs (one warp per
//   4 rows ran at 4.5 % of an H200's 4.8 TB/s); R, the warps and MV_UNROLL were chosen by
//   `python -m accel.cuda_harness tune` on an H200 (launch.py).
// matmul: 64 rows x 64 tokens per block of 256 threads (prefill). A K-step of 64 values is decoded
//   once into shared memory and multiplied with 64 tokens; each thread keeps 4 x 4 sums.
#include "dequant.cu"

#ifndef MV_UNROLL
#define MV_UNROLL 1
#endif
#define MV_MAX_WARPS 8
#define MV_MAX_ROWS 4
#define MM_ROWS 64
#define MM_TOKENS 64
#define MM_K 64
#define MM_STRIDE (MM_K + 1)  // padding: rows of the tiles fall in different shared-memory banks

template <int QT, int R>
__device__ void matvec(const u8* W, i64 row_bytes, int n_out, int n_in, const float* x, int x_stride,
                       float* y, int y_stride, const u8* tab, double* partial, unsigned long long* tab_shared) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    if (READS_TAB(QT)) {
        for (int i = threadIdx.x; i < TAB_BYTES / 8; i += blockDim.x) tab_shared[i] = ld_row8(tab + 8 * i);
        __syncthreads();
        tab = (const u8*)tab_shared;
    }
    const float* xt = x + (i64)blockIdx.y * x_stride;
    for (int r0 = blockIdx.x * R; r0 < n_out; r0 += gridDim.x * R) {  // the block's row groups
        double acc[R];
        for (int r = 0; r < R; r++) acc[r] = 0.0;
        for (int c0 = 256 * warp + 8 * lane; c0 < n_in; c0 += 256 * n_warps * MV_UNROLL) {
#pragma unroll
            for (int u = 0; u < MV_UNROLL; u++) {
                int v0 = c0 + 256 * n_warps * u;
                if (v0 < n_in) {
                    float xv[8], w[8];
                    for (int j = 0; j < 8; j++) xv[j] = xt[v0 + j];
                    for (int r = 0; r < R; r++) {
                        if (r0 + r < n_out) {
                            decode8<QT>(W + (i64)(r0 + r) * row_bytes, v0, tab, w);
                            acc[r] += (double)dot8(w, xv);
                        }
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) {
            double total = warp_sum(acc[r]);  // every lane gets here, whatever its trip count
            if (lane == 0) partial[warp * R + r] = total;
        }
        __syncthreads();
        if (threadIdx.x < R && r0 + threadIdx.x < n_out) {
            double total = 0.0;
            for (int v = 0; v < n_warps; v++) total += partial[v * R + threadIdx.x];
            y[(i64)blockIdx.y * y_stride + r0 + threadIdx.x] = (float)total;
        }
        __syncthreads();  // partial is read before the next group writes it
    }
}

template <int QT>
__device__ void matmul(const u8* W, i64 row_bytes, int n_out, int n_in, const float* x, int x_stride,
                       float* y, int y_stride, int T, const u8* tab, float* w_tile, float* x_tile) {
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // tokens tx + 16 b, rows ty + 16 a
    int row0 = blockIdx.x * MM_ROWS, tok0 = blockIdx.y * MM_TOKENS;
    double acc[4][4];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) acc[a][b] = 0.0;
    for (int k0 = 0; k0 < n_in; k0 += MM_K) {
        for (int i = threadIdx.x; i < MM_ROWS * (MM_K / 8); i += blockDim.x) {
            int r = i / (MM_K / 8), v0 = k0 + i % (MM_K / 8) * 8;
            float w[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // rows and values past the end multiply as zeros
            if (row0 + r < n_out && v0 < n_in) decode8<QT>(W + (i64)(row0 + r) * row_bytes, v0, tab, w);
            for (int j = 0; j < 8; j++) w_tile[r * MM_STRIDE + v0 - k0 + j] = w[j];
        }
        for (int i = threadIdx.x; i < MM_TOKENS * MM_K; i += blockDim.x) {
            int t = i / MM_K, k = i % MM_K;
            bool inside = tok0 + t < T && k0 + k < n_in;
            x_tile[t * MM_STRIDE + k] = inside ? x[(i64)(tok0 + t) * x_stride + k0 + k] : 0.0f;
        }
        __syncthreads();
        for (int g = 0; g < MM_K; g += 8)
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++)
                    acc[a][b] += (double)dot8(&w_tile[(ty + 16 * a) * MM_STRIDE + g], &x_tile[(tx + 16 * b) * MM_STRIDE + g]);
        __syncthreads();
    }
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) {
            int r = row0 + ty + 16 * a, t = tok0 + tx + 16 * b;
            if (r < n_out && t < T) y[(i64)t * y_stride + r] = (float)acc[a][b];
        }
}

// block (32 x warps, at most MV_MAX_WARPS), grid (up to ceil(n_out / rows), T); rows 1, 2 or 4 (MV_MAX_ROWS)
extern "C" __global__ void matvec_rows(int qtype, const u8* W, i64 row_bytes, int n_out, int n_in, const float* x,
                                       int x_stride, float* y, int y_stride, const u8* tab, int rows) {
    __shared__ double partial[MV_MAX_WARPS * MV_MAX_ROWS];
    __shared__ unsigned long long tab_shared[TAB_BYTES / 8];
#define MATVEC_R(QT, R) matvec<QT, R>(W, row_bytes, n_out, n_in, x, x_stride, y, y_stride, tab, partial, tab_shared)
#define MATVEC(QT) \
    switch (rows) { case 1: MATVEC_R(QT, 1); break; case 2: MATVEC_R(QT, 2); break; default: MATVEC_R(QT, 4); }
    DISPATCH_QTYPE(qtype, MATVEC)
}

// block (256), grid (ceil(n_out / 64), ceil(T / 64))
extern "C" __global__ void matmul_tiled(int qtype, const u8* W, i64 row_bytes, int n_out, int n_in, const float* x,
                                        int x_stride, float* y, int y_stride, int T, const u8* tab) {
    // the tiles are declared here, once: shared arrays inside the template would be one per type
    __shared__ float w_tile[MM_ROWS * MM_STRIDE];
    __shared__ float x_tile[MM_TOKENS * MM_STRIDE];
#define MATMUL(QT) matmul<QT>(W, row_bytes, n_out, n_in, x, x_stride, y, y_stride, T, tab, w_tile, x_tile)
    DISPATCH_QTYPE(qtype, MATMUL)
}

// Exact float32 rows [first, first + n_rows) of W -> out [n_rows, n_in]: one thread per 8 values.
extern "C" __global__ void dequantize_rows(int qtype, const u8* W, i64 row_bytes, int n_in, int first, int n_rows,
                                           float* out, const u8* tab) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    int per_row = n_in / 8;
    if (i >= (i64)n_rows * per_row) return;
    int r = (int)(i / per_row), v0 = (int)(i % per_row) * 8;
#define DEQUANTIZE(QT) decode8<QT>(W + (i64)(first + r) * row_bytes, v0, tab, out + (i64)r * n_in + v0)
    DISPATCH_QTYPE(qtype, DEQUANTIZE)
}
