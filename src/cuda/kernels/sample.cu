// Sampling on the device: each row of a batch's logits gets the draw of the CPU `Sampler`
// (src/sampling.rs) from the same uniform, so only ids and the requested log-probabilities
// cross to the host (not 1 MB of logits a row). Four kernels, launched in this order:
//   sample_mask      (rows with a structured-output mask) every id the row's bitmask refuses
//                    set to -inf in place, so the rest of the draw only sees allowed ids;
//   sample_penalize  (rows with penalties) the repetition / presence / frequency penalties in
//                    place on the ids of the row's history, the raw values saved;
//   sample_stats     a block per (chunk of SAMPLE_CHUNK ids, row): the chunk's maximum, its
//                    softmax mass at temperature 1 and at the row's temperature, and its
//                    SAMPLE_K largest logits (radix select on the float bits; ties: lowest id);
//   sample_pick      a block per row: the chunks' candidates merged into the row's SAMPLE_K
//                    largest, then the CPU sampler's filters and draw on them (top-k, top-p
//                    against the full mass, min-p, the inverse CDF in descending order), or for
//                    plain sampling the inverse CDF over the whole vocabulary in id order
//                    (the chunk masses locate the chunk, a scan of it the id). It also writes the
//                    log-sum-exp and top log-probabilities of the raw logits.
// Where the candidates cannot decide (top-k above SAMPLE_K, or a top-p / min-p set that may
// reach past them) the row is flagged and the host samples its logits row instead.
// Row parameters: SAMPLE_PW 32-bit words (SP_*); results: SAMPLE_OW words (SO_*).

#define SAMPLE_K 64
#define SAMPLE_CHUNK 8192
#define SAMPLE_MAX_CHUNKS 32
#define SAMPLE_TOPN 20
#define SAMPLE_PW 16
#define SAMPLE_OW 48
// parameter words: temperature (0: greedy), top_k (0: off), top_p, min_p, the three penalties
// (f32), the id limit, the row's penalty list (offset and length in `pen`, pairs of id and
// count), top log-probabilities wanted (-1: none), the row's mask (its index among the
// uploaded masks; SAMPLE_NO_MASK: none), and the uniform (f64, low word first)
#define SAMPLE_NO_MASK 0xffffffffu
#define SP_TEMP 0
#define SP_TOPK 1
#define SP_TOPP 2
#define SP_MINP 3
#define SP_REP 4
#define SP_PRES 5
#define SP_FREQ 6
#define SP_LIMIT 7
#define SP_PEN_OFF 8
#define SP_PEN_LEN 9
#define SP_NLP 10
#define SP_MASK 11
#define SP_U_LO 12
#define SP_U_HI 13
// result words: the id, 1 where the host must sample, the raw log-sum-exp (f32), the id's
// log-probability (f32), the number of top pairs, then (id, log-probability) pairs
#define SO_ID 0
#define SO_FLAG 1
#define SO_LSE 2
#define SO_LP 3
#define SO_NTOP 4
#define SO_TOP 5
// sample_pick's phases: the stats are of the raw logits (write the log-sum-exp and the top
// log-probabilities), draw, and the buffer holds penalized values (the raw ones in `saved`)
#define SAMPLE_RAW 1
#define SAMPLE_DRAW 2
#define SAMPLE_PENALIZED 4

// The float's order as an unsigned key (NaN as -inf).
__device__ __forceinline__ unsigned sample_key(float v) {
    unsigned u = v != v ? 0xff800000u : __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
#define SAMPLE_KEY_NEG_INF 0x007fffffu

// (v, id) ranks before (w, jd): larger value, then lower id.
__device__ __forceinline__ bool sample_before(float v, int id, float w, int jd) {
    return v > w || (v == w && id < jd);
}

// Bitonic sort of n (a power of two) pairs in shared memory, best first; all threads call it.
__device__ void sample_sort(float* v, int* id, int n) {
    for (int k = 2; k <= n; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const bool lb = sample_before(v[l], id[l], v[i], id[i]);
                    const bool ib = sample_before(v[i], id[i], v[l], id[l]);
                    if ((i & k) == 0 ? lb : ib) {
                        const float tv = v[i];
                        v[i] = v[l];
                        v[l] = tv;
                        const int ti = id[i];
                        id[i] = id[l];
                        id[l] = ti;
                    }
                }
            }
            __syncthreads();
        }
}

