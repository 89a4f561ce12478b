//! `kestrel serve` end to end over real HTTP on 127.0.0.1: the demo model (random weights, so
//! only shapes, counts and reproducibility are checked), a scripted engine whose output is
//! forced (reasoning split, tool calls, stop strings, exact text), and the binary itself.

use anyhow::Result;
use kestrel::config::{GenerationConfig, TextConfig};
use kestrel::model::{CpuModel, Engine, Logits};
use kestrel::server::{Drained, ServerConfig, Shared, drain, run_model, serve};
use kestrel::tensor::DType;
use kestrel::tokenizer::{Tokenizer, special};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const GENERATION_CONFIG: &str = include_str!("../assets/qwen3_6/generation_config.json");

fn config(max_seq: usize, api_key: Option<&str>) -> ServerConfig {
    ServerConfig {
        model_id: "test-model".into(),
        max_seq,
        api_key: api_key.map(str::to_string),
        cache_mem: 1 << 30,
        request_timeout: Duration::from_secs(120),
        default_max_tokens: 8,
        prefill_chunk: 4096,
        max_queue: 64,
        max_running: Some(4),
    }
}

/// Starts a server in-process on a free port; the engine is built on the model thread by
/// `make` (after `load_delay`, to observe the loading state).
fn start<E: Engine + 'static>(
    make: impl FnOnce() -> E + Send + 'static,
    cfg: ServerConfig,
    load_delay: Duration,
) -> SocketAddr {
    start_shared(make, cfg, load_delay).0
}

/// [`start`], also returning the server's shared state (to drain it).
fn start_shared<E: Engine + 'static>(
    make: impl FnOnce() -> E + Send + 'static,
    cfg: ServerConfig,
    load_delay: Duration,
) -> (SocketAddr, Arc<Shared>) {
    let tokenizer = Tokenizer::bundled().unwrap();
    let generation = GenerationConfig::from_json_str(GENERATION_CONFIG).unwrap();
    let (shared, rx) = Shared::new(cfg, tokenizer, &generation).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let model_shared = shared.clone();
    let http_shared = shared.clone();
    std::thread::spawn(move || {
        std::thread::sleep(load_delay);
        let engine = make();
        run_model(&engine, model_shared, rx).unwrap();
    });
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            serve(l, http_shared, std::future::pending()).await.unwrap();
        });
    });
    (addr, shared)
}

fn wait_ready(addr: SocketAddr) {
    let t0 = Instant::now();
    while http(addr, "GET", "/health", None, &[]).0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(30), "server never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn demo_engine() -> CpuModel {
    let cfg = kestrel::synthetic::demo_config();
    let w = kestrel::synthetic::random_weights(&cfg, kestrel::synthetic::DEMO_SEED, DType::BF16);
    CpuModel::new(cfg, w)
}

/// One demo-model server shared by the tests.
fn demo() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let a = start(demo_engine, config(32_768, None), Duration::ZERO);
        wait_ready(a);
        a
    })
}

/// An engine that writes a fixed script (then `<|im_end|>`), whatever the prompt: the
/// position advances when the fed token is the one it predicted.
struct Scripted {
    config: TextConfig,
    script: Vec<u32>,
    /// Time each forward call takes (to keep requests running while a test watches).
    delay: Duration,
}

#[derive(Clone)]
struct ScriptState {
    len: usize,
    pos: usize,
    last: Option<u32>,
}

impl Engine for Scripted {
    type State = ScriptState;
    fn config(&self) -> &TextConfig {
        &self.config
    }
    fn new_state(&self) -> anyhow::Result<ScriptState> {
        Ok(ScriptState {
            len: 0,
            pos: 0,
            last: None,
        })
    }
    fn state_len(&self, s: &ScriptState) -> usize {
        s.len
    }
    fn state_bytes(&self, _: &ScriptState) -> usize {
        64
    }
    fn forward(&self, s: &mut ScriptState, tokens: &[u32], _: Logits) -> Result<Vec<f32>> {
        std::thread::sleep(self.delay);
        s.len += tokens.len();
        s.pos = if s.last.is_some_and(|p| tokens == [p]) {
            s.pos + 1
        } else {
            0
        };
        let next = self.script.get(s.pos).copied().unwrap_or(special::IM_END);
        s.last = Some(next);
        let mut logits = vec![0.0; self.config.vocab_size];
        logits[next as usize] = 100.0;
        Ok(logits)
    }
}

fn scripted_server(text: &str) -> SocketAddr {
    scripted_server_with(text, 4096)
}

fn scripted_server_with(text: &str, max_seq: usize) -> SocketAddr {
    let a = start(scripted(text), config(max_seq, None), Duration::ZERO);
    wait_ready(a);
    a
}

/// A factory for a [`Scripted`] engine writing `text`.
fn scripted(text: &str) -> impl FnOnce() -> Scripted + Send + 'static {
    slow_scripted(text, Duration::ZERO)
}

/// [`scripted`], each forward call taking `delay`.
fn slow_scripted(text: &str, delay: Duration) -> impl FnOnce() -> Scripted + Send + 'static {
    let script = Tokenizer::bundled().unwrap().encode(text, true).unwrap();
    move || Scripted {
        config: kestrel::synthetic::demo_config(),
        script,
        delay,
    }
}

/// A minimal HTTP/1.1 client: (status, body), chunked bodies decoded.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request(method, path, body, headers).as_bytes())
        .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, rest) = text.split_once("\r\n\r\n").expect("no header end");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, body)
}

fn request(method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> String {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        ));
    } else {
        r.push_str("\r\n");
    }
    r
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some(&body.to_string()), &[]);
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

fn chat(addr: SocketAddr, body: Value) -> Value {
    let (status, v) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    v
}

/// The `data:` payloads of an SSE body (the last must be `[DONE]`).
fn sse_events(body: &str) -> Vec<Value> {
    let datas: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not SSE data: {e:?}"))
        })
        .collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "{body}");
    datas[..datas.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn health_is_503_while_loading_then_200() {
    let a = start(
        scripted("hello"),
        config(4096, None),
        Duration::from_millis(1000),
    );
    // Readiness (what routers probe) fails while loading; liveness holds.
    for path in ["/health", "/ready"] {
        let (status, body) = http(a, "GET", path, None, &[]);
        assert_eq!(status, 503, "{path}: {body}");
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap()["status"],
            "loading"
        );
    }
    let (status, body) = http(a, "GET", "/live", None, &[]);
    assert_eq!(status, 200, "{body}");
    let (status, v) = post(a, "/v1/chat/completions", &json!({"messages": user("hi")}));
    assert_eq!(status, 503);
    assert!(v["error"]["message"].is_string());
    wait_ready(a);
    for path in ["/health", "/ready", "/live"] {
        let (status, body) = http(a, "GET", path, None, &[]);
        assert_eq!(status, 200, "{path}: {body}");
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap()["status"],
            "ok"
        );
    }
    let (status, body) = http(a, "GET", "/get_load", None, &[]);
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["load"], 0);
    let (status, body) = http(a, "GET", "/v1/models", None, &[]);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "test-model");
}

