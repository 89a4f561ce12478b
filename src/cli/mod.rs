//! The `kestrel` command line: `generate`, `chat`, `serve`, `inspect` and `bench`.
//!
//! Everything that generates is generic over [`Engine`]; [`load_engine`] turns `--device` and
//! `--model` into a [`Backend`], and [`with_engine!`] hands its engine to generic code. A new
//! backend is one more `Backend` variant, one more arm in `load_engine` and in `with_engine!`.
//!
//! [`Engine`]: kestrel::model::Engine

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kestrel::config::WeightFormat;
use kestrel::config::{GenerationConfig, TextConfig};
use kestrel::hub;
use kestrel::model::CpuModel;
use kestrel::synthetic;
use kestrel::tensor::DType;
use kestrel::tokenizer::Tokenizer;
use kestrel::weights::{Checkpoint, ModelWeights};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// A loaded model, whichever backend runs it (one per process, so size does not matter).
#[allow(clippy::large_enum_variant)]
enum Backend {
    Cpu(CpuModel),
    Cuda(kestrel::cuda::model::CudaModel),
}

/// Runs `$body` with `$e` bound to the backend's engine (`&impl Engine`).
macro_rules! with_engine {
    ($backend:expr, $e:ident => $body:expr) => {
        match $backend {
            Backend::Cpu($e) => $body,
            Backend::Cuda($e) => $body,
        }
    };
}

mod args;
mod bench;
mod chat;
mod generate;
mod inspect;
mod progress;
mod serve;

use args::{Device, GenArgs, ModelArgs, ServeArgs};
use bench::bench_cmd;
use chat::chat_cmd;
use generate::generate_cmd;
use inspect::inspect;
use progress::{ProgressBar, read_weights};
use serve::serve_cmd;

/// The demo model's generation defaults: the real model's `generation_config.json`.
const BUNDLED_GENERATION_CONFIG: &str = include_str!("../../assets/qwen3_6/generation_config.json");

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
    /// Generate a reply to one prompt (chat-formatted unless --raw) and stream it to stdout.
    Generate {
        /// The prompt text.
        #[arg(long)]
        prompt: String,
        /// Send the prompt as is, without the chat template.
        #[arg(long, conflicts_with = "system")]
        raw: bool,
        /// A system message (chat-formatted prompts only).
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        opts: GenArgs,
    },
    /// Interactive multi-turn chat; reads one message per line from stdin (/help for commands).
    Chat {
        /// The system message.
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        opts: GenArgs,
    },
    /// Serve an OpenAI-compatible HTTP API (chat and text completions, streaming, tools).
    Serve {
        #[command(flatten)]
        serve: ServeArgs,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Validate a checkpoint and print its shape, sizes and per-sequence state bytes.
    Inspect {
        /// Checkpoint directory or Hugging Face repo id (resolved in the local cache).
        #[arg(long)]
        model: String,
    },
    /// Benchmark (Lily's contract: batch 1, greedy, TTFT-style prefill, 64 decode steps).
    Bench {
        /// Seeded random weights of a known shape instead of a checkpoint: `full` (the exact
        /// 40-layer Qwen3.6-35B-A3B shape, bf16), `full-fp8` (the same in the official FP8
        /// layout), `full-int4` (affine 4-bit, MLX's group 64) or `demo`.
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
        /// Prompt tokens per prefill chunk on the GPU (default: 16,384 where the workspace
        /// fits, else 8,192).
        #[arg(long)]
        max_chunk: Option<usize>,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Comma-separated stream counts: instead of the batch-1 contract, decode that many
        /// sequences together at each of --contexts tokens each (aggregate and per-stream
        /// tok/s, bytes a step against the read bandwidth).
        #[arg(long)]
        concurrency: Option<String>,
        /// With --concurrency: every stream samples (temperature 1, top-k 20, top-p 0.95, the
        /// model card's settings) instead of decoding greedily.
        #[arg(long, requires = "concurrency")]
        sampling: bool,
        /// `mtp`: at each context, plain and MTP-speculative decoding of 64 tokens (checked
        /// identical), acceptance, tokens per step, and the verification step's cost at
        /// K = 1..4 with the speedup modelled from it (CPU only for now).
        #[arg(long, value_parser = ["mtp"], conflicts_with = "concurrency")]
        speculative: Option<String>,
        /// With --speculative: tokens drafted per step.
        #[arg(long, default_value_t = 2, requires = "speculative", value_parser = clap::value_parser!(u64).range(1..=16))]
        draft_tokens: u64,
        /// With --speculative: forced acceptance, the drafts replaced by the target's own
        /// next tokens (from the plain run), so every draft is accepted: the best case end to
        /// end (the head still runs).
        #[arg(long, requires = "speculative")]
        speculative_forced: bool,
    },
}

