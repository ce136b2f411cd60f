// Integer-dot matmuls over the quantized weight formats, as the CPU path computes them:
// activations are quantized to 8 bits by the rule ggml pairs with each weight format
// (`engine::qmatmul::activations`: per block of 32, d = amax / 127 kept as f16 and
// q = round(x / d) half away from zero; Q8_1 adds s = f16(f16(sum q) * d); per superblock of
// 256, Q8_K's d = 1 / (-127 / max) in f32), and each weight block contributes
// d_w·d_x·sum(q_w q_x) + offset_w · s_x.
// Weights are stored per output column: a column's quant bytes are contiguous, block scales
// (and offsets: Q4_1's and Q5_1's minimum, Q4_0's -8·d, Q5_0's -16·d, a K-quant block's
// -dmin·m) are f32 arrays `[n_out, blocks_per_row]` (Q6_K: one per half block, no offset);
// fifth bits one u32 per block (bit j for element j).

__device__ __forceinline__ float round_to_f16(float v) { return from_kv(to_kv(v)); }

// Activation formats, as `ActivationFormat` numbers them.
#define ACTIVATIONS_Q8_0 0
#define ACTIVATIONS_Q8_1 1
#define ACTIVATIONS_Q8_K 2

// Q8_0 and Q8_1: one warp per activation block of 32, lane l holding element l (`v`).
__device__ void quantize_block32(float v, signed char* quants, float* scales,
                                 float* scaled_sums, long long block, int format) {
    const int lane = threadIdx.x % 32;
    const float d = warp_max(fabsf(v)) / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)roundf(v * inverse);
    quants[block * 32 + lane] = (signed char)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) {
        const float scale = round_to_f16(d);
        scales[block] = scale;
        scaled_sums[block] = format == ACTIVATIONS_Q8_1
                                 ? round_to_f16(round_to_f16((float)sum) * scale)
                                 : scale * (float)sum;
    }
}

// Q8_K: one warp per superblock of 256, lane l holding element l of each of its 8 blocks
// (`v[b]`). `max` is the first value of the largest magnitude, as ggml picks it.
__device__ void quantize_superblock(const float* v, signed char* quants, float* scales,
                                    float* scaled_sums, long long superblock) {
    const int lane = threadIdx.x % 32;
    const long long first = superblock * 256;
    float amax = 0.0f;
    for (int b = 0; b < 8; b++) amax = fmaxf(amax, fabsf(v[b]));
    amax = warp_max(amax);
    int at = 256;
    for (int b = 7; b >= 0; b--)
        if (fabsf(v[b]) == amax) at = b * 32 + lane;
    for (int offset = 16; offset > 0; offset >>= 1)
        at = min(at, __shfl_xor_sync(0xffffffffu, at, offset));
    const float max = __shfl_sync(0xffffffffu, v[at / 32 < 8 ? at / 32 : 0], at % 32);
    const float inverse = amax > 0.0f ? -127.0f / max : 0.0f;
    const float d = amax > 0.0f ? 1.0f / inverse : 0.0f;
    for (int b = 0; b < 8; b++) {
        const int q = (int)fminf(fmaxf(roundf(inverse * v[b]), -128.0f), 127.0f);
        quants[first + b * 32 + lane] = (signed char)q;
        const int sum = warp_sum_int(q);
        if (lane == 0) {
            scales[superblock * 8 + b] = d;
            scaled_sums[superblock * 8 + b] = d * (float)sum;
        }
    }
}

// How a fused kernel's activations (rows of `dim`) are formed before they are quantized.
#define SOURCE_PLAIN 0   // x
#define SOURCE_SILU 1    // silu(gate) * up, x the stacked gate/up rows of 2 * dim (SwiGLU)
#define SOURCE_GELU 2    // gelu_tanh(gate) * up, likewise (GeGLU)
#define SOURCE_NORMED 3  // x * scale * weight (RMSNorm; `scale` the row's)

