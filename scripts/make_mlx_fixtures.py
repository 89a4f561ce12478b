#!/usr/bin/env python3
"""Writes tests/fixtures/tiny-mlx-4bit: a tiny random qwen3_5_moe checkpoint converted by
mlx-lm's own converter to MLX affine 4-bit (group 64, mlx-lm's default 8-bit router and
shared-expert gate), plus mlx-lm's logits and greedy tokens as the reference.

    python3 -m venv /work/venv-mlx
    /work/venv-mlx/bin/pip install mlx==0.32.4 mlx-cpu mlx-lm==0.32.2
    /work/venv-mlx/bin/python scripts/make_mlx_fixtures.py --out tests/fixtures

Steps:
1. a bf16 Hugging Face checkpoint in the official release layout (wrapper config,
   `model.language_model.*`, fused experts, zero-centred norms stored as w) with the dims of
   tiny-official-fp8 (every matrix dim a multiple of 64) and the init rules of
   scripts/make_fixtures.py, drawn with numpy;
2. `mlx_lm.convert(..., quantize=True, q_group_size=64, q_bits=4)`: mlx-lm's sanitize (norms
   +1, conv1d to [C, K, 1], experts to `switch_mlp`) and quantiser, exactly as for the real
   release;
3. mlx-lm's model on the converted directory, twice: as loaded (bf16 scales, so bf16
   activations: what Lily runs) and with every float parameter cast to float32 (the same
   quantised codes, scales and biases, f32 arithmetic: the tight reference).

The seed search keeps the first seed whose f32 greedy run has a top1 - top2 margin of at least
MIN_MARGIN at every step. The tokenizer files the converter writes are not kept (Kestrel
uses its bundled Qwen3.6 tokenizer for a directory without one).
"""

import argparse
import gzip
import json
import math
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import mlx.core as mx
import mlx_lm
from mlx_lm import convert
from mlx_lm.utils import load

ROOT = Path(__file__).resolve().parent.parent
MIN_MARGIN = 0.05
N_DECODE = 64
T = 40

TEXT = dict(
    attention_bias=False, attention_dropout=0.0, attn_output_gate=True, bos_token_id=2,
    dtype="bfloat16", eos_token_id=2, full_attention_interval=4, head_dim=256,
    hidden_act="silu", hidden_size=128, initializer_range=0.02,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_value_head_dim=128, mamba_ssm_dtype="float32",
    max_position_embeddings=4096, model_type="qwen3_5_moe_text", moe_intermediate_size=128,
    mtp_num_hidden_layers=0, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
    num_hidden_layers=4, num_key_value_heads=1, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
    shared_expert_intermediate_size=128, tie_word_embeddings=False, vocab_size=256,
)

# The init rules of scripts/make_fixtures.py.
EMBED_STD, HEAD_GAIN, ROUTER_GAIN = 1.0, 3.0, 3.0
ZC_NORM_STD, GATED_NORM_STD, CONV_STD = 0.3, 0.3, 0.5
DT_BIAS_MEAN, DT_BIAS_STD, A_RANGE = -4.0, 1.0, (1.0, 16.0)


