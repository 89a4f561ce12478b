//! Structured outputs (`response_format` `json_object` / `json_schema`): the grammar engine
//! over the real 248k vocabulary (random walks through its masks always end in valid JSON;
//! the mask's cost per token), and the server end to end on 127.0.0.1 with the demo model
//! (random weights: the grammar, not the model, makes the output valid) and a scripted
//! engine (a model that writes prose, a thinking block that stays free text).

use anyhow::Result;
use kestrel::config::{GenerationConfig, TextConfig};
use kestrel::generate::{DecodeLoop, GenerateOptions, GenerationStats, StopReason};
use kestrel::grammar::{Constraint, GrammarEngine, MaskCost, allowed};
use kestrel::model::{CpuModel, Engine, Logits};
use kestrel::sampling::{Draw, Drawn, Sampler, SamplingParams};
use kestrel::server::{ServerConfig, Shared, run_model, serve};
use kestrel::tensor::DType;
use kestrel::tokenizer::{Tokenizer, special};
mod common;
use common::http;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const GENERATION_CONFIG: &str = include_str!("../assets/qwen3_6/generation_config.json");

/// A schema every answer of the tests must meet: bounded, so that even a random walk ends.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}
        },
        "required": ["name", "age", "role", "active", "tags"],
        "additionalProperties": false
    })
}

/// Whether `v` is valid against `schema`, for the keywords these tests use (type, enum,
/// properties, required, additionalProperties: false, items, maxItems, maxLength, minimum,
/// maximum): the reason where it is not.
fn validate(v: &Value, schema: &Value) -> Result<(), String> {
    if let Some(e) = schema.get("enum").and_then(Value::as_array)
        && !e.contains(v)
    {
        return Err(format!("{v} is not one of {e:?}"));
    }
    let ty = schema.get("type").and_then(Value::as_str);
    let ok = match ty {
        None => true,
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some("null") => v.is_null(),
        Some(t) => return Err(format!("type {t} not known to this check")),
    };
    if !ok {
        return Err(format!("{v} is not of type {}", ty.unwrap_or("?")));
    }
    if let Some(s) = v.as_str()
        && let Some(n) = schema.get("maxLength").and_then(Value::as_u64)
        && s.chars().count() as u64 > n
    {
        return Err(format!("{v} is longer than {n}"));
    }
    if let Some(x) = v.as_f64() {
        if let Some(lo) = schema.get("minimum").and_then(Value::as_f64)
            && x < lo
        {
            return Err(format!("{v} < {lo}"));
        }
        if let Some(hi) = schema.get("maximum").and_then(Value::as_f64)
            && x > hi
        {
            return Err(format!("{v} > {hi}"));
        }
    }
    if let Some(a) = v.as_array() {
        if let Some(n) = schema.get("maxItems").and_then(Value::as_u64)
            && a.len() as u64 > n
        {
            return Err(format!("{v} has more than {n} items"));
        }
        if let Some(items) = schema.get("items") {
            for x in a {
                validate(x, items)?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for r in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r.as_str().unwrap();
            if !o.contains_key(r) {
                return Err(format!("{v} lacks {r}"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(s) => validate(x, s)?,
                None if schema.get("additionalProperties") == Some(&json!(false)) => {
                    return Err(format!("{v} has the extra property {k}"));
                }
                None => {}
            }
        }
    }
    Ok(())
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::bundled().unwrap())
}

fn engine() -> &'static GrammarEngine {
    static E: OnceLock<GrammarEngine> = OnceLock::new();
    E.get_or_init(|| {
        let t = Instant::now();
        let tok = tokenizer();
        let e = GrammarEngine::new(tok, tok.vocab_size(), special::IM_END).unwrap();
        eprintln!(
            "grammar engine over {} ids built in {:.0} ms",
            tok.vocab_size(),
            t.elapsed().as_secs_f64() * 1e3
        );
        e
    })
}

/// xorshift64*: the walks' choices.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// A walk through `c`'s masks choosing uniformly among the allowed ids (at most `steps`):
/// the ids (the end token last, if reached) and each mask's compute time.
fn walk(c: &Constraint, seed: u64, steps: usize) -> (Vec<u32>, Vec<Duration>) {
    let mut g = engine().guide(c).unwrap();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut ids, mut times) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let mask = g.next_mask().get().to_vec();
        times.push(g.next_mask().compute_time());
        let allowed_ids: Vec<u32> = (0..engine().vocab() as u32)
            .filter(|&i| allowed(&mask, i))
            .collect();
        assert!(!allowed_ids.is_empty(), "an empty mask after {ids:?}");
        let id = allowed_ids[(rng.next() % allowed_ids.len() as u64) as usize];
        ids.push(id);
        if id == special::IM_END {
            break;
        }
        g.commit(id);
    }
    (ids, times)
}

