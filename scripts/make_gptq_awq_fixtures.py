#!/usr/bin/env python3
"""Writes tests/fixtures/tiny-gptq and tests/fixtures/tiny-awq: the tiny random checkpoint of
scripts/make_mlx_fixtures.py (same dims and init rules; official layout, per-expert experts)
with some projections quantised to 4 bits and packed as GPTQ and AWQ store them, written
from the formats' definitions (no quantiser package; the rounding is plain round-to-nearest,
which is all a checkpoint's layout depends on):

* tiny-gptq: the routed and shared experts (as `palmfuture/Qwen3.6-35B-A3B-GPTQ-Int4`
  quantises only experts) and the attention projections (which keeps the fixture under
  2 MB; the GDN projections stay bf16), symmetric, group 128, `checkpoint_format` "gptq" (zeros stored
  minus one), `desc_act` false with the trivial `g_idx`.
  `qweight [in/8, out]` I32: input row i of output column o is bits 4*(i%8) of
  `qweight[i//8, o]`; `qzeros [in/g, out/8]` I32: column o is bits 4*(o%8) of
  `qzeros[g, o//8]`; `scales [in/g, out]` F16; w = s * (q - (z + 1)).
* tiny-awq: every attention, GDN in/out and expert projection (as the AWQ releases quantise
  experts and attention), asymmetric, group 32, AWQ GEMM packing: `qweight [in, out/8]`
  I32 packed along the output in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble p of word c
  holds column 8c + order[p]), `qzeros [in/g, out/8]` packed the same way, `scales
  [in/g, out]` F16; w = s * (q - z).

* tiny-ct: compressed-tensors `pack-quantized` (llm-compressor's W4A16 format): the
  experts, shared experts and attention, asymmetric, group 64, bf16 scales.
  `weight_packed [out, in/8]` I32: column i of row o is bits 4*(i%8) of
  `weight_packed[o, i//8]`, stored as the signed code + 8; `weight_zero_point
  [out/8, in/g]` I32 packed along the output the same way (signed + 8); `weight_scale
  [out, in/g]`; `weight_shape` [2]; w = s * (q - z) in either the signed or the unsigned
  range.

Each fixture's `reference.json` lists, for every quantised tensor, 16 (row, column, value)
samples of the dequantised weight computed here in float64 (an independent check of the Rust
unpacking). Run with the venv of make_mlx_fixtures.py:

    /work/venv-mlx/bin/python scripts/make_gptq_awq_fixtures.py --out tests/fixtures
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_mlx_fixtures as base  # noqa: E402

SEED = 4017  # the MLX fixture's weights
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_bf16(x):
    """Rounds float values to bf16 (nearest even), returned as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return b.view(np.float32)


def quantise(w, group, sym, bf16_scales=False):
    """Round-to-nearest 4-bit codes per group of input columns: (q [out, in], s [G, out] f16, z [G, out])."""
    out, inp = w.shape
    G = inp // group
    wg = w.reshape(out, G, group).astype(np.float64)
    if sym:
        amax = np.abs(wg).max(axis=2)
        s = np.maximum(2 * amax / 15, 1e-8)
        z = np.full((out, G), 8)
    else:
        lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
        s = np.maximum((hi - lo) / 15, 1e-8)
        z = np.clip(np.round(-lo / s), 0, 15).astype(np.int64)
    s = to_bf16(s) if bf16_scales else s.astype(np.float16)
    q = np.clip(np.round(wg / s.astype(np.float64)[:, :, None]) + z[:, :, None], 0, 15).astype(np.int64)
    return q.reshape(out, inp), s.T.copy(), z.T.copy()


def dequantise(q, s, z, group, zeros_offset=0):
    g = np.arange(q.shape[1]) // group
    return s.astype(np.float64).T[:, g] * (q - z.T[:, g])


