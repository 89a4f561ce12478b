//! Checkpoint loading: every accepted layout gives the same model, and every kind of bad
//! input gives a clear error naming the file and tensor (never a panic).

use kestrel::config::{LayerKind, TextConfig};
use kestrel::model::{CpuModel, Engine, Logits};
use kestrel::synthetic::{Layout, random_weights, write_checkpoint};
use kestrel::tensor::DType;
use std::path::{Path, PathBuf};

fn tiny_config() -> TextConfig {
    TextConfig {
        hidden_size: 32,
        num_layers: 4,
        vocab_size: 100,
        layer_kinds: vec![
            LayerKind::Gdn,
            LayerKind::Gdn,
            LayerKind::Gdn,
            LayerKind::Attention,
        ],
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rotary_dim: 4,
        rope_theta: 1e7,
        gdn_num_key_heads: 2,
        gdn_num_value_heads: 4,
        gdn_key_dim: 8,
        gdn_value_dim: 8,
        conv_kernel: 4,
        num_experts: 4,
        experts_per_token: 2,
        moe_intermediate: 16,
        shared_intermediate: 16,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 4096,
        eos_token_ids: vec![1],
        mtp_layers: 0,
        quantization: None,
        affine: None,
    }
}

fn write(layout: Layout, dtype: DType, shards: usize) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let w = random_weights(&cfg, 5, dtype);
    write_checkpoint(dir.path(), &cfg, &w, layout, shards).unwrap();
    let p = dir.path().to_path_buf();
    (dir, p)
}

fn load_err(dir: &Path) -> String {
    match CpuModel::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// Rewrites a safetensors header in place, keeping the data section.
fn edit_header(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut header);
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

fn shard(dir: &Path, i: usize, of: usize) -> PathBuf {
    dir.join(format!("model-{i:05}-of-{of:05}.safetensors"))
}

/// The shard holding `name`, according to the index.
fn shard_of(dir: &Path, name: &str) -> PathBuf {
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    dir.join(idx["weight_map"][name].as_str().unwrap())
}

#[test]
fn all_layouts_and_dtypes_load_to_the_same_model() {
    let cfg = tiny_config();
    let tokens = [3u32, 14, 15, 92, 65, 35];
    let reference = {
        let m = CpuModel::new(cfg.clone(), random_weights(&cfg, 5, DType::BF16));
        m.forward(&mut m.new_state().unwrap(), &tokens, Logits::All)
            .unwrap()
    };
    for (layout, shards) in [
        (Layout::Official, 3),
        (Layout::PerExpert, 1),
        (Layout::PerExpert, 2),
    ] {
        let (_t, dir) = write(layout, DType::BF16, shards);
        let m = CpuModel::load(&dir).unwrap();
        assert_eq!(m.config, cfg, "{layout:?}");
        let got = m
            .forward(&mut m.new_state().unwrap(), &tokens, Logits::All)
            .unwrap();
        assert_eq!(got, reference, "{layout:?} with {shards} shards");
    }
    // f32 and f16 storage load too (different rounding, so just finite, same shape).
    for dt in [DType::F32, DType::F16] {
        let (_t, dir) = write(Layout::PerExpert, dt, 1);
        let m = CpuModel::load(&dir).unwrap();
        let got = m
            .forward(&mut m.new_state().unwrap(), &tokens, Logits::Last)
            .unwrap();
        assert_eq!(got.len(), cfg.vocab_size);
        assert!(got.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn vision_tensors_are_skipped_and_mtp_kept() {
    let (_t, dir) = write(Layout::Official, DType::BF16, 1);
    let extra = dir.join("extra.safetensors");
    let data = vec![0u8; 16];
    let views = vec![
        (
            "model.visual.blocks.0.attn.qkv.weight".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &data)
                .unwrap(),
        ),
        (
            "mtp.fc.weight".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &data)
                .unwrap(),
        ),
    ];
    // Without an index and with model.safetensors present, only model.safetensors is read;
    // move it so the directory scan picks up both files.
    std::fs::rename(
        dir.join("model.safetensors"),
        dir.join("model-a.safetensors"),
    )
    .unwrap();
    safetensors::serialize_to_file(views, None, &extra).unwrap();
    let ck = kestrel::weights::Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.skipped_vision, 1);
    assert_eq!(ck.mtp, vec!["mtp.fc.weight".to_string()]);
    CpuModel::load(&dir).unwrap();
}

#[test]
fn missing_config_is_named() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn missing_directory_is_named() {
    let e = load_err(Path::new("/nonexistent/kestrel-model"));
    assert!(e.contains("/nonexistent/kestrel-model"), "{e}");
}

#[test]
fn missing_shard_named_by_the_index() {
    let (_t, dir) = write(Layout::Official, DType::BF16, 3);
    std::fs::remove_file(shard(&dir, 2, 3)).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model-00002-of-00003.safetensors") && e.contains("does not exist"),
        "{e}"
    );
}

