// Launch dependencies and barriers: programmatic dependent launch (griddepcontrol), named
// barriers of some warps of a block, the thread-block cluster's split barrier, and a counter
// published between blocks (release store, acquire load).

// Programmatic dependent launch (sm_90): the decode kernels are launched so that the next
// kernel may start while this one runs. `griddep_launch` lets it (DECODE_KERNEL does at the
// start; with DECODE_KERNEL_NO_LAUNCH the kernel calls it itself); `griddep_wait` blocks until
// the previous kernel has finished and its writes are visible (`griddep_wait_plain`: the same
// without the timeline's hook). Before the wait a kernel may read only immutable data (weights).
// All are no-ops for a normal launch.
__device__ __forceinline__ void griddep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void griddep_wait_plain() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Prefill kernels, launched with programmatic dependent launch by Gpu::launch_dep: wait for the
// previous kernel and its writes before anything else (reads and writes alike), then let the
// next kernel's blocks onto the SMs this one's last wave leaves, so a launch's latency overlaps
// this kernel's tail. Both are no-ops for a normal launch.
// (The untraced wait: the traced one would give every prefill kernel the trace's shared memory.)
#define PREFILL_KERNEL()   \
    griddep_wait_plain(); \
    griddep_launch()

// `bar.sync id, threads`: a barrier of some whole warps of the block (id 0 is __syncthreads').
__device__ __forceinline__ void bar_sync_named(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// `bar.arrive id, threads`: counts toward that barrier without waiting for it.
__device__ __forceinline__ void bar_arrive_named(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The thread-block cluster's barrier (sm_90) in its split form, every thread of the cluster:
// arrive (release: this thread's earlier memory accesses are performed first) early, wait
// (acquire) later.
__device__ __forceinline__ void cluster_arrive_release() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
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
