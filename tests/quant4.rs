//! 4-bit checkpoints on the CPU backend.
//!
//! * MLX affine (`tests/fixtures/tiny-mlx-4bit`, converted by mlx-lm's own converter; the
//!   reference is mlx-lm: see `tests/fixtures/README.md` and `scripts/make_mlx_fixtures.py`).
//! * Every bad MLX checkpoint (scales of the wrong shape, a bit width the packing
//!   contradicts, a missing bias or scale, a truncated file) gives an error naming the file
//!   and the tensor.

use kestrel::model::{CpuModel, Engine, Logits};
use kestrel::ops::argmax;
use kestrel::tensor::DType;
use std::path::{Path, PathBuf};
mod common;
use common::{
    Reference, f32_tensor, id_tensor, mlx_fixtures, norm_rel_err, read_reference, rel_err,
};

/// Kestrel (f32 arithmetic) against mlx-lm with its float parameters cast to f32: the same
/// codes, scales and biases, so only rounding differs. Same bar as the HF fixtures.
const REL_TOL: f32 = 1e-3;

/// Prefill in chunks (all positions' logits), then decode teacher-forced on the reference's
/// ids; returns the prompt and decode logits and our greedy ids.
fn run(model: &CpuModel, r: &Reference, chunk: usize) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let mut state = model.new_state().unwrap();
    let mut prompt_logits = Vec::new();
    for piece in r.prompt_ids.chunks(chunk) {
        prompt_logits.extend(model.forward(&mut state, piece, Logits::All).unwrap());
    }
    let last = &prompt_logits[prompt_logits.len() - r.vocab..];
    let mut ids = vec![argmax(last).unwrap() as u32];
    let mut decode_logits = Vec::new();
    for i in 0..r.decode_ids.len() {
        let l = model
            .forward(&mut state, &[r.decode_ids[i]], Logits::Last)
            .unwrap();
        if i + 1 < r.decode_ids.len() {
            ids.push(argmax(&l).unwrap() as u32);
        }
        decode_logits.extend(l);
    }
    (prompt_logits, decode_logits, ids)
}

fn mlx_dir() -> PathBuf {
    mlx_fixtures().pop().unwrap()
}

#[test]
fn mlx_fixture_loads_as_stored_affine_4_bit_with_8_bit_gates() {
    let dir = mlx_dir();
    let model = CpuModel::load(&dir).unwrap();
    let w = &model.weights;
    assert_eq!(w.format(), "affine 4-bit group 64 + 8-bit group 64");
    assert!(w.is_affine());
    // Embedding and lm_head 4-bit, the router 8-bit, experts 4-bit views of the stack.
    assert_eq!(w.embed.dtype, DType::U4);
    assert_eq!(w.lm_head.dtype, DType::U4);
    let moe = &w.layers[0].moe;
    assert_eq!(moe.router.dtype, DType::U8);
    assert_eq!(moe.experts[1].gate.dtype, DType::U4);
    assert_eq!(moe.experts[1].gate.affine.as_ref().unwrap().group, 64);
    // Nothing was expanded: the codes are the mapped file's bytes.
    assert!(matches!(
        *moe.experts[1].gate.storage,
        kestrel::tensor::Storage::Mmap(_)
    ));
    // 4 bits an element for the embedding (256 x 128), 8 for the router (4 x 128).
    assert_eq!(w.embed.nbytes(), 256 * 128 / 2);
    assert_eq!(moe.router.nbytes(), 4 * 128);
}

