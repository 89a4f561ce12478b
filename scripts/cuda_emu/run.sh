#!/usr/bin/env bash
# Runs Kestrel's kernels on the CPU (no GPU needed) through the small CUDA emulator in
# cuda_emu.h and checks them against double-precision references:
#   mma  ldmatrix/mma.sync emulation against plain matrix products (the PTX fragment layouts)
#   gdn  gdn_decode.cu, gdn_chunk.cu, gdn_state.cu: the decode step (alone and fused with the
#        conv, with clusters of two), the recurrent and the chunked delta rule (gdn_chunk_prep
#        through a double-precision state pass and through gdn_chunk_state_t64 on emulated
#        wgmma), prefill conv, gated norm; at the model's dk 128 and, through the kernels'
#        templates, smaller ones (`gdn full`: also the full model's head counts over 300
#        tokens, and 4,096 tokens of 4 heads; about a minute more)
#   attn attn_prefill.cu, attn_decode.cu: attn_prep_rows against attn_prep; the prefill flash
#        kernel attn_flash4 (on emulated wgmma, mbarriers and a producer warpgroup; its fused
#        query prep bitwise the separate prep); the tensor-core decode attention and its
#        combine (head dim 256; up to the step's 64 and 256 splits at 4,096-32,805 positions)
#   gemv gemv.cu: the decode GEMVs (gemv_dec, gemv_dec_w, gemv_dec_stream, gemv_fp8, gemv_q4 on
#        emulated mma.sync) and misc.cu's dequant_q4_bf16
#   moe  moe_route.cu, moe_gemm.cu, moe_decode.cu: the routing top-k (ties included), the few-row
#        path's one-launch routing (moe_route_small); the decode
#        MoE block (router, gate/up, down) at small and reduced real shapes; moe_combine (and its
#        fused RMSNorm against norm.cu's rmsnorm_zc_bf16, bitwise); moe_plan + moe_scatter +
#        moe_gemv_sorted (the few-row path) +
#        moe_grouped(_swiglu)_q4 (4-bit experts over a plan of tiles) +
#        moe_grouped(_swiglu)_fp8 (FP8 experts over such a plan, e4m3 to bf16 in registers) +
#        moe_gemm6 (wgmma, emulated through its descriptors; SwiGLU-fused and plain, and the bf16
#        y bitwise its f32 y rounded) against double references at the tiny fixtures' dims, a
#        deep-K shape and a reduced real shape; moe_plan over several warps of experts
#   sample sample.cu: the draw on the device (penalties, chunk statistics and candidates, the
#        pick) against a transcription of the CPU sampler: same ids from the same uniforms for
#        every filter, ties and NaN, rows past the candidates flagged, log-probabilities
# Usage: run.sh [mma|gdn|attn|gemv|moe|sample|all] [full]   (default all). Needs g++ with C++20.
# EMU_DEFINES="A B=1": preprocessor defines for the kernels (as KESTREL_KERNEL_DEFINES on the GPU).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
what=${1:-all}
shift || true
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$here/cuda_emu.h" "$tmp/"
# -fno-strict-aliasing: the kernels type-pun (bf16 arrays read as uint4, floats as float4), which
# CUDA allows; without it g++ -O2 may drop such accesses (gemv.cu's checks failed that way).
build() {  # build NAME KERNEL_FILES...
  local n=$1
  shift
  python3 "$here/build.py" "$tmp/kernels_emu.inc" "$@"
  local defs=()
  for d in ${EMU_DEFINES:-}; do defs+=("-D$d"); done
  g++ -std=c++20 -O2 "${defs[@]}" -fno-strict-aliasing -Wno-unknown-pragmas -Wno-psabi -pthread -I"$tmp" "$here/${n}_check.cpp" -o "$tmp/${n}_check"
}
for n in mma gdn attn gemv moe sample; do
  [ "$what" = all ] || [ "$what" = "$n" ] || continue
  case $n in
    mma) build mma ;;
    gdn) build gdn gdn_decode.cu gdn_chunk.cu gdn_state.cu ;;
    attn) build attn attn_prefill.cu attn_decode.cu ;;
    gemv) build gemv misc.cu gemv.cu ;;
    moe) build moe norm.cu moe_route.cu moe_gemm.cu moe_decode.cu ;;
    sample) build sample sample.cu ;;
  esac
  echo "== $n"
  "$tmp/${n}_check" "$@"
done
