// Shared helpers for Kestrel's CUDA kernels (compiled at run time with NVRTC).
#include <cuda_bf16.h>
#include <mma.h>

typedef __nv_bfloat16 bf16;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned long long u64;

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). All threads get it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)((blockDim.x + 31) >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Programmatic dependent launch (sm_90): the decode kernels are launched so that the next
// kernel may start while this one runs. `griddep_launch` lets it (DECODE_KERNEL does at the
// start; with DECODE_KERNEL_NO_LAUNCH the kernel calls it itself); `griddep_wait` blocks until
// the previous kernel has finished and its writes are visible (`griddep_wait_plain`: the same
// without the timeline's hook). Before the wait a kernel may read only immutable data (weights).
// All are no-ops for a normal launch.
__device__ __forceinline__ void griddep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void griddep_wait_plain() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// ---- Decode timeline (compiled in with KESTREL_KERNEL_DEFINES=KESTREL_TRACE; see
// CudaModel::trace_decode_step and scripts/decode_timeline.py): thread 0 of every 8th block and
// of the last block of each decode kernel appends one record of TRACE_RECORD u64 to the buffer
// trace_set gave: tag << 48 | grid << 24 | block, SM, then %globaltimer (ns) at the block's start,
// when its griddep_wait returned (0: never waited) and at its end, then up to three phase stamps a
// kernel may take on thread 0 (TRACE_PHASE(k), k < 3; 0: not taken). Without the define the hooks
// are empty.
#define TRACE_RECORD 8  // u64 a record (CudaModel::trace_decode_step reads the same)
__device__ u64* g_trace;
__device__ unsigned g_trace_n, g_trace_cap;
extern "C" __global__ void trace_set(u64* buf, unsigned cap) {
    g_trace = buf;
    g_trace_n = 0;
    g_trace_cap = cap;
}
#ifdef KESTREL_TRACE
#ifndef TRACE_EVERY
#define TRACE_EVERY 8  // blocks sampled: every TRACE_EVERY-th and the last (1: all; more atomics)
#endif
__shared__ u64 g_trace_t0, g_trace_t1;  // this block's start and wait release
__shared__ u64 g_trace_ph[3];           // its phase stamps
__device__ __forceinline__ u64 trace_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned trace_sm() {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    return sm;
}
struct TraceBlock {
    unsigned tag;
    __device__ explicit TraceBlock(unsigned t) : tag(t) {
        if (threadIdx.x == 0) {
            g_trace_t0 = trace_now(), g_trace_t1 = 0;
            g_trace_ph[0] = g_trace_ph[1] = g_trace_ph[2] = 0;
        }
    }
    __device__ ~TraceBlock() {
        if (threadIdx.x != 0 || !g_trace || ((blockIdx.x % TRACE_EVERY) && blockIdx.x + 1 != gridDim.x)) return;
        const unsigned i = atomicAdd(&g_trace_n, 1u);
        if (i >= g_trace_cap) return;
        u64* r = g_trace + TRACE_RECORD * (size_t)i;
        r[0] = (u64)tag << 48 | (u64)gridDim.x << 24 | blockIdx.x;
        r[1] = (u64)blockIdx.y << 32 | trace_sm();
        r[2] = g_trace_t0;
        r[3] = g_trace_t1;
        r[4] = trace_now();
        for (int k = 0; k < 3; k++) r[5 + k] = g_trace_ph[k];
    }
};
#define TRACE_PHASE(k)                                 \
    do {                                               \
        if (threadIdx.x == 0) g_trace_ph[k] = trace_now(); \
    } while (0)
__device__ __forceinline__ void griddep_wait() {
    griddep_wait_plain();
    if (threadIdx.x == 0) g_trace_t1 = trace_now();
}
#define DECODE_KERNEL(tag) \
    griddep_launch();      \
    TraceBlock trace_block_(tag)
#define DECODE_KERNEL_NO_LAUNCH(tag) TraceBlock trace_block_(tag)
#else
__device__ __forceinline__ void griddep_wait() { griddep_wait_plain(); }
#define DECODE_KERNEL(tag) griddep_launch()
#define DECODE_KERNEL_NO_LAUNCH(tag)
#define TRACE_PHASE(k) \
    do {               \
    } while (0)
#endif
// Prefill kernels, launched with programmatic dependent launch by Gpu::launch_dep: wait for the
// previous kernel and its writes before anything else (reads and writes alike), then let the
// next kernel's blocks onto the SMs this one's last wave leaves, so a launch's latency overlaps
// this kernel's tail. Both are no-ops for a normal launch.
// (The untraced wait: the traced one would give every prefill kernel the trace's shared memory.)
#define PREFILL_KERNEL()   \
    griddep_wait_plain(); \
    griddep_launch()
// Tags of the decode kernels in the timeline (decode_timeline.py has the names).
#define TAG_EMBED 1
#define TAG_GEMV 2
#define TAG_GDN_CONV 3
#define TAG_GDN_STEP 4
#define TAG_ATTN_PREP 5
#define TAG_ATTN_DECODE 6
#define TAG_ATTN_COMBINE 7
#define TAG_ROUTER 8
#define TAG_GATE_UP 9
#define TAG_DOWN 10

// Arg-max of (value, index) pairs over the warp: the larger value, the smaller index on ties.
// Every lane gets the result.
__device__ __forceinline__ void warp_argmax(float& v, int& id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
    }
}

