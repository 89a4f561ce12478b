//! The CUDA kernels one by one against references (f64 products, the sequential kernels, or
//! the CPU), at the model's shapes where the tiny fixtures do not reach them. Its own harness
//! (`main`, through `common::gpu_main`): each test is reported ignored with the reason where
//! it cannot run (not asked for, or no usable GPU); run on the H200 by `scripts/gpu_check.sh`.
//! Timing lives in `kestrel bench`, not here.

use kestrel::cuda::attention::{FlashCall, QPrep};
use kestrel::cuda::gdn::{ConvRows, DeltaBufs, GdnShape};
use kestrel::cuda::kernels::misc::ArgmaxRows;
use kestrel::cuda::kernels::moe_route::MoeGemvSorted;
use kestrel::cuda::kernels::{Dev, On, Untyped};
use kestrel::cuda::moe::{self, Grouped, GroupedOut, MoePlan};
use kestrel::cuda::{Arg, Gpu};
mod common;
use common::{Lcg, gpu, norm_rel_err, rel_err};

fn bf16_to_f32(v: &[u16]) -> Vec<f32> {
    v.iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect()
}

/// The grouped GEMM (`moe_gemm6`, what prefill's MoE runs) at the model's expert shape (hidden
/// 2,048, 256 experts of 512, top-8): gate/up with the SwiGLU fused into bf16 act, then down
/// into f32 y and into bf16 y, all into NaN-filled outputs (a missed row or column fails),
/// over 4,096 tokens routed ~9:1 from the first expert to the last, 2,048 routed uniformly and
/// 40 (a few rows an expert: partial tiles). Against f64 products of the same bf16 inputs on a
/// sample of rows: act within bf16 rounding, y (from the GPU's act) within 1e-4 of its row's
/// scale, bf16 y bitwise bf16(f32 y); the kernels' item counter back at zero. Then the few-row
/// path (`moe_gemv_sorted`, batched decode steps) the same way: 8 tokens (a batch of 8), 1, and
/// 16 routed ~9:1 (a hot expert's rows in a run).
fn moe_grouped_gemm_matches_reference_full_shape() {
    let gpu = gpu();
    for (t, skewed) in [(4096, true), (2048, false), (40, false)] {
        moe_grouped_case(&gpu, t, skewed, false);
    }
    for (t, skewed) in [(8, false), (1, false), (16, true)] {
        moe_grouped_case(&gpu, t, skewed, true);
    }
}

