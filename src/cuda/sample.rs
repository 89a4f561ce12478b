//! The draw on the device (`kernels/sample.cu`): each row of a batch's logits, still on the
//! GPU, gets the id the request's CPU sampler would pick with the same uniform
//! ([`crate::sampling::draw`]), and the log-probabilities it asks for; only those cross to the
//! host. A row the kernels cannot decide (top-k above [`SAMPLE_K`], a top-p or min-p set that
//! may reach past the candidates, more penalized ids than the buffer holds) or that asks for
//! its logits copies its logits row and draws on the host instead, with the same uniform.

use super::kernels::sample::{
    SAMPLE_DRAW, SAMPLE_K, SAMPLE_MASK_WORDS, SAMPLE_MAX_CHUNKS, SAMPLE_NO_MASK, SAMPLE_OW,
    SAMPLE_PENALIZED, SAMPLE_PW, SAMPLE_RAW, SAMPLE_TOPN, SampleMask, SamplePenalize, SamplePick,
    SampleStats, chunks, so, sp,
};
use super::kernels::{Dev, On};
use super::{DeviceBuf, Gpu, PinnedBuf};
use crate::sampling::{Draw, Drawn, TokenLogprobs};
use anyhow::{Result, ensure};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Penalized (id, count) pairs a call holds at most, over all its rows.
const PEN_CAP: usize = 1 << 18;

/// The draw's device buffers, for up to `rows` rows a call.
pub struct SampleWs {
    rows: usize,
    /// The rows' parameter words, then the penalty pairs: one upload a call.
    up: DeviceBuf,
    saved: DeviceBuf,
    stats: DeviceBuf,
    cand_id: DeviceBuf,
    cand_v: DeviceBuf,
    out: DeviceBuf,
    /// The structured-output masks of a call's masked rows ([`SAMPLE_MASK_WORDS`] a row).
    masks: DeviceBuf,
    /// The page-locked host side of `up`, `masks` and `out`.
    host: Mutex<Staging>,
}

/// Page-locked staging of a call's uploads and results: the copies are DMA queued on the
/// stream behind the step's kernels (the host does not wait for them, nor make the staging
/// copy pageable memory takes).
struct Staging {
    up: PinnedBuf,
    masks: PinnedBuf,
    out: PinnedBuf,
    /// Whether copies from `up` / `masks` may still be queued (a call that failed before its
    /// closing sync): the next call syncs before writing them.
    in_flight: bool,
}

impl SampleWs {
    pub fn new(gpu: &Gpu, rows: usize) -> Result<Self> {
        let per_row = SAMPLE_MAX_CHUNKS * SAMPLE_K * 4;
        Ok(SampleWs {
            rows,
            up: gpu.alloc_zeroed(rows * SAMPLE_PW * 4 + PEN_CAP * 8)?,
            saved: gpu.alloc_zeroed(PEN_CAP * 4)?,
            stats: gpu.alloc_zeroed(rows * SAMPLE_MAX_CHUNKS * 16)?,
            cand_id: gpu.alloc_zeroed(rows * per_row)?,
            cand_v: gpu.alloc_zeroed(rows * per_row)?,
            out: gpu.alloc_zeroed(rows * SAMPLE_OW * 4)?,
            masks: gpu.alloc_zeroed(rows * SAMPLE_MASK_WORDS * 4)?,
            host: Mutex::new(Staging {
                up: gpu.alloc_pinned(rows * SAMPLE_PW + PEN_CAP * 2)?,
                masks: gpu.alloc_pinned(rows * SAMPLE_MASK_WORDS)?,
                out: gpu.alloc_pinned(rows * SAMPLE_OW)?,
                in_flight: false,
            }),
        })
    }

