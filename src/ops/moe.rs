//! Sparse MoE: router softmax over all experts, top-k renormalised, SwiGLU experts and the
//! sigmoid-gated shared expert. Tokens are grouped by expert so each expert's weights are
//! widened once per call (a grouped GEMM, not one GEMV per token).

use super::gemm::{dot, matmul_act};
use super::{sigmoid, silu};
use crate::weights::{ExpertWeights, MoeWeights};

/// Top-k experts of one token's router logits: softmax over all experts (f32), the k
/// largest, renormalised to sum to 1. Ties go to the lower expert index.
pub fn route(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let chosen: f32 = idx.iter().map(|&e| probs[e] / total).sum();
    idx.into_iter()
        .map(|e| (e, probs[e] / total / chosen))
        .collect()
}

/// SwiGLU feed-forward of `t` rows: `(SiLU(x Gᵀ) ⊙ x Uᵀ) Dᵀ`.
/// With `bf16`, GEMM inputs are rounded to bf16 (the GPU's precision).
pub fn swiglu(x: &[f32], t: usize, w: &ExpertWeights, bf16: bool) -> Vec<f32> {
    let g = matmul_act(x, t, &w.gate, bf16);
    let u = matmul_act(x, t, &w.up, bf16);
    let m: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    matmul_act(&m, t, &w.down, bf16)
}

/// The MoE block for `t` tokens `x [t, d]`; returns `[t, d]`.
pub fn moe_forward(
    x: &[f32],
    t: usize,
    d: usize,
    w: &MoeWeights,
    top_k: usize,
    bf16: bool,
) -> Vec<f32> {
    let router = matmul_act(x, t, &w.router, bf16);
    let e = w.experts.len();
    // Group (token, weight) by expert.
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for tok in 0..t {
        for (ex, wt) in route(&router[tok * e..(tok + 1) * e], top_k) {
            by_expert[ex].push((tok, wt));
        }
    }
    let mut out = vec![0.0f32; t * d];
    for (ex, rows) in by_expert.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let mut xs = Vec::with_capacity(rows.len() * d);
        for &(tok, _) in rows {
            xs.extend_from_slice(&x[tok * d..(tok + 1) * d]);
        }
        let mut y = swiglu(&xs, rows.len(), &w.experts[ex], bf16);
        if bf16 {
            // The GPU takes a routed expert's output as bf16 (transformers' experts return it so).
            y = super::gemm::round_bf16(&y);
        }
        for (r, &(tok, wt)) in rows.iter().enumerate() {
            for (o, v) in out[tok * d..(tok + 1) * d]
                .iter_mut()
                .zip(&y[r * d..(r + 1) * d])
            {
                *o += wt * v;
            }
        }
    }
    let shared = swiglu(x, t, &w.shared, bf16);
    for tok in 0..t {
        let xt = &x[tok * d..(tok + 1) * d];
        let gate = if bf16 {
            sigmoid(dot(&super::gemm::round_bf16(xt), &w.shared_gate))
        } else {
            sigmoid(dot(xt, &w.shared_gate))
        };
        for (o, s) in out[tok * d..(tok + 1) * d]
            .iter_mut()
            .zip(&shared[tok * d..(tok + 1) * d])
        {
            *o += gate * s;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_renormalises_the_top_k() {
        let r = route(&[0.0, 2.0, 1.0, 2.0f32.ln() + 2.0], 2);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 1]);
        assert!((r[0].1 - 2.0 / 3.0).abs() < 1e-6 && (r[1].1 - 1.0 / 3.0).abs() < 1e-6);
    }
}
