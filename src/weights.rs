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
//! * mlx-lm's: `language_model.model.*`, `language_model.lm_head.*`, experts stacked as
//!   `mlp.switch_mlp.{gate,up,down}_proj.weight [E, out, in]`, conv1d `[C, K, 1]` (the
//!   same bytes as `[C, 1, K]`), and the zero-centred norms stored with mlx-lm's +1 added
//!   (`input_layernorm`, `post_attention_layernorm`, the final `norm`, `q_norm`, `k_norm`;
//!   not the GDN gated norm): the loader subtracts 1 so the graph's `1 + w` is unchanged.
//!
//! `model.visual.*` (and mlx-vlm's `vision_tower.*`) is skipped; `mtp.*` is listed, and
//! loaded as [`MtpWeights`] for speculative decoding (`--speculative mtp`).
//!
//! Affine 4/8-bit ([`Checkpoint::any_weight`]): MLX `<m>.weight` (U32 codes, 8 a word for
//! 4 bits, 4 for 8), `<m>.scales`, `<m>.biases` (`[out, in/group]`), bits and group from
//! config.json's `quantization` block (per-module overrides; mlx-lm's 8-bit router and
//! shared-expert gate), kept mapped; any MLX matrix may be quantised, embeddings and lm_head
//! included. GPTQ (`qweight [in/8, out]`, `qzeros [in/g, out/8]`, `scales [in/g, out]`,
//! `g_idx`) and AWQ GEMM (`qweight [in, out/8]`, interleaved) per-module tensors are
//! repacked at load into the same form (f32 scales, `bias = -scale * zero`);
//! compressed-tensors' `weight_packed` (codes + 8) already is that form and stays mapped
//! with its `weight_scale`, only the biases being computed.
//!
//! FP8 (`quantization_config` fp8 / e4m3 / 128x128, the official FP8 release): the attention
//! q/k/v/o, GDN `in_proj_qkv` / `in_proj_z` / `out_proj`, shared-expert and per-expert
//! routed-expert matrices may be F8_E4M3 with `<m>.weight_scale_inv [ceil(rows/128),
//! ceil(cols/128)]`; the bytes stay mapped and the scales (upcast to f32) ride on the `Mat`.
//! Everything else (embeddings, lm_head, norms, router, `shared_expert_gate`, GDN
//! `in_proj_a` / `in_proj_b` / `conv1d` / `A_log` / `dt_bias` / `norm`) must be unquantized.

use crate::config::{AffineQuant, AffineSource, Fp8Quant, LayerKind, TextConfig};
use crate::tensor::{Affine, BlockScales, DType, Mat, Storage, convert_to_f32, pack_codes};
use anyhow::{Context, Result, anyhow, bail};
use rayon::prelude::*;
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
    /// mlx-lm's layout (`language_model.*` names): zero-centred norms stored with the +1
    /// added, conv1d `[C, K, 1]`, experts stacked as `mlp.switch_mlp.*`.
    pub mlx_layout: bool,
}

