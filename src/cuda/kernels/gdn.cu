// Gated DeltaNet: causal conv with state, q/k L2 norms and gates, the delta-rule recurrence
// (one thread per value column, the state column in registers), and the gated RMSNorm.

// Causal depthwise conv + SiLU, one thread per channel, tokens in order.
// p: [t, c] pre-conv inputs in rows of ldp; state: [kern-1, c] (oldest first), advanced in
// place; w: [c, kern]; out: [t, c].
extern "C" __global__ void gdn_conv(const float* __restrict__ p, float* __restrict__ state,
                                    const float* __restrict__ w, float* __restrict__ out,
                                    int t, int c, int ldp, int kern) {
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
        float x = p[(size_t)s * ldp + ch];
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
    PREFILL_KERNEL();
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

// Gated RMSNorm per value head: o / rms(o) * w * SiLU(z), bf16 out. A warp per (token, head)
// row of dv, so the norm is one shuffle reduction; 4 values a lane a load when dv and ldz are
// multiples of 4. z: a token's hv heads of dv in rows of ldz floats (where the in-projection
// wrote them). grid ceil(rows / 8), block 256.
extern "C" __global__ void gdn_gated_norm(const float* __restrict__ o, const float* __restrict__ z_in,
                                          const float* __restrict__ w, bf16* __restrict__ out, int rows, int dv,
                                          int hv, int ldz, float eps) {
    PREFILL_KERNEL();
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;  // warp-uniform
    const size_t base = (size_t)row * dv;
    const float* z = z_in + (size_t)(row / hv) * ldz + (size_t)(row % hv) * dv;  // this row's z
    float ss = 0.0f;
    if ((dv & 3) == 0 && (ldz & 3) == 0 && (reinterpret_cast<size_t>(z_in) & 15) == 0) {
        for (int i = 4 * lane; i < dv; i += 128) {
            const float4 v = *reinterpret_cast<const float4*>(o + base + i);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        const float inv = rsqrtf(warp_sum(ss) / dv + eps);
        for (int i = 4 * lane; i < dv; i += 128) {
            const float4 v = *reinterpret_cast<const float4*>(o + base + i);
            const float4 g = *reinterpret_cast<const float4*>(z + i);
            const float4 wv = *reinterpret_cast<const float4*>(w + i);
            *reinterpret_cast<uint2*>(out + base + i) =
                make_uint2(pack_bf16x2(v.x * inv * wv.x * silu_f(g.x), v.y * inv * wv.y * silu_f(g.y)),
                           pack_bf16x2(v.z * inv * wv.z * silu_f(g.z), v.w * inv * wv.w * silu_f(g.w)));
        }
        return;
    }
    for (int i = lane; i < dv; i += 32) ss += o[base + i] * o[base + i];
    const float inv = rsqrtf(warp_sum(ss) / dv + eps);
    for (int i = lane; i < dv; i += 32) out[base + i] = __float2bfloat16(o[base + i] * inv * w[i] * silu_f(z[i]));
}

// ---- Decode (one token): two launches between the in- and out-projections ----

// Conv step + SiLU + q/k L2 norms: block per q, k or v head, thread per channel (each thread
// owns its channel's conv state, so the in-place update has no race). p: projection output
// whose first c values are the conv inputs; grid 2*hk + hv, block >= max(dk, dv), a multiple of 32.
extern "C" __global__ void gdn_conv_dec(const float* __restrict__ p, float* __restrict__ state,
                                        const float* __restrict__ w, float* __restrict__ out, int c, int kern,
                                        int hk, int dk, int dv, float q_scale) {
    DECODE_KERNEL(TAG_GDN_CONV);
    int b = blockIdx.x, i = threadIdx.x;
    bool qk = b < 2 * hk;
    int width = qk ? dk : dv;
    int ch = qk ? b * dk + i : 2 * hk * dk + (b - 2 * hk) * dv + i;
    bool on = i < width;
    const int hist = kern - 1;
    // The conv state and weights are this layer's own (see gdn_step_dec): loaded before the
    // wait, so only the projection output is read after it. kern <= 9.
    float acc = 0.0f, hs[8];
    if (on) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            hs[j] = j < hist ? state[(size_t)j * c + ch] : 0.0f;
            if (j < hist) acc += w[(size_t)ch * kern + j] * hs[j];
        }
    }
    const float wl = on ? w[(size_t)ch * kern + hist] : 0.0f;
    griddep_wait();
    float y = 0.0f;
    if (on) {
        float x = p[ch];
        acc += wl * x;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < hist) state[(size_t)j * c + ch] = j + 1 < hist ? hs[j < 7 ? j + 1 : 7] : x;
        y = silu_f(acc);
    }
    if (qk) y *= rsqrtf(block_sum(y * y) + 1e-6f) * (b < hk ? q_scale : 1.0f);
    if (on) out[ch] = y;
}

// The decode step's column math, shared by gdn_step_dec and gdn_convstep_dec: four lanes hold a
// value column m of S, a quarter (RQ rows) each, and read q and k from four padded quarters
// (quarter p at p (RQ + 4): the four lanes reading quarter `part` at the same i hit different
// bank groups; unpadded, every read was a 4-way bank conflict).
template <int RQ>
__device__ __forceinline__ int gdn_quarter_at(int i) {
    return (i / RQ) * (RQ + 4) + i % RQ;
}
// S[:, m] *= decay; returns (Sᵀ k)[m], summed over the column's four lanes.
template <int RQ>
__device__ __forceinline__ float gdn_col_decay_dot(float (&S)[RQ], const float* kq, float decay) {
    float r = 0.0f;
#pragma unroll
    for (int i = 0; i < RQ; i++) {
        S[i] *= decay;
        r += S[i] * kq[i];
    }
    r += __shfl_xor_sync(0xffffffffu, r, 1);
    return r + __shfl_xor_sync(0xffffffffu, r, 2);
}
// S[:, m] += k u; returns (Sᵀ q)[m], summed over the column's four lanes.
template <int RQ>
__device__ __forceinline__ float gdn_col_update_dot(float (&S)[RQ], const float* kq, const float* qq, float u) {
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < RQ; i++) {
        S[i] += kq[i] * u;
        o += S[i] * qq[i];
    }
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    return o + __shfl_xor_sync(0xffffffffu, o, 2);
}

// Gates + delta-rule step + gated RMSNorm: block per value head; four neighbouring lanes share
// value column m, each keeping a quarter of S[:, m] in registers (read and written once), and
// combine their partial dot products with two shuffles. ba: [b (hv) | a (hv)]; z: [hv, dv];
// out bf16. grid hv, block 4 * dv rounded up to 32 (<= 1024).
template <int DK>
__device__ void gdn_step_dec_impl(const float* __restrict__ qkv, const float* __restrict__ ba,
                                  const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                  const float* __restrict__ z, const float* __restrict__ nw,
                                  float* __restrict__ state, bf16* __restrict__ out, int hk, int hv, int dv,
                                  float eps) {
    constexpr int RQ = DK / 4;  // state rows per lane
    DECODE_KERNEL(TAG_GDN_STEP);
    int j = blockIdx.x, m = threadIdx.x >> 2, part = threadIdx.x & 3;
    int kh = j / (hv / hk);
    bool active = m < dv;
    // The state is this layer's own (last written by this kernel in the previous step, which
    // finished before the step began), so its loads overlap the conv kernel still running.
    float* st = state + (size_t)j * DK * dv + (size_t)part * RQ * dv + m;
    float S[RQ];
#pragma unroll
    for (int i = 0; i < RQ; i++) S[i] = active ? st[(size_t)i * dv] : 0.0f;
    const float a_j = expf(a_log[j]), dtb = dt_bias[j], nwm = active ? nw[m] : 0.0f;
    griddep_wait();
    // Every input of the step is loaded at once, before the first barrier: one round trip.
    // q and k in padded quarters (gdn_quarter_at).
    __shared__ __align__(16) float qs[4 * (RQ + 4)], ks[4 * (RQ + 4)];
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        const int at = gdn_quarter_at<RQ>(i);
        qs[at] = qkv[(size_t)kh * DK + i];
        ks[at] = qkv[(size_t)(hk + kh) * DK + i];
    }
    const float v = active ? qkv[(size_t)2 * hk * DK + (size_t)j * dv + m] : 0.0f;
    const float zm = active && part == 0 ? z[(size_t)j * dv + m] : 0.0f;
    float bt = sigmoid_f(ba[j]);
    float decay = expf(-a_j * softplus_f(ba[hv + j] + dtb));
    __syncthreads();
    TRACE_PHASE(0);  // the timeline's phases: inputs in, state updated, output norm summed
    const float* kq = ks + part * (RQ + 4);
    const float* qq = qs + part * (RQ + 4);
    const float r = gdn_col_decay_dot<RQ>(S, kq, decay);
    float o = gdn_col_update_dot<RQ>(S, kq, qq, bt * (v - r));
    TRACE_PHASE(1);
    if (active) {
#pragma unroll
        for (int i = 0; i < RQ; i++) st[(size_t)i * dv] = S[i];
    }
    if (!active) o = 0.0f;
    float inv = rsqrtf(block_sum(part == 0 ? o * o : 0.0f) / dv + eps);
    TRACE_PHASE(2);
    if (active && part == 0)
        out[(size_t)j * dv + m] = __float2bfloat16(o * inv * nwm * silu_f(zm));
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

// gdn_conv_dec and gdn_step_dec in one launch: gdn_step_dec's block per value head (and its
// lanes), where thread t < nc = 2 DK + dv first runs conv channel t of what the head reads: its
// key head's q ([0, DK)) and k ([DK, 2 DK)) and its own v ([2 DK, nc)), the outputs staying in
// shared memory. The G = hv / hk value heads of a key head all compute its q and k; only the
// first writes their conv state, and with G = 2 (CL = 2, sm_90a) the two blocks form a cluster
// whose barrier (arrived at once the old state is read, waited for before it is written) keeps
// that write after the other block's read. q and k are normalised by scaling the step's sums
// (r and o) and k's update factor instead of the vectors. z: [hv, dv]; ba: [b (hv) | a (hv)];
// out bf16. grid hv, block 4 dv rounded up to 32 (>= nc); the conv's kernel size is 4 (its
// history in registers across the wait). Dynamic shared memory (a cluster kernel's blocks each need
// their own on the CPU emulator): GDN_CONVSTEP_SMEM(DK, dv) bytes.
#define GDN_CONVSTEP_SMEM(DK, DV) ((2 * ((DK) + 16) + 32 + (DV)) * 4)
template <int DK, int CL>
__device__ void gdn_convstep_dec_impl(const float* __restrict__ p, float* __restrict__ conv_state,
                                      const float* __restrict__ conv_w, const float* __restrict__ z,
                                      const float* __restrict__ ba, const float* __restrict__ a_log,
                                      const float* __restrict__ dt_bias, const float* __restrict__ nw,
                                      float* __restrict__ state, bf16* __restrict__ out, int c, int hk, int hv,
                                      int dv, float q_scale, float eps) {
    constexpr int RQ = DK / 4, KERN = 4, HIST = KERN - 1;  // state rows per lane; conv history
    DECODE_KERNEL(TAG_GDN_STEP);
    const int j = blockIdx.x, t = threadIdx.x, m = t >> 2, part = t & 3;
    const int kh = j / (hv / hk), nc = 2 * DK + dv;
    const bool active = m < dv, conv_on = t < nc;
    // The first value head of its key head (cluster rank 0) owns the q and k conv state.
    const bool qk_owner = j % (hv / hk) == 0;
    const int ch = t < DK       ? kh * DK + t
                   : t < 2 * DK ? (hk + kh) * DK + (t - DK)
                                : 2 * hk * DK + j * dv + (t - 2 * DK);
    // The recurrent and conv states and the weights are this layer's own (last written by this
    // kernel in the previous step): loaded before the wait, overlapping the in-projection.
    float* st = state + (size_t)j * DK * dv + (size_t)part * RQ * dv + m;
    float S[RQ];
#pragma unroll
    for (int i = 0; i < RQ; i++) S[i] = active ? st[(size_t)i * dv] : 0.0f;
    float acc = 0.0f, hs[HIST];
#pragma unroll
    for (int i = 0; i < HIST; i++) {
        hs[i] = conv_on ? conv_state[(size_t)i * c + ch] : 0.0f;
        if (conv_on) acc += conv_w[(size_t)ch * KERN + i] * hs[i];
    }
    const float wl = conv_on ? conv_w[(size_t)ch * KERN + HIST] : 0.0f;
    const float a_j = expf(a_log[j]), dtb = dt_bias[j], nwm = active ? nw[m] : 0.0f;
    if constexpr (CL > 1) cluster_arrive_release();  // this block has read the old conv state
    griddep_wait();
    extern __shared__ __align__(16) float cs_smem[];
    float* qs = cs_smem;                  // [4 (RQ + 4)]
    float* ks = cs_smem + 4 * (RQ + 4);   // [4 (RQ + 4)]
    float* red = ks + 4 * (RQ + 4);       // [32]: the warps' sums of squares
    float* vs = red + 32;                 // [dv]
    float y = 0.0f;
    if (conv_on) {
        const float x = p[ch];
        acc += wl * x;
        y = silu_f(acc);
    }
    const float zm = active && part == 0 ? z[(size_t)j * dv + m] : 0.0f;
    const float bt = sigmoid_f(ba[j]);
    const float decay = expf(-a_j * softplus_f(ba[hv + j] + dtb));
    // q and k (raw) in padded quarters (gdn_quarter_at); v by column.
    if (t < DK) qs[gdn_quarter_at<RQ>(t)] = y;
    else if (t < 2 * DK) ks[gdn_quarter_at<RQ>(t - DK)] = y;
    else if (conv_on) vs[t - 2 * DK] = y;
    __syncthreads();
    // The L2 norms: every warp sums the same squares in the same order (no second barrier).
    float sq = 0.0f, sk = 0.0f;
    for (int i = t & 31; i < DK; i += 32) {
        const float a = qs[gdn_quarter_at<RQ>(i)], b = ks[gdn_quarter_at<RQ>(i)];
        sq += a * a;
        sk += b * b;
    }
    const float iq = rsqrtf(warp_sum(sq) + 1e-6f) * q_scale, ik = rsqrtf(warp_sum(sk) + 1e-6f);
    const float v = active ? vs[m] : 0.0f;
    TRACE_PHASE(0);  // the timeline's phases: inputs in, state updated, output norm summed
    const float* kq = ks + part * (RQ + 4);
    const float* qq = qs + part * (RQ + 4);
    const float r = gdn_col_decay_dot<RQ>(S, kq, decay) * ik;
    // the update's k_i u with k normalised: k_raw,i (u |k|^-1)
    float o = gdn_col_update_dot<RQ>(S, kq, qq, bt * (v - r) * ik);
    o = active ? o * iq : 0.0f;
    TRACE_PHASE(1);
    if (active) {
#pragma unroll
        for (int i = 0; i < RQ; i++) st[(size_t)i * dv] = S[i];
    }
    // The conv state: v's channels by this block, q's and k's by their owner once every block
    // that reads them has (the cluster's barrier; without a cluster the block is their only reader).
    if constexpr (CL > 1) cluster_wait_acquire();
    if (conv_on && (t >= 2 * DK || qk_owner)) {
        const float x = p[ch];
#pragma unroll
        for (int i = 0; i < HIST; i++) conv_state[(size_t)i * c + ch] = i + 1 < HIST ? hs[i + 1 < HIST ? i + 1 : 0] : x;
    }
    // The gated RMSNorm: every warp sums the warps' partials in the same order.
    const float ss = warp_sum(part == 0 ? o * o : 0.0f);
    if ((t & 31) == 0) red[t >> 5] = ss;
    __syncthreads();
    const float tot = warp_sum((t & 31) < (int)(blockDim.x >> 5) ? red[t & 31] : 0.0f);
    const float inv = rsqrtf(tot / dv + eps);
    TRACE_PHASE(2);
    if (active && part == 0) out[(size_t)j * dv + m] = __float2bfloat16(o * inv * nwm * silu_f(zm));
}

