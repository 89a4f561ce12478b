//! Token sampling: penalties, temperature, top-k, top-p, min-p, then a seeded draw.
//!
//! [`Sampler`] is per request: `Sampler::new(params, seed)`, then `sample(logits, history)`
//! once per generated token. The transforms are also exposed as plain functions on
//! `(id, logit)` candidate lists so each one's math is testable on hand-made logits.
//!
//! Order (as Hugging Face `generate` applies its logits processors): repetition penalty,
//! presence / frequency penalties, temperature, top-k, top-p, min-p. Temperature 0 is greedy
//! (the argmax after the penalties). Ids at or above `vocab_limit` (the padding rows of the
//! embedding) are never chosen.

use crate::config::GenerationConfig;
use std::collections::HashMap;
use std::fmt;

/// Sampling settings of one request. `Default` is plain sampling at temperature 1 with every
/// filter and penalty off.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely ids; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely ids whose probability reaches `top_p`; 1 is off.
    pub top_p: f32,
    /// Drop ids less likely than `min_p` times the most likely one; 0 is off.
    pub min_p: f32,
    /// Hugging Face's repetition penalty on ids in the history (positive logits divided by it,
    /// negative ones multiplied); 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every id that occurs in the history (OpenAI's).
    pub presence_penalty: f32,
    /// Subtracted from each id's logit once per occurrence in the history (OpenAI's).
    pub frequency_penalty: f32,
    /// Only ids below this are ever chosen (`usize::MAX`: all of the logits).
    pub vocab_limit: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            vocab_limit: usize::MAX,
        }
    }
}

/// An out-of-range sampling setting, naming the field.
#[derive(Clone, Debug, PartialEq)]
pub struct InvalidParam {
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl fmt::Display for InvalidParam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is {} but must be {}",
            self.field, self.value, self.expected
        )
    }
}

impl std::error::Error for InvalidParam {}

/// Range checks shared by the command-line flags, `generation_config.json` and API requests.
pub mod check {
    pub const TEMPERATURE: &str = "a finite number >= 0";
    pub const TOP_P: &str = "in (0, 1]";
    pub const MIN_P: &str = "in [0, 1]";
    pub const REPETITION_PENALTY: &str = "a finite number > 0";
    pub const PRESENCE_FREQUENCY: &str = "in [-2, 2]";

    pub fn temperature(x: f32) -> bool {
        x.is_finite() && x >= 0.0
    }
    pub fn top_p(x: f32) -> bool {
        x > 0.0 && x <= 1.0
    }
    pub fn min_p(x: f32) -> bool {
        (0.0..=1.0).contains(&x)
    }
    pub fn repetition_penalty(x: f32) -> bool {
        x.is_finite() && x > 0.0
    }
    pub fn presence_frequency(x: f32) -> bool {
        (-2.0..=2.0).contains(&x)
    }
}

