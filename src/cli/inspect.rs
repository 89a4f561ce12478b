//! `kestrel inspect`: a checkpoint's shape, sizes and per-sequence state bytes.

use super::progress::human_bytes;
use anyhow::Result;
use kestrel::config::TextConfig;
use kestrel::state::SequenceState;
use kestrel::weights::{Checkpoint, ModelWeights};
use std::path::Path;

pub(super) fn inspect(dir: &Path) -> Result<()> {
    let cfg = TextConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open(dir)?;
    let weights = ModelWeights::from_checkpoint(&ck, &cfg)?;
    let (total, active) = cfg.parameter_counts();
    println!("checkpoint      {}", dir.display());
    println!(
        "files           {} safetensors file(s), {} text tensors, {} mtp tensors kept, {} vision tensors skipped",
        ck.files.len(),
        ck.len() - ck.mtp.len(),
        ck.mtp.len(),
        ck.skipped_vision
    );
    println!(
        "layers          {} ({} Gated DeltaNet, {} gated attention)",
        cfg.num_layers,
        cfg.num_gdn_layers(),
        cfg.num_attention_layers()
    );
    println!(
        "hidden          {}   vocab {}   max positions {}",
        cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings
    );
    println!(
        "attention       {} q heads / {} kv heads x {} (rotary {} dims, theta {})",
        cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope_theta
    );
    println!(
        "gated deltanet  {} key heads / {} value heads, dk {} dv {}, conv kernel {}",
        cfg.gdn_num_key_heads,
        cfg.gdn_num_value_heads,
        cfg.gdn_key_dim,
        cfg.gdn_value_dim,
        cfg.conv_kernel
    );
    println!(
        "moe             {} experts, top-{}, expert hidden {}, shared expert hidden {}",
        cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate, cfg.shared_intermediate
    );
    println!(
        "parameters      {total} total, {active} active per token (incl. lm_head, excl. embedding)"
    );
    match &cfg.quantization {
        None if cfg.affine.is_some() => println!(
            "format          {} ({})",
            weights.format(),
            cfg.affine.as_ref().unwrap().describe()
        ),
        Some(q) => println!(
            "format          {} (quantization_config: fp8, e4m3, dynamic activations, {} modules_to_not_convert)",
            weights.format(),
            q.modules_to_not_convert.len()
        ),
        None => println!("format          {}", weights.format()),
    }
    println!(
        "weight bytes    {} ({})",
        weights.nbytes(),
        human_bytes(weights.nbytes() as u64)
    );
    for (kind, n) in weights.bytes_by_kind() {
        println!("  {kind:<22} {n:>14} ({})", human_bytes(n as u64));
    }
    println!(
        "state per seq   KV {} per token (bf16), GDN state {} (bf16 conv + f32 recurrent)",
        human_bytes(cfg.kv_bytes_per_token(2) as u64),
        human_bytes(cfg.gdn_state_bytes() as u64)
    );
    // Whether --speculative mtp can run: the head loads in full (names, shapes, dtypes).
    match kestrel::weights::MtpWeights::from_checkpoint(&ck, &cfg) {
        Ok(_) => println!(
            "mtp head        complete ({} tensors): --speculative mtp can draft with it",
            ck.mtp.len()
        ),
        Err(e) => println!(
            "mtp head        unusable for --speculative mtp: {}",
            format!("{e:#}").replace('\n', " ")
        ),
    }
    let cpu_state = SequenceState::new(&cfg).memory_bytes();
    println!(
        "cpu backend     {} of f32 state per sequence before any token",
        human_bytes(cpu_state as u64)
    );
    Ok(())
}
