// Runs attn_prefill.cu's and attn_decode.cu's kernels on the CPU emulator (through run.sh):
// attn_prep_rows against attn_prep; the prefill flash kernel attn_flash4_hd256 (and its fused
// query prep) against a double-precision causal softmax(q·k * scale) · v times sigmoid(gate);
// attn_decode_mma_hd256 (split-K over the context on tensor cores) then attn_combine_dec against
// the same reference at the model's head dim (256) with 8 query heads per KV head, 2, and 1 (no
// GQA sharing), with partial tiles and splits, up to the step's 64 and 256 splits at 4,096,
// 16,384 and 32,805 positions (the GPU test attn_decode_splits_match_reference_long_kv goes on
// to 131,072).
#include "kernels_emu.inc"
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

static std::mt19937_64 rng(5);
static float uni(float a, float b) { return std::uniform_real_distribution<float>(a, b)(rng); }
static int fails = 0;

using DecodeMma = void (*)(const float*, const bf16*, const bf16*, float*, const int*, int, int, int, float, const u64*);
template <int HD>
static void run(int nq, int nkv, int n, int nsplit, DecodeMma kernel) {
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
               [&] { kernel(q.data(), kc.data(), vc.data(), part.data(), &past, nq, nkv, nsplit, scale, nullptr); });
    emu_launch({(unsigned)nq, (unsigned)(HD / 32), 1}, 256, 0,
               [&] { attn_combine_dec(part.data(), qg.data(), out.data(), &past, nq, HD, nsplit, 0); });
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

// Prefill flash kernel (attn_flash4_hd256): `t` new positions after `past` cached ones, causal,
// sigmoid gate, against f64 softmax(q.k * scale) . v * sigmoid(gate) with the kernel's bf16 K/V
// (q and gate in f32). grid (nq / 2, ceil(t / 64)), block 384.
using FlashKernel = void (*)(const float*, const bf16*, const bf16*, const float*, bf16*, int, int, int, int, int, float);
template <int HD>
static void run_flash(const char* name, FlashKernel kernel, size_t smem, int t, int past, int nq, int nkv,
                      unsigned threads) {
    const int n = past + t;
    std::vector<float> q((size_t)t * nq * HD), qg((size_t)t * nq * 2 * HD);
    std::vector<bf16> kc((size_t)n * nkv * HD), vc((size_t)n * nkv * HD);
    for (auto& x : q) x = uni(-1, 1);
    for (auto& x : qg) x = uni(-2, 2);
    for (auto& x : kc) x = __float2bfloat16(uni(-2, 2));
    for (auto& x : vc) x = __float2bfloat16(uni(-1, 1));
    const float scale = 1.0f / std::sqrt((float)HD);
    std::vector<bf16> out((size_t)t * nq * HD, __float2bfloat16(std::nanf("")));
    emu_launch({(unsigned)(nq / 2), (unsigned)((t + 63) / 64), 1}, threads, smem, [&] {
        kernel(q.data(), kc.data(), vc.data(), qg.data(), out.data(), t, past, nq, nkv, HD, scale);
    });
    const int group = nq / nkv;
    double num = 0, den = 0, err = 0, mag = 0;
    for (int s = 0; s < t; s++)
        for (int h = 0; h < nq; h++) {
            int kvh = h / group, nk = past + s + 1;
            std::vector<double> sc(nk);
            double mx = -1e300;
            for (int j = 0; j < nk; j++) {
                double d = 0;
                for (int i = 0; i < HD; i++)
                    d += (double)q[((size_t)s * nq + h) * HD + i] * __bfloat162float(kc[((size_t)j * nkv + kvh) * HD + i]);
                sc[j] = d * scale;
                mx = std::max(mx, sc[j]);
            }
            double l = 0;
            for (int j = 0; j < nk; j++) l += sc[j] = std::exp(sc[j] - mx);
            for (int i = 0; i < HD; i++) {
                double o = 0;
                for (int j = 0; j < nk; j++) o += sc[j] * __bfloat162float(vc[((size_t)j * nkv + kvh) * HD + i]);
                double gate = 1.0 / (1.0 + std::exp(-(double)qg[((size_t)s * nq + h) * 2 * HD + HD + i]));
                double ref = o / l * gate, got = __bfloat162float(out[((size_t)s * nq + h) * HD + i]);
                if (!std::isfinite(got)) err = INFINITY;
                err = std::max(err, std::fabs(got - ref));
                mag = std::max(mag, std::fabs(ref));
                num += (got - ref) * (got - ref);
                den += ref * ref;
            }
        }
    // The GPU test's measure (norm-relative, bar 1e-2; measured 2.3e-3 at hd 256) and the max.
    double nrel = std::sqrt(num / den);
    bool ok = nrel <= 1e-2 && err / mag <= 2e-2;
    printf("%s %s t=%d past=%d nq=%d nkv=%d: norm rel err %.2e, max err %.2e of max |out| %.2e\n",
           ok ? "ok  " : "FAIL", name, t, past, nq, nkv, nrel, err / mag, mag);
    fails += !ok;
}