impl SamplingParams {
    /// Checks every field's range; the error names the first bad field.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        let bad = |field, value: f32, expected| {
            Err(InvalidParam {
                field,
                value: value.to_string(),
                expected,
            })
        };
        if !check::temperature(self.temperature) {
            return bad("temperature", self.temperature, check::TEMPERATURE);
        }
        if !check::top_p(self.top_p) {
            return bad("top_p", self.top_p, check::TOP_P);
        }
        if !check::min_p(self.min_p) {
            return bad("min_p", self.min_p, check::MIN_P);
        }
        if !check::repetition_penalty(self.repetition_penalty) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                check::REPETITION_PENALTY,
            );
        }
        if !check::presence_frequency(self.presence_penalty) {
            return bad(
                "presence_penalty",
                self.presence_penalty,
                check::PRESENCE_FREQUENCY,
            );
        }
        if !check::presence_frequency(self.frequency_penalty) {
            return bad(
                "frequency_penalty",
                self.frequency_penalty,
                check::PRESENCE_FREQUENCY,
            );
        }
        if self.vocab_limit == 0 {
            return Err(InvalidParam {
                field: "vocab_limit",
                value: "0".into(),
                expected: "at least 1",
            });
        }
        Ok(())
    }

    /// A checkpoint's defaults from its `generation_config.json`, read as transformers reads
    /// it: greedy (temperature 0) unless `do_sample` is true; fields it leaves out are off.
    pub fn from_generation_config(cfg: &GenerationConfig, vocab_limit: usize) -> Self {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: if cfg.do_sample == Some(true) {
                cfg.temperature.unwrap_or(d.temperature)
            } else {
                0.0
            },
            top_k: cfg.top_k.unwrap_or(d.top_k),
            top_p: cfg.top_p.unwrap_or(d.top_p),
            min_p: cfg.min_p.unwrap_or(d.min_p),
            repetition_penalty: cfg.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: cfg.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: cfg.frequency_penalty.unwrap_or(d.frequency_penalty),
            vocab_limit,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether any penalty changes the logits once ids have been generated.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// xoshiro256** seeded through SplitMix64: small, fast, and the same stream on every platform.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Applies the repetition, presence and frequency penalties in place, for every id that occurs
/// in `history` (ids outside `logits` are ignored).
pub fn apply_penalties(
    logits: &mut [f32],
    history: &[u32],
    repetition: f32,
    presence: f32,
    frequency: f32,
) {
    if history.is_empty() || (repetition == 1.0 && presence == 0.0 && frequency == 0.0) {
        return;
    }
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &id in history {
        *counts.entry(id).or_insert(0) += 1;
    }
    for (&id, &n) in &counts {
        let Some(l) = logits.get_mut(id as usize) else {
            continue;
        };
        if repetition != 1.0 {
            *l = if *l > 0.0 {
                *l / repetition
            } else {
                *l * repetition
            };
        }
        *l -= presence + frequency * n as f32;
    }
}

/// Sorts candidates by descending logit (ties: lower id first), so every transform and the
/// final draw see one deterministic order.
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Keeps the `k` candidates with the largest logits (all of them when `k` is 0 or larger than
/// the list), sorted by descending logit.
pub fn top_k(cands: &mut Vec<(u32, f32)>, k: usize) {
    if k > 0 && k < cands.len() {
        cands.select_nth_unstable_by(k - 1, by_logit_desc);
        cands.truncate(k);
    }
    cands.sort_unstable_by(by_logit_desc);
}

/// Softmax weights `exp(l - max)` of sorted candidates and their sum.
fn weights(cands: &[(u32, f32)]) -> (Vec<f64>, f64) {
    let max = cands.first().map_or(0.0, |c| c.1) as f64;
    let w: Vec<f64> = cands.iter().map(|c| (c.1 as f64 - max).exp()).collect();
    let sum = w.iter().sum();
    (w, sum)
}

/// Nucleus filter on candidates sorted by descending logit: keeps the shortest prefix whose
/// probability mass reaches `p` (at least one candidate).
pub fn top_p(cands: &mut Vec<(u32, f32)>, p: f32) {
    let (_, sum) = weights(cands);
    top_p_of_mass(cands, p, sum);
}

/// [`top_p`] where `total` is the softmax mass (`sum exp(l - max)`) of the full candidate set,
/// of which `cands` may be only the largest, sorted part.
fn top_p_of_mass(cands: &mut Vec<(u32, f32)>, p: f32, total: f64) {
    if p >= 1.0 || cands.len() <= 1 {
        return;
    }
    let (w, _) = weights(cands);
    let target = p as f64 * total;
    let mut acc = 0.0;
    let mut keep = cands.len();
    for (i, wi) in w.iter().enumerate() {
        acc += wi;
        if acc >= target {
            keep = i + 1;
            break;
        }
    }
    cands.truncate(keep.max(1));
}

/// Drops candidates whose probability is below `p` times the most likely one's, i.e. whose
/// logit is below `max + ln p`. Candidates must be sorted by descending logit.
pub fn min_p(cands: &mut Vec<(u32, f32)>, p: f32) {
    if p <= 0.0 || cands.is_empty() {
        return;
    }
    let threshold = cands[0].1 as f64 + (p as f64).ln();
    let keep = cands
        .iter()
        .position(|c| (c.1 as f64) < threshold)
        .unwrap_or(cands.len());
    cands.truncate(keep.max(1));
}

/// Probabilities of sorted candidates (softmax over the list).
pub fn probabilities(cands: &[(u32, f32)]) -> Vec<f64> {
    let (w, sum) = weights(cands);
    w.into_iter().map(|x| x / sum).collect()
}

/// The log-probability of `id` and the `top_n` most likely ids under the model's own
/// distribution (softmax over `logits[..vocab_limit]`, before any sampling transform).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub fn logprobs(logits: &[f32], vocab_limit: usize, id: u32, top_n: usize) -> TokenLogprobs {
    let l = &logits[..vocab_limit.min(logits.len())];
    let max = l
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + l.iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |x: f32| (x as f64 - lse) as f32;
    let logprob = l.get(id as usize).map_or(f32::NEG_INFINITY, |&x| lp(x));
    let mut cands: Vec<(u32, f32)> = l
        .iter()
        .enumerate()
        .filter(|(_, x)| !x.is_nan())
        .map(|(i, &x)| (i as u32, x))
        .collect();
    top_k(&mut cands, top_n);
    cands.truncate(top_n);
    TokenLogprobs {
        id,
        logprob,
        top: cands.into_iter().map(|(i, x)| (i, lp(x))).collect(),
    }
}

/// A seeded sampler for one request.
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    scratch: Vec<f32>,
    cands: Vec<(u32, f32)>,
}

