// Per-row reductions of the logits that sampling and routing policies read: the maximum and
// its first index (greedy), Z' = Σ exp(l - max) and Σ exp(l - max)(l - max), from which the
// host gets max_prob = 1 / Z' and entropy = ln Z' - Σ e (l - max) / Z'. One block per row.

__device__ __forceinline__ void keep_better(float& value, int& index, float other_value,
                                            int other_index) {
    if (other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

// stats: [rows, 3] = (max, Z', Σ e·shift); argmax: [rows].
extern "C" __global__ void logit_stats(const float* logits, int vocab, float* stats,
                                       int* argmax) {
    __shared__ float best_values[32];
    __shared__ int best_indices[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float best = -INFINITY;
    int best_index = vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) keep_better(best, best_index, row[i], i);
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
        keep_better(best, best_index, other, other_index);
    }
    if (lane == 0) {
        best_values[warp] = best;
        best_indices[warp] = best_index;
    }
    __syncthreads();
    best = -INFINITY;
    best_index = vocab;
    for (int w = 0; w < (int)(blockDim.x / 32); w++) keep_better(best, best_index, best_values[w], best_indices[w]);
    float sum_exp = 0.0f, weighted = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float shifted = row[i] - best;
        const float e = expf(shifted);
        sum_exp += e;
        weighted += e * shifted;
    }
    sum_exp = block_sum(sum_exp);
    weighted = block_sum(weighted);
    if (threadIdx.x == 0) {
        stats[blockIdx.x * 3] = best;
        stats[blockIdx.x * 3 + 1] = sum_exp;
        stats[blockIdx.x * 3 + 2] = weighted;
        argmax[blockIdx.x] = best_index;
    }
}
