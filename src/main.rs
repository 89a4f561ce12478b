//! The `kestrel` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kestrel::chat::ChatRequest;
use kestrel::config::{GenerationConfig, TextConfig};
use kestrel::generate::{GenerateOptions, TextStream, generate_greedy};
use kestrel::model::{CpuModel, Engine};
use kestrel::state::SequenceState;
use kestrel::synthetic;
use kestrel::tensor::DType;
use kestrel::tokenizer::Tokenizer;
use kestrel::weights::Checkpoint;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kestrel",
    version,
    about = "Inference engine for Qwen3.6-35B-A3B (qwen3_5_moe)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to one prompt (chat-formatted unless --raw).
    Generate {
        /// The prompt text.
        #[arg(long)]
        prompt: String,
        /// Checkpoint directory. Without it, the bundled demo model (random weights) runs.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Maximum number of generated tokens.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Send the prompt as is, without the chat template.
        #[arg(long)]
        raw: bool,
        /// Render the template with thinking disabled.
        #[arg(long)]
        no_think: bool,
        /// Context limit in tokens (prompt + reply).
        #[arg(long, default_value_t = 32_768)]
        max_seq: usize,
    },
    /// Validate a checkpoint and print its shape, sizes and per-sequence state bytes.
    Inspect {
        #[arg(long)]
        model: PathBuf,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate {
            prompt,
            model,
            max_tokens,
            raw,
            no_think,
            max_seq,
        } => generate(prompt, model, max_tokens, raw, no_think, max_seq),
        Command::Inspect { model } => inspect(model),
    }
}

struct Loaded {
    model: CpuModel,
    tokenizer: Tokenizer,
    generation: GenerationConfig,
}

fn load(model: Option<PathBuf>) -> Result<Loaded> {
    match model {
        Some(dir) => {
            let m = CpuModel::load(&dir)?;
            let tokenizer = Tokenizer::for_model_dir(&dir)?;
            let generation = GenerationConfig::from_dir(&dir)?;
            Ok(Loaded {
                model: m,
                tokenizer,
                generation,
            })
        }
        None => {
            eprintln!(
                "kestrel: no --model given: running the bundled demo model (Qwen3.6 architecture at toy size, \
                 random weights, real tokenizer), so the text is gibberish. For real output: \
                 hf download Qwen/Qwen3.6-35B-A3B, then --model <dir>."
            );
            let cfg = synthetic::demo_config();
            let weights = synthetic::random_weights(&cfg, synthetic::DEMO_SEED, DType::BF16);
            let generation = GenerationConfig {
                eos_token_ids: cfg.eos_token_ids.clone(),
                ..Default::default()
            };
            Ok(Loaded {
                model: CpuModel::new(cfg, weights),
                tokenizer: Tokenizer::bundled()?,
                generation,
            })
        }
    }
}

fn generate(
    prompt: String,
    model: Option<PathBuf>,
    max_tokens: usize,
    raw: bool,
    no_think: bool,
    max_seq: usize,
) -> Result<()> {
    let Loaded {
        model,
        tokenizer,
        generation,
    } = load(model)?;
    let text = if raw {
        prompt
    } else {
        let template = tokenizer
            .template
            .as_ref()
            .context("the checkpoint has no chat template; use --raw")?;
        template.render(&ChatRequest {
            messages: vec![serde_json::json!({"role": "user", "content": prompt})],
            add_generation_prompt: true,
            enable_thinking: no_think.then_some(false),
            ..Default::default()
        })?
    };
    let ids = tokenizer.encode(&text, !raw)?;
    let cfg = model.config();
    let mut stop_ids = generation.eos_token_ids.clone();
    for id in &cfg.eos_token_ids {
        if !stop_ids.contains(id) {
            stop_ids.push(*id);
        }
    }
    let opts = GenerateOptions {
        max_tokens,
        stop_ids: stop_ids.clone(),
        vocab_limit: tokenizer.vocab_size().min(cfg.vocab_size),
        prefill_chunk: 4096,
        max_seq: max_seq.min(cfg.max_position_embeddings),
    };
    let mut state = model.new_state();
    let mut stream = TextStream::new();
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let stats = generate_greedy(&model, &mut state, &ids, &opts, |id| {
        if stop_ids.contains(&id) {
            return true;
        }
        match stream.push(id, |ids| tokenizer.decode(ids, true)) {
            Ok(piece) => {
                if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false;
                }
                true
            }
            Err(_) => true,
        }
    })?;
    if let Some(e) = write_err
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        return Err(e.into());
    }
    writeln!(out)?;
    eprintln!(
        "[prompt {} tokens, generated {}, ttft {:.1} ms, prefill {:.1} tok/s, decode {:.1} tok/s, stop: {:?}]",
        stats.prompt_tokens,
        stats.generated.len(),
        stats.time_to_first_token.as_secs_f64() * 1e3,
        stats.prefill_tok_s(),
        stats.decode_tok_s(),
        stats.stop
    );
    Ok(())
}

fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", units[u])
}

fn inspect(dir: PathBuf) -> Result<()> {
    let cfg = TextConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open(&dir)?;
    let weights = kestrel::weights::ModelWeights::from_checkpoint(&ck, &cfg)?;
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
    println!(
        "weight bytes    {} ({})",
        weights.nbytes(),
        human_bytes(weights.nbytes() as u64)
    );
    println!(
        "state per seq   KV {} per token (bf16), GDN state {} (bf16 conv + f32 recurrent)",
        human_bytes(cfg.kv_bytes_per_token(2) as u64),
        human_bytes(cfg.gdn_state_bytes() as u64)
    );
    let cpu_state = SequenceState::new(&cfg).memory_bytes();
    println!(
        "cpu backend     {} of f32 state per sequence before any token",
        human_bytes(cpu_state as u64)
    );
    Ok(())
}