// attn_flash4 reading q prepared by attn_prep_rows (the FlashKernel signature, no fused prep).
static void flash4_plain(const float* q, const bf16* kc, const bf16* vc, const float* qg, bf16* out, int t, int past,
                         int nq, int nkv, int hd, float scale) {
    attn_flash4_hd256(q, kc, vc, qg, out, t, past, nq, nkv, hd, scale, nullptr, nullptr, 0, 0.0f);
}

// attn_flash4 preparing the query heads itself (q_norm set; attn_prep_rows on the KV heads only)
// against attn_prep_rows on all heads then attn_flash4 on its q: the same sums in the same order,
// so the caches and the outputs bitwise equal.
static void run_flash4_prep(int t, int past, int nq, int nkv, int rot_half) {
    const int hd = 256, n = past + t;
    std::vector<float> qg((size_t)t * nq * 2 * hd), k((size_t)t * nkv * hd), v(k.size()), qn(hd), kn(hd), invf(rot_half);
    for (auto* a : {&qg, &k, &v}) for (auto& x : *a) x = uni(-2, 2);
    for (auto* a : {&qn, &kn}) for (auto& x : *a) x = uni(-0.5, 0.5);
    for (int i = 0; i < rot_half; i++) invf[i] = std::pow(10000.0f, -(float)i / rot_half);
    std::vector<bf16> cache((size_t)n * nkv * hd);
    for (auto& x : cache) x = __float2bfloat16(uni(-1, 1));
    const float scale = 1.0f / 16.0f;
    std::vector<bf16> out[2], kc[2], vc[2];
    for (int fused = 0; fused < 2; fused++) {
        std::vector<float> q((size_t)t * nq * hd, NAN);
        kc[fused] = cache, vc[fused] = cache;
        out[fused].assign((size_t)t * nq * hd, __float2bfloat16(std::nanf("")));
        const int h0 = fused ? nq : 0;
        emu_launch({(unsigned)((t * (nq + nkv - h0) + 7) / 8), 1, 1}, 256, (size_t)8 * hd * 4, [&] {
            attn_prep_rows(qg.data(), k.data(), v.data(), qn.data(), kn.data(), invf.data(), q.data(), kc[fused].data(),
                           vc[fused].data(), past, t, nq, nkv, hd, rot_half, 1e-6f, h0);
        });
        emu_launch({(unsigned)(nq / 2), (unsigned)((t + 63) / 64), 1}, 384, F4_SMEM, [&] {
            attn_flash4_hd256(q.data(), kc[fused].data(), vc[fused].data(), qg.data(), out[fused].data(), t, past, nq,
                              nkv, hd, scale, fused ? qn.data() : nullptr, fused ? invf.data() : nullptr, rot_half,
                              1e-6f);
        });
    }
    size_t diff = 0, nan = 0;
    for (size_t i = 0; i < out[0].size(); i++) {
        const float a = __bfloat162float(out[0][i]), b = __bfloat162float(out[1][i]);
        nan += !std::isfinite(a) || !std::isfinite(b);
        diff += a != b;
    }
    auto same = [](const std::vector<bf16>& a, const std::vector<bf16>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
    };
    const bool caches = same(kc[0], kc[1]) && same(vc[0], vc[1]);
    const bool ok = nan == 0 && diff == 0 && caches;
    printf("%s attn_flash4 fused q prep t=%d past=%d rot=%d: %zu of %zu outputs differ from the separate prep, %zu "
           "non-finite, caches %s\n",
           ok ? "ok  " : "FAIL", t, past, 2 * rot_half, diff, out[0].size(), nan,
           caches ? "equal" : "DIFFER");
    fails += !ok;
}

