// Gated DeltaNet: causal conv with state, q/k L2 norms and gates, the delta-rule recurrence
// (one thread per value column, the state column in registers), and the gated RMSNorm.

// Causal depthwise conv + SiLU, one thread per channel, tokens in order.
// p: [t, c] pre-conv inputs; state: [kern-1, c] (oldest first), advanced in place;
// w: [c, kern]; out: [t, c].
extern "C" __global__ void gdn_conv(const float* __restrict__ p, float* __restrict__ state,
                                    const float* __restrict__ w, float* __restrict__ out,
                                    int t, int c, int kern) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    int hist = kern - 1;
    float win[8];  // window of the last `hist` inputs (kern <= 9)
#pragma unroll
    for (int j = 0; j < 8; j++) win[j] = j < hist ? state[(size_t)j * c + ch] : 0.0f;
    float wt[9];
#pragma unroll
    for (int j = 0; j < 9; j++) wt[j] = j < kern ? w[(size_t)ch * kern + j] : 0.0f;
    for (int s = 0; s < t; s++) {
        float x = p[(size_t)s * c + ch];
        float acc = wt[hist] * x;
#pragma unroll
        for (int j = 0; j < 8; j++) if (j < hist) acc += wt[j] * win[j];
        out[(size_t)s * c + ch] = silu_f(acc);
#pragma unroll
        for (int j = 0; j < 7; j++) if (j + 1 < hist) win[j] = win[j + 1];
        if (hist > 0) {
#pragma unroll
            for (int j = 0; j < 8; j++) if (j == hist - 1) win[j] = x;
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) if (j < hist) state[(size_t)j * c + ch] = win[j];
}

// L2-normalise each q and k head of the conv output in place (q also scaled by dk^-1/2).
// grid (t, 2*hk), block dk (<= 1024).
extern "C" __global__ void gdn_qk_l2norm(float* __restrict__ qkv, int c, int hk, int dk, float q_scale) {
    int s = blockIdx.x, head = blockIdx.y;
    float* x = qkv + (size_t)s * c + (size_t)head * dk;  // q heads then k heads are contiguous
    float v = threadIdx.x < dk ? x[threadIdx.x] : 0.0f;
    float inv = rsqrtf(block_sum(v * v) + 1e-6f);
    float scale = head < hk ? q_scale : 1.0f;
    if (threadIdx.x < dk) x[threadIdx.x] = v * inv * scale;
}

// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); ba: [t, 2*hv] = [b | a].
extern "C" __global__ void gdn_gates(const float* __restrict__ b, const float* __restrict__ a, int ld,
                                     const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                     float* __restrict__ beta, float* __restrict__ g, int t, int hv) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= t * hv) return;
    int s = i / hv, j = i % hv;
    beta[i] = sigmoid_f(b[(size_t)s * ld + j]);
    g[i] = -expf(a_log[j]) * softplus_f(a[(size_t)s * ld + j] + dt_bias[j]);
}

