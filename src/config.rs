//! `config.json` / `generation_config.json` parsing and strict architecture validation.
//!
//! Sizes may vary (tiny test models load), but the architecture must be exactly
//! Qwen3.5/3.6-MoE: hybrid GDN / gated-attention layers, top-k MoE with a shared expert in
//! every layer, untied lm_head, partial NeoX RoPE. Every inconsistency is reported at once,
//! each with the field it concerns.

use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention).
    Gdn,
    /// Gated full attention with a KV cache.
    Attention,
}

/// The text model's hyper-parameters (`qwen3_5_moe_text`).
#[derive(Clone, Debug, PartialEq)]
pub struct TextConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub layer_kinds: Vec<LayerKind>,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub gdn_num_key_heads: usize,
    pub gdn_num_value_heads: usize,
    pub gdn_key_dim: usize,
    pub gdn_value_dim: usize,
    pub conv_kernel: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate: usize,
    pub shared_intermediate: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub mtp_layers: usize,
    /// `quantization_config` of an FP8 checkpoint: `None` for any other.
    pub quantization: Option<Fp8Quant>,
    /// The affine 4/8-bit formats (MLX's `quantization` block, or a GPTQ / AWQ
    /// `quantization_config`): `None` for any other.
    pub affine: Option<AffineQuant>,
}

/// Where an affine-quantised checkpoint comes from: it decides the tensor names and bit
/// layouts the loader reads (all are mapped onto [`crate::tensor::Affine`]).
#[derive(Clone, Debug, PartialEq)]
pub enum AffineSource {
    /// mlx-lm's `affine` mode: `<m>.weight` (u32 codes), `<m>.scales`, `<m>.biases`.
    Mlx,
    /// GPTQ (AutoGPTQ / GPTQModel / optimum): `qweight` packed along the input dim,
    /// `qzeros` along the output dim, `scales`, `g_idx`. `zeros_offset` is 1 for the
    /// original format (`checkpoint_format` "gptq": zeros stored minus one), 0 for "gptq_v2".
    Gptq { zeros_offset: u32, desc_act: bool },
    /// AWQ GEMM (AutoAWQ): `qweight` / `qzeros` packed along the output dim in the order
    /// [0, 2, 4, 6, 1, 3, 5, 7], `scales`.
    Awq,
    /// compressed-tensors `pack-quantized` (llm-compressor): `weight_packed [out, in/8]`
    /// (codes + 8, packed along the input, lowest nibble first: Kestrel's own layout),
    /// `weight_scale [out, in/group]`, `weight_zero_point [out/8, in/group]` (asymmetric,
    /// packed along the output), `weight_g_idx`, `weight_shape`.
    CompressedTensors,
}

/// An affine-quantised checkpoint's format: the default bits and group size, and (MLX) the
/// per-module overrides of its `quantization` block.
#[derive(Clone, Debug, PartialEq)]
pub struct AffineQuant {
    pub source: AffineSource,
    pub bits: usize,
    pub group: usize,
    /// GPTQ / AWQ: symmetric (GPTQ `sym`; AWQ `zero_point: false`).
    pub sym: bool,
    /// MLX: module path (`language_model.model.layers.0.mlp.gate`) to its `(bits, group)`,
    /// or `None` where the block says the module is not quantised.
    pub overrides: BTreeMap<String, Option<(usize, usize)>>,
    /// GPTQ / AWQ `modules_to_not_convert`.
    pub modules_to_not_convert: Vec<String>,
}

impl AffineQuant {
    /// The `(bits, group)` the config gives the module at `path` (a stored tensor name
    /// without its `.weight`), or `None` if it says the module is unquantised.
    pub fn for_module(&self, path: &str) -> Option<(usize, usize)> {
        match self.overrides.get(path) {
            Some(o) => *o,
            None => Some((self.bits, self.group)),
        }
    }

    /// A short description for `inspect`: "MLX affine 4-bit, group 64; 8-bit group 64: 8
    /// modules".
    pub fn describe(&self) -> String {
        let base = match &self.source {
            AffineSource::Mlx => "MLX affine",
            AffineSource::Gptq { desc_act: true, .. } => "GPTQ act-order",
            AffineSource::Gptq { .. } => "GPTQ",
            AffineSource::Awq => "AWQ GEMM",
            AffineSource::CompressedTensors => "compressed-tensors pack-quantized",
        };
        let sym = match self.source {
            AffineSource::Mlx => "",
            _ if self.sym => ", symmetric",
            _ => ", asymmetric",
        };
        let mut s = format!("{base} {}-bit, group {}{sym}", self.bits, self.group);
        let mut other: BTreeMap<String, usize> = BTreeMap::new();
        for o in self.overrides.values() {
            match o {
                Some((b, g)) if (*b, *g) != (self.bits, self.group) => {
                    *other.entry(format!("{b}-bit group {g}")).or_default() += 1
                }
                Some(_) => {}
                None => *other.entry("unquantized".into()).or_default() += 1,
            }
        }
        for (k, n) in other {
            s.push_str(&format!("; {k}: {n} modules"));
        }
        s
    }

    /// Parses mlx-lm's `quantization` block (`field` names it in messages).
    fn from_mlx_json(q: &Value, field: &str, problems: &mut Vec<String>) -> Option<Self> {
        let Some(obj) = q.as_object() else {
            problems.push(format!("`{field}` must be an object, found {q}"));
            return None;
        };
        let before = problems.len();
        let params = |v: &Value, f: &str, problems: &mut Vec<String>| -> Option<(usize, usize)> {
            let o = v.as_object()?;
            let mut bits = None;
            let mut group = None;
            for (k, x) in o {
                match k.as_str() {
                    "bits" => match x.as_u64() {
                        Some(b @ (4 | 8)) => bits = Some(b as usize),
                        _ => problems.push(format!(
                            "`{f}.bits` is {x}; Kestrel runs MLX affine 4- and 8-bit weights only"
                        )),
                    },
                    "group_size" => match x.as_u64() {
                        Some(g @ (32 | 64 | 128)) => group = Some(g as usize),
                        _ => problems.push(format!(
                            "`{f}.group_size` is {x}; Kestrel runs group sizes 32, 64 and 128"
                        )),
                    },
                    "mode" => {
                        if x.as_str() != Some("affine") {
                            problems.push(format!(
                                "`{f}.mode` is {x}; Kestrel runs only MLX's \"affine\" mode (not mxfp4, nvfp4, mxfp8)"
                            ))
                        }
                    }
                    _ if f == field => {}
                    other => problems.push(format!(
                        "`{f}.{other}` is not a field Kestrel knows (known: bits, group_size, mode)"
                    )),
                }
            }
            match (bits, group) {
                (Some(b), Some(g)) => Some((b, g)),
                _ => {
                    for (k, v) in [("bits", bits.is_some()), ("group_size", group.is_some())] {
                        if !v && !o.contains_key(k) {
                            problems.push(format!("`{f}.{k}` is missing"));
                        }
                    }
                    None
                }
            }
        };
        let default = params(q, field, problems);
        let mut overrides = BTreeMap::new();
        for (k, v) in obj {
            if matches!(k.as_str(), "bits" | "group_size" | "mode") {
                continue;
            }
            let f = format!("{field}.{k}");
            match v {
                Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                Value::Bool(true) => {
                    if let Some(d) = default {
                        overrides.insert(k.clone(), Some(d));
                    }
                }
                Value::Object(_) => {
                    if let Some(p) = params(v, &f, problems) {
                        overrides.insert(k.clone(), Some(p));
                    }
                }
                _ => problems.push(format!(
                    "`{f}` is {v}; a module override must be an object with bits and group_size, or a bool (`{field}.{k}` is not a field Kestrel knows)"
                )),
            }
        }
        if problems.len() > before {
            return None;
        }
        let (bits, group) = default?;
        Some(AffineQuant {
            source: AffineSource::Mlx,
            bits,
            group,
            sym: false,
            overrides,
            modules_to_not_convert: Vec::new(),
        })
    }

