//! Gated full attention pieces: partial NeoX RoPE and causal GQA softmax attention over a
//! KV cache.

use super::gemm::dot;
use rayon::prelude::*;

/// Inverse frequencies `θ^(-2i/rd)` for `i < rd/2`, in f32 like the reference.
pub fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32)
        .collect()
}

/// Rotates the first `2 * inv_freq.len()` dims of one head in place, pairing `i` with
/// `i + rd/2` (rotate-half / NeoX). Dims past the rotary part pass through.
pub fn apply_rope(x: &mut [f32], pos: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for (i, f) in inv_freq.iter().enumerate() {
        let angle = pos as f32 * f;
        let (sin, cos) = angle.sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos - b * sin;
        x[i + half] = b * cos + a * sin;
    }
}

/// Causal attention of `t` new queries at positions `past..past+t` over a cache that
/// already holds their keys. `q` is `[t, nq, hd]`, caches `[past + t, nkv, hd]`;
/// query head `h` reads KV head `h / (nq / nkv)`. Returns `[t, nq, hd]`.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    t: usize,
    past: usize,
    k_cache: &[f32],
    v_cache: &[f32],
    nq: usize,
    nkv: usize,
    hd: usize,
) -> Vec<f32> {
    let group = nq / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; t * nq * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (s, h) = (idx / nq, idx % nq);
        let kvh = h / group;
        let qv = &q[idx * hd..(idx + 1) * hd];
        let n = past + s + 1;
        let mut scores: Vec<f32> = (0..n)
            .map(|p| dot(qv, &k_cache[(p * nkv + kvh) * hd..][..hd]) * scale)
            .collect();
        let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for x in scores.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        for (p, w) in scores.iter().enumerate() {
            let v = &v_cache[(p * nkv + kvh) * hd..][..hd];
            let w = w / sum;
            for (oi, vi) in o.iter_mut().zip(v) {
                *oi += w * vi;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_pairs_i_with_i_plus_half_and_leaves_the_rest() {
        let inv = rope_inv_freq(4, 10_000.0);
        let mut x = [1.0f32, 0.0, 0.0, 0.0, 5.0, 6.0];
        apply_rope(&mut x, 1, &inv);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6);
        assert!((x[2] - 1f32.sin()).abs() < 1e-6); // partner of dim 0 is dim 2
        assert_eq!(x[1], 0.0);
        assert_eq!(&x[4..], &[5.0, 6.0]);
    }

    #[test]
    fn single_key_returns_its_value_and_gqa_maps_heads() {
        // nq = 4, nkv = 2: heads 0,1 read kv head 0; heads 2,3 read kv head 1.
        let hd = 2;
        let k = vec![1.0, 0.0, 0.0, 1.0];
        let v = vec![10.0, 20.0, 30.0, 40.0];
        let q = vec![1.0; 4 * hd];
        let o = causal_attention(&q, 1, 0, &k, &v, 4, 2, hd);
        assert_eq!(o, vec![10.0, 20.0, 10.0, 20.0, 30.0, 40.0, 30.0, 40.0]);
    }
}
