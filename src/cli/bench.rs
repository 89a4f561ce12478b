//! `kestrel bench`: the benchmark runners for each backend and the JSON report.

use super::PREFILL_CHUNKS;
use anyhow::{Context, Result};
use kestrel::config::TextConfig;
use kestrel::config::WeightFormat;
use kestrel::model::{CpuModel, Engine};
use kestrel::state::SequenceState;
use kestrel::synthetic;
use kestrel::tensor::DType;
use std::path::{Path, PathBuf};

struct CudaRunner<'a>(&'a kestrel::cuda::model::CudaModel, usize);

impl kestrel::bench::GreedyRunner for CudaRunner<'_> {
    type State = kestrel::cuda::model::CudaState;
    fn fresh(&self) -> Result<Self::State> {
        self.0.new_state_checked()
    }
    fn step(&self, state: &mut Self::State, tokens: &[u32]) -> Result<u32> {
        self.0.forward_greedy(state, tokens, self.1)
    }
}

/// The decode timeline of one step at `context` (after the prompt and 8 warm steps) into
/// `{prefix}-{context}.csv` (`KESTREL_TRACE_OUT`; needs the kernels compiled with
/// `KESTREL_TRACE=1`); scripts/decode_timeline.py reads it.
fn trace_decode(
    m: &kestrel::cuda::model::CudaModel,
    context: usize,
    vocab_limit: usize,
    prefix: &str,
) -> Result<()> {
    let mut st = m.new_state_checked()?;
    let mut next = m.forward_greedy(
        &mut st,
        &kestrel::bench::prompt(context, vocab_limit),
        vocab_limit,
    )?;
    for _ in 0..8 {
        next = m.forward_greedy(&mut st, &[next], vocab_limit)?;
    }
    let recs = m.trace_decode_step(&mut st, next, vocab_limit)?;
    if recs.is_empty() {
        anyhow::bail!(
            "KESTREL_TRACE_OUT: no timeline records; compile the kernels with KESTREL_TRACE=1"
        );
    }
    let path = format!("{prefix}-{context}.csv");
    let mut out =
        String::from("tag,grid,block,y,sm,start_ns,wait_ns,end_ns,ph0_ns,ph1_ns,ph2_ns\n");
    for r in &recs {
        out += &format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            r[0] >> 48,
            (r[0] >> 24) & 0xff_ffff,
            r[0] & 0xff_ffff,
            r[1] >> 32,
            r[1] & 0xffff_ffff,
            r[2],
            r[3],
            r[4],
            r[5],
            r[6],
            r[7]
        );
    }
    std::fs::write(&path, out).map_err(|e| anyhow::anyhow!("writing {path}: {e}"))?;
    eprintln!(
        "decode timeline at context {context}: {} block records -> {path}",
        recs.len()
    );
    Ok(())
}

struct CpuRunner<'a>(&'a CpuModel, usize);

impl kestrel::bench::GreedyRunner for CpuRunner<'_> {
    type State = SequenceState;
    fn fresh(&self) -> Result<Self::State> {
        self.0.new_state()
    }
    fn step(&self, state: &mut Self::State, tokens: &[u32]) -> Result<u32> {
        let mut logits = Vec::new();
        for piece in tokens.chunks(4096) {
            logits = self.0.forward(state, piece, kestrel::model::Logits::Last)?;
        }
        Ok(kestrel::ops::argmax(&logits[..self.1.min(logits.len())]).unwrap_or(0) as u32)
    }
}

fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[allow(clippy::too_many_arguments)]
pub(super) fn bench_cmd(
    synthetic: Option<String>,
    model: Option<PathBuf>,
    device: String,
    contexts: String,
    max_chunk: Option<usize>,
    json: Option<PathBuf>,
    concurrency: Option<String>,
    sampling: bool,
    speculative: Option<(usize, bool)>,
) -> Result<()> {
    let contexts = positive_list("--contexts", &contexts)?;
    if speculative.is_some() && device != "cpu" {
        anyhow::bail!(
            "MTP speculation on the GPU is not built yet (issue 40): bench --speculative mtp runs with --device cpu"
        );
    }
    let streams = concurrency
        .as_deref()
        .map(|c| positive_list("--concurrency", c))
        .transpose()?;
    let max_ctx = *contexts.iter().max().unwrap();
    let (cfg, host, weights_label) = match (&synthetic, &model) {
        (Some(s), None) => {
            let cfg = match s.as_str() {
                "full" | "full-fp8" | "full-int4" => TextConfig::qwen36_35b_a3b(),
                "demo" => synthetic::demo_config(),
                other => {
                    anyhow::bail!(
                        "--synthetic must be `full`, `full-fp8`, `full-int4` or `demo`, not {other:?}"
                    )
                }
            };
            eprintln!(
                "kestrel bench: SYNTHETIC weights (seeded random, {} shape): these numbers measure speed only, never output quality",
                match s.as_str() {
                    "full" => "exact 40-layer Qwen3.6-35B-A3B, bf16",
                    "full-fp8" => "exact 40-layer Qwen3.6-35B-A3B, the official FP8 layout",
                    "full-int4" => {
                        "exact 40-layer Qwen3.6-35B-A3B, affine 4-bit group 64 (MLX's layout)"
                    }
                    _ => "demo",
                }
            );
            (cfg, None, format!("synthetic-{s}"))
        }
        (None, Some(dir)) => {
            let mut m = CpuModel::load(dir)?;
            if speculative.is_some() {
                let ck = kestrel::weights::Checkpoint::open(dir)?;
                m.attach_mtp(kestrel::weights::MtpWeights::from_checkpoint(
                    &ck, &m.config,
                )?);
            }
            (m.config.clone(), Some(m), dir.display().to_string())
        }
        _ => anyhow::bail!(
            "give exactly one of --synthetic full|full-fp8|full-int4|demo or --model DIR"
        ),
    };
    let format = match (&host, synthetic.as_deref()) {
        (Some(h), _) => h.weights.weight_format(),
        (None, Some(kind)) => WeightFormat::of_synthetic(kind).unwrap_or(WeightFormat::Bf16),
        (None, None) => WeightFormat::Bf16,
    };
    let vocab_limit = cfg
        .vocab_size
        .min(kestrel::tokenizer::special::FIRST_PADDING_ID as usize);
    let log = |s: &str| eprintln!("{s}");
    let mut prefill_chunk = None; // the GPU's, for the JSON
    let (rows, device_name, bw) = match device.as_str() {
        "cuda" => {
            let gpu = kestrel::cuda::Gpu::open(0)?;
            let bw = Bandwidth::measure(&gpu)?;
            eprintln!(
                "device: {} (read bandwidth {:.2} TB/s, the fractions' basis; copy {:.2} TB/s read+write)",
                gpu.name,
                bw.read.unwrap_or(0.0) / 1e12,
                bw.copy.unwrap_or(0.0) / 1e12
            );
            let max_seq = max_ctx + kestrel::bench::DECODE_STEPS + 8;
            let max_chunk = match max_chunk {
                Some(c) => c.max(1),
                None => kestrel::cuda::model::CudaModel::pick_chunk(
                    &gpu,
                    &cfg,
                    format,
                    max_seq,
                    &PREFILL_CHUNKS,
                )?,
            };
            eprintln!("prefill chunk: {max_chunk} tokens");
            prefill_chunk = Some(max_chunk);
            let t0 = std::time::Instant::now();
            let m = match &host {
                Some(h) => kestrel::cuda::model::CudaModel::from_weights(
                    gpu.clone(),
                    cfg.clone(),
                    &h.weights,
                    max_seq,
                    max_chunk,
                )?,
                None => kestrel::cuda::model::CudaModel::synthetic(
                    gpu.clone(),
                    cfg.clone(),
                    format,
                    7,
                    max_seq,
                    max_chunk,
                )?,
            };
            eprintln!(
                "weights ready in {:.1} s ({:.2} GB on the GPU, {format:?})",
                t0.elapsed().as_secs_f64(),
                m.weight_bytes as f64 / 1e9
            );
            if let Some(streams) = &streams {
                let rows = concurrency_rows(
                    &m,
                    &cfg,
                    format,
                    streams,
                    &contexts,
                    vocab_limit,
                    sampling,
                    bw.read,
                )?;
                print_profile(&gpu);
                return write_concurrency_json(
                    json.as_deref(),
                    &rows,
                    &gpu.name,
                    &weights_label,
                    bw,
                );
            }
            let runner = CudaRunner(&m, vocab_limit);
            let mut rows = Vec::new();
            for &c in &contexts {
                rows.push(kestrel::bench::bench_context(
                    &runner,
                    &cfg,
                    format,
                    c,
                    vocab_limit,
                    bw.read,
                    log,
                )?);
                // Written after every context, so a run cut short keeps what it measured.
                write_bench_json(
                    json.as_deref(),
                    &rows,
                    &gpu.name,
                    &weights_label,
                    bw,
                    prefill_chunk,
                )?;
                if let Some(prefix) = &kestrel::settings::Settings::get().trace_out {
                    trace_decode(&m, c, vocab_limit, prefix)?;
                }
            }
            print_profile(&gpu);
            (rows, gpu.name.clone(), bw)
        }
        "cpu" => {
            let m = match host {
                Some(h) => h,
                None => {
                    let mut w = synthetic::random_weights(&cfg, 7, DType::BF16);
                    if speculative.is_some() {
                        w.mtp = Some(synthetic::random_mtp_weights(&cfg, 7, DType::BF16));
                    }
                    CpuModel::new(cfg.clone(), w)
                }
            };
            if let Some((k, forced)) = speculative {
                return spec_rows(
                    &m,
                    &contexts,
                    vocab_limit,
                    k,
                    forced,
                    json.as_deref(),
                    &weights_label,
                );
            }
            if let Some(streams) = &streams {
                let rows = concurrency_rows(
                    &m,
                    &cfg,
                    format,
                    streams,
                    &contexts,
                    vocab_limit,
                    sampling,
                    None,
                )?;
                return write_concurrency_json(
                    json.as_deref(),
                    &rows,
                    "cpu",
                    &weights_label,
                    Bandwidth::default(),
                );
            }
            let runner = CpuRunner(&m, vocab_limit);
            let mut rows = Vec::new();
            for &c in &contexts {
                rows.push(kestrel::bench::bench_context(
                    &runner,
                    &cfg,
                    format,
                    c,
                    vocab_limit,
                    None,
                    log,
                )?);
            }
            (rows, "cpu".to_string(), Bandwidth::default())
        }
        other => anyhow::bail!("--device must be cpu or cuda, not {other:?}"),
    };
    println!(
        "{:>8} {:>14} {:>10} {:>13} {:>10} {:>9}",
        "context", "prefill tok/s", "ttft ms", "decode tok/s", "ms/token", "bw frac"
    );
    for r in &rows {
        println!(
            "{:>8} {:>14.0} {:>10.1} {:>13.1} {:>10.3} {:>9}",
            r.context,
            r.prefill_tok_s,
            r.ttft_ms,
            r.decode_tok_s,
            r.decode_ms_per_token,
            frac(r.decode_bandwidth_fraction)
        );
    }
    write_bench_json(
        json.as_deref(),
        &rows,
        &device_name,
        &weights_label,
        bw,
        prefill_chunk,
    )?;
    Ok(())
}

