//! The CUDA backend against the CPU reference and the Hugging Face fixtures. Skips (with the
//! reason printed) where no usable GPU exists, e.g. in CI; run on the H200 by
//! `scripts/gpu_check.sh`.
//!
//! Precision chain: the CPU reference matches transformers (f32) to ~1e-5 on the HF fixtures
//! (`tests/hf_reference.rs`). The GPU keeps weights in bf16, feeds bf16 into every GEMM and
//! into attention (q, K/V cache, probabilities), with f32 accumulation, residual and GDN state.
//! The tiny random fixtures are very sensitive to that rounding (the CPU reference itself moves
//! by 0.12-0.20 of the logit scale when run at bf16), so the GPU is compared with the CPU
//! reference run at the GPU's precision (`round_to_bf16` + `bf16_activations`):
//! ‖Δ‖/‖ref‖ <= 3e-2 over the logits and max |Δlogit| <= 1e-1 x max |logit| (what remains is
//! f32 summation order and the router's near-ties in these tiny random models: one flipped
//! expert moves a row by a few percent; a wrong op moves it by 20% or more), and identical
//! greedy choices wherever the reference's top-2 margin exceeds 5% of the logit scale. Against transformers at full width (healthy
//! scale) see `fullwidth_checkpoint_matches_hf`.

use kestrel::cuda::attention::{Flash, FlashCall, QPrep};
use kestrel::cuda::gdn::{ConvRows, DeltaBufs, GdnShape};
use kestrel::cuda::gemm::GemmPath;
use kestrel::cuda::model::CudaModel;
use kestrel::cuda::moe::{self, Grouped, MoeGemm, MoePlan};
use kestrel::cuda::{Arg, Gpu};
use kestrel::model::{CpuModel, Engine, Logits};
use kestrel::ops::argmax;
mod common;
use common::{f32_tensor, fixtures, id_tensor, norm_rel_err, read_reference, rel_err};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const REL_TOL: f32 = 1e-1;
const NORM_TOL: f64 = 3e-2;

fn gpu() -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        // Only a missing GPU/driver skips; a kernel or cuBLAS failure on a GPU machine fails.
        Err(e) if e.to_string().starts_with("CUDA is not available") => {
            println!("SKIPPED: no usable GPU: {e:#}");
            None
        }
        Err(e) => panic!("GPU present but unusable: {e:#}"),
    }
}

/// The GPU model of a fixture and the CPU reference at the GPU's precision.
fn load(gpu: &Arc<Gpu>, dir: &Path, max_chunk: usize) -> (CpuModel, CudaModel) {
    let mut cpu = CpuModel::load(dir).unwrap();
    cpu.weights.round_to_bf16();
    cpu.bf16_activations = true;
    let cuda = CudaModel::from_weights(
        gpu.clone(),
        cpu.config.clone(),
        &cpu.weights,
        512,
        max_chunk,
    )
    .unwrap();
    (cpu, cuda)
}

/// Top-1 minus top-2.
fn margin(x: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in x {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

#[test]
fn cuda_matches_reference_prefill_decode_and_greedy() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let (cpu, cuda) = load(&gpu, &dir, 256);
        let r = read_reference(&dir);
        let vocab = cuda.config.vocab_size;
        let (mut gs, mut cs) = (cuda.new_state(), cpu.new_state());
        let g = cuda.forward(&mut gs, &r.prompt_ids, Logits::All).unwrap();
        let c = cpu.forward(&mut cs, &r.prompt_ids, Logits::All).unwrap();
        let pe = rel_err(&g, &c);
        let pn = norm_rel_err(&g, &c);
        let hf = rel_err(&g, &r.prompt_logits);
        // 64 decode steps, teacher-forced with the reference's greedy tokens.
        let mut tok = argmax(&c[c.len() - vocab..]).unwrap() as u32;
        let (mut worst, mut compared) = (0.0f32, 0);
        let (mut all_g, mut all_c) = (Vec::new(), Vec::new());
        let scale = c.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(r.decode_ids.len() >= 32);
        for step in 0..r.decode_ids.len() {
            let gl = cuda.forward(&mut gs, &[tok], Logits::Last).unwrap();
            let cl = cpu.forward(&mut cs, &[tok], Logits::Last).unwrap();
            worst = worst.max(rel_err(&gl, &cl));
            all_g.extend_from_slice(&gl);
            all_c.extend_from_slice(&cl);
            let want = argmax(&cl).unwrap();
            if margin(&cl) > 0.05 * scale {
                compared += 1;
                assert_eq!(
                    argmax(&gl).unwrap(),
                    want,
                    "{}: greedy step {step}",
                    dir.display()
                );
            }
            tok = want as u32;
        }
        let dn = norm_rel_err(&all_g, &all_c);
        println!(
            "{}: vs CPU@bf16 prompt max {pe:.2e} norm {pn:.2e}, decode max {worst:.2e} norm {dn:.2e}; greedy equal on {compared} confident steps; (vs HF f32 prompt {hf:.2e})",
            dir.display()
        );
        assert!(
            pn <= NORM_TOL && dn <= NORM_TOL,
            "{}: norm {pn} {dn}",
            dir.display()
        );
        assert!(pe <= REL_TOL, "{}: prompt {pe}", dir.display());
        assert!(worst <= REL_TOL, "{}: decode {worst}", dir.display());
        // The confident steps are the CPU reference's own margins: 33 on tiny-official-bf16
        // until the routed experts' outputs became bf16 on both sides, 31 since (the reference's
        // logits moved, not the GPU's agreement with them).
        assert!(
            compared >= 30,
            "{}: only {compared} confident steps",
            dir.display()
        );
    }
}

#[test]
fn cuda_chunked_prefill_equals_one_shot_and_token_by_token() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let r = read_reference(&dir);
        let reference = {
            let (cpu, _) = load(&gpu, &dir, 64);
            cpu.forward(&mut cpu.new_state(), &r.prompt_ids, Logits::All)
                .unwrap()
        };
        // max_chunk 7 forces the model's own chunking; explicit calls of 1 and 64 tokens too.
        for (max_chunk, call) in [(256, 1), (7, 256), (256, 64), (256, 7)] {
            let (_cpu, cuda) = load(&gpu, &dir, max_chunk);
            let mut st = cuda.new_state();
            let mut all = Vec::new();
            for piece in r.prompt_ids.chunks(call) {
                all.extend(cuda.forward(&mut st, piece, Logits::All).unwrap());
            }
            let e = rel_err(&all, &reference);
            println!(
                "{} max_chunk {max_chunk} calls of {call}: {e:.2e}",
                dir.display()
            );
            assert!(
                e <= REL_TOL,
                "{} chunk {max_chunk}/{call}: {e}",
                dir.display()
            );
        }
    }
}

#[test]
fn cuda_matches_cpu_and_snapshots_restore() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let (cpu, cuda) = load(&gpu, &dir, 256);
        let r = read_reference(&dir);
        let half = r.prompt_ids.len() / 2;
        let mut st = cuda.new_state();
        cuda.forward(&mut st, &r.prompt_ids[..half], Logits::Last)
            .unwrap();
        let snap = st.clone();
        let rest = &r.prompt_ids[half..];
        let a = cuda.forward(&mut st, rest, Logits::All).unwrap();
        cuda.forward(&mut st, &[1, 2, 3], Logits::Last).unwrap();
        let mut st = snap.clone();
        let b = cuda.forward(&mut st, rest, Logits::All).unwrap();
        assert_eq!(a, b, "{}: restored snapshot diverged", dir.display());
        // The snapshot holds its KV only as far as it is filled; a copy of it grows on its
        // first forward, and decode steps (the captured graph) from it equal a fresh state's.
        assert!(
            cuda.state_bytes(&snap) < cuda.state_bytes(&cuda.new_state()),
            "{}: a snapshot keeps the whole KV room",
            dir.display()
        );
        let mut fresh = cuda.new_state();
        cuda.forward(&mut fresh, &r.prompt_ids[..half], Logits::Last)
            .unwrap();
        let mut resumed = snap.clone();
        for s in [&mut fresh, &mut resumed] {
            cuda.forward(s, rest, Logits::Last).unwrap();
        }
        for tok in [5u32, 6, 7] {
            let x = cuda.forward(&mut fresh, &[tok], Logits::Last).unwrap();
            let y = cuda.forward(&mut resumed, &[tok], Logits::Last).unwrap();
            assert_eq!(x, y, "{}: decode after a restored snapshot", dir.display());
        }
        let mut cs = cpu.new_state();
        let c = cpu.forward(&mut cs, &r.prompt_ids, Logits::All).unwrap();
        let e = rel_err(&b, &c[half * cpu.config.vocab_size..]);
        assert!(e <= REL_TOL, "{}: vs CPU {e}", dir.display());
        // Device-side greedy agrees with host argmax.
        let mut s1 = cuda.new_state();
        let next = cuda
            .forward_greedy(&mut s1, &r.prompt_ids, cuda.config.vocab_size)
            .unwrap();
        assert_eq!(next, r.decode_ids[0]);
        let _ = &r.decode_logits;
    }
}

#[test]
fn cuda_rejects_bad_tokens_and_overflow() {
    let Some(gpu) = gpu() else { return };
    let cfg = kestrel::synthetic::demo_config();
    let w = kestrel::synthetic::random_weights(&cfg, 3, kestrel::tensor::DType::BF16);
    let cuda = CudaModel::from_weights(gpu.clone(), cfg, &w, 512, 64).unwrap();
    let mut st = cuda.new_state();
    let e = cuda
        .forward(&mut st, &[cuda.config.vocab_size as u32], Logits::Last)
        .unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"));
    let long = vec![1u32; 600];
    let e = cuda.forward(&mut st, &long, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("--max-seq"), "{e}");
}

/// Decode GEMVs with few blocks (`gemv_max_blocks`, each block walking many row groups and
/// reusing its staged input) give bitwise the same logits as one row group per block: every
/// row's dot product is the same sum wherever it runs.
#[test]
fn decode_gemv_row_walking_matches() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let r = read_reference(&dir);
        let (_cpu, mut cuda) = load(&gpu, &dir, 256);
        let mut run = |max_blocks: usize| {
            cuda.gemv_max_blocks = max_blocks;
            let mut st = cuda.new_state();
            cuda.forward(&mut st, &r.prompt_ids, Logits::Last).unwrap();
            let out: Vec<Vec<f32>> = r
                .decode_ids
                .iter()
                .map(|&tok| cuda.forward(&mut st, &[tok], Logits::Last).unwrap())
                .collect();
            out
        };
        let wide = run(1 << 20);
        let walking = run(3);
        println!(
            "{}: 3-block GEMVs vs one row group per block: equal {}",
            dir.display(),
            wide == walking
        );
        assert!(
            wide == walking,
            "{}: row-walking GEMVs differ",
            dir.display()
        );
    }
}

