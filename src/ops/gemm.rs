//! Dense products against stored weights: `y = x · Wᵀ` with `W` in PyTorch `[out, in]` order.
//!
//! Weights stay in their stored dtype; blocks of rows are widened to f32 just before the
//! f32 GEMM (matrixmultiply), so a bf16 checkpoint is never expanded whole. FP8 weights are
//! widened the same way (e4m3 table times the block's scale, [`Mat::rows_f32`]) for prefill;
//! for a few rows ([`FP8_DIRECT_MAX_ROWS`], decode) [`matmul_fp8_direct`] reads the bytes once
//! and applies each 128-block's scale to its partial sum, the order a W8A16 GEMV uses.

use crate::tensor::{DType, E4M3_TABLE, Mat};
use rayon::prelude::*;

/// Up to this many input rows an FP8 product takes [`matmul_fp8_direct`].
pub const FP8_DIRECT_MAX_ROWS: usize = 8;

/// Rows of `W` widened per block: about 256 KiB of f32, at least 16 rows.
fn block_rows(cols: usize) -> usize {
    (65_536 / cols.max(1)).clamp(16, 1024)
}

/// `x` is `[t, w.cols]`; returns `[t, w.rows]`.
pub fn matmul(x: &[f32], t: usize, w: &Mat) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k, "matmul: input is not [t, {k}]");
    if w.dtype == DType::F8E4M3 && t <= FP8_DIRECT_MAX_ROWS {
        return matmul_fp8_direct(x, t, w);
    }
    let mut y = vec![0.0f32; t * n];
    if t == 0 || n == 0 {
        return y;
    }
    let nb = block_rows(k);
    let blocks: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(nb))
        .into_par_iter()
        .map(|b| {
            let r0 = b * nb;
            let r1 = (r0 + nb).min(n);
            let rows = r1 - r0;
            let mut wb = vec![0.0f32; rows * k];
            w.rows_f32(r0, r1, &mut wb);
            let mut out = vec![0.0f32; t * rows];
            // SAFETY: all pointers cover exactly the extents given by the dims and strides.
            unsafe {
                matrixmultiply::sgemm(
                    t,
                    k,
                    rows,
                    1.0,
                    x.as_ptr(),
                    k as isize,
                    1,
                    wb.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    out.as_mut_ptr(),
                    rows as isize,
                    1,
                );
            }
            (r0, out)
        })
        .collect();
    for (r0, out) in blocks {
        let rows = out.len() / t;
        for i in 0..t {
            y[i * n + r0..i * n + r0 + rows].copy_from_slice(&out[i * rows..(i + 1) * rows]);
        }
    }
    y
}

/// `y = x · Wᵀ` for an FP8 `W` (`x [t, w.cols]`, `y [t, w.rows]`) straight from the e4m3
/// bytes: per weight row and 128-column block, the decoded block is dotted with each input
/// row and the sum scaled by the block's `weight_scale_inv` (f32 throughout).
pub fn matmul_fp8_direct(x: &[f32], t: usize, w: &Mat) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k, "matmul_fp8_direct: input is not [t, {k}]");
    let s = w
        .scales
        .as_ref()
        .expect("matmul_fp8_direct: an FP8 matrix has block scales");
    let bc = s.block_cols;
    let mut y = vec![0.0f32; t * n];
    if t == 0 || n == 0 {
        return y;
    }
    let bytes = w.bytes();
    const ROWS: usize = 64;
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(ROWS))
        .into_par_iter()
        .map(|p| {
            let (r0, r1) = (p * ROWS, ((p + 1) * ROWS).min(n));
            let mut out = vec![0.0f32; (r1 - r0) * t];
            let mut wb = vec![0.0f32; bc];
            for r in r0..r1 {
                let srow = s.row(r);
                let q = &bytes[r * k..(r + 1) * k];
                for (b, (qb, sc)) in q.chunks(bc).zip(srow).enumerate() {
                    let wb = &mut wb[..qb.len()];
                    for (o, v) in wb.iter_mut().zip(qb) {
                        *o = E4M3_TABLE[*v as usize];
                    }
                    let c0 = b * bc;
                    for i in 0..t {
                        let xb = &x[i * k + c0..i * k + c0 + qb.len()];
                        out[(r - r0) * t + i] += dot(xb, wb) * sc;
                    }
                }
            }
            (r0, out)
        })
        .collect();
    for (r0, out) in parts {
        for (j, row) in out.chunks_exact(t).enumerate() {
            for (i, v) in row.iter().enumerate() {
                y[i * n + r0 + j] = *v;
            }
        }
    }
    y
}

