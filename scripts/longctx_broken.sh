#!/usr/bin/env bash
# Issue 43: shows once that the long-context check fails when a kernel is wrong. Builds, here
# (no GPU needed), scratch copies of tests/cuda.rs's executable from the committed HEAD, each
# with one deliberate bug, into .device/bin/test-cuda-broken-NAME; `scripts/gpu_check.sh
# longctx` runs each after the real check and requires longctx_checkpoint_matches_hf to FAIL.
# Run after scripts/stage_device.sh (which clears .device), under the cargo lock:
#   flock /tmp/kestrel-cargo.lock scripts/longctx_broken.sh
# The bug (nothing of it reaches the product: a detached scratch worktree, its own target dir,
# BROKEN_TARGET_DIR, default /tmp/kestrel-broken-target; seed it with a copy of a target dir to
# skip the dependencies' build):
#   offset  every prefill call's flash attention is given past = 0: a call after the first
#           attends to the first call's keys with its queries rotated as if at position 0, so
#           the chunked prefills move away from the one-call result (1.2e-3 of the rows' norm
#           at 32,768 on the H100, against exactly 0 for the correct build; HF's bf16 bar of
#           ~2.8e-2 alone would not see it: random weights spread attention over every
#           position). One call of the whole prompt is unaffected.
# A broken decode split combine (the last of 256 splits dropped) was tried too and is invisible
# at the model level for the same reason (the newest 128 of 32,768 positions hold ~0.4% of the
# attention mass): test-cuda_kernels' attn_decode_splits_match_reference_long_kv, with planted
# boundary keys, is the check for the split paths.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .device/bin ] || { echo "longctx_broken.sh: no .device/bin: run scripts/stage_device.sh first" >&2; exit 1; }
export CARGO_TARGET_DIR=${BROKEN_TARGET_DIR:-/tmp/kestrel-broken-target}
wt=$(mktemp -d /tmp/kestrel-broken.XXXXXX)
git worktree add --detach "$wt" HEAD > /dev/null
trap 'git worktree remove --force "$wt"' EXIT
# break FILE FROM TO: FROM must occur exactly once in FILE
break_it() {
  python3 - "$wt/$1" "$2" "$3" << 'EOF'
import sys
path, old, new = sys.argv[1:]
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"longctx_broken.sh: {old!r} occurs {s.count(old)} times in {path}, expected once")
open(path, "w").write(s.replace(old, new))
EOF
}
for bug in offset; do
  git -C "$wt" checkout -q -- .
  case $bug in
    offset)
      break_it src/cuda/prefill.rs \
        $'                                t: n,\n                                past,\n' \
        $'                                t: n,\n                                past: 0, // BROKEN (issue 43 demo)\n' ;;
  esac
  exe=$(cd "$wt" && cargo test --release --test cuda --no-run --message-format=json 2> /dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="cuda":
        print(m["executable"])')
  [ -n "$exe" ] || { echo "longctx_broken.sh: the '$bug' build failed (cargo test --release --test cuda --no-run in $wt)" >&2; exit 1; }
  cp "$exe" ".device/bin/test-cuda-broken-$bug"
  strip ".device/bin/test-cuda-broken-$bug"
  echo "built .device/bin/test-cuda-broken-$bug ($(git -C "$wt" diff --stat | tail -1))"
done
