//! Qwen3.6 tool calls: the model writes
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=P>
//! value
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! [`ToolCallStream`] pulls such blocks out of streamed text as they complete and turns each
//! into a [`ToolCall`] whose `arguments` are typed by the tool's JSON schema (integer, number,
//! boolean, object, array and null values parsed; strings and anything that does not parse
//! kept as the raw text). Text outside the blocks passes through. A malformed or truncated
//! block is never dropped: it comes back as text, with a warning in the log.

use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// The arguments as OpenAI sends them: a JSON object serialised to a string.
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }
}

/// What the stream yields, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// The JSON schema `type` of parameter `param` of tool `name` in OpenAI `tools`, as a list.
fn param_types(tools: &[Value], name: &str, param: &str) -> Vec<String> {
    let tool = tools.iter().find(|t| {
        t.pointer("/function/name").and_then(Value::as_str) == Some(name)
            || t.get("name").and_then(Value::as_str) == Some(name)
    });
    let Some(tool) = tool else { return vec![] };
    let params = tool
        .pointer("/function/parameters")
        .or_else(|| tool.get("parameters"));
    let ty = params
        .and_then(|p| p.get("properties"))
        .and_then(|p| p.get(param))
        .and_then(|p| p.get("type"));
    match ty {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        _ => vec![],
    }
}

/// A raw parameter value typed by the schema's `types`: the first type it parses as wins;
/// otherwise (or for `string`, or without a schema) the raw text.
fn typed_value(raw: &str, types: &[String]) -> Value {
    for t in types {
        let parsed = match t.as_str() {
            "string" => return Value::String(raw.to_string()),
            "integer" => raw.trim().parse::<i64>().ok().map(Value::from),
            "number" => serde_json::from_str::<Value>(raw.trim())
                .ok()
                .filter(Value::is_number),
            "boolean" => match raw.trim().to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "object" => serde_json::from_str::<Value>(raw.trim())
                .ok()
                .filter(Value::is_object),
            "array" => serde_json::from_str::<Value>(raw.trim())
                .ok()
                .filter(Value::is_array),
            "null" => (raw.trim() == "null").then_some(Value::Null),
            _ => None,
        };
        if let Some(v) = parsed {
            return v;
        }
    }
    Value::String(raw.to_string())
}

/// Strips one leading and one trailing newline (the format puts the value on its own lines).
fn trim_one_newline(s: &str) -> &str {
    let s = s.strip_prefix("\r\n").or(s.strip_prefix('\n')).unwrap_or(s);
    s.strip_suffix("\r\n").or(s.strip_suffix('\n')).unwrap_or(s)
}

/// Parses the inside of one `<tool_call>...</tool_call>` block.
pub fn parse_call(inner: &str, tools: &[Value]) -> Result<ToolCall, String> {
    let s = inner.trim();
    let rest = s
        .strip_prefix("<function=")
        .ok_or("the block does not start with <function=NAME>")?;
    let gt = rest.find('>').ok_or("<function= is not closed by >")?;
    let name = rest[..gt].trim().to_string();
    if name.is_empty() || name.contains(['<', '\n']) {
        return Err(format!("bad function name {name:?}"));
    }
    let body = rest[gt + 1..]
        .strip_suffix("</function>")
        .ok_or("</function> missing at the end of the block")?;
    let mut arguments = Map::new();
    let mut rest = body;
    loop {
        let trimmed = rest.trim_start();
        if trimmed.is_empty() {
            break;
        }
        let after = trimmed
            .strip_prefix("<parameter=")
            .ok_or_else(|| format!("unexpected text in the call: {:?}", short(trimmed)))?;
        let gt = after.find('>').ok_or("<parameter= is not closed by >")?;
        let param = after[..gt].trim();
        if param.is_empty() || param.contains(['<', '\n']) {
            return Err(format!("bad parameter name {param:?}"));
        }
        let value_and_rest = &after[gt + 1..];
        let end = value_and_rest
            .find("</parameter>")
            .ok_or_else(|| format!("parameter {param} is not closed by </parameter>"))?;
        let raw = trim_one_newline(&value_and_rest[..end]);
        let types = param_types(tools, &name, param);
        arguments.insert(param.to_string(), typed_value(raw, &types));
        rest = &value_and_rest[end + "</parameter>".len()..];
    }
    Ok(ToolCall { name, arguments })
}

fn short(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Length of the longest proper prefix of `pat` that `s` ends with.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&n| {
            s.is_char_boundary(s.len() - n)
                && pat.as_bytes().starts_with(&s.as_bytes()[s.len() - n..])
        })
        .unwrap_or(0)
}

/// Pulls tool calls out of text that arrives in pieces (see the module docs).
pub struct ToolCallStream {
    tools: Vec<Value>,
    /// Text outside a block, held back: a possible start of `<tool_call>`, or whitespace
    /// that is dropped when it only separates calls.
    pending: String,
    /// Inside a block: its text so far (after `<tool_call>`).
    inside: Option<String>,
    /// Calls yielded so far.
    pub calls: usize,
    /// Blocks that did not parse (returned as text).
    pub malformed: usize,
}

impl ToolCallStream {
    pub fn new(tools: &[Value]) -> Self {
        ToolCallStream {
            tools: tools.to_vec(),
            pending: String::new(),
            inside: None,
            calls: 0,
            malformed: 0,
        }
    }