fn text_of(ids: &[u32]) -> String {
    tokenizer().decode(ids, true).unwrap()
}

#[test]
fn random_walks_through_the_masks_end_in_valid_json() {
    let schema = person_schema();
    let c = Constraint::JsonSchema(schema.clone());
    let mut times = Vec::new();
    let mut slow = Vec::new();
    for seed in 0..50 {
        let (ids, t) = walk(&c, seed, 400);
        for (i, d) in t.iter().enumerate() {
            slow.push((*d, text_of(&ids[..i])));
        }
        times.extend(t);
        assert_eq!(ids.last(), Some(&special::IM_END), "seed {seed}: no end");
        let text = text_of(&ids);
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        validate(&v, &schema).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
    }
    slow.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (d, prefix) in slow.iter().take(8) {
        eprintln!("slow mask {:.3} ms after {prefix:?}", d.as_secs_f64() * 1e3);
    }
    times.sort();
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    let pct = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
    eprintln!(
        "mask compute time ({} ids, {} tokens): mean {:.3} ms, p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        engine().vocab(),
        times.len(),
        mean.as_secs_f64() * 1e3,
        pct(0.5).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        times.last().unwrap().as_secs_f64() * 1e3
    );
}

/// The decode step of [`Timed`]: longer than a mask's compute, as the H200's is (its step
/// ~2.2 ms at batch 1, a schema's mask ~0.67 ms).
const STEP: Duration = Duration::from_millis(3);

/// A model whose decode step takes [`STEP`] of wall time, with flat logits (the mask alone
/// chooses). `device`: the step runs on its own, as the GPU's queued kernels do, and the
/// draw takes the masks while it runs (as `draw_rows` does after the step's launch);
/// otherwise the step blocks and the draw is on the host after it (the CPU's).
struct Timed {
    config: TextConfig,
    device: bool,
}

impl Engine for Timed {
    type State = usize;
    fn config(&self) -> &TextConfig {
        &self.config
    }
    fn new_state(&self) -> Result<usize> {
        Ok(0)
    }
    fn state_len(&self, s: &usize) -> usize {
        *s
    }
    fn state_bytes(&self, _: &usize) -> usize {
        64
    }
    fn forward(&self, s: &mut usize, tokens: &[u32], _: Logits) -> Result<Vec<f32>> {
        *s += tokens.len();
        std::thread::sleep(STEP);
        Ok(vec![0.0; self.config.vocab_size])
    }
    fn forward_batch_draw(
        &self,
        states: &mut [&mut usize],
        tokens: &[u32],
        draws: &[Draw],
    ) -> Result<Vec<Drawn>> {
        if !self.device {
            return kestrel::model::forward_rows_draw(self, states, tokens, draws);
        }
        // the step's kernels are queued: it ends at `end` whatever the host does meanwhile
        let end = Instant::now() + STEP;
        for s in states.iter_mut() {
            **s += 1;
        }
        for m in draws.iter().filter_map(|d| d.mask) {
            m.get_after(|| Instant::now() < end);
        }
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        let flat = vec![0.0; self.config.vocab_size];
        Ok(draws.iter().map(|d| d.on_host(&flat)).collect())
    }
}