/// Dynamic activation quantisation (`activation_scheme: dynamic`), per input row and
/// `group`-column group: `s = max(amax, 1e-10) / 448`, `q = e4m3(clamp(x / s, ±448))`, as
/// vLLM's per-token-group FP8 quantiser does. Returns (`q [t, k]`, `s [t, ceil(k / group)]`).
pub fn quantize_activations_e4m3(
    x: &[f32],
    t: usize,
    k: usize,
    group: usize,
) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(x.len(), t * k);
    let g = k.div_ceil(group);
    let mut q = vec![0u8; t * k];
    let mut s = vec![0.0f32; t * g];
    for i in 0..t {
        for b in 0..g {
            let (c0, c1) = (b * group, ((b + 1) * group).min(k));
            let xs = &x[i * k + c0..i * k + c1];
            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let sc = amax.max(1e-10) / crate::tensor::E4M3_MAX;
            s[i * g + b] = sc;
            for (o, v) in q[i * k + c0..i * k + c1].iter_mut().zip(xs) {
                *o = crate::tensor::e4m3_from_f32(v / sc);
            }
        }
    }
    (q, s)
}

/// The W8A8 product the GPU's FP8 tensor-core GEMMs compute (transformers' and vLLM's
/// fine-grained FP8 path): activations quantised per row and 128-group
/// ([`quantize_activations_e4m3`]), then `y[i, r] = Σ_b s_x[i, b] · s_w[r/128, b] ·
/// Σ_{c in b} x_q[i, c] · w_q[r, c]`, accumulated in f32. Not used by the CPU model (which is
/// weight-only, [`matmul`]); an oracle for the GPU kernels. The activation group is the
/// weight's column block.
pub fn matmul_fp8_w8a8(x: &[f32], t: usize, w: &Mat) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k, "matmul_fp8_w8a8: input is not [t, {k}]");
    let s = w
        .scales
        .as_ref()
        .expect("matmul_fp8_w8a8: an FP8 matrix has block scales");
    let bc = s.block_cols;
    let g = k.div_ceil(bc);
    let (xq, xs) = quantize_activations_e4m3(x, t, k, bc);
    let xd: Vec<f32> = xq.iter().map(|b| E4M3_TABLE[*b as usize]).collect();
    let bytes = w.bytes();
    let rows: Vec<Vec<f32>> = (0..n)
        .into_par_iter()
        .map(|r| {
            let srow = s.row(r);
            let wd: Vec<f32> = bytes[r * k..(r + 1) * k]
                .iter()
                .map(|b| E4M3_TABLE[*b as usize])
                .collect();
            (0..t)
                .map(|i| {
                    (0..g)
                        .map(|b| {
                            let (c0, c1) = (b * bc, ((b + 1) * bc).min(k));
                            dot(&xd[i * k + c0..i * k + c1], &wd[c0..c1]) * xs[i * g + b] * srow[b]
                        })
                        .sum::<f32>()
                })
                .collect()
        })
        .collect();
    let mut y = vec![0.0f32; t * n];
    for (r, col) in rows.iter().enumerate() {
        for (i, v) in col.iter().enumerate() {
            y[i * n + r] = *v;
        }
    }
    y
}

/// Rounds values to bf16 precision (kept as f32): what a bf16 GEMM input sees.
pub fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect()
}

/// [`matmul`], optionally with the input rounded to bf16 first (the GPU's precision).
pub fn matmul_act(x: &[f32], t: usize, w: &Mat, bf16_input: bool) -> Vec<f32> {
    if bf16_input {
        matmul(&round_bf16(x), t, w)
    } else {
        matmul(x, t, w)
    }
}

