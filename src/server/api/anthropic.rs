//! The Anthropic Messages wire format, without any HTTP.
//!
//! Requests: [`parse_anthropic`] turns a `/v1/messages` (or `/v1/messages/count_tokens`) body
//! into the same [`ChatInput`] an OpenAI chat request becomes, so that both render through
//! the one chat template and run on the one engine path: `system` becomes the system message,
//! `tool_use` blocks the assistant's `tool_calls`, `tool_result` blocks `tool` messages,
//! `thinking` blocks `reasoning_content`, `thinking` the template's `enable_thinking` switch
//! and the thinking budget, a final assistant message the start of the reply (prefill).
//!
//! Responses: [`Blocks`] turns the reply's [`Delta`]s into content blocks and Anthropic's
//! stream events; [`message_json`], [`stop_reason`] and [`error_json`] write the rest.

use super::error::{ApiError, R};
use super::params::{parse_gen_params, present, type_error};
use super::request::{ChatInput, ToolChoice};
use super::response::{Delta, ResponseMeta, Usage};
use crate::generate::StopReason;
use crate::sampling::SamplingParams;
use serde_json::{Map, Value, json};

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid("", message)
}

fn block_type<'a>(b: &'a Value, p: &str) -> R<&'a str> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("`{p}.type` must be a string")))
}

fn block_text(b: &Value, p: &str) -> R<String> {
    b.get("text")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| invalid(format!("`{p}.text` must be a string")))
}

/// Content that may only be text: a string or a list of `text` blocks, joined by newlines.
fn text_only(v: &Value, p: &str) -> R<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                let bp = format!("{p}[{j}]");
                match block_type(b, &bp)? {
                    "text" => texts.push(block_text(b, &bp)?),
                    other => {
                        return Err(invalid(format!(
                            "`{bp}`: content blocks of type {other:?} are not supported here (text only)"
                        )));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        other => Err(type_error(p, "a string or a list of text blocks", other)),
    }
}

/// The blocks of one message (a string is one text block).
fn blocks_of(v: Option<&Value>, p: &str) -> R<Vec<Value>> {
    match v {
        Some(Value::String(s)) => Ok(vec![json!({"type": "text", "text": s})]),
        Some(Value::Array(a)) => Ok(a.clone()),
        Some(other) => Err(type_error(
            &format!("{p}.content"),
            "a string or a list of content blocks",
            other,
        )),
        None => Err(invalid(format!("`{p}.content` is required"))),
    }
}

/// One assistant message: text, thinking and `tool_use` blocks.
fn assistant_message(blocks: &[Value], p: &str, tool_ids: &mut Vec<String>) -> R<Value> {
    let (mut text, mut thinking, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{p}.content[{j}]");
        match block_type(b, &bp)? {
            "text" => text.push(block_text(b, &bp)?),
            "thinking" => thinking.push(
                b.get("thinking")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("`{bp}.thinking` must be a string")))?
                    .to_string(),
            ),
            // Another model's encrypted reasoning: nothing this one can read.
            "redacted_thinking" => {}
            "tool_use" => {
                let id = b
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("`{bp}.id` must be a string")))?;
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("`{bp}.name` must be a string")))?;
                let input = match b.get("input") {
                    Some(o @ Value::Object(_)) => o.clone(),
                    Some(other) => {
                        return Err(type_error(&format!("{bp}.input"), "an object", other));
                    }
                    None => json!({}),
                };
                tool_ids.push(id.to_string());
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input}}));
            }
            other => {
                return Err(invalid(format!(
                    "`{bp}`: assistant content blocks of type {other:?} are not supported (text, thinking, tool_use)"
                )));
            }
        }
    }
    let mut m = json!({"role": "assistant", "content": text.join("\n")});
    if !thinking.is_empty() {
        m["reasoning_content"] = json!(thinking.join("\n"));
    }
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    Ok(m)
}