impl Sampler {
    /// `params` should have passed [`SamplingParams::validate`]; out-of-range values are
    /// clamped rather than trusted.
    pub fn new(params: SamplingParams, seed: u64) -> Self {
        Sampler {
            params,
            rng: Rng::new(seed),
            scratch: Vec::new(),
            cands: Vec::new(),
        }
    }

    /// Whether [`Sampler::sample`] is a plain argmax over ids `< vocab_limit` whatever the
    /// history (greedy, no penalties), so an engine's own argmax can stand in for it.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.is_greedy() && !self.params.has_penalties()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The model's log-probability of `id` and its `top_n` most likely ids at this position
    /// (before any sampling transform), over the ids this sampler may choose.
    pub fn logprobs(&self, logits: &[f32], id: u32, top_n: usize) -> TokenLogprobs {
        logprobs(logits, self.params.vocab_limit, id, top_n)
    }

    /// Chooses the next id from one position's `logits`. `history` is what the penalties
    /// count (the CLI passes the reply generated so far).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let u = self.uniform();
        let (x, cands) = (&mut self.scratch, &mut self.cands);
        draw_in(&self.params, logits, history, u, x, cands)
    }

    /// [`sample`](Self::sample) among the ids `mask` allows (structured outputs).
    pub fn sample_masked(&mut self, logits: &[f32], history: &[u32], mask: &[u32]) -> u32 {
        let x = masked_logits(logits, mask);
        let id = self.sample(&x, history);
        allowed_or_best(id, &x, mask, self.params.vocab_limit)
    }

    /// The uniform the next draw uses (one a sampled token; none when greedy), for an engine
    /// that draws on the device ([`Draw::u`]): with it, [`draw`] picks what
    /// [`Sampler::sample`] would.
    pub fn uniform(&mut self) -> f64 {
        if self.params.is_greedy() {
            0.0
        } else {
            self.rng.next_f64()
        }
    }
}

/// The id [`Sampler::sample`] chooses from `logits` with the uniform `u` (unused when greedy):
/// penalties over `history`, temperature, top-k, top-p, min-p, then the inverse CDF at `u`.
pub fn draw(p: &SamplingParams, logits: &[f32], history: &[u32], u: f64) -> u32 {
    draw_in(p, logits, history, u, &mut Vec::new(), &mut Vec::new())
}