#[test]
fn chat_non_streaming_shape_and_usage() {
    let a = demo();
    let v = chat(
        a,
        json!({"model": "test-model", "messages": user("Hello!"), "max_tokens": 5, "seed": 3,
               "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert_eq!(choice["finish_reason"], "length");
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 5);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + 5
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(u["completion_tokens_details"]["reasoning_tokens"], 0);
}

#[test]
fn chat_streaming_matches_non_streaming_with_the_same_seed() {
    let a = demo();
    let body = json!({"messages": user("Tell me a story."), "max_tokens": 6, "seed": 11,
                      "temperature": 0.8, "logprobs": true, "top_logprobs": 2});
    let whole = chat(a, body.clone());
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (status, text) = http(
        a,
        "POST",
        "/v1/chat/completions",
        Some(&sbody.to_string()),
        &[],
    );
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let (mut reasoning, mut content, mut finish, mut lps) = (String::new(), String::new(), None, 0);
    for e in &events[..events.len() - 1] {
        assert_eq!(e["object"], "chat.completion.chunk");
        assert!(e["usage"].is_null() && e.as_object().unwrap().contains_key("usage"));
        let c = &e["choices"][0];
        reasoning.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        if let Some(l) = c["logprobs"]["content"].as_array() {
            lps += l.len();
            assert_eq!(l[0]["top_logprobs"].as_array().unwrap().len(), 2);
        }
        if !c["finish_reason"].is_null() {
            finish = Some(c["finish_reason"].clone());
        }
    }
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert_eq!(finish, Some(json!("length")));
    let m = &whole["choices"][0]["message"];
    assert_eq!(reasoning, m["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(content, m["content"].as_str().unwrap_or(""));
    // thinking is on by default: the demo model's tokens land in the reasoning channel
    assert_eq!(
        whole["usage"]["completion_tokens_details"]["reasoning_tokens"],
        6
    );
    assert_eq!(lps, 6);
    assert_eq!(
        whole["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        6
    );
}

#[test]
fn seed_reproducibility() {
    let a = demo();
    let body = json!({"messages": user("Pick a number."), "max_tokens": 6, "seed": 1234,
                      "temperature": 1.0, "top_k": 0, "top_p": 1.0});
    let x = chat(a, body.clone());
    let y = chat(a, body);
    assert_eq!(x["choices"][0]["message"], y["choices"][0]["message"]);
}

#[test]
fn completions_plain_and_streaming() {
    let a = demo();
    let body = json!({"prompt": "The kestrel is", "max_tokens": 4, "seed": 5, "logprobs": 1});
    let (status, v) = post(a, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (status, raw) = http(a, "POST", "/v1/completions", Some(&sbody.to_string()), &[]);
    assert_eq!(status, 200);
    let events = sse_events(&raw);
    let streamed: String = events
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
}

#[test]
fn prefix_cache_hit_for_a_shared_system_prompt() {
    let a = demo();
    let system = "You are the prefix cache test. ".repeat(8);
    let ask = |q: &str| {
        chat(
            a,
            json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                   "max_tokens": 2}),
        )
    };
    let first = ask("first question");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = ask("second, different question");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 50, "cached {cached}: {second}");
    assert!(cached < second["usage"]["prompt_tokens"].as_u64().unwrap());
    let (_, metrics) = http(a, "GET", "/metrics", None, &[]);
    assert!(metrics.contains("kestrel_prefix_cache_hits_total"));
    let hits: u64 = metric(&metrics, "kestrel_prefix_cache_hits_total");
    assert!(hits >= 1);
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name}"))
        .trim()
        .parse::<f64>()
        .unwrap() as u64
}

#[test]
fn client_disconnect_stops_generation_and_frees_the_slot() {
    let a = demo();
    let body = json!({"messages": user("Write a very long essay."), "max_tokens": 5000,
                      "stream": true, "seed": 9});
    let before = metric(
        &http(a, "GET", "/metrics", None, &[]).1,
        "kestrel_cancelled_total",
    );
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request("POST", "/v1/chat/completions", Some(&body.to_string()), &[]).as_bytes())
        .unwrap();
    // read until a few chunks of content have arrived, then hang up
    let mut reader = BufReader::new(s);
    let mut datas = 0;
    let mut line = String::new();
    while datas < 4 {
        line.clear();
        reader.read_line(&mut line).unwrap();
        if line.contains("data: ") {
            datas += 1;
        }
    }
    drop(reader);
    let t0 = Instant::now();
    loop {
        let m = http(a, "GET", "/metrics", None, &[]).1;
        if metric(&m, "kestrel_cancelled_total") > before {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "generation never stopped:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // a non-streaming client that hangs up is noticed too
    let mut s = TcpStream::connect(a).unwrap();
    let mut b = body.clone();
    b["stream"] = json!(false);
    s.write_all(request("POST", "/v1/chat/completions", Some(&b.to_string()), &[]).as_bytes())
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(s);
    let t0 = Instant::now();
    loop {
        let m = http(a, "GET", "/metrics", None, &[]).1;
        if metric(&m, "kestrel_cancelled_total") > before + 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "generation never stopped:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // the slot is free: a short request completes promptly
    let v = chat(a, json!({"messages": user("after"), "max_tokens": 2}));
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let m = http(a, "GET", "/metrics", None, &[]).1;
    // (other tests share this server, so the gauges are only checked to be there)
    assert!(metric(&m, "kestrel_running_sequences") <= 4);
    assert!(metric(&m, "kestrel_queue_depth") < 64);
    assert!(m.contains("kestrel_time_to_first_token_seconds_bucket{le=\"+Inf\"}"));
    assert!(m.contains("kestrel_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"));
}

#[test]
fn concurrent_clients_all_complete() {
    let a = demo();
    let n = 32;
    let handles: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({"messages": user(&format!("client {i}")), "max_tokens": 3,
                                  "seed": i, "stream": i % 2 == 0});
                let (status, text) = http(
                    a,
                    "POST",
                    "/v1/chat/completions",
                    Some(&body.to_string()),
                    &[],
                );
                assert_eq!(status, 200, "{text}");
                if i % 2 == 0 {
                    let ev = sse_events(&text);
                    assert_eq!(ev.last().unwrap()["choices"][0]["finish_reason"], "length");
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    assert_eq!(v["usage"]["completion_tokens"], 3);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn errors_have_openai_shape_and_status() {
    let a = demo();
    let ok_msgs = user("hi");
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, None),
        ("/v1/chat/completions", "[1, 2]".into(), 400, None),
        (
            "/v1/chat/completions",
            json!({}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": 5}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 3}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "model": "gpt-9"}).to_string(),
            404,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "temperature": 7e9, "top_p": 1.5}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "presence_penalty": 3}).to_string(),
            400,
            Some("presence_penalty"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "max_tokens": "ten"}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "n": 2}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "response_format": {"type": "json_object"}}).to_string(),
            400,
            Some("response_format"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ok_msgs, "stream": "yes"}).to_string(),
            400,
            Some("stream"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "assistant", "content": "x"}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"]}).to_string(),
            400,
            Some("prompt"),
        ),
        ("/v1/nothing", json!({}).to_string(), 404, None),
    ];
    for (path, body, status, param) in cases {
        let (got, text) = http(a, "POST", path, Some(&body), &[]);
        assert_eq!(got, status, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{text}");
        assert!(
            e.as_object().unwrap().contains_key("param")
                && e.as_object().unwrap().contains_key("code")
        );
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{body}: {text}");
        }
        if status == 404 && path.ends_with("completions") {
            assert_eq!(e["code"], "model_not_found");
        }
    }
    let (got, _) = http(a, "GET", "/v1/chat/completions", None, &[]);
    assert_eq!(got, 405);
    // odd bodies are client errors, never 500
    let m = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let odd = [
        "null".to_string(),
        "\"text\"".to_string(),
        "".to_string(),
        json!({"messages": [null]}).to_string(),
        json!({"messages": [{"role": "user", "content": [null]}]}).to_string(),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).to_string(),
        json!({"messages": [{"role": "tool", "content": "x"}]}).to_string(),
        json!({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]}).to_string(),
        json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}).to_string(),
        m(json!({"stop": [1]})),
        m(json!({"stop": [""]})),
        m(json!({"tools": {}})),
        m(json!({"tools": [{"type": "function"}]})),
        m(json!({"tool_choice": "sometimes"})),
        m(json!({"top_k": -5})),
        m(json!({"seed": "x"})),
        m(json!({"max_tokens": 1.5})),
        m(json!({"stream_options": true})),
        m(json!({"chat_template_kwargs": {"enable_thinking": "yes"}})),
        m(json!({"model": 7})),
        m(json!({"thinking_budget": -1})),
    ];
    for body in odd {
        let (got, text) = http(a, "POST", "/v1/chat/completions", Some(&body), &[]);
        assert!((400..500).contains(&got), "{body}: {got} {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        assert!(v["error"]["message"].is_string(), "{text}");
    }
}

