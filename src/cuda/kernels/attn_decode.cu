// Gated full attention, split-K (flash-decoding style): the decode step's q/k zero-centred norms +
// partial NeoX RoPE + KV-cache append (attn_prep), causal GQA attention over splits of the
// context and the combines that merge the splits and apply the sigmoid output gate: attn_split +
// attn_combine (warp per query and split; prefill's path where no flash kernel applies) and the
// decode step's attn_decode_mma (tensor cores) + attn_combine_dec.

// grid (t, nq + nkv), block hd. qg: [t, nq, 2*hd] ([query | gate] per head); k, v: [t, nkv*hd].
// q_out: [t, nq, hd] f32; caches: [max_seq, nkv, hd] bf16, tokens written at past + s.
// `past_dev`, when set, holds `past` on the device (decode graphs: no per-step arguments).
// Batched decode: with `tab` set, row s is another sequence's token at position past_dev[s],
// its caches tab[s] (K) and tab[t + s] (V).
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                     float* __restrict__ q_out, bf16* __restrict__ k_cache,
                                     bf16* __restrict__ v_cache, int past, const int* __restrict__ past_dev,
                                     int nq, int nkv, int hd, int rot_half, float eps,
                                     const u64* __restrict__ tab) {
    DECODE_KERNEL(TAG_ATTN_PREP);
    // Weights and the host-written position before the wait, the rotation angle with them;
    // after it, every input at once.
    int s = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
    if (tab) {
        past = past_dev[s] - s;  // pos = past + s below
        k_cache = reinterpret_cast<bf16*>(tab[s]);
        v_cache = reinterpret_cast<bf16*>(tab[gridDim.x + s]);
    } else if (past_dev) {
        past = *past_dev;
    }
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

// ---- Decode on tensor cores ----

// Decode attention, one warp per block = one KV head's GQA group over one split of the context:
// the group's query heads are the rows of a 16-row mma tile (rows past the group are zero), so
// every K/V element read from shared memory feeds a tensor-core product for the whole group
// instead of 8 scalar FMAs per head. Per tile of AD_TK keys (cp.async, double-buffered):
// S = Q Kᵀ (mma m16n8k16), online softmax in base 2 on the accumulators, O += P V with P packed
// from S's registers. Writes attn_split's partials (unnormalised O, natural-log max, sum) for
// attn_combine_dec. grid (nkv, nsplit, rows), block 32, dynamic smem (16 + 4 * AD_TK) * (HD + 8) * 2.
// Rows (batched decode): row r = blockIdx.z is another sequence's query, at position past_dev[r],
// its q and partials r * nq heads on, its caches tab[r] and tab[rows + r] (`tab` null: kc and vc).
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
                                                     float scale_log2, const u64* __restrict__ tab) {
    constexpr int LD = HD + 8;  // padded rows: an ldmatrix's 8 row addresses hit distinct banks
    extern __shared__ __align__(128) unsigned char ad_smem[];
    bf16* qs = reinterpret_cast<bf16*>(ad_smem);  // [16][LD]
    bf16* kv = qs + 16 * LD;                      // [2 stages][K | V][AD_TK][LD]
    DECODE_KERNEL(TAG_ATTN_DECODE);
    griddep_wait();
    const int kvh = blockIdx.x, sp = blockIdx.y, lane = threadIdx.x, group = nq / nkv, row = blockIdx.z;
    if (tab) {
        kc = reinterpret_cast<const bf16*>(tab[row]);
        vc = reinterpret_cast<const bf16*>(tab[gridDim.z + row]);
    }
    q += (size_t)row * nq * HD;
    part += (size_t)row * nq * nsplit * (HD + 2);
    const int n = past_dev[row] + 1;
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
        const int* __restrict__ past_dev, int nq, int nkv, int nsplit, float scale, const u64* __restrict__ tab) { \
        attn_decode_mma_body<HD>(q, kc, vc, part, past_dev, nq, nkv, nsplit, scale * 1.4426950408889634f, tab); \
    }
ATTN_DECODE_MMA(256)  // the model's head dim

// Decode combine: merges the splits of attn_decode_mma, normalises, applies sigmoid(gate) and
// writes bf16 [nq * hd]. grid (nq, hd / 32, rows), block 256: warp w sums splits w, w + 8, ... for
// the block's 32 dims (lane = dim), so each thread has many independent loads in flight. Row r
// (batched decode) at position past_dev[r], its gates r * ldqg floats on.
extern "C" __global__ void __launch_bounds__(256) attn_combine_dec(const float* __restrict__ part,
                                                                   const float* __restrict__ qg, bf16* __restrict__ out,
                                                                   const int* __restrict__ past_dev, int nq, int hd,
                                                                   int nsplit, int ldqg) {
    DECODE_KERNEL(TAG_ATTN_COMBINE);
    griddep_wait();
    const int row = blockIdx.z;
    part += (size_t)row * nq * nsplit * (hd + 2);
    qg += (size_t)row * ldqg;
    out += (size_t)row * nq * hd;
    const int n = past_dev[row] + 1;
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
