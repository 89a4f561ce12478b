// Sparse MoE, prefill: routing (softmax over all experts, top-k renormalised), a device-side
// counting sort of (token, slot) pairs by expert (moe_plan, moe_scatter: the rows the grouped
// GEMM of moe_gemm.cu and the few-row moe_gemv_sorted take), SwiGLU, and the combine with the
// sigmoid-gated shared expert. The decode step's MoE block is in moe_decode.cu.

// Order-preserving key of a float (larger float, larger unsigned) and back.
__device__ __forceinline__ unsigned float_key(float f) {
    unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Softmax top-k of one router row `r` [e] (in shared memory) by one warp: the k largest logits
// (first index on ties; they order like the probabilities), their probabilities renormalised
// over the k, exp(r_i - max) / sum, summed in rank order. For e <= 256 each lane sorts its own
// 8 values (i = lane + 32 m), then each round takes the best lane head with two integer warp
// reductions (the key, then the lowest index holding it) and the winner pops its head: no
// serial scan of the row per round. Wider rows take k rounds of a warp arg-max over the row.
// k <= 32. Entries past e never win (key 0 is below every float's key).
__device__ void route_topk_warp(float* r, int e, int k, int* __restrict__ ids, float* __restrict__ wts) {
    const int lane = threadIdx.x & 31;
    float my_v = -INFINITY;  // lane kk keeps the kk-th choice
    int my_id = 0;
    if (e <= 256) {
        unsigned key[8], idx[8];
#pragma unroll
        for (int m = 0; m < 8; m++) {
            int i = lane + 32 * m;
            key[m] = i < e ? float_key(r[i]) : 0u;
            idx[m] = i;
        }
        // Sort descending by key (ascending index on equal keys: odd-even transposition keeps
        // equal keys in their original, increasing-index order).
#pragma unroll
        for (int pass = 0; pass < 8; pass++)
#pragma unroll
            for (int m = pass & 1; m + 1 < 8; m += 2)
                if (key[m + 1] > key[m]) {
                    unsigned tk = key[m], ti = idx[m];
                    key[m] = key[m + 1]; idx[m] = idx[m + 1];
                    key[m + 1] = tk; idx[m + 1] = ti;
                }
        for (int kk = 0; kk < k; kk++) {
            unsigned best = __reduce_max_sync(0xffffffffu, key[0]);
            unsigned win = __reduce_min_sync(0xffffffffu, key[0] == best ? idx[0] : 0xffffffffu);
            if (lane == kk) { my_v = key_float(best); my_id = (int)win; }
            if (idx[0] == win) {
#pragma unroll
                for (int m = 0; m < 7; m++) { key[m] = key[m + 1]; idx[m] = idx[m + 1]; }
                key[7] = 0u;
            }
        }
    } else {
        for (int kk = 0; kk < k; kk++) {
            float best = -INFINITY;
            int bi = 0x7fffffff;
            for (int i = lane; i < e; i += 32) {
                float v = r[i];
                if (v > best || (v == best && i < bi)) { best = v; bi = i; }
            }
            warp_argmax(best, bi);
            if (lane == kk) { my_v = best; my_id = bi; }
            if (lane == 0) r[bi] = -INFINITY;
            __syncwarp();
        }
    }
    const float mx = __shfl_sync(0xffffffffu, my_v, 0);
    const float p = lane < k ? expf(my_v - mx) : 0.0f;
    float sum_p = 0.0f;
    for (int kk = 0; kk < k; kk++) sum_p += __shfl_sync(0xffffffffu, p, kk);
    if (lane < k) {
        ids[lane] = my_id;
        wts[lane] = p / sum_p;
    }
}

// Prefill routing, a warp per token, ROUTE_WARPS tokens a block: logits [t, e] -> topk
// ids/weights [t, k]; counts[e] += 1 a choice (lanes < k each add their own); and the shared
// expert's gate sigmoid(x . w_sg) for moe_combine. Its loads are issued before the top-k, so
// both latencies overlap. grid ceil(t / ROUTE_WARPS), block 32 ROUTE_WARPS, smem ROUTE_WARPS e
// floats. (A block a token, one warp each, ran 8,192 tokens in ~35 us on the H200: two waves of
// blocks too small for the SMs' block slots.)
#define ROUTE_WARPS 8
extern "C" __global__ void __launch_bounds__(32 * ROUTE_WARPS) moe_route(
    const float* __restrict__ logits, int e, int k, int* __restrict__ topk_ids, float* __restrict__ topk_w,
    int* __restrict__ counts, const bf16* __restrict__ x, const float* __restrict__ w_sg, float* __restrict__ sgate,
    int d, int t) {
    PREFILL_KERNEL();
    extern __shared__ float route_rows[];  // ROUTE_WARPS x e
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, s = blockIdx.x * ROUTE_WARPS + warp;
    if (s >= t) return;  // warp-uniform; no block barrier below
    float* row = route_rows + warp * e;
    for (int i = lane; i < e; i += 32) row[i] = logits[(size_t)s * e + i];
    // The shared expert's gate (8 bf16 a load when d allows).
    const bf16* xs = x + (size_t)s * d;
    float dot = 0.0f;
    if ((d & 7) == 0) {
        for (int c = lane; c < d / 8; c += 32) dot += dot8(reinterpret_cast<const uint4*>(xs)[c], w_sg + 8 * c);
    } else {
        for (int i = lane; i < d; i += 32) dot += __bfloat162float(xs[i]) * w_sg[i];
    }
    __syncwarp();
    route_topk_warp(row, e, k, topk_ids + s * k, topk_w + s * k);
    if (lane < k) atomicAdd(&counts[topk_ids[s * k + lane]], 1);  // the id this lane wrote
    dot = warp_sum(dot);
    if (lane == 0) sgate[s] = sigmoid_f(dot);
}

// Few-row routing (the calls moe_gemv_sorted runs, e <= 1024): the router's logits, each
// token's top-k and shared-expert gate, the rows per expert, the expert-sorted order and each
// sorted row's expert, in one launch where longer calls take five (the router GEMM, the counts'
// reset, moe_route, moe_plan, moe_scatter; ~25 us a layer at 8 tokens on the H200). Block b's 8
// warps take router rows 8b..8b+7, a warp a row (its words in registers before the wait), and
// "row" e the shared expert's gates sigmoid(x . w_sg), against the tokens' inputs x [t, d] bf16,
// staged ROUTE_SMALL_TOKENS at a time. The last block to finish (ticket, reset for the next
// launch) routes: a warp a token (route_topk_warp on its logits, read through L2, all of a row's
// loads in flight at once: the first version read them and w_sg in dependent trips, 15.7 us a
// call by Nsight Compute at 8 tokens); the counts in shared memory, scanned into each expert's
// first sorted row; row_expert[r] = the expert of sorted row r; the scatter as moe_scatter's
// (sorted_token, slot_row; the order within an expert not deterministic, each row's product is).
// grid ceil((e + 1) / 8), block 256, smem moe_route_small_smem(d, e) bytes.
#define ROUTE_SMALL_TOKENS 8
__host__ __device__ __forceinline__ int moe_route_small_smem(int d, int e) {
    const int stage = ROUTE_SMALL_TOKENS * d * 2, route = (8 * e + 2 * e + 8) * 4;
    return stage > route ? stage : route;
}
template <int VPL>
__device__ __forceinline__ void moe_route_small_impl(const bf16* x, int t, int d, const bf16* __restrict__ wr, int e,
                                                     int k, const float* __restrict__ w_sg, float* logits,
                                                     int* topk_ids, float* topk_w, float* __restrict__ sgate,
                                                     int* __restrict__ row_expert, int* __restrict__ sorted_token,
                                                     int* __restrict__ slot_row, unsigned* ticket, uint4* sm) {
    constexpr int NV = VPL > 0 ? VPL : 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = blockIdx.x * 8 + warp, kv = d >> 3;
    const uint4* wrow = row < e ? reinterpret_cast<const uint4*>(wr + (size_t)row * d) : nullptr;
    const bool gate = row == e;  // this warp computes the shared expert's gates
    uint4 v[NV];
    float4 g[VPL > 0 ? 2 * VPL : 1];
    if (VPL > 0) {
#pragma unroll
        for (int j = 0; j < NV; j++) v[j] = wrow ? __ldg(wrow + lane + 32 * j) : make_uint4(0, 0, 0, 0);
        if (gate)
#pragma unroll
            for (int j = 0; j < NV; j++) {
                g[2 * j] = __ldg(reinterpret_cast<const float4*>(w_sg) + 2 * (lane + 32 * j));
                g[2 * j + 1] = __ldg(reinterpret_cast<const float4*>(w_sg) + 2 * (lane + 32 * j) + 1);
            }
    }
    griddep_wait_plain();
    griddep_launch();
    for (int s0 = 0; s0 < t; s0 += ROUTE_SMALL_TOKENS) {
        const int n = min(ROUTE_SMALL_TOKENS, t - s0);
        __syncthreads();  // the previous group's reads of the stage are done
        // 8 words a thread in flight at once (a loop of dependent trips through L2 cost ~6 us)
        const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)s0 * d);
        for (int i0 = threadIdx.x; i0 < n * kv; i0 += 8 * blockDim.x) {
            uint4 w8[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int i = i0 + u * blockDim.x;
                w8[u] = i < n * kv ? src[i] : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (i0 + u * blockDim.x < n * kv) sm[i0 + u * blockDim.x] = w8[u];
        }
        __syncthreads();
        if (wrow || gate)
            for (int s = 0; s < n; s++) {
                const uint4* xr = sm + s * kv;
                float acc = 0.0f;
                if (VPL > 0 && gate) {
#pragma unroll
                    for (int j = 0; j < NV; j++) {
                        const X8 xv = unpack8(xr[lane + 32 * j]);
                        acc += xv.a.x * g[2 * j].x + xv.a.y * g[2 * j].y + xv.b.x * g[2 * j].z + xv.b.y * g[2 * j].w +
                               xv.c.x * g[2 * j + 1].x + xv.c.y * g[2 * j + 1].y + xv.d.x * g[2 * j + 1].z +
                               xv.d.y * g[2 * j + 1].w;
                    }
                } else if (gate) {
                    for (int c = lane; c < kv; c += 32) acc += dot8(xr[c], w_sg + 8 * c);
                } else if (VPL > 0) {
#pragma unroll
                    for (int j = 0; j < NV; j++) acc += dot8(v[j], unpack8(xr[lane + 32 * j]));
                } else {
                    for (int c = lane; c < kv; c += 32) acc += dot8(__ldg(wrow + c), unpack8(xr[c]));
                }
                acc = warp_sum(acc);
                if (lane == 0) {
                    if (gate) sgate[s0 + s] = sigmoid_f(acc);
                    else logits[(size_t)(s0 + s) * e + row] = acc;
                }
            }
    }
    if (!last_block_done(ticket)) return;
    float* rl = reinterpret_cast<float*>(sm) + warp * e;  // this warp's logits row
    int* cnt = reinterpret_cast<int*>(sm) + 8 * e;
    int* first = cnt + e;
    int* warp_total = first + e;
    for (int i = threadIdx.x; i < e; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int s = warp; s < t; s += 8) {
        // the row's first 256 logits loaded at once (one trip through L2, not eight)
        const float* ls = logits + (size_t)s * e;
        float lv[8];
#pragma unroll
        for (int m = 0; m < 8; m++) lv[m] = lane + 32 * m < e ? __ldcg(ls + lane + 32 * m) : 0.0f;
#pragma unroll
        for (int m = 0; m < 8; m++)
            if (lane + 32 * m < e) rl[lane + 32 * m] = lv[m];
        for (int i = lane + 256; i < e; i += 32) rl[i] = __ldcg(ls + i);
        __syncwarp();
        route_topk_warp(rl, e, k, topk_ids + s * k, topk_w + s * k);
        if (lane < k) atomicAdd(&cnt[topk_ids[s * k + lane]], 1);  // the id this lane wrote
        __syncwarp();  // rl is the next token's
    }
    __syncthreads();
    // Exclusive scan of the counts: thread i takes experts [q i, q i + q), q = ceil(e / 256).
    const int q = (e + blockDim.x - 1) / blockDim.x, x0 = threadIdx.x * q;
    int mine = 0;
    for (int x1 = x0; x1 < min(x0 + q, e); x1++) mine += cnt[x1];
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int off = incl - mine;
    for (int w = 0; w < warp; w++) off += warp_total[w];
    for (int x1 = x0; x1 < min(x0 + q, e); x1++) {
        first[x1] = off;
        for (int j = 0; j < cnt[x1]; j++) row_expert[off + j] = x1;
        off += cnt[x1];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < t * k; i += blockDim.x) {
        const int r = atomicAdd(&first[topk_ids[i]], 1);
        sorted_token[r] = i / k;
        slot_row[i] = r;
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_route_small(
    const bf16* x, int t, int d, const bf16* __restrict__ wr, int e, int k, const float* __restrict__ w_sg,
    float* logits, int* topk_ids, float* topk_w, float* __restrict__ sgate, int* __restrict__ row_expert,
    int* __restrict__ sorted_token, int* __restrict__ slot_row, unsigned* ticket) {
    extern __shared__ uint4 route_small_sm[];
    if (d == 2048)
        moe_route_small_impl<8>(x, t, d, wr, e, k, w_sg, logits, topk_ids, topk_w, sgate, row_expert, sorted_token,
                                slot_row, ticket, route_small_sm);
    else
        moe_route_small_impl<0>(x, t, d, wr, e, k, w_sg, logits, topk_ids, topk_w, sgate, row_expert, sorted_token,
                                slot_row, ticket, route_small_sm);
}

// One block, a thread per expert (e <= 1024, block e rounded up to 32): exclusive scans of the
// counts and of the tiles per expert, then each expert writes its own tiles. tiles: (expert,
// first row in sorted order, rows) for every tile_m rows of every expert.
extern "C" __global__ void moe_plan(const int* __restrict__ counts, int e, int tile_m,
                                    int* __restrict__ offsets, int* __restrict__ cursor,
                                    int* __restrict__ tile_expert, int* __restrict__ tile_row,
                                    int* __restrict__ tile_rows, int* __restrict__ num_tiles) {
    PREFILL_KERNEL();
    __shared__ int warp_rows[32], warp_tiles[32];
    const int x = threadIdx.x, lane = x & 31, warp = x >> 5;
    const int c = x < e ? counts[x] : 0, nt = (c + tile_m - 1) / tile_m;
    int rows = c, tiles = nt;  // inclusive scans within the warp, then over the warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int r = __shfl_up_sync(0xffffffffu, rows, o), t = __shfl_up_sync(0xffffffffu, tiles, o);
        if (lane >= o) rows += r, tiles += t;
    }
    if (lane == 31) warp_rows[warp] = rows, warp_tiles[warp] = tiles;
    __syncthreads();
    if (warp == 0) {
        const bool in = lane < (int)(blockDim.x >> 5);
        int wr = in ? warp_rows[lane] : 0, wt = in ? warp_tiles[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int r = __shfl_up_sync(0xffffffffu, wr, o), t = __shfl_up_sync(0xffffffffu, wt, o);
            if (lane >= o) wr += r, wt += t;
        }
        warp_rows[lane] = wr, warp_tiles[lane] = wt;
    }
    __syncthreads();
    const int off = (warp ? warp_rows[warp - 1] : 0) + rows - c;
    const int t0 = (warp ? warp_tiles[warp - 1] : 0) + tiles - nt;
    if (x >= e) return;
    offsets[x] = off;
    cursor[x] = off;
    for (int j = 0; j < nt; j++) {
        tile_expert[t0 + j] = x;
        tile_row[t0 + j] = off + j * tile_m;
        tile_rows[t0 + j] = min(tile_m, c - j * tile_m);
    }
    if (x == e - 1) {
        offsets[e] = off + c;
        *num_tiles = t0 + nt;
    }
}

// Thread per (token, slot): its row in expert-sorted order.
extern "C" __global__ void moe_scatter(const int* __restrict__ topk_ids, int n, int k, int* __restrict__ cursor,
                                       int* __restrict__ sorted_token, int* __restrict__ slot_row) {
    PREFILL_KERNEL();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int row = atomicAdd(&cursor[topk_ids[i]], 1);
    sorted_token[row] = i / k;
    slot_row[i] = row;
}

// Few-row path (batched decode steps, short prefill chunks): a GEMV per (token, slot) row, the
// rows in expert-sorted order (moe_scatter's), so that the tokens that chose one expert are
// neighbours in the grid and all but the first read its weight rows from L2. A block takes one
// row and a group of its expert's output features; each warp holds its weight rows in
// registers, loaded before the input is staged (per-lane sums in block_gemv's order). expert:
// the expert of each sorted row (moe_plan's tile_expert with tile_m 1). SWIGLU: w [E, 2 nf,
// kdim] (gate rows, then up rows), a warp per feature j (its gate and up rows), out bf16 act
// [rows, nf] = bf16(SiLU(g) * u); else w [E, nf, kdim], gemv_sorted_rows features a warp, out f32
// y [rows, nf]. Input of sorted row r: a[gather[r]] (gather null: a[r]), bf16 [*, kdim], kdim %
// 8 == 0. grid (rows, ceil(nf / gemv_sorted_features)), block 256, smem kdim bf16.
// (Tiles of 2 or 4 rows of one expert, each weight word taken against all of them, ran 8 and 16
// streams 2-4% slower on the H200: the L2 already serves the repeats, and the unpacked words
// cost registers.)
// Weight rows a warp: the gate and up rows of one feature (SWIGLU), else 8 rows of 512 (the down
// product) or 2 of any other width: 64 registers of 16-byte words in flight either way. A
// kernel's registers are the most any of its paths needs (4 rows of 2,048 in the down kernel's
// unused wide path held 168 a thread, one block an SM: 2.4 TB/s against gate/up's 3.9).
__host__ __device__ __forceinline__ constexpr int gemv_sorted_rows(bool swiglu, int kdim) {
    return swiglu ? 2 : kdim == 512 ? 8 : 2;
}
// Output features a block (8 warps).
__host__ __device__ __forceinline__ int gemv_sorted_features(bool swiglu, int kdim) {
    return 8 * (swiglu ? 1 : gemv_sorted_rows(false, kdim));
}
// FP8 (the _fp8 kernels): w e4m3 with its block scales sc [E, rows / 128, ceil(kdim / 128)] (an
// expert's rows % 128 == 0, kdim % 16 == 0), VPL words of 16 a lane; the same rows a warp.
template <int VPL, bool SWIGLU, bool FP8>
__device__ __forceinline__ void moe_gemv_sorted_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                                     const void* __restrict__ w, const float* __restrict__ sc,
                                                     void* __restrict__ out, const int* __restrict__ expert, int nf,
                                                     int kdim, uint4* xs) {
    constexpr int R = gemv_sorted_rows(SWIGLU, VPL * (FP8 ? 512 : 256)), NV = VPL > 0 ? VPL : 1;
    griddep_wait_plain();
    griddep_launch();
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int f0 = (blockIdx.y * 8 + warp) * (SWIGLU ? 1 : R);  // the warp's first feature
    const int ex = expert[r], per = (SWIGLU ? 2 : 1) * nf;     // the expert, its rows
    int row[R];                                                // the warp's rows in the expert's
#pragma unroll
    for (int q = 0; q < R; q++) {
        const int f = SWIGLU ? f0 : f0 + q;
        row[q] = f < nf ? (SWIGLU ? q * nf : 0) + f : -1;
    }
    const bf16* x = a + (size_t)(gather ? gather[r] : r) * kdim;
    float acc[R];
    if (FP8) {
        const int kw = kdim >> 4, kb = (kdim + 127) >> 7;
        const uint4* we = reinterpret_cast<const uint4*>(w) + (size_t)ex * per * kw;
        const float* se = sc + (size_t)ex * (per >> 7) * kb;
        const uint4* rows[R];
        const float* srows[R];
#pragma unroll
        for (int q = 0; q < R; q++) {
            rows[q] = row[q] >= 0 ? we + (size_t)row[q] * kw : nullptr;
            srows[q] = se + (size_t)(row[q] >> 7) * kb;
        }
        uint4 v[R][NV];
        float s[R][NV];
        if (VPL > 0) load_rows_fp8<R, NV>(v, s, rows, srows);
        stage_bf16(xs, x, kdim);
        if (VPL > 0) dot_rows_fp8<R, NV>(v, s, xs, acc);
        else dot_rows_fp8_any<R>(rows, srows, xs, kw, acc);
    } else {
        const bf16* we = reinterpret_cast<const bf16*>(w) + (size_t)ex * per * kdim;
        const bf16* rows[R];
#pragma unroll
        for (int q = 0; q < R; q++) rows[q] = row[q] >= 0 ? we + (size_t)row[q] * kdim : nullptr;
        uint4 v[R][NV];
        if (VPL > 0) load_rows<R, NV>(v, rows);
        stage_bf16(xs, x, kdim);
        if (VPL > 0) dot_rows<R, NV>(v, xs, acc);
        else dot_rows_any<R>(rows, xs, kdim, acc);
    }
    float s[R];
#pragma unroll
    for (int q = 0; q < R; q++) s[q] = warp_sum(acc[q]);
    if (SWIGLU) {
        if (lane == 0 && f0 < nf) reinterpret_cast<bf16*>(out)[(size_t)r * nf + f0] = __float2bfloat16(silu_f(s[0]) * s[1]);
    } else {
#pragma unroll
        for (int q = 0; q < R; q++)
            if (lane == q && f0 + q < nf) reinterpret_cast<float*>(out)[(size_t)r * nf + f0 + q] = s[q];
    }
}

