//! The weights on the device: uploaded from host matrices (converted to bf16; norms and small
//! vectors f32) or seeded on the device (`--synthetic`), in the layout the kernels read
//! (fused in-projections, experts stacked `[E, rows, cols]`).

use super::{DeviceBuf, Gpu};
use crate::config::{LayerKind, TextConfig};
use crate::ops::attention::rope_inv_freq;
use crate::tensor::{DType, Mat, encode_f32};
use crate::weights::{ExpertWeights, Mixer, ModelWeights};
use anyhow::Result;

pub(super) struct GdnW {
    /// `[C + Hv*Dv + 2*Hv, D]`: the qkv conv inputs, z, b, a rows in one matrix, so decode
    /// reads them in one GEMV and prefill in one GEMM.
    pub(super) in_proj: DeviceBuf,
    pub(super) conv: DeviceBuf,
    pub(super) a_log: DeviceBuf,
    pub(super) dt_bias: DeviceBuf,
    pub(super) norm: DeviceBuf,
    pub(super) out: DeviceBuf,
}

pub(super) struct AttnW {
    /// `[Nq*2*Hd + 2*Nkv*Hd, D]`: query+gate, key and value rows in one matrix.
    pub(super) qkv: DeviceBuf,
    pub(super) o: DeviceBuf,
    pub(super) q_norm: DeviceBuf,
    pub(super) k_norm: DeviceBuf,
}

impl AttnW {
    /// Device pointers of the query+gate, key and value parts of `qkv`.
    pub(super) fn qkv_parts(&self, c: &TextConfig) -> (u64, u64, u64) {
        let row = (c.hidden_size * 2) as u64;
        let (q, kv) = (
            (c.num_attention_heads * 2 * c.head_dim) as u64,
            (c.num_kv_heads * c.head_dim) as u64,
        );
        let p = self.qkv.ptr;
        (p, p + q * row, p + (q + kv) * row)
    }
}

pub(super) enum MixerW {
    Gdn(GdnW),
    Attn(AttnW),
}

pub(super) struct LayerW {
    pub(super) input_norm: DeviceBuf,
    pub(super) post_norm: DeviceBuf,
    pub(super) mixer: MixerW,
    pub(super) router: DeviceBuf,
    /// `[E, 2I, D]`: per expert gate rows then up rows.
    pub(super) gate_up: DeviceBuf,
    /// `[E, D, I]`.
    pub(super) down: DeviceBuf,
    /// `[2Is, D]`.
    pub(super) shared_gate_up: DeviceBuf,
    pub(super) shared_down: DeviceBuf,
    pub(super) shared_gate: DeviceBuf,
}

/// Weights in the shape the GPU kernels read, from host matrices or seeded on the device.
pub(super) enum Source<'a> {
    Host(&'a ModelWeights),
    Synthetic(u64),
}

/// The GPU kernels read bf16 weights only: an FP8 or affine 4-bit (MLX, GPTQ, AWQ)
/// checkpoint is refused before anything is allocated (their GEMM kernels are not written
/// yet), rather than expanded to bf16 behind the user's back.
pub(super) fn ensure_no_fp8(w: &ModelWeights) -> Result<()> {
    if w.is_affine() {
        anyhow::bail!(
            "4-bit weights on the GPU are not supported yet (issue 39; this checkpoint is {}); \
             run it on the CPU backend (`--device cpu`) or use the bf16 checkpoint",
            w.format()
        );
    }
    if w.is_fp8() {
        anyhow::bail!(
            "FP8 weights on the GPU are not supported yet (this checkpoint is {}); run it on \
             the CPU backend (`--device cpu`) or use the bf16 checkpoint",
            w.format()
        );
    }
    Ok(())
}

fn bf16_bytes(m: &Mat) -> Vec<u8> {
    assert!(
        m.dtype != DType::F8E4M3 && !m.dtype.is_affine(),
        "FP8 and 4-bit weights are refused by ensure_no_fp8"
    );
    match m.dtype {
        DType::BF16 => m.bytes().to_vec(),
        _ => encode_f32(&m.to_f32(), DType::BF16),
    }
}

pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    encode_f32(v, DType::F32)
}

/// Every weight of the model on the device.
pub(super) struct Weights {
    pub(super) embed: DeviceBuf,
    pub(super) final_norm: DeviceBuf,
    pub(super) lm_head: DeviceBuf,
    /// RoPE's inverse frequencies (f32 `[rotary_dim / 2]`).
    pub(super) inv_freq: DeviceBuf,
    pub(super) layers: Vec<LayerW>,
}

