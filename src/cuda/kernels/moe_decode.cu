// Sparse MoE, decode (one token): three launches for the whole MoE block, the router
// (moe_router_dec), the gate/up half of the chosen and the shared expert (moe_gate_up_dec) and
// the down half with the combine and residual (moe_down_dec). They pick the experts with
// moe_route.cu's route_topk_warp.

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
// FP8: gate_up / shared_gate_up e4m3 with their block scales gu_sc [E, 2 inter / 128, ceil(d /
// 128)] and sgu_sc (inter, s_inter % 128 == 0, d % 16 == 0), VPL words of 16 a lane (d / 512).
// A routed slot's expert, picked by this warp from the router's logits after the wait (its own
// copy in `routing`: per warp e logits, k ids, k weights, 16-byte rounded; no block barrier);
// block (0, 1)'s warp 0 also stores the ids and weights for moe_down_dec. Shared by the bf16/FP8
// and 4-bit gate/up kernels.
__device__ __forceinline__ int gate_up_dec_pick(float* routing, const float* logits, int e, int k, int slot,
                                                int* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                int late_launch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    griddep_wait();  // the logits come from the router
    if (late_launch) griddep_launch();
    float* rl = routing + warp * ((e + 2 * k + 3) & ~3);
    int* ids = reinterpret_cast<int*>(rl + e);
    float* wts = rl + e + k;
    for (int i = lane; i < e; i += 32) rl[i] = logits[i];
    __syncwarp();
    route_topk_warp(rl, e, k, ids, wts);
    __syncwarp();  // lanes < k wrote the choices
    if (blockIdx.x == 0 && blockIdx.y == 1 && warp == 0 && lane < k) {
        topk_ids[lane] = ids[lane];
        topk_w[lane] = wts[lane];
    }
    return ids[slot];
}
template <int VPL, bool FP8>
__device__ __forceinline__ void moe_gate_up_dec_impl(const bf16* __restrict__ xb, int d, const float* logits, int e,
                                                     int k, int* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                     const void* __restrict__ gate_up, const float* __restrict__ gu_sc,
                                                     int inter, const void* __restrict__ shared_gate_up,
                                                     const float* __restrict__ sgu_sc, int s_inter,
                                                     float* __restrict__ act, int act_ld, float* xs, int late_launch) {
    DECODE_KERNEL_NO_LAUNCH(TAG_GATE_UP);
    if (!late_launch) griddep_launch();
    // blockIdx.y 0 is the shared expert (slot k), whose blocks are dispatched first: its rows
    // are known before the router finishes, so those blocks load them before waiting.
    const int slot = blockIdx.y == 0 ? k : blockIdx.y - 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool shared = slot == k;
    const int expert = shared ? 0 : gate_up_dec_pick(xs + d, logits, e, k, slot, topk_ids, topk_w, late_launch);
    const int n = shared ? s_inter : inter, j = blockIdx.x * 8 + warp;
    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    // the shared expert's xb, the normalised input, comes from the router too
    auto stage = [&] {
        if (shared) {
            griddep_wait();
            if (late_launch) griddep_launch();
        }
        stage_bf16(reinterpret_cast<uint4*>(xs), xb, d);
    };
    constexpr int NV = VPL > 0 ? VPL : 1;
    float acc[2];
    if (FP8) {
        const int kw = d >> 4, kb = (d + 127) >> 7;
        const uint4* w = shared ? reinterpret_cast<const uint4*>(shared_gate_up)
                                : reinterpret_cast<const uint4*>(gate_up) + (size_t)expert * 2 * inter * kw;
        const float* sc = shared ? sgu_sc : gu_sc + (size_t)expert * (2 * inter / 128) * kb;
        const uint4* rows[2] = {j < n ? w + (size_t)j * kw : nullptr, j < n ? w + (size_t)(n + j) * kw : nullptr};
        const float* srows[2] = {sc + (size_t)(j >> 7) * kb, sc + (size_t)((n + j) >> 7) * kb};
        uint4 v[2][NV];
        float s[2][NV];
        if (VPL > 0) load_rows_fp8<2, NV>(v, s, rows, srows);
        stage();
        if (VPL > 0) dot_rows_fp8<2, NV>(v, s, xv, acc);
        else dot_rows_fp8_any<2>(rows, srows, xv, kw, acc);
    } else {
        const bf16* w = shared ? reinterpret_cast<const bf16*>(shared_gate_up)
                               : reinterpret_cast<const bf16*>(gate_up) + (size_t)expert * 2 * inter * d;
        const bf16* rows[2] = {j < n ? w + (size_t)j * d : nullptr, j < n ? w + (size_t)(n + j) * d : nullptr};
        uint4 v[2][NV];
        if (VPL > 0) load_rows<2, NV>(v, rows);
        stage();
        if (VPL > 0) dot_rows<2, NV>(v, xv, acc);
        else dot_rows_any<2>(rows, xv, d, acc);
    }
    float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
    if (lane == 0 && j < n) act[(size_t)slot * act_ld + j] = __bfloat162float(__float2bfloat16(silu_f(g) * u));
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up_dec(
    const bf16* __restrict__ xb, int d, const float* logits, int e, int k, int* __restrict__ topk_ids,
    float* __restrict__ topk_w, const bf16* __restrict__ gate_up, int inter, const bf16* __restrict__ shared_gate_up,
    int s_inter, float* __restrict__ act, int act_ld, int late_launch) {
    extern __shared__ float xs[];
    if (d == 2048)
        moe_gate_up_dec_impl<8, false>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, nullptr, inter, shared_gate_up,
                                       nullptr, s_inter, act, act_ld, xs, late_launch);
    else
        moe_gate_up_dec_impl<0, false>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, nullptr, inter, shared_gate_up,
                                       nullptr, s_inter, act, act_ld, xs, late_launch);
}
// The same for FP8 experts (W8A16).
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_dec_fp8(
    const bf16* __restrict__ xb, int d, const float* logits, int e, int k, int* __restrict__ topk_ids,
    float* __restrict__ topk_w, const uint4* __restrict__ gate_up, const float* __restrict__ gu_sc, int inter,
    const uint4* __restrict__ shared_gate_up, const float* __restrict__ sgu_sc, int s_inter, float* __restrict__ act,
    int act_ld, int late_launch) {
    extern __shared__ float xs[];
    if (d == 2048)
        moe_gate_up_dec_impl<4, true>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, gu_sc, inter, shared_gate_up,
                                      sgu_sc, s_inter, act, act_ld, xs, late_launch);
    else
        moe_gate_up_dec_impl<0, true>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, gu_sc, inter, shared_gate_up,
                                      sgu_sc, s_inter, act, act_ld, xs, late_launch);
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
// The slots' sums of a block's 4 rows (warp s: slot s's partial sums acc, its weight coef) met
// in red and added into h.
__device__ __forceinline__ void down_dec_combine(const float (&acc)[4], float coef, int s, int k, float (&red)[17][4],
                                                 int r0, float* __restrict__ h, int d) {
    const int lane = threadIdx.x & 31;
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
    down_dec_combine(acc, s == k ? *sgate : early ? wts[s] : topk_w[s], s, k, red, r0, h, d);
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

// moe_down_dec for FP8 down / shared_down (e4m3 with block scales down_sc [E, d / 128, ceil(inter /
// 128)] and sd_sc; d % 128 == 0, inter % 16 == 0): the experts from topk_ids after the wait (no
// early path), VPL words of 16 a lane (inter / 512). grid ceil(d / 4), block 32 (k + 1).
template <int VPL>
__device__ __forceinline__ void moe_down_dec_fp8_impl(const float* act, int act_ld, const int* topk_ids,
                                                      const float* topk_w, int k, const float* sgate,
                                                      const uint4* __restrict__ down, const float* __restrict__ down_sc,
                                                      int inter, const uint4* __restrict__ shared_down,
                                                      const float* __restrict__ sd_sc, int s_inter,
                                                      float* __restrict__ h, int d) {
    constexpr int NV = VPL > 0 ? VPL : 1;
    __shared__ float red[17][4];
    DECODE_KERNEL(TAG_DOWN);
    const int s = threadIdx.x >> 5, r0 = blockIdx.x * 4;
    griddep_wait();  // the ids, act and sgate come from the previous kernels
    const int kk = s == k ? s_inter : inter, kw = kk >> 4, kb = (kk + 127) >> 7;
    const int e = s == k ? 0 : topk_ids[s];
    const uint4* base = s == k ? shared_down : down + (size_t)e * d * kw;
    const float* sb = s == k ? sd_sc : down_sc + (size_t)e * (d >> 7) * kb;
    const uint4* rows[4];
    const float* srows[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        rows[q] = r0 + q < d ? base + (size_t)(r0 + q) * kw : nullptr;
        srows[q] = sb + (size_t)((r0 + q) >> 7) * kb;
    }
    const float* xs = act + (size_t)s * act_ld;
    float acc[4];
    if (VPL > 0) {
        uint4 v[4][NV];
        float sc[4][NV];
        load_rows_fp8<4, NV>(v, sc, rows, srows);
        dot_rows_fp8<4, NV>(v, sc, xs, acc);
    } else {
        dot_rows_fp8_any<4>(rows, srows, xs, kw, acc);
    }
    down_dec_combine(acc, s == k ? *sgate : topk_w[s], s, k, red, r0, h, d);
}
extern "C" __global__ void __launch_bounds__(544) moe_down_dec_fp8(
    const float* act, int act_ld, const int* topk_ids, const float* topk_w, int k, const float* sgate,
    const uint4* __restrict__ down, const float* __restrict__ down_sc, int inter, const uint4* __restrict__ shared_down,
    const float* __restrict__ sd_sc, int s_inter, float* __restrict__ h, int d) {
    if (inter == 512 && s_inter == 512)
        moe_down_dec_fp8_impl<1>(act, act_ld, topk_ids, topk_w, k, sgate, down, down_sc, inter, shared_down, sd_sc,
                                 s_inter, h, d);
    else
        moe_down_dec_fp8_impl<0>(act, act_ld, topk_ids, topk_w, k, sgate, down, down_sc, inter, shared_down, sd_sc,
                                 s_inter, h, d);
}

// moe_gate_up_dec for affine 4-bit experts (q4 tiles, gemv.cuh: gate_up [E, 2 inter, d] and
// shared_gate_up [2 s_inter, d] with scale/bias pairs gu_sb / sgu_sb, groups of `group`; inter,
// s_inter % 16 == 0, d % 64 == 0): a block takes 16 features j0.., the gate strip and the up
// strip of its slot's expert, its 8 warps splitting the d / 64 units on the tensor cores
// (q4_load / q4_dot; NV = d / 512 a warp), the sums met in shared memory. The slot's expert as
// in moe_gate_up_dec (each warp's own top-k from the logits; the shared expert's blocks load
// before the wait). grid (ceil(max(inter, s_inter) / 16), k + 1), block 256, smem
// gate_up_dec_q4_smem(d, e, k, group) bytes.
__host__ __device__ __forceinline__ int gate_up_dec_q4_smem(int d, int e, int k, int group) {
    return q4_smem(1, d, group, false, 8 * 2 * 16) + 4 * 8 * ((e + 2 * k + 3) & ~3);
}
template <int NV>
__device__ __forceinline__ void moe_gate_up_dec_q4_impl(const bf16* __restrict__ xb, int d, const float* logits, int e,
                                                        int k, int* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                        const uint4* __restrict__ gate_up,
                                                        const unsigned* __restrict__ gu_sb, int inter,
                                                        const uint4* __restrict__ shared_gate_up,
                                                        const unsigned* __restrict__ sgu_sb, int s_inter, int group,
                                                        float* __restrict__ act, int act_ld, int late_launch,
                                                        float* smem) {
    DECODE_KERNEL_NO_LAUNCH(TAG_GATE_UP);
    if (!late_launch) griddep_launch();
    const int slot = blockIdx.y == 0 ? k : blockIdx.y - 1;
    const bool shared = slot == k;
    const int n = shared ? s_inter : inter, j0 = blockIdx.x * 16, nspan = d / q4_span(group);
    unsigned* xw = reinterpret_cast<unsigned*>(smem);
    float* xsum = smem + d / 2;
    float* red = xsum + nspan;
    float* routing = red + 8 * 2 * 16;
    const int expert = shared ? 0 : gate_up_dec_pick(routing, logits, e, k, slot, topk_ids, topk_w, late_launch);
    if (j0 >= n) return;  // the wider of the two experts' grid
    const uint4* w = shared ? shared_gate_up : gate_up;
    const unsigned* sb = shared ? sgu_sb : gu_sb;
    const int base = shared ? 0 : expert * 2 * inter;  // the expert's first row
    const int strip[2] = {(base + j0) / 16, (base + n + j0) / 16};
    uint4 v[2][NV > 0 ? NV : 1];
    Q4Sb<(NV > 0 ? NV : 1)> sbr[2];
    q4_load<NV, 2>(v, sbr, w, sb, group, strip, d);
    if (shared) {
        griddep_wait();  // xb, the normalised input, comes from the router
        if (late_launch) griddep_launch();
    }
    q4_stage_rows(xw, d / 2, xb, nullptr, 1, d);
    q4_span_sums(xw, d / 2, 1, d, q4_span(group), xsum);
    q4_dot<NV, 1, 2>(v, sbr, w, sb, group, strip, d, xw, d / 2, 1, xsum, red);
    if (threadIdx.x < 16 && j0 + threadIdx.x < n) {
        const float gs = q4_red_sum<2>(red, 0, 1, 0, threadIdx.x), us = q4_red_sum<2>(red, 1, 1, 0, threadIdx.x);
        act[(size_t)slot * act_ld + j0 + threadIdx.x] = __bfloat162float(__float2bfloat16(silu_f(gs) * us));
    }
}
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_dec_q4(
    const bf16* __restrict__ xb, int d, const float* logits, int e, int k, int* __restrict__ topk_ids,
    float* __restrict__ topk_w, const uint4* __restrict__ gate_up, const unsigned* __restrict__ gu_sb, int inter,
    const uint4* __restrict__ shared_gate_up, const unsigned* __restrict__ sgu_sb, int s_inter, int group,
    float* __restrict__ act, int act_ld, int late_launch) {
    extern __shared__ float gate_up_q4_xs[];
    if (d == 2048)
        moe_gate_up_dec_q4_impl<4>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, gu_sb, inter, shared_gate_up,
                                   sgu_sb, s_inter, group, act, act_ld, late_launch, gate_up_q4_xs);
    else
        moe_gate_up_dec_q4_impl<0>(xb, d, logits, e, k, topk_ids, topk_w, gate_up, gu_sb, inter, shared_gate_up,
                                   sgu_sb, s_inter, group, act, act_ld, late_launch, gate_up_q4_xs);
}