/// mlx-lm in f32 on the same quantised weights: max |Δlogit| <= 1e-3 x max |logit|, every
/// greedy id identical (teacher-forced at each chunk size and free-running) over 64 steps.
/// Chunk 1 is the decode path, the whole prompt the widening GEMM.
#[test]
fn cpu_matches_mlx_lm_f32_on_the_mlx_fixture() {
    let dir = mlx_dir();
    let model = CpuModel::load(&dir).unwrap();
    let r = read_reference(&dir);
    assert!(r.decode_ids.len() >= 64);
    for chunk in [r.prompt_ids.len(), 7, 1] {
        let (p, d, ids) = run(&model, &r, chunk);
        let (pe, de) = (rel_err(&p, &r.prompt_logits), rel_err(&d, &r.decode_logits));
        println!("chunk {chunk}: prompt rel err {pe:.2e}, decode rel err {de:.2e}");
        assert!(pe <= REL_TOL, "chunk {chunk}: prompt {pe}");
        assert!(de <= REL_TOL, "chunk {chunk}: decode {de}");
        assert_eq!(ids, r.decode_ids, "chunk {chunk}");
    }
    let mut state = model.new_state().unwrap();
    let mut l = model
        .forward(&mut state, &r.prompt_ids, Logits::Last)
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..r.decode_ids.len() {
        let id = argmax(&l).unwrap() as u32;
        ids.push(id);
        l = model.forward(&mut state, &[id], Logits::Last).unwrap();
    }
    assert_eq!(ids, r.decode_ids, "free-running greedy");
}

fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::MIN, f32::MIN);
    for &x in row {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// mlx-lm as Lily runs it (bf16 scales, so bf16 activations), teacher-forced on the same
/// ids. Kestrel computes in f32, so it is as far from this as mlx-lm's own f32 run is (on
/// this random tiny model bf16 rounding moves the logits by about 6.6%, L2 relative): we
/// require at most 1.05 x that distance, and wherever mlx-lm's top-2 margin is at least
/// BF16_CONFIDENT its greedy token is ours, on at least 32 of the 64 rows.
#[test]
fn cpu_matches_mlx_lm_bf16_where_mlx_is_confident() {
    const BF16_CONFIDENT: f32 = 0.5;
    let dir = mlx_dir();
    let model = CpuModel::load(&dir).unwrap();
    let r = read_reference(&dir);
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let bf_prompt = f32_tensor(&st, "bf16_prompt_logits");
    let bf_decode = f32_tensor(&st, "bf16_decode_logits");
    let bf_ids = id_tensor(&st, "bf16_decode_ids");
    let (p, d, _) = run(&model, &r, r.prompt_ids.len());
    let (pe, de) = (norm_rel_err(&p, &bf_prompt), norm_rel_err(&d, &bf_decode));
    let (mp, md) = (
        norm_rel_err(&r.prompt_logits, &bf_prompt),
        norm_rel_err(&r.decode_logits, &bf_decode),
    );
    println!(
        "vs mlx-lm bf16: prompt L2 rel err {pe:.3e} (mlx-lm f32: {mp:.3e}), decode {de:.3e} ({md:.3e})"
    );
    assert!(pe <= 1.05 * mp && de <= 1.05 * md, "{pe} {de}");
    // Row k predicts bf16_decode_ids[k]: the prompt's last row, then decode rows 0..N-1.
    let v = r.vocab;
    let rows: Vec<&[f32]> = std::iter::once(&bf_prompt[bf_prompt.len() - v..])
        .chain(bf_decode.chunks_exact(v))
        .collect();
    let ours: Vec<&[f32]> = std::iter::once(&p[p.len() - v..])
        .chain(d.chunks_exact(v))
        .collect();
    let mut compared = 0;
    for (k, (theirs, mine)) in rows.iter().zip(&ours).enumerate().take(bf_ids.len()) {
        if top2_margin(theirs) >= BF16_CONFIDENT {
            compared += 1;
            assert_eq!(argmax(theirs).unwrap() as u32, bf_ids[k], "row {k}");
            assert_eq!(argmax(mine).unwrap() as u32, bf_ids[k], "row {k}");
        }
    }
    println!("{compared} confident rows compared");
    assert!(compared >= 32, "only {compared} confident rows");
}

/// The comparison sees the MLX specifics: reading the norms without undoing mlx-lm's +1,
/// ignoring the group biases, or a nibble order swapped within each byte all fail the bar
/// by far.
#[test]
fn mlx_fixture_needs_each_format_detail() {
    use kestrel::tensor::Storage;
    use kestrel::weights::Mixer;
    let dir = mlx_dir();
    let r = read_reference(&dir);
    type Mutation = fn(&mut kestrel::weights::ModelWeights);
    let mutations: [(&str, Mutation); 3] = [
        ("norms keep mlx-lm's +1", |w| {
            for l in &mut w.layers {
                l.input_norm.iter_mut().for_each(|x| *x += 1.0);
                l.post_attention_norm.iter_mut().for_each(|x| *x += 1.0);
            }
        }),
        ("group biases ignored in o_proj", |w| {
            for l in &mut w.layers {
                if let Mixer::Attention(a) = &mut l.mixer {
                    let af = a.o.affine.as_mut().unwrap();
                    let n = af.biases.rows * af.biases.cols;
                    af.biases = kestrel::tensor::Mat::from_f32(
                        &vec![0.0; n],
                        af.biases.rows,
                        af.biases.cols,
                        DType::BF16,
                    );
                }
            }
        }),
        ("high nibble first in the embedding", |w| {
            let swapped: Vec<u8> = w.embed.bytes().iter().map(|b| b.rotate_left(4)).collect();
            w.embed.storage = std::sync::Arc::new(Storage::Owned(swapped));
            w.embed.offset = 0;
        }),
    ];
    for (what, mutate) in mutations {
        let mut model = CpuModel::load(&dir).unwrap();
        mutate(&mut model.weights);
        let logits = model
            .forward(&mut model.new_state().unwrap(), &r.prompt_ids, Logits::All)
            .unwrap();
        let e = rel_err(&logits, &r.prompt_logits);
        assert!(e > 10.0 * REL_TOL, "{what}: error {e} would pass");
    }
}

// ---------------------------------------------------------------------------------------
// Bad MLX checkpoints: a copy of the fixture with one thing changed.

struct Tensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// A copy of the MLX fixture where `edit` may change, add or remove tensors (the index is
/// kept in step) and `edit_cfg` the config.
fn edited_copy(
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, Tensor>),
    edit_cfg: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    edited_copy_of(&mlx_dir(), edit, edit_cfg)
}