/// Dot product in f32.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn matches_naive_product_across_blocks() {
        let (t, k, n) = (3, 40, 2000); // n spans several row blocks
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let wv: Vec<f32> = (0..n * k)
            .map(|i| ((i * 11) % 17) as f32 / 17.0 - 0.5)
            .collect();
        for dt in [DType::F32, DType::BF16] {
            let w = Mat::from_f32(&wv, n, k, dt);
            let wf = w.to_f32();
            let y = matmul(&x, t, &w);
            for i in 0..t {
                for j in 0..n {
                    let r = dot(&x[i * k..(i + 1) * k], &wf[j * k..(j + 1) * k]);
                    assert!((y[i * n + j] - r).abs() < 1e-4, "{dt:?} {i} {j}");
                }
            }
        }
    }

    /// The reference for FP8: dequantise every element by the format's definition (e4m3 by
    /// its bit fields, times the scale of its block), then a plain f64 product.
    fn fp8_reference(x: &[f32], t: usize, w: &Mat) -> Vec<f32> {
        let s = w.scales.as_ref().unwrap();
        let decode = |b: u8| -> f64 {
            let (e, m) = (((b >> 3) & 0xf) as i32, (b & 7) as f64);
            let mag = if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            if b & 0x80 != 0 { -mag } else { mag }
        };
        let (n, k) = (w.rows, w.cols);
        let mut deq = vec![0.0f64; n * k];
        for r in 0..n {
            for c in 0..k {
                let sr = (s.row0 + r) / s.block_rows;
                let sc = s.values[sr * s.grid_cols + c / s.block_cols] as f64;
                deq[r * k + c] = decode(w.bytes()[r * k + c]) * sc;
            }
        }
        let mut y = vec![0.0f32; t * n];
        for i in 0..t {
            for j in 0..n {
                let mut acc = 0.0f64;
                for c in 0..k {
                    acc += x[i * k + c] as f64 * deq[j * k + c];
                }
                y[i * n + j] = acc as f32;
            }
        }
        y
    }

    #[test]
    fn fp8_kernels_match_dequantise_then_matmul() {
        // Ragged both ways (300 = 2*128 + 44 rows, 330 = 2*128 + 74 cols) and block-aligned;
        // the weights vary in scale by block so a wrong block index shows.
        for (n, k) in [(300, 330), (256, 128), (5, 130)] {
            let wv: Vec<f32> = (0..n * k)
                .map(|i| {
                    let (r, c) = (i / k, i % k);
                    let mag = 0.01 * (1 + (r / 128) * 3 + (c / 128) * 7) as f32;
                    (((i * 11) % 17) as f32 / 17.0 - 0.5) * mag
                })
                .collect();
            let w = Mat::quantize_fp8(&wv, n, k, [128, 128]);
            for t in [1, 3, FP8_DIRECT_MAX_ROWS, FP8_DIRECT_MAX_ROWS + 1, 20] {
                let x: Vec<f32> = (0..t * k)
                    .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
                    .collect();
                let want = fp8_reference(&x, t, &w);
                let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let check = |got: &[f32], what: &str| {
                    for (j, (g, r)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - r).abs() <= 1e-5 * scale.max(1e-3),
                            "{what} n {n} k {k} t {t} at {j}: {g} vs {r}"
                        );
                    }
                };
                check(&matmul_fp8_direct(&x, t, &w), "direct");
                check(&matmul(&x, t, &w), "matmul");
                // A view starting mid-block (the per-expert views of a fused tensor).
                if n > 140 {
                    let v = w.rows_view(100, 40);
                    let want_v: Vec<f32> = (0..t)
                        .flat_map(|i| want[i * n + 100..i * n + 140].to_vec())
                        .collect();
                    let got = matmul(&x, t, &v);
                    for (g, r) in got.iter().zip(&want_v) {
                        assert!((g - r).abs() <= 1e-5 * scale.max(1e-3), "view t {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn w8a8_fp8_matches_its_definition_and_stays_near_the_weight_only_product() {
        let (n, k, t) = (150, 300, 3);
        let wv: Vec<f32> = (0..n * k)
            .map(|i| (((i * 11) % 17) as f32 / 17.0 - 0.5) * 0.05)
            .collect();
        let w = Mat::quantize_fp8(&wv, n, k, [128, 128]);
        let x: Vec<f32> = (0..t * k)
            .map(|i| (((i * 7) % 13) as f32 / 13.0 - 0.5) * if i % 5 == 0 { 3.0 } else { 1.0 })
            .collect();
        // Reference: quantise each 128-group of x by the definition, dequantise, then the
        // f64 dequantise-then-matmul reference of the weight-only test.
        let mut xdq = vec![0.0f32; t * k];
        for i in 0..t {
            for b in 0..k.div_ceil(128) {
                let (c0, c1) = (b * 128, ((b + 1) * 128).min(k));
                let amax = x[i * k + c0..i * k + c1]
                    .iter()
                    .fold(0.0f32, |a, v| a.max(v.abs()));
                let sc = amax / 448.0;
                for c in c0..c1 {
                    let q = crate::tensor::e4m3_from_f32(x[i * k + c] / sc);
                    xdq[i * k + c] = crate::tensor::E4M3_TABLE[q as usize] * sc;
                }
            }
        }
        let want = fp8_reference(&xdq, t, &w);
        let got = matmul_fp8_w8a8(&x, t, &w);
        let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        for (g, r) in got.iter().zip(&want) {
            assert!((g - r).abs() <= 1e-5 * scale, "{g} vs {r}");
        }
        // Activation rounding moves the product by a few percent of its scale at most.
        let wo = matmul(&x, t, &w);
        let d = got
            .iter()
            .zip(&wo)
            .fold(0.0f32, |a, (g, r)| a.max((g - r).abs()));
        assert!(
            d > 0.0 && d < 0.05 * scale,
            "W8A8 vs weight-only: {d} of {scale}"
        );
    }
}