    /// Parses a GPTQ or AWQ `quantization_config` (quant_method "gptq" / "awq").
    fn from_hf_json(
        q: &serde_json::Map<String, Value>,
        field: &str,
        problems: &mut Vec<String>,
    ) -> Option<Self> {
        let before = problems.len();
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        let s = |k: &str| q.get(k).filter(|v| !v.is_null());
        let uint =
            |keys: &[&str], default: Option<u64>, problems: &mut Vec<String>| -> Option<u64> {
                for k in keys {
                    if let Some(v) = s(k) {
                        return match v.as_u64() {
                            Some(x) => Some(x),
                            None => {
                                problems.push(format!(
                                    "`{field}.{k}` must be a positive integer, found {v}"
                                ));
                                None
                            }
                        };
                    }
                }
                if default.is_none() {
                    problems.push(format!("`{field}.{}` is missing", keys[0]));
                }
                default
            };
        let bits = uint(&["bits", "w_bit"], None, problems);
        if let Some(b) = bits
            && b != 4
        {
            problems.push(format!(
                "`{field}.bits` is {b}; Kestrel runs {method} 4-bit weights only"
            ));
        }
        let group = uint(&["group_size", "q_group_size"], None, problems);
        if let Some(g) = group
            && g != 32
            && g != 64
            && g != 128
        {
            problems.push(format!(
                "`{field}.group_size` is {g}; Kestrel runs group sizes 32, 64 and 128 (not per-channel -1)"
            ));
        }
        let boolean = |k: &str, default: bool, problems: &mut Vec<String>| match s(k) {
            None => default,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                problems.push(format!("`{field}.{k}` must be true or false, found {v}"));
                default
            }
        };
        let mut skip = Vec::new();
        module_names(
            field,
            "modules_to_not_convert",
            s("modules_to_not_convert"),
            &mut skip,
            problems,
        );
        let (source, sym) = if method == "gptq" {
            let desc_act = boolean("desc_act", false, problems);
            let sym = boolean("sym", true, problems);
            let zeros_offset = match s("checkpoint_format").or_else(|| s("format")) {
                None => 1,
                Some(Value::String(f)) if f == "gptq" => 1,
                Some(Value::String(f)) if f == "gptq_v2" => 0,
                Some(v) => {
                    problems.push(format!(
                        "`{field}.checkpoint_format` is {v}; Kestrel reads \"gptq\" and \"gptq_v2\" (not marlin, bitblas, ...)"
                    ));
                    1
                }
            };
            if let Some(d) = s("dynamic")
                && d.as_object().is_none_or(|o| !o.is_empty())
            {
                problems.push(format!(
                    "`{field}.dynamic` is {d}; per-module GPTQ overrides are not supported"
                ));
            }
            if boolean("static_groups", false, problems) && desc_act {
                problems.push(format!(
                    "`{field}.static_groups` with `desc_act` is not supported"
                ));
            }
            (
                AffineSource::Gptq {
                    zeros_offset,
                    desc_act,
                },
                sym,
            )
        } else {
            match s("version") {
                None => {}
                Some(Value::String(v)) if v.eq_ignore_ascii_case("gemm") => {}
                Some(v) => problems.push(format!(
                    "`{field}.version` is {v}; Kestrel reads AWQ's \"gemm\" packing only"
                )),
            }
            let zp = boolean("zero_point", true, problems);
            (AffineSource::Awq, !zp)
        };
        if problems.len() > before {
            return None;
        }
        Some(AffineQuant {
            source,
            bits: bits? as usize,
            group: group? as usize,
            sym,
            overrides: BTreeMap::new(),
            modules_to_not_convert: skip,
        })
    }
}

/// How a checkpoint's projections and experts are stored (the GPU keeps them so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Bf16,
    /// The official FP8 release's layout ([`Fp8Quant`]): the attention and GDN projections
    /// (but GDN's a and b), the shared and the routed experts e4m3 with 128 x 128 block
    /// scales, the rest bf16.
    Fp8,
    /// Affine 4-bit (MLX, GPTQ, AWQ, compressed-tensors W4A16): on the GPU the matrices of
    /// [`TextConfig::fp8_matrices`] and lm_head as 4-bit codes with (scale, bias) bf16 pairs per
    /// group; GDN's a and b, the router, norms and the embedding (dequantised at upload) bf16.
    /// Byte counts take MLX's group of 64 columns ([`Q4_GROUP`]).
    Int4,
}

impl WeightFormat {
    /// The format of a `--synthetic` kind: `full` bf16, `full-fp8` the official FP8 layout,
    /// `full-int4` MLX's affine 4-bit (group 64); `None` for any other.
    pub fn of_synthetic(kind: &str) -> Option<WeightFormat> {
        match kind {
            "full" => Some(WeightFormat::Bf16),
            "full-fp8" => Some(WeightFormat::Fp8),
            "full-int4" => Some(WeightFormat::Int4),
            _ => None,
        }
    }
}

/// The group (columns a scale and bias) the 4-bit byte counts and the synthetic 4-bit model
/// take: MLX's default, Lily's checkpoint's.
pub const Q4_GROUP: usize = 64;

/// Device bytes of a `[rows, cols]` matrix as 4-bit codes with a bf16 (scale, bias) pair per
/// [`Q4_GROUP`] columns.
pub fn q4_bytes(rows: usize, cols: usize) -> usize {
    rows * cols / 2 + rows * cols.div_ceil(Q4_GROUP) * 4
}

/// The one quantized format Kestrel runs: the official FP8 release's fine-grained FP8
/// (`quant_method: fp8`, `fmt: e4m3`, `activation_scheme: dynamic`,
/// `weight_block_size: [128, 128]`). Each quantized `W [rows, cols]` is stored F8_E4M3 with
/// `W.weight_scale_inv [ceil(rows/128), ceil(cols/128)]`, and `w = q * scale` per block.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Quant {
    /// `weight_block_size`: rows, cols of one scale block (always 128 x 128 today).
    pub block: [usize; 2],
    /// `modules_to_not_convert`: module-name patterns kept unquantized.
    pub modules_to_not_convert: Vec<String>,
}

