//! End to end: the `kestrel` binary on the bundled demo model (real tokenizer, random
//! weights): `chat` over piped stdin reusing state across turns, `generate` with sampling
//! flags and seeds, stop strings, Ctrl-C, `--model` as a Hugging Face repo id in a fake cache,
//! and the bad-input cases (exit code and message, never a panic).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kestrel");

fn kestrel(args: &[&str], stdin: Option<&str>, envs: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("RUST_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run kestrel");
    if let Some(text) = stdin {
        let mut si = child.stdin.take().unwrap();
        si.write_all(text.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The `[prompt ...]` stats lines of stderr.
fn stats_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("[prompt "))
        .collect()
}

/// The number after `key ` in a stats line.
fn field(line: &str, key: &str) -> usize {
    let rest = &line[line
        .find(&format!("{key} "))
        .unwrap_or_else(|| panic!("{key} in {line}"))
        + key.len()
        + 1..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
}

#[test]
fn chat_second_turn_reuses_the_first_turns_state() {
    let out = kestrel(
        &["chat", "--seed", "7", "--max-tokens", "6"],
        Some("Hello there!\n/think off\nAnd a second question?\n/stats\n"),
        &[],
    );
    assert_ok(&out);
    let err = text(&out.stderr);
    assert!(err.contains("bundled demo model"), "{err}");
    let stats = stats_lines(&err);
    assert_eq!(stats.len(), 2, "{err}");
    assert_eq!(field(stats[0], "cached"), 0, "{err}");
    let cached = field(stats[1], "cached");
    assert!(cached > 0, "second turn reused nothing: {err}");
    // The reused part is the first turn's whole prompt minus its generation prompt.
    assert!(cached < field(stats[0], "prompt"), "{err}");
    assert!(field(stats[1], "prompt") > field(stats[0], "prompt") + 6);
    for s in &stats {
        assert!(s.contains("ttft ") && s.contains("prefill ") && s.contains("decode "));
        assert_eq!(field(s, "generated"), 6);
        assert!(s.ends_with("stop: max tokens]"), "{s}");
    }
    assert!(err.contains("(thinking off)"), "{err}");
    assert!(err.contains("turns 2"), "{err}");
    // First reply thinks (marked, stdout is not a terminal); the second does not.
    let out_text = text(&out.stdout);
    assert!(out_text.starts_with("<think>\n"), "{out_text}");
    assert_eq!(out_text.matches("<think>").count(), 1, "{out_text}");
}

#[test]
fn generate_with_sampling_flags_is_reproducible_per_seed() {
    let run = |seed: &str| {
        let out = kestrel(
            &[
                "generate",
                "--prompt",
                "Write a haiku about kestrels.",
                "--no-think",
                "--temperature",
                "0.9",
                "--top-k",
                "50",
                "--top-p",
                "0.95",
                "--min-p",
                "0.01",
                "--repetition-penalty",
                "1.1",
                "--presence-penalty",
                "0.3",
                "--frequency-penalty",
                "0.2",
                "--max-tokens",
                "10",
                "--seed",
                seed,
            ],
            None,
            &[],
        );
        assert_ok(&out);
        let err = text(&out.stderr);
        let stats = stats_lines(&err);
        assert_eq!(stats.len(), 1, "{err}");
        assert_eq!(field(stats[0], "generated"), 10);
        text(&out.stdout)
    };
    let a = run("11");
    let b = run("11");
    let c = run("12");
    assert!(!a.trim().is_empty());
    assert_eq!(a, b, "same seed, different output");
    assert_ne!(a, c, "different seeds gave the same 10 sampled tokens");
    assert!(
        !a.contains("<think>"),
        "--no-think output has a thinking block: {a}"
    );
}

#[test]
fn stop_strings_end_the_reply_and_are_not_printed() {
    let base = [
        "generate",
        "--prompt",
        "Count to ten.",
        "--no-think",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
    ];
    let out = kestrel(&base, None, &[]);
    assert_ok(&out);
    let full = text(&out.stdout);
    let full = full.strip_suffix('\n').unwrap_or(&full).to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    // A stop string from the middle of the greedy reply (most likely spanning tokens).
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 4].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];
    let mut args = base.to_vec();
    args.extend(["--stop", &stop, "--stop", "never-in-gibberish-output"]);
    let out = kestrel(&args, None, &[]);
    assert_ok(&out);
    let got = text(&out.stdout);
    assert_eq!(got.strip_suffix('\n').unwrap_or(&got), expected);
    assert!(text(&out.stderr).contains("stop: stop string"));
}

