//! `gemv.cu`: the decode GEMVs, `y = beta * y + W · input` for one token, the input a bf16
//! vector or RMSNorm(h) computed by each block as it stages it. `gemv_dec_w` (a warp per whole
//! row, the greedy argmax over the rows fused for lm_head) and `gemv_dec_stream` (the k = 2,048
//! in-projections as one stream a block through per-warp rings of bulk copies).

use super::{Dev, On, U128, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// `gemv_dec_w`; `gemv_dec` (two warps a row at k = 4,096) is the emulator's oracle for it
    /// and for `gemv_dec_stream`, not launched by the engine.
    GemvDec ["gemv_dec_w", "gemv_dec"] {
        w: Dev<bf16>, n: i32, k: i32, x: Dev<bf16>, h: Dev<f32>, nw: Dev<f32>, eps: f32,
        xb_out: Dev<bf16>, y: Dev<f32>, beta: f32, arg_val: Dev<f32>, arg_idx: Dev<i32>,
        arg_done: Dev<u32>, arg_limit: i32, arg_out: Dev<i32>, arg_out2: Dev<i32>,
    }
    /// The k = 2,048 GEMV as one stream a block (`ns` ring stages a warp, `early` of them
    /// requested before the kernel's griddep_wait, the next kernels let in `launch_at` units
    /// before a warp's end, stages by bulk copy when `bulk`).
    GemvDecStream ["gemv_dec_stream"] {
        w: Dev<bf16>, n: i32, x: Dev<bf16>, h: Dev<f32>, nw: Dev<f32>, eps: f32,
        xb_out: Dev<bf16>, y: Dev<f32>, beta: f32, ns: i32, early: i32, launch_at: i32, bulk: i32,
    }
    /// The W8A16 GEMV of FP8 weights (e4m3 `[n, k]`, 16 a word, block scales `sc`) for `m`
    /// tokens: the bf16 rows `x [m, k]`, or (x null, m = 1) RMSNorm(h) with weight `nw`; `y
    /// [m, ldy]`.
    GemvFp8 ["gemv_fp8"] {
        w: Dev<U128>, sc: Dev<f32>, n: i32, k: i32, x: Dev<bf16>, h: Dev<f32>, nw: Dev<f32>,
        eps: f32, m: i32, y: Dev<f32>, ldy: i32, beta: f32, wb: Dev<bf16>, nb: i32,
    }
    /// The W4A16 GEMV of affine 4-bit weights ([`Q4`] tiles, on the tensor cores) for `m`
    /// tokens: the bf16 rows `x [m, k]`, or (x null, m = 1) RMSNorm(h) with weight `nw`; `y
    /// [m, ldy]`.
    GemvQ4 ["gemv_q4"] {
        w: Dev<U128>, sb: Dev<u32>, group: i32, n: i32, k: i32, x: Dev<bf16>, h: Dev<f32>,
        nw: Dev<f32>, eps: f32, m: i32, y: Dev<f32>, ldy: i32, beta: f32, arg_val: Dev<f32>,
        arg_idx: Dev<i32>, arg_done: Dev<u32>, arg_limit: i32, arg_out: Dev<i32>,
        arg_out2: Dev<i32>, wb: Dev<bf16>, nb: i32,
    }
}

/// Tokens a [`GemvQ4`] call takes (gemv.cu's GEMV_Q4_TOKENS).
pub const GEMV_Q4_TOKENS: usize = 16;

/// Affine 4-bit weights on the device in the q4 tile layout (gemv.cuh): `[rows, cols]` with
/// rows % 16 == 0 and cols % 64 == 0; `q` the codes (a strip of 16 rows, a unit of 64 columns:
/// 512 bytes, each lane's 16 bytes its mma fragments), `sb` the (scale, bias) bf16 pairs of
/// each strip's groups, `[rows / 16, cols / group, 16]`.
#[derive(Clone, Copy, Debug)]
pub struct Q4 {
    pub q: Dev<U128>,
    pub sb: Dev<u32>,
    pub group: usize,
}