__device__ float sample_block_max(float v) {
    __shared__ float part[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float m = lane < (int)(blockDim.x >> 5) ? part[lane] : -INFINITY;
        m = warp_max(m);
        if (lane == 0) total = m;
    }
    __syncthreads();
    return total;
}

__device__ __forceinline__ float sample_f(const unsigned* p, int w) { return __uint_as_float(p[w]); }

// The temperature the sampler divides by (greedy rows: 1).
__device__ __forceinline__ float sample_temp(const unsigned* p) {
    const float t = sample_f(p, SP_TEMP);
    return t == 0.0f ? 1.0f : fmaxf(t, 1.17549435e-38f);
}

// The structured-output masks: row r's mask is the `words` words at `masks + p[SP_MASK] *
// words`, bit i % 32 of word i / 32 set where id i is allowed (ids past words * 32 are
// refused); every refused id below the row's limit becomes -inf. Rows without a mask are left
// as they are. Grid (chunks of SAMPLE_CHUNK ids, rows), 256 threads: a thread an id, so a
// warp reads one mask word.
extern "C" __global__ void __launch_bounds__(256) sample_mask(float* __restrict__ logits, int ld,
                                                              const unsigned* __restrict__ params,
                                                              const unsigned* __restrict__ masks, int words) {
    PREFILL_KERNEL();
    const unsigned* p = params + (size_t)blockIdx.y * SAMPLE_PW;
    const unsigned m = p[SP_MASK];
    if (m == SAMPLE_NO_MASK) return;
    const unsigned* w = masks + (size_t)m * words;
    float* x = logits + (size_t)blockIdx.y * ld;
    const int limit = min((int)p[SP_LIMIT], ld);
    const int end = min((int)(blockIdx.x + 1) * SAMPLE_CHUNK, limit);
    for (int i = (int)blockIdx.x * SAMPLE_CHUNK + (int)threadIdx.x; i < end; i += blockDim.x) {
        const int wi = i >> 5;
        const unsigned bits = wi < words ? w[wi] : 0u;
        if (!((bits >> (i & 31)) & 1u)) x[i] = -INFINITY;
    }
}

extern "C" __global__ void __launch_bounds__(256) sample_penalize(float* __restrict__ logits, int ld,
                                                                  const unsigned* __restrict__ params,
                                                                  const int* __restrict__ pen,
                                                                  float* __restrict__ saved) {
    PREFILL_KERNEL();
    const unsigned* p = params + (size_t)blockIdx.x * SAMPLE_PW;
    const int off = (int)p[SP_PEN_OFF], len = (int)p[SP_PEN_LEN], limit = (int)p[SP_LIMIT];
    const float rep = sample_f(p, SP_REP), pres = sample_f(p, SP_PRES), freq = sample_f(p, SP_FREQ);
    float* x = logits + (size_t)blockIdx.x * ld;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const int id = pen[2 * (off + j)], n = pen[2 * (off + j) + 1];
        if (id < 0 || id >= limit) continue;  // the ids are distinct: no two threads meet
        float v = x[id];
        saved[off + j] = v;
        if (v != v) v = -INFINITY;
        if (rep != 1.0f) v = v > 0.0f ? v / rep : v * rep;
        v -= pres + freq * (float)n;
        x[id] = v;
    }
}

