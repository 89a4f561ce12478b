// Zero-centred RMSNorm (1 + w): f32 rows in, bf16 rows out (the next GEMM's input).
extern "C" __global__ void rmsnorm_zc_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                           bf16* __restrict__ out, int d, float eps) {
    const float* r = x + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += r[i] * r[i];
    float inv = rsqrtf(block_sum(ss) / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        out[(size_t)blockIdx.x * d + i] = __float2bfloat16(r[i] * inv * (1.0f + w[i]));
}
