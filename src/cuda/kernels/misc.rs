//! `misc.cu`: the embedding gather, the bf16 cast, seeded random fills and the bandwidth probes.

use super::{Dev, On, U128, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// `out[t, :] = f32(table[ids[t], :])` for `t` rows of `d`.
    EmbedGather ["embed_gather"] { table: Dev<bf16>, ids: Dev<i32>, out: Dev<f32>, d: i32 }
    /// The greedy id of each of `rows` rows of `ld` logits over ids `< limit` (0 where none
    /// beats -inf), as [`crate::sampling::greedy_id`].
    ArgmaxRows ["argmax_rows"] { logits: Dev<f32>, ld: i32, limit: i32, out: Dev<i32> }
    /// `y = bf16(x)`, `n` values.
    F32ToBf16 ["f32_to_bf16"] { x: Dev<f32>, y: Dev<bf16>, n: u64 }
    /// `out = mean + std * N(0, 1)` (a sum of four seeded uniforms), `n` bf16 values.
    FillRandomBf16 ["fill_random_bf16"] { out: Dev<bf16>, n: u64, seed: u64, mean: f32, std: f32 }
    /// [`FillRandomBf16`] into f32.
    FillRandomF32 ["fill_random_f32"] { out: Dev<f32>, n: u64, seed: u64, mean: f32, std: f32 }
    /// `y = x`, `n` 16-byte words: the copy-bandwidth probe.
    CopyProbe ["copy_probe"] { x: Dev<U128>, y: Dev<U128>, n: u64 }
    /// Reads `items` MiB of 4 KiB rows in 32 KiB stages of `run` 16-byte chunks a row, one
    /// persistent block an SM: the read-bandwidth probe (`xs_out` keeps the reads alive).
    ReadProbe ["read_probe"] { w: Dev<U128>, items: i32, run: i32, xs_out: Dev<u32> }
    /// `out = bf16(q · s)` of FP8 weights `[n, k]` (e4m3 bytes, 16 a word) with their block
    /// scales, for the prefill GEMMs.
    DequantFp8Bf16 ["dequant_fp8_bf16"] { q: Dev<U128>, sc: Dev<f32>, n: u64, k: i32, out: Dev<U128> }
    /// Seeded e4m3 bytes of about `N(0, 1) · mult`, `n` bytes (the synthetic FP8 weights).
    FillRandomE4m3 ["fill_random_e4m3"] { out: Dev<u32>, n: u64, seed: u64, mult: f32 }
    /// `out = bf16(scale · q + bias)` of affine 4-bit weights `[n, k]` in the q4 tile layout
    /// (`crate::cuda::upload::Q4`), for the prefill GEMMs.
    DequantQ4Bf16 ["dequant_q4_bf16"] { q: Dev<U128>, sb: Dev<u32>, group: i32, n: u64, k: i32, out: Dev<bf16> }
    /// Seeded affine 4-bit weights: uniform codes, and (scale, bias) pairs giving weights of
    /// about mean 0 and standard deviation `std` (the synthetic 4-bit model).
    FillRandomQ4 ["fill_random_q4"] { codes: Dev<u32>, n_words: u64, sb: Dev<u32>, n_pairs: u64, seed: u64, std: f32 }
}

/// Dynamic shared memory of `read_probe`: a 4-stage ring of 32 KiB.
pub const READ_PROBE_SMEM: usize = 4 * 32 * 1024;