// CL = 1: one value head a key head (no cluster); CL = 2: two, a cluster of two blocks (sm_90a).
#define GDN_CONVSTEP_DEC(DK)                                                                                   \
    extern "C" __global__ void __launch_bounds__(512) gdn_convstep_dec_##DK(                                   \
        const float* p, float* conv_state, const float* conv_w, const float* z, const float* ba,               \
        const float* a_log, const float* dt_bias, const float* nw, float* state, bf16* out, int c, int hk,     \
        int hv, int dv, float q_scale, float eps) {                                                            \
        gdn_convstep_dec_impl<DK, 1>(p, conv_state, conv_w, z, ba, a_log, dt_bias, nw, state, out, c, hk, hv, dv, \
                                     q_scale, eps);                                                            \
    }                                                                                                          \
    extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(512) gdn_convstep_dec_cl2_##DK(     \
        const float* p, float* conv_state, const float* conv_w, const float* z, const float* ba,               \
        const float* a_log, const float* dt_bias, const float* nw, float* state, bf16* out, int c, int hk,     \
        int hv, int dv, float q_scale, float eps) {                                                            \
        gdn_convstep_dec_impl<DK, 2>(p, conv_state, conv_w, z, ba, a_log, dt_bias, nw, state, out, c, hk, hv, dv, \
                                     q_scale, eps);                                                            \
    }
GDN_CONVSTEP_DEC(16)
GDN_CONVSTEP_DEC(32)
GDN_CONVSTEP_DEC(64)
GDN_CONVSTEP_DEC(128)

// ---- Prefill (t > 1): a token-parallel conv and the chunked delta rule.

// Causal depthwise conv + SiLU over a prefill call with the q/k L2 norm (and q's dk^-1/2)
// fused. Block (tile blockIdx.x of GDN_CONV_TT tokens, group blockIdx.y) of 128 threads, a
// thread per channel: group y < 2*hk is q/k head y (dk <= 128 channels), the others 128 v
// channels each. With the usual kernel width 4 a thread loads its tile's inputs at once and
// slides the window in registers, so each input is read once and the loads overlap. The
// first kern-1 tokens take their history from the conv state, which is only read here
// (gdn_conv_advance moves it afterwards, so no block reads a row another block rewrites).
#define GDN_CONV_TT 32

template <int KERN>
__device__ __forceinline__ void conv_prefill_tile(const float* __restrict__ p, const float* __restrict__ state,
                                                  const float* __restrict__ w, float* __restrict__ out, int t,
                                                  int c, int ldp, int ch, bool valid, bool qk, float scale) {
    constexpr int H = KERN - 1;
    const int s0 = blockIdx.x * GDN_CONV_TT, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v[GDN_CONV_TT];
    if (valid) {
        float wt[KERN], win[H], x[GDN_CONV_TT];
#pragma unroll
        for (int j = 0; j < KERN; j++) wt[j] = w[(size_t)ch * KERN + j];
#pragma unroll
        for (int j = 0; j < H; j++) {  // inputs of tokens s0-H .. s0-1
            int src = s0 - H + j;
            win[j] = src >= 0 ? p[(size_t)src * ldp + ch] : state[(size_t)(H + src) * c + ch];
        }
#pragma unroll
        for (int i = 0; i < GDN_CONV_TT; i++) x[i] = s0 + i < t ? p[(size_t)(s0 + i) * ldp + ch] : 0.0f;
#pragma unroll
        for (int i = 0; i < GDN_CONV_TT; i++) {
            float acc = wt[H] * x[i];
#pragma unroll
            for (int j = 0; j < H; j++) acc += wt[j] * (i - H + j >= 0 ? x[i - H + j] : win[i + j]);
            v[i] = silu_f(acc);
        }
    } else {
#pragma unroll
        for (int i = 0; i < GDN_CONV_TT; i++) v[i] = 0.0f;
    }
    if (qk) {  // block-uniform: one barrier for the tile's 32 norms
        __shared__ float part[4][GDN_CONV_TT];
#pragma unroll
        for (int i = 0; i < GDN_CONV_TT; i++) {
            float ss = warp_sum(v[i] * v[i]);
            if (lane == 0) part[warp][i] = ss;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < GDN_CONV_TT; i++)
            v[i] *= rsqrtf(part[0][i] + part[1][i] + part[2][i] + part[3][i] + 1e-6f) * scale;
    }
    if (valid)
#pragma unroll
        for (int i = 0; i < GDN_CONV_TT; i++)
            if (s0 + i < t) out[(size_t)(s0 + i) * c + ch] = v[i];
}

extern "C" __global__ void __launch_bounds__(128) gdn_conv_prefill(
    const float* __restrict__ p, const float* __restrict__ state, const float* __restrict__ w,
    float* __restrict__ out, int t, int c, int ldp, int kern, int hk, int dk, float q_scale) {
    PREFILL_KERNEL();
    const int y = blockIdx.y, hist = kern - 1;
    const bool qk = y < 2 * hk;
    const int ch = qk ? y * dk + threadIdx.x : 2 * hk * dk + (y - 2 * hk) * blockDim.x + threadIdx.x;
    const bool valid = qk ? (int)threadIdx.x < dk : ch < c;
    const float scale = qk && y < hk ? q_scale : 1.0f;
    if (kern == 4) return conv_prefill_tile<4>(p, state, w, out, t, c, ldp, ch, valid, qk, scale);
    // Other widths: token by token (taps read from global memory, a block sum per q/k norm).
    const int s_end = min(t, (int)(blockIdx.x + 1) * GDN_CONV_TT);
    for (int s = blockIdx.x * GDN_CONV_TT; s < s_end; s++) {
        float v = 0.0f;
        if (valid) {
            const float* wc = w + (size_t)ch * kern;
            float acc = wc[hist] * p[(size_t)s * ldp + ch];
            for (int j = 0; j < hist; j++) {
                int src = s - hist + j;  // token of tap j; negative: conv state row hist + src
                float x = src >= 0 ? p[(size_t)src * ldp + ch] : state[(size_t)(hist + src) * c + ch];
                acc += wc[j] * x;
            }
            v = silu_f(acc);
        }
        if (qk) v *= rsqrtf(block_sum(v * v) + 1e-6f) * scale;  // block-uniform
        if (valid) out[(size_t)s * c + ch] = v;
    }
}

// After gdn_conv_prefill: the conv state becomes the last kern-1 rows of [state ; p]. One
// thread per channel reads all its rows before writing any, so no row is read after being
// overwritten (t < kern-1 keeps some old rows, shifted).
extern "C" __global__ void gdn_conv_advance(const float* __restrict__ p, float* __restrict__ state,
                                            int t, int c, int ldp, int kern) {
    PREFILL_KERNEL();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    int hist = kern - 1;
    float row[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int src = t + j;  // row of [state ; p]
        row[j] = j >= hist ? 0.0f : src < hist ? state[(size_t)src * c + ch] : p[(size_t)(src - hist) * ldp + ch];
    }
#pragma unroll
    for (int j = 0; j < 8; j++) if (j < hist) state[(size_t)j * c + ch] = row[j];
}

#define GDN_C 64             // chunk length of the chunked delta rule
#define GDN_LDP (GDN_C + 4)  // row stride of 64x64 matrices in shared memory
#define GDN_DVS 32           // value columns per block of gdn_chunk_state
// gdn_chunk_state's B operands S [DK][32] and Vd [64][32], split 3xTF32, in a "quad" layout:
// per 8-row k block kb and c < 4, column n holds {hi, lo} of rows 8kb+c and 8kb+c+4 as
// {hi(c), hi(c+4), lo(c), lo(c+4)}, so a lane's b0, b1 of both parts are one 16-byte load into
// registers the mma takes as they are; a quarter-warp's lanes (c, g) hit 8c + 4g mod 32, no conflict.
#define GDN_LDQ (4 * GDN_DVS + 8)  // floats per c row of a k block
#define GDN_KBQ (4 * GDN_LDQ)      // floats per 8-row k block

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ void st2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }

// A lane's accumulator pair (row `row` = 8kb + lane / 4, columns m, m + 1) into a quad-layout
// matrix: lanes l and l ^ 16 hold rows k and k + 4 of the same columns; after one exchange
// the lower lane writes column m's cell, the upper column m + 1's. All 32 lanes must call it.
__device__ __forceinline__ void st_quad(float* mat, int row, int m, float x0, float x1, int lane) {
    unsigned h0, l0, h1, l1;
    split_tf32(x0, h0, l0);
    split_tf32(x1, h1, l1);
    const bool up = lane & 16;
    const unsigned sh = __shfl_xor_sync(0xffffffffu, up ? h0 : h1, 16);
    const unsigned sl = __shfl_xor_sync(0xffffffffu, up ? l0 : l1, 16);
    float* cell = mat + (row >> 3) * GDN_KBQ + (row & 3) * GDN_LDQ + 4 * (m + (up ? 1 : 0));
    st4(cell, up ? make_float4(__uint_as_float(sh), __uint_as_float(h1), __uint_as_float(sl), __uint_as_float(l1))
                 : make_float4(__uint_as_float(h0), __uint_as_float(sh), __uint_as_float(l0), __uint_as_float(sl)));
}

__device__ __forceinline__ void gdn_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void gdn_prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

// 3xTF32 pieces of gdn_chunk_prep. The A fragment (16 rows x 8) of f32 rows at `a`, stride
// lda ≡ 4 mod 32 (ldmatrix conflict free), split into hi and lo.
__device__ __forceinline__ void gdn_frag_a(const float* a, int lda, int lane, unsigned (&hi)[4], unsigned (&lo)[4]) {
    unsigned f[4];
    ldsm_x4(f, a + (lane & 15) * lda + (lane >> 4) * 4);
#pragma unroll
    for (int e = 0; e < 4; e++) split_tf32(__uint_as_float(f[e]), hi[e], lo[e]);
}
// A B fragment's b0, b1 split as {hi(b0), hi(b1), lo(b0), lo(b1)}.
__device__ __forceinline__ void gdn_frag_b(float b0, float b1, unsigned (&b)[4]) {
    split_tf32(b0, b[0], b[2]);
    split_tf32(b1, b[1], b[3]);
}
// acc += A_hi B_hi, cor += A_hi B_lo + A_lo B_hi (the cross terms in their own chain).
__device__ __forceinline__ void gdn_mma3(float (&acc)[4], float (&cor)[4], const unsigned (&ah)[4],
                                         const unsigned (&al)[4], const unsigned (&b)[4]) {
    mma_tf32_1688(cor, al, b[0], b[1]);
    mma_tf32_1688(cor, ah, b[2], b[3]);
    mma_tf32_1688(acc, ah, b[0], b[1]);
}

// Chunked delta rule (prefill), part 1: all chunks in parallel. Block = chunk blockIdx.x of
// value head blockIdx.y, 256 threads. With γ the inclusive cumulative log-decay inside the
// chunk and Γ_rs = exp(γ_r − γ_s) (s <= r, so never exp of a positive number):
//   L = strictly lower (β_r k_r·k_s Γ_rs),   P = lower incl. diagonal (q_r·k_s Γ_rs),
//   X = [W | U] = (I + L)^-1 [β e^γ K | β V],   Q' = e^γ Q − P W,   O_intra = P U,
// so that part 2 (sequential over chunks) needs only V' = U − W S, O = O_intra + Q' S and the
// state update: equal to the CPU reference's chunk (O = e^γ Q S + P V', V' = U − W S).
// Every product runs on tensor cores, 3xTF32 as in gdn_chunk_state (the f32 SIMT version was
// latency-bound: 884 µs per layer at 8,192 tokens). The solve is blocked so that it is
// products too: T_d = (I + L_dd)^-1 of the four 16x16 diagonal blocks by a short serial
// solve, then X_d = T_d (B_d − L_{d,<d} X_{<d}) block row by block row. Columns of X are
// independent, so a warp owns its 8-column tiles of X for all rows and the solve needs no
// block barrier; Y_d = P_{d,≤d} X_{≤d} shares the split fragments of X_{≤d} with the products
// of R_{d+1}. L and P are kept negated, so the products accumulate onto B and onto e^γ Q.
// Out: w, qp [hv, tp, DK], u [hv, tp, dv], gamma [hv, tp] (tp = chunks * 64; the tail of a
// partial last chunk is padded as g = β = 0, q = k = v = 0, so its rows of W, Q', U are 0 and
// its γ is the last token's); O_intra into o [t, hv, dv]. Needs dv % 4 == 0 and c % 4 == 0.
// Dynamic shared memory: see GdnShape::prep_smem_bytes on the host (108,288 bytes at
// dk = dv = 128: two blocks per SM).
template <int DK>
__device__ void gdn_chunk_prep_impl(const float* __restrict__ qkv, int c, const float* __restrict__ g,
                                    const float* __restrict__ beta, float* __restrict__ w_out,
                                    float* __restrict__ qp_out, float* __restrict__ u_out,
                                    float* __restrict__ gamma_out, float* __restrict__ o, int t, int hk,
                                    int hv, int dv) {
    extern __shared__ __align__(16) float gdn_smem[];
    constexpr int LDK = DK + 4;  // K and Q rows, ≡ 4 mod 32 like GDN_LDP: A and B loads conflict free
    constexpr int LDT = 20;      // T_d rows, the same
    const int nx = DK + (dv + 7) / 8 * 8;      // X columns: W, U, zeros up to whole 8-column tiles
    const int ldx = nx + (40 - nx % 32) % 32;  // ≡ 8 mod 32: B fragment loads X[k][n] conflict free
    float* nl = gdn_smem;               // [64][LDP] −L
    float* np = nl + GDN_C * GDN_LDP;   // [64][LDP] −P
    float* gam = np + GDN_C * GDN_LDP;  // [64] γ
    float* eg = gam + GDN_C;            // [64] e^γ
    float* bet = eg + GDN_C;            // [64] β
    float* tinv = bet + GDN_C;          // [4 * 16][LDT] T_d, row 16 d + i
    float* ks = tinv + 4 * 16 * LDT;    // [64][LDK] K
    float* qs = ks + GDN_C * LDK;       // [64][LDK] Q
    float* xs = ks;                     // [64][ldx] B = [K | V | 0], turned into X; replaces K and Q
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
    const int c0 = blockIdx.x * GDN_C, j = blockIdx.y, kh = j / (hv / hk);
    const int n = min(GDN_C, t - c0);
    const size_t tp = (size_t)gridDim.x * GDN_C;
    const size_t qoff = (size_t)kh * DK, koff = (size_t)(hk + kh) * DK;
    const size_t voff = (size_t)2 * hk * DK + (size_t)j * dv;
    const float* rows = qkv + (size_t)c0 * c;  // the chunk's conv rows
    float* wrows = w_out + ((size_t)j * tp + c0) * DK;
    float* qprows = qp_out + ((size_t)j * tp + c0) * DK;
    float* urows = u_out + ((size_t)j * tp + c0) * dv;

    for (int idx = tid; idx < GDN_C * DK / 4; idx += blockDim.x) {
        const int r = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
        const bool in = r < n;
        cp_async16(ks + r * LDK + i, in ? rows + (size_t)r * c + koff + i : qkv, in);
        cp_async16(qs + r * LDK + i, in ? rows + (size_t)r * c + qoff + i : qkv, in);
    }
    cp_async_commit();
    {  // the V rows are read after L and P: into L2 meanwhile
        const int lines = (dv + 31) / 32;
        for (int idx = tid; idx < n * lines; idx += blockDim.x)
            gdn_prefetch_l2(rows + (size_t)(idx / lines) * c + voff + 32 * (idx % lines));
    }
    if (tid < GDN_C) {
        const bool in = tid < n;
        gam[tid] = in ? g[(size_t)(c0 + tid) * hv + j] : 0.0f;
        bet[tid] = in ? beta[(size_t)(c0 + tid) * hv + j] : 0.0f;
    }
    cp_async_wait_all();
    __syncthreads();
    if (tid == 0) {  // serial, in the CPU reference's order; read after the next barrier
        float acc = 0.0f;
#pragma unroll 8
        for (int r = 0; r < GDN_C; r++) {
            acc += gam[r];
            gam[r] = acc;
        }
    }

    // K Kᵀ and Q Kᵀ on the 20 (16-row tile, 8-column tile) pairs on or below the diagonal. Warp:
    // row tile ti, column tiles tn0 .. tn0 + tcnt − 1 (warps 0-7: 0/0-1, 1/0-1, 1/2-3, 2/0-2,
    // 2/3-5, 3/0-2, 3/3-5, 3/6-7), so a k step splits 2 A fragments for 2-3 tiles and each B
    // fragment once for both products; the warps ending on column tile 2 ti + 1 own a diagonal block.
    const int ti = (0x33322110 >> 4 * warp) & 15, tn0 = (0x63030200 >> 4 * warp) & 15,
              tcnt = (0x23333222 >> 4 * warp) & 15;
    float lacc[3][4], lcor[3][4], pacc[3][4], pcor[3][4];
#pragma unroll
    for (int p = 0; p < 3; p++)
#pragma unroll
        for (int e = 0; e < 4; e++) lacc[p][e] = lcor[p][e] = pacc[p][e] = pcor[p][e] = 0.0f;
    {
        const float* ka = ks + 16 * ti * LDK;
        const float* qa = qs + 16 * ti * LDK;
        // B = Kᵀ from K rows: one ldmatrix gives b0, b1 of k steps k0 and k0 + 8
        const float* kb = ks + (8 * tn0 + (lane & 7)) * LDK + (lane >> 3) * 4;
#pragma unroll 2
        for (int k0 = 0; k0 < DK; k0 += 16) {
            unsigned bf[3][4];
#pragma unroll
            for (int p = 0; p < 3; p++)
                if (p < tcnt) ldsm_x4(bf[p], kb + 8 * p * LDK + k0);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                unsigned kah[4], kal[4], qah[4], qal[4];
                gdn_frag_a(ka + k0 + 8 * h, LDK, lane, kah, kal);
                gdn_frag_a(qa + k0 + 8 * h, LDK, lane, qah, qal);
#pragma unroll
                for (int p = 0; p < 3; p++) {
                    if (p < tcnt) {
                        unsigned b[4];
                        gdn_frag_b(__uint_as_float(bf[p][2 * h]), __uint_as_float(bf[p][2 * h + 1]), b);
                        gdn_mma3(lacc[p], lcor[p], kah, kal, b);
                        gdn_mma3(pacc[p], pcor[p], qah, qal, b);
                    }
                }
            }
        }
    }
    __syncthreads();  // K and Q read (their space is free), γ summed

    // B's rows into X's place (the β, e^γ scaling is applied where R starts from them); zeros
    // past t and in the padding columns.
    {
        const int nx4 = nx / 4;
        for (int idx = tid; idx < GDN_C * nx4; idx += blockDim.x) {
            const int r = idx / nx4, col = (idx % nx4) * 4;
            const bool in = r < n && col < DK + dv;
            cp_async16(xs + r * ldx + col, in ? rows + (size_t)r * c + (col < DK ? koff + col : voff + (col - DK)) : qkv, in);
        }
        cp_async_commit();
    }
    if (tid < GDN_C) {
        eg[tid] = expf(gam[tid]);
        gamma_out[(size_t)j * tp + c0 + tid] = gam[tid];
    }
    // −L and −P with the decay and the masks; tiles right of the diagonal are never read.
