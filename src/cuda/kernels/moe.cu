// Sparse MoE: routing (softmax over all experts, top-k renormalised), a device-side counting
// sort of (token, slot) pairs by expert, a grouped bf16 tensor-core GEMM over the selected
// experts only, SwiGLU, and the combine with the sigmoid-gated shared expert.

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

// Grouped GEMM: for each tile (expert x, rows r0..r0+rows of the sorted order) and a block of
// 64 output columns: C[row, n] = sum_k A[a_row(row), k] * W_x[n, k].
// A: bf16 [*, kdim] gathered through `gather` (or row = sorted row if gather is null);
// W: bf16 [E, ndim, kdim]; C: f32 [rows_total, ndim]. 4 warps, each a 32x32 quadrant.
#define TM 64
#define TN 64
#define TK 32
extern "C" __global__ void __launch_bounds__(128) moe_gemm(
    const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,
    float* __restrict__ c, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
    const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim) {
    PREFILL_KERNEL();
    using namespace nvcuda;
    int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    int x = tile_expert[tile], r0 = tile_row[tile], rows = tile_rows[tile];
    int n0 = blockIdx.y * TN;
    const bf16* wx = w + (size_t)x * ndim * kdim;
    __shared__ __align__(32) bf16 as[TM][TK + 8];
    __shared__ __align__(32) bf16 bs[TN][TK + 8];
    __shared__ __align__(32) float cs[TM][TN + 4];
    __shared__ int arow[TM];
    int tid = threadIdx.x, warp = tid >> 5;
    if (tid < TM) arow[tid] = tid < rows ? (gather ? gather[r0 + tid] : r0 + tid) : -1;
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    for (int k0 = 0; k0 < kdim; k0 += TK) {
        // 64 x 32 bf16 per operand = 256 vectors of 8; two per thread each (kdim % 8 == 0).
        for (int idx = tid; idx < TM * TK / 8; idx += 128) {
            int rr = idx / (TK / 8), kk = (idx % (TK / 8)) * 8;
            int ar = arow[rr];
            bool kin = k0 + kk < kdim;
            uint4 va = make_uint4(0, 0, 0, 0), vb = make_uint4(0, 0, 0, 0);
            if (ar >= 0 && kin) va = *reinterpret_cast<const uint4*>(a + (size_t)ar * kdim + k0 + kk);
            int nn = n0 + rr;
            if (nn < ndim && kin) vb = *reinterpret_cast<const uint4*>(wx + (size_t)nn * kdim + k0 + kk);
            *reinterpret_cast<uint4*>(&as[rr][kk]) = va;
            *reinterpret_cast<uint4*>(&bs[rr][kk]) = vb;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], &as[wm + i * 16][kk], TK + 8);
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], &bs[wn + j * 16][kk], TK + 8);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(&cs[wm + i * 16][wn + j * 16], acc[i][j], TN + 4, wmma::mem_row_major);
    __syncthreads();
    for (int idx = tid; idx < TM * TN; idx += 128) {
        int rr = idx / TN, nn = idx % TN;
        if (rr < rows && n0 + nn < ndim) c[(size_t)(r0 + rr) * ndim + n0 + nn] = cs[rr][nn];
    }
}

// Few-row path (short prefill chunks): a block = rows of one (token, slot) product.
// Row r = token * k + slot reads expert topk_ids[r] and input row (gather_by_k ? r / k : r)
// of a [*, kdim] bf16; y: f32 [rows, ndim]. grid (rows, ceil(ndim / (gemv_rows_per_block(kdim)))),
// block 256, smem kdim floats.
extern "C" __global__ void __launch_bounds__(256) moe_gemv(
    const bf16* __restrict__ a, int gather_by_k, const int* __restrict__ topk_ids, int k,
    const bf16* __restrict__ w, float* __restrict__ y, int ndim, int kdim) {
    extern __shared__ float xs[];
    int r = blockIdx.x;
    const bf16* x = a + (size_t)(gather_by_k ? r / k : r) * kdim;
    const bf16* wx = w + (size_t)topk_ids[r] * ndim * kdim;
    int row0 = blockIdx.y * gemv_rows_per_block(kdim);
    block_gemv(wx, ndim, kdim, row0, false, x, nullptr, nullptr, 0.0f, nullptr, xs, y + (size_t)r * ndim, 0.0f);
}

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

// Grouped GEMM, second version (KESTREL_MOE_GEMM=v2; v1 selects moe_gemm):
// 128x128 tiles, 8 warps of 64x32, K tiles of 32 double-buffered with cp.async (16-byte
// copies, zero-filled out of range). Same contract as moe_gemm, with the plan's tile_m = 128.
#define BM2 128
#define BN2 128
#define BK2 32
#define LDS2 (BK2 + 8)

extern "C" __global__ void __launch_bounds__(256) moe_gemm2(
    const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,
    float* __restrict__ c, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
    const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim) {
    PREFILL_KERNEL();
    using namespace nvcuda;
    int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    int x = tile_expert[tile], r0 = tile_row[tile], rows = tile_rows[tile];
    int n0 = blockIdx.y * BN2;
    const bf16* wx = w + (size_t)x * ndim * kdim;
    // [2][BM2][LDS2] of A then [2][BN2][LDS2] of B; reused as the epilogue's staging.
    __shared__ __align__(128) bf16 smem[2 * BM2 * LDS2 + 2 * BN2 * LDS2];
    __shared__ int arow[BM2];
    bf16* as = smem;
    bf16* bs = smem + 2 * BM2 * LDS2;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid < BM2) arow[tid] = tid < rows ? (gather ? gather[r0 + tid] : r0 + tid) : -1;
    __syncthreads();
    auto load = [&](int buf, int k0) {
#pragma unroll
        for (int q = 0; q < 2; q++) {
            int v = tid + q * 256;           // 512 vectors of 8 per operand tile
            int r = v >> 2, kk = (v & 3) * 8;
            bool kin = k0 + kk < kdim;
            int ar = arow[r];
            bool va = ar >= 0 && kin;
            cp_async16(as + (buf * BM2 + r) * LDS2 + kk, va ? a + (size_t)ar * kdim + k0 + kk : a, va);
            int nn = n0 + r;
            bool vb = nn < ndim && kin;
            cp_async16(bs + (buf * BN2 + r) * LDS2 + kk, vb ? wx + (size_t)nn * kdim + k0 + kk : wx, vb);
        }
        cp_async_commit();
    };
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    int nk = (kdim + BK2 - 1) / BK2;
    load(0, 0);
    for (int kt = 0; kt < nk; kt++) {
        if (kt + 1 < nk) {
            load((kt + 1) & 1, (kt + 1) * BK2);
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();
        const bf16* ab = as + (kt & 1) * BM2 * LDS2;
        const bf16* bb = bs + (kt & 1) * BN2 * LDS2;
#pragma unroll
        for (int kk = 0; kk < BK2; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[4];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 4; i++) wmma::load_matrix_sync(fa[i], ab + (wm + i * 16) * LDS2 + kk, LDS2);
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], bb + (wn + j * 16) * LDS2 + kk, LDS2);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
    // Epilogue: each warp stages one 16x16 fragment at a time (1.25 KiB per warp).
    float* stage = reinterpret_cast<float*>(smem) + warp * 16 * 20;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(stage, acc[i][j], 20, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                int rr = wm + i * 16 + (e >> 4), nn = n0 + wn + j * 16 + (e & 15);
                if (rr < rows && nn < ndim) c[(size_t)(r0 + rr) * ndim + nn] = stage[(e >> 4) * 20 + (e & 15)];
            }
            __syncwarp();
        }
}

