#!/usr/bin/env python3
"""Write tiny random-weight Qwen3.5/3.6-MoE ("qwen3_5_moe") checkpoints plus Hugging Face
reference outputs, as golden fixtures for Kestrel's Rust tests.

Two fixtures are written under --out (default tests/fixtures):

  tiny-flat-f32/        flat text-only layout (model_type qwen3_5_moe_text), f32, written by
                        Qwen3_5MoeForCausalLM.save_pretrained (per-expert keys, `model.` prefix).
  tiny-official-bf16/   official release layout (wrapper config, model.language_model.*, fused
                        experts, bf16 with an f32 A_log, 2 shards + index, dummy vision and MTP
                        tensors, generation_config.json).
  tiny-official-fp8/    the official FP8 release's on-disk format (quantization_config fp8 / e4m3
                        / dynamic / [128, 128]; F8_E4M3 projections and per-expert experts, each
                        with an F32 `weight_scale_inv`; the rest bf16), quantised with
                        transformers' own fine-grained FP8 quantiser (`Fp8Quantize`, CPU).

Each fixture also gets reference.safetensors (prompt/decode ids and logits computed by
transformers in float32) and reference.json (versions, seeds, scales, margins, checks).
See tests/fixtures/README.md for the format. Regenerate with:

    /work/venv-fixtures/bin/python scripts/make_fixtures.py --out tests/fixtures --seed 1234

Only torch, transformers, safetensors and numpy are needed (scripts/requirements-fixtures.txt).
Everything runs on CPU in float32.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import sys
import tempfile

import torch
import transformers
import safetensors
from safetensors import safe_open
from safetensors.torch import save_file, load_file
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5MoeVisionConfig,
)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod

MIN_GREEDY_MARGIN = 0.05     # top1 - top2 logit gap required at every greedy step
MIN_ROUTER_GAP = 5e-4        # k-th minus (k+1)-th router logit, every token and layer (f32 noise ~5e-5)
SELFCHECK_TOL = 3e-4         # cached decode vs one uncached forward (measured f32 noise is ~1e-4 at |logit|~15)
N_DECODE = 64

# ----------------------------------------------------------------------------------------------
# Fixture definitions
# ----------------------------------------------------------------------------------------------

FIXTURES = {
    "tiny-flat-f32": dict(
        layout="flat",
        storage="f32",
        T=37,
        text=dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            full_attention_interval=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=256,  # the real model's head dims (the production CUDA kernels exist only for these)
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            # rotary dims = 256 * 0.25 = 64 -> 32 frequencies -> mrope_section sums to 32 (the real [11, 11, 10])
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                 mrope_section=[11, 11, 10], mrope_interleaved=True),
        ),
    ),
    "tiny-official-bf16": dict(
        layout="official",
        storage="bf16",
        T=150,  # > 2 x 64: HF's chunked GDN prefill crosses two chunk boundaries
        text=dict(
            vocab_size=1000,
            hidden_size=96,
            num_hidden_layers=8,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
            full_attention_interval=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,  # real dims, as fixture A
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            # rotary dims = 256 * 0.25 = 64 -> 32 frequencies -> mrope_section sums to 32 (the real [11, 11, 10])
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                 mrope_section=[11, 11, 10], mrope_interleaved=True),
        ),
        # The official ids do not fit a 1000-token vocab; stand-ins: 1 plays <|im_end|> (248046),
        # 2 plays <|endoftext|> (248044). generation_config.json gets eos [1, 2] (official:
        # [248046, 248044]); text_config gets eos 2 and bos 2 (official: 248044).
        eos_token_id=[1, 2],
        pad_token_id=2,
        bos_token_id=2,
        text_config_eos_token_id=2,
    ),
    # The FP8 release's format. Every quantised dim is a multiple of 128 (D = I = Is = 128), as
    # in the release: transformers' quantiser leaves other shapes unquantised and its
    # dequantiser rejects them, so ragged blocks are tested in Rust only.
    "tiny-official-fp8": dict(
        layout="official-fp8",
        storage="fp8",
        T=70,  # > 64: HF's chunked GDN prefill crosses a chunk boundary
        text=dict(
            vocab_size=256,
            hidden_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            full_attention_interval=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                 mrope_section=[11, 11, 10], mrope_interleaved=True),
        ),
        eos_token_id=[1, 2],
        pad_token_id=2,
        bos_token_id=2,
        text_config_eos_token_id=2,
        vision_token_ids=[250, 251, 252, 253],
    ),
}

FP8_BLOCK = (128, 128)
# The modules the FP8 release keeps in bf16 (spec 5.3), as transformers-style patterns (a prefix
# or a suffix of the module name). The release's exact list is unverified; these are its roles.
FP8_MODULES_TO_NOT_CONVERT = [
    "lm_head",
    "model.language_model.embed_tokens",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "model.visual",
    "mtp.fc",
]
# In-memory (Qwen3_5MoeForCausalLM) names of the FP8 projections; experts are handled per expert.
FP8_LINEAR_RE = re.compile(
    r"(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")

COMMON_TEXT = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    partial_rotary_factor=0.25,
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    router_aux_loss_coef=0.001,
)

# weight scales (see init_weights); chosen so logits have std ~2-3 and routing is spread out
EMBED_STD = 1.0
HEAD_GAIN = 3.0
ROUTER_GAIN = 3.0
ZC_NORM_STD = 0.3     # zero-centred RMSNorm weights (used as 1 + w)
GATED_NORM_STD = 0.3  # GDN gated norm weight = 1 + N(0, 0.3) (used as plain w)
CONV_STD = 0.5
DT_BIAS_MEAN, DT_BIAS_STD = -4.0, 1.0
A_RANGE = (1.0, 16.0)


def make_text_config(fx):
    kw = dict(COMMON_TEXT)
    kw.update(copy.deepcopy(fx["text"]))
    if "text_config_eos_token_id" in fx:
        kw["eos_token_id"] = fx["text_config_eos_token_id"]
        kw["bos_token_id"] = fx["bos_token_id"]
    cfg = Qwen3_5MoeTextConfig(**kw)
    assert cfg.layer_types == fx["text"]["layer_types"]
    for i, t in enumerate(cfg.layer_types):
        assert t == ("full_attention" if i % 4 == 3 else "linear_attention")
    return cfg


# ----------------------------------------------------------------------------------------------
# Weight initialisation
# ----------------------------------------------------------------------------------------------

ZC_NORM_RE = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$")


def init_weights(model, cfg, gen):
    """Overwrite every parameter with a fixed-seed draw. Returns {name: rule} for the record."""
    D = cfg.hidden_size
    I = cfg.moe_intermediate_size
    rules = {}

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            shp = tuple(p.shape)
            if name.endswith("embed_tokens.weight"):
                v, r = normal(shp, EMBED_STD), f"N(0,{EMBED_STD})"
            elif name == "lm_head.weight":
                v, r = normal(shp, HEAD_GAIN / math.sqrt(D)), f"N(0,{HEAD_GAIN}/sqrt(D))"
            elif name.endswith("linear_attn.norm.weight"):
                v, r = 1.0 + normal(shp, GATED_NORM_STD), f"1+N(0,{GATED_NORM_STD})"
            elif ZC_NORM_RE.search(name) or name.endswith("model.norm.weight"):
                v, r = normal(shp, ZC_NORM_STD), f"N(0,{ZC_NORM_STD})"
            elif name.endswith("linear_attn.A_log"):
                lo, hi = A_RANGE
                u = torch.rand(shp, generator=gen, dtype=torch.float32) * (hi - lo) + lo
                v, r = torch.log(u), f"log(U({lo},{hi}))"
            elif name.endswith("linear_attn.dt_bias"):
                v, r = normal(shp, DT_BIAS_STD, DT_BIAS_MEAN), f"N({DT_BIAS_MEAN},{DT_BIAS_STD})"
            elif name.endswith("linear_attn.conv1d.weight"):
                v, r = normal(shp, CONV_STD), f"N(0,{CONV_STD})"
            elif name.endswith("mlp.gate.weight"):
                v, r = normal(shp, ROUTER_GAIN / math.sqrt(D)), f"N(0,{ROUTER_GAIN}/sqrt(D))"
            elif name.endswith("mlp.experts.gate_up_proj"):
                v, r = normal(shp, 1.0 / math.sqrt(D)), "N(0,1/sqrt(D))"
            elif name.endswith("mlp.experts.down_proj"):
                v, r = normal(shp, 1.0 / math.sqrt(I)), "N(0,1/sqrt(I))"
            elif p.ndim == 2:
                v, r = normal(shp, 1.0 / math.sqrt(shp[1])), "N(0,1/sqrt(fan_in))"
            else:
                raise RuntimeError(f"no init rule for parameter {name} {shp}")
            p.copy_(v)
            rules[re.sub(r"\.\d+\.", ".N.", name)] = r
    return rules


def round_params_to_bf16(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def build_model(cfg, seed, bf16_round):
    torch.manual_seed(seed)  # HF's own init draws from the global RNG; we overwrite it anyway
    model = Qwen3_5MoeForCausalLM(cfg)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed)
    rules = init_weights(model, cfg, gen)
    if bf16_round:
        round_params_to_bf16(model)
    model.eval()
    return model, rules


# ----------------------------------------------------------------------------------------------
# FP8: transformers' own fine-grained FP8 quantiser, run on CPU
# ----------------------------------------------------------------------------------------------

def fp8_ops():
    """transformers' `Fp8Quantize` / `Fp8Dequantize` conversion ops. They are plain torch and run
    on CPU; only the quantizer's `validate_environment` (on-the-fly quantisation at load) and the
    FP8 matmul (Triton / DeepGEMM) need a GPU."""
    from transformers.utils.quantization_config import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
    qz = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=FP8_BLOCK))
    return Fp8Quantize(qz), Fp8Dequantize(qz)


def fp8_dequantize(q, s):
    """The format's definition: w[r, c] = e4m3(q[r, c]) * s[r // 128, c // 128] (in f32)."""
    rows, cols = q.shape
    br, bc = FP8_BLOCK
    full = s.to(torch.float32).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.to(torch.float32) * full


