// Gated full attention: q/k zero-centred norms + partial NeoX RoPE + KV-cache append, then
// split-K (flash-decoding style) causal GQA attention and a combine that applies the
// sigmoid output gate.

// grid (t, nq + nkv), block hd. qg: [t, nq, 2*hd] ([query | gate] per head); k, v: [t, nkv*hd].
// q_out: [t, nq, hd] f32; caches: [max_seq, nkv, hd] bf16, tokens written at past + s.
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                     float* __restrict__ q_out, bf16* __restrict__ k_cache,
                                     bf16* __restrict__ v_cache, int past, int nq, int nkv, int hd,
                                     int rot_half, float eps) {
    int s = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
    bool is_q = head < nq;
    int kvh = head - nq;
    const float* src = is_q ? qg + ((size_t)s * nq + head) * 2 * hd : k + ((size_t)s * nkv + kvh) * hd;
    const float* w = is_q ? q_norm : k_norm;
    extern __shared__ float buf[];
    float x = i < hd ? src[i] : 0.0f;
    float inv = rsqrtf(block_sum(x * x) / hd + eps);
    if (i < hd) buf[i] = x * inv * (1.0f + w[i]);
    __syncthreads();
    if (i >= hd) return;
    float y = buf[i];
    int pos = past + s;
    if (i < 2 * rot_half) {
        int f = i < rot_half ? i : i - rot_half;
        float sn, cs;
        sincosf((float)pos * inv_freq[f], &sn, &cs);
        y = i < rot_half ? buf[i] * cs - buf[i + rot_half] * sn : buf[i] * cs + buf[i - rot_half] * sn;
    }
    if (is_q) {
        q_out[((size_t)s * nq + head) * hd + i] = y;
    } else {
        size_t off = ((size_t)pos * nkv + kvh) * hd + i;
        k_cache[off] = __float2bfloat16(y);
        v_cache[off] = __float2bfloat16(v[((size_t)s * nkv + kvh) * hd + i]);
    }
}

// One warp per (query s, head h, split). Keys [split*chunk, min(...)) of the 0..past+s range.
// part: [t, nq, nsplit, hd + 2] = acc[hd], running max, running sum.
extern "C" __global__ void attn_split(const float* __restrict__ q, const bf16* __restrict__ k_cache,
                                      const bf16* __restrict__ v_cache, float* __restrict__ part,
                                      int past, int nq, int nkv, int hd, int nsplit, int chunk, float scale) {
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
                                        bf16* __restrict__ out, int past, int nq, int hd, int nsplit, int chunk) {
    int s = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    if (i >= hd) return;
    int n = past + s + 1;
    int used = min(nsplit, (n + chunk - 1) / chunk);
    const float* base = part + ((size_t)s * nq + h) * nsplit * (hd + 2);
    float m = -INFINITY;
    for (int sp = 0; sp < used; sp++) m = fmaxf(m, base[sp * (hd + 2) + hd]);
    float l = 0.0f, acc = 0.0f;
    for (int sp = 0; sp < used; sp++) {
        const float* r = base + sp * (hd + 2);
        float w = expf(r[hd] - m);
        l += r[hd + 1] * w;
        acc += r[i] * w;
    }
    float gate = qg[((size_t)s * nq + h) * 2 * hd + hd + i];
    out[((size_t)s * nq + h) * hd + i] = __float2bfloat16(acc / l * sigmoid_f(gate));
}