/// The model's full width (hidden 2,048, 256 experts top-8, head dim 256, the real vocabulary)
/// at 4 layers (3 GDN, 1 attention), seeded weights made on the device: the decode kernels'
/// full-shape paths (which the tiny fixtures do not reach) are deterministic and race-free.
/// Two graph + PDL runs of a 200-token prompt and 64 greedy steps give bitwise-equal logits,
/// and so do direct launches without PDL. A kernel reading data before its griddep_wait that
/// an earlier kernel of the step writes makes these differ (the bench's round check caught
/// such a race in moe_down_dec; the tiny fixtures did not).
#[test]
fn full_width_decode_is_deterministic_with_graph_and_pdl() {
    let Some(gpu) = gpu() else { return };
    let mut cfg = kestrel::config::TextConfig::qwen36_35b_a3b();
    cfg.num_layers = 4;
    cfg.layer_kinds.truncate(4);
    assert_eq!(cfg.num_attention_layers(), 1, "{:?}", cfg.layer_kinds);
    let mut cuda = CudaModel::synthetic(gpu.clone(), cfg.clone(), 7, 512, 512).unwrap();
    let prompt: Vec<u32> = kestrel::bench::prompt(200, 248_077);
    let stream = cuda.gemv_stream;
    let convstep = cuda.gdn_convstep;
    let mut run = |graph: bool,
                   ids: Option<&[u32]>,
                   gemv_stream: Option<(usize, usize, usize)>,
                   fused_conv_step: bool| {
        cuda.decode_graph = graph;
        cuda.decode_pdl = graph;
        cuda.gemv_stream = gemv_stream;
        cuda.gdn_convstep = fused_conv_step;
        let mut st = cuda.new_state();
        let first = cuda.forward(&mut st, &prompt, Logits::Last).unwrap();
        let mut tok = argmax(&first).unwrap() as u32;
        let (mut logits, mut chosen) = (Vec::new(), Vec::new());
        for step in 0..64 {
            if let Some(ids) = ids {
                tok = ids[step];
            }
            chosen.push(tok);
            let l = cuda.forward(&mut st, &[tok], Logits::Last).unwrap();
            assert!(
                l.iter().all(|x| x.is_finite()),
                "step {step}: non-finite logits"
            );
            tok = argmax(&l).unwrap() as u32;
            logits.push(l);
        }
        (logits, chosen)
    };
    let (a, ids) = run(true, None, stream, convstep);
    let (b, _) = run(true, Some(&ids), stream, convstep);
    let (direct, _) = run(false, Some(&ids), stream, convstep);
    // The in-projections as one stream a block (gemv_dec_stream, the default) or gemv_dec's
    // blocks: the same sums, so the same logits bit for bit.
    let other = if stream.is_some() {
        None
    } else {
        Some((2, 2, 3))
    };
    let (other_gemv, _) = run(true, Some(&ids), other, convstep);
    // The GDN conv and step in one launch (gdn_convstep_dec, the default) or two: q and k
    // normalised through the sums instead of the vectors, so close, not equal. The first step
    // shows the kernels' difference (on the H200 none: 0 at 3354939); later ones add what 64
    // steps of this random model amplify (4.7e-2 there; a reordered sum of squares in the
    // gated norm alone gave 7e-3), so over 64 steps the bound only catches a broken path.
    let (other_conv, _) = run(true, Some(&ids), stream, !convstep);
    let rel_diff = |p: &[f32], q: &[f32]| {
        let scale = q.iter().fold(0f32, |m, x| m.max(x.abs()));
        p.iter().zip(q).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    };
    let conv_first = rel_diff(&other_conv[0], &a[0]);
    let conv_worst = other_conv
        .iter()
        .zip(&a)
        .map(|(p, q)| rel_diff(p, q))
        .fold(0f32, f32::max);
    println!(
        "GDN conv + step fused {convstep} against {}: logits apart by {conv_first:.2e} of the largest at the first step, {conv_worst:.2e} at worst over 64",
        !convstep
    );
    assert!(
        conv_first <= 1e-3 && conv_worst <= 0.1,
        "the fused and split GDN conv + step differ: {conv_first} first step, {conv_worst} worst"
    );
    let first_diff = |x: &[Vec<f32>]| x.iter().zip(&a).position(|(p, q)| p != q);
    println!(
        "full width, 4 layers: 64 greedy steps; graph+PDL rerun first differing step {:?}, direct launches {:?}, in-projections {:?} instead of {stream:?}: {:?}",
        first_diff(&b),
        first_diff(&direct),
        other,
        first_diff(&other_gemv)
    );
    assert_eq!(
        first_diff(&other_gemv),
        None,
        "gemv_dec_stream and gemv_dec give different logits"
    );
    assert_eq!(
        first_diff(&b),
        None,
        "graph + PDL decode differs between two runs"
    );
    assert_eq!(
        first_diff(&direct),
        None,
        "graph + PDL decode differs from direct launches"
    );
}

/// Needs no fixtures: seeded random weights (demo shape, real vocabulary; and a shape with
/// dk=32, 8 value heads, 16 experts top-4), GPU against CPU in prefill and decode.
#[test]
fn cuda_matches_cpu_on_random_weights() {
    let Some(gpu) = gpu() else { return };
    let mut wide = kestrel::synthetic::demo_config();
    wide.vocab_size = 3000;
    wide.gdn_key_dim = 32;
    wide.gdn_value_dim = 48;
    wide.gdn_num_value_heads = 8;
    wide.num_experts = 16;
    wide.experts_per_token = 4;
    wide.head_dim = 64;
    wide.rotary_dim = 16;
    // (The demo shape's random weights are too chaotic under bf16 rounding of q and the
    // softmax probabilities for a tight comparison; the HF fixtures cover that shape's ops.)
    for cfg in [wide] {
        let w = kestrel::synthetic::random_weights(&cfg, 11, kestrel::tensor::DType::BF16);
        let cuda = CudaModel::from_weights(gpu.clone(), cfg.clone(), &w, 512, 64).unwrap();
        let mut cpu = CpuModel::new(cfg.clone(), w);
        // Random weights are chaotic under bf16 rounding, so compare with the CPU reference
        // at the GPU's precision (bf16 GEMM inputs and KV cache).
        cpu.bf16_activations = true;
        // 250 + 16 tokens: decode crosses 256 positions, where the fused step switches to
        // another attention split count (and captures another graph).
        let prompt: Vec<u32> = kestrel::bench::prompt(250, cfg.vocab_size.min(248_077));
        let (mut cs, mut gs) = (cpu.new_state(), cuda.new_state());
        let a = cpu.forward(&mut cs, &prompt, Logits::All).unwrap();
        let b = cuda.forward(&mut gs, &prompt, Logits::All).unwrap();
        let e = rel_err(&b, &a);
        println!(
            "random weights hidden {} vocab {}: prefill rel err {e:.2e}",
            cfg.hidden_size, cfg.vocab_size
        );
        assert!(e <= REL_TOL, "prefill {e}");
        let mut tok = argmax(&a[a.len() - cfg.vocab_size..]).unwrap() as u32;
        for step in 0..16 {
            let a = cpu.forward(&mut cs, &[tok], Logits::Last).unwrap();
            let b = cuda.forward(&mut gs, &[tok], Logits::Last).unwrap();
            let e = rel_err(&b, &a);
            assert!(e <= REL_TOL, "decode step {step}: {e}");
            tok = argmax(&a).unwrap() as u32;
        }
        assert!(
            cuda.decode_graphs(&gs) >= 2,
            "no second decode graph after crossing 256 positions"
        );
    }
}

/// Full-width check (run by `scripts/gpu_check.sh fullwidth` after
/// `scripts/fullwidth_check.py` wrote a full-width, reduced-depth checkpoint with transformers
/// and its f32 reference): Kestrel loads it through the normal loader and must match HF's
/// f32 logits within ‖Δ‖/‖ref‖ <= 5e-2 and at least as closely as transformers' own bf16 run
/// does (or 2e-2), and its greedy continuation (teacher-forced: every step's argmax equals
/// HF's; the script picked a prompt whose steps have a top-2 margin >= 0.1).
/// Skips without the checkpoint (KESTREL_FULLWIDTH_DIR).
#[test]
fn fullwidth_checkpoint_matches_hf() {
    let Ok(dir) = std::env::var("KESTREL_FULLWIDTH_DIR") else {
        println!("SKIPPED: KESTREL_FULLWIDTH_DIR not set (see scripts/gpu_check.sh fullwidth)");
        return;
    };
    let Some(gpu) = gpu() else { return };
    let dir = PathBuf::from(dir);
    let t0 = std::time::Instant::now();
    let cpu = CpuModel::load(&dir.join("model")).unwrap();
    let cfg = cpu.config.clone();
    assert_eq!(cfg.hidden_size, 2048);
    assert_eq!(cfg.num_experts, 256);
    assert_eq!(cfg.vocab_size, 248_320);
    let cuda = CudaModel::from_weights(gpu.clone(), cfg.clone(), &cpu.weights, 1024, 256).unwrap();
    drop(cpu);
    println!(
        "loaded the full-width checkpoint in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| f32_tensor(&st, n);
    let ids = |n: &str| id_tensor(&st, n);
    let (prompt, last4, dec_ids, dec_logits) = (
        ids("prompt_ids"),
        f32s("prompt_logits_last4"),
        ids("decode_ids"),
        f32s("decode_logits"),
    );
    let v = cfg.vocab_size;
    let mut state = cuda.new_state();
    let all = cuda.forward(&mut state, &prompt, Logits::All).unwrap();
    let tail = &all[all.len() - 4 * v..];
    let (pn, pm) = (norm_rel_err(tail, &last4), rel_err(tail, &last4));
    let mut got = vec![argmax(&all[all.len() - v..]).unwrap() as u32];
    let mut logits = Vec::new();
    for i in 0..dec_ids.len() {
        // Teacher-forced: feed HF's token, compare our choice with HF's next one.
        let l = cuda
            .forward(&mut state, &[dec_ids[i]], Logits::Last)
            .unwrap();
        if i + 1 < dec_ids.len() {
            got.push(argmax(&l).unwrap() as u32);
        }
        logits.extend(l);
    }
    let (dn, dm) = (
        norm_rel_err(&logits, &dec_logits),
        rel_err(&logits, &dec_logits),
    );
    println!(
        "full-width vs HF f32: prompt (last 4) |d|/|ref| {pn:.3e} (max-abs/scale {pm:.3e}); decode |d|/|ref| {dn:.3e} (max-abs/scale {dm:.3e})"
    );
    // transformers' own bf16 run against its f32 reference, on the same rows.
    let hf_bf16 = f32s("hf_bf16_logits");
    let mut ours = tail.to_vec();
    ours.extend(&logits);
    let mut theirs_ref = last4.clone();
    theirs_ref.extend(&dec_logits);
    let (on, hn) = (
        norm_rel_err(&ours, &theirs_ref),
        norm_rel_err(&hf_bf16, &theirs_ref),
    );
    println!("greedy: kestrel {got:?}\n        hf      {dec_ids:?}");
    println!("all rows |d|/|ref|: kestrel bf16 {on:.3e}, transformers bf16 {hn:.3e}");
    assert!(on <= 5e-2, "logits: {on}");
    assert!(
        on <= hn.max(2e-2),
        "kestrel ({on}) further from f32 than transformers bf16 ({hn})"
    );
    assert_eq!(got, dec_ids, "greedy continuation");
}

/// The grouped MoE GEMMs against the first (`moe_gemm`, v1) through the whole model, on
/// prompts long enough to take the grouped path: v2, and v3 and v4 (mma.sync, SwiGLU fused into
/// the gate/up kernel) with their tile height chosen by the rows and forced to each size. The same
/// bf16 products summed in f32, so what differs is f32 summation order inside the tensor-core
/// k steps (~1e-7 relative), which can at most flip a rare bf16 rounding of the SwiGLU output
/// (2^-8 of one element); through these small models that stays far below 1e-3 of the logits,
/// while a missed or misplaced row, column or k tile moves them by 1e-2 or more.
#[test]
fn moe_gemm_v2_matches_v1() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let r = read_reference(&dir);
        let (_cpu, mut cuda) = load(&gpu, &dir, 256);
        let mut run = |gemm: MoeGemm, tile_m: Option<usize>| {
            cuda.moe_gemm = gemm;
            cuda.moe_tile_m = tile_m;
            cuda.forward(&mut cuda.new_state(), &r.prompt_ids, Logits::All)
                .unwrap()
        };
        let v1 = run(MoeGemm::V1, None);
        for (gemm, tile_m) in [
            (MoeGemm::V2, None),
            (MoeGemm::V3, None),
            (MoeGemm::V3, Some(128)),
            (MoeGemm::V3, Some(64)),
            (MoeGemm::V4, None),
            (MoeGemm::V4, Some(128)),
            (MoeGemm::V4, Some(64)),
        ] {
            let b = run(gemm, tile_m);
            let n = norm_rel_err(&b, &v1);
            println!(
                "{}: {gemm:?} (tile_m {tile_m:?}) vs V1 {n:.2e}",
                dir.display()
            );
            assert!(b.iter().all(|x| x.is_finite()), "{}", dir.display());
            assert!(n <= 1e-3, "{} {gemm:?} {tile_m:?}: {n}", dir.display());
        }
    }
}