#pragma unroll
    for (int p = 0; p < 3; p++) {
        if (p < tcnt) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 16 * ti + gq + 8 * h, s = 8 * (tn0 + p) + 2 * cq;
                float lv[2], pv[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float kk = lacc[p][2 * h + e] + lcor[p][2 * h + e];
                    const float qk = pacc[p][2 * h + e] + pcor[p][2 * h + e];
                    const float d = s + e <= r ? expf(gam[r] - gam[s + e]) : 0.0f;
                    lv[e] = s + e < r ? -(bet[r] * kk * d) : 0.0f;
                    pv[e] = s + e <= r ? -(qk * d) : 0.0f;
                }
                st2(nl + r * GDN_LDP + s, lv[0], lv[1]);
                st2(np + r * GDN_LDP + s, pv[0], pv[1]);
            }
        }
    }
    // T_d = (I + L_dd)^-1 (unit lower triangular) for d = ti, by the warp that wrote that
    // diagonal block: lane m < 16 solves (I + L_dd) x = e_m by substitution, column m of T_d.
    if (tn0 + tcnt == 2 * ti + 2) {
        __syncwarp();
        if (lane < 16) {
            const float* ld = nl + 16 * ti * (GDN_LDP + 1);
            float tcol[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float a = 0.0f;
#pragma unroll
                for (int s = 0; s < i; s++) a = fmaf(ld[i * GDN_LDP + s], tcol[s], a);
                tcol[i] = i < lane ? 0.0f : i == lane ? 1.0f : a;
            }
#pragma unroll
            for (int i = 0; i < 16; i++) tinv[(16 * ti + i) * LDT + lane] = tcol[i];
        }
    }
    cp_async_wait_all();
    __syncthreads();  // −L, −P, T_d, e^γ and B in place

    // Block forward substitution and Y = P X. Warp: column tiles tb + 8p (p < 4) of X, all 64
    // rows, so only __syncwarp orders its reads and writes of X. Row block d: R_d (accumulated
    // in step d − 1) replaces B_d, X_d = T_d R_d replaces R_d and goes out as W or U; then the
    // split fragments of X_{≤d} feed both R_{d+1} = B_{d+1} − L_{d+1,≤d} X_{≤d} and
    // e^γ Q − P_{d,≤d} X_{≤d}, which is Q' on W columns and −O_intra on U columns (Q is 0 there).
    const int ntile = nx / 8;
    for (int tb = warp; tb < ntile; tb += 32) {
        // tile p: columns 8 tb + 64 p .., the lane's accumulator columns col + 64 p, + 1
        const int col = 8 * tb + 2 * cq;
        const float* xb = xs + cq * ldx + 8 * tb + gq;  // the lane's B fragment element, row 0
        bool has[4];
#pragma unroll
        for (int p = 0; p < 4; p++) has[p] = tb + 8 * p < ntile;
        float racc[4][4], rcor[4][4];
        auto start_r = [&](int d) {  // R_d starts as the B rows of block d, scaled
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * d + gq + 8 * h, m = col + 64 * p;
                    const float2 v = has[p] ? ld2(xs + r * ldx + m) : make_float2(0.0f, 0.0f);
                    const float sc = m < DK ? bet[r] * eg[r] : bet[r];
                    racc[p][2 * h] = sc * v.x;
                    racc[p][2 * h + 1] = sc * v.y;
                    rcor[p][2 * h] = rcor[p][2 * h + 1] = 0.0f;
                }
        };
        start_r(0);
        int r0 = 0;  // the row block's first row
        // f(row, column, v, v + 1) for the lane's accumulator pairs of its tiles in block r0
        auto each_pair = [&](const float(&acc)[4][4], const float(&cor)[4][4], auto&& f) {
#pragma unroll
            for (int p = 0; p < 4; p++)
                if (has[p])
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        f(r0 + gq + 8 * h, col + 64 * p, acc[p][2 * h] + cor[p][2 * h],
                          acc[p][2 * h + 1] + cor[p][2 * h + 1]);
        };
        for (int d = 0; d < 4; d++) {
            r0 = 16 * d;
            float2 qv[4][2];  // Q rows of the block (0 off the W columns), fetched early
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = r0 + gq + 8 * h, m = col + 64 * p;
                    qv[p][h] = has[p] && m < DK && r < n ? ld2(rows + (size_t)r * c + qoff + m) : make_float2(0.0f, 0.0f);
                }
#pragma unroll
            for (int p = 0; p < 4; p++)
                if (has[p])
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        st2(xs + (r0 + gq + 8 * h) * ldx + col + 64 * p, racc[p][2 * h] + rcor[p][2 * h],
                            racc[p][2 * h + 1] + rcor[p][2 * h + 1]);
            __syncwarp();
            float xacc[4][4], xcor[4][4];
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int e = 0; e < 4; e++) xacc[p][e] = xcor[p][e] = 0.0f;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                unsigned th[4], tl[4];
                gdn_frag_a(tinv + r0 * LDT + 8 * h, LDT, lane, th, tl);
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    if (has[p]) {
                        const float* x = xb + (r0 + 8 * h) * ldx + 64 * p;
                        unsigned b[4];
                        gdn_frag_b(x[0], x[4 * ldx], b);
                        gdn_mma3(xacc[p], xcor[p], th, tl, b);
                    }
                }
            }
            __syncwarp();  // every lane has read R_d
            each_pair(xacc, xcor, [&](int r, int m, float x0, float x1) {
                st2(xs + r * ldx + m, x0, x1);
                if (m < DK) st2(wrows + (size_t)r * DK + m, x0, x1);
                else if (m < DK + dv) st2(urows + (size_t)r * dv + (m - DK), x0, x1);
            });
            __syncwarp();  // X_d visible to every lane
            if (d < 3) start_r(d + 1);
            float yacc[4][4], ycor[4][4];
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float e = eg[r0 + gq + 8 * h];
                    yacc[p][2 * h] = e * qv[p][h].x;
                    yacc[p][2 * h + 1] = e * qv[p][h].y;
                    ycor[p][2 * h] = ycor[p][2 * h + 1] = 0.0f;
                }
            for (int k = 0; k < 2 * (d + 1); k++) {
                unsigned ph[4], pl[4], lh[4], ll[4];
                gdn_frag_a(np + r0 * GDN_LDP + 8 * k, GDN_LDP, lane, ph, pl);
                if (d < 3) gdn_frag_a(nl + (r0 + 16) * GDN_LDP + 8 * k, GDN_LDP, lane, lh, ll);
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    if (has[p]) {
                        const float* x = xb + 8 * k * ldx + 64 * p;
                        unsigned b[4];
                        gdn_frag_b(x[0], x[4 * ldx], b);
                        gdn_mma3(yacc[p], ycor[p], ph, pl, b);
                        if (d < 3) gdn_mma3(racc[p], rcor[p], lh, ll, b);
                    }
                }
            }
            each_pair(yacc, ycor, [&](int r, int m, float y0, float y1) {
                if (m < DK) st2(qprows + (size_t)r * DK + m, y0, y1);
                else if (m < DK + dv && r < n) st2(o + ((size_t)(c0 + r) * hv + j) * dv + (m - DK), -y0, -y1);
            });
        }
    }
}

// S ← e^{γ_last} S + Kᵀ Vd for one warp's S tiles (column tiles tile0 + p, rows srow and
// srow + 8, f32 in sr), on 3xTF32 mma with the cross terms in their own accumulators; A = Kᵀ
// read transposed from K rows at kt, B = Vd in the quad layout; the new S is then stored split
// into `dst` (quad layout) for the next chunk's products.
template <int DK, int NPW>
__device__ __forceinline__ void gdn_state_update(float (&sr)[NPW][4], float el, const float* kt, const float* vd,
                                                 float* dst, int srow, int tile0, int lane) {
    constexpr int LDKT = DK + 8;
    const int gq = lane >> 2, cq = lane & 3;
    float cor[NPW][4];
#pragma unroll
    for (int p = 0; p < NPW; p++)
#pragma unroll
        for (int e = 0; e < 4; e++) sr[p][e] *= el, cor[p][e] = 0.0f;
#pragma unroll 2
    for (int r0 = 0; r0 < GDN_C; r0 += 8) {
        const float* ka = kt + (r0 + cq) * LDKT + srow;
        const float kv[4] = {ka[0], ka[8], ka[4 * LDKT], ka[4 * LDKT + 8]};
        unsigned ah[4], al[4];
#pragma unroll
        for (int e = 0; e < 4; e++) split_tf32(kv[e], ah[e], al[e]);
#pragma unroll
        for (int p = 0; p < NPW; p++) {
            const float4 q = ld4(vd + (r0 >> 3) * GDN_KBQ + cq * GDN_LDQ + 4 * (8 * ((tile0 + p) % 4) + gq));
            const unsigned bh0 = __float_as_uint(q.x), bh1 = __float_as_uint(q.y);
            const unsigned bl0 = __float_as_uint(q.z), bl1 = __float_as_uint(q.w);
            mma_tf32_1688(cor[p], al, bh0, bh1);
            mma_tf32_1688(cor[p], ah, bl0, bl1);
            mma_tf32_1688(sr[p], ah, bh0, bh1);
        }
    }
#pragma unroll
    for (int p = 0; p < NPW; p++) {
#pragma unroll
        for (int e = 0; e < 4; e++) sr[p][e] += cor[p][e];
        const int m = 8 * ((tile0 + p) % 4) + 2 * cq;
        st_quad(dst, srow, m, sr[p][0], sr[p][1], lane);
        st_quad(dst, srow + 8, m, sr[p][2], sr[p][3], lane);
    }
}

// Chunked delta rule, part 2 (gdn_chunk_state): the chunks in order, for value head blockIdx.x
// and value columns [32 * blockIdx.y, +32), on tensor cores with f32 precision by the 3xTF32
// split: each operand x = hi + lo (hi = tf32(x), lo = tf32(x − hi)) and
// A B ≈ A_hi B_hi + (A_hi B_lo + A_lo B_hi), three mma.sync m16n8k8, f32 accumulate (the
// dropped A_lo B_lo is ~2^-22 of the product). The state slice S [DK, 32] stays in registers
// (f32, mma accumulator layout) from the first chunk to the last, with its (hi, lo) split in
// shared memory (quad layout, above) as the B operand; W, Q' and K stay f32 in shared memory
// and are split as their fragments are loaded. 512 threads in two teams of 8 warps, so that
// O = O_intra + Q' S (not on the state's critical path) runs beside the state update instead
// of before it (H200, 4,096 tokens: 0.793 ms against 0.878 for the removed 8-warp kernel that
// did [W; Q'] S first). Team A (warps 0-7) owns S:
//   R = W S (64 x 32; warp: 16 rows x 16 columns), Vd = e^{γ_last − γ} (U − R) (quad layout),
//   S ← e^{γ_last} S + Kᵀ Vd (gdn_state_update), its split into the other S buffer;
// team B (warps 8-15) computes O = O_intra + Q' S of the same chunk from the S buffer team A
// is not writing. One block barrier per chunk (hand-off: S, tiles, buffers), one team-A
// barrier (Vd, K). W and K are single-buffered (refilled once dead, with an L2 prefetch a
// chunk ahead), Q' and S double-buffered. Dynamic shared memory: GdnShape::state_smem_bytes
// (223,744 at dk 128).
#define GDN_STATE_THREADS 512

// Phase clock of gdn_chunk_state's block (0, 0), compiled in with
// KESTREL_KERNEL_DEFINES=KESTREL_GDN_TRACE (the GPU test gdn_chunk_state_phases prints it):
// per chunk (the first GDN_TRACE_CHUNKS), clock64 of team A's thread 0 at slots 0-7 and of team
// B's thread 0 at slots 8-15, at the points GDN_PHASE marks.
#define GDN_TRACE_CHUNKS 256
__device__ u64 g_gdn_phase[GDN_TRACE_CHUNKS * 16];
extern "C" __global__ void gdn_phase_read(u64* __restrict__ out) {
    for (int i = threadIdx.x; i < GDN_TRACE_CHUNKS * 16; i += blockDim.x) out[i] = g_gdn_phase[i];
}
// (TEAM: threads a team; its thread 0 writes)
#ifdef KESTREL_GDN_TRACE
#define GDN_PHASE_AT(slot, TEAM)                                                                 \
    if (blockIdx.x == 0 && blockIdx.y == 0 && tid % (TEAM) == 0 && ch < GDN_TRACE_CHUNKS)       \
    g_gdn_phase[ch * 16 + (team_a ? 0 : 8) + (slot)] = clock64()
#else
#define GDN_PHASE_AT(slot, TEAM)
#endif
#define GDN_PHASE(slot) GDN_PHASE_AT(slot, 256)

