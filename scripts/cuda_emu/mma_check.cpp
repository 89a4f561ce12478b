// Checks the emulator's ldmatrix and mma.sync (through run.sh) against plain matrix products,
// so that kernels checked on it follow the PTX fragment layouts: mma with fragments built by
// hand from the layouts documented in common.cuh; A from ldsm_x4 of a row-major tile, B from
// ldsm_x4 of an [n][k] tile and from ldsm_x4_t of a [k][n] tile; the raw ldsm_x4 registers
// with rows at scattered addresses; the accumulator of one mma repacked (pack_bf16x2) as the A
// operand of the next (as flash attention does with P); smem_addr; the tf32 m16n8k8 mma and
// to_tf32, with fragments by hand and through ldsm_x4 of f32 rows; the 3xTF32 and 3xBF16 splits.
#include "kernels_emu.inc"
#include <cstdio>
#include <random>

static std::mt19937_64 rng(5);
static float rnd_bf16() {  // a bf16-representable value in [-2, 2)
    return __bfloat162float(__float2bfloat16(std::uniform_real_distribution<float>(-2, 2)(rng)));
}
static uint16_t bits(float f) { return __float2bfloat16(f).v; }
static unsigned pack2(float lo, float hi) { return (unsigned)bits(lo) | (unsigned)bits(hi) << 16; }
static int fails = 0;
static void report(const char* what, double err, double tol) {
    bool ok = err <= tol;
    fails += !ok;
    printf("%s %s: max err %.2e\n", ok ? "ok  " : "FAIL", what, err);
}

// D[16][8] = A[16][16] B[16][8] + C, reference in double.
static double ref_err(const float (*A)[16], const float (*B)[8], const float (*C)[8], const float (*D)[8]) {
    double e = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) {
            double s = C[r][n];
            for (int k = 0; k < 16; k++) s += (double)A[r][k] * B[k][n];
            e = std::max(e, std::fabs(s - D[r][n]) / (1 + std::fabs(s)));
        }
    return e;
}

// The largest |A B - D| of a 16 x 8 product over K, relative to the row's sum |a b| (the split
// checks: a split is as exact as its parts, whatever the cancellation).
template <int K>
static double split_err(const float (&A)[16][K], const float (&B)[K][8], const float (&D)[16][8]) {
    double e = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) {
            double s = 0, a = 0;
            for (int k = 0; k < K; k++) s += (double)A[r][k] * B[k][n], a += std::fabs((double)A[r][k] * B[k][n]);
            e = std::max(e, std::fabs(s - D[r][n]) / a);
        }
    return e;
}

