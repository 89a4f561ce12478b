// Runs gdn_decode.cu's, gdn_chunk.cu's and gdn_state.cu's kernels on the CPU emulator (through
// run.sh) and checks the recurrent kernel and the chunked delta rule against a double-precision
// token-by-token delta rule: gdn_chunk_prep's output through a double-precision state pass (here)
// and through gdn_chunk_state_t64 (twice on the same prep output, once with each cp.async
// timing, bitwise equal); the prefill conv against the sequential conv kernels, the gated norm
// and the decode step against double references; both cp.async timings (eager, deferred). The
// product module has the GDN kernels at the model's dk = 128 only; the checks at smaller dk
// (faster, narrower edge cases) instantiate the kernels' templates here.
#include "kernels_emu.inc"
#include <cstdio>
#include <random>

static float G_SCALE = 5.0f;
struct Rng { std::mt19937_64 g; float uni(float a, float b) { return std::uniform_real_distribution<float>(a, b)(g); } };

static double max_rel(const std::vector<float>& a, const std::vector<double>& ref) {
    double m = 0, s = 0;
    for (size_t i = 0; i < a.size(); i++) { m = std::max(m, std::fabs(a[i] - ref[i])); s = std::max(s, std::fabs(ref[i])); }
    return m / s;
}
static bool any_nan(const std::vector<float>& a) { for (float x : a) if (!std::isfinite(x)) return true; return false; }

