//! Handing a validated request to the model thread: its [`ReplySettings`], the queue
//! ([`submit`]), and the model's events read back in the API's terms.

use super::Shared;
use super::api::{ApiError, GenParams, ResponseMeta};
use super::http::unix_now;
use super::worker::{Event, Job};
use crate::generate::{GenerateOptions, ReplySettings, StopReason, ThinkingControl};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// The error for a request whose model-thread channel closed without an answer.
pub(super) fn model_gone() -> ApiError {
    ApiError::new(500, "server_error", "the model thread dropped the request")
}

/// [`model_gone`] as the event a stream reports when its channel closes unanswered.
pub(super) fn gone_event() -> Event {
    let e = model_gone();
    Event::Error {
        status: e.status,
        message: e.message,
    }
}

pub(super) fn context_error(s: &Shared, n: usize, param: &str) -> ApiError {
    context_error_msg(s, &n.to_string(), param)
}

fn context_error_msg(s: &Shared, n: &str, param: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {} tokens, but the prompt is {n} tokens. Shorten the prompt.",
            s.config.max_seq
        ),
    )
    .with_code("context_length_exceeded")
}

/// A `max_tokens` the context cannot hold whatever the prompt (at least the whole context):
/// refused before any rendering or tokenizing.
pub(super) fn max_tokens_cap(s: &Shared, max_tokens: Option<usize>) -> Result<(), ApiError> {
    if let Some(m) = max_tokens
        && m >= s.config.max_seq
    {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "`max_tokens` is {m}, but this model's maximum context length is {} tokens (prompt and reply together); ask for fewer",
                s.config.max_seq
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// The prompt and an explicit `max_tokens` must fit the context together (OpenAI's
/// `context_length_exceeded`). A `max_tokens` left to the server's default is not checked:
/// the reply then stops where the context ends (`finish_reason` `length`).
pub(super) fn fits_context(
    s: &Shared,
    prompt: usize,
    max_tokens: Option<usize>,
    what: &str,
) -> Result<(), ApiError> {
    if let Some(m) = max_tokens
        && prompt + m > s.config.max_seq
    {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({prompt} in the {what}, {m} in the completion). Please reduce the length of the {what} or completion.",
                s.config.max_seq,
                prompt + m
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// The context check before any tokenizing: text of `bytes` bytes (that the prompt surely
/// holds) is at least `bytes / max_token_bytes` tokens, so a prompt far over the limit is
/// refused at once, with bounded work and memory.
pub(super) fn context_floor(s: &Shared, bytes: usize, param: &str) -> Result<(), ApiError> {
    let floor = bytes / s.max_token_bytes;
    if floor >= s.config.max_seq {
        return Err(context_error_msg(s, &format!("at least {floor}"), param));
    }
    Ok(())
}

/// Bytes of text tokenized at once, at most `cap` (a longer text waits until it is alone):
/// the tokenizer's working memory is some 100 times its text, so this, not the number of
/// requests, bounds it.
pub(crate) struct TextBudget {
    cap: usize,
    used: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
}

impl TextBudget {
    pub(crate) fn new(cap: usize) -> Self {
        TextBudget {
            cap,
            used: std::sync::Mutex::new(0),
            freed: std::sync::Condvar::new(),
        }
    }

    /// `f`, once `bytes` more fit the budget (blocks meanwhile: call it off the async
    /// workers).
    pub(crate) fn run<T>(&self, bytes: usize, f: impl FnOnce() -> T) -> T {
        let need = bytes.min(self.cap);
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        while *used + need > self.cap {
            used = self.freed.wait(used).unwrap_or_else(|p| p.into_inner());
        }
        *used += need;
        drop(used);
        // given back on the way out, a panic included
        struct Release<'a>(&'a TextBudget, usize);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                let mut used = self.0.used.lock().unwrap_or_else(|p| p.into_inner());
                *used -= self.1;
                self.0.freed.notify_all();
            }
        }
        let _release = Release(self, need);
        f()
    }
}

/// A prompt's (or a text's) ids: the context floor first ([`context_floor`]: a text that
/// cannot fit is refused without tokenizing), then the tokenizer within the server's
/// [`TextBudget`]. Every endpoint that tokenizes request text goes through here (blocking:
/// call it off the async workers).
pub(super) fn encode_bounded(
    s: &Shared,
    text: &str,
    parse_special: bool,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    context_floor(s, text.len(), param)?;
    // A text much longer than a full context of typical tokens: its head first. Cut before
    // a space that follows a non-space character, the head's tokens are exactly the
    // text's first tokens (no token or pre-tokenizer piece spans such a cut), so a head
    // already over the limit (with a margin) refuses the text without tokenizing the rest.
    let head = HEAD_BYTES_PER_TOKEN * s.config.max_seq;
    if text.len() > 2 * head
        && let Some(cut) = head_cut(text, head)
    {
        let n = s
            .tokenizing
            .run(cut, || s.tokenizer.encode(&text[..cut], parse_special))
            .map_err(|e| ApiError::new(500, "server_error", format!("{e:#}")))?
            .len();
        if n >= s.config.max_seq + HEAD_MARGIN {
            return Err(context_error_msg(s, &format!("at least {n}"), param));
        }
    }
    s.tokenizing
        .run(text.len(), || {
            let ids = s.tokenizer.encode(text, parse_special);
            if text.len() >= TRIM_AFTER {
                give_back_free_memory();
            }
            ids
        })
        .map_err(|e| ApiError::new(500, "server_error", format!("{e:#}")))
}

/// Bytes a token of the head check ([`encode_bounded`]): 16, some four times ordinary text's.
const HEAD_BYTES_PER_TOKEN: usize = 16;
/// Tokens past the limit the head must have to refuse its text.
const HEAD_MARGIN: usize = 16;

/// Where the head of `text` ends: the first byte at or after `at` (within 64 KiB) that is a
/// space following a character that is not whitespace; `None` where there is none.
fn head_cut(text: &str, at: usize) -> Option<usize> {
    let b = text.as_bytes();
    (at.max(1)..b.len().min(at + (64 << 10))).find(|&i| {
        b[i] == b' '
            && text.is_char_boundary(i)
            && text[..i]
                .chars()
                .next_back()
                .is_some_and(|c| !c.is_whitespace())
    })
}

/// Text bytes after whose tokenizing the allocator is asked to return free memory.
const TRIM_AFTER: usize = 1 << 20;

/// Returns the allocator's free pages to the system (glibc's `malloc_trim`, every arena). A
/// long text's tokenizing frees hundreds of MB on the blocking thread that ran it, which
/// glibc keeps resident in that thread's arena: without this, long prompts tokenized one at
/// a time on different threads raised the resident set by their peak each (8 prompts of 4
/// MB: 0.44 -> 3.0 GB).
fn give_back_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: glibc's malloc_trim takes any pad and only releases free memory.
        unsafe {
            malloc_trim(0);
        }
    }
}

