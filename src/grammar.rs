//! Structured outputs: a reply's answer constrained to a JSON schema (or to any JSON object)
//! through `llguidance`, token by token.
//!
//! * [`GrammarEngine`]: the tokenizer's vocabulary as `llguidance` sees it (built once; every
//!   added token such as `<think>` or `<tool_call>` is special, so a grammar never produces
//!   one) and the compiler of a [`Constraint`] into a matcher; a bad schema is an error
//!   naming the problem, found when the request arrives.
//! * [`Guide`]: one sequence's matcher on a thread of its own. After each committed id it
//!   computes the next token mask at once, so the mask is being computed while the model
//!   runs that id; the draw waits for it only when it needs it ([`PendingMask::get`]), which
//!   on the GPU is after the step's kernels were launched ([`PendingMask::get_after`]: only
//!   the wait past the step's end is a cost, and only it counts as waited).
//!
//! A mask is a bitmask of the vocabulary: bit `i % 32` of word `i / 32` set when id `i` is
//! allowed ([`mask_words`] words). The decode loop ([`crate::generate::DecodeLoop`]) applies
//! it only outside the thinking block: the reasoning stays free text.

use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, anyhow};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What a reply's answer must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema (`response_format: {"type": "json_schema"}`).
    JsonSchema(Value),
}

/// Strict tool calls: the calls of the request's tools (`tools[i].function.strict: true`
/// ones with their arguments constrained to their `parameters` schema), in the model's
/// `<tool_call>` format. The answer around the calls stays free; the constraint applies from
/// each `<tool_call>` to its `</tool_call>`.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCalls {
    /// OpenAI `tools` entries.
    pub tools: Vec<Value>,
    /// Text of the call the prompt already holds after `<tool_call>` (`tool_choice`
    /// required or named forces `\n<function=` or `\n<function=NAME>\n`): the reply starts
    /// inside a call.
    pub started: Option<String>,
}

impl ToolCalls {
    /// The constraint of `tools` where any is strict.
    pub fn of(tools: &[Value]) -> Option<ToolCalls> {
        tools
            .iter()
            .any(|t| t.pointer("/function/strict") == Some(&Value::Bool(true)))
            .then(|| ToolCalls {
                tools: tools.to_vec(),
                started: None,
            })
    }
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// A parameter's value rule in the call format (`\nVALUE\n</parameter>\n` after the
/// parameter's tag): a string is raw text (one of an enum's strings, where it has one), any
/// other schema JSON.
fn value_rule(name: &str, schema: &Value) -> String {
    const END: &str = "\n</parameter>\n";
    let enum_strings: Option<Vec<&str>> = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.iter().map(Value::as_str).collect());
    if let Some(e) = enum_strings.filter(|e| !e.is_empty()) {
        let alts: Vec<String> = e.iter().map(|s| lit(s)).collect();
        return format!("{name}: ({}) {}\n", alts.join(" | "), lit(END));
    }
    if schema.get("type").and_then(Value::as_str) == Some("string") {
        return format!("{name}[suffix={}]: /(?s:.*)/\n", lit(END));
    }
    let mut s = schema.clone();
    if let Value::Object(o) = &mut s {
        o.insert("x-guidance".into(), layout());
    }
    format!("{name}: %json {s} {}\n", lit(END))
}

/// The Lark grammar of one call's text after `<tool_call>`, up to and including the
/// `</tool_call>` token (`close`): a strict tool's parameters in its schema's order, the
/// required ones always and the others optionally, each value by [`value_rule`]; a
/// non-strict tool's body free up to `</function>`.
fn tool_call_lark(tools: &[Value], close: u32) -> Result<String, String> {
    let mut rules = String::new();
    let mut calls = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("tools[{i}] has no function name"))?;
        let head = lit(&format!("{name}>\n"));
        let strict = f.get("strict") == Some(&Value::Bool(true));
        if !strict {
            rules.push_str(&format!(
                "call_{i}: {head} body_{i} <[{close}]>\nbody_{i}[suffix={}]: /(?s:.*)/\n",
                lit("</function>\n")
            ));
            calls.push(format!("call_{i}"));
            continue;
        }
        let params = f.get("parameters").cloned().unwrap_or(json!({}));
        let props = params.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = params
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut seq = Vec::new();
        for (j, (pname, pschema)) in props.into_iter().flatten().enumerate() {
            let tag = lit(&format!("<parameter={pname}>\n"));
            rules.push_str(&format!("param_{i}_{j}: {tag} value_{i}_{j}\n"));
            rules.push_str(&value_rule(&format!("value_{i}_{j}"), pschema));
            seq.push(if required.contains(&pname.as_str()) {
                format!("param_{i}_{j}")
            } else {
                format!("param_{i}_{j}?")
            });
        }
        rules.push_str(&format!(
            "call_{i}: {head} {} {} <[{close}]>\n",
            seq.join(" "),
            lit("</function>\n")
        ));
        calls.push(format!("call_{i}"));
    }
    if calls.is_empty() {
        return Err("no tools".into());
    }
    Ok(format!(
        "start: {} ({})\n{rules}",
        lit("\n<function="),
        calls.join(" | ")
    ))
}

