// Causal attention of each new row over its own sequence's paged KV, for ragged batches: one
// thread block per (KV head, row), grid (kv_heads, rows), one warp per query head of the KV
// head's group, so the group reads each key and value row from the same SM's cache (GQA).
// Positions go by in tiles of 32: lane j
// scores the tile's position j (a whole dot product with the query, kept in shared memory),
// the tile's terms fold into an online softmax, and the lanes, split over the head dimensions,
// add the tile's values. So a position costs a lane's dot product, not a warp reduction, and
// no score buffer grows with the context. A sliding-window layer (`window` > 0) reads only the
// row's last `window` positions.
#define MAX_DIMS_PER_LANE 8
#define FULL_WARP 0xffffffffu

extern "C" __global__ void paged_attention(const float* q, const unsigned short* k_cache,
                                           const unsigned short* v_cache, float* out,
                                           const int* row_positions, const int* row_tables,
                                           const int* block_table, long long layer_offset,
                                           int heads, int kv_heads, int head_dim, float scale,
                                           int window) {
    // The group's queries, `head_dim` floats per warp (the launch sizes it).
    extern __shared__ float queries[];
    const int kv_head = blockIdx.x, row = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = kv_head * (heads / kv_heads) + warp;
    const int kv_dim = kv_heads * head_dim;
    float* query = queries + warp * head_dim;
    const float* q_row = q + ((long long)row * heads + head) * head_dim;
    for (int d = lane; d < head_dim; d += 32) query[d] = q_row[d];
    __syncwarp();
    const int* table = block_table + row_tables[row];
    const int visible = row_positions[row] + 1;
    const int first = window > 0 && visible > window ? visible - window : 0;
    const long long head_offset = layer_offset + (long long)kv_head * head_dim;
    float acc[MAX_DIMS_PER_LANE];
    for (int t = 0; t < MAX_DIMS_PER_LANE; t++) acc[t] = 0.0f;
    float running_max = -INFINITY, denominator = 0.0f;
    for (int tile = first; tile < visible; tile += 32) {
        const int j = tile + lane;
        const bool inside = j < visible;
        long long at = 0;
        float score = -INFINITY;
        if (inside) {
            const long long slot =
                (long long)table[j / BLOCK_TOKENS] * BLOCK_TOKENS + j % BLOCK_TOKENS;
            at = head_offset + slot * kv_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) dot += query[d] * from_kv(k_cache[at + d]);
            score = dot * scale;
        }
        // The first position is inside every tile, so the new maximum is finite.
        const float new_max = fmaxf(running_max, warp_max(score));
        const float correction = expf(running_max - new_max);
        const float p = inside ? expf(score - new_max) : 0.0f;
        denominator = denominator * correction + warp_sum(p);
        for (int t = 0; t < MAX_DIMS_PER_LANE; t++) acc[t] *= correction;
        const int count = min(32, visible - tile);
        for (int i = 0; i < count; i++) {
            const float weight = __shfl_sync(FULL_WARP, p, i);
            const long long value_at = __shfl_sync(FULL_WARP, at, i);
            for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
                const int d = lane + 32 * t;
                if (d < head_dim) acc[t] += weight * from_kv(v_cache[value_at + d]);
            }
        }
        running_max = new_max;
    }
    float* dst = out + ((long long)row * heads + head) * head_dim;
    for (int t = 0; t < MAX_DIMS_PER_LANE; t++) {
        const int d = lane + 32 * t;
        if (d < head_dim) dst[d] = acc[t] / denominator;
    }
}
