// Host side of the affine 4-bit (q4 tile) checks: a random [rows, cols] matrix of codes 0..15
// with bf16 group scales and biases, packed into the device's q4 tiles by a transcription of the
// layout described in gemv.cuh (independent of src/cuda/upload.rs's packer, which the GPU tests
// check end to end), and its dequantised values for double references.
#pragma once
#include <random>
#include <vector>

struct Q4Host {
    int rows, cols, group;
    std::vector<unsigned char> q;   // [rows, cols] codes
    std::vector<float> s, b;        // [rows, cols / group], bf16-representable
    std::vector<uint4> tiles;       // the device codes
    std::vector<unsigned> sb;       // the device (scale, bias) pairs
    double w(int r, int c) const {
        const int g = r * (cols / group) + c / group;
        return (double)s[g] * q[(size_t)r * cols + c] + b[g];
    }
};

inline unsigned bf16_bits(float v) {
    bf16 h = __float2bfloat16(v);
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}

// The tiles and pairs of m's codes, scales and biases: strip st = r / 16, unit u = c / 64, lane
// l, k-step j; nibble i of the lane's u32 j is (row, column) of the fragment: with g = l / 4,
// c0 = 2 (l % 4): (g, c0), (g+8, c0), (g, c0+8), (g+8, c0+8), (g, c0+1), (g+8, c0+1), (g, c0+9),
// (g+8, c0+9) within the 16 x 16 k-step.
inline void pack_q4(Q4Host& m) {
    const int rows = m.rows, cols = m.cols, G = cols / m.group, U = cols / 64;
    m.tiles.assign((size_t)rows / 16 * U * 32, make_uint4(0, 0, 0, 0));
    for (int st = 0; st < rows / 16; st++)
        for (int un = 0; un < U; un++)
            for (int l = 0; l < 32; l++) {
                const int g = l / 4, c0 = 2 * (l % 4);
                const int pos[8][2] = {{g, c0}, {g + 8, c0}, {g, c0 + 8}, {g + 8, c0 + 8},
                                       {g, c0 + 1}, {g + 8, c0 + 1}, {g, c0 + 9}, {g + 8, c0 + 9}};
                unsigned words[4];
                for (int j = 0; j < 4; j++) {
                    unsigned wv = 0;
                    for (int i = 0; i < 8; i++) {
                        const int r = st * 16 + pos[i][0], c = un * 64 + 16 * j + pos[i][1];
                        wv |= (unsigned)m.q[(size_t)r * cols + c] << (4 * i);
                    }
                    words[j] = wv;
                }
                m.tiles[((size_t)st * U + un) * 32 + l] = make_uint4(words[0], words[1], words[2], words[3]);
            }
    m.sb.assign((size_t)rows * G, 0);
    for (int st = 0; st < rows / 16; st++)
        for (int gi = 0; gi < G; gi++)
            for (int r = 0; r < 16; r++) {
                const size_t i = (size_t)(st * 16 + r) * G + gi;
                m.sb[((size_t)st * G + gi) * 16 + r] = bf16_bits(m.s[i]) | (bf16_bits(m.b[i]) << 16);
            }
}

// Random codes, scales in [0.5, 2] * scale_mag and biases of about -7.5 scales (zero-centred
// weights, as the quantisers produce), packed by pack_q4.
inline Q4Host make_q4(int rows, int cols, int group, std::mt19937_64& rng, float scale_mag = 0.02f) {
    Q4Host m{rows, cols, group, {}, {}, {}, {}, {}};
    std::uniform_real_distribution<float> u01(0.0f, 1.0f);
    m.q.resize((size_t)rows * cols);
    for (auto& v : m.q) v = (unsigned char)(rng() & 15);
    const int G = cols / group;
    m.s.resize((size_t)rows * G);
    m.b.resize((size_t)rows * G);
    for (size_t i = 0; i < m.s.size(); i++) {
        m.s[i] = __bfloat162float(__float2bfloat16(scale_mag * (0.5f + 1.5f * u01(rng))));
        m.b[i] = __bfloat162float(__float2bfloat16(-m.s[i] * (7.5f + (u01(rng) - 0.5f))));
    }
    pack_q4(m);
    return m;
}