impl Q4 {
    /// Rows `[row0, ..)` of a matrix of `cols` columns (row0 % 16 == 0).
    pub fn rows_from(self, row0: usize, cols: usize) -> Result<Q4> {
        ensure!(
            row0.is_multiple_of(16),
            "4-bit rows from {row0}: not on a 16-row strip"
        );
        Ok(Q4 {
            q: self.q.at(row0 * cols / 32),
            sb: self.sb.at(row0 * (cols / self.group)),
            group: self.group,
        })
    }

    /// Whether this holds a `[n, k]` matrix.
    fn holds(&self, n: usize, k: usize) -> bool {
        n.is_multiple_of(16)
            && k.is_multiple_of(64)
            && matches!(self.group, 32 | 64 | 128)
            && k.is_multiple_of(self.group)
            && self.q.len * 32 >= n * k
            && self.sb.len >= n * (k / self.group)
    }
}

/// Columns of one scale application (gemv.cuh's q4_span).
fn q4_span(group: usize) -> usize {
    if group == 32 { 32 } else { 64 }
}

/// Strips of 16 rows a `gemv_q4` block (gemv.cuh's q4_strips of k / 512).
pub fn q4_strips(k: usize) -> usize {
    match k {
        2048 => 2,
        512 => 4,
        _ => 1,
    }
}

/// Shared memory (bytes) of the q4 GEMVs (gemv.cuh's q4_smem): `m` staged input rows of `k`
/// (padded past one token), the RMSNorm weight when `norm`, the span sums and `red` floats
/// of partial sums.
pub fn q4_smem(m: usize, k: usize, group: usize, norm: bool, red: usize) -> usize {
    let ldw = if m == 1 { k / 2 } else { k / 2 + 4 };
    4 * (m * ldw + if norm { k } else { 0 } + m * (k / q4_span(group)) + red)
}

/// `y [m, ldy] = beta · y + input · Wᵀ` for affine 4-bit `W [n, k]` ([`Q4`]): `input` the
/// bf16 rows `[m, k]` (m <= [`GEMV_Q4_TOKENS`]), or a one-token RMSNorm input; with `argmax`
/// (one token) also the greedy id over its rows. `tail`: bf16 rows `[nb, k]` whose products go
/// to rows `[n, n + nb)` of y in the same launch (GDN's b|a beside the 4-bit q|k|v|z).
#[allow(clippy::too_many_arguments)]
pub fn gemv_q4(
    gpu: &Gpu,
    w: Q4,
    n: usize,
    k: usize,
    input: Input,
    m: usize,
    y: Dev<f32>,
    ldy: usize,
    beta: f32,
    argmax: Option<Argmax>,
    tail: Option<(Dev<bf16>, usize)>,
    on: On,
) -> Result<()> {
    let (wb, nb) = tail.unwrap_or((Dev::null(), 0));
    ensure!(
        w.holds(n, k)
            && (1..=GEMV_Q4_TOKENS).contains(&m)
            && ldy >= n + nb
            && y.len >= (m - 1) * ldy + n + nb
            && wb.len >= nb * k
            && (nb == 0 || argmax.is_none()),
        "gemv_q4: W [{n}, {k}] group {} {:?} scales {:?} (+ {nb} bf16 rows {wb:?}), {m} tokens, \
         y {y:?} rows of {ldy}",
        w.group,
        w.q,
        w.sb
    );
    let (x, h, nw, eps, norm) = match input {
        Input::Bf16(x) => {
            ensure!(x.len >= m * k, "gemv_q4: input {x:?} of {m} x {k}");
            (x, Dev::null(), Dev::null(), 0.0, false)
        }
        Input::Norm { h, w, eps } => {
            ensure!(
                m == 1 && h.len >= k && w.len >= k,
                "gemv_q4: RMSNorm input of {m} tokens: {h:?}, weight {w:?}"
            );
            (Dev::null(), h, w, eps, true)
        }
    };
    let spb = q4_strips(k);
    let smem = q4_smem(m, k, w.group, norm, 8 * 16 * m * spb);
    let q4_blocks = (n / 16).div_ceil(spb);
    let blocks = q4_blocks + nb.div_ceil(16);
    let a = argmax.unwrap_or(Argmax::NONE);
    if argmax.is_some() {
        ensure!(
            m == 1
                && a.val.len >= blocks
                && a.idx.len >= blocks
                && !a.done.is_null()
                && !a.out.is_null(),
            "gemv_q4: the argmax of {m} tokens, buffers for {blocks} blocks: {a:?}"
        );
    }
    let p = GemvQ4 {
        w: w.q,
        sb: w.sb,
        group: w.group as i32,
        n: n as i32,
        k: k as i32,
        x,
        h,
        nw,
        eps,
        m: m as i32,
        y,
        ldy: ldy as i32,
        beta,
        arg_val: a.val,
        arg_idx: a.idx,
        arg_done: a.done,
        arg_limit: a.limit.min(n) as i32,
        arg_out: a.out,
        arg_out2: a.out2,
        wb,
        nb: nb as i32,
    };
    gpu.run("gemv_q4", (blocks as u32, 1, 1), 256, smem, &p.args(), on)
}

