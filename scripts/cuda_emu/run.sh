#!/usr/bin/env bash
# Runs the GDN kernels of src/cuda/kernels/gdn.cu on the CPU (no GPU needed) through a small
# CUDA emulator and checks them against a double-precision delta rule and the sequential
# conv kernels. `run.sh full` adds the full model's head dims (hk 16, hv 32, dk = dv = 128,
# 300 tokens; about a minute). Needs g++ with C++20.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$here/build.py" "$tmp/kernels_emu.inc"
cp "$here/cuda_emu.h" "$tmp/"
g++ -std=c++20 -O2 -Wno-unknown-pragmas -pthread -I"$tmp" "$here/gdn_check.cpp" -o "$tmp/gdn_check"
"$tmp/gdn_check" "$@"
