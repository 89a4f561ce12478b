// Gated full attention: q/k zero-centred norms + partial NeoX RoPE + KV-cache append, then
// split-K (flash-decoding style) causal GQA attention and a combine that applies the
// sigmoid output gate.

// grid (t, nq + nkv), block hd. qg: [t, nq, 2*hd] ([query | gate] per head); k, v: [t, nkv*hd].
// q_out: [t, nq, hd] f32; caches: [max_seq, nkv, hd] bf16, tokens written at past + s.
// `past_dev`, when set, holds `past` on the device (decode graphs: no per-step arguments).
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                     float* __restrict__ q_out, bf16* __restrict__ k_cache,
                                     bf16* __restrict__ v_cache, int past, const int* __restrict__ past_dev,
                                     int nq, int nkv, int hd, int rot_half, float eps) {
    DECODE_KERNEL(TAG_ATTN_PREP);
    // Weights and the host-written position before the wait, the rotation angle with them;
    // after it, every input at once.
    if (past_dev) past = *past_dev;
    int s = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
    bool is_q = head < nq;
    int kvh = head - nq;
    const float* src = is_q ? qg + ((size_t)s * nq + head) * 2 * hd : k + ((size_t)s * nkv + kvh) * hd;
    const float wi = i < hd ? (is_q ? q_norm : k_norm)[i] : 0.0f;
    int pos = past + s;
    float sn = 0.0f, cs = 1.0f;
    if (i < 2 * rot_half) sincosf((float)pos * inv_freq[i < rot_half ? i : i - rot_half], &sn, &cs);
    griddep_wait();
    extern __shared__ float buf[];
    float x = i < hd ? src[i] : 0.0f;
    const float vi = !is_q && i < hd ? v[((size_t)s * nkv + kvh) * hd + i] : 0.0f;
    float inv = rsqrtf(block_sum(x * x) / hd + eps);
    if (i < hd) buf[i] = x * inv * (1.0f + wi);
    __syncthreads();
    if (i >= hd) return;
    float y = buf[i];
    if (i < 2 * rot_half)
        y = i < rot_half ? buf[i] * cs - buf[i + rot_half] * sn : buf[i] * cs + buf[i - rot_half] * sn;
    if (is_q) {
        q_out[((size_t)s * nq + head) * hd + i] = y;
    } else {
        size_t off = ((size_t)pos * nkv + kvh) * hd + i;
        k_cache[off] = __float2bfloat16(y);
        v_cache[off] = __float2bfloat16(vi);
    }
}

// Prefill's attn_prep (the same outputs; `past` from the host): a warp per (token, head) row,
// 8 rows a block, 16-byte loads and a shuffle reduction, the normalised row staged in the warp's
// shared memory for the rotation's partner reads. attn_prep's block of hd threads per row (147k
// blocks, each with two block barriers, at 8,192 tokens) was latency-bound. Needs hd % 4 == 0.
// Heads h0.. of each row only: h0 = nq leaves the query heads to attn_flash4's fused prep.
// grid ceil(t (nq + nkv - h0) / 8), block 256, dynamic smem 8 hd floats.
extern "C" __global__ void __launch_bounds__(256)
    attn_prep_rows(const float* __restrict__ qg, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                   const float* __restrict__ inv_freq, float* __restrict__ q_out, bf16* __restrict__ k_cache,
                   bf16* __restrict__ v_cache, int past, int t, int nq, int nkv, int hd, int rot_half, float eps,
                   int h0) {
    PREFILL_KERNEL();
    extern __shared__ float prep_rows[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nh = nq + nkv - h0;
    const int r = blockIdx.x * 8 + warp;
    if (r >= t * nh) return;  // warp-uniform; no block barrier below
    const int s = r / nh, head = h0 + r % nh, kvh = head - nq;
    const bool is_q = head < nq;
    const float* src = is_q ? qg + ((size_t)s * nq + head) * 2 * hd : k + ((size_t)s * nkv + kvh) * hd;
    const float* wn = is_q ? q_norm : k_norm;
    float* buf = prep_rows + warp * hd;
    float ss = 0.0f;
    for (int i = 4 * lane; i < hd; i += 128) {
        const float4 x = *reinterpret_cast<const float4*>(src + i);
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        *reinterpret_cast<float4*>(buf + i) = x;
    }
    const float inv = rsqrtf(warp_sum(ss) / hd + eps);
    __syncwarp();
    const int pos = past + s;
    for (int i = lane; i < hd; i += 32) {
        float y = buf[i] * inv * (1.0f + wn[i]);
        if (i < 2 * rot_half) {
            const int j = i < rot_half ? i + rot_half : i - rot_half;
            const float pj = buf[j] * inv * (1.0f + wn[j]);
            float sn, cs;
            sincosf((float)pos * inv_freq[i < rot_half ? i : j], &sn, &cs);
            y = i < rot_half ? y * cs - pj * sn : y * cs + pj * sn;
        }
        if (is_q) {
            q_out[((size_t)s * nq + head) * hd + i] = y;
        } else {
            const size_t off = ((size_t)pos * nkv + kvh) * hd + i;
            k_cache[off] = __float2bfloat16(y);
            v_cache[off] = __float2bfloat16(v[((size_t)s * nkv + kvh) * hd + i]);
        }
    }
}

// One warp per (query s, head h, split). Keys [split*chunk, min(...)) of the 0..past+s range.
// part: [t, nq, nsplit, hd + 2] = acc[hd], running max, running sum. With `past_dev` set, past
// comes from the device and chunk = max(64, ceil(n / nsplit)) is derived from it (decode graphs).
extern "C" __global__ void attn_split(const float* __restrict__ q, const bf16* __restrict__ k_cache,
                                      const bf16* __restrict__ v_cache, float* __restrict__ part,
                                      int past, const int* __restrict__ past_dev, int nq, int nkv, int hd,
                                      int nsplit, int chunk, float scale) {
    if (past_dev) {
        past = *past_dev;
        chunk = max(64, (past + 1 + nsplit - 1) / nsplit);
    }
    int s = blockIdx.x, h = blockIdx.y, sp = blockIdx.z * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (sp >= nsplit) return;
    int kvh = h / (nq / nkv);
    int n = past + s + 1;
    int start = sp * chunk, end = min(start + chunk, n);
    float* out = part + (((size_t)s * nq + h) * nsplit + sp) * (hd + 2);
    int epl = hd >> 5;  // elements per lane (hd <= 256)
    float qv[8], acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) { qv[e] = e < epl ? q[((size_t)s * nq + h) * hd + lane * epl + e] * scale : 0.f; acc[e] = 0.f; }
    float m = -INFINITY, l = 0.0f;
    for (int p = start; p < end; p++) {
        const bf16* kr = k_cache + ((size_t)p * nkv + kvh) * hd + lane * epl;
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) if (e < epl) d += qv[e] * __bfloat162float(kr[e]);
        d = warp_sum(d);
        float mn = fmaxf(m, d);
        float corr = expf(m - mn), pw = expf(d - mn);
        l = l * corr + pw;
        const bf16* vr = v_cache + ((size_t)p * nkv + kvh) * hd + lane * epl;
#pragma unroll
        for (int e = 0; e < 8; e++) if (e < epl) acc[e] = acc[e] * corr + pw * __bfloat162float(vr[e]);
        m = mn;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) if (e < epl) out[lane * epl + e] = acc[e];
    if (lane == 0) { out[hd] = m; out[hd + 1] = l; }
}

// grid (t, nq), block hd: merge the splits, normalise, apply sigmoid(gate), write bf16 [t, nq*hd].
extern "C" __global__ void attn_combine(const float* __restrict__ part, const float* __restrict__ qg,
                                        bf16* __restrict__ out, int past, const int* __restrict__ past_dev, int nq,
                                        int hd, int nsplit, int chunk) {
    DECODE_KERNEL(TAG_ATTN_COMBINE);
    griddep_wait();
    if (past_dev) {
        past = *past_dev;
        chunk = max(64, (past + 1 + nsplit - 1) / nsplit);
    }
    int s = blockIdx.x, h = blockIdx.y, i = threadIdx.x;  // blockDim.x == hd (a multiple of 32)
    int n = past + s + 1;
    int used = min(nsplit, (n + chunk - 1) / chunk);
    const float* base = part + ((size_t)s * nq + h) * nsplit * (hd + 2);
    // The splits' weights exp(m_sp - max m) in shared memory (nsplit <= 256), read in parallel.
    __shared__ float wsp[256];
    __shared__ float red[32];
    float m = -INFINITY;
    for (int sp = i; sp < used; sp += blockDim.x) m = fmaxf(m, base[sp * (hd + 2) + hd]);
    m = warp_max(m);
    if ((i & 31) == 0) red[i >> 5] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
    float lpart = 0.0f;
    for (int sp = i; sp < used; sp += blockDim.x) {
        float w = expf(base[sp * (hd + 2) + hd] - m);
        wsp[sp] = w;
        lpart += base[sp * (hd + 2) + hd + 1] * w;
    }
    float l = block_sum(lpart);  // (its barriers also publish wsp)
    float acc = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < used; sp++) acc += wsp[sp] * base[sp * (hd + 2) + i];
    float gate = qg[((size_t)s * nq + h) * 2 * hd + hd + i];
    out[((size_t)s * nq + h) * hd + i] = __float2bfloat16(acc / l * sigmoid_f(gate));
}

