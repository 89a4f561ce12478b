// Decode GEMVs (one token): the weights stream once with 16-byte loads, four rows per warp in
// flight; the input vector is staged in shared memory (rounded to bf16 like every GEMM input).

// y[r] = beta * y[r] + W[r, :] . x for W bf16 [n, k]. The input is the bf16 vector `x`, or,
// when `x` is null, the zero-centred RMSNorm of the f32 residual `h` with weight `nw` (block 0
// also stores that as bf16 in `xb_out`, if given, for later kernels). A block stages the input
// once and walks row groups gridDim.x apart (grids are capped for very tall matrices).
// With `arg_val` set (lm_head), also the greedy argmax over rows < arg_limit: per-block
// partials, reduced by the last block into arg_out[0] (and arg_out2[0] if given).
// grid <= ceil(n / (gemv_rows_per_block(k))), block 256, dynamic smem k floats.
// gemv_dec_w: the same with k = 4096 read a warp per whole row (gemv_rows_per_block(k, true)).
template <bool WHOLE_ROWS>
__device__ __forceinline__ void gemv_dec_impl(
    const bf16* __restrict__ w, int n, int k, const bf16* __restrict__ x, const float* __restrict__ h,
    const float* __restrict__ nw, float eps, bf16* __restrict__ xb_out, float* __restrict__ y, float beta,
    float* __restrict__ arg_val, int* __restrict__ arg_idx, unsigned* __restrict__ arg_done, int arg_limit,
    int* __restrict__ arg_out, int* __restrict__ arg_out2) {
    DECODE_KERNEL(TAG_GEMV);
    extern __shared__ float xs[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int rows = gemv_rows_per_block(k, WHOLE_ROWS);
    float best = -INFINITY;  // warp 0: running argmax over this block's rows
    int best_id = 0x7fffffff;
    for (int row0 = blockIdx.x * rows; row0 < n; row0 += gridDim.x * rows) {
        bool staged = row0 != blockIdx.x * rows;
        block_gemv<WHOLE_ROWS>(w, n, k, row0, staged, x, h, nw, eps, blockIdx.x == 0 ? xb_out : nullptr, xs, y, beta);
        if (arg_val) {
            __syncthreads();  // this group's y visible to warp 0
            int r = row0 + lane;
            if (warp == 0 && lane < rows && r < n && r < arg_limit) {
                float v = y[r];
                if (v > best) { best = v; best_id = r; }  // rows ascend: first index kept on ties
            }
        }
    }
    if (!arg_val) return;
    if (warp == 0) {
        warp_argmax(best, best_id);
        if (lane == 0) { arg_val[blockIdx.x] = best; arg_idx[blockIdx.x] = best_id; }
    }
    if (!last_block_done(arg_done)) return;
    float v = -INFINITY;
    int id = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        float ov = __ldcg(arg_val + b);
        int oi = __ldcg(arg_idx + b);
        if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
    }
    block_argmax(v, id);
    if (threadIdx.x == 0) {
        arg_out[0] = id;
        if (arg_out2) arg_out2[0] = id;
    }
}

#define GEMV_DEC(NAME, WHOLE_ROWS)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                   \
        const bf16* __restrict__ w, int n, int k, const bf16* __restrict__ x, const float* __restrict__ h,      \
        const float* __restrict__ nw, float eps, bf16* __restrict__ xb_out, float* __restrict__ y, float beta,  \
        float* __restrict__ arg_val, int* __restrict__ arg_idx, unsigned* __restrict__ arg_done, int arg_limit, \
        int* __restrict__ arg_out, int* __restrict__ arg_out2) {                                               \
        gemv_dec_impl<WHOLE_ROWS>(w, n, k, x, h, nw, eps, xb_out, y, beta, arg_val, arg_idx, arg_done, arg_limit, \
                                  arg_out, arg_out2);                                                            \
    }
GEMV_DEC(gemv_dec, false)
GEMV_DEC(gemv_dec_w, true)

