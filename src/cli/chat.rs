//! `kestrel chat`: the interactive multi-turn loop.

use super::args::{GenArgs, ModelArgs};
use super::generate::{Printer, Setup, enable_thinking, finish_output, setup, stats_line};
use super::{CANCEL, Generating, Loaded};
use anyhow::{Result, bail};
use kestrel::generate::GenerationStats;
use kestrel::model::Engine;
use kestrel::session::{Conversation, chat_turn};
use std::io::{BufRead, IsTerminal, Write};

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

pub(super) fn chat_cmd<E: Engine>(
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