/// A copy of a one-file fixture `src`, edited as [`edited_copy`].
fn edited_copy_of(
    src: &Path,
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, Tensor>),
    edit_cfg: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: std::collections::BTreeMap<String, Tensor> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                Tensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                },
            )
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = tensors
        .keys()
        .map(|k| (k.clone(), serde_json::json!("model.safetensors")))
        .collect();
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit_cfg(&mut cfg);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    tmp
}

fn load_err(dir: &Path) -> String {
    match CpuModel::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn assert_names(e: &str, needles: &[&str]) {
    for n in needles {
        assert!(e.contains(n), "missing {n:?} in:\n{e}");
    }
}

const QKV: &str = "language_model.model.layers.0.linear_attn.in_proj_qkv";
const GATE: &str = "language_model.model.layers.0.mlp.gate";

#[test]
fn an_unedited_copy_loads() {
    let t = edited_copy(|_| {}, |_| {});
    CpuModel::load(t.path()).unwrap();
}

#[test]
fn mlx_scales_of_the_wrong_shape_are_named() {
    let t = edited_copy(
        |m| {
            let s = m.get_mut(&format!("{QKV}.scales")).unwrap();
            // [512, 2] -> [512, 1]: one scale a row where the config's group 64 needs two.
            s.shape = vec![512, 1];
            s.data.truncate(512 * 2);
        },
        |_| {},
    );
    let e = load_err(t.path());
    assert_names(
        &e,
        &[
            &format!("`{QKV}.scales`"),
            "model.safetensors",
            "[512, 1]",
            "expected [512, 2]",
            "group_size",
        ],
    );
}

#[test]
fn mlx_bit_width_the_packing_contradicts_is_named() {
    // The router is stored 8-bit; a config that says 4 contradicts its packed width.
    let t = edited_copy(
        |_| {},
        |c| {
            c["quantization"][GATE]["bits"] = serde_json::json!(4);
            c["quantization_config"][GATE]["bits"] = serde_json::json!(4);
        },
    );
    let e = load_err(t.path());
    assert_names(
        &e,
        &[
            &format!("`{GATE}.weight`"),
            "model.safetensors",
            "[4, 32]",
            "packing of 8-bit codes",
            &format!("`quantization.{GATE}.bits` is 4"),
        ],
    );
    // Without the override the default (4-bit) contradicts it too.
    let t = edited_copy(
        |_| {},
        |c| {
            for k in ["quantization", "quantization_config"] {
                c[k].as_object_mut().unwrap().remove(GATE);
            }
        },
    );
    let e = load_err(t.path());
    assert_names(
        &e,
        &[&format!("`{GATE}.weight`"), "`quantization.bits` is 4"],
    );
}

#[test]
fn mlx_missing_bias_or_scales_are_named() {
    let t = edited_copy(
        |m| {
            m.remove(&format!("{QKV}.biases"));
        },
        |_| {},
    );
    let e = load_err(t.path());
    assert_names(
        &e,
        &[
            &format!("`{QKV}.weight`"),
            "model.safetensors",
            &format!("`{QKV}.biases` is missing"),
        ],
    );
    let t = edited_copy(
        |m| {
            m.remove(&format!("{QKV}.scales"));
            m.remove(&format!("{QKV}.biases"));
        },
        |_| {},
    );
    let e = load_err(t.path());
    assert_names(
        &e,
        &[
            &format!("`{QKV}.weight`"),
            "is U32 (packed codes)",
            "scales",
        ],
    );
}

#[test]
fn mlx_codes_of_the_wrong_dtype_are_named() {
    let t = edited_copy(
        |m| {
            m.get_mut(&format!("{QKV}.weight")).unwrap().dtype = safetensors::Dtype::F32;
        },
        |_| {},
    );
    let e = load_err(t.path());
    assert_names(&e, &[&format!("`{QKV}.weight`"), "F32", "U32"]);
}

#[test]
fn mlx_truncated_file_is_named() {
    let t = edited_copy(|_| {}, |_| {});
    let f = t.path().join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.set_len(len - 1000).unwrap();
    let e = load_err(t.path());
    assert_names(&e, &["model.safetensors", "truncated"]);
}

#[test]
fn mlx_config_problems_name_the_field() {
    for (edit, needle) in [
        (serde_json::json!({"bits": 3}), "`quantization.bits` is 3"),
        (
            serde_json::json!({"group_size": 48}),
            "`quantization.group_size` is 48",
        ),
        (
            serde_json::json!({"mode": "mxfp4"}),
            "`quantization.mode` is \"mxfp4\"",
        ),
    ] {
        let t = edited_copy(
            |_| {},
            |c| {
                for k in ["quantization", "quantization_config"] {
                    for (f, v) in edit.as_object().unwrap() {
                        c[k][f] = v.clone();
                    }
                }
            },
        );
        let e = load_err(t.path());
        assert_names(&e, &[needle, "config.json"]);
    }
    let t = edited_copy(
        |_| {},
        |c| c["quantization_config"]["bits"] = serde_json::json!(8),
    );
    assert_names(
        &load_err(t.path()),
        &["differs from the MLX `quantization` block"],
    );
}

// ---------------------------------------------------------------------------------------
// GPTQ and AWQ (`tests/fixtures/tiny-gptq`, `tiny-awq`, packed from the formats' definitions
// by `scripts/make_gptq_awq_fixtures.py`), repacked into the affine form at load.

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn raw_tensors(dir: &Path) -> std::collections::BTreeMap<String, Tensor> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                Tensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                },
            )
        })
        .collect()
}

