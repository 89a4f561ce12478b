//! Dense products against stored weights: `y = x · Wᵀ` with `W` in PyTorch `[out, in]` order.
//!
//! Weights stay in their stored dtype; blocks of rows are widened to f32 just before the
//! f32 GEMM (matrixmultiply), so a bf16 checkpoint is never expanded whole.

use crate::tensor::Mat;
use rayon::prelude::*;

/// Rows of `W` widened per block: about 256 KiB of f32, at least 16 rows.
fn block_rows(cols: usize) -> usize {
    (65_536 / cols.max(1)).clamp(16, 1024)
}

/// `x` is `[t, w.cols]`; returns `[t, w.rows]`.
pub fn matmul(x: &[f32], t: usize, w: &Mat) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k, "matmul: input is not [t, {k}]");
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
}
