//! The options both endpoints share ([`GenParams`]: sampling, stop strings, streaming,
//! logprobs...) and the typed field readers that validation is built from.

use super::error::{ApiError, R};
use crate::sampling::{SamplingParams, check};
use serde_json::{Map, Value, json};

pub(super) fn type_error(key: &str, what: &str, v: &Value) -> ApiError {
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

pub(super) fn present<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
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
    /// `response_format` `json_object` / `json_schema` (chat only): what the answer must be.
    pub constraint: Option<crate::grammar::Constraint>,
    /// Strict tools' calls (chat, set from `tools` once the prompt is rendered).
    pub tool_calls: Option<crate::grammar::ToolCalls>,
}

/// `response_format` (OpenAI's shape): `text` is no constraint; `json_object` any JSON
/// object; `json_schema` `{name, schema, strict}` JSON valid against `schema` (enforced
/// whether or not `strict` is set; a missing `schema` allows any JSON value). Whether the
/// schema compiles is checked when the request is submitted.
fn parse_response_format(obj: &Map<String, Value>) -> R<Option<crate::grammar::Constraint>> {
    use crate::grammar::Constraint;
    let Some(v) = present(obj, "response_format") else {
        return Ok(None);
    };
    let o = v
        .as_object()
        .ok_or_else(|| type_error("response_format", "an object", v))?;
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let key = "response_format.json_schema";
            let js = match present(o, "json_schema") {
                Some(Value::Object(js)) => js,
                Some(v) => return Err(type_error(key, "an object", v)),
                None => {
                    return Err(ApiError::invalid(
                        key,
                        "`response_format.json_schema` is required when `type` is \"json_schema\"",
                    ));
                }
            };
            match present(js, "name") {
                Some(Value::String(n))
                    if (1..=64).contains(&n.len())
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                Some(v) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        format!(
                            "`response_format.json_schema.name` must be 1 to 64 letters, digits, '_' or '-', not {}",
                            short_json(v)
                        ),
                    ));
                }
                None => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` is required",
                    ));
                }
            }
            if let Some(v) = present(js, "strict")
                && !v.is_boolean()
            {
                return Err(type_error(
                    "response_format.json_schema.strict",
                    "a boolean",
                    v,
                ));
            }
            let schema = match present(js, "schema") {
                None => json!({}),
                Some(s @ Value::Object(_)) => s.clone(),
                Some(v) => {
                    return Err(type_error(
                        "response_format.json_schema.schema",
                        "a JSON schema object",
                        v,
                    ));
                }
            };
            Ok(Some(Constraint::JsonSchema(schema)))
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", not {}",
                short_json(o.get("type").unwrap_or(&Value::Null))
            ),
        )),
    }
}

/// Options this server refuses rather than silently ignores, with the value that is harmless.
fn refuse_unsupported(obj: &Map<String, Value>, chat: bool) -> R<()> {
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
            "response_format" if chat => true,
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
    refuse_unsupported(obj, chat)?;
    let constraint = if chat {
        parse_response_format(obj)?
    } else {
        None
    };
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
    // OpenAI's own answer: stream options only apply to a stream.
    if !stream && present(obj, "stream_options").is_some() {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
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
        constraint,
        tool_calls: None,
    })
}
