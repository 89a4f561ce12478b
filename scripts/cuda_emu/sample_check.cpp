// Runs sample.cu's draw (sample_penalize, sample_stats, sample_pick) on the CPU emulator
// (through run.sh) against a C++ transcription of the CPU sampler (src/sampling.rs `draw`,
// `logprobs`): every row of a batch has its own settings and uniform, and the device id must
// be the reference's (top-k, top-k + top-p, top-p alone, min-p, plain sampling in id order,
// greedy, penalties, ties, NaN, a vocabulary limit); rows whose candidates cannot decide must
// be flagged for the host; log-sum-exp and top log-probabilities within 1e-4. Then
// sample_mask (structured outputs): rows with a bitmask of 1, 3, 40 or thousands of allowed
// ids (and a row without one) draw the reference's id from the masked logits, always an
// allowed one, for every filter.
#include "kernels_emu.inc"
#include <cstdio>
#include <map>
#include <random>

static std::mt19937_64 rng(37);
static double uni01() { return std::uniform_real_distribution<double>(0, 1)(rng); }

struct Params {
    float temp = 1, top_p = 1, min_p = 0, rep = 1, pres = 0, freq = 0;
    int top_k = 0, limit = 0;
};

static bool before(std::pair<int, float> a, std::pair<int, float> b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
}

// The CPU sampler's draw (sampling.rs), transcribed.
static int ref_draw(const Params& p, const std::vector<float>& logits, const std::vector<int>& hist, double u) {
    const int n = std::min<int>(p.limit, logits.size());
    const bool greedy = p.temp == 0 || p.top_k == 1;
    const bool pens = p.rep != 1 || p.pres != 0 || p.freq != 0;
    std::vector<float> x(n);
    for (int i = 0; i < n; i++) x[i] = std::isnan(logits[i]) ? -INFINITY : logits[i];
    auto argmax = [&] {
        int best = 0;
        float bv = -INFINITY;
        for (int i = 0; i < n; i++)
            if (x[i] > bv) { bv = x[i]; best = i; }
        return best;
    };
    if (greedy && (hist.empty() || !pens)) return argmax();
    std::map<int, int> counts;
    for (int id : hist) counts[id]++;
    if (pens)
        for (auto [id, c] : counts) {
            if (id >= n) continue;
            float& l = x[id];
            if (p.rep != 1) l = l > 0 ? l / p.rep : l * p.rep;
            l -= p.pres + p.freq * (float)c;
        }
    if (greedy) return argmax();
    const float t = std::max(p.temp, 1.17549435e-38f);
    if (t != 1) for (auto& v : x) v /= t;
    float mx = -INFINITY;
    for (float v : x) mx = std::max(mx, v);
    if (mx == -INFINITY) return argmax();
    std::vector<std::pair<int, float>> c;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) c.push_back({i, x[i]});
    std::sort(c.begin(), c.end(), before);
    double total = 0;
    if (p.top_k > 0 && p.top_k < n) {
        if ((int)c.size() > p.top_k) c.resize(p.top_k);
        for (auto& e : c) total += std::exp((double)e.second - (double)c[0].second);
    } else if (p.top_p >= 1 && p.min_p <= 0) {
        double tot = 0;
        std::vector<float> w(n);
        for (int i = 0; i < n; i++) { w[i] = std::exp(x[i] - mx); tot += w[i]; }
        const double uu = u * tot;
        double acc = 0;
        int last = 0;
        for (int i = 0; i < n; i++)
            if (w[i] > 0) {
                acc += w[i];
                last = i;
                if (uu < acc) return i;
            }
        return last;
    } else {
        for (auto& e : c) total += std::exp((double)e.second - (double)mx);
        if (p.min_p > 0) {
            const double thr = (double)mx + std::log((double)p.min_p);
            size_t keep = 0;
            while (keep < c.size() && (double)c[keep].second >= thr) keep++;
            c.resize(keep);
            if (p.top_p >= 1) total = 0;
        }
    }
    const double x0 = c[0].second;
    if (p.top_p < 1 && c.size() > 1) {
        const double target = (double)p.top_p * total;
        double acc = 0;
        for (size_t j = 0; j < c.size(); j++) {
            acc += std::exp((double)c[j].second - x0);
            if (acc >= target) { c.resize(j + 1); break; }
        }
    }
    if (p.min_p > 0) {
        const double thr = x0 + std::log((double)p.min_p);
        size_t keep = 0;
        while (keep < c.size() && !((double)c[keep].second < thr)) keep++;
        c.resize(std::max<size_t>(keep, 1));
    }
    double sum = 0, acc = 0;
    for (auto& e : c) sum += std::exp((double)e.second - x0);
    for (auto& e : c) {
        acc += std::exp((double)e.second - x0) / sum;
        if (u < acc) return e.first;
    }
    return c.back().first;
}

