// Embedding gather, casts, seeded random fill and the memory-bandwidth probes.

extern "C" __global__ void embed_gather(const bf16* __restrict__ table, const int* __restrict__ ids,
                                        float* __restrict__ out, int d) {
    DECODE_KERNEL(TAG_EMBED);
    griddep_wait();
    int t = blockIdx.x;
    const bf16* row = table + (size_t)ids[t] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[(size_t)t * d + i] = __bfloat162float(row[i]);
}

// The greedy id of each row of logits (a block a row): the largest of ids < limit, the lowest on
// ties, NaN never chosen, 0 where nothing beats -inf (as the sampler's greedy_id). logits: rows
// of `ld` floats. Rows of whole 16-byte words (ld % 4 == 0) are read as float4s, four in flight
// a thread (scalar loads, one at a time, ran 8 rows of 248,320 in ~90 us on the H200: a block
// holds too few loads in flight to stream a 1 MB row); each thread's ids still ascend.
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int ld, int limit,
                                                               int* __restrict__ out) {
    PREFILL_KERNEL();
    const float* x = logits + (size_t)blockIdx.x * ld;
    float best = -INFINITY;
    int id = 0x7fffffff;
    const int n4 = (ld & 3) ? 0 : limit >> 2, step = blockDim.x;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int c0 = threadIdx.x; c0 < n4; c0 += 4 * step) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            v[u] = c0 + u * step < n4 ? __ldg(x4 + c0 + u * step) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = 4 * (c0 + u * step);
            if (v[u].x > best) { best = v[u].x; id = i; }
            if (v[u].y > best) { best = v[u].y; id = i + 1; }
            if (v[u].z > best) { best = v[u].z; id = i + 2; }
            if (v[u].w > best) { best = v[u].w; id = i + 3; }
        }
    }
    for (int i = 4 * n4 + threadIdx.x; i < limit; i += step)
        if (x[i] > best) { best = x[i]; id = i; }  // each thread's ids ascend: the first wins ties
    block_argmax(best, id);
    if (threadIdx.x == 0) out[blockIdx.x] = id == 0x7fffffff ? 0 : id;
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(x[i]);
}

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Seeded approximately-normal values (sum of four uniforms), mean + std * N(0,1).
extern "C" __global__ void fill_random_bf16(bf16* __restrict__ out, u64 n, u64 seed, float mean, float std) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 r = splitmix64(seed * 0x100000001B3ull + i);
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) s += (float)((r >> (16 * k)) & 0xffff) * (1.0f / 65536.0f);
        out[i] = __float2bfloat16(mean + (s - 2.0f) * 1.7320508f * std);
    }
}

extern "C" __global__ void fill_random_f32(float* __restrict__ out, u64 n, u64 seed, float mean, float std) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 r = splitmix64(seed * 0x100000001B3ull + i);
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) s += (float)((r >> (16 * k)) & 0xffff) * (1.0f / 65536.0f);
        out[i] = mean + (s - 2.0f) * 1.7320508f * std;
    }
}

// Seeded e4m3 bytes of about N(0, 1) * mult (saturated to +-448; the synthetic FP8 weights, whose
// block scales carry std / mult), 4 bytes a thread: n % 4 == 0.
extern "C" __global__ void fill_random_e4m3(unsigned* __restrict__ out, u64 n, u64 seed, float mult) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n / 4; i += (u64)gridDim.x * blockDim.x) {
        float v[4];
#pragma unroll
        for (int b = 0; b < 4; b++) {
            u64 r = splitmix64(seed * 0x100000001B3ull + 4 * i + b);
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; k++) s += (float)((r >> (16 * k)) & 0xffff) * (1.0f / 65536.0f);
            v[b] = (s - 2.0f) * 1.7320508f * mult;
        }
        unsigned short lo, hi;  // cvt's first operand goes to the upper byte
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[1]), "f"(v[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[3]), "f"(v[2]));
        out[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
}

// Memory bandwidth probe: y = x, 16 bytes per thread per step.
extern "C" __global__ void copy_probe(const uint4* __restrict__ x, uint4* __restrict__ y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) y[i] = x[i];
}

// Weight-stream probe: how fast the grouped MoE GEMMs' operand pattern reads from DRAM. A
// persistent block (128 threads, one per SM) walks 1 MiB items (256 rows of 4 KiB, an expert
// slice's rows at K = 2,048) in 32 KiB stages with 16-byte cp.async into a 4-stage ring, as
// moe_gemm6's producer does. A stage is `run` 16-byte chunks of each of 2048 / run rows (run 8:
// 128 bytes of all 256 rows, the GEMMs' K step; run 256: 8 whole rows, i.e. contiguous).
// Nothing consumes the stages; xs_out keeps the copies from being dropped.
extern "C" __global__ void __launch_bounds__(128) read_probe(const uint4* __restrict__ w, int items, int run,
                                                             unsigned* __restrict__ xs_out) {
    extern __shared__ __align__(16) uint4 probe_smem[];  // [4][2048]
    const int tid = threadIdx.x, rows = 2048 / run, blocks = 256 / rows;
    unsigned it = 0;
    for (int q = blockIdx.x; q < items; q += gridDim.x) {
        const uint4* item = w + (size_t)q * 65536;  // 1 MiB in 16-byte chunks
        for (int kt = 0; kt < 32; kt++, it++) {
            uint4* st = probe_smem + (it % 4) * 2048;
            const int cs = kt / blocks, rb = kt % blocks;  // column step, row block
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int i = tid + 128 * j;  // chunk of the stage
                cp_async16(st + i, item + (size_t)(rb * rows + i / run) * 256 + cs * run + i % run, true);
            }
            cp_async_commit();
            cp_async_wait<2>();
        }
    }
    cp_async_wait_all();
    __syncthreads();
    if (tid == 0) xs_out[blockIdx.x] = probe_smem[0].x ^ probe_smem[4095].y;
}

