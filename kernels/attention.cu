// Causal attention of each new row over its own sequence's paged KV, for ragged batches: one
// warp per (query head, row), grid (heads, rows). Lanes split the head dimensions; positions
// are visited in order with an online softmax, so no score buffer grows with the context.
// A sliding-window layer (`window` > 0) reads only the row's last `window` positions.
#define MAX_DIMS_PER_LANE 8

extern "C" __global__ void paged_attention(const float* q, const unsigned short* k_cache,
                                           const unsigned short* v_cache, float* out,
                                           const int* row_positions, const int* row_tables,
                                           const int* block_table, long long layer_offset,
                                           int heads, int kv_heads, int head_dim, float scale,
                                           int window) {
    const int head = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    const int kv_head = head / (heads / kv_heads);
    const int kv_dim = kv_heads * head_dim;
    const float* query = q + ((long long)row * heads + head) * head_dim;
    const int* table = block_table + row_tables[row];
    const int visible = row_positions[row] + 1;
    float qv[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
    for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
        const int d = lane + 32 * t;
        qv[t] = d < head_dim ? query[d] : 0.0f;
        acc[t] = 0.0f;
    }
    float running_max = -INFINITY, denominator = 0.0f;
    const int first = window > 0 && visible > window ? visible - window : 0;
    for (int j = first; j < visible; j++) {
        const long long slot = (long long)table[j / BLOCK_TOKENS] * BLOCK_TOKENS + j % BLOCK_TOKENS;
        const long long at = layer_offset + slot * kv_dim + (long long)kv_head * head_dim;
        float partial = 0.0f;
        for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
            const int d = lane + 32 * t;
            if (d < head_dim) partial += qv[t] * from_kv(k_cache[at + d]);
        }
        const float score = warp_sum(partial) * scale;
        const float new_max = fmaxf(running_max, score);
        const float correction = expf(running_max - new_max);
        const float p = expf(score - new_max);
        denominator = denominator * correction + p;
        for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
            const int d = lane + 32 * t;
            if (d < head_dim) acc[t] = acc[t] * correction + p * from_kv(v_cache[at + d]);
        }
        running_max = new_max;
    }
    float* dst = out + ((long long)row * heads + head) * head_dim;
    for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
        const int d = lane + 32 * t;
        if (d < head_dim) dst[d] = acc[t] / denominator;
    }
}