template <int DK>
void run_delta(int t, int hk, int hv, int dv, bool deferred, double tol) {
    g_cp_deferred = deferred;
    const int dk = DK, c = 2 * hk * dk + hv * dv, C = 64, nch = (t + C - 1) / C, tp = nch * C;
    Rng rng{std::mt19937_64(t * 131 + hv)};
    std::vector<float> qkv((size_t)t * c), g((size_t)t * hv), beta((size_t)t * hv), s0((size_t)hv * dk * dv);
    for (int s = 0; s < t; s++) {
        for (int h = 0; h < 2 * hk; h++) {
            float* x = &qkv[(size_t)s * c + h * dk];
            double n = 0;
            for (int i = 0; i < dk; i++) { x[i] = rng.uni(-1, 1); n += x[i] * x[i]; }
            float sc = (h < hk ? 1.0f / std::sqrt((float)dk) : 1.0f) / std::sqrt((float)n);
            for (int i = 0; i < dk; i++) x[i] *= sc;
        }
        for (int i = 2 * hk * dk; i < c; i++) qkv[(size_t)s * c + i] = rng.uni(-1, 1);
        for (int j = 0; j < hv; j++) {
            float a = G_SCALE * std::pow((j + 1.0f) / hv, 3.0f);  // decay scale per head: ~0 .. 5
            g[s * hv + j] = -rng.uni(0, a);
            beta[s * hv + j] = rng.uni(0.01f, 0.99f);
        }
    }
    for (auto& x : s0) x = rng.uni(-0.5f, 0.5f);
    // reference
    std::vector<double> sref(s0.begin(), s0.end()), oref((size_t)t * hv * dv, 0.0);
    for (int j = 0; j < hv; j++) {
        int kh = j / (hv / hk);
        double* S = &sref[(size_t)j * dk * dv];
        for (int s = 0; s < t; s++) {
            const float* q = &qkv[(size_t)s * c + kh * dk];
            const float* k = &qkv[(size_t)s * c + (hk + kh) * dk];
            const float* v = &qkv[(size_t)s * c + 2 * hk * dk + j * dv];
            double dec = std::exp((double)g[s * hv + j]), b = beta[s * hv + j];
            for (int m = 0; m < dv; m++) {
                double r = 0;
                for (int i = 0; i < dk; i++) { S[i * dv + m] *= dec; r += S[i * dv + m] * k[i]; }
                double u = b * (v[m] - r), o = 0;
                for (int i = 0; i < dk; i++) { S[i * dv + m] += k[i] * u; o += S[i * dv + m] * q[i]; }
                oref[((size_t)s * hv + j) * dv + m] = o;
            }
        }
    }
    const float NaN = std::nanf("");
    // recurrent kernel (the module's entry point at dk 128, the template otherwise)
    std::vector<float> st_r = s0, o_r((size_t)t * hv * dv, NaN);
    unsigned blk = (dv + 31) / 32 * 32;
    emu_launch({(unsigned)hv, 1, 1}, blk, 0, [&] {
        if constexpr (DK == 128) gdn_recurrent_128(qkv.data(), c, g.data(), beta.data(), st_r.data(), o_r.data(), t, hk, hv, dv);
        else gdn_recurrent_impl<DK>(qkv.data(), c, g.data(), beta.data(), st_r.data(), o_r.data(), t, hk, hv, dv);
    });
    // gdn_chunk_prep: W, Q', U, γ and O_intra (in o)
    std::vector<float> o_intra((size_t)t * hv * dv, NaN), scratch((size_t)hv * tp * (2 * dk + dv + 1), NaN);
    float* w = scratch.data();
    float* qp = w + (size_t)hv * tp * dk;
    float* u = qp + (size_t)hv * tp * dk;
    float* gam = u + (size_t)hv * tp * dv;
    const int nx = dk + (dv + 7) / 8 * 8, ldx = nx + (40 - nx % 32) % 32;
    size_t prep = 4 * (2 * C * (C + 4) + 3 * C + 4 * 16 * 20 + std::max(2 * C * (dk + 4), C * ldx));
    emu_launch({(unsigned)nch, (unsigned)hv, 1}, 256, prep, [&] {
        if constexpr (DK == 128) gdn_chunk_prep_128(qkv.data(), c, g.data(), beta.data(), w, qp, u, gam, o_intra.data(), t, hk, hv, dv);
        else gdn_chunk_prep_impl<DK>(qkv.data(), c, g.data(), beta.data(), w, qp, u, gam, o_intra.data(), t, hk, hv, dv);
    });
    // The state pass in double precision from the prep's output (the contract gdn_chunk_state_t64
    // implements): per chunk V' = U − W S, O = O_intra + Q' S, S ← e^{γ_last} S + Kᵀ (e^{γ_last − γ} V'),
    // K the chunk's conv rows (0 past t). So the prep alone meets the f32-level bound.
    std::vector<double> st_c(s0.begin(), s0.end()), o_c((size_t)t * hv * dv, 0.0);
    {
        std::vector<double> vd((size_t)C * dv);
        for (int j = 0; j < hv; j++) {
            const int kh = j / (hv / hk);
            double* S = &st_c[(size_t)j * dk * dv];
            for (int ch = 0; ch < nch; ch++) {
                const size_t row0 = (size_t)j * tp + (size_t)ch * C;
                const double last = gam[row0 + C - 1];
                for (int r = 0; r < C; r++) {
                    const float* wr = w + (row0 + r) * dk;
                    const float* qr = qp + (row0 + r) * dk;
                    const int s = ch * C + r;
                    const double e = std::exp(last - (double)gam[row0 + r]);
                    for (int m = 0; m < dv; m++) {
                        double rw = 0, rq = 0;
                        for (int i = 0; i < dk; i++) { rw += (double)wr[i] * S[i * dv + m]; rq += (double)qr[i] * S[i * dv + m]; }
                        vd[(size_t)r * dv + m] = ((double)u[(row0 + r) * dv + m] - rw) * e;
                        if (s < t) o_c[((size_t)s * hv + j) * dv + m] = (double)o_intra[((size_t)s * hv + j) * dv + m] + rq;
                    }
                }
                const double el = std::exp(last);
                for (int i = 0; i < dk * dv; i++) S[i] *= el;
                for (int r = 0; r < C && ch * C + r < t; r++) {
                    const float* k = &qkv[(size_t)(ch * C + r) * c + (hk + kh) * dk];
                    for (int i = 0; i < dk; i++)
                        for (int m = 0; m < dv; m++) S[i * dv + m] += (double)k[i] * vd[(size_t)r * dv + m];
                }
            }
        }
    }
    auto max_rel_d = [](const std::vector<double>& a, const std::vector<double>& ref) {
        double m = 0, s = 0;
        for (size_t i = 0; i < a.size(); i++) {
            if (!std::isfinite(a[i])) return (double)INFINITY;
            m = std::max(m, std::fabs(a[i] - ref[i]));
            s = std::max(s, std::fabs(ref[i]));
        }
        return m / s;
    };
    std::vector<double> o_rd(o_r.begin(), o_r.end()), s_rd(st_r.begin(), st_r.end());
    double er_o = max_rel(o_r, oref), er_s = max_rel(st_r, sref);
    double ec_o = max_rel_d(o_c, oref), ec_s = max_rel_d(st_c, sref);
    // the prep's path vs the recurrent kernel too, as the GPU test compares them
    double x_o = max_rel_d(o_c, o_rd), x_s = max_rel_d(st_c, s_rd);
    bool ok = !any_nan(o_r) && !any_nan(st_r) && er_o < tol && er_s < tol && ec_o < tol && ec_s < tol && x_o < tol &&
              x_s < tol;
    printf("%s dk=%d dv=%d hk=%d hv=%d t=%d cp.async %s: recurrent o %.1e S %.1e | prep + f64 state pass o %.1e S %.1e | vs recurrent o %.1e S %.1e\n",
           ok ? "ok  " : "FAIL", dk, dv, hk, hv, t, deferred ? "deferred" : "eager", er_o, er_s, ec_o, ec_s, x_o, x_s);
    if (!ok) exit(1);
    // gdn_chunk_state_t64 (Sᵀ as the wgmma A operand, DK 128; 3xBF16 products, ~1e-5-level, so
    // its own bound) from the same prep output: the state blocks, then 3 out blocks (the emulator
    // runs blocks in order, so the out blocks find every state released); again with the other
    // cp.async timing, bitwise the same (a difference would mean a missing wait: a race between
    // the roles)
    if constexpr (DK == 128) {
        const int nstate = hv * ((dv + 63) / 64);
        std::vector<float> st_t[2], o_t[2];
        bool flags_ok = true;
        for (int pass = 0; pass < 2; pass++) {
            g_cp_deferred = pass ? !deferred : deferred;
            st_t[pass] = s0, o_t[pass] = o_intra;
            std::vector<float> s_out((size_t)nstate * nch * 128 * 64, NaN);
            std::vector<unsigned> flags((size_t)nstate * GDN_T64_FLAG_STRIDE, 0);  // a 128-byte line each
            size_t t64sm = 2 * 2 * 3 * C * dk + 4 * (2 * C * 68 + 2 * C) + 80;
            emu_launch({(unsigned)(nstate + 3), 1, 1}, 384, t64sm, [&] {
                gdn_chunk_state_t64_128(qkv.data(), c, w, qp, u, gam, st_t[pass].data(), o_t[pass].data(), s_out.data(),
                                        flags.data(), t, hk, hv, dv);
            });
            for (int b = 0; b < nstate; b++) flags_ok = flags_ok && flags[(size_t)b * GDN_T64_FLAG_STRIDE] == (unsigned)nch;
        }
        g_cp_deferred = deferred;
        double et_o = max_rel(o_t[0], oref), et_s = max_rel(st_t[0], sref);
        double xt_o = max_rel(o_t[0], o_rd), xt_s = max_rel(st_t[0], s_rd);
        bool same = o_t[0] == o_t[1] && st_t[0] == st_t[1];
        bool okt = !any_nan(o_t[0]) && !any_nan(st_t[0]) && et_o < 1e-4 && et_s < 1e-4 && xt_o < 1e-4 && xt_s < 1e-4 &&
                   flags_ok && same;
        printf("%s   Sᵀ-register state pass, 3xBF16 (gdn_chunk_state_t64): o %.1e S %.1e | vs recurrent o %.1e S %.1e | "
               "both cp.async timings %s%s\n",
               okt ? "ok  " : "FAIL", et_o, et_s, xt_o, xt_s, same ? "bitwise equal" : "DIFFER",
               flags_ok ? "" : ", counters wrong");
        if (!okt) exit(1);
    }
}