fn words(t: &Tensor) -> Vec<u32> {
    assert_eq!(t.dtype, safetensors::Dtype::I32);
    t.data
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f16s(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.dtype, safetensors::Dtype::F16);
    t.data
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Fmt {
    Gptq,
    Awq,
    /// AWQ's words read without its interleave (to show the fixture depends on it).
    AwqPlainOrder,
    /// compressed-tensors pack-quantized.
    Ct,
}

fn bf16s(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.dtype, safetensors::Dtype::BF16);
    t.data
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect()
}

/// A compressed-tensors module's weight `[out, in]` by the format's definition: signed
/// codes `u - 8` minus signed zero points `uz - 8` (8 - 8 = 0 when there are none), times
/// the scale.
fn spec_dequant_ct(
    t: &std::collections::BTreeMap<String, Tensor>,
    module: &str,
    group: usize,
) -> (usize, usize, Vec<f32>) {
    let wp = &t[&format!("{module}.weight_packed")];
    let (out, inp) = (wp.shape[0], wp.shape[1] * 8);
    let groups = inp / group;
    let w = words(wp);
    let s = bf16s(&t[&format!("{module}.weight_scale")]);
    let zp = t.get(&format!("{module}.weight_zero_point")).map(words);
    let mut r = vec![0.0f32; out * inp];
    for o in 0..out {
        for i in 0..inp {
            let g = i / group;
            let q = ((w[o * (inp / 8) + i / 8] >> (4 * (i % 8))) & 15) as i32 - 8;
            let z = zp.as_ref().map_or(0, |z| {
                ((z[(o / 8) * groups + g] >> (4 * (o % 8))) & 15) as i32 - 8
            });
            r[o * inp + i] = s[o * groups + g] * (q - z) as f32;
        }
    }
    (out, inp, r)
}

