//! `--model` resolution against a fake Hugging Face cache tree: `refs/main` honoured, else the
//! newest snapshot; `@revision`; local directories win; clear errors that say where they
//! looked. No network, no process environment changes (the environment is passed in).

use kestrel::hub::{resolve_in_cache, resolve_model_with};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

fn env(pairs: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
    move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
}

/// `models--{org}--{name}/snapshots/{rev}/config.json` for each rev, with the given ages.
fn fake_repo(cache: &Path, repo: &str, revs: &[(&str, u64)]) -> PathBuf {
    let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    for (rev, age_s) in revs {
        let snap = dir.join("snapshots").join(rev);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        let t = SystemTime::now() - Duration::from_secs(*age_s);
        std::fs::File::open(&snap).unwrap().set_modified(t).unwrap();
    }
    dir
}

const OLD: &str = "1111111111111111111111111111111111111111";
const NEW: &str = "2222222222222222222222222222222222222222";

#[test]
fn refs_main_is_honoured_even_when_older() {
    let cache = tempfile::tempdir().unwrap();
    let repo = fake_repo(
        cache.path(),
        "Qwen/Qwen3.6-35B-A3B",
        &[(OLD, 500), (NEW, 10)],
    );
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), format!("{OLD}\n")).unwrap();
    let got = resolve_in_cache(cache.path(), "Qwen/Qwen3.6-35B-A3B", None).unwrap();
    assert_eq!(got, repo.join("snapshots").join(OLD));
    // A named ref or a commit directly.
    std::fs::write(repo.join("refs/v2"), NEW).unwrap();
    let got = resolve_in_cache(cache.path(), "Qwen/Qwen3.6-35B-A3B", Some("v2")).unwrap();
    assert_eq!(got, repo.join("snapshots").join(NEW));
    let got = resolve_in_cache(cache.path(), "Qwen/Qwen3.6-35B-A3B", Some(OLD)).unwrap();
    assert_eq!(got, repo.join("snapshots").join(OLD));
    let err = resolve_in_cache(cache.path(), "Qwen/Qwen3.6-35B-A3B", Some("nope"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("revision `nope`") && err.contains("refs"),
        "{err}"
    );
}

#[test]
fn without_refs_the_newest_snapshot_is_used() {
    let cache = tempfile::tempdir().unwrap();
    let repo = fake_repo(cache.path(), "org/model", &[(NEW, 10), (OLD, 500)]);
    let got = resolve_in_cache(cache.path(), "org/model", None).unwrap();
    assert_eq!(got, repo.join("snapshots").join(NEW));
}

#[test]
fn a_dangling_ref_or_an_empty_repo_is_an_error() {
    let cache = tempfile::tempdir().unwrap();
    let repo = fake_repo(cache.path(), "org/model", &[]);
    std::fs::create_dir_all(repo.join("snapshots")).unwrap();
    let err = resolve_in_cache(cache.path(), "org/model", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("holds no snapshot"), "{err}");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), NEW).unwrap();
    let err = resolve_in_cache(cache.path(), "org/model", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains(NEW) && err.contains("does not exist"), "{err}");
}

#[test]
fn resolution_uses_hf_hub_cache_then_hf_home_then_home() {
    let root = tempfile::tempdir().unwrap();
    let hub_cache = root.path().join("hubcache");
    let hf_home = root.path().join("hfhome");
    let home = root.path().join("home");
    let a = fake_repo(&hub_cache, "org/a", &[(OLD, 1)]);
    let b = fake_repo(&hf_home.join("hub"), "org/b", &[(OLD, 1)]);
    let c = fake_repo(&home.join(".cache/huggingface/hub"), "org/c", &[(OLD, 1)]);
    let full = || {
        env(vec![
            ("HF_HUB_CACHE", hub_cache.display().to_string()),
            ("HF_HOME", hf_home.display().to_string()),
            ("HOME", home.display().to_string()),
        ])
    };
    assert_eq!(
        resolve_model_with("org/a", full()).unwrap(),
        a.join("snapshots").join(OLD)
    );
    // HF_HUB_CACHE set: HF_HOME is not consulted.
    assert!(resolve_model_with("org/b", full()).is_err());
    let no_hub = env(vec![
        ("HF_HOME", hf_home.display().to_string()),
        ("HOME", home.display().to_string()),
    ]);
    assert_eq!(
        resolve_model_with("org/b", no_hub).unwrap(),
        b.join("snapshots").join(OLD)
    );
    let only_home = env(vec![("HOME", home.display().to_string())]);
    assert_eq!(
        resolve_model_with("org/c", &only_home).unwrap(),
        c.join("snapshots").join(OLD)
    );
    // An explicit revision that is neither a ref nor a snapshot is an error.
    let err = resolve_model_with("org/c@v9", &only_home)
        .unwrap_err()
        .to_string();
    assert!(err.contains("revision `v9`"), "{err}");
}

#[test]
fn errors_say_where_they_looked() {
    let root = tempfile::tempdir().unwrap();
    let e = || env(vec![("HF_HUB_CACHE", root.path().display().to_string())]);
    let err = resolve_model_with("Qwen/Missing-Model", e())
        .unwrap_err()
        .to_string();
    assert!(err.contains("models--Qwen--Missing-Model"), "{err}");
    assert!(err.contains(&root.path().display().to_string()), "{err}");
    assert!(err.contains("HF_HUB_CACHE"), "{err}");
    // Not a repo id and not a directory.
    let err = resolve_model_with("/no/such/dir", e())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("/no/such/dir") && err.contains("no such directory"),
        "{err}"
    );
    // A file is not a checkpoint directory.
    let f = root.path().join("file.txt");
    std::fs::write(&f, "x").unwrap();
    let err = resolve_model_with(f.to_str().unwrap(), e())
        .unwrap_err()
        .to_string();
    assert!(err.contains("is a file"), "{err}");
}

#[test]
fn an_existing_directory_wins_over_the_cache() {
    let root = tempfile::tempdir().unwrap();
    let local = root.path().join("org").join("model");
    std::fs::create_dir_all(&local).unwrap();
    let got = resolve_model_with(
        local.to_str().unwrap(),
        env(vec![("HF_HUB_CACHE", "/nonexistent".into())]),
    )
    .unwrap();
    assert_eq!(got, local);
}