// pad: p's rows are c + pad floats apart (the conv's channels the first c of the whole
// in-projection's row); the padding holds values that would show if read.
void run_conv(int t, int hk, int dk, int hv, int dv, int kern = 4, int pad = 0) {
    const int c = 2 * hk * dk + hv * dv, hist = kern - 1, ldp = c + pad;
    Rng rng{std::mt19937_64(7 + t)};
    std::vector<float> p((size_t)t * ldp), w((size_t)c * kern), st((size_t)hist * c);
    for (size_t i = 0; i < p.size(); i++) p[i] = (int)(i % ldp) < c ? rng.uni(-2, 2) : 1e30f;
    for (auto& x : w) x = rng.uni(-1, 1);
    for (auto& x : st) x = rng.uni(-2, 2);
    std::vector<float> st_a = st, st_b = st, out_a((size_t)t * c, 1e30f), out_b((size_t)t * c, 1e30f);
    float qs = 1.0f / std::sqrt((float)dk);
    emu_launch({(unsigned)((c + 127) / 128), 1, 1}, 128, 0, [&] { gdn_conv(p.data(), st_a.data(), w.data(), out_a.data(), t, c, ldp, kern); });
    emu_launch({(unsigned)t, (unsigned)(2 * hk), 1}, (dk + 31) / 32 * 32, 0, [&] { gdn_qk_l2norm(out_a.data(), c, hk, dk, qs); });
    emu_launch({(unsigned)((t + 31) / 32), (unsigned)(2 * hk + (hv * dv + 127) / 128), 1}, 128, 0,
               [&] { gdn_conv_prefill(p.data(), st_b.data(), w.data(), out_b.data(), t, c, ldp, kern, hk, dk, qs); });
    emu_launch({(unsigned)((c + 255) / 256), 1, 1}, 256, 0, [&] { gdn_conv_advance(p.data(), st_b.data(), t, c, ldp, kern); });
    // the state's last rows are the last inputs (or, t < hist, the old rows shifted)
    bool st_ok = true;
    for (int j = 0; j < hist; j++)
        for (int ch = 0; ch < c; ch++) {
            const int src = t + j;  // row of [state ; p]
            const float want = src < hist ? st[(size_t)src * c + ch] : p[(size_t)(src - hist) * ldp + ch];
            st_ok = st_ok && st_b[(size_t)j * c + ch] == want;
        }
    double eo = 0, es = 0;
    for (size_t i = 0; i < out_a.size(); i++) eo = std::max(eo, (double)std::fabs(out_a[i] - out_b[i]));
    for (size_t i = 0; i < st_a.size(); i++) es = std::max(es, (double)std::fabs(st_a[i] - st_b[i]));
    bool ok = eo < 1e-6 && es == 0 && st_ok;
    printf("%s conv t=%d c=%d ldp=%d kern=%d: out max diff %.1e, state max diff %.1e%s\n", ok ? "ok  " : "FAIL", t, c, ldp,
           kern, eo, es, st_ok ? "" : ", state not the last inputs");
    if (!ok) exit(1);
}

