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
//!
//! Affine 4- and 8-bit (MLX's `affine` mode, and GPTQ / AWQ / compressed-tensors W4A16
//! mapped onto it at load): [`DType::U4`] / [`DType::U8`] codes packed into little-endian
//! u32 words, lowest bits first (element `c` of a row is bits `bits*(c % per_word)` of word
//! `c / per_word`), and the matrix carries [`Affine`] group scales and biases:
//! `w[r, c] = scale[r, g] * q[r, c] + bias[r, g]` with `g = c / group` (or a stored column
//! to group map for GPTQ act-order). The codes stay mapped as stored.

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
    /// Unsigned 4-bit affine codes, 8 a u32 word, lowest nibble first. A matrix of it always
    /// has [`Affine`] scales and biases.
    U4,
    /// Unsigned 8-bit affine codes (4 a u32 word, lowest byte first, i.e. plain bytes). A
    /// matrix of it always has [`Affine`] scales and biases.
    U8,
}

impl DType {
    /// Bits an element.
    pub fn bits(self) -> usize {
        match self {
            DType::F32 => 32,
            DType::F16 | DType::BF16 => 16,
            DType::F8E4M3 | DType::U8 => 8,
            DType::U4 => 4,
        }
    }
    /// Bytes an element (a 4-bit type has none: see [`DType::bytes_for`]).
    pub fn size(self) -> usize {
        assert!(
            self.bits() >= 8,
            "{} packs two elements a byte",
            self.name()
        );
        self.bits() / 8
    }
    /// Bytes of `n` elements (`n` even for a 4-bit type).
    pub fn bytes_for(self, n: usize) -> usize {
        n * self.bits() / 8
    }
    /// Whether this is an affine-quantised code type (its matrices carry [`Affine`]).
    pub fn is_affine(self) -> bool {
        matches!(self, DType::U4 | DType::U8)
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            DType::U4 => "U4",
            DType::U8 => "U8",
        }
    }
}

/// The group scales and biases of an affine-quantised matrix ([`DType::U4`] / [`DType::U8`]):
/// `scales` and `biases` are float matrices `[rows, groups]` (stored dtype, mapped or owned);
/// `w[r, c] = scales[r, g(c)] * q[r, c] + biases[r, g(c)]`, `g(c) = c / group` unless
/// `col_group` maps each column to its group (GPTQ act-order).
#[derive(Clone, Debug)]
pub struct Affine {
    pub group: usize,
    pub scales: Mat,
    pub biases: Mat,
    pub col_group: Option<Arc<Vec<u32>>>,
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
/// `scales` is `Some` exactly when `dtype` is [`DType::F8E4M3`], `affine` exactly when it
/// is [`DType::U4`] or [`DType::U8`].
#[derive(Clone)]
pub struct Mat {
    pub storage: Arc<Storage>,
    pub offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub scales: Option<BlockScales>,
    pub affine: Option<Box<Affine>>,
}

impl std::fmt::Debug for Mat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mat[{}x{} {}", self.rows, self.cols, self.dtype.name())?;
        if let Some(s) = &self.scales {
            write!(f, " block {}x{}", s.block_rows, s.block_cols)?;
        }
        if let Some(a) = &self.affine {
            write!(f, " group {} {}", a.group, a.scales.dtype.name())?;
        }
        write!(f, "]")
    }
}