#define MOE_GEMV_SORTED(NAME, SWIGLU)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16* __restrict__ a,                                 \
                                                           const int* __restrict__ gather,                             \
                                                           const bf16* __restrict__ w, void* __restrict__ out,          \
                                                           const int* __restrict__ expert, int nf, int kdim) {          \
        extern __shared__ uint4 gemv_xs[];                                                                             \
        if (kdim == 2048) moe_gemv_sorted_impl<8, SWIGLU, false>(a, gather, w, nullptr, out, expert, nf, kdim, gemv_xs); \
        else if (kdim == 512) moe_gemv_sorted_impl<2, SWIGLU, false>(a, gather, w, nullptr, out, expert, nf, kdim, gemv_xs); \
        else moe_gemv_sorted_impl<0, SWIGLU, false>(a, gather, w, nullptr, out, expert, nf, kdim, gemv_xs);           \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME##_fp8(                                                      \
        const bf16* __restrict__ a, const int* __restrict__ gather, const uint4* __restrict__ w,                       \
        const float* __restrict__ sc, void* __restrict__ out, const int* __restrict__ expert, int nf, int kdim) {       \
        extern __shared__ uint4 gemv_xs[];                                                                             \
        if (kdim == 2048) moe_gemv_sorted_impl<4, SWIGLU, true>(a, gather, w, sc, out, expert, nf, kdim, gemv_xs);     \
        else if (kdim == 512) moe_gemv_sorted_impl<1, SWIGLU, true>(a, gather, w, sc, out, expert, nf, kdim, gemv_xs); \
        else moe_gemv_sorted_impl<0, SWIGLU, true>(a, gather, w, sc, out, expert, nf, kdim, gemv_xs);                  \
    }