// The grouped GEMMs' epilogue: a warp's MI x NJ accumulator tiles (rows wm.., columns wn..
// of the block tile at output column n0) stored for the tile's `rows` sorted rows from r0:
// SWIGLU: bf16 act = SiLU(gate) * up [rows, ndim / 2] (the first NJ / 2 column tiles hold the
// gate half, the rest the same up columns); else f32 C [rows, ndim].
template <int MI, int NJ, bool SWIGLU>
__device__ __forceinline__ void moe_tile_store(const float (&acc)[MI][NJ][4], void* __restrict__ out, int wm, int wn,
                                               int n0, int r0, int rows, int ndim, int lane) {
    const int g = lane >> 2, c2 = (lane & 3) * 2, inter = ndim / 2;
#pragma unroll
    for (int i = 0; i < MI; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int rr = wm + i * 16 + g + h * 8;
            if (rr >= rows) continue;
            size_t row = (size_t)(r0 + rr);
            if (SWIGLU) {
                bf16* act = reinterpret_cast<bf16*>(out);
#pragma unroll
                for (int j = 0; j < NJ / 2; j++) {
                    int col = n0 + (wn / 2) + j * 8 + c2;
                    const float* gt = acc[i][j] + 2 * h;
                    const float* up = acc[i][j + NJ / 2] + 2 * h;
#ifdef MOE_PROBE_NO_STORE  // diagnostic (timing only, outputs wrong): no epilogue stores
                    if (col < 0)
#else
                    if (col < inter)
#endif
                        *reinterpret_cast<unsigned*>(act + row * inter + col) =
                            pack_bf16x2(silu_f(gt[0]) * up[0], silu_f(gt[1]) * up[1]);
                }
            } else {
                float* c = reinterpret_cast<float*>(out);
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    int col = n0 + wn + j * 8 + c2;
                    if (col < ndim)
                        *reinterpret_cast<float2*>(c + row * ndim + col) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                }
            }
        }
    }
}

// A warp's 16 rows x 256 columns of a wgmma m64n256 accumulator stored as bf16 [*, ndim]
// (ndim % 8 == 0) with 16-byte stores. acc[j] holds columns 8j + 2q, +1 of rows g and g + 8 (q =
// lane & 3, g = lane >> 2), so a direct store writes 4 bytes a thread, 16 a row; instead the
// quad's four threads swap their bf16 pairs (a 4x4 transpose, three shuffles) until each holds 8
// consecutive columns, and one warp store writes 64 contiguous bytes of each of its 8 rows.
__device__ __forceinline__ void moe_tile_store_bf16(const float (&acc)[32][4], bf16* __restrict__ out, int wm, int n0,
                                                    int r0, int rows, int ndim, int lane) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = wm + g + 8 * h;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            unsigned w[4], r[4];
#pragma unroll
            for (int jj = 0; jj < 4; jj++) w[jj] = pack_bf16x2(acc[4 * m + jj][2 * h], acc[4 * m + jj][2 * h + 1]);
#pragma unroll
            for (int jj = 0; jj < 4; jj++) r[jj] = w[jj];  // r[q] = w[q] stays
            // Round s: lane q takes lane q ^ s's pair for column group q (that lane's w[q]) into
            // r[q ^ s], each lane sending its w[q ^ s].
#pragma unroll
            for (int s = 1; s < 4; s++) {
                const int i = q ^ s;
                const unsigned send = i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
                const unsigned got = __shfl_xor_sync(0xffffffffu, send, s);
#pragma unroll
                for (int jj = 0; jj < 4; jj++) r[jj] = jj == i ? got : r[jj];
            }
            const int col = n0 + 8 * (4 * m + q);
#ifdef MOE_PROBE_NO_STORE
            if (col < 0)
#else
            if (rr < rows && col < ndim)
#endif
                *reinterpret_cast<uint4*>(out + (size_t)(r0 + rr) * ndim + col) = make_uint4(r[0], r[1], r[2], r[3]);
        }
    }
}

// Grouped GEMM, third version (KESTREL_MOE_GEMM=v3; v2/v1 select the WMMA kernels):
// mma.sync m16n8k16 fed by ldmatrix, K tiles of 32 in a 4-stage cp.async pipeline (dynamic
// shared memory, rows padded to 80 bytes so the 8 rows of an ldmatrix hit distinct bank
// groups), 8 warps as 2 (M) x 4 (N), each a (BM/2) x (BN/4) sub-tile in registers.
// SWIGLU: the block's BN weight rows are BN/2 gate rows and the matching BN/2 up rows (each
// warp's columns: its gate half, then the same up columns), so act = bf16(SiLU(gate) * up) is
// formed in registers and written as bf16 [rows, ndim / 2]; otherwise C is f32 [rows, ndim].
#define G3_BK 32
#define G3_LDS 40
#define G3_STAGES 4

template <int BM, int BN, bool SWIGLU>
__device__ __forceinline__ void moe_gemm3_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                               const bf16* __restrict__ w, void* __restrict__ out,
                                               const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                                               const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,
                                               int ndim, int kdim) {
    constexpr int WM = BM / 2, WN = BN / 4, MI = WM / 16, NJ = WN / 8;
    constexpr int AV = BM / 64, BV = BN / 64;  // 16-byte vectors per thread per stage
    constexpr int STAGE = (BM + BN) * G3_LDS;  // bf16 elements
    extern __shared__ __align__(16) bf16 g3_smem[];
    int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    int x = tile_expert[tile], r0 = tile_row[tile], rows = tile_rows[tile];
    const bf16* wx = w + (size_t)x * ndim * kdim;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int inter = ndim / 2;
    int n0 = blockIdx.y * (SWIGLU ? BN / 2 : BN);
    // Each thread copies the same k column (kc) of rows tid / 4 + 64 q of both operands.
    int kc = (tid & 3) * 8, lr = tid >> 2;
    const bf16* asrc[AV];
    const bf16* bsrc[BV];
#pragma unroll
    for (int q = 0; q < AV; q++) {
        int r = lr + 64 * q;
        asrc[q] = r < rows ? a + (size_t)(gather ? gather[r0 + r] : r0 + r) * kdim + kc : nullptr;
    }
#pragma unroll
    for (int q = 0; q < BV; q++) {
        int r = lr + 64 * q, n;
        bool ok;
        if (SWIGLU) {
            int qq = r % WN, j = n0 + (r / WN) * (WN / 2) + qq % (WN / 2);
            n = qq < WN / 2 ? j : inter + j;
            ok = j < inter;
        } else {
            n = n0 + r;
            ok = n < ndim;
        }
        bsrc[q] = ok ? wx + (size_t)n * kdim + kc : nullptr;
    }
    int nk = (kdim + G3_BK - 1) / G3_BK;
    auto load = [&](int kt) {
        if (kt < nk) {
            bf16* sa = g3_smem + (kt % G3_STAGES) * STAGE + lr * G3_LDS + kc;
            bf16* sb = sa + BM * G3_LDS;
            int k0 = kt * G3_BK;
            bool kin = k0 + kc < kdim;
#pragma unroll
            for (int q = 0; q < AV; q++) {
                bool v = asrc[q] && kin;
                cp_async16(sa + 64 * q * G3_LDS, v ? asrc[q] + k0 : a, v);
            }
#pragma unroll
            for (int q = 0; q < BV; q++) {
                bool v = bsrc[q] && kin;
                cp_async16(sb + 64 * q * G3_LDS, v ? bsrc[q] + k0 : w, v);
            }
        }
        cp_async_commit();  // empty groups at the tail keep the wait count uniform
    };
    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    int wm = (warp >> 2) * WM, wn = (warp & 3) * WN;
    // ldmatrix row addresses: A, matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) of an m16 tile;
    // B, (n 0-7, k 0-7 | 8-15) then (n 8-15, ...) of an n16 pair.
    int a_off = (wm + (lane & 15)) * G3_LDS + (lane >> 4) * 8;
    int b_off = BM * G3_LDS + (wn + (lane & 7) + ((lane >> 4) << 3)) * G3_LDS + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int s = 0; s < G3_STAGES - 1; s++) load(s);
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<G3_STAGES - 2>();
        __syncthreads();  // stage kt landed for all; stage kt - 1 is free to refill
        load(kt + G3_STAGES - 1);
        const bf16* st = g3_smem + (kt % G3_STAGES) * STAGE;
#pragma unroll
        for (int kk = 0; kk < G3_BK; kk += 16) {
            unsigned af[MI][4], bfr[NJ / 2][4];
#pragma unroll
            for (int i = 0; i < MI; i++) ldsm_x4(af[i], st + a_off + i * 16 * G3_LDS + kk);
#pragma unroll
            for (int j = 0; j < NJ / 2; j++) ldsm_x4(bfr[j], st + b_off + j * 16 * G3_LDS + kk);
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
                    mma_bf16_16816(acc[i][j], af[i], bfr[j >> 1][(j & 1) * 2], bfr[j >> 1][(j & 1) * 2 + 1]);
        }
    }
    cp_async_wait_all();
    moe_tile_store<MI, NJ, SWIGLU>(acc, out, wm, wn, n0, r0, rows, ndim, lane);
}