impl AffineQuant {
    /// Parses a compressed-tensors `quantization_config` (llm-compressor's W4A16
    /// `pack-quantized`): every config group must quantise weights only, 4-bit int, group
    /// strategy, the same group size and symmetry.
    fn from_ct_json(
        q: &serde_json::Map<String, Value>,
        field: &str,
        problems: &mut Vec<String>,
    ) -> Option<Self> {
        let before = problems.len();
        let fmt_ok = |v: Option<&Value>, f: &str, problems: &mut Vec<String>| match v {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "pack-quantized" => {}
            Some(v) => problems.push(format!(
                "`{f}` is {v}; Kestrel reads compressed-tensors \"pack-quantized\" (W4A16) only"
            )),
        };
        fmt_ok(q.get("format"), &format!("{field}.format"), problems);
        let mut params: Option<(usize, bool)> = None;
        match q.get("config_groups") {
            Some(Value::Object(groups)) if !groups.is_empty() => {
                for (name, g) in groups {
                    let f = format!("{field}.config_groups.{name}");
                    fmt_ok(g.get("format"), &format!("{f}.format"), problems);
                    for act in ["input_activations", "output_activations"] {
                        if let Some(v) = g.get(act).filter(|v| !v.is_null()) {
                            problems.push(format!(
                                "`{f}.{act}` is {v}; Kestrel runs weight-only (W4A16) compressed-tensors checkpoints"
                            ));
                        }
                    }
                    let Some(w) = g.get("weights").and_then(Value::as_object) else {
                        problems.push(format!("`{f}.weights` is missing"));
                        continue;
                    };
                    let wf = format!("{f}.weights");
                    let get = |k: &str| w.get(k).filter(|v| !v.is_null());
                    if get("num_bits").and_then(Value::as_u64) != Some(4) {
                        problems.push(format!(
                            "`{wf}.num_bits` is {}; Kestrel runs 4-bit weights only",
                            get("num_bits").unwrap_or(&Value::Null)
                        ));
                    }
                    if get("type").and_then(Value::as_str).is_some_and(|t| t != "int") {
                        problems.push(format!(
                            "`{wf}.type` is {}; Kestrel runs int weights only",
                            w["type"]
                        ));
                    }
                    if get("strategy").and_then(Value::as_str) != Some("group") {
                        problems.push(format!(
                            "`{wf}.strategy` is {}; Kestrel runs the \"group\" strategy only",
                            get("strategy").unwrap_or(&Value::Null)
                        ));
                    }
                    if get("dynamic").is_some_and(|d| d != &Value::Bool(false)) {
                        problems.push(format!(
                            "`{wf}.dynamic` is {}; Kestrel needs stored weight scales",
                            w["dynamic"]
                        ));
                    }
                    let group = match get("group_size").and_then(Value::as_u64) {
                        Some(g @ (32 | 64 | 128)) => g as usize,
                        _ => {
                            problems.push(format!(
                                "`{wf}.group_size` is {}; Kestrel runs group sizes 32, 64 and 128",
                                get("group_size").unwrap_or(&Value::Null)
                            ));
                            0
                        }
                    };
                    let sym = match get("symmetric") {
                        None => true,
                        Some(Value::Bool(b)) => *b,
                        Some(v) => {
                            problems.push(format!("`{wf}.symmetric` must be true or false, found {v}"));
                            true
                        }
                    };
                    match params {
                        None => params = Some((group, sym)),
                        Some(p) if p == (group, sym) => {}
                        Some(_) => problems.push(format!(
                            "`{f}` quantises with another group size or symmetry than the other config groups; Kestrel runs one scheme a checkpoint"
                        )),
                    }
                }
            }
            Some(v) => problems.push(format!(
                "`{field}.config_groups` must be a non-empty object of quantisation schemes, found {v}"
            )),
            None => problems.push(format!("`{field}.config_groups` is missing")),
        }
        if let Some(v) = q
            .get("sparsity_config")
            .filter(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
        {
            problems.push(format!(
                "`{field}.sparsity_config` is {v}; sparse compressed-tensors checkpoints are not supported"
            ));
        }
        let mut skip = Vec::new();
        if let Some(Value::Array(a)) = q.get("ignore") {
            skip.extend(a.iter().filter_map(Value::as_str).map(str::to_string));
        }
        if problems.len() > before {
            return None;
        }
        let (group, sym) = params?;
        Some(AffineQuant {
            source: AffineSource::CompressedTensors,
            bits: 4,
            group,
            sym,
            overrides: BTreeMap::new(),
            modules_to_not_convert: skip,
        })
    }
}

/// The only block size Kestrel runs (the release's; the GPU kernels will be built for it).
pub const FP8_BLOCK: [usize; 2] = [128, 128];

impl Fp8Quant {
    /// The release's format with an empty skip list.
    pub fn block_128() -> Self {
        Fp8Quant {
            block: FP8_BLOCK,
            modules_to_not_convert: Vec::new(),
        }
    }

    /// Whether `module` (a stored tensor name without `.weight`, e.g.
    /// `model.language_model.layers.0.mlp.gate`) is listed in `modules_to_not_convert`.
    /// transformers' rule (`should_convert_module`): the pattern matches at the start of the
    /// name (a regex there) or the name ends with it. Here a pattern is literal except `*`,
    /// which matches any run of characters; no released list is known to use other regex.
    pub fn keeps_unquantized(&self, module: &str) -> bool {
        self.modules_to_not_convert
            .iter()
            .any(|p| module.ends_with(p.as_str()) || glob_prefix(p, module))
    }