/// What the masks of a schema answer from [`Timed`] cost, through the decode loop as the
/// server's worker runs it (ids drawn by the engine under each next mask).
fn timed_mask_cost(device: bool) -> MaskCost {
    let e = Timed {
        config: kestrel::synthetic::demo_config(),
        device,
    };
    let opts = GenerateOptions {
        max_tokens: 48,
        stop_ids: vec![special::IM_END],
        prefill_chunk: 64,
        max_seq: 4096,
        thinking: None,
        device_greedy: true,
        speculative: None,
    };
    let mut sampler = Sampler::new(SamplingParams::default(), 7);
    // the guide starts when the request arrives, its first mask computed during the prefill
    let guide = engine()
        .guide(&Constraint::JsonSchema(person_schema()))
        .unwrap();
    let mut state = 0;
    let logits = e.forward(&mut state, &[1, 2, 3], Logits::Last).unwrap();
    let stats = GenerationStats {
        prompt_tokens: 3,
        cached_tokens: 0,
        generated: Vec::new(),
        forced_tokens: 0,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
        stop: StopReason::Cancelled,
        prefill_complete: true,
        spec: Default::default(),
    };
    let mut dl = DecodeLoop::new(stats, false, logits, Instant::now());
    dl.constrain(guide);
    loop {
        let id = dl.pick(&opts, &mut sampler);
        if dl.check(&opts, state).is_some() {
            break;
        }
        dl.feed(&e, &mut state, id, &opts, &mut sampler).unwrap();
    }
    dl.mask_cost
}

/// Issue 41: the mask of the next id is computed while the step that gives its logits
/// runs, so where the step is the longer the draw hardly waits (the H200 showed a wait per
/// token of 0.78 ms against a compute of 0.67 ms: the wait was counted while the GPU ran).
#[test]
fn the_mask_is_hidden_behind_a_longer_step() {
    engine();
    for device in [false, true] {
        let c = timed_mask_cost(device);
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / c.masks.max(1) as f64;
        let (compute, waited) = (ms(c.compute), ms(c.waited));
        eprintln!(
            "device {device}: {} masks, compute mean {compute:.3} ms, waited mean {waited:.3} ms, max {:.3} ms",
            c.masks,
            c.max_waited.as_secs_f64() * 1e3
        );
        assert!(c.masks >= 8, "{} masks", c.masks);
        assert!(
            compute < 0.5 * STEP.as_secs_f64() * 1e3,
            "the masks took {compute:.3} ms each: not shorter than the step"
        );
        assert!(
            waited < 0.25 * compute + 0.05,
            "device {device}: the draw waited {waited:.3} ms a mask of {compute:.3} ms"
        );
    }
}

/// An id the engine chose under the constraint reaches the guide when the engine hands it
/// over (`set_drawn`), so the next mask computes while the caller reports the token; the
/// pick that follows records it once, not twice.
#[test]
fn an_engines_id_reaches_the_guide_before_its_pick() {
    let c = Constraint::JsonSchema(person_schema());
    let opts = GenerateOptions {
        max_tokens: 16,
        stop_ids: vec![special::IM_END],
        prefill_chunk: 64,
        max_seq: 4096,
        thinking: None,
        device_greedy: true,
        speculative: None,
    };
    let stats = GenerationStats {
        prompt_tokens: 3,
        cached_tokens: 0,
        generated: Vec::new(),
        forced_tokens: 0,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
        stop: StopReason::Cancelled,
        prefill_complete: true,
        spec: Default::default(),
    };
    let mut sampler = Sampler::new(SamplingParams::default(), 7);
    let flat = vec![0.0; engine().vocab()];
    let mut dl = DecodeLoop::new(stats, false, flat, Instant::now());
    dl.constrain(engine().guide(&c).unwrap());
    let first = dl.pick(&opts, &mut sampler);
    // the engine's choice for the next id: the first one the mask allows that is not the end
    let mask = dl.next_mask().unwrap().get().to_vec();
    let second = (0..engine().vocab() as u32)
        .find(|&i| allowed(&mask, i) && i != special::IM_END)
        .unwrap();
    let mut reference = engine().guide(&c).unwrap();
    reference.commit(first);
    reference.commit(second);
    let after = reference.next_mask().get().to_vec();
    assert_ne!(
        after, mask,
        "the test needs a mask that changes with the id"
    );
    dl.set_drawn(second, None);
    assert!(
        dl.next_mask().unwrap().get() == after,
        "after set_drawn the next mask is still the one {second} was drawn under"
    );
    assert_eq!(dl.pick(&opts, &mut sampler), second);
    assert!(
        dl.next_mask().unwrap().get() == after,
        "the pick recorded {second} with the guide a second time"
    );
    assert_eq!(
        dl.mask_cost.masks, 2,
        "each mask an id was picked under, counted once"
    );
}

