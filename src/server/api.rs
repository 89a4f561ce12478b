//! The OpenAI wire format, without any HTTP: request validation (every client mistake is an
//! [`ApiError`] naming the field), and the response side ([`Assembler`] splits reasoning,
//! answer and tool calls; the `*_json` / `*_chunk` functions write OpenAI's exact shapes).

use crate::generate::Channel;
use crate::sampling::{SamplingParams, check};
use crate::tools::{Piece, ToolCall, ToolCallStream};
use serde_json::{Map, Value, json};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: (!param.is_empty()).then(|| param.to_string()),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

type R<T> = Result<T, ApiError>;

fn type_error(key: &str, what: &str, v: &Value) -> ApiError {
    ApiError::invalid(
        key,
        format!("`{key}` must be {what}, not {}", short_json(v)),
    )
}

fn short_json(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(60).collect::<String>())
    } else {
        s
    }
}

fn present<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn opt_f32(obj: &Map<String, Value>, key: &str) -> R<Option<f32>> {
    match present(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| type_error(key, "a number", v)),
    }
}

fn opt_i64(obj: &Map<String, Value>, key: &str) -> R<Option<i64>> {
    match present(obj, key) {
        None => Ok(None),
        Some(v) => match (v.as_i64(), v.as_f64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
            _ => Err(type_error(key, "an integer", v)),
        },
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> R<Option<bool>> {
    match present(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| type_error(key, "a boolean", v)),
    }
}

fn opt_positive(obj: &Map<String, Value>, key: &str) -> R<Option<usize>> {
    match opt_i64(obj, key)? {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::invalid(
            key,
            format!("`{key}` is {n} but must be at least 1"),
        )),
    }
}

fn ranged(
    obj: &Map<String, Value>,
    key: &str,
    ok: fn(f32) -> bool,
    expected: &str,
) -> R<Option<f32>> {
    match opt_f32(obj, key)? {
        Some(x) if !ok(x) => Err(ApiError::invalid(
            key,
            format!("`{key}` is {x} but must be {expected}"),
        )),
        x => Ok(x),
    }
}

/// Generation settings shared by both endpoints.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `Some(top_n)` when log-probabilities were asked for.
    pub logprobs: Option<usize>,
    pub thinking_budget: Option<usize>,
    /// `prompt_cache_key`: the caller's cache affinity; its saved prefixes are evicted last.
    pub cache_key: Option<String>,
}

/// Options this server refuses rather than silently ignores, with the value that is harmless.
fn refuse_unsupported(obj: &Map<String, Value>) -> R<()> {
    for key in [
        "logit_bias",
        "response_format",
        "audio",
        "modalities",
        "prediction",
        "functions",
        "function_call",
        "web_search_options",
        "best_of",
        "echo",
        "suffix",
    ] {
        let Some(v) = present(obj, key) else { continue };
        let harmless = match key {
            "logit_bias" => v.as_object().is_some_and(Map::is_empty),
            "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
            "modalities" => v == &json!(["text"]),
            "best_of" => v.as_i64() == Some(1),
            "echo" => v == &Value::Bool(false),
            _ => false,
        };
        if !harmless {
            return Err(ApiError::invalid(
                key,
                format!("`{key}` is not supported by this server"),
            ));
        }
    }
    Ok(())
}