    /// Parses and validates `quantization_config`, adding every problem to `problems`.
    /// `field` is the JSON path used in messages (`quantization_config`).
    fn from_json(q: &Value, field: &str, problems: &mut Vec<String>) -> Option<Self> {
        let Some(obj) = q.as_object() else {
            problems.push(format!("`{field}` must be an object, found {q}"));
            return None;
        };
        let before = problems.len();
        let s = |k: &str| obj.get(k).filter(|v| !v.is_null());
        // Keys transformers' FineGrainedFP8Config knows, plus the release's `fmt`.
        const KNOWN: [&str; 9] = [
            "quant_method",
            "fmt",
            "activation_scheme",
            "weight_block_size",
            "modules_to_not_convert",
            "ignored_layers",
            "modules_to_convert",
            "scale_fmt",
            "dequantize",
        ];
        for k in obj.keys() {
            if !KNOWN.contains(&k.as_str()) {
                problems.push(format!(
                    "`{field}.{k}` is not a field Kestrel knows for FP8 checkpoints (known: {})",
                    KNOWN.join(", ")
                ));
            }
        }
        match s("quant_method") {
            Some(Value::String(m)) if m == "fp8" => {}
            Some(v) => problems.push(format!(
                "`{field}.quant_method` is {v}; Kestrel runs \"fp8\" (fine-grained FP8 with 128x128 block scales, as the official Qwen3.6-35B-A3B-FP8 release), \"gptq\" and \"awq\" (4-bit), and MLX affine checkpoints (a `quantization` block)"
            )),
            None => problems.push(format!("`{field}.quant_method` is missing (expected \"fp8\")")),
        }
        // transformers assumes e4m3 (float8_e4m3fn) and writes no `fmt`; the release writes it.
        match s("fmt") {
            None => {}
            Some(Value::String(f)) if f == "e4m3" => {}
            Some(v) => problems.push(format!(
                "`{field}.fmt` is {v}; Kestrel runs only \"e4m3\" (float8_e4m3fn weights)"
            )),
        }
        match s("activation_scheme") {
            None => {}
            Some(Value::String(a)) if a.eq_ignore_ascii_case("dynamic") => {}
            Some(v) => problems.push(format!(
                "`{field}.activation_scheme` is {v}; Kestrel runs only \"dynamic\" (no stored activation scales)"
            )),
        }
        let mut block = FP8_BLOCK;
        match s("weight_block_size") {
            // transformers' default is (128, 128); null would mean per-tensor scales.
            None if !obj.contains_key("weight_block_size") => {}
            Some(Value::Array(a))
                if a.len() == 2 && a.iter().all(|x| x.as_u64().is_some_and(|x| x > 0)) =>
            {
                block = [a[0].as_u64().unwrap() as usize, a[1].as_u64().unwrap() as usize];
                if block != FP8_BLOCK {
                    problems.push(format!(
                        "`{field}.weight_block_size` is [{}, {}]; Kestrel runs only [128, 128] block scales",
                        block[0], block[1]
                    ));
                }
            }
            Some(v) => problems.push(format!(
                "`{field}.weight_block_size` must be [128, 128], found {v}"
            )),
            None => problems.push(format!(
                "`{field}.weight_block_size` is null (per-tensor scales); Kestrel runs only [128, 128] block scales"
            )),
        }
        match s("scale_fmt") {
            None => {}
            Some(Value::String(f)) if f == "float" => {}
            Some(v) => problems.push(format!(
                "`{field}.scale_fmt` is {v}; Kestrel runs only \"float\" scales (f32/bf16 `weight_scale_inv`)"
            )),
        }
        match s("modules_to_convert") {
            None => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(v) => problems.push(format!(
                "`{field}.modules_to_convert` is {v}; Kestrel does not run FP8 embeddings"
            )),
        }
        if let Some(v) = s("dequantize")
            && !v.is_boolean()
        {
            problems.push(format!(
                "`{field}.dequantize` must be true or false, found {v}"
            ));
        }
        let mut skip = Vec::new();
        for key in ["modules_to_not_convert", "ignored_layers"] {
            module_names(field, key, s(key), &mut skip, problems);
        }
        if problems.len() > before {
            return None;
        }
        Some(Fp8Quant {
            block,
            modules_to_not_convert: skip,
        })
    }
}

/// `pattern` (literal, `*` = any run) matches a prefix of `name`.
fn glob_prefix(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    for part in parts {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

/// Everything that is wrong with a config, each with the field it concerns.
#[derive(Debug)]
pub struct ConfigError {
    pub source: String,
    pub problems: Vec<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} problem(s) with the model configuration:",
            self.source,
            self.problems.len()
        )?;
        for p in &self.problems {
            writeln!(f, "  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Reads fields from a JSON object, collecting every problem instead of stopping at the first.
struct Fields<'a> {
    obj: &'a Value,
    prefix: &'a str,
    problems: Vec<String>,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize_req(&mut self, key: &str) -> usize {
        match self.get(key) {
            Some(v) => match v.as_u64() {
                Some(n) => n as usize,
                None => {
                    let name = self.name(key);
                    self.problems.push(format!(
                        "`{name}` must be a non-negative integer, found {v}"
                    ));
                    0
                }
            },
            None => {
                let name = self.name(key);
                self.problems.push(format!("`{name}` is missing"));
                0
            }
        }
    }

    fn usize_or(&mut self, key: &str, default: usize) -> usize {
        if self.get(key).is_some() {
            self.usize_req(key)
        } else {
            default
        }
    }

    fn f64_or(&mut self, key: &str, default: f64) -> f64 {
        match self.get(key) {
            None => default,
            Some(v) => v.as_f64().unwrap_or_else(|| {
                let name = self.name(key);
                self.problems
                    .push(format!("`{name}` must be a number, found {v}"));
                default
            }),
        }
    }

    fn bool_or(&mut self, key: &str, default: bool) -> bool {
        match self.get(key) {
            None => default,
            Some(v) => v.as_bool().unwrap_or_else(|| {
                let name = self.name(key);
                self.problems
                    .push(format!("`{name}` must be true or false, found {v}"));
                default
            }),
        }
    }

    fn str_opt(&mut self, key: &str) -> Option<&'a str> {
        let v = self.get(key)?;
        match v.as_str() {
            Some(s) => Some(s),
            None => {
                let name = self.name(key);
                self.problems
                    .push(format!("`{name}` must be a string, found {v}"));
                None
            }
        }
    }

    fn check(&mut self, ok: bool, msg: impl FnOnce() -> String) {
        if !ok {
            self.problems.push(msg());
        }
    }
}

/// Token ids: a single integer or a list of integers.
fn token_ids(v: Option<&Value>) -> Option<Vec<u32>> {
    match v? {
        Value::Number(n) => n.as_u64().map(|x| vec![x as u32]),
        Value::Array(a) => a.iter().map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => None,
    }
}

impl TextConfig {
    /// Loads `config.json` from a checkpoint directory.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read model config {}: {e}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{} is not valid JSON: {e}", path.display()))?;
        Ok(Self::from_json(&json, &path.display().to_string())?)
    }

    /// Parses the wrapper (`qwen3_5_moe` with `text_config`) or the flat text config.
    pub fn from_json(json: &Value, source: &str) -> Result<Self, ConfigError> {
        let err = |problems: Vec<String>| ConfigError {
            source: source.to_string(),
            problems,
        };
        if !json.is_object() {
            return Err(err(vec!["the config must be a JSON object".into()]));
        }
        let model_type = json.get("model_type").and_then(Value::as_str);
        let (obj, prefix) = match model_type {
            Some("qwen3_5_moe") => match json.get("text_config") {
                Some(t) if t.is_object() => (t, "text_config."),
                _ => {
                    return Err(err(vec![
                        "`text_config` is missing: a `qwen3_5_moe` config nests the text model there"
                            .into(),
                    ]));
                }
            },
            Some("qwen3_5_moe_text") => (json, ""),
            Some(other) => {
                return Err(err(vec![format!(
                    "`model_type` is \"{other}\"; Kestrel runs only \"qwen3_5_moe\" (or its text model \"qwen3_5_moe_text\")"
                )]));
            }
            None => {
                return Err(err(vec![
                    "`model_type` is missing (expected \"qwen3_5_moe\" or \"qwen3_5_moe_text\")"
                        .into(),
                ]));
            }
        };
        if let Some(t) = obj.get("model_type").and_then(Value::as_str)
            && prefix == "text_config."
            && t != "qwen3_5_moe_text"
        {
            return Err(err(vec![format!(
                "`text_config.model_type` is \"{t}\", expected \"qwen3_5_moe_text\""
            )]));
        }

        let mut f = Fields {
            obj,
            prefix,
            problems: Vec::new(),
        };
        let hidden_size = f.usize_req("hidden_size");
        let num_layers = f.usize_req("num_hidden_layers");
        let vocab_size = f.usize_req("vocab_size");
        let num_attention_heads = f.usize_req("num_attention_heads");
        let num_kv_heads = f.usize_req("num_key_value_heads");
        let head_dim = f.usize_req("head_dim");
        let gdn_num_key_heads = f.usize_req("linear_num_key_heads");
        let gdn_num_value_heads = f.usize_req("linear_num_value_heads");
        let gdn_key_dim = f.usize_req("linear_key_head_dim");
        let gdn_value_dim = f.usize_req("linear_value_head_dim");
        let conv_kernel = f.usize_req("linear_conv_kernel_dim");
        let num_experts = f.usize_req("num_experts");
        let experts_per_token = f.usize_req("num_experts_per_tok");
        let moe_intermediate = f.usize_req("moe_intermediate_size");
        let shared_intermediate = f.usize_req("shared_expert_intermediate_size");
        let rms_norm_eps = f.f64_or("rms_norm_eps", 1e-6) as f32;
        let max_position_embeddings = f.usize_or("max_position_embeddings", 262_144);
        let mtp_layers = f.usize_or("mtp_num_hidden_layers", 0);

        // The wrapper carries tie_word_embeddings at the top level; either place counts.
        let tied = json
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            || f.bool_or("tie_word_embeddings", false);
        f.check(!tied, || {
            "`tie_word_embeddings` is true, but this architecture has an untied lm_head".into()
        });
        if let Some(act) = f.str_opt("hidden_act") {
            f.check(act == "silu", || {
                format!("`{prefix}hidden_act` is \"{act}\", expected \"silu\"")
            });
        }
        let bias = f.bool_or("attention_bias", false);
        f.check(!bias, || {
            format!("`{prefix}attention_bias` is true; this architecture has no attention bias")
        });
        let gate = f.bool_or("attn_output_gate", true);
        f.check(gate, || {
            format!("`{prefix}attn_output_gate` is false; this architecture gates attention output")
        });
        let norm_topk = f.bool_or("norm_topk_prob", true);
        f.check(norm_topk, || {
            format!("`{prefix}norm_topk_prob` is false; this architecture renormalises the top-k")
        });
        if let Some(v) = f.get("mlp_only_layers") {
            let empty = v.as_array().map(|a| a.is_empty()).unwrap_or(false);
            f.check(empty, || {
                format!(
                    "`{prefix}mlp_only_layers` must be empty: every layer is a sparse MoE layer"
                )
            });
        }

        // Layer pattern: explicit `layer_types`, else every `full_attention_interval`-th layer.
        let interval = f.usize_or("full_attention_interval", 4);
        f.check(interval >= 1, || {
            format!("`{prefix}full_attention_interval` must be at least 1")
        });
        let expected_kind = |i: usize| {
            if interval >= 1 && (i + 1).is_multiple_of(interval) {
                LayerKind::Attention
            } else {
                LayerKind::Gdn
            }
        };
        let layer_kinds: Vec<LayerKind> = match f.get("layer_types") {
            None => (0..num_layers).map(expected_kind).collect(),
            Some(Value::Array(a)) => {
                let mut kinds = Vec::with_capacity(a.len());
                for (i, t) in a.iter().enumerate() {
                    match t.as_str() {
                        Some("linear_attention") => kinds.push(LayerKind::Gdn),
                        Some("full_attention") => kinds.push(LayerKind::Attention),
                        _ => f.problems.push(format!(
                            "`{prefix}layer_types[{i}]` is {t}, expected \"linear_attention\" or \"full_attention\""
                        )),
                    }
                }
                if a.len() != num_layers {
                    f.problems.push(format!(
                        "`{prefix}layer_types` has {} entries but `{prefix}num_hidden_layers` is {num_layers}",
                        a.len()
                    ));
                }
                if kinds.len() == a.len() && interval >= 1 {
                    for (i, k) in kinds.iter().enumerate() {
                        if *k != expected_kind(i) {
                            f.problems.push(format!(
                                "`{prefix}layer_types[{i}]` is {k:?}, but the hybrid pattern (full attention every {interval} layers, `{prefix}full_attention_interval`) puts {:?} there",
                                expected_kind(i)
                            ));
                        }
                    }
                }
                kinds
            }
            Some(v) => {
                f.problems
                    .push(format!("`{prefix}layer_types` must be a list, found {v}"));
                Vec::new()
            }
        };

        // RoPE: transformers 5 nests it in `rope_parameters`; older files use `rope_scaling`
        // or top-level keys. Only the default (1-D for text) rope type exists for this model.
        let rope = f
            .get("rope_parameters")
            .or_else(|| f.get("rope_scaling"))
            .cloned()
            .unwrap_or(Value::Null);
        let rope_field = |k: &str| rope.get(k).filter(|v| !v.is_null()).cloned();
        if let Some(t) = rope_field("rope_type").or_else(|| rope_field("type")) {
            let ok = matches!(t.as_str(), Some("default") | Some("mrope"));
            f.check(ok, || {
                format!("`{prefix}rope_parameters.rope_type` is {t}; only \"default\" is supported")
            });
        }
        let rope_theta = rope_field("rope_theta")
            .and_then(|v| v.as_f64())
            .unwrap_or_else(|| f.f64_or("rope_theta", 10_000_000.0));
        let partial = rope_field("partial_rotary_factor")
            .and_then(|v| v.as_f64())
            .unwrap_or_else(|| f.f64_or("partial_rotary_factor", 0.25));
        let rotary = head_dim as f64 * partial;
        let rotary_dim = rotary.round() as usize;
        f.check(
            partial > 0.0 && partial <= 1.0 && (rotary - rotary.round()).abs() < 1e-9,
            || {
                format!(
                    "`{prefix}partial_rotary_factor` {partial} times `head_dim` {head_dim} is not a whole number of rotary dims"
                )
            },
        );
        f.check(rotary_dim.is_multiple_of(2), || {
            format!("rotary dims ({rotary_dim} = head_dim x partial_rotary_factor) must be even")
        });
        if let Some(sec) = rope_field("mrope_section") {
            let sum: Option<u64> = sec
                .as_array()
                .and_then(|a| a.iter().map(Value::as_u64).sum::<Option<u64>>());
            f.check(sum == Some((rotary_dim / 2) as u64), || {
                format!(
                    "`{prefix}rope_parameters.mrope_section` {sec} must sum to rotary_dim/2 = {}",
                    rotary_dim / 2
                )
            });
        }
        f.check(rope_theta > 0.0, || {
            format!("`{prefix}rope_theta` must be positive")
        });

        // Head and expert consistency.
        let positive = [
            ("hidden_size", hidden_size),
            ("num_hidden_layers", num_layers),
            ("vocab_size", vocab_size),
            ("num_attention_heads", num_attention_heads),
            ("num_key_value_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("linear_num_key_heads", gdn_num_key_heads),
            ("linear_num_value_heads", gdn_num_value_heads),
            ("linear_key_head_dim", gdn_key_dim),
            ("linear_value_head_dim", gdn_value_dim),
            ("linear_conv_kernel_dim", conv_kernel),
            ("num_experts", num_experts),
            ("num_experts_per_tok", experts_per_token),
            ("moe_intermediate_size", moe_intermediate),
            (
                "shared_expert_intermediate_size (the shared expert is part of the architecture)",
                shared_intermediate,
            ),
        ];
        for (name, v) in positive {
            if v == 0 && obj.get(name.split(' ').next().unwrap()).is_some() {
                f.problems
                    .push(format!("`{prefix}{name}` must be positive"));
            }
        }
        if num_kv_heads > 0 {
            f.check(num_attention_heads.is_multiple_of(num_kv_heads), || {
                format!(
                    "`{prefix}num_attention_heads` ({num_attention_heads}) must be a multiple of `{prefix}num_key_value_heads` ({num_kv_heads})"
                )
            });
        }
        if gdn_num_key_heads > 0 {
            f.check(gdn_num_value_heads.is_multiple_of(gdn_num_key_heads), || {
                format!(
                    "`{prefix}linear_num_value_heads` ({gdn_num_value_heads}) must be a multiple of `{prefix}linear_num_key_heads` ({gdn_num_key_heads})"
                )
            });
        }
        f.check(experts_per_token <= num_experts, || {
            format!(
                "`{prefix}num_experts_per_tok` ({experts_per_token}) exceeds `{prefix}num_experts` ({num_experts})"
            )
        });
        f.check(layer_kinds.contains(&LayerKind::Gdn) || num_layers == 0, || {
            format!("`{prefix}layer_types` has no linear_attention (GDN) layer; this is a hybrid model")
        });

        let eos_token_ids = token_ids(f.get("eos_token_id"))
            .or_else(|| token_ids(json.get("eos_token_id")))
            .unwrap_or_default();

        // mlx-lm writes its `quantization` block (and the same object again as
        // `quantization_config`); GPTQ / AWQ name their `quant_method`.
        let mut affine = None;
        let mlx_block = json.get("quantization").filter(|v| !v.is_null());
        let hf_q = json
            .get("quantization_config")
            .filter(|v| !v.is_null())
            .or_else(|| {
                f.get("quantization_config")
                    .filter(|_| prefix == "text_config.")
            });
        let method = hf_q
            .and_then(|q| q.get("quant_method"))
            .and_then(Value::as_str);
        if let Some(m) = mlx_block {
            if let Some(q) = json.get("quantization_config").filter(|v| !v.is_null())
                && q != m
            {
                f.problems.push(
                    "`quantization_config` differs from the MLX `quantization` block (mlx-lm writes the same object twice); give one"
                        .into(),
                );
            }
            affine = AffineQuant::from_mlx_json(m, "quantization", &mut f.problems);
        } else if let (Some(Value::Object(q)), Some("gptq" | "awq")) = (hf_q, method) {
            affine = AffineQuant::from_hf_json(q, "quantization_config", &mut f.problems);
        } else if let (Some(Value::Object(q)), Some("compressed-tensors")) = (hf_q, method) {
            affine = AffineQuant::from_ct_json(q, "quantization_config", &mut f.problems);
        }
        // transformers keeps `quantization_config` at the top level (the wrapper's, for the
        // release); a text config nested by hand may carry it in `text_config`.
        let quantization = if mlx_block.is_some()
            || affine.is_some()
            || matches!(method, Some("gptq" | "awq" | "compressed-tensors"))
        {
            None
        } else {
            match (
                json.get("quantization_config").filter(|v| !v.is_null()),
                f.get("quantization_config")
                    .filter(|_| prefix == "text_config."),
            ) {
                (None, None) => None,
                (Some(q), None) => Fp8Quant::from_json(q, "quantization_config", &mut f.problems),
                (None, Some(q)) => {
                    Fp8Quant::from_json(q, "text_config.quantization_config", &mut f.problems)
                }
                (Some(q), Some(t)) => {
                    if q != t {
                        f.problems.push(
                        "`quantization_config` and `text_config.quantization_config` differ; give one"
                            .into(),
                    );
                    }
                    Fp8Quant::from_json(q, "quantization_config", &mut f.problems)
                }
            }
        };

        if !f.problems.is_empty() {
            return Err(err(f.problems));
        }
        Ok(TextConfig {
            hidden_size,
            num_layers,
            vocab_size,
            layer_kinds,
            num_attention_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            gdn_num_key_heads,
            gdn_num_value_heads,
            gdn_key_dim,
            gdn_value_dim,
            conv_kernel,
            num_experts,
            experts_per_token,
            moe_intermediate,
            shared_intermediate,
            rms_norm_eps,
            max_position_embeddings,
            eos_token_ids,
            mtp_layers,
            quantization,
            affine,
        })
    }

    /// The exact shape of Qwen3.6-35B-A3B (used by `--synthetic full` and the docs).
    pub fn qwen36_35b_a3b() -> Self {
        TextConfig {
            hidden_size: 2048,
            num_layers: 40,
            vocab_size: 248_320,
            layer_kinds: (0..40)
                .map(|i| {
                    if i % 4 == 3 {
                        LayerKind::Attention
                    } else {
                        LayerKind::Gdn
                    }
                })
                .collect(),
            num_attention_heads: 16,
            num_kv_heads: 2,
            head_dim: 256,
            rotary_dim: 64,
            rope_theta: 10_000_000.0,
            gdn_num_key_heads: 16,
            gdn_num_value_heads: 32,
            gdn_key_dim: 128,
            gdn_value_dim: 128,
            conv_kernel: 4,
            num_experts: 256,
            experts_per_token: 8,
            moe_intermediate: 512,
            shared_intermediate: 512,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 262_144,
            eos_token_ids: vec![248_044],
            mtp_layers: 1,
            quantization: None,
            affine: None,
        }
    }

    pub fn num_gdn_layers(&self) -> usize {
        self.layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::Gdn)
            .count()
    }
    pub fn num_attention_layers(&self) -> usize {
        self.num_layers - self.num_gdn_layers()
    }
    /// Width of q (and of k) in a GDN layer.
    pub fn gdn_qk_width(&self) -> usize {
        self.gdn_num_key_heads * self.gdn_key_dim
    }
    /// Width of v (and of the gate z) in a GDN layer.
    pub fn gdn_v_width(&self) -> usize {
        self.gdn_num_value_heads * self.gdn_value_dim
    }
    /// Channels of the causal conv: q, k and v together.
    pub fn gdn_conv_channels(&self) -> usize {
        2 * self.gdn_qk_width() + self.gdn_v_width()
    }
    /// KV cache bytes per token of context, all attention layers, at `bytes_per_elem`.
    pub fn kv_bytes_per_token(&self, bytes_per_elem: usize) -> usize {
        self.num_attention_layers() * 2 * self.num_kv_heads * self.head_dim * bytes_per_elem
    }
    /// GDN state bytes per sequence: bf16 conv state + f32 recurrent state (the GPU layout).
    pub fn gdn_state_bytes(&self) -> usize {
        let conv = (self.conv_kernel - 1) * self.gdn_conv_channels() * 2;
        let rec = self.gdn_num_value_heads * self.gdn_key_dim * self.gdn_value_dim * 4;
        self.num_gdn_layers() * (conv + rec)
    }

    /// Parameter counts: (total, active per token incl. lm_head but not the embedding table).
    pub fn parameter_counts(&self) -> (u64, u64) {
        let d = self.hidden_size as u64;
        let vocab = self.vocab_size as u64;
        let (qk, v) = (self.gdn_qk_width() as u64, self.gdn_v_width() as u64);
        let hv = self.gdn_num_value_heads as u64;
        let gdn = (2 * qk + v) * d
            + v * d
            + 2 * hv * d
            + self.gdn_conv_channels() as u64 * self.conv_kernel as u64
            + 2 * hv
            + self.gdn_value_dim as u64
            + d * v;
        let hd = self.head_dim as u64;
        let nq = self.num_attention_heads as u64;
        let nkv = self.num_kv_heads as u64;
        let attn = 2 * nq * hd * d + 2 * nkv * hd * d + d * nq * hd + 2 * hd;
        let e = self.num_experts as u64;
        let expert = 3 * self.moe_intermediate as u64 * d;
        let shared = 3 * self.shared_intermediate as u64 * d;
        let router = e * d;
        let moe_total = router + e * expert + shared + d;
        let moe_active = router + self.experts_per_token as u64 * expert + shared + d;
        let norms = 2 * d;
        let mut total = 2 * vocab * d + d;
        let mut active = vocab * d + d;
        for k in &self.layer_kinds {
            let mixer = match k {
                LayerKind::Gdn => gdn,
                LayerKind::Attention => attn,
            };
            total += mixer + moe_total + norms;
            active += mixer + moe_active + norms;
        }
        (total, active)
    }

    /// The matrices the FP8 format quantizes, as (rows, cols, copies, routed expert) over the
    /// whole model: each layer's mixer projections, its shared expert and its experts.
    pub fn fp8_matrices(&self) -> Vec<(usize, usize, usize, bool)> {
        let d = self.hidden_size;
        let (nq, nkv, hd) = (self.num_attention_heads, self.num_kv_heads, self.head_dim);
        let (e, i, is) = (
            self.num_experts,
            self.moe_intermediate,
            self.shared_intermediate,
        );
        let mut m = Vec::new();
        for kind in &self.layer_kinds {
            match kind {
                LayerKind::Gdn => {
                    m.push((self.gdn_conv_channels() + self.gdn_v_width(), d, 1, false));
                    m.push((d, self.gdn_v_width(), 1, false));
                }
                LayerKind::Attention => {
                    m.push((nq * 2 * hd + 2 * nkv * hd, d, 1, false));
                    m.push((d, nq * hd, 1, false));
                }
            }
            m.extend([(2 * is, d, 1, false), (d, is, 1, false)]);
            m.extend([(2 * i, d, e, true), (d, i, e, true)]);
        }
        m
    }

    /// Bytes a decode step reads of the weights in `format`: (all but the routed experts,
    /// one routed expert of one layer). FP8 counts each quantized matrix's bytes and its f32
    /// 128 x 128 block scales.
    pub fn step_weight_bytes(&self, format: WeightFormat) -> (f64, f64) {
        let (_, active) = self.parameter_counts();
        let expert_params = 3 * self.hidden_size * self.moe_intermediate;
        let routed = (self.num_layers * self.experts_per_token * expert_params) as f64;
        let dense_params = active as f64 - routed;
        match format {
            WeightFormat::Bf16 => (2.0 * dense_params, 2.0 * expert_params as f64),
            WeightFormat::Fp8 => {
                let scales = |r: usize, c: usize| (r.div_ceil(128) * c.div_ceil(128) * 4) as f64;
                let (mut dense_q, mut dense_sc, mut expert) = (0.0, 0.0, 0.0);
                for (r, c, n, is_routed) in self.fp8_matrices() {
                    if is_routed {
                        // one expert of one layer: gate/up and down are each listed per layer
                        expert += ((r * c) as f64 + scales(r, c)) / self.num_layers as f64;
                    } else {
                        dense_q += (r * c * n) as f64;
                        dense_sc += scales(r, c) * n as f64;
                    }
                }
                (2.0 * (dense_params - dense_q) + dense_q + dense_sc, expert)
            }
            WeightFormat::Int4 => {
                let (mut dense_q, mut dense_b, mut expert) = (0.0, 0.0, 0.0);
                for (r, c, n, is_routed) in self.fp8_matrices() {
                    if is_routed {
                        expert += q4_bytes(r, c) as f64 / self.num_layers as f64;
                    } else {
                        dense_q += (r * c * n) as f64;
                        dense_b += (q4_bytes(r, c) * n) as f64;
                    }
                }
                let (v, d) = (self.vocab_size, self.hidden_size);
                dense_q += (v * d) as f64; // lm_head
                dense_b += q4_bytes(v, d) as f64;
                (2.0 * (dense_params - dense_q) + dense_b, expert)
            }
        }
    }
}

/// Sampling defaults and end tokens from `generation_config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub do_sample: Option<bool>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` if present; a missing file means "no defaults".
    pub fn from_dir(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        Self::from_json_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    pub fn from_json_str(text: &str) -> anyhow::Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| anyhow::anyhow!("invalid JSON: {e}"))?;
        let f32_of = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let eos = match v.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            some => token_ids(some).ok_or_else(|| {
                anyhow::anyhow!("`eos_token_id` must be an integer or a list of integers")
            })?,
        };
        Ok(GenerationConfig {
            eos_token_ids: eos,
            temperature: f32_of("temperature"),
            top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
            top_p: f32_of("top_p"),
            min_p: f32_of("min_p"),
            repetition_penalty: f32_of("repetition_penalty"),
            presence_penalty: f32_of("presence_penalty"),
            frequency_penalty: f32_of("frequency_penalty"),
            do_sample: v.get("do_sample").and_then(Value::as_bool),
        })
    }
}