// The four entry points: same arguments as moe_gemm2 (out: f32 C [rows, ndim], or for _swiglu
// bf16 act [rows, ndim / 2]); block 256; dynamic smem 4 * (BM + BN) * 80 bytes; plan tile_m = BM;
// grid (max tiles, ceil(out columns / (BN, or BN / 2 for _swiglu))). BM 128 / BN 128: 80 KiB;
// BM 64 / BN 256: 100 KiB.
#define MOE_GEMM3(NAME, BM, BN, SWIGLU)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                 \
        const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,                \
        void* __restrict__ out, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,         \
        const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim) {            \
        PREFILL_KERNEL();                                                                                      \
        moe_gemm3_impl<BM, BN, SWIGLU>(a, gather, w, out, tile_expert, tile_row, tile_rows, num_tiles, ndim, kdim); \
    }
MOE_GEMM3(moe_gemm3_m128, 128, 128, false)
MOE_GEMM3(moe_gemm3_m64, 64, 256, false)
MOE_GEMM3(moe_gemm3_swiglu_m128, 128, 128, true)
MOE_GEMM3(moe_gemm3_swiglu_m64, 64, 256, true)

// Grouped GEMM, fourth version (KESTREL_MOE_GEMM=v4; the default off sm_90a, and v5's 64-row
// tiles): moe_gemm3's contract and numerics (the same k16 mma steps in the same order: bitwise
// equal), with K tiles of 64 (half the barriers per K), rows unpadded and XOR-swizzled (16-byte
// chunk c of row r sits at chunk c ^ (r & 7), so both the cp.async writes and each 8-row
// ldmatrix phase hit 32 distinct banks), warp tiles of up to 64x64 (8 ldmatrix.x4 per 32 mma
// instead of 6 per 16) and fragments of the next k16 step loaded while the current one's mma
// issue. Grid (n blocks, tiles): a tile's n blocks are adjacent in launch order, so its gathered
// A rows are shared in L2.
#define G4_BK 64

// The operand copier of moe_gemm4, 5 and 6: T threads (tid 0..T-1) copy a tile's BM gathered A
// rows and BN B rows, 64 bf16 of K a stage, with 16-byte cp.async. Thread t copies chunk t % 8 of rows
// t / 8 + (T / 8) q; element offsets in registers (-1: outside the tile, zero-filled; the
// launcher keeps them below 2^31), stored XOR-swizzled (16-byte chunk c of row r at chunk
// c ^ (r & 7)). SWIGLU: B row group r / WN holds WN / 2 gate rows, then the same up rows.
template <int BM, int BN, int T, int WN, bool SWIGLU>
struct MoeStageCopier {
    static constexpr int RPP = T / 8, AV = BM / RPP, BV = BN / RPP;  // rows a pass, passes
    static_assert(RPP % 8 == 0 && BM % RPP == 0 && BN % RPP == 0, "copier shape");
    int aoff[AV], boff[BV], kc, dst;
    __device__ __forceinline__ MoeStageCopier(const int* __restrict__ gather, int r0, int rows, int n0, int ndim,
                                              int kdim, int tid) {
        const int lr = tid >> 3, inter = ndim / 2;
        kc = (tid & 7) * 8;
        dst = lr * G4_BK + ((kc >> 3) ^ (lr & 7)) * 8;  // RPP % 8 == 0: same swizzle every q
#pragma unroll
        for (int q = 0; q < AV; q++) {
            const int r = lr + RPP * q;
            aoff[q] = r < rows ? (gather ? gather[r0 + r] : r0 + r) * kdim + kc : -1;
        }
#pragma unroll
        for (int q = 0; q < BV; q++) {
            const int r = lr + RPP * q;
            int n;
            bool ok;
            if (SWIGLU) {
                const int qq = r % WN, j = n0 + (r / WN) * (WN / 2) + qq % (WN / 2);
                n = qq < WN / 2 ? j : inter + j;
                ok = j < inter;
            } else {
                n = n0 + r;
                ok = n < ndim;
            }
            boff[q] = ok ? n * kdim + kc : -1;
        }
    }
    // K tile kt into `stage` (A rows, then B rows); the caller commits.
    __device__ __forceinline__ void load(bf16* stage, int kt, const bf16* __restrict__ a, const bf16* __restrict__ w,
                                         const bf16* __restrict__ wx, int kdim) const {
        load_a(stage, kt, a, kdim);
        bf16* sb = stage + dst + BM * G4_BK;
        const int k0 = kt * G4_BK;
        const bool kin = k0 + kc < kdim;
#pragma unroll
        for (int q = 0; q < BV; q++) {
#ifdef MOE_PROBE_NO_B  // diagnostic (timing only, outputs wrong): B zero-filled, no weight reads
            const bool v = false;
#else
            const bool v = boff[q] >= 0 && kin;
#endif
            cp_async16(sb + RPP * q * G4_BK, v ? wx + boff[q] + k0 : w, v);
        }
    }
    // K tile kt of the A rows alone into the stage (moe_gemm7, whose B rows come by tensor copy).
    __device__ __forceinline__ void load_a(bf16* stage, int kt, const bf16* __restrict__ a, int kdim) const {
        bf16* sa = stage + dst;
        const int k0 = kt * G4_BK;
        const bool kin = k0 + kc < kdim;
#pragma unroll
        for (int q = 0; q < AV; q++) {
            const bool v = aoff[q] >= 0 && kin;
            cp_async16(sa + RPP * q * G4_BK, v ? a + aoff[q] + k0 : a, v);
        }
    }
};

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool SWIGLU>
__device__ __forceinline__ void moe_gemm4_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                               const bf16* __restrict__ w, void* __restrict__ out,
                                               const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                                               const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,
                                               int ndim, int kdim) {
    constexpr int T = 32 * WARPS_M * WARPS_N;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NJ = WN / 8;
    constexpr int STAGE = (BM + BN) * G4_BK;  // bf16 elements
    static_assert(NJ % 2 == 0 && WM % 16 == 0, "tile shape");
    extern __shared__ __align__(16) bf16 g4_smem[];
    int tile = blockIdx.y;
    if (tile >= *num_tiles) return;
    int x = tile_expert[tile], r0 = tile_row[tile], rows = tile_rows[tile];
    const bf16* wx = w + (size_t)x * ndim * kdim;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int n0 = blockIdx.x * (SWIGLU ? BN / 2 : BN);
    const MoeStageCopier<BM, BN, T, WN, SWIGLU> copier(gather, r0, rows, n0, ndim, kdim, threadIdx.x);
    const int nk = (kdim + G4_BK - 1) / G4_BK;
    auto load = [&](int kt) {
        if (kt < nk) copier.load(g4_smem + (kt % STAGES) * STAGE, kt, a, w, wx, kdim);
        cp_async_commit();  // empty groups at the tail keep the wait count uniform
    };
    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    // ldmatrix rows as moe_gemm3 (A: rows lane % 16, chunk lane / 16; B: n rows lane % 8 +
    // 8 (lane / 16), chunk (lane / 8) % 2). Fragments start on multiples of 8 rows, so every
    // lane's row swizzle is lane % 8.
    const int a_row = (wm + (lane & 15)) * G4_BK, a_ch = lane >> 4;
    const int b_row = (BM + wn + (lane & 7) + ((lane >> 4) << 3)) * G4_BK, b_ch = (lane >> 3) & 1;
    const int sx = lane & 7;
    unsigned af[2][MI][4], bfr[2][NJ / 2][4];
    auto frag = [&](const bf16* st, int ks, int buf) {  // k16 step ks (0..3) of stage st
        const bf16* pa = st + a_row + ((2 * ks + a_ch) ^ sx) * 8;
        const bf16* pb = st + b_row + ((2 * ks + b_ch) ^ sx) * 8;
#pragma unroll
        for (int i = 0; i < MI; i++) ldsm_x4(af[buf][i], pa + i * 16 * G4_BK);
#pragma unroll
        for (int j = 0; j < NJ / 2; j++) ldsm_x4(bfr[buf][j], pb + j * 16 * G4_BK);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) load(s);
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage kt landed for all; stage kt - 1 is free to refill
        load(kt + STAGES - 1);
        const bf16* st = g4_smem + (kt % STAGES) * STAGE;
        frag(st, 0, 0);
#pragma unroll
        for (int ks = 0; ks < G4_BK / 16; ks++) {
            if (ks + 1 < G4_BK / 16) frag(st, ks + 1, (ks + 1) & 1);
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
                    mma_bf16_16816(acc[i][j], af[ks & 1][i], bfr[ks & 1][j >> 1][(j & 1) * 2],
                                   bfr[ks & 1][j >> 1][(j & 1) * 2 + 1]);
        }
    }
    cp_async_wait_all();
    moe_tile_store<MI, NJ, SWIGLU>(acc, out, wm, wn, n0, r0, rows, ndim, lane);
}

