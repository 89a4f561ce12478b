//! MTP speculative decoding on the CPU backend (issue 40): the MTP head against an
//! independent reference, lossless greedy decoding (speculative = plain, token for token, with
//! both the accept and the reject path taken), the state a speculative reply leaves, the exact
//! distribution of speculative rejection sampling, and the errors of checkpoints without a
//! complete head.

use kestrel::generate::{
    GenerateOptions, GenerationStats, SpecStats, Speculative, StopReason, generate,
};
use kestrel::model::{CpuModel, Engine, Logits};
use kestrel::sampling::{Sampler, SamplingParams, distribution, draw, speculative_step};
use kestrel::synthetic::random_mtp_weights;
use kestrel::tensor::DType;
use kestrel::weights::{Checkpoint, MtpWeights};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
mod common;
use common::{f32_tensor, id_tensor, read_reference, rel_err};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The bf16 official fixture with its complete MTP head (written by make_fixtures.py).
fn bf16_with_mtp() -> CpuModel {
    with_mtp("tiny-official-bf16")
}

/// An official fixture (bf16 or FP8) with its complete MTP head.
fn with_mtp(name: &str) -> CpuModel {
    let dir = fixture(name);
    let mut m = CpuModel::load(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    m.attach_mtp(MtpWeights::from_checkpoint(&ck, &m.config).unwrap());
    m
}

/// A fixture whose checkpoint has no complete head, given a seeded random one.
fn with_random_head(name: &str) -> CpuModel {
    let mut m = CpuModel::load(&fixture(name)).unwrap();
    let head = random_mtp_weights(&m.config, 99, DType::BF16);
    m.attach_mtp(head);
    m
}

fn opts(max_tokens: usize, spec: Option<Speculative>) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        stop_ids: vec![],
        prefill_chunk: 64,
        max_seq: 2048,
        thinking: None,
        device_greedy: false,
        speculative: spec,
    }
}

fn spec(k: usize, forced: Option<Vec<u32>>) -> Option<Speculative> {
    Some(Speculative {
        draft_tokens: k,
        forced: forced.map(Arc::new),
    })
}

fn greedy() -> Sampler {
    Sampler::new(
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        0,
    )
}

/// Runs `prompt` from a fresh state; the stats and the state afterwards.
fn run(
    m: &CpuModel,
    prompt: &[u32],
    o: &GenerateOptions,
    sampler: &mut Sampler,
) -> (GenerationStats, kestrel::state::SequenceState) {
    let mut state = m.new_state().unwrap();
    let g = generate(
        m,
        &mut state,
        prompt,
        false,
        o,
        sampler,
        &AtomicBool::new(false),
        None,
        |_, _| None,
    )
    .unwrap();
    (g.stats, state)
}

fn prompt_of(m: &CpuModel, n: usize) -> Vec<u32> {
    let v = m.config.vocab_size as u32;
    (0..n as u32).map(|i| (i * 37 + 11) % v).collect()
}

#[test]
fn mtp_head_matches_the_independent_reference() {
    for name in ["tiny-official-bf16", "tiny-official-fp8"] {
        head_matches_reference(name);
    }
}