/// `bench --speculative mtp`: a [`kestrel::bench::SpecRow`] per context, printed and written.
fn spec_rows(
    m: &CpuModel,
    contexts: &[usize],
    vocab_limit: usize,
    k: usize,
    forced: bool,
    json: Option<&Path>,
    weights: &str,
) -> Result<()> {
    let mut rows = Vec::new();
    for &c in contexts {
        rows.push(kestrel::bench::bench_speculative(
            m,
            c,
            vocab_limit,
            k,
            forced,
            |s| eprintln!("{s}"),
        )?);
    }
    println!(
        "{:>8} {:>3} {:>7} {:>12} {:>12} {:>8} {:>10} {:>11}  verify/1-token and modelled speedup at 0.8, K=1..4",
        "context",
        "K",
        "forced",
        "plain tok/s",
        "spec tok/s",
        "speedup",
        "acceptance",
        "tokens/step"
    );
    for r in &rows {
        let v: Vec<String> = r
            .verify
            .iter()
            .map(|v| format!("{:.2}x/{:.2}x", v.vs_one_token, v.modelled_speedup_at_0_8))
            .collect();
        println!(
            "{:>8} {:>3} {:>7} {:>12.1} {:>12.1} {:>8.2} {:>10.3} {:>11.2}  {}",
            r.context,
            r.draft_tokens,
            r.forced,
            r.plain_decode_tok_s,
            r.spec_decode_tok_s,
            r.speedup,
            r.acceptance,
            r.tokens_per_step,
            v.join(" ")
        );
    }
    write_report(
        json,
        serde_json::json!({
            "device": "cpu",
            "weights": weights,
            "contract": "batch 1, greedy, the contract prompt of `context` tokens, 64 decode tokens plain and MTP-speculative (checked token-identical); `speedup` is measured end to end; `verify` is the K+1-token verification step against a one-token step (median of 3) and the speedup modelled from those costs at a per-draft acceptance of 0.8; random weights accept ~0 drafts, `forced` replaces the drafts by the target's own tokens (the best case)",
            "rows": rows,
        }),
    )
}