#[test]
fn truncated_file() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    let p = dir.join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 100).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // Shorter than the 8-byte length prefix.
    f.set_len(5).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("too short"),
        "{e}"
    );
}

#[test]
fn invalid_header_json() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    let p = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = b'#';
    std::fs::write(&p, bytes).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors") && e.contains("JSON"), "{e}");
}

#[test]
fn tensor_bytes_out_of_range() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    let p = dir.join("model.safetensors");
    edit_header(&p, |h| {
        h["lm_head.weight"]["data_offsets"][1] = serde_json::json!(1u64 << 40);
    });
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(e.contains("lm_head.weight") || e.contains("shape"), "{e}");
}

#[test]
fn missing_tensor() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    edit_header(&dir.join("model.safetensors"), |h| {
        let o = h.as_object_mut().unwrap();
        let v = o
            .remove("model.layers.2.linear_attn.in_proj_z.weight")
            .unwrap();
        o.insert("model.layers.2.linear_attn.unexpected.weight".into(), v);
    });
    let e = load_err(&dir);
    assert!(
        e.contains("layers.2.linear_attn.in_proj_z.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn wrong_shape() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    edit_header(&dir.join("model.safetensors"), |h| {
        h["model.layers.3.self_attn.o_proj.weight"]["shape"] = serde_json::json!([64, 32]);
    });
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.3.self_attn.o_proj.weight")
            && e.contains("[64, 32]")
            && e.contains("[32, 64]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype() {
    let (_t, dir) = write(Layout::PerExpert, DType::BF16, 1);
    edit_header(&dir.join("model.safetensors"), |h| {
        h["model.layers.0.mlp.gate.weight"]["dtype"] = serde_json::json!("I16");
    });
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.0.mlp.gate.weight") && e.contains("I16"),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_across_shards() {
    let (_t, dir) = write(Layout::Official, DType::BF16, 2);
    let target = shard_of(&dir, "lm_head.weight");
    let other = if target == shard(&dir, 1, 2) {
        shard(&dir, 2, 2)
    } else {
        shard(&dir, 1, 2)
    };
    // Rename some tensor of the other shard to a name the first shard already has.
    edit_header(&other, |h| {
        let o = h.as_object_mut().unwrap();
        let key = o
            .keys()
            .find(|k| k.as_str() != "__metadata__")
            .unwrap()
            .clone();
        let v = o.remove(&key).unwrap();
        o.insert("lm_head.weight".into(), v);
    });
    let e = load_err(&dir);
    assert!(e.contains("duplicate tensor `lm_head.weight`"), "{e}");
}