/// One chunk of `t` tokens for [`moe_grouped_gemm_matches_reference_full_shape`], on the
/// grouped GEMM or (`tiles`) the few-row GEMVs over sorted rows.
fn moe_grouped_case(gpu: &Gpu, t: usize, skewed: bool, tiles: bool) {
    let (d, i, e, k) = (2048usize, 512usize, 256usize, 8usize);
    let rows = t * k;
    let mut rng = Lcg(23 + t as u64);
    let weight: Vec<f32> = (0..e)
        .map(|x| {
            if skewed {
                1.0 / (1.0 + x as f32 / 32.0)
            } else {
                1.0
            }
        })
        .collect();
    let total: f32 = weight.iter().sum();
    let (mut topk, mut counts) = (Vec::with_capacity(rows), vec![0i32; e]);
    for _ in 0..t {
        let mut chosen: Vec<usize> = Vec::with_capacity(k);
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
    let max_tiles = moe::max_tiles(rows, e).max(rows);
    let i32buf = |n: usize| gpu.alloc(n * 4).unwrap();
    let (counts_d, topk_d) = (gpu.upload(&counts).unwrap(), gpu.upload(&topk).unwrap());
    let (offsets, cursor, num_tiles) = (i32buf(e + 1), i32buf(e), i32buf(1));
    // the kernels' item counter: zero before the first launch, and each leaves it at zero
    let claim = i32buf(1);
    gpu.memset_zero(claim.ptr, 4).unwrap();
    let (tile_expert, tile_row, tile_rows) =
        (i32buf(max_tiles), i32buf(max_tiles), i32buf(max_tiles));
    let (sorted_token, slot_row) = (i32buf(rows), i32buf(rows));
    let plan = MoePlan {
        counts: counts_d.i32(),
        offsets: offsets.i32(),
        cursor: cursor.i32(),
        tile_expert: tile_expert.i32(),
        tile_row: tile_row.i32(),
        tile_rows: tile_rows.i32(),
        num_tiles: num_tiles.i32(),
        claim: claim.i32(),
    };
    let random_bf16 = |n: usize, seed: u64, std: f32| {
        let b = gpu.alloc(n * 2).unwrap();
        gpu.fill_random(b.ptr, n, false, seed, 0.0, std).unwrap();
        b
    };
    let xb = random_bf16(t * d, 1, 1.0);
    let w_gu = random_bf16(e * 2 * i * d, 2, 1.0 / (d as f32).sqrt());
    let w_down = random_bf16(e * d * i, 3, 1.0 / (i as f32).sqrt());
    let tile_m = if tiles { 1 } else { moe::TILE_M };
    gpu.moe_plan(&plan, e, tile_m).unwrap();
    gpu.moe_scatter(
        topk_d.i32(),
        rows,
        k,
        cursor.i32(),
        sorted_token.i32(),
        slot_row.i32(),
    )
    .unwrap();
    let nan_bf16 = |n: usize| gpu.upload(&vec![0x7fc0u16; n]).unwrap();
    let (act, y16) = (nan_bf16(rows * i), nan_bf16(rows * d));
    let y = gpu.upload(&vec![f32::NAN; rows * d]).unwrap();
    let gate_up = Grouped {
        a: xb.bf16(),
        gather: sorted_token.i32(),
        w: w_gu.bf16(),
        out: act.bf16().into(),
        ndim: 2 * i,
        kdim: d,
    };
    let down = |out: Untyped| Grouped {
        a: act.bf16(),
        gather: Dev::null(),
        w: w_down.bf16(),
        out,
        ndim: d,
        kdim: i,
    };
    if tiles {
        // a tile a row: tile_expert is each sorted row's expert
        let gemv = |a: Dev<half::bf16>, gather: Dev<i32>, w: Dev<half::bf16>, out, nf, kdim| {
            MoeGemvSorted {
                a,
                gather,
                w,
                out,
                expert: plan.tile_expert,
                nf: nf as i32,
                kdim: kdim as i32,
            }
        };
        gemv(
            xb.bf16(),
            sorted_token.i32(),
            w_gu.bf16(),
            act.bf16().into(),
            i,
            d,
        )
        .launch(gpu, true, rows, e)
        .unwrap();
        gemv(act.bf16(), Dev::null(), w_down.bf16(), y.f32().into(), d, i)
            .launch(gpu, false, rows, e)
            .unwrap();
    } else {
        gpu.moe_grouped(GroupedOut::SwiGlu, &plan, rows, e, &gate_up, false)
            .unwrap();
        gpu.moe_grouped(
            GroupedOut::F32,
            &plan,
            rows,
            e,
            &down(y.f32().into()),
            false,
        )
        .unwrap();
        gpu.moe_grouped(
            GroupedOut::Bf16,
            &plan,
            rows,
            e,
            &down(y16.bf16().into()),
            false,
        )
        .unwrap();
    }
    let u16s = |b: &kestrel::cuda::DeviceBuf, n: usize| {
        let mut v = vec![0u16; n];
        gpu.copy_to_host(b.ptr, &mut v).unwrap();
        v
    };
    let i32s = |b: &kestrel::cuda::DeviceBuf, n: usize| {
        let mut v = vec![0i32; n];
        gpu.copy_to_host(b.ptr, &mut v).unwrap();
        v
    };
    let act_h = bf16_to_f32(&u16s(&act, rows * i));
    // the few-row path writes no bf16 y: take f32 y's rounding in its place
    let y16_h = if tiles {
        let mut v = vec![0f32; rows * d];
        gpu.copy_to_host(y.ptr, &mut v).unwrap();
        kestrel::ops::gemm::round_bf16(&v)
    } else {
        bf16_to_f32(&u16s(&y16, rows * d))
    };
    let mut y_h = vec![0f32; rows * d];
    gpu.copy_to_host(y.ptr, &mut y_h).unwrap();
    assert!(
        act_h
            .iter()
            .chain(&y_h)
            .chain(&y16_h)
            .all(|x| x.is_finite()),
        "t {t}: an output element was not written"
    );
    let rounded = kestrel::ops::gemm::round_bf16(&y_h);
    assert!(
        y16_h
            .iter()
            .zip(&rounded)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "t {t}: bf16 y != bf16(f32 y)"
    );
    assert_eq!(
        i32s(&claim, 1)[0],
        0,
        "t {t}: the item counter was left set"
    );
    // f64 references on a sample of the sorted rows (their tokens and experts from the plan)
    let (x_h, gu_h, dn_h) = (
        u16s(&xb, t * d),
        u16s(&w_gu, e * 2 * i * d),
        u16s(&w_down, e * d * i),
    );
    let bf = |b: u16| f64::from(half::bf16::from_bits(b).to_f32());
    let (sorted, offs) = (i32s(&sorted_token, rows), i32s(&offsets, e + 1));
    let (mut act_err, mut y_err) = (0f64, 0f64);
    let (mut act_got, mut act_want) = (Vec::new(), Vec::new());
    for j in 0..97 {
        let r = if j == 96 { rows - 1 } else { j * 7919 % rows };
        let tok = sorted[r] as usize;
        let x = offs.partition_point(|&o| o as usize <= r) - 1;
        assert!(
            (offs[x] as usize..offs[x + 1] as usize).contains(&r) && tok < t,
            "t {t}: row {r}'s plan"
        );
        let xr = &x_h[tok * d..][..d];
        let dot = |w: &[u16]| -> f64 { xr.iter().zip(w).map(|(a, b)| bf(*a) * bf(*b)).sum() };
        let want: Vec<f64> = (0..i)
            .map(|c| {
                let g = dot(&gu_h[(x * 2 * i + c) * d..][..d]);
                let u = dot(&gu_h[(x * 2 * i + i + c) * d..][..d]);
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        let got = &act_h[r * i..][..i];
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        for (g, w) in got.iter().zip(&want) {
            act_err = act_err.max((f64::from(*g) - w).abs() / scale);
        }
        act_got.extend_from_slice(got);
        act_want.extend(want.iter().map(|&v| v as f32));
        let want_y: Vec<f64> = (0..d)
            .map(|c| {
                let w = &dn_h[(x * d + c) * i..][..i];
                got.iter().zip(w).map(|(a, b)| f64::from(*a) * bf(*b)).sum()
            })
            .collect();
        let scale = want_y.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        for (g, w) in y_h[r * d..][..d].iter().zip(&want_y) {
            y_err = y_err.max((f64::from(*g) - w).abs() / scale);
        }
    }
    let act_norm = norm_rel_err(&act_got, &act_want);
    println!(
        "t {t} ({}, {}): act vs f64 max {act_err:.2e} of the row scale, norm {act_norm:.2e}; y max {y_err:.2e}",
        if skewed { "skewed" } else { "uniform" },
        if tiles {
            "moe_gemv_sorted"
        } else {
            "moe_gemm6"
        }
    );
    assert!(
        act_err <= 1e-2 && act_norm <= 3e-3,
        "t {t}: act {act_err} {act_norm}"
    );
    assert!(y_err <= 1e-4, "t {t}: y {y_err}");
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
        qkv: qkv.f32(),
        g: g.f32(),
        beta: beta.f32(),
        state: state.f32(),
        o: o.f32(),
    };
    if chunked {
        gpu.gdn_delta_chunked(sh, &bufs, scratch.f32()).unwrap();
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
/// f32 (`gdn_chunk_state_t64`'s 3xBF16 products, ~1e-5-level, within a 1e-4 bound): at the full
/// model's head dims (dk = dv = 128) with its 16 key and 32 value heads over 300 tokens (a
/// partial last chunk) and 2 tokens, and with the fixtures' few heads (one or two value heads a
/// key head).
fn gdn_chunked_kernel_matches_recurrent() {
    let gpu = gpu();
    let shape = |t, hk, hv, dk, dv| GdnShape { t, hk, hv, dk, dv };
    for sh in [
        model_gdn_shape(300),
        model_gdn_shape(2),
        shape(64, 2, 4, 128, 128),
        shape(130, 4, 8, 128, 128),
        shape(37, 2, 2, 128, 128),
    ] {
        assert!(
            sh.chunked_fits(gpu.max_smem_per_block, gpu.sm_count),
            "{sh:?}"
        );
        let inputs = delta_inputs(&sh, 42 + sh.t as u64);
        let (o_r, s_r) = run_delta(&gpu, &sh, &inputs, false);
        let (o_c, s_c) = run_delta(&gpu, &sh, &inputs, true);
        let (eo, es) = (rel_err(&o_c, &o_r), rel_err(&s_c, &s_r));
        let pass = "Sᵀ-register 3xBF16";
        println!(
            "{sh:?} ({pass} state pass): chunked vs recurrent o max {eo:.2e} norm {:.2e}, state max {es:.2e} norm {:.2e}",
            norm_rel_err(&o_c, &o_r),
            norm_rel_err(&s_c, &s_r)
        );
        assert!(o_c.iter().chain(&s_c).all(|x| x.is_finite()), "{sh:?}");
        assert!(eo <= 1e-4 && es <= 1e-4, "{sh:?}: o {eo} state {es}");
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
fn gdn_conv_prefill_matches_sequential() {
    let gpu = gpu();
    let kern = 4;
    for (t, hk, hv, dk, dv, pad) in [
        (2, 16, 32, 128, 128, 4160),
        (300, 16, 32, 128, 128, 4160),
        (300, 16, 32, 128, 128, 0),
        (1, 2, 4, 128, 128, 0),
        (5, 2, 4, 128, 128, 13),
        (70, 4, 8, 128, 128, 0),
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
                p: p.f32(),
                ld: c + pad,
            };
            f(&gpu, &sh, kern, rows, st.f32(), w.f32(), out.f32()).unwrap();
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

/// `Gpu::gemm` (cuBLASLt) against an f64 product: y = x·Wᵀ, then y += x·Wᵀ, into rows wider
/// than n, at 70 rows, then 65 and 80 (the same bucket of row counts: cuBLASLt reuses the
/// algorithm it chose at 70), on the main and the second stream.
fn gemm_matches_reference() {
    let gpu = gpu();
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
    for t in [70, 65, 80] {
        for aux in [false, true] {
            for beta in [0.0f32, 1.0] {
                let yd = gpu.upload(&y0).unwrap();
                if aux {
                    gpu.fork_aux().unwrap();
                    gpu.gemm_aux(wd.ptr, n, k, xd.ptr, t, yd.ptr, ldy, beta)
                        .unwrap();
                    gpu.join_aux().unwrap();
                } else {
                    gpu.gemm(wd.ptr, n, k, xd.ptr, t, yd.ptr, ldy, beta)
                        .unwrap();
                }
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
                            "aux {aux} t {t} beta {beta}: y[{r}, {c}] = {} vs {expect}",
                            g[c]
                        );
                    }
                }
            }
        }
    }
}

/// The decode GEMV kernels (`gemv_dec`; `gemv_dec_w`, k = 4096 a warp per whole row) against
/// an f64 product with bf16 inputs, y = y0 + W·x, at the model's inner dimensions (512 experts'
/// down, 2,048 in-projections, 4,096 out-projections) and ragged row counts.
fn decode_gemv_kernels_match_reference() {
    let gpu = gpu();
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
/// KV heads): q/gate f32, K/V cache bf16 holding `past + t` positions.
struct AttnCase {
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
    /// Causal attention with the sigmoid output gate, in f64 from the same (bf16) inputs, for
    /// the new positions `rows` (`[rows.len(), nq, hd]`).
    fn reference_rows(&self, rows: &[usize]) -> Vec<f32> {
        let (hd, nq, nkv) = (ATT_HD, ATT_NQ, ATT_NKV);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0f32; rows.len() * nq * hd];
        for (ri, &s) in rows.iter().enumerate() {
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
                    out[(ri * nq + h) * hd + c] = (acc / z / (1.0 + (-gate).exp())) as f32;
                }
            }
        }
        out
    }
}

/// One layer's prefill attention the two ways: attn_prep_rows on all heads writing q, then
/// attn_flash3 reading it; or attn_prep_rows on the KV heads only and attn_flash4 preparing the
/// queries from qg itself (`FlashCall::q_prep`). Returns the output, the caches and the
/// separate way's q.
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

/// Output, K cache, V cache, q.
type QPrepRun = (Vec<f32>, Vec<half::bf16>, Vec<half::bf16>, Vec<f32>);

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

    fn run(&self, gpu: &Gpu, fused: bool) -> QPrepRun {
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
            if fused {
                gpu.attn_flash(&FlashCall {
                    q_prep: QPrep {
                        q_norm: qn.f32(),
                        inv_freq: invf.f32(),
                        rot_half: Self::ROT_HALF,
                        eps,
                    },
                    k_cache: kc.bf16(),
                    v_cache: vc.bf16(),
                    qg: qg.f32(),
                    out: out.bf16(),
                    t,
                    past: self.past,
                    nq,
                    nkv,
                    hd,
                })
                .unwrap();
            }
        };
        once();
        let mut o = vec![half::bf16::ZERO; t * nq * hd];
        gpu.copy_to_host(out.ptr, &mut o).unwrap();
        let mut kh = vec![half::bf16::ZERO; self.cache.len()];
        let mut vh = kh.clone();
        gpu.copy_to_host(kc.ptr, &mut kh).unwrap();
        gpu.copy_to_host(vc.ptr, &mut vh).unwrap();
        let mut qh = vec![0f32; t * nq * hd];
        gpu.copy_to_host(q.ptr, &mut qh).unwrap();
        (o.iter().map(|x| x.to_f32()).collect(), kh, vh, qh)
    }
}