// Entry points: moe_gemm3's arguments; block 32 * WARPS_M * WARPS_N; dynamic smem
// STAGES * (BM + BN) * 128 bytes; plan tile_m = BM; grid (n blocks, max tiles), n blocks =
// ceil(out columns / (BN, or BN / 2 for _swiglu)).
//   m128: 128x128, 4 warps of 64x64, 3 stages, 96 KiB, 2 blocks/SM
//   m64:  64x128, 4 warps of 32x64, 3 stages, 72 KiB, 3 blocks/SM
#define MOE_GEMM4(NAME, BM, BN, WMS, WNS, STAGES, MINB, SWIGLU)                                                   \
    extern "C" __global__ void __launch_bounds__(32 * WMS * WNS, MINB) NAME(                                     \
        const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,                \
        void* __restrict__ out, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,         \
        const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim) {            \
        PREFILL_KERNEL();                                                                                      \
        moe_gemm4_impl<BM, BN, WMS, WNS, STAGES, SWIGLU>(a, gather, w, out, tile_expert, tile_row, tile_rows,  \
                                                         num_tiles, ndim, kdim);                               \
    }
MOE_GEMM4(moe_gemm4_m128, 128, 128, 2, 2, 3, 2, false)
MOE_GEMM4(moe_gemm4_m64, 64, 128, 2, 2, 3, 3, false)
MOE_GEMM4(moe_gemm4_swiglu_m128, 128, 128, 2, 2, 3, 2, true)
MOE_GEMM4(moe_gemm4_swiglu_m64, 64, 128, 2, 2, 3, 3, true)

// Grouped GEMM, fifth version (sm_90a; KESTREL_MOE_GEMM=v5): moe_gemm4's 128-row contract on
// the Hopper tensor-core path. A block of two warpgroups computes a 128 x 256 tile, each
// warpgroup its 64 rows with wgmma m64n256k16 straight from shared memory (no ldmatrix, no
// fragment registers; the accumulators are the only per-thread state). Operands arrive through
// moe_gemm4's cp.async copies, whose swizzled 128-byte rows are wgmma's 128-byte swizzle layout,
// in G5_STAGES stages of 64-wide K: two stages in flight while one is multiplied and one is
// released. SWIGLU: the block's 256 B rows are 128 gate rows, then the same 128 up rows, so a
// thread holds each gate/up pair and writes act = bf16(SiLU(gate) * up) for 128 columns.
// Grid (ceil(out columns / (256, or 128 for SWIGLU)), max tiles), block 256, dynamic smem
// G5_STAGES * 48 KiB (1024-byte aligned: the swizzle is a function of the address).
#define G5_BM 128
#define G5_BN 256
#define G5_STAGES 4
template <bool SWIGLU>
__device__ __forceinline__ void moe_gemm5_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                               const bf16* __restrict__ w, void* __restrict__ out,
                                               const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                                               const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,
                                               int ndim, int kdim) {
    constexpr int STAGE = (G5_BM + G5_BN) * G4_BK;  // bf16 elements (48 KiB)
    extern __shared__ __align__(1024) bf16 g5_smem[];
    const int tile = blockIdx.y;
    if (tile >= *num_tiles) return;
    const int x = tile_expert[tile], r0 = tile_row[tile], rows = tile_rows[tile];
    const bf16* wx = w + (size_t)x * ndim * kdim;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
    const int n0 = blockIdx.x * (SWIGLU ? G5_BN / 2 : G5_BN);
    // moe_gemm4's copies; with SWIGLU the block's 256 B rows are one gate/up group.
    const MoeStageCopier<G5_BM, G5_BN, 256, G5_BN, SWIGLU> copier(gather, r0, rows, n0, ndim, kdim, threadIdx.x);
    const int nk = (kdim + G4_BK - 1) / G4_BK;
    auto load = [&](int kt) {
        if (kt < nk) copier.load(g5_smem + (kt % G5_STAGES) * STAGE, kt, a, w, wx, kdim);
        cp_async_commit();  // empty groups at the tail keep the wait count uniform
    };
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < G5_STAGES - 2; s++) load(s);
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<G5_STAGES - 3>();  // this thread's copies of stage kt landed
        fence_proxy_async();             // ... and are visible to wgmma's (async proxy) reads
        __syncthreads();  // everyone's; and both warpgroups retired stage kt - 2's wgmma
        load(kt + G5_STAGES - 2);        // into stage kt - 2's buffer
        const bf16* st = g5_smem + (kt % G5_STAGES) * STAGE;
        const unsigned long long da = wgmma_desc_sw128(st + wg * 64 * G4_BK);
        const unsigned long long db = wgmma_desc_sw128(st + G5_BM * G4_BK);
#pragma unroll
        for (int i = 0; i < 128; i++) wgmma_fence_operand(acc[i]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < G4_BK / 16; ks++)  // k16 step: 32 bytes along the swizzled rows
            wgmma_m64n256k16(acc, da + 2 * ks, db + 2 * ks, 1);
        wgmma_commit();
        wgmma_wait<1>();  // stage kt - 1's group retired; kt's runs on
#pragma unroll
        for (int i = 0; i < 128; i++) wgmma_fence_operand(acc[i]);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; i++) wgmma_fence_operand(acc[i]);
    cp_async_wait_all();
    moe_tile_store<1, 32, SWIGLU>(reinterpret_cast<const float(&)[1][32][4]>(acc), out, wg * 64 + (warp & 3) * 16, 0, n0,
                                  r0, rows, ndim, lane);
}

#define MOE_GEMM5(NAME, SWIGLU)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                                 \
        const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,                \
        void* __restrict__ out, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,         \
        const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim) {            \
        PREFILL_KERNEL();                                                                                      \
        moe_gemm5_impl<SWIGLU>(a, gather, w, out, tile_expert, tile_row, tile_rows, num_tiles, ndim, kdim);    \
    }
MOE_GEMM5(moe_gemm5_m128, false)
MOE_GEMM5(moe_gemm5_swiglu_m128, true)

// Grouped GEMM, sixth version (sm_90a; KESTREL_MOE_GEMM=v6): moe_gemm5's tiles and products
// (128 x 256 a tile; two consumer warpgroups of 64 rows each issue wgmma m64n256k16 from the
// swizzled stages, the same k16 steps in the same order: bitwise moe_gemm5's outputs),
// warp-specialised and persistent. Block 384: a producer warpgroup (setmaxnreg 120: its 24 copy
// offsets a thread spill below that) copies the K
// stages with cp.async into G6_STAGES buffers guarded by `full` / `empty` mbarriers, running
// up to G6_STAGES stages ahead across tile boundaries, so a tile's first stages land while the
// consumers (setmaxnreg 192) still store the previous one; nothing makes the two consumer
// warpgroups wait on each other. Grid: at most one block an SM, walking the work items q of
// nblk column blocks x *num_tiles tiles (q = tile * nblk + column block: a tile's column blocks
// run side by side and share its gathered A rows in L2) in increasing q, each block claiming
// its next item from the launch's counter `claim` (g6_next_item), since items differ in cost
// (an expert's last tile may hold a few rows) and a launch may share the SMs with another
// stream's (the shared expert's); against a fixed share per block it measured level on the
// H200 (docs/KERNELS.md, eighteenth session). Dynamic smem G6_SMEM (1024-byte aligned: the
// swizzle is a function of the address): the stages, their barriers, then the item hand-off
// (two slots).
#define G6_STAGES 4
#define G6_STAGE ((G5_BM + G5_BN) * G4_BK)  // bf16 elements of a stage (48 KiB)
#define G6_SMEM (G6_STAGES * G6_STAGE * 2 + 2 * G6_STAGES * 8 + 48)

