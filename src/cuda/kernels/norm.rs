//! `norm.cu`: the zero-centred RMSNorm into bf16 (the GEMMs' input).

use super::{Dev, On, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// `out[r] = bf16(x[r] / rms(x[r]) * (1 + w))`, rows of `d`.
    RmsnormZcBf16 ["rmsnorm_zc_bf16"] { x: Dev<f32>, w: Dev<f32>, out: Dev<bf16>, d: i32, eps: f32 }
}

impl RmsnormZcBf16 {
    /// A block a row, `rows` rows.
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        let d = self.d as usize;
        ensure!(
            self.x.len >= rows * d && self.out.len >= rows * d && self.w.len >= d,
            "rmsnorm_zc_bf16: {rows} rows of {d}: x {:?}, w {:?}, out {:?}",
            self.x,
            self.w,
            self.out
        );
        gpu.run(
            "rmsnorm_zc_bf16",
            (rows as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}