/// bf16 bits to f32.
/// Runs `f` once (warm-up) and waits for it, then (reps > 0) the mean milliseconds of `reps`
/// more calls, the GPU drained before and after; 0 when reps is 0.
fn gpu_time_ms(gpu: &Gpu, reps: usize, f: impl Fn()) -> f64 {
    f();
    gpu.sync().unwrap();
    if reps == 0 {
        return 0.0;
    }
    let t0 = std::time::Instant::now();
    for _ in 0..reps {
        f();
    }
    gpu.sync().unwrap();
    t0.elapsed().as_secs_f64() * 1e3 / reps as f64
}

fn bf16_to_f32(v: &[u16]) -> Vec<f32> {
    v.iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect()
}

/// The grouped MoE GEMMs at the real model's shape, kernels driven directly: 4,096 and 8,192
/// tokens routed top-8 over 256 experts (random, skewed ~9:1 from the first expert to the last;
/// then 8,192 routed uniformly and exactly balanced, see [`Routing`]), d 2,048, i 512, random bf16 weights and inputs. moe_gemm3 at both tile heights, plain
/// (f32 gate/up and down) and SwiGLU-fused (bf16 act), against moe_gemm (v1) on the same
/// expert-sorted rows: f32 outputs within 1e-5 of the output scale (the same products summed
/// in f32 in the same k steps), act within one bf16 rounding (max 1e-2 of the scale, norm
/// 1e-3); moe_gemm4 (v4) at both tile heights bitwise equal to moe_gemm3's outputs; outputs
/// start as NaN so that a missed row or column fails. Prints each kernel's
/// time per launch (mean of 20 after a warm-up) and TFLOP/s over the useful rows, v1 and v2
/// included; timing is not asserted.
#[test]
fn moe_grouped_gemm_full_shape() {
    let Some(gpu) = gpu() else { return };
    // 4,096 and 8,192 tokens (the default prefill chunk): ~128 and ~256 rows per expert,
    // skewed; then 8,192 routed uniformly (256 +- 16 rows: about half the experts have a
    // last tile of <= 64 rows) and exactly 256 rows each (two full tiles, no partial one), so
    // the times show what partial tiles cost.
    for (t, routing) in [
        (4096, Routing::Skewed),
        (8192, Routing::Skewed),
        (8192, Routing::Uniform),
        (8192, Routing::Balanced),
    ] {
        moe_grouped_gemm_case(&gpu, t, routing);
    }
}

/// How [`moe_grouped_gemm_case`] routes its tokens.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Random, ~9:1 from the first expert to the last.
    Skewed,
    /// Random, every expert equally likely.
    Uniform,
    /// Token n's slots j take experts (8 n + j) mod e: every expert the same count.
    Balanced,
}

/// One chunk of `t` tokens for [`moe_grouped_gemm_full_shape`].
fn moe_grouped_gemm_case(gpu: &Arc<Gpu>, t: usize, routing: Routing) {
    let (d, i, e, k) = (2048usize, 512usize, 256usize, 8usize);
    let rows = t * k;
    let mut rng = Lcg(23 + t as u64);
    let weight: Vec<f32> = (0..e)
        .map(|x| match routing {
            Routing::Skewed => 1.0 / (1.0 + x as f32 / 32.0),
            _ => 1.0,
        })
        .collect();
    let total: f32 = weight.iter().sum();
    let (mut topk, mut counts) = (Vec::with_capacity(rows), vec![0i32; e]);
    for n in 0..t {
        let mut chosen: Vec<usize> = Vec::with_capacity(k);
        if let Routing::Balanced = routing {
            chosen.extend((0..k).map(|j| (k * n + j) % e));
        }
        while chosen.len() < k {
            let mut u = (rng.next() + 1.0) * 0.5 * total;
            let mut x = 0;
            while x + 1 < e && u >= weight[x] {
                u -= weight[x];
                x += 1;
            }
            if !chosen.contains(&x) {
                chosen.push(x);
            }
        }
        for &x in &chosen {
            topk.push(x as i32);
            counts[x] += 1;
        }
    }
    println!(
        "{t} tokens ({routing:?}), {rows} rows over {e} experts: {} to {} per expert",
        counts.iter().min().unwrap(),
        counts.iter().max().unwrap()
    );
    let max_tiles = moe::max_tiles(rows, e, moe::MIN_TILE_M);
    let i32buf = |n: usize| gpu.alloc(n * 4).unwrap();
    let (counts_d, topk_d) = (gpu.upload(&counts).unwrap(), gpu.upload(&topk).unwrap());
    let (offsets, cursor, num_tiles) = (i32buf(e + 1), i32buf(e), i32buf(1));
    // moe_gemm6's item counter: zero before the first launch, and each leaves it at zero
    let claim = i32buf(1);
    gpu.memset_zero(claim.ptr, 4).unwrap();
    let (tile_expert, tile_row, tile_rows) =
        (i32buf(max_tiles), i32buf(max_tiles), i32buf(max_tiles));
    let (sorted_token, slot_row) = (i32buf(rows), i32buf(rows));
    let plan = MoePlan {
        counts: counts_d.ptr,
        offsets: offsets.ptr,
        cursor: cursor.ptr,
        tile_expert: tile_expert.ptr,
        tile_row: tile_row.ptr,
        tile_rows: tile_rows.ptr,
        num_tiles: num_tiles.ptr,
        claim: claim.ptr,
    };
    let random_bf16 = |n: usize, seed: u64, std: f32| {
        let b = gpu.alloc(n * 2).unwrap();
        gpu.fill_random(b.ptr, n, false, seed, 0.0, std).unwrap();
        b
    };
    let xb = random_bf16(t * d, 1, 1.0);
    let w_gu = random_bf16(e * 2 * i * d, 2, 1.0 / (d as f32).sqrt());
    let w_down = random_bf16(e * d * i, 3, 1.0 / (i as f32).sqrt());
    // moe_gemm7's tensor maps over the same weights.
    let (gu_map, down_map) = (
        gpu.moe_tensor_map(w_gu.ptr, e * 2 * i, d).unwrap(),
        gpu.moe_tensor_map(w_down.ptr, e * d, i).unwrap(),
    );
    // The scatter once (its order within an expert is not deterministic), then only re-plans.
    gpu.moe_plan(&plan, e, 64).unwrap();
    gpu.moe_scatter(
        topk_d.ptr,
        rows,
        k,
        cursor.ptr,
        sorted_token.ptr,
        slot_row.ptr,
    )
    .unwrap();
    let (gu, act, y) = (
        gpu.alloc(rows * 2 * i * 4).unwrap(),
        gpu.alloc(rows * i * 2).unwrap(),
        gpu.alloc(rows * d * 4).unwrap(),
    );
    let (gu_ref, act_ref, y_ref) = (
        gpu.alloc(rows * 2 * i * 4).unwrap(),
        gpu.alloc(rows * i * 2).unwrap(),
        gpu.alloc(rows * d * 4).unwrap(),
    );
    let gate_up = |out: u64| Grouped {
        a: xb.ptr,
        gather: sorted_token.ptr,
        w: w_gu.ptr,
        out,
        ndim: 2 * i,
        kdim: d,
        tmap: gu_map.ptr,
    };
    // down reads v1's act, so each down kernel sees the same input
    let down = |out: u64| Grouped {
        a: act_ref.ptr,
        gather: 0,
        w: w_down.ptr,
        out,
        ndim: d,
        kdim: i,
        tmap: down_map.ptr,
    };
    let time_ms = |f: &dyn Fn()| gpu_time_ms(gpu, 20, f);
    let tflops = |ms: f64, ndim: usize, kdim: usize| 2.0 * (rows * ndim * kdim) as f64 / ms / 1e9;
    let f32s = |b: &kestrel::cuda::DeviceBuf, n: usize| {
        let mut v = vec![0f32; n];
        gpu.copy_to_host(b.ptr, &mut v).unwrap();
        v
    };
    let bf16s = |b: &kestrel::cuda::DeviceBuf, n: usize| {
        let mut v = vec![0u16; n];
        gpu.copy_to_host(b.ptr, &mut v).unwrap();
        bf16_to_f32(&v)
    };
    let nan_f32 = |b: &kestrel::cuda::DeviceBuf, n: usize| {
        gpu.copy_to_device(b.ptr, &vec![f32::NAN; n]).unwrap()
    };
    let nan_bf16 = |b: &kestrel::cuda::DeviceBuf, n: usize| {
        gpu.copy_to_device(b.ptr, &vec![0x7fc0u16; n]).unwrap()
    };
    let tiles = |tile_m: usize| {
        gpu.moe_plan(&plan, e, tile_m).unwrap();
        let mut n = [0i32];
        gpu.copy_to_host(num_tiles.ptr, &mut n).unwrap();
        n[0] as usize
    };

    // v1: the reference outputs.
    let nt = tiles(64);
    let v1 = MoeGemm::V1;
    gpu.moe_grouped(v1, 64, &plan, rows, e, &gate_up(gu_ref.ptr))
        .unwrap();
    gpu.swiglu_bf16(gu_ref.ptr, act_ref.ptr, rows, i).unwrap();
    gpu.moe_grouped(v1, 64, &plan, rows, e, &down(y_ref.ptr))
        .unwrap();
    let (gu_r, act_r, y_r) = (
        f32s(&gu_ref, rows * 2 * i),
        bf16s(&act_ref, rows * i),
        f32s(&y_ref, rows * d),
    );
    assert!(gu_r.iter().chain(&act_r).chain(&y_r).all(|x| x.is_finite()));
    let t_gu = time_ms(&|| {
        gpu.moe_grouped(v1, 64, &plan, rows, e, &gate_up(gu.ptr))
            .unwrap()
    });
    let t_sw = time_ms(&|| gpu.swiglu_bf16(gu.ptr, act.ptr, rows, i).unwrap());
    let t_dn = time_ms(&|| {
        gpu.moe_grouped(v1, 64, &plan, rows, e, &down(y.ptr))
            .unwrap()
    });
    let report = |name: &str, tiles: usize, t_gu: f64, t_sw: f64, t_dn: f64| {
        println!(
            "{name:<26} {tiles:>5} tiles: gate_up {t_gu:.3} ms ({:.0} TFLOP/s){}, down {t_dn:.3} ms ({:.0} TFLOP/s); MoE GEMMs {:.3} ms",
            tflops(t_gu, 2 * i, d),
            if t_sw > 0.0 {
                format!(" + swiglu {t_sw:.3} ms")
            } else {
                String::new()
            },
            tflops(t_dn, d, i),
            t_gu + t_sw + t_dn
        )
    };
    report("v1 moe_gemm (64x64)", nt, t_gu, t_sw, t_dn);

    // One kind's outputs against v1's (its output buffers were NaN before its launches).
    let check = |name: &str, gu_out: Option<&[f32]>, act_out: Option<&[f32]>, y_out: &[f32]| {
        if let Some(g) = gu_out {
            let err = rel_err(g, &gu_r);
            println!("{name}: gate_up vs v1 max {err:.2e}");
            assert!(
                g.iter().all(|x| x.is_finite()) && err <= 1e-5,
                "{name} gate_up: {err}"
            );
        }
        if let Some(a) = act_out {
            let (m, n) = (rel_err(a, &act_r), norm_rel_err(a, &act_r));
            println!("{name}: act vs v1 max {m:.2e} norm {n:.2e}");
            assert!(
                a.iter().all(|x| x.is_finite()) && m <= 1e-2 && n <= 1e-3,
                "{name} act: {m} {n}"
            );
        }
        let err = rel_err(y_out, &y_r);
        println!("{name}: down vs v1 max {err:.2e}");
        assert!(
            y_out.iter().all(|x| x.is_finite()) && err <= 1e-5,
            "{name} down: {err}"
        );
    };

    // v2 (128-row tiles).
    let nt = tiles(128);
    let v2 = MoeGemm::V2;
    nan_f32(&gu, rows * 2 * i);
    nan_f32(&y, rows * d);
    gpu.moe_grouped(v2, 128, &plan, rows, e, &gate_up(gu.ptr))
        .unwrap();
    gpu.moe_grouped(v2, 128, &plan, rows, e, &down(y.ptr))
        .unwrap();
    check(
        "v2",
        Some(f32s(&gu, rows * 2 * i).as_slice()),
        None,
        &f32s(&y, rows * d),
    );
    let t_gu = time_ms(&|| {
        gpu.moe_grouped(v2, 128, &plan, rows, e, &gate_up(gu.ptr))
            .unwrap()
    });
    let t_dn = time_ms(&|| {
        gpu.moe_grouped(v2, 128, &plan, rows, e, &down(y.ptr))
            .unwrap()
    });
    report("v2 moe_gemm2 (128x128)", nt, t_gu, t_sw, t_dn);

    // A kernel family at one tile height: plain gate_up, fused gate_up + SwiGLU, plain down
    // into NaN-filled outputs (so a missed row shows), then their times.
    let run = |kind: MoeGemm, tile_m: usize| {
        // The plan's tiles depend on the tile height: rebuild it for this one.
        tiles(tile_m);
        nan_f32(&gu, rows * 2 * i);
        nan_bf16(&act, rows * i);
        nan_f32(&y, rows * d);
        gpu.moe_grouped(kind, tile_m, &plan, rows, e, &gate_up(gu.ptr))
            .unwrap();
        gpu.moe_grouped_swiglu(kind, tile_m, &plan, rows, e, &gate_up(act.ptr))
            .unwrap();
        gpu.moe_grouped(kind, tile_m, &plan, rows, e, &down(y.ptr))
            .unwrap();
        (
            f32s(&gu, rows * 2 * i),
            bf16s(&act, rows * i),
            f32s(&y, rows * d),
        )
    };
    let timings = |kind: MoeGemm, tile_m: usize, name: &str| {
        let t_gu = time_ms(&|| {
            gpu.moe_grouped(kind, tile_m, &plan, rows, e, &gate_up(gu.ptr))
                .unwrap()
        });
        let t_fused = time_ms(&|| {
            gpu.moe_grouped_swiglu(kind, tile_m, &plan, rows, e, &gate_up(act.ptr))
                .unwrap()
        });
        let t_dn = time_ms(&|| {
            gpu.moe_grouped(kind, tile_m, &plan, rows, e, &down(y.ptr))
                .unwrap()
        });
        let nt = tiles(tile_m);
        report(&format!("{name} plain"), nt, t_gu, t_sw, t_dn);
        report(&format!("{name} fused SwiGLU"), nt, t_fused, 0.0, t_dn);
    };

    // v3 at both tile heights, against the reference.
    let mut v3_out = Vec::new();
    for tile_m in [128, 64] {
        let name = format!("v3 moe_gemm3 m{tile_m}");
        let outs = run(MoeGemm::V3, tile_m);
        check(&name, Some(&outs.0), Some(&outs.1), &outs.2);
        v3_out.push((tile_m, outs));
        timings(MoeGemm::V3, tile_m, &name);
    }

    // v4 (the same k16 mma steps in the same order): bitwise equal to v3 at each tile height.
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for (tile_m, (gu3, act3, y3)) in &v3_out {
        let name = format!("v4 moe_gemm4 m{tile_m}");
        let (gu4, act4, y4) = run(MoeGemm::V4, *tile_m);
        assert!(bits(&gu4) == bits(gu3), "{name} gate_up != v3");
        assert!(bits(&act4) == bits(act3), "{name} act != v3");
        assert!(bits(&y4) == bits(y3), "{name} down != v3");
        println!("{name}: bitwise equal to v3");
        timings(MoeGemm::V4, *tile_m, &name);
    }
    // v5 (wgmma, 128-row tiles; sm_90a only): against the reference like v3, and its times.
    if gpu.compute_capability == (9, 0) {
        let name = "v5 moe_gemm5 m128";
        let outs = run(MoeGemm::V5, 128);
        check(name, Some(&outs.0), Some(&outs.1), &outs.2);
        timings(MoeGemm::V5, 128, name);
        // v6 (v5's wgmma steps, warp-specialised and persistent): bitwise equal to v5.
        let name = "v6 moe_gemm6 m128";
        let (gu6, act6, y6) = run(MoeGemm::V6, 128);
        assert!(bits(&gu6) == bits(&outs.0), "{name} gate_up != v5");
        assert!(bits(&act6) == bits(&outs.1), "{name} act != v5");
        assert!(bits(&y6) == bits(&outs.2), "{name} down != v5");
        println!("{name}: bitwise equal to v5");
        timings(MoeGemm::V6, 128, name);
        // The down product with bf16 y (moe_gemm6_m128_bf16): v6's f32 y rounded to bf16,
        // every element written (the buffer starts NaN), and its time.
        nan_bf16(&y, rows * d);
        gpu.moe_grouped_bf16(MoeGemm::V6, 128, &plan, rows, e, &down(y.ptr))
            .unwrap();
        let y16 = bf16s(&y, rows * d);
        let rounded = kestrel::ops::gemm::round_bf16(&y6);
        assert!(
            bits(&y16) == bits(&rounded),
            "{name} bf16 y != bf16(v6's y)"
        );
        let t_dn16 = time_ms(&|| {
            gpu.moe_grouped_bf16(MoeGemm::V6, 128, &plan, rows, e, &down(y.ptr))
                .unwrap()
        });
        println!("{name} bf16 y: bf16(v6's f32 y) bitwise; down {t_dn16:.3} ms");
        // Every moe_gemm6 launch (its blocks claim their items from the counter) left the
        // counter at zero for the next.
        let mut left = [-1i32];
        gpu.copy_to_host(claim.ptr, &mut left).unwrap();
        assert_eq!(left[0], 0, "moe_gemm6 left its item counter at {}", left[0]);
        // v7 (opt-in): clusters of two blocks on 256-row tiles, B rows by multicast tensor copy;
        // at 128-row tiles no cluster, B rows by tensor copy. The same wgmma steps per output,
        // so bitwise v6's outputs, bf16 y too; and their times.
        for tile_m in [256, 128] {
            let name = format!("v7 moe_gemm7 m{tile_m}");
            let (gu7, act7, y7) = run(MoeGemm::V7, tile_m);
            assert!(bits(&gu7) == bits(&gu6), "{name} gate_up != v6");
            assert!(bits(&act7) == bits(&act6), "{name} act != v6");
            assert!(bits(&y7) == bits(&y6), "{name} down != v6");
            nan_bf16(&y, rows * d);
            gpu.moe_grouped_bf16(MoeGemm::V7, tile_m, &plan, rows, e, &down(y.ptr))
                .unwrap();
            assert!(
                bits(&bf16s(&y, rows * d)) == bits(&rounded),
                "{name} bf16 y != bf16(v6's y)"
            );
            let t_dn16 = time_ms(&|| {
                gpu.moe_grouped_bf16(MoeGemm::V7, tile_m, &plan, rows, e, &down(y.ptr))
                    .unwrap()
            });
            println!("{name}: bitwise equal to v6 (bf16 y too); bf16 down {t_dn16:.3} ms");
            timings(MoeGemm::V7, tile_m, &name);
        }
        let clusters = gpu
            .max_active_clusters("moe_gemm7_m256", 384, 4 * 384 * 128 + 64, 2)
            .unwrap();
        println!(
            "moe_gemm7_m256: {clusters} clusters of 2 at once on {} SMs",
            gpu.sm_count
        );
    } else {
        println!(
            "v5 moe_gemm5: SKIPPED (compute capability {:?}, not 9.0)",
            gpu.compute_capability
        );
    }
    println!(
        "default tile height at {rows} rows over {e} experts: {}",
        moe::gemm3_tile_m(rows, e)
    );
}

