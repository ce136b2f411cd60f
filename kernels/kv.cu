// The paged KV cache (f16 bits): per layer `[blocks * BLOCK_TOKENS, kv_dim]` for keys and for
// values, `layer_stride` elements apart. A position lives in slot `block * BLOCK_TOKENS + offset`.

// Writes each new row's key and value into its slot of one layer; a padding row (slot < 0)
// writes nothing.
extern "C" __global__ void kv_append(const float* k, const float* v, const int* slots,
                                     unsigned short* k_cache, unsigned short* v_cache,
                                     long long layer_offset, int rows, int kv_dim) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * kv_dim) return;
    const int slot = slots[i / kv_dim];
    if (slot < 0) return;
    const long long dst = layer_offset + (long long)slot * kv_dim + i % kv_dim;
    k_cache[dst] = to_kv(k[i]);
    v_cache[dst] = to_kv(v[i]);
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