def pack_along_rows(x):
    """[n, m] codes -> [n/8, m] words: row r in bits 4*(r%8) of word row r//8."""
    n, m = x.shape
    out = np.zeros((n // 8, m), dtype=np.uint32)
    for k in range(8):
        out |= x[k::8].astype(np.uint32) << np.uint32(4 * k)
    return out.view(np.int32)


def pack_along_cols(x, order=None):
    """[n, m] codes -> [n, m/8] words: column 8c + order[p] in bits 4*p of word c."""
    n, m = x.shape
    order = order or list(range(8))
    out = np.zeros((n, m // 8), dtype=np.uint32)
    for p in range(8):
        out |= x[:, order[p]::8].astype(np.uint32) << np.uint32(4 * p)
    return out.view(np.int32)


def per_expert(w):
    """Official fused experts -> per-expert names (as GPTQ/AWQ releases store them)."""
    outw = {}
    for k, v in w.items():
        if k.endswith("experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                outw[f"{p}{e}.gate_proj.weight"] = v[e, :half]
                outw[f"{p}{e}.up_proj.weight"] = v[e, half:]
        elif k.endswith("experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                outw[f"{p}{e}.down_proj.weight"] = v[e]
        else:
            outw[k] = v
    return outw


def write(out_dir, name, targets, fmt, group, sym, qcfg):
    rng = np.random.default_rng(SEED)
    w = {k: np.array(v.astype(mx.float32)) for k, v in base.hf_weights(rng).items()}
    w = per_expert(w)
    tensors, samples = {}, {}
    srng = np.random.default_rng(1)
    for k, v in w.items():
        m = k[: -len(".weight")] if k.endswith(".weight") else None
        if m is None or v.ndim != 2 or not any(t in m for t in targets):
            keep = mx.array(v) if k.endswith("A_log") else mx.array(v).astype(mx.bfloat16)
            tensors[k] = keep
            continue
        wf = v.astype(np.float32)
        q, s, z = quantise(wf, group, sym, bf16_scales=fmt == "ct")
        deq = dequantise(q, s, z, group)
        if fmt == "gptq":
            tensors[m + ".qweight"] = mx.array(pack_along_rows(q.T))
            tensors[m + ".qzeros"] = mx.array(pack_along_cols(z - 1))
            tensors[m + ".g_idx"] = mx.array((np.arange(q.shape[1]) // group).astype(np.int32))
        elif fmt == "awq":
            tensors[m + ".qweight"] = mx.array(pack_along_cols(q.T, AWQ_ORDER))
            tensors[m + ".qzeros"] = mx.array(pack_along_cols(z, AWQ_ORDER))
        if fmt == "ct":
            # Unsigned codes are the signed ones + 8 already (quantise works unsigned).
            tensors[m + ".weight_packed"] = mx.array(pack_along_cols(q))
            tensors[m + ".weight_zero_point"] = mx.array(pack_along_rows(z.T.copy()))
            tensors[m + ".weight_scale"] = mx.array(s.T.copy()).astype(mx.bfloat16)
            tensors[m + ".weight_shape"] = mx.array(np.array(q.shape, dtype=np.int32))
        else:
            tensors[m + ".scales"] = mx.array(s)
        rows = srng.integers(0, q.shape[0], 16)
        cols = srng.integers(0, q.shape[1], 16)
        samples[m] = [[int(r), int(c), float(deq[r, c])] for r, c in zip(rows, cols)]
    d = out_dir / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": base.TEXT,
        "quantization_config": qcfg,
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "do_sample": False}, indent=2) + "\n")
    mx.save_safetensors(str(d / "model.safetensors"), tensors, metadata={"format": "pt"})
    info = {
        "versions": {"numpy": np.__version__, "mlx": mx.__version__},
        "weights": f"scripts/make_mlx_fixtures.py hf_weights, seed {SEED} (the tiny-mlx-4bit model before conversion)",
        "quantised": sorted(samples),
        "dequantised_samples": samples,
    }
    (d / "reference.json").write_text(json.dumps(info, indent=1) + "\n")
    print(d, len(samples), "quantised matrices")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    out = Path(ap.parse_args().out)
    write(out, "tiny-gptq", ["mlp.experts.", "mlp.shared_expert.", "self_attn."], "gptq", 128, True, {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False,
        "true_sequential": True,
    })
    write(out, "tiny-awq", ["self_attn.", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                            "linear_attn.out_proj", "mlp.experts.", "mlp.shared_expert."],
          "awq", 32, False, {
              "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
              "version": "gemm",
              "modules_to_not_convert": ["mlp.gate", "mlp.shared_expert_gate", "in_proj_a", "in_proj_b"],
          })
    write(out, "tiny-ct", ["mlp.experts.", "mlp.shared_expert.", "self_attn."], "ct", 64, False, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None, "sparsity_config": {},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn.*"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                        "group_size": 64, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None,
        }},
    })


if __name__ == "__main__":
    main()
