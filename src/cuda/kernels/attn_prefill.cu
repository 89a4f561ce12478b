// Gated full attention, prefill: the q/k zero-centred norms + partial NeoX RoPE + KV-cache append
// of a whole chunk (attn_prep_rows), then causal GQA flash attention with the sigmoid output
// gate fused: attn_flash4 (wgmma, head dim 256).

// Prefill's attn_prep (the same outputs; `past` from the host): a warp per (token, head) row,
// 8 rows a block, 16-byte loads and a shuffle reduction, the normalised row staged in the warp's
// shared memory for the rotation's partner reads. attn_prep's block of hd threads per row (147k
// blocks, each with two block barriers, at 8,192 tokens) was latency-bound. Needs hd % 4 == 0.
// Heads h0.. of each row only: h0 = nq leaves the query heads to attn_flash4's fused prep.
// grid ceil(t (nq + nkv - h0) / 8), block 256, dynamic smem 8 hd floats.
extern "C" __global__ void __launch_bounds__(256)
    attn_prep_rows(const float* __restrict__ qg, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                   const float* __restrict__ inv_freq, float* __restrict__ q_out, bf16* __restrict__ k_cache,
                   bf16* __restrict__ v_cache, int past, int t, int nq, int nkv, int hd, int rot_half, float eps,
                   int h0) {
    PREFILL_KERNEL();
    extern __shared__ float prep_rows[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nh = nq + nkv - h0;
    const int r = blockIdx.x * 8 + warp;
    if (r >= t * nh) return;  // warp-uniform; no block barrier below
    const int s = r / nh, head = h0 + r % nh, kvh = head - nq;
    const bool is_q = head < nq;
    const float* src = is_q ? qg + ((size_t)s * nq + head) * 2 * hd : k + ((size_t)s * nkv + kvh) * hd;
    const float* wn = is_q ? q_norm : k_norm;
    float* buf = prep_rows + warp * hd;
    float ss = 0.0f;
    for (int i = 4 * lane; i < hd; i += 128) {
        const float4 x = *reinterpret_cast<const float4*>(src + i);
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        *reinterpret_cast<float4*>(buf + i) = x;
    }
    const float inv = rsqrtf(warp_sum(ss) / hd + eps);
    __syncwarp();
    const int pos = past + s;
    for (int i = lane; i < hd; i += 32) {
        float y = buf[i] * inv * (1.0f + wn[i]);
        if (i < 2 * rot_half) {
            const int j = i < rot_half ? i + rot_half : i - rot_half;
            const float pj = buf[j] * inv * (1.0f + wn[j]);
            float sn, cs;
            sincosf((float)pos * inv_freq[i < rot_half ? i : j], &sn, &cs);
            y = i < rot_half ? y * cs - pj * sn : y * cs + pj * sn;
        }
        if (is_q) {
            q_out[((size_t)s * nq + head) * hd + i] = y;
        } else {
            const size_t off = ((size_t)pos * nkv + kvh) * hd + i;
            k_cache[off] = __float2bfloat16(y);
            v_cache[off] = __float2bfloat16(v[((size_t)s * nkv + kvh) * hd + i]);
        }
    }
}

// ---- Prefill flash attention ----
// A warp's 16 rows of O (mma accumulator layout: rows r0 and r0 + 8 in the lanes of each quad,
// l0 / l1 per-lane partial row sums): the quad's sums, then O / l times sigmoid(gate) as
// bf16 into out for the rows below t, head h.
template <int HD>
__device__ __forceinline__ void flash_store_rows(const float (&o)[HD / 8][4], float l0, float l1, int r0, int t, int h,
                                                 int nq, const float* __restrict__ qg, bf16* __restrict__ out,
                                                 int cq) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int srow = r0 + half * 8;
        if (srow >= t) continue;
        const float inv = 1.0f / (half ? l1 : l0);
        const float* gate = qg + ((size_t)srow * nq + h) * 2 * HD + HD;
        bf16* dst = out + ((size_t)srow * nq + h) * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            const int c = n * 8 + cq;
            const float2 gt = *reinterpret_cast<const float2*>(gate + c);
            *reinterpret_cast<unsigned*>(dst + c) =
                pack_bf16x2(o[n][2 * half] * inv * sigmoid_f(gt.x), o[n][2 * half + 1] * inv * sigmoid_f(gt.y));
        }
    }
}

