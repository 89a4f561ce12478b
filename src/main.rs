//! The `kestrel` command line: `generate`, `chat`, `serve`, `inspect` and `bench`.
//!
//! Everything that generates is generic over [`Engine`]; [`load_engine`] turns `--device` and
//! `--model` into a [`Backend`], and [`with_engine!`] hands its engine to generic code. A new
//! backend is one more `Backend` variant, one more arm in `load_engine` and in `with_engine!`.

use anyhow::Context;
use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use kestrel::config::{GenerationConfig, TextConfig};
use kestrel::generate::{
    Channel, GenerateOptions, GenerationStats, ReplySettings, StopReason, ThinkingControl, reply,
};
use kestrel::hub;
use kestrel::model::{CpuModel, Engine};
use kestrel::sampling::{SamplingParams, check};
use kestrel::session::{Conversation, chat_turn};
use kestrel::state::SequenceState;
use kestrel::synthetic;
use kestrel::tensor::{DType, Mat};
use kestrel::tokenizer::Tokenizer;
use kestrel::weights::{Checkpoint, Mixer, ModelWeights};
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The demo model's generation defaults: the real model's `generation_config.json`.
const BUNDLED_GENERATION_CONFIG: &str = include_str!("../assets/qwen3_6/generation_config.json");

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
        /// Prompt tokens per prefill chunk on the GPU (default: 16,384 where the workspace
        /// fits, else 8,192).
        #[arg(long)]
        max_chunk: Option<usize>,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Args, Clone, Debug)]
struct ModelArgs {
    /// Checkpoint directory, or a Hugging Face repo id (`Qwen/Qwen3.6-35B-A3B`, optionally
    /// `@revision`) resolved offline in the local Hugging Face cache. Without it, the bundled
    /// demo model (random weights) runs.
    #[arg(long)]
    model: Option<String>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Context limit in tokens (prompt + reply), at most the model's maximum positions.
    #[arg(long, allow_negative_numbers = true, default_value_t = 32_768, value_parser = clap::value_parser!(u64).range(2..))]
    max_seq: u64,
    /// Do not read the weights up front (pages load from disk on first use instead).
    #[arg(long)]
    lazy_load: bool,
    /// Only the generated text: no banner, progress bar or stats line.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Clone, Debug)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    bind: String,
    /// Require `Authorization: Bearer KEY` on /v1 endpoints.
    #[arg(long)]
    api_key: Option<String>,
    /// Bytes of sequence states the prefix cache keeps (K, M, G suffixes allowed).
    #[arg(long, default_value = "4G", value_parser = parse_bytes)]
    cache_mem: u64,
    /// Seconds a request may take, queueing included, before it is stopped.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// The model id clients send (default: the --model value, or `kestrel-demo`).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Tokens per reply when a chat request gives no max_tokens [default: 4096; 64 for
    /// the demo model].
    #[arg(long)]
    default_max_tokens: Option<usize>,
    /// Requests that may wait for the model; more are refused with 429.
    #[arg(long, default_value_t = 1024)]
    max_queue: usize,
    /// Sequences generated at once, interleaved token by token (each holds its own state).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    max_running: u64,
}

#[derive(Args, Clone, Debug)]
struct GenArgs {
    /// Maximum generated tokens per reply [default: 4096; 64 for the demo model].
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..))]
    max_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy [default: generation_config.json's when it samples
    /// (do_sample), else 0].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_temperature)]
    temperature: Option<f32>,
    /// Keep only the K most likely tokens; 0 is off [default: generation_config.json, else 0].
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<usize>,
    /// Nucleus sampling mass, in (0, 1] [default: generation_config.json, else 1].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_top_p)]
    top_p: Option<f32>,
    /// Drop tokens less likely than MIN_P times the most likely one, in [0, 1]
    /// [default: generation_config.json, else 0].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_min_p)]
    min_p: Option<f32>,
    /// Repetition penalty (> 0; 1 is off) on tokens of the reply so far.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_repetition_penalty)]
    repetition_penalty: Option<f32>,
    /// Presence penalty in [-2, 2] on tokens of the reply so far.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_presence_frequency)]
    presence_penalty: Option<f32>,
    /// Frequency penalty in [-2, 2] on tokens of the reply so far.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_presence_frequency)]
    frequency_penalty: Option<f32>,
    /// Random seed: the same seed gives the same output on the same backend [default: random].
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// Stop when the reply contains this text (not printed). Repeatable; `\n`, `\t` and `\\`
    /// are unescaped.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_stop)]
    stop: Vec<String>,
    /// Think before answering (the template's enable_thinking; the model's default).
    #[arg(long, conflicts_with = "no_think")]
    think: bool,
    /// Answer without thinking (enable_thinking=false).
    #[arg(long)]
    no_think: bool,
    /// Close the thinking block after this many tokens (feeds `</think>\n\n`).
    #[arg(long, allow_negative_numbers = true)]
    thinking_budget: Option<usize>,
}

