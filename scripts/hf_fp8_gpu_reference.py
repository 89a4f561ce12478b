#!/usr/bin/env python3
"""Issue 38: transformers' own FP8 *compute* path on the GPU, on tests/fixtures/tiny-official-fp8.

make_fixtures.py's reference for that fixture is transformers in float32 on the dequantised
weights (its FP8 loader on a CPU dequantises). On a GPU the same loader keeps FP8Linear /
FP8Experts and runs its W8A8 kernels: every activation quantised to e4m3 per 128-column group
at run time, the products on FP8 operands. This script runs that path on the fixture's prompt
(one-shot prefill) and its 64 decode ids (teacher-forced, with the cache), in bf16 activations
as users run it, and writes the logits and their distance from the committed f32 reference:

    python3 scripts/hf_fp8_gpu_reference.py --out DIR
      DIR/hf_w8a8_reference.safetensors  prompt_logits [70, 256], decode_logits [64, 256] (f32)
      DIR/hf_w8a8_reference.json         versions, module classes, distances, greedy agreement

Run on the GPU machine (scripts/gpu_check.sh hf-fp8); needs torch with CUDA (and Triton) and
transformers. transformers (5.x) runs FP8Linear / FP8Experts through the Triton kernel
`kernels-community/finegrained-fp8`, which its `kernels` package downloads from the Hugging Face
Hub at first use; the GPU machine has no network, so `--kernel DIR` imports a local copy of that
kernel's Python package instead (DIR/finegrained_fp8: the `finegrained-fp8/torch-ext/
finegrained_fp8` folder of github.com/huggingface/kernels-community, plus the `_ops.py` the
kernel builder would generate: `ops = torch.ops.<namespace>` and `add_op_namespace_prefix`;
scripts/stage_hf_fp8_kernel.sh REPO writes both into .device/hfk) and hands its matmul_2d /
matmul_batched / matmul_grouped to transformers as the loaded kernel.
"""

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen3_5MoeForConditionalGeneration  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tiny-official-fp8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixture", default=FIXTURE)
    ap.add_argument("--kernel", help="folder holding a local finegrained_fp8 package (see above)")
    args = ap.parse_args()
    kernel_source = "the Hugging Face Hub (kernels package)"
    if args.kernel:
        import importlib
        import types

        from transformers.integrations import finegrained_fp8 as tf_fp8  # noqa: E402

        # the package without its __init__ (which also imports the fused MoE kernels, whose
        # Triton tensor descriptors an older Triton lacks): only the three matmuls' modules
        pkg = types.ModuleType("finegrained_fp8")
        pkg.__path__ = [os.path.join(args.kernel, "finegrained_fp8")]
        sys.modules["finegrained_fp8"] = pkg
        mod = {n: importlib.import_module(f"finegrained_fp8.{n}") for n in ("matmul", "batched", "grouped")}
        tf_fp8._FINEGRAINED_FP8 = tf_fp8.FineGrainedFP8(
            matmul=mod["matmul"].matmul_2d,
            batched_matmul=mod["batched"].matmul_batched,
            grouped_matmul=mod["grouped"].matmul_grouped,
        )
        src = os.path.join(args.kernel, "SOURCE")
        kernel_source = "local copy " + (open(src).read().strip() if os.path.exists(src) else args.kernel)
        print("finegrained-fp8 kernel:", kernel_source, flush=True)
    os.makedirs(args.out, exist_ok=True)
    assert torch.cuda.is_available(), "needs a GPU: the W8A8 path is what this script measures"
    ref = load_file(os.path.join(args.fixture, "reference.safetensors"))
    prompt, dec = ref["prompt_ids"].cuda(), ref["decode_ids"].cuda()
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        args.fixture, dtype=torch.bfloat16, device_map="cuda").eval()
    classes = sorted({type(m).__name__ for m in model.modules() if "FP8" in type(m).__name__.upper()})
    print("FP8 module classes after load:", classes, flush=True)
    if not classes:
        sys.exit("transformers dequantised the checkpoint instead of keeping its FP8 modules")
    with torch.no_grad():
        out = model(input_ids=prompt[None], use_cache=True)
        prompt_logits = out.logits[0].float()
        cache = out.past_key_values
        rows = []
        for i in range(dec.numel()):
            o = model(input_ids=dec[i].view(1, 1), past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            rows.append(o.logits[0, -1].float())
        decode_logits = torch.stack(rows)
    save_file({"prompt_logits": prompt_logits.cpu().contiguous(),
               "decode_logits": decode_logits.cpu().contiguous()},
              os.path.join(args.out, "hf_w8a8_reference.safetensors"))

    def compare(mine, theirs):
        theirs = theirs.cuda()
        top2 = theirs.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        agree = mine.argmax(-1) == theirs.argmax(-1)
        return {
            "max_abs_diff": float((mine - theirs).abs().max()),
            "rel_to_max_abs_logit": float((mine - theirs).abs().max() / theirs.abs().max()),
            "greedy_agree": int(agree.sum()),
            "rows": int(agree.numel()),
            "disagreeing_rows_f32_margin": [float(m) for m in margin[~agree]],
        }

    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "path": "Qwen3_5MoeForConditionalGeneration.from_pretrained(fixture, dtype=bfloat16, "
                "device_map=cuda): FineGrainedFP8HfQuantizer keeps its FP8 modules (W8A8, dynamic "
                "per-128 activation quantisation); prompt one-shot, decode teacher-forced on the "
                "fixture's decode_ids with the cache",
        "fp8_module_classes": classes,
        "finegrained_fp8_kernel": kernel_source,
        "vs_f32_dequantised_reference": {
            "prompt": compare(prompt_logits, ref["prompt_logits"]),
            "decode": compare(decode_logits, ref["decode_logits"]),
        },
    }
    with open(os.path.join(args.out, "hf_w8a8_reference.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