/// One user message: `tool_result` blocks become `tool` messages, runs of text blocks user
/// messages, in their order.
fn user_messages(blocks: &[Value], p: &str, tool_ids: &[String], out: &mut Vec<Value>) -> R<()> {
    let mut text: Vec<String> = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": text.join("\n")}));
            text.clear();
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{p}.content[{j}]");
        match block_type(b, &bp)? {
            "text" => text.push(block_text(b, &bp)?),
            "tool_result" => {
                flush(&mut text, out);
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("`{bp}.tool_use_id` must be a string")))?;
                if !tool_ids.iter().any(|t| t == id) {
                    return Err(invalid(format!(
                        "`{bp}.tool_use_id` {id:?} does not match any earlier `tool_use` block"
                    )));
                }
                let mut content = match present(b.as_object().unwrap_or(&Map::new()), "content") {
                    None => String::new(),
                    Some(c) => text_only(c, &format!("{bp}.content"))?,
                };
                match b.get("is_error") {
                    None | Some(Value::Null) | Some(Value::Bool(false)) => {}
                    Some(Value::Bool(true)) => content = format!("Error: {content}"),
                    Some(other) => {
                        return Err(type_error(&format!("{bp}.is_error"), "a boolean", other));
                    }
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            other => {
                return Err(invalid(format!(
                    "`{bp}`: user content blocks of type {other:?} are not supported (text, tool_result)"
                )));
            }
        }
    }
    flush(&mut text, out);
    Ok(())
}

/// The conversation in the template's form, and the text of a final assistant message (the
/// reply's start) apart.
fn parse_conversation(obj: &Map<String, Value>) -> R<(Vec<Value>, Option<String>)> {
    let mut out = Vec::new();
    match present(obj, "system") {
        None => {}
        Some(v) => out.push(json!({"role": "system", "content": text_only(v, "system")?})),
    }
    let v = present(obj, "messages").ok_or_else(|| invalid("`messages` is required"))?;
    let list = v
        .as_array()
        .ok_or_else(|| type_error("messages", "a list of messages", v))?;
    if list.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    let mut tool_ids = Vec::new();
    let mut prefill = None;
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages.{i}");
        let obj = m
            .as_object()
            .ok_or_else(|| type_error(&p, "an object", m))?;
        let blocks = blocks_of(obj.get("content"), &p)?;
        match obj.get("role").and_then(Value::as_str) {
            Some("user") => user_messages(&blocks, &p, &tool_ids, &mut out)?,
            Some("assistant") => {
                let msg = assistant_message(&blocks, &p, &mut tool_ids)?;
                let last = i + 1 == list.len();
                if last && msg.get("tool_calls").is_none() && msg.get("reasoning_content").is_none()
                {
                    prefill = msg["content"].as_str().map(str::to_string);
                } else {
                    out.push(msg);
                }
            }
            Some(other) => {
                return Err(invalid(format!(
                    "`{p}.role`: unknown role {other:?} (user or assistant; the system prompt is the top-level `system`)"
                )));
            }
            None => return Err(invalid(format!("`{p}.role` must be a string"))),
        }
    }
    if !out.iter().any(|m| m["role"] == "user") {
        return Err(invalid("`messages` must contain a user message"));
    }
    Ok((out, prefill))
}

/// Anthropic tools (`{name, description, input_schema}`) as the template's function tools.
fn parse_tools(obj: &Map<String, Value>) -> R<Option<Vec<Value>>> {
    let Some(v) = present(obj, "tools") else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| type_error("tools", "a list", v))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools.{i}");
        let t = t
            .as_object()
            .ok_or_else(|| type_error(&p, "an object", t))?;
        match present(t, "type").map(|v| v.as_str()) {
            None | Some(Some("custom")) => {}
            Some(ty) => {
                return Err(invalid(format!(
                    "`{p}.type` {}: only client tools (with `input_schema`) are supported",
                    ty.map_or("is not a string".into(), |t| format!("{t:?}"))
                )));
            }
        }
        let name = present(t, "name")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("`{p}.name` must be a string")))?;
        let schema = match present(t, "input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            Some(other) => {
                return Err(type_error(&format!("{p}.input_schema"), "an object", other));
            }
            None => return Err(invalid(format!("`{p}.input_schema` is required"))),
        };
        let mut f = json!({"name": name, "parameters": schema});
        match present(t, "description") {
            None => {}
            Some(Value::String(d)) => f["description"] = json!(d),
            Some(other) => return Err(type_error(&format!("{p}.description"), "a string", other)),
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok((!out.is_empty()).then_some(out))
}