/// Parses the sampling and output options of a request over `defaults`.
pub fn parse_gen_params(
    obj: &Map<String, Value>,
    defaults: &SamplingParams,
    chat: bool,
) -> R<GenParams> {
    refuse_unsupported(obj)?;
    if let Some(n) = present(obj, "n")
        && n.as_i64() != Some(1)
    {
        return Err(ApiError::invalid(
            "n",
            format!("`n` is {} but only n=1 is supported", short_json(n)),
        ));
    }
    let mut p = defaults.clone();
    let max_tokens = match opt_positive(obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => opt_positive(obj, "max_tokens")?,
    };
    if let Some(x) = ranged(obj, "temperature", check::temperature, check::TEMPERATURE)? {
        p.temperature = x;
    }
    if let Some(x) = ranged(obj, "top_p", check::top_p, check::TOP_P)? {
        p.top_p = x;
    }
    if let Some(x) = ranged(obj, "min_p", check::min_p, check::MIN_P)? {
        p.min_p = x;
    }
    if let Some(x) = ranged(
        obj,
        "repetition_penalty",
        check::repetition_penalty,
        check::REPETITION_PENALTY,
    )? {
        p.repetition_penalty = x;
    }
    if let Some(x) = ranged(
        obj,
        "presence_penalty",
        check::presence_frequency,
        check::PRESENCE_FREQUENCY,
    )? {
        p.presence_penalty = x;
    }
    if let Some(x) = ranged(
        obj,
        "frequency_penalty",
        check::presence_frequency,
        check::PRESENCE_FREQUENCY,
    )? {
        p.frequency_penalty = x;
    }
    match opt_i64(obj, "top_k")? {
        None => {}
        Some(-1) | Some(0) => p.top_k = 0,
        Some(k) if k > 0 => p.top_k = k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` is {k} but must be >= 0 (0 or -1: off)"),
            ));
        }
    }
    let seed = opt_i64(obj, "seed")?.map(|s| s as u64);
    let stop = match present(obj, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                type_error(
                    "stop",
                    "a string or a list of strings",
                    &Value::Array(a.clone()),
                )
            })?,
        Some(v) => return Err(type_error("stop", "a string or a list of strings", v)),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings cannot be empty"));
    }
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match present(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")
            .map_err(|_| {
                type_error(
                    "stream_options.include_usage",
                    "a boolean",
                    &o["include_usage"],
                )
            })?
            .unwrap_or(false),
        Some(v) => return Err(type_error("stream_options", "an object", v)),
    };
    let logprobs = if chat {
        let on = opt_bool(obj, "logprobs")?.unwrap_or(false);
        let top = opt_i64(obj, "top_logprobs")?;
        match top {
            Some(n) if !(0..=20).contains(&n) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` is {n} but must be in [0, 20]"),
                ));
            }
            Some(_) if !on => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            _ => {}
        }
        on.then(|| top.unwrap_or(0) as usize)
    } else {
        match opt_i64(obj, "logprobs")? {
            None => None,
            Some(n) if (0..=20).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::invalid(
                    "logprobs",
                    format!("`logprobs` is {n} but must be in [0, 20]"),
                ));
            }
        }
    };
    let thinking_budget = match opt_i64(obj, "thinking_budget")? {
        None => None,
        Some(n) if n >= 0 => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(
                "thinking_budget",
                format!("`thinking_budget` is {n} but must be >= 0"),
            ));
        }
    };
    let cache_key = match present(obj, "prompt_cache_key") {
        None => None,
        Some(Value::String(k)) => Some(k.clone()),
        Some(v) => return Err(type_error("prompt_cache_key", "a string", v)),
    };
    Ok(GenParams {
        max_tokens,
        sampling: p,
        seed,
        stop,
        stream,
        include_usage,
        logprobs,
        thinking_budget,
        cache_key,
    })
}

/// How the reply may call tools.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

/// A validated chat request, ready for the template.
#[derive(Clone, Debug)]
pub struct ChatInput {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: ToolChoice,
    pub enable_thinking: Option<bool>,
    pub extra: Map<String, Value>,
    pub params: GenParams,
}

fn text_content(v: &Value, param: &str) -> R<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let p = format!("{param}[{j}]");
                let ty = part.get("type").and_then(Value::as_str);
                match (ty, part.get("text")) {
                    (Some("text") | None, Some(Value::String(t))) => texts.push(t.clone()),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(
                            &p,
                            format!("`{p}.text` must be a string"),
                        ));
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            &format!("{p}.type"),
                            format!(
                                "content parts of type {other:?} are not supported (text only)"
                            ),
                        ));
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            &p,
                            format!(
                                "`{p}` must be a text part {{\"type\": \"text\", \"text\": ...}}"
                            ),
                        ));
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        other => Err(type_error(param, "a string or a list of text parts", other)),
    }
}

