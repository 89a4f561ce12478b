//! The weights on the device: uploaded from host matrices (bf16, or FP8 as stored with their
//! block scales; norms and small vectors f32) or seeded on the device (`--synthetic`), in the
//! layout the kernels read (fused in-projections, experts stacked `[E, rows, cols]`).

use super::kernels::gemv::{Fp8, Q4};
use super::{DeviceBuf, Gpu};
pub use crate::config::WeightFormat;
use crate::config::{LayerKind, TextConfig};
use crate::ops::attention::rope_inv_freq;
use crate::tensor::{DType, Mat, encode_f32};
use crate::weights::{ExpertWeights, Mixer, ModelWeights};
use anyhow::{Result, bail, ensure};

/// The FP8 block (rows and columns) the GPU kernels read: the official release's 128 x 128.
pub(super) const FP8_BLOCK: usize = 128;

/// A weight matrix on the device, `[rows, cols]` row-major: bf16, or FP8 (W8A16 in the decode
/// kernels): e4m3 bytes and f32 block scales `[ceil(rows / 128), ceil(cols / 128)]`, w = q * s.
/// A stack of parts (fused projections, experts) keeps every part but the last a multiple of
/// 128 rows, so one block grid serves the stack.
/// Affine 4-bit (W4A16 on the tensor cores): the codes in q4 tiles and the (scale, bias) bf16
/// pairs of every 16-row strip's groups (gemv.cuh has the layout; [`q4_tiles`] writes it); a
/// stack keeps every part whole 16-row strips.
pub(super) enum Wt {
    Bf16(DeviceBuf),
    Fp8 {
        q: DeviceBuf,
        sc: DeviceBuf,
    },
    Q4 {
        q: DeviceBuf,
        sb: DeviceBuf,
        group: usize,
    },
}

impl Wt {
    pub(super) fn fp8(&self) -> Option<Fp8> {
        match self {
            Wt::Fp8 { q, sc } => Some(Fp8 {
                q: q.view(),
                sc: sc.f32(),
            }),
            _ => None,
        }
    }
    pub(super) fn q4(&self) -> Option<Q4> {
        match self {
            Wt::Q4 { q, sb, group } => Some(Q4 {
                q: q.view(),
                sb: sb.view(),
                group: *group,
            }),
            _ => None,
        }
    }
    /// The bf16 matrix; an error names the quantized matrix a bf16-only path was given.
    pub(super) fn bf16_buf(&self, what: &str) -> Result<&DeviceBuf> {
        match self {
            Wt::Bf16(b) => Ok(b),
            Wt::Fp8 { .. } => bail!("{what}: an FP8 matrix on a bf16-only path"),
            Wt::Q4 { .. } => bail!("{what}: a 4-bit matrix on a bf16-only path"),
        }
    }
}

/// Rows `[row0, row0 + n)` of an FP8 matrix of `cols` columns (row0 % 128 == 0).
pub(super) fn fp8_rows(w: Fp8, cols: usize, row0: usize) -> Result<Fp8> {
    ensure!(
        row0.is_multiple_of(FP8_BLOCK),
        "FP8 rows from {row0}: not on a {FP8_BLOCK}-row block"
    );
    let kb = cols.div_ceil(FP8_BLOCK);
    Ok(Fp8 {
        q: w.q.at(row0 * cols / 16),
        sc: w.sc.at(row0 / FP8_BLOCK * kb),
    })
}

pub(super) struct GdnW {
    /// `[C + Hv*Dv + 2*Hv, D]`: the qkv conv inputs, z, b, a rows in one matrix, so decode
    /// reads them in one GEMV and prefill in one GEMM. FP8 and 4-bit: the qkv and z rows only
    /// (`[C + Hv*Dv, D]`), b and a in `in_ba` as bf16 (so kept by the FP8 format; a 4-bit
    /// checkpoint's are dequantised: 2 Hv rows need not be whole 16-row strips).
    pub(super) in_proj: Wt,
    /// FP8 and 4-bit checkpoints: the bf16 b and a rows `[2*Hv, D]`.
    pub(super) in_ba: Option<DeviceBuf>,
    pub(super) conv: DeviceBuf,
    pub(super) a_log: DeviceBuf,
    pub(super) dt_bias: DeviceBuf,
    pub(super) norm: DeviceBuf,
    pub(super) out: Wt,
}

