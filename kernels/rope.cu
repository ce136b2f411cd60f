// Rotary position embedding, in place on [rows, heads, head_dim]; one thread per rotated pair.
// `interleaved` rotates adjacent pairs (GGUF llama's permuted q/k), otherwise the two halves.
extern "C" __global__ void rope(float* x, const int* positions, const float* inv_freq, int rows,
                                int heads, int head_dim, int interleaved) {
    const int half = head_dim / 2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * heads * half) return;
    const int pair = i % half;
    const long long row_head = i / half;
    const int row = row_head / heads;
    float sin_angle, cos_angle;
    sincosf((float)positions[row] * inv_freq[pair], &sin_angle, &cos_angle);
    float* head = x + row_head * head_dim;
    const int a = interleaved ? 2 * pair : pair;
    const int b = interleaved ? 2 * pair + 1 : pair + half;
    const float x0 = head[a], x1 = head[b];
    head[a] = x0 * cos_angle - x1 * sin_angle;
    head[b] = x0 * sin_angle + x1 * cos_angle;
}