fn parse_tool_calls(v: &Value, param: &str) -> R<Vec<Value>> {
    let list = v.as_array().ok_or_else(|| type_error(param, "a list", v))?;
    let mut out = Vec::new();
    for (j, call) in list.iter().enumerate() {
        let p = format!("{param}[{j}]");
        let f = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&p, format!("`{p}.function` must be an object")))?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                &format!("{p}.function.name"),
                format!("`{p}.function.name` must be a string"),
            )
        })?;
        let ap = format!("{p}.function.arguments");
        let args = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) => {
                let parsed: Value = serde_json::from_str(s).map_err(|e| {
                    ApiError::invalid(&ap, format!("`{ap}` is not valid JSON: {e}"))
                })?;
                if !parsed.is_object() {
                    return Err(ApiError::invalid(
                        &ap,
                        format!("`{ap}` must encode a JSON object"),
                    ));
                }
                parsed
            }
            Some(o @ Value::Object(_)) => o.clone(),
            Some(other) => return Err(type_error(&ap, "a JSON string", other)),
        };
        let mut c = json!({"type": "function", "function": {"name": name, "arguments": args}});
        if let Some(id) = call.get("id").filter(|v| v.is_string()) {
            c["id"] = id.clone();
        }
        out.push(c);
    }
    Ok(out)
}

/// Messages in the template's form: content flattened to text, tool-call arguments as
/// objects, `developer` as `system`.
pub fn parse_messages(v: Option<&Value>) -> R<Vec<Value>> {
    let v = v.ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    let list = v
        .as_array()
        .ok_or_else(|| type_error("messages", "a list of messages", v))?;
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let obj = m
            .as_object()
            .ok_or_else(|| type_error(&p, "an object", m))?;
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(&format!("{p}.role"), format!("`{p}.role` must be a string"))
        })?;
        let role = match role {
            "developer" => "system",
            "system" | "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    &format!("{p}.role"),
                    format!("unknown role {other:?} (system, user, assistant or tool)"),
                ));
            }
        };
        let content = text_content(
            obj.get("content").unwrap_or(&Value::Null),
            &format!("{p}.content"),
        )?;
        let mut msg = Map::new();
        msg.insert("role".into(), json!(role));
        let tool_calls = match present(obj, "tool_calls") {
            Some(tc) if role == "assistant" => {
                Some(parse_tool_calls(tc, &format!("{p}.tool_calls"))?)
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{p}.tool_calls"),
                    "only assistant messages have tool_calls",
                ));
            }
            None => None,
        };
        match content {
            Some(c) => {
                msg.insert("content".into(), json!(c));
            }
            None if role == "assistant" => {
                msg.insert("content".into(), json!(""));
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{p}.content"),
                    format!("`{p}.content` is required for a {role} message"),
                ));
            }
        }
        if let Some(tc) = tool_calls {
            msg.insert("tool_calls".into(), Value::Array(tc));
        }
        for key in ["reasoning_content", "tool_call_id", "name"] {
            match present(obj, key) {
                Some(Value::String(s)) => {
                    msg.insert(key.into(), json!(s));
                }
                Some(other) => return Err(type_error(&format!("{p}.{key}"), "a string", other)),
                None => {}
            }
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

fn parse_tools(obj: &Map<String, Value>) -> R<Option<Vec<Value>>> {
    let Some(v) = present(obj, "tools") else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| type_error("tools", "a list", v))?;
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        if let Some(ty) = t.get("type")
            && ty != "function"
        {
            return Err(ApiError::invalid(
                &format!("{p}.type"),
                "only tools of type \"function\" are supported",
            ));
        }
        if t.pointer("/function/name")
            .and_then(Value::as_str)
            .is_none()
        {
            return Err(ApiError::invalid(
                &format!("{p}.function.name"),
                format!("`{p}.function.name` must be a string"),
            ));
        }
    }
    Ok((!list.is_empty()).then(|| list.clone()))
}

fn parse_tool_choice(obj: &Map<String, Value>, tools: Option<&[Value]>) -> R<ToolChoice> {
    let choice = match present(obj, "tool_choice") {
        None => {
            return Ok(if tools.is_some() {
                ToolChoice::Auto
            } else {
                ToolChoice::None
            });
        }
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` {other:?} is not one of auto, none, required"),
                ));
            }
        },
        Some(v @ Value::Object(_)) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) => ToolChoice::Named(name.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice.function.name` must be a string",
                ));
            }
        },
        Some(v) => return Err(type_error("tool_choice", "a string or an object", v)),
    };
    let names: Vec<&str> = tools
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
        .collect();
    match &choice {
        ToolChoice::Required if names.is_empty() => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` is \"required\" but no `tools` are given",
        )),
        ToolChoice::Named(n) if !names.contains(&n.as_str()) => Err(ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` names {n:?}, which is not in `tools`"),
        )),
        _ => Ok(choice),
    }
}

