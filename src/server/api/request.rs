//! Request bodies: [`parse_chat`] (messages, tools, `tool_choice`, template kwargs) and
//! [`parse_completion`] (the prompt); both read their [`GenParams`] with [`parse_gen_params`].

use super::error::{ApiError, R};
use super::params::{GenParams, parse_gen_params, present, type_error};
use crate::sampling::SamplingParams;
use serde_json::{Map, Value, json};

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
    /// The start of the reply, written after the generation prompt for the model to continue
    /// (Anthropic's final assistant message); not part of the response.
    pub prefill: Option<String>,
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
        if role == "tool" && !matches!(present(obj, "tool_call_id"), Some(Value::String(_))) {
            return Err(ApiError::invalid(
                &format!("{p}.tool_call_id"),
                format!(
                    "`{p}.tool_call_id` is required for a tool message: the id of the assistant's tool call it answers"
                ),
            ));
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
        if let Some(params) = t.pointer("/function/parameters").filter(|v| !v.is_null())
            && !params.is_object()
        {
            return Err(type_error(
                &format!("{p}.function.parameters"),
                "a JSON Schema object",
                params,
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
    // The chat template needs a user turn; say so before it does in its own terms.
    if !messages.iter().any(|m| m["role"] == "user") {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one user message (a conversation of only system, assistant or tool messages has no query to answer)",
        ));
    }
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
        prefill: None,
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
    }
}
