//! Seeded random weights of any shape of this architecture: the bundled demo model (tiny,
//! real vocabulary) and full-size synthetic benchmarks. Never real output; always announced.

use crate::config::{LayerKind, TextConfig};
use crate::tensor::{DType, Mat};
use crate::weights::{
    AttentionWeights, ExpertWeights, GdnWeights, LayerWeights, Mixer, ModelWeights, MoeWeights,
    MtpWeights,
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
    let expert =
        |rows: usize, rng: &mut Rng, mat: &dyn Fn(usize, usize, &mut Rng) -> Mat| ExpertWeights {
            gate: mat(rows, d, rng),
            up: mat(rows, d, rng),
            down: mat(d, rows, rng),
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
        mtp: None,
    }
}

/// Seeded random MTP head weights for `cfg` (the demo model's `--speculative mtp`, tests).
/// Its own generator, so the main weights of [`random_weights`] are unchanged. Random, so its
/// drafts are almost never accepted.
pub fn random_mtp_weights(cfg: &TextConfig, seed: u64, dtype: DType) -> MtpWeights {
    let mut rng = Rng::new(seed ^ 0x4D54_5000);
    let d = cfg.hidden_size;
    let mat = |rows: usize, cols: usize, rng: &mut Rng| {
        let std = 1.0 / (cols as f32).sqrt();
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.normal(std)).collect();
        Mat::from_f32(&v, rows, cols, dtype)
    };
    let vecn = |n: usize, std: f32, rng: &mut Rng| -> Vec<f32> {
        (0..n).map(|_| rng.normal(std)).collect()
    };
    let expert = |rows: usize, rng: &mut Rng| ExpertWeights {
        gate: mat(rows, d, rng),
        up: mat(rows, d, rng),
        down: mat(d, rows, rng),
    };
    let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
    let fc = mat(d, 2 * d, &mut rng);
    let mixer = Mixer::Attention(AttentionWeights {
        q: mat(nq * 2 * hd, d, &mut rng),
        k: mat(nkv * hd, d, &mut rng),
        v: mat(nkv * hd, d, &mut rng),
        o: mat(d, nq * hd, &mut rng),
        q_norm: vecn(hd, 0.1, &mut rng),
        k_norm: vecn(hd, 0.1, &mut rng),
    });
    let experts = (0..cfg.num_experts)
        .map(|_| expert(cfg.moe_intermediate, &mut rng))
        .collect();
    let shared = expert(cfg.shared_intermediate, &mut rng);
    let router = {
        let v: Vec<f32> = (0..cfg.num_experts * d).map(|_| rng.normal(0.1)).collect();
        Mat::from_f32(&v, cfg.num_experts, d, dtype)
    };
    MtpWeights {
        pre_fc_norm_embedding: vecn(d, 0.1, &mut rng),
        pre_fc_norm_hidden: vecn(d, 0.1, &mut rng),
        fc,
        layer: LayerWeights {
            input_norm: vecn(d, 0.1, &mut rng),
            post_attention_norm: vecn(d, 0.1, &mut rng),
            mixer,
            moe: MoeWeights {
                router,
                experts,
                shared,
                shared_gate: vecn(d, 1.0 / (d as f32).sqrt(), &mut rng),
            },
        },
        norm: vecn(d, 0.1, &mut rng),
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
        // the model's head dims (the GPU kernels are compiled for them)
        head_dim: 256,
        rotary_dim: 64,
        rope_theta: 10_000_000.0,
        gdn_num_key_heads: 2,
        gdn_num_value_heads: 4,
        gdn_key_dim: 128,
        gdn_value_dim: 128,
        conv_kernel: 4,
        num_experts: 8,
        experts_per_token: 2,
        moe_intermediate: 32,
        shared_intermediate: 32,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 262_144,
        eos_token_ids: vec![248_046, 248_044],
        mtp_layers: 0,
        quantization: None,
        affine: None,
    }
}

pub const DEMO_SEED: u64 = 20_260_901;

/// Tensor naming used by [`write_checkpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `model.language_model.*`, fused 3-D experts, wrapper config (the official release).
    Official,
    /// `model.*`, one tensor per expert matrix, flat text config.
    PerExpert,
}

