// Decode GEMVs (one token): the weights stream once with 16-byte loads, four rows per warp in
// flight; the input vector is staged in shared memory (rounded to bf16 like every GEMM input).

// y[r] = beta * y[r] + W[r, :] . x for W bf16 [n, k]. The input is the bf16 vector `x`, or,
// when `x` is null, the zero-centred RMSNorm of the f32 residual `h` with weight `nw` (block 0
// also stores that as bf16 in `xb_out`, if given, for later kernels). A block stages the input
// once and walks row groups gridDim.x apart (grids are capped for very tall matrices).
// With `arg_val` set (lm_head), also the greedy argmax over rows < arg_limit: per-block
// partials, reduced by the last block into arg_out[0] (and arg_out2[0] if given).
// grid <= ceil(n / (gemv_rows_per_block(k))), block 256, dynamic smem k floats.
// gemv_dec_w: the same with k = 4096 read a warp per whole row (gemv_rows_per_block(k, true)).
template <bool WHOLE_ROWS>
__device__ __forceinline__ void gemv_dec_impl(
    const bf16* __restrict__ w, int n, int k, const bf16* __restrict__ x, const float* __restrict__ h,
    const float* __restrict__ nw, float eps, bf16* __restrict__ xb_out, float* __restrict__ y, float beta,
    float* __restrict__ arg_val, int* __restrict__ arg_idx, unsigned* __restrict__ arg_done, int arg_limit,
    int* __restrict__ arg_out, int* __restrict__ arg_out2) {
    DECODE_KERNEL(TAG_GEMV);
    extern __shared__ float xs[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int rows = gemv_rows_per_block(k, WHOLE_ROWS);
    float best = -INFINITY;  // warp 0: running argmax over this block's rows
    int best_id = 0x7fffffff;
    for (int row0 = blockIdx.x * rows; row0 < n; row0 += gridDim.x * rows) {
        bool staged = row0 != blockIdx.x * rows;
        block_gemv<WHOLE_ROWS>(w, n, k, row0, staged, x, h, nw, eps, blockIdx.x == 0 ? xb_out : nullptr, xs, y, beta);
        if (arg_val) {
            __syncthreads();  // this group's y visible to warp 0
            int r = row0 + lane;
            if (warp == 0 && lane < rows && r < n && r < arg_limit) {
                float v = y[r];
                if (v > best) { best = v; best_id = r; }  // rows ascend: first index kept on ties
            }
        }
    }
    if (!arg_val) return;
    if (warp == 0) {
        warp_argmax(best, best_id);
        if (lane == 0) { arg_val[blockIdx.x] = best; arg_idx[blockIdx.x] = best_id; }
    }
    if (!last_block_done(arg_done)) return;
    float v = -INFINITY;
    int id = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        float ov = __ldcg(arg_val + b);
        int oi = __ldcg(arg_idx + b);
        if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
    }
    block_argmax(v, id);
    if (threadIdx.x == 0) {
        arg_out[0] = id;
        if (arg_out2) arg_out2[0] = id;
    }
}

#define GEMV_DEC(NAME, WHOLE_ROWS)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                     \
        const bf16* __restrict__ w, int n, int k, const bf16* __restrict__ x, const float* __restrict__ h,      \
        const float* __restrict__ nw, float eps, bf16* __restrict__ xb_out, float* __restrict__ y, float beta,  \
        float* __restrict__ arg_val, int* __restrict__ arg_idx, unsigned* __restrict__ arg_done, int arg_limit, \
        int* __restrict__ arg_out, int* __restrict__ arg_out2) {                                               \
        gemv_dec_impl<WHOLE_ROWS>(w, n, k, x, h, nw, eps, xb_out, y, beta, arg_val, arg_idx, arg_done, arg_limit, \
                                  arg_out, arg_out2);                                                            \
    }
GEMV_DEC(gemv_dec, false)
GEMV_DEC(gemv_dec_w, true)