pub(super) fn settings(
    s: &Shared,
    params: &GenParams,
    default_max: usize,
    chat: bool,
) -> Result<ReplySettings, ApiError> {
    let think_ids = if chat { s.think_ids } else { None };
    let thinking = match (think_ids, params.thinking_budget) {
        (Some((open_id, close_id)), budget) => Some(ThinkingControl {
            open_id,
            close_id,
            budget,
            close_ids: s.close_think_ids.clone(),
        }),
        (None, Some(_)) => {
            return Err(ApiError::invalid(
                "thinking_budget",
                "`thinking_budget` only applies to chat completions",
            ));
        }
        (None, None) => None,
    };
    Ok(ReplySettings {
        opts: GenerateOptions {
            max_tokens: params.max_tokens.unwrap_or(default_max),
            stop_ids: s.stop_ids.clone(),
            prefill_chunk: s.config.prefill_chunk,
            max_seq: s.config.max_seq,
            thinking,
            device_greedy: crate::generate::device_greedy_allowed(),
            speculative: s.config.speculative.clone(),
        },
        stop_strings: params.stop.clone(),
        think_ids,
    })
}

/// Sets the cancel flag when dropped: the handler or its response stream went away.
pub(super) struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn fresh_seed(s: &Shared) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    t ^ s
        .next_id
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A queued job's receiving side.
pub(super) struct Submitted {
    pub(super) rx: UnboundedReceiver<Event>,
    pub(super) guard: CancelOnDrop,
    pub(super) cached_tokens: usize,
}

/// `f` with the grammar engine, on a blocking thread (compiling a schema can take long): the
/// engine's own failure is a 500, `f`'s error the request's.
async fn with_grammar<T: Send + 'static>(
    s: &Arc<Shared>,
    f: impl FnOnce(&Shared, &crate::grammar::GrammarEngine) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || {
        let engine = s
            .grammar()
            .map_err(|e| ApiError::new(500, "server_error", format!("structured outputs: {e}")))?;
        f(&s, &engine)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            500,
            "server_error",
            format!("schema compilation failed: {e}"),
        )
    })?
}

/// The structured-output guide of `c`: a schema the grammar engine cannot use is the
/// request's error (400, naming the problem).
async fn guide(
    s: &Arc<Shared>,
    c: &crate::grammar::Constraint,
) -> Result<crate::grammar::Guide, ApiError> {
    let c = c.clone();
    with_grammar(s, move |_, engine| {
        engine.guide(&c).map_err(|e| {
            let param = match c {
                crate::grammar::Constraint::JsonObject => "response_format",
                crate::grammar::Constraint::JsonSchema(_) => "response_format.json_schema.schema",
            };
            ApiError::invalid(param, format!("`{param}` cannot be used: {e}"))
        })
    })
    .await
}

/// The strict tool calls' gate of `t` (400 naming `tools` where the schemas cannot be used).
async fn tool_gate(
    s: &Arc<Shared>,
    t: &crate::grammar::ToolCalls,
) -> Result<crate::grammar::ToolGate, ApiError> {
    let t = t.clone();
    with_grammar(s, move |s, engine| {
        let tok = &s.tokenizer;
        let (Some(open), Some(close)) = (
            tok.token_to_id("<tool_call>"),
            tok.token_to_id("</tool_call>"),
        ) else {
            return Err(ApiError::invalid(
                "tools",
                "strict tools need the model's <tool_call> tokens",
            ));
        };
        engine
            .tool_calls(&t, open, close)
            .map_err(|e| ApiError::invalid("tools", format!("strict `tools` cannot be used: {e}")))
    })
    .await
}