// Prefill attention on wgmma (attn_flash4; sm_90a, head dim 256), causal over `past + t` cached
// keys, the sigmoid output gate fused into the store. A block = 64 query positions x 2 query
// heads of one KV group, so every K/V tile staged in shared memory serves both heads; grid
// (nq / 2, ceil(t / 64)). Query blocks run latest first (most keys): the head pairs are x, so the
// blocks, dispatched in linear order, go heaviest query tile first over all heads (longest-first:
// the light tiles fill in behind; with the query tiles on x, a later head's heaviest tiles
// started last). Warp-specialised.
// Warpgroups 0 and 1 are consumers, warpgroup w owning head h0 + w (its 64 rows a wgmma tile);
// warpgroup 2 is the producer, alone issuing the K/V copies (cp.async) into two stages, each
// with a `full` mbarrier (the producer's 128 threads arrive as their copies land) and an
// `empty` one (the 256 consumer threads arrive when done with it). So the consumers never wait
// for each other and drift apart: one's softmax runs while the other's products use the tensor
// cores. The producer gives registers back (setmaxnreg) so the consumers can hold O. A
// consumer warpgroup, per K/V tile j of F4_BK = 80 keys:
//   S = Q Kᵀ: 16 wgmma m64n80k16 straight from shared memory (Q and K in the 128-byte swizzle,
//      four 64-dim column blocks each; at 80 keys a k16 step reads 5 KB for 40 of the tensor
//      cores' clocks where 64 keys read 4 KB for 32: less shared-memory bandwidth a FLOP);
//   the online softmax (base 2, Q pre-scaled by scale·log2 e) on the accumulators, rows in the
//      lanes of a quad as in attn_decode_mma (attention.cuh); O is rescaled only when a row's
//      max moved;
//   O += P V: 4 wgmma m64n256k16 with P from registers (S's accumulators packed to bf16 are the
//      A fragments) and V read N-major from its swizzled tile (no transposing copy).
// Registers: O 128, S 40 floats a consumer thread. Block 384. Dynamic smem F4_SMEM (1024-byte
// aligned: the swizzle is a function of the address): Q 2 x 32 KiB, 2 stages of K 40 KiB +
// V 40 KiB, then the four mbarriers (229,408 bytes).
// With q_norm set, Q comes straight from qg's first half with attn_prep_rows' RMSNorm and
// partial rotation applied on the way into shared memory (the same sums, in the same order), so
// attn_prep_rows does only the KV heads and no f32 q round trip is written and read (~250 MB at
// 8,192 tokens a layer). Needs rot_half % 4 == 0 and rot_half <= 32: lane l holds dims
// [4l, 4l + 4) and [128 + 4l, ..) as attn_prep_rows sums them, the rotation partner is lane
// l ± rot_half / 4 and lane f computes frequency f's sincos for the whole row.
#define F4_HD 256
#define F4_BK 80  // keys a K/V tile
#define F4_TILE (64 * F4_HD * 2)       // bytes of a Q tile: 4 column blocks of 64 rows x 128 B
#define F4_KV (F4_BK * F4_HD * 2)      // bytes of a K or V tile: 4 column blocks of F4_BK rows
#define F4_SMEM (2 * F4_TILE + 4 * F4_KV + 32)

