// Sparse MoE, prefill: the grouped bf16 GEMM over the expert-sorted rows (moe_gemm6, wgmma,
// sm_90a), on moe_plan's tiles of 128 rows.

// K (bf16 elements) a stage of the GEMM; its block tile, G5_BM rows x G5_BN B rows.
#define G4_BK 64
#define G5_BM 128
#define G5_BN 256

// The operand copier of moe_gemm6's producer: T threads (tid 0..T-1) copy a tile's BM gathered
// A rows and BN B rows, 64 bf16 of K a stage, with 16-byte cp.async. Thread t copies chunk t % 8 of rows
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
            const bool v = boff[q] >= 0 && kin;
            cp_async16(sb + RPP * q * G4_BK, v ? wx + boff[q] + k0 : w, v);
        }
    }
    // K tile kt of the A rows alone into the stage (load's first part).
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
                    if (col < inter)
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
            if (rr < rows && col < ndim)
                *reinterpret_cast<uint4*>(out + (size_t)(r0 + rr) * ndim + col) = make_uint4(r[0], r[1], r[2], r[3]);
        }
    }
}

// Grouped GEMM (sm_90a): for each plan tile (expert x, rows tile_row .. + tile_rows of the sorted
// order, at most 128: the plan's tile_m) and block of output columns,
// C[row, n] = sum_k A[a_row(row), k] * W_x[n, k], A bf16 [*, kdim] gathered through `gather`
// (row = the sorted row if gather is null), W bf16 [E, ndim, kdim], kdim % 8 == 0. A 128 x 256
// tile: two consumer warpgroups of 64 rows each issue wgmma m64n256k16 straight from the
// swizzled stages (no ldmatrix, no fragment registers; the accumulators are the only
// per-thread state), whose cp.async copies' XOR-swizzled 128-byte rows are wgmma's 128-byte
// swizzle layout, 64-wide K a stage. SWIGLU: the block's 256 B rows are 128 gate rows, then the
// same 128 up rows, so a thread holds each gate/up pair and writes act = bf16(SiLU(gate) * up)
// [rows, ndim / 2] for 128 columns; else C f32 [rows, ndim] (Y16: bf16). Warp-specialised and
// persistent. Block 384: a producer warpgroup (setmaxnreg 120: its 24 copy
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
// H200 (docs/DECISIONS.md). Dynamic smem G6_SMEM (1024-byte aligned: the
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
// other claim came before it) sets the counter back to zero for the next launch.
__device__ __forceinline__ int g6_next_item(int* claim, int items, int* slot_q, unsigned long long* item_full,
                                            unsigned long long* item_empty, int n, bool leader) {
    const int slot = n & 1;
    if (leader && n >= 2) mbar_wait(&item_empty[slot], ((n >> 1) - 1) & 1);
    if (leader && (threadIdx.x & 31) == 0) {
        int q = atomicAdd(claim, 1);
        if (q >= items) {
            if (q == items + (int)gridDim.x - 1) *claim = 0;  // no block touches it again in this launch
            q = -1;
        }
        slot_q[slot] = q;
        mbar_arrive(&item_full[slot]);
    }
    mbar_wait(&item_full[slot], (n >> 1) & 1);
    const int q = slot_q[slot];
    mbar_arrive(&item_empty[slot]);
    return q;
}

// One landed K stage of a 128 x 256 tile (moe_gemm6): warpgroup wg's 64 A rows of the
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