/// [`draw`] with the caller's scratch buffers (a vocabulary of values, the candidates).
fn draw_in(
    p: &SamplingParams,
    logits: &[f32],
    history: &[u32],
    u: f64,
    x: &mut Vec<f32>,
    cands: &mut Vec<(u32, f32)>,
) -> u32 {
    let n = p.vocab_limit.min(logits.len());
    if n == 0 {
        return 0;
    }
    if p.is_greedy() && (history.is_empty() || !p.has_penalties()) {
        return greedy_id(logits, n);
    }
    x.clear();
    x.extend(
        logits[..n]
            .iter()
            .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v }),
    );
    apply_penalties(
        x,
        history,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    );
    if p.is_greedy() {
        return argmax(x);
    }
    let t = p.temperature.max(f32::MIN_POSITIVE);
    if t != 1.0 {
        x.iter_mut().for_each(|v| *v /= t);
    }
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return argmax(x);
    }
    let total = if p.top_k > 0 && p.top_k < n {
        top_k_scan(x, p.top_k, cands);
        weights(cands).1
    } else if p.top_p >= 1.0 && p.min_p <= 0.0 {
        // Plain sampling over the whole vocabulary, in id order: the weights replace the
        // logits in place, so each needs one exp.
        let mut total = 0.0f64;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            total += *v as f64;
        }
        let u = u * total;
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &w) in x.iter().enumerate() {
            if w > 0.0 {
                acc += w as f64;
                last = i as u32;
                if u < acc {
                    return i as u32;
                }
            }
        }
        return last;
    } else if p.min_p > 0.0 {
        // Min-p keeps a prefix of the sorted order, so filtering first and sorting only
        // the survivors gives the same result; top-p still needs the full mass.
        let total = if p.top_p < 1.0 {
            x.iter().map(|&v| (v - max).exp() as f64).sum()
        } else {
            0.0
        };
        let threshold = max as f64 + (p.min_p as f64).ln();
        cands.clear();
        cands.extend(
            x.iter()
                .enumerate()
                .filter(|(_, v)| **v as f64 >= threshold)
                .map(|(i, &v)| (i as u32, v)),
        );
        cands.sort_unstable_by(by_logit_desc);
        total
    } else {
        cands.clear();
        cands.extend(
            x.iter()
                .enumerate()
                .filter(|(_, v)| **v > f32::NEG_INFINITY)
                .map(|(i, &v)| (i as u32, v)),
        );
        sort_enough(cands, p.top_p, 0.0)
    };
    top_p_of_mass(cands, p.top_p, total);
    min_p(cands, p.min_p);
    let probs = probabilities(cands);
    let mut acc = 0.0;
    for (c, pr) in cands.iter().zip(&probs) {
        acc += pr;
        if u < acc {
            return c.0;
        }
    }
    cands.last().map_or(0, |c| c.0)
}

/// The distribution [`draw`] samples from, written out: `(id, probability)` of every id it
/// can pick (penalties over `history`, temperature, top-k, top-p, min-p, then the softmax
/// of what is left), most likely first. Greedy: the one id [`draw`] picks, probability 1.
/// Speculative rejection sampling applies it to the target's and the draft's logits alike.
pub fn distribution(p: &SamplingParams, logits: &[f32], history: &[u32]) -> Vec<(u32, f64)> {
    let n = p.vocab_limit.min(logits.len());
    if p.is_greedy() || n == 0 {
        return vec![(draw(p, logits, history, 0.0), 1.0)];
    }
    let mut x: Vec<f32> = logits[..n]
        .iter()
        .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v })
        .collect();
    apply_penalties(
        &mut x,
        history,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    );
    let t = p.temperature.max(f32::MIN_POSITIVE);
    if t != 1.0 {
        x.iter_mut().for_each(|v| *v /= t);
    }
    let mut cands: Vec<(u32, f32)> = x
        .iter()
        .enumerate()
        .filter(|(_, v)| **v > f32::NEG_INFINITY)
        .map(|(i, &v)| (i as u32, v))
        .collect();
    if cands.is_empty() {
        return vec![(argmax(&x), 1.0)];
    }
    top_k(&mut cands, p.top_k);
    top_p(&mut cands, p.top_p);
    min_p(&mut cands, p.min_p);
    let probs = probabilities(&cands);
    cands.iter().map(|c| c.0).zip(probs).collect()
}

/// The id at `u` in `[0, 1)` of a written-out distribution (its inverse CDF, in its order).
pub fn sample_from(dist: &[(u32, f64)], u: f64) -> u32 {
    let total: f64 = dist.iter().map(|d| d.1).sum();
    let u = u * total;
    let mut acc = 0.0;
    for &(id, pr) in dist {
        acc += pr;
        if u < acc && pr > 0.0 {
            return id;
        }
    }
    dist.iter().rev().find(|d| d.1 > 0.0).map_or(0, |d| d.0)
}