fn number(s: &str) -> Result<f32, String> {
    s.trim()
        .parse::<f32>()
        .map_err(|_| format!("`{s}` is not a number"))
}

fn ranged(s: &str, ok: fn(f32) -> bool, expected: &str) -> Result<f32, String> {
    let x = number(s)?;
    if ok(x) {
        Ok(x)
    } else {
        Err(format!("must be {expected}"))
    }
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    ranged(s, check::temperature, check::TEMPERATURE)
}
fn parse_top_p(s: &str) -> Result<f32, String> {
    ranged(s, check::top_p, check::TOP_P)
}
fn parse_min_p(s: &str) -> Result<f32, String> {
    ranged(s, check::min_p, check::MIN_P)
}
fn parse_repetition_penalty(s: &str) -> Result<f32, String> {
    ranged(s, check::repetition_penalty, check::REPETITION_PENALTY)
}
fn parse_presence_frequency(s: &str) -> Result<f32, String> {
    ranged(s, check::presence_frequency, check::PRESENCE_FREQUENCY)
}

/// `123`, `64K`, `512M`, `4G` (binary multiples).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                'B' => 1,
                _ => return Err(format!("unknown size suffix in `{s}` (K, M, G, T)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 4G, 512M, 1000000)"))?;
    if !n.is_finite() || n < 0.0 {
        return Err(format!("`{s}` is not a size"));
    }
    Ok((n * mult as f64) as u64)
}

