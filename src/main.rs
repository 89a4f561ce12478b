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
    /// Benchmark (Lily's contract: batch 1, greedy, TTFT-style prefill, 64 decode steps).
    Bench {
        /// Seeded random weights of a known shape instead of a checkpoint: `full` (the exact
        /// 40-layer Qwen3.6-35B-A3B shape) or `demo`.
        #[arg(long)]
        synthetic: Option<String>,
        /// Checkpoint directory (when not --synthetic).
        #[arg(long)]
        model: Option<PathBuf>,
        /// cpu or cuda.
        #[arg(long, default_value = "cuda")]
        device: String,
        /// Comma-separated context lengths.
        #[arg(
            long,
            default_value = "256,512,1024,2048,4096,8192,16384,32768,65536,131072"
        )]
        contexts: String,
        /// Prompt tokens per prefill chunk on the GPU.
        #[arg(long, default_value_t = 4096)]
        max_chunk: usize,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
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
        Command::Bench {
            synthetic,
            model,
            device,
            contexts,
            max_chunk,
            json,
        } => bench_cmd(synthetic, model, device, contexts, max_chunk, json),
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

struct CudaRunner<'a>(&'a kestrel::cuda::model::CudaModel, usize);

impl kestrel::bench::GreedyRunner for CudaRunner<'_> {
    type State = kestrel::cuda::model::CudaState;
    fn fresh(&self) -> Result<Self::State> {
        self.0.new_state_checked()
    }
    fn step(&self, state: &mut Self::State, tokens: &[u32]) -> Result<u32> {
        self.0.forward_greedy(state, tokens, self.1)
    }
}

struct CpuRunner<'a>(&'a CpuModel, usize);

impl kestrel::bench::GreedyRunner for CpuRunner<'_> {
    type State = SequenceState;
    fn fresh(&self) -> Result<Self::State> {
        Ok(self.0.new_state())
    }
    fn step(&self, state: &mut Self::State, tokens: &[u32]) -> Result<u32> {
        let mut logits = Vec::new();
        for piece in tokens.chunks(4096) {
            logits = self.0.forward(state, piece, kestrel::model::Logits::Last)?;
        }
        Ok(kestrel::generate::greedy(&logits, self.1))
    }
}

fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn bench_cmd(
    synthetic: Option<String>,
    model: Option<PathBuf>,
    device: String,
    contexts: String,
    max_chunk: usize,
    json: Option<PathBuf>,
) -> Result<()> {
    let contexts: Vec<usize> = contexts
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| anyhow::anyhow!("--contexts: {s:?} is not a whole number"))
        })
        .collect::<Result<_>>()?;
    if contexts.is_empty() || contexts.contains(&0) {
        anyhow::bail!("--contexts needs positive lengths");
    }
    let max_ctx = *contexts.iter().max().unwrap();
    let (cfg, host, weights_label) = match (&synthetic, &model) {
        (Some(s), None) => {
            let cfg = match s.as_str() {
                "full" => TextConfig::qwen36_35b_a3b(),
                "demo" => synthetic::demo_config(),
                other => anyhow::bail!("--synthetic must be `full` or `demo`, not {other:?}"),
            };
            eprintln!(
                "kestrel bench: SYNTHETIC weights (seeded random, {} shape): these numbers measure speed only, never output quality",
                if s == "full" {
                    "exact 40-layer Qwen3.6-35B-A3B"
                } else {
                    "demo"
                }
            );
            (cfg, None, format!("synthetic-{s}"))
        }
        (None, Some(dir)) => {
            let m = CpuModel::load(dir)?;
            (m.config.clone(), Some(m), dir.display().to_string())
        }
        _ => anyhow::bail!("give exactly one of --synthetic full|demo or --model DIR"),
    };
    let vocab_limit = cfg
        .vocab_size
        .min(kestrel::tokenizer::special::FIRST_PADDING_ID as usize);
    let log = |s: &str| eprintln!("{s}");
    let (rows, device_name, copy_bw) = match device.as_str() {
        "cuda" => {
            let gpu = kestrel::cuda::Gpu::open(0)?;
            let copy_bw = gpu.measure_copy_bandwidth(4 << 30)?;
            eprintln!(
                "device: {} (copy bandwidth {:.2} TB/s read+write)",
                gpu.name,
                copy_bw / 1e12
            );
            let max_seq = max_ctx + kestrel::bench::DECODE_STEPS + 8;
            let t0 = std::time::Instant::now();
            let m = match &host {
                Some(h) => kestrel::cuda::model::CudaModel::from_weights(
                    gpu.clone(),
                    cfg.clone(),
                    &h.weights,
                    max_seq,
                    max_chunk,
                )?,
                None => kestrel::cuda::model::CudaModel::synthetic(
                    gpu.clone(),
                    cfg.clone(),
                    7,
                    max_seq,
                    max_chunk,
                )?,
            };
            eprintln!("weights ready in {:.1} s", t0.elapsed().as_secs_f64());
            let runner = CudaRunner(&m, vocab_limit);
            let mut rows = Vec::new();
            for &c in &contexts {
                rows.push(kestrel::bench::bench_context(
                    &runner,
                    &cfg,
                    c,
                    vocab_limit,
                    copy_bw,
                    log,
                )?);
            }
            let prof = gpu.take_profile();
            if !prof.is_empty() {
                let total: f64 = prof.iter().map(|p| p.2).sum();
                eprintln!("profile (each op between syncs; all contexts, all rounds):");
                for (name, calls, secs) in prof.iter().take(30) {
                    eprintln!(
                        "  {name:<32} {calls:>8} calls {:>10.3} ms {:>6.1}%  {:>8.1} us/call",
                        secs * 1e3,
                        100.0 * secs / total,
                        secs * 1e6 / *calls as f64
                    );
                }
            }
            (rows, gpu.name.clone(), copy_bw)
        }
        "cpu" => {
            let m = match host {
                Some(h) => h,
                None => {
                    let w = synthetic::random_weights(&cfg, 7, DType::BF16);
                    CpuModel::new(cfg.clone(), w)
                }
            };
            let runner = CpuRunner(&m, vocab_limit);
            let mut rows = Vec::new();
            for &c in &contexts {
                rows.push(kestrel::bench::bench_context(
                    &runner,
                    &cfg,
                    c,
                    vocab_limit,
                    0.0,
                    log,
                )?);
            }
            (rows, "cpu".to_string(), 0.0)
        }
        other => anyhow::bail!("--device must be cpu or cuda, not {other:?}"),
    };
    println!(
        "{:>8} {:>14} {:>10} {:>13} {:>10} {:>9}",
        "context", "prefill tok/s", "ttft ms", "decode tok/s", "ms/token", "bw frac"
    );
    for r in &rows {
        println!(
            "{:>8} {:>14.0} {:>10.1} {:>13.1} {:>10.3} {:>9.3}",
            r.context,
            r.prefill_tok_s,
            r.ttft_ms,
            r.decode_tok_s,
            r.decode_ms_per_token,
            r.decode_bandwidth_fraction
        );
    }
    if let Some(path) = json {
        let report = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "commit": std::env::var("KESTREL_COMMIT").unwrap_or_else(|_| "unknown".into()),
            "date": utc_date(),
            "device": device_name,
            "weights": weights_label,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "contract": "batch 1, greedy, prompt[i] = ((i*2654435761) mod 2^32) mod vocab, warm-up, TTFT prefill, 64 decode steps, median of 2 rounds",
            "rows": rows,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
