#!/bin/sh
# The engines' preStop: drain this pod's engines, so that no pd-proxy sends them a new request,
# and wait (at most 25 s) until no proxy has one in flight on them. PD_PROXY_URL names every
# proxy replica (a headless Service: each address is asked). The kubelet sends SIGTERM when this
# returns, whatever its exit status.
#
# DRAIN_AT=registry (prefills): marked in their registry, which every pd-proxy follows. The
# engines are those registered from this pod's address, whatever their engine ids (vLLM's data
# parallelism gives each dp rank its own). The registry is the pod's bootstrap-server sidecar
# unless PD_BOOTSTRAP_URL names another (with PD_BOOTSTRAP_TOKEN, when it wants one).
# DRAIN_AT=proxies (decodes, and engines in no registry): marked at each proxy, as the backend
# it found at this pod's address.
case "$VLLM_HOST_IP" in
  *:*) host="[$VLLM_HOST_IP]" ;;
  *) host="$VLLM_HOST_IP" ;;
esac
if [ "${DRAIN_AT:-registry}" = proxies ]; then
  set -- --backend "http://$host:8000"
else
  set -- --engine-host "$VLLM_HOST_IP"
fi
exec /pd-bin/worker-client drain "$@" --wait-idle "$PD_PROXY_URL" \
  --admin-key "$PD_PROXY_ADMIN_KEY" --idle-timeout 25