fn parse_stop(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    if out.is_empty() {
        return Err("a stop string cannot be empty".into());
    }
    Ok(out)
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

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
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
        } => {
            bench_cmd(synthetic, model, device, contexts, max_chunk, json)?;
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
/// The server's prefill step: one round advances a prompt by at most this many tokens, so
/// the other running sequences wait at most one such call per round.
const SERVER_PREFILL_CHUNK: usize = 8192;

/// The engine for `device`: a checkpoint directory, or the bundled demo model.
fn load_engine(device: Device, dir: Option<&Path>, args: &ModelArgs) -> Result<Backend> {
    // Open the GPU first: a missing or unsuitable GPU is reported before any weights load.
    let gpu = match device {
        Device::Cpu => None,
        Device::Cuda => Some(
            kestrel::cuda::Gpu::open(0)
                .context("--device cuda (without a usable GPU, use --device cpu)")?,
        ),
    };
    let make = |cfg: TextConfig, weights: ModelWeights| -> Result<Backend> {
        match &gpu {
            None => Ok(Backend::Cpu(CpuModel::new(cfg, weights))),
            Some(g) => {
                let max_seq = (args.max_seq as usize).min(cfg.max_position_embeddings);
                let chunk =
                    kestrel::cuda::model::CudaModel::pick_chunk(g, &cfg, max_seq, &PREFILL_CHUNKS)?;
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
    let Some(dir) = dir else {
        if !args.quiet {
            eprintln!(
                "kestrel: no --model given: running the bundled demo model (Qwen3.6 architecture at toy \
                 size, random weights, real tokenizer), so the text is gibberish. For real output: \
                 hf download Qwen/Qwen3.6-35B-A3B, then --model Qwen/Qwen3.6-35B-A3B (or a directory)."
            );
        }
        let cfg = synthetic::demo_config();
        let weights = synthetic::random_weights(&cfg, synthetic::DEMO_SEED, DType::BF16);
        return make(cfg, weights);
    };
    let config = TextConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open(dir)?;
    let weights = ModelWeights::from_checkpoint(&ck, &config)?;
    if !args.lazy_load && gpu.is_none() {
        let show = !args.quiet && std::io::stderr().is_terminal();
        read_weights(&weights, show);
    }
    make(config, weights)
}

/// Every weight matrix of the model (fused experts appear as their per-expert views).
fn matrices(w: &ModelWeights) -> Vec<&Mat> {
    let mut v = vec![&w.embed, &w.lm_head];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Gdn(g) => v.extend([&g.in_qkv, &g.in_z, &g.in_a, &g.in_b, &g.out]),
            Mixer::Attention(a) => v.extend([&a.q, &a.k, &a.v, &a.o]),
        }
        v.push(&l.moe.router);
        for e in l.moe.experts.iter().chain([&l.moe.shared]) {
            v.extend([&e.gate, &e.up, &e.down]);
        }
    }
    v
}

/// Reads every page of the memory-mapped weights once, so they are in memory before the
/// first token, with a progress bar over the bytes read when `show`.
fn read_weights(w: &ModelWeights, show: bool) {
    let mats = matrices(w);
    let total: u64 = mats.iter().map(|m| m.nbytes() as u64).sum();
    let mut bar = ProgressBar::new("reading weights", total, show);
    let mut checksum = 0u8;
    for m in mats {
        for chunk in m.bytes().chunks(1 << 20) {
            // One byte per 4 KiB page faults the page in.
            for page in chunk.chunks(4096) {
                checksum ^= page[0];
            }
            bar.advance(chunk.len() as u64);
        }
    }
    std::hint::black_box(checksum);
    bar.finish();
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

/// A one-line progress bar on stderr (bytes, rate); draws nothing when not shown.
struct ProgressBar {
    label: &'static str,
    total: u64,
    done: u64,
    start: Instant,
    last_draw: Option<Instant>,
    show: bool,
}

impl ProgressBar {
    fn new(label: &'static str, total: u64, show: bool) -> Self {
        ProgressBar {
            label,
            total,
            done: 0,
            start: Instant::now(),
            last_draw: None,
            show,
        }
    }

    fn advance(&mut self, n: u64) {
        self.done += n;
        if self.show
            && self
                .last_draw
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(100))
        {
            self.draw();
        }
    }

    fn draw(&mut self) {
        self.last_draw = Some(Instant::now());
        let frac = self.done as f64 / self.total.max(1) as f64;
        let width = 30;
        let filled = ((frac * width as f64) as usize).min(width);
        let secs = self.start.elapsed().as_secs_f64();
        let rate = self.done as f64 / secs.max(1e-6);
        let eta = if rate > 0.0 {
            (self.total - self.done) as f64 / rate
        } else {
            0.0
        };
        eprint!(
            "\r\x1b[2K{} [{}{}] {} / {}  {}/s  eta {:.0} s",
            self.label,
            "=".repeat(filled),
            " ".repeat(width - filled),
            human_bytes(self.done),
            human_bytes(self.total),
            human_bytes(rate as u64),
            eta
        );
    }

    fn finish(&mut self) {
        let secs = self.start.elapsed().as_secs_f64();
        if self.show {
            self.draw();
            eprintln!(
                "\r\x1b[2K{}: {} in {:.1} s ({}/s)",
                self.label,
                human_bytes(self.total),
                secs,
                human_bytes((self.total as f64 / secs.max(1e-6)) as u64)
            );
        } else {
            tracing::info!(
                "{}: {} in {:.1} s",
                self.label,
                human_bytes(self.total),
                secs
            );
        }
    }
}

/// Sampling settings: flags over `generation_config.json` over the neutral defaults.
fn sampling_params(
    opts: &GenArgs,
    cfg: &GenerationConfig,
    vocab_limit: usize,
) -> Result<SamplingParams> {
    let mut p = SamplingParams::from_generation_config(cfg, vocab_limit);
    let set = |dst: &mut f32, flag: Option<f32>| {
        if let Some(v) = flag {
            *dst = v;
        }
    };
    set(&mut p.temperature, opts.temperature);
    set(&mut p.top_p, opts.top_p);
    set(&mut p.min_p, opts.min_p);
    set(&mut p.repetition_penalty, opts.repetition_penalty);
    set(&mut p.presence_penalty, opts.presence_penalty);
    set(&mut p.frequency_penalty, opts.frequency_penalty);
    if let Some(k) = opts.top_k {
        p.top_k = k;
    }
    // Flags were checked when parsed, so a bad value here comes from the checkpoint.
    p.validate().map_err(|e| {
        anyhow::anyhow!(
            "generation_config.json: {e}; override it with --{}",
            e.field.replace('_', "-")
        )
    })?;
    Ok(p)
}

/// A seed from the clock when none is given.
fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_nanos() as u64) ^ ((std::process::id() as u64) << 32)
}