    /// Feeds text; returns what is settled.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut input = text.to_string();
        loop {
            match &mut self.inside {
                Some(buf) => {
                    buf.push_str(&input);
                    let Some(at) = buf.find(CLOSE) else {
                        return out;
                    };
                    let block = buf[..at].to_string();
                    input = buf[at + CLOSE.len()..].to_string();
                    self.inside = None;
                    match parse_call(&block, &self.tools) {
                        Ok(call) => {
                            self.calls += 1;
                            out.push(Piece::Call(call));
                        }
                        Err(e) => {
                            self.malformed += 1;
                            tracing::warn!("malformed tool call ({e}); returning it as text");
                            out.push(Piece::Text(format!("{OPEN}{block}{CLOSE}")));
                        }
                    }
                }
                None => {
                    self.pending.push_str(&input);
                    input.clear();
                    if let Some(at) = self.pending.find(OPEN) {
                        let before = self.pending[..at].to_string();
                        let after = self.pending[at + OPEN.len()..].to_string();
                        self.pending.clear();
                        // Whitespace between calls (or before the first) is not content.
                        if !before.trim().is_empty() {
                            out.push(Piece::Text(before));
                        }
                        self.inside = Some(String::new());
                        input = after;
                        continue;
                    }
                    let hold = partial_suffix(&self.pending, OPEN);
                    let ready = self.pending.len() - hold;
                    let (emit, keep) = self.pending.split_at(ready);
                    if emit.trim().is_empty() {
                        // Only whitespace so far: hold it until something follows.
                        return out;
                    }
                    let (emit, keep) = (emit.to_string(), keep.to_string());
                    out.push(Piece::Text(emit));
                    self.pending = keep;
                    return out;
                }
            }
        }
    }

    /// Ends the text: a block still open is truncated and comes back as text; held-back
    /// whitespace comes back unless it only trails tool calls.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        let separator = self.calls > 0 && pending.trim().is_empty();
        if !pending.is_empty() && !separator {
            out.push(Piece::Text(pending));
        }
        if let Some(buf) = self.inside.take() {
            self.malformed += 1;
            tracing::warn!("truncated tool call (no {CLOSE}); returning it as text");
            out.push(Piece::Text(format!("{OPEN}{buf}")));
        }
        out
    }
}

/// The whole-text form: content (tool-call blocks removed) and the calls.
pub fn extract(text: &str, tools: &[Value]) -> (String, Vec<ToolCall>) {
    let mut s = ToolCallStream::new(tools);
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "filter": {"type": "object"},
                    "tags": {"type": "array"},
                    "note": {"type": ["integer", "string"]}
                }
            }}}),
        ]
    }

    const ONE: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn well_formed_call_typed_by_schema() {
        let (content, calls) = extract(&format!("Let me check.\n\n{ONE}"), &tools());
        assert_eq!(content, "Let me check.\n\n");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            Value::Object(calls[0].arguments.clone()),
            json!({"city": "Paris", "days": 3})
        );
        assert_eq!(calls[0].arguments_json(), r#"{"city":"Paris","days":3}"#);
    }

    #[test]
    fn multiple_calls_and_whitespace_between() {
        let text = format!("{ONE}\n{ONE}\n");
        let (content, calls) = extract(&text, &tools());
        assert_eq!(content, "");
        assert_eq!(calls.len(), 2);
    }

    #[test]
    fn nested_json_values_and_fallbacks() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=filter>\n{\"a\": [1, {\"b\": null}]}\n</parameter>\n<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=note>\nabc\n</parameter>\n<parameter=days>\nmany\n</parameter>\n<parameter=unknown>\n42\n</parameter>\n<parameter=city>\nline one\nline two\n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = extract(text, &tools());
        assert_eq!(
            Value::Object(calls[0].arguments.clone()),
            json!({"filter": {"a": [1, {"b": null}]}, "tags": ["x", "y"], "metric": true,
                   "ratio": 0.5, "note": "abc", "days": "many", "unknown": "42",
                   "city": "line one\nline two"})
        );
    }

    #[test]
    fn truncated_call_comes_back_as_text() {
        let text = "Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
        let (content, calls) = extract(text, &tools());
        assert!(calls.is_empty());
        assert_eq!(content, text);
    }

    #[test]
    fn malformed_calls_come_back_as_text() {
        for bad in [
            "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\nstray <parameter=city>\nx\n</parameter>\n</function>\n</tool_call>",
        ] {
            let (content, calls) = extract(&format!("a {bad} b"), &tools());
            assert!(calls.is_empty(), "{bad}");
            assert_eq!(content, format!("a {bad} b"));
        }
        // a good call after a bad one is still found
        let text = format!("<tool_call>oops</tool_call>{ONE}");
        let (content, calls) = extract(&text, &tools());
        assert_eq!(calls.len(), 1);
        assert_eq!(content, "<tool_call>oops</tool_call>");
    }

    #[test]
    fn streaming_in_tiny_pieces_matches_whole_text() {
        let text = format!("Checking <tool_ the weather.\n{ONE}\n{ONE}\nDone <tool");
        let mut s = ToolCallStream::new(&tools());
        let mut pieces = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(3) {
            pieces.extend(s.push(&c.iter().collect::<String>()));
        }
        pieces.extend(s.finish());
        let calls = pieces
            .iter()
            .filter(|p| matches!(p, Piece::Call(_)))
            .count();
        let content: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(calls, 2);
        assert_eq!(content, "Checking <tool_ the weather.\n\nDone <tool");
        assert_eq!(extract(&text, &tools()).0, content);
    }
}