/// Words of a mask over `vocab` ids.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether `mask` allows id `id` (ids past the mask are not allowed).
pub fn allowed(mask: &[u32], id: u32) -> bool {
    mask.get(id as usize / 32)
        .is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// Sets every logit `mask` does not allow to −∞ (the host's masking; the GPU's is the
/// `sample_mask` kernel).
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// The JSON layout every constraint uses: `", "` and `": "` separators and no other
/// whitespace, so output stays compact and a model cannot wander into endless whitespace.
fn layout() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

impl Constraint {
    fn schema(&self) -> Value {
        let mut s = match self {
            Constraint::JsonObject => json!({"type": "object"}),
            Constraint::JsonSchema(s) => s.clone(),
        };
        if let Value::Object(o) = &mut s {
            o.insert("x-guidance".into(), layout());
        }
        s
    }
}

/// The vocabulary and compiler, shared by every constrained request.
pub struct GrammarEngine {
    factory: ParserFactory,
    vocab: usize,
    eos: u32,
}

impl GrammarEngine {
    /// The engine for `tok` over a model vocabulary of `vocab` ids (the embedding's rows:
    /// ids the tokenizer does not define are never allowed); `eos` ends a finished answer.
    pub fn new(tok: &Tokenizer, vocab: usize, eos: u32) -> Result<Self> {
        let json: Value =
            serde_json::from_str(&tok.to_json()?).context("the tokenizer's JSON does not parse")?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        words.resize(vocab, Vec::new());
        // Added tokens (<|im_end|>, <think>, <tool_call>, ...) are markers, never text a
        // grammar may produce: special in llguidance's terms.
        for t in json["added_tokens"].as_array().into_iter().flatten() {
            let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
                continue;
            };
            if let Some(w) = words.get_mut(id as usize) {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(content.as_bytes());
                *w = b;
            }
        }
        anyhow::ensure!(
            (eos as usize) < vocab,
            "the end token {eos} is past the vocabulary ({vocab})"
        );
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(GrammarEngine {
            factory,
            vocab,
            eos,
        })
    }

    /// The engine of the server's tokenizer (`<|im_end|>` ends an answer), built once.
    pub fn shared(tok: &Tokenizer, vocab: usize) -> Result<Arc<GrammarEngine>> {
        let eos = tok
            .token_to_id("<|im_end|>")
            .ok_or_else(|| anyhow!("the tokenizer has no <|im_end|>"))?;
        Ok(Arc::new(Self::new(tok, vocab, eos)?))
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    fn matcher(&self, c: &Constraint) -> Result<Matcher, String> {
        // Up to two newlines may come first: what a model writes after `</think>`.
        let grammar = TopLevelGrammar::from_lark(format!(
            "start: NL? answer\nNL: /\\n{{1,2}}/\nanswer: %json {}\n",
            c.schema()
        ));
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }

    /// Compiles `c` (the check a request's schema gets before it is admitted): the
    /// compiler's message when it cannot be used.
    pub fn check(&self, c: &Constraint) -> Result<(), String> {
        self.matcher(c).map(drop)
    }

    /// The gate of strict tool calls `t` (its grammar compiled now: an error names the
    /// problem); `open` / `close` are the `<tool_call>` / `</tool_call>` ids.
    pub fn tool_calls(&self, t: &ToolCalls, open: u32, close: u32) -> Result<ToolGate, String> {
        let lark = tool_call_lark(&t.tools, close)?;
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let mut gate = ToolGate {
            matcher,
            vocab: self.vocab,
            eos: self.eos,
            open,
            close,
            active: None,
        };
        if let Some(text) = &t.started {
            let mut m = gate.matcher.clone();
            let ids = self.factory.tok_env().tokenize_bytes(text.as_bytes());
            m.consume_tokens(&ids).map_err(|e| {
                format!("the forced start of the call {text:?} does not fit the tools: {e}")
            })?;
            gate.active = Some(Guide::start(m, self.vocab, self.eos));
        }
        Ok(gate)
    }

    /// A sequence's guide for `c`, computing its first mask already.
    pub fn guide(&self, c: &Constraint) -> Result<Guide, String> {
        let m = self.matcher(c)?;
        Ok(Guide::start(m, self.vocab, self.eos))
    }
}

/// A mask as the guide's thread sends it: the words and how long they took to compute.
type Computed = (Vec<u32>, Duration);

/// A mask still being computed (or computed): [`get`](Self::get) waits for it.
pub struct PendingMask {
    rx: Mutex<Receiver<Computed>>,
    mask: OnceLock<Computed>,
    /// How long the first [`get`](Self::get) waited for the guide's thread.
    waited: OnceLock<Duration>,
    /// What is allowed if the guide's thread is gone: the end token only.
    words: usize,
    eos: u32,
}

impl PendingMask {
    /// A mask already known (tests, callers with a fixed set of ids).
    pub fn ready(mask: Vec<u32>) -> PendingMask {
        let words = mask.len();
        PendingMask {
            rx: Mutex::new(channel().1),
            mask: OnceLock::from((mask, Duration::ZERO)),
            waited: OnceLock::from(Duration::ZERO),
            words,
            eos: 0,
        }
    }

    /// The mask: bit `i` of the vocabulary set where id `i` is allowed.
    pub fn get(&self) -> &[u32] {
        &self.computed().0
    }

    /// How long the guide's thread took to commit the previous id and compute this mask
    /// (waits for it): the constraint's cost per token, whether or not it was hidden behind
    /// the model's step.
    pub fn compute_time(&self) -> Duration {
        self.computed().1
    }

    /// How long the draw waited for the mask (the part of its cost not hidden behind the
    /// model's step); waits for it.
    pub fn waited(&self) -> Duration {
        self.computed();
        self.waited.get().copied().unwrap_or_default()
    }

    /// The mask, for a draw that asks for it while the model's step may still be running
    /// (the GPU's, whose kernels were queued): the draw polls for the mask (no thread
    /// wake-up on its path, before or after the step ends) and takes it the moment it
    /// arrives; only the time after `busy()` first said the step was done counts as waited,
    /// since the step hid the rest.
    pub fn get_after(&self, busy: impl Fn() -> bool) -> &[u32] {
        if let Some(c) = self.mask.get() {
            return &c.0;
        }
        let (c, waited) = {
            let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
            let mut idle: Option<Instant> = None;
            loop {
                match rx.try_recv() {
                    Ok(c) => break (c, idle.map_or(Duration::ZERO, |t| t.elapsed())),
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        break (
                            (only(self.words, self.eos), Duration::ZERO),
                            idle.map_or(Duration::ZERO, |t| t.elapsed()),
                        );
                    }
                    Err(std::sync::mpsc::TryRecvError::Empty) => {
                        if idle.is_none() && !busy() {
                            idle = Some(Instant::now());
                        }
                        // yielding: on few cores the guide's thread may want this one
                        std::thread::yield_now();
                    }
                }
            }
        };
        let _ = self.waited.set(waited);
        &self.mask.get_or_init(|| c).0
    }

    fn computed(&self) -> &Computed {
        self.mask.get_or_init(|| {
            let t = Instant::now();
            let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
            let c = rx
                .recv()
                .unwrap_or_else(|_| (only(self.words, self.eos), Duration::ZERO));
            let _ = self.waited.set(t.elapsed());
            c
        })
    }
}