fn prob_of(dist: &[(u32, f64)], id: u32) -> f64 {
    dist.iter().find(|d| d.0 == id).map_or(0.0, |d| d.1)
}

/// Speculative rejection sampling (Leviathan et al. / Chen et al.), one draft position:
/// `draft` was drawn from `q` (the draft's distribution), `p` is the target's. Accepts with
/// probability `min(1, p(draft) / q(draft))`, `u` uniform in `[0, 1)`; on rejection returns the
/// id drawn at `u2()` (called only then) from the residual `max(0, p - q)` renormalised. Either way the id has
/// exactly the distribution `p`. Greedy (`p` and `q` one id each, `u = 0`): accepted exactly
/// when the draft is the target's choice, else the target's choice.
pub fn speculative_step(
    p: &[(u32, f64)],
    q: &[(u32, f64)],
    draft: u32,
    u: f64,
    u2: impl FnOnce() -> f64,
) -> (u32, bool) {
    let (pd, qd) = (prob_of(p, draft), prob_of(q, draft));
    if qd > 0.0 && u * qd < pd {
        return (draft, true);
    }
    let qs: HashMap<u32, f64> = q.iter().copied().collect();
    let residual: Vec<(u32, f64)> = p
        .iter()
        .map(|&(id, pr)| (id, (pr - qs.get(&id).copied().unwrap_or(0.0)).max(0.0)))
        .filter(|r| r.1 > 0.0)
        .collect();
    if residual.is_empty() {
        // p <= q everywhere means p == q, where the draft is always accepted; rounding only
        return (sample_from(p, u2()), false);
    }
    (sample_from(&residual, u2()), false)
}

/// One row of a batched step's draw ([`crate::model::Engine::forward_batch_draw`]): the
/// request's settings, the uniform its sampler gave for this token ([`Sampler::uniform`]), the
/// history the penalties count, how many top log-probabilities it wants (`None`: none), and
/// whether it needs the logits row itself (the thinking budget may replace the drawn id), and
/// the structured-output mask of the ids it may pick (waited for only when the draw needs it,
/// so it is computed while the step runs).
#[derive(Clone, Copy)]
pub struct Draw<'a> {
    pub params: &'a SamplingParams,
    pub u: f64,
    pub history: &'a [u32],
    pub top_logprobs: Option<usize>,
    pub want_logits: bool,
    pub mask: Option<&'a crate::grammar::PendingMask>,
}

impl std::fmt::Debug for Draw<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Draw")
            .field("params", self.params)
            .field("u", &self.u)
            .field("history", &self.history.len())
            .field("top_logprobs", &self.top_logprobs)
            .field("want_logits", &self.want_logits)
            .field("masked", &self.mask.is_some())
            .finish()
    }
}

/// What a row's draw gave.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub id: u32,
    pub logprobs: Option<TokenLogprobs>,
    /// The row's logits, where [`Draw::want_logits`] asked.
    pub logits: Option<Vec<f32>>,
}

impl Draw<'_> {
    /// The draw from the row's `logits` on the host (the reference every device draw matches);
    /// with a mask, from the logits the mask allows (the log-probabilities too).
    pub fn on_host(&self, logits: &[f32]) -> Drawn {
        let masked;
        let logits = match self.mask {
            Some(m) => {
                masked = masked_logits(logits, m.get());
                &masked[..]
            }
            None => logits,
        };
        let mut id = draw(self.params, logits, self.history, self.u);
        if let Some(m) = self.mask {
            id = allowed_or_best(id, logits, m.get(), self.params.vocab_limit);
        }
        Drawn {
            id,
            logprobs: self
                .top_logprobs
                .map(|n| logprobs(logits, self.params.vocab_limit, id, n)),
            logits: self.want_logits.then(|| logits.to_vec()),
        }
    }
}

/// A copy of `logits` with every id `mask` does not allow at −∞.
pub fn masked_logits(logits: &[f32], mask: &[u32]) -> Vec<f32> {
    let mut x = logits.to_vec();
    crate::grammar::apply_mask(&mut x, mask);
    x
}