fn parse_tool_choice(obj: &Map<String, Value>, tools: Option<&[Value]>) -> R<ToolChoice> {
    let names: Vec<&str> = tools
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
        .collect();
    let Some(v) = present(obj, "tool_choice") else {
        return Ok(if names.is_empty() {
            ToolChoice::None
        } else {
            ToolChoice::Auto
        });
    };
    let o = v
        .as_object()
        .ok_or_else(|| type_error("tool_choice", "an object", v))?;
    if let Some(d) = present(o, "disable_parallel_tool_use")
        && !d.is_boolean()
    {
        return Err(type_error(
            "tool_choice.disable_parallel_tool_use",
            "a boolean",
            d,
        ));
    }
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => ToolChoice::Named(
            o.get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("`tool_choice.name` must be a string"))?
                .to_string(),
        ),
        _ => {
            return Err(invalid(
                "`tool_choice.type` must be one of auto, any, tool, none",
            ));
        }
    };
    match &choice {
        ToolChoice::Required if names.is_empty() => Err(invalid(
            "`tool_choice` is {\"type\": \"any\"} but no `tools` are given",
        )),
        ToolChoice::Named(n) if !names.contains(&n.as_str()) => Err(invalid(format!(
            "`tool_choice.name` is {n:?}, which is not in `tools`"
        ))),
        _ => Ok(choice),
    }
}

/// `thinking`: `(on, budget)`. Absent means off, as on Anthropic's API.
fn parse_thinking(obj: &Map<String, Value>) -> R<(bool, Option<usize>)> {
    let Some(v) = present(obj, "thinking") else {
        return Ok((false, None));
    };
    let o = v
        .as_object()
        .ok_or_else(|| type_error("thinking", "an object", v))?;
    match o.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok((false, None)),
        // The model decides how long to think.
        Some("adaptive") => Ok((true, None)),
        Some("enabled") => {
            let b = present(o, "budget_tokens")
                .ok_or_else(|| invalid("`thinking.budget_tokens` is required"))?;
            match b.as_u64() {
                Some(n) if n >= 1 => Ok((true, Some(n as usize))),
                _ => Err(type_error(
                    "thinking.budget_tokens",
                    "a positive integer",
                    b,
                )),
            }
        }
        _ => Err(invalid(
            "`thinking.type` must be one of enabled, disabled, adaptive",
        )),
    }
}