// Delta rule, token by token. Block = one value head, thread m = value column m, which keeps
// S[:, m] (DK floats) in registers. qkv: conv output [t, c] (q heads, k heads, v heads);
// state: [hv, DK, dv]; o: [t, hv, dv].
template <int DK>
__device__ void gdn_recurrent_impl(const float* __restrict__ qkv, int c, const float* __restrict__ g,
                                   const float* __restrict__ beta, float* __restrict__ state,
                                   float* __restrict__ o, int t, int hk, int hv, int dv) {
    int j = blockIdx.x, m = threadIdx.x;
    int kh = j / (hv / hk);
    __shared__ float qs[DK], ks[DK];
    float S[DK];
    float* st = state + (size_t)j * DK * dv;
    bool active = m < dv;
#pragma unroll
    for (int i = 0; i < DK; i++) S[i] = active ? st[(size_t)i * dv + m] : 0.0f;
    size_t qoff = (size_t)kh * DK, koff = (size_t)(hk + kh) * DK, voff = (size_t)2 * hk * DK + (size_t)j * dv;
    for (int s = 0; s < t; s++) {
        const float* row = qkv + (size_t)s * c;
        __syncthreads();
        for (int i = threadIdx.x; i < DK; i += blockDim.x) { qs[i] = row[qoff + i]; ks[i] = row[koff + i]; }
        __syncthreads();
        float decay = expf(g[s * hv + j]);
        float bt = beta[s * hv + j];
        float r0 = 0.f, r1 = 0.f, r2 = 0.f, r3 = 0.f;
#pragma unroll
        for (int i = 0; i < DK; i += 4) {
            S[i] *= decay; S[i + 1] *= decay; S[i + 2] *= decay; S[i + 3] *= decay;
            r0 += S[i] * ks[i]; r1 += S[i + 1] * ks[i + 1]; r2 += S[i + 2] * ks[i + 2]; r3 += S[i + 3] * ks[i + 3];
        }
        float v = active ? row[voff + m] : 0.0f;
        float u = bt * (v - ((r0 + r1) + (r2 + r3)));
        float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
        for (int i = 0; i < DK; i += 4) {
            S[i] += ks[i] * u; S[i + 1] += ks[i + 1] * u; S[i + 2] += ks[i + 2] * u; S[i + 3] += ks[i + 3] * u;
            o0 += S[i] * qs[i]; o1 += S[i + 1] * qs[i + 1]; o2 += S[i + 2] * qs[i + 2]; o3 += S[i + 3] * qs[i + 3];
        }
        if (active) o[((size_t)s * hv + j) * dv + m] = (o0 + o1) + (o2 + o3);
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < DK; i++) st[(size_t)i * dv + m] = S[i];
    }
}

#define GDN_RECURRENT(DK)                                                                              \
    extern "C" __global__ void gdn_recurrent_##DK(const float* qkv, int c, const float* g, const float* beta, \
                                                 float* state, float* o, int t, int hk, int hv, int dv) {  \
        gdn_recurrent_impl<DK>(qkv, c, g, beta, state, o, t, hk, hv, dv);                              \
    }
GDN_RECURRENT(16)
GDN_RECURRENT(32)
GDN_RECURRENT(64)
GDN_RECURRENT(128)

// Gated RMSNorm per value head: o / rms(o) * w * SiLU(z), bf16 out. grid t*hv, block >= dv.
extern "C" __global__ void gdn_gated_norm(const float* __restrict__ o, const float* __restrict__ z,
                                          const float* __restrict__ w, bf16* __restrict__ out, int dv, float eps) {
    size_t base = (size_t)blockIdx.x * dv;
    float v = threadIdx.x < dv ? o[base + threadIdx.x] : 0.0f;
    float inv = rsqrtf(block_sum(v * v) / dv + eps);
    if (threadIdx.x < dv)
        out[base + threadIdx.x] = __float2bfloat16(v * inv * w[threadIdx.x] * silu_f(z[base + threadIdx.x]));
}

// ---- Decode (one token): two launches between the in- and out-projections ----

// Conv step + SiLU + q/k L2 norms: block per q, k or v head, thread per channel (each thread
// owns its channel's conv state, so the in-place update has no race). p: projection output
// whose first c values are the conv inputs; grid 2*hk + hv, block >= max(dk, dv), a multiple of 32.
extern "C" __global__ void gdn_conv_dec(const float* __restrict__ p, float* __restrict__ state,
                                        const float* __restrict__ w, float* __restrict__ out, int c, int kern,
                                        int hk, int dk, int dv, float q_scale) {
    griddep_launch();
    griddep_wait();
    int b = blockIdx.x, i = threadIdx.x;
    bool qk = b < 2 * hk;
    int width = qk ? dk : dv;
    int ch = qk ? b * dk + i : 2 * hk * dk + (b - 2 * hk) * dv + i;
    bool on = i < width;
    float y = 0.0f;
    if (on) {
        int hist = kern - 1;
        float x = p[ch];
        float acc = w[(size_t)ch * kern + hist] * x;
        for (int j = 0; j < hist; j++) acc += w[(size_t)ch * kern + j] * state[(size_t)j * c + ch];
        for (int j = 0; j + 1 < hist; j++) state[(size_t)j * c + ch] = state[(size_t)(j + 1) * c + ch];
        if (hist > 0) state[(size_t)(hist - 1) * c + ch] = x;
        y = silu_f(acc);
    }
    if (qk) y *= rsqrtf(block_sum(y * y) + 1e-6f) * (b < hk ? q_scale : 1.0f);
    if (on) out[ch] = y;
}