@torch.no_grad()
def quantize_model_fp8(model, cfg):
    """Quantise every FP8-format weight of `model` with transformers' quantiser and write the
    dequantised values back, so `model` is exactly what the FP8 files mean. Returns
    {in-memory per-expert-style name: (fp8 tensor, f32 weight_scale_inv)}."""
    qop, dqop = fp8_ops()
    stored = {}
    E, I = cfg.num_experts, cfg.moe_intermediate_size

    def q1(name, w):
        out = qop.convert({name: w.contiguous()})
        q, s = out[name], out[name[: -len(".weight")] + ".weight_scale_inv"]
        rows, cols = w.shape
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, (name, q.dtype, s.dtype)
        assert tuple(s.shape) == (math.ceil(rows / FP8_BLOCK[0]), math.ceil(cols / FP8_BLOCK[1])), name
        d = fp8_dequantize(q, s)
        assert torch.equal(d, dqop._dequantize_one(q, s, output_dtype=torch.float32)), name
        stored[name] = (q, s)
        return d

    for name, p in model.named_parameters():
        if FP8_LINEAR_RE.search(name):
            p.copy_(q1(name, p.data))
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            for e in range(E):
                p[e, :I] = q1(f"{base}.{e}.gate_proj.weight", p[e, :I])
                p[e, I:] = q1(f"{base}.{e}.up_proj.weight", p[e, I:])
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len(".down_proj")]
            for e in range(E):
                p[e] = q1(f"{base}.{e}.down_proj.weight", p[e])
    n_expected = cfg.num_hidden_layers * (3 * E + 3) + sum(
        3 if t == "linear_attention" else 4 for t in cfg.layer_types)
    assert len(stored) == n_expected, (len(stored), n_expected)
    return stored


# ----------------------------------------------------------------------------------------------
# Reference computation
# ----------------------------------------------------------------------------------------------

class RouterTap:
    """Forward hooks on every MoE router: records router logits and chosen experts."""

    def __init__(self, model, k):
        self.records = []  # (layer, logits[n,E], indices[n,k])
        self.handles = []
        self.k = k
        self.min_gap = float("inf")
        for li, layer in enumerate(model.model.layers):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(li)))

    def _hook(self, li):
        def fn(_mod, _inp, out):
            logits, _scores, idx = out
            self.records.append((li, logits.detach().clone(), idx.detach().clone()))
            srt = torch.sort(logits.detach().float(), dim=-1, descending=True).values
            self.min_gap = min(self.min_gap, float((srt[:, self.k - 1] - srt[:, self.k]).min()))
        return fn

    def close(self):
        for h in self.handles:
            h.remove()

    def summary(self, cfg):
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        counts = torch.zeros(cfg.num_hidden_layers, E, dtype=torch.long)
        min_gap = float("inf")
        for li, logits, idx in self.records:
            counts[li] += torch.bincount(idx.reshape(-1), minlength=E)
            s = torch.sort(logits.float(), dim=-1, descending=True).values
            min_gap = min(min_gap, float((s[:, k - 1] - s[:, k]).min()))
        return counts, min_gap


def top2_margin(logits):
    s = torch.topk(logits, 2, dim=-1).values
    return s[..., 0] - s[..., 1]


@torch.no_grad()
def run_reference(model, cfg, prompt_ids, n_decode, reject=None):
    """Prefill, then n_decode greedy cached steps. `reject(row)` (optional) is called on every
    row whose argmax is (or would be) a greedy choice; if it returns True the run stops early
    and None is returned (used by the seed search)."""
    T = prompt_ids.numel()
    out = model(input_ids=prompt_ids[None], use_cache=True)
    prompt_logits = out.logits[0].float().clone()
    if reject is not None and reject(prompt_logits[-1]):
        return None
    cache = out.past_key_values
    decode_ids = [int(prompt_logits[-1].argmax())]
    decode_logits = []
    for i in range(n_decode):
        assert cache.get_seq_length() == T + i, (cache.get_seq_length(), T + i)
        tok = torch.tensor([[decode_ids[i]]], dtype=torch.long)
        pos = torch.tensor([[T + i]], dtype=torch.long)
        out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True)
        cache = out.past_key_values
        row = out.logits[0, -1].float().clone()
        decode_logits.append(row)
        if reject is not None and reject(row):
            return None
        if i + 1 < n_decode:
            decode_ids.append(int(row.argmax()))
    return prompt_logits, torch.tensor(decode_ids, dtype=torch.long), torch.stack(decode_logits)


