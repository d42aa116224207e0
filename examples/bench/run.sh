#!/usr/bin/env bash
# Runs the whole benchmark suite with one command: builds the release binaries (with UCX),
# installs the peer routers (vllm-router, smg; benchmark-only) into target/bench-venv, runs every
# scenario and writes the Markdown report to target/bench/results.md (docs/performance.md keeps
# the latest).
# Extra flags go to pd-bench, e.g. --seconds 10. Run it on a quiet machine: the load generator,
# the mocks and the system under test share its cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --bins --all-features
VENV="${VENV:-target/bench-venv}"
VENV="$VENV" examples/bench/peers.sh
mkdir -p target/bench
exec target/release/pd-bench --peers-venv "$VENV" --out target/bench/results.md "$@" all