MOE_GEMV_SORTED(moe_gemv_sorted, false)
MOE_GEMV_SORTED(moe_gemv_sorted_swiglu, true)

// act[r, i] = SiLU(gu[r, i]) * gu[r, inter + i], bf16 out; gu: [rows, 2*inter].
extern "C" __global__ void swiglu_bf16(const float* __restrict__ gu, bf16* __restrict__ act, int rows, int inter) {
    size_t n = (size_t)rows * inter;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        size_t r = idx / inter, i = idx % inter;
        act[idx] = __float2bfloat16(silu_f(gu[r * 2 * inter + i]) * gu[r * 2 * inter + inter + i]);
    }
}

// y's row `row`, features [V c, V c + V): one 16-byte load, 4 f32 (V = 4) or 8 bf16 (V = 8, the
// down product's y from moe_gemm6_m128_bf16), kept raw until combine_fma so that the 8 rows'
// loads in flight cost 4 registers each.
template <int V>
__device__ __forceinline__ uint4 combine_load(const void* __restrict__ y, size_t row, int d, int c) {
    return __ldg(reinterpret_cast<const uint4*>(y) + row * (d / V) + c);
}
// acc[i] += w * y_i for the V features of a raw combine_load, y_i taken as bf16 (f32 values
// rounded first; bf16 y is already).
template <int V>
__device__ __forceinline__ void combine_fma(float (&acc)[V], float w, uint4 u) {
    const unsigned p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (V == 4) {
            acc[i] += w * __bfloat162float(__float2bfloat16(__uint_as_float(p[i])));
        } else {
            acc[2 * i] += w * __uint_as_float(p[i] << 16);
            acc[2 * i + 1] += w * __uint_as_float(p[i] & 0xffff0000u);
        }
    }
}

