#!/bin/sh
# Starts an engine (the arguments) under a fresh engine id: the pod's name and a random suffix.
# Fresh at every start, so a restarted container is a new engine to D (vLLM's D keeps each
# engine id's addresses for its lifetime); written down for the preStop drain (engine-drain.sh).
# KV_TRANSFER_CONFIG, when set, is the connector's JSON with %s where the engine id goes.
set -eu
id="$POD_NAME-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
echo "$id" > /tmp/engine-id
if [ -n "${KV_TRANSFER_CONFIG:-}" ]; then
  exec "$@" --kv-transfer-config "$(printf "$KV_TRANSFER_CONFIG" "$id")"
fi
exec "$@"