#[test]
fn json_object_walks_stay_a_json_object_prefix() {
    // Any object is unbounded: a walk may not end, but what it wrote is always the start of
    // an object, and where it ended it parses as one.
    let mut ended = 0;
    for seed in 0..20 {
        let (ids, _) = walk(&Constraint::JsonObject, seed, 60);
        let text = text_of(&ids);
        let text = text.trim_start_matches('\n');
        assert!(text.starts_with('{'), "seed {seed}: {text:?}");
        if ids.last() == Some(&special::IM_END) {
            ended += 1;
            let v: Value = serde_json::from_str(text).unwrap();
            assert!(v.is_object(), "{text}");
        }
    }
    eprintln!("{ended} of 20 json_object walks ended within 60 ids");
}

#[test]
fn markers_are_never_allowed() {
    let g = engine().guide(&Constraint::JsonObject).unwrap();
    let m = g.next_mask().get();
    for id in [
        special::THINK,
        special::THINK_END,
        special::TOOL_CALL,
        special::IM_START,
        special::IM_END,
        special::FIRST_PADDING_ID,
    ] {
        assert!(!allowed(m, id), "id {id} allowed at the start of an object");
    }
    assert!(allowed(m, tokenizer().token_to_id("{").unwrap()));
}

#[test]
fn bad_schemas_are_refused_with_the_reason() {
    let e = engine();
    let bad = [
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}),
        json!({"type": "strnig"}),
        json!({"type": "integer", "minimum": 5, "maximum": 1}),
    ];
    for s in bad {
        let err = e.check(&Constraint::JsonSchema(s.clone())).unwrap_err();
        assert!(!err.is_empty(), "{s}");
        eprintln!("{s} -> {err}");
    }
    e.check(&Constraint::JsonSchema(person_schema())).unwrap();
}

// ---- the server -------------------------------------------------------------------------

fn config() -> ServerConfig {
    ServerConfig {
        model_id: "test-model".into(),
        max_seq: 4096,
        api_key: None,
        cache_mem: 1 << 30,
        request_timeout: Duration::from_secs(120),
        default_max_tokens: 8,
        prefill_chunk: 4096,
        max_queue: 64,
        max_running: Some(4),
        max_body: ServerConfig::MAX_BODY,
        header_timeout: ServerConfig::HEADER_TIMEOUT,
        body_timeout: ServerConfig::BODY_TIMEOUT,
        max_connections: ServerConfig::MAX_CONNECTIONS,
        allow_origins: Vec::new(),
        access_log: false,
        speculative: None,
    }
}

fn start<E: Engine + 'static>(make: impl FnOnce() -> E + Send + 'static) -> SocketAddr {
    let generation = GenerationConfig::from_json_str(GENERATION_CONFIG).unwrap();
    let (shared, rx) = Shared::new(config(), Tokenizer::bundled().unwrap(), &generation).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let model_shared = shared.clone();
    std::thread::spawn(move || {
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
            serve(l, shared, std::future::pending()).await.unwrap();
        });
    });
    let t0 = Instant::now();
    while http(addr, "GET", "/health", None, &[]).0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(30), "server never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    addr
}

fn demo() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        start(|| {
            let cfg = kestrel::synthetic::demo_config();
            let w = kestrel::synthetic::random_weights(
                &cfg,
                kestrel::synthetic::DEMO_SEED,
                DType::BF16,
            );
            CpuModel::new(cfg, w)
        })
    })
}

fn post(addr: SocketAddr, body: &Value) -> (u16, Value) {
    let (status, text) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &[],
    );
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

fn chat(addr: SocketAddr, body: Value) -> Value {
    let (status, v) = post(addr, &body);
    assert_eq!(status, 200, "{v}");
    v
}