// The same over the whole block (blockDim.x a multiple of 32); thread 0 gets the result.
__device__ void block_argmax(float& v, int& id) {
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_argmax(v, id);
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = id; }
    __syncthreads();
    if (warp == 0) {
        int nw = (int)(blockDim.x >> 5);
        v = lane < nw ? sv[lane] : -INFINITY;
        id = lane < nw ? si[lane] : 0x7fffffff;
        warp_argmax(v, id);
    }
}

// Dot of 8 bf16 weights (one 16-byte load) with 8 staged f32 inputs.
__device__ __forceinline__ float dot8(uint4 v, const float* x) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
    float4 x0 = reinterpret_cast<const float4*>(x)[0], x1 = reinterpret_cast<const float4*>(x)[1];
    float2 a = __bfloat1622float2(p[0]), b = __bfloat1622float2(p[1]);
    float2 c = __bfloat1622float2(p[2]), d = __bfloat1622float2(p[3]);
    return a.x * x0.x + a.y * x0.y + b.x * x0.z + b.y * x0.w + c.x * x1.x + c.y * x1.y + d.x * x1.z + d.y * x1.w;
}

// 8 bf16 values (one 16-byte word) as f32 pairs, and their dot with 8 bf16 weights in dot8's
// order (so the sum is bitwise dot8's with the same values staged as f32).
struct X8 {
    float2 a, b, c, d;
};
__device__ __forceinline__ X8 unpack8(uint4 v) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
    return {__bfloat1622float2(p[0]), __bfloat1622float2(p[1]), __bfloat1622float2(p[2]), __bfloat1622float2(p[3])};
}
__device__ __forceinline__ float dot8(uint4 v, const X8& x) {
    const X8 w = unpack8(v);
    return w.a.x * x.a.x + w.a.y * x.a.y + w.b.x * x.b.x + w.b.y * x.b.y + w.c.x * x.c.x + w.c.y * x.c.y +
           w.d.x * x.d.x + w.d.y * x.d.y;
}

// ---- Decode GEMV machinery: a warp owns R weight rows, each lane streams 16-byte vectors
// c = lane + 32*j of them. With VPL (vectors per lane) known at compile time, all R*VPL loads
// are issued before the input is staged, so the staging latency hides behind the weight fetch.

// Output rows per 256-thread block of the decode GEMVs (the host uses the same rule): two rows
// per warp up to k = 2048, a warp pair per row (each half of k) at k = 4096, else a row per warp.
// whole_rows: k = 4096 as a warp per whole row (8 rows a block) instead of two warps per row.
__host__ __device__ __forceinline__ int gemv_rows_per_block(int k, bool whole_rows = false) {
    return k <= 2048 ? 16 : k == 4096 ? (whole_rows ? 8 : 4) : 8;
}

template <int R, int VPL>
__device__ __forceinline__ void load_rows(uint4 (&v)[R][VPL], const bf16* const* row) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++)
#pragma unroll
        for (int j = 0; j < VPL; j++)
            v[q][j] = row[q] ? __ldg(reinterpret_cast<const uint4*>(row[q]) + lane + 32 * j) : make_uint4(0, 0, 0, 0);
}