/// Tokens a [`GemvFp8`] call takes (gemv.cu's GEMV_FP8_TOKENS).
pub const GEMV_FP8_TOKENS: usize = 16;

/// Rows a warp of `gemv_fp8` (gemv.cu's gemv_fp8_rows).
fn gemv_fp8_rows(k: usize) -> usize {
    match k {
        4096 => 1,
        2048 => 4,
        512 => 8,
        _ => 2,
    }
}

/// Blocks of a `gemv_fp8` launch: 8 warps of gemv_fp8_rows FP8 rows, then 16 bf16 tail rows a
/// block.
fn gemv_fp8_blocks(n: usize, k: usize, nb: usize) -> usize {
    n.div_ceil(8 * gemv_fp8_rows(k)) + nb.div_ceil(16)
}

/// FP8 weights on the device: e4m3 `[rows, cols]` row-major (16 a 16-byte word) and their f32
/// block scales `[ceil(rows / 128), ceil(cols / 128)]`.
#[derive(Clone, Copy, Debug)]
pub struct Fp8 {
    pub q: Dev<U128>,
    pub sc: Dev<f32>,
}

/// `y [m, ldy] = beta · y + input · Wᵀ` for FP8 `W [n, k]` (k % 16 == 0): `input` the bf16
/// rows `[m, k]` (m <= [`GEMV_FP8_TOKENS`]), or a one-token RMSNorm input. `tail`: bf16 rows
/// `[nb, k]` whose products go to rows `[n, n + nb)` of y in the same launch (GDN's b|a beside
/// the FP8 q|k|v|z).
#[allow(clippy::too_many_arguments)]
pub fn gemv_fp8(
    gpu: &Gpu,
    w: Fp8,
    n: usize,
    k: usize,
    input: Input,
    m: usize,
    y: Dev<f32>,
    ldy: usize,
    beta: f32,
    tail: Option<(Dev<bf16>, usize)>,
    on: On,
) -> Result<()> {
    let kb = k.div_ceil(128);
    let (wb, nb) = tail.unwrap_or((Dev::null(), 0));
    ensure!(
        k.is_multiple_of(16)
            && (1..=GEMV_FP8_TOKENS).contains(&m)
            && w.q.len * 16 >= n * k
            && w.sc.len >= n.div_ceil(128) * kb
            && ldy >= n + nb
            && y.len >= (m - 1) * ldy + n + nb
            && wb.len >= nb * k,
        "gemv_fp8: W [{n}, {k}] {:?} scales {:?} (+ {nb} bf16 rows {wb:?}), {m} tokens, y {y:?} \
         rows of {ldy}",
        w.q,
        w.sc
    );
    let (x, h, nw, eps, smem) = match input {
        Input::Bf16(x) => {
            ensure!(x.len >= m * k, "gemv_fp8: input {x:?} of {m} x {k}");
            (x, Dev::null(), Dev::null(), 0.0, 2 * m * k)
        }
        Input::Norm { h, w, eps } => {
            ensure!(
                m == 1 && h.len >= k && w.len >= k,
                "gemv_fp8: RMSNorm input of {m} tokens: {h:?}, weight {w:?}"
            );
            (Dev::null(), h, w, eps, 8 * k)
        }
    };
    let p = GemvFp8 {
        w: w.q,
        sc: w.sc,
        n: n as i32,
        k: k as i32,
        x,
        h,
        nw,
        eps,
        m: m as i32,
        y,
        ldy: ldy as i32,
        beta,
        wb,
        nb: nb as i32,
    };
    let grid = (gemv_fp8_blocks(n, k, nb) as u32, 1, 1);
    gpu.run("gemv_fp8", grid, 256, smem, &p.args(), on)
}