/// Set by Ctrl-C while a reply is being generated: stops that reply.
static CANCEL: AtomicBool = AtomicBool::new(false);
/// While true (outside generation), Ctrl-C ends the program at once.
static EXIT_ON_INTERRUPT: AtomicBool = AtomicBool::new(true);

/// Ctrl-C outside generation exits with `status`; during generation it only stops the reply.
fn install_interrupt_handler(status: i32) {
    use signal_hook::consts::SIGINT;
    // The conditional exit must be registered first so it runs before the flag is set.
    let r = signal_hook::flag::register_conditional_shutdown(SIGINT, status, &EXIT_ON_INTERRUPT)
        .and_then(|_| signal_hook::flag::register(SIGINT, &CANCEL));
    if let Err(e) = r {
        tracing::warn!("cannot install the Ctrl-C handler: {e}");
    }
}

/// Marks the span of one reply: Ctrl-C cancels it instead of ending the program.
struct Generating;

impl Generating {
    fn start() -> Self {
        CANCEL.store(false, Ordering::SeqCst);
        EXIT_ON_INTERRUPT.store(false, Ordering::SeqCst);
        Generating
    }
}

impl Drop for Generating {
    fn drop(&mut self) {
        EXIT_ON_INTERRUPT.store(true, Ordering::SeqCst);
    }
}

pub(crate) fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // Warnings, and `serve`'s access log (off with --no-access-log).
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,kestrel::access=info")
                }),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(Cli::parse()) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Generate {
            prompt,
            raw,
            system,
            model,
            opts,
        } => {
            install_interrupt_handler(130);
            let loaded = load(&model)?;
            with_engine!(&loaded.backend, e => generate_cmd(e, &loaded, &model, &opts, &prompt, raw, system))
        }
        Command::Chat {
            system,
            model,
            opts,
        } => {
            install_interrupt_handler(0);
            let loaded = load(&model)?;
            with_engine!(&loaded.backend, e => chat_cmd(e, &loaded, &model, &opts, system))
        }
        Command::Serve { serve, model } => serve_cmd(serve, model),
        Command::Inspect { model } => {
            inspect(&hub::resolve_model(&model)?)?;
            Ok(0)
        }
        Command::Bench {
            synthetic,
            model,
            device,
            contexts,
            max_chunk,
            json,
            concurrency,
            sampling,
            speculative,
            draft_tokens,
            speculative_forced,
        } => {
            let spec = speculative.map(|_| (draft_tokens as usize, speculative_forced));
            bench_cmd(
                synthetic,
                model,
                device,
                contexts,
                max_chunk,
                json,
                concurrency,
                sampling,
                spec,
            )?;
            Ok(0)
        }
    }
}

struct Loaded {
    backend: Backend,
    tokenizer: Tokenizer,
    generation: GenerationConfig,
    demo: bool,
}

/// Resolves `--model`, checks `--device`, and loads the engine, tokenizer and generation
/// defaults.
fn load(args: &ModelArgs) -> Result<Loaded> {
    let dir = match &args.model {
        Some(spec) => {
            let dir = hub::resolve_model(spec)?;
            tracing::info!("model {spec} -> {}", dir.display());
            Some(dir)
        }
        None => None,
    };
    let backend = load_engine(args.device, dir.as_deref(), args)?;
    match dir {
        Some(dir) => Ok(Loaded {
            backend,
            tokenizer: Tokenizer::for_model_dir(&dir)?,
            generation: GenerationConfig::from_dir(&dir)?,
            demo: false,
        }),
        None => Ok(Loaded {
            backend,
            tokenizer: Tokenizer::bundled()?,
            generation: GenerationConfig::from_json_str(BUNDLED_GENERATION_CONFIG)?,
            demo: true,
        }),
    }
}

/// Prompt tokens per prefill call, most preferred first: the GPU workspace is sized for the
/// first that fits beside the weights, KV and state (about 8.1 GB at 16,384 tokens, 4.1 GB at
/// 8,192). Longer calls keep more rows per expert in the grouped MoE GEMM and fewer passes over
/// the weights: H200, 32,768-token prompt 43.6k tok/s in 8,192-token calls, 45.4k in 16,384.
const PREFILL_CHUNKS: [usize; 2] = [16384, 8192];
/// What `generate` hands the model per call (the model splits it to its workspace).
const PREFILL_CHUNK: usize = PREFILL_CHUNKS[0];