fn schema_format(schema: Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}})
}

fn no_thinking() -> Value {
    json!({"enable_thinking": false})
}

#[test]
fn demo_model_json_schema_answers_always_validate() {
    let a = demo();
    let schema = person_schema();
    // greedy, then 50 sampled seeds: random weights, and every answer meets the schema
    let mut bodies = vec![json!({"temperature": 0})];
    bodies.extend((0..50).map(|seed| json!({"temperature": 1.0, "seed": seed})));
    for extra in bodies {
        let mut body = json!({
            "messages": [{"role": "user", "content": "Describe a person."}],
            "max_tokens": 200,
            "response_format": schema_format(schema.clone()),
            "chat_template_kwargs": no_thinking(),
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let v = chat(a, body);
        let choice = &v["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap();
        assert_eq!(choice["finish_reason"], "stop", "{extra}: {v}");
        let parsed: Value =
            serde_json::from_str(content).unwrap_or_else(|e| panic!("{extra}: {e}: {content:?}"));
        validate(&parsed, &schema).unwrap_or_else(|e| panic!("{extra}: {e}"));
    }
}

#[test]
fn demo_model_thinks_freely_then_answers_valid_json() {
    // thinking on, closed by the budget: the reasoning is the model's free text, the answer
    // after `</think>` the schema's
    let v = chat(
        demo(),
        json!({
            "messages": [{"role": "user", "content": "Describe a person."}],
            "max_tokens": 200,
            "thinking_budget": 6,
            "seed": 3,
            "temperature": 0.7,
            "response_format": schema_format(person_schema()),
        }),
    );
    let m = &v["choices"][0]["message"];
    assert!(
        !m["reasoning_content"].as_str().unwrap().trim().is_empty(),
        "{v}"
    );
    let content = m["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    validate(&serde_json::from_str(content).unwrap(), &person_schema())
        .unwrap_or_else(|e| panic!("{e}: {content}"));
}

#[test]
fn demo_model_json_object_is_an_object_and_length_stops_mid_json() {
    let a = demo();
    let v = chat(
        a,
        json!({
            "messages": [{"role": "user", "content": "Any JSON."}],
            "max_tokens": 400,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "chat_template_kwargs": no_thinking(),
        }),
    );
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with('{'), "{v}");
    match v["choices"][0]["finish_reason"].as_str().unwrap() {
        "stop" => assert!(serde_json::from_str::<Value>(content).unwrap().is_object()),
        "length" => eprintln!("json_object: greedy ran past 400 tokens: {content:.80}"),
        r => panic!("finish_reason {r}"),
    }
    // a limit far too small for the schema: cut mid-JSON, finish_reason "length"
    let v = chat(
        a,
        json!({
            "messages": [{"role": "user", "content": "Describe a person."}],
            "max_tokens": 3,
            "temperature": 0,
            "response_format": schema_format(person_schema()),
            "chat_template_kwargs": no_thinking(),
        }),
    );
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(content.starts_with('{') && serde_json::from_str::<Value>(content).is_err());
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn demo_model_streamed_answer_validates() {
    let a = demo();
    let body = json!({
        "messages": [{"role": "user", "content": "Describe a person."}],
        "max_tokens": 200,
        "seed": 7,
        "temperature": 0.8,
        "stream": true,
        "response_format": schema_format(person_schema()),
        "chat_template_kwargs": no_thinking(),
    });
    let (status, raw) = http(
        a,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(status, 200, "{raw}");
    let mut content = String::new();
    let mut finish = Value::Null;
    for e in raw.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let d = e.strip_prefix("data: ").unwrap();
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "stop");
    validate(&serde_json::from_str(&content).unwrap(), &person_schema()).unwrap();
}

#[test]
fn bad_response_formats_are_400_in_openai_shape() {
    let a = demo();
    let cases = [
        (json!({"type": "xml"}), "response_format.type"),
        (json!("json"), "response_format"),
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}),
            "response_format.json_schema.schema",
        ),
        (
            schema_format(json!({"type": "strnig"})),
            "response_format.json_schema.schema",
        ),
        (
            schema_format(
                json!({"properties": {"a": {"$ref": "#/$defs/nope"}}, "required": ["a"]}),
            ),
            "response_format.json_schema.schema",
        ),
    ];
    for (rf, param) in cases {
        let (status, v) = post(
            a,
            &json!({"messages": [{"role": "user", "content": "hi"}], "response_format": rf}),
        );
        assert_eq!(status, 400, "{rf}: {v}");
        let e = &v["error"];
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        assert_eq!(e["param"], param, "{rf}: {v}");
        assert!(e["message"].as_str().unwrap().contains(param), "{v}");
    }
    // text is no constraint; completions still refuse response_format
    let v = chat(
        a,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
               "response_format": {"type": "text"}}),
    );
    assert_eq!(v["object"], "chat.completion");
    let (status, _) = http(
        a,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "hi", "response_format": {"type": "json_object"}}).to_string()),
        &[],
    );
    assert_eq!(status, 400);
}