// Block per token: h[t] += sum_k w_k * y[slot_row[t,k]] + sgate[t] * ys[t] (sgate: moe_route's
// shared-expert gates; the routed experts' outputs y are taken as bf16, as transformers' experts
// return them and the decode step rounds them, whatever y's storage). A thread takes V
// features at a time (16-byte loads of y: V = 4 for f32 y, d % 4 == 0; V = 8 for bf16 y,
// d % 8 == 0) with up to 8 of its rows' loads issued together and no block barrier before them:
// the kernel streams y once and is bound by that, not by round trips. With norm_w, the next layer's input RMSNorm follows on the new row: xb[t] = bf16(h[t] /
// rms(h[t]) * (1 + norm_w)); for V = 4 the same sums in the same order as rmsnorm_zc_bf16 (which
// it replaces there), so one pass over h fewer a layer.
template <int V>
__device__ __forceinline__ void moe_combine_impl(const void* __restrict__ y, const int* __restrict__ slot_row,
                                                 const float* __restrict__ topk_w, const float* __restrict__ ys,
                                                 const float* __restrict__ sgate, float* __restrict__ h, int k, int d,
                                                 const float* __restrict__ norm_w, bf16* __restrict__ xb, float eps) {
    const int s = blockIdx.x, dv = d / V;
    const float gate = sgate[s];
    const float4* ys4 = reinterpret_cast<const float4*>(ys) + (size_t)s * (d / 4);
    float4* h4 = reinterpret_cast<float4*>(h) + (size_t)s * (d / 4);
    float ss = 0.0f;  // the new row's sum of squares, for the RMSNorm
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float acc[V];
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = 0.0f;
        for (int k0 = 0; k0 < k; k0 += 8) {
            uint4 v[8];
            float wv[8];
#pragma unroll
            for (int kk = 0; kk < 8; kk++)
                if (k0 + kk < k) {
                    const int i = s * k + k0 + kk;
                    v[kk] = combine_load<V>(y, (size_t)(slot_row ? slot_row[i] : i), d, c);  // null: rows unsorted
                    wv[kk] = topk_w[i];
                }
#pragma unroll
            for (int kk = 0; kk < 8; kk++)
                if (k0 + kk < k) combine_fma<V>(acc, wv[kk], v[kk]);
        }
#pragma unroll
        for (int j = 0; j < V / 4; j++) {
            const int c4 = c * (V / 4) + j;
            const float4 sh = ys4[c4];
            float4 hv = h4[c4];
            hv.x += acc[4 * j] + gate * sh.x, hv.y += acc[4 * j + 1] + gate * sh.y;
            hv.z += acc[4 * j + 2] + gate * sh.z, hv.w += acc[4 * j + 3] + gate * sh.w;
            h4[c4] = hv;
            ss += hv.x * hv.x + hv.y * hv.y + hv.z * hv.z + hv.w * hv.w;
        }
    }
    if (!norm_w) return;  // grid-uniform
    const float inv = rsqrtf(block_sum(ss) / d + eps);
    const float4* w4 = reinterpret_cast<const float4*>(norm_w);
    for (int c = threadIdx.x; c < dv; c += blockDim.x)  // the thread's own writes of h4