// The block's n-th work item, or -1 when none is left: lane 0 of warp `leader` (the whole
// warp waits for the slot) claims it from `claim` (an i32 that is zero when the launch begins)
// and hands it to the block's other threads through slot n % 2 (`full` count 1, `empty` count:
// every thread of the block, so a slot is refilled only once all have read it). Each block
// makes exactly one claim past the items; the last of those (value items + gridDim.x - 1: every
// other claim came before it) sets the counter back to zero for the next launch. With
// MOE_G6_STATIC, block b takes b, b + gridDim.x, .. (the counter untouched).
__device__ __forceinline__ int g6_next_item(int* claim, int items, int* slot_q, unsigned long long* item_full,
                                            unsigned long long* item_empty, int n, bool leader) {
    const int slot = n & 1;
    if (leader && n >= 2) mbar_wait(&item_empty[slot], ((n >> 1) - 1) & 1);
    if (leader && (threadIdx.x & 31) == 0) {
#ifdef MOE_G6_STATIC
        int q = blockIdx.x + n * gridDim.x;
        if (q >= items) q = -1;
#else
        int q = atomicAdd(claim, 1);
        if (q >= items) {
            if (q == items + (int)gridDim.x - 1) *claim = 0;  // no block touches it again in this launch
            q = -1;
        }
#endif
        slot_q[slot] = q;
        mbar_arrive(&item_full[slot]);
    }
    mbar_wait(&item_full[slot], (n >> 1) & 1);
    const int q = slot_q[slot];
    mbar_arrive(&item_empty[slot]);
    return q;
}

// One landed K stage of a 128 x 256 tile (moe_gemm6, moe_gemm7): warpgroup wg's 64 A rows of the
// stage at `st` times its 256 B rows (after the 128 A rows) into acc, scale-d 0 at kt 0 (acc is
// never zeroed: a zeroing loop ptxas schedules inside a stage serializes every wgmma, C7513);
// returns once the previous stage's products retired. Descriptors and scale-d are pinned before
// the stage (C7513, as in attn_flash4).
__device__ __forceinline__ void moe_stage_products(float (&acc)[128], const bf16* st, int wg, int kt) {
    fence_proxy_async();  // the stage's cp.async copies visible to wgmma
    unsigned long long da = wgmma_desc_sw128(st + wg * 64 * G4_BK), db = wgmma_desc_sw128(st + G5_BM * G4_BK);
    unsigned accumulate = kt > 0;
    wgmma_fence_operand(da);
    wgmma_fence_operand(db);
    wgmma_fence_operand(accumulate);
#pragma unroll
    for (int i = 0; i < 128; i++) wgmma_fence_operand(acc[i]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < G4_BK / 16; ks++) wgmma_m64n256k16(acc, da + 2 * ks, db + 2 * ks, ks > 0 ? 1 : accumulate);
    wgmma_commit();
    wgmma_wait<1>();
#pragma unroll
    for (int i = 0; i < 128; i++) wgmma_fence_operand(acc[i]);
}
// The tile's last stage's products retired.
__device__ __forceinline__ void moe_stage_drain(float (&acc)[128]) {
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; i++) wgmma_fence_operand(acc[i]);
}
template <bool SWIGLU, bool Y16>
__device__ __forceinline__ void moe_gemm6_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                               const bf16* __restrict__ w, void* __restrict__ out,
                                               const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                                               const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,
                                               int ndim, int kdim, int nblk, int* __restrict__ claim) {
    extern __shared__ __align__(1024) bf16 g6_smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(g6_smem + G6_STAGES * G6_STAGE);
    unsigned long long* empty = full + G6_STAGES;
    unsigned long long* item_full = empty + G6_STAGES;  // [2]
    unsigned long long* item_empty = item_full + 2;     // [2]
    int* slot_q = reinterpret_cast<int*>(item_empty + 2);  // [2]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int items = nblk * *num_tiles, nk = (kdim + G4_BK - 1) / G4_BK;
    constexpr int COLS = SWIGLU ? G5_BN / 2 : G5_BN;  // output columns of a column block
    if (tid == 0) {
        for (int s = 0; s < G6_STAGES; s++) {
            mbar_init(&full[s], 128);   // every producer thread's cp.async arrival
            mbar_init(&empty[s], 256);  // every consumer thread, once its products of s retired
        }
        for (int s = 0; s < 2; s++) {
            mbar_init(&item_full[s], 1);
            mbar_init(&item_empty[s], 384);
        }
    }
    __syncthreads();
    // Stage use `it` (counted over all of this block's K steps) sits in buffer it % G6_STAGES;
    // its phase on either barrier is it / G6_STAGES.
    if (warp >= 8) {  // the producer
        setmaxnreg_dec<120>();
        unsigned it = 0;
        for (int n = 0;; n++) {
            const int q = g6_next_item(claim, items, slot_q, item_full, item_empty, n, warp == 8);
            if (q < 0) break;
            const int tile = q / nblk, n0 = (q % nblk) * COLS;
            const bf16* wx = w + (size_t)tile_expert[tile] * ndim * kdim;
            const MoeStageCopier<G5_BM, G5_BN, 128, G5_BN, SWIGLU> copier(gather, tile_row[tile], tile_rows[tile], n0,
                                                                          ndim, kdim, tid - 256);
            for (int kt = 0; kt < nk; kt++, it++) {
                const unsigned s = it % G6_STAGES;
                if (it >= G6_STAGES) mbar_wait(&empty[s], (it / G6_STAGES - 1) & 1);
                copier.load(g6_smem + s * G6_STAGE, kt, a, w, wx, kdim);
                cp_async_mbar_arrive(&full[s]);
            }
        }
        return;
    }
    setmaxnreg_inc<192>();
    // The warpgroup through a shuffle from lane 0 (warp-uniform to ptxas: uniform registers).
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    unsigned it = 0;
    // acc is never zeroed: a tile's first product overwrites it (scale-d 0); a zeroing loop
    // that ptxas schedules inside a wgmma stage serializes every wgmma of the kernel (C7513).
    float acc[128];
    for (int n = 0;; n++) {
        const int q = g6_next_item(claim, items, slot_q, item_full, item_empty, n, false);
        if (q < 0) break;
        const int tile = q / nblk, n0 = (q % nblk) * COLS;
        if (wg * 64 >= tile_rows[tile]) {
            // No rows of this warpgroup (an expert's last tile of <= 64 rows): it releases each
            // stage once it has landed (so its arrival counts toward this use, not the last),
            // and the other warpgroup's wgmma have the tensor cores to themselves.
            for (int kt = 0; kt < nk; kt++, it++) {
                const unsigned s = it % G6_STAGES;
                mbar_wait(&full[s], (it / G6_STAGES) & 1);
                mbar_arrive(&empty[s]);
            }
            continue;
        }
        for (int kt = 0; kt < nk; kt++, it++) {
            const unsigned s = it % G6_STAGES;
            mbar_wait(&full[s], (it / G6_STAGES) & 1);  // the producer's copies of this stage landed
            moe_stage_products(acc, g6_smem + s * G6_STAGE, wg, kt);
            if (kt > 0) mbar_arrive(&empty[(it - 1) % G6_STAGES]);
        }
        moe_stage_drain(acc);
        mbar_arrive(&empty[(it - 1) % G6_STAGES]);
        if (Y16)
            moe_tile_store_bf16(reinterpret_cast<const float(&)[32][4]>(acc), reinterpret_cast<bf16*>(out),
                                wg * 64 + (warp & 3) * 16, n0, tile_row[tile], tile_rows[tile], ndim, lane);
        else
            moe_tile_store<1, 32, SWIGLU>(reinterpret_cast<const float(&)[1][32][4]>(acc), out, wg * 64 + (warp & 3) * 16,
                                          0, n0, tile_row[tile], tile_rows[tile], ndim, lane);
    }
}