/// attn_flash4 preparing the query heads itself (RMSNorm and partial rotation on the way into
/// shared memory; `FlashCall::q_prep`, what prefill runs) against the f64 attention of the
/// queries attn_prep_rows prepares separately (the decode path's and the short calls' prep):
/// the KV cache rows the two ways write bitwise equal, the fused way never writing q, its
/// output within 1e-2 of the reference (q and the probabilities enter the tensor cores as bf16,
/// the output is bf16); from an empty cache, after cached positions, ragged lengths, and one
/// 2,048-token call against the reference's first and last rows.
fn attn_flash4_matches_reference_full_shape() {
    let gpu = gpu();
    let rh = QPrepCase::ROT_HALF;
    assert!(kestrel::cuda::kernels::attn_prefill::AttnFlash4::fits(
        ATT_NQ, ATT_NKV, ATT_HD, rh
    ));
    for (t, past) in [(100, 0), (77, 190), (129, 64), (300, 0), (2048, 0)] {
        let case = QPrepCase::new(t, past, 40 + t as u64);
        let (_, ka, va, q) = case.run(&gpu, false);
        let (b, kb, vb, q_b) = case.run(&gpu, true);
        assert!(q.iter().all(|x| x.is_finite()), "t {t}: separate q");
        assert!(
            q_b.iter().all(|x| x.is_nan()),
            "t {t}: the fused way wrote q"
        );
        assert!(
            ka == kb && va == vb,
            "t {t} past {past}: KV cache rows differ"
        );
        let case_ref = AttnCase {
            past,
            q,
            qg: case.qg.clone(),
            k: ka,
            v: va,
        };
        // the f64 reference is O(t^2): at 2,048 tokens its first and last 64 rows
        let rows: Vec<usize> = if t > 512 {
            (0..64).chain(t - 64..t).collect()
        } else {
            (0..t).collect()
        };
        let want = case_ref.reference_rows(&rows);
        let got: Vec<f32> = rows
            .iter()
            .flat_map(|&r| {
                b[r * ATT_NQ * ATT_HD..(r + 1) * ATT_NQ * ATT_HD]
                    .iter()
                    .copied()
            })
            .collect();
        let e = norm_rel_err(&got, &want);
        println!(
            "t {t} past {past}: attn_flash4 (fused q prep) vs f64 {e:.2e} over {} rows",
            rows.len()
        );
        assert!(
            got.iter().all(|x| x.is_finite()) && e <= 1e-2,
            "t {t} past {past}: {e}"
        );
    }
}