/// Everything a reply needs besides the prompt, from the flags and the checkpoint.
struct Setup {
    settings: ReplySettings,
    params: SamplingParams,
    seed: u64,
}

fn setup<E: Engine>(
    engine: &E,
    loaded: &Loaded,
    model: &ModelArgs,
    opts: &GenArgs,
) -> Result<Setup> {
    let cfg = engine.config();
    let tok = &loaded.tokenizer;
    let vocab_limit = tok.vocab_size().min(cfg.vocab_size);
    let params = sampling_params(opts, &loaded.generation, vocab_limit)?;
    let mut stop_ids = loaded.generation.eos_token_ids.clone();
    for id in &cfg.eos_token_ids {
        if !stop_ids.contains(id) {
            stop_ids.push(*id);
        }
    }
    let think_ids = tok.token_to_id("<think>").zip(tok.token_to_id("</think>"));
    let thinking = match (think_ids, opts.thinking_budget) {
        (Some((open_id, close_id)), budget) => Some(ThinkingControl {
            open_id,
            close_id,
            budget,
            close_ids: tok.encode("</think>\n\n", true)?,
        }),
        (None, Some(_)) => bail!("--thinking-budget: this tokenizer has no <think> tokens"),
        (None, None) => None,
    };
    let max_seq = (model.max_seq as usize).min(cfg.max_position_embeddings);
    let default_max = if loaded.demo { 64 } else { 4096 };
    let seed = opts.seed.unwrap_or_else(fresh_seed);
    tracing::info!("sampling {params:?}, seed {seed}");
    Ok(Setup {
        settings: ReplySettings {
            opts: GenerateOptions {
                max_tokens: opts.max_tokens.map_or(default_max, |n| n as usize),
                stop_ids,
                prefill_chunk: PREFILL_CHUNK,
                max_seq,
                thinking,
                device_greedy: kestrel::generate::device_greedy_allowed(),
            },
            stop_strings: opts.stop.clone(),
            think_ids,
        },
        params,
        seed,
    })
}

fn enable_thinking(opts: &GenArgs) -> Option<bool> {
    if opts.think {
        Some(true)
    } else if opts.no_think {
        Some(false)
    } else {
        None
    }
}

/// Writes a reply to stdout: the reasoning dimmed on a terminal (else between `<think>` and
/// `</think>` lines), then the answer.
struct Printer {
    color: bool,
    channel: Option<Channel>,
    line_start: bool,
}

impl Printer {
    fn new() -> Self {
        Printer {
            color: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
            channel: None,
            line_start: true,
        }
    }

