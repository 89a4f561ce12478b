// Small CPU emulation of the CUDA features Kestrel's kernels use, to run them without a GPU:
// blocks one after another (a thread-block cluster's blocks together, emu_launch_cluster); per
// block an OS thread per warp and, inside it, a fiber (own stack, cooperative switching) per
// lane. A block's per-thread state (stacks, cp.async and wgmma groups), dynamic shared memory,
// mbarriers and named barriers sit in its slot (its rank in the cluster, t_slot). Barriers: __syncwarp, shuffles, ldmatrix and mma switch
// between the warp's lanes; __syncthreads waits for the warp's lanes, then for the other warps.
// Warp-collective operations exchange the lanes' values through the warp's buffers. cp.async
// copies either at issue (eager) or at the wait that covers them (deferred).
//
// emu-provides: griddep_launch griddep_wait cp_async16 cp_async_commit cp_async_wait_all
// emu-provides: cp_async_wait_one cp_async_wait smem_addr ldsm_x4 ldsm_x4_t mma_bf16_16816
// emu-provides: to_tf32 mma_tf32_1688 bar_sync_named ex2_approx gdn_prefetch_l2
// emu-provides: trace_now trace_sm
// emu-provides: wgmma_desc_sw128 wgmma_fence wgmma_commit wgmma_wait fence_proxy_async
// emu-provides: wgmma_fence_operand wgmma_m64n256k16 wgmma_desc_sw128_mn
// emu-provides: wgmma_m64n80k16 wgmma_m64n256k16_rs_tb mbar_init mbar_arrive cp_async_mbar_arrive
// emu-provides: mbar_wait setmaxnreg_dec setmaxnreg_inc bar_arrive_named griddep_wait_plain
// emu-provides: wgmma_m64n64k16_rs wgmma_m64n128k16_rs_tb
// emu-provides: ld_acquire_gpu st_release_gpu spin_pause
// emu-provides: mbar_arrive_expect_tx bulk_load cluster_arrive_release cluster_wait_acquire
// emu-provides: q4_pair
// emu-skips: fill_random_e4m3 (the synthetic FP8 weights; cvt.rn.satfinite.e4m3x2.f32 is not emulated)
// emu-provides: e4m3x4_to_float4 e4m3x4_to_bf16x4
// (build.py drops these from the headers and the kernel files; everything else there compiles
// as written.) bar_sync_named(id, threads): `bar.sync id, threads` for whole warps;
// gdn_prefetch_l2: a prefetch, nothing here.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <optional>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
using std::max;
using std::min;

