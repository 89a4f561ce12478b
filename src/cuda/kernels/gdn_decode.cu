// Gated DeltaNet: causal conv with state, q/k L2 norms and gates, the delta-rule recurrence
// (one thread per value column, the state column in registers), the gated RMSNorm, and the
// decode step's kernels (conv, step, and both fused). The prefill's token-parallel conv and
// chunked delta rule are in gdn_chunk.cu and gdn_state.cu.

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
GDN_RECURRENT(128)  // the model's key head dim

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
GDN_STEP_DEC(128)  // the model's key head dim

// gdn_conv_dec and gdn_step_dec in one launch: gdn_step_dec's block per value head (and its
// lanes), where thread t < nc = 2 DK + dv first runs conv channel t of what the head reads: its
// key head's q ([0, DK)) and k ([DK, 2 DK)) and its own v ([2 DK, nc)), the outputs staying in
// shared memory. The G = hv / hk value heads of a key head all compute its q and k; only the
// first writes their conv state, and with G = 2 (CL = 2, sm_90a) the two blocks form a cluster
// whose barrier (arrived at once the old state is read, waited for before it is written) keeps
// that write after the other block's read. q and k are normalised by scaling the step's sums
// (r and o) and k's update factor instead of the vectors. z: [hv, dv]; ba: [b (hv) | a (hv)];
// out bf16. grid (hv, rows), block 4 dv rounded up to 32 (>= nc); the conv's kernel size is 4 (its
// history in registers across the wait). Dynamic shared memory (a cluster kernel's blocks each need
// their own on the CPU emulator): GDN_CONVSTEP_SMEM(DK, dv) bytes.
// Batched decode: row r = blockIdx.y is another sequence's token, its p, z and ba r * ldp floats
// on and its out r * ldo values on; `tab` (if set) holds its states, [conv state of each row |
// recurrent state of each row], in place of `conv_state` and `state`.
#define GDN_CONVSTEP_SMEM(DK, DV) ((2 * ((DK) + 16) + 32 + (DV)) * 4)
template <int DK, int CL>
__device__ void gdn_convstep_dec_impl(const float* __restrict__ p, float* __restrict__ conv_state,
                                      const float* __restrict__ conv_w, const float* __restrict__ z,
                                      const float* __restrict__ ba, const float* __restrict__ a_log,
                                      const float* __restrict__ dt_bias, const float* __restrict__ nw,
                                      float* __restrict__ state, bf16* __restrict__ out, int c, int hk, int hv,
                                      int dv, float q_scale, float eps, const u64* __restrict__ tab, int ldp,
                                      int ldo) {
    constexpr int RQ = DK / 4, KERN = 4, HIST = KERN - 1;  // state rows per lane; conv history
    DECODE_KERNEL(TAG_GDN_STEP);
    const int j = blockIdx.x, t = threadIdx.x, m = t >> 2, part = t & 3, row = blockIdx.y;
    if (tab) {
        conv_state = reinterpret_cast<float*>(tab[row]);
        state = reinterpret_cast<float*>(tab[gridDim.y + row]);
    }
    p += (size_t)row * ldp;
    z += (size_t)row * ldp;
    ba += (size_t)row * ldp;
    out += (size_t)row * ldo;
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
// Instantiated at the model's key head dim.
#define GDN_CONVSTEP_DEC(DK)                                                                                   \
    extern "C" __global__ void __launch_bounds__(512) gdn_convstep_dec_##DK(                                   \
        const float* p, float* conv_state, const float* conv_w, const float* z, const float* ba,               \
        const float* a_log, const float* dt_bias, const float* nw, float* state, bf16* out, int c, int hk,     \
        int hv, int dv, float q_scale, float eps, const u64* tab, int ldp, int ldo) {                          \
        gdn_convstep_dec_impl<DK, 1>(p, conv_state, conv_w, z, ba, a_log, dt_bias, nw, state, out, c, hk, hv, dv, \
                                     q_scale, eps, tab, ldp, ldo);                                             \
    }                                                                                                          \
    extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(512) gdn_convstep_dec_cl2_##DK(     \
        const float* p, float* conv_state, const float* conv_w, const float* z, const float* ba,               \
        const float* a_log, const float* dt_bias, const float* nw, float* state, bf16* out, int c, int hk,     \
        int hv, int dv, float q_scale, float eps, const u64* tab, int ldp, int ldo) {                          \
        gdn_convstep_dec_impl<DK, 2>(p, conv_state, conv_w, z, ba, a_log, dt_bias, nw, state, out, c, hk, hv, dv, \
                                     q_scale, eps, tab, ldp, ldo);                                             \
    }
GDN_CONVSTEP_DEC(128)