// _bf16: the output as bf16 (moe_tile_store_bf16; ndim % 8 == 0), for the down product's y.
#define MOE_GEMM6(NAME, SWIGLU, Y16)                                                                            \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                 \
        const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,                \
        void* __restrict__ out, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,         \
        const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim, int nblk,    \
        int* __restrict__ claim) {                                                                             \
        PREFILL_KERNEL();                                                                                      \
        moe_gemm6_impl<SWIGLU, Y16>(a, gather, w, out, tile_expert, tile_row, tile_rows, num_tiles, ndim, kdim,   \
                                    nblk, claim);                                                              \
    }
MOE_GEMM6(moe_gemm6_m128, false, false)
MOE_GEMM6(moe_gemm6_m128_bf16, false, true)
MOE_GEMM6(moe_gemm6_swiglu_m128, true, false)

// Grouped GEMM, seventh version (sm_90a; 256-row plan tiles, V7, opt-in): moe_gemm6's stages,
// products and epilogues (bitwise its outputs) in clusters of two blocks that share the B rows.
// Built on the reading that moe_gemm6 is bound by what streams from L2, and measured slower than
// it on the H200 (docs/KERNELS.md, seventeenth session). Of a 128 x 256 tile's 48 KiB stage two
// thirds are B rows, the same for every row tile of an expert: here block r of a cluster takes rows
// 128 r .. 128 r + 127 of a 256-row tile and copies only its half of each stage's B rows (the
// gate rows, or the up rows for SWIGLU; else columns 128 r ..) with one tensor copy multicast
// into both blocks' shared memory, so each B byte leaves L2 once per 256 rows, not per 128. A
// rows stay on the producer warpgroup's cp.async (they are gathered). A stage's `full` counts the
// 128 producer threads' cp.async arrivals and one expect_tx arrival for the 32 KiB of B from
// both blocks; its `empty` counts this block's 256 consumer threads and one arrival from each
// warp of the other block's consumers (its tensor copy writes this block's stage too). The two
// blocks walk the same (tile, column block) items in the same order, cluster c taking items c,
// c + clusters, ..; a block without rows in a tile (its half of an expert's last tile) still
// copies its B half and releases the stages. Block 384, cluster 2, grid 2 x clusters, dynamic
// smem G6_SMEM; `tmap`: a 2-D tensor map over w as [E * ndim rows][kdim] bf16 with 128 x 64
// boxes in the 128-byte swizzle (kdim % 8 == 0).
// PAIR false (the _m128 kernels): no cluster; 128-row plan tiles as moe_gemm6, whose B rows
// the block copies whole by two tensor copies of its own (the producer threads copy A only).
template <bool SWIGLU, bool Y16, bool PAIR>
__device__ __forceinline__ void moe_gemm7_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                               const void* __restrict__ tmap, void* __restrict__ out,
                                               const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                                               const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,
                                               int ndim, int kdim, int nblk) {
    extern __shared__ __align__(1024) bf16 g7_smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(g7_smem + G6_STAGES * G6_STAGE);
    unsigned long long* empty = full + G6_STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned rank = PAIR ? cluster_ctarank() : 0u, peer = rank ^ 1u;
    const int items = nblk * *num_tiles, nk = (kdim + G4_BK - 1) / G4_BK;
    const int cluster = PAIR ? blockIdx.x >> 1 : blockIdx.x, clusters = PAIR ? gridDim.x >> 1 : gridDim.x;
    constexpr int COLS = SWIGLU ? G5_BN / 2 : G5_BN;
    if (tid == 0) {
        for (int s = 0; s < G6_STAGES; s++) {
            mbar_init(&full[s], 128 + 1);  // the producer threads' cp.async, the expect_tx
            mbar_init(&empty[s], PAIR ? 256 + 8 : 256);  // this block's consumer threads, the peer's warps
        }
    }
    __syncthreads();
    if (PAIR) cluster_sync();  // both blocks' barriers initialised before either block's copies signal them
    // This block's rows of the tile's 256 (none when the tile has <= 128 and rank is 1).
    auto my_rows = [&](int tile) { return max(0, min(128, tile_rows[tile] - 128 * (int)rank)); };
    if (warp >= 8) {  // the producer
        setmaxnreg_dec<120>();
        unsigned it = 0;
        for (int q = cluster; q < items; q += clusters) {
            const int tile = q / nblk, n0 = (q % nblk) * COLS, x = tile_expert[tile];
            // This block's B half: gate rows n0.. (rank 0) or up rows inter + n0.. (rank 1) for
            // SWIGLU, else rows n0 + 128 rank ..; rows of expert x are x * ndim + n.
            const int brow = x * ndim + (SWIGLU ? (rank ? ndim / 2 : 0) + n0 : n0 + 128 * (int)rank);
            const MoeStageCopier<G5_BM, G5_BN, 128, G5_BN, SWIGLU> copier(
                gather, tile_row[tile] + 128 * (int)rank, my_rows(tile), n0, ndim, kdim, tid - 256);
            for (int kt = 0; kt < nk; kt++, it++) {
                const unsigned s = it % G6_STAGES;
                if (it >= G6_STAGES) mbar_wait(&empty[s], (it / G6_STAGES - 1) & 1);
                bf16* st = g7_smem + s * G6_STAGE;
                copier.load_a(st, kt, a, kdim);
                cp_async_mbar_arrive(&full[s]);
                if (tid == 256) {
                    mbar_arrive_expect_tx(&full[s], G5_BN * G4_BK * 2);
                    if (PAIR) {
                        tma_load_2d_mc(st + (G5_BM + 128 * rank) * G4_BK, tmap, kt * G4_BK, brow, &full[s], 3);
                    } else {  // both halves (rank 1's rows as the pair's second block takes them)
                        const int brow1 = x * ndim + (SWIGLU ? ndim / 2 + n0 : n0 + 128);
                        tma_load_2d(st + G5_BM * G4_BK, tmap, kt * G4_BK, brow, &full[s]);
                        tma_load_2d(st + (G5_BM + 128) * G4_BK, tmap, kt * G4_BK, brow1, &full[s]);
                    }
                }
            }
        }
    } else {
        setmaxnreg_inc<192>();
        const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
        unsigned it = 0;
        float acc[128];  // never zeroed: an item's first product has scale-d 0 (moe_gemm6)
        // Releases stage use `u`: this block's consumer threads, and one arrival a warp on the peer.
        auto release = [&](unsigned u) {
            mbar_arrive(&empty[u % G6_STAGES]);
            if (PAIR) {
                __syncwarp();
                if (lane == 0) mbar_arrive_remote(&empty[u % G6_STAGES], peer);
            }
        };
        for (int q = cluster; q < items; q += clusters) {
            const int tile = q / nblk, n0 = (q % nblk) * COLS, rows = my_rows(tile);
            if (wg * 64 >= rows) {  // no rows of this warpgroup: release each stage once landed
                for (int kt = 0; kt < nk; kt++, it++) {
                    mbar_wait(&full[it % G6_STAGES], (it / G6_STAGES) & 1);
                    release(it);
                }
                continue;
            }
            for (int kt = 0; kt < nk; kt++, it++) {
                const unsigned s = it % G6_STAGES;
                mbar_wait(&full[s], (it / G6_STAGES) & 1);
                moe_stage_products(acc, g7_smem + s * G6_STAGE, wg, kt);
                if (kt > 0) release(it - 1);
            }
            moe_stage_drain(acc);
            release(it - 1);
            const int r0 = tile_row[tile] + 128 * (int)rank;
            if (Y16)
                moe_tile_store_bf16(reinterpret_cast<const float(&)[32][4]>(acc), reinterpret_cast<bf16*>(out),
                                    wg * 64 + (warp & 3) * 16, n0, r0, rows, ndim, lane);
            else
                moe_tile_store<1, 32, SWIGLU>(reinterpret_cast<const float(&)[1][32][4]>(acc), out,
                                              wg * 64 + (warp & 3) * 16, 0, n0, r0, rows, ndim, lane);
        }
    }
    // Neither block leaves while the other may still copy into its shared memory or arrive on
    // its barriers.
    if (PAIR) cluster_sync();
}

