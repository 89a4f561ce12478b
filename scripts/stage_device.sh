#!/usr/bin/env bash
# Builds the release binary and test executables here (no GPU needed) and copies them into
# .device/ (git-ignored), which the device tool carries to the GPU machine. Honours
# CARGO_TARGET_DIR (e.g. staging a clean worktree of one commit with the main target dir).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
cargo test --release --no-run >/dev/null 2>&1 || {
  echo "stage_device.sh: the tests do not build (cargo test --release --no-run shows why); .device left as it was" >&2
  exit 1
}
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["target"]["name"], m["executable"])' > /tmp/kestrel-test-exes
rm -rf .device && mkdir -p .device/bin
cp "${CARGO_TARGET_DIR:-target}/release/kestrel" .device/bin/
while read -r name exe; do
  case "$name" in cuda | cuda_kernels) cp "$exe" ".device/bin/test-$name" ;; esac
done < /tmp/kestrel-test-exes
# Stripped: the device tool carries at most 64 MiB with the tree (the fixtures are ~30 MiB).
strip .device/bin/*
git rev-parse --short HEAD > .device/COMMIT
du -sh .device
