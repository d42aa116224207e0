#!/usr/bin/env bash
# Runs the whole benchmark suite with one command: builds the release binaries (with UCX),
# installs the peer routers (vllm-router, smg; benchmark-only) into target/bench-venv and SGLang
# (for its own bootstrap server; several GB) into target/bench-sglang-venv, runs every
# scenario and writes the Markdown report to target/bench/results.md (docs/performance.md keeps
# the latest). When the `etcd` binary is installed, the bootstrap scenarios run once more on the
# etcd backend, against a throwaway local etcd (target/bench/results-etcd.md).
# Extra flags go to pd-bench, e.g. --seconds 10. Run it on a quiet machine: the load generator,
# the mocks and the system under test share its cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --bins --all-features
VENV="${VENV:-target/bench-venv}"
VENV="$VENV" examples/bench/peers.sh
SGLANG_VENV="${SGLANG_VENV:-target/bench-sglang-venv}"
SGLANG_VENV="$SGLANG_VENV" examples/bench/sglang-peer.sh
mkdir -p target/bench
target/release/pd-bench --peers-venv "$VENV" --sglang-venv "$SGLANG_VENV" \
  --out target/bench/results.md "$@" all

if command -v etcd >/dev/null; then
  dir=$(mktemp -d -p target/bench etcd.XXXXXX)
  client=$((20000 + $$ % 20000))
  peer=$((client + 1))
  etcd --data-dir "$dir/data" --listen-client-urls "http://127.0.0.1:$client" \
    --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "default=http://127.0.0.1:$peer" >"$dir/etcd.log" 2>&1 &
  etcd_pid=$!
  trap 'kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$client") 2>/dev/null && break
    sleep 0.1
  done
  target/release/pd-bench --store "etcd://127.0.0.1:$client" --out target/bench/results-etcd.md \
    "$@" bootstrap
fi
