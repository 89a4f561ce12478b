//! Model resolution: `--model` is a checkpoint directory or a Hugging Face repo id
//! (`Qwen/Qwen3.6-35B-A3B`, optionally `@revision`) looked up offline in the local Hugging Face
//! cache. Nothing here touches the network.
//!
//! Cache location, as `huggingface_hub` decides it: `HF_HUB_CACHE`, else the legacy
//! `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`. A repo lives in `models--{org}--{name}/`, with one directory
//! per downloaded commit under `snapshots/` and branch/tag names mapped to commits in `refs/`.

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

/// The hub cache directory given an environment lookup (`std::env::var` in practice).
pub fn cache_dir_from(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(d) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return Some(PathBuf::from(d));
    }
    if let Some(h) = var("HF_HOME") {
        return Some(PathBuf::from(h).join("hub"));
    }
    if let Some(x) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(x).join("huggingface").join("hub"));
    }
    var("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("huggingface")
            .join("hub")
    })
}

/// The hub cache directory of this process's environment.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var(k).ok())
}

/// Which environment variable (or default) chose the cache directory, for error messages.
fn cache_origin(env: impl Fn(&str) -> Option<String>) -> &'static str {
    let set = |k: &str| env(k).is_some_and(|v| !v.is_empty());
    if set("HF_HUB_CACHE") {
        "from HF_HUB_CACHE"
    } else if set("HUGGINGFACE_HUB_CACHE") {
        "from HUGGINGFACE_HUB_CACHE"
    } else if set("HF_HOME") {
        "from HF_HOME"
    } else if set("XDG_CACHE_HOME") {
        "from XDG_CACHE_HOME"
    } else {
        "the default; set HF_HUB_CACHE or HF_HOME to look elsewhere"
    }
}

/// `org/name` with the characters the Hub allows, optionally followed by `@revision`.
/// Returns `(repo_id, revision)`.
pub fn parse_repo_id(s: &str) -> Option<(&str, Option<&str>)> {
    let (repo, rev) = match s.split_once('@') {
        Some((r, v)) if !v.is_empty() && !v.contains(['/', '\\']) && v != "." && v != ".." => {
            (r, Some(v))
        }
        Some(_) => return None,
        None => (s, None),
    };
    let (org, name) = repo.split_once('/')?;
    let ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (ok(org) && ok(name)).then_some((repo, rev))
}

/// The snapshot directory of `repo_id` in the cache at `cache`: the commit `refs/{revision}`
/// names (`refs/main` by default) when that ref exists, a snapshot named `revision` itself,
/// else the most recently modified snapshot.
pub fn resolve_in_cache(cache: &Path, repo_id: &str, revision: Option<&str>) -> Result<PathBuf> {
    let folder = format!("models--{}", repo_id.replace('/', "--"));
    let repo_dir = cache.join(&folder);
    let snapshots = repo_dir.join("snapshots");
    if !snapshots.is_dir() {
        bail!(
            "`{repo_id}` is not in the Hugging Face cache ({} does not exist)",
            snapshots.display()
        );
    }
    let rev = revision.unwrap_or("main");
    let ref_file = repo_dir.join("refs").join(rev);
    if ref_file.is_file() {
        let commit = std::fs::read_to_string(&ref_file)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", ref_file.display()))?;
        let commit = commit.trim();
        let dir = snapshots.join(commit);
        if commit.is_empty() || commit.contains(['/', '\\']) || !dir.is_dir() {
            bail!(
                "{} names commit {commit:?}, but {} does not exist (incomplete download?)",
                ref_file.display(),
                dir.display()
            );
        }
        return Ok(dir);
    }
    if let Some(r) = revision {
        let dir = snapshots.join(r);
        if dir.is_dir() {
            return Ok(dir);
        }
        bail!(
            "revision `{r}` of `{repo_id}` is not in the cache: neither {} nor {} exists",
            ref_file.display(),
            dir.display()
        );
    }
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    let entries = std::fs::read_dir(&snapshots)
        .map_err(|e| anyhow::anyhow!("cannot list {}: {e}", snapshots.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let modified = entry
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        // Newest first; on equal times the larger name, so the choice is deterministic.
        if newest
            .as_ref()
            .is_none_or(|(t, p)| (modified, &path) > (*t, p))
        {
            newest = Some((modified, path));
        }
    }
    match newest {
        Some((_, dir)) => Ok(dir),
        None => bail!(
            "`{repo_id}` is in the Hugging Face cache but {} holds no snapshot",
            snapshots.display()
        ),
    }
}

/// Resolves `--model`: an existing directory as is; otherwise a repo id looked up in the
/// cache chosen by `env`.
pub fn resolve_model_with(spec: &str, env: impl Fn(&str) -> Option<String>) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        bail!(
            "--model {spec}: is a file; expected a checkpoint directory (with config.json and \
             *.safetensors) or a Hugging Face repo id"
        );
    }
    let Some((repo, rev)) = parse_repo_id(spec) else {
        bail!(
            "--model {spec}: no such directory (and it is not a Hugging Face repo id like \
             `Qwen/Qwen3.6-35B-A3B`)"
        );
    };
    let Some(cache) = cache_dir_from(&env) else {
        bail!(
            "--model {spec}: no such directory, and no Hugging Face cache to look in \
             (HF_HUB_CACHE, HF_HOME and HOME are all unset)"
        );
    };
    resolve_in_cache(&cache, repo, rev).map_err(|e| {
        anyhow::anyhow!(
            "--model {spec}: no such directory, and {e}. The cache is {} ({}). Kestrel never \
             downloads: fetch it first (`hf download {repo}`) or pass a checkpoint directory.",
            cache.display(),
            cache_origin(&env)
        )
    })
}

/// [`resolve_model_with`] in this process's environment.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    resolve_model_with(spec, |k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn cache_dir_precedence() {
        let all = [
            ("HF_HUB_CACHE", "/a"),
            ("HUGGINGFACE_HUB_CACHE", "/b"),
            ("HF_HOME", "/c"),
            ("XDG_CACHE_HOME", "/d"),
            ("HOME", "/e"),
        ];
        let dirs: Vec<PathBuf> = (0..all.len())
            .map(|i| cache_dir_from(env(&all[i..])).unwrap())
            .collect();
        assert_eq!(
            dirs,
            [
                "/a",
                "/b",
                "/c/hub",
                "/d/huggingface/hub",
                "/e/.cache/huggingface/hub"
            ]
            .map(PathBuf::from)
        );
        assert_eq!(cache_dir_from(env(&[("HF_HUB_CACHE", "")])), None);
    }

    #[test]
    fn repo_ids() {
        assert_eq!(
            parse_repo_id("Qwen/Qwen3.6-35B-A3B"),
            Some(("Qwen/Qwen3.6-35B-A3B", None))
        );
        assert_eq!(parse_repo_id("a/b@v1.0"), Some(("a/b", Some("v1.0"))));
        for bad in [
            "", "a", "a/b/c", "/abs", "./x", "a/", "a/b@", "a b/c", "a/b@x/y", "../x",
        ] {
            assert_eq!(parse_repo_id(bad), None, "{bad:?}");
        }
    }
}