#[test]
fn api_key_is_enforced() {
    let a = start(
        scripted("hello"),
        config(4096, Some("sekret")),
        Duration::ZERO,
    );
    wait_ready(a);
    let body = json!({"messages": user("hi"), "max_tokens": 1}).to_string();
    let (s, t) = http(a, "POST", "/v1/chat/completions", Some(&body), &[]);
    assert_eq!(s, 401, "{t}");
    assert!(t.contains("invalid_api_key"));
    let (s, _) = http(
        a,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[("Authorization", "Bearer nope")],
    );
    assert_eq!(s, 401);
    let (s, _) = http(a, "GET", "/v1/models", None, &[]);
    assert_eq!(s, 401);
    let (s, t) = http(
        a,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[("Authorization", "Bearer sekret")],
    );
    assert_eq!(s, 200, "{t}");
    assert_eq!(http(a, "GET", "/health", None, &[]).0, 200);
    // The scheme in any case, and Anthropic's header; a key of another length or one wrong
    // byte is refused.
    for (h, v, want) in [
        ("Authorization", "bearer sekret", 200),
        ("Authorization", "BEARER sekret", 200),
        ("x-api-key", "sekret", 200),
        ("x-api-key", "sekreT", 401),
        ("Authorization", "Bearer sekret2", 401),
        ("Authorization", "Basic sekret", 401),
    ] {
        let (s, t) = http(a, "GET", "/v1/models", None, &[(h, v)]);
        assert_eq!(s, want, "{h}: {v}: {t}");
    }
}

#[test]
fn models_retrieve_by_id_and_404_for_others() {
    let a = demo();
    let (s, t) = http(a, "GET", "/v1/models/test-model", None, &[]);
    assert_eq!(s, 200, "{t}");
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["id"], "test-model");
    assert_eq!(v["object"], "model");
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
    let (s, t) = http(a, "GET", "/v1/models/gpt-4o", None, &[]);
    assert_eq!(s, 404, "{t}");
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(v["error"]["message"].as_str().unwrap().contains("gpt-4o"));
}