impl Weights {
    /// Uploads (or seeds) every weight, calling `progress(bytes_uploaded, upload_total)` as
    /// they go up.
    pub(super) fn upload(
        gpu: &Gpu,
        cfg: &TextConfig,
        src: &Source,
        upload_total: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        if let Source::Host(w) = src {
            ensure_no_fp8(w)?;
        }
        let uploaded = std::cell::Cell::new(0u64);
        let progress = std::cell::RefCell::new(progress);
        let upload = |bytes: &[u8]| -> Result<DeviceBuf> {
            let b = gpu.upload(bytes)?;
            uploaded.set(uploaded.get() + bytes.len() as u64);
            (progress.borrow_mut())(uploaded.get().min(upload_total), upload_total);
            Ok(b)
        };
        let d = cfg.hidden_size;
        let mut seed_counter = 0u64;
        let mut mat =
            |host: Option<Vec<u8>>, rows: usize, cols: usize, std: f32| -> Result<DeviceBuf> {
                match (host, &src) {
                    (Some(bytes), _) => upload(&bytes),
                    (None, Source::Synthetic(seed)) => {
                        let b = gpu.alloc(rows * cols * 2)?;
                        seed_counter += 1;
                        gpu.fill_random(
                            b.ptr,
                            rows * cols,
                            false,
                            seed.wrapping_add(seed_counter),
                            0.0,
                            std,
                        )?;
                        Ok(b)
                    }
                    (None, Source::Host(_)) => unreachable!("host weights always give bytes"),
                }
            };
        let host = match &src {
            Source::Host(w) => Some(*w),
            Source::Synthetic(_) => None,
        };
        let mut vec_counter = 0u64;
        let mut vecf = |host: Option<&[f32]>, n: usize, mean: f32, std: f32| -> Result<DeviceBuf> {
            match host {
                Some(v) => upload(&f32_bytes(v)),
                None => {
                    let b = gpu.alloc(n * 4)?;
                    vec_counter += 1;
                    gpu.fill_random(b.ptr, n, true, 0x5eed_0000 + vec_counter, mean, std)?;
                    Ok(b)
                }
            }
        };
        let wstd = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        let embed = mat(host.map(|w| bf16_bytes(&w.embed)), cfg.vocab_size, d, 1.0)?;
        let lm_head = mat(
            host.map(|w| bf16_bytes(&w.lm_head)),
            cfg.vocab_size,
            d,
            wstd(d),
        )?;
        let final_norm = vecf(host.map(|w| w.final_norm.as_slice()), d, 0.0, 0.1)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let cat = |parts: &[&Mat]| -> Vec<u8> {
            let mut v = Vec::new();
            for p in parts {
                v.extend(bf16_bytes(p));
            }
            v
        };
        for (l, kind) in cfg.layer_kinds.iter().enumerate() {
            let hl = host.map(|w| &w.layers[l]);
            let mixer = match kind {
                LayerKind::Gdn => {
                    let g = hl.map(|x| match &x.mixer {
                        Mixer::Gdn(g) => g,
                        Mixer::Attention(_) => unreachable!("layer kinds come from the config"),
                    });
                    let (hv, ch) = (cfg.gdn_num_value_heads, cfg.gdn_conv_channels());
                    MixerW::Gdn(GdnW {
                        in_proj: mat(
                            g.map(|g| cat(&[&g.in_qkv, &g.in_z, &g.in_b, &g.in_a])),
                            ch + cfg.gdn_v_width() + 2 * hv,
                            d,
                            wstd(d),
                        )?,
                        conv: vecf(g.map(|g| g.conv.as_slice()), ch * cfg.conv_kernel, 0.0, 0.5)?,
                        a_log: match g {
                            Some(g) => gpu.upload(&f32_bytes(&g.a_log))?,
                            None => gpu.upload(&f32_bytes(
                                &(0..hv)
                                    .map(|j| (1.0 + 15.0 * j as f32 / hv as f32).ln())
                                    .collect::<Vec<_>>(),
                            ))?,
                        },
                        dt_bias: vecf(g.map(|g| g.dt_bias.as_slice()), hv, 0.0, 0.5)?,
                        norm: vecf(g.map(|g| g.norm.as_slice()), cfg.gdn_value_dim, 1.0, 0.1)?,
                        out: mat(
                            g.map(|g| bf16_bytes(&g.out)),
                            d,
                            cfg.gdn_v_width(),
                            wstd(cfg.gdn_v_width()),
                        )?,
                    })
                }
                LayerKind::Attention => {
                    let a = hl.map(|x| match &x.mixer {
                        Mixer::Attention(a) => a,
                        Mixer::Gdn(_) => unreachable!("layer kinds come from the config"),
                    });
                    let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
                    MixerW::Attn(AttnW {
                        qkv: mat(
                            a.map(|a| cat(&[&a.q, &a.k, &a.v])),
                            nq * 2 * hd + 2 * nkv * hd,
                            d,
                            wstd(d),
                        )?,
                        o: mat(a.map(|a| bf16_bytes(&a.o)), d, nq * hd, wstd(nq * hd))?,
                        q_norm: vecf(a.map(|a| a.q_norm.as_slice()), hd, 0.0, 0.1)?,
                        k_norm: vecf(a.map(|a| a.k_norm.as_slice()), hd, 0.0, 0.1)?,
                    })
                }
            };
            let moe = hl.map(|x| &x.moe);
            let (e, i, is) = (
                cfg.num_experts,
                cfg.moe_intermediate,
                cfg.shared_intermediate,
            );
            let experts_gate_up = moe.map(|m| {
                let mut v = Vec::with_capacity(e * 2 * i * d * 2);
                for x in &m.experts {
                    v.extend(bf16_bytes(&x.gate));
                    v.extend(bf16_bytes(&x.up));
                }
                v
            });
            let experts_down = moe.map(|m| {
                let mut v = Vec::with_capacity(e * d * i * 2);
                for x in &m.experts {
                    v.extend(bf16_bytes(&x.down));
                }
                v
            });
            let shared = moe.map(|m| &m.shared);
            let sh_gu = shared.map(|s: &ExpertWeights| cat(&[&s.gate, &s.up]));
            let gate_up = mat(experts_gate_up, e * 2 * i, d, wstd(d))?;
            let down = mat(experts_down, e * d, i, wstd(i))?;
            layers.push(LayerW {
                input_norm: vecf(hl.map(|x| x.input_norm.as_slice()), d, 0.0, 0.1)?,
                post_norm: vecf(hl.map(|x| x.post_attention_norm.as_slice()), d, 0.0, 0.1)?,
                mixer,
                router: mat(moe.map(|m| bf16_bytes(&m.router)), e, d, 0.1)?,
                gate_up,
                down,
                shared_gate_up: mat(sh_gu, 2 * is, d, wstd(d))?,
                shared_down: mat(shared.map(|s| bf16_bytes(&s.down)), d, is, wstd(is))?,
                shared_gate: vecf(moe.map(|m| m.shared_gate.as_slice()), d, 0.0, wstd(d))?,
            });
        }
        let inv_freq = gpu.upload(&f32_bytes(&rope_inv_freq(cfg.rotary_dim, cfg.rope_theta)))?;
        (progress.borrow_mut())(upload_total, upload_total);
        Ok(Weights {
            embed,
            final_norm,
            lm_head,
            inv_freq,
            layers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_weights_are_refused_with_a_clear_error() {
        let cfg = crate::synthetic::demo_config();
        let cfg = TextConfig {
            vocab_size: 64,
            ..cfg
        };
        let mut w = crate::synthetic::random_weights(&cfg, 1, DType::BF16);
        ensure_no_fp8(&w).unwrap();
        w.quantize_fp8(&crate::config::Fp8Quant::block_128());
        let e = ensure_no_fp8(&w).unwrap_err().to_string();
        assert!(
            e.contains("FP8 weights on the GPU are not supported yet")
                && e.contains("fp8 e4m3 block 128x128"),
            "{e}"
        );
    }

    #[test]
    fn four_bit_weights_are_refused_with_a_clear_error() {
        let cfg = TextConfig {
            vocab_size: 64,
            ..crate::synthetic::demo_config()
        };
        let mut w = crate::synthetic::random_weights(&cfg, 1, DType::BF16);
        let m = &mut w.layers[0].moe.shared.gate;
        *m = crate::tensor::Mat::quantize_affine(&m.to_f32(), m.rows, m.cols, 4, 64);
        let e = ensure_no_fp8(&w).unwrap_err().to_string();
        assert!(
            e.contains("4-bit weights on the GPU are not supported yet (issue 39")
                && e.contains("affine 4-bit group 64"),
            "{e}"
        );
    }
}