// Decode attention (one query per head), split-K over the context: a block = one KV head's
// GQA group (a warp per query head) over one split; K/V tiles of 32 positions stream through
// shared memory once for the whole group, double-buffered with cp.async (the next tile loads
// while this one is used). In a tile, lane j scores key j; the online softmax update is per tile;
// each lane accumulates hd/32 output dims. Writes the same partials as attn_split. The position
// comes from the device (graphs). grid (nkv, nsplit), block 32 * (nq / nkv), dynamic smem
// `attn_decode_smem` on the host: 2 stages x (K + V) x 32 x (hd + 8) bf16 + (nq / nkv) * hd floats.
#define ATT_TK 32
extern "C" __global__ void attn_decode(const float* __restrict__ q, const bf16* __restrict__ k_cache,
                                       const bf16* __restrict__ v_cache, float* __restrict__ part,
                                       const int* __restrict__ past_dev, int nq, int nkv, int hd, int nsplit,
                                       float scale) {
    DECODE_KERNEL(TAG_ATTN_DECODE);
    griddep_wait();
    extern __shared__ __align__(16) unsigned char smem[];
    const int ldk = hd + 8;  // bf16 row stride: 16-byte skew between rows, no bank conflicts
    const int tile = ATT_TK * ldk;
    bf16* kv = reinterpret_cast<bf16*>(smem);  // [stage][K | V][ATT_TK][ldk]
    float* qs = reinterpret_cast<float*>(kv + 4 * tile);
    int kvh = blockIdx.x, sp = blockIdx.y, group = nq / nkv;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int h = kvh * group + warp;
    int n = *past_dev + 1;
    int chunk = max(64, (n + nsplit - 1) / nsplit);
    int start = sp * chunk, end = min(start + chunk, n);
    if (start >= end) return;  // whole block: beyond the context (combine ignores it)
    int vecs = hd >> 3;        // 16-byte vectors per row
    auto load_tile = [&](int t0, int stage) {
        int nt = min(ATT_TK, end - t0);
        bf16* ks = kv + stage * 2 * tile;
        for (int idx = threadIdx.x; idx < nt * vecs; idx += blockDim.x) {
            int r = idx / vecs, c = idx % vecs;
            size_t g = ((size_t)(t0 + r) * nkv + kvh) * hd + c * 8;
            cp_async16(ks + r * ldk + c * 8, k_cache + g, true);
            cp_async16(ks + tile + r * ldk + c * 8, v_cache + g, true);
        }
        cp_async_commit();
    };
    load_tile(start, 0);
    for (int i = lane; i < hd; i += 32) qs[warp * hd + i] = q[(size_t)h * hd + i] * scale;
    int epl = hd >> 5;  // output dims per lane (hd <= 256)
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    int stage = 0;
    for (int t0 = start; t0 < end; t0 += ATT_TK, stage ^= 1) {
        int nt = min(ATT_TK, end - t0);
        if (t0 + ATT_TK < end) {
            load_tile(t0 + ATT_TK, stage ^ 1);
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();  // this tile (and qs, the first time) visible to every warp
        const bf16* ks = kv + stage * 2 * tile;
        const bf16* vs = ks + tile;
        float sc = -INFINITY;
        if (lane < nt) {
            const bf16* kr = ks + lane * ldk;
            const float* qr = qs + warp * hd;
            float s0 = 0.0f, s1 = 0.0f;
            for (int c = 0; c < vecs; c += 2) {
                s0 += dot8(*reinterpret_cast<const uint4*>(kr + c * 8), qr + c * 8);
                if (c + 1 < vecs) s1 += dot8(*reinterpret_cast<const uint4*>(kr + (c + 1) * 8), qr + (c + 1) * 8);
            }
            sc = s0 + s1;
        }
        float mn = fmaxf(m, warp_max(sc));
        float corr = expf(m - mn);
        float p = lane < nt ? expf(sc - mn) : 0.0f;
        l = l * corr + warp_sum(p);
        m = mn;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= corr;
        if (epl == 8) {
            for (int j = 0; j < nt; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
                uint4 raw = *reinterpret_cast<const uint4*>(vs + j * ldk + lane * 8);
                const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(v2[e]);
                    acc[2 * e] += pj * f.x;
                    acc[2 * e + 1] += pj * f.y;
                }
            }
        } else {
            for (int j = 0; j < nt; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
                const bf16* vr = vs + j * ldk + lane * epl;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    if (e < epl) acc[e] += pj * __bfloat162float(vr[e]);
            }
        }
        __syncthreads();  // every warp done with this stage before it is refilled
    }
    float* out = part + ((size_t)h * nsplit + sp) * (hd + 2);
#pragma unroll
    for (int e = 0; e < 8; e++)
        if (e < epl) out[lane * epl + e] = acc[e];
    if (lane == 0) {
        out[hd] = m;
        out[hd + 1] = l;
    }
}