// gemv_dec for k = 2048 as one stream a block: one 256-thread block an SM takes a contiguous run
// of row pairs, and each warp streams its pairs (8 KiB: two rows) through a private ring of
// `ns` (2-3) stages (see `bulk`), so every SM keeps loads in flight from its first pair to its last
// instead of in three waves of blocks that each load, then compute, then give way. `early` (0 to
// ns) of each warp's first pairs are requested before griddep_wait (weights only), the rest as
// stages free up. A stage holds the pair's two rows as they are in memory, which is the layout
// of load_rows<2, 8> (with cp.async a lane reads back only what it copied), and the sums are
// gemv_dec's, so y is bitwise the same. No argmax (the in-projections only).
// launch_at: the kernels after this one may start (griddepcontrol.launch_dependents) once each
// warp has launch_at units left (or at its first unit when it has fewer); 0: at the start. The
// GDN conv, step and out-projection (or the attention's prep, decode and combine) then take their
// SMs and request their weights and state while this stream ends, not from its start, where
// their requests slowed it (decode +1.5-2.5% at 256, H200).
// bulk (sm_90): lane 0 fills a stage with one bulk copy (its two rows are contiguous) that
// completes on the stage's mbarrier, instead of 16 cp.async a lane, so the ring's requests do
// not occupy the SM's load path (decode +2% on the H200; the input's staging after the wait
// stayed ~3.5 µs, so what it bought is not established).
// grid <= ceil(n / 2), block 256, dynamic smem gemv_stream_smem(ns) bytes.
__host__ __device__ __forceinline__ int gemv_stream_smem(int ns) { return 2 * 2048 * 4 + 8 * ns * (8192 + 8); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_dec_stream(
    const bf16* __restrict__ w, int n, const bf16* __restrict__ x, const float* __restrict__ h,
    const float* __restrict__ nw, float eps, bf16* __restrict__ xb_out, float* __restrict__ y, float beta, int ns,
    int early, int launch_at, int bulk) {
    DECODE_KERNEL_NO_LAUNCH(TAG_GEMV);
    if (launch_at <= 0) griddep_launch();
    constexpr int K = 2048;
    extern __shared__ __align__(16) float xs[];  // x [K], the RMSNorm weight [K], the rings, their mbarriers
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4* ring = reinterpret_cast<uint4*>(xs + 2 * K) + warp * ns * 512;
    unsigned long long* full = reinterpret_cast<unsigned long long*>(xs + 2 * K + 8 * ns * 2048) + warp * ns;
    if (bulk) {
        if (lane == 0) {
            for (int s = 0; s < ns; s++) mbar_init(&full[s], 1);
            fence_proxy_async();  // the initialised barriers visible to the copy engine
        }
        __syncwarp();
    }
    const int pairs = (n + 1) / 2, p0 = (int)((long long)pairs * blockIdx.x / gridDim.x),
              p1 = (int)((long long)pairs * (blockIdx.x + 1) / gridDim.x);
    const int mine = p1 - p0 > warp ? (p1 - p0 - warp + 7) / 8 : 0;  // pairs p0 + warp + 8 u
    int issued = 0;
    auto issue = [&](int u) {
        const int r = 2 * (p0 + warp + 8 * u);
        uint4* st = ring + (u % ns) * 512;
        if (bulk) {
            if (lane == 0) {
                const unsigned bytes = (r + 1 < n ? 2 : 1) * K * 2;  // the last pair may be one row
                mbar_arrive_expect_tx(&full[u % ns], bytes);
                bulk_load(st, w + (size_t)r * K, bytes, &full[u % ns]);
            }
            return;
        }
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const bool ok = r + q < n;
            const uint4* src = reinterpret_cast<const uint4*>(w + (size_t)(ok ? r + q : r) * K);
#pragma unroll
            for (int j = 0; j < 8; j++) cp_async16(st + q * 256 + lane + 32 * j, src + lane + 32 * j, ok);
        }
        cp_async_commit();
    };
    const float* ws = x ? nullptr : preload_norm(xs + K, nw, K);  // its group first: see below
    while (issued < mine && issued < early && issued < ns) issue(issued++);
    griddep_wait();
    uint4* xb = reinterpret_cast<uint4*>(xs);  // the input as bf16
    if (!x && bulk) {
        // h's loads go out before the stages this warp still has to request, not behind them.
        float4 hv[2];
#pragma unroll
        for (int u = 0; u < 2; u++) hv[u] = reinterpret_cast<const float4*>(h)[threadIdx.x + 256 * u];
        while (issued < mine && issued < ns) issue(issued++);
        stage_rmsnorm_held<2>(xb, hv, nw, K, eps, blockIdx.x == 0 ? xb_out : nullptr, ws);
    } else {
        while (issued < mine && issued < ns) issue(issued++);
        // The RMSNorm weight's copies were committed before every ring stage: wait for them only.
        stage_input(xb, x, h, nw, K, eps, blockIdx.x == 0 ? xb_out : nullptr, ws,
                    bulk ? 0 : issued);
    }
    TRACE_PHASE(0);  // the timeline's phases: input staged, first unit summed, last unit summed
    for (int u = 0; u < mine; u++) {
        if (launch_at > 0 && u == (mine > launch_at ? mine - launch_at : 0)) griddep_launch();
        if (bulk) mbar_wait(&full[u % ns], (u / ns) & 1);
        else cp_async_wait_dyn(issued - 1 - u);  // the groups committed after u's may stay in flight
        const uint4* st = ring + (u % ns) * 512;
        const int r = 2 * (p0 + warp + 8 * u);
        float acc[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const X8 xv = unpack8(xb[lane + 32 * j]);
#pragma unroll
            for (int q = 0; q < 2; q++) acc[q] += dot8(st[q * 256 + lane + 32 * j], xv);
        }
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const float a = warp_sum(acc[q]);
            if (lane == q && r + q < n) y[r + q] = beta == 0.0f ? a : beta * y[r + q] + a;
        }
        // The stage is refilled only after the warp sums of what it held (their loads are done;
        // with bulk, lane 0 refills what every lane read).
        if (issued < mine) issue(issued++);
        if (u == 0) TRACE_PHASE(1);
    }
    TRACE_PHASE(2);
    if (launch_at > 0 && mine == 0) griddep_launch();
}

