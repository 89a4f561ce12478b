//! The flags shared by several commands, and their value parsers.

use clap::{Args, ValueEnum};
use kestrel::sampling::check;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Device {
    Cpu,
    Cuda,
}

#[derive(Args, Clone, Debug)]
pub(super) struct ModelArgs {
    /// Checkpoint directory, or a Hugging Face repo id (`Qwen/Qwen3.6-35B-A3B`, optionally
    /// `@revision`) resolved offline in the local Hugging Face cache. Without it, the bundled
    /// demo model (random weights) runs.
    #[arg(long)]
    pub(super) model: Option<String>,
    /// `full` (bf16), `full-fp8` (the official FP8 layout) or `full-int4` (affine 4-bit,
    /// MLX's group 64): seeded random weights of the exact 40-layer Qwen3.6-35B-A3B shape, made
    /// on the GPU (--device cuda), in place of a checkpoint: for load tests and benchmarks, the
    /// text is gibberish.
    #[arg(long, conflicts_with = "model", value_parser = ["full", "full-fp8", "full-int4"])]
    pub(super) synthetic: Option<String>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub(super) device: Device,
    /// Context limit in tokens (prompt + reply), at most the model's maximum positions.
    #[arg(long, allow_negative_numbers = true, default_value_t = 32_768, value_parser = clap::value_parser!(u64).range(2..))]
    pub(super) max_seq: u64,
    /// CUDA device ordinal to run on, with --device cuda (default 0). Ordinals count the
    /// devices CUDA_VISIBLE_DEVICES leaves visible, renumbered from 0, so `--gpu 1` and
    /// `CUDA_VISIBLE_DEVICES=1` (with the default `--gpu 0`) pick the same physical GPU.
    #[arg(long, value_name = "N")]
    pub(super) gpu: Option<usize>,
    /// Do not read the weights up front (pages load from disk on first use instead).
    #[arg(long)]
    pub(super) lazy_load: bool,
    /// Only the generated text: no banner, progress bar or stats line.
    #[arg(long, short)]
    pub(super) quiet: bool,
    /// Speculative decoding: `mtp` drafts tokens with the checkpoint's multi-token-prediction
    /// head and verifies them in one step of the main model (lossless: greedy output is the
    /// same, sampled output has the same distribution). CPU only for now.
    #[arg(long, value_parser = ["mtp"])]
    pub(super) speculative: Option<String>,
    /// With --speculative mtp: tokens the head drafts per step.
    #[arg(long, default_value_t = 2, requires = "speculative", value_parser = clap::value_parser!(u64).range(1..=16))]
    pub(super) draft_tokens: u64,
}

impl ModelArgs {
    /// What `--speculative` / `--draft-tokens` ask for.
    pub(super) fn speculative(&self) -> Option<kestrel::generate::Speculative> {
        self.speculative
            .as_ref()
            .map(|_| kestrel::generate::Speculative {
                draft_tokens: self.draft_tokens as usize,
                forced: None,
            })
    }
}