#define MOE_GEMM7(NAME, SWIGLU, Y16, PAIR)                                                                      \
    extern "C" __global__ void __cluster_dims__((PAIR) ? 2 : 1, 1, 1) __launch_bounds__(384, 1) NAME(          \
        const bf16* __restrict__ a, const int* __restrict__ gather, const void* __restrict__ tmap,             \
        void* __restrict__ out, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,         \
        const int* __restrict__ tile_rows, const int* __restrict__ num_tiles, int ndim, int kdim, int nblk) {  \
        PREFILL_KERNEL();                                                                                      \
        moe_gemm7_impl<SWIGLU, Y16, PAIR>(a, gather, tmap, out, tile_expert, tile_row, tile_rows, num_tiles,      \
                                          ndim, kdim, nblk);                                                   \
    }
MOE_GEMM7(moe_gemm7_m256, false, false, true)
MOE_GEMM7(moe_gemm7_m256_bf16, false, true, true)
MOE_GEMM7(moe_gemm7_swiglu_m256, true, false, true)
MOE_GEMM7(moe_gemm7_m128, false, false, false)
MOE_GEMM7(moe_gemm7_m128_bf16, false, true, false)
MOE_GEMM7(moe_gemm7_swiglu_m128, true, false, false)

// ---- Decode (one token): three launches for the whole MoE block ----

// Router: logits = W_r . x with x the post-attention RMSNorm of h (block 0 stores x as bf16 for
// the experts). The router is only 1 MB, so its time is latency: ROUTER_ROWS rows per block with
// the 256 threads splitting k spreads it over ~e/2 blocks, all loads issued before the input is
// staged. The extra last block computes the shared-expert gate sigmoid(x . w_sg). The top-k is
// left to moe_gate_up_dec's warps (each picks it from the logits: no last-block ticket here).
// The RMSNorm weight and the shared gate's row are copied into shared memory before the wait.
// grid ceil(e / ROUTER_ROWS) + 1, block 256, smem router_smem floats.
#define ROUTER_ROWS 2
// Shared memory of moe_router_dec in floats: the input, the RMSNorm weight and the shared
// gate's row (d each). The host computes the same.
__host__ __device__ __forceinline__ int router_smem(int d) { return 3 * d; }
extern "C" __global__ void __launch_bounds__(256) moe_router_dec(
    const float* __restrict__ h, const float* __restrict__ nw, float eps, int d, const bf16* __restrict__ wr, int e,
    const float* __restrict__ w_sg, bf16* __restrict__ xb, float* __restrict__ logits, float* __restrict__ sgate) {
    DECODE_KERNEL(TAG_ROUTER);
    extern __shared__ float xs[];
    __shared__ float part[8][ROUTER_ROWS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* ws = xs + d;  // the RMSNorm weight, then the shared gate's row
    uint4* xv = reinterpret_cast<uint4*>(xs);  // the input as bf16
    if (blockIdx.x + 1 < gridDim.x) {
        const int r0 = blockIdx.x * ROUTER_ROWS, nv = d >> 3;
        const uint4* rows[ROUTER_ROWS];
        uint4 w[ROUTER_ROWS];
#pragma unroll
        for (int q = 0; q < ROUTER_ROWS; q++) {
            rows[q] = r0 + q < e ? reinterpret_cast<const uint4*>(wr + (size_t)(r0 + q) * d) : nullptr;
            w[q] = rows[q] && tid < nv ? __ldg(rows[q] + tid) : make_uint4(0, 0, 0, 0);
        }
        const float* wn = preload_norm(ws, nw, d);
        griddep_wait();
        stage_rmsnorm(xv, h, nw, d, eps, blockIdx.x == 0 ? xb : nullptr, wn);
        TRACE_PHASE(0);  // the timeline's phases: input staged, block's sums met
        float acc[ROUTER_ROWS];
        const X8 x0 = unpack8(tid < nv ? xv[tid] : make_uint4(0, 0, 0, 0));
#pragma unroll
        for (int q = 0; q < ROUTER_ROWS; q++) {
            acc[q] = tid < nv ? dot8(w[q], x0) : 0.0f;
            for (int c = tid + 256; c < nv; c += 256)  // d > 2048 only
                if (rows[q]) acc[q] += dot8(__ldg(rows[q] + c), unpack8(xv[c]));
            float a = warp_sum(acc[q]);
            if (lane == 0) part[warp][q] = a;
        }
        __syncthreads();
        TRACE_PHASE(1);
        if (tid < ROUTER_ROWS && r0 + tid < e) {
            float t = 0.0f;
            for (int i = 0; i < 8; i++) t += part[i][tid];
            logits[r0 + tid] = t;
        }
    } else {
        const float* wn = preload_norm(ws, nw, d);
        const float* wg = preload_norm(ws + d, w_sg, d);
        griddep_wait();
        stage_rmsnorm(xv, h, nw, d, eps, nullptr, wn);  // waits for both copies
        const bf16* xh = reinterpret_cast<const bf16*>(xv);
        float dot = 0.0f;
        for (int i = tid; i < d; i += blockDim.x) dot += __bfloat162float(xh[i]) * (wg ? wg[i] : w_sg[i]);
        dot = block_sum(dot);
        if (tid == 0) *sgate = sigmoid_f(dot);
    }
}

// Gate/up half of the k chosen experts and the shared expert (slot k): act[s, j] =
// bf16(SiLU(gate_j . x) * (up_j . x)), reading only those experts' rows; a warp per j (its gate
// and up rows loaded before x is staged). Each warp of a routed block picks the top-k itself
// from the router's logits (route_topk_warp on its own copy in shared memory: no block barrier,
// and no last-block ticket in the router); block (0, 1) also stores the ids and weights for
// moe_down_dec. grid (ceil(max(inter, s_inter) / 8), k + 1), block 256, smem
// gate_up_dec_smem(d, e, k) floats: x, then per warp e logits, k ids and k weights.
// logits is not __restrict__: a read-only (ld.global.nc) load of it may be hoisted above
// griddep_wait, and the router writes it in the same step.
__host__ __device__ __forceinline__ int gate_up_dec_smem(int d, int e, int k) { return d + 8 * ((e + 2 * k + 3) & ~3); }
// late_launch: let moe_down_dec start only once every block has passed its griddep_wait, so that
// the router has finished when any of moe_down_dec's blocks runs (it picks the experts from the
// logits before its own wait).
template <int VPL>
__device__ __forceinline__ void moe_gate_up_dec_impl(const bf16* __restrict__ xb, int d, const float* logits, int e,
                                                     int k, int* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                     const bf16* __restrict__ gate_up, int inter,
                                                     const bf16* __restrict__ shared_gate_up, int s_inter,
                                                     float* __restrict__ act, int act_ld, float* xs, int late_launch) {
    DECODE_KERNEL_NO_LAUNCH(TAG_GATE_UP);
    if (!late_launch) griddep_launch();
    // blockIdx.y 0 is the shared expert (slot k), whose blocks are dispatched first: its rows
    // are known before the router finishes, so those blocks load them before waiting.
    const int slot = blockIdx.y == 0 ? k : blockIdx.y - 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool shared = slot == k;
    int expert = 0;
    if (!shared) {
        griddep_wait();  // the logits come from the router
        if (late_launch) griddep_launch();
        float* rl = xs + d + warp * ((e + 2 * k + 3) & ~3);
        int* ids = reinterpret_cast<int*>(rl + e);
        float* wts = rl + e + k;
        for (int i = lane; i < e; i += 32) rl[i] = logits[i];
        __syncwarp();
        route_topk_warp(rl, e, k, ids, wts);
        __syncwarp();  // lanes < k wrote the choices
        expert = ids[slot];
        if (blockIdx.x == 0 && blockIdx.y == 1 && warp == 0 && lane < k) {
            topk_ids[lane] = ids[lane];
            topk_w[lane] = wts[lane];
        }
    }
    int n = shared ? s_inter : inter;
    const bf16* w = shared ? shared_gate_up : gate_up + (size_t)expert * 2 * inter * d;
    int j = blockIdx.x * 8 + warp;
    const bf16* rows[2] = {j < n ? w + (size_t)j * d : nullptr, j < n ? w + (size_t)(n + j) * d : nullptr};
    constexpr int NV = VPL > 0 ? VPL : 1;
    uint4 v[2][NV];
    if (VPL > 0) load_rows<2, NV>(v, rows);
    if (shared) {
        griddep_wait();  // xb, the normalised input, comes from the router too
        if (late_launch) griddep_launch();
    }
    stage_bf16(reinterpret_cast<uint4*>(xs), xb, d);
    float acc[2];
    if (VPL > 0) dot_rows<2, NV>(v, reinterpret_cast<const uint4*>(xs), acc);
    else dot_rows_any<2>(rows, reinterpret_cast<const uint4*>(xs), d, acc);
    float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
    if (lane == 0 && j < n) act[(size_t)slot * act_ld + j] = __bfloat162float(__float2bfloat16(silu_f(g) * u));
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up_dec(
    const bf16* __restrict__ xb, int d, const float* logits, int e, int k, int* __restrict__ topk_ids,
    float* __restrict__ topk_w, const bf16* __restrict__ gate_up, int inter, const bf16* __restrict__ shared_gate_up,
    int s_inter, float* __restrict__ act, int act_ld, int late_launch) {
    extern __shared__ float xs[];
    if (d == 2048)
        moe_gate_up_dec_impl<8>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, inter, shared_gate_up, s_inter, act,
                                act_ld, xs, late_launch);
    else
        moe_gate_up_dec_impl<0>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, inter, shared_gate_up, s_inter, act,
                                act_ld, xs, late_launch);
}