    /// Device bytes these buffers take for `rows` rows.
    pub fn bytes(rows: usize) -> usize {
        rows * (SAMPLE_PW * 4
            + SAMPLE_MAX_CHUNKS * (16 + 2 * SAMPLE_K * 4)
            + SAMPLE_OW * 4
            + SAMPLE_MASK_WORDS * 4)
            + PEN_CAP * 12
    }
}

/// A row's parameter words, with its penalty list at `pen_off` (`pen_len` pairs).
fn param_words(d: &Draw, limit: usize, pen_off: usize, pen_len: usize) -> [u32; SAMPLE_PW] {
    let p = d.params;
    let mut w = [0u32; SAMPLE_PW];
    w[sp::TEMP] = p.temperature.to_bits();
    w[sp::TOPK] = p.top_k.min(u32::MAX as usize) as u32;
    w[sp::TOPP] = p.top_p.to_bits();
    w[sp::MINP] = p.min_p.to_bits();
    w[sp::REP] = p.repetition_penalty.to_bits();
    w[sp::PRES] = p.presence_penalty.to_bits();
    w[sp::FREQ] = p.frequency_penalty.to_bits();
    w[sp::LIMIT] = limit as u32;
    w[sp::PEN_OFF] = pen_off as u32;
    w[sp::PEN_LEN] = pen_len as u32;
    w[sp::NLP] = d.top_logprobs.map_or(-1, |n| n.min(SAMPLE_TOPN) as i32) as u32;
    w[sp::MASK] = SAMPLE_NO_MASK;
    let u = d.u.to_bits();
    w[sp::U_LO] = u as u32;
    w[sp::U_HI] = (u >> 32) as u32;
    w
}

/// The (id, count) pairs the penalties apply to: every id of `history`, counted, in id order.
fn penalty_pairs(history: &[u32]) -> Vec<(u32, u32)> {
    let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
    for &id in history {
        *counts.entry(id).or_insert(0) += 1;
    }
    counts.into_iter().collect()
}

