#!/usr/bin/env bash
# N `kestrel serve` replicas on consecutive ports and vllm-router (cache-aware policy) in
# front of them, in the foreground. SIGTERM or Ctrl-C drains the replicas (each finishes the
# requests it has), then stops the router. See deploy/README.md.
#
#   deploy/replicas.sh [--replicas N] [--port PORT] [--base-port PORT] [--host ADDR]
#                      [--device cpu|cuda] [--run-dir DIR] [-- KESTREL_SERVE_ARGS...]
#
# Replica i (0-based) listens on BASE_PORT + i (default PORT + 1 + i) and, with --device
# cuda, runs on `--gpu i`. The router listens on HOST:PORT (default 127.0.0.1:8000).
# Environment: KESTREL (the binary; default `kestrel` on PATH, else ./target/release/kestrel),
# VLLM_ROUTER (the router command; default `vllm-router`; may be a command with arguments,
# e.g. "python3 -m vllm_router.launch_router"), ROUTER_ARGS (more router flags),
# ROUTER_METRICS_PORT (the router's own Prometheus port, default 29000).
# The run dir (default ./kestrel-replicas) gets each process's log and pid file; once all
# are up the script prints "ready: http://HOST:PORT" on stdout.
set -euo pipefail

replicas=2
port=8000
base_port=
host=127.0.0.1
device=cpu
run_dir=./kestrel-replicas
while [ $# -gt 0 ]; do
  case "$1" in
    --replicas) replicas=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --base-port) base_port=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "replicas.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
base_port=${base_port:-$((port + 1))}
case "$device" in cpu|cuda) ;; *) echo "replicas.sh: --device is cpu or cuda" >&2; exit 2 ;; esac

if [ -z "${KESTREL:-}" ]; then
  if command -v kestrel >/dev/null; then KESTREL=kestrel
  elif [ -x ./target/release/kestrel ]; then KESTREL=./target/release/kestrel
  else echo "replicas.sh: no kestrel binary: set KESTREL or put kestrel on PATH" >&2; exit 1
  fi
fi
read -r -a router_cmd <<< "${VLLM_ROUTER:-vllm-router}"
if ! command -v "${router_cmd[0]}" >/dev/null; then
  echo "replicas.sh: no ${router_cmd[0]}: pip install vllm-router (or set VLLM_ROUTER)" >&2
  exit 1
fi
mkdir -p "$run_dir"

# 0 when GET http://HOST:PORT/PATH answers 200 (bash's /dev/tcp: no curl needed).
http_ok() {
  (exec 3<>"/dev/tcp/$1/$2" || exit 1
   printf 'GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' "$3" "$1" >&3
   read -r _ code _ <&3
   [ "$code" = 200 ]) 2>/dev/null
}

pids=()
router_pid=
stop() {
  trap '' INT TERM
  echo "replicas.sh: draining the replicas" >&2
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ -n "$router_pid" ]; then kill -TERM "$router_pid" 2>/dev/null || true; wait "$router_pid" 2>/dev/null || true; fi
  echo "replicas.sh: stopped" >&2
  exit 0
}
trap stop INT TERM

urls=()
for ((i = 0; i < replicas; i++)); do
  p=$((base_port + i))
  gpu=()
  [ "$device" = cuda ] && gpu=(--gpu "$i")
  "$KESTREL" serve --bind "$host:$p" --device "$device" "${gpu[@]}" "$@" \
    > "$run_dir/replica-$i.log" 2>&1 &
  pids+=($!)
  echo $! > "$run_dir/replica-$i.pid"
  urls+=("http://$host:$p")
done

# Each replica's readiness (GET /health is 200 once its weights are loaded).
for ((i = 0; i < replicas; i++)); do
  until http_ok "$host" "$((base_port + i))" /health; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      echo "replicas.sh: replica $i exited; its log:" >&2
      tail -n 20 "$run_dir/replica-$i.log" >&2
      stop
    fi
    sleep 0.2
  done
done

# The router: cache-aware routing (a request goes to the replica whose past requests share
# the longest prefix with it, unless the load is out of balance); health checked every
# second, one failed check takes a replica out (a draining replica answers 503) and one
# success brings it back; a request that fails before any byte reached the client (connection
# refused or reset, 503 from a draining replica) is retried, with backoff, for ~5 s.
# shellcheck disable=SC2086
"${router_cmd[@]}" --host "$host" --port "$port" --worker-urls "${urls[@]}" \
  --policy cache_aware \
  --health-check-interval-secs 1 --health-failure-threshold 1 --health-success-threshold 1 \
  --worker-startup-check-interval 1 \
  --retry-max-retries 8 --retry-initial-backoff-ms 100 --retry-max-backoff-ms 1000 \
  --prometheus-host 127.0.0.1 --prometheus-port "${ROUTER_METRICS_PORT:-29000}" \
  ${ROUTER_ARGS:-} > "$run_dir/router.log" 2>&1 &
router_pid=$!
echo "$router_pid" > "$run_dir/router.pid"
until http_ok "$host" "$port" /v1/models; do
  if ! kill -0 "$router_pid" 2>/dev/null; then
    echo "replicas.sh: the router exited; its log:" >&2
    tail -n 20 "$run_dir/router.log" >&2
    stop
  fi
  sleep 0.2
done
echo "ready: http://$host:$port (replicas: ${urls[*]})"

# Until a signal, or until every replica has exited.
while :; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 1 ] || { echo "replicas.sh: every replica has exited" >&2; stop; }
  sleep 1 &
  wait $! || true
done
