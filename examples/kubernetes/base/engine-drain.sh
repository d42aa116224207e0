#!/bin/sh
# The engines' preStop: mark this engine draining in the registry, so that every pd-proxy sends
# it no new request, and wait (at most 25 s) until the proxy has none in flight on it. The
# kubelet sends SIGTERM when this returns, whatever its exit status.
id=$(cat /tmp/engine-id 2>/dev/null || echo "$POD_NAME")
exec /pd-bin/worker-client drain "$id" --url "$PD_BOOTSTRAP_URL" --wait-idle "$PD_PROXY_URL" \
  --admin-key "$PD_PROXY_ADMIN_KEY" --idle-timeout 25