// Per-lane partial dots of loaded rows with the input staged in shared memory as bf16 (xb:
// 16-byte words of 8; not yet summed over the warp). A lane reads word lane + 32 j once for
// all R rows: 4 shared-memory wavefronts a warp, where f32 staging took 16 (two 16-byte reads
// at a 32-byte stride, 2-way bank conflicts), which bounded the short GEMVs' dot phase.
template <int R, int VPL>
__device__ __forceinline__ void dot_rows(const uint4 (&v)[R][VPL], const uint4* xb, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        const X8 x = unpack8(xb[lane + 32 * j]);
#pragma unroll
        for (int q = 0; q < R; q++) acc[q] += dot8(v[q][j], x);
    }
}

// dot_rows for any k (% 8 == 0) with the bf16-staged input: the runtime-length fallback.
template <int R>
__device__ __forceinline__ void dot_rows_any(const bf16* const* row, const uint4* xb, int k, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
    for (int c = lane; c < (k >> 3); c += 32) {
        const X8 x = unpack8(xb[c]);
#pragma unroll
        for (int q = 0; q < R; q++)
            if (row[q]) acc[q] += dot8(__ldg(reinterpret_cast<const uint4*>(row[q]) + c), x);
    }
}

// Per-lane partial dots of loaded rows with f32 inputs xs (not yet summed over the warp).
template <int R, int VPL>
__device__ __forceinline__ void dot_rows(const uint4 (&v)[R][VPL], const float* xs, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) {
        acc[q] = 0.0f;
#pragma unroll
        for (int j = 0; j < VPL; j++) acc[q] += dot8(v[q][j], xs + (lane + 32 * j) * 8);
    }
}

// Per-lane partial dots for any k (% 8 == 0): the runtime-length fallback.
template <int R>
__device__ __forceinline__ void dot_rows_any(const bf16* const* row, const float* xs, int k, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
    for (int c = lane; c < (k >> 3); c += 32) {
#pragma unroll
        for (int q = 0; q < R; q++)
            if (row[q]) acc[q] += dot8(__ldg(reinterpret_cast<const uint4*>(row[q]) + c), xs + c * 8);
    }
}

// Stage a bf16 vector of k values (k % 8 == 0) into shared memory as it is (xb: 16-byte words
// of 8), then a block barrier.
__device__ __forceinline__ void stage_bf16(uint4* xb, const bf16* __restrict__ x, int k) {
    for (int c = threadIdx.x; c < (k >> 3); c += blockDim.x) xb[c] = reinterpret_cast<const uint4*>(x)[c];
    __syncthreads();
}

// 16-byte asynchronous global-to-shared copy (zero-fills the destination when !valid), and
// its group fences: wait_one leaves the most recent committed group in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
// Wait until at most N of the committed cp.async groups are still in flight (a pipeline of
// N + 2 stages keeps N loads going while one stage is read).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// The same for an n known only at run time (0 to 4; more waits as for 4).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
    if (n <= 0) cp_async_wait<0>();
    else if (n == 1) cp_async_wait<1>();
    else if (n == 2) cp_async_wait<2>();
    else if (n == 3) cp_async_wait<3>();
    else cp_async_wait<4>();
}

// Copies the RMSNorm weight w [k] into shared memory `ws` with cp.async, to be issued before
// griddep_wait (weights are immutable), so that the weight's trip to DRAM is not on the critical
// path after the wait (the decode timeline showed it there). Returns ws, or null when k % 4 != 0
// (stage_rmsnorm then reads w itself).
__device__ __forceinline__ float* preload_norm(float* ws, const float* __restrict__ w, int k) {
    if (k & 3) return nullptr;
    for (int c = threadIdx.x; c < (k >> 2); c += blockDim.x) cp_async16(ws + 4 * c, w + 4 * c, true);
    cp_async_commit();
    return ws;
}

// Float4 c of the RMSNorm's output: bf16(h * inv * (1 + w)) into xb (and xb_out if given).
__device__ __forceinline__ void rmsnorm_put(uint4* xb, bf16* __restrict__ xb_out, int c, float4 v, const float* wn,
                                            float inv) {
    const float4 g = reinterpret_cast<const float4*>(wn)[c];
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv * (1.0f + g.x), v.y * inv * (1.0f + g.y));
    __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * inv * (1.0f + g.z), v.w * inv * (1.0f + g.w));
    uint2 o;
    o.x = *reinterpret_cast<unsigned*>(&lo);
    o.y = *reinterpret_cast<unsigned*>(&hi);
    reinterpret_cast<uint2*>(xb)[c] = o;
    if (xb_out) reinterpret_cast<uint2*>(xb_out)[c] = o;
}

