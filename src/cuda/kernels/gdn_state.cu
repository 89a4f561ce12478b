// Gated DeltaNet prefill, part 2: the chunked delta rule's state pass over the chunks in order,
// from gdn_chunk_prep's W, Q', U, γ and O_intra (gdn_chunk.cu): gdn_chunk_state_t64 (wgmma,
// 3xBF16, dk = 128).

// ---- gdn_chunk_state_t64's wgmma pieces ----
// The split products' pipeline of gdn_t64_s_times' wgmma: KS k steps in groups of G, the A
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
// A descriptor of a 128-byte-swizzle tile of ROWS rows in panels of 128-byte rows (ROWS x 128
// bytes each) advanced to its step kk of 32 bytes (a k16 step of bf16): the panel, then 32 bytes
// a step.
template <int ROWS>
__device__ __forceinline__ unsigned long long gdn_descr_k8(unsigned long long d, int kk) {
    return d + (unsigned long long)((kk >> 2) * ROWS * 8 + (kk & 3) * 2);
}

// ---- gdn_chunk_state_t64 (sm_90a, dk = 128): the state pass with Sᵀ as the wgmma A operand ----
// The prep's W, Q', U, γ and O_intra in, o (O_intra + Q' S) and the state out, in one launch of
// a block an SM, every block resident at once. State blocks (the first hv * dv / 64):
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
// prep + state 0.581 against 0.513 ms at 4,096 tokens (docs/DECISIONS.md).
// An accumulator's two n8 blocks packed to bf16x2 are the A fragment of a k16 step as they are:
// Sᵀ's column n is key dim n, Rᵀ's and O'ᵀ's column n chunk row n. Two producer warpgroups per
// block split W (or Q') and K into bf16 hi and lo tiles (gdn_t64_at: row-major 64 x 128, read
// K-major for W and Q', N-major for K, so nothing is transposed) and copy U, γ (or O_intra),
// each buffer guarded by full / empty mbarriers. Dynamic shared memory (1024-byte aligned):
// GdnShape::state_t64_smem_bytes (133,712 bytes); docs/KERNELS.md.
#define GDN_T64_COLS 64   // value columns of a block
#define GDN_T64_LDU 68    // U and O_intra rows (the consumer's reads hit 32 distinct banks)
// The state blocks' progress counters, one a 128-byte line (the out blocks poll them), and the
// out blocks' pause between polls (ns).
#define GDN_T64_FLAG_STRIDE 32
#define GDN_T64_SPIN_NS 128
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
                spin_pause(GDN_T64_SPIN_NS);
        bar_sync_named(1, 128);
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