// The bf16 tail rows of gemv_fp8 / gemv_q4 (GDN's b|a beside the quantised q|k|v|z): tail block
// tb takes rows 16 tb .. + 15 of wb [nb, k], two a warp, against the m staged bf16 input rows
// (x: rows of ldw 32-bit words), into y [t, n + row] (beta as the GEMV's).
__device__ __forceinline__ void gemv_bf16_tail(const bf16* __restrict__ wb, int nb, int tb, int k, const unsigned* x,
                                               int ldw, int m, float* __restrict__ y, int ldy, int n, float beta) {
    const int lane = threadIdx.x & 31, tr = tb * 16 + (threadIdx.x >> 5) * 2;
    const bf16* brows[2] = {tr < nb ? wb + (size_t)tr * k : nullptr, tr + 1 < nb ? wb + (size_t)(tr + 1) * k : nullptr};
    for (int t = 0; t < m; t++) {
        float acc[2];
        dot_rows_any<2>(brows, reinterpret_cast<const uint4*>(x + t * ldw), k, acc);
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const float a = warp_sum(acc[q]);
            if (lane == q && tr + q < nb) {
                float* o = y + (size_t)t * ldy + n + tr + q;
                *o = beta == 0.0f ? a : beta * *o + a;
            }
        }
    }
}