/// The fused one-token decode step, replayed as a CUDA graph and launched directly, against
/// the general (prefill) path on every fixture: the prompt, then every teacher-forced step of
/// the reference. Graph and direct launches run the same kernels, so they agree exactly; the
/// general path differs in summation order only. Direct launches also run without programmatic
/// dependent launch, so a kernel reading its inputs before `griddep_wait` would show up as a
/// difference. The greedy ids from the fused lm_head argmax
/// equal the argmax of the fused logits at every step.
#[test]
fn fused_decode_and_graph_match_general_path() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let r = read_reference(&dir);
        let (_cpu, mut cuda) = load(&gpu, &dir, 256);
        let v = cuda.config.vocab_size;
        let mut run = |fused: bool, graph: bool, greedy: bool| {
            cuda.fused_decode = fused;
            cuda.decode_graph = graph;
            // Direct launches without programmatic dependent launch: a missing griddep_wait
            // in a kernel would make the overlapped (graph) runs differ from these.
            cuda.decode_pdl = graph;
            let mut st = cuda.new_state();
            cuda.forward(&mut st, &r.prompt_ids, Logits::Last).unwrap();
            let mut out = Vec::new();
            for &tok in &r.decode_ids {
                if greedy {
                    out.push(vec![cuda.forward_greedy(&mut st, &[tok], v).unwrap() as f32]);
                } else {
                    out.push(cuda.forward(&mut st, &[tok], Logits::Last).unwrap());
                }
            }
            (out, cuda.decode_graphs(&st))
        };
        let (general, none) = run(false, false, false);
        let (direct, _) = run(true, false, false);
        let (graphed, captured) = run(true, true, false);
        let (ids, _) = run(true, true, true);
        assert_eq!(none, 0, "the general path captured a graph");
        assert!(captured >= 1, "{}: no decode graph captured", dir.display());
        assert!(
            graphed == direct,
            "{}: graph replay differs from direct launches",
            dir.display()
        );
        let scale = general.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
        let n = norm_rel_err(&direct.concat(), &general.concat());
        let mut compared = 0;
        let mut differ = Vec::new();
        for (step, ((f, g), id)) in direct.iter().zip(&general).zip(&ids).enumerate() {
            assert_eq!(
                id[0] as usize,
                argmax(f).unwrap(),
                "{}: step {step}: device argmax differs from the logits' argmax",
                dir.display()
            );
            if margin(g) > 0.02 * scale {
                compared += 1;
                if argmax(f) != argmax(g) {
                    differ.push((step, margin(g) / scale, rel_err(f, g)));
                }
            }
        }
        println!(
            "{}: fused decode vs general path {n:.2e} over {} steps, greedy equal on {compared} confident steps (differ: {differ:?}), {captured} graph(s)",
            dir.display(),
            direct.len()
        );
        assert!(differ.is_empty(), "{}: greedy differs", dir.display());
        assert!(n <= NORM_TOL, "{}: {n}", dir.display());
        assert!(
            compared >= 32,
            "{}: only {compared} confident steps",
            dir.display()
        );
    }
}

/// Prompt and greedy continuation in pieces of the given sizes, then the rest, all logits;
/// prefill GDN chunked or sequential.
fn logits_in_pieces(
    cuda: &mut CudaModel,
    ids: &[u32],
    pieces: &[usize],
    chunked: bool,
) -> Vec<f32> {
    cuda.gdn_chunked = chunked;
    let mut st = cuda.new_state();
    let mut out = Vec::new();
    let mut at = 0;
    for &n in pieces.iter().chain(std::iter::once(&ids.len())) {
        let end = (at + n).min(ids.len());
        if end > at {
            out.extend(cuda.forward(&mut st, &ids[at..end], Logits::All).unwrap());
        }
        at = end;
    }
    out
}