/// Queues a job and waits until the model starts it (or refuses it).
pub(super) async fn submit(
    s: &Arc<Shared>,
    prompt: Vec<u32>,
    snapshot_points: Vec<usize>,
    settings: ReplySettings,
    params: &GenParams,
) -> Result<Submitted, ApiError> {
    // Counted from the request's arrival at the server (validation and tokenizing
    // included), as the access log's duration.
    let log = super::access::current();
    let arrived = log.as_ref().map_or_else(Instant::now, |l| l.start);
    let guide = match &params.constraint {
        None => None,
        Some(c) => Some(guide(s, c).await?),
    };
    let tool_gate = match &params.tool_calls {
        None => None,
        Some(t) => Some(tool_gate(s, t).await?),
    };
    let (tx, mut rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        guide: std::sync::Mutex::new(guide),
        tool_gate: std::sync::Mutex::new(tool_gate),
        prompt,
        snapshot_points,
        settings,
        params: params.sampling.clone(),
        seed: params.seed.unwrap_or_else(|| fresh_seed(s)),
        logprobs: params.logprobs,
        cache_key: params.cache_key.clone(),
        events: tx,
        cancel: cancel.clone(),
        deadline: Instant::now() + s.config.request_timeout,
        arrived,
        log,
    };
    let guard = CancelOnDrop(cancel);
    let waiting = s.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if waiting as usize >= s.config.max_queue {
        s.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(
            429,
            "rate_limit_error",
            format!("{waiting} requests are already waiting for the model; retry later"),
        )
        .with_code("queue_full"));
    }
    let sent = s.jobs.lock().unwrap_or_else(|e| e.into_inner()).send(job);
    if sent.is_err() {
        s.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(
            503,
            "service_unavailable",
            "the model thread has stopped",
        ));
    }
    match rx.recv().await {
        Some(Event::Started { cached_tokens }) => Ok(Submitted {
            rx,
            guard,
            cached_tokens,
        }),
        Some(Event::Error { status, message }) => Err(event_error(status, message)),
        _ => Err(model_gone()),
    }
}

pub(super) fn event_error(status: u16, message: String) -> ApiError {
    match status {
        503 => ApiError::new(503, "service_unavailable", message),
        400 => ApiError::invalid("", message).with_code("context_length_exceeded"),
        504 => ApiError::new(504, "timeout", message),
        _ => ApiError::new(status, "server_error", message),
    }
}

pub(super) fn finish_reason(stop: StopReason, calls: bool) -> &'static str {
    match stop {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        _ if calls => "tool_calls",
        _ => "stop",
    }
}

pub(super) fn token_text(s: &Shared, id: u32) -> String {
    s.tokenizer.decode(&[id], false).unwrap_or_default()
}

pub(super) fn meta(s: &Shared, prefix: &str) -> ResponseMeta {
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    ResponseMeta {
        id: format!("{prefix}-{:x}{n:06}", unix_now()),
        created: unix_now(),
        model: s.config.model_id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::head_cut;
    use crate::tokenizer::Tokenizer;

    /// The head check's premise: cut where `head_cut` cuts, the head's ids are the text's
    /// first ids, on the real tokenizer, for text of every kind of piece (words, digits,
    /// punctuation, runs of spaces and newlines, no-break and ideographic spaces, CJK,
    /// combining marks, special-token text).
    #[test]
    fn a_head_cut_keeps_the_texts_first_ids() {
        let tok = Tokenizer::bundled().unwrap();
        let text = "Hello, world!  It's 2026:\tnumbers 12345 and x=3.14;\n\n  indented\u{a0} nbsp \
                    \u{3000}ideographic 漢字とかな が 混ざる 文 e\u{301}t\u{301}e\u{301} \
                    <|im_start|>user <think> (parens) [brackets] {braces} --- ...   end\r\n ok "
            .repeat(3);
        let mut cuts = 0;
        for parse_special in [true, false] {
            let full = tok.encode(&text, parse_special).unwrap();
            let mut at = 1;
            while let Some(cut) = head_cut(&text, at) {
                let head = tok.encode(&text[..cut], parse_special).unwrap();
                assert_eq!(
                    head[..],
                    full[..head.len()],
                    "cut at {cut} ({:?}|{:?})",
                    &text[cut.saturating_sub(12)..cut],
                    &text[cut..(cut + 12).min(text.len())]
                );
                cuts += 1;
                at = cut + 1;
            }
        }
        assert!(cuts > 100, "{cuts} cuts");
        assert_eq!(head_cut("aaaa", 1), None, "no space, no cut");
        assert_eq!(head_cut("a  b", 2), None, "a space after a space is no cut");
        assert_eq!(head_cut("ab cd", 1), Some(2));
    }
}