/// With `KESTREL_PROFILE=1`: the GPU time per op over the whole run.
fn print_profile(gpu: &kestrel::cuda::Gpu) {
    let prof = gpu.take_profile();
    if prof.is_empty() {
        return;
    }
    let total: f64 = prof.iter().map(|p| p.seconds).sum();
    eprintln!("profile (GPU time per op and grid, CUDA events; all contexts, all rounds):");
    for p in prof.iter().take(45) {
        eprintln!(
            "  {:<32} {:>8} calls {:>10.3} ms {:>6.1}%  {:>8.1} us/call (min {:.1}, max {:.1})",
            p.op,
            p.calls,
            p.seconds * 1e3,
            100.0 * p.seconds / total,
            p.seconds * 1e6 / p.calls as f64,
            p.min * 1e6,
            p.max * 1e6
        );
    }
}

/// A comma-separated list of positive whole numbers (`flag` names it in errors).
fn positive_list(flag: &str, s: &str) -> Result<Vec<usize>> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| anyhow::anyhow!("{flag}: {x:?} is not a whole number"))
        })
        .collect::<Result<_>>()?;
    if v.is_empty() || v.contains(&0) {
        anyhow::bail!("{flag} needs positive numbers");
    }
    Ok(v)
}

/// The concurrency benchmark at every (context, streams), printed as a table.
#[allow(clippy::too_many_arguments)]
fn concurrency_rows<E: Engine>(
    m: &E,
    cfg: &TextConfig,
    format: WeightFormat,
    streams: &[usize],
    contexts: &[usize],
    vocab_limit: usize,
    sampling: bool,
    read_bw: Option<f64>,
) -> Result<Vec<kestrel::bench::ConcurrencyRow>> {
    let mut rows = Vec::new();
    for &c in contexts {
        for &n in streams {
            rows.push(kestrel::bench::bench_concurrency(
                m,
                cfg,
                format,
                n,
                c,
                vocab_limit,
                sampling,
                read_bw,
                |s| eprintln!("{s}"),
            )?);
        }
    }
    println!(
        "{:>8} {:>8} {:>13} {:>15} {:>9} {:>9} {:>9}",
        "streams", "context", "decode tok/s", "per stream", "ms/step", "GB/step", "bw frac"
    );
    for r in &rows {
        println!(
            "{:>8} {:>8} {:>13.1} {:>15.1} {:>9.3} {:>9.2} {:>9}",
            r.streams,
            r.context,
            r.decode_tok_s,
            r.per_stream_tok_s,
            r.step_ms,
            r.bytes_per_step / 1e9,
            frac(r.bandwidth_fraction)
        );
    }
    Ok(rows)
}