struct Case {
    const char* name;
    Params p;
    bool penalties;
    bool expect_flag;  // the candidates cannot decide: the host draws
};

int main() {
    int fails = 0;
    const int V = 20000, LD = 20480, ROWS = 12;
    Params base;
    base.limit = V;
    auto with = [&](auto f) { Params p = base; f(p); return p; };
    std::vector<Case> cases = {
        {"top-k 20, top-p 0.95, t 0.7", with([](Params& p) { p.top_k = 20; p.top_p = 0.95f; p.temp = 0.7f; }), false, false},
        {"top-k 64", with([](Params& p) { p.top_k = 64; }), false, false},
        {"top-k 65 (past the candidates)", with([](Params& p) { p.top_k = 65; }), false, true},
        {"top-p 0.9, peaked", with([](Params& p) { p.top_p = 0.9f; p.temp = 0.25f; }), false, false},
        {"top-p 0.9, flat (past the candidates)", with([](Params& p) { p.top_p = 0.9f; p.temp = 4.0f; }), false, true},
        {"min-p 0.2, peaked", with([](Params& p) { p.min_p = 0.2f; p.temp = 0.3f; }), false, false},
        {"min-p + top-p", with([](Params& p) { p.min_p = 0.05f; p.top_p = 0.8f; p.temp = 0.3f; }), false, false},
        {"plain, t 1 (id order)", base, false, false},
        {"plain, t 0.5, limit 17000", with([](Params& p) { p.temp = 0.5f; p.limit = 17000; }), false, false},
        {"greedy", with([](Params& p) { p.temp = 0; }), false, false},
        {"greedy + penalties", with([](Params& p) { p.temp = 0; p.rep = 1.3f; p.pres = 0.5f; p.freq = 0.2f; }), true, false},
        {"top-k 40 + penalties", with([](Params& p) { p.top_k = 40; p.rep = 1.2f; p.pres = 0.4f; p.freq = 0.3f; p.temp = 0.8f; }), true, false},
        {"plain + penalties", with([](Params& p) { p.freq = 1.5f; }), true, false},
    };
    for (int variant = 0; variant < 2; variant++) {
        // variant 1: logits on a coarse grid (many ties at every threshold) with NaNs
        for (const Case& cs : cases) {
            std::vector<float> logits((size_t)ROWS * LD, -123.0f);
            std::normal_distribution<float> nd(0, 2);
            for (int r = 0; r < ROWS; r++)
                for (int i = 0; i < V; i++) {
                    float v = nd(rng);
                    if (i % 997 == 5) v += 9;  // a few likely ids spread over the chunks
                    if (variant) v = std::round(v * 2) / 2;
                    if (variant && i % 1500 == 7) v = NAN;
                    logits[(size_t)r * LD + i] = v;
                }
            std::vector<std::vector<int>> hist(ROWS);
            std::vector<int> pen;
            std::vector<unsigned> params((size_t)ROWS * SAMPLE_PW, 0);
            std::vector<double> us(ROWS);
            const int nlp = 5;
            for (int r = 0; r < ROWS; r++) {
                if (cs.penalties)
                    for (int j = 0; j < 30; j++) {
                        // likely ids and random ones, some repeated, one past the limit
                        int id = j % 3 == 0 ? (5 + 997 * (j % 7)) : (int)(uni01() * V);
                        if (j == 29) id = V + 3;
                        hist[r].push_back(id);
                        if (j % 4 == 0) hist[r].push_back(id);
                    }
                std::map<int, int> counts;
                for (int id : hist[r]) counts[id]++;
                const int off = (int)pen.size() / 2;
                if (cs.penalties)
                    for (auto [id, c] : counts) { pen.push_back(id); pen.push_back(c); }
                unsigned* w = &params[(size_t)r * SAMPLE_PW];
                const Params& p = cs.p;
                w[SP_TEMP] = __float_as_uint(p.temp);
                w[SP_TOPK] = p.top_k;
                w[SP_TOPP] = __float_as_uint(p.top_p);
                w[SP_MINP] = __float_as_uint(p.min_p);
                w[SP_REP] = __float_as_uint(p.rep);
                w[SP_PRES] = __float_as_uint(p.pres);
                w[SP_FREQ] = __float_as_uint(p.freq);
                w[SP_LIMIT] = p.limit;
                w[SP_PEN_OFF] = off;
                w[SP_PEN_LEN] = cs.penalties ? (unsigned)counts.size() : 0;
                w[SP_NLP] = nlp;
                us[r] = uni01();
                unsigned long long ub;
                memcpy(&ub, &us[r], 8);
                w[SP_U_LO] = (unsigned)ub;
                w[SP_U_HI] = (unsigned)(ub >> 32);
            }
            const std::vector<float> raw = logits;
            const int chunks = (std::max(cs.p.limit, 1) + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
            std::vector<float> stats((size_t)ROWS * chunks * 4), cand_v((size_t)ROWS * chunks * SAMPLE_K);
            std::vector<int> cand_id(cand_v.size());
            std::vector<float> saved(std::max<size_t>(pen.size() / 2, 1));
            std::vector<unsigned> out((size_t)ROWS * SAMPLE_OW, 0xdeadbeef);
            auto stats_launch = [&] {
                emu_launch({(unsigned)chunks, (unsigned)ROWS, 1}, 1024, 0, [&] {
                    sample_stats(logits.data(), LD, params.data(), stats.data(), cand_id.data(), cand_v.data());
                });
            };
            auto pick_launch = [&](int phase) {
                emu_launch({(unsigned)ROWS, 1, 1}, 1024, 0, [&] {
                    sample_pick(logits.data(), LD, params.data(), chunks, stats.data(), cand_id.data(), cand_v.data(),
                                pen.data(), saved.data(), phase, out.data());
                });
            };
            stats_launch();
            if (!cs.penalties) {
                pick_launch(SAMPLE_RAW | SAMPLE_DRAW);
            } else {
                pick_launch(SAMPLE_RAW);
                emu_launch({(unsigned)ROWS, 1, 1}, 256, 0,
                           [&] { sample_penalize(logits.data(), LD, params.data(), pen.data(), saved.data()); });
                stats_launch();
                pick_launch(SAMPLE_DRAW | SAMPLE_PENALIZED);
            }
            int same = 0, flagged = 0, lp_bad = 0;
            for (int r = 0; r < ROWS; r++) {
                std::vector<float> row(raw.begin() + (size_t)r * LD, raw.begin() + (size_t)r * LD + V);
                const unsigned* o = &out[(size_t)r * SAMPLE_OW];
                flagged += o[SO_FLAG] != 0;
                if (o[SO_FLAG]) continue;
                const int want = ref_draw(cs.p, row, hist[r], us[r]);
                same += (int)o[SO_ID] == want;
                if ((int)o[SO_ID] != want)
                    printf("     row %d: id %u, reference %d (u %.6f)\n", r, o[SO_ID], want, us[r]);
                // log-probabilities of the raw logits over the limit
                const int n = cs.p.limit;
                double m = -INFINITY, s = 0;
                for (int i = 0; i < n; i++)
                    if (!std::isnan(row[i])) m = std::max(m, (double)row[i]);
                for (int i = 0; i < n; i++)
                    if (!std::isnan(row[i])) s += std::exp(row[i] - m);
                const double lse = m + std::log(s);
                std::vector<std::pair<int, float>> c;
                for (int i = 0; i < n; i++)
                    if (!std::isnan(row[i])) c.push_back({i, row[i]});
                std::partial_sort(c.begin(), c.begin() + nlp, c.end(), before);
                bool ok = std::fabs(__uint_as_float(o[SO_LSE]) - lse) <= 1e-4 * (1 + std::fabs(lse)) &&
                          (int)o[SO_NTOP] == nlp;
                for (int j = 0; j < nlp && ok; j++)
                    ok = (int)o[SO_TOP + 2 * j] == c[j].first &&
                         std::fabs(__uint_as_float(o[SO_TOP + 2 * j + 1]) - (c[j].second - lse)) <= 1e-4;
                const double id_lp = row[o[SO_ID]] - lse;
                ok = ok && std::fabs(__uint_as_float(o[SO_LP]) - id_lp) <= 1e-4 * (1 + std::fabs(id_lp));
                lp_bad += !ok;
            }
            const bool ok = cs.expect_flag ? flagged == ROWS : (flagged == 0 && same == ROWS && lp_bad == 0);
            printf("%s %-40s %s: %d/%d ids the reference's, %d flagged for the host, logprobs %s\n",
                   ok ? "ok  " : "FAIL", cs.name, variant ? "ties+NaN" : "normal  ", same, ROWS - flagged, flagged,
                   lp_bad ? "WRONG" : "ok");
            fails += !ok;
        }
    }
    // Many draws of one row (one batch, a uniform a row): the frequencies follow the
    // reference's probabilities (every id the reference's, so the distribution is too).
    {
        const int v = 300, rows = 400;
        std::vector<float> logits((size_t)rows * v);
        std::vector<float> one(v);
        for (int i = 0; i < v; i++) one[i] = (float)(std::normal_distribution<double>(0, 1.5)(rng));
        for (int r = 0; r < rows; r++) std::copy(one.begin(), one.end(), logits.begin() + (size_t)r * v);
        Params p;
        p.limit = v;
        p.top_k = 30;
        p.top_p = 0.9f;
        p.temp = 0.8f;
        std::vector<unsigned> params((size_t)rows * SAMPLE_PW, 0);
        std::vector<double> us(rows);
        for (int r = 0; r < rows; r++) {
            unsigned* w = &params[(size_t)r * SAMPLE_PW];
            w[SP_TEMP] = __float_as_uint(p.temp);
            w[SP_TOPK] = p.top_k;
            w[SP_TOPP] = __float_as_uint(p.top_p);
            w[SP_REP] = __float_as_uint(1.0f);
            w[SP_LIMIT] = v;
            w[SP_NLP] = (unsigned)-1;
            us[r] = (r + 0.5) / rows;  // stratified uniforms
            unsigned long long ub;
            memcpy(&ub, &us[r], 8);
            w[SP_U_LO] = (unsigned)ub;
            w[SP_U_HI] = (unsigned)(ub >> 32);
        }
        std::vector<float> stats((size_t)rows * 4), cand_v((size_t)rows * SAMPLE_K), saved(1);
        std::vector<int> cand_id(cand_v.size()), pen(2);
        std::vector<unsigned> out((size_t)rows * SAMPLE_OW);
        emu_launch({1, (unsigned)rows, 1}, 1024, 0, [&] {
            sample_stats(logits.data(), v, params.data(), stats.data(), cand_id.data(), cand_v.data());
        });
        emu_launch({(unsigned)rows, 1, 1}, 1024, 0, [&] {
            sample_pick(logits.data(), v, params.data(), 1, stats.data(), cand_id.data(), cand_v.data(), pen.data(),
                        saved.data(), SAMPLE_RAW | SAMPLE_DRAW, out.data());
        });
        int same = 0;
        std::map<int, int> freq;
        for (int r = 0; r < rows; r++) {
            same += (int)out[(size_t)r * SAMPLE_OW] == ref_draw(p, one, {}, us[r]);
            freq[out[(size_t)r * SAMPLE_OW]]++;
        }
        const bool ok = same == rows && freq.size() > 3;
        printf("%s %d stratified draws of one row: %d the reference's, %zu distinct ids\n", ok ? "ok  " : "FAIL", rows,
               same, freq.size());
        fails += !ok;
    }
    // sample_mask, then the draw: the reference draws from the row with the refused ids at -inf.
    {
        const int V = 20000, LD = 20480, ROWS = 6, WORDS = (V + 31) / 32;
        const int allowed_n[ROWS] = {1, 3, 40, 5000, 12000, -1};  // -1: no mask
        Params base;
        base.limit = V;
        auto with = [&](auto f) { Params p = base; f(p); return p; };
        std::vector<std::pair<const char*, Params>> settings = {
            {"greedy", with([](Params& p) { p.temp = 0; })},
            {"top-k 20, top-p 0.95, t 0.7", with([](Params& p) { p.top_k = 20; p.top_p = 0.95f; p.temp = 0.7f; })},
            {"plain, t 1 (id order)", base},
            {"top-p 0.9, peaked", with([](Params& p) { p.top_p = 0.9f; p.temp = 0.25f; })},
            {"min-p 0.2, peaked", with([](Params& p) { p.min_p = 0.2f; p.temp = 0.3f; })},
        };
        for (auto& [name, prm] : settings) {
            std::vector<float> logits((size_t)ROWS * LD, -123.0f);
            std::normal_distribution<float> nd(0, 2);
            for (int r = 0; r < ROWS; r++)
                for (int i = 0; i < V; i++) logits[(size_t)r * LD + i] = nd(rng) + (i % 997 == 5 ? 9.0f : 0.0f);
            std::vector<unsigned> masks, params((size_t)ROWS * SAMPLE_PW, 0);
            std::vector<std::vector<bool>> allow(ROWS, std::vector<bool>(V, true));
            std::vector<double> us(ROWS);
            int nmasks = 0;
            for (int r = 0; r < ROWS; r++) {
                unsigned* w = &params[(size_t)r * SAMPLE_PW];
                w[SP_TEMP] = __float_as_uint(prm.temp);
                w[SP_TOPK] = prm.top_k;
                w[SP_TOPP] = __float_as_uint(prm.top_p);
                w[SP_MINP] = __float_as_uint(prm.min_p);
                w[SP_REP] = __float_as_uint(1.0f);
                w[SP_LIMIT] = prm.limit;
                w[SP_NLP] = (unsigned)-1;
                w[SP_MASK] = SAMPLE_NO_MASK;
                us[r] = uni01();
                unsigned long long ub;
                memcpy(&ub, &us[r], 8);
                w[SP_U_LO] = (unsigned)ub;
                w[SP_U_HI] = (unsigned)(ub >> 32);
                if (allowed_n[r] < 0) continue;
                // the allowed ids avoid the likely ones, so the mask decides
                std::vector<bool> a(V, false);
                for (int k = 0; k < allowed_n[r];) {
                    const int id = (int)(uni01() * V);
                    if (id % 997 == 5 || a[id]) continue;
                    a[id] = true;
                    k++;
                }
                std::vector<unsigned> m(WORDS, 0);
                for (int i = 0; i < V; i++)
                    if (a[i]) m[i >> 5] |= 1u << (i & 31);
                masks.insert(masks.end(), m.begin(), m.end());
                w[SP_MASK] = nmasks++;
                allow[r] = a;
            }
            const int chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
            std::vector<float> stats((size_t)ROWS * chunks * 4), cand_v((size_t)ROWS * chunks * SAMPLE_K), saved(1);
            std::vector<int> cand_id(cand_v.size()), pen(2);
            std::vector<unsigned> out((size_t)ROWS * SAMPLE_OW, 0xdeadbeef);
            const std::vector<float> raw = logits;
            emu_launch({(unsigned)chunks, (unsigned)ROWS, 1}, 256, 0,
                       [&] { sample_mask(logits.data(), LD, params.data(), masks.data(), WORDS); });
            emu_launch({(unsigned)chunks, (unsigned)ROWS, 1}, 1024, 0, [&] {
                sample_stats(logits.data(), LD, params.data(), stats.data(), cand_id.data(), cand_v.data());
            });
            emu_launch({(unsigned)ROWS, 1, 1}, 1024, 0, [&] {
                sample_pick(logits.data(), LD, params.data(), chunks, stats.data(), cand_id.data(), cand_v.data(),
                            pen.data(), saved.data(), SAMPLE_DRAW, out.data());
            });
            int same = 0, flagged = 0, refused = 0, masked_ok = 0;
            for (int r = 0; r < ROWS; r++) {
                std::vector<float> row(V);
                for (int i = 0; i < V; i++) row[i] = allow[r][i] ? raw[(size_t)r * LD + i] : -INFINITY;
                bool rows_equal = true;  // the kernel's masked row is the host's (the host draws a flagged row)
                for (int i = 0; i < V; i++) rows_equal &= logits[(size_t)r * LD + i] == row[i];
                masked_ok += rows_equal;
                const unsigned* o = &out[(size_t)r * SAMPLE_OW];
                if (o[SO_FLAG]) { flagged++; continue; }
                const int want = ref_draw(prm, row, {}, us[r]);
                same += (int)o[SO_ID] == want;
                refused += !allow[r][o[SO_ID]];
                if ((int)o[SO_ID] != want)
                    printf("     row %d (%d allowed): id %u, reference %d (u %.6f)\n", r, allowed_n[r], o[SO_ID], want,
                           us[r]);
            }
            const bool ok = same == ROWS - flagged && refused == 0 && masked_ok == ROWS && flagged <= 2;
            printf("%s masked %-31s %d/%d ids the reference's, %d refused ids, %d flagged, rows masked %s\n",
                   ok ? "ok  " : "FAIL", name, same, ROWS - flagged, refused, flagged,
                   masked_ok == ROWS ? "ok" : "WRONG");
            fails += !ok;
        }
    }
    printf("%s\n", fails ? "SOME CHECKS FAILED" : "all sample checks passed");
    return fails ? 1 : 0;
}
