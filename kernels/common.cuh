// Helpers every kernel source starts with (the executor prepends this file before NVRTC
// compiles a source, together with `#define BLOCK_TOKENS`, the KV block size of `engine::kv`).
// NVRTC compiles without the C library headers, so the few constants needed are defined here.

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

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