pub(super) struct AttnW {
    /// `[Nq*2*Hd + 2*Nkv*Hd, D]`: query+gate, key and value rows in one matrix.
    pub(super) qkv: Wt,
    pub(super) o: Wt,
    pub(super) q_norm: DeviceBuf,
    pub(super) k_norm: DeviceBuf,
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
    pub(super) gate_up: Wt,
    /// `[E, D, I]`.
    pub(super) down: Wt,
    /// `[2Is, D]`.
    pub(super) shared_gate_up: Wt,
    pub(super) shared_down: Wt,
    pub(super) shared_gate: DeviceBuf,
}

/// Weights in the shape the GPU kernels read, from host matrices or seeded on the device.
pub(super) enum Source<'a> {
    Host(&'a ModelWeights),
    Synthetic(u64, WeightFormat),
}

impl Source<'_> {
    pub(super) fn format(&self) -> WeightFormat {
        match self {
            Source::Host(w) => w.weight_format(),
            Source::Synthetic(_, f) => *f,
        }
    }
}

/// The GPU runs bf16, FP8 and affine 4-bit checkpoints. Refused before anything is allocated:
/// GPTQ's act-order (a column to group map: its groups are not runs of columns, which the q4
/// tiles need), 4-bit matrices the tiles cannot hold (groups other than 32, 64, 128; rows not
/// whole 16-row strips; columns not a multiple of 64), and a layer whose experts (routed and
/// shared) are not all 4-bit with one group or all not (the MoE kernels take one format).
pub(super) fn ensure_gpu_format(w: &ModelWeights) -> Result<()> {
    let fits = |m: &Mat| {
        m.affine.as_ref().is_some_and(|a| {
            matches!(a.group, 32 | 64 | 128)
                && m.rows.is_multiple_of(16)
                && m.cols.is_multiple_of(64)
                && m.cols.is_multiple_of(a.group)
        })
    };
    for (l, layer) in w.layers.iter().enumerate() {
        let moe = &layer.moe;
        let experts: Vec<&Mat> = moe
            .experts
            .iter()
            .chain([&moe.shared])
            .flat_map(|e| [&e.gate, &e.up, &e.down])
            .collect();
        let four: Vec<bool> = experts.iter().map(|m| m.dtype == DType::U4).collect();
        let groups: Vec<usize> = experts
            .iter()
            .filter_map(|m| m.affine.as_ref().map(|a| a.group))
            .collect();
        if four.iter().any(|&b| b)
            && (four.iter().any(|&b| !b) || groups.windows(2).any(|g| g[0] != g[1]))
        {
            bail!(
                "layer {l}: the routed and shared experts mix 4-bit and other formats or group \
                 sizes; the GPU's MoE kernels take every expert of a layer in one format (run it \
                 on `--device cpu`)"
            );
        }
    }
    let (q, k) = w.matrices_by_role();
    for m in q.iter().chain([&&w.lm_head]) {
        if m.dtype == DType::U4 && !fits(m) {
            bail!(
                "a 4-bit matrix of {} x {} with groups of {} does not fit the GPU's 4-bit tiles \
                 (groups of 32, 64 or 128 columns, rows in whole 16-row strips, columns a \
                 multiple of 64); run it on `--device cpu`",
                m.rows,
                m.cols,
                m.affine.as_ref().map_or(0, |a| a.group)
            );
        }
    }
    if q.iter()
        .chain(&k)
        .any(|m| m.affine.as_ref().is_some_and(|a| a.col_group.is_some()))
    {
        bail!(
            "GPTQ act-order (desc_act, a g_idx column order) on the GPU is not supported yet \
             (issue 39; this checkpoint is {}); run it on the CPU backend (`--device cpu`) or use \
             a checkpoint quantised without act-order",
            w.format()
        );
    }
    Ok(())
}

