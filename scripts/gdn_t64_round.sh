#!/usr/bin/env bash
# One device round for gdn_chunk_state_t64 (Sᵀ in registers, the default): the phase clocks at
# 2,048 tokens (also under each kernel define set in DEFINES, ';'-separated), the delta-rule
# tests (every state pass against the recurrent kernel), the kernels' timing at 4,096 tokens,
# then the bench (scripts/gpu_check.sh variants) at CONTEXTS (default 2048,8192) over VARIANTS
# (default 'KESTREL_GDN_STATE=wg;-'; "bin:PATH" entries are other builds' binaries).
# Usage: gdn_t64_round.sh [CONTEXTS] [VARIANTS] [DEFINES]. Logs under $OUT.
set -uo pipefail
T=.device/bin/test-cuda
run() { echo "=== $*"; env "$@" 2>&1 | grep -v "^running\|^$\|test result\|filtered"; }
{
  run KESTREL_KERNEL_DEFINES=KESTREL_GDN_TRACE $T gdn_chunk_state_phases --nocapture
  IFS=';' read -ra defs <<< "${3:-}"
  for d in "${defs[@]}"; do
    run KESTREL_KERNEL_DEFINES="KESTREL_GDN_TRACE $d" $T gdn_chunk_state_phases --nocapture | grep -A12 t64
    run KESTREL_KERNEL_DEFINES="$d" $T gdn_prefill_kernel_timing_full_shape --nocapture
  done
  run $T gdn_chunked --nocapture --test-threads=1
  run $T gdn_prefill_kernel_timing_full_shape --nocapture
} 2>&1 | tee "$OUT/gdn-round.log"
scripts/gpu_check.sh variants "${1:-2048,8192}" "${2:-KESTREL_GDN_STATE=wg;-}"
