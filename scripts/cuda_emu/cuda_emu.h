// Minimal CPU emulation of the CUDA features gdn.cu uses: one OS thread per CUDA thread,
// blocks one after another, __syncthreads as a barrier, warp shuffles through an exchange
// buffer, cp.async either eager (copy at issue) or deferred (copy at the wait).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <functional>
#include <thread>
#include <vector>
using std::max;
using std::min;
struct uint3_ { unsigned x = 0, y = 0, z = 0; };
inline thread_local uint3_ threadIdx, blockIdx;
inline uint3_ blockDim, gridDim;
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct bf16 { uint16_t v; };
typedef bf16 __nv_bfloat16;
inline float __bfloat162float(bf16 b) { uint32_t u = (uint32_t)b.v << 16; float f; memcpy(&f, &u, 4); return f; }
inline bf16 __float2bfloat16(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return bf16{(uint16_t)(u >> 16)}; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline std::barrier<>* g_block_bar;
inline std::barrier<>* g_warp_bar[32];
inline float g_xchg[32][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp() { g_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xchg[w][l] = v;
    g_warp_bar[w]->arrive_and_wait();
    float r = g_xchg[w][l ^ o];
    g_warp_bar[w]->arrive_and_wait();
    return r;
}

// cp.async: per-thread groups of pending copies.
struct PendingCopy { void* dst; const void* src; bool valid; };
inline bool g_cp_deferred = false;
inline thread_local std::vector<std::vector<PendingCopy>> t_groups;
inline thread_local std::vector<PendingCopy> t_open;
inline void do_copy(const PendingCopy& c) { if (c.valid) memcpy(c.dst, c.src, 16); else memset(c.dst, 0, 16); }
inline void cp_async16(void* smem, const void* gmem, bool valid) {
    if (((uintptr_t)smem & 15) || (valid && ((uintptr_t)gmem & 15))) { fprintf(stderr, "cp.async misaligned\n"); abort(); }
    PendingCopy c{smem, gmem, valid};
    if (g_cp_deferred) t_open.push_back(c); else do_copy(c);
}
inline void cp_async_commit() { t_groups.push_back(t_open); t_open.clear(); }
inline void cp_async_wait_n(size_t keep) {
    while (t_groups.size() > keep) { for (auto& c : t_groups.front()) do_copy(c); t_groups.erase(t_groups.begin()); }
}
inline void cp_async_wait_all() { for (auto& c : t_open) do_copy(c); t_open.clear(); cp_async_wait_n(0); }
inline void cp_async_wait_one() { cp_async_wait_n(1); }

inline void emu_check_align(const void* p) {
    if ((uintptr_t)p & 15) { fprintf(stderr, "misaligned float4 access\n"); abort(); }
}
inline std::vector<unsigned char> g_dyn_smem;
inline float* emu_dyn_smem() { return reinterpret_cast<float*>(g_dyn_smem.data()); }

// Runs kernel(...) over the grid, one block at a time; dynamic shared memory starts as NaN.
template <class F>
void emu_launch(uint3_ grid, unsigned block, size_t smem, F kernel) {
    gridDim = grid;
    blockDim = {block, 1, 1};
    g_dyn_smem.assign(smem + 16, 0xff);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                std::fill(g_dyn_smem.begin(), g_dyn_smem.end(), 0xff);
                std::barrier<> bar(block);
                g_block_bar = &bar;
                std::vector<std::unique_ptr<std::barrier<>>> wb;
                for (unsigned w = 0; w < (block + 31) / 32; w++) {
                    wb.emplace_back(new std::barrier<>(std::min(32u, block - 32 * w)));
                    g_warp_bar[w] = wb.back().get();
                }
                std::vector<std::thread> th;
                for (unsigned t = 0; t < block; t++)
                    th.emplace_back([=] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        t_groups.clear();
                        t_open.clear();
                        kernel();
                        if (!t_groups.empty() || !t_open.empty()) {
                            // a real kernel may exit with copies in flight, but ours should not
                            fprintf(stderr, "cp.async groups left at exit\n");
                            abort();
                        }
                    });
                for (auto& t : th) t.join();
            }
}