#[test]
fn raw_prompts_are_not_chat_formatted() {
    let out = kestrel(
        &[
            "generate",
            "--raw",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "3",
            "--seed",
            "1",
        ],
        None,
        &[],
    );
    assert_ok(&out);
    let err = text(&out.stderr);
    let stats = stats_lines(&err);
    // "Once", " upon", " a", " time": no template tokens around it.
    assert_eq!(field(stats[0], "prompt"), 4, "{err}");
}

/// Starts `args` with stdin piped, waits for the first bytes of the reply, sends SIGINT,
/// then writes `after` to stdin and closes it. Returns (exit code, stdout, stderr).
fn interrupt_mid_reply(args: &[&str], first: &str, after: &str) -> (Option<i32>, String, String) {
    let mut child: Child = Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(first.as_bytes()).unwrap();
    stdin.flush().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    all.extend_from_slice(&buf[..n]);
                    let _ = tx.send(());
                }
            }
        }
        all
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("no output from the reply");
    // Let a few more tokens through, then Ctrl-C.
    std::thread::sleep(Duration::from_millis(300));
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    stdin.write_all(after.as_bytes()).ok();
    drop(stdin);
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("kestrel did not stop after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = reader.join().unwrap();
    let err = err_reader.join().unwrap();
    (status.code(), text(&out), text(&err))
}