// One team's (TT threads, tt its index) cp.async copies of a chunk's 64 rows of a [rows][DK]
// f32 scratch tensor, from row row0, into a [64][DK + 4] tile, and of the chunk's 64 γ into
// gdst if given; the caller commits.
template <int DK, int TT>
__device__ __forceinline__ void gdn_copy_tile(const float* src, size_t row0, float* dst, float* gdst,
                                              const float* gamma_in, int tt) {
    constexpr int RPI = TT * 4 / DK, LDW = DK + 4;  // rows a pass
    const int lr = tt / (DK / 4), lc = (tt % (DK / 4)) * 4;
    const float* s = src + (row0 + lr) * DK + lc;
    float* d = dst + lr * LDW + lc;
#pragma unroll
    for (int p = 0; p < GDN_C / RPI; p++) cp_async16(d + p * RPI * LDW, s + p * RPI * DK, true);
    if (gdst && tt < GDN_C / 4) cp_async16(gdst + 4 * tt, gamma_in + row0 + 4 * tt, true);
}
// The same team's copies of chunk ch's K rows (key head at column koff of the conv rows, 0
// past t) into a [64][DK + 8] tile; the caller commits.
template <int DK, int TT>
__device__ __forceinline__ void gdn_copy_k(const float* qkv, int c, size_t koff, int ch, int t, float* kt, int tt) {
    constexpr int RPI = TT * 4 / DK, LDKT = DK + 8;
    const int lr = tt / (DK / 4), lc = (tt % (DK / 4)) * 4;
    const int s0 = ch * GDN_C + lr;
    const float* src = qkv + (size_t)s0 * c + koff + lc;
#pragma unroll
    for (int p = 0; p < GDN_C / RPI; p++) {
        const bool in = s0 + p * RPI < t;
        cp_async16(kt + (lr + p * RPI) * LDKT + lc, in ? src + (size_t)p * RPI * c : qkv, in);
    }
}
// bar.sync on barrier `id` for `threads` threads (whole warps); attention.cu's bar_sync_named
// comes later in the module, so gdn.cu has its own.
__device__ __forceinline__ void gdn_bar(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// acc (16 rows x 2 column tiles of 8) = A S with A 16 f32 rows at `a` (row stride LDA) and S's
// split (quad layout) at `s`, column tiles 2 * half and 2 * half + 1, 3xTF32; whole warp.
template <int DK, int LDA>
__device__ __forceinline__ void gdn_rows_times_s(const float* a, const float* s, int half, int lane,
                                                 float (&acc)[2][4]) {
    const int gq = lane >> 2, cq = lane & 3;
    float cor[2][4];  // the cross terms, their own chains for ILP
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = cor[nt][e] = 0.0f;
    const float* arow = a + (lane & 15) * LDA + (lane >> 4) * 4;
#pragma unroll 4
    for (int k0 = 0; k0 < DK; k0 += 8) {
        unsigned af[4], ah[4], al[4];
        ldsm_x4(af, arow + k0);
#pragma unroll
        for (int e = 0; e < 4; e++) split_tf32(__uint_as_float(af[e]), ah[e], al[e]);
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const float4 q = ld4(s + (k0 >> 3) * GDN_KBQ + cq * GDN_LDQ + 4 * (8 * (2 * half + nt) + gq));
            const unsigned bh0 = __float_as_uint(q.x), bh1 = __float_as_uint(q.y);
            const unsigned bl0 = __float_as_uint(q.z), bl1 = __float_as_uint(q.w);
            mma_tf32_1688(cor[nt], al, bh0, bh1);
            mma_tf32_1688(cor[nt], ah, bl0, bl1);
            mma_tf32_1688(acc[nt], ah, bh0, bh1);
        }
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] += cor[nt][e];
}

template <int DK>
__device__ void gdn_chunk_state_impl(const float* __restrict__ qkv, int c, const float* __restrict__ w_in,
                                      const float* __restrict__ qp_in, const float* __restrict__ u_in,
                                      const float* __restrict__ gamma_in, float* __restrict__ state,
                                      float* __restrict__ o, int t, int hk, int hv, int dv) {
    extern __shared__ __align__(16) float gdn_smem[];
    constexpr int LDW = DK + 4, LDKT = DK + 8, RT = DK / 16;
    constexpr int NPW = RT >= 2 ? RT / 2 : 1;
    constexpr int TILE = GDN_C * LDW;            // floats of a W or Q' tile
    constexpr int SBUF = DK / 8 * GDN_KBQ;       // floats of one split S
    float* ws = gdn_smem;                        // [64][LDW] W (team A)
    float* qs = ws + TILE;                       // [2][64][LDW] Q', by chunk parity (team B)
    float* kt = qs + 2 * TILE;                   // [64][LDKT] K (0 past t)
    float* ss = kt + GDN_C * LDKT;               // [2][DK / 8][KBQ] S_ch split in buffer ch & 1
    float* vd = ss + 2 * SBUF;                   // [8][KBQ] Vd, quad layout
    float* gm = vd + GDN_C / 8 * GDN_KBQ;        // [2][64] γ, by chunk parity
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
    const bool team_a = warp < 8;
    const int wt = warp & 7, tt = tid & 255;  // warp and thread within the team
    const int j = blockIdx.x, m0 = blockIdx.y * GDN_DVS;
    const int kh = j / (hv / hk), nchunks = (t + GDN_C - 1) / GDN_C;
    const size_t tp = (size_t)nchunks * GDN_C;
    const int dvs = min(GDN_DVS, dv - m0);
    const size_t koff = (size_t)(hk + kh) * DK;
    float* st = state + (size_t)j * DK * dv + m0;

    // Loaders of one team (256 threads); each commits one group, possibly empty, and every
    // wait below is a wait for all.
    auto load_tile = [&](const float* src, int ch, float* dst, float* gdst) {
        if (ch < nchunks) gdn_copy_tile<DK, 256>(src, (size_t)j * tp + (size_t)ch * GDN_C, dst, gdst, gamma_in, tt);
        cp_async_commit();
    };
    auto load_k = [&](int ch) {
        gdn_copy_k<DK, 256>(qkv, c, koff, ch, t, kt, tt);
        cp_async_commit();
    };

    const bool has_s = team_a && (8 * NPW <= 4 * RT || wt * NPW < 4 * RT);  // DK = 16: warps 0-3
    const int srow = 16 * (wt * NPW / 4) + gq;  // S rows srow and srow + 8 of this warp
    float sr[NPW][4];
    if (team_a) {
        load_tile(w_in, 0, ws, gm);
#pragma unroll
        for (int p = 0; p < NPW; p++) {
            const int m = 8 * ((wt * NPW + p) % 4) + 2 * cq;
            const bool ok = has_s && m < dvs;
            sr[p][0] = ok ? st[(size_t)srow * dv + m] : 0.0f;  // padding columns stay 0
            sr[p][1] = ok ? st[(size_t)srow * dv + m + 1] : 0.0f;
            sr[p][2] = ok ? st[(size_t)(srow + 8) * dv + m] : 0.0f;
            sr[p][3] = ok ? st[(size_t)(srow + 8) * dv + m + 1] : 0.0f;
            if (has_s) {
                st_quad(ss, srow, m, sr[p][0], sr[p][1], lane);
                st_quad(ss, srow + 8, m, sr[p][2], sr[p][3], lane);
            }
        }
    } else {
        load_tile(qp_in, 0, qs, nullptr);
    }
    cp_async_wait_all();

    // Both teams: 16 rows 16 * (wt >> 1).. of the chunk, column tiles 2 * (wt & 1), +1.
    const int r = 16 * (wt >> 1) + gq, half = wt & 1;
    for (int ch = 0; ch < nchunks; ch++) {
        const int par = ch & 1, c0 = ch * GDN_C;
        // S_ch in ss[par]; this chunk's W, γ and Q' landed; the last chunk's readers of ws,
        // qs[par ^ 1], ss[par ^ 1], kt, vd and gm[par ^ 1] are done.
        __syncthreads();
        GDN_PHASE(0);
        const float* sc = ss + par * SBUF;
        if (team_a) {
            load_k(ch);
            if (ch + 1 < nchunks) {  // next W and U rows into L2: their copies start mid-chunk
                const size_t row1 = (size_t)j * tp + (size_t)(ch + 1) * GDN_C;
                for (int i = tt; i < 2 * DK; i += 256) gdn_prefetch_l2(w_in + row1 * DK + 32 * i);
                if (tt < GDN_C) gdn_prefetch_l2(u_in + (row1 + tt) * dv + m0);
            }
            const float* gc = gm + par * GDN_C;
            float pre[2][4];  // U rows r, r + 8, fetched before the product
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int m = 8 * (2 * half + nt) + 2 * cq;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float2 v = make_float2(0.f, 0.f);
                    if (m < dvs) v = ld2(u_in + ((size_t)j * tp + c0 + r + 8 * h) * dv + m0 + m);
                    pre[nt][2 * h] = v.x;
                    pre[nt][2 * h + 1] = v.y;
                }
            }
            float acc[2][4];
            gdn_rows_times_s<DK, LDW>(ws + 16 * (wt >> 1) * LDW, sc, half, lane, acc);
            GDN_PHASE(1);
            const float last = gc[GDN_C - 1];
            const float d0 = expf(last - gc[r]), d1 = expf(last - gc[r + 8]);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int m = 8 * (2 * half + nt) + 2 * cq;
                st_quad(vd, r, m, (pre[nt][0] - acc[nt][0]) * d0, (pre[nt][1] - acc[nt][1]) * d0, lane);
                st_quad(vd, r + 8, m, (pre[nt][2] - acc[nt][2]) * d1, (pre[nt][3] - acc[nt][3]) * d1, lane);
            }
            GDN_PHASE(2);
            cp_async_wait_all();  // this chunk's K
            GDN_PHASE(3);
            gdn_bar(1, 256);      // team A: Vd complete, K visible, every read of W done
            GDN_PHASE(4);
            load_tile(w_in, ch + 1, ws, gm + (par ^ 1) * GDN_C);

            // S ← e^{γ_last} S + Kᵀ Vd (A = Kᵀ read transposed), split into ss[par ^ 1].
            if (has_s) gdn_state_update<DK, NPW>(sr, expf(last), kt, vd, ss + (par ^ 1) * SBUF, srow, wt * NPW, lane);
            GDN_PHASE(5);
        } else {
            load_tile(qp_in, ch + 1, qs + (par ^ 1) * TILE, nullptr);
            float pre[2][4];  // O_intra rows r, r + 8
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int m = 8 * (2 * half + nt) + 2 * cq;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int rr = r + 8 * h;
                    float2 v = make_float2(0.f, 0.f);
                    if (m < dvs && c0 + rr < t) v = ld2(o + ((size_t)(c0 + rr) * hv + j) * dv + m0 + m);
                    pre[nt][2 * h] = v.x;
                    pre[nt][2 * h + 1] = v.y;
                }
            }
            float acc[2][4];
            gdn_rows_times_s<DK, LDW>(qs + par * TILE + 16 * (wt >> 1) * LDW, sc, half, lane, acc);
            GDN_PHASE(1);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int m = 8 * (2 * half + nt) + 2 * cq;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int rr = r + 8 * h;
                    if (m < dvs && c0 + rr < t)
                        st2(o + ((size_t)(c0 + rr) * hv + j) * dv + m0 + m, pre[nt][2 * h] + acc[nt][2 * h],
                            pre[nt][2 * h + 1] + acc[nt][2 * h + 1]);
                }
            }
        }
        GDN_PHASE(6);
        cp_async_wait_all();  // the next chunk's W and γ (team A) or Q' (team B)
        GDN_PHASE(7);
    }
    if (has_s) {
#pragma unroll
        for (int p = 0; p < NPW; p++) {
            const int m = 8 * ((wt * NPW + p) % 4) + 2 * cq;
            if (m < dvs) {
                st[(size_t)srow * dv + m] = sr[p][0];
                st[(size_t)srow * dv + m + 1] = sr[p][1];
                st[(size_t)(srow + 8) * dv + m] = sr[p][2];
                st[(size_t)(srow + 8) * dv + m + 1] = sr[p][3];
            }
        }
    }
}

// gdn_chunk_state on wgmma (sm_90a; DK 64 or 128): the same contract, chunk order and 3xTF32
// products as gdn_chunk_state_impl, with each product a chain of warpgroup MMAs
// (wgmma m64n32k8 tf32) instead of per-warp mma.sync: the A operand (W, Q' rows; Kᵀ) is split
// from f32 into hi and lo in registers, and the B operands (S's and Vd's splits) are read by
// the tensor cores from K-major 128-byte-swizzle tiles, once per warpgroup rather than once
// per warp. 256 threads: warpgroup 0 (team A) owns S (m64 halves of its rows, in registers):
// R = W S, Vd = e^{γ_last − γ} (U − R), S ← e^{γ_last} S + Kᵀ Vd and S's split into the other
// S buffer; warpgroup 1 (team B) computes O = O_intra + Q' S from the buffer team A is not
// writing. U and O_intra come a chunk ahead through cp.async into shared memory (read from
// global into registers, ptxas sank those loads past the products, exposing their latency);
// Q' is single-buffered (refilled once team B's product is done with it). Dynamic shared memory
// (1024-byte aligned): GdnShape::state_wg_smem_bytes (225,792 at dk 128).
#define GDN_STATE_WG_THREADS 256
#define GDN_PHASE_WG(slot) GDN_PHASE_AT(slot, 128)
// Float index of element (n, k) of a K-major tf32 operand tile of 32 rows in the 128-byte
// swizzle: atoms of [32 rows][32 floats] (4 KiB) along k, 16-byte unit k/4 of row n at unit
// (k/4) ^ (n % 8).
__device__ __forceinline__ int gdn_sw(int n, int k) {
    return (k >> 5) * 1024 + n * 32 + ((((k >> 2) & 7) ^ (n & 7)) << 2) + (k & 3);
}
// A descriptor of such a tile advanced to its k8 step kk: the atom, then 32 bytes a step.
__device__ __forceinline__ unsigned long long gdn_desc_k8(unsigned long long d, int kk) {
    return d + (unsigned long long)((kk >> 2) * 256 + (kk & 3) * 2);
}
// The split products' pipeline of the wgmma kernels below: KS k steps in groups of G, the A
// fragments (hi, lo) of a group split by frag(kk, hi, lo) into one of two register sets and its
// products issued by issue(kk, hi, lo) (A_hi B_hi + A_hi B_lo + A_lo B_hi); a set is refilled
// once the group that read it retired (wgmma_wait<1>), so G steps' fragments are live, not KS.
// The caller fences its accumulators and descriptors around it; it returns with every product
// retired.
template <int KS, int G, class Frag, class Issue>
__device__ __forceinline__ void gdn_split_chain(Frag&& frag, Issue&& issue) {
    constexpr int NG = KS / G;
    unsigned fh[2][G][4], fl[2][G][4];
#pragma unroll
    for (int g = 0; g < NG; g++) {
        const int b = g & 1;
        if (g >= 2) wgmma_wait<1>();  // group g - 2, the last reader of set b, retired
#pragma unroll
        for (int i = 0; i < G; i++) {
            frag(g * G + i, fh[b][i], fl[b][i]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                wgmma_fence_operand(fh[b][i][e]);
                wgmma_fence_operand(fl[b][i][e]);
            }
        }
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < G; i++) issue(g * G + i, fh[b][i], fl[b][i]);
        wgmma_commit();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int i = 0; i < G; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                wgmma_fence_operand(fh[b][i][e]);
                wgmma_fence_operand(fl[b][i][e]);
            }
}
// acc (64 x 32, this warpgroup) = A B with A 64 f32 rows at `a` (row stride LDA; this warp's
// 16 from row 16 * warp4) split into hi and lo as loaded, B the split tiles at bh, bl (K = DK):
// A_hi B_hi + A_hi B_lo + A_lo B_hi. The even and odd k steps accumulate in two chains,
// summed at the end (four measured no faster: the instructions' cost bounds it); the A
// fragments come in groups of 4 k steps through two register sets (a set is refilled once
// the wgmma group that read it retired), 64 registers instead of 128.
template <int DK, int LDA>
__device__ __forceinline__ void gdn_wg_rows_mma(const float* a, int warp4, int lane, unsigned long long bh,
                                                unsigned long long bl, float (&acc)[16]) {
    float acc2[16];
    wgmma_fence_operand(bh);
    wgmma_fence_operand(bl);
#pragma unroll
    for (int e = 0; e < 16; e++) {
        wgmma_fence_operand(acc[e]);
        wgmma_fence_operand(acc2[e]);
    }
    gdn_split_chain<DK / 8, 4>(
        [&](int kk, unsigned (&hi)[4], unsigned (&lo)[4]) {
            gdn_frag_a(a + 16 * warp4 * LDA + 8 * kk, LDA, lane, hi, lo);
        },
        [&](int kk, const unsigned (&hi)[4], const unsigned (&lo)[4]) {
            float(&d)[16] = (kk & 1) ? acc2 : acc;
            wgmma_m64n32k8_tf32_rs(d, hi, gdn_desc_k8(bh, kk), kk >= 2);
            wgmma_m64n32k8_tf32_rs(d, hi, gdn_desc_k8(bl, kk), 1);
            wgmma_m64n32k8_tf32_rs(d, lo, gdn_desc_k8(bh, kk), 1);
        });
#pragma unroll
    for (int e = 0; e < 16; e++) {
        wgmma_fence_operand(acc[e]);
        wgmma_fence_operand(acc2[e]);
        acc[e] += acc2[e];
    }
}

