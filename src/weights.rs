//! Checkpoint loading: memory-mapped safetensors (single file or sharded with an index),
//! tensor-name normalisation across the official and re-exported layouts, and the typed
//! per-layer weights the model graph reads.
//!
//! Accepted layouts:
//! * official: `model.language_model.*`, top-level `lm_head.weight`, fused 3-D experts
//!   `mlp.experts.gate_up_proj [E, 2I, D]` / `mlp.experts.down_proj [E, D, I]`;
//! * per-expert: `mlp.experts.{e}.{gate,up,down}_proj.weight`;
//! * the plain `model.*` prefix.
//!
//! `model.visual.*` is skipped; `mtp.*` is listed, and loaded as [`MtpWeights`] for
//! speculative decoding (`--speculative mtp`).
//!
//! FP8 (`quantization_config` fp8 / e4m3 / 128x128, the official FP8 release): the attention
//! q/k/v/o, GDN `in_proj_qkv` / `in_proj_z` / `out_proj`, shared-expert and per-expert
//! routed-expert matrices may be F8_E4M3 with `<m>.weight_scale_inv [ceil(rows/128),
//! ceil(cols/128)]`; the bytes stay mapped and the scales (upcast to f32) ride on the `Mat`.
//! Everything else (embeddings, lm_head, norms, router, `shared_expert_gate`, GDN
//! `in_proj_a` / `in_proj_b` / `conv1d` / `A_log` / `dt_bias` / `norm`) must be unquantized.

use crate::config::{Fp8Quant, LayerKind, TextConfig};
use crate::tensor::{BlockScales, DType, Mat, Storage, convert_to_f32};
use anyhow::{Context, Result, anyhow, bail};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One tensor found in a checkpoint file.
#[derive(Clone)]
pub struct TensorEntry {
    pub name: String,
    pub file: PathBuf,
    pub storage: Arc<Storage>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
}

/// All tensors of a checkpoint directory, by canonical (text-model-relative) name.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    tensors: HashMap<String, TensorEntry>,
    pub mtp: Vec<String>,
    pub skipped_vision: usize,
}

/// Maps a stored name to the canonical one, or `None` for tensors we skip.
fn canonical_name(name: &str) -> Option<String> {
    if name.starts_with("model.visual.") || name.starts_with("visual.") {
        return None;
    }
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        return Some(rest.to_string());
    }
    if let Some(rest) = name.strip_prefix("model.") {
        return Some(rest.to_string());
    }
    Some(name.to_string())
}

fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the file is opened read-only; like every mmap-based loader we assume the
    // checkpoint is not modified while the engine runs.
    unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))
}

fn explain(e: safetensors::SafeTensorError, file_len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => {
            format!("file is {file_len} bytes, too short to hold a safetensors header (truncated?)")
        }
        E::InvalidHeaderLength => "the header length field points past the end of the file (truncated or not a safetensors file)".into(),
        E::HeaderTooLarge => "the header length field is absurdly large (not a safetensors file?)".into(),
        E::InvalidHeader(e) => format!("the header is not valid UTF-8: {e}"),
        E::InvalidHeaderDeserialization(e) => format!("the header is not valid safetensors JSON: {e}"),
        E::MetadataIncompleteBuffer => format!(
            "the tensor data does not match the file size ({file_len} bytes): the file is truncated or has trailing bytes"
        ),
        E::InvalidOffset(name) => format!(
            "tensor `{name}` has data offsets that overlap, leave gaps, or run past the end of the data"
        ),
        E::TensorInvalidInfo => "a tensor's shape and dtype do not match its byte range".into(),
        E::ValidationOverflow => "a tensor's shape overflows".into(),
        other => other.to_string(),
    }
}