// Stage the zero-centred RMSNorm (1 + w) of the f32 residual h into shared memory as bf16 (xb,
// k % 8 == 0; every GEMM input is rounded to bf16); `xb_out` (may be null) also receives it.
// h is read twice (the sum of squares, then the scaling), not kept in registers: the GEMVs
// hold their weight rows in registers across this. The weight comes from `ws` when
// preload_norm put it there (this thread's copies are waited for here; the block barrier in
// block_sum makes all of them visible), else from w. Ends with a block barrier.
// ws_pending: cp.async groups this thread committed after preload_norm's, which may stay in
// flight (gemv_dec_stream's first weight stages).
__device__ __forceinline__ void stage_rmsnorm(uint4* xb, const float* __restrict__ h, const float* __restrict__ w,
                                              int k, float eps, bf16* __restrict__ xb_out, const float* ws,
                                              int ws_pending = 0) {
    if (ws) cp_async_wait_dyn(ws_pending);
    const float4* h4 = reinterpret_cast<const float4*>(h);
    float ss = 0.0f;
    for (int c = threadIdx.x; c < (k >> 2); c += blockDim.x) {
        const float4 v = h4[c];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float inv = rsqrtf(block_sum(ss) / k + eps);
    for (int c = threadIdx.x; c < (k >> 2); c += blockDim.x)
        rmsnorm_put(xb, xb_out, c, h4[c], ws ? ws : w, inv);  // h again: an L1 hit
    __syncthreads();
}

// stage_rmsnorm with this thread's float4s of h already loaded (hv[u] = h4[threadIdx.x + u *
// blockDim.x]; k = 4 * HV * blockDim.x), so that their loads could be issued before anything
// else the kernel requests after its wait.
template <int HV>
__device__ __forceinline__ void stage_rmsnorm_held(uint4* xb, const float4 (&hv)[HV], const float* __restrict__ w,
                                                   int k, float eps, bf16* __restrict__ xb_out, const float* ws) {
    if (ws) cp_async_wait_all();
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < HV; u++) ss += hv[u].x * hv[u].x + hv[u].y * hv[u].y + hv[u].z * hv[u].z + hv[u].w * hv[u].w;
    const float inv = rsqrtf(block_sum(ss) / k + eps);
#pragma unroll
    for (int u = 0; u < HV; u++) rmsnorm_put(xb, xb_out, threadIdx.x + u * blockDim.x, hv[u], ws ? ws : w, inv);
    __syncthreads();
}

// Stage the decode GEMV input into shared memory as bf16 (xb): the bf16 vector x, or (x null)
// RMSNorm(h) with weight nw, preloaded into ws (the GEMVs' smem is 2k floats: the input in the
// first k, the weight in the second).
__device__ __forceinline__ void stage_input(uint4* xb, const bf16* __restrict__ x, const float* __restrict__ h,
                                            const float* __restrict__ nw, int k, float eps, bf16* __restrict__ xb_out,
                                            const float* ws, int ws_pending = 0) {
    if (x) stage_bf16(xb, x, k);
    else stage_rmsnorm(xb, h, nw, k, eps, xb_out, ws, ws_pending);
}

template <int R, int VPL>
__device__ __forceinline__ void block_gemv_fixed(const bf16* __restrict__ w, int n, int k, int row0, bool staged,
                                                 const bf16* x, const float* h, const float* nw, float eps,
                                                 bf16* xb_out, float* xs, float* __restrict__ y, float beta) {
    int lane = threadIdx.x & 31, r0 = row0 + (threadIdx.x >> 5) * R;
    const bf16* rows[R];
#pragma unroll
    for (int q = 0; q < R; q++) rows[q] = r0 + q < n ? w + (size_t)(r0 + q) * k : nullptr;
    constexpr int NV = VPL > 0 ? VPL : 1;  // VPL 0: runtime-length fallback, nothing preloaded
    uint4* xb = reinterpret_cast<uint4*>(xs);  // the input as bf16
    uint4 v[R][NV];
    if (VPL > 0) load_rows<R, NV>(v, rows);
    if (!staged) {
        const float* ws = x ? nullptr : preload_norm(xs + k, nw, k);
        griddep_wait();
        stage_input(xb, x, h, nw, k, eps, xb_out, ws);
        TRACE_PHASE(0);  // the timeline's phases: input staged, dot products done
    }
    float acc[R];
    if (VPL > 0) dot_rows<R, NV>(v, xb, acc);
    else dot_rows_any<R>(rows, xb, k, acc);
    TRACE_PHASE(1);
#pragma unroll
    for (int q = 0; q < R; q++) {
        float a = warp_sum(acc[q]);
        if (lane == q && r0 + q < n) y[r0 + q] = beta == 0.0f ? a : beta * y[r0 + q] + a;
    }
}

