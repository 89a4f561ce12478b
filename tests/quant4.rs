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