impl Mat {
    /// The raw bytes of the whole matrix.
    pub fn bytes(&self) -> &[u8] {
        let len = self.nbytes();
        &self.storage.bytes()[self.offset..self.offset + len]
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.cols)
    }

    /// Bytes of the stored elements (for FP8 and affine, without the scales: see
    /// [`Mat::scale_bytes`]).
    pub fn nbytes(&self) -> usize {
        self.rows * self.row_bytes()
    }

    /// Bytes of the scales this matrix reads: FP8 block scales (f32; a view counts the
    /// scale rows it touches), or affine scales plus biases as stored; 0 otherwise.
    pub fn scale_bytes(&self) -> usize {
        if let Some(a) = &self.affine {
            return a.scales.nbytes() + a.biases.nbytes();
        }
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
            offset: self.offset + start * self.row_bytes(),
            dtype: self.dtype,
            rows: n,
            cols: self.cols,
            scales: self.scales.clone().map(|mut s| {
                s.row0 += start;
                s
            }),
            affine: self.affine.as_ref().map(|a| {
                Box::new(Affine {
                    group: a.group,
                    scales: a.scales.rows_view(start, n),
                    biases: a.biases.rows_view(start, n),
                    col_group: a.col_group.clone(),
                })
            }),
        }
    }

    /// Converts rows `[r0, r1)` to f32 into `out` (len `(r1 - r0) * cols`); FP8 rows are
    /// dequantised with their block scales, affine rows with their group scales and biases.
    pub fn rows_f32(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let start = self.offset + r0 * rb;
        let src = &self.storage.bytes()[start..start + (r1 - r0) * rb];
        if let Some(a) = &self.affine {
            let groups = a.scales.cols;
            let (mut s, mut b) = (vec![0.0f32; groups], vec![0.0f32; groups]);
            for (i, (q, o)) in src
                .chunks_exact(rb)
                .zip(out.chunks_exact_mut(self.cols))
                .enumerate()
            {
                a.scales.rows_f32(r0 + i, r0 + i + 1, &mut s);
                a.biases.rows_f32(r0 + i, r0 + i + 1, &mut b);
                decode_affine_row(self.dtype, q, o);
                match &a.col_group {
                    None => {
                        for ((ob, sc), bi) in o.chunks_mut(a.group).zip(&s).zip(&b) {
                            ob.iter_mut().for_each(|y| *y = sc * *y + bi);
                        }
                    }
                    Some(map) => {
                        for (y, g) in o.iter_mut().zip(map.iter()) {
                            let g = *g as usize;
                            *y = s[g] * *y + b[g];
                        }
                    }
                }
            }
            return;
        }
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
        assert!(!dtype.is_affine(), "use Mat::quantize_affine");
        Mat {
            storage: Arc::new(Storage::Owned(encode_f32(values, dtype))),
            offset: 0,
            dtype,
            rows,
            cols,
            scales: None,
            affine: None,
        }
    }

    /// Quantises f32 values to `bits`-bit affine codes (4 or 8) with `group` columns a
    /// scale, as MLX's `quantize` does in spirit (per group `scale = (max - min) / (2^bits -
    /// 1)`, `bias = min`, codes rounded and clamped), with bf16 scales and biases. For
    /// synthetic and test weights; the dequantised values are what the model computes with.
    pub fn quantize_affine(
        values: &[f32],
        rows: usize,
        cols: usize,
        bits: usize,
        group: usize,
    ) -> Mat {
        assert_eq!(values.len(), rows * cols);
        assert!(bits == 4 || bits == 8, "affine bits must be 4 or 8");
        assert!(group > 0 && cols.is_multiple_of(group) && cols.is_multiple_of(32 / bits));
        let groups = cols / group;
        let levels = ((1u32 << bits) - 1) as f32;
        let (mut sc, mut bi) = (vec![0.0f32; rows * groups], vec![0.0f32; rows * groups]);
        let mut codes = vec![0u32; rows * cols];
        for r in 0..rows {
            for g in 0..groups {
                let v = &values[r * cols + g * group..r * cols + (g + 1) * group];
                let (lo, hi) = v
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
                let s = bf16::from_f32(((hi - lo) / levels).max(1e-8)).to_f32();
                let b = bf16::from_f32(lo).to_f32();
                sc[r * groups + g] = s;
                bi[r * groups + g] = b;
                for (j, x) in v.iter().enumerate() {
                    codes[r * cols + g * group + j] =
                        ((x - b) / s).round().clamp(0.0, levels) as u32;
                }
            }
        }
        let dtype = if bits == 4 { DType::U4 } else { DType::U8 };
        Mat {
            storage: Arc::new(Storage::Owned(pack_codes(&codes, bits))),
            offset: 0,
            dtype,
            rows,
            cols,
            scales: None,
            affine: Some(Box::new(Affine {
                group,
                scales: Mat::from_f32(&sc, rows, groups, DType::BF16),
                biases: Mat::from_f32(&bi, rows, groups, DType::BF16),
                col_group: None,
            })),
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
            affine: None,
        }
    }
}

/// Packs unsigned `bits`-bit codes (each `< 2^bits`) into little-endian u32 words, lowest
/// bits first: code `i` goes to bits `bits * (i % (32 / bits))` of word `i / (32 / bits)`.
pub fn pack_codes(codes: &[u32], bits: usize) -> Vec<u8> {
    let per = 32 / bits;
    assert_eq!(codes.len() % per, 0, "codes do not fill whole words");
    let mut out = Vec::with_capacity(codes.len() * bits / 8);
    for w in codes.chunks_exact(per) {
        let mut word = 0u32;
        for (i, c) in w.iter().enumerate() {
            debug_assert!(*c < (1 << bits));
            word |= c << (bits * i);
        }
        out.extend_from_slice(&word.to_le_bytes());
    }
    out
}