static const double TOL = 1e-5;

// gdn_gated_norm against a double reference (o / rms(o) * w * SiLU(z), then bf16): vector
// (dv and z's row stride % 4 == 0) and scalar rows; within the bf16 rounding. z: t tokens of hv
// heads in rows of hv * dv + pad floats (the in-projection's output; the padding would show).
static void run_gated_norm(int t, int hv, int dv, int pad) {
    const int rows = t * hv, ldz = hv * dv + pad;
    std::mt19937 rng(rows * 131 + dv + pad);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<float> o((size_t)rows * dv), z((size_t)t * ldz), w(dv);
    for (auto& x : o) x = u(rng);
    for (size_t i = 0; i < z.size(); i++) z[i] = (int)(i % ldz) < hv * dv ? u(rng) : NAN;
    for (auto& x : w) x = u(rng);
    std::vector<bf16> out(o.size());
    const float eps = 1e-6f;
    emu_launch({(unsigned)((rows + 7) / 8), 1, 1}, 256, 0,
               [&] { gdn_gated_norm(o.data(), z.data(), w.data(), out.data(), rows, dv, hv, ldz, eps); });
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int i = 0; i < dv; i++) ss += (double)o[(size_t)r * dv + i] * o[(size_t)r * dv + i];
        const double inv = 1.0 / std::sqrt(ss / dv + eps);
        for (int i = 0; i < dv; i++) {
            const size_t j = (size_t)r * dv + i;
            const double zj = z[(size_t)(r / hv) * ldz + (size_t)(r % hv) * dv + i];
            const double ref = o[j] * inv * w[i] * (zj / (1.0 + std::exp(-zj)));
            const double e = std::fabs(__bfloat162float(out[j]) - ref) / (std::fabs(ref) * 0.00390625 + 1e-6);
            if (!(e <= worst)) worst = e;
        }
    }
    const bool ok = worst <= 1.0;
    printf("gdn_gated_norm t %d hv %d dv %d ldz %d: %.2f of the bf16 bound %s\n", t, hv, dv, ldz, worst, ok ? "ok" : "FAILED");
    if (!ok) exit(1);
}