/// The flat `qwen3_5_moe_text` config.json of `cfg`.
pub fn config_json(cfg: &TextConfig) -> serde_json::Value {
    let layer_types: Vec<&str> = cfg
        .layer_kinds
        .iter()
        .map(|k| match k {
            LayerKind::Gdn => "linear_attention",
            LayerKind::Attention => "full_attention",
        })
        .collect();
    serde_json::json!({
        "model_type": "qwen3_5_moe_text",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "layer_types": layer_types,
        "full_attention_interval": 4,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "linear_num_key_heads": cfg.gdn_num_key_heads,
        "linear_num_value_heads": cfg.gdn_num_value_heads,
        "linear_key_head_dim": cfg.gdn_key_dim,
        "linear_value_head_dim": cfg.gdn_value_dim,
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate,
        "shared_expert_intermediate_size": cfg.shared_intermediate,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "eos_token_id": cfg.eos_token_ids,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rotary_dim as f64 / cfg.head_dim as f64,
        },
    })
}

/// Writes `weights` as a safetensors checkpoint (config.json included) in `dir`, split over
/// `shards` files with an index when `shards > 1`. Used by tests and full-size checks.
pub fn write_checkpoint(
    dir: &std::path::Path,
    cfg: &TextConfig,
    weights: &ModelWeights,
    layout: Layout,
    shards: usize,
) -> anyhow::Result<()> {
    use crate::tensor::encode_f32;
    std::fs::create_dir_all(dir)?;
    let prefix = match layout {
        Layout::Official => "model.language_model.",
        Layout::PerExpert => "model.",
    };
    // (name, dtype, shape, bytes)
    let mut tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    fn add_mat(
        tensors: &mut Vec<(String, DType, Vec<usize>, Vec<u8>)>,
        name: String,
        m: &Mat,
        shape: Vec<usize>,
    ) {
        assert!(
            m.affine.is_none(),
            "the synthetic writer writes bf16/f32/FP8 checkpoints, not affine ones"
        );
        if let Some(s) = &m.scales {
            // FP8: `<name minus .weight>.weight_scale_inv` [ceil(rows/b), ceil(cols/b)], f32.
            assert_eq!(s.row0, 0, "write whole FP8 tensors, not views");
            let base = name
                .strip_suffix(".weight")
                .expect("FP8 tensors end in .weight");
            tensors.push((
                format!("{base}.weight_scale_inv"),
                DType::F32,
                vec![s.grid_rows, s.grid_cols],
                crate::tensor::encode_f32(&s.values, DType::F32),
            ));
        }
        tensors.push((name, m.dtype, shape, m.bytes().to_vec()));
    }
    let mut vecs: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    add_mat(
        &mut tensors,
        format!("{prefix}embed_tokens.weight"),
        &weights.embed,
        vec![weights.embed.rows, weights.embed.cols],
    );
    add_mat(
        &mut tensors,
        "lm_head.weight".into(),
        &weights.lm_head,
        vec![weights.lm_head.rows, weights.lm_head.cols],
    );
    vecs.push((
        format!("{prefix}norm.weight"),
        vec![cfg.hidden_size],
        weights.final_norm.clone(),
    ));
    let shape = |m: &Mat| vec![m.rows, m.cols];
    for (i, l) in weights.layers.iter().enumerate() {
        let p = format!("{prefix}layers.{i}.");
        vecs.push((
            format!("{p}input_layernorm.weight"),
            vec![cfg.hidden_size],
            l.input_norm.clone(),
        ));
        vecs.push((
            format!("{p}post_attention_layernorm.weight"),
            vec![cfg.hidden_size],
            l.post_attention_norm.clone(),
        ));
        match &l.mixer {
            Mixer::Gdn(g) => {
                let a = format!("{p}linear_attn.");
                add_mat(
                    &mut tensors,
                    format!("{a}in_proj_qkv.weight"),
                    &g.in_qkv,
                    shape(&g.in_qkv),
                );
                add_mat(
                    &mut tensors,
                    format!("{a}in_proj_z.weight"),
                    &g.in_z,
                    shape(&g.in_z),
                );
                add_mat(
                    &mut tensors,
                    format!("{a}in_proj_b.weight"),
                    &g.in_b,
                    shape(&g.in_b),
                );
                add_mat(
                    &mut tensors,
                    format!("{a}in_proj_a.weight"),
                    &g.in_a,
                    shape(&g.in_a),
                );
                add_mat(
                    &mut tensors,
                    format!("{a}out_proj.weight"),
                    &g.out,
                    shape(&g.out),
                );
                let ch = cfg.gdn_conv_channels();
                vecs.push((
                    format!("{a}conv1d.weight"),
                    vec![ch, 1, cfg.conv_kernel],
                    g.conv.clone(),
                ));
                vecs.push((format!("{a}A_log"), vec![g.a_log.len()], g.a_log.clone()));
                vecs.push((
                    format!("{a}dt_bias"),
                    vec![g.dt_bias.len()],
                    g.dt_bias.clone(),
                ));
                vecs.push((
                    format!("{a}norm.weight"),
                    vec![g.norm.len()],
                    g.norm.clone(),
                ));
            }
            Mixer::Attention(w) => {
                let a = format!("{p}self_attn.");
                add_mat(&mut tensors, format!("{a}q_proj.weight"), &w.q, shape(&w.q));
                add_mat(&mut tensors, format!("{a}k_proj.weight"), &w.k, shape(&w.k));
                add_mat(&mut tensors, format!("{a}v_proj.weight"), &w.v, shape(&w.v));
                add_mat(&mut tensors, format!("{a}o_proj.weight"), &w.o, shape(&w.o));
                vecs.push((
                    format!("{a}q_norm.weight"),
                    vec![w.q_norm.len()],
                    w.q_norm.clone(),
                ));
                vecs.push((
                    format!("{a}k_norm.weight"),
                    vec![w.k_norm.len()],
                    w.k_norm.clone(),
                ));
            }
        }
        let m = format!("{p}mlp.");
        add_mat(
            &mut tensors,
            format!("{m}gate.weight"),
            &l.moe.router,
            shape(&l.moe.router),
        );
        // The FP8 release stores experts per expert (under the official prefix).
        let fp8_experts = l.moe.experts[0].gate.dtype == DType::F8E4M3;
        match layout {
            Layout::Official if !fp8_experts => {
                let (mut gu, mut dn) = (Vec::new(), Vec::new());
                for e in &l.moe.experts {
                    gu.extend_from_slice(e.gate.bytes());
                    gu.extend_from_slice(e.up.bytes());
                    dn.extend_from_slice(e.down.bytes());
                }
                let (ne, i, d) = (cfg.num_experts, cfg.moe_intermediate, cfg.hidden_size);
                let dt = l.moe.experts[0].gate.dtype;
                tensors.push((
                    format!("{m}experts.gate_up_proj"),
                    dt,
                    vec![ne, 2 * i, d],
                    gu,
                ));
                tensors.push((format!("{m}experts.down_proj"), dt, vec![ne, d, i], dn));
            }
            _ => {
                for (x, e) in l.moe.experts.iter().enumerate() {
                    add_mat(
                        &mut tensors,
                        format!("{m}experts.{x}.gate_proj.weight"),
                        &e.gate,
                        shape(&e.gate),
                    );
                    add_mat(
                        &mut tensors,
                        format!("{m}experts.{x}.up_proj.weight"),
                        &e.up,
                        shape(&e.up),
                    );
                    add_mat(
                        &mut tensors,
                        format!("{m}experts.{x}.down_proj.weight"),
                        &e.down,
                        shape(&e.down),
                    );
                }
            }
        }
        let s = &l.moe.shared;
        add_mat(
            &mut tensors,
            format!("{m}shared_expert.gate_proj.weight"),
            &s.gate,
            shape(&s.gate),
        );
        add_mat(
            &mut tensors,
            format!("{m}shared_expert.up_proj.weight"),
            &s.up,
            shape(&s.up),
        );
        add_mat(
            &mut tensors,
            format!("{m}shared_expert.down_proj.weight"),
            &s.down,
            shape(&s.down),
        );
        vecs.push((
            format!("{m}shared_expert_gate.weight"),
            vec![1, cfg.hidden_size],
            l.moe.shared_gate.clone(),
        ));
    }
    // Small vectors are stored in f32 (their dtype is read from the header on load).
    for (name, shape, v) in vecs {
        tensors.push((name, DType::F32, shape, encode_f32(&v, DType::F32)));
    }

    let st_dtype = |d: DType| match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
        DType::U4 | DType::U8 => unreachable!("affine matrices are refused by add_mat"),
    };
    let shards = shards.max(1);
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (s, group) in tensors.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards)
        };
        let views: Vec<(String, safetensors::tensor::TensorView)> = group
            .iter()
            .map(|(n, dt, shape, bytes)| {
                total += bytes.len();
                weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
                let view =
                    safetensors::tensor::TensorView::new(st_dtype(*dt), shape.clone(), bytes)
                        .expect("shape and bytes agree");
                (n.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file))?;
    }
    if shards > 1 {
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    let text = config_json(cfg);
    let mut config = match layout {
        Layout::PerExpert => text,
        Layout::Official => serde_json::json!({
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": false,
            "text_config": text,
        }),
    };
    if let Some(q) = &cfg.quantization {
        // Top level, where transformers (and the release) keep it.
        config["quantization_config"] = serde_json::json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": q.block,
            "modules_to_not_convert": q.modules_to_not_convert,
        });
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    Ok(())
}