/// The split KV range of one decode step, as `attn_decode_mma` and `attn_combine_dec` derive
/// it (`attn_dec_chunk` in attn_decode.cu): positions a split, and splits used.
fn decode_chunk(n: usize, nsplit: usize) -> (usize, usize) {
    let even = n.div_ceil(nsplit);
    let chunk = if nsplit > 16 {
        even.max(64)
    } else {
        even.div_ceil(32) * 32
    };
    (chunk, n.div_ceil(chunk))
}

/// One decode step's attention at the real shape (16 query heads over 2 KV heads, head dim
/// 256, gated): the new position's queries over `n` cached positions. Every query head has
/// "needles": keys along its own query, at split boundaries (first, middle and last split's
/// first and last position, the newest position) and a few seeded places, each scoring
/// ln(n) + 1 and more over keys that score ~N(0, 0.33), so most of each head's weight sits in
/// a few known splits and a split dropped, shifted or merged wrongly moves the output by tens
/// of percent. Returns (q [nq, hd], qg [nq, 2 hd], K, V bf16 [n, nkv, hd]).
fn decode_attn_case(n: usize, nsplit: usize, seed: u64) -> AttnCase {
    let (nq, nkv, hd) = (ATT_NQ, ATT_NKV, ATT_HD);
    let group = nq / nkv;
    let mut r = Lcg(seed);
    let q = r.vec(nq * hd, 1.0);
    let mut qg = vec![0f32; nq * 2 * hd];
    let gates = r.vec(nq * hd, 2.0);
    for h in 0..nq {
        qg[h * 2 * hd..][..hd].copy_from_slice(&q[h * hd..][..hd]);
        qg[h * 2 * hd + hd..][..hd].copy_from_slice(&gates[h * hd..][..hd]);
    }
    let mut k: Vec<f32> = r.vec(n * nkv * hd, 1.0);
    let v: Vec<f32> = r.vec(n * nkv * hd, 1.0);
    let (chunk, used) = decode_chunk(n, nsplit);
    let first = |sp: usize| sp * chunk;
    let last = |sp: usize| ((sp + 1) * chunk).min(n) - 1;
    let mid = used / 2;
    let boundary = [
        first(0),
        last(0),
        first(1.min(used - 1)),
        first(mid),
        last(mid),
        first(used - 1),
        n - 1,
        last(used.saturating_sub(2)),
    ];
    let scale = 1.0 / (hd as f64).sqrt();
    let mut taken = vec![false; n * nkv];
    for h in 0..nq {
        let (kvh, j) = (h / group, h % group);
        let qh = &q[h * hd..][..hd];
        let q2: f64 = qh.iter().map(|&x| x as f64 * x as f64).sum();
        let mut spots = vec![boundary[j]];
        spots.extend((0..3).map(|i| (j * 7_919 + i * 104_729 + seed as usize * 31) % n));
        for (i, p) in spots.into_iter().enumerate() {
            if std::mem::replace(&mut taken[p * nkv + kvh], true) {
                continue; // another head's needle is there
            }
            // q . k * scale = ln(n) + 1 + 0.3 i
            let target = (n as f64).ln() + 1.0 + 0.3 * i as f64;
            let c = target / scale / q2;
            for (d, &x) in k[(p * nkv + kvh) * hd..][..hd].iter_mut().zip(qh) {
                *d = (c * x as f64) as f32;
            }
        }
    }
    let to_bf16 = |x: Vec<f32>| x.into_iter().map(half::bf16::from_f32).collect();
    AttnCase {
        past: n - 1,
        q,
        qg,
        k: to_bf16(k),
        v: to_bf16(v),
    }
}