#[test]
fn scripted_reasoning_split_stream_and_whole() {
    let a = scripted_server("Two plus two.\n</think>\n\nThe answer is 4.");
    let v = chat(a, json!({"messages": user("2+2?"), "max_tokens": 40}));
    let m = &v["choices"][0]["message"];
    assert_eq!(
        m["reasoning_content"].as_str().unwrap().trim(),
        "Two plus two."
    );
    assert_eq!(m["content"], "The answer is 4.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = v["usage"]["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    let c = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(r >= 4 && r < c, "{v}");
    let body = json!({"messages": user("2+2?"), "max_tokens": 40, "stream": true});
    let (_, raw) = http(
        a,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &[],
    );
    let ev = sse_events(&raw);
    let join = |k: &str| -> String {
        ev.iter()
            .filter_map(|e| e["choices"][0]["delta"][k].as_str())
            .collect()
    };
    assert_eq!(join("reasoning_content").trim(), "Two plus two.");
    assert_eq!(join("content"), "The answer is 4.");
    assert_eq!(ev.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[test]
fn scripted_stop_strings() {
    let a = scripted_server("Hello world. END and more text");
    let body = json!({"messages": user("hi"), "max_tokens": 40, "stop": ["END", "zzz"],
                      "chat_template_kwargs": {"enable_thinking": false}});
    let v = chat(a, body.clone());
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world. ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut s = body;
    s["stream"] = json!(true);
    let (_, raw) = http(a, "POST", "/v1/chat/completions", Some(&s.to_string()), &[]);
    let content: String = sse_events(&raw)
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(content, "Hello world. ");
    // a prompt over the context limit (4096 here) names both numbers
    let long = "word ".repeat(5000);
    let (status, v) = post(a, "/v1/chat/completions", &json!({"messages": user(&long)}));
    assert_eq!(status, 400);
    let msg = v["error"]["message"].as_str().unwrap();
    let numbers: Vec<u64> = msg
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(
        numbers.contains(&4096) && numbers.iter().any(|&n| n > 5000),
        "{msg}"
    );
    assert_eq!(v["error"]["param"], "messages");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
}

const WEATHER_TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather",
  "description": "Weather forecast", "parameters": {"type": "object", "properties": {
  "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
  "required": ["city"]}}}]"#;

#[test]
fn scripted_tool_calls_whole_and_streamed() {
    let call = |city: &str, days: u32| {
        format!(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n{days}\n</parameter>\n<parameter=opts>\n{{\"units\": [\"C\"]}}\n</parameter>\n</function>\n</tool_call>"
        )
    };
    let script = format!(
        "I should call the tool.\n</think>\n\n{}\n{}",
        call("Paris", 3),
        call("Oslo", 1)
    );
    let a = scripted_server(&script);
    let tools: Value = serde_json::from_str(WEATHER_TOOLS).unwrap();
    let body = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
        {"role": "user", "content": "And Paris and Oslo?"}
    ], "tools": tools, "max_tokens": 200});
    let v = chat(a, body.clone());
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert!(c["message"]["content"].is_null(), "{v}");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(
        args,
        json!({"city": "Paris", "days": 3, "opts": {"units": ["C"]}})
    );
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    // streamed: each call arrives as one tool_calls delta with its index
    let mut s = body.clone();
    s["stream"] = json!(true);
    let (_, raw) = http(a, "POST", "/v1/chat/completions", Some(&s.to_string()), &[]);
    let ev = sse_events(&raw);
    let deltas: Vec<&Value> = ev
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array())
        .map(|a| &a[0])
        .collect();
    assert_eq!(deltas.len(), 2);
    assert_eq!(deltas[1]["index"], 1);
    let args: Value =
        serde_json::from_str(deltas[1]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["city"], "Oslo");
    assert_eq!(
        ev.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // without tools the same text is plain content
    let mut plain = body;
    plain.as_object_mut().unwrap().remove("tools");
    let v = chat(a, plain);
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("<tool_call>")
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn scripted_named_tool_choice_forces_the_call() {
    // The prompt is prefilled with `<tool_call>\n<function=get_weather>\n`; the script
    // writes the rest of the call.
    let a = scripted_server("<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>");
    let tools: Value = serde_json::from_str(WEATHER_TOOLS).unwrap();
    let v = chat(
        a,
        json!({"messages": user("weather?"), "tools": tools, "max_tokens": 50,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    );
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert_eq!(
        c["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert_eq!(
        c["message"]["tool_calls"][0]["function"]["arguments"],
        r#"{"city":"Lima"}"#
    );
    assert!(c["message"].get("reasoning_content").is_none());
    let (status, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": user("x"), "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("tool_choice"))
    );
}

#[test]
fn request_timeout_stops_a_long_generation() {
    let mut cfg = config(32_768, None);
    cfg.request_timeout = Duration::from_millis(800);
    // a script far longer than the timeout allows
    let a = start(scripted(&"word ".repeat(20_000)), cfg, Duration::ZERO);
    wait_ready(a);
    let t0 = Instant::now();
    let (status, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": user("go on forever"), "max_tokens": 100000}),
    );
    assert_eq!(status, 504, "{v}");
    assert_eq!(v["error"]["type"], "timeout");
    assert!(t0.elapsed() < Duration::from_secs(10));
    // the server still answers afterwards (within a fresh deadline)
    let v = chat(a, json!({"messages": user("short"), "max_tokens": 1}));
    assert_eq!(v["usage"]["completion_tokens"], 1);
}

#[test]
fn scripted_truncated_tool_call_is_returned_as_content() {
    let a = scripted_server("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar");
    let tools: Value = serde_json::from_str(WEATHER_TOOLS).unwrap();
    let v = chat(
        a,
        json!({"messages": user("x"), "tools": tools, "chat_template_kwargs": {"enable_thinking": false}, "max_tokens": 50}),
    );
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["message"].get("tool_calls").is_none());
    assert_eq!(
        c["message"]["content"],
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    );
}

#[test]
fn binary_serves_the_demo_model() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["serve", "--bind", "127.0.0.1:0", "--max-seq", "2048"])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut addr = None;
    let mut line = String::new();
    while addr.is_none() {
        line.clear();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(rest) = line.split("http://").nth(1) {
            addr = rest
                .split_whitespace()
                .next()
                .map(|a| a.parse::<SocketAddr>().unwrap());
        }
    }
    let addr = addr.expect("no listening line");
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    wait_ready(addr);
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "kestrel-demo", "messages": user("hi"), "max_tokens": 2}),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "kestrel-demo");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[test]
fn official_openai_python_client() {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIPPED official_openai_python_client: `python3 -c \"import openai\"` fails (pip install openai to run it)"
        );
        return;
    }
    let a = scripted_server(
        "Checking the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    );
    let out = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai_client.py"
        ))
        .arg(format!("http://{a}/v1"))
        .arg("test-model")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn scripted_thinking_budget_and_context_limit() {
    let text = "one two three four five six seven eight nine ten eleven twelve";
    let a = scripted_server(text);
    // after 2 reasoning tokens `</think>` is fed; the script then starts over as the answer
    let v = chat(
        a,
        json!({"messages": user("count"), "thinking_budget": 2, "max_tokens": 30}),
    );
    let m = &v["choices"][0]["message"];
    assert_eq!(
        m["reasoning_content"].as_str().unwrap().trim(),
        "one two",
        "{v}"
    );
    assert_eq!(m["content"], text);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // --max-seq bounds prompt + reply: the reply stops with `length` at the limit
    let a = scripted_server_with(&format!("{text} {text} {text} {text}"), 40);
    let (status, v) = post(
        a,
        "/v1/completions",
        &json!({"prompt": "a b", "max_tokens": 1000}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let u = &v["usage"];
    // The sequence state holds the limit (the prompt and every token fed back); the last
    // sampled token is never fed, so it needs no room.
    assert_eq!(u["total_tokens"].as_u64().unwrap(), 41, "{v}");
}

#[test]
fn a_full_queue_is_refused_with_429() {
    let mut cfg = config(32_768, None);
    cfg.max_queue = 1;
    cfg.max_running = Some(1);
    cfg.request_timeout = Duration::from_secs(3);
    let a = start(scripted(&"word ".repeat(20_000)), cfg, Duration::ZERO);
    wait_ready(a);
    let long = json!({"messages": user("long"), "max_tokens": 100000});
    let running = std::thread::spawn(move || post(a, "/v1/chat/completions", &long).0);
    std::thread::sleep(Duration::from_millis(300));
    let queued = std::thread::spawn(move || {
        post(
            a,
            "/v1/chat/completions",
            &json!({"messages": user("q"), "max_tokens": 1}),
        )
        .0
    });
    std::thread::sleep(Duration::from_millis(300));
    let (status, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": user("r"), "max_tokens": 1}),
    );
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], "queue_full");
    assert_eq!(running.join().unwrap(), 504);
    assert_eq!(queued.join().unwrap(), 200);
}