/// Maps a stored name to the canonical one, or `None` for tensors we skip.
fn canonical_name(name: &str) -> Option<String> {
    // The vision tower: the official names, and mlx-vlm's.
    if name.starts_with("model.visual.")
        || name.starts_with("visual.")
        || name.starts_with("vision_tower.")
    {
        return None;
    }
    // mlx-lm's layout: `language_model.model.*` and `language_model.lm_head.*`.
    if let Some(rest) = name.strip_prefix("language_model.model.") {
        return Some(rest.to_string());
    }
    if let Some(rest) = name.strip_prefix("language_model.") {
        return Some(rest.to_string());
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
            mlx_layout: false,
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
                if name.starts_with("language_model.") {
                    ckpt.mlx_layout = true;
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
            affine: None,
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
            affine: None,
        })
    }

    /// A projection matrix in whatever format the checkpoint stores it: FP8 where the FP8
    /// format quantises it (`fp8_ok`), affine 4/8-bit (MLX triples, GPTQ / AWQ) where the
    /// config is affine and the module's quantised tensors are present, else unquantized.
    /// `shape` is `[rows, cols]`, or `[E, rows, cols]` for stacked experts (viewed as
    /// `[E * rows, cols]`).
    pub fn any_weight(
        &self,
        name: &str,
        shape: &[usize],
        cfg: &TextConfig,
        fp8_ok: bool,
    ) -> Result<Mat> {
        if let Some(a) = &cfg.affine {
            let base = name.strip_suffix(".weight").unwrap_or(name);
            return match a.source {
                AffineSource::Mlx => self.mlx_weight(name, shape, a),
                AffineSource::CompressedTensors
                    if self.contains(&format!("{base}.weight_packed")) =>
                {
                    self.ct_weight(base, shape, a)
                }
                AffineSource::CompressedTensors => {
                    let parts = ["weight_scale", "weight_zero_point", "weight_g_idx"];
                    self.no_orphan_parts(base, &parts, "weight_packed")?;
                    self.mat(name, shape)
                }
                _ if self.contains(&format!("{base}.qweight")) => {
                    self.gptq_awq_weight(base, shape, a)
                }
                _ => {
                    if let Some(e) = self.tensors.get(name)
                        && matches!(e.dtype, safetensors::Dtype::I32 | safetensors::Dtype::U32)
                    {
                        bail!(
                            "tensor `{}` in {} is {:?}; a {} checkpoint stores quantised modules as `qweight` / `qzeros` / `scales`, others as BF16, F16 or F32",
                            e.name,
                            e.file.display(),
                            e.dtype,
                            a.describe()
                        );
                    }
                    self.no_orphan_parts(base, &["qzeros", "scales", "g_idx"], "qweight")?;
                    self.mat(name, shape)
                }
            };
        }
        if fp8_ok {
            self.weight(name, shape, cfg.quantization.as_ref())
        } else {
            self.mat(name, shape)
        }
    }

    fn float_mat(e: &TensorEntry, what: &str, rows: usize, cols: usize) -> Result<Mat> {
        let dtype = match e.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => bail!(
                "tensor `{}` in {} has dtype {other:?}; {what} must be BF16, F16 or F32",
                e.name,
                e.file.display()
            ),
        };
        Ok(Mat {
            storage: e.storage.clone(),
            offset: e.offset,
            dtype,
            rows,
            cols,
            scales: None,
            affine: None,
        })
    }

    /// An MLX module: `<m>.weight` (U32 codes) with `<m>.scales` and `<m>.biases`, or an
    /// unquantized `<m>.weight` (mlx-lm, too, decides by the presence of `<m>.scales`).
    fn mlx_weight(&self, name: &str, shape: &[usize], q: &AffineQuant) -> Result<Mat> {
        let e = self.entry(name)?;
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let module = e.name.strip_suffix(".weight").unwrap_or(&e.name);
        let (se, be) = (
            self.tensors.get(&format!("{base}.scales")),
            self.tensors.get(&format!("{base}.biases")),
        );
        let Some(se) = se else {
            if let Some(be) = be {
                bail!(
                    "tensor `{}` in {} has no scales: `{module}.scales` is missing beside its biases",
                    be.name,
                    be.file.display()
                );
            }
            if e.dtype == safetensors::Dtype::U32 {
                bail!(
                    "tensor `{}` in {} is U32 (packed codes) but `{module}.scales` and `{module}.biases` are missing",
                    e.name,
                    e.file.display()
                );
            }
            return self.mat(name, shape);
        };
        let Some(be) = be else {
            bail!(
                "tensor `{}` in {} is quantised (it has `{module}.scales`) but its bias `{module}.biases` is missing: MLX affine weights are scale * q + bias",
                e.name,
                e.file.display()
            );
        };
        if e.dtype != safetensors::Dtype::U32 {
            bail!(
                "tensor `{}` in {} has dtype {:?} but has `{module}.scales`: MLX packs quantised weights as U32",
                e.name,
                e.file.display(),
                e.dtype
            );
        }
        let Some((bits, group)) = q.for_module(module) else {
            bail!(
                "tensor `{}` in {} is quantised, but config.json's `quantization.{module}` says the module is not",
                e.name,
                e.file.display()
            );
        };
        let (lead, (rows, cols)) = (
            &shape[..shape.len() - 2],
            (shape[shape.len() - 2], shape[shape.len() - 1]),
        );
        let field = if q.overrides.contains_key(module) {
            format!("quantization.{module}.bits")
        } else {
            "quantization.bits".to_string()
        };
        let packed = |b: usize| [lead, &[rows, cols * b / 32]].concat();
        if e.shape != packed(bits) {
            let other = if bits == 4 { 8 } else { 4 };
            let hint = if e.shape == packed(other) {
                format!(": that is the packing of {other}-bit codes, but `{field}` is {bits}")
            } else {
                String::new()
            };
            bail!(
                "tensor `{}` in {} has shape {:?}, expected {:?} for {bits}-bit codes of [{rows}, {cols}] ({} a u32 word, `{field}`){hint}",
                e.name,
                e.file.display(),
                e.shape,
                packed(bits),
                32 / bits
            );
        }
        if !cols.is_multiple_of(group) {
            bail!(
                "tensor `{}` in {}: {cols} columns are not a whole number of groups of {group}",
                e.name,
                e.file.display()
            );
        }
        let gshape = [lead, &[rows, cols / group]].concat();
        for t in [se, be] {
            if t.shape != gshape {
                bail!(
                    "tensor `{}` in {} has shape {:?}, expected {gshape:?}: one value a group of {group} columns of `{}` [{rows}, {cols}] (`quantization.group_size`)",
                    t.name,
                    t.file.display(),
                    t.shape,
                    e.name
                );
            }
        }
        let n: usize = lead.iter().product::<usize>() * rows;
        let scales = Self::float_mat(se, "MLX scales", n, cols / group)?;
        let biases = Self::float_mat(be, "MLX biases", n, cols / group)?;
        if let Some((r, c, v)) = first_non_finite(&scales) {
            bail!(
                "tensor `{}` in {} has scale {v} at [{r}, {c}]; scales must be finite",
                se.name,
                se.file.display()
            );
        }
        Ok(Mat {
            storage: e.storage.clone(),
            offset: e.offset,
            dtype: if bits == 4 { DType::U4 } else { DType::U8 },
            rows: n,
            cols,
            scales: None,
            affine: Some(Box::new(Affine {
                group,
                scales,
                biases,
                col_group: None,
            })),
        })
    }

    /// An act-order `g_idx` tensor (column -> group), checked against `groups`; `None` where it
    /// is the plain order (column / `group`), so the matrix keeps the fast path.
    fn col_groups(ge: &TensorEntry, groups: usize, group: usize) -> Result<Option<Arc<Vec<u32>>>> {
        let idx = Self::i32_words(ge)?;
        if let Some((i, g)) = idx.iter().enumerate().find(|(_, g)| **g as usize >= groups) {
            bail!(
                "tensor `{}` in {} maps column {i} to group {g}, but there are {groups} groups",
                ge.name,
                ge.file.display()
            );
        }
        let plain = idx
            .iter()
            .enumerate()
            .all(|(i, g)| *g as usize == i / group);
        Ok(if plain { None } else { Some(Arc::new(idx)) })
    }

    /// An error naming the first of `base`'s quantisation `parts` present without its codes
    /// (`base.codes`), which the caller found missing.
    fn no_orphan_parts(&self, base: &str, parts: &[&str], codes: &str) -> Result<()> {
        for suffix in parts {
            if let Some(e) = self.tensors.get(&format!("{base}.{suffix}")) {
                bail!(
                    "tensor `{}` in {} is a {suffix} without its `{codes}`: `{base}.{codes}` is missing",
                    e.name,
                    e.file.display()
                );
            }
        }
        Ok(())
    }

    fn i32_words(e: &TensorEntry) -> Result<Vec<u32>> {
        if !matches!(e.dtype, safetensors::Dtype::I32 | safetensors::Dtype::U32) {
            bail!(
                "tensor `{}` in {} has dtype {:?}; packed 4-bit tensors are I32",
                e.name,
                e.file.display(),
                e.dtype
            );
        }
        let n: usize = e.shape.iter().product();
        Ok(e.storage.bytes()[e.offset..e.offset + 4 * n]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// A GPTQ or AWQ module `<base>.{qweight,qzeros,scales[,g_idx]}` for a `[rows, cols]`
    /// (out, in) weight, repacked into Kestrel's affine form: codes `[out, in]` packed
    /// along the input, `scale = s`, `bias = -s * z` (f32).
    fn gptq_awq_weight(&self, base: &str, shape: &[usize], q: &AffineQuant) -> Result<Mat> {
        if shape.len() != 2 {
            bail!("stacked GPTQ/AWQ experts are not supported (`{base}`)");
        }
        let (rows, cols) = (shape[0], shape[1]);
        let group = q.group;
        let get = |suffix: &str, why: &str| -> Result<&TensorEntry> {
            let qw = &self.tensors[&format!("{base}.qweight")];
            self.tensors
                .get(&format!("{base}.{suffix}"))
                .ok_or_else(|| {
                    anyhow!(
                        "tensor `{}` in {} has no `{suffix}`: `{}.{suffix}` is missing ({why})",
                        qw.name,
                        qw.file.display(),
                        qw.name.strip_suffix(".qweight").unwrap_or(&qw.name)
                    )
                })
        };
        let qw = get("qweight", "")?;
        let qz = get("qzeros", "the zero points, one a group and output column")?;
        let sc = get("scales", "the group scales")?;
        let groups = cols.div_ceil(group);
        let awq = q.source == AffineSource::Awq;
        let check = |e: &TensorEntry, want: Vec<usize>, what: &str| -> Result<()> {
            if e.shape != want {
                bail!(
                    "tensor `{}` in {} has shape {:?}, expected {want:?}: {what} of a [{rows}, {cols}] (out, in) weight, 4-bit, group {group} (`quantization_config.bits` / `group_size`)",
                    e.name,
                    e.file.display(),
                    e.shape
                );
            }
            Ok(())
        };
        if awq {
            check(qw, vec![cols, rows / 8], "AWQ qweight [in, out/8]")?;
        } else {
            check(qw, vec![cols / 8, rows], "GPTQ qweight [in/8, out]")?;
        }
        check(qz, vec![groups, rows / 8], "qzeros [in/group, out/8]")?;
        check(sc, vec![groups, rows], "scales [in/group, out]")?;
        let words = Self::i32_words(qw)?;
        let zwords = Self::i32_words(qz)?;
        let s = Self::float_mat(sc, "GPTQ/AWQ scales", groups, rows)?.to_f32();
        // Nibble position of output column j within its word (AWQ's interleaved order).
        const AWQ_POS: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
        let zero_at = |g: usize, o: usize| -> u32 {
            let w = zwords[g * (rows / 8) + o / 8];
            let p = if awq { AWQ_POS[o % 8] } else { o % 8 };
            (w >> (4 * p)) & 0xf
        };
        let offset = match q.source {
            AffineSource::Gptq { zeros_offset, .. } => zeros_offset,
            _ => 0,
        };
        // One output row at a time, in parallel (a full-size checkpoint has ~32e9 codes).
        let mut codes = vec![0u32; rows * cols];
        codes.par_chunks_mut(cols).enumerate().for_each(|(o, row)| {
            for (i, c) in row.iter_mut().enumerate() {
                *c = if awq {
                    (words[i * (rows / 8) + o / 8] >> (4 * AWQ_POS[o % 8])) & 0xf
                } else {
                    (words[(i / 8) * rows + o] >> (4 * (i % 8))) & 0xf
                };
            }
        });
        let (mut scales, mut biases) = (vec![0.0f32; rows * groups], vec![0.0f32; rows * groups]);
        for g in 0..groups {
            for o in 0..rows {
                let sv = s[g * rows + o];
                if !sv.is_finite() {
                    bail!(
                        "tensor `{}` in {} has scale {sv} at [{g}, {o}]; scales must be finite",
                        sc.name,
                        sc.file.display()
                    );
                }
                let z = zero_at(g, o) + offset;
                scales[o * groups + g] = sv;
                biases[o * groups + g] = -sv * z as f32;
            }
        }
        let col_group = match self.tensors.get(&format!("{base}.g_idx")) {
            None => None,
            Some(ge) => {
                check(ge, vec![cols], "g_idx [in]")?;
                Self::col_groups(ge, groups, group)?
            }
        };
        Ok(Mat {
            storage: Arc::new(Storage::Owned(pack_codes(&codes, 4))),
            offset: 0,
            dtype: DType::U4,
            rows,
            cols,
            scales: None,
            affine: Some(Box::new(Affine {
                group,
                scales: Mat::from_f32(&scales, rows, groups, DType::F32),
                biases: Mat::from_f32(&biases, rows, groups, DType::F32),
                col_group,
            })),
        })
    }

    /// A compressed-tensors `pack-quantized` module for a `[rows, cols]` weight: the codes
    /// (`weight_packed`, Kestrel's own layout, stored `q + 8`) and `weight_scale` stay
    /// mapped; `bias = -scale * zero` (f32) with the zero point in the codes' unsigned
    /// range (`weight_zero_point` as stored, the signed value + 8; 8 when symmetric).
    fn ct_weight(&self, base: &str, shape: &[usize], q: &AffineQuant) -> Result<Mat> {
        if shape.len() != 2 {
            bail!("stacked compressed-tensors experts are not supported (`{base}`)");
        }
        let (rows, cols) = (shape[0], shape[1]);
        let group = q.group;
        let wp = &self.tensors[&format!("{base}.weight_packed")];
        let module = wp.name.strip_suffix(".weight_packed").unwrap_or(&wp.name);
        let get = |suffix: &str, why: &str| -> Result<&TensorEntry> {
            self.tensors.get(&format!("{base}.{suffix}")).ok_or_else(|| {
                anyhow!(
                    "tensor `{}` in {} has no `{suffix}`: `{module}.{suffix}` is missing ({why})",
                    wp.name,
                    wp.file.display()
                )
            })
        };
        let groups = cols.div_ceil(group);
        let check = |e: &TensorEntry, want: Vec<usize>, what: &str| -> Result<()> {
            if e.shape != want {
                bail!(
                    "tensor `{}` in {} has shape {:?}, expected {want:?}: {what} of a [{rows}, {cols}] (out, in) weight, 4-bit, group {group} (`quantization_config.config_groups.*.weights`)",
                    e.name,
                    e.file.display(),
                    e.shape
                );
            }
            Ok(())
        };
        if !matches!(wp.dtype, safetensors::Dtype::I32 | safetensors::Dtype::U32) {
            bail!(
                "tensor `{}` in {} has dtype {:?}; packed 4-bit tensors are I32",
                wp.name,
                wp.file.display(),
                wp.dtype
            );
        }
        if !cols.is_multiple_of(8) {
            bail!(
                "tensor `{}` in {}: {cols} columns do not fill whole words",
                wp.name,
                wp.file.display()
            );
        }
        check(wp, vec![rows, cols / 8], "weight_packed [out, in/8]")?;
        if let Some(se) = self.tensors.get(&format!("{base}.weight_shape")) {
            let dims: Vec<i64> = match se.dtype {
                safetensors::Dtype::I32 => Self::i32_words(se)?
                    .iter()
                    .map(|x| *x as i32 as i64)
                    .collect(),
                safetensors::Dtype::I64 => se.storage.bytes()
                    [se.offset..se.offset + 8 * se.shape.iter().product::<usize>()]
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                other => bail!(
                    "tensor `{}` in {} has dtype {other:?}; expected I32 or I64",
                    se.name,
                    se.file.display()
                ),
            };
            if dims != [rows as i64, cols as i64] {
                bail!(
                    "tensor `{}` in {} says the weight is {dims:?}, but config.json makes it [{rows}, {cols}]",
                    se.name,
                    se.file.display()
                );
            }
        }
        let sc = get("weight_scale", "the group scales")?;
        check(sc, vec![rows, groups], "weight_scale [out, in/group]")?;
        let scales = Self::float_mat(sc, "weight_scale", rows, groups)?;
        let s = scales.to_f32();
        let zp = self.tensors.get(&format!("{base}.weight_zero_point"));
        let zeros: Vec<u32> = match (q.sym, zp) {
            (true, None) => vec![8; rows * groups],
            (true, Some(z)) => bail!(
                "tensor `{}` in {} is a zero point, but config.json's scheme is symmetric",
                z.name,
                z.file.display()
            ),
            (false, None) => bail!(
                "tensor `{}` in {} has no `weight_zero_point`: `{module}.weight_zero_point` is missing (config.json's scheme is asymmetric)",
                wp.name,
                wp.file.display()
            ),
            (false, Some(z)) => {
                check(
                    z,
                    vec![rows.div_ceil(8), groups],
                    "weight_zero_point [out/8, in/group]",
                )?;
                let w = Self::i32_words(z)?;
                (0..rows * groups)
                    .map(|k| {
                        let (o, g) = (k / groups, k % groups);
                        (w[(o / 8) * groups + g] >> (4 * (o % 8))) & 0xf
                    })
                    .collect()
            }
        };
        let mut biases = vec![0.0f32; rows * groups];
        for (k, b) in biases.iter_mut().enumerate() {
            if !s[k].is_finite() {
                bail!(
                    "tensor `{}` in {} has scale {} at [{}, {}]; scales must be finite",
                    sc.name,
                    sc.file.display(),
                    s[k],
                    k / groups,
                    k % groups
                );
            }
            *b = -s[k] * zeros[k] as f32;
        }
        let col_group = match self.tensors.get(&format!("{base}.weight_g_idx")) {
            None => None,
            Some(ge) => {
                check(ge, vec![cols], "weight_g_idx [in]")?;
                Self::col_groups(ge, groups, group)?
            }
        };
        Ok(Mat {
            storage: wp.storage.clone(),
            offset: wp.offset,
            dtype: DType::U4,
            rows,
            cols,
            scales: None,
            affine: Some(Box::new(Affine {
                group,
                scales,
                biases: Mat::from_f32(&biases, rows, groups, DType::F32),
                col_group,
            })),
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

/// The first non-finite value of a float matrix, with its position.
fn first_non_finite(m: &Mat) -> Option<(usize, usize, f32)> {
    let v = m.to_f32();
    v.iter()
        .position(|x| !x.is_finite())
        .map(|i| (i / m.cols.max(1), i % m.cols.max(1), v[i]))
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

impl LayerWeights {
    /// The mixer's projections, the dense matrices the quantised formats store quantised: GDN's
    /// in_proj_qkv, in_proj_z and out_proj (not in_proj_a / in_proj_b), attention's q, k, v, o.
    pub fn mixer_matrices_mut(&mut self) -> Vec<&mut Mat> {
        match &mut self.mixer {
            Mixer::Gdn(g) => vec![&mut g.in_qkv, &mut g.in_z, &mut g.out],
            Mixer::Attention(a) => vec![&mut a.q, &mut a.k, &mut a.v, &mut a.o],
        }
    }
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
        // mlx-lm stores the zero-centred norms with the +1 added (its sanitize): back to w.
        let zc = |name: &str, n: usize| -> Result<Vec<f32>> {
            let mut v = ck.vec_f32(name, &[n])?;
            if ck.mlx_layout {
                v.iter_mut().for_each(|x| *x -= 1.0);
            }
            Ok(v)
        };
        let conv_shape = |ch: usize| {
            if ck.mlx_layout {
                [ch, cfg.conv_kernel, 1]
            } else {
                [ch, 1, cfg.conv_kernel]
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (i, kind) in cfg.layer_kinds.iter().enumerate() {
            let p = format!("layers.{i}.");
            let mixer = match kind {
                LayerKind::Gdn => {
                    let a = format!("{p}linear_attn.");
                    let hv = cfg.gdn_num_value_heads;
                    let ch = cfg.gdn_conv_channels();
                    Mixer::Gdn(GdnWeights {
                        in_qkv: ck.any_weight(
                            &format!("{a}in_proj_qkv.weight"),
                            &[ch, d],
                            cfg,
                            true,
                        )?,
                        in_z: ck.any_weight(
                            &format!("{a}in_proj_z.weight"),
                            &[cfg.gdn_v_width(), d],
                            cfg,
                            true,
                        )?,
                        in_b: ck.any_weight(
                            &format!("{a}in_proj_b.weight"),
                            &[hv, d],
                            cfg,
                            false,
                        )?,
                        in_a: ck.any_weight(
                            &format!("{a}in_proj_a.weight"),
                            &[hv, d],
                            cfg,
                            false,
                        )?,
                        conv: ck.vec_f32(&format!("{a}conv1d.weight"), &conv_shape(ch))?,
                        a_log: ck.vec_f32(&format!("{a}A_log"), &[hv])?,
                        dt_bias: ck.vec_f32(&format!("{a}dt_bias"), &[hv])?,
                        norm: ck.vec_f32(&format!("{a}norm.weight"), &[cfg.gdn_value_dim])?,
                        out: ck.any_weight(
                            &format!("{a}out_proj.weight"),
                            &[d, cfg.gdn_v_width()],
                            cfg,
                            true,
                        )?,
                    })
                }
                LayerKind::Attention => {
                    let a = format!("{p}self_attn.");
                    let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
                    Mixer::Attention(AttentionWeights {
                        q: ck.any_weight(
                            &format!("{a}q_proj.weight"),
                            &[nq * 2 * hd, d],
                            cfg,
                            true,
                        )?,
                        k: ck.any_weight(
                            &format!("{a}k_proj.weight"),
                            &[nkv * hd, d],
                            cfg,
                            true,
                        )?,
                        v: ck.any_weight(
                            &format!("{a}v_proj.weight"),
                            &[nkv * hd, d],
                            cfg,
                            true,
                        )?,
                        o: ck.any_weight(&format!("{a}o_proj.weight"), &[d, nq * hd], cfg, true)?,
                        q_norm: zc(&format!("{a}q_norm.weight"), hd)?,
                        k_norm: zc(&format!("{a}k_norm.weight"), hd)?,
                    })
                }
            };
            layers.push(LayerWeights {
                input_norm: zc(&format!("{p}input_layernorm.weight"), d)?,
                post_attention_norm: zc(&format!("{p}post_attention_layernorm.weight"), d)?,
                mixer,
                moe: load_moe(ck, cfg, &format!("{p}mlp."))?,
            });
        }
        Ok(ModelWeights {
            embed: ck.any_weight("embed_tokens.weight", &[cfg.vocab_size, d], cfg, false)?,
            layers,
            final_norm: zc("norm.weight", d)?,
            lm_head: ck.any_weight("lm_head.weight", &[cfg.vocab_size, d], cfg, false)?,
            mtp: None,
        })
    }

    /// Every matrix re-stored as the GPU backend holds it, so the CPU reference can run at
    /// the GPU's precision: bf16, except FP8 (kept) and 4-bit affine matrices, which keep
    /// their codes with their scales and biases rounded to bf16 (the GPU's q4 tiles hold bf16
    /// pairs: GPTQ/AWQ f16 scales move by up to 2^-9). 8-bit affine matrices (MLX's router),
    /// the embedding and GDN's in_proj_a / in_proj_b go up dequantised to bf16 whatever their
    /// format (the gather and the b|a rows read bf16). Without this the 4-bit fixtures' GPU
    /// runs sat 2-5x further from the CPU than the GPU's own arithmetic explains (tiny-gptq:
    /// 2.7e-2 of the decode logits' norm from the scales alone).
    pub fn round_to_bf16(&mut self) {
        let r = |m: &mut Mat| {
            if m.dtype == DType::U4 {
                if let Some(a) = m.affine.as_mut() {
                    for t in [&mut a.scales, &mut a.biases] {
                        if t.dtype != DType::BF16 {
                            *t = Mat::from_f32(&t.to_f32(), t.rows, t.cols, DType::BF16);
                        }
                    }
                }
            } else if m.dtype != DType::BF16 && m.dtype != DType::F8E4M3 {
                *m = Mat::from_f32(&m.to_f32(), m.rows, m.cols, DType::BF16);
            }
        };
        let bf16 = |m: &mut Mat| {
            if m.dtype != DType::BF16 {
                *m = Mat::from_f32(&m.to_f32(), m.rows, m.cols, DType::BF16);
            }
        };
        bf16(&mut self.embed);
        r(&mut self.lm_head);
        for l in &mut self.layers {
            l.mixer_matrices_mut().into_iter().for_each(r);
            if let Mixer::Gdn(g) = &mut l.mixer {
                bf16(&mut g.in_a);
                bf16(&mut g.in_b);
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
    pub(crate) fn matrices_by_role(&self) -> (Vec<&Mat>, Vec<&Mat>) {
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
            l.mixer_matrices_mut().into_iter().for_each(f);
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

    /// The GPU's weight format for these weights: FP8 where any matrix is FP8, 4-bit where
    /// any is 4-bit affine, else bf16 (8-bit affine ones are dequantised to bf16 on the GPU).
    pub fn weight_format(&self) -> crate::config::WeightFormat {
        use crate::config::WeightFormat;
        let (q, k) = self.matrices_by_role();
        if self.is_fp8() {
            WeightFormat::Fp8
        } else if q.iter().chain(&k).any(|m| m.dtype == DType::U4) {
            WeightFormat::Int4
        } else {
            WeightFormat::Bf16
        }
    }

    /// Whether any matrix is stored affine 4/8-bit (MLX, GPTQ, AWQ).
    pub fn is_affine(&self) -> bool {
        let (q, k) = self.matrices_by_role();
        q.iter().chain(&k).any(|m| m.dtype.is_affine())
    }

    /// The weight format: `"fp8 e4m3 block 128x128"` when any matrix is FP8;
    /// `"affine 4-bit group 64 + 8-bit group 64"` (then `+ bf16` where some matrices are
    /// unquantized) when any is affine; else the matrices' dtypes (`"bf16"`, `"bf16+f32"`).
    pub fn format(&self) -> String {
        let (q, k) = self.matrices_by_role();
        if let Some(s) = q.iter().find_map(|m| m.scales.as_ref()) {
            return format!("fp8 e4m3 block {}x{}", s.block_rows, s.block_cols);
        }
        if self.is_affine() {
            let mut kinds: Vec<(usize, usize)> = Vec::new();
            let mut floats: Vec<String> = Vec::new();
            for m in q.iter().chain(&k) {
                match &m.affine {
                    Some(a) => kinds.push((m.dtype.bits(), a.group)),
                    None => floats.push(m.dtype.name().to_lowercase()),
                }
            }
            // The most common kind first.
            let count = |x: &(usize, usize)| kinds.iter().filter(|y| *y == x).count();
            let mut uniq = kinds.clone();
            uniq.sort();
            uniq.dedup();
            uniq.sort_by_key(|x| std::cmp::Reverse(count(x)));
            floats.sort();
            floats.dedup();
            let mut parts: Vec<String> = uniq
                .iter()
                .map(|(b, g)| format!("{b}-bit group {g}"))
                .collect();
            parts[0] = format!("affine {}", parts[0]);
            parts.extend(floats);
            return parts.join(" + ");
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

    /// Bytes by kind, as stored: each matrix dtype (`F8_E4M3`, `U4`, `BF16`, ...), the FP8
    /// block scales (`FP8 block scales (f32)`), the affine group scales and biases
    /// (`affine scales+biases (BF16)`) and the small vectors (`f32 vectors`), in that order.
    pub fn bytes_by_kind(&self) -> Vec<(String, usize)> {
        let (q, k) = self.matrices_by_role();
        let mut by: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut scales = 0;
        let mut affine: BTreeMap<String, usize> = BTreeMap::new();
        for m in q.iter().chain(&k) {
            *by.entry(m.dtype.name()).or_default() += m.nbytes();
            match &m.affine {
                Some(a) => {
                    let (s, b) = (a.scales.dtype.name(), a.biases.dtype.name());
                    let kind = if s == b {
                        s.to_string()
                    } else {
                        format!("{s} scales, {b} biases")
                    };
                    *affine.entry(kind).or_default() += m.scale_bytes()
                }
                None => scales += m.scale_bytes(),
            }
        }
        let mut out: Vec<(String, usize)> =
            by.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        if scales > 0 {
            out.push(("FP8 block scales (f32)".into(), scales));
        }
        for (dt, n) in affine {
            out.push((format!("affine scales+biases ({dt})"), n));
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
    let fused = format!("{p}experts.gate_up_proj");
    let stacked = format!("{p}switch_mlp.gate_proj.weight");
    let experts = if ck.contains(&stacked) {
        // mlx-lm's SwitchGLU: [E, I, D] / [E, D, I], quantised or not, viewed per expert.
        let gate = ck.any_weight(&stacked, &[e, i, d], cfg, false)?;
        let up = ck.any_weight(
            &format!("{p}switch_mlp.up_proj.weight"),
            &[e, i, d],
            cfg,
            false,
        )?;
        let down = ck.any_weight(
            &format!("{p}switch_mlp.down_proj.weight"),
            &[e, d, i],
            cfg,
            false,
        )?;
        (0..e)
            .map(|x| ExpertWeights {
                gate: gate.rows_view(x * i, i),
                up: up.rows_view(x * i, i),
                down: down.rows_view(x * d, d),
            })
            .collect()
    } else if ck.contains(&fused) {
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
                gate: ck.any_weight(&format!("{n}gate_proj.weight"), &[i, d], cfg, true)?,
                up: ck.any_weight(&format!("{n}up_proj.weight"), &[i, d], cfg, true)?,
                down: ck.any_weight(&format!("{n}down_proj.weight"), &[d, i], cfg, true)?,
            });
        }
        v
    };
    let s = cfg.shared_intermediate;
    Ok(MoeWeights {
        router: ck.any_weight(&format!("{p}gate.weight"), &[e, d], cfg, false)?,
        experts,
        shared: ExpertWeights {
            gate: ck.any_weight(
                &format!("{p}shared_expert.gate_proj.weight"),
                &[s, d],
                cfg,
                true,
            )?,
            up: ck.any_weight(
                &format!("{p}shared_expert.up_proj.weight"),
                &[s, d],
                cfg,
                true,
            )?,
            down: ck.any_weight(
                &format!("{p}shared_expert.down_proj.weight"),
                &[d, s],
                cfg,
                true,
            )?,
        },
        // [1, D]: a vector (dequantised where MLX stores it 8-bit).
        shared_gate: ck
            .any_weight(
                &format!("{p}shared_expert_gate.weight"),
                &[1, d],
                cfg,
                false,
            )?
            .to_f32(),
    })
}
