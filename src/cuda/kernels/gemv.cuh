// The decode GEMVs' building blocks (gemv.cu, and the MoE's decode kernels and moe_gemv_tiles).

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

// ---- FP8 (e4m3) weights, W8A16: a 16-byte word holds 16 weights, columns 16c..16c+15 of its
// row; the 8 words of a 128-column block share one f32 scale, s[r / 128][c / 128] of the
// matrix's block grid (row-major, ceil(k / 128) blocks a row). A lane takes words c = lane + 32 j
// as for bf16, against the input staged as bf16 words of 8 (two a weight word) or as f32.

// 16 e4m3 weights with 16 inputs (two bf16 words, unpacked), summed in f32 in column order.
__device__ __forceinline__ float dot16_fp8(uint4 w, const X8& x0, const X8& x1) {
    const float4 a = e4m3x4_to_float4(w.x), b = e4m3x4_to_float4(w.y);
    const float4 c = e4m3x4_to_float4(w.z), d = e4m3x4_to_float4(w.w);
    return a.x * x0.a.x + a.y * x0.a.y + a.z * x0.b.x + a.w * x0.b.y + b.x * x0.c.x + b.y * x0.c.y + b.z * x0.d.x +
           b.w * x0.d.y + c.x * x1.a.x + c.y * x1.a.y + c.z * x1.b.x + c.w * x1.b.y + d.x * x1.c.x + d.y * x1.c.y +
           d.z * x1.d.x + d.w * x1.d.y;
}
// The same with 16 f32 inputs.
__device__ __forceinline__ float dot16_fp8(uint4 w, const float* x) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4 x0 = x4[0], x1 = x4[1], x2 = x4[2], x3 = x4[3];
    const float4 a = e4m3x4_to_float4(w.x), b = e4m3x4_to_float4(w.y);
    const float4 c = e4m3x4_to_float4(w.z), d = e4m3x4_to_float4(w.w);
    return a.x * x0.x + a.y * x0.y + a.z * x0.z + a.w * x0.w + b.x * x1.x + b.y * x1.y + b.z * x1.z + b.w * x1.w +
           c.x * x2.x + c.y * x2.y + c.z * x2.z + c.w * x2.w + d.x * x3.x + d.y * x3.y + d.z * x3.z + d.w * x3.w;
}

// Words c = lane + 32 j of R rows (row[q]: its words, null past the matrix; srow[q]: the scales
// of its 128-row block) and each word's block scale.
template <int R, int NV>
__device__ __forceinline__ void load_rows_fp8(uint4 (&v)[R][NV], float (&s)[R][NV], const uint4* const* row,
                                              const float* const* srow) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++)
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int c = lane + 32 * j;
            v[q][j] = row[q] ? __ldg(row[q] + c) : make_uint4(0, 0, 0, 0);
            s[q][j] = row[q] ? __ldg(srow[q] + (c >> 3)) : 0.0f;
        }
}

// Per-lane partial dots of loaded FP8 rows with the bf16-staged input xb (words of 8) or the
// f32 input xs.
template <int R, int NV>
__device__ __forceinline__ void dot_rows_fp8(const uint4 (&v)[R][NV], const float (&s)[R][NV], const uint4* xb,
                                             float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int c = lane + 32 * j;
        const X8 x0 = unpack8(xb[2 * c]), x1 = unpack8(xb[2 * c + 1]);
#pragma unroll
        for (int q = 0; q < R; q++) acc[q] += s[q][j] * dot16_fp8(v[q][j], x0, x1);
    }
}
template <int R, int NV>
__device__ __forceinline__ void dot_rows_fp8(const uint4 (&v)[R][NV], const float (&s)[R][NV], const float* xs,
                                             float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) {
        acc[q] = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) acc[q] += s[q][j] * dot16_fp8(v[q][j], xs + (lane + 32 * j) * 16);
    }
}

