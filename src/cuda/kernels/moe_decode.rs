//! `moe_decode.cu`: the decode step's MoE in three launches: the router with its RMSNorm and
//! the shared expert's gate (`moe_router_dec`), the top-k picked by every gate/up warp from the
//! logits with the chosen and shared experts' gate/up and SwiGLU (`moe_gate_up_dec`), and their
//! down projections combined into the residual (`moe_down_dec`, which picks its experts from the
//! logits and loads its weight rows before its griddep_wait).

use super::{Dev, On, U128, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// `xb = bf16(RMSNorm(h) * (1 + nw))`, the router's logits `wr · xb` and the shared gate.
    MoeRouterDec ["moe_router_dec"] {
        h: Dev<f32>, nw: Dev<f32>, eps: f32, d: i32, wr: Dev<bf16>, e: i32, w_sg: Dev<f32>,
        xb: Dev<bf16>, logits: Dev<f32>, sgate: Dev<f32>,
    }
    /// Grid (8-row groups, k + 1 experts: the chosen ones, then the shared one); `act` rows of
    /// `act_ld`; `late_launch` lets the down kernel start only after the router is done.
    MoeGateUpDec ["moe_gate_up_dec"] {
        xb: Dev<bf16>, d: i32, logits: Dev<f32>, e: i32, k: i32, topk_ids: Dev<i32>,
        topk_w: Dev<f32>, gate_up: Dev<bf16>, inter: i32, shared_gate_up: Dev<bf16>, s_inter: i32,
        act: Dev<f32>, act_ld: i32, late_launch: i32,
    }
    /// `h += Σ topk_w · down_x · act_x + sgate · shared_down · act_shared`; `early` 2: the
    /// experts from the logits and the weight rows by bulk copy before the griddep_wait.
    MoeDownDec ["moe_down_dec"] {
        act: Dev<f32>, act_ld: i32, topk_ids: Dev<i32>, topk_w: Dev<f32>, logits: Dev<f32>,
        e: i32, early: i32, k: i32, sgate: Dev<f32>, down: Dev<bf16>, inter: i32,
        shared_down: Dev<bf16>, s_inter: i32, h: Dev<f32>, d: i32,
    }
    /// [`MoeGateUpDec`] for FP8 experts (e4m3 words of 16 and their block scales).
    MoeGateUpDecFp8 ["moe_gate_up_dec_fp8"] {
        xb: Dev<bf16>, d: i32, logits: Dev<f32>, e: i32, k: i32, topk_ids: Dev<i32>,
        topk_w: Dev<f32>, gate_up: Dev<U128>, gu_sc: Dev<f32>, inter: i32,
        shared_gate_up: Dev<U128>, sgu_sc: Dev<f32>, s_inter: i32, act: Dev<f32>, act_ld: i32,
        late_launch: i32,
    }
    /// [`MoeDownDec`] for FP8 experts, the ids from `topk_ids` after the wait.
    MoeDownDecFp8 ["moe_down_dec_fp8"] {
        act: Dev<f32>, act_ld: i32, topk_ids: Dev<i32>, topk_w: Dev<f32>, k: i32,
        sgate: Dev<f32>, down: Dev<U128>, down_sc: Dev<f32>, inter: i32,
        shared_down: Dev<U128>, sd_sc: Dev<f32>, s_inter: i32, h: Dev<f32>, d: i32,
    }
    /// [`MoeGateUpDec`] for affine 4-bit experts (q4 tiles and their scale/bias pairs, on the
    /// tensor cores; grid of 16-feature groups).
    MoeGateUpDecQ4 ["moe_gate_up_dec_q4"] {
        xb: Dev<bf16>, d: i32, logits: Dev<f32>, e: i32, k: i32, topk_ids: Dev<i32>,
        topk_w: Dev<f32>, gate_up: Dev<U128>, gu_sb: Dev<u32>, inter: i32,
        shared_gate_up: Dev<U128>, sgu_sb: Dev<u32>, s_inter: i32, group: i32, act: Dev<f32>,
        act_ld: i32, late_launch: i32,
    }
    /// [`MoeDownDec`] for affine 4-bit experts, the ids from `topk_ids` after the wait (a
    /// block a strip of 16 rows).
    MoeDownDecQ4 ["moe_down_dec_q4"] {
        act: Dev<f32>, act_ld: i32, topk_ids: Dev<i32>, topk_w: Dev<f32>, k: i32,
        sgate: Dev<f32>, down: Dev<U128>, down_sb: Dev<u32>, inter: i32,
        shared_down: Dev<U128>, sd_sb: Dev<u32>, s_inter: i32, group: i32, h: Dev<f32>, d: i32,
    }
}

