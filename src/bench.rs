//! `kestrel bench`: Lily's public measurement contract. Batch 1, greedy; the prompt token at
//! position i is `((i * 2654435761) mod 2^32) mod vocab`; an exact-shape warm-up, then one
//! measured TTFT-style prefill and exactly 64 measured decode steps; median of 2 rounds; the
//! FNV-1a digest of the 64 generated ids must repeat across rounds.

use crate::config::{TextConfig, WeightFormat};
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
    /// Achieved bytes/s over the measured read-only streaming bandwidth (`read_bw` of
    /// [`bench_context`]: `Gpu::measure_weight_stream`, what a decode step's weight reads
    /// can reach); `None` where none was measured (the CPU).
    pub decode_bandwidth_fraction: Option<f64>,
    pub digest: String,
}

/// Bytes one batch-1 decode step must move at `context` tokens of context, weights in
/// `format`.
pub fn decode_bytes(cfg: &TextConfig, format: WeightFormat, context: usize) -> f64 {
    let (dense, expert) = cfg.step_weight_bytes(format);
    let routed = (cfg.num_layers * cfg.experts_per_token) as f64 * expert;
    let weights = dense + routed + cfg.hidden_size as f64 * 2.0; // + one embedding row
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

/// Bytes over seconds over the bandwidth `bw` (bytes/s), where one was measured.
fn fraction(bytes: f64, secs: f64, bw: Option<f64>) -> Option<f64> {
    bw.filter(|&b| b > 0.0).map(|b| bytes / secs / b)
}

/// Runs the contract at one context length. `read_bw` is the measured read-only streaming
/// bandwidth in bytes/s (`None`: no fraction).
#[allow(clippy::too_many_arguments)]
pub fn bench_context<R: GreedyRunner>(
    runner: &R,
    cfg: &TextConfig,
    format: WeightFormat,
    context: usize,
    vocab_limit: usize,
    read_bw: Option<f64>,
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
    let bytes = decode_bytes(cfg, format, context);
    Ok(BenchRow {
        context,
        prefill_tok_s: context as f64 / ttft,
        ttft_ms: ttft * 1e3,
        decode_tok_s: DECODE_STEPS as f64 / dec,
        decode_ms_per_token: per_token * 1e3,
        decode_bytes_per_step: bytes,
        decode_bandwidth_fraction: fraction(bytes, per_token, read_bw),
        digest: format!("{:016x}", digests[0]),
    })
}

/// One row of the concurrency benchmark: `streams` sequences at `context` tokens each, decoded
/// together (one batched step a token of every stream).
#[derive(Clone, Debug, Serialize)]
pub struct ConcurrencyRow {
    pub streams: usize,
    pub context: usize,
    /// Tokens a second over all streams.
    pub decode_tok_s: f64,
    /// Tokens a second each stream sees.
    pub per_stream_tok_s: f64,
    pub step_ms: f64,
    /// Bytes one step must read: the dense weights once, each expert the batch picks once
    /// (expected number under uniform routing, see [`expected_experts`]), every stream's
    /// GDN state (read + write) and KV.
    pub bytes_per_step: f64,
    pub expected_experts_per_layer: f64,
    /// Achieved bytes/s over the read bandwidth given (`read_bw`); `None` without one (the
    /// CPU).
    pub bandwidth_fraction: Option<f64>,
    /// Whether every stream sampled (temperature 1, top-k 20, top-p 0.95) instead of greedy.
    pub sampling: bool,
    pub digest: String,
}

/// Experts of `e` that `n` tokens each choosing `k` touch, expected under uniform routing
/// (the synthetic weights' near-uniform router): e (1 - (1 - k/e)^n).
pub fn expected_experts(e: usize, k: usize, n: usize) -> f64 {
    e as f64 * (1.0 - (1.0 - k as f64 / e as f64).powi(n as i32))
}

/// Bytes a batched decode step of `n` streams at `context` tokens must move, weights in
/// `format` (see [`ConcurrencyRow::bytes_per_step`]).
pub fn batch_decode_bytes(cfg: &TextConfig, format: WeightFormat, context: usize, n: usize) -> f64 {
    let (dense, expert) = cfg.step_weight_bytes(format);
    let touched = expected_experts(cfg.num_experts, cfg.experts_per_token, n);
    let experts = cfg.num_layers as f64 * touched * expert;
    let routed_one = (cfg.num_layers * cfg.experts_per_token) as f64 * expert;
    let per_stream = decode_bytes(cfg, format, context) - dense - routed_one;
    dense + experts + n as f64 * per_stream
}

/// The concurrency benchmark at one (streams, context): `streams` sequences, each prefilled
/// with its own prompt of `context` tokens (the contract's prompt, offset by the stream's
/// index), then 4 warm-up and [`DECODE_STEPS`] measured batched greedy steps (with
/// `sampling`: drawn at temperature 1, top-k 20, top-p 0.95, each stream its own seeded
/// sampler, through [`crate::model::Engine::forward_batch_draw`]), median of [`ROUNDS`]
/// rounds; the digest of all streams' ids must repeat across rounds.
#[allow(clippy::too_many_arguments)]
pub fn bench_concurrency<E: crate::model::Engine>(
    engine: &E,
    cfg: &TextConfig,
    format: WeightFormat,
    streams: usize,
    context: usize,
    vocab_limit: usize,
    sampling: bool,
    read_bw: Option<f64>,
    mut log: impl FnMut(&str),
) -> Result<ConcurrencyRow> {
    let params = crate::sampling::SamplingParams {
        temperature: if sampling { 1.0 } else { 0.0 },
        top_k: 20,
        top_p: 0.95,
        vocab_limit,
        ..Default::default()
    };
    let prompt_of = |j: usize| prompt(context + j, vocab_limit)[j..].to_vec();
    let run = |steps: usize| -> Result<(f64, Vec<u32>)> {
        let mut states = Vec::with_capacity(streams);
        let mut next = Vec::with_capacity(streams);
        for j in 0..streams {
            let mut st = engine.new_state()?;
            let logits = engine.forward(&mut st, &prompt_of(j), crate::model::Logits::Last)?;
            next.push(crate::sampling::greedy_id(&logits, vocab_limit));
            states.push(st);
        }
        let mut refs: Vec<&mut E::State> = states.iter_mut().collect();
        let mut ids = Vec::with_capacity(steps * streams);
        let mut samplers: Vec<crate::sampling::Sampler> = (0..streams)
            .map(|j| crate::sampling::Sampler::new(params.clone(), j as u64))
            .collect();
        let t0 = Instant::now();
        for _ in 0..steps {
            next = if sampling {
                let draws: Vec<crate::sampling::Draw> = samplers
                    .iter_mut()
                    .map(|s| crate::sampling::Draw {
                        u: s.uniform(),
                        params: &params,
                        history: &[],
                        top_logprobs: None,
                        want_logits: false,
                        mask: None,
                    })
                    .collect();
                let drawn = engine.forward_batch_draw(&mut refs, &next, &draws)?;
                drawn.into_iter().map(|d| d.id).collect()
            } else {
                engine.forward_batch_greedy(&mut refs, &next, vocab_limit)?
            };
            ids.extend(&next);
        }
        Ok((t0.elapsed().as_secs_f64(), ids))
    };
    run(4)?;
    let mut times = Vec::new();
    let mut digests = Vec::new();
    for round in 0..ROUNDS {
        let (t, ids) = run(DECODE_STEPS)?;
        log(&format!(
            "  {streams} streams{} at context {context} round {round}: {:.2} ms a step, {:.0} tok/s",
            if sampling { " sampling" } else { "" },
            t * 1e3 / DECODE_STEPS as f64,
            (streams * DECODE_STEPS) as f64 / t
        ));
        times.push(t);
        digests.push(fnv1a(&ids));
    }
    if digests.iter().any(|d| *d != digests[0]) {
        bail!(
            "the output differs between rounds at {streams} streams, context {context}: digests {digests:x?}"
        );
    }
    let t = median(times);
    let step = t / DECODE_STEPS as f64;
    let bytes = batch_decode_bytes(cfg, format, context, streams);
    Ok(ConcurrencyRow {
        streams,
        context,
        decode_tok_s: (streams * DECODE_STEPS) as f64 / t,
        per_stream_tok_s: DECODE_STEPS as f64 / t,
        step_ms: step * 1e3,
        bytes_per_step: bytes,
        expected_experts_per_layer: expected_experts(
            cfg.num_experts,
            cfg.experts_per_token,
            streams,
        ),
        bandwidth_fraction: fraction(bytes, step, read_bw),
        sampling,
        digest: format!("{:016x}", digests[0]),
    })
}

/// The verification step's cost at one draft length: `k + 1` tokens in one step against a
/// one-token step at the same context.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyCost {
    pub draft_tokens: usize,
    pub verify_ms: f64,
    /// `verify_ms` over a one-token step's.
    pub vs_one_token: f64,
    /// The head's drafting of `k` tokens, ms.
    pub draft_ms: f64,
    /// Modelled speedup over plain decoding at a per-draft acceptance of 0.8 (what is
    /// reported for this model's MTP at short context), from these measured costs: expected
    /// tokens a step `(1 - a^(k+1)) / (1 - a)` over `(draft + verify) / one-token step`.
    pub modelled_speedup_at_0_8: f64,
}