template <int DK>
__device__ void gdn_chunk_state_wg_impl(const float* __restrict__ qkv, int c, const float* __restrict__ w_in,
                                         const float* __restrict__ qp_in, const float* __restrict__ u_in,
                                         const float* __restrict__ gamma_in, float* __restrict__ state,
                                         float* __restrict__ o, int t, int hk, int hv, int dv) {
    static_assert(DK % 64 == 0, "S's rows are m64 halves");
    extern __shared__ __align__(1024) float gdn_wg_smem[];
    constexpr int LDW = DK + 4, LDKT = DK + 8, NH = DK / 64;
    constexpr int TILE = GDN_C * LDW;        // floats of a W or Q' tile
    constexpr int ST = DK / 32 * 1024;       // floats of one part (hi or lo) of a split S tile
    constexpr int VT = GDN_C / 32 * 1024;    // ... of a split Vd tile
    constexpr int LDR = GDN_DVS + 8;         // row stride of U and O_intra: float2 reads of a
                                             // quarter-warp's 4 rows hit distinct banks
    constexpr int RT = GDN_C * LDR;          // floats of a U or O_intra tile [64][LDR]
    float* ss = gdn_wg_smem;                 // [2 buffers][hi, lo][ST]: S_ch split in buffer ch & 1
    float* vd = ss + 4 * ST;                 // [hi, lo][VT]: Vd split (n = column, k = chunk row)
    float* ub = vd + 2 * VT;                 // [2][64][LDR] U by chunk parity (team A)
    float* ob = ub + 2 * RT;                 // [2][64][LDR] O_intra by chunk parity (team B)
    float* ws = ob + 2 * RT;                 // [64][LDW] W (team A)
    float* qs = ws + TILE;                   // [64][LDW] Q' (team B)
    float* kt = qs + TILE;                   // [64][LDKT] K (0 past t)
    float* gm = kt + GDN_C * LDKT;           // [2][64] γ, by chunk parity
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
    const bool team_a = warp < 4;
    const int w4 = warp & 3, tt = tid & 127;
    const int j = blockIdx.x, m0 = blockIdx.y * GDN_DVS;
    const int kh = j / (hv / hk), nchunks = (t + GDN_C - 1) / GDN_C;
    const size_t tp = (size_t)nchunks * GDN_C;
    const int dvs = min(GDN_DVS, dv - m0);
    const size_t koff = (size_t)(hk + kh) * DK;
    float* st = state + (size_t)j * DK * dv + m0;
    const int r0 = 16 * w4 + gq;  // accumulator rows r0, r0 + 8; columns 8 i + 2 cq + {0, 1}

    // Loaders of one team (128 threads); the caller commits.
    auto load_tile = [&](const float* src, int ch, float* dst, float* gdst) {
        gdn_copy_tile<DK, 128>(src, (size_t)j * tp + (size_t)ch * GDN_C, dst, gdst, gamma_in, tt);
    };
    // 64 rows x 32 columns of U (scratch rows, padded to whole chunks) or O_intra (o's rows, t
    // of them); columns past dvs and rows past t zero-filled.
    auto load_rows = [&](bool is_u, int ch, float* dst) {
#pragma unroll
        for (int p = 0; p < GDN_C * GDN_DVS / 4 / 128; p++) {
            const int i = tt + 128 * p, r = i / (GDN_DVS / 4), n = (i % (GDN_DVS / 4)) * 4;
            const int row = ch * GDN_C + r;
            const bool in = n < dvs && (is_u || row < t);
            const float* src = is_u ? u_in + ((size_t)j * tp + row) * dv + m0 + n
                                    : o + ((size_t)row * hv + j) * dv + m0 + n;
            cp_async16(dst + r * LDR + n, in ? src : u_in, in);
        }
    };
    auto load_k = [&](int ch) { gdn_copy_k<DK, 128>(qkv, c, koff, ch, t, kt, tt); };
    // S's split into the tiles of buffer b (rows of S are the tiles' k, columns their n).
    auto store_s = [&](const float (&s)[NH][16], int b) {
        float* hi = ss + 2 * b * ST;
#pragma unroll
        for (int h = 0; h < NH; h++)
#pragma unroll
            for (int e = 0; e < 16; e++) {
                const int k = 64 * h + r0 + 8 * ((e >> 1) & 1), n = 8 * (e >> 2) + 2 * cq + (e & 1);
                unsigned vh, vl;
                split_tf32(s[h][e], vh, vl);
                hi[gdn_sw(n, k)] = __uint_as_float(vh);
                hi[ST + gdn_sw(n, k)] = __uint_as_float(vl);
            }
        fence_proxy_async();  // visible to the wgmma (async proxy) after the next barrier
    };

    float s[NH][16];  // team A: S rows 64 h + r0 (+8), the accumulator layout
    if (team_a) {
        load_tile(w_in, 0, ws, gm);
        load_rows(true, 0, ub);
        cp_async_commit();
#pragma unroll
        for (int h = 0; h < NH; h++)
#pragma unroll
            for (int e = 0; e < 16; e++) {
                const int k = 64 * h + r0 + 8 * ((e >> 1) & 1), n = 8 * (e >> 2) + 2 * cq + (e & 1);
                s[h][e] = n < dvs ? st[(size_t)k * dv + n] : 0.0f;  // padding columns stay 0
            }
        store_s(s, 0);
    } else {
        load_tile(qp_in, 0, qs, nullptr);
        load_rows(false, 0, ob);
        cp_async_commit();
    }
    cp_async_wait_all();

    for (int ch = 0; ch < nchunks; ch++) {
        const int par = ch & 1;
        const bool next = ch + 1 < nchunks;
        // S_ch in ss[par]; this chunk's W, γ, U, Q' and O_intra landed; the last chunk's
        // readers of ss[par ^ 1], kt, vd, ub/ob[par ^ 1] and gm[par ^ 1] are done.
        __syncthreads();
        GDN_PHASE_WG(0);
        const unsigned long long sh = wgmma_desc_sw128(ss + 2 * par * ST), sl = wgmma_desc_sw128(ss + (2 * par + 1) * ST);
        float acc[16];
        if (team_a) {
            load_k(ch);
            cp_async_commit();
            if (next) {  // next W and U rows into L2: their copies start mid-chunk
                const size_t row1 = (size_t)j * tp + (size_t)(ch + 1) * GDN_C;
                for (int i = tt; i < 2 * DK; i += 128) gdn_prefetch_l2(w_in + row1 * DK + 32 * i);
                if (tt < GDN_C) gdn_prefetch_l2(u_in + (row1 + tt) * dv + m0);
            }
            gdn_wg_rows_mma<DK, LDW>(ws, w4, lane, sh, sl, acc);
            GDN_PHASE_WG(1);
            const float* gc = gm + par * GDN_C;
            const float* uc = ub + par * RT;
            const float last = gc[GDN_C - 1];
            const float d0 = expf(last - gc[r0]), d1 = expf(last - gc[r0 + 8]);
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                const int k = r0 + 8 * ((e >> 1) & 1), n = 8 * (e >> 2) + 2 * cq;
                const float2 u = ld2(uc + k * LDR + n);
                const float d = (e & 2) ? d1 : d0;
                unsigned vh, vl;
                split_tf32((u.x - acc[e]) * d, vh, vl);
                vd[gdn_sw(n, k)] = __uint_as_float(vh);
                vd[VT + gdn_sw(n, k)] = __uint_as_float(vl);
                split_tf32((u.y - acc[e + 1]) * d, vh, vl);
                vd[gdn_sw(n + 1, k)] = __uint_as_float(vh);
                vd[VT + gdn_sw(n + 1, k)] = __uint_as_float(vl);
            }
            fence_proxy_async();
            GDN_PHASE_WG(2);
            cp_async_wait_all();  // this chunk's K
            GDN_PHASE_WG(3);
            gdn_bar(1, 128);      // team A: Vd complete, K visible, every read of W done
            GDN_PHASE_WG(4);
            if (next) {
                load_tile(w_in, ch + 1, ws, gm + (par ^ 1) * GDN_C);
                load_rows(true, ch + 1, ub + (par ^ 1) * RT);
            }
            cp_async_commit();

            // S ← e^{γ_last} S + Kᵀ Vd: A = Kᵀ (rows of S = columns of K) read from kt here,
            // 2 k steps of both halves a group through two register sets; the halves' chains
            // interleaved.
            const float eg = expf(last);
            const unsigned long long vh = wgmma_desc_sw128(vd), vl = wgmma_desc_sw128(vd + VT);
            unsigned kh_[2][NH][2][4], kl_[2][NH][2][4];
#pragma unroll
            for (int h = 0; h < NH; h++)
#pragma unroll
                for (int e = 0; e < 16; e++) {
                    s[h][e] *= eg;
                    wgmma_fence_operand(s[h][e]);
                }
#pragma unroll
            for (int g = 0; g < GDN_C / 16; g++) {
                const int b = g & 1;
                if (g >= 2) wgmma_wait<1>();
#pragma unroll
                for (int h = 0; h < NH; h++)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const float* kc = kt + (8 * (2 * g + i) + cq) * LDKT + 64 * h + r0;
                        split_tf32(kc[0], kh_[b][h][i][0], kl_[b][h][i][0]);
                        split_tf32(kc[8], kh_[b][h][i][1], kl_[b][h][i][1]);
                        split_tf32(kc[4 * LDKT], kh_[b][h][i][2], kl_[b][h][i][2]);
                        split_tf32(kc[4 * LDKT + 8], kh_[b][h][i][3], kl_[b][h][i][3]);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            wgmma_fence_operand(kh_[b][h][i][e]);
                            wgmma_fence_operand(kl_[b][h][i][e]);
                        }
                    }
                wgmma_fence();
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int kk = 2 * g + i;
#pragma unroll
                    for (int h = 0; h < NH; h++) wgmma_m64n32k8_tf32_rs(s[h], kh_[b][h][i], gdn_desc_k8(vh, kk), 1);
#pragma unroll
                    for (int h = 0; h < NH; h++) wgmma_m64n32k8_tf32_rs(s[h], kh_[b][h][i], gdn_desc_k8(vl, kk), 1);
#pragma unroll
                    for (int h = 0; h < NH; h++) wgmma_m64n32k8_tf32_rs(s[h], kl_[b][h][i], gdn_desc_k8(vh, kk), 1);
                }
                wgmma_commit();
            }
            wgmma_wait<0>();
#pragma unroll
            for (int h = 0; h < NH; h++)
#pragma unroll
                for (int e = 0; e < 16; e++) wgmma_fence_operand(s[h][e]);
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int h = 0; h < NH; h++)
#pragma unroll
                    for (int i = 0; i < 2; i++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            wgmma_fence_operand(kh_[b][h][i][e]);
                            wgmma_fence_operand(kl_[b][h][i][e]);
                        }
            store_s(s, par ^ 1);
            GDN_PHASE_WG(5);
        } else {
#ifdef KESTREL_GDN_WG_NO_B  // diagnostic (wrong o): team A's chain without team B's product
#pragma unroll
            for (int e = 0; e < 16; e++) acc[e] = 0.0f;
#else
            gdn_wg_rows_mma<DK, LDW>(qs, w4, lane, sh, sl, acc);
#endif
            gdn_bar(2, 128);  // team B: every warp has read its Q' rows; refill the tile
            if (next) {
                load_tile(qp_in, ch + 1, qs, nullptr);
                load_rows(false, ch + 1, ob + (par ^ 1) * RT);
            }
            cp_async_commit();
            GDN_PHASE_WG(1);
            const float* oc = ob + par * RT;
            const int c0 = ch * GDN_C;
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                const int r = r0 + 8 * ((e >> 1) & 1), n = 8 * (e >> 2) + 2 * cq;
                if (n < dvs && c0 + r < t) {
                    const float2 v = ld2(oc + r * LDR + n);
                    st2(o + ((size_t)(c0 + r) * hv + j) * dv + m0 + n, v.x + acc[e], v.y + acc[e + 1]);
                }
            }
        }
        GDN_PHASE_WG(6);
        cp_async_wait_all();  // the next chunk's W, γ and U (team A) or Q' and O_intra (team B)
        GDN_PHASE_WG(7);
    }
    if (team_a) {
#pragma unroll
        for (int h = 0; h < NH; h++)
#pragma unroll
            for (int e = 0; e < 16; e++) {
                const int k = 64 * h + r0 + 8 * ((e >> 1) & 1), n = 8 * (e >> 2) + 2 * cq + (e & 1);
                if (n < dvs) st[(size_t)k * dv + n] = s[h][e];
            }
    }
}
// The state passes' entry points: NAME_DK runs IMPL<DK> with THREADS threads, a block an SM.
#define GDN_STATE_ENTRY(NAME, IMPL, THREADS, DK)                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME##_##DK(                                  \
        const float* qkv, int c, const float* w_in, const float* qp_in, const float* u_in,                 \
        const float* gamma_in, float* state, float* o, int t, int hk, int hv, int dv) {                    \
        PREFILL_KERNEL();                                                                                  \
        IMPL<DK>(qkv, c, w_in, qp_in, u_in, gamma_in, state, o, t, hk, hv, dv);                            \
    }
GDN_STATE_ENTRY(gdn_chunk_state_wg, gdn_chunk_state_wg_impl, GDN_STATE_WG_THREADS, 64)
GDN_STATE_ENTRY(gdn_chunk_state_wg, gdn_chunk_state_wg_impl, GDN_STATE_WG_THREADS, 128)

#define GDN_CHUNKED(DK)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_##DK(                             \
        const float* qkv, int c, const float* g, const float* beta, float* w_out, float* qp_out,           \
        float* u_out, float* gamma_out, float* o, int t, int hk, int hv, int dv) {                         \
        PREFILL_KERNEL();                                                                                  \
        gdn_chunk_prep_impl<DK>(qkv, c, g, beta, w_out, qp_out, u_out, gamma_out, o, t, hk, hv, dv);      \
    }                                                                                                      \
    GDN_STATE_ENTRY(gdn_chunk_state, gdn_chunk_state_impl, GDN_STATE_THREADS, DK)
GDN_CHUNKED(16)
GDN_CHUNKED(32)
GDN_CHUNKED(64)
GDN_CHUNKED(128)

