// Shared helpers for Kestrel's CUDA kernels (compiled at run time with NVRTC as one module: the
// SOURCES files of src/cuda/mod.rs concatenated in order, this one first, then ptx.cuh (the
// PTX wrappers), sync.cuh (launch dependencies, barriers), trace.cuh (the decode timeline and
// phase clocks), gemv.cuh (the decode GEMV machinery) and the kernel files). The module is
// built for compute_90a only (the device check accepts compute capability 9.0).
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
