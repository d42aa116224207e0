#!/usr/bin/env bash
# Builds the workspace binaries and runs a local P/D cluster on 127.0.0.1: two bootstrap
# servers, two simulated prefill engines (dp=2,tp=2 and dp=1,tp=2), two simulated decode
# engines and the proxy on port 8000. Sends a few requests, then runs until Ctrl-C.
# Flags go to pd-cluster (see --help), e.g. --once to exit after the requests, or
# --transfer ucx to move the KV over UCX (built with --features ucx; needs libucx-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
previous=""
for arg in "$@"; do
  if [[ "$arg" == "--transfer=ucx" || ("$previous" == "--transfer" && "$arg" == "ucx") ]]; then
    features=(--features ucx)
  fi
  previous="$arg"
done
cargo build --release --bins "${features[@]}"
exec target/release/pd-cluster "$@"