// FP8 weights to bf16 for the prefill GEMMs: out[r, c] = bf16(q[r, c] s[r / 128, c / 128]) for W
// e4m3 [n, k] (k % 16 == 0; experts stacked [E n', k] with n' % 128 == 0 read as one matrix)
// with f32 block scales s [ceil(n / 128), ceil(k / 128)]; a thread a 16-byte word (16 weights),
// grid-stride.
extern "C" __global__ void dequant_fp8_bf16(const uint4* __restrict__ q, const float* __restrict__ sc, u64 n, int k,
                                            uint4* __restrict__ out) {
    PREFILL_KERNEL();
    const long long kw = k >> 4, kb = (k + 127) >> 7, total = (long long)n * kw;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / kw, c = i % kw;
        const float s = __ldg(sc + (r >> 7) * kb + (c >> 3));
        const uint4 w = __ldg(q + i);
        const unsigned words[4] = {w.x, w.y, w.z, w.w};
        unsigned o[8];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float4 f = e4m3x4_to_float4(words[u]);
            __nv_bfloat162 lo = __floats2bfloat162_rn(f.x * s, f.y * s), hi = __floats2bfloat162_rn(f.z * s, f.w * s);
            o[2 * u] = *reinterpret_cast<unsigned*>(&lo);
            o[2 * u + 1] = *reinterpret_cast<unsigned*>(&hi);
        }
        out[2 * i] = make_uint4(o[0], o[1], o[2], o[3]);
        out[2 * i + 1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
}

// Affine 4-bit weights (q4 tiles, gemv.cuh) to bf16 for the prefill GEMMs: out[r, c] =
// bf16(scale * q + bias) for w [n, k] (n % 16 == 0, k % 64 == 0; experts stacked [E n', k] read
// as one matrix), a thread a lane's 16 bytes of a unit (32 codes of rows g and g + 8 of a strip),
// grid-stride.
extern "C" __global__ void dequant_q4_bf16(const uint4* __restrict__ q, const unsigned* __restrict__ sb, int group,
                                           u64 n, int k, bf16* __restrict__ out) {
    PREFILL_KERNEL();
    const long long U = k >> 6, G = k / group, total = (long long)(n >> 4) * U * 32;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int lane = (int)(i & 31), g = lane >> 2, c = 2 * (lane & 3);
        const long long su = i >> 5, s = su / U;
        const int u = (int)(su - s * U);
        const uint4 w = __ldg(q + i);
        const unsigned wj[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int col = u * 64 + 16 * j + c, grp = col / group;  // the k-step's 16 columns share a group
            const unsigned pa = __ldg(sb + (s * G + grp) * 16 + g), pb = __ldg(sb + (s * G + grp) * 16 + g + 8);
            const float sa = __uint_as_float(pa << 16), ba = __uint_as_float(pa & 0xffff0000u);
            const float sbv = __uint_as_float(pb << 16), bb = __uint_as_float(pb & 0xffff0000u);
            auto q_at = [&](int nib) { return (float)((wj[j] >> (4 * nib)) & 15u); };
            unsigned* ra = reinterpret_cast<unsigned*>(out + (s * 16 + g) * (long long)k + col);
            unsigned* rb = reinterpret_cast<unsigned*>(out + (s * 16 + g + 8) * (long long)k + col);
            ra[0] = pack_bf16x2(sa * q_at(0) + ba, sa * q_at(4) + ba);
            rb[0] = pack_bf16x2(sbv * q_at(1) + bb, sbv * q_at(5) + bb);
            ra[4] = pack_bf16x2(sa * q_at(2) + ba, sa * q_at(6) + ba);
            rb[4] = pack_bf16x2(sbv * q_at(3) + bb, sbv * q_at(7) + bb);
        }
    }
}

// Seeded affine 4-bit weights (the synthetic --synthetic full-int4 model): uniform random codes
// (n_words u32 words) and, for every (row, group), scale = std / 4.6 (1 + U(-1/8, 1/8)) and bias
// = -7.5 scale, so that w has mean ~0 and standard deviation ~std (the codes' is 4.6).
extern "C" __global__ void fill_random_q4(unsigned* __restrict__ codes, u64 n_words, unsigned* __restrict__ sb,
                                          u64 n_pairs, u64 seed, float std) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n_words; i += stride)
        codes[i] = (unsigned)splitmix64(seed * 0x100000001B3ull + i);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n_pairs; i += stride) {
        const u64 r = splitmix64((seed ^ 0x5CA1Eull) * 0x100000001B3ull + i);
        const float u = (float)(r >> 40) * (1.0f / 16777216.0f) - 0.5f;
        const float sc = std / 4.6f * (1.0f + 0.25f * u);
        sb[i] = pack_bf16x2(sc, -7.5f * sc);
    }
}