/// The fused decode step's attention (`attn_decode_mma_hd256` into split partials, then
/// `attn_combine_dec`'s merge, normalisation and gate) at long KV, with the split counts the
/// step picks there (`decode_splits`: 64 up to 4,096 positions, 256 beyond), against the f64
/// attention of the same bf16 K/V and f32 queries ([`AttnCase::reference_rows`]). Lengths:
/// 1,100 (64 splits, 18 used), 4,096 (64 full splits of 64), 5,000 (256 splits, 79 used),
/// 32,768 (256 of 128), 32,805 (256 of 129, the last one short) and 131,072 (256 of 512). The
/// partials and the output start NaN (a split used but not written, or one read past those
/// used, fails). Tolerance: ‖Δ‖/‖ref‖ <= 1e-2 over all heads and <= 2e-2 for each head (q
/// and the probabilities enter the tensor cores as bf16 and the output is bf16: ~3e-3
/// expected; the f64 reference with one boundary split's V zeroed moves by 9.5e-2 to 3.4e-1
/// over all heads, 2.7e-1 to 7.4e-1 for the worst head, at every length here). The reference
/// takes ~10 s of CPU at 131,072.
fn attn_decode_splits_match_reference_long_kv() {
    use kestrel::cuda::attention::decode_splits;
    use kestrel::cuda::kernels::attn_decode::{AttnCombineDec, AttnDecodeMma};
    let gpu = gpu();
    let (nq, nkv, hd) = (ATT_NQ, ATT_NKV, ATT_HD);
    for (n, nsplit) in [
        (1_100, 64),
        (4_096, 64),
        (5_000, 256),
        (32_768, 256),
        (32_805, 256),
        (131_072, 256),
    ] {
        assert_eq!(decode_splits(n), nsplit, "the step's split count at {n}");
        let case = decode_attn_case(n, nsplit, n as u64);
        let want = case.reference_rows(&[0]);
        let (q, qg) = (gpu.upload(&case.q).unwrap(), gpu.upload(&case.qg).unwrap());
        let (kc, vc) = (gpu.upload(&case.k).unwrap(), gpu.upload(&case.v).unwrap());
        let pos = gpu.upload(&[(n - 1) as i32]).unwrap();
        let part = gpu.upload(&vec![f32::NAN; nq * nsplit * (hd + 2)]).unwrap();
        let out = gpu.upload(&vec![0x7fc0u16; nq * hd]).unwrap();
        AttnDecodeMma {
            q: q.f32(),
            kc: kc.bf16(),
            vc: vc.bf16(),
            part: part.f32(),
            past_dev: pos.i32(),
            nq: nq as i32,
            nkv: nkv as i32,
            nsplit: nsplit as i32,
            scale: 1.0 / (hd as f32).sqrt(),
            tab: Dev::null(),
        }
        .launch(&gpu, hd, 1, On::Plain)
        .unwrap();
        AttnCombineDec {
            part: part.f32(),
            qg: qg.f32(),
            out: out.bf16(),
            past_dev: pos.i32(),
            nq: nq as i32,
            hd: hd as i32,
            nsplit: nsplit as i32,
            ldqg: 0,
        }
        .launch(&gpu, 1, On::Plain)
        .unwrap();
        let mut o = vec![0u16; nq * hd];
        gpu.copy_to_host(out.ptr, &mut o).unwrap();
        let got = bf16_to_f32(&o);
        let e = norm_rel_err(&got, &want);
        let per_head: Vec<f64> = (0..nq)
            .map(|h| norm_rel_err(&got[h * hd..][..hd], &want[h * hd..][..hd]))
            .collect();
        let worst = per_head.iter().cloned().fold(0.0, f64::max);
        let (chunk, used) = decode_chunk(n, nsplit);
        println!(
            "n {n}: {nsplit} splits ({used} used, {chunk} positions each): decode attention vs f64 {e:.2e}, worst head {worst:.2e}"
        );
        assert!(
            got.iter().all(|x| x.is_finite()) && e <= 1e-2 && worst <= 2e-2,
            "n {n}, {nsplit} splits: {e} (heads {per_head:.3?})"
        );
    }
}