// ---- CUDA vocabulary ----
struct uint3_ { unsigned x = 0, y = 0, z = 0; };
inline thread_local uint3_ threadIdx, blockIdx;
inline uint3_ blockDim, gridDim;
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
struct bf16 { uint16_t v; };
typedef bf16 __nv_bfloat16;
struct __nv_bfloat162 { bf16 x, y; };
inline float __bfloat162float(bf16 b) { uint32_t u = (uint32_t)b.v << 16; float f; memcpy(&f, &u, 4); return f; }
// Round to nearest even, NaN kept (as cuda_bf16.h does).
inline bf16 __float2bfloat16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{0x7fff};
    u += 0x7fff + ((u >> 16) & 1);
    return bf16{(uint16_t)(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {__float2bfloat16(lo), __float2bfloat16(hi)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {__bfloat162float(v.x), __bfloat162float(v.y)}; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))  // GNU: may stand after `static` (__shared__)
#define __shared__ static  // one copy for all blocks: a cluster kernel must use dynamic smem only
#define __cluster_dims__(...)
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
// sync.cuh's acquire load and release store of a counter (blocks run one after another here,
// so a waiter's publishing block has finished).
inline unsigned ld_acquire_gpu(const unsigned* p) { return std::atomic_ref<const unsigned>(*p).load(std::memory_order_acquire); }
inline void st_release_gpu(unsigned* p, unsigned v) { std::atomic_ref<unsigned>(*p).store(v, std::memory_order_release); }
inline void spin_pause(unsigned) {}
template <class T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void griddep_launch() {}
inline void griddep_wait() {}  // one kernel at a time here
inline void griddep_wait_plain() {}

[[noreturn]] inline void emu_fail(const char* what) {
    fprintf(stderr, "cuda_emu: %s (block %u,%u,%u thread %u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
    abort();
}
inline void __trap() { emu_fail("__trap"); }

// ---- Fibers: a lane runs until it reaches a barrier, then the warp's scheduler runs the next ----
#if defined(__x86_64__)
// emu_switch(save, load): pushes the callee-saved registers, stores rsp in *save, continues on
// the stack `load` (saved the same way, or prepared by emu_fiber_stack).
extern "C" void emu_switch(void** save, void* load);
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

enum LaneState { LANE_READY, LANE_AT_WARP_BAR, LANE_AT_BLOCK_BAR, LANE_AT_NAMED_BAR, LANE_AT_CLUSTER_ARRIVE,
                 LANE_AT_CLUSTER_WAIT, LANE_DONE };
// Blocks of one cluster at most (their state slots).
constexpr int EMU_MAX_CLUSTER = 4;
inline thread_local int t_slot = 0;  // this block's rank in its cluster
// The per-thread state index of the calling thread: its block's slot, then threadIdx.x.
inline unsigned emu_tid();
struct Lane {
    void* sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    LaneState state = LANE_READY;
    int bar_id = 0, bar_threads = 0;  // at a named barrier
    bool bar_arrive = false;          // ... only arriving (bar.arrive)
};
struct Warp {
    int id = 0, lanes = 0, cur = 0;
    void* sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    Lane lane[32];
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    // exchange buffers of the warp-collective operations
    uint32_t xchg[32];
    const void* addr[32];
    uint32_t ma[32][4], mb[32][2];
};
inline thread_local Warp* t_warp;
// Named barriers (bar.sync id, threads) of each block: made on first use, counting warps.
inline std::unique_ptr<std::barrier<>> g_named[EMU_MAX_CLUSTER][16];
inline int g_named_threads[EMU_MAX_CLUSTER][16];
inline std::mutex g_named_mu;
inline std::barrier<>* emu_named_bar(int id, int threads) {
    std::lock_guard<std::mutex> lk(g_named_mu);
    if (id <= 0 || id >= 16 || threads <= 0 || threads % 32) emu_fail("bad named barrier");
    if (!g_named[t_slot][id]) {
        g_named[t_slot][id].reset(new std::barrier<>(threads / 32));
        g_named_threads[t_slot][id] = threads;
    } else if (g_named_threads[t_slot][id] != threads) {
        emu_fail("named barrier used with two thread counts");
    }
    return g_named[t_slot][id].get();
}
constexpr size_t EMU_STACK = 256 * 1024;
constexpr int EMU_SLOTS = EMU_MAX_CLUSTER * 1024;
inline std::unique_ptr<char[]> g_stacks[EMU_SLOTS];

inline void emu_to_scheduler(LaneState s) {
    Warp* w = t_warp;
    Lane& l = w->lane[w->cur];
    l.state = s;
#if defined(__x86_64__)
    emu_switch(&l.sp, w->sched_sp);
#else
    swapcontext(&l.uc, &w->sched_uc);
#endif
}

[[noreturn]] inline void emu_fiber_main();

// cp.async: per-thread groups of pending copies.
struct PendingCopy { void* dst; const void* src; bool valid; };
inline bool g_cp_deferred = false;
inline std::vector<std::vector<PendingCopy>> g_cp_groups[EMU_SLOTS];
inline std::vector<PendingCopy> g_cp_open[EMU_SLOTS];
// wgmma: per-thread groups of pending products (see wgmma_m64n256k16 below).
// n: columns (64, 80, 128 or 256); trans_b: B N-major; a_reg: A from registers, this thread's two rows
// (16 k each) gathered from its quad at issue.
struct PendingWgmma {
    float* d;
    unsigned long long da, db;
    int scale_d, n = 256;
    bool trans_b = false, a_reg = false;
    float a[2][16] = {};
};
inline std::vector<std::vector<PendingWgmma>> g_wg_groups[EMU_SLOTS];
inline std::vector<PendingWgmma> g_wg_open[EMU_SLOTS];
inline unsigned emu_tid() { return (unsigned)t_slot * 1024 + threadIdx.x; }

inline void emu_fiber_main() {
    Warp* w = t_warp;
    w->body(w->arg);
    unsigned t = emu_tid();
    // a real kernel may exit with copies in flight, but ours should not
    if (!g_cp_groups[t].empty() || !g_cp_open[t].empty()) emu_fail("cp.async groups left at exit");
    if (!g_wg_groups[t].empty() || !g_wg_open[t].empty()) emu_fail("wgmma groups left at exit");
    emu_to_scheduler(LANE_DONE);
    abort();  // a finished lane is never resumed
}

inline void emu_resume(Warp* w, int l) {
    w->cur = l;
    threadIdx = {(unsigned)(w->id * 32 + l), 0, 0};
    w->lane[l].state = LANE_READY;
#if defined(__x86_64__)
    emu_switch(&w->sched_sp, w->lane[l].sp);
#else
    swapcontext(&w->sched_uc, &w->lane[l].uc);
#endif
}

// Runs the lanes of warp `id` of the current block on this OS thread (cluster_bar: all warps of
// the block's cluster, for the cluster barrier's arrive and wait).
inline void emu_run_warp(int id, int lanes, std::barrier<>* block_bar, void (*body)(void*), void* arg,
                         std::barrier<>* cluster_bar = nullptr) {
    Warp w;
    w.id = id;
    w.lanes = lanes;
    w.body = body;
    w.arg = arg;
    t_warp = &w;
    std::optional<std::barrier<>::arrival_token> cluster_token;  // between a split arrive and its wait
    for (int l = 0; l < lanes; l++) {
        unsigned t = (unsigned)t_slot * 1024 + id * 32 + l;
        if (!g_stacks[t]) g_stacks[t].reset(new char[EMU_STACK]);
        char* top = g_stacks[t].get() + EMU_STACK;
        g_cp_groups[t].clear();
        g_cp_open[t].clear();
        g_wg_groups[t].clear();
        g_wg_open[t].clear();
#if defined(__x86_64__)
        // emu_switch pops 6 registers, then returns into emu_fiber_main with the stack as
        // after a call (rsp = 8 mod 16).
        void** sp = reinterpret_cast<void**>((uintptr_t)top & ~(uintptr_t)15);
        *--sp = nullptr;
        *--sp = reinterpret_cast<void*>(&emu_fiber_main);
        for (int r = 0; r < 6; r++) *--sp = nullptr;
        w.lane[l].sp = sp;
#else
        getcontext(&w.lane[l].uc);
        w.lane[l].uc.uc_stack.ss_sp = g_stacks[t].get();
        w.lane[l].uc.uc_stack.ss_size = EMU_STACK;
        w.lane[l].uc.uc_link = nullptr;
        makecontext(&w.lane[l].uc, (void (*)())emu_fiber_main, 0);
#endif
        w.lane[l].state = LANE_READY;
    }
    for (;;) {
        for (int l = 0; l < lanes; l++)
            if (w.lane[l].state == LANE_READY) emu_resume(&w, l);
        int done = 0, at_warp = 0, at_block = 0, at_named = 0, at_carrive = 0, at_cwait = 0;
        for (int l = 0; l < lanes; l++) {
            LaneState s = w.lane[l].state;
            done += s == LANE_DONE;
            at_warp += s == LANE_AT_WARP_BAR;
            at_block += s == LANE_AT_BLOCK_BAR;
            at_named += s == LANE_AT_NAMED_BAR;
            at_carrive += s == LANE_AT_CLUSTER_ARRIVE;
            at_cwait += s == LANE_AT_CLUSTER_WAIT;
        }
        if (done == lanes) break;
        if (at_warp && (at_block || done || at_named)) emu_fail("a warp barrier (syncwarp, shuffle, ldmatrix, mma) without all lanes");
        if (at_carrive || at_cwait) {
            if ((at_carrive && at_carrive != lanes) || (at_cwait && at_cwait != lanes) || !cluster_bar)
                emu_fail("cluster arrive / wait without all lanes of the warp, or outside a cluster launch");
            if (at_carrive) {
                if (cluster_token) emu_fail("a second cluster arrive before the wait");
                cluster_token.emplace(cluster_bar->arrive());
            } else {
                if (!cluster_token) emu_fail("a cluster wait without an arrive");
                cluster_bar->wait(std::move(*cluster_token));
                cluster_token.reset();
            }
        }
        if (at_named) {
            if (at_named != lanes) emu_fail("a named barrier without all lanes of the warp");
            for (int l = 1; l < lanes; l++)
                if (w.lane[l].bar_id != w.lane[0].bar_id || w.lane[l].bar_threads != w.lane[0].bar_threads ||
                    w.lane[l].bar_arrive != w.lane[0].bar_arrive)
                    emu_fail("lanes of a warp at different named barriers");
            std::barrier<>* b = emu_named_bar(w.lane[0].bar_id, w.lane[0].bar_threads);
            if (w.lane[0].bar_arrive) (void)b->arrive();
            else b->arrive_and_wait();
        }
        if (at_block) block_bar->arrive_and_wait();
        for (int l = 0; l < lanes; l++)
            if (w.lane[l].state != LANE_DONE) w.lane[l].state = LANE_READY;
    }
    block_bar->arrive_and_drop();
    if (cluster_bar) cluster_bar->arrive_and_drop();
    t_warp = nullptr;
}

inline void __syncthreads() { emu_to_scheduler(LANE_AT_BLOCK_BAR); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_to_scheduler(LANE_AT_WARP_BAR); }
inline void bar_sync_named(int id, int threads) {
    Lane& l = t_warp->lane[t_warp->cur];
    l.bar_id = id;
    l.bar_threads = threads;
    l.bar_arrive = false;
    emu_to_scheduler(LANE_AT_NAMED_BAR);
}
inline void bar_arrive_named(int id, int threads) {
    Lane& l = t_warp->lane[t_warp->cur];
    l.bar_id = id;
    l.bar_threads = threads;
    l.bar_arrive = true;
    emu_to_scheduler(LANE_AT_NAMED_BAR);
}
inline void gdn_prefetch_l2(const void*) {}
// The decode timeline's clock and SM id (only compiled in with KESTREL_TRACE, never here).
inline unsigned long long trace_now() { return 0; }
inline unsigned trace_sm() { return 0; }
inline int emu_lane() { return threadIdx.x & 31; }
// ex2.approx.ftz.f32: 2^x with the denormal results flushed to zero (its ~2 ulp error not modelled).
inline float ex2_approx(float x) {
    float y = std::exp2(x);
    return std::fabs(y) < 1.17549435e-38f ? 0.0f : y;
}

// A warp shuffle: every lane publishes v, then reads lane src_of(its lane)'s value.
template <class T, class F>
inline T emu_shfl(T v, F src_of) {
    static_assert(sizeof(T) == 4);
    Warp* w = t_warp;
    int l = emu_lane();
    memcpy(&w->xchg[l], &v, 4);
    __syncwarp();
    T r;
    memcpy(&r, &w->xchg[src_of(l) & 31], 4);
    __syncwarp();
    return r;
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_shfl(v, [o](int l) { return l ^ o; }); }
template <class T>
inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, [src](int) { return src; }); }
template <class T>
inline T __shfl_up_sync(unsigned, T v, int o) { return emu_shfl(v, [o](int l) { return l >= o ? l - o : l; }); }
// Warp-wide integer reductions (redux.sync): every lane publishes v, then all read all 32.
// __match_any_sync: the lanes whose value equals this lane's (all 32 lanes take part).
template <class T>
inline unsigned __match_any_sync(unsigned, T v) {
    unsigned m = 0;
    for (int l = 0; l < 32; l++)
        if (__shfl_sync(0xffffffffu, v, l) == v) m |= 1u << l;
    return m;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
template <class F>
inline unsigned emu_reduce(unsigned v, F op) {
    Warp* w = t_warp;
    memcpy(&w->xchg[emu_lane()], &v, 4);
    __syncwarp();
    unsigned r;
    memcpy(&r, &w->xchg[0], 4);
    for (int l = 1; l < 32; l++) {
        unsigned o;
        memcpy(&o, &w->xchg[l], 4);
        r = op(r, o);
    }
    __syncwarp();
    return r;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) { return emu_reduce(v, [](unsigned a, unsigned b) { return a > b ? a : b; }); }
inline unsigned __reduce_min_sync(unsigned, unsigned v) { return emu_reduce(v, [](unsigned a, unsigned b) { return a < b ? a : b; }); }

// ---- cp.async ----
inline void emu_do_copy(const PendingCopy& c) { if (c.valid) memcpy(c.dst, c.src, 16); else memset(c.dst, 0, 16); }
inline void cp_async16(void* smem, const void* gmem, bool valid) {
    if (((uintptr_t)smem & 15) || (valid && ((uintptr_t)gmem & 15))) emu_fail("cp.async misaligned");
    PendingCopy c{smem, gmem, valid};
    if (g_cp_deferred) g_cp_open[emu_tid()].push_back(c);
    else emu_do_copy(c);
}
inline void cp_async_commit() {
    unsigned t = emu_tid();
    g_cp_groups[t].push_back(g_cp_open[t]);
    g_cp_open[t].clear();
}
inline void cp_async_wait_n(size_t keep) {
    auto& g = g_cp_groups[emu_tid()];
    while (g.size() > keep) { for (auto& c : g.front()) emu_do_copy(c); g.erase(g.begin()); }
}
inline void cp_async_wait_all() {
    for (auto& c : g_cp_open[emu_tid()]) emu_do_copy(c);
    g_cp_open[emu_tid()].clear();
    cp_async_wait_n(0);
}
inline void cp_async_wait_one() { cp_async_wait_n(1); }
template <int N> inline void cp_async_wait() { cp_async_wait_n(N); }

// ---- shared memory ----
inline void emu_check_align(const void* p) {
    if ((uintptr_t)p & 15) emu_fail("misaligned float4 access");
}
inline std::vector<unsigned char> g_dyn_smem_slots[EMU_MAX_CLUSTER];
// The calling block's dynamic shared memory.
inline std::vector<unsigned char>& emu_smem() { return g_dyn_smem_slots[t_slot]; }
inline float* emu_dyn_smem() { return reinterpret_cast<float*>(emu_smem().data()); }
// Shared-window addresses: offsets into the dynamic shared memory (the only shared memory the
// emulated ldmatrix/mma kernels address as numbers).
inline unsigned smem_addr(const void* p) {
    const unsigned char* q = static_cast<const unsigned char*>(p);
    if (q < emu_smem().data() || q >= emu_smem().data() + emu_smem().size()) emu_fail("smem_addr outside dynamic shared memory");
    return (unsigned)(q - emu_smem().data());
}
inline void* emu_smem_ptr(unsigned a) { return emu_smem().data() + a; }

template <int N> inline void setmaxnreg_dec() {}
template <int N> inline void setmaxnreg_inc() {}
// ---- mbarrier: a host-side record per shared-memory word (by block slot and offset), under one
// lock. A phase completes once its arrivals are all in and its transaction bytes (expect_tx up,
// complete_tx down, in either order) are back at zero.
struct EmuMbar { int count = 0, pending = 0; unsigned phase = 0; long long tx = 0; };
inline std::mutex g_mbar_mu;
inline std::unordered_map<unsigned long long, EmuMbar> g_mbars;
inline unsigned long long emu_mbar_key(int slot, unsigned off) { return (unsigned long long)slot << 32 | off; }
inline void mbar_init(unsigned long long* bar, int count) {
    std::lock_guard<std::mutex> g(g_mbar_mu);
    g_mbars[emu_mbar_key(t_slot, smem_addr(bar))] = {count, count, 0, 0};
}
// Under g_mbar_mu: arrivals and transaction bytes on block `slot`'s mbarrier at `off`.
inline void emu_mbar_update(int slot, unsigned off, int arrivals, long long tx_up, long long tx_down) {
    auto it = g_mbars.find(emu_mbar_key(slot, off));
    if (it == g_mbars.end()) emu_fail("mbarrier used before init");
    EmuMbar& m = it->second;
    m.tx += tx_up - tx_down;
    m.pending -= arrivals;
    if (m.pending < 0) emu_fail("mbarrier: more arrivals than its count in a phase");
    if (m.pending == 0 && m.tx == 0) m.pending = m.count, m.phase ^= 1;
}
inline void mbar_arrive(unsigned long long* bar) {
    std::lock_guard<std::mutex> g(g_mbar_mu);
    emu_mbar_update(t_slot, smem_addr(bar), 1, 0, 0);
}
// An arrival that also expects `bytes` of transactions (the tensor copies) in this phase.
inline void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    std::lock_guard<std::mutex> g(g_mbar_mu);
    emu_mbar_update(t_slot, smem_addr(bar), 1, bytes, 0);
}
// The thread's copies land now (deferred ones included), then it arrives.
inline void cp_async_mbar_arrive(unsigned long long* bar) {
    unsigned t = emu_tid();
    for (auto& grp : g_cp_groups[t])
        for (auto& c : grp) emu_do_copy(c);
    for (auto& c : g_cp_open[t]) emu_do_copy(c);
    g_cp_groups[t].clear();
    g_cp_open[t].clear();
    mbar_arrive(bar);
}
// Whole warps wait together: lane 0 looks, a shuffle tells the others (a warp-collective step,
// so no lane spins while another lane of its warp still has to arrive somewhere).
inline void mbar_wait(unsigned long long* bar, unsigned parity) {
    for (;;) {
        int done = 0;
        if (emu_lane() == 0) {
            std::lock_guard<std::mutex> g(g_mbar_mu);
            auto it = g_mbars.find(emu_mbar_key(t_slot, smem_addr(bar)));
            if (it == g_mbars.end()) emu_fail("mbarrier wait before init");
            done = it->second.phase != parity;
        }
        if (__shfl_sync(0xffffffffu, done, 0)) return;
        std::this_thread::yield();
    }
}