/// `module`'s weight `[out, in]` by the format's definition, element by element.
fn spec_dequant(
    t: &std::collections::BTreeMap<String, Tensor>,
    module: &str,
    fmt: Fmt,
    group: usize,
) -> (usize, usize, Vec<f32>) {
    if fmt == Fmt::Ct {
        return spec_dequant_ct(t, module, group);
    }
    let qw = &t[&format!("{module}.qweight")];
    let (qwv, zv) = (words(qw), words(&t[&format!("{module}.qzeros")]));
    let s = f16s(&t[&format!("{module}.scales")]);
    let (out, inp) = if fmt == Fmt::Gptq {
        (qw.shape[1], qw.shape[0] * 8)
    } else {
        (qw.shape[1] * 8, qw.shape[0])
    };
    let g_idx = t.get(&format!("{module}.g_idx")).map(words);
    const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
    // AWQ: the nibble that holds column 8c + j is the p with ORDER[p] == j.
    let nib = |j: usize| match fmt {
        Fmt::Awq => ORDER.iter().position(|x| *x == j).unwrap(),
        _ => j,
    };
    let mut w = vec![0.0f32; out * inp];
    for o in 0..out {
        for i in 0..inp {
            let g = g_idx.as_ref().map_or(i / group, |x| x[i] as usize);
            let (q, z) = match fmt {
                Fmt::Gptq => (
                    (qwv[(i / 8) * out + o] >> (4 * (i % 8))) & 15,
                    ((zv[g * (out / 8) + o / 8] >> (4 * (o % 8))) & 15) + 1,
                ),
                _ => (
                    (qwv[i * (out / 8) + o / 8] >> (4 * nib(o % 8))) & 15,
                    (zv[g * (out / 8) + o / 8] >> (4 * nib(o % 8))) & 15,
                ),
            };
            w[o * inp + i] = s[g * out + o] * (q as f32 - z as f32);
        }
    }
    (out, inp, w)
}

/// The loaded matrix of a stored module name (`model.language_model.layers.3.self_attn.o_proj`).
fn mat_of<'a>(w: &'a kestrel::weights::ModelWeights, module: &str) -> &'a kestrel::tensor::Mat {
    use kestrel::weights::Mixer;
    let rest = module.strip_prefix("model.language_model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let l = &w.layers[layer.parse::<usize>().unwrap()];
    let parts: Vec<&str> = rest.split('.').collect();
    let pick = |e: &'a kestrel::weights::ExpertWeights, p: &str| match p {
        "gate_proj" => &e.gate,
        "up_proj" => &e.up,
        "down_proj" => &e.down,
        _ => panic!("{module}"),
    };
    match (&l.mixer, parts.as_slice()) {
        (_, ["mlp", "experts", e, p]) => pick(&l.moe.experts[e.parse::<usize>().unwrap()], p),
        (_, ["mlp", "shared_expert", p]) => pick(&l.moe.shared, p),
        (Mixer::Attention(a), ["self_attn", p]) => match *p {
            "q_proj" => &a.q,
            "k_proj" => &a.k,
            "v_proj" => &a.v,
            "o_proj" => &a.o,
            _ => panic!("{module}"),
        },
        (Mixer::Gdn(g), ["linear_attn", p]) => match *p {
            "in_proj_qkv" => &g.in_qkv,
            "in_proj_z" => &g.in_z,
            "out_proj" => &g.out,
            _ => panic!("{module}"),
        },
        _ => panic!("{module}"),
    }
}