// k = 4096: warps 2i and 2i+1 take the two halves of row row0 + i (8 vectors per lane each),
// which doubles the blocks of a short, wide matrix (the out-projections); halves meet in smem.
__device__ __forceinline__ void block_gemv_split2(const bf16* __restrict__ w, int n, int k, int row0, bool staged,
                                                  const bf16* x, const float* h, const float* nw, float eps,
                                                  bf16* xb_out, float* xs, float* __restrict__ y, float beta) {
    __shared__ float halves[8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = row0 + (warp >> 1), half = warp & 1;
    const bf16* rows[1] = {r < n ? w + (size_t)r * k + half * (k / 2) : nullptr};
    uint4 v[1][8];
    load_rows<1, 8>(v, rows);
    if (!staged) {
        const float* ws = x ? nullptr : preload_norm(xs + k, nw, k);
        griddep_wait();
        stage_input(reinterpret_cast<uint4*>(xs), x, h, nw, k, eps, xb_out, ws);
    }
    float acc[1];
    dot_rows<1, 8>(v, reinterpret_cast<const uint4*>(xs) + half * (k / 16), acc);
    float a = warp_sum(acc[0]);
    if (lane == 0) halves[warp] = a;
    __syncthreads();
    if (half == 0 && lane == 0 && r < n) {
        float t = halves[warp] + halves[warp + 1];
        y[r] = beta == 0.0f ? t : beta * y[r] + t;
    }
    __syncthreads();  // halves reused by the next row group
}

// y[r] = beta * y[r] + W[r, :] . input for the block's gemv_rows_per_block(k) rows from row0.
// Unless `staged` (xs already holds it), the input is staged by `stage_input` into xs (k floats
// of shared memory; 2k with the RMSNorm, whose weight is preloaded into xs + k) after this
// block's weight rows are in flight and the previous kernel is done (griddep_wait). All
// threads must call it.
template <bool WHOLE_ROWS = false>
__device__ __forceinline__ void block_gemv(const bf16* __restrict__ w, int n, int k, int row0, bool staged,
                                           const bf16* x, const float* h, const float* nw, float eps, bf16* xb_out,
                                           float* xs, float* __restrict__ y, float beta) {
    if (WHOLE_ROWS && k == 4096) return block_gemv_fixed<1, 16>(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta);
    switch (k) {
        case 512: block_gemv_fixed<2, 2>(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta); break;
        case 1024: block_gemv_fixed<2, 4>(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta); break;
        case 2048: block_gemv_fixed<2, 8>(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta); break;
        case 4096: block_gemv_split2(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta); break;
        default:
            if (k <= 2048) block_gemv_fixed<2, 0>(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta);
            else block_gemv_fixed<1, 0>(w, n, k, row0, staged, x, h, nw, eps, xb_out, xs, y, beta);
    }
}

// Block-wide "am I the last block to finish" ticket (threadfence reduction pattern); the last
// block also resets the counter for the next launch. All threads must call it.
__device__ __forceinline__ bool last_block_done(unsigned* counter) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned ticket = atomicAdd(counter, 1u);
        last = ticket == gridDim.x * gridDim.y - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}