// moe_down_dec for affine 4-bit down / shared_down (q4 tiles, [E, d, inter] and [d, s_inter];
// d % 16 == 0, inter and s_inter % 64 == 0): a block takes a strip of 16 rows; warp s is slot s
// (the k routed experts from topk_ids after the wait, then the shared expert): it stages its
// slot's activations as bf16 with their span sums and takes all its strip's units on the tensor
// cores (NV = inter / 64 = 8 loaded at once at the model's 512); the slots' sums meet in shared
// memory (a routed expert's rounded to bf16, as moe_down_dec) and go into h.
// grid d / 16, block 32 (k + 1), smem down_dec_q4_smem(k, inter, s_inter, group) bytes.
__host__ __device__ __forceinline__ int down_dec_q4_words(int inter, int s_inter, int group) {
    const int kk = inter > s_inter ? inter : s_inter;
    return kk / 2 + kk / q4_span(group);
}
__host__ __device__ __forceinline__ int down_dec_q4_smem(int k, int inter, int s_inter, int group) {
    return 4 * (k + 1) * (down_dec_q4_words(inter, s_inter, group) + 16);
}
template <int NV>
__device__ __forceinline__ void moe_down_dec_q4_impl(const float* act, int act_ld, const int* topk_ids,
                                                     const float* topk_w, int k, const float* sgate,
                                                     const uint4* __restrict__ down, const unsigned* __restrict__ down_sb,
                                                     int inter, const uint4* __restrict__ shared_down,
                                                     const unsigned* __restrict__ sd_sb, int s_inter, int group,
                                                     float* __restrict__ h, int d, float* smem) {
    DECODE_KERNEL(TAG_DOWN);
    const int s = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    griddep_wait();  // the ids, act and sgate come from the previous kernels
    const int kk = s == k ? s_inter : inter, U = kk >> 6, G = kk / group, span = q4_span(group), nspan = kk / span;
    const int strip = (s == k ? 0 : topk_ids[s] * d) / 16 + blockIdx.x;
    const uint4* w = s == k ? shared_down : down;
    const unsigned* sb = s == k ? sd_sb : down_sb;
    uint4 v[NV > 0 ? NV : 1];
    Q4Sb<(NV > 0 ? NV : 1)> sbr;
    if (NV > 0) {
#pragma unroll
        for (int i = 0; i < (NV > 0 ? NV : 1); i++) v[i] = __ldg(w + ((size_t)strip * U + i) * 32 + lane);
        q4_load_sb(sbr, sb, group, strip, kk, 0);
    }
    // this slot's activations as bf16, then its span sums
    unsigned* xw = reinterpret_cast<unsigned*>(smem) + s * down_dec_q4_words(inter, s_inter, group);
    float* xsum = reinterpret_cast<float*>(xw + kk / 2);
    float* red = smem + (k + 1) * down_dec_q4_words(inter, s_inter, group);
    const float* a = act + (size_t)s * act_ld;
    for (int c = lane; c < kk / 2; c += 32) xw[c] = pack_bf16x2(a[2 * c], a[2 * c + 1]);
    __syncwarp();
    for (int i = 0; i < nspan; i++) {
        float x = 0.0f;
        if (lane < span / 2) {
            const unsigned p = xw[i * (span / 2) + lane];
            x = __uint_as_float(p << 16) + __uint_as_float(p & 0xffff0000u);
        }
        x = warp_sum(x);
        if (lane == 0) xsum[i] = x;
    }
    __syncwarp();
    TRACE_PHASE(0);  // the timeline's phases: rows in, partial sums done, slots summed
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (NV > 0) {
        const auto at = [&sbr](int grp, int r) { return q4_sb_at(sbr, grp, r); };
#pragma unroll
        for (int i = 0; i < (NV > 0 ? NV : 1); i++) q4_unit<1>(v[i], xw, kk / 2, 1, i * 64, xsum, nspan, at, group, acc);
    } else {
        const Q4SbGlobal at{sb + (size_t)strip * G * 16};
        for (int u = 0; u < U; u++)
            q4_unit<1>(__ldg(w + ((size_t)strip * U + u) * 32 + lane), xw, kk / 2, 1, u * 64, xsum, nspan, at, group,
                       acc);
    }
    TRACE_PHASE(1);
    if ((lane & 3) == 0) {  // token 0's column: rows g and g + 8
        const float coef = s == k ? *sgate : topk_w[s];
        float r0 = acc[0][0], r1 = acc[0][2];
        if (s != k) {
            r0 = __bfloat162float(__float2bfloat16(r0));
            r1 = __bfloat162float(__float2bfloat16(r1));
        }
        red[s * 16 + g] = coef * r0;
        red[s * 16 + g + 8] = coef * r1;
    }
    __syncthreads();
    TRACE_PHASE(2);
    const int row = blockIdx.x * 16 + threadIdx.x;
    if (threadIdx.x < 16 && row < d) {
        float t = 0.0f;
        for (int i = 0; i <= k; i++) t += red[i * 16 + threadIdx.x];
        h[row] += t;
    }
}
extern "C" __global__ void __launch_bounds__(544) moe_down_dec_q4(
    const float* act, int act_ld, const int* topk_ids, const float* topk_w, int k, const float* sgate,
    const uint4* __restrict__ down, const unsigned* __restrict__ down_sb, int inter,
    const uint4* __restrict__ shared_down, const unsigned* __restrict__ sd_sb, int s_inter, int group,
    float* __restrict__ h, int d) {
    extern __shared__ float down_q4_xs[];
    if (inter == 512 && s_inter == 512)
        moe_down_dec_q4_impl<8>(act, act_ld, topk_ids, topk_w, k, sgate, down, down_sb, inter, shared_down, sd_sb,
                                s_inter, group, h, d, down_q4_xs);
    else
        moe_down_dec_q4_impl<0>(act, act_ld, topk_ids, topk_w, k, sgate, down, down_sb, inter, shared_down, sd_sb,
                                s_inter, group, h, d, down_q4_xs);
}
