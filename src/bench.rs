//! `kestrel bench`: Lily's public measurement contract. Batch 1, greedy; the prompt token at
//! position i is `((i * 2654435761) mod 2^32) mod vocab`; an exact-shape warm-up, then one
//! measured TTFT-style prefill and exactly 64 measured decode steps; median of 2 rounds; the
//! FNV-1a digest of the 64 generated ids must repeat across rounds.

use crate::config::TextConfig;
use anyhow::{Result, bail};
use serde::Serialize;
use std::time::Instant;

pub const DECODE_STEPS: usize = 64;
pub const ROUNDS: usize = 2;

/// The synthetic prompt of `len` tokens.
pub fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (((i as u64).wrapping_mul(2_654_435_761) % (1u64 << 32)) % vocab as u64) as u32)
        .collect()
}

pub fn fnv1a(ids: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in ids {
        for b in id.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// What a backend offers the bench: a fresh sequence, and greedy steps.
pub trait GreedyRunner {
    type State;
    fn fresh(&self) -> Result<Self::State>;
    /// Runs `tokens` and returns the greedy next id (only it leaves the device).
    fn step(&self, state: &mut Self::State, tokens: &[u32]) -> Result<u32>;
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub context: usize,
    pub prefill_tok_s: f64,
    pub ttft_ms: f64,
    pub decode_tok_s: f64,
    pub decode_ms_per_token: f64,
    /// Bytes a decode step must read (weights + GDN state r/w + KV at this context).
    pub decode_bytes_per_step: f64,
    /// Achieved bytes/s over the measured copy bandwidth.
    pub decode_bandwidth_fraction: f64,
    pub digest: String,
}

/// Bytes one batch-1 bf16 decode step must move at `context` tokens of context.
pub fn decode_bytes(cfg: &TextConfig, context: usize) -> f64 {
    let (_, active) = cfg.parameter_counts();
    let weights = active as f64 * 2.0 + cfg.hidden_size as f64 * 2.0; // + one embedding row
    let rec =
        cfg.num_gdn_layers() * cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4;
    let conv = cfg.num_gdn_layers() * (cfg.conv_kernel - 1) * cfg.gdn_conv_channels() * 4;
    let kv = cfg.kv_bytes_per_token(2) * context;
    weights + 2.0 * (rec + conv) as f64 + kv as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs the contract at one context length. `copy_bw` is bytes/s (read + write).
pub fn bench_context<R: GreedyRunner>(
    runner: &R,
    cfg: &TextConfig,
    context: usize,
    vocab_limit: usize,
    copy_bw: f64,
    mut log: impl FnMut(&str),
) -> Result<BenchRow> {
    let p = prompt(context, vocab_limit);
    let run = |measure: bool| -> Result<(f64, f64, Vec<u32>)> {
        let mut st = runner.fresh()?;
        let t0 = Instant::now();
        let mut next = runner.step(&mut st, &p)?;
        let ttft = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut ids = Vec::with_capacity(DECODE_STEPS);
        let steps = if measure { DECODE_STEPS } else { 4 };
        for _ in 0..steps {
            next = runner.step(&mut st, &[next])?;
            ids.push(next);
        }
        Ok((ttft, t1.elapsed().as_secs_f64(), ids))
    };
    // Exact-shape warm-up; its time to first token is what a prompt of a length not seen
    // before pays (plans and algorithm choices for new shapes), logged beside the rounds.
    let (cold, _, _) = run(false)?;
    log(&format!(
        "  context {context} warm-up: ttft {:.1} ms (the first prompt of this length)",
        cold * 1e3
    ));
    let mut ttfts = Vec::new();
    let mut decodes = Vec::new();
    let mut digests = Vec::new();
    for round in 0..ROUNDS {
        let (ttft, dec, ids) = run(true)?;
        log(&format!(
            "  context {context} round {round}: ttft {:.1} ms, decode {:.2} ms/token",
            ttft * 1e3,
            dec * 1e3 / DECODE_STEPS as f64
        ));
        ttfts.push(ttft);
        decodes.push(dec);
        digests.push(fnv1a(&ids));
    }
    if digests.iter().any(|d| *d != digests[0]) {
        bail!("greedy output differs between rounds at context {context}: digests {digests:x?}");
    }
    let ttft = median(ttfts);
    let dec = median(decodes);
    let per_token = dec / DECODE_STEPS as f64;
    let bytes = decode_bytes(cfg, context);
    Ok(BenchRow {
        context,
        prefill_tok_s: context as f64 / ttft,
        ttft_ms: ttft * 1e3,
        decode_tok_s: DECODE_STEPS as f64 / dec,
        decode_ms_per_token: per_token * 1e3,
        decode_bytes_per_step: bytes,
        decode_bandwidth_fraction: if copy_bw > 0.0 {
            bytes / per_token / copy_bw
        } else {
            0.0
        },
        digest: format!("{:016x}", digests[0]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_follows_the_contract() {
        let p = prompt(3, 248_320);
        assert_eq!(p[0], 0);
        assert_eq!(p[1], (2_654_435_761u64 % 248_320) as u32);
        assert_eq!(p[2], ((2 * 2_654_435_761u64) % (1 << 32) % 248_320) as u32);
    }

    #[test]
    fn full_size_decode_bytes_near_5_9_gb() {
        let b = decode_bytes(&TextConfig::qwen36_35b_a3b(), 0);
        assert!((5.9e9..6.1e9).contains(&b), "{b}");
    }
}
