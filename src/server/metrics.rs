//! Counters and gauges for `GET /metrics` (Prometheus text format).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, secs: f64) {
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

#[derive(Default)]
pub struct Metrics {
    /// (endpoint, status) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// MTP speculation of finished requests: verification steps, drafts proposed, accepted.
    pub spec_steps: AtomicU64,
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub queue_depth: AtomicU64,
    pub running: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_entries: AtomicU64,
    /// Set where states live in device memory and their KV is paged (the `kv` gauges mean
    /// something).
    pub kv_paged: AtomicBool,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_reserved: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    pub cancelled: AtomicU64,
    pub timeouts: AtomicU64,
    /// Set while the server drains (`kestrel_draining`).
    pub draining: AtomicBool,
    /// From the request's arrival at the server to its first generated token.
    pub ttft: Histogram,
    /// From the model's admitting the request (the end of its queueing) to its first token.
    pub ttft_admitted: Histogram,
    /// From arrival at the server to admission.
    pub queue_time: Histogram,
    /// From arrival at the server to the end of the reply, whatever ended it.
    pub e2e: Histogram,
    pub itl: Histogram,
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// The Prometheus text; `model_id` labels the vLLM-named load gauges.
    pub fn render(&self, model_id: &str) -> String {
        let mut out = String::new();
        out.push_str("# HELP kestrel_requests_total HTTP requests by endpoint and status.\n# TYPE kestrel_requests_total counter\n");
        for ((ep, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "kestrel_requests_total{{endpoint=\"{ep}\",status=\"{status}\"}} {n}"
            );
        }
        let scalar = |out: &mut String, name: &str, kind: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        scalar(
            &mut out,
            "kestrel_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            &self.prompt_tokens,
        );
        scalar(
            &mut out,
            "kestrel_generated_tokens_total",
            "counter",
            "Generated tokens.",
            &self.generated_tokens,
        );
        scalar(
            &mut out,
            "kestrel_cached_tokens_total",
            "counter",
            "Prompt tokens reused from the prefix cache.",
            &self.cached_tokens,
        );
        scalar(
            &mut out,
            "kestrel_spec_verify_steps_total",
            "counter",
            "MTP speculative verification steps (finished requests).",
            &self.spec_steps,
        );
        scalar(
            &mut out,
            "kestrel_spec_draft_tokens_total",
            "counter",
            "Tokens the MTP head drafted (finished requests).",
            &self.spec_drafted,
        );
        scalar(
            &mut out,
            "kestrel_spec_accepted_tokens_total",
            "counter",
            "Drafted tokens the main model accepted (finished requests).",
            &self.spec_accepted,
        );
        {
            let (steps, drafted, accepted) = (
                self.spec_steps.load(Ordering::Relaxed) as f64,
                self.spec_drafted.load(Ordering::Relaxed) as f64,
                self.spec_accepted.load(Ordering::Relaxed) as f64,
            );
            let _ = writeln!(
                out,
                "# HELP kestrel_spec_acceptance_rate Accepted over drafted MTP tokens (0 before any draft).\n# TYPE kestrel_spec_acceptance_rate gauge\nkestrel_spec_acceptance_rate {}",
                if drafted > 0.0 {
                    accepted / drafted
                } else {
                    0.0
                }
            );
            let _ = writeln!(
                out,
                "# HELP kestrel_spec_tokens_per_step Tokens a verification step emitted (accepted drafts + 1; 0 before any step).\n# TYPE kestrel_spec_tokens_per_step gauge\nkestrel_spec_tokens_per_step {}",
                if steps > 0.0 {
                    (accepted + steps) / steps
                } else {
                    0.0
                }
            );
        }
        scalar(
            &mut out,
            "kestrel_queue_depth",
            "gauge",
            "Requests waiting for the model.",
            &self.queue_depth,
        );
        scalar(
            &mut out,
            "kestrel_running_sequences",
            "gauge",
            "Sequences being generated.",
            &self.running,
        );
        scalar(
            &mut out,
            "kestrel_prefix_cache_hits_total",
            "counter",
            "Requests that resumed from a cached prefix.",
            &self.cache_hits,
        );
        scalar(
            &mut out,
            "kestrel_prefix_cache_misses_total",
            "counter",
            "Requests that found no cached prefix.",
            &self.cache_misses,
        );
        scalar(
            &mut out,
            "kestrel_prefix_cache_bytes",
            "gauge",
            "Bytes of cached sequence states.",
            &self.cache_bytes,
        );
        scalar(
            &mut out,
            "kestrel_prefix_cache_entries",
            "gauge",
            "Cached sequence states.",
            &self.cache_entries,
        );
        if self.kv_paged.load(Ordering::Relaxed) {
            scalar(
                &mut out,
                "kestrel_kv_blocks_used",
                "gauge",
                "KV cache blocks mapped now, by running sequences and cached snapshots (a block: the same positions of every attention layer's K and V).",
                &self.kv_blocks_used,
            );
            scalar(
                &mut out,
                "kestrel_kv_blocks_reserved",
                "gauge",
                "Blocks' worth of device memory the running sequences reserved (each for its prompt + max_tokens).",
                &self.kv_blocks_reserved,
            );
            scalar(
                &mut out,
                "kestrel_kv_blocks_free",
                "gauge",
                "Blocks' worth of state memory neither reserved by running sequences nor held by the prefix cache.",
                &self.kv_blocks_free,
            );
        }
        scalar(
            &mut out,
            "kestrel_cancelled_total",
            "counter",
            "Requests stopped because the client went away.",
            &self.cancelled,
        );
        scalar(
            &mut out,
            "kestrel_timeouts_total",
            "counter",
            "Requests stopped by the request timeout.",
            &self.timeouts,
        );
        let _ = writeln!(
            out,
            "# HELP kestrel_draining 1 while the server drains (new requests refused, running ones finishing).\n# TYPE kestrel_draining gauge\nkestrel_draining {}",
            u8::from(self.draining.load(Ordering::Relaxed))
        );
        // The same two load figures under vLLM's names, which routers and dashboards built
        // for vLLM read (vllm-router's load-aware policies among them).
        let label = model_id.replace('\\', "\\\\").replace('"', "\\\"");
        for (name, help, v) in [
            (
                "vllm:num_requests_running",
                "Requests being generated (kestrel_running_sequences).",
                &self.running,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting for the model (kestrel_queue_depth).",
                &self.queue_depth,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{label}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        self.ttft.render(
            &mut out,
            "kestrel_time_to_first_token_seconds",
            "Time from the request's arrival at the server to its first generated token (queueing included).",
        );
        self.ttft_admitted.render(
            &mut out,
            "kestrel_time_to_first_token_after_admission_seconds",
            "Time from the model's admitting a request (its queueing over) to its first generated token.",
        );
        self.queue_time.render(
            &mut out,
            "kestrel_queue_time_seconds",
            "Time from a request's arrival at the server to the model's admitting it (validation, tokenizing and queueing).",
        );
        self.e2e.render(
            &mut out,
            "kestrel_e2e_request_latency_seconds",
            "Time from a request's arrival at the server to the end of its reply (finished, cancelled, timed out or failed).",
        );
        self.itl.render(
            &mut out,
            "kestrel_inter_token_latency_seconds",
            "Time between generated tokens.",
        );
        out
    }
}