// W8A16 GEMV of FP8 weights for up to GEMV_FP8_TOKENS tokens (the decode step, batched steps and
// short chunks): y[t, r] = beta * y[t, r] + sum_c q[r, c] s[r / 128, c / 128] x[t, c] for W e4m3
// [n, k] (k % 16 == 0) with f32 block scales s [ceil(n / 128), ceil(k / 128)]. The input is the
// bf16 rows x [m, k], or (x null, m = 1) the zero-centred RMSNorm of h with weight nw; it is
// staged in shared memory as bf16 after the warp's weight words are in flight (all of them: R
// rows of k / 512 words a lane). y [m, ldy]. Each token re-converts the words held in registers.
// With nb > 0, blocks past the FP8 rows' take the bf16 rows wb [nb, k] (two a warp), their
// products into y columns n .. n + nb - 1 (GDN's bf16 b|a beside the FP8 q|k|v|z: one launch).
// grid ceil(n / (8 gemv_fp8_rows(k))) + ceil(nb / 16), block 256, smem gemv_fp8_smem(m, k,
// x null) bytes.
#define GEMV_FP8_TOKENS 16
__host__ __device__ __forceinline__ constexpr int gemv_fp8_rows(int k) {
    return k == 4096 ? 1 : k == 2048 ? 4 : k == 512 ? 8 : 2;
}
__host__ __device__ __forceinline__ int gemv_fp8_smem(int m, int k, bool norm) { return norm ? 8 * k : 2 * m * k; }
template <int VPL>
__device__ __forceinline__ void gemv_fp8_impl(const uint4* __restrict__ w, const float* __restrict__ sc, int n, int k,
                                              const bf16* __restrict__ x, const float* __restrict__ h,
                                              const float* __restrict__ nw, float eps, int m, float* __restrict__ y,
                                              int ldy, float beta, const bf16* __restrict__ wb, int nb, float* xs) {
    DECODE_KERNEL(TAG_GEMV);
    constexpr int R = gemv_fp8_rows(VPL * 512), NV = VPL > 0 ? VPL : 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = k >> 4, kb = (k + 127) >> 7;
    const int fp8_blocks = (n + 8 * R - 1) / (8 * R);
    const bool tail = (int)blockIdx.x >= fp8_blocks;  // block-uniform: bf16 rows of wb
    const int r0 = tail ? n : (blockIdx.x * 8 + warp) * R;
    const uint4* rows[R];
    const float* srows[R];
#pragma unroll
    for (int q = 0; q < R; q++) {
        const int r = r0 + q;
        rows[q] = r < n ? w + (size_t)r * kw : nullptr;
        srows[q] = sc + (size_t)(r >> 7) * kb;
    }
    uint4 v[R][NV];
    float s[R][NV];
    if (VPL > 0) load_rows_fp8<R, NV>(v, s, rows, srows);
    uint4* xb = reinterpret_cast<uint4*>(xs);
    if (x) {
        griddep_wait();
        stage_bf16(xb, x, m * k);
    } else {
        const float* ws = preload_norm(xs + k, nw, k);
        griddep_wait();
        stage_rmsnorm(xb, h, nw, k, eps, nullptr, ws);
    }
    if (tail) {
        gemv_bf16_tail(wb, nb, (int)blockIdx.x - fp8_blocks, k, reinterpret_cast<const unsigned*>(xb), k / 2, m, y,
                       ldy, n, beta);
        return;
    }
    for (int t = 0; t < m; t++) {
        float acc[R];
        if (VPL > 0) dot_rows_fp8<R, NV>(v, s, xb + t * (k >> 3), acc);
        else dot_rows_fp8_any<R>(rows, srows, xb + t * (k >> 3), kw, acc);
#pragma unroll
        for (int q = 0; q < R; q++) {
            const float a = warp_sum(acc[q]);
            if (lane == q && r0 + q < n) {
                float* o = y + (size_t)t * ldy + r0 + q;
                *o = beta == 0.0f ? a : beta * *o + a;
            }
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) gemv_fp8(const uint4* __restrict__ w, const float* __restrict__ sc,
                                                           int n, int k, const bf16* __restrict__ x,
                                                           const float* __restrict__ h, const float* __restrict__ nw,
                                                           float eps, int m, float* __restrict__ y, int ldy,
                                                           float beta, const bf16* __restrict__ wb, int nb) {
    extern __shared__ float gemv_fp8_xs[];
    switch (k) {
        case 512: gemv_fp8_impl<1>(w, sc, n, k, x, h, nw, eps, m, y, ldy, beta, wb, nb, gemv_fp8_xs); break;
        case 2048: gemv_fp8_impl<4>(w, sc, n, k, x, h, nw, eps, m, y, ldy, beta, wb, nb, gemv_fp8_xs); break;
        case 4096: gemv_fp8_impl<8>(w, sc, n, k, x, h, nw, eps, m, y, ldy, beta, wb, nb, gemv_fp8_xs); break;
        default: gemv_fp8_impl<0>(w, sc, n, k, x, h, nw, eps, m, y, ldy, beta, wb, nb, gemv_fp8_xs);
    }
}

// W4A16 GEMV of affine 4-bit weights (q4 tiles, gemv.cuh) for up to GEMV_Q4_TOKENS tokens on
// the tensor cores: y[t, r] = beta * y[t, r] + sum_c w[r, c] x[t, c] for w [n, k] (n % 16 == 0,
// k % 64 == 0) with scale/bias pairs sb. A block takes q4_strips(k / 512) strips of 16 rows; its
// 8 warps split each strip's k / 64 units (q4_load / q4_dot: NV consecutive units a warp, all
// their codes requested before the input is staged); the warps' partial sums meet in shared
// memory. The input is the bf16 rows x [m, k], or (x null, m = 1) the zero-centred RMSNorm of h
// with weight nw. y [m, ldy]. With arg_val set (m = 1: lm_head), also the greedy argmax over
// rows < arg_limit as gemv_dec's: per-block partials (arg_val, arg_idx: a block each), reduced by
// the last block (arg_done's ticket) into arg_out[0] (and arg_out2[0] if given); 0 where no row
// beats -inf.
// grid ceil(n / (16 q4_strips(k / 512))), block 256, smem q4_smem(m, k, group, x null,
// 8 * 16 * m * q4_strips(k / 512)) bytes.
#define GEMV_Q4_TOKENS 16
template <int NV, int NT>
__device__ __forceinline__ void gemv_q4_impl(const uint4* __restrict__ w, const unsigned* __restrict__ sb, int group,
                                             int n, int k, const bf16* __restrict__ x, const float* __restrict__ h,
                                             const float* __restrict__ nw, float eps, int m, float* __restrict__ y,
                                             int ldy, float beta, float* __restrict__ arg_val,
                                             int* __restrict__ arg_idx, unsigned* __restrict__ arg_done,
                                             int arg_limit, int* __restrict__ arg_out, int* __restrict__ arg_out2,
                                             const bf16* __restrict__ wb, int nb, float* smem) {
    DECODE_KERNEL(TAG_GEMV);
    constexpr int SPB = q4_strips(NV);
    const int nspan = k / q4_span(group), ldw = q4_ldw(m, k);
    const int q4_blocks = (n / 16 + SPB - 1) / SPB;
    const bool tail = (int)blockIdx.x >= q4_blocks;  // block-uniform: bf16 rows of wb
    int strip[SPB];
#pragma unroll
    for (int sp = 0; sp < SPB; sp++) {
        const int st = (int)blockIdx.x * SPB + sp;
        strip[sp] = !tail && st * 16 < n ? st : -1;
    }
    uint4 v[SPB][NV > 0 ? NV : 1];
    Q4Sb<(NV > 0 ? NV : 1)> sbr[SPB];
    q4_load<NV, SPB>(v, sbr, w, sb, group, strip, k);
    unsigned* xw = reinterpret_cast<unsigned*>(smem);
    float* xsum = smem + m * ldw + (x ? 0 : k);
    float* red = xsum + m * nspan;
    if (x) {
        griddep_wait();
        q4_stage_rows(xw, ldw, x, nullptr, m, k);
    } else {
        const float* ws = preload_norm(smem + ldw, nw, k);
        griddep_wait();
        stage_rmsnorm(reinterpret_cast<uint4*>(xw), h, nw, k, eps, nullptr, ws);
    }
    if (tail) {
        gemv_bf16_tail(wb, nb, (int)blockIdx.x - q4_blocks, k, xw, ldw, m, y, ldy, n, beta);
        return;
    }
    q4_span_sums(xw, ldw, m, k, q4_span(group), xsum);
    TRACE_PHASE(0);  // the timeline's phases: input staged, dot products done
    q4_dot<NV, NT, SPB>(v, sbr, w, sb, group, strip, k, xw, ldw, m, xsum, red);
    float best = -INFINITY;  // the argmax (m = 1): this thread's row, then the block's
    int best_id = 0x7fffffff;
    for (int o = threadIdx.x; o < SPB * m * 16; o += blockDim.x) {
        const int sp = o / (m * 16), t = (o >> 4) % m, r = o & 15;
        if (strip[sp] < 0) continue;
        const float a = q4_red_sum<SPB>(red, sp, m, t, r);
        float* out = y + (size_t)t * ldy + strip[sp] * 16 + r;
        const float val = beta == 0.0f ? a : beta * *out + a;
        *out = val;
        const int row = strip[sp] * 16 + r;
        if (val > best && row < arg_limit) { best = val; best_id = row; }  // a row a thread: ids ascend
    }
    if (!arg_val) return;
    block_argmax(best, best_id);
    if (threadIdx.x == 0) { arg_val[blockIdx.x] = best; arg_idx[blockIdx.x] = best_id; }
    if (!last_block_done(arg_done)) return;
    float top = -INFINITY;
    int id = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        const float ov = __ldcg(arg_val + b);
        const int oi = __ldcg(arg_idx + b);
        if (ov > top || (ov == top && oi < id)) { top = ov; id = oi; }
    }
    block_argmax(top, id);
    if (threadIdx.x == 0) {
        arg_out[0] = id == 0x7fffffff ? 0 : id;
        if (arg_out2) arg_out2[0] = id == 0x7fffffff ? 0 : id;
    }
}
extern "C" __global__ void __launch_bounds__(256) gemv_q4(const uint4* __restrict__ w, const unsigned* __restrict__ sb,
                                                          int group, int n, int k, const bf16* __restrict__ x,
                                                          const float* __restrict__ h, const float* __restrict__ nw,
                                                          float eps, int m, float* __restrict__ y, int ldy,
                                                          float beta, float* __restrict__ arg_val,
                                                          int* __restrict__ arg_idx, unsigned* __restrict__ arg_done,
                                                          int arg_limit, int* __restrict__ arg_out,
                                                          int* __restrict__ arg_out2, const bf16* __restrict__ wb,
                                                          int nb) {
    extern __shared__ float gemv_q4_xs[];
#define GEMV_Q4_CASE(NV)                                                                                          \
    if (m <= 8)                                                                                                   \
        gemv_q4_impl<NV, 1>(w, sb, group, n, k, x, h, nw, eps, m, y, ldy, beta, arg_val, arg_idx, arg_done,       \
                            arg_limit, arg_out, arg_out2, wb, nb, gemv_q4_xs);                                    \
    else                                                                                                          \
        gemv_q4_impl<NV, 2>(w, sb, group, n, k, x, h, nw, eps, m, y, ldy, beta, nullptr, nullptr, nullptr, 0,     \
                            nullptr, nullptr, wb, nb, gemv_q4_xs)
    switch (k) {
        case 512: GEMV_Q4_CASE(1); break;
        case 2048: GEMV_Q4_CASE(4); break;
        case 4096: GEMV_Q4_CASE(8); break;
        default: GEMV_Q4_CASE(0);
    }
#undef GEMV_Q4_CASE
}