// The grouped MoE of affine 4-bit experts (q4 tiles, gemv.cuh), prefill calls past the few-row
// path, on the tensor cores without a bf16 copy of the experts: over moe_plan's tiles (tile:
// expert tile_expert, sorted rows tile_row .. + tile_rows, at most 128), a block takes SPB strips
// of 16 features of its tile's expert, holds their codes for its warp's units in registers
// (q4_load, once) and takes the tile's rows 16 at a time: staged (gathered), span sums, q4_dot
// with the rows as two 8-token mma columns, written. SWIGLU: w [E, 2 nf, kdim] (the gate and up
// strips of 16 features), out bf16 act [rows, nf] = bf16(SiLU(g) * u); else w [E, nf, kdim],
// q4_strips(kdim / 512) strips a block, out f32 y [rows, nf]. Input of sorted row r: a[gather[r]]
// (gather null: a[r]), bf16 [*, kdim]. nf % 16 == 0, kdim % 64 == 0.
// grid (max tiles, ceil(nf / (16 (SWIGLU ? 1 : SPB)))), block 256, smem q4_smem(16, kdim,
// group, false, 8 * 16 * 16 * SPB) bytes.
#define MOE_Q4_CHUNK 16
template <int NV, bool SWIGLU>
__device__ __forceinline__ void moe_grouped_q4_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                                    const uint4* __restrict__ w, const unsigned* __restrict__ sb,
                                                    int group, void* __restrict__ out,
                                                    const int* __restrict__ tile_expert,
                                                    const int* __restrict__ tile_row,
                                                    const int* __restrict__ tile_rows,
                                                    const int* __restrict__ num_tiles, int nf, int kdim, float* smem) {
    constexpr int SPB = SWIGLU ? 2 : q4_strips(NV);
    griddep_wait_plain();
    griddep_launch();
    const int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    const int ex = tile_expert[tile], row0 = tile_row[tile], nrows = tile_rows[tile];
    const int per = (SWIGLU ? 2 : 1) * nf, base = ex * per;  // the expert's first weight row
    int strip[SPB];
#pragma unroll
    for (int sp = 0; sp < SPB; sp++) {
        const int f = SWIGLU ? blockIdx.y * 16 + sp * nf : (blockIdx.y * SPB + sp) * 16;
        strip[sp] = (SWIGLU ? blockIdx.y * 16 < nf : f < nf) ? (base + f) / 16 : -1;
    }
    uint4 v[SPB][NV > 0 ? NV : 1];
    q4_load<NV, SPB>(v, nullptr, w, sb, group, strip, kdim);
    const int nspan = kdim / q4_span(group);
    for (int c0 = 0; c0 < nrows; c0 += MOE_Q4_CHUNK) {
        const int m = nrows - c0 < MOE_Q4_CHUNK ? nrows - c0 : MOE_Q4_CHUNK, r0 = row0 + c0;
        const int ldw = q4_ldw(m, kdim);
        unsigned* xw = reinterpret_cast<unsigned*>(smem);
        float* xsum = smem + m * ldw;
        float* red = xsum + m * nspan;
        if (c0) __syncthreads();  // the previous chunk's partial sums are read
        q4_stage_rows(xw, ldw, gather ? a : a + (size_t)r0 * kdim, gather ? gather + r0 : nullptr, m, kdim);
        q4_span_sums(xw, ldw, m, kdim, q4_span(group), xsum);
        q4_dot<NV, 2, SPB>(v, nullptr, w, sb, group, strip, kdim, xw, ldw, m, xsum, red);
        q4_store_rows<SPB, SWIGLU>(red, strip, m, nf, blockIdx.y, r0, out);
    }
}
#define MOE_GROUPED_Q4(NAME, SWIGLU)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                          \
        const bf16* __restrict__ a, const int* __restrict__ gather, const uint4* __restrict__ w,                     \
        const unsigned* __restrict__ sb, int group, void* __restrict__ out, const int* __restrict__ tile_expert,    \
        const int* __restrict__ tile_row, const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,     \
        int nf, int kdim) {                                                                                          \
        extern __shared__ float moe_grouped_q4_xs[];                                                                 \
        if (kdim == 2048)                                                                                            \
            moe_grouped_q4_impl<4, SWIGLU>(a, gather, w, sb, group, out, tile_expert, tile_row, tile_rows, num_tiles, \
                                           nf, kdim, moe_grouped_q4_xs);                                             \
        else if (kdim == 512)                                                                                        \
            moe_grouped_q4_impl<1, SWIGLU>(a, gather, w, sb, group, out, tile_expert, tile_row, tile_rows, num_tiles, \
                                           nf, kdim, moe_grouped_q4_xs);                                             \
        else                                                                                                         \
            moe_grouped_q4_impl<0, SWIGLU>(a, gather, w, sb, group, out, tile_expert, tile_row, tile_rows, num_tiles, \
                                           nf, kdim, moe_grouped_q4_xs);                                             \
    }
MOE_GROUPED_Q4(moe_grouped_q4, false)
MOE_GROUPED_Q4(moe_grouped_swiglu_q4, true)

// The grouped MoE of FP8 experts (e4m3 rows, f32 block scales per 128 x 128: gemv.cuh's FP8
// layout), prefill calls past the few-row path, on the tensor cores without a bf16 copy of the
// experts: moe_grouped_q4's blocks, plan, staging and stores, with the codes read as the
// checkpoint stores them. A strip is 16 weight rows (inside one 128-row scale block: rows % 16
// == 0), a unit its 64 columns from 64u (inside one 128-column block); lane (g, q) (g = lane / 4,
// q = lane % 4) holds words 4u + q of rows g and g + 8, columns 64u + 16q .. + 15. Its u32 j of
// those words gives the A fragment of k-step j: the four columns 64u + 16q + 4j .. + 3 of each
// row are the fragment's logical columns 2q, 2q + 1 (bytes 0, 1) and 8 + 2q, 9 + 2q (bytes 2, 3),
// converted exactly to bf16 (e4m3x4_to_bf16x4). A dot product does not care how its terms are
// ordered, so the B fragment (the staged bf16 input, token = the mma column) takes the same
// columns for the same logical rows: token g's bf16 columns 64u + 16q + 4j .. + 3, for k-steps
// 2h and 2h + 1 one 16-byte shared load (conflict-free: q4_ldw's rows of k / 2 + 4 words). Each
// unit's f32 partial sums (one scale block of the strip) are scaled once: acc += s * unit sum.