/// Validates a `/v1/messages` body (`count_only`: a `/v1/messages/count_tokens` body, which
/// has no `max_tokens` and no sampling options).
pub fn parse_anthropic(body: &Value, defaults: &SamplingParams, count_only: bool) -> R<ChatInput> {
    let obj = body
        .as_object()
        .ok_or_else(|| invalid("the request body must be a JSON object"))?;
    let (messages, prefill) = parse_conversation(obj)?;
    let tools = parse_tools(obj)?;
    let tool_choice = parse_tool_choice(obj, tools.as_deref())?;
    let (thinking, budget) = parse_thinking(obj)?;
    if thinking && matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(invalid(
            "thinking may not be enabled when `tool_choice` forces tool use",
        ));
    }
    if thinking && prefill.is_some() {
        return Err(invalid(
            "a final assistant message (prefill) cannot be continued with thinking enabled",
        ));
    }
    // The options in the names the shared reader knows.
    let mut gen_opts = Map::new();
    if !count_only {
        let max_tokens =
            present(obj, "max_tokens").ok_or_else(|| invalid("`max_tokens` is required"))?;
        if let Some(t) = present(obj, "temperature")
            && !t.as_f64().is_some_and(|t| (0.0..=1.0).contains(&t))
        {
            return Err(type_error("temperature", "a number in [0, 1]", t));
        }
        for key in ["max_tokens", "temperature", "top_p", "top_k", "stream"] {
            if let Some(v) = present(obj, key) {
                gen_opts.insert(key.into(), v.clone());
            }
        }
        if let (Some(b), Some(m)) = (budget, max_tokens.as_u64())
            && b as u64 >= m
        {
            return Err(invalid(format!(
                "`max_tokens` ({m}) must be greater than `thinking.budget_tokens` ({b})"
            )));
        }
        match present(obj, "stop_sequences") {
            None => {}
            Some(Value::Array(a))
                if a.iter().all(|s| s.as_str().is_some_and(|s| !s.is_empty())) =>
            {
                gen_opts.insert("stop".into(), Value::Array(a.clone()));
            }
            Some(other) => {
                return Err(type_error(
                    "stop_sequences",
                    "a list of non-empty strings",
                    other,
                ));
            }
        }
        if let Some(m) = present(obj, "metadata")
            && !m.is_object()
        {
            return Err(type_error("metadata", "an object", m));
        }
    }
    if let Some(b) = budget {
        gen_opts.insert("thinking_budget".into(), json!(b));
    }
    let params = parse_gen_params(&gen_opts, defaults, true)?;
    Ok(ChatInput {
        messages,
        tools,
        tool_choice,
        enable_thinking: Some(thinking),
        extra: Map::new(),
        params,
        prefill,
    })
}

/// Anthropic's `stop_reason` for how a reply ended.
pub fn stop_reason(stop: StopReason, tool_use: bool) -> &'static str {
    match stop {
        StopReason::MaxTokens | StopReason::ContextFull => "max_tokens",
        StopReason::StopString => "stop_sequence",
        _ if tool_use => "tool_use",
        _ => "end_turn",
    }
}

/// Anthropic's usage object: `input_tokens` are the prompt tokens the prefix cache did not
/// hold, `cache_read_input_tokens` those it did.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

/// A `message` object (also the one `message_start` carries, with no content yet).
pub fn message_json(
    meta: &ResponseMeta,
    content: &[Value],
    stop_reason: Option<&str>,
    stop_sequence: Option<&str>,
    usage: &Usage,
) -> Value {
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_json(usage),
    })
}