// The same for any row length (kw words a row): the runtime-length fallback.
template <int R>
__device__ __forceinline__ void dot_rows_fp8_any(const uint4* const* row, const float* const* srow, const uint4* xb,
                                                 int kw, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
    for (int c = lane; c < kw; c += 32) {
        const X8 x0 = unpack8(xb[2 * c]), x1 = unpack8(xb[2 * c + 1]);
#pragma unroll
        for (int q = 0; q < R; q++)
            if (row[q]) acc[q] += __ldg(srow[q] + (c >> 3)) * dot16_fp8(__ldg(row[q] + c), x0, x1);
    }
}
template <int R>
__device__ __forceinline__ void dot_rows_fp8_any(const uint4* const* row, const float* const* srow, const float* xs,
                                                 int kw, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.0f;
    for (int c = lane; c < kw; c += 32)
#pragma unroll
        for (int q = 0; q < R; q++)
            if (row[q]) acc[q] += __ldg(srow[q] + (c >> 3)) * dot16_fp8(__ldg(row[q] + c), xs + c * 16);
}

// Stage a bf16 vector of k values (k % 8 == 0) into shared memory as it is (xb: 16-byte words
// of 8), then a block barrier.
__device__ __forceinline__ void stage_bf16(uint4* xb, const bf16* __restrict__ x, int k) {
    for (int c = threadIdx.x; c < (k >> 3); c += blockDim.x) xb[c] = reinterpret_cast<const uint4*>(x)[c];
    __syncthreads();
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

// ---- Affine 4-bit weights (MLX, GPTQ, AWQ; W4A16 on the tensor cores) ----
// w[r, c] = scale[r, g] * q[r, c] + bias[r, g], q in 0..15, g = c / group (group 32, 64 or 128).
// Device layout ("q4 tiles", written at upload by src/cuda/upload.rs `q4_tiles`): rows in
// strips of 16, columns in units of 64 (k % 64 == 0, rows % 16 == 0). Unit u of strip s is 512
// bytes, lane l's 16 bytes at uint4 index (s * (k / 64) + u) * 32 + l; its u32 j (k-step j:
// columns 64u + 16j ..) holds the eight codes of lane l's mma.m16n8k16 A fragment (g = l / 4,
// c = 2 (l % 4)), nibbles 0..7 = (g, c), (g+8, c), (g, c+8), (g+8, c+8), (g, c+1), (g+8, c+1),
// (g, c+9), (g+8, c+9) as (row, column) within the 16 x 16 k-step, so that one mask-and-or per
// register pair gives the fragment. Scales and biases: sb[(s * (k / group) + grp) * 16 + r],
// a bf16 pair (scale low, bias high) for row r of strip s.
// The A registers hold the codes q as bf16 (exact), the B operand the bf16 inputs, the
// accumulator f32; per group-span (the 64-column unit, or 32 columns at group 32) the span's sum
// acc = sum q x gives scale * acc + bias * xsum with xsum = sum x of the span (staged beside the
// input). (Leaving the codes at 128 + q and folding -128 scale into the bias saves the
// subtraction but costs the sums ~20x of their f32 precision: 8.7e-6 against the emulator's
// double reference where the exact codes give <= 1.2e-6.)

// The A fragment of one k-step from its u32 of codes: bf16 pairs (q_lo, q_hi) (ptx.cuh's
// q4_pair: a shift, one mask-and-or giving 128 + q, an exact - 128).
__device__ __forceinline__ void q4_frag(unsigned w, unsigned (&a)[4]) {
    a[0] = q4_pair<0>(w);
    a[1] = q4_pair<4>(w);
    a[2] = q4_pair<8>(w);
    a[3] = q4_pair<12>(w);
}

// Columns a span (the unit of scale application): 64, or 32 at group 32.
__host__ __device__ __forceinline__ int q4_span(int group) { return group == 32 ? 32 : 64; }

// Rows of staged input in 32-bit words for m tokens of k (a row padded by 4 words past one token,
// so that the B fragments' 8 token rows fall in distinct banks).
__host__ __device__ __forceinline__ int q4_ldw(int m, int k) { return m == 1 ? k / 2 : k / 2 + 4; }

// Shared memory (bytes) of the q4 GEMV machinery for m tokens of k with `red` floats of
// cross-warp partials: the input (m rows of q4_ldw words; with the RMSNorm, m = 1, its k f32
// weights after), then m * k / span span sums, then red.
__host__ __device__ __forceinline__ int q4_smem(int m, int k, int group, bool norm, int red) {
    return 4 * (m * q4_ldw(m, k) + (norm ? k : 0) + m * (k / q4_span(group)) + red);
}

// Span sums of the staged bf16 input (xw: m rows of ldw words): xsum[t * nspan + i] = sum of
// token t's columns of span i, a warp per (token, span), the block's warps taking every 8th.
// Ends with a block barrier.
__device__ __forceinline__ void q4_span_sums(const unsigned* xw, int ldw, int m, int k, int span, float* xsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nspan = k / span;
    for (int it = warp; it < m * nspan; it += 8) {
        const int t = it / nspan, i = it - t * nspan;
        float v = 0.0f;
        if (lane < span / 2) {
            const unsigned p = xw[t * ldw + i * (span / 2) + lane];
            v = __uint_as_float(p << 16) + __uint_as_float(p & 0xffff0000u);
        }
        v = warp_sum(v);
        if (lane == 0) xsum[it] = v;
    }
    __syncthreads();
}

// Stages m bf16 rows of k into xw (rows of ldw words): row t from x + row_of[t] * k (row_of null:
// row t). Ends with a block barrier.
__device__ __forceinline__ void q4_stage_rows(unsigned* xw, int ldw, const bf16* __restrict__ x,
                                              const int* __restrict__ row_of, int m, int k) {
    const int kv = k >> 3;  // 16-byte words of a row
    for (int i = threadIdx.x; i < m * kv; i += blockDim.x) {
        const int t = i / kv, cw = i - t * kv;
        const size_t src = (size_t)(row_of ? row_of[t] : t) * kv + cw;
        reinterpret_cast<uint4*>(xw + t * ldw)[cw] = reinterpret_cast<const uint4*>(x)[src];
    }
    __syncthreads();
}

// A strip's scale/bias pairs that one warp's NV units use, held in registers and requested with
// the codes (before the wait), not read from global memory inside the products where each
// unit's load waited a round trip (on an H100, gemv_q4's time grew ~2 us a unit a warp: 38 us
// for the GDN in-projection's 12.6 MB). Word p * 32 + lane of the strip's groups from grp0 (the
// first unit's): sb[(s * G + grp0) * 16 + p * 32 + lane]; NV words a lane cover NV units at group
// 32 (two groups a unit), half of them at 64, a quarter at 128 (the rest stay 0).
template <int NV>
struct Q4Sb {
    unsigned w[NV];
    int grp0;
};
// Strip s's pairs for units unit0 .. unit0 + NV - 1 (s < 0: none) of a q4 matrix of k columns.
template <int NV>
__device__ __forceinline__ void q4_load_sb(Q4Sb<NV>& r, const unsigned* __restrict__ sb, int group, int s, int k,
                                           int unit0) {
    const int lane = threadIdx.x & 31, G = k / group;
    r.grp0 = unit0 * 64 / group;
    const int words = ((unit0 * 64 + NV * 64 - 1) / group - r.grp0 + 1) * 16;
    const unsigned* p = sb + ((size_t)(s < 0 ? 0 : s) * G + r.grp0) * 16 + lane;
#pragma unroll
    for (int i = 0; i < NV; i++) r.w[i] = s >= 0 && i * 32 + lane < words ? __ldg(p + i * 32) : 0u;
}
// Row r's pair of group grp from registers q4_load_sb filled (every lane calls it with the same
// grp: the word's slot (grp - grp0) / 2 is the same for all, its lane differs).
template <int NV>
__device__ __forceinline__ unsigned q4_sb_at(const Q4Sb<NV>& s, int grp, int r) {
    const int idx = (grp - s.grp0) * 16 + r, slot = idx >> 5;
    unsigned v = s.w[0];
#pragma unroll
    for (int i = 1; i < NV; i++)
        if (slot == i) v = s.w[i];
    return __shfl_sync(0xffffffffu, v, idx & 31);
}
// The same pair read from global memory (shapes outside the model's: units read as they go).
struct Q4SbGlobal {
    const unsigned* sbp;  // the strip's pairs: row r of group grp at sbp[grp * 16 + r]
    __device__ __forceinline__ unsigned operator()(int grp, int r) const { return sbp[grp * 16 + r]; }
};

// One 64-column unit of a 16-row strip against NT tiles of 8 tokens: the unit's codes wv (this
// lane's 16 bytes), the input xw (m rows of ldw words, column kc0 = the unit's first), span sums
// xs (token t's span i at xs[t * nspan + i]) and the strip's scale/bias pairs (row r's group
// grp: sb_at(grp, r), Q4SbGlobal or q4_sb_at; called alike by every lane), accumulated into
// acc[NT][4] (the C fragment: rows g and g+8, tokens 8 nt + c and + 1).
template <int NT, typename SB>
__device__ __forceinline__ void q4_unit(uint4 wv, const unsigned* xw, int ldw, int m, int kc0, const float* xs,
                                        int nspan, SB sb_at, int group, float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = 2 * (lane & 3);
    const unsigned wj[4] = {wv.x, wv.y, wv.z, wv.w};
    const bool g32 = group == 32;
    float tmp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) tmp[nt][i] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        unsigned a[4];
        q4_frag(wj[j], a);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int t = nt * 8 + g;
            unsigned b0 = 0, b1 = 0;
            if (t < m) {
                const unsigned* xr = xw + t * ldw + (kc0 + 16 * j + c) / 2;
                b0 = xr[0];
                b1 = xr[4];
            }
            mma_bf16_16816(tmp[nt], a, b0, b1);
        }
        if (j == 3 || (g32 && j == 1)) {
            // the span's scale and bias for rows g and g + 8
            const int col = kc0 + 16 * j - (g32 ? 16 : 48), sp = col / (g32 ? 32 : 64), grp = col / group;
            const unsigned p0 = sb_at(grp, g), p1 = sb_at(grp, g + 8);
            const float s0 = __uint_as_float(p0 << 16), c0 = __uint_as_float(p0 & 0xffff0000u);
            const float s1 = __uint_as_float(p1 << 16), c1 = __uint_as_float(p1 & 0xffff0000u);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int t = nt * 8 + c;
                const float x0 = t < m ? xs[t * nspan + sp] : 0.0f, x1 = t + 1 < m ? xs[(t + 1) * nspan + sp] : 0.0f;
                acc[nt][0] += s0 * tmp[nt][0] + c0 * x0;
                acc[nt][1] += s0 * tmp[nt][1] + c0 * x1;
                acc[nt][2] += s1 * tmp[nt][2] + c1 * x0;
                acc[nt][3] += s1 * tmp[nt][3] + c1 * x1;
                tmp[nt][0] = tmp[nt][1] = tmp[nt][2] = tmp[nt][3] = 0.0f;
            }
        }
    }
}

