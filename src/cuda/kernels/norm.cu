// Zero-centred RMSNorm (1 + w): f32 rows in, bf16 rows out (the next GEMM's input).
extern "C" __global__ void rmsnorm_zc_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                           bf16* __restrict__ out, int d, float eps) {
    PREFILL_KERNEL();
    const float* r = x + (size_t)blockIdx.x * d;
    bf16* o = out + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    if ((d & 3) == 0) {  // 16-byte loads, two bf16 pairs per store
        const float4* r4 = reinterpret_cast<const float4*>(r);
        for (int i = threadIdx.x; i < (d >> 2); i += blockDim.x) {
            float4 v = r4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        float inv = rsqrtf(block_sum(ss) / d + eps);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        for (int i = threadIdx.x; i < (d >> 2); i += blockDim.x) {
            float4 v = r4[i], g = w4[i];
            uint2 p = make_uint2(pack_bf16x2(v.x * inv * (1.0f + g.x), v.y * inv * (1.0f + g.y)),
                                 pack_bf16x2(v.z * inv * (1.0f + g.z), v.w * inv * (1.0f + g.w)));
            reinterpret_cast<uint2*>(o)[i] = p;
        }
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += r[i] * r[i];
    float inv = rsqrtf(block_sum(ss) / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __float2bfloat16(r[i] * inv * (1.0f + w[i]));
}
