//! Replicas behind a cache-aware router, end to end on loopback: `deploy/replicas.sh` starts
//! three `kestrel serve` replicas (the demo model, CPU) and vllm-router (from PyPI, pinned) in
//! front of them, and this test shows, through the router:
//!
//! 1. requests sharing a long prefix land on the replica that has it cached (`cached_tokens`
//!    > 0 on every repeat, one owner per prefix), and distinct prefixes spread;
//! 2. a replica told to drain (SIGTERM) gets no new requests once the router's health check
//!    has seen it (those arriving before are refused with 503 and retried elsewhere, so every
//!    one succeeds); its running streams finish, and one still running at `--drain-timeout`
//!    ends with an `error` event and `[DONE]`, forwarded by the router;
//! 3. a replica killed (SIGKILL) mid-load loses no request that had not started streaming:
//!    the router retries them on the other replicas and they complete; the streams it was
//!    writing end with a broken transfer (no `[DONE]`), never a clean-looking end.
//!
//! The router: `KESTREL_VLLM_ROUTER` (a command) if set, else `vllm-router` on PATH, else
//! `python3 -m vllm_router.launch_router` if python3 has it (`.ci/run` installs it), else it
//! is installed from PyPI into a venv under the target directory. Only when that fails does
//! the test skip, saying why.

use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kestrel");
/// The router release this recipe was tested with.
const ROUTER_PACKAGE: &str = "vllm-router==0.1.17";
const REPLICAS: usize = 3;

/// The router command, or why there is none.
fn router_command() -> Result<Vec<String>, String> {
    let works = |cmd: &[String]| {
        Command::new(&cmd[0])
            .args(&cmd[1..])
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Ok(c) = std::env::var("KESTREL_VLLM_ROUTER") {
        let cmd: Vec<String> = c.split_whitespace().map(str::to_string).collect();
        return if !cmd.is_empty() && works(&cmd) {
            Ok(cmd)
        } else {
            Err(format!("KESTREL_VLLM_ROUTER={c:?} does not run"))
        };
    }
    for cmd in [
        vec!["vllm-router".to_string()],
        ["python3", "-m", "vllm_router.launch_router"]
            .map(String::from)
            .to_vec(),
    ] {
        if works(&cmd) {
            return Ok(cmd);
        }
    }
    // Install it from PyPI into a venv of its own (kept for later runs).
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-router-venv");
    let bin = venv.join("bin/vllm-router");
    let cmd = vec![bin.display().to_string()];
    if works(&cmd) {
        return Ok(cmd);
    }
    let run = |c: &mut Command| -> Result<(), String> {
        let out = c.output().map_err(|e| format!("{c:?}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            Err(format!("{c:?} failed: {}", tail.join(" | ")))
        }
    };
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    run(Command::new(venv.join("bin/pip")).args([
        "install",
        "-q",
        "--disable-pip-version-check",
        ROUTER_PACKAGE,
    ]))?;
    if works(&cmd) {
        Ok(cmd)
    } else {
        Err(format!("{} installed but does not run", bin.display()))
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An HTTP reply as the client saw it.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: String,
    /// The body arrived whole (a chunked body's last chunk, or Content-Length bytes).
    complete: bool,
    /// Some of the body had arrived (for a stream: it had started).
    started: bool,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The `data:` payloads of an SSE body, `[DONE]` as a string.
    fn events(&self) -> Vec<Value> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_string())))
            .collect()
    }
}

/// One HTTP/1.1 request on its own connection. A connection cut mid-body is not an error:
/// the reply says what had arrived.
fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let Some((head, rest)) = text.split_once("\r\n\r\n") else {
        return Reply {
            status: 0,
            body: text,
            complete: false,
            started: false,
        };
    };
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let lower = head.to_ascii_lowercase();
    if lower.contains("transfer-encoding: chunked") {
        let (mut out, mut s, mut complete) = (String::new(), rest, false);
        while let Some((size, tail)) = s.split_once("\r\n") {
            let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
                break;
            };
            if n == 0 {
                complete = true;
                break;
            }
            if tail.len() < n {
                out.push_str(tail);
                break;
            }
            out.push_str(&tail[..n]);
            s = tail.get(n + 2..).unwrap_or("");
        }
        Reply {
            status,
            started: !out.is_empty(),
            body: out,
            complete,
        }
    } else {
        let len = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        Reply {
            status,
            complete: len.is_none_or(|n| rest.len() >= n),
            started: !rest.is_empty(),
            body: rest.to_string(),
        }
    }
}