// Down half + combine + residual: h[r] += sum_s w_s * down_s[r, :] . act_s + sgate *
// shared_down[r, :] . act_k. Warp s = slot s (k routed, then the shared expert) over the block's
// 4 rows, its weight rows in flight at once; the slots' sums meet in shared memory.
// early: the block picks the experts itself from the router's logits (warp 0, route_topk_warp,
// the same choice as moe_gate_up_dec's) and loads its weight rows before griddep_wait, so they
// stream during moe_gate_up_dec's tail. That needs the router finished before this grid starts:
// moe_gate_up_dec launched with late_launch lets this grid start only after all its blocks
// passed their own wait on the router; and the logits are read through L2 (ld.global.cg), not
// an L1 line an earlier layer's read may have left. Else the ids come from topk_ids after the
// wait (reading them before it raced: moe_gate_up_dec let this grid start before the router
// had finished). act and sgate are not __restrict__: ptxas hoisted read-only loads of them above
// the wait (SASS). grid ceil(d / 4), block 32 * (k + 1), smem (early) down_dec_smem bytes: the
// logits, ids and weights, then (inter = s_inter = 512) the block's weight rows.
// early = 2 (sm_90): each warp's 4 rows (contiguous) come as one bulk copy completing on the
// warp's mbarrier (after the stages), not 8 cp.async a lane: the SM's load path stays free for
// the activations' loads after the wait.
__host__ __device__ __forceinline__ int down_dec_smem(int e, int k, int inter, int s_inter, int early) {
    return early ? ((e + 2 * k + 3) & ~3) * 4 +
                       (inter == 512 && s_inter == 512 ? (k + 1) * (4 * 2 * 32 * 16 + 8) : 0)
                 : 0;
}
template <int VPL>
__device__ __forceinline__ void moe_down_dec_impl(const float* act, int act_ld,
                                                  const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
                                                  const float* logits, int e, int early, int k,
                                                  const float* sgate,
                                                  const bf16* __restrict__ down, int inter,
                                                  const bf16* __restrict__ shared_down, int s_inter,
                                                  float* __restrict__ h, int d) {
    constexpr int NV = VPL > 0 ? VPL : 1;
    __shared__ float red[17][4];
    extern __shared__ float rl[];  // early: e logits, k ids, k weights
    DECODE_KERNEL(TAG_DOWN);
    int s = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * 4;
    int* ids = reinterpret_cast<int*>(rl + e);
    float* wts = rl + e + k;
    if (early) {
        if (s == 0) {
            for (int i = lane; i < e; i += 32) rl[i] = __ldcg(logits + i);
            __syncwarp();
            route_topk_warp(rl, e, k, ids, wts);
        }
        __syncthreads();
    } else {
        griddep_wait();
    }
    int kk = s == k ? s_inter : inter;
    const bf16* base = s == k ? shared_down : down + (size_t)(early ? ids[s] : topk_ids[s]) * d * inter;
    const bf16* rows[4];
#pragma unroll
    for (int q = 0; q < 4; q++) rows[q] = r0 + q < d ? base + (size_t)(r0 + q) * kk : nullptr;
    const float* xs = act + (size_t)s * act_ld;
    float acc[4];
    if (VPL > 0 && early) {
        // The rows go to shared memory by cp.async: ptxas sinks plain read-only loads whose
        // values are used only after griddep_wait to after it (seen in the SASS), which would
        // put their trip to DRAM back on the critical path.
        uint4* stages = reinterpret_cast<uint4*>(rl + ((e + 2 * k + 3) & ~3));
        uint4* stage = stages + (size_t)s * 4 * NV * 32;
        if (early == 2) {
            unsigned long long* bar = reinterpret_cast<unsigned long long*>(stages + (size_t)(k + 1) * 4 * NV * 32) + s;
            if (lane == 0) {
                const unsigned bytes = (unsigned)(d - r0 < 4 ? d - r0 : 4) * NV * 512;  // rows[0] exists: r0 < d
                mbar_init(bar, 1);
                fence_proxy_async();  // the initialised barrier visible to the copy engine
                mbar_arrive_expect_tx(bar, bytes);
                bulk_load(stage, rows[0], bytes, bar);
            }
            __syncwarp();
            griddep_wait();  // act and sgate come from the previous kernels
            mbar_wait(bar, 0);
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++)
#pragma unroll
                for (int j = 0; j < NV; j++)
                    cp_async16(stage + (q * NV + j) * 32 + lane,
                               rows[q] ? reinterpret_cast<const uint4*>(rows[q]) + lane + 32 * j : (const uint4*)base,
                               rows[q] != nullptr);
            cp_async_commit();
            griddep_wait();  // act and sgate come from the previous kernels
            cp_async_wait_all();
        }
        TRACE_PHASE(0);  // the timeline's phases: rows in, partial sums done, slots summed
        uint4 v[4][NV];
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
            for (int j = 0; j < NV; j++) v[q][j] = stage[(q * NV + j) * 32 + lane];
        dot_rows<4, NV>(v, xs, acc);
    } else if (VPL > 0) {
        uint4 v[4][NV];
        load_rows<4, NV>(v, rows);
        dot_rows<4, NV>(v, xs, acc);
    } else {
        if (early) griddep_wait();
        dot_rows_any<4>(rows, xs, kk, acc);
    }
    float coef = s == k ? *sgate : early ? wts[s] : topk_w[s];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float a = warp_sum(acc[q]);
        // A routed expert's output rounded to bf16, as prefill's y (moe_gemm6_m128_bf16).
        if (s != k) a = __bfloat162float(__float2bfloat16(a));
        if (lane == 0) red[s][q] = coef * a;
    }
    TRACE_PHASE(1);
    __syncthreads();
    TRACE_PHASE(2);
    if (threadIdx.x < 4 && r0 + threadIdx.x < d) {
        float t = 0.0f;
        for (int i = 0; i <= k; i++) t += red[i][threadIdx.x];
        h[r0 + threadIdx.x] += t;
    }
}

extern "C" __global__ void __launch_bounds__(544) moe_down_dec(
    const float* act, int act_ld, const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
    const float* logits, int e, int early, int k, const float* sgate, const bf16* __restrict__ down,
    int inter, const bf16* __restrict__ shared_down, int s_inter, float* __restrict__ h, int d) {
    if (inter == 512 && s_inter == 512)
        moe_down_dec_impl<2>(act, act_ld, topk_ids, topk_w, logits, e, early, k, sgate, down, inter, shared_down,
                             s_inter, h, d);
    else
        moe_down_dec_impl<0>(act, act_ld, topk_ids, topk_w, logits, e, early, k, sgate, down, inter, shared_down,
                             s_inter, h, d);
}
