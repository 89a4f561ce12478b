// Runs moe_route.cu's, moe_gemm.cu's and moe_decode.cu's kernels on the CPU emulator (through
// run.sh): the routing top-k (moe_route) against a plain top-k; the few-row path's one-launch
// routing (moe_route_small); moe_combine; the decode MoE block (router, gate/up, down) against a
// double reference; then the prefill MoE kernels: moe_plan and moe_scatter on skewed random
// routing (one expert hot, one unused), the few-row moe_gemv_sorted (SwiGLU-fused gate/up and
// plain down over the sorted rows), the grouped 4-bit and FP8 kernels (moe_grouped(_swiglu)_q4,
// _fp8) over a plan of tiles, then moe_gemm6: SwiGLU-fused gate/up (bf16 act), plain
// gate/up (f32) and plain down (f32, no gather), each against a double-precision reference over
// every sorted row, and the bf16 down; outputs start as NaN so that a missed row or column shows.
#include "kernels_emu.inc"
#include "q4_host.h"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

static std::mt19937_64 rng(11);
static float uni(float a, float b) { return std::uniform_real_distribution<float>(a, b)(rng); }
static std::vector<bf16> rand_bf16(size_t n, float scale) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(uni(-scale, scale));
    return v;
}
static double f(bf16 b) { return __bfloat162float(b); }

struct Shape { const char* name; int t, d, inter, e, k; };

// The plan's tiles cover every expert's rows in order, tile_m at a time.
static bool plan_ok(const std::vector<int>& counts, int tile_m, const std::vector<int>& te, const std::vector<int>& tr,
                    const std::vector<int>& tn, int nt) {
    int i = 0, off = 0;
    for (int x = 0; x < (int)counts.size(); x++) {
        for (int r = 0; r < counts[x]; r += tile_m, i++)
            if (i >= nt || te[i] != x || tr[i] != off + r || tn[i] != std::min(tile_m, counts[x] - r)) return false;
        off += counts[x];
    }
    return i == nt;
}

static int fails = 0;

static void run(const Shape& s, bool deferred) {
    g_cp_deferred = deferred;
    const int t = s.t, d = s.d, I = s.inter, E = s.e, K = s.k, rows = t * K;
    // Skewed routing: expert 0 hot, expert E-1 never chosen.
    std::vector<double> wt(E);
    for (int x = 0; x < E; x++) wt[x] = x == 0 ? 12.0 * E : x == E - 1 ? 0.0 : 1.0 + x % 3;
    std::vector<int> topk(rows), counts(E, 0);
    for (int tok = 0; tok < t; tok++) {
        std::vector<double> w = wt;
        for (int j = 0; j < K; j++) {
            int x = std::discrete_distribution<int>(w.begin(), w.end())(rng);
            w[x] = 0;
            topk[tok * K + j] = x;
            counts[x]++;
        }
    }
    auto xb = rand_bf16((size_t)t * d, 1.0f);
    auto wgu = rand_bf16((size_t)E * 2 * I * d, 1.0f / std::sqrt((float)d));
    auto wdn = rand_bf16((size_t)E * d * I, 1.0f / std::sqrt((float)I));
    auto act_in = rand_bf16((size_t)rows * I, 1.0f);
    const int max_tiles = rows + E;  // the workspace's bound (smallest tile: one row)
    std::vector<int> offsets(E + 1), cursor(E), te(max_tiles), tr(max_tiles), tn(max_tiles), nt(1);
    std::vector<int> sorted_token(rows, -1), slot_row(rows, -1);
    auto plan = [&](int tile_m) {
        emu_launch({1, 1, 1}, (unsigned)((E + 31) / 32 * 32), 0, [&] {
            moe_plan(counts.data(), E, tile_m, offsets.data(), cursor.data(), te.data(), tr.data(), tn.data(), nt.data());
        });
        bool ok = plan_ok(counts, tile_m, te, tr, tn, nt[0]) && nt[0] <= (rows + tile_m - 1) / tile_m + E;
        if (!ok) { printf("FAIL %s: moe_plan tile_m %d\n", s.name, tile_m); fails++; }
    };
    plan(64);
    emu_launch({(unsigned)((rows + 255) / 256), 1, 1}, 256, 0, [&] {
        moe_scatter(topk.data(), rows, K, cursor.data(), sorted_token.data(), slot_row.data());
    });
    // scatter: a permutation that puts each (token, slot) in its expert's range
    std::vector<int> expert_of(rows, -1);
    bool perm = true;
    for (int x = 0; x < E; x++)
        for (int r = offsets[x]; r < offsets[x + 1]; r++) expert_of[r] = x;
    for (int i = 0; i < rows; i++) {
        int r = slot_row[i];
        perm &= r >= 0 && r < rows && sorted_token[r] == i / K && expert_of[r] == topk[i];
    }
    if (!perm) { printf("FAIL %s: moe_scatter\n", s.name); fails++; }

    // references in double over the sorted rows
    std::vector<double> gu_ref((size_t)rows * 2 * I), act_ref((size_t)rows * I), y_ref((size_t)rows * d);
    for (int r = 0; r < rows; r++) {
        int x = expert_of[r];
        const bf16* a = &xb[(size_t)sorted_token[r] * d];
        for (int n = 0; n < 2 * I; n++) {
            const bf16* w = &wgu[((size_t)x * 2 * I + n) * d];
            double acc = 0;
            for (int k = 0; k < d; k++) acc += f(a[k]) * f(w[k]);
            gu_ref[(size_t)r * 2 * I + n] = acc;
        }
        for (int n = 0; n < I; n++) {
            double g = gu_ref[(size_t)r * 2 * I + n], u = gu_ref[(size_t)r * 2 * I + I + n];
            act_ref[(size_t)r * I + n] = g / (1 + std::exp(-g)) * u;
        }
        for (int n = 0; n < d; n++) {
            const bf16* w = &wdn[((size_t)x * d + n) * I];
            double acc = 0;
            for (int k = 0; k < I; k++) acc += f(act_in[(size_t)r * I + k]) * f(w[k]);
            y_ref[(size_t)r * d + n] = acc;
        }
    }
    auto scale_of = [](const std::vector<double>& v) { double m = 0; for (double x : v) m = std::max(m, std::fabs(x)); return m; };
    // f32 outputs: max |err| / max |ref|; bf16 act: each element within its rounding
    // (2^-8 relative) plus 1e-5 of the scale.
    auto f32_err = [&](const std::vector<float>& got, const std::vector<double>& ref) {
        double m = 0, sc = scale_of(ref);
        for (size_t i = 0; i < got.size(); i++) m = std::isnan(got[i]) ? INFINITY : std::max(m, std::fabs(got[i] - ref[i]) / sc);
        return m;
    };
    auto act_err = [&](const std::vector<bf16>& got, const std::vector<double>& ref) {
        double m = 0, sc = scale_of(ref);
        for (size_t i = 0; i < got.size(); i++) {
            double g = f(got[i]);
            double e = std::isnan(g) ? INFINITY : std::fabs(g - ref[i]) / (std::fabs(ref[i]) * 0.00390625 + 1e-5 * sc);
            m = std::max(m, e);
        }
        return m;
    };
    // moe_gemv_sorted (the few-row path) over the sorted rows, a plan of one-row tiles giving
    // each row's expert: SwiGLU-fused gate/up (bf16 act, gathered input rows) and the plain down
    // (f32), into NaN-filled outputs.
    plan(1);
    {
        using KS = void (*)(const bf16*, const int*, const bf16*, void*, const int*, int, int);
        auto launch_s = [&](KS kern, bool swiglu, const bf16* a, const int* gather, const bf16* w, void* out, int nf,
                            int kdim) {
            const int feat = gemv_sorted_features(swiglu, kdim);
            emu_launch({(unsigned)rows, (unsigned)((nf + feat - 1) / feat), 1}, 256, (size_t)kdim * 2,
                       [&] { kern(a, gather, w, out, te.data(), nf, kdim); });
        };
        std::vector<bf16> act_s((size_t)rows * I, bf16{0x7fff});
        std::vector<float> y_s((size_t)rows * d, NAN);
        launch_s(moe_gemv_sorted_swiglu, true, xb.data(), sorted_token.data(), wgu.data(), act_s.data(), I, d);
        launch_s(moe_gemv_sorted, false, act_in.data(), nullptr, wdn.data(), y_s.data(), d, I);
        const double ea = act_err(act_s, act_ref), ey = f32_err(y_s, y_ref);
        const bool ok = ea <= 1.0 && ey <= 1e-6;
        fails += !ok;
        printf("%s %-22s d=%d i=%d E=%d rows=%d: moe_gemv_sorted swiglu act %.2f of its bound, down %.1e\n",
               ok ? "ok  " : "FAIL", s.name, d, I, E, rows, ea, ey);
    }
    // moe_gemm6 (wgmma, emulated through its descriptors; warp-specialised, persistent) on the
    // plan's 128-row tiles: its three products (gate/up + SwiGLU, plain gate/up, down) into fresh
    // NaN-filled outputs against the double references; a grid of 3 blocks walks all (tile, column
    // block) items, so the stages' mbarrier phases run on across tiles.
    plan(128);
    using KG6 = void (*)(const bf16*, const int*, const bf16*, void*, const int*, const int*, const int*, const int*,
                         int, int, int, int*);
    int claim = 0;  // the blocks' item counter: zero before a launch, and after it
    auto launch6 = [&](KG6 k, bool swiglu, const bf16* a, const int* gather, const bf16* w, void* out, int ndim,
                       int kdim) {
        const int cols = swiglu ? ndim / 2 : ndim, nblk = (cols + (swiglu ? 127 : 255)) / (swiglu ? 128 : 256);
        emu_launch({3, 1, 1}, 384, 4 * 384 * 128 + 64 + 48, [&] {
            k(a, gather, w, out, te.data(), tr.data(), tn.data(), nt.data(), ndim, kdim, nblk, &claim);
        });
        if (claim != 0) {
            printf("FAIL %-22s moe_gemm6 left its item counter at %d\n", s.name, claim);
            fails++;
            claim = 0;
        }
    };
    std::vector<bf16> act6((size_t)rows * I, bf16{0x7fff});
    std::vector<float> gu6((size_t)rows * 2 * I, NAN), y6((size_t)rows * d, NAN);
    launch6(moe_gemm6_swiglu_m128, true, xb.data(), sorted_token.data(), wgu.data(), act6.data(), 2 * I, d);
    launch6(moe_gemm6_m128, false, xb.data(), sorted_token.data(), wgu.data(), gu6.data(), 2 * I, d);
    launch6(moe_gemm6_m128, false, act_in.data(), nullptr, wdn.data(), y6.data(), d, I);
    const double ea = act_err(act6, act_ref), eg = f32_err(gu6, gu_ref), ey = f32_err(y6, y_ref);
    const bool ok = ea <= 1.0 && eg <= 1e-6 && ey <= 1e-6;
    fails += !ok;
    // tiles of <= 64 rows: the second consumer warpgroup only releases the stages
    int half = 0;
    for (int i = 0; i < nt[0]; i++) half += tn[i] <= 64;
    printf("%s %-22s d=%d i=%d E=%d rows=%d tiles=%d cp.async %-8s: v6 m128 swiglu act %.2f of its bound, gate_up "
           "%.1e, down %.1e (%d tiles <= 64 rows)\n",
           ok ? "ok  " : "FAIL", s.name, d, I, E, rows, nt[0], deferred ? "deferred" : "eager", ea, eg, ey, half);
    // moe_gemm6_m128_bf16 (the down product's y as bf16, quad-transposed 16-byte stores): the bits
    // of moe_gemm6's f32 y rounded to bf16, every row and column written.
    std::vector<bf16> y16((size_t)rows * d, bf16{0x7fff});
    launch6(moe_gemm6_m128_bf16, false, act_in.data(), nullptr, wdn.data(), y16.data(), d, I);
    bool same16 = d % 8 == 0;
    for (size_t i = 0; i < y16.size() && same16; i++) same16 = y16[i].v == __float2bfloat16(y6[i]).v;
    fails += !same16;
    printf("%s %-22s v6 m128 bf16 y: %s moe_gemm6's y rounded to bf16\n", same16 ? "ok  " : "FAIL", s.name,
           same16 ? "bitwise equal to" : "DIFFERS from");
}

