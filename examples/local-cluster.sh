#!/usr/bin/env bash
# Builds the workspace binaries and runs a local P/D cluster on 127.0.0.1: two bootstrap
# servers, two simulated prefill engines (dp=2,tp=2 and dp=1,tp=2), two simulated decode
# engines and the proxy on port 8000. Sends a few requests, then runs until Ctrl-C.
# Flags go to pd-cluster (see --help), e.g. --once to exit after the requests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
exec target/release/pd-cluster "$@"