#[test]
fn ctrl_c_stops_the_reply_not_the_chat() {
    let (code, out, err) = interrupt_mid_reply(
        &["chat", "--seed", "3", "--max-tokens", "100000"],
        "Tell me a very long story.\n",
        "/stats\n",
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.is_empty());
    let stats = stats_lines(&err);
    assert_eq!(stats.len(), 1, "{err}");
    assert!(stats[0].ends_with("stop: cancelled]"), "{err}");
    assert!(field(stats[0], "generated") < 100000);
    // The chat went on to read /stats after the cancelled reply.
    assert!(err.contains("turns 1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn ctrl_c_during_generate_stops_with_status_130() {
    let (code, _, err) = interrupt_mid_reply(
        &[
            "generate",
            "--prompt",
            "Go on and on.",
            "--max-tokens",
            "100000",
        ],
        "",
        "",
    );
    assert_eq!(code, Some(130), "{err}");
    assert!(err.contains("stop: cancelled"), "{err}");
}

#[test]
fn model_given_as_a_repo_id_in_the_hugging_face_cache() {
    use kestrel::synthetic::{DEMO_SEED, Layout, demo_config, random_weights, write_checkpoint};
    // The demo model's weights written as a checkpoint into a fake cache: loading it by repo
    // id through the memory-mapped path must give exactly the built-in demo model's tokens.
    let cache = tempfile::tempdir().unwrap();
    let rev = "0123456789abcdef0123456789abcdef01234567";
    let repo = cache.path().join("models--kestrel-test--demo");
    let snap = repo.join("snapshots").join(rev);
    let cfg = demo_config();
    let w = random_weights(&cfg, DEMO_SEED, kestrel::tensor::DType::BF16);
    write_checkpoint(&snap, &cfg, &w, Layout::Official, 2).unwrap();
    drop(w);
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    let env = [("HF_HUB_CACHE", cache.path())];

    let out = kestrel(&["inspect", "--model", "kestrel-test/demo"], None, &env);
    assert_ok(&out);
    assert!(text(&out.stdout).contains(&snap.display().to_string()));

    let args = |model: Option<&'static str>| {
        let mut a = vec![
            "generate",
            "--prompt",
            "Hi",
            "--temperature",
            "0",
            "--max-tokens",
            "5",
        ];
        if let Some(m) = model {
            a.extend(["--model", m]);
        }
        a
    };
    let from_cache = kestrel(&args(Some("kestrel-test/demo")), None, &env);
    assert_ok(&from_cache);
    assert!(!text(&from_cache.stderr).contains("bundled demo model"));
    let built_in = kestrel(&args(None), None, &[]);
    assert_ok(&built_in);
    assert_eq!(text(&from_cache.stdout), text(&built_in.stdout));

    // Sampling defaults come from the checkpoint's generation_config.json, checked like flags.
    std::fs::write(
        snap.join("generation_config.json"),
        r#"{"do_sample": true, "top_p": 1.5, "eos_token_id": [248046, 248044]}"#,
    )
    .unwrap();
    let err = fails(
        &["generate", "--prompt", "Hi", "--model", "kestrel-test/demo"],
        1,
        &env,
    );
    assert!(
        err.contains("generation_config.json")
            && err.contains("top_p is 1.5")
            && err.contains("--top-p"),
        "{err}"
    );
    let out = kestrel(
        &[
            "generate",
            "--prompt",
            "Hi",
            "--model",
            "kestrel-test/demo",
            "--top-p",
            "0.9",
            "--max-tokens",
            "2",
        ],
        None,
        &env,
    );
    assert_ok(&out);
}

/// Runs a command that must fail: returns stderr after checking the exit code and that
/// nothing panicked.
fn fails(args: &[&str], code: i32, envs: &[(&str, &Path)]) -> String {
    let out = kestrel(args, None, envs);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn bad_input_gives_a_clear_error_and_a_nonzero_exit() {
    let g = |extra: &[&'static str]| {
        let mut a = vec!["generate", "--prompt", "hi"];
        a.extend_from_slice(extra);
        a
    };
    // Flag values (clap's usage errors exit with 2).
    for (flag, value) in [
        ("--temperature", "-0.5"),
        ("--temperature", "hot"),
        ("--top-p", "1.5"),
        ("--top-p", "0"),
        ("--min-p", "2"),
        ("--repetition-penalty", "0"),
        ("--presence-penalty", "3"),
        ("--max-tokens", "0"),
        ("--max-tokens", "-3"),
        ("--top-k", "-1"),
        ("--max-seq", "-5"),
        ("--stop", ""),
    ] {
        let err = fails(&g(&[flag, value]), 2, &[]);
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    let err = fails(&g(&["--device", "tpu"]), 2, &[]);
    assert!(err.contains("--device"), "{err}");
    let err = fails(&g(&["--think", "--no-think"]), 2, &[]);
    assert!(err.contains("--no-think"), "{err}");

    // No usable GPU here (CI): a clear error that points to the CPU backend.
    let err = fails(&g(&["--device", "cuda"]), 1, &[]);
    assert!(
        err.contains("CUDA") && err.contains("--device cpu"),
        "{err}"
    );

    // --gpu picks a CUDA device: refused on the CPU backend (serve refuses it before it
    // listens), and with --device cuda the error names the ordinal.
    let err = fails(&g(&["--gpu", "1"]), 1, &[]);
    assert!(
        err.contains("--gpu") && err.contains("--device cuda"),
        "{err}"
    );
    let err = fails(&["serve", "--bind", "127.0.0.1:0", "--gpu", "1"], 1, &[]);
    assert!(
        err.contains("--gpu") && err.contains("--device cuda"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");
    let err = fails(&g(&["--device", "cuda", "--gpu", "3"]), 1, &[]);
    assert!(err.contains("--gpu 3"), "{err}");

    // Nonexistent directory; repo id not in the cache (says where it looked).
    let err = fails(&g(&["--model", "/no/such/checkpoint"]), 1, &[]);
    assert!(err.contains("/no/such/checkpoint"), "{err}");
    let cache = tempfile::tempdir().unwrap();
    let err = fails(
        &g(&["--model", "Qwen/Qwen3.6-35B-A3B"]),
        1,
        &[("HF_HUB_CACHE", cache.path())],
    );
    assert!(err.contains("models--Qwen--Qwen3.6-35B-A3B"), "{err}");
    assert!(err.contains(&cache.path().display().to_string()), "{err}");

    // A directory that is not a checkpoint.
    let empty = tempfile::tempdir().unwrap();
    let err = fails(
        &["inspect", "--model", empty.path().to_str().unwrap()],
        1,
        &[],
    );
    assert!(err.contains("config.json"), "{err}");

    // Prompt longer than the context limit: both numbers.
    let err = fails(&g(&["--max-seq", "8"]), 1, &[]);
    assert!(
        err.contains("the prompt is 11 tokens") && err.contains("context limit is 8 tokens"),
        "{err}"
    );
}

#[test]
fn serve_api_key_file_missing_or_empty_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("kestrel-keyfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.key");
    let o = kestrel(
        &["serve", "--api-key-file", missing.to_str().unwrap()],
        None,
        &[],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot read the API key file"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let empty = dir.join("empty.key");
    std::fs::write(&empty, "  \n").unwrap();
    let o = kestrel(
        &["serve", "--api-key-file", empty.to_str().unwrap()],
        None,
        &[],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("is empty"), "{err}");
    let o = kestrel(
        &[
            "serve",
            "--api-key",
            "k",
            "--api-key-file",
            empty.to_str().unwrap(),
        ],
        None,
        &[],
    );
    assert_ne!(
        o.status.code(),
        Some(0),
        "both a key and a key file are refused"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inspect_shows_the_weight_format_and_bytes_per_kind() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let out = kestrel(
        &[
            "inspect",
            "--model",
            root.join("tiny-official-fp8").to_str().unwrap(),
        ],
        None,
        &[],
    );
    assert_ok(&out);
    let s = text(&out.stdout);
    for needle in [
        "format          fp8 e4m3 block 128x128 (quantization_config: fp8, e4m3, dynamic activations",
        // 73 FP8 matrices of 128x128 (experts, shared experts) or larger, 1 byte an element
        "  F8_E4M3                       1638400",
        // one f32 scale per 128x128 block: 1638400 / 16384 * 4
        "  FP8 block scales (f32)            400",
        "  BF16 ",
        "  f32 vectors ",
    ] {
        assert!(s.contains(needle), "missing {needle:?} in:\n{s}");
    }
    let out = kestrel(
        &[
            "inspect",
            "--model",
            root.join("tiny-official-bf16").to_str().unwrap(),
        ],
        None,
        &[],
    );
    assert_ok(&out);
    let s = text(&out.stdout);
    assert!(s.contains("format          bf16\n"), "{s}");
    assert!(!s.contains("F8_E4M3"), "{s}");
    assert!(s.contains("mtp head        complete (19 tensors)"), "{s}");
    let out = kestrel(
        &[
            "inspect",
            "--model",
            root.join("tiny-flat-f32").to_str().unwrap(),
        ],
        None,
        &[],
    );
    assert_ok(&out);
    let s = text(&out.stdout);
    assert!(
        s.contains("mtp head        unusable for --speculative mtp: "),
        "{s}"
    );
    assert!(s.contains("no `mtp.*` tensors"), "{s}");
}

/// `--speculative mtp` on the demo model (its seeded random head): the reply is the plain
/// greedy reply, the stats line reports the acceptance and tokens per step, chat resumes a
/// speculative turn's state, and the GPU and a checkpoint without a head are refused.
#[test]
fn speculative_flags_keep_the_reply_and_report_acceptance() {
    let args = [
        "generate",
        "--prompt",
        "Tell me a story.",
        "--temperature",
        "0",
    ];
    let plain = kestrel(&[&args[..], &["--max-tokens", "24"]].concat(), None, &[]);
    assert_ok(&plain);
    for k in ["1", "3"] {
        let sp = kestrel(
            &[
                &args[..],
                &[
                    "--max-tokens",
                    "24",
                    "--speculative",
                    "mtp",
                    "--draft-tokens",
                    k,
                ],
            ]
            .concat(),
            None,
            &[],
        );
        assert_ok(&sp);
        assert_eq!(text(&sp.stdout), text(&plain.stdout), "K={k}");
        let err = text(&sp.stderr);
        let line = stats_lines(&err)[0];
        assert!(line.contains("mtp acceptance "), "{line}");
        assert!(line.contains(" tokens/step"), "{line}");
        assert_eq!(field(line, "generated"), 24);
        assert!(!stats_lines(&text(&plain.stderr))[0].contains("mtp"));
    }
    // chat: the second turn resumes what the first (speculative) turn left
    let out = kestrel(
        &[
            "chat",
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--speculative",
            "mtp",
        ],
        Some("Hello there!\nAnd a second question?\n"),
        &[],
    );
    assert_ok(&out);
    let err = text(&out.stderr);
    let stats = stats_lines(&err);
    assert_eq!(stats.len(), 2, "{err}");
    assert!(field(stats[1], "cached") > 0, "{}", stats[1]);
    assert!(stats[1].contains("mtp acceptance"), "{}", stats[1]);

    let e = fails(
        &[
            "generate",
            "--prompt",
            "hi",
            "--device",
            "cuda",
            "--speculative",
            "mtp",
        ],
        1,
        &[],
    );
    assert!(
        e.contains("MTP speculation on the GPU is not built yet (issue 40)"),
        "{e}"
    );
    let e = fails(
        &[
            "serve",
            "--device",
            "cuda",
            "--speculative",
            "mtp",
            "--bind",
            "127.0.0.1:0",
        ],
        1,
        &[],
    );
    assert!(e.contains("not built yet (issue 40)"), "{e}");
    let flat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-flat-f32");
    let e = fails(
        &[
            "generate",
            "--prompt",
            "hi",
            "--raw",
            "--model",
            flat.to_str().unwrap(),
            "--speculative",
            "mtp",
        ],
        1,
        &[],
    );
    assert!(e.contains("no `mtp.*` tensors"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    // --draft-tokens needs --speculative; 0 drafts is refused
    fails(
        &["generate", "--prompt", "hi", "--draft-tokens", "2"],
        2,
        &[],
    );
    fails(
        &[
            "generate",
            "--prompt",
            "hi",
            "--speculative",
            "mtp",
            "--draft-tokens",
            "0",
        ],
        2,
        &[],
    );
}

/// The plain and the concurrency bench on the CPU: it measures no bandwidth, so the JSON says
/// so (`bandwidth_basis` "none", the bandwidths and every fraction null) and the tables print
/// `-` for the fraction, not a made-up 0.
#[test]
fn cpu_bench_states_it_has_no_bandwidth_basis() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-official-bf16");
    for (name, extra) in [("plain", &[][..]), ("conc", &["--concurrency", "2"][..])] {
        let json = dir.path().join(format!("{name}.json"));
        let mut args = vec![
            "bench",
            "--device",
            "cpu",
            "--model",
            fixture.to_str().unwrap(),
            "--contexts",
            "16",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend(extra);
        let out = kestrel(&args, None, &[]);
        assert_ok(&out);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert!(
            v["bandwidth_basis"].as_str().unwrap().starts_with("none"),
            "{name}: {v}"
        );
        assert!(v["read_bandwidth_bytes_per_s"].is_null(), "{name}: {v}");
        assert!(v["copy_bandwidth_bytes_per_s"].is_null(), "{name}: {v}");
        let row = &v["rows"][0];
        let key = if extra.is_empty() {
            "decode_bandwidth_fraction"
        } else {
            "bandwidth_fraction"
        };
        assert!(row[key].is_null(), "{name}: {row}");
        assert!(row["decode_tok_s"].as_f64().unwrap() > 0.0, "{name}: {row}");
        let table = text(&out.stdout);
        let last = table.lines().last().unwrap();
        assert!(last.trim_end().ends_with(" -"), "{name}: {table}");
    }
}

/// `bench --speculative mtp` on the CPU: the JSON carries acceptance, tokens per step and the
/// verify costs; forced acceptance accepts every draft.
#[test]
fn bench_speculative_reports_acceptance_and_verify_costs() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-official-bf16");
    for forced in [false, true] {
        let json = dir.path().join(format!("spec-{forced}.json"));
        let mut args = vec![
            "bench",
            "--device",
            "cpu",
            "--model",
            fixture.to_str().unwrap(),
            "--contexts",
            "32",
            "--speculative",
            "mtp",
            "--draft-tokens",
            "3",
            "--json",
            json.to_str().unwrap(),
        ];
        if forced {
            args.push("--speculative-forced");
        }
        let out = kestrel(&args, None, &[]);
        assert_ok(&out);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let row = &v["rows"][0];
        assert_eq!(row["context"], 32);
        assert_eq!(row["draft_tokens"], 3);
        assert_eq!(row["forced"], forced);
        let acc = row["acceptance"].as_f64().unwrap();
        let tps = row["tokens_per_step"].as_f64().unwrap();
        if forced {
            assert_eq!(acc, 1.0, "{row}");
            assert_eq!(tps, 4.0, "{row}");
        } else {
            assert!((1.0..=4.0).contains(&tps), "{row}");
        }
        let verify = row["verify"].as_array().unwrap();
        assert_eq!(verify.len(), 4);
        for (i, c) in verify.iter().enumerate() {
            assert_eq!(c["draft_tokens"], i + 1);
            assert!(c["verify_ms"].as_f64().unwrap() > 0.0, "{c}");
            assert!(c["modelled_speedup_at_0_8"].as_f64().unwrap() > 0.0, "{c}");
        }
    }
    let e = fails(
        &[
            "bench",
            "--device",
            "cuda",
            "--synthetic",
            "demo",
            "--speculative",
            "mtp",
        ],
        1,
        &[],
    );
    assert!(e.contains("not built yet (issue 40)"), "{e}");
}

#[test]
fn mlx_4bit_checkpoint_inspects_and_generates_on_the_cpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = root.join("tiny-mlx-4bit");
    let out = kestrel(&["inspect", "--model", dir.to_str().unwrap()], None, &[]);
    assert_ok(&out);
    let s = text(&out.stdout);
    for needle in [
        "format          affine 4-bit group 64 + 8-bit group 64 (MLX affine 4-bit, group 64; 8-bit group 64: 8 modules)",
        // 4 bits a weight: everything but the routers and shared-expert gates (8-bit, 8 x
        // 128 + 4 x 4 x 128 bytes)
        "  U4                             852736",
        "  U8                               2048",
        // one bf16 scale and one bias a group of 64
        "  affine scales+biases (BF16)         106720",
    ] {
        assert!(s.contains(needle), "missing {needle:?} in:\n{s}");
    }
    // The fixture's vocabulary is 256 ids, so a one-byte raw prompt (the bundled tokenizer,
    // as the fixture ships none).
    let out = kestrel(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--raw",
            "--prompt",
            "a",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
        None,
        &[],
    );
    assert_ok(&out);
    let err = text(&out.stderr);
    assert!(err.contains("generated 8 tokens"), "{err}");
}