// One token's routing against a plain top-k of its logits l [e] (the k largest, first index on
// ties; weights exp(l - max) renormalised over the k): ids equal into ids_ok, the weights'
// largest error into worst (a NaN sticks), each chosen id counted into counts (if given).
static void check_topk(const float* l, int e, int k, const int* ids, const float* w, bool& ids_ok, double& worst,
                       std::vector<int>* counts) {
    std::vector<int> order(e);
    for (int i = 0; i < e; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
    double sum = 0;
    for (int j = 0; j < k; j++) sum += std::exp((double)l[order[j]] - l[order[0]]);
    for (int j = 0; j < k; j++) {
        ids_ok &= ids[j] == order[j];
        const double dv = std::fabs(w[j] - std::exp((double)l[order[j]] - l[order[0]]) / sum);
        if (!(dv <= worst)) worst = dv;
        if (counts) (*counts)[order[j]]++;
    }
}

// moe_route_small (the few-row path's routing in one launch): its logits against a double
// product of the same bf16 inputs; ids and weights against a plain top-k of its own logits (so
// that near-ties decided by rounding do not count); shared gates against a double reference;
// the sorted order: row_expert ascending with each expert's count, sorted_token / slot_row a
// permutation that puts each (token, slot) in its expert's run; the ticket back at zero. Over
// several groups of staged tokens, and router rows past the last block's 8 (e % 8 != 0).
static void route_small_check(int t, int e, int k, int d) {
    auto x = rand_bf16((size_t)t * d, 1.0f);
    auto wr = rand_bf16((size_t)e * d, 1.0f / std::sqrt((float)d));
    std::vector<float> w_sg(d), logits((size_t)t * e, NAN), w((size_t)t * k, NAN), sgate(t, NAN);
    for (auto& v : w_sg) v = uni(-0.5f, 0.5f);
    const int rows = t * k;
    std::vector<int> ids(rows, -1), row_expert(rows, -1), sorted_token(rows, -1), slot_row(rows, -1);
    unsigned ticket = 0;
    emu_launch({(unsigned)((e + 8) / 8), 1, 1}, 256, (size_t)moe_route_small_smem(d, e), [&] {
        moe_route_small(x.data(), t, d, wr.data(), e, k, w_sg.data(), logits.data(), ids.data(), w.data(),
                        sgate.data(), row_expert.data(), sorted_token.data(), slot_row.data(), &ticket);
    });
    double worst_l = 0, worst_w = 0, worst_g = 0, scale = 0;
    bool ids_ok = true;
    std::vector<int> counts(e, 0);
    for (int tok = 0; tok < t; tok++) {
        const float* l = &logits[(size_t)tok * e];
        for (int r = 0; r < e; r++) {
            double dot = 0;
            for (int c = 0; c < d; c++) dot += f(x[(size_t)tok * d + c]) * f(wr[(size_t)r * d + c]);
            scale = std::max(scale, std::fabs(dot));
            const double dl = std::fabs(l[r] - dot);
            if (!(dl <= worst_l)) worst_l = dl;
        }
        check_topk(l, e, k, &ids[(size_t)tok * k], &w[(size_t)tok * k], ids_ok, worst_w, &counts);
        double dot = 0;
        for (int i = 0; i < d; i++) dot += f(x[(size_t)tok * d + i]) * w_sg[i];
        const double dg = std::fabs(sgate[tok] - 1.0 / (1.0 + std::exp(-dot)));
        if (!(dg <= worst_g)) worst_g = dg;
    }
    bool order_ok = true;
    for (int r = 0, x1 = 0; x1 < e; x1++)
        for (int j = 0; j < counts[x1]; j++, r++) order_ok &= row_expert[r] == x1;
    std::vector<bool> seen(rows, false);
    for (int i = 0; i < rows; i++) {
        const int r = slot_row[i];
        order_ok &= r >= 0 && r < rows && !seen[r] && sorted_token[r] == i / k && row_expert[r] == ids[i];
        if (r >= 0 && r < rows) seen[r] = true;
    }
    const bool ok = worst_l <= 1e-5 * scale && ids_ok && worst_w < 1e-6 && worst_g < 1e-6 && order_ok && ticket == 0;
    printf("moe_route_small t %d e %d k %d d %d: logits %.1e of %.1e, ids %s, weights %.1e, gates %.1e, sorted "
           "order %s, ticket %u %s\n",
           t, e, k, d, worst_l, scale, ids_ok ? "equal" : "DIFFER", worst_w, worst_g, order_ok ? "right" : "WRONG",
           ticket, ok ? "ok" : "FAILED");
    fails += !ok;
}

// moe_route (route_topk_warp, a warp per token) against a plain top-k: the k largest logits,
// first index on ties (rows with repeated values), weights exp(l - max) renormalised over the
// k; widths below, at and above the 256 the sorted-lanes path handles. Also its shared-expert
// gates sigmoid(x . w_sg) against a double reference, at a width d of whole 8-element loads
// (d % 8 == 0) or not.
static void route_check(int t, int e, int k, int d) {
    std::vector<float> logits((size_t)t * e);
    for (int tok = 0; tok < t; tok++)
        for (int i = 0; i < e; i++)  // every fourth row heavy with ties
            logits[(size_t)tok * e + i] = tok % 4 == 0 ? (float)(int)uni(-3, 3) : uni(-4, 4);
    std::vector<int> ids((size_t)t * k, -1), counts(e, 0);
    std::vector<float> w((size_t)t * k, NAN), sgate(t, NAN), w_sg(d);
    auto x = rand_bf16((size_t)t * d, 1.0f);
    for (auto& v : w_sg) v = uni(-0.5f, 0.5f);
    emu_launch({(unsigned)((t + ROUTE_WARPS - 1) / ROUTE_WARPS), 1, 1}, 32 * ROUTE_WARPS, (size_t)ROUTE_WARPS * e * 4, [&] {
        moe_route(logits.data(), e, k, ids.data(), w.data(), counts.data(), x.data(), w_sg.data(), sgate.data(), d, t);
    });
    double worst = 0, worst_g = 0;
    bool ok = true;
    for (int tok = 0; tok < t && ok; tok++) {
        const float* l = &logits[(size_t)tok * e];
        check_topk(l, e, k, &ids[(size_t)tok * k], &w[(size_t)tok * k], ok, worst, nullptr);
        double dot = 0;
        for (int i = 0; i < d; i++) dot += f(x[(size_t)tok * d + i]) * w_sg[i];
        const double dg = std::fabs(sgate[tok] - 1.0 / (1.0 + std::exp(-dot)));
        if (!(dg <= worst_g)) worst_g = dg;
    }
    // counts: every choice counted once
    std::vector<int> want(e, 0);
    for (int i = 0; i < t * k; i++)
        if (ids[i] >= 0 && ids[i] < e) want[ids[i]]++;
    const bool counted = want == counts;
    ok &= worst < 1e-6 && worst_g < 1e-6 && counted;
    printf("moe_route t %d e %d k %d d %d: ids %s, weights max err %.1e, shared gates %.1e, counts %s %s\n", t, e, k, d,
           ok ? "equal" : "DIFFER", worst, worst_g, counted ? "equal" : "WRONG", ok ? "ok" : "FAILED");
    fails += !ok;
}

// moe_combine against a double reference: h += sum_k w_k bf16(y[row(t, k)]) + sgate[t] ys[t]
// (a routed expert's output taken as bf16), rows through a permutation (the sorted order) or
// unsorted (null), k above the 8 loads a pass. Without the fused norm, then with it on the same
// inputs: h the same bits, and xb the bits rmsnorm_zc_bf16 writes from that h. With d % 8 == 0
// also moe_combine_bf16 on y stored as bf16: h the same bits as moe_combine's, xb within one
// bf16 step of rmsnorm_zc_bf16's (its threads sum the squares over other features, so the sum
// may round differently).
static void combine_check(int t, int k, int d, bool sorted) {
    std::vector<float> y((size_t)t * k * d), ys((size_t)t * d), h((size_t)t * d), w((size_t)t * k), sg(t);
    for (auto* v : {&y, &ys, &h, &w, &sg})
        for (auto& x : *v) x = uni(-1, 1);
    std::vector<int> slot_row((size_t)t * k);
    for (int i = 0; i < t * k; i++) slot_row[i] = i;
    std::shuffle(slot_row.begin(), slot_row.end(), rng);
    const int* rows = sorted ? slot_row.data() : nullptr;
    std::vector<bf16> y16(y.size());
    for (size_t i = 0; i < y.size(); i++) y16[i] = __float2bfloat16(y[i]);
    std::vector<double> ref(h.begin(), h.end());
    for (int tok = 0; tok < t; tok++)
        for (int c = 0; c < d; c++) {
            for (int kk = 0; kk < k; kk++) {
                const int i = tok * k + kk, r = sorted ? slot_row[i] : i;
                ref[(size_t)tok * d + c] += (double)w[i] * __bfloat162float(y16[(size_t)r * d + c]);
            }
            ref[(size_t)tok * d + c] += (double)sg[tok] * ys[(size_t)tok * d + c];
        }
    std::vector<float> h2 = h, h3 = h, nw(d);
    for (auto& x : nw) x = uni(-0.3f, 0.3f);
    std::vector<bf16> xb((size_t)t * d, bf16{0x7fff}), xb_ref((size_t)t * d, bf16{0x7fff}), xb16 = xb;
    const float eps = 1e-6f;
    emu_launch({(unsigned)t, 1, 1}, 256, 0, [&] {
        moe_combine(y.data(), rows, w.data(), ys.data(), sg.data(), h.data(), k, d, nullptr, nullptr, eps);
    });
    emu_launch({(unsigned)t, 1, 1}, 256, 0, [&] {
        moe_combine(y.data(), rows, w.data(), ys.data(), sg.data(), h2.data(), k, d, nw.data(), xb.data(), eps);
    });
    emu_launch({(unsigned)t, 1, 1}, 256, 0, [&] { rmsnorm_zc_bf16(h.data(), nw.data(), xb_ref.data(), d, eps); });
    double worst = 0;
    for (size_t i = 0; i < h.size(); i++) {
        const double dv = std::fabs(h[i] - ref[i]);
        if (!(dv <= worst)) worst = dv;
    }
    const bool same = memcmp(h.data(), h2.data(), h.size() * 4) == 0 && memcmp(xb.data(), xb_ref.data(), xb.size() * 2) == 0;
    bool ok = worst < 1e-5 && same;
    std::string wide = "";
    if (d % 8 == 0) {
        emu_launch({(unsigned)t, 1, 1}, 256, 0, [&] {
            moe_combine_bf16(y16.data(), rows, w.data(), ys.data(), sg.data(), h3.data(), k, d, nw.data(), xb16.data(),
                             eps);
        });
        int steps = 0;
        for (size_t i = 0; i < xb16.size(); i++)
            steps = std::max(steps, std::abs((int)(int16_t)xb16[i].v - (int)(int16_t)xb_ref[i].v));
        const bool same16 = memcmp(h3.data(), h.data(), h.size() * 4) == 0 && steps <= 1;
        ok &= same16;
        wide = same16 ? "; moe_combine_bf16: h bitwise, xb within a bf16 step" : "; moe_combine_bf16 DIFFERS";
    }
    printf("moe_combine t %d k %d d %d %s: max err %.1e, fused RMSNorm %s rmsnorm_zc_bf16's%s %s\n", t, k, d,
           sorted ? "sorted" : "unsorted", worst, same ? "bitwise" : "DIFFERS from", wide.c_str(), ok ? "ok" : "FAILED");
    fails += !ok;
}

// FP8 weights [rows, cols]: random e4m3 bytes (every finite code) and a random scale for each
// 128 x 128 block; at() is the dequantised value.
struct Fp8W {
    std::vector<unsigned char> q;
    std::vector<float> s;
    int rows = 0, cols = 0;
    double at(size_t r, int c) const { return (double)emu_e4m3(q[r * cols + c]) * s[(r / 128) * ((cols + 127) / 128) + c / 128]; }
    const uint4* words() const { return reinterpret_cast<const uint4*>(q.data()); }
};
static Fp8W rand_fp8(int rows, int cols, float scale) {
    Fp8W w;
    w.rows = rows, w.cols = cols;
    w.q.resize((size_t)rows * cols);
    for (auto& b : w.q) {
        do b = (unsigned char)(rng() & 0xff); while ((b & 0x7f) == 0x7f);
    }
    w.s.resize((size_t)((rows + 127) / 128) * ((cols + 127) / 128));
    for (auto& v : w.s) v = uni(0.5f, 1.5f) * scale / 200.0f;  // |e4m3| up to 448, mostly smaller
    return w;
}

// The decode MoE block, router -> gate/up -> down (moe_router_dec, moe_gate_up_dec,
// moe_down_dec), against a double-precision reference of the same math: x = bf16(RMSNorm(h)),
// logits = W_r x, the top-k renormalised, sgate = sigmoid(w_sg . x), act = bf16(SiLU(g) u) for
// the k chosen and the shared expert, h += sum_s w_s down_s act_s + sgate shared_down act.
// d 2048 / inter 512 take the kernels' register-preloaded paths, the small shape the generic ones.
// early: moe_down_dec picks the experts from the logits itself (before its griddep_wait).
// fp8: the experts e4m3 with block scales (moe_gate_up_dec_fp8, moe_down_dec_fp8; no early).
// q4: the experts affine 4-bit in q4 tiles with groups of q4 columns (moe_gate_up_dec_q4,
// moe_down_dec_q4; no early).
static void decode_moe_check(int d, int e, int k, int inter, int s_inter, int early, bool fp8 = false, int q4 = 0) {
    const float eps = 1e-6f;
    std::vector<float> h(d), nw(d), w_sg(d);
    for (auto& v : h) v = uni(-2, 2);
    for (auto& v : nw) v = uni(-0.3f, 0.3f);
    for (auto& v : w_sg) v = uni(-0.05f, 0.05f);
    auto wr = rand_bf16((size_t)e * d, 1.0f / std::sqrt((float)d));
    const float sd = 1.0f / std::sqrt((float)d), si = 1.0f / std::sqrt((float)inter), ss_ = 1.0f / std::sqrt((float)s_inter);
    auto gu = rand_bf16(fp8 ? 0 : (size_t)e * 2 * inter * d, sd);
    auto sgu = rand_bf16(fp8 ? 0 : (size_t)2 * s_inter * d, sd);
    auto dn = rand_bf16(fp8 ? 0 : (size_t)e * d * inter, si);
    auto sdn = rand_bf16(fp8 ? 0 : (size_t)d * s_inter, ss_);
    Fp8W gu8, sgu8, dn8, sdn8;
    if (fp8) {
        gu8 = rand_fp8(e * 2 * inter, d, sd);
        sgu8 = rand_fp8(2 * s_inter, d, sd);
        dn8 = rand_fp8(e * d, inter, si);
        sdn8 = rand_fp8(d, s_inter, ss_);
    }
    Q4Host gu4, sgu4, dn4, sdn4;
    if (q4) {  // scales ~ std / 5: weights of about the bf16 case's spread
        gu4 = make_q4(e * 2 * inter, d, q4, rng, sd / 5);
        sgu4 = make_q4(2 * s_inter, d, q4, rng, sd / 5);
        dn4 = make_q4(e * d, inter, q4, rng, si / 5);
        sdn4 = make_q4(d, s_inter, q4, rng, ss_ / 5);
    }
    // weight (row r, column c) of the stacked gate/up, shared gate/up, down, shared down
    auto w_gu = [&](size_t r, int c) { return q4 ? gu4.w(r, c) : fp8 ? gu8.at(r, c) : f(gu[r * d + c]); };
    auto w_sgu = [&](size_t r, int c) { return q4 ? sgu4.w(r, c) : fp8 ? sgu8.at(r, c) : f(sgu[r * d + c]); };
    auto w_dn = [&](size_t r, int c) { return q4 ? dn4.w(r, c) : fp8 ? dn8.at(r, c) : f(dn[r * inter + c]); };
    auto w_sdn = [&](size_t r, int c) { return q4 ? sdn4.w(r, c) : fp8 ? sdn8.at(r, c) : f(sdn[r * s_inter + c]); };
    const int act_ld = std::max(inter, s_inter);
    std::vector<bf16> xb(d);
    std::vector<float> logits(e), sgate(1), topk_w(k), act((size_t)(k + 1) * act_ld, NAN), h_out = h;
    std::vector<int> topk_ids(k, -1);
    emu_launch({(unsigned)((e + ROUTER_ROWS - 1) / ROUTER_ROWS + 1), 1, 1}, 256, (size_t)router_smem(d) * 4, [&] {
        moe_router_dec(h.data(), nw.data(), eps, d, wr.data(), e, w_sg.data(), xb.data(), logits.data(),
                       sgate.data());
    });
    if (q4)
        emu_launch({(unsigned)((std::max(inter, s_inter) + 15) / 16), (unsigned)(k + 1), 1}, 256,
                   (size_t)gate_up_dec_q4_smem(d, e, k, q4), [&] {
            moe_gate_up_dec_q4(xb.data(), d, logits.data(), e, k, topk_ids.data(), topk_w.data(), gu4.tiles.data(),
                               gu4.sb.data(), inter, sgu4.tiles.data(), sgu4.sb.data(), s_inter, q4, act.data(), act_ld,
                               0);
        });
    else
    emu_launch({(unsigned)((std::max(inter, s_inter) + 7) / 8), (unsigned)(k + 1), 1}, 256,
               (size_t)gate_up_dec_smem(d, e, k) * 4, [&] {
        if (fp8)
            moe_gate_up_dec_fp8(xb.data(), d, logits.data(), e, k, topk_ids.data(), topk_w.data(), gu8.words(),
                                gu8.s.data(), inter, sgu8.words(), sgu8.s.data(), s_inter, act.data(), act_ld, 0);
        else
            moe_gate_up_dec(xb.data(), d, logits.data(), e, k, topk_ids.data(), topk_w.data(), gu.data(), inter,
                            sgu.data(), s_inter, act.data(), act_ld, early);
    });
    if (early) std::fill(topk_w.begin(), topk_w.end(), NAN);  // the early down must not read them
    if (q4) {
        emu_launch({(unsigned)(d / 16), 1, 1}, 32 * (k + 1), (size_t)down_dec_q4_smem(k, inter, s_inter, q4), [&] {
            moe_down_dec_q4(act.data(), act_ld, topk_ids.data(), topk_w.data(), k, sgate.data(), dn4.tiles.data(),
                            dn4.sb.data(), inter, sdn4.tiles.data(), sdn4.sb.data(), s_inter, q4, h_out.data(), d);
        });
    } else if (fp8) {
        emu_launch({(unsigned)((d + 3) / 4), 1, 1}, 32 * (k + 1), 0, [&] {
            moe_down_dec_fp8(act.data(), act_ld, topk_ids.data(), topk_w.data(), k, sgate.data(), dn8.words(),
                             dn8.s.data(), inter, sdn8.words(), sdn8.s.data(), s_inter, h_out.data(), d);
        });
    } else {
        emu_launch({(unsigned)((d + 3) / 4), 1, 1}, 32 * (k + 1), (size_t)down_dec_smem(e, k, inter, s_inter, early), [&] {
            moe_down_dec(act.data(), act_ld, early ? nullptr : topk_ids.data(), topk_w.data(), logits.data(), e, early,
                         k, sgate.data(), dn.data(), inter, sdn.data(), s_inter, h_out.data(), d);
        });
    }
    // Reference.
    double ss = 0;
    for (float v : h) ss += (double)v * v;
    const float inv = 1.0f / std::sqrt((float)(ss / d) + eps);
    std::vector<double> x(d);
    for (int i = 0; i < d; i++) x[i] = __bfloat162float(__float2bfloat16(h[i] * inv * (1.0f + nw[i])));
    std::vector<double> lg(e);
    for (int x_ = 0; x_ < e; x_++) {
        double a = 0;
        for (int i = 0; i < d; i++) a += f(wr[(size_t)x_ * d + i]) * x[i];
        lg[x_] = a;
    }
    std::vector<int> order(e);
    for (int i = 0; i < e; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lg[a] > lg[b]; });
    double sum = 0, sg = 0;
    for (int j = 0; j < k; j++) sum += std::exp(lg[order[j]] - lg[order[0]]);
    for (int i = 0; i < d; i++) sg += (double)w_sg[i] * x[i];
    sg = 1.0 / (1.0 + std::exp(-sg));
    bool ids_ok = true;
    for (int j = 0; j < k; j++) ids_ok &= topk_ids[j] == order[j];
    double err = 0, scale = 0;
    std::vector<std::vector<double>> acts(k + 1);
    for (int s = 0; s <= k; s++) {
        const bool sh = s == k;
        const int n = sh ? s_inter : inter;
        const size_t r0 = sh ? 0 : (size_t)order[s] * 2 * inter;
        for (int j = 0; j < n; j++) {
            double g = 0, u = 0;
            for (int i = 0; i < d; i++) {
                g += (sh ? w_sgu(r0 + j, i) : w_gu(r0 + j, i)) * x[i];
                u += (sh ? w_sgu(r0 + n + j, i) : w_gu(r0 + n + j, i)) * x[i];
            }
            acts[s].push_back(__bfloat162float(__float2bfloat16((float)(g / (1.0 + std::exp(-g)) * u))));
        }
    }
    for (int r = 0; r < d; r++) {
        double y = h[r], slack = 0;
        for (int s = 0; s <= k; s++) {
            const bool sh = s == k;
            const int n = sh ? s_inter : inter;
            double a = 0;
            for (int j = 0; j < n; j++)
                a += (sh ? w_sdn(r, j) : w_dn((size_t)order[s] * d + r, j)) * acts[s][j];
            const double wt = sh ? sg : std::exp(lg[order[s]] - lg[order[0]]) / sum;
            if (!sh) {
                // A routed expert's output is taken as bf16. Where the sum lies within 1e-5 of a
                // rounding boundary, the kernel's f32 sum may round to the other neighbour.
                const float up = __bfloat162float(__float2bfloat16((float)(a * (1 + 1e-5)))),
                            dn = __bfloat162float(__float2bfloat16((float)(a * (1 - 1e-5))));
                slack += wt * std::fabs(up - dn);
                a = __bfloat162float(__float2bfloat16((float)a));
            }
            y += wt * a;
        }
        const double dv = std::max(0.0, std::fabs(h_out[r] - y) - slack) + (h_out[r] == h_out[r] ? 0.0 : NAN);
        if (!(dv <= err)) err = dv;  // a NaN (a slot never written) sticks
        scale = std::max(scale, std::fabs(y));
    }
    const bool ok = ids_ok && err <= 1e-5 * (1.0 + scale);
    char fmt[32];
    snprintf(fmt, sizeof fmt, q4 ? " q4 group %d" : fp8 ? " fp8" : "", q4);
    printf("%s decode MoE%s d=%d e=%d k=%d inter=%d/%d, down %s: ids %s, h max err %.1e (scale %.2f)\n",
           ok ? "ok  " : "FAIL", fmt, d, e, k, inter, s_inter,
           early == 2 ? "early, bulk rows" : early ? "early" : "after the wait", ids_ok ? "equal" : "DIFFER", err, scale);
    fails += !ok;
}

