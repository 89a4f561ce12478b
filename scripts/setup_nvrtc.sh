#!/usr/bin/env bash
# Fetches NVRTC and the CUDA headers from PyPI (no GPU, no CUDA install needed) so that the
# kernel-compilation test runs on CPU-only machines such as CI. Prints the two exports to
# eval; prints nothing (and exits 0) when the wheels cannot be had.
set -u
dir=${KESTREL_NVRTC_DIR:-${HOME:-/tmp}/.cache/kestrel/nvrtc-13.0}
if [ ! -f "$dir/nvidia/cu13/include/crt/mma.h" ] || [ ! -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  tmp=$(mktemp -d)
  if ! timeout 300 python3 -m pip download -q --no-deps -d "$tmp" \
      "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" >&2; then
    echo "setup_nvrtc: could not download the NVRTC wheels; the kernel compile test will skip" >&2
    rm -rf "$tmp"
    exit 0
  fi
  mkdir -p "$dir"
  for w in "$tmp"/*.whl; do python3 -m zipfile -e "$w" "$dir" >&2; done
  rm -rf "$tmp"
fi
echo "export CUDA_HOME=$dir/nvidia/cu13"
echo "export LD_LIBRARY_PATH=$dir/nvidia/cu13/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