/// The token-parallel conv and chunked delta rule against the sequential kernels (the
/// `KESTREL_GDN=recurrent` path) through the whole model. The kernels agree to ~1e-6 at full
/// size (`gdn_chunked_kernel_matches_recurrent`); through these tiny random models such a
/// difference can flip bf16 roundings downstream, so the model-level bar is the GPU-vs-CPU one
/// (‖Δ‖/‖ref‖ <= 3e-2, max <= 1e-1 of the logit scale; measured 7e-3 / 3.8e-2). In one call
/// (2 and 4 chunks, the last partial), and in calls of 2 tokens (fewer than the conv's
/// history), 1 (decode kernels), 2 and 70 (state carried in).
#[test]
fn gdn_chunked_matches_recurrent_through_the_model() {
    let Some(gpu) = gpu() else { return };
    for dir in fixtures() {
        let r = read_reference(&dir);
        let (_cpu, mut cuda) = load(&gpu, &dir, 256);
        let sh = GdnShape::of(&cuda.config, 2);
        assert!(sh.chunked_fits(gpu.max_smem_per_block), "{sh:?}");
        let ids: Vec<u32> = r.prompt_ids.iter().chain(&r.decode_ids).copied().collect();
        for pieces in [&[][..], &[2, 1, 2, 70]] {
            let a = logits_in_pieces(&mut cuda, &ids, pieces, false);
            let b = logits_in_pieces(&mut cuda, &ids, pieces, true);
            let (n, m) = (norm_rel_err(&b, &a), rel_err(&b, &a));
            println!(
                "{}: {} tokens in pieces {pieces:?}: chunked vs recurrent GDN norm {n:.2e} max {m:.2e}",
                dir.display(),
                ids.len()
            );
            assert!(b.iter().all(|x| x.is_finite()), "{}", dir.display());
            assert!(
                n <= NORM_TOL && m <= REL_TOL,
                "{} {pieces:?}: {n} {m}",
                dir.display()
            );
        }
    }
}

/// Seeded numbers in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.next()).collect()
    }
}

/// Inputs of a delta-rule call as the conv and gates leave them: q and k heads L2-normalised
/// (q times dk^-1/2), v in [-1, 1], g in [-a_j, 0] with a_j from ~0 (slow decay, the state
/// carries across chunks) to 5 over the value heads, β in (0, 1); a nonzero initial state.
/// Returns (qkv, g, beta, state).
fn delta_inputs(sh: &GdnShape, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Lcg(seed);
    let (c, dk, hv) = (sh.channels(), sh.dk, sh.hv);
    let mut qkv = rng.vec(sh.t * c, 1.0);
    for row in qkv.chunks_exact_mut(c) {
        for (h, x) in row[..2 * sh.hk * dk].chunks_exact_mut(dk).enumerate() {
            let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            let scale = if h < sh.hk {
                1.0 / (dk as f32).sqrt()
            } else {
                1.0
            };
            x.iter_mut().for_each(|v| *v *= scale / norm);
        }
    }
    let mut g = Vec::with_capacity(sh.t * hv);
    for _ in 0..sh.t {
        for j in 0..hv {
            let a = 5.0 * ((j + 1) as f32 / hv as f32).powi(3);
            g.push(-a * 0.5 * (rng.next() + 1.0));
        }
    }
    let beta = (0..sh.t * hv).map(|_| 0.5 + 0.49 * rng.next()).collect();
    let state = rng.vec(hv * dk * sh.dv, 0.5);
    (qkv, g, beta, state)
}

/// (o, final state) of one delta-rule call on the GPU, chunked or token by token; o starts as
/// NaN so that a row the kernels miss shows.
fn run_delta(
    gpu: &Gpu,
    sh: &GdnShape,
    inputs: &(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>),
    chunked: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (qkv, g, beta, state) = inputs;
    let (qkv, g, beta, state) = (
        gpu.upload(qkv).unwrap(),
        gpu.upload(g).unwrap(),
        gpu.upload(beta).unwrap(),
        gpu.upload(state).unwrap(),
    );
    let o = gpu.upload(&vec![f32::NAN; sh.t * sh.hv * sh.dv]).unwrap();
    let scratch = gpu.alloc(sh.chunk_scratch_floats() * 4).unwrap();
    let bufs = DeltaBufs {
        qkv: qkv.ptr,
        g: g.ptr,
        beta: beta.ptr,
        state: state.ptr,
        o: o.ptr,
    };
    if chunked {
        gpu.gdn_delta_chunked(sh, &bufs, scratch.ptr).unwrap();
    } else {
        gpu.gdn_delta_recurrent(sh, &bufs).unwrap();
    }
    let mut o_h = vec![0f32; sh.t * sh.hv * sh.dv];
    let mut s_h = vec![0f32; sh.hv * sh.dk * sh.dv];
    gpu.copy_to_host(o.ptr, &mut o_h).unwrap();
    gpu.copy_to_host(state.ptr, &mut s_h).unwrap();
    (o_h, s_h)
}

/// The full model's GDN shape (16 key and 32 value heads of 128) over `t` tokens.
fn model_gdn_shape(t: usize) -> GdnShape {
    GdnShape {
        t,
        hk: 16,
        hv: 32,
        dk: 128,
        dv: 128,
    }
}

/// The chunked delta-rule kernels against the token-by-token kernel on the same inputs, both
/// f32 (`gdn_chunk_state`'s tensor-core products are split 3xTF32, f32-level; the default
/// `gdn_chunk_state_t64`'s 3xBF16, ~1e-5-level, within the same 1e-4 bound): at the full
/// model's head dims (dk = dv = 128, 16 key and 32 value heads) over 300 tokens (a partial
/// last chunk) and 2 tokens, and at the fixtures' and other small dims.
#[test]
fn gdn_chunked_kernel_matches_recurrent() {
    let Some(gpu) = gpu() else { return };
    use std::sync::atomic::Ordering::Relaxed;
    let default_wg = gpu.gdn_state_wg.load(Relaxed);
    let default_t64 = gpu.gdn_state_t64.load(Relaxed);
    let default_prep_wg = gpu.gdn_prep_wg.load(Relaxed);
    let shape = |t, hk, hv, dk, dv| GdnShape { t, hk, hv, dk, dv };
    for sh in [
        model_gdn_shape(300),
        model_gdn_shape(2),
        shape(64, 2, 4, 64, 64),
        shape(130, 4, 8, 32, 48),
        shape(150, 4, 8, 32, 32),
        shape(37, 2, 4, 16, 24),
    ] {
        assert!(sh.chunked_fits(gpu.max_smem_per_block), "{sh:?}");
        let inputs = delta_inputs(&sh, 42 + sh.t as u64);
        let (o_r, s_r) = run_delta(&gpu, &sh, &inputs, false);
        // the state pass on wgmma (sm_90a, dk 64 and 128), with Sᵀ in registers (sm_90a, dk
        // 128) and on mma.sync; the prep on wgmma (sm_90a, dk = dv = 128) and on mma.sync
        let mut states = vec![("mma.sync", false, false)];
        if default_wg && matches!(sh.dk, 64 | 128) {
            states.insert(0, ("wgmma", true, false));
        }
        if gpu.sm90a && sh.dk == 128 {
            states.push(("Sᵀ-register 3xBF16", false, true));
        }
        let preps: &[bool] = if gpu.sm90a && sh.dk == 128 && sh.dv == 128 {
            &[true, false]
        } else {
            &[false]
        };
        for &prep_wg in preps {
            for &(state_name, wg, t64) in &states {
                gpu.gdn_state_wg.store(wg, Relaxed);
                gpu.gdn_state_t64.store(t64, Relaxed);
                gpu.gdn_prep_wg.store(prep_wg, Relaxed);
                let (o_c, s_c) = run_delta(&gpu, &sh, &inputs, true);
                let (eo, es) = (rel_err(&o_c, &o_r), rel_err(&s_c, &s_r));
                println!(
                    "{sh:?} ({} prep, {state_name} state pass): chunked vs recurrent o max {eo:.2e} norm {:.2e}, state max {es:.2e} norm {:.2e}",
                    if prep_wg { "wgmma" } else { "mma.sync" },
                    norm_rel_err(&o_c, &o_r),
                    norm_rel_err(&s_c, &s_r)
                );
                assert!(o_c.iter().chain(&s_c).all(|x| x.is_finite()), "{sh:?}");
                assert!(
                    eo <= 1e-4 && es <= 1e-4,
                    "{sh:?} prep wg {prep_wg} state {state_name}: o {eo} state {es}"
                );
            }
        }
        gpu.gdn_state_wg.store(default_wg, Relaxed);
        gpu.gdn_state_t64.store(default_t64, Relaxed);
        gpu.gdn_prep_wg.store(default_prep_wg, Relaxed);
        assert!(
            rel_err(&s_r, &inputs.3) > 1e-2,
            "{sh:?}: the state did not move"
        );
    }
}

/// The token-parallel prefill conv (SiLU and q/k norm fused, state advanced by a second
/// kernel) against the sequential conv and norm kernels, including calls shorter than the
/// conv's history; the same sums in the same order, so equal up to the last bits. The inputs
/// in rows wider than the channels (the whole in-projection's output, as prefill has them)
/// where `pad` > 0.
#[test]
fn gdn_conv_prefill_matches_sequential() {
    let Some(gpu) = gpu() else { return };
    let kern = 4;
    for (t, hk, hv, dk, dv, pad) in [
        (2, 16, 32, 128, 128, 4160),
        (300, 16, 32, 128, 128, 4160),
        (300, 16, 32, 128, 128, 0),
        (1, 2, 4, 16, 24, 0),
        (5, 2, 4, 16, 24, 13),
        (70, 4, 8, 32, 32, 0),
    ] {
        let sh = GdnShape { t, hk, hv, dk, dv };
        let c = sh.channels();
        let mut rng = Lcg(t as u64 + 7);
        let (p, w, st0) = (
            gpu.upload(&rng.vec(t * (c + pad), 2.0)).unwrap(),
            gpu.upload(&rng.vec(c * kern, 1.0)).unwrap(),
            rng.vec((kern - 1) * c, 2.0),
        );
        let run = |prefill: bool| {
            let st = gpu.upload(&st0).unwrap();
            let out = gpu.alloc(t * c * 4).unwrap();
            let f = if prefill {
                Gpu::gdn_conv_prefill
            } else {
                Gpu::gdn_conv_sequential
            };
            let rows = ConvRows {
                ptr: p.ptr,
                ld: c + pad,
            };
            f(&gpu, &sh, kern, rows, st.ptr, w.ptr, out.ptr).unwrap();
            let mut o_h = vec![0f32; t * c];
            let mut s_h = vec![0f32; (kern - 1) * c];
            gpu.copy_to_host(out.ptr, &mut o_h).unwrap();
            gpu.copy_to_host(st.ptr, &mut s_h).unwrap();
            (o_h, s_h)
        };
        let (o_a, s_a) = run(false);
        let (o_b, s_b) = run(true);
        let e = rel_err(&o_b, &o_a);
        println!("{sh:?}: prefill conv vs sequential {e:.2e}");
        assert!(
            o_b.iter().all(|x| x.is_finite()) && e <= 1e-6,
            "{sh:?}: {e}"
        );
        assert_eq!(s_b, s_a, "{sh:?}: conv state");
    }
}

/// DRAM read bandwidth of 4 KiB weight rows read in 32 KiB stages of 128 bytes a row (the
/// grouped MoE GEMMs' K step over 256 rows) up to whole rows (contiguous), over 2 GiB;
/// printed (a measurement, like the timing test below), asserted only to have run.
#[test]
fn weight_stream_bandwidth_by_layout() {
    let Some(gpu) = gpu() else { return };
    let items = 2048;
    let copy = gpu.measure_copy_bandwidth(1 << 30).unwrap();
    println!("copy bandwidth (read + write): {:.2} TB/s", copy / 1e12);
    for run in [8, 16, 32, 256] {
        let bw = gpu.measure_weight_stream(items, run).unwrap();
        println!(
            "weight stream, {} bytes of each of {} rows a 32 KiB stage: {:.2} TB/s",
            16 * run,
            2048 / run,
            bw / 1e12
        );
        assert!(bw.is_finite() && bw > 0.0, "run {run}: {bw}");
    }
    assert!(gpu.measure_weight_stream(items, 12).is_err());
}