/// Logits rows of the model's vocabulary (248,320; the last 1,000 past the limit) like a
/// language model's: a few likely ids spread over the vocabulary above a noise floor, scaled
/// by `peak` (small: nearly flat).
fn vocab_rows(rows: usize, seed: u64, peak: f32) -> Vec<f32> {
    let v = 248_320;
    let mut rng = Lcg(seed);
    let mut x = rng.vec(rows * v, 3.0);
    for r in 0..rows {
        for j in 0..40 {
            let id = (j * 6_151 + r * 977 + 13) % v;
            x[r * v + id] += peak * (1.0 + j as f32 / 8.0);
        }
    }
    x
}

/// The draw on the device (`sample.cu` through `Gpu::draw_rows`) against the host sampler
/// (`Draw::on_host`) on the model's vocabulary: every row of a 64-row batch has its own
/// settings (the server's default top-k 20 / top-p 0.95, top-k alone, top-p and min-p alone,
/// plain sampling, greedy, penalties over a history, a vocabulary limit, top-k past the
/// device's candidates and a flat top-p, which the host draws) and its own uniform; the ids
/// must be the host's (plain sampling in id order may differ in f32 summation order: at most
/// one row in 64), the log-probabilities within 1e-4, and a row asking for its logits gets
/// them unchanged (penalized rows' raw values restored).
fn device_draws_match_the_host_sampler() {
    use kestrel::cuda::sample::SampleWs;
    use kestrel::sampling::{Draw, Rng, SamplingParams};
    let gpu = gpu();
    let (v, rows) = (248_320usize, 64usize);
    let ws = SampleWs::new(&gpu, rows).unwrap();
    let base = SamplingParams {
        vocab_limit: v - 1_000,
        ..SamplingParams::default()
    };
    let set = |f: &dyn Fn(&mut SamplingParams)| {
        let mut p = base.clone();
        f(&mut p);
        p
    };
    let kinds: Vec<(&str, SamplingParams)> = vec![
        (
            "top-k 20 top-p 0.95",
            set(&|p| {
                p.top_k = 20;
                p.top_p = 0.95;
                p.temperature = 0.7;
            }),
        ),
        ("top-k 50", set(&|p| p.top_k = 50)),
        (
            "top-p 0.9",
            set(&|p| {
                p.top_p = 0.9;
                p.temperature = 0.3;
            }),
        ),
        (
            "min-p 0.1",
            set(&|p| {
                p.min_p = 0.1;
                p.temperature = 0.5;
            }),
        ),
        ("plain", set(&|p| p.temperature = 1.0)),
        ("greedy", set(&|p| p.temperature = 0.0)),
        (
            "penalties",
            set(&|p| {
                p.top_k = 30;
                p.repetition_penalty = 1.3;
                p.presence_penalty = 0.5;
                p.frequency_penalty = 0.25;
            }),
        ),
        (
            "greedy penalties",
            set(&|p| {
                p.temperature = 0.0;
                p.repetition_penalty = 1.5;
            }),
        ),
        ("top-k 100 (host)", set(&|p| p.top_k = 100)),
        (
            "flat top-p (host)",
            set(&|p| {
                p.top_p = 0.95;
                p.temperature = 5.0;
            }),
        ),
    ];
    let mut rng = Rng::new(5);
    for (round, peak) in [(0u64, 12.0f32), (1, 6.0), (2, 12.0)] {
        let logits = vocab_rows(rows, 100 + round, peak);
        let dev = gpu.upload(&logits).unwrap();
        let params: Vec<&SamplingParams> = (0..rows).map(|r| &kinds[r % kinds.len()].1).collect();
        let hist: Vec<Vec<u32>> = (0..rows)
            .map(|r| {
                (0..200)
                    .map(|j| ((j * 6_151 + r * 977 + 13) % v) as u32)
                    .chain([v as u32 - 10])
                    .collect()
            })
            .collect();
        let us: Vec<f64> = (0..rows).map(|_| rng.next_f64()).collect();
        let draws: Vec<Draw> = (0..rows)
            .map(|r| Draw {
                params: params[r],
                u: us[r],
                history: &hist[r],
                top_logprobs: (r % 3 == 0).then_some(5),
                want_logits: round == 2 && r % 5 == 0,
                mask: None,
            })
            .collect();
        let got = gpu.draw_rows(&ws, dev.f32(), v, &draws).unwrap();
        let (mut plain_differ, mut compared) = (0, 0);
        for (r, d) in draws.iter().enumerate() {
            let row = &logits[r * v..(r + 1) * v];
            let want = d.on_host(row);
            let kind = kinds[r % kinds.len()].0;
            if got[r].id != want.id {
                assert_eq!(
                    kind, "plain",
                    "round {round} row {r} ({kind}): {} vs {}",
                    got[r].id, want.id
                );
                plain_differ += 1;
            }
            compared += 1;
            match (&got[r].logprobs, &want.logprobs) {
                (Some(g), Some(w)) if g.id == w.id => {
                    assert!(
                        (g.logprob - w.logprob).abs() <= 1e-4,
                        "row {r}: {g:?} vs {w:?}"
                    );
                    assert_eq!(g.top.len(), w.top.len(), "row {r}");
                    for (a, b) in g.top.iter().zip(&w.top) {
                        assert_eq!(a.0, b.0, "row {r}: top ids");
                        assert!((a.1 - b.1).abs() <= 1e-4, "row {r}: {a:?} vs {b:?}");
                    }
                }
                (g, w) => assert_eq!(g.is_some(), w.is_some(), "row {r}"),
            }
            assert_eq!(
                got[r].logits.as_deref(),
                d.want_logits.then_some(row),
                "row {r}"
            );
        }
        println!(
            "draws round {round}: {compared} rows the host's, plain sampling differs on {plain_differ}"
        );
        assert!(
            plain_differ <= 1,
            "round {round}: {plain_differ} plain rows differ"
        );
    }
}