// moe_gemv_sorted_fp8 / moe_gemv_sorted_swiglu_fp8 (the few-row path with FP8 experts) over rows
// of random experts (repeats included), gathered input rows for gate/up, against double products
// of the dequantised weights: act within its bf16 rounding, y to 1e-6 of its scale.
static void sorted_fp8_check(int d, int inter, int e, int rows) {
    auto gu = rand_fp8(e * 2 * inter, d, 1.0f / std::sqrt((float)d));
    auto dn = rand_fp8(e * d, inter, 1.0f / std::sqrt((float)inter));
    const int tokens = rows / 2 + 1;
    auto xb = rand_bf16((size_t)tokens * d, 1.0f), act_in = rand_bf16((size_t)rows * inter, 1.0f);
    std::vector<int> expert(rows), gather(rows);
    for (int r = 0; r < rows; r++) expert[r] = (int)(rng() % e), gather[r] = (int)(rng() % tokens);
    std::sort(expert.begin(), expert.end());
    std::vector<bf16> act((size_t)rows * inter, bf16{0x7fff});
    std::vector<float> y((size_t)rows * d, NAN);
    const int fg = gemv_sorted_features(true, d), fd = gemv_sorted_features(false, inter);
    emu_launch({(unsigned)rows, (unsigned)((inter + fg - 1) / fg), 1}, 256, (size_t)d * 2, [&] {
        moe_gemv_sorted_swiglu_fp8(xb.data(), gather.data(), gu.words(), gu.s.data(), act.data(), expert.data(), inter, d);
    });
    emu_launch({(unsigned)rows, (unsigned)((d + fd - 1) / fd), 1}, 256, (size_t)inter * 2, [&] {
        moe_gemv_sorted_fp8(act_in.data(), nullptr, dn.words(), dn.s.data(), y.data(), expert.data(), d, inter);
    });
    double ea = 0, ey = 0, ys = 0;
    std::vector<double> yr((size_t)rows * d);
    for (int r = 0; r < rows; r++) {
        const size_t g0 = (size_t)expert[r] * 2 * inter;
        for (int j = 0; j < inter; j++) {
            double g = 0, u = 0;
            for (int i = 0; i < d; i++) {
                const double xv = f(xb[(size_t)gather[r] * d + i]);
                g += gu.at(g0 + j, i) * xv;
                u += gu.at(g0 + inter + j, i) * xv;
            }
            const double ref = g / (1.0 + std::exp(-g)) * u, got = f(act[(size_t)r * inter + j]);
            const double e_ = std::fabs(got - ref) / (std::fabs(ref) * 0.00390625 + 1e-5);
            if (!(e_ <= ea)) ea = e_;
        }
        for (int n = 0; n < d; n++) {
            double a = 0;
            for (int j = 0; j < inter; j++) a += dn.at((size_t)expert[r] * d + n, j) * f(act_in[(size_t)r * inter + j]);
            yr[(size_t)r * d + n] = a;
            ys = std::max(ys, std::fabs(a));
        }
    }
    for (size_t i = 0; i < yr.size(); i++) {
        const double e_ = std::fabs(y[i] - yr[i]) / ys;
        if (!(e_ <= ey)) ey = e_;
    }
    const bool ok = ea <= 1.0 && ey <= 1e-6;
    fails += !ok;
    printf("%s moe_gemv_sorted fp8 d=%d i=%d E=%d rows=%d: swiglu act %.2f of its bound, down %.1e\n",
           ok ? "ok  " : "FAIL", d, inter, e, rows, ea, ey);
}