#[test]
fn long_prompts_are_snapshotted_at_chunk_boundaries() {
    // prefill in rounds of 100 tokens (interleaved with other sequences' decoding)
    let mut cfg = config(8192, None);
    cfg.prefill_chunk = 100;
    let a = start(scripted("ok"), cfg, Duration::ZERO);
    wait_ready(a);
    let ids: Vec<u32> = (0..3000).map(|i| 1000 + i).collect();
    let ask = |ids: &[u32]| {
        let (status, v) = post(
            a,
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 1}),
        );
        assert_eq!(status, 200, "{v}");
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(ask(&ids), 0);
    // shares 2500 tokens with the first: resumes from the snapshot at 2048
    let mut other = ids[..2500].to_vec();
    other.extend(5000..5100);
    assert_eq!(ask(&other), 2048);
    // the first prompt plus its reply extended: resumes from the end of the first request
    let mut longer = ids.clone();
    longer.extend([7, 8, 9]);
    assert!(ask(&longer) >= 3000);
}

#[test]
fn a_short_request_finishes_while_a_long_stream_runs() {
    // 30000 tokens take tens of seconds even scripted, so a request that had to wait for the
    // long one would take that long
    let a = scripted_server_with(&"word ".repeat(30_000), 32_768);
    let long = json!({"messages": user("a long story please"), "max_tokens": 30000,
                      "stream": true, "seed": 2});
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request("POST", "/v1/chat/completions", Some(&long.to_string()), &[]).as_bytes())
        .unwrap();
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    let mut next_data = |reader: &mut BufReader<TcpStream>| loop {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "stream ended");
        if let Some(d) = line.trim_end().split("data: ").nth(1) {
            return d.to_string();
        }
    };
    // the long reply is under way
    for _ in 0..3 {
        assert_ne!(next_data(&mut reader), "[DONE]");
    }
    // a short request is served meanwhile (interleaved), not after the long one
    let t0 = Instant::now();
    let v = chat(a, json!({"messages": user("short"), "max_tokens": 2}));
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    let d = next_data(&mut reader);
    assert_ne!(d, "[DONE]");
    let chunk: Value = serde_json::from_str(&d).unwrap();
    assert!(chunk["choices"][0]["finish_reason"].is_null(), "{chunk}");
}

#[test]
fn post_bodies_must_be_json_typed() {
    let a = demo();
    let body = json!({"messages": user("hi"), "max_tokens": 1}).to_string();
    let send = |content_type: Option<&str>| {
        let mut r =
            "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                .to_string();
        if let Some(t) = content_type {
            r.push_str(&format!("Content-Type: {t}\r\n"));
        }
        r.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s.write_all(r.as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let status: u16 = raw.split(' ').nth(1).unwrap().parse().unwrap();
        (status, raw)
    };
    // what a web page can send without a CORS preflight, and no type at all: refused
    for t in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let (status, raw) = send(t);
        assert_eq!(status, 415, "{t:?}: {raw}");
        assert!(raw.contains("unsupported_media_type"), "{raw}");
    }
    for t in ["application/json", "Application/JSON; charset=utf-8"] {
        let (status, raw) = send(Some(t));
        assert_eq!(status, 200, "{t}: {raw}");
    }
}

