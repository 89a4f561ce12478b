//! The CPU backend against Hugging Face transformers' `qwen3_5_moe` on committed golden
//! fixtures (tiny random-weight checkpoints of the exact architecture; see
//! `tests/fixtures/README.md` and `scripts/make_fixtures.py`).
//!
//! Tolerance: the reference is f32; we require max |Δlogit| <= 1e-3 x max |logit| of the
//! row set compared (the "logit scale"), and identical greedy tokens.

use kestrel::model::{CpuModel, Engine, GdnMode, Logits};
use kestrel::ops::argmax;
mod common;
use common::{Reference, fixtures, fp8_fixtures, read_reference, rel_err};

const REL_TOL: f32 = 1e-3;

/// Prefill in chunks (all positions' logits), then greedy decode; returns the relative
/// error against the reference and the generated ids.
fn run(model: &CpuModel, r: &Reference, chunk: usize) -> (f32, f32, Vec<u32>) {
    let mut state = model.new_state().unwrap();
    let mut prompt_logits = Vec::new();
    for piece in r.prompt_ids.chunks(chunk) {
        prompt_logits.extend(model.forward(&mut state, piece, Logits::All).unwrap());
    }
    let prompt_err = rel_err(&prompt_logits, &r.prompt_logits);
    let last = &prompt_logits[prompt_logits.len() - r.vocab..];
    let mut ids = vec![argmax(last).unwrap() as u32];
    let mut decode_logits = Vec::new();
    for i in 0..r.decode_ids.len() {
        // Feed the reference token so one divergence cannot cascade; the ids are compared.
        let l = model
            .forward(&mut state, &[r.decode_ids[i]], Logits::Last)
            .unwrap();
        if i + 1 < r.decode_ids.len() {
            ids.push(argmax(&l).unwrap() as u32);
        }
        decode_logits.extend(l);
    }
    (prompt_err, rel_err(&decode_logits, &r.decode_logits), ids)
}

#[test]
fn cpu_matches_hf_prefill_and_decode() {
    for dir in fixtures() {
        let model = CpuModel::load(&dir).unwrap();
        let r = read_reference(&dir);
        assert!(r.decode_ids.len() >= 16);
        let (pe, de, ids) = run(&model, &r, r.prompt_ids.len());
        println!(
            "{}: prompt rel err {pe:.2e}, decode rel err {de:.2e}",
            dir.display()
        );
        assert!(
            pe <= REL_TOL,
            "{}: prompt logits rel err {pe}",
            dir.display()
        );
        assert!(
            de <= REL_TOL,
            "{}: decode logits rel err {de}",
            dir.display()
        );
        assert_eq!(ids, r.decode_ids, "{}: greedy tokens", dir.display());
    }
}

#[test]
fn chunked_prefill_equals_one_shot_and_token_by_token() {
    for dir in fixtures() {
        let model = CpuModel::load(&dir).unwrap();
        let r = read_reference(&dir);
        for chunk in [1, 7, 64] {
            let (pe, de, ids) = run(&model, &r, chunk);
            assert!(pe <= REL_TOL, "{} chunk {chunk}: {pe}", dir.display());
            assert!(de <= REL_TOL, "{} chunk {chunk}: {de}", dir.display());
            assert_eq!(ids, r.decode_ids, "{} chunk {chunk}", dir.display());
        }
    }
}

#[test]
fn step_form_gdn_matches_hf_too() {
    for dir in fixtures() {
        let mut model = CpuModel::load(&dir).unwrap();
        model.gdn_mode = GdnMode::Step;
        let r = read_reference(&dir);
        let (pe, de, ids) = run(&model, &r, r.prompt_ids.len());
        assert!(
            pe <= REL_TOL && de <= REL_TOL,
            "{}: {pe} {de}",
            dir.display()
        );
        assert_eq!(ids, r.decode_ids);
    }
}

#[test]
fn snapshot_restored_mid_sequence_continues_identically() {
    for dir in fixtures() {
        let model = CpuModel::load(&dir).unwrap();
        let r = read_reference(&dir);
        let half = r.prompt_ids.len() / 2;
        let mut state = model.new_state().unwrap();
        model
            .forward(&mut state, &r.prompt_ids[..half], Logits::Last)
            .unwrap();
        let snap = state.snapshot();
        let rest = &r.prompt_ids[half..];
        let first = model.forward(&mut state, rest, Logits::All).unwrap();
        let after_first = state.clone();
        // Diverge the live state, then roll back.
        model.forward(&mut state, &[1, 2, 3], Logits::Last).unwrap();
        state.restore(&snap);
        let second = model.forward(&mut state, rest, Logits::All).unwrap();
        assert_eq!(first, second, "{}", dir.display());
        assert_eq!(state, after_first);
        let tail = &r.prompt_logits[half * r.vocab..];
        assert!(rel_err(&second, tail) <= REL_TOL);
    }
}

