//! `gdn_decode.cu`: the Gated DeltaNet's sequential kernels (the decode step, and prefill calls
//! the chunked kernels do not take): the causal conv, the q/k L2 norm, the gates, the
//! token-by-token delta rule, the gated RMSNorm, and the decode step's conv + delta-rule step
//! in one launch (`gdn_convstep_dec*`, a cluster of two blocks a key head of two value heads).

use super::{Dev, On, kernels};
use crate::cuda::{Gpu, block_threads};
use anyhow::{Result, anyhow, ensure};
use half::bf16;

kernels! {
    /// Causal conv + SiLU of `t` rows of `c` channels (`ldp` floats apart) token by token, a
    /// thread a channel; `state [kern - 1, c]` advanced to end with the last inputs.
    GdnConv ["gdn_conv"] {
        p: Dev<f32>, state: Dev<f32>, w: Dev<f32>, out: Dev<f32>, t: i32, c: i32, ldp: i32, kern: i32,
    }
    /// L2-normalises the q and k heads of `qkv [t, c]` in place (q also times `q_scale`).
    GdnQkL2norm ["gdn_qk_l2norm"] { qkv: Dev<f32>, c: i32, hk: i32, dk: i32, q_scale: f32 }
    /// β = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias), `t` rows of `hv` (b and a `ld`
    /// floats apart).
    GdnGates ["gdn_gates"] {
        b: Dev<f32>, a: Dev<f32>, ld: i32, a_log: Dev<f32>, dt_bias: Dev<f32>, beta: Dev<f32>,
        g: Dev<f32>, t: i32, hv: i32,
    }
    /// The delta rule token by token: a block a value head, a thread a value column.
    GdnRecurrent ["gdn_recurrent_128"] {
        qkv: Dev<f32>, c: i32, g: Dev<f32>, beta: Dev<f32>, state: Dev<f32>, o: Dev<f32>, t: i32,
        hk: i32, hv: i32, dv: i32,
    }
    /// `out = bf16(RMSNorm(o) * w * SiLU(z))` over `rows` (token, value head) rows of `dv`.
    GdnGatedNorm ["gdn_gated_norm"] {
        o: Dev<f32>, z_in: Dev<f32>, w: Dev<f32>, out: Dev<bf16>, rows: i32, dv: i32, hv: i32,
        ldz: i32, eps: f32,
    }
    /// The decode step's conv + SiLU and q/k norm (a block a head of q, k, then v).
    GdnConvDec ["gdn_conv_dec"] {
        p: Dev<f32>, state: Dev<f32>, w: Dev<f32>, out: Dev<f32>, c: i32, kern: i32, hk: i32,
        dk: i32, dv: i32, q_scale: f32,
    }
    /// The decode step's gates, delta-rule step and gated norm, a block a value head.
    GdnStepDec ["gdn_step_dec_128"] {
        qkv: Dev<f32>, ba: Dev<f32>, a_log: Dev<f32>, dt_bias: Dev<f32>, z: Dev<f32>,
        nw: Dev<f32>, state: Dev<f32>, out: Dev<bf16>, hk: i32, hv: i32, dv: i32, eps: f32,
    }
    /// [`GdnConvDec`] and [`GdnStepDec`] in one launch: a block a value head computes its key
    /// head's q, k and its own v conv channels into shared memory (`_cl2`: two value heads a key
    /// head, a cluster of two blocks, the first writing the q/k conv state).
    GdnConvstepDec ["gdn_convstep_dec_128", "gdn_convstep_dec_cl2_128"] {
        p: Dev<f32>, conv_state: Dev<f32>, conv_w: Dev<f32>, z: Dev<f32>, ba: Dev<f32>,
        a_log: Dev<f32>, dt_bias: Dev<f32>, nw: Dev<f32>, state: Dev<f32>, out: Dev<bf16>, c: i32,
        hk: i32, hv: i32, dv: i32, q_scale: f32, eps: f32, tab: Dev<u64>, ldp: i32, ldo: i32,
    }
}

/// Key head dims the delta-rule kernels are compiled for (the model's).
pub const KEY_DIMS: [usize; 1] = [128];

/// The kernel of `names` compiled for key head dim `dk` (its name ends in `_{dk}`).
pub(super) fn for_dk(names: &'static [&'static str], dk: usize) -> Result<&'static str> {
    let suffix = format!("_{dk}");
    names
        .iter()
        .find(|n| n.ends_with(&suffix))
        .copied()
        .ok_or_else(|| anyhow!("no {} kernel for key head dim {dk}", names[0]))
}

impl GdnConv {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (t, c) = (self.t as usize, self.c as usize);
        ensure!(
            self.out.len >= t * c && self.state.len >= (self.kern as usize - 1) * c,
            "gdn_conv: {t} x {c}: out {:?}, state {:?}",
            self.out,
            self.state
        );
        gpu.run(
            "gdn_conv",
            (c.div_ceil(128) as u32, 1, 1),
            128,
            0,
            &self.args(),
            on,
        )
    }
}

impl GdnQkL2norm {
    /// A block a (token, q or k head), `t` tokens.
    pub fn launch(&self, gpu: &Gpu, t: usize, on: On) -> Result<()> {
        ensure!(
            self.qkv.len >= t * self.c as usize,
            "gdn_qk_l2norm: {:?}",
            self.qkv
        );
        let grid = (t as u32, 2 * self.hk as u32, 1);
        let block = block_threads(self.dk as usize);
        gpu.run("gdn_qk_l2norm", grid, block, 0, &self.args(), on)
    }
}