// gdn_step_dec (the decode step: gates, delta rule on the f32 state, gated RMSNorm) against a
// double-precision step from the same state: S *= decay, u = beta (v - S^T k), S += k u^T,
// o = S^T q, out = bf16(o / rms(o) * w * SiLU(z)). Inputs as the decode graph lays them out.
template <int DK>
static void run_step_dec(int hk, int hv, int dv, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> qkv((size_t)2 * hk * DK + (size_t)hv * dv), ba(2 * hv), a_log(hv), dt_bias(hv),
        z((size_t)hv * dv), nw(dv), state((size_t)hv * DK * dv);
    for (auto* a : {&qkv, &ba, &a_log, &dt_bias, &z, &nw, &state}) for (auto& x : *a) x = u(rng);
    for (int i = 0; i < 2 * hk * DK; i++) qkv[i] *= 0.1f;  // unit-ish q, k as after the L2 norms
    const float eps = 1e-6f;
    std::vector<double> st_ref(state.begin(), state.end()), out_ref((size_t)hv * dv);
    for (int j = 0; j < hv; j++) {
        const int kh = j / (hv / hk);
        const double x = (double)ba[hv + j] + dt_bias[j], sp = x > 20 ? x : std::log1p(std::exp(x));
        const double decay = std::exp(-std::exp((double)a_log[j]) * sp);
        const double bt = 1.0 / (1.0 + std::exp(-(double)ba[j]));
        std::vector<double> o(dv);
        for (int m = 0; m < dv; m++) {
            double r = 0;
            for (int i = 0; i < DK; i++) {
                double& sv = st_ref[((size_t)j * DK + i) * dv + m];
                sv *= decay;
                r += sv * qkv[(size_t)(hk + kh) * DK + i];
            }
            const double uu = bt * (qkv[(size_t)2 * hk * DK + (size_t)j * dv + m] - r);
            for (int i = 0; i < DK; i++) {
                double& sv = st_ref[((size_t)j * DK + i) * dv + m];
                sv += qkv[(size_t)(hk + kh) * DK + i] * uu;
                o[m] += sv * qkv[(size_t)kh * DK + i];
            }
        }
        double ss = 0;
        for (double x : o) ss += x * x;
        const double inv = 1.0 / std::sqrt(ss / dv + eps);
        for (int m = 0; m < dv; m++) {
            const double zm = z[(size_t)j * dv + m];
            out_ref[(size_t)j * dv + m] = o[m] * inv * nw[m] * zm / (1.0 + std::exp(-zm));
        }
    }
    std::vector<bf16> out((size_t)hv * dv);
    const unsigned block = (unsigned)((4 * dv + 31) / 32 * 32);
    emu_launch({(unsigned)hv, 1, 1}, block, 0, [&] {
        if constexpr (DK == 128)
            gdn_step_dec_128(qkv.data(), ba.data(), a_log.data(), dt_bias.data(), z.data(), nw.data(), state.data(),
                             out.data(), hk, hv, dv, eps);
        else
            gdn_step_dec_impl<DK>(qkv.data(), ba.data(), a_log.data(), dt_bias.data(), z.data(), nw.data(), state.data(),
                                  out.data(), hk, hv, dv, eps);
    });
    double es = max_rel(state, st_ref), eo = 0;
    for (size_t i = 0; i < out.size(); i++) {
        const double e =
            std::fabs(__bfloat162float(out[i]) - out_ref[i]) / (std::fabs(out_ref[i]) * 0.0078125 + 1e-5);
        if (!(e <= eo)) eo = e;
    }
    const bool ok = es < 1e-5 && eo <= 1.0 && !any_nan(state);
    printf("%s gdn_step_dec dk=%d hk=%d hv=%d dv=%d: state max rel %.1e, out %.2f of a bf16 step\n",
           ok ? "ok  " : "FAIL", DK, hk, hv, dv, es, eo);
    if (!ok) exit(1);
}