/// `id` where the mask allows it, else the best allowed id of the (masked) `logits`: a draw
/// whose inverse CDF ran past the last candidate of positive mass never lands on a refused
/// id.
pub fn allowed_or_best(id: u32, logits: &[f32], mask: &[u32], vocab_limit: usize) -> u32 {
    if crate::grammar::allowed(mask, id) {
        return id;
    }
    let n = vocab_limit.min(logits.len());
    (0..n as u32)
        .filter(|&i| crate::grammar::allowed(mask, i))
        .max_by(|&a, &b| {
            logits[a as usize]
                .total_cmp(&logits[b as usize])
                .then(b.cmp(&a))
        })
        .unwrap_or(id)
}

/// The greedy id of one position's logits: the first largest among ids `< vocab_limit` (NaN
/// never chosen; 0 when nothing beats -inf), as [`Sampler::sample`] picks at temperature 0.
pub fn greedy_id(logits: &[f32], vocab_limit: usize) -> u32 {
    argmax(&logits[..vocab_limit.min(logits.len())])
}

/// Index of the largest value, the lowest index on ties, NaN never chosen (0 if nothing is
/// larger than minus infinity).
fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// The `k` largest of `x` as `(id, value)` sorted like [`top_k`] (ties: lower id first), in
/// one pass without building the full candidate list: a buffer of at most `2k` entries is
/// cut back to its best `k` whenever it fills, and later values that cannot beat the k-th
/// best so far are skipped.
fn top_k_scan(x: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    let cap = (2 * k).max(64);
    let mut threshold = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        // Equal values later in the scan have larger ids, so they lose the tie.
        if v > threshold {
            out.push((i as u32, v));
            if out.len() >= cap {
                out.select_nth_unstable_by(k - 1, by_logit_desc);
                out.truncate(k);
                threshold = out[k - 1].1;
            }
        }
    }
    top_k(out, k);
}

