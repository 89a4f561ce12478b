//! `kestrel generate`, and the sampling setup and reply printing it shares with `chat`.

use super::args::{GenArgs, ModelArgs};
use super::{CANCEL, Generating, Loaded, PREFILL_CHUNK};
use anyhow::{Result, bail};
use kestrel::config::GenerationConfig;
use kestrel::generate::{
    Channel, GenerateOptions, GenerationStats, ReplySettings, StopReason, ThinkingControl, reply,
};
use kestrel::model::Engine;
use kestrel::sampling::SamplingParams;
use kestrel::session::{Conversation, chat_turn};
use std::io::{IsTerminal, Write};

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
pub(super) struct Setup {
    pub(super) settings: ReplySettings,
    pub(super) params: SamplingParams,
    pub(super) seed: u64,
}

pub(super) fn setup<E: Engine>(
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
                speculative: model.speculative(),
            },
            stop_strings: opts.stop.clone(),
            think_ids,
        },
        params,
        seed,
    })
}

pub(super) fn enable_thinking(opts: &GenArgs) -> Option<bool> {
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
pub(super) struct Printer {
    color: bool,
    channel: Option<Channel>,
    line_start: bool,
}

impl Printer {
    pub(super) fn new() -> Self {
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

    pub(super) fn text(&mut self, ch: Channel, text: &str) -> std::io::Result<()> {
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

pub(super) fn stats_line(s: &GenerationStats) -> String {
    // With speculation: drafts accepted over proposed, and tokens a verification step gave.
    let spec = if s.spec.steps > 0 {
        format!(
            ", mtp acceptance {:.1}% ({}/{}), {:.2} tokens/step",
            100.0 * s.spec.acceptance(),
            s.spec.accepted,
            s.spec.drafted,
            s.spec.tokens_per_step()
        )
    } else {
        String::new()
    };
    format!(
        "[prompt {} tokens, cached {}, ttft {:.1} ms, prefill {:.1} tok/s, decode {:.1} tok/s, generated {} tokens{spec}, stop: {}]",
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
pub(super) fn finish_output(printer: &mut Printer, result: Result<()>) -> Result<bool> {
    let result = result.and_then(|_| printer.end().map_err(Into::into));
    match result {
        Ok(()) => Ok(true),
        Err(e) => match e.downcast_ref::<std::io::Error>() {
            Some(io) if io.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
            _ => Err(e),
        },
    }
}

pub(super) fn generate_cmd<E: Engine>(
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
        let mut state = engine.new_state()?;
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