/// Structured outputs on the device: rows with a mask (`sample_mask` before the draw) of 1, 3,
/// 40 or 5,000 allowed ids, or a real JSON grammar's first mask, under every kind of setting,
/// next to rows without one: each device id is the host's masked draw ([`Draw::on_host`]
/// masks too), always an allowed id, and a row asking for its logits gets them masked.
fn device_draws_honour_structured_output_masks() {
    use kestrel::cuda::sample::SampleWs;
    use kestrel::grammar::{Constraint, GrammarEngine, PendingMask, allowed, mask_words};
    use kestrel::sampling::{Draw, Rng, SamplingParams};
    let gpu = gpu();
    let (v, rows) = (248_320usize, 40usize);
    let ws = SampleWs::new(&gpu, rows).unwrap();
    let tok = kestrel::tokenizer::Tokenizer::bundled().unwrap();
    let engine = GrammarEngine::new(&tok, v, kestrel::tokenizer::special::IM_END).unwrap();
    let json_mask = engine
        .guide(&Constraint::JsonObject)
        .unwrap()
        .next_mask()
        .get()
        .to_vec();
    let mut rng = Rng::new(23);
    let mut masks: Vec<Option<PendingMask>> = Vec::new();
    for r in 0..rows {
        let n = [1usize, 3, 40, 5_000, 0, usize::MAX][r % 6];
        masks.push(match n {
            0 => None,
            usize::MAX => Some(PendingMask::ready(json_mask.clone())),
            n => {
                let mut m = vec![0u32; mask_words(v)];
                for _ in 0..n {
                    let id = (rng.next_f64() * (v - 1_000) as f64) as usize;
                    m[id / 32] |= 1 << (id % 32);
                }
                Some(PendingMask::ready(m))
            }
        });
    }
    let kinds: Vec<SamplingParams> = [0.0f32, 0.7, 1.0]
        .iter()
        .flat_map(|&t| {
            [(0usize, 1.0f32), (20, 0.95), (0, 0.9)].map(|(k, p)| SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                vocab_limit: v - 1_000,
                ..SamplingParams::default()
            })
        })
        .collect();
    let all = vocab_rows(rows, 321, 10.0);
    let us: Vec<f64> = (0..rows).map(|_| rng.next_f64()).collect();
    // Twice through the same buffers, the second time with the rows reversed (each mask in
    // another slot of the page-locked staging and on the device): nothing of the first
    // call's masks or parameters may show in the second's draws.
    let mut plain_differ = 0;
    for round in 0..2 {
        let order: Vec<usize> = if round == 0 {
            (0..rows).collect()
        } else {
            (0..rows).rev().collect()
        };
        let logits: Vec<f32> = order
            .iter()
            .flat_map(|&r| all[r * v..(r + 1) * v].iter().copied())
            .collect();
        let dev = gpu.upload(&logits).unwrap();
        let draws: Vec<Draw> = order
            .iter()
            .map(|&r| Draw {
                params: &kinds[r % kinds.len()],
                u: us[r],
                history: &[],
                top_logprobs: (r % 4 == 0).then_some(3),
                want_logits: r % 7 == 3,
                mask: masks[r].as_ref(),
            })
            .collect();
        let got = gpu.draw_rows(&ws, dev.f32(), v, &draws).unwrap();
        for (r, d) in draws.iter().enumerate() {
            let row = &logits[r * v..(r + 1) * v];
            let want = d.on_host(row);
            let p = d.params;
            // plain sampling in id order may differ in f32 summation order (as above)
            let plain = p.temperature > 0.0 && p.top_k == 0 && p.top_p >= 1.0;
            if plain && got[r].id != want.id {
                plain_differ += 1;
            } else {
                assert_eq!(got[r].id, want.id, "round {round} row {r}: {d:?}");
            }
            if let Some(m) = d.mask {
                assert!(
                    allowed(m.get(), got[r].id),
                    "round {round} row {r}: a refused id"
                );
            }
            if d.want_logits {
                assert_eq!(
                    got[r].logits.as_ref(),
                    want.logits.as_ref(),
                    "round {round} row {r}: logits"
                );
            }
        }
    }
    assert!(plain_differ <= 2, "{plain_differ} plain rows differ");
    println!(
        "masked draws: {rows} rows twice the host's (plain differs on {plain_differ}), every id allowed"
    );
}