def hf_weights(rng):
    c = TEXT
    D, V, E, I, S = (c["hidden_size"], c["vocab_size"], c["num_experts"],
                     c["moe_intermediate_size"], c["shared_expert_intermediate_size"])
    hk, hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"],
                      c["linear_key_head_dim"], c["linear_value_head_dim"])
    nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    ch = 2 * hk * dk + hv * dv
    n = lambda shape, std, mean=0.0: rng.standard_normal(shape).astype(np.float32) * std + mean
    lin = lambda o, i: n((o, i), 1.0 / math.sqrt(i))
    w = {}
    p = "model.language_model."
    w[p + "embed_tokens.weight"] = n((V, D), EMBED_STD)
    w["lm_head.weight"] = n((V, D), HEAD_GAIN / math.sqrt(D))
    w[p + "norm.weight"] = n((D,), ZC_NORM_STD)
    for i, kind in enumerate(c["layer_types"]):
        l = f"{p}layers.{i}."
        w[l + "input_layernorm.weight"] = n((D,), ZC_NORM_STD)
        w[l + "post_attention_layernorm.weight"] = n((D,), ZC_NORM_STD)
        if kind == "linear_attention":
            a = l + "linear_attn."
            w[a + "in_proj_qkv.weight"] = lin(ch, D)
            w[a + "in_proj_z.weight"] = lin(hv * dv, D)
            w[a + "in_proj_b.weight"] = lin(hv, D)
            w[a + "in_proj_a.weight"] = lin(hv, D)
            w[a + "conv1d.weight"] = n((ch, 1, c["linear_conv_kernel_dim"]), CONV_STD)
            w[a + "A_log"] = np.log(rng.uniform(*A_RANGE, size=(hv,))).astype(np.float32)
            w[a + "dt_bias"] = n((hv,), DT_BIAS_STD, DT_BIAS_MEAN)
            w[a + "norm.weight"] = 1.0 + n((dv,), GATED_NORM_STD)
            w[a + "out_proj.weight"] = lin(D, hv * dv)
        else:
            a = l + "self_attn."
            w[a + "q_proj.weight"] = lin(nq * 2 * hd, D)
            w[a + "k_proj.weight"] = lin(nkv * hd, D)
            w[a + "v_proj.weight"] = lin(nkv * hd, D)
            w[a + "o_proj.weight"] = lin(D, nq * hd)
            w[a + "q_norm.weight"] = n((hd,), ZC_NORM_STD)
            w[a + "k_norm.weight"] = n((hd,), ZC_NORM_STD)
        m = l + "mlp."
        w[m + "gate.weight"] = n((E, D), ROUTER_GAIN / math.sqrt(D))
        w[m + "experts.gate_up_proj"] = n((E, 2 * I, D), 1.0 / math.sqrt(D))
        w[m + "experts.down_proj"] = n((E, D, I), 1.0 / math.sqrt(I))
        w[m + "shared_expert.gate_proj.weight"] = lin(S, D)
        w[m + "shared_expert.up_proj.weight"] = lin(S, D)
        w[m + "shared_expert.down_proj.weight"] = lin(D, S)
        w[m + "shared_expert_gate.weight"] = lin(1, D)
    # bf16 on disk, as the release; A_log f32 (as tiny-official-bf16).
    return {k: mx.array(v) if k.endswith("A_log") else mx.array(v).astype(mx.bfloat16)
            for k, v in w.items()}


