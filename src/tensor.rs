//! Weight views: a dtype-tagged, zero-copy window into a memory-mapped (or owned) buffer.
//!
//! The CPU backend converts rows to f32 on the fly, so a 67 GB bf16 checkpoint is never
//! expanded in memory. New storage formats (MLX affine int4, FP8 with block scales) become new
//! `DType`s / `Mat` variants here without touching the model graph.

use half::{bf16, f16};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }
}

/// Bytes that back weights: a memory-mapped file or an owned buffer (synthetic models).
pub enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A row-major 2-D matrix `[rows, cols]` of `dtype` at `offset` bytes into `storage`.
#[derive(Clone)]
pub struct Mat {
    pub storage: Arc<Storage>,
    pub offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl std::fmt::Debug for Mat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mat[{}x{} {}]", self.rows, self.cols, self.dtype.name())
    }
}

impl Mat {
    /// The raw bytes of the whole matrix.
    pub fn bytes(&self) -> &[u8] {
        let len = self.rows * self.cols * self.dtype.size();
        &self.storage.bytes()[self.offset..self.offset + len]
    }

    pub fn nbytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size()
    }

    /// Rows `[start, start + n)` as a new view (no copy).
    pub fn rows_view(&self, start: usize, n: usize) -> Mat {
        assert!(start + n <= self.rows, "row range out of bounds");
        Mat {
            storage: self.storage.clone(),
            offset: self.offset + start * self.cols * self.dtype.size(),
            dtype: self.dtype,
            rows: n,
            cols: self.cols,
        }
    }

    /// Converts rows `[r0, r1)` to f32 into `out` (len `(r1 - r0) * cols`).
    pub fn rows_f32(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let es = self.dtype.size();
        let start = self.offset + r0 * self.cols * es;
        let src = &self.storage.bytes()[start..start + (r1 - r0) * self.cols * es];
        convert_to_f32(self.dtype, src, out);
    }

    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut v = vec![0.0; self.cols];
        self.rows_f32(r, r + 1, &mut v);
        v
    }

    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        self.rows_f32(0, self.rows, &mut v);
        v
    }

    /// An owned matrix from f32 values, stored as `dtype` (synthetic and test weights).
    pub fn from_f32(values: &[f32], rows: usize, cols: usize, dtype: DType) -> Mat {
        assert_eq!(values.len(), rows * cols);
        Mat {
            storage: Arc::new(Storage::Owned(encode_f32(values, dtype))),
            offset: 0,
            dtype,
            rows,
            cols,
        }
    }
}

/// Decodes little-endian `dtype` bytes into f32 (bytes may be unaligned).
pub fn convert_to_f32(dtype: DType, src: &[u8], out: &mut [f32]) {
    debug_assert_eq!(src.len(), out.len() * dtype.size());
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}

/// Encodes f32 values as little-endian `dtype` bytes (round to nearest even).
pub fn encode_f32(values: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    match dtype {
        DType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_views() {
        let vals: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let m = Mat::from_f32(&vals, 3, 4, dt);
            assert_eq!(m.to_f32(), vals, "{dt:?}");
            assert_eq!(m.rows_view(1, 2).row_f32(1), vals[8..12].to_vec());
        }
        let m = Mat::from_f32(&[1.0 / 3.0], 1, 1, DType::BF16);
        assert!((m.to_f32()[0] - 1.0 / 3.0).abs() < 2e-3);
        assert_ne!(m.to_f32()[0], 1.0 / 3.0);
    }
}