// The module's gdn_convstep_dec entry points at dk 128, the template otherwise.
using ConvstepF = void (*)(const float*, float*, const float*, const float*, const float*, const float*, const float*,
                           const float*, float*, bf16*, int, int, int, int, float, float, const u64*, int, int);
template <int DK>
static ConvstepF convstep_fn(int G) {
    if constexpr (DK == 128) return G == 2 ? gdn_convstep_dec_cl2_128 : gdn_convstep_dec_128;
    else return G == 2 ? gdn_convstep_dec_impl<DK, 2> : gdn_convstep_dec_impl<DK, 1>;
}

// gdn_convstep_dec (conv + delta-rule step in one launch; with two value heads a key head a
// cluster of two blocks) against gdn_conv_dec then gdn_step_dec on the same inputs: the conv state
// bitwise, the recurrent state within f32 rounding (q and k are normalised through the sums
// instead of the vectors), the output within a bf16 step.
template <int DK>
static void run_convstep_dec(int hk, int hv, int dv, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int c = 2 * hk * DK + hv * dv, kern = 4, G = hv / hk;
    std::vector<float> p(c), z((size_t)hv * dv), ba(2 * hv), a_log(hv), dt_bias(hv), nw(dv), conv_w((size_t)c * kern),
        conv_st((size_t)(kern - 1) * c), state((size_t)hv * DK * dv);
    for (auto* a : {&p, &z, &ba, &a_log, &dt_bias, &nw, &conv_w, &conv_st, &state}) for (auto& x : *a) x = u(rng);
    const float q_scale = 1.0f / std::sqrt((float)DK), eps = 1e-6f;
    // the two launches
    std::vector<float> conv_a = conv_st, state_a = state, qkv(c);
    std::vector<bf16> out_a((size_t)hv * dv), out_b((size_t)hv * dv);
    emu_launch({(unsigned)(2 * hk + hv), 1, 1}, (unsigned)((std::max(DK, dv) + 31) / 32 * 32), 0, [&] {
        gdn_conv_dec(p.data(), conv_a.data(), conv_w.data(), qkv.data(), c, kern, hk, DK, dv, q_scale);
    });
    emu_launch({(unsigned)hv, 1, 1}, (unsigned)((4 * dv + 31) / 32 * 32), 0, [&] {
        if constexpr (DK == 128)
            gdn_step_dec_128(qkv.data(), ba.data(), a_log.data(), dt_bias.data(), z.data(), nw.data(), state_a.data(),
                             out_a.data(), hk, hv, dv, eps);
        else
            gdn_step_dec_impl<DK>(qkv.data(), ba.data(), a_log.data(), dt_bias.data(), z.data(), nw.data(),
                                  state_a.data(), out_a.data(), hk, hv, dv, eps);
    });
    // the fused one
    std::vector<float> conv_b = conv_st, state_b = state;
    emu_launch_cluster({(unsigned)hv, 1, 1}, G == 2 ? 2 : 1, (unsigned)((4 * dv + 31) / 32 * 32), GDN_CONVSTEP_SMEM(DK, dv), [&] {
        // the module's entry points at dk 128, the template otherwise
        convstep_fn<DK>(G)(p.data(), conv_b.data(), conv_w.data(), z.data(), ba.data(), a_log.data(), dt_bias.data(),
                           nw.data(), state_b.data(), out_b.data(), c, hk, hv, dv, q_scale, eps, nullptr, 0, 0);
    });
    const bool conv_same = conv_a == conv_b;
    const double es = max_rel(state_b, std::vector<double>(state_a.begin(), state_a.end()));
    double eo = 0;
    for (size_t i = 0; i < out_b.size(); i++) {
        const double a = __bfloat162float(out_a[i]), b = __bfloat162float(out_b[i]);
        const double e = std::fabs(b - a) / (std::fabs(a) * 0.0078125 + 1e-5);
        if (!(e <= eo)) eo = e;
    }
    const bool ok = conv_same && es < 1e-5 && eo <= 1.0 && !any_nan(state_b);
    printf("%s gdn_convstep_dec dk=%d hk=%d hv=%d dv=%d (%s): conv state %s, state max rel %.1e, out %.2f of a bf16 step "
           "from the two launches\n",
           ok ? "ok  " : "FAIL", DK, hk, hv, dv, G == 2 ? "clusters of 2" : "no cluster",
           conv_same ? "bitwise" : "DIFFERS", es, eo);
    if (!ok) exit(1);
}