// ---- gdn_chunk_prep_wg (sm_90a, dk = dv = 128; opt-in, KESTREL_GDN_PREP=wg): gdn_chunk_prep's
// outputs on wgmma ----
// The same chunk algebra (L, P, X = [W | U] = (I + L)^-1 [β e^γ K | β V], Q' = e^γ Q − P W,
// O_intra = P U) with every product a chain of 3xTF32 `wgmma.m64n64k8` and T = (I + L)^-1
// formed explicitly (so X is one product instead of a blocked substitution):
//   1. K Kᵀ (warpgroup 0: A = K's split tiles through ldmatrix) and Q Kᵀ (warpgroup 1: A = Q's
//      rows), B = K's split tiles (K-major as stored).
//   2. L (f32, for the inverse) and −P's split tiles; T by 16x16 blocks: the diagonal ones by
//      substitution, then T_ij = −T_ii Σ_k L_ik T_kj down each warp's own columns; T split.
//   3. Xᵀ = Bᵀ Tᵀ: M = X's column (warpgroup 0 W's 128, warpgroup 1 U's, an m64 slice at a
//      time), A = the scaled K or V column read transposed from L2, B = T's rows.
//   4. Yᵀ = Xᵀ (−P)ᵀ onto e^γ Qᵀ (W half: Q') or zero (U half: −O_intra), A = Xᵀ straight from
//      the accumulators: the pair (2c, 2c + 1) of an accumulator's k block is the fragment's
//      k (c, c + 4) when −P's tiles hold its columns in that order (gdn_pk).
// Outputs through per-warpgroup staging tiles as whole 16-byte row pieces. Block = chunk
// blockIdx.x of value head blockIdx.y, 256 threads, two blocks an SM; dynamic shared memory
// GdnShape::prep_wg_smem_bytes (101,376 bytes). Level with gdn_chunk_prep on the H200, not
// faster (docs/KERNELS.md, twelfth session, has each version's phase clock).
// Phase clock of gdn_chunk_prep_wg (KESTREL_GDN_TRACE, as gdn_chunk_state's): value head 0's
// block of chunk ch < 128 writes clock64 of each warpgroup's thread 0 at slots 0-7 (warpgroup 1
// at 8-15) of g_gdn_phase's chunk 128 + ch, at the points GDN_PREP_PHASE marks.
#ifdef KESTREL_GDN_TRACE
#define GDN_PREP_PHASE(slot)                                                                     \
    if (blockIdx.y == 0 && blockIdx.x < 128 && tid % 128 == 0)                                   \
    g_gdn_phase[(128 + blockIdx.x) * 16 + 8 * (tid / 128) + (slot)] = clock64()
#else
#define GDN_PREP_PHASE(slot)
#endif
#define GDN_LDR 132  // Q's rows (≡ 4 mod 32: the fragments' ldmatrix conflict free)
#define GDN_LDT 68   // L and T rows
// Element (n, k) of a K-major tf32 split tile of ROWS rows in 128-byte-swizzle panels of 32 k
// (ROWS x 128 bytes each), and a descriptor of such a tile advanced to its k8 step kk.
template <int ROWS>
__device__ __forceinline__ int gdn_swr(int n, int k) {
    return (k >> 5) * (ROWS * 32) + n * 32 + ((((k >> 2) & 7) ^ (n & 7)) << 2) + (k & 3);
}
template <int ROWS>
__device__ __forceinline__ unsigned long long gdn_descr_k8(unsigned long long d, int kk) {
    return d + (unsigned long long)((kk >> 2) * ROWS * 8 + (kk & 3) * 2);
}
// The tf32 A fragment (hi, lo) of k block kk from an accumulator x of the same rows: its column
// pair (2c, 2c + 1) is the fragment's k (c, c + 4).
__device__ __forceinline__ void gdn_acc_frag(const float* x, int kk, unsigned (&hi)[4], unsigned (&lo)[4]) {
    split_tf32(x[4 * kk], hi[0], lo[0]);
    split_tf32(x[4 * kk + 2], hi[1], lo[1]);
    split_tf32(x[4 * kk + 1], hi[2], lo[2]);
    split_tf32(x[4 * kk + 3], hi[3], lo[3]);
}
// −P's column s as stored in its tiles: within each 8, even s to slots 0-3, odd to 4-7.
__device__ __forceinline__ int gdn_pk(int s) { return (s & ~7) | ((s & 1) << 2) | ((s & 7) >> 1); }

// acc (64 x 64, this warpgroup) = (accumulate ? acc : 0) + A B, 3xTF32, over KS k8 steps: the
// thread's A values of step kk from frag(kk, hi, lo) (split), B the split tiles at bh, bl. A
// fragments in groups of G steps through two register sets (gdn_split_chain).
template <int KS, int G, class Frag>
__device__ __forceinline__ void gdn_wg64_mma(float (&acc)[32], unsigned long long bh, unsigned long long bl,
                                             bool accumulate, Frag&& frag) {
    unsigned acc_in = accumulate;
    wgmma_fence_operand(bh);
    wgmma_fence_operand(bl);
    wgmma_fence_operand(acc_in);
#pragma unroll
    for (int e = 0; e < 32; e++) wgmma_fence_operand(acc[e]);
    gdn_split_chain<KS, G>(frag, [&](int kk, const unsigned (&hi)[4], const unsigned (&lo)[4]) {
        wgmma_m64n64k8_tf32_rs(acc, hi, gdn_descr_k8<64>(bh, kk), kk > 0 ? 1u : acc_in);
        wgmma_m64n64k8_tf32_rs(acc, hi, gdn_descr_k8<64>(bl, kk), 1);
        wgmma_m64n64k8_tf32_rs(acc, lo, gdn_descr_k8<64>(bh, kk), 1);
    });
#pragma unroll
    for (int e = 0; e < 32; e++) wgmma_fence_operand(acc[e]);
}

__device__ __forceinline__ void gdn_split4(float4 v, float* hi, float* lo) {
    unsigned h[4], l[4];
    split_tf32(v.x, h[0], l[0]);
    split_tf32(v.y, h[1], l[1]);
    split_tf32(v.z, h[2], l[2]);
    split_tf32(v.w, h[3], l[3]);
    st4(hi, make_float4(__uint_as_float(h[0]), __uint_as_float(h[1]), __uint_as_float(h[2]), __uint_as_float(h[3])));
    st4(lo, make_float4(__uint_as_float(l[0]), __uint_as_float(l[1]), __uint_as_float(l[2]), __uint_as_float(l[3])));
}

// A warpgroup's 64 x 64 accumulator slice (row m = X's column, column r = the chunk row) out to
// rows r < rows of dst (row stride ld) at columns col0 .. col0 + 63, times sign: through the
// warpgroup's staging tile [64][GDN_LDT] so the global stores are whole 16-byte row pieces.
__device__ __forceinline__ void gdn_prep_store(const float (&acc)[32], float* stage, int col0, float* dst, size_t ld,
                                               int rows, float sign, int wg, int w4, int lane) {
    const int gq = lane >> 2, cq = lane & 3;
#pragma unroll
    for (int e4 = 0; e4 < 32; e4++) {
        const int e = e4 & 3, m = 16 * w4 + gq + 8 * (e >> 1), r = 8 * (e4 >> 2) + 2 * cq + (e & 1);
        stage[r * GDN_LDT + m] = sign * acc[e4];
    }
    gdn_bar(1 + wg, 128);
    const int t = 32 * w4 + lane;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int idx = t + 128 * i, r = idx >> 4, c4 = (idx & 15) * 4;
        if (r < rows) st4(dst + (size_t)r * ld + col0 + c4, ld4(stage + r * GDN_LDT + c4));
    }
    gdn_bar(1 + wg, 128);  // the staging tile is read before its next use
}

