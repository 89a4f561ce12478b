//! Helpers shared by the test files: the HF fixtures and error measures.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

fn config_text(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("config.json")).unwrap_or_default()
}

/// Whether a fixture is quantised in any format (its config has a `quantization_config`,
/// or mlx-lm's `quantization` block).
fn is_quantized(dir: &Path) -> bool {
    let c = config_text(dir);
    c.contains("\"quantization_config\"") || c.contains("\"quantization\"")
}

/// Whether a fixture is in the FP8 release's format.
fn is_fp8(dir: &Path) -> bool {
    is_quantized(dir) && config_text(dir).contains("\"fp8\"")
}

/// Whether a fixture is an mlx-lm checkpoint (its config has the `quantization` block).
fn is_mlx(dir: &Path) -> bool {
    config_text(dir).contains("\"quantization\"")
}

fn reference_dirs() -> (PathBuf, Vec<PathBuf>) {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    (root, dirs)
}

/// The FP8 HF fixtures (`tiny-official-fp8`): kept out of [`fixtures`] (the tests that run
/// both take them by name: the FP8 checks differ, e.g. no bf16 rounding of the weights).
pub fn fp8_fixtures() -> Vec<PathBuf> {
    let (root, dirs) = reference_dirs();
    let dirs: Vec<PathBuf> = dirs.into_iter().filter(|d| is_fp8(d)).collect();
    assert!(
        !dirs.is_empty(),
        "expected the FP8 fixture in {}",
        root.display()
    );
    dirs
}

/// The MLX affine 4-bit fixtures (`tiny-mlx-4bit`, converted by mlx-lm; its reference is
/// mlx-lm's): kept out of [`fixtures`] (the tests that run it take it by name).
pub fn mlx_fixtures() -> Vec<PathBuf> {
    let (root, dirs) = reference_dirs();
    let dirs: Vec<PathBuf> = dirs.into_iter().filter(|d| is_mlx(d)).collect();
    assert!(
        !dirs.is_empty(),
        "expected the MLX fixture in {}",
        root.display()
    );
    dirs
}

/// The unquantized HF fixture directories (those with a `reference.safetensors`): under the
/// crate the test was built in, or, where that path does not exist (a test executable carried
/// to the GPU machine from another checkout), under the working directory.
pub fn fixtures() -> Vec<PathBuf> {
    let (root, dirs) = reference_dirs();
    let mut dirs: Vec<PathBuf> = dirs.into_iter().filter(|d| !is_quantized(d)).collect();
    dirs.sort();
    assert!(
        dirs.len() >= 2,
        "expected the HF fixtures in {}",
        root.display()
    );
    dirs
}

pub fn f32_tensor(st: &safetensors::SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn id_tensor(st: &safetensors::SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::I64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// A fixture's transformers outputs (see tests/fixtures/README.md).
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    /// `[T, V]`
    pub prompt_logits: Vec<f32>,
    pub decode_ids: Vec<u32>,
    /// `[N, V]`
    pub decode_logits: Vec<f32>,
    pub vocab: usize,
}

pub fn read_reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    Reference {
        prompt_ids: id_tensor(&st, "prompt_ids"),
        prompt_logits: f32_tensor(&st, "prompt_logits"),
        decode_ids: id_tensor(&st, "decode_ids"),
        decode_logits: f32_tensor(&st, "decode_logits"),
        vocab: st.tensor("prompt_logits").unwrap().shape()[1],
    }
}

/// max |a - b| / max |b| (the "logit scale").
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    err / scale
}

/// ‖a − b‖₂ / ‖b‖₂.
pub fn norm_rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// The GPU (device 0) for a GPU test. [`gpu_main`] runs a GPU test only after its probe
/// opened one, so a failure here is the test's.
pub fn gpu() -> std::sync::Arc<kestrel::cuda::Gpu> {
    kestrel::cuda::Gpu::open(0).unwrap_or_else(|e| panic!("GPU present but unusable: {e:#}"))
}

/// Why a GPU test did not run without `--include-ignored` (or `--ignored`).
const NOT_ASKED: &str = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)";

/// The harness of the GPU test files (`harness = false` in Cargo.toml, via libtest-mimic):
/// runs `tests` (name, function) as libtest would, except that a test that cannot run is
/// reported ignored with the reason, never passed, and without a panic. Without
/// `--include-ignored` / `--ignored` each is ignored with [`NOT_ASKED`] (CI, a plain
/// `cargo test`); with one, device 0 is opened once first: where no usable GPU exists (no
/// driver, no device, not Hopper-class) each is ignored with the reason; a GPU that is present
/// but fails to open fails each test; otherwise they run. A test named in `needs` with an
/// environment variable (what it reads its input from) is ignored, saying so, where the
/// variable is unset.
pub fn gpu_main(
    tests: &[(&'static str, fn())],
    needs: &[(&str, &str, &str)],
) -> std::process::ExitCode {
    use libtest_mimic::{Arguments, Completion, Failed, Trial};
    let args = Arguments::from_args();
    let asked = args.ignored || args.include_ignored;
    // Ok(None): run; Ok(Some(reason)): ignored; Err: fails
    let verdict: Result<Option<String>, String> = if !asked {
        Ok(Some(NOT_ASKED.to_string()))
    } else if args.list {
        Ok(None)
    } else {
        match kestrel::cuda::Gpu::open(0) {
            Ok(_) => Ok(None),
            Err(e)
                if matches!(
                    kestrel::cuda::GpuError::of(&e),
                    Some(kestrel::cuda::GpuError::Unavailable(_))
                ) =>
            {
                Ok(Some(format!("no usable GPU: {e:#}")))
            }
            Err(e) => Err(format!("GPU present but unusable: {e:#}")),
        }
    };
    let trials = tests
        .iter()
        .map(|&(name, test)| {
            let mut verdict = verdict.clone();
            if let Ok(None) = verdict
                && let Some((_, var, why)) = needs
                    .iter()
                    .find(|n| n.0 == name && std::env::var_os(n.1).is_none())
            {
                verdict = Ok(Some(format!("{var} not set ({why})")));
            }
            // flagged ignored only where asked, so `--ignored` selects them and a plain run
            // reaches the runner, which reports the reason
            Trial::ignorable_test(name, move || match verdict {
                Ok(None) => {
                    test();
                    Ok(Completion::Completed)
                }
                Ok(Some(reason)) => Ok(Completion::ignored_with(reason)),
                Err(e) => Err(Failed::from(e)),
            })
            .with_ignored_flag(asked)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// Seeded numbers in [-1, 1).
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.next()).collect()
    }
}

/// A minimal HTTP/1.1 client for the server tests: (status, body), chunked bodies decoded.
pub fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120)))
        .unwrap();
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

/// The request's bytes: `Connection: close`, `headers`, a JSON body if given.
pub fn request(method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> String {
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

/// A chunked transfer's body.
pub fn dechunk(mut s: &str) -> String {
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