// The hardware reads a .tf32 operand's top 19 bits (the low 13 are ignored).
inline float emu_tf32_val(uint32_t reg) { reg &= 0xffffe000u; float f; memcpy(&f, &reg, 4); return f; }

// ---- wgmma (m64n256k16, bf16, f32 accumulators, K-major operands in the 128-byte swizzle) ----
// Each thread computes its own accumulator elements from shared memory through the
// descriptors, as the hardware's address swizzle defines them (16-byte unit bits 4-6 XOR row
// bits 7-9 of the shared address). The products run at the wait that retires their group, so a
// stage overwritten before that wait is read overwritten (as a race on the GPU could).
inline unsigned long long wgmma_desc_sw128(const void* p) {
    unsigned a = smem_addr(p);
    if (a % 1024) emu_fail("wgmma operand tile not 1024-byte aligned");
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// A descriptor's start address, leading and stride offsets in bytes (128-byte swizzle only).
struct EmuDesc { unsigned start, lbo, sbo; };
inline EmuDesc emu_desc(unsigned long long desc) {
    if ((desc >> 62) != 1) emu_fail("wgmma descriptor: not the 128-byte swizzle");
    return {(unsigned)(desc & 0x3FFF) << 4, (unsigned)((desc >> 16) & 0x3FFF) << 4, (unsigned)((desc >> 32) & 0x3FFF) << 4};
}
// The bf16 at unswizzled shared offset `addr` of a 128-byte-swizzle operand.
inline float emu_swizzled_bf16(unsigned addr) {
    addr ^= ((addr >> 7) & 7) << 4;
    if (addr + 2 > emu_smem().size()) emu_fail("wgmma operand outside shared memory");
    bf16 v;
    memcpy(&v, emu_smem().data() + addr, 2);
    return __bfloat162float(v);
}
// Element (row, k) of a K-major operand: 128-byte rows, 8-row groups at the stride offset.
inline float emu_wgmma_elem(unsigned long long desc, int row, int k) {
    const EmuDesc d = emu_desc(desc);
    const unsigned a = d.start + (row / 8) * d.sbo + (row % 8) * 128;
    return emu_swizzled_bf16(a + k * 2);
}
// Element (n, k) of an N-major operand (imm-trans-b): 64-wide N blocks at the leading offset,
// K rows of 128 bytes, 8-row groups at the stride offset.
inline float emu_wgmma_elem_mn(unsigned long long desc, int n, int k) {
    const EmuDesc d = emu_desc(desc);
    return emu_swizzled_bf16(d.start + (n / 64) * d.lbo + (k / 8) * d.sbo + (k % 8) * 128 + (n % 64) * 2);
}
inline void emu_wgmma_run(const PendingWgmma& op) {
    int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    for (int j = 0; j < op.n / 8; j++)  // n8 blocks of the columns
        for (int e = 0; e < 4; e++) {
            int row = 16 * warp + lane / 4 + (e >= 2 ? 8 : 0), col = 8 * j + 2 * (lane % 4) + (e & 1);
            // the k16 dot product exactly (bf16 products are exact in double), then one f32 add,
            // close to the tensor core's wide internal sum
            double dot = 0;
            for (int k = 0; k < 16; k++) {
                float a = op.a_reg ? op.a[e >= 2][k] : emu_wgmma_elem(op.da, row, k);
                float b = op.trans_b ? emu_wgmma_elem_mn(op.db, col, k) : emu_wgmma_elem(op.db, col, k);
                dot += (double)a * b;
            }
            op.d[4 * j + e] = (float)((op.scale_d ? op.d[4 * j + e] : 0.0f) + dot);
        }
}
inline void wgmma_fence() {}
inline void fence_proxy_async() {}
inline void wgmma_fence_operand(float&) {}
inline void wgmma_fence_operand(unsigned&) {}
inline void wgmma_fence_operand(unsigned long long&) {}
inline void wgmma_m64n256k16(float (&d)[128], unsigned long long da, unsigned long long db, int scale_d) {
    g_wg_open[emu_tid()].push_back({d, da, db, scale_d});
}
inline unsigned long long wgmma_desc_sw128_mn(const void* p, unsigned lbo) {
    unsigned a = smem_addr(p);
    if (a % 1024) emu_fail("wgmma operand tile not 1024-byte aligned");
    return ((a & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) | (64ull << 32) | (1ull << 62);
}
inline void wgmma_m64n80k16(float (&d)[40], unsigned long long da, unsigned long long db, int scale_d) {
    PendingWgmma op{d, da, db, scale_d};
    op.n = 80;
    g_wg_open[emu_tid()].push_back(op);
}
// A from registers: the quad's four lanes hold a row pair's 16 k (a[0], a[2]: row g, k 2q.. and
// 8 + 2q..; a[1], a[3]: row g + 8), gathered here as the hardware reads them at issue.
inline void emu_wgmma_bf16_rs(float* d, int n, bool trans_b, const unsigned (&a)[4], unsigned long long db,
                              int scale_d) {
    PendingWgmma op{d, 0, db, scale_d};
    op.n = n;
    op.trans_b = trans_b;
    op.a_reg = true;
    int quad = emu_lane() & ~3;
    for (int q = 0; q < 4; q++)
        for (int r = 0; r < 4; r++) {
            unsigned v = __shfl_sync(0xffffffffu, a[r], quad + q);
            bf16 lo, hi;
            uint16_t l16 = v & 0xffff, h16 = v >> 16;
            memcpy(&lo, &l16, 2);
            memcpy(&hi, &h16, 2);
            int row = r & 1, k = 2 * q + (r >= 2 ? 8 : 0);
            op.a[row][k] = __bfloat162float(lo);
            op.a[row][k + 1] = __bfloat162float(hi);
        }
    g_wg_open[emu_tid()].push_back(op);
}
inline void wgmma_m64n256k16_rs_tb(float (&d)[128], const unsigned (&a)[4], unsigned long long db, int scale_d) {
    emu_wgmma_bf16_rs(d, 256, true, a, db, scale_d);
}
inline void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int scale_d) {
    emu_wgmma_bf16_rs(d, 64, false, a, db, scale_d);
}
inline void wgmma_m64n128k16_rs_tb(float (&d)[64], const unsigned (&a)[4], unsigned long long db, int scale_d) {
    emu_wgmma_bf16_rs(d, 128, true, a, db, scale_d);
}
inline void wgmma_commit() {
    unsigned t = emu_tid();
    g_wg_groups[t].push_back(g_wg_open[t]);
    g_wg_open[t].clear();
}
template <int N> inline void wgmma_wait() {
    auto& g = g_wg_groups[emu_tid()];
    while (g.size() > (size_t)N) { for (auto& op : g.front()) emu_wgmma_run(op); g.erase(g.begin()); }
}

// ---- Tensor cores (PTX ISA layouts) ----
// ldmatrix .m8n8.x4.b16: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i; lane l
// receives in r[i] the elements (row l/4, cols 2(l%4), 2(l%4)+1) of matrix i, the lower column
// in the low half. .trans: the same of the transposed matrix, i.e. (rows 2(l%4), 2(l%4)+1,
// col l/4) of the stored one.
inline void emu_ldsm(unsigned (&r)[4], const void* p, bool trans) {
    if ((uintptr_t)p & 15) emu_fail("ldmatrix row address not 16-byte aligned");
    Warp* w = t_warp;
    int l = emu_lane();
    w->addr[l] = p;
    __syncwarp();
    for (int i = 0; i < 4; i++) {
        uint16_t lo, hi;
        if (!trans) {
            const uint16_t* row = static_cast<const uint16_t*>(w->addr[8 * i + l / 4]);
            lo = row[2 * (l % 4)];
            hi = row[2 * (l % 4) + 1];
        } else {
            lo = static_cast<const uint16_t*>(w->addr[8 * i + 2 * (l % 4)])[l / 4];
            hi = static_cast<const uint16_t*>(w->addr[8 * i + 2 * (l % 4) + 1])[l / 4];
        }
        r[i] = (unsigned)lo | (unsigned)hi << 16;
    }
    __syncwarp();
}
inline void ldsm_x4(unsigned (&r)[4], const void* p) { emu_ldsm(r, p, false); }
inline void ldsm_x4_t(unsigned (&r)[4], const void* p) { emu_ldsm(r, p, true); }

inline float emu_bf16_half(uint32_t reg, int half) { return __bfloat162float(bf16{(uint16_t)(reg >> (16 * half))}); }
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, D = A B + C. g = lane/4, c = 2(lane%4):
// A 16x16: a[0] (g, c..c+1), a[1] (g+8, c..), a[2] (g, 8+c..), a[3] (g+8, 8+c..);
// B 16x8 (k x n): b0 (k c..c+1, n g), b1 (k 8+c.., n g); C/D 16x8: d[0..1] (g, c..c+1),
// d[2..3] (g+8, c..c+1). The products are exact; their sum is formed in double and rounded
// once (the hardware's f32 adds may differ in the last bits).
inline void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    Warp* w = t_warp;
    int l = emu_lane();
    for (int i = 0; i < 4; i++) w->ma[l][i] = a[i];
    w->mb[l][0] = b0;
    w->mb[l][1] = b1;
    __syncwarp();
    int g = l / 4, c = 2 * (l % 4);
    float out[4];
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e / 2), col = c + e % 2;
        double s = d[e];
        for (int k = 0; k < 16; k++) {
            float av = emu_bf16_half(w->ma[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
            float bv = emu_bf16_half(w->mb[col * 4 + (k % 8) / 2][k / 8], k % 2);
            s += (double)av * bv;
        }
        out[e] = (float)s;
    }
    __syncwarp();
    for (int e = 0; e < 4; e++) d[e] = out[e];
}