/// Validates a chat completion request body.
pub fn parse_chat(body: &Value, defaults: &SamplingParams) -> R<ChatInput> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("", "the request body must be a JSON object"))?;
    let messages = parse_messages(obj.get("messages"))?;
    let tools = parse_tools(obj)?;
    let tool_choice = parse_tool_choice(obj, tools.as_deref())?;
    let (mut enable_thinking, mut extra) = (None, Map::new());
    match present(obj, "chat_template_kwargs") {
        None => {}
        Some(Value::Object(kw)) => {
            for (k, v) in kw {
                if k == "enable_thinking" {
                    enable_thinking = Some(v.as_bool().ok_or_else(|| {
                        type_error("chat_template_kwargs.enable_thinking", "a boolean", v)
                    })?);
                } else if !["messages", "tools", "add_generation_prompt"].contains(&k.as_str()) {
                    extra.insert(k.clone(), v.clone());
                }
            }
        }
        Some(v) => return Err(type_error("chat_template_kwargs", "an object", v)),
    }
    let params = parse_gen_params(obj, defaults, true)?;
    Ok(ChatInput {
        messages,
        tools,
        tool_choice,
        enable_thinking,
        extra,
        params,
    })
}

/// A completion prompt: text or token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// Validates a completion request body.
pub fn parse_completion(body: &Value, defaults: &SamplingParams) -> R<(PromptInput, GenParams)> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("", "the request body must be a JSON object"))?;
    let prompt = match obj.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("prompt", "`prompt` is required"));
        }
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            PromptInput::Text(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(a))
            if !a.is_empty()
                && a.iter()
                    .all(|x| x.as_u64().is_some_and(|n| n <= u32::MAX as u64)) =>
        {
            PromptInput::Ids(
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|n| n as u32)
                    .collect(),
            )
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` must be one string or a list of token ids (batches of prompts are not supported)",
            ));
        }
        Some(v) => return Err(type_error("prompt", "a string", v)),
    };
    if prompt == PromptInput::Text(String::new()) {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    Ok((prompt, parse_gen_params(obj, defaults, false)?))
}

/// One piece of a reply as the client sees it.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    Call(ToolCall),
}

/// Turns decoded text (per channel) into reasoning, content and tool calls, pulling tool
/// calls out of both channels when tools are on; keeps the whole reply too.
pub struct Assembler {
    tools: Option<[ToolCallStream; 2]>,
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
}

impl Assembler {
    /// `tools`: parse tool calls against these; `forced`: text the prompt already holds of
    /// the answer (a forced tool-call opening), seen by the parser first.
    pub fn new(tools: Option<&[Value]>, forced: &str) -> Self {
        let mut a = Assembler {
            tools: tools.map(|t| [ToolCallStream::new(t), ToolCallStream::new(t)]),
            reasoning: String::new(),
            content: String::new(),
            calls: Vec::new(),
        };
        if !forced.is_empty() {
            let d = a.push(Channel::Answer, forced);
            debug_assert!(d.is_empty(), "a forced prefix yields nothing on its own");
        }
        a
    }

    fn record(&mut self, d: &Delta) {
        match d {
            Delta::Reasoning(t) => self.reasoning.push_str(t),
            Delta::Content(t) => self.content.push_str(t),
            Delta::Call(c) => self.calls.push(c.clone()),
        }
    }

    fn convert(ch: Channel, pieces: Vec<Piece>) -> Vec<Delta> {
        pieces
            .into_iter()
            .map(|p| match (p, ch) {
                (Piece::Text(t), Channel::Reasoning) => Delta::Reasoning(t),
                (Piece::Text(t), Channel::Answer) => Delta::Content(t),
                (Piece::Call(c), _) => Delta::Call(c),
            })
            .collect()
    }

    pub fn push(&mut self, ch: Channel, text: &str) -> Vec<Delta> {
        let out = match &mut self.tools {
            None => vec![match ch {
                Channel::Reasoning => Delta::Reasoning(text.to_string()),
                Channel::Answer => Delta::Content(text.to_string()),
            }],
            Some(streams) => {
                let i = (ch == Channel::Answer) as usize;
                // Text held back in the other channel is settled by the switch.
                let mut out = Self::convert(other(ch), streams[1 - i].finish());
                out.extend(Self::convert(ch, streams[i].push(text)));
                out
            }
        };
        for d in &out {
            self.record(d);
        }
        out
    }

    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        if let Some([r, a]) = &mut self.tools {
            out.extend(Self::convert(Channel::Reasoning, r.finish()));
            out.extend(Self::convert(Channel::Answer, a.finish()));
        }
        for d in &out {
            self.record(d);
        }
        out
    }
}

fn other(ch: Channel) -> Channel {
    match ch {
        Channel::Reasoning => Channel::Answer,
        Channel::Answer => Channel::Reasoning,
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub reasoning_tokens: usize,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        })
    }
}

/// The OpenAI `tool_calls` entry for call `index` of a reply.
pub fn tool_call_json(call: &ToolCall, id: &str, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// Identity of one response.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    /// The id of the `i`th tool call of this response.
    pub fn call_id(&self, i: usize) -> String {
        format!("call_{}_{i}", self.id.rsplit('-').next().unwrap_or("0"))
    }
}

/// A non-streaming chat completion.
pub fn chat_json(
    meta: &ResponseMeta,
    a: &Assembler,
    finish: &str,
    logprobs: Option<Value>,
    usage: &Usage,
) -> Value {
    let mut message = json!({"role": "assistant", "content": a.content});
    if !a.calls.is_empty() {
        if a.content.trim().is_empty() {
            message["content"] = Value::Null;
        }
        let calls: Vec<Value> = a
            .calls
            .iter()
            .enumerate()
            .map(|(i, c)| tool_call_json(c, &meta.call_id(i), None))
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    if !a.reasoning.is_empty() {
        message["reasoning_content"] = json!(a.reasoning);
    }
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs.map(|c| json!({"content": c})),
            "finish_reason": finish,
        }],
        "usage": usage.json(),
    })
}

/// One streamed chat chunk with `delta`; `usage: null` when the client asked for usage.
pub fn chat_chunk(
    meta: &ResponseMeta,
    delta: Value,
    finish: Option<&str>,
    logprobs: Option<Value>,
    include_usage: bool,
) -> Value {
    let mut v = json!({
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "delta": delta,
            "logprobs": logprobs.map(|c| json!({"content": c})),
            "finish_reason": finish,
        }],
    });
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// The last chunk of a stream with `include_usage`: no choices, the usage.
pub fn usage_chunk(meta: &ResponseMeta, object: &str, usage: &Usage) -> Value {
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage.json(),
    })
}

/// The delta of a chat chunk for one [`Delta`]; `calls_so_far` numbers tool calls.
pub fn delta_json(meta: &ResponseMeta, d: &Delta, calls_so_far: usize) -> Value {
    match d {
        Delta::Reasoning(t) => json!({"reasoning_content": t}),
        Delta::Content(t) => json!({"content": t}),
        Delta::Call(c) => {
            json!({"tool_calls": [tool_call_json(c, &meta.call_id(calls_so_far), Some(calls_so_far))]})
        }
    }
}

/// A non-streaming text completion.
pub fn completion_json(
    meta: &ResponseMeta,
    text: &str,
    finish: &str,
    logprobs: Option<Value>,
    usage: &Usage,
) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage.json(),
    })
}

/// One streamed completion chunk.
pub fn completion_chunk(
    meta: &ResponseMeta,
    text: &str,
    finish: Option<&str>,
    logprobs: Option<Value>,
    include_usage: bool,
) -> Value {
    let mut v = json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    });
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// One Server-Sent Events message: `data: <json>` and a blank line.
pub fn sse_data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
                "top_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stop": 5}),
                "stop",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": 7}),
                "prompt_cache_key",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]}),
                "messages[0].tool_calls[0].function.arguments",
            ),
        ];
        for (body, param) in cases {
            let e = parse_chat(&body, &defaults()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn messages_are_normalised_for_the_template() {
        let body = json!({"messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ], "chat_template_kwargs": {"enable_thinking": false, "preserve_thinking": true}});
        let c = parse_chat(&body, &defaults()).unwrap();
        assert_eq!(c.messages[0]["role"], "system");
        assert_eq!(c.messages[1]["content"], "a\nb");
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(c.messages[3]["tool_call_id"], "c1");
        assert_eq!(c.enable_thinking, Some(false));
        assert_eq!(c.extra["preserve_thinking"], json!(true));
        assert_eq!(c.tool_choice, ToolChoice::None);
    }

    #[test]
    fn assembler_splits_reasoning_content_and_calls() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}),
        ];
        let mut a = Assembler::new(Some(&tools), "");
        let mut ds = Vec::new();
        ds.extend(a.push(Channel::Reasoning, "think <tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>"));
        ds.extend(a.push(Channel::Answer, "Hi <tool_"));
        ds.extend(a.push(
            Channel::Answer,
            "call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
        ));
        ds.extend(a.finish());
        assert_eq!(a.reasoning, "think ");
        assert_eq!(a.content, "Hi ");
        assert_eq!(a.calls.len(), 2);
        assert_eq!(a.calls[1].arguments_json(), r#"{"n":2}"#);
        let meta = ResponseMeta {
            id: "chatcmpl-7".into(),
            created: 1,
            model: "m".into(),
        };
        let v = chat_json(&meta, &a, "tool_calls", None, &Usage::default());
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][1]["function"]["arguments"],
            r#"{"n":2}"#
        );
        assert_eq!(v["choices"][0]["message"]["reasoning_content"], "think ");
        let d = delta_json(&meta, &Delta::Call(a.calls[0].clone()), 0);
        assert_eq!(d["tool_calls"][0]["index"], 0);
        assert_eq!(d["tool_calls"][0]["id"], "call_7_0");
    }

    #[test]
    fn completion_prompts_and_tool_choices() {
        let d = defaults();
        let (p, g) =
            parse_completion(&json!({"prompt": "hi", "logprobs": 2, "stream": true}), &d).unwrap();
        assert_eq!(p, PromptInput::Text("hi".into()));
        assert_eq!((g.logprobs, g.stream), (Some(2), true));
        let (p, _) = parse_completion(&json!({"prompt": [1, 2, 3]}), &d).unwrap();
        assert_eq!(p, PromptInput::Ids(vec![1, 2, 3]));
        for bad in [
            json!({"prompt": ""}),
            json!({"prompt": 5}),
            json!({"prompt": [-1]}),
            json!({"prompt": "x", "logprobs": 99}),
            json!({"prompt": "x", "echo": true}),
        ] {
            assert_eq!(parse_completion(&bad, &d).unwrap_err().status, 400, "{bad}");
        }
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let c = parse_chat(&json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}), &d).unwrap();
        assert_eq!(c.tool_choice, ToolChoice::Named("f".into()));
        let c = parse_chat(
            &json!({"messages": [{"role": "user", "content": "x"}], "tools": tools}),
            &d,
        )
        .unwrap();
        assert_eq!(c.tool_choice, ToolChoice::Auto);
        // a forced opening is parsed together with what the model writes next
        let mut a = Assembler::new(
            Some(tools.as_array().unwrap()),
            "<tool_call>\n<function=f>\n",
        );
        assert!(
            a.push(Channel::Answer, "</function>\n</tool_call>")
                .iter()
                .any(|d| matches!(d, Delta::Call(c) if c.name == "f"))
        );
    }

    #[test]
    fn sse_encoding() {
        assert_eq!(sse_data(&json!({"a": 1})), "data: {\"a\":1}\n\n");
        let meta = ResponseMeta {
            id: "x".into(),
            created: 2,
            model: "m".into(),
        };
        let c = chat_chunk(&meta, json!({"content": "hi"}), None, None, true);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["usage"].is_null() && c.as_object().unwrap().contains_key("usage"));
        assert_eq!(c["choices"][0]["delta"]["content"], "hi");
        let u = usage_chunk(
            &meta,
            "chat.completion.chunk",
            &Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_tokens: 1,
                reasoning_tokens: 0,
            },
        );
        assert_eq!(u["usage"]["total_tokens"], 5);
        assert_eq!(u["choices"], json!([]));
    }
}