impl EmbedGather {
    /// One block a row, `rows` rows.
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        let d = self.d as usize;
        ensure!(
            self.out.len >= rows * d && self.ids.len >= rows,
            "embed_gather: {rows} rows of {d}: out {:?}, ids {:?}",
            self.out,
            self.ids
        );
        gpu.run(
            "embed_gather",
            (rows as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

impl ArgmaxRows {
    /// A block a row, `rows` rows.
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        let (ld, limit) = (self.ld as usize, self.limit as usize);
        ensure!(
            limit <= ld
                && self.logits.len >= rows.saturating_sub(1) * ld + limit
                && self.out.len >= rows,
            "argmax_rows: {rows} rows of {ld} (limit {limit}): logits {:?}, out {:?}",
            self.logits,
            self.out
        );
        gpu.run(
            "argmax_rows",
            (rows as u32, 1, 1),
            1024,
            0,
            &self.args(),
            on,
        )
    }
}

impl DequantFp8Bf16 {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (n, k) = (self.n as usize, self.k as usize);
        ensure!(
            k.is_multiple_of(16)
                && self.q.len * 16 >= n * k
                && self.out.len * 8 >= n * k
                && self.sc.len >= n.div_ceil(128) * k.div_ceil(128),
            "dequant_fp8_bf16: [{n}, {k}]: q {:?}, scales {:?}, out {:?}",
            self.q,
            self.sc,
            self.out
        );
        let words = n * k / 16;
        let grid = words.div_ceil(256).clamp(1, 132 * 16) as u32;
        gpu.run("dequant_fp8_bf16", (grid, 1, 1), 256, 0, &self.args(), on)
    }
}

impl DequantQ4Bf16 {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (n, k, group) = (self.n as usize, self.k as usize, self.group as usize);
        ensure!(
            n.is_multiple_of(16)
                && k.is_multiple_of(64)
                && matches!(group, 32 | 64 | 128)
                && k.is_multiple_of(group)
                && self.q.len * 32 >= n * k
                && self.sb.len >= n * (k / group)
                && self.out.len >= n * k,
            "dequant_q4_bf16: [{n}, {k}] group {group}: q {:?}, scales {:?}, out {:?}",
            self.q,
            self.sb,
            self.out
        );
        let words = n * k / 32;
        let grid = words.div_ceil(256).clamp(1, 132 * 16) as u32;
        gpu.run("dequant_q4_bf16", (grid, 1, 1), 256, 0, &self.args(), on)
    }
}

impl FillRandomQ4 {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        ensure!(
            self.codes.len as u64 >= self.n_words && self.sb.len as u64 >= self.n_pairs,
            "fill_random_q4: {} words into {:?}, {} pairs into {:?}",
            self.n_words,
            self.codes,
            self.n_pairs,
            self.sb
        );
        gpu.run(
            "fill_random_q4",
            (1024, 1, 1),
            256,
            0,
            &self.args(),
            On::Plain,
        )
    }
}

impl FillRandomE4m3 {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        ensure!(
            self.n.is_multiple_of(4) && self.out.len as u64 * 4 >= self.n,
            "fill_random_e4m3: {} bytes into {:?}",
            self.n,
            self.out
        );
        gpu.run(
            "fill_random_e4m3",
            (1024, 1, 1),
            256,
            0,
            &self.args(),
            On::Plain,
        )
    }
}

impl FillRandomBf16 {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        ensure!(
            self.out.len as u64 >= self.n,
            "fill_random_bf16: {:?}",
            self.out
        );
        gpu.run(
            "fill_random_bf16",
            (1024, 1, 1),
            256,
            0,
            &self.args(),
            On::Plain,
        )
    }
}

impl FillRandomF32 {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        ensure!(
            self.out.len as u64 >= self.n,
            "fill_random_f32: {:?}",
            self.out
        );
        gpu.run(
            "fill_random_f32",
            (1024, 1, 1),
            256,
            0,
            &self.args(),
            On::Plain,
        )
    }
}

impl CopyProbe {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        ensure!(
            self.x.len as u64 >= self.n && self.y.len as u64 >= self.n,
            "copy_probe: {} words of {:?} into {:?}",
            self.n,
            self.x,
            self.y
        );
        gpu.run(
            "copy_probe",
            (132 * 8, 1, 1),
            512,
            0,
            &self.args(),
            On::Plain,
        )
    }
}

impl ReadProbe {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        let run = self.run as usize;
        ensure!(
            (8..=256).contains(&run) && run.is_power_of_two(),
            "read_probe: run {run} is not a power of two in 8..=256"
        );
        ensure!(
            self.w.len * 16 >= (self.items as usize) << 20 && self.xs_out.len >= gpu.sm_count,
            "read_probe: {} MiB from {:?}",
            self.items,
            self.w
        );
        let grid = (gpu.sm_count as u32, 1, 1);
        gpu.run(
            "read_probe",
            grid,
            128,
            READ_PROBE_SMEM,
            &self.args(),
            On::Plain,
        )
    }
}