/// bf16 bytes of a matrix; affine (4- or 8-bit) ones dequantised (the embedding, the router,
/// GDN's a and b, 8-bit modules).
fn bf16_bytes(m: &Mat) -> Vec<u8> {
    assert!(
        m.dtype != DType::F8E4M3,
        "FP8 matrices go up through fp8_bytes"
    );
    match m.dtype {
        DType::BF16 => m.bytes().to_vec(),
        _ => encode_f32(&m.to_f32(), DType::BF16),
    }
}

/// The q4 tiles of `parts` (4-bit affine matrices, one group size, stacked by rows) as
/// [`Wt::Q4`] stores them: (codes, (scale, bias) pairs, group). The layout (gemv.cuh): strip
/// s = r / 16, unit u = c / 64, lane l (g = l / 4, c0 = 2 (l % 4)), k-step j; nibble i of the
/// lane's u32 j is fragment element (row, column) (g, c0), (g+8, c0), (g, c0+8), (g+8, c0+8),
/// (g, c0+1), (g+8, c0+1), (g, c0+9), (g+8, c0+9) of the k-step's 16 x 16; the pairs
/// `[strips, cols / group, 16]`, bf16 scale low, bias high. `name` names the stack in errors.
pub(super) fn q4_tiles(parts: &[&Mat], name: &str) -> Result<(Vec<u8>, Vec<u8>, usize)> {
    let cols = parts.first().map_or(0, |m| m.cols);
    let mut group = 0;
    let (mut q, mut sb) = (Vec::new(), Vec::new());
    for (i, m) in parts.iter().enumerate() {
        let Some(a) = m.affine.as_ref().filter(|_| m.dtype == DType::U4) else {
            bail!(
                "{name}: part {i} is {} where the GPU's 4-bit layout needs U4",
                m.dtype.name()
            );
        };
        if i == 0 {
            group = a.group;
        }
        ensure!(
            a.col_group.is_none()
                && a.group == group
                && matches!(group, 32 | 64 | 128)
                && m.cols == cols
                && cols.is_multiple_of(64)
                && cols.is_multiple_of(group)
                && m.rows.is_multiple_of(16),
            "{name}: part {i} ({} x {}, group {}{}) does not fit the GPU's 4-bit layout (rows in \
             whole 16-row strips, columns a multiple of 64, one group of 32, 64 or 128 for the \
             stack, groups runs of columns)",
            m.rows,
            m.cols,
            a.group,
            if a.col_group.is_some() {
                ", act-order"
            } else {
                ""
            }
        );
        let groups = cols / group;
        // the codes, strips spread over the host's cores (the full model has ~2 x 10^10)
        let at = q.len();
        q.resize(at + m.rows * cols / 2, 0);
        let strip_bytes = 8 * cols;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = (m.rows / 16).div_ceil(threads).max(1);
        std::thread::scope(|sc| {
            for (i, out) in q[at..].chunks_mut(per * strip_bytes).enumerate() {
                let codes = m.bytes();
                sc.spawn(move || {
                    for (k, o) in out.chunks_mut(strip_bytes).enumerate() {
                        q4_strip(codes, cols, i * per + k, o);
                    }
                });
            }
        });
        let (mut s, mut b) = (vec![0.0f32; groups], vec![0.0f32; groups]);
        for st in 0..m.rows / 16 {
            let mut pairs = vec![0u32; groups * 16];
            for r in 0..16 {
                a.scales.rows_f32(st * 16 + r, st * 16 + r + 1, &mut s);
                a.biases.rows_f32(st * 16 + r, st * 16 + r + 1, &mut b);
                for gi in 0..groups {
                    let bits = |v: f32| half::bf16::from_f32(v).to_bits() as u32;
                    pairs[gi * 16 + r] = bits(s[gi]) | bits(b[gi]) << 16;
                }
            }
            sb.extend(pairs.iter().flat_map(|p| p.to_le_bytes()));
        }
    }
    Ok((q, sb, group))
}