/// How fast a short burst of weight reads can come from DRAM at best (a decode kernel streams
/// 17-50 MB in 5-18 µs): `window_probe` over windows of 4 MiB to 1 GiB with 1, 2 and 5 stages of
/// 32 KiB in flight a block, timed inside the kernel (no launch latency). Prints TB/s to the
/// first and to the last block's end; asserts only that the windows ran and that a long one
/// streams faster than a short one (ramp and tail weigh less).
#[test]
fn weight_window_bandwidth() {
    let Some(gpu) = gpu() else { return };
    let buf = gpu.alloc_zeroed(4 << 30).unwrap();
    let mut rates = Vec::new();
    for depth in [1, 2, 5] {
        for mib in [4usize, 8, 16, 32, 48, 64, 128, 1024] {
            let bytes = mib << 20;
            let (first, last) = gpu.measure_weight_window(&buf, bytes, depth, 7).unwrap();
            println!(
                "window {mib:>5} MiB, {depth} stage(s) in flight a block: last block done {:6.2} µs ({:.2} TB/s), first {:6.2} µs",
                last * 1e6,
                bytes as f64 / last / 1e12,
                first * 1e6
            );
            assert!(
                last > 0.0 && first > 0.0 && first <= last,
                "{mib} MiB: {first} {last}"
            );
            rates.push((depth, mib, bytes as f64 / last));
        }
    }
    for depth in [1, 2, 5] {
        let r = |m: usize| rates.iter().find(|x| x.0 == depth && x.1 == m).unwrap().2;
        assert!(
            r(1024) > r(4),
            "depth {depth}: 1 GiB at {} vs 4 MiB at {}",
            r(1024),
            r(4)
        );
    }
    assert!(gpu.measure_weight_window(&buf, 1 << 20, 6, 1).is_err());
    assert!(gpu.measure_weight_window(&buf, 1 << 20, 2, 0).is_err());
}

/// What one grid-wide barrier costs (a persistent decode kernel would pay ~7 a layer where the
/// step now has launch boundaries): one and two blocks an SM, 2,000 barriers a launch, the time
/// per barrier printed (it includes two memsets and a launch spread over the 2,000); every
/// barrier must hold.
#[test]
fn grid_barrier_cost() {
    let Some(gpu) = gpu() else { return };
    for per_sm in [1, 2] {
        let blocks = per_sm * gpu.sm_count;
        let (secs, held) = gpu.measure_grid_barrier(blocks, 2000).unwrap();
        println!(
            "grid barrier over {blocks} blocks ({per_sm} an SM): {:.2} µs each",
            secs * 1e6
        );
        assert!(held, "{blocks} blocks: a barrier let a block through early");
        assert!(
            secs > 0.0 && secs < 1e-3,
            "{blocks} blocks: {secs} s a barrier"
        );
    }
}

/// Where gdn_chunk_state's time goes within a chunk: a 2,048-token call (32 chunks) at the full
/// model's shape with the phase clock compiled in (`KESTREL_KERNEL_DEFINES=KESTREL_GDN_TRACE`
/// in the environment; otherwise the clock must have stayed 0 and the test says it skipped),
/// cycles per chunk of each phase of block (0, 0) averaged over chunks 2 .. 31, printed; the
/// phases of every chunk must be in order.
#[test]
fn gdn_chunk_state_phases() {
    let Some(gpu) = gpu() else { return };
    let sh = model_gdn_shape(2048);
    let traced =
        std::env::var("KESTREL_KERNEL_DEFINES").is_ok_and(|d| d.contains("KESTREL_GDN_TRACE"));
    // The phase clock of one chunked delta-rule run at 2,048 tokens with a kernel choice set
    // (then put back).
    let traced_with = |flag: &std::sync::atomic::AtomicBool, on: bool| {
        let default = flag.swap(on, std::sync::atomic::Ordering::Relaxed);
        run_delta(&gpu, &sh, &delta_inputs(&sh, 9), true);
        flag.store(default, std::sync::atomic::Ordering::Relaxed);
        gpu.gdn_phase_trace().unwrap()
    };
    // gdn_chunk_state_wg's (or gdn_chunk_state's) clock first: gdn_chunk_state_t64 off
    let ph = traced_with(&gpu.gdn_state_t64, false);
    if !traced {
        assert!(
            ph.iter().all(|&x| x == 0),
            "phase clock written without the define"
        );
        println!("SKIPPED: phase clock not compiled in (KESTREL_KERNEL_DEFINES=KESTREL_GDN_TRACE)");
        return;
    }
    let chunks = sh.t / 64;
    // (team slot offset, from, to, name)
    let phases = [
        (0, 0, 1, "A: U loads + W S"),
        (0, 1, 2, "A: Vd (decay, split, store)"),
        (0, 2, 3, "A: wait for K"),
        (0, 3, 4, "A: team barrier"),
        (0, 4, 5, "A: S update + split"),
        (0, 5, 6, "A: to the loop end"),
        (0, 6, 7, "A: wait for next W"),
        (8, 0, 1, "B: O_intra loads + Q' S"),
        (8, 1, 6, "B: o stores"),
        (8, 6, 7, "B: wait for next Q'"),
    ];
    let at = |ch: usize, slot: usize| ph[ch * 16 + slot];
    for ch in 0..chunks {
        for (team, slots) in [(0, &[0, 1, 2, 3, 4, 5, 6, 7][..]), (8, &[0, 1, 6, 7][..])] {
            for w in slots.windows(2) {
                assert!(
                    at(ch, team + w[0]) <= at(ch, team + w[1]),
                    "chunk {ch} team {team}: {w:?}"
                );
            }
        }
    }
    let span = 2..chunks;
    let avg =
        |f: &dyn Fn(usize) -> u64| span.clone().map(f).sum::<u64>() as f64 / span.len() as f64;
    println!(
        "{} block (0, 0), t = {}, cycles a chunk (chunks 2 .. {}):",
        if gpu.gdn_state_wg.load(std::sync::atomic::Ordering::Relaxed) {
            "gdn_chunk_state_wg_128"
        } else {
            "gdn_chunk_state_128"
        },
        sh.t,
        chunks - 1
    );
    println!(
        "  chunk period: {:.0}",
        avg(&|ch| at(ch, 0) - at(ch - 1, 0))
    );
    for (team, a, b, name) in phases {
        println!(
            "  {name}: {:.0}",
            avg(&|ch| at(ch, team + b) - at(ch, team + a))
        );
    }
    println!(
        "  A: barrier to barrier (7 -> next 0): {:.0}",
        avg(&|ch| at(ch, 0) - at(ch - 1, 7))
    );
    // gdn_chunk_state_t64's clock (state block 0: the consumer at slots 0-5, the W and U producer
    // at 8-11; the producer's iteration ch fills chunk ch's buffers while the consumer works on
    // chunk ch - 1)
    if gpu.sm90a {
        let ph = traced_with(&gpu.gdn_state_t64, true);
        let at = |ch: usize, slot: usize| ph[ch * 16 + slot];
        let t64 = [
            (0, 0, 1, "state consumer: wait for W"),
            (0, 1, 2, "state consumer: R product and the S stores"),
            (0, 2, 3, "state consumer: wait for U"),
            (0, 3, 4, "state consumer: e^γ S, wait for K"),
            (0, 4, 5, "state consumer: Vd and the S update"),
            (
                8,
                0,
                1,
                "state producer (W, U): W loads, wait for W's release",
            ),
            (8, 1, 2, "state producer (W, U): W split"),
            (8, 2, 3, "state producer (W, U): U copies (wait)"),
        ];
        for ch in 0..chunks {
            for (team, a, b, name) in t64 {
                assert!(at(ch, team + a) <= at(ch, team + b), "chunk {ch}: {name}");
            }
        }
        println!(
            "gdn_chunk_state_t64_128 block (0, 0), cycles a chunk (chunks 2 .. {}): period {:.0}",
            chunks - 1,
            avg(&|ch| at(ch, 0) - at(ch - 1, 0))
        );
        for (team, a, b, name) in t64 {
            println!(
                "  {name}: {:.0}",
                avg(&|ch| at(ch, team + b) - at(ch, team + a))
            );
        }
        // how far ahead of the consumer's use the producer issued chunk ch's W and U (the same
        // SM's clock)
        let lead = |a: usize, b: usize| {
            span.clone()
                .map(|ch| at(ch, a) as i64 - at(ch, b) as i64)
                .sum::<i64>() as f64
                / span.len() as f64
        };
        println!(
            "  lead: W split done -> consumer waits for it {:.0}, U copies issued -> consumer waits for them {:.0}",
            lead(0, 8 + 2),
            lead(2, 8 + 3)
        );
    }
    // gdn_chunk_prep_wg's clock (value head 0's blocks, chunk ch at 128 + ch), run on its own
    if gpu.sm90a {
        let ph = traced_with(&gpu.gdn_prep_wg, true);
        let at = |ch: usize, slot: usize| ph[ch * 16 + slot];
        let prep = [
            "loads",
            "K split",
            "K Kᵀ | Q Kᵀ",
            "L, −P",
            "T",
            "slice 0: X, Y, stores",
            "slice 1",
        ];
        for ch in 0..chunks {
            for wg in [0, 8] {
                for i in 0..7 {
                    assert!(
                        at(128 + ch, wg + i) <= at(128 + ch, wg + i + 1),
                        "prep chunk {ch} warpgroup {}: slot {i}",
                        wg / 8
                    );
                }
            }
        }
        let all = 0..chunks;
        let mean =
            |f: &dyn Fn(usize) -> u64| all.clone().map(f).sum::<u64>() as f64 / all.len() as f64;
        println!("gdn_chunk_prep_wg_128, value head 0, cycles a block (mean of {chunks}):");
        for wg in [0, 8] {
            let row: Vec<String> = prep
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    let d = mean(&|ch| at(128 + ch, wg + i + 1) - at(128 + ch, wg + i));
                    format!("{name} {d:.0}")
                })
                .collect();
            let total = mean(&|ch| at(128 + ch, wg + 7) - at(128 + ch, wg));
            println!(
                "  warpgroup {}: {} | total {total:.0}",
                wg / 8,
                row.join(", ")
            );
        }
    }
}

/// Time per call of the GDN prefill kernels at the full model's shape over a 4,096-token
/// chunk (one layer's call), new against sequential; printed, not asserted (the target for
/// the chunked delta rule is <= 1 ms).
#[test]
fn gdn_prefill_kernel_timing_full_shape() {
    let Some(gpu) = gpu() else { return };
    let sh = model_gdn_shape(4096);
    let (qkv, g, beta, state) = delta_inputs(&sh, 5);
    let up = |v: &[f32]| gpu.upload(v).unwrap();
    let (qkv, g, beta, state) = (up(&qkv), up(&g), up(&beta), up(&state));
    let o = gpu.alloc(sh.t * sh.hv * sh.dv * 4).unwrap();
    let scratch = gpu.alloc(sh.chunk_scratch_floats() * 4).unwrap();
    let conv_w = up(&Lcg(6).vec(sh.channels() * 4, 0.5));
    let conv_state = gpu.alloc_zeroed(3 * sh.channels() * 4).unwrap();
    let conv_out = gpu.alloc(sh.t * sh.channels() * 4).unwrap();
    let bufs = DeltaBufs {
        qkv: qkv.ptr,
        g: g.ptr,
        beta: beta.ptr,
        state: state.ptr,
        o: o.ptr,
    };
    let time_ms = |reps: usize, f: &dyn Fn()| gpu_time_ms(&gpu, reps, f);
    use std::sync::atomic::Ordering::Relaxed;
    let default_wg = gpu.gdn_state_wg.load(Relaxed);
    let default_t64 = gpu.gdn_state_t64.load(Relaxed);
    let default_prep_wg = gpu.gdn_prep_wg.load(Relaxed);
    let mut chunked_by_pass = String::new();
    for (prep_wg, wg, t64) in [
        (false, false, false),
        (false, true, false),
        (true, true, false),
        (false, false, true),
    ] {
        if (wg && !default_wg) || ((prep_wg || t64) && !gpu.sm90a) {
            continue;
        }
        gpu.gdn_state_wg.store(wg, Relaxed);
        gpu.gdn_state_t64.store(t64, Relaxed);
        gpu.gdn_prep_wg.store(prep_wg, Relaxed);
        let ms = time_ms(10, &|| {
            gpu.gdn_delta_chunked(&sh, &bufs, scratch.ptr).unwrap()
        });
        let name = |on| if on { "wgmma" } else { "mma.sync" };
        let state = if t64 {
            "Sᵀ-register 3xBF16"
        } else {
            name(wg)
        };
        chunked_by_pass += &format!(" {ms:.3} ms ({} prep, {state} state pass)", name(prep_wg));
    }
    gpu.gdn_state_wg.store(default_wg, Relaxed);
    gpu.gdn_state_t64.store(default_t64, Relaxed);
    gpu.gdn_prep_wg.store(default_prep_wg, Relaxed);
    let chunked = chunked_by_pass;
    let recurrent = time_ms(2, &|| gpu.gdn_delta_recurrent(&sh, &bufs).unwrap());
    // The conv reads the normalised qkv as its input: any finite numbers do for timing.
    let conv = |f: fn(&Gpu, &GdnShape, usize, ConvRows, u64, u64, u64) -> anyhow::Result<()>| {
        time_ms(10, &|| {
            f(
                &gpu,
                &sh,
                4,
                ConvRows::packed(qkv.ptr),
                conv_state.ptr,
                conv_w.ptr,
                conv_out.ptr,
            )
            .unwrap()
        })
    };
    let (conv_new, conv_old) = (conv(Gpu::gdn_conv_prefill), conv(Gpu::gdn_conv_sequential));
    println!(
        "{sh:?}: delta rule chunked{chunked}, recurrent {recurrent:.3} ms; conv prefill {conv_new:.3} ms, sequential {conv_old:.3} ms"
    );
}

