#!/usr/bin/env python3
"""Production-shape LONG-CONTEXT reference for Kestrel (issue 43): a full-width, 4-layer
Qwen3.6-35B-A3B checkpoint (linear x3, full: the real GDN 16/32 x 128 and gated attention 16/2 x
256 shapes, 256 experts top-8, vocab 248,320) and transformers' float32 logits for prompts of
32,768 (and, optionally, 131,072) tokens, for `longctx_checkpoint_matches_hf` in tests/cuda.rs
(run by `scripts/gpu_check.sh longctx`).

The checkpoint, the weight scales and the reference conventions are scripts/fullwidth_check.py's
(imported, not copied): seeded random weights of healthy scale (logit std ~3), bf16 on disk,
checked bit for bit. Per length L it writes DIR/ctx-L/reference.safetensors with fullwidth's
tensors and meaning:

  prompt_ids i64 [L], prompt_logits_last4 f32 [4,V] (positions L-4..L-1), decode_ids i64 [N],
  decode_logits f32 [N,V] (decode_ids[0] = argmax(last prompt row); step i feeds decode_ids[i]
  at position L+i; decode_ids[i+1] = argmax(decode_logits[i])), hf_bf16_logits f32 [4+N,V] (the
  same rows from transformers in bf16, uncached, teacher-forced: the blocked attention below in
  bf16 (eager's bf16 arithmetic), grouped_mm experts; the tolerance's basis, measured at the
  full length)

and DIR/longctx.json (versions, margins, spreads, timings).

How the float32 reference runs at 32k+ tokens (eager attention would need 16 x L x L floats, 69
GB at 32,768):
  * attention: a registered attention function, `kestrel_f32_blocked`: eager attention's own
    arithmetic (f32 matmuls with TF32 off, f32 softmax, KV heads repeated) 512 queries at a time
    against the keys they see, so O(512 x L) memory; causal for the prompt, every key for a decode
    step. It is checked against eager attention on a --check-len prompt first (max |logit diff|
    recorded, must be <= 1e-3);
  * GDN: transformers' torch chunked delta rule (torch_chunk_gated_delta_rule: flash-linear-
    attention and causal-conv1d are blocked by fullwidth_check's import, as there), f32;
  * experts: eager; TF32 off everywhere; lm_head on the last 4 positions only.
Prompts are seeded random ids, redrawn (up to --max-tries within --search-seconds) until every
greedy top1-top2 margin is >= --min-margin; otherwise the draw that got furthest is kept and the
Rust test compares greedy tokens on the confident rows only.

Memory (H200, 141 GB): the model is 4.4 B params, 17.6 GB in f32. At 32,768 the largest
transients are the torch GDN's [32, L/64, 64, 128] f32 tensors (~0.5 GB each, ~10 live) and the
expert mask (0.5 GB): ~25 GB peak. At 131,072 4x that, ~60-70 GB.
Time (estimates, unmeasured): build + save + verify ~1 min; a 32,768 prefill in f32 ~5-10 s
(blocked f32 attention ~9 TFLOP causal, the GDN's 512 sequential chunk steps a layer, eager experts),
so ~1-1.5 min for draws, self-check and the bf16 pass; 131,072 ~30-60 s a prefill (attention 16x),
~3-4 min.

Usage (GPU, from the repository root):
    python3 scripts/longctx_check.py --out /tmp/longctx [--lengths 32768[,131072]] [--decode 16]
CPU smoke test (tiny dims):
    /work/venv-fp8/bin/python scripts/longctx_check.py --tiny --out /tmp/lc_tiny --lengths 300,700
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fullwidth_check as fw  # noqa: E402  (blocks fla/causal_conv1d, offline settings, torch)

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

log = fw.log
ATTN = "kestrel_f32_blocked"
QBLOCK = 512  # queries a block: [16, 512, L] f32 scores, 4.3 GB at 131,072


def blocked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **_kw):
    """transformers' attention interface: query [b, nq, q, hd], key/value [b, nkv, k, hd] (the
    cache included). Eager attention's arithmetic (f32 matmul, f32 softmax), QBLOCK queries at a
    time against the keys they can see: O(QBLOCK x L) memory instead of eager's L x L. The
    prompt from an empty cache (q == k, causal) or one decode step (q == 1, every key)."""
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is not None or not (q_len == 1 or q_len == k_len):
        raise RuntimeError(f"{ATTN}: only unpadded prefill from an empty cache or one-token decode "
                           f"(q {q_len}, k {k_len}, mask {attention_mask is not None})")
    g = module.num_key_value_groups
    key = key.repeat_interleave(g, dim=1)  # head h reads KV head h // g, like repeat_kv
    value = value.repeat_interleave(g, dim=1)
    past = k_len - q_len
    out = torch.empty_like(query)
    for s in range(0, q_len, QBLOCK):
        e = min(s + QBLOCK, q_len)
        kend = past + e  # the block's last query sees keys 0..kend-1
        sc = torch.matmul(query[:, :, s:e], key[:, :, :kend].transpose(-1, -2)) * scaling
        if q_len > 1:
            qpos = torch.arange(past + s, past + e, device=query.device)
            kpos = torch.arange(kend, device=query.device)
            sc.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
        sc = torch.softmax(sc, dim=-1, dtype=torch.float32).to(query.dtype)
        out[:, :, s:e] = torch.matmul(sc, value[:, :, :kend])
        del sc
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN, blocked_attention)


@torch.no_grad()
def params_to(model, dtype):
    """The parameters only: the buffers (the rotary inv_freq) stay float32, as transformers
    keeps them in a bf16 model it loads. (model.to(bf16) would round inv_freq too, and a later
    .float() would not undo that: rotation angles off by up to L x 2^-9 rad at position L.)"""
    for p in model.parameters():
        p.data = p.data.to(dtype)


@torch.no_grad()
def last_rows(model, ids, n=4):
    return model(input_ids=ids[None], use_cache=False, logits_to_keep=n).logits[0].float()


def draw_prompt(cfg, seed, length, attempt, device):
    gen = torch.Generator().manual_seed(seed * 1000003 + 7919 + 7 * length + attempt)
    return torch.randint(0, cfg.vocab_size, (length,), generator=gen, dtype=torch.long).to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="DIR: DIR/model, DIR/ctx-L/reference.safetensors, DIR/longctx.json")
    ap.add_argument("--lengths", default="32768", help="prompt lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=4, help="layers (every 4th full attention)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--min-margin", type=float, default=0.1)
    ap.add_argument("--max-tries", type=int, default=3, help="prompt draws a length at most")
    ap.add_argument("--search-seconds", type=float, default=60.0, help="time cap on a length's redraws")
    ap.add_argument("--check-len", type=int, default=2048,
                    help="prompt length of the blocked-vs-eager attention check")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    assert lengths and min(lengths) >= 4 and args.decode >= 1
    assert args.layers >= 4, "at least one full-attention layer (layer 3)"

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    out_dir = os.path.abspath(args.out)
    mdir = os.path.join(out_dir, "model")
    os.makedirs(mdir, exist_ok=True)
    fw.clean_dir(mdir)
    timings = {}
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else "") + f", lengths {lengths}")

    # ---- the checkpoint (fullwidth_check's) ----
    t = time.perf_counter()
    cfg = fw.make_config(args.layers, args.tiny)
    model, rules = fw.build_model(cfg, args.seed, device)
    model.save_pretrained(mdir, max_shard_size="5GB", save_original_format=False)  # fused experts
    problems, _ = fw.check_config_for_kestrel(os.path.join(mdir, "config.json"), cfg)
    if problems:
        log(f"FAILED: config.json problems for Kestrel: {problems}")
        sys.exit(2)
    verify = fw.verify_files(mdir, model, False, device)
    fw.free(device)
    timings["checkpoint_s"] = time.perf_counter() - t
    log(f"checkpoint: {args.layers} layers {cfg.layer_types}, {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B "
        f"params, {verify['tensors']} tensors verified, {timings['checkpoint_s']:.1f} s")

    # ---- f32, and the blocked attention against eager on a short prompt ----
    model.float()
    fw.free(device)
    t = time.perf_counter()
    check_ids = draw_prompt(cfg, args.seed, args.check_len, 999, device)
    fw.set_impl(model, "eager", "eager")
    eager = last_rows(model, check_ids)
    fw.set_impl(model, ATTN, "eager")
    eff = last_rows(model, check_ids)
    attn_check = {"prompt_len": args.check_len, "max_abs_logit_diff": float((eff - eager).abs().max()),
                  "max_abs_logit": float(eager.abs().max())}
    del eager, eff
    fw.free(device)
    timings["attn_check_s"] = time.perf_counter() - t
    log(f"{ATTN} vs eager attention, f32, {args.check_len} tokens: {attn_check}")
    if attn_check["max_abs_logit_diff"] > 1e-3:
        log(f"FAILED: {ATTN} does not reproduce eager attention")
        sys.exit(2)

    # ---- per length: the f32 reference, then transformers in bf16 on the same rows, written
    # before the next length (a longer one running out of memory keeps the shorter ones) ----
    refs, info_lengths = {}, {}
    tap = fw.RouterTap(model, cfg.num_experts_per_tok)

    def write_info():
        info = {
            "what": "full-width 4-layer Qwen3.6-35B-A3B random checkpoint + float32 HF references at long context (issue 43)",
            "transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "tiny": args.tiny, "seed": args.seed, "layers": args.layers, "layer_types": cfg.layer_types,
            "init_rules": rules, "checkpoint_verify": verify,
            "reference_impl": f"model.float(); attention {ATTN} (eager's f32 arithmetic, {QBLOCK} queries a block); "
                              "transformers torch GDN (chunked prefill, recurrent decode; fla blocked); eager experts; "
                              "TF32 off; cached decode",
            "gdn_chunk_impl": fw.hf_mod.torch_chunk_gated_delta_rule.__module__,
            "attn_check_vs_eager": attn_check,
            "min_margin_required": args.min_margin,
            "lengths": info_lengths,
            "timings_s": {k: round(v, 2) for k, v in timings.items()},
            "total_seconds": round(time.perf_counter() - fw.T0, 1),
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with open(os.path.join(out_dir, "longctx.json"), "w") as f:
            json.dump(info, f, indent=2)
            f.write("\n")
        log(f"wrote {out_dir}/longctx.json; total {info['total_seconds']} s; peak GPU memory {info['peak_gpu_memory_gib']} GiB")

    for L in lengths:
        t = time.perf_counter()
        best, tries, res = None, [], None
        for attempt in range(max(1, args.max_tries)):
            prompt = draw_prompt(cfg, args.seed, L, attempt, device)
            tap.min_gap = float("inf")
            res, margins = fw.run_reference(model, prompt, args.decode, args.min_margin)
            tries.append({"attempt": attempt, "rows_checked": len(margins), "min_margin_seen": round(min(margins), 5)})
            log(f"L {L} draw {attempt}: " + ("accepted" if res else f"rejected at row {len(margins) - 1}")
                + f", min margin {min(margins):.4f} ({time.perf_counter() - t:.1f} s)")
            if res is not None:
                break
            if best is None or len(margins) > best[1]:
                best = (attempt, len(margins))
            if time.perf_counter() - t > args.search_seconds:
                break
        if res is None:
            prompt = draw_prompt(cfg, args.seed, L, best[0], device)
            tap.min_gap = float("inf")
            res, margins = fw.run_reference(model, prompt, args.decode, 0.0)
            log(f"L {L}: no draw reached margin {args.min_margin}; kept draw {best[0]} (min margin {min(margins):.4f})")
        last4, decode_ids, decode_logits = res
        ref_rows = torch.cat([last4, decode_logits])
        timings[f"reference_{L}_s"] = time.perf_counter() - t
        # self-check: the uncached forward over prompt + decode ids reproduces the cached rows
        t = time.perf_counter()
        full = fw.teacher_forced_rows(model, prompt, decode_ids, args.decode + 4)
        selfcheck = float((full - ref_rows).abs().max())
        del full
        fw.free(device)
        timings[f"selfcheck_{L}_s"] = time.perf_counter() - t
        log(f"L {L}: decode ids {decode_ids.tolist()}; router min gap {tap.min_gap:.2e}; cached vs uncached "
            f"max |diff| {selfcheck:.2e} ({timings[f'reference_{L}_s']:.1f} + {timings[f'selfcheck_{L}_s']:.1f} s)")
        refs[L] = dict(prompt=prompt, last4=last4, decode_ids=decode_ids, decode_logits=decode_logits,
                       ref_rows=ref_rows, margins=margins, tries=tries, router_min_gap=tap.min_gap,
                       selfcheck=selfcheck)
        r = refs[L]
        # ---- transformers in bf16 on the same rows: the tolerance's basis. Attention stays the
        # blocked function (eager's bf16 arithmetic: bf16 scores and values, f32 softmax rounded to
        # bf16), not sdpa as in fullwidth_check: sdpa falling back to its math kernel would need
        # 16 x L x L elements. Experts grouped_mm, like the HF peer. ----
        params_to(model, torch.bfloat16)
        fw.set_impl(model, ATTN, "grouped_mm")
        fw.free(device)
        t = time.perf_counter()
        rows16 = fw.teacher_forced_rows(model, r["prompt"], r["decode_ids"], args.decode + 4)
        d = rows16 - r["ref_rows"]
        num = float(d.double().pow(2).sum().sqrt())
        spread = {
            "norm_rel": num / float(r["ref_rows"].double().pow(2).sum().sqrt()),
            "max_abs": float(d.abs().max()),
            "greedy_rows_agree": int((rows16[3:].argmax(-1) == r["ref_rows"][3:].argmax(-1)).sum()),
            "greedy_rows": args.decode + 1,
            "max_abs_per_row": [round(float(x), 4) for x in d.abs().amax(dim=-1)],
        }
        timings[f"bf16_{L}_s"] = time.perf_counter() - t
        log(f"L {L}: HF bf16 vs f32 {({k: v for k, v in spread.items() if k != 'max_abs_per_row'})}")
        cdir = os.path.join(out_dir, f"ctx-{L}")
        os.makedirs(cdir, exist_ok=True)
        save_file({
            "prompt_ids": r["prompt"].cpu().to(torch.int64).contiguous(),
            "prompt_logits_last4": r["last4"].cpu().float().contiguous(),
            "decode_ids": r["decode_ids"].cpu().to(torch.int64).contiguous(),
            "decode_logits": r["decode_logits"].cpu().float().contiguous(),
            "hf_bf16_logits": rows16.cpu().float().contiguous(),
        }, os.path.join(cdir, "reference.safetensors"), metadata={"format": "pt"})
        m = torch.tensor(r["margins"])
        info_lengths[str(L)] = {
            "dir": f"ctx-{L}", "decode_ids": r["decode_ids"].tolist(),
            "greedy_margins": [round(float(x), 5) for x in m], "min_greedy_margin": float(m.min()),
            "prompt_draws": r["tries"], "router_min_topk_gap": r["router_min_gap"],
            "max_abs_logit": float(r["ref_rows"].abs().max()),
            "logit_std_last_prompt_row": float(r["last4"][-1].std()),
            "selfcheck_cached_vs_uncached_max_abs": r["selfcheck"], "hf_bf16_vs_f32": spread,
        }
        del rows16, d
        fw.free(device)
        params_to(model, torch.float32)
        fw.set_impl(model, ATTN, "eager")
        fw.free(device)
        write_info()
    tap.close()

    bad = [L for L, r in refs.items() if r["selfcheck"] > 1e-2]
    if bad:
        log(f"FAILED: cached vs uncached self-check above 1e-2 at {bad}")
        sys.exit(2)


if __name__ == "__main__":
    main()