/// Shared memory of `moe_gate_up_dec_q4` in bytes (moe_decode.cu's gate_up_dec_q4_smem): the
/// staged input and its span sums, the warps' partial sums of two strips, then each warp's
/// routing copy.
pub fn gate_up_dec_q4_smem(d: usize, e: usize, k: usize, group: usize) -> usize {
    super::gemv::q4_smem(1, d, group, false, 8 * 2 * 16) + 4 * 8 * (e + 2 * k).next_multiple_of(4)
}

/// Shared memory of `moe_down_dec_q4` in bytes (moe_decode.cu's down_dec_q4_smem): each slot's
/// activations as bf16 and their span sums, then the slots' 16 row sums.
pub fn down_dec_q4_smem(k: usize, inter: usize, s_inter: usize, group: usize) -> usize {
    let kk = inter.max(s_inter);
    let span = if group == 32 { 32 } else { 64 };
    4 * (k + 1) * (kk / 2 + kk / span + 16)
}

/// The shape contract of the 4-bit decode MoE: widths whole strips and units, groups of 32,
/// 64 or 128 columns dividing every width.
fn q4_moe_shape(name: &str, d: usize, i: usize, is: usize, group: usize) -> Result<()> {
    ensure!(
        d.is_multiple_of(64)
            && i.is_multiple_of(64)
            && is.is_multiple_of(64)
            && matches!(group, 32 | 64 | 128)
            && [d, i, is].iter().all(|x| x.is_multiple_of(group)),
        "{name}: d {d}, inter {i}, shared {is} with groups of {group} do not fit the q4 tiles"
    );
    Ok(())
}

impl MoeGateUpDecQ4 {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (d, e, k) = (self.d as usize, self.e as usize, self.k as usize);
        let (i, is, group) = (
            self.inter as usize,
            self.s_inter as usize,
            self.group as usize,
        );
        q4_moe_shape("moe_gate_up_dec_q4", d, i, is, group)?;
        ensure!(
            self.act.len >= (k + 1) * self.act_ld as usize
                && self.act_ld as usize >= i.max(is)
                && self.gate_up.len * 32 >= e * 2 * i * d
                && self.gu_sb.len >= e * 2 * i * (d / group)
                && self.shared_gate_up.len * 32 >= 2 * is * d
                && self.sgu_sb.len >= 2 * is * (d / group),
            "moe_gate_up_dec_q4: d {d}, inter {i}, shared {is}: act {:?} of rows {}, gate_up {:?}",
            self.act,
            self.act_ld,
            self.gate_up
        );
        let grid = (i.max(is).div_ceil(16) as u32, (k + 1) as u32, 1);
        gpu.run(
            "moe_gate_up_dec_q4",
            grid,
            256,
            gate_up_dec_q4_smem(d, e, k, group),
            &self.args(),
            on,
        )
    }
}

impl MoeDownDecQ4 {
    /// Over `experts` routed experts' down stacks.
    pub fn launch(&self, gpu: &Gpu, experts: usize, on: On) -> Result<()> {
        let (d, k) = (self.d as usize, self.k as usize);
        let (i, is, group) = (
            self.inter as usize,
            self.s_inter as usize,
            self.group as usize,
        );
        q4_moe_shape("moe_down_dec_q4", d, i, is, group)?;
        ensure!(
            self.h.len >= d
                && self.down.len * 32 >= experts * d * i
                && self.down_sb.len >= experts * d * (i / group)
                && self.shared_down.len * 32 >= d * is
                && self.sd_sb.len >= d * (is / group),
            "moe_down_dec_q4: h {:?}, down {:?} for {experts} experts, shared_down {:?}",
            self.h,
            self.down,
            self.shared_down
        );
        let grid = ((d / 16) as u32, 1, 1);
        let block = (32 * (k + 1)) as u32;
        gpu.run(
            "moe_down_dec_q4",
            grid,
            block,
            down_dec_q4_smem(k, i, is, group),
            &self.args(),
            on,
        )
    }
}

/// Router rows per block of `moe_router_dec` (moe_decode.cu's ROUTER_ROWS).
const ROUTER_ROWS: usize = 2;

/// Shared memory of `moe_router_dec` in floats (moe_decode.cu's router_smem): the staged
/// input, the RMSNorm weight and the shared gate's row.
pub fn router_smem(d: usize) -> usize {
    3 * d
}