// gdn_convstep_dec batched: `rows` sequences' tokens in one launch (grid y), each row's p|z|ba
// ldp floats apart, its states through the table, its output ldo values on; against one launch
// per row with that row's states given directly. Bitwise: the same arithmetic per row.
template <int DK>
static void run_convstep_batch(int hk, int hv, int dv, int rows, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int c = 2 * hk * DK + hv * dv, kern = 4, G = hv / hk, vw = hv * dv;
    const int ldp = c + vw + 2 * hv + 3;  // an odd row length: the rows' offsets matter
    std::vector<float> P((size_t)rows * ldp), a_log(hv), dt_bias(hv), nw(dv), conv_w((size_t)c * kern);
    std::vector<std::vector<float>> conv(rows, std::vector<float>((size_t)(kern - 1) * c)),
        st(rows, std::vector<float>((size_t)hv * DK * dv));
    for (auto* a : {&P, &a_log, &dt_bias, &nw, &conv_w}) for (auto& x : *a) x = u(rng);
    for (int r = 0; r < rows; r++) {
        for (auto& x : conv[r]) x = u(rng);
        for (auto& x : st[r]) x = u(rng);
    }
    const float q_scale = 1.0f / std::sqrt((float)DK), eps = 1e-6f;
    const unsigned block = (unsigned)((4 * dv + 31) / 32 * 32);
    auto conv_a = conv, st_a = st;
    std::vector<bf16> out_a((size_t)rows * vw), out_b((size_t)rows * vw);
    for (int r = 0; r < rows; r++) {
        const float* pr = P.data() + (size_t)r * ldp;
        emu_launch_cluster({(unsigned)hv, 1, 1}, G == 2 ? 2 : 1, block, GDN_CONVSTEP_SMEM(DK, dv), [&] {
            convstep_fn<DK>(G)(pr, conv_a[r].data(), conv_w.data(), pr + c, pr + c + vw, a_log.data(), dt_bias.data(),
                               nw.data(), st_a[r].data(), out_a.data() + (size_t)r * vw, c, hk, hv, dv, q_scale, eps,
                               nullptr, 0, 0);
        });
    }
    auto conv_b = conv, st_b = st;
    std::vector<u64> tab(2 * rows);
    for (int r = 0; r < rows; r++) {
        tab[r] = reinterpret_cast<u64>(conv_b[r].data());
        tab[rows + r] = reinterpret_cast<u64>(st_b[r].data());
    }
    emu_launch_cluster({(unsigned)hv, (unsigned)rows, 1}, G == 2 ? 2 : 1, block, GDN_CONVSTEP_SMEM(DK, dv), [&] {
        convstep_fn<DK>(G)(P.data(), nullptr, conv_w.data(), P.data() + c, P.data() + c + vw, a_log.data(),
                           dt_bias.data(), nw.data(), nullptr, out_b.data(), c, hk, hv, dv, q_scale, eps, tab.data(),
                           ldp, vw);
    });
    bool same = conv_a == conv_b && st_a == st_b;
    for (size_t i = 0; i < out_a.size(); i++) same = same && __bfloat162float(out_a[i]) == __bfloat162float(out_b[i]);
    printf("%s gdn_convstep_dec dk=%d hk=%d hv=%d dv=%d, %d rows batched through the state table: %s one launch a row\n",
           same ? "ok  " : "FAIL", DK, hk, hv, dv, rows, same ? "bitwise" : "DIFFERS from");
    if (!same) exit(1);
}