impl GdnGates {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let n = (self.t * self.hv) as usize;
        ensure!(
            self.beta.len >= n && self.g.len >= n && self.a_log.len >= self.hv as usize,
            "gdn_gates: {n} gates: beta {:?}, g {:?}",
            self.beta,
            self.g
        );
        gpu.run(
            "gdn_gates",
            (n.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

impl GdnRecurrent {
    pub fn launch(&self, gpu: &Gpu, dk: usize, on: On) -> Result<()> {
        let (t, hv, dv) = (self.t as usize, self.hv as usize, self.dv as usize);
        ensure!(
            self.o.len >= t * hv * dv && self.state.len >= hv * dk * dv,
            "gdn_recurrent: o {:?}, state {:?}",
            self.o,
            self.state
        );
        let name = for_dk(Self::NAMES, dk)?;
        gpu.run(
            name,
            (hv as u32, 1, 1),
            block_threads(dv),
            0,
            &self.args(),
            on,
        )
    }
}

impl GdnGatedNorm {
    /// 8 rows a block.
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (rows, dv) = (self.rows as usize, self.dv as usize);
        ensure!(
            self.o.len >= rows * dv && self.out.len >= rows * dv && self.w.len >= dv,
            "gdn_gated_norm: {rows} rows of {dv}: o {:?}, out {:?}",
            self.o,
            self.out
        );
        gpu.run(
            "gdn_gated_norm",
            (rows.div_ceil(8) as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

impl GdnConvDec {
    /// A block a q, k or v head (`hv` value heads).
    pub fn launch(&self, gpu: &Gpu, hv: usize, on: On) -> Result<()> {
        let (hk, dk, dv) = (self.hk as usize, self.dk as usize, self.dv as usize);
        ensure!(
            self.out.len >= self.c as usize && self.c as usize == 2 * hk * dk + hv * dv,
            "gdn_conv_dec: {} channels for {hk} x {dk} and {hv} x {dv}",
            self.c
        );
        let grid = ((2 * hk + hv) as u32, 1, 1);
        gpu.run(
            "gdn_conv_dec",
            grid,
            block_threads(dk.max(dv)),
            0,
            &self.args(),
            on,
        )
    }
}

impl GdnStepDec {
    pub fn launch(&self, gpu: &Gpu, dk: usize, on: On) -> Result<()> {
        let (hv, dv) = (self.hv as usize, self.dv as usize);
        ensure!(
            self.state.len >= hv * dk * dv && self.out.len >= hv * dv,
            "gdn_step_dec: state {:?}, out {:?}",
            self.state,
            self.out
        );
        let name = for_dk(Self::NAMES, dk)?;
        gpu.run(
            name,
            (hv as u32, 1, 1),
            block_threads(4 * dv),
            0,
            &self.args(),
            on,
        )
    }
}

/// Dynamic shared memory of `gdn_convstep_dec*` in bytes (gdn_decode.cu's `GDN_CONVSTEP_SMEM`):
/// q and k in padded quarters, the warps' sums, v.
fn convstep_smem(dk: usize, dv: usize) -> usize {
    (2 * (dk + 16) + 32 + dv) * 4
}

impl GdnConvstepDec {
    /// Whether the fused kernel takes this shape: conv kernel 4, the key head's q and k plus
    /// the head's v no more channels than the block's 4 dv threads, one or two value heads a
    /// key head, a compiled key head dim.
    pub fn fits(kern: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> bool {
        kern == 4
            && hk > 0
            && hv.is_multiple_of(hk)
            && matches!(hv / hk, 1 | 2)
            && KEY_DIMS.contains(&dk)
            && 2 * dk + dv <= block_threads(4 * dv) as usize
    }

    /// A block a value head (clusters of two where a key head has two) of each of `rows`
    /// sequences' tokens: one sequence (`conv_state` and `state` its own) or, with `tab`
    /// (`[conv state of each row | recurrent state of each row]`), a batched decode step.
    pub fn launch(&self, gpu: &Gpu, dk: usize, rows: usize, on: On) -> Result<()> {
        let (hk, hv, dv) = (self.hk as usize, self.hv as usize, self.dv as usize);
        ensure!(
            Self::fits(4, hk, hv, dk, dv),
            "gdn_convstep_dec: {hk} key heads of {dk}, {hv} value heads of {dv}"
        );
        let last = rows.saturating_sub(1);
        ensure!(
            rows >= 1
                && (rows == 1 || (!self.tab.is_null() && self.tab.len >= 2 * rows))
                && (!self.tab.is_null() || self.state.len >= hv * dk * dv)
                && self.out.len >= last * self.ldo as usize + hv * dv
                && self.p.len >= last * self.ldp as usize + self.c as usize,
            "gdn_convstep_dec: {rows} rows: state {:?}, table {:?}, out {:?}, p {:?}",
            self.state,
            self.tab,
            self.out,
            self.p
        );
        // dk is a compiled key head dim (fits)
        let name = if hv / hk == 2 {
            Self::NAMES[1]
        } else {
            Self::NAMES[0]
        };
        let block = block_threads(4 * dv);
        gpu.run(
            name,
            (hv as u32, rows as u32, 1),
            block,
            convstep_smem(dk, dv),
            &self.args(),
            on,
        )
    }
}