/// Anthropic's error `type` and the HTTP status for an [`ApiError`] (an overloaded server
/// answers 529, as Anthropic's does).
pub fn error_kind(status: u16) -> (u16, &'static str) {
    match status {
        401 => (401, "authentication_error"),
        403 => (403, "permission_error"),
        404 => (404, "not_found_error"),
        413 => (413, "request_too_large"),
        429 => (429, "rate_limit_error"),
        503 | 529 => (529, "overloaded_error"),
        504 => (504, "timeout_error"),
        400..=499 => (status, "invalid_request_error"),
        _ => (500, "api_error"),
    }
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_json(e: &ApiError) -> (u16, Value) {
    let (status, kind) = error_kind(e.status);
    (
        status,
        json!({"type": "error", "error": {"type": kind, "message": e.message}}),
    )
}

/// One stream event: `event: TYPE` and its data.
pub fn sse_event(v: &Value) -> String {
    format!(
        "event: {}\ndata: {v}\n\n",
        v["type"].as_str().unwrap_or("error")
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Open {
    Thinking,
    Text,
}

/// A reply's content blocks as they form: consecutive reasoning becomes one `thinking`
/// block, consecutive answer text one `text` block, each tool call a `tool_use` block; every
/// step also yields the stream events that tell it.
pub struct Blocks {
    pub content: Vec<Value>,
    open: Option<Open>,
    id_stem: String,
    pub tool_uses: usize,
}

impl Blocks {
    pub fn new(meta: &ResponseMeta) -> Self {
        Blocks {
            content: Vec::new(),
            open: None,
            id_stem: meta.id.rsplit('_').next().unwrap_or("0").to_string(),
            tool_uses: 0,
        }
    }

    /// Ends the open block: its `content_block_stop`.
    pub fn close(&mut self) -> Option<Value> {
        self.open.take()?;
        Some(json!({"type": "content_block_stop", "index": self.content.len() - 1}))
    }

    fn start(&mut self, block: Value, events: &mut Vec<Value>) -> usize {
        events.extend(self.close());
        let index = self.content.len();
        events.push(json!({"type": "content_block_start", "index": index, "content_block": block}));
        self.content.push(block);
        index
    }

    /// Adds one piece of the reply; returns its events.
    pub fn push(&mut self, d: &Delta) -> Vec<Value> {
        let mut events = Vec::new();
        let (kind, field, delta_type, t) = match d {
            Delta::Reasoning(t) => (Open::Thinking, "thinking", "thinking_delta", t),
            Delta::Content(t) => (Open::Text, "text", "text_delta", t),
            Delta::Call(c) => {
                let id = format!("toolu_{}_{}", self.id_stem, self.tool_uses);
                self.tool_uses += 1;
                let index = self.start(
                    json!({"type": "tool_use", "id": id, "name": c.name, "input": {}}),
                    &mut events,
                );
                self.content[index]["input"] = Value::Object(c.arguments.clone());
                events.push(json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": c.arguments_json()}}));
                events.push(json!({"type": "content_block_stop", "index": index}));
                return events;
            }
        };
        if t.is_empty() {
            return events;
        }
        if self.open != Some(kind) {
            let block = match kind {
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Open::Text => json!({"type": "text", "text": ""}),
            };
            self.start(block, &mut events);
            self.open = Some(kind);
        }
        let index = self.content.len() - 1;
        let so_far = self.content[index][field].as_str().unwrap_or_default();
        self.content[index][field] = json!(format!("{so_far}{t}"));
        events.push(json!({"type": "content_block_delta", "index": index,
            "delta": {"type": delta_type, field: t}}));
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolCall;

    fn parse(body: Value) -> R<ChatInput> {
        parse_anthropic(&body, &SamplingParams::default(), false)
    }

    #[test]
    fn blocks_map_onto_the_template_messages() {
        let c = parse(json!({"max_tokens": 50,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "thinking": {"type": "enabled", "budget_tokens": 10},
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 7, "metadata": {"user_id": "u"}}))
        .unwrap();
        assert_eq!(
            c.messages,
            vec![
                json!({"role": "system", "content": "Be brief.\nBe kind."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
                       "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}),
                json!({"role": "user", "content": "And tomorrow?"}),
            ]
        );
        assert_eq!(
            c.tools.unwrap()[0],
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "description": "Weather"}})
        );
        assert_eq!(c.tool_choice, ToolChoice::Auto);
        assert_eq!(c.enable_thinking, Some(true));
        assert_eq!(c.params.thinking_budget, Some(10));
        assert_eq!(c.params.max_tokens, Some(50));
        assert_eq!(c.params.stop, vec!["END".to_string()]);
        assert_eq!(
            (c.params.sampling.temperature, c.params.sampling.top_k),
            (0.5, 7)
        );
        assert_eq!(c.prefill, None);
        // no `thinking`: off; a final assistant message is the reply's start
        let c = parse(json!({"max_tokens": 5, "messages": [
            {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]}))
        .unwrap();
        assert_eq!(c.enable_thinking, Some(false));
        assert_eq!(c.prefill.as_deref(), Some("Hi"));
        assert_eq!(c.messages.len(), 1);
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let user = json!([{"role": "user", "content": "x"}]);
        let tools = json!([{"name": "f", "input_schema": {"type": "object"}}]);
        for (body, needle) in [
            (json!({"messages": user}), "max_tokens"),
            (json!({"max_tokens": 0, "messages": user}), "max_tokens"),
            (json!({"max_tokens": 5}), "messages"),
            (json!({"max_tokens": 5, "messages": []}), "messages"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
                "role",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "image",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]}),
                "tool_use_id",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "system": 5}),
                "system",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "temperature": -1}),
                "temperature",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "temperature": 1.5}),
                "[0, 1]",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "top_k": "x"}),
                "top_k",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "stop_sequences": "END"}),
                "stop_sequences",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "stop_sequences": [""]}),
                "stop_sequences",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": [{"name": "f"}]}),
                "input_schema",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "client tools",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tool_choice": {"type": "any"}}),
                "no `tools`",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": tools, "tool_choice": {"type": "tool", "name": "g"}}),
                "not in `tools`",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": tools, "tool_choice": "auto"}),
                "tool_choice",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "thinking": {"type": "enabled"}}),
                "budget_tokens",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 5}}),
                "greater than",
            ),
            (
                json!({"max_tokens": 50, "messages": user, "thinking": {"type": "maybe"}}),
                "thinking.type",
            ),
            (
                json!({"max_tokens": 50, "messages": user, "tools": tools, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 5}}),
                "forces tool use",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "metadata": "x"}),
                "metadata",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "stream": "yes"}),
                "stream",
            ),
        ] {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
            let (status, v) = error_json(&e);
            assert_eq!(status, 400);
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], "invalid_request_error");
        }
        // count_tokens needs no max_tokens
        assert!(
            parse_anthropic(&json!({"messages": user}), &SamplingParams::default(), true).is_ok()
        );
    }

    #[test]
    fn error_types_follow_the_status() {
        for (status, want, kind) in [
            (400, 400, "invalid_request_error"),
            (415, 415, "invalid_request_error"),
            (401, 401, "authentication_error"),
            (403, 403, "permission_error"),
            (404, 404, "not_found_error"),
            (413, 413, "request_too_large"),
            (429, 429, "rate_limit_error"),
            (500, 500, "api_error"),
            (503, 529, "overloaded_error"),
            (504, 504, "timeout_error"),
        ] {
            assert_eq!(error_kind(status), (want, kind));
        }
    }

    #[test]
    fn blocks_and_their_events() {
        let meta = ResponseMeta {
            id: "msg_7".into(),
            created: 0,
            model: "m".into(),
        };
        let mut b = Blocks::new(&meta);
        let mut ev = Vec::new();
        for d in [
            Delta::Reasoning("Let me ".into()),
            Delta::Reasoning("think.".into()),
            Delta::Content("".into()),
            Delta::Content("Calling.".into()),
            Delta::Call(ToolCall {
                name: "f".into(),
                arguments: json!({"n": 1}).as_object().unwrap().clone(),
            }),
            Delta::Content("Done.".into()),
        ] {
            ev.extend(b.push(&d));
        }
        ev.extend(b.close());
        let types: Vec<String> = ev
            .iter()
            .map(|e| {
                let t = e["type"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches("content_block_");
                match e["delta"]["type"].as_str() {
                    Some(d) => format!("{t}:{d}"),
                    None => format!("{t}{}", e["index"]),
                }
            })
            .collect();
        assert_eq!(
            types,
            [
                "start0",
                "delta:thinking_delta",
                "delta:thinking_delta",
                "stop0",
                "start1",
                "delta:text_delta",
                "stop1",
                "start2",
                "delta:input_json_delta",
                "stop2",
                "start3",
                "delta:text_delta",
                "stop3",
            ]
        );
        assert_eq!(
            b.content,
            vec![
                json!({"type": "thinking", "thinking": "Let me think.", "signature": ""}),
                json!({"type": "text", "text": "Calling."}),
                json!({"type": "tool_use", "id": "toolu_7_0", "name": "f", "input": {"n": 1}}),
                json!({"type": "text", "text": "Done."}),
            ]
        );
        // a tool_use block starts with empty input; its JSON comes as one delta
        assert_eq!(ev[7]["content_block"]["input"], json!({}));
        assert_eq!(ev[8]["delta"]["partial_json"], r#"{"n":1}"#);
        assert_eq!(b.tool_uses, 1);
        assert_eq!(
            sse_event(&ev[0]).lines().next(),
            Some("event: content_block_start")
        );
    }
}