// Element i of the activations; the expressions of `rms_norm`, `silu_mul` and
// `gelu_tanh_mul`, so a fused kernel quantizes the very values the unfused steps would.
__device__ __forceinline__ float source_value(int source, const float* x, const float* weight,
                                              float scale, long long i, int dim) {
    if (source == SOURCE_PLAIN) return x[i];
    if (source == SOURCE_NORMED) return x[i] * scale * weight[i % dim];
    const long long at = (i / dim) * 2 * dim + i % dim;
    const float g = x[at];
    if (source == SOURCE_SILU) return g / (1.0f + expf(-g)) * x[at + dim];
    const float inner = 0.7978846f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanhf(inner)) * x[at + dim];
}

// Quantizes `unit` (a block of 32, or a superblock of 256 for Q8_K) of the activations.
__device__ void quantize_unit(int source, const float* x, const float* weight, float scale,
                              int dim, signed char* quants, float* scales, float* scaled_sums,
                              long long unit, int format) {
    const int lane = threadIdx.x % 32;
    if (format == ACTIVATIONS_Q8_K) {
        float v[8];
        for (int b = 0; b < 8; b++)
            v[b] = source_value(source, x, weight, scale, unit * 256 + b * 32 + lane, dim);
        quantize_superblock(v, quants, scales, scaled_sums, unit);
    } else {
        const float v = source_value(source, x, weight, scale, unit * 32 + lane, dim);
        quantize_block32(v, quants, scales, scaled_sums, unit, format);
    }
}

// One warp per unit: a block of 32 (Q8_0, Q8_1) or a superblock of 256 (Q8_K); `units`
// counts them. `source` is SOURCE_PLAIN, or a gated MLP's SOURCE_SILU / SOURCE_GELU over the
// stacked gate/up rows (the gating fused with the down projection's quantization).
extern "C" __global__ void quantize_q8(const float* x, signed char* quants, float* scales,
                                       float* scaled_sums, int units, int format, int source,
                                       int dim) {
    const int unit = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (unit >= units) return;
    quantize_unit(source, x, x, 1.0f, dim, quants, scales, scaled_sums, unit, format);
}

// RMSNorm fused with the quantization of its output (the next matmuls' input): one thread
// block per row of `dim`, its warps over the row's units after the block's sum of squares
// (the sum `rms_norm` takes, in its order). Where `keep`, the normed rows go to `normed` too
// (the output head's hidden states).
extern "C" __global__ void rms_norm_quantize_q8(const float* x, const float* weight, float eps,
                                                int dim, signed char* quants, float* scales,
                                                float* scaled_sums, int format, float* normed,
                                                int keep) {
    const long long row = blockIdx.x;
    const float* xr = x + row * dim;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) squares += xr[i] * xr[i];
    const float scale = 1.0f / sqrtf(block_sum(squares) / dim + eps);
    const int unit_len = format == ACTIVATIONS_Q8_K ? 256 : 32;
    const int units = dim / unit_len;
    for (int u = threadIdx.x / 32; u < units; u += blockDim.x / 32)
        quantize_unit(SOURCE_NORMED, x, weight, scale, dim, quants, scales, scaled_sums,
                      row * units + u, format);
    if (keep)
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            normed[row * dim + i] = xr[i] * scale * weight[i];
}

// The output element out[row, col] one warp of a qmatmul computes, its lanes taking every 32nd
// block of the column and the row; false for the warps past the last column.
struct OutputWarp {
    int col, row, lane;
    // The column's first weight block and the row's first activation block.
    long long w_block, x_block;
};

__device__ __forceinline__ bool output_warp(int n_out, int blocks_per_row, OutputWarp* o) {
    o->col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    o->row = blockIdx.y;
    o->lane = threadIdx.x % 32;
    o->w_block = (long long)o->col * blocks_per_row;
    o->x_block = (long long)o->row * blocks_per_row;
    return o->col < n_out;
}

// Sums the lanes' partial dot products into out[row, col] (rows `out_stride` apart: a matrix
// stacked beside others writes its columns of their shared rows), or adds them to it
// (`accumulate`: the residual add folded into the projection that feeds it).
__device__ __forceinline__ void store_output(const OutputWarp& o, float acc, float* out,
                                             int out_stride, int accumulate) {
    acc = warp_sum(acc);
    if (o.lane == 0) {
        float* dst = out + (long long)o.row * out_stride + o.col;
        *dst = accumulate ? *dst + acc : acc;
    }
}