/// `Gpu::gemm` through each path (cuBLASLt, cublasGemmEx) against an f64
/// product: y = x·Wᵀ, then y += x·Wᵀ, into rows wider than n, at 70 rows, then 65 and 80 (the
/// same bucket of row counts: cuBLASLt reuses the algorithm it chose at 70); then the time per
/// call of each path at the model's prefill projection shapes over 8,192 tokens (printed, not
/// asserted).
#[test]
fn gemm_paths_match_reference_and_timing() {
    let Some(gpu) = gpu() else { return };
    let bf = |v: Vec<f32>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_f32).collect() };
    let (tmax, n, k, ldy) = (80, 96, 136, 100);
    let mut rng = Lcg(3);
    let (w, x, y0) = (
        bf(rng.vec(n * k, 1.0)),
        bf(rng.vec(tmax * k, 1.0)),
        rng.vec(tmax * ldy, 1.0),
    );
    let (wd, xd) = (gpu.upload(&w).unwrap(), gpu.upload(&x).unwrap());
    let mut want = vec![0f32; tmax * ldy];
    for (r, row) in want.chunks_mut(ldy).enumerate() {
        for (c, out) in row.iter_mut().enumerate().take(n) {
            let dot: f64 = (0..k)
                .map(|i| f64::from(w[c * k + i].to_f32()) * f64::from(x[r * k + i].to_f32()))
                .sum();
            *out = dot as f32;
        }
    }
    let paths = [GemmPath::Lt, GemmPath::Ex];
    for t in [70, 65, 80] {
        for path in paths {
            gpu.set_gemm_path(path);
            for beta in [0.0f32, 1.0] {
                let yd = gpu.upload(&y0).unwrap();
                gpu.gemm(wd.ptr, n, k, xd.ptr, t, yd.ptr, ldy, beta)
                    .unwrap();
                let mut got = vec![0f32; tmax * ldy];
                gpu.copy_to_host(yd.ptr, &mut got).unwrap();
                for (r, (g, w)) in got.chunks(ldy).zip(want.chunks(ldy)).enumerate() {
                    let y0r = &y0[r * ldy..(r + 1) * ldy];
                    for c in 0..ldy {
                        // rows past t untouched
                        let expect = if c < n && r < t {
                            w[c] + beta * y0r[c]
                        } else {
                            y0r[c]
                        };
                        assert!(
                            (g[c] - expect).abs() <= 1e-3 * (1.0 + expect.abs()),
                            "{path:?} t {t} beta {beta}: y[{r}, {c}] = {} vs {expect}",
                            g[c]
                        );
                    }
                }
            }
        }
    }
    let t = 8192;
    let x = gpu.alloc(t * 4096 * 2).unwrap();
    gpu.fill_random(x.ptr, t * 4096, false, 1, 0.0, 1.0)
        .unwrap();
    for (n, k) in [
        (8192, 2048),
        (4096, 2048),
        (2048, 4096),
        (12352, 2048),
        (1024, 2048),
    ] {
        let w = gpu.alloc(n * k * 2).unwrap();
        gpu.fill_random(w.ptr, n * k, false, 2, 0.0, 0.02).unwrap();
        let y = gpu.alloc(t * n * 4).unwrap();
        let mut line = format!("gemm {n}x{k} t={t}:");
        for path in paths {
            gpu.set_gemm_path(path);
            gpu.gemm(w.ptr, n, k, x.ptr, t, y.ptr, n, 0.0).unwrap();
            gpu.sync().unwrap();
            let t0 = std::time::Instant::now();
            for _ in 0..10 {
                gpu.gemm(w.ptr, n, k, x.ptr, t, y.ptr, n, 0.0).unwrap();
            }
            gpu.sync().unwrap();
            let us = t0.elapsed().as_secs_f64() * 1e5;
            let tflops = 2.0 * (t * n * k) as f64 / us / 1e6;
            line += &format!(" {path:?} {us:.0} us ({tflops:.0} TFLOP/s)");
        }
        println!("{line}");
    }
    gpu.set_gemm_path(GemmPath::from_env().unwrap());
}

/// The decode GEMV kernels (`gemv_dec`; `gemv_dec_w`, k = 4096 a warp per whole row) against
/// an f64 product with bf16 inputs, y = y0 + W·x, at the model's inner dimensions (512 experts'
/// down, 2,048 in-projections, 4,096 out-projections) and ragged row counts.
#[test]
fn decode_gemv_kernels_match_reference() {
    let Some(gpu) = gpu() else { return };
    let bf = |v: Vec<f32>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_f32).collect() };
    for (n, k) in [(300, 4096), (2048, 4096), (100, 2048), (70, 512)] {
        let mut rng = Lcg(n as u64 * 7 + k as u64);
        let (w, x, y0) = (
            bf(rng.vec(n * k, 1.0)),
            bf(rng.vec(k, 1.0)),
            rng.vec(n, 1.0),
        );
        let want: Vec<f64> = (0..n)
            .map(|r| {
                let dot: f64 = (0..k)
                    .map(|i| f64::from(w[r * k + i].to_f32()) * f64::from(x[i].to_f32()))
                    .sum();
                dot + f64::from(y0[r])
            })
            .collect();
        let (wd, xd) = (gpu.upload(&w).unwrap(), gpu.upload(&x).unwrap());
        for (kernel, rows) in [
            ("gemv_dec", if k == 4096 { 4 } else { 16 }),
            ("gemv_dec_w", if k == 4096 { 8 } else { 16 }),
        ] {
            let yd = gpu.upload(&y0).unwrap();
            let mut args = vec![
                Arg::Ptr(wd.ptr),
                Arg::I(n as i32),
                Arg::I(k as i32),
                Arg::Ptr(xd.ptr),
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::F(0.0),
                Arg::Ptr(0),
                Arg::Ptr(yd.ptr),
                Arg::F(1.0),
            ];
            args.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::I(0)]);
            args.extend([Arg::Ptr(0), Arg::Ptr(0)]);
            let grid = (n.div_ceil(rows) as u32, 1, 1);
            gpu.launch(kernel, grid, 256, (k * 4) as u32, &args)
                .unwrap();
            let mut got = vec![0f32; n];
            gpu.copy_to_host(yd.ptr, &mut got).unwrap();
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (f64::from(*g) - w).abs() / (1.0 + w.abs()))
                .fold(0.0, f64::max);
            println!("{kernel} n {n} k {k}: max err {err:.2e}");
            assert!(err <= 1e-4, "{kernel} n {n} k {k}: {err}");
        }
    }
}

/// One prefill attention call at the real attention shape (head dim 256, 16 query heads over 2
/// KV heads) through `kernel`: q/gate f32, K/V cache bf16 holding `past + t` positions.
struct AttnCase {
    t: usize,
    past: usize,
    q: Vec<f32>,
    qg: Vec<f32>,
    k: Vec<half::bf16>,
    v: Vec<half::bf16>,
}

const ATT_NQ: usize = 16;
const ATT_NKV: usize = 2;
const ATT_HD: usize = 256;

impl AttnCase {
    fn new(t: usize, past: usize, seed: u64) -> Self {
        let mut r = Lcg(seed);
        let n = past + t;
        let bf = |v: Vec<f32>| v.into_iter().map(half::bf16::from_f32).collect::<Vec<_>>();
        AttnCase {
            t,
            past,
            q: r.vec(t * ATT_NQ * ATT_HD, 3.0),
            qg: r.vec(t * ATT_NQ * 2 * ATT_HD, 2.0),
            k: bf(r.vec(n * ATT_NKV * ATT_HD, 1.0)),
            v: bf(r.vec(n * ATT_NKV * ATT_HD, 1.0)),
        }
    }

    /// Causal attention with the sigmoid output gate, in f64 from the same (bf16) inputs.
    fn reference(&self) -> Vec<f32> {
        let (hd, nq, nkv) = (ATT_HD, ATT_NQ, ATT_NKV);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0f32; self.t * nq * hd];
        for s in 0..self.t {
            let pos = self.past + s;
            for h in 0..nq {
                let kvh = h / (nq / nkv);
                let q = &self.q[(s * nq + h) * hd..][..hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|p| {
                        let k = &self.k[(p * nkv + kvh) * hd..][..hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * b.to_f64())
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for c in 0..hd {
                    let acc: f64 = (0..=pos)
                        .map(|p| w[p] * self.v[(p * nkv + kvh) * hd + c].to_f64())
                        .sum();
                    let gate = self.qg[(s * nq + h) * 2 * hd + hd + c] as f64;
                    out[(s * nq + h) * hd + c] = (acc / z / (1.0 + (-gate).exp())) as f32;
                }
            }
        }
        out
    }

    /// Runs the `kind` kernel; returns the output and, with `reps > 0`, the mean
    /// milliseconds per call.
    fn run(&self, gpu: &Gpu, kind: Flash, reps: usize) -> (Vec<f32>, f64) {
        self.run_clustered(gpu, kind, 1, reps)
    }

    /// [`AttnCase::run`] with `attn_flash4` in clusters of `cluster` blocks.
    fn run_clustered(
        &self,
        gpu: &Gpu,
        kind: Flash,
        cluster: usize,
        reps: usize,
    ) -> (Vec<f32>, f64) {
        let (q, qg) = (gpu.upload(&self.q).unwrap(), gpu.upload(&self.qg).unwrap());
        let (k, v) = (gpu.upload(&self.k).unwrap(), gpu.upload(&self.v).unwrap());
        let out = gpu.alloc_zeroed(self.t * ATT_NQ * ATT_HD * 2).unwrap();
        let call = FlashCall {
            q_prep: None,
            q: q.ptr,
            k_cache: k.ptr,
            v_cache: v.ptr,
            qg: qg.ptr,
            out: out.ptr,
            t: self.t,
            past: self.past,
            nq: ATT_NQ,
            nkv: ATT_NKV,
            hd: ATT_HD,
        };
        let ms = gpu_time_ms(gpu, reps, || {
            gpu.attn_flash_clustered(kind, &call, cluster).unwrap()
        });
        let mut host = vec![half::bf16::ZERO; self.t * ATT_NQ * ATT_HD];
        gpu.copy_to_host(out.ptr, &mut host).unwrap();
        (host.iter().map(|x| x.to_f32()).collect(), ms)
    }
}

/// `attn_flash4` in clusters of 2 and 4 head pairs (each K/V tile copied once a cluster by
/// multicast tensor copies) against single blocks (every block copying its tiles): the same
/// tiles in shared memory, so the outputs bitwise equal, from an empty cache, after cached
/// positions, ragged; then the time of each at 8,192 tokens from 0 and 4,096 after 4,096.
#[test]
fn attn_flash4_clusters_match_single_blocks() {
    let Some(gpu) = gpu() else { return };
    if !gpu.flash_preps_q(Flash::Wgmma, ATT_NQ, ATT_NKV, ATT_HD, 32) {
        println!("SKIPPED: attn_flash4 needs sm_90a");
        return;
    }
    for (t, past) in [(77, 190), (300, 0), (129, 64)] {
        let case = AttnCase::new(t, past, 70 + t as u64);
        let (one, _) = case.run_clustered(&gpu, Flash::Wgmma, 1, 0);
        for cs in [2, 4] {
            let (c, _) = case.run_clustered(&gpu, Flash::Wgmma, cs, 0);
            let differ = one
                .iter()
                .zip(&c)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            println!(
                "t {t} past {past}: clusters of {cs}: {differ} of {} outputs differ",
                one.len()
            );
            assert_eq!(differ, 0, "t {t} past {past} clusters of {cs}");
        }
    }
    for (t, past) in [(8192, 0), (4096, 4096)] {
        let case = AttnCase::new(t, past, 5);
        let pairs: usize = (0..t).map(|s| past + s + 1).sum();
        let flop = (4 * ATT_HD * ATT_NQ * pairs) as f64;
        let mut line = format!("t {t} past {past}:");
        let (one, _) = case.run_clustered(&gpu, Flash::Wgmma, 1, 0);
        for cs in [1, 2, 4] {
            let (c, ms) = case.run_clustered(&gpu, Flash::Wgmma, cs, 5);
            assert!(
                one == c,
                "t {t} past {past} clusters of {cs}: outputs differ"
            );
            line += &format!(
                " clusters of {cs} {ms:.3} ms ({:.0} TFLOP/s);",
                flop / ms / 1e9
            );
        }
        println!("{line}");
    }
}

/// One layer's prefill attention the two ways: attn_prep_rows on all heads writing q, then
/// attn_flash4 reading it; or attn_prep_rows on the KV heads only and attn_flash4 preparing the
/// queries from qg itself (`FlashCall::q_prep`). Returns the output, the caches, the separate
/// way's q and, with `reps`, the milliseconds of prep + attention.
struct QPrepCase {
    t: usize,
    past: usize,
    qg: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    inv_freq: Vec<f32>,
    cache: Vec<half::bf16>,
}

/// Output, K cache, V cache, q, ms.
type QPrepRun = (Vec<f32>, Vec<half::bf16>, Vec<half::bf16>, Vec<f32>, f64);

impl QPrepCase {
    const ROT_HALF: usize = 32;

