//! Seeded random weights of any shape of this architecture: the bundled demo model (tiny,
//! real vocabulary) and full-size synthetic benchmarks. Never real output; always announced.

use crate::config::{LayerKind, TextConfig};
use crate::tensor::{DType, Mat};
use crate::weights::{
    AttentionWeights, ExpertWeights, GdnWeights, LayerWeights, Mixer, ModelWeights, MoeWeights,
};

/// SplitMix64: tiny, fast, reproducible on every platform.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Approximately normal(0, std): the sum of four uniforms, rescaled (cheap, bounded).
    pub fn normal(&mut self, std: f32) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0;
        s * std * 1.732_050_8 // var of the sum of 4 U(0,1) is 1/3
    }
}

/// Builds seeded random weights for `cfg` stored as `dtype`.
pub fn random_weights(cfg: &TextConfig, seed: u64, dtype: DType) -> ModelWeights {
    let mut rng = Rng::new(seed);
    let d = cfg.hidden_size;
    // Scales chosen so activations neither vanish nor explode through the layers.
    let mat = |rows: usize, cols: usize, rng: &mut Rng| {
        let std = 1.0 / (cols as f32).sqrt();
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.normal(std)).collect();
        Mat::from_f32(&v, rows, cols, dtype)
    };
    let vecn = |n: usize, mean: f32, std: f32, rng: &mut Rng| -> Vec<f32> {
        (0..n).map(|_| mean + rng.normal(std)).collect()
    };
    let expert = |rows: usize, rng: &mut Rng, mat: &dyn Fn(usize, usize, &mut Rng) -> Mat| {
        ExpertWeights {
            gate: mat(rows, d, rng),
            up: mat(rows, d, rng),
            down: mat(d, rows, rng),
        }
    };
    let embed = {
        let v: Vec<f32> = (0..cfg.vocab_size * d).map(|_| rng.normal(1.0)).collect();
        Mat::from_f32(&v, cfg.vocab_size, d, dtype)
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for kind in &cfg.layer_kinds {
        let mixer = match kind {
            LayerKind::Gdn => {
                let hv = cfg.gdn_num_value_heads;
                let ch = cfg.gdn_conv_channels();
                Mixer::Gdn(GdnWeights {
                    in_qkv: mat(ch, d, &mut rng),
                    in_z: mat(cfg.gdn_v_width(), d, &mut rng),
                    in_b: mat(hv, d, &mut rng),
                    in_a: mat(hv, d, &mut rng),
                    conv: vecn(ch * cfg.conv_kernel, 0.0, 0.5, &mut rng),
                    a_log: (0..hv).map(|_| (1.0 + 15.0 * rng.uniform()).ln()).collect(),
                    dt_bias: vecn(hv, 0.0, 0.5, &mut rng),
                    norm: vecn(cfg.gdn_value_dim, 1.0, 0.1, &mut rng),
                    out: mat(d, cfg.gdn_v_width(), &mut rng),
                })
            }
            LayerKind::Attention => {
                let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
                Mixer::Attention(AttentionWeights {
                    q: mat(nq * 2 * hd, d, &mut rng),
                    k: mat(nkv * hd, d, &mut rng),
                    v: mat(nkv * hd, d, &mut rng),
                    o: mat(d, nq * hd, &mut rng),
                    q_norm: vecn(hd, 0.0, 0.1, &mut rng),
                    k_norm: vecn(hd, 0.0, 0.1, &mut rng),
                })
            }
        };
        let experts = (0..cfg.num_experts)
            .map(|_| expert(cfg.moe_intermediate, &mut rng, &mat))
            .collect();
        let shared = expert(cfg.shared_intermediate, &mut rng, &mat);
        layers.push(LayerWeights {
            input_norm: vecn(d, 0.0, 0.1, &mut rng),
            post_attention_norm: vecn(d, 0.0, 0.1, &mut rng),
            mixer,
            moe: MoeWeights {
                // A stronger router spreads tokens over the experts.
                router: {
                    let v: Vec<f32> = (0..cfg.num_experts * d).map(|_| rng.normal(0.1)).collect();
                    Mat::from_f32(&v, cfg.num_experts, d, dtype)
                },
                experts,
                shared,
                shared_gate: vecn(d, 0.0, 1.0 / (d as f32).sqrt(), &mut rng),
            },
        });
    }
    let final_norm = vecn(d, 0.0, 0.1, &mut rng);
    let lm_head = mat(cfg.vocab_size, d, &mut rng);
    ModelWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    }
}

/// The bundled demo model: this architecture at toy size with the real 248,320-row vocabulary,
/// so it runs end to end with the real tokenizer (its output is random text).
pub fn demo_config() -> TextConfig {
    TextConfig {
        hidden_size: 64,
        num_layers: 4,
        vocab_size: 248_320,
        layer_kinds: vec![
            LayerKind::Gdn,
            LayerKind::Gdn,
            LayerKind::Gdn,
            LayerKind::Attention,
        ],
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        rotary_dim: 8,
        rope_theta: 10_000_000.0,
        gdn_num_key_heads: 2,
        gdn_num_value_heads: 4,
        gdn_key_dim: 16,
        gdn_value_dim: 16,
        conv_kernel: 4,
        num_experts: 8,
        experts_per_token: 2,
        moe_intermediate: 32,
        shared_intermediate: 32,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 262_144,
        eos_token_ids: vec![248_046, 248_044],
        mtp_layers: 0,
    }
}

pub const DEMO_SEED: u64 = 20_260_901;