fn get(addr: SocketAddr, path: &str) -> Option<String> {
    // A replica that has exited refuses the connection.
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut t = String::new();
    s.read_to_string(&mut t).ok()?;
    Some(t.split_once("\r\n\r\n")?.1.to_string())
}

/// A replica's Prometheus figures: `name{labels}` (or `name`) -> value.
fn metrics(addr: SocketAddr) -> Option<BTreeMap<String, f64>> {
    let text = get(addr, "/metrics")?;
    Some(
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect(),
    )
}

fn chat_count(m: &BTreeMap<String, f64>, status: u16) -> u64 {
    let k =
        format!("kestrel_requests_total{{endpoint=\"/v1/chat/completions\",status=\"{status}\"}}");
    m.get(&k).copied().unwrap_or(0.0) as u64
}

/// Chat POSTs a replica has answered, 200 and 503 (`None`: it is gone).
fn answered(addr: SocketAddr) -> Option<(u64, u64)> {
    let m = metrics(addr)?;
    Some((chat_count(&m, 200), chat_count(&m, 503)))
}

fn gauge(addr: SocketAddr, name: &str) -> u64 {
    metrics(addr)
        .and_then(|m| m.get(name).copied())
        .unwrap_or(0.0) as u64
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn chat_body(system: &str, question: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "kestrel-demo",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// A long system prompt unlike the others from its first character.
fn prefix(tag: &str) -> String {
    let words = [
        "kestrels", "hover", "over", "meadows", "hunting", "voles", "in", "the", "wind",
    ];
    let mut s = format!("{tag}: ");
    for i in 0..140 {
        s.push_str(words[(i * 7 + tag.len()) % words.len()]);
        s.push(' ');
    }
    s
}

fn kill(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {signal} {pid}");
}

/// `deploy/replicas.sh` in the background; stopped (drained) when dropped.
struct Deployment {
    script: Child,
    run_dir: tempfile::TempDir,
    router: SocketAddr,
    replicas: Vec<SocketAddr>,
}

impl Deployment {
    fn start(router_cmd: &[String]) -> Deployment {
        let run_dir = tempfile::tempdir().unwrap();
        let mut ports = BTreeSet::new();
        while ports.len() < REPLICAS + 2 {
            ports.insert(free_port());
        }
        let ports: Vec<u16> = ports.into_iter().collect();
        let (port, metrics_port) = (ports[0], ports[1]);
        // The script puts replicas on consecutive ports: find a free run of them.
        let base = (20000..60000)
            .step_by(7)
            .map(|b: u16| b + (std::process::id() % 997) as u16)
            .find(|&b| {
                (0..REPLICAS as u16)
                    .all(|i| std::net::TcpListener::bind(("127.0.0.1", b + i)).is_ok())
            })
            .unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/replicas.sh");
        let mut child = Command::new("bash")
            .arg(script)
            .args(["--replicas", &REPLICAS.to_string()])
            .args([
                "--port",
                &port.to_string(),
                "--base-port",
                &base.to_string(),
            ])
            .arg("--run-dir")
            .arg(run_dir.path())
            .args([
                "--",
                "--max-seq",
                "4096",
                "--max-running",
                "2",
                "--drain-timeout",
                "6",
            ])
            .env("KESTREL", BIN)
            .env("VLLM_ROUTER", router_cmd.join(" "))
            .env("ROUTER_METRICS_PORT", metrics_port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let t0 = Instant::now();
        loop {
            line.clear();
            let n = out.read_line(&mut line).unwrap();
            if n == 0 {
                let log =
                    std::fs::read_to_string(run_dir.path().join("router.log")).unwrap_or_default();
                panic!("replicas.sh exited before it was ready; router log:\n{log}");
            }
            if line.starts_with("ready: ") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "replicas.sh never ready"
            );
        }
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = out.read_to_string(&mut sink);
        });
        Deployment {
            script: child,
            run_dir,
            router: SocketAddr::from(([127, 0, 0, 1], port)),
            replicas: (0..REPLICAS as u16)
                .map(|i| SocketAddr::from(([127, 0, 0, 1], base + i)))
                .collect(),
        }
    }

    fn pid(&self, replica: usize) -> u32 {
        let p = self.run_dir.path().join(format!("replica-{replica}.pid"));
        std::fs::read_to_string(p).unwrap().trim().parse().unwrap()
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.run_dir.path().join(name)).unwrap_or_default()
    }

    /// Whether the router's health checks have taken `replica` out.
    fn router_sees_unhealthy(&self, replica: usize) -> bool {
        let url = format!("http://{}", self.replicas[replica]);
        let Some(body) = get(self.router, "/workers") else {
            return false;
        };
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        v["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| w["url"] == url.as_str() && w["is_healthy"] == false)
    }

    /// SIGTERM to the script (it drains the replicas, then stops the router): its status.
    fn stop(mut self) -> Option<i32> {
        kill("-TERM", self.script.id());
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.script.try_wait().unwrap() {
                return st.code();
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if self.script.try_wait().ok().flatten().is_none() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.script.id().to_string()])
                .status();
            let _ = self.script.wait();
        }
        if !std::thread::panicking() {
            return;
        }
        // After a failed assertion: nothing may outlive the test.
        for name in (0..REPLICAS)
            .map(|i| format!("replica-{i}.pid"))
            .chain(["router.pid".to_string()])
        {
            if let Ok(p) = std::fs::read_to_string(self.run_dir.path().join(name)) {
                let _ = Command::new("kill")
                    .args(["-KILL", p.trim()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

#[test]
fn replicas_behind_vllm_router() {
    let router_cmd = match router_command() {
        Ok(c) => c,
        Err(why) => {
            eprintln!(
                "SKIPPED replicas_behind_vllm_router: cannot install {ROUTER_PACKAGE}: {why}"
            );
            return;
        }
    };
    let t_start = Instant::now();
    let d = Deployment::start(&router_cmd);
    let r = d.router;

    // 1. Prefix affinity. The first request of each prefix goes out at once (the cache-aware
    // policy sends a prefix it has not seen to the least loaded replica, so they spread);
    // each repeat, sent alone, must land where its prefix is cached.
    let tags = ["alpha", "bravo", "charlie"];
    let firsts: Vec<_> = tags
        .iter()
        .map(|t| {
            let body = chat_body(&prefix(t), "first question", 24, false);
            std::thread::spawn(move || send(r, "POST", "/v1/chat/completions", Some(&body)))
        })
        .collect();
    for f in firsts {
        let reply = f.join().unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    let mut owner: BTreeMap<&str, usize> = BTreeMap::new();
    for round in 0..2 {
        for t in tags {
            let before: Vec<_> = d.replicas.iter().map(|&a| answered(a).unwrap()).collect();
            let body = chat_body(&prefix(t), &format!("question {round}"), 4, false);
            let reply = send(r, "POST", "/v1/chat/completions", Some(&body));
            assert_eq!(reply.status, 200, "{reply:?}");
            let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(
                cached > 0,
                "a repeat of prefix {t} found nothing cached: {}",
                reply.body
            );
            let served: Vec<usize> = (0..REPLICAS)
                .filter(|&i| answered(d.replicas[i]).unwrap().0 > before[i].0)
                .collect();
            assert_eq!(served.len(), 1, "{t}: {served:?}");
            let o = *owner.entry(t).or_insert(served[0]);
            assert_eq!(o, served[0], "prefix {t} moved between replicas");
        }
    }
    let owners: BTreeSet<usize> = owner.values().copied().collect();
    assert!(
        owners.len() >= 2,
        "three prefixes all on one replica: {owner:?}"
    );
    eprintln!("prefix owners: {owner:?}");

    // 2. Drain. Replica `dr` owns prefix alpha, so the router prefers it for alpha requests.
    let dr = owner["alpha"];
    let alpha = prefix("alpha");
    let short = {
        let body = chat_body(&alpha, "short stream", 40, true);
        std::thread::spawn(move || send(r, "POST", "/v1/chat/completions", Some(&body)))
    };
    let long = {
        // far longer than --drain-timeout 6 allows
        let body = chat_body(&alpha, "long stream", 3000, true);
        std::thread::spawn(move || send(r, "POST", "/v1/chat/completions", Some(&body)))
    };
    wait_for(
        "two streams on the draining replica",
        Duration::from_secs(20),
        || gauge(d.replicas[dr], "kestrel_running_sequences") == 2,
    );
    let (ok_before, _) = answered(d.replicas[dr]).unwrap();
    kill("-TERM", d.pid(dr));
    // Right away, before the router's health check has noticed: alpha requests still
    // prefer `dr`, which refuses them (503); the router retries them elsewhere.
    for i in 0..4 {
        let body = chat_body(&alpha, &format!("during the drain {i}"), 4, false);
        let reply = send(r, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(reply.status, 200, "lost during the drain: {reply:?}");
    }
    wait_for(
        "the router to take the draining replica out",
        Duration::from_secs(10),
        || d.router_sees_unhealthy(dr),
    );
    let seen = answered(d.replicas[dr]).expect("the draining replica is still up");
    assert_eq!(seen.0, ok_before, "the draining replica took a new request");
    eprintln!(
        "drain: the draining replica refused {} requests (503) before the router took it out; all were retried elsewhere",
        seen.1
    );
    for i in 0..4 {
        let body = chat_body(&alpha, &format!("after the drain was seen {i}"), 4, false);
        let reply = send(r, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    // Not even a refused one reached it since the router saw the drain.
    if let Some(now) = answered(d.replicas[dr]) {
        assert_eq!(now, seen, "requests reached the draining replica");
    }
    let short = short.join().unwrap();
    assert!(short.complete, "{short:?}");
    let ev = short.events();
    assert_eq!(ev.last().unwrap(), "[DONE]", "{short:?}");
    assert!(ev.iter().all(|e| e.get("error").is_none()), "{short:?}");
    assert!(
        ev[ev.len() - 2]["choices"][0]["finish_reason"].is_string(),
        "{short:?}"
    );
    // The long one: cut at --drain-timeout with an error event, then [DONE].
    let long = long.join().unwrap();
    assert!(long.complete, "{long:?}");
    let ev = long.events();
    assert_eq!(ev.last().unwrap(), "[DONE]", "{long:?}");
    assert_eq!(
        ev[ev.len() - 2]["error"]["type"],
        "service_unavailable",
        "{long:?}"
    );
    wait_for(
        "the drained replica to exit",
        Duration::from_secs(20),
        || TcpStream::connect(d.replicas[dr]).is_err(),
    );
    let log = d.log(&format!("replica-{dr}.log"));
    assert!(log.contains("SIGTERM: draining"), "{log}");
    assert!(
        log.contains("--drain-timeout passed: ended 1 open requests"),
        "{log}"
    );

    // 3. Kill. Of the two replicas left, `k` is killed while it runs two streams and has
    // more requests waiting. Distinct prompts, so the load spreads over both.
    let left: Vec<usize> = (0..REPLICAS).filter(|&i| i != dr).collect();
    let k = left[1];
    let jobs: Vec<_> = (0..16)
        .map(|i| {
            let stream = i % 4 != 3;
            let body = chat_body(
                &format!("{i:02} {:x} load", i * 7919),
                &format!("request {i}"),
                48,
                stream,
            );
            let h =
                std::thread::spawn(move || send(r, "POST", "/v1/chat/completions", Some(&body)));
            std::thread::sleep(Duration::from_millis(10));
            (stream, h)
        })
        .collect();
    wait_for(
        "the replica to kill to be busy, with requests waiting",
        Duration::from_secs(20),
        || {
            metrics(d.replicas[k]).is_some_and(|m| {
                m.get("kestrel_running_sequences") == Some(&2.0)
                    && m.get("kestrel_queue_depth").copied().unwrap_or(0.0) >= 1.0
            })
        },
    );
    kill("-KILL", d.pid(k));
    let (mut done, mut cut) = (0, 0);
    for (stream, h) in jobs {
        let reply = h.join().unwrap();
        if !stream {
            assert_eq!(
                reply.status, 200,
                "a non-streaming request was lost: {reply:?}"
            );
            assert!(reply.json()["choices"][0]["finish_reason"].is_string());
            done += 1;
            continue;
        }
        assert_eq!(reply.status, 200, "{reply:?}");
        let ev = reply.events();
        if reply.complete {
            assert_eq!(ev.last().unwrap(), "[DONE]", "{reply:?}");
            assert!(ev.iter().all(|e| e.get("error").is_none()), "{reply:?}");
            done += 1;
        } else {
            // Lost only if it had started streaming from the killed replica, and then the
            // client sees the transfer break: no [DONE], no final chunk.
            assert!(
                reply.started,
                "a request lost before it streamed: {reply:?}"
            );
            assert!(!ev.iter().any(|e| e == "[DONE]"), "{reply:?}");
            cut += 1;
        }
    }
    assert!(cut <= 2, "{cut} streams cut; the killed replica ran 2");
    assert_eq!(done + cut, 16);
    eprintln!("kill: {done} completed, {cut} streams cut mid-way");

    // The script drains what is left and stops the router: exit 0.
    assert_eq!(d.stop(), Some(0));
    eprintln!(
        "replicas_behind_vllm_router: {:.1} s",
        t_start.elapsed().as_secs_f64()
    );
}