template <int DK>
__device__ void gdn_chunk_prep_wg_impl(const float* __restrict__ qkv, int c, const float* __restrict__ g,
                                       const float* __restrict__ beta, float* __restrict__ w_out,
                                       float* __restrict__ qp_out, float* __restrict__ u_out,
                                       float* __restrict__ gamma_out, float* __restrict__ o, int t, int hk,
                                       int hv, int dv) {
    static_assert(DK == 128, "written for dk = dv = 128 (two m64 slices a warpgroup)");
    extern __shared__ __align__(1024) float gdn_smem[];
    // Two blocks an SM (101,376 bytes each, at most 128 registers a thread): what a step reads
    // once comes from global memory (L2) instead of shared memory.
    float* kt = gdn_smem;                // K's split tiles [hi | lo] (64 x 128 each; K's rows land
                                         // in the lo half first); after step 1:
    float* tt = gdn_smem;                //   T's split tiles [hi | lo] (64 x 64 each)
    float* pt = gdn_smem + 2 * 4096;     //   −P's split tiles, columns in gdn_pk order
    float* qsr = gdn_smem + 2 * 8192;    // [64][GDN_LDR] Q rows; after step 1:
    float* lm = qsr;                     //   [64][GDN_LDT] L (its upper blocks hold M_ij), then
    float* tm = lm + GDN_C * GDN_LDT;    //   [64][GDN_LDT] T = (I + L)^-1; after T's split, the
                                         //   warpgroups' output staging tiles
    float* gam = lm + 2 * GDN_C * GDN_LDT;  // [64] γ
    float* eg = gam + GDN_C;                // [64] e^γ
    float* bet = eg + GDN_C;                // [64] β
    float* bsk = bet + GDN_C;               // [64] β e^γ
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), w4 = warp & 3;
    const int c0 = blockIdx.x * GDN_C, j = blockIdx.y, kh = j / (hv / hk);
    const int n = min(GDN_C, t - c0);
    const size_t tp = (size_t)gridDim.x * GDN_C;
    const size_t qoff = (size_t)kh * DK, koff = (size_t)(hk + kh) * DK;
    const size_t voff = (size_t)2 * hk * DK + (size_t)j * dv;
    const float* rows = qkv + (size_t)c0 * c;
    GDN_PREP_PHASE(0);

    // K's rows (unpadded) into the lo tile, Q's into qsr; V's into L2 for step 3
    float* kraw = kt + GDN_C * DK;
    for (int idx = tid; idx < GDN_C * DK / 4; idx += blockDim.x) {
        const int r = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
        const bool in = r < n;
        cp_async16(kraw + r * DK + i, in ? rows + (size_t)r * c + koff + i : qkv, in);
    }
    cp_async_commit();
    for (int idx = tid; idx < GDN_C * DK / 4; idx += blockDim.x) {
        const int r = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
        const bool in = r < n;
        cp_async16(qsr + r * GDN_LDR + i, in ? rows + (size_t)r * c + qoff + i : qkv, in);
    }
    cp_async_commit();
    for (int idx = tid; idx < n * 4; idx += blockDim.x)
        gdn_prefetch_l2(rows + (size_t)(idx >> 2) * c + voff + 32 * (idx & 3));
    if (tid < GDN_C) {
        const bool in = tid < n;
        gam[tid] = in ? g[(size_t)(c0 + tid) * hv + j] : 0.0f;
        bet[tid] = in ? beta[(size_t)(c0 + tid) * hv + j] : 0.0f;
    }
    cp_async_wait<1>();  // K
    __syncthreads();
    GDN_PREP_PHASE(1);
    if (tid == 0) {  // serial, in the CPU reference's order (the values in registers first)
        float v[GDN_C];
#pragma unroll
        for (int r = 0; r < GDN_C; r += 4) *reinterpret_cast<float4*>(v + r) = ld4(gam + r);
#pragma unroll
        for (int r = 1; r < GDN_C; r++) v[r] += v[r - 1];
#pragma unroll
        for (int r = 0; r < GDN_C; r += 4) st4(gam + r, *reinterpret_cast<float4*>(v + r));
    }
    {  // K's split tiles, in place over its rows: all read, then all written
        float4 kv[GDN_C * DK / 4 / 256];
#pragma unroll
        for (int i = 0; i < GDN_C * DK / 4 / 256; i++) kv[i] = ld4(kraw + 4 * (tid + 256 * i));
        __syncthreads();
#pragma unroll
        for (int i = 0; i < GDN_C * DK / 4 / 256; i++) {
            const int idx = tid + 256 * i, r = idx / (DK / 4), k = (idx % (DK / 4)) * 4;
            gdn_split4(kv[i], kt + gdn_swr<64>(r, k), kt + GDN_C * DK + gdn_swr<64>(r, k));
        }
    }
    fence_proxy_async();  // the tiles' generic-proxy writes visible to wgmma
    cp_async_wait<0>();   // Q
    __syncthreads();
    GDN_PREP_PHASE(2);
    if (tid < GDN_C) {
        eg[tid] = expf(gam[tid]);
        bsk[tid] = bet[tid] * eg[tid];
        gamma_out[(size_t)j * tp + c0 + tid] = gam[tid];
    }

    // 1. K Kᵀ (warpgroup 0: A = K's split tiles as they are), Q Kᵀ (warpgroup 1: A = Q's rows)
    float acc[32];
    {
        const unsigned long long bh = wgmma_desc_sw128(kt), bl = wgmma_desc_sw128(kt + GDN_C * DK);
        if (wg == 0) {
            // the fragment's rows through ldmatrix from the swizzled tiles: lane l gives row
            // 16 w4 + (l & 15) at k offset 4 (l >> 4) (gdn_frag_a's matrices)
            const int r = 16 * w4 + (lane & 15), k4 = (lane >> 4) * 4;
            gdn_wg64_mma<DK / 8, 4>(acc, bh, bl, false, [&](int kk, unsigned(&hi)[4], unsigned(&lo)[4]) {
                const int at = gdn_swr<64>(r, 8 * kk + k4);
                ldsm_x4(hi, kt + at);
                ldsm_x4(lo, kt + GDN_C * DK + at);
            });
        } else {
            const float* a = qsr + 16 * w4 * GDN_LDR;
            gdn_wg64_mma<DK / 8, 4>(acc, bh, bl, false, [&](int kk, unsigned(&hi)[4], unsigned(&lo)[4]) {
                gdn_frag_a(a + 8 * kk, GDN_LDR, lane, hi, lo);
            });
        }
    }
    __syncthreads();  // both products retired: K's tiles and Q's rows are free; e^γ, β e^γ written
    GDN_PREP_PHASE(3);

    // 2. L (f32) and −P's split tiles; accumulator (row r, column s)
    {
        const int r0 = 16 * w4 + gq;
        const float gr[2] = {gam[r0], gam[r0 + 8]}, br[2] = {bet[r0], bet[r0 + 8]};
#pragma unroll
        for (int jn = 0; jn < 8; jn++) {
            // column blocks right of the warp's rows are zero (warp-uniform: no exp there)
            const bool live = 8 * jn <= 16 * w4 + 15;
            const float2 gs = live ? ld2(gam + 8 * jn + 2 * cq) : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, r = r0 + 8 * h, s = 8 * jn + 2 * cq + (e & 1);
                const float d = live && s <= r ? expf(gr[h] - ((e & 1) ? gs.y : gs.x)) : 0.0f;
                const float v = acc[4 * jn + e] * d;
                if (wg == 0) {
                    lm[r * GDN_LDT + s] = s < r ? br[h] * v : 0.0f;
                } else {
                    unsigned hi, lo;
                    split_tf32(-v, hi, lo);
                    const int at = gdn_swr<64>(r, gdn_pk(s));
                    pt[at] = __uint_as_float(hi);
                    pt[4096 + at] = __uint_as_float(lo);
                }
            }
        }
    }
    __syncthreads();
    GDN_PREP_PHASE(4);
    // T's diagonal blocks by substitution (warp b < 4: block b, lane m < 16: column m); the
    // other warps clear T's blocks above the diagonal
    if (warp < 4) {
        if (lane < 16) {
            const float* ld = lm + 16 * warp * (GDN_LDT + 1);
            float tcol[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float a = 0.0f;
#pragma unroll
                for (int s = 0; s < i; s++) a = fmaf(ld[i * GDN_LDT + s], tcol[s], a);
                tcol[i] = i < lane ? 0.0f : i == lane ? 1.0f : -a;
            }
#pragma unroll
            for (int i = 0; i < 16; i++) tm[(16 * warp + i) * GDN_LDT + 16 * warp + lane] = tcol[i];
        }
    } else {
        for (int idx = tid - 128; idx < 6 * 256; idx += 128) {  // the 6 blocks (bi < bj)
            const int p = idx >> 8, bi = p < 3 ? 0 : p < 5 ? 1 : 2, bj = p < 3 ? p + 1 : p < 5 ? p - 1 : 3;
            tm[(16 * bi + ((idx >> 4) & 15)) * GDN_LDT + 16 * bj + (idx & 15)] = 0.0f;
        }
    }
    __syncthreads();
    // T_ij = −T_ii M_ij, M_ij = Σ_{k=j}^{i−1} L_ik T_kj: a column of T needs only its own
    // entries, so each warp walks its columns down without block barriers (warps 0-3: block
    // column 0, 4 columns each; 4-5: block column 1, 8 each; 6-7: block column 2, 8 each).
    // M_ij goes to L's block (j, i), above the diagonal, never read as L.
    {
        const int bj = warp < 4 ? 0 : warp < 6 ? 1 : 2;
        const int nc = warp < 4 ? 2 : 4;  // columns a lane
        const int col0 = (warp < 4 ? 4 * warp : 8 * ((warp - 4) & 1)) + (lane >> 4) * nc, r = lane & 15;
        for (int bi = bj + 1; bi < 4; bi++) {
            float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int k = 16 * bj; k < 16 * bi; k += 4) {
                const float4 l = ld4(lm + (16 * bi + r) * GDN_LDT + k);
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if (q < nc) {
                        const float* tc = tm + k * GDN_LDT + 16 * bj + col0 + q;
                        m[q] = fmaf(l.x, tc[0], m[q]);
                        m[q] = fmaf(l.y, tc[GDN_LDT], m[q]);
                        m[q] = fmaf(l.z, tc[2 * GDN_LDT], m[q]);
                        m[q] = fmaf(l.w, tc[3 * GDN_LDT], m[q]);
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (q < nc) lm[(16 * bj + r) * GDN_LDT + 16 * bi + col0 + q] = m[q];
            __syncwarp();
            float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int k = 0; k < 16; k += 4) {  // T_ii is 0 above its diagonal
                const float4 ti = ld4(tm + (16 * bi + r) * GDN_LDT + 16 * bi + k);
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if (q < nc) {
                        const float* mc = lm + (16 * bj + k) * GDN_LDT + 16 * bi + col0 + q;
                        x[q] = fmaf(ti.x, mc[0], x[q]);
                        x[q] = fmaf(ti.y, mc[GDN_LDT], x[q]);
                        x[q] = fmaf(ti.z, mc[2 * GDN_LDT], x[q]);
                        x[q] = fmaf(ti.w, mc[3 * GDN_LDT], x[q]);
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (q < nc) tm[(16 * bi + r) * GDN_LDT + 16 * bj + col0 + q] = -x[q];
            __syncwarp();
        }
    }
    __syncthreads();
    // T's split tiles (rows r, k = s)
    for (int idx = tid; idx < GDN_C * GDN_C / 4; idx += blockDim.x) {
        const int r = idx >> 4, s = (idx & 15) * 4;
        gdn_split4(ld4(tm + r * GDN_LDT + s), tt + gdn_swr<64>(r, s), tt + 4096 + gdn_swr<64>(r, s));
    }
    fence_proxy_async();
    __syncthreads();
    GDN_PREP_PHASE(5);

    // 3 and 4 a slice (m64 of X's columns) at a time: Xᵀ = Bᵀ Tᵀ (A = the scaled K or V column
    // from global memory, where step 1's copies and the prefetch left it in L2), then
    // Yᵀ = Xᵀ (−P)ᵀ onto e^γ Qᵀ (Q') or 0 (−O_intra)
    const float* src = rows + (wg == 0 ? koff : voff);
    const float* scale = wg == 0 ? bsk : bet;
    float* stage = lm + wg * GDN_C * GDN_LDT;  // the warpgroup's output staging (L and T are done)
#pragma unroll 1
    for (int h = 0; h < 2; h++) {
        const int m = 64 * h + 16 * w4 + gq;  // the fragment's rows m, m + 8
        {  // the slice's 64 rows x 64 columns of K or V (and of Q for warpgroup 0) into L1 ahead
            const int t4 = 32 * w4 + lane, r = t4 >> 1;
            if (r < n) {
                gdn_prefetch_l1(src + (size_t)r * c + 64 * h + 32 * (t4 & 1));
                if (wg == 0) gdn_prefetch_l1(rows + (size_t)r * c + qoff + 64 * h + 32 * (t4 & 1));
            }
        }
        float x[32];
        gdn_wg64_mma<GDN_C / 8, 2>(x, wgmma_desc_sw128(tt), wgmma_desc_sw128(tt + 4096), false,
                                   [&](int kk, unsigned(&hi)[4], unsigned(&lo)[4]) {
                                       const int s = 8 * kk + cq;  // rows past t are 0 (scale 0)
                                       const float sc0 = scale[s], sc4 = scale[s + 4];
                                       const bool in0 = s < n, in4 = s + 4 < n;
                                       const float v[4] = {in0 ? src[(size_t)s * c + m] * sc0 : 0.0f,
                                                           in0 ? src[(size_t)s * c + m + 8] * sc0 : 0.0f,
                                                           in4 ? src[(size_t)(s + 4) * c + m] * sc4 : 0.0f,
                                                           in4 ? src[(size_t)(s + 4) * c + m + 8] * sc4 : 0.0f};
#pragma unroll
                                       for (int e = 0; e < 4; e++) split_tf32(v[e], hi[e], lo[e]);
                                   });
        float* dst = wg == 0 ? w_out + ((size_t)j * tp + c0) * DK : u_out + ((size_t)j * tp + c0) * dv;
        gdn_prep_store(x, stage, 64 * h, dst, wg == 0 ? DK : dv, GDN_C, 1.0f, wg, w4, lane);
        float y[32];
        if (wg == 0) {
#pragma unroll
            for (int e4 = 0; e4 < 32; e4++) {
                const int e = e4 & 3, mm = m + 8 * (e >> 1), r = 8 * (e4 >> 2) + 2 * cq + (e & 1);
                y[e4] = r < n ? eg[r] * rows[(size_t)r * c + qoff + mm] : 0.0f;
            }
        }
        gdn_wg64_mma<GDN_C / 8, 2>(y, wgmma_desc_sw128(pt), wgmma_desc_sw128(pt + 4096), wg == 0,
                                   [&](int kk, unsigned(&hi)[4], unsigned(&lo)[4]) { gdn_acc_frag(x, kk, hi, lo); });
        if (wg == 0) gdn_prep_store(y, stage, 64 * h, qp_out + ((size_t)j * tp + c0) * DK, DK, GDN_C, 1.0f, wg, w4, lane);
        else gdn_prep_store(y, stage, 64 * h, o + ((size_t)c0 * hv + j) * dv, (size_t)hv * dv, n, -1.0f, wg, w4, lane);
        if (h == 0) GDN_PREP_PHASE(6);
    }
    GDN_PREP_PHASE(7);
}
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_wg_128(
    const float* qkv, int c, const float* g, const float* beta, float* w_out, float* qp_out, float* u_out,
    float* gamma_out, float* o, int t, int hk, int hv, int dv) {
    PREFILL_KERNEL();
    gdn_chunk_prep_wg_impl<128>(qkv, c, g, beta, w_out, qp_out, u_out, gamma_out, o, t, hk, hv, dv);
}

// ---- gdn_chunk_state_t64 (sm_90a, dk = 128; the default there, KESTREL_GDN_STATE=wg keeps
// gdn_chunk_state_wg): the state pass with Sᵀ as the wgmma A operand ----
// gdn_chunk_state's contract (the prep's W, Q', U, γ and O_intra in, o and the state out) in one
// launch of a block an SM, every block resident at once. State blocks (the first hv * dv / 64):
// a value head's 64 value columns; consumer warpgroup 0 keeps Sᵀ (64 x dk, f32) in its
// accumulator registers from the first chunk to the last, and a chunk is two products whose A
// operand is split straight from registers, so nothing on the chain goes through shared memory:
//   Rᵀ = Sᵀ Wᵀ (m64n64k16, k = dk), Vdᵀ = (Uᵀ − Rᵀ) e^{γ_last − γ} in R's registers,
//   Sᵀ ← e^{γ_last} Sᵀ + Vdᵀ K (m64n128k16, k = the chunk's 64 rows),
// with each chunk's Sᵀ (before its update) stored for the out blocks. Out blocks (the rest):
// o = O_intra + O' with O'ᵀ = Sᵀ Q'ᵀ for (chunk, state block) items in chunk order, each once
// its state block released that chunk's Sᵀ (a counter a state block, st.release / ld.acquire).
// Products are 3xBF16 (split_bf16x2: ~1e-5-level against f32, within gdn_chunked_kernel_matches_
// recurrent's 1e-4): the 3xTF32 form of the same pass (~1e-7) took twice the wgmma on the chain,
// prep + state 0.581 against 0.513 ms at 4,096 tokens (docs/KERNELS.md, twenty-seventh session).
// An accumulator's two n8 blocks packed to bf16x2 are the A fragment of a k16 step as they are:
// Sᵀ's column n is key dim n, Rᵀ's and O'ᵀ's column n chunk row n. Two producer warpgroups per
// block split W (or Q') and K into bf16 hi and lo tiles (gdn_t64_at: row-major 64 x 128, read
// K-major for W and Q', N-major for K, so nothing is transposed) and copy U, γ (or O_intra),
// each buffer guarded by full / empty mbarriers. Dynamic shared memory (1024-byte aligned):
// GdnShape::state_t64_smem_bytes (133,712 bytes); docs/KERNELS.md, fourteenth session.
#define GDN_T64_COLS 64   // value columns of a block
#define GDN_T64_LDU 68    // U and O_intra rows (the consumer's reads hit 32 distinct banks)
// The state blocks' progress counters, one a 128-byte line (the out blocks poll them), and the
// out blocks' pause between polls (ns).
#define GDN_T64_FLAG_STRIDE 32
#ifndef GDN_T64_SPIN_NS
#define GDN_T64_SPIN_NS 128
#endif
// Two producer warpgroups: one splits W (state blocks) or Q' (out blocks), the other K (state
// blocks) or copies O_intra (out blocks), each in its own loop, so neither waits on the other.
#define GDN_T64_PRODUCERS 256
// A producer warpgroup's (thread pt < 128) copy of a chunk's 64 rows of W or Q' (f32, 128 a
// row at src) into registers: warp pw's 16 rows, 4 floats of each a lane (a row is one 512-byte
// load of the warp); loaded before the buffer is free.
__device__ __forceinline__ void gdn_t64_load_rows(const float* src, float4 (&v)[16], int pw, int lane) {
#pragma unroll
    for (int i = 0; i < 16; i++) v[i] = ld4(src + (size_t)(16 * pw + i) * 128 + 4 * lane);
}
// A producer warpgroup's cp.async of 64 rows x 64 columns (U or O_intra) into a [64][LDU]
// tile: row r from src + r * ld (columns past n_in and rows past rows_in zero-filled).
__device__ __forceinline__ void gdn_t64_copy_rows(const float* src, size_t ld, int n_in, int rows_in, float* tile,
                                                  int pt) {
#pragma unroll
    for (int p = 0; p < GDN_C * GDN_T64_COLS / 4 / 128; p++) {
        const int i = pt + 128 * p, r = i >> 4, n = (i & 15) * 4;
        const bool in = n < n_in && r < rows_in;
        cp_async16(tile + r * GDN_T64_LDU + n, in ? src + r * ld + n : src, in);
    }
}

#define GDN_T64_THREADS (128 + GDN_T64_PRODUCERS)
enum { GDN_BW, GDN_BQ, GDN_BU, GDN_BO, GDN_BK };  // the buffers' mbarriers (full[b], empty[b])
// Element (n, k) of a 64 x 128 bf16 tile: 64-column panels 8 KiB apart, rows of 128 bytes whose
// 16-byte chunks are swizzled by the row (the layout wgmma_desc_sw128 and _mn read).
__device__ __forceinline__ int gdn_t64_at(int n, int k) {
    return (k >> 6) * (GDN_C * 64) + n * 64 + ((((k >> 3) & 7) ^ (n & 7)) << 3) + (k & 7);
}
// A producer warpgroup's 64 rows (warp pw's 16, 4 floats of each a lane, as gdn_t64_load_rows
// loads them) split into the tile's hi and lo parts: 8 bytes a lane, a warp's store two
// conflict-free wavefronts.
__device__ __forceinline__ void gdn_t64_store_rows(const float4 (&v)[16], bf16* tile, int pw, int lane) {
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int at = gdn_t64_at(16 * pw + i, 4 * lane);
        unsigned h0, l0, h1, l1;
        split_bf16x2(v[i].x, v[i].y, h0, l0);
        split_bf16x2(v[i].z, v[i].w, h1, l1);
        *reinterpret_cast<uint2*>(tile + at) = make_uint2(h0, h1);
        *reinterpret_cast<uint2*>(tile + GDN_C * 128 + at) = make_uint2(l0, l1);
    }
}
// The 3xBF16 A fragment (hi, lo) of k16 step kk from an accumulator x of the same rows (its n8
// blocks 2 kk and 2 kk + 1).
__device__ __forceinline__ void gdn_t64_frag(const float* x, int kk, unsigned (&hi)[4], unsigned (&lo)[4]) {
#pragma unroll
    for (int p = 0; p < 4; p++) split_bf16x2(x[8 * kk + 2 * p], x[8 * kk + 2 * p + 1], hi[p], lo[p]);
}
// acc (64 x 64) = Sᵀ (s, m64n128, key dim n at column n) times the tile at (bh, bl)ᵀ, 3xBF16
// over dk = 128 (8 k16 steps in groups of 2 through two register sets); at(kk) runs once step
// kk's fragments are split (the state role stores Sᵀ there).
template <class At>
__device__ __forceinline__ void gdn_t64_s_times(const float (&s)[64], unsigned long long bh, unsigned long long bl,
                                                float (&acc)[32], At&& at) {
    wgmma_fence_operand(bh);
    wgmma_fence_operand(bl);
#pragma unroll
    for (int e = 0; e < 32; e++) wgmma_fence_operand(acc[e]);
    gdn_split_chain<8, 2>(
        [&](int kk, unsigned (&hi)[4], unsigned (&lo)[4]) {
            gdn_t64_frag(s, kk, hi, lo);
            at(kk);
        },
        [&](int kk, const unsigned (&hi)[4], const unsigned (&lo)[4]) {
            wgmma_m64n64k16_rs(acc, hi, gdn_descr_k8<GDN_C>(bh, kk), kk > 0 ? 1 : 0);
            wgmma_m64n64k16_rs(acc, hi, gdn_descr_k8<GDN_C>(bl, kk), 1);
            wgmma_m64n64k16_rs(acc, lo, gdn_descr_k8<GDN_C>(bh, kk), 1);
        });
#pragma unroll
    for (int e = 0; e < 32; e++) wgmma_fence_operand(acc[e]);
}
// The shared-memory plan (1024-byte aligned): three split tiles (two W buffers, the second the
// out role's Q', and K), U and O_intra ([64][GDN_T64_LDU] f32; U's second buffer is O_intra's),
// γ by chunk parity, the mbarriers (gdn_chunk_state_t64's buffers and roles).
struct GdnT64Smem {
    static constexpr int TT = GDN_C * 128;  // bf16 of one part (hi or lo) of a tile
    bf16 *wi, *qi, *ki;                       // [hi, lo][TT] each
    float *ub, *ob, *gm;
    unsigned long long *full, *empty;
    __device__ explicit GdnT64Smem(unsigned char* base) {
        wi = reinterpret_cast<bf16*>(base);
        qi = wi + 2 * TT;
        ki = qi + 2 * TT;
        ub = reinterpret_cast<float*>(ki + 2 * TT);
        ob = ub + GDN_C * GDN_T64_LDU;
        gm = ob + GDN_C * GDN_T64_LDU;
        full = reinterpret_cast<unsigned long long*>(gm + 2 * GDN_C);
        empty = full + 5;
    }
};