// An e4m3fn byte's value (NaN for 0x7f / 0xff): cvt.rn.f16x2.e4m3x2 then cvt.f32.f16, both exact.
inline float emu_e4m3(unsigned b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float mag = (e == 15 && m == 7) ? NAN : e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    return (b & 0x80) ? -mag : mag;
}
inline float4 e4m3x4_to_float4(unsigned w) {
    return {emu_e4m3(w & 0xff), emu_e4m3((w >> 8) & 0xff), emu_e4m3((w >> 16) & 0xff), emu_e4m3(w >> 24)};
}
// The f16 bits of a value exactly representable as a normal f16 or zero (an e4m3 value: the
// result of cvt.rn.f16x2.e4m3x2; NaN: 0x7fff).
inline uint32_t emu_f16_bits(float v) {
    if (std::isnan(v)) return 0x7fff;
    const uint32_t s = std::signbit(v) ? 0x8000 : 0;
    if (v == 0) return s;
    int e;
    const double fr = std::frexp(std::fabs((double)v), &e);  // |v| = fr 2^e, fr in [0.5, 1)
    const double mant = (fr * 2 - 1) * 1024;                 // 10 mantissa bits
    if (e - 1 + 15 <= 0 || e - 1 + 15 >= 31 || mant != std::floor(mant)) emu_fail("emu_f16_bits: not an exact normal f16");
    return s | (uint32_t)(e - 1 + 15) << 10 | (uint32_t)mant;
}
// e4m3x4_to_bf16x4's instructions one by one: cvt.rn.f16x2.e4m3x2 (the byte pair's low byte to
// the low half), and 0x7fff7fff, shr 3, lop3 a | (b & 0x80008000), fma.rn.bf16x2 by 2^112 plus -0
// (each half through f32: exact products, one round to bf16).
inline void e4m3x4_to_bf16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
    auto pair = [](uint32_t b16) {
        const uint32_t h = emu_f16_bits(emu_e4m3(b16 & 0xff)) | emu_f16_bits(emu_e4m3(b16 >> 8)) << 16;
        const uint32_t t = (((h & 0x7fff7fffu) >> 3) | (h & 0x80008000u));
        auto half = [](uint32_t x) {
            uint32_t u = x << 16;
            float f;
            memcpy(&f, &u, 4);
            return (uint32_t)__float2bfloat16(f * 0x1p112f + -0.0f).v;
        };
        return half(t & 0xffff) | half(t >> 16) << 16;
    };
    lo = pair(w & 0xffff);
    hi = pair(w >> 16);
}
// shr, lop3 (a & 0x000F000F | 0x43004300), fma.rn.bf16x2 x * 1 - 128: the codes at bits S and
// S + 16 as a bf16 pair (exact).
template <int S>
inline uint32_t q4_pair(uint32_t w) {
    auto half = [](uint32_t h) {
        uint32_t u = h << 16;
        float f;
        memcpy(&f, &u, 4);
        return (uint32_t)__float2bfloat16(f - 128.0f).v;
    };
    const uint32_t t = ((w >> S) & 0x000F000Fu) | 0x43004300u;
    return half(t & 0xffff) | (half(t >> 16) << 16);
}