/// `gemv_dec_stream`'s ring: (stages a warp, how many of them are requested before the
/// kernel's griddep_wait, how many units before a warp's end the next kernels may start), its
/// stages filled by bulk copies (docs/DECISIONS.md has the A/Bs that chose these).
pub const STREAM: (usize, usize, usize) = (2, 1, 3);

/// At most this many blocks per `gemv_dec_w` (8 per SM of an H200): each stages its input
/// once, then walks row groups, so a tall matrix (lm_head) does not restage it per 16 rows.
const MAX_BLOCKS: usize = 132 * 8;

/// Output rows per block of the decode GEMVs with inner dimension `k` (gemv.cuh's
/// `gemv_rows_per_block`; `whole_rows`: `gemv_dec_w`, a warp per row).
pub fn rows_per_block(k: usize, whole_rows: bool) -> usize {
    match k {
        0..=2048 => 16,
        4096 if !whole_rows => 4,
        _ => 8,
    }
}

/// Shared memory of `gemv_dec_stream` in bytes (gemv.cu's gemv_stream_smem): the staged input
/// and RMSNorm weight (2 x 2048 floats), then 8 warps' rings of `ns` 8 KiB stages and their
/// mbarriers.
pub fn stream_smem(ns: usize) -> usize {
    2 * 2048 * 4 + 8 * ns * (8192 + 8)
}

pub(super) fn dynamic_smem() -> Vec<(&'static str, usize)> {
    vec![
        ("gemv_dec_stream", stream_smem(3)),
        ("gemv_fp8", 2 * GEMV_FP8_TOKENS * 4096),
        (
            "gemv_q4",
            q4_smem(GEMV_Q4_TOKENS, 4096, 32, false, 8 * 16 * GEMV_Q4_TOKENS),
        ),
    ]
}

/// A decode GEMV's input: a bf16 vector, or RMSNorm(h) with weight `w` (f32, `k` values each).
#[derive(Clone, Copy, Debug)]
pub enum Input {
    Bf16(Dev<bf16>),
    Norm { h: Dev<f32>, w: Dev<f32>, eps: f32 },
}

/// The greedy argmax fused into a GEMV over its rows `< limit`: the blocks' partial maxima
/// (`val`, `idx`, one a block), the last-block counter `done` (zero between launches), and
/// where the winning row goes (`out`, and `out2` unless null).
#[derive(Clone, Copy, Debug)]
pub struct Argmax {
    pub val: Dev<f32>,
    pub idx: Dev<i32>,
    pub done: Dev<u32>,
    pub limit: usize,
    pub out: Dev<i32>,
    pub out2: Dev<i32>,
}

impl Argmax {
    /// No argmax: the kernels' null pointers.
    const NONE: Argmax = Argmax {
        val: Dev::null(),
        idx: Dev::null(),
        done: Dev::null(),
        limit: 0,
        out: Dev::null(),
        out2: Dev::null(),
    };
}