    fn new(t: usize, past: usize, seed: u64) -> Self {
        let mut r = Lcg(seed);
        let (nq, nkv, hd) = (ATT_NQ, ATT_NKV, ATT_HD);
        let rh = Self::ROT_HALF;
        QPrepCase {
            t,
            past,
            qg: r.vec(t * nq * 2 * hd, 2.0),
            k: r.vec(t * nkv * hd, 2.0),
            v: r.vec(t * nkv * hd, 1.0),
            q_norm: r.vec(hd, 0.5),
            k_norm: r.vec(hd, 0.5),
            inv_freq: (0..rh)
                .map(|i| 10_000f32.powf(-(i as f32) / rh as f32))
                .collect(),
            cache: r
                .vec((past + t) * nkv * hd, 1.0)
                .into_iter()
                .map(half::bf16::from_f32)
                .collect(),
        }
    }

    fn run(&self, gpu: &Gpu, fused: bool, reps: usize) -> QPrepRun {
        let (t, nq, nkv, hd) = (self.t, ATT_NQ, ATT_NKV, ATT_HD);
        let up = |v: &[f32]| gpu.upload(v).unwrap();
        let (qg, k, v) = (up(&self.qg), up(&self.k), up(&self.v));
        let (qn, kn, invf) = (up(&self.q_norm), up(&self.k_norm), up(&self.inv_freq));
        let (kc, vc) = (
            gpu.upload(&self.cache).unwrap(),
            gpu.upload(&self.cache).unwrap(),
        );
        // NaN: the fused way must not read q
        let q = up(&vec![f32::NAN; t * nq * hd]);
        let out = gpu.alloc_zeroed(t * nq * hd * 2).unwrap();
        let h0 = if fused { nq } else { 0 };
        let eps = 1e-6f32;
        let once = || {
            let args = [
                Arg::Ptr(qg.ptr),
                Arg::Ptr(k.ptr),
                Arg::Ptr(v.ptr),
                Arg::Ptr(qn.ptr),
                Arg::Ptr(kn.ptr),
                Arg::Ptr(invf.ptr),
                Arg::Ptr(q.ptr),
                Arg::Ptr(kc.ptr),
                Arg::Ptr(vc.ptr),
                Arg::I(self.past as i32),
                Arg::I(t as i32),
                Arg::I(nq as i32),
                Arg::I(nkv as i32),
                Arg::I(hd as i32),
                Arg::I(Self::ROT_HALF as i32),
                Arg::F(eps),
                Arg::I(h0 as i32),
            ];
            let grid = ((t * (nq + nkv - h0)).div_ceil(8) as u32, 1, 1);
            gpu.launch("attn_prep_rows", grid, 256, (8 * hd * 4) as u32, &args)
                .unwrap();
            let call = FlashCall {
                q_prep: fused.then_some(QPrep {
                    q_norm: qn.ptr,
                    inv_freq: invf.ptr,
                    rot_half: Self::ROT_HALF,
                    eps,
                }),
                q: q.ptr,
                k_cache: kc.ptr,
                v_cache: vc.ptr,
                qg: qg.ptr,
                out: out.ptr,
                t,
                past: self.past,
                nq,
                nkv,
                hd,
            };
            gpu.attn_flash(Flash::Wgmma, &call).unwrap();
        };
        let ms = gpu_time_ms(gpu, reps, once);
        let mut o = vec![half::bf16::ZERO; t * nq * hd];
        gpu.copy_to_host(out.ptr, &mut o).unwrap();
        let mut kh = vec![half::bf16::ZERO; self.cache.len()];
        let mut vh = kh.clone();
        gpu.copy_to_host(kc.ptr, &mut kh).unwrap();
        gpu.copy_to_host(vc.ptr, &mut vh).unwrap();
        let mut qh = vec![0f32; t * nq * hd];
        gpu.copy_to_host(q.ptr, &mut qh).unwrap();
        (o.iter().map(|x| x.to_f32()).collect(), kh, vh, qh, ms)
    }
}

/// attn_flash4 preparing the query heads itself (RMSNorm and partial rotation on the way into
/// shared memory; `FlashCall::q_prep`) against attn_prep_rows writing q for it: the KV cache
/// rows bitwise equal, the outputs within 1e-3 of each other (the same sums in the same order,
/// so equal unless the compiler contracts a product differently), both within 1e-2 of the f64
/// attention of the separate way's q (chunked: after cached positions, ragged lengths); then
/// both ways timed at 8,192 tokens.
#[test]
fn attn_flash4_fused_q_prep_matches_separate() {
    let Some(gpu) = gpu() else { return };
    let rh = QPrepCase::ROT_HALF;
    if !gpu.flash_preps_q(Flash::Wgmma, ATT_NQ, ATT_NKV, ATT_HD, rh) {
        println!("SKIPPED: attn_flash4 needs sm_90a");
        return;
    }
    for (t, past) in [(77, 190), (300, 0), (8192, 0)] {
        let case = QPrepCase::new(t, past, 40 + t as u64);
        let reps = if t >= 4096 { 5 } else { 0 };
        let (a, ka, va, q, ms_a) = case.run(&gpu, false, reps);
        let (b, kb, vb, q_b, ms_b) = case.run(&gpu, true, reps);
        assert!(q.iter().all(|x| x.is_finite()), "t {t}: separate q");
        assert!(
            q_b.iter().all(|x| x.is_nan()),
            "t {t}: the fused way wrote q"
        );
        assert!(
            ka == kb && va == vb,
            "t {t} past {past}: KV cache rows differ"
        );
        let diff = norm_rel_err(&b, &a);
        let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        print!(
            "t {t} past {past}: fused vs separate {diff:.2e} ({differing} of {} outputs differ)",
            a.len()
        );
        assert!(diff <= 1e-3, "t {t} past {past}: {diff}");
        if t <= 512 {
            let reference = AttnCase {
                t,
                past,
                q,
                qg: case.qg.clone(),
                k: ka,
                v: va,
            }
            .reference();
            let (ea, eb) = (norm_rel_err(&a, &reference), norm_rel_err(&b, &reference));
            print!(", vs f64 {ea:.2e} / {eb:.2e}");
            assert!(ea <= 1e-2 && eb <= 1e-2, "t {t} past {past}: {ea} / {eb}");
        }
        if reps > 0 {
            print!(", prep + attention {ms_a:.3} ms separate, {ms_b:.3} ms fused");
        }
        println!();
    }
}

/// The wgmma flash kernel (`Flash::Wgmma`: attn_flash4 on sm_90a) and the mma.sync ones
/// (`Flash::Mma`: attn_flash3, unless `KESTREL_ATTN=mma2`; and `Flash::Mma2`: attn_flash2) at
/// the real head shape against an f64 reference, from an empty
/// cache and continuing after cached positions (chunked prefill), ragged lengths included;
/// bound 1e-2 (q and the probabilities enter the tensor cores as bf16, the output is bf16).
/// Then the time of one 4,096-token chunk at positions 0 and 4,096 (the two calls of an 8k
/// prompt), both against the WMMA one, printed with TFLOP/s.
#[test]
fn attn_flash2_matches_reference_full_shape() {
    let Some(gpu) = gpu() else { return };
    for (t, past) in [(100, 0), (77, 190), (129, 64)] {
        let case = AttnCase::new(t, past, 11 + t as u64);
        let want = case.reference();
        let (wg, _) = case.run(&gpu, Flash::Wgmma, 0);
        let (new, _) = case.run(&gpu, Flash::Mma, 0);
        let (v2, _) = case.run(&gpu, Flash::Mma2, 0);
        let (old, _) = case.run(&gpu, Flash::Wmma, 0);
        let (e_new, e_v2) = (norm_rel_err(&new, &want), norm_rel_err(&v2, &want));
        let (e_old, e_wg) = (norm_rel_err(&old, &want), norm_rel_err(&wg, &want));
        println!(
            "t {t} past {past}: flash4 vs f64 {e_wg:.2e}, flash3 {e_new:.2e}, flash2 {e_v2:.2e} (wmma kernel {e_old:.2e})"
        );
        assert!(e_wg <= 1e-2, "t {t} past {past}: flash4 {e_wg}");
        assert!(e_new <= 1e-2, "t {t} past {past}: {e_new}");
        assert!(e_v2 <= 1e-2, "t {t} past {past}: flash2 {e_v2}");
    }
    for past in [0, 4096] {
        let t = 4096;
        let case = AttnCase::new(t, past, 3);
        let pairs: usize = (0..t).map(|s| past + s + 1).sum();
        let flop = (4 * ATT_HD * ATT_NQ * pairs) as f64;
        let (w, ms_wg) = case.run(&gpu, Flash::Wgmma, 5);
        let (a, ms_new) = case.run(&gpu, Flash::Mma, 5);
        let (c, ms_v2) = case.run(&gpu, Flash::Mma2, 5);
        let (b, ms_old) = case.run(&gpu, Flash::Wmma, 3);
        let (diff, diff_v2) = (norm_rel_err(&a, &b), norm_rel_err(&c, &b));
        let diff_wg = norm_rel_err(&w, &b);
        println!(
            "t {t} past {past}: flash4 {ms_wg:.3} ms ({:.0} TFLOP/s), flash3 {ms_new:.3} ms ({:.0} TFLOP/s), flash2 {ms_v2:.3} ms ({:.0} TFLOP/s), wmma {ms_old:.3} ms ({:.0} TFLOP/s); outputs differ by {diff_wg:.2e} / {diff:.2e} / {diff_v2:.2e}",
            flop / ms_wg / 1e9,
            flop / ms_new / 1e9,
            flop / ms_v2 / 1e9,
            flop / ms_old / 1e9
        );
        assert!(diff_wg <= 1e-2, "past {past}: flash4 {diff_wg}");
        assert!(diff <= 1e-2, "past {past}: {diff}");
        assert!(diff_v2 <= 1e-2, "past {past}: flash2 {diff_v2}");
    }
}