// Byte offset of (row r, 16-byte chunk c of the HD / 8) in a swizzled tile of ROWS rows.
template <int ROWS>
__device__ __forceinline__ int f4_off(int r, int c) {
    return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// attn_flash4's consumer warpgroups (see attn_flash4_body).
__device__ __forceinline__ void attn_flash4_consumer(const float* __restrict__ q, const float* __restrict__ qg,
                                                     bf16* __restrict__ out, int t, int past, int nq, float scale,
                                                     const float* __restrict__ q_norm,
                                                     const float* __restrict__ inv_freq, int rot_half, float eps,
                                                     unsigned char* qs, unsigned char* kvs, unsigned long long* full,
                                                     unsigned long long* empty, int q0, int h0, int ntiles,
                                                     int n_valid) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wi = warp & 3;
    setmaxnreg_inc<232>();
    // Consumers. The warpgroup through a shuffle from lane 0: ptxas then knows it is
    // warp-uniform and keeps the Q descriptor in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const float scale_log2 = scale * 1.4426950408889634f;
    if (q_norm) {  // grid-uniform: this warpgroup's Q prepared here (a warp a row), as bf16
        unsigned char* qw = qs + wg * F4_TILE;
        const int rh4 = rot_half >> 2, rot = lane < 2 * rh4;
        const int partner = lane < rh4 ? lane + rh4 : lane - rh4, f0 = 4 * (lane < rh4 ? lane : lane - rh4);
        const float4 w0 = *reinterpret_cast<const float4*>(q_norm + 4 * lane);
        const float4 w1 = *reinterpret_cast<const float4*>(q_norm + 128 + 4 * lane);
        const float freq = lane < rot_half ? inv_freq[lane] : 0.0f;
#pragma unroll 2
        for (int r = wi; r < 64; r += 4) {
            float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
            if (q0 + r < t) {  // warp-uniform
                const float* src = qg + ((size_t)(q0 + r) * nq + h0 + wg) * 2 * F4_HD;
                x0 = *reinterpret_cast<const float4*>(src + 4 * lane);
                x1 = *reinterpret_cast<const float4*>(src + 128 + 4 * lane);
            }
            float ss = 0.0f;
            ss += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w;
            ss += x1.x * x1.x + x1.y * x1.y + x1.z * x1.z + x1.w * x1.w;
            const float inv = rsqrtf(warp_sum(ss) / F4_HD + eps);
            float y[4] = {x0.x * inv * (1.0f + w0.x), x0.y * inv * (1.0f + w0.y), x0.z * inv * (1.0f + w0.z),
                          x0.w * inv * (1.0f + w0.w)};
            float sn_f, cs_f;  // this lane's frequency, at the row's position
            sincosf((float)(past + q0 + r) * freq, &sn_f, &cs_f);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float pj = __shfl_sync(0xffffffffu, y[e], partner & 31);
                const float sn = __shfl_sync(0xffffffffu, sn_f, (f0 + e) & 31);
                const float cs = __shfl_sync(0xffffffffu, cs_f, (f0 + e) & 31);
                if (rot) y[e] = lane < rh4 ? y[e] * cs - pj * sn : y[e] * cs + pj * sn;
            }
            const float4 z1 = make_float4(x1.x * inv * (1.0f + w1.x), x1.y * inv * (1.0f + w1.y),
                                          x1.z * inv * (1.0f + w1.z), x1.w * inv * (1.0f + w1.w));
            *reinterpret_cast<uint2*>(qw + f4_off<64>(r, lane >> 1) + (lane & 1) * 8) =
                make_uint2(pack_bf16x2(y[0] * scale_log2, y[1] * scale_log2),
                           pack_bf16x2(y[2] * scale_log2, y[3] * scale_log2));
            *reinterpret_cast<uint2*>(qw + f4_off<64>(r, 16 + (lane >> 1)) + (lane & 1) * 8) =
                make_uint2(pack_bf16x2(z1.x * scale_log2, z1.y * scale_log2),
                           pack_bf16x2(z1.z * scale_log2, z1.w * scale_log2));
        }
        fence_proxy_async();  // the stores visible to wgmma
        bar_sync_named(1 + wg, 128);
    } else {  // this warpgroup's Q, times scale·log2 e, as bf16 (rows past t zero)
        const int wt = tid & 127;
        unsigned char* qw = qs + wg * F4_TILE;
        for (int v = wt; v < 64 * (F4_HD / 8); v += 128) {
            const int r = v >> 5, c = v & 31;
            float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
            if (q0 + r < t) {
                const float* src = q + ((size_t)(q0 + r) * nq + h0 + wg) * F4_HD + c * 8;
                x0 = *reinterpret_cast<const float4*>(src);
                x1 = *reinterpret_cast<const float4*>(src + 4);
            }
            *reinterpret_cast<uint4*>(qw + f4_off<64>(r, c)) = make_uint4(
                pack_bf16x2(x0.x * scale_log2, x0.y * scale_log2), pack_bf16x2(x0.z * scale_log2, x0.w * scale_log2),
                pack_bf16x2(x1.x * scale_log2, x1.y * scale_log2), pack_bf16x2(x1.z * scale_log2, x1.w * scale_log2));
        }
        fence_proxy_async();  // the stores visible to wgmma
        bar_sync_named(1 + wg, 128);
    }
    const int g = lane >> 2, cq = 2 * (lane & 3);
    const int qpos0 = past + q0 + wi * 16 + g;  // this thread's first row; the second is 8 below
    const unsigned long long dq_wg = wgmma_desc_sw128(qs + wg * F4_TILE);
    // o is never zeroed: the first P V product overwrites it (scale_d 0); ptxas may schedule a
    // zeroing loop inside a wgmma stage, which serializes every wgmma of the kernel (C7513).
    float o[128];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    // The warpgroups take turns issuing S = Q Kᵀ (named barriers 3 + w, 256 threads: the other
    // warpgroup arrives when it has issued its own), so one's softmax runs under the other's
    // products. Warpgroup 0 goes first; the arrivals balance (warpgroup 1 skips its last).
    if (wg == 1) bar_arrive_named(3, 256);
    for (int j = 0; j < ntiles; j++) {
        const int st = j & 1;
        mbar_wait(&full[st], (j >> 1) & 1);  // the producer's copies of tile j landed
        fence_proxy_async();                 // ... and are visible to wgmma
        const unsigned char* kt = kvs + st * 2 * F4_KV;
        // Descriptors pinned (an empty asm) before each stage, so their arithmetic is not sunk
        // into it nor all 16 hoisted out of the loop (out of uniform registers, the copies back
        // inside the stage serialize every wgmma: C7513).
        unsigned long long dq = dq_wg, dk = wgmma_desc_sw128(kt), dv = wgmma_desc_sw128_mn(kt + F4_KV, F4_BK * 128);
        unsigned accumulate = j > 0;  // the first P V product overwrites o
        wgmma_fence_operand(dq);
        wgmma_fence_operand(dk);
        wgmma_fence_operand(dv);
        wgmma_fence_operand(accumulate);
        const int k0 = j * F4_BK;
        float s[F4_BK / 2];
        bar_sync_named(3 + wg, 256);  // this warpgroup's turn
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < F4_HD / 16; kk++)  // column block kk / 4, 32 bytes a k16 step inside it
            wgmma_m64n80k16(s, dq + (kk >> 2) * (8192 >> 4) + 2 * (kk & 3),
                            dk + (kk >> 2) * ((F4_BK * 128) >> 4) + 2 * (kk & 3), kk > 0);
        wgmma_commit();
        if (wg == 0 || j + 1 < ntiles) bar_arrive_named(4 - wg, 256);  // the other's turn
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < F4_BK / 2; i++) wgmma_fence_operand(s[i]);
        // Causal / cache-end mask, only on tiles that reach past this warp's first row.
        auto& s4 = reinterpret_cast<float(&)[F4_BK / 8][4]>(s);
        if (k0 + F4_BK - 1 > qpos0 - g || k0 + F4_BK > n_valid) warp_causal_mask<F4_BK>(s4, k0, qpos0, n_valid, cq);
        warp_softmax<F4_HD, F4_BK, true>(s4, reinterpret_cast<float(&)[F4_HD / 8][4]>(o), m0, m1, l0, l1, j > 0);
        unsigned p[F4_BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < F4_BK / 16; kk++) p_frag<F4_BK>(s4, kk, p[kk]);