// moe_gemv_sorted_q4 / moe_gemv_sorted_swiglu_q4 (the few-row path with affine 4-bit experts,
// an expert's rows 8 at a time): runs of up to rows / e rows (more than 8 where e is small, so
// tiles split a run), gathered input for gate/up, against double products of the dequantised
// weights: act within its bf16 rounding, y to 1e-6 of its scale.
static void sorted_q4_check(int d, int inter, int e, int rows, int group) {
    auto gu = make_q4(e * 2 * inter, d, group, rng, 1.0f / std::sqrt((float)d) / 5);
    auto dn = make_q4(e * d, inter, group, rng, 1.0f / std::sqrt((float)inter) / 5);
    const int tokens = rows / 2 + 1;
    auto xb = rand_bf16((size_t)tokens * d, 1.0f), act_in = rand_bf16((size_t)rows * inter, 1.0f);
    std::vector<int> expert(rows), gather(rows);
    for (int r = 0; r < rows; r++) expert[r] = (int)(rng() % e), gather[r] = (int)(rng() % tokens);
    std::sort(expert.begin(), expert.end());
    std::vector<bf16> act((size_t)rows * inter, bf16{0x7fff});
    std::vector<float> y((size_t)rows * d, NAN);
    const int spb = q4_strips(inter == 2048 ? 4 : inter == 512 ? 1 : inter == 4096 ? 8 : 0);
    emu_launch({(unsigned)rows, (unsigned)(inter / 16), 1}, 256, (size_t)q4_smem(8, d, group, false, 8 * 8 * 16 * 2), [&] {
        moe_gemv_sorted_swiglu_q4(xb.data(), gather.data(), gu.tiles.data(), gu.sb.data(), group, act.data(),
                                  expert.data(), rows, inter, d);
    });
    emu_launch({(unsigned)rows, (unsigned)((d / 16 + spb - 1) / spb), 1}, 256,
               (size_t)q4_smem(8, inter, group, false, 8 * 8 * 16 * spb), [&] {
        moe_gemv_sorted_q4(act_in.data(), nullptr, dn.tiles.data(), dn.sb.data(), group, y.data(), expert.data(), rows,
                           d, inter);
    });
    double ea = 0, ey = 0, ys = 0;
    std::vector<double> yr((size_t)rows * d);
    for (int r = 0; r < rows; r++) {
        const size_t g0 = (size_t)expert[r] * 2 * inter;
        for (int j = 0; j < inter; j++) {
            double g = 0, u = 0;
            for (int i = 0; i < d; i++) {
                const double xv = f(xb[(size_t)gather[r] * d + i]);
                g += gu.w(g0 + j, i) * xv;
                u += gu.w(g0 + inter + j, i) * xv;
            }
            const double ref = g / (1.0 + std::exp(-g)) * u, got = f(act[(size_t)r * inter + j]);
            const double e_ = std::fabs(got - ref) / (std::fabs(ref) * 0.00390625 + 1e-5);
            if (!(e_ <= ea)) ea = e_;
        }
        for (int n = 0; n < d; n++) {
            double a = 0;
            for (int j = 0; j < inter; j++) a += dn.w((size_t)expert[r] * d + n, j) * f(act_in[(size_t)r * inter + j]);
            yr[(size_t)r * d + n] = a;
            ys = std::max(ys, std::fabs(a));
        }
    }
    for (size_t i = 0; i < yr.size(); i++) {
        const double e_ = std::fabs(y[i] - yr[i]) / ys;
        if (!(e_ <= ey)) ey = e_;
    }
    const bool ok = ea <= 1.0 && ey <= 1e-6;
    fails += !ok;
    printf("%s moe_gemv_sorted q4 group %d d=%d i=%d E=%d rows=%d: swiglu act %.2f of its bound, down %.1e\n",
           ok ? "ok  " : "FAIL", group, d, inter, e, rows, ea, ey);
}

