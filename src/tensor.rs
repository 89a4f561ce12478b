//! Weight views: a dtype-tagged, zero-copy window into a memory-mapped (or owned) buffer.
//!
//! The CPU backend converts rows to f32 on the fly, so a 67 GB bf16 checkpoint is never
//! expanded in memory. New storage formats become new `DType`s here without touching the
//! model graph.
//!
//! FP8 (the official Qwen3.6-35B-A3B-FP8 release): [`DType::F8E4M3`] bytes stay mapped as
//! stored, and the matrix carries its block scales ([`BlockScales`], f32): element
//! `(r, c)` is `e4m3(q[r, c]) * scale[r / 128, c / 128]`. Every reader of a `Mat`
//! ([`Mat::rows_f32`], and so the GEMMs) applies the scales, so the model graph is unchanged.

use half::{bf16, f16};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// `float8_e4m3fn`: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN at
    /// `0x7f`/`0xff`, largest finite 448. A matrix of it always has [`BlockScales`].
    F8E4M3,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
        }
    }
}

/// The value of every e4m3fn byte (NaN for `0x7f` and `0xff`).
pub static E4M3_TABLE: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let exp = ((b >> 3) & 0xf) as i32;
        let man = (b & 7) as f32;
        let mag = if exp == 0xf && (b & 7) == 7 {
            f32::NAN
        } else if exp == 0 {
            // subnormal: m/8 * 2^-6
            man / 8.0 / 64.0
        } else {
            let mut p = 1.0f32;
            let mut e = exp - 7;
            while e > 0 {
                p *= 2.0;
                e -= 1;
            }
            while e < 0 {
                p /= 2.0;
                e += 1;
            }
            (1.0 + man / 8.0) * p
        };
        t[b] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
}

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Rounds `v` to the nearest e4m3fn byte (ties to even), saturating to ±448 (as
/// `torch.clamp(x, -448, 448).to(torch.float8_e4m3fn)`); NaN maps to `0x7f`.
pub fn e4m3_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs().min(E4M3_MAX);
    // Positive codes 0x00..=0x7e are increasing in value: find the nearest.
    let pos = &E4M3_TABLE[..0x7f];
    let hi = pos.partition_point(|x| *x < a); // first code with value >= a
    let code = if hi == 0 {
        0
    } else if hi >= pos.len() {
        0x7e
    } else {
        let (lo_v, hi_v) = (pos[hi - 1], pos[hi]);
        let (dl, dh) = (a - lo_v, hi_v - a);
        if dl < dh || (dl == dh && (hi - 1) % 2 == 0) {
            hi - 1
        } else {
            hi
        }
    };
    sign | code as u8
}

/// Block scales of an FP8 matrix: `values[br * grid_cols + bc]` multiplies the block of rows
/// `[br*block_rows, ..)` and columns `[bc*block_cols, ..)` of the *stored* tensor (the
/// `weight_scale_inv` tensor, upcast to f32). The last block of a row or column may be
/// partial (`grid = ceil(dims / block)`).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockScales {
    pub values: Arc<Vec<f32>>,
    pub grid_rows: usize,
    pub grid_cols: usize,
    pub block_rows: usize,
    pub block_cols: usize,
    /// The stored tensor's row where this matrix (a view, see [`Mat::rows_view`]) starts.
    pub row0: usize,
}

impl BlockScales {
    /// The scale row for row `r` of the matrix.
    #[inline]
    pub fn row(&self, r: usize) -> &[f32] {
        let br = (self.row0 + r) / self.block_rows;
        &self.values[br * self.grid_cols..(br + 1) * self.grid_cols]
    }

    pub fn nbytes(&self) -> usize {
        self.values.len() * 4
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

/// A row-major 2-D matrix `[rows, cols]` of `dtype` at `offset` bytes into `storage`;
/// `scales` is `Some` exactly when `dtype` is [`DType::F8E4M3`].
#[derive(Clone)]
pub struct Mat {
    pub storage: Arc<Storage>,
    pub offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub scales: Option<BlockScales>,
}

impl std::fmt::Debug for Mat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mat[{}x{} {}", self.rows, self.cols, self.dtype.name())?;
        if let Some(s) = &self.scales {
            write!(f, " block {}x{}", s.block_rows, s.block_cols)?;
        }
        write!(f, "]")
    }
}

impl Mat {
    /// The raw bytes of the whole matrix.
    pub fn bytes(&self) -> &[u8] {
        let len = self.rows * self.cols * self.dtype.size();
        &self.storage.bytes()[self.offset..self.offset + len]
    }

