#!/bin/sh
# The engines' preStop: mark this engine draining in its pod's registry (a prefill's
# bootstrap-server sidecar, which every pd-proxy follows), so that no pd-proxy sends it a new
# request, and wait (at most 25 s) until the proxy has none in flight on it. The kubelet sends
# SIGTERM when this returns, whatever its exit status.
id=$(cat /tmp/engine-id 2>/dev/null || echo "$POD_NAME")
exec /pd-bin/worker-client drain "$id" --url http://127.0.0.1:8998 --wait-idle "$PD_PROXY_URL" \
  --admin-key "$PD_PROXY_ADMIN_KEY" --idle-timeout 25
