// Warp-level pieces of the attention kernels on mma accumulators (a warp = 16 query rows):
// attn_decode_mma's products and softmax (attn_decode.cu), attn_flash4's mask, softmax and P
// fragments (attn_prefill.cu).

// S (16 rows x NK keys) = Q Kᵀ: Q rows at qw, K rows at kt, both bf16 with row stride LD.
template <int HD, int NK, int LD>
__device__ __forceinline__ void warp_qk(float (&s)[NK / 8][4], const bf16* qw, const bf16* kt, int lane) {
#pragma unroll
    for (int n = 0; n < NK / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        unsigned a[4];
        ldsm_x4(a, qw + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int nb = 0; nb < NK / 16; nb++) {
            unsigned b[4];
            ldsm_x4(b, kt + (nb * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_bf16_16816(s[2 * nb], a, b[0], b[1]);
            mma_bf16_16816(s[2 * nb + 1], a, b[2], b[3]);
        }
    }
}

// 2^x on the special-function unit alone (ex2.approx.ftz: ~2 ulp, results below 2^-126
// flushed to 0, 2^-inf = 0); exp2f adds a range fix-up of 3 instructions around it.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// Causal / cache-end mask of a warp's score tile (mma accumulator layout, NK keys from k0):
// -inf where the key lies past the row's position (qpos0 for row g, qpos0 + 8 for row g + 8)
// or past the cache's n_valid keys. cq = 2 (lane % 4).
template <int NK>
__device__ __forceinline__ void warp_causal_mask(float (&s)[NK / 8][4], int k0, int qpos0, int n_valid, int cq) {
#pragma unroll
    for (int n = 0; n < NK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int kp = k0 + n * 8 + cq + (e & 1), qp = qpos0 + 8 * (e >> 1);
            if (kp > qp || kp >= n_valid) s[n][e] = -INFINITY;
        }
}

// Online softmax (base 2) of one tile's scores, rows g (m0, l0) and g + 8 (m1, l1); a row lives
// in the 4 lanes of a quad, l stays a per-lane partial sum. Rescales o; leaves P in s.
// SFU (attn_flash4): exponentials by ex2_approx, and o rescaled only when o_live and one of the
// thread's row maxima moved (o is not yet written before the first tile's P V there).
template <int HD, int NK, bool SFU = false>
__device__ __forceinline__ void warp_softmax(float (&s)[NK / 8][4], float (&o)[HD / 8][4], float& m0, float& m1,
                                             float& l0, float& l1, bool o_live = true) {
    auto exp2_ = [](float x) { return SFU ? ex2_approx(x) : exp2f(x); };
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int n = 0; n < NK / 8; n++) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float b0 = mx0 == -INFINITY ? 0.0f : mx0, b1 = mx1 == -INFINITY ? 0.0f : mx1;  // fully masked rows
    const float c0 = exp2_(m0 - b0), c1 = exp2_(m1 - b1);
    const bool moved = mx0 != m0 || mx1 != m1;
    m0 = mx0;
    m1 = mx1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < NK / 8; n++) {
        s[n][0] = exp2_(s[n][0] - b0);
        s[n][1] = exp2_(s[n][1] - b0);
        s[n][2] = exp2_(s[n][2] - b1);
        s[n][3] = exp2_(s[n][3] - b1);
        sum0 += s[n][0] + s[n][1];
        sum1 += s[n][2] + s[n][3];
    }
    l0 = l0 * c0 + sum0;
    l1 = l1 * c1 + sum1;
    if (SFU && !(o_live && moved)) return;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        o[n][0] *= c0;
        o[n][1] *= c0;
        o[n][2] *= c1;
        o[n][3] *= c1;
    }
}

// The A fragment of keys 16 kk.. for O += P V: the probabilities of key blocks 2kk, 2kk + 1
// (accumulator layout) packed to bf16 pairs.
template <int NK>
__device__ __forceinline__ void p_frag(const float (&s)[NK / 8][4], int kk, unsigned (&a)[4]) {
    a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// O += P V: the S accumulators of key blocks 2kk, 2kk+1 are the A fragment of keys 16kk.. (V
// rows at vt, bf16, row stride LD, read transposed).
template <int HD, int NK, int LD>
__device__ __forceinline__ void warp_pv(float (&o)[HD / 8][4], const float (&s)[NK / 8][4], const bf16* vt, int lane) {
#pragma unroll
    for (int kk = 0; kk < NK / 16; kk++) {
        unsigned a[4];
        p_frag<NK>(s, kk, a);
#pragma unroll
        for (int nb = 0; nb < HD / 16; nb++) {
            unsigned b[4];
            ldsm_x4_t(b, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + nb * 16 + (lane >> 4) * 8);
            mma_bf16_16816(o[2 * nb], a, b[0], b[1]);
            mma_bf16_16816(o[2 * nb + 1], a, b[2], b[3]);
        }
    }
}
