//! `sample.cu`: the draw on the device (penalties in place, per-chunk statistics and
//! candidates, the per-row pick). The constants mirror the CUDA `#define`s of the same names.

use super::{Dev, On, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};

/// Candidates a chunk keeps, and a row's merged list.
pub const SAMPLE_K: usize = 64;
/// Ids a `sample_stats` block scans.
pub const SAMPLE_CHUNK: usize = 8192;
/// Chunks a row has at most (so ids below 262,144).
pub const SAMPLE_MAX_CHUNKS: usize = 32;
/// Top log-probabilities a row returns at most (the OpenAI API's cap).
pub const SAMPLE_TOPN: usize = 20;
/// 32-bit parameter words a row.
pub const SAMPLE_PW: usize = 16;
/// 32-bit result words a row.
pub const SAMPLE_OW: usize = 48;

/// Parameter word indices (`SP_*`).
pub mod sp {
    pub const TEMP: usize = 0;
    pub const TOPK: usize = 1;
    pub const TOPP: usize = 2;
    pub const MINP: usize = 3;
    pub const REP: usize = 4;
    pub const PRES: usize = 5;
    pub const FREQ: usize = 6;
    pub const LIMIT: usize = 7;
    pub const PEN_OFF: usize = 8;
    pub const PEN_LEN: usize = 9;
    pub const NLP: usize = 10;
    pub const MASK: usize = 11;
    pub const U_LO: usize = 12;
    pub const U_HI: usize = 13;
}

/// Result word indices (`SO_*`).
pub mod so {
    pub const ID: usize = 0;
    pub const FLAG: usize = 1;
    pub const LSE: usize = 2;
    pub const LP: usize = 3;
    pub const NTOP: usize = 4;
    pub const TOP: usize = 5;
}

/// [`sp::MASK`] of a row without a structured-output mask.
pub const SAMPLE_NO_MASK: u32 = u32::MAX;
/// Mask words a row has at most (ids below `SAMPLE_MAX_CHUNKS * SAMPLE_CHUNK`).
pub const SAMPLE_MASK_WORDS: usize = SAMPLE_MAX_CHUNKS * SAMPLE_CHUNK / 32;

/// `sample_pick` phases.
pub const SAMPLE_RAW: i32 = 1;
pub const SAMPLE_DRAW: i32 = 2;
pub const SAMPLE_PENALIZED: i32 = 4;

kernels! {
    /// The structured-output masks in place: every id a masked row's bitmask (`words` words
    /// at `masks + params[SP_MASK] * words`) refuses set to −∞.
    SampleMask ["sample_mask"] {
        logits: Dev<f32>, ld: i32, params: Dev<u32>, masks: Dev<u32>, words: i32
    }
    /// The penalties of each row's `pen` pairs (id, count) applied in place to `logits`, the
    /// raw values saved at the same index into `saved`.
    SamplePenalize ["sample_penalize"] {
        logits: Dev<f32>, ld: i32, params: Dev<u32>, pen: Dev<i32>, saved: Dev<f32>
    }
    /// Per (chunk, row): the chunk's max, masses and `SAMPLE_K` largest logits.
    SampleStats ["sample_stats"] {
        logits: Dev<f32>, ld: i32, params: Dev<u32>, stats: Dev<f32>, cand_id: Dev<i32>,
        cand_v: Dev<f32>
    }
    /// Per row: the merged candidates, the raw log-sum-exp and top log-probabilities
    /// (`SAMPLE_RAW`), the draw (`SAMPLE_DRAW`) into `SAMPLE_OW` words of `out`.
    SamplePick ["sample_pick"] {
        logits: Dev<f32>, ld: i32, params: Dev<u32>, chunks: i32, stats: Dev<f32>,
        cand_id: Dev<i32>, cand_v: Dev<f32>, pen: Dev<i32>, saved: Dev<f32>, phase: i32,
        out: Dev<u32>
    }
}

/// The chunks of a row of `limit` ids.
pub fn chunks(limit: usize) -> usize {
    limit.div_ceil(SAMPLE_CHUNK).max(1)
}

fn check_rows(name: &str, logits: Dev<f32>, ld: i32, params: Dev<u32>, rows: usize) -> Result<()> {
    ensure!(
        logits.len >= rows * ld as usize && params.len >= rows * SAMPLE_PW,
        "{name}: {rows} rows of {ld}: logits {logits:?}, params {params:?}"
    );
    Ok(())
}

