//! Gated DeltaNet kernels: causal depthwise conv with a state of pre-conv inputs, and the
//! delta-rule recurrence in step form (decode) and chunked WY form (prefill).
//!
//! Recurrent state layout per value head: `S[key i][value m]`, f32, `[Hv, dk, dv]`.

use super::gemm::dot;
use super::silu;
use rayon::prelude::*;

/// Chunk length of the chunked delta rule (as in the reference).
pub const CHUNK: usize = 64;

/// Causal depthwise conv + SiLU over `t` tokens of `channels` (input `[t, channels]`).
///
/// `state` holds the last `kernel - 1` pre-conv inputs `[kernel-1, channels]` (oldest first)
/// and is advanced to end with the last inputs of `x`. Tap `kernel-1` multiplies the
/// current token. `w` is `[channels, kernel]`.
pub fn causal_conv_silu(
    x: &[f32],
    t: usize,
    channels: usize,
    state: &mut [f32],
    w: &[f32],
    kernel: usize,
) -> Vec<f32> {
    let hist = kernel - 1;
    debug_assert_eq!(state.len(), hist * channels);
    // Window = state rows followed by the new rows.
    let row = |j: usize| -> &[f32] {
        if j < hist {
            &state[j * channels..(j + 1) * channels]
        } else {
            &x[(j - hist) * channels..(j - hist + 1) * channels]
        }
    };
    let mut out = vec![0.0f32; t * channels];
    for s in 0..t {
        let o = &mut out[s * channels..(s + 1) * channels];
        for tap in 0..kernel {
            let src = row(s + tap);
            for c in 0..channels {
                o[c] += w[c * kernel + tap] * src[c];
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
    // New state: the last `hist` rows of [state ; x].
    let mut new_state = vec![0.0f32; hist * channels];
    for j in 0..hist {
        new_state[j * channels..(j + 1) * channels].copy_from_slice(row(t + j));
    }
    state.copy_from_slice(&new_state);
    out
}

/// Per-token, per-value-head inputs of the recurrence (already normalised and gated).
pub struct DeltaInputs<'a> {
    pub t: usize,
    pub num_value_heads: usize,
    /// Value heads per key head (`j` uses key head `j / group`).
    pub group: usize,
    pub dk: usize,
    pub dv: usize,
    /// `[t, Hk, dk]`: L2-normalised q times `dk^-1/2`.
    pub q: &'a [f32],
    /// `[t, Hk, dk]`: L2-normalised k.
    pub k: &'a [f32],
    /// `[t, Hv, dv]`.
    pub v: &'a [f32],
    /// `[t, Hv]`: log-decay `g <= 0`.
    pub g: &'a [f32],
    /// `[t, Hv]`: write strength.
    pub beta: &'a [f32],
}

impl DeltaInputs<'_> {
    fn q(&self, s: usize, j: usize) -> &[f32] {
        let hk = self.num_value_heads / self.group;
        let h = j / self.group;
        &self.q[(s * hk + h) * self.dk..][..self.dk]
    }
    fn k(&self, s: usize, j: usize) -> &[f32] {
        let hk = self.num_value_heads / self.group;
        let h = j / self.group;
        &self.k[(s * hk + h) * self.dk..][..self.dk]
    }
    fn v(&self, s: usize, j: usize) -> &[f32] {
        &self.v[(s * self.num_value_heads + j) * self.dv..][..self.dv]
    }
    fn g(&self, s: usize, j: usize) -> f32 {
        self.g[s * self.num_value_heads + j]
    }
    fn beta(&self, s: usize, j: usize) -> f32 {
        self.beta[s * self.num_value_heads + j]
    }
}

/// Per-head outputs `[Hv][t, dv]` into the token-major layout `[t, Hv, dv]`.
fn interleave_heads(per_head: &[Vec<f32>], t: usize, dv: usize) -> Vec<f32> {
    let hv = per_head.len();
    let mut out = vec![0.0f32; t * hv * dv];
    for (j, o_head) in per_head.iter().enumerate() {
        for tok in 0..t {
            out[(tok * hv + j) * dv..][..dv].copy_from_slice(&o_head[tok * dv..][..dv]);
        }
    }
    out
}

/// Step form: token by token, `S ← λS; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq`.
/// Returns `o` as `[t, Hv, dv]`; `state` is `[Hv, dk, dv]`.
pub fn delta_rule_step(inp: &DeltaInputs, state: &mut [f32]) -> Vec<f32> {
    let (dk, dv, t) = (inp.dk, inp.dv, inp.t);
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(j, s)| {
            let mut o_head = vec![0.0f32; t * dv];
            let mut r = vec![0.0f32; dv];
            for tok in 0..t {
                let (q, k, v) = (inp.q(tok, j), inp.k(tok, j), inp.v(tok, j));
                let decay = inp.g(tok, j).exp();
                let beta = inp.beta(tok, j);
                r.iter_mut().for_each(|x| *x = 0.0);
                for i in 0..dk {
                    let row = &mut s[i * dv..(i + 1) * dv];
                    for m in 0..dv {
                        row[m] *= decay;
                        r[m] += row[m] * k[i];
                    }
                }
                let u: Vec<f32> = (0..dv).map(|m| beta * (v[m] - r[m])).collect();
                let o = &mut o_head[tok * dv..(tok + 1) * dv];
                for i in 0..dk {
                    let row = &mut s[i * dv..(i + 1) * dv];
                    for m in 0..dv {
                        row[m] += k[i] * u[m];
                        o[m] += row[m] * q[i];
                    }
                }
            }
            o_head
        })
        .collect();
    interleave_heads(&per_head, t, dv)
}