/// `kestrel bench --speculative mtp`: at one context, plain greedy decoding of 64 tokens and
/// speculative decoding of the same (checked token-identical), and the verification step's
/// cost at K = 1..4.
#[derive(Clone, Debug, Serialize)]
pub struct SpecRow {
    pub context: usize,
    pub draft_tokens: usize,
    /// Forced acceptance: the drafts were the target's own continuation (the best case).
    pub forced: bool,
    pub plain_decode_tok_s: f64,
    pub spec_decode_tok_s: f64,
    /// `spec_decode_tok_s / plain_decode_tok_s`, measured end to end.
    pub speedup: f64,
    pub acceptance: f64,
    pub tokens_per_step: f64,
    pub verify: Vec<VerifyCost>,
}

/// Expected tokens a verification step emits with `k` drafts each accepted with probability
/// `a` (independently): `1 + a + ... + a^k`.
pub fn expected_tokens(a: f64, k: usize) -> f64 {
    (0..=k).map(|i| a.powi(i as i32)).sum()
}

/// Runs [`SpecRow`] at `context` on `engine` (which must have its MTP head).
pub fn bench_speculative<E: crate::model::Engine>(
    engine: &E,
    context: usize,
    vocab_limit: usize,
    draft_tokens: usize,
    forced: bool,
    mut log: impl FnMut(&str),
) -> Result<SpecRow> {
    use crate::generate::{GenerateOptions, Speculative, generate};
    use crate::sampling::{Sampler, SamplingParams};
    use std::sync::atomic::AtomicBool;
    engine.mtp_check()?;
    let p = prompt(context, vocab_limit);
    let greedy = || {
        Sampler::new(
            SamplingParams {
                temperature: 0.0,
                vocab_limit,
                ..SamplingParams::default()
            },
            0,
        )
    };
    let opts = |speculative| GenerateOptions {
        max_tokens: DECODE_STEPS + 1,
        stop_ids: vec![],
        prefill_chunk: 4096,
        max_seq: context + DECODE_STEPS + 16,
        thinking: None,
        device_greedy: false,
        speculative,
    };
    let cancel = AtomicBool::new(false);
    let once = |o: &GenerateOptions| -> Result<crate::generate::GenerationStats> {
        let mut st = engine.new_state()?;
        let g = generate(
            engine,
            &mut st,
            &p,
            false,
            o,
            &mut greedy(),
            &cancel,
            None,
            |_, _| None,
        )?;
        Ok(g.stats)
    };
    let plain = once(&opts(None))?;
    let spec = Speculative {
        draft_tokens,
        forced: forced.then(|| std::sync::Arc::new(plain.generated.clone())),
    };
    let sp = once(&opts(Some(spec)))?;
    if sp.generated != plain.generated {
        bail!("speculative decoding gave other tokens than plain decoding at context {context}");
    }
    log(&format!(
        "  context {context} speculative K={draft_tokens}{}: plain {:.1} tok/s, speculative {:.1} tok/s, acceptance {:.3}, {:.2} tokens/step",
        if forced { " (forced acceptance)" } else { "" },
        plain.decode_tok_s(),
        sp.decode_tok_s(),
        sp.spec.acceptance(),
        sp.spec.tokens_per_step()
    ));
    // The step costs at this context: median of 3 of each, from the state after the prompt.
    let mut base = engine.new_state()?;
    let mut next = 0;
    for piece in p.chunks(4096) {
        let l = engine.forward(&mut base, piece, crate::model::Logits::Last)?;
        next = crate::sampling::greedy_id(&l, vocab_limit);
    }
    let time3 = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut t = Vec::new();
        for _ in 0..3 {
            let t0 = Instant::now();
            f()?;
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        Ok(median(t))
    };
    let one = time3(&mut || {
        let mut s = base.clone();
        engine.forward(&mut s, &[next], crate::model::Logits::Last)?;
        Ok(())
    })?;
    let mut verify = Vec::new();
    for k in 1..=4 {
        let tokens = vec![next; k + 1];
        let v = time3(&mut || {
            let mut s = base.clone();
            engine.spec_verify(&mut s, &tokens)?;
            Ok(())
        })?;
        let d = time3(&mut || {
            let mut s = base.clone();
            engine.mtp_draft(&mut s, next, k, &mut |l, _| {
                crate::sampling::greedy_id(l, vocab_limit)
            })?;
            Ok(())
        })?;
        verify.push(VerifyCost {
            draft_tokens: k,
            verify_ms: v,
            vs_one_token: v / one,
            draft_ms: d,
            modelled_speedup_at_0_8: expected_tokens(0.8, k) * one / (v + d),
        });
    }
    Ok(SpecRow {
        context,
        draft_tokens,
        forced,
        plain_decode_tok_s: plain.decode_tok_s(),
        spec_decode_tok_s: sp.decode_tok_s(),
        speedup: sp.decode_tok_s() / plain.decode_tok_s().max(1e-9),
        acceptance: sp.spec.acceptance(),
        tokens_per_step: sp.spec.tokens_per_step(),
        verify,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_a_step_is_the_geometric_sum() {
        assert!((expected_tokens(0.8, 2) - 2.44).abs() < 1e-12);
        assert_eq!(expected_tokens(0.0, 3), 1.0);
        assert_eq!(expected_tokens(1.0, 3), 4.0);
    }

    #[test]
    fn prompt_follows_the_contract() {
        let p = prompt(3, 248_320);
        assert_eq!(p[0], 0);
        assert_eq!(p[1], (2_654_435_761u64 % 248_320) as u32);
        assert_eq!(p[2], ((2 * 2_654_435_761u64) % (1 << 32) % 248_320) as u32);
    }

    #[test]
    fn batch_bytes_follow_the_experts_touched() {
        let c = TextConfig::qwen36_35b_a3b();
        // the counts under uniform routing: ~57 / 163 / 222 of 256
        for (n, want) in [(1, 8.0), (8, 57.3), (32, 163.3), (64, 222.4)] {
            let got = expected_experts(256, 8, n);
            assert!((got - want).abs() < 0.5, "{n}: {got}");
        }
        // batch 1 reads what the batch-1 contract counts
        let one = batch_decode_bytes(&c, WeightFormat::Bf16, 1024, 1);
        let single = decode_bytes(&c, WeightFormat::Bf16, 1024);
        assert!((one - single).abs() / single < 1e-9, "{one} vs {single}");
        // the bound at 4.2 TB/s (context 1,024 a stream) near the estimates: roughly
        // 1,700 / 2,600 / 3,700 tok/s at 8 / 32 / 64 streams
        for (n, want) in [(8, 1700.0), (32, 2600.0), (64, 3700.0)] {
            let bound = n as f64 * 4.2e12 / batch_decode_bytes(&c, WeightFormat::Bf16, 1024, n);
            assert!((bound / want - 1.0).abs() < 0.1, "{n}: {bound:.0} tok/s");
        }
    }

    #[test]
    fn fp8_steps_read_the_fp8_bytes() {
        let c = TextConfig::qwen36_35b_a3b();
        let (bf16, fp8) = (
            decode_bytes(&c, WeightFormat::Bf16, 0),
            decode_bytes(&c, WeightFormat::Fp8, 0),
        );
        // e4m3 projections and experts, bf16 lm_head (1 GB), router and GDN a/b: ~3.5 GB
        assert!((3.3e9..3.7e9).contains(&fp8), "{fp8}");
        assert!(fp8 < 0.62 * bf16, "{fp8} vs {bf16}");
        let (_, e8) = c.step_weight_bytes(WeightFormat::Fp8);
        let (_, e16) = c.step_weight_bytes(WeightFormat::Bf16);
        // an expert: its bytes halve, plus 1/32 KiB of scales a 16 KiB block
        assert!(
            (e8 / (e16 / 2.0) - 1.0 - 1.0 / 4096.0).abs() < 1e-6,
            "{e8} {e16}"
        );
    }

    #[test]
    fn full_size_decode_bytes_near_5_9_gb() {
        let b = decode_bytes(&TextConfig::qwen36_35b_a3b(), WeightFormat::Bf16, 0);
        assert!((5.9e9..6.1e9).contains(&b), "{b}");
    }
}