// ---- Tensor-core fragments (mma.sync m16n8k16, bf16 in, f32 accumulate) ----
// Fragment layouts (PTX ISA "mma.m16n8k16"), g = lane / 4, c = 2 * (lane % 4):
//   A 16x16 row-major: a[0] (g, c..c+1), a[1] (g+8, c..), a[2] (g, 8+c..), a[3] (g+8, 8+c..)
//   B 16x8 (k x n):    b0 (k c..c+1, n g), b1 (k 8+c.., n g)
//   C 16x8:            d[0..1] (g, c..c+1), d[2..3] (g+8, c..c+1)
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// The same, each matrix transposed (B operands stored k-major, e.g. V rows = keys).
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats as a bf16 pair (lo in the low half: the lower column of a fragment).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// ---- Tensor-core fragments (mma.sync m16n8k8, tf32 in, f32 accumulate) ----
// Fragment layouts (PTX ISA "mma.m16n8k8" .tf32), g = lane / 4, c = lane % 4:
//   A 16x8 row-major: a[0] (g, c), a[1] (g+8, c), a[2] (g, c+4), a[3] (g+8, c+4)
//   B 8x8 (k x n):    b0 (k c, n g), b1 (k c+4, n g)
//   C 16x8:           d[0..1] (g, 2c..2c+1), d[2..3] (g+8, 2c..2c+1)
// ldsm_x4 of f32 rows reads tf32 A fragments (each 16-byte row = 4 floats): lanes 0-15 give
// rows 0-15 at column k0, lanes 16-31 the same rows at k0 + 4; likewise B from [n][k] storage.
// f32 -> tf32 (round to nearest, ties away), as the bits of a .b32 operand.
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 3xTF32 split: x = hi + lo to ~2^-22 relative, both tf32; A B ≈ A_hi B_hi + A_hi B_lo +
// A_lo B_hi (three mma, f32 accumulate) is then f32-level where one tf32 mma is 2^-11.
// Both round half away from zero as to_tf32 does, in integer ops: + half an ulp of tf32 on the
// magnitude bits, then hi drops the low 13 bits and lo leaves them to the mma, which ignores
// them (what ptxas itself emits for cvt.rna feeding an mma); NaN payloads may become inf.
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi)) + 0x1000u;  // x − hi is exact in f32
}
// The bf16 form (3xBF16, twice the tensor rate of 3xTF32): a pair (x0, x1) as bf16x2 hi (round
// to nearest) and lo = the rounded rest, x ≈ hi + lo to ~2^-17 relative; A B ≈ A_hi B_hi +
// A_hi B_lo + A_lo B_hi is then ~1e-5-level (one bf16 product is 2^-8).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// A counter another block publishes: its acquire load, and the release store that publishes it
// (cumulative: what this thread saw before, e.g. through a block barrier, is visible first).
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// A spinning waiter's pause between polls, so that many blocks polling one L2 line do not
// crowd out the other requests to its slice.
__device__ __forceinline__ void spin_pause(unsigned ns) { __nanosleep(ns); }

