#!/usr/bin/env bash
# Installs the two peer P/D routers that pd-proxy is benchmarked against, from PyPI, into a
# virtualenv ("${VENV:-target/bench-venv}", relative to the repository root), and prints the paths
# of their entry points. Both wheels ship their router as a native Rust extension (abi3 .so); the
# entry points are thin Python launchers. Re-running is a no-op once the pinned versions are in.
#
# How to run each in P/D mode against one prefill (http://127.0.0.1:PPORT, Mooncake bootstrap
# server on BPORT) and one decode (http://127.0.0.1:DPORT), listening on 127.0.0.1:PORT
# (MPORT: a free port for its Prometheus listener, which both always open):
#
#   vllm-router (vLLM Mooncake: P gets max_tokens=1 + kv_transfer_params{do_remote_decode,
#   transfer_id}; D, only after P answered, gets kv_transfer_params{do_remote_prefill, transfer_id,
#   remote_engine_id, remote_bootstrap_addr}; engine ids from GET http://127.0.0.1:BPORT/query at
#   start-up, so the bootstrap server must be up; the port opens only once P and D answer GET
#   /health, so GET /health == 200 means ready):
#     $VENV/bin/vllm-router --host 127.0.0.1 --port PORT \
#       --vllm-pd-disaggregation --kv-connector mooncake \
#       --prefill http://127.0.0.1:PPORT BPORT --decode http://127.0.0.1:DPORT \
#       --policy round_robin --log-level error --prometheus-port MPORT \
#       --worker-startup-check-interval 1
#
#   smg, SGLang wire format (P and D at once, both get bootstrap_host/bootstrap_port/bootstrap_room;
#   only for backends smg does not detect as vLLM: to vLLM-looking ones, see below, this command
#   sends P max_tokens=1 then D, with no KV params at all; ready when GET /readiness == 200,
#   /health answers 200 before the workers are registered):
#     $VENV/bin/smg launch --host 127.0.0.1 --port PORT --pd-disaggregation \
#       --prefill http://127.0.0.1:PPORT BPORT --decode http://127.0.0.1:DPORT \
#       --policy round_robin --prometheus-host 127.0.0.1 --prometheus-port MPORT \
#       --log-level warn --shutdown-grace-period-secs 0
#
#   smg, vLLM Mooncake (the same kv_transfer_params as vllm-router, D also after P): the connector
#   and P's engine id (ENGINE_ID, from GET http://127.0.0.1:BPORT/query) come only from a discovery
#   manifest, and the backends must look like vLLM (GET /v1/models answers owned_by "vllm"):
#     echo '{"version": 1, "workers": [
#       {"url": "http://127.0.0.1:PPORT", "worker_type": "prefill", "bootstrap_port": BPORT,
#        "kv_connector": "MooncakeConnector", "kv_engine_id": "ENGINE_ID"},
#       {"url": "http://127.0.0.1:DPORT", "worker_type": "decode"}]}' > MANIFEST
#     $VENV/bin/smg launch --host 127.0.0.1 --port PORT --pd-disaggregation \
#       --discovery-provider file --discovery-file MANIFEST \
#       --policy round_robin --prometheus-host 127.0.0.1 --prometheus-port MPORT \
#       --log-level warn --shutdown-grace-period-secs 0
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV="${VENV:-target/bench-venv}"
VLLM_ROUTER_VERSION=0.1.17
SMG_VERSION=1.13.0

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" - "$VLLM_ROUTER_VERSION" "$SMG_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
sys.exit(version("vllm-router") != sys.argv[1] or version("smg") != sys.argv[2])
PY
then
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "vllm-router==$VLLM_ROUTER_VERSION" "smg==$SMG_VERSION"
fi

echo "vllm-router: $(realpath "$VENV/bin/vllm-router")"
echo "smg: $(realpath "$VENV/bin/smg")"