// attn_prep_rows (prefill: a warp per row) against attn_prep (a block per row): q out, the K and V
// cache rows at past + s, over the model's head dim (partial rotation) and the fixtures'.
static void run_prep(int t, int past, int nq, int nkv, int hd, int rot_half) {
    std::vector<float> qg((size_t)t * nq * 2 * hd), k((size_t)t * nkv * hd), v(k.size()), qn(hd), kn(hd), invf(rot_half);
    for (auto* a : {&qg, &k, &v, &qn, &kn}) for (auto& x : *a) x = uni(-1, 1);
    for (int i = 0; i < rot_half; i++) invf[i] = std::pow(10000.0f, -(float)i / rot_half);
    const size_t cache = (size_t)(past + t) * nkv * hd;
    std::vector<float> q_a((size_t)t * nq * hd, NAN), q_b(q_a.size(), NAN);
    std::vector<bf16> kc_a(cache, __float2bfloat16(0)), vc_a(cache, __float2bfloat16(0)), kc_b(kc_a), vc_b(vc_a);
    emu_launch({(unsigned)t, (unsigned)(nq + nkv), 1}, (unsigned)((hd + 31) / 32 * 32), (size_t)hd * 4, [&] {
        attn_prep(qg.data(), k.data(), v.data(), qn.data(), kn.data(), invf.data(), q_a.data(), kc_a.data(), vc_a.data(),
                  past, nullptr, nq, nkv, hd, rot_half, 1e-6f, nullptr);
    });
    emu_launch({(unsigned)((t * (nq + nkv) + 7) / 8), 1, 1}, 256, (size_t)8 * hd * 4, [&] {
        attn_prep_rows(qg.data(), k.data(), v.data(), qn.data(), kn.data(), invf.data(), q_b.data(), kc_b.data(),
                       vc_b.data(), past, t, nq, nkv, hd, rot_half, 1e-6f, 0);
    });
    double eq = 0;
    for (size_t i = 0; i < q_a.size(); i++) eq = std::isnan(q_b[i]) ? INFINITY : std::max(eq, (double)std::fabs(q_a[i] - q_b[i]));
    // The caches: one bf16 rounding apart at most (the two sum the norm in different orders).
    double ec = 0;
    for (size_t i = 0; i < cache; i++)
        for (auto [a, b] : {std::pair{kc_a[i], kc_b[i]}, std::pair{vc_a[i], vc_b[i]}}) {
            const double x = __bfloat162float(a), y = __bfloat162float(b);
            ec = std::max(ec, std::fabs(x - y) / (std::fabs(x) * 0.0078125 + 1e-6));
        }
    const bool ok = eq < 1e-5 && ec <= 1.0;
    printf("attn_prep_rows t %d past %d hd %d rot %d: q max diff %.1e, cache %.2f of one bf16 ulp vs attn_prep %s\n", t,
           past, hd, 2 * rot_half, eq, ec, ok ? "ok" : "FAILED");
    fails += !ok;
}

