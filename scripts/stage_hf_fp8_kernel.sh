#!/usr/bin/env bash
# Copies transformers' FP8 Triton kernel (kernels-community/finegrained-fp8, which the `kernels`
# package would download from the Hugging Face Hub at first use) into .device/hfk, which
# `scripts/gpu_check.sh hf-fp8` passes to scripts/hf_fp8_gpu_reference.py as --kernel (the GPU
# machine has no network). Carry .device to the device with the rest of the staged files.
#   scripts/stage_hf_fp8_kernel.sh REPO   (a git clone or mirror of
#                                          github.com/huggingface/kernels-community)
# Only the kernel's Python package is copied, at the pinned commit below (the one run against
# transformers 5.25), plus the small `_ops.py` the kernel builder would generate: the torch op
# namespace its Triton ops register under. Nothing of it enters this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=${1:?usage: scripts/stage_hf_fp8_kernel.sh PATH-TO-kernels-community-git}
rev=${KERNEL_REV:-40d4194f}
src=finegrained-fp8/torch-ext/finegrained_fp8
dst=.device/hfk/finegrained_fp8
rm -rf .device/hfk && mkdir -p "$dst"
for f in $(git -C "$repo" ls-tree --name-only "$rev" "$src/"); do
  git -C "$repo" show "$rev:$f" > "$dst/$(basename "$f")"
done
cat > "$dst/_ops.py" << 'EOF'
# Written by scripts/stage_hf_fp8_kernel.sh (the kernel builder generates this module): the
# namespace the Triton ops register under.
import torch

ops = torch.ops._finegrained_fp8_local


def add_op_namespace_prefix(op_name: str) -> str:
    return f"_finegrained_fp8_local::{op_name}"
EOF
echo "$(git -C "$repo" rev-parse "$rev") github.com/huggingface/kernels-community $src" > .device/hfk/SOURCE
ls "$dst"