#[test]
fn bad_config_values_name_the_field() {
    let (_t, dir) = write(Layout::Official, DType::BF16, 1);
    let p = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg["text_config"]["num_experts_per_tok"] = serde_json::json!(7);
    cfg["text_config"]["linear_num_value_heads"] = serde_json::json!(3);
    std::fs::write(&p, cfg.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("text_config.num_experts_per_tok"), "{e}");
    assert!(e.contains("text_config.linear_num_value_heads"), "{e}");
    std::fs::write(&p, "{not json").unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("config.json") && e.contains("not valid JSON"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------
// FP8 (the official FP8 release's format): synthetic checkpoints quantised by
// `Mat::quantize_fp8`, with dims that make the 128-blocks ragged (160 = 128 + 32, 144).

fn fp8_config() -> TextConfig {
    TextConfig {
        hidden_size: 160,
        moe_intermediate: 144,
        shared_intermediate: 16,
        quantization: Some(kestrel::config::Fp8Quant {
            block: [128, 128],
            modules_to_not_convert: [
                "lm_head",
                "embed_tokens",
                "mlp.gate",
                "mlp.shared_expert_gate",
                "linear_attn.in_proj_a",
                "linear_attn.in_proj_b",
            ]
            .map(String::from)
            .to_vec(),
        }),
        ..tiny_config()
    }
}

fn fp8_weights(cfg: &TextConfig) -> kestrel::weights::ModelWeights {
    let mut w = random_weights(cfg, 11, DType::BF16);
    w.quantize_fp8(cfg.quantization.as_ref().unwrap());
    w
}

fn write_fp8(layout: Layout) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = fp8_config();
    write_checkpoint(dir.path(), &cfg, &fp8_weights(&cfg), layout, 1).unwrap();
    let p = dir.path().to_path_buf();
    (dir, p)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut cfg);
    std::fs::write(&p, cfg.to_string()).unwrap();
}

#[test]
fn fp8_checkpoints_load_as_written_without_dequantising() {
    let cfg = fp8_config();
    let tokens = [3u32, 14, 15, 92, 65, 35, 8, 9, 79];
    let reference = {
        let m = CpuModel::new(cfg.clone(), fp8_weights(&cfg));
        assert_eq!(m.weights.format(), "fp8 e4m3 block 128x128");
        m.forward(&mut m.new_state().unwrap(), &tokens, Logits::All)
            .unwrap()
    };
    for layout in [Layout::Official, Layout::PerExpert] {
        let (_t, dir) = write_fp8(layout);
        let m = CpuModel::load(&dir).unwrap();
        assert_eq!(m.config, cfg, "{layout:?}");
        let w = &m.weights;
        assert!(w.is_fp8());
        // The stored bytes stay mapped; scales are the ragged ceil grid.
        let e = &w.layers[0].moe.experts[1];
        assert_eq!(e.gate.dtype, DType::F8E4M3);
        let s = e.gate.scales.as_ref().unwrap();
        assert_eq!((s.grid_rows, s.grid_cols), (2, 2)); // [144, 160]
        assert_eq!(w.layers[0].moe.router.dtype, DType::BF16);
        assert_eq!(w.embed.dtype, DType::BF16);
        let kinds: Vec<String> = w.bytes_by_kind().into_iter().map(|k| k.0).collect();
        assert_eq!(
            kinds,
            ["BF16", "F8_E4M3", "FP8 block scales (f32)", "f32 vectors"]
        );
        let got = m
            .forward(&mut m.new_state().unwrap(), &tokens, Logits::All)
            .unwrap();
        assert_eq!(got, reference, "{layout:?}");
    }
}