// The decode step batched over sequences of different lengths (attn_prep, attn_decode_mma_hd256,
// attn_combine_dec with grid rows, the caches through the table, positions per row) against one
// launch of each a sequence: bitwise (the same arithmetic per row).
static void run_decode_batch(int nq, int nkv, std::vector<int> lens, int nsplit) {
    constexpr int HD = 256;
    const int rows = (int)lens.size(), rot_half = 32, ldqg = nq * 2 * HD + 5;  // gates' rows padded
    const float scale = 1.0f / std::sqrt((float)HD), eps = 1e-6f;
    std::vector<float> qg((size_t)rows * ldqg), k((size_t)rows * nkv * HD), v(k.size()), qn(HD), kn(HD), invf(rot_half);
    for (auto* a : {&qg, &k, &v, &qn, &kn}) for (auto& x : *a) x = uni(-1, 1);
    for (int i = 0; i < rot_half; i++) invf[i] = std::pow(10000.0f, -(float)i / rot_half);
    std::vector<std::vector<bf16>> kc(rows), vc(rows);
    for (int r = 0; r < rows; r++) {
        kc[r].resize((size_t)lens[r] * nkv * HD);
        vc[r].resize(kc[r].size());
        for (auto& x : kc[r]) x = __float2bfloat16(uni(-2, 2));
        for (auto& x : vc[r]) x = __float2bfloat16(uni(-1, 1));
    }
    const size_t smem = (16 + 4 * 32) * (HD + 8) * 2, pw = (size_t)nq * nsplit * (HD + 2);
    // one launch of each a row
    auto kc_a = kc, vc_a = vc;
    std::vector<float> q_a((size_t)rows * nq * HD), part_a(rows * pw, 0.0f);
    std::vector<bf16> out_a((size_t)rows * nq * HD);
    for (int r = 0; r < rows; r++) {
        int past = lens[r] - 1;
        // qg's row holds [q | gate] per head; attn_prep reads k and v from their own rows
        std::vector<float> qr(qg.begin() + (size_t)r * ldqg, qg.begin() + (size_t)r * ldqg + nq * 2 * HD);
        emu_launch({1, (unsigned)(nq + nkv), 1}, HD, (size_t)HD * 4, [&] {
            attn_prep(qr.data(), k.data() + (size_t)r * nkv * HD, v.data() + (size_t)r * nkv * HD, qn.data(), kn.data(),
                      invf.data(), q_a.data() + (size_t)r * nq * HD, kc_a[r].data(), vc_a[r].data(), 0, &past, nq, nkv,
                      HD, rot_half, eps, nullptr);
        });
        emu_launch({(unsigned)nkv, (unsigned)nsplit, 1}, 32, smem, [&] {
            attn_decode_mma_hd256(q_a.data() + (size_t)r * nq * HD, kc_a[r].data(), vc_a[r].data(),
                                  part_a.data() + r * pw, &past, nq, nkv, nsplit, scale, nullptr);
        });
        emu_launch({(unsigned)nq, (unsigned)(HD / 32), 1}, 256, 0, [&] {
            attn_combine_dec(part_a.data() + r * pw, qg.data() + (size_t)r * ldqg, out_a.data() + (size_t)r * nq * HD,
                             &past, nq, HD, nsplit, 0);
        });
    }
    // batched
    auto kc_b = kc, vc_b = vc;
    std::vector<float> q_b(q_a.size()), part_b(part_a.size(), 0.0f), qg_rows((size_t)rows * nq * 2 * HD);
    std::vector<bf16> out_b(out_a.size());
    std::vector<int> pos(rows);
    std::vector<u64> tab(2 * rows);
    for (int r = 0; r < rows; r++) {
        pos[r] = lens[r] - 1;
        tab[r] = reinterpret_cast<u64>(kc_b[r].data());
        tab[rows + r] = reinterpret_cast<u64>(vc_b[r].data());
        std::copy(qg.begin() + (size_t)r * ldqg, qg.begin() + (size_t)r * ldqg + nq * 2 * HD,
                  qg_rows.begin() + (size_t)r * nq * 2 * HD);
    }
    emu_launch({(unsigned)rows, (unsigned)(nq + nkv), 1}, HD, (size_t)HD * 4, [&] {
        attn_prep(qg_rows.data(), k.data(), v.data(), qn.data(), kn.data(), invf.data(), q_b.data(), nullptr, nullptr, 0,
                  pos.data(), nq, nkv, HD, rot_half, eps, tab.data());
    });
    emu_launch({(unsigned)nkv, (unsigned)nsplit, (unsigned)rows}, 32, smem, [&] {
        attn_decode_mma_hd256(q_b.data(), nullptr, nullptr, part_b.data(), pos.data(), nq, nkv, nsplit, scale, tab.data());
    });
    emu_launch({(unsigned)nq, (unsigned)(HD / 32), (unsigned)rows}, 256, 0, [&] {
        attn_combine_dec(part_b.data(), qg.data(), out_b.data(), pos.data(), nq, HD, nsplit, ldqg);
    });
    auto eq16 = [](const std::vector<bf16>& a, const std::vector<bf16>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
    };
    bool same = q_a == q_b && part_a == part_b;
    for (int r = 0; r < rows; r++) same = same && eq16(kc_a[r], kc_b[r]) && eq16(vc_a[r], vc_b[r]);
    for (size_t i = 0; i < out_a.size(); i++) same = same && __bfloat162float(out_a[i]) == __bfloat162float(out_b[i]);
    printf("attn decode batched over %d sequences (nq %d nkv %d, %d splits): %s one launch a sequence %s\n", rows, nq, nkv,
           nsplit, same ? "bitwise" : "DIFFERS from", same ? "ok" : "FAILED");
    fails += !same;
}

