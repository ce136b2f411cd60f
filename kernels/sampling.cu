// Per-row reductions of the logits that sampling and routing policies read. One thread block
// per row.

__device__ __forceinline__ void keep_better(float& value, int& index, float other_value,
                                            int other_index) {
    if (other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

// The block's largest (value, index), lowest index on ties; every thread gets it.
__device__ void block_argmax(float& value, int& index) {
    __shared__ float values[32];
    __shared__ int indices[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
        keep_better(value, index, other, other_index);
    }
    __syncthreads();
    if (lane == 0) {
        values[warp] = value;
        indices[warp] = index;
    }
    __syncthreads();
    for (int w = 0; w < (int)(blockDim.x / 32); w++) keep_better(value, index, values[w], indices[w]);
}

// The maximum and its first index (greedy), Z' = Σ exp(l - max) and Σ exp(l - max)(l - max),
// from which the host gets max_prob = 1 / Z' and entropy = ln Z' - Σ e (l - max) / Z'.
// stats: [rows, 3] = (max, Z', Σ e·shift); argmax: [rows].
extern "C" __global__ void logit_stats(const float* logits, int vocab, float* stats,
                                       int* argmax) {
    const float* row = logits + (long long)blockIdx.x * vocab;
    float best = -INFINITY;
    int best_index = vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) keep_better(best, best_index, row[i], i);
    block_argmax(best, best_index);
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

// The k largest logits, largest first (lowest index on ties), as the host's `top_logits`:
// k passes, each an argmax over the entries ranked after the previous pick (value
// descending, index ascending). indices and values: [rows, k].
extern "C" __global__ void top_k(const float* logits, int vocab, int k, int* indices,
                                 float* values) {
    const float* row = logits + (long long)blockIdx.x * vocab;
    float last = INFINITY;
    int last_index = -1;
    for (int pick = 0; pick < k && pick < vocab; pick++) {
        float best = -INFINITY;
        int best_index = vocab;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const bool after_last = row[i] < last || (row[i] == last && i > last_index);
            if (after_last) keep_better(best, best_index, row[i], i);
        }
        block_argmax(best, best_index);
        if (threadIdx.x == 0) {
            indices[(long long)blockIdx.x * k + pick] = best_index;
            values[(long long)blockIdx.x * k + pick] = best;
        }
        last = best;
        last_index = best_index;
    }
}
