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

// y[r] = beta * y[r] + W[r, :] . xs for rows r = row0 + warp * 4 + q (q < 4, r < n):
// W bf16 [n, k] read with 16-byte loads (k % 8 == 0), xs the input staged in shared memory.
// The body of the decode GEMVs (dense and per-expert).
__device__ __forceinline__ void rows_dot4(const bf16* __restrict__ w, const float* xs, int n, int k,
                                          int row0, float* __restrict__ y, float beta) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nvec = k / 8;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        int r = row0 + warp * 4 + q;
        if (r >= n) break;
        const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)r * k);
        float acc = 0.0f;
        for (int c = lane; c < nvec; c += 32) {
            uint4 v = wr[c];
            const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
            for (int j = 0; j < 8; j++) acc += __bfloat162float(e[j]) * xs[c * 8 + j];
        }
        acc = warp_sum(acc);
        if (lane == 0) y[r] = beta == 0.0f ? acc : beta * y[r] + acc;
    }
}
