#!/usr/bin/env bash
# One device round for gdn_chunk_state_wg (the wgmma state pass) against gdn_chunk_state
# (mma.sync, KESTREL_GDN_STATE=mma): phase clocks of both at 2,048 tokens, the delta-rule
# tests, the kernels' timing at 4,096, then the bench A/B (scripts/gpu_check.sh variants) at
# CONTEXTS (default 2048,8192). Logs under $OUT.
set -uo pipefail
T=.device/bin/test-cuda
run() { echo "=== $*"; env "$@" 2>&1 | grep -v "^running\|^$\|test result\|filtered"; }
{
  run KESTREL_GDN_STATE=wg KESTREL_KERNEL_DEFINES=KESTREL_GDN_TRACE $T gdn_chunk_state_phases --nocapture
  run KESTREL_GDN_STATE=mma KESTREL_KERNEL_DEFINES=KESTREL_GDN_TRACE $T gdn_chunk_state_phases --nocapture
  run KESTREL_GDN_STATE=wg $T gdn_chunked --nocapture
  run KESTREL_GDN_STATE=wg $T gdn_prefill_kernel_timing_full_shape --nocapture
} 2>&1 | tee "$OUT/gdn-round.log"
scripts/gpu_check.sh variants "${1:-2048,8192}" 'KESTREL_GDN_STATE=wg;KESTREL_GDN_STATE=mma'
