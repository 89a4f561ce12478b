//! The response side: [`Assembler`] splits a reply into reasoning, answer and tool calls;
//! the `*_json` / `*_chunk` functions write OpenAI's exact shapes, [`sse_data`] frames them.

use crate::generate::Channel;
use crate::tools::{Piece, ToolCall, ToolCallStream};
use serde_json::{Value, json};

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
    fn assembler_parses_a_forced_opening() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
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