// stats [rows, chunks, 4]: max, sum exp(v - max), sum exp(v / t - max / t), finite values;
// cand_v / cand_id [rows, chunks, SAMPLE_K]: the chunk's largest raw values, best first (id -1
// past the finite ones). Grid (chunks, rows), 256 threads.
extern "C" __global__ void __launch_bounds__(1024) sample_stats(const float* __restrict__ logits, int ld,
                                                               const unsigned* __restrict__ params,
                                                               float* __restrict__ stats,
                                                               int* __restrict__ cand_id,
                                                               float* __restrict__ cand_v) {
    PREFILL_KERNEL();
    __shared__ float sv[SAMPLE_CHUNK];
    __shared__ int hist[256];
    __shared__ int scan[1024];
    __shared__ float kv[SAMPLE_K];
    __shared__ int ki[SAMPLE_K];
    __shared__ unsigned s_prefix;
    __shared__ int s_rem, s_count, s_eq;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const unsigned* p = params + (size_t)r * SAMPLE_PW;
    const int limit = (int)p[SP_LIMIT], start = c * SAMPLE_CHUNK;
    const int n = max(0, min(SAMPLE_CHUNK, limit - start));
    const float t = sample_temp(p);
    const float* x = logits + (size_t)r * ld + start;
    float m = -INFINITY, valid = 0.0f;
#pragma unroll 8
    for (int i = tid; i < n; i += nt) {
        float v = x[i];
        if (v != v) v = -INFINITY;
        sv[i] = v;
        m = fmaxf(m, v);
        valid += v > -INFINITY ? 1.0f : 0.0f;
    }
    m = sample_block_max(m);
    const int nvalid = (int)block_sum(valid);
    float s1 = 0.0f, st = 0.0f;
    if (m > -INFINITY) {
        const float mt = t != 1.0f ? m / t : m;
        for (int i = tid; i < n; i += nt) {
            const float v = sv[i];
            s1 += expf(v - m);
            st += expf((t != 1.0f ? v / t : v) - mt);
        }
    }
    s1 = block_sum(s1);
    st = block_sum(st);
    // the SAMPLE_K-th largest key (radix select, 8 bits a pass) and how many equal to it to take
    const int want = min(SAMPLE_K, nvalid);
    unsigned prefix = SAMPLE_KEY_NEG_INF;
    int rem = 0, eq = 0;
    if (nvalid > SAMPLE_K) {
        unsigned mask = 0;
        prefix = 0;
        rem = SAMPLE_K;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            // a warp's lanes with the same bin add once (most values share the top byte)
            for (int i0 = 0; i0 < n; i0 += nt) {
                const int i = i0 + tid;
                const unsigned k = i < n ? sample_key(sv[i]) : 0u;
                const int bin = i < n && (k & mask) == prefix ? (int)((k >> shift) & 255) : -1;
                const unsigned peers = __match_any_sync(0xffffffffu, bin);
                if (bin >= 0 && (tid & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
            }
            __syncthreads();
            if (tid < 32) {
                // the largest bin b with at least `rem` values in bins >= b: lane l holds bins
                // 255 - 8l down to 248 - 8l, its lanes' counts before it by a shuffle scan
                int cnt[8], tot = 0;
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    cnt[q] = hist[255 - 8 * tid - q];
                    tot += cnt[q];
                }
                int incl = tot;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int y = __shfl_up_sync(0xffffffffu, incl, o);
                    if (tid >= o) incl += y;
                }
                const int excl = incl - tot;
                const unsigned win = __reduce_min_sync(0xffffffffu, excl < rem && rem <= incl ? tid : 32u);
                if (tid == (int)win) {
                    int acc = excl, q = 0;
                    while (q < 7 && acc + cnt[q] < rem) acc += cnt[q++];
                    s_prefix = prefix | ((unsigned)(255 - 8 * tid - q) << shift);
                    s_rem = rem - acc;
                    s_eq = cnt[q];
                }
            }
            __syncthreads();
            prefix = s_prefix;
            rem = s_rem;
            eq = s_eq;
            mask |= 255u << shift;
        }
    }
    // everything above the threshold (in any order), then the `rem` lowest ids equal to it; when
    // all the values equal to it are taken (no tie to break, the usual case) in the same pass
    if (tid == 0) s_count = 0;
    const bool all_eq = rem == eq;
    __syncthreads();
    for (int i = tid; i < n; i += nt) {
        const unsigned k = sample_key(sv[i]);
        if (k > prefix || (all_eq && k == prefix && rem > 0)) {
            const int s = atomicAdd(&s_count, 1);
            kv[s] = sv[i];
            ki[s] = start + i;
        }
    }
    if (rem > 0 && !all_eq) {
        const int per = (n + nt - 1) / nt, lo = tid * per, hi = min(n, lo + per);
        int ties = 0;
        for (int i = lo; i < hi; i++) ties += sample_key(sv[i]) == prefix;
        scan[tid] = ties;
        __syncthreads();
        if (tid == 0) {
            int acc = 0;
            for (int i = 0; i < nt; i++) {
                const int v = scan[i];
                scan[i] = acc;
                acc += v;
            }
        }
        __syncthreads();
        int j = scan[tid];
        const int base = want - rem;
        for (int i = lo; i < hi && j < rem; i++)
            if (sample_key(sv[i]) == prefix) {
                kv[base + j] = sv[i];
                ki[base + j] = start + i;
                j++;
            }
    }
    __syncthreads();
    for (int j = tid; j < SAMPLE_K; j += nt)
        if (j >= want) {
            kv[j] = -INFINITY;
            ki[j] = 0x7fffffff;
        }
    __syncthreads();
    sample_sort(kv, ki, SAMPLE_K);
    const size_t at = (size_t)r * gridDim.x + c;
    for (int j = tid; j < SAMPLE_K; j += nt) {
        cand_v[at * SAMPLE_K + j] = kv[j];
        cand_id[at * SAMPLE_K + j] = j < want ? ki[j] : -1;
    }
    if (tid == 0) {
        stats[at * 4 + 0] = m;
        stats[at * 4 + 1] = s1;
        stats[at * 4 + 2] = st;
        stats[at * 4 + 3] = (float)nvalid;
    }
}