// One unit of a strip against NT tiles of 8 tokens (acc[NT][4]: the C fragment, rows g and g + 8,
// tokens 8 nt + 2q and + 1): the lane's words w0 (row g), w1 (row g + 8), the unit's block scale s,
// the input xw (m rows of ldw words; the unit's first column kc0).
template <int NT>
__device__ __forceinline__ void fp8_unit(uint4 w0, uint4 w1, float s, const unsigned* xw, int ldw, int m, int kc0,
                                         float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned r0[4] = {w0.x, w0.y, w0.z, w0.w}, r1[4] = {w1.x, w1.y, w1.z, w1.w};
    float tmp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) tmp[nt][i] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint4 xb[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int t = nt * 8 + g;
            xb[nt] = t < m ? *reinterpret_cast<const uint4*>(xw + t * ldw + kc0 / 2 + 8 * q + 4 * h)
                           : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            unsigned a[4];
            e4m3x4_to_bf16x4(r0[2 * h + jj], a[0], a[2]);
            e4m3x4_to_bf16x4(r1[2 * h + jj], a[1], a[3]);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                mma_bf16_16816(tmp[nt], a, jj ? xb[nt].z : xb[nt].x, jj ? xb[nt].w : xb[nt].y);
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] += s * tmp[nt][i];
}

// The strips' products with the staged input (fp8_unit over this warp's units: NV consecutive
// ones held in v, NV 0: every 8th read as it goes), the partial sums stored to red as q4_dot
// stores them (q4_red_sum and q4_store_rows read them). strip[sp]: the strip's first weight row
// (< 0: none); sc the block scales. Ends with a block barrier.
template <int NV, int NT, int SPB>
__device__ __forceinline__ void fp8_dot(const uint4 (&v)[SPB][NV > 0 ? NV : 1][2], const uint4* __restrict__ w,
                                        const float* __restrict__ sc, const int (&strip)[SPB], int kdim,
                                        const unsigned* xw, int ldw, int m, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = 2 * (lane & 3);
    const int U = kdim >> 6, kw = kdim >> 4, kb = (kdim + 127) >> 7;
#pragma unroll
    for (int sp = 0; sp < SPB; sp++) {
        if (strip[sp] < 0) continue;
        const float* srow = sc + (size_t)(strip[sp] >> 7) * kb;  // the strip's row of block scales
        // one strip's sums at a time (stored before the next strip's products: 8 registers fewer)
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[nt][i] = 0.0f;
        if (NV > 0) {
#pragma unroll
            for (int i = 0; i < (NV > 0 ? NV : 1); i++) {
                const int u = warp * (NV > 0 ? NV : 1) + i;
                fp8_unit<NT>(v[sp][i][0], v[sp][i][1], __ldg(srow + (u >> 1)), xw, ldw, m, u * 64, acc);
            }
        } else {
            const uint4* w0 = w + (size_t)(strip[sp] + g) * kw + (lane & 3);
            for (int u = warp; u < U; u += 8)
                fp8_unit<NT>(__ldg(w0 + 4 * u), __ldg(w0 + 8 * kw + 4 * u), __ldg(srow + (u >> 1)), xw, ldw, m,
                             u * 64, acc);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int t = nt * 8 + c + (i & 1), r = g + (i >= 2 ? 8 : 0);
                if (t < m) red[((warp * SPB + sp) * m + t) * 16 + r] = acc[nt][i];
            }
    }
    __syncthreads();
}