impl Checkpoint {
    /// Opens every safetensors file of `dir` (through `model.safetensors.index.json` when
    /// present) and indexes their tensors. Reads only headers; data stays mapped.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let index_path = dir.join("model.safetensors.index.json");
        let mut expected: Option<BTreeMap<String, String>> = None;
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| anyhow!("{} is not valid JSON: {e}", index_path.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{} has no `weight_map` object", index_path.display()))?;
            let mut weight_map = BTreeMap::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    anyhow!(
                        "{}: `weight_map.{tensor}` must be a file name",
                        index_path.display()
                    )
                })?;
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    bail!(
                        "{}: shard name {file:?} for tensor `{tensor}` must be a plain file name",
                        index_path.display()
                    );
                }
                weight_map.insert(tensor.clone(), file.to_string());
            }
            let mut shards: Vec<String> = weight_map.values().cloned().collect();
            shards.sort();
            shards.dedup();
            for s in &shards {
                if !dir.join(s).exists() {
                    let example = weight_map.iter().find(|(_, f)| *f == s).unwrap().0;
                    bail!(
                        "shard {} is named by {} (e.g. for tensor `{example}`) but does not exist",
                        dir.join(s).display(),
                        index_path.display()
                    );
                }
            }
            expected = Some(weight_map);
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                bail!(
                    "no weights in {}: expected model.safetensors or model.safetensors.index.json",
                    dir.display()
                );
            }
            found
        };

        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            files: files.clone(),
            tensors: HashMap::new(),
            mtp: Vec::new(),
            skipped_vision: 0,
        };
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        for path in &files {
            let mmap = map_file(path)?;
            let file_len = mmap.len();
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
                .map_err(|e| anyhow!("{}: {}", path.display(), explain(e, file_len)))?;
            let storage = Arc::new(Storage::Mmap(mmap));
            let data_start = 8 + header_len;
            let mut infos: Vec<(String, &safetensors::tensor::TensorInfo)> =
                meta.tensors().into_iter().collect();
            infos.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, info) in infos {
                if let Some(first) = seen.insert(name.clone(), path.clone()) {
                    bail!(
                        "duplicate tensor `{name}`: found in {} and again in {}",
                        first.display(),
                        path.display()
                    );
                }
                if let Some(map) = &expected {
                    match map.get(&name) {
                        Some(f) if dir.join(f) == *path => {}
                        Some(f) => bail!(
                            "tensor `{name}` is in {} but the index says it is in {f}",
                            path.display()
                        ),
                        None => bail!(
                            "tensor `{name}` in {} is not listed in the index {}",
                            path.display(),
                            index_path.display()
                        ),
                    }
                }
                let Some(canon) = canonical_name(&name) else {
                    ckpt.skipped_vision += 1;
                    continue;
                };
                if canon.starts_with("mtp.") {
                    ckpt.mtp.push(canon.clone());
                }
                let entry = TensorEntry {
                    name: name.clone(),
                    file: path.clone(),
                    storage: storage.clone(),
                    offset: data_start + info.data_offsets.0,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                };
                if let Some(prev) = ckpt.tensors.insert(canon.clone(), entry) {
                    bail!(
                        "duplicate tensor: `{}` and `{name}` both name `{canon}` ({} and {})",
                        prev.name,
                        prev.file.display(),
                        path.display()
                    );
                }
            }
        }
        if let Some(map) = &expected
            && let Some(missing) = map.keys().find(|k| !seen.contains_key(*k))
        {
            bail!(
                "tensor `{missing}` is listed in {} (shard {}) but that shard does not contain it",
                index_path.display(),
                map[missing]
            );
        }
        ckpt.mtp.sort();
        Ok(ckpt)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors.get(name).ok_or_else(|| {
            anyhow!(
                "tensor `{name}` is missing from the checkpoint in {} (looked for `model.language_model.{name}`, `model.{name}` and `{name}`)",
                self.dir.display()
            )
        })
    }

    fn float_dtype(e: &TensorEntry) -> Result<DType> {
        match e.dtype {
            safetensors::Dtype::F32 => Ok(DType::F32),
            safetensors::Dtype::F16 => Ok(DType::F16),
            safetensors::Dtype::BF16 => Ok(DType::BF16),
            safetensors::Dtype::F8_E4M3 => bail!(
                "tensor `{}` in {} has dtype F8_E4M3, but it must be unquantized (BF16, F16 or F32): \
                 the FP8 format quantizes only the attention, GDN in_proj_qkv/in_proj_z/out_proj and \
                 expert projections, and keeps embeddings, lm_head, norms, the router, \
                 shared_expert_gate and GDN in_proj_a/in_proj_b/conv1d/A_log/dt_bias in bf16",
                e.name,
                e.file.display()
            ),
            other => bail!(
                "tensor `{}` in {} has dtype {other:?}; expected BF16, F16 or F32",
                e.name,
                e.file.display()
            ),
        }
    }

    fn check_shape(e: &TensorEntry, shape: &[usize]) -> Result<()> {
        if e.shape != shape {
            bail!(
                "tensor `{}` in {} has shape {:?}, expected {:?} from config.json",
                e.name,
                e.file.display(),
                e.shape,
                shape
            );
        }
        Ok(())
    }

    /// A matrix `[rows, cols]`, or a 3-D tensor viewed as `[shape[0]*shape[1], shape[2]]`.
    pub fn mat(&self, name: &str, shape: &[usize]) -> Result<Mat> {
        let e = self.entry(name)?;
        let dtype = Self::float_dtype(e)?;
        Self::check_shape(e, shape)?;
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape.iter().product::<usize>() / cols.max(1);
        Ok(Mat {
            storage: e.storage.clone(),
            offset: e.offset,
            dtype,
            rows,
            cols,
            scales: None,
        })
    }

    /// A projection matrix `[rows, cols]` that the FP8 format quantizes: F8_E4M3 with its
    /// `weight_scale_inv` block scales when `quant` says so, else unquantized as [`Self::mat`].
    pub fn weight(&self, name: &str, shape: &[usize], quant: Option<&Fp8Quant>) -> Result<Mat> {
        let e = self.entry(name)?;
        let module = e.name.strip_suffix(".weight").unwrap_or(&e.name);
        if e.dtype != safetensors::Dtype::F8_E4M3 {
            if let Some(q) = quant
                && !q.keeps_unquantized(module)
            {
                bail!(
                    "tensor `{}` in {} has dtype {:?}, but config.json's `quantization_config` \
                     quantizes `{module}` (it is not in `modules_to_not_convert`): expected \
                     F8_E4M3 with block scales `{module}.weight_scale_inv`",
                    e.name,
                    e.file.display(),
                    e.dtype
                );
            }
            return self.mat(name, shape);
        }
        let Some(q) = quant else {
            bail!(
                "tensor `{}` in {} is F8_E4M3, but {}/config.json has no `quantization_config` \
                 (expected quant_method fp8, fmt e4m3, weight_block_size [128, 128])",
                e.name,
                e.file.display(),
                self.dir.display()
            );
        };
        if q.keeps_unquantized(module) {
            bail!(
                "tensor `{}` in {} is F8_E4M3, but `quantization_config.modules_to_not_convert` \
                 lists `{module}` as unquantized",
                e.name,
                e.file.display()
            );
        }
        Self::check_shape(e, shape)?;
        let (rows, cols) = (shape[0], shape[1]);
        let canon_scale = format!(
            "{}.weight_scale_inv",
            name.strip_suffix(".weight").unwrap_or(name)
        );
        let se = self.tensors.get(&canon_scale).ok_or_else(|| {
            anyhow!(
                "tensor `{}` in {} is F8_E4M3, but its block scales `{module}.weight_scale_inv` \
                 are missing from the checkpoint in {}",
                e.name,
                e.file.display(),
                self.dir.display()
            )
        })?;
        let [br, bc] = q.block;
        let grid = [rows.div_ceil(br), cols.div_ceil(bc)];
        if se.shape != grid {
            bail!(
                "tensor `{}` in {} has shape {:?}, expected {grid:?} = [ceil({rows}/{br}), \
                 ceil({cols}/{bc})]: the {br}x{bc} block scales of `{}` [{rows}, {cols}] \
                 (`quantization_config.weight_block_size`)",
                se.name,
                se.file.display(),
                se.shape,
                e.name
            );
        }
        let sd = match se.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            other => bail!(
                "tensor `{}` in {} has dtype {other:?}; block scales must be F32, BF16 or F16",
                se.name,
                se.file.display()
            ),
        };
        let n = grid[0] * grid[1];
        let mut values = vec![0.0f32; n];
        convert_to_f32(
            sd,
            &se.storage.bytes()[se.offset..se.offset + n * sd.size()],
            &mut values,
        );
        if let Some(i) = values.iter().position(|v| !v.is_finite() || *v < 0.0) {
            bail!(
                "tensor `{}` in {} has scale {} at block [{}, {}]; block scales must be finite \
                 and non-negative",
                se.name,
                se.file.display(),
                values[i],
                i / grid[1],
                i % grid[1]
            );
        }
        Ok(Mat {
            storage: e.storage.clone(),
            offset: e.offset,
            dtype: DType::F8E4M3,
            rows,
            cols,
            scales: Some(BlockScales {
                values: Arc::new(values),
                grid_rows: grid[0],
                grid_cols: grid[1],
                block_rows: br,
                block_cols: bc,
                row0: 0,
            }),
        })
    }

    /// A small vector read at its stored dtype and kept in f32.
    pub fn vec_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        let dtype = Self::float_dtype(e)?;
        Self::check_shape(e, shape)?;
        let n: usize = shape.iter().product();
        let mut out = vec![0.0; n];
        convert_to_f32(
            dtype,
            &e.storage.bytes()[e.offset..e.offset + n * dtype.size()],
            &mut out,
        );
        Ok(out)
    }

    /// Canonical names not used by the model graph (reported by `inspect`).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