    /// Bytes of the stored elements (for FP8, without the scales: see [`Mat::scale_bytes`]).
    pub fn nbytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size()
    }

    /// Bytes of the f32 block scales this matrix reads (0 unless FP8). A view counts the
    /// scale rows it touches.
    pub fn scale_bytes(&self) -> usize {
        match &self.scales {
            None => 0,
            Some(_) if self.rows == 0 => 0,
            Some(s) => {
                let first = s.row0 / s.block_rows;
                let last = (s.row0 + self.rows - 1) / s.block_rows;
                (last - first + 1) * s.grid_cols * 4
            }
        }
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
            scales: self.scales.clone().map(|mut s| {
                s.row0 += start;
                s
            }),
        }
    }

    /// Converts rows `[r0, r1)` to f32 into `out` (len `(r1 - r0) * cols`); FP8 rows are
    /// dequantised with their block scales.
    pub fn rows_f32(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let es = self.dtype.size();
        let start = self.offset + r0 * self.cols * es;
        let src = &self.storage.bytes()[start..start + (r1 - r0) * self.cols * es];
        match &self.scales {
            None => convert_to_f32(self.dtype, src, out),
            Some(s) => {
                let bc = s.block_cols;
                for (i, (q, o)) in src
                    .chunks_exact(self.cols)
                    .zip(out.chunks_exact_mut(self.cols))
                    .enumerate()
                {
                    let srow = s.row(r0 + i);
                    for ((qb, ob), sc) in q.chunks(bc).zip(o.chunks_mut(bc)).zip(srow) {
                        for (x, y) in qb.iter().zip(ob.iter_mut()) {
                            *y = E4M3_TABLE[*x as usize] * sc;
                        }
                    }
                }
            }
        }
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
        assert_ne!(dtype, DType::F8E4M3, "use Mat::quantize_fp8");
        Mat {
            storage: Arc::new(Storage::Owned(encode_f32(values, dtype))),
            offset: 0,
            dtype,
            rows,
            cols,
            scales: None,
        }
    }

    /// Quantises f32 values to FP8 with `block` scales, as transformers' fine-grained FP8
    /// quantiser (`Fp8Quantize`) does: per block `amax = max |w|`. Partial edge blocks
    /// (rows or cols not a multiple of the block) use their own elements; transformers'
    /// quantiser leaves such shapes unquantised, and the release has none.
    pub fn quantize_fp8(values: &[f32], rows: usize, cols: usize, block: [usize; 2]) -> Mat {
        assert_eq!(values.len(), rows * cols);
        let (br, bc) = (block[0], block[1]);
        let (gr, gc) = (rows.div_ceil(br), cols.div_ceil(bc));
        // transformers: `scale = 448 / amax` (1 for an all-zero block), `q = e4m3(clamp(w *
        // scale))`, stored `scale_inv = 1 / scale`; all in f32.
        let mut fwd = vec![1.0f32; gr * gc];
        for (i, s) in fwd.iter_mut().enumerate() {
            let (r0, c0) = ((i / gc) * br, (i % gc) * bc);
            let mut amax = 0.0f32;
            for r in r0..(r0 + br).min(rows) {
                for v in &values[r * cols + c0..r * cols + (c0 + bc).min(cols)] {
                    amax = amax.max(v.abs());
                }
            }
            if amax > 0.0 {
                *s = E4M3_MAX / amax;
            }
        }
        let scales: Vec<f32> = fwd.iter().map(|s| 1.0 / s).collect();
        let mut q = vec![0u8; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                let v = values[r * cols + c] * fwd[(r / br) * gc + c / bc];
                q[r * cols + c] = e4m3_from_f32(v);
            }
        }
        Mat {
            storage: Arc::new(Storage::Owned(q)),
            offset: 0,
            dtype: DType::F8E4M3,
            rows,
            cols,
            scales: Some(BlockScales {
                values: Arc::new(scales),
                grid_rows: gr,
                grid_cols: gc,
                block_rows: br,
                block_cols: bc,
                row0: 0,
            }),
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
        // Unscaled e4m3 values (a matrix applies its block scales in `Mat::rows_f32`).
        DType::F8E4M3 => {
            for (o, b) in out.iter_mut().zip(src) {
                *o = E4M3_TABLE[*b as usize];
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
        // Unscaled (values must already be in e4m3 range; see `Mat::quantize_fp8`).
        DType::F8E4M3 => values.iter().for_each(|v| out.push(e4m3_from_f32(*v))),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// e4m3fn by its definition: sign, 4-bit exponent with bias 7, 3-bit mantissa.
    fn e4m3_by_formula(b: u8) -> f32 {
        let (e, m) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
        let mag = if e == 15 && m == 7.0 {
            f32::NAN
        } else if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        if b & 0x80 != 0 { -mag } else { mag }
    }

    #[test]
    fn e4m3_table_decode_and_encode() {
        for b in 0..=255u8 {
            let (t, f) = (E4M3_TABLE[b as usize], e4m3_by_formula(b));
            assert!(
                t.to_bits() == f.to_bits() || (t.is_nan() && f.is_nan()),
                "{b:#x}"
            );
            if !t.is_nan() {
                assert_eq!(e4m3_from_f32(t), b, "{b:#x} = {t}");
            }
        }
        assert_eq!(E4M3_TABLE[0x38], 1.0);
        assert_eq!(E4M3_TABLE[0x7e], 448.0);
        assert_eq!(E4M3_TABLE[0x01], 2f32.powi(-9));
        assert!(E4M3_TABLE[0x7f].is_nan() && E4M3_TABLE[0xff].is_nan());
        // Ties go to the even code; out of range saturates (as clamp-then-cast does).
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        assert_eq!(e4m3_from_f32(1e6), 0x7e);
        assert_eq!(e4m3_from_f32(-460.0), 0xfe);
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00); // half the smallest subnormal: even
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 0x02);
    }

    #[test]
    fn fp8_quantise_dequantise_with_ragged_blocks_and_views() {
        // 130 x 200 with 128 x 128 blocks: a 2 x 2 grid whose last row and column are partial.
        let (rows, cols) = (130, 200);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 7 == 0 { 0.1 } else { 0.01 })
            .collect();
        let m = Mat::quantize_fp8(&vals, rows, cols, [128, 128]);
        let s = m.scales.as_ref().unwrap();
        assert_eq!((s.grid_rows, s.grid_cols), (2, 2));
        assert_eq!(m.nbytes(), rows * cols);
        assert_eq!(m.scale_bytes(), 16);
        let deq = m.to_f32();
        for r in 0..rows {
            for c in 0..cols {
                let (w, d) = (vals[r * cols + c], deq[r * cols + c]);
                let inv = s.values[(r / 128) * 2 + c / 128];
                // Half an e4m3 ulp: 2^-4 relative for normals, 2^-10 * scale for subnormals.
                let tol = (w.abs() / 16.0).max(inv * 2f32.powi(-10)) * 1.0001;
                assert!((w - d).abs() <= tol, "({r},{c}) {w} -> {d}");
                // and it is the block formula on the stored byte
                let q = m.bytes()[r * cols + c];
                assert_eq!(d, e4m3_by_formula(q) * inv);
            }
        }
        // The block max maps to 448 exactly.
        assert!(m.bytes().iter().any(|b| *b == 0x7e || *b == 0xfe));
        // Views keep the block grid of the stored tensor (start 100 crosses a block edge).
        let v = m.rows_view(100, 30);
        assert_eq!(v.to_f32(), deq[100 * cols..130 * cols].to_vec());
        assert_eq!(v.scale_bytes(), 16);
        assert_eq!(m.rows_view(0, 128).scale_bytes(), 8);
    }

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
