// Row-wise and element-wise steps of the decoder layer.

// dst = row / rms(row) * weight over `dim` floats, by one thread block (dst may be row: each
// thread reads its elements before the block's sum and writes them after).
__device__ void norm_row(const float* row, const float* weight, float* dst, int dim, float eps) {
    float squares = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) squares += row[i] * row[i];
    const float scale = 1.0f / sqrtf(block_sum(squares) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = row[i] * scale * weight[i];
}

// out[r] = x[r] / rms(x[r]) * weight, one thread block per row of `dim`.
extern "C" __global__ void rms_norm(const float* x, const float* weight, float* out, int dim,
                                    float eps) {
    const long long at = (long long)blockIdx.x * dim;
    norm_row(x + at, weight, out + at, dim, eps);
}

// rms_norm in place over heads `first_head + blockIdx.x` of each row `blockIdx.y` of `x`,
// rows `row_stride` apart, heads `dim` apart (QK-norm on the stacked q/k/v projection).
extern "C" __global__ void rms_norm_heads(float* x, const float* weight, long long row_stride,
                                          int first_head, int dim, float eps) {
    float* head = x + blockIdx.y * row_stride + (long long)(first_head + blockIdx.x) * dim;
    norm_row(head, weight, head, dim, eps);
}

// out[r] = table[ids[r]] * scale, one thread block per row of `dim` (the embedding lookup;
// `scale` is Gemma's sqrt(hidden), else 1).
extern "C" __global__ void embed_rows(const float* table, const int* ids, float* out, int dim,
                                      float scale) {
    const float* from = table + (long long)ids[blockIdx.x] * dim;
    float* to = out + (long long)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) to[i] = from[i] * scale;
}

// x += y over n elements (the residual stream).
extern "C" __global__ void add_in_place(float* x, const float* y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// Adds `bias` (dim) to every row of x (n elements in all).
extern "C" __global__ void add_bias_rows(float* x, const float* bias, long long n, int dim) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % dim];
}

// The gated MLP's activations from the stacked gate/up projection, whose rows hold a row's
// gate then its up (`dim` each): out[r, j] = act(gate[r, j]) * up[r, j], `n` = rows * dim.
// SwiGLU's SiLU here, GeGLU's tanh-approximated GELU in `gelu_tanh_mul` (the CPU's
// `ops::gelu_tanh_mul_in_place`).
extern "C" __global__ void silu_mul(const float* gate_up, float* out, long long n, int dim) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const long long at = (i / dim) * 2 * dim + i % dim;
        const float g = gate_up[at];
        out[i] = g / (1.0f + expf(-g)) * gate_up[at + dim];
    }
}

extern "C" __global__ void gelu_tanh_mul(const float* gate_up, float* out, long long n, int dim) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const long long at = (i / dim) * 2 * dim + i % dim;
        const float g = gate_up[at];
        const float inner = 0.7978846f * (g + 0.044715f * g * g * g);
        out[i] = 0.5f * g * (1.0f + tanhf(inner)) * gate_up[at + dim];
    }
}

// dst[i] = src[rows[i]], rows of `dim`; one thread block per gathered row.
extern "C" __global__ void gather_rows(const float* src, const int* rows, float* dst, int dim) {
    const float* from = src + (long long)rows[blockIdx.x] * dim;
    float* to = dst + (long long)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) to[i] = from[i];
}

// f32 -> bf16 bits rounded to nearest even (NaN stays NaN): the activations of a bf16 GEMM.
extern "C" __global__ void to_bf16(const float* x, unsigned short* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned int bits = __float_as_uint(x[i]);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        out[i] = (unsigned short)((bits >> 16) | 0x40u);
    } else {
        out[i] = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}
