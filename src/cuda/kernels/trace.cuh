// Diagnostics compiled in with the setting KESTREL_TRACE=1 (src/settings.rs), which defines
// KESTREL_TRACE (the decode timeline) and KESTREL_GDN_TRACE (the GDN state pass's phase clock)
// for the kernels. Without the defines the hooks are empty.

// ---- Decode timeline (compiled in with KESTREL_TRACE=1; see
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

// Phase clock of gdn_chunk_state_t64's block 0 (a state block), compiled in with
// KESTREL_TRACE=1 (Gpu::gdn_phase_trace reads it): per
// chunk (the first GDN_TRACE_CHUNKS), clock64 of the consumer warpgroup's thread 0 at slots 0-7
// and of the W producer's thread 0 at slots 8-15, at the points GDN_PHASE_WG marks.
#define GDN_TRACE_CHUNKS 256
__device__ u64 g_gdn_phase[GDN_TRACE_CHUNKS * 16];
extern "C" __global__ void gdn_phase_read(u64* __restrict__ out) {
    for (int i = threadIdx.x; i < GDN_TRACE_CHUNKS * 16; i += blockDim.x) out[i] = g_gdn_phase[i];
}
// (TEAM: threads a team; its thread 0 writes)
#ifdef KESTREL_GDN_TRACE
#define GDN_PHASE_AT(slot, TEAM)                                                                 \
    if (blockIdx.x == 0 && blockIdx.y == 0 && tid % (TEAM) == 0 && ch < GDN_TRACE_CHUNKS)       \
    g_gdn_phase[ch * 16 + (team_a ? 0 : 8) + (slot)] = clock64()
#else
#define GDN_PHASE_AT(slot, TEAM)
#endif
// a warpgroup's thread 0 (team_a: the consumer, at slots 0-7; the W producer at 8-15)
#define GDN_PHASE_WG(slot) GDN_PHASE_AT(slot, 128)