/// An engine that writes a fixed script (then `<|im_end|>`), whatever the prompt: the
/// position advances when the fed token is the one it predicted.
struct Scripted {
    config: TextConfig,
    script: Vec<u32>,
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
    fn new_state(&self) -> Result<ScriptState> {
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
        s.len += tokens.len();
        s.pos = if s.last.is_some_and(|p| tokens == [p]) {
            s.pos + 1
        } else {
            s.pos
        };
        let next = self.script.get(s.pos).copied().unwrap_or(special::IM_END);
        s.last = Some(next);
        let mut logits = vec![0.0; self.config.vocab_size];
        logits[next as usize] = 100.0;
        Ok(logits)
    }
}

fn scripted(text: &str) -> SocketAddr {
    let script = Tokenizer::bundled().unwrap().encode(text, true).unwrap();
    start(move || Scripted {
        config: kestrel::synthetic::demo_config(),
        script,
    })
}

#[test]
fn a_conforming_answer_passes_unchanged_and_reasoning_stays_free() {
    let answer = r#"{"name": "Ada", "age": 36, "role": "admin", "active": true, "tags": ["math"]}"#;
    let a = scripted(&format!("Let me think {{ not json\n</think>\n\n{answer}"));
    let v = chat(
        a,
        json!({"messages": [{"role": "user", "content": "who?"}], "max_tokens": 80,
               "response_format": schema_format(person_schema())}),
    );
    let m = &v["choices"][0]["message"];
    assert_eq!(
        m["reasoning_content"].as_str().unwrap().trim(),
        "Let me think { not json"
    );
    assert_eq!(m["content"], answer, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn a_model_writing_prose_still_answers_valid_json() {
    let a = scripted("Sure! Here is a person: Ada, 36, an admin.");
    let v = chat(
        a,
        json!({"messages": [{"role": "user", "content": "who?"}], "max_tokens": 200,
               "response_format": schema_format(person_schema()),
               "chat_template_kwargs": no_thinking()}),
    );
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    validate(&serde_json::from_str(content).unwrap(), &person_schema())
        .unwrap_or_else(|e| panic!("{e}: {content}"));
}

// ---- strict tool calls ------------------------------------------------------------------

fn weather_tools(strict: bool) -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {
            "name": "get_weather", "strict": strict,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "hourly": {"type": "boolean"}
                },
                "required": ["city", "days", "hourly"],
                "additionalProperties": false
            }
        }}),
        json!({"type": "function", "function": {
            "name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}
        }}),
    ]
}

fn weather_args_valid(args: &serde_json::Map<String, Value>) -> Result<(), String> {
    let schema = &weather_tools(true)[0]["function"]["parameters"];
    validate(&Value::Object(args.clone()), schema)
}

