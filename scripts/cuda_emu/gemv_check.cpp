// Runs gemv.cu's decode GEMVs on the CPU emulator (through run.sh): gemv_dec and gemv_dec_w
// (k = 4096 a warp per whole row) against a double-precision y = y0 + W·x with bf16 inputs, at
// the model's inner dimensions and ragged row counts.
#include "kernels_emu.inc"
#include <cstdio>
#include <random>

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
    return fails ? 1 : 0;
}
