#!/bin/sh
# The engines' preStop: mark this pod's engines draining in their registry, so that no pd-proxy
# sends them a new request (every pd-proxy follows the registry's watch), and wait (at most
# 25 s) until the proxy has none in flight on them. The engines are those registered from this
# pod's address, whatever their engine ids (vLLM's data parallelism gives each dp rank its
# own). The registry is the pod's bootstrap-server sidecar unless PD_BOOTSTRAP_URL names
# another (with PD_BOOTSTRAP_TOKEN, when it wants one). The kubelet sends SIGTERM when this
# returns, whatever its exit status.
exec /pd-bin/worker-client drain --engine-host "$VLLM_HOST_IP" --wait-idle "$PD_PROXY_URL" \
  --admin-key "$PD_PROXY_ADMIN_KEY" --idle-timeout 25