/// The module names of the list `field.key` (absent: none) into `out`; anything but a list of
/// non-empty strings is a problem naming the field (and the entry).
fn module_names(
    field: &str,
    key: &str,
    v: Option<&Value>,
    out: &mut Vec<String>,
    problems: &mut Vec<String>,
) {
    match v {
        None => {}
        Some(Value::Array(a)) => {
            for (i, x) in a.iter().enumerate() {
                match x.as_str() {
                    Some(n) if !n.is_empty() => out.push(n.to_string()),
                    _ => problems.push(format!(
                        "`{field}.{key}[{i}]` must be a module name, found {x}"
                    )),
                }
            }
        }
        Some(v) => problems.push(format!(
            "`{field}.{key}` must be a list of module names, found {v}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        json!({
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "full_attention_interval": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": true},
            "hidden_act": "silu", "tie_word_embeddings": false
        })
    }

    #[test]
    fn parses_flat_and_wrapper() {
        let c = TextConfig::from_json(&tiny(), "t").unwrap();
        assert_eq!(c.rotary_dim, 8);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(c.num_attention_layers(), 1);
        assert_eq!(c.gdn_conv_channels(), 2 * 32 + 96);
        let wrapped = json!({"model_type": "qwen3_5_moe", "text_config": tiny(), "tie_word_embeddings": false});
        assert_eq!(TextConfig::from_json(&wrapped, "w").unwrap(), c);
    }

    #[test]
    fn reports_every_problem_with_its_field() {
        let mut j = tiny();
        j["num_key_value_heads"] = json!(3);
        j["num_experts_per_tok"] = json!(9);
        j["tie_word_embeddings"] = json!(true);
        j["layer_types"][0] = json!("full_attention");
        j.as_object_mut().unwrap().remove("head_dim");
        let e = TextConfig::from_json(&j, "cfg.json")
            .unwrap_err()
            .to_string();
        for needle in [
            "num_key_value_heads",
            "num_experts_per_tok",
            "tie_word_embeddings",
            "layer_types[0]",
            "`head_dim` is missing",
        ] {
            assert!(e.contains(needle), "missing {needle:?} in:\n{e}");
        }
    }

    #[test]
    fn rejects_other_models_and_bad_rope() {
        let e = TextConfig::from_json(&json!({"model_type": "llama"}), "c").unwrap_err();
        assert!(e.to_string().contains("llama"));
        let mut j = tiny();
        j["rope_parameters"]["rope_type"] = json!("yarn");
        let e = TextConfig::from_json(&j, "c").unwrap_err().to_string();
        assert!(e.contains("rope_type"), "{e}");
        let mut j = tiny();
        j["layer_types"] = json!(["linear_attention"]);
        let e = TextConfig::from_json(&j, "c").unwrap_err().to_string();
        assert!(e.contains("has 1 entries"), "{e}");
    }

    fn fp8_wrapper(q: Value) -> Value {
        json!({"model_type": "qwen3_5_moe", "text_config": tiny(), "quantization_config": q})
    }

    fn release_quant() -> Value {
        json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens",
                                       "mlp.gate", "mlp.shared_expert_gate",
                                       "model.language_model.layers.*.linear_attn.in_proj_a"]
        })
    }

    #[test]
    fn parses_the_fp8_release_quantization_config() {
        let c = TextConfig::from_json(&fp8_wrapper(release_quant()), "c").unwrap();
        let q = c.quantization.expect("quantized");
        assert_eq!(q.block, [128, 128]);
        assert_eq!(q.modules_to_not_convert.len(), 5);
        // transformers' rule: a prefix (here with a `*`) or a suffix of the module name.
        assert!(q.keeps_unquantized("lm_head"));
        assert!(q.keeps_unquantized("model.language_model.layers.3.mlp.gate"));
        assert!(q.keeps_unquantized("model.language_model.layers.12.linear_attn.in_proj_a"));
        assert!(!q.keeps_unquantized("model.language_model.layers.3.mlp.gate_proj"));
        assert!(!q.keeps_unquantized("model.language_model.layers.0.linear_attn.in_proj_qkv"));
        assert!(!q.keeps_unquantized("model.language_model.layers.0.mlp.experts.1.gate_proj"));
        // transformers' own defaults (no fmt, no activation scheme, no block size) are the
        // same format; a bf16 config has none.
        let c = TextConfig::from_json(&fp8_wrapper(json!({"quant_method": "fp8"})), "c").unwrap();
        assert_eq!(c.quantization, Some(Fp8Quant::block_128()));
        assert_eq!(
            TextConfig::from_json(&tiny(), "c").unwrap().quantization,
            None
        );
        // Flat text configs carry it at the top level too.
        let mut flat = tiny();
        flat["quantization_config"] = release_quant();
        assert!(
            TextConfig::from_json(&flat, "c")
                .unwrap()
                .quantization
                .is_some()
        );
    }

    #[test]
    fn rejects_every_fp8_variant_we_do_not_run_naming_the_field() {
        let cases: [(&str, Value, &str); 10] = [
            (
                "quant_method",
                json!("bitsandbytes"),
                "`quantization_config.quant_method` is \"bitsandbytes\"",
            ),
            (
                "fmt",
                json!("e5m2"),
                "`quantization_config.fmt` is \"e5m2\"",
            ),
            (
                "activation_scheme",
                json!("static"),
                "`quantization_config.activation_scheme` is \"static\"",
            ),
            (
                "weight_block_size",
                json!([64, 64]),
                "`quantization_config.weight_block_size` is [64, 64]",
            ),
            (
                "weight_block_size",
                json!([128]),
                "`quantization_config.weight_block_size` must be [128, 128]",
            ),
            ("weight_block_size", Value::Null, "per-tensor scales"),
            (
                "scale_fmt",
                json!("ue8m0"),
                "`quantization_config.scale_fmt` is \"ue8m0\"",
            ),
            (
                "modules_to_not_convert",
                json!("lm_head"),
                "`quantization_config.modules_to_not_convert` must be a list",
            ),
            (
                "modules_to_convert",
                json!(["embed_tokens"]),
                "FP8 embeddings",
            ),
            (
                "kv_cache_scheme",
                json!("fp8"),
                "`quantization_config.kv_cache_scheme` is not a field",
            ),
        ];
        for (key, value, needle) in cases {
            let mut q = release_quant();
            q[key] = value;
            let e = TextConfig::from_json(&fp8_wrapper(q), "cfg.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{key}: missing {needle:?} in:\n{e}");
        }
        // Every problem at once, alongside the architecture's.
        let mut j = fp8_wrapper(
            json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [64, 128]}),
        );
        j["text_config"]["num_key_value_heads"] = json!(3);
        let e = TextConfig::from_json(&j, "cfg.json").unwrap_err();
        assert_eq!(e.problems.len(), 3, "{e}");
        let e = TextConfig::from_json(&fp8_wrapper(json!("fp8")), "c").unwrap_err();
        assert!(
            e.to_string()
                .contains("`quantization_config` must be an object"),
            "{e}"
        );
        let e = TextConfig::from_json(&fp8_wrapper(json!({"fmt": "e4m3"})), "c").unwrap_err();
        assert!(
            e.to_string()
                .contains("`quantization_config.quant_method` is missing"),
            "{e}"
        );
    }

    #[test]
    fn parses_the_mlx_quantization_block_with_overrides() {
        let gate = "language_model.model.layers.0.mlp.gate";
        let block = json!({"group_size": 64, "bits": 4, "mode": "affine",
            gate: {"group_size": 64, "bits": 8},
            "language_model.model.layers.0.mlp.shared_expert_gate": {"group_size": 32, "bits": 8},
            "language_model.lm_head": false});
        let mut j = json!({"model_type": "qwen3_5_moe", "text_config": tiny()});
        j["quantization"] = block.clone();
        j["quantization_config"] = block;
        let c = TextConfig::from_json(&j, "c").unwrap();
        assert_eq!(c.quantization, None);
        let a = c.affine.unwrap();
        assert_eq!(
            (a.source.clone(), a.bits, a.group),
            (AffineSource::Mlx, 4, 64)
        );
        assert_eq!(a.for_module(gate), Some((8, 64)));
        assert_eq!(a.for_module("language_model.lm_head"), None);
        assert_eq!(
            a.for_module("language_model.model.layers.0.mlp.switch_mlp.up_proj"),
            Some((4, 64))
        );
        assert_eq!(
            a.describe(),
            "MLX affine 4-bit, group 64; 8-bit group 32: 1 modules; 8-bit group 64: 1 modules; unquantized: 1 modules"
        );
        // Every problem at once, each with its field.
        let mut j = json!({"model_type": "qwen3_5_moe", "text_config": tiny()});
        j["quantization"] =
            json!({"group_size": 16, "bits": 2, "mode": "nvfp4", gate: {"bits": 8}, "x": 3});
        let e = TextConfig::from_json(&j, "c").unwrap_err();
        let msg = e.to_string();
        for needle in [
            "`quantization.bits` is 2",
            "`quantization.group_size` is 16",
            "`quantization.mode` is \"nvfp4\"",
            &format!("`quantization.{gate}.group_size` is missing"),
            "`quantization.x` is 3",
        ] {
            assert!(msg.contains(needle), "missing {needle:?} in {msg}");
        }
        assert_eq!(e.problems.len(), 5, "{msg}");
    }

    #[test]
    fn parses_gptq_and_awq_quantization_configs() {
        let c = TextConfig::from_json(
            &fp8_wrapper(json!({"quant_method": "gptq", "bits": 4, "group_size": 128,
                "desc_act": false, "sym": true, "damp_percent": 0.01})),
            "c",
        )
        .unwrap();
        let a = c.affine.unwrap();
        assert_eq!(
            a.source,
            AffineSource::Gptq {
                zeros_offset: 1,
                desc_act: false
            }
        );
        assert_eq!((a.bits, a.group, a.sym), (4, 128, true));
        let c = TextConfig::from_json(
            &fp8_wrapper(json!({"quant_method": "gptq", "bits": 4, "group_size": 32,
                "desc_act": true, "sym": false, "checkpoint_format": "gptq_v2"})),
            "c",
        )
        .unwrap();
        assert_eq!(
            c.affine.unwrap().source,
            AffineSource::Gptq {
                zeros_offset: 0,
                desc_act: true
            }
        );
        let c = TextConfig::from_json(
            &fp8_wrapper(
                json!({"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                "zero_point": true, "version": "GEMM"}),
            ),
            "c",
        )
        .unwrap();
        let a = c.affine.unwrap();
        assert_eq!(
            (a.source, a.bits, a.group, a.sym),
            (AffineSource::Awq, 4, 128, false)
        );
        let e = TextConfig::from_json(&fp8_wrapper(json!({"quant_method": "awq", "bits": 4})), "c")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`quantization_config.group_size` is missing"),
            "{e}"
        );
    }

    #[test]
    fn full_size_counts_match_the_spec() {
        let c = TextConfig::qwen36_35b_a3b();
        let (total, active) = c.parameter_counts();
        assert_eq!(total, 34_660_610_688);
        assert_eq!(active, 2_946_429_568);
        assert_eq!(c.kv_bytes_per_token(2), 20_480);
        assert_eq!(c.gdn_state_bytes(), 64_389_120);
    }

    #[test]
    fn generation_config_eos_forms() {
        let g = GenerationConfig::from_json_str(
            r#"{"eos_token_id": [248046, 248044], "top_k": 20, "top_p": 0.95}"#,
        )
        .unwrap();
        assert_eq!(g.eos_token_ids, vec![248046, 248044]);
        assert_eq!(g.top_k, Some(20));
        assert_eq!((g.presence_penalty, g.frequency_penalty), (None, None));
        let g = GenerationConfig::from_json_str(
            r#"{"eos_token_id": 7, "presence_penalty": 1.5, "frequency_penalty": 0.5}"#,
        )
        .unwrap();
        assert_eq!(
            (g.presence_penalty, g.frequency_penalty),
            (Some(1.5), Some(0.5))
        );
        let g = GenerationConfig::from_json_str(r#"{"eos_token_id": 7}"#).unwrap();
        assert_eq!(g.eos_token_ids, vec![7]);
        assert!(GenerationConfig::from_json_str(r#"{"eos_token_id": "x"}"#).is_err());
    }
}