fn head_matches_reference(name: &str) {
    let dir = fixture(name);
    let m = with_mtp(name);
    let bytes = std::fs::read(dir.join("mtp_reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let hidden = f32_tensor(&st, "hidden");
    let tokens = id_tensor(&st, "tokens");
    let want = f32_tensor(&st, "logits");
    let v = m.config.vocab_size;

    // The head alone, on the reference's own hidden states.
    let got = m.mtp_logits(&hidden, &tokens).unwrap();
    let err = rel_err(&got, &want);
    assert!(
        err <= 1e-3,
        "{name}: MTP logits {err:.2e} of the logit scale from the reference"
    );
    let argmax = |l: &[f32]| kestrel::sampling::greedy_id(l, v);
    for (r, (a, b)) in got.chunks(v).zip(want.chunks(v)).enumerate() {
        assert_eq!(argmax(a), argmax(b), "{name} row {r}");
    }

    // Through the engine: the prompt's hidden states recorded by the main model's forward,
    // the first draft pass over all of them; its last row's logits are the reference's last.
    let r = read_reference(&dir);
    let mut state = m.new_state().unwrap();
    m.forward(&mut state, &r.prompt_ids, Logits::Last).unwrap();
    let mut seen = Vec::new();
    let d = m
        .mtp_draft(&mut state, *tokens.last().unwrap(), 1, &mut |l, _| {
            seen = l.to_vec();
            argmax(l)
        })
        .unwrap();
    let last = &want[want.len() - v..];
    let err = rel_err(&seen, last);
    assert!(
        err <= 1e-3,
        "{name}: draft logits {err:.2e} from the reference's last row"
    );
    eprintln!("{name}: MTP head within {err:.2e} of the reference");
    assert_eq!(d, vec![argmax(last)]);
}

/// Plain greedy decoding and speculative at K, the same `n` tokens; returns the speculative
/// counts.
fn same_greedy(m: &CpuModel, prompt: &[u32], n: usize, s: Option<Speculative>) -> SpecStats {
    let (plain, plain_state) = run(m, prompt, &opts(n, None), &mut greedy());
    let (sp, sp_state) = run(m, prompt, &opts(n, s.clone()), &mut greedy());
    assert_eq!(plain.generated.len(), n);
    assert_eq!(
        sp.generated, plain.generated,
        "speculative ({s:?}) != plain"
    );
    assert!(sp.spec.steps > 0);
    // The state holds the prompt and every generated id but the last in both runs, and
    // continues the same.
    assert_eq!(sp_state.len, plain_state.len);
    let (mut a, mut b) = (plain_state, sp_state);
    let last = *plain.generated.last().unwrap();
    let la = m.forward(&mut a, &[last], Logits::Last).unwrap();
    let lb = m.forward(&mut b, &[last], Logits::Last).unwrap();
    assert_eq!(la, lb, "the states differ after the reply");
    sp.spec
}

#[test]
fn greedy_speculation_is_lossless_for_256_tokens() {
    let models = [
        ("tiny-official-bf16 (its MTP head)", bf16_with_mtp()),
        (
            "tiny-flat-f32 (random head)",
            with_random_head("tiny-flat-f32"),
        ),
        (
            "tiny-official-fp8 (its FP8 MTP head)",
            with_mtp("tiny-official-fp8"),
        ),
    ];
    for (name, m) in &models {
        let prompt = prompt_of(m, 40);
        let (plain, _) = run(m, &prompt, &opts(256, None), &mut greedy());
        for k in 1..=3 {
            // The head's own drafts: random weights, so mostly rejected.
            let own = same_greedy(m, &prompt, 256, spec(k, None));
            // K drafts a step; fewer only where the token limit is near.
            assert!(
                own.drafted <= own.steps * k && own.drafted + k >= own.steps * k,
                "{name} K={k}"
            );
            // Forced drafts from the plain run with about one in four wrong (at hashed
            // positions, so no draft length aliases with them): accepts and rejects.
            let mut forced = plain.generated.clone();
            for (i, t) in forced.iter_mut().enumerate() {
                if ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 4 == 3 {
                    *t = (*t + 1) % m.config.vocab_size as u32;
                }
            }
            let mixed = same_greedy(m, &prompt, 256, spec(k, Some(forced)));
            assert!(
                mixed.acceptance() > 0.3 && mixed.acceptance() < 0.95,
                "{name} K={k}: {mixed:?} should both accept and reject"
            );
            // The target's own continuation: every draft accepted (verification's logits
            // are those of one-token steps, bit for bit).
            let all = same_greedy(m, &prompt, 256, spec(k, Some(plain.generated.clone())));
            assert_eq!(all.accepted, all.drafted, "{name} K={k}: {all:?}");
            assert!(
                all.tokens_per_step() > k as f64 + 0.5,
                "{name} K={k}: {all:?}"
            );
            eprintln!(
                "{name} K={k}: own head {:.3} accepted, {:.2} tokens/step; mixed {:.3}; forced {:.3}",
                own.acceptance(),
                own.tokens_per_step(),
                mixed.acceptance(),
                all.acceptance()
            );
        }
    }
}

#[test]
fn a_reply_ending_among_accepted_drafts_rolls_the_state_back() {
    let m = bf16_with_mtp();
    let prompt = prompt_of(&m, 20);
    let (plain, _) = run(&m, &prompt, &opts(64, None), &mut greedy());
    // Stop at an id first met at generated index 10: with forced drafts at K = 4 it arrives
    // as an accepted draft, with later drafts already verified in the state.
    let stop = plain.generated[10];
    let first = plain.generated.iter().position(|&t| t == stop).unwrap();
    let mut o = opts(64, None);
    o.stop_ids = vec![stop];
    let (p, ps) = run(&m, &prompt, &o, &mut greedy());
    o.speculative = spec(4, Some(plain.generated.clone()));
    let (s, ss) = run(&m, &prompt, &o, &mut greedy());
    assert_eq!(p.stop, StopReason::EndToken);
    assert_eq!(p.generated.len(), first + 1);
    assert_eq!(s.generated, p.generated);
    assert_eq!(s.stop, StopReason::EndToken);
    assert_eq!(ss.len, prompt.len() + s.fed_tokens().len());
    assert_eq!(ss.len, ps.len);
    // The MTP part is consistent too: drafting continues from the rolled-back state.
    let (mut a, mut b) = (ps, ss);
    let la = m.forward(&mut a, &[stop], Logits::All).unwrap();
    let lb = m.forward(&mut b, &[stop], Logits::All).unwrap();
    assert_eq!(la, lb);
    let mtp = b.mtp.as_ref().unwrap();
    let row = m.config.num_kv_heads * m.config.head_dim;
    assert_eq!(
        mtp.kv.positions(row) + mtp.hidden.len() / m.config.hidden_size,
        b.len
    );
    let mut pick = |l: &[f32], _: &[u32]| kestrel::sampling::greedy_id(l, l.len());
    assert_eq!(
        m.mtp_draft(&mut a, 5, 3, &mut pick).unwrap(),
        m.mtp_draft(&mut b, 5, 3, &mut pick).unwrap()
    );
}

/// A deterministic uniform stream for the statistical tests.
struct Uniform(u64);
impl Uniform {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let mut chi = 0.0;
    let mut df = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        if p > 0.0 {
            let e = n as f64 * p;
            chi += (c as f64 - e).powi(2) / e;
            df += 1;
        } else {
            assert_eq!(c, 0, "an id of probability 0 was drawn");
        }
    }
    (chi, df.max(2) - 1)
}

/// The chi-square value a correct sampler exceeds with probability about 1e-4 (Wilson-Hilferty).
fn chi_critical(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.719;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn rejection_sampling_gives_the_target_distribution() {
    let mut u = Uniform(7);
    let v = 10;
    for case in 0..6 {
        // Target p and draft q: random logits; some ids only one of them can pick.
        let logits = |u: &mut Uniform| -> Vec<f32> {
            (0..v).map(|_| (u.next() * 4.0 - 2.0) as f32).collect()
        };
        let params = SamplingParams {
            temperature: 0.8,
            top_k: if case % 2 == 0 { 6 } else { 0 },
            top_p: if case % 3 == 0 { 0.9 } else { 1.0 },
            vocab_limit: v,
            ..SamplingParams::default()
        };
        let (lp, lq) = (logits(&mut u), logits(&mut u));
        let p = distribution(&params, &lp, &[]);
        let q = distribution(&params, &lq, &[]);
        let n = 200_000;
        let mut counts = vec![0u64; v];
        // Negative controls, to show the test can fail: the drafts themselves, and a wrong
        // rule that resamples from p (not the residual) on rejection.
        let (mut drafts, mut wrong) = (vec![0u64; v], vec![0u64; v]);
        let mut accepted = 0;
        for _ in 0..n {
            let d = kestrel::sampling::sample_from(&q, u.next());
            let (t, ok) = speculative_step(&p, &q, d, u.next(), || u.next());
            counts[t as usize] += 1;
            accepted += ok as u64;
            drafts[d as usize] += 1;
            let w = if ok {
                t
            } else {
                kestrel::sampling::sample_from(&p, u.next())
            };
            wrong[w as usize] += 1;
        }
        let mut dense = vec![0.0; v];
        for &(id, pr) in &p {
            dense[id as usize] = pr;
        }
        let (chi, df) = chi_square(&counts, &dense);
        assert!(
            chi < chi_critical(df),
            "case {case}: chi-square {chi:.1} (df {df}) against the target; counts {counts:?}, p {dense:?}"
        );
        let chi_of = |c: &[u64]| -> f64 {
            let n: u64 = c.iter().sum();
            c.iter()
                .zip(&dense)
                .filter(|(_, p)| **p > 0.0)
                .map(|(&c, &p)| (c as f64 - n as f64 * p).powi(2) / (n as f64 * p))
                .sum()
        };
        assert!(
            chi_of(&wrong) > chi_critical(df),
            "case {case}: the wrong rule passed"
        );
        assert!(
            drafts.iter().zip(&dense).any(|(&c, &p)| p == 0.0 && c > 0)
                || chi_of(&drafts) > chi_critical(df),
            "case {case}: the drafts passed as the target"
        );
        // Both branches ran; the acceptance rate is sum min(p, q).
        let overlap: f64 = p
            .iter()
            .map(|&(id, pr)| pr.min(q.iter().find(|x| x.0 == id).map_or(0.0, |x| x.1)))
            .sum();
        let rate = accepted as f64 / n as f64;
        assert!(accepted > 0 && accepted < n, "case {case}");
        assert!(
            (rate - overlap).abs() < 0.01,
            "case {case}: {rate} vs {overlap}"
        );
    }
}

#[test]
fn the_written_out_distribution_is_what_draw_samples() {
    let mut u = Uniform(3);
    let v = 50;
    let history = [3u32, 3, 7, 12];
    for case in 0..8 {
        let logits: Vec<f32> = (0..v).map(|_| (u.next() * 6.0 - 3.0) as f32).collect();
        let params = SamplingParams {
            temperature: [0.7, 1.0, 1.3][case % 3],
            top_k: [0, 5, 20][case % 3],
            top_p: [1.0, 0.8][case % 2],
            min_p: [0.0, 0.0, 0.05, 0.2][case % 4],
            repetition_penalty: [1.0, 1.3][case % 2],
            presence_penalty: [0.0, 0.5][case / 4],
            frequency_penalty: [0.0, 0.2][case / 4],
            vocab_limit: v,
        };
        let dist = distribution(&params, &logits, &history);
        let mut want = vec![0.0; v];
        for &(id, pr) in &dist {
            want[id as usize] = pr;
        }
        // draw's inverse CDF over a fine grid of uniforms: each id's share is its probability.
        let n = 100_000;
        let mut got = vec![0.0; v];
        for i in 0..n {
            let id = draw(&params, &logits, &history, (i as f64 + 0.5) / n as f64);
            got[id as usize] += 1.0 / n as f64;
        }
        for id in 0..v {
            assert!(
                (got[id] - want[id]).abs() < 2e-4,
                "case {case} id {id}: draw {:.5}, distribution {:.5}",
                got[id],
                want[id]
            );
        }
    }
    // greedy: one id, the one draw picks
    let g = SamplingParams {
        temperature: 0.0,
        vocab_limit: 4,
        ..SamplingParams::default()
    };
    assert_eq!(
        distribution(&g, &[0.1, 2.0, 3.0, 0.5, 9.0], &[]),
        vec![(2, 1.0)]
    );
}

/// Sampled speculative decoding end to end on the fixture: the marginal distribution of the
/// second and third generated tokens over many seeds against the exact one computed from the
/// model (plain sampling's distribution), at K = 2 with the fixture's own (random) head.
#[test]
fn sampled_speculation_has_the_plain_samplers_distribution() {
    let m = bf16_with_mtp();
    let v = m.config.vocab_size;
    let params = SamplingParams {
        temperature: 1.5,
        top_k: 3,
        vocab_limit: v,
        ..SamplingParams::default()
    };
    let prompt = prompt_of(&m, 12);
    // Exact: p(t1) from the prompt, p(t2 | t1), p(t3 | t1 t2).
    let mut base = m.new_state().unwrap();
    let l0 = m.forward(&mut base, &prompt, Logits::Last).unwrap();
    let mut exact2 = vec![0.0; v];
    let mut exact3 = vec![0.0; v];
    for (t1, p1) in distribution(&params, &l0, &[]) {
        let mut s1 = base.clone();
        let l1 = m.forward(&mut s1, &[t1], Logits::Last).unwrap();
        for (t2, p2) in distribution(&params, &l1, &[t1]) {
            exact2[t2 as usize] += p1 * p2;
            let mut s2 = s1.clone();
            let l2 = m.forward(&mut s2, &[t2], Logits::Last).unwrap();
            for (t3, p3) in distribution(&params, &l2, &[t1, t2]) {
                exact3[t3 as usize] += p1 * p2 * p3;
            }
        }
    }
    // Two drafters: the fixture's random head (its drafts, sampled from its own distribution,
    // are all but never accepted: the residual path) and forced drafts of likely target ids
    // (accepted often: the accept path). Both must give the exact marginals.
    let top = |l: &[f32], h: &[u32]| distribution(&params, l, h)[0].0;
    let t1 = top(&l0, &[]);
    let mut s1 = base.clone();
    let t2 = top(&m.forward(&mut s1, &[t1], Logits::Last).unwrap(), &[t1]);
    let t3 = top(&m.forward(&mut s1, &[t2], Logits::Last).unwrap(), &[t1, t2]);
    // State after all but the last prompt token, so each run prefills one token.
    let mut pre = m.new_state().unwrap();
    m.forward(&mut pre, &prompt[..prompt.len() - 1], Logits::Last)
        .unwrap();
    let runs = 1500;
    for forced in [None, Some(vec![t1, t2, t3])] {
        let (mut c2, mut c3) = (vec![0u64; v], vec![0u64; v]);
        let mut total = SpecStats::default();
        for seed in 0..runs {
            let mut sampler = Sampler::new(params.clone(), 1000 + seed);
            let mut state = pre.clone();
            let g = generate(
                &m,
                &mut state,
                &prompt[prompt.len() - 1..],
                false,
                &opts(3, spec(2, forced.clone())),
                &mut sampler,
                &AtomicBool::new(false),
                None,
                |_, _| None,
            )
            .unwrap();
            let s = g.stats;
            c2[s.generated[1] as usize] += 1;
            c3[s.generated[2] as usize] += 1;
            total.add(&s.spec);
        }
        assert_eq!(total.steps, runs as usize);
        match forced {
            None => assert!(total.accepted < total.drafted / 10, "{total:?}"),
            Some(_) => assert!(
                total.accepted > total.drafted / 10 && total.accepted < total.drafted,
                "{total:?}"
            ),
        }
        for (name, c, e) in [("second", &c2, &exact2), ("third", &c3, &exact3)] {
            let (chi, df) = chi_square(c, e);
            assert!(
                chi < chi_critical(df),
                "{name} token, forced {forced:?}: chi-square {chi:.1} (df {df}) against the \
                 exact distribution"
            );
        }
    }
}

#[test]
fn checkpoints_without_a_complete_head_are_refused_clearly() {
    let flat = fixture("tiny-flat-f32");
    let cfg = kestrel::config::TextConfig::from_file(&flat.join("config.json")).unwrap();
    let e = MtpWeights::from_checkpoint(&Checkpoint::open(&flat).unwrap(), &cfg)
        .err()
        .unwrap();
    let msg = format!("{e:#}");
    assert!(msg.contains("no `mtp.*` tensors"), "{msg}");
    // The bf16 fixture without one of its head's tensors: only part of a head.
    let partial = tempfile::tempdir().unwrap();
    drop_tensor(
        &fixture("tiny-official-bf16"),
        partial.path(),
        "mtp.layers.0.self_attn.q_proj.weight",
    );
    let cfg = kestrel::config::TextConfig::from_file(&partial.path().join("config.json")).unwrap();
    let ck = Checkpoint::open(partial.path()).unwrap();
    // the main model still loads
    kestrel::weights::ModelWeights::from_checkpoint(&ck, &cfg).unwrap();
    let e = MtpWeights::from_checkpoint(&ck, &cfg).err().unwrap();
    let msg = format!("{e:#}");
    assert!(msg.contains("not a complete MTP head"), "{msg}");
    assert!(msg.contains("mtp.layers.0.self_attn.q_proj"), "{msg}");
    // A model without a head drafts nothing and says why.
    let m = CpuModel::load(&flat).unwrap();
    assert!(m.mtp_check().is_err());
    let mut s = m.new_state().unwrap();
    m.forward(&mut s, &[1, 2], Logits::Last).unwrap();
    let e = m
        .mtp_draft(&mut s, 3, 2, &mut |_, _| 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no MTP head"), "{e}");
}

/// Copies the sharded checkpoint `src` to `dst` without tensor `name` (rewriting the shard
/// that held it and the index).
fn drop_tensor(src: &Path, dst: &Path, name: &str) {
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(src.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = idx["weight_map"][name].as_str().unwrap().to_string();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let f = p.file_name().unwrap().to_str().unwrap().to_string();
        if f != shard && f != "model.safetensors.index.json" {
            std::fs::copy(&p, dst.join(&f)).unwrap();
        }
    }
    let bytes = std::fs::read(src.join(&shard)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    let out = safetensors::tensor::serialize(kept, None).unwrap();
    std::fs::write(dst.join(&shard), out).unwrap();
    let mut idx = idx;
    idx["weight_map"].as_object_mut().unwrap().remove(name);
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&idx).unwrap(),
    )
    .unwrap();
}

/// At the GPU's precision (`round_to_bf16_with_mtp` + `bf16_activations`, the oracle a GPU
/// speculation path will be checked against) speculation stays lossless, and the head's
/// matrices are bf16.
#[test]
fn speculation_at_gpu_precision_is_lossless_too() {
    let mut m = CpuModel::load(&fixture("tiny-flat-f32")).unwrap();
    let head = random_mtp_weights(&m.config, 5, DType::F32);
    m.attach_mtp(head);
    m.weights.round_to_bf16_with_mtp();
    m.bf16_activations = true;
    let h = m.weights.mtp.as_ref().unwrap();
    assert_eq!(h.fc.dtype, DType::BF16);
    assert_eq!(h.layer.moe.experts[0].down.dtype, DType::BF16);
    assert_eq!(m.weights.layers.len(), m.config.num_layers);
    let prompt = prompt_of(&m, 30);
    let (plain, _) = run(&m, &prompt, &opts(96, None), &mut greedy());
    same_greedy(&m, &prompt, 96, spec(2, None));
    let all = same_greedy(&m, &prompt, 96, spec(2, Some(plain.generated.clone())));
    assert_eq!(all.accepted, all.drafted);
}