/// The device's draws follow the host sampler's distribution: 4,096 draws (64-row batches of
/// one row's logits, each row its own random uniform) at the server's default settings (top-k
/// 20, top-p 0.95, temperature 0.7) on a moderately peaked row, against the probabilities the
/// host's draw gives (its id at 200,000 evenly spaced uniforms): chi-square over the ids the
/// host can choose (those expected fewer than 5 times in one bin), at most its 0.999 quantile.
fn device_draws_follow_the_host_distribution() {
    use kestrel::cuda::sample::SampleWs;
    use kestrel::sampling::{Draw, Rng, SamplingParams, draw};
    let gpu = gpu();
    let (v, rows) = (248_320usize, 64usize);
    let ws = SampleWs::new(&gpu, rows).unwrap();
    let one = vocab_rows(1, 77, 2.5);
    let logits: Vec<f32> = (0..rows).flat_map(|_| one.iter().copied()).collect();
    let dev = gpu.upload(&logits).unwrap();
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.95,
        vocab_limit: v,
        ..SamplingParams::default()
    };
    let grid = 200_000;
    let mut expect = std::collections::BTreeMap::<u32, f64>::new();
    for i in 0..grid {
        let id = draw(&p, &one, &[], (i as f64 + 0.5) / grid as f64);
        *expect.entry(id).or_default() += 1.0 / grid as f64;
    }
    let mut rng = Rng::new(11);
    let mut seen = std::collections::BTreeMap::<u32, f64>::new();
    let n = 4096;
    for _ in 0..n / rows {
        let us: Vec<f64> = (0..rows).map(|_| rng.next_f64()).collect();
        let draws: Vec<Draw> = us
            .iter()
            .map(|&u| Draw {
                params: &p,
                u,
                history: &[],
                top_logprobs: None,
                want_logits: false,
                mask: None,
            })
            .collect();
        for d in gpu.draw_rows(&ws, dev.f32(), v, &draws).unwrap() {
            assert!(
                expect.contains_key(&d.id),
                "id {} outside the host's choices",
                d.id
            );
            *seen.entry(d.id).or_default() += 1.0;
        }
    }
    let (mut bins, mut rare) = (Vec::new(), (0.0, 0.0));
    for (id, &pr) in &expect {
        let (e, o) = (pr * n as f64, seen.get(id).copied().unwrap_or(0.0));
        if e < 5.0 {
            rare = (rare.0 + e, rare.1 + o);
        } else {
            bins.push((e, o));
        }
    }
    if rare.0 > 0.0 {
        bins.push(rare);
    }
    let chi2: f64 = bins.iter().map(|(e, o)| (o - e) * (o - e) / e).sum();
    let dof = bins.len() - 1;
    // the chi-square 0.999 quantile, by Wilson-Hilferty
    let z = 3.09;
    let k = dof as f64;
    let q = k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3);
    println!(
        "device draws: chi-square {chi2:.1} over {} bins of {} ids (0.999 quantile {q:.1})",
        bins.len(),
        expect.len()
    );
    assert!(
        bins.len() >= 5,
        "the row is too peaked to test: {} bins",
        bins.len()
    );
    assert!(chi2 <= q, "chi-square {chi2:.1} above {q:.1}");
}

/// `argmax_rows` (the batched greedy pick) against a host scan: the largest of ids below the
/// limit, the lowest on ties, NaN never chosen, 0 when nothing beats -inf; at the real
/// vocabulary (float4 loads) and at an odd row width (the scalar path), with the maximum
/// planted in the last float4, in the scalar tail, tied, beside NaNs and past the limit.
fn argmax_rows_matches_host_scan() {
    let gpu = gpu();
    for (ld, limit) in [
        (248_320usize, 248_320usize),
        (248_320, 248_077),
        (1_003, 1_001),
    ] {
        let rows = 7;
        let mut rng = Lcg(ld as u64 + limit as u64);
        let mut x: Vec<f32> = (0..rows * ld).map(|_| rng.next()).collect();
        let row = |r: usize| r * ld;
        x[row(0) + limit - 1] = 9.0; // the last id below the limit
        x[row(1) + 5] = 7.0; // a tie: the lowest id wins
        x[row(1) + limit - 3] = 7.0;
        x[row(2) + 17] = f32::NAN; // NaN beside the maximum
        x[row(2) + 18] = 8.0;
        if limit < ld {
            x[row(3) + limit] = 50.0; // past the limit: never chosen
        }
        x[row(4)..row(5)].fill(f32::NEG_INFINITY); // nothing beats -inf: 0
        x[row(5) + (limit & !3) - 1] = 6.0; // the last whole float4
        x[row(6)..row(7)].fill(f32::NAN);
        x[row(6) + limit / 2] = -3.0;
        let want: Vec<i32> = (0..rows)
            .map(|r| {
                let (mut best, mut id) = (f32::NEG_INFINITY, 0usize);
                for (i, &v) in x[row(r)..row(r) + limit].iter().enumerate() {
                    if v > best {
                        (best, id) = (v, i);
                    }
                }
                id as i32
            })
            .collect();
        let logits = gpu.upload(&x).unwrap();
        let out = gpu.upload(&vec![-1i32; rows]).unwrap();
        ArgmaxRows {
            logits: logits.f32(),
            ld: ld as i32,
            limit: limit as i32,
            out: out.i32(),
        }
        .launch(&gpu, rows, On::Plain)
        .unwrap();
        let mut got = vec![0i32; rows];
        gpu.copy_to_host(out.ptr, &mut got).unwrap();
        assert_eq!(got, want, "rows of {ld} (limit {limit})");
    }
}

/// The GPU tests, run by [`common::gpu_main`] (`harness = false`): a new one is listed here.
fn main() -> std::process::ExitCode {
    common::gpu_main(
        &[
            (
                "moe_grouped_gemm_matches_reference_full_shape",
                moe_grouped_gemm_matches_reference_full_shape,
            ),
            (
                "attn_decode_splits_match_reference_long_kv",
                attn_decode_splits_match_reference_long_kv,
            ),
            (
                "gdn_chunked_kernel_matches_recurrent",
                gdn_chunked_kernel_matches_recurrent,
            ),
            (
                "gdn_conv_prefill_matches_sequential",
                gdn_conv_prefill_matches_sequential,
            ),
            ("gemm_matches_reference", gemm_matches_reference),
            (
                "decode_gemv_kernels_match_reference",
                decode_gemv_kernels_match_reference,
            ),
            (
                "attn_flash4_matches_reference_full_shape",
                attn_flash4_matches_reference_full_shape,
            ),
            (
                "device_draws_match_the_host_sampler",
                device_draws_match_the_host_sampler,
            ),
            (
                "device_draws_honour_structured_output_masks",
                device_draws_honour_structured_output_masks,
            ),
            (
                "device_draws_follow_the_host_distribution",
                device_draws_follow_the_host_distribution,
            ),
            (
                "argmax_rows_matches_host_scan",
                argmax_rows_matches_host_scan,
            ),
        ],
        &[],
    )
}
