// Gated DeltaNet prefill (t > 1), part 1: the token-parallel conv and the chunked delta rule's
// per-chunk preparation (gdn_chunk_prep); the sequential state pass is in gdn_state.cu.

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

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ void st2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }

__device__ __forceinline__ void gdn_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

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
// Every product runs on tensor cores, 3xTF32 on mma.sync m16n8k8 (the f32 SIMT version was
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

// gdn_chunk_prep's entry point at the model's dk (gdn_chunk_prep_DK runs gdn_chunk_prep_impl<DK>),
// two blocks an SM.
#define GDN_CHUNK_PREP(DK)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_##DK(                             \
        const float* qkv, int c, const float* g, const float* beta, float* w_out, float* qp_out,           \
        float* u_out, float* gamma_out, float* o, int t, int hk, int hv, int dv) {                         \
        PREFILL_KERNEL();                                                                                  \
        gdn_chunk_prep_impl<DK>(qkv, c, g, beta, w_out, qp_out, u_out, gamma_out, o, t, hk, hv, dv);      \
    }
GDN_CHUNK_PREP(128)