// moe_grouped_q4 / moe_grouped_swiglu_q4 (the grouped MoE on 4-bit experts, prefill past the
// few-row path) over a plan of tiles of up to 128 rows built here (an expert of 150 rows: a full
// tile and a short one; runs of 5 and 17; an expert with none; the tile list padded past
// num_tiles with junk the kernel must not read), gathered input for gate/up, against double
// products of the dequantised weights: act within its bf16 rounding, y to 1e-6 of its scale.
static void grouped_q4_check(int d, int inter, int group, const std::vector<int>& run) {
    const int e = (int)run.size();
    auto gu = make_q4(e * 2 * inter, d, group, rng, 1.0f / std::sqrt((float)d) / 5);
    auto dn = make_q4(e * d, inter, group, rng, 1.0f / std::sqrt((float)inter) / 5);
    std::vector<int> expert, te, tr, tn;
    for (int x = 0; x < e; x++) {
        for (int j = 0; j < run[x]; j += 128) {
            te.push_back(x);
            tr.push_back((int)expert.size() + j);
            tn.push_back(std::min(128, run[x] - j));
        }
        for (int j = 0; j < run[x]; j++) expert.push_back(x);
    }
    const int rows = (int)expert.size(), tiles = (int)te.size(), max_tiles = tiles + 3;
    std::vector<int> num_tiles(1, tiles);
    for (int j = 0; j < 3; j++) te.push_back(999999), tr.push_back(-5), tn.push_back(1000);
    const int tokens = rows / 2 + 1;
    auto xb = rand_bf16((size_t)tokens * d, 1.0f), act_in = rand_bf16((size_t)rows * inter, 1.0f);
    std::vector<int> gather(rows);
    for (int r = 0; r < rows; r++) gather[r] = (int)(rng() % tokens);
    std::vector<bf16> act((size_t)rows * inter, bf16{0x7fff});
    std::vector<float> y((size_t)rows * d, NAN);
    auto spb = [](bool swiglu, int kdim) { return swiglu ? 2 : q4_strips(kdim == 2048 ? 4 : kdim == 512 ? 1 : kdim == 4096 ? 8 : 0); };
    emu_launch({(unsigned)max_tiles, (unsigned)(inter / 16), 1}, 256,
               (size_t)q4_smem(16, d, group, false, 8 * 16 * 16 * spb(true, d)), [&] {
        moe_grouped_swiglu_q4(xb.data(), gather.data(), gu.tiles.data(), gu.sb.data(), group, act.data(), te.data(),
                              tr.data(), tn.data(), num_tiles.data(), inter, d);
    });
    const int sd = spb(false, inter);
    emu_launch({(unsigned)max_tiles, (unsigned)((d / 16 + sd - 1) / sd), 1}, 256,
               (size_t)q4_smem(16, inter, group, false, 8 * 16 * 16 * sd), [&] {
        moe_grouped_q4(act_in.data(), nullptr, dn.tiles.data(), dn.sb.data(), group, y.data(), te.data(), tr.data(),
                       tn.data(), num_tiles.data(), d, inter);
    });
    double ea = 0, ey = 0, ys = 0;
    std::vector<double> yr((size_t)rows * d);
    for (int r = 0; r < rows; r++) {
        const size_t g0 = (size_t)expert[r] * 2 * inter;
        for (int j = 0; j < inter; j++) {
            double g = 0, u = 0;
            for (int i = 0; i < d; i++) {
                const double xv = f(xb[(size_t)gather[r] * d + i]);
                g += gu.w(g0 + j, i) * xv;
                u += gu.w(g0 + inter + j, i) * xv;
            }
            const double ref = g / (1.0 + std::exp(-g)) * u, got = f(act[(size_t)r * inter + j]);
            const double e_ = std::fabs(got - ref) / (std::fabs(ref) * 0.00390625 + 1e-5);
            if (!(e_ <= ea)) ea = e_;
        }
        for (int n = 0; n < d; n++) {
            double a = 0;
            for (int j = 0; j < inter; j++) a += dn.w((size_t)expert[r] * d + n, j) * f(act_in[(size_t)r * inter + j]);
            yr[(size_t)r * d + n] = a;
            ys = std::max(ys, std::fabs(a));
        }
    }
    for (size_t i = 0; i < yr.size(); i++) {
        const double e_ = std::fabs(y[i] - yr[i]) / ys;
        if (!(e_ <= ey)) ey = e_;
    }
    const bool ok = ea <= 1.0 && ey <= 1e-6;
    fails += !ok;
    printf("%s moe_grouped q4 group %d d=%d i=%d E=%d rows=%d tiles=%d: swiglu act %.2f of its bound, down %.1e\n",
           ok ? "ok  " : "FAIL", group, d, inter, e, rows, tiles, ea, ey);
}