/// Chunked (WY) form over chunks of [`CHUNK`] tokens; equal to [`delta_rule_step`] up to
/// rounding. Returns `o` as `[t, Hv, dv]` and advances `state`.
pub fn delta_rule_chunked(inp: &DeltaInputs, state: &mut [f32]) -> Vec<f32> {
    let (dk, dv, t) = (inp.dk, inp.dv, inp.t);
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(j, s0)| {
            let mut o_head = vec![0.0f32; t * dv];
            let mut start = 0;
            while start < t {
                let n = CHUNK.min(t - start);
                chunk(
                    inp,
                    j,
                    start,
                    n,
                    s0,
                    &mut o_head[start * dv..(start + n) * dv],
                );
                start += n;
            }
            o_head
        })
        .collect();
    interleave_heads(&per_head, t, dv)
}

/// One chunk of `n` tokens for value head `j`, incoming state `s0` (updated in place).
fn chunk(inp: &DeltaInputs, j: usize, start: usize, n: usize, s0: &mut [f32], o: &mut [f32]) {
    let (dk, dv) = (inp.dk, inp.dv);
    let tok = |r: usize| start + r;
    // Inclusive cumulative log-decay.
    let mut acc = 0.0f32;
    let gamma: Vec<f32> = (0..n)
        .map(|r| {
            acc += inp.g(tok(r), j);
            acc
        })
        .collect();
    let beta: Vec<f32> = (0..n).map(|r| inp.beta(tok(r), j)).collect();
    // L[r][s] = β_r (k_r·k_s) exp(γ_r − γ_s), strictly lower.
    let mut l = vec![0.0f32; n * n];
    for r in 0..n {
        for s in 0..r {
            l[r * n + s] =
                beta[r] * dot(inp.k(tok(r), j), inp.k(tok(s), j)) * (gamma[r] - gamma[s]).exp();
        }
    }
    // Forward substitution: (I + L) U = β V and (I + L) W = β e^γ K.
    let mut u = vec![0.0f32; n * dv];
    let mut w = vec![0.0f32; n * dk];
    for r in 0..n {
        let (ur, wr) = (r * dv, r * dk);
        let v = inp.v(tok(r), j);
        let k = inp.k(tok(r), j);
        let eg = gamma[r].exp();
        for m in 0..dv {
            u[ur + m] = beta[r] * v[m];
        }
        for i in 0..dk {
            w[wr + i] = beta[r] * eg * k[i];
        }
        for s in 0..r {
            let c = l[r * n + s];
            if c != 0.0 {
                for m in 0..dv {
                    u[ur + m] -= c * u[s * dv + m];
                }
                for i in 0..dk {
                    w[wr + i] -= c * w[s * dk + i];
                }
            }
        }
    }
    // V' = U − W S0 (the actual write vectors).
    let mut vp = u;
    for r in 0..n {
        for i in 0..dk {
            let c = w[r * dk + i];
            let srow = &s0[i * dv..(i + 1) * dv];
            for m in 0..dv {
                vp[r * dv + m] -= c * srow[m];
            }
        }
    }
    // O[r] = e^{γ_r} q_r S0 + Σ_{s≤r} (q_r·k_s) exp(γ_r − γ_s) V'[s].
    for r in 0..n {
        let q = inp.q(tok(r), j);
        let or = &mut o[r * dv..(r + 1) * dv];
        let eg = gamma[r].exp();
        for i in 0..dk {
            let c = eg * q[i];
            let srow = &s0[i * dv..(i + 1) * dv];
            for m in 0..dv {
                or[m] += c * srow[m];
            }
        }
        for s in 0..=r {
            let c = dot(q, inp.k(tok(s), j)) * (gamma[r] - gamma[s]).exp();
            for m in 0..dv {
                or[m] += c * vp[s * dv + m];
            }
        }
    }
    // S_new = e^{γ_last} S0 + Σ_r (e^{γ_last − γ_r} k_r) ⊗ V'[r].
    let last = gamma[n - 1];
    let el = last.exp();
    s0.iter_mut().for_each(|x| *x *= el);
    for r in 0..n {
        let k = inp.k(tok(r), j);
        let c = (last - gamma[r]).exp();
        for i in 0..dk {
            let ki = c * k[i];
            let srow = &mut s0[i * dv..(i + 1) * dv];
            for m in 0..dv {
                srow[m] += ki * vp[r * dv + m];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::norm::l2_normalize;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn chunked_equals_step_with_nonzero_state() {
        let (t, hk, hv, dk, dv) = (150, 2, 4, 8, 6);
        let mut seed = 7;
        let mut q: Vec<f32> = (0..t * hk * dk).map(|_| lcg(&mut seed)).collect();
        let mut k: Vec<f32> = (0..t * hk * dk).map(|_| lcg(&mut seed)).collect();
        for h in q.chunks_exact_mut(dk).chain(k.chunks_exact_mut(dk)) {
            l2_normalize(h, 1e-6);
        }
        let v: Vec<f32> = (0..t * hv * dv).map(|_| lcg(&mut seed)).collect();
        let g: Vec<f32> = (0..t * hv).map(|_| -0.3 * (lcg(&mut seed) + 1.0)).collect();
        let beta: Vec<f32> = (0..t * hv).map(|_| 0.5 * (lcg(&mut seed) + 1.0)).collect();
        let inp = DeltaInputs {
            t,
            num_value_heads: hv,
            group: hv / hk,
            dk,
            dv,
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let init: Vec<f32> = (0..hv * dk * dv).map(|_| lcg(&mut seed)).collect();
        let (mut s1, mut s2) = (init.clone(), init.clone());
        let o1 = delta_rule_step(&inp, &mut s1);
        let o2 = delta_rule_chunked(&inp, &mut s2);
        let max_o = o1
            .iter()
            .zip(&o2)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let max_s = s1
            .iter()
            .zip(&s2)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(max_o < 1e-4 && max_s < 1e-4, "o {max_o} s {max_s}");
        // And the state actually moved.
        assert!(s1.iter().zip(&init).any(|(a, b)| (a - b).abs() > 1e-2));
    }

    #[test]
    fn conv_state_carries_across_calls() {
        let (c, kern) = (3, 4);
        let w: Vec<f32> = (0..c * kern).map(|i| i as f32 * 0.1 - 0.5).collect();
        let x: Vec<f32> = (0..10 * c).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut s_all = vec![0.0; (kern - 1) * c];
        let all = causal_conv_silu(&x, 10, c, &mut s_all, &w, kern);
        let mut s = vec![0.0; (kern - 1) * c];
        let mut parts = causal_conv_silu(&x[..4 * c], 4, c, &mut s, &w, kern);
        parts.extend(causal_conv_silu(&x[4 * c..5 * c], 1, c, &mut s, &w, kern));
        parts.extend(causal_conv_silu(&x[5 * c..], 5, c, &mut s, &w, kern));
        assert_eq!(all, parts);
        assert_eq!(s, s_all);
        assert_eq!(&s[..], &x[7 * c..]); // state = last three raw inputs
    }
}