// cvt.rna.tf32.f32: keep 10 mantissa bits, round half away from zero (magnitude), NaN/inf kept.
inline unsigned to_tf32(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    return u;
}
// mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32, D = A B + C. g = lane/4, c = lane%4:
// A 16x8: a[0] (g, c), a[1] (g+8, c), a[2] (g, c+4), a[3] (g+8, c+4); B 8x8 (k x n):
// b0 (k c, n g), b1 (k c+4, n g); C/D 16x8: d[0..1] (g, 2c..2c+1), d[2..3] (g+8, 2c..2c+1).
// Products exact, summed in double, rounded once (as the bf16 one).
inline void mma_tf32_1688(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    Warp* w = t_warp;
    int l = emu_lane();
    for (int i = 0; i < 4; i++) w->ma[l][i] = a[i];
    w->mb[l][0] = b0;
    w->mb[l][1] = b1;
    __syncwarp();
    int g = l / 4, c = 2 * (l % 4);
    float out[4];
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e / 2), col = c + e % 2;
        double s = d[e];
        for (int k = 0; k < 8; k++) {
            // A (row, k) sits in lane (row % 8) * 4 + k % 4, register row / 8 + 2 * (k / 4)
            float av = emu_tf32_val(w->ma[(row % 8) * 4 + k % 4][row / 8 + 2 * (k / 4)]);
            float bv = emu_tf32_val(w->mb[col * 4 + k % 4][k / 4]);
            s += (double)av * bv;
        }
        out[e] = (float)s;
    }
    __syncwarp();
    for (int e = 0; e < 4; e++) d[e] = out[e];
}

