// Helpers every kernel source starts with (the executor prepends this file before NVRTC
// compiles a source, together with `#define BLOCK_TOKENS`, the KV block size of `engine::kv`).
// NVRTC compiles without the C library headers, so the few constants needed are defined here.

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// The KV cache holds f16 bits (like the CPU cache); PTX conversions, since NVRTC compiles
// without cuda_fp16.h.
__device__ __forceinline__ unsigned short to_kv(float v) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    return bits;
}

__device__ __forceinline__ float from_kv(unsigned short bits) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(bits));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the thread block (blockDim.x a multiple of 32); every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.0f;
    return warp_sum(v);
}