@torch.no_grad()
def full_forward(model, ids):
    return model(input_ids=ids[None], use_cache=False).logits[0].float()


def _f64_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **_kw):
    """Token-by-token gated delta rule in float64 (spec section 3.4.7), same call signature as
    transformers' torch_{chunk,recurrent}_gated_delta_rule. Diagnostic only."""
    f64 = torch.float64
    q, k, v, b, gg = [x.transpose(1, 2).to(f64) for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    bsz, nh, L, dk = k.shape
    S = torch.zeros(bsz, nh, dk, v.shape[-1], dtype=f64) if initial_state is None else initial_state.to(f64)
    o = torch.empty(bsz, nh, L, v.shape[-1], dtype=f64)
    for t in range(L):
        S = S * gg[:, :, t].exp()[..., None, None]
        u = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])) * b[:, :, t, None]
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        o[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    return o.transpose(1, 2).to(query.dtype), (S if output_final_state else None)


@torch.no_grad()
def f64_diagnostic(model, res):
    """How far is the float32 HF reference from a float64 re-run (GDN core replaced by a float64
    recurrence; HF still does RMSNorm statistics and RoPE cos/sin in float32)? This is the noise
    floor a correct f32 implementation should expect against the stored logits."""
    saved = (hf_mod.torch_chunk_gated_delta_rule, hf_mod.torch_recurrent_gated_delta_rule)
    hf_mod.torch_chunk_gated_delta_rule = _f64_delta_rule
    hf_mod.torch_recurrent_gated_delta_rule = _f64_delta_rule
    try:
        m64 = copy.deepcopy(model).double()
        seq = torch.cat([res["prompt_ids"], res["decode_ids"]])
        T = res["prompt_ids"].numel()
        ref = m64(input_ids=seq[None], use_cache=False).logits[0]
    finally:
        hf_mod.torch_chunk_gated_delta_rule, hf_mod.torch_recurrent_gated_delta_rule = saved
    return {
        "prompt_logits_vs_f64_max_abs": float((res["prompt_logits"].double() - ref[:T]).abs().max()),
        "decode_logits_vs_f64_max_abs": float((res["decode_logits"].double() - ref[T:]).abs().max()),
        "f64_greedy_ids_agree": bool(torch.equal(ref[T - 1:-1].argmax(-1), res["decode_ids"])),
    }


def try_seed(name, fx, cfg, seed, verbose=True):
    bf16 = fx["storage"] in ("bf16", "fp8")
    model, rules = build_model(cfg, seed, bf16)
    fp8_stored = quantize_model_fp8(model, cfg) if fx["storage"] == "fp8" else None
    gen = torch.Generator().manual_seed(seed + 7919)
    prompt_ids = torch.randint(0, cfg.vocab_size, (fx["T"],), generator=gen, dtype=torch.long)

    eos = set(fx.get("eos_token_id", []) or [])

    def reject(row):
        return (float(top2_margin(row)) < MIN_GREEDY_MARGIN or int(row.argmax()) in eos
                or tap.min_gap < MIN_ROUTER_GAP)

    tap = RouterTap(model, cfg.num_experts_per_tok)
    out = run_reference(model, cfg, prompt_ids, N_DECODE, reject=reject)
    tap.close()
    if out is None:
        if verbose:
            print(f"  [{name}] seed {seed}: reject early (greedy margin < {MIN_GREEDY_MARGIN}, eos, "
                  f"or router gap < {MIN_ROUTER_GAP})", flush=True)
        return False, None
    prompt_logits, decode_ids, decode_logits = out
    counts, router_gap = tap.summary(cfg)

    chosen_rows = torch.cat([prompt_logits[-1:], decode_logits])  # N+1 rows (last one unused)
    margins = top2_margin(chosen_rows)
    min_margin_used = float(margins[:-1].min())
    min_margin_all = float(margins.min())
    eos_hit = [int(t) for t in decode_ids if int(t) in eos]

    ok = True
    why = []
    if min_margin_all < MIN_GREEDY_MARGIN:
        ok = False
        why.append(f"greedy margin {min_margin_all:.4f}")
    if router_gap < MIN_ROUTER_GAP:
        ok = False
        why.append(f"router gap {router_gap:.2e}")
    if eos_hit:
        ok = False
        why.append(f"decode hits eos {eos_hit}")
    used = (counts > 0).sum(dim=1)
    if int(used.min()) < math.ceil(0.75 * cfg.num_experts):
        ok = False
        why.append(f"few experts used {used.tolist()}")
    share = counts.float() / counts.sum(dim=1, keepdim=True)
    if float(share.max()) > 3.0 / cfg.num_experts:
        ok = False
        why.append(f"expert share too high {float(share.max()):.3f}")
    if verbose:
        print(f"  [{name}] seed {seed}: margin(min over steps) {min_margin_all:.4f}, router gap "
              f"{router_gap:.2e}, logit std {float(prompt_logits.std()):.3f} -> "
              f"{'OK' if ok else 'reject: ' + '; '.join(why)}", flush=True)
    return ok, dict(model=model, rules=rules, fp8_stored=fp8_stored, prompt_ids=prompt_ids, prompt_logits=prompt_logits,
                    decode_ids=decode_ids, decode_logits=decode_logits, counts=counts,
                    router_gap=router_gap, min_margin_used=min_margin_used,
                    min_margin_all=min_margin_all, margins=margins, tap_records=tap.records)


@torch.no_grad()
def hidden_stats(model, ids):
    """RMS of the residual stream: embeddings, after each decoder layer, after the final norm."""
    rec = {}
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: rec.__setitem__("embed", o))]
    for li, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, i, o, li=li: rec.__setitem__(f"layer{li}", o)))
    hooks.append(model.model.norm.register_forward_hook(lambda m, i, o: rec.__setitem__("final_norm", o)))
    model(input_ids=ids[None], use_cache=False)
    for h in hooks:
        h.remove()
    return {k: round(float(v.float().pow(2).mean().sqrt()), 4) for k, v in rec.items()}


# ----------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------

