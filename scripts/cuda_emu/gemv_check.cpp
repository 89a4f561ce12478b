// Runs gemv.cu's decode GEMVs on the CPU emulator (through run.sh): gemv_dec and gemv_dec_w
// (k = 4096 a warp per whole row) against a double-precision y = y0 + W·x with bf16 inputs, at
// the model's inner dimensions and ragged row counts; the RMSNorm input path; gemv_dec_stream
// bitwise against gemv_dec; gemv_fp8 (e4m3 weights with 128 x 128 block scales, up to 16 tokens,
// bf16 or RMSNorm input) against a double product of the dequantised weights; gemv_q4 (affine
// 4-bit q4 tiles on the emulated mma.sync, groups of 32 / 64 / 128, 1-16 tokens, bf16 or RMSNorm
// input, the model's k and others) the same way; dequant_q4_bf16 (misc.cu) against the rounded
// dequantised values.
#include "kernels_emu.inc"
#include "q4_host.h"
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>

static std::mt19937_64 rng(9);
static float uni(float a, float b) { return std::uniform_real_distribution<float>(a, b)(rng); }

int main() {
    int fails = 0;
    for (auto [n, k] : {std::pair{37, 4096}, {20, 2048}, {9, 512}}) {
        std::vector<bf16> w((size_t)n * k), x(k);
        std::vector<float> y0(n);
        for (auto& v : w) v = __float2bfloat16(uni(-1, 1));
        for (auto& v : x) v = __float2bfloat16(uni(-1, 1));
        for (auto& v : y0) v = uni(-1, 1);
        for (bool whole : {false, true}) {
            std::vector<float> y = y0;
            int rows = gemv_rows_per_block(k, whole);
            emu_launch({(unsigned)((n + rows - 1) / rows), 1, 1}, 256, (size_t)k * 4, [&] {
                if (whole)
                    gemv_dec_w(w.data(), n, k, x.data(), nullptr, nullptr, 0.0f, nullptr, y.data(), 1.0f, nullptr,
                               nullptr, nullptr, 0, nullptr, nullptr);
                else
                    gemv_dec(w.data(), n, k, x.data(), nullptr, nullptr, 0.0f, nullptr, y.data(), 1.0f, nullptr,
                             nullptr, nullptr, 0, nullptr, nullptr);
            });
            double err = 0;
            for (int r = 0; r < n; r++) {
                double ref = y0[r];
                for (int i = 0; i < k; i++) ref += (double)__bfloat162float(w[(size_t)r * k + i]) * __bfloat162float(x[i]);
                err = std::max(err, std::fabs(y[r] - ref) / (1.0 + std::fabs(ref)));
            }
            bool ok = err <= 1e-5;
            printf("%s %s n=%d k=%d: max err %.2e\n", ok ? "ok  " : "FAIL", whole ? "gemv_dec_w" : "gemv_dec  ", n, k, err);
            fails += !ok;
        }
    }
    // The RMSNorm input path (x null: x = bf16(RMSNorm(h) (1 + nw)), its weight preloaded into
    // shared memory before the wait), block 0's bf16 copy of it, and row walking (grid 2).
    for (auto [n, k] : {std::pair{37, 2048}, {21, 64}}) {
        std::vector<bf16> w((size_t)n * k), xb(k);
        std::vector<float> h(k), nw(k), y(n, NAN);
        for (auto& v : w) v = __float2bfloat16(uni(-1, 1));
        for (auto& v : h) v = uni(-2, 2);
        for (auto& v : nw) v = uni(-0.3f, 0.3f);
        const float eps = 1e-6f;
        emu_launch({2, 1, 1}, 256, (size_t)k * 8, [&] {
            gemv_dec(w.data(), n, k, nullptr, h.data(), nw.data(), eps, xb.data(), y.data(), 0.0f, nullptr, nullptr,
                     nullptr, 0, nullptr, nullptr);
        });
        double ss = 0;
        for (float v : h) ss += (double)v * v;
        const float inv = 1.0f / std::sqrt((float)(ss / k) + eps);
        double err = 0;
        bool xb_ok = true;
        std::vector<double> x(k);
        for (int i = 0; i < k; i++) {
            x[i] = __bfloat162float(__float2bfloat16(h[i] * inv * (1.0f + nw[i])));
            xb_ok &= std::fabs(__bfloat162float(xb[i]) - x[i]) <= 1e-2 * std::fabs(x[i]) + 1e-6;
        }
        for (int r = 0; r < n; r++) {
            double ref = 0;
            for (int i = 0; i < k; i++) ref += (double)__bfloat162float(w[(size_t)r * k + i]) * x[i];
            const double e = std::fabs(y[r] - ref) / (1.0 + std::fabs(ref));
            if (!(e <= err)) err = e;  // NaN sticks
        }
        bool ok = err <= 1e-4 && xb_ok;
        printf("%s gemv_dec   n=%d k=%d RMSNorm input, 2 blocks walking rows: max err %.2e, bf16 input %s\n",
               ok ? "ok  " : "FAIL", n, k, err, xb_ok ? "stored" : "WRONG");
        fails += !ok;
    }
    // gemv_dec_stream (k = 2048, one stream a block through per-warp rings) must give gemv_dec's
    // y bit for bit, with the RMSNorm input and the bf16 one, odd row counts, any ring depth and
    // early count, and more blocks than some have rows for.
    for (auto [n, blocks, ns, early] : {std::tuple{12352, 4, 2, 2}, {9217, 3, 3, 0}, {37, 5, 2, 1}, {5, 4, 3, 3}}) {
        const int k = 2048;
        std::vector<bf16> w((size_t)n * k), xb(k), xb2(k), xin(k);
        std::vector<float> h(k), nw(k), y0(n);
        for (auto& v : w) v = __float2bfloat16(uni(-1, 1));
        for (auto& v : h) v = uni(-2, 2);
        for (auto& v : nw) v = uni(-0.3f, 0.3f);
        for (auto& v : xin) v = __float2bfloat16(uni(-1, 1));
        for (auto& v : y0) v = uni(-1, 1);
        const float eps = 1e-6f;
        const int launch_at = blocks & 1 ? 3 : 0;  // where the next kernel may start: no effect on y
        bool same = true;
        for (int bulk = 0; bulk < 2; bulk++)  // ring stages by cp.async a lane, or a bulk copy
        for (bool norm : {true, false}) {
            const float beta = norm ? 0.0f : 1.0f;
            std::vector<float> ya = y0, yb = y0;
            emu_launch({(unsigned)((n + 15) / 16), 1, 1}, 256, (size_t)k * 8, [&] {
                gemv_dec(w.data(), n, k, norm ? nullptr : xin.data(), h.data(), nw.data(), eps, xb.data(), ya.data(),
                         beta, nullptr, nullptr, nullptr, 0, nullptr, nullptr);
            });
            emu_launch({(unsigned)blocks, 1, 1}, 256, (size_t)gemv_stream_smem(ns), [&] {
                gemv_dec_stream(w.data(), n, norm ? nullptr : xin.data(), h.data(), nw.data(), eps, xb2.data(),
                                yb.data(), beta, ns, early, launch_at, bulk);
            });
            same &= memcmp(ya.data(), yb.data(), n * 4) == 0 && (!norm || memcmp(xb.data(), xb2.data(), k * 2) == 0);
        }
        printf("%s gemv_dec_stream n=%d, %d blocks, %d stages, %d early, next kernel %d units before the end, "
               "cp.async and bulk stages: %s\n",
               same ? "ok  " : "FAIL", n, blocks, ns, early, launch_at,
               same ? "y (and the bf16 input) bitwise gemv_dec's" : "DIFFERS from gemv_dec");
        fails += !same;
    }
    // gemv_fp8: random e4m3 bytes (every finite value, NaN codes skipped) and per-block scales;
    // the model's k (register-preloaded paths) and others (the generic path); 1, 3 and 16 tokens;
    // beta 0 and 1; the RMSNorm input for one token; nb bf16 tail rows (GDN's b|a: 64 beside
    // the in-projection's 12,288 at the model's shape) in the same launch.
    for (auto [n, k, m, norm, nb] :
         {std::tuple{37, 4096, 1, false, 0}, {300, 2048, 3, false, 5}, {300, 2048, 1, true, 64},
          {256, 2048, 1, true, 33}, {20, 512, 16, false, 17}, {129, 128, 2, false, 0}, {21, 48, 1, true, 3},
          {9, 4096, 16, false, 0}}) {
        const int kb = (k + 127) / 128;
        std::vector<unsigned char> q((size_t)n * k);
        for (auto& b : q) {
            do b = (unsigned char)(rng() & 0xff); while ((b & 0x7f) == 0x7f);
        }
        std::vector<float> sc((size_t)((n + 127) / 128) * kb), h(k), nw(k), y0((size_t)m * n);
        for (auto& v : sc) v = uni(0.5f, 2.0f) / 448.0f;
        for (auto& v : h) v = uni(-2, 2);
        for (auto& v : nw) v = uni(-0.3f, 0.3f);
        for (auto& v : y0) v = uni(-1, 1);
        const int ldy = n + nb;
        y0.resize((size_t)m * ldy);
        for (auto& v : y0) v = uni(-1, 1);
        std::vector<bf16> x((size_t)m * k), wb((size_t)nb * k);
        for (auto& v : x) v = __float2bfloat16(uni(-1, 1));
        for (auto& v : wb) v = __float2bfloat16(uni(-0.1f, 0.1f));
        const float eps = 1e-6f, beta = norm ? 0.0f : 1.0f;
        std::vector<float> y = y0;
        const int rows = 8 * gemv_fp8_rows(k), blocks = (n + rows - 1) / rows + (nb + 15) / 16;
        emu_launch({(unsigned)blocks, 1, 1}, 256, (size_t)gemv_fp8_smem(m, k, norm), [&] {
            gemv_fp8(reinterpret_cast<const uint4*>(q.data()), sc.data(), n, k, norm ? nullptr : x.data(), h.data(),
                     nw.data(), eps, m, y.data(), ldy, beta, nb ? wb.data() : nullptr, nb);
        });
        std::vector<double> xin((size_t)m * k);
        if (norm) {
            double ss = 0;
            for (float v : h) ss += (double)v * v;
            const float inv = 1.0f / std::sqrt((float)(ss / k) + eps);
            for (int i = 0; i < k; i++) xin[i] = __bfloat162float(__float2bfloat16(h[i] * inv * (1.0f + nw[i])));
        } else {
            for (size_t i = 0; i < xin.size(); i++) xin[i] = __bfloat162float(x[i]);
        }
        double err = 0;
        for (int t = 0; t < m; t++)
            for (int r = 0; r < n + nb; r++) {
                double ref = beta * y0[(size_t)t * ldy + r];
                for (int i = 0; i < k; i++)
                    ref += (r < n ? (double)emu_e4m3(q[(size_t)r * k + i]) * sc[(r / 128) * kb + i / 128]
                                  : (double)__bfloat162float(wb[(size_t)(r - n) * k + i])) *
                           xin[(size_t)t * k + i];
                const double e = std::fabs(y[(size_t)t * ldy + r] - ref) / (1.0 + std::fabs(ref));
                if (!(e <= err)) err = e;  // NaN sticks
            }
        const bool ok = err <= 1e-5;
        printf("%s gemv_fp8 n=%d (+%d bf16) k=%d tokens=%d %s input: max err %.2e\n", ok ? "ok  " : "FAIL", n, nb, k,
               m, norm ? "RMSNorm" : "bf16", err);
        fails += !ok;
    }
    // gemv_q4: (n, k, tokens, RMSNorm input, group, bf16 tail rows); beta 1 for bf16 input, 0
    // with the RMSNorm; y rows of n + nb.
    for (auto [n, k, m, norm, group, nb] :
         {std::tuple{48, 2048, 1, true, 64, 64}, {48, 2048, 3, false, 128, 0}, {32, 2048, 16, false, 64, 5},
          {32, 4096, 1, false, 64, 0}, {16, 4096, 9, false, 32, 0}, {80, 512, 1, false, 64, 0},
          {80, 512, 16, false, 128, 33}, {16, 128, 2, false, 32, 4}, {32, 256, 1, true, 128, 0},
          {16, 192, 5, false, 64, 0}}) {
        Q4Host wq = make_q4(n, k, group, rng);
        std::vector<bf16> wb((size_t)nb * k);
        for (auto& v : wb) v = __float2bfloat16(uni(-0.05f, 0.05f));
        const int ny = n + nb;
        std::vector<float> h(k), nw(k), y0((size_t)m * ny);
        for (auto& v : h) v = uni(-2, 2);
        for (auto& v : nw) v = uni(-0.3f, 0.3f);
        for (auto& v : y0) v = uni(-1, 1);
        std::vector<bf16> x((size_t)m * k);
        for (auto& v : x) v = __float2bfloat16(uni(-1, 1));
        const float eps = 1e-6f, beta = norm ? 0.0f : 1.0f;
        std::vector<float> y = y0;
        const int spb = q4_strips(k == 2048 ? 4 : k == 512 ? 1 : k == 4096 ? 8 : 0);
        emu_launch({(unsigned)((n / 16 + spb - 1) / spb + (nb + 15) / 16), 1, 1}, 256,
                   (size_t)q4_smem(m, k, group, norm, 8 * 16 * m * spb), [&] {
            gemv_q4(wq.tiles.data(), wq.sb.data(), group, n, k, norm ? nullptr : x.data(), h.data(), nw.data(), eps, m,
                    y.data(), n + nb, beta, nullptr, nullptr, nullptr, 0, nullptr, nullptr, wb.data(), nb);
        });
        std::vector<double> xin((size_t)m * k);
        if (norm) {
            double ss = 0;
            for (float v : h) ss += (double)v * v;
            const float inv = 1.0f / std::sqrt((float)(ss / k) + eps);
            for (int i = 0; i < k; i++) xin[i] = __bfloat162float(__float2bfloat16(h[i] * inv * (1.0f + nw[i])));
        } else {
            for (size_t i = 0; i < xin.size(); i++) xin[i] = __bfloat162float(x[i]);
        }
        double err = 0;
        for (int t = 0; t < m; t++)
            for (int r = 0; r < ny; r++) {
                double ref = beta * y0[(size_t)t * ny + r];
                for (int i = 0; i < k; i++)
                    ref += (r < n ? wq.w(r, i) : (double)__bfloat162float(wb[(size_t)(r - n) * k + i])) *
                           xin[(size_t)t * k + i];
                const double e = std::fabs(y[(size_t)t * ny + r] - ref) / (1.0 + std::fabs(ref));
                if (!(e <= err)) err = e;  // NaN sticks
            }
        const bool ok = err <= 1e-5;
        printf("%s gemv_q4 n=%d (+%d bf16) k=%d group %d tokens=%d %s input: max err %.2e\n", ok ? "ok  " : "FAIL", n,
               nb, k, group, m, norm ? "RMSNorm" : "bf16", err);
        fails += !ok;
    }
    // gemv_q4's fused argmax (lm_head): the greedy id over rows < limit of its own y, in a
    // second output too, the ticket back at zero; ties to the lowest row: with a positive input,
    // rows 3 and 40 (all codes 15, no bias: equal and the largest) tie where 40 < limit.
    for (auto [n, k, limit] : {std::tuple{96, 2048, 90}, {160, 512, 160}, {48, 128, 17}}) {
        Q4Host wq = make_q4(n, k, 64, rng);
        for (int r : {3, 40})
            for (int c = 0; c < k; c++) {
                wq.q[(size_t)r * k + c] = 15;
                wq.s[r * (k / 64) + c / 64] = 0.02f;
                wq.b[r * (k / 64) + c / 64] = 0.0f;
            }
        pack_q4(wq);
        std::vector<float> h(k), nw(k), y(n, NAN);
        for (auto& v : h) v = uni(0.5f, 2);
        for (auto& v : nw) v = uni(0.0f, 0.3f);
        const int spb = q4_strips(k == 2048 ? 4 : k == 512 ? 1 : k == 4096 ? 8 : 0);
        const int blocks = (n / 16 + spb - 1) / spb;
        std::vector<float> av(blocks);
        std::vector<int> ai(blocks), out(1, -1), out2(1, -1);
        std::vector<unsigned> done(1, 0);
        emu_launch({(unsigned)blocks, 1, 1}, 256, (size_t)q4_smem(1, k, 64, true, 8 * 16 * spb), [&] {
            gemv_q4(wq.tiles.data(), wq.sb.data(), 64, n, k, nullptr, h.data(), nw.data(), 1e-6f, 1, y.data(), n, 0.0f,
                    av.data(), ai.data(), done.data(), limit, out.data(), out2.data(), nullptr, 0);
        });
        int want = 0;
        for (int r = 1; r < limit; r++)
            if (y[r] > y[want]) want = r;
        const bool ok = out[0] == want && out2[0] == want && done[0] == 0 && want == 3 && y[3] == y[40];
        printf("%s gemv_q4 argmax n=%d k=%d limit %d: id %d (host %d), second output %d, ticket %u\n",
               ok ? "ok  " : "FAIL", n, k, limit, out[0], want, out2[0], done[0]);
        fails += !ok;
    }
    // dequant_q4_bf16: every element bf16(scale q + bias) of its own (row, column).
    for (auto [n, k, group] : {std::tuple{32, 2048, 64}, {48, 256, 32}, {16, 512, 128}}) {
        Q4Host wq = make_q4(n, k, group, rng);
        std::vector<bf16> out((size_t)n * k);
        emu_launch({4, 1, 1}, 256, 0, [&] {
            dequant_q4_bf16(wq.tiles.data(), wq.sb.data(), group, (u64)n, k, out.data());
        });
        size_t bad = 0;
        for (int r = 0; r < n; r++)
            for (int c = 0; c < k; c++) {
                const int g = r * (k / group) + c / group;
                const float want = __bfloat162float(__float2bfloat16(wq.s[g] * (float)wq.q[(size_t)r * k + c] + wq.b[g]));
                bad += __bfloat162float(out[(size_t)r * k + c]) != want;
            }
        printf("%s dequant_q4_bf16 [%d, %d] group %d: %zu elements differ\n", bad ? "FAIL" : "ok  ", n, k, group, bad);
        fails += bad != 0;
    }
    return fails ? 1 : 0;
}