#[test]
fn random_walks_through_a_strict_call_give_valid_arguments() {
    let tok = tokenizer();
    let tools = weather_tools(true);
    let calls = kestrel::grammar::ToolCalls::of(&tools).unwrap();
    let mut gate = engine()
        .tool_calls(&calls, special::TOOL_CALL, special::TOOL_CALL_END)
        .unwrap();
    assert!(gate.next_mask().is_none(), "dormant in free text");
    let intro = tok.encode("Let me check.\n", false).unwrap();
    for &id in &intro {
        gate.observe(id);
        assert!(gate.next_mask().is_none());
    }
    for seed in 0..20u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut ids = vec![special::TOOL_CALL];
        gate.observe(special::TOOL_CALL);
        for _ in 0..200 {
            let mask = gate.next_mask().expect("inside a call").get().to_vec();
            let allowed_ids: Vec<u32> = (0..engine().vocab() as u32)
                .filter(|&i| allowed(&mask, i))
                .collect();
            // get_weather only: a free `note` call could run on for ever
            let id = loop {
                let id = allowed_ids[(rng.next() % allowed_ids.len() as u64) as usize];
                let text = text_of(&[&ids[1..], &[id]].concat());
                if !text.starts_with("\n<function=n") {
                    break id;
                }
            };
            ids.push(id);
            gate.observe(id);
            if id == special::TOOL_CALL_END {
                break;
            }
        }
        assert_eq!(ids.last(), Some(&special::TOOL_CALL_END), "seed {seed}");
        assert!(gate.next_mask().is_none(), "dormant after the call");
        let text = tok.decode(&ids, false).unwrap();
        let (rest, calls) = kestrel::tools::extract(&text, &tools);
        assert_eq!(calls.len(), 1, "seed {seed}: {text:?} left {rest:?}");
        assert_eq!(calls[0].name, "get_weather");
        weather_args_valid(&calls[0].arguments).unwrap_or_else(|e| panic!("{e}: {text}"));
    }
}

#[test]
fn a_strict_tool_call_gets_valid_arguments_from_a_model_that_errs() {
    // the script calls get_weather with an unknown city and days as text
    let a = scripted(
        "Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
    );
    let body = |strict: bool| {
        json!({"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 120,
               "tools": weather_tools(strict)})
    };
    let v = chat(a, body(true));
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    weather_args_valid(args.as_object().unwrap()).unwrap_or_else(|e| panic!("{e}: {v}"));
    // not strict: the model's own arguments, as written
    let v = chat(a, body(false));
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "London", "days": "three"}), "{v}");
}

#[test]
fn a_conforming_strict_call_and_free_text_pass_unchanged() {
    let text = "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>";
    let a = scripted(text);
    let v = chat(
        a,
        json!({"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 120,
               "tools": weather_tools(true), "chat_template_kwargs": no_thinking()}),
    );
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"].as_str().unwrap().trim(), "Sure.", "{v}");
    let args: Value = serde_json::from_str(
        m["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(args, json!({"city": "Oslo", "days": 2, "hourly": true}));
}

#[test]
fn demo_model_forced_strict_calls_validate() {
    let a = demo();
    for (seed, choice) in [
        (1, json!("required")),
        (
            2,
            json!({"type": "function", "function": {"name": "get_weather"}}),
        ),
        (
            3,
            json!({"type": "function", "function": {"name": "get_weather"}}),
        ),
    ] {
        let v = chat(
            a,
            json!({"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 150,
                   "seed": seed, "temperature": 0.8, "tools": weather_tools(true),
                   "tool_choice": choice}),
        );
        // random weights write on after the call (finish_reason may be "length"); the call
        // itself, forced to start by tool_choice, is complete and its arguments valid
        let c = &v["choices"][0];
        let calls = c["message"]["tool_calls"].as_array();
        let Some(call) = calls.and_then(|c| c.first()).map(|c| &c["function"]) else {
            // "required" may pick the free `note` tool, whose text is unbounded
            assert_eq!(choice, json!("required"), "{v}");
            continue;
        };
        if choice != json!("required") {
            assert_eq!(call["name"], "get_weather", "{v}");
        }
        if call["name"] == "get_weather" {
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
            weather_args_valid(args.as_object().unwrap()).unwrap_or_else(|e| panic!("{e}: {v}"));
        }
    }
}

#[test]
fn bad_strict_tool_schemas_are_400() {
    let tools = json!([{"type": "function", "function": {"name": "f", "strict": true,
        "parameters": {"type": "object", "properties": {"n": {"type": "intgr"}}, "required": ["n"]}}}]);
    let (status, v) = post(
        demo(),
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("intgr"),
        "{v}"
    );
}