// Prefill attention on tensor cores (flash-attention style): a block = 64 queries of one head,
// 4 warps of 16 query rows; key/value tiles of 64 from the bf16 cache; online softmax in f32
// with the running output in shared memory; causal; sigmoid output gate fused.
// Dynamic shared memory: see `flash_smem_bytes` on the host. grid (ceil(t/64), nq), block 128.
#define FQ 64
#define FK 64
extern "C" __global__ void __launch_bounds__(128) attn_flash(
    const float* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const float* __restrict__ qg, bf16* __restrict__ out, int t, int past, int nq, int nkv, int hd, float scale) {
    PREFILL_KERNEL();
    using namespace nvcuda;
    extern __shared__ __align__(128) unsigned char smem[];
    const int ldh = hd + 8;   // bf16 row stride for Q/K/V tiles
    const int ldo = hd + 4;   // f32 row stride for O
    bf16* qs = reinterpret_cast<bf16*>(smem);                 // [FQ][ldh]
    bf16* ks = qs + FQ * ldh;                                   // [FK][ldh]
    bf16* vs = ks + FK * ldh;                                   // [FK][ldh]
    float* os = reinterpret_cast<float*>(vs + FK * ldh);        // [FQ][ldo]
    float* ss = os + FQ * ldo;                                  // [FQ][FK + 4]
    bf16* ps = reinterpret_cast<bf16*>(ss + FQ * (FK + 4));     // [FQ][FK + 8]
    float* mrow = reinterpret_cast<float*>(ps + FQ * (FK + 8)); // [FQ]
    float* lrow = mrow + FQ;                                    // [FQ]
    const int q0 = blockIdx.x * FQ, h = blockIdx.y, kvh = h / (nq / nkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    for (int idx = tid; idx < FQ * hd; idx += 128) {
        int r = idx / hd, c = idx % hd;
        float v = q0 + r < t ? q[((size_t)(q0 + r) * nq + h) * hd + c] * scale : 0.0f;
        qs[r * ldh + c] = __float2bfloat16(v);
        os[r * ldo + c] = 0.0f;
    }
    if (tid < FQ) { mrow[tid] = -INFINITY; lrow[tid] = 0.0f; }
    const int n_valid = past + t;                       // keys in the cache
    const int n_end = min(n_valid, past + q0 + FQ);     // last row's causal bound (exclusive)
    for (int k0 = 0; k0 < n_end; k0 += FK) {
        __syncthreads();
        for (int idx = tid; idx < FK * (hd / 8); idx += 128) {
            int r = idx / (hd / 8), c = (idx % (hd / 8)) * 8;
            int kp = k0 + r;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (kp < n_valid) {
                size_t off = ((size_t)kp * nkv + kvh) * hd + c;
                kv4 = *reinterpret_cast<const uint4*>(k_cache + off);
                vv4 = *reinterpret_cast<const uint4*>(v_cache + off);
            }
            *reinterpret_cast<uint4*>(ks + r * ldh + c) = kv4;
            *reinterpret_cast<uint4*>(vs + r * ldh + c) = vv4;
        }
        __syncthreads();
        // S = Q K^T for this warp's 16 rows: 16 x 32.
        const int wr = warp * 16;
        {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc[FK / 16];
#pragma unroll
            for (int j = 0; j < FK / 16; j++) wmma::fill_fragment(sacc[j], 0.0f);
            for (int kk = 0; kk < hd; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
                wmma::load_matrix_sync(fa, qs + wr * ldh + kk, ldh);
#pragma unroll
                for (int j = 0; j < FK / 16; j++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
                    wmma::load_matrix_sync(fb, ks + (j * 16) * ldh + kk, ldh);
                    wmma::mma_sync(sacc[j], fa, fb, sacc[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < FK / 16; j++)
                wmma::store_matrix_sync(ss + wr * (FK + 4) + j * 16, sacc[j], FK + 4, wmma::mem_row_major);
        }
        __syncwarp();
        // Online softmax: 2 lanes per row, FK/2 columns each.
        {
            int r = wr + (lane >> 1), half = lane & 1;
            int qpos = past + q0 + r;
            bool row_ok = q0 + r < t;
            float mx = -INFINITY;
            for (int c = half * (FK / 2); c < (half + 1) * (FK / 2); c++) {
                int kp = k0 + c;
                float s = ss[r * (FK + 4) + c];
                if (row_ok && kp <= qpos && kp < n_valid) mx = fmaxf(mx, s);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            float m_old = mrow[r];
            float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int c = half * (FK / 2); c < (half + 1) * (FK / 2); c++) {
                int kp = k0 + c;
                float s = ss[r * (FK + 4) + c];
                float p = (row_ok && kp <= qpos && kp < n_valid) ? expf(s - m_new) : 0.0f;
                ps[r * (FK + 8) + c] = __float2bfloat16(p);
                sum += p;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            float corr = (m_new == -INFINITY) ? 1.0f : expf(m_old - m_new);
            __syncwarp();
            if (half == 0) { mrow[r] = m_new; lrow[r] = lrow[r] * corr + sum; }
            // Rescale this row of O (each of the two lanes takes half of the columns).
            for (int c = half; c < hd; c += 2) os[r * ldo + c] *= corr;
        }
        __syncwarp();
        // O += P V for this warp's rows.
        for (int j = 0; j < hd; j += 16) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> oacc;
            wmma::load_matrix_sync(oacc, os + wr * ldo + j, ldo, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < FK; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fp;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fv;
                wmma::load_matrix_sync(fp, ps + wr * (FK + 8) + kk, FK + 8);
                wmma::load_matrix_sync(fv, vs + kk * ldh + j, ldh);
                wmma::mma_sync(oacc, fp, fv, oacc);
            }
            wmma::store_matrix_sync(os + wr * ldo + j, oacc, ldo, wmma::mem_row_major);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < FQ * hd; idx += 128) {
        int r = idx / hd, c = idx % hd;
        int s = q0 + r;
        if (s >= t) continue;
        float gate = qg[((size_t)s * nq + h) * 2 * hd + hd + c];
        out[((size_t)s * nq + h) * hd + c] = __float2bfloat16(os[r * ldo + c] / lrow[r] * sigmoid_f(gate));
    }
}

// ---- Warp-level pieces of the mma.sync attention kernels (a warp = 16 query rows) ----
// S (16 rows x NK keys) = Q Kᵀ: Q rows at qw, K rows at kt, both bf16 with row stride LD.
template <int HD, int NK, int LD>
__device__ __forceinline__ void warp_qk(float (&s)[NK / 8][4], const bf16* qw, const bf16* kt, int lane) {
#pragma unroll
    for (int n = 0; n < NK / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        unsigned a[4];
        ldsm_x4(a, qw + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int nb = 0; nb < NK / 16; nb++) {
            unsigned b[4];
            ldsm_x4(b, kt + (nb * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_bf16_16816(s[2 * nb], a, b[0], b[1]);
            mma_bf16_16816(s[2 * nb + 1], a, b[2], b[3]);
        }
    }
}

// 2^x on the special-function unit alone (ex2.approx.ftz: ~2 ulp, results below 2^-126
// flushed to 0, 2^-inf = 0); exp2f adds a range fix-up of 3 instructions around it.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// Causal / cache-end mask of a warp's score tile (mma accumulator layout, NK keys from k0):
// -inf where the key lies past the row's position (qpos0 for row g, qpos0 + 8 for row g + 8)
// or past the cache's n_valid keys. cq = 2 (lane % 4).
template <int NK>
__device__ __forceinline__ void warp_causal_mask(float (&s)[NK / 8][4], int k0, int qpos0, int n_valid, int cq) {
#pragma unroll
    for (int n = 0; n < NK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int kp = k0 + n * 8 + cq + (e & 1), qp = qpos0 + 8 * (e >> 1);
            if (kp > qp || kp >= n_valid) s[n][e] = -INFINITY;
        }
}

// Online softmax (base 2) of one tile's scores, rows g (m0, l0) and g + 8 (m1, l1); a row lives
// in the 4 lanes of a quad, l stays a per-lane partial sum. Rescales o; leaves P in s.
// SFU (attn_flash4): exponentials by ex2_approx, and o rescaled only when o_live and one of the
// thread's row maxima moved (o is not yet written before the first tile's P V there).
template <int HD, int NK, bool SFU = false>
__device__ __forceinline__ void warp_softmax(float (&s)[NK / 8][4], float (&o)[HD / 8][4], float& m0, float& m1,
                                             float& l0, float& l1, bool o_live = true) {
    auto exp2_ = [](float x) { return SFU ? ex2_approx(x) : exp2f(x); };
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int n = 0; n < NK / 8; n++) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float b0 = mx0 == -INFINITY ? 0.0f : mx0, b1 = mx1 == -INFINITY ? 0.0f : mx1;  // fully masked rows
    const float c0 = exp2_(m0 - b0), c1 = exp2_(m1 - b1);
    const bool moved = mx0 != m0 || mx1 != m1;
    m0 = mx0;
    m1 = mx1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < NK / 8; n++) {
        s[n][0] = exp2_(s[n][0] - b0);
        s[n][1] = exp2_(s[n][1] - b0);
        s[n][2] = exp2_(s[n][2] - b1);
        s[n][3] = exp2_(s[n][3] - b1);
        sum0 += s[n][0] + s[n][1];
        sum1 += s[n][2] + s[n][3];
    }
    l0 = l0 * c0 + sum0;
    l1 = l1 * c1 + sum1;
    if (SFU && !(o_live && moved)) return;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        o[n][0] *= c0;
        o[n][1] *= c0;
        o[n][2] *= c1;
        o[n][3] *= c1;
    }
}

// The A fragment of keys 16 kk.. for O += P V: the probabilities of key blocks 2kk, 2kk + 1
// (accumulator layout) packed to bf16 pairs.
template <int NK>
__device__ __forceinline__ void p_frag(const float (&s)[NK / 8][4], int kk, unsigned (&a)[4]) {
    a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// O += P V: the S accumulators of key blocks 2kk, 2kk+1 are the A fragment of keys 16kk.. (V
// rows at vt, bf16, row stride LD, read transposed).
template <int HD, int NK, int LD>
__device__ __forceinline__ void warp_pv(float (&o)[HD / 8][4], const float (&s)[NK / 8][4], const bf16* vt, int lane) {
#pragma unroll
    for (int kk = 0; kk < NK / 16; kk++) {
        unsigned a[4];
        p_frag<NK>(s, kk, a);
#pragma unroll
        for (int nb = 0; nb < HD / 16; nb++) {
            unsigned b[4];
            ldsm_x4_t(b, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + nb * 16 + (lane >> 4) * 8);
            mma_bf16_16816(o[2 * nb], a, b[0], b[1]);
            mma_bf16_16816(o[2 * nb + 1], a, b[2], b[3]);
        }
    }
}

// Prefill attention on mma.sync tensor cores (flash-attention 2 style). A block = 64 query
// positions x FA_HPB query heads of one KV group (warps 0-3 the first head, 4-7 the second, 16
// rows each), so every K/V tile staged in shared memory serves both heads. K/V tiles of 64 keys
// stream from the bf16 cache through a two-stage cp.async pipeline; S = Q K^T, the online
// softmax (base 2, Q pre-scaled by scale * log2 e) and O += P V all stay in registers (P is
// reused from the S accumulators as the A operand). Causal over `past + t` cached keys; the
// sigmoid output gate is fused into the store. Query blocks run latest first (most keys).
// Same arguments as attn_flash (hd = HD). grid (nq / FA_HPB, ceil(t / 64)), block 256, dynamic
// smem flash2_smem_bytes(HD) (model.rs). The head pairs are x, so the blocks, dispatched in
// linear order, go heaviest query tile first over all heads (longest-first: the light tiles
// fill in behind; with the query tiles on x, a later head's heaviest tiles started last).
#define FA_BQ 64
#define FA_BK 64
#define FA_HPB 2

// The flash kernels' copies (block of 256 threads): K and V rows k0.. (FA_BK of them) of KV
// head kvh into ks / vs (row stride LD), zero past n_valid, as one cp.async group.
template <int HD, int LD>
__device__ __forceinline__ void flash_load_kv(bf16* ks, bf16* vs, const bf16* __restrict__ kc,
                                              const bf16* __restrict__ vc, int k0, int n_valid, int nkv, int kvh) {
    constexpr int VPR = HD / 8;
    for (int v = threadIdx.x; v < FA_BK * VPR; v += 256) {
        int r = v / VPR, c = (v % VPR) * 8, kp = k0 + r;
        bool ok = kp < n_valid;
        size_t off = ((size_t)(ok ? kp : 0) * nkv + kvh) * HD + c;
        cp_async16(ks + r * LD + c, kc + off, ok);
        cp_async16(vs + r * LD + c, vc + off, ok);
    }
    cp_async_commit();
}

// Queries q0.. (FA_BQ of them, zero past t) of the FA_HPB heads from h0, times scale·log2 e, as
// bf16 rows of qs (head-major, row stride LD).
template <int HD, int LD>
__device__ __forceinline__ void flash_stage_q(bf16* qs, const float* __restrict__ q, int t, int q0, int nq, int h0,
                                              float scale_log2) {
    for (int v = threadIdx.x; v < FA_HPB * FA_BQ * (HD / 4); v += 256) {
        int rr = v / (HD / 4), c = (v % (HD / 4)) * 4, hh = rr / FA_BQ, r = rr % FA_BQ;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (q0 + r < t) x = *reinterpret_cast<const float4*>(q + ((size_t)(q0 + r) * nq + h0 + hh) * HD + c);
        unsigned* d = reinterpret_cast<unsigned*>(qs + rr * LD + c);
        d[0] = pack_bf16x2(x.x * scale_log2, x.y * scale_log2);
        d[1] = pack_bf16x2(x.z * scale_log2, x.w * scale_log2);
    }
}

// `bar.sync id, threads`: a barrier of some whole warps of the block (id 0 is __syncthreads').
__device__ __forceinline__ void bar_sync_named(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// `bar.arrive id, threads`: counts toward that barrier without waiting for it.
__device__ __forceinline__ void bar_arrive_named(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The end of a warp's 16-row tile (mma accumulator layout: rows r0 and r0 + 8 of the thread's
// quad, l0 / l1 per-lane partial row sums): the quad's sums, then O / l times sigmoid(gate) as
// bf16 into out for the rows below t, head h.
template <int HD>
__device__ __forceinline__ void flash_store_rows(const float (&o)[HD / 8][4], float l0, float l1, int r0, int t, int h,
                                                 int nq, const float* __restrict__ qg, bf16* __restrict__ out,
                                                 int cq) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int srow = r0 + half * 8;
        if (srow >= t) continue;
        const float inv = 1.0f / (half ? l1 : l0);
        const float* gate = qg + ((size_t)srow * nq + h) * 2 * HD + HD;
        bf16* dst = out + ((size_t)srow * nq + h) * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            const int c = n * 8 + cq;
            const float2 gt = *reinterpret_cast<const float2*>(gate + c);
            *reinterpret_cast<unsigned*>(dst + c) =
                pack_bf16x2(o[n][2 * half] * inv * sigmoid_f(gt.x), o[n][2 * half + 1] * inv * sigmoid_f(gt.y));
        }
    }
}
template <int HD>
__device__ __forceinline__ void attn_flash2_body(const float* __restrict__ q, const bf16* __restrict__ kc,
                                                 const bf16* __restrict__ vc, const float* __restrict__ qg,
                                                 bf16* __restrict__ out, int t, int past, int nq, int nkv,
                                                 float scale_log2) {
    constexpr int LD = HD + 8;  // padded rows: the 8 row addresses of an ldmatrix hit distinct banks
    extern __shared__ __align__(128) unsigned char fa_smem[];
    bf16* qs = reinterpret_cast<bf16*>(fa_smem);  // [FA_HPB * FA_BQ][LD]
    bf16* ks = qs + FA_HPB * FA_BQ * LD;       // [2][FA_BK][LD]
    bf16* vs = ks + 2 * FA_BK * LD;            // [2][FA_BK][LD]
    const int q0 = (gridDim.y - 1 - blockIdx.y) * FA_BQ;  // heaviest query tiles first (flash_grid)
    const int h0 = blockIdx.x * FA_HPB, kvh = h0 / (nq / nkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n_valid = past + t;
    const int n_end = min(n_valid, past + q0 + FA_BQ);
    const int ntiles = (n_end + FA_BK - 1) / FA_BK;
    auto load_kv = [&](int buf, int k0) {
        flash_load_kv<HD, LD>(ks + buf * FA_BK * LD, vs + buf * FA_BK * LD, kc, vc, k0, n_valid, nkv, kvh);
    };
    load_kv(0, 0);
    flash_stage_q<HD, LD>(qs, q, t, q0, nq, h0, scale_log2);
    const int hh = warp / 4, wr = (warp % 4) * 16;
    const int g = lane >> 2, cq = 2 * (lane & 3);
    const int qpos0 = past + q0 + wr + g;  // this thread's first row; the second is 8 below
    const bf16* qw = qs + (hh * FA_BQ + wr) * LD;
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) {
            load_kv((j + 1) & 1, (j + 1) * FA_BK);
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();
        const bf16* kt = ks + (j & 1) * FA_BK * LD;
        const bf16* vt = vs + (j & 1) * FA_BK * LD;
        const int k0 = j * FA_BK;
        // S = Q K^T: 16 rows x 64 keys per warp.
        float s[FA_BK / 8][4];
        warp_qk<HD, FA_BK, LD>(s, qw, kt, lane);
        // Causal / cache-end mask, only on tiles that reach past this warp's first row.
        if (k0 + FA_BK - 1 > past + q0 + wr || k0 + FA_BK > n_valid) warp_causal_mask<FA_BK>(s, k0, qpos0, n_valid, cq);
        warp_softmax<HD, FA_BK>(s, o, m0, m1, l0, l1);
        warp_pv<HD, FA_BK, LD>(o, s, vt, lane);
        __syncthreads();  // the next iteration's prefetch overwrites this buffer
    }
    flash_store_rows<HD>(o, l0, l1, q0 + wr + g, t, h0 + hh, nq, qg, out, cq);
}

// The prefill flash kernels' entry points, one per head dim: attn_flash<V>_hd<HD> runs
// attn_flash<V>_body<HD> with the scale in log2 units (the softmax uses exp2).
#define ATTN_FLASH_ENTRY(V, HD)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1) attn_flash##V##_hd##HD(                             \
        const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,              \
        const float* __restrict__ qg, bf16* __restrict__ out, int t, int past, int nq, int nkv, int hd,         \
        float scale) {                                                                                       \
        PREFILL_KERNEL();                                                                                    \
        attn_flash##V##_body<HD>(q, kc, vc, qg, out, t, past, nq, nkv, scale * 1.4426950408889634f);        \
    }
ATTN_FLASH_ENTRY(2, 32)
ATTN_FLASH_ENTRY(2, 64)
ATTN_FLASH_ENTRY(2, 128)
ATTN_FLASH_ENTRY(2, 256)

// Prefill attention, version 3: attn_flash2's block (64 query positions x 2 heads of one KV
// group, 8 warps, K/V tiles of 64 keys from the bf16 cache, double-buffered cp.async, base-2
// online softmax in registers, gate fused, heaviest blocks first), with half the shared-memory
// reads per tensor-core product. The 8 warps form 4 pairs; a pair owns 32 query rows of one
// head. Per K/V tile:
//   S: each warp of the pair scores all 32 rows against its half of the keys (32 x 32, so every
//      Q and K fragment feeds 4 mma instead of 8 and 2: 64 ldmatrix per 128 mma, not 80);
//   softmax: the pair exchanges row maxima through shared memory (named barrier of 64 threads),
//      both warps form the same new max and correction; each packs its P (bf16) and hands it to
//      the other as raw fragment registers (2 KB per warp);
//   O += P V: each warp accumulates all 32 rows x its half of the head dims, so every V
//      fragment feeds 4 mma instead of 2 (32 ldmatrix per 128 mma, not 64); its own P half first,
//      the partner's after the second pair barrier.
// One block barrier per tile (the prefetch of tile j + 1 is issued after it, into the buffer
// every warp finished with in tile j - 1). The row sums are per key half, added at the end.
// Registers as attn_flash2 (O: 32 rows x HD/2 dims = HD/2 floats a thread at most 128).
// Same arguments and grid as attn_flash2 (grid (nq / 2, ceil(t / 64)), block 256); dynamic smem
// flash3_smem(HD) in attention.rs: Q 128 x (HD + 8) + 2 x (K + V) 64 x (HD + 8) bf16, the P
// exchange 8 warps x 2 KB, the max / sum exchange 8 warps x 512 B.
template <int HD>
__device__ __forceinline__ void attn_flash3_body(const float* __restrict__ q, const bf16* __restrict__ kc,
                                                 const bf16* __restrict__ vc, const float* __restrict__ qg,
                                                 bf16* __restrict__ out, int t, int past, int nq, int nkv,
                                                 float scale_log2) {
    constexpr int LD = HD + 8;  // padded rows: the 8 row addresses of an ldmatrix hit distinct banks
    constexpr int HD2 = HD / 2;  // head dims of O per warp
    extern __shared__ __align__(128) unsigned char fa3_smem[];
    bf16* qs = reinterpret_cast<bf16*>(fa3_smem);  // [2 heads x 64][LD]
    bf16* ks = qs + 2 * FA_BQ * LD;                // [2][FA_BK][LD]
    bf16* vs = ks + 2 * FA_BK * LD;                // [2][FA_BK][LD]
    uint4* px = reinterpret_cast<uint4*>(vs + 2 * FA_BK * LD);  // [8 warps][4][32 lanes] P fragments
    float4* mxs = reinterpret_cast<float4*>(px + 8 * 4 * 32);   // [8 warps][32 lanes] row max / sum
    const int q0 = (gridDim.y - 1 - blockIdx.y) * FA_BQ;  // heaviest query tiles first (flash_grid)
    const int h0 = blockIdx.x * 2, kvh = h0 / (nq / nkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n_valid = past + t;
    const int n_end = min(n_valid, past + q0 + FA_BQ);
    const int ntiles = (n_end + FA_BK - 1) / FA_BK;
    auto load_kv = [&](int buf, int k0) {
        flash_load_kv<HD, LD>(ks + buf * FA_BK * LD, vs + buf * FA_BK * LD, kc, vc, k0, n_valid, nkv, kvh);
    };
    load_kv(0, 0);
    flash_stage_q<HD, LD>(qs, q, t, q0, nq, h0, scale_log2);
    const int pair = warp >> 1, hf = warp & 1;
    const int hh = pair >> 1, pr0 = (pair & 1) * 32;  // the pair's head and first position
    const int g = lane >> 2, cq = 2 * (lane & 3);
    // Row r of the thread (r = 2 * mt + half): pair row mt * 16 + half * 8 + g.
    const int qpos0 = past + q0 + pr0 + g;  // + 16 * mt + 8 * half
    const bf16* qw = qs + (hh * FA_BQ + pr0) * LD;
    float o[2][HD2 / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int n = 0; n < HD2 / 8; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
    float m[4], l[4];
#pragma unroll
    for (int r = 0; r < 4; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const int bar_id = 1 + pair;
    for (int j = 0; j < ntiles; j++) {
        cp_async_wait_all();
        __syncthreads();  // tile j (and Q) visible; every warp is done with tile j - 1's buffer
        if (j + 1 < ntiles) load_kv((j + 1) & 1, (j + 1) * FA_BK);
        const bf16* kt = ks + (j & 1) * FA_BK * LD;
        const bf16* vt = vs + (j & 1) * FA_BK * LD;
        const int kw = j * FA_BK + 32 * hf;  // this warp's first key
        // S = Q K^T: 32 rows x this warp's 32 keys.
        float s[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int n = 0; n < 4; n++) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            unsigned a0[4], a1[4];
            ldsm_x4(a0, qw + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
            ldsm_x4(a1, qw + (16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
                unsigned b[4];
                ldsm_x4(b, kt + (32 * hf + nb * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
                mma_bf16_16816(s[0][2 * nb], a0, b[0], b[1]);
                mma_bf16_16816(s[0][2 * nb + 1], a0, b[2], b[3]);
                mma_bf16_16816(s[1][2 * nb], a1, b[0], b[1]);
                mma_bf16_16816(s[1][2 * nb + 1], a1, b[2], b[3]);
            }
        }
        // Causal / cache-end mask, only where this warp's keys reach past the pair's first row.
        if (kw + 31 > qpos0 - g || kw + 32 > n_valid) {
#pragma unroll
            for (int mt = 0; mt < 2; mt++) warp_causal_mask<32>(s[mt], kw, qpos0 + 16 * mt, n_valid, cq);
        }
        // Row maxima over this warp's keys (a row lives in the 4 lanes of a quad), then the pair's.
        float mx[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int mt = r >> 1, e = 2 * (r & 1);
            float v = fmaxf(s[mt][0][e], s[mt][0][e + 1]);
#pragma unroll
            for (int n = 1; n < 4; n++) v = fmaxf(v, fmaxf(s[mt][n][e], s[mt][n][e + 1]));
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
            mx[r] = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
        }
        mxs[warp * 32 + lane] = make_float4(mx[0], mx[1], mx[2], mx[3]);
        bar_sync_named(bar_id, 64);
        const float4 pm = mxs[(warp ^ 1) * 32 + lane];
        mx[0] = fmaxf(mx[0], pm.x);
        mx[1] = fmaxf(mx[1], pm.y);
        mx[2] = fmaxf(mx[2], pm.z);
        mx[3] = fmaxf(mx[3], pm.w);
        float c[4], bse[4];
        bool rescale = false;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float mn = fmaxf(m[r], mx[r]);
            bse[r] = mn == -INFINITY ? 0.0f : mn;
            c[r] = ex2_approx(m[r] - bse[r]);
            rescale |= mn != m[r];
            m[r] = mn;
        }
        // P = exp2(S - max), this warp's partial row sums, packed as A fragments (keys 16 kk2..).
        unsigned pown[2][2][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < 4; n++) {
                s[mt][n][0] = ex2_approx(s[mt][n][0] - bse[2 * mt]);
                s[mt][n][1] = ex2_approx(s[mt][n][1] - bse[2 * mt]);
                s[mt][n][2] = ex2_approx(s[mt][n][2] - bse[2 * mt + 1]);
                s[mt][n][3] = ex2_approx(s[mt][n][3] - bse[2 * mt + 1]);
                sum0 += s[mt][n][0] + s[mt][n][1];
                sum1 += s[mt][n][2] + s[mt][n][3];
            }
            l[2 * mt] = l[2 * mt] * c[2 * mt] + sum0;  // per-lane partial sums
            l[2 * mt + 1] = l[2 * mt + 1] * c[2 * mt + 1] + sum1;
#pragma unroll
            for (int kk2 = 0; kk2 < 2; kk2++) {
                pown[mt][kk2][0] = pack_bf16x2(s[mt][2 * kk2][0], s[mt][2 * kk2][1]);
                pown[mt][kk2][1] = pack_bf16x2(s[mt][2 * kk2][2], s[mt][2 * kk2][3]);
                pown[mt][kk2][2] = pack_bf16x2(s[mt][2 * kk2 + 1][0], s[mt][2 * kk2 + 1][1]);
                pown[mt][kk2][3] = pack_bf16x2(s[mt][2 * kk2 + 1][2], s[mt][2 * kk2 + 1][3]);
                px[(warp * 4 + mt * 2 + kk2) * 32 + lane] =
                    make_uint4(pown[mt][kk2][0], pown[mt][kk2][1], pown[mt][kk2][2], pown[mt][kk2][3]);
            }
        }
        if (rescale) {  // (the max changed for one of this thread's rows; a thread-local branch)
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int n = 0; n < HD2 / 8; n++) {
                    o[mt][n][0] *= c[2 * mt];
                    o[mt][n][1] *= c[2 * mt];
                    o[mt][n][2] *= c[2 * mt + 1];
                    o[mt][n][3] *= c[2 * mt + 1];
                }
        }
        // O += P V over this warp's keys, then (after the pair barrier) over the partner's.
        auto pv = [&](const unsigned (&p)[2][2][4], int khalf) {
#pragma unroll
            for (int kk2 = 0; kk2 < 2; kk2++) {
#pragma unroll
                for (int nb = 0; nb < HD2 / 16; nb++) {
                    unsigned b[4];
                    ldsm_x4_t(b, vt + (32 * khalf + kk2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + hf * HD2 +
                                     nb * 16 + (lane >> 4) * 8);
                    mma_bf16_16816(o[0][2 * nb], p[0][kk2], b[0], b[1]);
                    mma_bf16_16816(o[0][2 * nb + 1], p[0][kk2], b[2], b[3]);
                    mma_bf16_16816(o[1][2 * nb], p[1][kk2], b[0], b[1]);
                    mma_bf16_16816(o[1][2 * nb + 1], p[1][kk2], b[2], b[3]);
                }
            }
        };
        pv(pown, hf);
        bar_sync_named(bar_id, 64);
        unsigned ppart[2][2][4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint4 v = px[((warp ^ 1) * 4 + i) * 32 + lane];
            ppart[i >> 1][i & 1][0] = v.x;
            ppart[i >> 1][i & 1][1] = v.y;
            ppart[i >> 1][i & 1][2] = v.z;
            ppart[i >> 1][i & 1][3] = v.w;
        }
        pv(ppart, hf ^ 1);
    }
    // Row sums: the quad's lanes, then the two key halves (the partner read this warp's last
    // maxima before the last tile's second pair barrier, so the slot is free).
#pragma unroll
    for (int r = 0; r < 4; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    mxs[warp * 32 + lane] = make_float4(l[0], l[1], l[2], l[3]);
    bar_sync_named(bar_id, 64);
    const float4 pl = mxs[(warp ^ 1) * 32 + lane];
    const float lt[4] = {l[0] + pl.x, l[1] + pl.y, l[2] + pl.z, l[3] + pl.w};  // (the same in both)
    const int h = h0 + hh;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int mt = r >> 1, e = 2 * (r & 1);
        const int srow = q0 + pr0 + 16 * mt + 8 * (r & 1) + g;
        if (srow >= t) continue;
        const float inv = 1.0f / lt[r];
        const float* gate = qg + ((size_t)srow * nq + h) * 2 * HD + HD + hf * HD2;
        bf16* dst = out + ((size_t)srow * nq + h) * HD + hf * HD2;
#pragma unroll
        for (int n = 0; n < HD2 / 8; n++) {
            int cc = n * 8 + cq;
            float2 gt = *reinterpret_cast<const float2*>(gate + cc);
            *reinterpret_cast<unsigned*>(dst + cc) =
                pack_bf16x2(o[mt][n][e] * inv * sigmoid_f(gt.x), o[mt][n][e + 1] * inv * sigmoid_f(gt.y));
        }
    }
}

ATTN_FLASH_ENTRY(3, 32)
ATTN_FLASH_ENTRY(3, 64)
ATTN_FLASH_ENTRY(3, 128)
ATTN_FLASH_ENTRY(3, 256)

// Prefill attention, version 4 (sm_90a, head dim 256): attn_flash3's grid (64 query positions
// x 2 heads of one KV group a block, heaviest blocks first) on wgmma, warp-specialised.
// Warpgroups 0 and 1 are consumers, warpgroup w owning head h0 + w (its 64 rows a wgmma tile);
// warpgroup 2 is the producer, alone issuing the K/V copies (cp.async) into two stages, each
// with a `full` mbarrier (the producer's 128 threads arrive as their copies land) and an
// `empty` one (the 256 consumer threads arrive when done with it). So the consumers never wait
// for each other and drift apart: one's softmax runs while the other's products use the tensor
// cores. The producer gives registers back (setmaxnreg) so the consumers can hold O. A
// consumer warpgroup, per K/V tile j of F4_BK = 80 keys (F4_BK=64 by a kernel define):
//   S = Q Kᵀ: 16 wgmma m64n80k16 straight from shared memory (Q and K in the 128-byte swizzle,
//      four 64-dim column blocks each; at 80 keys a k16 step reads 5 KB for 40 of the tensor
//      cores' clocks where 64 keys read 4 KB for 32: less shared-memory bandwidth a FLOP);
//   the online softmax (base 2) on the accumulators, rows in the lanes of a quad as in the
//      mma.sync kernels; O is rescaled only when a row's max moved;
//   O += P V: 4 wgmma m64n256k16 with P from registers (S's accumulators packed to bf16 are the
//      A fragments) and V read N-major from its swizzled tile (no transposing copy).
// Registers: O 128, S 40 floats a consumer thread. Block 384. Dynamic smem F4_SMEM (1024-byte
// aligned: the swizzle is a function of the address): Q 2 x 32 KiB, 2 stages of K 40 KiB +
// V 40 KiB, then the four mbarriers (229,408 bytes).
// With q_norm set, Q comes straight from qg's first half with attn_prep_rows' RMSNorm and
// partial rotation applied on the way into shared memory (the same sums, in the same order), so
// attn_prep_rows does only the KV heads and no f32 q round trip is written and read (~250 MB at
// 8,192 tokens a layer). Needs rot_half % 4 == 0 and rot_half <= 32: lane l holds dims
// [4l, 4l + 4) and [128 + 4l, ..) as attn_prep_rows sums them, the rotation partner is lane
// l ± rot_half / 4 and lane f computes frequency f's sincos for the whole row.
#define F4_HD 256
#ifndef F4_BK
#define F4_BK 80  // keys a K/V tile (64 or 80)
#endif
#define F4_TILE (64 * F4_HD * 2)       // bytes of a Q tile: 4 column blocks of 64 rows x 128 B
#define F4_KV (F4_BK * F4_HD * 2)      // bytes of a K or V tile: 4 column blocks of F4_BK rows
#define F4_SMEM (2 * F4_TILE + 4 * F4_KV + 32)

// Byte offset of (row r, 16-byte chunk c of the HD / 8) in a swizzled tile of ROWS rows.
template <int ROWS>
__device__ __forceinline__ int f4_off(int r, int c) {
    return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
// S (64 x F4_BK) += Q (64 x 16) Kᵀ from descriptors: the wgmma of the key tile's width.
__device__ __forceinline__ void f4_qk(float (&s)[F4_BK / 2], unsigned long long dq, unsigned long long dk,
                                      int scale_d) {
#if F4_BK == 80
    wgmma_m64n80k16(s, dq, dk, scale_d);
#else
    wgmma_m64n64k16(s, dq, dk, scale_d);
#endif
}

// A tensor map passed by value (cuTensorMapEncodeTiled's 128 opaque bytes; `__grid_constant__`
// so the copy instructions can take its address).
struct alignas(64) TmaParam {
    unsigned long long v[16];
};

// attn_flash4's consumer warpgroups (see attn_flash4_body).
template <int CS>
__device__ __forceinline__ void attn_flash4_consumer(const float* __restrict__ q, const float* __restrict__ qg,
                                                     bf16* __restrict__ out, int t, int past, int nq, float scale,
                                                     const float* __restrict__ q_norm,
                                                     const float* __restrict__ inv_freq, int rot_half, float eps,
                                                     unsigned char* qs, unsigned char* kvs, unsigned long long* full,
                                                     unsigned long long* empty, int q0, int h0, int ntiles,
                                                     int n_valid) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wi = warp & 3;
    setmaxnreg_inc<232>();
    // Consumers. The warpgroup through a shuffle from lane 0: ptxas then knows it is
    // warp-uniform and keeps the Q descriptor in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const float scale_log2 = scale * 1.4426950408889634f;
    if (q_norm) {  // grid-uniform: this warpgroup's Q prepared here (a warp a row), as bf16
        unsigned char* qw = qs + wg * F4_TILE;
        const int rh4 = rot_half >> 2, rot = lane < 2 * rh4;
        const int partner = lane < rh4 ? lane + rh4 : lane - rh4, f0 = 4 * (lane < rh4 ? lane : lane - rh4);
        const float4 w0 = *reinterpret_cast<const float4*>(q_norm + 4 * lane);
        const float4 w1 = *reinterpret_cast<const float4*>(q_norm + 128 + 4 * lane);
        const float freq = lane < rot_half ? inv_freq[lane] : 0.0f;
#pragma unroll 2
        for (int r = wi; r < 64; r += 4) {
            float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
            if (q0 + r < t) {  // warp-uniform
                const float* src = qg + ((size_t)(q0 + r) * nq + h0 + wg) * 2 * F4_HD;
                x0 = *reinterpret_cast<const float4*>(src + 4 * lane);
                x1 = *reinterpret_cast<const float4*>(src + 128 + 4 * lane);
            }
            float ss = 0.0f;
            ss += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w;
            ss += x1.x * x1.x + x1.y * x1.y + x1.z * x1.z + x1.w * x1.w;
            const float inv = rsqrtf(warp_sum(ss) / F4_HD + eps);
            float y[4] = {x0.x * inv * (1.0f + w0.x), x0.y * inv * (1.0f + w0.y), x0.z * inv * (1.0f + w0.z),
                          x0.w * inv * (1.0f + w0.w)};
            float sn_f, cs_f;  // this lane's frequency, at the row's position
            sincosf((float)(past + q0 + r) * freq, &sn_f, &cs_f);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float pj = __shfl_sync(0xffffffffu, y[e], partner & 31);
                const float sn = __shfl_sync(0xffffffffu, sn_f, (f0 + e) & 31);
                const float cs = __shfl_sync(0xffffffffu, cs_f, (f0 + e) & 31);
                if (rot) y[e] = lane < rh4 ? y[e] * cs - pj * sn : y[e] * cs + pj * sn;
            }
            const float4 z1 = make_float4(x1.x * inv * (1.0f + w1.x), x1.y * inv * (1.0f + w1.y),
                                          x1.z * inv * (1.0f + w1.z), x1.w * inv * (1.0f + w1.w));
            *reinterpret_cast<uint2*>(qw + f4_off<64>(r, lane >> 1) + (lane & 1) * 8) =
                make_uint2(pack_bf16x2(y[0] * scale_log2, y[1] * scale_log2),
                           pack_bf16x2(y[2] * scale_log2, y[3] * scale_log2));
            *reinterpret_cast<uint2*>(qw + f4_off<64>(r, 16 + (lane >> 1)) + (lane & 1) * 8) =
                make_uint2(pack_bf16x2(z1.x * scale_log2, z1.y * scale_log2),
                           pack_bf16x2(z1.z * scale_log2, z1.w * scale_log2));
        }
        fence_proxy_async();  // the stores visible to wgmma
        bar_sync_named(1 + wg, 128);
    } else {  // this warpgroup's Q, times scale·log2 e, as bf16 (rows past t zero)
        const int wt = tid & 127;
        unsigned char* qw = qs + wg * F4_TILE;
        for (int v = wt; v < 64 * (F4_HD / 8); v += 128) {
            const int r = v >> 5, c = v & 31;
            float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
            if (q0 + r < t) {
                const float* src = q + ((size_t)(q0 + r) * nq + h0 + wg) * F4_HD + c * 8;
                x0 = *reinterpret_cast<const float4*>(src);
                x1 = *reinterpret_cast<const float4*>(src + 4);
            }
            *reinterpret_cast<uint4*>(qw + f4_off<64>(r, c)) = make_uint4(
                pack_bf16x2(x0.x * scale_log2, x0.y * scale_log2), pack_bf16x2(x0.z * scale_log2, x0.w * scale_log2),
                pack_bf16x2(x1.x * scale_log2, x1.y * scale_log2), pack_bf16x2(x1.z * scale_log2, x1.w * scale_log2));
        }
        fence_proxy_async();  // the stores visible to wgmma
        bar_sync_named(1 + wg, 128);
    }
    const int g = lane >> 2, cq = 2 * (lane & 3);
    const int qpos0 = past + q0 + wi * 16 + g;  // this thread's first row; the second is 8 below
    const unsigned long long dq_wg = wgmma_desc_sw128(qs + wg * F4_TILE);
    // o is never zeroed: the first P V product overwrites it (scale_d 0); ptxas may schedule a
    // zeroing loop inside a wgmma stage, which serializes every wgmma of the kernel (C7513).
    float o[128];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    // The warpgroups take turns issuing S = Q Kᵀ (named barriers 3 + w, 256 threads: the other
    // warpgroup arrives when it has issued its own), so one's softmax runs under the other's
    // products. Warpgroup 0 goes first; the arrivals balance (warpgroup 1 skips its last).
    if (wg == 1) bar_arrive_named(3, 256);
    for (int j = 0; j < ntiles; j++) {
        const int st = j & 1;
        mbar_wait(&full[st], (j >> 1) & 1);  // the producer's copies of tile j landed
        fence_proxy_async();                 // ... and are visible to wgmma
        const unsigned char* kt = kvs + st * 2 * F4_KV;
        // Descriptors pinned (an empty asm) before each stage, so their arithmetic is not sunk
        // into it nor all 16 hoisted out of the loop (out of uniform registers, the copies back
        // inside the stage serialize every wgmma: C7513).
        unsigned long long dq = dq_wg, dk = wgmma_desc_sw128(kt), dv = wgmma_desc_sw128_mn(kt + F4_KV, F4_BK * 128);
        unsigned accumulate = j > 0;  // the first P V product overwrites o
        wgmma_fence_operand(dq);
        wgmma_fence_operand(dk);
        wgmma_fence_operand(dv);
        wgmma_fence_operand(accumulate);
        const int k0 = j * F4_BK;
        float s[F4_BK / 2];
        bar_sync_named(3 + wg, 256);  // this warpgroup's turn
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < F4_HD / 16; kk++)  // column block kk / 4, 32 bytes a k16 step inside it
            f4_qk(s, dq + (kk >> 2) * (8192 >> 4) + 2 * (kk & 3), dk + (kk >> 2) * ((F4_BK * 128) >> 4) + 2 * (kk & 3),
                  kk > 0);
        wgmma_commit();
        if (wg == 0 || j + 1 < ntiles) bar_arrive_named(4 - wg, 256);  // the other's turn
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < F4_BK / 2; i++) wgmma_fence_operand(s[i]);
        // Causal / cache-end mask, only on tiles that reach past this warp's first row.
        auto& s4 = reinterpret_cast<float(&)[F4_BK / 8][4]>(s);
        if (k0 + F4_BK - 1 > qpos0 - g || k0 + F4_BK > n_valid) warp_causal_mask<F4_BK>(s4, k0, qpos0, n_valid, cq);
        warp_softmax<F4_HD, F4_BK, true>(s4, reinterpret_cast<float(&)[F4_HD / 8][4]>(o), m0, m1, l0, l1, j > 0);
        unsigned p[F4_BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < F4_BK / 16; kk++) p_frag<F4_BK>(s4, kk, p[kk]);
#pragma unroll
        for (int i = 0; i < 128; i++) wgmma_fence_operand(o[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < F4_BK / 16; kk++)  // keys 16 kk..: 16 rows of 128 B down the V tile
            wgmma_m64n256k16_rs_tb(o, p[kk], dv + kk * (2048 >> 4), kk > 0 ? 1 : accumulate);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 128; i++) wgmma_fence_operand(o[i]);
        if (CS == 1) {
            mbar_arrive(&empty[st]);  // this thread is done with stage st
        } else if (j + 2 < ntiles) {  // this warp is done with stage st, which tile j + 2 reuses
            __syncwarp();
            if (lane == 0)
                for (int r = 0; r < CS; r++) mbar_arrive_remote(&empty[st], r);
        }
    }
    flash_store_rows<F4_HD>(reinterpret_cast<const float(&)[F4_HD / 8][4]>(o), l0, l1, q0 + wi * 16 + g, t, h0 + wg, nq,
                            qg, out, cq);
}

// CS > 1 (attn_flash4c*): clusters of CS blocks along x, the CS head pairs of one KV head that
// share a query tile and so every K/V tile: lane 0 of the producer's first warp in rank r
// copies column blocks r, r + CS, .. of each K and V tile with a multicast tensor copy
// (`kmap`, `vmap`: 3-D maps [positions][nkv][hd] with boxes of F4_BK rows x 64, the 128-byte
// swizzle the descriptors read, rows past n_valid zero) into all CS blocks, so each tile
// streams from L2 once a cluster instead of once a block (a probe without the K/V reads ran
// 8,192 / 32,768-token prompts 1.5% / 8% faster, docs/KERNELS.md). `full` = the local
// expect_tx arrival + the tile's bytes from all ranks; `empty` = one arrival from every
// consumer warp of the cluster, sent only for tiles whose stage is loaded again. Opt-in
// (KESTREL_ATTN_CLUSTER=2|4): on the H200 clusters of 2 measured level with single blocks, of 4
// slower (468 -> 354 TFLOP/s at 8,192 tokens): with two stages a cluster's blocks wait for the
// slowest one's release of every stage.
template <int CS>
__device__ __forceinline__ void attn_flash4_body(const float* __restrict__ q, const bf16* __restrict__ kc,
                                                 const bf16* __restrict__ vc, const float* __restrict__ qg,
                                                 bf16* __restrict__ out, int t, int past, int nq, int nkv, float scale,
                                                 const float* __restrict__ q_norm, const float* __restrict__ inv_freq,
                                                 int rot_half, float eps, const void* kmap, const void* vmap) {
    extern __shared__ __align__(1024) unsigned char f4_smem[];
    unsigned char* qs = f4_smem;                 // [2 heads]
    unsigned char* kvs = f4_smem + 2 * F4_TILE;  // [2 stages][K tile | V tile]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(kvs + 4 * F4_KV);  // [2]
    unsigned long long* empty = full + 2;                                                      // [2]
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 64;  // heaviest query tiles first (flash_grid)
    const int h0 = blockIdx.x * 2, kvh = h0 / (nq / nkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n_valid = past + t;
    const int n_end = min(n_valid, past + q0 + 64);
    const int ntiles = (n_end + F4_BK - 1) / F4_BK;
    const unsigned rank = CS > 1 ? cluster_ctarank() : 0u;
    if (tid == 0) {
        mbar_init(&full[0], CS > 1 ? 1 : 128);
        mbar_init(&full[1], CS > 1 ? 1 : 128);
        mbar_init(&empty[0], CS > 1 ? 8 * CS : 256);
        mbar_init(&empty[1], CS > 1 ? 8 * CS : 256);
    }
    __syncthreads();
    if (CS > 1) cluster_sync();  // every block's barriers initialised before any copy signals them
    if (CS > 1 && warp >= 8) {  // the producer: one thread, multicast tensor copies
        setmaxnreg_dec<40>();
        if (warp == 8) {  // the warp waits, its lane 0 issues
            for (int j = 0; j < ntiles; j++) {
                const int st = j & 1;
                if (j >= 2) mbar_wait(&empty[st], ((j >> 1) - 1) & 1);
                unsigned char* ks = kvs + st * 2 * F4_KV;
                if (lane == 0) {
                    mbar_arrive_expect_tx(&full[st], 2 * F4_KV);
                    for (int cb = rank; cb < F4_HD / 64; cb += CS) {
                        tma_load_3d_mc(ks + cb * (F4_BK * 128), kmap, cb * 64, kvh, j * F4_BK, &full[st],
                                       (1u << CS) - 1);
                        tma_load_3d_mc(ks + F4_KV + cb * (F4_BK * 128), vmap, cb * 64, kvh, j * F4_BK, &full[st],
                                       (1u << CS) - 1);
                    }
                }
                __syncwarp();
            }
        }
    } else if (warp >= 8) {  // the producer: tile j into stage j % 2 once the consumers released it
        setmaxnreg_dec<40>();
        const int r0 = (tid >> 5) & 3;  // rows r0, r0 + 4, ..; the lane is the 16-byte chunk
        for (int j = 0; j < ntiles; j++) {
            const int st = j & 1;
            if (j >= 2) mbar_wait(&empty[st], ((j >> 1) - 1) & 1);
            unsigned char* ks = kvs + st * 2 * F4_KV;
#pragma unroll 4
            for (int r = r0; r < F4_BK; r += 4) {
                const int kp = j * F4_BK + r;
#ifdef F4_PROBE_NO_KV  // diagnostic (timing only, outputs wrong): K/V zero-filled, no cache reads
                const bool ok = false;
#else
                const bool ok = kp < n_valid;
#endif
                const size_t off = ((size_t)(ok ? kp : 0) * nkv + kvh) * F4_HD + lane * 8;
                cp_async16(ks + f4_off<F4_BK>(r, lane), kc + off, ok);
                cp_async16(ks + F4_KV + f4_off<F4_BK>(r, lane), vc + off, ok);
            }
            cp_async_mbar_arrive(&full[st]);
        }
    } else {
        attn_flash4_consumer<CS>(q, qg, out, t, past, nq, scale, q_norm, inv_freq, rot_half, eps, qs, kvs, full, empty,
                                 q0, h0, ntiles, n_valid);
    }
    // With clusters no block leaves while another may still copy into its shared memory or
    // arrive on its barriers.
    if (CS > 1) cluster_sync();
}

extern "C" __global__ void __launch_bounds__(384, 1)
    attn_flash4_hd256(const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                      const float* __restrict__ qg, bf16* __restrict__ out, int t, int past, int nq, int nkv, int hd,
                      float scale, const float* __restrict__ q_norm, const float* __restrict__ inv_freq, int rot_half,
                      float eps) {
    PREFILL_KERNEL();
    attn_flash4_body<1>(q, kc, vc, qg, out, t, past, nq, nkv, scale, q_norm, inv_freq, rot_half, eps, nullptr, nullptr);
}

// attn_flash4 by clusters of CS (2 or 4) head pairs sharing each K/V tile's copy; box_rows: the
// maps' box height, which must be F4_BK (a build with another F4_BK traps here).
#define ATTN_FLASH4C(CS)                                                                                               \
    extern "C" __global__ void __cluster_dims__(CS, 1, 1) __launch_bounds__(384, 1) attn_flash4c##CS##_hd256(         \
        const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,                          \
        const float* __restrict__ qg, bf16* __restrict__ out, int t, int past, int nq, int nkv, int hd, float scale,    \
        const float* __restrict__ q_norm, const float* __restrict__ inv_freq, int rot_half, float eps,                  \
        const __grid_constant__ TmaParam kmap, const __grid_constant__ TmaParam vmap, int box_rows) {                   \
        PREFILL_KERNEL();                                                                                               \
        if (box_rows != F4_BK) __trap();                                                                                \
        attn_flash4_body<CS>(q, kc, vc, qg, out, t, past, nq, nkv, scale, q_norm, inv_freq, rot_half, eps, &kmap,       \
                             &vmap);                                                                                    \
    }
ATTN_FLASH4C(2)
ATTN_FLASH4C(4)

// ---- Decode on tensor cores ----

// Decode attention, one warp per block = one KV head's GQA group over one split of the context:
// the group's query heads are the rows of a 16-row mma tile (rows past the group are zero), so
// every K/V element read from shared memory feeds a tensor-core product for the whole group
// instead of 8 scalar FMAs per head. Per tile of AD_TK keys (cp.async, double-buffered):
// S = Q Kᵀ (mma m16n8k16), online softmax in base 2 on the accumulators, O += P V with P packed
// from S's registers. Writes attn_decode's partials (unnormalised O, natural-log max, sum) for
// attn_combine_dec. grid (nkv, nsplit), block 32, dynamic smem (16 + 4 * AD_TK) * (HD + 8) * 2.
// q is not __restrict__: attn_prep writes it in the same step, and ptxas may hoist a read-only
// load above griddep_wait.
#define AD_TK 32
// Positions a split takes (attn_combine_dec derives the same). Where the step has at most 16
// splits: whole AD_TK-key tiles, so a short context spreads over more one-warp blocks (at least
// 64 positions there measured 0.6-1.2% slower at context 256) and no split ends in a tile of a
// few keys (ceil(n / 16) = 33..36 at 512 had made 16 splits of a full and a nearly empty tile).
// With more splits at least 64 (32 measured 3% slower at 8,192: twice the blocks and partials).
__device__ __forceinline__ int attn_dec_chunk(int n, int nsplit) {
    const int even = (n + nsplit - 1) / nsplit;  // >= 1: n counts the new position
    return nsplit > 16 ? max(64, even) : (even + AD_TK - 1) / AD_TK * AD_TK;
}

template <int HD>
__device__ __forceinline__ void attn_decode_mma_body(const float* q, const bf16* __restrict__ kc,
                                                     const bf16* __restrict__ vc, float* __restrict__ part,
                                                     const int* __restrict__ past_dev, int nq, int nkv, int nsplit,
                                                     float scale_log2) {
    constexpr int LD = HD + 8;  // padded rows: an ldmatrix's 8 row addresses hit distinct banks
    extern __shared__ __align__(128) unsigned char ad_smem[];
    bf16* qs = reinterpret_cast<bf16*>(ad_smem);  // [16][LD]
    bf16* kv = qs + 16 * LD;                      // [2 stages][K | V][AD_TK][LD]
    DECODE_KERNEL(TAG_ATTN_DECODE);
    griddep_wait();
    const int kvh = blockIdx.x, sp = blockIdx.y, lane = threadIdx.x, group = nq / nkv;
    const int n = *past_dev + 1;
    const int chunk = attn_dec_chunk(n, nsplit);
    const int start = sp * chunk, end = min(start + chunk, n);
    if (start >= end) return;  // beyond the context: attn_combine_dec ignores this split
    auto load_tile = [&](int t0, int stage) {
        bf16* ks = kv + stage * 2 * AD_TK * LD;
        constexpr int VPR = HD / 8;
        for (int v = lane; v < AD_TK * VPR; v += 32) {
            int r = v / VPR, c = (v % VPR) * 8, kp = t0 + r;
            bool ok = kp < end;
            size_t off = ((size_t)(ok ? kp : start) * nkv + kvh) * HD + c;
            cp_async16(ks + r * LD + c, kc + off, ok);
            cp_async16(ks + (AD_TK + r) * LD + c, vc + off, ok);
        }
        cp_async_commit();
    };
    load_tile(start, 0);
    // The group's queries (rows < group <= 8) scaled into the tile's bf16 rows, rows 8..15 zero.
    // Every load is issued before any store (a loop storing each before the next load issued
    // them in ~8 dependent rounds); the block's time at context 256 measured the same.
    constexpr int QV = 8 * (HD / 4) / 32;
    float4 xq[QV];
#pragma unroll
    for (int it = 0; it < QV; it++) {
        const int v = lane + 32 * it, r = v / (HD / 4), c = (v % (HD / 4)) * 4;
        xq[it] = r < group ? *reinterpret_cast<const float4*>(q + (size_t)(kvh * group + r) * HD + c)
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int it = 0; it < 2 * QV; it++) {
        const int v = lane + 32 * it, r = v / (HD / 4), c = (v % (HD / 4)) * 4;
        const float4 x = it < QV ? xq[it] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        unsigned* d = reinterpret_cast<unsigned*>(qs + r * LD + c);
        d[0] = pack_bf16x2(x.x * scale_log2, x.y * scale_log2);
        d[1] = pack_bf16x2(x.z * scale_log2, x.w * scale_log2);
    }
    TRACE_PHASE(0);  // the timeline's phases: queries staged, first tile in, products done
    const int g = lane >> 2, cq = 2 * (lane & 3);
    float o[HD / 8][4];
#pragma unroll
    for (int nn = 0; nn < HD / 8; nn++) o[nn][0] = o[nn][1] = o[nn][2] = o[nn][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    int stage = 0;
    for (int t0 = start; t0 < end; t0 += AD_TK, stage ^= 1) {
        if (t0 + AD_TK < end) {
            load_tile(t0 + AD_TK, stage ^ 1);
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();  // every lane's copies (and Q, the first time) visible to the warp
        if (t0 == start) TRACE_PHASE(1);
        const bf16* kt = kv + stage * 2 * AD_TK * LD;
        const bf16* vt = kt + AD_TK * LD;
        float s[AD_TK / 8][4];
        warp_qk<HD, AD_TK, LD>(s, qs, kt, lane);
        if (t0 + AD_TK > end) {  // the split's last, partial tile
#pragma unroll
            for (int nn = 0; nn < AD_TK / 8; nn++) {
                int kp = t0 + nn * 8 + cq;
                if (kp >= end) s[nn][0] = s[nn][2] = -INFINITY;
                if (kp + 1 >= end) s[nn][1] = s[nn][3] = -INFINITY;
            }
        }
        warp_softmax<HD, AD_TK>(s, o, m0, m1, l0, l1);
        warp_pv<HD, AD_TK, LD>(o, s, vt, lane);
        __syncthreads();  // done with this stage before the next iteration refills it
    }
    TRACE_PHASE(2);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    if (g >= group) return;  // padding rows (8..15 are never a head: group <= 8 here)
    float* out = part + ((size_t)(kvh * group + g) * nsplit + sp) * (HD + 2);
#pragma unroll
    for (int nn = 0; nn < HD / 8; nn++) *reinterpret_cast<float2*>(out + nn * 8 + cq) = make_float2(o[nn][0], o[nn][1]);
    if ((lane & 3) == 0) {
        out[HD] = m0 * 0.6931471805599453f;  // base-2 max back to natural log
        out[HD + 1] = l0;
    }
}

#define ATTN_DECODE_MMA(HD)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32) attn_decode_mma_hd##HD(                                  \
        const float* q, const bf16* __restrict__ kc, const bf16* __restrict__ vc, float* __restrict__ part,     \
        const int* __restrict__ past_dev, int nq, int nkv, int nsplit, float scale) {                         \
        attn_decode_mma_body<HD>(q, kc, vc, part, past_dev, nq, nkv, nsplit, scale * 1.4426950408889634f);    \
    }
ATTN_DECODE_MMA(32)
ATTN_DECODE_MMA(64)
ATTN_DECODE_MMA(128)
ATTN_DECODE_MMA(256)

// Decode combine: merges the splits of attn_decode(_mma), normalises, applies sigmoid(gate) and
// writes bf16 [nq * hd]. grid (nq, hd / 32), block 256: warp w sums splits w, w + 8, ... for the
// block's 32 dims (lane = dim), so each thread has many independent loads in flight.
extern "C" __global__ void __launch_bounds__(256) attn_combine_dec(const float* __restrict__ part,
                                                                   const float* __restrict__ qg, bf16* __restrict__ out,
                                                                   const int* __restrict__ past_dev, int nq, int hd,
                                                                   int nsplit) {
    DECODE_KERNEL(TAG_ATTN_COMBINE);
    griddep_wait();
    const int n = *past_dev + 1;
    const int chunk = attn_dec_chunk(n, nsplit);
    const int used = min(nsplit, (n + chunk - 1) / chunk);
    const int h = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, dim = blockIdx.y * 32 + lane;
    const float* base = part + (size_t)h * nsplit * (hd + 2);
    __shared__ float wsp[256];  // the splits' weights exp(m_sp - max m) (nsplit <= 256)
    __shared__ float red[8][32];
    float m = -INFINITY;
    for (int sp = tid; sp < used; sp += 256) m = fmaxf(m, base[sp * (hd + 2) + hd]);
    m = warp_max(m);
    if (lane == 0) red[warp][0] = m;
    __syncthreads();
    m = red[0][0];
    for (int w = 1; w < 8; w++) m = fmaxf(m, red[w][0]);
    float lpart = 0.0f;
    for (int sp = tid; sp < used; sp += 256) {
        float w = expf(base[sp * (hd + 2) + hd] - m);
        wsp[sp] = w;
        lpart += base[sp * (hd + 2) + hd + 1] * w;
    }
    const float l = block_sum(lpart);  // (its barriers also publish wsp)
    float acc = 0.0f;
#pragma unroll 8
    for (int sp = warp; sp < used; sp += 8) acc += wsp[sp] * base[sp * (hd + 2) + dim];
    red[warp][lane] = acc;
    __syncthreads();
    if (warp == 0) {
        float a = 0.0f;
        for (int w = 0; w < 8; w++) a += red[w][lane];
        float gate = qg[(size_t)h * 2 * hd + hd + dim];
        out[(size_t)h * hd + dim] = __float2bfloat16(a / l * sigmoid_f(gate));
    }
}