// ---- Thread-block clusters (sm_90) ----
// barrier.cluster.arrive.release / barrier.cluster.wait.acquire, split: the arrive does not
// block; the wait returns once every warp of the cluster has arrived.
inline void cluster_arrive_release() { emu_to_scheduler(LANE_AT_CLUSTER_ARRIVE); }
inline void cluster_wait_acquire() { emu_to_scheduler(LANE_AT_CLUSTER_WAIT); }
// cp.async.bulk (1-D): the bytes land at issue, then complete on the mbarrier.
inline void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    const unsigned off = smem_addr(dst);
    if (off % 16 || (uintptr_t)src % 16 || bytes % 16) emu_fail("bulk copy: unaligned address or size");
    std::vector<unsigned char>& sm = g_dyn_smem_slots[t_slot];
    if (off + bytes > sm.size()) emu_fail("bulk copy outside shared memory");
    memcpy(sm.data() + off, src, bytes);
    std::lock_guard<std::mutex> g(g_mbar_mu);
    emu_mbar_update(t_slot, smem_addr(bar), 0, 0, (long long)bytes);
}

// ---- Launch ----
// Runs kernel() over the grid, one cluster of `cluster` consecutive blocks (along x) at a time,
// a cluster's blocks together; dynamic shared memory starts as NaN.
template <class F>
void emu_launch_cluster(uint3_ grid, unsigned cluster, unsigned block, size_t smem, F kernel) {
    if (block == 0 || block > 1024) emu_fail("bad block size");
    if (cluster == 0 || cluster > (unsigned)EMU_MAX_CLUSTER || grid.x % cluster) emu_fail("bad cluster size");
    gridDim = grid;
    blockDim = {block, 1, 1};
    unsigned nw = (block + 31) / 32;
    auto body = [](void* f) { (*static_cast<F*>(f))(); };
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x0 = 0; x0 < grid.x; x0 += cluster) {
                {
                    std::lock_guard<std::mutex> g(g_mbar_mu);
                    g_mbars.clear();
                }
                std::vector<std::unique_ptr<std::barrier<>>> bars;
                std::barrier<> cluster_bar(nw * cluster);
                std::vector<std::thread> th;
                for (unsigned c = 0; c < cluster; c++) {
                    g_dyn_smem_slots[c].assign(smem + 16, 0xff);
                    for (auto& b : g_named[c]) b.reset();
                    bars.emplace_back(new std::barrier<>(nw));
                }
                for (unsigned c = 0; c < cluster; c++)
                    for (unsigned w = 0; w < nw; w++)
                        th.emplace_back([&, c, w] {
                            t_slot = (int)c;
                            blockIdx = {x0 + c, y, z};
                            emu_run_warp((int)w, (int)std::min(32u, block - 32 * w), bars[c].get(), body, &kernel,
                                         cluster > 1 ? &cluster_bar : nullptr);
                        });
                for (auto& t : th) t.join();
            }
}
// Runs kernel() over the grid, one block at a time.
template <class F>
void emu_launch(uint3_ grid, unsigned block, size_t smem, F kernel) {
    emu_launch_cluster(grid, 1, block, smem, kernel);
}