#pragma unroll
        for (int i = 0; i < 128; i++) wgmma_fence_operand(o[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < F4_BK / 16; kk++)  // keys 16 kk..: 16 rows of 128 B down the V tile
            wgmma_m64n256k16_rs_tb(o, p[kk], dv + kk * (2048 >> 4), kk > 0 ? 1 : accumulate);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 128; i++) wgmma_fence_operand(o[i]);
        mbar_arrive(&empty[st]);  // this thread is done with stage st
    }
    flash_store_rows<F4_HD>(reinterpret_cast<const float(&)[F4_HD / 8][4]>(o), l0, l1, q0 + wi * 16 + g, t, h0 + wg, nq,
                            qg, out, cq);
}

// attn_flash4's block: the two consumer warpgroups and the producer (see above).
__device__ __forceinline__ void attn_flash4_body(const float* __restrict__ q, const bf16* __restrict__ kc,
                                                 const bf16* __restrict__ vc, const float* __restrict__ qg,
                                                 bf16* __restrict__ out, int t, int past, int nq, int nkv, float scale,
                                                 const float* __restrict__ q_norm, const float* __restrict__ inv_freq,
                                                 int rot_half, float eps) {
    extern __shared__ __align__(1024) unsigned char f4_smem[];
    unsigned char* qs = f4_smem;                 // [2 heads]
    unsigned char* kvs = f4_smem + 2 * F4_TILE;  // [2 stages][K tile | V tile]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(kvs + 4 * F4_KV);  // [2]
    unsigned long long* empty = full + 2;                                                      // [2]
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 64;  // heaviest query tiles first (flash_grid)
    const int h0 = blockIdx.x * 2, kvh = h0 / (nq / nkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n_valid = past + t;
    const int n_end = min(n_valid, past + q0 + 64);
    const int ntiles = (n_end + F4_BK - 1) / F4_BK;
    if (tid == 0) {
        mbar_init(&full[0], 128);
        mbar_init(&full[1], 128);
        mbar_init(&empty[0], 256);
        mbar_init(&empty[1], 256);
    }
    __syncthreads();
    if (warp >= 8) {  // the producer: tile j into stage j % 2 once the consumers released it
        setmaxnreg_dec<40>();
        const int r0 = (tid >> 5) & 3;  // rows r0, r0 + 4, ..; the lane is the 16-byte chunk
        for (int j = 0; j < ntiles; j++) {
            const int st = j & 1;
            if (j >= 2) mbar_wait(&empty[st], ((j >> 1) - 1) & 1);
            unsigned char* ks = kvs + st * 2 * F4_KV;
#pragma unroll 4
            for (int r = r0; r < F4_BK; r += 4) {
                const int kp = j * F4_BK + r;
                const bool ok = kp < n_valid;
                const size_t off = ((size_t)(ok ? kp : 0) * nkv + kvh) * F4_HD + lane * 8;
                cp_async16(ks + f4_off<F4_BK>(r, lane), kc + off, ok);
                cp_async16(ks + F4_KV + f4_off<F4_BK>(r, lane), vc + off, ok);
            }
            cp_async_mbar_arrive(&full[st]);
        }
    } else {
        attn_flash4_consumer(q, qg, out, t, past, nq, scale, q_norm, inv_freq, rot_half, eps, qs, kvs, full, empty, q0,
                             h0, ntiles, n_valid);
    }
}

extern "C" __global__ void __launch_bounds__(384, 1)
    attn_flash4_hd256(const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                      const float* __restrict__ qg, bf16* __restrict__ out, int t, int past, int nq, int nkv, int hd,
                      float scale, const float* __restrict__ q_norm, const float* __restrict__ inv_freq, int rot_half,
                      float eps) {
    PREFILL_KERNEL();
    attn_flash4_body(q, kc, vc, qg, out, t, past, nq, nkv, scale, q_norm, inv_freq, rot_half, eps);
}
