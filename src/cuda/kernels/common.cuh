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

// Dot of 8 bf16 weights (one 16-byte load) with 8 staged f32 inputs.
__device__ __forceinline__ float dot8(uint4 v, const float* x) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
    float4 x0 = reinterpret_cast<const float4*>(x)[0], x1 = reinterpret_cast<const float4*>(x)[1];
    float2 a = __bfloat1622float2(p[0]), b = __bfloat1622float2(p[1]);
    float2 c = __bfloat1622float2(p[2]), d = __bfloat1622float2(p[3]);
    return a.x * x0.x + a.y * x0.y + b.x * x0.z + b.y * x0.w + c.x * x1.x + c.y * x1.y + d.x * x1.z + d.y * x1.w;
}

// acc[q] = row[q][0..k) . xs for R weight rows (null = skip), summed over the warp: every lane
// gets every sum. k % 8 == 0; 16-byte loads, R rows (x2 unrolled) in flight per lane.
// The body of every decode GEMV (dense, per-expert, lm_head).
template <int R>
__device__ __forceinline__ void warp_rows_dot(const bf16* const* row, const float* xs, int k, float* acc) {
    int lane = threadIdx.x & 31, nvec = k >> 3;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
#pragma unroll 2
    for (int c = lane; c < nvec; c += 32) {
        uint4 v[R];
#pragma unroll
        for (int q = 0; q < R; q++)
            v[q] = row[q] ? __ldg(reinterpret_cast<const uint4*>(row[q]) + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < R; q++) acc[q] += dot8(v[q], xs + c * 8);
    }
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = warp_sum(acc[q]);
}

// y[r] = beta * y[r] + W[r, :] . xs for the block's 32 rows from row0 (4 per warp, r < n);
// W bf16 [n, k] row-major.
__device__ __forceinline__ void block_gemv32(const bf16* __restrict__ w, const float* xs, int n, int k, int row0,
                                             float* __restrict__ y, float beta) {
    int lane = threadIdx.x & 31, r0 = row0 + (threadIdx.x >> 5) * 4;
    const bf16* rows[4];
#pragma unroll
    for (int q = 0; q < 4; q++) rows[q] = r0 + q < n ? w + (size_t)(r0 + q) * k : nullptr;
    float acc[4];
    warp_rows_dot<4>(rows, xs, k, acc);
#pragma unroll
    for (int q = 0; q < 4; q++)
        if (lane == q && r0 + q < n) y[r0 + q] = beta == 0.0f ? acc[q] : beta * y[r0 + q] + acc[q];
}

// Stage a bf16 vector of k values into shared memory as f32 (then a block barrier).
__device__ __forceinline__ void stage_bf16(float* xs, const bf16* __restrict__ x, int k) {
    for (int i = threadIdx.x; i < k; i += blockDim.x) xs[i] = __bfloat162float(x[i]);
    __syncthreads();
}

// Stage the zero-centred RMSNorm (1 + w) of the f32 residual h, rounded to bf16 like every GEMM
// input; `xb_out` (may be null) also receives it as bf16. Ends with a block barrier.
__device__ __forceinline__ void stage_rmsnorm(float* xs, const float* __restrict__ h, const float* __restrict__ w,
                                              int k, float eps, bf16* __restrict__ xb_out) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        float v = h[i];
        xs[i] = v;
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / k + eps);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        bf16 b = __float2bfloat16(xs[i] * inv * (1.0f + w[i]));
        xs[i] = __bfloat162float(b);
        if (xb_out) xb_out[i] = b;
    }
    __syncthreads();
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