/// Sorts only as many of the largest candidates as top-p and min-p can keep, growing the
/// sorted prefix until it is provably enough; the rest is dropped. Returns the softmax mass of
/// all the candidates, which top-p needs. With [`top_p_of_mass`] and [`min_p`] after it, this
/// equals a full sort followed by the two filters, without sorting a 248k-entry vocabulary
/// every step.
fn sort_enough(cands: &mut Vec<(u32, f32)>, top_p: f32, min_p: f32) -> f64 {
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let total: f64 = cands.iter().map(|c| (c.1 as f64 - max).exp()).sum();
    let mut k = 64.min(cands.len());
    loop {
        if k >= cands.len() {
            cands.sort_unstable_by(by_logit_desc);
            return total;
        }
        cands.select_nth_unstable_by(k - 1, by_logit_desc);
        cands[..k].sort_unstable_by(by_logit_desc);
        let max = cands[0].1 as f64;
        let mass: f64 = cands[..k].iter().map(|c| (c.1 as f64 - max).exp()).sum();
        let last = cands[k - 1].1 as f64;
        let p_enough = top_p < 1.0 && mass >= top_p as f64 * total;
        let m_enough = min_p > 0.0 && last < max + (min_p as f64).ln();
        if p_enough || m_enough {
            cands.truncate(k);
            return total;
        }
        k = (k * 8).min(cands.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(logits: &[f32]) -> Vec<(u32, f32)> {
        logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, x))
            .collect()
    }

    fn ids(c: &[(u32, f32)]) -> Vec<u32> {
        c.iter().map(|x| x.0).collect()
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut l = vec![2.0, -2.0, 1.0, 4.0];
        apply_penalties(&mut l, &[0, 1, 1], 2.0, 0.0, 0.0);
        assert_eq!(l, vec![1.0, -4.0, 1.0, 4.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_occurrences() {
        let mut l = vec![1.0, 1.0, 1.0];
        // id 0 once, id 2 three times, id 7 is outside the logits and ignored
        apply_penalties(&mut l, &[2, 0, 2, 2, 7], 1.0, 0.5, 0.25);
        assert_eq!(l, vec![1.0 - 0.5 - 0.25, 1.0, 1.0 - 0.5 - 0.75]);
        let mut l = vec![1.0, 1.0];
        apply_penalties(&mut l, &[], 2.0, 1.0, 1.0);
        assert_eq!(l, vec![1.0, 1.0]);
    }

    #[test]
    fn top_k_keeps_the_k_largest_in_order() {
        let mut c = cands(&[0.1, 3.0, -1.0, 2.0, 2.5]);
        top_k(&mut c, 3);
        assert_eq!(ids(&c), vec![1, 4, 3]);
        let mut c = cands(&[0.1, 3.0]);
        top_k(&mut c, 0);
        assert_eq!(ids(&c), vec![1, 0]);
        // ties: lower id first
        let mut c = cands(&[1.0, 1.0, 1.0]);
        top_k(&mut c, 2);
        assert_eq!(ids(&c), vec![0, 1]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // probabilities 0.5, 0.25, 0.125, 0.125
        let l = [2f32.ln() + 1.0, 1.0, 0.5f32.ln() + 1.0, 0.5f32.ln() + 1.0];
        let mut base = cands(&l);
        top_k(&mut base, 0);
        let p = probabilities(&base);
        assert!((p[0] - 0.5).abs() < 1e-6 && (p[1] - 0.25).abs() < 1e-6);
        for (pp, keep) in [(0.4, 1), (0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (1.0, 4)] {
            let mut c = base.clone();
            top_p(&mut c, pp);
            assert_eq!(c.len(), keep, "top_p {pp}");
        }
        let mut c = base.clone();
        top_p(&mut c, 1e-9);
        assert_eq!(ids(&c), vec![0]);
    }

    #[test]
    fn min_p_drops_ids_below_a_fraction_of_the_best() {
        // probabilities proportional to 8, 4, 2, 1
        let l: Vec<f32> = [8f32, 4.0, 2.0, 1.0].iter().map(|x| x.ln()).collect();
        for (p, keep) in [
            (0.0, 4),
            (0.1, 4),
            (0.12, 4),
            (0.13, 3),
            (0.2, 3),
            (0.45, 2),
            (0.55, 1),
            (0.9, 1),
        ] {
            let mut c = cands(&l);
            top_k(&mut c, 0);
            min_p(&mut c, p);
            assert_eq!(c.len(), keep, "min_p {p}");
        }
    }

    #[test]
    fn temperature_zero_is_greedy_after_penalties() {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            1,
        );
        assert_eq!(s.sample(&[0.0, 5.0, 4.0], &[]), 1);
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                repetition_penalty: 2.0,
                ..Default::default()
            },
            1,
        );
        // 5 / 2 = 2.5 < 4
        assert_eq!(s.sample(&[0.0, 5.0, 4.0], &[1]), 2);
    }

    #[test]
    fn ids_at_or_above_the_vocab_limit_are_never_sampled() {
        let mut logits = vec![0.0; 10];
        logits[8] = 100.0;
        logits[9] = 100.0;
        for temperature in [0.0, 1.0, 5.0] {
            let mut s = Sampler::new(
                SamplingParams {
                    temperature,
                    vocab_limit: 8,
                    ..Default::default()
                },
                3,
            );
            for _ in 0..200 {
                assert!(s.sample(&logits, &[]) < 8);
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let params = SamplingParams {
            temperature: 1.3,
            top_p: 0.9,
            top_k: 200,
            ..Default::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(params.clone(), seed);
            (0..100).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn draws_follow_the_filtered_distribution() {
        // probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1
        let l: Vec<f32> = [8f32, 4.0, 2.0, 1.0, 1.0].iter().map(|x| x.ln()).collect();
        let freq = |params: SamplingParams| {
            let mut s = Sampler::new(params, 7);
            let mut n = [0usize; 5];
            for _ in 0..20_000 {
                n[s.sample(&l, &[]) as usize] += 1;
            }
            n.map(|x| x as f64 / 20_000.0)
        };
        let close = |a: [f64; 5], b: [f64; 5]| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 0.015);
        let f = freq(SamplingParams::default());
        assert!(close(f, [0.5, 0.25, 0.125, 0.0625, 0.0625]), "{f:?}");
        // top-p 0.7: keeps 0.5 + 0.25, renormalised
        let f = freq(SamplingParams {
            top_p: 0.7,
            ..Default::default()
        });
        assert!(close(f, [2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0, 0.0]), "{f:?}");
        // min-p 0.2: keeps 8, 4, 2 (1/8 < 0.2 dropped)
        let f = freq(SamplingParams {
            min_p: 0.2,
            ..Default::default()
        });
        assert!(
            close(f, [4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0, 0.0, 0.0]),
            "{f:?}"
        );
        // top-k 2 at temperature 0.5: weights 8^2 : 4^2 = 0.8 : 0.2
        let f = freq(SamplingParams {
            top_k: 2,
            temperature: 0.5,
            ..Default::default()
        });
        assert!(close(f, [0.8, 0.2, 0.0, 0.0, 0.0]), "{f:?}");
    }

    #[test]
    fn sort_enough_matches_a_full_sort() {
        let mut rng = Rng::new(9);
        let logits: Vec<f32> = (0..5000).map(|_| (rng.next_f64() * 12.0) as f32).collect();
        for (tp, mp) in [
            (0.9, 0.0),
            (0.999, 0.0),
            (1.0, 0.05),
            (0.5, 0.3),
            (1.0, 1e-6),
        ] {
            let mut full = cands(&logits);
            top_k(&mut full, 0);
            top_p(&mut full, tp);
            min_p(&mut full, mp);
            let mut fast = cands(&logits);
            let total = sort_enough(&mut fast, tp, mp);
            top_p_of_mass(&mut fast, tp, total);
            min_p(&mut fast, mp);
            assert_eq!(ids(&full), ids(&fast), "top_p {tp} min_p {mp}");
        }
    }

    #[test]
    fn top_k_scan_matches_top_k() {
        let mut rng = Rng::new(4);
        // Coarse values, so there are many ties.
        let x: Vec<f32> = (0..20_000)
            .map(|_| (rng.next_f64() * 50.0).floor() as f32)
            .collect();
        for k in [1, 5, 20, 64, 1000] {
            let mut full = cands(&x);
            top_k(&mut full, k);
            let mut scanned = Vec::new();
            top_k_scan(&x, k, &mut scanned);
            assert_eq!(scanned, full, "k {k}");
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = [2f32.ln(), 1f32.ln(), 1f32.ln(), 100.0];
        let lp = logprobs(&l, 3, 1, 2);
        assert!((lp.logprob - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0].0, 0);
        assert!((lp.top[0].1 - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn generation_config_defaults_follow_transformers() {
        let g = GenerationConfig::from_json_str(
            r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95}"#,
        )
        .unwrap();
        let p = SamplingParams::from_generation_config(&g, 100);
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.min_p, p.vocab_limit),
            (0.6, 20, 0.95, 0.0, 100)
        );
        // Without do_sample it is greedy, whatever the temperature says.
        let g = GenerationConfig::from_json_str(r#"{"temperature": 0.6}"#).unwrap();
        assert!(SamplingParams::from_generation_config(&g, 100).is_greedy());
    }

    #[test]
    fn validation_names_the_field() {
        let bad = |p: SamplingParams| p.validate().unwrap_err().field;
        let d = SamplingParams::default;
        assert!(d().validate().is_ok());
        assert_eq!(
            bad(SamplingParams {
                temperature: -0.1,
                ..d()
            }),
            "temperature"
        );
        assert_eq!(bad(SamplingParams { top_p: 0.0, ..d() }), "top_p");
        assert_eq!(bad(SamplingParams { top_p: 1.5, ..d() }), "top_p");
        assert_eq!(bad(SamplingParams { min_p: 2.0, ..d() }), "min_p");
        assert_eq!(
            bad(SamplingParams {
                repetition_penalty: 0.0,
                ..d()
            }),
            "repetition_penalty"
        );
        assert_eq!(
            bad(SamplingParams {
                frequency_penalty: 3.0,
                ..d()
            }),
            "frequency_penalty"
        );
        assert_eq!(
            bad(SamplingParams {
                temperature: f32::NAN,
                ..d()
            }),
            "temperature"
        );
    }
}