// moe_grouped_fp8 / moe_grouped_swiglu_fp8 (the grouped MoE on FP8 experts, prefill past the
// few-row path) over grouped_q4_check's kind of plan (a full tile and a short one, short runs, an
// expert with none, junk past num_tiles), every e4m3 code but NaN (zeros and subnormals
// included) with random 128 x 128 block scales, gathered input for gate/up, against double
// products of the dequantised weights: act within its bf16 rounding, y to 1e-6 of its scale.
// Shapes whose rows and columns cross several scale blocks (per expert and within a strip's
// units), at the model's kdim 2,048 / 512 (the register-held paths) and others (the NV 0 path).
static void grouped_fp8_check(int d, int inter, const std::vector<int>& run) {
    const int e = (int)run.size();
    auto gu = rand_fp8(e * 2 * inter, d, 1.0f / std::sqrt((float)d));
    auto dn = rand_fp8(e * d, inter, 1.0f / std::sqrt((float)inter));
    std::vector<int> expert, te, tr, tn;
    for (int x = 0; x < e; x++) {
        for (int j = 0; j < run[x]; j += 128) {
            te.push_back(x);
            tr.push_back((int)expert.size() + j);
            tn.push_back(std::min(128, run[x] - j));
        }
        for (int j = 0; j < run[x]; j++) expert.push_back(x);
    }
    const int rows = (int)expert.size(), tiles = (int)te.size(), max_tiles = tiles + 3;
    std::vector<int> num_tiles(1, tiles);
    for (int j = 0; j < 3; j++) te.push_back(999999), tr.push_back(-5), tn.push_back(1000);
    const int tokens = rows / 2 + 1;
    auto xb = rand_bf16((size_t)tokens * d, 1.0f), act_in = rand_bf16((size_t)rows * inter, 1.0f);
    std::vector<int> gather(rows);
    for (int r = 0; r < rows; r++) gather[r] = (int)(rng() % tokens);
    std::vector<bf16> act((size_t)rows * inter, bf16{0x7fff});
    std::vector<float> y((size_t)rows * d, NAN);
    auto spb = [](bool swiglu, int kdim) { return swiglu ? 2 : q4_strips(kdim == 2048 ? 4 : kdim == 512 ? 1 : 0); };
    auto smem = [&](bool swiglu, int kdim) { return (size_t)4 * (16 * q4_ldw(16, kdim) + 8 * 16 * 16 * spb(swiglu, kdim)); };
    emu_launch({(unsigned)max_tiles, (unsigned)(inter / 16), 1}, 256, smem(true, d), [&] {
        moe_grouped_swiglu_fp8(xb.data(), gather.data(), gu.words(), gu.s.data(), act.data(), te.data(), tr.data(),
                               tn.data(), num_tiles.data(), inter, d);
    });
    const int sd = spb(false, inter);
    emu_launch({(unsigned)max_tiles, (unsigned)((d / 16 + sd - 1) / sd), 1}, 256, smem(false, inter), [&] {
        moe_grouped_fp8(act_in.data(), nullptr, dn.words(), dn.s.data(), y.data(), te.data(), tr.data(), tn.data(),
                        num_tiles.data(), d, inter);
    });
    double ea = 0, ey = 0, ys = 0;
    std::vector<double> yr((size_t)rows * d);
    for (int r = 0; r < rows; r++) {
        const size_t g0 = (size_t)expert[r] * 2 * inter;
        for (int j = 0; j < inter; j++) {
            double g = 0, u = 0;
            for (int i = 0; i < d; i++) {
                const double xv = f(xb[(size_t)gather[r] * d + i]);
                g += gu.at(g0 + j, i) * xv;
                u += gu.at(g0 + inter + j, i) * xv;
            }
            const double ref = g / (1.0 + std::exp(-g)) * u, got = f(act[(size_t)r * inter + j]);
            const double e_ = std::fabs(got - ref) / (std::fabs(ref) * 0.00390625 + 1e-5);
            if (!(e_ <= ea)) ea = e_;
        }
        for (int n = 0; n < d; n++) {
            double a = 0;
            for (int j = 0; j < inter; j++) a += dn.at((size_t)expert[r] * d + n, j) * f(act_in[(size_t)r * inter + j]);
            yr[(size_t)r * d + n] = a;
            ys = std::max(ys, std::fabs(a));
        }
    }
    for (size_t i = 0; i < yr.size(); i++) {
        const double e_ = std::fabs(y[i] - yr[i]) / ys;
        if (!(e_ <= ey)) ey = e_;
    }
    const bool ok = ea <= 1.0 && ey <= 1e-6;
    fails += !ok;
    printf("%s moe_grouped fp8 d=%d i=%d E=%d rows=%d tiles=%d: swiglu act %.2f of its bound, down %.1e\n",
           ok ? "ok  " : "FAIL", d, inter, e, rows, tiles, ea, ey);
}