// Strips a block of the q4 GEMVs whose warps hold NV units each (NV = k / 512): two at k = 2,048,
// four at 512, else one (k = 4,096, and NV 0: shapes outside the model's).
__host__ __device__ __forceinline__ constexpr int q4_strips(int nv) { return nv == 4 ? 2 : nv == 1 ? 4 : 1; }

// This warp's codes of up to SPB strips (strip[sp] < 0: none) of a q4 matrix of k columns, units
// warp * NV .. + NV - 1 (NV = k / 512), and (sbr not null: SPB of them) their scale/bias pairs;
// NV 0 loads nothing, q4_dot then reads as it goes. The grouped MoE, whose blocks take many
// chunks of rows, reads the pairs from global memory (sbr null: 176 registers a thread held,
// against 122, for one wait per unit its later chunks find in L1).
template <int NV, int SPB>
__device__ __forceinline__ void q4_load(uint4 (&v)[SPB][NV > 0 ? NV : 1], Q4Sb<(NV > 0 ? NV : 1)>* sbr,
                                        const uint4* __restrict__ w, const unsigned* __restrict__ sb, int group,
                                        const int (&strip)[SPB], int k) {
    if constexpr (NV > 0) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, U = k >> 6;
#pragma unroll
        for (int sp = 0; sp < SPB; sp++) {
#pragma unroll
            for (int i = 0; i < NV; i++)
                v[sp][i] = strip[sp] >= 0 ? __ldg(w + ((size_t)strip[sp] * U + warp * NV + i) * 32 + lane)
                                          : make_uint4(0, 0, 0, 0);
            if (sbr) q4_load_sb<NV>(sbr[sp], sb, group, strip[sp], k, warp * NV);
        }
    }
}

