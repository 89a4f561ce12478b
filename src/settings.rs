//! Every `KESTREL_*` environment setting, read in this one place (docs/ARCHITECTURE.md,
//! "Settings"). There are no others: a kernel variant is compared with history by building the
//! older commit (`scripts/gpu_check.sh abbin`), not by a switch.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The environment's settings, read once per process ([`Settings::get`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// `KESTREL_CACHE_DIR`: where compiled kernels are cached (`DIR/kernels`; default
    /// `$XDG_CACHE_HOME/kestrel/kernels` or `~/.cache/kestrel/kernels`).
    pub cache_dir: Option<PathBuf>,
    /// `KESTREL_PROFILE=1`: every GPU op timed by a pair of events (`kestrel bench` prints the
    /// table; it slows everything, so its timings are not the engine's).
    pub profile: bool,
    /// `KESTREL_TRACE=1`: the kernels compiled with the decode timeline's and the GDN state
    /// pass's clock stamps (`kestrel bench` with `KESTREL_TRACE_OUT`, GPU test
    /// `gdn_chunk_state_phases`).
    pub trace: bool,
    /// `KESTREL_TRACE_OUT=PREFIX`: `kestrel bench` writes each context's decode timeline to
    /// `PREFIX-CONTEXT.csv` (with `KESTREL_TRACE=1`).
    pub trace_out: Option<String>,
    /// Test oracle `KESTREL_DECODE=unfused`: one-token steps take the general (prefill) path
    /// instead of the fused decode kernels and their CUDA graph.
    pub unfused_decode: bool,
    /// Test oracle `KESTREL_GDN=recurrent`: prefill runs the GDN through the sequential
    /// kernels instead of the chunked ones.
    pub recurrent_gdn: bool,
    /// Test oracle `KESTREL_HOST_SAMPLING` (any value): greedy decoding copies every step's
    /// logits to the host and picks there, instead of the device argmax.
    pub host_sampling: bool,
    /// `KESTREL_COMMIT`: the commit `kestrel bench` records in its JSON.
    pub commit: Option<String>,
    /// User setting `KESTREL_API_KEY`: `kestrel serve`'s API key where neither `--api-key`
    /// nor `--api-key-file` is given (trimmed; empty means none).
    pub api_key: Option<String>,
}

impl Settings {
    /// The settings from a variable lookup (`std::env::var` in the product, a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let is = |name: &str, value: &str| get(name).is_some_and(|v| v == value);
        Settings {
            cache_dir: get("KESTREL_CACHE_DIR").map(PathBuf::from),
            profile: get("KESTREL_PROFILE").is_some_and(|v| v != "0"),
            trace: get("KESTREL_TRACE").is_some_and(|v| v != "0"),
            trace_out: get("KESTREL_TRACE_OUT"),
            unfused_decode: is("KESTREL_DECODE", "unfused"),
            recurrent_gdn: is("KESTREL_GDN", "recurrent"),
            host_sampling: get("KESTREL_HOST_SAMPLING").is_some(),
            commit: get("KESTREL_COMMIT"),
            api_key: get("KESTREL_API_KEY")
                .map(|k| k.trim().to_string())
                .filter(|k| !k.is_empty()),
        }
    }

    /// This process's settings, read from the environment on first use.
    pub fn get() -> &'static Settings {
        static SETTINGS: OnceLock<Settings> = OnceLock::new();
        SETTINGS.get_or_init(|| Settings::from_lookup(|name| std::env::var(name).ok()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Settings {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn unset_is_the_product_path() {
        assert_eq!(with(&[]), Settings::default());
    }

    #[test]
    fn each_variable_sets_its_field_only() {
        assert_eq!(
            with(&[("KESTREL_DECODE", "unfused")]),
            Settings {
                unfused_decode: true,
                ..Default::default()
            }
        );
        assert!(!with(&[("KESTREL_DECODE", "fused")]).unfused_decode);
        assert!(with(&[("KESTREL_GDN", "recurrent")]).recurrent_gdn);
        assert!(!with(&[("KESTREL_GDN", "chunked")]).recurrent_gdn);
        assert!(with(&[("KESTREL_PROFILE", "1")]).profile);
        assert!(!with(&[("KESTREL_PROFILE", "0")]).profile);
        assert!(with(&[("KESTREL_TRACE", "1")]).trace);
        assert!(with(&[("KESTREL_HOST_SAMPLING", "")]).host_sampling);
        let s = with(&[("KESTREL_CACHE_DIR", "/tmp/k"), ("KESTREL_COMMIT", "abc")]);
        assert_eq!(s.cache_dir, Some(PathBuf::from("/tmp/k")));
        assert_eq!(s.commit.as_deref(), Some("abc"));
        assert_eq!(
            with(&[("KESTREL_API_KEY", " k1 ")]).api_key.as_deref(),
            Some("k1")
        );
        assert_eq!(with(&[("KESTREL_API_KEY", "  ")]).api_key, None);
    }
}