/// The demo model behind a probe that records the rows of every batched step the scheduler
/// runs.
struct BatchProbe {
    inner: CpuModel,
    widest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl BatchProbe {
    fn saw(&self, rows: usize) {
        self.widest
            .fetch_max(rows, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Engine for BatchProbe {
    type State = <CpuModel as Engine>::State;
    fn config(&self) -> &TextConfig {
        self.inner.config()
    }
    fn new_state(&self) -> Result<Self::State> {
        self.inner.new_state()
    }
    fn state_len(&self, s: &Self::State) -> usize {
        self.inner.state_len(s)
    }
    fn state_bytes(&self, s: &Self::State) -> usize {
        self.inner.state_bytes(s)
    }
    fn forward(&self, s: &mut Self::State, tokens: &[u32], l: Logits) -> Result<Vec<f32>> {
        self.inner.forward(s, tokens, l)
    }
    fn forward_batch(&self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<Vec<f32>> {
        self.saw(tokens.len());
        kestrel::model::forward_rows(&self.inner, states, tokens)
    }
    fn forward_batch_greedy(
        &self,
        states: &mut [&mut Self::State],
        tokens: &[u32],
        limit: usize,
    ) -> Result<Vec<u32>> {
        self.saw(tokens.len());
        kestrel::model::forward_rows_greedy(&self.inner, states, tokens, limit)
    }
}

/// Concurrent requests are decoded together, one batched step a round over all of them
/// (greedy and sampling ones alike; the sampled ones' picks on several threads), and each
/// reply is what it is alone.
#[test]
fn concurrent_requests_decode_in_batched_steps_with_their_own_replies() {
    let widest = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let w = widest.clone();
    let mut cfg = config(4096, None);
    cfg.max_running = Some(8);
    let a = start(
        move || BatchProbe {
            inner: demo_engine(),
            widest: w,
        },
        cfg,
        Duration::ZERO,
    );
    wait_ready(a);
    let body = |i: usize| {
        // two greedy (device-greedy path), four sampled with a seed
        let t = if i < 2 { 0.0 } else { 0.8 };
        json!({"messages": user(&format!("tell me about {i}")), "max_tokens": 24,
               "temperature": t, "seed": i})
    };
    let alone: Vec<Value> = (0..6).map(|i| chat(a, body(i))).collect();
    assert!(widest.load(std::sync::atomic::Ordering::SeqCst) <= 1);
    let together: Vec<Value> = (0..6)
        .map(|i| std::thread::spawn(move || chat(a, body(i))))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let widest = widest.load(std::sync::atomic::Ordering::SeqCst);
    assert!(widest >= 2, "never batched: widest step {widest}");
    for (i, (x, y)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            x["choices"][0]["message"], y["choices"][0]["message"],
            "request {i}: alone vs batched"
        );
        let n = &y["usage"]["completion_tokens"];
        assert_eq!(&x["usage"]["completion_tokens"], n, "request {i}");
    }
}

/// The demo model, but any prefill piece of a sequence already past 600 tokens fails.
struct FailsLongPrefill(CpuModel);

impl Engine for FailsLongPrefill {
    type State = <CpuModel as Engine>::State;
    fn config(&self) -> &TextConfig {
        self.0.config()
    }
    fn new_state(&self) -> Result<Self::State> {
        self.0.new_state()
    }
    fn state_len(&self, s: &Self::State) -> usize {
        self.0.state_len(s)
    }
    fn state_bytes(&self, s: &Self::State) -> usize {
        self.0.state_bytes(s)
    }
    fn forward(&self, s: &mut Self::State, tokens: &[u32], l: Logits) -> Result<Vec<f32>> {
        if tokens.len() > 1 && self.0.state_len(s) >= 600 {
            anyhow::bail!("poisoned prefill");
        }
        self.0.forward(s, tokens, l)
    }
}

/// A sequence whose prefill fails leaves with the error, and a sequence running beside it
/// goes on unharmed (its reply as alone); the server keeps serving.
#[test]
fn a_failed_prefill_fails_only_its_own_request() {
    let mut cfg = config(8192, None);
    cfg.prefill_chunk = 100;
    cfg.cache_mem = 0;
    let a = start(|| FailsLongPrefill(demo_engine()), cfg, Duration::ZERO);
    wait_ready(a);
    let short = json!({"messages": user("a short one"), "max_tokens": 300, "temperature": 0});
    let alone = chat(a, short.clone());
    // long enough to be decoding when the other prefill fails
    assert!(
        alone["usage"]["completion_tokens"].as_u64().unwrap() >= 100,
        "{alone}"
    );
    let long_prompt = "word ".repeat(2500);
    let long = std::thread::spawn(move || {
        post(
            a,
            "/v1/chat/completions",
            &json!({"messages": user(&long_prompt), "max_tokens": 4}),
        )
    });
    std::thread::sleep(Duration::from_millis(20));
    let beside = chat(a, short);
    let (status, err) = long.join().unwrap();
    assert!(status >= 500, "{status}: {err}");
    assert!(err.to_string().contains("poisoned prefill"), "{err}");
    assert_eq!(
        alone["choices"][0]["message"],
        beside["choices"][0]["message"]
    );
    // and the server still serves
    assert_eq!(
        chat(a, json!({"messages": user("after"), "max_tokens": 2}))["usage"]["completion_tokens"],
        2
    );
}

/// What [`PagedScripted`]'s states hold of its small "device memory".
struct Ledger {
    mem: kestrel::model::StateMemory,
    /// Bytes the budget may use (what the server sees free, less its headroom).
    limit: usize,
    used: std::sync::Mutex<usize>,
    blocks: std::sync::atomic::AtomicUsize,
    live: std::sync::atomic::AtomicUsize,
    peak_live: std::sync::atomic::AtomicUsize,
}

impl Ledger {
    /// Takes `bytes` and `blocks`, or fails as a GPU out of memory does.
    fn take(&self, bytes: usize, blocks: usize) -> Result<()> {
        let mut used = self.used.lock().unwrap();
        if *used + bytes > self.limit {
            return Err(kestrel::cuda::GpuError::OutOfMemory {
                bytes,
                driver: "test ledger".into(),
            }
            .into());
        }
        *used += bytes;
        self.blocks
            .fetch_add(blocks, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn give(&self, bytes: usize, blocks: usize) {
        *self.used.lock().unwrap() -= bytes;
        self.blocks
            .fetch_sub(blocks, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The scripted engine with states in a paged memory: a state holds `fixed` bytes and one
/// block per `block_tokens` positions; a step that needs a block the memory does not have
/// fails like an out-of-memory GPU.
struct PagedScripted {
    inner: Scripted,
    ledger: std::sync::Arc<Ledger>,
}

struct PagedState {
    s: ScriptState,
    blocks: usize,
    ledger: std::sync::Arc<Ledger>,
}

impl PagedState {
    fn new(s: ScriptState, blocks: usize, ledger: &std::sync::Arc<Ledger>) -> Result<Self> {
        ledger.take(
            ledger.mem.bytes_for(0) + blocks * ledger.mem.block_bytes,
            blocks,
        )?;
        let live = ledger
            .live
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        ledger
            .peak_live
            .fetch_max(live, std::sync::atomic::Ordering::SeqCst);
        Ok(PagedState {
            s,
            blocks,
            ledger: ledger.clone(),
        })
    }
}

impl Clone for PagedState {
    fn clone(&self) -> Self {
        PagedState::new(self.s.clone(), self.blocks, &self.ledger)
            .expect("a snapshot beyond the state memory")
    }
}

impl Drop for PagedState {
    fn drop(&mut self) {
        let l = &self.ledger;
        l.give(
            l.mem.bytes_for(0) + self.blocks * l.mem.block_bytes,
            self.blocks,
        );
        l.live.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Engine for PagedScripted {
    type State = PagedState;
    fn config(&self) -> &TextConfig {
        self.inner.config()
    }
    fn new_state(&self) -> Result<PagedState> {
        PagedState::new(self.inner.new_state()?, 0, &self.ledger)
    }
    fn state_len(&self, s: &PagedState) -> usize {
        s.s.len
    }
    fn state_bytes(&self, s: &PagedState) -> usize {
        self.ledger.mem.bytes_for(s.s.len)
    }
    fn forward(&self, s: &mut PagedState, tokens: &[u32], l: Logits) -> Result<Vec<f32>> {
        let m = &self.ledger.mem;
        let more = m.blocks_for(s.s.len + tokens.len()) - s.blocks;
        self.ledger.take(more * m.block_bytes, more)?;
        s.blocks += more;
        std::thread::sleep(Duration::from_millis(2));
        self.inner.forward(&mut s.s, tokens, l)
    }
    fn state_memory(&self) -> Option<kestrel::model::StateMemory> {
        Some(self.ledger.mem)
    }
    fn kv_blocks_in_use(&self) -> Option<usize> {
        Some(self.ledger.blocks.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// A state memory far too small for the load: 24 streaming requests (every third client
/// hangs up mid-stream) against room for 3 at a time. Admission waits for memory instead of
/// running out of it: every remaining request finishes with its `finish_reason`, the
/// scheduler never overcommits (the engine would fail the step), and at the end every block
/// is back and `/metrics` says so.
#[test]
fn a_state_memory_too_small_for_the_load_queues_and_frees_every_block() {
    const HEADROOM: usize = kestrel::server::worker::DEVICE_HEADROOM;
    let mem = kestrel::model::StateMemory {
        // fixed 100 + 4 blocks a request (~54 positions at its longest): 4,100 bytes each;
        // a whole 256-position sequence (16 blocks) must fit alone.
        free: HEADROOM + 3 * 4_100 + 4_000,
        fixed: 100,
        block_bytes: 1_000,
        block_tokens: 16,
    };
    let ledger = std::sync::Arc::new(Ledger {
        mem,
        limit: mem.free - HEADROOM,
        used: Default::default(),
        blocks: Default::default(),
        live: Default::default(),
        peak_live: Default::default(),
    });
    let l = ledger.clone();
    let words: String = (0..80).map(|i| format!(" w{i}")).collect();
    let make = scripted(&words);
    let mut cfg = config(256, None);
    cfg.cache_mem = 0;
    cfg.max_running = None; // from memory
    let a = start(
        move || PagedScripted {
            inner: make(),
            ledger: l,
        },
        cfg,
        Duration::ZERO,
    );
    wait_ready(a);
    ledger
        .peak_live
        .store(0, std::sync::atomic::Ordering::SeqCst); // after the warm-up
    let n = 24;
    let handles: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({"prompt": format!("client {i}"), "max_tokens": 50,
                                  "stream": true, "seed": i});
                let mut s = TcpStream::connect(a).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let req = request("POST", "/v1/completions", Some(&body.to_string()), &[]);
                s.write_all(req.as_bytes()).unwrap();
                let mut reader = BufReader::new(s);
                let (mut line, mut datas, mut finish) = (String::new(), 0, None);
                loop {
                    line.clear();
                    if reader.read_line(&mut line).unwrap() == 0 {
                        break;
                    }
                    if let Some(d) = line.trim().strip_prefix("data: ") {
                        datas += 1;
                        if i % 3 == 0 && datas == 3 {
                            return None; // hang up mid-stream
                        }
                        if let Ok(v) = serde_json::from_str::<Value>(d)
                            && let Some(f) = v["choices"][0]["finish_reason"].as_str()
                        {
                            finish = Some(f.to_string());
                        }
                    }
                }
                Some(finish)
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        if let Some(finish) = h.join().unwrap() {
            assert_eq!(finish.as_deref(), Some("length"), "request {i}");
        }
    }
    let peak = ledger.peak_live.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2..=3).contains(&peak),
        "{peak} states at once (room for 3)"
    );
    let t0 = Instant::now();
    let m = loop {
        let m = http(a, "GET", "/metrics", None, &[]).1;
        if metric(&m, "kestrel_running_sequences") == 0 && metric(&m, "kestrel_kv_blocks_used") == 0
        {
            break m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "blocks never freed:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(*ledger.used.lock().unwrap(), 0, "state memory not returned");
    assert_eq!(metric(&m, "kestrel_kv_blocks_reserved"), 0);
    assert_eq!(metric(&m, "kestrel_kv_blocks_free"), 16, "{m}");
    assert_eq!(metric(&m, "kestrel_queue_depth"), 0);
    assert_eq!(
        metric(&m, "kestrel_cancelled_total"),
        (0..n).filter(|i| i % 3 == 0).count() as u64
    );
    assert!(!m.contains("status=\"503\""), "{m}");
}

/// Short requests arriving behind a 12,000-token prompt are not held until it is prefilled:
/// each round gives the short prompts their whole pieces first (the long one keeps a quarter
/// of the round's budget and the rest), so both short replies are complete before the long
/// prompt's first token, which still comes.
#[test]
fn short_requests_are_not_held_behind_a_long_prompt() {
    let mut cfg = config(32_768, None);
    cfg.prefill_chunk = 1024; // a dozen rounds for the long prompt
    cfg.request_timeout = Duration::from_secs(900);
    let a = start(demo_engine, cfg, Duration::ZERO);
    wait_ready(a);
    let long = json!({"messages": user(&"word ".repeat(12_000)), "max_tokens": 1,
                      "stream": true, "seed": 1});
    let t0 = Instant::now();
    let reader = std::thread::spawn(move || {
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        s.write_all(
            request("POST", "/v1/chat/completions", Some(&long.to_string()), &[]).as_bytes(),
        )
        .unwrap();
        let mut reader = BufReader::new(s);
        let (mut line, mut datas, mut first_token, mut finish) = (String::new(), 0, None, None);
        while reader.read_line(&mut line).unwrap() > 0 {
            if let Some(d) = line.trim().strip_prefix("data: ") {
                datas += 1;
                // the first event is the role chunk, sent at once; the next needs the prefill
                if datas == 2 {
                    first_token = Some(Instant::now());
                }
                if let Ok(v) = serde_json::from_str::<Value>(d)
                    && let Some(f) = v["choices"][0]["finish_reason"].as_str()
                {
                    finish = Some(f.to_string());
                }
            }
            line.clear();
        }
        (first_token, finish)
    });
    // the long prompt is being prefilled
    let t = Instant::now();
    while metric(
        &http(a, "GET", "/metrics", None, &[]).1,
        "kestrel_running_sequences",
    ) == 0
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the long request never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let shorts: Vec<_> = (0..2)
        .map(|i| {
            std::thread::spawn(move || {
                let v = chat(
                    a,
                    json!({"messages": user(&format!("short {i}")), "max_tokens": 4}),
                );
                assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
                Instant::now()
            })
        })
        .collect();
    let done: Vec<Instant> = shorts.into_iter().map(|h| h.join().unwrap()).collect();
    let (first_token, finish) = reader.join().unwrap();
    let first_token = first_token.expect("the long reply never started");
    assert_eq!(finish.as_deref(), Some("length"));
    let secs = |t: Instant| (t - t0).as_secs_f64();
    println!(
        "short replies done at {:.1} s and {:.1} s, the long prompt's first token at {:.1} s",
        secs(done[0]),
        secs(done[1]),
        secs(first_token)
    );
    for d in done {
        assert!(
            d < first_token,
            "a short reply waited for the long prompt's prefill"
        );
    }
}

/// A streaming chat request on its own connection: the thread returns its SSE body.
fn stream_in_thread(a: SocketAddr, body: Value) -> std::thread::JoinHandle<(u16, String)> {
    std::thread::spawn(move || {
        http(
            a,
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
            &[],
        )
    })
}

/// Waits until the server has `n` requests running and `queued` waiting.
fn wait_load(a: SocketAddr, running: u64, queued: u64) {
    let t0 = Instant::now();
    loop {
        let (_, m) = http(a, "GET", "/metrics", None, &[]);
        if metric(&m, "kestrel_running_sequences") == running
            && metric(&m, "kestrel_queue_depth") == queued
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "load never reached:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs [`drain`] on its own runtime thread.
fn drain_in_thread(shared: Arc<Shared>, timeout: Duration) -> std::thread::JoinHandle<Drained> {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(drain(&shared, timeout))
    })
}

#[test]
fn drain_refuses_new_requests_and_finishes_the_taken_ones() {
    let mut cfg = config(32_768, None);
    cfg.max_running = Some(1);
    // about 40 ms a token: a 30-token reply runs for over a second
    let (a, shared) = start_shared(
        slow_scripted(&"word ".repeat(500), Duration::from_millis(40)),
        cfg,
        Duration::ZERO,
    );
    wait_ready(a);
    let running = stream_in_thread(
        a,
        json!({"messages": user("first"), "max_tokens": 30, "stream": true}),
    );
    wait_load(a, 1, 0);
    let queued = std::thread::spawn(move || {
        post(
            a,
            "/v1/chat/completions",
            &json!({"messages": user("second"), "max_tokens": 3}),
        )
    });
    wait_load(a, 1, 1);
    let drained = drain_in_thread(shared.clone(), Duration::from_secs(60));
    while !shared.draining.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Readiness fails at once (routers stop sending); liveness holds.
    for path in ["/health", "/ready"] {
        let (status, body) = http(a, "GET", path, None, &[]);
        assert_eq!(status, 503, "{path}: {body}");
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap()["status"],
            "draining"
        );
    }
    assert_eq!(http(a, "GET", "/live", None, &[]).0, 200);
    // New requests get 503 in OpenAI's error shape, streaming or not.
    for stream in [false, true] {
        let (status, v) = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": user("late"), "max_tokens": 2, "stream": stream}),
        );
        assert_eq!(status, 503, "{v}");
        assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
        assert_eq!(v["error"]["code"], "draining", "{v}");
    }
    let (status, v) = post(
        a,
        "/v1/completions",
        &json!({"prompt": "late", "max_tokens": 2}),
    );
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("draining")),
        "{v}"
    );
    let (_, m) = http(a, "GET", "/metrics", None, &[]);
    assert_eq!(metric(&m, "kestrel_draining"), 1, "{m}");
    // The running stream and the queued request both finish normally.
    let (status, body) = running.join().unwrap();
    assert_eq!(status, 200);
    let events = sse_events(&body);
    assert!(events.iter().all(|e| e.get("error").is_none()), "{body}");
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    let (status, v) = queued.join().unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(drained.join().unwrap(), Drained::Clean);
}

#[test]
fn drain_timeout_ends_an_open_stream_with_an_error_event() {
    let (a, shared) = start_shared(
        slow_scripted(&"word ".repeat(500), Duration::from_millis(40)),
        config(32_768, None),
        Duration::ZERO,
    );
    wait_ready(a);
    let running = stream_in_thread(
        a,
        json!({"messages": user("long"), "max_tokens": 400, "stream": true}),
    );
    wait_load(a, 1, 0);
    let t0 = Instant::now();
    let drained = drain_in_thread(shared, Duration::from_millis(300));
    let (status, body) = running.join().unwrap();
    assert_eq!(status, 200);
    let events = sse_events(&body);
    let last = events.last().unwrap();
    assert_eq!(last["error"]["type"], "service_unavailable", "{body}");
    assert!(
        events.len() > 2,
        "some tokens came before the error: {body}"
    );
    assert_eq!(drained.join().unwrap(), Drained::TimedOut { ended: 1 });
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn metrics_carry_the_load_under_vllm_names_too() {
    let a = demo();
    let (_, m) = http(a, "GET", "/metrics", None, &[]);
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting"] {
        let line = m
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .unwrap_or_else(|| panic!("no {name}:\n{m}"));
        assert!(line.contains("model_name=\"test-model\""), "{line}");
        assert!(m.contains(&format!("# TYPE {name} gauge")), "{m}");
    }
    assert_eq!(metric(&m, "kestrel_draining"), 0);
}

/// `kestrel serve` itself: SIGTERM drains (a stream already running finishes, a new request
/// gets 503), then the process exits 0.
#[test]
fn binary_drains_on_sigterm_and_exits_0() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["serve", "--bind", "127.0.0.1:0", "--max-seq", "2048"])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "no listening line");
        if let Some(rest) = line.split("http://").nth(1) {
            break rest
                .split_whitespace()
                .next()
                .unwrap()
                .parse::<SocketAddr>()
                .unwrap();
        }
    };
    let log = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });
    wait_ready(addr);
    let running = stream_in_thread(
        addr,
        json!({"model": "kestrel-demo", "messages": user("drain me"), "max_tokens": 60, "stream": true}),
    );
    wait_load(addr, 1, 0);
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let t0 = Instant::now();
    while http(addr, "GET", "/health", None, &[]).0 != 503 {
        assert!(t0.elapsed() < Duration::from_secs(10), "never draining");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "kestrel-demo", "messages": user("late"), "max_tokens": 2}),
    );
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("draining")),
        "{v}"
    );
    let (status, body) = running.join().unwrap();
    assert_eq!(status, 200);
    let events = sse_events(&body);
    assert!(events.iter().all(|e| e.get("error").is_none()), "{body}");
    assert!(
        events.last().unwrap()["choices"][0]["finish_reason"].is_string(),
        "{body}"
    );
    let code = child.wait().unwrap();
    let log = log.join().unwrap();
    assert_eq!(code.code(), Some(0), "{log}");
    assert!(
        log.contains("SIGTERM: draining") && log.contains("drained"),
        "{log}"
    );
}

/// `POST /v1/chat/completions/render` (vLLM's): the ids the same chat request runs, which a
/// cache-aware router routes on.
#[test]
fn chat_render_gives_the_prompt_ids_the_request_runs() {
    let a = demo();
    let body = json!({"messages": [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a falcon."}], "max_tokens": 2});
    let (status, r) = post(a, "/v1/chat/completions/render", &body);
    assert_eq!(status, 200, "{r}");
    let ids = r["token_ids"].as_array().unwrap();
    let v = chat(a, body.clone());
    assert_eq!(
        ids.len() as u64,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    let (status, r2) = post(a, "/v1/chat/completions/render", &body);
    assert_eq!((status, &r2["token_ids"]), (200, &r["token_ids"]));
    let (status, e) = post(a, "/v1/chat/completions/render", &json!({"messages": 3}));
    assert_eq!(status, 400, "{e}");
}
