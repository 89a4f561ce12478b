//! Normalisations: zero-centred RMSNorm `(1 + w)`, the GDN gated RMSNorm (plain `w`, SiLU
//! gate), and the L2 norm of GDN q/k (epsilon on the sum of squares).

use super::silu;

/// Zero-centred RMSNorm of every `w.len()`-wide row: `x / rms(x) * (1 + w)`.
pub fn rms_norm_zero_centred(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_zero_centred_inplace(&mut out, w, eps);
    out
}

pub fn rms_norm_zero_centred_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = *v * r * (1.0 + wi);
        }
    }
}

/// Gated RMSNorm of one value head: `o / rms(o) * w * SiLU(z)` (plain weight).
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let ms = o.iter().map(|v| v * v).sum::<f32>() / o.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((v, wi), zi) in o.iter_mut().zip(w).zip(z) {
        *v = *v * r * wi * silu(*zi);
    }
}

/// `x / sqrt(sum(x²) + eps)`.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_centred_uses_one_plus_w() {
        let x = [3.0f32, -4.0];
        let y = rms_norm_zero_centred(&x, &[0.0, 1.0], 0.0);
        let rms = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / rms).abs() < 1e-6);
        assert!((y[1] - 2.0 * -4.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn l2_eps_is_on_the_sum() {
        let mut x = [3.0f32, 4.0];
        l2_normalize(&mut x, 11.0);
        assert!((x[0] - 0.5).abs() < 1e-6 && (x[1] - 4.0 / 6.0).abs() < 1e-6);
    }

    #[test]
    fn gated_norm_plain_weight_and_silu_gate() {
        let mut o = [1.0f32, -1.0];
        gated_rms_norm(&mut o, &[0.0, 2.0], &[2.0, 1.0], 0.0);
        assert_eq!(o[0], 0.0); // SiLU(0) = 0
        assert!((o[1] - -silu(2.0)).abs() < 1e-6);
    }
}