/// Strip `st` of a row-major 4-bit matrix (`codes`, two a byte, low nibble first; `cols`
/// columns) as q4 tiles into `out` (`8 cols` bytes), in the order [`q4_tiles`] describes.
fn q4_strip(codes: &[u8], cols: usize, st: usize, out: &mut [u8]) {
    let rb = cols / 2;
    let nib = |r: usize, c: usize| -> u32 {
        let b = codes[r * rb + c / 2];
        (if c.is_multiple_of(2) { b & 15 } else { b >> 4 }) as u32
    };
    let mut words = out.chunks_exact_mut(4);
    for u in 0..cols / 64 {
        for l in 0..32 {
            let (g, c0) = (l / 4, 2 * (l % 4));
            let pos = [
                (g, c0),
                (g + 8, c0),
                (g, c0 + 8),
                (g + 8, c0 + 8),
                (g, c0 + 1),
                (g + 8, c0 + 1),
                (g, c0 + 9),
                (g + 8, c0 + 9),
            ];
            for j in 0..4 {
                let mut w = 0u32;
                for (n, (dr, dc)) in pos.iter().enumerate() {
                    w |= nib(st * 16 + dr, u * 64 + 16 * j + dc) << (4 * n);
                }
                words
                    .next()
                    .expect("a strip's 8 cols bytes")
                    .copy_from_slice(&w.to_le_bytes());
            }
        }
    }
}

/// The e4m3 bytes and f32 block scales of `parts` stacked by rows, as [`Wt::Fp8`] stores them;
/// `name` names the stack in errors.
fn fp8_bytes(parts: &[&Mat], name: &str) -> Result<(Vec<u8>, Vec<u8>)> {
    let (mut q, mut sc) = (Vec::new(), Vec::new());
    for (i, m) in parts.iter().enumerate() {
        let Some(s) = m.scales.as_ref().filter(|_| m.dtype == DType::F8E4M3) else {
            bail!(
                "{name}: part {i} is {} where the GPU's FP8 layout needs F8_E4M3",
                m.dtype.name()
            );
        };
        ensure!(
            (s.block_rows, s.block_cols) == (FP8_BLOCK, FP8_BLOCK)
                && s.row0.is_multiple_of(FP8_BLOCK)
                && (i + 1 == parts.len() || m.rows.is_multiple_of(FP8_BLOCK))
                && m.cols == parts[0].cols
                && m.cols.is_multiple_of(16),
            "{name}: part {i} ({} x {}, block {} x {} from row {}) does not fit the GPU's FP8 \
             layout (128 x 128 blocks, stacked parts of whole blocks, columns a multiple of 16)",
            m.rows,
            m.cols,
            s.block_rows,
            s.block_cols,
            s.row0
        );
        q.extend_from_slice(m.bytes());
        for r in (0..m.rows).step_by(FP8_BLOCK) {
            sc.extend(encode_f32(s.row(r), DType::F32));
        }
    }
    Ok((q, sc))
}

pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    encode_f32(v, DType::F32)
}