#[test]
fn fp8_missing_scale_is_named() {
    let (_t, dir) = write_fp8(Layout::Official);
    let name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv";
    edit_header(&dir.join("model.safetensors"), |h| {
        let o = h.as_object_mut().unwrap();
        let v = o.remove(name).unwrap();
        o.insert(
            "model.language_model.layers.0.linear_attn.in_proj_qkv.scale_x".into(),
            v,
        );
    });
    let e = load_err(&dir);
    assert!(
        e.contains("`model.language_model.layers.0.linear_attn.in_proj_qkv.weight`")
            && e.contains("model.safetensors")
            && e.contains("weight_scale_inv")
            && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn fp8_scale_of_the_wrong_shape_is_named() {
    let (_t, dir) = write_fp8(Layout::Official);
    let name = "model.language_model.layers.1.mlp.experts.2.down_proj.weight_scale_inv";
    edit_header(&dir.join("model.safetensors"), |h| {
        assert_eq!(h[name]["shape"], serde_json::json!([2, 2]));
        h[name]["shape"] = serde_json::json!([4, 1]);
    });
    let e = load_err(&dir);
    assert!(
        e.contains(name)
            && e.contains("model.safetensors")
            && e.contains("[4, 1]")
            && e.contains("[2, 2] = [ceil(160/128), ceil(144/128)]")
            && e.contains("weight_block_size"),
        "{e}"
    );
}

#[test]
fn fp8_where_bf16_is_required_is_named() {
    let (_t, dir) = write_fp8(Layout::Official);
    // The router [4, 160] bf16 relabelled as F8_E4M3 [4, 320] (the same bytes).
    let name = "model.language_model.layers.2.mlp.gate.weight";
    edit_header(&dir.join("model.safetensors"), |h| {
        h[name]["dtype"] = serde_json::json!("F8_E4M3");
        h[name]["shape"] = serde_json::json!([4, 320]);
    });
    let e = load_err(&dir);
    assert!(
        e.contains(name) && e.contains("F8_E4M3") && e.contains("must be unquantized"),
        "{e}"
    );
}

#[test]
fn fp8_config_and_dtypes_must_agree() {
    // FP8 tensors without a quantization_config.
    let (_t, dir) = write_fp8(Layout::Official);
    edit_config(&dir, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    let e = load_err(&dir);
    assert!(
        e.contains("is F8_E4M3") && e.contains("no `quantization_config`"),
        "{e}"
    );
    // A block size we do not run names the field.
    let (_t, dir) = write_fp8(Layout::Official);
    edit_config(&dir, |c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64]);
    });
    let e = load_err(&dir);
    assert!(
        e.contains("config.json") && e.contains("`quantization_config.weight_block_size`"),
        "{e}"
    );
    // An FP8 tensor in a module the config keeps unquantized.
    let (_t, dir) = write_fp8(Layout::PerExpert);
    edit_config(&dir, |c| {
        c["quantization_config"]["modules_to_not_convert"] =
            serde_json::json!(["lm_head", "model.layers.*.self_attn.o_proj"]);
    });
    let e = load_err(&dir);
    assert!(
        e.contains("`model.layers.3.self_attn.o_proj.weight`")
            && e.contains("modules_to_not_convert"),
        "{e}"
    );
    // A bf16 checkpoint whose config claims FP8: the first projection that should be FP8.
    let (_t, dir) = write(Layout::Official, DType::BF16, 1);
    edit_config(&dir, |c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
    });
    let e = load_err(&dir);
    assert!(
        e.contains("`model.language_model.layers.0.linear_attn.in_proj_qkv.weight`")
            && e.contains("model.safetensors")
            && e.contains("has dtype BF16")
            && e.contains("`quantization_config`"),
        "{e}"
    );
}

/// mlx-vlm's vision tower (`vision_tower.*`) is skipped like `model.visual.*`.
#[test]
fn mlx_vlm_vision_tower_is_skipped() {
    let (_t, dir) = write(Layout::Official, DType::BF16, 1);
    let f = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let extra = [0u8; 8];
    tensors.push((
        "vision_tower.blocks.0.attn.qkv.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![2, 2], &extra).unwrap(),
    ));
    let out = safetensors::serialize(tensors, None).unwrap();
    bytes.clear();
    std::fs::write(&f, out).unwrap();
    let ck = kestrel::weights::Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.skipped_vision, 1);
    assert!(!ck.names().any(|n| n.contains("vision_tower")));
    CpuModel::load(&dir).unwrap();
}