// out[row, col] over Q8_0 weights: one warp per (column, row), lanes over blocks.
extern "C" __global__ void qmatmul_q8_0(const signed char* w, const float* w_scales,
                                        const signed char* xq, const float* x_scales, float* out,
                                        int n_out, int blocks_per_row, int out_stride,
                                        int accumulate) {
    OutputWarp o;
    if (!output_warp(n_out, blocks_per_row, &o)) return;
    const int* w_col = (const int*)(w + o.w_block * 32);
    const int* x_row = (const int*)(xq + o.x_block * 32);
    float acc = 0.0f;
    for (int b = o.lane; b < blocks_per_row; b += 32) {
        int dot = 0;
        for (int i = 0; i < 8; i++) dot = __dp4a(w_col[b * 8 + i], x_row[b * 8 + i], dot);
        acc += (float)dot * (w_scales[o.w_block + b] * x_scales[o.x_block + b]);
    }
    store_output(o, acc, out, out_stride, accumulate);
}

// out[row, col] over Q4_0 / Q4_1 weights (16 bytes per block: element j in the low nibble of
// byte j, element j + 16 in its high nibble).
extern "C" __global__ void qmatmul_q4(const unsigned char* w, const float* w_scales,
                                      const float* w_offsets, const signed char* xq,
                                      const float* x_scales, const float* x_scaled_sums,
                                      float* out, int n_out, int blocks_per_row, int out_stride,
                                        int accumulate) {
    OutputWarp o;
    if (!output_warp(n_out, blocks_per_row, &o)) return;
    const int* w_col = (const int*)(w + o.w_block * 16);
    const int* x_row = (const int*)(xq + o.x_block * 32);
    float acc = 0.0f;
    for (int b = o.lane; b < blocks_per_row; b += 32) {
        int dot = 0;
        for (int i = 0; i < 4; i++) {
            const int packed = w_col[b * 4 + i];
            dot = __dp4a(packed & 0x0F0F0F0F, x_row[b * 8 + i], dot);
            dot = __dp4a((packed >> 4) & 0x0F0F0F0F, x_row[b * 8 + 4 + i], dot);
        }
        const long long wb = o.w_block + b, xb = o.x_block + b;
        acc += (float)dot * (w_scales[wb] * x_scales[xb]) + w_offsets[wb] * x_scaled_sums[xb];
    }
    store_output(o, acc, out, out_stride, accumulate);
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
                                      int blocks_per_row, int out_stride,
                                        int accumulate) {
    OutputWarp o;
    if (!output_warp(n_out, blocks_per_row, &o)) return;
    const int* w_col = (const int*)(w + o.w_block * 16);
    const int* x_row = (const int*)(xq + o.x_block * 32);
    float acc = 0.0f;
    for (int b = o.lane; b < blocks_per_row; b += 32) {
        const long long wb = o.w_block + b, xb = o.x_block + b;
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
    store_output(o, acc, out, out_stride, accumulate);
}

// out[row, col] over Q6_K weights: signed bytes as Q8_0's (q - 32), a scale per half block of
// 16 elements (`w_first`, `w_second`), no offset; Q8_K activations (one scale per block here).
extern "C" __global__ void qmatmul_q6_k(const signed char* w, const float* w_first,
                                        const float* w_second, const signed char* xq,
                                        const float* x_scales, float* out, int n_out,
                                        int blocks_per_row, int out_stride,
                                        int accumulate) {
    OutputWarp o;
    if (!output_warp(n_out, blocks_per_row, &o)) return;
    const int* w_col = (const int*)(w + o.w_block * 32);
    const int* x_row = (const int*)(xq + o.x_block * 32);
    float acc = 0.0f;
    for (int b = o.lane; b < blocks_per_row; b += 32) {
        int first = 0, second = 0;
        for (int i = 0; i < 4; i++) {
            first = __dp4a(w_col[b * 8 + i], x_row[b * 8 + i], first);
            second = __dp4a(w_col[b * 8 + 4 + i], x_row[b * 8 + 4 + i], second);
        }
        const long long wb = o.w_block + b;
        const float x_scale = x_scales[o.x_block + b];
        acc += (float)first * (w_first[wb] * x_scale) + (float)second * (w_second[wb] * x_scale);
    }
    store_output(o, acc, out, out_stride, accumulate);
}
