// Runs attention.cu's decode kernels on the CPU emulator (through run.sh): attn_decode_mma_hd*
// (split-K over the context on tensor cores) then attn_combine_dec, against a double-precision
// softmax(q·k / sqrt(hd)) · v times sigmoid(gate), at the model's shape (hd 256, 8 query heads
// per KV head) and the fixtures' (hd 32, 2 per KV head), with partial tiles and splits.
#include "kernels_emu.inc"
#include <cstdio>
#include <random>

static std::mt19937_64 rng(5);
static float uni(float a, float b) { return std::uniform_real_distribution<float>(a, b)(rng); }
static int fails = 0;

template <int HD>
static void run(int nq, int nkv, int n, int nsplit, void (*kernel)(const float*, const bf16*, const bf16*, float*,
                                                                   const int*, int, int, int, float)) {
    std::vector<float> q((size_t)nq * HD), qg((size_t)nq * 2 * HD);
    std::vector<bf16> kc((size_t)n * nkv * HD), vc((size_t)n * nkv * HD);
    for (auto& x : q) x = uni(-1, 1);
    for (auto& x : qg) x = uni(-2, 2);
    for (auto& x : kc) x = __float2bfloat16(uni(-2, 2));  // wide scores: the max matters
    for (auto& x : vc) x = __float2bfloat16(uni(-1, 1));
    const float scale = 1.0f / std::sqrt((float)HD);
    std::vector<float> part((size_t)nq * nsplit * (HD + 2), std::nanf(""));
    std::vector<bf16> out((size_t)nq * HD, __float2bfloat16(std::nanf("")));
    int past = n - 1;
    const size_t smem = (16 + 4 * 32) * (HD + 8) * 2;
    emu_launch({(unsigned)nkv, (unsigned)nsplit, 1}, 32, smem,
               [&] { kernel(q.data(), kc.data(), vc.data(), part.data(), &past, nq, nkv, nsplit, scale); });
    emu_launch({(unsigned)nq, (unsigned)(HD / 32), 1}, 256, 0,
               [&] { attn_combine_dec(part.data(), qg.data(), out.data(), &past, nq, HD, nsplit); });
    double err = 0, mag = 0;
    const int group = nq / nkv;
    for (int h = 0; h < nq; h++) {
        int kvh = h / group;
        std::vector<double> s(n);
        double mx = -1e300;
        for (int j = 0; j < n; j++) {
            double d = 0;
            for (int i = 0; i < HD; i++) d += (double)q[h * HD + i] * __bfloat162float(kc[((size_t)j * nkv + kvh) * HD + i]);
            s[j] = d * scale;
            mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int j = 0; j < n; j++) l += s[j] = std::exp(s[j] - mx);
        for (int i = 0; i < HD; i++) {
            double o = 0;
            for (int j = 0; j < n; j++) o += s[j] * __bfloat162float(vc[((size_t)j * nkv + kvh) * HD + i]);
            double gate = 1.0 / (1.0 + std::exp(-(double)qg[(size_t)h * 2 * HD + HD + i]));
            double ref = o / l * gate, got = __bfloat162float(out[h * HD + i]);
            if (!std::isfinite(got)) err = INFINITY;
            err = std::max(err, std::fabs(got - ref));
            mag = std::max(mag, std::fabs(ref));
        }
    }
    // bf16 Q and P operands (like the prefill flash kernel) and a bf16 output: measured ~3e-3.
    bool ok = err / mag <= 6e-3;
    printf("%s attn decode hd=%d nq=%d nkv=%d n=%d nsplit=%d: max err %.2e of max |out| %.2e\n", ok ? "ok  " : "FAIL",
           HD, nq, nkv, n, nsplit, err / mag, mag);
    fails += !ok;
}

int main() {
    for (bool d : {false, true}) {
        g_cp_deferred = d;
        run<256>(16, 2, 300, 4, attn_decode_mma_hd256);  // splits of 75 keys: 3 tiles, the last partial
        run<256>(16, 2, 70, 4, attn_decode_mma_hd256);   // two splits of 64 and 6 keys, two empty
        run<32>(4, 2, 1, 4, attn_decode_mma_hd32);       // the first decoded token
        run<32>(4, 2, 200, 16, attn_decode_mma_hd32);
        run<64>(8, 8, 130, 4, attn_decode_mma_hd64);     // no GQA sharing
        run<128>(16, 2, 4097, 64, attn_decode_mma_hd128);
    }
    return fails ? 1 : 0;
}