/// `y = beta * y + W · input` for `W [n, k]` (bf16): `gemv_dec_stream` at k = 2,048 without an
/// argmax, else `gemv_dec_w` (with the argmax when given).
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    w: Dev<bf16>,
    n: usize,
    k: usize,
    input: Input,
    y: Dev<f32>,
    beta: f32,
    argmax: Option<Argmax>,
    on: On,
) -> Result<()> {
    ensure!(
        w.len >= n * k && y.len >= n,
        "gemv: W [{n}, {k}] {w:?}, y {y:?}"
    );
    let (x, h, nw, eps) = match input {
        Input::Bf16(x) => {
            ensure!(x.len >= k, "gemv: input {x:?} of {k}");
            (x, Dev::null(), Dev::null(), 0.0)
        }
        Input::Norm { h, w, eps } => {
            ensure!(
                h.len >= k && w.len >= k,
                "gemv: RMSNorm input {h:?}, weight {w:?}"
            );
            (Dev::null(), h, w, eps)
        }
    };
    if let (2048, None) = (k, argmax) {
        let (ns, early, launch_at) = STREAM;
        let p = GemvDecStream {
            w,
            n: n as i32,
            x,
            h,
            nw,
            eps,
            xb_out: Dev::null(),
            y,
            beta,
            ns: ns as i32,
            early: early as i32,
            launch_at: launch_at as i32,
            bulk: 1,
        };
        let grid = (n.div_ceil(2).min(gpu.sm_count) as u32, 1, 1);
        return gpu.run("gemv_dec_stream", grid, 256, stream_smem(ns), &p.args(), on);
    }
    let blocks = n.div_ceil(rows_per_block(k, true)).min(MAX_BLOCKS);
    let a = argmax.unwrap_or(Argmax::NONE);
    if argmax.is_some() {
        ensure!(
            a.val.len >= blocks && a.idx.len >= blocks && !a.done.is_null() && !a.out.is_null(),
            "gemv: argmax buffers for {blocks} blocks: {a:?}"
        );
    }
    let p = GemvDec {
        w,
        n: n as i32,
        k: k as i32,
        x,
        h,
        nw,
        eps,
        xb_out: Dev::null(),
        y,
        beta,
        arg_val: a.val,
        arg_idx: a.idx,
        arg_done: a.done,
        arg_limit: a.limit.min(n) as i32,
        arg_out: a.out,
        arg_out2: a.out2,
    };
    // k floats of staged input, and with the RMSNorm its weight after them
    let smem = k * 4 * if x.is_null() { 2 } else { 1 };
    gpu.run(
        "gemv_dec_w",
        (blocks as u32, 1, 1),
        256,
        smem,
        &p.args(),
        on,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gemv_fp8's grid covers every FP8 row as the kernel splits them (8 warps of
    /// gemv_fp8_rows(k) rows a block) and then every bf16 tail row (16 a block), no block
    /// wholly past both.
    #[test]
    fn fp8_grid_covers_the_rows_and_the_tail() {
        for k in [128, 512, 2048, 4096] {
            let per = 8 * gemv_fp8_rows(k);
            for n in [16usize, 300, 2048, 12_288] {
                for nb in [0, 1, 16, 33, 64] {
                    let fp8 = n.div_ceil(per);
                    let tail = gemv_fp8_blocks(n, k, nb) - fp8;
                    assert!(fp8 * per >= n && (fp8 - 1) * per < n, "n {n} k {k}");
                    assert!(
                        tail * 16 >= nb && (tail == 0 || (tail - 1) * 16 < nb),
                        "nb {nb}"
                    );
                }
            }
        }
        // the GDN in-projection: 12,288 FP8 rows in 384 blocks, b|a's 64 in 4 more
        assert_eq!(gemv_fp8_blocks(12_288, 2048, 64), 388);
    }
}