fn only(words: usize, id: u32) -> Vec<u32> {
    let mut m = vec![0u32; words];
    if let Some(w) = m.get_mut(id as usize / 32) {
        *w |= 1 << (id % 32);
    }
    m
}

/// One sequence's constraint: its matcher on a thread that computes the mask after every
/// committed id.
pub struct Guide {
    tx: Option<Sender<(u32, Sender<Computed>)>>,
    next: PendingMask,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The mask the matcher gives now (words of the vocabulary), or the end token alone when it
/// has stopped or failed (a failure is logged).
fn compute(m: &mut Matcher, words: usize, eos: u32) -> Vec<u32> {
    match m.compute_mask_or_eos() {
        Ok(v) => {
            let mut out = v.as_slice().to_vec();
            out.resize(words, 0);
            if out.iter().all(|&w| w == 0) {
                out = only(words, eos);
            }
            out
        }
        Err(e) => {
            tracing::warn!("structured output: the grammar failed ({e}); ending the answer");
            only(words, eos)
        }
    }
}

impl Guide {
    fn start(mut m: Matcher, vocab: usize, eos: u32) -> Guide {
        let words = mask_words(vocab);
        let (tx, rx) = channel::<(u32, Sender<Computed>)>();
        let (first_tx, first_rx) = channel();
        let thread = std::thread::Builder::new()
            .name("kestrel-grammar".into())
            .spawn(move || {
                let t = Instant::now();
                let _ = first_tx.send((compute(&mut m, words, eos), t.elapsed()));
                while let Ok((id, reply)) = rx.recv() {
                    let t = Instant::now();
                    // the end token ends the answer (and the reply): nothing to parse
                    if id == eos {
                        let _ = reply.send((only(words, eos), t.elapsed()));
                        continue;
                    }
                    if let Err(e) = m.consume_token(id) {
                        tracing::warn!("structured output: id {id} was refused ({e})");
                    }
                    let _ = reply.send((compute(&mut m, words, eos), t.elapsed()));
                }
            })
            .ok();
        Guide {
            tx: Some(tx),
            next: PendingMask {
                rx: Mutex::new(first_rx),
                mask: OnceLock::new(),
                waited: OnceLock::new(),
                words,
                eos,
            },
            thread,
        }
    }