    fn write(&mut self, s: &str) -> std::io::Result<()> {
        if s.is_empty() {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        out.write_all(s.as_bytes())?;
        out.flush()?;
        self.line_start = s.ends_with('\n');
        Ok(())
    }

    fn close_reasoning(&mut self) -> std::io::Result<()> {
        if self.color {
            self.write("\x1b[0m")?;
            self.line_start = false;
        }
        if !self.line_start {
            self.write("\n")?;
        }
        if !self.color {
            self.write("</think>\n")?;
        }
        self.write("\n")
    }

    fn text(&mut self, ch: Channel, text: &str) -> std::io::Result<()> {
        if self.channel != Some(ch) {
            if self.channel == Some(Channel::Reasoning) {
                self.close_reasoning()?;
            }
            if ch == Channel::Reasoning {
                self.write(if self.color { "\x1b[2m" } else { "<think>\n" })?;
            }
            self.channel = Some(ch);
        }
        self.write(text)
    }

    /// Ends the reply: closes the reasoning style or marker and the line.
    fn end(&mut self) -> std::io::Result<()> {
        if self.channel == Some(Channel::Reasoning) {
            if self.color {
                self.write("\x1b[0m")?;
            }
            if !self.color {
                if !self.line_start {
                    self.write("\n")?;
                }
                self.write("</think>")?;
                self.line_start = false;
            }
        }
        self.channel = None;
        if !self.line_start {
            self.write("\n")?;
        }
        Ok(())
    }
}

fn stats_line(s: &GenerationStats) -> String {
    format!(
        "[prompt {} tokens, cached {}, ttft {:.1} ms, prefill {:.1} tok/s, decode {:.1} tok/s, generated {} tokens, stop: {}]",
        s.prompt_tokens,
        s.cached_tokens,
        s.time_to_first_token.as_secs_f64() * 1e3,
        s.prefill_tok_s(),
        s.decode_tok_s(),
        s.generated.len(),
        s.stop
    )
}

/// Ends a reply's output, treating a closed stdout as the reader having had enough.
fn finish_output(printer: &mut Printer, result: Result<()>) -> Result<bool> {
    let result = result.and_then(|_| printer.end().map_err(Into::into));
    match result {
        Ok(()) => Ok(true),
        Err(e) => match e.downcast_ref::<std::io::Error>() {
            Some(io) if io.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
            _ => Err(e),
        },
    }
}

fn generate_cmd<E: Engine>(
    engine: &E,
    loaded: &Loaded,
    model: &ModelArgs,
    opts: &GenArgs,
    prompt: &str,
    raw: bool,
    system: Option<String>,
) -> Result<i32> {
    let Setup {
        settings,
        params,
        seed,
    } = setup(engine, loaded, model, opts)?;
    let tok = &loaded.tokenizer;
    let mut sampler = kestrel::sampling::Sampler::new(params, seed);
    let mut printer = Printer::new();
    let guard = Generating::start();
    let outcome = if raw {
        if opts.think || opts.no_think {
            tracing::warn!("--think / --no-think only apply to chat-formatted prompts");
        }
        let ids = tok.encode(prompt, false)?;
        let mut state = engine.new_state();
        reply(
            engine,
            tok,
            &mut state,
            &ids,
            None,
            &settings,
            &mut sampler,
            &CANCEL,
            |ch, t| printer.text(ch, t),
        )
        .map(|(r, _)| r)
    } else {
        if tok.template.is_none() {
            bail!("the checkpoint has no chat template; use --raw");
        }
        let mut conv = Conversation::<E::State>::new();
        conv.system = system;
        conv.enable_thinking = enable_thinking(opts);
        chat_turn(
            engine,
            tok,
            &mut conv,
            prompt,
            &settings,
            &mut sampler,
            &CANCEL,
            |ch, t| printer.text(ch, t),
        )
    };
    drop(guard);
    let (reply, io) = match outcome {
        Ok(r) => (Some(r), Ok(())),
        Err(e) => (None, Err(e)),
    };
    if !finish_output(&mut printer, io)? {
        return Ok(0);
    }
    let reply = reply.expect("errors returned above");
    if !model.quiet {
        eprintln!("{}", stats_line(&reply.stats));
    }
    Ok(if reply.stats.stop == StopReason::Cancelled {
        130
    } else {
        0
    })
}

const CHAT_HELP: &str = "\
commands:
  /reset           forget the conversation (keeps the system prompt)
  /system [TEXT]   set (or, without TEXT, clear) the system prompt
  /think on|off    think before answering, or answer directly
  /stats           conversation and speed statistics
  /help            this list
  /exit            quit (also Ctrl-D; Ctrl-C quits at the prompt and stops a reply)";

/// Running totals of a chat session.
#[derive(Default)]
struct ChatTotals {
    turns: usize,
    prefilled: usize,
    cached: usize,
    generated: usize,
    last: Option<GenerationStats>,
}

fn chat_cmd<E: Engine>(
    engine: &E,
    loaded: &Loaded,
    model: &ModelArgs,
    opts: &GenArgs,
    system: Option<String>,
) -> Result<i32> {
    let Setup {
        settings,
        params,
        seed,
    } = setup(engine, loaded, model, opts)?;
    let tok = &loaded.tokenizer;
    if tok.template.is_none() {
        bail!("the checkpoint has no chat template, so it cannot chat");
    }
    let mut sampler = kestrel::sampling::Sampler::new(params, seed);
    let mut conv = Conversation::<E::State>::new();
    conv.system = system;
    conv.enable_thinking = enable_thinking(opts);
    let interactive = std::io::stdin().is_terminal();
    if !model.quiet {
        eprintln!(
            "kestrel chat: one message per line; /help lists commands; Ctrl-D or /exit quits."
        );
    }
    let mut totals = ChatTotals::default();
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    loop {
        if interactive {
            let mut out = std::io::stdout().lock();
            write!(out, "> ")?;
            out.flush()?;
        }
        line.clear();
        if stdin.read_line(&mut line)? == 0 {
            if interactive {
                println!();
            }
            return Ok(0);
        }
        let input = line.trim();
        if input.is_empty() {
            continue;
        }
        if let Some(cmd) = input.strip_prefix('/') {
            let (name, arg) = cmd.split_once(char::is_whitespace).unwrap_or((cmd, ""));
            let arg = arg.trim();
            match name {
                "exit" | "quit" => return Ok(0),
                "help" => eprintln!("{CHAT_HELP}"),
                "reset" => {
                    conv.reset();
                    eprintln!("(conversation cleared)");
                }
                "system" => {
                    conv.system = (!arg.is_empty()).then(|| arg.to_string());
                    eprintln!(
                        "({}; the next reply prefills the conversation again)",
                        if arg.is_empty() {
                            "system prompt cleared"
                        } else {
                            "system prompt set"
                        }
                    );
                }
                "think" => match arg {
                    "on" => {
                        conv.enable_thinking = Some(true);
                        eprintln!("(thinking on)");
                    }
                    "off" => {
                        conv.enable_thinking = Some(false);
                        eprintln!("(thinking off)");
                    }
                    _ => eprintln!("usage: /think on|off"),
                },
                "stats" => {
                    let context = conv.cached_lengths().first().copied().unwrap_or(0);
                    eprintln!(
                        "turns {}, context {} / {} tokens, prompt tokens prefilled {}, reused {}, generated {}, seed {}",
                        totals.turns,
                        context,
                        settings.opts.max_seq,
                        totals.prefilled,
                        totals.cached,
                        totals.generated,
                        seed
                    );
                    if let Some(s) = &totals.last {
                        eprintln!("last reply {}", stats_line(s));
                    }
                }
                _ => eprintln!("unknown command /{name}; /help lists the commands"),
            }
            continue;
        }
        let mut printer = Printer::new();
        let guard = Generating::start();
        let outcome = chat_turn(
            engine,
            tok,
            &mut conv,
            input,
            &settings,
            &mut sampler,
            &CANCEL,
            |ch, t| printer.text(ch, t),
        );
        drop(guard);
        let (reply, io) = match outcome {
            Ok(r) => (Some(r), Ok(())),
            Err(e) => (None, Err(e)),
        };
        match finish_output(&mut printer, io) {
            Ok(true) => {}
            Ok(false) => return Ok(0),
            Err(e) => {
                eprintln!("error: {e:#}");
                if format!("{e:#}").contains("context limit") {
                    eprintln!("(/reset starts a new conversation; --max-seq raises the limit)");
                }
                continue;
            }
        }
        let Some(reply) = reply else { continue };
        let s = &reply.stats;
        totals.turns += 1;
        totals.prefilled += s.prefilled_tokens();
        totals.cached += s.cached_tokens;
        totals.generated += s.generated.len();
        if !model.quiet {
            eprintln!("{}", stats_line(s));
        }
        totals.last = Some(reply.stats);
    }
}

/// `kestrel serve`: tokenizer and defaults load first, the HTTP listener starts at once
/// (`/health` answers 503 until the weights are in), and the engine loads and then runs on
/// its own thread.
fn serve_cmd(args: ServeArgs, model: ModelArgs) -> Result<i32> {
    use kestrel::server::{ServerConfig, Shared, run_model, serve};
    let ServeArgs {
        bind,
        api_key,
        cache_mem,
        request_timeout,
        served_model_name,
        default_max_tokens,
        max_queue,
        max_running,
    } = args;
    let max_running = max_running as usize;
    let dir = match &model.model {
        Some(spec) => Some(hub::resolve_model(spec)?),
        None => None,
    };
    let (tokenizer, generation) = match &dir {
        Some(d) => (Tokenizer::for_model_dir(d)?, GenerationConfig::from_dir(d)?),
        None => (
            Tokenizer::bundled()?,
            GenerationConfig::from_json_str(BUNDLED_GENERATION_CONFIG)?,
        ),
    };
    let model_id = served_model_name.unwrap_or_else(|| match &model.model {
        Some(spec) => spec.clone(),
        None => "kestrel-demo".into(),
    });
    let config = ServerConfig {
        model_id: model_id.clone(),
        max_seq: model.max_seq as usize,
        api_key,
        cache_mem: cache_mem.min(usize::MAX as u64) as usize,
        request_timeout: Duration::from_secs(request_timeout.max(1)),
        default_max_tokens: default_max_tokens.unwrap_or(if dir.is_none() { 64 } else { 4096 }),
        prefill_chunk: SERVER_PREFILL_CHUNK,
        max_queue,
        max_running,
    };
    let (shared, rx) = Shared::new(config, tokenizer, &generation)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&bind))
        .with_context(|| format!("cannot listen on {bind}"))?;
    let addr = listener.local_addr()?;
    let model_shared = shared.clone();
    let model_args = model.clone();
    std::thread::Builder::new()
        .name("kestrel-model".into())
        .spawn(move || {
            let backend = match load_engine(model_args.device, dir.as_deref(), &model_args) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(1);
                }
            };
            if !model_args.quiet {
                eprintln!("kestrel serve: model loaded");
            }
            // On the GPU this first checks that --max-running states fit (and sizes the cache).
            if let Err(e) = with_engine!(&backend, e => run_model(e, model_shared, rx)) {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        })?;
    if !model.quiet {
        eprintln!(
            "kestrel serve: listening on http://{addr} (model id `{model_id}`); Ctrl-C stops"
        );
    }
    // Ctrl-C: stop accepting, end running and queued requests (503), then exit once the
    // open responses are closed; a second Ctrl-C exits at once.
    let stop_shared = shared.clone();
    let shutdown = async move {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("kestrel serve: shutting down (Ctrl-C again to exit at once)");
        stop_shared.stopping.store(true, Ordering::SeqCst);
        tokio::spawn(async {
            let _ = tokio::signal::ctrl_c().await;
            std::process::exit(130);
        });
    };
    runtime.block_on(serve(listener, shared, shutdown))?;
    Ok(0)
}