/// Every weight of the model on the device.
pub(super) struct Weights {
    pub(super) embed: DeviceBuf,
    pub(super) final_norm: DeviceBuf,
    pub(super) lm_head: Wt,
    /// RoPE's inverse frequencies (f32 `[rotary_dim / 2]`).
    pub(super) inv_freq: DeviceBuf,
    pub(super) layers: Vec<LayerW>,
    pub(super) format: WeightFormat,
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
        let format = src.format();
        let fp8 = format == WeightFormat::Fp8;
        let int4 = format == WeightFormat::Int4;
        let uploaded = std::cell::Cell::new(0u64);
        let progress = std::cell::RefCell::new(progress);
        let upload = |bytes: &[u8]| -> Result<DeviceBuf> {
            let b = gpu.upload(bytes)?;
            uploaded.set(uploaded.get() + bytes.len() as u64);
            (progress.borrow_mut())(uploaded.get().min(upload_total), upload_total);
            Ok(b)
        };
        let d = cfg.hidden_size;
        let seed_counter = std::cell::Cell::new(0u64);
        let next_seed = |seed: u64| {
            seed_counter.set(seed_counter.get() + 1);
            seed.wrapping_add(seed_counter.get())
        };
        // A bf16 matrix: the host's bytes, or seeded N(0, std) on the device.
        let mat =
            |host: Option<Vec<u8>>, rows: usize, cols: usize, std: f32| -> Result<DeviceBuf> {
                match (host, &src) {
                    (Some(bytes), _) => upload(&bytes),
                    (None, Source::Synthetic(seed, _)) => {
                        let b = gpu.alloc(rows * cols * 2)?;
                        gpu.fill_random(b.ptr, rows * cols, false, next_seed(*seed), 0.0, std)?;
                        Ok(b)
                    }
                    (None, Source::Host(_)) => unreachable!("host weights always give bytes"),
                }
            };
        // A quantizable matrix (the stack of `parts`): bf16, or in FP8 checkpoints e4m3 with
        // its block scales (seeded: bytes of about N(0, 16), every scale std / 16), or in 4-bit
        // ones q4 tiles where every part is 4-bit (seeded: uniform codes, groups of
        // Q4_GROUP), else (modules left unquantized or 8-bit) bf16.
        let wt = |parts: Option<Vec<&Mat>>,
                  name: &str,
                  rows: usize,
                  cols: usize,
                  std: f32|
         -> Result<Wt> {
            if int4 {
                return match (parts, &src) {
                    (Some(ps), _) if ps.iter().all(|m| m.dtype == DType::U4) => {
                        let (q, sb, group) = q4_tiles(&ps, name)?;
                        Ok(Wt::Q4 {
                            q: upload(&q)?,
                            sb: upload(&sb)?,
                            group,
                        })
                    }
                    (Some(ps), _) => {
                        let bytes: Vec<u8> = ps.iter().flat_map(|m| bf16_bytes(m)).collect();
                        Ok(Wt::Bf16(upload(&bytes)?))
                    }
                    (None, Source::Synthetic(seed, _)) => {
                        let group = crate::config::Q4_GROUP;
                        let q = gpu.alloc(rows * cols / 2)?;
                        let sb = gpu.alloc(rows * (cols / group) * 4)?;
                        super::kernels::misc::FillRandomQ4 {
                            codes: q.view(),
                            n_words: (rows * cols / 8) as u64,
                            sb: sb.view(),
                            n_pairs: (rows * (cols / group)) as u64,
                            seed: next_seed(*seed),
                            std,
                        }
                        .launch(gpu)?;
                        Ok(Wt::Q4 { q, sb, group })
                    }
                    (None, Source::Host(_)) => unreachable!("host weights always give matrices"),
                };
            }
            if !fp8 {
                let host = parts.map(|ps| ps.iter().flat_map(|m| bf16_bytes(m)).collect());
                return Ok(Wt::Bf16(mat(host, rows, cols, std)?));
            }
            match (parts, &src) {
                (Some(ps), _) => {
                    let (q, sc) = fp8_bytes(&ps, name)?;
                    Ok(Wt::Fp8 {
                        q: upload(&q)?,
                        sc: upload(&sc)?,
                    })
                }
                (None, Source::Synthetic(seed, _)) => {
                    const MULT: f32 = 16.0;
                    let q = gpu.alloc(rows * cols)?;
                    super::kernels::misc::FillRandomE4m3 {
                        out: q.view(),
                        n: (rows * cols) as u64,
                        seed: next_seed(*seed),
                        mult: MULT,
                    }
                    .launch(gpu)?;
                    let blocks = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
                    let sc = gpu.alloc(blocks * 4)?;
                    gpu.fill_random(sc.ptr, blocks, true, 0, std / MULT, 0.0)?;
                    Ok(Wt::Fp8 { q, sc })
                }
                (None, Source::Host(_)) => unreachable!("host weights always give matrices"),
            }
        };
        let host = match &src {
            Source::Host(w) => Some(*w),
            Source::Synthetic(..) => None,
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
        let lm_head = if int4 {
            wt(
                host.map(|w| vec![&w.lm_head]),
                "lm_head",
                cfg.vocab_size,
                d,
                wstd(d),
            )?
        } else {
            Wt::Bf16(mat(
                host.map(|w| bf16_bytes(&w.lm_head)),
                cfg.vocab_size,
                d,
                wstd(d),
            )?)
        };
        let final_norm = vecf(host.map(|w| w.final_norm.as_slice()), d, 0.0, 0.1)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let cat =
            |parts: &[&Mat]| -> Vec<u8> { parts.iter().flat_map(|m| bf16_bytes(m)).collect() };
        for (l, kind) in cfg.layer_kinds.iter().enumerate() {
            let hl = host.map(|w| &w.layers[l]);
            let mixer = match kind {
                LayerKind::Gdn => {
                    let g = hl.map(|x| match &x.mixer {
                        Mixer::Gdn(g) => g,
                        Mixer::Attention(_) => unreachable!("layer kinds come from the config"),
                    });
                    let (hv, ch) = (cfg.gdn_num_value_heads, cfg.gdn_conv_channels());
                    let (in_proj, in_ba) = if fp8 || int4 {
                        let ba = mat(g.map(|g| cat(&[&g.in_b, &g.in_a])), 2 * hv, d, wstd(d))?;
                        let qz = wt(
                            g.map(|g| vec![&g.in_qkv, &g.in_z]),
                            &format!("layer {l} in_proj_qkv + in_proj_z"),
                            ch + cfg.gdn_v_width(),
                            d,
                            wstd(d),
                        )?;
                        (qz, Some(ba))
                    } else {
                        let all = g.map(|g| vec![&g.in_qkv, &g.in_z, &g.in_b, &g.in_a]);
                        let w = wt(all, "", ch + cfg.gdn_v_width() + 2 * hv, d, wstd(d))?;
                        (w, None)
                    };
                    MixerW::Gdn(GdnW {
                        in_proj,
                        in_ba,
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
                        out: wt(
                            g.map(|g| vec![&g.out]),
                            &format!("layer {l} out_proj"),
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
                        qkv: wt(
                            a.map(|a| vec![&a.q, &a.k, &a.v]),
                            &format!("layer {l} q_proj + k_proj + v_proj"),
                            nq * 2 * hd + 2 * nkv * hd,
                            d,
                            wstd(d),
                        )?,
                        o: wt(
                            a.map(|a| vec![&a.o]),
                            &format!("layer {l} o_proj"),
                            d,
                            nq * hd,
                            wstd(nq * hd),
                        )?,
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
            let experts_gate_up =
                moe.map(|m| m.experts.iter().flat_map(|x| [&x.gate, &x.up]).collect());
            let experts_down = moe.map(|m| m.experts.iter().map(|x| &x.down).collect());
            let shared = moe.map(|m| &m.shared);
            let sh_gu = shared.map(|s: &ExpertWeights| vec![&s.gate, &s.up]);
            let gate_up = wt(
                experts_gate_up,
                &format!("layer {l} experts' gate_proj + up_proj"),
                e * 2 * i,
                d,
                wstd(d),
            )?;
            let down = wt(
                experts_down,
                &format!("layer {l} experts' down_proj"),
                e * d,
                i,
                wstd(i),
            )?;
            layers.push(LayerW {
                input_norm: vecf(hl.map(|x| x.input_norm.as_slice()), d, 0.0, 0.1)?,
                post_norm: vecf(hl.map(|x| x.post_attention_norm.as_slice()), d, 0.0, 0.1)?,
                mixer,
                router: mat(moe.map(|m| bf16_bytes(&m.router)), e, d, 0.1)?,
                gate_up,
                down,
                shared_gate_up: wt(
                    sh_gu,
                    &format!("layer {l} shared_expert gate_proj + up_proj"),
                    2 * is,
                    d,
                    wstd(d),
                )?,
                shared_down: wt(
                    shared.map(|s| vec![&s.down]),
                    &format!("layer {l} shared_expert down_proj"),
                    d,
                    is,
                    wstd(is),
                )?,
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
            format,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4-bit weights go to the GPU; refused with a clear error before anything is allocated:
    /// a layer mixing 4-bit and other experts, a group the tiles do not take, GPTQ act-order.
    #[test]
    fn what_the_4_bit_tiles_cannot_hold_is_refused_and_the_rest_passes() {
        let cfg = TextConfig {
            vocab_size: 64,
            moe_intermediate: 64,
            shared_intermediate: 64,
            ..crate::synthetic::demo_config()
        };
        let mut w = crate::synthetic::random_weights(&cfg, 1, DType::BF16);
        ensure_gpu_format(&w).unwrap();
        let mut fp8 = crate::synthetic::random_weights(&cfg, 1, DType::BF16);
        fp8.quantize_fp8(&crate::config::Fp8Quant::block_128());
        ensure_gpu_format(&fp8).unwrap();
        let q4 = |m: &mut Mat, group: usize| {
            *m = crate::tensor::Mat::quantize_affine(&m.to_f32(), m.rows, m.cols, 4, group);
        };
        // one expert matrix of a layer 4-bit, the others not: the MoE kernels take one format
        q4(&mut w.layers[0].moe.shared.gate, 64);
        let e = ensure_gpu_format(&w).unwrap_err().to_string();
        assert!(
            e.contains("layer 0: the routed and shared experts mix"),
            "{e}"
        );
        let moe = &mut w.layers[0].moe;
        for x in moe.experts.iter_mut().chain([&mut moe.shared]) {
            for m in [&mut x.gate, &mut x.up, &mut x.down] {
                if m.dtype != DType::U4 {
                    q4(m, 64);
                }
            }
        }
        ensure_gpu_format(&w).unwrap();
        assert_eq!(w.weight_format(), WeightFormat::Int4);
        // a group the tiles do not take
        let o = &mut w.layers[1].mixer;
        if let crate::weights::Mixer::Gdn(g) = o {
            q4(&mut g.out, 16);
        } else if let crate::weights::Mixer::Attention(a) = o {
            q4(&mut a.o, 16);
        }
        let e = ensure_gpu_format(&w).unwrap_err().to_string();
        assert!(e.contains("with groups of 16 does not fit"), "{e}");
        if let crate::weights::Mixer::Gdn(g) = &mut w.layers[1].mixer {
            q4(&mut g.out, 64);
        } else if let crate::weights::Mixer::Attention(a) = &mut w.layers[1].mixer {
            q4(&mut a.o, 64);
        }
        ensure_gpu_format(&w).unwrap();
        let g = &mut w.layers[0].moe.shared.gate;
        let cols = g.cols as u32;
        let a = g.affine.as_mut().unwrap();
        a.col_group = Some(std::sync::Arc::new((0..cols).map(|c| c % 2).collect()));
        let e = ensure_gpu_format(&w).unwrap_err().to_string();
        assert!(
            e.contains("GPTQ act-order") && e.contains("issue 39"),
            "{e}"
        );
    }

    /// Every 4-bit fixture (MLX, GPTQ, AWQ, compressed-tensors) passes the GPU's checks and
    /// packs into q4 tiles, matrix by matrix, as the GPU tests will load them.
    #[test]
    fn the_4_bit_fixtures_fit_the_gpu_tiles() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for name in ["tiny-mlx-4bit", "tiny-gptq", "tiny-awq", "tiny-ct"] {
            let m = crate::model::CpuModel::load(&root.join(name)).unwrap();
            assert_eq!(m.weights.weight_format(), WeightFormat::Int4, "{name}");
            ensure_gpu_format(&m.weights).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (q, _) = m.weights.matrices_by_role();
            let packed = q
                .iter()
                .chain([&&m.weights.lm_head])
                .filter(|x| x.dtype == DType::U4)
                .map(|x| q4_tiles(&[x], name).map(|_| ()))
                .collect::<Result<Vec<_>>>()
                .unwrap();
            assert!(!packed.is_empty(), "{name}: no 4-bit matrix");
        }
    }

    /// The q4 tiles put every code where gemv.cuh's layout says (read back here by that
    /// description, independently of the packer's loops) and every (scale, bias) pair of its
    /// strip and group; parts that break the strips are named.
    #[test]
    fn q4_tiles_follow_the_fragment_layout() {
        let (rows, cols, group) = (48, 192, 32);
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32) * 0.61).sin() + 0.1 * ((i as f32) * 0.07).cos())
            .collect();
        let m = Mat::quantize_affine(&v, rows, cols, 4, group);
        let (a, b) = (m.rows_view(0, 32), m.rows_view(32, 16));
        let (q, sb, g) = q4_tiles(&[&a, &b], "stack").unwrap();
        assert_eq!(g, group);
        assert_eq!(q.len(), rows * cols / 2);
        assert_eq!(sb.len(), rows * (cols / group) * 4);
        let want = m.to_f32();
        let words: Vec<u32> = q
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let pairs: Vec<u32> = sb
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let bf = |bits: u32| half::bf16::from_bits(bits as u16).to_f32();
        let (units, groups) = (cols / 64, cols / group);
        for r in 0..rows {
            for c in 0..cols {
                let (st, rr, u, cc) = (r / 16, r % 16, c / 64, c % 64);
                let (j, kc) = (cc / 16, cc % 16);
                // the lane holding (rr, kc): g = rr % 8, column pair 2 (l % 4) = kc % 8 rounded
                let lane = (rr % 8) * 4 + (kc % 8) / 2;
                let nibble = (rr / 8) + 2 * (kc / 8) + 4 * (kc % 2);
                let w = words[((st * units + u) * 32 + lane) * 4 + j];
                let code = (w >> (4 * nibble)) & 15;
                let p = pairs[(st * groups + c / group) * 16 + rr];
                let got = bf(p & 0xffff) * code as f32 + bf(p >> 16);
                let exact = want[r * cols + c];
                assert!(
                    (got - exact).abs() <= 1e-2 * (1.0 + exact.abs()),
                    "({r}, {c}): {got} vs {exact}"
                );
            }
        }
        // a part of 8 rows before another breaks the strips
        let e = q4_tiles(&[&m.rows_view(0, 8), &b], "layer 2 experts")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer 2 experts: part 0 (8 x 192, group 32)"),
            "{e}"
        );
        let bf16 = Mat::from_f32(&v, rows, cols, DType::BF16);
        let e = q4_tiles(&[&a, &bf16], "x").unwrap_err().to_string();
        assert!(e.contains("part 1 is BF16"), "{e}");
    }

    /// FP8 stacks go up as e4m3 bytes and one scale row per 128-row block; a part that is
    /// not whole blocks, or not FP8, is named in the error.
    #[test]
    fn fp8_stacks_keep_whole_blocks_and_name_a_bad_part() {
        let q = |rows: usize, cols: usize, seed: f32| {
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| ((i as f32 + seed) * 0.37).sin())
                .collect();
            Mat::quantize_fp8(&v, rows, cols, [128, 128])
        };
        let (a, b) = (q(256, 160, 0.0), q(64, 160, 1.0));
        let (bytes, scales) = fp8_bytes(&[&a, &b], "stack").unwrap();
        assert_eq!(bytes.len(), (256 + 64) * 160);
        assert_eq!(&bytes[..256 * 160], a.bytes());
        assert_eq!(&bytes[256 * 160..], b.bytes());
        // 2 + 1 row blocks of ceil(160 / 128) = 2 scales each, in order
        let sc: Vec<f32> = scales
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let s = |m: &Mat, r: usize| m.scales.as_ref().unwrap().row(r).to_vec();
        assert_eq!(sc, [s(&a, 0), s(&a, 128), s(&b, 0)].concat());
        // a part of 64 rows before another breaks the shared block grid
        let e = fp8_bytes(&[&b, &a], "layer 3 q_proj + k_proj")
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer 3 q_proj + k_proj: part 0"), "{e}");
        let bf = Mat::from_f32(&vec![0.5; 128 * 160], 128, 160, DType::BF16);
        let e = fp8_bytes(&[&a, &bf], "x").unwrap_err().to_string();
        assert!(e.contains("part 1 is BF16"), "{e}");
    }
}