// ---- mbarrier (sm_90: try_wait): a 64-bit arrival counter in shared memory with a phase bit ----
// Initialised by one thread before a block barrier. A phase completes when `count` arrivals
// have happened; waiters name the parity of the phase they wait for (0 first, then 1, ...).
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival once every cp.async this thread issued before has landed (noinc: the init count
// already counts it).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// ---- wgmma (sm_90a): warpgroup matrix multiply-accumulate from shared-memory descriptors ----
// Only the compute_90a build has these instructions (the host picks the wgmma kernels only on
// compute capability 9.0); elsewhere they trap.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define WGMMA_ASM(...) __trap()
#endif
// ---- Thread-block clusters and tensor copies (sm_90; used by sm_90a kernels only) ----
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_ctarank() {
    unsigned r = 0;
    WGMMA_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every thread of the cluster: arrive (release), then wait (acquire).
__device__ __forceinline__ void cluster_sync() {
    WGMMA_ASM("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The split form, every thread of the cluster: arrive (release: this thread's earlier memory
// accesses are performed first) early, wait (acquire) later.
__device__ __forceinline__ void cluster_arrive_release() {
    WGMMA_ASM("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
    WGMMA_ASM("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// One arrival on the mbarrier at the same shared offset in block `cta` of the cluster.
__device__ __forceinline__ void mbar_arrive_remote(unsigned long long* bar, unsigned cta) {
    WGMMA_ASM(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(smem_addr(bar)),
        "r"(cta)
        : "memory");
}
// One arrival that also expects `bytes` of tensor-copy transactions in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    WGMMA_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// The box at (column c0, row c1) of the 2-D tensor map `tmap` (in global memory) into the same
// shared offset as `dst` in every block of `mask`, each block's mbarrier at bar's offset
// completing its bytes (the box layout, e.g. the 128-byte swizzle, is the map's).
__device__ __forceinline__ void tma_load_2d_mc(void* dst, const void* tmap, int c0, int c1, unsigned long long* bar,
                                               unsigned short mask) {
    WGMMA_ASM(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_addr(dst)),
        "l"(tmap), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(mask)
        : "memory");
}

// The box at (c0, c1, c2) of the 3-D tensor map `tmap` (in global or grid-constant parameter
// memory) into every block of `mask`, as tma_load_2d_mc.
__device__ __forceinline__ void tma_load_3d_mc(void* dst, const void* tmap, int c0, int c1, int c2,
                                               unsigned long long* bar, unsigned short mask) {
    WGMMA_ASM(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(smem_addr(dst)),
        "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "h"(mask)
        : "memory");
}

// tma_load_2d_mc into this block only (no multicast).
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tmap, int c0, int c1, unsigned long long* bar) {
    WGMMA_ASM(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
        "l"(tmap), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}
// `bytes` (a multiple of 16) from global `src` into shared `dst` (both 16-byte aligned) as one
// bulk copy (cp.async.bulk, sm_90), completing its bytes on `bar`: the copy engine moves them,
// so the block's own load path (its outstanding-request slots) stays free for other loads.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    WGMMA_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                  smem_addr(dst)),
              "l"(src), "r"(bytes), "r"(smem_addr(bar))
              : "memory");
}
// Warpgroup-wide register budget changes (sm_90a): a producer warpgroup gives registers back,
// consumer warpgroups take them (per SM sub-partition, every warpgroup has one warp there).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { WGMMA_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { WGMMA_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
// Shared-memory matrix descriptor of a K-major operand tile in the 128-byte swizzle layout
// (rows of 64 bf16 = 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), 8-row groups
// 1024 bytes apart, the tile 1024-byte aligned): start address >> 4 (bits 0-13), stride between
// 8-row groups >> 4 (bits 32-45), swizzle mode 1 = 128 B (bits 62-63); the leading offset is
// unused by this layout. Advancing along K inside the 128-byte row adds bytes >> 4 to the start.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* smem_tile) {
    const unsigned long long addr = smem_addr(smem_tile);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { WGMMA_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { WGMMA_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { WGMMA_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// The same layout read N-major (imm-trans-b = 1: B's N index runs along the 128-byte rows):
// rows are K (8-row groups 1024 bytes apart: the stride field), 64-wide N blocks `lbo` bytes
// apart (the leading field).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128_mn(const void* smem_tile, unsigned lbo) {
    const unsigned long long addr = smem_addr(smem_tile);
    return ((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// Writes by the generic proxy (st.shared, cp.async) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads/writes across in-flight wgmma.
__device__ __forceinline__ void wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// (and register A fragments, which an in-flight wgmma still reads)
__device__ __forceinline__ void wgmma_fence_operand(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }
// (and descriptors: computed before wgmma_fence, not sunk into the stage, where a non-wgmma
// instruction defining a wgmma input makes ptxas serialize every wgmma of the kernel: C7513)
__device__ __forceinline__ void wgmma_fence_operand(unsigned long long& r) { asm volatile("" : "+l"(r)::"memory"); }
// The 128 f32 accumulators of an m64n256 wgmma: the operand list (%0..%127) and its constraints.
#define WGMMA_D128_REGS \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
    "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
    "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
    "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
    "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
// The 32 f32 accumulators of an m64n64 wgmma: the operand list (%0..%31) and its constraints.
#define WGMMA_D32_REGS \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WGMMA_D32_OUT(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31])
// The 64 f32 accumulators of an m64n128 wgmma: the operand list (%0..%63) and its constraints.
#define WGMMA_D64_REGS \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// (each the next size's halves: d's first accumulators, then the rest from (d) + half)
#define WGMMA_D64_OUT(d) WGMMA_D32_OUT(d), WGMMA_D32_OUT((d) + 32)
#define WGMMA_D128_OUT(d) WGMMA_D64_OUT(d), WGMMA_D64_OUT((d) + 64)
// D[64 x 256] (f32, 128 registers a thread) = (scale_d ? D : 0) + A[64 x 16] * B[256 x 16]^T,
// A and B bf16 K-major from descriptors. Thread t of the warpgroup holds, for n8 block j,
// d[4j..4j+1] at row 16 (t / 32) + (t % 32) / 4, columns 8j + 2 (t % 4) + {0, 1}, and
// d[4j+2..4j+3] 8 rows below (mma.sync's C layout, a warp per 16 rows).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long da, unsigned long long db,
                                                 int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WGMMA_D128_REGS ", %128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D128_OUT(d)
        : "l"(da), "l"(db), "r"(scale_d));
}
// D[64 x 64] (32 registers a thread, wgmma_m64n256k16's layout over 8 n8 blocks) =
// (scale_d ? D : 0) + A[64 x 16] * B[64 x 16]^T, both K-major from descriptors.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], unsigned long long da, unsigned long long db,
                                                int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        WGMMA_D32_REGS ", "
        "%32, %33, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D32_OUT(d)
        : "l"(da), "l"(db), "r"(scale_d));
}
// The same at N = 80 (40 registers a thread, 10 n8 blocks): attn_flash4's key tiles of 80.
__device__ __forceinline__ void wgmma_m64n80k16(float (&d)[40], unsigned long long da, unsigned long long db,
                                                int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,"
        "%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, "
        "%40, %41, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D32_OUT(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
          "+f"(d[38]), "+f"(d[39])
        : "l"(da), "l"(db), "r"(scale_d));
}
// D[64 x 32] (16 registers a thread, wgmma_m64n256k16's layout over 4 n8 blocks) =
// (scale_d ? D : 0) + A[64 x 8] * B[32 x 8]^T in tf32 (the hardware reads a register's top 19
// bits), A from registers (thread t: a[0] = row 16 (t / 32) + (t % 32) / 4, column t % 4; a[1]
// the row 8 below; a[2], a[3] the same rows at column t % 4 + 4: mma.sync m16n8k8's A fragment
// per warp), B K-major from a 128-byte-swizzle descriptor (32 tf32 = 128 bytes a row; tf32
// operands have no transposed form).
__device__ __forceinline__ void wgmma_m64n32k8_tf32_rs(float (&d)[16], const unsigned (&a)[4],
                                                       unsigned long long db, int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// wgmma_m64n32k8_tf32_rs at N = 64 (32 registers a thread, 8 n8 blocks): the same A
// fragment, B 64 K-major rows from a 128-byte-swizzle descriptor.
__device__ __forceinline__ void wgmma_m64n64k8_tf32_rs(float (&d)[32], const unsigned (&a)[4],
                                                       unsigned long long db, int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
        WGMMA_D32_REGS ", {%32, %33, %34, %35}, %36, p, 1, 1;\n"
        "}\n"
        : WGMMA_D32_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// wgmma_m64n32k8_tf32_rs at N = 128 (64 registers a thread, 16 n8 blocks): the same A
// fragment, B 128 K-major rows from a 128-byte-swizzle descriptor.
__device__ __forceinline__ void wgmma_m64n128k8_tf32_rs(float (&d)[64], const unsigned (&a)[4],
                                                        unsigned long long db, int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        WGMMA_D64_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1;\n"
        "}\n"
        : WGMMA_D64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// D[64 x 64] (32 registers a thread) = (scale_d ? D : 0) + A[64 x 16] * B[64 x 16]^T in bf16,
// A from registers (wgmma_m64n256k16_rs_tb's fragment: an accumulator's two n8 blocks packed),
// B K-major from a 128-byte-swizzle descriptor.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db,
                                                   int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        WGMMA_D32_REGS ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : WGMMA_D32_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// The same at N = 128 (64 registers a thread) with B[16 x 128] N-major (wgmma_desc_sw128_mn).
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const unsigned (&a)[4],
                                                       unsigned long long db, int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        WGMMA_D64_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
        "}\n"
        : WGMMA_D64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// D[64 x 256] = (scale_d ? D : 0) + A[64 x 16] * B, A from registers (thread t: a[0] = row 16 (t / 32) + (t % 32) / 4,
// columns 2 (t % 4) + {0, 1}; a[1] the row 8 below; a[2], a[3] the same 8 columns on: the
// accumulator layout of two n8 blocks, packed to bf16x2), B[16 x 256] N-major from a descriptor
// (wgmma_desc_sw128_mn).
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[128], const unsigned (&a)[4],
                                                       unsigned long long db, int scale_d) {
    WGMMA_ASM(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WGMMA_D128_REGS
        ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n"
        "}\n"
        : WGMMA_D128_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