fn inspect(dir: &Path) -> Result<()> {
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

/// The decode timeline of one step at `context` (after the prompt and 8 warm steps) into
/// `{prefix}-{context}.csv` (`KESTREL_TRACE_OUT`; needs the kernels compiled with
/// `KESTREL_KERNEL_DEFINES=KESTREL_TRACE`); scripts/decode_timeline.py reads it.
fn trace_decode(
    m: &kestrel::cuda::model::CudaModel,
    context: usize,
    vocab_limit: usize,
    prefix: &str,
) -> Result<()> {
    let mut st = m.new_state_checked()?;
    let mut next = m.forward_greedy(
        &mut st,
        &kestrel::bench::prompt(context, vocab_limit),
        vocab_limit,
    )?;
    for _ in 0..8 {
        next = m.forward_greedy(&mut st, &[next], vocab_limit)?;
    }
    let recs = m.trace_decode_step(&mut st, next, vocab_limit)?;
    if recs.is_empty() {
        anyhow::bail!(
            "KESTREL_TRACE_OUT: no timeline records; compile the kernels with KESTREL_KERNEL_DEFINES=KESTREL_TRACE"
        );
    }
    let path = format!("{prefix}-{context}.csv");
    let mut out =
        String::from("tag,grid,block,y,sm,start_ns,wait_ns,end_ns,ph0_ns,ph1_ns,ph2_ns\n");
    for r in &recs {
        out += &format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            r[0] >> 48,
            (r[0] >> 24) & 0xff_ffff,
            r[0] & 0xff_ffff,
            r[1] >> 32,
            r[1] & 0xffff_ffff,
            r[2],
            r[3],
            r[4],
            r[5],
            r[6],
            r[7]
        );
    }
    std::fs::write(&path, out).map_err(|e| anyhow::anyhow!("writing {path}: {e}"))?;
    eprintln!(
        "decode timeline at context {context}: {} block records -> {path}",
        recs.len()
    );
    Ok(())
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
        Ok(kestrel::ops::argmax(&logits[..self.1.min(logits.len())]).unwrap_or(0) as u32)
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
    max_chunk: Option<usize>,
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
    let mut prefill_chunk = None; // the GPU's, for the JSON
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
            let max_chunk = match max_chunk {
                Some(c) => c.max(1),
                None => kestrel::cuda::model::CudaModel::pick_chunk(
                    &gpu,
                    &cfg,
                    max_seq,
                    &PREFILL_CHUNKS,
                )?,
            };
            eprintln!("prefill chunk: {max_chunk} tokens");
            prefill_chunk = Some(max_chunk);
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
                // Written after every context, so a run cut short keeps what it measured.
                write_bench_json(
                    json.as_deref(),
                    &rows,
                    &gpu.name,
                    &weights_label,
                    copy_bw,
                    prefill_chunk,
                )?;
                if let Ok(prefix) = std::env::var("KESTREL_TRACE_OUT") {
                    trace_decode(&m, c, vocab_limit, &prefix)?;
                }
            }
            let prof = gpu.take_profile();
            if !prof.is_empty() {
                let total: f64 = prof.iter().map(|p| p.seconds).sum();
                eprintln!(
                    "profile (GPU time per op and grid, CUDA events; all contexts, all rounds):"
                );
                for p in prof.iter().take(45) {
                    eprintln!(
                        "  {:<32} {:>8} calls {:>10.3} ms {:>6.1}%  {:>8.1} us/call (min {:.1}, max {:.1})",
                        p.op,
                        p.calls,
                        p.seconds * 1e3,
                        100.0 * p.seconds / total,
                        p.seconds * 1e6 / p.calls as f64,
                        p.min * 1e6,
                        p.max * 1e6
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
    write_bench_json(
        json.as_deref(),
        &rows,
        &device_name,
        &weights_label,
        copy_bw,
        prefill_chunk,
    )?;
    Ok(())
}

fn write_bench_json(
    path: Option<&Path>,
    rows: &[kestrel::bench::BenchRow],
    device: &str,
    weights: &str,
    copy_bw: f64,
    prefill_chunk: Option<usize>,
) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let report = serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": std::env::var("KESTREL_COMMIT").unwrap_or_else(|_| "unknown".into()),
        "date": utc_date(),
        "device": device,
        "weights": weights,
        "copy_bandwidth_bytes_per_s": copy_bw,
        "prefill_chunk": prefill_chunk,
        "contract": "batch 1, greedy, prompt[i] = ((i*2654435761) mod 2^32) mod vocab, exact-shape warm-up, TTFT prefill, 64 decode steps, median of 2 rounds",
        "rows": rows,
    });
    std::fs::write(path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("cannot write {}", path.display()))
}