// Gates + delta-rule step + gated RMSNorm: block per value head, thread m = value column m with
// S[:, m] in registers (read and written once). ba: [b (hv) | a (hv)]; z: [hv, dv]; out bf16.
// grid hv, block dv rounded up to 32.
template <int DK>
__device__ void gdn_step_dec_impl(const float* __restrict__ qkv, const float* __restrict__ ba,
                                  const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                  const float* __restrict__ z, const float* __restrict__ nw,
                                  float* __restrict__ state, bf16* __restrict__ out, int hk, int hv, int dv,
                                  float eps) {
    griddep_launch();
    griddep_wait();
    int j = blockIdx.x, m = threadIdx.x;
    int kh = j / (hv / hk);
    __shared__ float qs[DK], ks[DK];
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        qs[i] = qkv[(size_t)kh * DK + i];
        ks[i] = qkv[(size_t)(hk + kh) * DK + i];
    }
    bool active = m < dv;
    float* st = state + (size_t)j * DK * dv;
    float S[DK];
#pragma unroll
    for (int i = 0; i < DK; i++) S[i] = active ? st[(size_t)i * dv + m] : 0.0f;
    float bt = sigmoid_f(ba[j]);
    float decay = expf(-expf(a_log[j]) * softplus_f(ba[hv + j] + dt_bias[j]));
    __syncthreads();
    float r0 = 0.f, r1 = 0.f, r2 = 0.f, r3 = 0.f;
#pragma unroll
    for (int i = 0; i < DK; i += 4) {
        S[i] *= decay; S[i + 1] *= decay; S[i + 2] *= decay; S[i + 3] *= decay;
        r0 += S[i] * ks[i]; r1 += S[i + 1] * ks[i + 1]; r2 += S[i + 2] * ks[i + 2]; r3 += S[i + 3] * ks[i + 3];
    }
    float v = active ? qkv[(size_t)2 * hk * DK + (size_t)j * dv + m] : 0.0f;
    float u = bt * (v - ((r0 + r1) + (r2 + r3)));
    float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
    for (int i = 0; i < DK; i += 4) {
        S[i] += ks[i] * u; S[i + 1] += ks[i + 1] * u; S[i + 2] += ks[i + 2] * u; S[i + 3] += ks[i + 3] * u;
        o0 += S[i] * qs[i]; o1 += S[i + 1] * qs[i + 1]; o2 += S[i + 2] * qs[i + 2]; o3 += S[i + 3] * qs[i + 3];
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < DK; i++) st[(size_t)i * dv + m] = S[i];
    }
    float o = active ? (o0 + o1) + (o2 + o3) : 0.0f;
    float inv = rsqrtf(block_sum(o * o) / dv + eps);
    if (active) out[(size_t)j * dv + m] = __float2bfloat16(o * inv * nw[m] * silu_f(z[(size_t)j * dv + m]));
}

#define GDN_STEP_DEC(DK)                                                                                   \
    extern "C" __global__ void gdn_step_dec_##DK(const float* qkv, const float* ba, const float* a_log,        \
                                                const float* dt_bias, const float* z, const float* nw,         \
                                                float* state, bf16* out, int hk, int hv, int dv, float eps) {  \
        gdn_step_dec_impl<DK>(qkv, ba, a_log, dt_bias, z, nw, state, out, hk, hv, dv, eps);                   \
    }
GDN_STEP_DEC(16)
GDN_STEP_DEC(32)
GDN_STEP_DEC(64)
GDN_STEP_DEC(128)