/// Shared memory of `moe_gate_up_dec` in floats (moe_decode.cu's gate_up_dec_smem): the staged
/// input, then for each of the 8 warps the logits, the top-k ids and weights (rounded up to 16
/// bytes).
pub fn gate_up_dec_smem(d: usize, e: usize, k: usize) -> usize {
    d + 8 * (e + 2 * k).next_multiple_of(4)
}

/// Shared memory of `moe_down_dec` in bytes (moe_decode.cu's down_dec_smem, early mode): the
/// router's logits, the ids and weights, then (expert widths 512) the block's weight rows.
pub fn down_dec_smem(e: usize, k: usize, inter: usize, s_inter: usize) -> usize {
    let rows = if inter == 512 && s_inter == 512 {
        (k + 1) * (4 * 2 * 32 * 16 + 8) // and a bulk copy's mbarrier a warp
    } else {
        0
    };
    ((e + 2 * k + 3) & !3) * 4 + rows
}

impl MoeRouterDec {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (d, e) = (self.d as usize, self.e as usize);
        ensure!(
            self.logits.len >= e && self.xb.len >= d && self.wr.len >= e * d,
            "moe_router_dec: logits {:?}, xb {:?}",
            self.logits,
            self.xb
        );
        let grid = (e.div_ceil(ROUTER_ROWS) as u32 + 1, 1, 1);
        gpu.run(
            "moe_router_dec",
            grid,
            256,
            router_smem(d) * 4,
            &self.args(),
            on,
        )
    }
}

impl MoeGateUpDec {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (d, e, k) = (self.d as usize, self.e as usize, self.k as usize);
        let (i, is) = (self.inter as usize, self.s_inter as usize);
        ensure!(
            self.act.len >= (k + 1) * self.act_ld as usize && self.act_ld as usize >= i.max(is),
            "moe_gate_up_dec: act {:?} of rows {}",
            self.act,
            self.act_ld
        );
        let grid = (i.max(is).div_ceil(8) as u32, (k + 1) as u32, 1);
        gpu.run(
            "moe_gate_up_dec",
            grid,
            256,
            gate_up_dec_smem(d, e, k) * 4,
            &self.args(),
            on,
        )
    }
}

impl MoeDownDec {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (d, e, k) = (self.d as usize, self.e as usize, self.k as usize);
        let (i, is) = (self.inter as usize, self.s_inter as usize);
        ensure!(
            self.early == 2 && self.h.len >= d,
            "moe_down_dec: early {} (the engine runs 2), h {:?}",
            self.early,
            self.h
        );
        let grid = (d.div_ceil(4) as u32, 1, 1);
        let block = (32 * (k + 1)) as u32;
        gpu.run(
            "moe_down_dec",
            grid,
            block,
            down_dec_smem(e, k, i, is),
            &self.args(),
            on,
        )
    }
}

impl MoeGateUpDecFp8 {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (d, e, k) = (self.d as usize, self.e as usize, self.k as usize);
        let (i, is) = (self.inter as usize, self.s_inter as usize);
        ensure!(
            d.is_multiple_of(16)
                && i.is_multiple_of(128)
                && is.is_multiple_of(128)
                && self.act.len >= (k + 1) * self.act_ld as usize
                && self.act_ld as usize >= i.max(is)
                && self.gate_up.len * 16 >= e * 2 * i * d
                && self.shared_gate_up.len * 16 >= 2 * is * d,
            "moe_gate_up_dec_fp8: d {d}, inter {i}, shared {is}: act {:?} of rows {}",
            self.act,
            self.act_ld
        );
        let grid = (i.max(is).div_ceil(8) as u32, (k + 1) as u32, 1);
        gpu.run(
            "moe_gate_up_dec_fp8",
            grid,
            256,
            gate_up_dec_smem(d, e, k) * 4,
            &self.args(),
            on,
        )
    }
}

impl MoeDownDecFp8 {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (d, k) = (self.d as usize, self.k as usize);
        let (i, is) = (self.inter as usize, self.s_inter as usize);
        ensure!(
            d.is_multiple_of(128)
                && i.is_multiple_of(16)
                && is.is_multiple_of(16)
                && self.h.len >= d
                && self.shared_down.len * 16 >= d * is,
            "moe_down_dec_fp8: d {d}, inter {i}, shared {is}: h {:?}",
            self.h
        );
        let grid = (d.div_ceil(4) as u32, 1, 1);
        gpu.run(
            "moe_down_dec_fp8",
            grid,
            (32 * (k + 1)) as u32,
            0,
            &self.args(),
            on,
        )
    }
}
