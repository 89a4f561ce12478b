#!/usr/bin/env bash
# The GPU round, run on the H200 through the device tool from the repository root:
#   GPU test executables (built here with `cargo test --release --no-run`, staged by
#   scripts/stage_device.sh into .device/), the HF full-width comparison, the bench and the
#   HF peer; all logs and JSON packed into $OUT/round.tgz (see Results below).
# Usage: scripts/gpu_check.sh [tests] [fullwidth] [cli] [bench CONTEXTS] [profile CONTEXT] [peer]
#          [kernels CONTEXT] [abbin BINARY[,BINARY..] CONTEXTS] [timeline CONTEXTS]
#          [concurrency STREAMS CONTEXTS] [concurrency-sampling STREAMS CONTEXTS] [serveload]
#          [serveload-long] [longctx [LENGTHS]] [formats CONTEXTS] [structmask] [hf-fp8]
#   (KESTREL_BENCH_ARGS adds bench options, e.g. "--max-chunk 8192"; KESTREL_SYNTHETIC=full-fp8
#   runs bench, concurrency, profile, kernels and abbin on the synthetic FP8 weights, =full-int4
#   on the 4-bit ones)
#   formats CONTEXTS: the bench at CONTEXTS on synthetic bf16, FP8 and 4-bit weights in one call.
#   abbin: the bench of other builds of kestrel (comma-separated, e.g. an older commit's,
#   built here and carried under .device/) and of this one, alternating, two rounds each, rows
#   tagged by binary into $OUT/ab.log: how a change is compared with history (there are no
#   run-time switches between kernel variants).
#   timeline: one decode step's per-kernel cost on the critical path from a %globaltimer trace
#   (KESTREL_TRACE=1), and the kernels' phase stamps, tables into $OUT/timeline-CONTEXT.txt.
#   concurrency: the batched decode bench (`kestrel bench --concurrency STREAMS`, e.g. 1,8,32,64
#   at CONTEXTS tokens a stream) into $OUT/concurrency.json / .log (KESTREL_PROFILE=1 there
#   prints the GPU time per op).
#   serveload: `kestrel serve --device cuda --synthetic full` (default --max-running, from
#   memory) driven by scripts/serve_load.py: streaming greedy requests at 1 / 8 / 32 / 64 in
#   flight, sampled ones (the server's defaults) at 8 and 64, open-loop arrivals at 4 and 16 a
#   second; then a --max-seq 32768 server given 256 requests at once (admitted or queued, none
#   failing). $OUT/serveload*.json / .log.
#   structmask: the structured-output mask's cost a token (issue 41, PERFORMANCE.md table 16):
#   `kestrel serve --device cuda --synthetic full --max-seq 4096` at RUST_LOG=kestrel=info,
#   scripts/struct_mask.py's batch-1 streaming requests, plain and json_schema at temperature
#   0 and 1, twice: ITL per kind into $OUT/structmask.log / .json, the server's per-reply mask
#   compute and wait lines after them.
#   hf-fp8: transformers' own FP8 compute path (W8A8) on tests/fixtures/tiny-official-fp8
#   (scripts/hf_fp8_gpu_reference.py): its logits and their distance from the committed f32
#   reference into $OUT/hf-fp8/ (issue 38).
#   kernels: Nsight Compute times every kernel of one fused decode step (clocks left alone)
#   and scripts/kernel_table.py sums them per op into $OUT/decode-kernels.md.
#   longctx [LENGTHS]: issue 43's production-shape long-context check. scripts/longctx_check.py
#   writes a full-width 4-layer checkpoint (GDN x3, gated attention) and transformers' f32
#   references at LENGTHS (default 32768; "32768,131072" adds the long one) to /tmp/longctx,
#   then test-cuda's longctx_checkpoint_matches_hf compares Kestrel's prefill (one call,
#   calls of 16,384 and 8,192, ragged) and 16 decode steps with them. Logs:
#   $OUT/longctx-hf.log, $OUT/longctx.json, $OUT/longctx.log. Then every
#   .device/bin/test-cuda-broken-* (a scratch build with a deliberate bug, made here by
#   scripts/longctx_broken.sh after stage_device.sh) must FAIL the same check: its log in
#   $OUT/longctx-broken-NAME.log, the verdict in longctx.log. Measured on an H100 (2026-12-07):
#   32768 with two broken builds took 199 s (HF's references ~120 s, Kestrel's load 32 s and
#   ~30 s for all ways, each broken build ~30 s). 131072 adds HF's f32 attention at 16x.
#   Results: a call returns at most 8 files, so every log and JSON is written under a work
#   folder and packed after each step into $OUT/round.tgz (a step cut short keeps what the
#   earlier ones packed): `tar xzf .../round.tgz` here.
set -uo pipefail
FINAL=${OUT:-/tmp/kestrel-out}
OUT=/tmp/kestrel-round
rm -rf "$OUT"
mkdir -p "$OUT" "$FINAL"
pack() { tar czf "$FINAL/round.tgz" -C "$OUT" .; }
export KESTREL_CACHE_DIR=/tmp/kestrel-cache RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
export KESTREL_COMMIT=$(cat .device/COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.txt" 2>&1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
status=0
# ab_rounds CONTEXTS BINARY...: the bench by each kestrel binary, alternating, two rounds, rows
# tagged into $OUT/ab.log.
ab_rounds() {
  local contexts=$1 round r
  shift
  for round in 1 2; do
    for r in "$@"; do
      "$r" bench --synthetic ${KESTREL_SYNTHETIC:-full} --contexts "$contexts" ${KESTREL_BENCH_ARGS:-} 2>&1 \
        | grep -E '^ +[0-9]+ ' | sed "s|^|$r round $round |" | tee -a "$OUT/ab.log" || status=1
    done
  done
}
while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      for t in .device/bin/test-*; do
        case $t in *-broken-*) continue ;; esac  # longctx's deliberately broken builds
        echo "== $t"
        # The GPU tests are ignored unless asked for (their harness, tests/common gpu_main,
        # reports them ignored with the reason where no usable GPU exists): include them.
        "$t" --include-ignored --test-threads=1 --nocapture 2>&1 | tee -a "$OUT/tests.log" || status=1
      done ;;
    fullwidth)
      python3 scripts/fullwidth_check.py --out /tmp/fullwidth 2>&1 | tee "$OUT/fullwidth-hf.log" || status=1
      KESTREL_FULLWIDTH_DIR=/tmp/fullwidth .device/bin/test-cuda fullwidth --include-ignored --nocapture 2>&1 | tee "$OUT/fullwidth.log" || status=1 ;;
    cli)
      # generate/chat/serve --device cuda on the checkpoint `fullwidth` wrote, and the
      # not-enough-memory error (needs `fullwidth` earlier in the same call).
      python3 scripts/gpu_cli_check.py --kestrel .device/bin/kestrel --model /tmp/fullwidth/model \
        --out "$OUT/cli" 2>&1 | tee "$OUT/cli.log" || status=1 ;;
    bench)
      shift
      # bench.json / bench.log, or with the contexts in the name when a bench step ran before
      tag=""
      [ -e "$OUT/bench.json" ] && tag="-${1//,/_}"
      .device/bin/kestrel bench --synthetic ${KESTREL_SYNTHETIC:-full} --contexts "$1" ${KESTREL_BENCH_ARGS:-} --json "$OUT/bench$tag.json" 2>&1 \
        | tee "$OUT/bench$tag.log" || status=1 ;;
    formats)
      # the same bench on the three synthetic formats in one call (bf16, FP8, 4-bit), side by
      # side: bench-full.json, bench-full-fp8.json, bench-full-int4.json and their logs
      shift
      for f in full full-fp8 full-int4; do
        .device/bin/kestrel bench --synthetic $f --contexts "$1" ${KESTREL_BENCH_ARGS:-} --json "$OUT/bench-$f.json" 2>&1 \
          | tee "$OUT/bench-$f.log" || status=1
      done ;;
    concurrency|concurrency-sampling)
      # concurrency-sampling: every stream samples, drawn on the device (--sampling)
      tag=${1#concurrency}
      extra=""
      [ -n "$tag" ] && extra="--sampling"
      .device/bin/kestrel bench --synthetic ${KESTREL_SYNTHETIC:-full} --concurrency "$2" --contexts "$3" $extra ${KESTREL_BENCH_ARGS:-} \
        --json "$OUT/concurrency$tag.json" 2>&1 | tee "$OUT/concurrency$tag.log" || status=1
      shift 2 ;;
    serveload)
      # start_server PORT ARGS..: a synthetic full-size server in the background, ready
      start_server() {
        local port=$1
        shift
        .device/bin/kestrel serve --device cuda --synthetic full --bind 127.0.0.1:$port "$@" \
          > "$OUT/serve-$port.log" 2>&1 &
        for _ in $(seq 300); do
          python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
            2> /dev/null && return 0
          sleep 1
        done
        echo "server on $port never ready"; status=1
      }
      start_server 8123 --max-seq 4096
      load="python3 scripts/serve_load.py --url http://127.0.0.1:8123 --max-tokens 128"
      $load --greedy --concurrency 1,8,32,64 --json "$OUT/serveload-greedy.json" 2>&1 | tee "$OUT/serveload.log" || status=1
      $load --concurrency 8,64 --requests 64 --json "$OUT/serveload-sampled.json" 2>&1 | tee -a "$OUT/serveload.log" || status=1
      $load --greedy --rates 4,16 --requests 64 --json "$OUT/serveload-rates.json" 2>&1 | tee -a "$OUT/serveload.log" || status=1
      python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/metrics').read().decode())" | grep -E '^kestrel_(running|waiting|queue|requests|kv_)' >> "$OUT/serveload.log"
      kill %1; wait
      start_server 8124 --max-seq 32768
      python3 scripts/serve_load.py --url http://127.0.0.1:8124 --max-tokens 16 --greedy --concurrency 256 \
        --requests 256 --json "$OUT/serveload-256.json" 2>&1 | tee -a "$OUT/serveload.log" || status=1
      python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8124/metrics').read().decode())" | grep -E '^kestrel_(running|queue|requests|kv_)' >> "$OUT/serveload.log"
      kill %1; wait
      grep -h "sequences at once" "$OUT"/serve-*.log | tee -a "$OUT/serveload.log" ;;
    serveload-long)
      # A 30,000-word prompt admitted while 8 streams decode, at --prefill-per-round 8192
      # (the default) and 2048: the streams' worst inter-token gap and the prompt's TTFT.
      for per in 8192 2048; do
        .device/bin/kestrel serve --device cuda --synthetic full --bind 127.0.0.1:8125 --max-seq 32768 \
          --prefill-per-round $per > "$OUT/serve-long-$per.log" 2>&1 &
        for _ in $(seq 300); do
          python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8125/health', timeout=2)" 2> /dev/null && break
          sleep 1
        done
        echo "--prefill-per-round $per" | tee -a "$OUT/serveload-long.log"
        python3 scripts/serve_load.py --url http://127.0.0.1:8125 --max-tokens 256 --greedy --concurrency 8 \
          --requests 8 --long-prompt-words 30000 --json "$OUT/serveload-long-$per.json" 2>&1 | tee -a "$OUT/serveload-long.log" || status=1
        kill %1; wait
      done ;;
    structmask)
      RUST_LOG=kestrel=info .device/bin/kestrel serve --device cuda --synthetic full --bind 127.0.0.1:8126 \
        --max-seq 4096 > "$OUT/serve-structmask.log" 2>&1 &
      for _ in $(seq 300); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8126/health', timeout=2)" 2> /dev/null && break
        sleep 1
      done
      python3 scripts/struct_mask.py --url http://127.0.0.1:8126 --json "$OUT/structmask.json" 2>&1 \
        | tee "$OUT/structmask.log" || status=1
      kill %1; wait
      grep -h "structured output:" "$OUT/serve-structmask.log" | tee -a "$OUT/structmask.log" ;;
    profile)
      shift
      # CUDA-event time per op and grid (KESTREL_PROFILE=1), prefill and decode of one context.
      KESTREL_PROFILE=1 .device/bin/kestrel bench --synthetic ${KESTREL_SYNTHETIC:-full} --contexts "$1" ${KESTREL_BENCH_ARGS:-} 2>&1 | tee "$OUT/profile-$1.log" || status=1 ;;
    kernels)
      shift
      # One decode step = the launches from one embed_gather to the next; skip the warm-up.
      ncu --clock-control none --csv --metrics gpu__time_duration.sum \
        -k regex:'embed_gather|gemv_|_dec_|_dec$|attn_decode|attn_prep|attn_combine' \
        --launch-skip 3000 --launch-count 600 \
        .device/bin/kestrel bench --synthetic ${KESTREL_SYNTHETIC:-full} --contexts "$1" > "$OUT/ncu.csv" 2> "$OUT/ncu.log" || status=1
      python3 scripts/kernel_table.py "$OUT/ncu.csv" > "$OUT/decode-kernels.md" || status=1
      cat "$OUT/decode-kernels.md" ;;
    timeline)
      # one decode step's timeline per context (every 8th and the last block of each decode
      # kernel, %globaltimer), summarised per kernel by scripts/decode_timeline.py
      KESTREL_TRACE=1 KESTREL_TRACE_OUT="$OUT/timeline" .device/bin/kestrel bench --synthetic full \
        --contexts "$2" ${KESTREL_BENCH_ARGS:-} 2>&1 | tail -3 | tee -a "$OUT/timeline.log" || status=1
      for f in "$OUT"/timeline-*.csv; do
        python3 scripts/decode_timeline.py "$f" --launches > "${f%.csv}.txt" 2>&1 || status=1
        head -24 "${f%.csv}.txt" | tee -a "$OUT/timeline.log"
        sed -n '/after the wait release/,/^$/p' "${f%.csv}.txt" | tee -a "$OUT/timeline.log"  # phases
      done
      shift ;;
    abbin)
      ab_rounds "$3" ${2//,/ } .device/bin/kestrel
      shift 2 ;;
    longctx)
      lengths=32768
      if [[ "${2:-}" =~ ^[0-9,]+$ ]]; then lengths=$2; shift; fi
      rm -rf /tmp/longctx
      python3 scripts/longctx_check.py --out /tmp/longctx --lengths "$lengths" 2>&1 | tee "$OUT/longctx-hf.log" || status=1
      cp /tmp/longctx/longctx.json "$OUT/" 2> /dev/null
      KESTREL_LONGCTX_DIR=/tmp/longctx .device/bin/test-cuda longctx --include-ignored --nocapture 2>&1 \
        | tee "$OUT/longctx.log" || status=1
      # Scratch builds with a deliberate bug (scripts/longctx_broken.sh): each must fail.
      for b in .device/bin/test-cuda-broken-*; do
        [ -e "$b" ] || continue
        name=${b##*/test-cuda-broken-}
        if KESTREL_LONGCTX_DIR=/tmp/longctx "$b" longctx --include-ignored --nocapture \
          > "$OUT/longctx-broken-$name.log" 2>&1; then
          echo "broken build '$name' PASSED the long-context check: the check is blind to it" | tee -a "$OUT/longctx.log"
          status=1
        elif grep -q "long-context check failed" "$OUT/longctx-broken-$name.log"; then
          echo "broken build '$name' failed the long-context check, as it must:" | tee -a "$OUT/longctx.log"
          sed -n '/long-context check failed/,/^note:\|^stack/p' "$OUT/longctx-broken-$name.log" | head -20 | tee -a "$OUT/longctx.log"
        else
          echo "broken build '$name' failed for another reason (see longctx-broken-$name.log)" | tee -a "$OUT/longctx.log"
          status=1
        fi
      done ;;
    hf-fp8)
      # the Triton kernel transformers loads from the Hub, copied here (no network there):
      # .device/hfk/finegrained_fp8 (scripts/stage_hf_fp8_kernel.sh writes it)
      kernel=""
      [ -d .device/hfk/finegrained_fp8 ] && kernel="--kernel .device/hfk"
      python3 scripts/hf_fp8_gpu_reference.py --out "$OUT/hf-fp8" $kernel 2>&1 | tee "$OUT/hf-fp8.log" || status=1 ;;
    peer)
      python3 scripts/hf_peer_bench.py --out "$OUT/hf_peer.json" 2>&1 | tee "$OUT/hf_peer.log" || status=1 ;;
    *) echo "unknown step $1"; status=1 ;;
  esac
  shift
  pack
done
exit $status