int main() {
    float A[16][16], B[16][16], C[16][8], D[16][8];
    for (auto& r : A) for (auto& x : r) x = rnd_bf16();
    for (auto& r : B) for (auto& x : r) x = rnd_bf16();
    for (auto& r : C) for (auto& x : r) x = std::uniform_real_distribution<float>(-4, 4)(rng);

    // 1. Fragments by hand from the documented layouts.
    emu_launch({1, 1, 1}, 32, 0, [&] {
        int l = threadIdx.x, g = l / 4, c = 2 * (l % 4);
        unsigned a[4] = {pack2(A[g][c], A[g][c + 1]), pack2(A[g + 8][c], A[g + 8][c + 1]),
                         pack2(A[g][c + 8], A[g][c + 9]), pack2(A[g + 8][c + 8], A[g + 8][c + 9])};
        unsigned b0 = pack2(B[c][g], B[c + 1][g]), b1 = pack2(B[c + 8][g], B[c + 9][g]);
        float d[4] = {C[g][c], C[g][c + 1], C[g + 8][c], C[g + 8][c + 1]};
        mma_bf16_16816(d, a, b0, b1);
        D[g][c] = d[0], D[g][c + 1] = d[1], D[g + 8][c] = d[2], D[g + 8][c + 1] = d[3];
    });
    float B8[16][8];
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++) B8[k][n] = B[k][n];
    report("mma m16n8k16, fragments from the documented layout", ref_err(A, B8, C, D), 1e-6);

    // 2. Through ldmatrix: A row-major [16][16+8 pad]; B as [n][k] (non-trans) and [k][n]
    // (trans); two n8 tiles (n 0-7, 8-15), D = A B with C = 0.
    const int LD = 24;
    for (int trans = 0; trans < 2; trans++) {
        float out[16][16];
        emu_launch({1, 1, 1}, 32, 3 * 16 * LD * 2, [&] {
            bf16* sa = reinterpret_cast<bf16*>(emu_dyn_smem());
            bf16* sb = sa + 16 * LD;
            int l = threadIdx.x;
            for (int i = l; i < 256; i += 32) {
                int r = i / 16, k = i % 16;
                sa[r * LD + k] = __float2bfloat16(A[r][k]);
                // non-trans: row n holds B[.][n]; trans: row k holds B[k][.]
                sb[r * LD + k] = __float2bfloat16(trans ? B[r][k] : B[k][r]);
            }
            __syncthreads();
            unsigned a[4], b[4];
            ldsm_x4(a, sa + (l & 15) * LD + (l >> 4) * 8);
            if (!trans) ldsm_x4(b, sb + ((l & 7) + ((l >> 4) << 3)) * LD + ((l >> 3) & 1) * 8);
            else ldsm_x4_t(b, sb + (((l >> 3) & 1) * 8 + (l & 7)) * LD + (l >> 4) * 8);
            int g = l / 4, c = 2 * (l % 4);
            for (int j = 0; j < 2; j++) {
                float d[4] = {0, 0, 0, 0};
                mma_bf16_16816(d, a, b[2 * j], b[2 * j + 1]);
                out[g][8 * j + c] = d[0], out[g][8 * j + c + 1] = d[1];
                out[g + 8][8 * j + c] = d[2], out[g + 8][8 * j + c + 1] = d[3];
            }
        });
        double e = 0;
        for (int r = 0; r < 16; r++)
            for (int n = 0; n < 16; n++) {
                double s = 0;
                for (int k = 0; k < 16; k++) s += (double)A[r][k] * B[k][n];
                e = std::max(e, std::fabs(s - out[r][n]) / (1 + std::fabs(s)));
            }
        report(trans ? "ldsm_x4 A + ldsm_x4_t B [k][n] -> mma" : "ldsm_x4 A + ldsm_x4 B [n][k] -> mma", e, 1e-6);
    }

    // 3. Raw ldsm registers, each lane's row at a scattered address: lane l of matrix i gets
    // (row l/4, cols 2(l%4), +1), .trans (rows 2(l%4), +1, col l/4).
    for (int trans = 0; trans < 2; trans++) {
        int bad = 0;
        constexpr int ROWS = 64;
        emu_launch({1, 1, 1}, 32, ROWS * 8 * 2, [&] {
            uint16_t* s = reinterpret_cast<uint16_t*>(emu_dyn_smem());
            int l = threadIdx.x;
            for (int i = l; i < ROWS * 8; i += 32) s[i] = (uint16_t)(i * 7 + 3);
            __syncthreads();
            auto row_of = [&](int lane) -> int { return (lane * 37 + 11) % ROWS; };  // lane -> smem row
            unsigned r[4];
            if (trans) ldsm_x4_t(r, s + row_of(l) * 8);
            else ldsm_x4(r, s + row_of(l) * 8);
            for (int i = 0; i < 4; i++) {
                auto at = [&](int row, int col) { return (unsigned)s[row_of(8 * i + row) * 8 + col]; };
                unsigned want = trans ? at(2 * (l % 4), l / 4) | at(2 * (l % 4) + 1, l / 4) << 16
                                      : at(l / 4, 2 * (l % 4)) | at(l / 4, 2 * (l % 4) + 1) << 16;
                if (r[i] != want) bad++;
            }
        });
        report(trans ? "ldsm_x4_t registers" : "ldsm_x4 registers", bad, 0);
    }

    // 4. P = A B (16x16, f32 accumulators of two n8 tiles) packed to bf16 as an A fragment,
    // then O = bf16(P) V for V [16][8] loaded with ldsm_x4_t ([k][n], k = P's columns).
    float V[16][8], P[16][16], O[16][8];
    for (auto& r : V) for (auto& x : r) x = rnd_bf16();
    emu_launch({1, 1, 1}, 32, 3 * 16 * LD * 2, [&] {
        int l = threadIdx.x, g = l / 4, c = 2 * (l % 4);
        bf16* sv = reinterpret_cast<bf16*>(emu_dyn_smem());
        for (int i = l; i < 128; i += 32) sv[(i / 8) * LD + i % 8] = __float2bfloat16(V[i / 8][i % 8]);
        __syncthreads();
        unsigned a[4] = {pack2(A[g][c], A[g][c + 1]), pack2(A[g + 8][c], A[g + 8][c + 1]),
                         pack2(A[g][c + 8], A[g][c + 9]), pack2(A[g + 8][c + 8], A[g + 8][c + 9])};
        float p[2][4] = {};
        for (int j = 0; j < 2; j++)
            mma_bf16_16816(p[j], a, pack2(B[c][8 * j + g], B[c + 1][8 * j + g]), pack2(B[c + 8][8 * j + g], B[c + 9][8 * j + g]));
        unsigned pa[4] = {pack_bf16x2(p[0][0], p[0][1]), pack_bf16x2(p[0][2], p[0][3]), pack_bf16x2(p[1][0], p[1][1]),
                          pack_bf16x2(p[1][2], p[1][3])};
        // x4.trans over V's two k halves (matrices 0, 1) and again (2, 3: unused duplicates)
        unsigned v[4];
        ldsm_x4_t(v, sv + (((l >> 3) & 1) * 8 + (l & 7)) * LD);
        float o[4] = {0, 0, 0, 0};
        mma_bf16_16816(o, pa, v[0], v[1]);
        O[g][c] = o[0], O[g][c + 1] = o[1], O[g + 8][c] = o[2], O[g + 8][c + 1] = o[3];
        for (int j = 0; j < 2; j++) {
            P[g][8 * j + c] = p[j][0], P[g][8 * j + c + 1] = p[j][1];
            P[g + 8][8 * j + c] = p[j][2], P[g + 8][8 * j + c + 1] = p[j][3];
        }
    });
    double e = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) {
            double s = 0;
            for (int k = 0; k < 16; k++) s += (double)__bfloat162float(__float2bfloat16(P[r][k])) * V[k][n];
            e = std::max(e, std::fabs(s - O[r][n]) / (1 + std::fabs(s)));
        }
    double ep = 0;
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            double s = 0;
            for (int k = 0; k < 16; k++) s += (double)A[r][k] * B[k][n];
            ep = std::max(ep, std::fabs(s - P[r][n]) / (1 + std::fabs(s)));
        }
    report("accumulator -> pack_bf16x2 -> A fragment -> mma (P V)", std::max(e, ep), 1e-6);

    // 5. smem_addr: offsets into the dynamic shared memory.
    int bad = 0;
    emu_launch({1, 1, 1}, 32, 1024, [&] {
        char* s = reinterpret_cast<char*>(emu_dyn_smem());
        unsigned a = smem_addr(s + 16 * threadIdx.x);
        if (a != 16 * threadIdx.x || emu_smem_ptr(a) != s + 16 * threadIdx.x) bad++;
    });
    report("smem_addr", bad, 0);
    // 6. tf32 m16n8k8: to_tf32 rounding; fragments by hand from the documented layout; A from
    // ldsm_x4 of f32 rows [16][8], B from ldsm_x4 of f32 [n][k] rows (two n8 tiles, k 0..7).
    {
        int badr = 0;
        for (float x : {1.0f, -1.0f, 1.00048828125f /* 1 + 2^-11: tie, away */, 3.14159265f, -2.7182818f, 1e-30f}) {
            float r; unsigned u = to_tf32(x); memcpy(&r, &u, 4);
            double ulp = std::ldexp(1.0, std::ilogb(x) - 10);
            if ((u & 0x1fffu) || std::fabs(r - x) > 0.5 * ulp || (x == 1.00048828125f && r != 1.0009765625f)) badr++;
        }
        report("to_tf32 rounding", badr, 0);
        auto tf = [](float x) { unsigned u = to_tf32(x); float f; memcpy(&f, &u, 4); return f; };
        std::uniform_real_distribution<float> U(-2, 2);
        float TA[16][8], TB[8][16], TC[16][8], TD[16][16], TE[16][16];
        for (auto& r : TA) for (auto& x : r) x = tf(U(rng));
        for (auto& r : TB) for (auto& x : r) x = tf(U(rng));
        for (auto& r : TC) for (auto& x : r) x = U(rng);
        emu_launch({1, 1, 1}, 32, 2 * 16 * 12 * 4, [&] {
            int l = threadIdx.x, g = l / 4, c = l % 4;
            auto bitsf = [](float f) { unsigned u; memcpy(&u, &f, 4); return u; };
            unsigned a[4] = {bitsf(TA[g][c]), bitsf(TA[g + 8][c]), bitsf(TA[g][c + 4]), bitsf(TA[g + 8][c + 4])};
            float d[4] = {TC[g][2 * c], TC[g][2 * c + 1], TC[g + 8][2 * c], TC[g + 8][2 * c + 1]};
            mma_tf32_1688(d, a, bitsf(TB[c][g]), bitsf(TB[c + 4][g]));
            TD[g][2 * c] = d[0], TD[g][2 * c + 1] = d[1], TD[g + 8][2 * c] = d[2], TD[g + 8][2 * c + 1] = d[3];
            // through ldmatrix: sa [16][12] rows of A, sb [16][12] rows n of B^T
            float* sa = emu_dyn_smem();
            float* sb = sa + 16 * 12;
            for (int i = l; i < 128; i += 32) { sa[(i / 8) * 12 + i % 8] = TA[i / 8][i % 8]; }
            for (int i = l; i < 128; i += 32) { sb[(i / 8) * 12 + i % 8] = TB[i % 8][i / 8]; }
            __syncthreads();
            unsigned fa[4], fb[4];
            ldsm_x4(fa, sa + (l & 15) * 12 + (l >> 4) * 4);
            // matrices: (n 0-7, k 0-3), (n 0-7, k 4-7), (n 8-15, k 0-3), (n 8-15, k 4-7)
            ldsm_x4(fb, sb + ((l & 7) + ((l >> 4) << 3)) * 12 + ((l >> 3) & 1) * 4);
            for (int j = 0; j < 2; j++) {
                float e[4] = {0, 0, 0, 0};
                mma_tf32_1688(e, fa, fb[2 * j], fb[2 * j + 1]);
                TE[g][8 * j + 2 * c] = e[0], TE[g][8 * j + 2 * c + 1] = e[1];
                TE[g + 8][8 * j + 2 * c] = e[2], TE[g + 8][8 * j + 2 * c + 1] = e[3];
            }
        });
        double e1 = 0, e2 = 0;
        for (int r = 0; r < 16; r++)
            for (int n = 0; n < 16; n++) {
                double s = 0;
                for (int k = 0; k < 8; k++) s += (double)TA[r][k] * TB[k][n];
                e2 = std::max(e2, std::fabs(s - TE[r][n]) / (1 + std::fabs(s)));
                if (n < 8) e1 = std::max(e1, std::fabs(s + TC[r][n] - TD[r][n]) / (1 + std::fabs(s + TC[r][n])));
            }
        report("mma m16n8k8 tf32, fragments from the documented layout", e1, 1e-6);
        report("ldsm_x4 f32 A + ldsm_x4 f32 B [n][k] -> mma tf32", e2, 1e-6);
        // 3xTF32 (split_tf32, three mma) on f32 values that tf32 does not hold: f32-level,
        // where a single tf32 mma of the same values is off by ~2^-11.
        float FA[16][8], FB[8][8], F1[16][8], F3[16][8];
        for (auto& r : FA) for (auto& x : r) x = U(rng);
        for (auto& r : FB) for (auto& x : r) x = U(rng);
        emu_launch({1, 1, 1}, 32, 0, [&] {
            int l = threadIdx.x, g = l / 4, c = l % 4;
            const float av[4] = {FA[g][c], FA[g + 8][c], FA[g][c + 4], FA[g + 8][c + 4]};
            const float bv[2] = {FB[c][g], FB[c + 4][g]};
            unsigned ah[4], al[4], bh[2], bl[2];
            for (int e = 0; e < 4; e++) split_tf32(av[e], ah[e], al[e]);
            for (int e = 0; e < 2; e++) split_tf32(bv[e], bh[e], bl[e]);
            float d1[4] = {0, 0, 0, 0}, d3[4] = {0, 0, 0, 0};
            mma_tf32_1688(d1, ah, bh[0], bh[1]);
            mma_tf32_1688(d3, al, bh[0], bh[1]);
            mma_tf32_1688(d3, ah, bl[0], bl[1]);
            mma_tf32_1688(d3, ah, bh[0], bh[1]);
            F1[g][2 * c] = d1[0], F1[g][2 * c + 1] = d1[1], F1[g + 8][2 * c] = d1[2], F1[g + 8][2 * c + 1] = d1[3];
            F3[g][2 * c] = d3[0], F3[g][2 * c + 1] = d3[1], F3[g + 8][2 * c] = d3[2], F3[g + 8][2 * c + 1] = d3[3];
        });
        report("3xTF32 (split_tf32) mma vs f64, relative to sum |a b|", split_err(FA, FB, F3), 1e-6);
        report("(1xTF32 on the same values is coarse: error > 1e-5)", split_err(FA, FB, F1) > 1e-5 ? 0 : 1, 0);
        // 3xBF16 (split_bf16x2, three bf16 mma: the GDN state pass's form) on the same kind of
        // values: ~1e-5-level (hi + lo hold ~16 bits), where one bf16 mma is off by ~2^-8.
        float GA[16][16], GB[16][8], G1[16][8], G3[16][8];
        for (auto& r : GA) for (auto& x : r) x = U(rng);
        for (auto& r : GB) for (auto& x : r) x = U(rng);
        emu_launch({1, 1, 1}, 32, 0, [&] {
            int l = threadIdx.x, g = l / 4, c = l % 4;
            unsigned ah[4], al[4], bh[2], bl[2];
            for (int e = 0; e < 4; e++) {
                const int r = g + 8 * (e & 1), k = 2 * c + 8 * (e >> 1);
                split_bf16x2(GA[r][k], GA[r][k + 1], ah[e], al[e]);
            }
            for (int e = 0; e < 2; e++) split_bf16x2(GB[2 * c + 8 * e][g], GB[2 * c + 8 * e + 1][g], bh[e], bl[e]);
            float d1[4] = {0, 0, 0, 0}, d3[4] = {0, 0, 0, 0};
            mma_bf16_16816(d1, ah, bh[0], bh[1]);
            mma_bf16_16816(d3, al, bh[0], bh[1]);
            mma_bf16_16816(d3, ah, bl[0], bl[1]);
            mma_bf16_16816(d3, ah, bh[0], bh[1]);
            G1[g][2 * c] = d1[0], G1[g][2 * c + 1] = d1[1], G1[g + 8][2 * c] = d1[2], G1[g + 8][2 * c + 1] = d1[3];
            G3[g][2 * c] = d3[0], G3[g][2 * c + 1] = d3[1], G3[g + 8][2 * c] = d3[2], G3[g + 8][2 * c + 1] = d3[3];
        });
        report("3xBF16 (split_bf16x2) mma vs f64, relative to sum |a b|", split_err(GA, GB, G3), 3e-5);
        report("(1xBF16 on the same values is coarse: error > 1e-3)", split_err(GA, GB, G1) > 1e-3 ? 0 : 1, 0);
    }
    if (fails) printf("%d check(s) FAILED\n", fails);
    return fails ? 1 : 0;
}