// A block per row (1024 threads) over sample_stats' `chunks` chunks; `phase` as SAMPLE_*.
extern "C" __global__ void __launch_bounds__(1024) sample_pick(const float* __restrict__ logits, int ld,
                                                               const unsigned* __restrict__ params, int chunks,
                                                               const float* __restrict__ stats,
                                                               const int* __restrict__ cand_id,
                                                               const float* __restrict__ cand_v,
                                                               const int* __restrict__ pen,
                                                               const float* __restrict__ saved, int phase,
                                                               unsigned* __restrict__ out) {
    PREFILL_KERNEL();
    __shared__ float mv[SAMPLE_MAX_CHUNKS * SAMPLE_K];
    __shared__ int mi[SAMPLE_MAX_CHUNKS * SAMPLE_K];
    __shared__ float top_v[SAMPLE_K];
    __shared__ int top_i[SAMPLE_K];
    __shared__ double wj[SAMPLE_K];  // exp(x_j - x_0) of the transformed candidates
    __shared__ double cw_raw[SAMPLE_MAX_CHUNKS], cw_t[SAMPLE_MAX_CHUNKS];  // chunk masses
    __shared__ double part[1024];
    __shared__ double s_target;
    __shared__ int s_chunk, s_id, s_thread;
    __shared__ float s_raw;
    __shared__ unsigned p[SAMPLE_PW];
    __shared__ float st[SAMPLE_MAX_CHUNKS * 4];
    __shared__ double s_lse;
    const int r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    unsigned* o = out + (size_t)r * SAMPLE_OW;
    const float* x = logits + (size_t)r * ld;
    // the row's parameters and chunk statistics into shared memory, a thread a word
    if (tid < SAMPLE_PW) p[tid] = params[(size_t)r * SAMPLE_PW + tid];
    if (tid < chunks * 4) st[tid] = stats[(size_t)r * chunks * 4 + tid];
    __syncthreads();
    const int limit = (int)p[SP_LIMIT], nlp = (int)p[SP_NLP];
    const float t = sample_temp(p);
    float m = -INFINITY;
    int nvalid = 0;
    for (int c = 0; c < chunks; c++) {
        m = fmaxf(m, st[c * 4]);
        nvalid += (int)st[c * 4 + 3];
    }
    const float mt = t != 1.0f ? m / t : m;
    // The chunks' lists are sorted best first: a candidate's rank in the row is its place in
    // its own list plus, in every other list, how many rank before it (a binary search each).
    for (int j = tid; j < chunks * SAMPLE_K; j += nt) {
        const int id = cand_id[(size_t)r * chunks * SAMPLE_K + j];
        mv[j] = id >= 0 ? cand_v[(size_t)r * chunks * SAMPLE_K + j] : -INFINITY;
        mi[j] = id >= 0 ? id : 0x7fffffff;
    }
    if (tid < chunks) {
        const float cm = st[tid * 4];
        const bool any = cm > -INFINITY;
        cw_raw[tid] = any ? (double)st[tid * 4 + 1] * exp((double)cm - (double)m) : 0.0;
        cw_t[tid] = any ? (double)st[tid * 4 + 2] * exp((double)(t != 1.0f ? cm / t : cm) - (double)mt) : 0.0;
    }
    __syncthreads();
    for (int j = tid; j < chunks * SAMPLE_K; j += nt) {
        const int own = j / SAMPLE_K;
        const float v = mv[j];
        const int id = mi[j];
        if (id == 0x7fffffff) continue;
        int rank = j - own * SAMPLE_K;
        for (int c = 0; c < chunks && rank < SAMPLE_K; c++) {
            if (c == own) continue;
            const float* lv = mv + c * SAMPLE_K;
            const int* li = mi + c * SAMPLE_K;
            int lo = 0, hi = SAMPLE_K;  // the first entry that does not rank before (v, id)
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (sample_before(lv[mid], li[mid], v, id)) lo = mid + 1;
                else hi = mid;
            }
            rank += lo;
        }
        if (rank < SAMPLE_K) {
            top_v[rank] = v;
            top_i[rank] = id;
        }
    }
    __syncthreads();
    const int nc = min(nvalid, SAMPLE_K);
    // the transformed candidates x_j = v_j / t (the sampler's f32 division) and their weights
    const float x0 = nc > 0 ? (t != 1.0f ? top_v[0] / t : top_v[0]) : 0.0f;
    if (tid < SAMPLE_K) {
        const float xj = tid < nc ? (t != 1.0f ? top_v[tid] / t : top_v[tid]) : -INFINITY;
        mv[tid] = xj;
        mi[tid] = top_i[tid];
        wj[tid] = tid < nc ? exp((double)xj - (double)x0) : 0.0;
    }
    __syncthreads();
    if ((phase & SAMPLE_RAW) && tid == 0) {
        double s = 0.0;
        for (int c = 0; c < chunks; c++) s += cw_raw[c];
        const double lse = (double)m + log(s);
        s_lse = lse;
        o[SO_LSE] = __float_as_uint((float)lse);
        const int top = max(0, min(nlp, min(nc, SAMPLE_TOPN)));
        o[SO_NTOP] = (unsigned)top;
        for (int j = 0; j < top; j++) {
            o[SO_TOP + 2 * j] = (unsigned)top_i[j];
            o[SO_TOP + 2 * j + 1] = __float_as_uint((float)((double)top_v[j] - lse));
        }
    }
    if (!(phase & SAMPLE_DRAW)) return;
    if (tid == 0) {
        const float temp = sample_f(p, SP_TEMP), top_p = sample_f(p, SP_TOPP), min_p = sample_f(p, SP_MINP);
        const int top_k = (int)p[SP_TOPK];
        const double u = __longlong_as_double((long long)(((u64)p[SP_U_HI] << 32) | p[SP_U_LO]));
        const bool complete = nvalid <= SAMPLE_K;  // the candidates are every finite logit
        int id = 0, flag = 0, len = 0;
        s_chunk = -1;
        if (temp == 0.0f || top_k == 1) {
            id = nc > 0 ? mi[0] : 0;
        } else if (nc > 0) {
            double full = 0.0;  // the softmax mass at temperature t, relative to x_0
            for (int c = 0; c < chunks; c++) full += cw_t[c];
            double total = 0.0;
            if (top_k > 0 && top_k < limit) {
                if (top_k > SAMPLE_K && !complete) {
                    flag = 1;
                } else {
                    len = min(top_k, nc);
                    for (int j = 0; j < len; j++) total += wj[j];
                }
            } else if (top_p >= 1.0f && min_p <= 0.0f) {
                // plain sampling: the inverse CDF over every id in id order; find the chunk
                const double target = u * full;
                double acc = 0.0;
                int last = -1;
                for (int c = 0; c < chunks && s_chunk < 0; c++) {
                    if (!(cw_t[c] > 0.0)) continue;
                    last = c;
                    if (target < acc + cw_t[c]) {
                        s_chunk = c;
                        s_target = target - acc;
                    }
                    acc += cw_t[c];
                }
                if (s_chunk < 0) {  // rounding: the last positive weight
                    s_chunk = last;
                    s_target = 1e300;
                }
            } else if (min_p > 0.0f) {
                total = top_p < 1.0f ? full : 0.0;
                const double thr = (double)x0 + log((double)min_p);
                while (len < nc && (double)mv[len] >= thr) len++;
                if (len == nc && !complete) flag = 1;  // more ids past the candidates may pass
            } else {
                total = full;
                double mass = 0.0;
                for (int j = 0; j < nc; j++) mass += wj[j];
                if (!(mass >= (double)top_p * total) && !complete) flag = 1;
                len = nc;
            }
            if (!flag && s_chunk < 0) {
                if (top_p < 1.0f && len > 1) {
                    const double target = (double)top_p * total;
                    double acc = 0.0;
                    for (int j = 0; j < len; j++) {
                        acc += wj[j];
                        if (acc >= target) {
                            len = j + 1;
                            break;
                        }
                    }
                }
                if (min_p > 0.0f) {
                    const double thr = (double)x0 + log((double)min_p);
                    int keep = 0;
                    while (keep < len && !((double)mv[keep] < thr)) keep++;
                    len = max(keep, 1);
                }
                double sum = 0.0;
                for (int j = 0; j < len; j++) sum += wj[j];
                double acc = 0.0;
                id = mi[len - 1];
                for (int j = 0; j < len; j++) {
                    acc += wj[j] / sum;
                    if (u < acc) {
                        id = mi[j];
                        break;
                    }
                }
            }
        }
        s_id = id;
        o[SO_FLAG] = (unsigned)flag;
        s_thread = -1;
    }
    __syncthreads();
    if (s_chunk >= 0) {
        // plain sampling, the chosen chunk: each thread a contiguous range of ids, in order
        const int c = s_chunk, start = c * SAMPLE_CHUNK, cn = max(0, min(SAMPLE_CHUNK, limit - start));
        const int per = (cn + nt - 1) / nt, lo = start + tid * per, hi = min(start + cn, lo + per);
        double s = 0.0;
        for (int i = lo; i < hi; i++) {
            float v = x[i];
            if (v != v) v = -INFINITY;
            s += (double)expf((t != 1.0f ? v / t : v) - mt);
        }
        part[tid] = s;
        __syncthreads();
        if (tid == 0) {
            double acc = 0.0, target = s_target;
            int last = -1;
            for (int i = 0; i < nt; i++) {
                if (part[i] > 0.0) last = i;
                if (s_thread < 0 && part[i] > 0.0 && target < acc + part[i]) {
                    s_thread = i;
                    s_target = target - acc;
                }
                acc += part[i];
            }
            if (s_thread < 0) {
                s_thread = last;
                s_target = 1e300;
            }
        }
        __syncthreads();
        if (tid == s_thread) {
            double acc = 0.0;
            int id = lo;
            for (int i = lo; i < hi; i++) {
                float v = x[i];
                if (v != v) v = -INFINITY;
                const float w = expf((t != 1.0f ? v / t : v) - mt);
                if (w > 0.0f) {
                    acc += (double)w;
                    id = i;
                    if (s_target < acc) break;
                }
            }
            s_id = id;
        }
        __syncthreads();
    }
    // the id's raw log-probability (its value before the penalties where they were applied)
    const int id = s_id;
    if (tid == 0) s_raw = x[id];
    __syncthreads();
    if ((phase & SAMPLE_PENALIZED) && nlp >= 0) {
        const int off = (int)p[SP_PEN_OFF], len = (int)p[SP_PEN_LEN];
        for (int j = tid; j < len; j += nt)
            if (pen[2 * (off + j)] == id) s_raw = saved[off + j];
        __syncthreads();
    }
    if (tid == 0) {
        // the log-sum-exp of this launch, or of the raw pass before the penalties
        const double lse = (phase & SAMPLE_RAW) ? s_lse : (double)__uint_as_float(o[SO_LSE]);
        o[SO_ID] = (unsigned)id;
        o[SO_LP] = __float_as_uint((float)((double)s_raw - lse));
    }
}
