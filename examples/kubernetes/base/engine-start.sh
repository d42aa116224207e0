#!/bin/sh
# Starts an engine (the arguments) under a fresh engine id: the pod's name and a random suffix.
# Fresh at every start, so a restarted container is a new engine to D (vLLM's D keeps each
# engine id's addresses for its lifetime).
# KV_TRANSFER_CONFIG, when set, is the connector's JSON with %s where the engine id goes.
# ENGINE_ARGS, when set, are more arguments, split at spaces (an overlay's: data parallelism
# over several pods).
set -eu
id="$POD_NAME-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
# shellcheck disable=SC2086 # split on purpose
set -- "$@" ${ENGINE_ARGS:-}
if [ -n "${KV_TRANSFER_CONFIG:-}" ]; then
  exec "$@" --kv-transfer-config "$(printf "$KV_TRANSFER_CONFIG" "$id")"
fi
exec "$@"