fn quantised_modules(dir: &Path) -> (Vec<String>, serde_json::Value) {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let list = j["quantised"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect();
    (list, j["dequantised_samples"].clone())
}

/// Every quantised matrix of the three fixtures, as loaded (repacked to the affine form),
/// equals its dequantisation by the format's definition (computed here element by element
/// from the stored words) to f32 rounding, and the script's own float64 dequantisation at
/// 16 samples a matrix. Reading AWQ without its interleaved order gives other values.
#[test]
fn gptq_and_awq_load_to_their_definitions() {
    for (name, fmt, group, format) in [
        ("tiny-gptq", Fmt::Gptq, 128, "affine 4-bit group 128 + bf16"),
        ("tiny-awq", Fmt::Awq, 32, "affine 4-bit group 32 + bf16"),
        ("tiny-ct", Fmt::Ct, 64, "affine 4-bit group 64 + bf16"),
    ] {
        let dir = fixture(name);
        let model = CpuModel::load(&dir).unwrap();
        assert_eq!(model.weights.format(), format, "{name}");
        let raw = raw_tensors(&dir);
        let (modules, samples) = quantised_modules(&dir);
        assert!(modules.len() >= 60, "{name}: {}", modules.len());
        for m in &modules {
            let mat = mat_of(&model.weights, m);
            assert_eq!(mat.dtype, DType::U4, "{m}");
            let got = mat.to_f32();
            let (out, inp, want) = spec_dequant(&raw, m, fmt, group);
            assert_eq!((mat.rows, mat.cols), (out, inp), "{m}");
            let scale = want.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            let err = rel_err(&got, &want);
            assert!(err <= 1e-6, "{name} {m}: {err} (max |w| {scale})");
            for s in samples[m].as_array().unwrap() {
                let (r, c, v) = (
                    s[0].as_u64().unwrap() as usize,
                    s[1].as_u64().unwrap() as usize,
                    s[2].as_f64().unwrap() as f32,
                );
                assert!(
                    (got[r * inp + c] - v).abs() <= 1e-6 * v.abs().max(1e-3),
                    "{name} {m} [{r}, {c}]: {} vs {v}",
                    got[r * inp + c]
                );
            }
            if fmt == Fmt::Awq {
                let (_, _, plain) = spec_dequant(&raw, m, Fmt::AwqPlainOrder, group);
                assert!(
                    rel_err(&plain, &want) > 0.1,
                    "{m}: the order is not exercised"
                );
            }
        }
    }
}

/// The whole model on the repacked GPTQ / AWQ weights equals the model on their
/// dequantisation stored f32: prefill logits and 64 teacher-forced and free-running greedy
/// steps (chunks 1 and the whole prompt, so both GEMM paths read the 4-bit matrices).
#[test]
fn gptq_and_awq_models_equal_their_dequantised_models() {
    use kestrel::tensor::Mat;
    for name in ["tiny-gptq", "tiny-awq", "tiny-ct"] {
        let dir = fixture(name);
        let quant = CpuModel::load(&dir).unwrap();
        let mut deq = CpuModel::load(&dir).unwrap();
        let f = |m: &mut Mat| {
            if m.affine.is_some() {
                *m = Mat::from_f32(&m.to_f32(), m.rows, m.cols, DType::F32);
            }
        };
        for l in &mut deq.weights.layers {
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
        assert!(!deq.weights.is_affine() && quant.weights.is_affine());
        let mut lcg = common::Lcg(7);
        let prompt: Vec<u32> = (0..40)
            .map(|_| ((lcg.next() + 1.0) * 128.0) as u32 % 256)
            .collect();
        let greedy = |m: &CpuModel, chunk: usize| {
            let mut st = m.new_state().unwrap();
            let mut all = Vec::new();
            for p in prompt.chunks(chunk) {
                all.extend(m.forward(&mut st, p, Logits::All).unwrap());
            }
            let mut ids = vec![argmax(&all[all.len() - 256..]).unwrap() as u32];
            for _ in 0..64 {
                let l = m
                    .forward(&mut st, &[*ids.last().unwrap()], Logits::Last)
                    .unwrap();
                ids.push(argmax(&l).unwrap() as u32);
                all.extend(l);
            }
            (all, ids)
        };
        let (want, want_ids) = greedy(&deq, prompt.len());
        for chunk in [prompt.len(), 1] {
            let (got, ids) = greedy(&quant, chunk);
            let e = rel_err(&got, &want);
            println!("{name} chunk {chunk}: rel err {e:.2e}");
            assert!(e <= 1e-5, "{name} chunk {chunk}: {e}");
            assert_eq!(ids, want_ids, "{name} chunk {chunk}");
        }
    }
}

const GPTQ_O: &str = "model.language_model.layers.3.self_attn.o_proj";

/// GPTQ act-order: a `g_idx` that maps columns to groups out of order is honoured (o_proj
/// has 512 inputs, 4 groups of 128).
#[test]
fn gptq_act_order_g_idx_is_honoured() {
    let t = edited_copy_of(
        &fixture("tiny-gptq"),
        |m| {
            let g = m.get_mut(&format!("{GPTQ_O}.g_idx")).unwrap();
            g.data = (0..512u32)
                .flat_map(|i| ((i * 7 + i / 3) % 4).to_le_bytes())
                .collect();
        },
        |c| c["quantization_config"]["desc_act"] = serde_json::json!(true),
    );
    let model = CpuModel::load(t.path()).unwrap();
    let raw = raw_tensors(t.path());
    let (_, _, want) = spec_dequant(&raw, GPTQ_O, Fmt::Gptq, 128);
    let got = mat_of(&model.weights, GPTQ_O).to_f32();
    assert!(rel_err(&got, &want) <= 1e-6);
    let plain = mat_of(
        &CpuModel::load(&fixture("tiny-gptq")).unwrap().weights,
        GPTQ_O,
    )
    .to_f32();
    assert!(
        rel_err(&plain, &want) > 0.01,
        "the edited g_idx changed nothing"
    );
}

#[test]
fn gptq_awq_bad_tensors_are_named() {
    let gptq = fixture("tiny-gptq");
    let e = load_err(
        edited_copy_of(
            &gptq,
            |m| {
                m.remove(&format!("{GPTQ_O}.qzeros"));
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[
            &format!("`{GPTQ_O}.qweight`"),
            "model.safetensors",
            &format!("`{GPTQ_O}.qzeros` is missing"),
        ],
    );
    let e = load_err(
        edited_copy_of(
            &gptq,
            |m| {
                let s = m.get_mut(&format!("{GPTQ_O}.scales")).unwrap();
                s.shape = vec![2, 128];
                s.data.truncate(2 * 128 * 2);
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[
            &format!("`{GPTQ_O}.scales`"),
            "[2, 128]",
            "expected [4, 128]",
        ],
    );
    // A config whose group size the stored tensors contradict.
    let e = load_err(
        edited_copy_of(
            &gptq,
            |_| {},
            |c| c["quantization_config"]["group_size"] = serde_json::json!(64),
        )
        .path(),
    );
    assert_names(
        &e,
        &["qzeros", "expected [2, 16]", "group 64", "group_size"],
    );
    let e = load_err(
        edited_copy_of(
            &gptq,
            |m| {
                let g = m.get_mut(&format!("{GPTQ_O}.g_idx")).unwrap();
                g.data[..4].copy_from_slice(&9u32.to_le_bytes());
            },
            |_| {},
        )
        .path(),
    );
    assert_names(&e, &[&format!("`{GPTQ_O}.g_idx`"), "group 9", "4 groups"]);
    let e = load_err(
        edited_copy_of(
            &gptq,
            |m| {
                m.remove(&format!("{GPTQ_O}.qweight"));
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[&format!("`{GPTQ_O}.qzeros`"), "without its `qweight`"],
    );
    let awq = fixture("tiny-awq");
    let q = "model.language_model.layers.0.linear_attn.in_proj_z";
    let e = load_err(
        edited_copy_of(
            &awq,
            |m| {
                let w = m.get_mut(&format!("{q}.qweight")).unwrap();
                w.shape = vec![64, 64];
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[
            &format!("`{q}.qweight`"),
            "[64, 64]",
            "AWQ qweight [in, out/8]",
            "expected [128, 32]",
        ],
    );
}

const CT_Q: &str = "model.language_model.layers.3.self_attn.q_proj";

#[test]
fn compressed_tensors_bad_tensors_are_named_and_symmetric_reads() {
    let ct = fixture("tiny-ct");
    // The codes and scales stay mapped (Kestrel's own layout).
    let model = CpuModel::load(&ct).unwrap();
    let q = mat_of(&model.weights, CT_Q);
    assert!(matches!(*q.storage, kestrel::tensor::Storage::Mmap(_)));
    let e = load_err(
        edited_copy_of(
            &ct,
            |m| {
                m.remove(&format!("{CT_Q}.weight_zero_point"));
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[
            &format!("`{CT_Q}.weight_packed`"),
            "model.safetensors",
            &format!("`{CT_Q}.weight_zero_point` is missing"),
        ],
    );
    let e = load_err(
        edited_copy_of(
            &ct,
            |m| {
                let s = m.get_mut(&format!("{CT_Q}.weight_shape")).unwrap();
                s.data = [1024i32, 64].iter().flat_map(|x| x.to_le_bytes()).collect();
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[
            &format!("`{CT_Q}.weight_shape`"),
            "[1024, 64]",
            "[1024, 128]",
        ],
    );
    let e = load_err(
        edited_copy_of(
            &ct,
            |m| {
                let s = m.get_mut(&format!("{CT_Q}.weight_scale")).unwrap();
                s.shape = vec![1024, 1];
                s.data.truncate(1024 * 2);
            },
            |_| {},
        )
        .path(),
    );
    assert_names(
        &e,
        &[
            &format!("`{CT_Q}.weight_scale`"),
            "[1024, 1]",
            "expected [1024, 2]",
        ],
    );
    // Symmetric: no zero points, codes centred on 8. Dropping every zero point and saying
    // symmetric gives exactly s * (u - 8).
    let t = edited_copy_of(
        &ct,
        |m| m.retain(|k, _| !k.ends_with(".weight_zero_point")),
        |c| {
            c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] =
                serde_json::json!(true)
        },
    );
    let model = CpuModel::load(t.path()).unwrap();
    let raw = raw_tensors(t.path());
    let (_, _, want) = spec_dequant(&raw, CT_Q, Fmt::Ct, 64);
    assert!(rel_err(&mat_of(&model.weights, CT_Q).to_f32(), &want) <= 1e-6);
}

#[test]
fn gptq_awq_config_problems_name_the_field() {
    for (dir, key, value, needle) in [
        (
            "tiny-gptq",
            "bits",
            serde_json::json!(8),
            "`quantization_config.bits` is 8",
        ),
        (
            "tiny-gptq",
            "group_size",
            serde_json::json!(-1),
            "`quantization_config.group_size` must be a positive integer",
        ),
        (
            "tiny-gptq",
            "checkpoint_format",
            serde_json::json!("marlin"),
            "`quantization_config.checkpoint_format` is \"marlin\"",
        ),
        (
            "tiny-gptq",
            "dynamic",
            serde_json::json!({"-:.*mlp.*": {}}),
            "`quantization_config.dynamic`",
        ),
        (
            "tiny-awq",
            "version",
            serde_json::json!("gemv"),
            "`quantization_config.version` is \"gemv\"",
        ),
        (
            "tiny-awq",
            "zero_point",
            serde_json::json!("yes"),
            "`quantization_config.zero_point` must be true or false",
        ),
    ] {
        let t = edited_copy_of(
            &fixture(dir),
            |_| {},
            |c| c["quantization_config"][key] = value.clone(),
        );
        assert_names(&load_err(t.path()), &[needle, "config.json"]);
    }
}