#pragma unroll
        for (int j = 0; j < V / 4; j++) {
            const int c4 = c * (V / 4) + j;
            const float4 v = h4[c4], g = w4[c4];
            reinterpret_cast<uint2*>(xb + (size_t)s * d)[c4] =
                make_uint2(pack_bf16x2(v.x * inv * (1.0f + g.x), v.y * inv * (1.0f + g.y)),
                           pack_bf16x2(v.z * inv * (1.0f + g.z), v.w * inv * (1.0f + g.w)));
        }
}

// Four blocks an SM at least (64 registers): at 128, two blocks kept too few of y's loads in
// flight (moe_combine_bf16 237 against moe_combine's 186 us at 8,192 tokens on the H200).
#define MOE_COMBINE(NAME, YT, V)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 4) NAME(                                                 \
        const YT* __restrict__ y, const int* __restrict__ slot_row, const float* __restrict__ topk_w,          \
        const float* __restrict__ ys, const float* __restrict__ sgate, float* __restrict__ h, int k, int d,    \
        const float* __restrict__ norm_w, bf16* __restrict__ xb, float eps) {                                  \
        PREFILL_KERNEL();                                                                                      \
        moe_combine_impl<V>(y, slot_row, topk_w, ys, sgate, h, k, d, norm_w, xb, eps);                         \
    }