impl Gpu {
    /// The draws of `draws.len()` rows of `ld` logits at `logits` (on the device; rows the
    /// kernels penalize are changed in place). Ends with the results on the host.
    pub fn draw_rows(
        &self,
        ws: &SampleWs,
        logits: Dev<f32>,
        ld: usize,
        draws: &[Draw],
    ) -> Result<Vec<Drawn>> {
        let rows = draws.len();
        ensure!(
            rows <= ws.rows && logits.len >= rows * ld,
            "a draw of {rows} rows of {ld} logits: room for {} rows, logits {logits:?}",
            ws.rows
        );
        if rows == 0 {
            return Ok(Vec::new());
        }
        let limits: Vec<usize> = draws.iter().map(|d| d.params.vocab_limit.min(ld)).collect();
        let nchunks = limits.iter().map(|&l| chunks(l)).max().unwrap_or(1);
        ensure!(
            nchunks <= SAMPLE_MAX_CHUNKS,
            "a draw over {ld} logits: at most {} ids a row",
            SAMPLE_MAX_CHUNKS * super::kernels::sample::SAMPLE_CHUNK
        );
        // Rows that draw on the host: those asking for the logits, and penalized ones once the
        // pair buffer is full.
        let mut host: Vec<bool> = draws.iter().map(|d| d.want_logits).collect();
        let mut words = Vec::with_capacity(rows * SAMPLE_PW);
        let mut pen: Vec<i32> = Vec::new();
        let mut pen_at: Vec<(usize, Vec<(u32, u32)>)> = vec![(0, Vec::new()); rows];
        for (r, d) in draws.iter().enumerate() {
            let pairs = if d.params.has_penalties() && !host[r] {
                penalty_pairs(d.history)
            } else {
                Vec::new()
            };
            if pen.len() / 2 + pairs.len() > PEN_CAP {
                host[r] = true;
            }
            let (off, len) = if host[r] {
                (0, 0)
            } else {
                (pen.len() / 2, pairs.len())
            };
            if !host[r] {
                pen.extend(pairs.iter().flat_map(|&(id, n)| [id as i32, n as i32]));
                pen_at[r] = (off, pairs);
            }
            words.extend(param_words(d, limits[r], off, len));
        }
        let mut out = vec![0u32; rows * SAMPLE_OW];
        if host.iter().any(|h| !h) {
            let mut staging = ws.host.lock().unwrap_or_else(|p| p.into_inner());
            let st = &mut *staging;
            if st.in_flight {
                self.sync()?;
            }
            // The masked rows' mask slots, then the parameter words and penalty pairs, queued
            // (page-locked, asynchronous) behind the step's kernels before any mask is waited
            // for. A host row masks its own logits.
            let words_per = ld.div_ceil(32).min(SAMPLE_MASK_WORDS);
            let mut masked = Vec::new();
            for (r, d) in draws.iter().enumerate() {
                if let Some(m) = d.mask.filter(|_| !host[r]) {
                    words[r * SAMPLE_PW + sp::MASK] = masked.len() as u32;
                    masked.push(m);
                }
            }
            let pen_at_dev = ws.rows * SAMPLE_PW;
            words.resize(pen_at_dev, 0);
            words.extend(pen.iter().map(|&x| x as u32));
            st.up.words_mut()[..words.len()].copy_from_slice(&words);
            st.in_flight = true;
            self.copy_pinned_to_device(ws.up.ptr, &st.up, 0..words.len())?;
            // Each mask as soon as it is there, its copy queued at once: the guides computed
            // them while the GPU ran the step, so a mask taken before the step ended costs
            // nothing and is not counted as waited (`get_after`).
            for (k, m) in masked.iter().enumerate() {
                let m = m.get_after(|| self.busy());
                let slot = k * words_per..(k + 1) * words_per;
                let dst = &mut st.masks.words_mut()[slot.clone()];
                let n = m.len().min(words_per);
                dst[..n].copy_from_slice(&m[..n]);
                dst[n..].fill(0);
                self.copy_pinned_to_device(ws.masks.ptr + 4 * slot.start as u64, &st.masks, slot)?;
            }
            let params: Dev<u32> = Dev::new(ws.up.ptr, pen_at_dev);
            let pen_dev: Dev<i32> = Dev::new(ws.up.ptr + 4 * pen_at_dev as u64, PEN_CAP * 2);
            let (ldi, nc) = (ld as i32, nchunks as i32);
            let stats = SampleStats {
                logits,
                ld: ldi,
                params,
                stats: ws.stats.f32(),
                cand_id: ws.cand_id.i32(),
                cand_v: ws.cand_v.f32(),
            };
            let pick = |phase: i32| SamplePick {
                logits,
                ld: ldi,
                params,
                chunks: nc,
                stats: ws.stats.f32(),
                cand_id: ws.cand_id.i32(),
                cand_v: ws.cand_v.f32(),
                pen: pen_dev,
                saved: ws.saved.f32(),
                phase,
                out: ws.out.view(),
            };
            if !masked.is_empty() {
                SampleMask {
                    logits,
                    ld: ldi,
                    params,
                    masks: ws.masks.view(),
                    words: words_per as i32,
                }
                .launch(self, rows, nchunks, masked.len(), On::Prefill)?;
            }
            stats.launch(self, rows, nchunks, On::Prefill)?;
            if pen.is_empty() {
                pick(SAMPLE_RAW | SAMPLE_DRAW).launch(self, rows, On::Prefill)?;
            } else {
                // the log-probabilities are of the raw logits: taken before the penalties
                if draws.iter().any(|d| d.top_logprobs.is_some()) {
                    pick(SAMPLE_RAW).launch(self, rows, On::Prefill)?;
                }
                SamplePenalize {
                    logits,
                    ld: ldi,
                    params,
                    pen: pen_dev,
                    saved: ws.saved.f32(),
                }
                .launch(self, rows, On::Prefill)?;
                stats.launch(self, rows, nchunks, On::Prefill)?;
                pick(SAMPLE_DRAW | SAMPLE_PENALIZED).launch(self, rows, On::Prefill)?;
            }
            self.copy_to_pinned(ws.out.ptr, &mut st.out, 0..rows * SAMPLE_OW)?;
            st.in_flight = false;
            out.copy_from_slice(&st.out.words()[..rows * SAMPLE_OW]);
        }
        let mut drawn = Vec::with_capacity(rows);
        for (r, d) in draws.iter().enumerate() {
            let o = &out[r * SAMPLE_OW..(r + 1) * SAMPLE_OW];
            if host[r] || o[so::FLAG] != 0 {
                let mut row = vec![0f32; ld];
                self.copy_to_host(logits.at(r * ld).ptr, &mut row)?;
                // undo the penalties the kernels applied: the host draw applies its own
                let (off, pairs) = &pen_at[r];
                if !pairs.is_empty() {
                    let mut raw = vec![0f32; pairs.len()];
                    self.copy_to_host(ws.saved.f32().at(*off).ptr, &mut raw)?;
                    for (&(id, _), v) in pairs.iter().zip(raw) {
                        if (id as usize) < limits[r] {
                            row[id as usize] = v;
                        }
                    }
                }
                drawn.push(d.on_host(&row));
                continue;
            }
            let id = o[so::ID];
            let logprobs = d.top_logprobs.map(|n| {
                let top = (o[so::NTOP] as usize).min(n);
                TokenLogprobs {
                    id,
                    logprob: f32::from_bits(o[so::LP]),
                    top: (0..top)
                        .map(|j| (o[so::TOP + 2 * j], f32::from_bits(o[so::TOP + 2 * j + 1])))
                        .collect(),
                }
            });
            drawn.push(Drawn {
                id,
                logprobs,
                logits: None,
            });
        }
        Ok(drawn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    #[test]
    fn penalty_pairs_count_each_id_once_in_id_order() {
        assert_eq!(
            penalty_pairs(&[7, 3, 7, 7, 1]),
            vec![(1, 1), (3, 1), (7, 3)]
        );
        assert!(penalty_pairs(&[]).is_empty());
    }

    #[test]
    fn parameter_words_carry_every_setting() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            vocab_limit: 1000,
        };
        let u = 0.123_456_789_012_345_68_f64;
        let d = Draw {
            params: &p,
            u,
            history: &[],
            top_logprobs: Some(50),
            want_logits: false,
            mask: None,
        };
        let w = param_words(&d, 900, 11, 3);
        assert_eq!(f32::from_bits(w[sp::TEMP]), 0.7);
        assert_eq!(w[sp::TOPK], 20);
        assert_eq!(f32::from_bits(w[sp::TOPP]), 0.95);
        assert_eq!(f32::from_bits(w[sp::MINP]), 0.05);
        assert_eq!(f32::from_bits(w[sp::REP]), 1.1);
        assert_eq!(f32::from_bits(w[sp::PRES]), 0.5);
        assert_eq!(f32::from_bits(w[sp::FREQ]), -0.25);
        assert_eq!((w[sp::LIMIT], w[sp::PEN_OFF], w[sp::PEN_LEN]), (900, 11, 3));
        assert_eq!(
            w[sp::MASK],
            SAMPLE_NO_MASK,
            "the mask index is set by draw_rows"
        );
        assert_eq!(
            w[sp::NLP],
            SAMPLE_TOPN as u32,
            "capped at the kernel's top list"
        );
        let back = (w[sp::U_LO] as u64) | ((w[sp::U_HI] as u64) << 32);
        assert_eq!(f64::from_bits(back), u, "the uniform crosses bit for bit");
        let none = Draw {
            top_logprobs: None,
            ..d
        };
        assert_eq!(param_words(&none, 900, 0, 0)[sp::NLP] as i32, -1);
    }
}