// moe_grouped_q4's kernel for FP8 experts: over moe_plan's tiles, a block takes SPB strips of 16
// features of its tile's expert, holds its warp's units of them in registers (NV = kdim / 512
// units a warp, once) and takes the tile's rows 16 at a time: staged (gathered), fp8_dot with
// the rows as two 8-token mma columns, written. SWIGLU: w [E, 2 nf, kdim] (gate rows, then up
// rows), out bf16 act [rows, nf] = bf16(SiLU(g) * u), SPB 2 (a feature's gate and up strips);
// else w [E, nf, kdim], q4_strips(NV) strips a block, out f32 y [rows, nf]. sc: the stack's block
// scales [ceil(E * rows / 128), ceil(kdim / 128)]. Input of sorted row r: a[gather[r]] (gather
// null: a[r]), bf16 [*, kdim]. nf % 16 == 0, kdim % 64 == 0.
// grid (max tiles, ceil(nf / (16 (SWIGLU ? 1 : SPB)))), block 256, smem
// 4 (16 q4_ldw(16, kdim) + 8 * 16 * 16 * SPB) bytes.
template <int NV, bool SWIGLU>
__device__ __forceinline__ void moe_grouped_fp8_impl(const bf16* __restrict__ a, const int* __restrict__ gather,
                                                     const uint4* __restrict__ w, const float* __restrict__ sc,
                                                     void* __restrict__ out, const int* __restrict__ tile_expert,
                                                     const int* __restrict__ tile_row,
                                                     const int* __restrict__ tile_rows,
                                                     const int* __restrict__ num_tiles, int nf, int kdim,
                                                     float* smem) {
    constexpr int SPB = SWIGLU ? 2 : q4_strips(NV), NVV = NV > 0 ? NV : 1;
    griddep_wait_plain();
    griddep_launch();
    const int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    const int ex = tile_expert[tile], row0 = tile_row[tile], nrows = tile_rows[tile];
    const int per = (SWIGLU ? 2 : 1) * nf, base = ex * per;  // the expert's first weight row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = kdim >> 4;
    int strip[SPB];
#pragma unroll
    for (int sp = 0; sp < SPB; sp++) {
        const int f = SWIGLU ? blockIdx.y * 16 + sp * nf : (blockIdx.y * SPB + sp) * 16;
        strip[sp] = (SWIGLU ? blockIdx.y * 16 < nf : f < nf) ? base + f : -1;
    }
    uint4 v[SPB][NVV][2];
    if constexpr (NV > 0) {
#pragma unroll
        for (int sp = 0; sp < SPB; sp++)
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const uint4* w0 = w + (size_t)(strip[sp] + (lane >> 2)) * kw + 4 * (warp * NV + i) + (lane & 3);
                v[sp][i][0] = strip[sp] >= 0 ? __ldg(w0) : make_uint4(0, 0, 0, 0);
                v[sp][i][1] = strip[sp] >= 0 ? __ldg(w0 + 8 * kw) : make_uint4(0, 0, 0, 0);
            }
    }
    for (int c0 = 0; c0 < nrows; c0 += MOE_Q4_CHUNK) {
        const int m = nrows - c0 < MOE_Q4_CHUNK ? nrows - c0 : MOE_Q4_CHUNK, r0 = row0 + c0;
        const int ldw = q4_ldw(m, kdim);
        unsigned* xw = reinterpret_cast<unsigned*>(smem);
        float* red = smem + m * ldw;
        if (c0) __syncthreads();  // the previous chunk's partial sums are read
        q4_stage_rows(xw, ldw, gather ? a : a + (size_t)r0 * kdim, gather ? gather + r0 : nullptr, m, kdim);
        fp8_dot<NV, 2, SPB>(v, w, sc, strip, kdim, xw, ldw, m, red);
        q4_store_rows<SPB, SWIGLU>(red, strip, m, nf, blockIdx.y, r0, out);
    }
}
#define MOE_GROUPED_FP8(NAME, SWIGLU)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                           \
        const bf16* __restrict__ a, const int* __restrict__ gather, const uint4* __restrict__ w,                      \
        const float* __restrict__ sc, void* __restrict__ out, const int* __restrict__ tile_expert,                   \
        const int* __restrict__ tile_row, const int* __restrict__ tile_rows, const int* __restrict__ num_tiles,      \
        int nf, int kdim) {                                                                                           \
        extern __shared__ float moe_grouped_fp8_xs[];                                                                 \
        if (kdim == 2048)                                                                                             \
            moe_grouped_fp8_impl<4, SWIGLU>(a, gather, w, sc, out, tile_expert, tile_row, tile_rows, num_tiles, nf,   \
                                            kdim, moe_grouped_fp8_xs);                                                \
        else if (kdim == 512)                                                                                         \
            moe_grouped_fp8_impl<1, SWIGLU>(a, gather, w, sc, out, tile_expert, tile_row, tile_rows, num_tiles, nf,   \
                                            kdim, moe_grouped_fp8_xs);                                                \
        else                                                                                                          \
            moe_grouped_fp8_impl<0, SWIGLU>(a, gather, w, sc, out, tile_expert, tile_row, tile_rows, num_tiles, nf,   \
                                            kdim, moe_grouped_fp8_xs);                                                \
    }
MOE_GROUPED_FP8(moe_grouped_fp8, false)
MOE_GROUPED_FP8(moe_grouped_swiglu_fp8, true)