MOE_COMBINE(moe_combine, float, 4)
MOE_COMBINE(moe_combine_bf16, bf16, 8)

// The few-row MoE for affine 4-bit experts (q4 tiles, gemv.cuh), on the tensor cores: the
// sorted rows of one expert go through its weights together, up to 8 at a time (the mma's token
// columns), so each expert's codes are read once per 8 of its rows. Block x = sorted row r leads
// a tile when r is the first of its expert's run or 8, 16, ... rows into it (other blocks
// return at once); the tile is its run's rows r .. r + 7. Block y takes SPB strips of 16
// features: SWIGLU the gate strip and the up strip of 16 features (w [E, 2 nf, kdim], out bf16
// act [rows, nf] = bf16(SiLU(g) * u)), else q4_strips(kdim / 512) strips of nf (w [E, nf,
// kdim], out f32 y [rows, nf]). Input of sorted row r: a[gather[r]] (gather null: a[r]), bf16
// [*, kdim]. nf % 16 == 0, kdim % 64 == 0. grid (rows, ceil(nf / (16 (SWIGLU ? 1 : SPB)))),
// block 256, smem q4_smem(8, kdim, group, false, 8 * 8 * 16 * SPB) bytes.
template <int NV, bool SWIGLU>
__device__ __forceinline__ void moe_gemv_sorted_q4_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                                        const uint4* __restrict__ w, const unsigned* __restrict__ sb,
                                                        int group, void* __restrict__ out,
                                                        const int* __restrict__ expert, int rows, int nf, int kdim,
                                                        float* smem) {
    constexpr int SPB = SWIGLU ? 2 : q4_strips(NV);
    griddep_wait_plain();
    griddep_launch();
    const int r = blockIdx.x, ex = expert[r];
    int run0 = r;
    while (run0 > 0 && expert[run0 - 1] == ex) run0--;
    if ((r - run0) & 7) return;
    int m = 1;
    while (m < 8 && r + m < rows && expert[r + m] == ex) m++;
    const int per = (SWIGLU ? 2 : 1) * nf, base = ex * per;  // the expert's first row
    int strip[SPB];
#pragma unroll
    for (int sp = 0; sp < SPB; sp++) {
        const int f = SWIGLU ? blockIdx.y * 16 + sp * nf : (blockIdx.y * SPB + sp) * 16;
        strip[sp] = (SWIGLU ? blockIdx.y * 16 < nf : f < nf) ? (base + f) / 16 : -1;
    }
    uint4 v[SPB][NV > 0 ? NV : 1];
    Q4Sb<(NV > 0 ? NV : 1)> sbr[SPB];
    q4_load<NV, SPB>(v, sbr, w, sb, group, strip, kdim);
    const int ldw = q4_ldw(m, kdim), nspan = kdim / q4_span(group);
    unsigned* xw = reinterpret_cast<unsigned*>(smem);
    float* xsum = smem + m * ldw;
    float* red = xsum + m * nspan;
    // the tile's rows: a[gather[r + t]], or (gather null) a[r + t]
    q4_stage_rows(xw, ldw, gather ? a : a + (size_t)r * kdim, gather ? gather + r : nullptr, m, kdim);
    q4_span_sums(xw, ldw, m, kdim, q4_span(group), xsum);
    q4_dot<NV, 1, SPB>(v, sbr, w, sb, group, strip, kdim, xw, ldw, m, xsum, red);
    q4_store_rows<SPB, SWIGLU>(red, strip, m, nf, blockIdx.y, r, out);
}
#define MOE_GEMV_SORTED_Q4(NAME, SWIGLU)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                           \
        const bf16* __restrict__ a, const int* __restrict__ gather, const uint4* __restrict__ w,                      \
        const unsigned* __restrict__ sb, int group, void* __restrict__ out, const int* __restrict__ expert, int rows, \
        int nf, int kdim) {                                                                                           \
        extern __shared__ float gemv_q4_sorted_xs[];                                                                  \
        if (kdim == 2048)                                                                                             \
            moe_gemv_sorted_q4_impl<4, SWIGLU>(a, gather, w, sb, group, out, expert, rows, nf, kdim, gemv_q4_sorted_xs); \
        else if (kdim == 512)                                                                                         \
            moe_gemv_sorted_q4_impl<1, SWIGLU>(a, gather, w, sb, group, out, expert, rows, nf, kdim, gemv_q4_sorted_xs); \
        else                                                                                                          \
            moe_gemv_sorted_q4_impl<0, SWIGLU>(a, gather, w, sb, group, out, expert, rows, nf, kdim, gemv_q4_sorted_xs); \
    }
MOE_GEMV_SORTED_Q4(moe_gemv_sorted_q4, false)
MOE_GEMV_SORTED_Q4(moe_gemv_sorted_swiglu_q4, true)
