// Integer-dot matmuls over the quantized weight formats, as the CPU path computes them:
// activations are quantized to 8 bits per block of 32 (scale = amax / 127, round half to
// even), and each weight block contributes d_w·d_x·Σ q_w q_x + offset_w · d_x·Σ q_x.
// Weights are stored per output column: a column's quant bytes are contiguous, block scales
// (and offsets: Q4_1's and Q5_1's minimum, Q4_0's -8·d, Q5_0's -16·d, a K-quant block's
// -dmin·m) are f32 arrays `[n_out, blocks_per_row]`; fifth bits one u32 per block (bit j for
// element j).

// One warp per activation block of 32.
extern "C" __global__ void quantize_q8(const float* x, signed char* quants, float* scales,
                                       float* scaled_sums, int blocks) {
    const int block = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (block >= blocks) return;
    const float v = x[(long long)block * 32 + lane];
    const float scale = warp_max(fabsf(v)) / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    const int q = (int)rintf(v * inverse);
    quants[(long long)block * 32 + lane] = (signed char)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) {
        scales[block] = scale;
        scaled_sums[block] = scale * (float)sum;
    }
}

// out[row, col] over Q8_0 weights: one warp per (column, row), lanes over blocks.
extern "C" __global__ void qmatmul_q8_0(const signed char* w, const float* w_scales,
                                        const signed char* xq, const float* x_scales, float* out,
                                        int n_out, int blocks_per_row) {
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int row = blockIdx.y, lane = threadIdx.x % 32;
    if (col >= n_out) return;
    const int* w_col = (const int*)(w + (long long)col * blocks_per_row * 32);
    const int* x_row = (const int*)(xq + (long long)row * blocks_per_row * 32);
    float acc = 0.0f;
    for (int b = lane; b < blocks_per_row; b += 32) {
        int dot = 0;
        for (int i = 0; i < 8; i++) dot = __dp4a(w_col[b * 8 + i], x_row[b * 8 + i], dot);
        acc += (float)dot * (w_scales[(long long)col * blocks_per_row + b] *
                             x_scales[(long long)row * blocks_per_row + b]);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(long long)row * n_out + col] = acc;
}

// out[row, col] over Q4_0 / Q4_1 weights (16 bytes per block: element j in the low nibble of
// byte j, element j + 16 in its high nibble).
extern "C" __global__ void qmatmul_q4(const unsigned char* w, const float* w_scales,
                                      const float* w_offsets, const signed char* xq,
                                      const float* x_scales, const float* x_scaled_sums,
                                      float* out, int n_out, int blocks_per_row) {
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int row = blockIdx.y, lane = threadIdx.x % 32;
    if (col >= n_out) return;
    const int* w_col = (const int*)(w + (long long)col * blocks_per_row * 16);
    const int* x_row = (const int*)(xq + (long long)row * blocks_per_row * 32);
    float acc = 0.0f;
    for (int b = lane; b < blocks_per_row; b += 32) {
        int dot = 0;
        for (int i = 0; i < 4; i++) {
            const int packed = w_col[b * 4 + i];
            dot = __dp4a(packed & 0x0F0F0F0F, x_row[b * 8 + i], dot);
            dot = __dp4a((packed >> 4) & 0x0F0F0F0F, x_row[b * 8 + 4 + i], dot);
        }
        const long long wb = (long long)col * blocks_per_row + b;
        const long long xb = (long long)row * blocks_per_row + b;
        acc += (float)dot * (w_scales[wb] * x_scales[xb]) + w_offsets[wb] * x_scaled_sums[xb];
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(long long)row * n_out + col] = acc;
}

// Four fifth bits (bit i for byte i) as a byte's 16 each.
__device__ __forceinline__ int fifth_bits(unsigned int bits) {
    return (int)(((bits & 1u) << 4) | ((bits & 2u) << 11) | ((bits & 4u) << 18) |
                 ((bits & 8u) << 25));
}

// out[row, col] over Q5_0 / Q5_1 weights: Q4's nibbles with their fifth bits.
extern "C" __global__ void qmatmul_q5(const unsigned char* w, const unsigned int* w_high,
                                      const float* w_scales, const float* w_offsets,
                                      const signed char* xq, const float* x_scales,
                                      const float* x_scaled_sums, float* out, int n_out,
                                      int blocks_per_row) {
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int row = blockIdx.y, lane = threadIdx.x % 32;
    if (col >= n_out) return;
    const int* w_col = (const int*)(w + (long long)col * blocks_per_row * 16);
    const int* x_row = (const int*)(xq + (long long)row * blocks_per_row * 32);
    float acc = 0.0f;
    for (int b = lane; b < blocks_per_row; b += 32) {
        const long long wb = (long long)col * blocks_per_row + b;
        const long long xb = (long long)row * blocks_per_row + b;
        const unsigned int high = w_high[wb];
        int dot = 0;
        for (int i = 0; i < 4; i++) {
            const int packed = w_col[b * 4 + i];
            const int low = (packed & 0x0F0F0F0F) | fifth_bits(high >> (4 * i));
            const int upper = ((packed >> 4) & 0x0F0F0F0F) | fifth_bits(high >> (16 + 4 * i));
            dot = __dp4a(low, x_row[b * 8 + i], dot);
            dot = __dp4a(upper, x_row[b * 8 + 4 + i], dot);
        }
        acc += (float)dot * (w_scales[wb] * x_scales[xb]) + w_offsets[wb] * x_scaled_sums[xb];
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(long long)row * n_out + col] = acc;
}