fn write_concurrency_json(
    path: Option<&Path>,
    rows: &[kestrel::bench::ConcurrencyRow],
    device: &str,
    weights: &str,
    bw: Bandwidth,
) -> Result<()> {
    write_report(
        path,
        bw.with(serde_json::json!({
            "device": device,
            "weights": weights,
            "contract": "N streams, each its own contract prompt (offset by the stream index) of `context` tokens, greedy (rows with `sampling`: temperature 1, top-k 20, top-p 0.95, drawn on the device), 4 warm-up then 64 measured batched decode steps, median of 2 rounds",
            "rows": rows,
        })),
    )
}

/// A bench report: the command, commit and date, then `fields` (an object).
fn write_report(path: Option<&Path>, fields: serde_json::Value) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let mut report = serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": kestrel::settings::Settings::get().commit.as_deref().unwrap_or("unknown"),
        "date": utc_date(),
    });
    if let (Some(r), serde_json::Value::Object(f)) = (report.as_object_mut(), fields) {
        r.extend(f);
    }
    std::fs::write(path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

fn write_bench_json(
    path: Option<&Path>,
    rows: &[kestrel::bench::BenchRow],
    device: &str,
    weights: &str,
    bw: Bandwidth,
    prefill_chunk: Option<usize>,
) -> Result<()> {
    write_report(
        path,
        bw.with(serde_json::json!({
            "device": device,
            "weights": weights,
            "prefill_chunk": prefill_chunk,
            "contract": "batch 1, greedy, prompt[i] = ((i*2654435761) mod 2^32) mod vocab, exact-shape warm-up, TTFT prefill, 64 decode steps, median of 2 rounds",
            "rows": rows,
        })),
    )
}

/// The bandwidths a GPU bench measures once, before the weights load. Every fraction (batch 1
/// and concurrency) is of `read`: the read-only streaming probe (`read_probe`, 2 GiB of 4 KiB
/// rows read whole, a persistent block an SM, nothing written), the kind of traffic a decode
/// step's weight reads are. `copy` (a device-to-device copy, bytes read + written over the
/// time) is reported beside it only: the tables up to issue 43 divided by it.
#[derive(Clone, Copy, Debug, Default)]
struct Bandwidth {
    read: Option<f64>,
    copy: Option<f64>,
}

impl Bandwidth {
    fn measure(gpu: &kestrel::cuda::Gpu) -> Result<Self> {
        Ok(Bandwidth {
            read: Some(gpu.measure_weight_stream(2048, 256)?),
            copy: Some(gpu.measure_copy_bandwidth(4 << 30)?),
        })
    }

    /// `fields` with the bandwidths and the fractions' basis added.
    fn with(self, mut fields: serde_json::Value) -> serde_json::Value {
        let basis = if self.read.is_some() {
            "read: each fraction is bytes a step / step time / read_bandwidth_bytes_per_s (the read-only streaming probe read_probe: 2 GiB of 4 KiB rows read whole, a persistent block an SM, nothing written); copy_bandwidth_bytes_per_s (device-to-device copy, read + write) is reported only"
        } else {
            "none: no bandwidth is measured on this device, the fractions are null"
        };
        if let Some(f) = fields.as_object_mut() {
            f.insert("bandwidth_basis".into(), basis.into());
            f.insert("read_bandwidth_bytes_per_s".into(), self.read.into());
            f.insert("copy_bandwidth_bytes_per_s".into(), self.copy.into());
        }
        fields
    }
}

/// A fraction for the tables, `-` where none was measured.
fn frac(f: Option<f64>) -> String {
    f.map_or_else(|| "-".into(), |f| format!("{f:.3}"))
}