int main(int argc, char** argv) {
    bool full = argc > 1 && std::string(argv[1]) == "full";
    if (const char* gs = getenv("G_SCALE")) G_SCALE = atof(gs);
    run_step_dec<128>(2, 4, 128, 1);  // the model's head shape (block 512)
    run_step_dec<32>(2, 4, 24, 2);    // a narrow one (block 96: a column's lanes across warps)
    run_convstep_dec<128>(2, 4, 128, 4);  // the model's shape: two value heads a key head
    run_convstep_dec<128>(2, 2, 128, 5);  // one value head a key head
    run_convstep_dec<32>(2, 4, 40, 6);    // narrow heads (block 160: conv channels 104)
    run_convstep_dec<32>(3, 3, 48, 7);
    run_convstep_batch<128>(2, 4, 128, 3, 8);  // clusters of two, three sequences
    run_convstep_batch<32>(3, 3, 48, 4, 9);     // no cluster
    for (int dv : {128, 24, 18, 256}) run_gated_norm(21, 1, dv, 0);
    run_gated_norm(7, 3, 128, 64);  // z in the in-projection's rows: the vector path
    run_gated_norm(7, 3, 128, 2);   // a row stride not a multiple of 4: the scalar path
    run_gated_norm(5, 2, 18, 3);
    for (int t : {1, 2, 5, 70}) run_conv(t, 2, 16, 4, 24);
    run_conv(9, 4, 32, 8, 32);
    run_conv(33, 4, 128, 8, 128);
    run_conv(33, 4, 128, 8, 128, 4, 4160);  // p in the whole in-projection's rows (z, b|a after)
    run_conv(2, 2, 16, 4, 24, 4, 13);
    run_conv(70, 2, 16, 4, 24, 4, 13);
    for (int t : {2, 40}) run_conv(t, 2, 16, 4, 24, 3);
    for (bool d : {true, false}) {
        run_delta<16>(37, 2, 4, 24, d, TOL);
        run_delta<16>(150, 2, 4, 24, d, TOL);
        run_delta<32>(130, 4, 8, 32, d, TOL);
        run_delta<32>(64, 2, 4, 48, d, TOL);
        run_delta<64>(100, 2, 4, 64, d, TOL);
        run_delta<128>(70, 1, 2, 128, d, TOL);
        run_delta<16>(45, 2, 4, 20, d, TOL);    // dv % 8 == 4: the prep's zero padding columns
        run_delta<128>(70, 1, 2, 132, d, TOL);  // 33 column tiles: a warp takes a second group
        run_delta<128>(200, 1, 2, 128, d, TOL);  // 4 chunks: gdn_chunk_state_t64's buffers twice each
    }
    if (full) {
        run_delta<128>(300, 16, 32, 128, true, TOL);
        run_delta<128>(4096, 1, 4, 128, true, TOL);  // 64 chunks: does the error build up in S?
    }
    return 0;
}