impl SampleMask {
    /// Grid (`chunks`, `rows`); `masked` rows' masks uploaded.
    pub fn launch(
        &self,
        gpu: &Gpu,
        rows: usize,
        chunks: usize,
        masked: usize,
        on: On,
    ) -> Result<()> {
        check_rows("sample_mask", self.logits, self.ld, self.params, rows)?;
        ensure!(
            (1..=SAMPLE_MAX_CHUNKS).contains(&chunks)
                && self.words >= 0
                && self.masks.len >= masked * self.words as usize,
            "sample_mask: {rows} rows of {chunks} chunks, {masked} masks of {} words: {:?}",
            self.words,
            self.masks
        );
        gpu.run(
            "sample_mask",
            (chunks as u32, rows as u32, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

impl SamplePenalize {
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        check_rows("sample_penalize", self.logits, self.ld, self.params, rows)?;
        gpu.run(
            "sample_penalize",
            (rows as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

impl SampleStats {
    /// Grid (`chunks`, `rows`): every row's limit at most `chunks * SAMPLE_CHUNK`.
    pub fn launch(&self, gpu: &Gpu, rows: usize, chunks: usize, on: On) -> Result<()> {
        check_rows("sample_stats", self.logits, self.ld, self.params, rows)?;
        ensure!(
            (1..=SAMPLE_MAX_CHUNKS).contains(&chunks)
                && self.stats.len >= rows * chunks * 4
                && self.cand_id.len >= rows * chunks * SAMPLE_K
                && self.cand_v.len >= rows * chunks * SAMPLE_K,
            "sample_stats: {rows} rows of {chunks} chunks: stats {:?}, candidates {:?} / {:?}",
            self.stats,
            self.cand_id,
            self.cand_v
        );
        gpu.run(
            "sample_stats",
            (chunks as u32, rows as u32, 1),
            1024,
            0,
            &self.args(),
            on,
        )
    }
}

impl SamplePick {
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        check_rows("sample_pick", self.logits, self.ld, self.params, rows)?;
        let chunks = self.chunks as usize;
        ensure!(
            (1..=SAMPLE_MAX_CHUNKS).contains(&chunks)
                && self.stats.len >= rows * chunks * 4
                && self.cand_id.len >= rows * chunks * SAMPLE_K
                && self.out.len >= rows * SAMPLE_OW,
            "sample_pick: {rows} rows of {chunks} chunks: stats {:?}, out {:?}",
            self.stats,
            self.out
        );
        gpu.run("sample_pick", (rows as u32, 1, 1), 256, 0, &self.args(), on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants here are the `#define`s of `sample.cu`: a value changed on one side only
    /// fails here instead of misreading the parameter or result words.
    #[test]
    fn constants_match_the_cuda_defines() {
        let src = include_str!("sample.cu");
        assert!(
            src.contains(&format!("#define SAMPLE_NO_MASK {SAMPLE_NO_MASK:#x}u")),
            "SAMPLE_NO_MASK differs from the CUDA define"
        );
        let define = |name: &str| -> usize {
            src.lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("no #define {name}"))
                .trim()
                .parse()
                .unwrap()
        };
        let ours = [
            ("SAMPLE_K", SAMPLE_K),
            ("SAMPLE_CHUNK", SAMPLE_CHUNK),
            ("SAMPLE_MAX_CHUNKS", SAMPLE_MAX_CHUNKS),
            ("SAMPLE_TOPN", SAMPLE_TOPN),
            ("SAMPLE_PW", SAMPLE_PW),
            ("SAMPLE_OW", SAMPLE_OW),
            ("SP_TEMP", sp::TEMP),
            ("SP_TOPK", sp::TOPK),
            ("SP_TOPP", sp::TOPP),
            ("SP_MINP", sp::MINP),
            ("SP_REP", sp::REP),
            ("SP_PRES", sp::PRES),
            ("SP_FREQ", sp::FREQ),
            ("SP_LIMIT", sp::LIMIT),
            ("SP_PEN_OFF", sp::PEN_OFF),
            ("SP_PEN_LEN", sp::PEN_LEN),
            ("SP_NLP", sp::NLP),
            ("SP_MASK", sp::MASK),
            ("SP_U_LO", sp::U_LO),
            ("SP_U_HI", sp::U_HI),
            ("SO_ID", so::ID),
            ("SO_FLAG", so::FLAG),
            ("SO_LSE", so::LSE),
            ("SO_LP", so::LP),
            ("SO_NTOP", so::NTOP),
            ("SO_TOP", so::TOP),
            ("SAMPLE_RAW", SAMPLE_RAW as usize),
            ("SAMPLE_DRAW", SAMPLE_DRAW as usize),
            ("SAMPLE_PENALIZED", SAMPLE_PENALIZED as usize),
        ];
        for (name, v) in ours {
            assert_eq!(define(name), v, "{name}");
        }
        const { assert!(so::TOP + 2 * SAMPLE_TOPN <= SAMPLE_OW) };
    }
}