/// The comparison is sharp enough to catch the classic silent mistakes: each mutation of
/// the weights below mimics one of them and must push the error past the tolerance.
#[test]
fn tolerance_catches_wrong_ops() {
    use kestrel::weights::Mixer;
    let dir = fixtures().pop().unwrap();
    let r = read_reference(&dir);
    type Mutation = fn(&mut kestrel::weights::ModelWeights);
    let mutations: [(&str, Mutation); 4] = [
        ("norm uses w instead of 1+w", |w| {
            for l in &mut w.layers {
                l.input_norm.iter_mut().for_each(|x| *x -= 1.0);
            }
        }),
        ("gated norm uses 1+w", |w| {
            for l in &mut w.layers {
                if let Mixer::Gdn(g) = &mut l.mixer {
                    g.norm.iter_mut().for_each(|x| *x += 1.0);
                }
            }
        }),
        ("shared expert gate forgotten", |w| {
            for l in &mut w.layers {
                l.moe.shared_gate.iter_mut().for_each(|x| *x = 0.0);
            }
        }),
        ("q/k norm uses w instead of 1+w", |w| {
            for l in &mut w.layers {
                if let Mixer::Attention(a) = &mut l.mixer {
                    a.q_norm.iter_mut().for_each(|x| *x -= 1.0);
                    a.k_norm.iter_mut().for_each(|x| *x -= 1.0);
                }
            }
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

/// The FP8 release's on-disk format (`tests/fixtures/tiny-official-fp8`, quantised by
/// transformers' own `Fp8Quantize`): the CPU backend keeps the e4m3 bytes and dequantises on
/// the fly; the reference is transformers in f32 on the dequantised weights (which
/// transformers' FP8 loader reproduces exactly on CPU). Same bar as the bf16 fixtures:
/// max |Δlogit| <= 1e-3 x max |logit|, and every greedy token identical, teacher-forced and
/// free-running, over all 64 steps (the fixture's smallest top-2 margin is 0.09). Chunk sizes
/// 1 and 7 run the decode-sized FP8 kernel (`matmul_fp8_direct`), 64 and the whole prompt the
/// widening GEMM.
#[test]
fn cpu_fp8_matches_hf_on_the_fp8_fixture() {
    for dir in fp8_fixtures() {
        let model = CpuModel::load(&dir).unwrap();
        assert_eq!(model.weights.format(), "fp8 e4m3 block 128x128");
        let r = read_reference(&dir);
        assert!(r.decode_ids.len() >= 64);
        for chunk in [r.prompt_ids.len(), 64, 7, 1] {
            let (pe, de, ids) = run(&model, &r, chunk);
            println!(
                "{} chunk {chunk}: prompt rel err {pe:.2e}, decode rel err {de:.2e}",
                dir.display()
            );
            assert!(
                pe <= REL_TOL,
                "{} chunk {chunk}: prompt {pe}",
                dir.display()
            );
            assert!(
                de <= REL_TOL,
                "{} chunk {chunk}: decode {de}",
                dir.display()
            );
            assert_eq!(ids, r.decode_ids, "{} chunk {chunk}", dir.display());
        }
        // Free-running greedy: our own tokens fed back give the reference's sequence.
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
        assert_eq!(ids, r.decode_ids, "{}: free-running greedy", dir.display());
    }
}

/// The fixture's FP8 weights really are what is multiplied: ignoring the block scales (or
/// reading the bytes as if they were the dequantised values) fails the bar by far.
#[test]
fn fp8_fixture_needs_its_block_scales() {
    use kestrel::weights::Mixer;
    let dir = fp8_fixtures().pop().unwrap();
    let r = read_reference(&dir);
    let mut model = CpuModel::load(&dir).unwrap();
    for l in &mut model.weights.layers {
        if let Mixer::Attention(a) = &mut l.mixer {
            let s = a.o.scales.as_mut().unwrap();
            s.values = std::sync::Arc::new(vec![1.0; s.values.len()]);
        }
    }
    let logits = model
        .forward(&mut model.new_state().unwrap(), &r.prompt_ids, Logits::All)
        .unwrap();
    let e = rel_err(&logits, &r.prompt_logits);
    assert!(e > 10.0 * REL_TOL, "unscaled o_proj: error {e} would pass");
}