// ---------------------------------------------------------------------------------------
// Typed weights of the text model.

pub struct GdnWeights {
    /// `in_proj_qkv` [2*Kd + Vd, D]: q, k, v rows (also the conv channel order).
    pub in_qkv: Mat,
    /// `in_proj_z` [Vd, D]: the output gate, per value head.
    pub in_z: Mat,
    /// `in_proj_b` [Hv, D] -> beta; `in_proj_a` [Hv, D] -> decay input.
    pub in_b: Mat,
    pub in_a: Mat,
    /// Depthwise conv taps, `[channels, kernel]`, tap `kernel-1` multiplies the current token.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight (plain, not 1+w), shared by all value heads.
    pub norm: Vec<f32>,
    pub out: Mat,
}

pub struct AttentionWeights {
    /// `q_proj` [Nq * 2 * hd, D]: per head a [query | gate] block.
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    pub o: Mat,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub struct ExpertWeights {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

pub struct MoeWeights {
    pub router: Mat,
    pub experts: Vec<ExpertWeights>,
    pub shared: ExpertWeights,
    /// `shared_expert_gate` [1, D] as a vector.
    pub shared_gate: Vec<f32>,
}

pub enum Mixer {
    Gdn(GdnWeights),
    Attention(AttentionWeights),
}

pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

pub struct ModelWeights {
    pub embed: Mat,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub lm_head: Mat,
    /// The multi-token-prediction head (`mtp.*`), loaded only for speculative decoding
    /// ([`MtpWeights::from_checkpoint`]); `None` otherwise.
    pub mtp: Option<MtpWeights>,
}

/// The MTP head (spec §4): zero-centred RMSNorms on the next token's embedding and on the
/// main model's hidden state, `fc` over their concatenation (embedding first), one gated
/// full-attention decoder layer with its own MoE, and a final norm. Embeddings and lm_head
/// are the main model's.
pub struct MtpWeights {
    pub pre_fc_norm_embedding: Vec<f32>,
    pub pre_fc_norm_hidden: Vec<f32>,
    /// `mtp.fc` `[D, 2D]`: input columns `0..D` the normed embedding, `D..2D` the normed
    /// hidden state.
    pub fc: Mat,
    /// `mtp.layers.0.*`: a full-attention layer of the main model's shape.
    pub layer: LayerWeights,
    /// `mtp.norm`: the head's final zero-centred norm, before the shared lm_head.
    pub norm: Vec<f32>,
}

impl MtpWeights {
    /// The `mtp.*` tensors of `ck`, every shape checked against `cfg`. A checkpoint without
    /// them (or with only some) is an error that says so: speculative decoding needs them.
    pub fn from_checkpoint(ck: &Checkpoint, cfg: &TextConfig) -> Result<Self> {
        if ck.mtp.is_empty() {
            bail!(
                "--speculative mtp needs the checkpoint's multi-token-prediction head, but {} has \
                 no `mtp.*` tensors (the official Qwen3.6 bf16 and FP8 releases carry them; \
                 re-exports such as MLX conversions often drop them)",
                ck.dir.display()
            );
        }
        Self::load(ck, cfg).with_context(|| {
            format!(
                "the checkpoint in {} has {} `mtp.*` tensors but not a complete MTP head \
                 (--speculative mtp needs all of them)",
                ck.dir.display(),
                ck.mtp.len()
            )
        })
    }

    fn load(ck: &Checkpoint, cfg: &TextConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        let q = cfg.quantization.as_ref();
        if cfg.mtp_layers > 1 {
            bail!(
                "`mtp_num_hidden_layers` is {}; Kestrel's MTP head has one layer",
                cfg.mtp_layers
            );
        }
        let a = "mtp.layers.0.self_attn.";
        let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
        let layer = LayerWeights {
            input_norm: ck.vec_f32("mtp.layers.0.input_layernorm.weight", &[d])?,
            post_attention_norm: ck
                .vec_f32("mtp.layers.0.post_attention_layernorm.weight", &[d])?,
            mixer: Mixer::Attention(AttentionWeights {
                q: ck.weight(&format!("{a}q_proj.weight"), &[nq * 2 * hd, d], q)?,
                k: ck.weight(&format!("{a}k_proj.weight"), &[nkv * hd, d], q)?,
                v: ck.weight(&format!("{a}v_proj.weight"), &[nkv * hd, d], q)?,
                o: ck.weight(&format!("{a}o_proj.weight"), &[d, nq * hd], q)?,
                q_norm: ck.vec_f32(&format!("{a}q_norm.weight"), &[hd])?,
                k_norm: ck.vec_f32(&format!("{a}k_norm.weight"), &[hd])?,
            }),
            moe: load_moe(ck, cfg, "mtp.layers.0.mlp.")?,
        };
        Ok(MtpWeights {
            pre_fc_norm_embedding: ck.vec_f32("mtp.pre_fc_norm_embedding.weight", &[d])?,
            pre_fc_norm_hidden: ck.vec_f32("mtp.pre_fc_norm_hidden.weight", &[d])?,
            fc: ck.mat("mtp.fc.weight", &[d, 2 * d])?,
            layer,
            norm: ck.vec_f32("mtp.norm.weight", &[d])?,
        })
    }
}

impl ModelWeights {
    /// Builds the typed weights from a checkpoint, checking every shape against `cfg`.
    pub fn from_checkpoint(ck: &Checkpoint, cfg: &TextConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        let q = cfg.quantization.as_ref();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (i, kind) in cfg.layer_kinds.iter().enumerate() {
            let p = format!("layers.{i}.");
            let mixer = match kind {
                LayerKind::Gdn => {
                    let a = format!("{p}linear_attn.");
                    let hv = cfg.gdn_num_value_heads;
                    let ch = cfg.gdn_conv_channels();
                    Mixer::Gdn(GdnWeights {
                        in_qkv: ck.weight(&format!("{a}in_proj_qkv.weight"), &[ch, d], q)?,
                        in_z: ck.weight(
                            &format!("{a}in_proj_z.weight"),
                            &[cfg.gdn_v_width(), d],
                            q,
                        )?,
                        in_b: ck.mat(&format!("{a}in_proj_b.weight"), &[hv, d])?,
                        in_a: ck.mat(&format!("{a}in_proj_a.weight"), &[hv, d])?,
                        conv: ck
                            .vec_f32(&format!("{a}conv1d.weight"), &[ch, 1, cfg.conv_kernel])?,
                        a_log: ck.vec_f32(&format!("{a}A_log"), &[hv])?,
                        dt_bias: ck.vec_f32(&format!("{a}dt_bias"), &[hv])?,
                        norm: ck.vec_f32(&format!("{a}norm.weight"), &[cfg.gdn_value_dim])?,
                        out: ck.weight(
                            &format!("{a}out_proj.weight"),
                            &[d, cfg.gdn_v_width()],
                            q,
                        )?,
                    })
                }
                LayerKind::Attention => {
                    let a = format!("{p}self_attn.");
                    let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
                    Mixer::Attention(AttentionWeights {
                        q: ck.weight(&format!("{a}q_proj.weight"), &[nq * 2 * hd, d], q)?,
                        k: ck.weight(&format!("{a}k_proj.weight"), &[nkv * hd, d], q)?,
                        v: ck.weight(&format!("{a}v_proj.weight"), &[nkv * hd, d], q)?,
                        o: ck.weight(&format!("{a}o_proj.weight"), &[d, nq * hd], q)?,
                        q_norm: ck.vec_f32(&format!("{a}q_norm.weight"), &[hd])?,
                        k_norm: ck.vec_f32(&format!("{a}k_norm.weight"), &[hd])?,
                    })
                }
            };
            layers.push(LayerWeights {
                input_norm: ck.vec_f32(&format!("{p}input_layernorm.weight"), &[d])?,
                post_attention_norm: ck
                    .vec_f32(&format!("{p}post_attention_layernorm.weight"), &[d])?,
                mixer,
                moe: load_moe(ck, cfg, &format!("{p}mlp."))?,
            });
        }
        Ok(ModelWeights {
            embed: ck.mat("embed_tokens.weight", &[cfg.vocab_size, d])?,
            layers,
            final_norm: ck.vec_f32("norm.weight", &[d])?,
            lm_head: ck.mat("lm_head.weight", &[cfg.vocab_size, d])?,
            mtp: None,
        })
    }

    /// Every matrix re-stored as bf16 (what the GPU backend holds), so the CPU reference can
    /// run at the GPU's precision. FP8 matrices stay FP8 (the GPU will hold them so too).
    pub fn round_to_bf16(&mut self) {
        let r = |m: &mut Mat| {
            if m.dtype != DType::BF16 && m.dtype != DType::F8E4M3 {
                *m = Mat::from_f32(&m.to_f32(), m.rows, m.cols, DType::BF16);
            }
        };
        r(&mut self.embed);
        r(&mut self.lm_head);
        for l in &mut self.layers {
            match &mut l.mixer {
                Mixer::Gdn(g) => {
                    for m in [
                        &mut g.in_qkv,
                        &mut g.in_z,
                        &mut g.in_a,
                        &mut g.in_b,
                        &mut g.out,
                    ] {
                        r(m);
                    }
                }
                Mixer::Attention(a) => {
                    for m in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                        r(m);
                    }
                }
            }
            r(&mut l.moe.router);
            for e in l
                .moe
                .experts
                .iter_mut()
                .chain(std::iter::once(&mut l.moe.shared))
            {
                r(&mut e.gate);
                r(&mut e.up);
                r(&mut e.down);
            }
        }
    }

    /// [`Self::round_to_bf16`] including the MTP head's matrices (the head's oracle at the
    /// GPU's precision).
    pub fn round_to_bf16_with_mtp(&mut self) {
        self.round_to_bf16();
        let Some(mtp) = self.mtp.take() else { return };
        // The head's layer has the main layers' shape: round it as one of them.
        let MtpWeights {
            pre_fc_norm_embedding,
            pre_fc_norm_hidden,
            fc,
            layer,
            norm,
        } = mtp;
        let mut fc = fc;
        if fc.dtype != DType::BF16 && fc.dtype != DType::F8E4M3 {
            fc = Mat::from_f32(&fc.to_f32(), fc.rows, fc.cols, DType::BF16);
        }
        let mut layers = std::mem::take(&mut self.layers);
        self.layers = vec![layer];
        self.round_to_bf16();
        let layer = self.layers.pop().expect("the MTP layer");
        layers.shrink_to_fit();
        self.layers = layers;
        self.mtp = Some(MtpWeights {
            pre_fc_norm_embedding,
            pre_fc_norm_hidden,
            fc,
            layer,
            norm,
        });
    }

    /// Every matrix the FP8 format quantizes, and the ones it keeps unquantized.
    fn matrices_by_role(&self) -> (Vec<&Mat>, Vec<&Mat>) {
        let (mut quantizable, mut kept) = (Vec::new(), vec![&self.embed, &self.lm_head]);
        for l in &self.layers {
            match &l.mixer {
                Mixer::Gdn(g) => {
                    quantizable.extend([&g.in_qkv, &g.in_z, &g.out]);
                    kept.extend([&g.in_a, &g.in_b]);
                }
                Mixer::Attention(a) => quantizable.extend([&a.q, &a.k, &a.v, &a.o]),
            }
            kept.push(&l.moe.router);
            for e in l.moe.experts.iter().chain([&l.moe.shared]) {
                quantizable.extend([&e.gate, &e.up, &e.down]);
            }
        }
        (quantizable, kept)
    }

    /// Every quantizable matrix (see [`Self::matrices_by_role`]) re-stored as FP8 with
    /// `quant`'s block scales, by [`Mat::quantize_fp8`] (synthetic FP8 checkpoints, tests).
    pub fn quantize_fp8(&mut self, quant: &Fp8Quant) {
        let f = |m: &mut Mat| {
            if m.dtype != DType::F8E4M3 {
                *m = Mat::quantize_fp8(&m.to_f32(), m.rows, m.cols, quant.block);
            }
        };
        for l in &mut self.layers {
            match &mut l.mixer {
                Mixer::Gdn(g) => [&mut g.in_qkv, &mut g.in_z, &mut g.out]
                    .into_iter()
                    .for_each(f),
                Mixer::Attention(a) => [&mut a.q, &mut a.k, &mut a.v, &mut a.o]
                    .into_iter()
                    .for_each(f),
            }
            for e in l
                .moe
                .experts
                .iter_mut()
                .chain(std::iter::once(&mut l.moe.shared))
            {
                [&mut e.gate, &mut e.up, &mut e.down]
                    .into_iter()
                    .for_each(f);
            }
        }
    }

    /// Whether any matrix is stored FP8.
    pub fn is_fp8(&self) -> bool {
        self.matrices_by_role()
            .0
            .iter()
            .any(|m| m.dtype == DType::F8E4M3)
    }

    /// The weight format: `"fp8 e4m3 block 128x128"` when any matrix is FP8, else the
    /// matrices' dtypes (`"bf16"`, `"f32"`, `"bf16+f32"`).
    pub fn format(&self) -> String {
        let (q, k) = self.matrices_by_role();
        if let Some(s) = q.iter().find_map(|m| m.scales.as_ref()) {
            return format!("fp8 e4m3 block {}x{}", s.block_rows, s.block_cols);
        }
        let mut names: Vec<String> = q
            .iter()
            .chain(&k)
            .map(|m| m.dtype.name().to_lowercase())
            .collect();
        names.sort();
        names.dedup();
        names.join("+")
    }

    /// Bytes by kind, as stored: each matrix dtype (`F8_E4M3`, `BF16`, ...), the FP8 block
    /// scales (`FP8 block scales (f32)`) and the small vectors (`f32 vectors`), in that order.
    pub fn bytes_by_kind(&self) -> Vec<(String, usize)> {
        let (q, k) = self.matrices_by_role();
        let mut by: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut scales = 0;
        for m in q.iter().chain(&k) {
            *by.entry(m.dtype.name()).or_default() += m.nbytes();
            scales += m.scale_bytes();
        }
        let mut out: Vec<(String, usize)> =
            by.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        if scales > 0 {
            out.push(("FP8 block scales (f32)".into(), scales));
        }
        let vectors = self.nbytes() - out.iter().map(|x| x.1).sum::<usize>();
        out.push(("f32 vectors".into(), vectors));
        out
    }

    /// Bytes of all weights the graph reads (as stored, FP8 block scales included).
    pub fn nbytes(&self) -> usize {
        let v = |x: &Vec<f32>| x.len() * 4;
        let (q, k) = self.matrices_by_role();
        let mut n = v(&self.final_norm);
        for m in q.iter().chain(&k) {
            n += m.nbytes() + m.scale_bytes();
        }
        for l in &self.layers {
            n += v(&l.input_norm) + v(&l.post_attention_norm) + v(&l.moe.shared_gate);
            n += match &l.mixer {
                Mixer::Gdn(g) => v(&g.conv) + v(&g.a_log) + v(&g.dt_bias) + v(&g.norm),
                Mixer::Attention(a) => v(&a.q_norm) + v(&a.k_norm),
            };
        }
        n
    }
}

fn load_moe(ck: &Checkpoint, cfg: &TextConfig, p: &str) -> Result<MoeWeights> {
    let (d, e, i) = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate);
    let q = cfg.quantization.as_ref();
    let fused = format!("{p}experts.gate_up_proj");
    let experts = if ck.contains(&fused) {
        let fe = ck.entry(&fused)?;
        if fe.dtype == safetensors::Dtype::F8_E4M3 {
            bail!(
                "tensor `{}` in {} is a fused F8_E4M3 expert tensor; Kestrel reads FP8 experts \
                 per expert (`mlp.experts.{{e}}.{{gate,up,down}}_proj.weight` with \
                 `weight_scale_inv`, as the official FP8 release stores them)",
                fe.name,
                fe.file.display()
            );
        }
        // Fused [E, 2I, D] (gate rows first) and [E, D, I], viewed per expert without copying.
        let gate_up = ck.mat(&fused, &[e, 2 * i, d])?;
        let down = ck.mat(&format!("{p}experts.down_proj"), &[e, d, i])?;
        (0..e)
            .map(|x| ExpertWeights {
                gate: gate_up.rows_view(x * 2 * i, i),
                up: gate_up.rows_view(x * 2 * i + i, i),
                down: down.rows_view(x * d, d),
            })
            .collect()
    } else {
        let mut v = Vec::with_capacity(e);
        for x in 0..e {
            let n = format!("{p}experts.{x}.");
            v.push(ExpertWeights {
                gate: ck.weight(&format!("{n}gate_proj.weight"), &[i, d], q)?,
                up: ck.weight(&format!("{n}up_proj.weight"), &[i, d], q)?,
                down: ck.weight(&format!("{n}down_proj.weight"), &[d, i], q)?,
            });
        }
        v
    };
    let s = cfg.shared_intermediate;
    Ok(MoeWeights {
        router: ck.mat(&format!("{p}gate.weight"), &[e, d])?,
        experts,
        shared: ExpertWeights {
            gate: ck.weight(&format!("{p}shared_expert.gate_proj.weight"), &[s, d], q)?,
            up: ck.weight(&format!("{p}shared_expert.up_proj.weight"), &[s, d], q)?,
            down: ck.weight(&format!("{p}shared_expert.down_proj.weight"), &[d, s], q)?,
        },
        shared_gate: ck.vec_f32(&format!("{p}shared_expert_gate.weight"), &[1, d])?,
    })
}