/// The codes of one packed affine row as f32 (0..15 or 0..255).
fn decode_affine_row(dtype: DType, q: &[u8], out: &mut [f32]) {
    match dtype {
        DType::U4 => {
            for (b, o) in q.iter().zip(out.chunks_exact_mut(2)) {
                o[0] = (b & 0xf) as f32;
                o[1] = (b >> 4) as f32;
            }
        }
        DType::U8 => {
            for (b, o) in q.iter().zip(out.iter_mut()) {
                *o = *b as f32;
            }
        }
        _ => unreachable!("not an affine dtype"),
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
        // Unscaled affine codes (a matrix applies its scales and biases in `Mat::rows_f32`).
        DType::U4 | DType::U8 => decode_affine_row(dtype, src, out),
    }
}

/// Encodes f32 values as little-endian `dtype` bytes (round to nearest even).
pub fn encode_f32(values: &[f32], dtype: DType) -> Vec<u8> {
    assert!(
        !dtype.is_affine(),
        "affine codes are made by Mat::quantize_affine"
    );
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
        DType::U4 | DType::U8 => unreachable!(),
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

    /// MLX's packing by hand: a row `[0, 1, .., 15]` of 4-bit codes is the words
    /// 0x76543210 and 0xfedcba98 (lowest nibble first); 8-bit codes are 4 a word, lowest
    /// byte first. `w = scale * q + bias` per group of columns.
    #[test]
    fn affine_nibble_order_and_group_formula() {
        let codes: Vec<u32> = (0..16).collect();
        let packed = pack_codes(&codes, 4);
        assert_eq!(packed, [0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe]);
        assert_eq!(
            u32::from_le_bytes(packed[..4].try_into().unwrap()),
            0x7654_3210
        );
        let p8 = pack_codes(&[1, 2, 3, 250], 8);
        assert_eq!(u32::from_le_bytes(p8[..4].try_into().unwrap()), 0xfa03_0201);
        // Two rows of 16 codes, group 8: scales/biases [2, 2].
        let mut words = packed.clone();
        words.extend(pack_codes(
            &codes.iter().rev().copied().collect::<Vec<_>>(),
            4,
        ));
        let (sc, bi) = ([0.5f32, 2.0, -1.0, 0.25], [1.0f32, -3.0, 0.0, 8.0]);
        let m = Mat {
            storage: Arc::new(Storage::Owned(words)),
            offset: 0,
            dtype: DType::U4,
            rows: 2,
            cols: 16,
            scales: None,
            affine: Some(Box::new(Affine {
                group: 8,
                scales: Mat::from_f32(&sc, 2, 2, DType::BF16),
                biases: Mat::from_f32(&bi, 2, 2, DType::F32),
                col_group: None,
            })),
        };
        assert_eq!(m.nbytes(), 16);
        assert_eq!(m.scale_bytes(), 8 + 16);
        let d = m.to_f32();
        for r in 0..2 {
            for c in 0..16 {
                let q = if r == 0 { c } else { 15 - c } as f32;
                let g = r * 2 + c / 8;
                assert_eq!(d[r * 16 + c], sc[g] * q + bi[g], "({r},{c})");
            }
        }
        assert_eq!(m.rows_view(1, 1).to_f32(), d[16..].to_vec());
        // A column-to-group map (GPTQ act-order) picks each column's group.
        let mut m2 = m.clone();
        let map: Vec<u32> = (0..16).map(|c| (c % 2) as u32).collect();
        m2.affine.as_mut().unwrap().col_group = Some(Arc::new(map));
        let d2 = m2.to_f32();
        assert_eq!(d2[3], sc[1] * 3.0 + bi[1]);
        assert_eq!(d2[4], sc[0] * 4.0 + bi[0]);
    }

    #[test]
    fn affine_quantise_dequantise_error_is_half_a_step() {
        let (rows, cols) = (3, 128);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        for (bits, group) in [(4, 64), (8, 64), (4, 32), (4, 128)] {
            let m = Mat::quantize_affine(&vals, rows, cols, bits, group);
            assert_eq!(m.nbytes(), rows * cols * bits / 8);
            let d = m.to_f32();
            let a = m.affine.as_ref().unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    let s = a.scales.row_f32(r)[c / group];
                    let e = (d[r * cols + c] - vals[r * cols + c]).abs();
                    // half a step, plus the bf16 rounding of the group's minimum
                    assert!(e <= 0.5 * s + 0.02, "{bits}/{group} ({r},{c}): {e} > {s}/2");
                }
            }
        }
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
