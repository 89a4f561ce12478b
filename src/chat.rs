//! The checkpoint's Jinja chat template, rendered with minijinja the way transformers'
//! `apply_chat_template` renders it (trim_blocks, lstrip_blocks, Python string methods,
//! `tojson` as Python's `json.dumps(ensure_ascii=False)`), so prompts are byte-exact.

use anyhow::{Context, Result, anyhow};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;
use std::path::Path;

pub struct ChatTemplate {
    env: Environment<'static>,
}

/// What to render: OpenAI-style messages and tool definitions as JSON, plus switches.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    pub messages: Vec<Json>,
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    /// `None` leaves `enable_thinking` undefined (the template's default: thinking on).
    pub enable_thinking: Option<bool>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `preserve_thinking`).
    pub extra: serde_json::Map<String, Json>,
}

/// serde_json formatter with Python's default `json.dumps` separators `", "` and `": "`.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)` as Python writes it.
pub fn python_json(value: &Json, indent: Option<usize>) -> String {
    let mut out = Vec::new();
    let result = match indent {
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompact);
            serde::Serialize::serialize(value, &mut ser)
        }
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            serde::Serialize::serialize(value, &mut ser)
        }
    };
    result.expect("serialising a JSON value cannot fail");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = match indent {
        Some(v) => Some(v),
        None => kwargs.get("indent")?,
    };
    // Python-only options that do not change our output for JSON-shaped data.
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(python_json(&json, indent)))
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow!("template syntax config: {e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| anyhow!("the chat template does not parse: {e:#}"))?;
        Ok(ChatTemplate { env })
    }

    /// `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`; `None` if neither.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let src = std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read {}", jinja.display()))?;
            return Self::new(&src)
                .map(Some)
                .with_context(|| jinja.display().to_string());
        }
        let cfg = dir.join("tokenizer_config.json");
        if cfg.exists() {
            let text = std::fs::read_to_string(&cfg)
                .with_context(|| format!("cannot read {}", cfg.display()))?;
            let json: Json = serde_json::from_str(&text)
                .map_err(|e| anyhow!("{} is not valid JSON: {e}", cfg.display()))?;
            if let Some(src) = json.get("chat_template").and_then(Json::as_str) {
                return Self::new(src)
                    .map(Some)
                    .with_context(|| format!("{} chat_template", cfg.display()));
            }
        }
        Ok(None)
    }

    pub fn render(&self, req: &ChatRequest) -> Result<String> {
        let mut ctx = req.extra.clone();
        let messages: Vec<Json> = req.messages.iter().map(normalise_message).collect();
        ctx.insert("messages".into(), Json::Array(messages));
        if let Some(tools) = &req.tools {
            ctx.insert("tools".into(), Json::Array(tools.clone()));
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(req.add_generation_prompt),
        );
        if let Some(t) = req.enable_thinking {
            ctx.insert("enable_thinking".into(), Json::Bool(t));
        }
        ctx.entry("bos_token")
            .or_insert(Json::String(String::new()));
        ctx.entry("eos_token")
            .or_insert(Json::String("<|im_end|>".into()));
        let tmpl = self.env.get_template("chat").expect("added in new()");
        tmpl.render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| anyhow!("chat template: {e:#}"))
    }
}

/// As transformers prepares messages: keys set to null are dropped, and reasoning given as
/// `reasoning_content`, `thinking` or `reasoning` is exposed under both names templates use.
fn normalise_message(m: &Json) -> Json {
    let Some(obj) = m.as_object() else {
        return m.clone();
    };
    let mut out: serde_json::Map<String, Json> = obj
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| out.get(*k).cloned());
    if let Some(r) = reasoning {
        out.insert("thinking".into(), r.clone());
        out.insert("reasoning_content".into(), r);
    }
    Json::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_json_separators_and_unicode() {
        let v = json!({"b": [1, 2.5, "é"], "a": {"x": null}});
        assert_eq!(
            python_json(&v, None),
            r#"{"b": [1, 2.5, "é"], "a": {"x": null}}"#
        );
        assert_eq!(python_json(&json!([1]), Some(2)), "[\n  1\n]");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('bad role') }}").unwrap();
        let e = t.render(&ChatRequest::default()).unwrap_err().to_string();
        assert!(e.contains("bad role"), "{e}");
    }
}
