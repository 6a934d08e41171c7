// Helpers every kernel file includes: fixed-width loads from GGUF blocks, float16/bfloat16 bits,
// warp and block reductions. No headers: NVRTC (CuPy's RawModule) has none, and the same source
// compiles as plain C++ for the CPU tests (tests/test_cuda.py), where __CUDA_ARCH__ is undefined.
//
// The kernels are built with -fmad=false so that `a * b + c` rounds twice, as NumPy does; the
// float64 sums that want a fused multiply-add say so with fma().
#ifndef MG_COMMON_CU
#define MG_COMMON_CU

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define WARP 32
#define FULL_MASK 0xffffffffu

__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float bits_float(u32 b) { return __uint_as_float(b); }
__device__ __forceinline__ double bits_double(unsigned long long b) { return __longlong_as_double((long long)b); }
__device__ __forceinline__ int popcount(u32 v) { return __popc(v); }
__device__ __forceinline__ float half_float(u16 h) {  // one cvt instruction
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
__host__ __device__ __forceinline__ float bits_float(u32 b) { float f; __builtin_memcpy(&f, &b, 4); return f; }
__host__ __device__ __forceinline__ double bits_double(unsigned long long b) { double f; __builtin_memcpy(&f, &b, 8); return f; }
__host__ __device__ __forceinline__ int popcount(u32 v) { return __builtin_popcount(v); }
__host__ __device__ __forceinline__ float half_float(u16 h) {  // IEEE binary16 -> binary32, exact
    u32 sign = (u32)(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
    if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
    if (mant == 0) return bits_float(sign);
    int shift = 0;  // subnormal: normalize the mantissa
    while (!(mant & 1024)) { mant <<= 1; shift++; }
    return bits_float(sign | ((u32)(113 - shift) << 23) | ((mant & 1023) << 13));
}
#endif

__host__ __device__ __forceinline__ float bfloat_float(u16 h) { return bits_float((u32)h << 16); }
__host__ __device__ __forceinline__ double neg_inf() { return bits_double(0xfff0000000000000ull); }

// Little-endian loads from a GGUF block. Every 16-bit field of every block type sits at an even
// offset and every block size is even, so 2-byte loads are aligned on the device; the CPU build of
// the tests checks it (MG_CHECK_ALIGNED), since an odd address would fault only on the device.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ u32 ld16(const u8* p) { return *(const u16*)p; }
#else
#ifndef MG_CHECK_ALIGNED
#define MG_CHECK_ALIGNED(p, n)
#endif
__host__ __device__ __forceinline__ u32 ld16(const u8* p) {
    MG_CHECK_ALIGNED(p, 2);
    u16 v;
    __builtin_memcpy(&v, p, 2);
    return v;
}
#endif
__host__ __device__ __forceinline__ u32 ld32(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }
__host__ __device__ __forceinline__ float ld_half(const u8* p) { return half_float((u16)ld16(p)); }

// Butterfly sums over a warp: every lane ends with the same total, in a fixed order.
__device__ __forceinline__ double warp_sum(double v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
}

__device__ __forceinline__ double warp_max(double v) {
    for (int m = 16; m > 0; m >>= 1) v = fmax(v, __shfl_xor_sync(FULL_MASK, v, m));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets the
// total. `scratch` is a __shared__ double[32] the caller owns; called by all threads.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < n_warps; w++) total += scratch[w];
    return total;
}

__device__ __forceinline__ double block_max(double v, double* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double best = neg_inf();
    for (int w = 0; w < n_warps; w++) best = fmax(best, scratch[w]);
    return best;
}

#endif