/// The engine for `device`: a checkpoint directory, or the bundled demo model.
fn load_engine(device: Device, dir: Option<&Path>, args: &ModelArgs) -> Result<Backend> {
    if args.speculative.is_some() && device == Device::Cuda {
        anyhow::bail!(
            "MTP speculation on the GPU is not built yet (issue 40): --speculative mtp runs with \
             --device cpu"
        );
    }
    // Open the GPU first: a missing or unsuitable GPU is reported before any weights load.
    let gpu = match device {
        Device::Cpu => {
            anyhow::ensure!(
                args.gpu.is_none(),
                "--gpu selects a CUDA device: it needs --device cuda"
            );
            None
        }
        Device::Cuda => {
            let ordinal = args.gpu.unwrap_or(0);
            Some(kestrel::cuda::Gpu::open(ordinal).with_context(|| {
                format!("--device cuda --gpu {ordinal} (without a usable GPU, use --device cpu)")
            })?)
        }
    };
    let make = |cfg: TextConfig, weights: ModelWeights| -> Result<Backend> {
        match &gpu {
            None => Ok(Backend::Cpu(CpuModel::new(cfg, weights))),
            Some(g) => {
                let max_seq = (args.max_seq as usize).min(cfg.max_position_embeddings);
                let format = weights.weight_format();
                let chunk = kestrel::cuda::model::CudaModel::pick_chunk(
                    g,
                    &cfg,
                    format,
                    max_seq,
                    &PREFILL_CHUNKS,
                )?;
                let show = !args.quiet && std::io::stderr().is_terminal();
                let mut bar: Option<ProgressBar> = None;
                let m = kestrel::cuda::model::CudaModel::from_weights_with_progress(
                    g.clone(),
                    cfg,
                    &weights,
                    max_seq,
                    chunk,
                    &mut |done, total| {
                        let b = bar.get_or_insert_with(|| {
                            ProgressBar::new("uploading weights to the GPU", total, show)
                        });
                        b.advance(done.saturating_sub(b.done));
                    },
                )?;
                if let Some(mut b) = bar {
                    b.finish();
                }
                Ok(Backend::Cuda(m))
            }
        }
    };
    if let Some(kind) = &args.synthetic {
        let Some(g) = &gpu else {
            anyhow::bail!(
                "--synthetic {kind} makes its weights on the GPU: it needs --device cuda"
            );
        };
        let format = WeightFormat::of_synthetic(kind)
            .ok_or_else(|| anyhow::anyhow!("--synthetic {kind}: not a synthetic model"))?;
        let cfg = TextConfig::qwen36_35b_a3b();
        let max_seq = (args.max_seq as usize).min(cfg.max_position_embeddings);
        let chunk =
            kestrel::cuda::model::CudaModel::pick_chunk(g, &cfg, format, max_seq, &PREFILL_CHUNKS)?;
        if !args.quiet {
            eprintln!(
                "kestrel: SYNTHETIC weights (seeded random, exact 40-layer Qwen3.6-35B-A3B shape, {format:?}): for load tests and benchmarks only, the text is gibberish"
            );
        }
        let m =
            kestrel::cuda::model::CudaModel::synthetic(g.clone(), cfg, format, 7, max_seq, chunk)?;
        return Ok(Backend::Cuda(m));
    }
    let Some(dir) = dir else {
        if !args.quiet {
            eprintln!(
                "kestrel: no --model given: running the bundled demo model (Qwen3.6 architecture at toy \
                 size, random weights, real tokenizer), so the text is gibberish. For real output: \
                 hf download Qwen/Qwen3.6-35B-A3B, then --model Qwen/Qwen3.6-35B-A3B (or a directory)."
            );
        }
        let cfg = synthetic::demo_config();
        let mut weights = synthetic::random_weights(&cfg, synthetic::DEMO_SEED, DType::BF16);
        if args.speculative.is_some() {
            weights.mtp = Some(synthetic::random_mtp_weights(
                &cfg,
                synthetic::DEMO_SEED,
                DType::BF16,
            ));
        }
        return make(cfg, weights);
    };
    let config = TextConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open(dir)?;
    let mut weights = ModelWeights::from_checkpoint(&ck, &config)?;
    if args.speculative.is_some() {
        weights.mtp = Some(kestrel::weights::MtpWeights::from_checkpoint(&ck, &config)?);
    }
    if !args.lazy_load && gpu.is_none() {
        let show = !args.quiet && std::io::stderr().is_terminal();
        read_weights(&weights, show);
    }
    make(config, weights)
}