// The state role: block sb < nstate owns value head sb / halves, columns 64 (sb % halves) ..;
// per chunk R, Vd and the state update (the chain above, less O'), and Sᵀ before the update out
// to s_out (the out blocks' A operand), released by the K producer once the consumer's release
// of K (after its stores) reached it: no fence on the chain.
__device__ void gdn_t64_state_role(const float* __restrict__ qkv, int c, const float* __restrict__ w_in,
                                   const float* __restrict__ u_in, const float* __restrict__ gamma_in,
                                   float* __restrict__ state, float* __restrict__ s_out, unsigned* __restrict__ flags,
                                   int t, int hk, int hv, int dv, GdnT64Smem sm) {
    constexpr int DK = 128;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int halves = (dv + GDN_T64_COLS - 1) / GDN_T64_COLS, sb = blockIdx.x;
    const int j = sb / halves, m0 = (sb % halves) * GDN_T64_COLS;
    const int kh = j / (hv / hk), nchunks = (t + GDN_C - 1) / GDN_C;
    const size_t tp = (size_t)nchunks * GDN_C;
    const int dvs = min(GDN_T64_COLS, dv - m0);
    [[maybe_unused]] const bool team_a = warp < 4;  // the consumer (phase clock slots 0-5; the W producer 8-11)
    if (warp >= 4) {  // the producers: chunk ch's buffers, each once the consumer released its last use
        setmaxnreg_dec<128>();
        const int pt = (tid - 128) & 127, pw = pt >> 5;
        const size_t koff = (size_t)(hk + kh) * DK;
        if (warp < 8) {  // W, γ and U, into buffer ch & 1 of each, a chunk ahead of the consumer
            for (int ch = 0; ch < nchunks; ch++) {
                const int bw = ch & 1 ? GDN_BQ : GDN_BW, bu = ch & 1 ? GDN_BO : GDN_BU;
                const unsigned ph = ((ch >> 1) - 1) & 1;  // the buffer's previous use (chunk ch - 2)
                const size_t row0 = (size_t)j * tp + (size_t)ch * GDN_C;
                GDN_PHASE_WG(0);
                float4 vw[16];
                gdn_t64_load_rows(w_in + row0 * DK, vw, pw, lane);
                const float gam = pt < GDN_C ? gamma_in[row0 + pt] : 0.0f;
                if (ch + 1 < nchunks)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const int line = pt + 128 * i;
                        gdn_prefetch_l2(w_in + (row0 + GDN_C + (line >> 2)) * DK + (line & 3) * 32);
                    }
                if (ch > 1) mbar_wait(&sm.empty[bw], ph);
                GDN_PHASE_WG(1);
                gdn_t64_store_rows(vw, ch & 1 ? sm.qi : sm.wi, pw, lane);
                if (pt < GDN_C) sm.gm[(ch & 1) * GDN_C + pt] = gam;
                fence_proxy_async();
                mbar_arrive(&sm.full[bw]);
                GDN_PHASE_WG(2);
                if (ch > 1) mbar_wait(&sm.empty[bu], ph);
                gdn_t64_copy_rows(u_in + row0 * dv + m0, dv, dvs, GDN_C, ch & 1 ? sm.ob : sm.ub, pt);
                cp_async_mbar_arrive(&sm.full[bu]);
                GDN_PHASE_WG(3);
            }
        } else {  // K (rows past t zero), and the out blocks' counter
            // chunk kc's rows into registers (and kc + 1's into L2): a chunk ahead, so that they
            // are in flight while the counter's release below (a fence, which waits for the
            // consumer's Sᵀ stores) holds this warp, not after it
            float4 vk[16];
            auto load_k = [&](int kc) {
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const int row = kc * GDN_C + 16 * pw + i;
                    vk[i] = row < t ? ld4(qkv + (size_t)row * c + koff + 4 * lane) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
                if (kc + 1 < nchunks)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const int line = pt + 128 * i, krow = (kc + 1) * GDN_C + (line >> 2);
                        if (krow < t) gdn_prefetch_l2(qkv + (size_t)krow * c + koff + (line & 3) * 32);
                    }
            };
            if (nchunks > 0) load_k(0);
            for (int ch = 0; ch < nchunks; ch++) {
                if (ch > 0) mbar_wait(&sm.empty[GDN_BK], (ch - 1) & 1);
                gdn_t64_store_rows(vk, sm.ki, pw, lane);
                fence_proxy_async();
                mbar_arrive(&sm.full[GDN_BK]);
                if (ch + 1 < nchunks) load_k(ch + 1);
                // S_0 .. S_{ch-1} out to the out blocks (st.release is cumulative over what the K release's wait observed)
                if (ch > 0 && pt == 0) st_release_gpu(flags + sb * GDN_T64_FLAG_STRIDE, ch);
            }
            if (nchunks > 0) mbar_wait(&sm.empty[GDN_BK], (nchunks - 1) & 1);  // the last update
            if (pt == 0) st_release_gpu(flags + sb * GDN_T64_FLAG_STRIDE, nchunks);
        }
        return;
    }
    setmaxnreg_inc<240>();

    // The consumer. Sᵀ's accumulator s[4 i + e]: row m = 16 warp + lane / 4 + 8 (e / 2), key dim
    // 8 i + 2 (lane % 4) + e % 2.
    const int gq = lane >> 2, cq = lane & 3, r0 = 16 * warp + gq;
    float* st = state + (size_t)j * DK * dv + m0;
    float s[64];
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int m = r0 + 8 * (e >> 1), k = 8 * i + 2 * cq + (e & 1);
            s[4 * i + e] = m < dvs ? st[(size_t)k * dv + m] : 0.0f;  // padding columns stay 0
        }
    const unsigned long long kdh = wgmma_desc_sw128_mn(sm.ki, GDN_C * 128),
                             kdl = wgmma_desc_sw128_mn(sm.ki + GdnT64Smem::TT, GDN_C * 128);
    // s_out [nstate][chunks][16][128 threads][4]: each thread's accumulator as it holds it, float4
    // i of every thread side by side (a warp's store is 512 contiguous bytes), read back so by
    // the out blocks
    float* so = s_out + (size_t)sb * nchunks * 128 * 64 + 4 * tid;
    for (int ch = 0; ch < nchunks; ch++) {
        const unsigned par = ch & 1;
        GDN_PHASE_WG(0);
        float r[32];
        const int bw = par ? GDN_BQ : GDN_BW, bu = par ? GDN_BO : GDN_BU;
        const unsigned use = (ch >> 1) & 1;
        const bf16* wt = par ? sm.qi : sm.wi;
        mbar_wait(&sm.full[bw], use);
        fence_proxy_async();
        GDN_PHASE_WG(1);
        const float* gc = sm.gm + par * GDN_C;
        const float last = gc[GDN_C - 1];
        float dec[16];  // e^{γ_last − γ} of chunk rows 8 i + 2 cq + b, at 2 i + b
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int b = 0; b < 2; b++) dec[2 * i + b] = expf(last - gc[8 * i + 2 * cq + b]);
        // Rᵀ = Sᵀ Wᵀ; Sᵀ (before the update) out to s_out with each step's split
        float* so_ch = so + (size_t)ch * 128 * 64;
        gdn_t64_s_times(s, wgmma_desc_sw128(wt), wgmma_desc_sw128(wt + GdnT64Smem::TT), r, [&](int kk) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int i = 2 * kk + h;
                st4(so_ch + 512 * i, make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]));
            }
        });
        mbar_arrive(&sm.empty[bw]);
        GDN_PHASE_WG(2);
        const float* ut = par ? sm.ob : sm.ub;
        mbar_wait(&sm.full[bu], use);
        GDN_PHASE_WG(3);
        // Sᵀ ← e^{γ_last} Sᵀ + Vdᵀ K: 4 k16 steps (the chunk's rows) through two register sets;
        // each step's Vdᵀ = (Uᵀ − Rᵀ) e^{γ_last − γ} formed in R's registers just before its split
        const float eg = expf(last);
#pragma unroll
        for (int e = 0; e < 64; e++) s[e] *= eg;
        mbar_wait(&sm.full[GDN_BK], par);
        fence_proxy_async();
        GDN_PHASE_WG(4);
        unsigned fh[2][4], fl[2][4];
        unsigned long long dh = kdh, dl = kdl;  // pinned before the stage (C7513)
        wgmma_fence_operand(dh);
        wgmma_fence_operand(dl);
#pragma unroll
        for (int e = 0; e < 64; e++) wgmma_fence_operand(s[e]);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const int b = kk & 1;
            if (kk >= 2) wgmma_wait<1>();
#pragma unroll
            for (int e8 = 0; e8 < 8; e8++) {  // R's n8 blocks 2 kk, 2 kk + 1: chunk row 8 i + 2 cq + e % 2
                const int i = 2 * kk + (e8 >> 2), e = e8 & 3, row = 8 * i + 2 * cq + (e & 1);
                r[4 * i + e] = (ut[row * GDN_T64_LDU + r0 + 8 * (e >> 1)] - r[4 * i + e]) * dec[2 * i + (e & 1)];
            }
            gdn_t64_frag(r, kk, fh[b], fl[b]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                wgmma_fence_operand(fh[b][e]);
                wgmma_fence_operand(fl[b][e]);
            }
            wgmma_fence();
            const unsigned long long at = (unsigned long long)kk * (16 * 128 >> 4);  // 16 rows of 128 bytes
            wgmma_m64n128k16_rs_tb(s, fh[b], dh + at, 1);
            wgmma_m64n128k16_rs_tb(s, fh[b], dl + at, 1);
            wgmma_m64n128k16_rs_tb(s, fl[b], dh + at, 1);
            wgmma_commit();
        }
        mbar_arrive(&sm.empty[bu]);  // U's last reads were in the loop
        wgmma_wait<0>();
#pragma unroll
        for (int e = 0; e < 64; e++) wgmma_fence_operand(s[e]);
#pragma unroll
        for (int b = 0; b < 2; b++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                wgmma_fence_operand(fh[b][e]);
                wgmma_fence_operand(fl[b][e]);
            }
        mbar_arrive(&sm.empty[GDN_BK]);
        GDN_PHASE_WG(5);
    }
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int m = r0 + 8 * (e >> 1), k = 8 * i + 2 * cq + (e & 1);
            if (m < dvs) st[(size_t)k * dv + m] = s[4 * i + e];
        }
}

// The out role: blocks nstate .. take the (chunk, state block) items in chunk order, a stride of
// the out blocks' count apart: o = O_intra + O' with O'ᵀ = S_cᵀ Q'ᵀ (S_c from s_out once the
// state block released it; Q' split by this block's producers, O_intra copied).
__device__ void gdn_t64_out_role(const float* __restrict__ qp_in, const float* __restrict__ s_out,
                                 const unsigned* __restrict__ flags, float* __restrict__ o, int t, int hv, int dv,
                                 int nstate, GdnT64Smem sm) {
    constexpr int DK = 128;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int halves = (dv + GDN_T64_COLS - 1) / GDN_T64_COLS, nchunks = (t + GDN_C - 1) / GDN_C;
    const size_t tp = (size_t)nchunks * GDN_C;
    const int items = nstate * nchunks, first = blockIdx.x - nstate, stride = gridDim.x - nstate;
    if (warp >= 4) {  // the producers: item it's Q' and O_intra, once the consumer released it - 1's
        setmaxnreg_dec<128>();
        const int pt = (tid - 128) & 127, pw = pt >> 5;
        const bool qp_side = warp < 8;
        unsigned it = 0;
        for (int q = first; q < items; q += stride, it++) {
            const int ch = q / nstate, sb = q % nstate, j = sb / halves, m0 = (sb % halves) * GDN_T64_COLS;
            const unsigned ph = (it - 1) & 1;
            if (qp_side) {
                float4 vq[16];
                gdn_t64_load_rows(qp_in + ((size_t)j * tp + (size_t)ch * GDN_C) * DK, vq, pw, lane);
                if (it > 0) mbar_wait(&sm.empty[GDN_BQ], ph);
                gdn_t64_store_rows(vq, sm.qi, pw, lane);
                fence_proxy_async();
                mbar_arrive(&sm.full[GDN_BQ]);
            } else {
                if (it > 0) mbar_wait(&sm.empty[GDN_BO], ph);
                gdn_t64_copy_rows(o + ((size_t)ch * GDN_C * hv + j) * dv + m0, (size_t)hv * dv,
                                  min(GDN_T64_COLS, dv - m0), min(GDN_C, t - ch * GDN_C), sm.ob, pt);
                cp_async_mbar_arrive(&sm.full[GDN_BO]);
            }
        }
        return;
    }
    setmaxnreg_inc<240>();
    const int gq = lane >> 2, cq = lane & 3, r0 = 16 * warp + gq;
    const unsigned long long qh = wgmma_desc_sw128(sm.qi), ql = wgmma_desc_sw128(sm.qi + GdnT64Smem::TT);
    unsigned it = 0;
    for (int q = first; q < items; q += stride, it++) {
        const int ch = q / nstate, sb = q % nstate, j = sb / halves, m0 = (sb % halves) * GDN_T64_COLS;
        const int dvs = min(GDN_T64_COLS, dv - m0);
        const unsigned par = it & 1;
        if (tid == 0)
            while (ld_acquire_gpu(flags + sb * GDN_T64_FLAG_STRIDE) < (unsigned)ch + 1)
                if (GDN_T64_SPIN_NS) spin_pause(GDN_T64_SPIN_NS);
        gdn_bar(1, 128);
        float s[64];  // S_c as the state block's thread tid held it (L2 reads)
        const float* so = s_out + ((size_t)sb * nchunks + ch) * 128 * 64 + 4 * tid;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(so + 512 * i));
            s[4 * i] = v.x, s[4 * i + 1] = v.y, s[4 * i + 2] = v.z, s[4 * i + 3] = v.w;
        }
        float op[32];
        mbar_wait(&sm.full[GDN_BQ], par);
        fence_proxy_async();
        gdn_t64_s_times(s, qh, ql, op, [](int) {});  // O'ᵀ = S_cᵀ Q'ᵀ
        mbar_arrive(&sm.empty[GDN_BQ]);
        mbar_wait(&sm.full[GDN_BO], par);
        const int c0 = ch * GDN_C;
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = r0 + 8 * (e >> 1), row = 8 * i + 2 * cq + (e & 1);
                if (m < dvs && c0 + row < t)
                    o[((size_t)(c0 + row) * hv + j) * dv + m0 + m] = sm.ob[row * GDN_T64_LDU + m] + op[4 * i + e];
            }
        mbar_arrive(&sm.empty[GDN_BO]);
    }
}

// Grid: nstate = hv * ceil(dv / 64) state blocks, then out blocks (the host launches one block
// an SM, so every block is resident at once and the out blocks' wait on the state blocks'
// progress cannot deadlock); flags: nstate zeroed counters.
__device__ void gdn_chunk_state_t64_impl(const float* __restrict__ qkv, int c, const float* __restrict__ w_in,
                                         const float* __restrict__ qp_in, const float* __restrict__ u_in,
                                         const float* __restrict__ gamma_in, float* __restrict__ state,
                                         float* __restrict__ o, float* __restrict__ s_out, unsigned* __restrict__ flags,
                                         int t, int hk, int hv, int dv) {
    extern __shared__ __align__(1024) unsigned char gdn_t64_smem[];
    const GdnT64Smem sm(gdn_t64_smem);
    const int nstate = hv * ((dv + GDN_T64_COLS - 1) / GDN_T64_COLS);
    if (threadIdx.x == 0) {
        for (int b = 0; b < 5; b++) {
            mbar_init(&sm.full[b], 128);
            mbar_init(&sm.empty[b], 128);
        }
    }
    __syncthreads();
    if ((int)blockIdx.x < nstate)
        gdn_t64_state_role(qkv, c, w_in, u_in, gamma_in, state, s_out, flags, t, hk, hv, dv, sm);
    else
        gdn_t64_out_role(qp_in, s_out, flags, o, t, hv, dv, nstate, sm);
}
extern "C" __global__ void __launch_bounds__(GDN_T64_THREADS, 1) gdn_chunk_state_t64_128(
    const float* qkv, int c, const float* w_in, const float* qp_in, const float* u_in, const float* gamma_in,
    float* state, float* o, float* s_out, unsigned* flags, int t, int hk, int hv, int dv) {
    PREFILL_KERNEL();
    gdn_chunk_state_t64_impl(qkv, c, w_in, qp_in, u_in, gamma_in, state, o, s_out, flags, t, hk, hv, dv);
}