// The strips' products with the staged input (q4_unit over this warp's units), the partial sums
// stored to red[((warp * SPB + sp) * m + t) * 16 + r] (row r of strip sp, token t). Ends with a
// block barrier; q4_red_sum then gives the sum over the 8 warps.
template <int NV, int NT, int SPB>
__device__ __forceinline__ void q4_dot(const uint4 (&v)[SPB][NV > 0 ? NV : 1],
                                       const Q4Sb<(NV > 0 ? NV : 1)>* sbr, const uint4* __restrict__ w,
                                       const unsigned* __restrict__ sb, int group, const int (&strip)[SPB], int k,
                                       const unsigned* xw, int ldw, int m, const float* xsum, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = 2 * (lane & 3);
    const int U = k >> 6, G = k / group, nspan = k / q4_span(group);
    float acc[SPB][NT][4];
#pragma unroll
    for (int sp = 0; sp < SPB; sp++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[sp][nt][i] = 0.0f;
#pragma unroll
    for (int sp = 0; sp < SPB; sp++) {
        if (strip[sp] < 0) continue;
        if (NV > 0 && sbr) {
            const Q4Sb<(NV > 0 ? NV : 1)>& sr = sbr[sp];
            const auto at = [&sr](int grp, int r) { return q4_sb_at(sr, grp, r); };
#pragma unroll
            for (int i = 0; i < (NV > 0 ? NV : 1); i++)
                q4_unit<NT>(v[sp][i], xw, ldw, m, (warp * NV + i) * 64, xsum, nspan, at, group, acc[sp]);
        } else if (NV > 0) {
            const Q4SbGlobal at{sb + (size_t)strip[sp] * G * 16};
#pragma unroll
            for (int i = 0; i < (NV > 0 ? NV : 1); i++)
                q4_unit<NT>(v[sp][i], xw, ldw, m, (warp * NV + i) * 64, xsum, nspan, at, group, acc[sp]);
        } else {
            const Q4SbGlobal at{sb + (size_t)strip[sp] * G * 16};
            for (int u = warp; u < U; u += 8)
                q4_unit<NT>(__ldg(w + ((size_t)strip[sp] * U + u) * 32 + lane), xw, ldw, m, u * 64, xsum, nspan,
                            at, group, acc[sp]);
        }
    }
    TRACE_PHASE(1);
#pragma unroll
    for (int sp = 0; sp < SPB; sp++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int t = nt * 8 + c + (i & 1), r = g + (i >= 2 ? 8 : 0);
                if (t < m) red[((warp * SPB + sp) * m + t) * 16 + r] = acc[sp][nt][i];
            }
    __syncthreads();
}

// Row r of strip sp, token t: the sum of q4_dot's 8 warps' partials.
template <int SPB>
__device__ __forceinline__ float q4_red_sum(const float* red, int sp, int m, int t, int r) {
    float a = 0.0f;
#pragma unroll
    for (int wi = 0; wi < 8; wi++) a += red[((wi * SPB + sp) * m + t) * 16 + r];
    return a;
}

// The few-row and grouped 4-bit MoE's outputs of rows r0 .. r0 + m - 1 from q4_dot's partials
// (feature group fy = blockIdx.y): SWIGLU bf16 act[r, j] = bf16(SiLU(gate) * up) of strips 0
// (gate) and 1 (up), j = 16 fy + (0..15); else f32 y[r, f] of each strip sp, f = 16 (SPB fy + sp)
// + (0..15). Rows of nf.
template <int SPB, bool SWIGLU>
__device__ __forceinline__ void q4_store_rows(const float* red, const int (&strip)[SPB], int m, int nf, int fy, int r0,
                                              void* __restrict__ out) {
    if (SWIGLU) {
        for (int o = threadIdx.x; o < m * 16; o += blockDim.x) {
            const int t = o >> 4, j = fy * 16 + (o & 15);
            if (strip[0] < 0 || j >= nf) continue;
            const float gs = q4_red_sum<SPB>(red, 0, m, t, o & 15), us = q4_red_sum<SPB>(red, 1, m, t, o & 15);
            reinterpret_cast<bf16*>(out)[(size_t)(r0 + t) * nf + j] = __float2bfloat16(silu_f(gs) * us);
        }
    } else {
        for (int o = threadIdx.x; o < SPB * m * 16; o += blockDim.x) {
            const int sp = o / (m * 16), t = (o >> 4) % m, f = (fy * SPB + sp) * 16 + (o & 15);
            if (strip[sp] < 0) continue;
            reinterpret_cast<float*>(out)[(size_t)(r0 + t) * nf + f] = q4_red_sum<SPB>(red, sp, m, t, o & 15);
        }
    }
}