def write_hf(dirpath, rng):
    dirpath.mkdir(parents=True)
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": TEXT,
    }
    (dirpath / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": 2, "eos_token_id": [2], "do_sample": False}
    (dirpath / "generation_config.json").write_text(json.dumps(gen, indent=2))
    mx.save_safetensors(str(dirpath / "model.safetensors"), hf_weights(rng),
                        metadata={"format": "pt"})
    tok = ROOT / "assets/qwen3_6"
    with gzip.open(tok / "tokenizer.json.gz") as f:
        (dirpath / "tokenizer.json").write_bytes(f.read())
    shutil.copy(tok / "tokenizer_config.json", dirpath / "tokenizer_config.json")


def run(model, prompt, forced=None):
    """One prefill (all positions' logits), then N_DECODE steps with the cache: greedy, or
    feeding `forced` (teacher forcing; ids are still the model's own argmaxes)."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[0].astype(mx.float32)
    mx.eval(logits)
    prompt_logits = np.array(logits)
    ids, dec = [int(np.argmax(prompt_logits[-1]))], []
    for i in range(N_DECODE):
        feed = ids[i] if forced is None else int(forced[i])
        l = model(mx.array([[feed]]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(l)
        dec.append(np.array(l))
        if i + 1 < N_DECODE:
            ids.append(int(np.argmax(dec[-1])))
    return prompt_logits, np.array(ids, dtype=np.int64), np.stack(dec)


def margins(prompt_logits, dec):
    rows = np.concatenate([prompt_logits[-1:], dec[:-1]])
    s = np.sort(rows, axis=-1)
    return s[:, -1] - s[:, -2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--seed", type=int, default=4000)
    ap.add_argument("--attempts", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out) / "tiny-mlx-4bit"
    for attempt in range(args.attempts):
        seed = args.seed + attempt
        tmp = Path(tempfile.mkdtemp())
        write_hf(tmp / "hf", np.random.default_rng(seed))
        convert(str(tmp / "hf"), str(tmp / "mlx"), quantize=True, q_group_size=64, q_bits=4)
        model, _ = load(str(tmp / "mlx"))
        prompt = [int(x) for x in np.random.default_rng(seed + 7).integers(0, TEXT["vocab_size"], T)]
        bf_free = run(model, prompt)
        model.set_dtype(mx.float32)
        f32 = run(model, prompt)
        model, _ = load(str(tmp / "mlx"))
        bf = run(model, prompt, forced=f32[1])
        m32, mbf = margins(f32[0], f32[2]), margins(bf[0], bf[2])
        print(f"seed {seed}: min f32 margin {m32.min():.3f}, bf16 teacher-forced greedy agrees "
              f"{int((bf[1] == f32[1]).sum())}/{N_DECODE}, free {int((bf_free[1] == f32[1]).sum())}")
        if m32.min() < MIN_MARGIN:
            shutil.rmtree(tmp)
            continue
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for f in ["config.json", "model.safetensors", "model.safetensors.index.json",
                  "generation_config.json"]:
            if (tmp / "mlx" / f).exists():
                shutil.copy(tmp / "mlx" / f, out / f)
        ref = {
            "prompt_ids": mx.array(np.array(prompt, dtype=np.int64)),
            "prompt_logits": mx.array(f32[0]),
            "decode_ids": mx.array(f32[1]),
            "decode_logits": mx.array(f32[2]),
            "bf16_prompt_logits": mx.array(bf[0]),
            "bf16_decode_ids": mx.array(bf[1]),
            "bf16_decode_logits": mx.array(bf[2]),
            "bf16_free_decode_ids": mx.array(bf_free[1]),
        }
        mx.save_safetensors(str(out / "reference.safetensors"), ref)
        amax = float(np.abs(f32[0]).max())
        info = {
            "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                         "numpy": np.__version__, "python": platform.python_version()},
            "seed": {"base": args.seed, "used": seed, "attempt": attempt,
                     "rule": f"first seed whose f32 greedy margin is >= {MIN_MARGIN} at every step"},
            "convert": "mlx_lm.convert(hf, mlx, quantize=True, q_group_size=64, q_bits=4)",
            "T": T, "N": N_DECODE,
            "step_convention": "as tests/fixtures/README.md: decode_ids[0] = argmax(prompt_logits[T-1]); "
                               "step i feeds decode_ids[i]",
            "references": {
                "prompt_logits/decode_ids/decode_logits": "mlx-lm with every float parameter cast to float32 (same codes, scales, biases)",
                "bf16_prompt_logits/bf16_decode_logits": "mlx-lm as loaded (bf16 scales and activations), fed the f32 run's decode_ids (teacher forced); bf16_decode_ids[i] = argmax of row i-1 (row 0: the prompt's last)",
                "bf16_free_decode_ids": "mlx-lm as loaded, free-running greedy on its own tokens",
            },
            "min_greedy_margin_f32": float(m32.min()),
            "min_greedy_margin_bf16": float(mbf.min()),
            "bf16_steps_with_margin_over_0.5": int((mbf > 0.5).sum()),
            "bf16_vs_f32_greedy_agree_teacher_forced": int((bf[1] == f32[1]).sum()),
            "bf16_free_vs_f32_greedy_agree": int((bf_free[1] == f32[1]).sum()),
            "bf16_vs_f32_max_abs_prompt_logit_diff": float(np.abs(bf[0] - f32[0]).max()),
            "max_abs_logit": amax,
            "logit_std": float(f32[0].std()),
        }
        (out / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
        print(json.dumps(info, indent=2))
        shutil.rmtree(tmp)
        return
    raise SystemExit("no seed met the margin rule")


if __name__ == "__main__":
    main()