#[derive(Args, Clone, Debug)]
pub(super) struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub(super) bind: String,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1 endpoints. A key on
    /// the command line is visible to other users in `ps`: prefer --api-key-file.
    #[arg(long, conflicts_with = "api_key_file")]
    pub(super) api_key: Option<String>,
    /// Read the API key from this file (its first line, surrounding whitespace removed).
    /// Without --api-key or --api-key-file, the environment variable KESTREL_API_KEY (when
    /// set and not empty) is the key.
    #[arg(long, value_name = "PATH")]
    pub(super) api_key_file: Option<std::path::PathBuf>,
    /// Answer cross-origin (browser) requests from ORIGIN (`scheme://host[:port]`) with CORS
    /// headers; repeatable or a comma list; `*` allows any origin. Without it, cross-origin
    /// requests get no CORS headers and their preflights 403.
    #[arg(long, value_name = "ORIGIN", value_delimiter = ',')]
    pub(super) allow_origin: Vec<String>,
    /// No access log line (method, path, status, duration, tokens) per request.
    #[arg(long)]
    pub(super) no_access_log: bool,
    /// Bytes of sequence states the prefix cache keeps (K, M, G suffixes allowed).
    #[arg(long, default_value = "4G", value_parser = parse_bytes)]
    pub(super) cache_mem: u64,
    /// Seconds a request may take, queueing included, before it is stopped.
    #[arg(long, default_value_t = 600)]
    pub(super) request_timeout: u64,
    /// The model id clients send (default: the --model value, or `kestrel-demo`).
    #[arg(long)]
    pub(super) served_model_name: Option<String>,
    /// Tokens per reply when a chat request gives no max_tokens [default: 4096; 64 for
    /// the demo model].
    #[arg(long)]
    pub(super) default_max_tokens: Option<usize>,
    /// Requests that may wait for the model; more are refused with 429.
    #[arg(long, default_value_t = 1024)]
    pub(super) max_queue: usize,
    /// Sequences generated at once, one batched decode step a token (each holds its own
    /// state) [default: on the GPU up to 64, as many as the requests' reserved memory fits,
    /// said at start; 4 on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) max_running: Option<u64>,
    /// Prompt tokens one round prefills at most, over all the prompts being prefilled: the
    /// decoding sequences' next token waits for that much. Smaller bounds their inter-token
    /// latency while a long prompt is admitted. Larger prefills bursts of prompts faster.
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) prefill_per_round: u64,
    /// Largest request body (K, M, G suffixes allowed); larger is refused with 413 (one whose
    /// Content-Length says so before any of it is read).
    #[arg(long, default_value = "32M", value_parser = parse_bytes)]
    pub(super) max_body: u64,
    /// Seconds a client has to send a request's headers, from connecting or from the end of
    /// its previous response (so also how long an idle keep-alive connection stays open).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) header_timeout: u64,
    /// Seconds a client has to send a request's body once its headers are in (408 after).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) body_timeout: u64,
    /// Connections served as usual at once; beyond it each still gets one request, which it
    /// must send within a second (so /health keeps answering), and is then closed.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) max_connections: u64,
    /// Seconds a graceful stop (SIGTERM or Ctrl-C) waits for the requests already taken to
    /// finish; new ones get 503 meanwhile. Those still open then end with a 503 error (an
    /// `error` event when streaming). A second signal exits at once.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub(super) drain_timeout: u64,
}

#[derive(Args, Clone, Debug)]
pub(super) struct GenArgs {
    /// Maximum generated tokens per reply [default: 4096; 64 for the demo model].
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) max_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy [default: generation_config.json's when it samples
    /// (do_sample), else 0].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_temperature)]
    pub(super) temperature: Option<f32>,
    /// Keep only the K most likely tokens; 0 is off [default: generation_config.json, else 0].
    #[arg(long, allow_negative_numbers = true)]
    pub(super) top_k: Option<usize>,
    /// Nucleus sampling mass, in (0, 1] [default: generation_config.json, else 1].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_top_p)]
    pub(super) top_p: Option<f32>,
    /// Drop tokens less likely than MIN_P times the most likely one, in [0, 1]
    /// [default: generation_config.json, else 0].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_min_p)]
    pub(super) min_p: Option<f32>,
    /// Repetition penalty (> 0; 1 is off) on tokens of the reply so far.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_repetition_penalty)]
    pub(super) repetition_penalty: Option<f32>,
    /// Presence penalty in [-2, 2] on tokens of the reply so far.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_presence_frequency)]
    pub(super) presence_penalty: Option<f32>,
    /// Frequency penalty in [-2, 2] on tokens of the reply so far.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_presence_frequency)]
    pub(super) frequency_penalty: Option<f32>,
    /// Random seed: the same seed gives the same output on the same backend [default: random].
    #[arg(long, allow_negative_numbers = true)]
    pub(super) seed: Option<u64>,
    /// Stop when the reply contains this text (not printed). Repeatable; `\n`, `\t` and `\\`
    /// are unescaped.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_stop)]
    pub(super) stop: Vec<String>,
    /// Think before answering (the template's enable_thinking; the model's default).
    #[arg(long, conflicts_with = "no_think")]
    pub(super) think: bool,
    /// Answer without thinking (enable_thinking=false).
    #[arg(long)]
    pub(super) no_think: bool,
    /// Close the thinking block after this many tokens (feeds `</think>\n\n`).
    #[arg(long, allow_negative_numbers = true)]
    pub(super) thinking_budget: Option<usize>,
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