int main(int argc, char** argv) {
    run_prep(37, 5, 16, 2, 256, 32);
    run_prep(9, 0, 4, 2, 32, 8);
    run_prep(3, 11, 2, 1, 20, 10);
    bool flash = argc < 2 || std::string(argv[1]) != "decode", decode = argc < 2 || std::string(argv[1]) != "flash";
    for (bool d : {false, true}) {
        g_cp_deferred = d;
        if (!flash) continue;
        // wgmma (emulated through its descriptors: Q/K K-major, V N-major, P from registers), a producer
        // warpgroup and mbarriers: block 384
        run_flash<256>("attn_flash4_hd256", flash4_plain, F4_SMEM, 130, 70, 4, 2, 384);  // ragged, past
        run_flash<256>("attn_flash4_hd256", flash4_plain, F4_SMEM, 64, 0, 4, 2, 384);    // one block, no past
        run_flash<256>("attn_flash4_hd256", flash4_plain, F4_SMEM, 100, 29, 4, 2, 384);  // unaligned past
        run_flash<256>("attn_flash4_hd256", flash4_plain, F4_SMEM, 5, 190, 16, 2, 384);  // short chunk, 8 per group
        run_flash4_prep(130, 70, 4, 2, 32);
        run_flash4_prep(70, 0, 4, 1, 16);
    }
    for (bool d : {false, true}) {
        g_cp_deferred = d;
        if (!decode) continue;
        g_cp_deferred = d;
        run<256>(16, 2, 300, 4, attn_decode_mma_hd256);   // splits of 75 keys: 3 tiles, the last partial
        run<256>(16, 2, 300, 16, attn_decode_mma_hd256);  // the bench at 256: 10 splits of 32
        run<256>(16, 2, 530, 16, attn_decode_mma_hd256);  // 9 splits of 64 (ceil(530 / 16) = 34 rounded up)
        run<256>(16, 2, 70, 4, attn_decode_mma_hd256);    // splits of 32, 32 and 6 keys, one empty
        run<256>(4, 2, 1, 4, attn_decode_mma_hd256);      // the first decoded token, 2 per group
        run<256>(4, 2, 200, 16, attn_decode_mma_hd256);
        run<256>(8, 8, 130, 4, attn_decode_mma_hd256);    // no GQA sharing
        run<256>(16, 2, 4097, 64, attn_decode_mma_hd256);
        run<256>(16, 2, 3000, 256, attn_decode_mma_hd256);  // many splits: 47 of 64 positions
        // The step's own counts at long context (decode_splits: 64 up to 4,096, 256 beyond):
        run<256>(16, 2, 4096, 64, attn_decode_mma_hd256);    // 64 full splits of 64
        run<256>(16, 2, 16384, 256, attn_decode_mma_hd256);  // 256 full splits of 64
        run<256>(16, 2, 32805, 256, attn_decode_mma_hd256);  // 255 splits of 129, the last of 39
    }
    if (decode) {
        run_decode_batch(16, 2, {1, 70, 300}, 16);  // ragged: one split used, three, all ten
        run_decode_batch(8, 8, {33, 5}, 4);
        run_decode_batch(16, 2, {16500, 1, 4097}, 256);  // long rows, 256 splits: 65 positions each
    }
    return fails ? 1 : 0;
}
