//! `kestrel serve`: the OpenAI- and Anthropic-compatible HTTP server.

use super::args::{ModelArgs, ServeArgs};
use super::{BUNDLED_GENERATION_CONFIG, Backend, load_engine};
use anyhow::{Context, Result};
use kestrel::config::GenerationConfig;
use kestrel::hub;
use kestrel::tokenizer::Tokenizer;
use std::time::Duration;

/// `kestrel serve`: tokenizer and defaults load first, the HTTP listener starts at once
/// (`/health` answers 503 until the weights are in), and the engine loads and then runs on
/// its own thread.
pub(super) fn serve_cmd(args: ServeArgs, model: ModelArgs) -> Result<i32> {
    use kestrel::server::{Drained, ServerConfig, Shared, drain, run_model, serve};
    let ServeArgs {
        bind,
        api_key,
        api_key_file,
        allow_origin,
        no_access_log,
        cache_mem,
        request_timeout,
        served_model_name,
        default_max_tokens,
        max_queue,
        max_running,
        prefill_per_round,
        max_body,
        header_timeout,
        body_timeout,
        max_connections,
        drain_timeout,
    } = args;
    // Checked before the listener binds, so that a replica with a bad flag never looks alive.
    anyhow::ensure!(
        model.gpu.is_none() || model.device == super::args::Device::Cuda,
        "--gpu selects a CUDA device: it needs --device cuda"
    );
    anyhow::ensure!(
        model.speculative.is_none() || model.device == super::args::Device::Cpu,
        "MTP speculation on the GPU is not built yet (issue 40): --speculative mtp runs with \
         --device cpu"
    );
    let max_running = max_running.map(|n| n as usize);
    let api_key = match api_key_file {
        Some(path) => Some(read_api_key(&path)?),
        None => api_key.or_else(|| kestrel::settings::Settings::get().api_key.clone()),
    };
    let allow_origins: Vec<String> = allow_origin
        .iter()
        .map(|o| o.trim().trim_end_matches('/').to_string())
        .filter(|o| !o.is_empty())
        .collect();
    let dir = match &model.model {
        Some(spec) => Some(hub::resolve_model(spec)?),
        None => None,
    };
    let (tokenizer, generation) = match &dir {
        Some(d) => (Tokenizer::for_model_dir(d)?, GenerationConfig::from_dir(d)?),
        None => (
            Tokenizer::bundled()?,
            GenerationConfig::from_json_str(BUNDLED_GENERATION_CONFIG)?,
        ),
    };
    let model_id = served_model_name.unwrap_or_else(|| match &model.model {
        Some(spec) => spec.clone(),
        None => match &model.synthetic {
            Some(kind) => format!("synthetic-{kind}"),
            None => "kestrel-demo".into(),
        },
    });
    let config = ServerConfig {
        model_id: model_id.clone(),
        max_seq: model.max_seq as usize,
        api_key,
        cache_mem: cache_mem.min(usize::MAX as u64) as usize,
        request_timeout: Duration::from_secs(request_timeout.max(1)),
        default_max_tokens: default_max_tokens.unwrap_or(if dir.is_none() { 64 } else { 4096 }),
        prefill_chunk: prefill_per_round as usize,
        max_queue,
        max_running,
        max_body: max_body.min(usize::MAX as u64) as usize,
        header_timeout: Duration::from_secs(header_timeout),
        body_timeout: Duration::from_secs(body_timeout),
        max_connections: max_connections as usize,
        allow_origins,
        access_log: !no_access_log,
        speculative: model.speculative(),
    };
    let (shared, rx) = Shared::new(config, tokenizer, &generation)?;
    // The structured-output vocabulary takes a few seconds to build: meanwhile the weights
    // load, so the first `response_format` request does not wait for it.
    let warm = shared.clone();
    std::thread::Builder::new()
        .name("kestrel-grammar-init".into())
        .spawn(move || {
            if let Err(e) = warm.grammar() {
                tracing::warn!("structured outputs are unavailable: {e}");
            }
        })
        .context("cannot start a thread")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&bind))
        .with_context(|| format!("cannot listen on {bind}"))?;
    let addr = listener.local_addr()?;
    let model_shared = shared.clone();
    let model_args = model.clone();
    std::thread::Builder::new()
        .name("kestrel-model".into())
        .spawn(move || {
            let backend = match load_engine(model_args.device, dir.as_deref(), &model_args) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(1);
                }
            };
            if !model_args.quiet {
                eprintln!("kestrel serve: model loaded");
            }
            // On the GPU this first checks that --max-running states fit (and sizes the cache).
            if let Err(e) = with_engine!(&backend, e => run_model(e, model_shared, rx)) {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        })?;
    if !model.quiet {
        eprintln!(
            "kestrel serve: listening on http://{addr} (model id `{model_id}`); SIGTERM or Ctrl-C drains and stops"
        );
    }
    // SIGTERM or Ctrl-C: drain (new requests get 503 and readiness fails while the taken
    // ones finish, at most --drain-timeout), then stop accepting and exit 0 once the open
    // responses are written; a second signal exits at once.
    let stop_shared = shared.clone();
    let timeout = Duration::from_secs(drain_timeout);
    let mut signals = runtime.block_on(async { Signals::new() })?;
    let shutdown = async move {
        let sig = signals.next().await;
        eprintln!(
            "kestrel serve: {sig}: draining ({} requests open; new ones get 503; at most {}s; a second signal exits at once)",
            stop_shared.in_flight(),
            timeout.as_secs()
        );
        tokio::spawn(async move {
            let again = signals.next().await;
            eprintln!("kestrel serve: {again} again: exiting at once");
            std::process::exit(if again == "SIGTERM" { 143 } else { 130 });
        });
        match drain(&stop_shared, timeout).await {
            Drained::Clean => eprintln!("kestrel serve: drained, stopping"),
            Drained::TimedOut { ended } => eprintln!(
                "kestrel serve: --drain-timeout passed: ended {ended} open requests with a 503 error, stopping"
            ),
        }
        // The open connections get a few seconds to take their last bytes (a client that
        // stopped reading would hold the exit forever).
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            eprintln!("kestrel serve: connections still open 10 s after the drain; exiting");
            std::process::exit(0);
        });
    };
    runtime.block_on(serve(listener, shared, shutdown))?;
    Ok(0)
}

/// The key in `path`: its first line, trimmed; an empty or unreadable file is an error.
fn read_api_key(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the API key file {}", path.display()))?;
    let key = text.lines().next().unwrap_or("").trim();
    anyhow::ensure!(
        !key.is_empty(),
        "the API key file {} is empty",
        path.display()
    );
    Ok(key.to_string())
}

/// SIGTERM and SIGINT, whichever comes first.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Must run inside the runtime.
    fn new() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
        })
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
