// The paged KV cache (f16 bits): per layer `[blocks * BLOCK_TOKENS, kv_dim]` for keys and for
// values, `layer_stride` elements apart. A position lives in slot `block * BLOCK_TOKENS + offset`.

// Rotary position embedding of the step's new rows fused with their KV write, for one layer,
// from the stacked q/k/v projection `qkv` (rows of `row_stride`: the queries' `heads`, the
// keys' and the values' `kv_heads` heads of `head_dim`): the rotated queries into
// `q [rows, heads, head_dim]`; the rotated keys, with the values, into the row's cache slot
// (none for a padding row's negative slot). One thread per rotated pair of dimensions, of a
// query head or a KV head. `interleaved` rotates adjacent pairs (GGUF llama's permuted q/k),
// otherwise the two halves.
extern "C" __global__ void rope_kv_append(const float* qkv, float* q, const int* positions,
                                          const int* slots, const float* inv_freq,
                                          unsigned short* k_cache, unsigned short* v_cache,
                                          long long layer_offset, int rows, int row_stride,
                                          int heads, int kv_heads, int head_dim,
                                          int interleaved) {
    const int half = head_dim / 2;
    const int all_heads = heads + kv_heads;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * all_heads * half) return;
    const int pair = i % half;
    const int head = (i / half) % all_heads;
    const int row = i / ((long long)half * all_heads);
    float sin_angle, cos_angle;
    sincosf((float)positions[row] * inv_freq[pair], &sin_angle, &cos_angle);
    const int a = interleaved ? 2 * pair : pair;
    const int b = interleaved ? 2 * pair + 1 : pair + half;
    // Heads lie in the row's order (queries, keys), so `head` indexes both.
    const float* x = qkv + (long long)row * row_stride + (long long)head * head_dim;
    const float x0 = x[a], x1 = x[b];
    const float r0 = x0 * cos_angle - x1 * sin_angle;
    const float r1 = x0 * sin_angle + x1 * cos_angle;
    if (head < heads) {
        float* dst = q + ((long long)row * heads + head) * head_dim;
        dst[a] = r0;
        dst[b] = r1;
        return;
    }
    const int slot = slots[row];
    if (slot < 0) return;
    const int kv_head = head - heads;
    const int kv_dim = kv_heads * head_dim;
    const float* value = x + kv_dim;
    const long long dst = layer_offset + (long long)slot * kv_dim + (long long)kv_head * head_dim;
    k_cache[dst + a] = to_kv(r0);
    k_cache[dst + b] = to_kv(r1);
    v_cache[dst + a] = to_kv(value[a]);
    v_cache[dst + b] = to_kv(value[b]);
}

// Copies whole blocks `from[p]` -> `to[p]` in every layer (a forked prefix gets its own copy).
extern "C" __global__ void kv_copy_blocks(unsigned short* k_cache, unsigned short* v_cache,
                                          const int* from, const int* to, int pairs, int layers,
                                          long long layer_stride, int kv_dim) {
    const int block_elems = BLOCK_TOKENS * kv_dim;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)pairs * layers * block_elems) return;
    const int e = i % block_elems;
    const long long pair_layer = i / block_elems;
    const int layer = pair_layer % layers;
    const int pair = pair_layer / layers;
    const long long base = layer * layer_stride + e;
    const long long src = base + (long long)from[pair] * block_elems;
    const long long dst = base + (long long)to[pair] * block_elems;
    k_cache[dst] = k_cache[src];
    v_cache[dst] = v_cache[src];
}