    /// The mask of the next id (computing, or computed).
    pub fn next_mask(&self) -> &PendingMask {
        &self.next
    }

    /// Records the id chosen under [`next_mask`](Self::next_mask) and starts computing the
    /// mask after it.
    pub fn commit(&mut self, id: u32) {
        let (reply, rx) = channel();
        if let Some(tx) = &self.tx {
            let _ = tx.send((id, reply));
        }
        self.next = PendingMask {
            rx: Mutex::new(rx),
            mask: OnceLock::new(),
            waited: OnceLock::new(),
            words: self.next.words,
            eos: self.next.eos,
        };
    }
}

impl Drop for Guide {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a sequence's masks cost: how many, their compute time (commit + mask on the guide's
/// thread) and how long the draws waited for them (the part on the decode step's path).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MaskCost {
    pub masks: usize,
    pub compute: Duration,
    pub waited: Duration,
    pub max_waited: Duration,
}

impl MaskCost {
    /// Counts `m`, a mask an id was just picked under.
    pub fn add(&mut self, m: &PendingMask) {
        let w = m.waited();
        self.masks += 1;
        self.compute += m.compute_time();
        self.waited += w;
        self.max_waited = self.max_waited.max(w);
    }
}

/// Strict tool calls of one sequence: dormant in free text, a [`Guide`] from each
/// `<tool_call>` the model writes (its first mask computed while the model runs that id) to
/// the `</tool_call>` the grammar ends with.
pub struct ToolGate {
    matcher: Matcher,
    vocab: usize,
    eos: u32,
    open: u32,
    close: u32,
    active: Option<Guide>,
}

impl ToolGate {
    /// The mask of the next id, inside a call.
    pub fn next_mask(&self) -> Option<&PendingMask> {
        self.active.as_ref().map(Guide::next_mask)
    }

    /// Records an id of the answer (picked under [`next_mask`](Self::next_mask) inside a
    /// call): a `<tool_call>` opens a call, its `</tool_call>` closes it.
    pub fn observe(&mut self, id: u32) {
        match &mut self.active {
            Some(_) if id == self.close => self.active = None,
            Some(g) => g.commit(id),
            None if id == self.open => {
                self.active = Some(Guide::start(self.matcher.clone(), self.vocab, self.eos));
            }
            None => {}
        }
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}