def fused_to_per_expert(sd, n_experts, inter):
    """Split fused expert tensors ([E,2I,D] gate rows first, [E,D,I]) into per-expert keys."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if not m:
            out[k] = v
            continue
        base, which = m.groups()
        assert v.shape[0] == n_experts
        for e in range(n_experts):
            if which == "gate_up_proj":
                assert v.shape[1] == 2 * inter
                out[f"{base}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
            else:
                out[f"{base}.{e}.down_proj.weight"] = v[e].contiguous()
    return out


def write_flat(model, cfg, fdir):
    """Fixture A: whatever Qwen3_5MoeForCausalLM.save_pretrained writes (f32), forced to the
    per-expert layout if a future transformers saves fused keys."""
    model.save_pretrained(fdir, safe_serialization=True)
    path = os.path.join(fdir, "model.safetensors")
    assert os.path.exists(path), os.listdir(fdir)
    sd = load_file(path)
    info = {"save_pretrained_wrote_fused_experts": any(k.endswith("experts.gate_up_proj") for k in sd)}
    if info["save_pretrained_wrote_fused_experts"]:
        sd = fused_to_per_expert(sd, cfg.num_experts, cfg.moe_intermediate_size)
        save_file(sd, path, metadata={"format": "pt"})
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in sd)
    assert not any(k.startswith("model.language_model.") for k in sd)
    assert all(v.dtype == torch.float32 for v in sd.values())
    return info


def official_text_state(model):
    """In-memory Qwen3_5MoeForCausalLM names -> official names (fused experts already match)."""
    out = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            out[k] = v
        elif k.startswith("model."):
            out["model.language_model." + k[len("model."):]] = v
        else:
            raise RuntimeError(k)
    return out


def storage_dtype(name):
    # A_log stays f32 on purpose; everything else (big matrices, dt_bias, norms, conv, router)
    # is bf16 -> mixed small-vector dtypes, as seen across copies of the real checkpoint.
    return torch.float32 if name.endswith("linear_attn.A_log") else torch.bfloat16


def stub_vision_config(D):
    return Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                  patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                                  in_channels=3, out_hidden_size=D, num_position_embeddings=16)


def make_vision_tensors(vcfg, gen):
    vm = hf_mod.Qwen3_5MoeVisionModel(vcfg)
    out = {}
    for k, v in vm.state_dict().items():
        if "inv_freq" in k:
            continue
        out["model.visual." + k] = (torch.randn(v.shape, generator=gen) * 0.02).to(torch.bfloat16)
    return out


def make_mtp_tensors(cfg, gen):
    """A partial MTP set with the official names and shapes (norms, fc, one layer's norms and
    router). Random; transformers ignores mtp.*, so there is no reference for them."""
    D, hd, E = cfg.hidden_size, cfg.head_dim, cfg.num_experts

    def n(shape, std):
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    return {
        "mtp.fc.weight": n((D, 2 * D), 1 / math.sqrt(2 * D)),
        "mtp.pre_fc_norm_embedding.weight": n((D,), ZC_NORM_STD),
        "mtp.pre_fc_norm_hidden.weight": n((D,), ZC_NORM_STD),
        "mtp.norm.weight": n((D,), ZC_NORM_STD),
        "mtp.layers.0.input_layernorm.weight": n((D,), ZC_NORM_STD),
        "mtp.layers.0.post_attention_layernorm.weight": n((D,), ZC_NORM_STD),
        "mtp.layers.0.self_attn.q_norm.weight": n((hd,), ZC_NORM_STD),
        "mtp.layers.0.self_attn.k_norm.weight": n((hd,), ZC_NORM_STD),
        "mtp.layers.0.mlp.gate.weight": n((E, D), ROUTER_GAIN / math.sqrt(D)),
        "mtp.layers.0.mlp.shared_expert_gate.weight": n((1, D), 1 / math.sqrt(D)),
    }


MTP_LAYER_SEED_OFFSET = 7919


def make_mtp_layer_tensors(cfg, seed):
    """The rest of a complete MTP head for the bf16 official fixture: the MTP layer's gated
    attention projections, fused routed experts and shared expert, with the official names and
    shapes (spec 2.3). Its own generator (seed + MTP_LAYER_SEED_OFFSET), so every other tensor,
    and the partial set make_mtp_tensors writes, are unchanged."""
    gen = torch.Generator().manual_seed(seed + MTP_LAYER_SEED_OFFSET)
    D, hd = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size

    def n(shape, fan_in):
        return (torch.randn(shape, generator=gen) / math.sqrt(fan_in)).to(torch.bfloat16)

    p = "mtp.layers.0."
    return {
        p + "self_attn.q_proj.weight": n((nq * 2 * hd, D), D),
        p + "self_attn.k_proj.weight": n((nkv * hd, D), D),
        p + "self_attn.v_proj.weight": n((nkv * hd, D), D),
        p + "self_attn.o_proj.weight": n((D, nq * hd), nq * hd),
        p + "mlp.experts.gate_up_proj": n((E, 2 * I, D), D),
        p + "mlp.experts.down_proj": n((E, D, I), I),
        p + "mlp.shared_expert.gate_proj.weight": n((Is, D), D),
        p + "mlp.shared_expert.up_proj.weight": n((Is, D), D),
        p + "mlp.shared_expert.down_proj.weight": n((D, Is), Is),
    }


def make_mtp_layer_tensors_fp8(cfg, seed, have):
    """make_mtp_layer_tensors in the FP8 release's format: experts per expert, and every
    projection the format quantises (attention q/k/v/o, routed and shared experts) quantised by
    transformers' own Fp8Quantize with its F32 weight_scale_inv. Tensors already in `have` (the
    one FP8 expert matrix write_official_fp8 writes) are left as they are."""
    bf = make_mtp_layer_tensors(cfg, seed)
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    p = "mtp.layers.0."
    plain = {k: v for k, v in bf.items() if "mlp.experts." not in k}
    gate_up, down = bf[p + "mlp.experts.gate_up_proj"], bf[p + "mlp.experts.down_proj"]
    for e in range(E):
        plain[f"{p}mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :I]
        plain[f"{p}mlp.experts.{e}.up_proj.weight"] = gate_up[e, I:]
        plain[f"{p}mlp.experts.{e}.down_proj.weight"] = down[e]
    qop, _ = fp8_ops()
    out = {}
    for k, w in sorted(plain.items()):
        if k in have:
            continue
        q = qop.convert({k: w.float()})
        out[k] = q[k].contiguous()
        out[k[: -len(".weight")] + ".weight_scale_inv"] = q[k[: -len(".weight")] + ".weight_scale_inv"].contiguous()
    return out


def add_mtp_layer(fdir, cfg, seed, fp8=False):
    """Completes the MTP head of an official fixture in place: make_mtp_layer_tensors (FP8 for
    the FP8 fixture) go into the last shard (the other shard's bytes are untouched), and the
    index follows."""
    idx_path = os.path.join(fdir, "model.safetensors.index.json")
    idx = json.load(open(idx_path))
    last = sorted(set(idx["weight_map"].values()))[-1]
    path = os.path.join(fdir, last)
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if fp8:
        extra = make_mtp_layer_tensors_fp8(cfg, seed, set(idx["weight_map"]))
    else:
        extra = make_mtp_layer_tensors(cfg, seed)
    assert not set(extra) & set(idx["weight_map"]), "the fixture already has the MTP layer"
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})
    for k, v in extra.items():
        idx["weight_map"][k] = last
        idx["metadata"]["total_size"] += v.numel() * v.element_size()
    idx["weight_map"] = dict(sorted(idx["weight_map"].items()))
    with open(idx_path, "w") as f:
        json.dump(idx, f, indent=2)
        f.write("\n")
    return {"mtp_layer_tensors": sorted(extra), "mtp_shard": last,
            "total_size": idx["metadata"]["total_size"]}


def zc_rms_norm(x, w, eps):
    """Zero-centred RMSNorm (spec 3.2 A), f32: x / rms(x) * (1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


@torch.no_grad()
def write_mtp_reference(fdir):
    """An independent reference for Kestrel's MTP head (transformers has none): the head
    written out here from its structure (spec 4.2, vLLM's Qwen3_5MultiTokenPredictor), with
    transformers' own Qwen3_5MoeDecoderLayer (full attention, its MoE) for the MTP layer and
    transformers' rotary embedding, all in f32 from the stored weights. Rows: the main model's
    final-normed hidden state at each prompt position p (transformers' last_hidden_state)
    paired with the token at p + 1, the last row with the prompt's greedy next token, at
    positions 0..T-1 (causal). Writes mtp_reference.safetensors: hidden [T, D], tokens [T],
    logits [T, V]."""
    ref = load_file(os.path.join(fdir, "reference.safetensors"))
    prompt = ref["prompt_ids"].long()
    nxt = ref["decode_ids"][:1].long()
    m = Qwen3_5MoeForConditionalGeneration.from_pretrained(fdir, dtype=torch.float32).eval()
    m.set_attn_implementation("eager")
    m.set_experts_implementation("eager")
    lm = m.model.language_model
    cfg = lm.config
    y = lm(input_ids=prompt[None], use_cache=False).last_hidden_state[0].float()
    tokens = torch.cat([prompt[1:], nxt])
    T, D = y.shape
    idx = json.load(open(os.path.join(fdir, "model.safetensors.index.json")))
    raw = {}
    for fname in sorted(set(idx["weight_map"].values())):
        with safe_open(os.path.join(fdir, fname), "pt") as f:
            for k in f.keys():
                if k.startswith("mtp."):
                    raw[k] = f.get_tensor(k)
    # FP8 matrices dequantised by the format's definition; per-expert experts fused as
    # transformers' decoder layer holds them.
    w = {}
    for k, t in raw.items():
        if k.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            w[k] = fp8_dequantize(t, raw[k[: -len(".weight")] + ".weight_scale_inv"])
        else:
            w[k] = t.float()
    p = "mtp.layers.0.mlp.experts."
    if p + "0.down_proj.weight" in w:
        E = cfg.num_experts
        w[p + "gate_up_proj"] = torch.stack(
            [torch.cat([w.pop(f"{p}{e}.gate_proj.weight"), w.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)])
        w[p + "down_proj"] = torch.stack([w.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    eps = cfg.rms_norm_eps
    e = zc_rms_norm(lm.embed_tokens.weight[tokens].float(), w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = zc_rms_norm(y, w["mtp.pre_fc_norm_hidden.weight"], eps)
    h0 = torch.cat([e, h], dim=-1) @ w["mtp.fc.weight"].T
    full = cfg.layer_types.index("full_attention")
    layer = hf_mod.Qwen3_5MoeDecoderLayer(cfg, full).float().eval()
    sd = {k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if "inv_freq" not in k], (missing, unexpected)
    pos = torch.arange(T).view(1, 1, -1).expand(3, 1, -1)
    pe = lm.rotary_emb(h0[None], pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out = layer(h0[None], position_embeddings=pe, attention_mask=mask, position_ids=pos[0])
    out = out[0] if isinstance(out, tuple) else out
    mo = zc_rms_norm(out[0], w["mtp.norm.weight"], eps)
    logits = mo @ m.lm_head.weight.float().T
    save_file({"hidden": y.contiguous(), "tokens": tokens.to(torch.int64).contiguous(),
               "logits": logits.contiguous()},
              os.path.join(fdir, "mtp_reference.safetensors"), metadata={"format": "pt"})
    return {"rows": T, "max_abs_logit": float(logits.abs().max()), "logit_std": float(logits.std())}


TEXT_CONFIG_KEYS = [
    "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "full_attention_interval",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "layer_types",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_value_head_dim", "max_position_embeddings", "model_type", "moe_intermediate_size",
    "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
    "num_key_value_heads", "output_router_logits", "partial_rotary_factor", "rms_norm_eps",
    "rope_parameters", "router_aux_loss_coef", "shared_expert_intermediate_size",
    "tie_word_embeddings", "use_cache", "vocab_size",
]
VISION_CONFIG_KEYS = [
    "depth", "hidden_act", "hidden_size", "in_channels", "initializer_range", "intermediate_size",
    "model_type", "num_heads", "num_position_embeddings", "out_hidden_size", "patch_size",
    "spatial_merge_size", "temporal_patch_size",
]


def official_config_dict(cfg, fx, vcfg):
    """A clean wrapper config.json in the style of the official release (only meaningful keys)."""
    td, vd = cfg.to_dict(), vcfg.to_dict()
    text = {k: td[k] for k in TEXT_CONFIG_KEYS}
    # keys the official text_config carries that transformers does not read
    text.update({"attn_output_gate": True, "dtype": "bfloat16", "mamba_ssm_dtype": "float32",
                 "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                 "model_type": "qwen3_5_moe_text", "tie_word_embeddings": False})
    vision = {k: vd[k] for k in VISION_CONFIG_KEYS}
    vision["model_type"] = "qwen3_5_moe_vision"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        # the real ids (248056/248057/248053/248054) do not fit the tiny vocab
        **dict(zip(["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"],
                   fx.get("vision_token_ids", [990, 991, 992, 993]))),
        "text_config": dict(sorted(text.items())),
        "vision_config": dict(sorted(vision.items())),
        "transformers_version": transformers.__version__,
    }


def write_official(model, cfg, fx, fdir, seed):
    gen = torch.Generator().manual_seed(seed + 104729)
    tensors = {}
    for k, v in official_text_state(model).items():
        t = v.detach().to(storage_dtype(k)).contiguous()
        assert torch.equal(t.float(), v.float()), f"{k} is not bf16-representable"
        tensors[k] = t
    vcfg = stub_vision_config(cfg.hidden_size)
    tensors.update(make_vision_tensors(vcfg, gen))
    tensors.update(make_mtp_tensors(cfg, gen))

    names = sorted(tensors)
    nbytes = {k: tensors[k].numel() * tensors[k].element_size() for k in names}
    total = sum(nbytes.values())
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    shards = [{}, {}]
    acc = 0
    for k in names:  # sorted order; the cut falls in the middle of a layer on purpose
        s = 0 if acc < total / 2 else 1
        shards[s][k] = tensors[k]
        acc += nbytes[k]
    weight_map = {}
    for fname, sh in zip(shard_names, shards):
        assert sh
        save_file(sh, os.path.join(fdir, fname), metadata={"format": "pt"})
        for k in sh:
            weight_map[k] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(fdir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")

    conf = official_config_dict(cfg, fx, vcfg)
    with open(os.path.join(fdir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")
    gen_conf = {
        "bos_token_id": fx["bos_token_id"],
        "pad_token_id": fx["pad_token_id"],
        "eos_token_id": list(fx["eos_token_id"]),
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(fdir, "generation_config.json"), "w") as f:
        json.dump(gen_conf, f, indent=2)
        f.write("\n")
    return {"total_size": total, "shards": {n: len(s) for n, s in zip(shard_names, shards)}}


def official_name(k):
    return k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]


def write_official_fp8(model, cfg, fx, fdir, seed, stored):
    """The FP8 release's layout: official names, FP8 projections with F32 `weight_scale_inv`,
    experts per expert, everything else bf16 (A_log f32), stub vision and a partial MTP set
    (including one FP8 expert matrix, as the release's MTP experts are FP8), two shards split
    between an FP8 weight and its scale."""
    gen = torch.Generator().manual_seed(seed + 104729)
    tensors = {}
    for k, v in official_text_state(model).items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            continue  # written per expert below
        internal = "model." + k[len("model.language_model."):] if k.startswith("model.") else k
        if internal in stored:
            continue
        t = v.detach().to(storage_dtype(k)).contiguous()
        assert torch.equal(t.float(), v.float()), f"{k} is not bf16-representable"
        tensors[k] = t
    for internal, (q, sc) in stored.items():
        k = official_name(internal)
        tensors[k] = q.contiguous()
        tensors[k[: -len(".weight")] + ".weight_scale_inv"] = sc.contiguous()
    vcfg = stub_vision_config(cfg.hidden_size)
    tensors.update(make_vision_tensors(vcfg, gen))
    tensors.update(make_mtp_tensors(cfg, gen))
    qop, _ = fp8_ops()
    mtp_e = "mtp.layers.0.mlp.experts.0.gate_proj.weight"
    w = torch.randn((cfg.moe_intermediate_size, cfg.hidden_size), generator=gen) / math.sqrt(cfg.hidden_size)
    out = qop.convert({mtp_e: w.to(torch.bfloat16).float()})
    tensors[mtp_e] = out[mtp_e]
    tensors[mtp_e[: -len(".weight")] + ".weight_scale_inv"] = out[mtp_e[: -len(".weight")] + ".weight_scale_inv"]

    names = sorted(tensors)
    nbytes = {k: tensors[k].numel() * tensors[k].element_size() for k in names}
    total = sum(nbytes.values())
    # Cut at about half the bytes, right before a scale tensor, so that scale lives in the
    # other shard than its weight.
    acc, cut = 0, None
    for i, k in enumerate(names):
        if acc >= total / 2 and k.endswith(".weight_scale_inv") and names[i - 1] == k[: -len("_scale_inv")]:
            cut = i
            break
        acc += nbytes[k]
    assert cut is not None
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    shards = [{k: tensors[k] for k in names[:cut]}, {k: tensors[k] for k in names[cut:]}]
    weight_map = {}
    for fname, sh in zip(shard_names, shards):
        save_file(sh, os.path.join(fdir, fname), metadata={"format": "pt"})
        for k in sh:
            weight_map[k] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(fdir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")

    conf = official_config_dict(cfg, fx, vcfg)
    # The release's quantization_config, at the top level where transformers keeps it.
    conf["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": FP8_MODULES_TO_NOT_CONVERT,
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    }
    with open(os.path.join(fdir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")
    gen_conf = {
        "bos_token_id": fx["bos_token_id"],
        "pad_token_id": fx["pad_token_id"],
        "eos_token_id": list(fx["eos_token_id"]),
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(fdir, "generation_config.json"), "w") as f:
        json.dump(gen_conf, f, indent=2)
        f.write("\n")
    n_fp8 = sum(1 for t in tensors.values() if t.dtype == torch.float8_e4m3fn)
    return {"total_size": total, "shards": {n: len(s) for n, s in zip(shard_names, shards)},
            "fp8_tensors": n_fp8, "split_pair": names[cut - 1]}


def write_reference(fdir, res):
    ref = {
        "prompt_ids": res["prompt_ids"].to(torch.int64).contiguous(),
        "prompt_logits": res["prompt_logits"].to(torch.float32).contiguous(),
        "decode_ids": res["decode_ids"].to(torch.int64).contiguous(),
        "decode_logits": res["decode_logits"].to(torch.float32).contiguous(),
    }
    save_file(ref, os.path.join(fdir, "reference.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# Verification: load what was written back into transformers and reproduce the logits
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def compare_models(ref_model, other, label, seq):
    sd_ref = ref_model.state_dict()
    sd_oth = other.state_dict()
    assert set(sd_ref) == set(sd_oth), (label, set(sd_ref) ^ set(sd_oth))
    for k in sd_ref:
        assert torch.equal(sd_ref[k].float(), sd_oth[k].float()), (label, k)
    a = full_forward(ref_model, seq)
    other.set_attn_implementation("eager")
    other.set_experts_implementation("eager")
    b = other(input_ids=seq[None], use_cache=False).logits[0].float()
    d = float((a - b).abs().max())
    assert d <= 1e-5, (label, d)
    return d


@torch.no_grad()
def verify_flat(fdir, model, cfg, seq):
    checks = {}
    re_model, info = Qwen3_5MoeForCausalLM.from_pretrained(fdir, dtype=torch.float32,
                                                           output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    checks["reload_CausalLM_max_abs_logit_diff"] = compare_models(model, re_model.eval(), "flat", seq)
    # independent check of the per-expert split (gate rows first)
    sd = load_file(os.path.join(fdir, "model.safetensors"))
    I = cfg.moe_intermediate_size
    for li, layer in enumerate(model.model.layers):
        gu, dn = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
        for e in range(cfg.num_experts):
            p = f"model.layers.{li}.mlp.experts.{e}."
            assert torch.equal(sd[p + "gate_proj.weight"], gu[e, :I])
            assert torch.equal(sd[p + "up_proj.weight"], gu[e, I:])
            assert torch.equal(sd[p + "down_proj.weight"], dn[e])
    checks["per_expert_split_matches_fused"] = True
    return checks


@torch.no_grad()
def verify_official(fdir, model, cfg, seq):
    checks = {}
    # (1) manual mapping of the files back to CausalLM names
    idx = json.load(open(os.path.join(fdir, "model.safetensors.index.json")))
    loaded = {}
    total = 0
    for fname in sorted(set(idx["weight_map"].values())):
        with safe_open(os.path.join(fdir, fname), "pt") as f:
            for k in f.keys():
                assert idx["weight_map"][k] == fname
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
                loaded[k] = t
    assert set(loaded) == set(idx["weight_map"]) and total == idx["metadata"]["total_size"]
    sd_ref = model.state_dict()
    for k, v in sd_ref.items():
        ok = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        assert torch.equal(loaded[ok].float(), v), k
    checks["manual_name_mapping_exact"] = True

    # (2) transformers CausalLM on a text-only copy (prefix rule model.language_model. -> model.)
    conf = json.load(open(os.path.join(fdir, "config.json")))
    with tempfile.TemporaryDirectory() as td:
        tc = dict(conf["text_config"])
        tc["architectures"] = ["Qwen3_5MoeForCausalLM"]
        json.dump(tc, open(os.path.join(td, "config.json"), "w"), indent=2)
        for fname in set(idx["weight_map"].values()) | {"model.safetensors.index.json"}:
            shutil.copy(os.path.join(fdir, fname), td)
        m2, info = Qwen3_5MoeForCausalLM.from_pretrained(td, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        checks["reload_CausalLM_textonly_unexpected_keys_reported"] = sorted(info["unexpected_keys"])[:5]
        checks["reload_CausalLM_textonly_max_abs_logit_diff"] = compare_models(model, m2.eval(), "official/causal", seq)

    # (3) the full wrapper class straight from the fixture directory
    m3, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(fdir, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    m3.eval()
    m3.set_attn_implementation("eager")
    m3.set_experts_implementation("eager")
    lm_sd = {k: v for k, v in m3.state_dict().items() if not k.startswith("model.visual.")}
    for k, v in sd_ref.items():
        ok = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        assert torch.equal(lm_sd[ok].float(), v), k
    a = full_forward(model, seq)
    b = m3(input_ids=seq[None], use_cache=False).logits[0].float()
    d = float((a - b).abs().max())
    assert d <= 1e-5, d
    checks["reload_ConditionalGeneration_max_abs_logit_diff"] = d
    return checks


@torch.no_grad()
def verify_official_fp8(fdir, model, cfg, seq):
    checks = {}
    # (1) the files, dequantised by the format's definition, are exactly the reference model
    idx = json.load(open(os.path.join(fdir, "model.safetensors.index.json")))
    loaded = {}
    for fname in sorted(set(idx["weight_map"].values())):
        with safe_open(os.path.join(fdir, fname), "pt") as f:
            for k in f.keys():
                loaded[k] = f.get_tensor(k)
    E, I = cfg.num_experts, cfg.moe_intermediate_size

    def deq(k):
        t = loaded[k]
        if t.dtype == torch.float8_e4m3fn:
            return fp8_dequantize(t, loaded[k[: -len(".weight")] + ".weight_scale_inv"])
        assert k[: -len(".weight")] + ".weight_scale_inv" not in loaded, k
        return t.float()

    n_fp8 = 0
    for k, v in model.state_dict().items():
        ok = official_name(k)
        if ok.endswith("mlp.experts.gate_up_proj") or ok.endswith("mlp.experts.down_proj"):
            base = ok.rsplit(".", 1)[0]
            for e in range(E):
                if ok.endswith("gate_up_proj"):
                    for part, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
                        name = f"{base}.{e}.{part}.weight"
                        assert loaded[name].dtype == torch.float8_e4m3fn, name
                        assert torch.equal(deq(name), v[e, rows]), name
                        n_fp8 += 1
                else:
                    name = f"{base}.{e}.down_proj.weight"
                    assert loaded[name].dtype == torch.float8_e4m3fn, name
                    assert torch.equal(deq(name), v[e]), name
                    n_fp8 += 1
            continue
        if FP8_LINEAR_RE.search(k):
            assert loaded[ok].dtype == torch.float8_e4m3fn, ok
            n_fp8 += 1
        else:
            assert loaded[ok].dtype in (torch.bfloat16, torch.float32), ok
        assert torch.equal(deq(ok), v), ok
    checks["files_dequantise_to_the_reference_model_exactly"] = True
    checks["fp8_matrices_checked"] = n_fp8

    # (2) transformers' own FP8 loader. Without a GPU its quantizer switches to
    # `dequantize=True` (Fp8Dequantize folds each weight_scale_inv into its weight, before the
    # per-expert tensors are fused); on a GPU it would keep FP8Linear/FP8Experts and run the
    # Triton/DeepGEMM W8A8 kernels, which this CPU script cannot.
    assert not torch.cuda.is_available(), "run on CPU: the GPU path is a separate check"
    m3, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(fdir, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # transformers drops the quantizer and quantization_config once it has dequantised; what
    # shows the FP8 path ran is that the loaded weights equal q * weight_scale_inv exactly
    # (checked below), which a plain cast of the e4m3 bytes would not give.
    fp8_modules = sorted({type(m).__name__ for m in m3.modules() if "FP8" in type(m).__name__})
    checks["hf_loader"] = {
        "path": ("Qwen3_5MoeForConditionalGeneration.from_pretrained on this directory: "
                 "FineGrainedFP8HfQuantizer, no GPU -> dequantize=True (Fp8Dequantize per weight, "
                 "then the per-expert tensors fused)"),
        "fp8_module_classes_after_load": fp8_modules,
    }
    assert not fp8_modules, fp8_modules
    m3.eval()
    m3.set_attn_implementation("eager")
    m3.set_experts_implementation("eager")
    lm_sd = {k: v for k, v in m3.state_dict().items() if not k.startswith("model.visual.")}
    for k, v in model.state_dict().items():
        assert torch.equal(lm_sd[official_name(k)].float(), v), k
    checks["hf_fp8_loader_dequantize_state_dict_exact"] = True
    a = full_forward(model, seq)
    b = m3(input_ids=seq[None], use_cache=False).logits[0].float()
    d = float((a - b).abs().max())
    assert d <= 1e-5, d
    checks["hf_fp8_loader_dequantize_max_abs_logit_diff"] = d
    return checks


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def config_summary(cfg):
    keys = ["vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "rms_norm_eps", "rope_parameters", "tie_word_embeddings"]
    d = {k: getattr(cfg, k) for k in keys}
    d["rotary_dim"] = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    return json.loads(json.dumps(d))


def make_fixture(name, fx, out_root, base_seed, fixture_index, max_attempts):
    print(f"== {name}", flush=True)
    cfg = make_text_config(fx)
    fdir = os.path.join(out_root, name)
    res = None
    for attempt in range(max_attempts):
        seed = base_seed + 1000 * fixture_index + attempt
        ok, res = try_seed(name, fx, cfg, seed)
        if ok:
            break
    else:
        raise SystemExit(f"{name}: no seed in {max_attempts} attempts met the margin/routing criteria")
    model = res["model"]
    assert res["min_margin_all"] >= MIN_GREEDY_MARGIN
    assert res["router_gap"] >= MIN_ROUTER_GAP

    # self-check: one uncached forward over prompt + decode ids reproduces the cached logits
    seq = torch.cat([res["prompt_ids"], res["decode_ids"]])
    tap = RouterTap(model, cfg.num_experts_per_tok)
    full = full_forward(model, seq)
    tap.close()
    # ... with the same expert choices at every token and layer
    for li in range(cfg.num_hidden_layers):
        cached = torch.cat([idx for l, _, idx in res["tap_records"] if l == li])
        uncached = [idx for l, _, idx in tap.records if l == li][0]
        assert torch.equal(cached.sort(-1).values, uncached.sort(-1).values), f"routing differs, layer {li}"
    T = res["prompt_ids"].numel()
    d_prompt = float((full[:T] - res["prompt_logits"]).abs().max())
    d_decode = float((full[T:] - res["decode_logits"]).abs().max())
    assert d_prompt <= SELFCHECK_TOL and d_decode <= SELFCHECK_TOL, (d_prompt, d_decode)
    # and the recomputation's own greedy choices agree
    assert torch.equal(full[T - 1:-1].argmax(-1), res["decode_ids"])
    print(f"  self-check: uncached vs prefill {d_prompt:.2e}, vs cached decode {d_decode:.2e}", flush=True)
    diag64 = f64_diagnostic(model, res)
    assert diag64["f64_greedy_ids_agree"], diag64
    print(f"  f64 diagnostic: {diag64}", flush=True)

    if os.path.isdir(fdir):
        shutil.rmtree(fdir)
    os.makedirs(fdir)
    if fx["layout"] == "flat":
        write_info = write_flat(model, cfg, fdir)
        verify = verify_flat(fdir, model, cfg, seq)
    elif fx["layout"] == "official-fp8":
        write_info = write_official_fp8(model, cfg, fx, fdir, seed, res["fp8_stored"])
        verify = verify_official_fp8(fdir, model, cfg, seq)
    else:
        write_info = write_official(model, cfg, fx, fdir, seed)
        verify = verify_official(fdir, model, cfg, seq)
    write_reference(fdir, res)
    if fx["layout"] in ("official", "official-fp8"):
        # A complete MTP head (after the reference: transformers ignores mtp.*) and its
        # independent reference, as `--mtp-only` adds them to an existing fixture.
        write_info["mtp"] = add_mtp_layer(fdir, cfg, seed, fp8=fx["layout"] == "official-fp8")
        write_info["mtp"]["reference"] = write_mtp_reference(fdir)
    print(f"  reload checks: {verify}", flush=True)

    counts = res["counts"]
    all_logits = torch.cat([res["prompt_logits"], res["decode_logits"]])
    margins = res["margins"]
    step_of_min = int(margins[:-1].argmin())
    info = {
        "fixture": name,
        "layout": fx["layout"],
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "safetensors": safetensors.__version__, "python": sys.version.split()[0]},
        "seed": {"base_seed": base_seed, "used_seed": seed, "attempts": attempt + 1,
                 "rule": "used_seed = base_seed + 1000*fixture_index + attempt; first seed meeting the criteria"},
        "dtype_notes": (
            "Weights stored f32; reference computed in float32 on CPU."
            if fx["storage"] == "f32" else
            "FP8 release format. The model was built in f32 and every parameter rounded to bf16; "
            "the FP8-format projections (attention q/k/v/o, GDN in_proj_qkv/in_proj_z/out_proj, "
            "shared expert, routed experts per expert) were then quantised by transformers' "
            "Fp8Quantize (per 128x128 block: scale = 448/amax, q = e4m3(clamp(w*scale)), stored "
            "weight_scale_inv = 1/scale, F32) and replaced by their dequantisation q*scale_inv "
            "(f32). The reference is transformers in float32 on those dequantised weights; "
            "transformers' FP8 loader on CPU (dequantize=True) reproduces it exactly. The W8A8 "
            "Triton path (dynamic per-128 activation quantisation) needs a GPU and is not in "
            "this reference."
            if fx["storage"] == "fp8" else
            "Weights stored bf16 except linear_attn.A_log (f32, holding bf16-representable values). "
            "The reference model was built in f32, every parameter rounded to bf16 and back, and run "
            "in float32 on CPU, so f32 math on the upcast bf16 weights should match tightly."),
        "reference_path": {"attn_implementation": "eager", "experts_implementation": "eager",
                           "gdn_prefill": "torch_chunk_gated_delta_rule (torch fallback, chunk 64)",
                           "gdn_decode": "torch_recurrent_gated_delta_rule (torch fallback)",
                           "conv": "causal_conv1d_fn / causal_conv1d_update torch fallbacks",
                           "fla_or_causal_conv1d_installed": gdn_backend_info()},
        "T": T,
        "N": N_DECODE,
        "step_convention": (
            "prompt_logits[t] = logits after prompt_ids[0..t] (one-shot prefill, positions 0..T-1). "
            "decode_ids[0] = argmax(prompt_logits[T-1]). Step i (0..N-1) feeds decode_ids[i] at "
            "position T+i with the cache, giving decode_logits[i]; decode_ids[i+1] = "
            "argmax(decode_logits[i]). The argmax of decode_logits[N-1] is not stored. EOS is ignored."),
        "config_summary": config_summary(cfg),
        "init_rules": res["rules"],
        "min_greedy_margin": res["min_margin_used"],
        "min_greedy_margin_including_last_row": res["min_margin_all"],
        "min_greedy_margin_step": ("prompt_logits[T-1]" if step_of_min == 0 else f"decode_logits[{step_of_min - 1}]"),
        "max_abs_logit": float(all_logits.abs().max()),
        "logit_std": float(all_logits.std()),
        "prompt_logit_std": float(res["prompt_logits"].std()),
        "hidden_rms": hidden_stats(model, seq),
        "min_router_topk_gap": res["router_gap"],
        "experts_used_per_layer": (counts > 0).sum(dim=1).tolist(),
        "expert_token_counts_per_layer": counts.tolist(),
        "selfcheck_uncached_vs_prefill_max_abs": d_prompt,
        "selfcheck_uncached_vs_cached_decode_max_abs": d_decode,
        "f64_diagnostic": dict(diag64, note=(
            "HF float32 logits vs the same model run in float64 with the GDN core replaced by a "
            "float64 token-by-token recurrence (HF still computes RMSNorm statistics and RoPE "
            "cos/sin in float32 there). Indicates the float32 noise floor of the reference.")),
        "reload_checks": verify,
        "write_info": write_info,
        "distinct_decode_ids": int(torch.unique(res["decode_ids"]).numel()),
    }
    if fx["layout"] in ("official", "official-fp8"):
        info["eos_note"] = ("generation_config eos_token_id [1, 2] stands in for the real "
                            "[248046, 248044], which do not fit the tiny vocab; the seed "
                            "search rejects seeds whose greedy decode emits an eos id, so a "
                            "stop-at-eos loop runs all 64 steps.")
    with open(os.path.join(fdir, "reference.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(f"  wrote {fdir}: margin {res['min_margin_used']:.4f}, max|logit| {info['max_abs_logit']:.3f}, "
          f"logit std {info['logit_std']:.3f}, experts used {info['experts_used_per_layer']}", flush=True)
    return info


def gdn_backend_info():
    import importlib.util
    return {p: importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d", "kernels")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", choices=sorted(FIXTURES), action="append",
                    help="write only these fixtures (repeatable)")
    ap.add_argument("--max-attempts", type=int, default=2000)
    ap.add_argument("--mtp-only", action="store_true",
                    help="only complete the MTP head of the existing official bf16 fixture under "
                         "--out and write its mtp_reference.safetensors (everything else untouched)")
    args = ap.parse_args()
    if args.mtp_only:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        for name in args.only or ["tiny-official-bf16", "tiny-official-fp8"]:
            fx = FIXTURES[name]
            assert fx["layout"] in ("official", "official-fp8"), name
            fdir = os.path.join(args.out, name)
            info = json.load(open(os.path.join(fdir, "reference.json")))
            cfg = make_text_config(fx)
            seed = info["seed"]["used_seed"]
            mtp = add_mtp_layer(fdir, cfg, seed, fp8=fx["layout"] == "official-fp8")
            mtp["reference"] = write_mtp_reference(fdir)
            info["write_info"]["mtp"] = mtp
            with open(os.path.join(fdir, "reference.json"), "w") as f:
                json.dump(info, f, indent=2)
                f.write("\n")
            print(name, json.dumps(mtp, indent=2))
        return

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    be = gdn_backend_info()
    if be["fla"] or be["causal_conv1d"]:
        raise SystemExit(f"fla / causal_conv1d are installed ({be}); the fixtures must use the torch "
                         "fallback path; use a clean venv (scripts/requirements-fixtures.txt)")
    os.makedirs(args.out, exist_ok=True)
    for i, (name, fx) in enumerate(FIXTURES.items()):
        if args.only and name not in args.only:
            continue
        make_fixture(name, fx, args.out, args.seed, i, args.max_attempts)


if __name__ == "__main__":
    main()