// e4m3x4_to_bf16x4 (as the emulator runs its instructions) against the e4m3 values: every byte
// (NaN codes aside) in every position of the word, bitwise.
static void e4m3_bf16_check() {
    int bad = 0;
    for (unsigned b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f) continue;
        for (int pos = 0; pos < 4; pos++) {
            const unsigned w = (b << (8 * pos)) | (0x38u << (8 * ((pos + 1) % 4)));  // 0x38: 1.0 beside it
            unsigned lo, hi;
            e4m3x4_to_bf16x4(w, lo, hi);
            const unsigned half = ((pos < 2 ? lo : hi) >> (16 * (pos % 2))) & 0xffff;
            bad += f(bf16{(uint16_t)half}) != (double)emu_e4m3(b);
        }
    }
    printf("%s e4m3x4_to_bf16x4: every finite e4m3 code, each byte position: %d wrong\n", bad ? "FAIL" : "ok  ", bad);
    fails += bad != 0;
}

// moe_plan alone over several warps of experts (the model's 256, and ragged counts), offsets
// and cursor included, against plan_ok's sequential table.
static void plan_check(int e, int tile_m) {
    std::vector<int> counts(e);
    for (int x = 0; x < e; x++) counts[x] = x % 7 == 3 ? 0 : (int)(rng() % (3 * tile_m));
    const int max_tiles = 4 * e;
    std::vector<int> offsets(e + 1, -1), cursor(e, -1), te(max_tiles), tr(max_tiles), tn(max_tiles), nt(1, -1);
    emu_launch({1, 1, 1}, (unsigned)((e + 31) / 32 * 32), 0, [&] {
        moe_plan(counts.data(), e, tile_m, offsets.data(), cursor.data(), te.data(), tr.data(), tn.data(), nt.data());
    });
    bool ok = plan_ok(counts, tile_m, te, tr, tn, nt[0]);
    for (int x = 0, off = 0; x <= e; off += x < e ? counts[x] : 0, x++)
        ok &= offsets[x] == off && (x == e || cursor[x] == off);
    printf("%s moe_plan e=%d tile_m=%d: %d tiles\n", ok ? "ok  " : "FAIL", e, tile_m, nt[0]);
    fails += !ok;
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && std::string(argv[1]) == "quick";
    for (int e : {5, 40, 256, 1000}) plan_check(e, e == 40 ? 64 : 128);
    for (int early : {0, 1, 2}) {  // 2: the down rows by bulk copies
        decode_moe_check(64, 8, 2, 32, 32, early);
        decode_moe_check(96, 16, 4, 40, 24, early);
        decode_moe_check(2048, 16, 8, 512, 512, early);
        decode_moe_check(2048, 256, 8, 512, 512, early);
    }
    decode_moe_check(128, 8, 2, 128, 128, 0, true);
    decode_moe_check(2048, 16, 8, 512, 512, 0, true);
    decode_moe_check(2048, 256, 8, 512, 512, 0, true);
    sorted_fp8_check(128, 128, 4, 5);
    sorted_fp8_check(2048, 512, 6, 9);
    decode_moe_check(128, 8, 2, 128, 128, 0, false, 64);
    decode_moe_check(128, 8, 2, 128, 64, 0, false, 32);
    decode_moe_check(256, 8, 4, 128, 128, 0, false, 128);
    decode_moe_check(2048, 16, 8, 512, 512, 0, false, 64);
    decode_moe_check(2048, 256, 8, 512, 512, 0, false, 64);
    sorted_q4_check(128, 128, 4, 5, 64);
    sorted_q4_check(128, 128, 2, 21, 32);
    sorted_q4_check(2048, 512, 3, 20, 64);
    sorted_q4_check(2048, 512, 6, 9, 128);
    grouped_q4_check(128, 128, 32, {20, 0, 9});
    grouped_q4_check(2048, 512, 64, {150, 5, 0, 17});
    e4m3_bf16_check();
    grouped_fp8_check(128, 128, {20, 0, 9});
    grouped_fp8_check(384, 256, {150, 5, 0, 17});
    if (!quick) grouped_fp8_check(2048, 512, {150, 5, 0, 17});
    for (int e : {5, 8, 16, 64, 256, 300})
        for (int k : {1, 2, 4, 8})
            if (k <= e) route_check(k % 2 ? 12 : 21, e, k, k % 2 ? 36 : 64);
    route_small_check(8, 256, 8, 2048);
    route_small_check(16, 256, 8, 2048);
    route_small_check(37, 20, 2, 64);
    route_small_check(5, 300, 4, 96);
    for (bool sorted : {true, false}) {
        combine_check(5, 8, 2048, sorted);
        combine_check(3, 10, 36, sorted);
        combine_check(4, 2, 1100, sorted);
    }
    // deep-k: 8 and 5 K tiles, so the pipelines' stages wrap (the tiny shapes have one or two)
    const Shape tiny[] = {{"tiny-flat-f32", 37, 64, 32, 8, 2}, {"tiny-official-bf16", 150, 96, 32, 16, 4},
                          {"ragged", 50, 40, 24, 5, 2}, {"deep-k", 40, 512, 320, 4, 2}};
    for (bool deferred : {true, false})
        for (const Shape& s : tiny) run(s, deferred);
    if (!quick) run({"reduced real", 150, 2048, 512, 16, 2}, true);
    if (fails) printf("%d check(s) FAILED\n", fails);
    return fails ? 1 : 0;
}
